//! `GET /api/v1/routes/{id}/rate-limit`: a route's limits as this gateway runs them (TRAFFIC.md
//! §6): its key table, what it admitted and refused, its requests in flight, and under
//! `scope: cluster` this gateway's part of the exchange with the others.
//!
//! Read from the live snapshot and the rate-share task's last picture, not the store: the view
//! keeps answering while the store is away, which is when an operator needs it most.

use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::Json;
use chrono::{DateTime, Utc};
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Viewer;
use super::error::{ApiError, ErrorBody};
use super::extract::IdPath;
use super::AdminState;
use crate::control::{RateShares, RoutePicture};
use crate::model::{Id, RateLimit, RateLimitScope, Route};

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new().routes(routes!(route_rate_limit))
}

/// A route's limits on this gateway.
#[derive(Debug, Serialize, ToSchema)]
pub struct RateLimitView {
    pub route_id: Id,
    /// The route's name.
    pub route: String,
    pub rate_limit: Option<RateLimit>,
    /// Requests a key at rest may send at once (the configured burst, or one second's worth).
    pub burst: Option<u32>,
    /// Keys tracked now, and at most.
    pub keys: u64,
    pub capacity: u64,
    /// Requests the current limit admitted and refused (from when it was last changed).
    pub admitted: u64,
    pub limited: u64,
    /// Keys forgotten to make room for others.
    pub evicted: u64,
    /// Requests answered 429 `rate_limited`, across the route's changes.
    pub rate_limited_total: u64,
    pub max_in_flight: Option<u32>,
    pub in_flight: u64,
    /// Requests answered 503 `too_many_requests`.
    pub in_flight_refused: u64,
    /// Under `scope: cluster`, this gateway's part of the exchange; null otherwise.
    pub cluster: Option<ClusterView>,
}

/// What this gateway knows of a cluster-scope limit.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterView {
    /// This gateway.
    pub instance_id: String,
    /// Gateways seen within the freshness window, this one included.
    pub instances: u32,
    /// The rate of a key without a share of its own here: the rate over `instances`.
    pub default_share_per_second: f64,
    /// The last exchange through the store that answered; null before the first.
    pub synced_at: Option<DateTime<Utc>>,
    /// Why exchanges fail, while they do (every share stays as last set meanwhile).
    pub last_error: Option<String>,
    /// The busiest keys here and elsewhere (at most 20).
    pub hot_keys: Vec<ClusterKeyView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClusterKeyView {
    /// 16 hex digits of the key's hash: never the key, which may be a credential.
    pub key: String,
    /// Requests per second offered here, smoothed.
    pub demand_per_second: f64,
    /// What the key runs at here.
    pub share_per_second: f64,
    /// The other gateways' demand of the key, as they last reported it.
    pub gateways: Vec<GatewayDemandView>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct GatewayDemandView {
    pub instance_id: String,
    pub demand_per_second: f64,
}

#[utoipa::path(get, path = "/routes/{id}/rate-limit", tag = "routes",
    responses((status = 200, body = RateLimitView), (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
async fn route_rate_limit(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<RateLimitView>, ApiError> {
    let snapshot = state.control.snapshot();
    let live = snapshot
        .routes()
        .into_iter()
        .find(|entry| entry.route.id == id)
        .cloned();
    let Some(entry) = live else {
        // Stored but not (or not yet) routed: nothing counted; unknown: the usual 404.
        let route = state.store.get_route(id).await?;
        return Ok(Json(idle_view(&route)));
    };
    let stats = &entry.stats;
    let mut view = idle_view(&entry.route);
    view.rate_limited_total = stats.rate_limited.load(Ordering::Relaxed);
    view.in_flight = stats.in_flight.load(Ordering::Relaxed);
    view.in_flight_refused = stats.in_flight_refused.load(Ordering::Relaxed);
    if let Some(limiter) = &entry.limiter {
        view.rate_limit = Some(limiter.spec().clone());
        view.burst = Some(limiter.spec().effective_burst());
        view.keys = limiter.keys();
        view.capacity = limiter.capacity() as u64;
        view.admitted = limiter.admitted.load(Ordering::Relaxed);
        view.limited = limiter.limited.load(Ordering::Relaxed);
        view.evicted = limiter.evicted.load(Ordering::Relaxed);
    }
    let shares = state.control.rate_shares();
    view.cluster = match (shares.route(id), &entry.limiter) {
        (Some(picture), _) => Some(cluster_view(shares, picture)),
        // A cluster route the task has not reached yet (it is at most a period old).
        (None, Some(limiter)) if limiter.spec().scope == RateLimitScope::Cluster => {
            Some(cluster_view(
                shares,
                RoutePicture {
                    instances: 1,
                    default_share_per_second: limiter.default_rate(),
                    synced_at: None,
                    last_error: None,
                    keys: Vec::new(),
                },
            ))
        }
        _ => None,
    };
    Ok(Json(view))
}

fn idle_view(route: &Route) -> RateLimitView {
    RateLimitView {
        route_id: route.id,
        route: route.name.clone(),
        rate_limit: route.rate_limit.clone(),
        burst: route.rate_limit.as_ref().map(RateLimit::effective_burst),
        keys: 0,
        capacity: 0,
        admitted: 0,
        limited: 0,
        evicted: 0,
        rate_limited_total: 0,
        max_in_flight: route.max_in_flight,
        in_flight: 0,
        in_flight_refused: 0,
        cluster: None,
    }
}

fn cluster_view(shares: &RateShares, picture: RoutePicture) -> ClusterView {
    ClusterView {
        instance_id: shares.instance_id().to_owned(),
        instances: picture.instances,
        default_share_per_second: picture.default_share_per_second,
        synced_at: picture.synced_at,
        last_error: picture.last_error,
        hot_keys: picture
            .keys
            .into_iter()
            .map(|key| ClusterKeyView {
                key: format!("{:016x}", key.key),
                demand_per_second: key.demand_per_second,
                share_per_second: key.share_per_second,
                gateways: key
                    .gateways
                    .into_iter()
                    .map(|gateway| GatewayDemandView {
                        instance_id: gateway.instance_id,
                        demand_per_second: gateway.demand_per_second,
                    })
                    .collect(),
            })
            .collect(),
    }
}
