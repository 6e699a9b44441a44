//! The data path through real sockets: balancing, tiers, live changes, header rewriting, routing,
//! failures, HTTP/2, and protocol upgrades (DESIGN.md §5 and §6). Streaming a gigabyte with flat
//! memory is measured in `tests/memory/proxy.rs`, in a process of its own.

use crate::common;
use common::*;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

async fn create_service(gateway: &TestGateway, body: Value) -> i64 {
    gateway.create("/api/v1/services", body).await
}

async fn add_target(
    gateway: &TestGateway,
    service: i64,
    upstream: &Upstream,
    weight: u32,
    priority: i32,
) -> i64 {
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(upstream, weight, priority),
        )
        .await
}

/// A target at an address nothing listens on.
async fn add_dead_target(gateway: &TestGateway, service: i64, addr: SocketAddr) -> i64 {
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": addr.ip().to_string(), "port": addr.port(), "weight": 1}),
        )
        .await
}

async fn add_route(gateway: &TestGateway, body: Value) -> i64 {
    gateway.create("/api/v1/routes", body).await
}

/// A gateway whose route `all` sends every request to one upstream (service `name`).
async fn gateway_to_one_upstream(name: &str) -> (TestGateway, Upstream) {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start(name).await;
    let service = gateway
        .service_with_targets(name, &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    (gateway, upstream)
}

async fn patch_target(gateway: &TestGateway, id: i64, body: Value) {
    let (status, answer) = gateway
        .api("PATCH", &format!("/api/v1/targets/{id}"), Some(body))
        .await;
    assert_eq!(status, 200, "PATCH target {id}: {answer}");
}

/// An address that refuses connections: bound once, then released.
fn dead_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// A GET through the proxy that must answer 200; returns the body (the upstream's name).
async fn fetch(gateway: &TestGateway, path: &str) -> String {
    let response = gateway.get(path).await;
    assert_eq!(response.status(), 200, "GET {path}");
    response.text().await.unwrap()
}

/// A request through the proxy with an explicit Host header.
async fn send_to_host(
    gateway: &TestGateway,
    method: reqwest::Method,
    host: &str,
    path: &str,
) -> reqwest::Response {
    gateway
        .http
        .request(method, gateway.proxy_url(path))
        .header("host", host)
        .send()
        .await
        .expect("proxy answers")
}

/// The upstream name answering a GET with the given Host (must be 200).
async fn fetch_host(gateway: &TestGateway, host: &str, path: &str) -> String {
    let response = send_to_host(gateway, reqwest::Method::GET, host, path).await;
    assert_eq!(response.status(), 200, "GET {path} with Host {host}");
    response.text().await.unwrap()
}

/// A named JSON error answer: status, `error.code`, `error.message`.
async fn error_answer(response: reqwest::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let text = response.text().await.unwrap();
    let error = json_error(status, &content_type, &text);
    (status, error.code, error.message)
}

fn count(counts: &HashMap<String, usize>, name: &str) -> usize {
    counts.get(name).copied().unwrap_or(0)
}

/// Every value an upstream saw for a header, joined as one list (`a, b`).
fn joined(seen: &Seen, name: &str) -> Option<String> {
    seen.headers.get(name).map(|values| values.join(", "))
}

/// One raw request over a fresh connection (left open by neither side's choice); returns the
/// response head and its body as sent (Content-Length or chunked framing).
async fn raw_exchange(addr: SocketAddr, request: &str) -> (String, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let (head, mut body) = read_head(&mut stream).await;
    let length = head_values(&head, "content-length")
        .first()
        .map(|v| v.parse::<usize>().expect("numeric content-length"));
    let chunked = head_values(&head, "transfer-encoding")
        .iter()
        .any(|v| v.eq_ignore_ascii_case("chunked"));
    let done = |body: &Vec<u8>| match length {
        Some(length) => body.len() >= length,
        None if chunked => body.ends_with(b"0\r\n\r\n"),
        None => false,
    };
    let mut chunk = [0u8; 4096];
    while !done(&body) {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("response body within 10 s")
            .expect("read");
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    (head, body)
}

/// An upstream that records the request target (path and query) of every request it receives.
struct UriRecorder {
    addr: SocketAddr,
    uris: Arc<Mutex<Vec<String>>>,
}

impl UriRecorder {
    async fn start() -> UriRecorder {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let uris = Arc::new(Mutex::new(Vec::new()));
        let recorded = uris.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let recorded = recorded.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(
                        move |request: hyper::Request<hyper::body::Incoming>| {
                            recorded.lock().unwrap().push(request.uri().to_string());
                            async {
                                Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                    Bytes::from_static(b"recorder"),
                                )))
                            }
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        UriRecorder { addr, uris }
    }

    fn target(&self) -> Value {
        json!({"host": self.addr.ip().to_string(), "port": self.addr.port(), "weight": 1})
    }

    fn last(&self) -> String {
        self.uris
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("recorder saw a request")
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Balancing policies
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_splits_one_to_three_and_interleaves() {
    let gateway = TestGateway::start().await;
    let light = Upstream::start("light").await;
    let heavy = Upstream::start("heavy").await;
    let service = gateway
        .service_with_targets("rr", &[target(&light, 100, 0), target(&heavy, 300, 0)])
        .await;
    gateway.route_all_to(service).await;

    // Weights 100:300 (1:3). Smooth weighted round-robin interleaves; a scheme that serves
    // each target its whole weight in turn would show a burst of 300.
    let mut sequence = Vec::new();
    for _ in 0..40 {
        sequence.push(fetch(&gateway, "/rr").await);
    }
    let mut run = 0;
    let mut longest = 0;
    for name in &sequence {
        run = if name == "heavy" { run + 1 } else { 0 };
        longest = longest.max(run);
    }
    assert!(
        longest <= 3,
        "heavy picked {longest} times in a row; first 40 picks: {sequence:?}"
    );
    assert!(
        sequence.iter().any(|name| name == "light"),
        "light never picked in 40 requests"
    );

    let counts = spread(&gateway, "/rr", 4000, 8).await;
    let light_share = count(&counts, "light") as f64 / 4000.0;
    assert_eq!(count(&counts, "light") + count(&counts, "heavy"), 4000);
    assert!(
        (light_share - 0.25).abs() <= 0.03,
        "weights 1:3 gave light {:.1} % ({counts:?})",
        light_share * 100.0
    );
    assert_eq!(light.hits() + heavy.hits(), 4040);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_policy_splits_one_to_three() {
    let gateway = TestGateway::start().await;
    let light = Upstream::start("light").await;
    let heavy = Upstream::start("heavy").await;
    let service = create_service(&gateway, json!({"name": "rnd", "lb_policy": "random"})).await;
    add_target(&gateway, service, &light, 1, 0).await;
    add_target(&gateway, service, &heavy, 3, 0).await;
    gateway.route_all_to(service).await;

    let counts = spread(&gateway, "/rnd", 4000, 8).await;
    assert_eq!(count(&counts, "light") + count(&counts, "heavy"), 4000);
    let light_share = count(&counts, "light") as f64 / 4000.0;
    assert!(
        (light_share - 0.25).abs() <= 0.03,
        "random 1:3 gave light {:.1} % ({counts:?})",
        light_share * 100.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_request_avoids_the_target_holding_slow_requests() {
    let gateway = TestGateway::start().await;
    let busy = Upstream::start("busy").await;
    let idle = Upstream::start("idle").await;
    let service = create_service(
        &gateway,
        json!({"name": "lr", "lb_policy": "least_request"}),
    )
    .await;
    add_target(&gateway, service, &busy, 1, 0).await;
    gateway.route_all_to(service).await;

    // Four slow requests in flight on `busy` (the only target so far).
    let mut slow = Vec::new();
    for _ in 0..4 {
        let client = gateway.http.clone();
        let url = gateway.proxy_url("/slow/8000");
        slow.push(tokio::spawn(async move {
            client.get(url).send().await.map(|r| r.status().as_u16())
        }));
    }
    wait_until("busy holds 4 slow requests", Duration::from_secs(5), || {
        let seen = busy.seen.clone();
        async move {
            seen.lock()
                .unwrap()
                .iter()
                .filter(|s| s.path == "/slow/8000")
                .count()
                == 4
        }
    })
    .await;

    // A second target arrives; in-flight counts survive the snapshot rebuild.
    add_target(&gateway, service, &idle, 1, 0).await;
    let counts = spread(&gateway, "/fast", 200, 1).await;
    assert!(
        slow.iter().all(|task| !task.is_finished()),
        "the slow requests ended before the fast ones; the test proves nothing"
    );
    let to_busy = count(&counts, "busy");
    assert_eq!(to_busy + count(&counts, "idle"), 200);
    // Power of two choices over {busy: 4 in flight, idle: 0}: the busy one may only win when
    // both draws land on it; anything near an even split means in-flight load is ignored.
    assert!(
        to_busy * 10 <= 200,
        "least_request sent {to_busy} of 200 new requests to the target holding 4 slow ones \
         ({counts:?})"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Priority tiers and weight 0
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lower_tier_takes_traffic_only_when_the_preferred_tier_is_disabled() {
    let gateway = TestGateway::start().await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let backup = Upstream::start("backup").await;
    let service = create_service(&gateway, json!({"name": "tiers"})).await;
    let first_id = add_target(&gateway, service, &first, 1, 0).await;
    let second_id = add_target(&gateway, service, &second, 1, 0).await;
    add_target(&gateway, service, &backup, 100, 10).await;
    gateway.route_all_to(service).await;

    let counts = spread(&gateway, "/t", 40, 1).await;
    assert_eq!(
        count(&counts, "backup"),
        0,
        "tier 10 used while tier 0 is up: {counts:?}"
    );
    assert!(
        count(&counts, "first") > 0 && count(&counts, "second") > 0,
        "{counts:?}"
    );

    // One target of tier 0 left: it takes everything; weight never crosses tiers.
    patch_target(&gateway, first_id, json!({"enabled": false})).await;
    let counts = spread(&gateway, "/t", 40, 1).await;
    assert_eq!(count(&counts, "second"), 40, "{counts:?}");

    // All of tier 0 disabled: every request goes to tier 10.
    patch_target(&gateway, second_id, json!({"enabled": false})).await;
    let counts = spread(&gateway, "/t", 40, 1).await;
    assert_eq!(count(&counts, "backup"), 40, "{counts:?}");

    // Re-enabled: back to tier 0 at once.
    patch_target(&gateway, first_id, json!({"enabled": true})).await;
    let counts = spread(&gateway, "/t", 40, 1).await;
    assert_eq!(count(&counts, "first"), 40, "{counts:?}");
    patch_target(&gateway, second_id, json!({"enabled": true})).await;
    let counts = spread(&gateway, "/t", 40, 1).await;
    assert_eq!(count(&counts, "backup"), 0, "{counts:?}");
    assert!(
        count(&counts, "first") > 0 && count(&counts, "second") > 0,
        "{counts:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weight_zero_targets_are_never_picked() {
    let gateway = TestGateway::start().await;
    let live = Upstream::start("live").await;
    let zero_same_tier = Upstream::start("zero-same").await;
    let zero_better_tier = Upstream::start("zero-better").await;
    let service = create_service(&gateway, json!({"name": "zero"})).await;
    add_target(&gateway, service, &zero_same_tier, 0, 0).await;
    add_target(&gateway, service, &live, 1, 0).await;
    // A tier made only of weight-0 targets has nothing available: it must not win.
    add_target(&gateway, service, &zero_better_tier, 0, -5).await;
    gateway.route_all_to(service).await;

    let counts = spread(&gateway, "/z", 1000, 4).await;
    assert_eq!(count(&counts, "live"), 1000, "{counts:?}");
    assert_eq!(zero_same_tier.hits(), 0);
    assert_eq!(zero_better_tier.hits(), 0);
}

// ---------------------------------------------------------------------------------------------
// 3. Live changes through the admin API
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_changes_carry_the_next_request_and_spare_in_flight_ones() {
    let gateway = TestGateway::start().await;
    let old = Upstream::start("old").await;
    let new = Upstream::start("new").await;
    let fresh = Upstream::start("fresh").await;
    let service = create_service(&gateway, json!({"name": "live"})).await;
    let old_id = add_target(&gateway, service, &old, 1, 0).await;
    gateway.route_all_to(service).await;
    assert_eq!(fetch(&gateway, "/fresh/x").await, "old");

    // A new route: the very next request after the API call uses it.
    let other = create_service(&gateway, json!({"name": "fresh"})).await;
    add_target(&gateway, other, &fresh, 1, 0).await;
    assert_eq!(
        fetch(&gateway, "/fresh/x").await,
        "old",
        "route not created yet"
    );
    add_route(
        &gateway,
        json!({"name": "fresh", "path_prefix": "/fresh", "service_id": other}),
    )
    .await;
    assert_eq!(fetch(&gateway, "/fresh/x").await, "fresh");

    // A slow request in flight on `old` while the service's targets change under it.
    let started = Instant::now();
    let slow = {
        let client = gateway.http.clone();
        let url = gateway.proxy_url("/slow/1500");
        tokio::spawn(async move {
            let response = client.get(url).send().await.expect("slow request answered");
            let status = response.status().as_u16();
            (status, response.text().await.expect("slow body"))
        })
    };
    wait_until("old holds the slow request", Duration::from_secs(5), || {
        let seen = old.seen.clone();
        async move { seen.lock().unwrap().iter().any(|s| s.path == "/slow/1500") }
    })
    .await;

    // A new target in a preferred tier: the very next request goes there.
    add_target(&gateway, service, &new, 1, -1).await;
    assert_eq!(fetch(&gateway, "/after-create").await, "new");
    // The target serving the slow request is deleted outright.
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/targets/{old_id}"), None)
        .await;
    assert_eq!(status, 204, "DELETE target: {body}");
    let counts = spread(&gateway, "/after-delete", 10, 1).await;
    assert_eq!(count(&counts, "new"), 10, "{counts:?}");
    assert!(
        !slow.is_finished(),
        "the slow request ended before the changes were made; the test proves nothing"
    );

    let (status, body) = slow.await.unwrap();
    assert_eq!(
        status, 200,
        "in-flight request broken by the change: {body}"
    );
    assert_eq!(body, "old");
    assert!(started.elapsed() >= Duration::from_millis(1500));
}

// ---------------------------------------------------------------------------------------------
// 4. Host and forwarding headers
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn host_header_follows_upstream_authority_target_or_client() {
    let gateway = TestGateway::start().await;
    let with_authority = Upstream::start("with-authority").await;
    let plain = Upstream::start("plain").await;
    let shop = create_service(
        &gateway,
        json!({"name": "shop", "upstream_authority": "shop.internal:8443"}),
    )
    .await;
    add_target(&gateway, shop, &with_authority, 1, 0).await;
    let bare = create_service(&gateway, json!({"name": "bare"})).await;
    add_target(&gateway, bare, &plain, 1, 0).await;
    add_route(
        &gateway,
        json!({"name": "shop", "hosts": ["shop.test"], "service_id": shop}),
    )
    .await;
    add_route(
        &gateway,
        json!({"name": "bare", "hosts": ["bare.test"], "service_id": bare}),
    )
    .await;
    add_route(
        &gateway,
        json!({"name": "keep", "hosts": ["keep.test"], "service_id": shop, "preserve_host": true}),
    )
    .await;

    assert_eq!(
        fetch_host(&gateway, "shop.test", "/h").await,
        "with-authority"
    );
    assert_eq!(
        with_authority.last_seen().header("host"),
        Some("shop.internal:8443")
    );

    assert_eq!(fetch_host(&gateway, "bare.test", "/h").await, "plain");
    let expected = plain.addr.to_string();
    assert_eq!(plain.last_seen().header("host"), Some(expected.as_str()));

    assert_eq!(
        fetch_host(&gateway, "keep.test:8080", "/h").await,
        "with-authority"
    );
    assert_eq!(
        with_authority.last_seen().header("host"),
        Some("keep.test:8080")
    );
}

#[tokio::test]
async fn forwarding_headers_and_request_id() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("up").await;
    let service = gateway
        .service_with_targets("fwd", &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;

    // Incoming X-Forwarded-For and X-Request-Id.
    let response = gateway
        .http
        .get(gateway.proxy_url("/f"))
        .header("host", "client.example")
        .header("x-forwarded-for", "203.0.113.7")
        .header("x-request-id", "req-abc-123")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        response.headers().get("x-request-id").map(|v| v.as_bytes()),
        Some(&b"req-abc-123"[..]),
        "request id not echoed"
    );
    let response_via = response
        .headers()
        .get_all("via")
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect::<Vec<_>>()
        .join(", ");
    assert!(
        response_via.contains("raahi"),
        "response Via: {response_via:?}"
    );
    let seen = upstream.last_seen();
    assert_eq!(
        joined(&seen, "x-forwarded-for").as_deref(),
        Some("203.0.113.7, 127.0.0.1")
    );
    assert_eq!(joined(&seen, "x-forwarded-proto").as_deref(), Some("http"));
    assert_eq!(
        joined(&seen, "x-forwarded-host").as_deref(),
        Some("client.example")
    );
    let via = joined(&seen, "via").unwrap_or_default();
    assert!(via.contains("raahi"), "upstream saw Via {via:?}");
    assert_eq!(
        joined(&seen, "x-request-id").as_deref(),
        Some("req-abc-123")
    );

    // None sent: the gateway adds its own and generates an id, the same one both ways.
    let mut ids = Vec::new();
    for _ in 0..2 {
        let response = gateway.get("/g").await;
        assert_eq!(response.status(), 200);
        let echoed = response
            .headers()
            .get("x-request-id")
            .expect("a generated request id is echoed")
            .to_str()
            .unwrap()
            .to_owned();
        let seen = upstream.last_seen();
        assert_eq!(
            joined(&seen, "x-forwarded-for").as_deref(),
            Some("127.0.0.1")
        );
        let sent = joined(&seen, "x-request-id").expect("upstream got a request id");
        assert!(!sent.is_empty());
        assert_eq!(
            sent, echoed,
            "upstream and client saw different request ids"
        );
        ids.push(sent);
    }
    assert_ne!(ids[0], ids[1], "generated request ids repeat");
}

#[tokio::test]
async fn forwarding_lists_keep_every_incoming_field_line() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("up").await;
    let service = gateway
        .service_with_targets("lines", &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;

    // A list header may arrive as several field lines (RFC 9110 §5.3); appending must keep all
    // of them, and a client's X-Forwarded-Proto must not survive on a plain-HTTP listener.
    let (head, _) = raw_exchange(
        gateway.proxy,
        "GET /lines HTTP/1.1\r\n\
         Host: lines.test\r\n\
         X-Forwarded-For: 198.51.100.1\r\n\
         X-Forwarded-For: 198.51.100.2\r\n\
         Via: 1.1 edge-a\r\n\
         Via: 1.1 edge-b\r\n\
         X-Forwarded-Proto: https\r\n\
         Connection: close\r\n\
         \r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "response head: {head}");
    let seen = upstream.last_seen();
    let forwarded_for = joined(&seen, "x-forwarded-for").unwrap_or_default();
    let via = joined(&seen, "via").unwrap_or_default();
    assert!(
        forwarded_for == "198.51.100.1, 198.51.100.2, 127.0.0.1"
            && via.starts_with("1.1 edge-a, 1.1 edge-b, ")
            && via.contains("raahi"),
        "a list header lost an incoming field line: X-Forwarded-For {forwarded_for:?} \
         (want \"198.51.100.1, 198.51.100.2, 127.0.0.1\"), Via {via:?} \
         (want \"1.1 edge-a, 1.1 edge-b, 1.1 raahi\")"
    );
    assert_eq!(joined(&seen, "x-forwarded-proto").as_deref(), Some("http"));
}

// ---------------------------------------------------------------------------------------------
// 5. Hop-by-hop headers
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn hop_by_hop_headers_are_not_forwarded() {
    let (gateway, upstream) = gateway_to_one_upstream("hop").await;

    let (head, body) = raw_exchange(
        gateway.proxy,
        "GET /hop HTTP/1.1\r\n\
         Host: hop.test\r\n\
         Connection: keep-alive, X-Custom-Hop\r\n\
         x-custom-hop: must-not-pass\r\n\
         Keep-Alive: timeout=5\r\n\
         TE: trailers, deflate\r\n\
         Proxy-Connection: keep-alive\r\n\
         x-ordinary: passes\r\n\
         \r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "response head: {head}");
    assert!(String::from_utf8_lossy(&body).contains("hop"));

    let seen = upstream.last_seen();
    assert_eq!(
        seen.header("x-ordinary"),
        Some("passes"),
        "{:?}",
        seen.headers
    );
    for name in ["x-custom-hop", "keep-alive", "te", "proxy-connection"] {
        assert!(
            !seen.headers.contains_key(name),
            "hop-by-hop {name} reached the upstream: {:?}",
            seen.headers
        );
    }
    let connection = joined(&seen, "connection").unwrap_or_default();
    assert!(
        !connection.to_ascii_lowercase().contains("x-custom-hop"),
        "client's Connection reached the upstream: {connection:?}"
    );

    // The upstream's hop-by-hop response header stays with the upstream connection.
    assert!(
        head_values(&head, "x-hop").is_empty(),
        "x-hop reached the client: {head}"
    );
    assert!(
        head_values(&head, "connection")
            .iter()
            .all(|v| !v.to_ascii_lowercase().contains("x-hop")),
        "upstream's Connection reached the client: {head}"
    );
    assert_eq!(head_values(&head, "x-upstream"), vec!["hop".to_owned()]);

    let response = gateway.get("/hop-again").await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().get("x-hop").is_none());
    assert_eq!(response.headers()["x-upstream"], "hop");
}

// ---------------------------------------------------------------------------------------------
// 6. Routing
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_match_host_then_longest_prefix_then_priority_and_methods() {
    let gateway = TestGateway::start().await;
    let mut upstreams = HashMap::new();
    let mut services = HashMap::new();
    for name in ["exact", "wild", "short", "long", "low", "high", "post"] {
        let upstream = Upstream::start(name).await;
        let service = gateway
            .service_with_targets(name, &[target(&upstream, 1, 0)])
            .await;
        upstreams.insert(name, upstream);
        services.insert(name, service);
    }
    let recorder = UriRecorder::start().await;
    let strip = create_service(&gateway, json!({"name": "strip"})).await;
    gateway
        .create(
            &format!("/api/v1/services/{strip}/targets"),
            recorder.target(),
        )
        .await;

    let routes = [
        json!({"name": "exact", "hosts": ["api.example.com"], "service_id": services["exact"]}),
        json!({"name": "wild", "hosts": ["*.example.com"], "service_id": services["wild"]}),
        json!({"name": "short", "path_prefix": "/api", "service_id": services["short"]}),
        json!({"name": "long", "path_prefix": "/api/v2", "service_id": services["long"]}),
        // Created first, so an id tie-break would favour it: priority must decide.
        json!({"name": "low", "path_prefix": "/p", "priority": 0, "service_id": services["low"]}),
        json!({"name": "high", "path_prefix": "/p", "priority": 5, "service_id": services["high"]}),
        json!({"name": "post", "path_prefix": "/m", "methods": ["POST"], "service_id": services["post"]}),
        json!({"name": "strip", "path_prefix": "/strip", "strip_prefix": true, "service_id": strip}),
        json!({"name": "keep", "path_prefix": "/keep", "service_id": strip}),
    ];
    for route in routes {
        add_route(&gateway, route).await;
    }

    // Host: exact beats wildcard; the wildcard covers subdomains at any depth, not the bare
    // domain; the port is not part of the match.
    assert_eq!(fetch_host(&gateway, "api.example.com", "/x").await, "exact");
    assert_eq!(
        fetch_host(&gateway, "api.example.com:8080", "/x").await,
        "exact"
    );
    assert_eq!(fetch_host(&gateway, "www.example.com", "/x").await, "wild");
    assert_eq!(fetch_host(&gateway, "a.b.example.com", "/x").await, "wild");
    assert_eq!(fetch_host(&gateway, "example.com", "/api/x").await, "short");

    // Longest path prefix, on whole segments.
    assert_eq!(fetch(&gateway, "/api/v2/users").await, "long");
    assert_eq!(fetch(&gateway, "/api/v2").await, "long");
    assert_eq!(fetch(&gateway, "/api/v1/users").await, "short");
    assert_eq!(fetch(&gateway, "/api").await, "short");
    let (status, code, _) = error_answer(gateway.get("/apix").await).await;
    assert_eq!((status, code.as_str()), (404, "no_route"));

    // Equal host and prefix: the higher priority wins.
    assert_eq!(fetch(&gateway, "/p/x").await, "high");

    // Methods filter.
    let response = send_to_host(&gateway, reqwest::Method::POST, "m.test", "/m/x").await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "post");
    let (status, code, _) = error_answer(gateway.get("/m/x").await).await;
    assert_eq!((status, code.as_str()), (404, "no_route"));

    // strip_prefix keeps the query and a leading slash; without it the path is untouched.
    assert_eq!(fetch(&gateway, "/strip/users?x=1").await, "recorder");
    assert_eq!(recorder.last(), "/users?x=1");
    assert_eq!(fetch(&gateway, "/strip").await, "recorder");
    assert_eq!(recorder.last(), "/");
    assert_eq!(fetch(&gateway, "/strip?y=2").await, "recorder");
    assert_eq!(recorder.last(), "/?y=2");
    assert_eq!(fetch(&gateway, "/keep/users?x=1").await, "recorder");
    assert_eq!(recorder.last(), "/keep/users?x=1");

    // No route at all.
    let (status, code, message) = error_answer(gateway.get("/nothing/here").await).await;
    assert_eq!((status, code.as_str()), (404, "no_route"), "{message}");
    for upstream in upstreams.values() {
        assert!(
            upstream
                .seen
                .lock()
                .unwrap()
                .iter()
                .all(|s| s.path != "/nothing/here"),
            "an unrouted request reached {}",
            upstream.name
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 7. Failures: retries, 502, 503, 504
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failures_are_retried_on_a_live_target() {
    let gateway = TestGateway::start().await;
    let live = Upstream::start("live").await;
    let service = create_service(&gateway, json!({"name": "mixed", "max_attempts": 3})).await;
    add_dead_target(&gateway, service, dead_addr()).await;
    add_target(&gateway, service, &live, 1, 0).await;
    gateway.route_all_to(service).await;

    for i in 0..50 {
        let response = gateway.get(&format!("/get/{i}")).await;
        assert_eq!(
            response.status(),
            200,
            "GET {i} not retried on the live target"
        );
        assert_eq!(response.text().await.unwrap(), "live");
    }
    assert_eq!(live.hits(), 50);

    for i in 0..20usize {
        let body = vec![b'a' + (i % 26) as u8; 10_000 + i * 1_000];
        let response = gateway
            .http
            .post(gateway.proxy_url(&format!("/post/{i}")))
            .body(body.clone())
            .send()
            .await
            .expect("proxy answers");
        assert_eq!(
            response.status(),
            200,
            "POST {i} not retried on the live target"
        );
        assert_eq!(response.text().await.unwrap(), "live");
        let seen = live.last_seen();
        assert_eq!(seen.method, "POST");
        assert_eq!(seen.path, format!("/post/{i}"));
        assert_eq!(seen.body_len, body.len(), "POST {i} body arrived cut");
    }
    assert_eq!(live.hits(), 70, "a request reached the live target twice");
}

#[tokio::test]
async fn dead_targets_answer_502_and_an_empty_service_503() {
    let gateway = TestGateway::start().await;
    let dead = create_service(&gateway, json!({"name": "all-dead", "max_attempts": 3})).await;
    let dead_targets = [dead_addr(), dead_addr()];
    for address in dead_targets {
        add_dead_target(&gateway, dead, address).await;
    }
    let empty = create_service(&gateway, json!({"name": "empty-svc"})).await;
    add_route(
        &gateway,
        json!({"name": "dead", "path_prefix": "/dead", "service_id": dead}),
    )
    .await;
    add_route(
        &gateway,
        json!({"name": "empty", "path_prefix": "/empty", "service_id": empty}),
    )
    .await;

    for method in [reqwest::Method::GET, reqwest::Method::POST] {
        let response = gateway
            .http
            .request(method.clone(), gateway.proxy_url("/dead/x"))
            .body("payload")
            .send()
            .await
            .unwrap();
        let (status, code, message) = error_answer(response).await;
        assert_eq!(
            (status, code.as_str()),
            (502, "upstream_connect_failed"),
            "{method}: {message}"
        );
        // Target addresses are internal network details: the log has them, the client not.
        for address in dead_targets {
            assert!(
                !message.contains(&address.to_string()),
                "{method}: the answer names target {address}: {message}"
            );
        }
    }

    let (status, code, message) = error_answer(gateway.get("/empty/x").await).await;
    assert_eq!((status, code.as_str()), (503, "no_available_target"));
    assert!(
        message.contains("empty-svc"),
        "503 message does not name the service: {message:?}"
    );
}

#[tokio::test]
async fn slow_response_headers_answer_504_quickly() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("slow").await;
    let service = create_service(
        &gateway,
        json!({"name": "slowpoke", "timeouts": {"response_header_ms": 200}}),
    )
    .await;
    add_target(&gateway, service, &upstream, 1, 0).await;
    gateway.route_all_to(service).await;

    let started = Instant::now();
    let response = gateway.get("/slow/2000").await;
    let elapsed = started.elapsed();
    let (status, code, message) = error_answer(response).await;
    assert_eq!(
        (status, code.as_str()),
        (504, "upstream_timeout"),
        "{message}"
    );
    assert!(
        elapsed < Duration::from_millis(1500),
        "504 took {elapsed:?} with a 200 ms response header timeout"
    );
    assert!(
        elapsed >= Duration::from_millis(190),
        "504 after only {elapsed:?}"
    );
    // A fast request on the same service is unaffected.
    assert_eq!(fetch(&gateway, "/quick").await, "slow");
}

// ---------------------------------------------------------------------------------------------
// 8. HTTP/2 prior knowledge
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn http2_prior_knowledge_is_proxied_with_the_right_host() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("h2").await;
    let named = create_service(
        &gateway,
        json!({"name": "h2-named", "upstream_authority": "h2.internal"}),
    )
    .await;
    add_target(&gateway, named, &upstream, 1, 0).await;
    let bare = create_service(&gateway, json!({"name": "h2-bare"})).await;
    add_target(&gateway, bare, &upstream, 1, 0).await;
    add_route(&gateway, json!({"name": "named", "service_id": named})).await;
    add_route(
        &gateway,
        json!({"name": "keep", "path_prefix": "/keep", "preserve_host": true, "service_id": named}),
    )
    .await;
    add_route(
        &gateway,
        json!({"name": "bare", "path_prefix": "/bare", "service_id": bare}),
    )
    .await;

    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let client_authority = gateway.proxy.to_string();

    let response = h2.get(gateway.proxy_url("/named")).send().await.unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "h2");
    let seen = upstream.last_seen();
    assert_eq!(seen.header("host"), Some("h2.internal"));
    assert_eq!(
        seen.header("x-forwarded-host"),
        Some(client_authority.as_str())
    );

    let response = h2.get(gateway.proxy_url("/keep/x")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(
        upstream.last_seen().header("host"),
        Some(client_authority.as_str())
    );

    let response = h2
        .post(gateway.proxy_url("/bare/x"))
        .body(vec![b'z'; 50_000])
        .send()
        .await
        .unwrap();
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    let seen = upstream.last_seen();
    let target_authority = upstream.addr.to_string();
    assert_eq!(seen.header("host"), Some(target_authority.as_str()));
    assert_eq!(seen.method, "POST");
    assert_eq!(seen.body_len, 50_000);
}

// (9. Streaming with flat memory: `tests/memory/proxy.rs`.)

// ---------------------------------------------------------------------------------------------
// 10. Upgrade
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn upgrade_tunnels_bytes_both_ways() {
    let (gateway, upstream) = gateway_to_one_upstream("ws").await;
    // WebSocket passes by default; another protocol only when the route names it.
    let (_, routes) = gateway.api("GET", "/api/v1/routes", None).await;
    let route = routes["items"][0]["id"].as_i64().unwrap();
    let (status, patched) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{route}"),
            Some(json!({"upgrades": ["websocket", "Echo"]})),
        )
        .await;
    assert_eq!(status, hyper::StatusCode::OK, "{patched}");
    assert_eq!(patched["upgrades"], json!(["echo", "websocket"]));

    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    stream
        .write_all(
            b"GET /ws HTTP/1.1\r\nHost: ws.test\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n",
        )
        .await
        .unwrap();
    let (head, early) = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 101"), "upgrade answer: {head}");
    assert!(
        head_values(&head, "upgrade")
            .iter()
            .any(|v| v.eq_ignore_ascii_case("echo")),
        "101 without Upgrade: echo: {head}"
    );
    assert!(
        early.is_empty(),
        "bytes before anything was sent: {early:?}"
    );
    // The harness upstream answers `/ws` before recording it in `seen`; it does count it.
    assert_eq!(upstream.hits(), 1);

    for message in [&b"ping-123"[..], &b"a second, longer message"[..]] {
        stream.write_all(message).await.unwrap();
        let mut echoed = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(5), stream.read_exact(&mut echoed))
            .await
            .expect("echo within 5 s")
            .expect("echo read");
        assert_eq!(echoed, message);
    }

    // Half-close: the client's end of stream travels to the upstream, whose close comes back.
    stream.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest))
        .await
        .expect("the tunnel closes after the client's half-close")
        .expect("read to end");
    assert!(rest.is_empty(), "unexpected bytes after close: {rest:?}");
}

/// An upgrade the route does not pass, and h2c always, goes up as a plain request: the target
/// never sees `Upgrade` (nor h2c's settings), so no tunnel bypasses the route's rules.
#[tokio::test]
async fn upgrades_the_route_does_not_pass_go_up_as_plain_requests() {
    let (gateway, upstream) = gateway_to_one_upstream("plain").await;
    for upgrade in ["h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA", "echo"] {
        let request = format!(
            "GET /not-ws HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade, HTTP2-Settings\r\n\
             Upgrade: {upgrade}\r\n\r\n"
        );
        let (head, body) = raw_exchange(gateway.proxy, &request).await;
        assert!(head.starts_with("HTTP/1.1 200"), "{upgrade}: {head}");
        assert_eq!(body, b"plain");
        let seen = upstream.last_seen();
        assert_eq!(seen.path, "/not-ws");
        assert_eq!(seen.header("upgrade"), None, "{upgrade}");
        assert_eq!(seen.header("http2-settings"), None, "{upgrade}");
    }
}

/// A request body that sends `chunks` small chunks, one every `gap`.
struct SlowBody {
    chunks: usize,
    gap: Duration,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
}

impl SlowBody {
    fn new(chunks: usize, gap: Duration) -> SlowBody {
        SlowBody {
            chunks,
            gap,
            sleep: Box::pin(tokio::time::sleep(gap)),
        }
    }
}

impl hyper::body::Body for SlowBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        if self.chunks == 0 {
            return std::task::Poll::Ready(None);
        }
        std::task::ready!(std::future::Future::poll(self.sleep.as_mut(), cx));
        self.chunks -= 1;
        let next = tokio::time::Instant::now() + self.gap;
        self.sleep.as_mut().reset(next);
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from_static(
            b"0123456789",
        )))))
    }
}

