//! Plain data shared by every layer: services, targets, routes, tokens and their states. No I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

mod canary;
pub mod path;
mod retry;
mod route_rules;

pub use canary::{
    last_step, latency_bound_micros, latency_bucket, Canary, CanaryAction, CanaryCounts,
    CanaryDecision, CanaryMove, CanaryState, CanaryStatus, IntervalCounts, LATENCY_BUCKETS,
    MIN_CANARY_INTERVAL_MS,
};
pub use retry::{RetryBackoff, RetryBudget, RetryOn, RetryPolicy, MAX_RETRY_DELAY_MS};
pub use route_rules::{
    parse_template, Backend, Condition, ConditionTest, Cors, HeaderFilter, Mirror, RateLimit,
    RateLimitKey, RateLimitScope, Redirect, Rewrite, RouteTimeouts, TemplatePart, Variable,
    DEFAULT_BACKEND_WEIGHT, DEFAULT_RATE_LIMIT_MAX_KEYS, MAX_BACKEND_WEIGHT,
};
pub use route_rules::{whole_value_regex, REGEX_SIZE_LIMIT};

/// Every stored object is addressed by an integer id.
pub type Id = i64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    #[default]
    Http,
    Https,
    /// HTTP/2 with prior knowledge over TCP (gRPC inside a cluster).
    H2c,
    Tcp,
    Tls,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum LbPolicy {
    #[default]
    RoundRobin,
    Random,
    LeastRequest,
    /// Consistent hashing on a ring of points (`hash_on` names the key).
    RingHash,
    /// Maglev consistent hashing: a lookup table (`hash_on` names the key).
    Maglev,
}

impl LbPolicy {
    pub fn is_hashing(self) -> bool {
        matches!(self, LbPolicy::RingHash | LbPolicy::Maglev)
    }
}

/// What a hashing policy hashes: `{"header": name}`, `{"cookie": name}`, `{"query": name}` or
/// `"client_ip"`. A request without the key is sent round robin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum HashOn {
    Header(String),
    Cookie(String),
    Query(String),
    ClientIp,
}

/// Zone-aware routing (TRAFFIC.md §4): while at least `min_available_percent` of the targets in
/// the gateway's zone (`cluster.zone`) are available, requests go only to them; below it, to
/// every target of every zone, as if the service had no locality.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Locality {
    /// 0–100; 70 when left out.
    #[serde(default = "Locality::default_min_available_percent")]
    pub min_available_percent: u32,
}

/// The target metadata key where Kubernetes discovery puts the zone names of an endpoint's
/// EndpointSlice `hints.forZones` (a list of strings; absent when the endpoint has none).
pub const ZONE_HINTS_KEY: &str = "zone_hints";

impl Locality {
    pub const DEFAULT_MIN_AVAILABLE_PERCENT: u32 = 70;

    fn default_min_available_percent() -> u32 {
        Self::DEFAULT_MIN_AVAILABLE_PERCENT
    }
}

/// Cookie-based session persistence (TRAFFIC.md §5): Raahi sets an opaque cookie naming the
/// target, and a request carrying it goes back to that target while it is active or draining
/// and available.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionPersistence {
    #[serde(default = "SessionPersistence::default_cookie")]
    pub cookie: String,
    /// The session ends this long after it began, however busy; null: never.
    #[serde(default)]
    pub absolute_timeout_s: Option<u64>,
    /// The session ends after this long without a request; null: never.
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
}

impl SessionPersistence {
    fn default_cookie() -> String {
        "raahi-session".to_owned()
    }
}

/// Lifecycle of a target: whether it may take new traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TargetState {
    #[default]
    Active,
    Draining,
    Stale,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    #[default]
    Unknown,
    Healthy,
    Unhealthy,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Admin,
    Viewer,
}

macro_rules! text_enum {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $ty {
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant),+];
            pub fn parse(text: &str) -> Option<Self> {
                match text { $($text => Some(Self::$variant),)+ _ => None }
            }
        }
    };
}

text_enum!(Protocol { Http => "http", Https => "https", H2c => "h2c", Tcp => "tcp", Tls => "tls" });

