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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::control::build::{build_snapshot, tests::service, CarriedState};
    use crate::events::{EventLog, EventSettings};
    use crate::model::{Health, Locality, RoutingConfig, Target, TargetState};

    fn zoned(id: i64, zone: &str) -> Target {
        Target {
            id,
            service_id: 1,
            host: "10.0.0.1".to_owned(),
            port: 8000 + id as u16,
            weight: 100,
            enabled: true,
            state: TargetState::Active,
            metadata: serde_json::json!({ "zone": zone }),
            ..Target::default()
        }
    }

    /// The locality events recorded after `since` (the log's last id before them).
    fn locality_events(log: &EventLog, since: u64) -> Vec<LocalityEvent> {
        use crate::events::variant_of;
        let splits = [ZoneSplitKind::ZoneOnly, ZoneSplitKind::AllZones];
        let number = |value: &serde_json::Value| value.as_u64().unwrap() as u32;
        log.subscribe(Some(since))
            .backlog
            .unwrap_or_default()
            .iter()
            .map(|event| event.parsed())
            .filter(|(kind, _)| kind == "locality")
            .map(|(_, data)| LocalityEvent {
                name: data["name"].as_str().unwrap().to_owned(),
                zone: data["zone"].as_str().unwrap().to_owned(),
                from: (!data["from"].is_null()).then(|| variant_of(&data["from"], &splits)),
                to: variant_of(&data["to"], &splits),
                basis: if data["basis"] == "hints" {
                    "hints"
                } else {
                    "labels"
                },
                available: number(&data["available"]),
                total: number(&data["total"]),
                min_available_percent: number(&data["min_available_percent"]),
                reason: data["reason"].as_str().unwrap().to_owned(),
            })
            .collect()
    }

    /// The control task's runtime watch, as its loop runs it: on a 250 ms interval in paused
    /// time, each tick deciding again and reporting.
    #[tokio::test(start_paused = true)]
    async fn each_change_of_the_split_is_one_event_with_its_reason() {
        let mut config = RoutingConfig {
            services: vec![service(1)],
            targets: vec![zoned(1, "a"), zoned(2, "a"), zoned(3, "b")],
            ..RoutingConfig::default()
        };
        config.services[0].locality = Some(Locality {
            min_available_percent: 100,
        });
        let mut carried = CarriedState::in_zone(Some("a".into()));
        let snapshot = build_snapshot(&config, &mut carried, 1);
        let log = Arc::new(EventLog::new(EventSettings::default()));
        let since = log.last_id();
        let mut observer = Observer::new(log.clone(), "me".into());
        // Before the start is over: the picture, no event.
        observer.report_locality(&snapshot);
        observer.prime(&Default::default());
        let mut watch = tokio::time::interval(std::time::Duration::from_millis(250));
        let tick = |observer: &mut Observer| {
            refresh_zone_splits(&snapshot, crate::clock::unix_ms());
            observer.report_locality(&snapshot);
        };
        for _ in 0..3 {
            watch.tick().await;
            tick(&mut observer);
        }
        assert!(locality_events(&log, since).is_empty(), "nothing changed");

        let service = snapshot.service(1).unwrap();
        service.targets[1].health.set_health(Health::Unhealthy);
        watch.tick().await;
        tick(&mut observer);
        watch.tick().await;
        tick(&mut observer);
        let events = locality_events(&log, since);
        assert_eq!(events.len(), 1, "one event for the change: {events:?}");
        assert_eq!(events[0].from, Some(ZoneSplitKind::ZoneOnly));
        assert_eq!(events[0].to, ZoneSplitKind::AllZones);
        assert_eq!((events[0].available, events[0].total), (1, 2));
        assert_eq!(
            events[0].reason,
            "1 of 2 targets in zone a available (50 % < 100 %)"
        );
        assert_eq!(events[0].basis, "labels");

        service.targets[1].health.set_health(Health::Healthy);
        watch.tick().await;
        tick(&mut observer);
        let events = locality_events(&log, since);
        assert_eq!(events.len(), 2);
        assert_eq!(events[1].to, ZoneSplitKind::ZoneOnly);
        assert_eq!(
            events[1].reason,
            "2 of 2 targets in zone a available (100 % ≥ 100 %)"
        );
    }
}
