//! The `kubernetes` provider: the endpoints of one Service, read from its EndpointSlices with
//! list + watch (DESIGN §4).
//!
//! kube-rs's watcher does the protocol: a paged list, then watches from the list's resource
//! version with bookmarks, a relist after 410 Gone, a new watch when the server ends one
//! (`timeoutSeconds`), and an idle timeout that catches a silently dead connection. This module
//! keeps the slices the watcher reports and turns them into whole endpoint sets
//! ([`endpoints_of`], pure):
//! - provider key `address:port` (`[address]:port` for IPv6), one endpoint per key across slices
//!   (the best state wins: ready over serving-and-terminating);
//! - `ready` endpoints are the set; `serving` ∧ `terminating` ones are left out (so reconcile
//!   drains them: no new requests, in-flight ones finish) unless no endpoint is ready, when they
//!   are the set (KEP-1669: a Service whose pods all terminate keeps serving through them);
//!   anything else is left out;
//! - the port is the Service port named by `port`, or the slice port with that number, or the
//!   only TCP port when `port` is unset.
//!
//! Credentials are read when a watch opens and on every request (the token file), so rotated
//! bound service-account tokens and a file that appears later both work; a missing file is a
//! failed refresh naming it, never a config error, since instances sharing a store may differ.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::{Stream, StreamExt};
use http::header::AUTHORIZATION;
use http::HeaderValue;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::discovery::config::{
    self, check_range, check_url, default_timeout_ms, default_true, default_weight, error,
    ProviderConfig, SharedKeys,
};
use crate::discovery::registry_client::error_chain;
use crate::discovery::{
    revision_of, ConfigError, Discovered, DiscoveryError, Fetch, FetchStyle, Registered,
    WatchAnswer, WatchProvider, WatchStream,
};
use crate::model::{Endpoint, ProviderKind};

pub const PROVIDER: Registered = Registered {
    provider: ProviderKind::Kubernetes,
    style: FetchStyle::Watch,
    description: "Watches the EndpointSlices of one Kubernetes Service (list + watch); pods \
                  becoming ready, terminating or gone reach the data path within about a \
                  second. Runs in the cluster with its service account, or outside with \
                  `api_server` or `kubeconfig`.",
    schema: config::schema_of::<KubernetesConfig>,
    validate: config::validate_as::<KubernetesConfig>,
    build,
};

/// Where a pod's service account is mounted (the in-cluster defaults).
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Seconds the API server keeps one watch request open (kube-rs's and client-go's order of
/// magnitude): an idle source costs one request about every five minutes.
pub const WATCH_TIMEOUT_SECS: u32 = 290;
/// How long after a change the events that follow it are taken into the same set. The
/// EndpointSlice controller writes a rollout's changes slice by slice, milliseconds apart.
const BURST_WINDOW: Duration = Duration::from_millis(50);
/// The label the EndpointSlice controller puts on every slice of a Service.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// `kubernetes`: the endpoints of one Service, watched through its EndpointSlices.
#[derive(Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    /// The Service's name.
    pub service: String,
    /// The Service's namespace; unset: the kubeconfig context's, else the pod's own (the
    /// service-account namespace file), else `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The Service port's name, or the endpoints' port number; required when the slices carry
    /// more than one TCP port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortRef>,
    /// The API server's URL; unset: the kubeconfig's, else in-cluster from
    /// `KUBERNETES_SERVICE_HOST` and `KUBERNETES_SERVICE_PORT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(url)]
    pub api_server: Option<String>,
    /// A bearer token file, read on every request (rotated tokens keep working); unset: the
    /// kubeconfig's credentials, else the pod's service-account token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_file: Option<String>,
    /// PEM certificates that sign the API server's certificate; unset: the kubeconfig's, else
    /// the service account's `ca.crt` in a cluster, else the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    /// A kubeconfig file, for running outside the cluster (its current context).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<String>,
    /// Verify the API server's certificate; false accepts any certificate.
    #[serde(default = "default_true")]
    pub tls_verify: bool,
    /// Milliseconds a list (the first read, and every relist) may take.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 10, max = 600_000))]
    pub timeout_ms: u64,
    /// Weight of every endpoint.
    #[serde(default = "default_weight")]
    #[schemars(range(max = 65535))]
    pub weight: u32,
    /// Priority tier of every endpoint (lower is preferred).
    #[serde(default)]
    pub priority: i32,
}

/// A port by the Service port's name or by number.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(untagged)]
pub enum PortRef {
    Number(u32),
    Name(String),
}

impl std::fmt::Display for PortRef {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PortRef::Number(number) => write!(formatter, "{number}"),
            PortRef::Name(name) => write!(formatter, "{name:?}"),
        }
    }
}

/// Shows paths, never credentials (there are none inline).
impl std::fmt::Debug for KubernetesConfig {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("KubernetesConfig")
            .field("service", &self.service)
            .field("namespace", &self.namespace)
            .field("port", &self.port)
            .field("api_server", &self.api_server)
            .finish_non_exhaustive()
    }
}

