//! `/api/v1/routes/{id}/canary`: where a route's canary stands (TRAFFIC.md §4), and the
//! operator's `pause`, `resume`, `promote` and `rollback`. Read from the store: the canary is
//! the cluster's, judged on every gateway's counts, not this gateway's alone.

use axum::extract::State;
use axum::Json;
use chrono::{DateTime, TimeZone, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Admin, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::IdPath;
use super::AdminState;
use crate::model::{
    Canary, CanaryAction, CanaryDecision, CanaryMove, CanaryState, Id, IntervalCounts, Route,
};
use crate::snapshot::canary_weights;

/// Decisions the view shows, the newest last.
const HISTORY_SHOWN: u32 = 50;

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(get_canary))
        .routes(routes!(pause_canary))
        .routes(routes!(resume_canary))
        .routes(routes!(promote_canary))
        .routes(routes!(rollback_canary))
}

/// One backend's share while the canary stands where it does.
#[derive(Debug, Serialize, ToSchema)]
pub struct BackendWeight {
    /// The backend's position in `backends`.
    pub backend: usize,
    pub service_id: Id,
    /// Percent of the route's requests.
    pub percent: f64,
    pub canary: bool,
}

/// The interval being judged, by every gateway's counts so far.
#[derive(Debug, Serialize, ToSchema)]
pub struct IntervalView {
    pub round: i64,
    pub started_at: DateTime<Utc>,
    /// When it is judged (while progressing).
    pub ends_at: Option<DateTime<Utc>>,
    /// By backend position.
    pub counts: Vec<IntervalCounts>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CanaryView {
    pub route_id: Id,
    /// The route's name.
    pub route: String,
    pub canary: Canary,
    pub state: CanaryState,
    /// The step in force (0-based position in `steps`).
    pub step: u32,
    /// The canary backend's percent now.
    pub weight: u8,
    pub weights: Vec<BackendWeight>,
    /// Why the canary is where it is.
    pub reason: String,
    pub interval: IntervalView,
    /// The gateway holding the route's canary lease (it judges); null while none does.
    pub judged_by: Option<String>,
    /// Decisions and actions, oldest first, with the counts each was taken on.
    pub history: Vec<CanaryDecision>,
}

fn time_of(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(ms).single().unwrap_or_default()
}

fn no_canary(route: &Route) -> ApiError {
    ApiError::NotFound {
        message: format!("route {} has no canary", route.id),
    }
}

async fn view(state: &AdminState, id: Id) -> Result<CanaryView, ApiError> {
    let route = state.store.get_route(id).await?;
    let Some(canary) = route.canary.clone() else {
        return Err(no_canary(&route));
    };
    let judged = state
        .store
        .judged_canary(id)
        .await?
        .ok_or_else(|| no_canary(&route))?;
    let status = judged.status;
    let weights = canary_weights(&route.backends, &canary, status.weight)
        .into_iter()
        .zip(&route.backends)
        .enumerate()
        .map(|(index, (weight, backend))| BackendWeight {
            backend: index,
            service_id: backend.service_id,
            percent: f64::from(weight) / 100.0,
            canary: index == canary.backend_index(),
        })
        .collect();
    let counts = (0..route.backends.len())
        .map(|backend| IntervalCounts::of(&judged.counts.get(backend).cloned().unwrap_or_default()))
        .collect();
    let interval_ms = i64::try_from(canary.step_interval_ms).unwrap_or(i64::MAX);
    let interval = IntervalView {
        round: status.round,
        started_at: time_of(status.interval_started_ms),
        ends_at: (status.state == CanaryState::Progressing)
            .then(|| time_of(status.interval_started_ms.saturating_add(interval_ms))),
        counts,
    };
    Ok(CanaryView {
        route_id: route.id,
        route: route.name,
        state: status.state,
        step: status.step,
        weight: status.weight,
        weights,
        reason: status.reason,
        interval,
        judged_by: state.store.canary_lease_holder(id).await?,
        history: state.store.canary_history(id, HISTORY_SHOWN).await?,
        canary,
    })
}

#[utoipa::path(get, path = "/routes/{id}/canary", tag = "routes",
    responses((status = 200, body = CanaryView), (status = 404, body = ErrorBody)))]
async fn get_canary(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<CanaryView>, ApiError> {
    Ok(Json(view(&state, id).await?))
}

/// Takes an operator's action on the canary as it stands now; a canary that moved meanwhile
/// (a decision in the same instant) is read again and the action taken on where it went.
async fn act(state: &AdminState, id: Id, action: CanaryAction) -> Result<CanaryView, ApiError> {
    const ATTEMPTS: usize = 3;
    for _ in 0..ATTEMPTS {
        let route = state.store.get_route(id).await?;
        let (Some(canary), Some(status)) = (&route.canary, &route.canary_status) else {
            return Err(no_canary(&route));
        };
        let moved = CanaryMove::after_action(canary, status, action).map_err(|message| {
            ApiError::Conflict {
                field: Some("state".to_owned()),
                message,
            }
        })?;
        if moved.state == status.state && moved.weight == status.weight && moved.step == status.step
        {
            return view(state, id).await;
        }
        if state
            .store
            .move_canary(id, status.round, &moved, &[])
            .await?
            .is_some()
        {
            state.apply().await?;
            return view(state, id).await;
        }
    }
    Err(ApiError::Conflict {
        field: None,
        message: format!("the canary of route {id} keeps moving; try again"),
    })
}

#[utoipa::path(post, path = "/routes/{id}/canary/pause", tag = "routes",
    responses((status = 200, body = CanaryView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn pause_canary(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<CanaryView>, ApiError> {
    Ok(Json(act(&state, id, CanaryAction::Pause).await?))
}

#[utoipa::path(post, path = "/routes/{id}/canary/resume", tag = "routes",
    responses((status = 200, body = CanaryView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
async fn resume_canary(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<CanaryView>, ApiError> {
    Ok(Json(act(&state, id, CanaryAction::Resume).await?))
}

#[utoipa::path(post, path = "/routes/{id}/canary/promote", tag = "routes",
    responses((status = 200, body = CanaryView), (status = 404, body = ErrorBody)))]
async fn promote_canary(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<CanaryView>, ApiError> {
    Ok(Json(act(&state, id, CanaryAction::Promote).await?))
}

#[utoipa::path(post, path = "/routes/{id}/canary/rollback", tag = "routes",
    responses((status = 200, body = CanaryView), (status = 404, body = ErrorBody)))]
async fn rollback_canary(
    _: Admin,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<CanaryView>, ApiError> {
    Ok(Json(act(&state, id, CanaryAction::Rollback).await?))
}
