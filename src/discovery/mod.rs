//! Service discovery: providers that read endpoints from DNS, DNS SRV, HTTP registries, Consul
//! and Kubernetes, the pure reconcile of endpoints into targets, source lifecycle, and the
//! per-source refresh and watch loops.
//!
//! Every provider lives in its own module, which owns its config type (schema, validation,
//! parsing) and registers itself in `PROVIDERS`: admin, the resources file and the control task
//! find providers only through [`validate`], [`build`] and [`descriptors`].
//!
//! Imports only `model`: the control task wires results into the store and the snapshot.

pub mod config;
pub mod consul;
pub mod dns;
pub mod dns_srv;
pub mod guard;
pub mod http;
pub mod kubernetes;
pub mod lifecycle;
pub mod reconcile;
pub mod registry_client;
pub mod resolver;
pub mod runner;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use futures_util::Stream;
use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::model::{Endpoint, ProviderKind};

/// Every provider Raahi knows, in the order the descriptor lists them. A new provider is its own
/// module plus one line here (and its name in [`ProviderKind`]).
const PROVIDERS: &[Registered] = &[
    dns::PROVIDER,
    dns_srv::PROVIDER,
    http::PROVIDER,
    consul::PROVIDER,
    kubernetes::PROVIDER,
];

/// How a provider learns about changes (DESIGN §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FetchStyle {
    /// Asked for the whole set on a schedule.
    Poll,
    /// Holds a long request open; the registry answers when the set changes.
    Watch,
}

/// One provider's entry in the registry.
pub struct Registered {
    pub provider: ProviderKind,
    pub style: FetchStyle,
    pub description: &'static str,
    /// The config type's JSON Schema (draft 2020-12).
    pub schema: fn() -> Value,
    /// Checks a config; returns it normalised with every default filled in.
    pub validate: fn(&Value) -> Result<Value, ConfigError>,
    /// A ready provider for a config that passed `validate` (errors are handled anyway).
    pub build: fn(&Value) -> Result<Fetch, ConfigError>,
}

/// A kind without a module here is refused like a bad config rather than a panic (a unit test
/// keeps every kind registered).
fn registered(kind: ProviderKind) -> Result<&'static Registered, ConfigError> {
    PROVIDERS
        .iter()
        .find(|registered| registered.provider == kind)
        .ok_or_else(|| ConfigError {
            field: String::new(),
            message: format!("provider {} is not built into this gateway", kind.as_str()),
        })
}

/// Checks `config` against the provider's schema and rules; returns it normalised with every
/// default filled in.
pub fn validate(kind: ProviderKind, config: &Value) -> Result<Value, ConfigError> {
    (registered(kind)?.validate)(config)
}

/// A ready provider for a source's stored config.
pub fn build(kind: ProviderKind, config: &Value) -> Result<Fetch, ConfigError> {
    (registered(kind)?.build)(config)
}

#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct ProviderDescriptor {
    pub name: String,
    pub kind: FetchStyle,
    pub description: String,
    #[schema(value_type = Object)]
    pub config_schema: Value,
    #[schema(value_type = Object)]
    pub defaults: Value,
}

/// For GET /api/v1/discovery/providers: every provider with its JSON Schema generated from the
/// Rust config type and its defaults.
pub fn descriptors() -> Vec<ProviderDescriptor> {
    PROVIDERS
        .iter()
        .map(|registered| {
            let config_schema = (registered.schema)();
            ProviderDescriptor {
                name: registered.provider.as_str().to_owned(),
                kind: registered.style,
                description: registered.description.to_owned(),
                defaults: config::defaults_in(&config_schema),
                config_schema,
            }
        })
        .collect()
}

/// A built provider, ready for its runner.
pub enum Fetch {
    Poll {
        provider: Box<dyn PollProvider>,
        schedule: Schedule,
    },
    Watch {
        provider: Box<dyn WatchProvider>,
    },
}

/// A successful refresh: the complete endpoint set (possibly empty, e.g. NXDOMAIN).
#[derive(Debug, Clone, PartialEq)]
pub struct Discovered {
    pub endpoints: Vec<Endpoint>,
    /// Opaque token of this result: the provider's own (an HTTP ETag) or [`revision_of`].
    pub revision: String,
    /// The smallest record TTL of a DNS answer, so the source can refresh before it expires.
    pub ttl: Option<Duration>,
    /// What the provider left out of the set and why (entries it could not use), for the
    /// source's `last_error`: a refusal is never silent.
    pub refused: Option<String>,
    /// Keys the registry still lists but says are leaving (Consul: not passing; Kubernetes:
    /// terminating or not ready): explicit departures, which the removal guard never holds.
    pub departures: Vec<String>,
}

