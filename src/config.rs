//! Bootstrap configuration: a TOML file whose every key can be overridden by an environment
//! variable named after its path (`proxy.listen` → `RAAHI_PROXY_LISTEN`).

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub const DEFAULT_CONFIG_PATH: &str = "config/raahi.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{file}: cannot read: {reason}")]
    Unreadable { file: String, reason: String },
    #[error("{file}: not valid TOML: {reason}")]
    Syntax { file: String, reason: String },
    #[error("{file}: {key}: {reason}")]
    InvalidKey {
        file: String,
        key: String,
        reason: String,
    },
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub proxy: ProxyConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub database: DatabaseConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub resources: ResourcesConfig,
    #[serde(default)]
    pub tls: TlsConfig,
    #[serde(default)]
    pub cluster: ClusterConfig,
    #[serde(default)]
    pub registration: RegistrationConfig,
    #[serde(default)]
    pub tracing: TracingConfig,
}

/// Where this gateway registers itself (DESIGN §10). Unset: nowhere.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegistrationConfig {
    #[serde(default)]
    pub consul: Option<ConsulRegistration>,
}

/// Self-registration in Consul with a TTL check (README "Registering in Consul").
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsulRegistration {
    /// The Consul agent's HTTP API, normally the local agent.
    #[serde(default = "ConsulRegistration::default_address")]
    pub address: String,
    /// ACL token with `service:write` on `service_name`, sent as `X-Consul-Token`.
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default = "ConsulRegistration::default_service_name")]
    pub service_name: String,
    /// Unset: the instance id (`cluster.instance_id`, or the generated one).
    #[serde(default)]
    pub service_id: Option<String>,
    /// The address clients reach the proxy at; unset: the proxy listener's, which then must not
    /// be a wildcard address.
    #[serde(default)]
    pub advertise_address: Option<IpAddr>,
    /// Unset: the proxy listener's port.
    #[serde(default)]
    pub advertise_port: Option<u16>,
    #[serde(default)]
    pub tags: Vec<String>,
    /// Added to the registration's meta, beside `raahi_version`.
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    /// The TTL check's TTL; the check is passed every third of it.
    #[serde(default = "ConsulRegistration::default_ttl_ms")]
    pub ttl_ms: u64,
    /// After this long critical (the process died), Consul removes the registration; Consul
    /// raises anything under a minute to a minute.
    #[serde(default = "ConsulRegistration::default_deregister_critical_after_ms")]
    pub deregister_critical_after_ms: u64,
}

/// Never shows the token.
impl std::fmt::Debug for ConsulRegistration {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ConsulRegistration")
            .field("address", &self.address)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("service_name", &self.service_name)
            .field("service_id", &self.service_id)
            .field("advertise_address", &self.advertise_address)
            .field("advertise_port", &self.advertise_port)
            .field("ttl_ms", &self.ttl_ms)
            .finish_non_exhaustive()
    }
}

impl ConsulRegistration {
    fn default_address() -> String {
        "http://127.0.0.1:8500".to_owned()
    }
    fn default_service_name() -> String {
        "raahi".to_owned()
    }
    fn default_ttl_ms() -> u64 {
        15_000
    }
    fn default_deregister_critical_after_ms() -> u64 {
        60_000
    }

    /// Where clients reach the proxy, from the bound proxy address.
    pub fn advertised(&self, proxy: SocketAddr) -> SocketAddr {
        SocketAddr::new(
            self.advertise_address.unwrap_or(proxy.ip()),
            self.advertise_port.unwrap_or(proxy.port()),
        )
    }
}

/// Several instances on one PostgreSQL store (see README "Scaling out with PostgreSQL").
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterConfig {
    /// Names this instance in source leases and in source status (`refreshed_by`). Unset: the
    /// host name and a random suffix, new at every start.
    #[serde(default)]
    pub instance_id: Option<String>,
    /// How long a discovery-source lease lasts without renewal (renewed every third of it); when
    /// the refreshing instance dies, another takes over within two of these.
    #[serde(default = "ClusterConfig::default_lease_ms")]
    pub lease_ms: u64,
    /// Period of the change-log read that backs up change notifications (PostgreSQL only;
    /// everything is read at least every 5 minutes).
    #[serde(default = "ClusterConfig::default_resync_ms")]
    pub resync_ms: u64,
    /// How often the gateways exchange their demand of cluster-scope rate limits through the
    /// store (TRAFFIC.md §6).
    #[serde(default = "ClusterConfig::default_rate_sync_ms")]
    pub rate_sync_ms: u64,
    /// The zone this gateway runs in (e.g. `eu-west-1a`): services with `locality` keep their
    /// requests on targets labelled with it (TRAFFIC.md §4). Unset: no zone, locality is off.
    #[serde(default)]
    pub zone: Option<String>,
}

impl ClusterConfig {
    fn default_lease_ms() -> u64 {
        15_000
    }
    fn default_resync_ms() -> u64 {
        15_000
    }
    fn default_rate_sync_ms() -> u64 {
        250
    }

    /// The configured instance id, or a generated one.
    pub fn instance_id_or_generated(&self) -> String {
        self.instance_id.clone().unwrap_or_else(default_instance_id)
    }
}

/// The name this process uses when none is configured: the host name and a random suffix, so two
/// instances on one host (or two in one test process) never share it.
pub fn default_instance_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|name| {
            // Within PostgreSQL's 63-byte application_name, printable ASCII only.
            name.trim()
                .chars()
                .filter(|c| c.is_ascii_graphic())
                .take(48)
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "raahi".to_owned());
    format!("{host}-{:06x}", fastrand::u32(..0x100_0000))
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            instance_id: None,
            lease_ms: Self::default_lease_ms(),
            resync_ms: Self::default_resync_ms(),
            rate_sync_ms: Self::default_rate_sync_ms(),
            zone: None,
        }
    }
}

/// Certificates from files for the HTTPS listener, beside those managed through the admin API.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The default certificate: served to clients that send no SNI or a name no certificate
    /// covers (and also by its own names).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// More certificates, each served for the names it covers.
    #[serde(default)]
    pub certificates: Vec<CertificateFiles>,
}

/// A PEM chain (leaf first) and its private key.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
}

