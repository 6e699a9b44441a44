//! Cluster-scope rate limits (TRAFFIC.md §6): the gateways sharing a store admit each route's
//! rate together. Every `cluster.rate_sync_ms` this task takes the requests each key offered
//! since the last turn, smooths them into a demand per second, and exchanges the demand of the
//! keys near their limit through the store; then each key in the exchange runs at the share of
//! the rate that follows this gateway's part of the total demand, and every other key at the
//! default share, the rate divided by the gateways seen.
//!
//! The request path never waits for any of it: shares are atomics in the route's limiter, moved
//! only here. The task is its own tokio task, so a slow or absent store delays no reload; while
//! the store fails, every share stays as last set and the next turn tries again.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::ControlError;
use crate::model::{Id, RateLimitScope};
use crate::snapshot::{KeyUse, RateLimiter, SnapshotHandle};
use crate::store::{DemandReport, DemandRow, RateExchange, Store, StoreError};

/// Weight of the newest sample in a key's smoothed demand.
const SMOOTHING: f64 = 0.5;
/// A key whose demand reaches this part of the default share is reported: it may soon need
/// more than the default.
const HOT_FRACTION: f64 = 0.5;
/// A key leaves the exchange when its demand here and elsewhere both fall below this part of
/// the default share; between this and [`HOT_FRACTION`] it stays as it is, so a key near the
/// line does not flap in and out.
const LEAVE_FRACTION: f64 = 0.1;
/// No gateway's share of a key falls below this part of the rate: one whose clients just
/// arrived is never locked out until the next exchange.
const FLOOR_FRACTION: f64 = 0.01;
/// Demand below this part of the default share is forgotten, so the task's memory follows the
/// keys that matter, not every client ever seen.
const FORGET_FRACTION: f64 = 0.01;
/// Keys one route reports per exchange at most, the busiest first: the rest run at the default
/// share, which never admits more than the rate in total.
const MAX_REPORTED_KEYS: usize = 2_000;
/// Keys the view shows per route.
const VIEW_KEYS: usize = 20;
/// Rows older than this many sync periods are no longer fresh (but never under a second): a
/// gateway that missed two exchanges is still counted.
const FRESH_PERIODS: u32 = 3;
const MIN_FRESH: Duration = Duration::from_secs(1);

/// How long another gateway's row counts, by the database's clock; also the most one exchange
/// may take (an answer later than that would be stale on arrival).
pub fn freshness(period: Duration) -> Duration {
    (period * FRESH_PERIODS).max(MIN_FRESH)
}

/// A gateway's default share: what each key runs at when it has no share of its own.
pub fn default_share(rate: f64, members: u32) -> f64 {
    rate / f64::from(members.max(1))
}

/// This gateway's share of a key's `rate` for its demand `mine` against the others' demand
/// `others`: in proportion, at least [`FLOOR_FRACTION`] of the rate, at most the rate. Without
/// any demand yet, the default share.
pub fn share_of(rate: f64, members: u32, mine: f64, others: f64) -> f64 {
    let mine = mine.max(0.0);
    let total = mine + others.max(0.0);
    let share = if total > 0.0 {
        rate * mine / total
    } else {
        default_share(rate, members)
    };
    share.clamp(rate * FLOOR_FRACTION, rate)
}

/// The next smoothed demand from the last one and the newest sample.
fn smoothed(previous: Option<f64>, sample: f64) -> f64 {
    match previous {
        // A key's first sample is taken whole, so a key that arrives hot is reported at once.
        None => sample,
        Some(previous) => SMOOTHING * sample + (1.0 - SMOOTHING) * previous,
    }
}

/// Whether a key belongs in this turn's exchange: hot here; or warm at another gateway and seen
/// here too; or already exchanged and still warm here or elsewhere. "Warm" is the leaving line
/// on both sides, so a key cold everywhere leaves and does not come back until it is hot again.
/// Hot is both a demand of half the default share and the limiter's own word that the key is
/// near its limit (refused, or past half its burst): one request in a short turn reads as a
/// high rate, and must not put every client of a slow per-client limit into the store.
fn wants_report(
    default_share: f64,
    mine: f64,
    others: f64,
    exchanged: bool,
    near_limit: bool,
) -> bool {
    let warm = LEAVE_FRACTION * default_share;
    let hot = near_limit && mine >= HOT_FRACTION * default_share;
    let warm_elsewhere = others > 0.0 && others >= warm;
    if exchanged {
        mine >= warm || warm_elsewhere || hot
    } else {
        hot || (warm_elsewhere && mine > 0.0)
    }
}

