//! The event stream's first frame, `snapshot`: every service, target and source as of an event
//! id, built once and shared by the clients that connect meanwhile.
//!
//! What it shows changes in two ways. Every change the control task makes or sees is an event
//! (and a rebuild publishes a new snapshot generation): a frame built at event `n` serves any
//! client that subscribed at `n` or before, which then skips the events up to `n` (already in
//! the frame). Counters and times that change without an event (in-flight requests, panic
//! picks, a source's last refresh) are kept fresh by a maximum age. So a thousand clients
//! connecting at once cost one store read and one serialisation, not a thousand, and hold one
//! copy of the bytes. Builds of one filter never overlap: a client arriving during a build
//! waits for it and shares its frame. The serialisation runs on the blocking pool, so a large
//! snapshot does not hold up other admin calls on the runtime's workers.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio::time::Instant;
use utoipa::ToSchema;

use super::error::ApiError;
use super::AdminState;
use crate::clock::unix_ms;
use crate::control::target_view;
use crate::events::{ServiceView, SourceView, TargetView};
use crate::model::{
    DiscoverySource, EndpointCounts, Id, SourceProgress, SourceStatus, TargetState,
};

/// How long a built frame may serve new clients while no event happened: counters and times
/// it shows without events behind them are never older than this.
pub const SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(1);

/// Filters (`?service_id=`) whose last frame is kept while no client uses them; past it the
/// unused ones are forgotten.
const KEPT_FILTERS: usize = 64;

/// The first event of a stream: everything a client draws, as of event `last_id`.
#[derive(Debug, Serialize, ToSchema)]
pub struct EventSnapshot {
    pub last_id: u64,
    pub at: DateTime<Utc>,
    pub services: Vec<ServiceView>,
    pub targets: Vec<TargetView>,
    pub sources: Vec<SourceView>,
}

/// A `snapshot` frame and the event it is as of.
#[derive(Debug, Clone)]
pub struct SnapshotFrame {
    pub last_id: u64,
    pub frame: Bytes,
}

/// The newest frame per filter.
#[derive(Default)]
pub struct SnapshotCache {
    slots: Mutex<HashMap<Option<Id>, Arc<Slot>>>,
    built: AtomicU64,
    shared: AtomicU64,
}

/// One filter's newest frame; locked while it is built.
type Slot = tokio::sync::Mutex<Option<Built>>;

struct Built {
    frame: SnapshotFrame,
    /// The snapshot generation published when it was built.
    generation: u64,
    at: Instant,
}

impl Built {
    /// Whether it may start a client subscribed at event `after` while `generation` is live.
    fn serves(&self, after: u64, generation: u64, now: Instant) -> bool {
        self.frame.last_id >= after
            && self.generation == generation
            && now.duration_since(self.at) < SNAPSHOT_MAX_AGE
    }
}

impl SnapshotCache {
    /// Frames built (store read and serialised) since start.
    pub fn built(&self) -> u64 {
        self.built.load(Ordering::Relaxed)
    }

    /// Clients started with a frame built for another.
    pub fn shared(&self) -> u64 {
        self.shared.load(Ordering::Relaxed)
    }

    /// A frame for a client subscribed at event `after`: the kept one when it is as new, else
    /// a new one (as of the newest event; the client skips the events it already holds).
    pub async fn frame(
        &self,
        state: &AdminState,
        filter: Option<Id>,
        after: u64,
    ) -> Result<SnapshotFrame, ApiError> {
        let slot = self.slot(filter);
        // Held across the build: builds of one filter never overlap, and those waiting share it.
        let mut kept = slot.lock().await;
        let generation = state.control.snapshot().generation;
        if let Some(built) = kept
            .as_ref()
            .filter(|built| built.serves(after, generation, Instant::now()))
        {
            self.shared.fetch_add(1, Ordering::Relaxed);
            return Ok(built.frame.clone());
        }
        // Read before the store, so the frame shows at least what these say.
        let last_id = state.control.events().last_id();
        let generation = state.control.snapshot().generation;
        let at = Instant::now();
        let frame = build(state, filter, last_id).await?;
        self.built.fetch_add(1, Ordering::Relaxed);
        *kept = Some(Built {
            frame: frame.clone(),
            generation,
            at,
        });
        Ok(frame)
    }

