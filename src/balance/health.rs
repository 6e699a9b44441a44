//! Per-target availability: active health-check verdicts and passive outlier ejection, as
//! atomics shared by every snapshot (carried by target id) and read on each pick.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use crate::model::{Ejection, Health};

#[derive(Debug)]
pub struct TargetHealth {
    /// The health-check verdict and the ejection deadline in one word ([`State`]), so that a
    /// pick tells an available target without an ejection from one load and one comparison.
    state: AtomicU64,
    /// Ejections since the last success: the next one lasts this many times the base.
    ejections: AtomicU32,
    /// Ejected before and not yet proven by a success: one failure ejects it again.
    probation: AtomicBool,
    /// Half-open: a request holds the one trial (its [`Trial`] guard) after the ejection ended.
    trial: AtomicBool,
    window_start_ms: AtomicU64,
    window_failures: AtomicU32,
    /// The last ejection: its failure, whether a trial failed, and a sequence number that
    /// never resets ([`EjectionCause`] packed), so the control task, looking now and then, tells
    /// every ejection and why; written only when ejecting.
    last_ejection: AtomicU32,
    /// Where a move of its health or ejection is marked for the control task (None: nobody
    /// watches, as in tests).
    mark: Option<super::Mark>,
}

/// The failure of one request or connection that feeds passive ejection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// The target answered a status the service counts as a failure.
    Status(u16),
    /// No connection could be made.
    ConnectFailed,
    /// No response (or no progress sending the body) in time.
    Timeout,
    /// The connection broke during the exchange.
    ConnectionError,
    /// A gRPC answer ended with `grpc-status` 14 (UNAVAILABLE): gRPC's 503.
    GrpcUnavailable,
}

impl std::fmt::Display for FailureCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailureCause::Status(status) => write!(f, "HTTP {status}"),
            FailureCause::ConnectFailed => f.write_str("connect failed"),
            FailureCause::Timeout => f.write_str("timed out"),
            FailureCause::ConnectionError => f.write_str("connection error"),
            FailureCause::GrpcUnavailable => f.write_str("grpc-status 14 (UNAVAILABLE)"),
        }
    }
}

impl FailureCause {
    fn code(self) -> u32 {
        match self {
            FailureCause::Status(status) => u32::from(status),
            FailureCause::ConnectFailed => 1,
            FailureCause::Timeout => 2,
            FailureCause::ConnectionError => 3,
            FailureCause::GrpcUnavailable => 4,
        }
    }

    fn from_code(code: u32) -> Option<FailureCause> {
        match code {
            0 => None,
            1 => Some(FailureCause::ConnectFailed),
            2 => Some(FailureCause::Timeout),
            3 => Some(FailureCause::ConnectionError),
            4 => Some(FailureCause::GrpcUnavailable),
            status => u16::try_from(status).ok().map(FailureCause::Status),
        }
    }
}

/// Why a target was last ejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EjectionCause {
    pub failure: FailureCause,
    /// The failure was of a half-open trial (or the first request after a restore), which
    /// ejects at once; otherwise the ejection policy's failure count was reached.
    pub trial: bool,
    /// Counts ejections since the target entered rotation (wrapping), so two looks tell
    /// whether it was ejected in between, even if it has been restored since.
    pub sequence: u32,
}

/// `last_ejection` packs the failure code (statuses are below 1024), the trial bit, then the
/// sequence in the remaining 21 bits.
const CODE_MASK: u32 = (1 << 10) - 1;
const TRIAL_BIT: u32 = 1 << 10;
const SEQUENCE_SHIFT: u32 = 11;

impl Default for TargetHealth {
    fn default() -> Self {
        TargetHealth::new(Health::Unknown)
    }
}

/// `TargetHealth::state`: the health code in the low [`HEALTH_BITS`] bits, the ejection deadline
/// (Unix ms; 0 when never ejected or cleared by a success) above them. Unknown and Healthy are
/// the codes below [`UNHEALTHY`], so every state below it is "not unhealthy, no ejection
/// recorded": the one comparison of a pick's common case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct State(u64);

