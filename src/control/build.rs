//! Turns the stored configuration into a routing snapshot.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use http::uri::Authority;
use http::HeaderValue;

use super::desired::Desired;
use crate::balance::{
    identity_hash, Balancer, ChangeMarks, HashTables, Member, Slots, TargetHealth, TargetLoad,
};
use crate::model::{
    Health, Id, Route, RoutingConfig, Service, SourceStanding, SourceState, Target, TargetState,
};
use crate::snapshot::{
    authority_text, RouteStats, ServiceCounters, ServiceRuntime, SessionTargets, Snapshot,
    SnapshotChange, StreamStats, TargetRuntime, ZoneSplit,
};
use crate::store::ChangeSet;

/// Runtime state that outlives snapshots: per target id (in-flight, health, ejection) and per
/// service id (counters).
#[derive(Default)]
pub struct CarriedState {
    loads: HashMap<Id, Arc<TargetLoad>>,
    health: HashMap<Id, Arc<TargetHealth>>,
    counters: HashMap<Id, Arc<ServiceCounters>>,
    route_stats: HashMap<Id, Arc<RouteStats>>,
    stream_stats: HashMap<Id, Arc<StreamStats>>,
    /// Every target id of each service as last built, to forget the state of the ones a
    /// service's rebuild no longer has.
    service_targets: HashMap<Id, Vec<Id>>,
    /// Hashing services' tables, reused by the next build of a tier whose members are the same.
    hash_tables: HashMap<Id, HashTables>,
    /// The gateway's zone (`cluster.zone`), fixed for the process: services with `locality`
    /// are split against it at every build.
    zone: Option<Arc<str>>,
    /// Which targets' health or ejection moved since the runtime watch last looked.
    marks: Arc<ChangeMarks>,
    slots: Slots,
}

/// The targets whose health or ejection moved since the last look.
pub(super) struct MovedTargets {
    pub(super) ids: Vec<Id>,
    /// Some moved without a place in the marks: look at every target.
    pub(super) everything: bool,
}

impl CarriedState {
    /// Nothing carried yet, for a gateway in `zone`.
    pub fn in_zone(zone: Option<Arc<str>>) -> CarriedState {
        CarriedState {
            zone,
            ..CarriedState::default()
        }
    }

    /// The live health of a target, created from its stored health the first time.
    pub fn health_of(&mut self, target: &Target) -> Arc<TargetHealth> {
        let CarriedState {
            health,
            marks,
            slots,
            ..
        } = self;
        health
            .entry(target.id)
            .or_insert_with(|| {
                let mark = marks.mark(slots.take(target.id));
                Arc::new(TargetHealth::marked(target.health, mark))
            })
            .clone()
    }

    /// Takes the targets whose health or ejection moved since the last call.
    pub(super) fn take_moved(&mut self) -> MovedTargets {
        let moved = self.marks.take();
        MovedTargets {
            ids: moved
                .slots
                .iter()
                .filter_map(|slot| self.slots.owner(*slot))
                .collect(),
            everything: moved.everything,
        }
    }

    fn forget_health(&mut self, id: Id) {
        if let Some(slot) = self.health.remove(&id).and_then(|health| health.slot()) {
            self.slots.give_back(slot);
        }
    }

    fn forget_gone_targets(&mut self, service_id: Id, targets: &[Arc<Target>]) {
        let Some(before) = self.service_targets.get(&service_id) else {
            return;
        };
        let now: HashSet<Id> = targets.iter().map(|target| target.id).collect();
        for id in before.iter().filter(|id| !now.contains(id)) {
            self.loads.remove(id);
            if let Some(slot) = self.health.remove(id).and_then(|health| health.slot()) {
                self.slots.give_back(slot);
            }
        }
    }

    fn forget_service(&mut self, service_id: Id) {
        self.forget_gone_targets(service_id, &[]);
        self.service_targets.remove(&service_id);
        self.counters.remove(&service_id);
        self.hash_tables.remove(&service_id);
    }

