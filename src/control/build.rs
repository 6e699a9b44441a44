//! Turns the stored configuration into a routing snapshot.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use http::uri::Authority;
use http::HeaderValue;

use crate::balance::{Balancer, Member, TargetHealth, TargetLoad};
use crate::model::{Health, Id, RoutingConfig, SourceStanding, SourceState, Target};
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
                || health.ejected_until(crate::clock::unix_ms()).is_some()
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
    let mut sources_by_service: HashMap<Id, Vec<&SourceStanding>> = HashMap::new();
    for source in &config.sources {
        sources_by_service
            .entry(source.service_id)
            .or_default()
            .push(source);
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
                discovery_gap: discovery_gap(
                    sources_by_service
                        .get(&service.id)
                        .map_or(&[][..], Vec::as_slice),
                    targets_by_service
                        .get(&service.id)
                        .map_or(&[][..], Vec::as_slice),
                ),
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

/// The service's enabled sources with their states, when none of them is healthy and no
/// operator target could take traffic: then a client without a target is told that discovery,
/// not the targets, is why (DESIGN §5).
fn discovery_gap(sources: &[&SourceStanding], targets: &[&Target]) -> Option<Box<str>> {
    let sources: Vec<&SourceStanding> = sources
        .iter()
        .copied()
        .filter(|source| source.enabled)
        .collect();
    let unhealthy = |source: &&SourceStanding| {
        matches!(
            source.state,
            SourceState::Pending | SourceState::Failing | SourceState::Stale
        )
    };
    let operator_targets = targets
        .iter()
        .any(|target| target.source_id.is_none() && target.takes_new_traffic());
    if sources.is_empty() || !sources.iter().all(unhealthy) || operator_targets {
        return None;
    }
    let listed: Vec<String> = sources
        .iter()
        .map(|source| format!("{} ({})", source.name, source.state.as_str()))
        .collect();
    Some(listed.join(", ").into())
}

fn target_authority(target: &Target) -> Option<(Authority, HeaderValue)> {
    let text = authority_text(&target.host, target.port);
    let header = HeaderValue::from_str(&text).ok()?;
    Some((Authority::try_from(text).ok()?, header))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::TargetState;

    fn standing(id: Id, name: &str, state: SourceState) -> SourceStanding {
        SourceStanding {
            id,
            service_id: 1,
            name: name.to_owned(),
            enabled: state != SourceState::Disabled,
            state,
        }
    }

    fn operator_target(state: TargetState) -> Target {
        let at = chrono::DateTime::from_timestamp_millis(0).unwrap();
        Target {
            id: 9,
            service_id: 1,
            source_id: None,
            host: "10.0.0.1".to_owned(),
            port: 80,
            weight: 100,
            priority: 0,
            enabled: true,
            metadata: serde_json::json!({}),
            provider_key: None,
            state,
            health: Health::Unknown,
            ejected_until: None,
            remove_at: None,
            last_check: None,
            managed_by: None,
            created_at: at,
            updated_at: at,
        }
    }

    #[test]
    fn a_gap_names_every_enabled_source_when_none_is_healthy() {
        let sources = [
            standing(1, "dns", SourceState::Pending),
            standing(2, "http", SourceState::Stale),
            standing(3, "off", SourceState::Disabled),
        ];
        let sources: Vec<&SourceStanding> = sources.iter().collect();
        assert_eq!(
            discovery_gap(&sources, &[]).as_deref(),
            Some("dns (pending), http (stale)")
        );
    }

    #[test]
    fn no_gap_with_a_healthy_source_an_operator_target_or_no_source() {
        let failing = standing(1, "dns", SourceState::Failing);
        let healthy = standing(2, "http", SourceState::Healthy);
        assert_eq!(discovery_gap(&[&failing, &healthy], &[]), None);
        let serving = operator_target(TargetState::Active);
        assert_eq!(discovery_gap(&[&failing], &[&serving]), None);
        let draining = operator_target(TargetState::Draining);
        assert!(discovery_gap(&[&failing], &[&draining]).is_some());
        assert_eq!(discovery_gap(&[], &[]), None);
        let disabled_only = standing(1, "off", SourceState::Disabled);
        assert_eq!(discovery_gap(&[&disabled_only], &[]), None);
    }
}
