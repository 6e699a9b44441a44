//! The canary's state machine: every verdict of `judge` and every operator's action; then the
//! task in paused time over a fake store: flushes, leases, when intervals are read and judged,
//! moves, a restart mid-step.

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

// The task itself, in paused time: a fake store whose clock is tokio's, and a real snapshot
// the test republishes from the fake's statuses as the control task would on a move.

use std::collections::BTreeMap;

use crate::control::build::tests::service;
use crate::control::{build_snapshot, CarriedState};
use crate::model::{Backend, Route, RoutingConfig};

const EPOCH_MS: i64 = 1_700_000_000_000;
const INTERVAL: Duration = Duration::from_secs(5);
const LEASE: Duration = Duration::from_secs(3);

/// Steps 10, 50, 100 over 5 s intervals, at least 10 requests, at most 5 % errors.
fn task_canary() -> Canary {
    serde_json::from_value(serde_json::json!({
        "backend": 1,
        "steps": [10, 50, 100],
        "step_interval_ms": INTERVAL.as_millis() as u64,
        "min_requests": 10,
        "max_error_percent": 5.0
    }))
    .unwrap()
}

/// One move the task made.
#[derive(Debug, Clone)]
struct Moved {
    route_id: Id,
    at_ms: i64,
    from_round: i64,
    to: CanaryMove,
    counts: Vec<IntervalCounts>,
}

#[derive(Default)]
struct Books {
    statuses: BTreeMap<Id, CanaryStatus>,
    /// Every flushed report with the store's time it arrived.
    counts: Vec<(i64, CountsReport)>,
    /// The next flushes fail.
    failing_flushes: usize,
    /// Routes whose `judged` fails.
    failing_judged: HashSet<Id>,
    /// Whether this gateway may hold the leases.
    lease_free: bool,
    /// What `judged` says the canary was started for, when not this test's canary.
    spec_override: Option<String>,
    flush_calls: Vec<(i64, Vec<CountsReport>)>,
    lease_calls: Vec<(i64, Vec<Id>)>,
    judged_calls: Vec<(i64, Id)>,
    moves: Vec<Moved>,
}

/// The store as the task sees it, in memory; its clock is tokio's (paused in these tests).
#[derive(Clone)]
struct FakeStore {
    books: Arc<Mutex<Books>>,
    origin: Instant,
}

impl FakeStore {
    fn new() -> FakeStore {
        FakeStore {
            books: Arc::new(Mutex::new(Books {
                lease_free: true,
                ..Books::default()
            })),
            origin: Instant::now(),
        }
    }

    fn now_ms(&self) -> i64 {
        EPOCH_MS + (Instant::now() - self.origin).as_millis() as i64
    }

    /// Milliseconds since the test began, for a store time.
    fn since_start(&self, at_ms: i64) -> i64 {
        at_ms - EPOCH_MS
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        lock(&self.books)
    }

    /// A canary at `step` (weight from the spec), round `round`, whose interval began `ago`.
    fn set_canary(&self, route_id: Id, state: CanaryState, step: u32, round: i64, ago: Duration) {
        let status = CanaryStatus {
            state,
            step,
            weight: task_canary().step_weight(step as usize),
            round,
            interval_started_ms: self.now_ms() - ago.as_millis() as i64,
            reason: "set by the test".to_owned(),
        };
        self.books().statuses.insert(route_id, status);
    }

    fn status(&self, route_id: Id) -> CanaryStatus {
        self.books().statuses[&route_id].clone()
    }

    fn moves(&self) -> Vec<Moved> {
        self.books().moves.clone()
    }

    /// When (ms since the start) `judged` was asked for `route_id`.
    fn judged_at(&self, route_id: Id) -> Vec<i64> {
        let books = self.books();
        books
            .judged_calls
            .iter()
            .filter(|(_, id)| *id == route_id)
            .map(|(at, _)| at - EPOCH_MS)
            .collect()
    }

    /// Requests and errors the store holds for a route's backend.
    fn stored(&self, route_id: Id, backend: u32) -> (u64, u64) {
        self.books()
            .counts
            .iter()
            .filter(|(_, report)| report.route_id == route_id && report.backend == backend)
            .fold((0, 0), |(requests, errors), (_, report)| {
                (
                    requests + report.counts.requests,
                    errors + report.counts.errors,
                )
            })
    }
}

