//! One refresh loop per discovery source.
//!
//! The loop only fetches: each attempt's outcome goes to the control task, which reconciles,
//! persists and publishes. Scheduling: `interval_ms` minus up to 10 % random jitter (so many
//! sources do not refresh in lock-step), earlier when a DNS TTL is shorter (never below
//! [`TTL_FLOOR`]), at once when an operator asks — unless a refresh is already running, which
//! the request then joins.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;

use super::{Discovered, DiscoveryError, Provider, Schedule};
use crate::model::Id;

/// A record TTL of 0 must not make a source spin.
pub const TTL_FLOOR: Duration = Duration::from_secs(1);
/// Largest share of the interval taken off as jitter.
const JITTER_FRACTION: f64 = 0.10;

/// Wall-clock time derived from tokio's clock, so timers and the times they record agree, also
/// under tokio's paused time in tests.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    origin: tokio::time::Instant,
    origin_wall: DateTime<Utc>,
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            origin: tokio::time::Instant::now(),
            origin_wall: Utc::now(),
        }
    }

    pub fn now(&self) -> DateTime<Utc> {
        self.at(tokio::time::Instant::now())
    }

    pub fn at(&self, instant: tokio::time::Instant) -> DateTime<Utc> {
        let elapsed = instant.saturating_duration_since(self.origin);
        self.origin_wall + chrono::Duration::from_std(elapsed).unwrap_or(chrono::Duration::MAX)
    }

    /// The tokio instant for a wall-clock time (now, if it is in the past).
    pub fn instant_of(&self, time: DateTime<Utc>) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        match (time - self.now()).to_std() {
            Ok(ahead) => now + ahead,
            Err(_) => now,
        }
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

/// What one refresh attempt produced, for the control task.
#[derive(Debug)]
pub struct RefreshOutcome {
    pub source_id: Id,
    /// Which runner of this source sent it: results of a replaced runner are ignored.
    pub generation: u64,
    pub finished_at: DateTime<Utc>,
    /// How long the attempt took.
    pub duration: Duration,
    pub result: Result<Discovered, DiscoveryError>,
    pub next_refresh_at: DateTime<Utc>,
}

/// The control task's grip on a running loop. Dropping it stops the loop.
pub struct RunnerHandle {
    pub generation: u64,
    wake: Arc<Notify>,
    refreshing: Arc<AtomicBool>,
    task: JoinHandle<()>,
}

impl RunnerHandle {
    /// Asks for an immediate refresh; false when one is already running (the caller's request
    /// is served by it).
    pub fn request_refresh(&self) -> bool {
        // Claiming the flag here, not when the loop wakes, makes a second request that arrives
        // before the loop runs join the first instead of queueing another refresh.
        if self
            .refreshing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        self.wake.notify_one();
        true
    }
}

impl Drop for RunnerHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The wait before the next refresh: the interval, or a shorter TTL (floored), less jitter.
/// `jitter` is a random number in [0, 1).
pub fn next_delay(schedule: &Schedule, ttl: Option<Duration>, jitter: f64) -> Duration {
    let base = match ttl {
        Some(ttl) if ttl < schedule.interval => ttl.max(TTL_FLOOR).min(schedule.interval),
        _ => schedule.interval,
    };
    base.mul_f64(1.0 - JITTER_FRACTION * jitter.clamp(0.0, 1.0))
}

pub struct RunnerSpec {
    pub source_id: Id,
    pub generation: u64,
    pub provider: Box<dyn Provider>,
    pub schedule: Schedule,
    /// Wait before the first refresh (0 for a new or changed source).
    pub first_delay: Duration,
}

pub fn spawn(
    spec: RunnerSpec,
    clock: Clock,
    outcomes: mpsc::Sender<RefreshOutcome>,
) -> RunnerHandle {
    let wake = Arc::new(Notify::new());
    let refreshing = Arc::new(AtomicBool::new(false));
    let generation = spec.generation;
    let task = tokio::spawn(run(spec, clock, outcomes, wake.clone(), refreshing.clone()));
    RunnerHandle {
        generation,
        wake,
        refreshing,
        task,
    }
}

