use crate::common;
use common::*;

// DNS discovery (DESIGN.md §4) against a real authoritative server (Knot DNS) through real
// sockets: `dns` (A/AAAA) and `dns-srv` sources, records changed at runtime, outcome classes,
// the source lifecycle, draining and removal grace, TTL-driven refreshes, forced refreshes,
// enable/disable/delete, restarts, and read-only discovered targets.
//
// Each test has its own Knot instance and gateway, so they run in parallel. DNS records point
// at real upstreams: A records at distinct loopback addresses (127.0.0.2, 127.0.0.3, ...) that
// share one port, SRV records at distinct ports on 127.0.0.1.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::knot::{Knot, ZoneOp};
use serde_json::{json, Value};

/// The longest wait for any one condition.
const WAIT: Duration = Duration::from_secs(10);
/// Refresh interval of the fast sources.
const INTERVAL_MS: u64 = 250;
/// One refresh attempt's budget.
const TIMEOUT_MS: u64 = 300;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A service with a route for `path_prefix` (any host).
async fn service_at(gateway: &TestGateway, name: &str, path_prefix: &str) -> i64 {
    let service = gateway
        .create("/api/v1/services", json!({ "name": name }))
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": name, "path_prefix": path_prefix, "service_id": service }),
        )
        .await;
    service
}

/// A discovery source body with fast timers: `config` gets the Knot resolver, `interval_ms` and
/// `timeout_ms` unless it names them; `extra` adds source fields.
fn source_body(name: &str, provider: &str, knot: &Knot, config: Value, extra: Value) -> Value {
    let mut config = config;
    let fields = config.as_object_mut().unwrap();
    fields
        .entry("resolver")
        .or_insert_with(|| json!(knot.resolver()));
    fields
        .entry("interval_ms")
        .or_insert_with(|| json!(INTERVAL_MS));
    fields
        .entry("timeout_ms")
        .or_insert_with(|| json!(TIMEOUT_MS));
    let mut body = json!({
        "name": name,
        "provider": provider,
        "config": config,
        "stale_after_ms": 60_000,
        "removal_grace_ms": 2_000,
    });
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

async fn add_source(gateway: &TestGateway, service: i64, body: Value) -> i64 {
    gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            body,
        )
        .await
}

/// Waits for a refresh that finished after the current `last_refresh_at`. The control task
/// publishes a refresh's snapshot before it applies the next outcome, so after this the data
/// path reflects every target change observed before the call.
async fn next_refresh(gateway: &TestGateway, source: i64) -> SourceStatus {
    let before = gateway.source_status(source).await.last_refresh_at;
    wait_status(gateway, source, "a later refresh", move |status| {
        status.last_refresh_at != before
    })
    .await
}

async fn wait_targets(
    gateway: &TestGateway,
    service: i64,
    what: &str,
    predicate: impl Fn(&[Target]) -> bool,
) -> Vec<Target> {
    let predicate = &predicate;
    wait_until(what, WAIT, move || async move {
        let targets = gateway.targets(service).await;
        if predicate(&targets) {
            Ok(targets)
        } else {
            Err(common::api::Targets(&targets).to_string())
        }
    })
    .await
}

/// The target with this provider key.
fn find<'a>(targets: &'a [Target], key: &str) -> Option<&'a Target> {
    targets
        .iter()
        .find(|target| target.provider_key.as_deref() == Some(key))
}

fn in_state(targets: &[Target], key: &str, state: &str) -> bool {
    find(targets, key).is_some_and(|target| target.state == state)
}

fn count_in(targets: &[Target], state: &str) -> usize {
    targets
        .iter()
        .filter(|target| target.state == state)
        .count()
}

fn ms(duration: chrono::TimeDelta) -> i64 {
    duration.num_milliseconds()
}

fn hits(counts: &HashMap<String, usize>, upstream: &Upstream) -> usize {
    counts.get(&upstream.name).copied().unwrap_or(0)
}

/// A GET through the proxy that must answer 503 `no_available_target`.
async fn assert_no_available_target(gateway: &TestGateway, path: &str) {
    assert_503(gateway, path, "no_available_target").await;
}

/// A GET through the proxy that must answer 503 with `code`; returns the message.
async fn assert_503(gateway: &TestGateway, path: &str, code: &str) -> String {
    let response = gateway.get(path).await;
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    assert_eq!(status, 503, "GET {path}: {body}");
    let value: Value = serde_json::from_str(&body).expect("the 503 body is JSON");
    let error = ProxyError::read(&value);
    assert_eq!(error.code, code, "GET {path}: {body}");
    error.message
}

/// The upstream name answering a GET (which must be 200).
async fn fetch(gateway: &TestGateway, path: &str) -> String {
    let response = gateway.get(path).await;
    let status = response.status().as_u16();
    let body = response.text().await.unwrap();
    assert_eq!(status, 200, "GET {path}: {body}");
    body
}

/// Upstreams on the given loopback addresses, all on one port (so that A records, which carry
/// no port, can tell them apart). Returns them in order, and the port.
async fn upstreams_on_one_port(ips: &[&str]) -> (Vec<Upstream>, u16) {
    for _ in 0..20 {
        let first = std::net::TcpListener::bind((ips[0], 0)).expect("bind a loopback address");
        let port = first.local_addr().unwrap().port();
        let mut probes = vec![first];
        for ip in &ips[1..] {
            match std::net::TcpListener::bind((*ip, port)) {
                Ok(listener) => probes.push(listener),
                Err(_) => break,
            }
        }
        if probes.len() < ips.len() {
            continue;
        }
        drop(probes);
        let mut upstreams = Vec::new();
        for ip in ips {
            let addr = SocketAddr::new(ip.parse().unwrap(), port);
            upstreams.push(Upstream::start_on(&format!("up-{ip}"), addr).await);
        }
        return (upstreams, port);
    }
    panic!("no port free on all of {ips:?}");
}

fn key(ip: &str, port: u16) -> String {
    format!("{ip}:{port}")
}

