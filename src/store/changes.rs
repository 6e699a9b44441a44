//! "What changed since position N": the change log that triggers write (migrations 0008), and
//! the parts of the routing configuration it names, read at one instant.
//!
//! A position is opaque to callers. On SQLite (one writer, commit order = revision order) it is
//! the next revision a reader needs; on PostgreSQL it is the xmin of the snapshot the reader
//! last read with (see the migration for why a revision does not do there).

use std::collections::{BTreeSet, HashMap};

use super::rows::{RouteRow, ServiceRow, StandingRow, TargetRow};
use super::{certificates, convert_all, stream_routes, Backend, Store, StoreError};
use crate::model::{
    CertificateWithKey, DiscoverySource, Id, Route, RoutingConfig, Service, SourceProgress,
    SourceStanding, StreamRoute, Target,
};

/// Where a reader stands in the change log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ChangePosition(i64);

impl ChangePosition {
    pub(super) fn at(position: i64) -> ChangePosition {
        ChangePosition(position)
    }
}

/// What changed since a position.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ChangeSet {
    /// Reload everything: the log no longer reaches back to the position, or a table was
    /// emptied at once.
    pub everything: bool,
    /// Services whose row, targets or discovery sources changed (created, changed or deleted).
    pub services: BTreeSet<Id>,
    pub routes: bool,
    pub stream_routes: bool,
    pub certificates: bool,
}

impl ChangeSet {
    pub fn everything() -> ChangeSet {
        ChangeSet {
            everything: true,
            ..ChangeSet::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        !self.everything
            && self.services.is_empty()
            && !self.routes
            && !self.stream_routes
            && !self.certificates
    }

    /// Whether the parts of service `id` (its row, targets, sources) may have changed.
    pub fn touches_service(&self, id: Id) -> bool {
        self.everything || self.services.contains(&id)
    }

    pub fn merge(&mut self, other: ChangeSet) {
        self.everything |= other.everything;
        self.services.extend(other.services);
        self.routes |= other.routes;
        self.stream_routes |= other.stream_routes;
        self.certificates |= other.certificates;
    }

    fn note(&mut self, scope: &str, service_id: Option<Id>) {
        match (scope, service_id) {
            ("service", Some(id)) => {
                self.services.insert(id);
            }
            ("routes", _) => self.routes = true,
            ("stream_routes", _) => self.stream_routes = true,
            ("certificates", _) => self.certificates = true,
            // 'all', or a scope this version does not know: nothing is assumed unchanged.
            _ => self.everything = true,
        }
    }
}

/// One changed service as it is now: None if it was deleted (its targets and sources with it).
#[derive(Debug, Clone)]
pub struct ServiceParts {
    pub id: Id,
    pub service: Option<Service>,
    pub targets: Vec<Target>,
    pub sources: Vec<SourceStanding>,
}

/// The parts of the routing configuration that changed since a position, read in one
/// transaction, and the position to ask from next time.
#[derive(Debug, Clone)]
pub struct ConfigDelta {
    pub changes: ChangeSet,
    pub services: Vec<ServiceParts>,
    /// Set when routes changed: all of them.
    pub routes: Option<Vec<Route>>,
    pub stream_routes: Option<Vec<StreamRoute>>,
    pub certificates: Option<Vec<CertificateWithKey>>,
    pub position: ChangePosition,
}

/// Ids bound in one `IN (…)` list. However many services changed, only they are read: falling
/// back to reading everything past some count would make a busy control task slower exactly
/// when it is behind.
const IDS_PER_QUERY: usize = 500;

/// How long the log keeps a change: an instance that has not read it by then reloads everything.
pub const CHANGE_LOG_RETENTION_MS: i64 = 5 * 60 * 1000;

#[derive(sqlx::FromRow)]
struct ChangeRow {
    scope: String,
    service_id: Option<i64>,
}

impl Store {
    /// Everything the routing snapshot is built from, and the change-log position it was read
    /// at (in the same transaction, so nothing falls between the two).
    pub async fn load_routing_config_at(
        &self,
    ) -> Result<(RoutingConfig, ChangePosition), StoreError> {
        let (config, position) = self.load_routing_config_with(true).await?;
        // Without a position (never, as asked) the next read of changes reloads everything.
        Ok((config, position.unwrap_or(ChangePosition(0))))
    }

