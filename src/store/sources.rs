//! Discovery sources, their progress (what the status endpoint shows) and the targets they own.

use chrono::{DateTime, Utc};

/// The statement that stores a source's progress, for either driver.
macro_rules! save_progress_query {
    ($id:expr, $progress:expr) => {
        sqlx::query(
            "UPDATE discovery_sources SET state = $1, last_error = $2, last_refresh_at = $3,
                last_success_at = $4, next_refresh_at = $5, revision = $6, failing_since = $7,
                watch = $8, guard = $9
             WHERE id = $10",
        )
        .bind($progress.state.as_str())
        .bind(&$progress.last_error)
        .bind(millis($progress.last_refresh_at))
        .bind(millis($progress.last_success_at))
        .bind(millis($progress.next_refresh_at))
        .bind(&$progress.revision)
        .bind(millis($progress.failing_since))
        .bind(json_text(&$progress.watch))
        .bind(json_text(&$progress.guard))
        .bind($id)
    };
}

use super::acceptances::AcceptanceWrite;
use super::rows::{time, SourceCountsRow, SourceRow, TargetRow};
use super::{convert_all, found, now_ms, Page, Store, StoreError};
use crate::model::{
    DiscoverySource, DiscoverySourceSpec, EndpointCounts, Id, SourceProgress, Target, TargetChange,
};

/// An optional part of a source stored as JSON text (NULL when absent).
fn json_text<T: serde::Serialize>(value: &Option<T>) -> Option<String> {
    value
        .as_ref()
        .and_then(|value| serde_json::to_string(value).ok())
}

fn millis(time: Option<DateTime<Utc>>) -> Option<i64> {
    time.map(|time| time.timestamp_millis())
}

const LEASE_LOST_FIELD: &str = "source_id";

impl StoreError {
    /// Whether a source write was refused because another instance holds the source's lease.
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, StoreError::Conflict { field, .. } if *field == LEASE_LOST_FIELD)
    }
}

/// A refresh result or timer write from an instance that no longer holds the source's lease: the
/// new holder's writes win, this one is dropped.
fn lease_lost(source_id: Id, holder: &str) -> StoreError {
    StoreError::Conflict {
        field: LEASE_LOST_FIELD,
        message: format!(
            "discovery source {source_id} is now refreshed by {holder}; write dropped"
        ),
    }
}

fn unique_source_name(error: sqlx::Error, name: &str) -> StoreError {
    match &error {
        sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
            field: "name",
            message: format!("this service already has a discovery source named {name:?}"),
        },
        _ => StoreError::Database(error),
    }
}

impl Store {
    pub async fn list_sources(
        &self,
        service_id: Id,
        page: Page,
    ) -> Result<Vec<DiscoverySource>, StoreError> {
        self.get_service(service_id).await?;
        let rows = on_pool!(self, |pool| {
            sqlx::query_as::<_, SourceRow>(
            "SELECT * FROM discovery_sources WHERE service_id = $1 AND id > $2 ORDER BY id LIMIT $3",
        )
        .bind(service_id)
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await
        })?;
        convert_all(rows)
    }

