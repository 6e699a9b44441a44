//! The memory event-stream clients may hold together: bytes handed to a client's connection
//! and not yet written to its socket. hyper keeps a frame until its last byte went out, so a
//! client that stops reading holds what it was handed (its socket buffers full) until its
//! connection closes. Each frame handed out is counted against `admin.event_stream_budget_bytes`
//! until hyper drops it; a client whose next frame would pass the budget is cut off, as one
//! that falls too far behind is. Frames are shared, so this counts a frame once per client
//! holding it: an upper bound on what the clients keep alive.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;

#[derive(Debug)]
pub struct EventBudget {
    limit: u64,
    held: AtomicU64,
}

impl EventBudget {
    pub fn new(limit: u64) -> Arc<EventBudget> {
        Arc::new(EventBudget {
            limit,
            held: AtomicU64::new(0),
        })
    }

    /// Bytes handed to clients and not yet written, all clients together.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// `frame` as a client's to send (the same bytes, not a copy), counted until the connection
    /// drops it; None when it would pass the budget. A frame larger than the whole budget still
    /// goes out while nothing else is held, so a large snapshot is slow to get, never refused.
    pub fn charge(self: &Arc<Self>, frame: Bytes) -> Option<Bytes> {
        let size = frame.len() as u64;
        let mut held = self.held.load(Ordering::Relaxed);
        loop {
            if held > 0 && held.saturating_add(size) > self.limit {
                return None;
            }
            match self.held.compare_exchange_weak(
                held,
                held + size,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => break,
                Err(now) => held = now,
            }
        }
        Some(Bytes::from_owner(Charged {
            frame,
            budget: self.clone(),
        }))
    }
}

/// A frame in a client's hands; its drop gives its size back.
struct Charged {
    frame: Bytes,
    budget: Arc<EventBudget>,
}

impl AsRef<[u8]> for Charged {
    fn as_ref(&self) -> &[u8] {
        &self.frame
    }
}

impl Drop for Charged {
    fn drop(&mut self) {
        self.budget
            .held
            .fetch_sub(self.frame.len() as u64, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_held_until_its_last_handle_goes() {
        let budget = EventBudget::new(100);
        let shared = Bytes::from(vec![7u8; 60]);
        let handed = budget.charge(shared.clone()).unwrap();
        assert_eq!(handed, shared, "the same bytes");
        assert_eq!(budget.held(), 60);
        // A connection writes part of it: the rest still holds the whole frame.
        let mut rest = handed.clone();
        drop(handed);
        bytes::Buf::advance(&mut rest, 50);
        assert_eq!(budget.held(), 60);
        drop(rest);
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn a_frame_that_would_pass_the_budget_is_refused() {
        let budget = EventBudget::new(100);
        let first = budget.charge(Bytes::from(vec![0u8; 60])).unwrap();
        assert!(budget.charge(Bytes::from(vec![0u8; 41])).is_none());
        let second = budget.charge(Bytes::from(vec![0u8; 40])).unwrap();
        assert_eq!(budget.held(), 100);
        drop((first, second));
        assert_eq!(budget.held(), 0);
    }

    #[test]
    fn a_frame_larger_than_the_budget_goes_out_alone() {
        let budget = EventBudget::new(100);
        let large = budget.charge(Bytes::from(vec![0u8; 500])).unwrap();
        assert_eq!(budget.held(), 500);
        assert!(budget.charge(Bytes::from(vec![0u8; 1])).is_none());
        drop(large);
        assert!(budget.charge(Bytes::from(vec![0u8; 500])).is_some());
    }
}