impl ProviderConfig for KubernetesConfig {
    fn shared(&self) -> SharedKeys {
        SharedKeys {
            interval_ms: None,
            timeout_ms: self.timeout_ms,
            weight: self.weight,
            port: match self.port {
                Some(PortRef::Number(number)) => Some(number),
                _ => None,
            },
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        check_dns_label("service", &self.service, true)?;
        if let Some(namespace) = &self.namespace {
            check_dns_label("namespace", namespace, false)?;
        }
        if let Some(PortRef::Name(name)) = &self.port {
            match name.parse::<u32>() {
                Ok(number) => check_range("port", number, (1, 65_535))?,
                Err(_) => check_dns_label("port", name, false)?,
            }
        }
        if let Some(url) = &self.api_server {
            check_url("api_server", url)?;
        }
        for (field, path) in [
            ("token_file", &self.token_file),
            ("ca_file", &self.ca_file),
            ("kubeconfig", &self.kubeconfig),
        ] {
            if let Some(path) = path {
                if path.is_empty() || path.chars().any(char::is_control) {
                    return Err(error(
                        field,
                        "must be a file path (not empty, no control characters)",
                    ));
                }
            }
        }
        Ok(())
    }

    /// A port name of digits only is a number (Kubernetes names always hold a letter).
    fn normalise(&mut self) {
        if let Some(PortRef::Name(name)) = &self.port {
            if let Ok(number) = name.parse::<u32>() {
                self.port = Some(PortRef::Number(number));
            }
        }
    }
}

/// Kubernetes object names: RFC 1123 labels (`service` is a RFC 1035 label: it starts with a
/// letter). Nothing else can reach the label selector or the URL.
fn check_dns_label(field: &str, value: &str, letter_first: bool) -> Result<(), ConfigError> {
    let bytes = value.as_bytes();
    let valid = (1..=63).contains(&bytes.len())
        && bytes
            .iter()
            .all(|byte| byte.is_ascii_lowercase() || byte.is_ascii_digit() || *byte == b'-')
        && bytes[0] != b'-'
        && bytes[bytes.len() - 1] != b'-'
        && (!letter_first || bytes[0].is_ascii_lowercase());
    if valid {
        return Ok(());
    }
    let first = if letter_first {
        "a letter"
    } else {
        "a letter or digit"
    };
    Err(error(
        field,
        format!(
            "must be a Kubernetes name: 1 to 63 lower-case letters, digits or '-', starting with \
             {first} and ending with a letter or digit, got {value:?}"
        ),
    ))
}

fn build(config: &Value) -> Result<Fetch, ConfigError> {
    let config = config::parse::<KubernetesConfig>(config)?;
    Ok(Fetch::Watch {
        provider: Box::new(KubernetesProvider {
            config: Arc::new(config),
        }),
    })
}

pub struct KubernetesProvider {
    config: Arc<KubernetesConfig>,
}

impl WatchProvider for KubernetesProvider {
    fn watch(&self) -> WatchStream {
        let config = Arc::clone(&self.config);
        Box::pin(
            futures_util::stream::once(async move { Follower::open(config).await }).flat_map(
                |opened| -> WatchStream {
                    match opened {
                        Ok(follower) => Box::pin(follower.answers()),
                        Err(error) => Box::pin(futures_util::stream::iter([Err(error)])),
                    }
                },
            ),
        )
    }

    /// kube-rs renews watch requests inside the stream and times out a connection idle past
    /// `timeoutSeconds` itself; lists are bounded by `timeout_ms` here.
    fn answer_deadline(&self) -> Option<Duration> {
        None
    }
}

/// Where the API server is and who we are to it, resolved when a watch opens.
struct Connection {
    client: kube::Client,
    namespace: String,
    /// The list URL, as `last_error` names it.
    shown_url: String,
}

impl Connection {
    async fn open(config: &KubernetesConfig) -> Result<Connection, DiscoveryError> {
        let in_cluster = config.api_server.is_none() && config.kubeconfig.is_none();
        let mut client_config = match (&config.kubeconfig, &config.api_server) {
            (Some(path), _) => from_kubeconfig(Path::new(path)).await?,
            (None, Some(url)) => kube::Config::new(parse_uri("api_server", url)?),
            (None, None) => kube::Config::new(in_cluster_uri()?),
        };
        if let Some(url) = &config.api_server {
            client_config.cluster_url = parse_uri("api_server", url)?;
        }
        let default_dir = Path::new(SERVICE_ACCOUNT_DIR);
        let ca_file = match &config.ca_file {
            Some(path) => Some(PathBuf::from(path)),
            None if in_cluster => Some(default_dir.join("ca.crt")),
            None => None,
        };
        if let Some(path) = ca_file {
            client_config.root_cert = Some(read_certificates(&path)?);
            client_config.root_cert_file = None;
        }
        client_config.accept_invalid_certs = !config.tls_verify;
        let token = match &config.token_file {
            Some(path) => Some(TokenFile::open(PathBuf::from(path))?),
            None if in_cluster => Some(TokenFile::open(default_dir.join("token"))?),
            // Outside a cluster without a kubeconfig (`kubectl proxy`, a test server), the pod's
            // token is used only when there is one.
            None if config.kubeconfig.is_none() => TokenFile::open(default_dir.join("token")).ok(),
            None => None,
        };
        if token.is_some() {
            client_config.auth_info = Default::default();
        }
        let timeout = Duration::from_millis(config.timeout_ms);
        client_config.connect_timeout = Some(timeout);
        client_config.write_timeout = Some(timeout);
        // A read may wait as long as a watch request lasts; a shorter bound would cut idle
        // watches, a longer one would leave a hung request unnoticed.
        client_config.read_timeout =
            Some(Duration::from_secs(u64::from(WATCH_TIMEOUT_SECS) + 5) + timeout);
        client_config.reset_reader_on_write = true;
        // The runner retries with its own backoff and reports each failure.
        client_config.default_retry = false;
        let namespace = match &config.namespace {
            Some(namespace) => namespace.clone(),
            None if config.kubeconfig.is_some() => client_config.default_namespace.clone(),
            None => std::fs::read_to_string(default_dir.join("namespace"))
                .ok()
                .map(|text| text.trim().to_owned())
                .filter(|namespace| !namespace.is_empty())
                .unwrap_or_else(|| "default".to_owned()),
        };
        let shown_url = format!(
            "{}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices?labelSelector={SERVICE_NAME_LABEL}={}",
            client_config.cluster_url.to_string().trim_end_matches('/'),
            config.service
        );
        let builder = kube::client::ClientBuilder::try_from(client_config).map_err(|err| {
            DiscoveryError::ClientSetup {
                reason: format!(
                    "cannot build a client for the API server: {}",
                    error_chain(&err)
                ),
            }
        })?;
        let client = match token {
            Some(token) => builder
                .with_layer(&tower::util::MapRequestLayer::new(
                    move |mut request: http::Request<kube::client::Body>| {
                        if let Some(value) = token.current() {
                            request.headers_mut().insert(AUTHORIZATION, value);
                        }
                        request
                    },
                ))
                .build(),
            None => builder.build(),
        };
        Ok(Connection {
            client,
            namespace,
            shown_url,
        })
    }

