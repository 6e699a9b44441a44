//! The immutable routing table the data path reads, and its publish/load wrapper.
//!
//! The control task builds a new [`Snapshot`] for every change and publishes it with one atomic
//! pointer swap; a request does one lock-free load and never sees a half-applied change. A new
//! generation shares every service, route index and stream table the change did not touch with
//! the one before ([`Snapshot::next`]).

use foldhash::{HashMap, HashMapExt};
use std::borrow::Cow;
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use http::uri::Authority;
use http::{HeaderValue, Method};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::balance::{Admission, Balancer, LoadBound, TargetHealth, TargetLoad, Trial};
use crate::clock::unix_ms;
use crate::model::path::{self, EscapedSlashes};
use crate::model::{Id, RateLimit, Route, Service, StreamRoute, Target};

mod backends;
mod canary;
mod header_filter;
mod locality;
mod rate_limit;
mod retries;
mod route_match;
mod sessions;
mod stream;

pub use backends::{BackendRuntime, Backends, Subset};
pub use canary::{canary_weights, is_error as is_canary_error, CanaryCounters, Outcome};
pub use header_filter::{CompiledHeaderFilter, Variables};
pub use locality::{ZoneBasis, ZoneDecision, ZoneSplit};
pub use rate_limit::{Decision, KeyUse, RateLimiter};
pub use retries::{RetryCounters, RetryReason, WindowTotals};
pub use route_match::{cookie_value, query_value, Conditions, RequestView};
pub use sessions::{Place, SessionTargets};
pub use stream::{StreamListenerRoutes, StreamRouteEntry, StreamStats, StreamTable};

/// One target that may take new traffic, as the data path needs it.
#[derive(Debug)]
pub struct TargetRuntime {
    pub id: Id,
    /// `host:port` (IPv6 hosts in brackets), used for the upstream URI and as the default Host.
    pub authority: Authority,
    /// The same authority as a `Host` header value, sent when no other Host is chosen.
    pub host_header: HeaderValue,
    /// Carried across snapshots by target id, so in-flight counts survive rebuilds.
    pub load: Arc<TargetLoad>,
    /// Health-check verdict and ejection, carried by target id like `load`.
    pub health: Arc<TargetHealth>,
    /// The stored target: weight, priority and the metadata subsets select by.
    pub spec: Arc<Target>,
    /// Hash of the target's stable identity (provider key, else `host:port`) for hashing
    /// policies; 0 for the others, which never read it.
    pub identity: u64,
}

/// Per-service counters, carried across snapshots by service id.
#[derive(Debug, Default)]
pub struct ServiceCounters {
    /// Picks made from unhealthy or ejected targets because no tier had an available one.
    pub panic_picks: AtomicU64,
    /// Attempts whose connection to a target failed or timed out.
    pub connect_errors: AtomicU64,
    /// Attempts that got no response headers (or could not send the body) in time.
    pub timeouts: AtomicU64,
    /// Requests waiting now for room at a full target (`limits.max_connections_per_target`).
    pub queued: AtomicU64,
    /// Requests refused for want of room: the queue was full or its timeout ran out.
    pub overloaded: AtomicU64,
    /// HTTP/2 connections open now to the service's targets.
    pub h2_connections: AtomicU64,
    /// HTTP/2 streams open now to the service's targets.
    pub h2_streams: AtomicU64,
    /// HTTP/2 streams the targets never processed (`REFUSED_STREAM`, above a GOAWAY's last
    /// stream id): each may be retried whatever its method.
    pub h2_unprocessed: AtomicU64,
    /// Requests in flight now to the service, kept only under `hash_balance_factor` (the
    /// bounded load compares each target with the mean).
    pub in_flight: AtomicU64,
    /// Requests whose session cookie named a target that could not take them: they were
    /// picked anew and given a new cookie.
    pub sessions_repinned: AtomicU64,
    /// The retry budget's window and what retries and hedges were sent for.
    pub retries: RetryCounters,
    /// With a zone split (`locality` and `cluster.zone`): picks made among the zone's targets,
    /// and picks made among every zone's.
    pub zone_picks: AtomicU64,
    pub all_zone_picks: AtomicU64,
}

/// Gateway-wide counters of the data path (for metrics).
#[derive(Debug, Default)]
pub struct GatewayCounters {
    /// Requests that matched no route.
    pub unrouted: AtomicU64,
    /// Stream connections closed because no stream route matched (no SNI match, no ClientHello).
    pub stream_unmatched: AtomicU64,
    /// Idle HTTP/1.1 client connections that gave back their HTTP state (parks so far).
    pub client_connection_parks: AtomicU64,
    /// HTTP/1.1 client connections parked now: open, idle, holding no HTTP buffers.
    pub parked_client_connections: AtomicU64,
    /// HTTP/2 client connections ended with GOAWAY ENHANCE_YOUR_CALM for cancelling most of
    /// the streams they opened.
    pub http2_calmed_connections: AtomicU64,
    /// HTTP/2 streams refused (RST_STREAM REFUSED_STREAM) for exceeding
    /// `proxy.http2_max_concurrent_streams` on their connection.
    pub http2_streams_refused: AtomicU64,
    /// Client connections open now on the proxy listeners.
    pub client_connections: AtomicU64,
    /// Client connections closed on arrival because their listener had `proxy.max_connections`.
    pub client_connections_refused: AtomicU64,
    /// Requests refused for breaking a rule or limit, by [`REFUSAL_CODES`] position.
    pub requests_refused: [AtomicU64; REFUSAL_CODES.len()],
    /// Memory held now by request bodies read before a target is picked.
    pub request_body_memory_bytes: AtomicU64,
    /// Bytes written now to spool files by request bodies too large for memory.
    pub request_spool_bytes: AtomicU64,
    /// Request bodies that went to a spool file (so far).
    pub requests_spooled: AtomicU64,
}

/// The answers (error codes) of requests refused before or instead of reaching a target for
/// breaking a rule or a limit, as `/metrics` labels them.
pub const REFUSAL_CODES: [&str; 11] = [
    "invalid_host",
    "invalid_framing",
    "unsupported_transfer_coding",
    "uri_too_long",
    "request_headers_too_large",
    "request_body_too_large",
    "client_body_timeout",
    "upstream_overloaded",
    "invalid_path",
    "rate_limited",
    "too_many_requests",
];

/// Upper bounds (seconds) of the request latency histogram buckets; the last is +Inf.
pub const LATENCY_BUCKETS: [f64; 14] = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    f64::INFINITY,
];

/// Requests of one route, carried across snapshots by route id: atomics, so recording takes no
/// lock.
#[derive(Debug, Default)]
pub struct RouteStats {
    /// By status class: index 0 for 1xx ... 4 for 5xx.
    responses: [AtomicU64; 5],
    /// Per bucket of [`LATENCY_BUCKETS`] (not cumulative).
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    latency_sum_micros: AtomicU64,
    /// Where the route's weighted backend schedule is.
    backend_cursor: Arc<AtomicU64>,
    /// Requests per backend label; only the control task locks it, to hand the counters out.
    backend_requests: std::sync::Mutex<HashMap<Arc<str>, Arc<AtomicU64>>>,
    /// Requests answered by the route's redirect.
    pub redirects: AtomicU64,
    pub mirror: MirrorStats,
    /// Requests refused by the route's `rate_limit` (429 `rate_limited`), across its changes.
    pub rate_limited: AtomicU64,
    /// Requests of the route in flight now, counted only under `max_in_flight`.
    pub in_flight: AtomicU64,
    /// Requests refused past `max_in_flight` (503 `too_many_requests`).
    pub in_flight_refused: AtomicU64,
    /// The route's key table, kept while its `rate_limit` is unchanged; only the control task
    /// locks it.
    limiter: std::sync::Mutex<Option<Arc<RateLimiter>>>,
    /// The outcomes of the route's canary by backend, kept while the route has a canary and
    /// the same number of backends; only the control task locks it.
    canary: std::sync::Mutex<Option<Arc<CanaryCounters>>>,
}

/// Copies of a route's requests sent to its mirror.
#[derive(Debug, Default)]
pub struct MirrorStats {
    /// Requests considered for a copy (`percent` counts them).
    pub seen: AtomicU64,
    pub sent: AtomicU64,
    /// Copies not made: too many out at once, or a body that streams.
    pub dropped: AtomicU64,
    pub in_flight: AtomicU64,
}

