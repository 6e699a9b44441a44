//! The `dns-srv` provider: SRV records of a service name, then the addresses of each target.
//!
//! Every priority tier is kept (the balancer fails over between tiers), and RFC 2782 weights
//! are mapped so that a weight-0 record still gets a very small share.
//!
//! Weights: a record of weight 0 becomes target weight 1; a positive weight `w` becomes
//! `w × k`, with one integer factor `k` for the whole answer: 100 while the largest record weight
//! is at most 655, else `65535 / largest` (rounded down, 1 at worst). So no record weight can
//! make a target weight beyond the 65535 the API accepts, positive weights keep their exact
//! proportions, and a zero stays below every positive weight (with `k = 1` it equals a weight of
//! 1, which is the chance RFC 2782's own selection gives it: picked only when the random number
//! drawn from `0..=sum` is 0).

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use futures_util::future::{try_join, try_join_all};
use hickory_proto::rr::rdata::SRV;
use hickory_proto::rr::{Name, RData, RecordType};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::discovery::config::{
    self, check_dns_name, check_resolver, default_interval_ms, default_timeout_ms, default_true,
    default_weight, normalised_resolver, registry_weight_scale, resolver_address, ProviderConfig,
    SharedKeys,
};
use crate::discovery::resolver::{address_key, min_ttl, Answer, Resolver, Session};
use crate::discovery::{
    revision_of, ConfigError, Discovered, DiscoveryError, Fetch, FetchStyle, PollProvider,
    RefreshFuture, Registered,
};
use crate::model::{Endpoint, ProviderKind};

pub const PROVIDER: Registered = Registered {
    provider: ProviderKind::DnsSrv,
    style: FetchStyle::Poll,
    description: "SRV records of `service_name`, then the A and AAAA records of each target; \
                  port, weight and priority come from the SRV records.",
    schema: config::schema_of::<DnsSrvConfig>,
    validate: config::validate_as::<DnsSrvConfig>,
    build,
};

/// `dns-srv`: SRV records of a service name, then A and AAAA of each SRV target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DnsSrvConfig {
    /// The SRV name, e.g. `_http._tcp.backend.internal`.
    pub service_name: String,
    /// DNS server as `ip:port` (UDP, TCP when the answer is truncated); unset uses /etc/resolv.conf.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolver: Option<String>,
    /// Take each endpoint's weight from its SRV record (RFC 2782 weight 0 gets a very small share).
    #[serde(default = "default_true")]
    pub use_record_weight: bool,
    /// Take each endpoint's priority tier from its SRV record.
    #[serde(default = "default_true")]
    pub use_record_priority: bool,
    /// Unused by SRV records (they carry a port); accepted for symmetry with the other providers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub port: Option<u32>,
    /// Milliseconds between refreshes (each wait subtracts up to 10 % jitter; a shorter record TTL refreshes sooner).
    #[serde(default = "default_interval_ms")]
    #[schemars(range(min = 100, max = 86_400_000))]
    pub interval_ms: u64,
    /// Milliseconds one refresh may take.
    #[serde(default = "default_timeout_ms")]
    #[schemars(range(min = 10, max = 600_000))]
    pub timeout_ms: u64,
    /// Weight of every endpoint when `use_record_weight` is false.
    #[serde(default = "default_weight")]
    #[schemars(range(max = 65535))]
    pub weight: u32,
    /// Priority tier of every endpoint when `use_record_priority` is false.
    #[serde(default)]
    pub priority: i32,
}

