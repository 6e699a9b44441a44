//! Discovery safety through real sockets.
//! - The removal guard (DESIGN §4): a real Knot DNS zone emptied to NXDOMAIN or losing most of
//!   its SRV records at once, a real HTTP registry answering `[]` after a good list, a Consul
//!   catalog marking entries critical (explicit departures), health checks taking a held target
//!   out, an admin accepting held removals, and the guard's settings in the API.
//! - Honest 503s (DESIGN §5): a service whose only sources are pending, failing or stale answers
//!   `discovery_unavailable`, distinct from `no_available_target`.

use crate::common;
use common::consul::{ConsulFake, Instance};
use common::knot::{Knot, ZoneOp};
use common::registry::Registry;
use common::*;

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{json, Value};

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(15);
/// Confirmation time of the guards under test: long enough to watch a hold on a loaded machine,
/// short enough for CI.
const CONFIRM_MS: i64 = 4_000;
/// The sources' removal grace: a drained target's `remove_at` minus this is when it drained.
const GRACE_MS: i64 = 60_000;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn guard(confirm_ms: i64) -> Value {
    json!({"max_percent": 50, "min_endpoints": 1, "confirm_ms": confirm_ms})
}

/// A service with a catch-all route.
async fn service(gateway: &TestGateway, name: &str) -> i64 {
    let service = gateway
        .create("/api/v1/services", json!({ "name": name }))
        .await;
    gateway.route_all_to(service).await;
    service
}

async fn add_source(gateway: &TestGateway, service: i64, body: Value) -> i64 {
    gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            body,
        )
        .await
}

/// A source body with fast timers and `guard` as its removal guard.
fn source(name: &str, provider: &str, config: Value, guard: Value) -> Value {
    json!({
        "name": name,
        "provider": provider,
        "config": config,
        "stale_after_ms": 600_000,
        "removal_grace_ms": GRACE_MS,
        "removal_guard": guard,
    })
}

fn http_source(registry: &Registry, guard: Value) -> Value {
    source(
        "registry",
        "http",
        json!({"url": registry.url("/v1/endpoints"), "interval_ms": 200, "timeout_ms": 500}),
        guard,
    )
}

/// Active and draining targets.
fn counts(status: &SourceStatus) -> (u64, u64) {
    (status.endpoints.active, status.endpoints.draining)
}

/// How many targets the removal guard holds; `None` while it holds nothing.
fn holding(status: &SourceStatus) -> Option<u64> {
    status.guard.as_ref().map(|guard| guard.holding)
}

fn time(value: &Value) -> DateTime<Utc> {
    value
        .as_str()
        .and_then(|text| text.parse().ok())
        .unwrap_or_else(|| panic!("a timestamp: {value}"))
}

/// The upstream names that answer `requests` requests through the proxy (each must succeed).
async fn serving(gateway: &TestGateway, requests: usize) -> BTreeSet<String> {
    let client = reqwest::Client::new();
    let mut names = BTreeSet::new();
    for _ in 0..requests {
        let response = client
            .get(gateway.proxy_url("/"))
            .send()
            .await
            .expect("proxy answers");
        assert_eq!(response.status(), 200, "a request through the proxy");
        names.insert(response.text().await.unwrap_or_default());
    }
    names
}

async fn proxy_status(gateway: &TestGateway) -> u16 {
    reqwest::get(gateway.proxy_url("/"))
        .await
        .expect("proxy answers")
        .status()
        .as_u16()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|name| (*name).to_owned()).collect()
}

/// Upstreams named `names` on 127.0.0.2, 127.0.0.3, ... sharing one port (for A records).
async fn upstreams_on_one_port(names: &[&str]) -> (Vec<Upstream>, u16) {
    let first = Upstream::start_on(names[0], "127.0.0.2:0".parse().unwrap()).await;
    let port = first.addr.port();
    let mut upstreams = vec![first];
    for (index, name) in names.iter().enumerate().skip(1) {
        let addr = format!("127.0.0.{}:{port}", index + 2).parse().unwrap();
        upstreams.push(Upstream::start_on(name, addr).await);
    }
    (upstreams, port)
}

