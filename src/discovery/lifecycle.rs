//! Source lifecycle (DESIGN §4): how refresh outcomes, the passing of time and the operator's
//! `enabled` switch move a source between pending, healthy, failing, stale and disabled. Pure:
//! each function edits a [`SourceProgress`] and the clock is an argument.
//!
//! `failing_since` is the one record of when a run of failures began. Success and `enable` clear
//! it and the first failure sets it, so a failing source keeps its place on the way to stale
//! across restarts (the progress is persisted) instead of starting the clock again.

use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::discovery::DiscoveryError;
use crate::model::{SourceProgress, SourceState};

/// What a call did to the source's state, so the caller knows what follows (`BecameStale`: mark
/// the source's targets stale). `Unchanged` when the state is the same as before.
///
/// There is no variant for entering `Disabled` or `Pending`: those happen only through
/// [`disable`] and [`enable`], which the caller itself decided on, and they return `Unchanged`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Unchanged,
    BecameHealthy,
    BecameFailing,
    BecameStale,
}

/// A successful refresh. Ignored while disabled: a result that lands after the operator disabled
/// the source must not revive it.
pub fn record_success(
    progress: &mut SourceProgress,
    now: DateTime<Utc>,
    revision: String,
    next_refresh_at: impl Into<Option<DateTime<Utc>>>,
) -> Transition {
    if progress.state == SourceState::Disabled {
        return Transition::Unchanged;
    }
    let before = progress.state;
    progress.state = SourceState::Healthy;
    progress.last_error = None;
    progress.last_refresh_at = Some(now);
    progress.last_success_at = Some(now);
    progress.next_refresh_at = next_refresh_at.into();
    progress.revision = Some(revision);
    progress.failing_since = None;
    transition(before, progress.state)
}

/// After a success whose provider left entries out of the set (e.g. a Consul service address
/// that is a host name): the source stays healthy and `last_error` says what was refused, so a
/// refusal is never silent. `None` leaves the cleared error as [`record_success`] set it.
pub fn record_refusals(progress: &mut SourceProgress, refused: Option<&str>) {
    if progress.state != SourceState::Disabled {
        if let Some(refused) = refused {
            progress.last_error = Some(refused.to_owned());
        }
    }
}

/// A failed refresh: failing, or stale once the run of failures has lasted `stale_after`.
/// Ignored while disabled, like [`record_success`].
pub fn record_failure(
    progress: &mut SourceProgress,
    now: DateTime<Utc>,
    error: &DiscoveryError,
    stale_after: Duration,
    next_refresh_at: impl Into<Option<DateTime<Utc>>>,
) -> Transition {
    if progress.state == SourceState::Disabled {
        return Transition::Unchanged;
    }
    let before = progress.state;
    let failing_since = *progress.failing_since.get_or_insert(now);
    progress.last_error = Some(error.to_string());
    progress.last_refresh_at = Some(now);
    progress.next_refresh_at = next_refresh_at.into();
    // Only a success brings a stale source back; another failure cannot make it less stale.
    let stale = before == SourceState::Stale || now >= stale_at(failing_since, stale_after);
    progress.state = if stale {
        SourceState::Stale
    } else {
        SourceState::Failing
    };
    transition(before, progress.state)
}

/// Between refreshes (a timer at [`stale_deadline`]): a failing source whose run of failures has
/// lasted `stale_after` turns stale, even if its next refresh is still far away.
pub fn check_stale(
    progress: &mut SourceProgress,
    now: DateTime<Utc>,
    stale_after: Duration,
) -> Transition {
    match stale_deadline(progress, stale_after) {
        Some(deadline) if now >= deadline => {
            progress.state = SourceState::Stale;
            Transition::BecameStale
        }
        _ => Transition::Unchanged,
    }
}

/// When a failing source turns stale if nothing succeeds before; `None` unless failing.
pub fn stale_deadline(progress: &SourceProgress, stale_after: Duration) -> Option<DateTime<Utc>> {
    match progress.state {
        SourceState::Failing => progress
            .failing_since
            .map(|since| stale_at(since, stale_after)),
        SourceState::Pending
        | SourceState::Healthy
        | SourceState::Stale
        | SourceState::Disabled => None,
    }
}

/// `enabled=false`: no more refreshes. The rest of the progress stays, as the last thing known.
pub fn disable(progress: &mut SourceProgress) -> Transition {
    progress.state = SourceState::Disabled;
    progress.next_refresh_at = None;
    Transition::Unchanged
}

