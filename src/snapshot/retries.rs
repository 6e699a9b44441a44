//! A service's retry budget on this gateway and what its retries were for (TRAFFIC.md §5):
//! requests and retries counted in ten one-second buckets of atomics, so the request path
//! counts a request with one add and a retry asks the window without a lock.

use std::sync::atomic::{AtomicU64, Ordering};
use tokio::time::Instant;

use crate::model::RetryBudget;

/// Why a retry (or a hedge's failed twin) was sent, as `raahi_retries_total{reason}` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryReason {
    ConnectFailure,
    Refused,
    Reset,
    PerTryTimeout,
    /// An HTTP status the policy retries.
    Status,
    /// A gRPC status in a trailers-only answer the policy retries.
    GrpcStatus,
}

impl RetryReason {
    pub const ALL: [RetryReason; 6] = [
        RetryReason::ConnectFailure,
        RetryReason::Refused,
        RetryReason::Reset,
        RetryReason::PerTryTimeout,
        RetryReason::Status,
        RetryReason::GrpcStatus,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RetryReason::ConnectFailure => "connect_failure",
            RetryReason::Refused => "refused",
            RetryReason::Reset => "reset",
            RetryReason::PerTryTimeout => "per_try_timeout",
            RetryReason::Status => "status",
            RetryReason::GrpcStatus => "grpc_status",
        }
    }
}

/// Buckets of the sliding window, one per second.
const WINDOW_SECONDS: u64 = 10;
/// A bucket's cell holds its second in the high bits and its count in the low ones, so one
/// compare-and-swap moves it to a new second and one add counts.
const COUNT_BITS: u32 = 32;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

/// One second's requests and retries (hedges included).
#[derive(Debug, Default)]
struct Bucket {
    requests: AtomicU64,
    retries: AtomicU64,
}

/// A service's retry counts on this gateway, carried across snapshots with its counters.
#[derive(Debug)]
pub struct RetryCounters {
    origin: Instant,
    buckets: [Bucket; WINDOW_SECONDS as usize],
    /// Retries sent, by [`RetryReason`].
    pub sent: [AtomicU64; RetryReason::ALL.len()],
    /// Retries and hedges the budget refused: the failure went to the client as it was.
    pub budget_exhausted: AtomicU64,
    /// Hedged attempts sent (each also spends the budget).
    pub hedges: AtomicU64,
}

impl Default for RetryCounters {
    fn default() -> Self {
        RetryCounters {
            origin: Instant::now(),
            buckets: Default::default(),
            sent: Default::default(),
            budget_exhausted: AtomicU64::new(0),
            hedges: AtomicU64::new(0),
        }
    }
}

/// What the window holds now, for views and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowTotals {
    pub requests: u64,
    pub retries: u64,
}

impl RetryCounters {
    /// Counts one client request sent to the service at `now`.
    pub fn request(&self, now: Instant) {
        let second = self.second(now);
        add(&self.bucket(second).requests, second);
    }

    /// Takes one retry (or hedge) from the budget at `now`, when the window still allows it;
    /// a refusal is counted in `budget_exhausted`.
    pub fn try_spend(&self, now: Instant, budget: &RetryBudget) -> bool {
        let second = self.second(now);
        let totals = self.totals_at(second);
        let allowed = budget.percent * totals.requests as f64 / 100.0
            + f64::from(budget.min_per_second) * WINDOW_SECONDS as f64;
        if (totals.retries + 1) as f64 > allowed {
            self.budget_exhausted.fetch_add(1, Ordering::Relaxed);
            return false;
        }
        add(&self.bucket(second).retries, second);
        true
    }

