//! Persistence of the desired state (services, targets, routes, tokens) with sqlx.
//!
//! SQLite is the embedded default: WAL journal, a busy timeout and a single writer connection so
//! concurrent admin calls queue instead of failing with "database is locked".

mod certificates;
mod rows;
mod sources;
mod stream_routes;
pub use certificates::NewCertificate;
pub use sources::ManagedKind;

use std::str::FromStr;
use std::time::Duration;

use chrono::Utc;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;

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
    #[error("unsupported database url {0:?}: expected sqlite://PATH or sqlite::memory:")]
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
pub struct Store {
    pool: SqlitePool,
}

pub(crate) fn now_ms() -> i64 {
    Utc::now().timestamp_millis()
}

impl Store {
    /// Opens (creating if needed) the database at `url` and applies pending migrations.
    pub async fn connect(url: &str) -> Result<Store, StoreError> {
        if !url.starts_with("sqlite:") {
            return Err(StoreError::UnsupportedUrl(url.to_owned()));
        }
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
        Ok(Store { pool })
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    /// Everything the routing snapshot is built from.
    pub async fn load_routing_config(&self) -> Result<RoutingConfig, StoreError> {
        let services = sqlx::query_as::<_, ServiceRow>("SELECT * FROM services ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        let targets = sqlx::query_as::<_, TargetRow>("SELECT * FROM targets ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        let routes = sqlx::query_as::<_, RouteRow>("SELECT * FROM routes ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        Ok(RoutingConfig {
            services: convert_all(services)?,
            targets: convert_all(targets)?,
            routes: convert_all(routes)?,
            stream_routes: self.all_stream_routes().await?,
            certificates: self.all_certificates_with_keys().await?,
        })
    }

    // ----- services -----

    pub async fn list_services(&self, page: Page) -> Result<Vec<Service>, StoreError> {
        let rows = sqlx::query_as::<_, ServiceRow>(
            "SELECT * FROM services WHERE id > ? ORDER BY id LIMIT ?",
        )
        .bind(page.after_id())
        .bind(page.limit)
        .fetch_all(&self.pool)
        .await?;
        convert_all(rows)
    }

    pub async fn get_service(&self, id: Id) -> Result<Service, StoreError> {
        sqlx::query_as::<_, ServiceRow>("SELECT * FROM services WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound {
                kind: "service",
                id,
            })?
            .try_into()
    }

