//! Retries that cannot storm (TRAFFIC.md §5), through real sockets: a failing target's 503,
//! 409 or stall is recovered on another target; the budget keeps a total outage from
//! multiplying the load; a POST that may have been processed is not sent twice without an
//! `Idempotency-Key`; a long `Retry-After` ends the retries; hedging answers from the faster
//! target within the budget; gRPC trailers-only statuses are retried for calls with a key; the
//! retries are counted in `raahi_retries_total`, `raahi_retry_budget_exhausted_total` and
//! `raahi_hedges_total`, and named in the access log.

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::time::Instant;

use crate::common::fixed_upstream::{Answer, FailingGrpcUpstream, FixedUpstream};
use crate::common::grpc::{client, EchoRequest, GrpcOrigin};
use crate::common::process::RaahiProcess;
use crate::common::{free_addr, TestGateway, ADMIN_TOKEN};

/// A service `name` over `targets` with `extra` service fields, and a route `name` sending
/// every request to it with `route` fields on top (e.g. `retry`).
async fn routed(
    gateway: &TestGateway,
    name: &str,
    targets: &[Value],
    extra: Value,
    route: Value,
) -> i64 {
    let mut service = json!({ "name": name });
    service
        .as_object_mut()
        .unwrap()
        .extend(extra.as_object().cloned().unwrap_or_default());
    let service = gateway.create("/api/v1/services", service).await;
    for target in targets {
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                target.clone(),
            )
            .await;
    }
    let mut body = json!({"name": name, "service_id": service});
    body.as_object_mut()
        .unwrap()
        .extend(route.as_object().cloned().unwrap_or_default());
    gateway.create("/api/v1/routes", body).await;
    service
}

/// Passive ejection off: a failing target keeps being picked, so every request that picks
/// it first needs the retry under test.
fn no_ejection() -> Value {
    json!({"ejection": false})
}

/// The sum of the series of `name` whose labels include every pair of `labels`, in whatever
/// order `/metrics` writes them (0 when none).
async fn metric(gateway: &TestGateway, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = gateway.metrics_text().await;
    metric_in(&text, name, labels)
}

fn metric_in(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let (series_name, series_labels) = match series.split_once('{') {
                Some((series_name, rest)) => (series_name, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            if series_name != name {
                return None;
            }
            let all = labels.iter().all(|(key, wanted)| {
                series_labels
                    .split(',')
                    .any(|pair| pair == format!("{key}=\"{wanted}\""))
            });
            all.then(|| value.trim().parse::<f64>().ok()).flatten()
        })
        .fold(0.0, |sum, value| sum + value)
}

async fn retries(gateway: &TestGateway, service: &str, reason: &str) -> f64 {
    metric(
        gateway,
        "raahi_retries_total",
        &[("service", service), ("reason", reason)],
    )
    .await
}

/// One answer as the client saw it: status, `x-upstream` (the answering upstream, "" when
/// Raahi answered itself), body.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    status: u16,
    upstream: String,
    body: String,
}

async fn seen(response: reqwest::Response) -> Seen {
    let status = response.status().as_u16();
    let upstream = response
        .headers()
        .get("x-upstream")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = response.text().await.unwrap_or_default();
    Seen {
        status,
        upstream,
        body,
    }
}

async fn get(gateway: &TestGateway, path: &str) -> Seen {
    seen(gateway.get(path).await).await
}

/// `count` GETs over `concurrency` parallel loops; the answers, in no particular order.
async fn gets(gateway: &TestGateway, count: usize, concurrency: usize) -> Vec<Seen> {
    let mut workers = Vec::new();
    for worker in 0..concurrency {
        let http = gateway.http.clone();
        let url = gateway.proxy_url("/r");
        let share = count / concurrency + usize::from(worker < count % concurrency);
        workers.push(tokio::spawn(async move {
            let mut answers = Vec::new();
            for _ in 0..share {
                answers.push(seen(http.get(&url).send().await.expect("proxy answers")).await);
            }
            answers
        }));
    }
    let mut answers = Vec::new();
    for worker in workers {
        answers.extend(worker.await.expect("worker finished"));
    }
    answers
}

