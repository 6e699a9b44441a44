//! Canaries in the store (TRAFFIC.md §4): where each route's canary stands (`route_canaries`,
//! configuration every gateway applies, in the change log as a route change), its history
//! (`canary_decisions`), each gateway's counts (`canary_counts`) and who judges it
//! (`canary_leases`). Times are the database's clock, so gateways with skewed clocks agree on
//! when an interval ends and who holds a lease.

use std::collections::HashMap;
use std::time::Duration;

use chrono::{TimeZone, Utc};

use super::{Store, StoreError};
use crate::model::{
    Backend as RouteBackend, Canary, CanaryCounts, CanaryDecision, CanaryMove, CanaryState,
    CanaryStatus, Id, IntervalCounts,
};

/// Decisions kept per route; older ones are deleted as new ones come.
const HISTORY: i64 = 100;
/// Counts untouched for this long are deleted by whichever gateway flushes next: longer than
/// the longest interval (a day), so no round being judged loses any.
const FORGET_COUNTS_AFTER_MS: i64 = 2 * 86_400_000;
/// Leases this long past their expiry belong to routes deleted or no longer judged.
const FORGET_LEASES_AFTER_MS: i64 = 3_600_000;

/// What a canary was started for: a route write that changes it starts the canary again. Only
/// what makes its progress mean something else: the steps, which backend is the canary and what
/// it sends to, and how many backends share the rest. New bounds, an interval or the other
/// backends' weights apply from the next judgement, and a promoted canary stays promoted.
pub fn canary_key(canary: &Canary, backends: &[RouteBackend]) -> String {
    let canary_backend = backends
        .get(canary.backend_index())
        .map(|backend| (backend.service_id, &backend.subset));
    serde_json::json!({
        "steps": canary.steps,
        "backend": canary.backend,
        "canary_backend": canary_backend,
        "backends": backends.len(),
    })
    .to_string()
}

/// One backend's counts of one flush, in the round the requests were served in.
#[derive(Debug, Clone, PartialEq)]
pub struct CountsReport {
    pub route_id: Id,
    pub round: i64,
    pub backend: u32,
    pub counts: CanaryCounts,
}

/// A canary the judging gateway may decide on.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgedCanary {
    /// [`canary_key`] of the canary and backends the status belongs to.
    pub spec: String,
    pub status: CanaryStatus,
    /// The database's clock now.
    pub now_ms: i64,
    /// Every gateway's counts of the round being judged, by backend position.
    pub counts: Vec<CanaryCounts>,
}

/// Upserts the canary row of a route being written: inserted at the first step, or restarted
/// when its canary or backends changed; the route without a canary loses it. Returns the
/// round of a (re)start, for its history entry. Rounds go on from the route's history, so a
/// canary removed and added again never takes a round (or a move read in one) of the last.
macro_rules! sync_route_canary {
    ($transaction:expr, $route_id:expr, $spec:expr, $now:expr) => {{
        let spec: &crate::model::RouteSpec = $spec;
        match &spec.canary {
            None => {
                sqlx::query("DELETE FROM route_canaries WHERE route_id = $1")
                    .bind($route_id)
                    .execute(&mut *$transaction)
                    .await?;
                None
            }
            Some(canary) => {
                let start = crate::model::CanaryMove::start(canary);
                let key = crate::store::canary::canary_key(canary, &spec.backends);
                let sql = format!(
                    "INSERT INTO route_canaries (route_id, spec, state, step, weight, round,
                        interval_started_ms, reason)
                     VALUES ($1, $2, $3, $4, $5,
                        (SELECT COALESCE(MAX(round), 0) + 1 FROM canary_decisions
                            WHERE route_id = $1),
                        {now}, $6)
                     ON CONFLICT (route_id) DO UPDATE
                        SET spec = excluded.spec, state = excluded.state, step = excluded.step,
                            weight = excluded.weight, round = route_canaries.round + 1,
                            interval_started_ms = excluded.interval_started_ms,
                            reason = excluded.reason
                        WHERE route_canaries.spec <> excluded.spec
                     RETURNING round",
                    now = $now
                );
                let round: Option<i64> = sqlx::query_scalar(&sql)
                    .bind($route_id)
                    .bind(&key)
                    .bind(start.state.as_str())
                    .bind(i64::from(start.step))
                    .bind(i64::from(start.weight))
                    .bind(&start.reason)
                    .fetch_optional(&mut *$transaction)
                    .await?;
                if let Some(round) = round {
                    crate::store::canary::record_decision!(
                        $transaction,
                        $route_id,
                        round,
                        &start,
                        "[]",
                        $now
                    );
                }
                round
            }
        }
    }};
}
pub(super) use sync_route_canary;

