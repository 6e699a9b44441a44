//! Building a routing snapshot (the control task's work after each change) with 10,000 targets.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;

use chrono::Utc;
use criterion::{criterion_group, criterion_main, Criterion};
use raahi::control::{build_snapshot, CarriedState};
use raahi::model::{
    Health, LbPolicy, Protocol, Route, RoutingConfig, Service, Target, TargetState, Timeouts,
};

fn config(services: i64, targets_per_service: i64) -> RoutingConfig {
    let now = Utc::now();
    let mut config = RoutingConfig::default();
    for service_id in 1..=services {
        config.services.push(Service {
            limits: raahi::model::UpstreamLimits::default(),
            id: service_id,
            name: format!("s{service_id}"),
            protocol: Protocol::Http,
            upstream_authority: None,
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: LbPolicy::RoundRobin,
            hash_on: None,
            hash_balance_factor: None,
            session_persistence: None,
            locality: None,
            timeouts: Timeouts::default(),
            max_attempts: 3,
            health_check: None,
            ejection: Default::default(),
            managed_by: None,
            created_at: now,
            updated_at: now,
        });
        config.routes.push(Route {
            id: service_id,
            name: format!("r{service_id}"),
            hosts: vec![format!("s{service_id}.test")],
            path_prefix: Some("/".into()),
            service_id: Some(service_id),
            backends: vec![raahi::model::Backend::whole(service_id)],
            request_buffer_bytes: raahi::model::DEFAULT_REQUEST_BUFFER_BYTES,
            upgrades: raahi::model::default_upgrades(),
            created_at: now,
            updated_at: now,
            ..Route::default()
        });
        for index in 0..targets_per_service {
            let id = service_id * 1_000_000 + index;
            config.targets.push(Target {
                id,
                service_id,
                source_id: None,
                host: format!("10.{}.{}.{}", service_id % 250, index / 250, index % 250),
                port: 8080,
                weight: 1 + (index % 7) as u32,
                priority: (index % 3) as i32,
                enabled: true,
                metadata: serde_json::json!({}),
                provider_key: Some(format!("k{index}")),
                state: TargetState::Active,
                health: Health::Unknown,
                ejected_until: None,
                remove_at: None,
                last_check: None,
                managed_by: None,
                created_at: now,
                updated_at: now,
            });
        }
    }
    config
}

fn builds(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot_build_10000_targets");
    group.sample_size(20);
    for (services, per_service) in [(1, 10_000), (100, 100)] {
        let config = config(services, per_service);
        let mut carried = CarriedState::default();
        build_snapshot(&config, &mut carried, 0);
        group.bench_function(format!("{services}_services"), |b| {
            let mut generation = 0;
            b.iter(|| {
                generation += 1;
                black_box(build_snapshot(&config, &mut carried, generation))
            })
        });
    }
    group.finish();
}

criterion_group!(benches, builds);
criterion_main!(benches);
