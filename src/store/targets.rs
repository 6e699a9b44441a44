//! Targets: the addresses a service sends to, written by operators or discovery.

use super::rows::TargetRow;
use super::{convert_all, foreign_key, found, now_ms, Page, Store, StoreError};
use crate::model::{Id, Target, TargetSpec};

/// Rows per multi-row INSERT: 10 binds each stays far below SQLite's 32,766 and PostgreSQL's
/// 65,535 bind parameters per statement.
const TARGETS_PER_INSERT: usize = 1_000;

impl Store {
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

    /// Creates many operator targets at once, each marked as managed by `manager`: multi-row
    /// INSERTs in one transaction, so a declarative file of 100,000 targets is a few hundred
    /// statements instead of 400,000, and either all of them are stored or none.
    pub async fn create_managed_targets(
        &self,
        targets: &[(Id, &TargetSpec)],
        manager: &str,
    ) -> Result<(), StoreError> {
        if targets.is_empty() {
            return Ok(());
        }
        let now = now_ms();
        on_pool!(self, |pool| async {
            let mut transaction = pool.begin().await?;
            for chunk in targets.chunks(TARGETS_PER_INSERT) {
                let mut insert = sqlx::QueryBuilder::new(
                    "INSERT INTO targets (service_id, source_id, host, port, weight, priority,
                        enabled, metadata, provider_key, state, health, ejected_until, managed_by,
                        created_at, updated_at) ",
                );
                insert.push_values(chunk, |mut row, (service_id, spec)| {
                    row.push_bind(*service_id)
                        .push("NULL")
                        .push_bind(&spec.host)
                        .push_bind(i64::from(spec.port))
                        .push_bind(i64::from(spec.weight))
                        .push_bind(i64::from(spec.priority))
                        .push_bind(spec.enabled)
                        .push_bind(spec.metadata.to_string())
                        .push("NULL, 'active', 'unknown', NULL")
                        .push_bind(manager)
                        .push_bind(now)
                        .push_bind(now);
                });
                insert.build().execute(&mut *transaction).await?;
            }
            transaction.commit().await
        }
        .await)
        .map_err(|error| foreign_key(error, "service_id", "a service was deleted".to_owned()))?;
        Ok(())
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
}
