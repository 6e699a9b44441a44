//! gRPC through the gateway with a stock client and server (tonic on both sides) over `h2c`
//! services: every streaming mode, large messages, status and metadata, deadlines,
//! cancellation, multiplexing, GOAWAY under load, Raahi's own failures as gRPC statuses, an
//! HTTP/1.1 client, and gRPC health checks.

use crate::common;
use common::grpc::*;
use common::*;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long any one step may take before the test fails.
const STEP: Duration = Duration::from_secs(10);

async fn gateway_with(origins: &[&GrpcOrigin], extra: serde_json::Value) -> TestGateway {
    let gateway = TestGateway::start().await;
    let service = grpc_service(&gateway, "grpc", origins, extra).await;
    gateway.route_all_to(service).await;
    gateway
}

fn message(text: &str) -> EchoRequest {
    EchoRequest {
        text: text.to_owned(),
        payload: text.as_bytes().to_vec(),
        ..EchoRequest::default()
    }
}

#[tokio::test]
async fn every_streaming_mode_works_through_the_gateway() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let mut client = client(gateway.proxy).await;

    let reply = client.unary(message("hello")).await.unwrap().into_inner();
    assert_eq!((reply.text.as_str(), reply.origin.as_str()), ("hello", "a"));

    let mut replies = client
        .server_stream(EchoRequest {
            count: 5,
            ..message("many")
        })
        .await
        .unwrap()
        .into_inner();
    let mut indexes = Vec::new();
    while let Some(reply) = replies.message().await.unwrap() {
        indexes.push(reply.index);
    }
    assert_eq!(indexes, vec![0, 1, 2, 3, 4]);

    let uploads = tokio_stream::iter((0..7).map(|i| message(&format!("part {i}"))));
    let summary = client.client_stream(uploads).await.unwrap().into_inner();
    assert_eq!(summary.index, 7, "the origin got every message");

    // Ping-pong: message k+1 is sent only once reply k came back. Any hop that buffers the
    // request body (or the answer) until it ends deadlocks here.
    let (sender, receiver) = tokio::sync::mpsc::channel::<EchoRequest>(1);
    sender.send(message("ping 0")).await.unwrap();
    let mut answers = client
        .bidi(tokio_stream::wrappers::ReceiverStream::new(receiver))
        .await
        .unwrap()
        .into_inner();
    for round in 0..20u32 {
        let reply = tokio::time::timeout(STEP, answers.message())
            .await
            .expect("each answer comes before the next message is sent")
            .unwrap()
            .unwrap();
        assert_eq!(reply.text, format!("ping {round}"));
        assert_eq!(reply.index, round);
        if round < 19 {
            sender
                .send(message(&format!("ping {}", round + 1)))
                .await
                .unwrap();
        }
    }
    drop(sender);
    assert!(answers.message().await.unwrap().is_none(), "the call ends");
}

#[tokio::test]
async fn four_mib_messages_pass_both_ways() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let mut client = client(gateway.proxy).await;
    let big = 4 * 1024 * 1024;
    let reply = client
        .unary(EchoRequest {
            payload: vec![b'x'; big],
            reply_size: big as u32,
            ..EchoRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.payload.len(), big);
    let summary = client
        .client_stream(tokio_stream::iter((0..3).map(move |_| EchoRequest {
            payload: vec![b'y'; big],
            ..EchoRequest::default()
        })))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summary.text, format!("{} bytes", 3 * big));
}

#[tokio::test]
async fn statuses_messages_and_metadata_pass_through_unchanged() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let mut client = client(gateway.proxy).await;

    // Headers both ways, ASCII and binary.
    let mut request = request_with_metadata(message("meta"), &[("x-echo-plain", "one")]);
    request.metadata_mut().insert_bin(
        "x-echo-data-bin",
        tonic::metadata::MetadataValue::from_bytes(&[0, 1, 2, 255]),
    );
    let response = client.unary(request).await.unwrap();
    assert_eq!(response.metadata().get("x-echo-plain").unwrap(), "one");
    assert_eq!(
        response
            .metadata()
            .get_bin("x-echo-data-bin")
            .unwrap()
            .to_bytes()
            .unwrap()
            .as_ref(),
        &[0, 1, 2, 255]
    );

    // A trailers-only error answer.
    let request = request_with_metadata(
        EchoRequest {
            status: Code::FailedPrecondition as u32,
            status_message: "cart is locked: 100% sure, naïvely".into(),
            ..message("fail")
        },
        &[("x-echo-why", "locked")],
    );
    let status = client.unary(request).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(status.message(), "cart is locked: 100% sure, naïvely");
    assert_eq!(status.metadata().get("x-echo-why").unwrap(), "locked");

    // Real trailers after messages.
    let request = request_with_metadata(
        EchoRequest {
            count: 2,
            status: Code::ResourceExhausted as u32,
            status_message: "quota".into(),
            ..message("stream")
        },
        &[("x-echo-quota", "0")],
    );
    let mut replies = client.server_stream(request).await.unwrap().into_inner();
    assert!(replies.message().await.unwrap().is_some());
    assert!(replies.message().await.unwrap().is_some());
    let status = replies.message().await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert_eq!(status.message(), "quota");
    assert_eq!(status.metadata().get("x-echo-quota").unwrap(), "0");
}

