//! The control task's side of the removal guard (DESIGN §4): it judges each successful refresh
//! with [`guard::judge`] before reconcile, re-reads a holding source so the hold is confirmed or
//! ended within about `confirm_ms` whatever the source's interval, and applies an admin's
//! acceptance.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::sources::SourceEntry;
use super::ControlTask;
use crate::discovery::guard::{self, Change};
use crate::discovery::{reconcile, Discovered};
use crate::model::{Endpoint, Id, Target, TargetChange};
use crate::store::{AcceptanceApplied, AcceptanceWrite, PendingAcceptance, StoreError};

/// The least time between two re-reads of a holding source.
const SHORTEST_REREAD: Duration = Duration::from_secs(1);

/// What became of an admin's acceptance of held removals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptAnswer {
    /// The held targets drain now: how many, and when (the database's clock).
    Released {
        released: u64,
        released_at: DateTime<Utc>,
    },
    /// Another instance refreshes this source (or will, once it takes the lease): the acceptance
    /// is stored for it and it was told.
    PassedOn,
    /// A single instance (SQLite) that does not hold the lease: the store is unreachable.
    NoHolder,
    /// No such source (deleted meanwhile).
    Unknown,
}

impl ControlTask {
    /// The set reconcile applies for a successful refresh: the registry's answer, plus the
    /// targets the guard holds. Records the hold in the entry's progress.
    pub(super) fn judge_removals(
        &self,
        entry: &mut SourceEntry,
        targets: &[Target],
        discovered: &Discovered,
        now: DateTime<Utc>,
    ) -> Vec<Endpoint> {
        let settings = entry.source.removal_guard;
        let taken_out = |target: &Target| self.carried.taken_out(target);
        let verdict = guard::judge(
            settings.as_ref(),
            targets,
            discovered,
            entry.progress.guard.as_ref(),
            taken_out,
            now,
        );
        log_change(entry.source.id, verdict.change, verdict.hold.as_ref());
        entry.guard_reread_at = verdict.hold.as_ref().map(|_| {
            let confirm = Duration::from_millis(settings.map_or(0, |guard| guard.confirm_ms));
            now + (confirm / 2).max(SHORTEST_REREAD)
        });
        entry.progress.guard = verdict.hold;
        verdict.endpoints
    }

    /// An admin accepts the removals the guard of `source_id` holds. The lease holder applies
    /// it now, storing the request already applied in the same transaction (a failed write
    /// leaves nothing pending). Another instance stores it for the holder and tells it; the
    /// holder applies a stored request at the notification, after a reconnect, on the periodic
    /// resync, or at a takeover.
    pub(super) async fn accept_removals(
        &mut self,
        source_id: Id,
    ) -> Result<AcceptAnswer, StoreError> {
        let Some(mut entry) = self.sources.remove(&source_id) else {
            return Ok(AcceptAnswer::Unknown);
        };
        let outcome = if entry.holds_lease() {
            Some(self.release_accepted(&mut entry, Accepted::AtOnce).await)
        } else {
            None
        };
        self.sources.insert(entry);
        match outcome {
            Some(Ok((released, released_at))) => {
                if released > 0 {
                    self.rebuild_logged().await;
                }
                // The at-once write always returns its time; `now` only if a version did not.
                let released_at = released_at.unwrap_or_else(|| self.clock.now());
                Ok(AcceptAnswer::Released {
                    released,
                    released_at,
                })
            }
            Some(Err(StoreError::NotFound { .. })) => Ok(AcceptAnswer::Unknown),
            // Another instance took the lease meanwhile: it applies the stored request.
            Some(Err(error)) if error.is_lease_lost() => self.pass_on(source_id).await,
            Some(Err(error)) => Err(error),
            None => self.pass_on(source_id).await,
        }
    }

    /// Stores the request for the lease holder and tells it (PostgreSQL).
    async fn pass_on(&self, source_id: Id) -> Result<AcceptAnswer, StoreError> {
        // One instance on SQLite: a lease it does not hold means the store is unreachable.
        if !self.store.is_shared() {
            return Ok(AcceptAnswer::NoHolder);
        }
        let stored = self.store.request_acceptance(source_id).await?;
        Ok(match stored {
            Some(_) => AcceptAnswer::PassedOn,
            None => AcceptAnswer::Unknown,
        })
    }

    /// Applies a stored request if this instance holds the source's lease: drains the hold it
    /// covers and records it applied. Returns the targets released (None when not the holder).
    async fn apply_acceptance(
        &mut self,
        request: PendingAcceptance,
    ) -> Result<Option<u64>, StoreError> {
        let Some(mut entry) = self.sources.remove(&request.source_id) else {
            return Ok(None);
        };
        let outcome = if entry.holds_lease() {
            self.release_accepted(&mut entry, Accepted::Stored(&request))
                .await
                .map(|(released, _)| Some(released))
        } else {
            Ok(None)
        };
        self.sources.insert(entry);
        let released = outcome?;
        if released.is_some_and(|released| released > 0) {
            self.rebuild_logged().await;
        }
        Ok(released)
    }