impl CanaryStore for FakeStore {
    async fn add_counts(&self, reports: &[CountsReport]) -> Result<(), StoreError> {
        let now = self.now_ms();
        let mut books = self.books();
        books.flush_calls.push((now, reports.to_vec()));
        if books.failing_flushes > 0 {
            books.failing_flushes -= 1;
            return Err(StoreError::Database(sqlx::Error::PoolTimedOut));
        }
        books
            .counts
            .extend(reports.iter().map(|report| (now, report.clone())));
        Ok(())
    }

    async fn take_leases(
        &self,
        route_ids: &[Id],
        _period: Duration,
    ) -> Result<Vec<Id>, StoreError> {
        let now = self.now_ms();
        let mut books = self.books();
        books.lease_calls.push((now, route_ids.to_vec()));
        Ok(if books.lease_free {
            route_ids.to_vec()
        } else {
            Vec::new()
        })
    }

    async fn judged(&self, route_id: Id) -> Result<Option<JudgedCanary>, StoreError> {
        let now_ms = self.now_ms();
        let mut books = self.books();
        books.judged_calls.push((now_ms, route_id));
        if books.failing_judged.contains(&route_id) {
            return Err(StoreError::Database(sqlx::Error::PoolTimedOut));
        }
        let Some(status) = books.statuses.get(&route_id).cloned() else {
            return Ok(None);
        };
        // As the store: every flush of the round being judged.
        let mut counts: Vec<CanaryCounts> = Vec::new();
        for (_, report) in &books.counts {
            if report.route_id != route_id || report.round != status.round {
                continue;
            }
            let backend = report.backend as usize;
            if counts.len() <= backend {
                counts.resize(backend + 1, CanaryCounts::default());
            }
            counts[backend].add(&report.counts);
        }
        Ok(Some(JudgedCanary {
            spec: books.spec_override.clone().unwrap_or_else(|| {
                canary_key(&task_canary(), &[Backend::whole(1), Backend::whole(2)])
            }),
            status,
            now_ms,
            counts,
        }))
    }

    async fn release(&self) -> Result<(), StoreError> {
        self.books().lease_free = true;
        Ok(())
    }

    async fn move_canary(
        &self,
        route_id: Id,
        from_round: i64,
        moved: &CanaryMove,
        counts: &[IntervalCounts],
    ) -> Result<Option<CanaryStatus>, StoreError> {
        let now = self.now_ms();
        let mut books = self.books();
        let Some(status) = books.statuses.get_mut(&route_id) else {
            return Ok(None);
        };
        if status.round != from_round {
            return Ok(None);
        }
        *status = CanaryStatus {
            state: moved.state,
            step: moved.step,
            weight: moved.weight,
            round: from_round + 1,
            interval_started_ms: now,
            reason: moved.reason.clone(),
        };
        let status = status.clone();
        books.moves.push(Moved {
            route_id,
            at_ms: now,
            from_round,
            to: moved.clone(),
            counts: counts.to_vec(),
        });
        Ok(Some(status))
    }
}

/// The task over a fake store, with the snapshot it reads.
struct Harness {
    store: FakeStore,
    snapshots: SnapshotHandle,
    carried: CarriedState,
    generation: u64,
    canaries: Canaries,
    task: Option<CanaryTask>,
    moved: mpsc::Receiver<()>,
}

impl Harness {
    /// The task over `store`, whose canaries (routes 1, 2, ... as the store has them) the
    /// snapshot holds; its first turn is a second from now.
    fn start(store: &FakeStore) -> Harness {
        Harness::start_with_grace(store, Duration::ZERO)
    }

    /// The same, judging `grace` after an interval's end (production: [`ROUND_GRACE`]).
    fn start_with_grace(store: &FakeStore, grace: Duration) -> Harness {
        let mut carried = CarriedState::default();
        let snapshot = build_snapshot(&routing(store), &mut carried, 1);
        let snapshots = SnapshotHandle::new(snapshot);
        let (sender, moved) = mpsc::channel(1);
        let (canaries, task) = spawn(store.clone(), snapshots.clone(), LEASE, grace, sender);
        Harness {
            store: store.clone(),
            snapshots,
            carried,
            generation: 1,
            canaries,
            task: Some(task),
            moved,
        }
    }