/// `enabled=true` again: pending until its first refresh finishes, with no run of failures
/// carried over from before it was disabled. An enabled source is left as it is.
pub fn enable(progress: &mut SourceProgress, next_refresh_at: DateTime<Utc>) -> Transition {
    if progress.state == SourceState::Disabled {
        progress.state = SourceState::Pending;
        progress.failing_since = None;
        progress.next_refresh_at = Some(next_refresh_at);
    }
    Transition::Unchanged
}

/// The runner that watched the source is gone (the source was disabled, or a new runner starts
/// after a restart or a takeover): a watch shown as connected is down from `now` until the new
/// runner's first answer. The last index is kept.
pub fn watch_gone(progress: &mut SourceProgress, now: DateTime<Utc>) {
    if let Some(watch) = progress.watch.as_mut().filter(|watch| watch.connected) {
        watch.connected = false;
        watch.since = now;
    }
}

fn transition(before: SourceState, after: SourceState) -> Transition {
    if before == after {
        return Transition::Unchanged;
    }
    match after {
        SourceState::Healthy => Transition::BecameHealthy,
        SourceState::Failing => Transition::BecameFailing,
        SourceState::Stale => Transition::BecameStale,
        SourceState::Pending | SourceState::Disabled => Transition::Unchanged,
    }
}

