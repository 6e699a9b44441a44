//! Discovery sources: `/api/v1/services/{id}/discovery-sources`, `/api/v1/discovery-sources/{id}`
//! (admin only: configs can hold registry credentials) and `/api/v1/discovery/providers`. A
//! source's `/status` is open to viewers: it carries no `config` (the same status the event
//! stream already shows them), and its `last_error` names registries without credentials.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::{ApiJson, IdPath, MergePatch, PageQuery, Pagination};
use super::{AdminState, List};
use crate::control::{AcceptAnswer, RefreshAnswer};
use crate::discovery::{self, ProviderDescriptor};
use crate::model::{DiscoverySource, DiscoverySourceSpec, Id, SourceStatus};
use crate::validate;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(list_sources, create_source))
        .routes(routes!(
            get_source,
            replace_source,
            patch_source,
            delete_source
        ))
        .routes(routes!(source_status))
        .routes(routes!(refresh_source))
        .routes(routes!(accept_removals))
        .routes(routes!(list_providers))
}

#[utoipa::path(get, path = "/services/{id}/discovery-sources", tag = "discovery", params(PageQuery),
    responses((status = 200, body = List<DiscoverySource>), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
async fn list_sources(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(service_id): IdPath,
    Pagination(page): Pagination,
) -> Result<Json<List<DiscoverySource>>, ApiError> {
    let items = state.store.list_sources(service_id, page).await?;
    Ok(Json(List::new(items, page, |s| s.id)))
}

#[utoipa::path(post, path = "/services/{id}/discovery-sources", tag = "discovery", request_body = DiscoverySourceSpec,
    responses((status = 201, body = DiscoverySource), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn create_source(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(service_id): IdPath,
    ApiJson(spec): ApiJson<DiscoverySourceSpec>,
) -> Result<(StatusCode, Json<DiscoverySource>), ApiError> {
    let spec = validate::source(spec)?;
    let source = state.store.create_source(service_id, &spec).await?;
    state.apply().await?;
    Ok((StatusCode::CREATED, Json(source)))
}

#[utoipa::path(get, path = "/discovery-sources/{id}", tag = "discovery",
    responses((status = 200, body = DiscoverySource), (status = 404, body = ErrorBody)))]