    /// What the control task does when told of a move: a snapshot with the store's statuses.
    fn apply(&mut self) {
        self.generation += 1;
        let snapshot = build_snapshot(&routing(&self.store), &mut self.carried, self.generation);
        self.snapshots.publish(snapshot);
    }

    /// The route's counters on the data path now.
    fn counters(&self, route_id: Id) -> Arc<CanaryCounters> {
        let snapshot = self.snapshots.load_full();
        snapshot
            .routes()
            .into_iter()
            .find(|entry| entry.route.id == route_id)
            .and_then(|entry| entry.canary.clone())
            .expect("a canary route")
    }

    /// `requests` answered to backend `backend` in 2 ms, `errors` of them 503s.
    fn serve(&self, route_id: Id, backend: usize, requests: u64, errors: u64) {
        let counters = self.counters(route_id);
        for request in 0..requests {
            counters.record(
                backend,
                crate::snapshot::Outcome {
                    failed: request < errors,
                    micros: 2_000,
                },
            );
        }
    }

    /// The canary backend's weight on the data path.
    fn applied_weight(&self, route_id: Id) -> u8 {
        let snapshot = self.snapshots.load_full();
        let entry = snapshot
            .routes()
            .into_iter()
            .find(|entry| entry.route.id == route_id)
            .cloned()
            .expect("a canary route");
        entry.route.canary_status.as_ref().expect("a status").weight
    }

    /// Whether the control task was told of a move since the last look.
    fn told(&mut self) -> bool {
        self.moved.try_recv().is_ok()
    }
}

/// Route ids with a canary in the store, as routes of services 1 (stable) and 2 (canary).
fn routing(store: &FakeStore) -> RoutingConfig {
    let statuses = store.books().statuses.clone();
    let routes = statuses
        .into_iter()
        .map(|(id, status)| Route {
            id,
            name: format!("r{id}"),
            service_id: None,
            path_prefix: Some(format!("/r{id}")),
            backends: vec![Backend::whole(1), Backend::whole(2)],
            canary: Some(task_canary()),
            canary_status: Some(status),
            ..Route::default()
        })
        .collect();
    RoutingConfig {
        services: vec![service(1), service(2)],
        routes,
        ..RoutingConfig::default()
    }
}

/// Sleeps until `at` after the start (paused time: the task's turns due before run first).
async fn until(store: &FakeStore, at: Duration) {
    tokio::time::sleep_until(store.origin + at).await;
}

fn ms(millis: u64) -> Duration {
    Duration::from_millis(millis)
}

#[tokio::test(start_paused = true)]
async fn counts_are_flushed_every_second_and_only_when_there_are_new_ones() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    store.books().lease_free = false;
    let harness = Harness::start(&store);
    harness.serve(1, 0, 90, 0);
    harness.serve(1, 1, 10, 2);
    until(&store, ms(1_500)).await;
    {
        let books = store.books();
        assert_eq!(books.flush_calls.len(), 1);
        let (at, reports) = &books.flush_calls[0];
        assert_eq!(
            store.since_start(*at),
            1_000,
            "the first turn is a second in"
        );
        let mut seen: Vec<(u32, u64, u64)> = reports
            .iter()
            .map(|report| (report.backend, report.counts.requests, report.counts.errors))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, vec![(0, 90, 0), (1, 10, 2)]);
        assert!(reports.iter().all(|report| report.route_id == 1));
        assert_eq!(
            reports[0].counts.latency.iter().sum::<u64>(),
            reports[0].counts.requests,
            "every request is timed"
        );
    }
    // A quiet second writes nothing; the next requests are flushed alone.
    until(&store, ms(2_500)).await;
    assert_eq!(store.books().flush_calls.len(), 1);
    harness.serve(1, 1, 5, 0);
    until(&store, ms(3_500)).await;
    let books = store.books();
    assert_eq!(books.flush_calls.len(), 2);
    let (at, reports) = &books.flush_calls[1];
    assert_eq!(store.since_start(*at), 3_000);
    assert_eq!(reports.len(), 1);
    assert_eq!((reports[0].backend, reports[0].counts.requests), (1, 5));
    drop(books);
    assert_eq!(store.stored(1, 1), (15, 2));
    assert_eq!(harness.canaries.failures(), 0);
}

