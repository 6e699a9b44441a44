//! The event log: every change the control task makes or sees (a target's state, health or
//! ejection; a source's lifecycle or guard; a configuration write; a route's limit tripping or
//! clearing), numbered in order, kept in a
//! bounded ring and broadcast to the event stream's clients, plus each target's recent
//! transitions for `/targets/{id}/history`.
//!
//! The control task is the only writer. Each event is serialised once, as the Server-Sent Events
//! frame every client sends, so a hundred clients cost a hundred `Bytes` clones, not a hundred
//! serialisations; the frame is all the ring keeps of it. Readers subscribe and read the ring under the same lock the writer takes, so
//! a client resumes with neither a gap nor a duplicate. The request path never comes here.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::sync::{broadcast, watch};
use utoipa::ToSchema;

use crate::model::{DiscoverySource, Id, RemovalGuard, Service, SourceStatus, Target};

/// Transitions kept per target for `/targets/{id}/history`.
pub const HISTORY_PER_TARGET: usize = 50;
/// Deleted targets whose history is still answered (the oldest is forgotten first).
const RETIRED_HISTORIES: usize = 10_000;

/// How much the log keeps, and how far a client may fall behind before it is cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSettings {
    /// Events kept for clients that resume with `Last-Event-ID`.
    pub ring: usize,
    /// Events a client may have queued (not yet written to its socket) before it is cut off.
    pub client_queue: usize,
}

impl Default for EventSettings {
    fn default() -> Self {
        EventSettings {
            ring: 10_000,
            client_queue: 4_096,
        }
    }
}

/// One recorded change, as the ring keeps it: the frame and what a client filters on. The
/// body is not kept beside its frame: the largest body (a configuration event with its service)
/// sized every event at 640 bytes, ten times what is left.
#[derive(Debug)]
pub struct Event {
    pub id: u64,
    /// The service it concerns (None: a route, stream route or certificate, which belong to none).
    pub service_id: Option<Id>,
    /// The whole SSE frame (`id:`, `event:`, `data:`), built once.
    pub frame: Bytes,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EventBody {
    Target(TargetEvent),
    Source(SourceEvent),
    Config(ConfigEvent),
    Route(RouteEvent),
    Canary(CanaryEvent),
    Locality(LocalityEvent),
}

impl EventBody {
    /// The SSE event name.
    pub fn kind(&self) -> &'static str {
        match self {
            EventBody::Target(_) => "target",
            EventBody::Source(_) => "source",
            EventBody::Config(_) => "config",
            EventBody::Route(_) => "route",
            EventBody::Canary(_) => "canary",
            EventBody::Locality(_) => "locality",
        }
    }
}

/// What happened to a target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TargetChangeKind {
    Added,
    Removed,
    Updated,
    State,
    Health,
    Ejected,
    HalfOpen,
    Restored,
    Enabled,
    Disabled,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TargetEvent {
    pub target_id: Id,
    pub source_id: Option<Id>,
    /// `host:port`
    pub address: String,
    pub change: TargetChangeKind,
    pub from: Option<String>,
    pub to: Option<String>,
    /// Why, in a sentence ("3 failed checks: HTTP 500").
    pub reason: String,
    /// The target after the change; null once removed.
    pub target: Option<TargetView>,
}

/// A target with its live runtime state, as the event stream shows it.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct TargetView {
    #[serde(flatten)]
    pub target: Target,
    pub half_open: bool,
    pub ejections: u32,
    pub in_flight: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SourceChangeKind {
    /// Its lifecycle state changed (`from` → `to`).
    State,
    /// Its removal guard started or stopped holding, or holds a different set.
    Guard,
    /// Its watch connected or lost its connection.
    Watch,
    /// It failed again with a different error.
    Error,
    /// It answered a changed set (`to`: the new revision) without changing state.
    Revision,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct SourceEvent {
    pub source_id: Id,
    pub name: String,
    pub change: SourceChangeKind,
    pub from: Option<String>,
    pub to: Option<String>,
    pub reason: String,
    pub status: SourceStatus,
}

/// What happened on a route's request path, as the control task saw it in its counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RouteChangeKind {
    /// One of its limits started refusing requests.
    Tripped,
    /// That limit has refused none for 10 s, or is gone (with its route).
    Cleared,
}

