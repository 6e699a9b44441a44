//! The PostgreSQL periodic resync at cluster scale (issue 38): a PostgreSQL store holding 5,000
//! services, each with one `http` discovery source and 20 discovered targets (100,000), and 5,000
//! routes; one gateway on it with `cluster.resync_ms` of 5 s and nothing else to do.
//!
//! Two phases of a window each: `WholeEachPeriod` forces a whole reload every period (by ending
//! the listener's connection: a reconnect reads everything, through the `forget_position` +
//! apply path the periodic resync itself took before issue 38) besides the periodic resync,
//! which adds what the periodic resync cost before; `PeriodicResync` is the gateway as it runs.
//! Reported for each:
//! - what each periodic resync costs: the gateway's CPU per resync (its runtime threads), the
//!   rows the database returned from `targets`, `services`, `discovery_sources` and
//!   `config_changes` per resync (`pg_stat_user_tables`), and the reloads it counted
//!   (`raahi_control_reloads_total{kind}`);
//! - how long the control task was busy: the round trip of a no-op command (a refresh of an
//!   unknown source) sent every 20 ms, p50 / p99 / max;
//! - that changes whose notification the gateway never acts on still arrive: one target weight
//!   a resync period, written under the gateway's own instance name (its listener skips its own
//!   notifications), and the time until the live snapshot shows it;
//! - the store reads themselves, timed alone on the filled store: a whole load, a read of the
//!   change log with nothing new, and a read of every source's progress.
//!
//! PostgreSQL comes from `RAAHI_TEST_POSTGRES_URL` (a new database on that server), else a
//! throwaway cluster as the tests start one (`tests/common/postgres.rs`).
//!
//! `cargo bench --bench control_resync` runs the full scale; knobs (environment):
//! `BENCH_SERVICES` (5000), `BENCH_TARGETS` (20 per service), `BENCH_RESYNC_MS` (5000),
//! `BENCH_WINDOW_SECONDS` (60 per phase), `BENCH_GATEWAY_THREADS` (2), `BENCH_WHOLE_PHASE`
//! (true). Under `cargo test --benches` it runs a small smoke version that checks the
//! unnotified changes arrive.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

#[path = "../tests/common/postgres.rs"]
mod postgres;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use raahi::config::Config;
use raahi::gateway::Gateway;
use raahi::model::TargetChange;
use raahi::model::{DiscoverySourceSpec, Endpoint, Id, ProviderKind, RouteSpec, ServiceSpec};
use raahi::snapshot::Snapshot;
use raahi::store::Store;
use serde_json::json;
use sqlx::Connection;
use tokio::net::TcpListener;

#[path = "support/scale.rs"]
mod scale;
use scale::{knob, percentile};

const HOST: &str = "127.0.0.1";
const FIRST_FAKE_PORT: u16 = 20_000;
const INSTANCE: &str = "bench-resync";
/// Concurrent writers filling the store.
const POPULATE_TASKS: usize = 8;

struct Knobs {
    smoke: bool,
    services: usize,
    targets: usize,
    resync_ms: u64,
    window: Duration,
    gateway_threads: usize,
    whole_phase: bool,
}

impl Knobs {
    fn read() -> Knobs {
        // `cargo bench` passes `--bench`; `cargo test --benches` does not.
        let smoke = !std::env::args().any(|arg| arg == "--bench");
        let (services, targets, resync_ms, window) = if smoke {
            (20, 4, 300, 2.0)
        } else {
            (5_000, 20, 5_000, 60.0)
        };
        Knobs {
            smoke,
            services: knob("BENCH_SERVICES", services),
            targets: knob("BENCH_TARGETS", targets),
            resync_ms: knob("BENCH_RESYNC_MS", resync_ms),
            window: Duration::from_secs_f64(knob("BENCH_WINDOW_SECONDS", window)),
            gateway_threads: knob("BENCH_GATEWAY_THREADS", 2),
            whole_phase: knob("BENCH_WHOLE_PHASE", true),
        }
    }
}

/// The registry every source reads: service `i` answers its targets' ports, so refreshes
/// change nothing.
fn registry_document(targets: usize) -> Bytes {
    let endpoints: Vec<_> = (0..targets)
        .map(|slot| json!({"host": HOST, "port": FIRST_FAKE_PORT + slot as u16}))
        .collect();
    serde_json::to_vec(&endpoints).unwrap().into()
}

