//! `/api/v1/services/{id}/targets` and `/api/v1/targets/{id}`

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, MergePatch, PageQuery, Pagination};
use super::{validate, AdminState, List};
use crate::model::{Target, TargetSpec};

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
    let items = state.store.list_targets(service_id, page).await?;
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
    Ok(Json(state.store.get_target(id).await?))
}

/// Discovered targets belong to their source; operators change the source instead.
async fn operator_target(state: &AdminState, id: crate::model::Id) -> Result<Target, ApiError> {
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
