//! What a request or a connection does to its target's shared state, the same for HTTP and
//! L4: it counts as in flight while it runs (least-request balancing, the dashboard), and its
//! outcome feeds passive ejection.

use std::sync::Arc;

use crate::balance::{FailureCause, TargetLoad};
use crate::clock::unix_ms;
use crate::snapshot::{ServiceRuntime, TargetRuntime};

/// Counts a request or connection against its target from pick until it is finished or dropped.
pub struct InFlight {
    load: Arc<TargetLoad>,
}

impl InFlight {
    pub fn start(load: &Arc<TargetLoad>) -> InFlight {
        load.start_request();
        InFlight { load: load.clone() }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.load.finish_request();
    }
}

/// Feeds passive ejection: a failure (connect error, timeout, a failure status) may take the
/// target out; a success clears its record and ends a half-open trial by restoring the target.
pub fn record_outcome(
    service: &ServiceRuntime,
    target: &TargetRuntime,
    failure: Option<FailureCause>,
) {
    let policy = &service.service.ejection;
    // With ejection turned off after a target was ejected, nothing would judge its trials and it
    // would stay half-open (one request at a time) for good: any outcome restores it instead,
    // once the ejection has run out.
    let Some(cause) = failure.filter(|_| policy.enabled) else {
        target.health.record_success(unix_ms);
        return;
    };
    let now = unix_ms();
    if !target.health.record_failure(now, policy) || !ejection_allowed(service, now) {
        return;
    }
    if let Some(until) = target.health.eject(now, policy, cause) {
        tracing::warn!(
            service = %service.service.name,
            target = %target.authority,
            ejected_for_ms = until.saturating_sub(now),
            "target ejected after failures"
        );
    }
}

/// `max_ejection_percent` of the service's targets may be out at once, and always at least one.
fn ejection_allowed(service: &ServiceRuntime, now: u64) -> bool {
    let percent = service.service.ejection.max_ejection_percent as usize;
    if percent == 0 {
        return false;
    }
    let allowed = (service.targets.len() * percent / 100).max(1);
    let ejected = service
        .targets
        .iter()
        .filter(|target| target.health.ejected_until(now).is_some())
        .count();
    ejected < allowed
}
