//! One `Balancer::pick` at 10, 1,000 and 10,000 members spread evenly over 3 tiers, per policy:
//! `best_tier` with everything available (tier 0 wins), `failover` with all of tier 0 skipped
//! (the pick has to prove tier 0 empty, one `skip` call per tier-0 member, then picks in tier 1).
//!
//! `service_pick`: one `ServiceRuntime::pick` (the request path's call: availability of each
//! candidate, then the balancer) over 10 targets in one tier, per policy: `no_ejection` (the
//! common case: the clock is never read) and `one_ejected` (one target out: the clock is read when
//! the pick meets it).
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

#[path = "support/service.rs"]
mod support;

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use raahi::balance::{identity_hash, key_hash, Balancer, Member, TargetLoad};
use raahi::clock::unix_ms;
use raahi::model::{Ejection, LbPolicy};
use raahi::snapshot::Preference;
use support::{authority_of, service};

const SIZES: [usize; 3] = [10, 1_000, 10_000];
const PRIORITIES: [i32; 3] = [0, 10, 20];
const POLICIES: [LbPolicy; 3] = [
    LbPolicy::RoundRobin,
    LbPolicy::Random,
    LbPolicy::LeastRequest,
];

/// `n` members, the first third in tier 0, with mixed weights and in-flight counts so that the
/// schedules, alias tables and load comparisons do real work.
fn members(n: usize) -> Vec<Member> {
    (0..n)
        .map(|i| {
            let load = Arc::new(TargetLoad::default());
            for _ in 0..i % 5 {
                load.start_request();
            }
            Member {
                weight: 1 + (i % 7) as u32,
                priority: PRIORITIES[i * PRIORITIES.len() / n],
                load,
                identity: 0,
            }
        })
        .collect()
}

fn pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("pick");
    for policy in POLICIES {
        for n in SIZES {
            let members = members(n);
            let tier0 = members.iter().filter(|m| m.priority == 0).count();
            let balancer = Balancer::new(policy, members);
            // The same predicate in both variants (members below `skipped` are unavailable), so
            // they differ only in how much of the balancer they exercise.
            for (variant, skipped) in [("best_tier", 0), ("failover", tier0)] {
                group.bench_with_input(
                    BenchmarkId::new(format!("{policy:?}/{variant}"), n),
                    &balancer,
                    |b, balancer| b.iter(|| balancer.pick(|i| black_box(i) < skipped)),
                );
            }
        }
    }
    group.finish();
}

fn service_pick(c: &mut Criterion) {
    let mut group = c.benchmark_group("service_pick");
    for policy in POLICIES {
        let healthy = service(policy, 10);
        let one_ejected = service(policy, 10);
        // Out for an hour: the whole run.
        let policy_hour = Ejection {
            base_ejection_ms: 3_600_000,
            max_ejection_ms: 3_600_000,
            ..Ejection::default()
        };
        one_ejected.targets[0]
            .health
            .eject(
                unix_ms(),
                &policy_hour,
                raahi::balance::FailureCause::Timeout,
            )
            .expect("a fresh target can be ejected");
        for (variant, service) in [("no_ejection", &healthy), ("one_ejected", &one_ejected)] {
            group.bench_with_input(
                BenchmarkId::new(format!("{policy:?}/{variant}"), 10),
                service,
                |b, service| b.iter(|| black_box(service.pick(|_| false, true).is_some())),
            );
        }
    }
    group.finish();
}

/// `ServiceRuntime::pick_preferring` with a key's hash (TRAFFIC.md §5) over one tier of `n`
/// targets: `key` (the key's target, or its next choice), `bounded` (`hash_balance_factor` 125,
/// every target idle: the bound is checked on each candidate). Keys cycle through 4,096
/// hashes so that the table is not read at one place only.
fn hash_pick(c: &mut Criterion) {
    let keys: Vec<u64> = (0..4096u32)
        .map(|k| key_hash(format!("user-{k:08}").as_bytes()))
        .collect();
    let mut group = c.benchmark_group("hash_pick");
    for policy in [LbPolicy::RingHash, LbPolicy::Maglev] {
        for n in SIZES {
            let mut runtime = service(policy, n);
            for (variant, factor) in [("key", None), ("bounded", Some(125))] {
                Arc::make_mut(&mut runtime.service).hash_balance_factor = factor;
                let mut turn = 0usize;
                group.bench_with_input(
                    BenchmarkId::new(format!("{policy:?}/{variant}"), n),
                    &runtime,
                    |b, runtime| {
                        b.iter(|| {
                            turn = turn.wrapping_add(1);
                            let preference = Preference {
                                pinned: None,
                                hash: Some(keys[turn & 4095]),
                            };
                            black_box(
                                runtime
                                    .pick_preferring(None, preference, |_| false, true)
                                    .is_some(),
                            )
                        })
                    },
                );
            }
        }
    }
    group.bench_function("key_hash/36_bytes", |b| {
        b.iter(|| key_hash(black_box(b"7f9c2ba4-e88f-4f2a-9d1b-3c5e6a7b8c9d")))
    });
    group.finish();
}

/// Building one tier's table, the control task's work per changed hashing service.
fn hash_table_build(c: &mut Criterion) {
    let mut group = c.benchmark_group("hash_table_build");
    group.sample_size(20);
    for policy in [LbPolicy::RingHash, LbPolicy::Maglev] {
        for n in [20usize, 1_000, 10_000] {
            let members: Vec<Member> = (0..n)
                .map(|i| Member {
                    weight: 100,
                    priority: 0,
                    load: Arc::default(),
                    identity: identity_hash(&authority_of(i)),
                })
                .collect();
            group.bench_with_input(
                BenchmarkId::new(format!("{policy:?}"), n),
                &members,
                |b, members| b.iter(|| black_box(Balancer::new(policy, members.clone()))),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, pick, service_pick, hash_pick, hash_table_build);
criterion_main!(benches);
