//! What the control task tells the event log. It keeps the last picture it reported (services,
//! routes, sources, targets with their runtime state) and records the difference each time the
//! configuration is reloaded, a source's progress moves, or the per-target atomics change.
//!
//! Diffing rather than reporting at each write site means one path covers every cause: the
//! admin API, a resources file, this instance's discovery and another instance's changes on a
//! shared store. The write sites only leave a reason for the change they make ([`note`]).
//! Passive ejection happens on the request path, which only flips atomics; the runtime pass
//! notices it here.
//!
//! [`note`]: Observer::note

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};

use super::health::HealthVerdict;
use super::sources::SourceEntry;
use crate::balance::unix_ms;
use crate::events::{
    ConfigChangeKind, ConfigEvent, ConfigKind, ConfigObject, EventBody, EventLog, SourceChangeKind,
    SourceEvent, SourceView, TargetChangeKind, TargetEvent, TargetView,
};
use crate::model::{
    Certificate, DiscoverySource, EndpointCounts, Health, Id, Route, RoutingConfig, Service,
    SourceProgress, SourceState, SourceStatus, StreamRoute, Target, TargetState,
};
use crate::snapshot::{Snapshot, TargetRuntime};

/// A target as the event stream shows it: stored fields with live health and ejection.
pub fn target_view(target: &Target, runtime: Option<&TargetRuntime>, now_ms: u64) -> TargetView {
    let mut target = target.clone();
    let Some(runtime) = runtime else {
        return TargetView {
            target,
            half_open: false,
            ejections: 0,
            in_flight: 0,
        };
    };
    target.health = runtime.health.health();
    target.ejected_until = runtime
        .health
        .ejected_until(now_ms)
        .and_then(|ms| DateTime::from_timestamp_millis(ms as i64));
    TargetView {
        target,
        half_open: runtime.health.half_open(now_ms),
        ejections: runtime.health.ejections(),
        in_flight: runtime.load.in_flight(),
    }
}

/// The runtime facts of a target in rotation that events report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Runtime {
    health: Health,
    ejected_until: Option<u64>,
    half_open: bool,
    ejections: u32,
}

impl Runtime {
    fn of(runtime: &TargetRuntime, now_ms: u64) -> Runtime {
        Runtime {
            health: runtime.health.health(),
            ejected_until: runtime.health.ejected_until(now_ms),
            half_open: runtime.health.half_open(now_ms),
            ejections: runtime.health.ejections(),
        }
    }
}

struct SeenTarget {
    target: Target,
    runtime: Runtime,
}

pub(super) struct Observer {
    log: Arc<EventLog>,
    instance_id: String,
    /// False until the first configuration: what exists at start is no event.
    primed: bool,
    services: HashMap<Id, Service>,
    routes: HashMap<Id, Route>,
    stream_routes: HashMap<Id, StreamRoute>,
    certificates: HashMap<Id, Certificate>,
    sources: HashMap<Id, DiscoverySource>,
    /// The progress last reported per source.
    progress: HashMap<Id, SourceProgress>,
    /// Source states as the store has them (another instance's sources change only there).
    stored_states: HashMap<Id, SourceState>,
    targets: HashMap<Id, SeenTarget>,
    /// Why the control task just changed a target, for its next event.
    reasons: HashMap<Id, String>,
    /// What the checks saw when they changed a target's health (to what).
    health_reasons: HashMap<Id, (Health, String)>,
}

impl Observer {
    pub(super) fn new(log: Arc<EventLog>, instance_id: String) -> Observer {
        Observer {
            log,
            instance_id,
            primed: false,
            services: HashMap::new(),
            routes: HashMap::new(),
            stream_routes: HashMap::new(),
            certificates: HashMap::new(),
            sources: HashMap::new(),
            progress: HashMap::new(),
            stored_states: HashMap::new(),
            targets: HashMap::new(),
            reasons: HashMap::new(),
            health_reasons: HashMap::new(),
        }
    }

    /// The reason of the next event about `target_id` (a change the control task is writing).
    pub(super) fn note(&mut self, target_id: Id, reason: impl Into<String>) {
        self.reasons.insert(target_id, reason.into());
    }

