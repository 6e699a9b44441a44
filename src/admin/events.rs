//! The live view's API: `GET /api/v1/events` (Server-Sent Events: a snapshot, then every event
//! the control task records), `GET /api/v1/targets/{id}/history`, and `GET /api/v1/session`
//! (who the caller's token is, so the dashboard knows which buttons to show).
//!
//! Each client reads the broadcast through its own receiver: the control task never waits for
//! a client, and a client that falls `admin.event_client_queue` events behind is cut off (its
//! stream ends) and resumes with `Last-Event-ID`. With several instances on one PostgreSQL
//! store, each instance streams what it saw itself.

use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{broadcast, watch};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Caller, Viewer};
use super::error::{ApiError, ErrorBody};
use super::extract::IdPath;
use super::AdminState;
use crate::clock::unix_ms;
use crate::control::target_view;
use crate::events::{Event, HistoryEntry, ServiceView, SourceView, TargetView};
use crate::model::{EndpointCounts, Id, Role, SourceStatus, TargetState};

/// A comment this often keeps proxies and load balancers from closing a quiet stream.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

pub fn router() -> OpenApiRouter<AdminState> {
    OpenApiRouter::new()
        .routes(routes!(events))
        .routes(routes!(target_history))
        .routes(routes!(session))
}

/// `GET /api/v1/session`
#[derive(Debug, Serialize, ToSchema)]
pub struct Session {
    pub role: Role,
    pub name: String,
}

/// The caller's token: its name and role.
#[utoipa::path(get, path = "/session", tag = "events",
    responses((status = 200, body = Session), (status = 401, body = ErrorBody)))]
async fn session(Caller(token): Caller) -> Json<Session> {
    Json(Session {
        role: token.role,
        name: token.name,
    })
}

/// `GET /api/v1/targets/{id}/history`
#[derive(Debug, Serialize, ToSchema)]
pub struct TargetHistory {
    pub target_id: Id,
    /// Newest first, at most 50; what this instance saw since it started.
    pub items: Vec<HistoryEntry>,
}

/// The target's last transitions (state, health, ejection, configuration) with their reasons,
/// newest first. A removed target's history is still answered for a while.
#[utoipa::path(get, path = "/targets/{id}/history", tag = "events",
    responses((status = 200, body = TargetHistory), (status = 404, body = ErrorBody)))]
async fn target_history(
    _: Viewer,
    State(state): State<AdminState>,
    IdPath(id): IdPath,
) -> Result<Json<TargetHistory>, ApiError> {
    let items = match state.control.events().history(id) {
        Some(items) => items,
        None => {
            // Known but quiet since this instance started: an empty history, not a 404.
            state.store.get_target(id).await?;
            Vec::new()
        }
    };
    Ok(Json(TargetHistory {
        target_id: id,
        items,
    }))
}

/// The first event of a stream: everything a client draws, as of event `last_id`.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventSnapshot {
    pub last_id: u64,
    pub at: DateTime<Utc>,
    pub services: Vec<ServiceView>,
    pub targets: Vec<TargetView>,
    pub sources: Vec<SourceView>,
}

/// Server-Sent Events: `snapshot` first (unless `Last-Event-ID` resumes from the ring), then
/// `target`, `source` and `config` events with increasing ids, and a `: keep-alive` comment
/// every 15 s. `?service_id=` keeps one service's events. A client that falls too far behind
/// is cut off and should reconnect with `Last-Event-ID`.
#[utoipa::path(get, path = "/events", tag = "events",
    params(("service_id" = Option<Id>, Query, description = "only this service's events"),
        ("Last-Event-ID" = Option<u64>, Header, description = "resume after this event")),
    responses((status = 200, content_type = "text/event-stream", description = "the event stream"),
        (status = 401, body = ErrorBody), (status = 404, body = ErrorBody), (status = 422, body = ErrorBody)))]