fn ok_from(answer: &Seen, upstream: &str) -> bool {
    answer.status == 200 && answer.upstream == upstream && answer.body == upstream
}

/// The target's own answer passed on as it is: its status, its marker header and its body.
fn passed_on(answer: &Seen, status: u16, upstream: &str) -> bool {
    answer.status == status && answer.upstream == upstream && answer.body == upstream
}

// ---------------------------------------------------------------------------------------
// Status retries and the budget
// ---------------------------------------------------------------------------------------

/// One of two targets answering 503 (as a restarting one does) costs clients nothing: the
/// default `on` (gateway_error) sends each such request to the other target.
#[tokio::test]
async fn one_target_answering_503_is_retried_on_the_other() {
    let gateway = TestGateway::start().await;
    let failing = FixedUpstream::start("a", Answer::status(503)).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    // Everything at its defaults: the route's retry, its budget, the service's ejection.
    routed(
        &gateway,
        "web",
        &[failing.target(), healthy.target()],
        json!({}),
        json!({"retry": {}}),
    )
    .await;

    let answers = gets(&gateway, 1000, 4).await;
    let ok = answers.iter().filter(|a| ok_from(a, "b")).count();
    let others: Vec<&Seen> = answers
        .iter()
        .filter(|a| !ok_from(a, "b"))
        .take(5)
        .collect();
    assert!(
        ok * 1000 >= 999 * answers.len(),
        "{ok} of {} answered 200 by b; others: {others:?}",
        answers.len()
    );
    assert!(failing.hits() >= 1, "the failing target was never picked");
    let retried = retries(&gateway, "web", "status").await;
    assert!(
        retried >= 1.0,
        "raahi_retries_total{{reason=\"status\"}} = {retried}"
    );
}

/// Every target down: three attempts per request would triple the load; the budget (20 % of
/// the requests plus 1/s over 10 s) keeps upstream requests under 1.2 × N + 10, and each
/// client gets the target's own 503.
#[tokio::test]
async fn a_total_outage_costs_no_more_upstream_requests_than_the_budget() {
    let gateway = TestGateway::start().await;
    let a = FixedUpstream::start("a", Answer::status(503)).await;
    let b = FixedUpstream::start("b", Answer::status(503)).await;
    routed(
        &gateway,
        "down",
        &[a.target(), b.target()],
        no_ejection(),
        json!({"retry": {"attempts": 3, "budget": {"percent": 20, "min_per_second": 1}}}),
    )
    .await;

    const N: usize = 300;
    let started = Instant::now();
    let mut answers = Vec::with_capacity(N);
    for _ in 0..N {
        answers.push(get(&gateway, "/r").await);
    }
    let elapsed = started.elapsed();
    for answer in &answers {
        assert!(
            passed_on(answer, 503, "a") || passed_on(answer, 503, "b"),
            "not a target's own 503: {answer:?}"
        );
    }
    let hits = a.hits() + b.hits();
    // The window is 10 one-second buckets; a run spanning more of them has a budget per
    // 10 buckets it touched (one window when it takes under 9 s, as it normally does).
    let windows = (elapsed.as_secs() as usize + 2).div_ceil(10);
    let bound = N + N / 5 + 10 * windows;
    assert!(
        hits <= bound,
        "{hits} upstream requests for {N} client requests in {elapsed:?} (bound {bound})"
    );
    assert!(
        hits > N,
        "no retry at all within the budget's floor: {hits} upstream requests for {N}"
    );
    let exhausted = metric(
        &gateway,
        "raahi_retry_budget_exhausted_total",
        &[("service", "down")],
    )
    .await;
    assert!(
        exhausted >= 1.0,
        "raahi_retry_budget_exhausted_total = {exhausted}"
    );
}