// ---------------------------------------------------------------------------------------------
// dns: A records
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_a_records_become_targets_and_follow_runtime_changes() {
    let (upstreams, port) = upstreams_on_one_port(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    let [u2, u3, u4] = &upstreams[..] else {
        unreachable!()
    };
    let knot = Knot::start("api A 127.0.0.2\napi A 127.0.0.3");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let grace_ms: i64 = 1_500;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"]}),
            json!({"removal_grace_ms": grace_ms}),
        ),
    )
    .await;

    // The first refresh: both addresses become active targets.
    let first = wait_status(&gateway, source, "healthy with 2 active", |s| {
        s.state == "healthy" && s.counts() == (2, 0, 0)
    })
    .await;
    assert_eq!(first.source_id, source);
    assert!(first.last_error.is_none(), "{first}");
    assert!(first.failing_since.is_none(), "{first}");
    assert!(
        first.revision.as_deref().is_some_and(|r| !r.is_empty()),
        "revision is set after a success: {first}"
    );
    let last_success = first.last_success_at.expect("last_success_at");
    assert_eq!(
        first.last_refresh_at.expect("last_refresh_at"),
        last_success
    );
    let next = first.next_refresh_at.expect("next_refresh_at");
    let delay = ms(next - last_success);
    assert!(
        (INTERVAL_MS as i64 * 9 / 10..=INTERVAL_MS as i64).contains(&delay),
        "next refresh {delay} ms after the last one (interval {INTERVAL_MS} less ≤10 % jitter): {first}"
    );

    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 2, "{found:?}");
    for ip in ["127.0.0.2", "127.0.0.3"] {
        let target =
            find(&found, &key(ip, port)).unwrap_or_else(|| panic!("a target for {ip}: {found:?}"));
        assert_eq!(target.host, ip);
        assert_eq!(target.port, port);
        assert_eq!(target.source_id, Some(source));
        assert_eq!(target.service_id, service);
        assert_eq!(target.state, "active");
        assert_eq!(target.health, "unknown");
        assert_eq!(target.weight, 100, "the dns provider's default weight");
        assert_eq!(target.priority, 0);
        assert!(target.enabled);
        assert!(target.remove_at.is_none(), "{target}");
    }
    let id2 = id_of(find(&found, &key("127.0.0.2", port)).unwrap());
    let id3 = id_of(find(&found, &key("127.0.0.3", port)).unwrap());

    // Traffic reaches both, evenly (same weight, round robin).
    next_refresh(&gateway, source).await;
    let answers = spread(&gateway, "/", 20, 2).await;
    assert!(
        (8..=12).contains(&hits(&answers, u2)) && (8..=12).contains(&hits(&answers, u3)),
        "{answers:?}"
    );
    assert_eq!(hits(&answers, u4), 0, "{answers:?}");

    // A record added at runtime: a new target, and traffic.
    knot.set("api", 1, "A", "127.0.0.4");
    let found = wait_targets(&gateway, service, "a target for 127.0.0.4", |t| {
        in_state(t, &key("127.0.0.4", port), "active")
    })
    .await;
    let id4 = id_of(find(&found, &key("127.0.0.4", port)).unwrap());
    assert!(id4 != id2 && id4 != id3);
    wait_until("traffic reaches 127.0.0.4", WAIT, || async {
        fetch(&gateway, "/").await == u4.name
    })
    .await;
    let s = gateway.source_status(source).await;
    assert_eq!(s.counts(), (3, 0, 0), "{s}");

    // A record removed: its target drains until now + removal grace and takes no new traffic.
    knot.unset("api", "A", "127.0.0.2");
    let found = wait_targets(&gateway, service, "127.0.0.2 draining", |t| {
        in_state(t, &key("127.0.0.2", port), "draining")
    })
    .await;
    let seen_at = Utc::now();
    let draining = find(&found, &key("127.0.0.2", port)).unwrap();
    assert_eq!(id_of(draining), id2, "the same target drains");
    let remove_at = draining.remove_at.expect("remove_at");
    let ahead = ms(remove_at - seen_at);
    assert!(
        (grace_ms - 600..=grace_ms + 100).contains(&ahead),
        "remove_at is {ahead} ms ahead, expected ≈ removal_grace_ms {grace_ms}: {draining}"
    );
    let s = next_refresh(&gateway, source).await;
    assert_eq!(s.counts(), (2, 1, 0), "{s}");
    assert!(s.state == "healthy", "{s}");
    let before = u2.hits();
    let answers = spread(&gateway, "/", 30, 3).await;
    assert_eq!(
        u2.hits(),
        before,
        "a draining target got new requests: {answers:?}"
    );
    assert_eq!(hits(&answers, u3) + hits(&answers, u4), 30, "{answers:?}");

    // A removed record that comes back while its target still drains: the same target returns.
    knot.unset("api", "A", "127.0.0.3");
    wait_targets(&gateway, service, "127.0.0.3 draining", |t| {
        in_state(t, &key("127.0.0.3", port), "draining")
    })
    .await;
    knot.set("api", 1, "A", "127.0.0.3");
    let found = wait_targets(&gateway, service, "127.0.0.3 active again", |t| {
        in_state(t, &key("127.0.0.3", port), "active")
    })
    .await;
    let back = find(&found, &key("127.0.0.3", port)).unwrap();
    assert_eq!(id_of(back), id3, "reactivation keeps the target id: {back}");
    assert!(back.remove_at.is_none(), "{back}");
    let before = u3.hits();
    wait_until("traffic reaches 127.0.0.3 again", WAIT, || async {
        fetch(&gateway, "/").await;
        u3.hits() > before
    })
    .await;

    // The removed target is deleted when its grace ends, not before.
    wait_until("127.0.0.2 deleted", WAIT, || async {
        let found = gateway.targets(service).await;
        match find(&found, &key("127.0.0.2", port)) {
            None => Ok(()),
            Some(target) => Err(target.to_string()),
        }
    })
    .await;
    let early = ms(remove_at - Utc::now());
    assert!(early <= 50, "deleted {early} ms before its remove_at");
    let s = gateway.source_status(source).await;
    assert_eq!(s.counts(), (2, 0, 0), "{s}");
    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 2, "{found:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_target_finishes_its_in_flight_request() {
    let (upstreams, port) = upstreams_on_one_port(&["127.0.0.2", "127.0.0.3"]).await;
    let knot = Knot::start("api A 127.0.0.2\napi A 127.0.0.3");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"]}),
            json!({"removal_grace_ms": 10_000}),
        ),
    )
    .await;
    wait_status(&gateway, source, "healthy with 2 active", |s| {
        s.state == "healthy" && s.counts() == (2, 0, 0)
    })
    .await;

    // A slow request is in flight on one of the two.
    let client = gateway.http.clone();
    let url = gateway.proxy_url("/slow/2500");
    next_refresh(&gateway, source).await;
    let slow = tokio::spawn(async move {
        let response = client.get(url).send().await.expect("proxy answers");
        let status = response.status().as_u16();
        (status, response.text().await.unwrap())
    });
    let busy = wait_until("an upstream receives the slow request", WAIT, || async {
        upstreams
            .iter()
            .position(|u| {
                u.seen
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|s| s.path == "/slow/2500")
            })
            .ok_or_else(|| "not yet".to_owned())
    })
    .await;
    let (victim, other) = (&upstreams[busy], &upstreams[1 - busy]);
    let victim_ip = victim.addr.ip().to_string();

    // Its record goes away: the target drains, new requests go to the other one.
    knot.unset("api", "A", &victim_ip);
    wait_targets(&gateway, service, "the busy target draining", |t| {
        in_state(t, &key(&victim_ip, port), "draining")
    })
    .await;
    next_refresh(&gateway, source).await;
    let before = victim.hits();
    let answers = spread(&gateway, "/", 20, 2).await;
    assert_eq!(victim.hits(), before, "a draining target got new requests");
    assert_eq!(hits(&answers, other), 20, "{answers:?}");
    assert!(
        !slow.is_finished(),
        "the slow request was to be in flight while its target drained"
    );

    // The in-flight request completes normally.
    let (code, body) = slow.await.unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(body, victim.name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nxdomain_and_nodata_are_successful_empty_refreshes() {
    let upstream = Upstream::start_on("gone", "127.0.0.2:0".parse().unwrap()).await;
    let port = upstream.addr.port();
    let knot = Knot::start("gone A 127.0.0.2\ntext TXT \"no addresses here\"");
    assert!(
        knot.query("missing", "A").is_empty(),
        "missing.svc.test must not exist"
    );
    let gateway = TestGateway::start().await;

    // NXDOMAIN: healthy, a revision, no targets, and the service has nothing to offer.
    let missing = service_at(&gateway, "missing", "/missing").await;
    let source = add_source(
        &gateway,
        missing,
        source_body(
            "missing",
            "dns",
            &knot,
            json!({"hostname": "missing.svc.test", "port": port}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    assert_eq!(s.counts(), (0, 0, 0), "{s}");
    assert!(s.last_error.is_none(), "{s}");
    assert!(s.revision.is_some(), "an empty success has a revision: {s}");
    assert!(s.last_success_at.is_some(), "{s}");
    assert!(gateway.targets(missing).await.is_empty());
    assert_no_available_target(&gateway, "/missing").await;

    // NODATA (the name exists, with no A or AAAA): the same.
    let nodata = service_at(&gateway, "nodata", "/nodata").await;
    let source = add_source(
        &gateway,
        nodata,
        source_body(
            "nodata",
            "dns",
            &knot,
            json!({"hostname": "text.svc.test", "port": port}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    assert_eq!(s.counts(), (0, 0, 0), "{s}");
    assert!(s.last_error.is_none(), "{s}");
    assert!(gateway.targets(nodata).await.is_empty());

    // A name whose records all go away: its targets drain and are deleted, the source stays
    // healthy, and the service answers 503 once they are out of rotation.
    let gone = service_at(&gateway, "gone", "/gone").await;
    let source = add_source(
        &gateway,
        gone,
        source_body(
            "gone",
            "dns",
            &knot,
            json!({"hostname": "gone.svc.test", "port": port}),
            json!({"removal_grace_ms": 800}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "healthy with 1 active", |s| {
        s.state == "healthy" && s.counts() == (1, 0, 0)
    })
    .await;
    let full_revision = s.revision.clone();
    next_refresh(&gateway, source).await;
    assert_eq!(fetch(&gateway, "/gone").await, "gone");
    knot.unset("gone", "A", "127.0.0.2");
    assert!(knot.query("gone", "A").is_empty());
    wait_targets(&gateway, gone, "the target draining", |t| {
        in_state(t, &key("127.0.0.2", port), "draining")
    })
    .await;
    let s = next_refresh(&gateway, source).await;
    assert!(s.state == "healthy", "no such name is a success: {s}");
    assert!(s.last_error.is_none(), "{s}");
    assert_ne!(
        s.revision, full_revision,
        "the empty set has its own revision"
    );
    assert_eq!(s.counts(), (0, 1, 0), "{s}");
    assert_no_available_target(&gateway, "/gone").await;
    wait_targets(&gateway, gone, "the target deleted", |t| t.is_empty()).await;
    let s = gateway.source_status(source).await;
    assert_eq!(s.counts(), (0, 0, 0), "{s}");
    assert!(s.state == "healthy", "{s}");
    assert_no_available_target(&gateway, "/gone").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aaaa_records_become_bracketed_targets() {
    // The upstream on ::1, when this machine has IPv6 loopback.
    let v6 = match std::net::TcpListener::bind("[::1]:0") {
        Ok(probe) => {
            drop(probe);
            Some(Upstream::start_on("v6", "[::1]:0".parse().unwrap()).await)
        }
        Err(err) => {
            eprintln!("no IPv6 loopback ({err}): the request through [::1] is skipped");
            None
        }
    };
    let port = v6.as_ref().map_or(8080, |upstream| upstream.addr.port());
    let knot = Knot::start("v6 AAAA ::1\ndual A 127.0.0.2\ndual AAAA ::1");
    let gateway = TestGateway::start().await;

    let service = service_at(&gateway, "v6", "/v6").await;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "v6",
            "dns",
            &knot,
            json!({"hostname": "v6.svc.test", "port": port, "record_types": ["aaaa"]}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "healthy with 1 active", |s| {
        s.state == "healthy" && s.counts() == (1, 0, 0)
    })
    .await;
    assert!(s.last_error.is_none(), "{s}");
    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].host, "::1");
    assert_eq!(found[0].port, port);
    assert_eq!(found[0].key(), format!("[::1]:{port}"));
    if let Some(v6) = &v6 {
        wait_until("a request reaches [::1]", WAIT, || async {
            fetch(&gateway, "/v6").await == "v6"
        })
        .await;
        assert!(v6.hits() > 0);
    }

    // The default record types are A and AAAA: both families become targets.
    let dual = service_at(&gateway, "dual", "/dual").await;
    let source = add_source(
        &gateway,
        dual,
        source_body(
            "dual",
            "dns",
            &knot,
            json!({"hostname": "dual.svc.test", "port": 9}),
            json!({}),
        ),
    )
    .await;
    let (code, stored) = gateway
        .api("GET", &format!("/api/v1/discovery-sources/{source}"), None)
        .await;
    assert_eq!(code, 200, "{stored}");
    assert_eq!(stored["config"]["record_types"], json!(["a", "aaaa"]));
    let found = wait_targets(&gateway, dual, "an A and an AAAA target", |t| {
        count_in(t, "active") == 2
    })
    .await;
    assert!(find(&found, "127.0.0.2:9").is_some(), "{found:?}");
    assert!(find(&found, "[::1]:9").is_some(), "{found:?}");
}

// ---------------------------------------------------------------------------------------------
// dns-srv
// ---------------------------------------------------------------------------------------------

/// SRV records on `_http._tcp.api.svc.test`, all naming `h.svc.test` (127.0.0.1).
fn srv_zone(records: &[(u16, u16, u16)]) -> String {
    let mut zone = String::from("h A 127.0.0.1\n");
    for (priority, weight, port) in records {
        zone.push_str(&format!(
            "_http._tcp.api SRV {priority} {weight} {port} h.svc.test.\n"
        ));
    }
    zone
}

fn srv_source(knot: &Knot, config: Value) -> Value {
    let mut full = json!({"service_name": "_http._tcp.api.svc.test"});
    full.as_object_mut()
        .unwrap()
        .extend(config.as_object().unwrap().clone());
    source_body(
        "api-srv",
        "dns-srv",
        knot,
        full,
        // These tests remove several records at once on purpose; the removal guard has its own
        // tests (discovery_safety.rs).
        json!({"removal_grace_ms": 1_000, "removal_guard": null}),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_srv_tiers_and_weights_with_failover() {
    let (a, b, c) = (
        Upstream::start("srv-a").await,
        Upstream::start("srv-b").await,
        Upstream::start("srv-c").await,
    );
    let (pa, pb, pc) = (a.addr.port(), b.addr.port(), c.addr.port());
    let knot = Knot::start(&srv_zone(&[(10, 1, pa), (10, 3, pb), (20, 1, pc)]));
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let source = add_source(&gateway, service, srv_source(&knot, json!({}))).await;
    let s = wait_status(&gateway, source, "healthy with 3 active", |s| {
        s.state == "healthy" && s.counts() == (3, 0, 0)
    })
    .await;
    assert!(s.revision.is_some(), "{s}");

    // Port, priority and weight come from the records (RFC 2782 weight w → balancer weight
    // w×100 while the answer's largest weight is at most 655, as the provider maps them).
    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 3, "{found:?}");
    for (port, weight, priority) in [(pa, 100, 10), (pb, 300, 10), (pc, 100, 20)] {
        let target = find(&found, &key("127.0.0.1", port))
            .unwrap_or_else(|| panic!("a target for port {port}: {found:?}"));
        assert_eq!(target.host, "127.0.0.1");
        assert_eq!(target.port, port);
        assert_eq!(target.weight, weight, "{target}");
        assert_eq!(target.priority, priority, "{target}");
        assert_eq!(target.state, "active");
        assert_eq!(target.metadata["srv_target"], "h.svc.test", "{target}");
    }

    // Only the priority-10 tier takes traffic, 1:3 by weight (±5 points).
    next_refresh(&gateway, source).await;
    let answers = spread(&gateway, "/", 1_000, 8).await;
    let (na, nb, nc) = (hits(&answers, &a), hits(&answers, &b), hits(&answers, &c));
    assert_eq!(nc, 0, "the priority-20 tier got traffic: {answers:?}");
    assert!(
        (200..=300).contains(&na),
        "weight 1 of 4 got {na}/1000: {answers:?}"
    );
    assert!(
        (700..=800).contains(&nb),
        "weight 3 of 4 got {nb}/1000: {answers:?}"
    );

    // The priority-10 records go away: traffic fails over to priority 20.
    knot.transaction(&[
        ZoneOp::unset("_http._tcp.api", "SRV", &format!("10 1 {pa} h.svc.test.")),
        ZoneOp::unset("_http._tcp.api", "SRV", &format!("10 3 {pb} h.svc.test.")),
    ]);
    wait_targets(&gateway, service, "the priority-10 targets draining", |t| {
        in_state(t, &key("127.0.0.1", pa), "draining")
            && in_state(t, &key("127.0.0.1", pb), "draining")
    })
    .await;
    let s = next_refresh(&gateway, source).await;
    assert_eq!(s.counts(), (1, 2, 0), "{s}");
    let answers = spread(&gateway, "/", 50, 2).await;
    assert_eq!(hits(&answers, &c), 50, "{answers:?}");
    wait_targets(&gateway, service, "the drained targets deleted", |t| {
        t.len() == 1
    })
    .await;
    let answers = spread(&gateway, "/", 10, 1).await;
    assert_eq!(hits(&answers, &c), 10, "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_srv_record_priority_and_weight_can_be_ignored() {
    let (a, b, c) = (
        Upstream::start("srv-a").await,
        Upstream::start("srv-b").await,
        Upstream::start("srv-c").await,
    );
    let (pa, pb, pc) = (a.addr.port(), b.addr.port(), c.addr.port());
    let knot = Knot::start(&srv_zone(&[(10, 1, pa), (10, 3, pb), (20, 4, pc)]));
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let source = add_source(
        &gateway,
        service,
        srv_source(&knot, json!({"use_record_priority": false})),
    )
    .await;
    let found = wait_targets(&gateway, service, "3 active", |t| {
        count_in(t, "active") == 3
    })
    .await;
    let ids: Vec<i64> = found.iter().map(id_of).collect();
    for (port, weight) in [(pa, 100), (pb, 300), (pc, 400)] {
        let target = find(&found, &key("127.0.0.1", port)).unwrap();
        assert_eq!(
            target.priority, 0,
            "one tier (the config's priority): {target}"
        );
        assert_eq!(target.weight, weight, "{target}");
    }
    // One tier: all three share traffic 1:3:4 (±5 points).
    next_refresh(&gateway, source).await;
    let answers = spread(&gateway, "/", 800, 8).await;
    let (na, nb, nc) = (hits(&answers, &a), hits(&answers, &b), hits(&answers, &c));
    assert!((60..=140).contains(&na), "{answers:?}");
    assert!((260..=340).contains(&nb), "{answers:?}");
    assert!((360..=440).contains(&nc), "{answers:?}");

    // Ignoring record weights too: every target gets the config's weight, keeping its id.
    let (code, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/discovery-sources/{source}"),
            Some(json!({"config": {"use_record_weight": false, "weight": 50, "priority": 5}})),
        )
        .await;
    assert_eq!(code, 200, "{body}");
    let found = wait_targets(&gateway, service, "weights 50, priority 5", |t| {
        t.len() == 3 && t.iter().all(|x| x.weight == 50 && x.priority == 5)
    })
    .await;
    let mut after: Vec<i64> = found.iter().map(id_of).collect();
    let mut before = ids;
    after.sort_unstable();
    before.sort_unstable();
    assert_eq!(after, before, "a changed config updates the same targets");
}

// ---------------------------------------------------------------------------------------------
// Failures and the source lifecycle
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_keeps_last_known_good_then_goes_stale_then_recovers() {
    let (upstreams, port) = upstreams_on_one_port(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]).await;
    let mut knot = Knot::start("api A 127.0.0.2\napi A 127.0.0.3\napi A 127.0.0.4");
    // The 503 is read for the source's state: told only with `proxy.error_details = "full"`.
    let gateway = TestGateway::start_with_full_errors().await;
    let service = service_at(&gateway, "api", "/").await;
    let stale_after_ms: i64 = 1_500;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"]}),
            json!({"stale_after_ms": stale_after_ms, "removal_grace_ms": 5_000}),
        ),
    )
    .await;
    let healthy = wait_status(&gateway, source, "healthy with 3 active", |s| {
        s.state == "healthy" && s.counts() == (3, 0, 0)
    })
    .await;
    let found = gateway.targets(service).await;
    let id_at = |ip: &str| id_of(find(&found, &key(ip, port)).unwrap());
    let ids = [id_at("127.0.0.2"), id_at("127.0.0.3"), id_at("127.0.0.4")];

    // The server stops answering: failing, with a precise error; the last known good targets
    // keep serving.
    knot.stop();
    let failing = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = failing
        .last_error
        .as_deref()
        .expect("last_error")
        .to_owned();
    assert!(
        error.contains("api.svc.test") && error.contains(&knot.resolver()),
        "the error names the query and the server: {error}"
    );
    assert!(
        error.contains("timed out") || (error.contains("no response") && error.contains(" ms")),
        "the error says the server did not answer in time: {error}"
    );
    assert_eq!(failing.last_success_at, healthy.last_success_at);
    assert_eq!(
        failing.revision, healthy.revision,
        "the last good revision stays"
    );
    assert!(failing.failing_since.is_some(), "{failing}");
    assert!(failing.next_refresh_at.is_some(), "{failing}");
    assert_eq!(failing.counts(), (3, 0, 0), "{failing}");
    let answers = spread(&gateway, "/", 30, 3).await;
    assert!(
        upstreams.iter().all(|u| hits(&answers, u) > 0),
        "every last-known-good target serves while failing: {answers:?}"
    );

    // Failing for longer than stale_after_ms: stale; its targets are stale and take no traffic.
    let stale = wait_status(&gateway, source, "stale", |s| s.state == "stale").await;
    let failing_since = stale.failing_since.expect("failing_since");
    let early = ms(failing_since + chrono::TimeDelta::milliseconds(stale_after_ms) - Utc::now());
    assert!(
        early <= 50,
        "stale {early} ms before stale_after_ms ran out"
    );
    assert_eq!(stale.counts(), (0, 0, 3), "{stale}");
    assert!(stale.last_error.is_some(), "{stale}");
    let found = gateway.targets(service).await;
    assert_eq!(count_in(&found, "stale"), 3, "{found:?}");
    next_refresh(&gateway, source).await;
    // Only a stale source feeds the service: discovery, not the targets, is why.
    let message = assert_503(&gateway, "/", "discovery_unavailable").await;
    assert!(message.contains("(stale)"), "{message}");

    // The server is back without one of the records: healthy; the endpoints that returned are
    // active again with their ids, the other one drains; traffic flows.
    knot.transaction_while_stopped(&[ZoneOp::unset("api", "A", "127.0.0.4")]);
    knot.restart();
    let recovered = wait_status(&gateway, source, "healthy with 2 active, 1 draining", |s| {
        s.state == "healthy" && s.counts() == (2, 1, 0)
    })
    .await;
    assert!(recovered.last_error.is_none(), "{recovered}");
    assert!(recovered.failing_since.is_none(), "{recovered}");
    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 3, "{found:?}");
    for (ip, id, state) in [
        ("127.0.0.2", ids[0], "active"),
        ("127.0.0.3", ids[1], "active"),
        ("127.0.0.4", ids[2], "draining"),
    ] {
        let target = find(&found, &key(ip, port)).unwrap();
        assert_eq!(id_of(target), id, "{target}");
        assert_eq!(target.state, state, "{target}");
    }
    next_refresh(&gateway, source).await;
    let answers = spread(&gateway, "/", 20, 2).await;
    assert_eq!(hits(&answers, &upstreams[0]), 10, "{answers:?}");
    assert_eq!(hits(&answers, &upstreams[1]), 10, "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answers_and_unreachable_servers_are_failed_refreshes() {
    let knot = Knot::start("api A 127.0.0.2");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;

    // A name outside Knot's zones: it answers REFUSED.
    let source = add_source(
        &gateway,
        service,
        source_body(
            "elsewhere",
            "dns",
            &knot,
            json!({"hostname": "api.elsewhere.test", "port": 80, "record_types": ["a"]}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = s.last_error.as_deref().expect("last_error");
    assert!(
        error.contains("REFUSED") && error.contains("api.elsewhere.test"),
        "{error}"
    );
    assert!(s.revision.is_none(), "no success yet, so no revision: {s}");
    assert!(s.last_success_at.is_none(), "{s}");
    assert!(s.last_refresh_at.is_some(), "{s}");
    assert_eq!(s.counts(), (0, 0, 0), "{s}");

    // A name in a zone Knot failed to load: it answers SERVFAIL.
    let source = add_source(
        &gateway,
        service,
        source_body(
            "broken",
            "dns",
            &knot,
            json!({"hostname": "api.broken.test", "port": 80, "record_types": ["a"]}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    assert_eq!(
        s.error(),
        "DNS server answered SERVFAIL for api.broken.test A",
        "{s}"
    );
    assert!(s.revision.is_none(), "{s}");

    // A resolver port nobody listens on: the kernel refuses at once.
    let closed = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let source = add_source(
        &gateway,
        service,
        source_body(
            "nobody",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": 80, "resolver": closed.to_string()}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = s.last_error.as_deref().expect("last_error");
    assert!(
        error.contains(&closed.to_string()) && error.to_lowercase().contains("refused"),
        "{error}"
    );
    assert!(s.revision.is_none(), "{s}");
    assert!(gateway.targets(service).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_refresh_picks_up_a_change_before_the_interval() {
    let (upstreams, port) = upstreams_on_one_port(&["127.0.0.2", "127.0.0.3"]).await;
    // A TTL above the interval, so only the interval (60 s) schedules refreshes.
    let mut knot = Knot::start("api 3600 A 127.0.0.2");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"], "interval_ms": 60_000}),
            json!({}),
        ),
    )
    .await;
    let first = wait_status(&gateway, source, "healthy with 1 active", |s| {
        s.state == "healthy" && s.counts() == (1, 0, 0)
    })
    .await;
    let delay = ms(first.next_refresh_at.expect("next_refresh_at")
        - first.last_success_at.expect("last_success_at"));
    assert!(
        (54_000..=60_000).contains(&delay),
        "next refresh {delay} ms later; expected the 60 s interval less ≤10 % jitter"
    );

    // Knot serves a new record, but nothing refreshes until asked.
    knot.set("api", 3600, "A", "127.0.0.3");
    assert_eq!(knot.query("api", "A").len(), 2);
    let refreshed_at = first.last_refresh_at;
    holds_for(
        "no refresh before it is asked for",
        Duration::from_millis(700),
        || {
            let gateway = &gateway;
            async move {
                let s = gateway.source_status(source).await;
                let found = gateway.targets(service).await;
                if s.last_refresh_at == refreshed_at && found.len() == 1 {
                    Ok(())
                } else {
                    Err(format!("{s} / {found:?}"))
                }
            }
        },
    )
    .await;

    // Stored times have millisecond precision.
    let asked_at = DateTime::from_timestamp_millis(Utc::now().timestamp_millis()).unwrap();
    let (code, answer) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        )
        .await;
    assert_eq!(code, 202, "{answer}");
    // The answer is the current status (every field read, so all are there).
    let answer = SourceStatus::read(answer);
    assert_eq!(answer.source_id, source, "{answer}");
    assert_eq!(answer.state, "healthy", "the current status: {answer}");
    let s = wait_status(&gateway, source, "2 active after the forced refresh", |s| {
        s.counts() == (2, 0, 0) && s.revision != first.revision
    })
    .await;
    assert!(
        s.last_refresh_at.expect("last_refresh_at") >= asked_at,
        "{s}"
    );
    let found = gateway.targets(service).await;
    assert!(
        in_state(&found, &key("127.0.0.3", port), "active"),
        "{found:?}"
    );
    wait_until("traffic reaches 127.0.0.3", WAIT, || async {
        fetch(&gateway, "/").await == upstreams[1].name
    })
    .await;

    // A request while a refresh runs joins it: one refresh, not two. (Knot is stopped so that
    // the refresh runs for its whole timeout; its query reaching the port shows it is running.)
    knot.stop();
    let refresh = format!("/api/v1/discovery-sources/{source}/refresh");
    let (code, answer) = gateway.api("POST", &refresh, None).await;
    assert_eq!(code, 202, "{answer}");
    wait_until("the forced refresh queries the server", WAIT, || async {
        match knot.swallowed_queries() {
            0 => Err("no query yet".to_owned()),
            _ => Ok(()),
        }
    })
    .await;
    let (code, answer) = gateway.api("POST", &refresh, None).await;
    assert_eq!(code, 202, "{answer}");
    let answer = SourceStatus::read(answer);
    assert_eq!(
        answer.state, "healthy",
        "the refresh has not finished: {answer}"
    );
    let failed = wait_status(&gateway, source, "the refresh failed", |s| {
        s.state == "failing"
    })
    .await;
    let refreshed_at = failed.last_refresh_at;
    holds_for(
        "no second refresh after the joined one",
        Duration::from_millis(3 * TIMEOUT_MS),
        || {
            let gateway = &gateway;
            async move {
                let s = gateway.source_status(source).await;
                if s.last_refresh_at == refreshed_at {
                    Ok(())
                } else {
                    Err(s.to_string())
                }
            }
        },
    )
    .await;

    let (code, answer) = gateway
        .api("POST", "/api/v1/discovery-sources/999999/refresh", None)
        .await;
    assert_eq!(code, 404, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disable_drains_enable_rediscovers_delete_removes_at_once() {
    let upstream = Upstream::start_on("up", "127.0.0.2:0".parse().unwrap()).await;
    let port = upstream.addr.port();
    let mut knot = Knot::start("api A 127.0.0.2");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let grace_ms: i64 = 800;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"]}),
            json!({"removal_grace_ms": grace_ms}),
        ),
    )
    .await;
    wait_status(&gateway, source, "healthy with 1 active", |s| {
        s.state == "healthy" && s.counts() == (1, 0, 0)
    })
    .await;
    next_refresh(&gateway, source).await;
    assert_eq!(fetch(&gateway, "/").await, "up");
    let path = format!("/api/v1/discovery-sources/{source}");

    // Disabled: no refreshes, no next refresh, its targets drain (no new traffic at once) and
    // are deleted after the grace.
    let (code, body) = gateway
        .api("PATCH", &path, Some(json!({"enabled": false})))
        .await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(body["enabled"], false);
    let disabled_at = Utc::now();
    let s = gateway.source_status(source).await;
    assert!(s.state == "disabled", "{s}");
    assert!(s.next_refresh_at.is_none(), "{s}");
    assert_eq!(s.counts(), (0, 1, 0), "{s}");
    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].state, "draining");
    let ahead = ms(found[0].remove_at.expect("remove_at") - disabled_at);
    assert!(
        (grace_ms - 500..=grace_ms + 100).contains(&ahead),
        "remove_at {ahead} ms ahead, expected ≈ {grace_ms}"
    );
    assert_no_available_target(&gateway, "/").await;
    let (code, body) = gateway.api("POST", &format!("{path}/refresh"), None).await;
    assert_eq!(code, 409, "a disabled source does not refresh: {body}");
    let last_refresh = s.last_refresh_at;
    wait_targets(&gateway, service, "the target deleted", |t| t.is_empty()).await;
    let s = gateway.source_status(source).await;
    assert!(s.state == "disabled", "{s}");
    assert_eq!(
        s.last_refresh_at, last_refresh,
        "no refresh while disabled: {s}"
    );
    assert_eq!(s.counts(), (0, 0, 0), "{s}");

    // Enabled again: pending until its first refresh finishes, then healthy with the target
    // back. (Knot is stopped meanwhile so that the first refresh cannot finish at once and
    // `pending` is observable.)
    knot.stop();
    let (code, body) = gateway
        .api("PATCH", &path, Some(json!({"enabled": true})))
        .await;
    assert_eq!(code, 200, "{body}");
    let s = gateway.source_status(source).await;
    assert!(s.state == "pending", "{s}");
    assert!(s.next_refresh_at.is_some(), "{s}");
    knot.restart();
    let s = wait_status(&gateway, source, "healthy with 1 active", |s| {
        s.state == "healthy" && s.counts() == (1, 0, 0)
    })
    .await;
    assert!(s.next_refresh_at.is_some(), "{s}");
    let found = gateway.targets(service).await;
    assert!(
        in_state(&found, &key("127.0.0.2", port), "active"),
        "{found:?}"
    );
    next_refresh(&gateway, source).await;
    assert_eq!(fetch(&gateway, "/").await, "up");

    // Deleted: its targets go at once.
    let (code, body) = gateway.api("DELETE", &path, None).await;
    assert_eq!(code, 204, "{body}");
    assert!(gateway.targets(service).await.is_empty());
    assert_no_available_target(&gateway, "/").await;
    let (code, _) = gateway.api("GET", &format!("{path}/status"), None).await;
    assert_eq!(code, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_ttl_refreshes_before_the_interval_with_a_floor() {
    let (upstreams, port) = upstreams_on_one_port(&["127.0.0.2", "127.0.0.3"]).await;
    let knot = Knot::start("api 1 A 127.0.0.2\nzero 0 A 127.0.0.2");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"], "interval_ms": 60_000}),
            json!({}),
        ),
    )
    .await;
    let s = wait_status(&gateway, source, "healthy with 1 active", |s| {
        s.state == "healthy" && s.counts() == (1, 0, 0)
    })
    .await;
    let delay =
        ms(s.next_refresh_at.expect("next_refresh_at")
            - s.last_success_at.expect("last_success_at"));
    assert!(
        (900..=1_000).contains(&delay),
        "TTL 1 s: next refresh {delay} ms later, expected 1 s less ≤10 % jitter"
    );

    // A change is picked up within a few seconds, without a forced refresh.
    knot.set("api", 1, "A", "127.0.0.3");
    let found = wait_until(
        "127.0.0.3 discovered by the TTL",
        Duration::from_secs(4),
        || async {
            let found = gateway.targets(service).await;
            if in_state(&found, &key("127.0.0.3", port), "active") {
                Ok(found)
            } else {
                Err(common::api::Targets(&found).to_string())
            }
        },
    )
    .await;
    assert_eq!(found.len(), 2, "{found:?}");
    wait_until("traffic reaches 127.0.0.3", WAIT, || async {
        fetch(&gateway, "/").await == upstreams[1].name
    })
    .await;

    // TTL 0 does not spin: the floor (1 s) applies.
    let zero = service_at(&gateway, "zero", "/zero").await;
    let source = add_source(
        &gateway,
        zero,
        source_body(
            "zero",
            "dns",
            &knot,
            json!({"hostname": "zero.svc.test", "port": port, "record_types": ["a"], "interval_ms": 60_000}),
            json!({}),
        ),
    )
    .await;
    let first = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let delay = ms(first.next_refresh_at.expect("next_refresh_at")
        - first.last_success_at.expect("last_success_at"));
    assert!(
        (900..=1_000).contains(&delay),
        "TTL 0: next refresh {delay} ms later, expected the 1 s floor less ≤10 % jitter"
    );
    let second = next_refresh(&gateway, source).await;
    let gap = ms(second.last_refresh_at.expect("last_refresh_at")
        - first.last_refresh_at.expect("last_refresh_at"));
    assert!(gap >= 850, "refreshes {gap} ms apart with TTL 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_serves_the_last_known_good_targets_and_keeps_drain_deadlines() {
    let (upstreams, port) = upstreams_on_one_port(&["127.0.0.2", "127.0.0.3"]).await;
    let mut knot = Knot::start("api A 127.0.0.2\napi A 127.0.0.3");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"]}),
            json!({"removal_grace_ms": 3_000}),
        ),
    )
    .await;
    wait_status(&gateway, source, "healthy with 2 active", |s| {
        s.state == "healthy" && s.counts() == (2, 0, 0)
    })
    .await;
    knot.unset("api", "A", "127.0.0.3");
    let found = wait_targets(&gateway, service, "127.0.0.3 draining", |t| {
        in_state(t, &key("127.0.0.3", port), "draining")
    })
    .await;
    let before = next_refresh(&gateway, source).await;
    let draining = find(&found, &key("127.0.0.3", port)).unwrap().clone();
    let active = find(&found, &key("127.0.0.2", port)).unwrap().clone();

    // No refresh can succeed after the restart.
    knot.stop();
    let gateway = gateway.restart().await;
    assert_eq!(
        fetch(&gateway, "/").await,
        upstreams[0].name,
        "the first request after a restart is served from the stored targets"
    );
    let answers = spread(&gateway, "/", 10, 2).await;
    assert_eq!(hits(&answers, &upstreams[0]), 10, "{answers:?}");

    let found = gateway.targets(service).await;
    let still_draining = find(&found, &key("127.0.0.3", port)).expect("the draining target");
    assert_eq!(still_draining.state, "draining");
    assert_eq!(id_of(still_draining), id_of(&draining));
    assert_eq!(
        still_draining.remove_at.expect("remove_at"),
        draining.remove_at.expect("remove_at"),
        "the drain deadline survives the restart"
    );
    let still_active = find(&found, &key("127.0.0.2", port)).expect("the active target");
    assert_eq!(still_active.state, "active");
    assert_eq!(id_of(still_active), id_of(&active));
    let after = gateway.source_status(source).await;
    assert_eq!(after.revision, before.revision, "{after}");
    assert_eq!(after.last_success_at, before.last_success_at, "{after}");

    // The restored deadline is kept: the target is deleted when it comes, not before.
    let remove_at = draining.remove_at.expect("remove_at");
    assert!(
        remove_at > Utc::now(),
        "the restart took longer than the removal grace; the test needs a longer grace"
    );
    wait_targets(&gateway, service, "the draining target deleted", |t| {
        find(t, &key("127.0.0.3", port)).is_none()
    })
    .await;
    let early = ms(remove_at - Utc::now());
    assert!(early <= 50, "deleted {early} ms before its remove_at");
    let answers = spread(&gateway, "/", 10, 2).await;
    assert_eq!(hits(&answers, &upstreams[0]), 10, "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_and_discovered_targets_coexist_and_discovered_ones_are_read_only() {
    let operator_upstream = Upstream::start("operator").await;
    let discovered_upstream =
        Upstream::start_on("discovered", "127.0.0.2:0".parse().unwrap()).await;
    let port = discovered_upstream.addr.port();
    let knot = Knot::start("api A 127.0.0.2");
    let gateway = TestGateway::start().await;
    let service = service_at(&gateway, "api", "/").await;
    let operator_id = gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            target(&operator_upstream, 100, 0),
        )
        .await;
    let source = add_source(
        &gateway,
        service,
        source_body(
            "api-dns",
            "dns",
            &knot,
            json!({"hostname": "api.svc.test", "port": port, "record_types": ["a"]}),
            json!({"removal_grace_ms": 500}),
        ),
    )
    .await;
    let found = wait_targets(&gateway, service, "the discovered target", |t| {
        in_state(t, &key("127.0.0.2", port), "active")
    })
    .await;
    assert_eq!(found.len(), 2, "{found:?}");
    let operator = found.iter().find(|t| id_of(t) == operator_id).unwrap();
    assert!(
        operator.source_id.is_none() && operator.provider_key.is_none(),
        "{operator}"
    );
    let discovered = find(&found, &key("127.0.0.2", port)).unwrap().clone();
    let discovered_id = id_of(&discovered);
    next_refresh(&gateway, source).await;
    let answers = spread(&gateway, "/", 20, 2).await;
    assert_eq!(hits(&answers, &operator_upstream), 10, "{answers:?}");
    assert_eq!(hits(&answers, &discovered_upstream), 10, "{answers:?}");

    // A discovered target is read-only: 409 naming its source; it stays as it was.
    let path = format!("/api/v1/targets/{discovered_id}");
    let spec = json!({"host": "127.0.0.9", "port": 1});
    for (method, body) in [
        ("PATCH", Some(json!({"weight": 1}))),
        ("PUT", Some(spec)),
        ("DELETE", None),
    ] {
        let (code, answer) = gateway.api(method, &path, body).await;
        assert_eq!(code, 409, "{method} {path}: {answer}");
        let error = ApiError::read(&answer);
        assert_eq!(error.code, "conflict", "{answer}");
        let message = error.message;
        assert!(
            message.contains(&format!("discovery source {source}")),
            "{method}: the message names the owning source: {message}"
        );
    }
    let (code, unchanged) = gateway.api("GET", &path, None).await;
    assert_eq!(code, 200);
    assert_eq!(unchanged["weight"], discovered.weight);
    assert_eq!(unchanged["host"], "127.0.0.2");

    // The operator's own target stays writable.
    let (code, answer) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/targets/{operator_id}"),
            Some(json!({"weight": 300})),
        )
        .await;
    assert_eq!(code, 200, "{answer}");

    // Discovery leaves the operator target alone when its records go away...
    knot.unset("api", "A", "127.0.0.2");
    wait_targets(&gateway, service, "the discovered target deleted", |t| {
        t.len() == 1 && id_of(&t[0]) == operator_id
    })
    .await;
    let found = gateway.targets(service).await;
    assert_eq!(found[0].state, "active", "{found:?}");
    assert_eq!(found[0].weight, 300, "{found:?}");
    let answers = spread(&gateway, "/", 10, 1).await;
    assert_eq!(hits(&answers, &operator_upstream), 10, "{answers:?}");

    // ...and when its source is deleted.
    knot.set("api", 1, "A", "127.0.0.2");
    wait_targets(&gateway, service, "rediscovered", |t| t.len() == 2).await;
    let (code, _) = gateway
        .api(
            "DELETE",
            &format!("/api/v1/discovery-sources/{source}"),
            None,
        )
        .await;
    assert_eq!(code, 204);
    let found = gateway.targets(service).await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(id_of(&found[0]), operator_id);
    let answers = spread(&gateway, "/", 10, 1).await;
    assert_eq!(hits(&answers, &operator_upstream), 10, "{answers:?}");
}

// ---------------------------------------------------------------------------------------------
// Provider descriptors and config validation
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn dns_providers_describe_their_schema_and_defaults() {
    let gateway = TestGateway::start().await;
    let (code, providers) = gateway
        .api("GET", "/api/v1/discovery/providers", None)
        .await;
    assert_eq!(code, 200, "{providers}");
    let providers = providers.as_array().expect("a list of providers").clone();
    let by_name = |name: &str| {
        providers
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("provider {name} listed"))
            .clone()
    };
    let dns = by_name("dns");
    for (key, value) in [
        ("record_types", json!(["a", "aaaa"])),
        ("interval_ms", json!(30_000)),
        ("timeout_ms", json!(5_000)),
        ("weight", json!(100)),
        ("priority", json!(0)),
    ] {
        assert_eq!(dns["defaults"][key], value, "dns default {key}: {dns}");
    }
    let required = dns["config_schema"]["required"].as_array().unwrap();
    assert!(
        required.contains(&json!("hostname")) && required.contains(&json!("port")),
        "{dns}"
    );
    let srv = by_name("dns-srv");
    for (key, value) in [
        ("use_record_weight", json!(true)),
        ("use_record_priority", json!(true)),
        ("interval_ms", json!(30_000)),
        ("timeout_ms", json!(5_000)),
    ] {
        assert_eq!(srv["defaults"][key], value, "dns-srv default {key}: {srv}");
    }
    let required = srv["config_schema"]["required"].as_array().unwrap();
    assert!(required.contains(&json!("service_name")), "{srv}");

    // dns needs a port (address records carry none); a bad resolver is named.
    let service = gateway
        .create("/api/v1/services", json!({"name": "api"}))
        .await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    for (config, field) in [
        (json!({"hostname": "api.svc.test"}), "config.port"),
        (
            json!({"hostname": "api.svc.test", "port": 80, "resolver": "not an address"}),
            "config.resolver",
        ),
        (json!({"resolver": "127.0.0.1:53"}), "config.service_name"),
    ] {
        let provider = if field == "config.service_name" {
            "dns-srv"
        } else {
            "dns"
        };
        let (code, answer) = gateway
            .api(
                "POST",
                &path,
                Some(json!({"name": "bad", "provider": provider, "config": config})),
            )
            .await;
        assert_eq!(code, 422, "{config}: {answer}");
        assert_eq!(
            ApiError::read(&answer).field.as_deref(),
            Some(field),
            "{answer}"
        );
    }

    // A created source shows its config with every default filled in, and the source defaults.
    let (code, created) = gateway
        .api(
            "POST",
            &path,
            Some(
                json!({"name": "ok", "provider": "dns-srv", "enabled": false,
                        "config": {"service_name": "_http._tcp.api.svc.test"}}),
            ),
        )
        .await;
    assert_eq!(code, 201, "{created}");
    assert_eq!(created["config"]["use_record_weight"], true, "{created}");
    assert_eq!(created["config"]["use_record_priority"], true, "{created}");
    assert_eq!(created["config"]["interval_ms"], 30_000, "{created}");
    assert_eq!(created["stale_after_ms"], 300_000, "{created}");
    assert_eq!(created["removal_grace_ms"], 60_000, "{created}");
}
