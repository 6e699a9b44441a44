//! Several gateway instances on one PostgreSQL database (issue 7), through real sockets: a change
//! made through one instance's admin API reaches every instance's data path within 1 s; each
//! discovery source is refreshed by one instance only (a lease), and its status names that
//! instance; when the refreshing instance stops, another takes the source over within two lease
//! periods; when PostgreSQL restarts under load, every instance keeps serving its last snapshot
//! and picks up changes made after the database is back.

use crate::common;
use crate::common::postgres;

use common::registry::Registry;
use common::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};

/// Longest wait for anything the instances do on their own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
/// How fast an admin change must reach every instance's data path.
const PROPAGATION: Duration = Duration::from_secs(1);
/// Short leases so a takeover test takes seconds, not the default quarter minute.
const LEASE_MS: u64 = 1_500;

/// Instances `gw-a` and `gw-b` on one database.
async fn two_instances(database_url: &str) -> (TestGateway, TestGateway) {
    let mut instances = Vec::new();
    for id in ["gw-a", "gw-b"] {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let config = cluster_config(database_url, id, LEASE_MS);
        instances.push(TestGateway::start_with(dir, config).await);
    }
    let second = instances.pop().expect("two instances");
    let first = instances.pop().expect("two instances");
    (first, second)
}

/// Status and body of a GET through an instance's proxy (status 0 when it does not answer).
async fn fetch(gateway: &TestGateway, path: &str) -> (u16, String) {
    gateway.fetch_status(path).await
}

async fn serves(gateway: &TestGateway, path: &str, body: &str) -> bool {
    fetch(gateway, path).await == (200, body.to_owned())
}

/// Refreshes this instance ran for `source` (its own counters, not the store's).
fn local_refreshes(gateway: &TestGateway, source: i64) -> u64 {
    gateway
        .gateway
        .as_ref()
        .expect("running")
        .control
        .source_stats()
        .get(&source)
        .map(|stats| stats.refreshes.load(Ordering::SeqCst))
        .unwrap_or(0)
}

fn registry_endpoint(key: &str, upstream: &Upstream) -> Value {
    json!({"key": key, "host": "127.0.0.1", "port": upstream.addr.port()})
}

/// A service with a catch-all route and an `http` source on `registry`, created through `via`.
async fn discovered_service(via: &TestGateway, registry: &Registry, interval_ms: u64) -> i64 {
    discovered_service_with_grace(via, registry, interval_ms, 500).await
}

