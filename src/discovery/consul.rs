//! The `consul` provider: the healthy instances of one service in Consul's catalog, watched with
//! blocking queries on `GET /v1/health/service/<service>` (DESIGN §4).
//!
//! Index rules, from Consul's documentation on blocking queries: the first read carries no
//! index (a plain read that answers at once); every later request sends the `X-Consul-Index` of
//! the answer before it with `wait`; an index that went backwards (a restored snapshot, another
//! server) is reset, so the next read is a plain read again; an index below 1 is taken as 1, so 0
//! (meaning "do not block") is never sent back. Rate limiting and reconnecting are the runner's.
//!
//! Every entry is read, not only passing ones (the provider does not send `passing`), so the
//! provider itself decides what a check status means: critical (maintenance is a critical
//! check) is always left out, warning is left out when `passing_only` and otherwise weighted
//! with `Weights.Warning`.
//!
//! Weights: Consul's are DNS SRV weights (it refuses any outside 0 to 65535 and serves them in
//! its SRV answers), so they map like `dns-srv`'s: ×100 while the set's largest is at most 655,
//! else by the one integer factor that keeps the largest within the API's 65535, so proportions
//! stay exact. Unlike an SRV weight, 0 stays 0: in Consul it means "no traffic in this state"
//! (a `Warning` weight of 0), and a target of weight 0 is never picked.
//!
//! An entry without `Weights` (written by a Consul before 1.2.3, which read a missing one as
//! `Passing` 1, or by a foreign server) weighs the source's `weight`, which is in target units
//! where Consul's default `Weights` 1 is 100: it counts as the registry weight `weight`/100 when
//! the set's factor is chosen, and its target weight is `weight` × factor / 100, rounded, never
//! 0 unless `weight` is. At the usual factor 100 that is `weight` itself; when large registry
//! weights shrink the factor, it shrinks in the same proportion as the others.
//!
//! An address must be an IP address: the request path never resolves names, and a name
//! resolved here would go stale between catalog changes, which are the only times a watch
//! answers. An entry whose address is a host name is left out and named in the source's
//! `last_error`.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue, ACCEPT};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::discovery::config::{
    self, check_range, check_url, default_timeout_ms, default_true, default_weight, error,
    registry_weight_scale, render_path, ProviderConfig, SharedKeys,
};
use crate::discovery::registry_client::{
    read_limited, shared_client, ClientBuildError, ClientSettings,
};
use crate::discovery::{
    revision_of, ConfigError, Discovered, DiscoveryError, Fetch, FetchStyle, Registered,
    WatchAnswer, WatchProvider, WatchStream,
};
use crate::error_chain::text as error_chain;
use crate::model::{Endpoint, ProviderKind, MAX_WEIGHT};

pub const PROVIDER: Registered = Registered {
    provider: ProviderKind::Consul,
    style: FetchStyle::Watch,
    description: "Watches the instances of `service` in Consul's catalog with blocking queries \
                  on /v1/health/service; a registration, deregistration or check change reaches \
                  the data path within about a second. Address, port and weight come from each \
                  instance.",
    schema: config::schema_of::<ConsulConfig>,
    validate: config::validate_as::<ConsulConfig>,
    build,
};

/// Consul's own default wait is 5 minutes; ours stays under the 60 s idle timeout common to load
/// balancers and NAT gateways between a gateway and its Consul servers, even with the up to
/// wait/16 Consul adds, and costs about one request a minute per source.
pub const DEFAULT_WAIT_MS: u64 = 55_000;
const WAIT_RANGE: (u64, u64) = (1_000, 600_000);
/// Largest answer read: a catalog answer carries every instance with its checks.
const MAX_ANSWER_BYTES: u64 = 64 * 1024 * 1024;
/// How much longer than its own request bound the runner waits before it takes a watch for dead,
/// so the provider's error, which names the URL, is what an operator reads.
const DEADLINE_MARGIN: Duration = Duration::from_secs(1);

/// Read consistency of the catalog query (Consul's consistency modes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Consistency {
    /// The leader answers (Consul's default).
    #[default]
    Default,
    /// Any server answers, possibly a little behind; spreads the load of many watchers.
    Stale,
    /// The leader answers after confirming it still leads.
    Consistent,
}

