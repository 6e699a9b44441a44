//! Route lookup in a snapshot of 10,000 routes: exact hosts (some with header conditions),
//! wildcards, any-host prefixes and regexes; building that table; and the request path's
//! normalisation that comes before the lookup.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::sync::Arc;

use chrono::Utc;
use criterion::{criterion_group, criterion_main, Criterion};
use http::Method;
use raahi::balance::Balancer;
use raahi::model::{Condition, LbPolicy, Protocol, Route, Service, Timeouts};
use raahi::snapshot::{RequestView, ServiceRuntime, Snapshot};

fn service() -> ServiceRuntime {
    ServiceRuntime {
        service: Arc::new(Service {
            limits: raahi::model::UpstreamLimits::default(),
            id: 1,
            name: "bench".into(),
            protocol: Protocol::Http,
            upstream_authority: None,
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: LbPolicy::RoundRobin,
            hash_on: None,
            hash_balance_factor: None,
            session_persistence: None,
            locality: None,
            timeouts: Timeouts::default(),
            max_attempts: 3,
            health_check: None,
            ejection: Default::default(),
            managed_by: None,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        }),
        upstream_host: None,
        targets: Vec::new(),
        balancer: Balancer::new(LbPolicy::RoundRobin, Vec::new()),
        counters: Default::default(),
        discovery_gap: None,
        sessions: None,
        locality: None,
    }
}

fn route(id: i64, hosts: Vec<String>, prefix: String) -> Route {
    Route {
        id,
        name: format!("r{id}"),
        hosts,
        path_prefix: Some(prefix),
        service_id: Some(1),
        backends: vec![raahi::model::Backend::whole(1)],
        request_buffer_bytes: raahi::model::DEFAULT_REQUEST_BUFFER_BYTES,
        upgrades: raahi::model::default_upgrades(),
        created_at: Utc::now(),
        updated_at: Utc::now(),
        ..Route::default()
    }
}

/// 5,000 exact-host routes (40 hosts × 100 prefixes, and for 25 of each host's prefixes a twin
/// that also wants `x-canary: 1`), 1,000 wildcard routes (10 suffixes × 100 prefixes), 3,990
/// any-host prefixes and 10 any-host regexes.
fn routes() -> Vec<Route> {
    let mut routes = Vec::new();
    let mut id = 0;
    let mut next = || {
        id += 1;
        id
    };
    for host in 0..40 {
        for prefix in 0..100 {
            let hosts = vec![format!("host{host}.example.com")];
            routes.push(route(next(), hosts.clone(), format!("/app{prefix}")));
            if prefix < 25 {
                routes.push(Route {
                    headers: vec![Condition {
                        name: "x-canary".into(),
                        value: Some("1".into()),
                        regex: None,
                        present: None,
                    }],
                    ..route(next(), hosts, format!("/app{prefix}"))
                });
            }
        }
    }
    for suffix in 0..10 {
        for prefix in 0..100 {
            routes.push(route(
                next(),
                vec![format!("*.zone{suffix}.test")],
                format!("/api/v{prefix}"),
            ));
        }
    }
    for prefix in 0..3_990 {
        routes.push(route(next(), Vec::new(), format!("/svc{prefix}/v1")));
    }
    for regex in 0..10 {
        routes.push(Route {
            path_prefix: None,
            path_regex: Some(format!("/items{regex}/[0-9]+(/[a-z]+)?")),
            ..route(next(), Vec::new(), String::new())
        });
    }
    assert_eq!(routes.len(), 10_000);
    routes
}

fn snapshot() -> Snapshot {
    Snapshot::new(1, vec![service()], routes())
}

fn lookups(c: &mut Criterion) {
    let snapshot = snapshot();
    let plain = http::HeaderMap::new();
    let mut canary = http::HeaderMap::new();
    canary.insert("x-canary", http::HeaderValue::from_static("1"));
    let get = |headers| RequestView {
        method: &Method::GET,
        headers,
        query: None,
    };
    let mut group = c.benchmark_group("route_lookup_10000_routes");
    for (name, host, path, headers, expected) in [
        (
            "exact_host",
            "host17.example.com",
            "/app42/users/7",
            &plain,
            true,
        ),
        (
            "exact_host_header_match",
            "host17.example.com",
            "/app7/users/7",
            &canary,
            true,
        ),
        (
            "exact_host_header_fallthrough",
            "host17.example.com",
            "/app7/users/7",
            &plain,
            true,
        ),
        (
            "wildcard_host",
            "edge.eu.zone3.test",
            "/api/v17/items",
            &plain,
            true,
        ),
        (
            "any_host_prefix",
            "unknown.test",
            "/svc3210/v1/orders/12",
            &plain,
            true,
        ),
        (
            "any_host_regex",
            "unknown.test",
            "/items7/12345/detail",
            &plain,
            true,
        ),
        (
            "miss",
            "unknown.test",
            "/nothing/here/at/all",
            &plain,
            false,
        ),
    ] {
        let request = get(headers);
        // The case finds what it is named for.
        assert_eq!(
            snapshot.find_route(host, path, &request).is_some(),
            expected,
            "{name}"
        );
        group.bench_function(name, |b| {
            b.iter(|| black_box(snapshot.find_route(black_box(host), black_box(path), &request)))
        });
    }
    group.finish();
    let routes = routes();
    let mut build = c.benchmark_group("route_table_build");
    build.sample_size(10);
    build.bench_function("10000_routes", |b| {
        b.iter(|| black_box(Snapshot::new(1, vec![service()], routes.clone())))
    });
    build.finish();
}

/// What normalising costs a request: nothing to copy for a path already normal (one scan),
/// and a copy for one that is not.
fn normalisation(c: &mut Criterion) {
    use raahi::model::path::{normalize, EscapedSlashes};
    let mut group = c.benchmark_group("path_normalisation");
    for (name, path) in [
        ("normal_short", "/app42/users/7"),
        ("normal_escaped", "/api/v1/files/report%202026.pdf"),
        ("dot_segments", "/api/v1/../v2/./items//7"),
        ("unreserved_escapes", "/%61pi/v1/%7Euser/items"),
    ] {
        group.bench_function(name, |b| {
            b.iter(|| black_box(normalize(black_box(path), EscapedSlashes::Keep).is_ok()))
        });
    }
    group.finish();
}

criterion_group!(benches, lookups, normalisation);
criterion_main!(benches);