/// `since + stale_after`, saturating: an absurd `stale_after` means "never stale", not a panic.
fn stale_at(since: DateTime<Utc>, stale_after: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(stale_after)
        .ok()
        .and_then(|span| since.checked_add_signed(span))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE_AFTER: Duration = Duration::from_millis(300_000);

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(ms).unwrap()
    }

    const T0: i64 = 1_700_000_000_000;

    fn timeout() -> DiscoveryError {
        DiscoveryError::Timeout { timeout_ms: 5_000 }
    }

    fn servfail() -> DiscoveryError {
        DiscoveryError::DnsResponse {
            name: "api.svc.test".to_owned(),
            record_type: "A".to_owned(),
            code: "SERVFAIL".to_owned(),
        }
    }

    fn in_state(state: SourceState) -> SourceProgress {
        SourceProgress {
            state,
            ..SourceProgress::default()
        }
    }

    fn healthy() -> SourceProgress {
        let mut progress = SourceProgress::default();
        record_success(&mut progress, at(T0), "r1".to_owned(), at(T0 + 30_000));
        progress
    }

    /// Failing since `T0`, as a first failure at `T0` leaves it.
    fn failing() -> SourceProgress {
        let mut progress = healthy();
        record_failure(
            &mut progress,
            at(T0),
            &timeout(),
            STALE_AFTER,
            at(T0 + 30_000),
        );
        progress
    }

    fn stale() -> SourceProgress {
        let mut progress = failing();
        check_stale(&mut progress, at(T0 + 300_000), STALE_AFTER);
        assert_eq!(progress.state, SourceState::Stale);
        progress
    }

    // --- record_success ----------------------------------------------------------------------

    #[test]
    fn a_gone_watch_is_down_from_then_with_its_index_kept() {
        let mut progress = healthy();
        watch_gone(&mut progress, at(T0 + 5));
        assert_eq!(progress.watch, None, "a poll source has no watch");
        let connected = crate::model::WatchProgress {
            connected: true,
            since: at(T0),
            index: Some("7".to_owned()),
        };
        progress.watch = Some(connected.clone());
        watch_gone(&mut progress, at(T0 + 5));
        let down = progress.watch.clone().unwrap();
        assert!(!down.connected);
        assert_eq!(down.since, at(T0 + 5));
        assert_eq!(down.index, connected.index);
        watch_gone(&mut progress, at(T0 + 9));
        assert_eq!(
            progress.watch.unwrap().since,
            at(T0 + 5),
            "down since the first time"
        );
    }

    #[test]
    fn refusals_show_in_last_error_of_a_healthy_source() {
        let mut progress = healthy();
        record_refusals(&mut progress, Some("1 of 3 entries refused"));
        assert_eq!(progress.state, SourceState::Healthy);
        assert_eq!(
            progress.last_error.as_deref(),
            Some("1 of 3 entries refused")
        );
        record_success(&mut progress, at(T0 + 1), "r2".to_owned(), None);
        record_refusals(&mut progress, None);
        assert_eq!(progress.last_error, None, "a clean set clears it");
        assert_eq!(progress.next_refresh_at, None, "a connected watch has none");
        disable(&mut progress);
        record_refusals(&mut progress, Some("late"));
        assert_eq!(progress.last_error, None);
    }

    #[test]
    fn pending_success_becomes_healthy_with_every_field_set() {
        let mut progress = SourceProgress::default();
        let t = record_success(&mut progress, at(T0), "rev-1".to_owned(), at(T0 + 30_000));
        assert_eq!(t, Transition::BecameHealthy);
        assert_eq!(
            progress,
            SourceProgress {
                state: SourceState::Healthy,
                last_error: None,
                last_refresh_at: Some(at(T0)),
                last_success_at: Some(at(T0)),
                next_refresh_at: Some(at(T0 + 30_000)),
                revision: Some("rev-1".to_owned()),
                failing_since: None,
                watch: None,
                guard: None,
            }
        );
    }

    #[test]
    fn healthy_success_is_unchanged_but_updates_progress() {
        let mut progress = healthy();
        let t = record_success(
            &mut progress,
            at(T0 + 30_000),
            "r2".to_owned(),
            at(T0 + 60_000),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress.last_success_at, Some(at(T0 + 30_000)));
        assert_eq!(progress.last_refresh_at, Some(at(T0 + 30_000)));
        assert_eq!(progress.next_refresh_at, Some(at(T0 + 60_000)));
        assert_eq!(progress.revision.as_deref(), Some("r2"));
    }

    #[test]
    fn failing_success_recovers_and_clears_the_failure() {
        let mut progress = failing();
        let t = record_success(&mut progress, at(T0 + 10), "r2".to_owned(), at(T0 + 30_010));
        assert_eq!(t, Transition::BecameHealthy);
        assert_eq!(progress.state, SourceState::Healthy);
        assert_eq!(progress.last_error, None);
        assert_eq!(progress.failing_since, None);
        assert_eq!(progress.last_success_at, Some(at(T0 + 10)));
    }

    #[test]
    fn stale_success_recovers() {
        let mut progress = stale();
        let t = record_success(
            &mut progress,
            at(T0 + 400_000),
            "r3".to_owned(),
            at(T0 + 430_000),
        );
        assert_eq!(t, Transition::BecameHealthy);
        assert_eq!(progress.state, SourceState::Healthy);
        assert_eq!(progress.failing_since, None);
        assert_eq!(progress.last_error, None);
        // A new run of failures starts its own clock.
        let t = record_failure(
            &mut progress,
            at(T0 + 500_000),
            &timeout(),
            STALE_AFTER,
            at(T0 + 530_000),
        );
        assert_eq!(t, Transition::BecameFailing);
        assert_eq!(progress.failing_since, Some(at(T0 + 500_000)));
    }

    // --- record_failure ----------------------------------------------------------------------

    #[test]
    fn pending_failure_becomes_failing() {
        let mut progress = SourceProgress::default();
        let t = record_failure(
            &mut progress,
            at(T0),
            &servfail(),
            STALE_AFTER,
            at(T0 + 30_000),
        );
        assert_eq!(t, Transition::BecameFailing);
        assert_eq!(
            progress,
            SourceProgress {
                state: SourceState::Failing,
                last_error: Some("DNS server answered SERVFAIL for api.svc.test A".to_owned()),
                last_refresh_at: Some(at(T0)),
                last_success_at: None,
                next_refresh_at: Some(at(T0 + 30_000)),
                revision: None,
                failing_since: Some(at(T0)),
                watch: None,
                guard: None,
            }
        );
    }

    #[test]
    fn healthy_failure_becomes_failing_keeping_last_success() {
        let mut progress = healthy();
        let t = record_failure(
            &mut progress,
            at(T0 + 30_000),
            &timeout(),
            STALE_AFTER,
            at(T0 + 60_000),
        );
        assert_eq!(t, Transition::BecameFailing);
        assert_eq!(progress.state, SourceState::Failing);
        assert_eq!(progress.failing_since, Some(at(T0 + 30_000)));
        assert_eq!(
            progress.last_error.as_deref(),
            Some("refresh timed out after 5000 ms")
        );
        assert_eq!(progress.last_success_at, Some(at(T0)));
        assert_eq!(progress.revision.as_deref(), Some("r1"));
    }

    #[test]
    fn later_failures_keep_failing_since_and_update_the_error() {
        let mut progress = failing();
        let t = record_failure(
            &mut progress,
            at(T0 + 30_000),
            &servfail(),
            STALE_AFTER,
            at(T0 + 60_000),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress.failing_since, Some(at(T0)));
        assert_eq!(progress.last_refresh_at, Some(at(T0 + 30_000)));
        assert_eq!(progress.next_refresh_at, Some(at(T0 + 60_000)));
        assert!(progress.last_error.as_deref().unwrap().contains("SERVFAIL"));
    }

    #[test]
    fn failure_at_exactly_stale_after_becomes_stale() {
        let mut progress = failing();
        let t = record_failure(
            &mut progress,
            at(T0 + 300_000),
            &timeout(),
            STALE_AFTER,
            at(T0 + 330_000),
        );
        assert_eq!(t, Transition::BecameStale);
        assert_eq!(progress.state, SourceState::Stale);
        assert_eq!(progress.failing_since, Some(at(T0)));
    }

    #[test]
    fn failure_one_ms_before_stale_after_stays_failing() {
        let mut progress = failing();
        let t = record_failure(
            &mut progress,
            at(T0 + 299_999),
            &timeout(),
            STALE_AFTER,
            at(T0 + 330_000),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress.state, SourceState::Failing);
    }

    #[test]
    fn stale_failure_stays_stale() {
        let mut progress = stale();
        let t = record_failure(
            &mut progress,
            at(T0 + 400_000),
            &servfail(),
            STALE_AFTER,
            at(T0 + 430_000),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress.state, SourceState::Stale);
        assert_eq!(progress.failing_since, Some(at(T0)));
        assert!(progress.last_error.as_deref().unwrap().contains("SERVFAIL"));
    }

    #[test]
    fn stale_failure_stays_stale_even_if_stale_after_grew() {
        // The operator raised stale_after; only a success un-stales a source.
        let mut progress = stale();
        let t = record_failure(
            &mut progress,
            at(T0 + 400_000),
            &timeout(),
            Duration::from_secs(3_600),
            at(T0 + 430_000),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress.state, SourceState::Stale);
    }

    #[test]
    fn zero_stale_after_goes_straight_to_stale() {
        let mut progress = healthy();
        let t = record_failure(
            &mut progress,
            at(T0 + 1),
            &timeout(),
            Duration::ZERO,
            at(T0 + 2),
        );
        assert_eq!(t, Transition::BecameStale);
    }

    #[test]
    fn failing_since_survives_a_restart_into_pending() {
        // A restart that reloads a failing source as pending keeps the run's start.
        let mut progress = SourceProgress {
            state: SourceState::Pending,
            ..failing()
        };
        let t = record_failure(
            &mut progress,
            at(T0 + 300_000),
            &timeout(),
            STALE_AFTER,
            at(T0 + 330_000),
        );
        assert_eq!(t, Transition::BecameStale);
    }

    // --- check_stale / stale_deadline --------------------------------------------------------

    #[test]
    fn check_stale_at_the_exact_boundary() {
        let mut progress = failing();
        assert_eq!(
            check_stale(&mut progress, at(T0 + 299_999), STALE_AFTER),
            Transition::Unchanged
        );
        assert_eq!(progress.state, SourceState::Failing);
        assert_eq!(
            check_stale(&mut progress, at(T0 + 300_000), STALE_AFTER),
            Transition::BecameStale
        );
        assert_eq!(progress.state, SourceState::Stale);
        // Already stale: nothing more to report.
        assert_eq!(
            check_stale(&mut progress, at(T0 + 900_000), STALE_AFTER),
            Transition::Unchanged
        );
        assert_eq!(progress.state, SourceState::Stale);
    }

    #[test]
    fn check_stale_ignores_sources_that_are_not_failing() {
        let late = at(T0 + 10_000_000);
        for state in [
            SourceState::Pending,
            SourceState::Healthy,
            SourceState::Disabled,
        ] {
            let mut progress = SourceProgress {
                failing_since: Some(at(T0)),
                ..in_state(state)
            };
            let before = progress.clone();
            assert_eq!(
                check_stale(&mut progress, late, STALE_AFTER),
                Transition::Unchanged,
                "{state:?}"
            );
            assert_eq!(progress, before, "{state:?}");
        }
        // Failing without a start (a damaged row) cannot be judged: left alone.
        let mut progress = in_state(SourceState::Failing);
        assert_eq!(
            check_stale(&mut progress, late, STALE_AFTER),
            Transition::Unchanged
        );
    }

    #[test]
    fn check_stale_with_a_clock_behind_failing_since_stays_failing() {
        let mut progress = failing();
        assert_eq!(
            check_stale(&mut progress, at(T0 - 1_000_000), STALE_AFTER),
            Transition::Unchanged
        );
        assert_eq!(progress.state, SourceState::Failing);
    }

    #[test]
    fn stale_deadline_only_while_failing() {
        assert_eq!(
            stale_deadline(&failing(), STALE_AFTER),
            Some(at(T0 + 300_000))
        );
        assert_eq!(stale_deadline(&healthy(), STALE_AFTER), None);
        assert_eq!(stale_deadline(&stale(), STALE_AFTER), None);
        assert_eq!(
            stale_deadline(&SourceProgress::default(), STALE_AFTER),
            None
        );
        assert_eq!(
            stale_deadline(&in_state(SourceState::Failing), STALE_AFTER),
            None
        );
        let mut disabled = failing();
        disable(&mut disabled);
        assert_eq!(stale_deadline(&disabled, STALE_AFTER), None);
    }

    #[test]
    fn huge_stale_after_never_goes_stale() {
        let mut progress = failing();
        assert_eq!(
            stale_deadline(&progress, Duration::MAX),
            Some(DateTime::<Utc>::MAX_UTC)
        );
        let t = record_failure(
            &mut progress,
            at(T0 + 1_000_000_000),
            &timeout(),
            Duration::MAX,
            at(T0),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(
            check_stale(&mut progress, at(T0 + 1_000_000_000), Duration::MAX),
            Transition::Unchanged
        );
        assert_eq!(progress.state, SourceState::Failing);
    }

    // --- disable / enable --------------------------------------------------------------------

    #[test]
    fn disable_from_every_state_stops_refreshes_and_keeps_history() {
        for mut progress in [SourceProgress::default(), healthy(), failing(), stale()] {
            let before = progress.clone();
            assert_eq!(disable(&mut progress), Transition::Unchanged);
            assert_eq!(
                progress,
                SourceProgress {
                    state: SourceState::Disabled,
                    next_refresh_at: None,
                    ..before
                }
            );
            // Disabling twice changes nothing more.
            let once = progress.clone();
            disable(&mut progress);
            assert_eq!(progress, once);
        }
    }

    #[test]
    fn disabled_source_ignores_late_success_and_failure() {
        let mut progress = failing();
        disable(&mut progress);
        let before = progress.clone();
        let t = record_success(&mut progress, at(T0 + 1), "late".to_owned(), at(T0 + 2));
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress, before);
        let t = record_failure(
            &mut progress,
            at(T0 + 400_000),
            &timeout(),
            STALE_AFTER,
            at(T0 + 2),
        );
        assert_eq!(t, Transition::Unchanged);
        assert_eq!(progress, before);
        assert_eq!(
            check_stale(&mut progress, at(T0 + 400_000), STALE_AFTER),
            Transition::Unchanged
        );
        assert_eq!(progress, before);
    }

    #[test]
    fn enable_makes_a_disabled_source_pending_without_its_old_failures() {
        let mut progress = failing();
        disable(&mut progress);
        let disabled = progress.clone();
        assert_eq!(enable(&mut progress, at(T0 + 5)), Transition::Unchanged);
        assert_eq!(
            progress,
            SourceProgress {
                state: SourceState::Pending,
                failing_since: None,
                next_refresh_at: Some(at(T0 + 5)),
                ..disabled
            }
        );
        // Its first failure after enabling starts a fresh run.
        let t = record_failure(
            &mut progress,
            at(T0 + 400_000),
            &timeout(),
            STALE_AFTER,
            at(T0 + 430_000),
        );
        assert_eq!(t, Transition::BecameFailing);
        assert_eq!(progress.failing_since, Some(at(T0 + 400_000)));
    }

    #[test]
    fn enable_leaves_an_enabled_source_alone() {
        for mut progress in [SourceProgress::default(), healthy(), failing(), stale()] {
            let before = progress.clone();
            assert_eq!(enable(&mut progress, at(T0 + 999)), Transition::Unchanged);
            assert_eq!(progress, before);
        }
    }

    #[test]
    fn enable_then_success_becomes_healthy() {
        let mut progress = healthy();
        disable(&mut progress);
        enable(&mut progress, at(T0 + 5));
        let t = record_success(&mut progress, at(T0 + 6), "r9".to_owned(), at(T0 + 30_006));
        assert_eq!(t, Transition::BecameHealthy);
    }
}
