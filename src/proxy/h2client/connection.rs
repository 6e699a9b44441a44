//! One HTTP/2 connection to a target: made once by whichever request needs it first (the others
//! that chose it wait for the same dial), then driven by a task of its own that closes it when
//! it has been idle for the idle timeout, when the target stops answering PINGs while streams
//! wait, or when the target ends it.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::OnceCell;

use super::sniff::{Seen, Sniffed};
use super::{H2Settings, H2Target};
use crate::snapshot::ServiceCounters;

/// Stream flow-control windows: those of hyper's client, so one stream can carry a large gRPC
/// message at speed while the connection's window bounds what a slow reader makes us hold.
const STREAM_WINDOW: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW: u32 = 5 * 1024 * 1024;
/// The largest response header section taken from a target (as `proxy.max_header_bytes`).
const MAX_HEADER_LIST: u32 = 64 * 1024;

/// Why no connection could be made; shared by every request that waited for the dial.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DialError {
    #[error("TCP connect failed: {0}")]
    Connect(Arc<io::Error>),
    #[error("connecting took longer than {timeout_ms} ms")]
    Timeout { timeout_ms: u64 },
    /// The TLS handshake failed (the detail names the server name).
    #[error("TLS failed: {detail}")]
    Tls { detail: String },
    /// The target chose another protocol than HTTP/2 by ALPN: nothing was sent.
    #[error("the target did not choose h2 by ALPN")]
    NotH2,
    #[error("the HTTP/2 handshake failed: {0}")]
    Handshake(String),
}

pub trait Transport: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Transport for T {}

pub type DialFuture = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<Box<dyn Transport>, DialError>> + Send>,
>;

/// How a target's connections are made: plain TCP (`h2c`), or TLS that chose `h2` by ALPN.
pub trait Dial: Send + Sync + 'static {
    /// Within the connect timeout.
    fn dial(&self) -> DialFuture;
}

/// TCP with prior knowledge.
pub struct TcpDial {
    pub address: String,
    pub timeout: Duration,
}

impl Dial for TcpDial {
    fn dial(&self) -> DialFuture {
        let address = self.address.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let timeout_ms = timeout.as_millis() as u64;
            let stream =
                match tokio::time::timeout(timeout, TcpStream::connect(address.as_str())).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(error)) => return Err(DialError::Connect(Arc::new(error))),
                    Err(_) => return Err(DialError::Timeout { timeout_ms }),
                };
            // Small frames (headers, window updates, gRPC messages) must not wait for Nagle.
            let _ = stream.set_nodelay(true);
            Ok(Box::new(stream) as Box<dyn Transport>)
        })
    }
}

#[derive(Debug)]
pub struct H2Connection {
    pub(super) seen: Arc<Seen>,
    /// Streams reserved on it: chosen by a request and not yet finished.
    open: AtomicUsize,
    /// Closed, or closing: it takes no new stream.
    closed: AtomicBool,
    /// When its last stream finished, in `seen`'s milliseconds.
    idle_since_ms: AtomicU64,
    /// The keep-alive PING went unanswered.
    pub(super) ping_failed: AtomicBool,
    sender: OnceCell<Result<SendRequest<Bytes>, DialError>>,
}

impl H2Connection {
    pub(super) fn new() -> H2Connection {
        H2Connection {
            seen: Arc::new(Seen::new()),
            open: AtomicUsize::new(0),
            closed: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            ping_failed: AtomicBool::new(false),
            sender: OnceCell::new(),
        }
    }

    /// Takes no new streams: closed, or the target sent GOAWAY.
    pub(super) fn retired(&self) -> bool {
        self.closed.load(Ordering::Acquire) || self.seen.going_away()
    }

