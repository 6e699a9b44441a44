//! Persistence of the desired state (services, targets, routes, tokens) with sqlx, on SQLite or
//! PostgreSQL.
//!
//! SQLite is the embedded default: WAL journal, a busy timeout and a single writer connection so
//! concurrent admin calls queue instead of failing with "database is locked". PostgreSQL
//! (`postgres://`) lets several gateway instances share one store: a normal pool, connections
//! named after the instance (`application_name`, which the change-notification triggers send as
//! their payload), and source leases (`leases.rs`).
//!
//! Both backends run the same SQL text: `$N` placeholders (sqlx's SQLite driver binds `$N` by
//! number), `RETURNING id` instead of a driver-specific last insert id, 64-bit integers
//! everywhere. `on_pool!` compiles each query once per driver, so rows decode with each
//! driver's native types.

/// Runs `$body` with `$pool` bound to the store's pool, once per backend: the same query text and
/// binds compile against each driver.
macro_rules! on_pool {
    ($store:expr, |$pool:ident| $body:expr) => {
        match &$store.backend {
            $crate::store::Backend::Sqlite($pool) => $body,
            $crate::store::Backend::Postgres($pool) => $body,
        }
    };
}

mod acceptances;
mod canary;
mod certificates;
mod changes;
mod leases;
mod rate_limits;
mod routes;
mod rows;
mod services;
mod sources;
mod stream_routes;
mod targets;
#[cfg(test)]
#[path = "../../tests/common/postgres.rs"]
mod test_postgres;
mod tokens;
pub use acceptances::{AcceptanceApplied, AcceptanceWrite, PendingAcceptance};
pub use canary::{canary_key, CountsReport, JudgedCanary};
pub use certificates::NewCertificate;
pub use changes::{ChangePosition, ChangeSet, ConfigDelta, ServiceParts, CHANGE_LOG_RETENTION_MS};
pub use rate_limits::{DemandReport, DemandRow, RateExchange};
pub use sources::ManagedKind;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

use crate::model::{Id, RoutingConfig};
use rows::{RouteRow, ServiceRow, TargetRow};

/// Why a store call failed: the caller's request (not found, conflict, invalid reference) or the
/// database itself (worth a retry later).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{kind} {id} not found")]
    NotFound { kind: &'static str, id: Id },
    #[error("{message}")]
    Conflict {
        field: &'static str,
        message: String,
    },
    #[error("{message}")]
    InvalidReference {
        field: std::borrow::Cow<'static, str>,
        message: String,
    },
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error(
        "unsupported database url {0:?}: expected sqlite://PATH, sqlite::memory: or postgres://..."
    )]
    UnsupportedUrl(String),
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    #[error("database migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
}

/// One page of a list: at most `limit` objects with ids greater than `after`.
#[derive(Debug, Clone, Copy)]
pub struct Page {
    pub limit: u32,
    pub after: Option<Id>,
}

impl Page {
    fn after_id(&self) -> Id {
        self.after.unwrap_or(0)
    }
}

#[derive(Clone)]
pub(crate) enum Backend {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

#[derive(Clone)]
pub struct Store {
    backend: Backend,
    /// Names this gateway instance in source leases and as the PostgreSQL `application_name`.
    instance_id: Arc<str>,
}

pub(crate) fn now_ms() -> i64 {
    crate::clock::now().timestamp_millis()
}

/// How long a PostgreSQL call waits for a connection: during a database outage, admin calls and
/// background jobs fail after this instead of queueing for sqlx's default 30 s.
const POSTGRES_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
const POSTGRES_POOL_SIZE: u32 = 10;

impl Store {
    /// Opens the database at `url` as gateway instance `instance_id` and applies pending
    /// migrations. `sqlite:` URLs open SQLite, `postgres://` and `postgresql://` PostgreSQL.
    pub async fn connect_as(url: &str, instance_id: &str) -> Result<Store, StoreError> {
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite(connect_sqlite(url).await?)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres(connect_postgres(url, instance_id).await?)
        } else {
            return Err(StoreError::UnsupportedUrl(url.to_owned()));
        };
        Ok(Store {
            backend,
            instance_id: instance_id.into(),
        })
    }

    /// Whether several gateway instances may share this store (PostgreSQL).
    pub fn is_shared(&self) -> bool {
        matches!(self.backend, Backend::Postgres(_))
    }

    pub fn instance_id(&self) -> &str {
        &self.instance_id
    }

    /// The PostgreSQL pool, for LISTEN (None on SQLite).
    pub fn postgres_pool(&self) -> Option<&PgPool> {
        match &self.backend {
            Backend::Postgres(pool) => Some(pool),
            Backend::Sqlite(_) => None,
        }
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        on_pool!(self, |pool| sqlx::query("SELECT 1")
            .execute(pool)
            .await
            .map(|done| done.rows_affected()))?;
        Ok(())
    }

    /// Everything the routing snapshot is built from.
    /// Read in one transaction (on PostgreSQL a repeatable-read one): the tables are seen at one
    /// moment, so a route is never read without the service it was written with.
    pub async fn load_routing_config(&self) -> Result<RoutingConfig, StoreError> {
        Ok(self.load_routing_config_with(false).await?.0)
    }