    fn slot(&self, filter: Option<Id>) -> Arc<Slot> {
        // A panic while holding the lock leaves a plain map behind; keep using it.
        let mut slots = self
            .slots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if !slots.contains_key(&filter) && slots.len() >= KEPT_FILTERS {
            slots.retain(|_, slot| Arc::strong_count(slot) > 1);
        }
        slots.entry(filter).or_default().clone()
    }
}

/// Reads what the frame shows from the store and the live snapshot, then assembles and
/// serialises it on the blocking pool.
async fn build(
    state: &AdminState,
    filter: Option<Id>,
    last_id: u64,
) -> Result<SnapshotFrame, ApiError> {
    let config = state.store.load_routing_config().await?;
    let holders = state.store.source_lease_holders().await?;
    let sources = state.store.all_sources().await?;
    let acceptances = state.store.removal_acceptances().await?;
    let live = state.control.snapshot();
    let read = Read {
        filter,
        last_id,
        config,
        holders,
        sources,
        acceptances,
        live,
    };
    let frame = tokio::task::spawn_blocking(move || read.frame())
        .await
        .map_err(|error| ApiError::Unavailable {
            message: format!("snapshot not built: {error}"),
        })??;
    Ok(SnapshotFrame { last_id, frame })
}

/// What a snapshot is made of, read.
struct Read {
    filter: Option<Id>,
    last_id: u64,
    config: crate::model::RoutingConfig,
    holders: HashMap<Id, String>,
    sources: Vec<(DiscoverySource, SourceProgress)>,
    acceptances: HashMap<Id, crate::model::RemovalAcceptance>,
    live: Arc<crate::snapshot::Snapshot>,
}

impl Read {
    /// `id: …\nevent: snapshot\ndata: {…}\n\n`
    fn frame(self) -> Result<Bytes, ApiError> {
        let last_id = self.last_id;
        let snapshot = self.assemble();
        let mut frame = Vec::with_capacity(4096);
        let _ = write!(frame, "id: {last_id}\nevent: snapshot\ndata: ");
        serde_json::to_writer(&mut frame, &snapshot).map_err(|error| ApiError::Unavailable {
            message: format!("snapshot not serialised: {error}"),
        })?;
        frame.extend_from_slice(b"\n\n");
        Ok(Bytes::from(frame))
    }

    /// Services, their targets with live state, and their sources' status.
    fn assemble(mut self) -> EventSnapshot {
        let filter = self.filter;
        let keep = |service_id: Id| filter.is_none_or(|wanted| wanted == service_id);
        let live = &self.live;
        let now_ms = unix_ms();
        let services = self
            .config
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
        let targets: Vec<TargetView> = self
            .config
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
        let mut sources = Vec::new();
        for (source, progress) in std::mem::take(&mut self.sources) {
            if !keep(source.service_id) {
                continue;
            }
            let status = SourceStatus {
                source_id: source.id,
                progress,
                endpoints: counts.get(&source.id).copied().unwrap_or_default(),
                refreshed_by: self.holders.remove(&source.id),
                removal_acceptance: self.acceptances.remove(&source.id),
            };
            sources.push(SourceView::new(&source, Some(status)));
        }
        EventSnapshot {
            last_id: self.last_id,
            at: crate::clock::now(),
            services,
            targets,
            sources,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(last_id: u64, generation: u64, at: Instant) -> Built {
        Built {
            frame: SnapshotFrame {
                last_id,
                frame: Bytes::new(),
            },
            generation,
            at,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_frame_serves_clients_up_to_its_event_in_its_generation_for_a_second() {
        let at = Instant::now();
        let frame = built(10, 3, at);
        assert!(frame.serves(10, 3, at), "subscribed at its event");
        assert!(frame.serves(7, 3, at), "subscribed before: skips 8 to 10");
        assert!(!frame.serves(11, 3, at), "an event it does not show");
        assert!(!frame.serves(10, 4, at), "a newer snapshot generation");
        let aged = at + SNAPSHOT_MAX_AGE;
        assert!(frame.serves(10, 3, aged - Duration::from_millis(1)));
        assert!(!frame.serves(10, 3, aged), "counters a second old");
    }
}
