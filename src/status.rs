//! `raahi status`: what discovery did, read from the admin API of a running gateway.
//!
//! [`fetch`] walks every service, its targets and its discovery sources (following pagination),
//! the status of each source, and every route; [`render_text`] turns the result into one block
//! per service, then one line per route.
//! Only the admin API is used: no configuration file, no database.

use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};
use futures_util::stream::{self, StreamExt, TryStreamExt};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::model::{
    Backend, Condition, ConditionTest, EndpointCounts, Health, Id, Mirror, Redirect, RouteTimeouts,
    SourceState, TargetState, WatchProgress,
};

/// Largest page the admin API serves; fewer round trips for big gateways.
const PAGE_LIMIT: u32 = 1000;
/// Services fetched at once (each costs two list walks plus one call per source).
const CONCURRENCY: usize = 8;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Everything `raahi status` shows, as of `fetched_at`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatusReport {
    pub admin_url: String,
    pub fetched_at: DateTime<Utc>,
    /// What `/readyz` said; None when it could not be read.
    pub gateway: Option<GatewayReport>,
    pub services: Vec<ServiceReport>,
    pub routes: Vec<RouteReport>,
}

/// One route as an operator reads it: what it takes and where it sends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouteReport {
    pub id: Id,
    pub name: String,
    /// `any host`, or the hosts joined with commas.
    pub hosts: String,
    /// `prefix /api`, `exact /login` or `regex /items/[0-9]+`.
    pub path: String,
    /// Header, query and cookie conditions, e.g. `header x-canary = 1`.
    pub conditions: Vec<String>,
    /// Each backend as `service 90 %` or `service{version=v2} 10 %`; empty for a redirect.
    pub backends: Vec<String>,
    /// Filters in force: `redirect https://... (301)`, `rewrite`, `mirror shadow 10 %`...
    pub filters: Vec<String>,
}

