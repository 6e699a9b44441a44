//! What the control task tells the event log. It keeps the last picture it reported (services,
//! routes, sources, targets with their runtime state) and records the difference each time the
//! configuration is reloaded, a source's progress moves, or the per-target atomics change.
//!
//! Diffing rather than reporting at each write site means one path covers every cause: the
//! admin API, a resources file, this instance's discovery and another instance's changes on a
//! shared store. The write sites only leave a reason for the change they make ([`note`]).
//! Passive ejection and routes' limits act on the request path, which only moves atomics; the
//! runtime pass notices them here.
//!
//! [`note`]: Observer::note

mod config;
mod limits;
mod locality;
mod runtime;
mod sources;
mod targets;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::Arc;

use super::desired::Desired;
use super::health::HealthVerdict;
use super::sources::SourceEntry;
use crate::events::{EventLog, RouteLimit};
use crate::model::{
    Certificate, CheckResult, DiscoverySource, EndpointCounts, Health, Id, Route, Service,
    SourceProgress, StreamRoute, Target,
};
use crate::snapshot::Snapshot;
use crate::store::ChangeSet;

pub(super) use locality::refresh_zone_splits;
pub use targets::target_view;

/// Where a target in rotation stood at the last look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Look {
    health: Health,
    /// The sequence of its last ejection (0: never ejected).
    ejection_sequence: u32,
    phase: Phase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    Ejected,
    HalfOpen,
}

/// What the observer keeps of a discovery source: its name for events, and a fingerprint of
/// the whole of it to tell a change. A copy (its provider `config` with it) took about 800
/// bytes a source, and the control task holds the source itself.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SeenSource {
    service_id: Id,
    name: String,
    fingerprint: u64,
}

impl SeenSource {
    fn of(source: &DiscoverySource) -> SeenSource {
        SeenSource {
            service_id: source.service_id,
            name: source.name.clone(),
            fingerprint: fingerprint(source),
        }
    }
}

/// A hash of the source's every field, as it serialises.
fn fingerprint(source: &DiscoverySource) -> u64 {
    use std::hash::Hasher;
    struct HashWriter(std::collections::hash_map::DefaultHasher);
    impl std::io::Write for HashWriter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.write(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut writer = HashWriter(Default::default());
    // Plain data: serialising it cannot fail, and a failure would only read as a change.
    let _ = serde_json::to_writer(&mut writer, source);
    writer.0.finish()
}

struct SeenTarget {
    /// Shared with the control task's picture of the configuration.
    target: Arc<Target>,
    /// None while out of rotation (draining, stale, disabled, weight 0): not looked at.
    look: Option<Look>,
}

pub(super) struct Observer {
    log: Arc<EventLog>,
    instance_id: String,
    /// False until the start is over: what exists at start is no event.
    primed: bool,
    /// Shared with the control task's picture of the configuration, as targets are.
    services: HashMap<Id, Arc<Service>>,
    routes: HashMap<Id, Arc<Route>>,
    stream_routes: HashMap<Id, StreamRoute>,
    certificates: HashMap<Id, Certificate>,
    sources: HashMap<Id, SeenSource>,
    /// The progress last reported per source.
    progress: HashMap<Id, SourceProgress>,
    /// Targets by state per source, as of the last reload.
    counts: HashMap<Id, EndpointCounts>,
    targets: HashMap<Id, SeenTarget>,
    /// The ids in `targets` by service, to find a changed service's removed targets.
    targets_by_service: HashMap<Id, Vec<Id>>,
    /// Why the control task is changing a target, for the event of that change.
    reasons: HashMap<Id, String>,
    /// What the checks saw when they changed a target's health (to what).
    health_reasons: HashMap<Id, (Health, String)>,
    /// The check that last changed a target's health, newer than the stored `last_check`
    /// until the check round is written.
    deciding_checks: HashMap<Id, CheckResult>,
    /// Each route's limits as last looked at, to tell when one trips or clears.
    limits: HashMap<(Id, RouteLimit), limits::WatchedLimit>,
    /// Where each service with a zone split sent its requests at the last look.
    zone_splits: HashMap<Id, crate::events::ZoneSplitKind>,
    /// Targets a reload put in view, to compare at the next runtime look whatever marks say.
    look_again: HashSet<Id>,
    /// When the ejections seen at the last looks run out (Unix ms, target id): the clock, not a
    /// write, turns those targets half-open.
    ejection_ends: BinaryHeap<Reverse<(u64, Id)>>,
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
            counts: HashMap::new(),
            targets: HashMap::new(),
            targets_by_service: HashMap::new(),
            reasons: HashMap::new(),
            health_reasons: HashMap::new(),
            deciding_checks: HashMap::new(),
            limits: HashMap::new(),
            zone_splits: HashMap::new(),
            look_again: HashSet::new(),
            ejection_ends: BinaryHeap::new(),
        }
    }

    /// The reason of the event about the change to `target_id` being written now.
    pub(super) fn note(&mut self, target_id: Id, reason: impl Into<String>) {
        self.reasons.insert(target_id, reason.into());
    }

    pub(super) fn note_health(&mut self, verdict: HealthVerdict) {
        self.health_reasons
            .insert(verdict.target_id, (verdict.health, verdict.reason));
        self.deciding_checks
            .insert(verdict.target_id, verdict.check);
    }

    /// Reports from now on: what was loaded so far (at start) is the picture, not news.
    pub(super) fn prime(&mut self, sources: &HashMap<Id, SourceEntry>) {
        self.sources = sources
            .iter()
            .map(|(id, entry)| (*id, SeenSource::of(&entry.source)))
            .collect();
        self.progress = sources
            .iter()
            .map(|(id, entry)| (*id, entry.progress.clone()))
            .collect();
        self.primed = true;
    }

    /// Reports what a reload changed among the parts `changes` names: configuration objects,
    /// then targets.
    pub(super) fn changes_loaded(
        &mut self,
        desired: &Desired,
        changes: &ChangeSet,
        snapshot: &Snapshot,
        sources: &HashMap<Id, SourceEntry>,
    ) {
        let previous_sources = self.report_config(desired, changes, snapshot, sources);
        self.report_targets(desired, changes, snapshot, sources, &previous_sources);
        // A note the reload did not use (its write failed) must not label a later change.
        self.reasons.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> DiscoverySource {
        let at = crate::clock::now();
        DiscoverySource {
            id: 3,
            service_id: 1,
            name: "registry".into(),
            provider: crate::model::ProviderKind::Http,
            config: serde_json::json!({"url": "http://127.0.0.1:1/endpoints", "interval_ms": 1000}),
            enabled: true,
            stale_after_ms: 300_000,
            removal_grace_ms: 60_000,
            removal_guard: None,
            managed_by: None,
            created_at: at,
            updated_at: at,
        }
    }

    #[test]
    fn a_seen_source_tells_every_change_without_keeping_a_copy() {
        let source = source();
        let before = SeenSource::of(&source);
        assert_eq!(
            SeenSource::of(&source.clone()),
            before,
            "read again, unchanged"
        );
        let mut moved = source.clone();
        moved.config["url"] = "http://127.0.0.1:2/endpoints".into();
        assert_ne!(SeenSource::of(&moved), before, "its config changed");
        let mut disabled = source.clone();
        disabled.enabled = false;
        assert_ne!(SeenSource::of(&disabled), before, "it was disabled");
        assert!(
            std::mem::size_of::<SeenSource>() <= 48,
            "a name and a fingerprint, not the source ({} bytes) with its config",
            std::mem::size_of::<DiscoverySource>()
        );
    }
}
