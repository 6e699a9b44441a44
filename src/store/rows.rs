//! Database rows and their conversion into model types.

use chrono::{DateTime, TimeZone, Utc};

use super::StoreError;
use crate::model::{
    Backend, Canary, CanaryStatus, Condition, Cors, DiscoverySource, HeaderFilter, Health,
    LbPolicy, Mirror, Protocol, ProviderKind, RateLimit, Redirect, RetryPolicy, Rewrite, Role,
    Route, RouteSpec, RouteTimeouts, Service, SourceProgress, SourceStanding, SourceState, Target,
    TargetState, Timeouts, Token,
};

pub(super) fn time(ms: i64) -> Result<DateTime<Utc>, StoreError> {
    Utc.timestamp_millis_opt(ms)
        .single()
        .ok_or_else(|| StoreError::Corrupt(format!("timestamp {ms} out of range")))
}

fn parse_text<T>(text: &str, what: &str, parse: fn(&str) -> Option<T>) -> Result<T, StoreError> {
    parse(text).ok_or_else(|| StoreError::Corrupt(format!("unknown {what} {text:?}")))
}

fn non_negative(value: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("negative {what} {value}")))
}

fn json<T: serde::de::DeserializeOwned>(text: &str, what: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

pub(super) fn string_list(text: &str, what: &str) -> Result<Vec<String>, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

#[derive(sqlx::FromRow)]
pub(super) struct ServiceRow {
    id: i64,
    name: String,
    protocol: String,
    upstream_authority: Option<String>,
    tls_sni: Option<String>,
    tls_verify: bool,
    tls_ca_pem: Option<String>,
    lb_policy: String,
    connect_timeout_ms: i64,
    response_header_timeout_ms: i64,
    idle_timeout_ms: i64,
    keepalive_ms: Option<i64>,
    max_attempts: i64,
    health_check: Option<String>,
    ejection: Option<String>,
    limits: Option<String>,
    hash_on: Option<String>,
    hash_balance_factor: Option<i64>,
    session_persistence: Option<String>,
    locality: Option<String>,
    managed_by: Option<String>,
    created_at: i64,
    updated_at: i64,
}

impl TryFrom<ServiceRow> for Service {
    type Error = StoreError;
    fn try_from(row: ServiceRow) -> Result<Self, StoreError> {
        Ok(Service {
            id: row.id,
            name: row.name,
            protocol: parse_text(&row.protocol, "protocol", Protocol::parse)?,
            upstream_authority: row.upstream_authority,
            tls_sni: row.tls_sni,
            tls_verify: row.tls_verify,
            tls_ca_pem: row.tls_ca_pem,
            lb_policy: parse_text(&row.lb_policy, "lb_policy", LbPolicy::parse)?,
            timeouts: Timeouts {
                connect_ms: non_negative(row.connect_timeout_ms, "connect timeout")?,
                response_header_ms: non_negative(
                    row.response_header_timeout_ms,
                    "response timeout",
                )?,
                idle_ms: non_negative(row.idle_timeout_ms, "idle timeout")?,
                keepalive_ms: row
                    .keepalive_ms
                    .map(|ms| non_negative(ms, "keepalive"))
                    .transpose()?,
            },
            max_attempts: u32::try_from(row.max_attempts)
                .map_err(|_| StoreError::Corrupt(format!("max_attempts {}", row.max_attempts)))?,
            health_check: row
                .health_check
                .as_deref()
                .map(|text| json(text, "health_check"))
                .transpose()?,
            ejection: row
                .ejection
                .as_deref()
                .map(|text| json(text, "ejection"))
                .transpose()?
                .unwrap_or_default(),
            limits: row
                .limits
                .as_deref()
                .map(|text| json(text, "limits"))
                .transpose()?
                .unwrap_or_default(),
            hash_on: row
                .hash_on
                .as_deref()
                .map(|text| json(text, "hash_on"))
                .transpose()?,
            hash_balance_factor: row
                .hash_balance_factor
                .map(|factor| {
                    u32::try_from(factor)
                        .map_err(|_| StoreError::Corrupt(format!("hash_balance_factor {factor}")))
                })
                .transpose()?,
            session_persistence: row
                .session_persistence
                .as_deref()
                .map(|text| json(text, "session_persistence"))
                .transpose()?,
            locality: row
                .locality
                .as_deref()
                .map(|text| json(text, "locality"))
                .transpose()?,
            managed_by: row.managed_by,
            created_at: time(row.created_at)?,
            updated_at: time(row.updated_at)?,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct TargetRow {
    id: i64,
    service_id: i64,
    source_id: Option<i64>,
    host: String,
    port: i64,
    weight: i64,
    priority: i64,
    enabled: bool,
    metadata: String,
    provider_key: Option<String>,
    state: String,
    health: String,
    ejected_until: Option<i64>,
    remove_at: Option<i64>,
    last_check: Option<String>,
    managed_by: Option<String>,
    created_at: i64,
    updated_at: i64,
}

impl TryFrom<TargetRow> for Target {
    type Error = StoreError;
    fn try_from(row: TargetRow) -> Result<Self, StoreError> {
        Ok(Target {
            id: row.id,
            service_id: row.service_id,
            source_id: row.source_id,
            host: row.host,
            port: u16::try_from(row.port)
                .map_err(|_| StoreError::Corrupt(format!("port {}", row.port)))?,
            weight: u32::try_from(row.weight)
                .map_err(|_| StoreError::Corrupt(format!("weight {}", row.weight)))?,
            priority: i32::try_from(row.priority)
                .map_err(|_| StoreError::Corrupt(format!("priority {}", row.priority)))?,
            enabled: row.enabled,
            metadata: serde_json::from_str(&row.metadata)
                .map_err(|e| StoreError::Corrupt(format!("target metadata: {e}")))?,
            provider_key: row.provider_key,
            state: parse_text(&row.state, "target state", TargetState::parse)?,
            health: parse_text(&row.health, "target health", Health::parse)?,
            ejected_until: row.ejected_until.map(time).transpose()?,
            remove_at: row.remove_at.map(time).transpose()?,
            last_check: row
                .last_check
                .as_deref()
                .map(|text| json(text, "last_check"))
                .transpose()?,
            managed_by: row.managed_by,
            created_at: time(row.created_at)?,
            updated_at: time(row.updated_at)?,
        })
    }
}

/// Routes with where their canary stands.
pub(super) const ROUTE_SELECT: &str = "SELECT routes.*, c.state AS canary_state,
        c.step AS canary_step, c.weight AS canary_weight, c.round AS canary_round,
        c.interval_started_ms AS canary_interval_started_ms, c.reason AS canary_reason
    FROM routes LEFT JOIN route_canaries c ON c.route_id = routes.id";

#[derive(sqlx::FromRow)]
pub(super) struct RouteRow {
    id: i64,
    name: String,
    hosts: String,
    path_prefix: Option<String>,
    methods: String,
    service_id: Option<i64>,
    preserve_host: bool,
    strip_prefix: bool,
    priority: i64,
    max_request_body_bytes: Option<i64>,
    request_buffer_bytes: i64,
    upgrades: String,
    rules: String,
    managed_by: Option<String>,
    created_at: i64,
    updated_at: i64,
    canary_state: Option<String>,
    canary_step: Option<i64>,
    canary_weight: Option<i64>,
    canary_round: Option<i64>,
    canary_interval_started_ms: Option<i64>,
    canary_reason: Option<String>,
}

/// Where the route's canary stands, from the joined `route_canaries` columns.
fn canary_status_of(row: &RouteRow) -> Result<Option<CanaryStatus>, StoreError> {
    let (Some(state), Some(step), Some(weight), Some(round), Some(started), Some(reason)) = (
        row.canary_state.as_deref(),
        row.canary_step,
        row.canary_weight,
        row.canary_round,
        row.canary_interval_started_ms,
        row.canary_reason.clone(),
    ) else {
        return Ok(None);
    };
    super::canary::status_of(state, step, weight, round, started, reason)
        .map(Some)
        .ok_or_else(|| StoreError::Corrupt(format!("route {} canary status", row.id)))
}

impl TryFrom<RouteRow> for Route {
    type Error = StoreError;
    fn try_from(row: RouteRow) -> Result<Self, StoreError> {
        let rules: RouteRules = serde_json::from_str(&row.rules)
            .map_err(|e| StoreError::Corrupt(format!("route {} rules: {e}", row.id)))?;
        let canary_status = canary_status_of(&row)?;
        // Routes stored before backends existed name their one service in the column.
        let backends = match (rules.backends.is_empty(), row.service_id) {
            (true, Some(service_id)) => vec![Backend::whole(service_id)],
            _ => rules.backends,
        };
        Ok(Route {
            id: row.id,
            name: row.name,
            hosts: string_list(&row.hosts, "route hosts")?,
            path_prefix: row.path_prefix,
            path_exact: rules.path_exact,
            path_regex: rules.path_regex,
            methods: string_list(&row.methods, "route methods")?,
            headers: rules.headers,
            query: rules.query,
            cookies: rules.cookies,
            service_id: backends.first().map(|backend| backend.service_id),
            backends,
            request_headers: rules.request_headers,
            response_headers: rules.response_headers,
            redirect: rules.redirect,
            rewrite: rules.rewrite,
            mirror: rules.mirror,
            cors: rules.cors,
            timeouts: rules.timeouts,
            retry: rules.retry,
            rate_limit: rules.rate_limit,
            max_in_flight: rules.max_in_flight,
            canary_status,
            canary: rules.canary,
            preserve_host: row.preserve_host,
            strip_prefix: row.strip_prefix,
            priority: i32::try_from(row.priority)
                .map_err(|_| StoreError::Corrupt(format!("route priority {}", row.priority)))?,
            max_request_body_bytes: row
                .max_request_body_bytes
                .map(|bytes| size(bytes, "route max_request_body_bytes"))
                .transpose()?,
            request_buffer_bytes: size(row.request_buffer_bytes, "route request_buffer_bytes")?,
            upgrades: string_list(&row.upgrades, "route upgrades")?,
            managed_by: row.managed_by,
            created_at: time(row.created_at)?,
            updated_at: time(row.updated_at)?,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct TokenRow {
    id: i64,
    name: String,
    role: String,
    #[allow(dead_code)] // selected with `*`, compared in SQL only
    token_hash: String,
    created_at: i64,
}

impl TryFrom<TokenRow> for Token {
    type Error = StoreError;
    fn try_from(row: TokenRow) -> Result<Self, StoreError> {
        Ok(Token {
            id: row.id,
            name: row.name,
            role: parse_text(&row.role, "token role", Role::parse)?,
            created_at: time(row.created_at)?,
        })
    }
}

/// What the routing snapshot needs of a discovery source.
#[derive(sqlx::FromRow)]
pub(super) struct StandingRow {
    id: i64,
    service_id: i64,
    name: String,
    enabled: bool,
    state: String,
}

impl TryFrom<StandingRow> for SourceStanding {
    type Error = StoreError;
    fn try_from(row: StandingRow) -> Result<Self, StoreError> {
        Ok(SourceStanding {
            id: row.id,
            service_id: row.service_id,
            name: row.name,
            enabled: row.enabled,
            state: parse_text(&row.state, "source state", SourceState::parse)?,
        })
    }
}

#[derive(sqlx::FromRow)]
pub(super) struct SourceRow {
    id: i64,
    service_id: i64,
    name: String,
    provider: String,
    config: String,
    enabled: bool,
    stale_after_ms: i64,
    removal_grace_ms: i64,
    state: String,
    last_error: Option<String>,
    last_refresh_at: Option<i64>,
    last_success_at: Option<i64>,
    next_refresh_at: Option<i64>,
    revision: Option<String>,
    failing_since: Option<i64>,
    watch: Option<String>,
    removal_guard: Option<String>,
    guard: Option<String>,
    managed_by: Option<String>,
    created_at: i64,
    updated_at: i64,
}

/// A source row with its targets counted by state.
#[derive(sqlx::FromRow)]
pub(super) struct SourceCountsRow {
    #[sqlx(flatten)]
    pub(super) source: SourceRow,
    pub(super) active_targets: i64,
    pub(super) draining_targets: i64,
    pub(super) stale_targets: i64,
}

impl SourceRow {
    pub(super) fn into_parts(self) -> Result<(DiscoverySource, SourceProgress), StoreError> {
        let progress = SourceProgress {
            state: parse_text(&self.state, "source state", SourceState::parse)?,
            last_error: self.last_error,
            last_refresh_at: self.last_refresh_at.map(time).transpose()?,
            last_success_at: self.last_success_at.map(time).transpose()?,
            next_refresh_at: self.next_refresh_at.map(time).transpose()?,
            revision: self.revision,
            failing_since: self.failing_since.map(time).transpose()?,
            watch: json_column(self.watch.as_deref(), "source watch")?,
            guard: json_column(self.guard.as_deref(), "source guard")?,
        };
        let source = DiscoverySource {
            id: self.id,
            service_id: self.service_id,
            name: self.name,
            provider: parse_text(&self.provider, "provider", ProviderKind::parse)?,
            config: serde_json::from_str(&self.config)
                .map_err(|e| StoreError::Corrupt(format!("source config: {e}")))?,
            enabled: self.enabled,
            stale_after_ms: non_negative(self.stale_after_ms, "stale_after_ms")?,
            removal_grace_ms: non_negative(self.removal_grace_ms, "removal_grace_ms")?,
            removal_guard: json_column(self.removal_guard.as_deref(), "removal_guard")?,
            managed_by: self.managed_by,
            created_at: time(self.created_at)?,
            updated_at: time(self.updated_at)?,
        };
        Ok((source, progress))
    }
}

/// A nullable JSON text column.
fn json_column<T: serde::de::DeserializeOwned>(
    text: Option<&str>,
    what: &str,
) -> Result<Option<T>, StoreError> {
    text.map(serde_json::from_str)
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

impl TryFrom<SourceRow> for DiscoverySource {
    type Error = StoreError;
    fn try_from(row: SourceRow) -> Result<Self, StoreError> {
        row.into_parts().map(|(source, _)| source)
    }
}

fn size(bytes: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(bytes).map_err(|_| StoreError::Corrupt(format!("{what} {bytes}")))
}

/// The parts of a route kept as one JSON document in `routes.rules`; every field optional, so
/// routes stored before them read as `{}`.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub(super) struct RouteRules {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_exact: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path_regex: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<Condition>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub query: Vec<Condition>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cookies: Vec<Condition>,
    pub backends: Vec<Backend>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_headers: Option<HeaderFilter>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_headers: Option<HeaderFilter>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub redirect: Option<Redirect>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rewrite: Option<Rewrite>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mirror: Option<Mirror>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cors: Option<Cors>,
    #[serde(skip_serializing_if = "RouteTimeouts::is_empty")]
    pub timeouts: RouteTimeouts,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryPolicy>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimit>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
}

impl RouteRules {
    pub fn of(spec: &RouteSpec) -> RouteRules {
        RouteRules {
            path_exact: spec.path_exact.clone(),
            path_regex: spec.path_regex.clone(),
            headers: spec.headers.clone(),
            query: spec.query.clone(),
            cookies: spec.cookies.clone(),
            backends: spec.backends.clone(),
            request_headers: spec.request_headers.clone(),
            response_headers: spec.response_headers.clone(),
            redirect: spec.redirect.clone(),
            rewrite: spec.rewrite.clone(),
            mirror: spec.mirror.clone(),
            cors: spec.cors.clone(),
            timeouts: spec.timeouts,
            retry: spec.retry.clone(),
            rate_limit: spec.rate_limit.clone(),
            max_in_flight: spec.max_in_flight,
            canary: spec.canary.clone(),
        }
    }
}
