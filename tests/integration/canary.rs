//! Canaries through real sockets (TRAFFIC.md §4): a healthy canary promoted step by step with
//! the traffic share following each step exactly; a canary answering 10 % 500s rolled back and
//! sent nothing afterwards; the view, the operator's actions and their refusals; `canary`
//! events and `raahi_canary_weight`; the declarative file; a restart mid-step; a gRPC canary
//! failing in its trailers; two gateways on PostgreSQL sharing one canary.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http_body_util::Full;
use hyper::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::common::fake_server::Listening;
use crate::common::grpc::{client as grpc_client, Code, EchoRequest, GrpcOrigin};
use crate::common::{
    assert_error, cluster_config, holds_for, postgres, target, test_config, test_config_with,
    wait_until, TestGateway, Upstream, ADMIN_TOKEN,
};

/// Longest wait for what a gateway does on its own with the short intervals used here.
const WAIT: Duration = Duration::from_secs(20);

/// Services `stable` and `canary` over one upstream each.
async fn two_services(gateway: &TestGateway, stable: SocketAddr, canary: SocketAddr) -> (i64, i64) {
    let target_of = |addr: SocketAddr| json!({"host": "127.0.0.1", "port": addr.port()});
    let stable = gateway
        .service_with_targets("stable", &[target_of(stable)])
        .await;
    let canary = gateway
        .service_with_targets("canary", &[target_of(canary)])
        .await;
    (stable, canary)
}

/// A route `name` to `stable` and `canary` (backend 1) with `canary` as its canary.
async fn canary_route(
    gateway: &TestGateway,
    name: &str,
    (stable, canary_service): (i64, i64),
    canary: Value,
) -> i64 {
    gateway
        .create(
            "/api/v1/routes",
            json!({"name": name, "backends": [
                {"service_id": stable}, {"service_id": canary_service}],
                "canary": canary}),
        )
        .await
}

/// `GET /api/v1/routes/{id}/canary`, which must answer 200.
async fn canary_view(gateway: &TestGateway, route: i64) -> Value {
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/routes/{route}/canary"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{view}");
    view
}

/// `POST /api/v1/routes/{id}/canary/{action}`: status and body.
async fn act(gateway: &TestGateway, route: i64, action: &str) -> (StatusCode, Value) {
    gateway
        .api(
            "POST",
            &format!("/api/v1/routes/{route}/canary/{action}"),
            None,
        )
        .await
}

/// `raahi_canary_weight{route="name"}` as the gateway's `/metrics` shows it: the weight its data
/// path applies; None when the series is absent.
async fn applied_weight(gateway: &TestGateway, name: &str) -> Option<u64> {
    let series = format!("raahi_canary_weight{{route=\"{name}\"}} ");
    gateway
        .metrics_text()
        .await
        .lines()
        .find_map(|line| line.strip_prefix(&series)?.trim().parse::<u64>().ok())
}

/// Sends `count` GETs one after another; every one must answer 200.
async fn send_ok(gateway: &TestGateway, count: usize) {
    for _ in 0..count {
        let status = gateway.get("/").await.status();
        assert_eq!(status, StatusCode::OK);
    }
}

/// Sends `count` GETs one after another, whatever they answer; returns the 500s.
async fn send_any(gateway: &TestGateway, count: usize) -> usize {
    let mut failed = 0;
    for _ in 0..count {
        if gateway.get("/").await.status() == StatusCode::INTERNAL_SERVER_ERROR {
            failed += 1;
        }
    }
    failed
}

/// A view's `at`/`started_at` time.
fn time_of(value: &Value) -> DateTime<Utc> {
    value
        .as_str()
        .and_then(|text| DateTime::parse_from_rfc3339(text).ok())
        .unwrap_or_else(|| panic!("a time: {value}"))
        .with_timezone(&Utc)
}

fn round_of(view: &Value) -> i64 {
    view["interval"]["round"].as_i64().expect("a round")
}

fn history(view: &Value) -> Vec<Value> {
    view["history"].as_array().expect("a history").clone()
}

/// Requests and errors of backend `backend` in a history entry or interval's `counts`.
fn counted(counts: &Value, backend: usize) -> (u64, u64) {
    let entry = &counts[backend];
    (
        entry["requests"].as_u64().unwrap_or(0),
        entry["errors"].as_u64().unwrap_or(0),
    )
}

/// Over `count` requests (a multiple of the step's period) sent while the gateway applies one
/// step, the canary's share is exact (smooth weighted round robin): returns the weight in force
/// when the window was clean (the same round in the store and the same weight applied on both
/// sides of it), after asserting the share; None when a move crossed the window.
async fn exact_window(
    gateway: &TestGateway,
    route: i64,
    name: &str,
    canary_hits: impl Fn() -> usize,
    count: usize,
) -> Option<u64> {
    let before = canary_view(gateway, route).await;
    let applied = applied_weight(gateway, name).await;
    let hits = canary_hits();
    send_ok(gateway, count).await;
    let received = canary_hits() - hits;
    let after = canary_view(gateway, route).await;
    let weight = before["weight"].as_u64()?;
    let clean = round_of(&before) == round_of(&after)
        && applied == Some(weight)
        && applied_weight(gateway, name).await == Some(weight);
    if !clean {
        return None;
    }
    assert_eq!(
        received as u64,
        count as u64 * weight / 100,
        "the canary's share of {count} requests at {weight} %: {after}"
    );
    Some(weight)
}