/// `consul`: the instances of one service, watched with blocking queries.
#[derive(Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ConsulConfig {
    /// Consul's HTTP API: a local agent (`http://127.0.0.1:8500`) or servers
    /// (`https://consul.internal:8501`).
    #[serde(default = "default_address")]
    #[schemars(url)]
    pub address: String,
    /// The service name as registered in Consul.
    pub service: String,
    /// Only instances carrying every one of these tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// A Consul filter expression, passed through as `filter`, e.g. `Service.Meta.version == "2"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// The datacenter to ask (`dc`); unset: the agent's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacenter: Option<String>,
    /// Consul Enterprise namespace (`ns`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Consul Enterprise admin partition (`partition`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partition: Option<String>,
    /// ACL token, sent as `X-Consul-Token` (never in the URL or a log).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Only instances whose checks all pass; false also takes `warning` ones, weighted with
    /// `Weights.Warning`. Critical instances are always left out.
    #[serde(default = "default_true")]
    pub passing_only: bool,
    /// Read consistency: `default`, `stale` or `consistent`.
    #[serde(default)]
    pub consistency: Consistency,
    /// Milliseconds one blocking query may wait for a change (Consul adds up to 1/16).
    #[serde(default = "default_wait_ms")]
    #[schemars(range(min = 1_000, max = 600_000))]
    pub wait_ms: u64,
    /// Milliseconds a plain read may take, and how much longer than `wait_ms` a blocking one may.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 10, max = 600_000))]
    pub timeout_ms: u64,
    /// Verify the certificate of an `https` address; false accepts any certificate.
    #[serde(default = "default_true")]
    pub tls_verify: bool,
    /// PEM certificates trusted for an `https` address, beside the public roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
    /// Port of instances registered without one (`Service.Port` 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u32>,
    /// Weight of instances without `Service.Weights`, in target units where Consul's default
    /// `Weights` 1 is 100; scaled with the set's registry weights (see the module doc).
    #[serde(default = "default_weight")]
    #[schemars(range(max = 65535))]
    pub weight: u32,
    /// Priority tier of every instance (lower is preferred).
    #[serde(default)]
    pub priority: i32,
}

/// Never shows the token.
impl std::fmt::Debug for ConsulConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ConsulConfig")
            .field("address", &self.address)
            .field("service", &self.service)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish_non_exhaustive()
    }
}

fn default_address() -> String {
    "http://127.0.0.1:8500".to_owned()
}
fn default_wait_ms() -> u64 {
    DEFAULT_WAIT_MS
}