    fn refused(&self, status: &kube::core::Status) -> DiscoveryError {
        let mut message = if status.message.is_empty() {
            status.reason.clone()
        } else {
            status.message.clone()
        };
        if status.code == 401 {
            message.push_str(" (the API server did not accept the bearer token)");
        }
        DiscoveryError::RegistryRefused {
            url: self.shown_url.clone(),
            status: status.code,
            message,
        }
    }

    fn failed(&self, err: &kube::Error) -> DiscoveryError {
        match err {
            kube::Error::Api(status) => self.refused(status),
            other => DiscoveryError::HttpRequest {
                url: self.shown_url.clone(),
                reason: error_chain(other),
            },
        }
    }
}

fn parse_uri(field: &str, url: &str) -> Result<http::Uri, DiscoveryError> {
    url.parse().map_err(|err| DiscoveryError::ClientSetup {
        reason: format!("{field} {url:?} is not a usable URL: {err}"),
    })
}

/// The API server as a pod sees it (what client-go's `InClusterConfig` reads).
fn in_cluster_uri() -> Result<http::Uri, DiscoveryError> {
    let host = std::env::var("KUBERNETES_SERVICE_HOST").ok();
    let port = std::env::var("KUBERNETES_SERVICE_PORT").ok();
    let (Some(host), Some(port)) = (host.filter(|h| !h.is_empty()), port) else {
        return Err(DiscoveryError::ClientSetup {
            reason: "not running in a cluster (KUBERNETES_SERVICE_HOST and \
                     KUBERNETES_SERVICE_PORT are unset): set api_server or kubeconfig"
                .to_owned(),
        });
    };
    let authority = match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => format!("[{host}]:{port}"),
        _ => format!("{host}:{port}"),
    };
    parse_uri("KUBERNETES_SERVICE_HOST", &format!("https://{authority}"))
}

async fn from_kubeconfig(path: &Path) -> Result<kube::Config, DiscoveryError> {
    let file = kube::config::Kubeconfig::read_from(path)
        .map_err(|err| local_file("kubeconfig", path, error_chain(&err)))?;
    kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|err| local_file("kubeconfig", path, error_chain(&err)))
}

fn local_file(what: &str, path: &Path, reason: String) -> DiscoveryError {
    DiscoveryError::LocalFile {
        what: what.to_owned(),
        path: path.display().to_string(),
        reason,
    }
}

/// The DER certificates of a PEM file.
fn read_certificates(path: &Path) -> Result<Vec<Vec<u8>>, DiscoveryError> {
    use rustls_pki_types::pem::PemObject;
    let text = std::fs::read(path).map_err(|err| local_file("CA file", path, err.to_string()))?;
    let certificates = rustls_pki_types::CertificateDer::pem_slice_iter(&text)
        .map(|certificate| certificate.map(|der| der.to_vec()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| local_file("CA file", path, format!("is not valid PEM: {err}")))?;
    if certificates.is_empty() {
        return Err(local_file(
            "CA file",
            path,
            "holds no PEM certificate".to_owned(),
        ));
    }
    Ok(certificates)
}

/// A bearer token file, read again for every request: a bound service-account token is
/// rotated on disk by the kubelet and a refused one must not outlive its replacement. When a
/// later read fails the last token read is kept (client-go does the same, kubernetes#68164).
struct TokenFile {
    path: PathBuf,
    last: Mutex<HeaderValue>,
}

impl TokenFile {
    fn open(path: PathBuf) -> Result<Arc<TokenFile>, DiscoveryError> {
        let value = Self::read(&path)?;
        Ok(Arc::new(TokenFile {
            path,
            last: Mutex::new(value),
        }))
    }

    fn read(path: &Path) -> Result<HeaderValue, DiscoveryError> {
        let text = std::fs::read_to_string(path)
            .map_err(|err| local_file("token file", path, err.to_string()))?;
        let token = text.trim();
        if token.is_empty() {
            return Err(local_file("token file", path, "is empty".to_owned()));
        }
        let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| {
            local_file(
                "token file",
                path,
                "holds characters a header cannot carry".to_owned(),
            )
        })?;
        value.set_sensitive(true);
        Ok(value)
    }

    fn current(&self) -> Option<HeaderValue> {
        let mut last = self.last.lock().ok()?;
        if let Ok(value) = Self::read(&self.path) {
            *last = value;
        }
        Some(last.clone())
    }
}

