//! How long opening an upstream connection took, told to the attempt that opened it.

use std::time::Duration;

/// How long opening the connection took, for the attempt that opened it (absent on a reused
/// connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectTiming {
    pub connect: Duration,
    pub tls: Option<Duration>,
}