async fn run(
    spec: RunnerSpec,
    clock: Clock,
    outcomes: mpsc::Sender<RefreshOutcome>,
    wake: Arc<Notify>,
    refreshing: Arc<AtomicBool>,
) {
    let mut delay = spec.first_delay;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = wake.notified() => {}
        }
        refreshing.store(true, Ordering::Release);
        let attempt_started = tokio::time::Instant::now();
        let result =
            match tokio::time::timeout(spec.schedule.timeout, spec.provider.refresh()).await {
                Ok(result) => result,
                Err(_) => Err(DiscoveryError::Timeout {
                    timeout_ms: spec.schedule.timeout.as_millis() as u64,
                }),
            };
        refreshing.store(false, Ordering::Release);
        let ttl = result.as_ref().ok().and_then(|discovered| discovered.ttl);
        delay = next_delay(&spec.schedule, ttl, fastrand::f64());
        let finished_at = clock.now();
        let outcome = RefreshOutcome {
            source_id: spec.source_id,
            generation: spec.generation,
            finished_at,
            duration: attempt_started.elapsed(),
            next_refresh_at: finished_at
                + chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX),
            result,
        };
        if outcomes.send(outcome).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::RefreshFuture;
    use std::sync::atomic::AtomicUsize;
    use std::sync::Mutex;

    /// Answers from a script; each refresh takes `latency`.
    struct ScriptedProvider {
        calls: Arc<AtomicUsize>,
        latency: Duration,
        ttl: Option<Duration>,
        fail: Arc<Mutex<bool>>,
    }

    impl Provider for ScriptedProvider {
        fn refresh(&self) -> RefreshFuture<'_> {
            Box::pin(async move {
                self.calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(self.latency).await;
                if *self.fail.lock().unwrap() {
                    return Err(DiscoveryError::HttpStatus {
                        url: "http://registry".into(),
                        status: 500,
                    });
                }
                Ok(Discovered {
                    endpoints: Vec::new(),
                    revision: "r".into(),
                    ttl: self.ttl,
                })
            })
        }
    }

    fn schedule(interval_ms: u64, timeout_ms: u64) -> Schedule {
        Schedule {
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    struct Harness {
        calls: Arc<AtomicUsize>,
        fail: Arc<Mutex<bool>>,
        handle: RunnerHandle,
        outcomes: mpsc::Receiver<RefreshOutcome>,
        clock: Clock,
    }

    fn start(schedule: Schedule, latency: Duration, ttl: Option<Duration>) -> Harness {
        let calls = Arc::new(AtomicUsize::new(0));
        let fail = Arc::new(Mutex::new(false));
        let provider = ScriptedProvider {
            calls: calls.clone(),
            latency,
            ttl,
            fail: fail.clone(),
        };
        let (sender, outcomes) = mpsc::channel(16);
        let clock = Clock::new();
        let handle = spawn(
            RunnerSpec {
                source_id: 7,
                generation: 3,
                provider: Box::new(provider),
                schedule,
                first_delay: Duration::ZERO,
            },
            clock,
            sender,
        );
        Harness {
            calls,
            fail,
            handle,
            outcomes,
            clock,
        }
    }

    #[test]
    fn delay_is_interval_less_at_most_ten_percent() {
        let schedule = schedule(30_000, 5_000);
        assert_eq!(next_delay(&schedule, None, 0.0), Duration::from_secs(30));
        assert_eq!(next_delay(&schedule, None, 0.999_999).as_millis(), 27_000);
        assert_eq!(
            next_delay(&schedule, None, 0.5),
            Duration::from_millis(28_500)
        );
    }

    #[test]
    fn short_ttl_refreshes_earlier_with_a_floor() {
        let schedule = schedule(30_000, 5_000);
        assert_eq!(
            next_delay(&schedule, Some(Duration::from_secs(5)), 0.0),
            Duration::from_secs(5)
        );
        assert_eq!(next_delay(&schedule, Some(Duration::ZERO), 0.0), TTL_FLOOR);
        assert_eq!(
            next_delay(&schedule, Some(Duration::from_secs(300)), 0.0),
            Duration::from_secs(30)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn refreshes_at_once_then_every_interval_with_jitter() {
        let mut harness = start(schedule(10_000, 1_000), Duration::ZERO, None);
        let first = harness.outcomes.recv().await.unwrap();
        assert_eq!(first.source_id, 7);
        assert_eq!(first.generation, 3);
        assert!(first.result.is_ok());
        let started = tokio::time::Instant::now();
        let second = harness.outcomes.recv().await.unwrap();
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_millis(9_000) && waited <= Duration::from_millis(10_000),
            "waited {waited:?}"
        );
        // The announced next refresh is when the second one came.
        let announced = harness.clock.instant_of(first.next_refresh_at);
        assert!(announced.saturating_duration_since(started) <= waited);
        assert_eq!(harness.calls.load(Ordering::SeqCst), 2);
        drop(second);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_provider_times_out_as_a_failure() {
        let mut harness = start(schedule(10_000, 500), Duration::from_secs(60), None);
        let started = tokio::time::Instant::now();
        let outcome = harness.outcomes.recv().await.unwrap();
        assert_eq!(started.elapsed(), Duration::from_millis(500));
        assert_eq!(
            outcome.result,
            Err(DiscoveryError::Timeout { timeout_ms: 500 })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ttl_shortens_the_wait() {
        let mut harness = start(
            schedule(60_000, 1_000),
            Duration::ZERO,
            Some(Duration::from_secs(2)),
        );
        harness.outcomes.recv().await.unwrap();
        let started = tokio::time::Instant::now();
        harness.outcomes.recv().await.unwrap();
        let waited = started.elapsed();
        assert!(
            waited <= Duration::from_secs(2) && waited >= Duration::from_millis(1_800),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_requested_refresh_runs_at_once_and_joins_a_running_one() {
        let mut harness = start(schedule(60_000, 5_000), Duration::from_millis(100), None);
        harness.outcomes.recv().await.unwrap();
        assert!(harness.handle.request_refresh());
        let asked = tokio::time::Instant::now();
        // A second request before the loop even woke joins the first.
        assert!(!harness.handle.request_refresh());
        // So does one while that refresh runs.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!harness.handle.request_refresh());
        harness.outcomes.recv().await.unwrap();
        assert_eq!(asked.elapsed(), Duration::from_millis(100));
        assert_eq!(harness.calls.load(Ordering::SeqCst), 2);
        // Nothing else is queued: the next refresh waits for the interval.
        let next = tokio::time::timeout(Duration::from_secs(50), harness.outcomes.recv()).await;
        assert!(next.is_err(), "no extra refresh was queued");
    }

    #[tokio::test(start_paused = true)]
    async fn failures_are_reported_and_the_loop_goes_on() {
        let mut harness = start(schedule(1_000, 500), Duration::ZERO, None);
        *harness.fail.lock().unwrap() = true;
        let failed = harness.outcomes.recv().await.unwrap();
        assert!(matches!(
            failed.result,
            Err(DiscoveryError::HttpStatus { status: 500, .. })
        ));
        *harness.fail.lock().unwrap() = false;
        let recovered = harness.outcomes.recv().await.unwrap();
        assert!(recovered.result.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn dropping_the_handle_stops_the_loop() {
        let mut harness = start(schedule(1_000, 500), Duration::ZERO, None);
        harness.outcomes.recv().await.unwrap();
        drop(harness.handle);
        assert!(
            harness.outcomes.recv().await.is_none(),
            "the loop ended and closed its sender"
        );
    }
}
