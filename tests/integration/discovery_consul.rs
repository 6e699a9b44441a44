//! Consul discovery through real sockets (DESIGN.md §4, watch rules and the Consul mapping): a
//! gateway in-process watches a faithful fake of Consul's HTTP API (`common::consul`) with
//! blocking queries, and its data path follows registrations, deregistrations and check changes
//! within a second; an unchanging catalog costs about one request per wait; a Consul outage is
//! a failed refresh like any registry's (failing, stale, back); index resets, silent
//! connections and refused tokens are handled; with two gateways on PostgreSQL only the lease
//! holder watches.

use crate::common;
use crate::common::postgres;

use common::consul::{ConsulFake, Instance};
use common::*;

use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
/// How fast a catalog change must reach the data path (the goal).
const PROPAGATION: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// A `consul` source on `fake` for service `web`, with `extra` merged into its config.
fn consul_source(fake: &ConsulFake, extra: Value) -> Value {
    let mut config = json!({
        "address": fake.url(),
        "service": "web",
        "wait_ms": 10_000,
        "timeout_ms": 500,
    });
    for (key, value) in extra.as_object().expect("an object") {
        config[key] = value.clone();
    }
    json!({
        "name": "consul",
        "provider": "consul",
        "config": config,
        "stale_after_ms": 600_000,
        "removal_grace_ms": 500,
    })
}

/// A service `web` with a catch-all route and a consul source; returns (service, source).
async fn consul_service(gateway: &TestGateway, fake: &ConsulFake, extra: Value) -> (i64, i64) {
    consul_service_with(gateway, consul_source(fake, extra)).await
}

async fn consul_service_with(gateway: &TestGateway, source: Value) -> (i64, i64) {
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            source,
        )
        .await;
    (service, source)
}

fn instance_of(upstream: &Upstream, node: &str) -> Instance {
    let mut instance = Instance::new("web", upstream.addr.port());
    instance.node = node.to_owned();
    instance
}

/// Status and body of a GET through the proxy (status 0 when it does not answer).
async fn fetch(gateway: &TestGateway) -> (u16, String) {
    gateway.fetch_status("/").await
}

/// Fetches until the proxy answers `body` `times` times in a row; returns how long that took.
async fn wait_serving(
    gateway: &TestGateway,
    body: &str,
    times: usize,
    within: Duration,
) -> Duration {
    let started = Instant::now();
    let what = format!("the proxy to serve {body:?} {times} times in a row");
    wait_until(&what, within, || async {
        // One burst of back-to-back requests; the first other answer ends it.
        for _ in 0..times {
            let (status, got) = fetch(gateway).await;
            if status != 200 || got != body {
                return Err(format!("it answers {status}: {got}"));
            }
        }
        Ok(started.elapsed())
    })
    .await
}

/// Waits until the watch blocks at the catalog's current index, so the next change wakes it at
/// once (a change within a second of the watch's last request waits for the next one).
async fn wait_watching(fake: &ConsulFake) {
    wait_until("the watch blocks at the current index", WAIT, || async {
        fake.in_flight() == 1
            && fake.queries().last().and_then(|query| index_in(query)) == Some(fake.index())
    })
    .await;
}

/// Outcomes the control task received for `source` (each set reported is one reconcile).
fn applied(gateway: &TestGateway, source: i64) -> u64 {
    gateway
        .gateway
        .as_ref()
        .expect("running")
        .control
        .source_stats()
        .get(&source)
        .map(|stats| stats.refreshes.load(std::sync::atomic::Ordering::SeqCst))
        .unwrap_or(0)
}

/// The `index` a recorded query carried, if any.
fn index_in(query: &str) -> Option<u64> {
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix("index="))
        .map(|index| index.parse().expect("a numeric index"))
}

