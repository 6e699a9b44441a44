//! HTTP routes: hosts, a path prefix and methods sent to a service.

use super::rows::RouteRow;
use super::{
    convert_all, foreign_key, found, json_text, now_ms, unique_name_conflict, Page, Store,
    StoreError,
};
use crate::model::{Id, Route, RouteSpec};

impl Store {
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
                strip_prefix, priority, max_request_body_bytes, request_buffer_bytes, upgrades,
                created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) RETURNING id",
        )
        .bind(&spec.name)
        .bind(json_text(&spec.hosts))
        .bind(&spec.path_prefix)
        .bind(json_text(&spec.methods))
        .bind(spec.service_id)
        .bind(spec.preserve_host)
        .bind(spec.strip_prefix)
        .bind(i64::from(spec.priority))
        .bind(spec.max_request_body_bytes.map(stored_size))
        .bind(stored_size(spec.request_buffer_bytes))
        .bind(json_text(&spec.upgrades))
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
                preserve_host = $6, strip_prefix = $7, priority = $8,
                max_request_body_bytes = $9, request_buffer_bytes = $10, upgrades = $11,
                updated_at = $12
             WHERE id = $13",
        )
        .bind(&spec.name)
        .bind(json_text(&spec.hosts))
        .bind(&spec.path_prefix)
        .bind(json_text(&spec.methods))
        .bind(spec.service_id)
        .bind(spec.preserve_host)
        .bind(spec.strip_prefix)
        .bind(i64::from(spec.priority))
        .bind(spec.max_request_body_bytes.map(stored_size))
        .bind(stored_size(spec.request_buffer_bytes))
        .bind(json_text(&spec.upgrades))
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
}

/// A byte size as the store's signed 64-bit integer; validation keeps sizes far below the cap.
fn stored_size(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}
