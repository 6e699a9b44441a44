//! Idle keep-alive connections to one target, whatever protocol they speak.
//!
//! A request takes the most recently used idle connection (its caller dials a new one when
//! there is none) and whoever finishes the exchange hands the connection back; a connection
//! cut short is simply not handed back. The pool is one target's, so its lock is shared only
//! by that target's requests and is held for a push or a pop. Idle connections close after
//! `idle_timeout`. The pool knows nothing of the connections but [`Pooled`]: the HTTP/1.1
//! codec and this pool never name each other (`plain_target.rs` joins them).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::time::Instant;

/// What the pool needs to know of a connection.
pub trait Pooled: Send + 'static {
    /// Whether it can carry another request: the peer has neither closed it nor sent anything
    /// unasked.
    fn is_reusable(&self) -> bool;

    /// Before idling: give back memory a large exchange made it grow.
    fn rest(&mut self) {}
}

struct Idle<C> {
    connection: C,
    since: Instant,
}

pub struct TargetPool<C> {
    idle_timeout: Duration,
    idle: Mutex<Vec<Idle<C>>>,
    reaper_running: AtomicBool,
}

impl<C: Pooled> TargetPool<C> {
    pub fn new(idle_timeout: Duration) -> Self {
        TargetPool {
            idle_timeout,
            idle: Mutex::new(Vec::new()),
            reaper_running: AtomicBool::new(false),
        }
    }

    pub fn idle_timeout(&self) -> Duration {
        self.idle_timeout
    }

    /// The most recently used idle connection that is still usable; the others met on the way
    /// (past their idle time, or closed by the peer) are dropped.
    pub fn take_idle(&self) -> Option<C> {
        let mut idle = self.lock();
        while let Some(candidate) = idle.pop() {
            if candidate.since.elapsed() < self.idle_timeout && candidate.connection.is_reusable() {
                return Some(candidate.connection);
            }
        }
        None
    }

    /// Takes back a connection whose exchange ended cleanly.
    pub fn put_back(self: &Arc<Self>, mut connection: C) {
        connection.rest();
        self.lock().push(Idle {
            connection,
            since: Instant::now(),
        });
        if !self.reaper_running.swap(true, Ordering::AcqRel) {
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => drop(runtime.spawn(reap(Arc::downgrade(self)))),
                // The runtime is going away, and the pool with it.
                Err(_) => self.reaper_running.store(false, Ordering::Release),
            }
        }
    }

    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle<C>>> {
        self.idle
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Drops idle connections past the idle timeout or closed by the peer; true when none is
    /// left (the reaper then stops, and the next one put back starts it again).
    fn prune(&self) -> bool {
        let mut idle = self.lock();
        let idle_timeout = self.idle_timeout;
        idle.retain(|entry| entry.since.elapsed() < idle_timeout && entry.connection.is_reusable());
        if idle.is_empty() {
            self.reaper_running.store(false, Ordering::Release);
            return true;
        }
        false
    }
}

/// Closes a pool's idle connections as they pass the idle timeout, until none is left or the
/// pool is gone.
async fn reap<C: Pooled>(pool: Weak<TargetPool<C>>) {
    loop {
        let Some(period) = pool.upgrade().map(|pool| reap_period(pool.idle_timeout)) else {
            return;
        };
        tokio::time::sleep(period).await;
        match pool.upgrade() {
            Some(pool) if !pool.prune() => {}
            _ => return,
        }
    }
}

/// A connection may outlive its idle timeout by at most a quarter of it (and one second).
fn reap_period(idle_timeout: Duration) -> Duration {
    (idle_timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A connection whose peer "closes" it when told to, counting the times it was rested.
    struct FakeConnection {
        id: usize,
        closed: Arc<AtomicBool>,
        rested: Arc<AtomicUsize>,
    }

    impl Pooled for FakeConnection {
        fn is_reusable(&self) -> bool {
            !self.closed.load(Ordering::SeqCst)
        }

        fn rest(&mut self) {
            self.rested.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn connection(id: usize) -> (FakeConnection, Arc<AtomicBool>) {
        let closed = Arc::new(AtomicBool::new(false));
        let connection = FakeConnection {
            id,
            closed: closed.clone(),
            rested: Arc::new(AtomicUsize::new(0)),
        };
        (connection, closed)
    }

    #[tokio::test]
    async fn the_most_recently_used_connection_goes_first_and_is_rested() {
        let pool = Arc::new(TargetPool::new(Duration::from_secs(60)));
        let (first, _) = connection(1);
        let (second, _) = connection(2);
        let rested = second.rested.clone();
        pool.put_back(first);
        pool.put_back(second);
        assert_eq!(rested.load(Ordering::SeqCst), 1, "rested before idling");
        assert_eq!(pool.take_idle().map(|c| c.id), Some(2));
        assert_eq!(pool.take_idle().map(|c| c.id), Some(1));
        assert!(pool.take_idle().is_none());
    }

    #[tokio::test]
    async fn a_connection_the_peer_closed_is_passed_over() {
        let pool = Arc::new(TargetPool::new(Duration::from_secs(60)));
        let (open, _) = connection(1);
        let (closing, closed) = connection(2);
        pool.put_back(open);
        pool.put_back(closing);
        closed.store(true, Ordering::SeqCst);
        assert_eq!(pool.take_idle().map(|c| c.id), Some(1));
        assert_eq!(
            pool.idle_count(),
            0,
            "the closed one was dropped on the way"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn idle_connections_close_after_the_idle_timeout_and_the_reaper_stops() {
        let pool = Arc::new(TargetPool::new(Duration::from_millis(400)));
        let (idle, _) = connection(1);
        pool.put_back(idle);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(pool.idle_count(), 1, "within its idle time");
        // The reaper looks every quarter of the idle timeout.
        tokio::time::sleep(Duration::from_millis(250)).await;
        assert_eq!(pool.idle_count(), 0, "closed past its idle time");
        tokio::task::yield_now().await;
        assert!(
            !pool.reaper_running.load(Ordering::Acquire),
            "the reaper stops when the pool is empty"
        );
        let (next, _) = connection(2);
        pool.put_back(next);
        assert!(
            pool.reaper_running.load(Ordering::Acquire),
            "and starts again"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_past_its_time_is_not_handed_out() {
        let pool = Arc::new(TargetPool::new(Duration::from_secs(10)));
        let (idle, _) = connection(1);
        pool.put_back(idle);
        // Past the idle time, before the reaper's next look could matter: `take_idle` judges.
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(pool.take_idle().is_none());
    }

    #[test]
    fn reap_period_is_a_quarter_of_the_idle_timeout_within_bounds() {
        assert_eq!(reap_period(Duration::from_secs(60)), Duration::from_secs(1));
        assert_eq!(
            reap_period(Duration::from_millis(400)),
            Duration::from_millis(100)
        );
        assert_eq!(
            reap_period(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
    }
}
