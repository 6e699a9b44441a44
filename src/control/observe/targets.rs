//! Targets added, removed or changed in the store between two reloads, with their reasons.

use std::collections::{HashMap, HashSet};

use chrono::DateTime;

use super::{Look, Observer, Phase, SeenSource, SeenTarget};
use crate::clock::unix_ms;
use crate::control::desired::Desired;
use crate::control::sources::SourceEntry;
use crate::events::{EventBody, TargetChangeKind, TargetEvent, TargetView};
use crate::model::{EndpointCounts, Id, Target, TargetState};
use crate::snapshot::{Snapshot, TargetRuntime};
use crate::store::ChangeSet;

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

/// One change of a target, as an event tells it.
pub(super) struct TargetNews {
    pub(super) change: TargetChangeKind,
    pub(super) from: Option<String>,
    pub(super) to: Option<String>,
    pub(super) reason: String,
}

impl TargetNews {
    pub(super) fn new(change: TargetChangeKind, reason: impl Into<String>) -> TargetNews {
        TargetNews {
            change,
            from: None,
            to: None,
            reason: reason.into(),
        }
    }

    pub(super) fn moving(mut self, from: Option<String>, to: Option<String>) -> TargetNews {
        self.from = from;
        self.to = to;
        self
    }
}

impl Look {
    pub(super) fn of(runtime: &TargetRuntime, now_ms: u64) -> Look {
        // The ejection word first: the deadline read after it is at least as new.
        let ejection_sequence = runtime
            .health
            .last_ejection()
            .map_or(0, |cause| cause.sequence);
        let until = runtime.health.ejected_until_ms();
        let phase = match until {
            0 => Phase::Open,
            until if until > now_ms => Phase::Ejected,
            _ => Phase::HalfOpen,
        };
        Look {
            health: runtime.health.health(),
            ejection_sequence,
            phase,
        }
    }
}

impl Observer {
    /// Reports the targets of the services `changes` names: added, changed, removed.
    pub(super) fn report_targets(
        &mut self,
        desired: &Desired,
        changes: &ChangeSet,
        snapshot: &Snapshot,
        entries: &HashMap<Id, SourceEntry>,
        previous_sources: &HashMap<Id, SeenSource>,
    ) {
        let now_ms = unix_ms();
        let scope: Vec<Id> = if changes.everything {
            let mut all: HashSet<Id> = desired.services.keys().copied().collect();
            all.extend(self.targets_by_service.keys().copied());
            all.into_iter().collect()
        } else {
            changes.services.iter().copied().collect()
        };
        let runtimes = runtimes(snapshot, &scope);
        self.recount(desired, &scope, previous_sources);
        let mut present = HashSet::new();
        let mut seen_before: Vec<Id> = Vec::new();
        for service_id in &scope {
            if let Some(ids) = self.targets_by_service.remove(service_id) {
                seen_before.extend(ids);
            }
            let ids: Vec<Id> = desired
                .targets_of(*service_id)
                .iter()
                .map(|target| target.id)
                .collect();
            if !ids.is_empty() {
                self.targets_by_service.insert(*service_id, ids);
            }
        }
        for target in scope.iter().flat_map(|id| desired.targets_of(*id)) {
            present.insert(target.id);
            let runtime = runtimes.get(&target.id).copied();
            if runtime.is_some() {
                // Its runtime state may be new with this snapshot: compare at the next look.
                self.look_again.insert(target.id);
            }
            // Entering rotation is no news by itself: later looks compare with this one.
            let look = runtime.map(|runtime| Look::of(runtime, now_ms));
            let Some(seen) = self.targets.get_mut(&target.id) else {
                if self.primed {
                    let reason =
                        self.reasons
                            .remove(&target.id)
                            .unwrap_or_else(|| match target.source_id {
                                Some(source) => format!(
                                    "discovered by source {}",
                                    source_name(source, &self.sources, previous_sources)
                                ),
                                None => "created by configuration".to_owned(),
                            });
                    let news = TargetNews::new(TargetChangeKind::Added, reason);
                    self.record_target(target, Some(target_view(target, runtime, now_ms)), news);
                }
                self.targets.insert(
                    target.id,
                    SeenTarget {
                        target: target.clone(),
                        look,
                    },
                );
                continue;
            };
            seen.look = match (seen.look, look) {
                (Some(kept), Some(_)) => Some(kept),
                (_, fresh) => fresh,
            };
            let changes = describe_target_change(&seen.target, target);
            // The reload's copy even when nothing changed: the one seen before would otherwise
            // stay alive beside it, a second copy of every target of the service.
            seen.target = target.clone();
            if changes.is_empty() {
                continue;
            }
            let noted = self.reasons.remove(&target.id);
            for news in changes {
                let news = match &noted {
                    Some(reason) => TargetNews {
                        reason: reason.clone(),
                        ..news
                    },
                    None => {
                        let reason = self.default_reason(target, &news, entries, previous_sources);
                        TargetNews { reason, ..news }
                    }
                };
                self.record_target(target, Some(target_view(target, runtime, now_ms)), news);
            }
        }
        let mut gone: Vec<Id> = seen_before
            .into_iter()
            .filter(|id| !present.contains(id))
            .collect();
        gone.sort_unstable();
        for id in gone {
            let Some(seen) = self.targets.remove(&id) else {
                continue;
            };
            self.health_reasons.remove(&id);
            self.deciding_checks.remove(&id);
            let reason = self
                .reasons
                .remove(&id)
                .unwrap_or_else(|| match seen.target.source_id {
                    Some(source) if !self.sources.contains_key(&source) => format!(
                        "its source {} was deleted",
                        source_name(source, &self.sources, previous_sources)
                    ),
                    Some(_) => "removal grace ended".to_owned(),
                    None => "deleted by configuration".to_owned(),
                });
            let news = TargetNews::new(TargetChangeKind::Removed, reason)
                .moving(Some(seen.target.state.as_str().to_owned()), None);
            self.record_target(&seen.target, None, news);
        }
    }

