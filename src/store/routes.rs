//! HTTP routes: hosts, a path, methods and conditions sent to weighted backends. The rules
//! beyond the original columns are one JSON document (`rules`); `route_services` lists every
//! service a route sends to (backends and mirror) so that one in use cannot be deleted.

use std::collections::HashMap;

use super::rows::{RouteRow, RouteRules, ROUTE_SELECT};
use super::{
    convert_all, foreign_key, found, json_text, now_ms, unique_name_conflict, Page, Store,
    StoreError,
};
use crate::model::{Id, Route, RouteSpec};

/// Rows per multi-row INSERT of routes: 15 binds each stays far below SQLite's 32,766 and
/// PostgreSQL's 65,535 bind parameters per statement.
const ROUTES_PER_INSERT: usize = 1_000;
/// Rows per multi-row INSERT of `route_services` (2 binds each).
const ROUTE_SERVICES_PER_INSERT: usize = 5_000;

/// Stores a route's columns and its `route_services` in one transaction; `$id` None inserts.
/// Gives the route's id, or None when the route to update does not exist.
macro_rules! write_route {
    ($pool:ident, $spec:expr, $id:expr, $services:expr, $now_sql:expr) => {{
        let spec: &RouteSpec = $spec;
        let now = now_ms();
        let mut transaction = $pool.begin().await?;
        let rules =
            serde_json::to_string(&RouteRules::of(spec)).expect("route rules always serialise");
        let first_service = spec.backends.first().map(|backend| backend.service_id);
        let id: i64 = match $id {
            None => {
                sqlx::query_scalar::<_, i64>(
                    "INSERT INTO routes (name, hosts, path_prefix, methods, service_id,
                        preserve_host, strip_prefix, priority, max_request_body_bytes,
                        request_buffer_bytes, upgrades, rules, created_at, updated_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $13)
                     RETURNING id",
                )
                .bind(&spec.name)
                .bind(json_text(&spec.hosts))
                .bind(&spec.path_prefix)
                .bind(json_text(&spec.methods))
                .bind(first_service)
                .bind(spec.preserve_host)
                .bind(spec.strip_prefix)
                .bind(i64::from(spec.priority))
                .bind(spec.max_request_body_bytes.map(stored_size))
                .bind(stored_size(spec.request_buffer_bytes))
                .bind(json_text(&spec.upgrades))
                .bind(&rules)
                .bind(now)
                .fetch_one(&mut *transaction)
                .await?
            }
            Some(id) => {
                let affected = sqlx::query(
                    "UPDATE routes SET name = $1, hosts = $2, path_prefix = $3, methods = $4,
                        service_id = $5, preserve_host = $6, strip_prefix = $7, priority = $8,
                        max_request_body_bytes = $9, request_buffer_bytes = $10, upgrades = $11,
                        rules = $12, updated_at = $13
                     WHERE id = $14",
                )
                .bind(&spec.name)
                .bind(json_text(&spec.hosts))
                .bind(&spec.path_prefix)
                .bind(json_text(&spec.methods))
                .bind(first_service)
                .bind(spec.preserve_host)
                .bind(spec.strip_prefix)
                .bind(i64::from(spec.priority))
                .bind(spec.max_request_body_bytes.map(stored_size))
                .bind(stored_size(spec.request_buffer_bytes))
                .bind(json_text(&spec.upgrades))
                .bind(&rules)
                .bind(now)
                .bind(id)
                .execute(&mut *transaction)
                .await?
                .rows_affected();
                if affected == 0 {
                    return Ok(None);
                }
                sqlx::query("DELETE FROM route_services WHERE route_id = $1")
                    .bind(id)
                    .execute(&mut *transaction)
                    .await?;
                id
            }
        };
        super::canary::sync_route_canary!(transaction, id, spec, $now_sql);
        for service_id in $services {
            sqlx::query("INSERT INTO route_services (route_id, service_id) VALUES ($1, $2)")
                .bind(id)
                .bind(service_id)
                .execute(&mut *transaction)
                .await?;
        }
        transaction.commit().await?;
        Ok::<Option<i64>, sqlx::Error>(Some(id))
    }};
}

