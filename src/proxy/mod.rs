//! The data path: listeners, HTTP forwarding and the upstream client pool.
//!
//! A request does one lock-free snapshot load, a route lookup and a pick; it never touches the
//! store, DNS or a lock shared by all requests.

mod body;
mod client;
mod connector;
mod error;
mod forward;
mod headers;
mod sni;
pub mod stream;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use error::{Blame, ProxyError};
pub use forward::{ProxyBody, ACCESS_LOG_TARGET};

use crate::snapshot::{GatewayCounters, SnapshotHandle};
use client::UpstreamClients;

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
}

impl ProxyState {
    pub fn new(snapshots: SnapshotHandle, counters: Arc<GatewayCounters>) -> Arc<ProxyState> {
        Arc::new(ProxyState {
            snapshots,
            clients: UpstreamClients::default(),
            counters,
        })
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
    let builder = Arc::new(builder);
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
                    tokio::spawn(serve_connection(
                        stream,
                        client,
                        state.clone(),
                        builder.clone(),
                        connections.watcher(),
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

async fn serve_connection(
    stream: tokio::net::TcpStream,
    client: SocketAddr,
    state: Arc<ProxyState>,
    builder: Arc<auto::Builder<TokioExecutor>>,
    watcher: Watcher,
) {
    let service = service_fn(move |request| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(forward::handle(&state, request, client).await) }
    });
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    if let Err(error) = watcher.watch(connection).await {
        tracing::debug!(%client, %error, "client connection ended with an error");
    }
}