impl Protocol {
    /// The service's targets speak TLS (`https` terminates it upstream, `tls` passes it through),
    /// so health checks must too.
    pub fn targets_speak_tls(self) -> bool {
        matches!(self, Protocol::Https | Protocol::Tls)
    }
}
text_enum!(LbPolicy { RoundRobin => "round_robin", Random => "random", LeastRequest => "least_request", RingHash => "ring_hash", Maglev => "maglev" });
text_enum!(TargetState { Active => "active", Draining => "draining", Stale => "stale" });
text_enum!(Health { Unknown => "unknown", Healthy => "healthy", Unhealthy => "unhealthy" });
text_enum!(Role { Admin => "admin", Viewer => "viewer" });
text_enum!(ProviderKind {
    Dns => "dns",
    DnsSrv => "dns-srv",
    Http => "http",
    Consul => "consul",
    Kubernetes => "kubernetes",
});
text_enum!(SourceState {
    Pending => "pending",
    Healthy => "healthy",
    Failing => "failing",
    Stale => "stale",
    Disabled => "disabled",
});

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum HealthCheckKind {
    /// A GET of `path`, healthy when the status is one of `expected_statuses`; over TLS (the
    /// service's server name, verification and CA) when the service is `https` or `tls`.
    #[default]
    Http,
    /// A TCP connect, whatever the service's protocol.
    Tcp,
    /// A TCP connect and a full TLS handshake with the service's server name, verification and
    /// CA, then an orderly close; only for `https` and `tls` services.
    Tls,
    /// `grpc.health.v1.Health/Check` for `grpc_service`, healthy only when `SERVING`; only for
    /// `h2c` and `https` services (over TLS for `https`).
    Grpc,
}

/// Active health checks of a service's targets, run by the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    #[serde(rename = "type", default)]
    pub kind: HealthCheckKind,
    #[serde(default = "HealthCheck::default_path")]
    pub path: String,
    #[serde(default = "HealthCheck::default_interval_ms")]
    pub interval_ms: u64,
    #[serde(default = "HealthCheck::default_timeout_ms")]
    pub timeout_ms: u64,
    /// Consecutive passed checks that make a target healthy.
    #[serde(default = "HealthCheck::default_healthy_threshold")]
    pub healthy_threshold: u32,
    /// Consecutive failed checks that make a target unhealthy.
    #[serde(default = "HealthCheck::default_unhealthy_threshold")]
    pub unhealthy_threshold: u32,
    /// Status codes or ranges that pass, e.g. `["200-299", "301"]`.
    #[serde(default = "HealthCheck::default_expected_statuses")]
    pub expected_statuses: Vec<String>,
    /// `Host` of the check request; null: the service's `upstream_authority`, else the target.
    #[serde(default)]
    pub host: Option<String>,
    /// For `type: "grpc"`: the service name asked about; null or `""`: the server as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc_service: Option<String>,
}

impl HealthCheck {
    fn default_path() -> String {
        "/".to_owned()
    }
    fn default_interval_ms() -> u64 {
        10_000
    }
    fn default_timeout_ms() -> u64 {
        2_000
    }
    fn default_healthy_threshold() -> u32 {
        2
    }
    fn default_unhealthy_threshold() -> u32 {
        3
    }
    fn default_expected_statuses() -> Vec<String> {
        vec!["200-399".to_owned()]
    }

    /// Whether `status` is one of `expected_statuses` (validated on write).
    pub fn expects(&self, status: u16) -> bool {
        self.expected_statuses.iter().any(|range| {
            let (low, high) = range.split_once('-').unwrap_or((range, range));
            match (low.trim().parse::<u16>(), high.trim().parse::<u16>()) {
                (Ok(low), Ok(high)) => (low..=high).contains(&status),
                _ => false,
            }
        })
    }
}

/// Passive outlier ejection: targets that keep failing real requests are taken out for a while.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Ejection {
    pub enabled: bool,
    /// Failures within `window_ms` that eject a target.
    pub failures: u32,
    pub window_ms: u64,
    /// First ejection time; the n-th ejection in a row lasts n times as long...
    pub base_ejection_ms: u64,
    /// ...but never longer than this.
    pub max_ejection_ms: u64,
    /// At most this share of a service's targets is ejected at once (at least one may be).
    pub max_ejection_percent: u32,
    /// Upstream statuses that count as failures (beside connect errors and timeouts).
    pub failure_statuses: Vec<u16>,
}

impl Default for Ejection {
    fn default() -> Self {
        Ejection {
            enabled: true,
            failures: 5,
            window_ms: 30_000,
            base_ejection_ms: 30_000,
            max_ejection_ms: 300_000,
            max_ejection_percent: 50,
            failure_statuses: vec![502, 503, 504],
        }
    }
}

/// The object form of [`Ejection`]; omitted keys take the defaults.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EjectionFields {
    enabled: Option<bool>,
    failures: Option<u32>,
    window_ms: Option<u64>,
    base_ejection_ms: Option<u64>,
    max_ejection_ms: Option<u64>,
    max_ejection_percent: Option<u32>,
    failure_statuses: Option<Vec<u16>>,
}