async fn get_source(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<DiscoverySource>, ApiError> {
    Ok(Json(state.store.get_source(id).await?))
}

#[utoipa::path(put, path = "/discovery-sources/{id}", tag = "discovery", request_body = DiscoverySourceSpec,
    responses((status = 200, body = DiscoverySource), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn replace_source(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    ApiJson(spec): ApiJson<DiscoverySourceSpec>,
) -> Result<Json<DiscoverySource>, ApiError> {
    let spec = validate::source(spec)?;
    let source = state.store.update_source(id, &spec).await?;
    state.apply().await?;
    Ok(Json(source))
}

#[utoipa::path(patch, path = "/discovery-sources/{id}", tag = "discovery", request_body = Object,
    responses((status = 200, body = DiscoverySource), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn patch_source(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
    patch: MergePatch,
) -> Result<Json<DiscoverySource>, ApiError> {
    let current = state.store.get_source(id).await?;
    // Null removes a member in a merge patch, and a source without `removal_guard` gets the
    // default guard; an explicit null still means "off", as in POST and PUT.
    let guard_off = patch.0.get("removal_guard").is_some_and(|v| v.is_null());
    let mut spec = patch.apply(&current.spec())?;
    if guard_off {
        spec.removal_guard = None;
    }
    let spec = validate::source(spec)?;
    let source = state.store.update_source(id, &spec).await?;
    state.apply().await?;
    Ok(Json(source))
}

#[utoipa::path(delete, path = "/discovery-sources/{id}", tag = "discovery",
    responses((status = 204), (status = 404, body = ErrorBody)))]
async fn delete_source(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<StatusCode, ApiError> {
    state.store.delete_source(id).await?;
    state.apply().await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn status_of(state: &AdminState, id: Id) -> Result<SourceStatus, ApiError> {
    let (progress, endpoints) = state.store.source_progress_and_counts(id).await?;
    Ok(SourceStatus {
        source_id: id,
        progress,
        endpoints,
        refreshed_by: state.store.source_lease_holder(id).await?,
        removal_acceptance: state.store.removal_acceptance(id).await?,
    })
}

/// The source's status (viewer): state, counts, refresh times, guard, watch, the last accepted
/// removals; never its `config`.
#[utoipa::path(get, path = "/discovery-sources/{id}/status", tag = "discovery",
    responses((status = 200, body = SourceStatus), (status = 404, body = ErrorBody)))]
async fn source_status(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<SourceStatus>, ApiError> {
    Ok(Json(status_of(&state, id).await?))
}

/// Queues an immediate refresh (joined with one already running) and answers at once with the
/// current status; poll the status endpoint for the result.
#[utoipa::path(post, path = "/discovery-sources/{id}/refresh", tag = "discovery",
    responses((status = 202, body = SourceStatus), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn refresh_source(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<(StatusCode, Json<SourceStatus>), ApiError> {
    state.store.get_source(id).await?;
    match state.control.refresh_source(id).await? {
        RefreshAnswer::Queued | RefreshAnswer::Joined => {}
        RefreshAnswer::Disabled => {
            return Err(ApiError::Conflict {
                field: Some("enabled".to_owned()),
                message: format!("discovery source {id} is disabled; enable it to refresh"),
            })
        }
        RefreshAnswer::Unknown => {
            return Err(ApiError::NotFound {
                message: format!("discovery source {id} not found"),
            })
        }
    }
    Ok((StatusCode::ACCEPTED, Json(status_of(&state, id).await?)))
}

/// What `POST /discovery-sources/{id}/accept-removals` did.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct AcceptedRemovals {
    /// Targets that drain now (0 when the guard held nothing); null when the acceptance was
    /// passed on to the instance that refreshes the source.
    pub released: Option<u64>,
    /// When the hold ended (the database's clock); null when passed on: then
    /// `status.removal_acceptance.released_at` tells when the holder applied it.
    pub released_at: Option<chrono::DateTime<chrono::Utc>>,
    pub status: SourceStatus,
}

/// Accepts the removals the source's removal guard holds: those targets drain now (200). On a
/// shared store, an instance that does not refresh the source stores the acceptance for the one
/// that does, tells it, and answers 202; the holder applies it at once, or after a lost
/// notification, a reconnect or a takeover, and the source's status records when
/// (`removal_acceptance`). A hold that begins after the request is not released by it.
#[utoipa::path(post, path = "/discovery-sources/{id}/accept-removals", tag = "discovery",
    responses((status = 200, body = AcceptedRemovals), (status = 202, body = AcceptedRemovals), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn accept_removals(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<(StatusCode, Json<AcceptedRemovals>), ApiError> {
    state.store.get_source(id).await?;
    let (code, released, released_at) = match state.control.accept_removals(id).await? {
        AcceptAnswer::Released {
            released,
            released_at,
        } => (StatusCode::OK, Some(released), Some(released_at)),
        AcceptAnswer::PassedOn => (StatusCode::ACCEPTED, None, None),
        AcceptAnswer::NoHolder => {
            return Err(ApiError::Unavailable {
                message: format!(
                    "no instance refreshes discovery source {id} right now (its lease is not \
                     held); try again"
                ),
            })
        }
        AcceptAnswer::Unknown => {
            return Err(ApiError::NotFound {
                message: format!("discovery source {id} not found"),
            })
        }
    };
    let status = status_of(&state, id).await?;
    Ok((
        code,
        Json(AcceptedRemovals {
            released,
            released_at,
            status,
        }),
    ))
}

#[utoipa::path(get, path = "/discovery/providers", tag = "discovery",
    responses((status = 200, body = Vec<ProviderDescriptor>)))]
async fn list_providers(_: Viewer) -> Json<Vec<ProviderDescriptor>> {
    Json(discovery::descriptors())
}