fn registry_endpoint(key: &str, upstream: &Upstream) -> Value {
    json!({"key": key, "host": "127.0.0.1", "port": upstream.addr.port()})
}

async fn accept(gateway: &TestGateway, source: i64) -> (u16, Value) {
    let (status, body) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/accept-removals"),
            None,
        )
        .await;
    (status.as_u16(), body)
}

// ---------------------------------------------------------------------------------------------
// Knot DNS
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zone_emptied_to_nxdomain_keeps_serving_until_confirmed() {
    let (upstreams, port) = upstreams_on_one_port(&["a", "b", "c"]).await;
    let knot = Knot::start("api A 127.0.0.2\napi A 127.0.0.3\napi A 127.0.0.4");
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "api").await;
    let source = add_source(
        &gateway,
        service,
        source(
            "api-dns",
            "dns",
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"],
                   "resolver": knot.resolver(), "interval_ms": 250, "timeout_ms": 500}),
            guard(CONFIRM_MS),
        ),
    )
    .await;
    wait_status(&gateway, source, "3 active", |s| counts(s) == (3, 0)).await;

    // The zone loses the name at once: NXDOMAIN, a successful but empty answer.
    knot.transaction(&[
        ZoneOp::unset("api", "A", "127.0.0.2"),
        ZoneOp::unset("api", "A", "127.0.0.3"),
        ZoneOp::unset("api", "A", "127.0.0.4"),
    ]);
    assert!(knot.query("api", "A").is_empty(), "the name is gone");
    let held = wait_status(&gateway, source, "the guard holding 3", |s| {
        holding(s) == Some(3)
    })
    .await;
    assert_eq!(
        held.state, "healthy",
        "NXDOMAIN is a successful refresh: {held}"
    );
    assert_eq!(counts(&held), (3, 0), "nothing drains while held: {held}");
    let guard = held.guard();
    assert_eq!(guard.held.len(), 3, "{held}");
    assert!(guard.reason.contains("remove 3 of 3"), "{held}");
    let since = guard.since;

    // Held targets keep serving; operators see the hold.
    assert_eq!(serving(&gateway, 12).await, names(&["a", "b", "c"]));
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.lines().any(
            |line| line.starts_with("raahi_discovery_guard_held_targets{")
                && line.contains("source=\"api-dns\"")
                && line.ends_with(" 3")
        ),
        "{metrics}"
    );
    let (_, readiness) = gateway.readyz().await;
    assert!(readiness.degraded, "{readiness}");
    assert!(
        readiness
            .degraded_because
            .iter()
            .any(|because| because.contains("removal guard")),
        "{readiness}"
    );

    // The same empty answer, seen for confirm_ms across 3 refreshes: the removals apply.
    wait_status(&gateway, source, "the hold confirmed", |s| {
        s.guard.is_none() && counts(s) == (0, 3)
    })
    .await;
    let drained = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await
        .1;
    for target in drained["items"].as_array().expect("targets") {
        let drained_at = time(&target["remove_at"]) - chrono::Duration::milliseconds(GRACE_MS);
        assert!(
            drained_at - since >= chrono::Duration::milliseconds(CONFIRM_MS),
            "drained {} ms after the hold began, before confirm_ms {CONFIRM_MS}: {target}",
            (drained_at - since).num_milliseconds()
        );
    }
    assert_eq!(proxy_status(&gateway).await, 503, "every target drains");
    drop(upstreams);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn most_srv_records_removed_at_once_are_held_until_an_admin_accepts() {
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["s1", "s2", "s3", "s4", "s5"].map(Upstream::start)).await;
    let record = |upstream: &Upstream| format!("10 10 {} h.svc.test.", upstream.addr.port());
    let mut zone = String::from("h A 127.0.0.1\n");
    for upstream in &upstreams {
        zone.push_str(&format!("_http._tcp.api SRV {}\n", record(upstream)));
    }
    let knot = Knot::start(&zone);
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "api").await;
    let source = add_source(
        &gateway,
        service,
        source(
            "api-srv",
            "dns-srv",
            json!({"service_name": "_http._tcp.api.svc.test", "resolver": knot.resolver(),
                   "interval_ms": 250, "timeout_ms": 500}),
            // Long enough that only the admin ends this hold.
            guard(600_000),
        ),
    )
    .await;
    wait_status(&gateway, source, "5 active", |s| counts(s) == (5, 0)).await;

    // Three of five SRV records go at once: more than half.
    knot.transaction(
        &upstreams[2..]
            .iter()
            .map(|upstream| ZoneOp::unset("_http._tcp.api", "SRV", &record(upstream)))
            .collect::<Vec<_>>(),
    );
    let held = wait_status(&gateway, source, "the guard holding 3", |s| {
        holding(s) == Some(3)
    })
    .await;
    assert_eq!(counts(&held), (5, 0), "{held}");
    // Refreshes go on and count confirmations of the same smaller set.
    wait_status(&gateway, source, "a second confirmation", |s| {
        s.guard
            .as_ref()
            .is_some_and(|guard| guard.confirmations >= 2)
    })
    .await;
    assert_eq!(
        serving(&gateway, 20).await,
        names(&["s1", "s2", "s3", "s4", "s5"]),
        "held targets keep serving"
    );

    let (code, accepted) = accept(&gateway, source).await;
    assert_eq!(code, 200, "{accepted}");
    assert_eq!(accepted["released"], 3, "{accepted}");
    assert!(accepted["status"]["guard"].is_null(), "{accepted}");
    let status = SourceStatus::read(accepted["status"].clone());
    assert_eq!(counts(&status), (2, 3), "{accepted}");
    // The answer says when the hold ended, and the status keeps it.
    let recorded = &accepted["status"]["removal_acceptance"];
    assert!(accepted["released_at"].is_string(), "{accepted}");
    assert_eq!(
        recorded["released_at"], accepted["released_at"],
        "{accepted}"
    );
    assert_eq!(recorded["released"], 3, "{accepted}");
    let later = gateway.source_status(source).await;
    assert_eq!(&later.json["removal_acceptance"], recorded, "{later}");
    assert_eq!(serving(&gateway, 10).await, names(&["s1", "s2"]));

    // Nothing is held any more: accepting again releases nothing.
    let (code, again) = accept(&gateway, source).await;
    assert_eq!((code, &again["released"]), (200, &json!(0)), "{again}");
    assert_eq!(
        again["status"]["removal_acceptance"]["released"], 0,
        "{again}"
    );
}

