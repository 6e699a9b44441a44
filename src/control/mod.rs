//! The control task: the only writer of routing snapshots.
//!
//! The admin API writes the store, then asks the control task (through [`ControlHandle`]) to
//! apply; the task reloads the desired state, (re)starts discovery refresh loops, builds a new
//! snapshot and publishes it. Refresh outcomes, removal-grace and stale timers arrive here too,
//! so every change to targets and every snapshot has one writer. Requests that arrive while a
//! rebuild runs are coalesced into the next one.
//!
//! On a shared (PostgreSQL) store other instances' changes arrive as notifications and trigger the
//! same reload, and each discovery source runs only on the instance holding its lease
//! (`cluster.rs`). A store that fails never empties the live snapshot: the previous one keeps
//! serving while reloads are retried with backoff.

mod build;
mod canary;
mod cluster;
mod desired;
mod edge;
mod guard;
mod health;
mod observe;
mod rate_share;
mod source_table;
mod sources;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::discovery::runner::{Clock, RefreshOutcome};
use crate::events::EventLog;
use crate::model::Id;
use crate::snapshot::SnapshotHandle;
use crate::store::{ChangePosition, ChangeSet, Store, StoreError};

use build::{build_changed, build_full};
pub use build::{build_snapshot, CarriedState};
pub use canary::{interval_over, judge, Canaries, CANARY_SYNC};
use cluster::ClusterEvent;
pub use cluster::ClusterSettings;
use desired::Desired;
use edge::Edge;
pub use edge::{EdgeOptions, FileCertificateExpiry, FileCertificates};
pub use guard::AcceptAnswer;
pub use observe::target_view;
pub use rate_share::{GatewayDemand, KeyPicture, RateShares, RoutePicture};
use source_table::SourceTable;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("the control task has stopped")]
    Stopped,
    #[error("cannot load the routing configuration: {0}")]
    Store(#[from] StoreError),
    #[error("the store did not answer the rate-limit exchange within {0:?}")]
    RateExchangeTimeout(std::time::Duration),
    #[error("the store did not take the canary counts within {0:?}")]
    CanaryFlushTimeout(std::time::Duration),
}

/// Refresh counters of one discovery source, for metrics.
#[derive(Debug, Default)]
pub struct SourceStats {
    pub refreshes: AtomicU64,
    pub failures: AtomicU64,
    pub duration_micros: AtomicU64,
}

/// How the control task read the store, for metrics: whole reloads (start, a listener
/// reconnect, the change log unable to say, the periodic resync's safety net) against reloads
/// of only what the change log named (notifications and the periodic resync).
#[derive(Debug, Default)]
pub struct ReloadStats {
    pub full: AtomicU64,
    pub partial: AtomicU64,
}

/// What the control task's periodic work costs, for benchmarks: the runtime watch (every
/// 250 ms: health and ejection changes, zone splits, route limits) and the look for the next
/// timer (every turn of its loop).
#[derive(Debug, Default)]
pub struct WatchStats {
    pub ticks: AtomicU64,
    pub tick_nanos: AtomicU64,
    pub timer_looks: AtomicU64,
    pub timer_look_nanos: AtomicU64,
}

/// Source stats by source id, shared with the admin API (control plane only, never the request
/// path, so a lock is fine).
pub type SourceStatsMap = Arc<RwLock<HashMap<Id, Arc<SourceStats>>>>;

/// What became of a request to refresh a source now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefreshAnswer {
    /// A refresh starts now.
    Queued,
    /// A refresh was already running; its result answers this request too.
    Joined,
    /// The source is disabled and does not refresh.
    Disabled,
    /// No such source (deleted meanwhile).
    Unknown,
}

type Reply<T> = oneshot::Sender<Result<T, Arc<ControlError>>>;

enum Command {
    Apply(Reply<u64>),
    Refresh {
        source_id: Id,
        reply: Reply<RefreshAnswer>,
    },
    AcceptRemovals {
        source_id: Id,
        reply: Reply<AcceptAnswer>,
    },
    BindStream {
        listen: std::net::SocketAddr,
        reply: oneshot::Sender<Result<(), crate::proxy::stream::BindError>>,
    },
    /// The config files' certificates were read again (SIGHUP); serve them from now on.
    FileCertificates {
        certificates: FileCertificates,
        reply: Reply<u64>,
    },
    /// An apply after an admin call that bound `listen` stored (or failed to store) its route.
    ApplyAfterBind {
        listen: std::net::SocketAddr,
        reply: Reply<u64>,
    },
    /// Stop refreshing and give up every held lease (graceful shutdown).
    ReleaseLeases(oneshot::Sender<()>),
}