impl ProviderConfig for DnsSrvConfig {
    fn shared(&self) -> SharedKeys {
        SharedKeys {
            interval_ms: Some(self.interval_ms),
            timeout_ms: self.timeout_ms,
            weight: self.weight,
            port: self.port,
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        check_dns_name("service_name", &self.service_name)?;
        check_resolver(self.resolver.as_deref())
    }

    fn normalise(&mut self) {
        self.resolver = normalised_resolver(self.resolver.as_deref());
    }
}

fn build(config: &Value) -> Result<Fetch, ConfigError> {
    let config = config::parse::<DnsSrvConfig>(config)?;
    Ok(Fetch::Poll {
        schedule: config::schedule_of(&config),
        provider: Box::new(DnsSrvProvider::new(&config)),
    })
}

pub struct DnsSrvProvider {
    service_name: String,
    use_record_weight: bool,
    use_record_priority: bool,
    weight: u32,
    priority: i32,
    resolver: Resolver,
}

impl DnsSrvProvider {
    /// `config` has passed `validate`.
    pub fn new(config: &DnsSrvConfig) -> Self {
        DnsSrvProvider {
            service_name: config.service_name.clone(),
            use_record_weight: config.use_record_weight,
            use_record_priority: config.use_record_priority,
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
        let answer = session.lookup(&self.service_name, RecordType::SRV).await?;
        let records = usable_records(&answer);
        let scale = weight_scale(&records);
        let targets = unique_targets(&records);
        let lookups = targets.iter().map(|target| addresses_of(&session, target));
        let resolved = try_join_all(lookups).await?;

        let mut ttls = vec![answer.ttl];
        let mut addresses = HashMap::new();
        for (target, (v4, v6)) in targets.iter().zip(&resolved) {
            ttls.extend([v4.ttl, v6.ttl]);
            let ips: Vec<_> = v4.addresses().chain(v6.addresses()).collect();
            addresses.insert(target.clone(), ips);
        }

        let mut endpoints = Vec::new();
        let mut seen = HashSet::new();
        for srv in &records {
            let metadata = serde_json::json!({ "srv_target": target_text(srv.target()) });
            for ip in addresses.get(srv.target()).into_iter().flatten() {
                let endpoint = Endpoint {
                    key: address_key(*ip, srv.port()),
                    host: ip.to_string(),
                    port: srv.port(),
                    weight: self.weight_of(srv, scale),
                    priority: self.priority_of(srv),
                    enabled: true,
                    metadata: metadata.clone(),
                };
                if seen.insert(endpoint.key.clone()) {
                    endpoints.push(endpoint);
                }
            }
        }
        Ok(Discovered {
            revision: revision_of(&endpoints),
            endpoints,
            ttl: min_ttl(ttls.into_iter()),
            refused: None,
            departures: Vec::new(),
        })
    }

    fn weight_of(&self, srv: &SRV, scale: u32) -> u32 {
        if self.use_record_weight {
            balancer_weight(srv.weight(), scale)
        } else {
            self.weight
        }
    }

    fn priority_of(&self, srv: &SRV) -> i32 {
        if self.use_record_priority {
            i32::from(srv.priority())
        } else {
            self.priority
        }
    }
}

impl PollProvider for DnsSrvProvider {
    fn refresh(&self) -> RefreshFuture<'_> {
        Box::pin(self.discover())
    }
}

/// The factor for every positive weight of one answer (see the module doc).
fn weight_scale(records: &[SRV]) -> u32 {
    let largest = records.iter().map(SRV::weight).max().unwrap_or(0);
    registry_weight_scale(u32::from(largest))
}

/// RFC 2782 weight → balancer weight. Weight 0 maps to 1 and positive weights to w×scale, which
/// covers both rules at once: in a tier of only zeros every record gets 1 (an even share), and
/// next to positive weights a zero gets a very small share instead of none.
fn balancer_weight(record_weight: u16, scale: u32) -> u32 {
    match record_weight {
        0 => 1,
        weight => u32::from(weight) * scale,
    }
}

/// SRV records that name a target, in a stable order (tier, then heavier first), so "the
/// first of two records with the same address" does not depend on the server's rotation.
/// A target of "." means "the service is not available here" and yields nothing.
fn usable_records(answer: &Answer) -> Vec<SRV> {
    let mut records: Vec<SRV> = answer
        .records
        .iter()
        .filter_map(|record| match record.data() {
            RData::SRV(srv) if !srv.target().is_root() => Some(srv.clone()),
            _ => None,
        })
        .collect();
    records.sort_by_key(|srv| {
        (
            srv.priority(),
            Reverse(srv.weight()),
            srv.target().to_lowercase().to_ascii(),
            srv.port(),
        )
    });
    records
}

fn unique_targets(records: &[SRV]) -> Vec<Name> {
    let mut seen = HashSet::new();
    records
        .iter()
        .map(|srv| srv.target().clone())
        .filter(|target| seen.insert(target.clone()))
        .collect()
}

/// A and AAAA of one SRV target, asked at once through the refresh's session.
async fn addresses_of(
    session: &Session,
    target: &Name,
) -> Result<(Answer, Answer), DiscoveryError> {
    // SRV targets are absolute names: the trailing dot keeps the search list out of it.
    let name = target.to_ascii();
    try_join(
        session.lookup(&name, RecordType::A),
        session.lookup(&name, RecordType::AAAA),
    )
    .await
}

fn target_text(target: &Name) -> String {
    target.to_ascii().trim_end_matches('.').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::resolver::test_server::{a, aaaa, srv, Reply, TestDns};
    use crate::model::{ProviderKind, MAX_WEIGHT};
    use hickory_proto::op::ResponseCode;
    use serde_json::json;

    const SERVICE: &str = "_http._tcp.api.test";

    fn provider(dns: &TestDns, extra: serde_json::Value) -> DnsSrvProvider {
        let mut config = json!({ "service_name": SERVICE, "resolver": dns.addr.to_string(), "timeout_ms": 2000 });
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let config = crate::discovery::validate(ProviderKind::DnsSrv, &config).unwrap();
        DnsSrvProvider::new(&serde_json::from_value(config).unwrap())
    }

    /// (key, weight, priority) of every endpoint, in order.
    fn summary(discovered: &Discovered) -> Vec<(String, u32, i32)> {
        discovered
            .endpoints
            .iter()
            .map(|endpoint| (endpoint.key.clone(), endpoint.weight, endpoint.priority))
            .collect()
    }

    fn entry(key: &str, weight: u32, priority: i32) -> (String, u32, i32) {
        (key.to_owned(), weight, priority)
    }

    /// Two tiers: priority 10 has weights 60, 20 and 0; priority 20 has only weight-0 records.
    async fn two_tier_server() -> TestDns {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![
                srv(SERVICE, 300, 20, 0, 9002, "c.test"),
                srv(SERVICE, 300, 10, 20, 9001, "b.test"),
                srv(SERVICE, 120, 10, 60, 9000, "a.test"),
                srv(SERVICE, 300, 10, 0, 9003, "d.test"),
                srv(SERVICE, 300, 20, 0, 9004, "e.test"),
            ]),
        );
        for (host, ip) in [
            ("a.test", "10.0.0.1"),
            ("b.test", "10.0.0.2"),
            ("c.test", "10.0.0.3"),
            ("d.test", "10.0.0.4"),
            ("e.test", "10.0.0.5"),
        ] {
            dns.set(host, RecordType::A, Reply::Records(vec![a(host, 60, ip)]));
        }
        dns
    }

    #[tokio::test]
    async fn priorities_and_weights_come_from_the_records() {
        let dns = two_tier_server().await;
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(
            summary(&discovered),
            [
                entry("10.0.0.1:9000", 6000, 10),
                entry("10.0.0.2:9001", 2000, 10),
                // Weight 0 next to positive weights: a very small share, not none.
                entry("10.0.0.4:9003", 1, 10),
                // A tier of only weight 0: an even share.
                entry("10.0.0.3:9002", 1, 20),
                entry("10.0.0.5:9004", 1, 20),
            ]
        );
        assert_eq!(
            discovered.endpoints[0].metadata,
            json!({"srv_target": "a.test"})
        );
        assert_eq!(discovered.endpoints[0].host, "10.0.0.1");
        assert_eq!(discovered.ttl, Some(Duration::from_secs(60)));
        assert_eq!(discovered.revision, revision_of(&discovered.endpoints));
    }

    #[tokio::test]
    async fn record_weight_and_priority_can_be_ignored() {
        let dns = two_tier_server().await;
        let discovered = provider(
            &dns,
            json!({"use_record_weight": false, "use_record_priority": false, "weight": 5, "priority": 3}),
        )
        .discover()
        .await
        .unwrap();
        assert_eq!(discovered.endpoints.len(), 5);
        assert!(summary(&discovered)
            .iter()
            .all(|(_, weight, priority)| (*weight, *priority) == (5, 3)));
    }

    #[tokio::test]
    async fn dot_target_yields_nothing() {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![srv(SERVICE, 300, 0, 0, 0, ".")]),
        );
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert!(discovered.endpoints.is_empty());
    }

    #[tokio::test]
    async fn target_with_a_and_aaaa_gives_both_addresses() {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![srv(SERVICE, 300, 1, 10, 443, "dual.test")]),
        );
        dns.set(
            "dual.test",
            RecordType::A,
            Reply::Records(vec![a("dual.test", 90, "10.0.0.7")]),
        );
        dns.set(
            "dual.test",
            RecordType::AAAA,
            Reply::Records(vec![aaaa("dual.test", 30, "fd00::7")]),
        );
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(
            summary(&discovered),
            [
                entry("10.0.0.7:443", 1000, 1),
                entry("[fd00::7]:443", 1000, 1)
            ]
        );
        assert_eq!(discovered.ttl, Some(Duration::from_secs(30)));
    }

    /// RFC 2181 §8: an SRV TTL with the top bit set is 0, not the smallest hint of the answer.
    #[tokio::test]
    async fn an_srv_ttl_of_2_pow_31_or_more_is_taken_as_zero() {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![srv(SERVICE, 0x8000_0001, 1, 10, 443, "big.test")]),
        );
        dns.set(
            "big.test",
            RecordType::A,
            Reply::Records(vec![a("big.test", 90, "10.0.0.8")]),
        );
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(summary(&discovered), [entry("10.0.0.8:443", 1000, 1)]);
        assert_eq!(discovered.ttl, Some(Duration::ZERO));
    }

    #[tokio::test]
    async fn duplicate_addresses_keep_the_first() {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![
                srv(SERVICE, 300, 5, 10, 80, "alias.test"),
                srv(SERVICE, 300, 1, 10, 80, "real.test"),
            ]),
        );
        for host in ["alias.test", "real.test"] {
            dns.set(
                host,
                RecordType::A,
                Reply::Records(vec![a(host, 60, "10.0.0.8")]),
            );
        }
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(summary(&discovered), [entry("10.0.0.8:80", 1000, 1)]);
        assert_eq!(
            discovered.endpoints[0].metadata,
            json!({"srv_target": "real.test"})
        );
    }

    #[tokio::test]
    async fn missing_service_is_an_empty_success() {
        let dns = TestDns::start().await;
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert!(discovered.endpoints.is_empty());
        dns.set(SERVICE, RecordType::TXT, Reply::Records(Vec::new()));
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert!(discovered.endpoints.is_empty(), "NODATA");
    }

    #[tokio::test]
    async fn errors_on_srv_or_target_lookups_fail_the_refresh() {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Code(ResponseCode::ServFail),
        );
        let err = provider(&dns, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::DnsResponse {
                name: SERVICE.into(),
                record_type: "SRV".into(),
                code: "SERVFAIL".into()
            }
        );
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![srv(SERVICE, 300, 1, 10, 80, "t.test")]),
        );
        dns.set(
            "t.test",
            RecordType::A,
            Reply::Records(vec![a("t.test", 60, "10.0.0.1")]),
        );
        dns.set(
            "t.test",
            RecordType::AAAA,
            Reply::Code(ResponseCode::Refused),
        );
        let err = provider(&dns, json!({})).discover().await.unwrap_err();
        assert_eq!(
            err,
            DiscoveryError::DnsResponse {
                name: "t.test.".into(),
                record_type: "AAAA".into(),
                code: "REFUSED".into()
            }
        );
    }

    /// Target weights of one answer's record weights, as `discover` maps them.
    fn mapped(record_weights: &[u16]) -> Vec<u32> {
        let largest = record_weights.iter().copied().max().unwrap_or(0);
        let scale = registry_weight_scale(u32::from(largest));
        record_weights
            .iter()
            .map(|weight| balancer_weight(*weight, scale))
            .collect()
    }

    #[test]
    fn weight_zero_gets_a_small_share() {
        assert_eq!(mapped(&[0, 1, 655]), [1, 100, 65_500]);
        assert_eq!(mapped(&[0]), [1], "a tier of only zeros: an even share");
    }

    /// ×100 for every weight made 656 a target weight of 65600, which the API refuses; the
    /// answer's factor shrinks instead, keeping the proportions exact.
    #[test]
    fn large_record_weights_stay_within_the_target_limit() {
        assert_eq!(mapped(&[0, 1, 656]), [1, 99, 656 * 99]);
        assert_eq!(mapped(&[0, 1, 655, 656]), [1, 99, 655 * 99, 656 * 99]);
        assert_eq!(mapped(&[0, 1, 65_535]), [1, 1, 65_535]);
        assert_eq!(mapped(&[32_768, 65_535]), [32_768, 65_535]);
        for largest in 1..=u16::MAX {
            let weights = mapped(&[0, 1, largest]);
            assert!(weights[2] <= MAX_WEIGHT, "{largest} -> {weights:?}");
            assert_eq!(
                weights[2],
                weights[1] * u32::from(largest),
                "{largest}: proportions kept"
            );
            assert!(weights[0] <= weights[1], "{largest}: zero below one");
        }
    }

    #[tokio::test]
    async fn an_answer_with_a_large_weight_is_scaled_as_a_whole() {
        let dns = TestDns::start().await;
        dns.set(
            SERVICE,
            RecordType::SRV,
            Reply::Records(vec![
                srv(SERVICE, 60, 10, 65_535, 9000, "a.test"),
                srv(SERVICE, 60, 10, 1, 9001, "b.test"),
                srv(SERVICE, 60, 10, 0, 9002, "c.test"),
            ]),
        );
        for (host, ip) in [
            ("a.test", "10.0.0.1"),
            ("b.test", "10.0.0.2"),
            ("c.test", "10.0.0.3"),
        ] {
            dns.set(host, RecordType::A, Reply::Records(vec![a(host, 60, ip)]));
        }
        let discovered = provider(&dns, json!({})).discover().await.unwrap();
        assert_eq!(
            summary(&discovered),
            [
                entry("10.0.0.1:9000", 65_535, 10),
                entry("10.0.0.2:9001", 1, 10),
                entry("10.0.0.3:9002", 1, 10),
            ]
        );
    }
}