    fn forget_missing_routes(&mut self, desired: &Desired) {
        let routes: HashSet<Id> = desired.routes.iter().map(|route| route.id).collect();
        self.route_stats.retain(|id, _| routes.contains(id));
        let stream_routes: HashSet<Id> =
            desired.stream_routes.iter().map(|route| route.id).collect();
        self.stream_stats.retain(|id, _| stream_routes.contains(id));
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
    build_full(&Desired::from_config(config.clone()), carried, generation)
}

/// Builds every part of a snapshot anew (at start, and when the change log cannot say what
/// changed).
pub(super) fn build_full(
    desired: &Desired,
    carried: &mut CarriedState,
    generation: u64,
) -> Snapshot {
    let existing: HashSet<Id> = desired.all_targets().map(|target| target.id).collect();
    carried.loads.retain(|id, _| existing.contains(id));
    let gone: Vec<Id> = carried
        .health
        .keys()
        .filter(|id| !existing.contains(id))
        .copied()
        .collect();
    for id in gone {
        carried.forget_health(id);
    }
    carried
        .counters
        .retain(|id, _| desired.services.contains_key(id));
    carried.service_targets.clear();
    carried
        .hash_tables
        .retain(|id, _| desired.services.contains_key(id));
    carried.forget_missing_routes(desired);
    let services = desired
        .services
        .values()
        .map(|service| build_service(desired, service, carried))
        .collect();
    let route_stats = &mut carried.route_stats;
    let snapshot = Snapshot::with_route_stats(generation, services, routes_of(desired), |id| {
        route_stats.entry(id).or_default().clone()
    });
    let stream_stats = &mut carried.stream_stats;
    snapshot.with_stream_routes(&desired.stream_routes, |id| {
        stream_stats.entry(id).or_default().clone()
    })
}

/// Builds the next snapshot from `previous`, rebuilding only the services, routes and stream
/// routes `changes` names; the rest is shared.
pub(super) fn build_changed(
    previous: &Snapshot,
    desired: &Desired,
    changes: &ChangeSet,
    carried: &mut CarriedState,
    generation: u64,
) -> Snapshot {
    let mut change = SnapshotChange::default();
    for &id in &changes.services {
        let runtime = desired.services.get(&id).map(|service| {
            carried.forget_gone_targets(id, desired.targets_of(id));
            build_service(desired, service, carried)
        });
        if runtime.is_none() {
            carried.forget_service(id);
        }
        change.services.push((id, runtime));
    }
    if changes.routes || changes.stream_routes {
        carried.forget_missing_routes(desired);
    }
    if changes.routes {
        change.routes = Some(routes_of(desired));
    }
    if changes.stream_routes {
        change.stream_routes = Some(desired.stream_routes.clone());
    }
    let CarriedState {
        route_stats,
        stream_stats,
        ..
    } = carried;
    previous.next(
        generation,
        change,
        |id| route_stats.entry(id).or_default().clone(),
        |id| stream_stats.entry(id).or_default().clone(),
    )
}

/// The snapshot's own copy of the routes (it normalises and keeps them).
fn routes_of(desired: &Desired) -> Vec<Arc<Route>> {
    desired.routes.clone()
}

/// One service with the targets that may take new traffic and their carried runtime state.
fn build_service(
    desired: &Desired,
    service: &Arc<Service>,
    carried: &mut CarriedState,
) -> ServiceRuntime {
    let targets = desired.targets_of(service.id);
    carried
        .service_targets
        .insert(service.id, targets.iter().map(|target| target.id).collect());
    let hashing = service.lb_policy.is_hashing();
    // Sized up front: the snapshot keeps `runtimes` as built, and growing by doubling would
    // leave up to half of it unused for every service.
    let mut runtimes = Vec::with_capacity(targets.len());
    let mut members = Vec::with_capacity(targets.len());
    for target in targets.iter().filter(|target| target.takes_new_traffic()) {
        let Some(runtime) = target_runtime(service, target, hashing, carried) else {
            continue;
        };
        members.push(Member {
            weight: target.weight,
            priority: target.priority,
            load: runtime.load.clone(),
            identity: runtime.identity,
        });
        runtimes.push(runtime);
    }
    let sessions = service.session_persistence.as_ref().map(|_| {
        let draining = targets
            .iter()
            .filter(|target| keeps_sessions(target))
            .filter_map(|target| target_runtime(service, target, hashing, carried))
            .collect();
        Box::new(SessionTargets::new(&runtimes, draining))
    });
    let previous_tables = carried.hash_tables.remove(&service.id).unwrap_or_default();
    let balancer = Balancer::reusing(service.lb_policy, members, &previous_tables);
    if hashing {
        carried
            .hash_tables
            .insert(service.id, balancer.hash_tables());
    }
    let upstream_host = service
        .upstream_authority
        .as_deref()
        .and_then(|authority| HeaderValue::from_str(authority).ok());
    let sources: Vec<&SourceStanding> = desired.sources_of(service.id).iter().collect();
    let all_targets: Vec<&Target> = targets.iter().map(|target| &**target).collect();
    let locality = match (&carried.zone, service.locality) {
        (Some(zone), Some(locality)) => Some(Box::new(ZoneSplit::build(
            zone.clone(),
            locality,
            service.lb_policy,
            &runtimes,
            crate::clock::unix_ms(),
        ))),
        _ => None,
    };
    ServiceRuntime {
        service: service.clone(),
        upstream_host,
        targets: runtimes,
        balancer,
        counters: carried.counters.entry(service.id).or_default().clone(),
        discovery_gap: discovery_gap(&sources, &all_targets),
        sessions,
        locality,
    }
}

/// A target as the data path needs it, with its runtime state carried by id; None when its
/// address cannot be an authority.
fn target_runtime(
    service: &Service,
    target: &Arc<Target>,
    hashing: bool,
    carried: &mut CarriedState,
) -> Option<TargetRuntime> {
    let Some((authority, host_header)) = target_authority(target) else {
        tracing::warn!(target_id = target.id, host = %target.host, "target address is not a valid authority; left out");
        return None;
    };
    let load = carried.loads.entry(target.id).or_default().clone();
    let health = carried.health_of(target);
    if service.health_check.is_none() {
        // Checks turned off: an old verdict must not keep the target out forever.
        health.set_health(Health::Unknown);
    }
    Some(TargetRuntime {
        id: target.id,
        authority,
        host_header,
        load,
        health,
        spec: target.clone(),
        identity: if hashing { target_identity(target) } else { 0 },
    })
}

/// A draining target keeps the sessions pinned to it until it is removed (HAProxy's `drain`);
/// disabled and weight-0 targets were taken out by hand and keep none.
fn keeps_sessions(target: &Target) -> bool {
    target.state == TargetState::Draining && target.enabled && target.weight > 0
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

/// What hashing tables are built from: the provider key, which survives a target's re-creation
/// and is the same on every gateway, else the operator target's address.
fn target_identity(target: &Target) -> u64 {
    match &target.provider_key {
        Some(key) => identity_hash(key),
        None => identity_hash(&authority_text(&target.host, target.port)),
    }
}

fn target_authority(target: &Target) -> Option<(Authority, HeaderValue)> {
    let text = authority_text(&target.host, target.port);
    let header = HeaderValue::from_str(&text).ok()?;
    Some((Authority::try_from(text).ok()?, header))
}

#[cfg(test)]
pub(super) mod tests {
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

    /// A plain round-robin service (shared with the other control tests).
    pub(in crate::control) fn service(id: Id) -> Service {
        let at = chrono::DateTime::from_timestamp_millis(0).unwrap();
        Service {
            limits: crate::model::UpstreamLimits::default(),
            id,
            name: format!("s{id}"),
            protocol: crate::model::Protocol::Http,
            upstream_authority: None,
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: crate::model::LbPolicy::RoundRobin,
            hash_on: None,
            hash_balance_factor: None,
            session_persistence: None,
            locality: None,
            timeouts: Default::default(),
            max_attempts: 2,
            health_check: None,
            ejection: Default::default(),
            managed_by: None,
            created_at: at,
            updated_at: at,
        }
    }

    fn target_of(service_id: Id, id: Id) -> Target {
        Target {
            id,
            service_id,
            port: 8000 + id as u16,
            ..operator_target(TargetState::Active)
        }
    }

    fn desired(targets: &[(Id, Id)]) -> Desired {
        let mut desired = Desired::default();
        for id in 1..=3 {
            desired.services.insert(id, Arc::new(service(id)));
        }
        for &(service_id, id) in targets {
            desired
                .targets
                .entry(service_id)
                .or_default()
                .push(Arc::new(target_of(service_id, id)));
        }
        desired
    }

    fn ports(snapshot: &Snapshot, service_id: Id) -> Vec<u16> {
        snapshot
            .service(service_id)
            .unwrap()
            .targets
            .iter()
            .map(|t| t.authority.port_u16().unwrap())
            .collect()
    }

    #[test]
    fn a_changed_build_equals_a_full_one_and_shares_the_rest() {
        let mut carried = CarriedState::default();
        let before = desired(&[(1, 1), (2, 2), (2, 3), (3, 4)]);
        let first = build_full(&before, &mut carried, 1);
        let kept_load = first.service(2).unwrap().targets[1].load.clone();
        let after = desired(&[(1, 1), (2, 3), (2, 5), (3, 4)]);
        let changes = ChangeSet {
            services: [2].into(),
            ..ChangeSet::default()
        };
        let changed = build_changed(&first, &after, &changes, &mut carried, 2);
        let full = build_full(&after, &mut CarriedState::default(), 2);
        for id in 1..=3 {
            assert_eq!(ports(&changed, id), ports(&full, id), "service {id}");
        }
        assert_eq!(ports(&changed, 2), vec![8003, 8005]);
        assert!(Arc::ptr_eq(
            first.service(1).unwrap(),
            changed.service(1).unwrap()
        ));
        assert!(Arc::ptr_eq(
            first.service(3).unwrap(),
            changed.service(3).unwrap()
        ));
        assert!(
            Arc::ptr_eq(&kept_load, &changed.service(2).unwrap().targets[0].load),
            "a surviving target keeps its runtime state"
        );
        assert!(
            !carried.loads.contains_key(&2),
            "a removed target's state is forgotten"
        );
        assert!(carried.loads.contains_key(&5));
    }

    #[test]
    fn a_service_keeps_no_spare_room_for_targets() {
        // 20 targets: a vector grown by doubling would hold room for 32.
        let targets: Vec<(Id, Id)> = (1..=20).map(|id| (1, id)).collect();
        let snapshot = build_full(&desired(&targets), &mut CarriedState::default(), 1);
        let runtimes = &snapshot.service(1).unwrap().targets;
        assert_eq!(runtimes.len(), 20);
        assert_eq!(runtimes.capacity(), 20, "every snapshot keeps it");
    }

    #[test]
    fn a_snapshot_shares_each_service_with_the_desired_state() {
        let desired = desired(&[(1, 1), (2, 2)]);
        let mut carried = CarriedState::default();
        let full = build_full(&desired, &mut carried, 1);
        let changes = ChangeSet {
            services: [2].into(),
            ..ChangeSet::default()
        };
        let changed = build_changed(&full, &desired, &changes, &mut carried, 2);
        for snapshot in [&full, &changed] {
            for id in [1, 2] {
                let runtime = snapshot.service(id).unwrap();
                assert!(
                    Arc::ptr_eq(&runtime.service, &desired.services[&id]),
                    "service {id} is a copy of the desired state's"
                );
            }
        }
    }

    #[test]
    fn a_deleted_service_forgets_its_runtime_state() {
        let mut carried = CarriedState::default();
        let before = desired(&[(1, 1), (2, 2)]);
        let first = build_full(&before, &mut carried, 1);
        let mut after = desired(&[(1, 1)]);
        after.services.remove(&2);
        let changes = ChangeSet {
            services: [2].into(),
            ..ChangeSet::default()
        };
        let changed = build_changed(&first, &after, &changes, &mut carried, 2);
        assert!(changed.service(2).is_none());
        assert!(!carried.loads.contains_key(&2));
        assert!(!carried.counters.contains_key(&2));
        assert!(carried.loads.contains_key(&1));
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
