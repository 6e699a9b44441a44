//! The `dns` provider: A/AAAA of one name, asked through the stub resolver (`resolver.rs`).

use std::collections::HashSet;
use std::time::Duration;

use futures_util::future::try_join_all;
use hickory_proto::rr::RecordType;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::discovery::config::{
    self, check_dns_name, check_resolver, default_interval_ms, default_timeout_ms, default_weight,
    error, normalised_resolver, resolver_address, ProviderConfig, SharedKeys,
};
use crate::discovery::resolver::{address_key, min_ttl, Answer, Resolver};
use crate::discovery::{
    revision_of, ConfigError, Discovered, DiscoveryError, Fetch, FetchStyle, PollProvider,
    RefreshFuture, Registered,
};
use crate::model::{Endpoint, ProviderKind};

pub const PROVIDER: Registered = Registered {
    provider: ProviderKind::Dns,
    style: FetchStyle::Poll,
    description: "A and AAAA records of `hostname`; every address becomes an endpoint on `port`.",
    schema: config::schema_of::<DnsConfig>,
    validate: config::validate_as::<DnsConfig>,
    build,
};

/// The record types the `dns` provider can ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RecordKind {
    A,
    Aaaa,
}

/// `dns`: A and/or AAAA records of one host name; every address becomes an endpoint on `port`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DnsConfig {
    /// The DNS name to resolve, e.g. `backend.internal`. Without a trailing dot and without
    /// `resolver`, the search domains of /etc/resolv.conf apply.
    pub hostname: String,
    /// Port of every discovered endpoint (DNS address records carry none).
    #[schemars(range(min = 1, max = 65535))]
    pub port: u32,
    /// Which address records to ask for.
    #[serde(default = "default_record_types")]
    #[schemars(length(min = 1))]
    pub record_types: Vec<RecordKind>,
    /// DNS server as `ip:port` (UDP, TCP when the answer is truncated); unset uses /etc/resolv.conf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolver: Option<String>,
    /// Milliseconds between refreshes (each wait subtracts up to 10 % jitter; a shorter record TTL refreshes sooner).
    #[serde(default = "default_interval_ms")]
    #[schemars(range(min = 100, max = 86_400_000))]
    pub interval_ms: u64,
    /// Milliseconds one refresh may take.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 10, max = 600_000))]
    pub timeout_ms: u64,
    /// Weight of every discovered endpoint.
    #[serde(default = "default_weight")]
    #[schemars(range(max = 65535))]
    pub weight: u32,
    /// Priority tier of every discovered endpoint (lower is preferred).
    #[serde(default)]
    pub priority: i32,
}

fn default_record_types() -> Vec<RecordKind> {
    vec![RecordKind::A, RecordKind::Aaaa]
}

impl ProviderConfig for DnsConfig {
    fn shared(&self) -> SharedKeys {
        SharedKeys {
            interval_ms: Some(self.interval_ms),
            timeout_ms: self.timeout_ms,
            weight: self.weight,
            port: Some(self.port),
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        check_dns_name("hostname", &self.hostname)?;
        if self.record_types.is_empty() {
            return Err(error(
                "record_types",
                "must list at least one of \"a\", \"aaaa\"",
            ));
        }
        for (index, kind) in self.record_types.iter().enumerate() {
            if self.record_types[..index].contains(kind) {
                return Err(error(format!("record_types[{index}]"), "is listed twice"));
            }
        }
        check_resolver(self.resolver.as_deref())
    }

    fn normalise(&mut self) {
        self.resolver = normalised_resolver(self.resolver.as_deref());
    }
}

fn build(config: &Value) -> Result<Fetch, ConfigError> {
    let config = config::parse::<DnsConfig>(config)?;
    Ok(Fetch::Poll {
        schedule: config::schedule_of(&config),
        provider: Box::new(DnsProvider::new(&config)),
    })
}

/// The `dns` provider: every A/AAAA address of `hostname` is an endpoint on the configured port.
pub struct DnsProvider {
    hostname: String,
    port: u16,
    record_types: Vec<RecordType>,
    weight: u32,
    priority: i32,
    resolver: Resolver,
}

impl DnsProvider {
    /// `config` has passed `validate`.
    pub fn new(config: &DnsConfig) -> Self {
        let record_types = config
            .record_types
            .iter()
            .map(|kind| match kind {
                RecordKind::A => RecordType::A,
                RecordKind::Aaaa => RecordType::AAAA,
            })
            .collect();
        DnsProvider {
            hostname: config.hostname.clone(),
            port: u16::try_from(config.port).unwrap_or(u16::MAX),
            record_types,
            weight: config.weight,
            priority: config.priority,
            resolver: Resolver::new(
                resolver_address(config.resolver.as_deref()),
                Duration::from_millis(config.timeout_ms),
            ),
        }
    }

