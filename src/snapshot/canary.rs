//! A canary route's side of the data path (TRAFFIC.md §4): the backends' weights for the step in
//! force, compiled into the route's schedule, and per-backend counts the request path adds to
//! with atomics and the canary task takes about once a second.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::{latency_bucket, Backend, Canary, CanaryCounts, LATENCY_BUCKETS};

/// The weights of a route's backends while its canary backend takes `percent` of the requests:
/// the others share the rest in their configured proportions. Scaled to 10,000 in all, so a
/// step's share is exact over the schedule, whatever the other weights.
pub fn canary_weights(backends: &[Backend], canary: &Canary, percent: u8) -> Vec<u32> {
    const TOTAL: u64 = 10_000;
    let percent = u64::from(percent.min(100));
    let canary_index = canary.backend_index();
    let others: u64 = backends
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != canary_index)
        .map(|(_, backend)| u64::from(backend.weight))
        .sum();
    let rest = TOTAL * (100 - percent) / 100;
    backends
        .iter()
        .enumerate()
        .map(|(index, backend)| {
            let weight = if index == canary_index {
                TOTAL * percent / 100
            } else {
                (rest * u64::from(backend.weight))
                    .checked_div(others)
                    .unwrap_or(0)
            };
            u32::try_from(weight).unwrap_or(u32::MAX)
        })
        .collect()
}

/// One backend's outcomes since the canary task last took them.
struct BackendOutcomes {
    requests: AtomicU64,
    errors: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
}

impl BackendOutcomes {
    fn new() -> BackendOutcomes {
        BackendOutcomes {
            requests: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            latency: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }

    fn take(&self) -> CanaryCounts {
        let mut latency: Vec<u64> = self
            .latency
            .iter()
            .map(|bucket| bucket.swap(0, Ordering::Relaxed))
            .collect();
        while latency.last() == Some(&0) {
            latency.pop();
        }
        CanaryCounts {
            requests: self.requests.swap(0, Ordering::Relaxed),
            errors: self.errors.swap(0, Ordering::Relaxed),
            latency,
        }
    }
}

/// The outcomes of a canary route's requests by backend position, carried across snapshots
/// while the route keeps its number of backends.
pub struct CanaryCounters {
    backends: Box<[BackendOutcomes]>,
}

/// How one request of a canary route ended, as the canary judges it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub failed: bool,
    /// Time to response headers.
    pub micros: u64,
}

impl std::fmt::Debug for CanaryCounters {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("CanaryCounters")
            .field("backends", &self.backends.len())
            .finish()
    }
}

impl CanaryCounters {
    pub fn new(backends: usize) -> CanaryCounters {
        CanaryCounters {
            backends: (0..backends).map(|_| BackendOutcomes::new()).collect(),
        }
    }

    pub fn backends(&self) -> usize {
        self.backends.len()
    }

    /// Counts one request sent to the backend at `backend`.
    pub fn record(&self, backend: usize, outcome: Outcome) {
        let Some(outcomes) = self.backends.get(backend) else {
            return;
        };
        outcomes.requests.fetch_add(1, Ordering::Relaxed);
        if outcome.failed {
            outcomes.errors.fetch_add(1, Ordering::Relaxed);
        }
        outcomes.latency[latency_bucket(outcome.micros)].fetch_add(1, Ordering::Relaxed);
    }

    /// Every backend's outcomes since the last take, by position; the counters start again.
    pub fn take(&self) -> Vec<CanaryCounts> {
        self.backends.iter().map(BackendOutcomes::take).collect()
    }
}

/// Whether an answer counts as a canary error: a 5xx (Raahi's own for upstream failures
/// included), or a gRPC status that says the server failed: UNKNOWN (2), DEADLINE_EXCEEDED (4),
/// INTERNAL (13), UNAVAILABLE (14).
pub fn is_error(status: u16, grpc_status: Option<u16>) -> bool {
    status >= 500 || matches!(grpc_status, Some(2 | 4 | 13 | 14))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::CanaryCounts;

    fn canary(backend: u32) -> Canary {
        serde_json::from_value(serde_json::json!({"backend": backend})).unwrap()
    }

    fn backends(weights: &[u32]) -> Vec<Backend> {
        weights
            .iter()
            .map(|&weight| Backend {
                weight,
                ..Backend::whole(1)
            })
            .collect()
    }

    #[test]
    fn the_canary_takes_its_step_and_the_others_share_the_rest_by_weight() {
        assert_eq!(
            canary_weights(&backends(&[100, 100]), &canary(1), 5),
            vec![9_500, 500]
        );
        assert_eq!(
            canary_weights(&backends(&[30, 10, 10]), &canary(1), 20),
            vec![6_000, 2_000, 2_000]
        );
        assert_eq!(
            canary_weights(&backends(&[1, 1]), &canary(0), 100),
            vec![10_000, 0]
        );
        assert_eq!(
            canary_weights(&backends(&[1, 1]), &canary(0), 0),
            vec![0, 10_000]
        );
    }

    #[test]
    fn a_take_hands_over_the_outcomes_and_starts_again() {
        let counters = CanaryCounters::new(2);
        counters.record(
            1,
            Outcome {
                failed: true,
                micros: 300,
            },
        );
        counters.record(
            1,
            Outcome {
                failed: false,
                micros: 100,
            },
        );
        counters.record(
            7,
            Outcome {
                failed: true,
                micros: 1,
            },
        );
        let taken = counters.take();
        assert_eq!(taken[0], CanaryCounts::default());
        assert_eq!((taken[1].requests, taken[1].errors), (2, 1));
        assert_eq!(taken[1].latency, vec![1, 0, 1]);
        assert!(counters.take().iter().all(CanaryCounts::is_empty));
    }

    #[test]
    fn server_failures_count_as_errors_and_client_ones_do_not() {
        assert!(is_error(503, None));
        assert!(is_error(200, Some(14)));
        assert!(is_error(200, Some(13)));
        assert!(!is_error(404, None));
        assert!(!is_error(200, Some(5)));
        assert!(!is_error(200, Some(0)));
    }
}