impl<'de> Deserialize<'de> for Ejection {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EjectionVisitor;
        impl<'de> serde::de::Visitor<'de> for EjectionVisitor {
            type Value = Ejection;
            fn expecting(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                formatter.write_str("an ejection object, or false to turn ejection off")
            }
            fn visit_bool<E: serde::de::Error>(self, enabled: bool) -> Result<Ejection, E> {
                Ok(Ejection {
                    enabled,
                    ..Ejection::default()
                })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<Ejection, A::Error> {
                let fields =
                    EjectionFields::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                let defaults = Ejection::default();
                Ok(Ejection {
                    enabled: fields.enabled.unwrap_or(defaults.enabled),
                    failures: fields.failures.unwrap_or(defaults.failures),
                    window_ms: fields.window_ms.unwrap_or(defaults.window_ms),
                    base_ejection_ms: fields.base_ejection_ms.unwrap_or(defaults.base_ejection_ms),
                    max_ejection_ms: fields.max_ejection_ms.unwrap_or(defaults.max_ejection_ms),
                    max_ejection_percent: fields
                        .max_ejection_percent
                        .unwrap_or(defaults.max_ejection_percent),
                    failure_statuses: fields.failure_statuses.unwrap_or(defaults.failure_statuses),
                })
            }
        }
        deserializer.deserialize_any(EjectionVisitor)
    }
}

/// The outcome of one active health check.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CheckResult {
    pub at: DateTime<Utc>,
    pub passed: bool,
    /// e.g. `HTTP 200`, `connect: connection refused`, `timed out after 2000 ms`.
    pub detail: String,
}

/// Upstream timeouts of a service, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    /// TCP connect to one target.
    #[serde(default = "Timeouts::default_connect_ms")]
    pub connect_ms: u64,
    /// From the request being sent until the upstream's response headers arrive.
    #[serde(default = "Timeouts::default_response_header_ms")]
    pub response_header_ms: u64,
    /// How long an unused pooled upstream connection is kept.
    #[serde(default = "Timeouts::default_idle_ms")]
    pub idle_ms: u64,
    /// HTTP/2 upstream connections: a PING when a connection with open streams has received
    /// nothing for this long, failed when no answer comes within `connect_ms`. Null: off (idle
    /// connections are never pinged either way: gRPC servers punish frequent pings).
    #[serde(default)]
    pub keepalive_ms: Option<u64>,
}