/// The response-header timeout counts from the end of the request body: an upload slower than
/// the timeout is the client's pace and must not turn into a 504.
#[tokio::test]
async fn a_slow_upload_is_not_a_response_timeout() {
    let gateway = TestGateway::start().await;
    let sink = Upstream::start("sink").await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "uploads", "timeouts": {"response_header_ms": 300}}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&sink, 1, 0),
        )
        .await;
    gateway.route_all_to(service).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<SlowBody>();
    let started = Instant::now();
    let request = hyper::Request::post(gateway.proxy_url("/upload"))
        .body(SlowBody::new(10, Duration::from_millis(100)))
        .unwrap();
    let response = client.request(request).await.expect("upload answered");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the body really was slow"
    );
    assert_eq!(
        response.status(),
        200,
        "a 1 s upload under a 300 ms header timeout"
    );
    assert_eq!(sink.last_seen().body_len, 100);

    // The timeout still applies once the body is in: a slow answer is a 504.
    let request = hyper::Request::post(gateway.proxy_url("/slow/2000"))
        .body(SlowBody::new(2, Duration::from_millis(10)))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 504);
}

// ---------------------------------------------------------------------------------------------
// 11. Review fixes: HTTP/2 cookies, absolute-form targets, aborted uploads
// ---------------------------------------------------------------------------------------------