    /// Drains the hold the acceptance covers and records it applied; returns the targets
    /// released and when it was recorded (None: a stored request replaced meanwhile).
    async fn release_accepted(
        &mut self,
        entry: &mut SourceEntry,
        accepted: Accepted<'_>,
    ) -> Result<(u64, Option<DateTime<Utc>>), StoreError> {
        let id = entry.source.id;
        let service_id = entry.source.service_id;
        let releases = match accepted {
            Accepted::Stored(request) => {
                guard::acceptance_releases(request.hold.as_ref(), entry.progress.guard.as_ref())
            }
            Accepted::AtOnce => true,
        };
        let Some(hold) = entry.progress.guard.clone().filter(|_| releases) else {
            let write = accepted.write(None, 0);
            let applied_at = self
                .store
                .apply_acceptance(service_id, id, &[], None, write)
                .await?;
            if entry.progress.guard.is_some() {
                tracing::info!(
                    source_id = id,
                    "accepted removals: the hold began after the request; still holding"
                );
            }
            self.note_acceptance(entry).await;
            return Ok((0, applied_at));
        };
        let targets = self.store.source_targets(id).await?;
        let now = self.clock.now();
        let changes = reconcile::drain_keys(&targets, &hold.held, now, entry.removal_grace());
        let reread_at = entry.guard_reread_at.take();
        entry.progress.guard = None;
        let write = accepted.write(Some(&hold), changes.len() as u64);
        let applied_at = match self
            .store
            .apply_acceptance(service_id, id, &changes, Some(&entry.progress), write)
            .await
        {
            Ok(applied_at) => applied_at,
            Err(error) => {
                entry.progress.guard = Some(hold);
                entry.guard_reread_at = reread_at;
                return Err(error);
            }
        };
        for change in &changes {
            if let TargetChange::Drain { id: target_id, .. } = change {
                self.observer.note(
                    *target_id,
                    "an admin accepted the removal guard's held removals",
                );
            }
        }
        self.note_acceptance(entry).await;
        // The drain is stored: a failure to read the deadlines back only delays the removal.
        if let Err(error) = self.after_changes(entry, &changes).await {
            tracing::warn!(source_id = id, %error, "removal deadlines not re-read; retrying soon");
            entry.next_removal = Some(now + chrono::Duration::seconds(1));
        }
        tracing::warn!(
            source_id = id,
            released = changes.len(),
            "an admin accepted the removals the guard held; those targets drain now"
        );
        Ok((changes.len() as u64, applied_at))
    }

    /// Keeps the applied request for the source's events (its status reads the store).
    async fn note_acceptance(&self, entry: &mut SourceEntry) {
        match self.store.removal_acceptance(entry.source.id).await {
            Ok(acceptance) => entry.acceptance = acceptance,
            Err(error) => {
                tracing::debug!(source_id = entry.source.id, %error, "applied acceptance not re-read")
            }
        }
    }

    /// Another instance passed on an admin's acceptance: applied only by the lease holder.
    pub(super) async fn accept_if_held(&mut self, source_id: Id) {
        if !self
            .sources
            .get(&source_id)
            .is_some_and(SourceEntry::holds_lease)
        {
            return;
        }
        let pending = match self.store.pending_acceptance(source_id).await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::error!(source_id, %error, "accepted removals not read; the resync retries");
                return;
            }
        };
        if let Some(request) = pending {
            if let Err(error) = self.apply_acceptance(request).await {
                tracing::error!(source_id, %error, "accepted removals not applied; the resync retries");
            }
        }
    }

    /// Applies every stored request of the sources this instance holds: after the listener
    /// (re)connects (a notification may have been lost), on the periodic resync and at start.
    pub(super) async fn apply_pending_acceptances(&mut self) {
        let pending = match self.store.pending_acceptances().await {
            Ok(pending) => pending,
            Err(error) => {
                tracing::warn!(%error, "pending accepted removals not read; retrying at the next resync");
                return;
            }
        };
        for request in pending {
            let source_id = request.source_id;
            if let Err(error) = self.apply_acceptance(request).await {
                tracing::error!(source_id, %error, "accepted removals not applied; the resync retries");
            }
        }
    }

    /// Re-reads holding sources whose re-read is due, so their hold is decided on time.
    pub(super) fn reread_holding(&mut self, entry: &mut SourceEntry, now: DateTime<Utc>) {
        if entry.guard_reread_at.is_some_and(|due| due <= now) {
            entry.guard_reread_at = None;
            if let Some(runner) = &entry.runner {
                runner.request_refresh();
            }
        }
    }
}

/// The acceptance the lease holder applies.
#[derive(Clone, Copy)]
enum Accepted<'a> {
    /// A request stored earlier (by another instance, or before a takeover).
    Stored(&'a PendingAcceptance),
    /// This instance was asked: it covers the hold held now.
    AtOnce,
}

impl<'a> Accepted<'a> {
    /// How the write records it; `hold` is the hold released (None: nothing released).
    fn write(
        self,
        hold: Option<&'a crate::model::GuardHold>,
        released: u64,
    ) -> AcceptanceWrite<'a> {
        match self {
            Accepted::Stored(request) => AcceptanceWrite::Mark(AcceptanceApplied {
                requested_at_ms: request.requested_at_ms,
                released,
            }),
            Accepted::AtOnce => AcceptanceWrite::AtOnce { hold, released },
        }
    }
}

fn log_change(source_id: Id, change: Change, hold: Option<&crate::model::GuardHold>) {
    match (change, hold) {
        (Change::Started, Some(hold)) => tracing::warn!(
            source_id,
            holding = hold.holding,
            held = ?hold.held,
            reason = %hold.reason,
            "removal guard: holding removals"
        ),
        (Change::StillHolding, Some(hold)) => tracing::info!(
            source_id,
            holding = hold.holding,
            confirmations = hold.confirmations,
            "removal guard: the registry answered the same smaller set again"
        ),
        (Change::Confirmed, _) => tracing::warn!(
            source_id,
            "removal guard: the smaller set is confirmed; the held removals apply"
        ),
        (Change::Ended, _) => tracing::info!(
            source_id,
            "removal guard: the registry's answer no longer removes too much; hold ended"
        ),
        (Change::Released, _) => tracing::info!(
            source_id,
            "removal guard: health checks or ejection took every held target out; hold ended"
        ),
        _ => {}
    }
}