/// A target answering 409 is retried only when the route asks for `retriable_4xx`.
#[tokio::test]
async fn a_409_is_retried_only_with_retriable_4xx() {
    let conflicting = FixedUpstream::start("a", Answer::status(409)).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    let targets = [conflicting.target(), healthy.target()];

    let gateway = TestGateway::start().await;
    routed(
        &gateway,
        "web",
        &targets,
        no_ejection(),
        json!({"retry": {"on": ["retriable_4xx"]}}),
    )
    .await;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        assert!(ok_from(&answer, "b"), "{answer:?}");
    }
    assert!(conflicting.hits() >= 1, "the 409 target was never picked");
    assert!(retries(&gateway, "web", "status").await >= 1.0);

    let gateway = TestGateway::start().await;
    routed(
        &gateway,
        "web",
        &targets,
        no_ejection(),
        json!({"retry": {"on": ["gateway_error"]}}),
    )
    .await;
    let before = conflicting.hits();
    let mut conflicts = 0;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        if answer.upstream == "a" {
            assert!(passed_on(&answer, 409, "a"), "{answer:?}");
            conflicts += 1;
        } else {
            assert!(ok_from(&answer, "b"), "{answer:?}");
        }
    }
    assert!(conflicts >= 1, "round robin never picked the 409 target");
    assert_eq!(
        conflicting.hits() - before,
        conflicts,
        "each 409 was sent once"
    );
    assert_eq!(retries(&gateway, "web", "status").await, 0.0);
}

/// `retriable_status` retries the statuses the route lists, and only those.
#[tokio::test]
async fn retriable_status_retries_the_listed_statuses() {
    let gateway = TestGateway::start().await;
    let failing = FixedUpstream::start("a", Answer::status(500)).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[failing.target(), healthy.target()],
        no_ejection(),
        json!({"retry": {"on": ["retriable_status"], "statuses": [500]}}),
    )
    .await;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        assert!(ok_from(&answer, "b"), "{answer:?}");
    }
    assert!(failing.hits() >= 1, "the failing target was never picked");
    assert!(retries(&gateway, "web", "status").await >= 1.0);
}

// ---------------------------------------------------------------------------------------
// Safety: what may have been processed
// ---------------------------------------------------------------------------------------

async fn post(gateway: &TestGateway, key: Option<&str>) -> Seen {
    let mut request = gateway
        .http
        .post(gateway.proxy_url("/orders"))
        .body("one order");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    seen(request.send().await.expect("proxy answers")).await
}

/// A POST that got a 503 may have been processed: without an `Idempotency-Key` the 503 goes
/// to the client and the target saw the POST once; with one, the POST is retried elsewhere.
#[tokio::test]
async fn a_post_is_retried_only_with_an_idempotency_key() {
    let gateway = TestGateway::start().await;
    let failing = FixedUpstream::start("a", Answer::status(503)).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "orders",
        &[failing.target(), healthy.target()],
        no_ejection(),
        json!({"retry": {"on": ["gateway_error"]}}),
    )
    .await;

    let mut refused = 0;
    let mut served = 0;
    for _ in 0..20 {
        let answer = post(&gateway, None).await;
        if answer.upstream == "a" {
            assert!(passed_on(&answer, 503, "a"), "{answer:?}");
            refused += 1;
        } else {
            assert!(ok_from(&answer, "b"), "{answer:?}");
            served += 1;
        }
    }
    assert!(refused >= 1, "round robin never picked the failing target");
    assert_eq!(failing.hits(), refused, "each POST reached a once");
    assert_eq!(healthy.hits(), served, "no POST went on to b after a's 503");
    assert_eq!(retries(&gateway, "orders", "status").await, 0.0);

    let before = failing.hits();
    for i in 0..20 {
        let answer = post(&gateway, Some(&format!("k{i}"))).await;
        assert!(
            ok_from(&answer, "b"),
            "POST with Idempotency-Key: {answer:?}"
        );
    }
    assert!(failing.hits() > before, "a was never tried with a key");
    assert!(retries(&gateway, "orders", "status").await >= 1.0);
}

