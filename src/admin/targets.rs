//! `/api/v1/services/{id}/targets` and `/api/v1/targets/{id}`

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, MergePatch, PageQuery, Pagination};
use super::{AdminState, List};
use crate::validate;
use std::collections::HashMap;

use crate::clock::unix_ms;
use crate::model::{Id, Target, TargetSpec};
use crate::snapshot::TargetRuntime;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_targets, create_target))
        .routes(routes!(
            get_target,
            replace_target,
            patch_target,
            delete_target
        ))
}

#[utoipa::path(get, path = "/services/{id}/targets", tag = "targets", params(PageQuery),
    responses((status = 200, body = List<Target>), (status = 404, body = ErrorBody)))]
async fn list_targets(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(service_id): IdPath,
    Pagination(page): Pagination,
) -> Result<Json<List<Target>>, ApiError> {
    let mut items = state.store.list_targets(service_id, page).await?;
    with_live_health(&state, &mut items);
    Ok(Json(List::new(items, page, |t| t.id)))
}

#[utoipa::path(post, path = "/services/{id}/targets", tag = "targets", request_body = TargetSpec,
    responses((status = 201, body = Target), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_target(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(service_id): IdPath,
    ApiJson(spec): ApiJson<TargetSpec>,
) -> Result<(StatusCode, Json<Target>), ApiError> {
    let spec = validate::target(spec)?;
    let target = state.store.create_target(service_id, &spec).await?;
    state.apply().await?;
    Ok((StatusCode::CREATED, Json(target)))
}

#[utoipa::path(get, path = "/targets/{id}", tag = "targets",
    responses((status = 200, body = Target), (status = 404, body = ErrorBody)))]
async fn get_target(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<Target>, ApiError> {
    let mut target = state.store.get_target(id).await?;
    with_live_health(&state, std::slice::from_mut(&mut target));
    Ok(Json(target))
}

/// Health and ejection change on the request path and in the checker faster than the store is
/// written; show the live values of targets in rotation.
fn with_live_health(state: &AdminState, targets: &mut [Target]) {
    let snapshot = state.control.snapshot();
    let now = unix_ms();
    let mut live: HashMap<Id, &TargetRuntime> = HashMap::new();
    for target in targets.iter() {
        if let Some(service) = snapshot.service(target.service_id) {
            if !live.contains_key(&target.id) {
                live.extend(service.targets.iter().map(|runtime| (runtime.id, runtime)));
            }
        }
    }
    for target in targets {
        if let Some(runtime) = live.get(&target.id) {
            target.health = runtime.health.health();
            target.ejected_until = runtime
                .health
                .ejected_until(now)
                .and_then(|ms| chrono::DateTime::from_timestamp_millis(ms as i64));
        }
    }
}

/// Discovered targets belong to their source; operators change the source instead.
async fn operator_target(state: &AdminState, id: Id) -> Result<Target, ApiError> {
    let target = state.store.get_target(id).await?;
    if let Some(source_id) = target.source_id {
        return Err(ApiError::Conflict {
            field: None,
            message: format!(
                "target {id} is managed by discovery source {source_id} and is read-only; change the source instead"
            ),
        });
    }
    Ok(target)
}

#[utoipa::path(put, path = "/targets/{id}", tag = "targets", request_body = TargetSpec,
    responses((status = 200, body = Target), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn replace_target(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    ApiJson(spec): ApiJson<TargetSpec>,
) -> Result<Json<Target>, ApiError> {
    operator_target(&state, id).await?;
    let spec = validate::target(spec)?;
    let target = state.store.update_target(id, &spec).await?;
    state.apply().await?;
    Ok(Json(target))
}

#[utoipa::path(patch, path = "/targets/{id}", tag = "targets", request_body = Object,
    responses((status = 200, body = Target), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn patch_target(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    patch: MergePatch,
) -> Result<Json<Target>, ApiError> {
    let current = operator_target(&state, id).await?;
    let spec = validate::target(patch.apply(&current.spec())?)?;
    let target = state.store.update_target(id, &spec).await?;
    state.apply().await?;
    Ok(Json(target))
}

#[utoipa::path(delete, path = "/targets/{id}", tag = "targets",
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn delete_target(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    operator_target(&state, id).await?;
    state.store.delete_target(id).await?;
    state.apply().await?;
    Ok(StatusCode::NO_CONTENT)
}
