//! `/api/v1/services`

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, MergePatch, PageQuery, Pagination};
use super::{validate, AdminState, List};
use crate::model::{Service, ServiceSpec};

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_services, create_service))
        .routes(routes!(
            get_service,
            replace_service,
            patch_service,
            delete_service
        ))
}

#[utoipa::path(get, path = "/services", tag = "services", params(PageQuery),
    responses((status = 200, body = List<Service>), (status = 401, body = ErrorBody)))]
async fn list_services(
    _: Viewer,
    State(state): State<AdminState>,
    Pagination(page): Pagination,
) -> Result<Json<List<Service>>, ApiError> {
    let items = state.store.list_services(page).await?;
    Ok(Json(List::new(items, page, |s| s.id)))
}

#[utoipa::path(post, path = "/services", tag = "services", request_body = ServiceSpec,
    responses((status = 201, body = Service), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_service(
    _: Admin,
    State(state): State<AdminState>,
    ApiJson(spec): ApiJson<ServiceSpec>,
) -> Result<(StatusCode, Json<Service>), ApiError> {
    let spec = validate::service(spec)?;
    let service = state.store.create_service(&spec).await?;
    state.apply().await?;
    Ok((StatusCode::CREATED, Json(service)))
}

#[utoipa::path(get, path = "/services/{id}", tag = "services",
    responses((status = 200, body = Service), (status = 404, body = ErrorBody)))]
async fn get_service(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<Service>, ApiError> {
    Ok(Json(state.store.get_service(id).await?))
}

#[utoipa::path(put, path = "/services/{id}", tag = "services", request_body = ServiceSpec,
    responses((status = 200, body = Service), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn replace_service(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    ApiJson(spec): ApiJson<ServiceSpec>,
) -> Result<Json<Service>, ApiError> {
    let spec = validate::service(spec)?;
    let service = state.store.update_service(id, &spec).await?;
    state.apply().await?;
    Ok(Json(service))
}

#[utoipa::path(patch, path = "/services/{id}", tag = "services", request_body = Object,
    responses((status = 200, body = Service), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn patch_service(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    patch: MergePatch,
) -> Result<Json<Service>, ApiError> {
    let current = state.store.get_service(id).await?;
    let spec = validate::service(patch.apply(&current.spec())?)?;
    let service = state.store.update_service(id, &spec).await?;
    state.apply().await?;
    Ok(Json(service))
}

#[utoipa::path(delete, path = "/services/{id}", tag = "services",
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn delete_service(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    state.store.delete_service(id).await?;
    state.apply().await?;
    Ok(StatusCode::NO_CONTENT)
}