// ---------------------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------------------

/// A `Retry-After` longer than `backoff.max_ms` ends the retries: the 503 goes to the client.
#[tokio::test]
async fn a_retry_after_beyond_max_backoff_ends_the_retries() {
    let gateway = TestGateway::start().await;
    let failing =
        FixedUpstream::start("a", Answer::status(503).with_header("retry-after", "1")).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[failing.target(), healthy.target()],
        no_ejection(),
        json!({"retry": {"backoff": {"base_ms": 25, "max_ms": 250}}}),
    )
    .await;
    let mut refused = 0;
    let mut served = 0;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        if answer.upstream == "a" {
            assert!(passed_on(&answer, 503, "a"), "{answer:?}");
            refused += 1;
        } else {
            assert!(ok_from(&answer, "b"), "{answer:?}");
            served += 1;
        }
    }
    assert!(refused >= 1, "round robin never picked the failing target");
    assert_eq!(failing.hits(), refused);
    assert_eq!(
        healthy.hits(),
        served,
        "no request went on to b after a's 503"
    );
    assert_eq!(retries(&gateway, "web", "status").await, 0.0);
}

/// `Retry-After: 0` is within any backoff: the request is retried and succeeds.
#[tokio::test]
async fn a_retry_after_of_zero_is_retried() {
    let gateway = TestGateway::start().await;
    let failing =
        FixedUpstream::start("a", Answer::status(503).with_header("retry-after", "0")).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[failing.target(), healthy.target()],
        no_ejection(),
        json!({"retry": {"backoff": {"base_ms": 25, "max_ms": 250}}}),
    )
    .await;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        assert!(ok_from(&answer, "b"), "{answer:?}");
    }
    assert!(failing.hits() >= 1, "the failing target was never picked");
    assert!(retries(&gateway, "web", "status").await >= 1.0);
}

/// A `Retry-After` within `backoff.max_ms` is waited for before the retry.
#[tokio::test]
async fn a_retry_after_within_max_backoff_is_waited_for() {
    let gateway = TestGateway::start().await;
    let failing =
        FixedUpstream::start("a", Answer::status(503).with_header("retry-after", "1")).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[failing.target(), healthy.target()],
        no_ejection(),
        json!({"retry": {"backoff": {"base_ms": 25, "max_ms": 2000}}}),
    )
    .await;
    let mut waited = 0;
    for _ in 0..4 {
        let before = failing.hits();
        let started = Instant::now();
        let answer = get(&gateway, "/r").await;
        let elapsed = started.elapsed();
        assert!(ok_from(&answer, "b"), "{answer:?}");
        if failing.hits() > before {
            assert!(
                elapsed >= Duration::from_millis(1000),
                "retried after {elapsed:?}, before a's Retry-After of 1 s"
            );
            waited += 1;
        }
    }
    assert!(waited >= 1, "round robin never picked the failing target");
}

// ---------------------------------------------------------------------------------------
// Per-try timeouts and hedging
// ---------------------------------------------------------------------------------------

/// An attempt without response headers within `per_try_timeout_ms` is abandoned and the GET
/// goes to the other target, long before the stalled one would answer.
#[tokio::test]
async fn a_per_try_timeout_moves_a_get_to_a_healthy_target() {
    let gateway = TestGateway::start().await;
    let stalled =
        FixedUpstream::start("a", Answer::status(200).after(Duration::from_secs(5))).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[stalled.target(), healthy.target()],
        no_ejection(),
        json!({"retry": {"per_try_timeout_ms": 200}}),
    )
    .await;
    for _ in 0..4 {
        let started = Instant::now();
        let answer = get(&gateway, "/r").await;
        let elapsed = started.elapsed();
        assert!(ok_from(&answer, "b"), "{answer:?}");
        // The stalled target answers after 5 s; one per-try timeout and a retry take 200 ms
        // and a backoff of at most 250 ms.
        assert!(
            elapsed < Duration::from_secs(2),
            "answered after {elapsed:?}"
        );
    }
    assert!(stalled.hits() >= 1, "the stalled target was never picked");
    assert!(retries(&gateway, "web", "per_try_timeout").await >= 1.0);
}

