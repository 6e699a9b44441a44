//! The demand exchange of cluster-scope rate limits (TRAFFIC.md §6): every `cluster.rate_sync_ms`
//! each gateway writes its presence and its recent demand of the keys near their limit, and
//! reads back the other gateways' fresh rows and how many gateways take part. One transaction per
//! exchange, whatever the number of keys; freshness is judged by the database's clock, as for
//! source leases, so gateways with skewed clocks agree on who is still there.
//!
//! This is runtime state, not configuration: the tables have no change-log triggers, and rows
//! a minute old (of deleted routes, of gateways gone without a goodbye) are deleted by whichever
//! gateway exchanges next.

use std::time::Duration;

use super::{Backend, Store, StoreError};
use crate::model::Id;

/// One key's demand as this gateway reports it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DemandReport {
    pub route_id: Id,
    pub key: u64,
    pub demand_per_second: f64,
}

/// Another gateway's fresh demand of one key.
#[derive(Debug, Clone, PartialEq)]
pub struct DemandRow {
    pub route_id: Id,
    pub key: u64,
    pub instance_id: String,
    pub demand_per_second: f64,
}

/// What one exchange read back.
#[derive(Debug, Clone, PartialEq)]
pub struct RateExchange {
    /// Gateways seen within the freshness window, this one included.
    pub members: u32,
    /// The other gateways' fresh rows of the routes asked about.
    pub rows: Vec<DemandRow>,
}

/// Rows written per statement: 3 binds each, far below either driver's limit.
const ROWS_PER_STATEMENT: usize = 1000;
/// Routes named per read.
const ROUTES_PER_STATEMENT: usize = 500;
/// Rows and presences older than this are gone for good.
const FORGET_AFTER_MS: i64 = 60_000;

/// Takes the database's clock once per exchange: every row this exchange writes carries the
/// same time, so the rows it did not write are told apart exactly.
/// The time strictly increases per gateway (by a millisecond at least): two exchanges within one
/// tick of the clock must still tell this one's rows from the last one's.
fn presence_sql(backend: &Backend, now: &str) -> String {
    let greatest = match backend {
        Backend::Sqlite(_) => "MAX",
        Backend::Postgres(_) => "GREATEST",
    };
    format!(
        "INSERT INTO rate_limit_members (instance_id, seen_at) VALUES ($1, {now})
         ON CONFLICT (instance_id) DO UPDATE
            SET seen_at = {greatest}(excluded.seen_at, rate_limit_members.seen_at + 1)
         RETURNING seen_at"
    )
}

fn upsert_sql(count: usize) -> String {
    let rows: Vec<String> = (0..count)
        .map(|row| {
            let first = 3 + row * 3;
            format!("(${first}, ${}, $1, ${}, $2)", first + 1, first + 2)
        })
        .collect();
    format!(
        "INSERT INTO rate_limit_demand (route_id, key_hash, instance_id, demand_per_second, updated_at)
         VALUES {}
         ON CONFLICT (route_id, key_hash, instance_id) DO UPDATE
            SET demand_per_second = excluded.demand_per_second, updated_at = excluded.updated_at",
        rows.join(", ")
    )
}

/// This instance's rows not written by this exchange: keys it no longer reports.
const DELETE_UNREPORTED_SQL: &str =
    "DELETE FROM rate_limit_demand WHERE instance_id = $1 AND updated_at <> $2";

/// Old rows of anyone. On PostgreSQL rows another exchange is deleting are skipped, not
/// waited for: two gateways cleaning up at once never wait on each other.
fn forget_sql(backend: &Backend, table: &str, key: &str, time: &str) -> String {
    match backend {
        Backend::Sqlite(_) => format!("DELETE FROM {table} WHERE {time} < $1"),
        Backend::Postgres(_) => format!(
            "DELETE FROM {table} WHERE ({key}) IN
                (SELECT {key} FROM {table} WHERE {time} < $1 FOR UPDATE SKIP LOCKED)"
        ),
    }
}

fn read_sql(count: usize) -> String {
    let routes: Vec<String> = (0..count).map(|n| format!("${}", n + 3)).collect();
    format!(
        "SELECT route_id, key_hash, instance_id, demand_per_second FROM rate_limit_demand
         WHERE instance_id <> $1 AND updated_at > $2 AND route_id IN ({})",
        routes.join(", ")
    )
}

const MEMBERS_SQL: &str = "SELECT COUNT(*) FROM rate_limit_members WHERE seen_at > $1";

