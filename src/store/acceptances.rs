//! Accepted removals (DESIGN §4): the last `POST …/accept-removals` of each source, kept until the
//! source's lease holder applies it, then kept with when it did. Stored rather than only
//! notified, so a notification lost while the holder's listener was down, or a holder that dies
//! before applying it, does not lose the request: the holder looks for pending requests after a
//! reconnect, on the periodic resync and when it takes a source over. Times are the database's
//! clock, like the leases'.

use std::collections::HashMap;

use super::rows::time;
use super::{Backend, Store, StoreError};
use crate::model::{GuardHold, Id, RemovalAcceptance};

/// A request the lease holder has not applied yet.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingAcceptance {
    pub source_id: Id,
    /// Identifies the request when it is marked applied (a newer one replaces it).
    pub requested_at_ms: i64,
    /// The hold the request covers: the one stored (or held) when it was made.
    pub hold: Option<GuardHold>,
}

/// What the lease holder made of a pending request, recorded with the targets it drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptanceApplied {
    pub requested_at_ms: i64,
    pub released: u64,
}

#[derive(sqlx::FromRow)]
struct AcceptanceRow {
    source_id: Id,
    requested_at: i64,
    requested_via: String,
    hold: Option<String>,
    released_at: Option<i64>,
    released_by: Option<String>,
    released: Option<i64>,
}

impl AcceptanceRow {
    fn view(&self) -> Result<RemovalAcceptance, StoreError> {
        Ok(RemovalAcceptance {
            requested_at: time(self.requested_at)?,
            requested_via: self.requested_via.clone(),
            released_at: self.released_at.map(time).transpose()?,
            released_by: self.released_by.clone(),
            released: self.released.map(|released| released.max(0) as u64),
        })
    }

    fn pending(self) -> PendingAcceptance {
        PendingAcceptance {
            source_id: self.source_id,
            requested_at_ms: self.requested_at,
            // A hold this version cannot read covers nothing: never release by guesswork.
            hold: self.hold.and_then(|text| serde_json::from_str(&text).ok()),
        }
    }
}

/// How a write of the lease holder records an admin's acceptance, in the transaction that
/// drains what it releases.
pub enum AcceptanceWrite<'a> {
    /// Marks a stored request applied.
    Mark(AcceptanceApplied),
    /// The holder was asked itself: the request is stored already applied, covering the hold it
    /// holds, so a failed write leaves no request pending for later.
    AtOnce {
        hold: Option<&'a GuardHold>,
        released: u64,
    },
}

impl Store {
    /// Records an admin's acceptance of the removals `source_id`'s guard holds (replacing an
    /// earlier request), covering the hold stored with the source's progress (read by the same
    /// statement: an instance that does not hold the lease knows no other), and on PostgreSQL
    /// asks the lease holder to apply it now (the notification is sent when the request is
    /// committed). None when the source is gone.
    pub async fn request_acceptance(
        &self,
        source_id: Id,
    ) -> Result<Option<PendingAcceptance>, StoreError> {
        let sql = format!(
            "INSERT INTO removal_acceptances (source_id, requested_at, requested_via, hold)
             SELECT id, {now}, $2, guard FROM discovery_sources WHERE id = $1
             ON CONFLICT (source_id) DO UPDATE
                SET requested_at = excluded.requested_at, requested_via = excluded.requested_via,
                    hold = excluded.hold, released_at = NULL, released_by = NULL,
                    released = NULL
             RETURNING *",
            now = self.now_sql(),
        );
        let row: Option<AcceptanceRow> = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let row = sqlx::query_as(&sql)
                .bind(source_id)
                .bind(self.instance_id())
                .fetch_optional(&mut *transaction)
                .await?;
            if row.is_some() && matches!(self.backend, Backend::Postgres(_)) {
                sqlx::query("SELECT pg_notify('raahi_accept_removals', $1)")
                    .bind(source_id.to_string())
                    .execute(&mut *transaction)
                    .await?;
            }
            transaction.commit().await?;
            row
        });
        Ok(row.map(AcceptanceRow::pending))
    }

    /// The request of `source_id` its lease holder has not applied yet, if any.
    pub async fn pending_acceptance(
        &self,
        source_id: Id,
    ) -> Result<Option<PendingAcceptance>, StoreError> {
        let row: Option<AcceptanceRow> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT * FROM removal_acceptances WHERE source_id = $1 AND released_at IS NULL"
        )
        .bind(source_id)
        .fetch_optional(pool)
        .await)?;
        Ok(row.map(AcceptanceRow::pending))
    }

    /// Every request not applied yet (a handful at most: one row per source, while pending).
    pub async fn pending_acceptances(&self) -> Result<Vec<PendingAcceptance>, StoreError> {
        let rows: Vec<AcceptanceRow> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT * FROM removal_acceptances WHERE released_at IS NULL ORDER BY source_id"
        )
        .fetch_all(pool)
        .await)?;
        Ok(rows.into_iter().map(AcceptanceRow::pending).collect())
    }

    /// The last request of `source_id` and what became of it, for its status.
    pub async fn removal_acceptance(
        &self,
        source_id: Id,
    ) -> Result<Option<RemovalAcceptance>, StoreError> {
        let row: Option<AcceptanceRow> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT * FROM removal_acceptances WHERE source_id = $1"
        )
        .bind(source_id)
        .fetch_optional(pool)
        .await)?;
        row.as_ref().map(AcceptanceRow::view).transpose()
    }

    /// Every source's last request, by source id (for the event stream's snapshot).
    pub async fn removal_acceptances(&self) -> Result<HashMap<Id, RemovalAcceptance>, StoreError> {
        let rows: Vec<AcceptanceRow> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT * FROM removal_acceptances"
        )
        .fetch_all(pool)
        .await)?;
        rows.iter()
            .map(|row| Ok((row.source_id, row.view()?)))
            .collect()
    }

    /// The statement that marks a pending request applied, inside the transaction that drains
    /// its targets: `$1` released, `$2` this instance, `$3` the source, `$4` the request's time.
    /// A request made meanwhile (another time) stays pending. Returns when it was marked.
    pub(super) fn mark_applied_sql(&self) -> String {
        format!(
            "UPDATE removal_acceptances SET released_at = {}, released_by = $2, released = $1
             WHERE source_id = $3 AND requested_at = $4 AND released_at IS NULL
             RETURNING released_at",
            self.now_sql()
        )
    }

    /// The statement that stores the holder's own request already applied, inside the
    /// transaction that drains its targets: `$1` released, `$2` this instance, `$3` the source,
    /// `$4` the hold it covers (JSON). No row when the source is gone. Returns when it applied.
    pub(super) fn applied_at_once_sql(&self) -> String {
        format!(
            "INSERT INTO removal_acceptances
                (source_id, requested_at, requested_via, hold, released_at, released_by, released)
             SELECT id, {now}, $2, $4, {now}, $2, $1 FROM discovery_sources WHERE id = $3
             ON CONFLICT (source_id) DO UPDATE
                SET requested_at = excluded.requested_at, requested_via = excluded.requested_via,
                    hold = excluded.hold, released_at = excluded.released_at,
                    released_by = excluded.released_by, released = excluded.released
             RETURNING released_at",
            now = self.now_sql()
        )
    }
}