#[tokio::test]
async fn a_deadline_goes_up_reduced_and_ends_as_deadline_exceeded() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let mut client = client(gateway.proxy).await;
    let mut request = tonic::Request::new(EchoRequest {
        delay_ms: 5_000,
        ..message("slow")
    });
    request.set_timeout(Duration::from_millis(300));
    let started = std::time::Instant::now();
    let status = client.unary(request).await.unwrap_err();
    // tonic ends the call itself at its deadline (as CANCELLED "Timeout expired"), a moment
    // before the gateway would answer DEADLINE_EXCEEDED: either is the deadline.
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    let sent = origin.state.last_timeout.lock().unwrap().clone().unwrap();
    let (digits, unit) = sent.split_at(sent.len() - 1);
    let micros: u64 = match unit {
        "n" => digits.parse::<u64>().unwrap() / 1_000,
        "u" => digits.parse().unwrap(),
        "m" => digits.parse::<u64>().unwrap() * 1_000,
        other => panic!("unit {other} for a sub-second deadline"),
    };
    assert!(
        micros <= 300_000 && micros > 100_000,
        "the target got what was left of 300 ms: {sent}"
    );
    wait_until("the target saw the call cancelled", STEP, || async {
        origin.state.cancelled.load(Ordering::SeqCst) >= 1
    })
    .await;
}

/// The gateway's own timeout reaches a gRPC client as DEADLINE_EXCEEDED, which it parses.
#[tokio::test]
async fn the_gateways_response_timeout_is_deadline_exceeded_to_a_grpc_client() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(
        &[&origin],
        json!({"max_attempts": 1, "timeouts": {"response_header_ms": 200}}),
    )
    .await;
    let mut client = client(gateway.proxy).await;
    let status = client
        .unary(EchoRequest {
            delay_ms: 3_000,
            ..message("slow")
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        status.metadata().get("x-raahi-error").unwrap(),
        "upstream_timeout"
    );
}

#[tokio::test]
async fn a_deadline_the_gateway_sees_pass_answers_deadline_exceeded_itself() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    // A raw gRPC request whose deadline the gateway enforces (this client does not).
    let mut h2 = h2_client(gateway.proxy).await;
    let request = http::Request::post(format!("http://{}/raahi.test.Echo/Unary", gateway.proxy))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", "200m")
        .body(http_body_util::Full::new(grpc_frame(&EchoRequest {
            delay_ms: 5_000,
            ..message("slow")
        })))
        .unwrap();
    let response = tokio::time::timeout(STEP, h2.send_request(request))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["grpc-status"], "4", "DEADLINE_EXCEEDED");
    assert_eq!(response.headers()["x-raahi-error"], "grpc_timeout");
    let (_, health) = gateway.api("GET", "/api/v1/services/1/runtime", None).await;
    assert!(
        !health.to_string().contains("\"ejections\":1"),
        "a client's deadline is no fault of the target: {health}"
    );
}

#[tokio::test]
async fn a_client_that_cancels_cancels_the_call_at_the_target() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let mut client = client(gateway.proxy).await;
    let mut replies = client
        .server_stream(EchoRequest {
            count: 1_000,
            delay_ms: 20,
            ..message("long")
        })
        .await
        .unwrap()
        .into_inner();
    assert!(replies.message().await.unwrap().is_some());
    drop(replies);
    wait_until("the target's handler was cancelled", STEP, || async {
        origin.state.cancelled.load(Ordering::SeqCst) == 1
    })
    .await;
}

#[tokio::test]
async fn two_hundred_concurrent_calls_ride_a_handful_of_connections() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let client = client(gateway.proxy).await;
    let calls: Vec<_> = (0..200)
        .map(|i| {
            let mut client = client.clone();
            tokio::spawn(async move {
                client
                    .unary(EchoRequest {
                        delay_ms: 200,
                        ..message(&format!("call {i}"))
                    })
                    .await
                    .map(|reply| reply.into_inner().text)
            })
        })
        .collect();
    for (i, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), format!("call {i}"));
    }
    assert_eq!(origin.calls(), 200);
    assert!(
        origin.connections() <= 4,
        "200 concurrent calls over {} upstream connections",
        origin.connections()
    );
}

