//! The service `benches/balance.rs` and `examples/pick_instructions.rs` pick from: `n` equal
//! targets in one tier.

use std::sync::Arc;

use chrono::Utc;
use http::uri::Authority;
use http::HeaderValue;
use raahi::balance::{identity_hash, Balancer, Member, TargetHealth, TargetLoad};
use raahi::model::{Ejection, LbPolicy, Protocol, Service, Timeouts};
use raahi::snapshot::{ServiceRuntime, TargetRuntime};

pub fn authority_of(i: usize) -> String {
    format!("127.0.0.{}:{}", 1 + i / 50_000, 10_000 + i % 50_000)
}

/// A service of `n` equal targets on 127.0.0.x, ports from 10000.
pub fn service(policy: LbPolicy, n: usize) -> ServiceRuntime {
    let loads: Vec<Arc<TargetLoad>> = (0..n).map(|_| Arc::default()).collect();
    let targets = loads
        .iter()
        .enumerate()
        .map(|(i, load)| {
            let authority = authority_of(i);
            TargetRuntime {
                spec: Default::default(),
                id: i as i64,
                host_header: HeaderValue::from_str(&authority).unwrap(),
                authority: Authority::try_from(authority).unwrap(),
                load: load.clone(),
                health: Arc::new(TargetHealth::default()),
                identity: identity_hash(&authority_of(i)),
            }
        })
        .collect();
    let members = loads
        .into_iter()
        .enumerate()
        .map(|(i, load)| Member {
            weight: 100,
            priority: 0,
            load,
            identity: identity_hash(&authority_of(i)),
        })
        .collect();
    ServiceRuntime {
        service: Arc::new(Service {
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
            locality: None,
            timeouts: Timeouts::default(),
            max_attempts: 3,
            health_check: None,
            ejection: Ejection::default(),
            managed_by: None,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        }),
        upstream_host: None,
        targets,
        balancer: Balancer::new(policy, members),
        counters: Default::default(),
        discovery_gap: None,
        sessions: None,
        locality: None,
    }
}
