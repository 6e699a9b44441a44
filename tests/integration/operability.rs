//! What an operator reads: `/metrics` and the access log.

use crate::common;

use std::time::Duration;

use common::process::RaahiProcess;
use common::registry::Registry;
use common::*;
use serde_json::json;

async fn scrape(gateway: &TestGateway) -> String {
    let response = gateway
        .http
        .get(gateway.admin_url("/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(
        content_type.starts_with("application/openmetrics-text"),
        "{content_type}"
    );
    response.text().await.unwrap()
}

fn value(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|number| number.parse().ok())
}

#[tokio::test]
async fn metrics_count_requests_latency_targets_and_sources() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("a").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 1, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "all", "hosts": ["web.test"], "service_id": service}),
        )
        .await;
    for _ in 0..3 {
        let response = gateway
            .http
            .get(gateway.proxy_url("/ok"))
            .header("host", "web.test")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }
    let failed = gateway
        .http
        .get(gateway.proxy_url("/status/503"))
        .header("host", "web.test")
        .send()
        .await
        .unwrap();
    assert_eq!(failed.status(), 503);
    let unrouted = gateway
        .http
        .get(gateway.proxy_url("/"))
        .header("host", "nowhere.test")
        .send()
        .await
        .unwrap();
    assert_eq!(unrouted.status(), 404);

    let registry = Registry::start().await;
    registry.set_json(json!([{"host": "127.0.0.1", "port": upstream.addr.port(), "key": "r1"}]));
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({"name": "reg", "provider": "http",
                   "config": {"url": registry.url("/endpoints"), "interval_ms": 200}}),
        )
        .await;
    gateway
        .wait_source_status(source, "healthy", Duration::from_secs(10), |status| {
            status.state == "healthy"
        })
        .await;

    let metrics = scrape(&gateway).await;
    let route = r#"service="web",route="all""#;
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_requests_total{{{route},class="2xx"}}"#)
        ),
        Some(3.0),
        "{metrics}"
    );
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_requests_total{{{route},class="5xx"}}"#)
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_request_duration_seconds_count{{{route}}}"#)
        ),
        Some(4.0)
    );
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_request_duration_seconds_bucket{{le="+Inf",{route}}}"#)
        )
        .or_else(|| value(
            &metrics,
            &format!(r#"raahi_request_duration_seconds_bucket{{{route},le="+Inf"}}"#)
        )),
        Some(4.0),
        "{metrics}"
    );
    assert_eq!(value(&metrics, "raahi_unrouted_requests_total"), Some(1.0));
    // The store was read whole once, at start; every change since reloaded only its part.
    assert_eq!(
        value(&metrics, r#"raahi_control_reloads_total{kind="full"}"#),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        value(&metrics, r#"raahi_control_reloads_total{kind="changed"}"#)
            .is_some_and(|changed| changed >= 3.0),
        "{metrics}"
    );
    let target_label = format!(r#"service="web",target="{}""#, upstream.addr);
    assert_eq!(
        value(
            &metrics,
            &format!("raahi_target_in_flight_requests{{{target_label}}}")
        ),
        Some(0.0),
        "{metrics}"
    );
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_target_health{{{target_label},health="unknown"}}"#)
        ),
        Some(1.0)
    );
    assert_eq!(
        value(&metrics, r#"raahi_targets{service="web",state="active"}"#),
        Some(2.0)
    );
    let source_label = r#"service="web",source="reg",provider="http""#;
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_discovery_source_state{{{source_label},state="healthy"}}"#)
        ),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        value(
            &metrics,
            &format!("raahi_discovery_refreshes_total{{{source_label}}}")
        )
        .unwrap()
            >= 1.0
    );
    assert_eq!(
        value(
            &metrics,
            &format!("raahi_discovery_refresh_failures_total{{{source_label}}}")
        ),
        Some(0.0)
    );
    // A route without limits has none of their series.
    for series in [
        "raahi_rate_limited_total",
        "raahi_rate_limit_keys",
        "raahi_rate_limit_rate",
        "raahi_route_in_flight",
        "raahi_route_in_flight_refused_total",
    ] {
        assert_eq!(
            value(&metrics, &format!(r#"{series}{{route="all"}}"#)),
            None,
            "{metrics}"
        );
    }
    assert!(metrics.trim_end().ends_with("# EOF"));
}

/// A route's rate limit and its requests in flight, each only for the route that has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_show_route_limits() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("a").await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 1, 0)])
        .await;
    // One request every 10 s after a burst of 2: the 3 after the burst are refused however
    // slowly this machine sends them.
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "limited", "hosts": ["limited.test"], "service_id": service,
                   "rate_limit": {"requests_per_second": 0.1, "burst": 2}}),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "held", "hosts": ["held.test"], "service_id": service,
                   "max_in_flight": 1}),
        )
        .await;
    let send = |host: &'static str, path: &'static str| {
        let http = gateway.http.clone();
        let url = gateway.proxy_url(path);
        async move {
            http.get(url)
                .header("host", host)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    let mut statuses = Vec::new();
    for _ in 0..5 {
        statuses.push(send("limited.test", "/ok").await.as_u16());
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429]);

    let slow = tokio::spawn(send("held.test", "/slow/3000"));
    wait_until(
        "the slow request in flight",
        Duration::from_secs(10),
        || async {
            let metrics = scrape(&gateway).await;
            value(&metrics, r#"raahi_route_in_flight{route="held"}"#) == Some(1.0)
        },
    )
    .await;
    assert_eq!(send("held.test", "/ok").await, 503);

    let metrics = scrape(&gateway).await;
    let limited = r#"{route="limited"}"#;
    assert_eq!(
        value(&metrics, &format!("raahi_rate_limited_total{limited}")),
        Some(3.0),
        "{metrics}"
    );
    assert_eq!(
        value(&metrics, &format!("raahi_rate_limit_keys{limited}")),
        Some(1.0),
        "one client address"
    );
    assert_eq!(
        value(&metrics, &format!("raahi_rate_limit_rate{limited}")),
        Some(0.1),
        "{metrics}"
    );
    assert_eq!(
        value(&metrics, &format!("raahi_route_in_flight{limited}")),
        None,
        "no max_in_flight"
    );
    let held = r#"{route="held"}"#;
    assert_eq!(
        value(
            &metrics,
            &format!("raahi_route_in_flight_refused_total{held}")
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        value(&metrics, &format!("raahi_rate_limited_total{held}")),
        None,
        "no rate_limit"
    );
    assert_eq!(
        value(
            &metrics,
            r#"raahi_requests_refused_total{code="rate_limited"}"#
        ),
        Some(3.0),
        "{metrics}"
    );
    assert_eq!(slow.await.unwrap(), 200);
    // The place is freed at the end of the answer's body, a moment after its status line.
    wait_until(
        "the held request's place is freed",
        Duration::from_secs(10),
        || async {
            let metrics = scrape(&gateway).await;
            let in_flight = value(&metrics, &format!("raahi_route_in_flight{held}"));
            (in_flight == Some(0.0)).then_some(()).ok_or(metrics)
        },
    )
    .await;
}

#[tokio::test]
async fn metrics_count_connect_errors_and_panic_picks() {
    let gateway = TestGateway::start().await;
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead_port = dead.local_addr().unwrap().port();
    drop(dead);
    let service = gateway
        .service_with_targets("down", &[json!({"host": "127.0.0.1", "port": dead_port})])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": "down", "service_id": service}),
        )
        .await;
    for _ in 0..6 {
        let response = gateway.get("/").await;
        assert_eq!(response.status(), 502);
    }
    let metrics = scrape(&gateway).await;
    assert_eq!(
        value(
            &metrics,
            r#"raahi_upstream_connect_errors_total{service="down"}"#
        ),
        Some(6.0),
        "{metrics}"
    );
    // Five failures eject the only target; the sixth request is a panic pick.
    assert_eq!(
        value(
            &metrics,
            r#"raahi_balancer_panic_picks_total{service="down"}"#
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &metrics,
            &format!(r#"raahi_target_ejected{{service="down",target="127.0.0.1:{dead_port}"}}"#)
        ),
        Some(1.0)
    );
}

/// One JSON line per request on stderr, with the fields an operator filters on.
#[tokio::test]
async fn the_access_log_has_one_json_line_per_request() {
    let upstream = Upstream::start("logged").await;
    let mut process = RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "json"),
    ])
    .await;
    process.route_all_to("logged", &upstream).await;
    let response = reqwest::Client::new()
        .get(format!("http://{}/hello?x=1", process.proxy))
        .header("x-request-id", "trace-me-123")
        // Tracing is off: the caller's trace id is still logged, and passed on untouched.
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);

    let line = process
        .stderr_line(|line| line.contains("raahi::access") && line.contains("trace-me-123"))
        .await;
    let entry: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
    assert_eq!(entry["target"], "raahi::access");
    let fields = &entry["fields"];
    assert_eq!(fields["request_id"], "trace-me-123");
    assert_eq!(fields["method"], "GET");
    assert_eq!(fields["path"], "/hello");
    assert_eq!(fields["status"], 200);
    assert_eq!(fields["route"], "logged-route");
    assert_eq!(fields["service"], "logged");
    assert_eq!(fields["target"], upstream.addr.to_string());
    assert_eq!(fields["client"], "127.0.0.1");
    assert!(fields["duration_ms"].as_f64().unwrap() >= 0.0);
    assert!(fields["upstream_ms"].as_f64().is_some());
    assert_eq!(fields["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(
        upstream.last_seen().header("traceparent"),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert!(entry["timestamp"].is_string());
}

/// A route with weighted backends names, per request, the backend that served it.
#[tokio::test]
async fn the_access_log_names_the_route_and_its_backend() {
    let upstream = Upstream::start("zoned").await;
    let mut process = RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "json"),
    ])
    .await;
    let service = process
        .create("/api/v1/services", serde_json::json!({"name": "web"}))
        .await["id"]
        .as_i64()
        .unwrap();
    let mut zoned = target(&upstream, 1, 0);
    zoned["metadata"] = serde_json::json!({"zone": "a"});
    process
        .create(&format!("/api/v1/services/{service}/targets"), zoned)
        .await;
    process
        .create(
            "/api/v1/routes",
            serde_json::json!({"name": "zonal", "backends": [
                {"service_id": service, "weight": 1, "subset": {"zone": "a"}}]}),
        )
        .await;
    let response = reqwest::Client::new()
        .get(format!("http://{}/x", process.proxy))
        .header("x-request-id", "backend-named")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let line = process
        .stderr_line(|line| line.contains("raahi::access") && line.contains("backend-named"))
        .await;
    let entry: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
    let fields = &entry["fields"];
    assert_eq!(fields["route"], "zonal", "{line}");
    assert_eq!(fields["service"], "web", "{line}");
    assert_eq!(fields["backend"], "web{zone=a}", "{line}");
}