async fn serve_registry(listener: TcpListener, document: Bytes) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let document = document.clone();
        tokio::spawn(async move {
            let service = service_fn(move |_: Request<Incoming>| {
                let response = Response::builder()
                    .status(StatusCode::OK)
                    .header("content-type", "application/json")
                    .body(Full::new(document.clone()))
                    .unwrap();
                async move { Ok::<_, Infallible>(response) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// One service with its source, route and targets, through the Store API; its id.
async fn populate_one(store: &Store, index: usize, targets: usize, registry: SocketAddr) -> Id {
    let spec: ServiceSpec =
        serde_json::from_value(json!({ "name": format!("svc-{index:05}") })).unwrap();
    let service = store.create_service(&spec).await.expect("service stored");
    let config = raahi::discovery::validate(
        ProviderKind::Http,
        &json!({
            "url": format!("http://{registry}/s/{index}"),
            "interval_ms": 3_600_000,
            "timeout_ms": 5_000,
        }),
    )
    .expect("valid http source");
    let source: DiscoverySourceSpec = serde_json::from_value(json!({
        "name": "registry",
        "provider": "http",
        "config": config,
        "removal_grace_ms": 60_000,
    }))
    .unwrap();
    let source = store
        .create_source(service.id, &source)
        .await
        .expect("source stored");
    let route: RouteSpec = serde_json::from_value(json!({
        "name": format!("route-{index:05}"),
        "hosts": [format!("svc-{index:05}.bench.test")],
        "service_id": service.id,
    }))
    .unwrap();
    store.create_route(&route).await.expect("route stored");
    let changes: Vec<TargetChange> = (0..targets)
        .map(|slot| {
            let port = FIRST_FAKE_PORT + slot as u16;
            TargetChange::Create(Endpoint {
                key: format!("{HOST}:{port}"),
                host: HOST.to_owned(),
                port,
                weight: raahi::model::DEFAULT_WEIGHT,
                priority: 0,
                enabled: true,
                metadata: json!({}),
            })
        })
        .collect();
    store
        .apply_target_changes(service.id, source.id, &changes)
        .await
        .expect("targets stored");
    service.id
}

async fn populate(url: &str, knobs: &Knobs, registry: SocketAddr) -> Vec<Id> {
    let store = Store::connect_as(url, "bench-populate")
        .await
        .expect("store opens");
    let mut tasks = Vec::new();
    for task in 0..POPULATE_TASKS {
        let store = store.clone();
        let (services, targets) = (knobs.services, knobs.targets);
        tasks.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            for index in (task..services).step_by(POPULATE_TASKS) {
                ids.push(populate_one(&store, index, targets, registry).await);
            }
            ids
        }));
    }
    let mut ids = Vec::new();
    for task in tasks {
        ids.extend(task.await.expect("populate task"));
    }
    ids.sort_unstable();
    ids
}

/// Rows the database returned from the tables a reload reads (sequential and index reads).
async fn rows_read(connection: &mut sqlx::PgConnection) -> Vec<(String, i64)> {
    // Statistics are flushed by the backends about once a second; read a fresh picture.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *connection)
        .await
        .expect("clear stats snapshot");
    sqlx::query_as(
        "SELECT relname::TEXT, COALESCE(seq_tup_read, 0) + COALESCE(idx_tup_fetch, 0) \
         FROM pg_stat_user_tables \
         WHERE relname IN ('targets', 'services', 'discovery_sources', 'config_changes') \
         ORDER BY relname",
    )
    .fetch_all(&mut *connection)
    .await
    .expect("table statistics")
}

/// User + system CPU of this process's threads named `raahi-gw*`, in 1/100 s.
fn gateway_cpu_ticks() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut total = 0;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        if !stat[open + 1..close].starts_with("raahi-gw") {
            continue;
        }
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let ticks = |index: usize| {
            fields
                .get(index)
                .and_then(|value| value.parse::<u64>().ok())
                .unwrap_or(0)
        };
        total += ticks(11) + ticks(12);
    }
    total
}

fn ms(duration: Duration) -> String {
    format!("{:.1}", duration.as_secs_f64() * 1000.0)
}

/// Median time of `runs` runs of `read`.
async fn median_time<F, Fut>(runs: usize, mut read: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut times = Vec::new();
    for _ in 0..runs {
        let started = Instant::now();
        read().await;
        times.push(started.elapsed());
    }
    times.sort_unstable();
    times[times.len() / 2]
}

fn weight_of(snapshot: &Snapshot, service: Id, target: Id) -> Option<u32> {
    snapshot
        .service(service)?
        .targets
        .iter()
        .find(|runtime| runtime.id == target)
        .map(|runtime| runtime.spec.weight)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The gateway as it runs: its periodic resync every `resync_ms`, nothing else to do but
    /// unnotified changes.
    PeriodicResync,
    /// Also a whole reload every `resync_ms`, forced by ending the listener's connection (a
    /// reconnect reads everything, through the same `forget_position` + apply path the periodic
    /// resync took before issue 38): what the periodic resync cost before.
    WholeEachPeriod,
}