const HEALTH_BITS: u32 = 2;
const HEALTH_MASK: u64 = (1 << HEALTH_BITS) - 1;
const UNHEALTHY: u64 = 2;
/// The latest deadline the state holds: 2^62 ms, millions of years away.
const MAX_UNTIL_MS: u64 = u64::MAX >> HEALTH_BITS;

impl State {
    fn new(health: Health, until_ms: u64) -> State {
        State((until_ms.min(MAX_UNTIL_MS) << HEALTH_BITS) | health_code(health))
    }

    fn health(self) -> Health {
        match self.0 & HEALTH_MASK {
            1 => Health::Healthy,
            UNHEALTHY => Health::Unhealthy,
            _ => Health::Unknown,
        }
    }

    fn until_ms(self) -> u64 {
        self.0 >> HEALTH_BITS
    }

    /// Not unhealthy and no ejection recorded.
    fn is_plain(self) -> bool {
        self.0 < UNHEALTHY
    }

    fn with_health(self, health: Health) -> State {
        State((self.0 & !HEALTH_MASK) | health_code(health))
    }

    fn with_until(self, until_ms: u64) -> State {
        State((until_ms.min(MAX_UNTIL_MS) << HEALTH_BITS) | (self.0 & HEALTH_MASK))
    }
}

fn health_code(health: Health) -> u64 {
    match health {
        Health::Unknown => 0,
        Health::Healthy => 1,
        Health::Unhealthy => UNHEALTHY,
    }
}

impl TargetHealth {
    pub fn new(health: Health) -> TargetHealth {
        TargetHealth {
            state: AtomicU64::new(State::new(health, 0).0),
            ejections: AtomicU32::new(0),
            probation: AtomicBool::new(false),
            trial: AtomicBool::new(false),
            window_start_ms: AtomicU64::new(0),
            window_failures: AtomicU32::new(0),
            last_ejection: AtomicU32::new(0),
            mark: None,
        }
    }

    /// A target whose moves are marked at `mark`.
    pub fn marked(health: Health, mark: super::Mark) -> TargetHealth {
        TargetHealth {
            mark: Some(mark),
            ..TargetHealth::new(health)
        }
    }

    /// Its slot in the change marks, if marked.
    pub fn slot(&self) -> Option<u32> {
        self.mark.as_ref().and_then(super::Mark::slot)
    }

    /// After its health or ejection moved: the control task looks at it at its next turn.
    fn moved(&self) {
        if let Some(mark) = &self.mark {
            mark.set();
        }
    }

    fn state(&self) -> State {
        State(self.state.load(Ordering::Relaxed))
    }

    /// The ejection deadline (Unix ms; 0 when not ejected or half-open), read once.
    fn until_ms(&self) -> u64 {
        self.state().until_ms()
    }

    pub fn health(&self) -> Health {
        self.state().health()
    }