impl RouteStats {
    /// The limiter of `rate_limit`: the one built before while the limit is the same, so keys
    /// keep their state across the route's other changes.
    pub fn limiter_for(&self, rate_limit: Option<&RateLimit>) -> Option<Arc<RateLimiter>> {
        let mut kept = self
            .limiter
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(rate_limit) = rate_limit else {
            *kept = None;
            return None;
        };
        match kept.as_ref() {
            Some(limiter) if limiter.spec() == rate_limit => Some(limiter.clone()),
            _ => {
                let limiter = Arc::new(RateLimiter::new(rate_limit));
                *kept = Some(limiter.clone());
                Some(limiter)
            }
        }
    }

    /// The canary's counters for a route with `backends` backends: the ones built before while
    /// the number is the same, so no outcome is lost to a rebuild. None forgets them.
    pub fn canary_counters_for(&self, backends: Option<usize>) -> Option<Arc<CanaryCounters>> {
        let mut kept = self
            .canary
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let Some(backends) = backends else {
            *kept = None;
            return None;
        };
        match kept.as_ref() {
            Some(counters) if counters.backends() == backends => Some(counters.clone()),
            _ => {
                let counters = Arc::new(CanaryCounters::new(backends));
                *kept = Some(counters.clone());
                Some(counters)
            }
        }
    }

    /// The counter of requests sent to the backend `label`, the same one every snapshot.
    pub fn backend_requests(&self, label: &str) -> Arc<AtomicU64> {
        let mut counters = self
            .backend_requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(counter) = counters.get(label) {
            return counter.clone();
        }
        let counter = Arc::new(AtomicU64::new(0));
        counters.insert(label.into(), counter.clone());
        counter
    }

    /// One answered request: its status and the time to its response headers.
    pub fn record(&self, status: u16, elapsed: std::time::Duration) {
        let class = usize::from((status / 100).clamp(1, 5)) - 1;
        self.responses[class].fetch_add(1, Ordering::Relaxed);
        let seconds = elapsed.as_secs_f64();
        let bucket = LATENCY_BUCKETS
            .iter()
            .position(|&bound| seconds <= bound)
            .unwrap_or(LATENCY_BUCKETS.len() - 1);
        self.latency_buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }

    /// Responses by status class, `[1xx, 2xx, 3xx, 4xx, 5xx]`.
    pub fn responses(&self) -> [u64; 5] {
        std::array::from_fn(|class| self.responses[class].load(Ordering::Relaxed))
    }

    /// `(upper bound, count)` per bucket, not cumulative, and the sum of latencies in seconds.
    pub fn latency(&self) -> (Vec<(f64, u64)>, f64) {
        let buckets = LATENCY_BUCKETS
            .iter()
            .zip(&self.latency_buckets)
            .map(|(&bound, count)| (bound, count.load(Ordering::Relaxed)))
            .collect();
        let sum = self.latency_sum_micros.load(Ordering::Relaxed) as f64 / 1_000_000.0;
        (buckets, sum)
    }
}

/// A service with the targets its balancer picks from.
pub struct ServiceRuntime {
    pub service: Arc<Service>,
    /// `Host` sent upstream unless the route preserves the client's; None: the target's authority.
    pub upstream_host: Option<HeaderValue>,
    /// Aligned with the balancer's member indices.
    pub targets: Vec<TargetRuntime>,
    pub balancer: Balancer,
    pub counters: Arc<ServiceCounters>,
    /// Set while the service's targets come only from discovery sources none of which is
    /// healthy (pending, failing or stale): those sources with their states, e.g.
    /// `web-dns (pending)`, for the `discovery_unavailable` answer.
    pub discovery_gap: Option<Box<str>>,
    /// With `session_persistence`: the targets a cookie may name, draining ones included.
    pub sessions: Option<Box<SessionTargets>>,
    /// With `locality` on a gateway with `cluster.zone`: the zone's targets and whether they
    /// take the requests now.
    pub locality: Option<Box<ZoneSplit>>,
}

/// What a request brings to its pick besides the targets to skip: the target its session
/// cookie names, and its hash key's hash under a hashing policy.
#[derive(Debug, Clone, Copy, Default)]
pub struct Preference {
    pub pinned: Option<Id>,
    pub hash: Option<u64>,
}

/// How a target was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PickKind {
    /// An available target (not unhealthy, not ejected).
    Available,
    /// No tier had an available target only because of health or ejection: like Envoy's panic
    /// mode, the pick ignores them rather than fail every request.
    Panic,
}

/// A picked target. Keep it until the attempt's outcome is recorded: it may hold the target's
/// half-open trial, which the next request may only take once this one has its verdict.
#[derive(Debug)]
pub struct Pick<'a> {
    pub target: &'a TargetRuntime,
    /// One byte beside the target, so that a pick is a pair of scalars and returns in two
    /// registers; the target holds the health whose trial a drop ends.
    hold: Hold,
}

/// How a [`Pick`] chose its target, and whether it holds the target's half-open trial.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Available,
    /// Available, as its one trial after an ejection: ended when the pick is dropped.
    Trial,
    Panic,
}

impl<'a> Pick<'a> {
    fn open(target: &'a TargetRuntime) -> Pick<'a> {
        Pick {
            target,
            hold: Hold::Available,
        }
    }

    fn trial(target: &'a TargetRuntime, trial: Trial<'a>) -> Pick<'a> {
        trial.hand_over();
        Pick {
            target,
            hold: Hold::Trial,
        }
    }

    fn panic(target: &'a TargetRuntime) -> Pick<'a> {
        Pick {
            target,
            hold: Hold::Panic,
        }
    }

    pub fn kind(&self) -> PickKind {
        match self.hold {
            Hold::Available | Hold::Trial => PickKind::Available,
            Hold::Panic => PickKind::Panic,
        }
    }

    /// The request is the target's one trial after an ejection.
    pub fn is_trial(&self) -> bool {
        self.hold == Hold::Trial
    }
}

impl Drop for Pick<'_> {
    fn drop(&mut self) {
        if self.hold == Hold::Trial {
            self.target.health.end_trial();
        }
    }
}

/// Picks in a row that may lose a half-open target's trial to a concurrent request. Each loss
/// leaves that target unavailable to the next pick (its trial is in flight), so a second pick
/// nearly always succeeds; the bound keeps a pick O(1) however the races go, and a pick that
/// loses them all is treated as finding nothing available.
const TRIAL_RACES: usize = 4;

