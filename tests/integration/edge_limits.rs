//! The proxy listener's limits through real sockets: connections per listener, request size
//! limits with named answers counted in `/metrics`, and HTTP/2's idle timeout and stream limit.
//! Framing and smuggling cases are the conformance corpus's (`conformance.rs`).

use crate::common;
use common::*;

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A gateway with `overrides` (environment form) routing everything to one upstream `name`.
async fn gateway_with(overrides: &[(&str, &str)], name: &str) -> (TestGateway, Upstream) {
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let config = test_config_with(dir.path(), overrides);
    let gateway = TestGateway::start_with(dir, config).await;
    let upstream = Upstream::start(name).await;
    let service = gateway
        .service_with_targets(name, &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    (gateway, upstream)
}

/// One metric sample's value as `/metrics` shows it (0 when absent).
async fn sample(gateway: &TestGateway, series: &str) -> u64 {
    gateway.metric(series).await
}

/// Reads what a connection sends until the gateway closes it (at most 10 s).
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    answer
}

#[tokio::test]
async fn a_listener_at_max_connections_refuses_more_with_a_named_503() {
    let (gateway, _upstream) =
        gateway_with(&[("RAAHI_PROXY_MAX_CONNECTIONS", "3")], "capped").await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(gateway.proxy).await.unwrap());
    }
    wait_until(
        "three client connections open",
        Duration::from_secs(5),
        || async { sample(&gateway, "raahi_client_connections").await == 3 },
    )
    .await;

    let mut fourth = TcpStream::connect(gateway.proxy).await.unwrap();
    let answer = String::from_utf8_lossy(&read_until_closed(&mut fourth).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("too_many_connections"), "{answer}");
    assert_eq!(
        sample(&gateway, "raahi_client_connections_refused_total").await,
        1
    );

    // A place frees when a connection ends; the next client is served.
    drop(held.pop());
    wait_until("a place to free", Duration::from_secs(5), || async {
        sample(&gateway, "raahi_client_connections").await == 2
    })
    .await;
    let answer = raw_http(
        gateway.proxy,
        "GET / HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test]
async fn request_limits_answer_named_statuses_counted_in_metrics() {
    let (gateway, upstream) = gateway_with(
        &[
            ("RAAHI_PROXY_MAX_URI_BYTES", "100"),
            ("RAAHI_PROXY_MAX_HEADER_COUNT", "6"),
            ("RAAHI_PROXY_MAX_HEADER_BYTES", "300"),
        ],
        "limited",
    )
    .await;
    let long_path = format!("/{}", "p".repeat(100));
    let many_fields: String = (0..6).map(|i| format!("X-Field-{i}: v\r\n")).collect();
    let big_field = format!("X-Big: {}\r\n", "b".repeat(300));
    let cases = [
        (
            format!("GET {long_path} HTTP/1.1\r\nHost: a.test\r\n\r\n"),
            "414",
            "uri_too_long",
        ),
        (
            format!("GET / HTTP/1.1\r\nHost: a.test\r\n{many_fields}\r\n"),
            "431",
            "request_headers_too_large",
        ),
        (
            format!("GET / HTTP/1.1\r\nHost: a.test\r\n{big_field}\r\n"),
            "431",
            "request_headers_too_large",
        ),
        (
            "GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n".to_owned(),
            "400",
            "invalid_host",
        ),
        (
            "POST / HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n"
                .to_owned(),
            "501",
            "unsupported_transfer_coding",
        ),
    ];
    for (request, status, code) in &cases {
        // Each refusal ends its connection: the reply is all the gateway sends.
        let answer = raw_http(gateway.proxy, request).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{code}: {answer}"
        );
        assert!(answer.contains(&format!("\"code\":\"{code}\"")), "{answer}");
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
    }
    assert_eq!(upstream.hits(), 0, "no refused request reached the target");
    for (code, count) in [
        ("uri_too_long", 1),
        ("request_headers_too_large", 2),
        ("invalid_host", 1),
        ("unsupported_transfer_coding", 1),
        ("request_body_too_large", 0),
    ] {
        assert_eq!(
            sample(
                &gateway,
                &format!("raahi_requests_refused_total{{code=\"{code}\"}}")
            )
            .await,
            count,
            "{code}"
        );
    }
    // Within the limits, the same listener serves.
    let answer = raw_http(
        gateway.proxy,
        "GET /fine HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

/// HTTP/2 frames as they come: (type, flags, stream, payload).
async fn read_frame(stream: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    let mut header = [0u8; 9];
    stream.read_exact(&mut header).await.ok()?;
    let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
    let mut payload = vec![0u8; length];
    stream.read_exact(&mut payload).await.ok()?;
    let stream_id = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & 0x7fff_ffff;
    Some((header[3], header[4], stream_id, payload))
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame.
const SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];

#[tokio::test]
async fn an_idle_http2_connection_is_closed_with_goaway_after_the_idle_timeout() {
    let (gateway, _upstream) =
        gateway_with(&[("RAAHI_PROXY_HTTP2_IDLE_TIMEOUT_MS", "400")], "h2-idle").await;
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    let opened = Instant::now();
    stream.write_all(PREFACE).await.unwrap();
    stream.write_all(&SETTINGS).await.unwrap();
    let goaway = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match read_frame(&mut stream).await {
                Some((7, _, _, payload)) => return Some(payload),
                Some((4, flags, _, payload)) if flags & 1 == 0 => {
                    // The server's SETTINGS: acknowledge them, and check its stream limit.
                    let advertised = payload.chunks(6).find_map(|setting| {
                        (u16::from_be_bytes([setting[0], setting[1]]) == 3).then(|| {
                            u32::from_be_bytes([setting[2], setting[3], setting[4], setting[5]])
                        })
                    });
                    assert_eq!(advertised, Some(100), "SETTINGS_MAX_CONCURRENT_STREAMS");
                    stream
                        .write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0])
                        .await
                        .unwrap();
                }
                Some(_) => {}
                None => return None,
            }
        }
    })
    .await
    .expect("GOAWAY within 10 s")
    .expect("GOAWAY before the connection closed");
    assert!(
        opened.elapsed() >= Duration::from_millis(400),
        "closed before its idle timeout: {:?}",
        opened.elapsed()
    );
    let error_code = u32::from_be_bytes(goaway[4..8].try_into().unwrap());
    assert_eq!(error_code, 0, "a graceful GOAWAY (NO_ERROR)");
    // Then it closes, even for a client that answers none of the gateway's PINGs.
    let told = Instant::now();
    read_until_closed(&mut stream).await;
    assert!(
        told.elapsed() < Duration::from_secs(5),
        "still open {:?} after GOAWAY",
        told.elapsed()
    );
}

