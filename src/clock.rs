//! The one home for reading the wall clock. Every module reads "now" here, so a test can find
//! every place time enters, and clippy (`clippy.toml`) refuses `SystemTime::now` and
//! `Utc::now` anywhere else. Durations and deadlines use `tokio::time::Instant`, which tests
//! can pause; this is for times shown to operators and shared through atomics.

use std::time::{SystemTime, UNIX_EPOCH};

use chrono::{DateTime, Utc};

/// The current time, for timestamps operators read.
#[allow(clippy::disallowed_methods)]
pub fn now() -> DateTime<Utc> {
    Utc::now()
}

/// Wall-clock milliseconds since the Unix epoch: cheap to read and to keep in an atomic, so
/// ejection deadlines and activity times can be shared with the request path and shown as
/// times. 0 if the clock is before 1970.
#[allow(clippy::disallowed_methods)]
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_millis() as u64)
        .unwrap_or(0)
}

/// Wall-clock microseconds since the Unix epoch (0 if before 1970).
#[allow(clippy::disallowed_methods)]
pub fn unix_micros() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_micros() as u64)
        .unwrap_or(0)
}

/// Wall-clock nanoseconds since the Unix epoch (0 if before 1970), as OTLP spans carry times.
#[allow(clippy::disallowed_methods)]
pub fn unix_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| elapsed.as_nanos() as u64)
        .unwrap_or(0)
}