impl ServiceRuntime {
    /// Picks a target for a new request or connection; `skip` excludes ones already tried.
    /// Without `allow_panic` (a retry), only available targets are picked.
    ///
    /// A half-open target (its ejection over, not yet proven) is available only while no trial
    /// is in flight, and the pick that chooses it carries the trial. Panic picks ignore
    /// ejection and so trials too: when nothing is available the target in a trial is as good
    /// a choice as an ejected one, and such a pick holds no trial.
    #[inline]
    pub fn pick(
        &self,
        skip: impl Fn(&TargetRuntime) -> bool,
        allow_panic: bool,
    ) -> Option<Pick<'_>> {
        self.pick_in(None, skip, allow_panic)
    }

    /// The target a session cookie names, when it still takes the session's requests: in
    /// rotation or draining, of `subset` when given, not skipped, available (its half-open
    /// trial is claimed as a pick's would be).
    pub fn pinned(
        &self,
        id: Id,
        subset: Option<&Subset>,
        skip: impl Fn(&TargetRuntime) -> bool,
    ) -> Option<Pick<'_>> {
        let target = self.session_target(id, subset)?;
        let clock = LazyClock::default();
        if skip(target) || !target.health.is_available(|| clock.now()) {
            return None;
        }
        match target.health.admit(|| clock.now()) {
            Admission::Open => Some(Pick::open(target)),
            Admission::Trial(trial) => Some(Pick::trial(target, trial)),
            Admission::Refused => None,
        }
    }

    /// Whether the target a session cookie names would take the session now (in rotation or
    /// draining, of `subset` when given, available), without claiming anything.
    pub fn takes_session(&self, id: Id, subset: Option<&Subset>) -> bool {
        self.session_target(id, subset)
            .is_some_and(|target| target.health.is_available(unix_ms))
    }

    /// The target with this id among those a session may reach: in rotation or draining, and
    /// of `subset` when given.
    fn session_target(&self, id: Id, subset: Option<&Subset>) -> Option<&TargetRuntime> {
        let sessions = self.sessions.as_deref()?;
        match sessions.place(id)? {
            Place::InRotation(index) => {
                let index = index as usize;
                let outside = subset.is_some_and(|subset| !subset.contains(index));
                (!outside).then(|| &self.targets[index])
            }
            Place::Draining(index) => {
                let target = &sessions.draining[index as usize];
                let outside = subset.is_some_and(|subset| !subset.selects(&target.spec.metadata));
                (!outside).then_some(target)
            }
        }
    }

    /// [`ServiceRuntime::pick_in`] honouring `preference`: the pinned target while it takes
    /// the session, else the hash key's choice under a hashing policy, else the policy's.
    pub fn pick_preferring(
        &self,
        subset: Option<&Subset>,
        preference: Preference,
        skip: impl Fn(&TargetRuntime) -> bool,
        allow_panic: bool,
    ) -> Option<Pick<'_>> {
        if let Some(pick) = preference
            .pinned
            .and_then(|id| self.pinned(id, subset, &skip))
        {
            return Some(pick);
        }
        match preference.hash {
            Some(hash) if self.service.lb_policy.is_hashing() => {
                self.pick_hashed(subset, hash, skip, allow_panic)
            }
            _ => self.pick_in(subset, skip, allow_panic),
        }
    }

    /// A consistent-hash pick: the key's target, or its next choice past unavailable ones and,
    /// with `hash_balance_factor`, loaded ones. Panic picks keep the key's order too.
    fn pick_hashed(
        &self,
        subset: Option<&Subset>,
        hash: u64,
        skip: impl Fn(&TargetRuntime) -> bool,
        allow_panic: bool,
    ) -> Option<Pick<'_>> {
        let bound = self
            .service
            .hash_balance_factor
            .map(|factor_percent| LoadBound {
                factor_percent,
                in_flight: self.counters.in_flight.load(Ordering::Relaxed),
            });
        self.pick_by(subset, ByHash(hash, bound), skip, allow_panic)
    }

    /// Whether some target (of `subset`, when given) is available now. Moves no cursor.
    pub fn has_available(&self, subset: Option<&Subset>) -> bool {
        let clock = LazyClock::default();
        let (balancer, members) = self.members(subset);
        balancer
            .pick_random(|index| {
                !self.targets[target_index(members, index)]
                    .health
                    .is_available(|| clock.now())
            })
            .is_some()
    }

    fn members<'a>(&'a self, subset: Option<&'a Subset>) -> (&'a Balancer, Option<&'a [u32]>) {
        match subset {
            Some(subset) => (&subset.balancer, Some(&subset.members)),
            None => (&self.balancer, None),
        }
    }

    /// [`ServiceRuntime::pick`] among the targets of `subset` (all targets when None).
    #[inline]
    pub fn pick_in(
        &self,
        subset: Option<&Subset>,
        skip: impl Fn(&TargetRuntime) -> bool,
        allow_panic: bool,
    ) -> Option<Pick<'_>> {
        self.pick_by(subset, ByPolicy, skip, allow_panic)
    }

    /// A pick by `choice` among the targets of `subset` (all when None): an available target,
    /// claiming a half-open one's trial (a lost race picks again, up to [`TRIAL_RACES`]); else,
    /// when allowed, a panic pick that ignores health and ejection but not `skip`.
    ///
    /// Without a subset, a zone split in force narrows the pick to the zone's targets first; when
    /// none of them is available (the control task has not looked since), the pick is over
    /// every zone, as without locality. A subset's pick ignores locality.
    #[inline]
    fn pick_by(
        &self,
        subset: Option<&Subset>,
        choice: impl Choice,
        skip: impl Fn(&TargetRuntime) -> bool,
        allow_panic: bool,
    ) -> Option<Pick<'_>> {
        let split = self.locality.as_deref().filter(|_| subset.is_none());
        if let Some(split) = split {
            if let Some((balancer, members)) = split.in_force() {
                if let Some(pick) = self.pick_among(balancer, Some(members), choice, &skip, false) {
                    self.counters.zone_picks.fetch_add(1, Ordering::Relaxed);
                    return Some(pick);
                }
            }
        }
        let (balancer, members) = self.members(subset);
        let pick = self.pick_among(balancer, members, choice, &skip, allow_panic);
        if split.is_some() && pick.is_some() {
            self.counters.all_zone_picks.fetch_add(1, Ordering::Relaxed);
        }
        pick
    }

    /// A pick by `choice` among `members` (all targets when None) through their `balancer`.
    ///
    /// Straight-line for the common case (an available target, no ejection met); the rest is
    /// out of line, so that the compiler hoists nothing of it into every pick.
    fn pick_among(
        &self,
        balancer: &Balancer,
        members: Option<&[u32]>,
        choice: impl Choice,
        skip: &impl Fn(&TargetRuntime) -> bool,
        allow_panic: bool,
    ) -> Option<Pick<'_>> {
        let candidates = Candidates {
            targets: &self.targets,
            members,
            skip,
        };
        let clock = LazyClock::default();
        let chosen = candidates.choose(balancer, choice, &clock);
        // The balancer returns only a target `available` passed, and `available` reads the
        // clock for every target with an ejection recorded. Unread, the chosen target had none
        // when the pick looked: no trial to claim, and `admit` would only load the same word
        // again. (Ejected since, it goes as a request picked a moment earlier would.)
        match chosen {
            Some(index) if !clock.was_read() => Some(Pick::open(candidates.at(index))),
            _ => self.pick_past_gate(candidates, balancer, choice, chosen, &clock, allow_panic),
        }
    }

    /// The rest of [`ServiceRuntime::pick_among`] after its first choice (`chosen`), when that
    /// met an ejection or found nothing: the gate lets the request through to the chosen target,
    /// as its trial when it is half-open; a trial lost to a concurrent request picks again, up
    /// to [`TRIAL_RACES`] picks in all. When they find nothing, a panic pick if allowed.
    #[cold]
    #[inline(never)]
    fn pick_past_gate<'t>(
        &self,
        candidates: Candidates<'t, '_, impl Fn(&TargetRuntime) -> bool>,
        balancer: &Balancer,
        choice: impl Choice,
        mut chosen: Option<usize>,
        clock: &LazyClock,
        allow_panic: bool,
    ) -> Option<Pick<'t>> {
        let mut picks = 1;
        while let Some(index) = chosen {
            let target = candidates.at(index);
            match target.health.admit(|| clock.now()) {
                Admission::Open => return Some(Pick::open(target)),
                Admission::Trial(trial) => return Some(Pick::trial(target, trial)),
                Admission::Refused if picks == TRIAL_RACES => break,
                Admission::Refused => {
                    picks += 1;
                    chosen = candidates.choose(balancer, choice, clock);
                }
            }
        }
        if !allow_panic {
            return None;
        }
        let skipped = |index: usize| (candidates.skip)(candidates.at(index));
        let index = choice.choose_in_panic(balancer, skipped)?;
        self.counters.panic_picks.fetch_add(1, Ordering::Relaxed);
        Some(Pick::panic(candidates.at(index)))
    }
}

/// The targets a pick chooses among, by the numbers their balancer gives them.
struct Candidates<'t, 'c, S> {
    targets: &'t [TargetRuntime],
    /// The targets' indices by balancer member (None: the same numbers).
    members: Option<&'c [u32]>,
    /// Targets this request may not have (already tried).
    skip: &'c S,
}

impl<S> Clone for Candidates<'_, '_, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Candidates<'_, '_, S> {}

impl<'t, S: Fn(&TargetRuntime) -> bool> Candidates<'t, '_, S> {
    fn at(self, index: usize) -> &'t TargetRuntime {
        &self.targets[target_index(self.members, index)]
    }

    /// One balancer pick by `choice` of a target not skipped and available now.
    #[inline]
    fn choose(self, balancer: &Balancer, choice: impl Choice, clock: &LazyClock) -> Option<usize> {
        choice.choose(balancer, move |index: usize| {
            let target = self.at(index);
            (self.skip)(target) || !target.health.is_available(|| clock.now())
        })
    }
}

/// How [`ServiceRuntime::pick_by`] chooses among available targets: a type for each way, so
/// that a policy's pick is compiled without the hashed one's code and state.
trait Choice: Copy {
    /// One member that `unavailable` does not rule out.
    fn choose(self, balancer: &Balancer, unavailable: impl Fn(usize) -> bool) -> Option<usize>;

    /// A panic pick: one member that `skipped` does not rule out, health and ejection ignored.
    fn choose_in_panic(self, balancer: &Balancer, skipped: impl Fn(usize) -> bool)
        -> Option<usize>;
}

/// The service's policy (round robin for a hashing policy without a key).
#[derive(Clone, Copy)]
struct ByPolicy;

