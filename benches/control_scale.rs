//! The control plane at cluster scale (issue 23): a SQLite store holding 5,000 services, each
//! with one `http` discovery source and 20 discovered targets (100,000), and 5,000 routes; then a
//! stream of changes at 10, 100 and 1,000 a second, half of them a source's endpoint set
//! changing (one endpoint replaced, then the source refreshed, as `POST …/refresh` does), half
//! of them a health-checked target's health flipping.
//!
//! Reported: the time to start with that store (until the first snapshot holds every service
//! with all its targets), change → data path latency (from the registry or upstream changing to
//! the live snapshot showing it: p50, p99, max, and changes never seen within a deadline), the
//! CPU of the gateway's threads (its tokio runtime and the SQLite worker) in cores, and RSS.
//!
//! Everything runs in this process, on 127.0.0.1 only: the gateway on its own tokio runtime
//! (threads `raahi-gw`), the registry, the health-checked upstreams and the change driver on
//! another (`bench-drv`), and a thread polling the live snapshot every millisecond
//! (`bench-observe`). The allocator is the binary's (jemalloc, same options).
//!
//! `cargo bench --bench control_scale` runs the full scale; knobs (environment):
//! `BENCH_SERVICES` (5000), `BENCH_TARGETS` (20 per service), `BENCH_HEALTH_SERVICES` (100: the
//! services with active health checks, whose targets are real listeners), `BENCH_HEALTH_INTERVAL_MS`
//! (1000), `BENCH_RATES` (`10,100,1000` changes a second), `BENCH_SECONDS` (20 per rate),
//! `BENCH_DRAIN_SECONDS` (30: how long after the last change a change may still arrive),
//! `BENCH_IDLE_SECONDS` (5: a phase without changes first), `BENCH_REMOVAL_GRACE_MS` (60000),
//! `BENCH_GATEWAY_THREADS` (2). `BENCH_SCENARIO=declarative` runs another scenario instead: the
//! same services with their targets as operator targets and a route each in a resources file,
//! applied at start on an empty store, then again at a restart on the filled store (serving
//! time, RSS, and the control task's per-tick cost once settled). Under `cargo test --benches` (no `--bench` argument) it runs a
//! small smoke version that checks every change reached the snapshot.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use raahi::config::Config;
use raahi::control::{ControlHandle, RefreshAnswer};
use raahi::gateway::Gateway;
use raahi::model::{
    DiscoverySourceSpec, Endpoint, Health, Id, ProviderKind, RouteSpec, ServiceSpec, TargetChange,
};
use raahi::snapshot::Snapshot;
use raahi::store::Store;
use serde_json::json;
use tokio::net::TcpListener;

#[path = "support/scale.rs"]
mod scale;
use scale::{knob, percentile};

const HOST: &str = "127.0.0.1";
/// Ports of the targets nobody connects to (services without health checks) start here.
const FIRST_FAKE_PORT: u16 = 20_000;
const LAST_FAKE_PORT: u16 = 65_000;

struct Knobs {
    smoke: bool,
    services: usize,
    targets: usize,
    health_services: usize,
    health_interval_ms: u64,
    rates: Vec<u32>,
    seconds: f64,
    drain_seconds: f64,
    idle_seconds: f64,
    removal_grace_ms: u64,
    gateway_threads: usize,
}

impl Knobs {
    fn read() -> Knobs {
        // `cargo bench` passes `--bench`; `cargo test --benches` does not.
        let smoke = !std::env::args().any(|arg| arg == "--bench");
        let (services, targets, health_services, interval, rates, seconds, drain, idle) = if smoke {
            (20, 4, 4, 200, "40", 1.5, 5.0, 0.5)
        } else {
            (5_000, 20, 100, 1_000, "10,100,1000", 20.0, 30.0, 5.0)
        };
        let rates: String = knob("BENCH_RATES", rates.to_owned());
        let knobs = Knobs {
            smoke,
            services: knob("BENCH_SERVICES", services),
            targets: knob("BENCH_TARGETS", targets),
            health_services: knob("BENCH_HEALTH_SERVICES", health_services),
            health_interval_ms: knob("BENCH_HEALTH_INTERVAL_MS", interval),
            rates: rates
                .split(',')
                .map(|rate| rate.trim().parse().expect("BENCH_RATES: numbers"))
                .collect(),
            seconds: knob("BENCH_SECONDS", seconds),
            drain_seconds: knob("BENCH_DRAIN_SECONDS", drain),
            idle_seconds: knob("BENCH_IDLE_SECONDS", idle),
            removal_grace_ms: knob("BENCH_REMOVAL_GRACE_MS", 60_000),
            gateway_threads: knob("BENCH_GATEWAY_THREADS", 2),
        };
        assert!(knobs.health_services <= knobs.services);
        assert!(knobs.targets >= 1 && knobs.targets < 1_000);
        knobs
    }
}