// ---------------------------------------------------------------------------------------------
// HTTP registry
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_list_after_a_good_one_is_held_and_the_recovered_list_ends_the_hold() {
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["r1", "r2", "r3"].map(Upstream::start)).await;
    let full = json!([
        registry_endpoint("r1", &upstreams[0]),
        registry_endpoint("r2", &upstreams[1]),
        registry_endpoint("r3", &upstreams[2]),
    ]);
    let registry = Registry::start().await;
    registry.set_json(full.clone());
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "web").await;
    let source = add_source(&gateway, service, http_source(&registry, guard(600_000))).await;
    let before = wait_status(&gateway, source, "3 active", |s| counts(s) == (3, 0)).await;
    let targets_before = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await
        .1;

    registry.set_json(json!([]));
    let held = wait_status(&gateway, source, "the guard holding 3", |s| {
        holding(s) == Some(3)
    })
    .await;
    assert_ne!(
        held.revision, before.revision,
        "the empty list was applied: {held}"
    );
    assert_eq!(serving(&gateway, 9).await, names(&["r1", "r2", "r3"]));

    // The registry recovers: the hold ends without anything having drained.
    registry.set_json(full);
    let recovered = wait_status(&gateway, source, "the hold ended", |s| {
        s.guard.is_none() && s.revision == before.revision
    })
    .await;
    assert_eq!(counts(&recovered), (3, 0), "{recovered}");
    let targets_after = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await
        .1;
    let ids = |list: &Value| -> Vec<i64> {
        list["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["id"].as_i64().unwrap())
            .collect()
    };
    assert_eq!(
        ids(&targets_before),
        ids(&targets_after),
        "the same targets throughout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gradual_scale_down_one_endpoint_at_a_time_passes_unheld() {
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["g1", "g2", "g3", "g4"].map(Upstream::start)).await;
    let keys = ["g1", "g2", "g3", "g4"];
    let list = |count: usize| {
        Value::Array(
            keys.iter()
                .zip(&upstreams)
                .take(count)
                .map(|(key, upstream)| registry_endpoint(key, upstream))
                .collect(),
        )
    };
    let registry = Registry::start().await;
    registry.set_json(list(4));
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "web").await;
    let source = add_source(&gateway, service, http_source(&registry, guard(600_000))).await;
    wait_status(&gateway, source, "4 active", |s| counts(s) == (4, 0)).await;
    for remaining in (0..4usize).rev() {
        registry.set_json(list(remaining));
        let status = wait_status(
            &gateway,
            source,
            &format!("{remaining} active, the rest draining"),
            |s| counts(s) == (remaining as u64, 4 - remaining as u64),
        )
        .await;
        assert!(
            status.guard.is_none(),
            "one at a time is never held: {status}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_target_that_fails_its_health_checks_is_released_alone() {
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["h1", "h2", "h3"].map(Upstream::start)).await;
    let registry = Registry::start().await;
    registry.set_json(json!([
        registry_endpoint("h1", &upstreams[0]),
        registry_endpoint("h2", &upstreams[1]),
        registry_endpoint("h3", &upstreams[2]),
    ]));
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "web", "health_check": {"type": "tcp", "interval_ms": 200,
                   "timeout_ms": 200, "unhealthy_threshold": 1, "healthy_threshold": 1}}),
        )
        .await;
    gateway.route_all_to(service).await;
    let source = add_source(&gateway, service, http_source(&registry, guard(600_000))).await;
    wait_status(&gateway, source, "3 active", |s| counts(s) == (3, 0)).await;
    registry.set_json(json!([]));
    wait_status(&gateway, source, "the guard holding 3", |s| {
        holding(s) == Some(3)
    })
    .await;

    // One held target goes down: its health checks take it out, and the guard lets it go.
    upstreams[2].stop();
    let released = wait_status(&gateway, source, "the guard holding 2", |s| {
        holding(s) == Some(2)
    })
    .await;
    assert_eq!(counts(&released), (2, 1), "the dead one drains: {released}");
    let held: BTreeSet<String> = released.guard().held.iter().cloned().collect();
    assert_eq!(held, names(&["h1", "h2"]));
    assert_eq!(serving(&gateway, 8).await, names(&["h1", "h2"]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_guard_an_empty_answer_drains_at_once() {
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["n1", "n2", "n3"].map(Upstream::start)).await;
    let registry = Registry::start().await;
    registry.set_json(Value::Array(
        ["n1", "n2", "n3"]
            .iter()
            .zip(&upstreams)
            .map(|(key, upstream)| registry_endpoint(key, upstream))
            .collect(),
    ));
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "web").await;
    let source = add_source(&gateway, service, http_source(&registry, Value::Null)).await;
    let created = gateway
        .api("GET", &format!("/api/v1/discovery-sources/{source}"), None)
        .await
        .1;
    assert!(created["removal_guard"].is_null(), "{created}");
    wait_status(&gateway, source, "3 active", |s| counts(s) == (3, 0)).await;
    registry.set_json(json!([]));
    let drained = wait_status(&gateway, source, "all draining", |s| counts(s) == (0, 3)).await;
    assert!(drained.guard.is_none(), "{drained}");
}

