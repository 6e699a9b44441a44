//! Admin API checks for the TLS and L4 objects: what a certificate, a stream route or a protocol
//! change is refused for, and that nothing is stored or bound when it is. And the admin
//! listener's own edge: connections that send nothing, half a head or rest close after the
//! header timeout, an event stream never counts as idle, the connection cap, and new tokens'
//! answers are never cached.

use crate::common;

use std::time::Duration;

use common::{ApiError, TestGateway};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);

fn self_signed(names: &[&str]) -> (String, String) {
    let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
    let generated = rcgen::generate_simple_self_signed(names).expect("rcgen");
    (generated.cert.pem(), generated.signing_key.serialize_pem())
}

async fn service(gateway: &TestGateway, name: &str, protocol: &str) -> i64 {
    gateway
        .create(
            "/api/v1/services",
            json!({"name": name, "protocol": protocol}),
        )
        .await
}

fn error_field(body: &Value) -> String {
    ApiError::read(body).field.unwrap_or_default()
}

#[tokio::test]
async fn certificate_is_checked_and_its_key_never_returned() {
    let gateway = TestGateway::start().await;
    let (cert_pem, key_pem) = self_signed(&["shop.test", "*.shop.test"]);
    let (_, other_key) = self_signed(&["shop.test"]);

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": "-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n", "key_pem": key_pem})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "cert_pem", "{body}");

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert_pem, "key_pem": other_key})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "key_pem", "{body}");

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert_pem, "key_pem": key_pem, "snis": ["other.test"]})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "snis", "{body}");

    let (status, listed) = gateway.api("GET", "/api/v1/certificates", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed["items"],
        json!([]),
        "refused certificates are not stored"
    );

    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert_pem, "key_pem": key_pem})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["snis"], json!(["*.shop.test", "shop.test"]));
    assert!(created["not_after"].is_string(), "{created}");
    assert!(created.get("key_pem").is_none(), "{created}");
    let id = created["id"].as_i64().unwrap();
    let (_, fetched) = gateway
        .api("GET", &format!("/api/v1/certificates/{id}"), None)
        .await;
    assert!(fetched.get("key_pem").is_none(), "{fetched}");
    assert!(!fetched.to_string().contains("PRIVATE KEY"), "{fetched}");

    // A second certificate for a name already served is a conflict on `snis`.
    let (cert2, key2) = self_signed(&["shop.test"]);
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({"cert_pem": cert2, "key_pem": key2})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "snis", "{body}");

    // Certificates hold private keys: viewers may not read them.
    let (status, token) = gateway
        .api(
            "POST",
            "/api/v1/tokens",
            Some(json!({"name": "reader", "role": "viewer"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let viewer = token["token"].as_str().expect("secret returned once");
    let (status, _) = gateway
        .api_as(Some(viewer), "GET", "/api/v1/certificates", None)
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

#[tokio::test]
async fn service_ca_bundle_must_be_pem_certificates() {
    let gateway = TestGateway::start().await;
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "secure", "protocol": "https", "tls_ca_pem": "garbage"})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "tls_ca_pem", "{body}");

    let (ca_pem, _) = self_signed(&["ca.test"]);
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "secure", "protocol": "https", "tls_ca_pem": ca_pem, "tls_sni": "api.test"})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{body}");
    assert_eq!(body["tls_ca_pem"], json!(ca_pem));
    assert_eq!(body["tls_verify"], json!(true));
}

