//! Shared budgets for what request bodies held before a target is picked may take together:
//! memory (`proxy.request_buffer_budget_bytes`) and spool disk
//! (`proxy.request_spool_budget_bytes`). Each is charged with what is really allocated or
//! written, not with what a client says it will send.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::snapshot::GatewayCounters;

/// A limit on bytes held together, whose use is one of the gateway's counters (so `/metrics`
/// shows it without a second count to keep in step).
pub struct Budget {
    limit: u64,
    counters: Arc<GatewayCounters>,
    used: fn(&GatewayCounters) -> &AtomicU64,
}

impl std::fmt::Debug for Budget {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Budget")
            .field("limit", &self.limit)
            .field("used", &self.used())
            .finish()
    }
}

impl Budget {
    /// A budget of `limit` bytes whose use is kept in the counter `used` picks.
    pub fn new(
        limit: u64,
        counters: Arc<GatewayCounters>,
        used: fn(&GatewayCounters) -> &AtomicU64,
    ) -> Arc<Budget> {
        Arc::new(Budget {
            limit,
            counters,
            used,
        })
    }

    /// A budget of its own, counted nowhere else.
    #[cfg(test)]
    pub fn standalone(limit: u64) -> Arc<Budget> {
        Budget::new(limit, Arc::default(), |counters| {
            &counters.request_body_memory_bytes
        })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn counter(&self) -> &AtomicU64 {
        (self.used)(&self.counters)
    }

    /// Bytes held now, by every reservation together.
    pub fn used(&self) -> u64 {
        self.counter().load(Ordering::Relaxed)
    }

    /// Takes `bytes` more for `reservation`, if the budget has them.
    pub fn grow(&self, reservation: &mut Reservation, bytes: u64) -> bool {
        let counter = self.counter();
        let before = counter.fetch_add(bytes, Ordering::Relaxed);
        if before.saturating_add(bytes) > self.limit {
            counter.fetch_sub(bytes, Ordering::Relaxed);
            return false;
        }
        reservation.bytes += bytes;
        true
    }
}

/// One body's share of a [`Budget`], given back when the body is gone.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Reservation {
    pub fn new(budget: &Arc<Budget>) -> Reservation {
        Reservation {
            budget: budget.clone(),
            bytes: 0,
        }
    }

    pub fn budget(&self) -> &Arc<Budget> {
        &self.budget
    }

    /// Bytes this reservation holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Gives back all but `keep` bytes (a buffer that shrank).
    pub fn shrink_to(&mut self, keep: u64) {
        if keep < self.bytes {
            self.budget
                .counter()
                .fetch_sub(self.bytes - keep, Ordering::Relaxed);
            self.bytes = keep;
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget
            .counter()
            .fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_grants_up_to_its_limit_and_takes_back_what_is_dropped() {
        let budget = Budget::standalone(100);
        let mut first = Reservation::new(&budget);
        assert!(budget.grow(&mut first, 60));
        let mut second = Reservation::new(&budget);
        assert!(!budget.grow(&mut second, 41), "past the limit");
        assert_eq!(budget.used(), 60, "a refused grant takes nothing");
        assert!(budget.grow(&mut second, 40));
        assert_eq!(budget.used(), 100);
        second.shrink_to(10);
        assert_eq!((second.bytes(), budget.used()), (10, 70));
        drop(first);
        assert_eq!(budget.used(), 10);
        drop(second);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn the_use_is_the_gateway_counter() {
        let counters = Arc::new(GatewayCounters::default());
        let budget = Budget::new(1 << 20, counters.clone(), |counters| {
            &counters.request_spool_bytes
        });
        let mut reservation = Reservation::new(&budget);
        assert!(budget.grow(&mut reservation, 4096));
        assert_eq!(counters.request_spool_bytes.load(Ordering::Relaxed), 4096);
        assert_eq!(
            counters.request_body_memory_bytes.load(Ordering::Relaxed),
            0
        );
        drop(reservation);
        assert_eq!(counters.request_spool_bytes.load(Ordering::Relaxed), 0);
    }
}
