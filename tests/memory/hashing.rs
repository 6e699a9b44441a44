//! Hash tables for many small services (issue 35's memory goal): 5,000 services of 20 targets
//! under `ring_hash` or `maglev` cost less than 64 MiB more than the same services round robin.
//! The snapshot is built by the control task's own builder; runs alone (see `main.rs`).

use chrono::Utc;
use raahi::control::{build_snapshot, CarriedState};
use raahi::model::{
    HashOn, Health, LbPolicy, Protocol, RoutingConfig, Service, Target, TargetState, Timeouts,
};

use crate::common::rss_kib;

const SERVICES: i64 = 5_000;
const TARGETS: i64 = 20;
const LIMIT_KIB: u64 = 64 * 1024;

fn config(policy: LbPolicy) -> RoutingConfig {
    let now = Utc::now();
    let mut config = RoutingConfig::default();
    for service_id in 1..=SERVICES {
        config.services.push(Service {
            limits: Default::default(),
            id: service_id,
            name: format!("s{service_id}"),
            protocol: Protocol::Http,
            upstream_authority: None,
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: policy,
            hash_on: policy.is_hashing().then(|| HashOn::Header("x-user".into())),
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
        for index in 0..TARGETS {
            config.targets.push(Target {
                id: service_id * 1_000 + index,
                service_id,
                source_id: Some(service_id),
                host: format!("10.{}.{}.{}", service_id / 250, service_id % 250, index),
                port: 8080,
                weight: 100,
                priority: 0,
                enabled: true,
                metadata: serde_json::json!({}),
                provider_key: Some(format!("pod-{service_id}-{index}")),
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

/// RSS growth (KiB) of holding a snapshot of `config` built from scratch.
fn snapshot_growth(config: &RoutingConfig) -> (u64, raahi::snapshot::Snapshot) {
    let before = rss_kib();
    let snapshot = build_snapshot(config, &mut CarriedState::default(), 1);
    (rss_kib().saturating_sub(before), snapshot)
}

#[tokio::test]
async fn five_thousand_hashed_services_of_twenty_targets_cost_under_64_mib_of_tables() {
    let _alone = crate::ALONE.lock().await;
    let configs = [
        config(LbPolicy::RoundRobin),
        config(LbPolicy::RingHash),
        config(LbPolicy::Maglev),
    ];
    // Every snapshot is kept until the end: memory freed by one build would otherwise hide
    // the next one's.
    let (round_robin, kept) = snapshot_growth(&configs[0]);
    let mut held = vec![kept];
    for config in &configs[1..] {
        let (hashed, snapshot) = snapshot_growth(config);
        let tables: usize = snapshot
            .services()
            .flat_map(|service| {
                let tables = service.balancer.hash_tables();
                tables
                    .tiers()
                    .map(|(_, table)| table.heap_bytes())
                    .collect::<Vec<_>>()
            })
            .sum();
        let policy = config.services[0].lb_policy.as_str();
        let extra = hashed.saturating_sub(round_robin);
        eprintln!(
            "{policy}: snapshot RSS +{hashed} KiB (round robin +{round_robin} KiB), tables {} KiB",
            tables / 1024
        );
        assert!(tables > 0, "{policy}: the snapshot holds its tables");
        assert!(
            extra < LIMIT_KIB && (tables as u64) / 1024 < LIMIT_KIB,
            "{policy}: {extra} KiB more than round robin, tables {} KiB; limit {LIMIT_KIB} KiB",
            tables / 1024
        );
        held.push(snapshot);
    }
    drop(held);
}
