//! The control task's side of discovery: refresh loops per source, applying their outcomes,
//! removal-grace and stale timers.
//!
//! Every source has a lease in the store; only the instance holding it runs the source's loop and
//! timers and writes its results (the store also refuses a result from an instance that lost the
//! lease). Other instances only track the source, bid for its lease every third of a lease
//! period, and take it over (with the stored progress and schedule) once it is free or expired.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{ControlError, ControlTask, MovedSources, RefreshAnswer};
use crate::discovery::lifecycle::{self, Transition};
use crate::discovery::runner::{self, RefreshOutcome, RunnerHandle, RunnerSpec};
use crate::discovery::{self, reconcile};
use crate::model::{
    DiscoverySource, Id, RemovalAcceptance, SourceProgress, SourceState, TargetChange,
};
use crate::store::{ChangeSet, StoreError};

pub(super) struct SourceEntry {
    pub(super) source: DiscoverySource,
    pub(super) progress: SourceProgress,
    /// None while disabled (or when its config cannot build a provider).
    pub(super) runner: Option<RunnerHandle>,
    /// Earliest removal deadline among its draining targets.
    pub(super) next_removal: Option<DateTime<Utc>>,
    /// Until when this instance holds the source's lease, judged conservatively from the start
    /// of the request that took or renewed it. None: another instance (or nobody) holds it.
    lease_until: Option<tokio::time::Instant>,
    /// While the removal guard holds: when to read the registry again.
    pub(super) guard_reread_at: Option<DateTime<Utc>>,
    /// The last acceptance of held removals this instance applied, for the source's events.
    pub(super) acceptance: Option<RemovalAcceptance>,
}

impl SourceEntry {
    pub(super) fn removal_grace(&self) -> Duration {
        Duration::from_millis(self.source.removal_grace_ms)
    }

    fn stale_after(&self) -> Duration {
        Duration::from_millis(self.source.stale_after_ms)
    }

    pub(super) fn lease_until(&self) -> Option<tokio::time::Instant> {
        self.lease_until
    }

    pub(super) fn holds_lease(&self) -> bool {
        self.lease_until
            .is_some_and(|until| until > tokio::time::Instant::now())
    }

