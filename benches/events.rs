//! The event log under load: what recording one event costs the control task with no client,
//! and how many events a second it can record while 100 event-stream clients read each one
//! (each client a task, as the SSE handler runs them). Goal: recording stays in the low
//! microseconds, so a burst of thousands of target changes never delays the next snapshot.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use raahi::events::{
    EventBody, EventLog, EventSettings, TargetChangeKind, TargetEvent, TargetView,
};
use raahi::model::{Health, Target, TargetState};
use tokio::sync::broadcast::error::RecvError;

const CLIENTS: usize = 100;
const EVENTS: u64 = 50_000;

fn target() -> Target {
    let now = chrono::Utc::now();
    Target {
        id: 7,
        service_id: 1,
        source_id: Some(2),
        host: "10.0.3.17".into(),
        port: 8080,
        weight: 100,
        priority: 0,
        enabled: true,
        metadata: serde_json::json!({"zone": "eu-west-1a", "pod": "web-7c9d5f-x2x9q"}),
        provider_key: Some("10.0.3.17:8080".into()),
        state: TargetState::Active,
        health: Health::Healthy,
        ejected_until: None,
        remove_at: None,
        last_check: None,
        managed_by: None,
        created_at: now,
        updated_at: now,
    }
}

fn health_change(view: &TargetView) -> EventBody {
    EventBody::Target(TargetEvent {
        target_id: 7,
        source_id: Some(2),
        address: "10.0.3.17:8080".into(),
        change: TargetChangeKind::Health,
        from: Some("healthy".into()),
        to: Some("unhealthy".into()),
        reason: "3 failed checks: HTTP 500".into(),
        target: Some(view.clone()),
    })
}

/// Records `EVENTS` events while `CLIENTS` tasks read every one; returns events a second and
/// how many clients were cut off for falling behind. Paced: every `pace` events the recorder
/// waits until every client has caught up (None: never waits, as the control task does).
fn throughput_with_clients(pace: Option<u64>) -> (f64, u64) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let log = Arc::new(EventLog::new(EventSettings::default()));
    let cut_off = Arc::new(AtomicU64::new(0));
    let view = TargetView {
        target: target(),
        half_open: false,
        ejections: 0,
        in_flight: 3,
    };
    let first = log.last_id();
    let last = first + EVENTS;
    let progress: Arc<Vec<AtomicU64>> = Arc::new((0..CLIENTS).map(|_| AtomicU64::new(0)).collect());
    runtime.block_on(async {
        let mut clients = Vec::new();
        for client in 0..CLIENTS {
            let mut receiver = log.subscribe(None).receiver;
            let cut_off = cut_off.clone();
            let progress = progress.clone();
            clients.push(tokio::spawn(async move {
                let mut bytes = 0usize;
                loop {
                    match receiver.recv().await {
                        Ok(event) => {
                            bytes += event.frame.len();
                            progress[client].store(event.id - first, Ordering::Relaxed);
                            if event.id == last {
                                return bytes;
                            }
                        }
                        Err(RecvError::Lagged(_)) => {
                            cut_off.fetch_add(1, Ordering::Relaxed);
                            progress[client].store(EVENTS, Ordering::Relaxed);
                            return bytes;
                        }
                        Err(RecvError::Closed) => return bytes,
                    }
                }
            }));
        }
        let started = Instant::now();
        // The control task records from its own task; yielding between bursts as its loop does.
        for n in 1..=EVENTS {
            log.record(Some(1), health_change(&view));
            match pace {
                Some(pace) if n % pace == 0 => {
                    while progress.iter().any(|p| p.load(Ordering::Relaxed) < n) {
                        tokio::task::yield_now().await;
                    }
                }
                None if n % 256 == 0 => tokio::task::yield_now().await,
                _ => {}
            }
        }
        let elapsed = started.elapsed();
        for client in clients {
            black_box(client.await.unwrap());
        }
        (
            EVENTS as f64 / elapsed.as_secs_f64(),
            cut_off.load(Ordering::Relaxed),
        )
    })
}

fn bench_record(c: &mut Criterion) {
    let (per_second, cut_off) = throughput_with_clients(None);
    println!(
        "record with {CLIENTS} reading clients, unpaced: {per_second:.0} events/s over {EVENTS} \
         events; {cut_off} clients cut off for falling behind"
    );
    let (per_second, cut_off) = throughput_with_clients(Some(1_024));
    println!(
        "delivered to all {CLIENTS} clients (recorder waits every 1024 events): \
         {per_second:.0} events/s; {cut_off} clients cut off"
    );
    let log = EventLog::new(EventSettings::default());
    let view = TargetView {
        target: target(),
        half_open: false,
        ejections: 0,
        in_flight: 3,
    };
    let mut group = c.benchmark_group("event_log");
    group.measurement_time(Duration::from_secs(3));
    group.bench_function("record_no_client", |b| {
        b.iter(|| black_box(log.record(Some(1), health_change(&view))))
    });
    group.finish();
}

criterion_group!(benches, bench_record);
criterion_main!(benches);
