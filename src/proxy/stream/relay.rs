//! Copying bytes both ways between a client and its target, with half-close, counts and an
//! idle timeout.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::snapshot::StreamStats;

/// How a connection that reached its upstream ended.
#[derive(Debug)]
pub(super) enum Ended {
    /// Both sides finished their writes.
    Closed,
    /// No byte moved either way for the service's idle timeout.
    IdleTimeout,
    /// Reading from or writing to the client failed (typically a reset).
    ClientFailed(io::Error),
    /// Reading from or writing to the target failed.
    UpstreamFailed(io::Error),
    /// Dropped by the gateway's shutdown after the grace period.
    Shutdown,
}

impl Ended {
    pub(super) fn code(&self) -> &'static str {
        match self {
            Ended::Closed => "closed",
            Ended::IdleTimeout => "idle_timeout",
            Ended::ClientFailed(_) => "client_error",
            Ended::UpstreamFailed(_) => "upstream_error",
            Ended::Shutdown => "shutdown",
        }
    }
}

/// Per direction and connection: large enough for loopback throughput, small enough for many
/// idle connections.
const COPY_BUFFER: usize = 16 * 1024;

#[derive(Debug, Clone, Copy)]
pub(super) enum Direction {
    ClientToUpstream,
    UpstreamToClient,
}

/// Bytes moved by one connection, and when a byte last moved either way.
pub(super) struct Progress {
    pub started: Instant,
    pub client_to_upstream: AtomicU64,
    pub upstream_to_client: AtomicU64,
    /// The route's statistics, once the connection has a route.
    pub route_stats: Option<Arc<StreamStats>>,
    /// Milliseconds after `started`.
    last_moved_ms: AtomicU64,
}

impl Progress {
    pub fn new() -> Progress {
        Progress {
            started: Instant::now(),
            client_to_upstream: AtomicU64::new(0),
            upstream_to_client: AtomicU64::new(0),
            route_stats: None,
            last_moved_ms: AtomicU64::new(0),
        }
    }

    fn moved(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last_moved_ms.store(now, Ordering::Relaxed);
    }

    fn count(&self, direction: Direction, bytes: u64) {
        match direction {
            Direction::ClientToUpstream => {
                self.client_to_upstream.fetch_add(bytes, Ordering::Relaxed);
                if let Some(stats) = &self.route_stats {
                    stats.moved_client_to_upstream(bytes);
                }
            }
            Direction::UpstreamToClient => {
                self.upstream_to_client.fetch_add(bytes, Ordering::Relaxed);
                if let Some(stats) = &self.route_stats {
                    stats.moved_upstream_to_client(bytes);
                }
            }
        }
    }

    /// Returns once no byte has moved either way for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = self.last_moved_ms.load(Ordering::Relaxed);
            let deadline = self.started + Duration::from_millis(last) + idle;
            tokio::time::sleep_until(deadline).await;
            if self.last_moved_ms.load(Ordering::Relaxed) == last {
                return;
            }
        }
    }
}

/// A failed direction of a relay, by the side whose socket failed.
enum RelayError {
    Client(io::Error),
    Upstream(io::Error),
}

/// Copies both ways until both directions have ended, one side fails, or nothing moves for
/// `idle`. `first` (a buffered ClientHello) goes upstream before anything else.
///
/// Not `tokio::io::copy_bidirectional`: it also shuts down the write half on EOF, but it reports
/// no byte counts when a side fails and has no idle timeout; the access log needs both.
pub(super) async fn relay(
    client: TcpStream,
    upstream: TcpStream,
    first: &[u8],
    idle: Duration,
    progress: &Progress,
) -> Ended {
    // The idle clock starts now, not at the accept: reading a ClientHello and connecting have
    // their own timeouts.
    progress.moved();
    let (client_read, client_write) = client.into_split();
    let (upstream_read, upstream_write) = upstream.into_split();
    let to_upstream = pump(
        client_read,
        upstream_write,
        first,
        Direction::ClientToUpstream,
        progress,
    );
    let to_client = pump(
        upstream_read,
        client_write,
        &[],
        Direction::UpstreamToClient,
        progress,
    );
    let both = async {
        tokio::try_join!(
            async {
                to_upstream.await.map_err(|side| match side {
                    Side::Reader(error) => RelayError::Client(error),
                    Side::Writer(error) => RelayError::Upstream(error),
                })
            },
            async {
                to_client.await.map_err(|side| match side {
                    Side::Reader(error) => RelayError::Upstream(error),
                    Side::Writer(error) => RelayError::Client(error),
                })
            },
        )
    };
    tokio::select! {
        result = both => match result {
            Ok(_) => Ended::Closed,
            Err(RelayError::Client(error)) => Ended::ClientFailed(error),
            Err(RelayError::Upstream(error)) => Ended::UpstreamFailed(error),
        },
        _ = progress.idle_for(idle) => Ended::IdleTimeout,
    }
}