impl Store {
    pub async fn list_routes(&self, page: Page) -> Result<Vec<Route>, StoreError> {
        let rows = on_pool!(self, |pool| sqlx::query_as::<_, RouteRow>(&format!(
            "{ROUTE_SELECT} WHERE routes.id > $1 ORDER BY routes.id LIMIT $2"
        ))
        .bind(page.after_id())
        .bind(i64::from(page.limit))
        .fetch_all(pool)
        .await)?;
        convert_all(rows)
    }

    pub async fn get_route(&self, id: Id) -> Result<Route, StoreError> {
        on_pool!(self, |pool| sqlx::query_as::<_, RouteRow>(&format!(
            "{ROUTE_SELECT} WHERE routes.id = $1"
        ))
        .bind(id)
        .fetch_optional(pool)
        .await)?
        .ok_or(StoreError::NotFound { kind: "route", id })?
        .try_into()
    }

    pub async fn create_route(&self, spec: &RouteSpec) -> Result<Route, StoreError> {
        let services = self.require_services_for_route(spec).await?;
        let id = self.write_route(spec, None, &services).await?;
        self.get_route(id).await
    }

    /// Creates many routes at once, each marked as managed by `manager`, with their
    /// `route_services` and canaries, in one transaction: all or none. Gives each new route's id
    /// by name, in the order of `specs`. The services they name are not looked up first (the
    /// caller read them): one deleted meanwhile fails the batch on the foreign key.
    pub async fn create_managed_routes(
        &self,
        specs: &[&RouteSpec],
        manager: &str,
    ) -> Result<Vec<(String, Id)>, StoreError> {
        if specs.is_empty() {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let now_sql = self.now_sql();
        let rules: Vec<String> = specs
            .iter()
            .map(|spec| {
                serde_json::to_string(&RouteRules::of(spec)).expect("route rules always serialise")
            })
            .collect();
        let written = on_pool!(self, |pool| async {
            let mut transaction = pool.begin().await?;
            let mut ids: HashMap<String, i64> = HashMap::with_capacity(specs.len());
            for (chunk, rules) in specs
                .chunks(ROUTES_PER_INSERT)
                .zip(rules.chunks(ROUTES_PER_INSERT))
            {
                let mut insert = sqlx::QueryBuilder::new(
                    "INSERT INTO routes (name, hosts, path_prefix, methods, service_id,
                        preserve_host, strip_prefix, priority, max_request_body_bytes,
                        request_buffer_bytes, upgrades, rules, managed_by, created_at,
                        updated_at) ",
                );
                insert.push_values(chunk.iter().zip(rules), |mut row, (spec, rules)| {
                    row.push_bind(&spec.name)
                        .push_bind(json_text(&spec.hosts))
                        .push_bind(&spec.path_prefix)
                        .push_bind(json_text(&spec.methods))
                        .push_bind(spec.backends.first().map(|backend| backend.service_id))
                        .push_bind(spec.preserve_host)
                        .push_bind(spec.strip_prefix)
                        .push_bind(i64::from(spec.priority))
                        .push_bind(spec.max_request_body_bytes.map(stored_size))
                        .push_bind(stored_size(spec.request_buffer_bytes))
                        .push_bind(json_text(&spec.upgrades))
                        .push_bind(rules)
                        .push_bind(manager)
                        .push_bind(now)
                        .push_bind(now);
                });
                insert.push(" RETURNING name, id");
                ids.extend(
                    insert
                        .build_query_as::<(String, i64)>()
                        .fetch_all(&mut *transaction)
                        .await?,
                );
            }
            let mut uses: Vec<(i64, Id)> = Vec::with_capacity(specs.len());
            for spec in specs {
                let id = returned_id(&ids, &spec.name)?;
                uses.extend(
                    route_services(spec)
                        .into_iter()
                        .map(|service| (id, service)),
                );
            }
            for chunk in uses.chunks(ROUTE_SERVICES_PER_INSERT) {
                let mut insert =
                    sqlx::QueryBuilder::new("INSERT INTO route_services (route_id, service_id) ");
                insert.push_values(chunk, |mut row, (route_id, service_id)| {
                    row.push_bind(*route_id).push_bind(*service_id);
                });
                insert.build().execute(&mut *transaction).await?;
            }
            // Canaries are rare: written one by one, as a single route write does.
            for spec in specs.iter().filter(|spec| spec.canary.is_some()) {
                let id = returned_id(&ids, &spec.name)?;
                let _round = super::canary::sync_route_canary!(transaction, id, *spec, now_sql);
            }
            transaction.commit().await?;
            Ok::<_, sqlx::Error>(ids)
        }
        .await);
        let mut ids = written.map_err(|error| match &error {
            sqlx::Error::Database(db) if db.is_unique_violation() => StoreError::Conflict {
                field: "name",
                message: "a route the file declares already exists".to_owned(),
            },
            _ => foreign_key(
                error,
                "backends",
                "a service a route sends to was deleted".to_owned(),
            ),
        })?;
        Ok(specs
            .iter()
            .map(|spec| {
                let id = ids.remove(&spec.name).unwrap_or_default();
                (spec.name.clone(), id)
            })
            .collect())
    }