impl Choice for ByPolicy {
    fn choose(self, balancer: &Balancer, unavailable: impl Fn(usize) -> bool) -> Option<usize> {
        balancer.pick(unavailable)
    }

    /// Weighted random, so that panic picks do not bend the round-robin rotation.
    fn choose_in_panic(
        self,
        balancer: &Balancer,
        skipped: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        balancer.pick_random(skipped)
    }
}

/// A consistent-hash pick for a key's hash, with the bounded load when configured.
#[derive(Clone, Copy)]
struct ByHash(u64, Option<LoadBound>);

impl Choice for ByHash {
    fn choose(self, balancer: &Balancer, unavailable: impl Fn(usize) -> bool) -> Option<usize> {
        balancer.pick_hashed(self.0, self.1, unavailable)
    }

    /// The key's order, as its ordinary pick has, without the load bound.
    fn choose_in_panic(
        self,
        balancer: &Balancer,
        skipped: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        balancer.pick_hashed(self.0, None, skipped)
    }
}

/// The wall clock in ms, read at most once per pick and only when some target has an
/// ejection to compare with it.
#[derive(Default)]
struct LazyClock(std::cell::Cell<u64>);

impl LazyClock {
    fn now(&self) -> u64 {
        if self.0.get() == 0 {
            self.0.set(unix_ms());
        }
        self.0.get()
    }

    /// Whether [`LazyClock::now`] was called. Also false if it read 0 (a clock before 1970),
    /// when no ejection has ended, so no target can be half-open.
    fn was_read(&self) -> bool {
        self.0.get() != 0
    }
}

/// A balancer member's index as an index into the service's targets.
fn target_index(members: Option<&[u32]>, index: usize) -> usize {
    match members {
        Some(members) => members[index] as usize,
        None => index,
    }
}

/// A route with its services resolved and its conditions compiled.
pub struct RouteEntry {
    pub route: Arc<Route>,
    pub backends: Backends,
    /// Where copies go, when the route has a mirror.
    pub mirror: Option<BackendRuntime>,
    pub stats: Arc<RouteStats>,
    /// The route's `rate_limit`, compiled.
    pub limiter: Option<Arc<RateLimiter>>,
    /// Where the outcomes of a canary route's requests are counted, by backend position.
    pub canary: Option<Arc<CanaryCounters>>,
    compiled: Arc<CompiledRoute>,
}

/// What a route tests and does, compiled once and shared by every rebuild of its entry.
struct CompiledRoute {
    methods: Vec<Method>,
    conditions: Conditions,
    path_regex: Option<regex::Regex>,
    request_headers: Option<CompiledHeaderFilter>,
    response_headers: Option<CompiledHeaderFilter>,
}

impl RouteEntry {
    /// Resolves the route's services in `services`; None when one is missing (the store
    /// forbids it, so only a route outliving its service in a rebuild).
    fn resolve(
        route: Arc<Route>,
        compiled: Arc<CompiledRoute>,
        services: &HashMap<Id, Arc<ServiceRuntime>>,
        stats: Arc<RouteStats>,
    ) -> Option<RouteEntry> {
        let canary_weights = match (&route.canary, &route.canary_status) {
            (Some(canary), Some(status)) => {
                Some(canary_weights(&route.backends, canary, status.weight))
            }
            _ => None,
        };
        let mut backends = Vec::with_capacity(route.backends.len());
        for (index, backend) in route.backends.iter().enumerate() {
            let service = services.get(&backend.service_id)?.clone();
            let mut runtime =
                BackendRuntime::new(service, backend, |label| stats.backend_requests(label));
            if let Some(weights) = &canary_weights {
                runtime.weight = weights[index];
            }
            backends.push(runtime);
        }
        let mirror = match &route.mirror {
            Some(mirror) => Some(BackendRuntime::new(
                services.get(&mirror.service_id)?.clone(),
                &crate::model::Backend::whole(mirror.service_id),
                |_| Arc::default(),
            )),
            None => None,
        };
        Some(RouteEntry {
            backends: Backends::new(backends, stats.backend_cursor.clone()),
            limiter: stats.limiter_for(route.rate_limit.as_ref()),
            canary: stats.canary_counters_for(route.canary.as_ref().map(|_| route.backends.len())),
            mirror,
            compiled,
            stats,
            route,
        })
    }

    /// The same route and statistics, resolved again in `services` (some of its services
    /// were rebuilt).
    fn with_services(&self, services: &HashMap<Id, Arc<ServiceRuntime>>) -> Option<RouteEntry> {
        RouteEntry::resolve(
            self.route.clone(),
            self.compiled.clone(),
            services,
            self.stats.clone(),
        )
    }

    /// The first backend's service: the route's own when it has one backend.
    pub fn service(&self) -> Option<&Arc<ServiceRuntime>> {
        self.backends.first().map(|backend| &backend.service)
    }

    pub fn request_headers(&self) -> Option<&CompiledHeaderFilter> {
        self.compiled.request_headers.as_ref()
    }

    pub fn response_headers(&self) -> Option<&CompiledHeaderFilter> {
        self.compiled.response_headers.as_ref()
    }

    /// The method and every header, query and cookie condition hold.
    fn accepts(&self, request: &RequestView<'_>) -> bool {
        (self.compiled.methods.is_empty() || self.compiled.methods.contains(request.method))
            && self.compiled.conditions.hold_for(request)
    }

    /// Among routes equal by host and path, the first by this key wins (TRAFFIC.md §3).
    fn precedence(&self) -> impl Ord {
        (
            std::cmp::Reverse(self.route.priority),
            std::cmp::Reverse(!self.compiled.methods.is_empty()),
            std::cmp::Reverse(self.compiled.conditions.header_and_cookie_count()),
            std::cmp::Reverse(self.compiled.conditions.query_count()),
            self.route.id,
        )
    }

    /// The upstream path after `strip_prefix`, always starting with `/`.
    pub fn upstream_path<'a>(&self, path: &'a str) -> std::borrow::Cow<'a, str> {
        let Some(prefix) = self
            .route
            .path_prefix
            .as_deref()
            .filter(|_| self.route.strip_prefix)
        else {
            return path.into();
        };
        let prefix = prefix.trim_end_matches('/');
        let rest = path.get(prefix.len()..).unwrap_or("");
        if rest.starts_with('/') {
            rest.into()
        } else {
            format!("/{rest}").into()
        }
    }
}

impl CompiledRoute {
    fn compile(route: &Route) -> Result<CompiledRoute, String> {
        let path_regex = route
            .path_regex
            .as_deref()
            .map(|pattern| {
                crate::model::whole_value_regex(pattern)
                    .map_err(|reason| format!("path_regex: {reason}"))
            })
            .transpose()?;
        Ok(CompiledRoute {
            methods: route
                .methods
                .iter()
                .filter_map(|m| Method::from_bytes(m.as_bytes()).ok())
                .collect(),
            conditions: Conditions::compile(route)?,
            path_regex,
            request_headers: route
                .request_headers
                .as_ref()
                .map(CompiledHeaderFilter::compile)
                .transpose()?,
            response_headers: route
                .response_headers
                .as_ref()
                .map(CompiledHeaderFilter::compile)
                .transpose()?,
        })
    }
}

