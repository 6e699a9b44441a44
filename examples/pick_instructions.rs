//! Instructions per `ServiceRuntime::pick`, for callgrind: runs N picks over 10 targets in one
//! tier (`benches/balance.rs`'s `service_pick` service) and nothing else worth counting, so
//! that (Ir at 2N - Ir at N) / N is one pick's cost, free of set-up and of the binary's start.
//!
//! Usage: pick_instructions N [round_robin|random|least_request] [no_ejection|one_ejected|half_open]
//! See `scripts/pick-instructions.sh`.
// A measuring tool: the wall clock is what the ejection it sets up compares with.
#![allow(clippy::disallowed_methods)]

#[path = "../benches/support/service.rs"]
mod support;

use std::hint::black_box;

use raahi::balance::FailureCause;
use raahi::clock::unix_ms;
use raahi::model::{Ejection, LbPolicy};
use support::service;

fn main() {
    let mut args = std::env::args().skip(1);
    let picks: usize = args
        .next()
        .and_then(|n| n.parse().ok())
        .expect("usage: pick_instructions N [policy] [variant]");
    let policy = match args.next().as_deref() {
        None | Some("round_robin") => LbPolicy::RoundRobin,
        Some("random") => LbPolicy::Random,
        Some("least_request") => LbPolicy::LeastRequest,
        Some(other) => panic!("unknown policy {other}"),
    };
    let service = service(policy, 10);
    let hour = Ejection {
        base_ejection_ms: 3_600_000,
        max_ejection_ms: 3_600_000,
        ..Ejection::default()
    };
    match args.next().as_deref() {
        None | Some("no_ejection") => {}
        // Out for the whole run.
        Some("one_ejected") => {
            service.targets[0]
                .health
                .eject(unix_ms(), &hour, FailureCause::Timeout)
                .expect("a fresh target can be ejected");
        }
        // Its ejection over, not yet proven: each pick that meets it takes and ends a trial.
        Some("half_open") => {
            service.targets[0]
                .health
                .eject(unix_ms() - 7_200_000, &hour, FailureCause::Timeout)
                .expect("a fresh target can be ejected");
        }
        Some(other) => panic!("unknown variant {other}"),
    }
    let mut found = 0usize;
    for _ in 0..picks {
        found += usize::from(black_box(&service).pick(|_| false, true).is_some());
    }
    assert_eq!(found, picks);
}