    fn default_reason(
        &self,
        target: &Target,
        news: &TargetNews,
        entries: &HashMap<Id, SourceEntry>,
        previous_sources: &HashMap<Id, SeenSource>,
    ) -> String {
        let Some(source_id) = target.source_id else {
            return match news.change {
                TargetChangeKind::Enabled => "enabled by configuration".to_owned(),
                TargetChangeKind::Disabled => "disabled by configuration".to_owned(),
                _ => "changed by configuration".to_owned(),
            };
        };
        let name = source_name(source_id, &self.sources, previous_sources);
        let entry = entries.get(&source_id);
        match (news.change, news.to.as_deref()) {
            (TargetChangeKind::State, Some("draining"))
                if entry.is_some_and(|entry| !entry.source.enabled) =>
            {
                format!("source {name} was disabled")
            }
            (TargetChangeKind::State, Some("draining")) => {
                format!("missing from the answer of source {name}")
            }
            (TargetChangeKind::State, Some("stale")) => {
                let error = entry
                    .and_then(|entry| entry.progress.last_error.clone())
                    .unwrap_or_else(|| "no successful refresh".to_owned());
                format!("source {name} is stale: {error}")
            }
            (TargetChangeKind::State, _) => format!("returned in the answer of source {name}"),
            (TargetChangeKind::Enabled, _) => format!("enabled by source {name}"),
            (TargetChangeKind::Disabled, _) => format!("disabled by source {name}"),
            _ => format!("changed in the answer of source {name}"),
        }
    }

    pub(super) fn record_target(
        &self,
        target: &Target,
        view: Option<TargetView>,
        news: TargetNews,
    ) {
        self.log.record(
            Some(target.service_id),
            EventBody::Target(TargetEvent {
                target_id: target.id,
                source_id: target.source_id,
                address: address(target),
                change: news.change,
                from: news.from,
                to: news.to,
                reason: news.reason,
                target: view,
            }),
        );
    }
}

fn source_name(
    source_id: Id,
    current: &HashMap<Id, SeenSource>,
    previous: &HashMap<Id, SeenSource>,
) -> String {
    current
        .get(&source_id)
        .or_else(|| previous.get(&source_id))
        .map(|source| source.name.clone())
        .unwrap_or_else(|| format!("#{source_id}"))
}

fn address(target: &Target) -> String {
    match target.host.parse::<std::net::IpAddr>() {
        Ok(std::net::IpAddr::V6(_)) => format!("[{}]:{}", target.host, target.port),
        _ => format!("{}:{}", target.host, target.port),
    }
}

/// The runtime state of the targets of `services` in rotation, by target id.
fn runtimes<'a>(snapshot: &'a Snapshot, services: &[Id]) -> HashMap<Id, &'a TargetRuntime> {
    services
        .iter()
        .filter_map(|id| snapshot.service(*id))
        .flat_map(|service| service.targets.iter())
        .map(|runtime| (runtime.id, runtime))
        .collect()
}