/// A HEADERS frame opening stream `id` with a POST to `/` whose body never comes, so the stream
/// stays open: HPACK static-table entries and one literal `:authority`.
fn open_stream(id: u32) -> Vec<u8> {
    // :method POST (3), :scheme http (6), :path / (4), :authority (1) "h2.test" not indexed.
    let mut block = vec![0x83, 0x86, 0x84, 0x01, 7];
    block.extend_from_slice(b"h2.test");
    let length = block.len() as u32;
    let mut frame = length.to_be_bytes()[1..].to_vec();
    // HEADERS, END_HEADERS (no END_STREAM: the body is still to come).
    frame.extend_from_slice(&[1, 0x4]);
    frame.extend_from_slice(&id.to_be_bytes());
    frame.extend_from_slice(&block);
    frame
}

#[tokio::test]
async fn streams_past_the_concurrent_limit_are_refused_and_counted() {
    let (gateway, _upstream) = gateway_with(
        &[("RAAHI_PROXY_HTTP2_MAX_CONCURRENT_STREAMS", "2")],
        "h2-refused",
    )
    .await;
    let before = sample(&gateway, "raahi_http2_streams_refused_total").await;
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    stream.write_all(PREFACE).await.unwrap();
    stream.write_all(&SETTINGS).await.unwrap();
    // Five streams at once, ignoring the server's limit of two: streams 5, 7 and 9 are over.
    let mut opened = Vec::new();
    for id in [1, 3, 5, 7, 9] {
        opened.extend(open_stream(id));
    }
    stream.write_all(&opened).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        let mut refused = Vec::new();
        while refused.len() < 3 {
            match read_frame(&mut stream).await {
                Some((3, _, id, payload)) => {
                    let code = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    assert_eq!(code, 7, "stream {id} reset with REFUSED_STREAM");
                    refused.push(id);
                }
                Some((4, flags, _, _)) if flags & 1 == 0 => stream
                    .write_all(&[0, 0, 0, 4, 1, 0, 0, 0, 0])
                    .await
                    .unwrap(),
                Some((7, _, _, payload)) => panic!("GOAWAY {payload:?}"),
                Some(_) => {}
                None => panic!("the connection closed"),
            }
        }
        refused
    })
    .await
    .expect("three refusals within 10 s");
    assert_eq!(refused, [5, 7, 9]);
    wait_until(
        "three refused streams in /metrics",
        Duration::from_secs(5),
        || {
            let gateway = &gateway;
            async move { sample(gateway, "raahi_http2_streams_refused_total").await == before + 3 }
        },
    )
    .await;
}

