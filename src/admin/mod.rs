//! The admin REST API (axum): services, targets, routes and tokens under `/api/v1`, plus
//! `/healthz` and `/readyz`. The OpenAPI document is generated from the handlers.

pub mod auth;
mod canary;
mod certificates;
mod error;
mod event_budget;
mod event_snapshot;
mod events;
mod extract;
mod metrics;
mod rate_limits;
pub mod readiness;
mod routes;
mod serve;
mod services;
mod sources;
mod stall;
mod stream_routes;
mod targets;
mod tokens;
mod ui;

use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;

pub use error::{ApiError, ErrorBody};
pub use events::EventStreams;
pub use serve::{ConnectionCounters, ListenerSettings};
pub use stall::WRITE_STALL_LIMIT;

use crate::control::ControlHandle;
use crate::model::Id;
use crate::store::{Page, Store};

#[derive(Clone)]
pub struct AdminState {
    pub store: Store,
    pub control: ControlHandle,
    /// When this process started serving: a source still pending from before a restart gets a
    /// first refresh's time from here.
    pub started_at: chrono::DateTime<chrono::Utc>,
    /// Data-path counters that belong to no route or service (for `/metrics`).
    pub gateway_counters: std::sync::Arc<crate::snapshot::GatewayCounters>,
    /// Set when the shutdown sequence starts.
    pub draining: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// This process's registration, when one is configured.
    pub registration: Option<tokio::sync::watch::Receiver<crate::registration::RegistrationStatus>>,
    /// The admin listener's connections.
    pub connections: std::sync::Arc<ConnectionCounters>,
    /// What the event streams share: snapshot frames, their memory budget, counters.
    pub event_streams: std::sync::Arc<EventStreams>,
    /// The span exporter's counts, when tracing is on.
    pub trace_counters: Option<std::sync::Arc<crate::telemetry::trace::TraceCounters>>,
}

impl AdminState {
    /// Makes a stored change live; returns when the new snapshot is published.
    async fn apply(&self) -> Result<(), ApiError> {
        self.control.apply().await?;
        Ok(())
    }
}

/// One page of a list; `next` is the cursor for `?after=`, null on the last page.
#[derive(Serialize, ToSchema)]
pub struct List<T> {
    pub items: Vec<T>,
    pub next: Option<Id>,
}

impl<T> List<T> {
    fn new(items: Vec<T>, page: Page, id_of: impl Fn(&T) -> Id) -> List<T> {
        let next = (items.len() == page.limit as usize)
            .then(|| items.last().map(&id_of))
            .flatten();
        List { items, next }
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "Raahi admin API", description = "Services, targets, routes, discovery sources and tokens of a Raahi gateway."),
    servers((url = "/api/v1")),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    components(schemas(ErrorBody))
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Serves the admin application on `listener` until `shutdown` turns true (see `serve`).
pub fn serve(
    listener: tokio::net::TcpListener,
    state: AdminState,
    settings: ListenerSettings,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    let connections = state.connections.clone();
    serve::serve(listener, router(state), settings, connections, shutdown)
}

/// The whole admin application.
pub fn router(state: AdminState) -> Router {
    let (api, openapi) = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .merge(services::router())
        .merge(targets::router())
        .merge(routes::router())
        .merge(rate_limits::router())
        .merge(canary::router())
        .merge(tokens::router())
        .merge(sources::router())
        .merge(stream_routes::router())
        .merge(certificates::router())
        .merge(events::router())
        .split_for_parts();
    let openapi = std::sync::Arc::new(openapi);
    let api = api
        .route(
            "/openapi.json",
            get(move || {
                let openapi = openapi.clone();
                async move { Json(openapi.as_ref().clone()) }
            }),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed);
    Router::new()
        .nest("/api/v1", api)
        .route("/healthz", get(healthz))
        .route("/readyz", get(readiness::readyz))
        .route("/metrics", get(metrics::metrics))
        .merge(ui::router())
        .fallback(not_found)
        .with_state(state)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NotFound {
        message: format!("no such admin resource: {}", uri.path()),
    }
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::MethodNotAllowed {
        message: format!("{method} is not allowed on {}", uri.path()),
    }
}

async fn healthz() -> impl IntoResponse {
    Json(serde_json::json!({ "status": "ok" }))
}
