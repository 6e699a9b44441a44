//! Active health checks and passive outlier ejection through real sockets (DESIGN.md §5:
//! "Available = active ∧ enabled ∧ health ≠ unhealthy ∧ not ejected ∧ weight > 0"), the panic
//! fallback, and validation of the `health_check` and `ejection` settings.

use crate::common;
use common::*;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// One active health check a [`Fake`] upstream answered.
#[derive(Debug, Clone)]
struct CheckSeen {
    status: u16,
    host: Option<String>,
}

struct FakeState {
    name: String,
    /// Status of every request except `/health`.
    status: AtomicU16,
    /// Status of `/health`.
    health: AtomicU16,
    /// Requests except `/health`.
    traffic: AtomicUsize,
    checks: Mutex<Vec<CheckSeen>>,
}

/// A tiny HTTP/1.1 upstream whose answers the test switches at run time: `/health` answers
/// `health` (and records the check's Host), every other path answers `status` with the name
/// as the body.
struct Fake {
    addr: SocketAddr,
    state: Arc<FakeState>,
    task: JoinHandle<()>,
}

impl Fake {
    async fn start(name: &str, status: u16) -> Fake {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(FakeState {
            name: name.to_owned(),
            status: AtomicU16::new(status),
            health: AtomicU16::new(200),
            traffic: AtomicUsize::new(0),
            checks: Mutex::new(Vec::new()),
        });
        let shared = state.clone();
        let task = tokio::spawn(async move {
            // Dropped with the task: aborting it closes every open connection too.
            let mut connections = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let state = shared.clone();
                connections.spawn(async move {
                    let service = service_fn(move |request| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(fake_answer(&state, request)) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Fake { addr, state, task }
    }

    fn set_status(&self, status: u16) {
        self.state.status.store(status, Ordering::SeqCst);
    }

    fn set_health(&self, status: u16) {
        self.state.health.store(status, Ordering::SeqCst);
    }

    fn traffic(&self) -> usize {
        self.state.traffic.load(Ordering::SeqCst)
    }

    fn checks(&self) -> Vec<CheckSeen> {
        self.state.checks.lock().unwrap().clone()
    }

    /// Checks answered with `status`, from the `from`-th check on.
    fn checks_answered(&self, status: u16, from: usize) -> usize {
        self.checks()
            .iter()
            .skip(from)
            .filter(|check| check.status == status)
            .count()
    }

    fn body(&self) -> Value {
        json!({"host": self.addr.ip().to_string(), "port": self.addr.port()})
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn fake_answer(state: &FakeState, request: Request<Incoming>) -> Response<Full<Bytes>> {
    let status = if request.uri().path() == "/health" {
        let status = state.health.load(Ordering::SeqCst);
        let host = request
            .headers()
            .get(hyper::header::HOST)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        state
            .checks
            .lock()
            .unwrap()
            .push(CheckSeen { status, host });
        status
    } else {
        state.traffic.fetch_add(1, Ordering::SeqCst);
        state.status.load(Ordering::SeqCst)
    };
    let mut response = Response::new(Full::new(Bytes::from(state.name.clone())));
    *response.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
    response
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// A service from `body` (its `name` is required) with a route on `path_prefix` (any host).
async fn service(gateway: &TestGateway, body: Value, path_prefix: &str) -> i64 {
    let name = body["name"].as_str().unwrap().to_owned();
    let id = gateway.create("/api/v1/services", body).await;
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": format!("{name}-route"), "service_id": id, "path_prefix": path_prefix}),
        )
        .await;
    id
}

async fn add_target(gateway: &TestGateway, service: i64, body: Value) -> i64 {
    gateway
        .create(&format!("/api/v1/services/{service}/targets"), body)
        .await
}

fn addr_body(addr: SocketAddr, priority: i32) -> Value {
    json!({"host": addr.ip().to_string(), "port": addr.port(), "priority": priority})
}

/// A GET through the proxy: status and body.
async fn send(gateway: &TestGateway, path: &str) -> (u16, String) {
    let response = gateway.get(path).await;
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// `GET /api/v1/services/{id}/runtime`
async fn runtime(gateway: &TestGateway, service: i64) -> Value {
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/services/{service}/runtime"), None)
        .await;
    assert_eq!(status, 200, "runtime view: {view}");
    view
}

fn runtime_target(view: &Value, target: i64) -> Value {
    view["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry["id"] == target)
        .cloned()
        .unwrap_or_else(|| panic!("target {target} not in the runtime view: {view}"))
}

/// The end of a target's ejection (Unix ms) as the runtime view shows it; None: not ejected.
fn ejected_until(entry: &Value) -> Option<i64> {
    entry["ejected_until"].as_str().map(|text| {
        chrono::DateTime::parse_from_rfc3339(text)
            .unwrap_or_else(|e| panic!("ejected_until {text:?}: {e}"))
            .timestamp_millis()
    })
}

async fn ejection_of(gateway: &TestGateway, service: i64, target: i64) -> Option<i64> {
    ejected_until(&runtime_target(&runtime(gateway, service).await, target))
}

fn ejected_count(view: &Value) -> usize {
    view["targets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|entry| ejected_until(entry).is_some())
        .count()
}

/// The target listing entry of one target (`GET /api/v1/services/{id}/targets`).
async fn listed_target(gateway: &TestGateway, service: i64, target: i64) -> Value {
    let (status, list) = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await;
    assert_eq!(status, 200, "target listing: {list}");
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|entry| entry["id"] == target)
        .cloned()
        .unwrap_or_else(|| panic!("target {target} not listed: {list}"))
}

async fn health_of(gateway: &TestGateway, service: i64, target: i64) -> String {
    listed_target(gateway, service, target).await["health"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Whether nothing listens on `addr` (a stopped upstream has released it).
fn free(addr: SocketAddr) -> bool {
    std::net::TcpListener::bind(addr).is_ok()
}

/// Sends requests one at a time until `target` shows as ejected. Returns the ejection's end and
/// the wall clock just before and just after the request that ejected it.
async fn drive_until_ejected(
    gateway: &TestGateway,
    path: &str,
    service: i64,
    target: i64,
) -> (i64, i64, i64) {
    for _ in 0..200 {
        let before = now_ms();
        send(gateway, path).await;
        let after = now_ms();
        if let Some(until) = ejection_of(gateway, service, target).await {
            return (until, before, after);
        }
    }
    panic!("target {target} was not ejected after 200 requests");
}

// ---------------------------------------------------------------------------------------------
// 1. Killing an upstream under steady load
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_an_upstream_under_load_ejects_it_without_failing_requests_and_it_comes_back() {
    const CLIENTS: usize = 4;
    const PER_CLIENT: usize = 500;
    const BASE_EJECTION_MS: i64 = 5_000;

    let gateway = TestGateway::start().await;
    let a = Upstream::start("a").await;
    let b = Upstream::start("b").await;
    let c = Upstream::start("c").await;
    let service = service(
        &gateway,
        json!({"name": "steady", "ejection": {
            "failures": 3, "window_ms": 5000, "base_ejection_ms": BASE_EJECTION_MS
        }}),
        "/",
    )
    .await;
    add_target(&gateway, service, target(&a, 1, 0)).await;
    add_target(&gateway, service, target(&b, 1, 0)).await;
    let c_id = add_target(&gateway, service, target(&c, 1, 0)).await;
    let c_addr = c.addr;

    // ~2,000 requests over ~10 s from a few clients, each paced at one request per 20 ms.
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut clients = JoinSet::new();
    for client in 0..CLIENTS {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap();
        let url = gateway.proxy_url(&format!("/load/{client}"));
        let done = done.clone();
        let failed = failed.clone();
        clients.spawn(async move {
            let mut pace = tokio::time::interval(Duration::from_millis(20));
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for _ in 0..PER_CLIENT {
                pace.tick().await;
                match http.get(&url).send().await {
                    Ok(response) if response.status().is_success() => {
                        let _ = response.bytes().await;
                    }
                    Ok(response) => failed
                        .lock()
                        .unwrap()
                        .push(format!("status {}", response.status())),
                    Err(error) => failed.lock().unwrap().push(format!("error {error}")),
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
        });
    }

    // ~2 s into the load, every upstream serves; then c dies like a killed process.
    wait_until("400 requests done", Duration::from_secs(30), || {
        let done = done.clone();
        async move { done.load(Ordering::SeqCst) >= 400 }
    })
    .await;
    assert!(
        a.hits() > 0 && b.hits() > 0 && c.hits() > 0,
        "all three serve before the kill: a {} b {} c {}",
        a.hits(),
        b.hits(),
        c.hits()
    );
    c.stop();

    let until = wait_until(
        "the killed upstream shows as ejected",
        Duration::from_secs(5),
        || ejection_of(&gateway, service, c_id),
    )
    .await;
    let remaining = until - now_ms();
    assert!(
        remaining > 0 && remaining <= BASE_EJECTION_MS,
        "a first ejection lasts base_ejection_ms: {remaining} ms left"
    );
    drop(c);

    // While it is ejected, the proxy must not even try it: a listener on its address that
    // counts (and closes) connections sees none until shortly before the ejection ends.
    let counting = wait_until(
        "the killed upstream's address is free",
        Duration::from_secs(5),
        || async { TcpListener::bind(c_addr).await.ok() },
    )
    .await;
    let connections = Arc::new(AtomicUsize::new(0));
    let accepted = connections.clone();
    let counter = tokio::spawn(async move {
        loop {
            if let Ok((stream, _)) = counting.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                drop(stream);
            }
        }
    });
    let done_at_watch_start = done.load(Ordering::SeqCst);
    let watch_end = until - 500;
    let wait = watch_end - now_ms();
    assert!(
        wait > 2_000,
        "too little of the ejection left to watch: {wait} ms"
    );
    holds_for(
        "no connection to the ejected target",
        Duration::from_millis(wait as u64),
        || async {
            let got = connections.load(Ordering::SeqCst);
            let watched = done.load(Ordering::SeqCst) - done_at_watch_start;
            if got == 0 {
                Ok(())
            } else {
                Err(format!(
                    "{got} connections while {watched} requests were served"
                ))
            }
        },
    )
    .await;
    let watched = done.load(Ordering::SeqCst) - done_at_watch_start;
    assert!(
        watched >= 200,
        "the load kept going while the target was ejected ({watched} requests)"
    );
    assert!(
        ejection_of(&gateway, service, c_id).await.is_some(),
        "still ejected at the end of the watch"
    );
    counter.abort();
    let _ = counter.await;

    // A real upstream comes back on the address: after the ejection ends, trial traffic reaches
    // it and it is back in rotation.
    wait_until(
        "the address is free again",
        Duration::from_secs(5),
        || async { free(c_addr).then_some(()) },
    )
    .await;
    let restarted = Upstream::start_on("c-again", c_addr).await;
    wait_until(
        "the restarted upstream is back in rotation",
        Duration::from_secs(15),
        || {
            let gateway = &gateway;
            let restarted = &restarted;
            let done = &done;
            async move {
                if done.load(Ordering::SeqCst) >= CLIENTS * PER_CLIENT {
                    // The load ended first: keep some traffic going.
                    let (status, _) = send(gateway, "/after").await;
                    assert_eq!(status, 200);
                }
                restarted.hits() >= 10
            }
        },
    )
    .await;
    let entry = runtime_target(&runtime(&gateway, service).await, c_id);
    assert_eq!(entry["ejected_until"], Value::Null, "{entry}");
    assert_eq!(entry["available"], true, "{entry}");

    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }
    let failed = failed.lock().unwrap().clone();
    let total = CLIENTS * PER_CLIENT;
    eprintln!(
        "{total} requests, {} failed; {watched} served during the watched ejection; \
         c-again served {} after it",
        failed.len(),
        restarted.hits()
    );
    assert!(
        failed.len() * 100 <= total,
        "{} of {total} requests failed (at most 1 % may): {:?}",
        failed.len(),
        &failed[..failed.len().min(10)]
    );
}

// ---------------------------------------------------------------------------------------------
// 2. Status-based ejection
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn failure_statuses_eject_a_target_after_the_configured_failures() {
    let gateway = TestGateway::start().await;
    let good_a = Fake::start("good-a", 200).await;
    let good_b = Fake::start("good-b", 200).await;
    let bad = Fake::start("bad", 503).await;
    let service = service(
        &gateway,
        json!({"name": "statuses", "ejection": {
            "failures": 3, "window_ms": 60000, "base_ejection_ms": 60000
        }}),
        "/",
    )
    .await;
    add_target(&gateway, service, good_a.body()).await;
    add_target(&gateway, service, good_b.body()).await;
    let bad_id = add_target(&gateway, service, bad.body()).await;

    let mut answers = Vec::new();
    for _ in 0..100 {
        answers.push(send(&gateway, "/x").await.0);
        if ejection_of(&gateway, service, bad_id).await.is_some() {
            break;
        }
        assert!(
            bad.traffic() < 3,
            "still not ejected after {} 503s",
            bad.traffic()
        );
    }
    assert_eq!(
        bad.traffic(),
        3,
        "ejected by exactly its 3rd failure; answers {answers:?}"
    );
    assert_eq!(
        answers.iter().filter(|&&status| status == 503).count(),
        3,
        "the upstream's 503s pass through: {answers:?}"
    );
    for _ in 0..30 {
        let (status, body) = send(&gateway, "/x").await;
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("good-"), "{body}");
    }
    assert_eq!(bad.traffic(), 3, "an ejected target gets no traffic");
    let entry = runtime_target(&runtime(&gateway, service).await, bad_id);
    assert_eq!(entry["available"], false, "{entry}");
}

#[tokio::test]
async fn statuses_outside_failure_statuses_do_not_eject() {
    let gateway = TestGateway::start().await;
    let good = Fake::start("good", 200).await;
    let bad = Fake::start("bad", 503).await;
    let service = service(
        &gateway,
        json!({"name": "only-500", "ejection": {
            "failures": 2, "base_ejection_ms": 60000, "failure_statuses": [500]
        }}),
        "/",
    )
    .await;
    add_target(&gateway, service, good.body()).await;
    let bad_id = add_target(&gateway, service, bad.body()).await;

    for _ in 0..30 {
        send(&gateway, "/x").await;
        assert_eq!(
            ejection_of(&gateway, service, bad_id).await,
            None,
            "503 is not in failure_statuses [500]"
        );
    }
    assert!(
        bad.traffic() >= 10,
        "it kept getting traffic: {}",
        bad.traffic()
    );

    // The same target answering a listed status is ejected.
    bad.set_status(500);
    let before = bad.traffic();
    drive_until_ejected(&gateway, "/x", service, bad_id).await;
    assert_eq!(bad.traffic() - before, 2, "two 500s eject it");
}

#[tokio::test]
async fn ejection_false_never_ejects() {
    let gateway = TestGateway::start().await;
    let good = Fake::start("good", 200).await;
    let bad = Fake::start("bad", 503).await;
    let service = service(&gateway, json!({"name": "never", "ejection": false}), "/").await;
    add_target(&gateway, service, good.body()).await;
    let bad_id = add_target(&gateway, service, bad.body()).await;
    // Connect failures do not eject either.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let dead_id = add_target(&gateway, service, addr_body(dead, 0)).await;

    for _ in 0..60 {
        send(&gateway, "/x").await;
        let view = runtime(&gateway, service).await;
        assert_eq!(ejected_count(&view), 0, "ejection is off: {view}");
    }
    assert!(
        bad.traffic() >= 20,
        "the failing target kept getting traffic: {}",
        bad.traffic()
    );
    let view = runtime(&gateway, service).await;
    for id in [bad_id, dead_id] {
        assert_eq!(runtime_target(&view, id)["available"], true, "{view}");
    }
}

// ---------------------------------------------------------------------------------------------
// 3. max_ejection_percent
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_ejection_percent_bounds_how_many_targets_are_out_at_once() {
    let gateway = Arc::new(TestGateway::start().await);
    let good = Fake::start("good", 200).await;
    let bad: Vec<Fake> = vec![
        Fake::start("bad-1", 503).await,
        Fake::start("bad-2", 503).await,
        Fake::start("bad-3", 503).await,
    ];
    let service = service(
        &gateway,
        json!({"name": "bounded", "ejection": {
            "failures": 2, "window_ms": 60000, "base_ejection_ms": 60000,
            "max_ejection_percent": 50
        }}),
        "/",
    )
    .await;
    add_target(&gateway, service, good.body()).await;
    for fake in &bad {
        add_target(&gateway, service, fake.body()).await;
    }

    // A few concurrent clients while a monitor watches the runtime view.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let most = Arc::new(AtomicUsize::new(0));
    let monitor = {
        let gateway = gateway.clone();
        let stop = stop.clone();
        let most = most.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                let view = runtime(&gateway, service).await;
                most.fetch_max(ejected_count(&view), Ordering::SeqCst);
            }
        })
    };
    let mut clients = JoinSet::new();
    for _ in 0..4 {
        let gateway = gateway.clone();
        clients.spawn(async move {
            for _ in 0..40 {
                send(&gateway, "/x").await;
            }
        });
    }
    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    monitor.await.unwrap();

    let view = runtime(&gateway, service).await;
    assert_eq!(
        ejected_count(&view),
        2,
        "50 % of 4 targets are ejected, not more: {view}"
    );
    assert!(
        most.load(Ordering::SeqCst) <= 2,
        "at some point {} targets were ejected at once",
        most.load(Ordering::SeqCst)
    );
    // The third failing target stays in rotation however often it fails.
    let traffic: Vec<usize> = bad.iter().map(Fake::traffic).collect();
    for _ in 0..20 {
        send(&gateway, "/x").await;
    }
    let grew = bad
        .iter()
        .zip(&traffic)
        .filter(|(fake, before)| fake.traffic() > **before)
        .count();
    assert_eq!(grew, 1, "exactly one failing target still gets traffic");
    assert_eq!(ejected_count(&runtime(&gateway, service).await), 2);
}

#[tokio::test]
async fn a_lone_target_can_be_ejected() {
    let gateway = TestGateway::start().await;
    let bad = Fake::start("lonely", 503).await;
    let service = service(
        &gateway,
        json!({"name": "lone", "ejection": {
            "failures": 2, "base_ejection_ms": 60000, "max_ejection_percent": 50
        }}),
        "/",
    )
    .await;
    let bad_id = add_target(&gateway, service, bad.body()).await;
    drive_until_ejected(&gateway, "/x", service, bad_id).await;
    assert_eq!(bad.traffic(), 2, "ejected by its second failure");
}

// ---------------------------------------------------------------------------------------------
// 4. Backoff
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn a_failed_trial_doubles_the_ejection_and_a_successful_one_restores_the_target() {
    const BASE: i64 = 1_000;
    let gateway = TestGateway::start().await;
    let good = Fake::start("good", 200).await;
    let flaky = Fake::start("flaky", 503).await;
    let service = service(
        &gateway,
        json!({"name": "backoff", "ejection": {
            "failures": 2, "window_ms": 60000, "base_ejection_ms": BASE,
            "max_ejection_ms": 60000, "max_ejection_percent": 50
        }}),
        "/",
    )
    .await;
    add_target(&gateway, service, good.body()).await;
    let flaky_id = add_target(&gateway, service, flaky.body()).await;

    let wait_for_return = |what: &'static str| {
        let gateway = &gateway;
        async move {
            wait_until(what, Duration::from_secs(5), || async move {
                ejection_of(gateway, service, flaky_id).await.is_none()
            })
            .await;
        }
    };

    // First ejection: base.
    let (until, before, after) = drive_until_ejected(&gateway, "/x", service, flaky_id).await;
    assert_eq!(flaky.traffic(), 2);
    assert!(
        until >= before + BASE && until <= after + BASE,
        "first ejection lasts base: until {until}, request sent {before}..{after}"
    );

    // It ends; the trial request fails: out again at once, for twice as long.
    wait_for_return("the first ejection ends").await;
    let entry = runtime_target(&runtime(&gateway, service).await, flaky_id);
    assert_eq!(entry["half_open"], true, "ended but unproven: {entry}");
    assert_eq!(entry["ejections"], 1, "{entry}");
    assert_eq!(entry["available"], true, "open to a trial: {entry}");
    let traffic = flaky.traffic();
    let (until, before, after) = drive_until_ejected(&gateway, "/x", service, flaky_id).await;
    assert_eq!(
        flaky.traffic(),
        traffic + 1,
        "one failed trial ejects it again"
    );
    assert!(
        until >= before + 2 * BASE && until <= after + 2 * BASE,
        "second ejection lasts 2 × base: until {until}, request sent {before}..{after}"
    );

    // It recovers: the trial after the second ejection succeeds and restores it.
    flaky.set_status(200);
    wait_for_return("the second ejection ends").await;
    let traffic = flaky.traffic();
    for _ in 0..20 {
        let (status, _) = send(&gateway, "/x").await;
        assert_eq!(status, 200);
        if flaky.traffic() > traffic {
            break;
        }
    }
    assert!(flaky.traffic() > traffic, "the trial request reached it");
    let entry = runtime_target(&runtime(&gateway, service).await, flaky_id);
    assert_eq!(entry["ejected_until"], Value::Null, "{entry}");
    assert_eq!(entry["available"], true, "{entry}");
    assert_eq!(entry["half_open"], false, "restored: {entry}");
    assert_eq!(entry["ejections"], 0, "{entry}");

    // Restored: one failure no longer ejects it, and the next ejection lasts base again.
    flaky.set_status(503);
    let traffic = flaky.traffic();
    let (until, before, after) = drive_until_ejected(&gateway, "/x", service, flaky_id).await;
    assert_eq!(
        flaky.traffic(),
        traffic + 2,
        "off probation: `failures` failures are needed again"
    );
    assert!(
        until >= before + BASE && until <= after + BASE,
        "the ejection after a recovery lasts base again: until {until}, request sent {before}..{after}"
    );
}

// ---------------------------------------------------------------------------------------------
// 5. Active health checks
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn http_checks_move_health_by_thresholds_and_steer_traffic() {
    let gateway = TestGateway::start().await;
    let x = Fake::start("x", 200).await;
    let y = Fake::start("y", 200).await;
    let service = service(
        &gateway,
        json!({
            "name": "checked",
            "upstream_authority": "api.internal:8443",
            "health_check": {
                "path": "/health", "interval_ms": 150, "timeout_ms": 200,
                "healthy_threshold": 2, "unhealthy_threshold": 3
            }
        }),
        "/",
    )
    .await;
    let x_id = add_target(&gateway, service, x.body()).await;
    let y_id = add_target(&gateway, service, y.body()).await;

    wait_until("both targets healthy", Duration::from_secs(10), || {
        let gateway = &gateway;
        async move {
            health_of(gateway, service, x_id).await == "healthy"
                && health_of(gateway, service, y_id).await == "healthy"
        }
    })
    .await;
    let entry = listed_target(&gateway, service, x_id).await;
    assert_eq!(entry["last_check"]["passed"], true, "{entry}");
    assert_eq!(entry["last_check"]["detail"], "HTTP 200", "{entry}");
    assert!(entry["last_check"]["at"].is_string(), "{entry}");
    for check in x.checks() {
        assert_eq!(
            check.host.as_deref(),
            Some("api.internal:8443"),
            "checks send the service's upstream_authority as Host"
        );
    }

    // Unhealthy after exactly `unhealthy_threshold` failed checks.
    x.set_health(500);
    wait_until("x unhealthy", Duration::from_secs(10), || {
        let gateway = &gateway;
        let x = &x;
        async move {
            let failed_before = x.checks_answered(500, 0);
            let health = health_of(gateway, service, x_id).await;
            let failed_after = x.checks_answered(500, 0);
            match health.as_str() {
                "healthy" => {
                    assert!(
                        failed_before <= 3,
                        "still healthy after {failed_before} failed checks"
                    );
                    false
                }
                "unhealthy" => {
                    assert!(
                        failed_after >= 3,
                        "unhealthy after only {failed_after} failed checks"
                    );
                    assert!(
                        failed_before <= 4,
                        "unhealthy only after {failed_before} failed checks"
                    );
                    true
                }
                other => panic!("unexpected health {other}"),
            }
        }
    })
    .await;
    wait_until(
        "the stored last check names the failure",
        Duration::from_secs(5),
        || {
            let gateway = &gateway;
            async move {
                let entry = listed_target(gateway, service, x_id).await;
                entry["last_check"]["passed"] == false
                    && entry["last_check"]["detail"]
                        .as_str()
                        .is_some_and(|detail| detail.contains("HTTP 500"))
            }
        },
    )
    .await;
    let view = runtime(&gateway, service).await;
    let entry = runtime_target(&view, x_id);
    assert_eq!(entry["health"], "unhealthy", "{view}");
    assert_eq!(entry["available"], false, "{view}");

    // An unhealthy target gets no traffic while another is healthy.
    let x_traffic = x.traffic();
    for _ in 0..20 {
        let (status, body) = send(&gateway, "/work").await;
        assert_eq!((status, body.as_str()), (200, "y"));
    }
    assert_eq!(x.traffic(), x_traffic, "no traffic to the unhealthy target");

    // Healthy again after exactly `healthy_threshold` passed checks.
    let mark = x.checks().len();
    x.set_health(200);
    wait_until("x healthy again", Duration::from_secs(10), || {
        let gateway = &gateway;
        let x = &x;
        async move {
            let passed_before = x.checks_answered(200, mark);
            let health = health_of(gateway, service, x_id).await;
            let passed_after = x.checks_answered(200, mark);
            match health.as_str() {
                "unhealthy" => {
                    assert!(
                        passed_before <= 2,
                        "still unhealthy after {passed_before} passed checks"
                    );
                    false
                }
                "healthy" => {
                    assert!(
                        passed_after >= 2,
                        "healthy after only {passed_after} passed checks"
                    );
                    true
                }
                other => panic!("unexpected health {other}"),
            }
        }
    })
    .await;
    wait_until("x gets traffic again", Duration::from_secs(5), || {
        let gateway = &gateway;
        let x = &x;
        async move {
            let (status, _) = send(gateway, "/work").await;
            assert_eq!(status, 200);
            x.traffic() > x_traffic
        }
    })
    .await;

    // `health_check.host` is the Host of the checks.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"health_check": {"host": "health.example:9000"}})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["health_check"]["path"], "/health", "{body}");
    assert_eq!(body["health_check"]["interval_ms"], 150, "{body}");
    let first_new = wait_until(
        "a check with the configured Host",
        Duration::from_secs(5),
        || async {
            x.checks()
                .iter()
                .position(|check| check.host.as_deref() == Some("health.example:9000"))
        },
    )
    .await;
    wait_until("three more checks", Duration::from_secs(5), || {
        let x = &x;
        async move { x.checks().len() >= first_new + 3 }
    })
    .await;
    for check in &x.checks()[first_new..] {
        assert_eq!(check.host.as_deref(), Some("health.example:9000"));
    }
}

#[tokio::test]
async fn tcp_checks_mark_a_stopped_upstream_unhealthy() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("tcp-checked").await;
    let other = Upstream::start("other").await;
    let service = service(
        &gateway,
        json!({
            "name": "tcp-checked",
            "health_check": {
                "type": "tcp", "interval_ms": 100, "timeout_ms": 200,
                "healthy_threshold": 1, "unhealthy_threshold": 2
            }
        }),
        "/",
    )
    .await;
    let id = add_target(&gateway, service, target(&upstream, 1, 0)).await;
    add_target(&gateway, service, target(&other, 1, 0)).await;

    wait_until("healthy by TCP connect", Duration::from_secs(10), || {
        let gateway = &gateway;
        async move {
            let entry = listed_target(gateway, service, id).await;
            entry["health"] == "healthy" && entry["last_check"]["passed"] == true
        }
    })
    .await;
    assert_eq!(upstream.hits(), 0, "a TCP check sends no HTTP request");

    let addr = upstream.addr;
    upstream.stop();
    wait_until(
        "unhealthy once nothing listens",
        Duration::from_secs(10),
        || {
            let gateway = &gateway;
            async move {
                let entry = listed_target(gateway, service, id).await;
                entry["health"] == "unhealthy"
                    && entry["last_check"]["passed"] == false
                    && entry["last_check"]["detail"]
                        .as_str()
                        .is_some_and(|detail| detail.contains("connect"))
            }
        },
    )
    .await;
    let view = runtime(&gateway, service).await;
    assert_eq!(runtime_target(&view, id)["available"], false, "{view}");
    for _ in 0..10 {
        let (status, body) = send(&gateway, "/").await;
        assert_eq!((status, body.as_str()), (200, "other"));
    }

    drop(upstream);
    wait_until("the address is free", Duration::from_secs(5), || async {
        free(addr).then_some(())
    })
    .await;
    let _back = Upstream::start_on("tcp-back", addr).await;
    wait_until(
        "healthy again once it listens",
        Duration::from_secs(10),
        || {
            let gateway = &gateway;
            async move { health_of(gateway, service, id).await == "healthy" }
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------------
// 6. Tier failover
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn an_unhealthy_tier_fails_over_to_the_next() {
    let gateway = TestGateway::start().await;
    let primary_a = Fake::start("primary-a", 200).await;
    let primary_b = Fake::start("primary-b", 200).await;
    let backup = Fake::start("backup", 200).await;
    let service = service(
        &gateway,
        json!({
            "name": "tiers",
            "health_check": {
                "path": "/health", "interval_ms": 100, "timeout_ms": 200,
                "healthy_threshold": 1, "unhealthy_threshold": 2
            }
        }),
        "/",
    )
    .await;
    let a_id = add_target(&gateway, service, addr_body(primary_a.addr, 0)).await;
    let b_id = add_target(&gateway, service, addr_body(primary_b.addr, 0)).await;
    let backup_id = add_target(&gateway, service, addr_body(backup.addr, 10)).await;

    wait_until("every target healthy", Duration::from_secs(10), || {
        let gateway = &gateway;
        async move {
            let view = runtime(gateway, service).await;
            [a_id, b_id, backup_id]
                .iter()
                .all(|id| runtime_target(&view, *id)["health"] == "healthy")
        }
    })
    .await;
    for _ in 0..20 {
        let (status, body) = send(&gateway, "/").await;
        assert_eq!(status, 200);
        assert!(body.starts_with("primary-"), "priority 0 wins: {body}");
    }
    assert_eq!(backup.traffic(), 0);

    primary_a.set_health(500);
    primary_b.set_health(500);
    wait_until(
        "the priority 0 tier unhealthy",
        Duration::from_secs(10),
        || {
            let gateway = &gateway;
            async move {
                let view = runtime(gateway, service).await;
                [a_id, b_id]
                    .iter()
                    .all(|id| runtime_target(&view, *id)["health"] == "unhealthy")
            }
        },
    )
    .await;
    let primary_traffic = primary_a.traffic() + primary_b.traffic();
    for _ in 0..20 {
        let (status, body) = send(&gateway, "/").await;
        assert_eq!((status, body.as_str()), (200, "backup"));
    }
    assert_eq!(primary_a.traffic() + primary_b.traffic(), primary_traffic);
    assert_eq!(
        runtime(&gateway, service).await["panic_picks"],
        0,
        "failing over is not panic"
    );

    // One primary recovers: traffic goes back to the priority 0 tier.
    primary_a.set_health(200);
    wait_until("primary-a healthy", Duration::from_secs(10), || {
        let gateway = &gateway;
        async move { health_of(gateway, service, a_id).await == "healthy" }
    })
    .await;
    let backup_traffic = backup.traffic();
    for _ in 0..10 {
        let (status, body) = send(&gateway, "/").await;
        assert_eq!((status, body.as_str()), (200, "primary-a"));
    }
    assert_eq!(backup.traffic(), backup_traffic);
}

// ---------------------------------------------------------------------------------------------
// 7. Panic fallback
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn with_every_target_unhealthy_requests_still_go_to_them_as_panic_picks() {
    let gateway = TestGateway::start().await;
    let one = Fake::start("sick-1", 200).await;
    let two = Fake::start("sick-2", 200).await;
    one.set_health(500);
    two.set_health(500);
    let service = service(
        &gateway,
        json!({
            "name": "all-sick",
            "health_check": {
                "path": "/health", "interval_ms": 100, "timeout_ms": 200,
                "healthy_threshold": 1, "unhealthy_threshold": 1
            }
        }),
        "/",
    )
    .await;
    let one_id = add_target(&gateway, service, one.body()).await;
    let two_id = add_target(&gateway, service, two.body()).await;
    wait_until("both unhealthy", Duration::from_secs(10), || {
        let gateway = &gateway;
        async move {
            let view = runtime(gateway, service).await;
            [one_id, two_id]
                .iter()
                .all(|id| runtime_target(&view, *id)["health"] == "unhealthy")
        }
    })
    .await;
    let before = runtime(&gateway, service).await["panic_picks"]
        .as_u64()
        .unwrap();
    for _ in 0..200 {
        let (status, body) = send(&gateway, "/").await;
        assert_eq!(
            status, 200,
            "panic mode answers from unhealthy targets: {body}"
        );
        assert!(body.starts_with("sick-"), "{body}");
    }
    // Panic mode still balances (weighted random over the targets in rotation), not all on one:
    // each gets at least a quarter of 200 picks (binomial: failing by chance is below 1e-12).
    assert!(
        one.traffic() >= 50 && two.traffic() >= 50,
        "200 panic picks spread over both targets: sick-1 got {}, sick-2 got {}",
        one.traffic(),
        two.traffic()
    );
    let after = runtime(&gateway, service).await["panic_picks"]
        .as_u64()
        .unwrap();
    assert_eq!(after - before, 200, "every request was a panic pick");
}

#[tokio::test]
async fn with_every_target_ejected_requests_still_go_to_them_as_panic_picks() {
    let gateway = TestGateway::start().await;
    let only = Fake::start("ejected", 503).await;
    let service = service(
        &gateway,
        json!({"name": "all-ejected", "ejection": {"failures": 2, "base_ejection_ms": 60000}}),
        "/",
    )
    .await;
    let only_id = add_target(&gateway, service, only.body()).await;
    drive_until_ejected(&gateway, "/", service, only_id).await;
    assert_eq!(runtime(&gateway, service).await["panic_picks"], 0);

    only.set_status(200);
    let traffic = only.traffic();
    let (status, body) = send(&gateway, "/").await;
    assert_eq!(
        (status, body.as_str()),
        (200, "ejected"),
        "an ejected-only service still answers from its target"
    );
    assert_eq!(only.traffic(), traffic + 1);
    assert_eq!(runtime(&gateway, service).await["panic_picks"], 1);
}

#[tokio::test]
async fn disabled_targets_are_not_a_panic_reason() {
    let gateway = TestGateway::start().await;
    let upstream = Upstream::start("disabled").await;
    let service = service(
        &gateway,
        json!({
            "name": "switched-off",
            "health_check": {"path": "/", "interval_ms": 100, "timeout_ms": 200}
        }),
        "/",
    )
    .await;
    let mut body = target(&upstream, 1, 0);
    body["enabled"] = json!(false);
    add_target(&gateway, service, body).await;

    for _ in 0..5 {
        let (status, body) = send(&gateway, "/").await;
        assert_eq!(status, 503, "{body}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            ProxyError::read(&body).code,
            "no_available_target",
            "{body}"
        );
    }
    assert_eq!(upstream.hits(), 0);
    let view = runtime(&gateway, service).await;
    assert_eq!(view["panic_picks"], 0, "{view}");
    assert_eq!(view["targets"], json!([]), "{view}");
}

// ---------------------------------------------------------------------------------------------
// 8. Validation
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn health_check_and_ejection_settings_are_validated_and_round_trip() {
    let gateway = TestGateway::start().await;

    let invalid = [
        (
            json!({"name": "v1", "health_check": {"expected_statuses": ["abc"]}}),
            "health_check.expected_statuses[0]",
        ),
        (
            json!({"name": "v2", "health_check": {"interval_ms": 0}}),
            "health_check.interval_ms",
        ),
        (
            json!({"name": "v3", "ejection": {"failures": 2, "bogus": 1}}),
            "ejection.bogus",
        ),
    ];
    for (body, field) in invalid {
        let (status, answer) = gateway
            .api("POST", "/api/v1/services", Some(body.clone()))
            .await;
        assert_eq!(status, 422, "{body} → {answer}");
        assert_eq!(
            ApiError::read(&answer).field.as_deref(),
            Some(field),
            "{body} → {answer}"
        );
    }
    let (_, list) = gateway.api("GET", "/api/v1/services", None).await;
    assert_eq!(list["items"], json!([]), "nothing invalid was stored");

    // `false` turns ejection off and reads back as the full object.
    let defaults = json!({
        "failures": 5, "window_ms": 30000, "base_ejection_ms": 30000,
        "max_ejection_ms": 300000, "max_ejection_percent": 50,
        "failure_statuses": [502, 503, 504]
    });
    let mut off = defaults.clone();
    off["enabled"] = json!(false);
    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "off", "ejection": false, "health_check": {}})),
        )
        .await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["ejection"], off, "{created}");
    assert_eq!(
        created["health_check"],
        json!({
            "type": "http", "path": "/", "interval_ms": 10000, "timeout_ms": 2000,
            "healthy_threshold": 2, "unhealthy_threshold": 3,
            "expected_statuses": ["200-399"], "host": null
        }),
        "{created}"
    );
    let id = created["id"].as_i64().unwrap();
    let (_, read) = gateway
        .api("GET", &format!("/api/v1/services/{id}"), None)
        .await;
    assert_eq!(read["ejection"], off, "{read}");
    // What GET shows can be written back unchanged.
    let mut spec = read.clone();
    for key in ["id", "created_at", "updated_at", "managed_by"] {
        spec.as_object_mut().unwrap().remove(key);
    }
    let (status, replaced) = gateway
        .api("PUT", &format!("/api/v1/services/{id}"), Some(spec))
        .await;
    assert_eq!(status, 200, "{replaced}");
    assert_eq!(replaced["ejection"], off, "{replaced}");

    // An omitted ejection is on with the defaults.
    let (_, plain) = gateway
        .api("POST", "/api/v1/services", Some(json!({"name": "plain"})))
        .await;
    let mut on = defaults.clone();
    on["enabled"] = json!(true);
    assert_eq!(plain["ejection"], on, "{plain}");
    assert_eq!(plain["health_check"], Value::Null, "{plain}");

    // PATCH of one ejection field keeps the others.
    let (status, custom) = gateway
        .api(
            "POST",
            "/api/v1/services",
            Some(json!({"name": "custom", "ejection": {
                "window_ms": 1234, "base_ejection_ms": 2000, "max_ejection_ms": 9000,
                "max_ejection_percent": 30, "failure_statuses": [500]
            }})),
        )
        .await;
    assert_eq!(status, 201, "{custom}");
    let id = custom["id"].as_i64().unwrap();
    let (status, patched) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{id}"),
            Some(json!({"ejection": {"failures": 2}})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(
        patched["ejection"],
        json!({
            "enabled": true, "failures": 2, "window_ms": 1234, "base_ejection_ms": 2000,
            "max_ejection_ms": 9000, "max_ejection_percent": 30, "failure_statuses": [500]
        }),
        "{patched}"
    );
    let (_, read) = gateway
        .api("GET", &format!("/api/v1/services/{id}"), None)
        .await;
    assert_eq!(read["ejection"], patched["ejection"]);

    // An invalid PATCH changes nothing.
    let (status, answer) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{id}"),
            Some(json!({"ejection": {"nope": true}})),
        )
        .await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(
        ApiError::read(&answer).field.as_deref(),
        Some("ejection.nope"),
        "{answer}"
    );
    let (_, read) = gateway
        .api("GET", &format!("/api/v1/services/{id}"), None)
        .await;
    assert_eq!(read["ejection"], patched["ejection"]);
}

// ---------------------------------------------------------------------------------------------
// 9. Review fixes: checks turned off, successes during an ejection
// ---------------------------------------------------------------------------------------------

/// The panic-pick counter of a service's runtime view.
fn panic_picks(view: &Value) -> u64 {
    view["panic_picks"]
        .as_u64()
        .unwrap_or_else(|| panic!("no panic_picks in the runtime view: {view}"))
}

/// With `health_check` removed nothing will ever check the target again: the verdict of the
/// old checks must go with them, or an unhealthy target stays out (a panic pick) for good.
#[tokio::test]
async fn turning_health_checks_off_clears_an_old_unhealthy_verdict() {
    let gateway = TestGateway::start().await;
    let once_sick = Fake::start("once-sick", 200).await;
    once_sick.set_health(500);
    let service = service(
        &gateway,
        json!({
            "name": "checks-off",
            "health_check": {
                "path": "/health", "interval_ms": 100, "timeout_ms": 200,
                "healthy_threshold": 1, "unhealthy_threshold": 1
            }
        }),
        "/",
    )
    .await;
    let sick_id = add_target(&gateway, service, once_sick.body()).await;
    wait_until("the target unhealthy", Duration::from_secs(10), || {
        let gateway = &gateway;
        async move {
            runtime_target(&runtime(gateway, service).await, sick_id)["health"] == "unhealthy"
        }
    })
    .await;
    // While unhealthy, the only target is reached as a panic pick.
    let before = panic_picks(&runtime(&gateway, service).await);
    assert_eq!(send(&gateway, "/work").await, (200, "once-sick".to_owned()));
    assert_eq!(
        panic_picks(&runtime(&gateway, service).await),
        before + 1,
        "an unhealthy lone target is a panic pick"
    );

    let (status, patched) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"health_check": null})),
        )
        .await;
    assert_eq!(status, 200, "{patched}");
    assert_eq!(patched["health_check"], Value::Null, "{patched}");

    let view = runtime(&gateway, service).await;
    let entry = runtime_target(&view, sick_id);
    assert_eq!(
        entry["health"], "unknown",
        "health checks are off, yet the old verdict stays: {view}"
    );
    assert_eq!(entry["available"], true, "{view}");
    assert_eq!(health_of(&gateway, service, sick_id).await, "unknown");
    let picks = panic_picks(&view);
    let checks_at_patch = once_sick.checks().len();

    // Over several former check intervals: no check brings the verdict back, and every request
    // is answered by the target as an available one, not as a panic pick.
    let requests = std::cell::Cell::new(0);
    holds_for(
        "the target answering as an available one, its health unknown",
        Duration::from_millis(600),
        || async {
            let answer = send(&gateway, "/work").await;
            requests.set(requests.get() + 1);
            let requests = requests.get();
            if answer != (200, "once-sick".to_owned()) {
                return Err(format!("request {requests} answered {answer:?}"));
            }
            let view = runtime(&gateway, service).await;
            let entry = runtime_target(&view, sick_id);
            if entry["health"] == "unknown" && entry["available"] == true {
                Ok(())
            } else {
                Err(format!("after {requests} requests: {view}"))
            }
        },
    )
    .await;
    let requests = requests.get();
    assert!(requests >= 5, "only {requests} requests in 600 ms");
    assert_eq!(
        panic_picks(&runtime(&gateway, service).await),
        picks,
        "requests after the checks were turned off counted as panic picks"
    );
    // A check already under way when the loop stopped may still have arrived.
    assert!(
        once_sick.checks().len() <= checks_at_patch + 1,
        "checks go on after health_check was removed: {} then {}",
        checks_at_patch,
        once_sick.checks().len()
    );
}