/// A path matches a prefix on whole segments: `/api` matches `/api` and `/api/x`, not `/apix`.
pub fn path_has_prefix(path: &str, prefix: &str) -> bool {
    if prefix.ends_with('/') {
        return path.starts_with(prefix);
    }
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

/// The routes of one host class by path: exact paths, then prefixes, then regexes (TRAFFIC.md
/// §3). A lookup tries the exact path, then the request path's own prefixes at segment
/// boundaries, longest first, so it costs O(path segments) hash lookups however many routes
/// there are, plus the regex routes of the host class when nothing else matched.
#[derive(Default)]
struct PathIndex {
    /// Positions in the snapshot's route entries; each list in precedence order.
    // foldhash, not SipHash: every request hashes its host and each prefix of its path. The
    // keys are the operator's; a client only chooses what is looked up.
    exact: HashMap<String, Vec<u32>>,
    by_prefix: HashMap<String, Vec<u32>>,
    regex: Vec<u32>,
}

impl PathIndex {
    fn insert(&mut self, position: u32, route: &Route) {
        if let Some(exact) = &route.path_exact {
            self.exact.entry(exact.clone()).or_default().push(position);
        } else if route.path_regex.is_some() {
            self.regex.push(position);
        } else if let Some(prefix) = &route.path_prefix {
            self.by_prefix
                .entry(prefix.clone())
                .or_default()
                .push(position);
        }
    }

    fn sort(&mut self, entries: &[Arc<RouteEntry>]) {
        let key = |position: &u32| entries[*position as usize].precedence();
        for list in self
            .exact
            .values_mut()
            .chain(self.by_prefix.values_mut())
            .chain(std::iter::once(&mut self.regex))
        {
            list.sort_by_cached_key(key);
        }
    }

    fn find<'a>(
        &self,
        entries: &'a [Arc<RouteEntry>],
        path: &str,
        request: &RequestView<'_>,
    ) -> Option<&'a Arc<RouteEntry>> {
        let first_accepting = |positions: &[u32]| {
            positions
                .iter()
                .filter_map(|position| entries.get(*position as usize))
                .find(|entry| entry.accepts(request))
        };
        if !self.exact.is_empty() {
            if let Some(found) = self.exact.get(path).and_then(|list| first_accepting(list)) {
                return Some(found);
            }
        }
        if !self.by_prefix.is_empty() {
            let found = prefix_candidates(path)
                .find_map(|prefix| first_accepting(self.by_prefix.get(prefix)?));
            if found.is_some() {
                return found;
            }
        }
        self.regex
            .iter()
            .filter_map(|position| entries.get(*position as usize))
            .find(|entry| {
                entry
                    .compiled
                    .path_regex
                    .as_ref()
                    .is_some_and(|regex| regex.is_match(path))
                    && entry.accepts(request)
            })
    }
}

/// The prefixes a route may have to match `path` on whole segments, longest first: the path
/// itself, then at each `/` from the end the part up to and including it and the part before it.
/// `/api/v1` gives `/api/v1`, `/api/`, `/api`, `/`.
fn prefix_candidates(path: &str) -> impl Iterator<Item = &str> {
    let slashes = path
        .char_indices()
        .rev()
        .filter(|&(_, c)| c == '/')
        .map(|(index, _)| index);
    std::iter::once(path).chain(slashes.flat_map(move |index| {
        let with_slash = &path[..=index];
        let without = (index > 0).then(|| &path[..index]);
        std::iter::once(with_slash).chain(without)
    }))
}

/// Routes indexed by host: exact names, `*.suffix` wildcards, and routes for any host. It holds
/// positions, not entries, so a generation whose routes did not change shares it with the one
/// before and only swaps the entries of the services that changed.
#[derive(Default)]
struct RouteTable {
    exact: HashMap<String, PathIndex>,
    /// Keyed by the suffix with its dot: `*.example.com` → `.example.com`.
    wildcard: HashMap<String, PathIndex>,
    any_host: PathIndex,
    /// The positions of each service's routes, to re-resolve them when the service changes.
    by_service: HashMap<Id, Vec<u32>>,
}

impl RouteTable {
    fn build(entries: &[Arc<RouteEntry>]) -> RouteTable {
        let mut table = RouteTable::default();
        for (position, entry) in entries.iter().enumerate() {
            let position = u32::try_from(position).expect("fewer than 2^32 routes");
            let route = &entry.route;
            let mut services: Vec<Id> = route.service_ids().collect();
            services.sort_unstable();
            services.dedup();
            for service in services {
                table.by_service.entry(service).or_default().push(position);
            }
            if route.hosts.is_empty() {
                table.any_host.insert(position, route);
            }
            for host in &route.hosts {
                let host = host.to_ascii_lowercase();
                match host.strip_prefix('*') {
                    Some(suffix) => table
                        .wildcard
                        .entry(suffix.to_owned())
                        .or_default()
                        .insert(position, route),
                    None => table.exact.entry(host).or_default().insert(position, route),
                }
            }
        }
        for index in table
            .exact
            .values_mut()
            .chain(table.wildcard.values_mut())
            .chain(std::iter::once(&mut table.any_host))
        {
            index.sort(entries);
        }
        table
    }

    /// Exact host first, then the longest matching wildcard, then routes for any host.
    fn find<'a>(
        &self,
        entries: &'a [Arc<RouteEntry>],
        host: &str,
        path: &str,
        request: &RequestView<'_>,
    ) -> Option<&'a Arc<RouteEntry>> {
        if let Some(found) = self
            .exact
            .get(host)
            .and_then(|index| index.find(entries, path, request))
        {
            return Some(found);
        }
        if !self.wildcard.is_empty() {
            // `a.b.example.com` tries `.b.example.com`, then `.example.com`, then `.com`.
            let suffixes = host
                .char_indices()
                .filter(|&(at, c)| c == '.' && at > 0)
                .map(|(at, _)| &host[at..]);
            for suffix in suffixes {
                if let Some(found) = self
                    .wildcard
                    .get(suffix)
                    .and_then(|index| index.find(entries, path, request))
                {
                    return Some(found);
                }
            }
        }
        self.any_host.find(entries, path, request)
    }
}

pub struct Snapshot {
    pub generation: u64,
    services: HashMap<Id, Arc<ServiceRuntime>>,
    routes: Arc<RouteTable>,
    /// Every route once, with its service resolved; `routes` holds positions in it.
    route_entries: Vec<Arc<RouteEntry>>,
    streams: Arc<StreamTable>,
}

/// What a new generation changes; everything else is shared with the generation before.
#[derive(Default)]
pub struct SnapshotChange {
    /// Services built anew (Some) or deleted (None).
    pub services: Vec<(Id, Option<ServiceRuntime>)>,
    /// Every route, when routes changed.
    pub routes: Option<Vec<Arc<Route>>>,
    /// Every stream route, when stream routes changed.
    pub stream_routes: Option<Vec<StreamRoute>>,
}

impl Snapshot {
    pub fn empty() -> Snapshot {
        Snapshot {
            generation: 0,
            services: HashMap::new(),
            routes: Arc::default(),
            route_entries: Vec::new(),
            streams: Arc::default(),
        }
    }

    /// Assembles a snapshot with fresh route statistics; routes whose service is missing are
    /// left out.
    pub fn new(
        generation: u64,
        services: Vec<ServiceRuntime>,
        routes: Vec<impl Into<Arc<Route>>>,
    ) -> Snapshot {
        Snapshot::with_route_stats(generation, services, routes, |_| Arc::default())
    }

    /// Like [`Snapshot::new`], taking each route's statistics from `stats_of(route id)` so they
    /// outlive the snapshot.
    pub fn with_route_stats(
        generation: u64,
        services: Vec<ServiceRuntime>,
        routes: Vec<impl Into<Arc<Route>>>,
        stats_of: impl FnMut(Id) -> Arc<RouteStats>,
    ) -> Snapshot {
        let services: HashMap<Id, Arc<ServiceRuntime>> = services
            .into_iter()
            .map(|runtime| (runtime.service.id, Arc::new(runtime)))
            .collect();
        let route_entries = resolve_routes(routes, &services, stats_of);
        Snapshot {
            generation,
            services,
            routes: Arc::new(RouteTable::build(&route_entries)),
            route_entries,
            streams: Arc::default(),
        }
    }

    /// Adds the L4 stream routes, each with its statistics from `stats_of(route id)`.
    pub fn with_stream_routes(
        mut self,
        routes: &[StreamRoute],
        stats_of: impl FnMut(Id) -> Arc<StreamStats>,
    ) -> Snapshot {
        self.streams = Arc::new(StreamTable::build(routes, &self.services, stats_of));
        self
    }

