//! `h2c` services (HTTP/2 with prior knowledge to the target) through real sockets, with a
//! hyper HTTP/2 origin: what reaches the target, trailers both ways, HTTP/1.1 and HTTP/2
//! clients, upgrades refused, the multiplexed pool seen from the metrics.

use crate::common;
use common::*;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const STEP: Duration = Duration::from_secs(10);

/// What the origin saw of the last request.
#[derive(Debug, Clone, Default)]
struct Seen {
    version: String,
    authority: String,
    path: String,
    body: Vec<u8>,
    trailer: Option<String>,
}

struct H2Origin {
    addr: SocketAddr,
    connections: Arc<AtomicU64>,
    seen: Arc<Mutex<Seen>>,
}

/// An HTTP/2-only origin (prior knowledge): it answers with the request body's length, and
/// with a `x-origin-trailer` trailer.
async fn h2_origin() -> H2Origin {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let (counter, record) = (connections.clone(), seen.clone());
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            counter.fetch_add(1, Ordering::SeqCst);
            let record = record.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |request: Request<Incoming>| {
                    let record = record.clone();
                    async move { Ok::<_, Infallible>(answer(request, record).await) }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    });
    H2Origin {
        addr,
        connections,
        seen,
    }
}

type OriginBody =
    StreamBody<futures_util::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>>;

async fn answer(request: Request<Incoming>, record: Arc<Mutex<Seen>>) -> Response<OriginBody> {
    let (parts, body) = request.into_parts();
    let collected = body.collect().await.unwrap();
    let trailer = collected
        .trailers()
        .and_then(|trailers| trailers.get("x-client-trailer"))
        .map(|value| value.to_str().unwrap().to_owned());
    let body = collected.to_bytes().to_vec();
    let length = body.len();
    *record.lock().unwrap() = Seen {
        version: format!("{:?}", parts.version),
        authority: parts
            .uri
            .authority()
            .map(|authority| authority.to_string())
            .unwrap_or_default(),
        path: parts.uri.path().to_owned(),
        body,
        trailer,
    };
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-origin-trailer", "done".parse().unwrap());
    let frames = vec![
        Ok(Frame::data(Bytes::from(format!("got {length}")))),
        Ok(Frame::trailers(trailers)),
    ];
    Response::builder()
        .header("content-type", "text/plain")
        .header("trailer", "x-origin-trailer")
        .body(StreamBody::new(futures_util::stream::iter(frames)))
        .unwrap()
}

async fn h2c_service(gateway: &TestGateway, origin: &H2Origin, extra: serde_json::Value) -> i64 {
    let mut body = json!({"name": "h2", "protocol": "h2c"});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let service = gateway.create("/api/v1/services", body).await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": origin.addr.port()}),
        )
        .await;
    service
}

/// An HTTP/2 client with prior knowledge on the gateway's plain listener.
async fn h2_client(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let (sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    sender
}

#[tokio::test]
async fn an_http2_client_reaches_an_h2c_target_with_trailers_both_ways() {
    let gateway = TestGateway::start().await;
    let origin = h2_origin().await;
    let service = h2c_service(
        &gateway,
        &origin,
        json!({"upstream_authority": "api.internal"}),
    )
    .await;
    gateway.route_all_streaming_to(service).await;
    let mut client = h2_client(gateway.proxy).await;
    // A body with a trailer, through hyper's client.
    let mut trailers = http::HeaderMap::new();
    trailers.insert("x-client-trailer", "sent".parse().unwrap());
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
        Ok(Frame::data(Bytes::from_static(b"hello"))),
        Ok(Frame::trailers(trailers)),
    ];
    let mut sender = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        TokioIo::new(TcpStream::connect(gateway.proxy).await.unwrap()),
    )
    .await
    .map(|(sender, connection)| {
        tokio::spawn(connection);
        sender
    })
    .unwrap();
    let request = Request::post("http://shop.test/api/items")
        .body(StreamBody::new(futures_util::stream::iter(frames)))
        .unwrap();
    let response = tokio::time::timeout(STEP, sender.send_request(request))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    let collected = response.into_body().collect().await.unwrap();
    assert_eq!(
        collected.trailers().unwrap()["x-origin-trailer"],
        "done",
        "the target's trailers reach an HTTP/2 client"
    );
    assert_eq!(collected.to_bytes(), "got 5");
    let seen = origin.seen.lock().unwrap().clone();
    assert_eq!(seen.version, "HTTP/2.0");
    assert_eq!(
        seen.authority, "api.internal",
        "upstream_authority as :authority"
    );
    assert_eq!(seen.path, "/api/items");
    assert_eq!(
        seen.trailer.as_deref(),
        Some("sent"),
        "the client's trailers reach the target"
    );
    // A plain request on the first client works too.
    let response = client
        .send_request(
            Request::get("http://shop.test/")
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        origin.connections.load(Ordering::SeqCst),
        1,
        "one multiplexed connection"
    );
}

