//! One loop per discovery source: a refresh loop for poll providers, a watch loop for watch
//! providers.
//!
//! A loop only fetches: each outcome goes to the control task, which reconciles, persists and
//! publishes, the same way for both kinds, so lifecycle, timers, leases and persistence do not
//! know which kind of provider a source has.
//!
//! Poll scheduling: `interval_ms` minus up to 10 % random jitter (so many sources do not refresh
//! in lock-step), earlier when a DNS TTL is shorter (never below [`TTL_FLOOR`]), at once when an
//! operator asks — unless a refresh is already running, which the request then joins.
//!
//! Watching (DESIGN §4, watch rules): every answer is a whole set; an answer whose set is the one
//! last reported is not reported again, so an unchanged registry costs no reconcile; two requests
//! of one watch start at least [`WATCH_SPACING`] apart, so a burst of changes is read as one set
//! and a registry that answers at once cannot make the loop spin; an answer that does not come
//! within the provider's answer deadline ends the watch as dead. A failed watch is a failed
//! refresh, retried after a jittered exponential backoff ([`backoff_delay`]) with a full read.
//! An operator's refresh restarts the watch from a full read.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use tokio::sync::{mpsc, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{
    Discovered, DiscoveryError, Fetch, PollProvider, Schedule, WatchAnswer, WatchProvider,
    WatchStream,
};
use crate::model::{Id, WatchProgress};

/// A record TTL of 0 must not make a source spin.
pub const TTL_FLOOR: Duration = Duration::from_secs(1);
/// Largest share of the interval taken off as jitter.
const JITTER_FRACTION: f64 = 0.10;
/// The least time between the starts of two requests of one watch.
pub const WATCH_SPACING: Duration = Duration::from_secs(1);
/// The wait after a watch's first failure; it doubles with each further one up to
/// [`BACKOFF_MAX`].
pub const BACKOFF_FIRST: Duration = Duration::from_secs(1);
pub const BACKOFF_MAX: Duration = Duration::from_secs(60);
/// Largest share added to a backoff as jitter, so watches cut at once do not reconnect at once.
const BACKOFF_JITTER: f64 = 0.20;

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
            origin_wall: crate::clock::now(),
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
    /// When the loop asks next; None while a watch is connected (the registry answers when the
    /// set changes).
    pub next_refresh_at: Option<DateTime<Utc>>,
    /// The watch after this outcome; None for poll providers.
    pub watch: Option<WatchProgress>,
}

/// The control task's grip on a running loop. Dropping it stops the loop.
pub struct RunnerHandle {
    pub generation: u64,
    wake: Arc<Notify>,
    refreshing: Arc<AtomicBool>,
    report_again: Arc<AtomicBool>,
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