// ---------------------------------------------------------------------------------------------
// Explicit departures (Consul)
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_the_registry_marks_critical_are_never_held() {
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["c1", "c2", "c3"].map(Upstream::start)).await;
    let fake = ConsulFake::start().await;
    for upstream in &upstreams {
        fake.register(Instance::new("web", upstream.addr.port()));
    }
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "web").await;
    let source = add_source(
        &gateway,
        service,
        source(
            "consul",
            "consul",
            json!({"address": fake.url(), "service": "web", "wait_ms": 10_000, "timeout_ms": 500}),
            guard(CONFIRM_MS),
        ),
    )
    .await;
    wait_status(&gateway, source, "3 active", |s| counts(s) == (3, 0)).await;

    // Two of three turn critical: Consul still lists them and says they are down.
    for upstream in &upstreams[1..] {
        let port = upstream.addr.port();
        fake.set_check(&format!("node-{port}"), &format!("web-{port}"), "critical");
    }
    let status = wait_status(&gateway, source, "two draining", |s| counts(s) == (1, 2)).await;
    assert!(
        status.guard.is_none(),
        "explicit departures are not held: {status}"
    );

    // The same two vanishing from the catalog without a word would have been held.
    for upstream in &upstreams[1..] {
        let port = upstream.addr.port();
        fake.set_check(&format!("node-{port}"), &format!("web-{port}"), "passing");
    }
    wait_status(&gateway, source, "3 active again", |s| counts(s) == (3, 0)).await;
    for upstream in &upstreams[1..] {
        let port = upstream.addr.port();
        fake.deregister(&format!("node-{port}"), &format!("web-{port}"));
    }
    let held = wait_status(&gateway, source, "the guard holding 2", |s| {
        holding(s) == Some(2)
    })
    .await;
    assert_eq!(counts(&held), (3, 0), "{held}");
    // The catalog stays as it is, so the watch itself answers nothing new: the guard's own
    // re-reads (every confirm_ms / 2) confirm the removals.
    let reads_before = fake.requests();
    let confirmed = wait_status(&gateway, source, "the removals confirmed", |s| {
        s.guard.is_none() && counts(s) == (1, 2)
    })
    .await;
    assert!(confirmed.guard.is_none(), "{confirmed}");
    assert!(
        fake.requests() >= reads_before + 2,
        "the guard re-read the catalog: {} requests",
        fake.requests() - reads_before
    );
}