/// Asks the control task to apply the stored configuration or to refresh a source.
#[derive(Clone)]
pub struct ControlHandle {
    commands: mpsc::Sender<Command>,
    snapshots: SnapshotHandle,
    source_stats: SourceStatsMap,
    file_expiries: edge::FileExpiries,
    events: Arc<EventLog>,
    reload_stats: Arc<ReloadStats>,
    watch_stats: Arc<WatchStats>,
    rate_shares: RateShares,
    canaries: Canaries,
    zone: Option<Arc<str>>,
}

impl ControlHandle {
    /// What the canary task knows: which canaries this gateway judges.
    pub fn canaries(&self) -> &Canaries {
        &self.canaries
    }

    /// What the cluster rate-limit exchange knows, for the admin view and metrics.
    pub fn rate_shares(&self) -> &RateShares {
        &self.rate_shares
    }

    /// Stops the cluster rate-limit exchange and removes this gateway's part of it (graceful
    /// shutdown), so the other gateways take over its share at their next exchange.
    pub async fn stop_rate_sharing(&self) {
        self.rate_shares.stop().await;
    }

    /// This gateway's zone (`cluster.zone`).
    pub fn zone(&self) -> Option<&str> {
        self.zone.as_deref()
    }

    /// The log of what the control task changed or saw, for the event stream and histories.
    pub fn events(&self) -> &Arc<EventLog> {
        &self.events
    }

    /// The expiries of the certificate files being served (none without certificate files).
    pub fn file_certificate_expiries(&self) -> Arc<Vec<FileCertificateExpiry>> {
        self.file_expiries.load_full()
    }

    /// How many whole and partial reloads of the store the control task made.
    pub fn reload_stats(&self) -> &ReloadStats {
        &self.reload_stats
    }

    /// What the control task's periodic work cost so far.
    pub fn watch_stats(&self) -> &WatchStats {
        &self.watch_stats
    }

    /// Refresh counters of every source, by source id.
    pub fn source_stats(&self) -> HashMap<Id, Arc<SourceStats>> {
        self.source_stats
            .read()
            .map(|stats| stats.clone())
            .unwrap_or_default()
    }

    /// The live routing snapshot, for read-only views of runtime state (health, ejection).
    pub fn snapshot(&self) -> Arc<crate::snapshot::Snapshot> {
        self.snapshots.load_full()
    }

    /// Returns once a snapshot built after this call has been published; its generation.
    pub async fn apply(&self) -> Result<u64, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.send(Command::Apply(reply), done).await
    }

    /// Serves `certificates` in place of the config files' certificates read before; returns
    /// once the HTTPS listener uses them.
    pub async fn replace_file_certificates(
        &self,
        certificates: FileCertificates,
    ) -> Result<u64, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.send(
            Command::FileCertificates {
                certificates,
                reply,
            },
            done,
        )
        .await
    }

    /// Like [`ControlHandle::apply`], for the admin call that bound `listen` with
    /// [`ControlHandle::bind_stream_listener`]: from now on the stored routes alone decide
    /// whether the address stays bound.
    pub async fn apply_after_bind(
        &self,
        listen: std::net::SocketAddr,
    ) -> Result<u64, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.send(Command::ApplyAfterBind { listen, reply }, done)
            .await
    }

    /// Starts listening on `listen` for a stream route about to be stored; the outer error means
    /// the control task is gone, the inner one that the address cannot be bound. Call
    /// [`ControlHandle::apply_after_bind`] once the route is stored or refused.
    pub async fn bind_stream_listener(
        &self,
        listen: std::net::SocketAddr,
    ) -> Result<Result<(), crate::proxy::stream::BindError>, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.commands
            .send(Command::BindStream { listen, reply })
            .await
            .map_err(|_| Arc::new(ControlError::Stopped))?;
        done.await.map_err(|_| Arc::new(ControlError::Stopped))
    }

    /// Stops this instance's discovery loops and frees their leases, so another instance takes
    /// the sources over at its next lease round instead of waiting for the leases to expire.
    pub async fn release_leases(&self) -> Result<(), Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.commands
            .send(Command::ReleaseLeases(reply))
            .await
            .map_err(|_| Arc::new(ControlError::Stopped))?;
        done.await.map_err(|_| Arc::new(ControlError::Stopped))
    }

    pub async fn refresh_source(&self, source_id: Id) -> Result<RefreshAnswer, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.send(Command::Refresh { source_id, reply }, done).await
    }

    /// Drains the targets the removal guard of `source_id` holds (an admin accepted them).
    pub async fn accept_removals(&self, source_id: Id) -> Result<AcceptAnswer, Arc<ControlError>> {
        let (reply, done) = oneshot::channel();
        self.send(Command::AcceptRemovals { source_id, reply }, done)
            .await
    }

    async fn send<T>(
        &self,
        command: Command,
        done: oneshot::Receiver<Result<T, Arc<ControlError>>>,
    ) -> Result<T, Arc<ControlError>> {
        self.commands
            .send(command)
            .await
            .map_err(|_| Arc::new(ControlError::Stopped))?;
        done.await.map_err(|_| Arc::new(ControlError::Stopped))?
    }
}

