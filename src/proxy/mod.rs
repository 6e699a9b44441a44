//! The data path: listeners, HTTP forwarding and the upstream client pool.
//!
//! A request does one lock-free snapshot load, a route lookup and a pick; it never touches the
//! store, DNS or a lock shared by all requests.

mod accounting;
mod affinity;
mod body;
mod budget;
mod canary;
mod client;
pub mod connect_timing;
mod connector;
mod cors;
mod detach;
mod error;
mod failure;
mod forward;
mod grpc;
mod h1client;
mod h1server;
mod h2client;
mod h2server;
mod headers;
mod listen;
mod plain_target;
mod pool;
mod rate_limit;
mod redirect;
mod replay;
mod response_body;
mod retry;
mod session_cookie;
mod sni;
mod spool;
pub mod stream;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1 as hyper_http1;
use hyper::server::conn::http2 as hyper_http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

pub use budget::Budget;
pub use connector::{AlpnOffer, TlsConnection, TlsTargetConnector, UpstreamTlsError};
pub use error::{ErrorDetails, ProxyError};
pub use failure::{Blame, NoTarget, Retry, UpstreamFailure, UpstreamFailureKind};
pub use forward::{BodySettings, ProxyBody};
pub use listen::bind_listener;
pub use spool::{probe as probe_spool_dir, SpoolSettings};

use crate::model::path::EscapedSlashes;
use crate::snapshot::{GatewayCounters, SnapshotHandle};
use client::UpstreamClients;

/// Downstream connection settings.
#[derive(Debug, Clone, Copy)]
pub struct ListenerSettings {
    /// Time a client has to send a request's headers.
    pub client_header_timeout: Duration,
    /// On shutdown, how long requests in flight may take to finish.
    pub shutdown_grace: Duration,
    /// Open client connections per listener.
    pub max_connections: usize,
    pub http2_max_concurrent_streams: u32,
    /// An HTTP/2 connection without an open stream closes after this long.
    pub http2_idle_timeout: Duration,
    pub requests: RequestLimits,
}

/// What one request may be, checked before it is routed.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    pub max_uri_bytes: usize,
    pub max_header_count: usize,
    /// Header fields as written on the wire (name, ": ", value, CRLF).
    pub max_header_bytes: usize,
    /// What a request path's `%2F` or `%5C` gets: kept escaped, or refused.
    pub escaped_slashes: EscapedSlashes,
}

pub struct ProxyState {
    snapshots: SnapshotHandle,
    limits: RequestLimits,
    bodies: BodySettings,
    clients: UpstreamClients,
    counters: Arc<GatewayCounters>,
    /// What Raahi's own 5xx answers tell the client.
    error_details: ErrorDetails,
    /// Set when the shutdown sequence starts: HTTP/1.1 answers then carry `Connection: close`, so
    /// clients pinned to a keep-alive connection move to a new one (which their load balancer no
    /// longer sends here) before the listeners close, instead of racing the close.
    draining: AtomicBool,
    /// Records sampled requests' spans; None when tracing is off.
    tracer: Option<Arc<crate::telemetry::trace::Tracer>>,
}

impl ProxyState {
    pub fn new(
        snapshots: SnapshotHandle,
        counters: Arc<GatewayCounters>,
        limits: RequestLimits,
        bodies: BodySettings,
        error_details: ErrorDetails,
        tracer: Option<Arc<crate::telemetry::trace::Tracer>>,
    ) -> Arc<ProxyState> {
        Arc::new(ProxyState {
            snapshots,
            limits,
            bodies,
            clients: UpstreamClients::default(),
            counters,
            error_details,
            draining: AtomicBool::new(false),
            tracer,
        })
    }

    /// The drain delay begins: keep serving, but end each HTTP/1.1 connection after its answer.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
}

/// Accepts HTTP/1.1 and HTTP/2 prior-knowledge connections on `listener` until `shutdown` turns
/// true. Then it stops accepting, asks every open connection to finish gracefully (idle
/// keep-alive connections close at once, HTTP/2 gets GOAWAY, a request in flight completes) and
/// waits for them up to the grace period.
pub fn serve_http(
    listener: TcpListener,
    state: Arc<ProxyState>,
    settings: ListenerSettings,
    shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    serve(listener, None, state, settings, shutdown)
}