    pub fn set_health(&self, health: Health) {
        if self.state().health() == health {
            return;
        }
        // The deadline shares the word: a concurrent ejection or restore must survive.
        let changed = self
            .state
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |state| {
                let state = State(state);
                (state.health() != health).then_some(state.with_health(health).0)
            });
        if changed.is_ok() {
            self.moved();
        }
    }

    /// When the current ejection ends, if the target is ejected at `now_ms`.
    pub fn ejected_until(&self, now_ms: u64) -> Option<u64> {
        let until = self.until_ms();
        (until > now_ms).then_some(until)
    }

    /// Its ejection has ended but no success has proven it yet: it takes one request at a time.
    pub fn half_open(&self, now_ms: u64) -> bool {
        let until = self.until_ms();
        until != 0 && until <= now_ms
    }

    /// Ejections since its last success: the next one lasts one more times the base.
    pub fn ejections(&self) -> u32 {
        self.ejections.load(Ordering::Relaxed)
    }

    /// Not unhealthy, not ejected, and not half-open with its one trial already in flight. The
    /// clock is read only while an ejection is recorded.
    #[inline]
    pub fn is_available(&self, now_ms: impl FnOnce() -> u64) -> bool {
        let state = self.state();
        if state.is_plain() {
            return true;
        }
        if state.health() == Health::Unhealthy {
            return false;
        }
        // Not plain and not unhealthy: an ejection is recorded.
        state.until_ms() <= now_ms() && !self.trial.load(Ordering::Relaxed)
    }

    /// For a target a pick chose as available: lets the request through, as the one trial when
    /// the target is half-open. Claimed here and not while the pick looks at candidates, since
    /// a pick looks at some it does not choose. Refused when the trial went to another request,
    /// or a failure ejected the target again, since the pick looked.
    pub fn admit(&self, now_ms: impl FnOnce() -> u64) -> Admission<'_> {
        let until = self.until_ms();
        if until == 0 {
            return Admission::Open;
        }
        let now = now_ms();
        if until > now {
            return Admission::Refused;
        }
        // Acquire pairs with the release in `Trial::drop`: the last trial's verdict (a new
        // ejection, or a restore) is visible to the re-check below.
        if self
            .trial
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return Admission::Refused;
        }
        let trial = Trial { health: self };
        match self.until_ms() {
            // A success restored it in the meantime: no trial needed (dropping it releases it).
            0 => Admission::Open,
            until if until > now => Admission::Refused,
            _ => Admission::Trial(trial),
        }
    }

    /// Lets the next request try. Only for the holder of a trial handed over by
    /// [`Trial::hand_over`]; a [`Trial`] guard ends its own.
    pub fn end_trial(&self) {
        // Release pairs with the acquire in `admit`: this trial's verdict is visible to the next.
        self.trial.store(false, Ordering::Release);
    }

    /// A request it served succeeded: its failure window starts over, and a trial after an
    /// ejection restores it. A success that arrives while the ejection still runs (a request
    /// started before it) does not cut the ejection short.
    pub fn record_success(&self, now_ms: impl FnOnce() -> u64) {
        if self.window_failures.load(Ordering::Relaxed) != 0 {
            self.window_failures.store(0, Ordering::Relaxed);
        }
        let until = self.until_ms();
        if until == 0 && !self.probation.load(Ordering::Relaxed) {
            return;
        }
        if until > now_ms() {
            return;
        }
        // Clears the deadline only: the health verdict shares the word.
        self.state.fetch_and(HEALTH_MASK, Ordering::Relaxed);
        self.probation.store(false, Ordering::Relaxed);
        self.ejections.store(0, Ordering::Relaxed);
        self.moved();
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

    /// Why it was last ejected (None before its first ejection).
    pub fn last_ejection(&self) -> Option<EjectionCause> {
        // Acquire pairs with the release in `eject`: read first, the ejection it describes is
        // visible in the fields read after it.
        let packed = self.last_ejection.load(Ordering::Acquire);
        Some(EjectionCause {
            failure: FailureCause::from_code(packed & CODE_MASK)?,
            trial: packed & TRIAL_BIT != 0,
            sequence: packed >> SEQUENCE_SHIFT,
        })
    }

    /// The raw ejection deadline (Unix ms; 0 when not ejected or half-open), read once.
    pub fn ejected_until_ms(&self) -> u64 {
        self.until_ms()
    }

    /// Takes the target out until `now + base × ejections` (capped) because of `cause`. None
    /// when another request ejected it first.
    pub fn eject(&self, now_ms: u64, policy: &Ejection, cause: FailureCause) -> Option<u64> {
        let mut state = self.state();
        let previous = state.until_ms();
        if previous > now_ms {
            return None;
        }
        let times = u64::from(self.ejections.load(Ordering::Relaxed)) + 1;
        let duration = policy
            .base_ejection_ms
            .saturating_mul(times)
            .min(policy.max_ejection_ms);
        let until = now_ms.saturating_add(duration).clamp(1, MAX_UNTIL_MS);
        // Lost when another request moved the deadline first; a health verdict landing in the
        // meantime only changes the other bits, and is kept.
        while let Err(actual) = self.state.compare_exchange(
            state.0,
            state.with_until(until).0,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            state = State(actual);
            if state.until_ms() != previous {
                return None;
            }
        }
        self.ejections.fetch_add(1, Ordering::Relaxed);
        let trial = if self.probation.swap(true, Ordering::Relaxed) {
            TRIAL_BIT
        } else {
            0
        };
        // Only the request that won the swap above writes, so load-then-store cannot race.
        let sequence =
            (self.last_ejection.load(Ordering::Relaxed) >> SEQUENCE_SHIFT).wrapping_add(1);
        self.last_ejection.store(
            (cause.code() & CODE_MASK) | trial | (sequence << SEQUENCE_SHIFT),
            Ordering::Release,
        );
        self.window_failures.store(0, Ordering::Relaxed);
        self.window_start_ms.store(now_ms, Ordering::Relaxed);
        self.moved();
        Some(until)
    }
}

