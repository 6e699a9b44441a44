//! Reaching the API server: where it is and who we are to it, resolved when a watch opens
//! (explicit keys, then the kubeconfig, then the pod's service account), and what every request
//! goes through beside kube-rs's own stack.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::header::AUTHORIZATION;
use http::HeaderValue;

use super::exec::ExecPlugin;
use super::{watch_length, KubernetesConfig, SERVICE_NAME_LABEL};
use crate::discovery::runner::WATCH_SPACING;
use crate::discovery::DiscoveryError;
use crate::error_chain::text as error_chain;

/// Where a pod's service account is mounted (the in-cluster defaults).
const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A client for one watch, with what it was resolved to.
pub(super) struct Connection {
    pub(super) client: kube::Client,
    pub(super) namespace: String,
    /// The list URL, as `last_error` names it.
    pub(super) shown_url: String,
    /// The Service object's URL, as `last_error` names it.
    pub(super) service_url: String,
    /// The kubeconfig's exec credential plugin, whose token the follower renews.
    pub(super) exec: Option<Arc<ExecPlugin>>,
}

impl Connection {
    /// Resolves where the API server is and who we are to it: explicit keys first, then the
    /// kubeconfig, then (only when neither `api_server` nor `kubeconfig` is set) the pod's
    /// service account. The pod's token is never sent to a server named by hand.
    pub(super) async fn open(config: &KubernetesConfig) -> Result<Connection, DiscoveryError> {
        let in_cluster = config.api_server.is_none() && config.kubeconfig.is_none();
        let mut client_config = base_config(config).await?;
        apply_tls(&mut client_config, config, in_cluster)?;
        let timeout = Duration::from_millis(config.timeout_ms);
        let mut exec = None;
        let bearer = match token_of(config, in_cluster)? {
            Some(token) => {
                client_config.auth_info = Default::default();
                Some(Bearer::File(token))
            }
            None => match client_config.auth_info.exec.take() {
                Some(plugin) => {
                    let plugin = Arc::new(ExecPlugin::start(plugin, timeout).await?);
                    client_config.auth_info = Default::default();
                    exec = Some(Arc::clone(&plugin));
                    Some(Bearer::Exec(plugin))
                }
                None => None,
            },
        };
        apply_timeouts(&mut client_config, config);
        let namespace = namespace_of(config, &client_config);
        let shown_url = list_url(&client_config.cluster_url, &namespace, &config.service);
        let service_url = service_url(&client_config.cluster_url, &namespace, &config.service);
        let client = build_client(client_config, bearer, timeout).await?;
        Ok(Connection {
            client,
            namespace,
            shown_url,
            service_url,
            exec,
        })
    }
}

/// kube-rs's client builder, on a blocking thread and bounded by `timeout_ms`: it may run a
/// kubeconfig's legacy `auth-provider` command synchronously (exec plugins are run here, in
/// `exec.rs`, and never reach it).
async fn build_client(
    client_config: kube::Config,
    bearer: Option<Bearer>,
    timeout: Duration,
) -> Result<kube::Client, DiscoveryError> {
    let setup = |reason: String| DiscoveryError::ClientSetup { reason };
    let building = tokio::task::spawn_blocking(move || {
        let policy = RequestPolicy::layer(bearer, timeout);
        kube::client::ClientBuilder::try_from(client_config)
            .map(|builder| builder.with_layer(&policy).build())
    });
    tokio::time::timeout(timeout, building)
        .await
        .map_err(|_| {
            setup(format!(
                "finding the API server's credentials took longer than {} ms (timeout_ms)",
                timeout.as_millis()
            ))
        })?
        .map_err(|err| {
            setup(format!(
                "finding the API server's credentials failed: {err}"
            ))
        })?
        .map_err(|err| {
            setup(format!(
                "cannot build a client for the API server: {}",
                error_chain(&err)
            ))
        })
}

/// The cluster URL and anything the kubeconfig says.
async fn base_config(config: &KubernetesConfig) -> Result<kube::Config, DiscoveryError> {
    let mut client_config = match (&config.kubeconfig, &config.api_server) {
        (Some(path), _) => from_kubeconfig(Path::new(path)).await?,
        (None, Some(url)) => kube::Config::new(parse_uri("api_server", url)?),
        (None, None) => kube::Config::new(in_cluster_uri()?),
    };
    if let Some(url) = &config.api_server {
        client_config.cluster_url = parse_uri("api_server", url)?;
    }
    Ok(client_config)
}

/// `ca_file`, else the service account's CA in a cluster, else the kubeconfig's or the system's
/// roots. `tls_verify: false` turns verification off; true keeps what a kubeconfig says.
fn apply_tls(
    client_config: &mut kube::Config,
    config: &KubernetesConfig,
    in_cluster: bool,
) -> Result<(), DiscoveryError> {
    let ca_file = match &config.ca_file {
        Some(path) => Some(PathBuf::from(path)),
        None if in_cluster => Some(Path::new(SERVICE_ACCOUNT_DIR).join("ca.crt")),
        None => None,
    };
    if let Some(path) = ca_file {
        client_config.root_cert = Some(read_certificates(&path)?);
        client_config.root_cert_file = None;
    }
    if !config.tls_verify {
        client_config.accept_invalid_certs = true;
    }
    Ok(())
}

/// `token_file`, else the service account's token in a cluster; None leaves the kubeconfig's
/// credentials (or none).
fn token_of(
    config: &KubernetesConfig,
    in_cluster: bool,
) -> Result<Option<Arc<TokenFile>>, DiscoveryError> {
    match &config.token_file {
        Some(path) => TokenFile::open(PathBuf::from(path)).map(Some),
        None if in_cluster => {
            TokenFile::open(Path::new(SERVICE_ACCOUNT_DIR).join("token")).map(Some)
        }
        None => Ok(None),
    }
}