    /// The next generation: `change` applied, everything it leaves alone shared with this one.
    /// Its cost grows with what changed (plus one pointer copy per service and route), not with
    /// the number of targets. Route and stream statistics come from `route_stats_of` and
    /// `stream_stats_of` for routes that are new to it.
    pub fn next(
        &self,
        generation: u64,
        change: SnapshotChange,
        mut route_stats_of: impl FnMut(Id) -> Arc<RouteStats>,
        stream_stats_of: impl FnMut(Id) -> Arc<StreamStats>,
    ) -> Snapshot {
        let mut services = self.services.clone();
        let mut changed = Vec::with_capacity(change.services.len());
        for (id, runtime) in change.services {
            changed.push(id);
            match runtime {
                Some(runtime) => services.insert(id, Arc::new(runtime)),
                None => services.remove(&id),
            };
        }
        let (routes, route_entries) = match change.routes {
            Some(routes) => {
                let entries = resolve_routes(routes, &services, route_stats_of);
                (Arc::new(RouteTable::build(&entries)), entries)
            }
            None => {
                let mut entries = self.route_entries.clone();
                let mut orphaned = false;
                let mut positions: Vec<u32> = changed
                    .iter()
                    .filter_map(|id| self.routes.by_service.get(id))
                    .flatten()
                    .copied()
                    .collect();
                positions.sort_unstable();
                positions.dedup();
                for position in positions {
                    let slot = &mut entries[position as usize];
                    match slot.with_services(&services) {
                        Some(entry) => *slot = Arc::new(entry),
                        None => orphaned = true,
                    }
                }
                if orphaned {
                    // A route outlived its service (the store forbids it): leave it out, as a
                    // full build would.
                    let routes = entries.iter().map(|entry| entry.route.clone()).collect();
                    let entries = resolve_routes(routes, &services, |id| {
                        self.route_stats(id).unwrap_or_else(|| route_stats_of(id))
                    });
                    (Arc::new(RouteTable::build(&entries)), entries)
                } else {
                    (self.routes.clone(), entries)
                }
            }
        };
        let streams_touched = change.stream_routes.is_some()
            || self
                .streams
                .routes()
                .any(|entry| changed.contains(&entry.route.service_id));
        let streams = if streams_touched {
            let routes = change.stream_routes.unwrap_or_else(|| {
                self.streams
                    .routes()
                    .map(|entry| entry.route.clone())
                    .collect()
            });
            Arc::new(StreamTable::build(&routes, &services, stream_stats_of))
        } else {
            self.streams.clone()
        };
        Snapshot {
            generation,
            services,
            routes,
            route_entries,
            streams,
        }
    }

    fn route_stats(&self, route_id: Id) -> Option<Arc<RouteStats>> {
        self.route_entries
            .iter()
            .find(|entry| entry.route.id == route_id)
            .map(|entry| entry.stats.clone())
    }

    pub fn streams(&self) -> &StreamTable {
        &self.streams
    }

    /// `host` must be lower case and without port.
    pub fn find_route(
        &self,
        host: &str,
        path: &str,
        request: &RequestView<'_>,
    ) -> Option<&Arc<RouteEntry>> {
        self.routes.find(&self.route_entries, host, path, request)
    }

    pub fn service(&self, id: Id) -> Option<&Arc<ServiceRuntime>> {
        self.services.get(&id)
    }

    pub fn services(&self) -> impl Iterator<Item = &Arc<ServiceRuntime>> {
        self.services.values()
    }

    /// Every route once (a route with several hosts is indexed several times).
    pub fn routes(&self) -> Vec<&Arc<RouteEntry>> {
        self.route_entries.iter().collect()
    }
}

/// Resolves each route's services and compiles its conditions, in id order; a route whose
/// service is missing, or that cannot be compiled, is left out.
fn resolve_routes(
    routes: Vec<impl Into<Arc<Route>>>,
    services: &HashMap<Id, Arc<ServiceRuntime>>,
    mut stats_of: impl FnMut(Id) -> Arc<RouteStats>,
) -> Vec<Arc<RouteEntry>> {
    let mut routes: Vec<Arc<Route>> = routes.into_iter().map(Into::into).collect();
    routes.sort_by_key(|route| route.id);
    // Into a vector of their own: collected in place, the entries (a pointer each) would keep
    // the routes' buffer (a `Route` is 144 pointers wide) for as long as the snapshot lives.
    let mut entries = Vec::with_capacity(routes.len());
    entries.extend(routes.into_iter().filter_map(|mut route| {
        if !normalize_prefix(&mut route) {
            return None;
        }
        let compiled = match CompiledRoute::compile(&route) {
            Ok(compiled) => Arc::new(compiled),
            Err(reason) => {
                tracing::warn!(route = route.id, name = %route.name, "route left out: {reason}");
                return None;
            }
        };
        let stats = stats_of(route.id);
        RouteEntry::resolve(route, compiled, services, stats).map(Arc::new)
    }));
    entries
}

/// Puts a route's prefix in the normal form request paths are matched in; false when it has
/// none. The API stores prefixes normalised; one stored before it did is normalised here, and
/// one that has no normal form (it climbs above the root, or has a malformed escape) could
/// match no request: the route is left out, and said so.
fn normalize_prefix(route: &mut Arc<Route>) -> bool {
    let Some(prefix) = &route.path_prefix else {
        return true;
    };
    match path::normalize(prefix, EscapedSlashes::Keep) {
        Ok(Cow::Borrowed(_)) => true,
        Ok(Cow::Owned(normal)) => {
            // A copy only for a route whose prefix changes: the rest share the desired state's.
            Arc::make_mut(route).path_prefix = Some(normal);
            true
        }
        Err(error) => {
            tracing::warn!(
                route = route.id,
                name = %route.name,
                path_prefix = %prefix,
                "route left out: its path_prefix {}",
                error.reason()
            );
            false
        }
    }
}

/// Shared access to the current snapshot. Cloning is cheap; every clone sees the same table.
#[derive(Clone)]
pub struct SnapshotHandle {
    current: Arc<ArcSwap<Snapshot>>,
}

impl SnapshotHandle {
    pub fn new(initial: Snapshot) -> SnapshotHandle {
        SnapshotHandle {
            current: Arc::new(ArcSwap::from_pointee(initial)),
        }
    }

    /// Lock-free; drop the guard before awaiting.
    pub fn load(&self) -> Guard<Arc<Snapshot>> {
        self.current.load()
    }

    /// An owned reference, for readers that keep it across awaits (not the request path).
    pub fn load_full(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// Only the control task publishes.
    pub fn publish(&self, snapshot: Snapshot) {
        self.current.store(Arc::new(snapshot));
    }
}

/// `host:port` for a URI authority, with IPv6 literals in brackets.
pub fn authority_text(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod precedence_tests;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{LbPolicy, Protocol, Timeouts};

    pub(super) fn service(id: Id) -> ServiceRuntime {
        ServiceRuntime {
            service: Arc::new(Service {
                limits: crate::model::UpstreamLimits::default(),
                id,
                name: format!("s{id}"),
                protocol: Protocol::Http,
                upstream_authority: None,
                tls_sni: None,
                tls_verify: true,
                tls_ca_pem: None,
                lb_policy: LbPolicy::RoundRobin,
                hash_on: None,
                hash_balance_factor: None,
                session_persistence: None,
                locality: None,
                timeouts: Timeouts::default(),
                max_attempts: 3,
                health_check: None,
                ejection: Default::default(),
                managed_by: None,
                created_at: crate::clock::now(),
                updated_at: crate::clock::now(),
            }),
            upstream_host: None,
            targets: Vec::new(),
            balancer: Balancer::new(LbPolicy::RoundRobin, Vec::new()),
            counters: Default::default(),
            discovery_gap: None,
            sessions: None,
            locality: None,
        }
    }

    pub(super) fn route(
        id: Id,
        hosts: &[&str],
        prefix: &str,
        methods: &[&str],
        priority: i32,
    ) -> Route {
        Route {
            id,
            name: format!("r{id}"),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            path_prefix: Some(prefix.to_owned()),
            methods: methods.iter().map(|m| m.to_string()).collect(),
            service_id: Some(1),
            backends: vec![crate::model::Backend::whole(1)],
            priority,
            request_buffer_bytes: crate::model::DEFAULT_REQUEST_BUFFER_BYTES,
            upgrades: crate::model::default_upgrades(),
            created_at: crate::clock::now(),
            updated_at: crate::clock::now(),
            ..Route::default()
        }
    }

    /// A request with no header or query conditions to meet.
    pub(super) fn plain(method: &Method) -> RequestView<'_> {
        static NO_HEADERS: std::sync::LazyLock<http::HeaderMap> =
            std::sync::LazyLock::new(http::HeaderMap::new);
        RequestView {
            method,
            headers: &NO_HEADERS,
            query: None,
        }
    }

    fn found(snapshot: &Snapshot, host: &str, path: &str, method: Method) -> Option<Id> {
        snapshot
            .find_route(host, path, &plain(&method))
            .map(|entry| entry.route.id)
    }

    #[test]
    fn prefix_matches_whole_segments() {
        assert!(path_has_prefix("/api", "/api"));
        assert!(path_has_prefix("/api/x", "/api"));
        assert!(!path_has_prefix("/apix", "/api"));
        assert!(path_has_prefix("/api/x", "/api/"));
        assert!(!path_has_prefix("/api", "/api/"));
        assert!(path_has_prefix("/anything", "/"));
    }

