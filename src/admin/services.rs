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
use crate::model::{HashOn, Health, Id, LbPolicy, Service, ServiceSpec};
use crate::snapshot::{RetryCounters, RetryReason, ServiceRuntime};
use std::collections::{BTreeMap, HashMap};

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
    let spec = validate::service(patch.apply_replacing(&current.spec(), &["hash_on"])?)?;
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
    pub lb_policy: LbPolicy,
    /// Under `ring_hash` or `maglev`: each tier's table.
    pub hashing: Option<HashingView>,
    /// With `session_persistence`: the draining targets that keep their sessions, and how many
    /// sessions had to move.
    pub sessions: Option<SessionsView>,
    /// Targets in rotation (active, enabled, weight > 0).
    pub targets: Vec<TargetRuntimeView>,
    /// Retries and hedges sent to the service on this gateway, and its retry budget's window.
    pub retries: RetriesView,
    /// The zone split in force and why (TRAFFIC.md §4).
    pub locality: LocalityView,
}

/// Where a service's requests go by zone on this gateway (TRAFFIC.md §4).
#[derive(Serialize, ToSchema, Debug, PartialEq)]
pub struct LocalityView {
    /// The gateway's zone (`cluster.zone`); null when none is configured.
    pub zone: Option<String>,
    /// `zone_only` (the zone's targets take every request), `all_zones` (below the threshold:
    /// every target of every zone), `no_zone_configured` (the service has `locality`, the gateway
    /// no `cluster.zone`) or `no_locality`.
    pub in_force: &'static str,
    /// The service's `locality.min_available_percent`; null without `locality`.
    pub min_available_percent: Option<u32>,
    /// How the zone's targets were chosen: `hints` (every target carries Kubernetes
    /// EndpointSlice `hints.forZones`) or `labels` (their `zone` label); null without a split.
    pub basis: Option<&'static str>,
    /// The zone's targets counted (those in the priority tier the service picks from) and how
    /// many of them were available at the last look (every 250 ms).
    pub available: u32,
    pub total: u32,
    /// Picks made among the zone's targets, and among every zone's, since the split was built
    /// (counted across rebuilds of the service).
    pub zone_picks: u64,
    pub all_zone_picks: u64,
    /// Why, in a sentence.
    pub reason: String,
}

/// A service's retries on this gateway (TRAFFIC.md §5).
#[derive(Serialize, ToSchema, Debug, PartialEq)]
pub struct RetriesView {
    /// Requests sent to the service in the retry budget's window (the last 10 s, by the second).
    pub window_requests: u64,
    /// Retries and hedges the budget allowed in that window.
    pub window_retries: u64,
    /// Retries sent since start, by what the attempt before met: `connect_failure`, `refused`,
    /// `reset`, `per_try_timeout`, `status`, `grpc_status` (every reason, zeros included).
    pub sent: BTreeMap<String, u64>,
    /// Retries and hedges the budget refused since start: the failure went to the client as it
    /// was.
    pub budget_exhausted: u64,
    /// Hedged attempts sent since start.
    pub hedges: u64,
}

#[derive(Serialize, ToSchema)]
pub struct HashingView {
    pub hash_on: Option<HashOn>,
    pub hash_balance_factor: Option<u32>,
    /// Requests in flight to the service (kept under `hash_balance_factor`, else null).
    pub in_flight: Option<u64>,
    pub tiers: Vec<HashTierView>,
}

#[derive(Serialize, ToSchema)]
pub struct HashTierView {
    pub priority: i32,
    /// Ring points or Maglev entries.
    pub size: usize,
    pub memory_bytes: usize,
}

#[derive(Serialize, ToSchema)]
pub struct SessionsView {
    pub cookie: String,
    /// Requests whose session's target could not take them, pinned anew.
    pub repinned: u64,
    /// Draining targets that still serve their sessions until they are removed.
    pub draining: Vec<DrainingTargetView>,
}

#[derive(Serialize, ToSchema)]
pub struct DrainingTargetView {
    pub id: Id,
    pub address: String,
    pub in_flight: u32,
    pub available: bool,
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
    /// Under hashing: the share of its tier's keys this target owns (slots / table size).
    pub hash_share: Option<f64>,
    /// With a zone split: whether the target is one of the zone's (null without one).
    pub in_zone: Option<bool>,
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
            lb_policy: LbPolicy::default(),
            hashing: None,
            sessions: None,
            targets: Vec::new(),
            retries: retries_view(&RetryCounters::default(), tokio::time::Instant::now()),
            locality: LocalityView::without_runtime(state.control.zone()),
        },
        Some(service) => {
            let shares = hash_shares(service);
            ServiceRuntimeView {
                service_id: id,
                panic_picks: service.counters.panic_picks.load(Ordering::Relaxed),
                lb_policy: service.service.lb_policy,
                hashing: hashing_view(service),
                sessions: sessions_view(service, now),
                targets: service
                    .targets
                    .iter()
                    .enumerate()
                    .map(|(index, target)| TargetRuntimeView {
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
                        hash_share: shares.get(&index).copied(),
                        in_zone: service
                            .locality
                            .as_deref()
                            .map(|split| split.contains(index)),
                    })
                    .collect(),
                retries: retries_view(&service.counters.retries, tokio::time::Instant::now()),
                locality: locality_view(service, state.control.zone()),
            }
        }
    };
    Ok(Json(view))
}

impl LocalityView {
    /// A service not in the snapshot (yet): nothing decided.
    fn without_runtime(zone: Option<&str>) -> LocalityView {
        LocalityView {
            zone: zone.map(str::to_owned),
            in_force: "no_locality",
            min_available_percent: None,
            basis: None,
            available: 0,
            total: 0,
            zone_picks: 0,
            all_zone_picks: 0,
            reason: "the service is not in the routing snapshot".to_owned(),
        }
    }
}

