//! The canary's verdict on one interval (TRAFFIC.md §4): pure, so every transition is tested
//! without a store or a clock.

use crate::model::{
    last_step, latency_bound_micros, Canary, CanaryCounts, CanaryMove, CanaryState, CanaryStatus,
    LATENCY_BUCKETS,
};

/// Whether the interval of a progressing canary has ended by the store's clock `now_ms`.
pub fn interval_over(canary: &Canary, status: &CanaryStatus, now_ms: i64) -> bool {
    status.state == CanaryState::Progressing
        && now_ms.saturating_sub(status.interval_started_ms)
            >= i64::try_from(canary.step_interval_ms).unwrap_or(i64::MAX)
}

/// Where a progressing canary goes after an interval in which its backend saw `counts`:
/// rolled back when out of bounds, held when too few requests were seen to tell, otherwise
/// the next step, or promoted after the last.
pub fn judge(canary: &Canary, status: &CanaryStatus, counts: &CanaryCounts) -> CanaryMove {
    let rolled_back = |reason: String| CanaryMove {
        state: CanaryState::RolledBack,
        step: status.step,
        weight: 0,
        reason,
    };
    let max_errors = canary.max_error_percent;
    if counts.requests < canary.min_requests {
        // Out of bounds whatever the requests still missing would have been.
        if counts.errors as f64 * 100.0 > max_errors * canary.min_requests as f64 {
            return rolled_back(format!(
                "{} errors in {} requests: above max_error_percent {max_errors} of \
                 min_requests {} already",
                counts.errors, counts.requests, canary.min_requests
            ));
        }
        // No request at all: the canary backend may have had no available target (its share
        // went to the others), which holds it as long as it lasts; say so.
        let why = if counts.requests == 0 {
            " (none reached the canary backend: has it an available target?)"
        } else {
            ""
        };
        return CanaryMove {
            state: CanaryState::Progressing,
            step: status.step,
            weight: status.weight,
            reason: format!(
                "{} requests < min_requests {}{why}: step {} ({} %) held",
                counts.requests,
                canary.min_requests,
                status.step + 1,
                status.weight
            ),
        };
    }
    let error_percent = counts.error_percent();
    if error_percent > max_errors {
        return rolled_back(format!(
            "{error_percent:.2} % errors ({} of {}) > max_error_percent {max_errors}",
            counts.errors, counts.requests
        ));
    }
    let p99 = counts.p99_ms();
    if let Some(max_p99) = canary.max_p99_ms {
        if counts.p99_above(max_p99) {
            let p99 = p99.map_or_else(|| "unknown".to_owned(), p99_text);
            return rolled_back(format!("p99 up to {p99} > max_p99_ms {max_p99}"));
        }
    }
    let in_bounds = format!(
        "{error_percent:.2} % errors in {} requests, p99 {}",
        counts.requests,
        p99.map_or_else(|| "unknown".to_owned(), p99_text)
    );
    if status.step >= last_step(canary) {
        return CanaryMove {
            state: CanaryState::Promoted,
            step: last_step(canary),
            weight: 100,
            reason: format!("{in_bounds}: every step passed, promoted"),
        };
    }
    let step = status.step + 1;
    let weight = canary.step_weight(step as usize);
    CanaryMove {
        state: CanaryState::Progressing,
        step,
        weight,
        reason: format!("{in_bounds}: step {} ({weight} %)", step + 1),
    }
}

fn p99_text(p99: f64) -> String {
    if p99.is_finite() {
        format!("{p99:.1} ms")
    } else {
        format!(
            "over {:.0} s",
            latency_bound_micros(LATENCY_BUCKETS - 2) / 1e6
        )
    }
}
