//! The `kubernetes` provider: the endpoints of one Service, read from its EndpointSlices with
//! list + watch (DESIGN §4).
//!
//! kube-rs's watcher does the protocol: a paged list, then watches from the list's resource
//! version with bookmarks, a relist after 410 Gone, a new watch when the server ends one
//! (`timeoutSeconds`), and an idle timeout that catches a silently dead connection. The parts:
//! - this file: the config (schema, checks) and the provider the runner drives;
//! - `client.rs`: where the API server is and who we are to it (kubeconfig, `api_server`, the
//!   pod's service account), and what every request goes through (the token file read again,
//!   each watch's requests spaced, answers bounded by `timeout_ms`);
//! - `exec.rs`: a kubeconfig's exec credential plugin, run bounded by `timeout_ms`;
//! - `service.rs`: the Service object, a get and then a watch of it alone;
//! - `follow.rs`: one open watch: kube-rs's events kept as slices beside the Service, bursts
//!   gathered into one set, 410s relisted;
//! - `errors.rs`: how errors read in `last_error` (RBAC refusals name the permission);
//! - `ports.rs` and `slices.rs`: the pure mappings of `port` through the Service to the slices'
//!   port, and of slices to endpoints.
//!
//! Credentials are read when a watch opens and on every request (the token file), so rotated
//! bound service-account tokens and a file that appears later both work; a missing file is a
//! failed refresh naming it, never a config error, since instances sharing a store may differ.

mod client;
mod errors;
mod exec;
mod follow;
mod ports;
mod service;
mod slices;

pub use ports::{slice_port, SlicePort};
pub use slices::{endpoints_of, Wanted};

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::discovery::config::{
    self, check_range, check_url, default_timeout_ms, default_true, default_weight, error,
    ProviderConfig, SharedKeys,
};
use crate::discovery::{ConfigError, Fetch, FetchStyle, Registered, WatchProvider, WatchStream};
use crate::model::ProviderKind;

use follow::Follower;

pub const PROVIDER: Registered = Registered {
    provider: ProviderKind::Kubernetes,
    style: FetchStyle::Watch,
    description: "Watches the EndpointSlices of one Kubernetes Service (list + watch) and the \
                  Service itself (get + watch), whose ports map `port` to the endpoints' port; \
                  pods becoming ready, terminating or gone reach the data path within about a \
                  second. Runs in the cluster with its service account, or outside with \
                  `api_server` or `kubeconfig`.",
    schema: config::schema_of::<KubernetesConfig>,
    validate: config::validate_as::<KubernetesConfig>,
    build,
};

/// How long one watch request stays open by default: under the 60 s idle timeout common to load
/// balancers and NAT gateways, as for Consul, and the bound on noticing a silent API server.
pub const DEFAULT_WAIT_MS: u64 = 55_000;
const WAIT_RANGE: (u64, u64) = (1_000, 600_000);
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
    /// The Service's port as clients of the Service dial it: its number (`spec.ports[].port`,
    /// e.g. 80) or its name; the endpoints are reached on the port the Service maps it to (its
    /// target port, pod by pod). Unset: the Service's only TCP port. For a headless Service
    /// without ports, the endpoints' port number.
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
    /// Milliseconds one watch request stays open (the API server's `timeoutSeconds`, rounded up
    /// to seconds); a watch silent past it plus 5 s is taken for dead.
    #[serde(default = "default_wait_ms")]
    #[schemars(range(min = 1_000, max = 600_000))]
    pub wait_ms: u64,
    /// Milliseconds a request may wait for its answer to begin, and each page of a list to come.
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

fn default_wait_ms() -> u64 {
    DEFAULT_WAIT_MS
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
            if url.split_once("://").is_some_and(|(_, rest)| {
                rest.split(['/', '?', '#'])
                    .next()
                    .unwrap_or_default()
                    .contains('@')
            }) {
                return Err(error(
                    "api_server",
                    "must not carry a user name or password; use token_file or kubeconfig",
                ));
            }
        }
        check_range("wait_ms", self.wait_ms, WAIT_RANGE)?;
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
            futures_util::stream::once(async move { Follower::open(&config).await }).flat_map(
                |opened| -> WatchStream {
                    match opened {
                        Ok(follower) => Box::pin(follower.answers()),
                        Err(error) => Box::pin(futures_util::stream::iter([Err(error)])),
                    }
                },
            ),
        )
    }

    /// A healthy watch may be silent for ever: kube-rs renews its requests inside the stream.
    /// Dead connections are caught per request instead: `RequestPolicy` bounds every answer's
    /// head, kube-rs ends a watch silent past `wait_ms` + 5 s, and lists get `timeout_ms`.
    fn answer_deadline(&self) -> Option<Duration> {
        None
    }
}

/// Seconds one watch request stays open (`timeoutSeconds`), `wait_ms` rounded up.
fn watch_seconds(config: &KubernetesConfig) -> u32 {
    u32::try_from(config.wait_ms.div_ceil(1_000)).unwrap_or(u32::MAX)
}

fn watch_length(config: &KubernetesConfig) -> Duration {
    Duration::from_secs(u64::from(watch_seconds(config)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn validate(config: Value) -> Result<Value, ConfigError> {
        crate::discovery::validate(ProviderKind::Kubernetes, &config)
    }

    #[test]
    fn config_defaults_and_port_forms() {
        let valid = validate(json!({"service": "web"})).unwrap();
        assert_eq!(
            valid,
            json!({
                "service": "web", "tls_verify": true, "wait_ms": 55000, "timeout_ms": 5000,
                "weight": 100, "priority": 0,
            })
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
}