/// The other gateways' demand of one key: (instance id, requests per second).
type OthersDemand = Vec<(String, f64)>;

/// What a route's limiter should run at after an exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Settlement {
    pub default_rate: f64,
    /// Keys given a share of their own (`Some`) or handed back to the default (`None`).
    pub shares: Vec<(u64, Option<f64>)>,
}

/// One cluster route's exchange state on this gateway: pure, so the arithmetic is tested
/// without a store or a clock.
#[derive(Debug, Clone, Default)]
pub struct RouteShare {
    rate: f64,
    /// Smoothed requests per second offered here, by key.
    demand: HashMap<u64, f64>,
    /// The other gateways' fresh demand, by key, as of the last exchange.
    others: HashMap<u64, OthersDemand>,
    /// Keys running at a share of their own.
    exchanged: HashSet<u64>,
    /// Keys the limiter found near their limit when they last sent requests.
    near_limit: HashSet<u64>,
}

impl RouteShare {
    pub fn new(rate: f64) -> RouteShare {
        RouteShare {
            rate,
            ..RouteShare::default()
        }
    }

    fn others_total(&self, key: u64) -> f64 {
        self.others
            .get(&key)
            .map_or(0.0, |rows| rows.iter().map(|(_, demand)| demand).sum())
    }

    /// Takes the requests each key offered over `elapsed` into its smoothed demand; keys that
    /// offered none decay. `members`: the gateways last seen, 1 before any exchange.
    pub fn observe(&mut self, uses: &[KeyUse], elapsed: Duration, members: u32) {
        let seconds = elapsed.as_secs_f64().max(1e-3);
        let mut seen = HashSet::with_capacity(uses.len());
        for key_use in uses {
            seen.insert(key_use.key);
            // A key keeps the limiter's last word on it through a turn it sent nothing in.
            if key_use.near_limit {
                self.near_limit.insert(key_use.key);
            } else {
                self.near_limit.remove(&key_use.key);
            }
            let sample = f64::from(key_use.offered) / seconds;
            let previous = self.demand.get(&key_use.key).copied();
            self.demand.insert(key_use.key, smoothed(previous, sample));
            if key_use.shared {
                self.exchanged.insert(key_use.key);
            }
        }
        for (key, demand) in self.demand.iter_mut() {
            if !seen.contains(key) {
                *demand = smoothed(Some(*demand), 0.0);
            }
        }
        // An exchanged key forgotten here stays exchanged, reported with no demand, until it is
        // cold elsewhere too.
        let forget_below = FORGET_FRACTION * default_share(self.rate, members);
        self.demand.retain(|_, demand| *demand >= forget_below);
        let demand = &self.demand;
        self.near_limit.retain(|key| demand.contains_key(key));
    }

    /// The keys to report this turn with their demand here, the busiest first.
    pub fn reports(&self, members: u32) -> Vec<(u64, f64)> {
        let default = default_share(self.rate, members);
        let candidates: HashSet<u64> = self
            .demand
            .keys()
            .chain(self.exchanged.iter())
            .copied()
            .collect();
        let mut reports: Vec<(u64, f64)> = candidates
            .into_iter()
            .filter_map(|key| {
                let mine = self.demand.get(&key).copied().unwrap_or(0.0);
                let exchanged = self.exchanged.contains(&key);
                let near_limit = self.near_limit.contains(&key);
                wants_report(default, mine, self.others_total(key), exchanged, near_limit)
                    .then_some((key, mine))
            })
            .collect();
        reports.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        reports.truncate(MAX_REPORTED_KEYS);
        reports
    }

    /// Takes an exchange's answer: `reported` is what this gateway wrote, `rows` the others'
    /// fresh rows of this route. Every reported key gets its share of the total demand; keys
    /// that left the exchange go back to the default share.
    pub fn settle(
        &mut self,
        reported: &[(u64, f64)],
        rows: Vec<DemandRow>,
        members: u32,
    ) -> Settlement {
        self.others.clear();
        for row in rows {
            self.others
                .entry(row.key)
                .or_default()
                .push((row.instance_id, row.demand_per_second));
        }
        let mut shares = Vec::with_capacity(reported.len() + self.exchanged.len());
        let now_exchanged: HashSet<u64> = reported.iter().map(|(key, _)| *key).collect();
        for &key in &self.exchanged {
            if !now_exchanged.contains(&key) {
                shares.push((key, None));
            }
        }
        for &(key, mine) in reported {
            let others = self.others_total(key);
            shares.push((key, Some(share_of(self.rate, members, mine, others))));
        }
        self.exchanged = now_exchanged;
        Settlement {
            default_rate: default_share(self.rate, members),
            shares,
        }
    }

