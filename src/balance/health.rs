//! Per-target availability: active health-check verdicts and passive outlier ejection, as
//! atomics shared by every snapshot (carried by target id) and read on each pick.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::model::{Ejection, Health};

/// Wall-clock milliseconds, so ejection deadlines can be shown to operators as times.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}

#[derive(Debug)]
pub struct TargetHealth {
    health: AtomicU8,
    /// Unix ms; 0 when never ejected or cleared by a success.
    ejected_until_ms: AtomicU64,
    /// Ejections since the last success: the next one lasts this many times the base.
    ejections: AtomicU32,
    /// Ejected before and not yet proven by a success: one failure ejects it again.
    probation: AtomicBool,
    window_start_ms: AtomicU64,
    window_failures: AtomicU32,
}

impl Default for TargetHealth {
    fn default() -> Self {
        TargetHealth::new(Health::Unknown)
    }
}

fn health_code(health: Health) -> u8 {
    match health {
        Health::Unknown => 0,
        Health::Healthy => 1,
        Health::Unhealthy => 2,
    }
}

impl TargetHealth {
    pub fn new(health: Health) -> TargetHealth {
        TargetHealth {
            health: AtomicU8::new(health_code(health)),
            ejected_until_ms: AtomicU64::new(0),
            ejections: AtomicU32::new(0),
            probation: AtomicBool::new(false),
            window_start_ms: AtomicU64::new(0),
            window_failures: AtomicU32::new(0),
        }
    }

