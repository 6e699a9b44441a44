//! `/api/v1/stream-routes`: L4 routes. Creating one binds its listen address at once (a taken
//! address is a 409 naming it); deleting the last route of an address stops accepting there
//! while open connections finish.

use std::net::SocketAddr;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, MergePatch, PageQuery, Pagination};
use super::{AdminState, List};
use crate::model::{Id, Protocol, StreamRoute, StreamRouteSpec};
use crate::store::StoreError;
use crate::validate;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_stream_routes, create_stream_route))
        .routes(routes!(
            get_stream_route,
            replace_stream_route,
            patch_stream_route,
            delete_stream_route
        ))
}

#[utoipa::path(get, path = "/stream-routes", tag = "stream-routes", params(PageQuery),
    responses((status = 200, body = List<StreamRoute>), (status = 401, body = ErrorBody)))]
async fn list_stream_routes(
    _: Viewer,
    State(state): State<AdminState>,
    Pagination(page): Pagination,
) -> Result<Json<List<StreamRoute>>, ApiError> {
    let items = state.store.list_stream_routes(page).await?;
    Ok(Json(List::new(items, page, |r| r.id)))
}

#[utoipa::path(post, path = "/stream-routes", tag = "stream-routes", request_body = StreamRouteSpec,
    responses((status = 201, body = StreamRoute), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_stream_route(
    _: Admin,
    State(state): State<AdminState>,
    ApiJson(spec): ApiJson<StreamRouteSpec>,
) -> Result<(StatusCode, Json<StreamRoute>), ApiError> {
    let _serialised = STREAM_ROUTE_WRITES.lock().await;
    let spec = checked(&state, spec, None).await?;
    let route =
        store_after_bind(&state, spec.listen, state.store.create_stream_route(&spec)).await?;
    Ok((StatusCode::CREATED, Json(route)))
}

#[utoipa::path(get, path = "/stream-routes/{id}", tag = "stream-routes",
    responses((status = 200, body = StreamRoute), (status = 404, body = ErrorBody)))]
