//! Turns the stored configuration into a routing snapshot.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use http::uri::Authority;
use http::HeaderValue;

use crate::balance::{Balancer, Member, TargetHealth, TargetLoad};
use crate::model::{Health, Id, RoutingConfig, Target};
use crate::snapshot::{
    authority_text, RouteStats, ServiceCounters, ServiceRuntime, Snapshot, StreamStats,
    TargetRuntime,
};

/// Runtime state that outlives snapshots: per target id (in-flight, health, ejection) and per
/// service id (counters).
#[derive(Default)]
pub struct CarriedState {
    loads: HashMap<Id, Arc<TargetLoad>>,
    health: HashMap<Id, Arc<TargetHealth>>,
    counters: HashMap<Id, Arc<ServiceCounters>>,
    route_stats: HashMap<Id, Arc<RouteStats>>,
    stream_stats: HashMap<Id, Arc<StreamStats>>,
}

impl CarriedState {
    /// The live health of a target, created from its stored health the first time.
    pub fn health_of(&mut self, target: &Target) -> Arc<TargetHealth> {
        self.health
            .entry(target.id)
            .or_insert_with(|| Arc::new(TargetHealth::new(target.health)))
            .clone()
    }

    /// Health checks or passive ejection took the target out (as far as this instance saw).
    pub fn taken_out(&self, target: &Target) -> bool {
        if target.health == Health::Unhealthy {
            return true;
        }
        self.health.get(&target.id).is_some_and(|health| {
            health.health() == Health::Unhealthy
                || health.ejected_until(crate::balance::unix_ms()).is_some()
        })
    }
}

/// Builds a snapshot, reusing each surviving target's and service's runtime state and
/// forgetting that of ones that no longer exist.
pub fn build_snapshot(
    config: &RoutingConfig,
    carried: &mut CarriedState,
    generation: u64,
) -> Snapshot {
    let mut targets_by_service: HashMap<Id, Vec<&Target>> = HashMap::new();
    for target in &config.targets {
        targets_by_service
            .entry(target.service_id)
            .or_default()
            .push(target);
    }
    let existing: HashSet<Id> = config.targets.iter().map(|target| target.id).collect();
    carried.loads.retain(|id, _| existing.contains(id));
    carried.health.retain(|id, _| existing.contains(id));
    let services: HashSet<Id> = config.services.iter().map(|service| service.id).collect();
    carried.counters.retain(|id, _| services.contains(id));
    let routes: HashSet<Id> = config.routes.iter().map(|route| route.id).collect();
    carried.route_stats.retain(|id, _| routes.contains(id));
    let stream_routes: HashSet<Id> = config.stream_routes.iter().map(|route| route.id).collect();
    carried
        .stream_stats
        .retain(|id, _| stream_routes.contains(id));

    let services = config
        .services
        .iter()
        .map(|service| {
            let mut runtimes = Vec::new();
            let mut members = Vec::new();
            let eligible = targets_by_service
                .get(&service.id)
                .into_iter()
                .flatten()
                .filter(|target| target.takes_new_traffic());
            for target in eligible {
                let Some((authority, host_header)) = target_authority(target) else {
                    tracing::warn!(target_id = target.id, host = %target.host, "target address is not a valid authority; left out");
                    continue;
                };
                let load = carried.loads.entry(target.id).or_default().clone();
                let health = carried.health_of(target);
                if service.health_check.is_none() {
                    // Checks turned off: an old verdict must not keep the target out forever.
                    health.set_health(Health::Unknown);
                }
                members.push(Member {
                    weight: target.weight,
                    priority: target.priority,
                    load: load.clone(),
                });
                runtimes.push(TargetRuntime {
                    id: target.id,
                    authority,
                    host_header,
                    load,
                    health,
                });
            }
            let upstream_host = service
                .upstream_authority
                .as_deref()
                .and_then(|authority| HeaderValue::from_str(authority).ok());
            ServiceRuntime {
                service: service.clone(),
                upstream_host,
                targets: runtimes,
                balancer: Balancer::new(service.lb_policy, members),
                counters: carried.counters.entry(service.id).or_default().clone(),
            }
        })
        .collect();
    let route_stats = &mut carried.route_stats;
    let snapshot = Snapshot::with_route_stats(generation, services, config.routes.clone(), |id| {
        route_stats.entry(id).or_default().clone()
    });
    let stream_stats = &mut carried.stream_stats;
    snapshot.with_stream_routes(&config.stream_routes, |id| {
        stream_stats.entry(id).or_default().clone()
    })
}

fn target_authority(target: &Target) -> Option<(Authority, HeaderValue)> {
    let text = authority_text(&target.host, target.port);
    let header = HeaderValue::from_str(&text).ok()?;
    Some((Authority::try_from(text).ok()?, header))
}