/// Sends a request head with `Content-Length: length` and the first `sent` bytes of its body,
/// then nothing more; the connection stays open.
async fn start_upload(gateway: &TestGateway, length: usize, sent: usize) -> TcpStream {
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    let head = format!("POST /upload HTTP/1.1\r\nHost: a.test\r\nContent-Length: {length}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&vec![b'u'; sent]).await.unwrap();
    stream
}

/// Bodies up to a route's `request_buffer_bytes` are read whole before a target is picked:
/// clients uploading slowly hold no upstream connection, and another client is served as usual.
#[tokio::test]
async fn slow_uploaders_cost_the_upstream_nothing_while_others_are_served() {
    let (gateway, upstream) = gateway_with(&[], "buffered").await;
    let mut uploaders = Vec::new();
    for _ in 0..50 {
        uploaders.push(start_upload(&gateway, 10_000, 100).await);
    }
    let answer = raw_http(
        gateway.proxy,
        "GET /other HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    holds_for(
        "only the other client's request at the upstream",
        Duration::from_millis(300),
        || async { upstream.hits() == 1 },
    )
    .await;

    // One uploader finishes: its whole body goes up at once.
    let mut finished = uploaders.pop().unwrap();
    finished.write_all(&vec![b'u'; 9_900]).await.unwrap();
    let mut head = [0u8; 12];
    finished.read_exact(&mut head).await.unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    let seen = upstream.last_seen();
    assert_eq!((seen.path.as_str(), seen.body_len), ("/upload", 10_000));
    assert_eq!(upstream.hits(), 2);
}

/// A body read whole must arrive within `proxy.client_body_timeout_ms` in total: bytes that
/// keep trickling do not extend it.
#[tokio::test]
async fn a_buffered_upload_slower_than_the_client_body_timeout_gets_408() {
    let (gateway, upstream) =
        gateway_with(&[("RAAHI_PROXY_CLIENT_BODY_TIMEOUT_MS", "600")], "trickle").await;
    let mut stream = start_upload(&gateway, 1_000, 10).await;
    let started = Instant::now();
    let answer = async {
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        loop {
            tokio::select! {
                read = stream.read(&mut buf) => match read.unwrap() {
                    0 => return answer,
                    n => answer.extend_from_slice(&buf[..n]),
                },
                // A byte every 100 ms: the upload moves, just too slowly.
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    let _ = stream.write_all(b"u").await;
                }
            }
        }
    };
    let answer = tokio::time::timeout(Duration::from_secs(10), answer)
        .await
        .expect("answered and closed within 10 s");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("client_body_timeout"), "{answer}");
    assert!(started.elapsed() >= Duration::from_millis(600));
    assert_eq!(upstream.hits(), 0, "nothing reached the upstream");
    assert_eq!(
        sample(
            &gateway,
            "raahi_requests_refused_total{code=\"client_body_timeout\"}"
        )
        .await,
        1
    );
}

/// With spooling off, a body past the memory budget streams instead: memory stays bounded
/// and the request goes up with what was read so far. (With spooling on, it spools: see
/// `request_spool.rs`.)
#[tokio::test]
async fn past_the_buffer_budget_bodies_stream_when_spooling_is_off() {
    let (gateway, upstream) = gateway_with(
        &[
            ("RAAHI_PROXY_REQUEST_BUFFER_BUDGET_BYTES", "1000"),
            ("RAAHI_PROXY_REQUEST_SPOOL_BYTES", "0"),
        ],
        "budget",
    )
    .await;
    let _uploader = start_upload(&gateway, 5_000, 2_000).await;
    wait_until(
        "the upload to stream to the upstream",
        Duration::from_secs(5),
        || async { upstream.hits() == 1 },
    )
    .await;
}