    /// The last outcome could not be applied (the store failed): a watch reports its next answer
    /// even when the set is the same, so the next answer repairs what was lost instead of the
    /// next catalog change, which may be hours away. (A poll loop reports every refresh anyway.)
    pub fn report_next_answer(&self) {
        self.report_again.store(true, Ordering::Release);
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

/// The wait before a watch reconnects after its `failures`-th failure in a row (from 1): 1 s
/// doubling to 60 s, plus up to 20 % jitter, never past 60 s. `jitter` is in [0, 1).
pub fn backoff_delay(failures: u32, jitter: f64) -> Duration {
    let doublings = failures.saturating_sub(1).min(16);
    let base = BACKOFF_FIRST
        .saturating_mul(1u32 << doublings)
        .min(BACKOFF_MAX);
    base.mul_f64(1.0 + BACKOFF_JITTER * jitter.clamp(0.0, 1.0))
        .min(BACKOFF_MAX)
}

pub struct RunnerSpec {
    pub source_id: Id,
    pub generation: u64,
    pub fetch: Fetch,
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
    let report_again = Arc::new(AtomicBool::new(false));
    let generation = spec.generation;
    let lane = Lane {
        source_id: spec.source_id,
        generation: spec.generation,
        clock,
        outcomes,
        wake: wake.clone(),
        refreshing: refreshing.clone(),
        report_again: report_again.clone(),
    };
    let task = match spec.fetch {
        Fetch::Poll { provider, schedule } => {
            tokio::spawn(poll(provider, schedule, spec.first_delay, lane))
        }
        Fetch::Watch { provider } => tokio::spawn(watch(provider, spec.first_delay, lane)),
    };
    RunnerHandle {
        generation,
        wake,
        refreshing,
        report_again,
        task,
    }
}

/// What both loops share: who they report for, where, and the operator's refresh requests.
struct Lane {
    source_id: Id,
    generation: u64,
    clock: Clock,
    outcomes: mpsc::Sender<RefreshOutcome>,
    wake: Arc<Notify>,
    refreshing: Arc<AtomicBool>,
    report_again: Arc<AtomicBool>,
}

impl Lane {
    /// Until `delay` passed or an operator asked for a refresh (which then goes first).
    async fn wait_or_woken(&self, delay: Duration) {
        tokio::select! {
            biased;
            _ = self.wake.notified() => {}
            _ = tokio::time::sleep(delay) => {}
        }
    }

    /// Sends an outcome; false when the control task is gone (the loop ends).
    async fn report(
        &self,
        started: Instant,
        result: Result<Discovered, DiscoveryError>,
        next_refresh_in: Option<Duration>,
        watch: Option<WatchProgress>,
    ) -> bool {
        let finished_at = self.clock.now();
        let outcome = RefreshOutcome {
            source_id: self.source_id,
            generation: self.generation,
            finished_at,
            duration: started.elapsed(),
            next_refresh_at: next_refresh_in.map(|delay| {
                finished_at + chrono::Duration::from_std(delay).unwrap_or(chrono::Duration::MAX)
            }),
            result,
            watch,
        };
        self.outcomes.send(outcome).await.is_ok()
    }
}

async fn poll(
    provider: Box<dyn PollProvider>,
    schedule: Schedule,
    first_delay: Duration,
    lane: Lane,
) {
    let mut delay = first_delay;
    loop {
        lane.wait_or_woken(delay).await;
        lane.refreshing.store(true, Ordering::Release);
        let attempt_started = Instant::now();
        let result = match tokio::time::timeout(schedule.timeout, provider.refresh()).await {
            Ok(result) => result,
            Err(_) => Err(DiscoveryError::Timeout {
                timeout_ms: schedule.timeout.as_millis() as u64,
            }),
        };
        lane.refreshing.store(false, Ordering::Release);
        let ttl = result.as_ref().ok().and_then(|discovered| discovered.ttl);
        delay = next_delay(&schedule, ttl, fastrand::f64());
        if !lane
            .report(attempt_started, result, Some(delay), None)
            .await
        {
            return;
        }
    }
}

/// How one watch ended.
enum WatchEnd {
    /// An operator asked for a refresh: reconnect at once with a full read.
    Restart,
    /// The request that started at `requested` failed.
    Failed {
        error: DiscoveryError,
        requested: Instant,
    },
    /// The control task is gone.
    Closed,
}

/// What the watch loop remembers across reconnects.
struct WatchMemory {
    progress: WatchProgress,
    /// The set last reported (its revision, what was refused from it and who is departing), so
    /// an identical answer is not reported again.
    reported: Option<(String, Option<String>, Vec<String>)>,
    failures: u32,
}

async fn watch(provider: Box<dyn WatchProvider>, first_delay: Duration, lane: Lane) {
    let mut memory = WatchMemory {
        progress: WatchProgress {
            connected: false,
            since: lane.clock.now(),
            index: None,
        },
        reported: None,
        failures: 0,
    };
    let mut delay = first_delay;
    loop {
        lane.wait_or_woken(delay).await;
        // A full read is under way: an operator's refresh joins it.
        lane.refreshing.store(true, Ordering::Release);
        match follow(provider.as_ref(), &lane, &mut memory).await {
            WatchEnd::Restart => delay = Duration::ZERO,
            WatchEnd::Closed => return,
            WatchEnd::Failed { error, requested } => {
                lane.refreshing.store(false, Ordering::Release);
                // A watch connected for longer than the longest backoff proved itself even if it
                // answered only once (a quiet Kubernetes watch answers its list and then nothing
                // until a change): its failure starts the backoff over.
                if memory.progress.connected
                    && (lane.clock.now() - memory.progress.since)
                        .to_std()
                        .unwrap_or_default()
                        >= BACKOFF_MAX
                {
                    memory.failures = 0;
                }
                memory.failures = memory.failures.saturating_add(1);
                delay = backoff_delay(memory.failures, fastrand::f64());
                if memory.progress.connected {
                    memory.progress.connected = false;
                    memory.progress.since = lane.clock.now();
                }
                let watch = Some(memory.progress.clone());
                if !lane.report(requested, Err(error), Some(delay), watch).await {
                    return;
                }
            }
        }
    }
}

/// Opens one watch and follows it until it fails or an operator asks for a full read.
async fn follow(provider: &dyn WatchProvider, lane: &Lane, memory: &mut WatchMemory) -> WatchEnd {
    let deadline = provider.answer_deadline();
    let mut stream = provider.watch();
    // The first answer of every watch is reported even when its set is the last one reported:
    // it ends a failure, or answers an operator's refresh, or starts the source.
    let mut first = true;
    loop {
        let requested = Instant::now();
        let answer = tokio::select! {
            biased;
            _ = lane.wake.notified() => return WatchEnd::Restart,
            answer = next_within(deadline, &mut stream) => answer,
        };
        let error = match answer {
            Err(waited) => DiscoveryError::WatchSilent {
                waited_ms: waited.as_millis() as u64,
            },
            Ok(None) => DiscoveryError::WatchEnded,
            Ok(Some(Err(error))) => error,
            Ok(Some(Ok(answer))) => {
                if !accept(answer, first, requested, lane, memory).await {
                    return WatchEnd::Closed;
                }
                first = false;
                tokio::select! {
                    biased;
                    _ = lane.wake.notified() => return WatchEnd::Restart,
                    _ = tokio::time::sleep_until(requested + WATCH_SPACING) => {}
                }
                continue;
            }
        };
        return WatchEnd::Failed { error, requested };
    }
}

/// The watch's next answer, or how long it waited in vain past its deadline.
async fn next_within(
    deadline: Option<Duration>,
    stream: &mut WatchStream,
) -> Result<Option<Result<WatchAnswer, DiscoveryError>>, Duration> {
    match deadline {
        Some(deadline) => tokio::time::timeout(deadline, stream.next())
            .await
            .map_err(|_| deadline),
        None => Ok(stream.next().await),
    }
}

/// One answer of a watch: reported when it is the watch's first, when its set differs from the
/// last one reported, or when the control task lost the last one. False when the control task is
/// gone.
async fn accept(
    answer: WatchAnswer,
    first: bool,
    requested: Instant,
    lane: &Lane,
    memory: &mut WatchMemory,
) -> bool {
    lane.refreshing.store(false, Ordering::Release);
    // Only an answer after the first (full) read proves the watch itself works: a registry that
    // answers plain reads but fails every blocking one must still back off further each time.
    if !first {
        memory.failures = 0;
    }
    if !memory.progress.connected {
        memory.progress.connected = true;
        memory.progress.since = lane.clock.now();
    }
    let set = (
        answer.discovered.revision.clone(),
        answer.discovered.refused.clone(),
        answer.discovered.departures.clone(),
    );
    let lost = lane.report_again.swap(false, Ordering::AcqRel);
    if !first && !lost && memory.reported.as_ref() == Some(&set) {
        return true;
    }
    memory.reported = Some(set);
    memory.progress.index = Some(answer.position);
    let watch = Some(memory.progress.clone());
    lane.report(requested, Ok(answer.discovered), None, watch)
        .await
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

    impl PollProvider for ScriptedProvider {
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
                    refused: None,
                    departures: Vec::new(),
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
                fetch: Fetch::Poll {
                    provider: Box::new(provider),
                    schedule,
                },
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
        let announced = harness.clock.instant_of(first.next_refresh_at.unwrap());
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

    // --- watch ---------------------------------------------------------------------------------

    #[test]
    fn backoff_doubles_from_one_second_to_a_minute_with_jitter() {
        let secs = |failures| backoff_delay(failures, 0.0).as_secs_f64();
        assert_eq!(
            [1, 2, 3, 4, 5, 6, 7, 8].map(secs),
            [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
        );
        assert_eq!(backoff_delay(u32::MAX, 0.99), BACKOFF_MAX);
        let jittered = backoff_delay(2, 0.5);
        assert_eq!(jittered, Duration::from_millis(2_200));
        assert_eq!(backoff_delay(0, 0.0), BACKOFF_FIRST);
    }

    /// One scripted answer of the watch.
    #[derive(Clone)]
    enum Step {
        Set(&'static [u16]),
        /// A set with entries the provider refused, and why.
        Refused(&'static [u16], &'static str),
        /// The set, after the registry took this long to answer.
        Slow(&'static [u16], Duration),
        Fail,
        /// Silence for this long, then a failure (a quiet watch that breaks).
        FailAfter(Duration),
        Hang,
    }

    /// A watch provider answering from a script; when the script runs out it answers the last
    /// set again at once, as a registry that does not block would.
    struct ScriptedWatch {
        script: Arc<Mutex<std::collections::VecDeque<Step>>>,
        /// Requests made (answers asked for), and watches opened.
        requests: Arc<AtomicUsize>,
        opened: Arc<AtomicUsize>,
    }

    fn set_of(ports: &[u16]) -> Discovered {
        let endpoints: Vec<crate::model::Endpoint> = ports
            .iter()
            .map(|port| crate::model::Endpoint {
                key: format!("n/{port}"),
                host: "127.0.0.1".into(),
                port: *port,
                weight: 100,
                priority: 0,
                enabled: true,
                metadata: serde_json::json!({}),
            })
            .collect();
        Discovered {
            revision: crate::discovery::revision_of(&endpoints),
            endpoints,
            ttl: None,
            refused: None,
            departures: Vec::new(),
        }
    }

    impl WatchProvider for ScriptedWatch {
        fn watch(&self) -> crate::discovery::WatchStream {
            self.opened.fetch_add(1, Ordering::SeqCst);
            let script = self.script.clone();
            let requests = self.requests.clone();
            let state = (script, requests, Step::Set(&[]));
            Box::pin(futures_util::stream::unfold(
                state,
                |(script, requests, last)| async move {
                    let index = requests.fetch_add(1, Ordering::SeqCst) + 1;
                    let step = script.lock().unwrap().pop_front();
                    let step = step.unwrap_or_else(|| last.clone());
                    let (ports, refused) = match step {
                        Step::Hang => std::future::pending().await,
                        Step::Fail | Step::FailAfter(_) => {
                            if let Step::FailAfter(silence) = step {
                                tokio::time::sleep(silence).await;
                            }
                            let error = DiscoveryError::HttpStatus {
                                url: "http://consul".into(),
                                status: 500,
                            };
                            return Some((Err(error), (script, requests, last)));
                        }
                        Step::Slow(ports, latency) => {
                            tokio::time::sleep(latency).await;
                            (ports, None)
                        }
                        Step::Set(ports) => (ports, None),
                        Step::Refused(ports, why) => (ports, Some(why.to_owned())),
                    };
                    let mut discovered = set_of(ports);
                    discovered.refused = refused.clone();
                    let again = match refused {
                        Some(_) => last,
                        None => Step::Set(ports),
                    };
                    let answer = crate::discovery::WatchAnswer {
                        discovered,
                        position: index.to_string(),
                    };
                    Some((Ok(answer), (script, requests, again)))
                },
            ))
        }

        fn answer_deadline(&self) -> Option<Duration> {
            Some(Duration::from_secs(70))
        }
    }

    struct WatchHarness {
        script: Arc<Mutex<std::collections::VecDeque<Step>>>,
        requests: Arc<AtomicUsize>,
        opened: Arc<AtomicUsize>,
        handle: RunnerHandle,
        outcomes: mpsc::Receiver<RefreshOutcome>,
    }

    fn start_watch(script: &[Step]) -> WatchHarness {
        let script = Arc::new(Mutex::new(script.iter().cloned().collect()));
        let requests = Arc::new(AtomicUsize::new(0));
        let opened = Arc::new(AtomicUsize::new(0));
        let provider = ScriptedWatch {
            script: Arc::clone(&script),
            requests: requests.clone(),
            opened: opened.clone(),
        };
        let (sender, outcomes) = mpsc::channel(16);
        let handle = spawn(
            RunnerSpec {
                source_id: 9,
                generation: 1,
                fetch: Fetch::Watch {
                    provider: Box::new(provider),
                },
                first_delay: Duration::ZERO,
            },
            Clock::new(),
            sender,
        );
        WatchHarness {
            script,
            requests,
            opened,
            handle,
            outcomes,
        }
    }

    fn ports_of(outcome: &RefreshOutcome) -> Vec<u16> {
        let discovered = outcome.result.as_ref().expect("a successful outcome");
        discovered.endpoints.iter().map(|e| e.port).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_reports_each_new_set_once_and_asks_at_most_once_a_second() {
        let mut harness = start_watch(&[Step::Set(&[1]), Step::Set(&[1]), Step::Set(&[1, 2])]);
        let first = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&first), [1]);
        assert_eq!(
            first.next_refresh_at, None,
            "a connected watch has no next refresh"
        );
        let watch = first.watch.clone().unwrap();
        assert!(watch.connected);
        assert_eq!(watch.index.as_deref(), Some("1"));
        let started = Instant::now();
        // The identical second answer is not reported; the third, a new set, is.
        let second = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&second), [1, 2]);
        assert_eq!(second.watch.unwrap().index.as_deref(), Some("3"));
        assert_eq!(started.elapsed(), 2 * WATCH_SPACING);
        // From here the provider answers the same set at once, forever: one request a second,
        // and nothing reported.
        let quiet = tokio::time::timeout(Duration::from_secs(60), harness.outcomes.recv()).await;
        assert!(quiet.is_err(), "an unchanged set is not reported");
        let requests = harness.requests.load(Ordering::SeqCst);
        assert!((62..=64).contains(&requests), "{requests} requests in 62 s");
        assert_eq!(harness.opened.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_watch_backs_off_reconnects_and_reports_the_same_set_again() {
        let mut harness = start_watch(&[
            Step::Set(&[1]),
            Step::Fail,
            Step::Fail,
            Step::Set(&[1]),
            Step::Hang,
        ]);
        assert_eq!(ports_of(&harness.outcomes.recv().await.unwrap()), [1]);
        let failed = harness.outcomes.recv().await.unwrap();
        assert!(failed.result.is_err());
        let watch = failed.watch.clone().unwrap();
        assert!(!watch.connected);
        assert_eq!(watch.index.as_deref(), Some("1"), "the last index is kept");
        let retry_in = failed.next_refresh_at.unwrap() - failed.finished_at;
        assert!(
            (1_000..=1_200).contains(&retry_in.num_milliseconds()),
            "{retry_in}"
        );
        let before_second = Instant::now();
        let failed_again = harness.outcomes.recv().await.unwrap();
        assert!(failed_again.result.is_err());
        let waited = before_second.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited <= Duration::from_millis(1_200),
            "{waited:?}"
        );
        let before_third = Instant::now();
        // Back: the same set as before the failure is reported, to end the failure.
        let recovered = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&recovered), [1]);
        assert!(recovered.watch.unwrap().connected);
        let waited = before_third.elapsed();
        assert!(
            waited >= Duration::from_secs(2) && waited <= Duration::from_millis(2_400),
            "the second failure waits twice as long: {waited:?}"
        );
        assert_eq!(harness.opened.load(Ordering::SeqCst), 3);
        drop(harness.script);
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_watch_is_taken_for_dead_after_its_deadline() {
        let mut harness = start_watch(&[Step::Set(&[1]), Step::Hang, Step::Set(&[1, 2])]);
        harness.outcomes.recv().await.unwrap();
        let started = Instant::now();
        let dead = harness.outcomes.recv().await.unwrap();
        assert_eq!(
            dead.result.unwrap_err(),
            DiscoveryError::WatchSilent { waited_ms: 70_000 }
        );
        assert_eq!(started.elapsed(), WATCH_SPACING + Duration::from_secs(70));
        let back = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&back), [1, 2]);
        assert_eq!(harness.opened.load(Ordering::SeqCst), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_requested_refresh_restarts_the_watch_from_a_full_read() {
        let mut harness = start_watch(&[Step::Set(&[1]), Step::Hang, Step::Set(&[1])]);
        harness.outcomes.recv().await.unwrap();
        // Let the watch sit in its blocking request.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(harness.handle.request_refresh());
        assert!(!harness.handle.request_refresh(), "a second request joins");
        let asked = Instant::now();
        let again = harness.outcomes.recv().await.unwrap();
        assert_eq!(
            ports_of(&again),
            [1],
            "reported although the set is the same"
        );
        assert_eq!(asked.elapsed(), Duration::ZERO);
        assert_eq!(harness.opened.load(Ordering::SeqCst), 2);
        // Once answered, a new request is a new refresh.
        assert!(harness.handle.request_refresh());
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresh_asked_during_a_slow_first_read_joins_it() {
        let mut harness = start_watch(&[Step::Slow(&[1], Duration::from_secs(3)), Step::Hang]);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            !harness.handle.request_refresh(),
            "joins the full read under way"
        );
        let first = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&first), [1]);
        assert_eq!(harness.opened.load(Ordering::SeqCst), 1, "not restarted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refresh_asked_during_a_backoff_reconnects_at_once() {
        let mut harness = start_watch(&[Step::Fail, Step::Fail, Step::Set(&[2]), Step::Hang]);
        harness.outcomes.recv().await.unwrap();
        let failed = harness.outcomes.recv().await.unwrap();
        assert!(failed.result.is_err());
        // Backing off for 2 s or more now.
        assert!(harness.handle.request_refresh());
        let asked = Instant::now();
        let back = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&back), [2]);
        assert_eq!(asked.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_in_what_was_refused_is_reported_though_the_set_is_the_same() {
        let mut harness = start_watch(&[
            Step::Set(&[1]),
            Step::Refused(&[1], "left out 1 of 2 instances"),
            Step::Refused(&[1], "left out 1 of 2 instances"),
            Step::Set(&[1]),
            Step::Hang,
        ]);
        assert_eq!(
            harness
                .outcomes
                .recv()
                .await
                .unwrap()
                .result
                .unwrap()
                .refused,
            None
        );
        let refused = harness.outcomes.recv().await.unwrap();
        assert_eq!(
            refused.result.unwrap().refused.as_deref(),
            Some("left out 1 of 2 instances")
        );
        // The repeated refusal is not reported again; its end is.
        let cleared = harness.outcomes.recv().await.unwrap();
        assert_eq!(cleared.result.unwrap().refused, None);
        assert_eq!(cleared.watch.unwrap().index.as_deref(), Some("4"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_outcome_lost_by_the_control_task_is_reported_again() {
        let mut harness = start_watch(&[Step::Set(&[1]), Step::Set(&[1]), Step::Set(&[1])]);
        harness.outcomes.recv().await.unwrap();
        harness.handle.report_next_answer();
        let again = harness.outcomes.recv().await.unwrap();
        assert_eq!(ports_of(&again), [1], "the same set, reported once more");
        assert_eq!(again.watch.unwrap().index.as_deref(), Some("2"));
        let quiet = tokio::time::timeout(Duration::from_secs(30), harness.outcomes.recv()).await;
        assert!(quiet.is_err(), "and then no more");
    }

    #[tokio::test(start_paused = true)]
    async fn plain_reads_that_work_do_not_reset_the_backoff_of_failing_watches() {
        let mut harness = start_watch(&[
            Step::Set(&[1]),
            Step::Fail,
            Step::Set(&[1]),
            Step::Fail,
            Step::Set(&[1]),
            Step::Fail,
            Step::Hang,
        ]);
        let mut retries = Vec::new();
        while retries.len() < 3 {
            let outcome = harness.outcomes.recv().await.unwrap();
            if outcome.result.is_err() {
                retries
                    .push((outcome.next_refresh_at.unwrap() - outcome.finished_at).num_seconds());
            }
        }
        assert_eq!(
            retries,
            [1, 2, 4],
            "the wait doubles though each full read answered"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_stayed_connected_a_long_time_starts_its_backoff_over() {
        let mut harness = start_watch(&[
            Step::Set(&[1]),
            Step::FailAfter(Duration::from_secs(61)),
            Step::Set(&[1]),
            Step::FailAfter(Duration::from_secs(61)),
            Step::Set(&[1]),
            Step::FailAfter(Duration::from_secs(30)),
            Step::Hang,
        ]);
        let mut retries = Vec::new();
        while retries.len() < 3 {
            let outcome = harness.outcomes.recv().await.unwrap();
            if outcome.result.is_err() {
                retries
                    .push((outcome.next_refresh_at.unwrap() - outcome.finished_at).num_seconds());
            }
        }
        // Connected 61 s each time: 1 s, 1 s; then only 30 s: the backoff doubles.
        assert_eq!(retries, [1, 1, 2]);
    }
}