/// Declarative configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourcesConfig {
    /// A TOML file of services, targets, discovery sources and routes, applied at start and on
    /// SIGHUP.
    #[serde(default)]
    pub file: Option<PathBuf>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyConfig {
    /// HTTP/1.1 and HTTP/2 prior-knowledge (h2c) on one port.
    #[serde(default = "ProxyConfig::default_listen")]
    pub listen: SocketAddr,
    /// HTTPS (TLS 1.2 and 1.3, ALPN h2 and http/1.1); unset: no HTTPS listener.
    #[serde(default)]
    pub tls_listen: Option<SocketAddr>,
    /// How long a client may take to send a request's headers.
    #[serde(default = "ProxyConfig::default_client_header_timeout_ms")]
    pub client_header_timeout_ms: u64,
    /// On SIGTERM/SIGINT, how long requests in flight may take to finish.
    #[serde(default = "ProxyConfig::default_shutdown_grace_ms")]
    pub shutdown_grace_ms: u64,
    /// On SIGTERM/SIGINT, how long the proxy keeps accepting after it reported itself draining,
    /// so load balancers and registries stop sending it traffic first. Unset: 0 without a
    /// registration, 5000 with one.
    #[serde(default)]
    pub drain_delay_ms: Option<u64>,
    /// Open client connections per listener; more are closed at once (and counted).
    #[serde(default = "ProxyConfig::default_max_connections")]
    pub max_connections: u32,
    /// Header fields one request may carry (431 beyond).
    #[serde(default = "ProxyConfig::default_max_header_count")]
    pub max_header_count: u32,
    /// Bytes of header fields one request may carry (431 beyond).
    #[serde(default = "ProxyConfig::default_max_header_bytes")]
    pub max_header_bytes: u32,
    /// Length of a request target (414 beyond).
    #[serde(default = "ProxyConfig::default_max_uri_bytes")]
    pub max_uri_bytes: u32,
    /// Streams one HTTP/2 client connection may have open at once.
    #[serde(default = "ProxyConfig::default_http2_max_concurrent_streams")]
    pub http2_max_concurrent_streams: u32,
    /// An HTTP/2 client connection with no open stream is closed (GOAWAY) after this long.
    #[serde(default = "ProxyConfig::default_http2_idle_timeout_ms")]
    pub http2_idle_timeout_ms: u64,
    /// A buffered request body (see a route's `request_buffer_bytes`) must arrive whole within
    /// this long (408 `client_body_timeout`).
    #[serde(default = "ProxyConfig::default_client_body_timeout_ms")]
    pub client_body_timeout_ms: u64,
    /// Memory all request bodies being buffered may hold together; beyond it bodies stream.
    #[serde(default = "ProxyConfig::default_request_buffer_budget_bytes")]
    pub request_buffer_budget_bytes: u64,
    /// The largest body one request may hold in a spool file when it is too large for memory
    /// (413 beyond); 0: such bodies stream to the target instead.
    #[serde(default = "ProxyConfig::default_request_spool_bytes")]
    pub request_spool_bytes: u64,
    /// Bytes all spool files may hold together (413 beyond).
    #[serde(default = "ProxyConfig::default_request_spool_budget_bytes")]
    pub request_spool_budget_bytes: u64,
    /// Where spool files are made (nameless from the start); unset: the system's temporary
    /// directory (`TMPDIR`, else `/tmp`).
    #[serde(default)]
    pub request_spool_dir: Option<PathBuf>,
    /// What a request path's `%2F` or `%5C` (an escaped slash or backslash) gets.
    #[serde(default)]
    pub escaped_slashes: EscapedSlashes,
    /// What Raahi's own 5xx answers tell clients.
    #[serde(default)]
    pub error_details: ErrorDetails,
    /// Accept backlog of the proxy, HTTPS and stream-route listeners (capped by the kernel's
    /// `net.core.somaxconn`).
    #[serde(default = "ProxyConfig::default_listen_backlog")]
    pub listen_backlog: u32,
}

/// `proxy.escaped_slashes`: an escaped slash or backslash in a request path is forwarded as it
/// is, escaped (decoded, it would make segments the client did not send), or refused (400
/// `invalid_path`) for targets that would decode it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum EscapedSlashes {
    #[default]
    Keep,
    Reject,
}

/// How much a 5xx body Raahi writes tells the client; the log line and the events keep
/// everything either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ErrorDetails {
    /// The code and the service; no discovery source, target address or upstream error text.
    #[default]
    Brief,
    /// As the log line tells it, sources and targets included.
    Full,
}

impl ProxyConfig {
    fn default_max_connections() -> u32 {
        20_000
    }
    fn default_max_header_count() -> u32 {
        100
    }
    fn default_max_header_bytes() -> u32 {
        64 * 1024
    }
    fn default_max_uri_bytes() -> u32 {
        8 * 1024
    }
    fn default_http2_max_concurrent_streams() -> u32 {
        100
    }
    fn default_http2_idle_timeout_ms() -> u64 {
        60_000
    }
    fn default_client_body_timeout_ms() -> u64 {
        60_000
    }
    fn default_request_buffer_budget_bytes() -> u64 {
        128 * 1024 * 1024
    }
    fn default_request_spool_bytes() -> u64 {
        1024 * 1024 * 1024
    }
    fn default_request_spool_budget_bytes() -> u64 {
        8 * 1024 * 1024 * 1024
    }

    /// The directory spool files are made in.
    pub fn spool_dir(&self) -> PathBuf {
        self.request_spool_dir
            .clone()
            .unwrap_or_else(std::env::temp_dir)
    }
    fn default_listen_backlog() -> u32 {
        1024
    }
    fn default_listen() -> SocketAddr {
        "0.0.0.0:8080".parse().expect("valid literal")
    }
    fn default_client_header_timeout_ms() -> u64 {
        30_000
    }
    fn default_shutdown_grace_ms() -> u64 {
        30_000
    }
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            listen: Self::default_listen(),
            tls_listen: None,
            client_header_timeout_ms: Self::default_client_header_timeout_ms(),
            shutdown_grace_ms: Self::default_shutdown_grace_ms(),
            drain_delay_ms: None,
            max_connections: Self::default_max_connections(),
            max_header_count: Self::default_max_header_count(),
            max_header_bytes: Self::default_max_header_bytes(),
            max_uri_bytes: Self::default_max_uri_bytes(),
            http2_max_concurrent_streams: Self::default_http2_max_concurrent_streams(),
            http2_idle_timeout_ms: Self::default_http2_idle_timeout_ms(),
            client_body_timeout_ms: Self::default_client_body_timeout_ms(),
            request_buffer_budget_bytes: Self::default_request_buffer_budget_bytes(),
            request_spool_bytes: Self::default_request_spool_bytes(),
            request_spool_budget_bytes: Self::default_request_spool_budget_bytes(),
            request_spool_dir: None,
            escaped_slashes: EscapedSlashes::Keep,
            error_details: ErrorDetails::default(),
            listen_backlog: Self::default_listen_backlog(),
        }
    }
}

impl Config {
    /// `proxy.drain_delay_ms`, or its default: a registry needs time to tell its clients.
    pub fn drain_delay(&self) -> Duration {
        let default = if self.registration.consul.is_some() {
            5_000
        } else {
            0
        };
        Duration::from_millis(self.proxy.drain_delay_ms.unwrap_or(default))
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    #[serde(default = "AdminConfig::default_listen")]
    pub listen: SocketAddr,
    /// An admin token accepted in addition to stored ones; unset, the first start generates one.
    #[serde(default)]
    pub token: Option<String>,
    /// Events kept for event-stream clients that resume with `Last-Event-ID`.
    #[serde(default = "AdminConfig::default_event_ring")]
    pub event_ring: usize,
    /// Events an event-stream client may fall behind before it is cut off (one shared slot per
    /// event: the events themselves are shared with the ring and every client).
    #[serde(default = "AdminConfig::default_event_client_queue")]
    pub event_client_queue: usize,
    /// Open admin connections; past it a new one is closed at once.
    #[serde(default = "AdminConfig::default_max_connections")]
    pub max_connections: u32,
    /// Bytes handed to event-stream clients and not yet written to their sockets, all clients
    /// together; a client whose next frame would pass it is cut off.
    #[serde(default = "AdminConfig::default_event_stream_budget_bytes")]
    pub event_stream_budget_bytes: u64,
}

impl AdminConfig {
    fn default_listen() -> SocketAddr {
        "127.0.0.1:9080".parse().expect("valid literal")
    }