/// A request that started before its target was ejected and succeeds while the ejection runs
/// must not end the ejection: only a trial after it may restore the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_success_that_lands_during_an_ejection_does_not_end_it() {
    let gateway = TestGateway::start().await;
    // The harness upstream: `/slow/MS` answers 200 after MS ms, `/status/503` answers 503.
    let flaky = Upstream::start("flaky").await;
    let backup = Fake::start("backup", 200).await;
    let service = service(
        &gateway,
        json!({"name": "late-success", "ejection": {
            "failures": 2, "window_ms": 60000, "base_ejection_ms": 60000
        }}),
        "/",
    )
    .await;
    // Tier 0 takes every request while it is available; the backup tier takes over after.
    let flaky_id = add_target(&gateway, service, target(&flaky, 1, 0)).await;
    add_target(&gateway, service, addr_body(backup.addr, 10)).await;

    // A slow request to the target, in flight before the ejection.
    let slow = {
        let client = gateway.http.clone();
        let url = gateway.proxy_url("/slow/1500");
        tokio::spawn(async move {
            let response = client.get(url).send().await.expect("proxy answers");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap())
        })
    };
    wait_until(
        "the slow request reaches the target",
        Duration::from_secs(10),
        || async {
            flaky
                .seen
                .lock()
                .unwrap()
                .iter()
                .any(|seen| seen.path == "/slow/1500")
        },
    )
    .await;

    // Two failures eject it.
    for _ in 0..2 {
        assert_eq!(
            send(&gateway, "/status/503").await,
            (503, "flaky".to_owned())
        );
    }
    let until = ejection_of(&gateway, service, flaky_id)
        .await
        .expect("ejected by its 2nd failure");
    assert!(
        !slow.is_finished(),
        "the slow request finished before the ejection; the test needs a slower one"
    );
    assert_eq!(send(&gateway, "/x").await, (200, "backup".to_owned()));

    // The slow request succeeds while the ejection runs.
    let answer = tokio::time::timeout(Duration::from_secs(10), slow)
        .await
        .expect("the slow request ends")
        .expect("the slow request's task");
    assert_eq!(answer, (200, "flaky".to_owned()));

    let view = runtime(&gateway, service).await;
    let entry = runtime_target(&view, flaky_id);
    assert_eq!(
        ejected_until(&entry),
        Some(until),
        "a success during the ejection ended or changed it: {view}"
    );
    assert_eq!(entry["available"], false, "{view}");
    let hits = flaky.hits();
    for _ in 0..10 {
        assert_eq!(send(&gateway, "/x").await, (200, "backup".to_owned()));
    }
    assert_eq!(flaky.hits(), hits, "the ejected target got traffic again");
}