struct Context<'a> {
    knobs: &'a Knobs,
    driver: &'a tokio::runtime::Runtime,
    control: &'a raahi::control::ControlHandle,
    url: &'a str,
    services: &'a [Id],
}

impl Context<'_> {
    fn measure(&self, phase: Phase) {
        let (knobs, driver, control, url, services) = (
            self.knobs,
            self.driver,
            self.control,
            self.url,
            self.services,
        );
        let stop = Arc::new(AtomicBool::new(false));
        let probes = {
            let control = control.clone();
            let stop = stop.clone();
            driver.spawn(async move {
                let mut round_trips = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    let _ = control.refresh_source(Id::MAX).await;
                    round_trips.push(sent.elapsed());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                round_trips
            })
        };
        let mut stats = driver.block_on(async {
            sqlx::PgConnection::connect(url)
                .await
                .expect("stats connection")
        });
        let rows_before = driver.block_on(rows_read(&mut stats));
        let full_before = control.reload_stats().full.load(Ordering::Relaxed);
        let changed_before = control.reload_stats().partial.load(Ordering::Relaxed);
        let cpu_before = gateway_cpu_ticks();
        let window_started = Instant::now();

        // Writes under the gateway's own name: its listener skips their notifications.
        let mut writer = driver.block_on(async {
            let options = sqlx::postgres::PgConnectOptions::from_str(url)
                .expect("url")
                .application_name(INSTANCE);
            sqlx::PgConnection::connect_with(&options)
                .await
                .expect("writer connection")
        });
        let period = Duration::from_millis(knobs.resync_ms);
        let mut arrivals = Vec::new();
        let mut missed = 0;
        let mut round = 0usize;
        while window_started.elapsed() + period <= knobs.window {
            if phase == Phase::WholeEachPeriod {
                let ended: Vec<bool> = driver.block_on(async {
                    sqlx::query_scalar(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                         WHERE datname = current_database() AND application_name = $1 \
                         AND query ILIKE 'LISTEN%'",
                    )
                    .bind(INSTANCE)
                    .fetch_all(&mut stats)
                    .await
                    .expect("listener ended")
                });
                assert!(ended.len() <= 1, "one listener");
            } else {
                let service = services[(round * 997) % services.len()];
                let weight = 2 + (round % 50) as u32;
                let target: Id = driver.block_on(async {
                    sqlx::query_scalar(
                        "UPDATE targets SET weight = $1 \
                         WHERE id = (SELECT MIN(id) FROM targets WHERE service_id = $2) \
                         RETURNING id",
                    )
                    .bind(i64::from(weight))
                    .bind(service)
                    .fetch_one(&mut writer)
                    .await
                    .expect("unnotified write")
                });
                let written = Instant::now();
                loop {
                    if weight_of(&control.snapshot(), service, target) == Some(weight) {
                        arrivals.push(written.elapsed());
                        break;
                    }
                    if written.elapsed() > period * 3 {
                        missed += 1;
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            round += 1;
            let next = window_started + period * round as u32;
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        std::thread::sleep(knobs.window.saturating_sub(window_started.elapsed()));

        let window = window_started.elapsed();
        let cpu = gateway_cpu_ticks() - cpu_before;
        let full = control.reload_stats().full.load(Ordering::Relaxed) - full_before;
        let changed = control.reload_stats().partial.load(Ordering::Relaxed) - changed_before;
        // Statistics reach the server about a second after the reads.
        std::thread::sleep(Duration::from_millis(1_500));
        let rows_after = driver.block_on(rows_read(&mut stats));
        stop.store(true, Ordering::Relaxed);
        let mut round_trips = driver.block_on(probes).expect("probe task");
        round_trips.sort_unstable();

        let periods = (window.as_secs_f64() * 1000.0 / knobs.resync_ms as f64).max(1.0);
        let cpu_ms = cpu as f64 * 10.0;
        println!(
            "[{phase:?}] window {:.1} s, {:.0} resync periods: reloads full {full}, changed {changed}; \
             gateway CPU {:.0} ms ({:.0} ms a period)",
            window.as_secs_f64(),
            periods,
            cpu_ms,
            cpu_ms / periods,
        );
        let rows: Vec<String> = rows_after
            .iter()
            .map(|(table, after)| {
                let before = rows_before
                    .iter()
                    .find(|(name, _)| name == table)
                    .map_or(0, |(_, rows)| *rows);
                format!("{table} {:.0}", (after - before) as f64 / periods)
            })
            .collect();
        println!("[{phase:?}] rows read a period: {}", rows.join(", "));
        println!(
            "[{phase:?}] control task round trip (every 20 ms, {} probes): p50 {} ms, p99 {} ms, max {} ms",
            round_trips.len(),
            ms(percentile(&round_trips, 0.50)),
            ms(percentile(&round_trips, 0.99)),
            ms(percentile(&round_trips, 1.0)),
        );
        if phase == Phase::PeriodicResync {
            arrivals.sort_unstable();
            println!(
                "[{phase:?}] unnotified changes: {} written, {} seen within 3 periods (p50 {} ms, max {} ms), {missed} not",
                arrivals.len() + missed,
                arrivals.len(),
                ms(percentile(&arrivals, 0.50)),
                ms(percentile(&arrivals, 1.0)),
            );
            assert_eq!(missed, 0, "every unnotified change arrives by a resync");
        }
    }
}

fn main() {
    let knobs = Knobs::read();
    let driver = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-drv")
        .enable_all()
        .build()
        .unwrap();
    let gateway_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(knobs.gateway_threads)
        .thread_name("raahi-gw")
        .enable_all()
        .build()
        .unwrap();
    println!(
        "control_resync: PostgreSQL, {} services x {} targets ({} targets), {} routes; resync every {} ms; window {:.0} s{}",
        knobs.services,
        knobs.targets,
        knobs.services * knobs.targets,
        knobs.services,
        knobs.resync_ms,
        knobs.window.as_secs_f64(),
        if knobs.smoke { " (smoke run: pass --bench for the full scale)" } else { "" },
    );
    let url = driver.block_on(postgres::fresh_database());
    let registry = driver.block_on(async {
        let listener = TcpListener::bind((HOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve_registry(listener, registry_document(knobs.targets)));
        addr
    });
    let populate_started = Instant::now();
    let services = driver.block_on(populate(&url, &knobs, registry));
    println!(
        "populated the store in {:.1} s",
        populate_started.elapsed().as_secs_f64()
    );

    // The store reads alone, before any gateway runs.
    let (load_ms, changes_ms, sources_ms) = driver.block_on(async {
        let store = Store::connect_as(&url, "bench-reads").await.expect("store");
        let runs = if knobs.smoke { 3 } else { 5 };
        let load = median_time(runs, || async {
            store.load_routing_config_at().await.expect("whole load");
        })
        .await;
        let (_, position) = store.load_routing_config_at().await.expect("whole load");
        let changes = median_time(runs, || async {
            store.changes_since(position).await.expect("change log");
        })
        .await;
        let sources = median_time(runs, || async {
            store.all_sources().await.expect("sources");
        })
        .await;
        (load, changes, sources)
    });
    println!(
        "store reads alone: whole load {} ms, change log with nothing new {} ms, every source's progress {} ms",
        ms(load_ms),
        ms(changes_ms),
        ms(sources_ms)
    );

    let env: Vec<(String, String)> = [
        ("RAAHI_PROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("RAAHI_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        (
            "RAAHI_ADMIN_TOKEN",
            "bench-admin-token-0123456789abcdef".to_owned(),
        ),
        ("RAAHI_DATABASE_URL", url.clone()),
        ("RAAHI_CLUSTER_INSTANCE_ID", INSTANCE.to_owned()),
        ("RAAHI_CLUSTER_RESYNC_MS", knobs.resync_ms.to_string()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    let config = Config::from_parts("control-resync.toml", None, &env).expect("config");
    let started = Instant::now();
    let gateway = gateway_runtime
        .block_on(gateway_runtime.spawn(async move { Gateway::start(&config).await }))
        .expect("start task")
        .expect("gateway starts");
    let control = gateway.control.clone();
    let settled = |snapshot: &Snapshot| {
        services.iter().all(|&id| {
            snapshot.service(id).is_some_and(|runtime| {
                runtime.targets.len() == knobs.targets && runtime.discovery_gap.is_none()
            })
        })
    };
    while !settled(&control.snapshot()) {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "sources did not settle"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "gateway settled {:.2} s after start",
        started.elapsed().as_secs_f64()
    );
    // Past the start's own reloads (the listener's first connection among them).
    std::thread::sleep(Duration::from_millis(knobs.resync_ms.min(3_000)));

    let context = Context {
        knobs: &knobs,
        driver: &driver,
        control: &control,
        url: &url,
        services: &services,
    };
    if knobs.whole_phase {
        context.measure(Phase::WholeEachPeriod);
    }
    context.measure(Phase::PeriodicResync);
    drop(gateway);
    gateway_runtime.shutdown_timeout(Duration::from_secs(5));
}
