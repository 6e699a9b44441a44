//! A canary route's answers counted for its analysis (TRAFFIC.md §4): by the backend the request
//! went to, whether it failed, and its time to response headers. A gRPC answer is judged by the
//! `grpc-status` of its trailers, so it is counted when its body ends.

use std::sync::Arc;
use std::time::Duration;

use crate::snapshot::{is_canary_error, CanaryCounters, Outcome, RouteEntry};

/// One answer of a canary route, waiting for its gRPC status (or counted at once).
pub struct CanaryTally {
    counters: Arc<CanaryCounters>,
    backend: usize,
    status: u16,
    micros: u64,
}

impl CanaryTally {
    /// The tally of an answer of `route` from the backend at `backend`; None for a route without
    /// a canary or a request that never reached a backend.
    pub fn of(
        route: &RouteEntry,
        backend: Option<usize>,
        status: u16,
        elapsed: Duration,
    ) -> Option<CanaryTally> {
        Some(CanaryTally {
            counters: route.canary.clone()?,
            backend: backend?,
            status,
            micros: u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
        })
    }

    /// Counts the answer, with the gRPC status it ended with.
    pub fn count(self, grpc_status: Option<u16>) {
        self.counters.record(
            self.backend,
            Outcome {
                failed: is_canary_error(self.status, grpc_status),
                micros: self.micros,
            },
        );
    }
}