    pub(super) fn note_health(&mut self, verdict: HealthVerdict) {
        self.health_reasons
            .insert(verdict.target_id, (verdict.health, verdict.reason));
    }

    /// Reports what a reload changed: configuration objects, then targets.
    pub(super) fn config_loaded(
        &mut self,
        config: &RoutingConfig,
        snapshot: &Snapshot,
        sources: &HashMap<Id, SourceEntry>,
    ) {
        let primed = self.primed;
        self.stored_states = config
            .sources
            .iter()
            .map(|standing| (standing.id, standing.state))
            .collect();
        let now_ms = unix_ms();
        let runtimes = runtimes(snapshot);
        let services: HashMap<Id, Service> = config
            .services
            .iter()
            .map(|service| (service.id, service.clone()))
            .collect();
        let routes = by_id(&config.routes, |route| route.id);
        let stream_routes = by_id(&config.stream_routes, |route| route.id);
        let certificates: HashMap<Id, Certificate> = config
            .certificates
            .iter()
            .map(|entry| (entry.certificate.id, entry.certificate.clone()))
            .collect();
        let current_sources: HashMap<Id, DiscoverySource> = sources
            .iter()
            .map(|(id, entry)| (*id, entry.source.clone()))
            .collect();
        if primed {
            self.report_services(&services, snapshot);
            self.report_sources(&current_sources, sources);
            self.report_plain(ConfigKind::Route, &self.routes, &routes, |route| {
                (Some(route.service_id), Some(route.name.clone()))
            });
            self.report_plain(
                ConfigKind::StreamRoute,
                &self.stream_routes,
                &stream_routes,
                |route| (Some(route.service_id), Some(route.listen.to_string())),
            );
            self.report_plain(
                ConfigKind::Certificate,
                &self.certificates,
                &certificates,
                |certificate| (None, certificate.snis.first().cloned()),
            );
        }
        self.services = services;
        self.routes = routes;
        self.stream_routes = stream_routes;
        self.certificates = certificates;
        let deleted_sources = std::mem::replace(&mut self.sources, current_sources);
        self.report_targets(config, &runtimes, now_ms, primed, &deleted_sources);
    }

    /// Reports from now on: what was loaded so far (at start) is the picture, not news.
    pub(super) fn prime(&mut self, sources: &HashMap<Id, SourceEntry>) {
        self.sources = sources
            .iter()
            .map(|(id, entry)| (*id, entry.source.clone()))
            .collect();
        self.progress = sources
            .iter()
            .map(|(id, entry)| (*id, entry.progress.clone()))
            .collect();
        self.primed = true;
    }

    fn report_services(&self, current: &HashMap<Id, Service>, snapshot: &Snapshot) {
        for (id, service) in current {
            let change = match self.services.get(id) {
                None => ConfigChangeKind::Created,
                Some(previous) if previous != service => ConfigChangeKind::Changed,
                Some(_) => continue,
            };
            let panic_picks = snapshot
                .service(*id)
                .map(|runtime| {
                    runtime
                        .counters
                        .panic_picks
                        .load(std::sync::atomic::Ordering::Relaxed)
                })
                .unwrap_or(0);
            let object = ConfigObject::Service(crate::events::ServiceView {
                service: service.clone(),
                panic_picks,
            });
            self.config_event(
                ConfigKind::Service,
                *id,
                Some(*id),
                &service.name,
                change,
                Some(object),
            );
        }
        for (id, service) in &self.services {
            if !current.contains_key(id) {
                self.config_event(
                    ConfigKind::Service,
                    *id,
                    Some(*id),
                    &service.name,
                    ConfigChangeKind::Deleted,
                    None,
                );
            }
        }
    }