impl Timeouts {
    fn default_connect_ms() -> u64 {
        5_000
    }
    fn default_response_header_ms() -> u64 {
        30_000
    }
    fn default_idle_ms() -> u64 {
        60_000
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect_ms: Self::default_connect_ms(),
            response_header_ms: Self::default_response_header_ms(),
            idle_ms: Self::default_idle_ms(),
            keepalive_ms: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Service {
    pub id: Id,
    pub name: String,
    pub protocol: Protocol,
    /// Host (and optional port) sent upstream as `Host`/`:authority`; null sends the target's address.
    pub upstream_authority: Option<String>,
    pub tls_sni: Option<String>,
    pub tls_verify: bool,
    /// PEM CA certificates trusted for this service's upstream TLS instead of the public roots.
    pub tls_ca_pem: Option<String>,
    pub lb_policy: LbPolicy,
    /// The key of `ring_hash` and `maglev`; null for other policies.
    pub hash_on: Option<HashOn>,
    /// Bounded load for hashing policies: no target above this percent of the mean load
    /// (≥ 100); null: off.
    pub hash_balance_factor: Option<u32>,
    /// Sticky sessions by cookie; null: off.
    pub session_persistence: Option<SessionPersistence>,
    /// Keep requests in the gateway's zone; null: off (every zone alike).
    pub locality: Option<Locality>,
    pub timeouts: Timeouts,
    /// Attempts per request, the first included (a retry goes to another target).
    pub max_attempts: u32,
    /// Active health checks; null: off (every target counts as available).
    pub health_check: Option<HealthCheck>,
    /// Passive outlier ejection.
    pub ejection: Ejection,
    /// How much of each target the service may use at once.
    pub limits: UpstreamLimits,
    /// `resources-file` when a declarative resources file manages it; null otherwise.
    pub managed_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// How much of each target a service may use at once, and how long a request waits for room.
/// A request refused or timed out here answers 503 `upstream_overloaded` and counts against no
/// target's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpstreamLimits {
    /// Requests in flight to one target at once: over HTTP/1.1 (plain targets), one connection
    /// each; for a `tcp` or `tls` service, connections; for an `h2c` service, connections,
    /// each carrying up to `max_streams_per_connection` requests. Null: no limit.
    #[serde(default)]
    pub max_connections_per_target: Option<u32>,
    /// Requests of the service that may wait for room at a full target; more are refused at
    /// once.
    #[serde(default = "UpstreamLimits::default_max_pending_requests")]
    pub max_pending_requests: u32,
    /// How long a request waits for room at a full target.
    #[serde(default = "UpstreamLimits::default_queue_timeout_ms")]
    pub queue_timeout_ms: u64,
    /// HTTP/2 upstream connections (`h2c`, `https` by ALPN): streams at once on one connection,
    /// also bounded by the target's own `SETTINGS_MAX_CONCURRENT_STREAMS`.
    #[serde(default = "UpstreamLimits::default_max_streams_per_connection")]
    pub max_streams_per_connection: u32,
}

impl UpstreamLimits {
    fn default_max_pending_requests() -> u32 {
        1_000
    }
    fn default_queue_timeout_ms() -> u64 {
        5_000
    }
    fn default_max_streams_per_connection() -> u32 {
        100
    }
}

impl Default for UpstreamLimits {
    fn default() -> Self {
        UpstreamLimits {
            max_connections_per_target: None,
            max_pending_requests: Self::default_max_pending_requests(),
            queue_timeout_ms: Self::default_queue_timeout_ms(),
            max_streams_per_connection: Self::default_max_streams_per_connection(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Target {
    pub id: Id,
    pub service_id: Id,
    /// The discovery source that owns this target; null for operator targets.
    pub source_id: Option<Id>,
    pub host: String,
    pub port: u16,
    pub weight: u32,
    pub priority: i32,
    pub enabled: bool,
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
    pub provider_key: Option<String>,
    pub state: TargetState,
    pub health: Health,
    pub ejected_until: Option<DateTime<Utc>>,
    /// While `draining`: when the target is deleted (its source's removal grace ends).
    pub remove_at: Option<DateTime<Utc>>,
    /// The latest active health check of this target.
    pub last_check: Option<CheckResult>,
    /// `resources-file` when a declarative resources file manages it; null otherwise.
    pub managed_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl Target {
    /// The endpoint a discovered target was last refreshed from (None for operator targets).
    pub fn discovered_endpoint(&self) -> Option<Endpoint> {
        Some(Endpoint {
            key: self.provider_key.clone()?,
            host: self.host.clone(),
            port: self.port,
            weight: self.weight,
            priority: self.priority,
            enabled: self.enabled,
            metadata: self.metadata.clone(),
        })
    }

    /// Lifecycle and operator switches allow new traffic (health and ejection are judged at pick time).
    pub fn takes_new_traffic(&self) -> bool {
        self.state == TargetState::Active && self.enabled && self.weight > 0
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Route {
    pub id: Id,
    pub name: String,
    /// Exact host names or `*.suffix` wildcards; empty matches any host.
    pub hosts: Vec<String>,
    /// One of `path_prefix` (on whole segments), `path_exact` and `path_regex` (the whole
    /// path); a route that gives none has the prefix `/`.
    pub path_prefix: Option<String>,
    pub path_exact: Option<String>,
    pub path_regex: Option<String>,
    /// Empty allows every method.
    pub methods: Vec<String>,
    /// Conditions that must all hold, beside the host, path and method.
    pub headers: Vec<Condition>,
    pub query: Vec<Condition>,
    pub cookies: Vec<Condition>,
    /// The first backend's service (the one-backend shorthand); null for a redirect.
    pub service_id: Option<Id>,
    /// Where requests go, one per request by weight (smooth weighted round robin).
    pub backends: Vec<Backend>,
    pub preserve_host: bool,
    pub strip_prefix: bool,
    /// Among routes equally specific by host and path, the higher value wins.
    pub priority: i32,
    /// Largest request body the route accepts (413 `request_body_too_large`); null: no limit.
    pub max_request_body_bytes: Option<u64>,
    /// Request bodies up to this size are read whole into memory before a target is picked,
    /// so a slow uploader costs the upstream nothing; larger ones (and any beyond the
    /// listener's memory budget) are spooled to disk first, or stream when spooling is off.
    /// 0 streams every body.
    pub request_buffer_bytes: u64,
    /// The `Upgrade` protocols (e.g. `websocket`) the route passes to its targets; any other
    /// upgrade is forwarded as a plain request. `h2c` is never passed (RFC 9113 §3.1).
    pub upgrades: Vec<String>,
    pub request_headers: Option<HeaderFilter>,
    pub response_headers: Option<HeaderFilter>,
    /// Answered by Raahi; such a route has no backend.
    pub redirect: Option<Redirect>,
    pub rewrite: Option<Rewrite>,
    pub mirror: Option<Mirror>,
    pub cors: Option<Cors>,
    pub timeouts: RouteTimeouts,
    /// Which failures another attempt may follow, its backoff, per-try timeout, hedging and
    /// budget; null: the service's `max_attempts` with the default rules and budget.
    pub retry: Option<RetryPolicy>,
    /// Requests per second per key (429 `rate_limited` past it); null: none.
    pub rate_limit: Option<RateLimit>,
    /// Requests of the route in flight at once on this gateway (503 `too_many_requests` past
    /// it); null: no limit.
    pub max_in_flight: Option<u32>,
    /// One backend's share moved step by step while it behaves (TRAFFIC.md §4); null: none.
    pub canary: Option<Canary>,
    /// Where the canary stands (read-only; `GET .../canary` tells more); null without one.
    pub canary_status: Option<CanaryStatus>,
    /// `resources-file` when a declarative resources file manages it; null otherwise.
    pub managed_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Token {
    pub id: Id,
    pub name: String,
    pub role: Role,
    pub created_at: DateTime<Utc>,
}

/// The discovery providers Raahi knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub enum ProviderKind {
    #[serde(rename = "dns")]
    Dns,
    #[serde(rename = "dns-srv")]
    DnsSrv,
    #[serde(rename = "http")]
    Http,
    #[serde(rename = "consul")]
    Consul,
    #[serde(rename = "kubernetes")]
    Kubernetes,
}

/// Lifecycle of a discovery source (DESIGN §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SourceState {
    /// Created; the first refresh has not finished.
    #[default]
    Pending,
    /// The last refresh succeeded.
    Healthy,
    /// Refreshes fail; the last known good targets are still trusted.
    Failing,
    /// Failing for longer than `stale_after_ms`: its targets take no new traffic.
    Stale,
    /// `enabled=false`: no refreshes.
    Disabled,
}

pub const DEFAULT_STALE_AFTER_MS: u64 = 300_000;
pub const DEFAULT_REMOVAL_GRACE_MS: u64 = 60_000;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DiscoverySource {
    pub id: Id,
    pub service_id: Id,
    pub name: String,
    pub provider: ProviderKind,
    /// Provider configuration, as given (see `GET /api/v1/discovery/providers`).
    #[schema(value_type = Object)]
    pub config: serde_json::Value,
    pub enabled: bool,
    pub stale_after_ms: u64,
    pub removal_grace_ms: u64,
    /// Holds sudden mass removals until confirmed (DESIGN §4); null: off.
    pub removal_guard: Option<RemovalGuard>,
    /// `resources-file` when a declarative resources file manages it; null otherwise.
    pub managed_by: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// When one refresh would remove more than `max_percent` of a source's active endpoints, and
/// more than `min_endpoints` of them, the removals are held until the smaller set is confirmed
/// (seen for `confirm_ms` across at least 3 refreshes) or an admin accepts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RemovalGuard {
    #[serde(default = "default_guard_max_percent")]
    pub max_percent: u32,
    #[serde(default = "default_guard_min_endpoints")]
    pub min_endpoints: u32,
    #[serde(default = "default_guard_confirm_ms")]
    pub confirm_ms: u64,
}

impl Default for RemovalGuard {
    fn default() -> Self {
        RemovalGuard {
            max_percent: default_guard_max_percent(),
            min_endpoints: default_guard_min_endpoints(),
            confirm_ms: default_guard_confirm_ms(),
        }
    }
}

fn default_guard_max_percent() -> u32 {
    50
}
fn default_guard_min_endpoints() -> u32 {
    1
}
fn default_guard_confirm_ms() -> u64 {
    60_000
}
/// A source without `removal_guard` gets the default guard; an explicit null turns it off.
fn default_removal_guard() -> Option<RemovalGuard> {
    Some(RemovalGuard::default())
}

/// Removals the guard holds back (the source status's `guard`; null while it holds nothing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct GuardHold {
    /// How many targets are held.
    pub holding: u64,
    /// Their provider keys.
    pub held: Vec<String>,
    /// When the registry first answered the smaller set now being confirmed.
    pub since: DateTime<Utc>,
    /// Refreshes that answered with the same removals, the first included.
    pub confirmations: u32,
    /// Active targets when the hold started: the share removed is measured against it while
    /// the hold lasts, so endpoints the suspicious answer adds cannot dilute it.
    pub base: u64,
    /// Why the removals are held, for operators.
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySourceSpec {
    pub name: String,
    pub provider: ProviderKind,
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    pub config: serde_json::Value,
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default = "default_stale_after_ms")]
    pub stale_after_ms: u64,
    #[serde(default = "default_removal_grace_ms")]
    pub removal_grace_ms: u64,
    /// Absent: the default guard (50 %, 1 endpoint, 60 s); null: no guard.
    #[serde(default = "default_removal_guard")]
    pub removal_guard: Option<RemovalGuard>,
}

impl DiscoverySource {
    pub fn spec(&self) -> DiscoverySourceSpec {
        DiscoverySourceSpec {
            name: self.name.clone(),
            provider: self.provider,
            config: self.config.clone(),
            enabled: self.enabled,
            stale_after_ms: self.stale_after_ms,
            removal_grace_ms: self.removal_grace_ms,
            removal_guard: self.removal_guard,
        }
    }
}

/// The persisted part of a source's status: what its refreshes did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SourceProgress {
    pub state: SourceState,
    pub last_error: Option<String>,
    pub last_refresh_at: Option<DateTime<Utc>>,
    pub last_success_at: Option<DateTime<Utc>>,
    pub next_refresh_at: Option<DateTime<Utc>>,
    /// Opaque token of the last successful result; null until the first success.
    pub revision: Option<String>,
    /// Start of the current run of failed refreshes (null while healthy).
    pub failing_since: Option<DateTime<Utc>>,
    /// The watch of a watch provider (null for poll providers and before the watch starts).
    #[serde(default)]
    pub watch: Option<WatchProgress>,
    /// Removals the removal guard holds back; null while it holds nothing.
    #[serde(default)]
    pub guard: Option<GuardHold>,
}

/// Where a watch provider's long request stands.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct WatchProgress {
    /// The last request was answered and the next one is (or is about to be) open; false while
    /// it backs off after a failure, or before its first answer.
    pub connected: bool,
    /// When `connected` last changed.
    pub since: DateTime<Utc>,
    /// The registry's position of the last set delivered (Consul's `X-Consul-Index`, a
    /// Kubernetes resource version, as text);
    /// null before the first.
    pub index: Option<String>,
}

/// A discovery source as the routing snapshot sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceStanding {
    pub id: Id,
    pub service_id: Id,
    pub name: String,
    pub enabled: bool,
    pub state: SourceState,
}

/// Targets of one source by lifecycle state.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EndpointCounts {
    pub active: u64,
    pub draining: u64,
    pub stale: u64,
}

/// `GET /api/v1/discovery-sources/{id}/status`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SourceStatus {
    pub source_id: Id,
    #[serde(flatten)]
    pub progress: SourceProgress,
    pub endpoints: EndpointCounts,
    /// The gateway instance that refreshes this source (holds its lease); null while none does.
    #[serde(default)]
    pub refreshed_by: Option<String>,
    /// The last `POST …/accept-removals` and when the hold ended by it; null before the first.
    #[serde(default)]
    pub removal_acceptance: Option<RemovalAcceptance>,
}

/// An admin's acceptance of the removals a source's guard holds, as stored: the lease holder
/// applies it (at once, at the notification, after a reconnect or a takeover) and records when.
/// Times are the database's clock.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RemovalAcceptance {
    pub requested_at: DateTime<Utc>,
    /// The gateway instance the admin asked.
    pub requested_via: String,
    /// When the lease holder applied it (the hold ended then); null while pending.
    pub released_at: Option<DateTime<Utc>>,
    /// The instance that applied it.
    pub released_by: Option<String>,
    /// Targets that began draining then: 0 when the hold it covered had already ended (a hold
    /// that began after the request is not released by it); null while pending.
    pub released: Option<u64>,
}