// ---------------------------------------------------------------------------------------------
// The admin API
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_guard_settings_default_validate_and_turn_off() {
    let registry = Registry::start().await;
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "web").await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    let body = json!({"name": "reg", "provider": "http",
                      "config": {"url": registry.url("/v1/endpoints")}});
    let (code, created) = gateway.api("POST", &path, Some(body)).await;
    assert_eq!(code, 201, "{created}");
    assert_eq!(
        created["removal_guard"],
        json!({"max_percent": 50, "min_endpoints": 1, "confirm_ms": 60_000}),
        "the default guard"
    );
    let source = created["id"].as_i64().unwrap();
    let source_path = format!("/api/v1/discovery-sources/{source}");

    // A partial patch merges into the current settings.
    let (code, patched) = gateway
        .api(
            "PATCH",
            &source_path,
            Some(json!({"removal_guard": {"confirm_ms": 5_000}})),
        )
        .await;
    assert_eq!(code, 200, "{patched}");
    assert_eq!(
        patched["removal_guard"],
        json!({"max_percent": 50, "min_endpoints": 1, "confirm_ms": 5_000})
    );
    // null turns it off, in a merge patch too.
    let (code, off) = gateway
        .api("PATCH", &source_path, Some(json!({"removal_guard": null})))
        .await;
    assert_eq!(code, 200, "{off}");
    assert!(off["removal_guard"].is_null(), "{off}");
    let (_, read) = gateway.api("GET", &source_path, None).await;
    assert!(read["removal_guard"].is_null(), "stored as off: {read}");
    // Patching something else keeps it off.
    let (_, renamed) = gateway
        .api("PATCH", &source_path, Some(json!({"name": "reg-2"})))
        .await;
    assert!(renamed["removal_guard"].is_null(), "{renamed}");

    for (guard, field) in [
        (json!({"max_percent": 101}), "removal_guard.max_percent"),
        (json!({"confirm_ms": 10}), "removal_guard.confirm_ms"),
        (json!({"max_percent": -1}), "removal_guard.max_percent"),
        (json!({"hold": true}), "removal_guard"),
    ] {
        let (code, error) = gateway
            .api("PATCH", &source_path, Some(json!({"removal_guard": guard})))
            .await;
        assert_eq!(code, 422, "{guard}: {error}");
        assert!(
            ApiError::read(&error)
                .field
                .is_some_and(|named| named.starts_with(field)),
            "{guard}: {error}"
        );
    }

    let (code, missing) = accept(&gateway, 9_999).await;
    assert_eq!(code, 404, "{missing}");
    let (code, nothing) = accept(&gateway, source).await;
    assert_eq!((code, &nothing["released"]), (200, &json!(0)), "{nothing}");
}

