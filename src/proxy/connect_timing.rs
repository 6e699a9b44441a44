//! How long opening an upstream connection took, told to the attempt that opened it.

use std::time::Duration;

/// In the extensions of an upstream answer whose request opened the connection it came on
/// (absent on a reused connection, so a keep-alive request allocates nothing for it). For a
/// plain HTTP/1.1 target it is the TCP connect; for an HTTP/2 pool the whole dial: TCP, TLS for
/// an https target, and the HTTP/2 handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectTiming {
    pub connect: Duration,
}
