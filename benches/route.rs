//! Route lookup in a snapshot of 10,000 routes: exact hosts, wildcards and any-host prefixes;
//! and the request path's normalisation that comes before it.
// Benchmarks measure real time, not the paused clock the rule in clippy.toml is for.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;

use chrono::Utc;
use criterion::{criterion_group, criterion_main, Criterion};
use http::Method;
use raahi::balance::Balancer;
use raahi::model::{LbPolicy, Protocol, Route, Service, Timeouts};
use raahi::snapshot::{RequestView, ServiceRuntime, Snapshot};

fn service() -> ServiceRuntime {
    ServiceRuntime {
        service: Service {
            limits: raahi::model::UpstreamLimits::default(),
            id: 1,
            name: "bench".into(),
            protocol: Protocol::Http,
            upstream_authority: None,
            tls_sni: None,
            tls_verify: true,
            tls_ca_pem: None,
            lb_policy: LbPolicy::RoundRobin,
            timeouts: Timeouts::default(),
            max_attempts: 3,
            health_check: None,
            ejection: Default::default(),
            managed_by: None,
            created_at: Utc::now(),
            updated_at: Utc::now(),
        },
        upstream_host: None,
        targets: Vec::new(),
        balancer: Balancer::new(LbPolicy::RoundRobin, Vec::new()),
        counters: Default::default(),
        discovery_gap: None,
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

/// 4,000 exact-host routes (40 hosts × 100 prefixes), 1,000 wildcard routes (10 suffixes ×
/// 100 prefixes), 5,000 any-host prefixes.
fn snapshot() -> Snapshot {
    let mut routes = Vec::new();
    let mut id = 0;
    let mut next = || {
        id += 1;
        id
    };
    for host in 0..40 {
        for prefix in 0..100 {
            routes.push(route(
                next(),
                vec![format!("host{host}.example.com")],
                format!("/app{prefix}"),
            ));
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
    for prefix in 0..5_000 {
        routes.push(route(next(), Vec::new(), format!("/svc{prefix}/v1")));
    }
    Snapshot::new(1, vec![service()], routes)
}

fn lookups(c: &mut Criterion) {
    let snapshot = snapshot();
    let headers = http::HeaderMap::new();
    let view = RequestView {
        method: &Method::GET,
        headers: &headers,
        query: None,
    };
    let mut group = c.benchmark_group("route_lookup_10000_routes");
    group.bench_function("exact_host", |b| {
        b.iter(|| {
            black_box(snapshot.find_route(
                black_box("host17.example.com"),
                black_box("/app42/users/7"),
                &view,
            ))
        })
    });
    group.bench_function("wildcard_host", |b| {
        b.iter(|| {
            black_box(snapshot.find_route(
                black_box("edge.eu.zone3.test"),
                black_box("/api/v17/items"),
                &view,
            ))
        })
    });
    group.bench_function("any_host_prefix", |b| {
        b.iter(|| {
            black_box(snapshot.find_route(
                black_box("unknown.test"),
                black_box("/svc4321/v1/orders/12"),
                &view,
            ))
        })
    });
    group.bench_function("miss", |b| {
        b.iter(|| {
            black_box(snapshot.find_route(
                black_box("unknown.test"),
                black_box("/nothing/here/at/all"),
                &view,
            ))
        })
    });
    group.finish();
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
