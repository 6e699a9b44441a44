//! Zone splits changing (TRAFFIC.md §4, "Visible"): the control task decides each service's split
//! again at every look ([`refresh_zone_splits`]); a change of where requests go (the zone only,
//! or every zone) is one event, with the counts and the reason.

use std::collections::HashSet;

use super::Observer;
use crate::events::{EventBody, LocalityEvent, ZoneSplitKind};
use crate::snapshot::Snapshot;

/// Decides every service's zone split again from its targets' health at `now_ms`: what the
/// request path follows until the next look.
pub(in crate::control) fn refresh_zone_splits(snapshot: &Snapshot, now_ms: u64) {
    for service in snapshot.services() {
        if let Some(split) = service.locality.as_deref() {
            split.refresh(&service.targets, now_ms);
        }
    }
}

impl Observer {
    /// Records each service whose split changed since the last look, and each split first seen
    /// after the start (a service given `locality`, a new one); before the start is over, only
    /// takes the picture.
    pub(in crate::control) fn report_locality(&mut self, snapshot: &Snapshot) {
        let mut present = HashSet::new();
        for service in snapshot.services() {
            let Some(split) = service.locality.as_deref() else {
                continue;
            };
            let id = service.service.id;
            present.insert(id);
            let decision = split.decision();
            let to = if decision.in_force.is_some() {
                ZoneSplitKind::ZoneOnly
            } else {
                ZoneSplitKind::AllZones
            };
            let from = self.zone_splits.insert(id, to);
            if !self.primed || from == Some(to) {
                continue;
            }
            self.log.record(
                Some(id),
                EventBody::Locality(LocalityEvent {
                    name: service.service.name.clone(),
                    zone: split.zone().to_owned(),
                    from,
                    to,
                    basis: split.basis().as_str(),
                    available: decision.available,
                    total: decision.total,
                    min_available_percent: split.min_available_percent(),
                    reason: split.reason(decision),
                }),
            );
        }
        self.zone_splits.retain(|id, _| present.contains(id));
    }
}