    /// The earliest of its removal, stale and guard re-read deadlines; None unless this
    /// instance holds its lease, since only the holder runs a source's timers.
    pub(super) fn timer_deadline(&self) -> Option<DateTime<Utc>> {
        self.lease_until?;
        [
            self.next_removal,
            lifecycle::stale_deadline(&self.progress, self.stale_after()),
            self.guard_reread_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Stops the loop and timers: another instance refreshes the source now.
    fn let_go(&mut self) {
        self.runner = None;
        self.lease_until = None;
    }
}

#[cfg(test)]
impl SourceEntry {
    /// A source with no progress, no loop and no timers, held until `lease_until`.
    pub(super) fn for_tests(
        source: DiscoverySource,
        lease_until: Option<tokio::time::Instant>,
    ) -> Self {
        SourceEntry {
            source,
            progress: SourceProgress::default(),
            runner: None,
            next_removal: None,
            lease_until,
            guard_reread_at: None,
            acceptance: None,
        }
    }

    pub(super) fn set_lease_until(&mut self, lease_until: Option<tokio::time::Instant>) {
        self.lease_until = lease_until;
    }
}

/// The longest a taken-over source waits for the refresh its previous holder scheduled.
const LONGEST_TAKEOVER_DELAY: Duration = Duration::from_secs(600);

impl ControlTask {
    /// Brings the running loops of the services `scope` names in line with their stored
    /// sources. Returns whether targets changed.
    pub(super) async fn sync_sources(&mut self, scope: &ChangeSet) -> Result<bool, ControlError> {
        let stored = if scope.everything {
            self.store.all_sources().await?
        } else {
            let services: Vec<Id> = scope.services.iter().copied().collect();
            self.store.sources_of_services(&services).await?
        };
        let new_sources: Vec<Id> = stored
            .iter()
            .map(|(source, _)| source.id)
            .filter(|id| !self.sources.contains_key(id))
            .collect();
        let leases = match self.bid_for_leases(&new_sources).await {
            Ok(leases) => Some(leases),
            // The lease round bids again.
            Err(error) => {
                tracing::warn!(%error, "cannot bid for the leases of new discovery sources");
                None
            }
        };
        let lease_of = |id: Id| {
            leases
                .as_ref()
                .and_then(|(held, until)| held.contains(&id).then_some(*until))
        };
        let mut present = HashSet::new();
        let mut changed = false;
        let mut first_error = None;
        for (source, stored_progress) in stored {
            present.insert(source.id);
            let unchanged = self
                .sources
                .get(&source.id)
                .map(|entry| entry.source == source);
            let outcome = match unchanged {
                Some(true) => {
                    // Another instance refreshes it: what it stored is what this one shows.
                    if let Some(mut entry) = self.sources.get_mut(&source.id) {
                        if !entry.holds_lease() {
                            entry.progress = stored_progress;
                        }
                    }
                    continue;
                }
                Some(false) => self.reconfigure(source).await,
                None => {
                    let lease_until = lease_of(source.id);
                    self.adopt(source, stored_progress, lease_until).await
                }
            };
            match outcome {
                Ok(source_changed) => changed |= source_changed,
                Err(error) => {
                    first_error.get_or_insert(error);
                }
            }
        }
        // Deleted sources: their targets went with them in the store; dropping the entry stops
        // the loop.
        self.sources.retain(|entry| {
            present.contains(&entry.source.id) || !scope.touches_service(entry.source.service_id)
        });
        if let Ok(mut stats) = self.source_stats.write() {
            stats.retain(|id, _| self.sources.contains_key(id));
        }
        match first_error {
            Some(error) => Err(error),
            None => Ok(changed),
        }
    }

    /// Syncs sources; on a store failure, tries again in a second rather than leave a source
    /// without its loop or drain until the next admin change. Returns whether targets changed.
    pub(super) async fn sync_sources_or_retry(&mut self) -> bool {
        match self.sync_sources(&ChangeSet::everything()).await {
            Ok(changed) => {
                self.unsynced = ChangeSet::default();
                self.resync_at = None;
                self.store_failures = 0;
                changed
            }
            Err(error) => {
                self.schedule_retry();
                tracing::error!(%error, retry_at = ?self.resync_at, "discovery sources not fully applied; retrying");
                // Some sources may have changed before the failure.
                true
            }
        }
    }

    /// A source seen for the first time (created, or found at start with its saved progress).
    /// `lease_until`: until when this instance holds its lease (None: it does not, for now).
    async fn adopt(
        &mut self,
        source: DiscoverySource,
        progress: SourceProgress,
        lease_until: Option<tokio::time::Instant>,
    ) -> Result<bool, ControlError> {
        let targets = self.store.source_targets(source.id).await?;
        let mut entry = SourceEntry {
            next_removal: reconcile::next_removal(&targets),
            source,
            progress,
            runner: None,
            lease_until,
            guard_reread_at: None,
            acceptance: None,
        };
        // Kept even when enforcing fails, so its loop and timers are not lost with the error.
        let outcome = self.enforce_enabled(&mut entry, true).await;
        self.sources.insert(entry);
        outcome
    }

    /// A source whose settings changed: restart its loop with the new settings.
    async fn reconfigure(&mut self, source: DiscoverySource) -> Result<bool, ControlError> {
        let Some(mut entry) = self.sources.remove(&source.id) else {
            return Ok(false);
        };
        let was_enabled = entry.source.enabled;
        let previous = std::mem::replace(&mut entry.source, source);
        entry.runner = None;
        let outcome = self.enforce_enabled(&mut entry, was_enabled).await;
        if outcome.is_err() {
            // Still differs from the store, so the retry of the sync reconfigures it again.
            entry.source = previous;
        }
        self.sources.insert(entry);
        outcome
    }

    /// Starts the loop of an enabled source; drains and stops a disabled one.
    async fn enforce_enabled(
        &mut self,
        entry: &mut SourceEntry,
        was_enabled: bool,
    ) -> Result<bool, ControlError> {
        if !entry.holds_lease() {
            // The holder applies the change when it sees it.
            entry.runner = None;
            return Ok(false);
        }
        let now = self.clock.now();
        if entry.source.enabled {
            if entry.progress.state == SourceState::Disabled || !was_enabled {
                lifecycle::enable(&mut entry.progress, now);
            }
            entry.progress.next_refresh_at = Some(now);
            self.start_runner(entry, Duration::ZERO);
            self.store
                .save_progress(entry.source.id, &entry.progress)
                .await?;
            return Ok(false);
        }
        let mut changed = false;
        if entry.progress.state != SourceState::Disabled {
            let targets = self.store.source_targets(entry.source.id).await?;
            let changes = reconcile::drain_all(&targets, now, entry.removal_grace());
            changed = self.write_changes(entry, &changes).await?;
            lifecycle::disable(&mut entry.progress);
            forget_hold(entry);
            lifecycle::watch_gone(&mut entry.progress, now);
            self.store
                .save_progress(entry.source.id, &entry.progress)
                .await?;
            tracing::info!(
                source_id = entry.source.id,
                drained = changes.len(),
                "discovery source disabled"
            );
        }
        Ok(changed)
    }

    fn start_runner(&mut self, entry: &mut SourceEntry, first_delay: Duration) {
        // A watch stored as connected was another runner's (before a restart or a takeover).
        lifecycle::watch_gone(&mut entry.progress, self.clock.now());
        match discovery::build(entry.source.provider, &entry.source.config) {
            Ok(fetch) => {
                let generation = self.next_runner_generation;
                self.next_runner_generation += 1;
                entry.runner = Some(runner::spawn(
                    RunnerSpec {
                        source_id: entry.source.id,
                        generation,
                        fetch,
                        first_delay,
                    },
                    self.clock,
                    self.outcomes.clone(),
                ));
            }
            Err(error) => {
                // Validated on write, so only a store edited by hand gets here.
                entry.runner = None;
                entry.progress.state = SourceState::Failing;
                entry.progress.last_error = Some(format!("invalid provider config: {error}"));
                tracing::error!(source_id = entry.source.id, %error, "discovery source cannot start");
            }
        }
    }

    pub(super) async fn request_refresh(&self, source_id: Id) -> RefreshAnswer {
        let Some(entry) = self.sources.get(&source_id) else {
            return RefreshAnswer::Unknown;
        };
        if !entry.source.enabled {
            return RefreshAnswer::Disabled;
        }
        if entry.holds_lease() {
            return self.refresh_if_held(source_id);
        }
        // Another instance refreshes this source: pass the request on to it.
        match self.store.request_refresh_by_holder(source_id).await {
            Ok(()) => RefreshAnswer::Queued,
            Err(error) => {
                tracing::warn!(source_id, %error, "cannot pass the refresh request to the source's holder");
                RefreshAnswer::Joined
            }
        }
    }

    /// Refreshes a source now if this instance runs its loop.
    pub(super) fn refresh_if_held(&self, source_id: Id) -> RefreshAnswer {
        match self.sources.get(&source_id) {
            None => RefreshAnswer::Unknown,
            Some(entry) => match &entry.runner {
                None => RefreshAnswer::Disabled,
                Some(runner) if runner.request_refresh() => RefreshAnswer::Queued,
                Some(_) => RefreshAnswer::Joined,
            },
        }
    }

    /// Takes or renews the leases of `source_ids` in a few statements: the ids held now, and
    /// until when.
    async fn bid_for_leases(
        &self,
        source_ids: &[Id],
    ) -> Result<(HashSet<Id>, tokio::time::Instant), StoreError> {
        let lease = self.cluster.lease;
        let started = tokio::time::Instant::now();
        if source_ids.is_empty() {
            return Ok((HashSet::new(), started + lease));
        }
        // Bounded, so a hanging database cannot keep the control task past the lease's end.
        match tokio::time::timeout(lease / 2, self.store.take_source_leases(source_ids, lease))
            .await
        {
            Ok(Ok(held)) => Ok((held, started + lease)),
            Ok(Err(error)) => Err(error),
            Err(_) => Err(StoreError::Database(sqlx::Error::PoolTimedOut)),
        }
    }

    /// Renews held leases, bids for free and expired ones, takes over the sources it wins and
    /// lets go of those another instance holds. Returns whether targets changed.
    pub(super) async fn lease_round(&mut self) -> bool {
        let mut ids = self.sources.ids();
        ids.sort_unstable();
        let (held, until) = match self.bid_for_leases(&ids).await {
            Ok(leases) => leases,
            Err(error) => {
                tracing::warn!(%error, "cannot renew discovery source leases");
                self.expire_leases();
                return false;
            }
        };
        let mut changed = false;
        let mut taken_over = Vec::new();
        for id in ids {
            let Some(mut entry) = self.sources.remove(&id) else {
                continue;
            };
            if held.contains(&id) {
                let gained = entry.lease_until.is_none();
                entry.lease_until = Some(until);
                if gained {
                    match self.take_over(&mut entry).await {
                        Ok(source_changed) => {
                            changed |= source_changed;
                            taken_over.push(id);
                        }
                        Err(error) => {
                            tracing::error!(source_id = id, %error, "cannot take the discovery source over; retrying at the next lease round");
                            entry.let_go();
                        }
                    }
                }
            } else {
                if entry.lease_until.is_some() {
                    tracing::info!(
                        source_id = id,
                        "another instance refreshes this discovery source now"
                    );
                }
                entry.let_go();
            }
            self.sources.insert(entry);
        }
        self.expire_leases();
        // An acceptance the previous holder did not apply (it died, or missed the notification)
        // is applied by the new one.
        for id in taken_over {
            self.accept_if_held(id).await;
        }
        changed
    }

    /// Stops every loop and frees the leases this instance holds. The lease round is pushed past
    /// the shutdown so the sources are not taken back meanwhile.
    pub(super) async fn release_leases(&mut self) {
        self.lease_round_at = tokio::time::Instant::now() + Duration::from_secs(3600);
        self.canaries.stop_judging();
        if let Err(error) = self.store.release_canary_leases().await {
            tracing::warn!(%error, "cannot release the canary leases; they expire on their own");
        }
        let now = self.clock.now();
        let mut held: Vec<(Id, Option<SourceProgress>)> = Vec::new();
        self.sources.for_each_mut(|entry| {
            if entry.lease_until.is_none() {
                return;
            }
            entry.let_go();
            let watch_ended = entry.progress.watch.as_ref().is_some_and(|w| w.connected);
            lifecycle::watch_gone(&mut entry.progress, now);
            let progress = watch_ended.then(|| entry.progress.clone());
            held.push((entry.source.id, progress));
        });
        for (id, progress) in held {
            // While the lease is still ours the store takes the write; the next holder starts
            // from a watch shown as down, not from this instance's connected one.
            if let Some(progress) = progress {
                if let Err(error) = self.store.save_progress(id, &progress).await {
                    tracing::warn!(source_id = id, %error, "cannot record the watch as ended");
                }
            }
            if let Err(error) = self.store.release_source_lease(id).await {
                // It expires on its own.
                tracing::warn!(source_id = id, %error, "cannot release the discovery source lease");
                break;
            }
        }
    }

    /// Stops every source whose lease ran out without renewal (the database is unreachable): by
    /// now another instance may refresh it.
    pub(super) fn expire_leases(&mut self) {
        let now = tokio::time::Instant::now();
        for id in self.sources.leases_ended(now) {
            if let Some(mut entry) = self.sources.get_mut(&id) {
                tracing::warn!(
                    source_id = id,
                    "discovery source lease expired without renewal; no longer refreshing it"
                );
                entry.let_go();
            }
        }
    }

    /// A source whose lease this instance just won: continue where the previous holder left off
    /// (its stored progress, its next refresh time, its draining targets).
    async fn take_over(&mut self, entry: &mut SourceEntry) -> Result<bool, ControlError> {
        let id = entry.source.id;
        let (_, progress) = self.store.get_source_with_progress(id).await?;
        entry.progress = progress;
        let targets = self.store.source_targets(id).await?;
        entry.next_removal = reconcile::next_removal(&targets);
        tracing::info!(
            source_id = id,
            instance = self.store.instance_id(),
            "took the discovery source over"
        );
        if !entry.source.enabled || entry.progress.state == SourceState::Disabled {
            return self
                .enforce_enabled(entry, entry.progress.state != SourceState::Disabled)
                .await;
        }
        let now = self.clock.now();
        let first_delay = entry
            .progress
            .next_refresh_at
            .and_then(|at| (at - now).to_std().ok())
            .unwrap_or(Duration::ZERO)
            .min(LONGEST_TAKEOVER_DELAY);
        let watched = entry.progress.watch.clone();
        self.start_runner(entry, first_delay);
        if entry.progress.watch != watched {
            // The previous holder's watch is gone: say so to every instance at once.
            self.store.save_progress(id, &entry.progress).await?;
        }
        Ok(false)
    }

    fn count_refresh(&self, outcome: &RefreshOutcome) {
        let Ok(mut all) = self.source_stats.write() else {
            return;
        };
        let stats = all.entry(outcome.source_id).or_default();
        stats.refreshes.fetch_add(1, Ordering::Relaxed);
        if outcome.result.is_err() {
            stats.failures.fetch_add(1, Ordering::Relaxed);
        }
        stats
            .duration_micros
            .fetch_add(outcome.duration.as_micros() as u64, Ordering::Relaxed);
    }

    /// Applies one refresh result. Returns whether targets changed (a rebuild is due).
    pub(super) async fn handle_outcome(&mut self, outcome: RefreshOutcome) -> bool {
        let Some(mut entry) = self.sources.remove(&outcome.source_id) else {
            return false;
        };
        let current = entry.runner.as_ref().map(|runner| runner.generation);
        if current == Some(outcome.generation) {
            self.count_refresh(&outcome);
        }
        let changed = if current == Some(outcome.generation) {
            match self.apply_outcome(&mut entry, outcome).await {
                Ok(changed) => changed,
                Err(error) if error.is_lease_lost() => {
                    tracing::info!(source_id = entry.source.id, %error, "lost the discovery source lease");
                    entry.let_go();
                    false
                }
                Err(error) => {
                    // Reconcile reads the stored targets each time, so the next refresh repairs
                    // this; a watch must be told, or it would not report an unchanged set again.
                    tracing::error!(source_id = entry.source.id, %error, "refresh result not stored");
                    if let Some(runner) = &entry.runner {
                        runner.report_next_answer();
                    }
                    false
                }
            }
        } else {
            false
        };
        self.sources.insert(entry);
        changed
    }

    async fn apply_outcome(
        &mut self,
        entry: &mut SourceEntry,
        outcome: RefreshOutcome,
    ) -> Result<bool, StoreError> {
        let now = outcome.finished_at;
        if outcome.watch.is_some() {
            entry.progress.watch = outcome.watch;
        }
        // Restored when the store refuses the write, so the hold is not ahead of the targets.
        let guard_before = (entry.progress.guard.clone(), entry.guard_reread_at);
        // A change of state changes which 503 the service answers (discovery_unavailable).
        let state_changed;
        // The targets the changes were made from, when read here.
        let mut read = None;
        let changes = match outcome.result {
            Ok(discovered) => {
                let targets = self.store.source_targets(entry.source.id).await?;
                let endpoints = self.judge_removals(entry, &targets, &discovered, now);
                let changes =
                    reconcile::reconcile(&targets, &endpoints, now, entry.removal_grace());
                let transition = lifecycle::record_success(
                    &mut entry.progress,
                    now,
                    discovered.revision,
                    outcome.next_refresh_at,
                );
                lifecycle::record_refusals(&mut entry.progress, discovered.refused.as_deref());
                if let Some(refused) = &discovered.refused {
                    tracing::warn!(
                        source_id = entry.source.id,
                        refused,
                        "discovery left entries out"
                    );
                }
                state_changed = transition != Transition::Unchanged;
                if transition != Transition::Unchanged || !changes.is_empty() {
                    tracing::info!(
                        source_id = entry.source.id,
                        endpoints = discovered.endpoints.len(),
                        changes = changes.len(),
                        "discovery refresh applied"
                    );
                }
                read = Some(targets);
                changes
            }
            Err(error) => {
                let stale_after = entry.stale_after();
                let repeated = entry.progress.last_error.as_deref() == Some(&error.to_string());
                let transition = lifecycle::record_failure(
                    &mut entry.progress,
                    now,
                    &error,
                    stale_after,
                    outcome.next_refresh_at,
                );
                state_changed = transition != Transition::Unchanged;
                // Once per change of error or state, not on every retry of the same failure.
                if repeated && transition == Transition::Unchanged {
                    tracing::debug!(source_id = entry.source.id, %error, "discovery refresh failed again");
                } else {
                    tracing::warn!(source_id = entry.source.id, %error, state = entry.progress.state.as_str(), "discovery refresh failed");
                }
                // Whenever stale, not only on the transition: a store failure on that first
                // write must not leave the targets of a stale source active.
                if entry.progress.state == SourceState::Stale {
                    forget_hold(entry);
                    self.stale_changes(entry, transition).await?
                } else {
                    Vec::new()
                }
            }
        };
        let written = self
            .store
            .apply_refresh(
                entry.source.service_id,
                entry.source.id,
                &changes,
                Some(&entry.progress),
            )
            .await;
        if let Err(error) = written {
            (entry.progress.guard, entry.guard_reread_at) = guard_before;
            return Err(error);
        }
        let changed = match read {
            // Only this task writes the source's targets (it holds the lease): no read back.
            Some(targets) if !changes.is_empty() => {
                entry.next_removal = reconcile::next_removal_after(&targets, &changes);
                true
            }
            Some(_) => false,
            None => self.after_changes(entry, &changes).await?,
        };
        Ok(changed || state_changed)
    }

    /// Stale targets of a source that just turned stale.
    async fn stale_changes(
        &self,
        entry: &SourceEntry,
        transition: Transition,
    ) -> Result<Vec<TargetChange>, StoreError> {
        let targets = self.store.source_targets(entry.source.id).await?;
        let changes = reconcile::mark_stale(&targets);
        if transition == Transition::BecameStale || !changes.is_empty() {
            tracing::warn!(
                source_id = entry.source.id,
                targets = changes.len(),
                "discovery source is stale; its targets take no new traffic"
            );
        }
        Ok(changes)
    }

    async fn mark_stale(&mut self, entry: &mut SourceEntry) -> Result<bool, StoreError> {
        let changes = self.stale_changes(entry, Transition::BecameStale).await?;
        self.write_changes(entry, &changes).await
    }

    /// Refreshes the entry's removal deadline after written changes. Returns whether any.
    pub(super) async fn after_changes(
        &self,
        entry: &mut SourceEntry,
        changes: &[TargetChange],
    ) -> Result<bool, StoreError> {
        if changes.is_empty() {
            return Ok(false);
        }
        let targets = self.store.source_targets(entry.source.id).await?;
        entry.next_removal = reconcile::next_removal(&targets);
        Ok(true)
    }

    /// Writes changes and refreshes the entry's removal deadline. Returns whether anything changed.
    async fn write_changes(
        &self,
        entry: &mut SourceEntry,
        changes: &[TargetChange],
    ) -> Result<bool, StoreError> {
        if changes.is_empty() {
            return Ok(false);
        }
        self.store
            .apply_target_changes(entry.source.service_id, entry.source.id, changes)
            .await?;
        self.after_changes(entry, changes).await
    }

    /// The earliest timer: a source's removal, stale or guard re-read deadline, a retry of the
    /// sync, or a listener to bind again.
    pub(super) fn next_timer(&self) -> Option<DateTime<Utc>> {
        [
            self.sources.next_timer(),
            self.resync_at,
            self.edge.rebind_at,
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Deletes targets whose removal grace ended and turns failing sources stale on time.
    /// Returns whether targets changed, and which sources' progress may have moved.
    pub(super) async fn run_timers(&mut self) -> (bool, MovedSources) {
        let now = self.clock.now();
        let mut changed = false;
        let mut moved = None;
        if self.resync_at.is_some_and(|due| due <= now) {
            changed = self.sync_sources_or_retry().await;
            moved = Some(MovedSources::Any);
        }
        if self.edge.rebind_at.is_some_and(|due| due <= now) {
            self.edge.bind_wanted(now);
        }
        let due = self.sources.due_timers(now);
        for &id in &due {
            let Some(mut entry) = self.sources.remove(&id) else {
                continue;
            };
            if !entry.holds_lease() {
                // Its lease may have run out since the last round: no timers without one.
                if entry.lease_until.is_some() {
                    entry.let_go();
                }
                self.sources.insert(entry);
                continue;
            }
            match self.run_source_timers(&mut entry, now).await {
                Ok(source_changed) => changed |= source_changed,
                Err(error) => {
                    tracing::error!(source_id = id, %error, "discovery timers not applied");
                    // Retry soon instead of spinning on a failing store.
                    entry.next_removal = entry
                        .next_removal
                        .map(|_| now + chrono::Duration::seconds(1));
                }
            }
            self.sources.insert(entry);
        }
        (changed, moved.unwrap_or(MovedSources::Only(due)))
    }

    async fn run_source_timers(
        &mut self,
        entry: &mut SourceEntry,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let mut changed = false;
        if entry.next_removal.is_some_and(|due| due <= now) {
            let targets = self.store.source_targets(entry.source.id).await?;
            let changes = reconcile::expire(&targets, now);
            changed |= self.write_changes(entry, &changes).await?;
            if changes.is_empty() {
                entry.next_removal = reconcile::next_removal(&targets);
            }
        }
        self.reread_holding(entry, now);
        let stale_after = entry.stale_after();
        if lifecycle::check_stale(&mut entry.progress, now, stale_after) == Transition::BecameStale
        {
            forget_hold(entry);
            self.mark_stale(entry).await?;
            // Also without targets to mark: the state names itself in discovery_unavailable.
            changed = true;
            self.store
                .save_progress(entry.source.id, &entry.progress)
                .await?;
        }
        Ok(changed)
    }
}

/// A stale or disabled source's targets no longer serve, so the guard has nothing to hold.
fn forget_hold(entry: &mut SourceEntry) {
    entry.progress.guard = None;
    entry.guard_reread_at = None;
}