async fn get_stream_route(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<StreamRoute>, ApiError> {
    Ok(Json(state.store.get_stream_route(id).await?))
}

#[utoipa::path(put, path = "/stream-routes/{id}", tag = "stream-routes", request_body = StreamRouteSpec,
    responses((status = 200, body = StreamRoute), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn replace_stream_route(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    ApiJson(spec): ApiJson<StreamRouteSpec>,
) -> Result<Json<StreamRoute>, ApiError> {
    let _serialised = STREAM_ROUTE_WRITES.lock().await;
    state.store.get_stream_route(id).await?;
    let spec = checked(&state, spec, Some(id)).await?;
    let route = store_after_bind(
        &state,
        spec.listen,
        state.store.update_stream_route(id, &spec),
    )
    .await?;
    Ok(Json(route))
}

#[utoipa::path(patch, path = "/stream-routes/{id}", tag = "stream-routes", request_body = Object,
    responses((status = 200, body = StreamRoute), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn patch_stream_route(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    patch: MergePatch,
) -> Result<Json<StreamRoute>, ApiError> {
    let _serialised = STREAM_ROUTE_WRITES.lock().await;
    let current = state.store.get_stream_route(id).await?;
    let spec = checked(&state, patch.apply(&current.spec())?, Some(id)).await?;
    let route = store_after_bind(
        &state,
        spec.listen,
        state.store.update_stream_route(id, &spec),
    )
    .await?;
    Ok(Json(route))
}

#[utoipa::path(delete, path = "/stream-routes/{id}", tag = "stream-routes",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_stream_route(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    let _serialised = STREAM_ROUTE_WRITES.lock().await;
    state.store.delete_stream_route(id).await?;
    state.apply().await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Binds the listen address, then stores the route and makes it live. A failed store write
/// still applies, so a listener bound only for this route closes again.
async fn store_after_bind(
    state: &AdminState,
    listen: SocketAddr,
    write: impl std::future::Future<Output = Result<StreamRoute, StoreError>>,
) -> Result<StreamRoute, ApiError> {
    if let Err(error) = state.control.bind_stream_listener(listen).await? {
        return Err(ApiError::Conflict {
            field: Some("listen".to_owned()),
            message: error.to_string(),
        });
    }
    let written = write.await;
    let applied = state.control.apply_after_bind(listen).await;
    let route = written?;
    applied?;
    Ok(route)
}

/// Stream-route writes one at a time: the check that a tcp route has its address to itself
/// reads the live routes, and two concurrent writes must not both pass it.
static STREAM_ROUTE_WRITES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Validates the spec and checks it against its service and the other routes of its listen
/// address (`editing`: the route being replaced, which does not count).
async fn checked(
    state: &AdminState,
    spec: StreamRouteSpec,
    editing: Option<Id>,
) -> Result<StreamRouteSpec, ApiError> {
    let spec = validate::stream_route(spec)?;
    let service = match state.store.get_service(spec.service_id).await {
        Ok(service) => service,
        Err(StoreError::NotFound { .. }) => {
            return Err(ApiError::validation(
                "service_id",
                format!("service {} does not exist", spec.service_id),
            ))
        }
        Err(other) => return Err(other.into()),
    };
    match (service.protocol, &spec.sni) {
        (Protocol::Tls, _) | (Protocol::Tcp, None) => {}
        (Protocol::Tcp, Some(_)) => {
            return Err(ApiError::validation(
                "sni",
                format!(
                    "service {:?} is a tcp service; a route with an SNI passes TLS through and needs a tls service",
                    service.name
                ),
            ))
        }
        (Protocol::Http | Protocol::Https | Protocol::H2c, _) => {
            return Err(ApiError::validation(
                "service_id",
                format!(
                    "service {:?} has protocol {}; a stream route needs a tcp or tls service",
                    service.name,
                    service.protocol.as_str()
                ),
            ))
        }
    }
    let plain_tcp = service.protocol == Protocol::Tcp;
    let snapshot = state.control.snapshot();
    for other in snapshot.streams().routes() {
        let route = &other.route;
        if Some(route.id) == editing || route.listen != spec.listen {
            continue;
        }
        let other_plain_tcp = other.service.service.protocol == Protocol::Tcp;
        if plain_tcp || other_plain_tcp {
            return Err(ApiError::Conflict {
                field: Some("listen".to_owned()),
                message: format!(
                    "{} is used by stream route {}; a tcp route needs its listen address to itself (TLS passthrough routes with an sni can share one)",
                    spec.listen, route.id
                ),
            });
        }
    }
    Ok(spec)
}

/// Refuses a service protocol change that routes pointing at the service could not follow.
pub(super) fn check_protocol_change(
    state: &AdminState,
    service_id: Id,
    protocol: Protocol,
) -> Result<(), ApiError> {
    let snapshot = state.control.snapshot();
    if !validate::serves_http(protocol) {
        if let Some(route) = snapshot
            .routes()
            .into_iter()
            .find(|entry| entry.route.service_ids().any(|id| id == service_id))
        {
            return Err(ApiError::Conflict {
                field: Some("protocol".to_owned()),
                message: format!(
                    "HTTP route {:?} sends to this service; protocol must stay http or https",
                    route.route.name
                ),
            });
        }
    }
    for entry in snapshot.streams().routes() {
        let route = &entry.route;
        if route.service_id != service_id {
            continue;
        }
        let shares_address = || {
            snapshot
                .streams()
                .routes()
                .any(|other| other.route.id != route.id && other.route.listen == route.listen)
        };
        let fits = match protocol {
            Protocol::Tls => true,
            Protocol::Tcp => route.sni.is_none() && !shares_address(),
            Protocol::Http | Protocol::Https | Protocol::H2c => false,
        };
        if !fits {
            return Err(ApiError::Conflict {
                field: Some("protocol".to_owned()),
                message: format!(
                    "stream route {} on {} sends to this service; protocol {} does not fit it",
                    route.id,
                    route.listen,
                    protocol.as_str()
                ),
            });
        }
    }
    Ok(())
}