/// Appends one entry to a route's history and drops entries beyond [`HISTORY`].
macro_rules! record_decision {
    ($transaction:expr, $route_id:expr, $round:expr, $moved:expr, $counts:expr, $now:expr) => {{
        let moved: &crate::model::CanaryMove = $moved;
        let sql = format!(
            "INSERT INTO canary_decisions (route_id, round, at_ms, state, step, weight, reason, counts)
             VALUES ($1, $2, {now}, $3, $4, $5, $6, $7)
             ON CONFLICT (route_id, round) DO NOTHING",
            now = $now
        );
        sqlx::query(&sql)
            .bind($route_id)
            .bind($round)
            .bind(moved.state.as_str())
            .bind(i64::from(moved.step))
            .bind(i64::from(moved.weight))
            .bind(&moved.reason)
            .bind($counts)
            .execute(&mut *$transaction)
            .await?;
        sqlx::query("DELETE FROM canary_decisions WHERE route_id = $1 AND round <= $2")
            .bind($route_id)
            .bind($round - crate::store::canary::HISTORY_KEPT)
            .execute(&mut *$transaction)
            .await?;
    }};
}
pub(super) use record_decision;
pub(super) const HISTORY_KEPT: i64 = HISTORY;

#[derive(sqlx::FromRow)]
struct DecisionRow {
    round: i64,
    at_ms: i64,
    state: String,
    step: i64,
    weight: i64,
    reason: String,
    counts: String,
}

impl TryFrom<DecisionRow> for CanaryDecision {
    type Error = StoreError;
    fn try_from(row: DecisionRow) -> Result<CanaryDecision, StoreError> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("canary decision {what}"));
        Ok(CanaryDecision {
            round: row.round,
            at: Utc
                .timestamp_millis_opt(row.at_ms)
                .single()
                .ok_or_else(|| corrupt("time"))?,
            state: CanaryState::parse(&row.state).ok_or_else(|| corrupt("state"))?,
            step: u32::try_from(row.step).map_err(|_| corrupt("step"))?,
            weight: u8::try_from(row.weight).map_err(|_| corrupt("weight"))?,
            reason: row.reason,
            counts: serde_json::from_str(&row.counts).map_err(|_| corrupt("counts"))?,
        })
    }
}

#[derive(sqlx::FromRow)]
struct StatusRow {
    state: String,
    step: i64,
    weight: i64,
    round: i64,
    interval_started_ms: i64,
    reason: String,
}

/// A canary row's columns as a status; None when a column holds what Raahi never writes.
pub(super) fn status_of(
    state: &str,
    step: i64,
    weight: i64,
    round: i64,
    interval_started_ms: i64,
    reason: String,
) -> Option<CanaryStatus> {
    Some(CanaryStatus {
        state: CanaryState::parse(state)?,
        step: u32::try_from(step).ok()?,
        weight: u8::try_from(weight).ok().filter(|weight| *weight <= 100)?,
        round,
        interval_started_ms,
        reason,
    })
}

#[derive(sqlx::FromRow)]
struct JudgedRow {
    spec: String,
    #[sqlx(flatten)]
    status: StatusRow,
}