    fn default_event_ring() -> usize {
        10_000
    }

    fn default_event_client_queue() -> usize {
        4_096
    }

    fn default_max_connections() -> u32 {
        1_024
    }

    fn default_event_stream_budget_bytes() -> u64 {
        64 << 20
    }
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: Self::default_listen(),
            token: None,
            event_ring: Self::default_event_ring(),
            event_client_queue: Self::default_event_client_queue(),
            max_connections: Self::default_max_connections(),
            event_stream_budget_bytes: Self::default_event_stream_budget_bytes(),
        }
    }
}

/// Distributed tracing (W3C trace context, spans over OTLP/HTTP). Without `otlp_endpoint`
/// nothing is recorded and trace headers pass through untouched.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The collector's base URL (`http://collector:4318`); `/v1/traces` is appended.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Requests arriving without a trace context that start a recorded trace, in percent.
    /// Requests with one follow their caller's sampled flag.
    #[serde(default)]
    pub sample_percent: f64,
    /// `service.name` of the exported spans.
    #[serde(default = "TracingConfig::default_service_name")]
    pub service_name: String,
    /// Finished requests whose spans wait for the exporter; past it spans are dropped and
    /// counted (`raahi_trace_spans_dropped_total`).
    #[serde(default = "TracingConfig::default_queue_requests")]
    pub queue_requests: usize,
    /// Requests per export call.
    #[serde(default = "TracingConfig::default_batch_requests")]
    pub batch_requests: usize,
    /// How long the first request of a batch waits for others.
    #[serde(default = "TracingConfig::default_batch_delay_ms")]
    pub batch_delay_ms: u64,
    /// An export call that takes longer fails and its spans are counted lost.
    #[serde(default = "TracingConfig::default_export_timeout_ms")]
    pub export_timeout_ms: u64,
}

impl TracingConfig {
    fn default_service_name() -> String {
        "raahi".to_owned()
    }

    fn default_queue_requests() -> usize {
        2_048
    }

    fn default_batch_requests() -> usize {
        256
    }

    fn default_batch_delay_ms() -> u64 {
        1_000
    }

    fn default_export_timeout_ms() -> u64 {
        10_000
    }
}

impl TracingConfig {
    fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let invalid = |key: &str, reason: &str| ConfigError::InvalidKey {
            file: file.to_owned(),
            key: format!("tracing.{key}"),
            reason: reason.to_owned(),
        };
        if let Some(endpoint) = &self.otlp_endpoint {
            let uri = endpoint.parse::<http::Uri>().ok();
            let usable = uri.as_ref().is_some_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https"))
                    && uri.host().is_some()
                    && uri.query().is_none()
            });
            if !usable {
                return Err(invalid(
                    "otlp_endpoint",
                    "expected the collector's base URL, http(s)://HOST:PORT[/PATH]",
                ));
            }
        }
        if !(0.0..=100.0).contains(&self.sample_percent) {
            return Err(invalid("sample_percent", "must be between 0 and 100"));
        }
        if !(1..=1_000_000).contains(&self.queue_requests) {
            return Err(invalid("queue_requests", "must be between 1 and 1000000"));
        }
        if !(1..=self.queue_requests).contains(&self.batch_requests) {
            return Err(invalid(
                "batch_requests",
                "must be between 1 and tracing.queue_requests",
            ));
        }
        if !(1..=60_000).contains(&self.batch_delay_ms) {
            return Err(invalid("batch_delay_ms", "must be between 1 and 60000"));
        }
        if !(1..=300_000).contains(&self.export_timeout_ms) {
            return Err(invalid("export_timeout_ms", "must be between 1 and 300000"));
        }
        Ok(())
    }
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            sample_percent: 0.0,
            service_name: Self::default_service_name(),
            queue_requests: Self::default_queue_requests(),
            batch_requests: Self::default_batch_requests(),
            batch_delay_ms: Self::default_batch_delay_ms(),
            export_timeout_ms: Self::default_export_timeout_ms(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    #[serde(default = "DatabaseConfig::default_url")]
    pub url: String,
}

impl DatabaseConfig {
    fn default_url() -> String {
        "sqlite://data/raahi.db".to_owned()
    }

    /// The URL as it may be printed or logged: without its password.
    pub fn shown_url(&self) -> String {
        match reqwest::Url::parse(&self.url) {
            Ok(mut url) if url.password().is_some() => {
                // Only fails for URLs that cannot have a password, which this one has.
                let _ = url.set_password(None);
                url.to_string()
            }
            _ => self.url.clone(),
        }
    }
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: Self::default_url(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    #[default]
    Json,
    /// `key=value` pairs, one event a line.
    Logfmt,
    /// tracing's human-readable format.
    Text,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    #[serde(default)]
    pub format: LogFormat,
    #[serde(default = "LogConfig::default_level")]
    pub level: String,
}

impl LogConfig {
    fn default_level() -> String {
        "info".to_owned()
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Json,
            level: Self::default_level(),
        }
    }
}

