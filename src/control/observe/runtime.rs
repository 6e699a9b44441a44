//! Health and ejection changes of targets in rotation: the atomics the checks and the request
//! path flip, looked at every few hundred milliseconds and after each health verdict.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};

use super::targets::{target_view, TargetNews};
use super::{Look, Observer, Phase};
use crate::clock::unix_ms;
use crate::control::build::MovedTargets;
use crate::events::TargetChangeKind;
use crate::model::{Ejection, Health, Id};
use crate::snapshot::{Snapshot, TargetRuntime};

impl Observer {
    /// Reports the health and ejection changes of the targets `moved` names, of those whose
    /// ejection has run out since the last look, and of those a reload put back in view: what
    /// a look at every target would report, at the cost of what changed.
    pub(in crate::control) fn report_runtime(&mut self, snapshot: &Snapshot, moved: MovedTargets) {
        if !self.primed {
            return;
        }
        let now_ms = unix_ms();
        let mut wanted: HashSet<Id> = std::mem::take(&mut self.look_again);
        wanted.extend(moved.ids);
        while let Some(Reverse((until, id))) = self.ejection_ends.peek().copied() {
            if until > now_ms {
                break;
            }
            self.ejection_ends.pop();
            wanted.insert(id);
        }
        if moved.everything {
            wanted.extend(self.targets.keys().copied());
        }
        let mut by_service: HashMap<Id, HashSet<Id>> = HashMap::new();
        for id in wanted {
            if let Some(seen) = self.targets.get(&id) {
                by_service
                    .entry(seen.target.service_id)
                    .or_default()
                    .insert(id);
            }
        }
        for (service_id, ids) in by_service {
            let Some(service) = snapshot.service(service_id) else {
                continue;
            };
            for runtime in service.targets.iter().filter(|r| ids.contains(&r.id)) {
                self.look_at(runtime, &service.service.ejection, now_ms);
            }
        }
    }

    /// Compares a target in rotation with its last look and reports what moved.
    fn look_at(&mut self, runtime: &TargetRuntime, ejection: &Ejection, now_ms: u64) {
        let current = Look::of(runtime, now_ms);
        let Some(seen) = self.targets.get_mut(&runtime.id) else {
            return;
        };
        let Some(before) = seen.look.replace(current) else {
            return;
        };
        if current.phase == Phase::Ejected {
            self.ejection_ends
                .push(Reverse((runtime.health.ejected_until_ms(), runtime.id)));
        }
        if before == current {
            return;
        }
        let mut target = crate::model::Target::clone(&seen.target);
        // The store has the deciding check only once the round is written.
        if let Some(check) = self.deciding_checks.get(&runtime.id) {
            if target
                .last_check
                .as_ref()
                .is_none_or(|stored| stored.at < check.at)
            {
                target.last_check = Some(check.clone());
            }
        }
        let news = self.runtime_news(before, current, runtime, ejection);
        for news in news {
            self.record_target(
                &target,
                Some(target_view(&target, Some(runtime), now_ms)),
                news,
            );
        }
    }

    /// What happened between two looks. An ejection that began and ended between them is
    /// still told (its sequence moved), then where the target is now.
    fn runtime_news(
        &mut self,
        before: Look,
        current: Look,
        runtime: &TargetRuntime,
        ejection: &Ejection,
    ) -> Vec<TargetNews> {
        let mut news = Vec::new();
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
            news.push(TargetNews::new(TargetChangeKind::Health, reason).moving(
                Some(before.health.as_str().to_owned()),
                Some(current.health.as_str().to_owned()),
            ));
        }
        let ejected_since = current.ejection_sequence != before.ejection_sequence;
        if ejected_since {
            let until = match current.phase {
                Phase::Ejected => {
                    DateTime::<Utc>::from_timestamp_millis(runtime.health.ejected_until_ms() as i64)
                        .map(|until| until.to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
                }
                _ => None,
            };
            news.push(
                TargetNews::new(
                    TargetChangeKind::Ejected,
                    ejection_reason(runtime, ejection),
                )
                .moving(None, until),
            );
        }
        let phase_moved = ejected_since || before.phase != current.phase;
        match current.phase {
            Phase::HalfOpen if phase_moved => news.push(TargetNews::new(
                TargetChangeKind::HalfOpen,
                "ejection ended; one trial request at a time",
            )),
            Phase::Open if phase_moved => news.push(TargetNews::new(
                TargetChangeKind::Restored,
                if ejection.enabled {
                    "a request succeeded"
                } else {
                    "ejection turned off"
                },
            )),
            _ => {}
        }
        news
    }
}