/// One open watch: kube-rs's watcher and the slices it reported.
struct Follower {
    connection: Connection,
    config: Arc<KubernetesConfig>,
    events: std::pin::Pin<
        Box<dyn Stream<Item = Result<watcher::Event<EndpointSlice>, watcher::Error>> + Send>,
    >,
    /// The slices as of the last complete list and the events since, by name.
    slices: BTreeMap<String, EndpointSlice>,
    /// A list in progress (kube-rs's `Init` .. `InitDone`).
    listing: Option<BTreeMap<String, EndpointSlice>>,
    /// The resource version of the newest object seen.
    position: String,
}

impl Follower {
    async fn open(config: Arc<KubernetesConfig>) -> Result<Follower, DiscoveryError> {
        let connection = Connection::open(&config).await?;
        let api = kube::Api::<EndpointSlice>::namespaced(
            connection.client.clone(),
            &connection.namespace,
        );
        let watch_config = watcher::Config::default()
            .labels(&format!("{SERVICE_NAME_LABEL}={}", config.service))
            .timeout(WATCH_TIMEOUT_SECS);
        Ok(Follower {
            connection,
            config,
            events: Box::pin(watcher(api, watch_config)),
            slices: BTreeMap::new(),
            listing: None,
            position: String::new(),
        })
    }

    fn answers(self) -> impl Stream<Item = Result<WatchAnswer, DiscoveryError>> + Send {
        futures_util::stream::unfold(Some(self), |follower| async move {
            let mut follower = follower?;
            match follower.next_answer().await {
                Ok(answer) => Some((Ok(answer), Some(follower))),
                // The runner opens a new watch after an error; this one is done.
                Err(error) => Some((Err(error), None)),
            }
        })
    }

    /// Waits for the next change, then takes every event arriving within [`BURST_WINDOW`] of
    /// it, so a burst (a rollout touching several slices, a scale-up written slice by slice) is
    /// one set and one reconcile.
    async fn next_answer(&mut self) -> Result<WatchAnswer, DiscoveryError> {
        let mut burst_ends: Option<tokio::time::Instant> = None;
        loop {
            let event = match burst_ends {
                Some(deadline) => match tokio::time::timeout_at(deadline, self.events.next()).await
                {
                    Ok(event) => event,
                    Err(_) => return self.answer(),
                },
                None => self.next_event().await?,
            };
            match event {
                None => return Err(DiscoveryError::WatchEnded),
                Some(Ok(event)) => {
                    if self.apply(event) && burst_ends.is_none() {
                        burst_ends = Some(tokio::time::Instant::now() + BURST_WINDOW);
                    }
                }
                // kube-rs relists on its next poll; a compacted history is routine.
                Some(Err(watcher::Error::WatchError(status))) if status.code == 410 => {
                    tracing::debug!(url = %self.connection.shown_url, "watch expired (410 Gone); relisting");
                }
                Some(Err(err)) => return Err(self.failed(err)),
            }
        }
    }

    /// The next event; while a list is under way, within `timeout_ms`.
    async fn next_event(
        &mut self,
    ) -> Result<Option<Result<watcher::Event<EndpointSlice>, watcher::Error>>, DiscoveryError> {
        let awaiting_list = self.listing.is_some() || self.position.is_empty();
        if !awaiting_list {
            return Ok(self.events.next().await);
        }
        let timeout = Duration::from_millis(self.config.timeout_ms);
        tokio::time::timeout(timeout, self.events.next())
            .await
            .map_err(|_| DiscoveryError::Timeout {
                timeout_ms: self.config.timeout_ms,
            })
    }

    /// True when the set may have changed.
    fn apply(&mut self, event: watcher::Event<EndpointSlice>) -> bool {
        match event {
            watcher::Event::Init => {
                self.listing = Some(BTreeMap::new());
                false
            }
            watcher::Event::InitApply(slice) => {
                self.note_position(&slice);
                if let Some(listing) = &mut self.listing {
                    listing.insert(name_of(&slice), slice);
                }
                false
            }
            watcher::Event::InitDone => {
                if let Some(listing) = self.listing.take() {
                    self.slices = listing;
                }
                if self.position.is_empty() {
                    // An empty list carries no object; the answer still needs a position.
                    self.position = "0".to_owned();
                }
                true
            }
            watcher::Event::Apply(slice) => {
                self.note_position(&slice);
                self.slices.insert(name_of(&slice), slice);
                true
            }
            watcher::Event::Delete(slice) => {
                self.note_position(&slice);
                self.slices.remove(&name_of(&slice));
                true
            }
        }
    }