impl TryFrom<StatusRow> for CanaryStatus {
    type Error = StoreError;
    fn try_from(row: StatusRow) -> Result<CanaryStatus, StoreError> {
        status_of(
            &row.state,
            row.step,
            row.weight,
            row.round,
            row.interval_started_ms,
            row.reason,
        )
        .ok_or_else(|| StoreError::Corrupt("canary status".to_owned()))
    }
}

const STATUS_SQL: &str = "SELECT state, step, weight, round, interval_started_ms, reason
    FROM route_canaries WHERE route_id = $1";
const JUDGED_SQL: &str = "SELECT spec, state, step, weight, round, interval_started_ms, reason
    FROM route_canaries WHERE route_id = $1";

/// One row of counts, whole: the store adds the flush to what the row held (a histogram is
/// added in Rust, not SQL).
const COUNTS_READ_SQL: &str = "SELECT requests, errors, latency FROM canary_counts
    WHERE route_id = $1 AND round = $2 AND instance_id = $3 AND backend = $4";
const COUNTS_WRITE_SQL: &str = "INSERT INTO canary_counts
        (route_id, round, instance_id, backend, requests, errors, latency, updated_at)
    VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
    ON CONFLICT (route_id, round, instance_id, backend) DO UPDATE
        SET requests = excluded.requests, errors = excluded.errors, latency = excluded.latency,
            updated_at = excluded.updated_at";

fn take_leases_sql(now: &str, contested: bool, count: usize) -> String {
    let only_if_free = if contested {
        format!("WHERE canary_leases.holder = excluded.holder OR canary_leases.expires_at <= {now}")
    } else {
        String::new()
    };
    let ids: Vec<String> = (3..count + 3).map(|n| format!("${n}")).collect();
    format!(
        "INSERT INTO canary_leases (route_id, holder, expires_at)
         SELECT route_id, $1, {now} + $2 FROM route_canaries WHERE route_id IN ({})
            ORDER BY route_id
         ON CONFLICT (route_id) DO UPDATE
            SET holder = excluded.holder, expires_at = excluded.expires_at
            {only_if_free}
         RETURNING route_id",
        ids.join(", ")
    )
}

impl Store {
    /// Where a route's canary stands; None when the route has none.
    pub async fn canary_status(&self, route_id: Id) -> Result<Option<CanaryStatus>, StoreError> {
        let row: Option<StatusRow> = on_pool!(self, |pool| sqlx::query_as(STATUS_SQL)
            .bind(route_id)
            .fetch_optional(pool)
            .await)?;
        row.map(CanaryStatus::try_from).transpose()
    }

