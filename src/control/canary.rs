//! Canary analysis (TRAFFIC.md §4): every second this task takes the outcomes each canary
//! route's backends saw on this gateway and adds them to the store; for the routes whose canary
//! lease it holds, once an interval is over by the store's clock, it judges the sum of every
//! gateway's counts and moves the canary (the next step, a hold, promoted or rolled back). A
//! move is a configuration change: every gateway, this one included, applies it on its next
//! reload, within a second.
//!
//! The request path never waits for any of it: it adds to atomics in the route's counters. The
//! task is its own tokio task, so a slow store delays no reload; while the store fails, counts
//! are kept (and added once it answers) and no canary moves.

mod judge;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub use judge::{interval_over, judge};

use super::ControlError;
use crate::model::{
    Canary, CanaryCounts, CanaryMove, CanaryState, CanaryStatus, Id, IntervalCounts,
};
use crate::snapshot::{CanaryCounters, SnapshotHandle};
use crate::store::{canary_key, CountsReport, JudgedCanary, Store, StoreError};

/// How often counts are added to the store and due intervals judged.
pub const CANARY_SYNC: Duration = Duration::from_secs(1);

/// How long after an interval's end it is judged (at most a quarter of the interval): every
/// gateway flushes once a second, so by then the others' counts of the interval's last second
/// are in the store too (a judgement at the end itself would see only the judge's own).
pub const ROUND_GRACE: Duration = Duration::from_millis(1_500);

