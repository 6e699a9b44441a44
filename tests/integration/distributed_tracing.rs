//! Distributed tracing through real sockets: W3C `traceparent` in and out, the server span and
//! a client span per attempt received by a test OTLP/HTTP collector, sampling, and a collector
//! that fails or hangs never holding a request back.

use crate::common;
use common::otlp::{CollectedSpan, Collector, Mode, KIND_CLIENT, KIND_SERVER, STATUS_ERROR};
use common::*;

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

/// How long any one step may take before the test fails.
const STEP: Duration = Duration::from_secs(10);

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

async fn traced_gateway(
    collector: &Collector,
    sample_percent: &str,
    extra: &[(&str, &str)],
) -> TestGateway {
    let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
    let endpoint = collector.endpoint();
    let mut overrides = vec![
        ("RAAHI_TRACING_OTLP_ENDPOINT", endpoint.as_str()),
        ("RAAHI_TRACING_SAMPLE_PERCENT", sample_percent),
        ("RAAHI_TRACING_SERVICE_NAME", "edge-test"),
        ("RAAHI_TRACING_BATCH_DELAY_MS", "20"),
    ];
    overrides.extend_from_slice(extra);
    let config = test_config_with(dir.path(), &overrides);
    TestGateway::start_with(dir, config).await
}

/// An upstream behind a service `api` that the route `all` sends everything to.
async fn routed_upstream(gateway: &TestGateway) -> Upstream {
    let upstream = Upstream::start("a").await;
    let service = gateway
        .service_with_targets("api", &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    upstream
}

/// `traceparent`'s parts: (trace id, parent id, flags).
fn parts(traceparent: &str) -> (String, String, String) {
    let fields: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(fields.len(), 4, "{traceparent}");
    assert_eq!(fields[0], "00", "{traceparent}");
    (
        fields[1].to_owned(),
        fields[2].to_owned(),
        fields[3].to_owned(),
    )
}

fn server_span(spans: &[CollectedSpan]) -> &CollectedSpan {
    let servers: Vec<_> = spans
        .iter()
        .filter(|span| span.kind == KIND_SERVER)
        .collect();
    assert_eq!(servers.len(), 1, "one server span: {spans:#?}");
    servers[0]
}

fn client_spans(spans: &[CollectedSpan]) -> Vec<&CollectedSpan> {
    let mut clients: Vec<_> = spans
        .iter()
        .filter(|span| span.kind == KIND_CLIENT)
        .collect();
    clients.sort_by_key(|span| span.attribute("raahi.attempt").as_i64());
    clients
}

/// A request Raahi samples gets a new trace: a server span (the hop) and one client span per
/// attempt, children of the server span, and the target sees the answering attempt's span as
/// its parent. The first attempt meets a closed port, so the second is a retry.
#[tokio::test]
async fn a_sampled_request_exports_its_hop_and_each_attempt() {
    let collector = Collector::start().await;
    let gateway = traced_gateway(&collector, "100", &[]).await;
    let live = Upstream::start("live").await;
    let closed_port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let service = gateway
        .service_with_targets(
            "web",
            &[
                json!({"host": "127.0.0.1", "port": closed_port, "weight": 1, "priority": 0}),
                target(&live, 1, 1),
            ],
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "shop", "service_id": service}),
        )
        .await;

    let response = gateway
        .http
        .get(gateway.proxy_url("/cart?item=7"))
        .header("user-agent", "trace-test/1")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let seen = live.last_seen();
    let traceparent = seen
        .header("traceparent")
        .expect("the target gets a traceparent");
    let (trace_id, parent_of_target, flags) = parts(traceparent);
    assert_eq!(flags, "01", "a recorded trace is sampled");
    assert!(seen.header("tracestate").is_none());

    let spans = collector.trace(&trace_id, 3, STEP).await;
    let server = server_span(&spans);
    assert_eq!(server.name, "GET shop");
    assert_eq!(
        server.parent_span_id, "",
        "a new trace: the hop is the root"
    );
    assert_eq!(server.service_name, "edge-test");
    assert_eq!(server.scope, "raahi");
    assert_eq!(server.attribute("http.request.method"), "GET");
    assert_eq!(server.attribute("url.path"), "/cart");
    assert_eq!(server.attribute("url.query"), "item=7");
    assert_eq!(server.attribute("url.scheme"), "http");
    assert_eq!(server.attribute("http.response.status_code"), 200);
    assert_eq!(server.attribute("network.protocol.version"), "1.1");
    assert_eq!(server.attribute("user_agent.original"), "trace-test/1");
    assert_eq!(server.attribute("client.address"), "127.0.0.1");
    assert_eq!(server.attribute("raahi.route"), "shop");
    assert_eq!(server.attribute("raahi.service"), "web");
    assert_eq!(
        server.attribute("http.response.body.size"),
        4,
        "the body \"live\""
    );
    assert!(server.attribute("raahi.request_id").is_string());
    assert_ne!(server.status_code, STATUS_ERROR);
    assert!(server.end_ns >= server.start_ns && server.start_ns > 0);

    let clients = client_spans(&spans);
    assert_eq!(clients.len(), 2, "{spans:#?}");
    let (first, second) = (clients[0], clients[1]);
    for client in [first, second] {
        assert_eq!(
            client.parent_span_id, server.span_id,
            "attempts are the hop's children"
        );
        assert_eq!(client.name, "GET");
        assert!(client.start_ns >= server.start_ns && client.end_ns <= server.end_ns);
    }
    assert_eq!(first.attribute("raahi.attempt"), 1);
    assert_eq!(first.attribute("server.port"), i64::from(closed_port));
    assert_eq!(first.attribute("error.type"), "upstream_connect_failed");
    assert_eq!(first.status_code, STATUS_ERROR);
    assert_eq!(second.attribute("raahi.attempt"), 2);
    assert_eq!(second.attribute("http.request.resend_count"), 1);
    assert_eq!(second.attribute("raahi.retry_reason"), "connect_failure");
    assert_eq!(second.attribute("server.address"), "127.0.0.1");
    assert_eq!(second.attribute("server.port"), i64::from(live.addr.port()));
    assert_eq!(
        second.attribute("url.full"),
        format!("http://{}/cart?item=7", live.addr).as_str()
    );
    assert_eq!(second.attribute("http.response.status_code"), 200);
    assert!(
        second
            .attribute("raahi.upstream.connect_ms")
            .as_f64()
            .is_some(),
        "the attempt that opened a connection tells how long it took: {second:#?}"
    );
    assert_eq!(
        second.span_id, parent_of_target,
        "the target's parent is the answering attempt"
    );

    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains("raahi_trace_spans_exported_total"),
        "{metrics}"
    );
    assert!(gateway.metric("raahi_trace_spans_exported_total").await >= 3);
}

