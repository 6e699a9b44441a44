//! The admin listener: accepts connections up to `admin.max_connections` and serves the API on
//! each with hyper, held to the proxy's client timeouts so that idle or half-sent connections
//! cannot pile up (each costs its buffers, tens of KiB):
//!
//! - a connection that sends nothing, or an HTTP/1.1 request head that does not arrive whole,
//!   closes after the header timeout; so does an HTTP/1.1 keep-alive connection idle (no request
//!   in flight) for that long (hyper's header timer, which restarts when a response is done);
//! - an HTTP/2 connection with no stream open or started for the HTTP/2 idle timeout gets
//!   GOAWAY and is closed at most a second later;
//! - a connection answering a request (an event stream, a slow handler) is never idle;
//! - writes that stall are cut off by [`StallGuard`].
//!
//! On shutdown the listener stops accepting, idle connections close, HTTP/2 gets GOAWAY, and
//! requests in flight finish (event streams end by themselves then), within the shutdown grace.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use bytes::Bytes;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower::Service;

use super::stall::{StallGuard, WRITE_STALL_LIMIT};

/// What the admin listener holds its connections to.
#[derive(Debug, Clone, Copy)]
pub struct ListenerSettings {
    /// A client must send a request's head whole within this (counted from its first byte;
    /// the first byte itself must come within it too); an idle HTTP/1.1 connection closes after
    /// it. The proxy's `client_header_timeout_ms`.
    pub header_timeout: Duration,
    /// An HTTP/2 connection with no stream open or started for this long closes. The proxy's
    /// `http2_idle_timeout_ms`.
    pub http2_idle_timeout: Duration,
    /// Open connections; a connection past it is closed at once.
    pub max_connections: usize,
    /// On shutdown, how long requests in flight may take to finish.
    pub shutdown_grace: Duration,
}

/// The listener's connections, for `/metrics`.
#[derive(Debug, Default)]
pub struct ConnectionCounters {
    open: AtomicU64,
    refused: AtomicU64,
}

impl ConnectionCounters {
    /// Connections open now.
    pub fn open(&self) -> u64 {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections closed on arrival, past `admin.max_connections`.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }
}

/// How long an idle HTTP/2 connection told GOAWAY has to finish closing.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The protocols as configured, shared by every connection.
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
    header_timeout: Duration,
    http2_idle_timeout: Duration,
}

impl Protocols {
    fn new(settings: &ListenerSettings) -> Protocols {
        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            .header_read_timeout(settings.header_timeout)
            .keep_alive(true);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2.timer(TokioTimer::new());
        Protocols {
            http1,
            http2,
            header_timeout: settings.header_timeout,
            http2_idle_timeout: settings.http2_idle_timeout,
        }
    }
}

