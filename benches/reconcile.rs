//! `reconcile` of a 10,000-target source: against an identical endpoint set (the common case, a
//! refresh where nothing changed) and with 1 % churn (100 endpoints gone, 100 new, 100 with a new
//! weight). Goal: under 20 ms per reconcile.
//!
//! Setup also reports what one `Target` costs in memory: its inline size and the heap bytes a
//! typical discovered target owns, counted by a wrapping global allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use criterion::{criterion_group, criterion_main, Criterion};
use raahi::discovery::reconcile::reconcile;
use raahi::model::{Endpoint, Health, Target, TargetChange, TargetState};
use serde_json::json;

const TARGETS: usize = 10_000;
const CHURN: usize = TARGETS / 100;
const GRACE: Duration = Duration::from_secs(60);

/// Counts heap bytes requested, so setup can measure what a `Target` owns.
struct Counting;

static ALLOCATED: AtomicUsize = AtomicUsize::new(0);
static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        System.alloc(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn now() -> DateTime<Utc> {
    DateTime::from_timestamp_millis(1_700_000_000_000).unwrap()
}

/// Endpoint `i` as the DNS providers report one: key `host:port`, an IPv4 host.
fn endpoint(i: usize, metadata: &serde_json::Value) -> Endpoint {
    let host = format!("10.{}.{}.{}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff);
    Endpoint {
        key: format!("{host}:8080"),
        host,
        port: 8080,
        weight: 100,
        priority: 0,
        enabled: true,
        metadata: metadata.clone(),
    }
}

/// What the store holds after `endpoint` was created: the same fields, active.
fn target(id: i64, endpoint: &Endpoint) -> Target {
    Target {
        id,
        service_id: 1,
        source_id: Some(1),
        host: endpoint.host.clone(),
        port: endpoint.port,
        weight: endpoint.weight,
        priority: endpoint.priority,
        enabled: endpoint.enabled,
        metadata: endpoint.metadata.clone(),
        provider_key: Some(endpoint.key.clone()),
        state: TargetState::Active,
        health: Health::Healthy,
        ejected_until: None,
        remove_at: None,
        last_check: None,
        managed_by: None,
        created_at: now(),
        updated_at: now(),
    }
}

fn current(endpoints: &[Endpoint]) -> Vec<Target> {
    endpoints
        .iter()
        .enumerate()
        .map(|(i, endpoint)| target(i as i64 + 1, endpoint))
        .collect()
}

/// The next refresh after 1 % churn: the first `CHURN` endpoints gone, `CHURN` new ones at the
/// end, and `CHURN` in the middle with a new weight.
fn churned(endpoints: &[Endpoint], metadata: &serde_json::Value) -> Vec<Endpoint> {
    let mut next: Vec<Endpoint> = endpoints[CHURN..].to_vec();
    let middle = next.len() / 2;
    for endpoint in &mut next[middle..middle + CHURN] {
        endpoint.weight = 50;
    }
    next.extend((TARGETS..TARGETS + CHURN).map(|i| endpoint(i, metadata)));
    next
}

/// Heap bytes and allocations owned by one target built the way `target` builds them.
fn heap_of(endpoint: &Endpoint) -> (usize, usize) {
    let bytes = ALLOCATED.load(Ordering::Relaxed);
    let count = ALLOCATIONS.load(Ordering::Relaxed);
    let built = black_box(target(1, endpoint));
    let owned = (
        ALLOCATED.load(Ordering::Relaxed) - bytes,
        ALLOCATIONS.load(Ordering::Relaxed) - count,
    );
    drop(built);
    owned
}

fn report_memory(metadata: &[(&str, serde_json::Value)]) {
    eprintln!(
        "size_of::<Target>() = {} bytes",
        std::mem::size_of::<Target>()
    );
    for (name, metadata) in metadata {
        let endpoint = endpoint(TARGETS - 1, metadata);
        let (bytes, allocations) = heap_of(&endpoint);
        eprintln!(
            "Target heap with {name} metadata (key {:?}): {bytes} bytes requested in {allocations} allocations, \
             {} bytes per target in total",
            endpoint.key,
            bytes + std::mem::size_of::<Target>(),
        );
    }
}

fn count_kinds(changes: &[TargetChange]) -> (usize, usize, usize) {
    let mut counts = (0, 0, 0);
    for change in changes {
        match change {
            TargetChange::Create(_) => counts.0 += 1,
            TargetChange::Refresh { .. } => counts.1 += 1,
            TargetChange::Drain { .. } => counts.2 += 1,
            TargetChange::MarkStale { .. } | TargetChange::Delete { .. } => {}
        }
    }
    counts
}

fn bench_reconcile(c: &mut Criterion) {
    let empty = json!({});
    report_memory(&[
        ("empty", empty.clone()),
        ("small", json!({"zone": "eu-west-1a", "version": "1.4.2"})),
    ]);

    let endpoints: Vec<Endpoint> = (0..TARGETS).map(|i| endpoint(i, &empty)).collect();
    let current = current(&endpoints);
    let next = churned(&endpoints, &empty);

    // The scenarios must do what they claim before their timings mean anything.
    assert!(reconcile(&current, &endpoints, now(), GRACE).is_empty());
    assert_eq!(
        count_kinds(&reconcile(&current, &next, now(), GRACE)),
        (CHURN, CHURN, CHURN)
    );

    let mut group = c.benchmark_group("reconcile_10k");
    group.bench_function("no_op", |b| {
        b.iter(|| reconcile(black_box(&current), black_box(&endpoints), now(), GRACE))
    });
    group.bench_function("churn_1pct", |b| {
        b.iter(|| reconcile(black_box(&current), black_box(&next), now(), GRACE))
    });
    group.finish();
}

criterion_group!(benches, bench_reconcile);
criterion_main!(benches);
