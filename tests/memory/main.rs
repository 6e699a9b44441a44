//! The tests that measure this process's resident memory (RSS) while a gigabyte moves through
//! the gateway. RSS is process-wide, so another test running in the same process would pollute
//! the measurement: these tests are a test binary of their own, apart from `tests/integration/`,
//! and each holds [`ALONE`] for its whole run, so they never overlap even when the harness runs
//! tests on several threads. `scripts/test.sh` runs this binary by itself after the others:
//! `cargo test --test memory -- --test-threads=1`.

// Real time, as in the integration suite: the clock rule in clippy.toml is for `src/`.
#![allow(clippy::disallowed_methods)]

#[path = "../common/mod.rs"]
mod common;

mod events;
mod hashing;
mod proxy;
mod rate_limit;
mod stream_routes;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::rss_kib;

/// Held by each memory-measured test for its whole run: one at a time, whatever the number of
/// test threads.
pub static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Samples this process's resident memory until finished; reports the largest sample.
pub struct RssPeak {
    peak: Arc<AtomicU64>,
    sampler: tokio::task::JoinHandle<()>,
}

impl RssPeak {
    pub fn start() -> RssPeak {
        let peak = Arc::new(AtomicU64::new(rss_kib()));
        let shared = peak.clone();
        let sampler = tokio::spawn(async move {
            loop {
                shared.fetch_max(rss_kib(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        RssPeak { peak, sampler }
    }

    pub fn sample(&self) {
        self.peak.fetch_max(rss_kib(), Ordering::SeqCst);
    }

    pub fn finish(self) -> u64 {
        self.sampler.abort();
        self.sample();
        self.peak.load(Ordering::SeqCst)
    }
}