/// One endpoint as a discovery provider reports it. `key` is its identity across refreshes
/// (`host:port` for the DNS providers, the registry's `key` for http).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Endpoint {
    pub key: String,
    /// An IP address: the request path never resolves names.
    pub host: String,
    pub port: u16,
    pub weight: u32,
    pub priority: i32,
    pub enabled: bool,
    pub metadata: serde_json::Value,
}

/// One change to a source's targets, decided by reconcile and written by the store.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetChange {
    /// A new endpoint: a new target, `active`, health `unknown`.
    Create(Endpoint),
    /// A known endpoint: update its fields and make it `active` again, keeping its id.
    Refresh {
        id: Id,
        endpoint: Endpoint,
    },
    /// Gone from the source: no new traffic; deleted at `remove_at`.
    Drain {
        id: Id,
        remove_at: DateTime<Utc>,
    },
    /// The source is stale: visible, no new traffic, until a success brings it back.
    MarkStale {
        id: Id,
    },
    Delete {
        id: Id,
    },
}

/// An L4 route: connections accepted on `listen` go to a `tcp` or `tls` service. With `sni`, the
/// listener is a TLS passthrough listener and the route takes the connections whose ClientHello
/// names that server (exact or `*.suffix`); a route without `sni` on such a listener takes the
/// rest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct StreamRoute {
    pub id: Id,
    #[schema(value_type = String, example = "0.0.0.0:5432")]
    pub listen: std::net::SocketAddr,
    pub sni: Option<String>,
    pub service_id: Id,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamRouteSpec {
    #[schema(value_type = String, example = "0.0.0.0:5432")]
    pub listen: std::net::SocketAddr,
    #[serde(default)]
    pub sni: Option<String>,
    pub service_id: Id,
}