    async fn discover(&self) -> Result<Discovered, DiscoveryError> {
        let session = self.resolver.session().await;
        let lookups = self
            .record_types
            .iter()
            .map(|record_type| session.lookup(&self.hostname, *record_type));
        // Both types are asked at once; either failing fails the refresh, since the set would
        // otherwise silently lose half its endpoints.
        let answers = try_join_all(lookups).await?;
        let metadata = serde_json::json!({ "hostname": self.hostname });
        let mut endpoints = Vec::new();
        let mut seen = HashSet::new();
        for ip in answers.iter().flat_map(Answer::addresses) {
            let endpoint = Endpoint {
                key: address_key(ip, self.port),
                host: ip.to_string(),
                port: self.port,
                weight: self.weight,
                priority: self.priority,
                enabled: true,
                metadata: metadata.clone(),
            };
            if seen.insert(endpoint.key.clone()) {
                endpoints.push(endpoint);
            }
        }
        Ok(Discovered {
            revision: revision_of(&endpoints),
            endpoints,
            ttl: min_ttl(answers.iter().map(|answer| answer.ttl)),
            refused: None,
            departures: Vec::new(),
        })
    }
}

impl PollProvider for DnsProvider {
    fn refresh(&self) -> RefreshFuture<'_> {
        Box::pin(self.discover())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::resolver::test_server::{a, aaaa, cname, Reply, TestDns};
    use crate::discovery::resolver::ROUNDS;
    use hickory_proto::op::ResponseCode;
    use serde_json::json;
    use tokio::net::UdpSocket;

    fn provider(dns: &TestDns, extra: serde_json::Value) -> DnsProvider {
        let mut config = json!({
            "hostname": "api.test", "port": 8080, "resolver": dns.addr.to_string(),
            "timeout_ms": 2000, "weight": 7, "priority": 2,
        });
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let config = crate::discovery::validate(ProviderKind::Dns, &config).unwrap();
        DnsProvider::new(&serde_json::from_value(config).unwrap())
    }

    fn keys(discovered: &Discovered) -> Vec<&str> {
        discovered
            .endpoints
            .iter()
            .map(|endpoint| endpoint.key.as_str())
            .collect()
    }