/// An HTTP/1.1 client that says it takes trailers gets them, chunked; the target got HTTP/2.
#[tokio::test]
async fn an_http1_client_reaches_an_h2c_target_and_gets_trailers_when_it_asks() {
    let gateway = TestGateway::start().await;
    let origin = h2_origin().await;
    let service = h2c_service(&gateway, &origin, json!({})).await;
    gateway.route_all_to(service).await;
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    stream
        .write_all(
            b"POST /echo HTTP/1.1\r\nHost: shop.test\r\nTE: trailers\r\nContent-Length: 3\r\n\r\nabc",
        )
        .await
        .unwrap();
    let wire = read_until(&mut stream, b"\r\n0\r\n").await;
    let rest = read_until(&mut stream, b"\r\n\r\n").await;
    let all = format!("{wire}{rest}");
    assert!(all.starts_with("HTTP/1.1 200"), "{all}");
    assert!(
        all.to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "{all}"
    );
    assert!(all.contains("got 3"), "{all}");
    assert!(
        all.to_ascii_lowercase().contains("x-origin-trailer: done"),
        "trailers after the last chunk: {all}"
    );
    let seen = origin.seen.lock().unwrap().clone();
    assert_eq!(seen.version, "HTTP/2.0");
    assert_eq!(
        seen.authority,
        format!("127.0.0.1:{}", origin.addr.port()),
        "no upstream_authority: the target's address"
    );
    assert_eq!(seen.body, b"abc");
}

async fn read_until(stream: &mut TcpStream, end: &[u8]) -> String {
    let mut wire = Vec::new();
    let mut byte = [0u8; 1];
    tokio::time::timeout(STEP, async {
        while !wire.ends_with(end) {
            if stream.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            wire.push(byte[0]);
        }
    })
    .await
    .expect("the answer came");
    String::from_utf8_lossy(&wire).into_owned()
}

#[tokio::test]
async fn an_upgrade_to_an_h2c_service_is_answered_501() {
    let gateway = TestGateway::start().await;
    let origin = h2_origin().await;
    let service = h2c_service(&gateway, &origin, json!({})).await;
    gateway.route_all_to(service).await;
    let answer = raw_http(
        gateway.proxy,
        "GET /ws HTTP/1.1\r\nHost: shop.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 501"), "{answer}");
    assert!(answer.contains("upgrade_not_supported"), "{answer}");
    assert_eq!(
        origin.connections.load(Ordering::SeqCst),
        0,
        "nothing reached the target"
    );
}

#[tokio::test]
async fn concurrent_requests_ride_one_upstream_connection_and_show_in_metrics() {
    let gateway = TestGateway::start().await;
    let origin = h2_origin().await;
    let service = h2c_service(&gateway, &origin, json!({})).await;
    gateway.route_all_to(service).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let client = client.clone();
            let url = gateway.proxy_url(&format!("/item/{i}"));
            tokio::spawn(async move { client.get(url).send().await.unwrap().status() })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap(), 200);
    }
    assert!(
        origin.connections.load(Ordering::SeqCst) <= 2,
        "64 requests multiplexed: {} connections",
        origin.connections.load(Ordering::SeqCst)
    );
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains("raahi_upstream_h2_connections{service=\"h2\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn the_api_refuses_h2c_settings_that_cannot_work() {
    let gateway = TestGateway::start().await;
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "bad", "protocol": "h2c", "timeouts": {"keepalive_ms": 5}})),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["field"], "timeouts.keepalive_ms");
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "bad", "protocol": "http", "health_check": {"type": "grpc"}})),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["field"], "health_check.type");
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(
                json!({"name": "ok", "protocol": "h2c", "timeouts": {"keepalive_ms": 20000},
                        "limits": {"max_streams_per_connection": 50}}),
            ),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["protocol"], "h2c");
    assert_eq!(body["timeouts"]["keepalive_ms"], 20000);
    assert_eq!(body["limits"]["max_streams_per_connection"], 50);
}

// ---------------------------------------------------------------------------------------------
// Targets that break HTTP/2: each fails its own calls only.
// ---------------------------------------------------------------------------------------------

/// An origin speaking HTTP/2 through the h2 crate's server, answering each stream with
/// `answer`.
async fn h2_crate_origin<F>(answer: F) -> SocketAddr
where
    F: Fn(h2::server::SendResponse<Bytes>) + Clone + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((socket, _)) = listener.accept().await else {
                return;
            };
            let answer = answer.clone();
            tokio::spawn(async move {
                let Ok(mut connection) = h2::server::handshake(socket).await else {
                    return;
                };
                while let Some(Ok((_request, respond))) = connection.accept().await {
                    answer(respond);
                }
            });
        }
    });
    addr
}

/// A raw origin that answers the client preface with a frame no HTTP/2 peer may send.
async fn malformed_frame_origin() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut preface = [0u8; 24];
                let _ = socket.read_exact(&mut preface).await;
                // An empty SETTINGS, then DATA on stream 0 (a connection error: PROTOCOL_ERROR).
                let _ = socket.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
                let _ = socket
                    .write_all(&[0, 0, 2, 0, 0, 0, 0, 0, 0, b'h', b'i'])
                    .await;
                let mut sink = vec![0u8; 4096];
                while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