#[tokio::test(start_paused = true)]
async fn counts_a_failed_flush_took_are_kept_and_added_with_the_next() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    store.books().lease_free = false;
    store.books().failing_flushes = 2;
    let harness = Harness::start(&store);
    harness.serve(1, 1, 4, 1);
    until(&store, ms(1_500)).await;
    assert_eq!(store.stored(1, 1), (0, 0));
    assert_eq!(harness.canaries.failures(), 1);
    assert!(harness.canaries.last_error().is_some());
    harness.serve(1, 1, 3, 0);
    until(&store, ms(2_500)).await;
    assert_eq!(harness.canaries.failures(), 2);
    // The store answers again: everything kept goes at once, once.
    harness.serve(1, 1, 2, 1);
    until(&store, ms(3_500)).await;
    assert_eq!(store.stored(1, 1), (9, 2));
    assert_eq!(harness.canaries.last_error(), None);
    let last = store.books().flush_calls.last().unwrap().1.clone();
    assert_eq!(last.len(), 1, "one report per route and backend: {last:?}");
    until(&store, ms(5_500)).await;
    assert_eq!(store.stored(1, 1), (9, 2), "nothing is sent twice");
    assert_eq!(store.books().flush_calls.len(), 3);
}

#[tokio::test(start_paused = true)]
async fn without_the_lease_the_canary_is_not_judged() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    store.books().lease_free = false;
    let mut harness = Harness::start(&store);
    for second in 1..=12 {
        harness.serve(1, 1, 20, 0);
        until(&store, Duration::from_secs(second) + ms(500)).await;
    }
    assert!(store.judged_at(1).is_empty());
    assert!(store.moves().is_empty());
    assert!(!harness.canaries.judges(1));
    assert!(!harness.told());
    // Every turn asked for the lease of the progressing canary.
    assert_eq!(store.books().lease_calls.len(), 12);
    assert!(store.books().lease_calls.iter().all(|(_, ids)| ids == &[1]));
    // The lease comes free: the interval long over, the next turn judges it.
    store.books().lease_free = true;
    until(&store, ms(13_500)).await;
    assert!(harness.canaries.judges(1));
    let moves = store.moves();
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(store.since_start(moves[0].at_ms), 13_000);
    assert_eq!(moves[0].to.step, 1);
}

#[tokio::test(start_paused = true)]
async fn an_interval_is_judged_once_over_and_not_read_long_before() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    let mut harness = Harness::start(&store);
    harness.serve(1, 0, 180, 0);
    harness.serve(1, 1, 20, 0);
    until(&store, ms(4_500)).await;
    assert!(store.moves().is_empty());
    assert!(!harness.told());
    assert!(harness.canaries.judges(1), "it holds the lease");
    // Read at the first turn (the store's clock unknown yet), then not until a second before
    // the interval ends by the store's clock.
    assert_eq!(store.judged_at(1), vec![1_000, 4_000]);
    until(&store, ms(5_500)).await;
    let moves = store.moves();
    assert_eq!(moves.len(), 1);
    let moved = &moves[0];
    assert_eq!(
        store.since_start(moved.at_ms),
        5_000,
        "at the interval's end"
    );
    assert_eq!(moved.from_round, 1);
    assert_eq!(
        (moved.to.state, moved.to.step, moved.to.weight),
        (CanaryState::Progressing, 1, 50)
    );
    let counts: Vec<(u64, u64)> = moved
        .counts
        .iter()
        .map(|counts| (counts.requests, counts.errors))
        .collect();
    assert_eq!(counts, vec![(180, 0), (20, 0)]);
    assert_eq!(moved.counts[1].p99_ms, Some(2.0));
    assert_eq!(store.status(1).round, 2);
    assert!(harness.told(), "the control task hears of the move");
    assert_eq!(
        harness.applied_weight(1),
        10,
        "until the control task applies it"
    );
    harness.apply();
    assert_eq!(harness.applied_weight(1), 50);
}

