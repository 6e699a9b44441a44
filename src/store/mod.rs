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
//! everywhere. [`on_pool!`] compiles each query once per driver, so rows decode with each
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

mod certificates;
mod leases;
mod rows;
mod sources;
mod stream_routes;
#[cfg(test)]
#[path = "../../tests/common/postgres.rs"]
mod test_postgres;
pub use certificates::NewCertificate;
pub use sources::ManagedKind;

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{PgPool, SqlitePool};

use crate::model::{
    Id, Route, RouteSpec, RoutingConfig, Service, ServiceSpec, Target, TargetSpec, Token, TokenSpec,
};
use rows::{RouteRow, ServiceRow, TargetRow, TokenRow};

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
        field: &'static str,
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
    Utc::now().timestamp_millis()
}

/// The name this process uses when none is configured: the host name and a random suffix, so two
/// instances on one host (or two in one test process) never share it.
pub fn default_instance_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|name| {
            // Within PostgreSQL's 63-byte application_name, printable ASCII only.
            name.trim()
                .chars()
                .filter(|c| c.is_ascii_graphic())
                .take(48)
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "raahi".to_owned());
    format!("{host}-{:06x}", fastrand::u32(..0x100_0000))
}

/// How long a PostgreSQL call waits for a connection: during a database outage, admin calls and
/// background jobs fail after this instead of queueing for sqlx's default 30 s.
const POSTGRES_ACQUIRE_TIMEOUT: Duration = Duration::from_secs(5);
const POSTGRES_POOL_SIZE: u32 = 10;

impl Store {
    /// Opens (creating if needed) the database at `url` and applies pending migrations, as an
    /// instance with a generated id.
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        Self::connect_as(url, &default_instance_id()).await
    }

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
        let shared = self.is_shared();
        let (services, targets, sources, routes, stream_routes, certificates) =
            on_pool!(self, |pool| {
                let mut transaction = pool.begin().await?;
                if shared {
                    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                        .execute(&mut *transaction)
                        .await?;
                }
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
                let routes = sqlx::query_as::<_, RouteRow>("SELECT * FROM routes ORDER BY id")
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
                    services,
                    targets,
                    sources,
                    routes,
                    stream_routes,
                    certificates,
                )
            });
        Ok(RoutingConfig {
            services: convert_all(services)?,
            targets: convert_all(targets)?,
            sources: convert_all(sources)?,
            routes: convert_all(routes)?,
            stream_routes: convert_all(stream_routes)?,
            certificates: certificates
                .into_iter()
                .map(certificates::CertificateRow::into_parts)
                .collect::<Result<_, _>>()?,
        })
    }

    // ----- services -----

    pub async fn list_services(&self, page: Page) -> Result<Vec<Service>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, ServiceRow>(
            "SELECT * FROM services WHERE id > $1 ORDER BY id LIMIT $2",
        )
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn get_service(&self, id: Id) -> Result<Service, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, ServiceRow>(
            "SELECT * FROM services WHERE id = $1"
        )
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound {
            kind: "service",
            id,
        })?
        .try_into()
    }

    pub async fn create_service(&self, spec: &ServiceSpec) -> Result<Service, StoreError> {
        let now = now_ms();
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO services (name, protocol, upstream_authority, tls_sni, tls_verify, tls_ca_pem,
                lb_policy, connect_timeout_ms, response_header_timeout_ms, idle_timeout_ms,
                max_attempts, health_check, ejection, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) RETURNING id",
        )
        .bind(&spec.name)
        .bind(spec.protocol.as_str())
        .bind(&spec.upstream_authority)
        .bind(&spec.tls_sni)
        .bind(spec.tls_verify)
        .bind(&spec.tls_ca_pem)
        .bind(spec.lb_policy.as_str())
        .bind(spec.timeouts.connect_ms as i64)
        .bind(spec.timeouts.response_header_ms as i64)
        .bind(spec.timeouts.idle_ms as i64)
        .bind(i64::from(spec.max_attempts))
        .bind(spec.health_check.as_ref().map(json_value))
        .bind(json_value(&spec.ejection))
        .bind(now)
        .bind(now)
        .fetch_one(pool)
        .await)
        .map_err(|e| unique_name_conflict(e, "service", &spec.name))?;
        self.get_service(id).await
    }

    pub async fn update_service(&self, id: Id, spec: &ServiceSpec) -> Result<Service, StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "UPDATE services SET name = $1, protocol = $2, upstream_authority = $3, tls_sni = $4,
                tls_verify = $5, tls_ca_pem = $6, lb_policy = $7, connect_timeout_ms = $8, response_header_timeout_ms = $9,
                idle_timeout_ms = $10, max_attempts = $11, health_check = $12, ejection = $13, updated_at = $14
             WHERE id = $15",
        )
        .bind(&spec.name)
        .bind(spec.protocol.as_str())
        .bind(&spec.upstream_authority)
        .bind(&spec.tls_sni)
        .bind(spec.tls_verify)
        .bind(&spec.tls_ca_pem)
        .bind(spec.lb_policy.as_str())
        .bind(spec.timeouts.connect_ms as i64)
        .bind(spec.timeouts.response_header_ms as i64)
        .bind(spec.timeouts.idle_ms as i64)
        .bind(i64::from(spec.max_attempts))
        .bind(spec.health_check.as_ref().map(json_value))
        .bind(json_value(&spec.ejection))
        .bind(now_ms())
        .bind(id)
        .execute(pool)
        .await