/// A route's `max_request_body_bytes` answers 413 from the Content-Length at once, and while a
/// body of unknown length streams past it.
#[tokio::test]
async fn a_body_over_the_route_limit_gets_413() {
    let (gateway, upstream) = gateway_with(&[], "small-bodies").await;
    let (_, routes) = gateway.api("GET", "/api/v1/routes", None).await;
    let route = routes["items"][0]["id"].as_i64().unwrap();
    for buffer in [1_048_576, 0] {
        let (status, body) = gateway
            .api(
                "PATCH",
                &format!("/api/v1/routes/{route}"),
                Some(serde_json::json!({"max_request_body_bytes": 1000, "request_buffer_bytes": buffer})),
            )
            .await;
        assert_eq!(status.as_u16(), 200, "{body}");
        let declared = raw_http(
            gateway.proxy,
            "POST /big HTTP/1.1\r\nHost: a.test\r\nContent-Length: 1001\r\n\r\n",
        )
        .await;
        assert!(declared.starts_with("HTTP/1.1 413"), "{declared}");
        assert!(declared.contains("request_body_too_large"), "{declared}");
        let chunk = "c".repeat(600);
        let chunked = raw_http(
            gateway.proxy,
            &format!(
                "POST /big HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n\
                 258\r\n{chunk}\r\n258\r\n{chunk}\r\n0\r\n\r\n"
            ),
        )
        .await;
        assert!(
            chunked.starts_with("HTTP/1.1 413"),
            "buffer {buffer}: {chunked}"
        );
    }
    assert!(
        upstream.hits() <= 1,
        "only the streaming body may have started at the upstream"
    );
}

/// `limits.max_connections_per_target` holds a target to that many requests at once; more wait
/// in the service's queue for room, up to `max_pending_requests` and `queue_timeout_ms`, and
/// are then answered 503 `upstream_overloaded`, without counting against the target's health.
#[tokio::test]
async fn a_full_target_queues_then_refuses_with_upstream_overloaded() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("narrow").await;
    let service = gateway
        .create(
            "/api/v1/services",
            serde_json::json!({
                "name": "narrow",
                "ejection": {"failures": 1, "window_ms": 60000},
                "limits": {
                    "max_connections_per_target": 2,
                    "max_pending_requests": 1,
                    "queue_timeout_ms": 400,
                },
            }),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&upstream, 1, 0),
        )
        .await;
    gateway.route_all_to(service).await;
    wait_until("the route to serve", Duration::from_secs(5), || async {
        gateway.fetch_status("/ready").await.0 == 200
    })
    .await;

    let get = |path: &'static str| {
        let client = gateway.http.clone();
        let url = gateway.proxy_url(path);
        tokio::spawn(async move {
            let response = client.get(url).send().await.unwrap();
            let status = response.status().as_u16();
            (status, response.text().await.unwrap())
        })
    };
    // Two slow requests fill the target.
    let slow = [get("/slow/3000"), get("/slow/3000")];
    wait_until(
        "two requests at the target",
        Duration::from_secs(5),
        || async { upstream.hits() == 3 },
    )
    .await;
    // A third waits in the queue; a fourth finds the queue full and is refused at once.
    let queued = get("/queued");
    wait_until("one request queued", Duration::from_secs(5), || async {
        sample(
            &gateway,
            "raahi_service_queued_requests{service=\"narrow\"}",
        )
        .await
            == 1
    })
    .await;
    let refused_at = Instant::now();
    let (status, body) = get("/refused").await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("upstream_overloaded"), "{body}");
    assert!(body.contains("max_pending_requests"), "{body}");
    assert!(
        refused_at.elapsed() < Duration::from_millis(400),
        "refused at once"
    );
    // The queued one gives up after its queue timeout, with the target still full.
    let (status, body) = queued.await.unwrap();
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("queue_timeout_ms"), "{body}");
    assert_eq!(
        upstream.hits(),
        3,
        "the target never had more than two at once"
    );
    for slow in slow {
        assert_eq!(slow.await.unwrap().0, 200);
    }
    // Room again: served, and the refusals cost the target nothing.
    let (status, _) = get("/after").await.unwrap();
    assert_eq!(status, 200);
    let (_, view) = gateway
        .api("GET", &format!("/api/v1/services/{service}/runtime"), None)
        .await;
    let entry = &view["targets"][0];
    assert_eq!(entry["ejected_until"], serde_json::Value::Null, "{view}");
    assert_eq!(entry["available"], true, "{view}");
    assert_eq!(
        sample(
            &gateway,
            "raahi_service_overloaded_requests_total{service=\"narrow\"}"
        )
        .await,
        2
    );
    assert_eq!(
        sample(
            &gateway,
            "raahi_requests_refused_total{code=\"upstream_overloaded\"}"
        )
        .await,
        2
    );
}