/// Where the counts go and the verdicts come from: the store, or a fake in tests.
pub trait CanaryStore: Send + Sync + 'static {
    fn add_counts(
        &self,
        reports: &[CountsReport],
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    fn take_leases(
        &self,
        route_ids: &[Id],
        period: Duration,
    ) -> impl Future<Output = Result<Vec<Id>, StoreError>> + Send;

    fn judged(
        &self,
        route_id: Id,
    ) -> impl Future<Output = Result<Option<JudgedCanary>, StoreError>> + Send;

    fn move_canary(
        &self,
        route_id: Id,
        from_round: i64,
        moved: &CanaryMove,
        counts: &[IntervalCounts],
    ) -> impl Future<Output = Result<Option<CanaryStatus>, StoreError>> + Send;

    fn release(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

impl CanaryStore for Store {
    async fn add_counts(&self, reports: &[CountsReport]) -> Result<(), StoreError> {
        self.add_canary_counts(reports).await
    }

    async fn take_leases(&self, route_ids: &[Id], period: Duration) -> Result<Vec<Id>, StoreError> {
        self.take_canary_leases(route_ids, period).await
    }

    async fn judged(&self, route_id: Id) -> Result<Option<JudgedCanary>, StoreError> {
        self.judged_canary(route_id).await
    }

    async fn move_canary(
        &self,
        route_id: Id,
        from_round: i64,
        moved: &CanaryMove,
        counts: &[IntervalCounts],
    ) -> Result<Option<CanaryStatus>, StoreError> {
        Store::move_canary(self, route_id, from_round, moved, counts).await
    }

    async fn release(&self) -> Result<(), StoreError> {
        self.release_canary_leases().await
    }
}

/// What the task last knew, for the admin view and metrics; never touched by the request path.
#[derive(Debug, Default)]
struct Shared {
    /// Routes whose canary this gateway judges.
    held: Mutex<HashSet<Id>>,
    last_error: Mutex<Option<String>>,
    failures: AtomicU64,
    stopped: AtomicBool,
}

/// A cheap handle on the canary task.
#[derive(Debug, Clone, Default)]
pub struct Canaries {
    shared: Arc<Shared>,
}

impl Canaries {
    /// Whether this gateway holds the route's canary lease (it judges the canary).
    pub fn judges(&self, route_id: Id) -> bool {
        lock(&self.shared.held).contains(&route_id)
    }

    /// Why the last exchange with the store failed, while it fails.
    pub fn last_error(&self) -> Option<String> {
        lock(&self.shared.last_error).clone()
    }

    /// Exchanges with the store that failed.
    pub fn failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    /// Stops judging (graceful shutdown): no lease is taken again, so the caller may free them.
    pub fn stop_judging(&self) {
        self.shared.stopped.store(true, Ordering::Relaxed);
        lock(&self.shared.held).clear();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Aborts the task when dropped: it ends with the control task.
pub(super) struct CanaryTask(JoinHandle<()>);

impl Drop for CanaryTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts the task; its first turn is one [`CANARY_SYNC`] from now. `moved` hears of every
/// canary it moved, so this gateway reloads at once (others hear of it through the store).
pub(super) fn spawn<S: CanaryStore>(
    store: S,
    snapshots: SnapshotHandle,
    lease: Duration,
    grace: Duration,
    moved: mpsc::Sender<()>,
) -> (Canaries, CanaryTask) {
    let canaries = Canaries::default();
    let judge = Judge {
        store,
        snapshots,
        // Renewed every second: a shorter lease would lapse between renewals and pass from
        // gateway to gateway.
        lease: lease.max(CANARY_SYNC * 3),
        moved,
        shared: canaries.shared.clone(),
        unsent: HashMap::new(),
        store_clock: None,
        grace_ms: i64::try_from(grace.as_millis()).unwrap_or(i64::MAX),
        mismatched: HashSet::new(),
    };
    let join = tokio::spawn(judge.run());
    (canaries, CanaryTask(join))
}

/// A canary route of the live snapshot.
struct Followed {
    route_id: Id,
    /// What the canary was started for ([`canary_key`]): judged only while the store says the
    /// same, so a gateway whose reloads lag never judges a new canary by its old steps.
    key: String,
    canary: Canary,
    status: CanaryStatus,
    counters: Arc<CanaryCounters>,
}

struct Judge<S> {
    store: S,
    snapshots: SnapshotHandle,
    lease: Duration,
    moved: mpsc::Sender<()>,
    shared: Arc<Shared>,
    /// Counts taken but not yet in the store (a flush failed), by route, round and backend: kept
    /// in the round they were served in, so counts held through an outage are never judged
    /// with a later step's.
    unsent: HashMap<(Id, i64, u32), CanaryCounts>,
    /// The store's clock as last read (from the last judged canary) and when: an interval not
    /// yet over by that reading plus the monotonic time since is not read. Monotonic, not the
    /// wall clock: a wall-clock step back would otherwise hold every judgement by as much.
    store_clock: Option<(i64, Instant)>,
    /// [`ROUND_GRACE`] in milliseconds.
    grace_ms: i64,
    /// Routes whose stored canary differs from this gateway's snapshot, warned about once.
    mismatched: HashSet<Id>,
}

impl<S: CanaryStore> Judge<S> {
    async fn run(mut self) {
        let mut ticks = tokio::time::interval_at(Instant::now() + CANARY_SYNC, CANARY_SYNC);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            self.turn().await;
        }
    }

    fn followed(&self) -> Vec<Followed> {
        let snapshot = self.snapshots.load_full();
        snapshot
            .routes()
            .into_iter()
            .filter_map(|entry| {
                let canary = entry.route.canary.clone()?;
                Some(Followed {
                    route_id: entry.route.id,
                    key: canary_key(&canary, &entry.route.backends),
                    canary,
                    status: entry.route.canary_status.clone()?,
                    counters: entry.canary.clone()?,
                })
            })
            .collect()
    }

    async fn turn(&mut self) {
        let routes = self.followed();
        let flushed = self.flush(&routes).await;
        // An interval is judged only once this gateway's counts are in the store: judged
        // without them (a flush failed), the errors they hold could be missed and the canary
        // stepped up on the rest.
        let stopped = self.shared.stopped.load(Ordering::Relaxed);
        if stopped {
            lock(&self.shared.held).clear();
        }
        let judged = if stopped || flushed.is_err() {
            Ok(())
        } else {
            self.judge_due(&routes).await
        };
        match flushed.and(judged) {
            Ok(()) => {
                if lock(&self.shared.last_error).take().is_some() {
                    tracing::info!("canary counts reach the store again");
                }
            }
            Err(error) => {
                self.shared.failures.fetch_add(1, Ordering::Relaxed);
                let mut last_error = lock(&self.shared.last_error);
                if last_error.is_none() {
                    tracing::warn!(%error, "cannot exchange canary counts through the store; \
                        canaries hold their weights until it answers");
                }
                *last_error = Some(error.to_string());
            }
        }
    }

    /// Adds every route's new outcomes (and any a failed flush kept) to the store.
    async fn flush(&mut self, routes: &[Followed]) -> Result<(), ControlError> {
        let live: HashSet<Id> = routes.iter().map(|route| route.route_id).collect();
        self.unsent
            .retain(|(route_id, _, _), _| live.contains(route_id));
        for route in routes {
            for (backend, counts) in route.counters.take().into_iter().enumerate() {
                if counts.is_empty() {
                    continue;
                }
                let backend = u32::try_from(backend).unwrap_or(u32::MAX);
                self.unsent
                    .entry((route.route_id, route.status.round, backend))
                    .or_default()
                    .add(&counts);
            }
        }
        if self.unsent.is_empty() {
            return Ok(());
        }
        let reports: Vec<CountsReport> = self
            .unsent
            .iter()
            .map(|(&(route_id, round, backend), counts)| CountsReport {
                route_id,
                round,
                backend,
                counts: counts.clone(),
            })
            .collect();
        match tokio::time::timeout(CANARY_SYNC * 3, self.store.add_counts(&reports)).await {
            Ok(Ok(())) => {
                self.unsent.clear();
                Ok(())
            }
            Ok(Err(error)) => Err(error.into()),
            Err(_) => Err(ControlError::CanaryFlushTimeout(CANARY_SYNC * 3)),
        }
    }

    /// Renews the leases of the progressing canaries and judges those whose interval is over.
    async fn judge_due(&mut self, routes: &[Followed]) -> Result<(), ControlError> {
        let progressing: Vec<&Followed> = routes
            .iter()
            .filter(|route| route.status.state == CanaryState::Progressing)
            .collect();
        let ids: Vec<Id> = progressing.iter().map(|route| route.route_id).collect();
        let held: HashSet<Id> = self
            .store
            .take_leases(&ids, self.lease)
            .await?
            .into_iter()
            .collect();
        if self.shared.stopped.load(Ordering::Relaxed) {
            // Stopped while taking them (a graceful shutdown released the leases meanwhile):
            // free them again, so the next gateway judges at once, not after a lease.
            self.store.release().await?;
            return Ok(());
        }
        *lock(&self.shared.held) = held.clone();
        let mut moved_any = false;
        let mut failed = None;
        for route in progressing {
            if !held.contains(&route.route_id) || !self.may_be_due(route) {
                continue;
            }
            // One route's failure neither holds the others back nor hides their moves: on
            // SQLite this notice is the only way this gateway hears of them.
            match self.judge_one(route).await {
                Ok(moved) => moved_any |= moved,
                Err(error) => {
                    failed.get_or_insert(error);
                }
            }
        }
        if moved_any {
            // Full: a reload is coming anyway.
            let _ = self.moved.try_send(());
        }
        failed.map_or(Ok(()), |error| Err(error.into()))
    }

    /// The wait after an interval's end: [`ROUND_GRACE`], but at most a quarter of a short
    /// interval, so a bad one is still rolled back within two.
    fn grace_for(&self, canary: &Canary) -> i64 {
        let quarter = i64::try_from(canary.step_interval_ms / 4).unwrap_or(i64::MAX);
        self.grace_ms.min(quarter)
    }

    /// Whether the route's interval may be over by the store's clock as last estimated.
    fn may_be_due(&self, route: &Followed) -> bool {
        let Some((read_ms, read_at)) = self.store_clock else {
            return true;
        };
        let since = i64::try_from(read_at.elapsed().as_millis()).unwrap_or(i64::MAX);
        let estimated_now = read_ms.saturating_add(since);
        // A second early rather than late: the store's clock decides.
        interval_over(
            &route.canary,
            &route.status,
            estimated_now
                .saturating_add(1_000)
                .saturating_sub(self.grace_for(&route.canary)),
        )
    }

    async fn judge_one(&mut self, route: &Followed) -> Result<bool, StoreError> {
        let Some(judged) = self.store.judged(route.route_id).await? else {
            return Ok(false);
        };
        self.store_clock = Some((judged.now_ms, Instant::now()));
        if judged.spec != route.key {
            if self.mismatched.insert(route.route_id) {
                tracing::warn!(
                    route_id = route.route_id,
                    "this gateway's configuration of the canary is behind the store's; \
                     it is not judged here until the next reload"
                );
            }
            return Ok(false);
        }
        self.mismatched.remove(&route.route_id);
        let judged_at = judged.now_ms.saturating_sub(self.grace_for(&route.canary));
        if !interval_over(&route.canary, &judged.status, judged_at) {
            return Ok(false);
        }
        let backends = route.counters.backends().max(judged.counts.len());
        let counts: Vec<CanaryCounts> = (0..backends)
            .map(|backend| judged.counts.get(backend).cloned().unwrap_or_default())
            .collect();
        let moved = judge(
            &route.canary,
            &judged.status,
            &counts[route.canary.backend_index()],
        );
        let summary: Vec<IntervalCounts> = counts.iter().map(IntervalCounts::of).collect();
        let status = self
            .store
            .move_canary(route.route_id, judged.status.round, &moved, &summary)
            .await?;
        if status.is_some() {
            tracing::info!(
                route_id = route.route_id,
                state = moved.state.as_str(),
                weight = moved.weight,
                reason = %moved.reason,
                "canary moved"
            );
        }
        Ok(status.is_some())
    }
}