/// Which end of a pump failed.
enum Side {
    Reader(io::Error),
    Writer(io::Error),
}

/// One direction: copies until the reader ends, then shuts down the writer (half-close), so the
/// peer sees EOF while the other direction keeps going.
async fn pump<R, W>(
    mut from: R,
    mut to: W,
    first: &[u8],
    direction: Direction,
    progress: &Progress,
) -> Result<(), Side>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if !first.is_empty() {
        to.write_all(first).await.map_err(Side::Writer)?;
        progress.count(direction, first.len() as u64);
        progress.moved();
    }
    let mut buffer = vec![0u8; COPY_BUFFER];
    loop {
        let read = from.read(&mut buffer).await.map_err(Side::Reader)?;
        if read == 0 {
            return to.shutdown().await.map_err(Side::Writer);
        }
        progress.moved();
        to.write_all(&buffer[..read]).await.map_err(Side::Writer)?;
        progress.count(direction, read as u64);
        progress.moved();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::stream::tests::socket_pair;

    #[tokio::test(start_paused = true)]
    async fn idle_waits_for_silence_since_the_last_byte() {
        let progress = Progress::new();
        let idle = Duration::from_secs(10);
        let watcher = progress.idle_for(idle);
        tokio::pin!(watcher);
        tokio::time::advance(Duration::from_secs(6)).await;
        progress.moved();
        // 10 s after the start, but only 4 s after the last byte.
        let early = tokio::time::timeout(Duration::from_secs(4), &mut watcher).await;
        assert!(early.is_err());
        let started = Instant::now();
        watcher.await;
        assert!(started.elapsed() >= Duration::from_secs(5));
    }

    #[tokio::test]
    async fn relay_half_closes_and_counts_both_ways() {
        let (mut client, client_side) = socket_pair().await;
        let (mut upstream, upstream_side) = socket_pair().await;
        let progress = Progress::new();
        let relay = relay(
            client_side,
            upstream_side,
            b"HELLO",
            Duration::from_secs(30),
            &progress,
        );
        let peers = async {
            client.write_all(b"request").await.unwrap();
            client.shutdown().await.unwrap();
            // The upstream sees the buffered bytes first, then the client's, then EOF...
            let mut received = Vec::new();
            upstream.read_to_end(&mut received).await.unwrap();
            assert_eq!(received, b"HELLOrequest");
            // ...and can still answer after it.
            upstream.write_all(b"late reply").await.unwrap();
            upstream.shutdown().await.unwrap();
            let mut reply = Vec::new();
            client.read_to_end(&mut reply).await.unwrap();
            assert_eq!(reply, b"late reply");
        };
        let (ended, ()) = tokio::join!(relay, peers);
        assert!(matches!(ended, Ended::Closed), "{ended:?}");
        assert_eq!(progress.client_to_upstream.load(Ordering::Relaxed), 12);
        assert_eq!(progress.upstream_to_client.load(Ordering::Relaxed), 10);
    }

    #[tokio::test]
    async fn relay_ends_an_idle_connection() {
        let (mut client, client_side) = socket_pair().await;
        let (_upstream, upstream_side) = socket_pair().await;
        let progress = Progress::new();
        let ended = relay(
            client_side,
            upstream_side,
            &[],
            Duration::from_millis(100),
            &progress,
        )
        .await;
        assert!(matches!(ended, Ended::IdleTimeout), "{ended:?}");
        // Both sockets were dropped: the client sees the end.
        let mut rest = Vec::new();
        // An end of stream or a reset, either way within the deadline and without bytes.
        let _ = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest))
            .await
            .expect("the client sees the close");
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn relay_reports_an_upstream_reset() {
        let (_client, client_side) = socket_pair().await;
        let (upstream, upstream_side) = socket_pair().await;
        // Linger 0: closing sends a reset instead of a FIN.
        upstream.set_zero_linger().unwrap();
        drop(upstream);
        let progress = Progress::new();
        let ended = relay(
            client_side,
            upstream_side,
            &[],
            Duration::from_secs(30),
            &progress,
        )
        .await;
        assert!(matches!(ended, Ended::UpstreamFailed(_)), "{ended:?}");
    }
}
