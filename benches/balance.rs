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

use std::hint::black_box;
use std::sync::Arc;

use chrono::Utc;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::uri::Authority;
use http::HeaderValue;
use raahi::balance::{Balancer, Member, TargetHealth, TargetLoad};
use raahi::clock::unix_ms;
use raahi::model::{Ejection, LbPolicy, Protocol, Service, Timeouts};
use raahi::snapshot::{ServiceRuntime, TargetRuntime};

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

/// A service of `n` equal targets on 127.0.0.1, ports from 10000.
fn service(policy: LbPolicy, n: usize) -> ServiceRuntime {
    let loads: Vec<Arc<TargetLoad>> = (0..n).map(|_| Arc::default()).collect();
    let targets = loads
        .iter()
        .enumerate()
        .map(|(i, load)| {
            let authority = format!("127.0.0.1:{}", 10_000 + i);
            TargetRuntime {
                spec: Default::default(),
                id: i as i64,
                host_header: HeaderValue::from_str(&authority).unwrap(),
                authority: Authority::try_from(authority).unwrap(),
                load: load.clone(),
                health: Arc::new(TargetHealth::default()),
                identity: 0,
            }
        })
        .collect();
    let members = loads
        .into_iter()
        .map(|load| Member {
            weight: 1,
            priority: 0,
            load,
            identity: 0,
        })
        .collect();
    ServiceRuntime {
        service: Service {
            limits: raahi::model::UpstreamLimits::default(),
            id: 1,
            name: "bench".into(),
            protocol: Protocol::Http,
            upstream_authority: None,
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: policy,
            hash_on: None,
            hash_balance_factor: None,
            session_persistence: None,
            timeouts: Timeouts::default(),
            max_attempts: 3,
            health_check: None,
            ejection: Ejection::default(),
            managed_by: None,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        },
        upstream_host: None,
        targets,
        balancer: Balancer::new(policy, members),
        counters: Default::default(),
        discovery_gap: None,
        sessions: None,
    }
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

criterion_group!(benches, pick, service_pick);
criterion_main!(benches);
