//! The canary's state machine: every verdict of `judge` and every operator's action.

use super::*;
use crate::model::{latency_bucket, CanaryAction, LATENCY_BUCKETS};

fn canary() -> Canary {
    serde_json::from_value(serde_json::json!({
        "backend": 1,
        "steps": [5, 25, 50, 100],
        "step_interval_ms": 10_000,
        "min_requests": 100,
        "max_error_percent": 1.0,
        "max_p99_ms": 200
    }))
    .unwrap()
}

fn status(state: CanaryState, step: u32, weight: u8) -> CanaryStatus {
    CanaryStatus {
        state,
        step,
        weight,
        round: 7,
        interval_started_ms: 1_000_000,
        reason: String::new(),
    }
}

/// `requests` answered in `millis` each, `errors` of them failed.
fn counts(requests: u64, errors: u64, millis: u64) -> CanaryCounts {
    let mut latency = vec![0; LATENCY_BUCKETS];
    latency[latency_bucket(millis * 1000)] = requests;
    CanaryCounts {
        requests,
        errors,
        latency,
    }
}

#[test]
fn an_interval_in_bounds_takes_the_next_step() {
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 0, 5),
        &counts(200, 1, 20),
    );
    assert_eq!(
        (moved.state, moved.step, moved.weight),
        (CanaryState::Progressing, 1, 25)
    );
    assert!(moved.reason.contains("step 2 (25 %)"), "{}", moved.reason);
}

#[test]
fn the_last_step_in_bounds_promotes() {
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 3, 100),
        &counts(500, 0, 5),
    );
    assert_eq!((moved.state, moved.weight), (CanaryState::Promoted, 100));
}

#[test]
fn too_many_errors_roll_back_to_zero() {
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 1, 25),
        &counts(1000, 100, 5),
    );
    assert_eq!((moved.state, moved.weight), (CanaryState::RolledBack, 0));
    assert!(moved.reason.contains("10.00 % errors"), "{}", moved.reason);
}

#[test]
fn a_slow_p99_rolls_back() {
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 1, 25),
        &counts(1000, 0, 400),
    );
    assert_eq!((moved.state, moved.weight), (CanaryState::RolledBack, 0));
    assert!(moved.reason.contains("max_p99_ms 200"), "{}", moved.reason);
}

#[test]
fn too_few_requests_hold_the_step() {
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 1, 25),
        &counts(99, 0, 5),
    );
    assert_eq!(
        (moved.state, moved.step, moved.weight),
        (CanaryState::Progressing, 1, 25)
    );
    assert!(
        moved.reason.contains("99 requests < min_requests 100"),
        "{}",
        moved.reason
    );
}

#[test]
fn errors_already_beyond_bounds_roll_back_before_min_requests() {
    // 2 errors: more than 1 % of 100 whatever the 50 missing requests would have been.
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 0, 5),
        &counts(50, 2, 5),
    );
    assert_eq!(moved.state, CanaryState::RolledBack);
    // 1 error in 50: still in bounds if the rest succeed.
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 0, 5),
        &counts(50, 1, 5),
    );
    assert_eq!(moved.state, CanaryState::Progressing);
}

#[test]
fn an_interval_is_over_by_the_stores_clock_only_while_progressing() {
    let progressing = status(CanaryState::Progressing, 0, 5);
    assert!(!interval_over(&canary(), &progressing, 1_009_999));
    assert!(interval_over(&canary(), &progressing, 1_010_000));
    let paused = status(CanaryState::Paused, 0, 5);
    assert!(!interval_over(&canary(), &paused, 2_000_000));
}

#[test]
fn operators_pause_resume_promote_and_roll_back() {
    let canary = canary();
    let at = |state, weight| status(state, 1, weight);
    let moved = CanaryMove::after_action(
        &canary,
        &at(CanaryState::Progressing, 25),
        CanaryAction::Pause,
    )
    .unwrap();
    assert_eq!((moved.state, moved.weight), (CanaryState::Paused, 25));
    let moved =
        CanaryMove::after_action(&canary, &at(CanaryState::Paused, 25), CanaryAction::Resume)
            .unwrap();
    assert_eq!((moved.state, moved.weight), (CanaryState::Progressing, 25));
    let moved = CanaryMove::after_action(
        &canary,
        &at(CanaryState::RolledBack, 0),
        CanaryAction::Resume,
    )
    .unwrap();
    assert_eq!(
        (moved.state, moved.step, moved.weight),
        (CanaryState::Progressing, 0, 5)
    );
    let moved =
        CanaryMove::after_action(&canary, &at(CanaryState::Paused, 25), CanaryAction::Promote)
            .unwrap();
    assert_eq!(
        (moved.state, moved.step, moved.weight),
        (CanaryState::Promoted, 3, 100)
    );
    let moved = CanaryMove::after_action(
        &canary,
        &at(CanaryState::Promoted, 100),
        CanaryAction::Rollback,
    )
    .unwrap();
    assert_eq!((moved.state, moved.weight), (CanaryState::RolledBack, 0));
    assert!(CanaryMove::after_action(
        &canary,
        &at(CanaryState::Promoted, 100),
        CanaryAction::Resume
    )
    .is_err());
    assert!(CanaryMove::after_action(
        &canary,
        &at(CanaryState::RolledBack, 0),
        CanaryAction::Pause
    )
    .is_err());
}
