//! The data path: listeners, HTTP forwarding and the upstream client pool.
//!
//! A request does one lock-free snapshot load, a route lookup and a pick; it never touches the
//! store, DNS or a lock shared by all requests.

mod accounting;
mod body;
mod client;
mod connector;
mod error;
mod failure;
mod forward;
mod h1client;
mod h1server;
mod headers;
mod plain_target;
mod pool;
mod sni;
pub mod stream;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper::server::conn::http1 as hyper_http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;

pub use connector::{AlpnOffer, TlsConnection, TlsTargetConnector, UpstreamTlsError};
pub use error::ProxyError;
pub use failure::{Blame, NoTarget, Retry, UpstreamFailure, UpstreamFailureKind};
pub use forward::ProxyBody;

use crate::snapshot::{GatewayCounters, SnapshotHandle};
use client::UpstreamClients;

/// The access log's tracing target: one line per HTTP request or L4 connection at INFO.
pub const ACCESS_LOG_TARGET: &str = "raahi::access";

/// Downstream connection settings.
#[derive(Debug, Clone, Copy)]
pub struct ListenerSettings {
    /// Time a client has to send a request's headers.
    pub client_header_timeout: Duration,
    /// On shutdown, how long requests in flight may take to finish.
    pub shutdown_grace: Duration,
}

pub struct ProxyState {
    snapshots: SnapshotHandle,
    clients: UpstreamClients,
    counters: Arc<GatewayCounters>,
    /// Set when the shutdown sequence starts: HTTP/1.1 answers then carry `Connection: close`, so
    /// clients pinned to a keep-alive connection move to a new one (which their load balancer no
    /// longer sends here) before the listeners close, instead of racing the close.
    draining: AtomicBool,
}

impl ProxyState {
    pub fn new(snapshots: SnapshotHandle, counters: Arc<GatewayCounters>) -> Arc<ProxyState> {
        Arc::new(ProxyState {
            snapshots,
            clients: UpstreamClients::default(),
            counters,
            draining: AtomicBool::new(false),
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
    /// HTTP/1.1 with upgrades, or HTTP/2 when the connection starts with its preface.
    any: auto::Builder<TokioExecutor>,
    /// HTTP/2 only, for TLS connections whose ALPN chose `h2`.
    http2: auto::Builder<TokioExecutor>,
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
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.client_header_timeout)
        .keep_alive(true);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)));
    // No header timeout in hyper for plain HTTP/1.1: the parking driver enforces it at its idle
    // checks, without a timer set and cleared on every request.
    let mut http1 = hyper_http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .keep_alive(true);
    let connection_settings = Arc::new(ConnectionSettings {
        http1,
        park: h1server::ParkSettings::for_header_timeout(settings.client_header_timeout),
        http2: builder.clone().http2_only(),
        any: builder,
        tls,
        handshake_timeout: settings.client_header_timeout,
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
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(wait_for_first_bytes(
                        stream,
                        client,
                        state.clone(),
                        connection_settings.clone(),
                        connections.watcher(),
                        shutdown.clone(),
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
    if settings.tls.is_none() && !HTTP2_PREFACE_START.starts_with(&first[..peeked]) {
        let (http1, park) = (settings.http1.clone(), settings.park);
        Box::pin(h1server::serve(
            stream, client, state, http1, park, watcher, shutdown,
        ))
        .await;
    } else {
        Box::pin(serve_connection(stream, client, state, settings, watcher)).await;
    }
}

const HTTP2_PREFACE_START: &[u8] = b"PRI ";

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

async fn serve_connection(
    stream: TcpStream,
    client: SocketAddr,
    state: Arc<ProxyState>,
    settings: Arc<ConnectionSettings>,
    watcher: Watcher,
) {
    let Some(acceptor) = &settings.tls else {
        serve_protocol(stream, client, false, false, state, &settings, watcher).await;
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
    let http2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
    serve_protocol(stream, client, true, http2, state, &settings, watcher).await;
}

async fn serve_protocol<I>(
    io: I,
    client: SocketAddr,
    over_tls: bool,
    http2: bool,
    state: Arc<ProxyState>,
    settings: &ConnectionSettings,
    watcher: Watcher,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let downstream = forward::Downstream::new(client, over_tls);
    let service = service_fn(move |request| {
        let state = state.clone();
        let downstream = downstream.clone();
        async move { Ok::<_, Infallible>(forward::handle(&state, request, &downstream).await) }
    });
    let io = TokioIo::new(io);
    let result = if http2 {
        watcher
            .watch(settings.http2.serve_connection(io, service))
            .await
    } else {
        watcher
            .watch(settings.any.serve_connection_with_upgrades(io, service))
            .await
    };
    if let Err(error) = result {
        tracing::debug!(%client, %error, "client connection ended with an error");
    }
}