/// The event stream of a gateway (`GET /api/v1/events`), read frame by frame.
struct Events {
    response: reqwest::Response,
    buffer: String,
}

impl Events {
    async fn open(gateway: &TestGateway) -> Events {
        let response = gateway
            .http
            .get(gateway.admin_url("/api/v1/events"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("events answer");
        assert_eq!(response.status(), 200);
        Events {
            response,
            buffer: String::new(),
        }
    }

    /// The `canary` events' data until one matches `last` (included), within `wait`.
    async fn canary_until(&mut self, wait: Duration, last: impl Fn(&Value) -> bool) -> Vec<Value> {
        let deadline = Instant::now() + wait;
        let mut seen = Vec::new();
        loop {
            while let Some(end) = self.buffer.find("\n\n") {
                let frame: String = self.buffer.drain(..end + 2).collect();
                let mut kind = None;
                let mut data = None;
                for line in frame.lines() {
                    if let Some(value) = line.strip_prefix("event: ") {
                        kind = Some(value.to_owned());
                    } else if let Some(value) = line.strip_prefix("data: ") {
                        data = serde_json::from_str::<Value>(value).ok();
                    }
                }
                if let (Some("canary"), Some(data)) = (kind.as_deref(), data) {
                    let done = last(&data);
                    seen.push(data);
                    if done {
                        return seen;
                    }
                }
            }
            let chunk = tokio::time::timeout_at(deadline, self.response.chunk())
                .await
                .unwrap_or_else(|_| panic!("no closing canary event within {wait:?}: {seen:?}"))
                .expect("the stream reads")
                .expect("the stream stays open");
            self.buffer
                .push_str(std::str::from_utf8(&chunk).expect("UTF-8 events"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_canary_is_promoted_with_the_share_following_each_step() {
    let gateway = TestGateway::start().await;
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let services = two_services(&gateway, stable.addr, canary.addr).await;
    let mut events = Events::open(&gateway).await;
    let route = canary_route(
        &gateway,
        "shop",
        services,
        json!({"backend": 1, "steps": [5, 25, 50, 100], "step_interval_ms": 1000,
               "min_requests": 5}),
    )
    .await;
    let started = canary_view(&gateway, route).await;
    assert_eq!(started["state"], "progressing");
    assert_eq!(
        (started["step"].clone(), started["weight"].clone()),
        (json!(0), json!(5))
    );
    assert_eq!(applied_weight(&gateway, "shop").await, Some(5));
    // The first step at once: exactly 1 request in 20 (0 % before the route existed).
    assert_eq!(canary.hits(), 0);
    send_ok(&gateway, 100).await;
    assert_eq!(canary.hits(), 5);

    // Every step, while it is in force, takes exactly its share of each window of 20.
    let windows: Mutex<BTreeMap<u64, usize>> = Mutex::new(BTreeMap::new());
    let promoted = wait_until("the canary promoted", WAIT, || async {
        if let Some(weight) = exact_window(&gateway, route, "shop", || canary.hits(), 20).await {
            *windows.lock().unwrap().entry(weight).or_default() += 1;
        }
        let view = canary_view(&gateway, route).await;
        let applied = applied_weight(&gateway, "shop").await;
        if view["state"] == "promoted" && applied == Some(100) {
            Ok(view)
        } else {
            Err(format!("applied {applied:?}, {view}"))
        }
    })
    .await;
    let windows = windows.into_inner().unwrap();
    for weight in [5, 25, 50, 100] {
        assert!(
            windows.contains_key(&weight),
            "no clean window at {weight} %: {windows:?}"
        );
    }
    let before = canary.hits();
    send_ok(&gateway, 20).await;
    assert_eq!(canary.hits() - before, 20, "promoted: every request");

    // The history: started, then every step judged on the interval's counts (holds between
    // are allowed while the traffic is thin), then promoted.
    assert_eq!(promoted["weight"], 100);
    assert_eq!(promoted["step"], 3);
    let history = history(&promoted);
    assert_eq!(history[0]["state"], "progressing");
    assert_eq!(history[0]["weight"], 5);
    assert_eq!(
        history[0]["counts"],
        json!([]),
        "the start was judged on nothing"
    );
    let mut weights: Vec<u64> = history
        .iter()
        .map(|entry| entry["weight"].as_u64().unwrap())
        .collect();
    weights.dedup();
    assert_eq!(weights, vec![5, 25, 50, 100], "{promoted}");
    let last = history.last().unwrap();
    assert_eq!(last["state"], "promoted");
    assert!(
        last["reason"].as_str().unwrap().contains("promoted"),
        "{last}"
    );
    for (entry, earlier) in history[1..].iter().zip(&history) {
        assert_eq!(entry["round"], earlier["round"].as_i64().unwrap() + 1);
        let counts = &entry["counts"];
        assert_eq!(counts.as_array().map(Vec::len), Some(2), "{entry}");
        let (requests, errors) = counted(counts, 1);
        assert_eq!(errors, 0, "{entry}");
        if entry["weight"] != earlier["weight"] || entry["state"] == "promoted" {
            assert!(requests >= 5, "a step on at least min_requests: {entry}");
            assert!(counts[1]["p99_ms"].as_f64().is_some(), "{entry}");
        } else {
            assert!(requests < 5, "a hold on too few requests: {entry}");
        }
    }

    // One `canary` event per move, from the start to the promotion.
    let seen = events
        .canary_until(WAIT, |event| event["state"] == "promoted")
        .await;
    assert!(seen
        .iter()
        .all(|event| event["route_id"] == route && event["name"] == "shop"));
    assert_eq!(seen[0]["previous_weight"], Value::Null);
    assert_eq!(seen[0]["weight"], 5);
    let moves: Vec<(Value, Value)> = seen
        .iter()
        .filter(|event| event["weight"] != event["previous_weight"])
        .map(|event| (event["previous_weight"].clone(), event["weight"].clone()))
        .collect();
    assert_eq!(
        moves,
        vec![
            (Value::Null, json!(5)),
            (json!(5), json!(25)),
            (json!(25), json!(50)),
            (json!(50), json!(100)),
        ]
    );
    let rounds: Vec<i64> = seen
        .iter()
        .map(|event| event["round"].as_i64().unwrap())
        .collect();
    assert!(
        rounds.windows(2).all(|pair| pair[0] < pair[1]),
        "{rounds:?}"
    );
    assert_eq!(seen.last().unwrap()["round"], last["round"]);
}

/// An HTTP/1.1 upstream that answers 500 to every 10th request it receives, 200 to the others.
struct FlakyUpstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    _listening: Listening,
}

impl FlakyUpstream {
    async fn start() -> FlakyUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let listening = Listening::serve(listener, None, {
            let hits = hits.clone();
            move |_request| {
                let fail = hits.fetch_add(1, Ordering::SeqCst) % 10 == 9;
                async move {
                    let status = if fail { 500 } else { 200 };
                    let mut response = Response::new(Full::new(Bytes::from_static(b"flaky")));
                    *response.status_mut() = StatusCode::from_u16(status).unwrap();
                    Ok::<_, Infallible>(response)
                }
            }
        });
        FlakyUpstream {
            addr,
            hits,
            _listening: listening,
        }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canary_answering_ten_percent_500s_is_rolled_back_and_then_sent_nothing() {
    let gateway = TestGateway::start().await;
    let stable = Upstream::start("stable").await;
    let canary = FlakyUpstream::start().await;
    let services = two_services(&gateway, stable.addr, canary.addr).await;
    let route = canary_route(
        &gateway,
        "shop",
        services,
        json!({"backend": 1, "steps": [20, 50, 100], "step_interval_ms": 1000,
               "min_requests": 10}),
    )
    .await;
    // Every 10 canary requests hold a 500: no interval can pass.
    let first_error_round = wait_until("the first 500", WAIT, || async {
        let failed = send_any(&gateway, 10).await;
        if failed == 0 {
            return None;
        }
        Some(round_of(&canary_view(&gateway, route).await))
    })
    .await;
    let rolled_back = wait_until("the canary rolled back", WAIT, || async {
        send_any(&gateway, 10).await;
        let view = canary_view(&gateway, route).await;
        (view["state"] == "rolled_back").then_some(view)
    })
    .await;
    assert_eq!(rolled_back["weight"], 0);
    let history = history(&rolled_back);
    let decision = history.last().unwrap();
    assert_eq!(decision["state"], "rolled_back");
    // Within two intervals of the first bad answer: the interval it fell in, or the next one
    // when its count reached the store after that interval was judged.
    let rolled_back_round = decision["round"].as_i64().unwrap();
    assert!(
        rolled_back_round <= first_error_round + 2,
        "the first 500 in round {first_error_round}, rolled back in {rolled_back_round}"
    );
    let (requests, errors) = counted(&decision["counts"], 1);
    assert!(errors >= 1 && requests >= errors, "{decision}");
    assert!(
        decision["reason"].as_str().unwrap().contains("errors"),
        "{decision}"
    );
    assert!(
        history
            .iter()
            .all(|entry| entry["weight"].as_u64() <= Some(20)),
        "the canary never passed a step: {rolled_back}"
    );

    // Once this gateway applies it, the canary receives nothing, however long.
    wait_until("the rollback applied", WAIT, || async {
        applied_weight(&gateway, "shop").await == Some(0)
    })
    .await;
    let hits = canary.hits();
    holds_for(
        "the rolled-back canary receiving nothing",
        Duration::from_millis(2_500),
        || async {
            send_ok(&gateway, 20).await;
            let view = canary_view(&gateway, route).await;
            if canary.hits() != hits {
                return Err(format!("{} requests reached it", canary.hits() - hits));
            }
            if view["state"] != "rolled_back" || round_of(&view) != rolled_back_round {
                return Err(format!("it moved: {view}"));
            }
            Ok(())
        },
    )
    .await;
    assert!(stable.hits() > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_shows_the_canary_and_operators_move_it() {
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let config = test_config_with(dir.path(), &[("RAAHI_CLUSTER_INSTANCE_ID", "gw-solo")]);
    let gateway = TestGateway::start_with(dir, config).await;
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let (stable_id, canary_id) = two_services(&gateway, stable.addr, canary.addr).await;
    // A long interval: nothing moves but the operator.
    let route = canary_route(
        &gateway,
        "api",
        (stable_id, canary_id),
        json!({"backend": 1, "steps": [10, 50, 100], "step_interval_ms": 600000,
               "min_requests": 1, "max_p99_ms": 5000}),
    )
    .await;
    let path = |action: &str| format!("/api/v1/routes/{route}/canary{action}");

    let view = wait_until("the canary judged by this gateway", WAIT, || async {
        let view = canary_view(&gateway, route).await;
        (view["judged_by"] == "gw-solo").then_some(view)
    })
    .await;
    assert_eq!(view["route_id"], route);
    assert_eq!(view["route"], "api");
    assert_eq!(view["canary"]["steps"], json!([10, 50, 100]));
    assert_eq!(view["canary"]["max_error_percent"], 1.0, "the default");
    assert_eq!(view["canary"]["max_p99_ms"], 5000);
    assert_eq!(view["state"], "progressing");
    assert_eq!(view["step"], 0);
    assert_eq!(view["weight"], 10);
    assert_eq!(
        view["weights"],
        json!([
            {"backend": 0, "service_id": stable_id, "percent": 90.0, "canary": false},
            {"backend": 1, "service_id": canary_id, "percent": 10.0, "canary": true},
        ])
    );
    assert_eq!(view["reason"], "started at step 1 (10 %)");
    let interval = &view["interval"];
    assert_eq!(interval["round"], 1);
    let started = time_of(&interval["started_at"]);
    assert_eq!(
        time_of(&interval["ends_at"]) - started,
        chrono::Duration::milliseconds(600_000)
    );
    assert!(
        (Utc::now() - started).num_seconds().abs() < 60,
        "{interval}"
    );
    let mut entries = history(&view);
    assert_eq!(entries.len(), 1, "{view}");
    // The entry's time is read by its own statement, a moment after the interval's start.
    let at = time_of(&entries[0]["at"]);
    assert!((at - started).num_milliseconds().abs() < 1_000, "{view}");
    entries[0].as_object_mut().unwrap().remove("at");
    assert_eq!(
        entries[0],
        json!({"round": 1, "state": "progressing", "step": 0, "weight": 10,
               "reason": "started at step 1 (10 %)", "counts": []})
    );
    // The route shows where its canary stands, read-only.
    let (_, route_body) = gateway
        .api("GET", &format!("/api/v1/routes/{route}"), None)
        .await;
    assert_eq!(route_body["canary_status"]["weight"], 10, "{route_body}");

    // The interval's counts: what every gateway (here one) counted since it began.
    send_ok(&gateway, 40).await;
    let view = wait_until("the interval's counts", WAIT, || async {
        let view = canary_view(&gateway, route).await;
        let counts = &view["interval"]["counts"];
        if counted(counts, 0) == (36, 0) && counted(counts, 1) == (4, 0) {
            Ok(view)
        } else {
            Err(counts.to_string())
        }
    })
    .await;
    let counts = &view["interval"]["counts"];
    assert_eq!(counts[1]["error_percent"], 0.0);
    assert!(
        counts[1]["p99_ms"].as_f64().is_some_and(|p99| p99 > 0.0),
        "{counts}"
    );
    assert_eq!(applied_weight(&gateway, "api").await, Some(10));

    // A write that leaves the canary and backends alone keeps the canary where it is.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{route}"),
            Some(json!({"priority": 7})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(round_of(&canary_view(&gateway, route).await), 1);

    // Pause: held at its weight, not judged; pausing again moves nothing.
    let (status, paused) = act(&gateway, route, "pause").await;
    assert_eq!(status, StatusCode::OK, "{paused}");
    assert_eq!(
        (paused["state"].clone(), paused["weight"].clone()),
        (json!("paused"), json!(10))
    );
    assert_eq!(paused["interval"]["ends_at"], Value::Null);
    assert!(
        paused["reason"].as_str().unwrap().contains("paused"),
        "{paused}"
    );
    let (status, again) = act(&gateway, route, "pause").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(round_of(&again), round_of(&paused));
    // Resume: judged again from a new interval.
    let (status, resumed) = act(&gateway, route, "resume").await;
    assert_eq!(status, StatusCode::OK, "{resumed}");
    assert_eq!(resumed["state"], "progressing");
    assert_eq!(resumed["weight"], 10);
    assert_eq!(round_of(&resumed), round_of(&paused) + 1);
    assert_eq!(
        counted(&resumed["interval"]["counts"], 1),
        (0, 0),
        "a new interval"
    );

    // Promote: every request to the canary, at once on the data path.
    let (status, promoted) = act(&gateway, route, "promote").await;
    assert_eq!(status, StatusCode::OK, "{promoted}");
    assert_eq!(
        (
            promoted["state"].clone(),
            promoted["step"].clone(),
            promoted["weight"].clone()
        ),
        (json!("promoted"), json!(2), json!(100))
    );
    assert_eq!(applied_weight(&gateway, "api").await, Some(100));
    let before = canary.hits();
    send_ok(&gateway, 10).await;
    assert_eq!(canary.hits() - before, 10);
    for refused in ["pause", "resume"] {
        let answer = act(&gateway, route, refused).await;
        assert_error(
            &format!("{refused} a promoted canary"),
            &answer,
            409,
            "conflict",
            Some("state"),
        );
    }

    // Rollback: nothing to the canary.
    let (status, rolled_back) = act(&gateway, route, "rollback").await;
    assert_eq!(status, StatusCode::OK, "{rolled_back}");
    assert_eq!(
        (rolled_back["state"].clone(), rolled_back["weight"].clone()),
        (json!("rolled_back"), json!(0))
    );
    assert_eq!(rolled_back["reason"], "rolled back by an operator");
    assert_eq!(applied_weight(&gateway, "api").await, Some(0));
    let before = canary.hits();
    send_ok(&gateway, 10).await;
    assert_eq!(canary.hits(), before);
    let answer = act(&gateway, route, "pause").await;
    assert_error(
        "pause a rolled-back canary",
        &answer,
        409,
        "conflict",
        Some("state"),
    );
    // Resume after a rollback: the first step again.
    let (status, again) = act(&gateway, route, "resume").await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        (
            again["state"].clone(),
            again["step"].clone(),
            again["weight"].clone()
        ),
        (json!("progressing"), json!(0), json!(10))
    );
    assert!(
        again["reason"]
            .as_str()
            .unwrap()
            .contains("after a rollback"),
        "{again}"
    );
    let states: Vec<(Value, Value)> = history(&again)
        .iter()
        .map(|entry| (entry["state"].clone(), entry["weight"].clone()))
        .collect();
    assert_eq!(
        states,
        [
            ("progressing", 10),
            ("paused", 10),
            ("progressing", 10),
            ("promoted", 100),
            ("rolled_back", 0),
            ("progressing", 10),
        ]
        .map(|(state, weight)| (json!(state), json!(weight)))
    );
    assert!(history(&again)
        .windows(2)
        .all(|pair| pair[1]["round"] == pair[0]["round"].as_i64().unwrap() + 1));

    // Refusals: a route without a canary, a route that does not exist, an unknown action.
    let plain = gateway
        .create(
            "/api/v1/routes",
            json!({"name": "plain", "path_prefix": "/plain", "service_id": stable_id}),
        )
        .await;
    for (method, target) in [
        ("GET", format!("/api/v1/routes/{plain}/canary")),
        ("POST", format!("/api/v1/routes/{plain}/canary/pause")),
        ("GET", "/api/v1/routes/999999/canary".to_owned()),
        ("POST", "/api/v1/routes/999999/canary/promote".to_owned()),
    ] {
        let answer = gateway.api(method, &target, None).await;
        assert_error(
            &format!("{method} {target}"),
            &answer,
            404,
            "not_found",
            None,
        );
    }
    let (status, _) = gateway.api("POST", &path("/explode"), None).await;
    assert!(status.is_client_error(), "an unknown action: {status}");

    // What the API refuses, naming the field.
    let backends = json!([{"service_id": stable_id}, {"service_id": canary_id}]);
    for (canary, on_backends, field) in [
        (
            json!({"backend": 1, "steps": [5, 5, 100]}),
            backends.clone(),
            "canary.steps[1]",
        ),
        (
            json!({"backend": 1, "steps": [5, 50]}),
            backends.clone(),
            "canary.steps[1]",
        ),
        (json!({"backend": 2}), backends.clone(), "canary.backend"),
        (
            json!({"backend": 1, "step_interval_ms": 999}),
            backends.clone(),
            "canary.step_interval_ms",
        ),
        (
            json!({"backend": 1, "min_requests": 0}),
            backends.clone(),
            "canary.min_requests",
        ),
        (
            json!({"backend": 1, "max_error_percent": 150.0}),
            backends.clone(),
            "canary.max_error_percent",
        ),
        (
            json!({"backend": 0}),
            json!([{"service_id": stable_id}]),
            "canary",
        ),
    ] {
        let answer = gateway
            .api(
                "POST",
                "/api/v1/routes",
                Some(
                    json!({"name": "bad", "path_prefix": "/bad", "backends": on_backends,
                            "canary": canary}),
                ),
            )
            .await;
        assert_error(
            &format!("canary {canary}"),
            &answer,
            422,
            "validation_failed",
            Some(field),
        );
    }

    // Without its canary the route goes back to its configured weights (1:1).
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/routes/{route}"),
            Some(json!({"canary": null})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer = gateway.api("GET", &path(""), None).await;
    assert_error(
        "the view of a removed canary",
        &answer,
        404,
        "not_found",
        None,
    );
    assert_eq!(applied_weight(&gateway, "api").await, None);
    let before = canary.hits();
    send_ok(&gateway, 10).await;
    assert_eq!(canary.hits() - before, 5);
}

fn declared(stable: SocketAddr, canary: SocketAddr, steps: &str) -> String {
    format!(
        r#"
[[services]]
name = "stable"
  [[services.targets]]
  host = "127.0.0.1"
  port = {stable}

[[services]]
name = "canary"
  [[services.targets]]
  host = "127.0.0.1"
  port = {canary}

[[routes]]
name = "shop"
backends = [{{ service = "stable" }}, {{ service = "canary" }}]
canary = {{ backend = 1, steps = {steps}, step_interval_ms = 600000, min_requests = 1 }}
"#,
        stable = stable.port(),
        canary = canary.port()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resources_file_declares_a_canary_and_reapplying_it_keeps_its_progress() {
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let dir = Arc::new(tempfile::tempdir().unwrap());
    let file = dir.path().join("resources.toml");
    std::fs::write(&file, declared(stable.addr, canary.addr, "[10, 100]")).unwrap();
    let mut config = test_config(dir.path());
    config.resources.file = Some(file.clone());
    let gateway = TestGateway::start_with(dir, config).await;
    let reload = || async {
        gateway
            .gateway
            .as_ref()
            .unwrap()
            .reload_resources()
            .await
            .expect("a resources file is configured")
    };
    let (_, routes) = gateway.api("GET", "/api/v1/routes", None).await;
    let route = routes["items"][0]["id"]
        .as_i64()
        .expect("the declared route");
    assert_eq!(routes["items"][0]["managed_by"], "resources-file");
    let started = canary_view(&gateway, route).await;
    assert_eq!(started["canary"]["steps"], json!([10, 100]));
    assert_eq!(started["weight"], 10);
    send_ok(&gateway, 50).await;
    assert_eq!(canary.hits(), 5);

    // The operator pauses it; applying the same file again leaves it paused, in its round.
    let (status, paused) = act(&gateway, route, "pause").await;
    assert_eq!(status, StatusCode::OK, "{paused}");
    let report = reload().await.expect("the file applies");
    assert!(report.changed.is_empty(), "{report:?}");
    let kept = canary_view(&gateway, route).await;
    assert_eq!(kept["state"], "paused");
    assert_eq!(round_of(&kept), round_of(&paused));

    // A changed canary in the file starts it again at its first step.
    std::fs::write(&file, declared(stable.addr, canary.addr, "[20, 100]")).unwrap();
    let report = reload().await.expect("the file applies");
    assert_eq!(report.changed, vec!["route shop".to_owned()], "{report:?}");
    let restarted = canary_view(&gateway, route).await;
    assert_eq!(
        (
            restarted["state"].clone(),
            restarted["step"].clone(),
            restarted["weight"].clone()
        ),
        (json!("progressing"), json!(0), json!(20))
    );
    assert_eq!(round_of(&restarted), round_of(&paused) + 1);
    let before = canary.hits();
    send_ok(&gateway, 50).await;
    assert_eq!(canary.hits() - before, 10);

    // A bad canary names its place in the file.
    std::fs::write(&file, declared(stable.addr, canary.addr, "[50, 20, 100]")).unwrap();
    let error = reload().await.unwrap_err().to_string();
    assert!(error.contains("routes[0].canary.steps[1]"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_mid_step_resumes_the_canary_where_it_was() {
    const INTERVAL_MS: i64 = 4_000;
    let mut gateway = TestGateway::start().await;
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let services = two_services(&gateway, stable.addr, canary.addr).await;
    let route = canary_route(
        &gateway,
        "shop",
        services,
        json!({"backend": 1, "steps": [10, 50, 100], "step_interval_ms": INTERVAL_MS,
               "min_requests": 3}),
    )
    .await;
    // A few rounds in: paused and resumed, so the interval in force began with round 3.
    act(&gateway, route, "pause").await;
    let (_, resumed) = act(&gateway, route, "resume").await;
    assert_eq!(round_of(&resumed), 3);
    let began = time_of(&resumed["interval"]["started_at"]);
    // Restarted well into the interval: a fresh one would be judged 8 s after `began`, at
    // least (its end, then the grace).
    wait_until("3 s into the interval", WAIT, || async {
        send_ok(&gateway, 10).await;
        Utc::now() - began >= chrono::Duration::milliseconds(3_000)
    })
    .await;
    let before = canary_view(&gateway, route).await;
    gateway = gateway.restart().await;
    let after = canary_view(&gateway, route).await;
    for field in ["state", "step", "weight", "reason", "history"] {
        assert_eq!(after[field], before[field], "{field}");
    }
    assert_eq!(after["interval"]["round"], before["interval"]["round"]);
    assert_eq!(
        after["interval"]["started_at"],
        before["interval"]["started_at"]
    );
    assert_eq!(applied_weight(&gateway, "shop").await, Some(10));

    // Judged at the end of the interval it was in, on the new process's traffic.
    let moved = wait_until("the next step", WAIT, || async {
        send_ok(&gateway, 10).await;
        let view = canary_view(&gateway, route).await;
        (round_of(&view) > 3).then_some(view)
    })
    .await;
    assert_eq!(round_of(&moved), 4);
    assert_eq!(
        (moved["step"].clone(), moved["weight"].clone()),
        (json!(1), json!(50))
    );
    let decided = time_of(&history(&moved).last().unwrap()["at"]);
    let after_begin = (decided - began).num_milliseconds();
    assert!(
        // The interval, then the grace for the last flushes (a quarter of 4 s), then the next
        // turn.
        (INTERVAL_MS + 1_000..INTERVAL_MS + 1_000 + 2_200).contains(&after_begin),
        "judged {after_begin} ms after its interval began"
    );
    wait_until("the step applied", WAIT, || async {
        applied_weight(&gateway, "shop").await == Some(50)
    })
    .await;

    // Paused, it stays paused across a restart, and is not judged.
    let (_, paused) = act(&gateway, route, "pause").await;
    gateway = gateway.restart().await;
    let after = canary_view(&gateway, route).await;
    assert_eq!(after["state"], "paused");
    assert_eq!(round_of(&after), round_of(&paused));
    assert_eq!(applied_weight(&gateway, "shop").await, Some(50));
    let hits = canary.hits();
    send_ok(&gateway, 20).await;
    assert_eq!(canary.hits() - hits, 10);
    holds_for(
        "a paused canary left alone",
        Duration::from_millis(1_500),
        || async {
            send_ok(&gateway, 5).await;
            round_of(&canary_view(&gateway, route).await) == round_of(&paused)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_canary_failing_in_its_trailers_is_rolled_back() {
    let gateway = TestGateway::start().await;
    let stable = GrpcOrigin::start("stable").await;
    let canary = GrpcOrigin::start("canary").await;
    let mut ids = Vec::new();
    for origin in [&stable, &canary] {
        let service = gateway
            .create(
                "/api/v1/services",
                json!({"name": origin.name, "protocol": "h2c"}),
            )
            .await;
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                json!({"host": "127.0.0.1", "port": origin.addr.port()}),
            )
            .await;
        ids.push(service);
    }
    let route = canary_route(
        &gateway,
        "grpc",
        (ids[0], ids[1]),
        json!({"backend": 1, "steps": [20, 50, 100], "step_interval_ms": 1000,
               "min_requests": 5}),
    )
    .await;
    let client = grpc_client(gateway.proxy).await;
    let gateway = &gateway;
    // NOT_FOUND is the caller's problem, not the canary's: it steps up.
    let stepped = wait_until("the canary stepped up", WAIT, || {
        let mut client = client.clone();
        async move {
            for _ in 0..20 {
                let status = client
                    .unary(EchoRequest {
                        status: Code::NotFound as u32,
                        ..EchoRequest::default()
                    })
                    .await
                    .expect_err("NOT_FOUND");
                assert_eq!(status.code(), Code::NotFound);
            }
            let view = canary_view(gateway, route).await;
            (view["weight"] == 50).then_some(view)
        }
    })
    .await;
    let calls = canary.calls();
    // UNAVAILABLE after a reply, in the trailers: the canary's errors.
    let rolled_back = wait_until("the canary rolled back", WAIT, || {
        let mut client = client.clone();
        async move {
            for _ in 0..20 {
                let mut replies = client
                    .server_stream(EchoRequest {
                        count: 1,
                        status: Code::Unavailable as u32,
                        ..EchoRequest::default()
                    })
                    .await
                    .expect("the stream starts")
                    .into_inner();
                let first = replies.message().await.expect("one reply");
                assert!(first.is_some());
                let end = replies.message().await.expect_err("UNAVAILABLE at the end");
                assert_eq!(end.code(), Code::Unavailable);
            }
            let view = canary_view(gateway, route).await;
            (view["state"] == "rolled_back").then_some(view)
        }
    })
    .await;
    assert!(canary.calls() > calls);
    let decision = history(&rolled_back).last().unwrap().clone();
    assert_eq!(decision["round"], round_of(&stepped) + 1, "{rolled_back}");
    // Its interval may begin with a few NOT_FOUND calls, which are no errors.
    let (requests, errors) = counted(&decision["counts"], 1);
    assert!(errors >= 1 && requests - errors <= 20, "{decision}");
    wait_until("the rollback applied", WAIT, || async {
        applied_weight(gateway, "grpc").await == Some(0)
    })
    .await;
    let calls = canary.calls();
    let mut client = client;
    for _ in 0..10 {
        let reply = client
            .unary(EchoRequest::default())
            .await
            .unwrap()
            .into_inner();
        assert_eq!(reply.origin, "stable");
    }
    assert_eq!(canary.calls(), calls);
}

/// Gateways `gw-a` and `gw-b` on one PostgreSQL database, with leases of `LEASE_MS`.
async fn two_gateways(database: &str) -> (TestGateway, TestGateway) {
    let mut gateways = Vec::new();
    for id in ["gw-a", "gw-b"] {
        let dir = Arc::new(tempfile::tempdir().unwrap());
        gateways.push(TestGateway::start_with(dir, cluster_config(database, id, LEASE_MS)).await);
    }
    let b = gateways.pop().unwrap();
    (gateways.pop().unwrap(), b)
}

const LEASE_MS: u64 = 3_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_on_postgres_share_one_canary() {
    const INTERVAL_MS: u64 = 3_000;
    let database = postgres::fresh_database().await;
    let (a, b) = two_gateways(&database).await;
    let stable = Upstream::start("stable").await;
    // The canary's share is the route's, whatever the number of its instances.
    let instances = [
        Upstream::start("canary-1").await,
        Upstream::start("canary-2").await,
        Upstream::start("canary-3").await,
    ];
    let canary = Hits(&instances);
    let stable_id = a
        .service_with_targets("stable", &[target(&stable, 100, 0)])
        .await;
    let targets: Vec<Value> = instances
        .iter()
        .map(|instance| target(instance, 100, 0))
        .collect();
    let canary_id = a.service_with_targets("canary", &targets).await;
    let route = canary_route(
        &a,
        "shop",
        (stable_id, canary_id),
        json!({"backend": 1, "steps": [5, 50, 100], "step_interval_ms": INTERVAL_MS,
               "min_requests": 5}),
    )
    .await;
    for gateway in [&a, &b] {
        wait_until("every gateway applies the first step", WAIT, || async {
            applied_weight(gateway, "shop").await == Some(5)
        })
        .await;
    }
    // Each gateway's own schedule gives exactly 5 % of its requests: 2 of 40 through one,
    // 3 of 60 through the other.
    for (gateway, count) in [(&a, 40), (&b, 60)] {
        let hits = canary.hits();
        send_ok(gateway, count).await;
        assert_eq!(canary.hits() - hits, count / 20);
    }
    // Both views tell the same: one judge, and every gateway's counts summed.
    let judge = wait_until("one gateway judges, seen alike from both", WAIT, || async {
        let (one, other) = (canary_view(&a, route).await, canary_view(&b, route).await);
        let summed = |view: &Value| {
            let counts = &view["interval"]["counts"];
            (counted(counts, 0), counted(counts, 1))
        };
        match one["judged_by"].as_str() {
            Some(judge)
                if one["judged_by"] == other["judged_by"]
                    && summed(&one) == ((95, 0), (5, 0))
                    && summed(&other) == summed(&one) =>
            {
                Ok(judge.to_owned())
            }
            _ => Err(format!("{one}\n{other}")),
        }
    })
    .await;
    assert!(judge == "gw-a" || judge == "gw-b", "{judge}");
    // The judge steps up on the sum: 5 canary requests, neither gateway's alone.
    let moved = wait_until("the next step", WAIT, || async {
        let view = canary_view(&a, route).await;
        (view["weight"] == 50).then_some(view)
    })
    .await;
    let seen = Instant::now();
    let decision = history(&moved).last().unwrap().clone();
    assert_eq!(decision["round"], 2);
    assert_eq!(counted(&decision["counts"], 0), (95, 0));
    assert_eq!(counted(&decision["counts"], 1), (5, 0));
    // Every gateway applies it within a second.
    for gateway in [&a, &b] {
        wait_until(
            "every gateway applies the step",
            Duration::from_secs(1).saturating_sub(seen.elapsed()),
            || async { applied_weight(gateway, "shop").await == Some(50) },
        )
        .await;
    }
    for gateway in [&a, &b] {
        let hits = canary.hits();
        send_ok(gateway, 20).await;
        assert_eq!(canary.hits() - hits, 10);
    }

    // The judge dies without a word; the other takes the lease over and the canary goes on.
    let (mut dead, survivor, survivor_id) = if judge == "gw-a" {
        (a, b, "gw-b")
    } else {
        (b, a, "gw-a")
    };
    dead.gateway.take().expect("running").abort();
    let survivor_judged = AtomicBool::new(false);
    let promoted = wait_until("the survivor promotes the canary", WAIT, || async {
        send_ok(&survivor, 20).await;
        let view = canary_view(&survivor, route).await;
        if view["judged_by"] == survivor_id {
            survivor_judged.store(true, Ordering::SeqCst);
        }
        if view["state"] == "promoted" {
            Ok(view)
        } else {
            Err(view.to_string())
        }
    })
    .await;
    assert!(
        survivor_judged.load(Ordering::SeqCst),
        "the survivor took the lease over"
    );
    assert_eq!(promoted["weight"], 100);
    let mut weights: Vec<Value> = history(&promoted)
        .iter()
        .map(|entry| entry["weight"].clone())
        .collect();
    weights.dedup();
    assert_eq!(weights, vec![json!(5), json!(50), json!(100)]);
    wait_until("the survivor applies the promotion", WAIT, || async {
        applied_weight(&survivor, "shop").await == Some(100)
    })
    .await;
    let hits = canary.hits();
    send_ok(&survivor, 20).await;
    assert_eq!(canary.hits() - hits, 20);
}

/// Requests received by a set of upstreams, together.
struct Hits<'a>(&'a [Upstream]);

impl Hits<'_> {
    fn hits(&self) -> usize {
        self.0.iter().map(Upstream::hits).sum()
    }
}

/// What a route write does to its canary: new bounds keep its progress (a promoted canary stays
/// promoted), new steps start it again, and a canary removed and added again goes on from the
/// route's last round, its history in order.
#[tokio::test]
async fn route_writes_restart_a_canary_only_when_its_progress_would_mean_something_else() {
    let gateway = TestGateway::start().await;
    let stable = Upstream::start("stable").await;
    let canary = Upstream::start("canary").await;
    let services = two_services(&gateway, stable.addr, canary.addr).await;
    let spec = json!({"backend": 1, "steps": [10, 100], "step_interval_ms": 600_000});
    let route = canary_route(&gateway, "rewritten", services, spec).await;
    let patch = |body: Value| {
        let gateway = &gateway;
        async move {
            let (status, answer) = gateway
                .api("PATCH", &format!("/api/v1/routes/{route}"), Some(body))
                .await;
            assert_eq!(status, StatusCode::OK, "{answer}");
        }
    };
    let (status, promoted) = act(&gateway, route, "promote").await;
    assert_eq!(status, StatusCode::OK, "{promoted}");
    assert_eq!(round_of(&promoted), 2);

    patch(json!({"canary": {"max_error_percent": 5.0, "max_p99_ms": 800}})).await;
    let view = canary_view(&gateway, route).await;
    assert_eq!(
        (view["state"].clone(), round_of(&view)),
        (json!("promoted"), 2)
    );
    assert_eq!(view["canary"]["max_p99_ms"], 800);
    assert_eq!(applied_weight(&gateway, "rewritten").await, Some(100));

    patch(json!({"canary": {"steps": [20, 100]}})).await;
    let view = canary_view(&gateway, route).await;
    assert_eq!(
        (
            view["state"].clone(),
            view["weight"].clone(),
            round_of(&view)
        ),
        (json!("progressing"), json!(20), 3)
    );

    patch(json!({"canary": null})).await;
    let (status, _) = gateway
        .api("GET", &format!("/api/v1/routes/{route}/canary"), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    patch(json!({"canary": {"backend": 1, "steps": [30, 100], "step_interval_ms": 600_000}})).await;
    let view = canary_view(&gateway, route).await;
    assert_eq!((view["weight"].clone(), round_of(&view)), (json!(30), 4));
    let rounds: Vec<i64> = history(&view)
        .iter()
        .map(|entry| entry["round"].as_i64().unwrap())
        .collect();
    assert_eq!(rounds, vec![1, 2, 3, 4], "{view}");
    assert!(
        history(&view)[3]["reason"]
            .as_str()
            .unwrap()
            .starts_with("started at step 1 (30 %)"),
        "{view}"
    );
}