/// The gateway's health indicator, as `/readyz` answers it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GatewayReport {
    /// `ready`, `starting` or `draining`.
    pub status: String,
    #[serde(default)]
    pub reason: Option<String>,
    #[serde(default)]
    pub ever_resolved: bool,
    #[serde(default)]
    pub degraded: bool,
    #[serde(default)]
    pub degraded_because: Vec<String>,
    #[serde(default)]
    pub ejected_targets: u64,
    #[serde(default)]
    pub registration: Option<RegistrationReport>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RegistrationReport {
    pub registry: String,
    pub service_id: String,
    pub service_name: String,
    pub address: String,
    pub state: String,
    pub since: DateTime<Utc>,
    #[serde(default)]
    pub last_heartbeat_at: Option<DateTime<Utc>>,
    #[serde(default)]
    pub last_error: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceReport {
    pub id: Id,
    pub name: String,
    /// Every target of the service (operator and discovered) by lifecycle state.
    pub targets: TargetCounts,
    /// Every target of the service by health.
    pub health: HealthCounts,
    pub sources: Vec<SourceReport>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TargetCounts {
    pub active: u64,
    pub draining: u64,
    pub stale: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct HealthCounts {
    pub healthy: u64,
    pub unhealthy: u64,
    pub unknown: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SourceReport {
    pub id: Id,
    pub name: String,
    pub provider: String,
    pub enabled: bool,
    pub state: SourceState,
    /// The source's targets by lifecycle state.
    pub endpoints: EndpointCounts,
    pub last_error: Option<String>,
    pub last_refresh_at: Option<DateTime<Utc>>,
    pub last_success_at: Option<DateTime<Utc>>,
    pub next_refresh_at: Option<DateTime<Utc>>,
    pub failing_since: Option<DateTime<Utc>>,
    /// The gateway instance holding the source's lease (the one that refreshes it).
    pub refreshed_by: Option<String>,
    /// A watch provider's watch.
    pub watch: Option<WatchProgress>,
}

/// Why `raahi status` could not build its report.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("invalid admin URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("cannot reach the admin API at {url}: {reason} (is the gateway running? set --admin-url or RAAHI_ADMIN_URL)")]
    Unreachable { url: String, reason: String },
    #[error("the admin API at {url} needs a token: pass --token or set RAAHI_ADMIN_TOKEN")]
    MissingToken { url: String },
    #[error("the admin API at {url} rejected the token (401): it is wrong or revoked; pass a valid admin token with --token or RAAHI_ADMIN_TOKEN")]
    BadToken { url: String },
    #[error("the admin API at {url} refused {path} (403): the token lacks the admin role, which discovery sources need; use an admin token")]
    Forbidden { url: String, path: String },
    #[error("GET {url} answered {status}: {message}")]
    Http {
        url: String,
        status: u16,
        message: String,
    },
    #[error("GET {url}: unexpected answer (is this a Raahi admin API?): {reason}")]
    Decode { url: String, reason: String },
}

/// Reads services, targets, discovery sources and their status from the admin API at
/// `admin_url` (e.g. `http://127.0.0.1:9080`; `http://` is assumed without a scheme).
pub async fn fetch(admin_url: &str, token: Option<&str>) -> Result<StatusReport, StatusError> {
    let base = normalise_url(admin_url)?;
    let http = reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .timeout(REQUEST_TIMEOUT)
        .user_agent(concat!("raahi-status/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|error| StatusError::InvalidUrl {
            url: admin_url.to_owned(),
            reason: chain(&error),
        })?;
    let api = Api {
        http,
        base,
        token: token.filter(|t| !t.is_empty()).map(str::to_owned),
    };
    let fetched_at = crate::clock::now();
    let services: Vec<ApiService> = api.list("/api/v1/services").await?;
    let routes: Vec<ApiRoute> = api.list("/api/v1/routes").await?;
    let names: std::collections::HashMap<Id, String> = services
        .iter()
        .map(|service| (service.id, service.name.clone()))
        .collect();
    let routes = routes.iter().map(|route| route.report(&names)).collect();
    let gateway = api.readiness().await;
    let reports: Vec<Option<ServiceReport>> = stream::iter(services)
        .map(|service| api.service(service))
        .buffered(CONCURRENCY)
        .try_collect()
        .await?;
    Ok(StatusReport {
        admin_url: api.base.clone(),
        fetched_at,
        gateway,
        services: reports.into_iter().flatten().collect(),
        routes,
    })
}

/// One block per service: its target counts, then one line per discovery source.
pub fn render_text(report: &StatusReport) -> String {
    let mut out = String::new();
    if let Some(gateway) = &report.gateway {
        out.push_str(&gateway_lines(gateway, report.fetched_at));
    }
    if report.services.is_empty() {
        out.push_str(&format!("no services configured at {}\n", report.admin_url));
        return out;
    }
    for (index, service) in report.services.iter().enumerate() {
        if index > 0 {
            out.push('\n');
        }
        let (t, h) = (service.targets, service.health);
        out.push_str(&format!(
            "service {} (id {}): targets active {}, draining {}, stale {}; health healthy {}, unhealthy {}, unknown {}\n",
            service.name, service.id, t.active, t.draining, t.stale, h.healthy, h.unhealthy, h.unknown
        ));
        for source in &service.sources {
            out.push_str(&source_line(source, report.fetched_at));
            out.push('\n');
        }
    }
    if !report.routes.is_empty() {
        out.push('\n');
    }
    for route in &report.routes {
        out.push_str(&route_line(route));
        out.push('\n');
    }
    out
}

/// `route split (id 3): any host, prefix /api, header x-canary = 1 -> web 90 %, web{tag=v2} 10 %; mirror shadow 5 %`
fn route_line(route: &RouteReport) -> String {
    let mut takes = vec![route.hosts.clone(), route.path.clone()];
    takes.extend(route.conditions.iter().cloned());
    let mut line = format!(
        "route {} (id {}): {}",
        route.name,
        route.id,
        takes.join(", ")
    );
    if !route.backends.is_empty() {
        line.push_str(&format!(" -> {}", route.backends.join(", ")));
    }
    if !route.filters.is_empty() {
        line.push_str(&format!("; {}", route.filters.join(", ")));
    }
    line
}

/// `gateway ready; degraded: ...`, then the registration, if any.
fn gateway_lines(gateway: &GatewayReport, now: DateTime<Utc>) -> String {
    let mut line = format!("gateway {}", gateway.status);
    if let Some(reason) = &gateway.reason {
        line.push_str(&format!(": {}", one_line(reason)));
    }
    if gateway.degraded {
        line.push_str(&format!(
            "; degraded: {}",
            gateway.degraded_because.join(", ")
        ));
    }
    line.push('\n');
    if let Some(registration) = &gateway.registration {
        let mut parts = vec![format!(
            "{} since {}",
            registration.state,
            when(registration.since, now)
        )];
        if let Some(at) = registration.last_heartbeat_at {
            parts.push(format!("last heartbeat {}", when(at, now)));
        }
        if let Some(error) = &registration.last_error {
            parts.push(format!("last error: {}", one_line(error)));
        }
        line.push_str(&format!(
            "  registration {} {}/{} at {}: {}\n",
            registration.registry,
            registration.service_name,
            registration.service_id,
            registration.address,
            parts.join(", ")
        ));
    }
    line
}

fn source_line(source: &SourceReport, now: DateTime<Utc>) -> String {
    let e = source.endpoints;
    let mut parts = vec![
        source.state.as_str().to_owned(),
        format!(
            "endpoints active/draining/stale {}/{}/{}",
            e.active, e.draining, e.stale
        ),
    ];
    match source.last_success_at {
        Some(at) => parts.push(format!("last success {}", when(at, now))),
        // Refreshes ran, none succeeded: worth saying. Before the first one: nothing to say.
        None if source.last_refresh_at.is_some() => parts.push("never succeeded".to_owned()),
        None => {}
    }
    if let Some(since) = source.failing_since {
        parts.push(format!("failing since {}", when(since, now)));
    }
    if let Some(watch) = &source.watch {
        let index = watch
            .index
            .as_deref()
            .map(|index| format!(" at index {index}"))
            .unwrap_or_default();
        let verb = if watch.connected {
            "watching"
        } else {
            "watch down"
        };
        parts.push(format!("{verb}{index} since {}", when(watch.since, now)));
    }
    if let Some(at) = source.next_refresh_at {
        parts.push(format!("next refresh {}", when(at, now)));
    }
    if let Some(instance) = &source.refreshed_by {
        parts.push(format!("refreshed by {instance}"));
    }
    if let Some(error) = &source.last_error {
        parts.push(format!("last error: {}", one_line(error)));
    }
    format!(
        "  source {} ({}): {}",
        source.name,
        source.provider,
        parts.join(", ")
    )
}

/// `2025-01-02T03:04:05Z (12s ago)` or `... (in 3s)`.
fn when(at: DateTime<Utc>, now: DateTime<Utc>) -> String {
    let stamp = at.to_rfc3339_opts(SecondsFormat::Secs, true);
    let seconds = (at - now).num_seconds();
    let relative = match seconds {
        0 => "now".to_owned(),
        s if s > 0 => format!("in {}", span(s.unsigned_abs())),
        s => format!("{} ago", span(s.unsigned_abs())),
    };
    format!("{stamp} ({relative})")
}

fn span(seconds: u64) -> String {
    match seconds {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 2 * 86400 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86400),
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `http://host:port` without a trailing slash; a URL without a scheme gets `http://`.
fn normalise_url(admin_url: &str) -> Result<String, StatusError> {
    let trimmed = admin_url.trim().trim_end_matches('/');
    let with_scheme = if trimmed.contains("://") {
        trimmed.to_owned()
    } else {
        format!("http://{trimmed}")
    };
    let invalid = |reason: String| StatusError::InvalidUrl {
        url: admin_url.to_owned(),
        reason,
    };
    let url = reqwest::Url::parse(&with_scheme).map_err(|error| invalid(error.to_string()))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(invalid("the scheme must be http or https".to_owned()));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid("give the base URL only, without ? or #".to_owned()));
    }
    Ok(with_scheme)
}

/// The innermost cause of an error is the one an operator can act on
/// (`Connection refused (os error 111)` rather than `error sending request`).
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    crate::error_chain::innermost(error).to_string()
}

// What the CLI reads of the API's objects: only the fields it shows, so newer gateways with
// more fields still work.

#[derive(Deserialize)]
struct Page<T> {
    items: Vec<T>,
    next: Option<Id>,
}

#[derive(Deserialize)]
struct ApiService {
    id: Id,
    name: String,
}

/// A route as the CLI reads it: the model's route, each rule optional so an older gateway's
/// answer reads too.
#[derive(Deserialize)]
struct ApiRoute {
    id: Id,
    name: String,
    #[serde(default)]
    hosts: Vec<String>,
    #[serde(default)]
    path_prefix: Option<String>,
    #[serde(default)]
    path_exact: Option<String>,
    #[serde(default)]
    path_regex: Option<String>,
    #[serde(default)]
    headers: Vec<Condition>,
    #[serde(default)]
    query: Vec<Condition>,
    #[serde(default)]
    cookies: Vec<Condition>,
    #[serde(default)]
    service_id: Option<Id>,
    #[serde(default)]
    backends: Vec<Backend>,
    #[serde(default)]
    redirect: Option<Redirect>,
    #[serde(default)]
    rewrite: Option<serde_json::Value>,
    #[serde(default)]
    mirror: Option<Mirror>,
    #[serde(default)]
    cors: Option<serde_json::Value>,
    #[serde(default)]
    request_headers: Option<serde_json::Value>,
    #[serde(default)]
    response_headers: Option<serde_json::Value>,
    #[serde(default)]
    timeouts: Option<RouteTimeouts>,
}

impl ApiRoute {
    fn report(&self, names: &std::collections::HashMap<Id, String>) -> RouteReport {
        let name_of = |id: Id| {
            names
                .get(&id)
                .cloned()
                .unwrap_or_else(|| format!("service {id}"))
        };
        let path = match (&self.path_exact, &self.path_regex, &self.path_prefix) {
            (Some(exact), _, _) => format!("exact {exact}"),
            (None, Some(regex), _) => format!("regex {regex}"),
            (None, None, prefix) => format!("prefix {}", prefix.as_deref().unwrap_or("/")),
        };
        let mut conditions = Vec::new();
        for (kind, list) in [
            ("header", &self.headers),
            ("query", &self.query),
            ("cookie", &self.cookies),
        ] {
            for condition in list {
                conditions.push(match condition.test() {
                    ConditionTest::Value(value) => format!("{kind} {} = {value}", condition.name),
                    ConditionTest::Regex(regex) => format!("{kind} {} ~ {regex}", condition.name),
                    ConditionTest::Present(true) => format!("{kind} {} present", condition.name),
                    ConditionTest::Present(false) => format!("{kind} {} absent", condition.name),
                });
            }
        }
        let backends: Vec<Backend> = match (&self.backends[..], self.service_id) {
            ([], Some(service_id)) => vec![Backend::whole(service_id)],
            (backends, _) => backends.to_vec(),
        };
        let total: u64 = backends.iter().map(|b| u64::from(b.weight)).sum();
        let backends = backends
            .iter()
            .map(|backend| {
                let mut label = name_of(backend.service_id);
                if !backend.subset.is_empty() {
                    let pairs: Vec<String> = backend
                        .subset
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    label.push_str(&format!("{{{}}}", pairs.join(",")));
                }
                if total > 0 && backends.len() > 1 {
                    let percent = u64::from(backend.weight) as f64 * 100.0 / total as f64;
                    label.push_str(&format!(" {} %", (percent * 10.0).round() / 10.0));
                }
                label
            })
            .collect();
        let mut filters = Vec::new();
        if let Some(redirect) = &self.redirect {
            let mut to = Vec::new();
            if let Some(scheme) = &redirect.scheme {
                to.push(format!("scheme {scheme}"));
            }
            if let Some(hostname) = &redirect.hostname {
                to.push(format!("host {hostname}"));
            }
            if let Some(port) = redirect.port {
                to.push(format!("port {port}"));
            }
            if let Some(path) = &redirect.path {
                to.push(format!("path {path}"));
            }
            if let Some(prefix) = &redirect.prefix {
                to.push(format!("prefix {prefix}"));
            }
            filters.push(format!("redirect {} ({})", to.join(" "), redirect.status));
        }
        let present = [
            ("rewrite", self.rewrite.is_some()),
            ("request headers", self.request_headers.is_some()),
            ("response headers", self.response_headers.is_some()),
            ("cors", self.cors.is_some()),
            (
                "timeouts",
                self.timeouts.is_some_and(|timeouts| !timeouts.is_empty()),
            ),
        ];
        filters.extend(
            present
                .iter()
                .filter(|(_, present)| *present)
                .map(|(name, _)| (*name).to_owned()),
        );
        if let Some(mirror) = &self.mirror {
            filters.push(format!(
                "mirror {} {} %",
                name_of(mirror.service_id),
                mirror.percent
            ));
        }
        RouteReport {
            id: self.id,
            name: self.name.clone(),
            hosts: if self.hosts.is_empty() {
                "any host".to_owned()
            } else {
                self.hosts.join(",")
            },
            path,
            conditions,
            backends,
            filters,
        }
    }
}

#[derive(Deserialize)]
struct ApiTarget {
    state: TargetState,
    health: Health,
}

#[derive(Deserialize)]
struct ApiSource {
    id: Id,
    name: String,
    provider: String,
    enabled: bool,
}

#[derive(Deserialize)]
struct ApiSourceStatus {
    state: SourceState,
    #[serde(default)]
    endpoints: EndpointCounts,
    last_error: Option<String>,
    last_refresh_at: Option<DateTime<Utc>>,
    last_success_at: Option<DateTime<Utc>>,
    next_refresh_at: Option<DateTime<Utc>>,
    #[serde(default)]
    failing_since: Option<DateTime<Utc>>,
    #[serde(default)]
    refreshed_by: Option<String>,
    #[serde(default)]
    watch: Option<WatchProgress>,
}

#[derive(Deserialize)]
struct ApiErrorBody {
    error: ApiErrorDetail,
}

#[derive(Deserialize)]
struct ApiErrorDetail {
    message: String,
}

struct Api {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    /// One service's report; `None` when it was deleted while we were reading.
    async fn service(&self, service: ApiService) -> Result<Option<ServiceReport>, StatusError> {
        let targets_path = format!("/api/v1/services/{}/targets", service.id);
        let sources_path = format!("/api/v1/services/{}/discovery-sources", service.id);
        let (targets, sources) = tokio::join!(
            self.list::<ApiTarget>(&targets_path),
            self.list::<ApiSource>(&sources_path)
        );
        let (targets, sources) = match (gone_is_none(targets)?, gone_is_none(sources)?) {
            (Some(targets), Some(sources)) => (targets, sources),
            _ => return Ok(None),
        };
        let mut counts = TargetCounts::default();
        let mut health = HealthCounts::default();
        for target in &targets {
            match target.state {
                TargetState::Active => counts.active += 1,
                TargetState::Draining => counts.draining += 1,
                TargetState::Stale => counts.stale += 1,
            }
            match target.health {
                Health::Healthy => health.healthy += 1,
                Health::Unhealthy => health.unhealthy += 1,
                Health::Unknown => health.unknown += 1,
            }
        }
        let mut reports = Vec::with_capacity(sources.len());
        for source in sources {
            let path = format!("/api/v1/discovery-sources/{}/status", source.id);
            let Some(status) = gone_is_none(self.get::<ApiSourceStatus>(&path).await)? else {
                continue;
            };
            reports.push(SourceReport {
                id: source.id,
                name: source.name,
                provider: source.provider,
                enabled: source.enabled,
                state: status.state,
                endpoints: status.endpoints,
                last_error: status.last_error,
                last_refresh_at: status.last_refresh_at,
                last_success_at: status.last_success_at,
                next_refresh_at: status.next_refresh_at,
                failing_since: status.failing_since,
                refreshed_by: status.refreshed_by,
                watch: status.watch,
            });
        }
        Ok(Some(ServiceReport {
            id: service.id,
            name: service.name,
            targets: counts,
            health,
            sources: reports,
        }))
    }

    /// Every item of a list, following `next` cursors.
    async fn list<T: DeserializeOwned>(&self, path: &str) -> Result<Vec<T>, StatusError> {
        let mut items = Vec::new();
        let mut after: Option<Id> = None;
        loop {
            let page_path = match after {
                None => format!("{path}?limit={PAGE_LIMIT}"),
                Some(cursor) => format!("{path}?limit={PAGE_LIMIT}&after={cursor}"),
            };
            let page: Page<T> = self.get(&page_path).await?;
            let got = page.items.len();
            items.extend(page.items);
            match page.next {
                // A cursor that does not move would loop forever.
                Some(next) if got > 0 && Some(next) != after => after = Some(next),
                _ => return Ok(items),
            }
        }
    }

    /// `/readyz` answers 503 with the same body while not ready; anything unreadable is left out.
    async fn readiness(&self) -> Option<GatewayReport> {
        let response = self
            .http
            .get(format!("{}/readyz", self.base))
            .send()
            .await
            .ok()?;
        response.json().await.ok()
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, StatusError> {
        let url = format!("{}{}", self.base, path);
        let mut request = self.http.get(&url);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let unreachable = |error: reqwest::Error| StatusError::Unreachable {
            url: self.base.clone(),
            reason: if error.is_timeout() {
                "timed out".to_owned()
            } else {
                chain(&error)
            },
        };
        let response = request.send().await.map_err(unreachable)?;
        let status = response.status();
        let body = response.bytes().await.map_err(unreachable)?;
        match status.as_u16() {
            200..=299 => serde_json::from_slice(&body).map_err(|error| StatusError::Decode {
                url,
                reason: error.to_string(),
            }),
            401 if self.token.is_none() => Err(StatusError::MissingToken {
                url: self.base.clone(),
            }),
            401 => Err(StatusError::BadToken {
                url: self.base.clone(),
            }),
            403 => Err(StatusError::Forbidden {
                url: self.base.clone(),
                path: path.split('?').next().unwrap_or(path).to_owned(),
            }),
            code => Err(StatusError::Http {
                url,
                status: code,
                message: error_message(&body),
            }),
        }
    }
}

/// A 404 on a service's or source's sub-resource: it was deleted between two calls.
fn gone_is_none<T>(result: Result<T, StatusError>) -> Result<Option<T>, StatusError> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(StatusError::Http { status: 404, .. }) => Ok(None),
        Err(error) => Err(error),
    }
}