/// [`discovered_service`] whose drained targets stay `grace_ms` before they are deleted.
async fn discovered_service_with_grace(
    via: &TestGateway,
    registry: &Registry,
    interval_ms: u64,
    grace_ms: u64,
) -> i64 {
    let service = via
        .create("/api/v1/services", json!({"name": "disc"}))
        .await;
    via.create(
        "/api/v1/routes",
        json!({"name": "disc-all", "service_id": service}),
    )
    .await;
    via.create(
        &format!("/api/v1/services/{service}/discovery-sources"),
        json!({
            "name": "registry",
            "provider": "http",
            "config": {"url": registry.url("/v1/endpoints"), "interval_ms": interval_ms, "timeout_ms": 500},
            "removal_grace_ms": grace_ms,
        }),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_made_through_one_instance_serves_on_the_other_within_a_second() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;

    let service = a
        .service_with_targets("web", &[target(&first, 100, 0)])
        .await;
    a.create(
        "/api/v1/routes",
        json!({"name": "web", "service_id": service, "path_prefix": "/web"}),
    )
    .await;
    let created = Instant::now();
    wait_until("b serves the route created on a", PROPAGATION, || {
        serves(&b, "/web", "first")
    })
    .await;
    assert!(created.elapsed() <= PROPAGATION);

    // The other way round, and a target change rather than a new route: b moves the traffic to
    // another upstream, a follows, reading only what the change log names.
    let full_reloads = reloads(&a, "full").await;
    let changed_reloads = reloads(&a, "changed").await;
    let (status, targets) = b
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{targets}");
    let old_target = targets["items"][0]["id"].as_i64().expect("a target id");
    b.create(
        &format!("/api/v1/services/{service}/targets"),
        target(&second, 100, 0),
    )
    .await;
    let (status, body) = b
        .api("DELETE", &format!("/api/v1/targets/{old_target}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    // Round robin alternates while both targets are there: four answers in a row from the new
    // one mean the deletion arrived too.
    wait_until(
        "a sends only to the target b added",
        PROPAGATION,
        || async {
            for _ in 0..4 {
                if !serves(&a, "/web", "second").await {
                    return false;
                }
            }
            true
        },
    )
    .await;
    // Every answer from a now comes from the new target only.
    let answers = spread(&a, "/web", 20, 4).await;
    assert_eq!(answers, HashMap::from([("second".to_owned(), 20)]));
    assert_eq!(reloads(&a, "full").await, full_reloads, "no whole reload");
    assert!(reloads(&a, "changed").await > changed_reloads);

    // Deleting the route on b stops it on a.
    let (_, routes) = b.api("GET", "/api/v1/routes", None).await;
    let route = routes["items"][0]["id"].as_i64().expect("a route id");
    let (status, body) = b
        .api("DELETE", &format!("/api/v1/routes/{route}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    wait_until(
        "a stops serving the route deleted on b",
        PROPAGATION,
        || async { fetch(&a, "/web").await.0 == 404 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_source_is_refreshed_by_one_instance_whose_status_names_it() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let registry = Registry::start().await;
    registry.set_json(json!([registry_endpoint("one", &first)]));

    let source = discovered_service(&a, &registry, 200).await;
    for instance in [&a, &b] {
        wait_until("both instances serve the discovered target", WAIT, || {
            serves(instance, "/", "first")
        })
        .await;
    }
    wait_until("the registry is asked a few times", WAIT, || async {
        registry.requests() >= 10
    })
    .await;

    // One instance ran every refresh the registry saw; the other ran none.
    let asked_before = registry.requests();
    let (by_a, by_b) = (local_refreshes(&a, source), local_refreshes(&b, source));
    let asked_after = registry.requests();
    assert!(
        (by_a == 0) != (by_b == 0),
        "exactly one instance refreshes: a ran {by_a}, b ran {by_b}"
    );
    let refreshed = by_a + by_b;
    // The registry counts a request on arrival, the instance when its answer is applied: at most
    // one refresh is between the two.
    assert!(
        refreshed as usize + 1 >= asked_before && refreshed as usize <= asked_after,
        "registry saw {asked_before}..{asked_after} requests, instances ran {refreshed} refreshes"
    );
    let (holder, other) = if by_a > 0 { (&a, &b) } else { (&b, &a) };
    let holder_id = if by_a > 0 { "gw-a" } else { "gw-b" };

    // Both instances' status names the refreshing instance.
    for instance in [&a, &b] {
        let status = instance.source_status(source).await;
        assert_eq!(status.refreshed_by.as_deref(), Some(holder_id), "{status}");
        assert_eq!(status.state, "healthy", "{status}");
    }

    // The result is written once and every instance serves it: a registry change reaches the
    // instance that does not refresh too.
    registry.set_json(json!([registry_endpoint("two", &second)]));
    wait_until(
        "the instance that does not refresh serves the new endpoint",
        WAIT,
        || serves(other, "/", "second"),
    )
    .await;
    wait_until("the refreshing instance serves it too", WAIT, || {
        serves(holder, "/", "second")
    })
    .await;
    assert_eq!(
        local_refreshes(other, source),
        0,
        "the other instance never refreshed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_takes_a_source_over_within_two_lease_periods() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let first = Upstream::start("first").await;
    let second = Upstream::start("second").await;
    let registry = Registry::start().await;
    registry.set_json(json!([registry_endpoint("one", &first)]));

    let source = discovered_service(&a, &registry, 200).await;
    let holder_id = wait_until("a source holder is named", WAIT, || async {
        a.source_status(source).await.refreshed_by
    })
    .await;
    let (mut holder, survivor, survivor_id) = if holder_id == "gw-a" {
        (a, b, "gw-b")
    } else {
        (b, a, "gw-a")
    };
    wait_until("the survivor serves the discovered target", WAIT, || {
        serves(&survivor, "/", "first")
    })
    .await;
    assert_eq!(local_refreshes(&survivor, source), 0);

    // The holder dies (no graceful shutdown, no goodbye): its lease runs out on its own.
    let stopped = Instant::now();
    holder.gateway.take().expect("running").abort();
    let takeover = Duration::from_millis(2 * LEASE_MS);
    wait_until(
        "the survivor takes the source over",
        takeover.saturating_sub(stopped.elapsed()),
        || async {
            survivor.source_status(source).await.refreshed_by.as_deref() == Some(survivor_id)
        },
    )
    .await;
    wait_until("the survivor refreshes the source", WAIT, || async {
        local_refreshes(&survivor, source) > 0
    })
    .await;

    // Its refreshes reach its data path: a registry change is served.
    registry.set_json(json!([registry_endpoint("two", &second)]));
    wait_until("the survivor serves the new endpoint", WAIT, || {
        serves(&survivor, "/", "second")
    })
    .await;
    assert_eq!(survivor.source_status(source).await.state, "healthy");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gracefully_stopped_instance_hands_its_sources_over_at_once() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let first = Upstream::start("first").await;
    let registry = Registry::start().await;
    registry.set_json(json!([registry_endpoint("one", &first)]));
    let source = discovered_service(&a, &registry, 200).await;
    let holder_id = wait_until("a source holder is named", WAIT, || async {
        a.source_status(source).await.refreshed_by
    })
    .await;
    let (mut holder, survivor, survivor_id) = if holder_id == "gw-a" {
        (a, b, "gw-b")
    } else {
        (b, a, "gw-a")
    };
    let stopping = Instant::now();
    holder.gateway.take().expect("running").shutdown().await;
    // The released lease is free at once: the survivor's next lease round (every third of a
    // lease) takes it, well before the lease could have expired.
    wait_until(
        "the survivor takes the released source over",
        Duration::from_millis(LEASE_MS * 2 / 3),
        || async {
            survivor.source_status(source).await.refreshed_by.as_deref() == Some(survivor_id)
        },
    )
    .await;
    assert!(stopping.elapsed() < Duration::from_millis(LEASE_MS));
    wait_until("the survivor refreshes the source", WAIT, || async {
        local_refreshes(&survivor, source) > 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refresh_asked_of_the_other_instance_is_run_by_the_holder() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let first = Upstream::start("first").await;
    let registry = Registry::start().await;
    registry.set_json(json!([registry_endpoint("one", &first)]));
    // A long interval: only the first refresh and the one asked for reach the registry.
    let source = discovered_service(&a, &registry, 600_000).await;
    wait_until("the first refresh", WAIT, || async {
        registry.requests() == 1 && a.source_status(source).await.state == "healthy"
    })
    .await;
    let holder_id = a
        .source_status(source)
        .await
        .refreshed_by
        .expect("a holder");
    let (holder, other) = if holder_id == "gw-a" {
        (&a, &b)
    } else {
        (&b, &a)
    };
    wait_until("the other instance knows the source", WAIT, || async {
        other
            .api("GET", &format!("/api/v1/discovery-sources/{source}"), None)
            .await
            .0
            == StatusCode::OK
    })
    .await;
    let (status, body) = other
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    wait_until("the holder refreshes on request", WAIT, || async {
        registry.requests() == 2 && local_refreshes(holder, source) == 2
    })
    .await;
    assert_eq!(local_refreshes(other, source), 0);
}

/// Requests through both instances in a loop until stopped; counts answers that are not 200.
struct Load {
    stop: Arc<AtomicBool>,
    served: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    failures: Arc<std::sync::Mutex<Vec<String>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(urls: Vec<String>, body: &'static str) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicUsize::new(0));
        let failed = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
        let client = reqwest::Client::new();
        let workers = (0..4)
            .map(|worker| {
                let (stop, served, failed, failures) = (
                    stop.clone(),
                    served.clone(),
                    failed.clone(),
                    failures.clone(),
                );
                let client = client.clone();
                let urls = urls.clone();
                tokio::spawn(async move {
                    let mut turn = worker;
                    while !stop.load(Ordering::SeqCst) {
                        let url = &urls[turn % urls.len()];
                        turn += 1;
                        let outcome = match client.get(url).send().await {
                            Ok(response) => {
                                let status = response.status().as_u16();
                                let text = response.text().await.unwrap_or_default();
                                (status == 200 && text == body)
                                    .then_some(())
                                    .ok_or(format!("{url}: {status} {text}"))
                            }
                            Err(error) => Err(format!("{url}: {error}")),
                        };
                        match outcome {
                            Ok(()) => served.fetch_add(1, Ordering::SeqCst),
                            Err(failure) => {
                                failures.lock().unwrap().push(failure);
                                failed.fetch_add(1, Ordering::SeqCst)
                            }
                        };
                    }
                })
            })
            .collect();
        Load {
            stop,
            served,
            failed,
            failures,
            workers,
        }
    }

    fn served(&self) -> usize {
        self.served.load(Ordering::SeqCst)
    }

    async fn finish(self) -> (usize, usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        for worker in self.workers {
            let _ = worker.await;
        }
        let failures = self.failures.lock().unwrap().clone();
        (
            self.served.load(Ordering::SeqCst),
            self.failed.load(Ordering::SeqCst),
            failures,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_serve_their_last_snapshot_while_postgres_restarts_and_recover() {
    // A private server: stopping the shared one would break the other tests.
    let cluster = tokio::task::spawn_blocking(postgres::Cluster::start)
        .await
        .expect("cluster starts");
    let database = postgres::create_database(&cluster.url()).await;
    let (a, b) = two_instances(&database).await;
    let upstream = Upstream::start("steady").await;
    let service = a
        .service_with_targets("web", &[target(&upstream, 100, 0)])
        .await;
    a.create(
        "/api/v1/routes",
        json!({"name": "web", "service_id": service, "path_prefix": "/web"}),
    )
    .await;
    wait_until("b serves the route", WAIT, || serves(&b, "/web", "steady")).await;

    let load = Load::start(vec![a.proxy_url("/web"), b.proxy_url("/web")], "steady");
    wait_until("the load runs", WAIT, || async { load.served() >= 50 }).await;

    let cluster = Arc::new(cluster);
    let stopping = cluster.clone();
    tokio::task::spawn_blocking(move || stopping.stop())
        .await
        .expect("cluster stops");
    let served_at_stop = load.served();
    // The outage lasts longer than a lease and a resync period, so every background job of both
    // instances meets the dead database at least once.
    let outage = Instant::now();
    wait_until(
        "both instances keep serving without the database",
        WAIT,
        || async {
            outage.elapsed() >= Duration::from_millis(2 * LEASE_MS + 500)
                && load.served() >= served_at_stop + 200
        },
    )
    .await;
    // The admin API reports the outage instead of pretending.
    let (status, _) = a.api("GET", "/api/v1/routes", None).await;
    assert_eq!(status, 503, "admin API without database");
    // Metrics still answer from the data path, and say the store is away.
    let scraped = a
        .http
        .get(a.admin_url("/metrics"))
        .send()
        .await
        .expect("metrics answer");
    assert_eq!(scraped.status(), 200);
    let metrics = scraped.text().await.unwrap_or_default();
    assert!(metrics.contains("raahi_store_up 0"), "{metrics}");
    assert!(metrics.contains("raahi_requests_total{"), "{metrics}");

    let starting = cluster.clone();
    tokio::task::spawn_blocking(move || starting.start_again())
        .await
        .expect("cluster starts again");

    // A change made after recovery reaches both instances.
    let other = Upstream::start("after").await;
    let new_service = wait_for_create(&a, "/api/v1/services", json!({"name": "after"})).await;
    wait_for_create(
        &a,
        &format!("/api/v1/services/{new_service}/targets"),
        target(&other, 100, 0),
    )
    .await;
    wait_for_create(
        &a,
        "/api/v1/routes",
        json!({"name": "after", "service_id": new_service, "path_prefix": "/after"}),
    )
    .await;
    for instance in [&a, &b] {
        wait_until("the change made after recovery serves", WAIT, || {
            serves(instance, "/after", "after")
        })
        .await;
    }

    let (served, failed, failures) = load.finish().await;
    assert_eq!(
        failed,
        0,
        "failed requests during the outage: {:?}",
        &failures[..failures.len().min(5)]
    );
    assert!(served > served_at_stop + 200, "served {served}");
}

/// Creates an object, retrying while the admin API cannot reach the database yet.
async fn wait_for_create(gateway: &TestGateway, path: &str, body: Value) -> i64 {
    let what = format!("POST {path} to succeed");
    wait_until(&what, Duration::from_secs(30), || async {
        let (status, answer) = gateway.api("POST", path, Some(body.clone())).await;
        if status == StatusCode::CREATED {
            return Ok(answer["id"].as_i64().expect("created"));
        }
        assert!(status.is_server_error(), "POST {path}: {status} {answer}");
        Err(format!("{status} {answer}"))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepting_held_removals_on_either_instance_reaches_the_one_that_refreshes() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["h1", "h2", "h3"].map(Upstream::start)).await;
    let registry = Registry::start().await;
    registry.set_json(Value::Array(
        ["h1", "h2", "h3"]
            .iter()
            .zip(&upstreams)
            .map(|(key, upstream)| registry_endpoint(key, upstream))
            .collect(),
    ));
    let service = discovered_service(&a, &registry, 200).await;
    let source = a
        .api(
            "GET",
            &format!("/api/v1/services/{service}/discovery-sources"),
            None,
        )
        .await
        .1["items"][0]["id"]
        .as_i64()
        .expect("a source id");
    // The registry empties: the holder's guard holds all three (the default guard).
    registry.set_json(json!([]));
    let held = a
        .wait_source_status(source, "the guard holding 3", WAIT, |s| {
            s.guard.as_ref().is_some_and(|guard| guard.holding == 3)
        })
        .await;
    let holder = held.refreshed_by.expect("a holder");
    let other = if holder == "gw-a" { &b } else { &a };
    let (status, answer) = other
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/accept-removals"),
            None,
        )
        .await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "passed on to {holder}: {answer}"
    );
    assert!(answer["released"].is_null(), "{answer}");
    let accepted = other
        .wait_source_status(
            source,
            "the held removals applied by the holder",
            WAIT,
            |s| s.guard.is_none() && s.endpoints.active == 0,
        )
        .await;
    assert_eq!(accepted.refreshed_by, Some(holder), "{accepted}");
}

/// A service whose `http` source the registry just emptied, its default guard holding all three
/// targets, drained ones kept `grace_ms`: the service, the source and the instance holding its
/// lease.
async fn held_source(
    via: &TestGateway,
    registry: &Registry,
    upstreams: &[Upstream],
    grace_ms: u64,
) -> (i64, i64, String) {
    registry.set_json(Value::Array(
        ["h1", "h2", "h3"]
            .iter()
            .zip(upstreams)
            .map(|(key, upstream)| registry_endpoint(key, upstream))
            .collect(),
    ));
    let service = discovered_service_with_grace(via, registry, 200, grace_ms).await;
    let source = via
        .api(
            "GET",
            &format!("/api/v1/services/{service}/discovery-sources"),
            None,
        )
        .await
        .1["items"][0]["id"]
        .as_i64()
        .expect("a source id");
    via.wait_source_status(source, "3 active", WAIT, |s| s.endpoints.active == 3)
        .await;
    registry.set_json(json!([]));
    let held = via
        .wait_source_status(source, "the guard holding 3", WAIT, |s| {
            s.guard.as_ref().is_some_and(|guard| guard.holding == 3)
        })
        .await;
    (service, source, held.refreshed_by.expect("a holder"))
}

/// `POST …/accept-removals` through `via`, which must pass it on (202).
async fn accept_passed_on(via: &TestGateway, source: i64) -> Value {
    let (status, answer) = via
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/accept-removals"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{answer}");
    assert!(answer["released"].is_null(), "{answer}");
    assert!(answer["released_at"].is_null(), "{answer}");
    let pending = &answer["status"]["removal_acceptance"];
    assert!(pending["requested_at"].is_string(), "{answer}");
    assert!(
        pending["released_at"].is_null(),
        "stored, not applied yet: {answer}"
    );
    answer
}

/// Waits until `holder` applied the acceptance: the hold ended, the three targets drain, and
/// the status says when and by whom.
async fn wait_released_by(via: &TestGateway, source: i64, holder: &str) -> SourceStatus {
    let released = via
        .wait_source_status(source, "the accepted removals released", WAIT, |s| {
            s.guard.is_none()
                && s.endpoints.active == 0
                && s.json["removal_acceptance"]["released_at"].is_string()
        })
        .await;
    let record = &released.json["removal_acceptance"];
    assert_eq!(record["released"], 3, "{released}");
    assert_eq!(record["released_by"], holder, "{released}");
    let time = |field: &str| {
        chrono::DateTime::parse_from_rfc3339(record[field].as_str().unwrap_or_default())
            .unwrap_or_else(|error| panic!("{field}: {error}: {released}"))
    };
    assert!(time("released_at") >= time("requested_at"), "{released}");
    released
}

/// The lease of the reconnect test: long, so the holder's lease cannot lapse while it cannot
/// reach the database (a lapse would make it take the source over again, and that takeover, not
/// the reconnect, would apply the request).
const RECONNECT_LEASE_MS: u64 = 10_000;

/// The holder's notification listener is down when another instance takes the acceptance (its
/// NOTIFY is lost): the request is stored, and the holder applies it once it listens again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acceptance_whose_notification_was_lost_applies_after_the_listener_reconnects() {
    let database = postgres::fresh_database().await;
    let mut instances = Vec::new();
    let mut roles = HashMap::new();
    for id in ["gw-a", "gw-b"] {
        let (role, url) = postgres::login_role(&database).await;
        roles.insert(id, role);
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let config = cluster_config(&url, id, RECONNECT_LEASE_MS);
        instances.push(TestGateway::start_with(dir, config).await);
    }
    let (b, a) = (instances.pop().unwrap(), instances.pop().unwrap());
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["h1", "h2", "h3"].map(Upstream::start)).await;
    let registry = Registry::start().await;
    let (_, source, holder) = held_source(&a, &registry, &upstreams, 500).await;
    let other = if holder == "gw-a" { &b } else { &a };
    let role = &roles[holder.as_str()];

    // The holder's connections are cut and it cannot reconnect for a moment (well within its
    // lease): its listener is down when the request's notification is sent.
    assert_eq!(postgres::listeners(&database, &holder).await, 1);
    let cut = Instant::now();
    postgres::set_login(&database, role, false).await;
    assert!(postgres::terminate_connections(&database, role).await >= 1);
    assert_eq!(postgres::listeners(&database, &holder).await, 0);
    accept_passed_on(other, source).await;
    let waiting = other.source_status(source).await;
    postgres::set_login(&database, role, true).await;
    assert!(
        waiting.guard.is_some(),
        "nobody heard the request: {waiting}"
    );

    wait_until("the holder listens again", WAIT, || async {
        postgres::listeners(&database, &holder).await == 1
    })
    .await;
    let released = wait_released_by(other, source, &holder).await;
    // The holder renews every third of a lease, so the lease it held at the cut lasts at least
    // two thirds of one past it: released before that, it never lapsed, so neither this holder
    // (anew) nor the other instance took the source over; the reconnect's look applied it.
    let within = Duration::from_millis(RECONNECT_LEASE_MS * 3 / 5);
    assert!(
        cut.elapsed() < within,
        "released {:?} after the cut, not within {within:?}: a takeover may have applied it",
        cut.elapsed()
    );
    assert_eq!(
        released.refreshed_by.as_deref(),
        Some(holder.as_str()),
        "no takeover: {released}"
    );
}

/// The holder dies before it applies an acceptance: the instance that takes the source over
/// applies it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acceptance_the_holder_never_applied_is_applied_by_the_next_holder() {
    let database = postgres::fresh_database().await;
    let (a, b) = two_instances(&database).await;
    let upstreams: Vec<Upstream> =
        futures_util::future::join_all(["h1", "h2", "h3"].map(Upstream::start)).await;
    let registry = Registry::start().await;
    // Drained targets stay a minute: a second application would drain them again, later.
    let (service, source, holder) = held_source(&a, &registry, &upstreams, 60_000).await;
    let (mut dying, survivor, survivor_id) = if holder == "gw-a" {
        (a, b, "gw-b")
    } else {
        (b, a, "gw-a")
    };
    // No goodbye: its lease runs out on its own, and the notification reaches nobody.
    dying.gateway.take().expect("running").abort();
    accept_passed_on(&survivor, source).await;

    let released = wait_released_by(&survivor, source, survivor_id).await;
    assert_eq!(
        released.refreshed_by.as_deref(),
        Some(survivor_id),
        "{released}"
    );
    // Applied once: the targets it drained are not drained again by later lease rounds.
    let drained = || async {
        let (_, targets) = survivor
            .api("GET", &format!("/api/v1/services/{service}/targets"), None)
            .await;
        targets["items"].as_array().cloned().unwrap_or_default()
    };
    let first = drained().await;
    assert_eq!(first.len(), 3, "{first:?}");
    for target in &first {
        assert_eq!(target["state"], "draining", "{target}");
        assert!(target["remove_at"].is_string(), "{target}");
    }
    let record = released.json["removal_acceptance"].clone();
    holds_for(
        "the drained targets and the record stay as the one application left them",
        Duration::from_millis(2 * LEASE_MS),
        || async {
            drained().await == first
                && survivor.source_status(source).await.json["removal_acceptance"] == record
        },
    )
    .await;
}

/// `raahi_control_reloads_total{kind=...}` of one instance.
async fn reloads(gateway: &TestGateway, kind: &str) -> u64 {
    let metrics = gateway.metrics_text().await;
    let series = format!(r#"raahi_control_reloads_total{{kind="{kind}"}} "#);
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(series.as_str()))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("{series} missing from /metrics:\n{metrics}"))
}