/// Like [`serve_http`], with TLS on every connection: the certificate comes from `tls`'s resolver
/// (by SNI), HTTP/2 is spoken when ALPN chose `h2`, HTTP/1.1 otherwise. The handshake runs in the
/// connection's own task and must finish within the client header timeout.
pub fn serve_https(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    state: Arc<ProxyState>,
    settings: ListenerSettings,
    shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    serve(
        listener,
        Some(TlsAcceptor::from(tls)),
        state,
        settings,
        shutdown,
    )
}

/// How a listener serves its connections.
struct ConnectionSettings {
    /// Plain HTTP/1.1 connections, which park while idle (see `h1server`).
    http1: hyper_http1::Builder,
    park: h1server::ParkSettings,
    /// HTTP/1.1 over TLS (ALPN other than `h2`), with upgrades.
    tls_http1: hyper_http1::Builder,
    /// HTTP/2: prior knowledge on the plain listener, ALPN `h2` on TLS.
    http2: h2server::H2Settings,
    tls: Option<TlsAcceptor>,
    handshake_timeout: Duration,
}

fn serve(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    state: Arc<ProxyState>,
    settings: ListenerSettings,
    mut shutdown: watch::Receiver<bool>,
) -> JoinHandle<()> {
    let limits = settings.requests;
    let mut http2 = hyper_http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .max_concurrent_streams(settings.http2_max_concurrent_streams)
        // HPACK counts 32 bytes per field beside its name and value (RFC 9113 §6.5.2).
        .max_header_list_size(
            u32::try_from(limits.max_header_bytes + 32 * limits.max_header_count)
                .unwrap_or(u32::MAX),
        );
    // No header timeout in hyper for plain HTTP/1.1: the parking driver enforces it at its idle
    // checks, without a timer set and cleared on every request.
    let mut http1 = hyper_http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true);
    // hyper parses up to 100 fields without allocating; a higher limit costs every request a
    // heap array, so it is asked for only when configured.
    if limits.max_header_count > 100 {
        http1.max_headers(limits.max_header_count + 1);
    }
    let mut tls_http1 = http1.clone();
    tls_http1.header_read_timeout(settings.client_header_timeout);
    let connection_settings = Arc::new(ConnectionSettings {
        http1,
        park: h1server::ParkSettings::for_header_timeout(settings.client_header_timeout),
        tls_http1,
        http2: h2server::H2Settings {
            builder: http2,
            idle_timeout: settings.http2_idle_timeout,
        },
        tls,
        handshake_timeout: settings.client_header_timeout,
    });
    let max_connections = settings.max_connections;
    let slots = Arc::new(Semaphore::new(max_connections));
    // Told to plain clients past the limit; a TLS one cannot be told anything before a
    // handshake it is not worth.
    let refusal = connection_settings.tls.is_none().then(|| {
        ProxyError::TooManyConnections {
            limit: max_connections,
        }
        .to_http1_close(state.error_details)
    });
    tokio::spawn(async move {
        let connections = GracefulShutdown::new();
        loop {
            let accepted = tokio::select! {
                accepted = listener.accept() => accepted,
                _ = shutdown.wait_for(|stop| *stop) => break,
            };
            match accepted {
                Ok((stream, client)) => {
                    let Some(slot) = ConnectionSlot::take(&slots, &state.counters) else {
                        refuse_connection(stream, client, refusal.as_deref(), &state.counters);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(wait_for_first_bytes(
                        stream,
                        client,
                        state.clone(),
                        connection_settings.clone(),
                        connections.watcher(),
                        shutdown.clone(),
                        slot,
                    ));
                }
                Err(error) => {
                    // Out of file descriptors and similar: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        }
        drop(listener);
        let open = connections.count();
        tracing::info!(
            open_connections = open,
            "proxy listener closed; draining connections"
        );
        match tokio::time::timeout(settings.shutdown_grace, connections.shutdown()).await {
            Ok(()) => tracing::info!("every client connection finished"),
            Err(_) => tracing::warn!(
                grace_ms = settings.shutdown_grace.as_millis() as u64,
                "shutdown grace ran out; closing the connections still open"
            ),
        }
    })
}

/// One of a listener's `proxy.max_connections` places, held for as long as its connection.
struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    counters: Arc<GatewayCounters>,
}

impl ConnectionSlot {
    fn take(slots: &Arc<Semaphore>, counters: &Arc<GatewayCounters>) -> Option<ConnectionSlot> {
        let permit = slots.clone().try_acquire_owned().ok()?;
        counters.client_connections.fetch_add(1, Ordering::Relaxed);
        Some(ConnectionSlot {
            _permit: permit,
            counters: counters.clone(),
        })
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.counters
            .client_connections
            .fetch_sub(1, Ordering::Relaxed);
    }
}

/// A connection past the listener's limit is closed at once, first told why (`refusal`, 503
/// `too_many_connections`) if its socket takes the bytes without waiting.
fn refuse_connection(
    stream: TcpStream,
    client: SocketAddr,
    refusal: Option<&[u8]>,
    counters: &GatewayCounters,
) {
    counters
        .client_connections_refused
        .fetch_add(1, Ordering::Relaxed);
    tracing::debug!(%client, "listener at its connection limit; connection refused");
    if let Some(refusal) = refusal {
        let _ = stream.try_write(refusal);
    }
}

/// A connection that has sent nothing yet is held by this small task, not by a whole HTTP (and
/// TLS) connection's state, which is only built once bytes arrive: thousands of clients that
/// connect ahead of need cost little. Clients speak first in HTTP and TLS, so nothing waits on
/// the gateway. The wait is bounded by the client header timeout and ends at shutdown.
async fn wait_for_first_bytes(
    stream: TcpStream,
    client: SocketAddr,
    state: Arc<ProxyState>,
    settings: Arc<ConnectionSettings>,
    watcher: Watcher,
    mut shutdown: watch::Receiver<bool>,
    slot: ConnectionSlot,
) {
    let mut first = [0u8; HTTP2_PREFACE_START.len()];
    // Boxed, as the connection's HTTP state below is: this task lives as long as the connection,
    // and its own size is the largest of what it holds at any await. The wait's timer and
    // shutdown watch go once the first bytes came.
    let Some(peeked) = Box::pin(peek_client(
        &stream,
        client,
        &mut first,
        settings.handshake_timeout,
        &mut shutdown,
    ))
    .await
    else {
        return;
    };
    // Plain connections that do not open with HTTP/2's preface ("PRI * HTTP/2.0…", a method
    // HTTP/1.1 reserves for it) are HTTP/1.1, served by the parking driver.
    // The connection's state goes in a box this task awaits: a task of its own would cost a
    // spawn per connection.
    if settings.tls.is_some() {
        let slot = Arc::new(slot);
        Box::pin(serve_tls(
            stream, client, state, settings, watcher, shutdown, slot,
        ))
        .await;
    } else if HTTP2_PREFACE_START.starts_with(&first[..peeked])
        && (peeked == HTTP2_PREFACE_START.len()
            || Box::pin(opens_with_http2_preface(
                &stream,
                &first[..peeked],
                settings.handshake_timeout,
            ))
            .await)
    {
        let http2 = &settings.http2;
        Box::pin(h2server::serve(
            stream, client, false, state, http2, watcher, shutdown,
        ))
        .await;
    } else {
        let (http1, park) = (settings.http1.clone(), settings.park);
        Box::pin(h1server::serve(
            stream, client, state, http1, park, watcher, shutdown,
        ))
        .await;
    }
}

const HTTP2_PREFACE_START: &[u8] = b"PRI ";

/// Whether a plain connection opens with HTTP/2's preface, from its first bytes `seen`. Fewer
/// than four that match it ("P", "PR": a POST sent a byte at a time, say) are peeked again
/// until they decide, briefly, as the client keeps sending.
async fn opens_with_http2_preface(stream: &TcpStream, seen: &[u8], within: Duration) -> bool {
    let mut first = [0u8; HTTP2_PREFACE_START.len()];
    let mut peeked = seen.len().min(first.len());
    first[..peeked].copy_from_slice(&seen[..peeked]);
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if !HTTP2_PREFACE_START.starts_with(&first[..peeked]) {
            return false;
        }
        if peeked == HTTP2_PREFACE_START.len() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        // The bytes there stay readable, so readiness cannot wait for more of them.
        tokio::time::sleep(Duration::from_millis(5)).await;
        match stream.peek(&mut first).await {
            Ok(seen) => peeked = seen,
            Err(_) => return false,
        }
    }
}

/// Whether the client sends bytes within `within` (not read: the connection's protocol reads
/// them); false when it closes, fails, stays silent or the listener shuts down.
async fn bytes_arrive(
    stream: &TcpStream,
    client: SocketAddr,
    within: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> bool {
    peek_client(stream, client, &mut [0u8; 1], within, shutdown)
        .await
        .is_some()
}

/// Peeks at the first bytes a client sends: `peek`, not `readable`, as readiness can be
/// reported before any byte is there.
async fn peek_client(
    stream: &TcpStream,
    client: SocketAddr,
    buf: &mut [u8],
    within: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<usize> {
    let arrived = tokio::time::timeout(within, stream.peek(buf));
    tokio::select! {
        waited = arrived => match waited {
            Ok(Ok(peeked @ 1..)) => return Some(peeked),
            Ok(Ok(_)) => tracing::debug!(%client, "client closed its connection"),
            Ok(Err(error)) => tracing::debug!(%client, %error, "client connection failed"),
            Err(_) => tracing::debug!(%client, "client sent nothing within the client header timeout; closed"),
        },
        _ = shutdown.wait_for(|stop| *stop) => {}
    }
    None
}

async fn serve_tls(
    stream: TcpStream,
    client: SocketAddr,
    state: Arc<ProxyState>,
    settings: Arc<ConnectionSettings>,
    watcher: Watcher,
    mut shutdown: watch::Receiver<bool>,
    slot: Arc<ConnectionSlot>,
) {
    let Some(acceptor) = &settings.tls else {
        return;
    };
    let handshake = tokio::time::timeout(settings.handshake_timeout, acceptor.accept(stream));
    let stream = match handshake.await {
        Ok(Ok(stream)) => stream,
        Ok(Err(error)) => {
            tracing::debug!(%client, %error, "TLS handshake with a client failed");
            return;
        }
        Err(_) => {
            tracing::debug!(%client, "TLS handshake with a client timed out");
            return;
        }
    };
    if stream.get_ref().1.alpn_protocol() == Some(b"h2") {
        h2server::serve(
            stream,
            client,
            true,
            state,
            &settings.http2,
            watcher,
            shutdown,
        )
        .await;
        return;
    }
    // HTTP/2 over TLS needs ALPN (RFC 9113 §3.2): anything else here is HTTP/1.1. An upgraded
    // exchange's tunnel outlives hyper's connection: it keeps the listener's slot.
    let downstream = forward::Downstream::new(client, true).holding_slot(slot);
    let service = service_fn(move |request| {
        let state = state.clone();
        let downstream = downstream.clone();
        // Dropped unfinished, its client left (see `detach`). Not boxed: hyper keeps one
        // place per connection for its request's future.
        detach::ClientBound::new(async move {
            Ok::<_, Infallible>(forward::handle(&state, request, &downstream).await)
        })
    });
    let connection = settings
        .tls_http1
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(connection);
    // hyper's graceful watcher does not take an upgradeable connection: the listener's
    // shutdown is followed here, and `watcher` held, so its grace period waits for this one.
    let stopping = async {
        let _ = shutdown.wait_for(|stop| *stop).await;
    };
    let finished = tokio::select! {
        result = connection.as_mut() => Some(result),
        () = stopping => None,
    };
    let result = match finished {
        Some(result) => result,
        None => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    drop(watcher);
    if let Err(error) = result {
        tracing::debug!(%client, %error, "client connection ended with an error");
    }
}
