//! Request bodies too large for memory are spooled to a nameless file before a target is
//! picked (issue 31, item 3): slow uploaders hold no upstream connection, the body goes up
//! whole with a Content-Length, a retry sends it again, and the per-request limit and the disk
//! budget answer 413. Through real sockets, with an origin that checks every byte.

use crate::common;
use common::*;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the origin received of one request.
#[derive(Debug, Clone)]
struct Received {
    method: String,
    length: u64,
    sha256: String,
    content_length: Option<String>,
}

/// An HTTP/1.1 origin that reads every body whole, hashing it, and counts its connections.
/// With `answer` false it reads the request and closes the connection without answering.
struct Origin {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicU64>,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Origin {
    async fn start(answer: bool) -> Origin {
        let received = Arc::new(Mutex::new(Vec::new()));
        let seen = received.clone();
        let (addr, connections) = counting_origin(move |stream| {
            let seen = seen.clone();
            async move {
                let service = service_fn(move |request: hyper::Request<hyper::body::Incoming>| {
                    let seen = seen.clone();
                    async move {
                        let method = request.method().to_string();
                        let content_length = request
                            .headers()
                            .get("content-length")
                            .map(|value| value.to_str().unwrap().to_owned());
                        let mut hasher = Sha256::new();
                        let mut length = 0u64;
                        let mut body = request.into_body();
                        while let Some(frame) = body.frame().await {
                            if let Some(data) = frame.expect("a whole body").data_ref() {
                                hasher.update(data);
                                length += data.len() as u64;
                            }
                        }
                        seen.lock().unwrap().push(Received {
                            method,
                            length,
                            sha256: hex::encode(hasher.finalize()),
                            content_length,
                        });
                        if !answer {
                            return Err("closing without an answer");
                        }
                        Ok::<_, &str>(hyper::Response::new(Full::new(Bytes::from_static(
                            b"stored",
                        ))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            }
        })
        .await;
        Origin {
            addr,
            connections,
            received,
        }
    }

    fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    fn target(&self) -> serde_json::Value {
        serde_json::json!({"host": "127.0.0.1", "port": self.addr.port(), "weight": 1})
    }
}

/// `length` bytes of a pattern that a shifted or repeated piece would not reproduce.
fn pattern(length: usize) -> Vec<u8> {
    (0..length).map(|i| ((i * 31 + 7) % 251) as u8).collect()
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A gateway whose spool files go to a directory of the test's own, routing everything to
/// `targets`.
async fn gateway_spooling(
    overrides: &[(&str, &str)],
    targets: &[serde_json::Value],
) -> (TestGateway, PathBuf) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let spool = dir.path().join("spool");
    std::fs::create_dir(&spool).unwrap();
    let spool_setting = spool.display().to_string();
    let mut settings = vec![("RAAHI_PROXY_REQUEST_SPOOL_DIR", spool_setting.as_str())];
    settings.extend_from_slice(overrides);
    let config = test_config_with(dir.path(), &settings);
    let gateway = TestGateway::start_with(dir, config).await;
    let service = gateway.service_with_targets("spooled", targets).await;
    gateway.route_all_to(service).await;
    (gateway, spool)
}

/// This process's open files in `dir`: the spool files (their names say they have none).
fn open_files_in(dir: &Path) -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|entry| std::fs::read_link(entry.ok()?.path()).ok())
        .map(|link| link.display().to_string())
        .filter(|link| link.starts_with(&dir.display().to_string()))
        .collect()
}

/// Sends a request head declaring `length` bytes and the body's first `sent` bytes.
async fn start_upload(gateway: &TestGateway, method: &str, body: &[u8], sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    let head = format!(
        "{method} /upload HTTP/1.1\r\nHost: a.test\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&body[..sent]).await.unwrap();
    stream
}

/// Reads an answer until the gateway closes the connection or 10 s pass.
async fn read_answer(stream: &mut TcpStream) -> String {
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

/// The case, scaled down: uploaders declaring more than the route's
/// `request_buffer_bytes` (1 MiB) and sending slowly hold spool files, not upstream
/// connections; a finished one goes up whole, once, with its Content-Length.
#[tokio::test]
async fn slow_uploads_larger_than_memory_spool_and_hold_no_upstream_connection() {
    let origin = Origin::start(true).await;
    let (gateway, spool) = gateway_spooling(&[], &[origin.target()]).await;
    let body = pattern(2_000_000);
    let mut uploaders = Vec::new();
    for _ in 0..30 {
        uploaders.push(start_upload(&gateway, "POST", &body, 1_000).await);
    }
    wait_until("30 bodies spooled", Duration::from_secs(10), || async {
        gateway.metric("raahi_requests_spooled_total").await == 30
    })
    .await;
    holds_for(
        "no upstream connection while the bodies are incomplete",
        Duration::from_millis(300),
        || async { origin.connections() == 0 },
    )
    .await;
    assert_eq!(
        std::fs::read_dir(&spool).unwrap().count(),
        0,
        "spool files have no name"
    );
    let files = open_files_in(&spool);
    assert_eq!(files.len(), 30, "{files:?}");
    assert!(
        files.iter().all(|file| file.ends_with("(deleted)")),
        "{files:?}"
    );
    wait_until(
        "every byte sent so far taken",
        Duration::from_secs(10),
        || async { gateway.metric("raahi_request_spool_bytes").await == 30 * 1_000 },
    )
    .await;

    let mut finished = uploaders.pop().unwrap();
    finished.write_all(&body[1_000..]).await.unwrap();
    let (head, _) = read_head(&mut finished).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let received = origin.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].length, 2_000_000);
    assert_eq!(received[0].sha256, sha256(&body));
    assert_eq!(received[0].content_length.as_deref(), Some("2000000"));
    assert_eq!(origin.connections(), 1);

    drop(uploaders);
    wait_until(
        "the spool files closed and their bytes given back",
        Duration::from_secs(10),
        || async {
            open_files_in(&spool).is_empty()
                && gateway.metric("raahi_request_spool_bytes").await == 0
        },
    )
    .await;
}

/// A spooled body can be sent again: a target that takes the body and closes without an
/// answer fails an idempotent request over to another target, which gets every byte.
#[tokio::test]
async fn a_spooled_body_goes_whole_to_another_target_on_a_retry() {
    let dropper = Origin::start(false).await;
    let keeper = Origin::start(true).await;
    let (gateway, _spool) = gateway_spooling(&[], &[dropper.target(), keeper.target()]).await;
    let body = pattern(1_500_000);
    for _ in 0..4 {
        let response = gateway
            .http
            .put(gateway.proxy_url("/upload"))
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "stored");
    }
    let kept = keeper.received();
    assert_eq!(kept.len(), 4);
    assert!(kept
        .iter()
        .all(|received| received.method == "PUT" && received.sha256 == sha256(&body)));
    let dropped = dropper.received();
    assert!(
        !dropped.is_empty(),
        "round robin sent some first to the dropper"
    );
    assert!(dropped
        .iter()
        .all(|received| received.sha256 == sha256(&body)));
    assert_eq!(gateway.metric("raahi_requests_spooled_total").await, 4);
}

/// `proxy.request_spool_bytes` bounds one body (413 at once from the Content-Length, or as
/// a chunked body grows past it) and `proxy.request_spool_budget_bytes` all of them.
#[tokio::test]
async fn past_the_spool_limit_or_the_disk_budget_a_body_gets_413() {
    let origin = Origin::start(true).await;
    let (gateway, _spool) = gateway_spooling(
        &[
            ("RAAHI_PROXY_REQUEST_SPOOL_BYTES", "1500000"),
            ("RAAHI_PROXY_REQUEST_SPOOL_BUDGET_BYTES", "2500000"),
        ],
        &[origin.target()],
    )
    .await;
    let declared = raw_http(
        gateway.proxy,
        "POST /big HTTP/1.1\r\nHost: a.test\r\nContent-Length: 1500001\r\n\r\n",
    )
    .await;
    assert!(declared.starts_with("HTTP/1.1 413"), "{declared}");
    assert!(declared.contains("request_body_too_large"), "{declared}");
    assert!(declared.contains("holds for one request"), "{declared}");

    let mut chunked = TcpStream::connect(gateway.proxy).await.unwrap();
    chunked
        .write_all(b"POST /big HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    let piece = pattern(100_000);
    for _ in 0..16 {
        chunked.write_all(b"186a0\r\n").await.unwrap();
        chunked.write_all(&piece).await.unwrap();
        chunked.write_all(b"\r\n").await.unwrap();
    }
    let _ = chunked.write_all(b"0\r\n\r\n").await;
    let answer = read_answer(&mut chunked).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");

    // One body holds 1.3 MB of the 2.5 MB budget: another declaring 1.4 MB does not fit now.
    let held_body = pattern(1_400_000);
    let mut held = start_upload(&gateway, "POST", &held_body, 1_300_000).await;
    wait_until("1.3 MB spooled", Duration::from_secs(10), || async {
        gateway.metric("raahi_request_spool_bytes").await == 1_300_000
    })
    .await;
    let refused = raw_http(
        gateway.proxy,
        "POST /big HTTP/1.1\r\nHost: a.test\r\nContent-Length: 1400000\r\n\r\n",
    )
    .await;
    assert!(refused.starts_with("HTTP/1.1 413"), "{refused}");
    assert!(refused.contains("spool is full"), "{refused}");
    assert_eq!(
        origin.connections(),
        0,
        "nothing refused reached the origin"
    );

    held.write_all(&held_body[1_300_000..]).await.unwrap();
    let (head, _) = read_head(&mut held).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(origin.received()[0].sha256, sha256(&held_body));
    assert_eq!(
        gateway
            .metric("raahi_requests_refused_total{code=\"request_body_too_large\"}")
            .await,
        3
    );
}

/// A spooled body may take longer than `client_body_timeout_ms` while it keeps coming (disk
/// is what it costs, not memory), but not pause for that long.
#[tokio::test]
async fn a_spooled_upload_may_take_long_but_not_pause_long() {
    let origin = Origin::start(true).await;
    let (gateway, _spool) = gateway_spooling(
        &[("RAAHI_PROXY_CLIENT_BODY_TIMEOUT_MS", "800")],
        &[origin.target()],
    )
    .await;
    let body = pattern(1_100_000);
    let started = Instant::now();
    let mut steady = start_upload(&gateway, "POST", &body, 1_000).await;
    let mut sent = 1_000;
    // A piece every 100 ms for 1.5 s: slow, never paused.
    while started.elapsed() < Duration::from_millis(1_500) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        steady.write_all(&body[sent..sent + 1_000]).await.unwrap();
        sent += 1_000;
    }
    steady.write_all(&body[sent..]).await.unwrap();
    let (head, _) = read_head(&mut steady).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(origin.received()[0].sha256, sha256(&body));

    let paused_at = Instant::now();
    let mut paused = start_upload(&gateway, "POST", &body, 1_000).await;
    let answer = read_answer(&mut paused).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("client_body_timeout"), "{answer}");
    assert!(paused_at.elapsed() >= Duration::from_millis(800));
    assert_eq!(origin.received().len(), 1, "the paused body never went up");
}

/// Past the memory budget a body spools rather than streaming: still no upstream connection
/// until it is whole.
#[tokio::test]
async fn past_the_memory_budget_a_body_spools() {
    let origin = Origin::start(true).await;
    let (gateway, _spool) = gateway_spooling(
        &[("RAAHI_PROXY_REQUEST_BUFFER_BUDGET_BYTES", "1000")],
        &[origin.target()],
    )
    .await;
    let body = pattern(5_000);
    let mut upload = start_upload(&gateway, "POST", &body, 2_000).await;
    wait_until("the body spooled", Duration::from_secs(10), || async {
        gateway.metric("raahi_requests_spooled_total").await == 1
    })
    .await;
    holds_for(
        "no upstream connection before the body is whole",
        Duration::from_millis(200),
        || async { origin.connections() == 0 },
    )
    .await;
    upload.write_all(&body[2_000..]).await.unwrap();
    let (head, _) = read_head(&mut upload).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(origin.received()[0].sha256, sha256(&body));
    wait_until("the memory given back", Duration::from_secs(5), || async {
        gateway.metric("raahi_request_body_memory_bytes").await == 0
    })
    .await;
}

/// HTTP/2 clients' bodies spool the same way and reach an HTTP/1.1 target with a length.
#[tokio::test]
async fn an_http2_upload_spools_too() {
    let origin = Origin::start(true).await;
    let (gateway, _spool) = gateway_spooling(&[], &[origin.target()]).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let body = pattern(1_500_000);
    let response = client
        .post(gateway.proxy_url("/upload"))
        .body(body.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    let received = origin.received();
    assert_eq!(received[0].sha256, sha256(&body));
    assert_eq!(received[0].content_length.as_deref(), Some("1500000"));
    assert_eq!(gateway.metric("raahi_requests_spooled_total").await, 1);
}

/// A spool directory the gateway cannot write stops the start, naming the key.
#[tokio::test]
async fn an_unusable_spool_directory_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir").display().to_string();
    let config = test_config_with(
        dir.path(),
        &[("RAAHI_PROXY_REQUEST_SPOOL_DIR", missing.as_str())],
    );
    let error = match raahi::gateway::Gateway::start(&config).await {
        Ok(_) => panic!("started with a missing spool directory"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("proxy.request_spool_dir"), "{error}");
    assert!(error.contains(&missing), "{error}");
}