    /// What changed since `position`, with the changed parts as they are now. None when the
    /// caller must reload everything instead: the log was trimmed past `position`, a table was
    /// emptied, or the store is behind `position` (it is not the one `position` was read from).
    pub async fn changes_since(
        &self,
        position: ChangePosition,
    ) -> Result<Option<ConfigDelta>, StoreError> {
        let shared = self.is_shared();
        macro_rules! read_delta {
            ($pool:expr, $changes_sql:expr, $position_sql:expr) => {{
                let mut tx = $pool.begin().await?;
                if shared {
                    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                        .execute(&mut *tx)
                        .await?;
                }
                let next: i64 = sqlx::query_scalar($position_sql)
                    .fetch_one(&mut *tx)
                    .await?;
                let floor: i64 =
                    sqlx::query_scalar("SELECT position FROM config_change_floor WHERE id = 1")
                        .fetch_one(&mut *tx)
                        .await?;
                // Below the floor the log was trimmed past the position. Above the store's own
                // position it is another database under the same address (a restore, a failover
                // to a replica that lost the log's tail): positions only grow, so none of its
                // changes could be told apart from ones already read.
                if position.0 <= floor || position.0 > next {
                    return Ok(None);
                }
                let rows = sqlx::query_as::<_, ChangeRow>($changes_sql)
                    .bind(position.0)
                    .fetch_all(&mut *tx)
                    .await?;
                let mut changes = ChangeSet::default();
                for row in rows {
                    changes.note(&row.scope, row.service_id);
                }
                if changes.everything {
                    return Ok(None);
                }
                let ids: Vec<Id> = changes.services.iter().copied().collect();
                let mut services: Vec<ServiceRow> = Vec::new();
                let mut targets: Vec<TargetRow> = Vec::new();
                let mut sources: Vec<StandingRow> = Vec::new();
                for chunk in ids.chunks(IDS_PER_QUERY) {
                    services.extend(
                        sqlx::query_as::<_, ServiceRow>(&in_list(
                            "SELECT * FROM services WHERE id",
                            chunk.len(),
                        ))
                        .bind_all(chunk)
                        .fetch_all(&mut *tx)
                        .await?,
                    );
                    targets.extend(
                        sqlx::query_as::<_, TargetRow>(&in_list(
                            "SELECT * FROM targets WHERE service_id",
                            chunk.len(),
                        ))
                        .bind_all(chunk)
                        .fetch_all(&mut *tx)
                        .await?,
                    );
                    sources.extend(
                        sqlx::query_as::<_, StandingRow>(&in_list(
                            "SELECT id, service_id, name, enabled, state FROM discovery_sources \
                             WHERE service_id",
                            chunk.len(),
                        ))
                        .bind_all(chunk)
                        .fetch_all(&mut *tx)
                        .await?,
                    );
                }
                let routes: Option<Vec<RouteRow>> = if changes.routes {
                    Some(
                        sqlx::query_as(&format!(
                            "{} ORDER BY routes.id",
                            super::rows::ROUTE_SELECT
                        ))
                        .fetch_all(&mut *tx)
                        .await?,
                    )
                } else {
                    None
                };
                let stream_routes: Option<Vec<stream_routes::StreamRouteRow>> =
                    if changes.stream_routes {
                        Some(
                            sqlx::query_as("SELECT * FROM stream_routes ORDER BY id")
                                .fetch_all(&mut *tx)
                                .await?,
                        )
                    } else {
                        None
                    };
                let certificates: Option<Vec<certificates::CertificateRow>> =
                    if changes.certificates {
                        Some(
                            sqlx::query_as("SELECT * FROM certificates ORDER BY id")
                                .fetch_all(&mut *tx)
                                .await?,
                        )
                    } else {
                        None
                    };
                tx.commit().await?;
                (
                    changes,
                    ChangePosition(next),
                    services,
                    targets,
                    sources,
                    routes,
                    stream_routes,
                    certificates,
                )
            }};
        }
        let (changes, next, services, targets, sources, routes, stream_routes, certificates) =
            match &self.backend {
                Backend::Sqlite(pool) => read_delta!(
                    pool,
                    "SELECT scope, service_id FROM config_changes WHERE revision >= $1",
                    SQLITE_POSITION
                ),
                Backend::Postgres(pool) => read_delta!(
                    pool,
                    "SELECT scope, service_id FROM config_changes \
                     WHERE xid >= ($1::BIGINT)::TEXT::xid8",
                    POSTGRES_POSITION
                ),
            };
        // Grouped by service once: filtering every row per changed service was quadratic (a
        // file creating 5,000 services of 20 targets took 5·10⁸ steps here).
        let mut services: HashMap<Id, Service> = convert_all::<_, Service>(services)?
            .into_iter()
            .map(|service| (service.id, service))
            .collect();
        let mut targets_of: HashMap<Id, Vec<Target>> = HashMap::new();
        for target in convert_all::<_, Target>(targets)? {
            targets_of
                .entry(target.service_id)
                .or_default()
                .push(target);
        }
        let mut sources_of: HashMap<Id, Vec<SourceStanding>> = HashMap::new();
        for source in convert_all::<_, SourceStanding>(sources)? {
            sources_of
                .entry(source.service_id)
                .or_default()
                .push(source);
        }
        let parts = changes
            .services
            .iter()
            .map(|&id| ServiceParts {
                id,
                service: services.remove(&id),
                targets: targets_of.remove(&id).unwrap_or_default(),
                sources: sources_of.remove(&id).unwrap_or_default(),
            })
            .collect();
        Ok(Some(ConfigDelta {
            changes,
            services: parts,
            routes: routes.map(convert_all).transpose()?,
            stream_routes: stream_routes.map(convert_all).transpose()?,
            certificates: certificates.map(convert_all).transpose()?,
            position: next,
        }))
    }