/// A log collector that stops reading stderr never slows a request: once the gateway's log
/// buffers are full, lines are dropped and counted, and logging resumes when stderr drains.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_stderr_drops_counted_lines_and_slows_no_request() {
    let mut process = RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "json"),
    ])
    .await;
    let client = reqwest::Client::new();
    let metrics = || async {
        client
            .get(format!("http://{}/metrics", process.admin))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    assert_eq!(
        value(&metrics().await, "raahi_log_dropped_lines_total"),
        Some(0.0)
    );

    let stalled = process.stall_stderr().await;
    // 8 KB access lines: 800 of them are several times the pipe and the 1 MiB buffers.
    let long_path = format!("/{}", "p".repeat(8_000));
    for _ in 0..800 {
        let response = client
            .get(format!("http://{}{long_path}", process.proxy))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404);
    }
    let dropped = value(&metrics().await, "raahi_log_dropped_lines_total").unwrap();
    assert!(dropped > 0.0, "no dropped line counted");
    drop(stalled);

    // Lines logged before the writer has emptied the full buffers are dropped too, so the
    // request is repeated until one of its lines is written.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let line = loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no access line written after the stall"
        );
        let response = client
            .get(format!("http://{}/after-the-stall", process.proxy))
            .header("x-request-id", "after-the-stall")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 404);
        let written = process
            .stderr_line_within(Duration::from_millis(500), |line| {
                line.contains("raahi::access") && line.contains("after-the-stall")
            })
            .await;
        if let Some(line) = written {
            break line;
        }
    };
    let entry: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
    assert_eq!(entry["fields"]["path"], "/after-the-stall");
}

/// `log.format = "logfmt"` gives `key=value` access lines.
#[tokio::test]
async fn the_access_log_can_be_logfmt() {
    let mut process = RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "logfmt"),
    ])
    .await;
    let response = reqwest::Client::new()
        .get(format!("http://{}/no/such/route", process.proxy))
        .header("x-request-id", "logfmt-42")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
    let line = process
        .stderr_line(|line| {
            line.contains("target=raahi::access") && line.contains("request_id=logfmt-42")
        })
        .await;
    assert!(line.starts_with("ts="), "{line}");
    for pair in [
        "level=info",
        "status=404",
        "method=GET",
        "path=/no/such/route",
    ] {
        assert!(line.contains(pair), "{pair} missing in {line}");
    }
}