    /// The routing configuration and, when `with_position`, the change-log position it was
    /// read at.
    async fn load_routing_config_with(
        &self,
        with_position: bool,
    ) -> Result<(RoutingConfig, Option<changes::ChangePosition>), StoreError> {
        let shared = self.is_shared();
        let position_sql = match self.backend {
            Backend::Sqlite(_) => changes::SQLITE_POSITION,
            Backend::Postgres(_) => changes::POSTGRES_POSITION,
        };
        let (position, services, targets, sources, routes, stream_routes, certificates) =
            on_pool!(self, |pool| {
                let mut transaction = pool.begin().await?;
                if shared {
                    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                        .execute(&mut *transaction)
                        .await?;
                }
                let position: Option<i64> = if with_position {
                    Some(
                        sqlx::query_scalar(position_sql)
                            .fetch_one(&mut *transaction)
                            .await?,
                    )
                } else {
                    None
                };
                let services =
                    sqlx::query_as::<_, ServiceRow>("SELECT * FROM services ORDER BY id")
                        .fetch_all(&mut *transaction)
                        .await?;
                let targets = sqlx::query_as::<_, TargetRow>("SELECT * FROM targets ORDER BY id")
                    .fetch_all(&mut *transaction)
                    .await?;
                let sources = sqlx::query_as::<_, rows::StandingRow>(
                "SELECT id, service_id, name, enabled, state FROM discovery_sources ORDER BY id",
            )
            .fetch_all(&mut *transaction)
            .await?;
                let routes = sqlx::query_as::<_, RouteRow>(&format!(
                    "{} ORDER BY routes.id",
                    rows::ROUTE_SELECT
                ))
                .fetch_all(&mut *transaction)
                .await?;
                let stream_routes = sqlx::query_as::<_, stream_routes::StreamRouteRow>(
                    "SELECT * FROM stream_routes ORDER BY id",
                )
                .fetch_all(&mut *transaction)
                .await?;
                let certificates = sqlx::query_as::<_, certificates::CertificateRow>(
                    "SELECT * FROM certificates ORDER BY id",
                )
                .fetch_all(&mut *transaction)
                .await?;
                transaction.commit().await?;
                (
                    position,
                    services,
                    targets,
                    sources,
                    routes,
                    stream_routes,
                    certificates,
                )
            });
        let config = RoutingConfig {
            services: convert_all(services)?,
            targets: convert_all(targets)?,
            sources: convert_all(sources)?,
            routes: convert_all(routes)?,
            stream_routes: convert_all(stream_routes)?,
            certificates: convert_all(certificates)?,
        };
        Ok((config, position.map(changes::ChangePosition::at)))
    }
}

async fn connect_sqlite(url: &str) -> Result<SqlitePool, StoreError> {
    if let Some(parent) = sqlite_file_parent(url) {
        std::fs::create_dir_all(&parent).map_err(|error| {
            StoreError::Database(sqlx::Error::Configuration(
                format!("cannot create {}: {error}", parent.display()).into(),
            ))
        })?;
    }
    let options = SqliteConnectOptions::from_str(url)?
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_secs(5))
        .foreign_keys(true);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await?;
    sqlx::migrate!("./migrations/sqlite").run(&pool).await?;
    Ok(pool)
}

async fn connect_postgres(url: &str, instance_id: &str) -> Result<PgPool, StoreError> {
    let options = PgConnectOptions::from_str(url)?.application_name(instance_id);
    let pool = PgPoolOptions::new()
        .max_connections(POSTGRES_POOL_SIZE)
        .acquire_timeout(POSTGRES_ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await?;
    // sqlx takes an advisory lock around migrations, so instances may start together.
    // An instance of an older version must still start (and a rollout be rolled back) after a
    // newer one applied migrations it does not know; migrations are additive.
    let mut migrator = sqlx::migrate!("./migrations/postgres");
    migrator.set_ignore_missing(true);
    migrator.run(&pool).await?;
    Ok(pool)
}

/// A write that touched no row: the object does not exist (any more).
fn found(affected: u64, kind: &'static str, id: Id) -> Result<(), StoreError> {
    if affected == 0 {
        return Err(StoreError::NotFound { kind, id });
    }
    Ok(())
}

fn convert_all<R, T>(rows: Vec<R>) -> Result<Vec<T>, StoreError>
where
    T: TryFrom<R, Error = StoreError>,
{
    rows.into_iter().map(T::try_from).collect()
}

fn json_value<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("plain data always serialises")
}

fn json_text(values: &[String]) -> String {
    serde_json::to_string(values).expect("a list of strings always serialises")
}

/// A foreign-key violation is a conflict with another write, not a store failure.
fn foreign_key(error: sqlx::Error, field: &'static str, message: String) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            StoreError::Conflict { field, message }
        }
        _ => StoreError::Database(error),
    }
}

fn unique_name_conflict(error: sqlx::Error, kind: &'static str, name: &str) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
            field: "name",
            message: format!("a {kind} named {name:?} already exists"),
        },
        _ => StoreError::Database(error),
    }
}

/// The folder a `sqlite://path/to/file.db` URL lives in, so a fresh machine can start without
/// creating `data/` by hand.
fn sqlite_file_parent(url: &str) -> Option<std::path::PathBuf> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))?;
    let path = rest.split('?').next().unwrap_or("");
    if path.is_empty() || path == ":memory:" {
        return None;
    }
    let parent = std::path::Path::new(path).parent()?;
    (!parent.as_os_str().is_empty()).then(|| parent.to_path_buf())
}

#[cfg(test)]
mod tests;