/// Serves `app` on `listener` until `shutdown` turns true, then finishes (see the module's
/// comment). `counters` follow the connections.
pub fn serve(
    listener: TcpListener,
    app: Router,
    settings: ListenerSettings,
    counters: Arc<ConnectionCounters>,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let protocols = Arc::new(Protocols::new(&settings));
    let slots = Arc::new(Semaphore::new(settings.max_connections));
    tokio::spawn(async move {
        let connections = GracefulShutdown::new();
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = shutdown.wait_for(|stop| *stop) => break,
            };
            match accepted {
                Ok((stream, client)) => {
                    let Some(slot) = ConnectionSlot::take(&slots, &counters) else {
                        counters.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(%client, "admin listener at admin.max_connections; connection closed");
                        drop(stream);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(connection(
                        stream,
                        client,
                        app.clone(),
                        protocols.clone(),
                        connections.watcher(),
                        shutdown.clone(),
                        slot,
                    ));
                }
                Err(error) => {
                    // Out of file descriptors and similar: back off instead of spinning.
                    tracing::warn!(%error, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        drop(listener);
        if tokio::time::timeout(settings.shutdown_grace, connections.shutdown())
            .await
            .is_err()
        {
            tracing::warn!(
                grace_ms = settings.shutdown_grace.as_millis() as u64,
                "admin connections still open after the shutdown grace; closing them"
            );
        }
    })
}

/// One of `admin.max_connections` places, held for as long as its connection.
struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    counters: Arc<ConnectionCounters>,
}

impl ConnectionSlot {
    fn take(slots: &Arc<Semaphore>, counters: &Arc<ConnectionCounters>) -> Option<ConnectionSlot> {
        let permit = slots.clone().try_acquire_owned().ok()?;
        counters.open.fetch_add(1, Ordering::Relaxed);
        Some(ConnectionSlot {
            _permit: permit,
            counters: counters.clone(),
        })
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.counters.open.fetch_sub(1, Ordering::Relaxed);
    }
}

async fn connection(
    stream: TcpStream,
    client: SocketAddr,
    app: Router,
    protocols: Arc<Protocols>,
    watcher: Watcher,
    mut shutdown: watch::Receiver<bool>,
    _slot: ConnectionSlot,
) {
    let Some(protocol) = first_bytes(&stream, protocols.header_timeout, &mut shutdown).await else {
        tracing::debug!(%client, "admin client sent no request within the header timeout, or left");
        return;
    };
    let io = StallGuard::new(stream, WRITE_STALL_LIMIT);
    let result = match protocol {
        Protocol::Http1 => serve_http1(io, app, &protocols.http1, shutdown).await,
        Protocol::Http2 => {
            let http2 = &protocols.http2;
            serve_http2(io, app, http2, protocols.http2_idle_timeout, shutdown).await
        }
    };
    drop(watcher);
    if let Err(error) = result {
        tracing::debug!(%client, %error, "admin connection ended with an error");
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// The start of HTTP/2's connection preface ("PRI * HTTP/2.0…", a method HTTP/1.1 reserves).
const HTTP2_PREFACE_START: &[u8] = b"PRI ";

/// Waits (peeking, so hyper reads them) for the client's first bytes and tells the protocol
/// they open; None when nothing decisive comes within `within`, the client leaves or the
/// listener shuts down.
async fn first_bytes(
    stream: &TcpStream,
    within: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<Protocol> {
    let deadline = Instant::now() + within;
    let mut first = [0u8; HTTP2_PREFACE_START.len()];
    loop {
        let peeked = tokio::select! {
            peeked = tokio::time::timeout_at(deadline, stream.peek(&mut first)) => match peeked {
                Ok(Ok(peeked @ 1..)) => peeked,
                _ => return None,
            },
            _ = shutdown.wait_for(|stop| *stop) => return None,
        };
        if !HTTP2_PREFACE_START.starts_with(&first[..peeked]) {
            return Some(Protocol::Http1);
        }
        if peeked == HTTP2_PREFACE_START.len() {
            return Some(Protocol::Http2);
        }
        // "P", "PR": too few bytes to tell. They stay readable, so readiness cannot wait for
        // more of them: look again shortly.
        if Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A request's answer, counted as an open stream until hyper drops it (sent or reset).
type Answer = Response<Counted>;

/// Serves one request with `app`, counting it in `streams` while it is answered.
fn answer(
    app: &Router,
    streams: &Arc<StreamCounts>,
    request: Request<Incoming>,
) -> impl std::future::Future<Output = Result<Answer, Infallible>> + Send + 'static {
    let open = OpenStream::start(streams);
    let mut app = app.clone();
    async move {
        let response = match app.call(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        };
        Ok(response.map(|body| Counted { body, _open: open }))
    }
}

async fn serve_http1<I>(
    io: I,
    app: Router,
    builder: &http1::Builder,
    mut shutdown: watch::Receiver<bool>,
) -> hyper::Result<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let streams = Arc::new(StreamCounts::default());
    let service = hyper::service::service_fn(move |request| answer(&app, &streams, request));
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    tokio::select! {
        result = connection.as_mut() => return result,
        _ = shutdown.wait_for(|stop| *stop) => {}
    }
    // Idle: closes now; answering: closes once the answer is sent.
    connection.as_mut().graceful_shutdown();
    connection.await
}

async fn serve_http2<I>(
    io: I,
    app: Router,
    builder: &http2::Builder<TokioExecutor>,
    idle_timeout: Duration,
    mut shutdown: watch::Receiver<bool>,
) -> hyper::Result<()>
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let streams = Arc::new(StreamCounts::default());
    let counted = streams.clone();
    let service = hyper::service::service_fn(move |request| answer(&app, &counted, request));
    let connection = builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let check_every = (idle_timeout / 4).max(Duration::from_millis(10));
    let mut idle = IdleClock::new(&streams);
    let mut closing = false;
    let mut closing_idle = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => return result,
            _ = shutdown.wait_for(|stop| *stop), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tokio::time::sleep(check_every), if !closing => {
                if idle.idle_for(&streams) >= idle_timeout {
                    connection.as_mut().graceful_shutdown();
                    closing = true;
                    closing_idle = true;
                }
            }
            // hyper's graceful close waits for the client's PING acknowledgement; an idle
            // client that never sends it is not waited for, unless a stream it opened meanwhile
            // is still being answered.
            _ = tokio::time::sleep(IDLE_CLOSE_GRACE), if closing_idle => {
                if streams.open.load(Ordering::Relaxed) == 0 {
                    return Ok(());
                }
            }
        }
    }
}

/// A connection's requests: being answered now, and started since it opened.
#[derive(Debug, Default)]
struct StreamCounts {
    open: AtomicU64,
    started: AtomicU64,
}

/// One request, open from its arrival until hyper drops its answer.
struct OpenStream {
    counts: Arc<StreamCounts>,
}

impl OpenStream {
    fn start(counts: &Arc<StreamCounts>) -> OpenStream {
        counts.started.fetch_add(1, Ordering::Relaxed);
        counts.open.fetch_add(1, Ordering::Relaxed);
        OpenStream {
            counts: counts.clone(),
        }
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.counts.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An answer's body, keeping its request counted as open.
pub struct Counted {
    body: Body,
    _open: OpenStream,
}

impl http_body::Body for Counted {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

/// How long a connection has had no request open or started, as seen at its checks: a request
/// that came and went between two checks counts as use.
struct IdleClock {
    started: u64,
    busy_at_last_check: bool,
    quiet_since: Instant,
}

impl IdleClock {
    fn new(counts: &StreamCounts) -> IdleClock {
        IdleClock {
            started: counts.started.load(Ordering::Relaxed),
            busy_at_last_check: false,
            quiet_since: Instant::now(),
        }
    }

    fn idle_for(&mut self, counts: &StreamCounts) -> Duration {
        let started = counts.started.load(Ordering::Relaxed);
        let busy = started != self.started || counts.open.load(Ordering::Relaxed) > 0;
        if busy || self.busy_at_last_check {
            self.quiet_since = Instant::now();
        }
        self.started = started;
        self.busy_at_last_check = busy;
        self.quiet_since.elapsed()
    }
}

#[cfg(test)]
mod tests;