/// `reports` with one entry per route and key (the last wins) and finite demands: an upsert
/// may not name a row twice.
fn unique_reports(reports: &[DemandReport]) -> Vec<DemandReport> {
    let mut unique: Vec<DemandReport> = reports
        .iter()
        .map(|report| DemandReport {
            demand_per_second: if report.demand_per_second.is_finite() {
                report.demand_per_second.max(0.0)
            } else {
                0.0
            },
            ..*report
        })
        .collect();
    unique.reverse();
    unique.sort_by_key(|report| (report.route_id, report.key));
    unique.dedup_by_key(|report| (report.route_id, report.key));
    unique
}

impl Store {
    /// One exchange: marks this instance present, makes its rows exactly `reports`, and reads
    /// back the member count and the other instances' rows of `routes` updated within `fresh`.
    pub async fn exchange_rate_demand(
        &self,
        routes: &[Id],
        reports: &[DemandReport],
        fresh: Duration,
    ) -> Result<RateExchange, StoreError> {
        let reports = unique_reports(reports);
        let fresh_ms = i64::try_from(fresh.as_millis()).unwrap_or(i64::MAX / 2);
        let presence = presence_sql(&self.backend, self.now_sql());
        let forget_rows = forget_sql(
            &self.backend,
            "rate_limit_demand",
            "route_id, key_hash, instance_id",
            "updated_at",
        );
        let forget_members = forget_sql(
            &self.backend,
            "rate_limit_members",
            "instance_id",
            "seen_at",
        );
        let instance = self.instance_id();
        let (members, rows) = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let now: i64 = sqlx::query_scalar(&presence)
                .bind(instance)
                .fetch_one(&mut *transaction)
                .await?;
            for chunk in reports.chunks(ROWS_PER_STATEMENT) {
                let sql = upsert_sql(chunk.len());
                let mut query = sqlx::query(&sql).bind(instance).bind(now);
                for report in chunk {
                    query = query
                        .bind(report.route_id)
                        .bind(report.key as i64)
                        .bind(report.demand_per_second);
                }
                query.execute(&mut *transaction).await?;
            }
            sqlx::query(DELETE_UNREPORTED_SQL)
                .bind(instance)
                .bind(now)
                .execute(&mut *transaction)
                .await?;
            for sql in [&forget_rows, &forget_members] {
                sqlx::query(sql)
                    .bind(now - FORGET_AFTER_MS)
                    .execute(&mut *transaction)
                    .await?;
            }
            let since = now - fresh_ms;
            let mut rows: Vec<(Id, i64, String, f64)> = Vec::new();
            for chunk in routes.chunks(ROUTES_PER_STATEMENT) {
                let sql = read_sql(chunk.len());
                let mut query = sqlx::query_as(&sql).bind(instance).bind(since);
                for route_id in chunk {
                    query = query.bind(*route_id);
                }
                rows.extend(query.fetch_all(&mut *transaction).await?);
            }
            let members: i64 = sqlx::query_scalar(MEMBERS_SQL)
                .bind(since)
                .fetch_one(&mut *transaction)
                .await?;
            transaction.commit().await?;
            (members, rows)
        });
        Ok(RateExchange {
            members: u32::try_from(members.max(1)).unwrap_or(u32::MAX),
            rows: rows
                .into_iter()
                .map(
                    |(route_id, key, instance_id, demand_per_second)| DemandRow {
                        route_id,
                        key: key as u64,
                        instance_id,
                        demand_per_second,
                    },
                )
                .collect(),
        })
    }

    /// Removes this instance's rows and presence (a graceful stop), so the others take its
    /// part of every rate at their next exchange instead of after the freshness window.
    pub async fn leave_rate_exchange(&self) -> Result<(), StoreError> {
        let instance = self.instance_id();
        on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            sqlx::query("DELETE FROM rate_limit_demand WHERE instance_id = $1")
                .bind(instance)
                .execute(&mut *transaction)
                .await?;
            sqlx::query("DELETE FROM rate_limit_members WHERE instance_id = $1")
                .bind(instance)
                .execute(&mut *transaction)
                .await?;
            transaction.commit().await?;
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upsert_names_each_row_once_with_finite_demand() {
        let report = |route_id, key, demand_per_second| DemandReport {
            route_id,
            key,
            demand_per_second,
        };
        let unique = unique_reports(&[
            report(2, 7, 1.0),
            report(1, u64::MAX, f64::NAN),
            report(2, 7, 3.0),
            report(1, 5, -1.0),
        ]);
        assert_eq!(
            unique,
            vec![
                report(1, 5, 0.0),
                report(1, u64::MAX, 0.0),
                report(2, 7, 3.0)
            ]
        );
    }

    #[test]
    fn statements_number_their_binds_in_order() {
        assert!(upsert_sql(2).contains("($3, $4, $1, $5, $2), ($6, $7, $1, $8, $2)"));
        assert!(read_sql(2).contains("route_id IN ($3, $4)"));
    }
}