/// A route's limit that refuses requests on this gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RouteLimit {
    /// `rate_limit`: 429 `rate_limited`.
    RateLimit,
    /// `max_in_flight`: 503 `too_many_requests`.
    MaxInFlight,
}

impl RouteLimit {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteLimit::RateLimit => "rate_limit",
            RouteLimit::MaxInFlight => "max_in_flight",
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct RouteEvent {
    pub route_id: Id,
    pub name: String,
    pub change: RouteChangeKind,
    pub limit: RouteLimit,
    /// Requests the limit refused since the control task's previous look (about 250 ms).
    pub refused: u64,
    /// Requests the limit refused on this gateway since it started.
    pub refused_total: u64,
    /// Why, in a sentence ("12 requests refused in 250 ms: over 5 requests per second per
    /// client IP, burst 5").
    pub reason: String,
}

/// A route's canary moved (TRAFFIC.md §4), as this gateway applied it: a step, a hold, a
/// rollback, a promotion, an operator's action, or a new canary.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CanaryEvent {
    pub route_id: Id,
    /// The route's name.
    pub name: String,
    pub state: crate::model::CanaryState,
    /// The step in force (0-based).
    pub step: u32,
    /// The canary backend's percent now, and before (null for a new canary).
    pub weight: u8,
    pub previous_weight: Option<u8>,
    pub round: i64,
    pub reason: String,
}

/// Where a service with `locality` sends its requests (TRAFFIC.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ZoneSplitKind {
    /// Only to the targets in the gateway's zone.
    ZoneOnly,
    /// To every target of every zone, as without locality.
    AllZones,
}

/// A service's zone split changed on this gateway (or was first decided, `from` null).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct LocalityEvent {
    /// The service's name (its id is the event's `service_id`).
    pub name: String,
    /// The gateway's zone (`cluster.zone`).
    pub zone: String,
    pub from: Option<ZoneSplitKind>,
    pub to: ZoneSplitKind,
    /// How the zone's targets were chosen: `hints` (Kubernetes EndpointSlice `hints.forZones`)
    /// or `labels` (the targets' `zone` label).
    pub basis: &'static str,
    /// The zone's targets counted (in the priority tier the service picks from) and how many
    /// were available.
    pub available: u32,
    pub total: u32,
    pub min_available_percent: u32,
    /// Why, in a sentence ("1 of 3 targets in zone a available (33 % < 70 %)").
    pub reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConfigKind {
    Service,
    Route,
    StreamRoute,
    DiscoverySource,
    Certificate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ConfigChangeKind {
    Created,
    Changed,
    Deleted,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ConfigEvent {
    pub kind: ConfigKind,
    pub object_id: Id,
    pub name: Option<String>,
    pub change: ConfigChangeKind,
    /// The service or discovery source after the change (never a source's `config`, which may
    /// hold secrets); null for other kinds and once deleted.
    pub object: Option<ConfigObject>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ConfigObject {
    Service(ServiceView),
    Source(SourceView),
}

/// A service with its panic-pick counter.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ServiceView {
    #[serde(flatten)]
    pub service: Service,
    pub panic_picks: u64,
}

/// A discovery source without its `config` (secrets stay out of events), with its status when
/// known.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct SourceView {
    pub id: Id,
    pub service_id: Id,
    pub name: String,
    pub provider: crate::model::ProviderKind,
    pub enabled: bool,
    pub stale_after_ms: u64,
    pub removal_grace_ms: u64,
    pub removal_guard: Option<RemovalGuard>,
    pub managed_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub status: Option<SourceStatus>,
}

impl SourceView {
    pub fn new(source: &DiscoverySource, status: Option<SourceStatus>) -> SourceView {
        SourceView {
            id: source.id,
            service_id: source.service_id,
            name: source.name.clone(),
            provider: source.provider,
            enabled: source.enabled,
            stale_after_ms: source.stale_after_ms,
            removal_grace_ms: source.removal_grace_ms,
            removal_guard: source.removal_guard,
            managed_by: source.managed_by.clone(),
            created_at: source.created_at,
            updated_at: source.updated_at,
            status,
        }
    }
}

/// The `data` of an event: its id and time beside the body's fields.
#[derive(Serialize)]
struct EventData<'a> {
    id: u64,
    at: DateTime<Utc>,
    service_id: Option<Id>,
    #[serde(flatten)]
    body: &'a EventBody,
}