// ---------------------------------------------------------------------------------------------
// Registry and upstreams

/// One service's registry entry: its endpoints' ports (all on 127.0.0.1) and the JSON the http
/// provider reads.
struct RegistryEntry {
    ports: Vec<u16>,
    next_port: u16,
    document: Bytes,
}

impl RegistryEntry {
    fn new(ports: Vec<u16>) -> RegistryEntry {
        let next_port = ports.iter().copied().max().unwrap_or(FIRST_FAKE_PORT) + 1;
        let mut entry = RegistryEntry {
            ports,
            next_port,
            document: Bytes::new(),
        };
        entry.render();
        entry
    }

    fn render(&mut self) {
        let endpoints: Vec<_> = self
            .ports
            .iter()
            .map(|port| json!({"host": HOST, "port": port}))
            .collect();
        self.document = serde_json::to_vec(&endpoints).unwrap().into();
    }

    /// Replaces the endpoint in `slot` with one on a port never used by this service; returns
    /// the new port.
    fn replace(&mut self, slot: usize) -> u16 {
        let slot = slot % self.ports.len();
        let mut port = self.next_port;
        while self.ports.contains(&port) {
            port = if port >= LAST_FAKE_PORT {
                FIRST_FAKE_PORT
            } else {
                port + 1
            };
        }
        self.next_port = if port >= LAST_FAKE_PORT {
            FIRST_FAKE_PORT
        } else {
            port + 1
        };
        self.ports[slot] = port;
        self.render();
        port
    }
}

struct Registry {
    entries: Vec<Mutex<RegistryEntry>>,
    requests: AtomicU64,
}

impl Registry {
    fn answer(&self, request: &Request<Incoming>) -> Response<Full<Bytes>> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let index = request
            .uri()
            .path()
            .strip_prefix("/s/")
            .and_then(|index| index.parse::<usize>().ok());
        match index.and_then(|index| self.entries.get(index)) {
            Some(entry) => {
                let document = entry.lock().unwrap().document.clone();
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(document))
                    .unwrap()
            }
            None => Response::builder()
                .status(StatusCode::NOT_FOUND)
                .body(Full::new(Bytes::new()))
                .unwrap(),
        }
    }
}