struct ControlTask {
    store: Store,
    snapshots: SnapshotHandle,
    clock: Clock,
    /// Runtime state carried from snapshot to snapshot by target and service id.
    carried: CarriedState,
    generation: u64,
    sources: SourceTable,
    source_stats: SourceStatsMap,
    health_checkers: health::HealthCheckers,
    /// When to retry a sync of sources (or a rebuild) that failed on a store error.
    resync_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Store failures in a row, for the retry backoff.
    store_failures: u32,
    /// A rebuild failed: the next retry rebuilds even if the sources did not change.
    rebuild_due: bool,
    cluster: ClusterSettings,
    /// Next renewal of held leases and bid for free ones.
    lease_round_at: tokio::time::Instant,
    /// Next read of the change log that backs up change notifications (shared stores only).
    periodic_resync_at: Option<tokio::time::Instant>,
    /// When the control task last read everything, for the periodic resync's safety net.
    full_reload_at: tokio::time::Instant,
    /// Listens for other instances' changes (shared stores only); stops when dropped.
    _listener: Option<cluster::ListenerTask>,
    /// Exchanges cluster rate-limit demand; stops when dropped.
    _rate_share: rate_share::RateShareTask,
    /// Adds canary counts to the store and judges canaries; stops when dropped.
    _canary: canary::CanaryTask,
    canaries: Canaries,
    next_runner_generation: u64,
    outcomes: mpsc::Sender<RefreshOutcome>,
    /// Stream listeners and served certificates, kept in step with each snapshot.
    edge: Edge,
    /// Turns what changed into events.
    observer: observe::Observer,
    /// The routing configuration as last read, by service.
    desired: Desired,
    /// Where the last read stood in the store's change log (None: read everything next).
    position: Option<ChangePosition>,
    /// What was read but is not yet in a published snapshot.
    pending: ChangeSet,
    /// What was read whose discovery loops were not yet brought in line: a rebuild between an
    /// admin write and its apply may read the write first.
    unsynced: ChangeSet,
    reload_stats: Arc<ReloadStats>,
    watch_stats: Arc<WatchStats>,
    /// Next trim of the store's change log.
    trim_at: tokio::time::Instant,
}

