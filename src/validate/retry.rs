//! A route's retry policy (TRAFFIC.md §5): how many attempts, after which failures, how long
//! each may take and wait, when to hedge, and the budget that bounds them.

use super::ValidationError;
use crate::model::{RetryOn, RetryPolicy, MAX_ATTEMPTS, MAX_RETRY_DELAY_MS};

/// Most retries a budget may always allow per second, however few the requests.
const MAX_BUDGET_MIN_PER_SECOND: u32 = 1_000_000;

/// `redirect`: the route is answered by Raahi, so there is no attempt to repeat.
pub fn retry(retry: &RetryPolicy, redirect: bool) -> Result<(), ValidationError> {
    if redirect {
        return Err(ValidationError::new(
            "retry",
            "a redirect is answered by Raahi: there is no request to the backend to retry",
        ));
    }
    if !(1..=MAX_ATTEMPTS).contains(&retry.attempts) {
        return Err(ValidationError::new(
            "retry.attempts",
            format!("1 to {MAX_ATTEMPTS}, the first attempt included (1 turns retries off)"),
        ));
    }
    on(retry)?;
    statuses(retry)?;
    for (field, value) in [
        ("retry.per_try_timeout_ms", retry.per_try_timeout_ms),
        ("retry.hedge_after_ms", retry.hedge_after_ms),
    ] {
        if value.is_some_and(|ms| !(1..=MAX_RETRY_DELAY_MS).contains(&ms)) {
            return Err(ValidationError::new(
                field,
                format!("1 to {MAX_RETRY_DELAY_MS} ms, or null"),
            ));
        }
    }
    if retry.backoff.base_ms > MAX_RETRY_DELAY_MS {
        return Err(ValidationError::new(
            "retry.backoff.base_ms",
            format!("0 to {MAX_RETRY_DELAY_MS} ms"),
        ));
    }
    if !(retry.backoff.base_ms..=MAX_RETRY_DELAY_MS).contains(&retry.backoff.max_ms) {
        return Err(ValidationError::new(
            "retry.backoff.max_ms",
            format!(
                "from retry.backoff.base_ms ({}) to {MAX_RETRY_DELAY_MS} ms",
                retry.backoff.base_ms
            ),
        ));
    }
    let percent = retry.budget.percent;
    if !(percent.is_finite() && (0.0..=100.0).contains(&percent)) {
        return Err(ValidationError::new(
            "retry.budget.percent",
            "0 to 100 (percent of the window's requests)",
        ));
    }
    if retry.budget.min_per_second > MAX_BUDGET_MIN_PER_SECOND {
        return Err(ValidationError::new(
            "retry.budget.min_per_second",
            format!("0 to {MAX_BUDGET_MIN_PER_SECOND}"),
        ));
    }
    hedge(retry)
}

/// No condition twice; none at all only when nothing would be retried anyway.
fn on(retry: &RetryPolicy) -> Result<(), ValidationError> {
    for (index, condition) in retry.on.iter().enumerate() {
        if retry.on[..index].contains(condition) {
            return Err(ValidationError::new(
                format!("retry.on[{index}]"),
                format!("{:?} is listed twice", condition.name()),
            ));
        }
    }
    // A hedge needs no failure to follow: a hedging route may retry nothing else.
    if retry.on.is_empty() && retry.attempts > 1 && retry.hedge_after_ms.is_none() {
        return Err(ValidationError::new(
            "retry.on",
            "empty, so no failure would be retried: name the conditions, or set attempts to 1",
        ));
    }
    Ok(())
}

