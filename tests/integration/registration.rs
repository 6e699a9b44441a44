//! Self-registration in Consul and the drain sequence (DESIGN §7 `/readyz`, §10), through real
//! sockets against the Consul fake's agent endpoints: the registration carries the advertised
//! address and a TTL check that heartbeats keep passing; a gateway still loading its sources is
//! registered critical and passes once ready; an agent that lost it gets it again; an agent down
//! at start never stops the proxy; draining fails the check, keeps serving for the drain delay,
//! then deregisters; `kill -9` leaves the entry to turn critical after its TTL; a rolling restart
//! behind a client that resolves the gateways through Consul, with the default drain delay,
//! loses no request; and a second gateway with a `consul` source routes to the first one's
//! registration.

use crate::common;
use common::api::Readiness;

use common::consul::{ConsulFake, Instance};
use common::process::RaahiProcess;
use common::registry::Registry;
use common::*;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use raahi::config::Config;
use serde_json::{json, Value};

/// Longest wait for anything the gateway does on its own with the short timers used here.
const WAIT: Duration = Duration::from_secs(10);
const TTL_MS: u64 = 1_500;

/// The environment that registers a gateway in `fake` as service `edge` with id `id`; the drain
/// delay is `drain_ms`, or the default (5 s with a registration) when None.
fn registration_env(
    fake: &ConsulFake,
    id: &str,
    drain_ms: Option<&str>,
) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN.to_owned()),
        ("RAAHI_REGISTRATION_CONSUL_ADDRESS", fake.url()),
        ("RAAHI_REGISTRATION_CONSUL_SERVICE_NAME", "edge".to_owned()),
        ("RAAHI_REGISTRATION_CONSUL_SERVICE_ID", id.to_owned()),
        ("RAAHI_REGISTRATION_CONSUL_TTL_MS", TTL_MS.to_string()),
        (
            "RAAHI_REGISTRATION_CONSUL_DEREGISTER_CRITICAL_AFTER_MS",
            "3000".to_owned(),
        ),
    ];
    if let Some(drain_ms) = drain_ms {
        env.push(("RAAHI_PROXY_DRAIN_DELAY_MS", drain_ms.to_owned()));
    }
    env
}

/// A resources file (in its own directory, kept while the guard lives): service `web` filled by
/// an `http` discovery source reading `registry`, and a route for every request to it.
fn resources_from(registry: &Registry) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("resources.toml");
    let text = format!(
        r#"
[[services]]
name = "web"

  [[services.discovery_sources]]
  name = "web-registry"
  provider = "http"
  config = {{ url = "{url}", timeout_ms = 10000 }}

[[routes]]
name = "web"
service = "web"
path_prefix = "/"
"#,
        url = registry.url("/endpoints"),
    );
    std::fs::write(&path, text).expect("resources file written");
    (dir, path.display().to_string())
}

/// A registry that lists `upstream` as the one endpoint, after `delay`.
async fn registry_of(upstream: &Upstream, delay: Duration) -> Registry {
    let registry = Registry::start().await;
    registry.set_json(json!([
        {"key": "web-1", "host": "127.0.0.1", "port": upstream.addr.port()}
    ]));
    registry.set_delay(delay);
    registry
}