fn apply_timeouts(client_config: &mut kube::Config, config: &KubernetesConfig) {
    let timeout = Duration::from_millis(config.timeout_ms);
    client_config.connect_timeout = Some(timeout);
    client_config.write_timeout = Some(timeout);
    // A read may wait as long as a watch request lasts plus kube-rs's margin; a shorter bound
    // would cut idle watches.
    client_config.read_timeout = Some(watch_length(config) + Duration::from_secs(5) + timeout);
    client_config.reset_reader_on_write = true;
    // The runner retries with its own backoff and reports each failure.
    client_config.default_retry = false;
}

/// `namespace`, else the kubeconfig context's, else the pod's own, else `default`.
fn namespace_of(config: &KubernetesConfig, client_config: &kube::Config) -> String {
    if let Some(namespace) = &config.namespace {
        return namespace.clone();
    }
    if config.kubeconfig.is_some() {
        return client_config.default_namespace.clone();
    }
    std::fs::read_to_string(Path::new(SERVICE_ACCOUNT_DIR).join("namespace"))
        .ok()
        .map(|text| text.trim().to_owned())
        .filter(|namespace| !namespace.is_empty())
        .unwrap_or_else(|| "default".to_owned())
}

fn list_url(cluster_url: &http::Uri, namespace: &str, service: &str) -> String {
    let base = cluster_url.to_string();
    format!(
        "{}/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices\
         ?labelSelector={SERVICE_NAME_LABEL}={service}",
        base.trim_end_matches('/')
    )
}

fn service_url(cluster_url: &http::Uri, namespace: &str, service: &str) -> String {
    let base = cluster_url.to_string();
    format!(
        "{}/api/v1/namespaces/{namespace}/services/{service}",
        base.trim_end_matches('/')
    )
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

    fn current(&self) -> HeaderValue {
        // A panic elsewhere while holding the lock leaves a token that is still good.
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Ok(value) = Self::read(&self.path) {
            *last = value;
        }
        last.clone()
    }
}

/// Where a request's bearer token comes from.
enum Bearer {
    File(Arc<TokenFile>),
    Exec(Arc<ExecPlugin>),
}

impl Bearer {
    fn current(&self) -> Option<HeaderValue> {
        match self {
            Bearer::File(file) => Some(file.current()),
            Bearer::Exec(plugin) => plugin.current(),
        }
    }
}

/// What every request to the API server goes through, outside kube-rs's own stack:
/// - the current bearer token (from [`TokenFile`] or the exec plugin's last token);
/// - the requests of one watch (one path: the slices', the Service's) at least
///   [`WATCH_SPACING`] apart: kube-rs opens a new watch at once when one ends, so a proxy that
///   cuts watches would otherwise make it loop;
/// - a bound on the wait for a watch answer's head (`timeout_ms`), so an API server that
///   accepts connections but never answers is a failed refresh, not a watch that looks
///   connected (lists are bounded where they are read).
struct RequestPolicy<S> {
    inner: S,
    bearer: Option<Arc<Bearer>>,
    head_timeout: Duration,
    /// By path: the slot of the last watch request.
    last_watch: HashMap<String, tokio::time::Instant>,
}

type KubeRequest = http::Request<kube::client::Body>;

impl<S> RequestPolicy<S> {
    fn layer(
        bearer: Option<Bearer>,
        head_timeout: Duration,
    ) -> impl tower::Layer<S, Service = RequestPolicy<S>> {
        let bearer = bearer.map(Arc::new);
        tower::layer::layer_fn(move |inner| RequestPolicy {
            inner,
            bearer: bearer.clone(),
            head_timeout,
            last_watch: HashMap::new(),
        })
    }

    /// When a watch request may start: now, or a spacing after the last one.
    fn watch_slot(&mut self, request: &KubeRequest) -> Option<tokio::time::Instant> {
        let is_watch = request.uri().query().is_some_and(|query| {
            query
                .split('&')
                .any(|pair| pair == "watch=true" || pair == "watch=1")
        });
        if !is_watch {
            return None;
        }
        let now = tokio::time::Instant::now();
        let last = self.last_watch.get(request.uri().path());
        let slot = last.map_or(now, |last| (*last + WATCH_SPACING).max(now));
        self.last_watch
            .insert(request.uri().path().to_owned(), slot);
        Some(slot)
    }
}

impl<S> tower::Service<KubeRequest> for RequestPolicy<S>
where
    S: tower::Service<KubeRequest, Error = tower::BoxError>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = tower::BoxError;
    type Future = futures_util::future::BoxFuture<'static, Result<S::Response, tower::BoxError>>;

    fn poll_ready(
        &mut self,
        context: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, mut request: KubeRequest) -> Self::Future {
        if let Some(header) = self.bearer.as_ref().and_then(|bearer| bearer.current()) {
            request.headers_mut().insert(AUTHORIZATION, header);
        }
        let slot = self.watch_slot(&request);
        let head_timeout = self.head_timeout;
        // The client's future sends nothing until polled, so waiting for the slot delays the
        // request itself.
        let response = self.inner.call(request);
        Box::pin(async move {
            // Lists are bounded whole, page by page, where they are read (`follow.rs`).
            let Some(slot) = slot else {
                return response.await;
            };
            tokio::time::sleep_until(slot).await;
            match tokio::time::timeout(head_timeout, response).await {
                Ok(answered) => answered,
                Err(_) => Err(format!(
                    "the watch request got no answer within {} ms (timeout_ms)",
                    head_timeout.as_millis()
                )
                .into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::config;
    use serde_json::json;

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
            "cannot use the token file /nonexistent/raahi/token: No such file or directory \
             (os error 2)"
        );
    }
}