    /// A key the limiter no longer tracks has no share of its own any more.
    fn forget_share(&mut self, key: u64) {
        self.exchanged.remove(&key);
    }

    /// The keys with the most demand here and elsewhere, for the view.
    fn busiest(&self, count: usize) -> Vec<(u64, f64, OthersDemand)> {
        let keys: HashSet<u64> = self
            .demand
            .keys()
            .chain(self.others.keys())
            .copied()
            .collect();
        let mut keys: Vec<(u64, f64)> = keys
            .into_iter()
            .map(|key| {
                let mine = self.demand.get(&key).copied().unwrap_or(0.0);
                (key, mine + self.others_total(key))
            })
            .collect();
        keys.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        keys.truncate(count);
        keys.into_iter()
            .map(|(key, _)| {
                (
                    key,
                    self.demand.get(&key).copied().unwrap_or(0.0),
                    self.others.get(&key).cloned().unwrap_or_default(),
                )
            })
            .collect()
    }
}

/// Another gateway's demand of one key, as it reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayDemand {
    pub instance_id: String,
    pub demand_per_second: f64,
}

/// One key as this gateway sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyPicture {
    /// The limiter's hash of the key (never the key itself).
    pub key: u64,
    pub demand_per_second: f64,
    /// What the key runs at on this gateway now.
    pub share_per_second: f64,
    pub gateways: Vec<GatewayDemand>,
}

/// What this gateway knows of one cluster route's exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct RoutePicture {
    /// Gateways seen within the freshness window, this one included (1 before any exchange).
    pub instances: u32,
    pub default_share_per_second: f64,
    /// The last exchange that answered, by this gateway's clock.
    pub synced_at: Option<DateTime<Utc>>,
    /// Why the exchanges fail, while they do.
    pub last_error: Option<String>,
    /// The busiest keys, here and elsewhere.
    pub keys: Vec<KeyPicture>,
}

/// The task's shared side: what it last published, and how often the store failed it.
#[derive(Debug)]
struct Shared {
    instance_id: String,
    pictures: Mutex<HashMap<Id, RoutePicture>>,
    failures: AtomicU64,
    exchanges: AtomicU64,
    stop: mpsc::Sender<oneshot::Sender<()>>,
}

/// A cheap handle on the rate-share task, for the admin view and metrics; never touched by the
/// request path.
#[derive(Debug, Clone)]
pub struct RateShares {
    shared: Arc<Shared>,
}

impl RateShares {
    /// This gateway's instance id.
    pub fn instance_id(&self) -> &str {
        &self.shared.instance_id
    }

    /// What the last turn knew of a cluster route; None for other routes.
    pub fn route(&self, route_id: Id) -> Option<RoutePicture> {
        self.shared
            .pictures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&route_id)
            .cloned()
    }

    /// Exchanges that failed (the store unreachable, or too slow).
    pub fn sync_failures(&self) -> u64 {
        self.shared.failures.load(Ordering::Relaxed)
    }

    /// Exchanges that answered.
    pub fn syncs(&self) -> u64 {
        self.shared.exchanges.load(Ordering::Relaxed)
    }

    /// Stops the task and removes this gateway's rows and presence, so the others take its part
    /// of every rate at their next exchange. Returns once done (or the task is gone).
    pub async fn stop(&self) {
        let (done, finished) = oneshot::channel();
        if self.shared.stop.send(done).await.is_ok() {
            let _ = finished.await;
        }
    }
}