    /// Resource versions are opaque; numeric ones (every real API server's) compare as numbers.
    fn note_position(&mut self, slice: &EndpointSlice) {
        let Some(version) = slice.metadata.resource_version.as_deref() else {
            return;
        };
        let newer = match (version.parse::<u64>(), self.position.parse::<u64>()) {
            (Ok(seen), Ok(known)) => seen > known,
            _ => true,
        };
        if newer {
            self.position = version.to_owned();
        }
    }

    fn answer(&self) -> Result<WatchAnswer, DiscoveryError> {
        let discovered =
            endpoints_of(&self.slices, &Wanted::of(&self.config)).map_err(|reason| {
                DiscoveryError::BadDocument {
                    url: self.connection.shown_url.clone(),
                    location: format!("Service {}", self.config.service),
                    reason,
                }
            })?;
        Ok(WatchAnswer {
            discovered,
            position: self.position.clone(),
        })
    }

    fn failed(&self, err: watcher::Error) -> DiscoveryError {
        match &err {
            watcher::Error::InitialListFailed(err)
            | watcher::Error::WatchStartFailed(err)
            | watcher::Error::WatchFailed(err) => self.connection.failed(err),
            watcher::Error::WatchError(status) => self.connection.refused(status),
            watcher::Error::NoResourceVersion => DiscoveryError::BadDocument {
                url: self.connection.shown_url.clone(),
                location: "metadata.resourceVersion".to_owned(),
                reason: err.to_string(),
            },
        }
    }
}

fn name_of(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// What the config asks of the slices.
#[derive(Debug, Clone, PartialEq)]
pub struct Wanted {
    pub service: String,
    pub port: Option<PortRef>,
    pub weight: u32,
    pub priority: i32,
}

impl Wanted {
    fn of(config: &KubernetesConfig) -> Wanted {
        Wanted {
            service: config.service.clone(),
            port: config.port.clone(),
            weight: config.weight,
            priority: config.priority,
        }
    }
}

/// How an endpoint may take traffic; the better one wins when an address is in several slices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Readiness {
    /// Neither ready nor serving: left out.
    Out,
    /// Serving while terminating: only when nothing is ready.
    Terminating,
    Ready,
}

fn readiness_of(endpoint: &k8s_openapi::api::discovery::v1::Endpoint) -> Readiness {
    let conditions = endpoint.conditions.clone().unwrap_or_default();
    // Nil `ready` and `serving` mean true, nil `terminating` false (the API's field docs).
    if conditions.ready.unwrap_or(true) {
        return Readiness::Ready;
    }
    if conditions.serving.unwrap_or(true) && conditions.terminating.unwrap_or(false) {
        return Readiness::Terminating;
    }
    Readiness::Out
}

/// The whole endpoint set of a Service's slices (pure). An error when the slices say the
/// config cannot be served as written (no such port; several ports and none chosen).
pub fn endpoints_of(
    slices: &BTreeMap<String, EndpointSlice>,
    wanted: &Wanted,
) -> Result<Discovered, String> {
    let mut best: BTreeMap<SocketAddr, (Readiness, Endpoint)> = BTreeMap::new();
    let mut refused: Vec<String> = Vec::new();
    let mut port_missing: Vec<String> = Vec::new();
    several_ports(slices, wanted)?;
    for (name, slice) in slices {
        if slice.endpoints.is_empty() {
            continue;
        }
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            refused.push(format!(
                "slice {name}: addressType {} (only IPv4 and IPv6 addresses can be proxied to)",
                slice.address_type
            ));
            continue;
        }
        let port = match port_of(slice, wanted) {
            Ok(port) => port,
            Err(reason) => {
                port_missing.push(format!("slice {name}: {reason}"));
                continue;
            }
        };
        for endpoint in &slice.endpoints {
            let readiness = readiness_of(endpoint);
            if readiness == Readiness::Out {
                continue;
            }
            let Some(address) = endpoint.addresses.first() else {
                continue;
            };
            // No semantics are defined for addresses beyond the first (kube-proxy ignores them).
            let Ok(ip) = address.parse::<IpAddr>() else {
                refused.push(format!(
                    "slice {name}: address {address:?} is not an IP address"
                ));
                continue;
            };
            let key = SocketAddr::new(ip, port);
            if best.get(&key).is_some_and(|(known, _)| *known >= readiness) {
                continue;
            }
            best.insert(
                key,
                (readiness, endpoint_of(key, endpoint, readiness, wanted)),
            );
        }
    }
    // No slice has the port: the config names a port the Service does not have, which is a
    // failed refresh (last known good keeps serving), not an empty Service.
    let usable = usable_slices(slices);
    if usable > 0 && port_missing.len() == usable {
        return Err(port_missing.join("; "));
    }
    refused.extend(port_missing);
    let any_ready = best
        .values()
        .any(|(readiness, _)| *readiness == Readiness::Ready);
    let endpoints: Vec<Endpoint> = best
        .into_values()
        .filter(|(readiness, _)| !any_ready || *readiness == Readiness::Ready)
        .map(|(_, endpoint)| endpoint)
        .collect();
    Ok(Discovered {
        revision: revision_of(&endpoints),
        endpoints,
        ttl: None,
        refused: (!refused.is_empty()).then(|| refused.join("; ")),
    })
}