// ---------------------------------------------------------------------------------------------
// Following the catalog
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registrations_and_deregistrations_reach_the_data_path_within_a_second() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    fake.require_token(Some("s3cr3t-token"));
    fake.register(instance_of(&first, "node-a"));
    let (_, source) = consul_service(
        &gateway,
        &fake,
        json!({"token": "s3cr3t-token", "tags": [], "datacenter": "dc1"}),
    )
    .await;
    wait_serving(&gateway, "first", 1, WAIT).await;
    let status = wait_status(&gateway, source, "watch connected", |s| {
        s.watch_connected() == Some(true)
    })
    .await;
    assert_eq!(status.state, "healthy", "{status}");
    assert_eq!(status.next_refresh_at, None, "{status}");
    assert_eq!(status.endpoints.active, 1, "{status}");
    assert_eq!(status.last_error, None, "{status}");
    assert!(status.watch().since <= chrono::Utc::now(), "{status}");
    assert_eq!(
        status.watch().index,
        Some(fake.index().to_string()),
        "{status}"
    );
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains(
            "raahi_discovery_watch_connected{service=\"web\",source=\"consul\",provider=\"consul\"} 1"
        ),
        "{metrics}"
    );

    // The token travels in its header only; the query says dc and blocks with index and wait.
    assert_eq!(
        fake.last_headers()["x-consul-token"],
        "s3cr3t-token",
        "the ACL token header"
    );
    let queries = fake.queries();
    assert!(queries.iter().all(|q| !q.contains("s3cr3t")), "{queries:?}");
    assert_eq!(
        index_in(&queries[0]),
        None,
        "the first read is plain: {queries:?}"
    );
    wait_until("a blocking query is open", WAIT, || async {
        fake.in_flight() == 1 && fake.blocking_requests() >= 1
    })
    .await;
    let blocking = fake.queries().last().cloned().unwrap();
    assert!(blocking.contains("dc=dc1"), "{blocking}");
    assert!(blocking.contains("wait=10000ms"), "{blocking}");
    assert_eq!(index_in(&blocking), Some(fake.index()), "{blocking}");

    // A second instance registers: it takes traffic within a second, though nothing polls.
    let registered = Instant::now();
    fake.register(instance_of(&second, "node-b"));
    let mut seen_second = false;
    while !seen_second {
        seen_second = fetch(&gateway).await.1 == "second";
        assert!(
            registered.elapsed() < PROPAGATION,
            "the registration did not reach the data path within {PROPAGATION:?}"
        );
    }
    // The watch asks again (at most once a second) and blocks...
    wait_watching(&fake).await;
    // The first deregisters: within a second it gets no new request.
    let deregistered = Instant::now();
    fake.deregister("node-a", &format!("web-{}", first.addr.port()));
    wait_serving(&gateway, "second", 20, PROPAGATION).await;
    assert!(deregistered.elapsed() < PROPAGATION);
    let status = wait_status(&gateway, source, "one draining", |s| {
        s.endpoints.draining == 1 || s.endpoints.active == 1
    })
    .await;
    assert_eq!(status.endpoints.active, 1, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_critical_check_drains_the_instance_and_a_passing_one_brings_it_back() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    fake.register(instance_of(&first, "node-a"));
    fake.register(instance_of(&second, "node-b"));
    // A long grace, so the drained target is still there to be looked at.
    let mut body = consul_source(&fake, json!({}));
    body["removal_grace_ms"] = json!(60_000);
    let (service, source) = consul_service_with(&gateway, body).await;
    wait_status(&gateway, source, "two active", |s| s.endpoints.active == 2).await;
    let second_id = format!("web-{}", second.addr.port());

    wait_watching(&fake).await;
    fake.set_check("node-b", &second_id, "critical");
    wait_serving(&gateway, "first", 20, PROPAGATION).await;
    let key = format!("node-b/{second_id}");
    let drained = gateway
        .targets(service)
        .await
        .into_iter()
        .find(|target| target.provider_key.as_deref() == Some(key.as_str()))
        .expect("the critical instance is still listed while it drains");
    assert_eq!(drained.state, "draining", "{drained}");

    // Passing again: back in rotation, as the same target.
    fake.set_check("node-b", &second_id, "passing");
    wait_serving(&gateway, "second", 1, PROPAGATION * 3).await;

    // Maintenance mode is a critical check too.
    fake.set_check("node-b", &second_id, "maintenance");
    wait_serving(&gateway, "first", 20, PROPAGATION * 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warning_instances_take_their_warning_weight_unless_passing_only() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    let mut warned = instance_of(&first, "node-a");
    warned.check_status = "warning".to_owned();
    warned.weights = (5, 2);
    warned.tags = vec!["blue".to_owned(), "v2".to_owned()];
    warned.meta.insert("version".to_owned(), "2".to_owned());
    fake.register(warned);
    let (service, source) = consul_service(
        &gateway,
        &fake,
        json!({"passing_only": false, "tags": ["blue", "v2"], "priority": 3}),
    )
    .await;
    wait_serving(&gateway, "first", 1, WAIT).await;
    let targets = gateway.targets(service).await;
    let target = &targets[0];
    assert_eq!(target.source_id, Some(source));
    assert_eq!(
        target.weight, 200,
        "Weights.Warning 2, scaled ×100: {target}"
    );
    assert_eq!(target.priority, 3, "{target}");
    assert_eq!(target.host, "127.0.0.1", "{target}");
    assert_eq!(target.metadata["status"], "warning", "{target}");
    assert_eq!(target.metadata["node"], "node-a", "{target}");
    assert_eq!(target.metadata["datacenter"], "dc1", "{target}");
    assert_eq!(target.metadata["tags"], json!(["blue", "v2"]), "{target}");
    assert_eq!(target.metadata["meta"], json!({"version": "2"}), "{target}");
    let queries = fake.queries();
    assert!(
        queries[0].contains("tag=blue") && queries[0].contains("tag=v2"),
        "every tag is sent: {queries:?}"
    );
    assert!(
        !queries[0].contains("passing"),
        "check statuses are judged by Raahi: {queries:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_address_is_refused_by_name_not_dropped_silently() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let mut named = Instance::new("web", 8443);
    named.node = "node-z".to_owned();
    named.address = "web.internal".to_owned();
    fake.register(named);
    let (_, source) = consul_service(&gateway, &fake, json!({})).await;
    let status = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("left out 1 of 2 instances: node-z/web-8443")
            && error.contains("\"web.internal\" is not an IP address"),
        "{status}"
    );
    wait_serving(&gateway, "first", 5, WAIT).await;
}

// ---------------------------------------------------------------------------------------------
// The watch's own rules
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanging_catalog_costs_one_request_per_wait_and_no_reconcile() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let wait_ms = 2_000;
    let (_, source) = consul_service(&gateway, &fake, json!({"wait_ms": wait_ms})).await;
    let settled = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let started = Instant::now();
    let before = fake.requests();

    // Index bumps that leave the set as it was: answered, never reconciled.
    fake.touch();
    fake.touch();
    // A counting window, not a wait for something to settle: the rate is what is measured.
    tokio::time::sleep(Duration::from_millis(6_500)).await;
    let elapsed = started.elapsed();
    let made = fake.requests() - before;
    eprintln!("unchanging catalog, wait_ms {wait_ms}: {made} requests in {elapsed:?}");
    // One per wait (plus Consul's jitter), plus one per touch at most.
    let bound = 2 + (elapsed.as_millis() as usize).div_ceil(wait_ms) + 1;
    assert!(
        made <= bound,
        "{made} requests in {elapsed:?} (bound {bound})"
    );
    assert!(made >= 2, "the watch kept asking: {made}");
    let now = gateway.source_status(source).await;
    assert_eq!(
        now.last_refresh_at, settled.last_refresh_at,
        "an identical set is not reconciled again: {now}"
    );

    // A server that answers at once with the same index cannot make it spin: one a second.
    fake.answer_at_once(true);
    let before = fake.requests();
    let started = Instant::now();
    // Again a counting window.
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let made = fake.requests() - before;
    eprintln!(
        "non-blocking server: {made} requests in {:?}",
        started.elapsed()
    );
    let bound = 2 + started.elapsed().as_secs() as usize;
    assert!(
        made <= bound,
        "{made} requests in 3.5 s against a non-blocking server"
    );
    assert!(made >= 2, "{made}");
    let now = gateway.source_status(source).await;
    assert_eq!(now.last_refresh_at, settled.last_refresh_at, "{now}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_changes_is_read_as_one_set() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let upstreams = [
        Upstream::start("u0").await,
        Upstream::start("u1").await,
        Upstream::start("u2").await,
        Upstream::start("u3").await,
        Upstream::start("u4").await,
    ];
    fake.register(instance_of(&upstreams[0], "node-0"));
    let (_, source) = consul_service(&gateway, &fake, json!({})).await;
    let first = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let refreshes_before = fake.requests();
    let applied_before = applied(&gateway, source);
    // Let the watch block, then register four instances in one burst.
    wait_until("a blocking query is open", WAIT, || async {
        fake.in_flight() == 1
    })
    .await;
    for (index, upstream) in upstreams.iter().enumerate().skip(1) {
        fake.register(instance_of(upstream, &format!("node-{index}")));
    }
    // The status reads progress and counts one after the other: wait for both.
    wait_status(&gateway, source, "five active", |s| {
        s.endpoints.active == 5 && s.revision != first.revision
    })
    .await;
    // The first change wakes the blocked query; the rest wait for the next request a second
    // later and arrive together: two reads after the one that was blocked, not four.
    assert!(
        fake.requests() - refreshes_before <= 3,
        "{} requests for a burst of 4",
        fake.requests() - refreshes_before
    );
    let reconciles = applied(&gateway, source) - applied_before;
    assert!(reconciles <= 2, "{reconciles} reconciles for a burst of 4");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_that_goes_backwards_starts_over_with_a_plain_read() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    fake.register(instance_of(&first, "node-a"));
    for _ in 0..50 {
        fake.touch();
    }
    let high = fake.index();
    let (_, source) = consul_service(&gateway, &fake, json!({})).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("a blocking query at the high index", WAIT, || async {
        fake.in_flight() == 1 && fake.queries().last().and_then(|q| index_in(q)) == Some(high)
    })
    .await;
    let asked_before = fake.queries().len();

    // A snapshot restore: the index drops to 3; the blocked query answers at once.
    fake.reset_index(3);
    wait_until("the client reads plainly after the reset", WAIT, || async {
        fake.queries().len() > asked_before + 1
    })
    .await;
    let queries = fake.queries();
    let after: Vec<Option<u64>> = queries[asked_before..]
        .iter()
        .map(|q| index_in(q))
        .collect();
    assert_eq!(
        after[0], None,
        "the read after the backwards jump has no index: {queries:?}"
    );
    assert!(
        after
            .iter()
            .flatten()
            .all(|index| *index < high && *index >= 1),
        "no stale index is sent again: {after:?}"
    );

    // It keeps following the catalog from the new index.
    fake.register(instance_of(&second, "node-b"));
    wait_serving(&gateway, "second", 1, WAIT).await;
    let status = gateway.source_status(source).await;
    assert_eq!(
        status.watch().index,
        Some(fake.index().to_string()),
        "{status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_of_zero_is_sent_back_as_one() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    fake.reset_index(0);
    let (_, source) = consul_service(&gateway, &fake, json!({"wait_ms": 1_000})).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("two blocking queries", WAIT, || async {
        fake.blocking_requests() >= 2
    })
    .await;
    let queries = fake.queries();
    assert!(
        queries
            .iter()
            .filter_map(|q| index_in(q))
            .all(|index| index >= 1),
        "index 0 (do not block) is never sent: {queries:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_silent_past_its_wait_is_detected_and_reconnected() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let (_, source) = consul_service(
        &gateway,
        &fake,
        json!({"wait_ms": 1_000, "timeout_ms": 300}),
    )
    .await;
    wait_status(&gateway, source, "connected", |s| {
        s.watch_connected() == Some(true)
    })
    .await;
    fake.hang(true);
    let hung = Instant::now();
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    // The request under way when the fake went silent is given wait + wait/16 + timeout_ms
    // (1362 ms) from its start; one started after may wait up to a second (the spacing) first.
    // Twice that is a bound a dead connection's detection cannot reach without the deadline.
    let longest_request = Duration::from_millis(1_000 + 1_000 / 16 + 300);
    let bound = 2 * (longest_request + Duration::from_secs(1));
    assert!(
        hung.elapsed() < bound,
        "detected after {:?}",
        hung.elapsed()
    );
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains(&format!("{}/v1/health/service/web", fake.url()))
            && error.contains("no answer within"),
        "{status}"
    );
    assert_eq!(status.watch_connected(), Some(false), "{status}");
    assert!(
        status.next_refresh_at.is_some(),
        "a retry is scheduled: {status}"
    );
    // The last known good set keeps serving while failing.
    wait_serving(&gateway, "first", 3, WAIT).await;

    fake.hang(false);
    let status = wait_status(&gateway, source, "healthy and connected again", |s| {
        s.state == "healthy" && s.watch_connected() == Some(true)
    })
    .await;
    assert_eq!(status.last_error, None, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requested_refresh_restarts_the_watch_from_a_full_read() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let (_, source) = consul_service(&gateway, &fake, json!({})).await;
    let before = wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    wait_until("a blocking query is open", WAIT, || async {
        fake.in_flight() == 1 && fake.blocking_requests() >= 1
    })
    .await;
    let asked = fake.queries().len();
    let (status, body) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let after = wait_status(&gateway, source, "refreshed", |s| {
        s.last_refresh_at != before.last_refresh_at
    })
    .await;
    assert_eq!(after.state, "healthy");
    let queries = fake.queries();
    assert_eq!(index_in(&queries[asked]), None, "a full read: {queries:?}");
    wait_until("the abandoned blocking query is closed", WAIT, || async {
        fake.in_flight() <= 1
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Outages and refusals
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_down_is_failing_then_stale_then_back() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let mut body = consul_source(&fake, json!({}));
    body["stale_after_ms"] = json!(2_500);
    let (_, source) = consul_service_with(&gateway, body).await;
    wait_serving(&gateway, "first", 1, WAIT).await;

    fake.stop();
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains(&format!("{}/v1/health/service/web", fake.url())),
        "{status}"
    );
    assert_eq!(status.watch_connected(), Some(false), "{status}");
    // Failing: the last known good set keeps serving.
    wait_serving(&gateway, "first", 3, WAIT).await;

    let status = wait_status(&gateway, source, "stale", |s| s.state == "stale").await;
    assert_eq!(status.endpoints.stale, 1, "{status}");
    wait_until("a stale source's targets take no traffic", WAIT, || async {
        let (status, body) = fetch(&gateway).await;
        if status == 503 {
            Ok(())
        } else {
            Err(format!("the proxy answers {status}: {body}"))
        }
    })
    .await;

    // Back at the next retry: the backoff has doubled a few times by now (1, 2, 4, 8 s).
    fake.restart().await;
    let status = gateway
        .wait_source_status(source, "healthy", 2 * WAIT, |s| s.state == "healthy")
        .await;
    assert_eq!(status.endpoints.active, 1, "{status}");
    assert_eq!(status.watch_connected(), Some(true), "{status}");
    wait_serving(&gateway, "first", 3, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_and_a_server_error_are_failed_refreshes_that_keep_the_last_set() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let (_, source) = consul_service(&gateway, &fake, json!({"token": "old-token"})).await;
    wait_serving(&gateway, "first", 1, WAIT).await;

    // The token is revoked: the next answer is 403.
    fake.require_token(Some("new-token"));
    fake.touch();
    let status = wait_status(&gateway, source, "failing", |s| s.state == "failing").await;
    let error = status.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains("answered HTTP 403: ACL not found"),
        "{status}"
    );
    assert!(!error.contains("old-token"), "{status}");
    wait_serving(&gateway, "first", 3, WAIT).await;

    // Fixed through the API: the new config reconnects.
    let (code, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/discovery-sources/{source}"),
            Some(json!({"config": {"token": "new-token"}})),
        )
        .await;
    assert_eq!(code, StatusCode::OK, "{body}");
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;

    fake.fail_with(Some((500, "rpc error: No cluster leader".to_owned())));
    let status = wait_status(&gateway, source, "failing on 500", |s| s.state == "failing").await;
    assert!(
        status
            .last_error
            .as_deref()
            .unwrap_or_default()
            .contains("answered HTTP 500: rpc error: No cluster leader"),
        "{status}"
    );
    wait_serving(&gateway, "first", 3, WAIT).await;
    fake.fail_with(None);
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consul_over_https_is_verified_against_ca_pem() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start_tls().await;
    let first = Upstream::start("first").await;
    fake.register(instance_of(&first, "node-a"));
    let ca_pem = fake.ca_pem.clone().expect("the fake's certificate");
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    gateway.route_all_to(service).await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    let mut sources = Vec::new();
    for (name, extra) in [
        ("trusted", json!({"ca_pem": ca_pem})),
        ("untrusted", json!({})),
        ("unverified", json!({"tls_verify": false})),
    ] {
        let mut body = consul_source(&fake, extra);
        body["name"] = json!(name);
        sources.push(gateway.create(&path, body).await);
    }
    let trusted = wait_status(&gateway, sources[0], "healthy", |s| s.state == "healthy").await;
    assert_eq!(trusted.watch_connected(), Some(true), "{trusted}");
    let untrusted = wait_status(&gateway, sources[1], "failing", |s| s.state == "failing").await;
    let error = untrusted.last_error.as_deref().unwrap_or_default();
    assert!(
        error.contains(&fake.url()) && error.to_lowercase().contains("certificate"),
        "{untrusted}"
    );
    wait_status(&gateway, sources[2], "healthy", |s| s.state == "healthy").await;
    wait_serving(&gateway, "first", 3, WAIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_consul_configs_are_refused_by_field() {
    let gateway = TestGateway::start().await;
    let service = gateway
        .create("/api/v1/services", json!({"name": "web"}))
        .await;
    let path = format!("/api/v1/services/{service}/discovery-sources");
    for (config, field) in [
        (json!({}), "config.service"),
        (
            json!({"service": "web", "address": "consul:8500"}),
            "config.address",
        ),
        (json!({"service": "web", "wait_ms": 100}), "config.wait_ms"),
        (
            json!({"service": "web", "interval_ms": 1000}),
            "config.interval_ms",
        ),
        (
            json!({"service": "web", "consistency": "eventual"}),
            "config.consistency",
        ),
        (json!({"service": "web", "tags": [""]}), "config.tags[0]"),
    ] {
        let (status, body) = gateway
            .api(
                "POST",
                &path,
                Some(json!({"name": "c", "provider": "consul", "config": config})),
            )
            .await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{config}: {body}");
        assert_eq!(
            ApiError::read(&body).field.as_deref(),
            Some(field),
            "{config}: {body}"
        );
    }
    let created = gateway
        .create(
            &path,
            json!({"name": "c", "provider": "consul", "config": {"service": "web"}}),
        )
        .await;
    let (_, source) = gateway
        .api("GET", &format!("/api/v1/discovery-sources/{created}"), None)
        .await;
    assert_eq!(
        source["config"]["address"], "http://127.0.0.1:8500",
        "{source}"
    );
    assert_eq!(source["config"]["wait_ms"], 55_000, "{source}");
}

// ---------------------------------------------------------------------------------------------
// Several gateways on PostgreSQL
// ---------------------------------------------------------------------------------------------

const LEASE_MS: u64 = 1_500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_lease_holder_watches_and_a_survivor_takes_the_watch_over() {
    let database = postgres::fresh_database().await;
    let mut instances = Vec::new();
    for id in ["gw-a", "gw-b"] {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        instances.push(TestGateway::start_with(dir, cluster_config(&database, id, LEASE_MS)).await);
    }
    let b = instances.pop().unwrap();
    let a = instances.pop().unwrap();
    let fake = ConsulFake::start().await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    fake.register(instance_of(&first, "node-a"));
    let (_, source) = consul_service(&a, &fake, json!({})).await;
    wait_serving(&a, "first", 1, WAIT).await;
    wait_serving(&b, "first", 1, WAIT).await;
    let status = wait_status(&b, source, "connected, seen from the other instance", |s| {
        s.watch_connected() == Some(true) && s.refreshed_by.is_some()
    })
    .await;
    // Several lease rounds pass (a window in which the other instance would start a watch of
    // its own if it did): never more than one watch open.
    holds_for(
        "only the lease holder watching",
        Duration::from_millis(2 * LEASE_MS),
        || async {
            let most = fake.max_in_flight();
            if most <= 1 {
                Ok(())
            } else {
                Err(format!("{most} watches were open at once"))
            }
        },
    )
    .await;
    assert_eq!(fake.max_in_flight(), 1, "only the lease holder watches");
    wait_until("the holder's watch is open", WAIT, || async {
        fake.in_flight() == 1
    })
    .await;

    let (mut holder, survivor, survivor_id) = if status.refreshed_by.as_deref() == Some("gw-a") {
        (a, b, "gw-b")
    } else {
        (b, a, "gw-a")
    };
    holder.gateway.take().expect("running").abort();
    wait_until("the survivor holds the source", WAIT, || async {
        survivor.source_status(source).await.refreshed_by.as_deref() == Some(survivor_id)
    })
    .await;
    fake.register(instance_of(&second, "node-b"));
    fake.deregister("node-a", &format!("web-{}", first.addr.port()));
    wait_serving(&survivor, "second", 10, WAIT).await;
    wait_until("one watch open again", WAIT, || async {
        fake.in_flight() == 1
    })
    .await;
    // The takeover recorded the dead holder's watch as down; connected again is the survivor's.
    let status = wait_status(&survivor, source, "the survivor's watch connected", |s| {
        s.watch_connected() == Some(true)
    })
    .await;
    assert_eq!(
        status.refreshed_by.as_deref(),
        Some(survivor_id),
        "{status}"
    );
}

// ---------------------------------------------------------------------------------------------
// Measured: catalog change → data path
// ---------------------------------------------------------------------------------------------

/// Prints the median and the worst delay from a registration in the catalog to the first
/// request served by the new instance; each change comes while the watch blocks, so each is
/// read on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalog_changes_reach_the_data_path_fast() {
    let gateway = TestGateway::start().await;
    let fake = ConsulFake::start().await;
    let mut upstreams = Vec::new();
    for index in 0..6 {
        upstreams.push(Upstream::start(&format!("u{index}")).await);
    }
    fake.register(instance_of(&upstreams[0], "node-0"));
    let (_, source) = consul_service(&gateway, &fake, json!({})).await;
    wait_status(&gateway, source, "healthy", |s| s.state == "healthy").await;
    let mut delays = Vec::new();
    for (index, upstream) in upstreams.iter().enumerate().skip(1) {
        wait_watching(&fake).await;
        let changed = Instant::now();
        fake.register(instance_of(upstream, &format!("node-{index}")));
        let name = format!("u{index}");
        while fetch(&gateway).await.1 != name {
            assert!(
                changed.elapsed() < PROPAGATION,
                "{name} not served within {PROPAGATION:?}"
            );
        }
        delays.push(changed.elapsed());
    }
    delays.sort();
    let median = delays[delays.len() / 2];
    eprintln!(
        "consul change to data path: median {median:?}, worst {:?} over {} changes",
        delays[delays.len() - 1],
        delays.len()
    );
    assert!(
        delays.iter().all(|delay| *delay < PROPAGATION),
        "{delays:?}"
    );
}