/// Why a refresh failed. The text is what an operator reads in the source's `last_error`, so it
/// says what was asked, of whom, and what came back.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiscoveryError {
    #[error("refresh timed out after {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    /// SERVFAIL, REFUSED and other error response codes.
    #[error("DNS server answered {code} for {name} {record_type}")]
    DnsResponse {
        name: String,
        record_type: String,
        code: String,
    },
    /// No answer at all: network errors, timeouts inside the resolver, malformed responses.
    #[error("DNS lookup of {name} {record_type} failed: {reason}")]
    DnsLookup {
        name: String,
        record_type: String,
        reason: String,
    },
    #[error("registry {url} answered HTTP {status}")]
    HttpStatus { url: String, status: u16 },
    /// An error answer whose body says why (Consul's "ACL not found", "No path to datacenter").
    #[error("registry {url} answered HTTP {status}: {message}")]
    RegistryRefused {
        url: String,
        status: u16,
        message: String,
    },
    #[error("registry {url} could not be fetched: {reason}")]
    HttpRequest { url: String, reason: String },
    #[error("registry {url} sent a document larger than {limit} bytes")]
    TooLarge { url: String, limit: u64 },
    #[error("registry {url} sent invalid JSON: {reason}")]
    BadJson { url: String, reason: String },
    /// Valid JSON that does not describe endpoints (no array at the path, an endpoint without
    /// `host`, a bad port...). `location` names the place, e.g. `endpoints[3].host`.
    #[error("registry {url}: {location}: {reason}")]
    BadDocument {
        url: String,
        location: String,
        reason: String,
    },
    /// A watch whose connection went silent past its longest legitimate wait.
    #[error("watch got no answer within {waited_ms} ms (its longest wait plus timeout_ms); reconnecting")]
    WatchSilent { waited_ms: u64 },
    /// A file the provider reads to reach its registry (a token, a CA, a kubeconfig).
    #[error("cannot use the {what} {path}: {reason}")]
    LocalFile {
        what: String,
        path: String,
        reason: String,
    },
    /// The provider cannot tell where or how to reach its registry.
    #[error("{reason}")]
    ClientSetup { reason: String },
    /// What the source names does not exist in the registry (a Kubernetes Service).
    #[error("no {what}: {reason}")]
    Absent { what: String, reason: String },
    /// A watch stream that ended without an error (the registry closed it).
    #[error("watch ended by the registry; reconnecting")]
    WatchEnded,
}

pub type RefreshFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Discovered, DiscoveryError>> + Send + 'a>>;

/// A configured poll provider (one per discovery source).
pub trait PollProvider: Send + Sync {
    /// One refresh attempt. The caller applies `timeout_ms` around it.
    fn refresh(&self) -> RefreshFuture<'_>;
}

/// One answer of a watch: the whole endpoint set as the registry holds it now, and the
/// registry's position (Consul's `X-Consul-Index`, a Kubernetes resource version).
#[derive(Debug, Clone, PartialEq)]
pub struct WatchAnswer {
    pub discovered: Discovered,
    pub position: String,
}

/// The answers of one watch, in order. It starts with a full read; the next request is made only
/// when the runner asks for the next answer, so the runner alone decides how often the registry
/// is asked. An error ends the watch: the runner backs off and opens a new one.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchAnswer, DiscoveryError>> + Send>>;

/// A configured watch provider (one per discovery source).
pub trait WatchProvider: Send + Sync {
    /// Opens a watch from a full read.
    fn watch(&self) -> WatchStream;
    /// The longest a healthy watch may stay silent between answers (its longest legitimate wait
    /// plus the request timeout): past it, the connection is taken for dead. None for a watch
    /// that may rightly stay silent for ever (a Kubernetes watch renews its requests inside the
    /// stream) and bounds each of its requests itself.
    fn answer_deadline(&self) -> Option<Duration>;
}

/// A source's refresh schedule, from the shared config keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    pub interval: Duration,
    pub timeout: Duration,
}

/// A provider config that does not fit its schema; `field` is the path inside `config`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

/// A revision for providers without a token of their own: a hash of the normalised endpoint
/// set, so the same endpoints in any order give the same revision.
pub fn revision_of(endpoints: &[Endpoint]) -> String {
    let mut keys: Vec<String> = endpoints
        .iter()
        .map(|endpoint| {
            format!(
                "{}|{}|{}|{}|{}|{}|{}",
                endpoint.key,
                endpoint.host,
                endpoint.port,
                endpoint.weight,
                endpoint.priority,
                endpoint.enabled,
                endpoint.metadata
            )
        })
        .collect();
    keys.sort();
    let mut hasher = Sha256::new();
    for key in &keys {
        hasher.update(key.as_bytes());
        hasher.update(b"\n");
    }
    hex::encode(&hasher.finalize()[..12])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(key: &str, port: u16) -> Endpoint {
        Endpoint {
            key: key.to_owned(),
            host: "127.0.0.1".to_owned(),
            port,
            weight: 100,
            priority: 0,
            enabled: true,
            metadata: serde_json::json!({}),
        }
    }

    #[test]
    fn every_provider_kind_is_registered_once_with_its_style() {
        let descriptors = descriptors();
        let listed: Vec<(&str, FetchStyle)> = descriptors
            .iter()
            .map(|descriptor| (descriptor.name.as_str(), descriptor.kind))
            .collect();
        assert_eq!(
            listed,
            [
                ("dns", FetchStyle::Poll),
                ("dns-srv", FetchStyle::Poll),
                ("http", FetchStyle::Poll),
                ("consul", FetchStyle::Watch),
                ("kubernetes", FetchStyle::Watch),
            ]
        );
        for (name, style) in listed {
            let kind = ProviderKind::parse(name).expect("a ProviderKind");
            assert_eq!(registered(kind).unwrap().provider, kind);
            assert_eq!(registered(kind).unwrap().style, style);
        }
        // Every kind the model knows: adding one without its module fails here.
        for kind in ProviderKind::ALL {
            assert!(registered(*kind).is_ok(), "{} is registered", kind.as_str());
        }
        assert_eq!(ProviderKind::ALL.len(), PROVIDERS.len());
        assert_eq!(
            serde_json::to_value(&descriptors[3]).unwrap()["kind"],
            serde_json::json!("watch")
        );
    }

    #[test]
    fn revision_ignores_order_and_sees_changes() {
        let a = vec![endpoint("a", 1), endpoint("b", 2)];
        let b = vec![endpoint("b", 2), endpoint("a", 1)];
        assert_eq!(revision_of(&a), revision_of(&b));
        assert_ne!(
            revision_of(&a),
            revision_of(&[endpoint("a", 1), endpoint("b", 3)])
        );
        assert_ne!(revision_of(&a), revision_of(&[]));
    }
}