/// Environment variables that override config keys. `RUST_LOG` overrides `log.level`.
const ENV_OVERRIDES: &[(&str, &str)] = &[
    ("RAAHI_PROXY_LISTEN", "proxy.listen"),
    ("RAAHI_PROXY_TLS_LISTEN", "proxy.tls_listen"),
    ("RAAHI_TLS_CERT_FILE", "tls.cert_file"),
    ("RAAHI_TLS_KEY_FILE", "tls.key_file"),
    (
        "RAAHI_PROXY_CLIENT_HEADER_TIMEOUT_MS",
        "proxy.client_header_timeout_ms",
    ),
    ("RAAHI_PROXY_SHUTDOWN_GRACE_MS", "proxy.shutdown_grace_ms"),
    ("RAAHI_PROXY_DRAIN_DELAY_MS", "proxy.drain_delay_ms"),
    ("RAAHI_PROXY_MAX_CONNECTIONS", "proxy.max_connections"),
    ("RAAHI_PROXY_MAX_HEADER_COUNT", "proxy.max_header_count"),
    ("RAAHI_PROXY_MAX_HEADER_BYTES", "proxy.max_header_bytes"),
    ("RAAHI_PROXY_MAX_URI_BYTES", "proxy.max_uri_bytes"),
    (
        "RAAHI_PROXY_HTTP2_MAX_CONCURRENT_STREAMS",
        "proxy.http2_max_concurrent_streams",
    ),
    (
        "RAAHI_PROXY_HTTP2_IDLE_TIMEOUT_MS",
        "proxy.http2_idle_timeout_ms",
    ),
    (
        "RAAHI_PROXY_CLIENT_BODY_TIMEOUT_MS",
        "proxy.client_body_timeout_ms",
    ),
    (
        "RAAHI_PROXY_REQUEST_BUFFER_BUDGET_BYTES",
        "proxy.request_buffer_budget_bytes",
    ),
    ("RAAHI_PROXY_ESCAPED_SLASHES", "proxy.escaped_slashes"),
    (
        "RAAHI_PROXY_REQUEST_SPOOL_BYTES",
        "proxy.request_spool_bytes",
    ),
    (
        "RAAHI_PROXY_REQUEST_SPOOL_BUDGET_BYTES",
        "proxy.request_spool_budget_bytes",
    ),
    ("RAAHI_PROXY_REQUEST_SPOOL_DIR", "proxy.request_spool_dir"),
    ("RAAHI_PROXY_ERROR_DETAILS", "proxy.error_details"),
    ("RAAHI_PROXY_LISTEN_BACKLOG", "proxy.listen_backlog"),
    (
        "RAAHI_REGISTRATION_CONSUL_ADDRESS",
        "registration.consul.address",
    ),
    (
        "RAAHI_REGISTRATION_CONSUL_TOKEN",
        "registration.consul.token",
    ),
    (
        "RAAHI_REGISTRATION_CONSUL_SERVICE_NAME",
        "registration.consul.service_name",
    ),
    (
        "RAAHI_REGISTRATION_CONSUL_SERVICE_ID",
        "registration.consul.service_id",
    ),
    (
        "RAAHI_REGISTRATION_CONSUL_ADVERTISE_ADDRESS",
        "registration.consul.advertise_address",
    ),
    (
        "RAAHI_REGISTRATION_CONSUL_ADVERTISE_PORT",
        "registration.consul.advertise_port",
    ),
    ("RAAHI_REGISTRATION_CONSUL_TAGS", "registration.consul.tags"),
    ("RAAHI_REGISTRATION_CONSUL_META", "registration.consul.meta"),
    (
        "RAAHI_REGISTRATION_CONSUL_TTL_MS",
        "registration.consul.ttl_ms",
    ),
    (
        "RAAHI_REGISTRATION_CONSUL_DEREGISTER_CRITICAL_AFTER_MS",
        "registration.consul.deregister_critical_after_ms",
    ),
    ("RAAHI_ADMIN_LISTEN", "admin.listen"),
    ("RAAHI_ADMIN_TOKEN", "admin.token"),
    ("RAAHI_ADMIN_EVENT_RING", "admin.event_ring"),
    ("RAAHI_ADMIN_EVENT_CLIENT_QUEUE", "admin.event_client_queue"),
    ("RAAHI_ADMIN_MAX_CONNECTIONS", "admin.max_connections"),
    (
        "RAAHI_ADMIN_EVENT_STREAM_BUDGET_BYTES",
        "admin.event_stream_budget_bytes",
    ),
    ("RAAHI_DATABASE_URL", "database.url"),
    ("RAAHI_CLUSTER_INSTANCE_ID", "cluster.instance_id"),
    ("RAAHI_CLUSTER_LEASE_MS", "cluster.lease_ms"),
    ("RAAHI_CLUSTER_RESYNC_MS", "cluster.resync_ms"),
    ("RAAHI_CLUSTER_RATE_SYNC_MS", "cluster.rate_sync_ms"),
    ("RAAHI_CLUSTER_ZONE", "cluster.zone"),
    ("RAAHI_RESOURCES_FILE", "resources.file"),
    ("RAAHI_LOG_FORMAT", "log.format"),
    ("RAAHI_TRACING_OTLP_ENDPOINT", "tracing.otlp_endpoint"),
    ("RAAHI_TRACING_SAMPLE_PERCENT", "tracing.sample_percent"),
    ("RAAHI_TRACING_SERVICE_NAME", "tracing.service_name"),
    ("RAAHI_TRACING_QUEUE_REQUESTS", "tracing.queue_requests"),
    ("RAAHI_TRACING_BATCH_REQUESTS", "tracing.batch_requests"),
    ("RAAHI_TRACING_BATCH_DELAY_MS", "tracing.batch_delay_ms"),
    (
        "RAAHI_TRACING_EXPORT_TIMEOUT_MS",
        "tracing.export_timeout_ms",
    ),
    ("RUST_LOG", "log.level"),
];

impl Config {
    /// Loads `path` (or, when `path` is None, the default path if it exists, else built-in
    /// defaults), then applies environment overrides, then validates.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let (file, text) = match path {
            Some(path) => (path.to_path_buf(), Some(read(path)?)),
            None => {
                let default = PathBuf::from(DEFAULT_CONFIG_PATH);
                let text = default.exists().then(|| read(&default)).transpose()?;
                (default, text)
            }
        };
        let env: Vec<(String, String)> = std::env::vars().collect();
        Self::from_parts(&file.display().to_string(), text.as_deref(), &env)
    }

    /// Parses TOML text (None: empty), applies the given environment, validates.
    pub fn from_parts(
        file: &str,
        text: Option<&str>,
        env: &[(String, String)],
    ) -> Result<Config, ConfigError> {
        let mut table: toml::Table = match text {
            Some(text) => text
                .parse()
                .map_err(|e: toml::de::Error| ConfigError::Syntax {
                    file: file.to_owned(),
                    reason: e.message().to_owned(),
                })?,
            None => toml::Table::new(),
        };
        for (variable, key) in ENV_OVERRIDES {
            if let Some((_, value)) = env.iter().find(|(name, _)| name == variable) {
                set_key(&mut table, key, value);
            }
        }
        let config: Config =
            serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|error| {
                ConfigError::InvalidKey {
                    file: file.to_owned(),
                    key: key_name(error.path().to_string(), error.inner().message()),
                    reason: error.inner().message().to_owned(),
                }
            })?;
        config.validate(file)?;
        Ok(config)
    }

    fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let invalid = |key: &str, reason: &str| ConfigError::InvalidKey {
            file: file.to_owned(),
            key: key.to_owned(),
            reason: reason.to_owned(),
        };
        let url = &self.database.url;
        if !(url.starts_with("sqlite:")
            || url.starts_with("postgres://")
            || url.starts_with("postgresql://"))
        {
            return Err(invalid(
                "database.url",
                "expected sqlite://PATH or postgres://USER@HOST:PORT/DATABASE",
            ));
        }
        if let Some(id) = &self.cluster.instance_id {
            // PostgreSQL keeps 63 printable ASCII bytes of an application_name, which carries the
            // id in change notifications.
            if id.is_empty() || id.len() > 63 || !id.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid(
                    "cluster.instance_id",
                    "must be 1 to 63 printable ASCII characters without spaces",
                ));
            }
        }
        if let Some(zone) = &self.cluster.zone {
            // A Kubernetes label value's limit, and what a zone label can hold.
            if zone.is_empty() || zone.len() > 63 || !zone.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(invalid(
                    "cluster.zone",
                    "must be 1 to 63 printable ASCII characters without spaces",
                ));
            }
        }
        if self.cluster.lease_ms < 300 {
            return Err(invalid("cluster.lease_ms", "must be at least 300"));
        }
        if self.cluster.resync_ms == 0 {
            return Err(invalid("cluster.resync_ms", "must be greater than 0"));
        }
        if self.cluster.rate_sync_ms == 0 {
            return Err(invalid("cluster.rate_sync_ms", "must be greater than 0"));
        }
        if self.tls.cert_file.is_some() != self.tls.key_file.is_some() {
            return Err(invalid(
                if self.tls.cert_file.is_some() {
                    "tls.key_file"
                } else {
                    "tls.cert_file"
                },
                "tls.cert_file and tls.key_file go together",
            ));
        }
        for (key, value) in [
            ("admin.event_ring", self.admin.event_ring),
            ("admin.event_client_queue", self.admin.event_client_queue),
        ] {
            if !(1..=1_000_000).contains(&value) {
                return Err(invalid(key, "must be between 1 and 1000000"));
            }
        }
        for (key, value) in [
            (
                "proxy.client_header_timeout_ms",
                self.proxy.client_header_timeout_ms,
            ),
            ("proxy.max_connections", self.proxy.max_connections.into()),
            ("admin.max_connections", self.admin.max_connections.into()),
            (
                "admin.event_stream_budget_bytes",
                self.admin.event_stream_budget_bytes,
            ),
            ("proxy.max_header_count", self.proxy.max_header_count.into()),
            ("proxy.max_header_bytes", self.proxy.max_header_bytes.into()),
            ("proxy.max_uri_bytes", self.proxy.max_uri_bytes.into()),
            (
                "proxy.http2_max_concurrent_streams",
                self.proxy.http2_max_concurrent_streams.into(),
            ),
            (
                "proxy.http2_idle_timeout_ms",
                self.proxy.http2_idle_timeout_ms,
            ),
            (
                "proxy.client_body_timeout_ms",
                self.proxy.client_body_timeout_ms,
            ),
            ("proxy.listen_backlog", self.proxy.listen_backlog.into()),
        ] {
            if value == 0 {
                return Err(invalid(key, "must be greater than 0"));
            }
        }
        for (key, value) in [
            (
                "proxy.http2_idle_timeout_ms",
                self.proxy.http2_idle_timeout_ms,
            ),
            (
                "proxy.client_body_timeout_ms",
                self.proxy.client_body_timeout_ms,
            ),
        ] {
            if value > MAX_CLIENT_TIMEOUT_MS {
                return Err(invalid(key, "must be at most 86400000 (a day)"));
            }
        }
        if self.proxy.request_spool_budget_bytes < self.proxy.request_spool_bytes {
            return Err(invalid(
                "proxy.request_spool_budget_bytes",
                "must be at least proxy.request_spool_bytes (one largest body must fit)",
            ));
        }
        if let Some(token) = &self.admin.token {
            if token.len() < 16 {
                return Err(invalid("admin.token", "must be at least 16 characters"));
            }
        }
        if let Some(consul) = &self.registration.consul {
            self.validate_consul_registration(consul, file)?;
        }
        self.tracing.validate(file)?;
        if tracing_subscriber::EnvFilter::try_new(&self.log.level).is_err() {
            return Err(invalid(
                "log.level",
                "not a valid level or filter directive",
            ));
        }
        Ok(())
    }
}