/// A TLS certificate served by the HTTPS listener to clients naming one of its `snis`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Certificate {
    pub id: Id,
    /// Server names (exact or `*.suffix`) this certificate is served for.
    pub snis: Vec<String>,
    /// The PEM chain, leaf first.
    pub cert_pem: String,
    /// Expiry of the leaf certificate.
    pub not_after: DateTime<Utc>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

/// A certificate with its private key, as the store keeps it; the key never leaves through the API.
#[derive(Debug, Clone, PartialEq)]
pub struct CertificateWithKey {
    pub certificate: Certificate,
    pub key_pem: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CertificateSpec {
    /// Defaults to the DNS names of the leaf certificate; each given name must be covered by it.
    #[serde(default)]
    pub snis: Option<Vec<String>>,
    pub cert_pem: String,
    pub key_pem: String,
}

/// Everything the data path is built from, read from the store in one go.
#[derive(Debug, Clone, Default)]
pub struct RoutingConfig {
    pub services: Vec<Service>,
    pub targets: Vec<Target>,
    /// How each discovery source stands, to tell a service's clients why it has no target.
    pub sources: Vec<SourceStanding>,
    pub routes: Vec<Route>,
    pub stream_routes: Vec<StreamRoute>,
    pub certificates: Vec<CertificateWithKey>,
}

/// What an operator writes for a service (create and full replace).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ServiceSpec {
    pub name: String,
    #[serde(default)]
    pub protocol: Protocol,
    #[serde(default)]
    pub upstream_authority: Option<String>,
    #[serde(default)]
    pub tls_sni: Option<String>,
    #[serde(default = "default_true")]
    pub tls_verify: bool,
    #[serde(default)]
    pub tls_ca_pem: Option<String>,
    #[serde(default)]
    pub lb_policy: LbPolicy,
    #[serde(default)]
    pub hash_on: Option<HashOn>,
    #[serde(default)]
    pub hash_balance_factor: Option<u32>,
    #[serde(default)]
    pub session_persistence: Option<SessionPersistence>,
    #[serde(default)]
    pub locality: Option<Locality>,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
    #[serde(default)]
    pub health_check: Option<HealthCheck>,
    /// An object, or `false` to turn ejection off (`true`: the defaults).
    #[serde(default)]
    pub ejection: Ejection,
    #[serde(default)]
    pub limits: UpstreamLimits,
}