/// A GET without response headers after `hedge_after_ms` gets a second attempt on the other
/// target, whose answer wins.
#[tokio::test]
async fn a_hedged_get_is_answered_by_the_faster_target() {
    let gateway = TestGateway::start().await;
    let slow = FixedUpstream::start("a", Answer::status(200).after(Duration::from_secs(1))).await;
    let fast = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[slow.target(), fast.target()],
        no_ejection(),
        json!({"retry": {"attempts": 2, "hedge_after_ms": 50}}),
    )
    .await;
    for _ in 0..10 {
        let started = Instant::now();
        let answer = get(&gateway, "/r").await;
        let elapsed = started.elapsed();
        assert!(ok_from(&answer, "b"), "{answer:?}");
        assert!(
            elapsed < Duration::from_millis(900),
            "answered after {elapsed:?}: the slow target's answer"
        );
    }
    assert!(slow.hits() >= 1, "the slow target was never picked");
    let hedges = metric(&gateway, "raahi_hedges_total", &[("service", "web")]).await;
    assert!(hedges >= 1.0, "raahi_hedges_total = {hedges}");
}

/// Hedges spend the retry budget: with no percent and a floor of 1/s, 40 concurrent GETs of
/// which about half go first to a stalled target send at most 10 hedges in the window.
#[tokio::test]
async fn hedges_are_bounded_by_the_budget() {
    let gateway = TestGateway::start().await;
    let slow = FixedUpstream::start("a", Answer::status(200).after(Duration::from_secs(1))).await;
    let fast = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[slow.target(), fast.target()],
        no_ejection(),
        json!({"retry": {"attempts": 2, "hedge_after_ms": 50,
                         "budget": {"percent": 0, "min_per_second": 1}}}),
    )
    .await;
    let answers = gets(&gateway, 40, 40).await;
    for answer in &answers {
        assert!(ok_from(answer, "a") || ok_from(answer, "b"), "{answer:?}");
    }
    let hedges = metric(&gateway, "raahi_hedges_total", &[("service", "web")]).await;
    assert!(
        (1.0..=10.0).contains(&hedges),
        "raahi_hedges_total = {hedges}, the budget allows 10 in the window"
    );
    let from_slow = answers.iter().filter(|a| ok_from(a, "a")).count();
    assert!(
        from_slow >= 1,
        "every request hedged: {hedges} hedges for {} answers from b",
        answers.len()
    );
    let exhausted = metric(
        &gateway,
        "raahi_retry_budget_exhausted_total",
        &[("service", "web")],
    )
    .await;
    assert!(
        exhausted >= 1.0,
        "raahi_retry_budget_exhausted_total = {exhausted}"
    );
}

// ---------------------------------------------------------------------------------------
// Routes without `retry`
// ---------------------------------------------------------------------------------------

/// A route without `retry` follows the service's `max_attempts`: a target that refuses
/// connections costs nothing (nothing was sent), and the retry is counted.
#[tokio::test]
async fn without_retry_a_connect_failure_goes_to_another_target() {
    let gateway = TestGateway::start().await;
    let closed: SocketAddr = free_addr();
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    let mut service = no_ejection();
    service["max_attempts"] = json!(3);
    routed(
        &gateway,
        "web",
        &[
            json!({"host": "127.0.0.1", "port": closed.port()}),
            healthy.target(),
        ],
        service,
        json!({}),
    )
    .await;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        assert!(ok_from(&answer, "b"), "{answer:?}");
    }
    let retried = retries(&gateway, "web", "connect_failure").await;
    assert!(
        retried >= 1.0,
        "raahi_retries_total{{reason=\"connect_failure\"}} = {retried}"
    );
}