    fn report_sources(
        &self,
        current: &HashMap<Id, DiscoverySource>,
        entries: &HashMap<Id, SourceEntry>,
    ) {
        for (id, source) in current {
            let change = match self.sources.get(id) {
                None => ConfigChangeKind::Created,
                Some(previous) if previous != source => ConfigChangeKind::Changed,
                Some(_) => continue,
            };
            let status = entries
                .get(id)
                .map(|entry| self.status_of(entry, &entry.progress));
            let object = ConfigObject::Source(SourceView::new(source, status));
            self.config_event(
                ConfigKind::DiscoverySource,
                *id,
                Some(source.service_id),
                &source.name,
                change,
                Some(object),
            );
        }
        for (id, source) in &self.sources {
            if !current.contains_key(id) {
                self.config_event(
                    ConfigKind::DiscoverySource,
                    *id,
                    Some(source.service_id),
                    &source.name,
                    ConfigChangeKind::Deleted,
                    None,
                );
            }
        }
    }

    /// Routes, stream routes and certificates: created, changed or deleted, without the object.
    fn report_plain<T: PartialEq>(
        &self,
        kind: ConfigKind,
        previous: &HashMap<Id, T>,
        current: &HashMap<Id, T>,
        describe: impl Fn(&T) -> (Option<Id>, Option<String>),
    ) {
        let mut changes: Vec<(Id, &T, ConfigChangeKind)> = Vec::new();
        for (id, object) in current {
            match previous.get(id) {
                None => changes.push((*id, object, ConfigChangeKind::Created)),
                Some(before) if before != object => {
                    changes.push((*id, object, ConfigChangeKind::Changed))
                }
                Some(_) => {}
            }
        }
        for (id, object) in previous {
            if !current.contains_key(id) {
                changes.push((*id, object, ConfigChangeKind::Deleted));
            }
        }
        changes.sort_by_key(|(id, _, _)| *id);
        for (id, object, change) in changes {
            let (service_id, name) = describe(object);
            self.log.record(
                service_id,
                EventBody::Config(ConfigEvent {
                    kind,
                    object_id: id,
                    name,
                    change,
                    object: None,
                }),
            );
        }
    }

    fn config_event(
        &self,
        kind: ConfigKind,
        object_id: Id,
        service_id: Option<Id>,
        name: &str,
        change: ConfigChangeKind,
        object: Option<ConfigObject>,
    ) {
        self.log.record(
            service_id,
            EventBody::Config(ConfigEvent {
                kind,
                object_id,
                name: Some(name.to_owned()),
                change,
                object,
            }),
        );
    }

    fn source_name(&self, source_id: Id, deleted: &HashMap<Id, DiscoverySource>) -> String {
        self.sources
            .get(&source_id)
            .or_else(|| deleted.get(&source_id))
            .map(|source| source.name.clone())
            .unwrap_or_else(|| format!("#{source_id}"))
    }

    fn report_targets(
        &mut self,
        config: &RoutingConfig,
        runtimes: &HashMap<Id, &TargetRuntime>,
        now_ms: u64,
        primed: bool,
        previous_sources: &HashMap<Id, DiscoverySource>,
    ) {
        let mut present = HashMap::with_capacity(config.targets.len());
        for target in &config.targets {
            present.insert(target.id, ());
            let runtime = runtimes.get(&target.id).copied();
            let seen_runtime = runtime.map(|r| Runtime::of(r, now_ms));
            let Some(seen) = self.targets.get(&target.id) else {
                if primed {
                    let reason =
                        self.reasons
                            .remove(&target.id)
                            .unwrap_or_else(|| match target.source_id {
                                Some(source) => format!(
                                    "discovered by source {}",
                                    self.source_name(source, previous_sources)
                                ),
                                None => "created by configuration".to_owned(),
                            });
                    self.target_event(
                        target,
                        runtime,
                        now_ms,
                        TargetChangeKind::Added,
                        None,
                        None,
                        reason,
                    );
                }
                self.targets.insert(
                    target.id,
                    SeenTarget {
                        target: target.clone(),
                        runtime: seen_runtime.unwrap_or_default(),
                    },
                );
                continue;
            };
            let events = describe_target_change(&seen.target, target);
            if events.is_empty() {
                continue;
            }
            let noted = self.reasons.remove(&target.id);
            for (change, from, to) in events {
                let reason = noted.clone().unwrap_or_else(|| {
                    self.default_reason(target, change, to.as_deref(), previous_sources)
                });
                self.target_event(target, runtime, now_ms, change, from, to, reason);
            }
            if let Some(seen) = self.targets.get_mut(&target.id) {
                seen.target = target.clone();
            }
        }
        let gone: Vec<Id> = self
            .targets
            .keys()
            .filter(|id| !present.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            let Some(seen) = self.targets.remove(&id) else {
                continue;
            };
            let reason = self
                .reasons
                .remove(&id)
                .unwrap_or_else(|| match seen.target.source_id {
                    Some(source) if !self.sources.contains_key(&source) => format!(
                        "its source {} was deleted",
                        self.source_name(source, previous_sources)
                    ),
                    Some(_) => "removal grace ended".to_owned(),
                    None => "deleted by configuration".to_owned(),
                });
            self.record_target(
                &seen.target,
                None,
                TargetChangeKind::Removed,
                Some(seen.target.state.as_str().to_owned()),
                None,
                reason,
            );
            self.health_reasons.remove(&id);
        }
    }

