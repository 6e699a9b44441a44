//! `/api/v1/routes`

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, MergePatch, PageQuery, Pagination};
use super::{AdminState, List};
use crate::model::{Route, RouteSpec};
use crate::store::StoreError;
use crate::validate;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_routes, create_route))
        .routes(routes!(get_route, replace_route, patch_route, delete_route))
}

#[utoipa::path(get, path = "/routes", tag = "routes", params(PageQuery),
    responses((status = 200, body = List<Route>), (status = 401, body = ErrorBody)))]
async fn list_routes(
    _: Viewer,
    State(state): State<AdminState>,
    Pagination(page): Pagination,
) -> Result<Json<List<Route>>, ApiError> {
    let items = state.store.list_routes(page).await?;
    Ok(Json(List::new(items, page, |r| r.id)))
}

#[utoipa::path(post, path = "/routes", tag = "routes", request_body = RouteSpec,
    responses((status = 201, body = Route), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_route(
    _: Admin,
    State(state): State<AdminState>,
    ApiJson(spec): ApiJson<RouteSpec>,
) -> Result<(StatusCode, Json<Route>), ApiError> {
    let spec = checked(&state, spec).await?;
    let route = state.store.create_route(&spec).await?;
    state.apply().await?;
    Ok((StatusCode::CREATED, Json(route)))
}

#[utoipa::path(get, path = "/routes/{id}", tag = "routes",
    responses((status = 200, body = Route), (status = 404, body = ErrorBody)))]
async fn get_route(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<Route>, ApiError> {
    Ok(Json(state.store.get_route(id).await?))
}

#[utoipa::path(put, path = "/routes/{id}", tag = "routes", request_body = RouteSpec,
    responses((status = 200, body = Route), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn replace_route(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    ApiJson(spec): ApiJson<RouteSpec>,
) -> Result<Json<Route>, ApiError> {
    let spec = checked(&state, spec).await?;
    let route = state.store.update_route(id, &spec).await?;
    state.apply().await?;
    Ok(Json(route))
}

#[utoipa::path(patch, path = "/routes/{id}", tag = "routes", request_body = Object,
    responses((status = 200, body = Route), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn patch_route(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    patch: MergePatch,
) -> Result<Json<Route>, ApiError> {
    let current = state.store.get_route(id).await?;
    let spec = checked(&state, patch.apply(&current.spec())?).await?;
    let route = state.store.update_route(id, &spec).await?;
    state.apply().await?;
    Ok(Json(route))
}

#[utoipa::path(delete, path = "/routes/{id}", tag = "routes",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_route(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    state.store.delete_route(id).await?;
    state.apply().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Validates the spec; its service must exist and speak HTTP (`http` or `https`).
async fn checked(state: &AdminState, spec: RouteSpec) -> Result<RouteSpec, ApiError> {
    let spec = validate::route(spec)?;
    match state.store.get_service(spec.service_id).await {
        Ok(service) if !validate::serves_http(service.protocol) => Err(ApiError::validation(
            "service_id",
            format!(
                "service {:?} has protocol {}; an HTTP route needs an http or https service (use a stream route)",
                service.name,
                service.protocol.as_str()
            ),
        )),
        // A missing service is the store's to report, with the same field.
        Ok(_) | Err(StoreError::NotFound { .. }) => Ok(spec),
        Err(other) => Err(other.into()),
    }
}