impl Config {
    fn validate_consul_registration(
        &self,
        consul: &ConsulRegistration,
        file: &str,
    ) -> Result<(), ConfigError> {
        let invalid = |key: &str, reason: String| ConfigError::InvalidKey {
            file: file.to_owned(),
            key: format!("registration.consul.{key}"),
            reason,
        };
        match reqwest::Url::parse(&consul.address) {
            Ok(url) if matches!(url.scheme(), "http" | "https") && url.host().is_some() => {}
            _ => {
                return Err(invalid(
                    "address",
                    format!(
                        "expected an http:// or https:// URL of the Consul agent, got {:?}",
                        consul.address
                    ),
                ))
            }
        }
        let advertised = consul.advertise_address.unwrap_or(self.proxy.listen.ip());
        if advertised.is_unspecified() {
            let reason = match consul.advertise_address {
                Some(_) => format!("{advertised} is not an address clients can reach"),
                None => format!(
                    "required when proxy.listen is {} (a wildcard address clients cannot reach)",
                    self.proxy.listen
                ),
            };
            return Err(invalid("advertise_address", reason));
        }
        if consul.advertise_port == Some(0) {
            return Err(invalid("advertise_port", "must be 1 to 65535".to_owned()));
        }
        for (key, value) in [
            ("service_name", Some(&consul.service_name)),
            ("service_id", consul.service_id.as_ref()),
            ("token", consul.token.as_ref()),
        ] {
            if let Some(value) = value {
                if value.is_empty() || !value.bytes().all(|b| b.is_ascii_graphic()) {
                    return Err(invalid(
                        key,
                        "must be printable ASCII without spaces".to_owned(),
                    ));
                }
            }
        }
        if !(1_000..=86_400_000).contains(&consul.ttl_ms) {
            return Err(invalid(
                "ttl_ms",
                "must be from 1000 to 86400000".to_owned(),
            ));
        }
        if consul.deregister_critical_after_ms < consul.ttl_ms {
            return Err(invalid(
                "deregister_critical_after_ms",
                "must be at least ttl_ms".to_owned(),
            ));
        }
        Ok(())
    }
}

fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError::Unreadable {
        file: path.display().to_string(),
        reason: e.to_string(),
    })
}

/// Keys whose environment value is a number though their names do not say so.
/// Longest client timeout accepted: a day is past any real use, and keeps deadlines far from
/// the clock's range.
const MAX_CLIENT_TIMEOUT_MS: u64 = 86_400_000;

const COUNT_KEYS: &[&str] = &[
    "admin.event_ring",
    "admin.event_client_queue",
    "admin.max_connections",
    "admin.event_stream_budget_bytes",
    "proxy.max_connections",
    "proxy.max_header_count",
    "proxy.max_header_bytes",
    "proxy.max_uri_bytes",
    "proxy.http2_max_concurrent_streams",
    "proxy.request_buffer_budget_bytes",
    "proxy.request_spool_bytes",
    "proxy.request_spool_budget_bytes",
    "proxy.listen_backlog",
    "tracing.queue_requests",
    "tracing.batch_requests",
];

/// Keys whose environment value is a decimal number.
const DECIMAL_KEYS: &[&str] = &["tracing.sample_percent"];

/// Environment values are strings; durations (`*_ms` keys), ports and counts are stored as
/// integers so they can be overridden too.
fn set_key(table: &mut toml::Table, dotted: &str, value: &str) {
    let mut parts = dotted.split('.').peekable();
    let mut current = table;
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            let parsed = match value.parse::<i64>() {
                Ok(number)
                    if part.ends_with("_ms")
                        || part.ends_with("_port")
                        || COUNT_KEYS.contains(&dotted) =>
                {
                    toml::Value::Integer(number)
                }
                _ if DECIMAL_KEYS.contains(&dotted) => match value.trim().parse::<f64>() {
                    Ok(number) => toml::Value::Float(number),
                    // Left a string: the key's type check names it.
                    Err(_) => toml::Value::String(value.to_owned()),
                },
                // A list in one variable: comma-separated, blanks dropped.
                _ if part == "tags" => toml::Value::Array(
                    value
                        .split(',')
                        .map(str::trim)
                        .filter(|tag| !tag.is_empty())
                        .map(|tag| toml::Value::String(tag.to_owned()))
                        .collect(),
                ),
                // A map in one variable: comma-separated `key=value` pairs.
                _ if part == "meta" => toml::Value::Table(
                    value
                        .split(',')
                        .filter_map(|pair| pair.split_once('='))
                        .map(|(key, value)| {
                            (
                                key.trim().to_owned(),
                                toml::Value::String(value.trim().to_owned()),
                            )
                        })
                        .collect(),
                ),
                _ => toml::Value::String(value.to_owned()),
            };
            current.insert(part.to_owned(), parsed);
            return;
        }
        let entry = current
            .entry(part.to_owned())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if !entry.is_table() {
            *entry = toml::Value::Table(toml::Table::new());
        }
        current = entry.as_table_mut().expect("made a table above");
    }
}