impl ControlTask {
    /// Reads what changed since the last read into `desired` (everything the first time, after
    /// [`ControlTask::forget_position`], or when the change log cannot say); the parts to
    /// rebuild add up in `pending` until a rebuild takes them.
    async fn load_changes(&mut self) -> Result<(), StoreError> {
        if let Some(position) = self.position {
            if let Some(delta) = self.store.changes_since(position).await? {
                self.position = Some(delta.position);
                let changes = self.desired.apply(delta);
                self.unsynced.merge(changes.clone());
                self.pending.merge(changes);
                self.reload_stats.partial.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        let (config, position) = self.store.load_routing_config_at().await?;
        self.full_reload_at = tokio::time::Instant::now();
        self.desired = Desired::from_config(config);
        self.position = Some(position);
        self.pending = ChangeSet::everything();
        self.unsynced = ChangeSet::everything();
        self.reload_stats.full.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The next reload reads everything (the listener reconnected, or the periodic resync's
    /// safety net is due).
    fn forget_position(&mut self) {
        self.position = None;
    }

    async fn rebuild(&mut self) -> Result<u64, ControlError> {
        if let Err(error) = self.load_changes().await {
            self.rebuild_due = true;
            self.schedule_retry();
            return Err(error.into());
        }
        self.rebuild_due = false;
        self.generation += 1;
        let changes = std::mem::take(&mut self.pending);
        self.health_checkers
            .stop_unwanted(&self.desired.services, &changes);
        let snapshot = if changes.everything {
            build_full(&self.desired, &mut self.carried, self.generation)
        } else {
            build_changed(
                &self.snapshots.load(),
                &self.desired,
                &changes,
                &mut self.carried,
                self.generation,
            )
        };
        self.snapshots.publish(snapshot);
        let published = self.snapshots.load();
        self.observer
            .changes_loaded(&self.desired, &changes, &published, self.sources.entries());
        // Each split was decided as it was built; a new one (or a changed one) is news now.
        self.observer.report_locality(&published);
        self.edge
            .sync_stream_listeners(&self.desired.stream_routes, self.clock.now());
        if changes.everything || changes.certificates {
            self.edge.publish_certificates(&self.desired.certificates);
        }
        self.health_checkers.start_missing(
            &self.desired.services,
            &changes,
            &self.snapshots,
            &self.store,
        );
        tracing::debug!(
            generation = self.generation,
            everything = changes.everything,
            services = changes.services.len(),
            "published routing snapshot"
        );
        Ok(self.generation)
    }

    /// Reads what changed, brings the discovery loops of the changed services in line
    /// (starting, restarting or stopping them), then rebuilds.
    async fn apply(&mut self) -> Result<u64, ControlError> {
        let synced = match self.load_changes().await {
            Ok(()) => {
                let scope = std::mem::take(&mut self.unsynced);
                let synced = self.sync_sources(&scope).await;
                if synced.is_err() {
                    self.unsynced.merge(scope);
                }
                synced
            }
            Err(error) => Err(error.into()),
        };
        if synced.is_err() {
            self.schedule_retry();
        }
        let generation = self.rebuild().await?;
        synced?;
        self.resync_at = None;
        self.store_failures = 0;
        Ok(generation)
    }

    async fn apply_logged(&mut self) {
        if let Err(error) = self.apply().await {
            tracing::error!(%error, "configuration not reloaded; the previous snapshot stays live");
        }
    }

    /// Retries a failed sync or rebuild after 1 s, doubling up to 8 s while the store keeps
    /// failing (a database outage), so the log and the database are not flooded.
    fn schedule_retry(&mut self) {
        let delay = 1i64 << self.store_failures.min(3);
        self.store_failures = self.store_failures.saturating_add(1);
        self.resync_at = Some(self.clock.now() + chrono::Duration::seconds(delay));
    }

    /// Handles what the listener reported: one reload for any number of changes.
    async fn handle_cluster_events(
        &mut self,
        first: ClusterEvent,
        events: &mut mpsc::Receiver<ClusterEvent>,
    ) {
        let mut reload = false;
        let mut reconnected = false;
        let mut next = Some(first);
        while let Some(event) = next {
            match event {
                ClusterEvent::Changed => reload = true,
                ClusterEvent::Resync => {
                    self.forget_position();
                    reload = true;
                    reconnected = true;
                }
                ClusterEvent::RefreshRequested(source_id) => {
                    self.refresh_if_held(source_id);
                }
                ClusterEvent::AcceptRequested(source_id) => {
                    self.accept_if_held(source_id).await;
                }
            }
            next = events.try_recv().ok();
        }
        if reload {
            self.apply_logged().await;
        }
        if reconnected {
            // Notifications sent while nobody listened are lost; requests are stored.
            self.apply_pending_acceptances().await;
        }
    }

    /// When the lease round, a held lease's expiry or the periodic resync is due.
    fn next_cluster_wake(&self) -> tokio::time::Instant {
        [
            Some(self.lease_round_at),
            self.sources.next_lease_end(),
            self.periodic_resync_at,
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(self.lease_round_at)
    }

    async fn run_cluster_timers(&mut self) {
        let now = tokio::time::Instant::now();
        let changed = if self.lease_round_at <= now {
            self.lease_round_at = now + self.cluster.lease / 3;
            self.lease_round().await
        } else {
            self.expire_leases();
            false
        };
        if changed {
            self.rebuild_logged().await;
        }
        if self.periodic_resync_at.is_some_and(|due| due <= now) {
            self.periodic_resync_at = Some(now + self.cluster.resync);
            self.periodic_resync(now).await;
            // Backs up the notification of accepted removals, as the resync backs up changes.
            self.apply_pending_acceptances().await;
        }
    }

    /// Backs up lost notifications by reading what the change log names since the position:
    /// the log is written in the same transaction as each change, whether or not its
    /// notification arrives. Every source's progress is read too (a row per source, not its
    /// targets): other instances write it without a log entry, and this instance's view and
    /// events of their sources follow it. Everything is read when the log cannot say (trimmed
    /// past the position, another database), and at least every [`FULL_RESYNC_INTERVAL`] as a
    /// safety net for writes that bypass the log's triggers (a restore, disabled triggers).
    async fn periodic_resync(&mut self, now: tokio::time::Instant) {
        if now.duration_since(self.full_reload_at) >= FULL_RESYNC_INTERVAL {
            self.forget_position();
        }
        self.unsynced.merge(ChangeSet::everything());
        self.apply_logged().await;
    }

    async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut outcomes: mpsc::Receiver<RefreshOutcome>,
        mut cluster_events: mpsc::Receiver<ClusterEvent>,
        mut verdicts: mpsc::Receiver<health::HealthVerdict>,
        mut canary_moves: mpsc::Receiver<()>,
    ) {
        // Passive ejection only flips atomics on the request path; this is how soon it is seen.
        let mut runtime_watch = tokio::time::interval(RUNTIME_WATCH_INTERVAL);
        runtime_watch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let looked_from = crate::clock::unix_nanos();
            let wake_at = self.next_timer().map(|time| self.clock.instant_of(time));
            let cluster_wake = self.next_cluster_wake();
            self.watch_stats.timer_looks.fetch_add(1, Ordering::Relaxed);
            self.watch_stats.timer_look_nanos.fetch_add(
                crate::clock::unix_nanos().saturating_sub(looked_from),
                Ordering::Relaxed,
            );
            let moved = tokio::select! {
                command = commands.recv() => {
                    let Some(command) = command else { return };
                    self.handle_commands(command, &mut commands).await;
                    MovedSources::Any
                }
                Some(outcome) = outcomes.recv() => {
                    let mut refreshed = vec![outcome.source_id];
                    let mut changed = self.handle_outcome(outcome).await;
                    while let Ok(more) = outcomes.try_recv() {
                        refreshed.push(more.source_id);
                        changed |= self.handle_outcome(more).await;
                    }
                    if changed {
                        self.rebuild_logged().await;
                    }
                    MovedSources::Only(refreshed)
                }
                _ = sleep_until_or_forever(wake_at) => {
                    let rebuild_due = self.rebuild_due;
                    let (changed, moved) = self.run_timers().await;
                    if changed || rebuild_due {
                        self.rebuild_logged().await;
                    }
                    moved
                }
                Some(()) = canary_moves.recv() => {
                    // A canary this gateway judges moved: apply it now, not at the notification.
                    self.apply_logged().await;
                    MovedSources::None
                }
                Some(event) = cluster_events.recv() => {
                    self.handle_cluster_events(event, &mut cluster_events).await;
                    MovedSources::Any
                }
                _ = tokio::time::sleep_until(cluster_wake) => {
                    self.run_cluster_timers().await;
                    MovedSources::Any
                }
                Some(verdict) = verdicts.recv() => {
                    self.observer.note_health(verdict);
                    while let Ok(more) = verdicts.try_recv() {
                        self.observer.note_health(more);
                    }
                    let snapshot = self.snapshots.load();
                    self.observer.report_runtime(&snapshot, self.carried.take_moved());
                    // A verdict may move a zone below its threshold: decide now, not at the tick.
                    self.split_zones(&snapshot);
                    MovedSources::None
                }
                _ = runtime_watch.tick() => {
                    let began = crate::clock::unix_nanos();
                    let snapshot = self.snapshots.load();
                    self.observer.report_runtime(&snapshot, self.carried.take_moved());
                    // Ejections end by the clock: only a look finds their zones whole again.
                    self.split_zones(&snapshot);
                    // Only on the tick: its spacing is what "refused in the last look" means.
                    self.observer.report_limits(&snapshot, tokio::time::Instant::now());
                    self.watch_stats.ticks.fetch_add(1, Ordering::Relaxed);
                    self.watch_stats.tick_nanos.fetch_add(
                        crate::clock::unix_nanos().saturating_sub(began),
                        Ordering::Relaxed,
                    );
                    self.trim_change_log_when_due().await;
                    MovedSources::None
                }
            };
            self.report_sources(moved).await;
        }
    }

    /// Records the sources whose progress moved; for one another instance refreshes, its
    /// lease holder comes from the store.
    async fn report_sources(&mut self, moved: MovedSources) {
        let candidates = match moved {
            MovedSources::None => return,
            MovedSources::Only(ids) => Some(ids),
            MovedSources::Any => None,
        };
        for mut news in self
            .observer
            .source_news(self.sources.entries(), candidates)
        {
            if news.holder_unknown {
                news.event.status.refreshed_by = self
                    .store
                    .source_lease_holder(news.event.source_id)
                    .await
                    .unwrap_or_default();
            }
            self.observer.record_source(news);
        }
    }

    async fn handle_commands(&mut self, first: Command, commands: &mut mpsc::Receiver<Command>) {
        let mut apply_waiting = Vec::new();
        let mut next = Some(first);
        while let Some(command) = next {
            match command {
                Command::Apply(reply) => apply_waiting.push(reply),
                Command::Refresh { source_id, reply } => {
                    let _ = reply.send(Ok(self.request_refresh(source_id).await));
                }
                Command::AcceptRemovals { source_id, reply } => {
                    let answer = self
                        .accept_removals(source_id)
                        .await
                        .map_err(|error| Arc::new(ControlError::Store(error)));
                    let _ = reply.send(answer);
                }
                Command::BindStream { listen, reply } => {
                    let _ = reply.send(self.edge.bind_stream_listener(listen));
                }
                Command::FileCertificates {
                    certificates,
                    reply,
                } => {
                    self.edge.replace_file_certificates(certificates);
                    // Not in the store's change log: served again on the next build.
                    self.pending.certificates = true;
                    apply_waiting.push(reply);
                }
                Command::ApplyAfterBind { listen, reply } => {
                    self.edge.release_pending(listen);
                    apply_waiting.push(reply);
                }
                Command::ReleaseLeases(reply) => {
                    self.release_leases().await;
                    let _ = reply.send(());
                }
            }
            next = commands.try_recv().ok();
        }
        if apply_waiting.is_empty() {
            return;
        }
        let outcome = self.apply().await.map_err(Arc::new);
        if let Err(error) = &outcome {
            tracing::error!(%error, "routing snapshot not rebuilt; the previous one stays live");
        }
        for reply in apply_waiting {
            let _ = reply.send(outcome.clone());
        }
    }

    async fn trim_change_log_when_due(&mut self) {
        let now = tokio::time::Instant::now();
        if now < self.trim_at {
            return;
        }
        self.trim_at = now + CHANGE_LOG_TRIM_INTERVAL;
        match self.store.trim_change_log().await {
            Ok(trimmed) => tracing::debug!(trimmed, "trimmed the change log"),
            Err(error) => tracing::warn!(%error, "cannot trim the change log; trying again later"),
        }
    }

    /// Decides every zone split again (TRAFFIC.md §4) and records the ones that changed.
    fn split_zones(&mut self, snapshot: &crate::snapshot::Snapshot) {
        observe::refresh_zone_splits(snapshot, crate::clock::unix_ms());
        self.observer.report_locality(snapshot);
    }

    async fn rebuild_logged(&mut self) {
        if let Err(error) = self.rebuild().await {
            tracing::error!(%error, "routing snapshot not rebuilt; the previous one stays live");
        }
    }
}

/// Which sources' progress a turn of the control loop may have moved: looking at every source
/// after each refresh outcome would make an outcome's cost grow with the number of sources.
enum MovedSources {
    None,
    Only(Vec<Id>),
    Any,
}

/// The longest the periodic resync goes without reading everything: the change log's
/// retention, so a whole read (about 1.5 s of the control task at 100,000 targets) comes no
/// more often than for a reader that fell behind the log.
const FULL_RESYNC_INTERVAL: std::time::Duration =
    std::time::Duration::from_millis(crate::store::CHANGE_LOG_RETENTION_MS as u64);

/// How often the control task trims the store's change log.
const CHANGE_LOG_TRIM_INTERVAL: std::time::Duration = std::time::Duration::from_secs(60);

/// How often the control task looks at the per-target atomics for health and ejection changes.
const RUNTIME_WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_millis(250);

async fn sleep_until_or_forever(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// Publishes the first snapshot from the store (so traffic flows to the last known targets
/// before any refresh), starts the discovery loops, then runs the control task.
pub async fn start(
    store: Store,
    snapshots: SnapshotHandle,
    edge: EdgeOptions,
    cluster: ClusterSettings,
    events: Arc<EventLog>,
) -> Result<(ControlHandle, JoinHandle<()>), ControlError> {
    let (outcome_sender, outcome_receiver) = mpsc::channel(1024);
    // Bounded: a burst of notifications needs one reload, not one each.
    let (cluster_sender, cluster_receiver) = mpsc::channel(16);
    let listener = store.postgres_pool().map(|pool| {
        cluster::spawn_listener(
            pool.clone(),
            store.instance_id().to_owned(),
            cluster_sender.clone(),
        )
    });
    let now = tokio::time::Instant::now();
    let shared = store.is_shared();
    // Bounded: a check loop that finds it full drops the detail, never the change.
    let (verdict_sender, verdict_receiver) = mpsc::channel(1024);
    let observer = observe::Observer::new(events.clone(), store.instance_id().to_owned());
    let (canary_moved, canary_moves) = mpsc::channel(1);
    let (canaries, canary_task) = canary::spawn(
        store.clone(),
        snapshots.clone(),
        cluster.lease,
        canary::ROUND_GRACE,
        canary_moved,
    );
    let (rate_shares, rate_share_task) = rate_share::spawn(
        store.clone(),
        store.instance_id().to_owned(),
        snapshots.clone(),
        cluster.rate_sync,
    );
    let zone = cluster.zone.clone();
    let mut task = ControlTask {
        store,
        snapshots,
        clock: Clock::new(),
        carried: CarriedState::in_zone(zone.clone()),
        generation: 0,
        sources: SourceTable::default(),
        source_stats: SourceStatsMap::default(),
        health_checkers: health::HealthCheckers::new(verdict_sender),
        resync_at: None,
        store_failures: 0,
        rebuild_due: false,
        lease_round_at: now + cluster.lease / 3,
        periodic_resync_at: shared.then(|| now + cluster.resync),
        full_reload_at: now,
        cluster,
        _listener: listener,
        _rate_share: rate_share_task,
        _canary: canary_task,
        canaries: canaries.clone(),
        next_runner_generation: 1,
        outcomes: outcome_sender,
        edge: Edge::new(edge),
        observer,
        desired: Desired::default(),
        position: None,
        pending: ChangeSet::default(),
        unsynced: ChangeSet::default(),
        reload_stats: Arc::default(),
        watch_stats: Arc::default(),
        trim_at: now + CHANGE_LOG_TRIM_INTERVAL,
    };
    task.rebuild().await?;
    task.unsynced = ChangeSet::default();
    if task.sync_sources(&ChangeSet::everything()).await? {
        task.rebuild().await?;
    }
    // An acceptance stored while no instance ran (or before a crash) is applied now.
    task.apply_pending_acceptances().await;
    task.observer.prime(task.sources.entries());
    let (sender, receiver) = mpsc::channel(256);
    let snapshots = task.snapshots.clone();
    let source_stats = task.source_stats.clone();
    let file_expiries = task.edge.file_expiries();
    let reload_stats = task.reload_stats.clone();
    let watch_stats = task.watch_stats.clone();
    // Without a listener (SQLite) the sender stays alive in the task, so the receiver just waits.
    let join = tokio::spawn(async move {
        let _cluster_sender = cluster_sender;
        task.run(
            receiver,
            outcome_receiver,
            cluster_receiver,
            verdict_receiver,
            canary_moves,
        )
        .await
    });
    Ok((
        ControlHandle {
            commands: sender,
            snapshots,
            source_stats,
            file_expiries,
            events,
            reload_stats,
            watch_stats,
            rate_shares,
            canaries,
            zone,
        },
        join,
    ))
}