/// A sampled `traceparent` is continued: same trace id, the caller's span as the hop's
/// parent, the caller's `tracestate` passed on, and the target's parent is Raahi's attempt.
#[tokio::test]
async fn a_sampled_traceparent_is_continued() {
    let collector = Collector::start().await;
    // Sampling 0: only the caller's decision records this request.
    let gateway = traced_gateway(&collector, "0", &[]).await;
    let upstream = routed_upstream(&gateway).await;

    let response = gateway
        .http
        .post(gateway.proxy_url("/orders"))
        .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .header("tracestate", "vendor=opaque")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let seen = upstream.last_seen();
    let (trace_id, parent_of_target, flags) = parts(seen.header("traceparent").unwrap());
    assert_eq!(trace_id, CALLER_TRACE);
    assert_eq!(flags, "01");
    assert_ne!(
        parent_of_target, CALLER_SPAN,
        "Raahi's attempt is the new parent"
    );
    assert_eq!(seen.header("tracestate"), Some("vendor=opaque"));

    let spans = collector.trace(CALLER_TRACE, 2, STEP).await;
    let server = server_span(&spans);
    assert_eq!(server.parent_span_id, CALLER_SPAN);
    assert_eq!(server.name, "POST all");
    let clients = client_spans(&spans);
    assert_eq!(clients.len(), 1);
    assert_eq!(clients[0].span_id, parent_of_target);
    assert_eq!(clients[0].parent_span_id, server.span_id);
}