/// serde reports a missing key at its parent's path; name the key itself. (An unknown key's
/// path already ends with its name.)
fn key_name(path: String, message: &str) -> String {
    let missing = message
        .split('`')
        .nth(1)
        .filter(|_| message.starts_with("missing field"));
    match (path.as_str(), missing) {
        (".", Some(name)) => name.to_owned(),
        (_, Some(name)) => format!("{path}.{name}"),
        _ => path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn key_of(error: ConfigError) -> String {
        match error {
            ConfigError::InvalidKey { key, .. } => key,
            other => panic!("not a key error: {other}"),
        }
    }

    #[test]
    fn the_database_url_is_shown_without_its_password() {
        let shown = |url: &str| {
            DatabaseConfig {
                url: url.to_owned(),
            }
            .shown_url()
        };
        assert_eq!(
            shown("postgres://raahi:s3cr3t@db.internal:5432/raahi"),
            "postgres://raahi@db.internal:5432/raahi"
        );
        assert_eq!(
            shown("postgres://raahi@db/raahi"),
            "postgres://raahi@db/raahi"
        );
        assert_eq!(shown("sqlite://data/raahi.db"), "sqlite://data/raahi.db");
    }

    #[test]
    fn a_consul_registration_comes_from_the_file_or_the_environment() {
        let text =
            "[proxy]\nlisten = \"10.0.0.7:8080\"\n[registration.consul]\ntags = [\"edge\"]\n";
        let config = Config::from_parts("raahi.toml", Some(text), &[]).unwrap();
        let consul = config.registration.consul.as_ref().unwrap();
        assert_eq!(consul.address, "http://127.0.0.1:8500");
        assert_eq!(consul.service_name, "raahi");
        assert_eq!(
            (consul.ttl_ms, consul.deregister_critical_after_ms),
            (15_000, 60_000)
        );
        assert_eq!(
            consul.advertised("10.0.0.7:8080".parse().unwrap()),
            "10.0.0.7:8080".parse().unwrap()
        );
        assert_eq!(
            config.drain_delay(),
            Duration::from_secs(5),
            "5 s with a registration"
        );
        assert_eq!(
            Config::default().drain_delay(),
            Duration::ZERO,
            "none without"
        );

        let config = Config::from_parts(
            "raahi.toml",
            None,
            &env(&[
                ("RAAHI_REGISTRATION_CONSUL_ADVERTISE_ADDRESS", "10.0.0.9"),
                ("RAAHI_REGISTRATION_CONSUL_ADVERTISE_PORT", "443"),
                ("RAAHI_REGISTRATION_CONSUL_TAGS", "edge, eu ,"),
                ("RAAHI_REGISTRATION_CONSUL_TTL_MS", "3000"),
                ("RAAHI_REGISTRATION_CONSUL_META", "zone=eu-1, rack = r7"),
                ("RAAHI_REGISTRATION_CONSUL_TOKEN", "s3cr3t-token"),
                ("RAAHI_PROXY_DRAIN_DELAY_MS", "250"),
            ]),
        )
        .unwrap();
        let consul = config.registration.consul.as_ref().unwrap();
        assert_eq!(consul.tags, ["edge", "eu"]);
        assert_eq!(consul.meta.get("zone").map(String::as_str), Some("eu-1"));
        assert_eq!(consul.meta.get("rack").map(String::as_str), Some("r7"));
        assert!(!format!("{consul:?}").contains("s3cr3t"), "{consul:?}");
        assert_eq!(consul.ttl_ms, 3_000);
        assert_eq!(
            consul.advertised("0.0.0.0:8080".parse().unwrap()),
            "10.0.0.9:443".parse().unwrap()
        );
        assert_eq!(config.drain_delay(), Duration::from_millis(250));
    }

    #[test]
    fn a_registration_nobody_can_reach_is_refused_by_key() {
        let refused =
            |text: &str| key_of(Config::from_parts("raahi.toml", Some(text), &[]).unwrap_err());
        // The default proxy.listen is 0.0.0.0:8080: an address must be given.
        assert_eq!(
            refused("[registration.consul]\n"),
            "registration.consul.advertise_address"
        );
        assert_eq!(
            refused("[registration.consul]\nadvertise_address = \"::\"\n"),
            "registration.consul.advertise_address"
        );
        let with = |extra: &str| {
            format!("[registration.consul]\nadvertise_address = \"10.0.0.7\"\n{extra}")
        };
        assert_eq!(
            refused(&with("address = \"consul:8500\"")),
            "registration.consul.address"
        );
        assert_eq!(refused(&with("ttl_ms = 500")), "registration.consul.ttl_ms");
        assert_eq!(
            refused(&with(
                "ttl_ms = 20000\nderegister_critical_after_ms = 10000"
            )),
            "registration.consul.deregister_critical_after_ms"
        );
        assert_eq!(
            refused(&with("service_id = \"a b\"")),
            "registration.consul.service_id"
        );
        assert_eq!(
            refused(&with("advertise_port = 0")),
            "registration.consul.advertise_port"
        );
        assert_eq!(refused(&with("unknown = 1")), "registration.consul.unknown");
    }

    #[test]
    fn defaults_without_file() {
        let config = Config::from_parts("x.toml", None, &[]).unwrap();
        assert_eq!(config.proxy.listen.to_string(), "0.0.0.0:8080");
        assert_eq!(config.admin.listen.to_string(), "127.0.0.1:9080");
        assert_eq!(config.database.url, "sqlite://data/raahi.db");
        assert_eq!(config.log.format, LogFormat::Json);
    }

    #[test]
    fn environment_overrides_file() {
        let text = "[proxy]\nlisten = \"127.0.0.1:1000\"\n";
        let config = Config::from_parts(
            "x.toml",
            Some(text),
            &env(&[
                ("RAAHI_PROXY_LISTEN", "127.0.0.1:2000"),
                ("RAAHI_LOG_FORMAT", "logfmt"),
                ("RAAHI_PROXY_CLIENT_HEADER_TIMEOUT_MS", "1500"),
                ("RAAHI_PROXY_SHUTDOWN_GRACE_MS", "2500"),
            ]),
        )
        .unwrap();
        assert_eq!(config.proxy.listen.to_string(), "127.0.0.1:2000");
        assert_eq!(config.log.format, LogFormat::Logfmt);
        assert_eq!(config.proxy.client_header_timeout_ms, 1500);
        assert_eq!(config.proxy.shutdown_grace_ms, 2500);
    }

    #[test]
    fn invalid_value_names_file_and_key() {
        let error = Config::from_parts("conf.toml", Some("[admin]\nlisten = \"nope\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(error.starts_with("conf.toml: admin.listen: "), "{error}");
    }

    #[test]
    fn tracing_comes_from_the_file_or_the_environment_and_is_checked() {
        let config = Config::from_parts(
            "conf.toml",
            Some("[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\nsample_percent = 1\n"),
            &env(&[
                ("RAAHI_TRACING_SAMPLE_PERCENT", "2.5"),
                ("RAAHI_TRACING_SERVICE_NAME", "edge-eu"),
                ("RAAHI_TRACING_BATCH_DELAY_MS", "50"),
            ]),
        )
        .unwrap();
        assert_eq!(
            config.tracing.otlp_endpoint.as_deref(),
            Some("http://127.0.0.1:4318")
        );
        assert_eq!(config.tracing.sample_percent, 2.5);
        assert_eq!(config.tracing.service_name, "edge-eu");
        assert_eq!(config.tracing.batch_delay_ms, 50);
        assert_eq!(Config::default().tracing.otlp_endpoint, None);
        for (text, key) in [
            (
                "otlp_endpoint = \"collector:4318\"",
                "tracing.otlp_endpoint",
            ),
            ("sample_percent = 101", "tracing.sample_percent"),
            ("sample_percent = -1", "tracing.sample_percent"),
            ("queue_requests = 0", "tracing.queue_requests"),
            (
                "queue_requests = 10\nbatch_requests = 11",
                "tracing.batch_requests",
            ),
        ] {
            let error = Config::from_parts("conf.toml", Some(&format!("[tracing]\n{text}\n")), &[])
                .unwrap_err()
                .to_string();
            assert!(
                error.starts_with(&format!("conf.toml: {key}: ")),
                "{text}: {error}"
            );
        }
        let error = Config::from_parts(
            "conf.toml",
            None,
            &env(&[("RAAHI_TRACING_SAMPLE_PERCENT", "lots")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            error.starts_with("conf.toml: tracing.sample_percent: "),
            "{error}"
        );
    }

    #[test]
    fn unknown_key_is_named() {
        let error = Config::from_parts("conf.toml", Some("[proxy]\nlisen = \"x\"\n"), &[])
            .unwrap_err()
            .to_string();
        assert!(
            error.starts_with("conf.toml: proxy.lisen: unknown field"),
            "{error}"
        );
    }

    #[test]
    fn syntax_error_names_file() {
        let error = Config::from_parts("conf.toml", Some("[proxy\n"), &[]).unwrap_err();
        assert!(matches!(error, ConfigError::Syntax { .. }));
        assert!(error.to_string().starts_with("conf.toml: not valid TOML"));
    }

    #[test]
    fn cluster_keys_have_defaults_and_environment_overrides() {
        let defaults = Config::from_parts("c", None, &[]).unwrap();
        assert_eq!(defaults.cluster.lease_ms, 15_000);
        assert_eq!(defaults.cluster.resync_ms, 15_000);
        assert_eq!(defaults.cluster.instance_id, None);
        let config = Config::from_parts(
            "c",
            None,
            &env(&[
                (
                    "RAAHI_DATABASE_URL",
                    "postgres://raahi@127.0.0.1:5432/raahi",
                ),
                ("RAAHI_CLUSTER_INSTANCE_ID", "gw-1"),
                ("RAAHI_CLUSTER_LEASE_MS", "2000"),
                ("RAAHI_CLUSTER_RESYNC_MS", "5000"),
            ]),
        )
        .unwrap();
        assert_eq!(config.cluster.instance_id.as_deref(), Some("gw-1"));
        assert_eq!(config.cluster.lease_ms, 2000);
        assert_eq!(config.cluster.resync_ms, 5000);
        let error = Config::from_parts("c", None, &env(&[("RAAHI_CLUSTER_INSTANCE_ID", "a b")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("cluster.instance_id"), "{error}");
        let error = Config::from_parts("c", None, &env(&[("RAAHI_CLUSTER_LEASE_MS", "10")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("cluster.lease_ms"), "{error}");
    }

    #[test]
    fn cluster_zone_is_unset_by_default_set_by_file_or_environment_and_checked() {
        let defaults = Config::from_parts("c", None, &[]).unwrap();
        assert_eq!(defaults.cluster.zone, None);
        let file = "[cluster]\nzone = \"eu-west-1a\"\n";
        let from_file = Config::from_parts("c", Some(file), &[]).unwrap();
        assert_eq!(from_file.cluster.zone.as_deref(), Some("eu-west-1a"));
        let config = Config::from_parts(
            "c",
            Some(file),
            &env(&[("RAAHI_CLUSTER_ZONE", "eu-west-1b")]),
        )
        .unwrap();
        assert_eq!(
            config.cluster.zone.as_deref(),
            Some("eu-west-1b"),
            "the environment wins"
        );
        for bad in ["", "zone a", &"z".repeat(64)] {
            let error = Config::from_parts("c", None, &env(&[("RAAHI_CLUSTER_ZONE", bad)]))
                .unwrap_err()
                .to_string();
            assert!(error.contains("cluster.zone"), "{bad:?}: {error}");
        }
    }

    #[test]
    fn rate_sync_ms_has_a_default_an_environment_override_and_must_be_positive() {
        let defaults = Config::from_parts("c", None, &[]).unwrap();
        assert_eq!(defaults.cluster.rate_sync_ms, 250);
        let config = Config::from_parts(
            "c",
            Some("[cluster]\nrate_sync_ms = 500\n"),
            &env(&[("RAAHI_CLUSTER_RATE_SYNC_MS", "100")]),
        )
        .unwrap();
        assert_eq!(config.cluster.rate_sync_ms, 100, "the environment wins");
        let from_file =
            Config::from_parts("c", Some("[cluster]\nrate_sync_ms = 500\n"), &[]).unwrap();
        assert_eq!(from_file.cluster.rate_sync_ms, 500);
        let error = Config::from_parts("c", None, &env(&[("RAAHI_CLUSTER_RATE_SYNC_MS", "0")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("cluster.rate_sync_ms"), "{error}");
    }

    #[test]
    fn short_admin_token_refused() {
        let error = Config::from_parts("c", None, &env(&[("RAAHI_ADMIN_TOKEN", "short")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("admin.token"), "{error}");
    }

    #[test]
    fn client_limits_default_override_and_validate() {
        let defaults = Config::from_parts("c", None, &[]).unwrap().proxy;
        assert_eq!(defaults.max_connections, 20_000);
        assert_eq!(defaults.max_header_count, 100);
        assert_eq!(defaults.max_uri_bytes, 8192);
        assert_eq!(defaults.http2_max_concurrent_streams, 100);
        assert_eq!(defaults.request_buffer_budget_bytes, 128 << 20);
        assert_eq!(defaults.request_spool_bytes, 1 << 30);
        assert_eq!(defaults.request_spool_budget_bytes, 8 << 30);
        assert_eq!(defaults.spool_dir(), std::env::temp_dir());
        let config = Config::from_parts(
            "c",
            Some("[proxy]\nmax_header_bytes = 4096\nhttp2_idle_timeout_ms = 5000\n"),
            &env(&[
                ("RAAHI_PROXY_MAX_CONNECTIONS", "50"),
                ("RAAHI_PROXY_REQUEST_BUFFER_BUDGET_BYTES", "1048576"),
                ("RAAHI_PROXY_CLIENT_BODY_TIMEOUT_MS", "700"),
            ]),
        )
        .unwrap()
        .proxy;
        assert_eq!(config.max_connections, 50);
        assert_eq!(config.max_header_bytes, 4096);
        assert_eq!(config.http2_idle_timeout_ms, 5000);
        assert_eq!(config.request_buffer_budget_bytes, 1 << 20);
        assert_eq!(config.client_body_timeout_ms, 700);
        let spool = Config::from_parts(
            "c",
            Some("[proxy]\nrequest_spool_dir = \"/var/spool/raahi\"\n"),
            &env(&[
                ("RAAHI_PROXY_REQUEST_SPOOL_BYTES", "0"),
                ("RAAHI_PROXY_REQUEST_SPOOL_BUDGET_BYTES", "4096"),
            ]),
        )
        .unwrap()
        .proxy;
        assert_eq!(spool.request_spool_bytes, 0, "0 turns spooling off");
        assert_eq!(spool.request_spool_budget_bytes, 4096);
        assert_eq!(spool.spool_dir(), PathBuf::from("/var/spool/raahi"));
        let error = Config::from_parts(
            "c",
            None,
            &env(&[("RAAHI_PROXY_REQUEST_SPOOL_BUDGET_BYTES", "1048576")]),
        )
        .unwrap_err();
        assert_eq!(key_of(error), "proxy.request_spool_budget_bytes");
        for (variable, key) in [
            ("RAAHI_PROXY_MAX_CONNECTIONS", "proxy.max_connections"),
            ("RAAHI_PROXY_MAX_URI_BYTES", "proxy.max_uri_bytes"),
            (
                "RAAHI_PROXY_HTTP2_MAX_CONCURRENT_STREAMS",
                "proxy.http2_max_concurrent_streams",
            ),
        ] {
            let error = Config::from_parts("c", None, &env(&[(variable, "0")])).unwrap_err();
            assert_eq!(key_of(error), key);
        }
        let error = Config::from_parts(
            "c",
            None,
            &env(&[("RAAHI_PROXY_CLIENT_BODY_TIMEOUT_MS", "18446744073709551615")]),
        )
        .unwrap_err();
        assert_eq!(key_of(error), "proxy.client_body_timeout_ms");
    }

    #[test]
    fn escaped_slashes_default_override_and_validate() {
        let defaults = Config::from_parts("c", None, &[]).unwrap().proxy;
        assert_eq!(defaults.escaped_slashes, EscapedSlashes::Keep);
        let from_file =
            Config::from_parts("c", Some("[proxy]\nescaped_slashes = \"reject\"\n"), &[])
                .unwrap()
                .proxy;
        assert_eq!(from_file.escaped_slashes, EscapedSlashes::Reject);
        let from_env = Config::from_parts(
            "c",
            Some("[proxy]\nescaped_slashes = \"reject\"\n"),
            &env(&[("RAAHI_PROXY_ESCAPED_SLASHES", "keep")]),
        )
        .unwrap()
        .proxy;
        assert_eq!(from_env.escaped_slashes, EscapedSlashes::Keep);
        let error = Config::from_parts(
            "c",
            None,
            &env(&[("RAAHI_PROXY_ESCAPED_SLASHES", "decode")]),
        )
        .unwrap_err();
        assert_eq!(key_of(error), "proxy.escaped_slashes");
    }

    #[test]
    fn listen_backlog_default_override_and_validate() {
        let defaults = Config::from_parts("c", None, &[]).unwrap().proxy;
        assert_eq!(defaults.listen_backlog, 1024);
        let config = Config::from_parts("c", Some("[proxy]\nlisten_backlog = 64\n"), &[])
            .unwrap()
            .proxy;
        assert_eq!(config.listen_backlog, 64);
        let config = Config::from_parts(
            "c",
            Some("[proxy]\nlisten_backlog = 64\n"),
            &env(&[("RAAHI_PROXY_LISTEN_BACKLOG", "7")]),
        )
        .unwrap()
        .proxy;
        assert_eq!(config.listen_backlog, 7);
        for bad in ["0", "-1", "many"] {
            let error = Config::from_parts("c", None, &env(&[("RAAHI_PROXY_LISTEN_BACKLOG", bad)]))
                .unwrap_err();
            assert_eq!(key_of(error), "proxy.listen_backlog", "{bad}");
        }
    }

    #[test]
    fn error_details_default_override_and_validate() {
        let defaults = Config::from_parts("c", None, &[]).unwrap().proxy;
        assert_eq!(defaults.error_details, ErrorDetails::Brief);
        let config = Config::from_parts("c", Some("[proxy]\nerror_details = \"full\"\n"), &[])
            .unwrap()
            .proxy;
        assert_eq!(config.error_details, ErrorDetails::Full);
        let config = Config::from_parts(
            "c",
            Some("[proxy]\nerror_details = \"full\"\n"),
            &env(&[("RAAHI_PROXY_ERROR_DETAILS", "brief")]),
        )
        .unwrap()
        .proxy;
        assert_eq!(config.error_details, ErrorDetails::Brief);
        let error = Config::from_parts("c", None, &env(&[("RAAHI_PROXY_ERROR_DETAILS", "all")]))
            .unwrap_err();
        assert_eq!(key_of(error), "proxy.error_details");
    }

    #[test]
    fn event_stream_limits_default_override_and_validate() {
        let config = Config::from_parts("c", None, &[]).unwrap();
        assert_eq!(
            (config.admin.event_ring, config.admin.event_client_queue),
            (10_000, 4_096)
        );
        let config = Config::from_parts(
            "c",
            Some("[admin]\nevent_ring = 500\n"),
            &env(&[("RAAHI_ADMIN_EVENT_CLIENT_QUEUE", "64")]),
        )
        .unwrap();
        assert_eq!(
            (config.admin.event_ring, config.admin.event_client_queue),
            (500, 64)
        );
        let error = Config::from_parts("c", None, &env(&[("RAAHI_ADMIN_EVENT_RING", "0")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("admin.event_ring"), "{error}");
    }

    #[test]
    fn admin_listener_limits_default_override_and_validate() {
        let config = Config::from_parts("c", None, &[]).unwrap();
        assert_eq!(
            (
                config.admin.max_connections,
                config.admin.event_stream_budget_bytes
            ),
            (1_024, 64 << 20)
        );
        let config = Config::from_parts(
            "c",
            Some("[admin]\nmax_connections = 8\n"),
            &env(&[("RAAHI_ADMIN_EVENT_STREAM_BUDGET_BYTES", "1048576")]),
        )
        .unwrap();
        assert_eq!(
            (
                config.admin.max_connections,
                config.admin.event_stream_budget_bytes
            ),
            (8, 1 << 20)
        );
        for (variable, key) in [
            ("RAAHI_ADMIN_MAX_CONNECTIONS", "admin.max_connections"),
            (
                "RAAHI_ADMIN_EVENT_STREAM_BUDGET_BYTES",
                "admin.event_stream_budget_bytes",
            ),
        ] {
            let error = Config::from_parts("c", None, &env(&[(variable, "0")])).unwrap_err();
            assert_eq!(key_of(error), key);
        }
    }
}