/// Runs the harness to `at` (after the start), applying every move as the control task would
/// the moment it is told.
async fn run_applying(harness: &mut Harness, at: Duration) {
    let end = harness.store.origin + at;
    loop {
        tokio::select! {
            told = harness.moved.recv() => {
                told.expect("the task runs");
                harness.apply();
            }
            _ = tokio::time::sleep_until(end) => return,
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_canary_steps_holds_and_is_promoted_then_is_left_alone() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    let mut harness = Harness::start(&store);
    // Interval 1 (0–5 s): in bounds; 2 (5–10 s): 9 requests, too few; 3 (10–15 s) and 4
    // (15–20 s): in bounds.
    let served = [(0, 20), (5, 9), (10, 30), (15, 40)];
    for (start, canary_requests) in served {
        run_applying(&mut harness, Duration::from_secs(start) + ms(200)).await;
        harness.serve(1, 1, canary_requests, 0);
        harness.serve(1, 0, 100, 0);
    }
    run_applying(&mut harness, ms(20_500)).await;
    let moves = store.moves();
    let seen: Vec<(i64, i64, CanaryState, u32, u8, u64)> = moves
        .iter()
        .map(|moved| {
            (
                store.since_start(moved.at_ms),
                moved.from_round,
                moved.to.state,
                moved.to.step,
                moved.to.weight,
                moved.counts[1].requests,
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (5_000, 1, CanaryState::Progressing, 1, 50, 20),
            (10_000, 2, CanaryState::Progressing, 1, 50, 9),
            (15_000, 3, CanaryState::Progressing, 2, 100, 30),
            (20_000, 4, CanaryState::Promoted, 2, 100, 40),
        ]
    );
    assert!(moves.iter().all(|moved| moved.route_id == 1));
    assert!(moves[1].to.reason.contains("9 requests < min_requests 10"));
    assert_eq!(harness.applied_weight(1), 100);
    // Promoted: no lease asked for, nothing read, however long.
    let asked = store.books().lease_calls.len();
    let read = store.judged_at(1).len();
    harness.serve(1, 1, 500, 500);
    run_applying(&mut harness, ms(40_500)).await;
    assert_eq!(store.moves().len(), 4);
    assert_eq!(store.judged_at(1).len(), read);
    let books = store.books();
    assert!(books.lease_calls[asked..]
        .iter()
        .all(|(_, ids)| ids.is_empty()));
    drop(books);
    assert!(!harness.canaries.judges(1));
}

#[tokio::test(start_paused = true)]
async fn errors_over_bounds_roll_the_canary_back_at_the_interval_end_for_good() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 1, 3, Duration::ZERO);
    let mut harness = Harness::start(&store);
    assert_eq!(harness.applied_weight(1), 50);
    // 10 % errors, spread over the interval.
    for second in 0..5 {
        run_applying(&mut harness, Duration::from_secs(second) + ms(100)).await;
        harness.serve(1, 1, 20, 2);
    }
    run_applying(&mut harness, ms(4_900)).await;
    assert!(store.moves().is_empty(), "judged at the interval end only");
    run_applying(&mut harness, ms(5_500)).await;
    let moves = store.moves();
    assert_eq!(moves.len(), 1);
    assert_eq!(
        (moves[0].from_round, moves[0].to.state, moves[0].to.weight),
        (3, CanaryState::RolledBack, 0)
    );
    assert_eq!(
        (moves[0].counts[1].requests, moves[0].counts[1].errors),
        (100, 10)
    );
    assert!(
        moves[0].to.reason.contains("10.00 % errors"),
        "{}",
        moves[0].to.reason
    );
    assert_eq!(harness.applied_weight(1), 0);
    run_applying(&mut harness, ms(30_500)).await;
    assert_eq!(
        store.moves().len(),
        1,
        "a rolled-back canary stays where it is"
    );
}

#[tokio::test(start_paused = true)]
async fn a_paused_canary_is_neither_leased_nor_judged() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Paused, 1, 2, Duration::from_secs(60));
    let mut harness = Harness::start(&store);
    harness.serve(1, 1, 100, 50);
    run_applying(&mut harness, ms(12_500)).await;
    assert!(store.moves().is_empty());
    assert!(store.judged_at(1).is_empty());
    assert!(store
        .books()
        .lease_calls
        .iter()
        .all(|(_, ids)| ids.is_empty()));
    // Its counts are still flushed: the view shows them.
    assert_eq!(store.stored(1, 1), (100, 50));
    assert_eq!(harness.applied_weight(1), 50);
}