/// What an operator writes for a target of their own.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TargetSpec {
    pub host: String,
    pub port: u16,
    #[serde(default = "default_weight")]
    pub weight: u32,
    #[serde(default)]
    pub priority: i32,
    #[serde(default = "default_true")]
    pub enabled: bool,
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    pub metadata: serde_json::Value,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    pub name: String,
    #[serde(default)]
    pub hosts: Vec<String>,
    /// At most one of the three; none: the prefix `/`.
    #[serde(default)]
    pub path_prefix: Option<String>,
    #[serde(default)]
    pub path_exact: Option<String>,
    #[serde(default)]
    pub path_regex: Option<String>,
    #[serde(default)]
    pub methods: Vec<String>,
    #[serde(default)]
    pub headers: Vec<Condition>,
    #[serde(default)]
    pub query: Vec<Condition>,
    #[serde(default)]
    pub cookies: Vec<Condition>,
    /// Shorthand for `backends: [{"service_id": ...}]`; give one or the other.
    #[serde(default)]
    pub service_id: Option<Id>,
    #[serde(default)]
    pub backends: Vec<Backend>,
    #[serde(default)]
    pub preserve_host: bool,
    #[serde(default)]
    pub strip_prefix: bool,
    #[serde(default)]
    pub priority: i32,
    #[serde(default)]
    pub max_request_body_bytes: Option<u64>,
    #[serde(default = "default_request_buffer_bytes")]
    pub request_buffer_bytes: u64,
    #[serde(default = "default_upgrades")]
    pub upgrades: Vec<String>,
    #[serde(default)]
    pub request_headers: Option<HeaderFilter>,
    #[serde(default)]
    pub response_headers: Option<HeaderFilter>,
    #[serde(default)]
    pub redirect: Option<Redirect>,
    #[serde(default)]
    pub rewrite: Option<Rewrite>,
    #[serde(default)]
    pub mirror: Option<Mirror>,
    #[serde(default)]
    pub cors: Option<Cors>,
    #[serde(default)]
    pub timeouts: RouteTimeouts,
    #[serde(default)]
    pub retry: Option<RetryPolicy>,
    #[serde(default)]
    pub rate_limit: Option<RateLimit>,
    #[serde(default)]
    pub max_in_flight: Option<u32>,
    #[serde(default)]
    pub canary: Option<Canary>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenSpec {
    pub name: String,
    pub role: Role,
}

