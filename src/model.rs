//! Plain data shared by every layer: services, targets, routes, tokens and their states. No I/O.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Every stored object is addressed by an integer id.
pub type Id = i64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    #[default]
    Http,
    Https,
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
            pub fn parse(text: &str) -> Option<Self> {
                match text { $($text => Some(Self::$variant),)+ _ => None }
            }
        }
    };
}

text_enum!(Protocol { Http => "http", Https => "https", Tcp => "tcp", Tls => "tls" });
text_enum!(LbPolicy { RoundRobin => "round_robin", Random => "random", LeastRequest => "least_request" });
text_enum!(TargetState { Active => "active", Draining => "draining", Stale => "stale" });
text_enum!(Health { Unknown => "unknown", Healthy => "healthy", Unhealthy => "unhealthy" });
text_enum!(Role { Admin => "admin", Viewer => "viewer" });

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
    pub lb_policy: LbPolicy,
    pub timeouts: Timeouts,
    /// Attempts per request, the first included (a retry goes to another target).
    pub max_attempts: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
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
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
}

impl Target {
    /// Lifecycle and operator switches allow new traffic (health and ejection are judged at pick time).
    pub fn takes_new_traffic(&self) -> bool {
        self.state == TargetState::Active && self.enabled && self.weight > 0
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Route {
    pub id: Id,
    pub name: String,
    /// Exact host names or `*.suffix` wildcards; empty matches any host.
    pub hosts: Vec<String>,
    pub path_prefix: String,
    /// Empty allows every method.
    pub methods: Vec<String>,
    pub service_id: Id,
    pub preserve_host: bool,
    pub strip_prefix: bool,
    /// Among routes equally specific by host and path, the higher value wins.
    pub priority: i32,
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

/// Everything the data path is built from, read from the store in one go.
#[derive(Debug, Clone, Default)]
pub struct RoutingConfig {
    pub services: Vec<Service>,
    pub targets: Vec<Target>,
    pub routes: Vec<Route>,
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
    pub lb_policy: LbPolicy,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default = "default_max_attempts")]
    pub max_attempts: u32,
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    pub name: String,
    #[serde(default)]
    pub hosts: Vec<String>,
    #[serde(default = "default_path_prefix")]
    pub path_prefix: String,
    #[serde(default)]
    pub methods: Vec<String>,
    pub service_id: Id,
    #[serde(default)]
    pub preserve_host: bool,
    #[serde(default)]
    pub strip_prefix: bool,
    #[serde(default)]
    pub priority: i32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenSpec {
    pub name: String,
    pub role: Role,
}

pub const DEFAULT_WEIGHT: u32 = 100;

fn default_true() -> bool {
    true
}
fn default_weight() -> u32 {
    DEFAULT_WEIGHT
}
fn default_max_attempts() -> u32 {
    3
}
fn default_path_prefix() -> String {
    "/".to_owned()
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
            lb_policy: self.lb_policy,
            timeouts: self.timeouts,
            max_attempts: self.max_attempts,
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

impl Route {
    pub fn spec(&self) -> RouteSpec {
        RouteSpec {
            name: self.name.clone(),
            hosts: self.hosts.clone(),
            path_prefix: self.path_prefix.clone(),
            methods: self.methods.clone(),
            service_id: self.service_id,
            preserve_host: self.preserve_host,
            strip_prefix: self.strip_prefix,
            priority: self.priority,
        }
    }
}