#[tokio::test(start_paused = true)]
async fn a_restart_mid_step_judges_at_the_original_interval_end() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 1, 4, Duration::ZERO);
    let mut first = Harness::start(&store);
    first.serve(1, 1, 6, 0);
    run_applying(&mut first, ms(2_100)).await;
    assert_eq!(store.stored(1, 1), (6, 0));
    // The process dies 2.5 s into the interval; a new one starts on the same store.
    run_applying(&mut first, ms(2_500)).await;
    drop(first.task.take());
    drop(first);
    let mut second = Harness::start(&store);
    assert_eq!(
        second.applied_weight(1),
        50,
        "the step in force is the store's"
    );
    second.serve(1, 1, 6, 0);
    run_applying(&mut second, ms(4_900)).await;
    assert!(store.moves().is_empty());
    run_applying(&mut second, ms(6_500)).await;
    let moves = store.moves();
    assert_eq!(moves.len(), 1, "{moves:?}");
    // Its first turn after the original end (turns at 3.5, 4.5, 5.5 s), not 5 s after the
    // restart; on the counts of both processes.
    assert_eq!(store.since_start(moves[0].at_ms), 5_500);
    assert_eq!(moves[0].from_round, 4);
    assert_eq!(
        (moves[0].to.state, moves[0].to.step, moves[0].to.weight),
        (CanaryState::Progressing, 2, 100)
    );
    assert_eq!(moves[0].counts[1].requests, 12);
    assert_eq!(second.applied_weight(1), 100);
}
#[tokio::test(start_paused = true)]
async fn an_interval_whose_counts_did_not_reach_the_store_is_not_judged() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    let mut harness = Harness::start(&store);
    harness.serve(1, 1, 40, 0);
    run_applying(&mut harness, ms(4_500)).await;
    // The errors of the interval's last second are taken at 5 s, and that flush fails: the
    // interval is not judged without them...
    harness.serve(1, 1, 10, 10);
    store.books().failing_flushes = 1;
    run_applying(&mut harness, ms(5_500)).await;
    assert!(store.moves().is_empty(), "{:?}", store.moves());
    // ... but at the next turn, with them.
    run_applying(&mut harness, ms(6_500)).await;
    let moves = store.moves();
    assert_eq!(moves.len(), 1);
    assert_eq!(moves[0].to.state, CanaryState::RolledBack);
    assert_eq!(
        (moves[0].counts[1].requests, moves[0].counts[1].errors),
        (50, 10)
    );
}
#[tokio::test(start_paused = true)]
async fn a_route_that_cannot_be_judged_neither_holds_nor_hides_the_others() {
    let store = FakeStore::new();
    for route_id in 1..=3 {
        store.set_canary(route_id, CanaryState::Progressing, 0, 1, Duration::ZERO);
    }
    store.books().failing_judged.insert(2);
    let mut harness = Harness::start(&store);
    for route_id in 1..=3 {
        harness.serve(route_id, 1, 20, 0);
    }
    until(&store, ms(5_500)).await;
    let moved: Vec<Id> = store.moves().iter().map(|moved| moved.route_id).collect();
    assert_eq!(moved, vec![1, 3], "route 3 is judged after route 2 failed");
    assert!(harness.canaries.last_error().is_some());
    assert!(
        harness.told(),
        "routes 1 and 3 moved: this gateway must apply them though route 2 failed"
    );
}