/// Slices with IP endpoints: the ones a port is looked up in.
fn usable_slices(slices: &BTreeMap<String, EndpointSlice>) -> usize {
    slices
        .values()
        .filter(|slice| {
            !slice.endpoints.is_empty() && matches!(slice.address_type.as_str(), "IPv4" | "IPv6")
        })
        .count()
}

/// With no `port` chosen the slices must agree on one TCP port; otherwise the operator must
/// choose (guessing would send traffic to a metrics or admin port).
fn several_ports(slices: &BTreeMap<String, EndpointSlice>, wanted: &Wanted) -> Result<(), String> {
    if wanted.port.is_some() {
        return Ok(());
    }
    let mut seen: BTreeMap<String, i32> = BTreeMap::new();
    for slice in slices.values() {
        for port in tcp_ports(slice) {
            seen.insert(
                port.name.clone().unwrap_or_default(),
                port.port.unwrap_or_default(),
            );
        }
    }
    if seen.len() <= 1 {
        return Ok(());
    }
    let mut listed = String::new();
    for (index, (name, number)) in seen.iter().enumerate() {
        if index > 0 {
            listed.push_str(", ");
        }
        let _ = write!(listed, "{name:?} ({number})");
    }
    Err(format!(
        "the slices carry several TCP ports: {listed}; set \"port\" to the name of the one to use"
    ))
}

fn tcp_ports(
    slice: &EndpointSlice,
) -> impl Iterator<Item = &k8s_openapi::api::discovery::v1::EndpointPort> {
    slice
        .ports
        .iter()
        .flatten()
        .filter(|port| port.protocol.as_deref().unwrap_or("TCP") == "TCP")
}

/// The port of one slice's endpoints for the wanted port.
fn port_of(slice: &EndpointSlice, wanted: &Wanted) -> Result<u16, String> {
    let ports = slice.ports.as_deref().unwrap_or_default();
    let number = |port: &k8s_openapi::api::discovery::v1::EndpointPort| {
        port.port
            .and_then(|number| u16::try_from(number).ok())
            .filter(|number| *number != 0)
    };
    match &wanted.port {
        Some(PortRef::Name(name)) => {
            let Some(port) = ports.iter().find(|port| port.name.as_deref() == Some(name)) else {
                return Err(format!(
                    "no port named {name:?} (its ports: {})",
                    describe_ports(ports)
                ));
            };
            let protocol = port.protocol.as_deref().unwrap_or("TCP");
            if protocol != "TCP" {
                return Err(format!(
                    "port {name:?} is {protocol}; only TCP can be proxied"
                ));
            }
            number(port).ok_or_else(|| format!("port {name:?} has no number"))
        }
        Some(PortRef::Number(wanted_number)) => {
            let wanted_number = u16::try_from(*wanted_number).unwrap_or(0);
            // No ports, or a port without a number, means "all ports".
            let all_ports = ports.is_empty() || ports.iter().any(|port| port.port.is_none());
            if all_ports || tcp_ports(slice).any(|port| number(port) == Some(wanted_number)) {
                return Ok(wanted_number);
            }
            Err(format!(
                "no TCP port {wanted_number} (its ports: {}); name the Service port or give the \
                 endpoints' port number",
                describe_ports(ports)
            ))
        }
        None => {
            let mut candidates = tcp_ports(slice).filter_map(number);
            match candidates.next() {
                Some(port) => Ok(port),
                None => Err(format!(
                    "no TCP port (its ports: {}); set \"port\"",
                    describe_ports(ports)
                )),
            }
        }
    }
}

