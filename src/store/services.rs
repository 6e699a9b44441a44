//! Services: what routes send to, with their timeouts, balancing, checks and ejection.

use super::rows::ServiceRow;
use super::{
    convert_all, foreign_key, found, json_value, now_ms, unique_name_conflict, Page, Store,
    StoreError,
};
use crate::model::{Id, Service, ServiceSpec};

/// Rows per multi-row INSERT: 22 binds each stays far below SQLite's 32,766 and PostgreSQL's
/// 65,535 bind parameters per statement.
const SERVICES_PER_INSERT: usize = 500;

/// The columns a new service row sets, in the order [`push_service_row`] binds them.
const INSERT_SERVICES: &str = "INSERT INTO services (name, protocol, upstream_authority, tls_sni,
    tls_verify, tls_ca_pem, lb_policy, connect_timeout_ms, response_header_timeout_ms,
    idle_timeout_ms, max_attempts, health_check, ejection, limits, created_at, updated_at,
    keepalive_ms, hash_on, hash_balance_factor, session_persistence, locality, managed_by) ";

/// Binds one service's values for [`INSERT_SERVICES`] (a macro: the row's database type differs
/// between the SQLite and PostgreSQL arms of `on_pool!`).
macro_rules! push_service_row {
    ($row:ident, $spec:expr, $now:expr, $manager:expr) => {
        $row.push_bind(&$spec.name)
            .push_bind($spec.protocol.as_str())
            .push_bind(&$spec.upstream_authority)
            .push_bind(&$spec.tls_sni)
            .push_bind($spec.tls_verify)
            .push_bind(&$spec.tls_ca_pem)
            .push_bind($spec.lb_policy.as_str())
            .push_bind($spec.timeouts.connect_ms as i64)
            .push_bind($spec.timeouts.response_header_ms as i64)
            .push_bind($spec.timeouts.idle_ms as i64)
            .push_bind(i64::from($spec.max_attempts))
            .push_bind($spec.health_check.as_ref().map(json_value))
            .push_bind(json_value(&$spec.ejection))
            .push_bind(json_value(&$spec.limits))
            .push_bind($now)
            .push_bind($now)
            .push_bind($spec.timeouts.keepalive_ms.map(|ms| ms as i64))
            .push_bind($spec.hash_on.as_ref().map(json_value))
            .push_bind($spec.hash_balance_factor.map(i64::from))
            .push_bind($spec.session_persistence.as_ref().map(json_value))
            .push_bind($spec.locality.as_ref().map(json_value))
            .push_bind($manager)
    };
}

impl Store {
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
        let id = on_pool!(self, |pool| async {
            let mut insert = sqlx::QueryBuilder::new(INSERT_SERVICES);
            insert.push_values([spec], |mut row, spec| {
                push_service_row!(row, spec, now, None::<&str>);
            });
            insert.push(" RETURNING id");
            insert.build_query_scalar::<i64>().fetch_one(pool).await
        }
        .await)
        .map_err(|e| unique_name_conflict(e, "service", &spec.name))?;
        self.get_service(id).await
    }

    /// Creates many services at once, each marked as managed by `manager`, in one transaction;
    /// gives each new service's id by name. A name already taken fails them all.
    pub async fn create_managed_services(
        &self,
        specs: &[&ServiceSpec],
        manager: &str,
    ) -> Result<Vec<(String, Id)>, StoreError> {
        if specs.is_empty() {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let created = on_pool!(self, |pool| async {
            let mut transaction = pool.begin().await?;
            let mut created = Vec::with_capacity(specs.len());
            for chunk in specs.chunks(SERVICES_PER_INSERT) {
                let mut insert = sqlx::QueryBuilder::new(INSERT_SERVICES);
                insert.push_values(chunk, |mut row, spec| {
                    push_service_row!(row, spec, now, manager);
                });
                insert.push(" RETURNING name, id");
                created.extend(
                    insert
                        .build_query_as::<(String, i64)>()
                        .fetch_all(&mut *transaction)
                        .await?,
                );
            }
            transaction.commit().await?;
            Ok::<_, sqlx::Error>(created)
        }
        .await)
        .map_err(|error| match &error {
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
                field: "name",
                message: "a service the file declares already exists".to_owned(),
            },
            _ => StoreError::Database(error),
        })?;
        Ok(created)
    }

    pub async fn update_service(&self, id: Id, spec: &ServiceSpec) -> Result<Service, StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "UPDATE services SET name = $1, protocol = $2, upstream_authority = $3, tls_sni = $4,
                tls_verify = $5, tls_ca_pem = $6, lb_policy = $7, connect_timeout_ms = $8, response_header_timeout_ms = $9,
                idle_timeout_ms = $10, max_attempts = $11, health_check = $12, ejection = $13,
                limits = $14, updated_at = $15, keepalive_ms = $17, hash_on = $18,
                hash_balance_factor = $19, session_persistence = $20, locality = $21
             WHERE id = $16",
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
        .bind(json_value(&spec.limits))
        .bind(now_ms())
        .bind(id)
        .bind(spec.timeouts.keepalive_ms.map(|ms| ms as i64))
        .bind(spec.hash_on.as_ref().map(json_value))
        .bind(spec.hash_balance_factor.map(i64::from))
        .bind(spec.session_persistence.as_ref().map(json_value))
        .bind(spec.locality.as_ref().map(json_value))
        .execute(pool)
        .await
.map(|done| done.rows_affected()))
        .map_err(|e| unique_name_conflict(e, "service", &spec.name))?;
        found(affected, "service", id)?;
        self.get_service(id).await
    }

    /// Deletes a service and its targets; refused while a route still sends traffic to it.
    pub async fn delete_service(&self, id: Id) -> Result<(), StoreError> {
        let route_names: Vec<(String,)> = on_pool!(self, |pool| {
            sqlx::query_as(
            "SELECT name FROM routes WHERE id IN (SELECT route_id FROM route_services WHERE service_id = $1)
             ORDER BY id LIMIT 5"
        )
        .bind(id)
        .fetch_all(pool)
        .await
        })?;
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
}