    /// A route's canary history, oldest first, at most `limit` entries (the newest).
    pub async fn canary_history(
        &self,
        route_id: Id,
        limit: u32,
    ) -> Result<Vec<CanaryDecision>, StoreError> {
        let rows: Vec<DecisionRow> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT round, at_ms, state, step, weight, reason, counts FROM canary_decisions
             WHERE route_id = $1 ORDER BY round DESC LIMIT $2"
        )
        .bind(route_id)
        .bind(i64::from(limit))
        .fetch_all(pool)
        .await)?;
        let mut history = rows
            .into_iter()
            .map(CanaryDecision::try_from)
            .collect::<Result<Vec<_>, _>>()?;
        history.reverse();
        Ok(history)
    }

    /// Moves a route's canary from the round `from_round` (a decision or an operator's action);
    /// every move starts a new interval. Returns the new status, or None when the canary moved
    /// meanwhile (another decision, an action, the route changed) and this move was not made.
    pub async fn move_canary(
        &self,
        route_id: Id,
        from_round: i64,
        moved: &CanaryMove,
        counts: &[IntervalCounts],
    ) -> Result<Option<CanaryStatus>, StoreError> {
        let now = self.now_sql();
        let counts = serde_json::to_string(counts).expect("counts always serialise");
        let sql = format!(
            "UPDATE route_canaries SET state = $1, step = $2, weight = $3, round = round + 1,
                interval_started_ms = {now}, reason = $4
             WHERE route_id = $5 AND round = $6
             RETURNING state, step, weight, round, interval_started_ms, reason"
        );
        let row: Option<StatusRow> = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let row: Option<StatusRow> = sqlx::query_as(&sql)
                .bind(moved.state.as_str())
                .bind(i64::from(moved.step))
                .bind(i64::from(moved.weight))
                .bind(&moved.reason)
                .bind(route_id)
                .bind(from_round)
                .fetch_optional(&mut *transaction)
                .await?;
            if let Some(row) = &row {
                record_decision!(transaction, route_id, row.round, moved, &counts, now);
            }
            transaction.commit().await?;
            row
        });
        row.map(CanaryStatus::try_from).transpose()
    }

    /// Adds this gateway's counts of one flush to its rows of their rounds, and deletes anyone's
    /// rows untouched for two days and leases an hour past their expiry. A handful of rows a
    /// second (one per canary route, round and backend), each read and written whole.
    pub async fn add_canary_counts(&self, reports: &[CountsReport]) -> Result<(), StoreError> {
        let now = self.now_sql();
        let instance = self.instance_id();
        let reports: Vec<&CountsReport> = reports
            .iter()
            .filter(|report| !report.counts.is_empty())
            .collect();
        if reports.is_empty() {
            return Ok(());
        }
        on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let at: i64 = sqlx::query_scalar(&format!("SELECT {now}"))
                .fetch_one(&mut *transaction)
                .await?;
            for report in &reports {
                let backend = i64::from(report.backend);
                let held: Option<(i64, i64, String)> = sqlx::query_as(COUNTS_READ_SQL)
                    .bind(report.route_id)
                    .bind(report.round)
                    .bind(instance)
                    .bind(backend)
                    .fetch_optional(&mut *transaction)
                    .await?;
                let mut sum = match held {
                    Some(held) => counts_of(held)?,
                    None => CanaryCounts::default(),
                };
                sum.add(&report.counts);
                sqlx::query(COUNTS_WRITE_SQL)
                    .bind(report.route_id)
                    .bind(report.round)
                    .bind(instance)
                    .bind(backend)
                    .bind(saturating_i64(sum.requests))
                    .bind(saturating_i64(sum.errors))
                    .bind(latency_text(&sum.latency))
                    .bind(at)
                    .execute(&mut *transaction)
                    .await?;
            }
            for (sql, age) in [
                (
                    "DELETE FROM canary_counts WHERE updated_at < $1",
                    FORGET_COUNTS_AFTER_MS,
                ),
                (
                    "DELETE FROM canary_leases WHERE expires_at < $1",
                    FORGET_LEASES_AFTER_MS,
                ),
            ] {
                sqlx::query(sql)
                    .bind(at - age)
                    .execute(&mut *transaction)
                    .await?;
            }
            transaction.commit().await?;
        });
        Ok(())
    }

    /// Takes or renews the canary leases of `route_ids` for `period` (on SQLite, one gateway:
    /// always); returns the ones this instance holds now.
    pub async fn take_canary_leases(
        &self,
        route_ids: &[Id],
        period: Duration,
    ) -> Result<Vec<Id>, StoreError> {
        if route_ids.is_empty() {
            return Ok(Vec::new());
        }
        let period_ms = i64::try_from(period.as_millis()).unwrap_or(i64::MAX / 2);
        let mut ids = route_ids.to_vec();
        ids.sort_unstable();
        let sql = take_leases_sql(self.now_sql(), self.is_shared(), ids.len());
        let held: Vec<Id> = on_pool!(self, |pool| {
            let mut query = sqlx::query_scalar(&sql)
                .bind(self.instance_id())
                .bind(period_ms);
            for id in &ids {
                query = query.bind(*id);
            }
            query.fetch_all(pool).await
        })?;
        Ok(held)
    }

    /// Who judges a route's canary now (a live lease's holder).
    pub async fn canary_lease_holder(&self, route_id: Id) -> Result<Option<String>, StoreError> {
        let sql = format!(
            "SELECT holder FROM canary_leases WHERE route_id = $1 AND expires_at > {}",
            self.now_sql()
        );
        on_pool!(self, |pool| sqlx::query_scalar(&sql)
            .bind(route_id)
            .fetch_optional(pool)
            .await)
        .map_err(StoreError::from)
    }

    /// Frees this instance's canary leases (a graceful stop), so another gateway judges at once.
    pub async fn release_canary_leases(&self) -> Result<(), StoreError> {
        on_pool!(self, |pool| sqlx::query(
            "DELETE FROM canary_leases WHERE holder = $1"
        )
        .bind(self.instance_id())
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))?;
        Ok(())
    }

    /// A canary as the judging gateway sees it: what it was started for, its status, the
    /// database's clock, and every gateway's counts of its round. None when the route has none.
    pub async fn judged_canary(&self, route_id: Id) -> Result<Option<JudgedCanary>, StoreError> {
        let now_sql = format!("SELECT {}", self.now_sql());
        let found = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let status: Option<JudgedRow> = sqlx::query_as(JUDGED_SQL)
                .bind(route_id)
                .fetch_optional(&mut *transaction)
                .await?;
            let found = match status {
                None => None,
                Some(JudgedRow { spec, status }) => {
                    let now: i64 = sqlx::query_scalar(&now_sql)
                        .fetch_one(&mut *transaction)
                        .await?;
                    let rows: Vec<(i64, i64, i64, String)> = sqlx::query_as(
                        "SELECT backend, requests, errors, latency FROM canary_counts
                         WHERE route_id = $1 AND round = $2",
                    )
                    .bind(route_id)
                    .bind(status.round)
                    .fetch_all(&mut *transaction)
                    .await?;
                    Some((spec, status, now, rows))
                }
            };
            transaction.commit().await?;
            found
        });
        let Some((spec, status, now_ms, rows)) = found else {
            return Ok(None);
        };
        let mut by_backend: HashMap<usize, CanaryCounts> = HashMap::new();
        for (backend, requests, errors, latency) in rows {
            // A route has at most a few backends: a larger position is no row Raahi wrote.
            let backend = usize::try_from(backend)
                .ok()
                .filter(|backend| *backend < 256)
                .ok_or_else(|| StoreError::Corrupt("canary counts backend".to_owned()))?;
            by_backend
                .entry(backend)
                .or_default()
                .add(&counts_of((requests, errors, latency))?);
        }
        let backends = by_backend.keys().max().map_or(0, |last| last + 1);
        let counts = (0..backends)
            .map(|backend| by_backend.remove(&backend).unwrap_or_default())
            .collect();
        Ok(Some(JudgedCanary {
            spec,
            status: status.try_into()?,
            now_ms,
            counts,
        }))
    }
}

fn saturating_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

/// A latency histogram as stored: a JSON array of counts.
fn latency_text(latency: &[u64]) -> String {
    serde_json::to_string(latency).expect("counts always serialise")
}

/// A row's (requests, errors, latency) as counts.
fn counts_of((requests, errors, latency): (i64, i64, String)) -> Result<CanaryCounts, StoreError> {
    Ok(CanaryCounts {
        requests: u64::try_from(requests).unwrap_or(0),
        errors: u64::try_from(errors).unwrap_or(0),
        latency: latency_of(&latency)?,
    })
}

fn latency_of(text: &str) -> Result<Vec<u64>, StoreError> {
    serde_json::from_str(text)
        .map_err(|error| StoreError::Corrupt(format!("canary latency counts: {error}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_statements_number_their_binds_in_order() {
        assert!(take_leases_sql("NOW", true, 2).contains("route_id IN ($3, $4)"));
        assert!(!take_leases_sql("NOW", false, 1).contains("expires_at <="));
    }
}