/// Statuses exactly when `retriable_status` is a condition, each a status once.
fn statuses(retry: &RetryPolicy) -> Result<(), ValidationError> {
    for (index, status) in retry.statuses.iter().enumerate() {
        let at = format!("retry.statuses[{index}]");
        if !(100..=599).contains(status) {
            return Err(ValidationError::new(at, "a status from 100 to 599"));
        }
        if retry.statuses[..index].contains(status) {
            return Err(ValidationError::new(
                at,
                format!("{status} is listed twice"),
            ));
        }
    }
    let by_status = retry.on.contains(&RetryOn::RetriableStatus);
    if by_status && retry.statuses.is_empty() {
        return Err(ValidationError::new(
            "retry.statuses",
            "retriable_status is in retry.on: name the statuses it retries",
        ));
    }
    if !by_status && !retry.statuses.is_empty() {
        return Err(ValidationError::new(
            "retry.statuses",
            "these statuses would retry nothing: add \"retriable_status\" to retry.on",
        ));
    }
    Ok(())
}

/// A hedge is a second attempt started before the first answers.
fn hedge(retry: &RetryPolicy) -> Result<(), ValidationError> {
    let Some(hedge_after_ms) = retry.hedge_after_ms else {
        return Ok(());
    };
    if retry.attempts < 2 {
        return Err(ValidationError::new(
            "retry.hedge_after_ms",
            "a hedge is a second attempt: attempts must be at least 2",
        ));
    }
    if let Some(per_try_timeout_ms) = retry.per_try_timeout_ms {
        if hedge_after_ms >= per_try_timeout_ms {
            return Err(ValidationError::new(
                "retry.hedge_after_ms",
                format!(
                    "shorter than retry.per_try_timeout_ms ({per_try_timeout_ms}): a hedge after \
                     the attempt timed out is just a retry"
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{RetryBackoff, RetryBudget};

    fn policy() -> RetryPolicy {
        serde_json::from_str("{}").unwrap()
    }

    fn field_of(policy: RetryPolicy) -> String {
        retry(&policy, false).unwrap_err().field
    }

    #[test]
    fn each_bad_field_is_named() {
        for attempts in [0, MAX_ATTEMPTS + 1] {
            assert_eq!(
                field_of(RetryPolicy {
                    attempts,
                    ..policy()
                }),
                "retry.attempts",
                "{attempts}"
            );
        }
        assert_eq!(
            field_of(RetryPolicy {
                on: vec![RetryOn::Reset, RetryOn::FiveXx, RetryOn::Reset],
                ..policy()
            }),
            "retry.on[2]"
        );
        assert_eq!(
            field_of(RetryPolicy {
                on: Vec::new(),
                ..policy()
            }),
            "retry.on"
        );
        let by_status = || RetryPolicy {
            on: vec![RetryOn::RetriableStatus],
            statuses: vec![429],
            ..policy()
        };
        for (statuses, field) in [
            (vec![429, 600], "retry.statuses[1]"),
            (vec![99], "retry.statuses[0]"),
            (vec![429, 503, 429], "retry.statuses[2]"),
            (Vec::new(), "retry.statuses"),
        ] {
            assert_eq!(
                field_of(RetryPolicy {
                    statuses,
                    ..by_status()
                }),
                field
            );
        }
        assert_eq!(
            field_of(RetryPolicy {
                statuses: vec![503],
                ..policy()
            }),
            "retry.statuses"
        );
        for ms in [0, MAX_RETRY_DELAY_MS + 1] {
            assert_eq!(
                field_of(RetryPolicy {
                    per_try_timeout_ms: Some(ms),
                    ..policy()
                }),
                "retry.per_try_timeout_ms"
            );
            assert_eq!(
                field_of(RetryPolicy {
                    hedge_after_ms: Some(ms),
                    ..policy()
                }),
                "retry.hedge_after_ms"
            );
        }
        assert_eq!(
            field_of(RetryPolicy {
                backoff: RetryBackoff {
                    base_ms: MAX_RETRY_DELAY_MS + 1,
                    max_ms: MAX_RETRY_DELAY_MS + 1,
                },
                ..policy()
            }),
            "retry.backoff.base_ms"
        );
        for (base_ms, max_ms) in [(100, 99), (0, MAX_RETRY_DELAY_MS + 1)] {
            assert_eq!(
                field_of(RetryPolicy {
                    backoff: RetryBackoff { base_ms, max_ms },
                    ..policy()
                }),
                "retry.backoff.max_ms"
            );
        }
        for percent in [-1.0, 100.5, f64::NAN, f64::INFINITY] {
            assert_eq!(
                field_of(RetryPolicy {
                    budget: RetryBudget {
                        percent,
                        ..RetryBudget::default()
                    },
                    ..policy()
                }),
                "retry.budget.percent",
                "{percent}"
            );
        }
        assert_eq!(
            field_of(RetryPolicy {
                budget: RetryBudget {
                    min_per_second: MAX_BUDGET_MIN_PER_SECOND + 1,
                    ..RetryBudget::default()
                },
                ..policy()
            }),
            "retry.budget.min_per_second"
        );
        assert_eq!(
            field_of(RetryPolicy {
                per_try_timeout_ms: Some(100),
                hedge_after_ms: Some(100),
                ..policy()
            }),
            "retry.hedge_after_ms"
        );
        assert_eq!(
            field_of(RetryPolicy {
                attempts: 1,
                hedge_after_ms: Some(50),
                ..policy()
            }),
            "retry.hedge_after_ms"
        );
        assert_eq!(retry(&policy(), true).unwrap_err().field, "retry");
    }

    #[test]
    fn a_route_checks_its_retry_and_a_redirect_takes_none() {
        use crate::model::{Redirect, RouteSpec};
        let spec = RouteSpec {
            name: "r".into(),
            service_id: Some(1),
            retry: Some(policy()),
            ..RouteSpec::default()
        };
        assert_eq!(super::super::route(spec.clone()).unwrap().retry, spec.retry);
        let bad = RouteSpec {
            retry: Some(RetryPolicy {
                attempts: 0,
                ..policy()
            }),
            ..spec.clone()
        };
        assert_eq!(
            super::super::route(bad).unwrap_err().field,
            "retry.attempts"
        );
        let redirect = RouteSpec {
            service_id: None,
            redirect: Some(Redirect {
                scheme: Some("https".into()),
                hostname: None,
                port: None,
                path: None,
                prefix: None,
                status: 308,
            }),
            ..spec
        };
        assert_eq!(super::super::route(redirect).unwrap_err().field, "retry");
    }

    #[test]
    fn sound_policies_are_accepted() {
        retry(&policy(), false).unwrap();
        retry(&RetryPolicy::service_default(1), false).unwrap();
        for accepted in [
            // One attempt retries nothing, so it needs no condition.
            RetryPolicy {
                attempts: 1,
                on: Vec::new(),
                ..policy()
            },
            // Hedging alone, with no failure retried.
            RetryPolicy {
                on: Vec::new(),
                hedge_after_ms: Some(50),
                per_try_timeout_ms: Some(200),
                ..policy()
            },
            RetryPolicy {
                attempts: MAX_ATTEMPTS,
                on: RetryOn::ALL.to_vec(),
                statuses: vec![100, 429, 599],
                per_try_timeout_ms: Some(MAX_RETRY_DELAY_MS),
                backoff: RetryBackoff {
                    base_ms: 0,
                    max_ms: 0,
                },
                budget: RetryBudget {
                    percent: 0.0,
                    min_per_second: 0,
                },
                hedge_after_ms: Some(1),
            },
            RetryPolicy {
                backoff: RetryBackoff {
                    base_ms: MAX_RETRY_DELAY_MS,
                    max_ms: MAX_RETRY_DELAY_MS,
                },
                budget: RetryBudget {
                    percent: 100.0,
                    min_per_second: MAX_BUDGET_MIN_PER_SECOND,
                },
                ..policy()
            },
        ] {
            retry(&accepted, false).unwrap_or_else(|error| panic!("{accepted:?}: {error}"));
        }
    }
}