/// Serves HTTP/1.1 on `listener`, one answer per request, closing each connection after its
/// response: the gateway's discovery and check clients then hold no idle connection to this
/// process, whose memory is measured with the gateway's.
async fn serve<F>(listener: TcpListener, answer: F)
where
    F: Fn(&Request<Incoming>) -> Response<Full<Bytes>> + Clone + Send + Sync + 'static,
{
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                eprintln!("accept: {error}");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let answer = answer.clone();
        tokio::spawn(async move {
            let service = service_fn(move |request: Request<Incoming>| {
                let response = answer(&request);
                async move { Ok::<_, Infallible>(response) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// An upstream of a health-checked target: 200 while `up`, else 503.
async fn start_upstream(up: Arc<AtomicBool>) -> u16 {
    let listener = TcpListener::bind((HOST, 0)).await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(serve(listener, move |_: &Request<Incoming>| {
        let status = if up.load(Ordering::Relaxed) {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from_static(b"ok\n")))
            .unwrap()
    }));
    port
}

// ---------------------------------------------------------------------------------------------
// Store population

struct BenchService {
    id: Id,
    source_id: Id,
}

fn service_name(index: usize) -> String {
    format!("svc-{index:05}")
}

/// Writes every service, source, route and discovered target through the Store API, one
/// service (source, route, and its targets in one transaction) after another.
async fn populate(
    url: &str,
    knobs: &Knobs,
    registry: SocketAddr,
    entries: &[Vec<u16>],
) -> Vec<BenchService> {
    let store = Store::connect_as(url, "bench-populate")
        .await
        .expect("store opens");
    let mut services = Vec::with_capacity(knobs.services);
    for (index, ports) in entries.iter().enumerate() {
        let mut spec = json!({ "name": service_name(index) });
        if index < knobs.health_services {
            spec["health_check"] = json!({
                "type": "http",
                "path": "/health",
                "interval_ms": knobs.health_interval_ms,
                "timeout_ms": 1000,
                "healthy_threshold": 1,
                "unhealthy_threshold": 1,
            });
        }
        let spec: ServiceSpec = serde_json::from_value(spec).unwrap();
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
            "removal_grace_ms": knobs.removal_grace_ms,
        }))
        .unwrap();
        let source = store
            .create_source(service.id, &source)
            .await
            .expect("source stored");
        let route: RouteSpec = serde_json::from_value(json!({
            "name": format!("route-{index:05}"),
            "hosts": [format!("{}.bench.test", service_name(index))],
            "service_id": service.id,
        }))
        .unwrap();
        store.create_route(&route).await.expect("route stored");
        let changes: Vec<TargetChange> = ports
            .iter()
            .map(|&port| {
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
        services.push(BenchService {
            id: service.id,
            source_id: source.id,
        });
    }
    services
}

// ---------------------------------------------------------------------------------------------
// Measuring

/// VmRSS and VmHWM of this process, MiB.
fn memory_mib() -> (f64, f64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse::<f64>().ok())
            .map_or(f64::NAN, |kib| kib / 1024.0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Starts VmHWM over from the current RSS (Linux `clear_refs` 5).
fn reset_peak_memory() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// User + system CPU of every thread of this process: tid → (name, ticks of 1/100 s, Linux's
/// USER_HZ).
fn thread_cpu() -> HashMap<u32, (String, u64)> {
    let mut threads = HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return threads;
    };
    for task in tasks.flatten() {
        let Ok(tid) = task.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_owned();
        // After the name: state is field 3, utime and stime fields 14 and 15.
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let ticks = |index: usize| {
            fields
                .get(index)
                .and_then(|value| value.parse::<u64>().ok())
                .unwrap_or(0)
        };
        threads.insert(tid, (name, ticks(11) + ticks(12)));
    }
    threads
}

#[derive(Debug, Default, Clone, Copy)]
struct Cores {
    /// The gateway's runtime threads and its SQLite connection's worker thread.
    gateway: f64,
    /// Registry, upstreams, change driver, snapshot observer.
    bench: f64,
    /// Everything else (jemalloc's background thread, the main thread).
    other: f64,
}

struct CpuWindow {
    started: Instant,
    threads: HashMap<u32, (String, u64)>,
}

impl CpuWindow {
    fn start() -> CpuWindow {
        CpuWindow {
            started: Instant::now(),
            threads: thread_cpu(),
        }
    }

    fn cores(&self) -> Cores {
        let seconds = self.started.elapsed().as_secs_f64();
        let mut ticks = [0u64; 3];
        for (tid, (name, now)) in thread_cpu() {
            let before = self.threads.get(&tid).map_or(0, |(_, ticks)| *ticks);
            let group = if name.starts_with("raahi-gw") || name.starts_with("sqlx-sqlite") {
                0
            } else if name.starts_with("bench-") {
                1
            } else {
                2
            };
            ticks[group] += now.saturating_sub(before);
        }
        let cores = |ticks: u64| ticks as f64 / 100.0 / seconds;
        Cores {
            gateway: cores(ticks[0]),
            bench: cores(ticks[1]),
            other: cores(ticks[2]),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Changes and their observation

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Kind {
    Endpoint,
    Health,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Endpoint => "endpoint set",
            Kind::Health => "health flip",
        }
    }
}

enum Expect {
    /// The service's targets in the snapshot include this authority.
    Authority { service_id: Id, authority: String },
    /// The target's live health is this.
    Health {
        service_id: Id,
        target_id: Id,
        health: Health,
    },
}

struct Pending {
    kind: Kind,
    seq: usize,
    /// Which service or health target, freed for new changes once seen.
    slot: usize,
    issued: Instant,
    expect: Expect,
}

struct Done {
    kind: Kind,
    seq: usize,
    latency: Duration,
}

#[derive(Default)]
struct Tracker {
    pending: Vec<Pending>,
    done: Vec<Done>,
    busy_services: HashSet<usize>,
    busy_targets: HashSet<usize>,
}

fn has_authority(snapshot: &Snapshot, service_id: Id, authority: &str) -> bool {
    snapshot.service(service_id).is_some_and(|service| {
        service
            .targets
            .iter()
            .any(|target| target.authority.as_str() == authority)
    })
}

fn health_of(snapshot: &Snapshot, service_id: Id, target_id: Id) -> Option<Health> {
    snapshot.service(service_id).and_then(|service| {
        service
            .targets
            .iter()
            .find(|target| target.id == target_id)
            .map(|target| target.health.health())
    })
}

/// Polls the live snapshot every millisecond and moves each change it shows from pending to
/// done. Endpoint changes are looked for only in a new snapshot generation; health lives in
/// per-target atomics, looked at on every poll.
fn observe(control: ControlHandle, tracker: Arc<Mutex<Tracker>>, stop: Arc<AtomicBool>) {
    let mut generation = u64::MAX;
    while !stop.load(Ordering::Relaxed) {
        let snapshot = control.snapshot();
        let seen_at = Instant::now();
        let new_generation = snapshot.generation != generation;
        generation = snapshot.generation;
        {
            let mut tracker = tracker.lock().unwrap();
            let Tracker {
                pending,
                done,
                busy_services,
                busy_targets,
            } = &mut *tracker;
            pending.retain(|change| {
                let seen = match &change.expect {
                    Expect::Authority {
                        service_id,
                        authority,
                    } => new_generation && has_authority(&snapshot, *service_id, authority),
                    Expect::Health {
                        service_id,
                        target_id,
                        health,
                    } => health_of(&snapshot, *service_id, *target_id) == Some(*health),
                };
                if seen {
                    done.push(Done {
                        kind: change.kind,
                        seq: change.seq,
                        latency: seen_at.saturating_duration_since(change.issued),
                    });
                    match change.kind {
                        Kind::Endpoint => busy_services.remove(&change.slot),
                        Kind::Health => busy_targets.remove(&change.slot),
                    };
                }
                !seen
            });
        }
        drop(snapshot);
        std::thread::sleep(Duration::from_millis(1));
    }
}

struct HealthTarget {
    service_id: Id,
    target_id: Id,
    up: Arc<AtomicBool>,
}

/// What the change driver works with.
struct Bench {
    control: ControlHandle,
    registry: Arc<Registry>,
    services: Vec<BenchService>,
    /// Indexes of the services whose endpoint sets change (those without health checks).
    endpoint_services: Vec<usize>,
    health_targets: Vec<HealthTarget>,
    tracker: Arc<Mutex<Tracker>>,
    answers: Arc<[AtomicU64; 4]>,
}

#[derive(Default)]
struct PhaseStats {
    issued: HashMap<Kind, usize>,
    /// Changes not issued because every candidate still had one pending.
    skipped: usize,
    /// Latest a change went out after its scheduled time (the driver's own lag).
    worst_issue_delay: Duration,
    missing: HashMap<Kind, usize>,
    done: Vec<Done>,
    cores: Cores,
    rss_mib: f64,
    drained_in: Duration,
    /// Snapshots published a second while changes were issued.
    snapshots_per_second: f64,
}

impl Bench {
    /// Issues `rate` changes a second for `seconds`, on schedule whatever the gateway does
    /// (open loop), then waits up to `drain` for the rest to show.
    async fn run_phase(&self, rate: u32, seconds: f64, drain: Duration) -> PhaseStats {
        let mut stats = PhaseStats::default();
        let total = (f64::from(rate) * seconds).round() as usize;
        let period = Duration::from_secs_f64(1.0 / f64::from(rate));
        let kinds: Vec<Kind> = [
            (!self.endpoint_services.is_empty()).then_some(Kind::Endpoint),
            (!self.health_targets.is_empty()).then_some(Kind::Health),
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut service_cursor = 0usize;
        let mut target_cursor = 0usize;
        let cpu = CpuWindow::start();
        let first_generation = self.control.snapshot().generation;
        let started = tokio::time::Instant::now();
        for seq in 0..total {
            let due = started + period.mul_f64(seq as f64);
            tokio::time::sleep_until(due).await;
            stats.worst_issue_delay = stats
                .worst_issue_delay
                .max(tokio::time::Instant::now().saturating_duration_since(due));
            let kind = kinds[seq % kinds.len()];
            let issued = match kind {
                Kind::Endpoint => self.change_endpoints(seq, &mut service_cursor),
                Kind::Health => self.flip_health(seq, &mut target_cursor),
            };
            if issued {
                *stats.issued.entry(kind).or_default() += 1;
            } else {
                stats.skipped += 1;
            }
        }
        stats.cores = cpu.cores();
        stats.snapshots_per_second = (self.control.snapshot().generation - first_generation) as f64
            / started.elapsed().as_secs_f64();
        let drain_started = Instant::now();
        while drain_started.elapsed() < drain && !self.tracker.lock().unwrap().pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stats.drained_in = drain_started.elapsed();
        let mut tracker = self.tracker.lock().unwrap();
        for change in tracker.pending.drain(..) {
            *stats.missing.entry(change.kind).or_default() += 1;
        }
        tracker.busy_services.clear();
        tracker.busy_targets.clear();
        stats.done = std::mem::take(&mut tracker.done);
        stats.rss_mib = memory_mib().0;
        stats
    }

    /// Replaces one endpoint of the next service without a pending change, then asks for the
    /// source's refresh. False when every candidate is busy.
    fn change_endpoints(&self, seq: usize, cursor: &mut usize) -> bool {
        let mut tracker = self.tracker.lock().unwrap();
        let candidates = self.endpoint_services.len();
        let Some(position) = (0..candidates)
            .map(|step| (*cursor + step) % candidates)
            .find(|position| {
                !tracker
                    .busy_services
                    .contains(&self.endpoint_services[*position])
            })
        else {
            return false;
        };
        *cursor = (position + 1) % candidates;
        let index = self.endpoint_services[position];
        let service = &self.services[index];
        let issued = Instant::now();
        let port = self.registry.entries[index]
            .lock()
            .unwrap()
            .replace(seq / 2);
        tracker.busy_services.insert(index);
        tracker.pending.push(Pending {
            kind: Kind::Endpoint,
            seq,
            slot: index,
            issued,
            expect: Expect::Authority {
                service_id: service.id,
                authority: format!("{HOST}:{port}"),
            },
        });
        drop(tracker);
        let control = self.control.clone();
        let answers = self.answers.clone();
        let source_id = service.source_id;
        tokio::spawn(async move {
            let slot = match control.refresh_source(source_id).await {
                Ok(RefreshAnswer::Queued) => 0,
                Ok(RefreshAnswer::Joined) => 1,
                Ok(_) => 2,
                Err(_) => 3,
            };
            answers[slot].fetch_add(1, Ordering::Relaxed);
        });
        true
    }

    /// Turns the next health-checked target without a pending change up or down.
    fn flip_health(&self, seq: usize, cursor: &mut usize) -> bool {
        let mut tracker = self.tracker.lock().unwrap();
        let candidates = self.health_targets.len();
        let Some(index) = (0..candidates)
            .map(|step| (*cursor + step) % candidates)
            .find(|index| !tracker.busy_targets.contains(index))
        else {
            return false;
        };
        *cursor = (index + 1) % candidates;
        let target = &self.health_targets[index];
        let issued = Instant::now();
        let up = !target.up.fetch_xor(true, Ordering::Relaxed);
        tracker.busy_targets.insert(index);
        tracker.pending.push(Pending {
            kind: Kind::Health,
            seq,
            slot: index,
            issued,
            expect: Expect::Health {
                service_id: target.service_id,
                target_id: target.target_id,
                health: if up {
                    Health::Healthy
                } else {
                    Health::Unhealthy
                },
            },
        });
        true
    }
}

fn ms(duration: Duration) -> String {
    let ms = duration.as_secs_f64() * 1000.0;
    if ms < 10.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.0}")
    }
}

/// Latencies of one kind: count, p50, p99, max, and the p50 of the first and the last quarter
/// of the changes issued (a growing backlog shows as a later quarter that is slower).
struct KindSummary {
    seen: usize,
    p50: Duration,
    p99: Duration,
    max: Duration,
    first_quarter_p50: Duration,
    last_quarter_p50: Duration,
}

fn summarise(done: &[Done], kind: Kind) -> KindSummary {
    let mut by_seq: Vec<(usize, Duration)> = done
        .iter()
        .filter(|change| change.kind == kind)
        .map(|change| (change.seq, change.latency))
        .collect();
    by_seq.sort_unstable();
    let quarter = |part: &[(usize, Duration)]| {
        let mut latencies: Vec<Duration> = part.iter().map(|(_, latency)| *latency).collect();
        latencies.sort_unstable();
        percentile(&latencies, 0.5)
    };
    let n = by_seq.len();
    let first_quarter_p50 = quarter(&by_seq[..n / 4]);
    let last_quarter_p50 = quarter(&by_seq[n - n / 4..]);
    let mut latencies: Vec<Duration> = by_seq.iter().map(|(_, latency)| *latency).collect();
    latencies.sort_unstable();
    KindSummary {
        seen: n,
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
        max: latencies.last().copied().unwrap_or_default(),
        first_quarter_p50,
        last_quarter_p50,
    }
}

// ---------------------------------------------------------------------------------------------

/// What the control task's periodic work cost per turn over a window.
struct WatchWindow {
    ticks: u64,
    tick_nanos: u64,
    looks: u64,
    look_nanos: u64,
}

impl WatchWindow {
    fn start(control: &ControlHandle) -> WatchWindow {
        let stats = control.watch_stats();
        WatchWindow {
            ticks: stats.ticks.load(Ordering::Relaxed),
            tick_nanos: stats.tick_nanos.load(Ordering::Relaxed),
            looks: stats.timer_looks.load(Ordering::Relaxed),
            look_nanos: stats.timer_look_nanos.load(Ordering::Relaxed),
        }
    }

    /// µs per runtime-watch tick and per look for the next timer since `start`.
    fn micros(&self, control: &ControlHandle) -> (f64, f64) {
        let now = WatchWindow::start(control);
        let per = |nanos: u64, count: u64| nanos as f64 / 1_000.0 / count.max(1) as f64;
        (
            per(now.tick_nanos - self.tick_nanos, now.ticks - self.ticks),
            per(now.look_nanos - self.look_nanos, now.looks - self.looks),
        )
    }
}

/// The resources file of `BENCH_SCENARIO=declarative`: every service with its targets as
/// operator targets (on ports nobody listens on) and one route each.
fn declarative_file(knobs: &Knobs) -> String {
    let mut text = String::with_capacity(knobs.services * knobs.targets * 48);
    for index in 0..knobs.services {
        text.push_str(&format!(
            "[[services]]\nname = \"{}\"\n",
            service_name(index)
        ));
        for slot in 0..knobs.targets {
            text.push_str(&format!(
                "[[services.targets]]\nhost = \"{HOST}\"\nport = {}\n",
                FIRST_FAKE_PORT as usize + slot
            ));
        }
    }
    for index in 0..knobs.services {
        text.push_str(&format!(
            "[[routes]]\nname = \"route-{index:05}\"\nhosts = [\"{}.bench.test\"]\nservice = \"{}\"\n",
            service_name(index),
            service_name(index)
        ));
    }
    text
}

/// `BENCH_SCENARIO=declarative`: a gateway starting from a resources file on an empty store,
/// then again on the store it filled; the watch's cost and RSS once settled.
fn declarative(knobs: &Knobs) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/raahi.db", dir.path().display());
    let file = dir.path().join("resources.toml");
    std::fs::write(&file, declarative_file(knobs)).expect("resources file written");
    let gateway_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(knobs.gateway_threads)
        .thread_name("raahi-gw")
        .enable_all()
        .build()
        .unwrap();
    let env: Vec<(String, String)> = [
        ("RAAHI_PROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("RAAHI_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        (
            "RAAHI_ADMIN_TOKEN",
            "bench-admin-token-0123456789abcdef".to_owned(),
        ),
        ("RAAHI_DATABASE_URL", url.clone()),
        ("RAAHI_RESOURCES_FILE", file.display().to_string()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    println!(
        "declarative: {} services x {} operator targets ({}), {} routes, in a {:.1} MiB file",
        knobs.services,
        knobs.targets,
        knobs.services * knobs.targets,
        knobs.services,
        std::fs::metadata(&file).map_or(0.0, |meta| meta.len() as f64 / 1048576.0)
    );
    for run in ["empty store", "filled store"] {
        let config = Config::from_parts("control-scale.toml", None, &env).expect("config");
        let (rss_before, _) = memory_mib();
        let started = Instant::now();
        let gateway = gateway_runtime
            .block_on(gateway_runtime.spawn(async move { Gateway::start(&config).await }))
            .expect("start task")
            .expect("gateway starts");
        let serving = started.elapsed();
        let counts = gateway.resources.as_ref().expect("resources applied").1;
        let control = gateway.control.clone();
        let snapshot = control.snapshot();
        let targets: usize = snapshot
            .services()
            .map(|service| service.targets.len())
            .sum();
        drop(snapshot);
        assert_eq!(targets, knobs.services * knobs.targets, "every target live");
        println!(
            "start on the {run}: serving after {:.2} s (created {}, unchanged {}); RSS {rss_before:.0} MiB before",
            serving.as_secs_f64(),
            counts.created,
            counts.unchanged,
        );
        std::thread::sleep(Duration::from_secs_f64(knobs.idle_seconds));
        let window = WatchWindow::start(&control);
        std::thread::sleep(Duration::from_secs_f64(knobs.idle_seconds));
        let (tick, look) = window.micros(&control);
        let (rss, peak) = memory_mib();
        println!(
            "  settled: RSS {rss:.0} MiB (peak {peak:.0}); runtime watch {tick:.1} µs a tick, \
             next-timer look {look:.1} µs a turn"
        );
        gateway_runtime.block_on(async {
            gateway_runtime
                .spawn(gateway.shutdown())
                .await
                .expect("shutdown task")
        });
    }
    gateway_runtime.shutdown_timeout(Duration::from_secs(5));
}

fn main() {
    let knobs = Knobs::read();
    if std::env::var("BENCH_SCENARIO").as_deref() == Ok("declarative") {
        declarative(&knobs);
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/raahi.db", dir.path().display());
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
        "control_scale: {} services x {} targets ({} targets), {} routes; {} services health-checked every {} ms; rates {:?}/s for {} s each{}",
        knobs.services,
        knobs.targets,
        knobs.services * knobs.targets,
        knobs.services,
        knobs.health_services,
        knobs.health_interval_ms,
        knobs.rates,
        knobs.seconds,
        if knobs.smoke { " (smoke run: pass --bench for the full scale)" } else { "" },
    );

    // Upstreams of the health-checked services, then the registry.
    let (health_flags, mut entries, registry_addr) = driver.block_on(async {
        let mut flags: Vec<Vec<Arc<AtomicBool>>> = Vec::new();
        let mut entries: Vec<Vec<u16>> = Vec::new();
        for _ in 0..knobs.health_services {
            let mut service_flags = Vec::new();
            let mut ports = Vec::new();
            for _ in 0..knobs.targets {
                let up = Arc::new(AtomicBool::new(true));
                ports.push(start_upstream(up.clone()).await);
                service_flags.push(up);
            }
            flags.push(service_flags);
            entries.push(ports);
        }
        for _ in knobs.health_services..knobs.services {
            entries.push(
                (0..knobs.targets)
                    .map(|slot| FIRST_FAKE_PORT + slot as u16)
                    .collect(),
            );
        }
        let listener = TcpListener::bind((HOST, 0)).await.unwrap();
        (flags, entries, listener)
    });
    let registry = Arc::new(Registry {
        entries: entries
            .iter()
            .map(|ports| Mutex::new(RegistryEntry::new(ports.clone())))
            .collect(),
        requests: AtomicU64::new(0),
    });
    let registry_addr = {
        let listener = registry_addr;
        let addr = listener.local_addr().unwrap();
        let registry = registry.clone();
        driver.spawn(serve(listener, move |request: &Request<Incoming>| {
            registry.answer(request)
        }));
        addr
    };

    let populate_started = Instant::now();
    let services = driver.block_on(populate(&url, &knobs, registry_addr, &entries));
    let populate_time = populate_started.elapsed();
    entries.clear();
    println!(
        "populated the store in {:.1} s ({} services, {} sources, {} routes, {} targets)",
        populate_time.as_secs_f64(),
        services.len(),
        services.len(),
        services.len(),
        services.len() * knobs.targets
    );

    // Start: from Gateway::start to a snapshot with every service and all its targets.
    let env: Vec<(String, String)> = [
        ("RAAHI_PROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("RAAHI_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        (
            "RAAHI_ADMIN_TOKEN",
            "bench-admin-token-0123456789abcdef".to_owned(),
        ),
        ("RAAHI_DATABASE_URL", url.clone()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    let config = Config::from_parts("control-scale.toml", None, &env).expect("config");
    // Let the population's allocations go back before the baseline is read.
    std::thread::sleep(Duration::from_millis(if knobs.smoke { 100 } else { 1500 }));
    let (rss_before, _) = memory_mib();
    reset_peak_memory();
    let start_cpu = CpuWindow::start();
    let started = Instant::now();
    let gateway = gateway_runtime
        .block_on(gateway_runtime.spawn(async move { Gateway::start(&config).await }))
        .expect("start task")
        .expect("gateway starts");
    let start_returned = started.elapsed();
    let control = gateway.control.clone();
    let complete = |snapshot: &Snapshot| {
        services.iter().all(|service| {
            snapshot
                .service(service.id)
                .is_some_and(|runtime| runtime.targets.len() == knobs.targets)
        })
    };
    while !complete(&control.snapshot()) {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "no complete snapshot"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let first_complete = started.elapsed();
    let (rss_started, _) = memory_mib();
    let serving = driver.block_on(async {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let host = if knobs.health_services > 0 {
            format!("{}.bench.test", service_name(0))
        } else {
            "unrouted.bench.test".to_owned()
        };
        client
            .get(format!("http://{}/", gateway.proxy_addr))
            .header("host", host)
            .send()
            .await
            .map(|response| response.status().as_u16())
    });
    // Every source refreshes once at start (its runner starts with no delay): settled when each
    // service's sources are healthy in the live snapshot and every checked target is healthy.
    let settled = |snapshot: &Snapshot| {
        services.iter().enumerate().all(|(index, service)| {
            snapshot.service(service.id).is_some_and(|runtime| {
                runtime.discovery_gap.is_none()
                    && (index >= knobs.health_services
                        || runtime
                            .targets
                            .iter()
                            .all(|target| target.health.health() == Health::Healthy))
            })
        })
    };
    while !settled(&control.snapshot()) {
        if started.elapsed() > Duration::from_secs(600) {
            panic!("sources did not settle within 600 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let settled_at = started.elapsed();
    let start_cores = start_cpu.cores();
    let (rss_settled, peak_start) = memory_mib();
    println!(
        "start: Gateway::start returned after {:.2} s; first snapshot with all {} services x {} targets at {:.2} s; \
         proxy answered {:?}; every source refreshed and healthy at {:.2} s ({} registry requests; gateway {:.2} cores meanwhile)",
        start_returned.as_secs_f64(),
        knobs.services,
        knobs.targets,
        first_complete.as_secs_f64(),
        serving,
        settled_at.as_secs_f64(),
        registry.requests.load(Ordering::Relaxed),
        start_cores.gateway,
    );
    println!(
        "memory: RSS {rss_before:.0} MiB before start (bench harness), {rss_started:.0} MiB at the first complete snapshot, \
         {rss_settled:.0} MiB settled, peak {peak_start:.0} MiB"
    );

    // The health-checked targets, by the ports their upstreams listen on.
    let snapshot = control.snapshot();
    let mut health_targets = Vec::new();
    for (index, flags) in health_flags.iter().enumerate() {
        let service = &services[index];
        let ports = registry.entries[index].lock().unwrap().ports.clone();
        let runtime = snapshot.service(service.id).expect("service in snapshot");
        for (port, up) in ports.iter().zip(flags) {
            let authority = format!("{HOST}:{port}");
            let target = runtime
                .targets
                .iter()
                .find(|target| target.authority.as_str() == authority)
                .expect("checked target in snapshot");
            health_targets.push(HealthTarget {
                service_id: service.id,
                target_id: target.id,
                up: up.clone(),
            });
        }
    }
    drop(snapshot);

    let tracker = Arc::new(Mutex::new(Tracker::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let observer = {
        let (control, tracker, stop) = (control.clone(), tracker.clone(), stop.clone());
        std::thread::Builder::new()
            .name("bench-observe".to_owned())
            .spawn(move || observe(control, tracker, stop))
            .unwrap()
    };
    let bench = Bench {
        control: control.clone(),
        registry: registry.clone(),
        endpoint_services: (knobs.health_services..knobs.services).collect(),
        services,
        health_targets,
        tracker,
        answers: Arc::new(Default::default()),
    };

    let idle = {
        let cpu = CpuWindow::start();
        let watch = WatchWindow::start(&control);
        std::thread::sleep(Duration::from_secs_f64(knobs.idle_seconds));
        let (tick, look) = watch.micros(&control);
        println!(
            "idle: runtime watch {tick:.1} µs a tick, next-timer look {look:.1} µs a turn of the control loop; \
             RSS {:.0} MiB after the idle phase",
            memory_mib().0
        );
        cpu.cores()
    };
    let mut rows = Vec::new();
    for &rate in &knobs.rates {
        let stats = driver.block_on(bench.run_phase(
            rate,
            knobs.seconds,
            Duration::from_secs_f64(knobs.drain_seconds),
        ));
        println!(
            "rate {rate}/s: issued {:?}, skipped {} (all candidates busy), worst issue delay {} ms, \
             drained in {:.1} s; gateway {:.2} cores, bench {:.2}, other {:.2}",
            stats.issued,
            stats.skipped,
            ms(stats.worst_issue_delay),
            stats.drained_in.as_secs_f64(),
            stats.cores.gateway,
            stats.cores.bench,
            stats.cores.other,
        );
        rows.push((rate, stats));
    }
    stop.store(true, Ordering::Relaxed);
    observer.join().unwrap();
    let (rss_end, peak) = memory_mib();
    let answers: Vec<u64> = bench
        .answers
        .iter()
        .map(|count| count.load(Ordering::Relaxed))
        .collect();

    println!();
    println!(
        "Start with {} targets in the store: serving (first complete snapshot) in {:.2} s, every \
         source refreshed in {:.2} s; RSS {:.0} MiB at start, {:.0} MiB settled, {:.0} MiB at the \
         end, peak {:.0} MiB (harness alone {:.0} MiB). Idle (health checks only): gateway {:.2} cores.",
        knobs.services * knobs.targets,
        first_complete.as_secs_f64(),
        settled_at.as_secs_f64(),
        rss_started,
        rss_settled,
        rss_end,
        peak,
        rss_before,
        idle.gateway,
    );
    println!();
    println!("| rate/s | kind | changes | p50 ms | p99 ms | max ms | missing | p50 first → last quarter ms | snapshots/s | gateway cores | RSS MiB |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut failures = Vec::new();
    for (rate, stats) in &rows {
        for kind in [Kind::Endpoint, Kind::Health] {
            let issued = stats.issued.get(&kind).copied().unwrap_or(0);
            if issued == 0 {
                continue;
            }
            let summary = summarise(&stats.done, kind);
            let missing = stats.missing.get(&kind).copied().unwrap_or(0);
            println!(
                "| {rate} | {} | {issued} | {} | {} | {} | {missing} | {} → {} | {:.1} | {:.2} | {:.0} |",
                kind.label(),
                ms(summary.p50),
                ms(summary.p99),
                ms(summary.max),
                ms(summary.first_quarter_p50),
                ms(summary.last_quarter_p50),
                stats.snapshots_per_second,
                stats.cores.gateway,
                stats.rss_mib,
            );
            if missing > 0 || summary.seen != issued {
                failures.push(format!(
                    "{rate}/s {}: {missing} of {issued} never reached the snapshot",
                    kind.label()
                ));
            }
        }
    }
    println!();
    println!(
        "refresh requests answered: queued {}, joined {}, disabled/unknown {}, failed {}",
        answers[0], answers[1], answers[2], answers[3]
    );

    driver.block_on(async {
        if tokio::time::timeout(Duration::from_secs(30), async {
            gateway_runtime
                .spawn(gateway.shutdown())
                .await
                .expect("shutdown task")
        })
        .await
        .is_err()
        {
            eprintln!("gateway shutdown took over 30 s");
        }
    });
    gateway_runtime.shutdown_timeout(Duration::from_secs(5));
    driver.shutdown_timeout(Duration::from_secs(5));
    drop(dir);
    if knobs.smoke {
        assert!(failures.is_empty(), "{failures:?}");
        assert!(rows.iter().all(|(_, stats)| stats.issued.len() == 2));
    } else if !failures.is_empty() {
        println!("changes missing: {failures:?}");
    }
}