/// A route without `retry` keeps today's rules: a target's 503 is an answer, passed on.
#[tokio::test]
async fn without_retry_a_503_is_passed_on() {
    let gateway = TestGateway::start().await;
    let failing = FixedUpstream::start("a", Answer::status(503)).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    routed(
        &gateway,
        "web",
        &[failing.target(), healthy.target()],
        no_ejection(),
        json!({}),
    )
    .await;
    let mut refused = 0;
    for _ in 0..10 {
        let answer = get(&gateway, "/r").await;
        if answer.upstream == "a" {
            assert!(passed_on(&answer, 503, "a"), "{answer:?}");
            refused += 1;
        } else {
            assert!(ok_from(&answer, "b"), "{answer:?}");
        }
    }
    assert!(refused >= 1, "round robin never picked the failing target");
    assert_eq!(failing.hits(), refused);
}

// ---------------------------------------------------------------------------------------
// gRPC
// ---------------------------------------------------------------------------------------

/// An h2c service over a target answering every call trailers-only UNAVAILABLE and a healthy
/// tonic origin, with a route retrying `unavailable`.
async fn grpc_gateway(failing: &FailingGrpcUpstream, healthy: &GrpcOrigin) -> TestGateway {
    let gateway = TestGateway::start().await;
    routed(
        &gateway,
        "grpc",
        &[
            json!({"host": "127.0.0.1", "port": failing.addr.port()}),
            json!({"host": "127.0.0.1", "port": healthy.addr.port()}),
        ],
        json!({"protocol": "h2c", "ejection": false}),
        json!({"retry": {"on": ["unavailable"]}}),
    )
    .await;
    gateway
}

fn call(text: &str) -> EchoRequest {
    EchoRequest {
        text: text.to_owned(),
        ..EchoRequest::default()
    }
}

/// A gRPC call is a POST: once it got an answer (a trailers-only UNAVAILABLE) it may have been
/// processed, so without an `Idempotency-Key` it is not sent again even though the route
/// names `unavailable` (TRAFFIC.md §5's safety rule); the status goes to the client as it is.
#[tokio::test]
async fn a_grpc_unavailable_without_an_idempotency_key_is_passed_on() {
    let failing = FailingGrpcUpstream::start(14).await;
    let healthy = GrpcOrigin::start("b").await;
    let gateway = grpc_gateway(&failing, &healthy).await;
    let mut grpc = client(gateway.proxy).await;
    let mut unavailable = 0;
    for i in 0..10 {
        match grpc.unary(call(&format!("call {i}"))).await {
            Ok(reply) => assert_eq!(reply.into_inner().origin, "b"),
            Err(status) => {
                assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
                assert_eq!(status.message(), "failing-origin", "{status:?}");
                unavailable += 1;
            }
        }
    }
    assert!(
        unavailable >= 1,
        "round robin never picked the failing origin"
    );
    assert_eq!(failing.hits(), unavailable, "each call reached it once");
    assert_eq!(
        healthy.calls(),
        10 - unavailable as u64,
        "no call went on to b"
    );
    assert_eq!(retries(&gateway, "grpc", "grpc_status").await, 0.0);
}