async fn events(
    _: Viewer,
    State(state): State<AdminState>,
    headers: HeaderMap,
    uri: Uri,
) -> Result<Response, ApiError> {
    let filter = service_filter(&uri)?;
    if let Some(service_id) = filter {
        state.store.get_service(service_id).await?;
    }
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok());
    let log = state.control.events().clone();
    let subscription = log.subscribe(last_event_id);
    let first: VecDeque<Bytes> = match subscription.backlog {
        Some(backlog) => backlog
            .iter()
            .filter(|event| wanted(event, filter))
            .map(|event| event.frame.clone())
            .collect(),
        None => VecDeque::from([snapshot_frame(&state, filter, subscription.last_id).await?]),
    };
    let stream = EventStream {
        pending: first,
        receiver: subscription.receiver,
        filter,
        closed: log.closed(),
        keep_alive: KEEP_ALIVE,
    };
    let body = Body::from_stream(stream.into_stream());
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    // Tells a buffering reverse proxy (NGINX) in front of the admin API to pass events at once.
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

fn service_filter(uri: &Uri) -> Result<Option<Id>, ApiError> {
    let Some(query) = uri.query() else {
        return Ok(None);
    };
    for pair in query.split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == "service_id" {
            return match value.parse::<Id>() {
                Ok(id) if id > 0 => Ok(Some(id)),
                _ => Err(ApiError::validation(
                    "service_id",
                    "service_id must be a service's id",
                )),
            };
        }
    }
    Ok(None)
}

fn wanted(event: &Event, filter: Option<Id>) -> bool {
    filter.is_none() || event.service_id == filter
}

/// One client's stream: what it must be sent first, then the broadcast.
struct EventStream {
    pending: VecDeque<Bytes>,
    receiver: broadcast::Receiver<Arc<Event>>,
    filter: Option<Id>,
    closed: watch::Receiver<bool>,
    keep_alive: Duration,
}

enum Next {
    Send(Bytes),
    End,
}

impl EventStream {
    fn into_stream(self) -> impl futures_util::Stream<Item = Result<Bytes, Infallible>> {
        let keep_alive = tokio::time::interval_at(
            tokio::time::Instant::now() + self.keep_alive,
            self.keep_alive,
        );
        futures_util::stream::unfold(
            (self, keep_alive),
            |(mut stream, mut keep_alive)| async move {
                match stream.next(&mut keep_alive).await {
                    Next::Send(bytes) => Some((Ok(bytes), (stream, keep_alive))),
                    Next::End => None,
                }
            },
        )
    }

    async fn next(&mut self, keep_alive: &mut tokio::time::Interval) -> Next {
        if let Some(frame) = self.pending.pop_front() {
            return Next::Send(frame);
        }
        loop {
            if *self.closed.borrow() {
                return Next::End;
            }
            tokio::select! {
                received = self.receiver.recv() => match received {
                    Ok(event) if wanted(&event, self.filter) => {
                        keep_alive.reset();
                        return Next::Send(event.frame.clone());
                    }
                    Ok(_) => continue,
                    // Its queue filled: cut it off rather than hold events for it.
                    Err(broadcast::error::RecvError::Lagged(_)) => return Next::End,
                    Err(broadcast::error::RecvError::Closed) => return Next::End,
                },
                _ = keep_alive.tick() => return Next::Send(Bytes::from_static(b": keep-alive\n\n")),
                changed = self.closed.changed() => {
                    if changed.is_err() {
                        return Next::End;
                    }
                }
            }
        }
    }
}

