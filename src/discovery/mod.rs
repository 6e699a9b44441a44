//! Service discovery: providers that read endpoints from DNS, DNS SRV and HTTP registries, the
//! pure reconcile of endpoints into targets, source lifecycle, and the per-source refresh loop.
//!
//! Imports only `model`: the control task wires results into the store and the snapshot.

pub mod dns;
pub mod dns_srv;
pub mod http;
pub mod lifecycle;
pub mod providers;
pub mod reconcile;
pub mod runner;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::model::Endpoint;

/// A successful refresh: the complete endpoint set (possibly empty, e.g. NXDOMAIN).
#[derive(Debug, Clone, PartialEq)]
pub struct Discovered {
    pub endpoints: Vec<Endpoint>,
    /// Opaque token of this result: the provider's own (an HTTP ETag) or [`revision_of`].
    pub revision: String,
    /// The smallest record TTL of a DNS answer, so the source can refresh before it expires.
    pub ttl: Option<Duration>,
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
}

pub type RefreshFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Discovered, DiscoveryError>> + Send + 'a>>;

/// One configured provider instance (one per discovery source).
pub trait Provider: Send + Sync {
    /// One refresh attempt. The caller applies `timeout_ms` around it.
    fn refresh(&self) -> RefreshFuture<'_>;
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
