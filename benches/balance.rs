//! One `Balancer::pick` at 10, 1,000 and 10,000 members spread evenly over 3 tiers, per policy:
//! `best_tier` with everything available (tier 0 wins), `failover` with all of tier 0 skipped
//! (the pick has to prove tier 0 empty, one `skip` call per tier-0 member, then picks in tier 1).

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use raahi::balance::{Balancer, Member, TargetLoad};
use raahi::model::LbPolicy;

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

criterion_group!(benches, pick);
criterion_main!(benches);