fn ejection_reason(runtime: &TargetRuntime, ejection: &Ejection) -> String {
    match runtime.health.last_ejection() {
        Some(cause) if cause.trial => format!("half-open trial failed: {}", cause.failure),
        Some(cause) => format!(
            "{} failures in {} s: {}",
            ejection.failures,
            ejection.window_ms.div_ceil(1_000),
            cause.failure
        ),
        None => "failed requests".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::balance::{FailureCause, TargetHealth};
    use crate::clock::unix_ms;
    use crate::events::{EventLog, EventSettings};

    fn runtime() -> TargetRuntime {
        TargetRuntime {
            spec: Default::default(),
            id: 1,
            authority: "10.0.0.1:80".parse().unwrap(),
            host_header: http::HeaderValue::from_static("10.0.0.1:80"),
            load: Arc::default(),
            health: Arc::new(TargetHealth::default()),
            identity: 0,
        }
    }

    fn observer() -> Observer {
        Observer::new(
            Arc::new(EventLog::new(EventSettings::default())),
            "me".into(),
        )
    }

    fn kinds(news: &[TargetNews]) -> Vec<TargetChangeKind> {
        news.iter().map(|news| news.change).collect()
    }

    fn policy() -> Ejection {
        Ejection {
            failures: 2,
            window_ms: 30_000,
            base_ejection_ms: 10_000,
            ..Ejection::default()
        }
    }

    #[test]
    fn an_ejection_begun_and_ended_between_two_looks_is_still_told() {
        let runtime = runtime();
        let now = unix_ms();
        let before = Look::of(&runtime, now);
        // Ejected 20 s ago for 10 s, and a request has succeeded since.
        runtime
            .health
            .eject(now - 20_000, &policy(), FailureCause::Status(503));
        runtime.health.record_success(|| now);
        let current = Look::of(&runtime, now);
        let news = observer().runtime_news(before, current, &runtime, &policy());
        assert_eq!(
            kinds(&news),
            [TargetChangeKind::Ejected, TargetChangeKind::Restored]
        );
        assert_eq!(news[0].reason, "2 failures in 30 s: HTTP 503");
        assert_eq!(news[0].to, None, "no longer ejected");
        assert_eq!(news[1].reason, "a request succeeded");
    }

    #[test]
    fn ejected_then_half_open_then_ejected_again_by_its_trial() {
        let runtime = runtime();
        let now = unix_ms();
        let mut observer = observer();
        runtime
            .health
            .eject(now, &policy(), FailureCause::ConnectFailed);
        let ejected = Look::of(&runtime, now);
        assert_eq!(ejected.phase, Phase::Ejected);
        let later = now + 10_001;
        let half_open = Look::of(&runtime, later);
        let news = observer.runtime_news(ejected, half_open, &runtime, &policy());
        assert_eq!(kinds(&news), [TargetChangeKind::HalfOpen]);
        // Its trial fails: ejected again, for longer, as a failed trial.
        assert!(runtime.health.record_failure(later, &policy()));
        runtime
            .health
            .eject(later, &policy(), FailureCause::Timeout);
        let again = Look::of(&runtime, later);
        let news = observer.runtime_news(half_open, again, &runtime, &policy());
        assert_eq!(kinds(&news), [TargetChangeKind::Ejected]);
        assert_eq!(news[0].reason, "half-open trial failed: timed out");
        assert!(news[0].to.is_some(), "ejected until a time");
    }

    #[test]
    fn a_health_change_takes_the_checks_reason_only_for_that_verdict() {
        let runtime = runtime();
        let now = unix_ms();
        let mut observer = observer();
        let before = Look::of(&runtime, now);
        observer
            .health_reasons
            .insert(1, (Health::Healthy, "2 passed checks: HTTP 200".to_owned()));
        runtime.health.set_health(Health::Unhealthy);
        let news = observer.runtime_news(before, Look::of(&runtime, now), &runtime, &policy());
        assert_eq!(kinds(&news), [TargetChangeKind::Health]);
        assert_eq!(news[0].reason, "health check verdict");
        assert_eq!(news[0].to.as_deref(), Some("unhealthy"));
    }

    /// Two observers of one snapshot: one looks at what the marks, the reload and the ejection
    /// deadlines name, the other at every target each time, as the watch did before.
    struct Pair {
        snapshot: crate::snapshot::Snapshot,
        carried: crate::control::CarriedState,
        marked: Observer,
        walking: Observer,
        marked_log: Arc<EventLog>,
        walking_log: Arc<EventLog>,
        /// The logs' last ids before the ticks (ids are times).
        since: (u64, u64),
    }

    impl Pair {
        fn new(services: i64, targets_each: i64) -> Pair {
            use crate::control::build::{build_snapshot, tests::service};
            use crate::model::{RoutingConfig, Target, TargetState};
            let config = RoutingConfig {
                services: (1..=services).map(service).collect(),
                targets: (0..services * targets_each)
                    .map(|index| Target {
                        id: index + 1,
                        service_id: index / targets_each + 1,
                        host: "10.0.0.1".to_owned(),
                        port: 1_000 + index as u16,
                        weight: 100,
                        enabled: true,
                        state: TargetState::Active,
                        ..Target::default()
                    })
                    .collect(),
                ..RoutingConfig::default()
            };
            let mut carried = crate::control::CarriedState::in_zone(None);
            let snapshot = build_snapshot(&config, &mut carried, 1);
            let desired = crate::control::desired::Desired::from_config(config);
            let marked_log = Arc::new(EventLog::new(EventSettings::default()));
            let walking_log = Arc::new(EventLog::new(EventSettings::default()));
            let mut marked = Observer::new(marked_log.clone(), "me".into());
            let mut walking = Observer::new(walking_log.clone(), "me".into());
            for observer in [&mut marked, &mut walking] {
                let everything = crate::store::ChangeSet::everything();
                observer.changes_loaded(&desired, &everything, &snapshot, &Default::default());
                observer.prime(&Default::default());
            }
            Pair {
                since: (marked_log.last_id(), walking_log.last_id()),
                snapshot,
                carried,
                marked,
                walking,
                marked_log,
                walking_log,
            }
        }

        fn runtime(&self, id: Id) -> &TargetRuntime {
            self.snapshot
                .services()
                .flat_map(|service| service.targets.iter())
                .find(|runtime| runtime.id == id)
                .unwrap()
        }

        /// One watch tick of each; the target events each recorded so far, by target.
        fn tick(&mut self) -> (Vec<String>, Vec<String>) {
            let moved = self.carried.take_moved();
            self.marked.report_runtime(&self.snapshot, moved);
            let everything = MovedTargets {
                ids: Vec::new(),
                everything: true,
            };
            self.walking.report_runtime(&self.snapshot, everything);
            (
                told(&self.marked_log, self.since.0),
                told(&self.walking_log, self.since.1),
            )
        }
    }

    fn told(log: &EventLog, since: u64) -> Vec<String> {
        let mut told: Vec<(Id, String)> = log
            .subscribe(Some(since))
            .backlog
            .unwrap_or_default()
            .iter()
            .map(|event| event.parsed())
            .filter(|(kind, _)| kind == "target")
            .map(|(_, data)| {
                let id = data["target_id"].as_i64().unwrap();
                let line = format!(
                    "{id} {} {}→{}: {}",
                    data["change"], data["from"], data["to"], data["reason"]
                );
                (id, line)
            })
            .collect();
        told.sort_by_key(|(id, _)| *id);
        told.into_iter().map(|(_, line)| line).collect()
    }

    #[test]
    fn a_look_at_the_marked_targets_tells_what_a_look_at_every_target_tells() {
        let mut pair = Pair::new(30, 40);
        assert_eq!(pair.tick(), (vec![], vec![]), "nothing moved");
        let now = unix_ms();
        pair.runtime(7).health.set_health(Health::Unhealthy);
        pair.runtime(700).health.set_health(Health::Healthy);
        pair.runtime(900)
            .health
            .eject(now, &policy(), FailureCause::Status(502));
        // Ejected long ago and restored since: both are news.
        pair.runtime(1_100)
            .health
            .eject(now - 20_000, &policy(), FailureCause::Timeout);
        pair.runtime(1_100).health.record_success(|| now);
        let (marked, walking) = pair.tick();
        assert_eq!(marked.len(), 5, "{marked:?}");
        assert_eq!(marked, walking);

        pair.runtime(7).health.set_health(Health::Healthy);
        pair.runtime(7).health.set_health(Health::Unhealthy);
        pair.runtime(8).health.set_health(Health::Unknown);
        let (marked, walking) = pair.tick();
        assert_eq!(
            marked.len(),
            5,
            "no news for a flip back and forth: {marked:?}"
        );
        assert_eq!(marked, walking);
    }

    #[test]
    fn an_ejection_that_runs_out_is_told_without_a_mark() {
        let mut pair = Pair::new(2, 3);
        let now = unix_ms();
        // Ejected for the policy's 10 s, starting 9.95 s ago: half-open 50 ms from now.
        let until = pair
            .runtime(2)
            .health
            .eject(now - 9_950, &policy(), FailureCause::ConnectFailed)
            .unwrap();
        let (marked, walking) = pair.tick();
        assert_eq!(marked, walking);
        assert_eq!(marked.len(), 1, "ejected: {marked:?}");
        // The clock alone moves it: no write, so no mark.
        while unix_ms() <= until {
            std::thread::yield_now();
        }
        let (marked, walking) = pair.tick();
        assert_eq!(marked, walking);
        assert_eq!(marked.len(), 2, "then half-open: {marked:?}");
        assert!(marked[1].contains("half_open"), "{marked:?}");
    }
}