    #[test]
    fn route_entries_keep_no_room_for_the_routes_they_came_from() {
        let routes: Vec<Route> = (1..=100).map(|id| route(id, &[], "/", &[], 0)).collect();
        let snapshot = Snapshot::new(1, vec![service(1)], routes);
        assert_eq!(snapshot.route_entries.len(), 100);
        assert_eq!(
            snapshot.route_entries.capacity(),
            100,
            "a pointer per route, not the buffer of the routes"
        );
    }

    #[test]
    fn route_entries_share_their_routes_unless_a_prefix_is_normalised() {
        let plain = Arc::new(route(1, &[], "/api", &[], 0));
        let dotted = Arc::new(route(2, &[], "/a/./b", &[], 0));
        let snapshot = Snapshot::new(1, vec![service(1)], vec![plain.clone(), dotted.clone()]);
        let entry = |id| {
            snapshot
                .route_entries
                .iter()
                .find(|entry| entry.route.id == id)
                .unwrap()
        };
        assert!(Arc::ptr_eq(&entry(1).route, &plain), "no copy of route 1");
        assert!(!Arc::ptr_eq(&entry(2).route, &dotted));
        assert_eq!(entry(2).route.path_prefix.as_deref(), Some("/a/b"));
        assert_eq!(
            dotted.path_prefix.as_deref(),
            Some("/a/./b"),
            "the original is left as given"
        );
    }

    #[test]
    fn exact_host_then_wildcard_then_any() {
        let snapshot = Snapshot::new(
            1,
            vec![service(1)],
            vec![
                route(1, &[], "/", &[], 0),
                route(2, &["*.example.com"], "/", &[], 0),
                route(3, &["api.example.com"], "/", &[], 0),
                route(4, &["*.eu.example.com"], "/", &[], 0),
            ],
        );
        assert_eq!(
            found(&snapshot, "api.example.com", "/", Method::GET),
            Some(3)
        );
        assert_eq!(
            found(&snapshot, "www.example.com", "/", Method::GET),
            Some(2)
        );
        assert_eq!(
            found(&snapshot, "a.eu.example.com", "/", Method::GET),
            Some(4)
        );
        assert_eq!(found(&snapshot, "example.com", "/", Method::GET), Some(1));
        assert_eq!(found(&snapshot, "other.org", "/x", Method::GET), Some(1));
    }

    #[test]
    fn stored_prefixes_are_matched_in_their_normal_form() {
        let snapshot = Snapshot::new(
            1,
            vec![service(1)],
            vec![
                route(1, &[], "/%61pi/./v1", &[], 0),
                route(2, &[], "/../x", &[], 0),
                route(3, &[], "/a%zz", &[], 0),
            ],
        );
        assert_eq!(found(&snapshot, "h", "/api/v1/x", Method::GET), Some(1));
        let prefixes: Vec<&str> = snapshot
            .routes()
            .iter()
            .map(|entry| entry.route.path_prefix.as_deref().unwrap_or(""))
            .collect();
        assert_eq!(prefixes, ["/api/v1"], "no normal form, no route");
    }

    #[test]
    fn longest_prefix_then_priority_then_methods() {
        let snapshot = Snapshot::new(
            1,
            vec![service(1)],
            vec![
                route(1, &[], "/api", &[], 0),
                route(2, &[], "/api/v2", &[], 0),
                route(3, &[], "/api", &[], 5),
                route(4, &[], "/api/v2", &["POST"], 9),
            ],
        );
        assert_eq!(found(&snapshot, "h", "/api/v2/x", Method::POST), Some(4));
        assert_eq!(found(&snapshot, "h", "/api/v2/x", Method::GET), Some(2));
        assert_eq!(found(&snapshot, "h", "/api/v1", Method::GET), Some(3));
        assert_eq!(found(&snapshot, "h", "/other", Method::GET), None);
    }

    #[test]
    fn falls_through_to_any_host_when_host_routes_do_not_match_path() {
        let snapshot = Snapshot::new(
            1,
            vec![service(1)],
            vec![
                route(1, &["a.test"], "/only", &[], 0),
                route(2, &[], "/", &[], 0),
            ],
        );
        assert_eq!(found(&snapshot, "a.test", "/else", Method::GET), Some(2));
        assert_eq!(found(&snapshot, "a.test", "/only/x", Method::GET), Some(1));
    }

    fn routed_to(snapshot: &Snapshot, host: &str) -> Option<Arc<ServiceRuntime>> {
        snapshot
            .find_route(host, "/", &plain(&Method::GET))
            .and_then(|entry| entry.service().cloned())
    }

    fn to_service(mut route: Route, service_id: Id) -> Route {
        route.service_id = Some(service_id);
        route.backends = vec![crate::model::Backend::whole(service_id)];
        route
    }

    #[test]
    fn a_next_generation_rebuilds_only_the_changed_service_and_its_routes() {
        let first = Snapshot::new(
            1,
            vec![service(1), service(2)],
            vec![
                route(10, &["one.test"], "/", &[], 0),
                to_service(route(20, &["two.test"], "/", &[], 0), 2),
            ],
        );
        let mut renamed = service(2);
        Arc::make_mut(&mut renamed.service).name = "renamed".into();
        let change = SnapshotChange {
            services: vec![(2, Some(renamed))],
            ..SnapshotChange::default()
        };
        let second = first.next(2, change, |_| panic!("no new route"), |_| Arc::default());
        assert_eq!(second.generation, 2);
        assert!(Arc::ptr_eq(
            first.service(1).unwrap(),
            second.service(1).unwrap()
        ));
        assert!(
            Arc::ptr_eq(&first.routes, &second.routes),
            "the index is shared"
        );
        assert_eq!(
            routed_to(&second, "two.test").unwrap().service.name,
            "renamed"
        );
        assert!(Arc::ptr_eq(
            &routed_to(&second, "one.test").unwrap(),
            first.service(1).unwrap()
        ));
        let stats = |snapshot: &Snapshot| {
            snapshot
                .find_route("two.test", "/", &plain(&Method::GET))
                .unwrap()
                .stats
                .clone()
        };
        assert!(
            Arc::ptr_eq(&stats(&first), &stats(&second)),
            "stats carry over"
        );
        assert_eq!(
            first.service(2).unwrap().service.name,
            "s2",
            "the old one is untouched"
        );
    }

    #[test]
    fn a_next_generation_with_new_routes_reindexes_them() {
        let first = Snapshot::new(
            1,
            vec![service(1)],
            vec![route(10, &["one.test"], "/", &[], 0)],
        );
        let change = SnapshotChange {
            routes: Some(vec![Arc::new(route(11, &["new.test"], "/", &[], 0))]),
            ..SnapshotChange::default()
        };
        let mut asked = Vec::new();
        let second = first.next(
            2,
            change,
            |id| {
                asked.push(id);
                Arc::default()
            },
            |_| Arc::default(),
        );
        assert_eq!(asked, vec![11]);
        assert!(routed_to(&second, "one.test").is_none());
        assert!(routed_to(&second, "new.test").is_some());
        assert!(Arc::ptr_eq(
            first.service(1).unwrap(),
            second.service(1).unwrap()
        ));
    }

    #[test]
    fn a_deleted_service_takes_its_routes_and_stream_routes_out() {
        let stream = StreamRoute {
            id: 5,
            listen: "127.0.0.1:9000".parse().unwrap(),
            sni: None,
            service_id: 2,
            created_at: crate::clock::now(),
            updated_at: crate::clock::now(),
        };
        let first = Snapshot::new(
            1,
            vec![service(1), service(2)],
            vec![to_service(route(20, &["two.test"], "/", &[], 0), 2)],
        )
        .with_stream_routes(std::slice::from_ref(&stream), |_| Arc::default());
        assert_eq!(first.streams().routes().count(), 1);
        let change = SnapshotChange {
            services: vec![(2, None)],
            ..SnapshotChange::default()
        };
        let second = first.next(2, change, |_| Arc::default(), |_| Arc::default());
        assert!(second.service(2).is_none());
        assert!(routed_to(&second, "two.test").is_none());
        assert_eq!(second.streams().routes().count(), 0);
    }

    #[test]
    fn a_changed_service_behind_a_stream_route_is_resolved_anew() {
        let stream = StreamRoute {
            id: 5,
            listen: "127.0.0.1:9000".parse().unwrap(),
            sni: None,
            service_id: 1,
            created_at: crate::clock::now(),
            updated_at: crate::clock::now(),
        };
        let first = Snapshot::new(1, vec![service(1)], Vec::<Route>::new())
            .with_stream_routes(std::slice::from_ref(&stream), |_| Arc::default());
        let mut changed = service(1);
        Arc::make_mut(&mut changed.service).name = "changed".into();
        let change = SnapshotChange {
            services: vec![(1, Some(changed))],
            ..SnapshotChange::default()
        };
        let second = first.next(2, change, |_| Arc::default(), |_| Arc::default());
        let entry = second.streams().routes().next().unwrap();
        assert_eq!(entry.service.service.name, "changed");
    }