#[tokio::test]
async fn stream_route_fits_its_service_and_listen_address() {
    let gateway = TestGateway::start().await;
    let web = service(&gateway, "web", "http").await;
    let tcp = service(&gateway, "db", "tcp").await;
    let tls_a = service(&gateway, "tls-a", "tls").await;
    let tls_b = service(&gateway, "tls-b", "tls").await;
    let listen = common::free_addr();

    let refused = [
        (
            json!({"listen": "127.0.0.1:0", "service_id": tcp}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "listen",
        ),
        (
            json!({"listen": listen, "service_id": web}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "service_id",
        ),
        (
            json!({"listen": listen, "service_id": 9999}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "service_id",
        ),
        (
            json!({"listen": listen, "sni": "a.test", "service_id": tcp}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "sni",
        ),
        (
            json!({"listen": listen, "sni": "not a name", "service_id": tls_a}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "sni",
        ),
        (
            json!({"listen": "localhost:80", "service_id": tcp}),
            StatusCode::UNPROCESSABLE_ENTITY,
            "listen",
        ),
    ];
    for (body, expected, field) in refused {
        let (status, answer) = gateway
            .api("POST", "/api/v1/stream-routes", Some(body.clone()))
            .await;
        assert_eq!(status, expected, "{body} -> {answer}");
        assert_eq!(error_field(&answer), field, "{body} -> {answer}");
    }
    let (_, listed) = gateway.api("GET", "/api/v1/stream-routes", None).await;
    assert_eq!(listed["items"], json!([]), "nothing refused was stored");

    // Passthrough routes share a listener; a tcp route cannot join them.
    let a = gateway
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen, "sni": "A.test", "service_id": tls_a}),
        )
        .await;
    let (_, route_a) = gateway
        .api("GET", &format!("/api/v1/stream-routes/{a}"), None)
        .await;
    assert_eq!(route_a["sni"], "a.test", "SNI is lower-cased");
    gateway
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen, "sni": "b.test", "service_id": tls_b}),
        )
        .await;
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": listen, "sni": "a.test", "service_id": tls_b})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "sni", "{body}");
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": listen, "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "listen", "{body}");
    // A catch-all passthrough route (no SNI, tls service) may join.
    gateway
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen, "service_id": tls_b}),
        )
        .await;

    // The services' protocols are now pinned by their routes.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{tls_a}"),
            Some(json!({"protocol": "tcp"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "protocol", "{body}");
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/services/{tls_a}"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");

    // The catch-all's tls service cannot turn tcp: its address is shared with SNI routes.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{tls_b}"),
            Some(json!({"protocol": "tcp"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "protocol", "{body}");

    // An HTTP route cannot send to a tcp service, and an http service with routes stays http.
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/routes",
            Some(json!({"name": "wrong", "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(error_field(&body), "service_id", "{body}");
    gateway
        .create("/api/v1/routes", json!({"name": "site", "service_id": web}))
        .await;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{web}"),
            Some(json!({"protocol": "tcp"})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{web}"),
            Some(json!({"protocol": "https"})),
        )
        .await;
    assert_eq!(
        status,
        StatusCode::OK,
        "http to https keeps the route valid: {body}"
    );
}

#[tokio::test]
async fn taken_listen_address_is_a_conflict_naming_it_and_nothing_is_stored() {
    let gateway = TestGateway::start().await;
    let tcp = service(&gateway, "db", "tcp").await;
    let holder = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let taken = holder.local_addr().unwrap();
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": taken, "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert_eq!(error_field(&body), "listen", "{body}");
    assert!(
        ApiError::read(&body).message.contains(&taken.to_string()),
        "the message names the address: {body}"
    );
    let (_, listed) = gateway.api("GET", "/api/v1/stream-routes", None).await;
    assert_eq!(listed["items"], json!([]));

    // The gateway's own proxy port is taken too.
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": gateway.proxy, "service_id": tcp})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    drop(holder);
}

// ---------------------------------------------------------------------------------------------
// The admin listener's own limits: timeouts, the connection cap, secrets never cached
// ---------------------------------------------------------------------------------------------

/// One `/metrics` series without labels, asked on a connection of its own (closed after).
async fn admin_metric(gateway: &TestGateway, series: &str) -> Option<u64> {
    let text = common::raw_http(
        gateway.admin,
        "GET /metrics HTTP/1.1\r\nHost: raahi\r\nConnection: close\r\n\r\n",
    )
    .await;
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|value| value.trim().parse().ok())
}

/// Reads until the gateway closes the connection; false when it is still open after `within`.
async fn closed_within(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    let mut rest = Vec::new();
    matches!(
        tokio::time::timeout(within, stream.read_to_end(&mut rest)).await,
        Ok(Ok(_)) | Ok(Err(_))
    )
}

async fn gateway_with(edit: impl FnOnce(&mut raahi::config::Config)) -> TestGateway {
    let dir = std::sync::Arc::new(tempfile::tempdir().unwrap());
    let mut config = common::test_config(dir.path());
    edit(&mut config);
    TestGateway::start_with(dir, config).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_connections_silent_half_sent_or_resting_close_after_the_header_timeout() {
    const TIMEOUT: Duration = Duration::from_millis(500);
    let gateway = gateway_with(|config| {
        config.proxy.client_header_timeout_ms = TIMEOUT.as_millis() as u64;
    })
    .await;
    let mut silent = TcpStream::connect(gateway.admin).await.unwrap();
    let mut half = TcpStream::connect(gateway.admin).await.unwrap();
    half.write_all(b"GET /healthz HTTP/1.1\r\nHost: raahi\r\n")
        .await
        .unwrap();
    let half_sent = Instant::now();
    let mut resting = TcpStream::connect(gateway.admin).await.unwrap();
    resting
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: raahi\r\n\r\n")
        .await
        .unwrap();
    let (head, _) = common::read_head(&mut resting).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        !head.to_ascii_lowercase().contains("connection: close"),
        "a keep-alive answer: {head}"
    );

    assert!(
        closed_within(&mut half, Duration::from_secs(10)).await,
        "a half-sent head is still open after 10 s"
    );
    assert!(
        half_sent.elapsed() >= TIMEOUT - Duration::from_millis(50),
        "closed before the header timeout: {:?}",
        half_sent.elapsed()
    );
    assert!(
        closed_within(&mut silent, Duration::from_secs(10)).await,
        "a silent connection is still open after 10 s"
    );
    assert!(
        closed_within(&mut resting, Duration::from_secs(10)).await,
        "an idle keep-alive connection is still open after 10 s"
    );
    // Only the asking connection is left.
    common::wait_until("one admin connection open", WAIT, || async {
        admin_metric(&gateway, "raahi_admin_connections").await == Some(1)
    })
    .await;
}

/// An SSE client through reqwest, over HTTP/1.1 or HTTP/2.
async fn event_stream(client: &reqwest::Client, gateway: &TestGateway) -> reqwest::Response {
    let response = client
        .get(gateway.admin_url("/api/v1/events"))
        .bearer_auth(common::ADMIN_TOKEN)
        .send()
        .await
        .expect("events answer");
    assert_eq!(response.status(), 200);
    response
}

/// Reads a stream until `needle` arrived; fails when it ends or stays silent for 10 s.
async fn read_until(response: &mut reqwest::Response, needle: &str) {
    let mut seen = String::new();
    while !seen.contains(needle) {
        let chunk = tokio::time::timeout(WAIT, response.chunk())
            .await
            .unwrap_or_else(|_| panic!("nothing for 10 s; waiting for {needle:?}"))
            .expect("the stream reads")
            .unwrap_or_else(|| panic!("the stream ended before {needle:?}"));
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
}

/// Reads an HTTP/2 response body until `needle` arrived.
async fn read_body_until(body: &mut hyper::body::Incoming, needle: &str) {
    use http_body_util::BodyExt;
    let mut seen = String::new();
    while !seen.contains(needle) {
        let frame = tokio::time::timeout(WAIT, body.frame())
            .await
            .unwrap_or_else(|_| panic!("nothing for 10 s; waiting for {needle:?}"))
            .unwrap_or_else(|| panic!("the stream ended before {needle:?}"))
            .expect("the stream reads");
        if let Some(data) = frame.data_ref() {
            seen.push_str(&String::from_utf8_lossy(data));
        }
    }
}

fn http2_get(
    gateway: &TestGateway,
    path: &str,
) -> hyper::Request<http_body_util::Empty<bytes::Bytes>> {
    hyper::Request::get(format!("http://{}{path}", gateway.admin))
        .header("authorization", format!("Bearer {}", common::ADMIN_TOKEN))
        .body(http_body_util::Empty::new())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_stream_is_not_idle_however_long_it_runs() {
    const TIMEOUT: Duration = Duration::from_millis(300);
    let gateway = gateway_with(|config| {
        config.proxy.client_header_timeout_ms = TIMEOUT.as_millis() as u64;
        config.proxy.http2_idle_timeout_ms = TIMEOUT.as_millis() as u64;
    })
    .await;
    let mut over_http1 = event_stream(&gateway.http, &gateway).await;
    assert_eq!(over_http1.version(), reqwest::Version::HTTP_11);
    read_until(&mut over_http1, "event: snapshot").await;
    // HTTP/2 on one connection of the test's own, to see what becomes of it.
    let (mut http2, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(TcpStream::connect(gateway.admin).await.unwrap()),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    let answer = http2
        .send_request(http2_get(&gateway, "/api/v1/events"))
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let mut over_http2 = answer.into_body();
    read_body_until(&mut over_http2, "event: snapshot").await;

    common::holds_for(
        "both event streams open past five idle timeouts",
        TIMEOUT * 5,
        || async { admin_metric(&gateway, "raahi_admin_event_streams").await == Some(2) },
    )
    .await;
    // The HTTP/2 connection was never told GOAWAY: it still takes new requests.
    let answer = http2
        .send_request(http2_get(&gateway, "/healthz"))
        .await
        .expect("a new request on the streaming HTTP/2 connection");
    assert_eq!(answer.status(), 200);
    // Both streams still receive what happens.
    service(&gateway, "late-news", "http").await;
    read_until(&mut over_http1, "late-news").await;
    read_body_until(&mut over_http2, "late-news").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_connection_cap_closes_the_next_and_admits_again_once_one_leaves() {
    let gateway = gateway_with(|config| config.admin.max_connections = 3).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(gateway.admin).await.unwrap());
    }
    // The fourth is closed at once (an admitted one would wait 30 s for its request).
    let mut refused = TcpStream::connect(gateway.admin).await.unwrap();
    let _ = refused
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: raahi\r\n\r\n")
        .await;
    assert!(
        closed_within(&mut refused, Duration::from_secs(5)).await,
        "a connection past admin.max_connections was admitted"
    );
    // One leaves: a new connection is served again.
    drop(held.pop());
    common::wait_until("a new admin connection served", WAIT, || async {
        common::raw_http(
            gateway.admin,
            "GET /healthz HTTP/1.1\r\nHost: raahi\r\nConnection: close\r\n\r\n",
        )
        .await
        .starts_with("HTTP/1.1 200")
    })
    .await;
    let refusals = admin_metric(&gateway, "raahi_admin_connections_refused_total")
        .await
        .expect("the refusal counter");
    assert!(refusals >= 1, "{refusals}");
    common::wait_until("two held and the asking connection open", WAIT, || async {
        admin_metric(&gateway, "raahi_admin_connections").await == Some(3)
    })
    .await;
}

#[tokio::test]
async fn a_new_tokens_answer_is_never_cached() {
    let gateway = TestGateway::start().await;
    let response = gateway
        .http
        .post(gateway.admin_url("/api/v1/tokens"))
        .bearer_auth(common::ADMIN_TOKEN)
        .json(&json!({"name": "ci", "role": "viewer"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        response
            .headers()
            .get("cache-control")
            .map(|value| value.to_str().unwrap()),
        Some("no-store")
    );
    let body: Value = response.json().await.unwrap();
    assert!(body["token"].is_string(), "{body}");
}
