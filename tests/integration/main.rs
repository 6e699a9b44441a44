//! Raahi's integration suite as one test binary (one link of the crate and its dependencies
//! instead of one per file). Each former `tests/X.rs` is the module `X`, so a test is named
//! `X::test_name`; run one file's tests with `cargo test --test integration X::`.
//!
//! The tests that measure this process's resident memory are not here: other tests running in
//! the same process would pollute the measurement. They are the `memory` test binary
//! (`tests/memory/`), which `scripts/test.sh` runs on its own, one test at a time.

// The suite runs the gateway against real sockets and processes, on real time: the clock rule
// in clippy.toml (tokio's pausable clock, wall time through `raahi::clock`) is for `src/`.
#![allow(clippy::disallowed_methods)]

#[path = "../common/mod.rs"]
mod common;

mod admin_api;
mod affinity;
mod canary;
mod cli;
mod cli_status;
mod cluster;
mod cluster_resync;
mod conformance;
mod consul_fake;
mod dashboard;
mod declarative;
mod discovery_consul;
mod discovery_dns;
mod discovery_http;
mod discovery_kubernetes;
mod discovery_safety;
mod distributed_tracing;
mod edge_admin;
mod edge_limits;
mod events;
mod grpc;
mod health;
mod health_tls;
mod kubernetes_fake;
mod layering;
mod locality;
mod operability;
mod proxy;
mod rate_limit;
mod rate_limit_cluster;
mod registration;
mod request_spool;
mod retry;
mod retry_api;
mod route_rules;
mod smoke;
mod stream_routes;
mod tls;
mod toolchain;
mod upload_stalls;
mod upstream_h1;
mod upstream_h2;