/// One line of a target's history.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct HistoryEntry {
    /// The id of the `target` event that recorded it.
    pub id: u64,
    pub at: DateTime<Utc>,
    pub change: TargetChangeKind,
    pub from: Option<String>,
    pub to: Option<String>,
    pub reason: String,
}

/// Where a new client starts.
pub struct Subscription {
    /// The events after the client's `Last-Event-ID`; None when it must start from a snapshot
    /// (no id, or one the ring no longer holds).
    pub backlog: Option<Vec<Arc<Event>>>,
    /// The newest event recorded when the client subscribed.
    pub last_id: u64,
    /// Every event after `last_id`.
    pub receiver: broadcast::Receiver<Arc<Event>>,
}

pub struct EventLog {
    inner: Mutex<Inner>,
    sender: broadcast::Sender<Arc<Event>>,
    /// Set when the gateway stops: open streams end so the admin listener can close.
    closed: watch::Sender<bool>,
    settings: EventSettings,
}

struct Inner {
    last_id: u64,
    ring: VecDeque<Arc<Event>>,
    history: HashMap<Id, VecDeque<HistoryEntry>>,
    /// Removed targets whose history is kept, oldest first.
    retired: VecDeque<Id>,
}

impl EventLog {
    pub fn new(settings: EventSettings) -> EventLog {
        let settings = EventSettings {
            ring: settings.ring.max(1),
            client_queue: settings.client_queue.max(1),
        };
        let (sender, _) = broadcast::channel(settings.client_queue);
        EventLog {
            inner: Mutex::new(Inner {
                last_id: first_id_base(),
                ring: VecDeque::with_capacity(settings.ring.min(1_024)),
                history: HashMap::new(),
                retired: VecDeque::new(),
            }),
            sender,
            closed: watch::Sender::new(false),
            settings,
        }
    }

    pub fn settings(&self) -> EventSettings {
        self.settings
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records a change; returns its id.
    pub fn record(&self, service_id: Option<Id>, body: EventBody) -> u64 {
        let at = crate::clock::now();
        let mut inner = self.lock();
        let id = inner.last_id + 1;
        inner.last_id = id;
        let frame = frame(id, at, service_id, &body);
        if let EventBody::Target(target) = body {
            inner.remember(id, at, target);
        }
        let event = Arc::new(Event {
            id,
            service_id,
            frame,
        });
        if inner.ring.len() == self.settings.ring {
            inner.ring.pop_front();
        }
        inner.ring.push_back(event.clone());
        // No client listening is not an error.
        let _ = self.sender.send(event);
        id
    }

    /// Starts a client after `last_event_id` (its `Last-Event-ID`): the events the ring still
    /// holds after it, or none and a snapshot when it holds them no longer.
    pub fn subscribe(&self, last_event_id: Option<u64>) -> Subscription {
        let inner = self.lock();
        let receiver = self.sender.subscribe();
        let backlog = last_event_id.and_then(|after| inner.events_after(after));
        Subscription {
            backlog,
            last_id: inner.last_id,
            receiver,
        }
    }

    /// The id of the newest event.
    pub fn last_id(&self) -> u64 {
        self.lock().last_id
    }

    /// The target's transitions, newest first; None when it has none.
    pub fn history(&self, target_id: Id) -> Option<Vec<HistoryEntry>> {
        let inner = self.lock();
        let entries = inner.history.get(&target_id)?;
        Some(entries.iter().rev().cloned().collect())
    }

    /// A receiver that turns true when the gateway stops.
    pub fn closed(&self) -> watch::Receiver<bool> {
        self.closed.subscribe()
    }

    /// Ends every open stream (the gateway is stopping).
    pub fn close(&self) {
        self.closed.send_replace(true);
    }
}

impl Inner {
    fn events_after(&self, after: u64) -> Option<Vec<Arc<Event>>> {
        if after > self.last_id {
            // From before a restart (ids start again): the client's picture is not ours.
            return None;
        }
        if after == self.last_id {
            return Some(Vec::new());
        }
        let oldest = self.ring.front()?.id;
        if after + 1 < oldest {
            return None;
        }
        let skip = (after + 1 - oldest) as usize;
        Some(self.ring.iter().skip(skip).cloned().collect())
    }