/// The `snapshot` event: services, their targets with live state, and their sources' status.
async fn snapshot_frame(
    state: &AdminState,
    filter: Option<Id>,
    last_id: u64,
) -> Result<Bytes, ApiError> {
    let config = state.store.load_routing_config().await?;
    let live = state.control.snapshot();
    let now_ms = unix_ms();
    let keep = |service_id: Id| filter.is_none_or(|wanted| wanted == service_id);
    let services = config
        .services
        .iter()
        .filter(|service| keep(service.id))
        .map(|service| ServiceView {
            service: service.clone(),
            panic_picks: live
                .service(service.id)
                .map(|runtime| runtime.counters.panic_picks.load(Ordering::Relaxed))
                .unwrap_or(0),
        })
        .collect();
    let runtimes: HashMap<Id, _> = live
        .services()
        .flat_map(|service| service.targets.iter())
        .map(|runtime| (runtime.id, runtime))
        .collect();
    let targets: Vec<TargetView> = config
        .targets
        .iter()
        .filter(|target| keep(target.service_id))
        .map(|target| target_view(target, runtimes.get(&target.id).copied(), now_ms))
        .collect();
    let mut counts: HashMap<Id, EndpointCounts> = HashMap::new();
    for view in &targets {
        let Some(source_id) = view.target.source_id else {
            continue;
        };
        let count = counts.entry(source_id).or_default();
        match view.target.state {
            TargetState::Active => count.active += 1,
            TargetState::Draining => count.draining += 1,
            TargetState::Stale => count.stale += 1,
        }
    }
    let mut holders = state.store.source_lease_holders().await?;
    let mut sources = Vec::new();
    for (source, progress) in state.store.all_sources().await? {
        if !keep(source.service_id) {
            continue;
        }
        let status = SourceStatus {
            source_id: source.id,
            progress,
            endpoints: counts.get(&source.id).copied().unwrap_or_default(),
            refreshed_by: holders.remove(&source.id),
        };
        sources.push(SourceView::new(&source, Some(status)));
    }
    let snapshot = EventSnapshot {
        last_id,
        at: crate::clock::now(),
        services,
        targets,
        sources,
    };
    let json = serde_json::to_string(&snapshot).map_err(|error| ApiError::Unavailable {
        message: format!("snapshot not serialised: {error}"),
    })?;
    Ok(Bytes::from(format!(
        "id: {last_id}\nevent: snapshot\ndata: {json}\n\n"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::{EventBody, EventLog, EventSettings, TargetChangeKind, TargetEvent};
    use futures_util::StreamExt;

    fn record(log: &EventLog, service_id: Id) {
        log.record(
            Some(service_id),
            EventBody::Target(TargetEvent {
                target_id: 1,
                source_id: None,
                address: "127.0.0.1:1".into(),
                change: TargetChangeKind::Updated,
                from: None,
                to: None,
                reason: "test".into(),
                target: None,
            }),
        );
    }

    fn stream_of(log: &EventLog, filter: Option<Id>) -> EventStream {
        let subscription = log.subscribe(Some(log.last_id()));
        EventStream {
            pending: VecDeque::new(),
            receiver: subscription.receiver,
            filter,
            closed: log.closed(),
            keep_alive: KEEP_ALIVE,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_stream_sends_a_comment_every_15_seconds() {
        let log = EventLog::new(EventSettings::default());
        let mut stream = Box::pin(stream_of(&log, None).into_stream());
        let started = tokio::time::Instant::now();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(&first[..], b": keep-alive\n\n");
        assert_eq!(started.elapsed(), KEEP_ALIVE);
        stream.next().await.unwrap().unwrap();
        assert_eq!(started.elapsed(), KEEP_ALIVE * 2);
    }

    #[tokio::test(start_paused = true)]
    async fn the_filter_passes_one_service_and_closing_ends_the_stream() {
        let log = EventLog::new(EventSettings::default());
        let mut stream = Box::pin(stream_of(&log, Some(2)).into_stream());
        let base = log.last_id();
        record(&log, 1);
        record(&log, 2);
        let frame = stream.next().await.unwrap().unwrap();
        let second = format!("id: {}\n", base + 2);
        assert!(frame.starts_with(second.as_bytes()), "{frame:?}");
        log.close();
        assert!(stream.next().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_falls_behind_is_cut_off() {
        let log = EventLog::new(EventSettings {
            ring: 100,
            client_queue: 4,
        });
        let mut stream = Box::pin(stream_of(&log, None).into_stream());
        for _ in 0..10 {
            record(&log, 1);
        }
        assert!(stream.next().await.is_none());
    }
}
