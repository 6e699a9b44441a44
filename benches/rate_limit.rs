//! A rate-limited request's cost (issue 37: at most 0.5 µs of CPU per request): the key's
//! hash, its bucket lookup and the GCRA compare-and-swap, for one hot key, for keys spread
//! over a full table of 100,000 (cache misses), and for keys that keep evicting others.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};

use criterion::{criterion_group, criterion_main, Criterion};
use raahi::model::{RateLimit, RateLimitKey, RateLimitScope};
use raahi::snapshot::RateLimiter;
use tokio::time::Instant;

fn limiter(key: RateLimitKey, scope: RateLimitScope) -> RateLimiter {
    RateLimiter::new(&RateLimit {
        // Fast enough that every request is admitted: the common case costs the most.
        requests_per_second: 1e6,
        burst: Some(1_000_000),
        key,
        scope,
        max_keys: 100_000,
    })
}

fn client(index: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(0x0a00_0000 | index))
}

fn rate_limit(c: &mut Criterion) {
    let mut group = c.benchmark_group("rate_limit");
    let headers = http::HeaderMap::new();

    let by_ip = limiter(RateLimitKey::ClientIp, RateLimitScope::Instance);
    group.bench_function("client_ip_one_key", |b| {
        b.iter(|| {
            let key = by_ip.key_of(&headers, black_box(client(7)));
            black_box(by_ip.check(key, Instant::now()))
        })
    });

    let spread = limiter(RateLimitKey::ClientIp, RateLimitScope::Cluster);
    for index in 0..100_000 {
        spread.check(spread.key_of(&headers, client(index)), Instant::now());
    }
    let mut next = 0u32;
    group.bench_function("client_ip_100k_keys_cluster", |b| {
        b.iter(|| {
            next = (next + 7919) % 100_000;
            let key = spread.key_of(&headers, black_box(client(next)));
            black_box(spread.check(key, Instant::now()))
        })
    });

    let evicting = limiter(RateLimitKey::ClientIp, RateLimitScope::Instance);
    let mut fresh = 0u32;
    group.bench_function("client_ip_new_key_evicts", |b| {
        b.iter(|| {
            fresh = fresh.wrapping_add(1);
            let key = evicting.key_of(&headers, black_box(client(fresh)));
            black_box(evicting.check(key, Instant::now()))
        })
    });

    let by_header = limiter(
        RateLimitKey::Header("x-api-key".into()),
        RateLimitScope::Instance,
    );
    let mut with_key = http::HeaderMap::new();
    with_key.insert(
        "x-api-key",
        "4f1c8e3a-9b7d-4c2e-8a6f-1d3b5e7f9a0c".parse().unwrap(),
    );
    group.bench_function("header_key", |b| {
        b.iter(|| {
            let key = by_header.key_of(black_box(&with_key), client(1));
            black_box(by_header.check(key, Instant::now()))
        })
    });
    group.finish();
}

criterion_group!(benches, rate_limit);
criterion_main!(benches);