/// The API's `error.message`, else the start of the body as text.
fn error_message(body: &[u8]) -> String {
    if let Ok(parsed) = serde_json::from_slice::<ApiErrorBody>(body) {
        return parsed.error.message;
    }
    let text = one_line(&String::from_utf8_lossy(body));
    match text.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None if text.is_empty() => "(empty body)".to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn at(seconds: i64) -> DateTime<Utc> {
        Utc.timestamp_opt(1_700_000_000 + seconds, 0).unwrap()
    }

    fn source(state: SourceState) -> SourceReport {
        SourceReport {
            id: 7,
            name: "web-registry".to_owned(),
            provider: "http".to_owned(),
            enabled: true,
            state,
            endpoints: EndpointCounts {
                active: 2,
                draining: 1,
                stale: 0,
            },
            last_error: None,
            last_refresh_at: None,
            last_success_at: None,
            next_refresh_at: None,
            failing_since: None,
            refreshed_by: None,
            watch: None,
        }
    }

    fn report(sources: Vec<SourceReport>) -> StatusReport {
        StatusReport {
            admin_url: "http://127.0.0.1:9080".to_owned(),
            fetched_at: at(0),
            gateway: None,
            services: vec![ServiceReport {
                id: 1,
                name: "web".to_owned(),
                targets: TargetCounts {
                    active: 3,
                    draining: 1,
                    stale: 0,
                },
                health: HealthCounts {
                    healthy: 2,
                    unhealthy: 0,
                    unknown: 2,
                },
                sources,
            }],
            routes: Vec::new(),
        }
    }

    #[test]
    fn healthy_source_shows_times_and_counts() {
        let mut healthy = source(SourceState::Healthy);
        healthy.last_refresh_at = Some(at(-5));
        healthy.last_success_at = Some(at(-5));
        healthy.next_refresh_at = Some(at(25));
        let text = render_text(&report(vec![healthy]));
        assert_eq!(
            text,
            "service web (id 1): targets active 3, draining 1, stale 0; health healthy 2, unhealthy 0, unknown 2\n\
             \x20 source web-registry (http): healthy, endpoints active/draining/stale 2/1/0, \
             last success 2023-11-14T22:13:15Z (5s ago), next refresh 2023-11-14T22:13:45Z (in 25s)\n"
        );
    }

    #[test]
    fn pending_source_omits_absent_fields() {
        let text = render_text(&report(vec![source(SourceState::Pending)]));
        assert!(
            text.ends_with(
                "  source web-registry (http): pending, endpoints active/draining/stale 2/1/0\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn failing_source_shows_error_on_one_line() {
        let mut failing = source(SourceState::Failing);
        failing.last_refresh_at = Some(at(-1));
        failing.failing_since = Some(at(-3 * 60));
        failing.last_error = Some("HTTP 503\nfrom registry".to_owned());
        failing.refreshed_by = Some("gw-2".to_owned());
        let text = render_text(&report(vec![failing]));
        assert!(
            text.contains("failing, endpoints active/draining/stale 2/1/0, never succeeded, failing since 2023-11-14T22:10:20Z (3m ago), refreshed by gw-2, last error: HTTP 503 from registry\n"),
            "{text}"
        );
    }

    #[test]
    fn a_watch_shows_whether_it_is_connected_and_its_index() {
        let mut watching = source(SourceState::Healthy);
        watching.provider = "consul".to_owned();
        watching.watch = Some(WatchProgress {
            connected: true,
            since: at(-60),
            index: Some("4711".to_owned()),
        });
        let text = render_text(&report(vec![watching.clone()]));
        assert!(
            text.contains("(consul): healthy, endpoints active/draining/stale 2/1/0, watching at index 4711 since 2023-11-14T22:12:20Z (60s ago)\n"),
            "{text}"
        );
        watching.watch = Some(WatchProgress {
            connected: false,
            since: at(-2),
            index: None,
        });
        watching.next_refresh_at = Some(at(3));
        let text = render_text(&report(vec![watching]));
        assert!(
            text.contains("watch down since 2023-11-14T22:13:18Z (2s ago), next refresh 2023-11-14T22:13:23Z (in 3s)"),
            "{text}"
        );
    }

    #[test]
    fn the_gateway_line_says_why_it_is_not_ready_and_how_its_registration_is() {
        let mut report = report(vec![]);
        report.services.clear();
        report.gateway = Some(GatewayReport {
            status: "draining".to_owned(),
            reason: Some("shutting down".to_owned()),
            ever_resolved: true,
            degraded: true,
            degraded_because: vec!["2 targets ejected".to_owned()],
            ejected_targets: 2,
            registration: Some(RegistrationReport {
                registry: "consul".to_owned(),
                service_id: "gw-1".to_owned(),
                service_name: "raahi".to_owned(),
                address: "10.0.0.7:8080".to_owned(),
                state: "withdrawn".to_owned(),
                since: at(-3),
                last_heartbeat_at: Some(at(-4)),
                last_error: None,
            }),
        });
        let text = render_text(&report);
        assert!(
            text.starts_with(
                "gateway draining: shutting down; degraded: 2 targets ejected\n  registration consul raahi/gw-1 at 10.0.0.7:8080: withdrawn since 2023-11-14T22:13:17Z (3s ago), last heartbeat 2023-11-14T22:13:16Z (4s ago)\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_redirect_route_shows_where_it_sends() {
        let route: ApiRoute = serde_json::from_value(serde_json::json!({
            "id": 4, "name": "to-https", "hosts": ["shop.test"], "path_exact": "/login",
            "service_id": null, "backends": [],
            "redirect": {"scheme": "https", "port": 8443, "status": 301},
            "query": [{"name": "next", "present": false}],
        }))
        .unwrap();
        let line = route_line(&route.report(&Default::default()));
        assert_eq!(
            line,
            "route to-https (id 4): shop.test, exact /login, query next absent; redirect scheme https port 8443 (301)"
        );
    }

    #[test]
    fn no_services_says_so() {
        let mut empty = report(vec![]);
        empty.services.clear();
        assert_eq!(
            render_text(&empty),
            "no services configured at http://127.0.0.1:9080\n"
        );
    }

    #[test]
    fn urls_are_normalised() {
        assert_eq!(
            normalise_url("127.0.0.1:9080/").unwrap(),
            "http://127.0.0.1:9080"
        );
        assert_eq!(
            normalise_url("https://gw.example:9443").unwrap(),
            "https://gw.example:9443"
        );
        assert!(normalise_url("ftp://x").is_err());
        assert!(normalise_url("http://x/?a=1").is_err());
    }

    #[test]
    fn error_messages_come_from_the_api_body() {
        assert_eq!(
            error_message(
                br#"{"error":{"code":"not_found","message":"service 9 not found","field":null}}"#
            ),
            "service 9 not found"
        );
        assert_eq!(
            error_message(b"<h1>Bad\nGateway</h1>"),
            "<h1>Bad Gateway</h1>"
        );
        assert_eq!(error_message(b""), "(empty body)");
    }
}
