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
use crate::store::StoreError;

/// The least time between two re-reads of a holding source.
const SHORTEST_REREAD: Duration = Duration::from_secs(1);

/// What became of an admin's acceptance of held removals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptAnswer {
    /// The held targets drain now; how many.
    Released(u64),
    /// Another instance refreshes this source; the acceptance was passed on to it.
    PassedOn,
    /// No instance refreshes the source now (its lease is not held: the store is unreachable).
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

    /// Drains the targets the guard of `source_id` holds, at an admin's request.
    pub(super) async fn accept_removals(
        &mut self,
        source_id: Id,
    ) -> Result<AcceptAnswer, StoreError> {
        let Some(mut entry) = self.sources.remove(&source_id) else {
            return Ok(AcceptAnswer::Unknown);
        };
        let outcome = self.accept_held(&mut entry).await;
        self.sources.insert(source_id, entry);
        let answer = outcome?;
        if matches!(answer, AcceptAnswer::Released(released) if released > 0) {
            self.rebuild_logged().await;
        }
        Ok(answer)
    }

    async fn accept_held(&mut self, entry: &mut SourceEntry) -> Result<AcceptAnswer, StoreError> {
        let id = entry.source.id;
        if !entry.holds_lease() {
            return Ok(if self.store.request_accept_by_holder(id).await? {
                AcceptAnswer::PassedOn
            } else {
                AcceptAnswer::NoHolder
            });
        }
        let Some(hold) = entry.progress.guard.clone() else {
            return Ok(AcceptAnswer::Released(0));
        };
        let targets = self.store.source_targets(id).await?;
        let now = self.clock.now();
        let changes = reconcile::drain_keys(&targets, &hold.held, now, entry.removal_grace());
        let reread_at = entry.guard_reread_at.take();
        entry.progress.guard = None;
        if let Err(error) = self
            .store
            .apply_refresh(entry.source.service_id, id, &changes, Some(&entry.progress))
            .await
        {
            entry.progress.guard = Some(hold);
            entry.guard_reread_at = reread_at;
            return Err(error);
        }
        for change in &changes {
            if let TargetChange::Drain { id: target_id, .. } = change {
                self.observer.note(
                    *target_id,
                    "an admin accepted the removal guard's held removals",
                );
            }
        }
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
        Ok(AcceptAnswer::Released(changes.len() as u64))
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
        if let Err(error) = self.accept_removals(source_id).await {
            tracing::error!(source_id, %error, "accepted removals not applied");
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