/// A gateway with one h2c service per broken origin (routes by path) and a healthy one at `/`.
async fn gateway_with_broken_targets(broken: &[(&str, SocketAddr)]) -> (TestGateway, H2Origin) {
    let gateway = TestGateway::start().await;
    let good = h2_origin().await;
    let service = h2c_service(&gateway, &good, json!({})).await;
    gateway.route_all_to(service).await;
    for (name, addr) in broken {
        let service = gateway
            .create(
                "/api/v1/services",
                json!({"name": name, "protocol": "h2c", "max_attempts": 1, "ejection": false}),
            )
            .await;
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                json!({"host": "127.0.0.1", "port": addr.port()}),
            )
            .await;
        gateway
            .create(
                "/api/v1/routes",
                json!({"name": name, "path_prefix": format!("/{name}"), "service_id": service}),
            )
            .await;
    }
    (gateway, good)
}

#[tokio::test]
async fn targets_that_break_http2_fail_their_own_calls_only() {
    let malformed = malformed_frame_origin().await;
    let oversized = h2_crate_origin(|mut respond| {
        let response = http::Response::builder()
            .header("x-huge", "v".repeat(100 * 1024))
            .body(())
            .unwrap();
        let _ = respond.send_response(response, true);
    })
    .await;
    let resetting =
        h2_crate_origin(|mut respond| respond.send_reset(h2::Reason::INTERNAL_ERROR)).await;
    let (gateway, _good) = gateway_with_broken_targets(&[
        ("malformed", malformed),
        ("oversized", oversized),
        ("resetting", resetting),
    ])
    .await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    for broken in ["malformed", "oversized", "resetting"] {
        // A storm of calls, all at once: each fails on its own, none hangs.
        let calls: Vec<_> = (0..50)
            .map(|_| {
                let client = client.clone();
                let url = gateway.proxy_url(&format!("/{broken}/x"));
                tokio::spawn(async move { client.get(url).send().await.unwrap() })
            })
            .collect();
        for call in calls {
            let response = tokio::time::timeout(STEP, call).await.unwrap().unwrap();
            assert_eq!(response.status(), 502, "{broken}");
            let body = response.text().await.unwrap();
            assert!(body.contains("upstream_"), "{broken}: {body}");
        }
        // The gateway and its other targets are unharmed.
        let response = client.get(gateway.proxy_url("/fine")).send().await.unwrap();
        assert_eq!(response.status(), 200, "after {broken}");
        assert_eq!(response.text().await.unwrap(), "got 0");
    }
}

/// A stream the target refused was never processed: it goes again, on another connection of
/// the same target, even for a POST, and holds nothing against the target.
#[tokio::test]
async fn a_refused_stream_is_retried_whatever_the_method() {
    let streams = Arc::new(AtomicU64::new(0));
    let counted = streams.clone();
    let origin = h2_crate_origin(move |mut respond| {
        // Every other stream is refused, the first one included.
        if counted.fetch_add(1, Ordering::SeqCst).is_multiple_of(2) {
            respond.send_reset(h2::Reason::REFUSED_STREAM);
            return;
        }
        let response = http::Response::builder().status(201).body(()).unwrap();
        let _ = respond.send_response(response, true);
    })
    .await;
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "orders", "protocol": "h2c", "max_attempts": 2}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": origin.port()}),
        )
        .await;
    gateway.route_all_to(service).await;
    for order in 0..5 {
        let response = gateway
            .http
            .post(gateway.proxy_url("/orders"))
            .body(format!("order {order}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 201, "order {order}");
    }
    assert_eq!(
        streams.load(Ordering::SeqCst),
        10,
        "each POST was refused once"
    );
    assert!(
        gateway
            .metric("raahi_upstream_h2_unprocessed_streams_total{service=\"orders\"}")
            .await
            >= 5
    );
    let target = &gateway.targets(service).await[0];
    assert!(target.ejected_until.is_none());
}

/// A target that takes the request and then goes silent (no answer, no PING answer) is caught
/// by the keep-alive PING well before the response timeout.
#[tokio::test]
async fn a_silent_target_is_caught_by_keepalive_pings() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                // An empty SETTINGS, then nothing more: everything sent is read and ignored.
                let _ = socket.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await;
                let mut sink = vec![0u8; 4096];
                while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
            });
        }
    });
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "silent", "protocol": "h2c", "max_attempts": 1,
                   "timeouts": {"keepalive_ms": 300, "connect_ms": 300, "response_header_ms": 30000}}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": "127.0.0.1", "port": silent.port()}),
        )
        .await;
    gateway.route_all_to(service).await;
    let started = std::time::Instant::now();
    let response = tokio::time::timeout(STEP, gateway.get("/waits"))
        .await
        .unwrap();
    let waited = started.elapsed();
    assert_eq!(response.status(), 502);
    assert!(
        waited >= Duration::from_millis(550) && waited < Duration::from_secs(3),
        "keepalive_ms + its timeout, not the 30 s response timeout: {waited:?}"
    );
    let body = response.text().await.unwrap();
    assert!(body.contains("upstream_failed"), "{body}");
}
