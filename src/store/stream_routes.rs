//! L4 stream routes: a listen address (and for TLS passthrough an SNI) sent to a service.

use std::net::SocketAddr;

use super::rows::time;
use super::{convert_all, found, now_ms, Page, Store, StoreError};
use crate::model::{Id, StreamRoute, StreamRouteSpec};

#[derive(sqlx::FromRow)]
pub(super) struct StreamRouteRow {
    id: i64,
    listen: String,
    sni: String,
    service_id: i64,
    created_at: i64,
    updated_at: i64,
}

impl TryFrom<StreamRouteRow> for StreamRoute {
    type Error = StoreError;
    fn try_from(row: StreamRouteRow) -> Result<Self, StoreError> {
        let listen: SocketAddr = row.listen.parse().map_err(|_| {
            StoreError::Corrupt(format!("stream route listen address {:?}", row.listen))
        })?;
        Ok(StreamRoute {
            id: row.id,
            listen,
            sni: (!row.sni.is_empty()).then_some(row.sni),
            service_id: row.service_id,
            created_at: time(row.created_at)?,
            updated_at: time(row.updated_at)?,
        })
    }
}

/// `(listen, sni)` identifies a stream route; a second one is a conflict.
fn duplicate_route(error: sqlx::Error, spec: &StreamRouteSpec) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
            field: if spec.sni.is_some() { "sni" } else { "listen" },
            message: match &spec.sni {
                Some(sni) => format!(
                    "a stream route on {} for SNI {sni:?} already exists",
                    spec.listen
                ),
                None => format!(
                    "a stream route without SNI on {} already exists",
                    spec.listen
                ),
            },
        },
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => {
            StoreError::InvalidReference {
                field: "service_id".into(),
                message: format!("service {} does not exist", spec.service_id),
            }
        }
        _ => StoreError::Database(error),
    }
}

impl Store {
    pub async fn list_stream_routes(&self, page: Page) -> Result<Vec<StreamRoute>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, StreamRouteRow>(
            "SELECT * FROM stream_routes WHERE id > $1 ORDER BY id LIMIT $2",
        )
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn all_stream_routes(&self) -> Result<Vec<StreamRoute>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, StreamRouteRow>(
            "SELECT * FROM stream_routes ORDER BY id"
        )
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn get_stream_route(&self, id: Id) -> Result<StreamRoute, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, StreamRouteRow>(
            "SELECT * FROM stream_routes WHERE id = $1"
        )
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound {
            kind: "stream route",
            id,
        })?
        .try_into()
    }

    pub async fn create_stream_route(
        &self,
        spec: &StreamRouteSpec,
    ) -> Result<StreamRoute, StoreError> {
        let now = now_ms();
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO stream_routes (listen, sni, service_id, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5) RETURNING id",
        )
        .bind(spec.listen.to_string())
        .bind(spec.sni.as_deref().unwrap_or(""))
        .bind(spec.service_id)
        .bind(now)
        .bind(now)
        .fetch_one(pool)
        .await)
        .map_err(|error| duplicate_route(error, spec))?;
        self.get_stream_route(id).await
    }

    pub async fn update_stream_route(
        &self,
        id: Id,
        spec: &StreamRouteSpec,
    ) -> Result<StreamRoute, StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "UPDATE stream_routes SET listen = $1, sni = $2, service_id = $3, updated_at = $4
             WHERE id = $5",
        )
        .bind(spec.listen.to_string())
        .bind(spec.sni.as_deref().unwrap_or(""))
        .bind(spec.service_id)
        .bind(now_ms())
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))
        .map_err(|error| duplicate_route(error, spec))?;
        found(affected, "stream route", id)?;
        self.get_stream_route(id).await
    }

    pub async fn delete_stream_route(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "DELETE FROM stream_routes WHERE id = $1"
        )
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))?;
        found(affected, "stream route", id)?;
        Ok(())
    }
}