/// With an `Idempotency-Key` in the call's metadata the same UNAVAILABLE is retried on the
/// healthy origin (tonic sends no Content-Length: the streamed body is kept for the retry).
#[tokio::test]
async fn a_grpc_unavailable_with_an_idempotency_key_is_retried() {
    let failing = FailingGrpcUpstream::start(14).await;
    let healthy = GrpcOrigin::start("b").await;
    let gateway = grpc_gateway(&failing, &healthy).await;
    let mut grpc = client(gateway.proxy).await;
    for i in 0..10 {
        let mut request = tonic::Request::new(call(&format!("call {i}")));
        request
            .metadata_mut()
            .insert("idempotency-key", format!("key-{i}").parse().unwrap());
        let reply = grpc
            .unary(request)
            .await
            .unwrap_or_else(|status| panic!("call {i}: {status:?}"))
            .into_inner();
        assert_eq!(reply.origin, "b");
    }
    assert!(failing.hits() >= 1, "the failing origin was never picked");
    assert!(retries(&gateway, "grpc", "grpc_status").await >= 1.0);
}

/// A unary call sent as one HTTP/2 request with a `Content-Length` (which tonic never sends):
/// its gRPC status (from the head or the trailers) and, when it succeeded, the origin that
/// answered.
async fn unary_with_length(
    sender: &mut hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    addr: SocketAddr,
    key: Option<&str>,
) -> (String, String) {
    use http_body_util::BodyExt;
    use prost::Message;
    let encoded = call("known length").encode_to_vec();
    let mut framed = vec![0u8];
    framed.extend_from_slice(&(encoded.len() as u32).to_be_bytes());
    framed.extend_from_slice(&encoded);
    let mut request = hyper::Request::post(format!("http://{addr}/raahi.test.Echo/Unary"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("content-length", framed.len());
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(framed)))
        .unwrap();
    let response = sender.send_request(request).await.expect("an answer");
    assert_eq!(response.status(), 200);
    let head_status = response
        .headers()
        .get("grpc-status")
        .map(|value| value.to_str().unwrap().to_owned());
    let collected = response.into_body().collect().await.expect("the body");
    let trailer_status = collected
        .trailers()
        .and_then(|trailers| trailers.get("grpc-status"))
        .map(|value| value.to_str().unwrap().to_owned());
    let body = collected.to_bytes();
    let origin = if body.len() > 5 {
        crate::common::grpc::EchoReply::decode(&body[5..])
            .expect("an EchoReply")
            .origin
    } else {
        String::new()
    };
    (head_status.or(trailer_status).unwrap_or_default(), origin)
}

/// With its body read ahead (a `Content-Length` within the route's buffer) and an
/// `Idempotency-Key`, a unary call's trailers-only UNAVAILABLE is retried: what isolates the
/// gRPC condition from the streaming of bodies without a length.
#[tokio::test]
async fn a_grpc_call_read_ahead_with_an_idempotency_key_is_retried() {
    let failing = FailingGrpcUpstream::start(14).await;
    let healthy = GrpcOrigin::start("b").await;
    let gateway = grpc_gateway(&failing, &healthy).await;
    let stream = tokio::net::TcpStream::connect(gateway.proxy).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    for i in 0..10 {
        let key = format!("key-{i}");
        let answer = unary_with_length(&mut sender, gateway.proxy, Some(&key)).await;
        assert_eq!(answer, ("0".to_owned(), "b".to_owned()), "call {i}");
    }
    assert!(failing.hits() >= 1, "the failing origin was never picked");
    assert!(retries(&gateway, "grpc", "grpc_status").await >= 1.0);
}

// ---------------------------------------------------------------------------------------
// The access log
// ---------------------------------------------------------------------------------------

/// A `raahi serve` process writing JSON access lines.
async fn logging_process() -> RaahiProcess {
    RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "json"),
    ])
    .await
}

/// A service `name` (ejection off) over `targets` and a route for the paths under
/// `/{name}` with `retry`.
async fn logged_route(process: &RaahiProcess, name: &str, targets: &[Value], retry: Value) {
    let service = process
        .create("/api/v1/services", json!({"name": name, "ejection": false}))
        .await;
    let service = service["id"].as_i64().unwrap();
    for target in targets {
        process
            .create(
                &format!("/api/v1/services/{service}/targets"),
                target.clone(),
            )
            .await;
    }
    process
        .create(
            "/api/v1/routes",
            json!({"name": name, "service_id": service, "path_prefix": format!("/{name}"),
                   "retry": retry}),
        )
        .await;
}