// ---------------------------------------------------------------------------------------------
// 10. Half-open recovery
// ---------------------------------------------------------------------------------------------

/// An upstream that answers every request 503 after `delay`, counting the requests and the
/// most it held at once.
struct Broken {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    most_at_once: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Broken {
    async fn start(delay: Duration) -> Broken {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let requests = Arc::new(AtomicUsize::new(0));
        let most_at_once = Arc::new(AtomicUsize::new(0));
        let active = Arc::new(AtomicUsize::new(0));
        let (counted, most) = (requests.clone(), most_at_once.clone());
        let task = tokio::spawn(async move {
            let mut connections = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (counted, most, active) = (counted.clone(), most.clone(), active.clone());
                let service = service_fn(move |_request: Request<Incoming>| {
                    let (counted, most, active) = (counted.clone(), most.clone(), active.clone());
                    async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        most.fetch_max(active.fetch_add(1, Ordering::SeqCst) + 1, Ordering::SeqCst);
                        tokio::time::sleep(delay).await;
                        active.fetch_sub(1, Ordering::SeqCst);
                        let mut response = Response::new(Full::new(Bytes::from_static(b"broken")));
                        *response.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
                        Ok::<_, Infallible>(response)
                    }
                });
                connections.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        Broken {
            addr,
            requests,
            most_at_once,
            task,
        }
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for Broken {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// DESIGN.md §5: when an ejection ends the target admits one request at a time until one
/// succeeds or fails; it does not take its share while unproven. Under concurrent load, a target
/// that stays broken gets one request per ejection that ends — the trial that ejects it again —
/// where taking its share would send it every other request for as long as its slow 503 takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn under_load_a_still_broken_target_gets_one_request_per_ended_ejection() {
    const CLIENTS: usize = 12;
    const PER_CLIENT: usize = 4_000;
    const EJECTIONS: u64 = 6;

    let gateway = TestGateway::start().await;
    let good = Fake::start("good", 200).await;
    // Slow enough that, taking its share, it would hold several requests at once.
    let broken = Broken::start(Duration::from_millis(50)).await;
    let service = service(
        &gateway,
        json!({"name": "half-open", "ejection": {
            "failures": 1, "window_ms": 60000, "base_ejection_ms": 100, "max_ejection_ms": 300
        }}),
        "/",
    )
    .await;
    add_target(&gateway, service, good.body()).await;
    let broken_id = add_target(&gateway, service, addr_body(broken.addr, 0)).await;

    // One request at a time until it is ejected: its first failure, its only request so far.
    drive_until_ejected(&gateway, "/x", service, broken_id).await;
    // On a slow machine the first ejection may already have ended in a trial by now.
    let before_load = broken.requests();
    assert!(
        (1..=2).contains(&before_load),
        "{before_load} requests before the load"
    );

    // Concurrent clients, each paced at one request per 2 ms, until the target has been ejected
    // EJECTIONS times (each ejection after the first ended in a trial, ~1.5 s in all).
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let statuses = Arc::new(Mutex::new(Vec::<u16>::new()));
    let mut clients = JoinSet::new();
    for client in 0..CLIENTS {
        let http = gateway.http.clone();
        let url = gateway.proxy_url(&format!("/load/{client}"));
        let (stop, statuses) = (stop.clone(), statuses.clone());
        clients.spawn(async move {
            let mut pace = tokio::time::interval(Duration::from_millis(2));
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            for _ in 0..PER_CLIENT {
                if stop.load(Ordering::SeqCst) {
                    break;
                }
                pace.tick().await;
                let status = match http.get(&url).send().await {
                    Ok(response) => {
                        let status = response.status().as_u16();
                        let _ = response.bytes().await;
                        status
                    }
                    Err(_) => 0,
                };
                statuses.lock().unwrap().push(status);
            }
        });
    }
    let ejections = |view: &Value| {
        runtime_target(view, broken_id)["ejections"]
            .as_u64()
            .unwrap_or_else(|| panic!("no ejections in the runtime view: {view}"))
    };
    wait_until(
        "the broken target ejected again and again",
        Duration::from_secs(30),
        || {
            let gateway = &gateway;
            async move { ejections(&runtime(gateway, service).await) >= EJECTIONS }
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);
    while let Some(joined) = clients.join_next().await {
        joined.unwrap();
    }

    // Every client has its answer, and a trial's outcome is recorded before its client gets
    // the answer: the counts are final.
    let view = runtime(&gateway, service).await;
    let ejected = ejections(&view) as usize;
    let statuses = statuses.lock().unwrap().clone();
    let failed = statuses.iter().filter(|&&status| status == 503).count();
    eprintln!(
        "{} requests under load, {failed} answered 503; the broken target got {} in all and was \
         ejected {ejected} times; the good one served {}",
        statuses.len(),
        broken.requests(),
        good.traffic()
    );
    assert!(
        broken.requests() <= ejected,
        "{} requests reached the broken target over {ejected} ejections: more than the one \
         trial each ended ejection admits",
        broken.requests()
    );
    assert_eq!(
        broken.most_at_once.load(Ordering::SeqCst),
        1,
        "the broken target held several requests at once"
    );
    assert_eq!(
        failed,
        broken.requests() - before_load,
        "the load's only failures are the trials"
    );
    assert!(
        statuses
            .iter()
            .all(|&status| status == 200 || status == 503),
        "every request answered by a target: {:?}",
        statuses
            .iter()
            .filter(|&&s| s != 200 && s != 503)
            .collect::<Vec<_>>()
    );
    assert!(
        statuses.len() >= 200,
        "the load kept going over the ejections: {} requests",
        statuses.len()
    );
    assert_eq!(
        view["panic_picks"], 0,
        "the good target was always there: {view}"
    );
}