    /// Every source with its progress, for the control task.
    pub async fn all_sources(&self) -> Result<Vec<(DiscoverySource, SourceProgress)>, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, SourceRow>(
            "SELECT * FROM discovery_sources ORDER BY id"
        )
        .fetch_all(pool)
        .await)?
        .into_iter()
        .map(SourceRow::into_parts)
        .collect()
    }

    pub async fn get_source_with_progress(
        &self,
        id: Id,
    ) -> Result<(DiscoverySource, SourceProgress), StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, SourceRow>(
            "SELECT * FROM discovery_sources WHERE id = $1"
        )
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound {
            kind: "discovery source",
            id,
        })?
        .into_parts()
    }

    pub async fn get_source(&self, id: Id) -> Result<DiscoverySource, StoreError> {
        self.get_source_with_progress(id)
            .await
            .map(|(source, _)| source)
    }

    /// `spec.config` must already be validated and normalised by its provider.
    pub async fn create_source(
        &self,
        service_id: Id,
        spec: &DiscoverySourceSpec,
    ) -> Result<DiscoverySource, StoreError> {
        self.get_service(service_id).await?;
        let now = now_ms();
        let state = if spec.enabled { "pending" } else { "disabled" };
        let id = on_pool!(self, |pool| sqlx::query_scalar::<_, i64>(
            "INSERT INTO discovery_sources (service_id, name, provider, config, enabled,
                stale_after_ms, removal_grace_ms, removal_guard, state, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) RETURNING id",
        )
        .bind(service_id)
        .bind(&spec.name)
        .bind(spec.provider.as_str())
        .bind(spec.config.to_string())
        .bind(spec.enabled)
        .bind(spec.stale_after_ms as i64)
        .bind(spec.removal_grace_ms as i64)
        .bind(json_text(&spec.removal_guard))
        .bind(state)
        .bind(now)
        .bind(now)
        .fetch_one(pool)
        .await)
        .map_err(|e| unique_source_name(e, &spec.name))?;
        self.get_source(id).await
    }

    pub async fn update_source(
        &self,
        id: Id,
        spec: &DiscoverySourceSpec,
    ) -> Result<DiscoverySource, StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "UPDATE discovery_sources SET name = $1, provider = $2, config = $3, enabled = $4,
                stale_after_ms = $5, removal_grace_ms = $6, removal_guard = $7, updated_at = $8
             WHERE id = $9",
        )
        .bind(&spec.name)
        .bind(spec.provider.as_str())
        .bind(spec.config.to_string())
        .bind(spec.enabled)
        .bind(spec.stale_after_ms as i64)
        .bind(spec.removal_grace_ms as i64)
        .bind(json_text(&spec.removal_guard))
        .bind(now_ms())
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))
        .map_err(|e| unique_source_name(e, &spec.name))?;
        found(affected, "discovery source", id)?;
        self.get_source(id).await
    }

    /// Deletes a source; its targets go with it at once.
    pub async fn delete_source(&self, id: Id) -> Result<(), StoreError> {
        let affected = on_pool!(self, |pool| sqlx::query(
            "DELETE FROM discovery_sources WHERE id = $1"
        )
        .bind(id)
        .execute(pool)
        .await
        .map(|done| done.rows_affected()))?;
        found(affected, "discovery source", id)?;
        Ok(())
    }

    /// Fenced like [`Store::apply_refresh`]: an instance that lost the source's lease while it
    /// was busy must not overwrite the new holder's progress.
    pub async fn save_progress(&self, id: Id, progress: &SourceProgress) -> Result<(), StoreError> {
        let fence = self.lease_fence_sql();
        on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let holder: Option<String> = sqlx::query_scalar(fence)
                .bind(id)
                .fetch_optional(&mut *transaction)
                .await?;
            if let Some(holder) = holder.filter(|holder| holder.as_str() != self.instance_id()) {
                return Err(lease_lost(id, &holder));
            }
            save_progress_query!(id, progress)
                .execute(&mut *transaction)
                .await?;
            transaction.commit().await?;
        });
        Ok(())
    }

    /// A source's progress and its targets' counts, read in one statement so they agree (a
    /// refresh writes both in one transaction; two reads could straddle it).
    pub async fn source_progress_and_counts(
        &self,
        source_id: Id,
    ) -> Result<(SourceProgress, EndpointCounts), StoreError> {
        let row = on_pool!(self, |pool| sqlx::query_as::<_, SourceCountsRow>(
            "SELECT s.*,
                (SELECT COUNT(*) FROM targets t WHERE t.source_id = s.id AND t.state = 'active')
                    AS active_targets,
                (SELECT COUNT(*) FROM targets t WHERE t.source_id = s.id AND t.state = 'draining')
                    AS draining_targets,
                (SELECT COUNT(*) FROM targets t WHERE t.source_id = s.id AND t.state = 'stale')
                    AS stale_targets
             FROM discovery_sources s WHERE s.id = $1"
        )
        .bind(source_id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound {
            kind: "discovery source",
            id: source_id,
        })?;
        let count = |count: i64| count.max(0) as u64;
        let counts = EndpointCounts {
            active: count(row.active_targets),
            draining: count(row.draining_targets),
            stale: count(row.stale_targets),
        };
        let (_, progress) = row.source.into_parts()?;
        Ok((progress, counts))
    }

    pub async fn source_targets(&self, source_id: Id) -> Result<Vec<Target>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, TargetRow>(
            "SELECT * FROM targets WHERE source_id = $1 ORDER BY id"
        )
        .bind(source_id)
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    /// Writes one reconcile's changes to a source's targets in a single transaction.
    pub async fn apply_target_changes(
        &self,
        service_id: Id,
        source_id: Id,
        changes: &[TargetChange],
    ) -> Result<(), StoreError> {
        self.apply_refresh(service_id, source_id, changes, None)
            .await
    }

    /// Writes a refresh's target changes and, when given, the source's new progress in one
    /// transaction, so the status never shows new counts beside an old revision.
    pub async fn apply_refresh(
        &self,
        service_id: Id,
        source_id: Id,
        changes: &[TargetChange],
        progress: Option<&SourceProgress>,
    ) -> Result<(), StoreError> {
        self.write_source_changes(service_id, source_id, changes, progress, None)
            .await
            .map(drop)
    }

    /// Applies an admin's acceptance: drains what it releases, stores the progress and records
    /// the request applied, in one transaction fenced by the lease, so the request is applied
    /// once even if this instance dies or loses the lease meanwhile, and a failed write leaves
    /// nothing to apply later. Returns when it was applied (None: a stored request replaced
    /// meanwhile, which stays pending); NotFound when the source is gone.
    pub async fn apply_acceptance(
        &self,
        service_id: Id,
        source_id: Id,
        changes: &[TargetChange],
        progress: Option<&SourceProgress>,
        acceptance: AcceptanceWrite<'_>,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let applied_at = self
            .write_source_changes(service_id, source_id, changes, progress, Some(acceptance))
            .await?;
        applied_at.map(time).transpose()
    }

    /// Returns when the acceptance was recorded applied, if one was written.
    async fn write_source_changes(
        &self,
        service_id: Id,
        source_id: Id,
        changes: &[TargetChange],
        progress: Option<&SourceProgress>,
        acceptance: Option<AcceptanceWrite<'_>>,
    ) -> Result<Option<i64>, StoreError> {
        if changes.is_empty() && progress.is_none() && acceptance.is_none() {
            return Ok(None);
        }
        let now = now_ms();
        let fence = self.lease_fence_sql();
        let mark_applied = self.mark_applied_sql();
        let applied_at_once = self.applied_at_once_sql();
        let applied_at = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            let holder: Option<String> = sqlx::query_scalar(fence)
                .bind(source_id)
                .fetch_optional(&mut *transaction)
                .await?;
            if let Some(holder) = holder.filter(|holder| holder.as_str() != self.instance_id()) {
                return Err(lease_lost(source_id, &holder));
            }
            if let Some(progress) = progress {
                save_progress_query!(source_id, progress)
                    .execute(&mut *transaction)
                    .await?;
            }
            // Existing rows in id order, as every writer of targets locks them (no deadlock
            // with another instance's health-check writes), new ones after.
            let mut ordered: Vec<&TargetChange> = changes.iter().collect();
            ordered.sort_by_key(|change| match change {
                TargetChange::Create(_) => Id::MAX,
                TargetChange::Refresh { id, .. }
                | TargetChange::Drain { id, .. }
                | TargetChange::MarkStale { id }
                | TargetChange::Delete { id } => *id,
            });
            for change in ordered {
                match change {
                    TargetChange::Create(endpoint) => {
                        sqlx::query(
                        "INSERT INTO targets (service_id, source_id, host, port, weight, priority,
                            enabled, metadata, provider_key, state, health, created_at, updated_at)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'active', 'unknown', $10, $11)",
                    )
                    .bind(service_id)
                    .bind(source_id)
                    .bind(&endpoint.host)
                    .bind(i64::from(endpoint.port))
                    .bind(i64::from(endpoint.weight))
                    .bind(i64::from(endpoint.priority))
                    .bind(endpoint.enabled)
                    .bind(endpoint.metadata.to_string())
                    .bind(&endpoint.key)
                    .bind(now)
                    .bind(now)
                    .execute(&mut *transaction)
                    .await?;
                    }
                    TargetChange::Refresh { id, endpoint } => {
                        sqlx::query(
                        "UPDATE targets SET host = $1, port = $2, weight = $3, priority = $4, enabled = $5,
                            metadata = $6, state = 'active', remove_at = NULL, updated_at = $7
                         WHERE id = $8 AND source_id = $9",
                    )
                    .bind(&endpoint.host)
                    .bind(i64::from(endpoint.port))
                    .bind(i64::from(endpoint.weight))
                    .bind(i64::from(endpoint.priority))
                    .bind(endpoint.enabled)
                    .bind(endpoint.metadata.to_string())
                    .bind(now)
                    .bind(id)
                    .bind(source_id)
                    .execute(&mut *transaction)
                    .await?;
                    }
                    TargetChange::Drain { id, remove_at } => {
                        sqlx::query(
                            "UPDATE targets SET state = 'draining', remove_at = $1, updated_at = $2
                         WHERE id = $3 AND source_id = $4",
                        )
                        .bind(remove_at.timestamp_millis())
                        .bind(now)
                        .bind(id)
                        .bind(source_id)
                        .execute(&mut *transaction)
                        .await?;
                    }
                    TargetChange::MarkStale { id } => {
                        sqlx::query(
                        "UPDATE targets SET state = 'stale', updated_at = $1 WHERE id = $2 AND source_id = $3",
                    )
                    .bind(now)
                    .bind(id)
                    .bind(source_id)
                    .execute(&mut *transaction)
                    .await?;
                    }
                    TargetChange::Delete { id } => {
                        sqlx::query("DELETE FROM targets WHERE id = $1 AND source_id = $2")
                            .bind(id)
                            .bind(source_id)
                            .execute(&mut *transaction)
                            .await?;
                    }
                }
            }
            let applied_at: Option<i64> = match &acceptance {
                None => None,
                Some(AcceptanceWrite::Mark(applied)) => {
                    sqlx::query_scalar(&mark_applied)
                        .bind(applied.released as i64)
                        .bind(self.instance_id())
                        .bind(source_id)
                        .bind(applied.requested_at_ms)
                        .fetch_optional(&mut *transaction)
                        .await?
                }
                Some(AcceptanceWrite::AtOnce { hold, released }) => {
                    let hold = hold.and_then(|hold| serde_json::to_string(hold).ok());
                    let applied_at = sqlx::query_scalar(&applied_at_once)
                        .bind(*released as i64)
                        .bind(self.instance_id())
                        .bind(source_id)
                        .bind(hold)
                        .fetch_optional(&mut *transaction)
                        .await?;
                    // The source is gone (deleted meanwhile): write nothing for it.
                    if applied_at.is_none() {
                        return Err(StoreError::NotFound {
                            kind: "discovery source",
                            id: source_id,
                        });
                    }
                    applied_at
                }
            };
            transaction.commit().await?;
            applied_at
        });
        Ok(applied_at)
    }
}