    fn default_reason(
        &self,
        target: &Target,
        change: TargetChangeKind,
        to: Option<&str>,
        previous_sources: &HashMap<Id, DiscoverySource>,
    ) -> String {
        let source = target
            .source_id
            .map(|id| (id, self.source_name(id, previous_sources)));
        match (change, source) {
            (TargetChangeKind::State, Some((id, name))) => match to {
                Some("draining") if self.sources.get(&id).is_some_and(|s| !s.enabled) => {
                    format!("source {name} was disabled")
                }
                Some("draining") => format!("missing from the answer of source {name}"),
                Some("stale") => {
                    let error = self
                        .progress
                        .get(&id)
                        .and_then(|progress| progress.last_error.clone())
                        .unwrap_or_else(|| "no successful refresh".to_owned());
                    format!("source {name} is stale: {error}")
                }
                _ => format!("returned in the answer of source {name}"),
            },
            (TargetChangeKind::Enabled | TargetChangeKind::Disabled, Some((_, name))) => {
                format!("{} by source {name}", change_word(change))
            }
            (TargetChangeKind::Enabled | TargetChangeKind::Disabled, None) => {
                format!("{} by configuration", change_word(change))
            }
            (_, Some((_, name))) => format!("changed in the answer of source {name}"),
            (_, None) => "changed by configuration".to_owned(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn target_event(
        &self,
        target: &Target,
        runtime: Option<&TargetRuntime>,
        now_ms: u64,
        change: TargetChangeKind,
        from: Option<String>,
        to: Option<String>,
        reason: String,
    ) {
        let view = target_view(target, runtime, now_ms);
        self.record_target(target, Some(view), change, from, to, reason);
    }

    fn record_target(
        &self,
        target: &Target,
        view: Option<TargetView>,
        change: TargetChangeKind,
        from: Option<String>,
        to: Option<String>,
        reason: String,
    ) {
        self.log.record(
            Some(target.service_id),
            EventBody::Target(TargetEvent {
                target_id: target.id,
                source_id: target.source_id,
                address: address(target),
                change,
                from,
                to,
                reason,
                target: view,
            }),
        );
    }

    /// Reports health and ejection changes of targets in rotation (the atomics the checks and
    /// the request path flip).
    pub(super) fn runtime_changed(&mut self, snapshot: &Snapshot) {
        if !self.primed {
            return;
        }
        let now_ms = unix_ms();
        for service in snapshot.services() {
            let ejection = &service.service.ejection;
            for runtime in &service.targets {
                let current = Runtime::of(runtime, now_ms);
                let Some(seen) = self.targets.get(&runtime.id) else {
                    continue;
                };
                let before = seen.runtime;
                if before == current {
                    continue;
                }
                let target = seen.target.clone();
                if before.health != current.health {
                    let reason = self
                        .health_reasons
                        .remove(&runtime.id)
                        .filter(|(health, _)| *health == current.health)
                        .map(|(_, reason)| reason)
                        .unwrap_or_else(|| match current.health {
                            Health::Unknown => "health checks turned off".to_owned(),
                            _ => "health check verdict".to_owned(),
                        });
                    self.target_event(
                        &target,
                        Some(runtime),
                        now_ms,
                        TargetChangeKind::Health,
                        Some(before.health.as_str().to_owned()),
                        Some(current.health.as_str().to_owned()),
                        reason,
                    );
                }
                let ejected_again = current.ejections > before.ejections
                    || (current.ejected_until.is_some()
                        && current.ejected_until != before.ejected_until
                        && before.ejected_until.is_none());
                if ejected_again && current.ejected_until.is_some() {
                    let reason = match runtime.health.last_ejection() {
                        Some(cause) if cause.trial => {
                            format!("half-open trial failed: {}", cause.failure)
                        }
                        Some(cause) => format!(
                            "{} failures in {} s: {}",
                            ejection.failures,
                            ejection.window_ms.div_ceil(1_000),
                            cause.failure
                        ),
                        None => "failed requests".to_owned(),
                    };
                    let until = current
                        .ejected_until
                        .and_then(|ms| DateTime::from_timestamp_millis(ms as i64))
                        .map(|until: DateTime<Utc>| {
                            until.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                        });
                    self.target_event(
                        &target,
                        Some(runtime),
                        now_ms,
                        TargetChangeKind::Ejected,
                        None,
                        until,
                        reason,
                    );
                } else if current.half_open && !before.half_open {
                    self.target_event(
                        &target,
                        Some(runtime),
                        now_ms,
                        TargetChangeKind::HalfOpen,
                        None,
                        None,
                        "ejection ended; one trial request at a time".to_owned(),
                    );
                } else if (before.half_open || before.ejected_until.is_some())
                    && !current.half_open
                    && current.ejected_until.is_none()
                {
                    let reason = if ejection.enabled {
                        "a request succeeded"
                    } else {
                        "ejection turned off"
                    };
                    self.target_event(
                        &target,
                        Some(runtime),
                        now_ms,
                        TargetChangeKind::Restored,
                        None,
                        None,
                        reason.to_owned(),
                    );
                }
                if let Some(seen) = self.targets.get_mut(&runtime.id) {
                    seen.runtime = current;
                }
            }
        }
    }

    /// Reports sources whose lifecycle, guard, watch or error moved since last reported.
    pub(super) fn sources_changed(&mut self, entries: &HashMap<Id, SourceEntry>) {
        if !self.primed {
            return;
        }
        let mut ids: Vec<Id> = entries.keys().copied().collect();
        ids.sort_unstable();
        for id in ids {
            let entry = &entries[&id];
            let mut progress = entry.progress.clone();
            if !entry.holds_lease() {
                // Another instance refreshes it: the store's state is what we know.
                if let Some(state) = self.stored_states.get(&id) {
                    progress.state = *state;
                }
            }
            let before = self.progress.get(&id);
            let changes = before
                .map(|before| describe_source_change(before, &progress))
                .unwrap_or_default();
            if before.is_none() || !changes.is_empty() {
                for (change, from, to, reason) in changes {
                    let status = self.status_of(entry, &progress);
                    self.log.record(
                        Some(entry.source.service_id),
                        EventBody::Source(SourceEvent {
                            source_id: id,
                            name: entry.source.name.clone(),
                            change,
                            from,
                            to,
                            reason,
                            status,
                        }),
                    );
                }
                self.progress.insert(id, progress);
            }
        }
        self.progress.retain(|id, _| entries.contains_key(id));
    }

    fn status_of(&self, entry: &SourceEntry, progress: &SourceProgress) -> SourceStatus {
        let mut endpoints = EndpointCounts::default();
        for seen in self.targets.values() {
            if seen.target.source_id == Some(entry.source.id) {
                match seen.target.state {
                    TargetState::Active => endpoints.active += 1,
                    TargetState::Draining => endpoints.draining += 1,
                    TargetState::Stale => endpoints.stale += 1,
                }
            }
        }
        SourceStatus {
            source_id: entry.source.id,
            progress: progress.clone(),
            endpoints,
            refreshed_by: entry.holds_lease().then(|| self.instance_id.clone()),
        }
    }
}

fn change_word(change: TargetChangeKind) -> &'static str {
    match change {
        TargetChangeKind::Enabled => "enabled",
        _ => "disabled",
    }
}

fn address(target: &Target) -> String {
    match target.host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(_)) => format!("[{}]:{}", target.host, target.port),
        _ => format!("{}:{}", target.host, target.port),
    }
}

