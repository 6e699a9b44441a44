//! A request body that stops moving: the gateway answers instead of holding the request (and an
//! upstream connection) forever, and says who stalled.

use crate::common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

async fn gateway_with(upstream_host: &str, upstream_port: u16) -> TestGateway {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "uploads", "timeouts": {"response_header_ms": 400}, "ejection": false}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({"host": upstream_host, "port": upstream_port}),
        )
        .await;
    gateway.route_all_streaming_to(service).await;
    gateway
}

async fn read_head(stream: &mut TcpStream) -> String {
    let mut response = Vec::new();
    let mut buffer = [0u8; 4096];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !response.windows(4).any(|w| w == b"\r\n\r\n") {
        let read = tokio::time::timeout_at(deadline, stream.read(&mut buffer))
            .await
            .expect("the gateway answers before the deadline")
            .unwrap();
        if read == 0 {
            break;
        }
        response.extend_from_slice(&buffer[..read]);
    }
    String::from_utf8_lossy(&response).into_owned()
}

#[tokio::test]
async fn a_client_that_stops_sending_its_body_gets_408() {
    let upstream = Upstream::start("sink").await;
    let gateway = gateway_with("127.0.0.1", upstream.addr.port()).await;
    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    stream
        .write_all(
            b"POST /upload HTTP/1.1\r\nHost: a.test\r\nContent-Length: 100000\r\n\r\n0123456789",
        )
        .await
        .unwrap();
    let started = Instant::now();
    let head = read_head(&mut stream).await;
    assert!(head.starts_with("HTTP/1.1 408"), "{head}");
    assert!(head.contains("x-request-id"), "{head}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(350),
        "answered after {waited:?}"
    );
    assert!(waited < Duration::from_secs(3), "answered after {waited:?}");
}

#[tokio::test]
async fn an_upstream_that_stops_reading_the_body_gets_504() {
    // Accepts, reads the request head, then never reads again: the body backs up.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (stalled_tx, mut stalled_rx) = tokio::sync::mpsc::channel::<TcpStream>(4);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut head = [0u8; 1024];
            let _ = stream.read(&mut head).await;
            // Keep the connection open and unread for the test's lifetime.
            let _ = stalled_tx.send(stream).await;
        }
    });
    let gateway = gateway_with("127.0.0.1", port).await;
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<GeneratedBody>();
    let request = hyper::Request::post(gateway.proxy_url("/upload"))
        .body(GeneratedBody::new(256 << 20))
        .unwrap();
    let started = Instant::now();
    let response = tokio::time::timeout(Duration::from_secs(20), client.request(request))
        .await
        .expect("the gateway answers instead of waiting forever")
        .expect("a response");
    assert_eq!(response.status(), 504);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        common::ProxyError::read(&body).code,
        "upstream_send_timeout",
        "{body}"
    );
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(
        stalled_rx.try_recv().is_ok(),
        "the request reached the stalled upstream"
    );
}
