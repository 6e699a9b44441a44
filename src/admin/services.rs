//! `/api/v1/services`

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
use std::sync::atomic::Ordering;

use serde::Serialize;
use utoipa::ToSchema;

use crate::clock::unix_ms;
use crate::model::{Health, Id, Service, ServiceSpec};

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_services, create_service))
        .routes(routes!(
            get_service,
            replace_service,
            patch_service,
            delete_service
        ))
        .routes(routes!(service_runtime))
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
    super::stream_routes::check_protocol_change(&state, id, spec.protocol)?;
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
    super::stream_routes::check_protocol_change(&state, id, spec.protocol)?;
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

/// What the data path sees of a service right now.
#[derive(Serialize, ToSchema)]
pub struct ServiceRuntimeView {
    pub service_id: Id,
    /// Picks that ignored health and ejection because no tier had an available target.
    pub panic_picks: u64,
    /// Targets in rotation (active, enabled, weight > 0).
    pub targets: Vec<TargetRuntimeView>,
}

#[derive(Serialize, ToSchema)]
pub struct TargetRuntimeView {
    pub id: Id,
    pub address: String,
    pub health: Health,
    pub ejected_until: Option<chrono::DateTime<chrono::Utc>>,
    /// Its ejection has ended but no request has succeeded since: it takes one trial request at
    /// a time, and is not `available` while one is in flight.
    pub half_open: bool,
    /// Ejections since its last success; the next one lasts one more times `base_ejection_ms`.
    pub ejections: u32,
    pub in_flight: u32,
    pub available: bool,
}

#[utoipa::path(get, path = "/services/{id}/runtime", tag = "services",
    responses((status = 200, body = ServiceRuntimeView), (status = 404, body = ErrorBody)))]
async fn service_runtime(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<ServiceRuntimeView>, ApiError> {
    state.store.get_service(id).await?;
    let snapshot = state.control.snapshot();
    let now = unix_ms();
    let view = match snapshot.service(id) {
        None => ServiceRuntimeView {
            service_id: id,
            panic_picks: 0,
            targets: Vec::new(),
        },
        Some(service) => ServiceRuntimeView {
            service_id: id,
            panic_picks: service.counters.panic_picks.load(Ordering::Relaxed),
            targets: service
                .targets
                .iter()
                .map(|target| TargetRuntimeView {
                    id: target.id,
                    address: target.authority.to_string(),
                    health: target.health.health(),
                    ejected_until: target
                        .health
                        .ejected_until(now)
                        .and_then(|ms| chrono::DateTime::from_timestamp_millis(ms as i64)),
                    half_open: target.health.half_open(now),
                    ejections: target.health.ejections(),
                    in_flight: target.load.in_flight(),
                    available: target.health.is_available(|| now),
                })
                .collect(),
        },
    };
    Ok(Json(view))
}