.map(|done| done.rows_affected()))
        .map_err(|e| unique_name_conflict(e, "service", &spec.name))?;
        found(affected, "service", id)?;
        self.get_service(id).await
    }

    /// Deletes a service and its targets; refused while a route still sends traffic to it.
    pub async fn delete_service(&self, id: Id) -> Result<(), StoreError> {
        let route_names: Vec<(String,)> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT name FROM routes WHERE service_id = $1 ORDER BY id LIMIT 5"
        )
        .bind(id)
        .fetch_all(pool)
        .await)?;
        if !route_names.is_empty() {
            let names: Vec<String> = route_names.into_iter().map(|(name,)| name).collect();
            return Err(StoreError::Conflict {
                field: "id",
                message: format!(
                    "service {id} is used by route(s) {}; delete or move them first",
                    names.join(", ")
                ),
            });
        }
        let stream_routes: Vec<(i64, String)> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT id, listen FROM stream_routes WHERE service_id = $1 ORDER BY id LIMIT 5",
        )
        .bind(id)
        .fetch_all(pool)
        .await)?;
        if !stream_routes.is_empty() {
            let routes: Vec<String> = stream_routes
                .into_iter()
                .map(|(route_id, listen)| format!("{route_id} ({listen})"))
                .collect();
            return Err(StoreError::Conflict {
                field: "id",
                message: format!(
                    "service {id} is used by stream route(s) {}; delete or move them first",
                    routes.join(", ")
                ),
            });
        }
        let affected = on_pool!(self, |pool| sqlx::query(
            "DELETE FROM services WHERE id = $1"
        )
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))
        .map_err(|error| {
            // A route created between the check above and this delete.
            foreign_key(error, "id", format!("service {id} is used by a route"))
        })?;
        found(affected, "service", id)?;
        Ok(())
    }

    // ----- targets -----

    pub async fn list_targets(
        &self,
        service_id: Id,
        page: Page,
    ) -> Result<Vec<Target>, StoreError> {
        self.get_service(service_id).await?;
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, TargetRow>(
            "SELECT * FROM targets WHERE service_id = $1 AND id > $2 ORDER BY id LIMIT $3",
        )
        .bind(service_id)
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn get_target(&self, id: Id) -> Result<Target, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, TargetRow>(
            "SELECT * FROM targets WHERE id = $1"
        )
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound { kind: "target", id })?
        .try_into()
    }

    /// Creates an operator target (no discovery source) in `service_id`.
    pub async fn create_target(
        &self,
        service_id: Id,
        spec: &TargetSpec,
    ) -> Result<Target, StoreError> {
        self.get_service(service_id).await?;
        let now = now_ms();
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO targets (service_id, source_id, host, port, weight, priority, enabled, metadata,
                provider_key, state, health, ejected_until, created_at, updated_at)
             VALUES ($1, NULL, $2, $3, $4, $5, $6, $7, NULL, 'active', 'unknown', NULL, $8, $9) RETURNING id",
        )
        .bind(service_id)
        .bind(&spec.host)
        .bind(i64::from(spec.port))
        .bind(i64::from(spec.weight))
        .bind(i64::from(spec.priority))
        .bind(spec.enabled)
        .bind(spec.metadata.to_string())
        .bind(now)
        .bind(now)
        .fetch_one(pool)
        .await)
        .map_err(|error| {
            foreign_key(error, "service_id", format!("service {service_id} was deleted"))
        })?;
        self.get_target(id).await
    }

    pub async fn update_target(&self, id: Id, spec: &TargetSpec) -> Result<Target, StoreError> {
        let affected = on_pool!(self, |pool| {
            sqlx::query(
            "UPDATE targets SET host = $1, port = $2, weight = $3, priority = $4, enabled = $5, metadata = $6,
                updated_at = $7
             WHERE id = $8",
        )
        .bind(&spec.host)
        .bind(i64::from(spec.port))
        .bind(i64::from(spec.weight))
        .bind(i64::from(spec.priority))
        .bind(spec.enabled)
        .bind(spec.metadata.to_string())
        .bind(now_ms())
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected())
        })?;
        found(affected, "target", id)?;
        self.get_target(id).await
    }

    pub async fn delete_target(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "DELETE FROM targets WHERE id = $1"
        )
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))?;
        found(affected, "target", id)?;
        Ok(())
    }

    // ----- routes -----

    pub async fn list_routes(&self, page: Page) -> Result<Vec<Route>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, RouteRow>(
            "SELECT * FROM routes WHERE id > $1 ORDER BY id LIMIT $2"
        )
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn get_route(&self, id: Id) -> Result<Route, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, RouteRow>(
            "SELECT * FROM routes WHERE id = $1"
        )
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound { kind: "route", id })?
        .try_into()
    }

    pub async fn create_route(&self, spec: &RouteSpec) -> Result<Route, StoreError> {
        self.require_service_for_route(spec.service_id).await?;
        let now = now_ms();
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO routes (name, hosts, path_prefix, methods, service_id, preserve_host,
                strip_prefix, priority, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING id",
        )
        .bind(&spec.name)
        .bind(json_text(&spec.hosts))
        .bind(&spec.path_prefix)
        .bind(json_text(&spec.methods))
        .bind(spec.service_id)
        .bind(spec.preserve_host)
        .bind(spec.strip_prefix)
        .bind(i64::from(spec.priority))
        .bind(now)
        .bind(now)
        .fetch_one(pool)
        .await)
        .map_err(|e| unique_name_conflict(e, "route", &spec.name))
        .map_err(|e| match e {
            StoreError::Database(error) => foreign_key(
                error,
                "service_id",
                format!("service {} was deleted", spec.service_id),
            ),
            other => other,
        })?;
        self.get_route(id).await
    }

    pub async fn update_route(&self, id: Id, spec: &RouteSpec) -> Result<Route, StoreError> {
        self.require_service_for_route(spec.service_id).await?;
        let affected = on_pool!(self, |pool| sqlx::query(
            "UPDATE routes SET name = $1, hosts = $2, path_prefix = $3, methods = $4, service_id = $5,
                preserve_host = $6, strip_prefix = $7, priority = $8, updated_at = $9
             WHERE id = $10",
        )
        .bind(&spec.name)
        .bind(json_text(&spec.hosts))
        .bind(&spec.path_prefix)
        .bind(json_text(&spec.methods))
        .bind(spec.service_id)
        .bind(spec.preserve_host)
        .bind(spec.strip_prefix)
        .bind(i64::from(spec.priority))
        .bind(now_ms())
        .bind(id)
        .execute(pool)
        .await
.map(|done| done.rows_affected()))
        .map_err(|e| unique_name_conflict(e, "route", &spec.name))
        .map_err(|e| match e {
            StoreError::Database(error) => foreign_key(
                error,
                "service_id",
                format!("service {} was deleted", spec.service_id),
            ),
            other => other,
        })?;
        found(affected, "route", id)?;
        self.get_route(id).await
    }

    pub async fn delete_route(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query("DELETE FROM routes WHERE id = $1")
            .bind(id)
            .execute(pool)
            .await
            .map(|done| done.rows_affected()))?;
        found(affected, "route", id)?;
        Ok(())
    }

    async fn require_service_for_route(&self, service_id: Id) -> Result<(), StoreError> {
        match self.get_service(service_id).await {
            Ok(_) => Ok(()),
            Err(StoreError::NotFound { .. }) => Err(StoreError::InvalidReference {
                field: "service_id",
                message: format!("service {service_id} does not exist"),
            }),
            Err(other) => Err(other),
        }
    }

    // ----- tokens -----

    pub async fn count_tokens(&self) -> Result<i64, StoreError> {
        let (count,): (i64,) =
            on_pool!(self, |pool| sqlx::query_as("SELECT COUNT(*) FROM tokens")
                .fetch_one(pool)
                .await)?;
        Ok(count)
    }

    pub async fn list_tokens(&self, page: Page) -> Result<Vec<Token>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, TokenRow>(
            "SELECT * FROM tokens WHERE id > $1 ORDER BY id LIMIT $2"
        )
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    /// Stores a token by the hash of its secret; the secret itself is never stored.
    pub async fn create_token(
        &self,
        spec: &TokenSpec,
        token_hash: &str,
    ) -> Result<Token, StoreError> {
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO tokens (name, role, token_hash, created_at) VALUES ($1, $2, $3, $4) RETURNING id",
        )
        .bind(&spec.name)
        .bind(spec.role.as_str())
        .bind(token_hash)
        .bind(now_ms())
        .fetch_one(pool)
        .await)
        .map_err(|e| unique_name_conflict(e, "token", &spec.name))?;
        let row = on_pool!(self, |pool| sqlx::query_as::<_, TokenRow>(
            "SELECT * FROM tokens WHERE id = $1"
        )
        .bind(id)
        .fetch_one(pool)
        .await)?;
        row.try_into()
    }

    /// Creates the token `spec.name`, or gives an existing one of that name this hash and role.
    pub async fn upsert_token_by_name(
        &self,
        spec: &TokenSpec,
        token_hash: &str,
    ) -> Result<(), StoreError> {
        on_pool!(self, |pool| {
            sqlx::query(
            "INSERT INTO tokens (name, role, token_hash, created_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT(name) DO UPDATE SET token_hash = excluded.token_hash, role = excluded.role",
        )
        .bind(&spec.name)
        .bind(spec.role.as_str())
        .bind(token_hash)
        .bind(now_ms())
        .execute(pool)
        .await
        .map(|done| done.rows_affected())
        })?;
        Ok(())
    }

    pub async fn find_token_by_hash(&self, token_hash: &str) -> Result<Option<Token>, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, TokenRow>(
            "SELECT * FROM tokens WHERE token_hash = $1"
        )
        .bind(token_hash)
        .fetch_optional(pool)
        .await)?
        .map(Token::try_from)
        .transpose()
    }

    pub async fn delete_token(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query("DELETE FROM tokens WHERE id = $1")
            .bind(id)
            .execute(pool)
            .await
            .map(|done| done.rows_affected()))?;
        found(affected, "token", id)?;
        Ok(())
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