fn by_id<T: Clone>(items: &[T], id: impl Fn(&T) -> Id) -> HashMap<Id, T> {
    items.iter().map(|item| (id(item), item.clone())).collect()
}

fn runtimes(snapshot: &Snapshot) -> HashMap<Id, &TargetRuntime> {
    snapshot
        .services()
        .flat_map(|service| service.targets.iter())
        .map(|runtime| (runtime.id, runtime))
        .collect()
}

/// The events one stored change of a target makes: its state, its switch, its other fields.
fn describe_target_change(
    before: &Target,
    after: &Target,
) -> Vec<(TargetChangeKind, Option<String>, Option<String>)> {
    let mut events = Vec::new();
    if before.state != after.state {
        events.push((
            TargetChangeKind::State,
            Some(before.state.as_str().to_owned()),
            Some(after.state.as_str().to_owned()),
        ));
    }
    if before.enabled != after.enabled {
        let change = if after.enabled {
            TargetChangeKind::Enabled
        } else {
            TargetChangeKind::Disabled
        };
        events.push((change, None, None));
    }
    let mut fields = Vec::new();
    if (&before.host, before.port) != (&after.host, after.port) {
        fields.push(format!("address {} → {}", address(before), address(after)));
    }
    if before.weight != after.weight {
        fields.push(format!("weight {} → {}", before.weight, after.weight));
    }
    if before.priority != after.priority {
        fields.push(format!("priority {} → {}", before.priority, after.priority));
    }
    if before.metadata != after.metadata {
        fields.push("metadata".to_owned());
    }
    if !fields.is_empty() {
        events.push((TargetChangeKind::Updated, None, Some(fields.join(", "))));
    }
    events
}