impl ProviderConfig for ConsulConfig {
    fn shared(&self) -> SharedKeys {
        SharedKeys {
            interval_ms: None,
            timeout_ms: self.timeout_ms,
            weight: self.weight,
            port: self.port,
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        check_url("address", &self.address)?;
        check_text("service", &self.service)?;
        for (index, tag) in self.tags.iter().enumerate() {
            check_text(&format!("tags[{index}]"), tag)?;
        }
        for (field, value) in [
            ("filter", &self.filter),
            ("datacenter", &self.datacenter),
            ("namespace", &self.namespace),
            ("partition", &self.partition),
        ] {
            if let Some(value) = value {
                check_text(field, value)?;
            }
        }
        if let Some(token) = &self.token {
            if HeaderValue::from_str(token).is_err() || token.is_empty() {
                return Err(error(
                    "token",
                    "must be a non-empty header value (visible ASCII, no line breaks)",
                ));
            }
        }
        check_range("wait_ms", self.wait_ms, WAIT_RANGE)?;
        if let Some(pem) = &self.ca_pem {
            match reqwest::Certificate::from_pem_bundle(pem.as_bytes()) {
                Ok(certificates) if !certificates.is_empty() => {}
                Ok(_) => return Err(error("ca_pem", "holds no PEM certificate")),
                Err(err) => {
                    return Err(error(
                        "ca_pem",
                        format!("is not valid PEM: {}", error_chain(&err)),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// Values that go into the query string: not empty, no control characters.
fn check_text(field: &str, value: &str) -> Result<(), ConfigError> {
    if value.is_empty() {
        return Err(error(field, "must not be empty"));
    }
    if value.chars().any(char::is_control) {
        return Err(error(field, "must not contain control characters"));
    }
    Ok(())
}

fn build(config: &Value) -> Result<Fetch, ConfigError> {
    let config = config::parse::<ConsulConfig>(config)?;
    Ok(Fetch::Watch {
        provider: Box::new(ConsulProvider::new(&config)?),
    })
}

pub struct ConsulProvider {
    inner: Arc<Watcher>,
}

/// What every request of every watch of one source shares (the client keeps its connection).
struct Watcher {
    /// Shared with every source of the same TLS and connect settings.
    client: Arc<reqwest::Client>,
    /// `<address>/v1/health/service/<service>`.
    url: reqwest::Url,
    /// The same without a user name or password, as errors and logs name it.
    shown_url: String,
    /// The query without `index` and `wait`.
    query: Vec<(&'static str, String)>,
    headers: HeaderMap,
    passing_only: bool,
    default_port: Option<u16>,
    default_weight: u32,
    priority: i32,
    wait: Duration,
    timeout: Duration,
}

impl ConsulProvider {
    /// `config` has passed `validate`.
    pub fn new(config: &ConsulConfig) -> Result<Self, ConfigError> {
        let client = shared_client(&ClientSettings {
            tls_verify: config.tls_verify,
            ca_pem: config.ca_pem.clone(),
            connect_timeout_ms: Some(config.timeout_ms),
        })
        .map_err(|err| match err {
            ClientBuildError::CaPem(_) => error("ca_pem", err.to_string()),
            ClientBuildError::Build(_) => error("", err.to_string()),
        })?;
        let mut url = reqwest::Url::parse(&config.address)
            .map_err(|err| error("address", format!("is not a valid URL: {err}")))?;
        url.path_segments_mut()
            .map_err(|()| error("address", "cannot be a base URL"))?
            .pop_if_empty()
            .extend(["v1", "health", "service", config.service.as_str()]);
        let mut headers = HeaderMap::new();
        headers.insert(ACCEPT, HeaderValue::from_static("application/json"));
        if let Some(token) = &config.token {
            let mut value = HeaderValue::from_str(token)
                .map_err(|_| error("token", "is not a valid header value"))?;
            value.set_sensitive(true);
            headers.insert("x-consul-token", value);
        }
        let mut shown = url.clone();
        // Both only fail for URLs without a host, which `check_url` refused.
        let _ = shown.set_username("");
        let _ = shown.set_password(None);
        Ok(ConsulProvider {
            inner: Arc::new(Watcher {
                client,
                shown_url: shown.to_string(),
                url,
                query: query_of(config),
                headers,
                passing_only: config.passing_only,
                default_port: config.port.and_then(|port| u16::try_from(port).ok()),
                default_weight: config.weight,
                priority: config.priority,
                wait: Duration::from_millis(config.wait_ms),
                timeout: Duration::from_millis(config.timeout_ms),
            }),
        })
    }
}

/// The query parameters every request carries.
fn query_of(config: &ConsulConfig) -> Vec<(&'static str, String)> {
    let mut query = Vec::new();
    for (name, value) in [
        ("dc", &config.datacenter),
        ("ns", &config.namespace),
        ("partition", &config.partition),
        ("filter", &config.filter),
    ] {
        if let Some(value) = value {
            query.push((name, value.clone()));
        }
    }
    // Repeated `tag`: an instance must carry all of them (Consul 1.14 and later).
    query.extend(config.tags.iter().map(|tag| ("tag", tag.clone())));
    match config.consistency {
        Consistency::Default => {}
        Consistency::Stale => query.push(("stale", String::new())),
        Consistency::Consistent => query.push(("consistent", String::new())),
    }
    query
}

impl WatchProvider for ConsulProvider {
    fn watch(&self) -> WatchStream {
        let watcher = Arc::clone(&self.inner);
        Box::pin(futures_util::stream::unfold(
            (watcher, None::<u64>),
            |(watcher, index)| async move {
                let answer = watcher.read(index).await;
                let next_index = match &answer {
                    Ok((_, answered)) => next_index(index, *answered),
                    Err(_) => index,
                };
                let item = answer.map(|(discovered, answered)| WatchAnswer {
                    discovered,
                    position: answered.to_string(),
                });
                Some((item, (watcher, next_index)))
            },
        ))
    }

    fn answer_deadline(&self) -> Option<Duration> {
        Some(self.inner.blocking_bound() + DEADLINE_MARGIN)
    }
}

/// The index to send with the next request, from the one sent and the one answered (already
/// raised to at least 1): a backwards jump resets to a plain read.
pub fn next_index(sent: Option<u64>, answered: u64) -> Option<u64> {
    match sent {
        Some(sent) if answered < sent => None,
        _ => Some(answered),
    }
}

impl Watcher {
    /// The longest a blocking query may take: the wait, Consul's jitter of up to wait/16, and
    /// `timeout_ms` for the rest of the exchange.
    fn blocking_bound(&self) -> Duration {
        self.wait + self.wait / 16 + self.timeout
    }

    /// One request: a plain read without `index`, else a blocking query. Returns the set and the
    /// answer's index (at least 1).
    async fn read(&self, index: Option<u64>) -> Result<(Discovered, u64), DiscoveryError> {
        let mut url = self.url.clone();
        {
            let mut pairs = url.query_pairs_mut();
            for (name, value) in &self.query {
                if value.is_empty() {
                    pairs.append_key_only(name);
                } else {
                    pairs.append_pair(name, value);
                }
            }
            if let Some(index) = index {
                pairs.append_pair("index", &index.to_string());
                pairs.append_pair("wait", &format!("{}ms", self.wait.as_millis()));
            }
        }
        let bound = match index {
            Some(_) => self.blocking_bound(),
            None => self.timeout,
        };
        let response = self
            .client
            .get(url)
            .headers(self.headers.clone())
            .timeout(bound)
            .send()
            .await
            .map_err(|err| self.request_error(err, bound))?;
        let status = response.status();
        let answered = response
            .headers()
            .get("x-consul-index")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok());
        let body = read_limited(response, &self.shown_url, MAX_ANSWER_BYTES, |err| {
            self.request_error(err, bound)
        })
        .await?;
        if !status.is_success() {
            return Err(DiscoveryError::RegistryRefused {
                url: self.shown_url.clone(),
                status: status.as_u16(),
                message: message_of(&body),
            });
        }
        let Some(answered) = answered else {
            return Err(self.bad(
                "X-Consul-Index",
                "the answer has no numeric X-Consul-Index header",
            ));
        };
        let entries: Vec<Entry> =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body))
                .map_err(|err| {
                    let location = render_path(err.path());
                    let reason = err.into_inner().to_string();
                    if location.is_empty() {
                        DiscoveryError::BadJson {
                            url: self.shown_url.clone(),
                            reason,
                        }
                    } else {
                        self.bad(&format!("entries{location}"), &reason)
                    }
                })?;
        Ok((self.discovered(&entries), answered.max(1)))
    }

    fn discovered(&self, entries: &[Entry]) -> Discovered {
        let mut endpoints = Vec::with_capacity(entries.len());
        let mut keys = HashSet::new();
        let mut refusals = Vec::new();
        let mut departures = Vec::new();
        let largest = entries.iter().filter_map(|entry| self.factor_weight(entry));
        let scale = registry_weight_scale(largest.max().unwrap_or(0));
        for entry in entries {
            match self.endpoint_of(entry, scale) {
                Ok(Some(endpoint)) => {
                    // Consul's first word on a key wins; a duplicate would be a catalog bug.
                    if keys.insert(endpoint.key.clone()) {
                        endpoints.push(endpoint);
                    }
                }
                // Listed with failing checks: Consul itself says it is going (or gone).
                Ok(None) => departures.push(entry.key()),
                Err(reason) => refusals.push(format!("{}: {reason}", entry.key())),
            }
        }
        departures.retain(|key| !keys.contains(key));
        Discovered {
            revision: revision_of(&endpoints),
            endpoints,
            ttl: None,
            refused: refused_text(&refusals, entries.len()),
            departures,
        }
    }

    fn takes(&self, status: CheckStatus) -> bool {
        match status {
            CheckStatus::Passing => true,
            CheckStatus::Warning => !self.passing_only,
            CheckStatus::Critical => false,
        }
    }

    /// The entry's `Weights` for its check status, within Consul's own range; None when it has
    /// no `Weights` or its checks leave it out.
    fn registry_weight(&self, entry: &Entry) -> Option<u32> {
        let weights = entry.service.weights.as_ref()?;
        let weight = match entry.status() {
            status if !self.takes(status) => return None,
            CheckStatus::Warning => weights.warning,
            _ => weights.passing,
        };
        Some(clamp_weight(weight))
    }

    /// The registry weight an entry counts as when the set's factor is chosen: its `Weights`,
    /// or `weight`/100 without them; None when its checks leave it out.
    fn factor_weight(&self, entry: &Entry) -> Option<u32> {
        if entry.service.weights.is_none() && self.takes(entry.status()) {
            return Some(self.default_weight / REGISTRY_UNIT);
        }
        self.registry_weight(entry)
    }

    /// The endpoint of one entry; None when its checks leave it out; Err when it cannot be used.
    /// `scale` is the set's factor for registry weights (see the module doc).
    fn endpoint_of(&self, entry: &Entry, scale: u32) -> Result<Option<Endpoint>, String> {
        let status = entry.status();
        if !self.takes(status) {
            return Ok(None);
        }
        let weight = self.registry_weight(entry).map_or_else(
            || unweighted_weight(self.default_weight, scale),
            |weight| weight * scale,
        );
        let address = if entry.service.address.is_empty() {
            &entry.node.address
        } else {
            &entry.service.address
        };
        let host: IpAddr = address.parse().map_err(|_| {
            if address.is_empty() {
                "neither Service.Address nor Node.Address is set".to_owned()
            } else {
                format!(
                    "address {address:?} is not an IP address (Raahi does not resolve names \
                     on the request path; register the instance with an IP address)"
                )
            }
        })?;
        let port = match entry.service.port {
            0 => self
                .default_port
                .ok_or("Service.Port is 0 and the source has no default `port`")?,
            port => port,
        };
        Ok(Some(Endpoint {
            key: entry.key(),
            host: host.to_string(),
            port,
            weight,
            priority: self.priority,
            enabled: true,
            metadata: json!({
                "node": entry.node.node,
                "datacenter": entry.node.datacenter,
                "service_id": entry.service.id,
                "tags": entry.service.tags,
                "meta": entry.service.meta,
                "status": status.as_str(),
            }),
        }))
    }

    fn request_error(&self, err: reqwest::Error, bound: Duration) -> DiscoveryError {
        let reason = if err.is_timeout() {
            format!("no answer within {} ms", bound.as_millis())
        } else {
            error_chain(&err.without_url())
        };
        DiscoveryError::HttpRequest {
            url: self.shown_url.clone(),
            reason,
        }
    }

    fn bad(&self, location: &str, reason: &str) -> DiscoveryError {
        DiscoveryError::BadDocument {
            url: self.shown_url.clone(),
            location: location.to_owned(),
            reason: reason.to_owned(),
        }
    }
}

/// The source's `weight` that stands for Consul's default `Weights` 1.
const REGISTRY_UNIT: u32 = 100;

/// The target weight of an entry without `Weights`: the source's `weight` scaled by the set's
/// factor over the usual 100, rounded half up; at least 1 unless `weight` is 0, so scaling never
/// takes an instance out. Within [`MAX_WEIGHT`] as the factor is at most 100.
fn unweighted_weight(weight: u32, scale: u32) -> u32 {
    if weight == 0 {
        return 0;
    }
    let unit = u64::from(REGISTRY_UNIT);
    let scaled = (u64::from(weight) * u64::from(scale) + unit / 2) / unit;
    u32::try_from(scaled.max(1)).unwrap_or(MAX_WEIGHT)
}

/// Consul refuses weights outside 0 to 65535; one from a broken or foreign server is held to
/// that range rather than refused, as the rest of its entry is still usable.
fn clamp_weight(weight: i64) -> u32 {
    u32::try_from(weight.clamp(0, i64::from(MAX_WEIGHT))).unwrap_or(MAX_WEIGHT)
}

/// The first line of an error answer, as Consul writes it ("ACL not found", "Permission denied").
fn message_of(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let line = text.lines().map(str::trim).find(|line| !line.is_empty());
    let mut message: String = line.unwrap_or("(empty body)").chars().take(200).collect();
    if message.len() < line.map_or(0, str::len) {
        message.push('…');
    }
    message
}

/// "left out 1 of 4 instances: node-3/web-2: …; …", at most a few named.
fn refused_text(refusals: &[String], total: usize) -> Option<String> {
    const NAMED: usize = 3;
    if refusals.is_empty() {
        return None;
    }
    let mut text = format!("left out {} of {total} instances: ", refusals.len());
    text.push_str(&refusals[..refusals.len().min(NAMED)].join("; "));
    if refusals.len() > NAMED {
        let _ = write!(text, "; and {} more", refusals.len() - NAMED);
    }
    Some(text)
}

/// One element of `/v1/health/service/<service>`; only the fields Raahi reads.
#[derive(Debug, Deserialize)]
struct Entry {
    #[serde(rename = "Node")]
    node: Node,
    #[serde(rename = "Service")]
    service: Service,
    #[serde(rename = "Checks", default, deserialize_with = "null_as_default")]
    checks: Vec<Check>,
}

#[derive(Debug, Deserialize)]
struct Node {
    #[serde(rename = "Node")]
    node: String,
    #[serde(rename = "Address", default)]
    address: String,
    #[serde(rename = "Datacenter", default)]
    datacenter: String,
}

#[derive(Debug, Deserialize)]
struct Service {
    #[serde(rename = "ID")]
    id: String,
    #[serde(rename = "Address", default)]
    address: String,
    #[serde(rename = "Port", default)]
    port: u16,
    #[serde(rename = "Tags", default, deserialize_with = "null_as_default")]
    tags: Vec<String>,
    #[serde(rename = "Meta", default, deserialize_with = "null_as_default")]
    meta: BTreeMap<String, String>,
    #[serde(rename = "Weights", default)]
    weights: Option<Weights>,
}

#[derive(Debug, Deserialize)]
struct Weights {
    #[serde(rename = "Passing", default = "one")]
    passing: i64,
    #[serde(rename = "Warning", default = "one")]
    warning: i64,
}

fn one() -> i64 {
    1
}

#[derive(Debug, Deserialize)]
struct Check {
    #[serde(rename = "Status")]
    status: String,
}

/// Consul writes `null` for an empty list or map.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CheckStatus {
    Passing,
    Warning,
    Critical,
}

impl CheckStatus {
    fn as_str(self) -> &'static str {
        match self {
            CheckStatus::Passing => "passing",
            CheckStatus::Warning => "warning",
            CheckStatus::Critical => "critical",
        }
    }
}

impl Entry {
    /// The provider key: `node/service-id`.
    fn key(&self) -> String {
        format!("{}/{}", self.node.node, self.service.id)
    }

    /// The worst of the entry's checks, as Consul aggregates them: any critical one (a
    /// maintenance check is critical, and so is a status Consul may add later) makes the entry
    /// critical, else any warning makes it warning.
    fn status(&self) -> CheckStatus {
        self.checks
            .iter()
            .map(|check| match check.status.as_str() {
                "passing" => CheckStatus::Passing,
                "warning" => CheckStatus::Warning,
                _ => CheckStatus::Critical,
            })
            .max_by_key(|status| *status as u8)
            .unwrap_or(CheckStatus::Passing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: Value) -> ConsulConfig {
        let mut value = json!({"service": "web"});
        value
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let valid = crate::discovery::validate(ProviderKind::Consul, &value).unwrap();
        serde_json::from_value(valid).unwrap()
    }

    fn watcher(extra: Value) -> Arc<Watcher> {
        ConsulProvider::new(&config(extra)).unwrap().inner
    }

    fn entry(node: &str, id: &str, address: &str, port: u16, statuses: &[&str]) -> Value {
        json!({
            "Node": {"Node": node, "Address": "10.1.0.1", "Datacenter": "dc1"},
            "Service": {"ID": id, "Service": "web", "Address": address, "Port": port,
                        "Tags": ["a"], "Meta": {"v": "2"},
                        "Weights": {"Passing": 3, "Warning": 1}},
            "Checks": statuses.iter().map(|status| json!({"Status": status})).collect::<Vec<_>>(),
        })
    }

    fn parse(entries: Value) -> Vec<Entry> {
        serde_json::from_value(entries).unwrap()
    }

    #[test]
    fn defaults_are_filled_and_the_token_is_never_shown() {
        let valid = crate::discovery::validate(
            ProviderKind::Consul,
            &json!({"service": "web", "token": "s3cr3t"}),
        )
        .unwrap();
        assert_eq!(valid["address"], json!("http://127.0.0.1:8500"));
        assert_eq!(valid["passing_only"], json!(true));
        assert_eq!(valid["consistency"], json!("default"));
        assert_eq!(valid["wait_ms"], json!(DEFAULT_WAIT_MS));
        assert_eq!(valid["tls_verify"], json!(true));
        assert!(
            valid.get("interval_ms").is_none(),
            "a watch has no interval"
        );
        let shown = format!("{:?}", config(json!({"token": "s3cr3t"})));
        assert!(!shown.contains("s3cr3t"), "{shown}");
    }

    #[test]
    fn bad_configs_name_their_field() {
        let field = |config: Value| {
            crate::discovery::validate(ProviderKind::Consul, &config)
                .unwrap_err()
                .field
        };
        assert_eq!(field(json!({})), "service");
        assert_eq!(field(json!({"service": ""})), "service");
        assert_eq!(
            field(json!({"service": "web", "address": "ftp://x"})),
            "address"
        );
        assert_eq!(
            field(json!({"service": "web", "tags": ["a", ""]})),
            "tags[1]"
        );
        assert_eq!(field(json!({"service": "web", "wait_ms": 999})), "wait_ms");
        assert_eq!(
            field(json!({"service": "web", "wait_ms": 600_001})),
            "wait_ms"
        );
        assert_eq!(
            field(json!({"service": "web", "consistency": "eventual"})),
            "consistency"
        );
        assert_eq!(field(json!({"service": "web", "token": "a\nb"})), "token");
        assert_eq!(field(json!({"service": "web", "ca_pem": "nope"})), "ca_pem");
        assert_eq!(
            field(json!({"service": "web", "interval_ms": 1000})),
            "interval_ms"
        );
        assert_eq!(field(json!({"service": "web", "port": 0})), "port");
    }

    #[test]
    fn the_query_carries_every_filter_and_no_token() {
        let watcher = watcher(json!({
            "service": "web api", "tags": ["blue", "v2"], "datacenter": "eu",
            "namespace": "team", "partition": "p1", "filter": "Service.Meta.v == \"2\"",
            "consistency": "stale", "token": "s3cr3t",
        }));
        assert_eq!(watcher.url.path(), "/v1/health/service/web%20api");
        let query: Vec<String> = watcher
            .query
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect();
        assert_eq!(
            query,
            [
                "dc=eu",
                "ns=team",
                "partition=p1",
                "filter=Service.Meta.v == \"2\"",
                "tag=blue",
                "tag=v2",
                "stale="
            ]
        );
        assert!(!format!("{query:?}").contains("s3cr3t"));
        assert!(watcher.headers["x-consul-token"].is_sensitive());
    }

    #[test]
    fn the_index_resets_when_it_goes_backwards() {
        assert_eq!(next_index(None, 1), Some(1));
        assert_eq!(next_index(Some(5), 5), Some(5));
        assert_eq!(next_index(Some(5), 9), Some(9));
        assert_eq!(
            next_index(Some(9), 4),
            None,
            "a backwards jump reads plainly"
        );
    }

    #[test]
    fn entries_map_to_endpoints_by_check_status() {
        let strict = watcher(json!({}));
        let entries = parse(json!([
            entry("n1", "web-1", "10.0.0.1", 8080, &["passing", "passing"]),
            entry("n2", "web-2", "", 8080, &["passing", "warning"]),
            entry("n3", "web-3", "10.0.0.3", 8080, &["passing", "critical"]),
            entry("n4", "web-4", "fd00::4", 9090, &[]),
        ]));
        let discovered = strict.discovered(&entries);
        let keys: Vec<&str> = discovered
            .endpoints
            .iter()
            .map(|e| e.key.as_str())
            .collect();
        assert_eq!(keys, ["n1/web-1", "n4/web-4"]);
        assert_eq!(
            discovered.departures,
            ["n2/web-2", "n3/web-3"],
            "listed with failing checks: explicit departures"
        );
        let first = &discovered.endpoints[0];
        assert_eq!(
            (first.host.as_str(), first.port, first.weight),
            ("10.0.0.1", 8080, 300)
        );
        assert_eq!(
            first.metadata,
            json!({"node": "n1", "datacenter": "dc1", "service_id": "web-1", "tags": ["a"],
                   "meta": {"v": "2"}, "status": "passing"})
        );
        assert_eq!(discovered.endpoints[1].host, "fd00::4");
        assert_eq!(discovered.refused, None);

        let lenient = watcher(json!({"passing_only": false, "priority": 2}));
        let discovered = lenient.discovered(&entries);
        let warning = &discovered.endpoints[1];
        assert_eq!(warning.key, "n2/web-2");
        assert_eq!(
            warning.host, "10.1.0.1",
            "Node.Address when Service.Address is empty"
        );
        assert_eq!(
            warning.weight, 100,
            "Weights.Warning 1, scaled like SRV weights"
        );
        assert_eq!(warning.priority, 2);
        assert_eq!(discovered.endpoints.len(), 3, "critical is always left out");
        assert_eq!(discovered.departures, ["n3/web-3"]);
    }

    #[test]
    fn unusable_entries_are_named_not_dropped_silently() {
        let watcher = watcher(json!({}));
        let mut no_weights = entry("n5", "web-5", "10.0.0.5", 0, &["passing"]);
        no_weights["Service"]["Weights"] = Value::Null;
        let entries = parse(json!([
            entry("n1", "web-1", "web.internal", 8080, &["passing"]),
            entry("n2", "web-2", "10.0.0.2", 8080, &["passing"]),
            no_weights,
        ]));
        let discovered = watcher.discovered(&entries);
        assert_eq!(discovered.endpoints.len(), 1);
        let refused = discovered.refused.unwrap();
        assert!(refused.starts_with("left out 2 of 3 instances: n1/web-1: address \"web.internal\" is not an IP address"), "{refused}");
        assert!(refused.contains("n5/web-5: Service.Port is 0"), "{refused}");
        let with_port = self::watcher(json!({"port": 7000, "weight": 40}));
        let endpoint = &with_port.discovered(&entries[2..]).endpoints[0];
        assert_eq!((endpoint.port, endpoint.weight), (7000, 40));
    }

    /// Target weights of passing instances with these `Weights.Passing`, in order.
    fn weights_of(watcher: &Watcher, passing: &[i64]) -> Vec<u32> {
        let entries: Vec<Value> = passing
            .iter()
            .enumerate()
            .map(|(n, weight)| {
                let mut entry = entry("n", &format!("web-{n}"), "10.0.0.1", 80, &["passing"]);
                entry["Service"]["Weights"]["Passing"] = json!(weight);
                entry
            })
            .collect();
        let discovered = watcher.discovered(&parse(Value::Array(entries)));
        discovered.endpoints.iter().map(|e| e.weight).collect()
    }

    #[test]
    fn weights_scale_like_srv_weights_but_zero_means_no_traffic() {
        let watcher = watcher(json!({}));
        assert_eq!(weights_of(&watcher, &[1, 3, 0, -4]), [100, 300, 0, 0]);
        assert_eq!(weights_of(&watcher, &[1, 655]), [100, 65_500]);
    }

    /// ×100 for every weight made 656 a target weight of 65600, which the API refuses; the
    /// set's factor shrinks instead, keeping the proportions exact.
    #[test]
    fn large_weights_stay_within_the_target_limit() {
        let watcher = watcher(json!({}));
        assert_eq!(weights_of(&watcher, &[0, 1, 656]), [0, 99, 656 * 99]);
        assert_eq!(weights_of(&watcher, &[1, 65_535]), [1, 65_535]);
        assert_eq!(
            weights_of(&watcher, &[1, 1 << 40]),
            [1, 65_535],
            "beyond what Consul accepts: held to its range"
        );
        // The factor follows the weights in use: a warning entry's when warning ones are taken.
        let mut warning = entry("n", "web-w", "10.0.0.1", 80, &["warning"]);
        warning["Service"]["Weights"]["Warning"] = json!(1000);
        let entries = parse(json!([
            entry("n", "web-1", "10.0.0.1", 80, &["passing"]),
            warning
        ]));
        let strict: Vec<u32> = watcher
            .discovered(&entries)
            .endpoints
            .iter()
            .map(|e| e.weight)
            .collect();
        assert_eq!(strict, [300], "Weights.Passing 3, the warning one left out");
        let lenient = self::watcher(json!({"passing_only": false}));
        let both: Vec<u32> = lenient
            .discovered(&entries)
            .endpoints
            .iter()
            .map(|e| e.weight)
            .collect();
        assert_eq!(both, [3 * 65, 1000 * 65]);
    }

    /// An entry without `Weights` next to these `Weights.Passing`: all target weights, the
    /// unweighted one first.
    fn with_unweighted(weight: u32, passing: &[i64]) -> Vec<u32> {
        let watcher = watcher(json!({"weight": weight}));
        let mut unweighted = entry("n", "web-u", "10.0.0.1", 80, &["passing"]);
        unweighted["Service"]["Weights"] = Value::Null;
        let mut entries = vec![unweighted];
        entries.extend(passing.iter().enumerate().map(|(n, weight)| {
            let mut entry = entry("n", &format!("web-{n}"), "10.0.0.1", 80, &["passing"]);
            entry["Service"]["Weights"]["Passing"] = json!(weight);
            entry
        }));
        let discovered = watcher.discovered(&parse(Value::Array(entries)));
        discovered.endpoints.iter().map(|e| e.weight).collect()
    }

    /// The source's `weight` stands for Consul's default `Weights` 1 at 100: with a large
    /// registry weight in the set it shrinks with the others instead of keeping 100, which made
    /// an unweighted instance weigh as much as a `Weights` 1.5 one beside a `Weights` 1000.
    #[test]
    fn entries_without_weights_scale_like_the_others() {
        assert_eq!(with_unweighted(100, &[1, 3]), [100, 100, 300], "factor 100");
        assert_eq!(with_unweighted(40, &[]), [40], "alone: the source's weight");
        assert_eq!(with_unweighted(65_535, &[655]), [65_535, 65_500]);
        assert_eq!(with_unweighted(100, &[1000]), [65, 65_000], "factor 65");
        assert_eq!(
            with_unweighted(250, &[65_535]),
            [3, 65_535],
            "2.5 rounds up"
        );
        assert_eq!(
            with_unweighted(1, &[65_535]),
            [1, 65_535],
            "never 0 unless `weight` is"
        );
        assert_eq!(with_unweighted(0, &[65_535]), [0, 65_535]);
        // Proportions between weighted and unweighted entries hold at every factor.
        assert_eq!(
            with_unweighted(300, &[3, 6_000]),
            [30, 30, 60_000],
            "factor 10: `weight` 300 weighs as `Weights` 3"
        );
    }

    #[test]
    fn errors_never_name_a_password_in_the_address() {
        let watcher = watcher(json!({"address": "https://ops:pa55@consul.internal:8501/api"}));
        assert_eq!(
            watcher.shown_url,
            "https://consul.internal:8501/api/v1/health/service/web"
        );
        assert_eq!(watcher.url.password(), Some("pa55"), "still sent");
        let error = watcher.bad("X", "y").to_string();
        assert!(!error.contains("pa55") && !error.contains("ops"), "{error}");
    }

    #[test]
    fn many_refusals_are_counted_not_all_named() {
        let refusals: Vec<String> = (0..5).map(|i| format!("n{i}/x: bad")).collect();
        let text = refused_text(&refusals, 9).unwrap();
        assert_eq!(
            text,
            "left out 5 of 9 instances: n0/x: bad; n1/x: bad; n2/x: bad; and 2 more"
        );
    }

    #[test]
    fn error_bodies_are_cut_to_their_first_line() {
        assert_eq!(message_of(b"ACL not found\n"), "ACL not found");
        assert_eq!(message_of(b""), "(empty body)");
        assert_eq!(message_of(&[b'x'; 300]).chars().count(), 201);
    }

    #[test]
    fn a_malformed_entry_is_located() {
        let watcher = watcher(json!({}));
        let mut bad = entry("n1", "web-1", "10.0.0.1", 8080, &[]);
        bad["Service"]["Port"] = json!("eighty");
        let body = serde_json::to_vec(&json!([entry("n0", "w", "10.0.0.9", 1, &[]), bad])).unwrap();
        let entries: Result<Vec<Entry>, _> =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_slice(&body));
        let location = render_path(entries.unwrap_err().path());
        assert_eq!(format!("entries{location}"), "entries[1].Service.Port");
        drop(watcher);
    }
}