    /// Counts a retry sent for `reason`.
    pub fn sent(&self, reason: RetryReason) {
        self.sent[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests and retries in the window ending at `now`.
    pub fn totals(&self, now: Instant) -> WindowTotals {
        self.totals_at(self.second(now))
    }

    fn totals_at(&self, second: u64) -> WindowTotals {
        let mut totals = WindowTotals {
            requests: 0,
            retries: 0,
        };
        for bucket in &self.buckets {
            totals.requests += count_within(&bucket.requests, second);
            totals.retries += count_within(&bucket.retries, second);
        }
        totals
    }

    /// Seconds since the counters began, in the cell's 32 bits (136 years).
    fn second(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.origin)
            .as_secs()
            .min(u64::MAX >> COUNT_BITS)
    }

    fn bucket(&self, second: u64) -> &Bucket {
        &self.buckets[(second % WINDOW_SECONDS) as usize]
    }
}

/// Adds one to `cell` for `second`, starting the bucket over when it still counts an older
/// second.
fn add(cell: &AtomicU64, second: u64) {
    let mut current = cell.load(Ordering::Relaxed);
    loop {
        if current >> COUNT_BITS == second {
            // A bucket that another thread moves on meanwhile takes this one with it: one
            // count in ten seconds' worth, off by a second.
            cell.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if current >> COUNT_BITS > second {
            // Moved on by a thread that read the clock later: this count belongs to a second
            // already out of the window.
            return;
        }
        match cell.compare_exchange_weak(
            current,
            (second << COUNT_BITS) | 1,
            Ordering::Relaxed,
            Ordering::Relaxed,
        ) {
            Ok(_) => return,
            Err(actual) => current = actual,
        }
    }
}

/// The count of `cell` when its second lies within the window ending at `second`.
fn count_within(cell: &AtomicU64, second: u64) -> u64 {
    let value = cell.load(Ordering::Relaxed);
    let counted = value >> COUNT_BITS;
    if counted <= second && second - counted < WINDOW_SECONDS {
        value & COUNT_MASK
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn budget(percent: f64, min_per_second: u32) -> RetryBudget {
        RetryBudget {
            percent,
            min_per_second,
        }
    }

    fn spend_all(counters: &RetryCounters, budget: &RetryBudget) -> u64 {
        let mut spent = 0;
        while counters.try_spend(Instant::now(), budget) {
            spent += 1;
            assert!(spent < 1_000_000, "the budget never ran out");
        }
        spent
    }

    #[tokio::test(start_paused = true)]
    async fn the_floor_allows_min_per_second_times_the_window() {
        let counters = RetryCounters::default();
        assert_eq!(spend_all(&counters, &budget(20.0, 10)), 100);
        assert_eq!(counters.budget_exhausted.load(Ordering::Relaxed), 1);
        assert!(!counters.try_spend(Instant::now(), &budget(20.0, 10)));
    }

    #[tokio::test(start_paused = true)]
    async fn retries_follow_a_percent_of_the_requests() {
        let counters = RetryCounters::default();
        for _ in 0..1_000 {
            counters.request(Instant::now());
        }
        // 20 % of 1,000, and nothing more with no floor.
        assert_eq!(spend_all(&counters, &budget(20.0, 0)), 200);
        // A bigger share of the same requests allows the difference.
        assert_eq!(spend_all(&counters, &budget(25.0, 0)), 50);
        assert_eq!(
            counters.totals(Instant::now()),
            WindowTotals {
                requests: 1_000,
                retries: 250
            }
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_budget_allows_nothing() {
        let counters = RetryCounters::default();
        counters.request(Instant::now());
        assert_eq!(spend_all(&counters, &budget(0.0, 0)), 0);
        assert_eq!(spend_all(&counters, &budget(100.0, 0)), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_slides_a_second_at_a_time() {
        let counters = RetryCounters::default();
        let none = budget(0.0, 1);
        // Ten retries a window: one spent in each of the first ten seconds.
        for second in 0..10 {
            assert!(counters.try_spend(Instant::now(), &none), "second {second}");
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        // Second 10: second 0's retry left the window, so one more fits, and no second.
        assert!(counters.try_spend(Instant::now(), &none));
        assert!(!counters.try_spend(Instant::now(), &none));
        // Just before second 11 nothing more left the window.
        tokio::time::advance(Duration::from_millis(999)).await;
        assert!(!counters.try_spend(Instant::now(), &none));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(counters.try_spend(Instant::now(), &none));
    }

    #[tokio::test(start_paused = true)]
    async fn requests_older_than_the_window_allow_nothing() {
        let counters = RetryCounters::default();
        for _ in 0..100 {
            counters.request(Instant::now());
        }
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(counters.totals(Instant::now()).requests, 100);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(counters.totals(Instant::now()).requests, 0);
        assert_eq!(spend_all(&counters, &budget(50.0, 0)), 0);
        // A bucket reused for a new second counts from one again.
        counters.request(Instant::now());
        assert_eq!(counters.totals(Instant::now()).requests, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_count_for_a_second_already_passed_is_dropped() {
        let counters = RetryCounters::default();
        let early = Instant::now();
        tokio::time::advance(Duration::from_secs(10)).await;
        counters.request(Instant::now());
        // Same bucket, ten seconds older: it must not add to the newer second's count.
        counters.request(early);
        assert_eq!(counters.totals(Instant::now()).requests, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn the_window_keeps_counting_after_half_a_year() {
        let counters = RetryCounters::default();
        // Past 2^24 seconds (194 days), where a narrower second would have wrapped.
        tokio::time::advance(Duration::from_secs((1 << 24) + 5)).await;
        counters.request(Instant::now());
        assert_eq!(counters.totals(Instant::now()).requests, 1);
        assert_eq!(spend_all(&counters, &budget(0.0, 1)), 10);
        tokio::time::advance(Duration::from_secs(400 * 86_400)).await;
        assert_eq!(spend_all(&counters, &budget(0.0, 1)), 10);
    }

    #[test]
    fn reasons_are_indexed_in_order() {
        for (index, reason) in RetryReason::ALL.iter().enumerate() {
            assert_eq!(*reason as usize, index);
        }
    }
}
