//! What the control-plane benches (`control_scale`, `control_resync`) share: the allocator
//! `raahi serve` runs with, the environment knobs, percentiles.

use std::str::FromStr;
use std::time::Duration;

/// The binary's allocator and options, so memory reads as it would in `raahi serve`.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[export_name = "_rjem_malloc_conf"]
static JEMALLOC_OPTIONS: JemallocOptions =
    JemallocOptions(c"background_thread:true,dirty_decay_ms:1000,muzzy_decay_ms:0".as_ptr());

#[repr(transparent)]
struct JemallocOptions(*const std::ffi::c_char);

// SAFETY: the pointer is to a static C string, never written.
unsafe impl Sync for JemallocOptions {}

/// The environment variable `name` parsed, else `default`; a value that does not parse stops
/// the bench.
pub fn knob<T: FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} does not parse")),
        Err(_) => default,
    }
}

/// The value below which `share` of the sorted durations fall (nearest rank).
pub fn percentile(sorted: &[Duration], share: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((share * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