impl Observer {
    /// Counts again the targets by state of every source of `services` (as they were and are).
    fn recount(
        &mut self,
        desired: &Desired,
        services: &[Id],
        previous_sources: &HashMap<Id, SeenSource>,
    ) {
        for source in previous_sources.keys() {
            self.counts.remove(source);
        }
        for service_id in services {
            for source in desired.sources_of(*service_id) {
                self.counts.insert(source.id, EndpointCounts::default());
            }
            for target in desired.targets_of(*service_id) {
                let Some(source_id) = target.source_id else {
                    continue;
                };
                let count = self.counts.entry(source_id).or_default();
                match target.state {
                    TargetState::Active => count.active += 1,
                    TargetState::Draining => count.draining += 1,
                    TargetState::Stale => count.stale += 1,
                }
            }
        }
    }
}

/// The news one stored change of a target makes: its state, its switch, its other fields.
fn describe_target_change(before: &Target, after: &Target) -> Vec<TargetNews> {
    let mut news = Vec::new();
    if before.state != after.state {
        news.push(
            TargetNews::new(TargetChangeKind::State, String::new()).moving(
                Some(before.state.as_str().to_owned()),
                Some(after.state.as_str().to_owned()),
            ),
        );
    }
    if before.enabled != after.enabled {
        let change = if after.enabled {
            TargetChangeKind::Enabled
        } else {
            TargetChangeKind::Disabled
        };
        news.push(TargetNews::new(change, String::new()));
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
        news.push(
            TargetNews::new(TargetChangeKind::Updated, String::new())
                .moving(None, Some(fields.join(", "))),
        );
    }
    news
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        let now = crate::clock::now();
        Target {
            id: 1,
            service_id: 1,
            source_id: None,
            host: "10.0.0.1".into(),
            port: 80,
            weight: 100,
            priority: 0,
            enabled: true,
            metadata: serde_json::json!({}),
            provider_key: None,
            state: TargetState::Active,
            health: crate::model::Health::Unknown,
            ejected_until: None,
            remove_at: None,
            last_check: None,
            managed_by: None,
            created_at: now,
            updated_at: now,
        }
    }

    #[test]
    fn a_reload_with_nothing_changed_keeps_one_copy_of_each_target() {
        use crate::control::build::{build_snapshot, tests::service};
        use crate::control::desired::Desired;
        use crate::events::{EventLog, EventSettings};
        use crate::model::RoutingConfig;
        use std::sync::Arc;
        let config = || RoutingConfig {
            services: vec![service(1)],
            targets: vec![target()],
            ..RoutingConfig::default()
        };
        let snapshot = build_snapshot(
            &config(),
            &mut crate::control::CarriedState::in_zone(None),
            1,
        );
        let log = Arc::new(EventLog::new(EventSettings::default()));
        let mut observer = Observer::new(log, "me".into());
        let everything = crate::store::ChangeSet::everything();
        let first = Desired::from_config(config());
        observer.changes_loaded(&first, &everything, &snapshot, &Default::default());
        // The same target read again, as the reload of its service reads it.
        let reloaded = Desired::from_config(config());
        drop(first);
        observer.changes_loaded(&reloaded, &everything, &snapshot, &Default::default());
        let kept = &observer.targets[&1].target;
        assert!(
            Arc::ptr_eq(kept, &reloaded.targets_of(1)[0]),
            "the observer holds the reload's copy, not one of its own"
        );
    }

    #[test]
    fn a_stored_change_is_told_by_state_switch_and_fields() {
        let before = target();
        let mut after = before.clone();
        after.state = TargetState::Draining;
        after.enabled = false;
        after.weight = 5;
        after.host = "::1".into();
        after.updated_at = before.updated_at + chrono::Duration::seconds(1);
        let news = describe_target_change(&before, &after);
        let kinds: Vec<TargetChangeKind> = news.iter().map(|n| n.change).collect();
        assert_eq!(
            kinds,
            [
                TargetChangeKind::State,
                TargetChangeKind::Disabled,
                TargetChangeKind::Updated
            ]
        );
        assert_eq!(news[0].to.as_deref(), Some("draining"));
        assert_eq!(
            news[2].to.as_deref(),
            Some("address 10.0.0.1:80 → [::1]:80, weight 100 → 5")
        );
        // Health, timestamps and checks written to the store are not news of the store.
        let mut checked = before.clone();
        checked.health = crate::model::Health::Unhealthy;
        checked.updated_at = after.updated_at;
        assert!(describe_target_change(&before, &checked).is_empty());
    }
}