impl Store {
    /// Stores one round of health checks: each target's health and latest result.
    pub async fn record_health_checks(
        &self,
        records: &[(Id, crate::model::Health, crate::model::CheckResult)],
    ) -> Result<(), StoreError> {
        if records.is_empty() {
            return Ok(());
        }
        // Rows are locked in id order: instances checking the same targets (each its own
        // view) write them concurrently, and any other order can deadlock on PostgreSQL.
        let mut ordered: Vec<_> = records.iter().collect();
        ordered.sort_by_key(|(id, _, _)| *id);
        on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            for (id, health, result) in &ordered {
                let last_check =
                    serde_json::to_string(result).expect("plain data always serialises");
                sqlx::query("UPDATE targets SET health = $1, last_check = $2 WHERE id = $3")
                    .bind(health.as_str())
                    .bind(last_check)
                    .bind(id)
                    .execute(&mut *transaction)
                    .await?;
            }
            transaction.commit().await?;
        });
        Ok(())
    }
}

impl Store {
    /// Targets per service and lifecycle state, for metrics.
    pub async fn target_state_counts(&self) -> Result<Vec<(Id, String, i64)>, StoreError> {
        Ok(on_pool!(self, |pool| sqlx::query_as(
            "SELECT service_id, state, COUNT(*) FROM targets GROUP BY service_id, state",
        )
        .fetch_all(pool)
        .await)?)
    }
}

/// The kinds of object a resources file manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ManagedKind {
    Service,
    Route,
    Target,
    DiscoverySource,
}

impl ManagedKind {
    fn statement(self) -> &'static str {
        match self {
            ManagedKind::Service => "UPDATE services SET managed_by = $1 WHERE id = $2",
            ManagedKind::Route => "UPDATE routes SET managed_by = $1 WHERE id = $2",
            ManagedKind::Target => "UPDATE targets SET managed_by = $1 WHERE id = $2",
            ManagedKind::DiscoverySource => {
                "UPDATE discovery_sources SET managed_by = $1 WHERE id = $2"
            }
        }
    }
}

impl Store {
    /// Marks (or, with None, unmarks) an object as managed by `manager`.
    pub async fn set_managed_by(
        &self,
        kind: ManagedKind,
        id: Id,
        manager: Option<&str>,
    ) -> Result<(), StoreError> {
        on_pool!(self, |pool| sqlx::query(kind.statement())
            .bind(manager)
            .bind(id)
            .execute(pool)
            .await
            .map(|done| done.rows_affected()))?;
        Ok(())
    }
}
