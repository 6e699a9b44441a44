//! The live view's API: `GET /api/v1/events` (Server-Sent Events: a snapshot, then every event
//! the control task records), `GET /api/v1/targets/{id}/history`, and `GET /api/v1/session`
//! (who the caller's token is, so the dashboard knows which buttons to show).
//!
//! Each client reads the broadcast through its own receiver: the control task never waits for
//! a client, and a client that falls `admin.event_client_queue` events behind is cut off (its
//! stream ends) and resumes with `Last-Event-ID`. With several instances on one PostgreSQL
//! store, each instance streams what it saw itself.
//!
//! Frames are shared, never copied per client: each event's is built once by the event log, and
//! the `snapshot` a stream starts with once for all the clients that connect meanwhile
//! (`event_snapshot`). What clients were handed and have not read yet is bounded for all of
//! them together (`event_budget`): a client past it is cut off as one too far behind is.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::{broadcast, watch};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Caller, Viewer};
use super::error::{ApiError, ErrorBody};
use super::event_budget::EventBudget;
use super::event_snapshot::SnapshotCache;
use super::extract::IdPath;
use super::AdminState;
use crate::events::{Event, HistoryEntry};
use crate::model::{Id, Role};

/// A comment this often keeps proxies and load balancers from closing a quiet stream.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// What every event-stream client shares: the snapshot frames, the memory budget, counters.
pub struct EventStreams {
    snapshots: SnapshotCache,
    budget: Arc<EventBudget>,
    open: AtomicU64,
    cut_behind: AtomicU64,
    cut_budget: AtomicU64,
}

impl EventStreams {
    /// `budget_bytes`: `admin.event_stream_budget_bytes`.
    pub fn new(budget_bytes: u64) -> Arc<EventStreams> {
        Arc::new(EventStreams {
            snapshots: SnapshotCache::default(),
            budget: EventBudget::new(budget_bytes),
            open: AtomicU64::new(0),
            cut_behind: AtomicU64::new(0),
            cut_budget: AtomicU64::new(0),
        })
    }

    /// Streams open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Bytes handed to clients and not yet written to their sockets.
    pub fn held_bytes(&self) -> u64 {
        self.budget.held()
    }

    /// Streams ended for falling `admin.event_client_queue` events behind, and for passing
    /// the budget.
    pub fn cut_off(&self) -> (u64, u64) {
        (
            self.cut_behind.load(Ordering::Relaxed),
            self.cut_budget.load(Ordering::Relaxed),
        )
    }

    /// `snapshot` frames built, and clients started with one built for another.
    pub fn snapshots(&self) -> (u64, u64) {
        (self.snapshots.built(), self.snapshots.shared())
    }
}

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

/// Server-Sent Events: `snapshot` first (unless `Last-Event-ID` resumes from the ring), then
/// `target`, `source`, `config`, `route`, `canary` and `locality` events with increasing ids,
/// and a `: keep-alive` comment every 15 s. `?service_id=` keeps one service's events. A client
/// that falls too far behind is cut off and should reconnect with `Last-Event-ID`.
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
    let (first, skip_through): (VecDeque<Bytes>, u64) = match subscription.backlog {
        Some(backlog) => (
            backlog
                .iter()
                .filter(|event| wanted(event, filter))
                .map(|event| event.frame.clone())
                .collect(),
            subscription.last_id,
        ),
        None => {
            let snapshot = state
                .event_streams
                .snapshots
                .frame(&state, filter, subscription.last_id)
                .await?;
            (VecDeque::from([snapshot.frame]), snapshot.last_id)
        }
    };
    let stream = EventStream {
        pending: first,
        receiver: subscription.receiver,
        filter,
        skip_through,
        closed: log.closed(),
        keep_alive: KEEP_ALIVE,
        shared: OpenEventStream::new(&state.event_streams),
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
    /// Events up to this id are already in what `pending` started with (a snapshot built after
    /// the client subscribed).
    skip_through: u64,
    closed: watch::Receiver<bool>,
    keep_alive: Duration,
    shared: OpenEventStream,
}