    pub fn health(&self) -> Health {
        match self.health.load(Ordering::Relaxed) {
            1 => Health::Healthy,
            2 => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }

    pub fn set_health(&self, health: Health) {
        self.health.store(health_code(health), Ordering::Relaxed);
    }

    /// When the current ejection ends, if the target is ejected at `now_ms`.
    pub fn ejected_until(&self, now_ms: u64) -> Option<u64> {
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        (until > now_ms).then_some(until)
    }

    /// Not unhealthy and not ejected. The clock is read only while an ejection is recorded.
    pub fn is_available(&self, now_ms: impl FnOnce() -> u64) -> bool {
        if self.health.load(Ordering::Relaxed) == health_code(Health::Unhealthy) {
            return false;
        }
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        until == 0 || until <= now_ms()
    }

    /// A request it served succeeded: its failure window starts over, and a trial after an
    /// ejection restores it. A success that arrives while the ejection still runs (a request
    /// started before it) does not cut the ejection short.
    pub fn record_success(&self, now_ms: impl FnOnce() -> u64) {
        if self.window_failures.load(Ordering::Relaxed) != 0 {
            self.window_failures.store(0, Ordering::Relaxed);
        }
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        if until == 0 && !self.probation.load(Ordering::Relaxed) {
            return;
        }
        if until > now_ms() {
            return;
        }
        self.ejected_until_ms.store(0, Ordering::Relaxed);
        self.probation.store(false, Ordering::Relaxed);
        self.ejections.store(0, Ordering::Relaxed);
    }

    /// A request it served failed. Returns whether this failure calls for an ejection: the
    /// `failures`-th within `window_ms`, or any failure of a trial after an ejection.
    pub fn record_failure(&self, now_ms: u64, policy: &Ejection) -> bool {
        if self.ejected_until(now_ms).is_some() {
            return false;
        }
        if self.probation.load(Ordering::Relaxed) {
            return true;
        }
        let start = self.window_start_ms.load(Ordering::Relaxed);
        let failures = if now_ms.saturating_sub(start) > policy.window_ms {
            self.window_start_ms.store(now_ms, Ordering::Relaxed);
            self.window_failures.store(1, Ordering::Relaxed);
            1
        } else {
            self.window_failures.fetch_add(1, Ordering::Relaxed) + 1
        };
        failures >= policy.failures
    }

    /// Takes the target out until `now + base × ejections` (capped). None when another request
    /// ejected it first.
    pub fn eject(&self, now_ms: u64, policy: &Ejection) -> Option<u64> {
        let previous = self.ejected_until_ms.load(Ordering::Relaxed);
        if previous > now_ms {
            return None;
        }
        let times = u64::from(self.ejections.load(Ordering::Relaxed)) + 1;
        let duration = policy
            .base_ejection_ms
            .saturating_mul(times)
            .min(policy.max_ejection_ms);
        let until = now_ms.saturating_add(duration).max(1);
        self.ejected_until_ms
            .compare_exchange(previous, until, Ordering::Relaxed, Ordering::Relaxed)
            .ok()?;
        self.ejections.fetch_add(1, Ordering::Relaxed);
        self.probation.store(true, Ordering::Relaxed);
        self.window_failures.store(0, Ordering::Relaxed);
        self.window_start_ms.store(now_ms, Ordering::Relaxed);
        Some(until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Ejection {
        Ejection {
            failures: 3,
            window_ms: 1_000,
            base_ejection_ms: 10_000,
            max_ejection_ms: 25_000,
            ..Ejection::default()
        }
    }

    #[test]
    fn failures_within_the_window_call_for_ejection() {
        let target = TargetHealth::default();
        assert!(!target.record_failure(100, &policy()));
        assert!(!target.record_failure(200, &policy()));
        assert!(target.record_failure(300, &policy()));
    }

    #[test]
    fn an_old_window_starts_over() {
        let target = TargetHealth::default();
        target.record_failure(100, &policy());
        target.record_failure(200, &policy());
        assert!(
            !target.record_failure(2_000, &policy()),
            "the window passed"
        );
        assert!(!target.record_failure(2_100, &policy()));
        assert!(target.record_failure(2_200, &policy()));
    }

    #[test]
    fn a_success_clears_the_window() {
        let target = TargetHealth::default();
        target.record_failure(100, &policy());
        target.record_failure(200, &policy());
        target.record_success(|| 250);
        assert!(!target.record_failure(300, &policy()));
    }

    #[test]
    fn ejection_lasts_longer_each_time_up_to_the_cap() {
        let target = TargetHealth::default();
        assert_eq!(target.eject(0, &policy()), Some(10_000));
        assert!(!target.is_available(|| 5_000));
        assert!(
            target.is_available(|| 10_000),
            "available again for a trial"
        );
        // The trial fails: out again at once, for twice as long.
        assert!(target.record_failure(10_001, &policy()));
        assert_eq!(target.eject(10_001, &policy()), Some(30_001));
        assert!(target.record_failure(30_002, &policy()));
        assert_eq!(
            target.eject(30_002, &policy()),
            Some(55_002),
            "capped at 25 s"
        );
    }

    #[test]
    fn a_success_during_the_ejection_does_not_end_it() {
        let target = TargetHealth::default();
        target.eject(0, &policy());
        target.record_success(|| 5_000);
        assert!(!target.is_available(|| 5_001), "still ejected");
    }

    #[test]
    fn a_successful_trial_restores_the_target() {
        let target = TargetHealth::default();
        target.eject(0, &policy());
        target.record_success(|| 10_000);
        assert!(target.is_available(|| 1));
        assert!(
            !target.record_failure(20_000, &policy()),
            "no longer on probation"
        );
        assert_eq!(
            target.eject(20_000, &policy()),
            Some(30_000),
            "back to the base time"
        );
    }

    #[test]
    fn only_one_concurrent_ejection_wins() {
        let target = TargetHealth::default();
        assert!(target.eject(0, &policy()).is_some());
        assert!(target.eject(1, &policy()).is_none());
        assert!(
            !target.record_failure(2, &policy()),
            "failures while ejected do not count"
        );
    }

    #[test]
    fn unhealthy_is_unavailable_whatever_the_ejection() {
        let target = TargetHealth::new(Health::Unhealthy);
        assert!(!target.is_available(|| 0));
        target.set_health(Health::Healthy);
        assert!(target.is_available(|| panic!("clock read without an ejection")));
        assert_eq!(target.health(), Health::Healthy);
    }
}