/// `GET /api/v1/services/{id}/runtime`, asserted 200.
async fn runtime_view(gateway: &TestGateway, service: i64) -> Value {
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/services/{service}/runtime"), None)
        .await;
    assert_eq!(status, 200, "runtime view: {view}");
    view
}

/// The one target entry of a runtime view with a single target.
fn only_runtime_target(view: &Value) -> Value {
    let targets = view["targets"].as_array().expect("runtime targets");
    assert_eq!(targets.len(), 1, "one target in the runtime view: {view}");
    targets[0].clone()
}

/// HTTP/2 lets a client split `cookie` into several fields (RFC 9113 §8.2.3); an HTTP/1.1
/// upstream must get them as one field joined with "; ".
#[tokio::test]
async fn http2_cookie_fields_reach_an_http1_upstream_as_one_joined_field() {
    let (gateway, upstream) = gateway_to_one_upstream("cookies").await;

    // hyper's HTTP/2 client sends each appended value as its own header field (reqwest may
    // merge them itself).
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<Full<Bytes>>();
    let mut request = hyper::Request::get(gateway.proxy_url("/cookies"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let headers = request.headers_mut();
    headers.append(hyper::header::COOKIE, "a=1".parse().unwrap());
    headers.append(hyper::header::COOKIE, "b=2".parse().unwrap());
    let response = client.request(request).await.expect("proxy answers");
    assert_eq!(
        response.version(),
        hyper::Version::HTTP_2,
        "the client spoke HTTP/2"
    );
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"cookies");

    let seen = upstream.last_seen();
    assert_eq!(seen.path, "/cookies");
    assert_eq!(
        seen.headers.get("cookie"),
        Some(&vec!["a=1; b=2".to_owned()]),
        "the HTTP/1.1 upstream must see exactly one cookie field `a=1; b=2`; saw {:?}",
        seen.headers.get("cookie")
    );
}

/// An absolute-form request target's authority wins over the Host header (RFC 9112 §3.2.2):
/// for routing, for a preserved Host and for X-Forwarded-Host.
#[tokio::test]
async fn an_absolute_form_authority_wins_over_the_host_header() {
    let gateway = TestGateway::start().await;
    let public = Upstream::start("public").await;
    let internal = Upstream::start("internal").await;
    let public_service = create_service(&gateway, json!({"name": "public"})).await;
    add_target(&gateway, public_service, &public, 1, 0).await;
    let internal_service = create_service(&gateway, json!({"name": "internal"})).await;
    add_target(&gateway, internal_service, &internal, 1, 0).await;
    add_route(
        &gateway,
        json!({"name": "public", "hosts": ["public.test"], "service_id": public_service,
               "preserve_host": true}),
    )
    .await;
    add_route(
        &gateway,
        json!({"name": "internal", "hosts": ["internal.test"], "service_id": internal_service}),
    )
    .await;

    let (head, body) = raw_exchange(
        gateway.proxy,
        "GET http://public.test/x HTTP/1.1\r\n\
         Host: internal.test\r\n\
         Connection: close\r\n\
         \r\n",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "response head: {head}");
    assert_eq!(
        String::from_utf8_lossy(&body),
        "public",
        "the route of the URI's authority answers"
    );
    assert_eq!(internal.hits(), 0, "the Host header's route was not used");
    let seen = public.last_seen();
    assert_eq!(seen.path, "/x");
    assert_eq!(
        seen.headers.get("host"),
        Some(&vec!["public.test".to_owned()]),
        "preserve_host sends the URI's authority, not the Host header"
    );
    assert_eq!(
        seen.headers.get("x-forwarded-host"),
        Some(&vec!["public.test".to_owned()]),
        "X-Forwarded-Host names the URI's authority"
    );
}

/// A client that goes away in the middle of its upload broke the request, not the target: the
/// target must neither count a failure nor be ejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_aborting_its_upload_is_not_an_upstream_failure() {
    const CHUNK: usize = 1_000;
    let gateway = TestGateway::start().await;
    let sink = Upstream::start("sink").await;
    let service = create_service(
        &gateway,
        json!({"name": "uploads", "ejection": {"failures": 2, "window_ms": 60000}}),
    )
    .await;
    add_target(&gateway, service, &sink, 1, 0).await;
    // A streaming route: the upload must be under way at the target when the client leaves.
    gateway.route_all_streaming_to(service).await;

    for attempt in 1..=3usize {
        let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
        stream
            .write_all(
                b"POST /upload HTTP/1.1\r\n\
                  Host: uploads.test\r\n\
                  Content-Length: 1000000\r\n\
                  \r\n",
            )
            .await
            .unwrap();
        stream.write_all(&[b'u'; CHUNK]).await.unwrap();
        stream.flush().await.unwrap();
        // The upload is under way: the upstream has its first bytes.
        wait_until(
            &format!("upload {attempt} reaches the upstream"),
            Duration::from_secs(10),
            || async { sink.body_bytes.load(Ordering::SeqCst) >= (attempt * CHUNK) as u64 },
        )
        .await;
        drop(stream);
        // The gateway gave the upstream connection up (the upstream saw its body end early)
        // and finished the request (the target's in-flight count is back to 0; the outcome is
        // recorded before that).
        wait_until(
            &format!("aborted upload {attempt} is over at the upstream"),
            Duration::from_secs(10),
            || async { sink.seen.lock().unwrap().len() >= attempt },
        )
        .await;
        wait_until(
            &format!("aborted upload {attempt} is over at the gateway"),
            Duration::from_secs(10),
            || async {
                only_runtime_target(&runtime_view(&gateway, service).await)["in_flight"] == 0
            },
        )
        .await;
    }
    let seen = sink.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3, "{seen:?}");
    for request in &seen {
        assert_eq!(request.method, "POST");
        assert!(
            request.body_len < 1_000_000,
            "an aborted upload arrived whole: {request:?}"
        );
    }

    let view = runtime_view(&gateway, service).await;
    let entry = only_runtime_target(&view);
    assert_eq!(
        entry["ejected_until"],
        Value::Null,
        "three aborted uploads ejected the target: {view}"
    );
    assert_eq!(entry["available"], true, "{view}");
    assert_eq!(view["panic_picks"], 0, "{view}");

    // A normal request goes to it as an available target, not as a panic pick.
    assert_eq!(fetch(&gateway, "/after").await, "sink");
    let view = runtime_view(&gateway, service).await;
    assert_eq!(
        view["panic_picks"], 0,
        "the target was picked in panic mode: {view}"
    );
    assert_eq!(only_runtime_target(&view)["available"], true, "{view}");
}

