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
use crate::model::{Id, Route, RouteSpec};
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
    let shorthand = spec.service_id.is_some();
    let spec = checked(&state, spec).await?;
    let route = state
        .store
        .create_route(&spec)
        .await
        .map_err(|error| as_written(error.into(), shorthand))?;
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
    let shorthand = spec.service_id.is_some();
    let spec = checked(&state, spec).await?;
    let route = state
        .store
        .update_route(id, &spec)
        .await
        .map_err(|error| as_written(error.into(), shorthand))?;
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
    let document = without_replaced_alternatives(
        serde_json::to_value(current.spec()).expect("a route spec always serialises"),
        &patch,
    );
    let spec: RouteSpec = super::extract::from_value(patch.apply(&document)?)?;
    let shorthand = spec.service_id.is_some();
    let spec = checked(&state, spec).await?;
    let route = state
        .store
        .update_route(id, &spec)
        .await
        .map_err(|error| as_written(error.into(), shorthand))?;
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

/// A route written with the `service_id` shorthand has its one backend's errors named as
/// `service_id`, the field its writer used.
fn as_written(error: ApiError, shorthand: bool) -> ApiError {
    match error {
        ApiError::Validation { field, message }
            if shorthand && field == "backends[0].service_id" =>
        {
            ApiError::Validation {
                field: "service_id".to_owned(),
                message,
            }
        }
        other => other,
    }
}

/// Validates the spec; every service it sends to must speak HTTP (`http`, `https`, `h2c`).
async fn checked(state: &AdminState, spec: RouteSpec) -> Result<RouteSpec, ApiError> {
    let shorthand = spec.service_id.is_some();
    let spec = validate::route(spec)?;
    let mut named: Vec<(String, Id)> = spec
        .backends
        .iter()
        .enumerate()
        .map(|(index, backend)| (format!("backends[{index}].service_id"), backend.service_id))
        .collect();
    if let Some(mirror) = &spec.mirror {
        named.push(("mirror.service_id".to_owned(), mirror.service_id));
    }
    for (field, service_id) in named {
        match state.store.get_service(service_id).await {
            Ok(service) if !validate::serves_http(service.protocol) => {
                return Err(as_written(ApiError::validation(
                    field,
                    format!(
                        "service {:?} has protocol {}; an HTTP route needs an http, https or h2c service (use a stream route)",
                        service.name,
                        service.protocol.as_str()
                    ),
                ), shorthand))
            }
            // A missing service is the store's to report, with the same field.
            Ok(_) | Err(StoreError::NotFound { .. }) => {}
            Err(other) => return Err(other.into()),
        }
    }
    Ok(spec)
}

/// Fields that say the same thing in different ways: a patch that names one of a group (not
/// as null) replaces the others, so `{"service_id": 7}` moves a route with backends, and
/// `{"path_exact": "/x"}` replaces its prefix.
const ALTERNATIVES: &[&[&str]] = &[
    &["service_id", "backends", "redirect"],
    &["path_prefix", "path_exact", "path_regex"],
];

fn without_replaced_alternatives(
    mut current: serde_json::Value,
    patch: &MergePatch,
) -> serde_json::Value {
    if let Some(document) = current.as_object_mut() {
        for group in ALTERNATIVES {
            let named = group.iter().any(|field| patch.names_value_for(field));
            if named {
                for field in group.iter().filter(|field| !patch.names(field)) {
                    document.remove(*field);
                }
            }
        }
    }
    current
}