    pub(super) fn open_streams(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// How many streams it may carry: ours, and the target's `SETTINGS_MAX_CONCURRENT_STREAMS`
    /// once it came; until then what the target's other connections were told (`learned`), so
    /// a new connection does not open streams the target would refuse.
    pub(super) fn capacity(&self, ours: usize, learned: usize) -> usize {
        match self.seen.max_concurrent_streams() {
            Some(theirs) => ours.min(theirs as usize),
            None => ours.min(learned),
        }
    }

    /// Counts one more stream; the caller holds the pool's lock, so the count it read is still
    /// the count.
    pub(super) fn reserve(self: &Arc<Self>, counters: &Arc<ServiceCounters>) -> StreamSlot {
        self.open.fetch_add(1, Ordering::AcqRel);
        counters.h2_streams.fetch_add(1, Ordering::Relaxed);
        StreamSlot {
            connection: self.clone(),
            counters: counters.clone(),
        }
    }

    /// The connection's sender, dialling it on first need.
    pub(super) async fn sender(
        self: &Arc<Self>,
        target: &Arc<H2Target>,
    ) -> Result<SendRequest<Bytes>, DialError> {
        let dialled = self
            .sender
            .get_or_init(|| dial(self.clone(), target.clone()))
            .await;
        if dialled.is_err() {
            self.closed.store(true, Ordering::Release);
            target.forget(self);
        }
        dialled.clone()
    }

    fn idle_for_ms(&self) -> Option<u64> {
        (self.open.load(Ordering::Acquire) == 0).then(|| {
            self.seen
                .now_ms()
                .saturating_sub(self.idle_since_ms.load(Ordering::Acquire))
        })
    }
}

/// A request's place on a connection, given back when its exchange ends (the response body is
/// done or dropped, or the attempt failed).
#[derive(Debug)]
pub struct StreamSlot {
    connection: Arc<H2Connection>,
    counters: Arc<ServiceCounters>,
}

impl StreamSlot {
    pub(super) fn connection(&self) -> &Arc<H2Connection> {
        &self.connection
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let connection = &self.connection;
        self.counters.h2_streams.fetch_sub(1, Ordering::Relaxed);
        if connection.open.fetch_sub(1, Ordering::AcqRel) == 1 {
            connection
                .idle_since_ms
                .store(connection.seen.now_ms(), Ordering::Release);
        }
    }
}

async fn dial(
    connection: Arc<H2Connection>,
    target: Arc<H2Target>,
) -> Result<SendRequest<Bytes>, DialError> {
    let settings = &target.settings;
    let timeout_ms = settings.connect_timeout.as_millis() as u64;
    let stream = target.dial.dial().await?;
    let transport = Sniffed::new(stream, connection.seen.clone());
    let handshake = h2::client::Builder::new()
        .initial_max_send_streams(target.learned_max_streams())
        .initial_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_header_list_size(MAX_HEADER_LIST)
        .max_concurrent_streams(0)
        .enable_push(false)
        .handshake::<_, Bytes>(transport);
    let (sender, mut driver) = match tokio::time::timeout(settings.connect_timeout, handshake).await
    {
        Ok(Ok(pair)) => pair,
        Ok(Err(error)) => return Err(DialError::Handshake(error.to_string())),
        Err(_) => return Err(DialError::Timeout { timeout_ms }),
    };
    let ping = driver.ping_pong();
    target
        .counters
        .h2_connections
        .fetch_add(1, Ordering::Relaxed);
    connection
        .idle_since_ms
        .store(connection.seen.now_ms(), Ordering::Release);
    tokio::spawn(drive(
        driver,
        ping,
        connection,
        Arc::downgrade(&target),
        target.settings.clone(),
        target.counters.clone(),
    ));
    Ok(sender)
}

/// Polls the connection until it ends, closing it when idle or when PINGs go unanswered.
async fn drive<T: Transport>(
    driver: h2::client::Connection<T, Bytes>,
    mut ping: Option<h2::PingPong>,
    connection: Arc<H2Connection>,
    pool: Weak<H2Target>,
    settings: H2Settings,
    counters: Arc<ServiceCounters>,
) {
    tokio::pin!(driver);
    loop {
        let wait = next_look(&connection, &settings);
        tokio::select! {
            ended = &mut driver => {
                if let Err(error) = ended {
                    tracing::debug!(%error, "upstream HTTP/2 connection ended");
                }
                break;
            }
            () = tokio::time::sleep(wait) => {}
        }
        if let Some(idle_ms) = connection.idle_for_ms() {
            if idle_ms >= settings.idle_timeout.as_millis() as u64
                && close_if_idle(&connection, &pool)
            {
                break;
            }
            continue;
        }
        let Some(keepalive) = settings.keepalive else {
            continue;
        };
        if connection.seen.silent_for_ms() < keepalive.as_millis() as u64 {
            continue;
        }
        let Some(pinger) = ping.as_mut() else {
            continue;
        };
        let answered = tokio::select! {
            ended = &mut driver => {
                if let Err(error) = ended {
                    tracing::debug!(%error, "upstream HTTP/2 connection ended");
                }
                break;
            }
            pong = tokio::time::timeout(settings.connect_timeout, pinger.ping(h2::Ping::opaque())) => {
                matches!(pong, Ok(Ok(_)))
            }
        };
        if !answered {
            tracing::warn!(
                silent_ms = connection.seen.silent_for_ms(),
                "upstream HTTP/2 connection failed: no PING answer while streams waited"
            );
            connection.ping_failed.store(true, Ordering::Release);
            break;
        }
    }
    connection.closed.store(true, Ordering::Release);
    if let Some(pool) = pool.upgrade() {
        pool.forget(&connection);
    }
    counters.h2_connections.fetch_sub(1, Ordering::Relaxed);
}

/// When to look again: at the end of the idle time, or when the keep-alive silence runs out.
fn next_look(connection: &H2Connection, settings: &H2Settings) -> Duration {
    if let Some(idle_ms) = connection.idle_for_ms() {
        let left = (settings.idle_timeout.as_millis() as u64).saturating_sub(idle_ms);
        return Duration::from_millis(left.max(1));
    }
    match settings.keepalive {
        Some(keepalive) => {
            let silent = connection.seen.silent_for_ms();
            let left = (keepalive.as_millis() as u64).saturating_sub(silent);
            Duration::from_millis(left.max(1))
        }
        // Streams open, no keep-alive: look again when they may have finished.
        None => settings.idle_timeout.min(Duration::from_secs(1)),
    }
}

/// Takes an idle connection out of the pool, unless a request chose it meanwhile (which the
/// pool's lock rules out once it is gone from the list).
fn close_if_idle(connection: &Arc<H2Connection>, pool: &Weak<H2Target>) -> bool {
    let Some(pool) = pool.upgrade() else {
        return true;
    };
    pool.retire_if_idle(connection)
}

pub(super) fn mark_closed(connection: &H2Connection) {
    connection.closed.store(true, Ordering::Release);
}