/// A gateway whose `proxy.client_header_timeout_ms` is 400, routing every request to one
/// upstream named `name`.
async fn gateway_with_header_timeout_400ms(name: &str) -> (TestGateway, Upstream) {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let mut config = test_config(dir.path());
    config.proxy.client_header_timeout_ms = 400;
    let gateway = TestGateway::start_with(dir, config).await;
    let upstream = Upstream::start(name).await;
    let service = gateway
        .service_with_targets(name, &[target(&upstream, 100, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": name, "service_id": service}),
        )
        .await;
    (gateway, upstream)
}

/// A client that connects and stays silent is closed after `proxy.client_header_timeout_ms`;
/// one that speaks late, within it, is served as usual (the connection waits cheaply for its
/// first bytes before HTTP is set up).
#[tokio::test]
async fn a_silent_connection_is_closed_after_the_client_header_timeout() {
    let (gateway, _upstream) = gateway_with_header_timeout_400ms("late").await;

    let mut late = TcpStream::connect(gateway.proxy).await.unwrap();
    let mut silent = TcpStream::connect(gateway.proxy).await.unwrap();
    tokio::time::sleep(Duration::from_millis(150)).await;
    late.write_all(b"GET /late HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), late.read_to_end(&mut answer))
        .await
        .expect("the late client is answered")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the silent connection is closed");
    assert!(rest.is_empty(), "nothing is sent to a silent client");
}

/// A client that sends its request head a byte at a time, slower than
/// `proxy.client_header_timeout_ms` allows for the whole head, gets a named 408 and a closed
/// connection: on a fresh connection, and on one that has served a request (and parked) first.
#[tokio::test]
async fn a_request_head_dribbled_past_the_header_timeout_gets_408() {
    let (gateway, upstream) = gateway_with_header_timeout_400ms("dribble").await;

    for name in ["used", "fresh"] {
        // Connected right before it speaks: a connection silent for the header timeout is
        // closed before any head (another test covers that).
        let mut stream = match name {
            "used" => connection_after_one_request(&gateway, "x").await,
            _ => TcpStream::connect(gateway.proxy).await.unwrap(),
        };
        let started = Instant::now();
        let (mut reader, mut writer) = stream.split();
        // Each byte moves the connection, so it never rests long enough to park; only the
        // header timeout can end this.
        let dribble = async {
            for byte in b"GET /never-finished HTTP/1.1\r\nHost: x\r\nX-Pad: "
                .iter()
                .cycle()
            {
                if writer.write_all(&[*byte]).await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        let answer = async {
            let mut answer = Vec::new();
            let _ = reader.read_to_end(&mut answer).await;
            answer
        };
        let answer = tokio::select! {
            answer = answer => answer,
            () = dribble => panic!("{name}: the dribbling ended before an answer"),
            () = tokio::time::sleep(Duration::from_secs(10)) => panic!("{name}: no answer within 10 s"),
        };
        let answer = String::from_utf8_lossy(&answer).into_owned();
        let (head, body) = answer.split_once("\r\n\r\n").expect("a whole answer");
        assert!(head.starts_with("HTTP/1.1 408"), "{name}: {head}");
        assert_eq!(head_values(head, "connection"), ["close"], "{name}: {head}");
        let error = json_error(408, &head_values(head, "content-type")[0], body);
        assert_eq!(error.code, "client_header_timeout", "{name}: {body}");
        assert!(
            started.elapsed() >= Duration::from_millis(400),
            "{name}: answered before the header timeout, after {:?}",
            started.elapsed()
        );
    }
    assert_eq!(
        upstream.hits(),
        1,
        "the unfinished heads never went upstream"
    );
}

/// Empty lines between requests are allowed (RFC 9112 §2.2): a keep-alive client that sent one
/// and then rested past the header timeout is closed without an answer it never asked for.
#[tokio::test]
async fn an_empty_line_after_a_response_gets_no_unasked_408() {
    let (gateway, _upstream) = gateway_with_header_timeout_400ms("crlf").await;

    let mut stream = connection_after_one_request(&gateway, "x").await;
    let started = Instant::now();
    stream.write_all(b"\r\n").await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest))
        .await
        .expect("the connection is closed after the header timeout")
        .unwrap();
    assert!(
        rest.is_empty(),
        "an unasked answer: {}",
        String::from_utf8_lossy(&rest)
    );
    assert!(started.elapsed() >= Duration::from_millis(400));
}

// ---------------------------------------------------------------------------------------------
// 11. Idle HTTP/1.1 connections park: they give back their HTTP buffers and stay open
// ---------------------------------------------------------------------------------------------

/// One `/metrics` series without labels.
async fn metric(gateway: &TestGateway, series: &str) -> u64 {
    let text = gateway
        .http
        .get(gateway.admin_url("/metrics"))
        .send()
        .await
        .expect("metrics answer")
        .text()
        .await
        .expect("metrics text");
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from /metrics:\n{text}"))
}

/// Reads one response with a Content-Length body off a keep-alive connection.
async fn read_response(stream: &mut TcpStream) -> (String, Vec<u8>) {
    let (head, mut body) = read_head(stream).await;
    let length: usize = head_values(&head, "content-length")
        .first()
        .expect("a Content-Length response")
        .parse()
        .unwrap();
    let mut chunk = vec![0u8; 64 * 1024];
    while body.len() < length {
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("body bytes within 10 s")
            .expect("read");
        assert!(n > 0, "closed after {} of {length} body bytes", body.len());
        body.extend_from_slice(&chunk[..n]);
    }
    assert_eq!(body.len(), length, "bytes past the response on {head}");
    (head, body)
}

/// A keep-alive connection through the proxy that has been answered `GET /first` with a 200
/// (the whole response read).
async fn connection_after_one_request(gateway: &TestGateway, host: &str) -> TcpStream {
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    stream
        .write_all(format!("GET /first HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let (head, _) = read_response(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    stream
}

#[tokio::test]
async fn an_idle_keep_alive_connection_parks_and_serves_its_next_request() {
    let (gateway, upstream) = gateway_to_one_upstream("park").await;

    let mut client = connection_after_one_request(&gateway, "park.test").await;

    wait_until(
        "the idle connection parks",
        Duration::from_secs(10),
        || async { metric(&gateway, "raahi_parked_client_connections").await == 1 },
    )
    .await;
    assert!(metric(&gateway, "raahi_client_connection_parks_total").await >= 1);

    client
        .write_all(b"GET /second HTTP/1.1\r\nHost: park.test\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_response(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(upstream.last_seen().path, "/second");
    assert_eq!(upstream.hits(), 2);
    assert_eq!(
        metric(&gateway, "raahi_parked_client_connections").await,
        0,
        "a connection with a request in hand is no longer parked"
    );
}

/// hyper hands back the bytes it read but had not parsed when the connection parks: a request
/// head interrupted by a pause longer than the idle check must still arrive whole.
#[tokio::test]
async fn a_request_head_split_by_a_park_arrives_whole() {
    let (gateway, upstream) = gateway_to_one_upstream("split").await;

    let mut client = connection_after_one_request(&gateway, "split.test").await;
    client
        .write_all(b"GET /split-head HTTP/1.1\r\nHost: split.test\r\n")
        .await
        .unwrap();
    wait_until(
        "the connection parks with half a request head",
        Duration::from_secs(10),
        || async { metric(&gateway, "raahi_client_connection_parks_total").await >= 1 },
    )
    .await;
    client.write_all(b"X-Rest: arrived\r\n\r\n").await.unwrap();
    let (head, body) = read_response(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(!body.is_empty());
    let seen = upstream.last_seen();
    assert_eq!(seen.path, "/split-head");
    assert_eq!(seen.header("x-rest"), Some("arrived"));
    assert_eq!(upstream.hits(), 2);
}

/// A response still streaming to a client that is not reading is activity, not idleness: the
/// connection is neither parked nor closed under it, and stays usable afterwards.
#[tokio::test]
async fn a_stalled_reader_of_a_long_response_keeps_its_connection() {
    let (gateway, _upstream) = gateway_to_one_upstream("stall").await;

    const BIG: usize = 32 * 1024 * 1024;
    let mut stalled = TcpStream::connect(gateway.proxy).await.unwrap();
    stalled
        .write_all(format!("GET /bytes/{BIG} HTTP/1.1\r\nHost: stall.test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    // Another connection parks twice while the first one reads nothing: the stalled
    // connection has sat through at least one whole idle check by then.
    let mut idle = TcpStream::connect(gateway.proxy).await.unwrap();
    for parks in 1..=2u64 {
        idle.write_all(b"GET /tick HTTP/1.1\r\nHost: stall.test\r\n\r\n")
            .await
            .unwrap();
        read_response(&mut idle).await;
        wait_until(
            "the other connection parks",
            Duration::from_secs(10),
            || async { metric(&gateway, "raahi_client_connection_parks_total").await >= parks },
        )
        .await;
    }
    assert_eq!(
        metric(&gateway, "raahi_parked_client_connections").await,
        1,
        "only the idle connection is parked"
    );
    let (head, body) = read_response(&mut stalled).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body.len(), BIG);
    assert!(
        head_values(&head, "connection").is_empty(),
        "keep-alive was not turned off: {head}"
    );
    stalled
        .write_all(b"GET /after HTTP/1.1\r\nHost: stall.test\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_response(&mut stalled).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
}

/// Shutdown waits for requests in flight, not for idle clients: parked connections and idle
/// ones not yet parked close at once, and the drain ends long before the 30 s grace.
#[tokio::test]
async fn shutdown_closes_parked_and_idle_connections_at_once() {
    let (mut gateway, _upstream) = gateway_to_one_upstream("bye").await;

    let request = b"GET / HTTP/1.1\r\nHost: bye.test\r\n\r\n";
    let mut parked = TcpStream::connect(gateway.proxy).await.unwrap();
    parked.write_all(request).await.unwrap();
    read_response(&mut parked).await;
    wait_until("a connection parks", Duration::from_secs(10), || async {
        metric(&gateway, "raahi_parked_client_connections").await == 1
    })
    .await;
    let mut idle = TcpStream::connect(gateway.proxy).await.unwrap();
    idle.write_all(request).await.unwrap();
    read_response(&mut idle).await;

    let shutdown = gateway.gateway.take().expect("running").shutdown();
    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("shutdown does not wait for idle client connections");
    for (name, stream) in [("parked", &mut parked), ("idle", &mut idle)] {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut rest))
            .await
            .unwrap_or_else(|_| panic!("the {name} connection is closed"));
        assert!(read.is_ok() && rest.is_empty(), "{name}: {read:?} {rest:?}");
    }
}

/// A request waiting on a slow upstream moves no bytes for several idle checks; it is in
/// flight, so its connection neither parks nor loses keep-alive under it.
#[tokio::test]
async fn a_request_waiting_on_a_slow_upstream_keeps_its_connection() {
    let (gateway, upstream) = gateway_to_one_upstream("slow").await;

    let mut client = TcpStream::connect(gateway.proxy).await.unwrap();
    // Three idle checks (0.5 s each) pass while the upstream thinks.
    client
        .write_all(b"GET /slow/1600 HTTP/1.1\r\nHost: slow.test\r\n\r\n")
        .await
        .unwrap();
    let (head, body) = read_response(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(body, b"slow");
    assert!(
        head_values(&head, "connection").is_empty(),
        "keep-alive was not turned off: {head}"
    );
    client
        .write_all(b"GET /again HTTP/1.1\r\nHost: slow.test\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = read_response(&mut client).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(upstream.hits(), 2);
}

/// A gateway whose route `all` sends every request to the one target at `address`.
async fn gateway_to_address(name: &str, address: SocketAddr) -> TestGateway {
    let gateway = TestGateway::start().await;
    let service = gateway
        .service_with_targets(
            name,
            &[json!({"host": address.ip().to_string(), "port": address.port(), "weight": 1})],
        )
        .await;
    gateway.route_all_to(service).await;
    gateway
}

/// Requests to a plain target reuse one keep-alive connection: each goes back to the pool once
/// its response (a body of known length, an empty HEAD answer) has been read.
#[tokio::test]
async fn sequential_requests_reuse_one_upstream_connection() {
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;

    let (address, accepted) = counting_origin(|stream| async move {
        let service = service_fn(
            |request: hyper::Request<hyper::body::Incoming>| async move {
                let body = if request.method() == hyper::Method::HEAD {
                    ""
                } else {
                    "ok\n"
                };
                Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from(body))))
            },
        );
        let _ = http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
    })
    .await;
    let gateway = gateway_to_address("reuse", address).await;

    for round in 0..20 {
        let response = gateway.get(&format!("/round/{round}")).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "ok\n");
        let head = gateway
            .http
            .head(gateway.proxy_url("/head"))
            .send()
            .await
            .unwrap();
        assert_eq!(head.status(), 200);
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "40 sequential requests should share one upstream connection"
    );
}

/// A chunked response that ends with trailers also gives its upstream connection back (hyper
/// stops polling a body after its trailers). The origin writes raw HTTP/1.1, as servers that
/// send trailers unasked do.
#[tokio::test]
async fn a_chunked_response_with_trailers_gives_its_connection_back() {
    let (address, accepted) = counting_origin(|mut stream| async move {
        let mut pending = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                pending.drain(..end + 4);
                let answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                    3\r\nok\n\r\n0\r\nX-Checksum: 1\r\n\r\n";
                if stream.write_all(answer).await.is_err() {
                    return;
                }
            }
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => pending.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    let gateway = gateway_to_address("trailers", address).await;

    for round in 0..10 {
        let response = gateway.get(&format!("/chunked/{round}")).await;
        assert_eq!(response.status(), 200);
        assert_eq!(response.text().await.unwrap(), "ok\n");
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "10 sequential requests should share one upstream connection"
    );
}