/// GETs `path` with fresh request ids until `first` received one (round robin picks it
/// within two requests); the status of that request and its id.
async fn get_until_hit(process: &RaahiProcess, path: &str, first: &FixedUpstream) -> (u16, String) {
    let http = reqwest::Client::new();
    for i in 0..4 {
        let id = format!("{}-{i}", path.trim_start_matches('/'));
        let before = first.hits();
        let response = http
            .get(format!("http://{}{path}", process.proxy))
            .header("x-request-id", &id)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        if first.hits() > before {
            return (status, id);
        }
    }
    panic!("four requests to {path} and none reached {}", first.name);
}

/// The fields of the access line of request `id`, and the line.
async fn access_fields(process: &mut RaahiProcess, id: &str) -> (Value, String) {
    let id_field = format!("\"request_id\":\"{id}\"");
    let line = process
        .stderr_line(|line| line.contains("raahi::access") && line.contains(&id_field))
        .await;
    let entry: Value = serde_json::from_str(&line).expect("a JSON line");
    (entry["fields"].clone(), line)
}

/// The access line of a retried request names its attempts and why it was retried.
#[tokio::test]
async fn the_access_log_names_the_attempts_and_the_retry_reason() {
    let failing = FixedUpstream::start("a", Answer::status(503)).await;
    let healthy = FixedUpstream::start("b", Answer::status(200)).await;
    let mut process = logging_process().await;
    logged_route(
        &process,
        "web",
        &[failing.target(), healthy.target()],
        json!({}),
    )
    .await;
    let (status, id) = get_until_hit(&process, "/web", &failing).await;
    assert_eq!(status, 200);
    let (fields, line) = access_fields(&mut process, &id).await;
    assert_eq!(fields["attempts"], 2, "{line}");
    assert_eq!(fields["retry_reason"], "status", "{line}");
    assert_eq!(fields["target"], healthy.addr.to_string(), "{line}");
    // Written when true (or not at all): neither happened here.
    assert_ne!(fields["hedged"], true, "{line}");
    assert_ne!(fields["retry_budget_exhausted"], true, "{line}");
}

/// The access line tells a hedged request, and a failure the budget kept from a retry.
#[tokio::test]
async fn the_access_log_names_hedges_and_an_exhausted_budget() {
    let slow =
        FixedUpstream::start("slow", Answer::status(200).after(Duration::from_secs(1))).await;
    let fast = FixedUpstream::start("fast", Answer::status(200)).await;
    let down = FixedUpstream::start("down", Answer::status(503)).await;
    let mut process = logging_process().await;
    logged_route(
        &process,
        "hedge",
        &[slow.target(), fast.target()],
        json!({"attempts": 2, "hedge_after_ms": 50}),
    )
    .await;
    // No budget at all: the first retry is refused.
    logged_route(
        &process,
        "down",
        &[down.target()],
        json!({"budget": {"percent": 0, "min_per_second": 0}}),
    )
    .await;

    let (status, id) = get_until_hit(&process, "/hedge", &slow).await;
    assert_eq!(status, 200);
    let (fields, line) = access_fields(&mut process, &id).await;
    assert_eq!(fields["hedged"], true, "{line}");
    assert_eq!(fields["attempts"], 2, "{line}");
    assert_eq!(fields["target"], fast.addr.to_string(), "{line}");

    let (status, id) = get_until_hit(&process, "/down", &down).await;
    assert_eq!(status, 503);
    let (fields, line) = access_fields(&mut process, &id).await;
    assert_eq!(fields["retry_budget_exhausted"], true, "{line}");
    assert_eq!(fields["attempts"], 1, "{line}");
    assert_eq!(down.hits(), 1, "the refused retry was not sent");
}