/// Where the demand goes: the store, or a fake in tests.
pub trait DemandExchange: Send + Sync + 'static {
    fn exchange(
        &self,
        routes: &[Id],
        reports: &[DemandReport],
        fresh: Duration,
    ) -> impl Future<Output = Result<RateExchange, StoreError>> + Send;

    fn leave(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// On SQLite a gateway is alone: the exchange answers at once, without holding the store's one
/// writer four times a second for nothing.
impl DemandExchange for Store {
    async fn exchange(
        &self,
        routes: &[Id],
        reports: &[DemandReport],
        fresh: Duration,
    ) -> Result<RateExchange, StoreError> {
        if !self.is_shared() {
            return Ok(RateExchange {
                members: 1,
                rows: Vec::new(),
            });
        }
        self.exchange_rate_demand(routes, reports, fresh).await
    }

    async fn leave(&self) -> Result<(), StoreError> {
        if !self.is_shared() {
            return Ok(());
        }
        self.leave_rate_exchange().await
    }
}

/// Aborts the task when dropped: it ends with the control task (a crash, for the others, until
/// its rows go stale).
pub(super) struct RateShareTask(JoinHandle<()>);

impl Drop for RateShareTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Starts the task; its first exchange is one `period` from now.
pub(super) fn spawn<E: DemandExchange>(
    exchange: E,
    instance_id: String,
    snapshots: SnapshotHandle,
    period: Duration,
) -> (RateShares, RateShareTask) {
    let (stop, stops) = mpsc::channel(4);
    let shared = Arc::new(Shared {
        instance_id,
        pictures: Mutex::default(),
        failures: AtomicU64::new(0),
        exchanges: AtomicU64::new(0),
        stop,
    });
    let task = Sharer {
        exchange,
        snapshots,
        period,
        shared: shared.clone(),
        routes: HashMap::new(),
        members: None,
        last_error: None,
        joined: false,
        last_turn: Instant::now(),
    };
    let join = tokio::spawn(task.run(stops));
    (RateShares { shared }, RateShareTask(join))
}

/// One cluster route as the task follows it: the limiter it moves (a changed `rate_limit` is a
/// new limiter, and starts over) and its exchange state.
struct Followed {
    limiter: Arc<RateLimiter>,
    share: RouteShare,
    /// This route's last exchange that answered.
    synced_at: Option<DateTime<Utc>>,
}

struct Sharer<E> {
    exchange: E,
    snapshots: SnapshotHandle,
    period: Duration,
    shared: Arc<Shared>,
    routes: HashMap<Id, Followed>,
    /// Gateways seen at the last exchange that answered; None before the first.
    members: Option<u32>,
    /// Set while exchanges fail: the outage is logged once, when it starts.
    last_error: Option<String>,
    /// This gateway has rows or presence in the store.
    joined: bool,
    last_turn: Instant,
}

impl<E: DemandExchange> Sharer<E> {
    async fn run(mut self, mut stops: mpsc::Receiver<oneshot::Sender<()>>) {
        let mut ticks = tokio::time::interval_at(Instant::now() + self.period, self.period);
        // A turn that ran late is not made up for: demand is measured over the real interval.
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => self.turn().await,
                stop = stops.recv() => {
                    if let Err(error) = self.leave().await {
                        tracing::warn!(%error, "cannot remove this gateway's rate-limit demand; \
                            the others count it until its rows go stale");
                    }
                    self.shared
                        .pictures
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .clear();
                    if let Some(done) = stop {
                        let _ = done.send(());
                    }
                    return;
                }
            }
        }
    }

    /// One turn: take the use of every cluster route's keys, exchange, settle, publish.
    async fn turn(&mut self) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.last_turn);
        self.last_turn = now;
        self.follow_live_routes();
        if self.routes.is_empty() {
            if self.joined && self.leave().await.is_ok() {
                self.joined = false;
            }
            self.publish();
            return;
        }
        let members = self.members.unwrap_or(1);
        let mut route_ids = Vec::with_capacity(self.routes.len());
        let mut reported: HashMap<Id, Vec<(u64, f64)>> = HashMap::new();
        let mut reports = Vec::new();
        for (&route_id, followed) in self.routes.iter_mut() {
            let mut uses = Vec::new();
            followed.limiter.take_use(now, |key_use| uses.push(key_use));
            followed.share.observe(&uses, elapsed, members);
            let chosen = followed.share.reports(members);
            reports.extend(chosen.iter().map(|&(key, demand)| DemandReport {
                route_id,
                key,
                demand_per_second: demand,
            }));
            route_ids.push(route_id);
            reported.insert(route_id, chosen);
        }
        route_ids.sort_unstable();
        // The view shows the new demand (and a new route) while the exchange runs.
        self.publish();
        let fresh = freshness(self.period);
        let answer =
            match tokio::time::timeout(fresh, self.exchange.exchange(&route_ids, &reports, fresh))
                .await
            {
                Ok(Ok(answer)) => Ok(answer),
                Ok(Err(error)) => Err(ControlError::Store(error)),
                Err(_) => Err(ControlError::RateExchangeTimeout(fresh)),
            };
        match answer {
            Ok(answer) => self.settle(answer, &mut reported),
            Err(error) => self.failed(error),
        }
        self.publish();
    }

    /// Removes this gateway's rows and presence, within the time an exchange may take: a store
    /// that does not answer must not hold the task (or a graceful stop) for longer.
    async fn leave(&self) -> Result<(), ControlError> {
        let fresh = freshness(self.period);
        match tokio::time::timeout(fresh, self.exchange.leave()).await {
            Ok(result) => result.map_err(ControlError::Store),
            Err(_) => Err(ControlError::RateExchangeTimeout(fresh)),
        }
    }

    /// Follows every route of the live snapshot whose limit has cluster scope; forgets the rest.
    /// A limiter new to the task (a new route, a changed limit) starts at the default share of
    /// the gateways last seen, not at the whole rate.
    fn follow_live_routes(&mut self) {
        let snapshot = self.snapshots.load_full();
        let mut live: HashMap<Id, Arc<RateLimiter>> = HashMap::new();
        for entry in snapshot.routes() {
            if let Some(limiter) = &entry.limiter {
                if limiter.spec().scope == RateLimitScope::Cluster {
                    live.insert(entry.route.id, limiter.clone());
                }
            }
        }
        self.routes.retain(|id, followed| {
            live.get(id)
                .is_some_and(|limiter| Arc::ptr_eq(limiter, &followed.limiter))
        });
        let members = self.members;
        for (id, limiter) in live {
            self.routes.entry(id).or_insert_with(|| {
                if let Some(members) = members {
                    limiter.set_default_rate(default_share(limiter.rate(), members));
                }
                Followed {
                    share: RouteShare::new(limiter.rate()),
                    limiter,
                    synced_at: None,
                }
            });
        }
    }

    fn settle(&mut self, answer: RateExchange, reported: &mut HashMap<Id, Vec<(u64, f64)>>) {
        let members = answer.members.max(1);
        let mut rows_by_route: HashMap<Id, Vec<DemandRow>> = HashMap::new();
        for row in answer.rows {
            rows_by_route.entry(row.route_id).or_default().push(row);
        }
        let at = crate::clock::now();
        for (route_id, followed) in self.routes.iter_mut() {
            let Some(chosen) = reported.remove(route_id) else {
                // Arrived after this turn's reports were taken: settled next turn.
                continue;
            };
            let rows = rows_by_route.remove(route_id).unwrap_or_default();
            let settlement = followed.share.settle(&chosen, rows, members);
            followed.limiter.set_default_rate(settlement.default_rate);
            for (key, share) in settlement.shares {
                if !followed.limiter.set_share(key, share) {
                    followed.share.forget_share(key);
                }
            }
            followed.synced_at = Some(at);
        }
        self.members = Some(members);
        self.joined = true;
        self.shared.exchanges.fetch_add(1, Ordering::Relaxed);
        if self.last_error.take().is_some() {
            tracing::info!("the rate-limit demand exchange works again");
        }
    }

    fn failed(&mut self, error: ControlError) {
        self.shared.failures.fetch_add(1, Ordering::Relaxed);
        let message = error.to_string();
        if self.last_error.is_none() {
            tracing::warn!(%error, "cannot exchange rate-limit demand through the store; \
                every cluster rate limit keeps its last shares until it can");
        }
        self.last_error = Some(message);
    }

    fn publish(&self) {
        let members = self.members.unwrap_or(1);
        let pictures: HashMap<Id, RoutePicture> = self
            .routes
            .iter()
            .map(|(&route_id, followed)| {
                let default_share = followed.limiter.default_rate();
                let keys = followed
                    .share
                    .busiest(VIEW_KEYS)
                    .into_iter()
                    .map(|(key, demand, others)| KeyPicture {
                        key,
                        demand_per_second: demand,
                        share_per_second: followed
                            .limiter
                            .rate_of_key(key)
                            .unwrap_or(default_share),
                        gateways: others
                            .into_iter()
                            .map(|(instance_id, demand_per_second)| GatewayDemand {
                                instance_id,
                                demand_per_second,
                            })
                            .collect(),
                    })
                    .collect();
                let picture = RoutePicture {
                    instances: members,
                    default_share_per_second: default_share,
                    synced_at: followed.synced_at,
                    last_error: self.last_error.clone(),
                    keys,
                };
                (route_id, picture)
            })
            .collect();
        *self
            .shared
            .pictures
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = pictures;
    }
}

#[cfg(test)]
mod tests;