    #[test]
    fn route_to_missing_service_is_left_out() {
        let mut orphan = route(1, &[], "/", &[], 0);
        orphan.service_id = Some(99);
        orphan.backends = vec![crate::model::Backend::whole(99)];
        let snapshot = Snapshot::new(1, vec![service(1)], vec![orphan]);
        assert_eq!(found(&snapshot, "h", "/", Method::GET), None);
    }

    #[test]
    fn strip_prefix_keeps_a_leading_slash() {
        let mut stripped = route(1, &[], "/api", &[], 0);
        stripped.strip_prefix = true;
        let snapshot = Snapshot::new(1, vec![service(1)], vec![stripped]);
        let entry = snapshot
            .find_route("h", "/api/x", &plain(&Method::GET))
            .unwrap();
        assert_eq!(entry.upstream_path("/api/x"), "/x");
        assert_eq!(entry.upstream_path("/api"), "/");
        let mut slash = route(2, &[], "/api/", &[], 0);
        slash.strip_prefix = true;
        let snapshot = Snapshot::new(1, vec![service(1)], vec![slash]);
        let entry = snapshot
            .find_route("h", "/api/x", &plain(&Method::GET))
            .unwrap();
        assert_eq!(entry.upstream_path("/api/x"), "/x");
    }

    #[test]
    fn prefix_candidates_are_segment_boundaries_longest_first() {
        let candidates: Vec<&str> = prefix_candidates("/api/v1").collect();
        assert_eq!(candidates, ["/api/v1", "/api/", "/api", "/"]);
        let candidates: Vec<&str> = prefix_candidates("/api/").collect();
        assert_eq!(candidates, ["/api/", "/api/", "/api", "/"]);
        assert_eq!(prefix_candidates("/").collect::<Vec<_>>(), ["/", "/"]);
    }

    #[test]
    fn many_routes_each_found_by_its_own_prefix() {
        let routes = (1..=2_000)
            .map(|id| route(id, &[], &format!("/svc{id}"), &[], 0))
            .collect();
        let snapshot = Snapshot::new(1, vec![service(1)], routes);
        assert_eq!(found(&snapshot, "h", "/svc1234/x", Method::GET), Some(1234));
        assert_eq!(found(&snapshot, "h", "/svc12345", Method::GET), None);
    }

    #[test]
    fn ipv6_authority_is_bracketed() {
        assert_eq!(authority_text("::1", 80), "[::1]:80");
        assert_eq!(authority_text("10.0.0.1", 80), "10.0.0.1:80");
    }

    /// A service of two equal targets (ids 0 and 1) in one tier.
    fn two_targets(policy: LbPolicy) -> ServiceRuntime {
        let mut runtime = service(1);
        runtime.targets = (0..2)
            .map(|id| {
                let authority = format!("127.0.0.1:{}", 10_000 + id);
                TargetRuntime {
                    spec: Default::default(),
                    id,
                    host_header: HeaderValue::from_str(&authority).unwrap(),
                    authority: Authority::try_from(authority).unwrap(),
                    load: Arc::default(),
                    health: Arc::default(),
                    identity: 0,
                }
            })
            .collect();
        let members = runtime
            .targets
            .iter()
            .map(|target| crate::balance::Member {
                weight: 1,
                priority: 0,
                load: target.load.clone(),
                identity: 0,
            })
            .collect();
        runtime.balancer = Balancer::new(policy, members);
        runtime
    }

    /// Ejects `target` by an ejection that has already run out: it is half-open.
    fn half_open(target: &TargetRuntime) {
        let policy = crate::model::Ejection {
            base_ejection_ms: 10,
            ..Default::default()
        };
        target
            .health
            .eject(
                unix_ms() - 1_000,
                &policy,
                crate::balance::FailureCause::Timeout,
            )
            .unwrap();
    }

    #[test]
    fn a_half_open_target_takes_one_pick_until_its_trial_ends() {
        let runtime = two_targets(LbPolicy::RoundRobin);
        half_open(&runtime.targets[1]);
        let trial = (0..4)
            .map(|_| runtime.pick(|_| false, true).unwrap())
            .find(|pick| pick.target.id == 1)
            .expect("round robin reaches the half-open target");
        assert!(trial.is_trial());
        for _ in 0..20 {
            let pick = runtime.pick(|_| false, true).unwrap();
            assert_eq!(
                (pick.target.id, pick.kind()),
                (0, PickKind::Available),
                "the other target takes every pick while the trial is in flight"
            );
            assert!(!pick.is_trial());
        }
        drop(trial);
        let again = (0..4)
            .map(|_| runtime.pick(|_| false, true).unwrap())
            .find(|pick| pick.target.id == 1)
            .expect("a trial that ended without a verdict lets the next pick try");
        assert!(again.is_trial());
    }

    #[test]
    fn a_pick_is_two_words_so_it_returns_in_registers() {
        // The trial is a flag beside the target (whose health it ends), not a guard of its own:
        // with one, `Option<Pick>` was three words and every pick returned it through memory.
        assert_eq!(
            std::mem::size_of::<Option<Pick<'_>>>(),
            2 * std::mem::size_of::<usize>()
        );
    }

    #[test]
    fn a_hashed_pick_claims_the_trial_of_its_half_open_target() {
        let mut runtime = two_targets(LbPolicy::RingHash);
        Arc::make_mut(&mut runtime.service).lb_policy = LbPolicy::RingHash;
        let members = runtime
            .targets
            .iter()
            .map(|target| crate::balance::Member {
                weight: 1,
                priority: 0,
                load: target.load.clone(),
                identity: crate::balance::identity_hash(target.authority.as_str()),
            })
            .collect();
        runtime.balancer = Balancer::new(LbPolicy::RingHash, members);
        let by_hash = |hash: u64| {
            let preference = Preference {
                pinned: None,
                hash: Some(hash),
            };
            runtime
                .pick_preferring(None, preference, |_| false, true)
                .unwrap()
        };
        let hash = (0..1_000)
            .find(|&hash| by_hash(hash).target.id == 1)
            .expect("some key hashes to target 1");
        half_open(&runtime.targets[1]);
        let trial = by_hash(hash);
        assert_eq!(trial.target.id, 1);
        assert!(trial.is_trial());
        let next = by_hash(hash);
        assert_eq!(
            (next.target.id, next.is_trial()),
            (0, false),
            "the key's next choice while the trial is in flight"
        );
        drop((trial, next));
        assert!(
            by_hash(hash).is_trial(),
            "the trial ended: the key's target tries again"
        );
    }

    #[test]
    fn a_candidate_the_pick_passes_over_keeps_its_trial() {
        // Least-request looks at both targets (`skip` runs for each) and chooses the lighter:
        // the half-open one, far busier, is looked at on every pick and chosen by none.
        let runtime = two_targets(LbPolicy::LeastRequest);
        half_open(&runtime.targets[1]);
        for _ in 0..100 {
            runtime.targets[1].load.start_request();
        }
        for _ in 0..50 {
            let pick = runtime.pick(|_| false, true).unwrap();
            assert_eq!(pick.target.id, 0);
        }
        assert!(
            runtime.targets[1].health.is_available(unix_ms),
            "a trial was claimed for a target that was not chosen"
        );
    }

    #[test]
    fn panic_picks_ignore_a_trial_in_flight_and_hold_none() {
        let mut runtime = two_targets(LbPolicy::Random);
        runtime.targets.truncate(1);
        runtime.balancer = Balancer::new(
            LbPolicy::Random,
            vec![crate::balance::Member {
                weight: 1,
                priority: 0,
                load: runtime.targets[0].load.clone(),
                identity: 0,
            }],
        );
        half_open(&runtime.targets[0]);
        let trial = runtime.pick(|_| false, true).unwrap();
        assert!(trial.is_trial());
        assert!(
            runtime.pick(|_| false, false).is_none(),
            "a retry takes no panic pick"
        );
        let panic = runtime.pick(|_| false, true).unwrap();
        assert_eq!((panic.target.id, panic.kind()), (0, PickKind::Panic));
        assert!(!panic.is_trial());
        assert_eq!(runtime.counters.panic_picks.load(Ordering::Relaxed), 1);
    }
}