#[tokio::test]
async fn a_target_that_sends_goaway_under_load_loses_no_call() {
    let origin = GrpcOrigin::start_with(
        "a",
        OriginOptions {
            max_connection_age: Some(Duration::from_millis(150)),
            ..OriginOptions::default()
        },
    )
    .await;
    let gateway = gateway_with(&[&origin], json!({"max_attempts": 1})).await;
    let client = client(gateway.proxy).await;
    let failures = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..16)
        .map(|worker| {
            let mut client = client.clone();
            let failures = failures.clone();
            let done = done.clone();
            tokio::spawn(async move {
                let until = tokio::time::Instant::now() + Duration::from_millis(1_500);
                let mut i = 0;
                while tokio::time::Instant::now() < until {
                    match client
                        .unary(EchoRequest {
                            delay_ms: 5,
                            ..message(&format!("{worker}/{i}"))
                        })
                        .await
                    {
                        Ok(_) => done.fetch_add(1, Ordering::SeqCst),
                        Err(status) => {
                            eprintln!("call failed: {status:?}");
                            failures.fetch_add(1, Ordering::SeqCst)
                        }
                    };
                    i += 1;
                }
            })
        })
        .collect();
    for worker in workers {
        worker.await.unwrap();
    }
    assert!(
        origin.connections() >= 3,
        "the target cycled its connections: {}",
        origin.connections()
    );
    assert!(done.load(Ordering::SeqCst) > 100);
    assert_eq!(
        failures.load(Ordering::SeqCst),
        0,
        "no call lost to a GOAWAY"
    );
}

#[tokio::test]
async fn raahis_own_failures_are_grpc_statuses() {
    let mut origin = GrpcOrigin::start("a").await;
    let gateway = TestGateway::start().await;
    let service = grpc_service(&gateway, "grpc", &[&origin], json!({"max_attempts": 1})).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "shop", "hosts": ["shop.test"], "service_id": service}),
        )
        .await;
    // The client's authority is the gateway's address: no route.
    let mut client = client(gateway.proxy).await;
    let status = client.unary(message("lost")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unimplemented, "{status:?}");
    assert!(status.message().contains("no route"), "{status:?}");

    // The only target is down.
    gateway.route_all_to(service).await;
    origin.stop();
    let port = origin.addr.port();
    wait_until("the origin's port is closed", STEP, || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
    })
    .await;
    let mut client = common::grpc::client(gateway.proxy).await;
    let status = client.unary(message("down")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}

#[tokio::test]
async fn an_http1_client_gets_the_grpc_status_in_trailers() {
    let origin = GrpcOrigin::start("a").await;
    let gateway = gateway_with(&[&origin], json!({})).await;
    let body = grpc_frame(&message("over h1"));
    let mut stream = tokio::net::TcpStream::connect(gateway.proxy).await.unwrap();
    let head = format!(
        "POST /raahi.test.Echo/Unary HTTP/1.1\r\nHost: grpc.test\r\nContent-Type: application/grpc\r\nTE: trailers\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&body).await.unwrap();
    let mut wire = Vec::new();
    tokio::time::timeout(STEP, async {
        let mut chunk = [0u8; 4096];
        while !wire.ends_with(b"\r\n\r\n") || !contains(&wire, b"\r\n0\r\n") {
            let read = stream.read(&mut chunk).await.unwrap();
            assert!(read > 0, "closed early: {}", String::from_utf8_lossy(&wire));
            wire.extend_from_slice(&chunk[..read]);
        }
    })
    .await
    .expect("the whole chunked answer came");
    let text = String::from_utf8_lossy(&wire).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 200"), "{text}");
    assert!(text.contains("transfer-encoding: chunked"), "{text}");
    assert!(text.contains("over h1"), "the reply message: {text}");
    let trailers = &text[text.find("\r\n0\r\n").unwrap()..];
    assert!(trailers.contains("grpc-status: 0"), "{trailers}");
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

#[tokio::test]
async fn a_not_serving_target_turns_unhealthy_and_traffic_moves_away() {
    let a = GrpcOrigin::start("a").await;
    let b = GrpcOrigin::start("b").await;
    let gateway = gateway_with(
        &[&a, &b],
        json!({"health_check": {"type": "grpc", "grpc_service": "raahi.test.Echo",
                                "interval_ms": 100, "timeout_ms": 1000,
                                "healthy_threshold": 1, "unhealthy_threshold": 1}}),
    )
    .await;
    let targets = gateway.targets(1).await;
    for target in &targets {
        wait_target(&gateway, target.id, "healthy", |t| {
            t.health == api::Health::Healthy
        })
        .await;
    }
    a.set_health(ServingStatus::NotServing).await;
    let a_target = targets
        .iter()
        .find(|target| target.port == a.addr.port())
        .unwrap();
    // The verdict is live at once; the check that decided it is stored after the round.
    wait_target(&gateway, a_target.id, "unhealthy by NOT_SERVING", |t| {
        t.health == api::Health::Unhealthy
            && t.last_check
                .as_ref()
                .is_some_and(|check| check.detail == "gRPC NOT_SERVING")
    })
    .await;
    let mut client = client(gateway.proxy).await;
    let before = a.calls();
    for _ in 0..20 {
        let reply = client.unary(message("x")).await.unwrap().into_inner();
        assert_eq!(reply.origin, "b");
    }
    assert_eq!(a.calls(), before, "no call reached the NOT_SERVING target");
}

/// A gRPC message on the wire: uncompressed, its length, the protobuf bytes.
fn grpc_frame(message: &EchoRequest) -> bytes::Bytes {
    use prost::Message;
    let encoded = message.encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    framed.extend_from_slice(&encoded);
    framed.into()
}

async fn h2_client(
    addr: std::net::SocketAddr,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    sender
}