#[tokio::test(start_paused = true)]
async fn counts_held_through_an_outage_stay_in_the_round_they_were_served_in() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    store.books().lease_free = false;
    store.books().failing_flushes = 1;
    let mut harness = Harness::start(&store);
    // Served at round 1, all failing; the flush fails and the counts are kept.
    harness.serve(1, 1, 10, 10);
    until(&store, ms(1_500)).await;
    assert_eq!(store.stored(1, 1), (0, 0));
    // An operator's action moves the canary to round 2 meanwhile; this gateway applies it.
    store.set_canary(1, CanaryState::Progressing, 1, 2, Duration::ZERO);
    harness.apply();
    harness.serve(1, 1, 5, 0);
    until(&store, ms(2_500)).await;
    let rounds: BTreeMap<i64, (u64, u64)> =
        store
            .books()
            .counts
            .iter()
            .fold(BTreeMap::new(), |mut rounds, (_, report)| {
                let entry = rounds.entry(report.round).or_insert((0, 0));
                entry.0 += report.counts.requests;
                entry.1 += report.counts.errors;
                rounds
            });
    assert_eq!(
        rounds,
        BTreeMap::from([(1, (10, 10)), (2, (5, 0))]),
        "the old round's errors are not judged with the new step"
    );
}

#[tokio::test(start_paused = true)]
async fn a_gateway_whose_configuration_lags_the_store_does_not_judge() {
    let store = FakeStore::new();
    // The store's canary was started for other steps than this gateway's snapshot says.
    store.set_canary(1, CanaryState::Progressing, 0, 1, INTERVAL);
    let mut other = task_canary();
    other.steps = vec![20, 100];
    let key = canary_key(&other, &[Backend::whole(1), Backend::whole(2)]);
    store.books().spec_override = Some(key);
    let mut harness = Harness::start(&store);
    for second in 1..=3 {
        harness.serve(1, 1, 20, 0);
        until(&store, Duration::from_secs(second) + ms(500)).await;
    }
    assert!(!store.judged_at(1).is_empty(), "it read the canary");
    assert!(
        store.moves().is_empty(),
        "and judged nothing on its old steps"
    );
    assert!(!harness.told());
    // Once its configuration agrees, the due interval is judged.
    store.books().spec_override = None;
    until(&store, ms(4_500)).await;
    assert_eq!(store.moves().len(), 1);
}

#[test]
fn a_p99_rolls_back_only_when_its_whole_bucket_is_above_the_bound() {
    let mut canary = canary();
    canary.max_p99_ms = Some(1_000);
    let at = status(CanaryState::Progressing, 1, 25);
    // 900 ms: its bucket reaches past 1,000 ms, but the p99 may be below it: not rolled back.
    let moved = judge(&canary, &at, &counts(1000, 0, 900));
    assert_eq!(moved.state, CanaryState::Progressing, "{}", moved.reason);
    // 1,300 ms: the bucket lies above the bound.
    let moved = judge(&canary, &at, &counts(1000, 0, 1_300));
    assert_eq!(moved.state, CanaryState::RolledBack, "{}", moved.reason);
    assert!(moved.reason.contains("max_p99_ms 1000"), "{}", moved.reason);
}

#[test]
fn a_hold_without_any_canary_request_says_why() {
    let moved = judge(
        &canary(),
        &status(CanaryState::Progressing, 1, 25),
        &counts(0, 0, 5),
    );
    assert_eq!(moved.state, CanaryState::Progressing);
    assert!(
        moved.reason.contains("none reached the canary backend"),
        "{}",
        moved.reason
    );
}

#[tokio::test(start_paused = true)]
async fn an_interval_is_judged_a_grace_after_its_end_with_the_others_last_counts() {
    let store = FakeStore::new();
    store.set_canary(1, CanaryState::Progressing, 0, 1, Duration::ZERO);
    let harness = Harness::start_with_grace(&store, ROUND_GRACE);
    harness.serve(1, 1, 20, 0);
    until(&store, ms(5_500)).await;
    assert!(store.moves().is_empty(), "not at the interval's end (5 s)");
    // Another gateway's last second of the interval, flushed after its end: 20 errors.
    store.books().counts.push((
        store.now_ms(),
        CountsReport {
            route_id: 1,
            round: 1,
            backend: 1,
            counts: CanaryCounts {
                requests: 20,
                errors: 20,
                latency: vec![20],
            },
        },
    ));
    until(&store, ms(7_500)).await;
    let moves = store.moves();
    assert_eq!(moves.len(), 1);
    assert_eq!(
        store.since_start(moves[0].at_ms),
        7_000,
        "5 s + 1.5 s, at the next turn"
    );
    assert_eq!(
        moves[0].to.state,
        CanaryState::RolledBack,
        "judged with the late counts: {}",
        moves[0].to.reason
    );
}