type SourceChange = (SourceChangeKind, Option<String>, Option<String>, String);

fn describe_source_change(before: &SourceProgress, after: &SourceProgress) -> Vec<SourceChange> {
    let mut changes = Vec::new();
    if before.state != after.state {
        let reason = match (after.state, &after.last_error) {
            (SourceState::Failing | SourceState::Stale, Some(error)) => error.clone(),
            (SourceState::Healthy, _) if before.state == SourceState::Pending => {
                "first successful refresh".to_owned()
            }
            (SourceState::Healthy, _) => "refreshed successfully again".to_owned(),
            (SourceState::Disabled, _) => "disabled".to_owned(),
            (SourceState::Pending, _) => "waiting for its first refresh".to_owned(),
            (_, None) => after.state.as_str().to_owned(),
        };
        changes.push((
            SourceChangeKind::State,
            Some(before.state.as_str().to_owned()),
            Some(after.state.as_str().to_owned()),
            reason,
        ));
    } else if before.last_error != after.last_error {
        if let Some(error) = &after.last_error {
            changes.push((SourceChangeKind::Error, None, None, error.clone()));
        }
    }
    let held = |progress: &SourceProgress| {
        progress
            .guard
            .as_ref()
            .map(|hold| (hold.held.clone(), hold.reason.clone()))
    };
    if held(before) != held(after) {
        let reason = match &after.guard {
            Some(hold) => format!("holding {} removals: {}", hold.held.len(), hold.reason),
            None => "the removal guard holds nothing any more".to_owned(),
        };
        changes.push((SourceChangeKind::Guard, None, None, reason));
    }
    let connected = |progress: &SourceProgress| progress.watch.as_ref().map(|w| w.connected);
    if connected(before) != connected(after) {
        let reason = match connected(after) {
            Some(true) => "watch connected".to_owned(),
            _ => match &after.last_error {
                Some(error) => format!("watch lost: {error}"),
                None => "watch not connected".to_owned(),
            },
        };
        changes.push((SourceChangeKind::Watch, None, None, reason));
    }
    changes
}