// ---------------------------------------------------------------------------------------------
// Honest 503s
// ---------------------------------------------------------------------------------------------

async fn refresh(gateway: &TestGateway, source: i64) {
    let path = format!("/api/v1/discovery-sources/{source}/refresh");
    let (code, body) = gateway.api("POST", &path, None).await;
    assert_eq!(code, 202, "{body}");
}

/// A GET through the proxy: its status and, when the answer is one, the proxy's named error.
async fn proxy_error(gateway: &TestGateway) -> (u16, Option<ProxyError>) {
    let response = reqwest::get(gateway.proxy_url("/"))
        .await
        .expect("proxy answers");
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body.get("error").map(|_| ProxyError::read(&body)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_fed_only_by_unhealthy_sources_answers_discovery_unavailable() {
    let registry = Registry::start().await;
    // Pending: the first answer never comes in time.
    registry.set_delay(Duration::from_secs(30));
    // The 503 is read for the source's state: told only with `proxy.error_details = "full"`.
    let gateway = TestGateway::start_with_full_errors().await;
    let service = service(&gateway, "web").await;
    let mut body = http_source(&registry, Value::Null);
    body["config"]["timeout_ms"] = json!(5_000);
    body["config"]["interval_ms"] = json!(60_000);
    let source = add_source(&gateway, service, body).await;
    assert_eq!(gateway.source_status(source).await.state, "pending");
    let (status, error) = proxy_error(&gateway).await;
    let error = error.unwrap_or_else(|| panic!("{status} is not a named error"));
    assert_eq!(status, 503, "{error:?}");
    assert_eq!(error.code, "discovery_unavailable", "{error:?}");
    let message = error.message;
    assert!(
        message.contains("web") && message.contains("registry (pending)"),
        "names the service and the source's state: {message}"
    );

    // Failing from the start: no last known good targets either.
    registry.set_delay(Duration::ZERO);
    registry.set_raw(500, "text/plain", "registry broken");
    refresh(&gateway, source).await;
    wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    wait_until("the 503 names the failing source", WAIT, || async {
        let (status, error) = proxy_error(&gateway).await;
        status == 503
            && error.is_some_and(|error| {
                error.code == "discovery_unavailable"
                    && error.message.contains("registry (failing)")
            })
    })
    .await;

    // Healthy but empty: the registry answered, so the targets (none) are the reason.
    registry.set_json(json!([]));
    refresh(&gateway, source).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until(
        "no_available_target once the source is healthy",
        WAIT,
        || async {
            let (status, error) = proxy_error(&gateway).await;
            status == 503 && error.is_some_and(|error| error.code == "no_available_target")
        },
    )
    .await;
}

/// A GET through the proxy at `path` that must answer `status` with `code`; its message.
async fn error_message(gateway: &TestGateway, path: &str, status: u16, code: &str) -> String {
    let response = reqwest::get(gateway.proxy_url(path))
        .await
        .expect("proxy answers");
    assert_eq!(response.status().as_u16(), status, "{path}");
    let body: Value = response.json().await.expect("a JSON error body");
    let error = ProxyError::read(&body);
    assert_eq!(error.code, code, "{body}");
    error.message
}

/// `proxy.error_details` (issue 31): by default a 5xx answer names its code and the service,
/// never a discovery source, its state, a target's address or the upstream's own error, which
/// describe the network behind the gateway; with "full" it tells what the log line tells.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_names_sources_and_targets_only_with_full_error_details() {
    let registry = Registry::start().await;
    registry.set_raw(500, "text/plain", "registry broken");
    // Nothing listens here: connecting is refused.
    let dead = free_addr();
    for full in [false, true] {
        let gateway = if full {
            TestGateway::start_with_full_errors().await
        } else {
            TestGateway::start().await
        };
        let web = service(&gateway, "web").await;
        let source = add_source(&gateway, web, http_source(&registry, Value::Null)).await;
        let down = gateway
            .create(
                "/api/v1/services",
                json!({"name": "down", "max_attempts": 1}),
            )
            .await;
        gateway
            .create(
                &format!("/api/v1/services/{down}/targets"),
                json!({"host": "127.0.0.1", "port": dead.port()}),
            )
            .await;
        gateway
            .create(
                "/api/v1/routes",
                json!({"name": "down", "path_prefix": "/down", "service_id": down}),
            )
            .await;
        wait_status(&gateway, source, "failing", |s| s.state == "failing").await;

        let discovery = error_message(&gateway, "/", 503, "discovery_unavailable").await;
        let connect = error_message(&gateway, "/down", 502, "upstream_connect_failed").await;
        assert!(discovery.contains("service web"), "{discovery}");
        assert!(connect.contains("service down"), "{connect}");
        let target = dead.to_string();
        if full {
            assert!(discovery.contains("registry (failing)"), "{discovery}");
            assert!(connect.contains(&target), "{connect}");
            assert!(connect.to_lowercase().contains("refused"), "{connect}");
        } else {
            for secret in ["registry", "failing"] {
                assert!(!discovery.contains(secret), "{secret}: {discovery}");
            }
            for secret in [target.as_str(), "127.0.0.1", "refused", "os error"] {
                assert!(
                    !connect.to_lowercase().contains(secret),
                    "{secret}: {connect}"
                );
            }
        }
        // The operator still sees the source's state and error, whatever the client is told.
        let status = gateway.source_status(source).await;
        assert_eq!(status.state, "failing");
        assert!(status.last_error.is_some(), "{status}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_target_keeps_the_answer_no_available_target() {
    let registry = Registry::start().await;
    registry.set_raw(500, "text/plain", "registry broken");
    let gateway = TestGateway::start().await;
    let service = service(&gateway, "web").await;
    // A disabled operator target takes no traffic: the failing source is still the reason.
    let upstream = Upstream::start("op").await;
    let mut disabled = target(&upstream, 100, 0);
    disabled["enabled"] = json!(false);
    gateway
        .create(&format!("/api/v1/services/{service}/targets"), disabled)
        .await;
    let source = add_source(&gateway, service, http_source(&registry, Value::Null)).await;
    wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    wait_until(
        "discovery_unavailable beside a disabled operator target",
        WAIT,
        || async {
            let (_, error) = proxy_error(&gateway).await;
            error.is_some_and(|error| error.code == "discovery_unavailable")
        },
    )
    .await;
    // An enabled operator target that is down: the targets are the reason now.
    let mut enabled = target(&upstream, 100, 0);
    enabled["port"] = json!(1);
    gateway
        .create(&format!("/api/v1/services/{service}/targets"), enabled)
        .await;
    let (status, error) = proxy_error(&gateway).await;
    assert_eq!(status, 502, "the operator target is tried: {error:?}");
    upstream.stop();
}