    /// The discovery sources of `services`, with their progress.
    pub async fn sources_of_services(
        &self,
        services: &[Id],
    ) -> Result<Vec<(DiscoverySource, SourceProgress)>, StoreError> {
        if services.is_empty() {
            return Ok(Vec::new());
        }
        let sql = in_list(
            "SELECT * FROM discovery_sources WHERE service_id",
            services.len(),
        );
        on_pool!(self, |pool| sqlx::query_as::<_, super::rows::SourceRow>(
            &sql
        )
        .bind_all(services)
        .fetch_all(pool)
        .await)?
        .into_iter()
        .map(super::rows::SourceRow::into_parts)
        .collect()
    }

    /// Forgets changes older than [`CHANGE_LOG_RETENTION_MS`]; returns how many. A reader whose
    /// position falls behind what was forgotten reloads everything.
    pub async fn trim_change_log(&self) -> Result<u64, StoreError> {
        let cutoff = super::now_ms() - CHANGE_LOG_RETENTION_MS;
        macro_rules! trim {
            ($pool:expr, $delete_sql:expr) => {{
                let mut tx = $pool.begin().await?;
                let trimmed: Vec<i64> = sqlx::query_scalar($delete_sql)
                    .bind(cutoff)
                    .fetch_all(&mut *tx)
                    .await?;
                if let Some(highest) = trimmed.iter().max() {
                    sqlx::query(
                        "UPDATE config_change_floor SET position = $1 \
                         WHERE id = 1 AND position < $1",
                    )
                    .bind(highest)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                trimmed.len() as u64
            }};
        }
        Ok(match &self.backend {
            Backend::Sqlite(pool) => trim!(
                pool,
                "DELETE FROM config_changes WHERE at_ms < $1 RETURNING revision"
            ),
            Backend::Postgres(pool) => trim!(
                pool,
                "DELETE FROM config_changes WHERE at_ms < $1 RETURNING xid::TEXT::BIGINT"
            ),
        })
    }
}

/// The next revision a SQLite reader needs (AUTOINCREMENT never reuses one, even once trimmed).
pub(super) const SQLITE_POSITION: &str = "SELECT COALESCE((SELECT seq FROM sqlite_sequence \
     WHERE name = 'config_changes'), 0) + 1";
/// Every transaction below this one had ended when the reader's snapshot was taken.
pub(super) const POSTGRES_POSITION: &str =
    "SELECT pg_snapshot_xmin(pg_current_snapshot())::TEXT::BIGINT";

/// `<head> IN ($1, …, $count)`: the text depends only on how many ids, never on their values.
fn in_list(head: &str, count: usize) -> String {
    let mut sql = String::with_capacity(head.len() + 8 + count * 6);
    sql.push_str(head);
    sql.push_str(" IN (");
    for n in 1..=count {
        if n > 1 {
            sql.push_str(", ");
        }
        sql.push('$');
        sql.push_str(&n.to_string());
    }
    sql.push_str(") ORDER BY id");
    sql
}

/// Binds every id, in order, to a query built with [`in_list`].
trait BindAll: Sized {
    fn bind_all(self, ids: &[Id]) -> Self;
}

impl<'q, DB, O> BindAll for sqlx::query::QueryAs<'q, DB, O, <DB as sqlx::Database>::Arguments<'q>>
where
    DB: sqlx::Database,
    i64: sqlx::Encode<'q, DB> + sqlx::Type<DB>,
{
    fn bind_all(self, ids: &[Id]) -> Self {
        ids.iter().fold(self, |query, id| query.bind(*id))
    }
}