/// What a request a pick gave to a target may do.
#[derive(Debug)]
pub enum Admission<'a> {
    /// The target is proven (or was never ejected): no trial needed.
    Open,
    /// The request is the target's one half-open trial; keep the guard until its outcome is
    /// recorded.
    Trial(Trial<'a>),
    /// Pick another target.
    Refused,
}

/// The half-open trial of a target, held by the request that carries it. Dropping it lets the
/// next request try: after the request's outcome is recorded (a success restored the target, a
/// failure ejected it again), or when the request ends without one (the client left, its
/// upload failed), so a target can never stay in a trial for good.
#[derive(Debug)]
#[must_use = "dropping the trial at once lets the next request try too"]
pub struct Trial<'a> {
    health: &'a TargetHealth,
}

impl Trial<'_> {
    /// Gives up the guard: the caller now ends the trial itself, with
    /// [`TargetHealth::end_trial`], exactly once. A pick keeps its trial as a flag beside the
    /// target, which holds its health, so that it stays two words and returns in registers.
    pub fn hand_over(self) {
        // Not a leak: the trial's end moves to the holder, which calls `end_trial` once.
        let _handed_over = std::mem::ManuallyDrop::new(self);
    }
}

impl Drop for Trial<'_> {
    fn drop(&mut self) {
        self.health.end_trial();
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

    /// The trial `admit` gives at `now`, failing the test if it gives anything else.
    fn trial(target: &TargetHealth, now: u64) -> Trial<'_> {
        match target.admit(|| now) {
            Admission::Trial(trial) => trial,
            other => panic!("expected a trial at {now}, got {other:?}"),
        }
    }

    fn refused(target: &TargetHealth, now: u64) -> bool {
        matches!(target.admit(|| now), Admission::Refused)
    }

    #[test]
    fn the_last_ejection_remembers_its_failure_and_whether_a_trial_failed() {
        let target = TargetHealth::default();
        assert_eq!(target.last_ejection(), None);
        target.eject(0, &policy(), FailureCause::Status(503));
        assert_eq!(
            target.last_ejection(),
            Some(EjectionCause {
                failure: FailureCause::Status(503),
                trial: false,
                sequence: 1
            })
        );
        // Once the ejection ran out, the failed trial ejects again, as a trial.
        assert!(target.record_failure(10_001, &policy()));
        target.eject(10_001, &policy(), FailureCause::ConnectFailed);
        assert_eq!(
            target.last_ejection(),
            Some(EjectionCause {
                failure: FailureCause::ConnectFailed,
                trial: true,
                sequence: 2
            })
        );
        assert_eq!(FailureCause::Status(503).to_string(), "HTTP 503");
    }

    #[test]
    fn ejection_lasts_longer_each_time_up_to_the_cap() {
        let target = TargetHealth::default();
        assert_eq!(
            target.eject(0, &policy(), FailureCause::Timeout),
            Some(10_000)
        );
        assert!(!target.is_available(|| 5_000));
        assert!(refused(&target, 5_000), "no trial while ejected");
        assert!(
            target.is_available(|| 10_000),
            "available again for a trial"
        );
        assert!(target.half_open(10_000));
        // The trial fails: out again at once, for twice as long.
        let first = trial(&target, 10_000);
        assert!(target.record_failure(10_001, &policy()));
        assert_eq!(
            target.eject(10_001, &policy(), FailureCause::Timeout),
            Some(30_001)
        );
        drop(first);
        assert!(!target.is_available(|| 10_002), "ejected again");
        assert!(!target.half_open(10_002));
        let second = trial(&target, 30_001);
        assert!(target.record_failure(30_002, &policy()));
        assert_eq!(
            target.eject(30_002, &policy(), FailureCause::Timeout),
            Some(55_002),
            "capped at 25 s"
        );
        drop(second);
        assert_eq!(target.ejections(), 3);
    }

    #[test]
    fn a_half_open_target_admits_one_trial_at_a_time() {
        let target = TargetHealth::default();
        target.eject(0, &policy(), FailureCause::Timeout);
        let first = trial(&target, 10_000);
        assert!(
            !target.is_available(|| 10_001),
            "not available while its trial is in flight"
        );
        assert!(refused(&target, 10_001), "a second trial is refused");
        assert!(target.half_open(10_001), "still half-open: no verdict yet");
        drop(first);
        assert!(
            target.is_available(|| 10_002),
            "a trial that ended without a verdict lets the next request try"
        );
        let _second = trial(&target, 10_002);
        assert!(refused(&target, 10_003));
    }

    #[test]
    fn a_failed_trial_ejects_again_and_blocks_trials_until_it_ends() {
        let target = TargetHealth::default();
        target.eject(0, &policy(), FailureCause::Timeout);
        let first = trial(&target, 10_000);
        assert!(target.record_failure(10_500, &policy()), "on probation");
        assert_eq!(
            target.eject(10_500, &policy(), FailureCause::Timeout),
            Some(30_500),
            "2 × base"
        );
        drop(first);
        assert!(!target.is_available(|| 10_501));
        assert!(
            refused(&target, 30_499),
            "no trial before the new ejection ends"
        );
        let _second = trial(&target, 30_500);
    }

    #[test]
    fn concurrent_admissions_give_out_one_trial() {
        let target = TargetHealth::default();
        target.eject(0, &policy(), FailureCause::Timeout);
        let threads = 8;
        let barrier = std::sync::Barrier::new(threads);
        let trials = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..threads {
                scope.spawn(|| {
                    barrier.wait();
                    let admission = target.admit(|| 10_000);
                    if matches!(admission, Admission::Trial(_)) {
                        trials.fetch_add(1, Ordering::SeqCst);
                    }
                    // Every thread still holds what it got while the others try.
                    barrier.wait();
                    drop(admission);
                });
            }
        });
        assert_eq!(trials.into_inner(), 1);
        let _after = trial(&target, 10_001);
    }

    #[test]
    fn without_an_ejection_admission_is_open_and_reads_no_clock() {
        let target = TargetHealth::default();
        assert!(matches!(
            target.admit(|| panic!("clock read without an ejection")),
            Admission::Open
        ));
        assert!(!target.half_open(0));
    }

    #[test]
    fn a_success_during_the_ejection_does_not_end_it() {
        let target = TargetHealth::default();
        target.eject(0, &policy(), FailureCause::Timeout);
        target.record_success(|| 5_000);
        assert!(!target.is_available(|| 5_001), "still ejected");
    }

    #[test]
    fn a_successful_trial_restores_the_target() {
        let target = TargetHealth::default();
        target.eject(0, &policy(), FailureCause::Timeout);
        let trial = trial(&target, 10_000);
        target.record_success(|| 10_000);
        assert!(
            target.is_available(|| panic!("clock read after the restore")),
            "restored: open to every request even before the trial is let go"
        );
        assert!(matches!(target.admit(|| 10_001), Admission::Open));
        drop(trial);
        assert!(!target.half_open(10_001));
        assert_eq!(target.ejections(), 0);
        assert!(
            !target.record_failure(20_000, &policy()),
            "no longer on probation"
        );
        assert_eq!(
            target.eject(20_000, &policy(), FailureCause::Timeout),
            Some(30_000),
            "back to the base time"
        );
    }

    #[test]
    fn only_one_concurrent_ejection_wins() {
        let target = TargetHealth::default();
        assert!(target.eject(0, &policy(), FailureCause::Timeout).is_some());
        assert!(target.eject(1, &policy(), FailureCause::Timeout).is_none());
        assert!(
            !target.record_failure(2, &policy()),
            "failures while ejected do not count"
        );
    }

    #[test]
    fn the_state_word_holds_health_and_deadline_apart() {
        let healths = [Health::Unknown, Health::Healthy, Health::Unhealthy];
        for health in healths {
            for until in [0, 1, 12_345, MAX_UNTIL_MS - 1, MAX_UNTIL_MS] {
                let state = State::new(health, until);
                assert_eq!((state.health(), state.until_ms()), (health, until));
                assert_eq!(
                    state.is_plain(),
                    until == 0 && health != Health::Unhealthy,
                    "{health:?} until {until}"
                );
                for other in healths {
                    assert_eq!(state.with_health(other), State::new(other, until));
                }
                assert_eq!(state.with_until(7), State::new(health, 7));
                assert_eq!(state.with_until(0), State::new(health, 0));
            }
            assert_eq!(State::new(health, u64::MAX).until_ms(), MAX_UNTIL_MS);
        }
    }

    #[test]
    fn verdicts_and_ejections_share_the_word_without_erasing_each_other() {
        let target = TargetHealth::new(Health::Healthy);
        target.eject(0, &policy(), FailureCause::Timeout);
        target.set_health(Health::Unhealthy);
        assert_eq!(
            target.ejected_until(5_000),
            Some(10_000),
            "the verdict kept it"
        );
        assert!(
            !target.is_available(|| 10_000),
            "unhealthy, though its ejection ended"
        );
        assert!(target.half_open(10_000));
        target.set_health(Health::Healthy);
        assert!(target.is_available(|| 10_000), "half-open again");
        let trial = trial(&target, 10_000);
        target.record_success(|| 10_000);
        drop(trial);
        assert_eq!(
            target.health(),
            Health::Healthy,
            "the restore kept the verdict"
        );
        assert_eq!(target.ejected_until_ms(), 0);
        target.set_health(Health::Unhealthy);
        assert!(!target.is_available(|| panic!("no ejection to compare")));
    }

    #[test]
    fn an_endless_ejection_is_capped_and_keeps_the_verdict() {
        let endless = Ejection {
            base_ejection_ms: u64::MAX,
            max_ejection_ms: u64::MAX,
            ..policy()
        };
        let target = TargetHealth::new(Health::Healthy);
        assert_eq!(
            target.eject(1, &endless, FailureCause::Timeout),
            Some(MAX_UNTIL_MS)
        );
        assert_eq!(target.health(), Health::Healthy);
        assert_eq!(target.ejected_until(u64::MAX - 1), None, "capped");
        assert_eq!(target.ejected_until(1), Some(MAX_UNTIL_MS));
    }

    #[test]
    fn concurrent_verdicts_and_ejections_lose_neither() {
        let target = TargetHealth::default();
        let rounds: u64 = 100_000;
        let ejecting = AtomicBool::new(true);
        std::thread::scope(|scope| {
            scope.spawn(|| {
                // Flips the verdict for as long as the other thread ejects, then leaves it healthy.
                let mut unhealthy = false;
                while ejecting.load(Ordering::Relaxed) {
                    unhealthy = !unhealthy;
                    target.set_health(if unhealthy {
                        Health::Unhealthy
                    } else {
                        Health::Healthy
                    });
                }
                target.set_health(Health::Healthy);
            });
            let lost = scope.spawn(|| {
                // Each ejection starts after the last one ended, so each must win.
                let lost = (1..=rounds)
                    .filter(|round| {
                        let now = round * 100_000;
                        target
                            .eject(now, &policy(), FailureCause::Timeout)
                            .is_none()
                    })
                    .count();
                ejecting.store(false, Ordering::Relaxed);
                lost
            });
            assert_eq!(lost.join().unwrap(), 0, "ejections lost to a verdict");
        });
        assert_eq!(target.health(), Health::Healthy, "the last verdict");
        assert_eq!(
            target.ejected_until_ms(),
            rounds * 100_000 + 25_000,
            "the last ejection, capped at 25 s"
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