/// A gRPC call's body (no Content-Length) is not read whole first: a streaming call sends a
/// message and waits for an answer before its next, so it must reach the target at once.
#[tokio::test]
async fn a_grpc_body_streams_to_the_target_while_it_is_still_open() {
    use http_body_util::StreamBody;
    let (gateway, upstream) = gateway_with(&[], "grpc").await;
    let (messages, mut next) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let frames = futures_util::stream::poll_fn(move |cx| {
        next.poll_recv(cx).map(|message| {
            message.map(|data| Ok::<_, std::convert::Infallible>(http_body::Frame::data(data)))
        })
    });
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let call = tokio::spawn(
        client
            .post(gateway.proxy_url("/pkg.Service/Chat"))
            .header("content-type", "application/grpc")
            .body(reqwest::Body::wrap(StreamBody::new(frames)))
            .send(),
    );
    messages
        .send(bytes::Bytes::from_static(b"\0\0\0\0\x05hello"))
        .await
        .unwrap();
    wait_until(
        "the call to reach the target while its body is open",
        Duration::from_secs(5),
        || async { upstream.hits() == 1 },
    )
    .await;
    drop(messages);
    let response = call.await.unwrap().unwrap();
    assert_eq!(response.status().as_u16(), 200);
    assert_eq!(upstream.last_seen().body_len, 10);
}

/// "P", "PR" could open HTTP/2's preface ("PRI * HTTP/2.0") as well as a POST: a client that
/// sends its request a byte at a time is still served as HTTP/1.1.
#[tokio::test]
async fn a_post_sent_a_byte_at_a_time_is_not_taken_for_http2() {
    let (gateway, upstream) = gateway_with(&[], "bytes").await;
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    let request =
        b"POST /p HTTP/1.1\r\nHost: a.test\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok";
    for (index, byte) in request.iter().enumerate() {
        stream.write_all(&[*byte]).await.unwrap();
        if index < 3 {
            // The client's pace, not a wait for the gateway: each byte its own segment.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }
    let answer = String::from_utf8_lossy(&read_until_closed(&mut stream).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert_eq!(upstream.last_seen().body_len, 2);
}

/// The accept backlog of the socket listening on TCP `port`, as `ss` (iproute2) shows it: a
/// LISTEN socket's Send-Q is its backlog.
fn listen_backlog(port: u16) -> u32 {
    let output = std::process::Command::new("ss")
        .args(["-Hltn", &format!("sport = :{port}")])
        .output()
        .expect("ss (iproute2) runs");
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .next()
        .unwrap_or_else(|| panic!("nothing listens on port {port}: {text:?}"));
    // State, Recv-Q, Send-Q, local address, peer address.
    line.split_whitespace()
        .nth(2)
        .and_then(|backlog| backlog.parse().ok())
        .unwrap_or_else(|| panic!("no backlog in {line:?}"))
}

/// `proxy.listen_backlog` is the backlog of the proxy, HTTPS and stream-route listeners (the
/// admin listener keeps its own); 1024 by default, as far as the kernel allows.
#[tokio::test]
async fn the_data_path_listeners_take_the_configured_backlog() {
    let (gateway, upstream) = gateway_with(
        &[
            ("RAAHI_PROXY_LISTEN_BACKLOG", "7"),
            ("RAAHI_PROXY_TLS_LISTEN", "127.0.0.1:0"),
        ],
        "backlog",
    )
    .await;
    let https = gateway
        .gateway
        .as_ref()
        .and_then(|gateway| gateway.tls_addr)
        .expect("an HTTPS listener");
    let stream = stream_service(
        &gateway,
        "stream-backlog",
        "tcp",
        &[target(&upstream, 1, 0)],
    )
    .await;
    let listen = free_addr();
    // A route's listener is bound when the route is created.
    stream_route(&gateway, listen, None, stream).await;
    for (listener, port) in [
        ("proxy", gateway.proxy.port()),
        ("https", https.port()),
        ("stream route", listen.port()),
    ] {
        assert_eq!(listen_backlog(port), 7, "{listener}");
    }

    let (default, _upstream) = gateway_with(&[], "default-backlog").await;
    let somaxconn: u32 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
        .expect("somaxconn")
        .trim()
        .parse()
        .expect("a number");
    assert_eq!(listen_backlog(default.proxy.port()), somaxconn.min(1024));
}