pub const DEFAULT_WEIGHT: u32 = 100;
/// Most attempts a request or connection makes on a service's targets, whatever the service
/// asks for: the API accepts `max_attempts` up to this, and the data path holds to it.
pub const MAX_ATTEMPTS: u32 = 10;

/// Largest target weight the API accepts; every provider keeps the weights it discovers within it.
pub const MAX_WEIGHT: u32 = 65_535;

fn default_true() -> bool {
    true
}
fn default_weight() -> u32 {
    DEFAULT_WEIGHT
}
fn default_max_attempts() -> u32 {
    3
}
/// A route buffers request bodies up to this size unless it says otherwise.
pub const DEFAULT_REQUEST_BUFFER_BYTES: u64 = 1024 * 1024;

fn default_request_buffer_bytes() -> u64 {
    DEFAULT_REQUEST_BUFFER_BYTES
}
/// WebSocket passes unless a route says otherwise, as it does through HAProxy and Traefik.
pub fn default_upgrades() -> Vec<String> {
    vec!["websocket".to_owned()]
}
fn default_stale_after_ms() -> u64 {
    DEFAULT_STALE_AFTER_MS
}
fn default_removal_grace_ms() -> u64 {
    DEFAULT_REMOVAL_GRACE_MS
}
fn empty_object() -> serde_json::Value {
    serde_json::Value::Object(Default::default())
}

impl Service {
    pub fn spec(&self) -> ServiceSpec {
        ServiceSpec {
            name: self.name.clone(),
            protocol: self.protocol,
            upstream_authority: self.upstream_authority.clone(),
            tls_sni: self.tls_sni.clone(),
            tls_verify: self.tls_verify,
            tls_ca_pem: self.tls_ca_pem.clone(),
            lb_policy: self.lb_policy,
            hash_on: self.hash_on.clone(),
            hash_balance_factor: self.hash_balance_factor,
            session_persistence: self.session_persistence.clone(),
            locality: self.locality,
            timeouts: self.timeouts,
            max_attempts: self.max_attempts,
            health_check: self.health_check.clone(),
            ejection: self.ejection.clone(),
            limits: self.limits,
        }
    }
}

impl Target {
    pub fn spec(&self) -> TargetSpec {
        TargetSpec {
            host: self.host.clone(),
            port: self.port,
            weight: self.weight,
            priority: self.priority,
            enabled: self.enabled,
            metadata: self.metadata.clone(),
        }
    }
}

impl StreamRoute {
    pub fn spec(&self) -> StreamRouteSpec {
        StreamRouteSpec {
            listen: self.listen,
            sni: self.sni.clone(),
            service_id: self.service_id,
        }
    }
}

impl Route {
    /// Every service the route sends requests to: its backends', then its mirror's.
    pub fn service_ids(&self) -> impl Iterator<Item = Id> + '_ {
        self.backends
            .iter()
            .map(|backend| backend.service_id)
            .chain(self.mirror.as_ref().map(|mirror| mirror.service_id))
    }

    pub fn spec(&self) -> RouteSpec {
        RouteSpec {
            name: self.name.clone(),
            hosts: self.hosts.clone(),
            path_prefix: self.path_prefix.clone(),
            path_exact: self.path_exact.clone(),
            path_regex: self.path_regex.clone(),
            methods: self.methods.clone(),
            headers: self.headers.clone(),
            query: self.query.clone(),
            cookies: self.cookies.clone(),
            // Backends say it all; `service_id` is only the shorthand a writer may use.
            service_id: None,
            backends: self.backends.clone(),
            preserve_host: self.preserve_host,
            strip_prefix: self.strip_prefix,
            priority: self.priority,
            max_request_body_bytes: self.max_request_body_bytes,
            request_buffer_bytes: self.request_buffer_bytes,
            upgrades: self.upgrades.clone(),
            request_headers: self.request_headers.clone(),
            response_headers: self.response_headers.clone(),
            redirect: self.redirect.clone(),
            rewrite: self.rewrite.clone(),
            mirror: self.mirror.clone(),
            cors: self.cors.clone(),
            timeouts: self.timeouts,
            retry: self.retry.clone(),
            rate_limit: self.rate_limit.clone(),
            max_in_flight: self.max_in_flight,
            canary: self.canary.clone(),
        }
    }
}