    pub async fn update_route(&self, id: Id, spec: &RouteSpec) -> Result<Route, StoreError> {
        let services = self.require_services_for_route(spec).await?;
        self.write_route(spec, Some(id), &services).await?;
        self.get_route(id).await
    }

    async fn write_route(
        &self,
        spec: &RouteSpec,
        id: Option<Id>,
        services: &[Id],
    ) -> Result<Id, StoreError> {
        let now_sql = self.now_sql();
        let written = async {
            on_pool!(self, |pool| write_route!(
                pool,
                spec,
                id,
                services.iter().copied(),
                now_sql
            ))
        };
        match written.await {
            Ok(Some(written)) => Ok(written),
            Ok(None) => Err(StoreError::NotFound {
                kind: "route",
                id: id.unwrap_or_default(),
            }),
            Err(error) => Err(match unique_name_conflict(error, "route", &spec.name) {
                StoreError::Database(error) => foreign_key(
                    error,
                    "backends",
                    "a service the route sends to was deleted".to_owned(),
                ),
                other => other,
            }),
        }
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

    /// Every service the route names must exist; returns them once each, backends first.
    async fn require_services_for_route(&self, spec: &RouteSpec) -> Result<Vec<Id>, StoreError> {
        let mut named: Vec<(String, Id)> = spec
            .backends
            .iter()
            .enumerate()
            .map(|(index, backend)| (format!("backends[{index}].service_id"), backend.service_id))
            .collect();
        if let Some(mirror) = &spec.mirror {
            named.push(("mirror.service_id".to_owned(), mirror.service_id));
        }
        let mut services: Vec<Id> = Vec::with_capacity(named.len());
        for (field, service_id) in named {
            if services.contains(&service_id) {
                continue;
            }
            match self.get_service(service_id).await {
                Ok(_) => services.push(service_id),
                Err(StoreError::NotFound { .. }) => {
                    return Err(StoreError::InvalidReference {
                        field: field.into(),
                        message: format!("service {service_id} does not exist"),
                    })
                }
                Err(other) => return Err(other),
            }
        }
        Ok(services)
    }
}

/// The id the INSERT returned for a route of the batch; a name it did not return fails the
/// batch instead of panicking.
fn returned_id(ids: &HashMap<String, i64>, name: &str) -> Result<i64, sqlx::Error> {
    ids.get(name).copied().ok_or(sqlx::Error::RowNotFound)
}

/// Every service a route sends to (its backends, then its mirror), once each.
fn route_services(spec: &RouteSpec) -> Vec<Id> {
    let mut services: Vec<Id> = Vec::with_capacity(spec.backends.len() + 1);
    let named = spec.backends.iter().map(|backend| backend.service_id);
    for service_id in named.chain(spec.mirror.as_ref().map(|mirror| mirror.service_id)) {
        if !services.contains(&service_id) {
            services.push(service_id);
        }
    }
    services
}

/// A byte size as the store's signed 64-bit integer; validation keeps sizes far below the cap.
fn stored_size(bytes: u64) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}