/// A stream counted as open in [`EventStreams`] for as long as it lives.
struct OpenEventStream(Arc<EventStreams>);

impl OpenEventStream {
    fn new(streams: &Arc<EventStreams>) -> OpenEventStream {
        streams.open.fetch_add(1, Ordering::Relaxed);
        OpenEventStream(streams.clone())
    }
}

impl Drop for OpenEventStream {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
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
            return self.hand(frame);
        }
        loop {
            if *self.closed.borrow() {
                return Next::End;
            }
            tokio::select! {
                received = self.receiver.recv() => match received {
                    Ok(event) if event.id > self.skip_through && wanted(&event, self.filter) => {
                        keep_alive.reset();
                        return self.hand(event.frame.clone());
                    }
                    Ok(_) => continue,
                    // Its queue filled: cut it off rather than hold events for it.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        self.shared.0.cut_behind.fetch_add(1, Ordering::Relaxed);
                        return Next::End;
                    }
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

    /// `frame` handed to the connection, counted against the budget until written; the end of
    /// the stream when the budget has no room for it.
    fn hand(&self, frame: Bytes) -> Next {
        let streams = &self.shared.0;
        match streams.budget.charge(frame) {
            Some(charged) => Next::Send(charged),
            None => {
                streams.cut_budget.fetch_add(1, Ordering::Relaxed);
                Next::End
            }
        }
    }
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
        stream_with(log, filter, &EventStreams::new(64 << 20))
    }

    fn stream_with(log: &EventLog, filter: Option<Id>, streams: &Arc<EventStreams>) -> EventStream {
        let subscription = log.subscribe(Some(log.last_id()));
        EventStream {
            pending: VecDeque::new(),
            receiver: subscription.receiver,
            filter,
            skip_through: subscription.last_id,
            closed: log.closed(),
            keep_alive: KEEP_ALIVE,
            shared: OpenEventStream::new(streams),
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

    #[tokio::test(start_paused = true)]
    async fn events_already_in_the_snapshot_are_skipped() {
        let log = EventLog::new(EventSettings::default());
        let mut stream = stream_of(&log, None);
        let base = log.last_id();
        // The snapshot this client starts with was built two events later than it subscribed.
        stream.skip_through = base + 2;
        let mut stream = Box::pin(stream.into_stream());
        for _ in 0..3 {
            record(&log, 1);
        }
        let frame = stream.next().await.unwrap().unwrap();
        let third = format!("id: {}\n", base + 3);
        assert!(frame.starts_with(third.as_bytes()), "{frame:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_past_the_budget_is_cut_off_and_counted() {
        let log = EventLog::new(EventSettings::default());
        let streams = EventStreams::new(1);
        let mut reading = Box::pin(stream_with(&log, None, &streams).into_stream());
        let mut stuck = Box::pin(stream_with(&log, None, &streams).into_stream());
        assert_eq!(streams.open(), 2);
        record(&log, 1);
        record(&log, 1);
        // The stuck client keeps what it was handed (its socket is full)...
        let held = stuck.next().await.unwrap().unwrap();
        assert_eq!(streams.held_bytes(), held.len() as u64);
        // ...so the next frame has no room, for whoever asks.
        assert!(reading.next().await.is_none());
        assert_eq!(streams.cut_off(), (0, 1));
        drop(held);
        assert_eq!(streams.held_bytes(), 0);
        let next = stuck.next().await.unwrap().unwrap();
        assert!(!next.is_empty());
        drop((next, reading));
        assert_eq!(streams.open(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_falls_behind_is_counted() {
        let log = EventLog::new(EventSettings {
            ring: 100,
            client_queue: 4,
        });
        let streams = EventStreams::new(64 << 20);
        let mut stream = Box::pin(stream_with(&log, None, &streams).into_stream());
        for _ in 0..10 {
            record(&log, 1);
        }
        assert!(stream.next().await.is_none());
        assert_eq!(streams.cut_off(), (1, 0));
    }
}