/// An in-process gateway's config: [`registration_env`] with no drain delay, `extra` on top.
fn registered_config(
    dir: &std::path::Path,
    fake: &ConsulFake,
    id: &str,
    extra: &[(&str, &str)],
) -> Config {
    let mut env: Vec<(String, String)> = [
        ("RAAHI_PROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("RAAHI_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        (
            "RAAHI_DATABASE_URL",
            format!("sqlite://{}/raahi.db", dir.display()),
        ),
    ]
    .into_iter()
    .chain(registration_env(fake, id, Some("0")))
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    for (name, value) in extra {
        env.retain(|(existing, _)| existing != name);
        env.push(((*name).to_owned(), (*value).to_owned()));
    }
    Config::from_parts("registration-test.toml", None, &env).expect("a valid config")
}

async fn registered_gateway(fake: &ConsulFake, id: &str, extra: &[(&str, &str)]) -> TestGateway {
    let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
    let config = registered_config(dir.path(), fake, id, extra);
    TestGateway::start_with(dir, config).await
}

async fn wait_check(fake: &ConsulFake, id: &str, status: &str) {
    wait_until(&format!("check of {id} is {status}"), WAIT, || async {
        fake.agent_check_status(id).as_deref() == Some(status)
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Registering and staying registered
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registration_carries_the_advertised_address_and_heartbeats_keep_it_passing() {
    let fake = ConsulFake::start().await;
    fake.require_token(Some("agent-token"));
    let gateway = registered_gateway(
        &fake,
        "gw-1",
        &[
            ("RAAHI_REGISTRATION_CONSUL_TOKEN", "agent-token"),
            ("RAAHI_REGISTRATION_CONSUL_TAGS", "edge,eu"),
        ],
    )
    .await;
    wait_check(&fake, "gw-1", "passing").await;
    let service = fake.agent_service("gw-1").expect("registered");
    assert_eq!(service.name, "edge");
    assert_eq!(service.address, "127.0.0.1");
    assert_eq!(service.port, gateway.proxy.port(), "the proxy's bound port");
    assert_eq!(service.tags, ["edge", "eu"]);
    assert_eq!(
        service.meta.get("raahi_version").map(String::as_str),
        Some(env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(service.ttl, Some(Duration::from_millis(TTL_MS)));
    assert_eq!(
        service.deregister_critical_after,
        Some(Duration::from_secs(3))
    );
    assert_eq!(fake.last_headers()["x-consul-token"], "agent-token");

    // Three TTLs later the check still passes, and never stopped passing (a status change would
    // have moved the index): heartbeats came every third of it.
    let index = fake.index();
    let updates = fake.agent_check_updates();
    let started = Instant::now();
    wait_until("three TTLs of heartbeats", WAIT, || async {
        started.elapsed() >= Duration::from_millis(3 * TTL_MS)
            && fake.agent_check_updates() >= updates + 8
    })
    .await;
    assert_eq!(fake.agent_check_status("gw-1").as_deref(), Some("passing"));
    assert_eq!(fake.index(), index, "the check never lapsed");
    assert_eq!(fake.agent_registrations(), 1, "registered once");

    let (status, body) = gateway.readyz().await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.registration().state, "registered", "{body}");
    assert_eq!(body.registration().service_id, "gw-1", "{body}");
    assert!(!body.degraded, "{body}");
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics
            .contains("raahi_registration_registered{registry=\"consul\",service_id=\"gw-1\"} 1"),
        "{metrics}"
    );
}

/// The metric line of `gw-1`'s registration gauge with `value`.
fn registered_gauge(value: u8) -> String {
    format!("raahi_registration_registered{{registry=\"consul\",service_id=\"gw-1\"}} {value}")
}

/// A gateway on its first refresh of a source whose registry holds its answer, with a TTL of a
/// minute (the next heartbeat is 20 s away, so only readiness can make the check pass sooner);
/// the drain delay is `drain_ms`.
async fn loading_gateway(
    fake: &ConsulFake,
    registry: &Registry,
    resources: &str,
    drain_ms: &str,
) -> TestGateway {
    registry.hold();
    registered_gateway(
        fake,
        "gw-1",
        &[
            ("RAAHI_RESOURCES_FILE", resources),
            ("RAAHI_REGISTRATION_CONSUL_TTL_MS", "60000"),
            (
                "RAAHI_REGISTRATION_CONSUL_DEREGISTER_CRITICAL_AFTER_MS",
                "120000",
            ),
            ("RAAHI_PROXY_DRAIN_DELAY_MS", drain_ms),
        ],
    )
    .await
}

/// Registered `starting` with the check critical and the note `starting`, the registered gauge
/// at 0, and it stays so for a second.
async fn assert_registered_starting(fake: &ConsulFake, gateway: &TestGateway) {
    wait_check(fake, "gw-1", "critical").await;
    let body = fake.last_registration_body().expect("registered");
    assert_eq!(body["Check"]["Status"], "critical", "{body}");
    wait_until("the check's note says starting", WAIT, || async {
        fake.agent_check_output("gw-1")
            .is_some_and(|output| output.starts_with("starting"))
    })
    .await;
    let body = wait_until_readyz(gateway, "registered while starting", |body| {
        body.registration_state()
            .is_some_and(|state| state == "starting")
    })
    .await;
    assert_eq!(body.status, "starting", "{body}");
    assert!(!body.degraded, "starting is the plan, not a fault: {body}");
    let metrics = gateway.metrics_text().await;
    assert!(metrics.contains(&registered_gauge(0)), "{metrics}");
    holds_for(
        "critical while the source loads",
        Duration::from_millis(1_000),
        || async { fake.agent_check_status("gw-1").as_deref() == Some("critical") },
    )
    .await;
    assert_eq!(gateway.readyz().await.0, 503);
    let metrics = gateway.metrics_text().await;
    assert!(metrics.contains(&registered_gauge(0)), "{metrics}");
}

/// A gateway whose discovery source is still on its first refresh has no targets yet: it is
/// registered with its check critical (note `starting`) and passes as soon as `/readyz` says
/// ready, not at the next heartbeat; by then its targets serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_still_loading_its_sources_is_registered_critical_until_ready() {
    let fake = ConsulFake::start().await;
    let upstream = Upstream::start("served").await;
    let registry = registry_of(&upstream, Duration::ZERO).await;
    let (_files, resources) = resources_from(&registry);
    let gateway = loading_gateway(&fake, &registry, &resources, "0").await;

    assert_registered_starting(&fake, &gateway).await;

    registry.release();
    wait_until(
        "passing at once when ready, not at the next heartbeat",
        Duration::from_secs(2),
        || async { fake.agent_check_status("gw-1").as_deref() == Some("passing") },
    )
    .await;
    assert_eq!(
        gateway.fetch_status("/").await,
        (200, "served".to_owned()),
        "passing only once its targets serve"
    );
    let body = wait_until_readyz(&gateway, "registered", |body| {
        body.registration_state()
            .is_some_and(|state| state == "registered")
    })
    .await;
    assert_eq!(body.status, "ready", "{body}");
    let metrics = gateway.metrics_text().await;
    assert!(metrics.contains(&registered_gauge(1)), "{metrics}");
    assert_eq!(fake.agent_registrations(), 1, "registered once");
}

/// Draining while still starting: the check never passes, even when the source resolves during
/// the drain delay; it is failed with the note `draining`, then the service is deregistered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_drained_while_starting_never_passes_and_is_deregistered() {
    let fake = Arc::new(ConsulFake::start().await);
    let upstream = Upstream::start("served").await;
    let registry = registry_of(&upstream, Duration::ZERO).await;
    let (_files, resources) = resources_from(&registry);
    let mut gateway = loading_gateway(&fake, &registry, &resources, "2000").await;
    let ever_passing = Arc::new(AtomicBool::new(false));
    let watcher = tokio::spawn({
        let (fake, ever_passing) = (fake.clone(), ever_passing.clone());
        async move {
            loop {
                if fake.agent_check_status("gw-1").as_deref() == Some("passing") {
                    ever_passing.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });
    assert_registered_starting(&fake, &gateway).await;

    let running = gateway.gateway.take().expect("running");
    let drained = tokio::spawn(running.drain(std::future::pending()));
    wait_until(
        "the check is failed with the note draining",
        WAIT,
        || async { fake.agent_check_output("gw-1").as_deref() == Some("draining") },
    )
    .await;
    assert_eq!(fake.agent_check_status("gw-1").as_deref(), Some("critical"));
    let body = wait_until_readyz(&gateway, "draining and withdrawn", |body| {
        body.registration_state()
            .is_some_and(|state| state == "withdrawn")
    })
    .await;
    assert_eq!(body.status, "draining", "{body}");
    // The source resolves during the drain delay: the gateway serves it, but stays withdrawn.
    registry.release();
    wait_until("the drained gateway serves its targets", WAIT, || async {
        gateway.fetch_status("/").await == (200, "served".to_owned())
    })
    .await;
    assert!(!drained.is_finished(), "within the drain delay");
    holds_for(
        "critical, note draining, through the rest of the delay",
        Duration::from_millis(500),
        || async {
            fake.agent_check_status("gw-1").as_deref() == Some("critical")
                && fake.agent_check_output("gw-1").as_deref() == Some("draining")
        },
    )
    .await;

    drained.await.unwrap();
    assert!(fake.agent_service("gw-1").is_none(), "deregistered");
    assert_eq!(fake.agent_deregistrations(), 1);
    watcher.abort();
    assert!(
        !ever_passing.load(Ordering::SeqCst),
        "the check passed at some point"
    );
    assert_eq!(fake.agent_registrations(), 1, "registered once");
}

/// Consul keeps the status of an existing check id through a new registration (the "check state
/// snapshot"): a gateway that restarts with the same id after its predecessor's check turned
/// critical passes its check at once when ready, not at its first heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_with_the_id_of_a_critical_check_passes_at_once_when_ready() {
    let fake = ConsulFake::start().await;
    let crashed = registered_gateway(
        &fake,
        "gw-1",
        &[(
            "RAAHI_REGISTRATION_CONSUL_DEREGISTER_CRITICAL_AFTER_MS",
            "120000",
        )],
    )
    .await;
    wait_check(&fake, "gw-1", "passing").await;
    let mut crashed = crashed;
    crashed.gateway.take().expect("running").abort();
    wait_check(&fake, "gw-1", "critical").await;
    let output = fake.agent_check_output("gw-1").unwrap_or_default();
    assert!(output.starts_with("TTL expired"), "{output}");

    // No sources: ready at once. The next heartbeat is 20 s away.
    let restarted = Instant::now();
    let gateway = registered_gateway(
        &fake,
        "gw-1",
        &[
            ("RAAHI_REGISTRATION_CONSUL_TTL_MS", "60000"),
            (
                "RAAHI_REGISTRATION_CONSUL_DEREGISTER_CRITICAL_AFTER_MS",
                "120000",
            ),
        ],
    )
    .await;
    wait_until(
        "the restarted gateway's check passes at once",
        Duration::from_secs(3),
        || async { fake.agent_check_status("gw-1").as_deref() == Some("passing") },
    )
    .await;
    assert_eq!(fake.agent_registrations(), 2);
    assert!(restarted.elapsed() < Duration::from_secs(3));
    assert_eq!(gateway.readyz().await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_lost_the_registration_gets_it_again() {
    let fake = ConsulFake::start().await;
    let _gateway = registered_gateway(&fake, "gw-1", &[]).await;
    wait_check(&fake, "gw-1", "passing").await;
    fake.agent_forget_all();
    assert!(fake.agent_service("gw-1").is_none());
    // The next heartbeat answers 404: the registrar registers again at once.
    wait_until("registered again", WAIT, || async {
        fake.agent_service("gw-1").is_some() && fake.agent_registrations() == 2
    })
    .await;
    wait_check(&fake, "gw-1", "passing").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registration_survives_an_agent_restart_without_its_data() {
    let fake = ConsulFake::start().await;
    let gateway = registered_gateway(&fake, "gw-1", &[]).await;
    wait_check(&fake, "gw-1", "passing").await;
    fake.stop();
    wait_until_readyz(&gateway, "the agent is unreachable", |body| {
        body.registration_state()
            .is_some_and(|state| state == "unreachable")
    })
    .await;
    fake.agent_forget_all();
    fake.restart().await;
    wait_check(&fake, "gw-1", "passing").await;
    assert_eq!(fake.agent_registrations(), 2, "registered again once back");
    let body = wait_until_readyz(&gateway, "registered", |body| {
        body.registration_state()
            .is_some_and(|state| state == "registered")
    })
    .await;
    assert!(body.registration().failures >= 1, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_down_at_start_never_stops_the_proxy_and_is_registered_with_when_back() {
    let fake = ConsulFake::start().await;
    fake.stop();
    let upstream = Upstream::start("served").await;
    let gateway = registered_gateway(&fake, "gw-1", &[]).await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    assert_eq!(gateway.fetch_status("/").await.1, "served");
    let body = wait_until_readyz(&gateway, "the registration is unreachable", |body| {
        body.registration_state()
            .is_some_and(|state| state == "unreachable")
    })
    .await;
    assert_eq!(body.status, "ready", "serving: ready, but degraded: {body}");
    assert!(body.degraded, "{body}");
    let error = body
        .registration()
        .last_error
        .as_deref()
        .unwrap_or_default();
    assert!(
        error.contains(&fake.url()) && error.contains("could not be reached"),
        "{body}"
    );

    fake.restart().await;
    // Retries back off from 1 s doubling; within a few seconds it is registered.
    wait_check(&fake, "gw-1", "passing").await;
    let body = wait_until_readyz(&gateway, "registered", |body| {
        body.registration_state()
            .is_some_and(|state| state == "registered")
    })
    .await;
    assert_eq!(body.registration().last_error, None, "{body}");
    assert!(!body.degraded, "{body}");
}

async fn wait_until_readyz(
    gateway: &TestGateway,
    what: &str,
    done: impl Fn(&Readiness) -> bool,
) -> Readiness {
    let done = &done;
    wait_until(what, WAIT, || async move {
        let (_, body) = gateway.readyz().await;
        if done(&body) {
            Ok(body)
        } else {
            Err(body)
        }
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Draining
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_fails_the_check_keeps_serving_for_the_delay_then_deregisters() {
    let fake = ConsulFake::start().await;
    let upstream = Upstream::start("served").await;
    let mut gateway =
        registered_gateway(&fake, "gw-1", &[("RAAHI_PROXY_DRAIN_DELAY_MS", "3000")]).await;
    let service = gateway
        .service_with_targets("web", &[target(&upstream, 1, 0)])
        .await;
    gateway.route_all_to(service).await;
    wait_check(&fake, "gw-1", "passing").await;

    let (hurry, hurried) = tokio::sync::oneshot::channel::<()>();
    let running = gateway.gateway.take().expect("running");
    let started = Instant::now();
    let drained = tokio::spawn(running.drain(async {
        let _ = hurried.await;
    }));
    // At once: readiness is gone and the check is failed, with why.
    let body = wait_until_readyz(&gateway, "draining and withdrawn", |body| {
        body.registration_state()
            .is_some_and(|state| state == "withdrawn")
    })
    .await;
    assert_eq!(body.status, "draining", "{body}");
    assert_eq!(gateway.readyz().await.0, 503);
    wait_check(&fake, "gw-1", "critical").await;
    assert_eq!(fake.agent_check_output("gw-1").as_deref(), Some("draining"));
    assert!(started.elapsed() < Duration::from_millis(2_000));

    // During the delay new connections and requests are still served, and each HTTP/1.1 answer
    // ends its connection, so a client pinned to one moves to a new connection before the close.
    let mut served = 0;
    while started.elapsed() < Duration::from_millis(2_200) {
        let response = reqwest::Client::new()
            .get(format!("http://{}/", gateway.proxy))
            .send()
            .await
            .unwrap_or_else(|error| {
                panic!("refused {:?} into the drain: {error}", started.elapsed())
            });
        assert_eq!(response.status(), 200);
        assert_eq!(
            response
                .headers()
                .get("connection")
                .map(|v| v.to_str().unwrap()),
            Some("close")
        );
        assert_eq!(response.text().await.unwrap(), "served");
        served += 1;
    }
    assert!(served > 5, "{served}");
    assert!(!drained.is_finished(), "the delay is not over");

    // Then it stops accepting, and deregisters once done.
    drained.await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(3_000));
    assert_eq!(gateway.fetch_status("/").await.0, 0);
    assert!(fake.agent_service("gw-1").is_none(), "deregistered");
    assert_eq!(fake.agent_deregistrations(), 1);
    drop(hurry);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_cuts_the_drain_delay_short() {
    let fake = ConsulFake::start().await;
    let mut gateway =
        registered_gateway(&fake, "gw-1", &[("RAAHI_PROXY_DRAIN_DELAY_MS", "60000")]).await;
    wait_check(&fake, "gw-1", "passing").await;
    let (hurry, hurried) = tokio::sync::oneshot::channel::<()>();
    let running = gateway.gateway.take().expect("running");
    let drained = tokio::spawn(running.drain(async {
        let _ = hurried.await;
    }));
    wait_check(&fake, "gw-1", "critical").await;
    let hurried_at = Instant::now();
    hurry.send(()).unwrap();
    tokio::time::timeout(WAIT, drained)
        .await
        .expect("the drain ends soon after the second signal")
        .unwrap();
    assert!(hurried_at.elapsed() < Duration::from_secs(5));
    assert!(fake.agent_service("gw-1").is_none(), "deregistered");
}

// ---------------------------------------------------------------------------------------------
// Processes: signals, a crash, and a rolling restart
// ---------------------------------------------------------------------------------------------

async fn spawn_registered(fake: &ConsulFake, id: &str, drain_ms: &str) -> RaahiProcess {
    spawn_with(registration_env(fake, id, Some(drain_ms))).await
}

async fn spawn_with(env: Vec<(&'static str, String)>) -> RaahiProcess {
    let pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    RaahiProcess::serve(&pairs).await
}

/// A gateway configured as in production: the default drain delay, its service and route from
/// `resources`, its targets from the registry that file names.
async fn spawn_edge(fake: &ConsulFake, id: &str, resources: &str) -> RaahiProcess {
    let mut env = registration_env(fake, id, None);
    env.push(("RAAHI_RESOURCES_FILE", resources.to_owned()));
    spawn_with(env).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_or_sigint_skips_the_drain_delay() {
    let fake = ConsulFake::start().await;
    let mut processes = Vec::new();
    for (id, signals) in [
        ("gw-tt", ["-TERM", "-TERM"]),
        ("gw-ii", ["-INT", "-INT"]),
        ("gw-ti", ["-TERM", "-INT"]),
    ] {
        processes.push((spawn_registered(&fake, id, "60000").await, id, signals));
    }
    for (_, id, _) in &processes {
        wait_check(&fake, id, "passing").await;
    }
    // A slow agent: the withdrawal takes its whole 2 s bound, and the second signal arrives
    // while nobody waits for it yet.
    fake.hang(true);
    let started = Instant::now();
    for (process, _, [first, _]) in &processes {
        process.signal(first);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    for (process, _, [_, second]) in &processes {
        process.signal(second);
    }
    for (process, id, signals) in processes {
        let status = tokio::time::timeout(Duration::from_secs(20), process.exit_status())
            .await
            .unwrap_or_else(|_| panic!("{id} ({signals:?}) still draining after 20 s"));
        assert!(status.success(), "{id}: {status:?}");
    }
    // 2 s withdrawal + 2 s deregistration at most, far from the 60 s delay.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_gateway_turns_critical_after_its_ttl_and_is_reaped() {
    let fake = ConsulFake::start().await;
    let process = spawn_registered(&fake, "gw-crash", "0").await;
    wait_check(&fake, "gw-crash", "passing").await;
    process.signal("-KILL");
    let killed = Instant::now();
    wait_check(&fake, "gw-crash", "critical").await;
    let lapsed = killed.elapsed();
    assert!(
        lapsed <= Duration::from_millis(TTL_MS + 1_000),
        "critical after {lapsed:?}"
    );
    let output = fake.agent_check_output("gw-crash").unwrap_or_default();
    assert!(output.starts_with("TTL expired"), "{output}");
    wait_until(
        "reaped after deregister_critical_after_ms",
        WAIT,
        || async { fake.agent_service("gw-crash").is_none() },
    )
    .await;
    let _ = process.exit_status().await;
}

/// How often the client reads the passing instances again, as a load balancer polling Consul
/// (or honouring a DNS TTL) does; the drain delay must cover it.
const RESOLVE_EVERY: Duration = Duration::from_millis(300);

/// A client that finds the gateways the way a load balancer fed from Consul does: every
/// [`RESOLVE_EVERY`] it asks Consul for the passing instances of `edge`, and sends each request
/// to the next one, round-robin, over a keep-alive pool.
struct ResolvingClient {
    consul: String,
    http: reqwest::Client,
    next: usize,
    resolved: Option<(Instant, Vec<String>)>,
}

impl ResolvingClient {
    async fn instances(&self) -> Vec<String> {
        let answer: Value = self
            .http
            .get(format!(
                "{}/v1/health/service/edge?passing=true",
                self.consul
            ))
            .send()
            .await
            .expect("the fake answers")
            .json()
            .await
            .expect("JSON");
        answer
            .as_array()
            .expect("an array")
            .iter()
            .map(|entry| {
                format!(
                    "{}:{}",
                    entry["Service"]["Address"].as_str().unwrap(),
                    entry["Service"]["Port"]
                )
            })
            .collect()
    }

    /// One request: Ok(instance) when it succeeded, Err(why) when it did not.
    async fn request(&mut self) -> Result<String, String> {
        let fresh = self
            .resolved
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < RESOLVE_EVERY);
        if !fresh {
            self.resolved = Some((Instant::now(), self.instances().await));
        }
        let instances = self
            .resolved
            .as_ref()
            .map(|(_, list)| list.clone())
            .unwrap_or_default();
        if instances.is_empty() {
            return Err("no passing instance".to_owned());
        }
        let instance = instances[self.next % instances.len()].clone();
        self.next += 1;
        match self.http.get(format!("http://{instance}/")).send().await {
            Ok(response) if response.status() == 200 => Ok(instance),
            Ok(response) => Err(format!("{instance}: HTTP {}", response.status())),
            Err(error) => Err(format!("{instance}: {error}")),
        }
    }
}

/// Requests each instance served, by its `ip:port`.
type ServedBy = Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>;

fn served_by(served: &ServedBy, instance: &str) -> usize {
    served.lock().unwrap().get(instance).copied().unwrap_or(0)
}

/// Stops `process` with SIGTERM while the load runs; waits for its exit 0 and deregistration.
async fn stop_one(fake: &ConsulFake, process: RaahiProcess, id: &str) {
    process.sigterm();
    let status = process.exit_status().await;
    assert!(status.success(), "{id}: exit 0 after draining: {status:?}");
    assert!(
        fake.agent_service(id).is_none(),
        "{id} deregistered at the end"
    );
}

/// Each gateway finds its upstream through a registry that takes a moment to answer, so a
/// replacement starts without targets: it must not be chosen before its first refresh. The
/// drain delay is the default.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_behind_consul_loses_no_request() {
    let fake = ConsulFake::start().await;
    let upstream = Upstream::start("served").await;
    let registry = registry_of(&upstream, Duration::from_millis(500)).await;
    let (_files, resources) = resources_from(&registry);
    let first = spawn_edge(&fake, "gw-a", &resources).await;
    let second = spawn_edge(&fake, "gw-b", &resources).await;
    wait_check(&fake, "gw-a", "passing").await;
    wait_check(&fake, "gw-b", "passing").await;

    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    let served: ServedBy = Arc::default();
    let load = {
        let (stop, failures, served) = (stop.clone(), failures.clone(), served.clone());
        let mut client = ResolvingClient {
            consul: fake.url(),
            http: reqwest::Client::new(),
            next: 0,
            resolved: None,
        };
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match client.request().await {
                    Ok(instance) => *served.lock().unwrap().entry(instance).or_default() += 1,
                    Err(why) => failures.lock().unwrap().push(why),
                }
            }
        })
    };
    let (first_address, second_address) = (first.proxy.to_string(), second.proxy.to_string());
    wait_until("the load reaches both instances", WAIT, || async {
        served_by(&served, &first_address) > 20 && served_by(&served, &second_address) > 20
    })
    .await;

    // The first is replaced: stopped, then started again (a new process, the same id).
    stop_one(&fake, first, "gw-a").await;
    let replacement = spawn_edge(&fake, "gw-a", &resources).await;
    wait_check(&fake, "gw-a", "passing").await;
    let replacement_address = replacement.proxy.to_string();
    wait_until("the load reaches the replacement", WAIT, || async {
        served_by(&served, &replacement_address) > 20
    })
    .await;
    // Then the second.
    stop_one(&fake, second, "gw-b").await;
    let after_second = served_by(&served, &replacement_address);
    wait_until("the replacement carries the load alone", WAIT, || async {
        served_by(&served, &replacement_address) > after_second + 50
    })
    .await;

    stop.store(true, Ordering::SeqCst);
    load.await.unwrap();
    let failures = failures.lock().unwrap().clone();
    let total: usize = served.lock().unwrap().values().sum();
    eprintln!(
        "rolling restart: {total} requests served, {} failed",
        failures.len()
    );
    assert!(failures.is_empty(), "requests lost: {failures:?}");
    drop(replacement);
}

// ---------------------------------------------------------------------------------------------
// The round trip: one gateway registers, another discovers it through Consul
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_gateway_routes_to_the_first_through_its_registration() {
    let fake = ConsulFake::start().await;
    let upstream = Upstream::start("origin").await;
    // A stray catalog entry of another service is never picked.
    fake.register(Instance::new("other", 1));
    // The drain delay covers the front's reaction: its watch asks at most once a second.
    let mut edge =
        registered_gateway(&fake, "edge-1", &[("RAAHI_PROXY_DRAIN_DELAY_MS", "5000")]).await;
    let service = edge
        .service_with_targets("web", &[target(&upstream, 1, 0)])
        .await;
    edge.route_all_to(service).await;
    wait_check(&fake, "edge-1", "passing").await;

    let front = TestGateway::start().await;
    let edges = front
        .create("/api/v1/services", json!({"name": "edges"}))
        .await;
    front.route_all_to(edges).await;
    let source = front
        .create(
            &format!("/api/v1/services/{edges}/discovery-sources"),
            json!({
                "name": "edges", "provider": "consul", "removal_grace_ms": 200,
                "config": {"address": fake.url(), "service": "edge", "wait_ms": 10_000},
            }),
        )
        .await;
    // register → discover → route
    wait_until("the front routes through the edge", WAIT, || async {
        front.fetch_status("/").await == (200, "origin".to_owned())
    })
    .await;
    let status = front.source_status(source).await;
    assert_eq!(status.endpoints.active, 1, "{status}");

    // deregister → drain: the edge withdraws; until the front stops choosing it, requests still
    // pass through it, and none fails on the way.
    let running = edge.gateway.take().expect("running");
    let withdrawn = Instant::now();
    let drained = tokio::spawn(running.drain(std::future::pending()));
    loop {
        let (status, body) = front.fetch_status("/").await;
        match status {
            200 => assert_eq!(body, "origin"),
            503 => break,
            other => panic!("the front answered {other} while the edge drained: {body}"),
        }
        assert!(
            withdrawn.elapsed() < WAIT,
            "the front kept routing to the edge"
        );
    }
    assert!(
        withdrawn.elapsed() < Duration::from_millis(5_000),
        "the front let go of the edge within its drain delay"
    );
    let status = front.source_status(source).await;
    assert_eq!(status.endpoints.active, 0, "{status}");
    drained.await.unwrap();
    assert!(fake.agent_service("edge-1").is_none());
}