fn locality_view(service: &ServiceRuntime, zone: Option<&str>) -> LocalityView {
    let counters = &service.counters;
    let mut view = LocalityView {
        zone: zone.map(str::to_owned),
        in_force: "no_locality",
        min_available_percent: service
            .service
            .locality
            .map(|locality| locality.min_available_percent),
        basis: None,
        available: 0,
        total: 0,
        zone_picks: counters.zone_picks.load(Ordering::Relaxed),
        all_zone_picks: counters.all_zone_picks.load(Ordering::Relaxed),
        reason: "the service has no locality: every zone alike".to_owned(),
    };
    let Some(split) = service.locality.as_deref() else {
        if service.service.locality.is_some() {
            view.in_force = "no_zone_configured";
            view.reason =
                "the gateway has no cluster.zone (RAAHI_CLUSTER_ZONE): every zone alike".to_owned();
        }
        return view;
    };
    let decision = split.decision();
    view.in_force = if decision.in_force.is_some() {
        "zone_only"
    } else {
        "all_zones"
    };
    view.basis = Some(split.basis().as_str());
    view.available = decision.available;
    view.total = decision.total;
    view.reason = split.reason(decision);
    view
}

fn retries_view(counters: &RetryCounters, now: tokio::time::Instant) -> RetriesView {
    let window = counters.totals(now);
    RetriesView {
        window_requests: window.requests,
        window_retries: window.retries,
        sent: RetryReason::ALL
            .iter()
            .map(|reason| {
                (
                    reason.name().to_owned(),
                    counters.sent[*reason as usize].load(Ordering::Relaxed),
                )
            })
            .collect(),
        budget_exhausted: counters.budget_exhausted.load(Ordering::Relaxed),
        hedges: counters.hedges.load(Ordering::Relaxed),
    }
}

fn hashing_view(service: &ServiceRuntime) -> Option<HashingView> {
    let config = &service.service;
    if !config.lb_policy.is_hashing() {
        return None;
    }
    let tiers = service
        .balancer
        .hash_tables()
        .tiers()
        .map(|(priority, table)| HashTierView {
            priority,
            size: table.slots(),
            memory_bytes: table.heap_bytes(),
        })
        .collect();
    Some(HashingView {
        hash_on: config.hash_on.clone(),
        hash_balance_factor: config.hash_balance_factor,
        in_flight: config
            .hash_balance_factor
            .map(|_| service.counters.in_flight.load(Ordering::Relaxed)),
        tiers,
    })
}

/// Each target's share of its tier's table, by index into the service's targets.
fn hash_shares(service: &ServiceRuntime) -> HashMap<usize, f64> {
    let mut shares = HashMap::new();
    let tables = service.balancer.hash_tables();
    for (priority, table) in tables.tiers() {
        let Some(members) = service.balancer.tier_members(priority) else {
            continue;
        };
        let size = table.slots().max(1) as f64;
        for (slot_owner, slots) in table.slots_per_member().into_iter().enumerate() {
            if let Some(&member) = members.get(slot_owner) {
                shares.insert(member as usize, slots as f64 / size);
            }
        }
    }
    shares
}

fn sessions_view(service: &ServiceRuntime, now: u64) -> Option<SessionsView> {
    let persistence = service.service.session_persistence.as_ref()?;
    let draining = service
        .sessions
        .as_deref()
        .map(|sessions| {
            sessions
                .draining
                .iter()
                .map(|target| DrainingTargetView {
                    id: target.id,
                    address: target.authority.to_string(),
                    in_flight: target.load.in_flight(),
                    available: target.health.is_available(|| now),
                })
                .collect()
        })
        .unwrap_or_default();
    Some(SessionsView {
        cookie: persistence.cookie.clone(),
        repinned: service.counters.sessions_repinned.load(Ordering::Relaxed),
        draining,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RetryBudget;
    use serde_json::json;
    use std::time::Duration;
    use tokio::time::Instant;

    #[tokio::test(start_paused = true)]
    async fn the_retries_view_reads_the_window_and_every_reason() {
        let counters = RetryCounters::default();
        let budget = RetryBudget {
            percent: 50.0,
            min_per_second: 0,
        };
        for _ in 0..4 {
            counters.request(Instant::now());
        }
        assert!(counters.try_spend(Instant::now(), &budget));
        counters.sent(RetryReason::ConnectFailure);
        assert!(counters.try_spend(Instant::now(), &budget));
        counters.hedges.fetch_add(1, Ordering::Relaxed);
        // Half of four requests: a third is refused.
        assert!(!counters.try_spend(Instant::now(), &budget));
        counters.sent(RetryReason::GrpcStatus);
        counters.sent(RetryReason::GrpcStatus);

        let view = serde_json::to_value(retries_view(&counters, Instant::now())).unwrap();
        assert_eq!(
            view,
            json!({
                "window_requests": 4,
                "window_retries": 2,
                "sent": {
                    "connect_failure": 1, "refused": 0, "reset": 0,
                    "per_try_timeout": 0, "status": 0, "grpc_status": 2
                },
                "budget_exhausted": 1,
                "hedges": 1
            })
        );

        // The window forgets; the totals since start stay.
        tokio::time::advance(Duration::from_secs(10)).await;
        let view = retries_view(&counters, Instant::now());
        assert_eq!((view.window_requests, view.window_retries), (0, 0));
        assert_eq!(view.sent["connect_failure"], 1);
        assert_eq!(view.budget_exhausted, 1);
    }
}
