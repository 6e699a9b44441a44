//! Health and ejection changes of targets in rotation: the atomics the checks and the request
//! path flip, looked at every few hundred milliseconds and after each health verdict.

use chrono::{DateTime, Utc};

use super::targets::{target_view, TargetNews};
use super::{Look, Observer, Phase};
use crate::clock::unix_ms;
use crate::events::TargetChangeKind;
use crate::model::{Ejection, Health};
use crate::snapshot::{Snapshot, TargetRuntime};

impl Observer {
    pub(in crate::control) fn report_runtime(&mut self, snapshot: &Snapshot) {
        if !self.primed {
            return;
        }
        let now_ms = unix_ms();
        for service in snapshot.services() {
            for runtime in &service.targets {
                let current = Look::of(runtime, now_ms);
                let Some(seen) = self.targets.get_mut(&runtime.id) else {
                    continue;
                };
                let Some(before) = seen.look.replace(current) else {
                    continue;
                };
                if before == current {
                    continue;
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
                let news = self.runtime_news(before, current, runtime, &service.service.ejection);
                for news in news {
                    self.record_target(
                        &target,
                        Some(target_view(&target, Some(runtime), now_ms)),
                        news,
                    );
                }
            }
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
}