/// With sampling at 0 nothing Raahi would start is exported, an unsampled caller's context
/// goes on untouched, and a request without context gets none. (A sampled request sent last
/// is the barrier: the exporter keeps arrival order, so once its spans arrive, anything the
/// earlier requests had exported would have arrived too.)
#[tokio::test]
async fn sampling_zero_exports_nothing_and_still_propagates() {
    let collector = Collector::start().await;
    let gateway = traced_gateway(&collector, "0", &[]).await;
    let upstream = routed_upstream(&gateway).await;

    let unsampled = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-00");
    for _ in 0..20 {
        let response = gateway
            .http
            .get(gateway.proxy_url("/plain"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert!(upstream.last_seen().header("traceparent").is_none());
        let response = gateway
            .http
            .get(gateway.proxy_url("/unsampled"))
            .header("traceparent", &unsampled)
            .header("tracestate", "k=v")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let seen = upstream.last_seen();
        assert_eq!(seen.header("traceparent"), Some(unsampled.as_str()));
        assert_eq!(seen.header("tracestate"), Some("k=v"));
    }

    let barrier_trace = "0af7651916cd43dd8448eb211c80319c";
    let response = gateway
        .http
        .get(gateway.proxy_url("/barrier"))
        .header(
            "traceparent",
            format!("00-{barrier_trace}-b7ad6b7169203331-01"),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    collector.trace(barrier_trace, 2, STEP).await;
    let others: Vec<_> = collector
        .spans()
        .into_iter()
        .filter(|span| span.trace_id != barrier_trace)
        .collect();
    assert!(others.is_empty(), "nothing else was exported: {others:#?}");
}

/// A collector that hangs, then fails, never holds a request back: the queue fills, spans
/// are dropped and counted, failed exports are counted, and exporting resumes when the
/// collector recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_hangs_or_fails_never_holds_a_request() {
    let collector = Collector::start().await;
    collector.set_mode(Mode::Hang);
    let gateway = traced_gateway(
        &collector,
        "100",
        &[
            ("RAAHI_TRACING_QUEUE_REQUESTS", "8"),
            ("RAAHI_TRACING_BATCH_REQUESTS", "4"),
            ("RAAHI_TRACING_EXPORT_TIMEOUT_MS", "1500"),
        ],
    )
    .await;
    let upstream = routed_upstream(&gateway).await;

    // Every request answers while the one export in progress hangs: far more requests than
    // the queue holds, each one bounded by a step's deadline.
    for _ in 0..200 {
        let response = tokio::time::timeout(STEP, gateway.http.get(gateway.proxy_url("/")).send())
            .await
            .expect("a request is never held by the exporter")
            .unwrap();
        assert_eq!(response.status(), 200);
    }
    assert!(collector.exports.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    assert!(
        gateway.metric("raahi_trace_spans_dropped_total").await > 0,
        "a full queue drops and counts"
    );

    // The hung export times out and counts its spans lost; a failing collector too.
    collector.set_mode(Mode::Fail);
    wait_until("failed exports are counted", STEP, || async {
        gateway.metric("raahi_trace_spans_failed_total").await > 0
    })
    .await;

    collector.set_mode(Mode::Accept);
    let response = gateway
        .http
        .get(gateway.proxy_url("/after"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let trace_id = parts(upstream.last_seen().header("traceparent").unwrap()).0;
    collector.trace(&trace_id, 2, STEP).await;
}

/// A gRPC call's spans carry its status from the trailers, and the body's end ends them.
#[tokio::test]
async fn a_grpc_call_is_traced_with_its_status() {
    use common::grpc::*;
    let collector = Collector::start().await;
    let gateway = traced_gateway(&collector, "100", &[]).await;
    let origin = GrpcOrigin::start("g").await;
    let service = grpc_service(&gateway, "grpc", &[&origin], json!({})).await;
    gateway.route_all_to(service).await;
    let mut client = client(gateway.proxy).await;
    let reply = client
        .unary(EchoRequest {
            text: "traced".to_owned(),
            ..EchoRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(reply.text, "traced");

    let server = collector.span_named("POST all", STEP).await;
    assert_eq!(server.attribute("rpc.system"), "grpc");
    assert_eq!(server.attribute("rpc.grpc.status_code"), 0);
    assert_eq!(server.attribute("network.protocol.version"), "2");
    let spans = collector.trace(&server.trace_id, 2, STEP).await;
    let clients = client_spans(&spans);
    assert_eq!(clients[0].attribute("network.protocol.version"), "2");
    assert_eq!(
        clients[0]
            .attribute("url.full")
            .as_str()
            .map(|url| url.starts_with("http://")),
        Some(true)
    );
}

/// A gateway that stops sends the spans still waiting for their batch: the last requests
/// before a shutdown are not lost.
#[tokio::test]
async fn a_stopping_gateway_exports_what_waits() {
    let collector = Collector::start().await;
    // A batch would wait a minute for company: only the shutdown's flush sends it in time.
    let mut gateway = traced_gateway(
        &collector,
        "100",
        &[("RAAHI_TRACING_BATCH_DELAY_MS", "60000")],
    )
    .await;
    let upstream = routed_upstream(&gateway).await;
    let response = gateway
        .http
        .get(gateway.proxy_url("/last"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let trace_id = parts(upstream.last_seen().header("traceparent").unwrap()).0;

    tokio::time::timeout(STEP, gateway.gateway.take().unwrap().shutdown())
        .await
        .expect("the shutdown is bounded");
    let spans = collector.trace(&trace_id, 2, Duration::ZERO).await;
    assert_eq!(server_span(&spans).attribute("url.path"), "/last");
}
