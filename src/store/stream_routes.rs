//! L4 stream routes: a listen address (and for TLS passthrough an SNI) sent to a service.

use std::net::SocketAddr;

use super::rows::time;
use super::{convert_all, now_ms, Page, Store, StoreError};
use crate::model::{Id, StreamRoute, StreamRouteSpec};

#[derive(sqlx::FromRow)]
struct StreamRouteRow {
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
                Some(sni) => format!("a stream route on {} for SNI {sni:?} already exists", spec.listen),
                None => format!("a stream route without SNI on {} already exists", spec.listen),
            },
        },
        sqlx::Error::Database(db) if db.is_foreign_key_violation() => StoreError::InvalidReference {
            field: "service_id",
            message: format!("service {} does not exist", spec.service_id),
        },
        _ => StoreError::Database(error),
    }
}

impl Store {
    pub async fn list_stream_routes(&self, page: Page) -> Result<Vec<StreamRoute>, StoreError> {
        let rows = sqlx::query_as::<_, StreamRouteRow>(
            "SELECT * FROM stream_routes WHERE id > ? ORDER BY id LIMIT ?",
        )
        .bind(page.after_id())
        .bind(page.limit)
        .fetch_all(&self.pool)
        .await?;
        convert_all(rows)
    }

    pub async fn all_stream_routes(&self) -> Result<Vec<StreamRoute>, StoreError> {
        let rows = sqlx::query_as::<_, StreamRouteRow>("SELECT * FROM stream_routes ORDER BY id")
            .fetch_all(&self.pool)
            .await?;
        convert_all(rows)
    }

    pub async fn get_stream_route(&self, id: Id) -> Result<StreamRoute, StoreError> {
        sqlx::query_as::<_, StreamRouteRow>("SELECT * FROM stream_routes WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?
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
        let result = sqlx::query(
            "INSERT INTO stream_routes (listen, sni, service_id, created_at, updated_at)
             VALUES (?, ?, ?, ?, ?)",
        )
        .bind(spec.listen.to_string())
        .bind(spec.sni.as_deref().unwrap_or(""))
        .bind(spec.service_id)
        .bind(now)
        .bind(now)
        .execute(&self.pool)
        .await
        .map_err(|error| duplicate_route(error, spec))?;
        self.get_stream_route(result.last_insert_rowid()).await
    }

    pub async fn update_stream_route(
        &self,
        id: Id,
        spec: &StreamRouteSpec,
    ) -> Result<StreamRoute, StoreError> {
        let result = sqlx::query(
            "UPDATE stream_routes SET listen = ?, sni = ?, service_id = ?, updated_at = ?
             WHERE id = ?",
        )
        .bind(spec.listen.to_string())
        .bind(spec.sni.as_deref().unwrap_or(""))
        .bind(spec.service_id)
        .bind(now_ms())
        .bind(id)
        .execute(&self.pool)
        .await
        .map_err(|error| duplicate_route(error, spec))?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "stream route",
                id,
            });
        }
        self.get_stream_route(id).await
    }

    pub async fn delete_stream_route(&self, id: Id) -> Result<(), StoreError> {
        let result = sqlx::query("DELETE FROM stream_routes WHERE id = ?")
            .bind(id)
            .execute(&self.pool)
            .await?;
        if result.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "stream route",
                id,
            });
        }
        Ok(())
    }
}
