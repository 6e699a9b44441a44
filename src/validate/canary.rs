//! A route's canary (TRAFFIC.md §4).

use super::ValidationError;
use crate::model::{Backend, Canary, MIN_CANARY_INTERVAL_MS};

/// Longest interval a step may be judged over: a day.
const MAX_CANARY_INTERVAL_MS: u64 = 86_400_000;
const MAX_STEPS: usize = 100;
const MAX_MIN_REQUESTS: u64 = 1_000_000_000;
/// Highest `max_p99_ms`: the latency histogram's last bounded bucket ends at 46 s, so a p99
/// above a higher bound could not be told from one below it.
const MAX_P99_MS: u64 = 45_000;

/// `backends`: the route's backends (after the `service_id` shorthand).
pub fn canary(canary: &Canary, backends: &[Backend]) -> Result<(), ValidationError> {
    let others_weight: u64 = backends
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != canary.backend_index())
        .map(|(_, backend)| u64::from(backend.weight))
        .sum();
    let backends = backends.len();
    if backends < 2 {
        return Err(ValidationError::new(
            "canary",
            "a canary needs a route with two or more backends",
        ));
    }
    if canary.backend_index() >= backends {
        return Err(ValidationError::new(
            "canary.backend",
            format!(
                "the position of one of the route's {backends} backends (0 to {})",
                backends - 1
            ),
        ));
    }
    if others_weight == 0 {
        return Err(ValidationError::new(
            "canary.backend",
            "the other backends' weights add up to 0: nothing would take the rest of the \
             requests, or all of them after a rollback (to send everything to a promoted \
             canary, remove `canary` in the same change)",
        ));
    }
    steps(&canary.steps)?;
    if !(MIN_CANARY_INTERVAL_MS..=MAX_CANARY_INTERVAL_MS).contains(&canary.step_interval_ms) {
        return Err(ValidationError::new(
            "canary.step_interval_ms",
            format!("{MIN_CANARY_INTERVAL_MS} to {MAX_CANARY_INTERVAL_MS}"),
        ));
    }
    if !(1..=MAX_MIN_REQUESTS).contains(&canary.min_requests) {
        return Err(ValidationError::new(
            "canary.min_requests",
            format!("1 to {MAX_MIN_REQUESTS}"),
        ));
    }
    let errors = canary.max_error_percent;
    if !(errors.is_finite() && (0.0..=100.0).contains(&errors)) {
        return Err(ValidationError::new("canary.max_error_percent", "0 to 100"));
    }
    if let Some(p99) = canary.max_p99_ms {
        if !(1..=MAX_P99_MS).contains(&p99) {
            return Err(ValidationError::new(
                "canary.max_p99_ms",
                format!("1 to {MAX_P99_MS}, or null"),
            ));
        }
    }
    Ok(())
}

fn steps(steps: &[u8]) -> Result<(), ValidationError> {
    if steps.is_empty() || steps.len() > MAX_STEPS {
        return Err(ValidationError::new(
            "canary.steps",
            format!("1 to {MAX_STEPS} percents, rising, the last 100"),
        ));
    }
    let mut previous = 0;
    for (index, &step) in steps.iter().enumerate() {
        if step <= previous || step > 100 {
            return Err(ValidationError::new(
                format!("canary.steps[{index}]"),
                format!("above the step before ({previous}), at most 100"),
            ));
        }
        previous = step;
    }
    if previous != 100 {
        return Err(ValidationError::new(
            format!("canary.steps[{}]", steps.len() - 1),
            "the last step is 100: a canary that passes every step is promoted",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(value: serde_json::Value) -> Canary {
        serde_json::from_value(value).unwrap()
    }

    fn backends(count: usize) -> Vec<Backend> {
        (0..count)
            .map(|index| Backend::whole(index as i64 + 1))
            .collect()
    }

    fn field_of(value: serde_json::Value, count: usize) -> String {
        canary(&parsed(value), &backends(count)).unwrap_err().field
    }

    #[test]
    fn the_defaults_on_two_backends_are_valid() {
        assert!(canary(&parsed(serde_json::json!({"backend": 1})), &backends(2)).is_ok());
        let defaults = parsed(serde_json::json!({"backend": 1}));
        assert_eq!(defaults.steps, vec![5, 25, 50, 100]);
        assert_eq!(defaults.step_interval_ms, 60_000);
        assert_eq!(defaults.min_requests, 100);
        assert_eq!(defaults.max_error_percent, 1.0);
        assert_eq!(defaults.max_p99_ms, None);
    }

    #[test]
    fn each_bad_field_is_named() {
        use serde_json::json;
        assert_eq!(field_of(json!({"backend": 0}), 1), "canary");
        assert_eq!(field_of(json!({"backend": 2}), 2), "canary.backend");
        assert_eq!(
            field_of(json!({"backend": 1, "steps": []}), 2),
            "canary.steps"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "steps": [5, 5, 100]}), 2),
            "canary.steps[1]"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "steps": [0, 100]}), 2),
            "canary.steps[0]"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "steps": [10, 50]}), 2),
            "canary.steps[1]"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "step_interval_ms": 999}), 2),
            "canary.step_interval_ms"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "min_requests": 0}), 2),
            "canary.min_requests"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "max_error_percent": 101.0}), 2),
            "canary.max_error_percent"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "max_p99_ms": 0}), 2),
            "canary.max_p99_ms"
        );
        assert_eq!(
            field_of(json!({"backend": 1, "max_p99_ms": 45_001}), 2),
            "canary.max_p99_ms"
        );
        let mut idle_stable = backends(2);
        idle_stable[0].weight = 0;
        let refused = canary(&parsed(json!({"backend": 1})), &idle_stable).unwrap_err();
        assert_eq!(refused.field, "canary.backend");
    }
}
