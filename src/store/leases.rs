//! Source leases: which gateway instance refreshes a discovery source. One row per source
//! (`holder`, `expires_at` in epoch milliseconds); an instance takes a lease that is free or
//! expired, and renews its own. Expiry is judged by the database's clock, so instances with
//! skewed clocks still agree. A plain table rather than advisory locks: it survives a
//! connection pooler, and operators can see who holds what.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use super::{Backend, Store, StoreError};
use crate::model::Id;

/// The database's clock in epoch milliseconds, as SQL.
const POSTGRES_NOW: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";
const SQLITE_NOW: &str = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)";

/// `contested`: whether another live holder keeps the lease (PostgreSQL). A SQLite file serves
/// one process, so there the asker always wins: a restarted gateway (with a new generated
/// instance id) refreshes at once instead of waiting for its previous life's lease to run out.
fn take_or_renew_sql(now: &str, contested: bool) -> String {
    let only_if_free = if contested {
        format!("WHERE source_leases.holder = excluded.holder OR source_leases.expires_at <= {now}")
    } else {
        String::new()
    };
    // `WHERE EXISTS`: no lease for a source deleted meanwhile (and SQLite needs a WHERE on an
    // upsert's SELECT to parse ON CONFLICT).
    format!(
        "INSERT INTO source_leases (source_id, holder, expires_at)
         SELECT $1, $2, {now} + $3 WHERE EXISTS (SELECT 1 FROM discovery_sources WHERE id = $1)
         ON CONFLICT (source_id) DO UPDATE
            SET holder = excluded.holder, expires_at = excluded.expires_at
            {only_if_free}
         RETURNING holder"
    )
}

/// Like [`take_or_renew_sql`] for `count` sources at once (`$3` on), in id order so that two
/// instances bidding for overlapping sets lock their rows in the same order.
fn take_or_renew_many_sql(now: &str, contested: bool, count: usize) -> String {
    let only_if_free = if contested {
        format!("WHERE source_leases.holder = excluded.holder OR source_leases.expires_at <= {now}")
    } else {
        String::new()
    };
    let ids: Vec<String> = (3..count + 3).map(|n| format!("${n}")).collect();
    format!(
        "INSERT INTO source_leases (source_id, holder, expires_at)
         SELECT id, $1, {now} + $2 FROM discovery_sources WHERE id IN ({}) ORDER BY id
         ON CONFLICT (source_id) DO UPDATE
            SET holder = excluded.holder, expires_at = excluded.expires_at
            {only_if_free}
         RETURNING source_id",
        ids.join(", ")
    )
}

/// How many leases one statement takes or renews.
const LEASES_PER_STATEMENT: usize = 500;

fn holder_sql(now: &str) -> String {
    format!("SELECT holder FROM source_leases WHERE source_id = $1 AND expires_at > {now}")
}

impl Store {
    /// Takes the lease of `source_id` for `period` if it is free or expired, or renews it if this
    /// instance holds it (on SQLite: always). Returns whether this instance holds it now.
    pub async fn take_source_lease(
        &self,
        source_id: Id,
        period: Duration,
    ) -> Result<bool, StoreError> {
        let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX / 2);
        let sql = take_or_renew_sql(self.now_sql(), self.is_shared());
        let taken: Option<String> = on_pool!(self, |pool| sqlx::query_scalar(&sql)
            .bind(source_id)
            .bind(self.instance_id())
            .bind(period_ms)
            .fetch_optional(pool)
            .await)
        .or_else(|error| match &error {
            // The source was deleted between the check and the insert.
            sqlx::Error::Database(db) if db.is_foreign_key_violation() => Ok(None),
            _ => Err(error),
        })?;
        Ok(taken.is_some())
    }

    /// [`Store::take_source_lease`] for many sources in a few statements: the ids this instance
    /// holds now (sources deleted meanwhile are left out).
    pub async fn take_source_leases(
        &self,
        source_ids: &[Id],
        period: Duration,
    ) -> Result<HashSet<Id>, StoreError> {
        let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX / 2);
        let mut held = HashSet::with_capacity(source_ids.len());
        for chunk in source_ids.chunks(LEASES_PER_STATEMENT) {
            let sql = take_or_renew_many_sql(self.now_sql(), self.is_shared(), chunk.len());
            let taken: Vec<i64> = on_pool!(self, |pool| {
                let mut query = sqlx::query_scalar(&sql)
                    .bind(self.instance_id())
                    .bind(period_ms);
                for id in chunk {
                    query = query.bind(*id);
                }
                query.fetch_all(pool).await
            })?;
            held.extend(taken);
        }
        Ok(held)
    }

    /// Gives up this instance's lease of `source_id` (so another instance may take it at once).
    pub async fn release_source_lease(&self, source_id: Id) -> Result<(), StoreError> {
        on_pool!(self, |pool| sqlx::query(
            "DELETE FROM source_leases WHERE source_id = $1 AND holder = $2"
        )
        .bind(source_id)
        .bind(self.instance_id())
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))?;
        Ok(())
    }

    /// The instance holding a live lease of `source_id`, if any.
    pub async fn source_lease_holder(&self, source_id: Id) -> Result<Option<String>, StoreError> {
        let sql = holder_sql(self.now_sql());
        Ok(on_pool!(self, |pool| sqlx::query_scalar(&sql)
            .bind(source_id)
            .fetch_optional(pool)
            .await)?)
    }

    /// Every held (unexpired) source lease: source id → holding instance.
    pub async fn source_lease_holders(&self) -> Result<HashMap<Id, String>, StoreError> {
        let sql = format!(
            "SELECT source_id, holder FROM source_leases WHERE expires_at > {}",
            self.now_sql()
        );
        let rows: Vec<(Id, String)> =
            on_pool!(self, |pool| sqlx::query_as(&sql).fetch_all(pool).await)?;
        Ok(rows.into_iter().collect())
    }

    /// Asks whichever instance holds the lease of `source_id` to refresh it now (a notification
    /// its listener turns into a refresh). On SQLite this instance is the only one: nothing to do.
    pub async fn request_refresh_by_holder(&self, source_id: Id) -> Result<(), StoreError> {
        if let Backend::Postgres(pool) = &self.backend {
            sqlx::query("SELECT pg_notify('raahi_refresh', $1)")
                .bind(source_id.to_string())
                .execute(pool)
                .await?;
        }
        Ok(())
    }

    /// The statement that reads a source's lease holder inside a refresh's transaction, locking
    /// the lease row on PostgreSQL so a takeover waits until this write is committed.
    pub(super) fn lease_fence_sql(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => "SELECT holder FROM source_leases WHERE source_id = $1",
            Backend::Postgres(_) => {
                "SELECT holder FROM source_leases WHERE source_id = $1 FOR UPDATE"
            }
        }
    }

    pub(super) fn now_sql(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => SQLITE_NOW,
            Backend::Postgres(_) => POSTGRES_NOW,
        }
    }
}