    fn remember(&mut self, id: u64, at: DateTime<Utc>, event: TargetEvent) {
        // Most targets only ever get one or two entries (added, a first health verdict), so a
        // history starts with room for one instead of a `VecDeque`'s first four.
        let entries = self
            .history
            .entry(event.target_id)
            .or_insert_with(|| VecDeque::with_capacity(1));
        if entries.len() == HISTORY_PER_TARGET {
            entries.pop_front();
        }
        entries.push_back(HistoryEntry {
            id,
            at,
            change: event.change,
            from: event.from,
            to: event.to,
            reason: event.reason,
        });
        // Target ids are never reused, so a removed target's history only ages out.
        if event.change == TargetChangeKind::Removed {
            self.retired.push_back(event.target_id);
            if self.retired.len() > RETIRED_HISTORIES {
                if let Some(forgotten) = self.retired.pop_front() {
                    self.history.remove(&forgotten);
                }
            }
        }
    }
}

#[cfg(test)]
impl Event {
    /// The frame's `event` name and `data`, as a client parses them.
    pub fn parsed(&self) -> (String, serde_json::Value) {
        let text = std::str::from_utf8(&self.frame).expect("frames are UTF-8");
        let line = |field: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(field))
                .unwrap_or_else(|| panic!("no {field} line in {text}"))
                .to_owned()
        };
        let data = serde_json::from_str(&line("data: ")).expect("the data is JSON");
        (line("event: "), data)
    }
}

/// Which of `choices` serialises as `value` (tests read events back from their frames).
#[cfg(test)]
pub fn variant_of<T: Serialize + Copy + std::fmt::Debug>(
    value: &serde_json::Value,
    choices: &[T],
) -> T {
    *choices
        .iter()
        .find(|choice| serde_json::to_value(choice).ok().as_ref() == Some(value))
        .unwrap_or_else(|| panic!("{value} is none of {choices:?}"))
}

/// Where this process's ids start: a random point in [2^52, 2^53 − 2^42), so each process has
/// its own stretch of 2^42 ids (14 years at 10,000 events a second) and every id stays exact as
/// a JavaScript number. A `Last-Event-ID` from before a restart or from another instance on the
/// same store is then outside this ring (two stretches meet with a chance of about n / 2^51 for
/// n events), and its client gets a fresh snapshot instead of events applied to a picture they
/// do not belong to. A start time would not do: ids advance by one per event, not per µs, so
/// two gateways started a second apart overlap after a million events.
fn first_id_base() -> u64 {
    const LOWEST: u64 = 1 << 52;
    const STRETCH: u64 = 1 << 42;
    fastrand::u64(LOWEST..(1 << 53) - STRETCH)
}

/// `id: …\nevent: …\ndata: …\n\n`. JSON has no raw newlines, so the data is one line.
fn frame(id: u64, at: DateTime<Utc>, service_id: Option<Id>, body: &EventBody) -> Bytes {
    let data = EventData {
        id,
        at,
        service_id,
        body,
    };
    let json = serde_json::to_string(&data).unwrap_or_else(|error| {
        format!(r#"{{"id":{id},"error":"event not serialised: {error}"}}"#)
    });
    let text = format!("id: {id}\nevent: {}\ndata: {json}\n\n", body.kind());
    // The ring keeps every frame: `format!` leaves up to twice the length allocated, which a
    // `Bytes` made from the `String` would hold for as long as the event is kept.
    Bytes::from(text.into_bytes().into_boxed_slice())
}

#[cfg(test)]
mod tests;