    #[tokio::test]
    async fn a_records_become_endpoints() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![
                a("api.test", 60, "10.0.0.1"),
                a("api.test", 30, "10.0.0.2"),
            ]),
        );
        let discovered = provider(&dns, json!({"record_types": ["a"]}))
            .discover()
            .await
            .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "10.0.0.2:8080"]);
        let first = &discovered.endpoints[0];
        assert_eq!(first.host, "10.0.0.1");
        assert_eq!(
            (first.port, first.weight, first.priority, first.enabled),
            (8080, 7, 2, true)
        );
        assert_eq!(first.metadata, json!({"hostname": "api.test"}));
        assert_eq!(discovered.ttl, Some(Duration::from_secs(30)));
        assert_eq!(discovered.revision, revision_of(&discovered.endpoints));
    }

    #[tokio::test]
    async fn aaaa_records_use_brackets_in_the_key() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::AAAA,
            Reply::Records(vec![aaaa("api.test", 60, "fd00::1")]),
        );
        let discovered = provider(&dns, json!({"record_types": ["aaaa"]}))
            .discover()
            .await
            .unwrap();
        assert_eq!(keys(&discovered), ["[fd00::1]:8080"]);
        assert_eq!(discovered.endpoints[0].host, "fd00::1");
    }

    #[tokio::test]
    async fn both_types_are_merged_and_ttl_is_the_smallest() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", 120, "10.0.0.1")]),
        );
        dns.set(
            "api.test",
            RecordType::AAAA,
            Reply::Records(vec![aaaa("api.test", 45, "fd00::1")]),
        );
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "[fd00::1]:8080"]);
        assert_eq!(discovered.ttl, Some(Duration::from_secs(45)));
    }

    /// RFC 2181 §8: a TTL with the top bit set is 0, so the refresh comes as soon as the floor
    /// allows rather than after the interval (as a 68-year TTL would have it).
    #[tokio::test]
    async fn a_ttl_of_2_pow_31_or_more_is_taken_as_zero() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", 1 << 31, "10.0.0.1")]),
        );
        dns.set(
            "api.test",
            RecordType::AAAA,
            Reply::Records(vec![aaaa("api.test", 45, "fd00::1")]),
        );
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080", "[fd00::1]:8080"]);
        assert_eq!(discovered.ttl, Some(Duration::ZERO));
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", u32::MAX, "10.0.0.1")]),
        );
        let discovered = provider(&dns, json!({"record_types": ["a"]}))
            .discover()
            .await
            .unwrap();
        assert_eq!(discovered.ttl, Some(Duration::ZERO));
    }

    #[tokio::test]
    async fn a_present_and_aaaa_nodata_is_just_the_a_records() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", 60, "10.0.0.1")]),
        );
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.1:8080"]);
    }

    #[tokio::test]
    async fn nxdomain_is_an_empty_success() {
        let dns = TestDns::start().await;
        let discovered = provider(&dns, json!({"hostname": "missing.test"}))
            .discover()
            .await
            .unwrap();
        assert!(discovered.endpoints.is_empty());
        assert_eq!(discovered.ttl, None);
        assert_eq!(discovered.revision, revision_of(&[]));
    }

    #[tokio::test]
    async fn nodata_is_an_empty_success() {
        let dns = TestDns::start().await;
        dns.set("api.test", RecordType::TXT, Reply::Records(Vec::new()));
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert!(discovered.endpoints.is_empty());
    }

    #[tokio::test]
    async fn servfail_and_refused_are_response_errors() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", 60, "10.0.0.1")]),
        );
        dns.set(
            "api.test",
            RecordType::AAAA,
            Reply::Code(ResponseCode::ServFail),
        );
        let err = provider(&dns, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::DnsResponse {
                name: "api.test".into(),
                record_type: "AAAA".into(),
                code: "SERVFAIL".into()
            }
        );
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Code(ResponseCode::Refused),
        );
        let err = provider(&dns, json!({"record_types": ["a"]}))
            .discover()
            .await
            .unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::DnsResponse {
                name: "api.test".into(),
                record_type: "A".into(),
                code: "REFUSED".into()
            }
        );
        assert_eq!(
            err.to_string(),
            "DNS server answered REFUSED for api.test A"
        );
    }

    #[tokio::test]
    async fn silence_is_a_lookup_error_within_the_timeout() {
        let dns = TestDns::start().await;
        dns.set("api.test", RecordType::A, Reply::Silence);
        let started = tokio::time::Instant::now();
        let err = provider(&dns, json!({"timeout_ms": 1000, "record_types": ["a"]}))
            .discover()
            .await
            .unwrap_err();
        let elapsed = started.elapsed();
        match &err {
            DiscoveryError::DnsLookup {
                name,
                record_type,
                reason,
            } => {
                assert_eq!((name.as_str(), record_type.as_str()), ("api.test", "A"));
                assert!(reason.contains("no response from"), "{reason}");
            }
            other => panic!("expected DnsLookup, got {other:?}"),
        }
        assert!(elapsed < Duration::from_millis(1000), "took {elapsed:?}");
        assert!(
            elapsed >= Duration::from_millis(800),
            "gave up early: {elapsed:?}"
        );
        assert_eq!(dns.udp_queries(), ROUNDS, "the query is retried once");
    }

    #[tokio::test]
    async fn every_refresh_asks_the_server() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", 3600, "10.0.0.1")]),
        );
        let provider = provider(&dns, json!({"record_types": ["a"]}));
        assert_eq!(keys(&provider.discover().await.unwrap()), ["10.0.0.1:8080"]);
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![a("api.test", 3600, "10.0.0.2")]),
        );
        assert_eq!(keys(&provider.discover().await.unwrap()), ["10.0.0.2:8080"]);
        assert_eq!(dns.udp_queries(), 2);
    }

    #[tokio::test]
    async fn truncated_answers_are_retried_over_tcp() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Truncated(vec![a("api.test", 60, "10.0.0.9")]),
        );
        let discovered = provider(&dns, json!({"record_types": ["a"]}))
            .discover()
            .await
            .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.9:8080"]);
        assert_eq!((dns.udp_queries(), dns.tcp_queries()), (1, 1));
    }

    #[tokio::test]
    async fn cname_chains_are_followed() {
        let dns = TestDns::start().await;
        dns.set(
            "api.test",
            RecordType::A,
            Reply::Records(vec![
                cname("api.test", 20, "real.test"),
                a("real.test", 60, "10.0.0.3"),
                a("other.test", 60, "10.9.9.9"),
            ]),
        );
        let discovered = provider(&dns, json!({"record_types": ["a"]}))
            .discover()
            .await
            .unwrap();
        assert_eq!(keys(&discovered), ["10.0.0.3:8080"]);
        assert_eq!(discovered.ttl, Some(Duration::from_secs(20)));
    }

    #[tokio::test]
    async fn unreachable_server_is_a_lookup_error() {
        // A port nobody listens on: the kernel answers the datagram with "port unreachable".
        let closed = UdpSocket::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap();
        let resolver = Resolver::new(Some(closed), Duration::from_millis(500));
        let err = resolver
            .session()
            .await
            .lookup("api.test", RecordType::A)
            .await
            .unwrap_err();
        assert!(matches!(err, DiscoveryError::DnsLookup { .. }), "{err:?}");
    }
}
