//! A rate-limited route's key table (issue 37's memory goal): a million distinct client keys
//! (IPv6 /64 networks) with `max_keys` 100,000 keep RSS growth under 64 MiB, because the table
//! is allocated once for `max_keys` and a new key takes the idlest slot. Runs alone (see
//! `main.rs`).

use std::net::{IpAddr, Ipv6Addr};

use raahi::model::{RateLimit, RateLimitKey, RateLimitScope};
use raahi::snapshot::{Decision, RateLimiter};

use crate::common::rss_kib;

const KEYS: u32 = 1_000_000;
const MAX_KEYS: u32 = 100_000;
const LIMIT_KIB: u64 = 64 * 1024;

#[tokio::test]
async fn a_million_client_keys_in_a_table_of_100_000_cost_under_64_mib() {
    let _alone = crate::ALONE.lock().await;
    let before = rss_kib();
    let limiter = RateLimiter::new(&RateLimit {
        requests_per_second: 1.0,
        burst: Some(1),
        key: RateLimitKey::ClientIp,
        scope: RateLimitScope::Cluster,
        max_keys: MAX_KEYS,
    });
    let headers = http::HeaderMap::new();
    let now = tokio::time::Instant::now();
    let mut admitted = 0u32;
    for client in 0..KEYS {
        // Every client a different IPv6 /64 (one key each; addresses within a /64 share one).
        let network = 0x2001_0db8_u128 << 96 | u128::from(client) << 64;
        let address = IpAddr::V6(Ipv6Addr::from(network | 1));
        let key = limiter.key_of(&headers, address);
        if matches!(limiter.check(key, now), Decision::Admitted { .. }) {
            admitted += 1;
        }
    }
    let growth = rss_kib().saturating_sub(before);
    eprintln!(
        "{KEYS} keys, max_keys {MAX_KEYS}: RSS +{growth} KiB, {} keys tracked, {} evicted",
        limiter.keys(),
        limiter.evicted.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert_eq!(
        admitted, KEYS,
        "each new key is at rest: its first request passes"
    );
    assert_eq!(limiter.keys(), u64::from(MAX_KEYS));
    assert!(
        limiter.evicted.load(std::sync::atomic::Ordering::Relaxed) >= u64::from(KEYS - MAX_KEYS)
    );
    assert!(
        growth < LIMIT_KIB,
        "RSS grew {growth} KiB, limit {LIMIT_KIB} KiB"
    );
}