    pub async fn create_service(&self, spec: &ServiceSpec) -> Result<Service, StoreError> {
        let now = now_ms();
        let result = sqlx::query(
            "INSERT INTO services (name, protocol, upstream_authority, tls_sni, tls_verify, tls_ca_pem,
                lb_policy, connect_timeout_ms, response_header_timeout_ms, idle_timeout_ms,
                max_attempts, health_check, ejection, created_at, updated_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
        .bind(spec.max_attempts)
        .bind(spec.health_check.as_ref().map(json_value))
        .bind(json_value(&spec.ejection))
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(|e| unique_name_conflict(e, "service", &spec.name))?;
        self.get_service(result.last_insert_rowid()).await
    }

    pub async fn update_service(&self, id: Id, spec: &ServiceSpec) -> Result<Service, StoreError> {
        let result = sqlx::query(
            "UPDATE services SET name = ?, protocol = ?, upstream_authority = ?, tls_sni = ?,
                tls_verify = ?, tls_ca_pem = ?, lb_policy = ?, connect_timeout_ms = ?, response_header_timeout_ms = ?,
                idle_timeout_ms = ?, max_attempts = ?, health_check = ?, ejection = ?, updated_at = ?
             WHERE id = ?",
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
        .bind(spec.max_attempts)
        .bind(spec.health_check.as_ref().map(json_value))
        .bind(json_value(&spec.ejection))
        .bind(now_ms())
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(|e| unique_name_conflict(e, "service", &spec.name))?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "service",
                id,
            });
        }
        self.get_service(id).await
    }

    /// Deletes a service and its targets; refused while a route still sends traffic to it.
    pub async fn delete_service(&self, id: Id) -> Result<(), StoreError> {
        let route_names: Vec<(String,)> =
            sqlx::query_as("SELECT name FROM routes WHERE service_id = ? ORDER BY id LIMIT 5")
                .bind(id)
                .fetch_all(&self.pool)
                .await?;
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
        let stream_routes: Vec<(i64, String)> = sqlx::query_as(
            "SELECT id, listen FROM stream_routes WHERE service_id = ? ORDER BY id LIMIT 5",
        )
        .bind(id)
        .fetch_all(&self.pool)
        .await?;
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
        let result = sqlx::query("DELETE FROM services WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(|error| {
                // A route created between the check above and this delete.
                foreign_key(error, "id", format!("service {id} is used by a route"))
            })?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "service",
                id,
            });
        }
        Ok(())
    }

    // ----- targets -----

    pub async fn list_targets(
        &self,
        service_id: Id,
        page: Page,
    ) -> Result<Vec<Target>, StoreError> {
        self.get_service(service_id).await?;
        let rows = sqlx::query_as::<_, TargetRow>(
            "SELECT * FROM targets WHERE service_id = ? AND id > ? ORDER BY id LIMIT ?",
        )
        .bind(service_id)
        .bind(page.after_id())
        .bind(page.limit)
        .fetch_all(&self.pool)
        .await?;
        convert_all(rows)
    }

    pub async fn get_target(&self, id: Id) -> Result<Target, StoreError> {
        sqlx::query_as::<_, TargetRow>("SELECT * FROM targets WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
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
        let result = sqlx::query(
            "INSERT INTO targets (service_id, source_id, host, port, weight, priority, enabled, metadata,
                provider_key, state, health, ejected_until, created_at, updated_at)
             VALUES (?, NULL, ?, ?, ?, ?, ?, ?, NULL, 'active', 'unknown', NULL, ?, ?)",
        )
        .bind(service_id)
        .bind(&spec.host)
        .bind(spec.port)
        .bind(spec.weight)
        .bind(spec.priority)
        .bind(spec.enabled)
        .bind(spec.metadata.to_string())
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(|error| {
            foreign_key(error, "service_id", format!("service {service_id} was deleted"))
        })?;
        self.get_target(result.last_insert_rowid()).await
    }

    pub async fn update_target(&self, id: Id, spec: &TargetSpec) -> Result<Target, StoreError> {
        let result = sqlx::query(
            "UPDATE targets SET host = ?, port = ?, weight = ?, priority = ?, enabled = ?, metadata = ?,
                updated_at = ?
             WHERE id = ?",
        )
        .bind(&spec.host)
        .bind(spec.port)
        .bind(spec.weight)
        .bind(spec.priority)
        .bind(spec.enabled)
        .bind(spec.metadata.to_string())
        .bind(now_ms())
        .bind(id)
        .execute(&self.pool)
        .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound { kind: "target", id });
        }
        self.get_target(id).await
    }

    pub async fn delete_target(&self, id: Id) -> Result<(), StoreError> {
        let result = sqlx::query("DELETE FROM targets WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound { kind: "target", id });
        }
        Ok(())
    }

    // ----- routes -----

    pub async fn list_routes(&self, page: Page) -> Result<Vec<Route>, StoreError> {
        let rows =
            sqlx::query_as::<_, RouteRow>("SELECT * FROM routes WHERE id > ? ORDER BY id LIMIT ?")
                .bind(page.after_id())
                .bind(page.limit)
                .fetch_all(&self.pool)
                .await?;
        convert_all(rows)
    }

    pub async fn get_route(&self, id: Id) -> Result<Route, StoreError> {
        sqlx::query_as::<_, RouteRow>("SELECT * FROM routes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
            .ok_or(StoreError::NotFound { kind: "route", id })?
            .try_into()
    }

    pub async fn create_route(&self, spec: &RouteSpec) -> Result<Route, StoreError> {
        self.require_service_for_route(spec.service_id).await?;
        let now = now_ms();
        let result = sqlx::query(
            "INSERT INTO routes (name, hosts, path_prefix, methods, service_id, preserve_host,
                strip_prefix, priority, created_at, updated_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&spec.name)
        .bind(json_text(&spec.hosts))
        .bind(&spec.path_prefix)
        .bind(json_text(&spec.methods))
        .bind(spec.service_id)
        .bind(spec.preserve_host)
        .bind(spec.strip_prefix)
        .bind(spec.priority)
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(|e| unique_name_conflict(e, "route", &spec.name))
        .map_err(|e| match e {
            StoreError::Database(error) => foreign_key(
                error,
                "service_id",
                format!("service {} was deleted", spec.service_id),
            ),
            other => other,
        })?;
        self.get_route(result.last_insert_rowid()).await
    }

    pub async fn update_route(&self, id: Id, spec: &RouteSpec) -> Result<Route, StoreError> {
        self.require_service_for_route(spec.service_id).await?;
        let result = sqlx::query(
            "UPDATE routes SET name = ?, hosts = ?, path_prefix = ?, methods = ?, service_id = ?,
                preserve_host = ?, strip_prefix = ?, priority = ?, updated_at = ?
             WHERE id = ?",
        )
        .bind(&spec.name)
        .bind(json_text(&spec.hosts))
        .bind(&spec.path_prefix)
        .bind(json_text(&spec.methods))
        .bind(spec.service_id)
        .bind(spec.preserve_host)
        .bind(spec.strip_prefix)
        .bind(spec.priority)
        .bind(now_ms())
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(|e| unique_name_conflict(e, "route", &spec.name))
        .map_err(|e| match e {
            StoreError::Database(error) => foreign_key(
                error,
                "service_id",
                format!("service {} was deleted", spec.service_id),
            ),
            other => other,
        })?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound { kind: "route", id });
        }
        self.get_route(id).await
    }

    pub async fn delete_route(&self, id: Id) -> Result<(), StoreError> {
        let result = sqlx::query("DELETE FROM routes WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound { kind: "route", id });
        }
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
        let (count,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM tokens")
            .fetch_one(&self.pool)
            .await?;
        Ok(count)
    }

    pub async fn list_tokens(&self, page: Page) -> Result<Vec<Token>, StoreError> {
        let rows =
            sqlx::query_as::<_, TokenRow>("SELECT * FROM tokens WHERE id > ? ORDER BY id LIMIT ?")
                .bind(page.after_id())
                .bind(page.limit)
                .fetch_all(&self.pool)
                .await?;
        convert_all(rows)
    }

    /// Stores a token by the hash of its secret; the secret itself is never stored.
    pub async fn create_token(
        &self,
        spec: &TokenSpec,
        token_hash: &str,
    ) -> Result<Token, StoreError> {
        let result = sqlx::query(
            "INSERT INTO tokens (name, role, token_hash, created_at) VALUES (?, ?, ?, ?)",
        )
        .bind(&spec.name)
        .bind(spec.role.as_str())
        .bind(token_hash)
        .bind(now_ms())
        .execute(&self.pool)
        .await
        .map_err(|e| unique_name_conflict(e, "token", &spec.name))?;
        let row = sqlx::query_as::<_, TokenRow>("SELECT * FROM tokens WHERE id = ?")
            .bind(result.last_insert_rowid())
            .fetch_one(&self.pool)
            .await?;
        row.try_into()
    }

    /// Creates the token `spec.name`, or gives an existing one of that name this hash and role.
    pub async fn upsert_token_by_name(
        &self,
        spec: &TokenSpec,
        token_hash: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO tokens (name, role, token_hash, created_at) VALUES (?, ?, ?, ?)
             ON CONFLICT(name) DO UPDATE SET token_hash = excluded.token_hash, role = excluded.role",
        )
        .bind(&spec.name)
        .bind(spec.role.as_str())
        .bind(token_hash)
        .bind(now_ms())
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    pub async fn find_token_by_hash(&self, token_hash: &str) -> Result<Option<Token>, StoreError> {
        sqlx::query_as::<_, TokenRow>("SELECT * FROM tokens WHERE token_hash = ?")
            .bind(token_hash)
            .fetch_optional(&self.pool)
            .await?
            .map(Token::try_from)
            .transpose()
    }

    pub async fn delete_token(&self, id: Id) -> Result<(), StoreError> {
        let result = sqlx::query("DELETE FROM tokens WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound { kind: "token", id });
        }
        Ok(())
    }
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