fn describe_ports(ports: &[k8s_openapi::api::discovery::v1::EndpointPort]) -> String {
    if ports.is_empty() {
        return "none".to_owned();
    }
    ports
        .iter()
        .map(|port| {
            format!(
                "{}={}/{}",
                port.name
                    .as_deref()
                    .filter(|name| !name.is_empty())
                    .unwrap_or("(unnamed)"),
                port.port
                    .map_or("*".to_owned(), |number| number.to_string()),
                port.protocol.as_deref().unwrap_or("TCP")
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn endpoint_of(
    key: SocketAddr,
    endpoint: &k8s_openapi::api::discovery::v1::Endpoint,
    readiness: Readiness,
    wanted: &Wanted,
) -> Endpoint {
    let mut metadata = serde_json::Map::new();
    if let Some(pod) = endpoint
        .target_ref
        .as_ref()
        .filter(|reference| reference.kind.as_deref().unwrap_or("Pod") == "Pod")
        .and_then(|reference| reference.name.clone())
    {
        metadata.insert("pod".to_owned(), json!(pod));
    }
    if let Some(node) = &endpoint.node_name {
        metadata.insert("node".to_owned(), json!(node));
    }
    if let Some(zone) = &endpoint.zone {
        metadata.insert("zone".to_owned(), json!(zone));
    }
    if readiness == Readiness::Terminating {
        metadata.insert("terminating".to_owned(), json!(true));
    }
    Endpoint {
        key: key.to_string(),
        host: key.ip().to_string(),
        port: key.port(),
        weight: wanted.weight,
        priority: wanted.priority,
        enabled: true,
        metadata: Value::Object(metadata),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(name: &str, address_type: &str, ports: Value, endpoints: Value) -> EndpointSlice {
        serde_json::from_value(json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "shop", "resourceVersion": "7"},
            "addressType": address_type,
            "ports": ports,
            "endpoints": endpoints,
        }))
        .expect("an EndpointSlice")
    }

    fn endpoint(address: &str, ready: bool, serving: bool, terminating: bool) -> Value {
        json!({
            "addresses": [address],
            "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            "nodeName": "node-1",
            "zone": "zone-a",
            "targetRef": {"kind": "Pod", "name": format!("web-{address}"), "namespace": "shop"},
        })
    }

    fn http_port() -> Value {
        json!([{"name": "http", "port": 8080, "protocol": "TCP"}])
    }

    fn wanted(port: Option<PortRef>) -> Wanted {
        Wanted {
            service: "web".to_owned(),
            port,
            weight: 100,
            priority: 0,
        }
    }

    fn set(slices: Vec<EndpointSlice>, port: Option<PortRef>) -> Result<Discovered, String> {
        let slices = slices
            .into_iter()
            .map(|slice| (name_of(&slice), slice))
            .collect();
        endpoints_of(&slices, &wanted(port))
    }

    fn keys(discovered: &Discovered) -> Vec<&str> {
        discovered
            .endpoints
            .iter()
            .map(|endpoint| endpoint.key.as_str())
            .collect()
    }

    #[test]
    fn ready_endpoints_are_the_set_with_pod_node_and_zone() {
        let discovered = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([
                    endpoint("10.0.0.1", true, true, false),
                    endpoint("10.0.0.2", false, false, false),
                ]),
            )],
            None,
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080"]);
        let only = &discovered.endpoints[0];
        assert_eq!((only.host.as_str(), only.port), ("10.0.0.1", 8080));
        assert_eq!(
            only.metadata,
            json!({"pod": "web-10.0.0.1", "node": "node-1", "zone": "zone-a"})
        );
        assert_eq!(discovered.refused, None);
    }

    #[test]
    fn terminating_endpoints_serve_only_while_none_is_ready() {
        let rolling = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([
                    endpoint("10.0.0.1", true, true, false),
                    endpoint("10.0.0.2", false, true, true),
                ]),
            )],
            None,
        )
        .unwrap();
        assert_eq!(keys(&rolling), ["10.0.0.1:8080"]);
        let all_terminating = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([
                    endpoint("10.0.0.1", false, true, true),
                    endpoint("10.0.0.2", false, true, true),
                    endpoint("10.0.0.3", false, false, true),
                ]),
            )],
            None,
        )
        .unwrap();
        assert_eq!(keys(&all_terminating), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert_eq!(
            all_terminating.endpoints[0].metadata["terminating"],
            json!(true)
        );
    }

    #[test]
    fn missing_conditions_mean_ready() {
        let discovered = set(
            vec![slice(
                "web-1",
                "IPv4",
                http_port(),
                json!([{"addresses": ["10.0.0.9"]}]),
            )],
            None,
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.9:8080"]);
    }

    #[test]
    fn an_address_in_two_slices_is_one_endpoint_in_its_best_state() {
        let discovered = set(
            vec![
                slice(
                    "web-a",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", false, true, true)]),
                ),
                slice(
                    "web-b",
                    "IPv4",
                    http_port(),
                    json!([
                        endpoint("10.0.0.1", true, true, false),
                        endpoint("10.0.0.2", true, true, false)
                    ]),
                ),
            ],
            None,
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        assert!(discovered.endpoints[0]
            .metadata
            .get("terminating")
            .is_none());
    }

    #[test]
    fn ipv6_slices_use_brackets_in_the_key() {
        let discovered = set(
            vec![
                slice(
                    "web-v4",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", true, true, false)]),
                ),
                slice(
                    "web-v6",
                    "IPv6",
                    http_port(),
                    json!([endpoint("fd00::1", true, true, false)]),
                ),
            ],
            None,
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "[fd00::1]:8080"]);
        assert_eq!(discovered.endpoints[1].host, "fd00::1");
    }

    #[test]
    fn a_named_port_picks_its_number_in_each_slice() {
        let ports = json!([
            {"name": "metrics", "port": 9090, "protocol": "TCP"},
            {"name": "http", "port": 8080, "protocol": "TCP"},
        ]);
        let moved = json!([{"name": "http", "port": 8081}, {"name": "metrics", "port": 9090}]);
        let slices = vec![
            slice(
                "web-a",
                "IPv4",
                ports,
                json!([endpoint("10.0.0.1", true, true, false)]),
            ),
            slice(
                "web-b",
                "IPv4",
                moved,
                json!([endpoint("10.0.0.2", true, true, false)]),
            ),
        ];
        let discovered = set(slices.clone(), Some(PortRef::Name("http".to_owned()))).unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "10.0.0.2:8081"]);
        let by_number = set(slices.clone(), Some(PortRef::Number(9090))).unwrap();
        assert_eq!(keys(&by_number), ["10.0.0.1:9090", "10.0.0.2:9090"]);
        let unchosen = set(slices, None).unwrap_err();
        assert!(unchosen.contains("several TCP ports"), "{unchosen}");
        assert!(unchosen.contains("\"http\""), "{unchosen}");
    }

    #[test]
    fn a_port_the_service_does_not_have_fails_the_refresh() {
        let slices = vec![slice(
            "web-a",
            "IPv4",
            http_port(),
            json!([endpoint("10.0.0.1", true, true, false)]),
        )];
        let error = set(slices.clone(), Some(PortRef::Name("grpc".to_owned()))).unwrap_err();
        assert_eq!(
            error,
            "slice web-a: no port named \"grpc\" (its ports: http=8080/TCP)"
        );
        let error = set(slices, Some(PortRef::Number(80))).unwrap_err();
        assert!(error.contains("no TCP port 80"), "{error}");
    }

    #[test]
    fn a_slice_without_the_port_is_refused_when_others_have_it() {
        let discovered = set(
            vec![
                slice(
                    "web-a",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", true, true, false)]),
                ),
                slice(
                    "web-b",
                    "IPv4",
                    json!([{"name": "admin", "port": 7000}]),
                    json!([endpoint("10.0.0.2", true, true, false)]),
                ),
            ],
            Some(PortRef::Name("http".to_owned())),
        )
        .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080"]);
        assert!(discovered
            .refused
            .unwrap()
            .contains("slice web-b: no port named"));
    }

    #[test]
    fn udp_ports_are_not_proxied_and_no_ports_take_the_configured_number() {
        let dns = json!([
            {"name": "dns", "port": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
        ]);
        let slices = vec![slice(
            "dns-a",
            "IPv4",
            dns,
            json!([endpoint("10.0.0.5", true, true, false)]),
        )];
        assert_eq!(keys(&set(slices.clone(), None).unwrap()), ["10.0.0.5:53"]);
        let error = set(slices, Some(PortRef::Name("dns".to_owned()))).unwrap_err();
        assert!(error.contains("is UDP"), "{error}");
        let headless = vec![slice(
            "db-a",
            "IPv4",
            json!([]),
            json!([endpoint("10.0.0.6", true, true, false)]),
        )];
        assert_eq!(
            keys(&set(headless.clone(), Some(PortRef::Number(5432))).unwrap()),
            ["10.0.0.6:5432"]
        );
        assert!(set(headless, None).unwrap_err().contains("no TCP port"));
    }

    #[test]
    fn fqdn_slices_and_an_empty_service_are_successful_sets() {
        let discovered = set(
            vec![slice(
                "ext",
                "FQDN",
                http_port(),
                json!([{"addresses": ["db.example.com"]}]),
            )],
            None,
        )
        .unwrap();
        assert!(discovered.endpoints.is_empty());
        assert!(discovered.refused.unwrap().contains("addressType FQDN"));
        let empty = set(vec![], None).unwrap();
        assert!(empty.endpoints.is_empty());
        assert_eq!(empty.refused, None);
    }

    #[test]
    fn the_same_slices_give_the_same_revision() {
        let make = || {
            set(
                vec![slice(
                    "web-a",
                    "IPv4",
                    http_port(),
                    json!([endpoint("10.0.0.1", true, true, false)]),
                )],
                None,
            )
            .unwrap()
        };
        assert_eq!(make().revision, make().revision);
    }

    fn validate(config: Value) -> Result<Value, ConfigError> {
        crate::discovery::validate(ProviderKind::Kubernetes, &config)
    }

    #[test]
    fn config_defaults_and_port_forms() {
        let valid = validate(json!({"service": "web"})).unwrap();
        assert_eq!(
            valid,
            json!({"service": "web", "tls_verify": true, "timeout_ms": 5000, "weight": 100, "priority": 0})
        );
        let numbered = validate(json!({"service": "web", "port": "8080"})).unwrap();
        assert_eq!(numbered["port"], json!(8080));
        let named = validate(json!({"service": "web", "port": "http"})).unwrap();
        assert_eq!(named["port"], json!("http"));
    }

    #[test]
    fn config_errors_name_the_field() {
        for (config, field) in [
            (json!({}), "service"),
            (json!({"service": "Web"}), "service"),
            (json!({"service": "1web"}), "service"),
            (json!({"service": "web", "namespace": "a b"}), "namespace"),
            (json!({"service": "web", "port": 0}), "port"),
            (json!({"service": "web", "port": "Http_1"}), "port"),
            (
                json!({"service": "web", "api_server": "ftp://x"}),
                "api_server",
            ),
            (json!({"service": "web", "token_file": ""}), "token_file"),
            (json!({"service": "web", "selector": "x"}), "selector"),
        ] {
            let error = validate(config.clone()).unwrap_err();
            assert_eq!(error.field, field, "{config}: {error}");
        }
    }

    #[tokio::test]
    async fn outside_a_cluster_without_a_server_the_error_says_what_to_set() {
        let config = config::parse::<KubernetesConfig>(&json!({"service": "web"})).unwrap();
        if std::env::var_os("KUBERNETES_SERVICE_HOST").is_some() {
            return;
        }
        let error = Connection::open(&config)
            .await
            .err()
            .expect("no API server");
        assert!(
            error.to_string().contains("set api_server or kubeconfig"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_missing_token_file_is_named() {
        let config = config::parse::<KubernetesConfig>(&json!({
            "service": "web",
            "api_server": "http://127.0.0.1:1",
            "token_file": "/nonexistent/raahi/token",
        }))
        .unwrap();
        let error = Connection::open(&config).await.err().expect("no token");
        assert_eq!(
            error.to_string(),
            "cannot use the token file /nonexistent/raahi/token: No such file or directory (os error 2)"
        );
    }
}
