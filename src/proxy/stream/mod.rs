//! Raw TCP and TLS passthrough stream routes: the listener set (here), a connection's way from
//! accept to target (`connection`) and the byte copying (`relay`).
//!
//! One accept loop per listen address of the snapshot's `StreamTable`; the control task binds
//! and retires them through [`StreamListeners`] as routes come and go, without a restart.
//! A connection:
//! - reads the current snapshot once to learn whether its address routes by SNI; if so it reads
//!   the client's ClientHello (bounded by [`StreamSettings::handshake_timeout`] and by
//!   `MAX_CLIENT_HELLO_BUFFER`) without terminating TLS, and those bytes go upstream first;
//! - picks a target with the service's balancer (the first pick may fall back to panic mode like
//!   HTTP), connecting with the service's `timeouts.connect_ms`; a connect failure feeds passive
//!   ejection and tries another untried available target, up to `max_attempts`;
//! - copies bytes both ways with half-close: when one side ends its writes, the other side's
//!   write half is shut down and the opposite direction keeps flowing until it ends too;
//! - is closed when no byte moves either way for the service's `timeouts.idle_ms` (the same
//!   setting bounds idle pooled HTTP connections), so a vanished peer cannot hold it forever.
//!
//! Open connections do not follow snapshot changes: a target that turns draining, a deleted
//! route or a retired listener keeps its open connections until they end. Shutdown stops every
//! listener and waits up to [`StreamSettings::shutdown_grace`] before dropping what is left.

mod connection;
mod relay;

use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

use crate::snapshot::{GatewayCounters, SnapshotHandle};

pub use connection::StreamError;

/// How often an accept loop looks for its route while the route's snapshot is not live yet.
const ROUTE_WAIT_POLL: Duration = Duration::from_millis(5);
/// After the shutdown grace, how long the dropped connections get to write their log lines.
const DROP_WAIT: Duration = Duration::from_secs(1);

/// Why a stream listener could not be bound: the control plane's failure, reported to the
/// operator who asked for the route, never a connection's.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// The address is taken, not local, or not allowed: the operator must choose another or
    /// free it; retrying as is will fail the same way.
    #[error("cannot listen on {listen}: {reason}")]
    Bind { listen: SocketAddr, reason: String },
    #[error("cannot listen on {listen}: the gateway is shutting down")]
    ShuttingDown { listen: SocketAddr },
    #[error("cannot listen on {listen}: not called inside the async runtime")]
    NoRuntime { listen: SocketAddr },
}

fn bind_error(listen: SocketAddr, error: &io::Error) -> BindError {
    let reason = match error.kind() {
        io::ErrorKind::AddrInUse => "address in use".to_owned(),
        io::ErrorKind::AddrNotAvailable => "address not available on this host".to_owned(),
        io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
        _ => error.to_string(),
    };
    BindError::Bind { listen, reason }
}

#[derive(Debug, Clone, Copy)]
pub struct StreamSettings {
    /// Longest wait for a complete ClientHello on a TLS passthrough listener.
    pub handshake_timeout: Duration,
    /// On shutdown, how long open connections may take to finish before they are dropped.
    pub shutdown_grace: Duration,
    /// Connections the kernel may hold for a listener before the gateway accepts them.
    pub listen_backlog: u32,
}

/// What every connection task shares.
pub(super) struct Shared {
    pub(super) snapshots: SnapshotHandle,
    pub(super) counters: Arc<GatewayCounters>,
    pub(super) settings: StreamSettings,
    /// Connections accepted and not yet ended, on every listener.
    open: AtomicUsize,
    /// Notified when `open` drops to zero.
    all_closed: Notify,
    /// Turns true when the shutdown grace has run out: the connections still open end at once.
    drop_open: watch::Sender<bool>,
}

impl Shared {
    async fn wait_all_closed(&self) {
        loop {
            let notified = self.all_closed.notified();
            tokio::pin!(notified);
            // Registered before the check, so a close between the check and the await is seen.
            notified.as_mut().enable();
            if self.open.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Counts one accepted connection in [`Shared::open`] until it is dropped, however its task ends.
pub(super) struct OpenConnection(Arc<Shared>);

impl Drop for OpenConnection {
    fn drop(&mut self) {
        if self.0.open.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.all_closed.notify_waiters();
        }
    }
}

/// The socket of one listen address. It sits behind a mutex that only its accept loop (once per
/// accept) and the control plane touch, so retiring it closes the socket at once: the port is
/// free for another bind as soon as `retain` returns.
type ListenerSlot = Arc<Mutex<Option<TcpListener>>>;

struct BoundListener {
    socket: ListenerSlot,
    stop: Arc<Notify>,
}

impl BoundListener {
    fn close(&self) {
        drop(
            self.socket
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        // A permit is stored if the loop is between polls, so it cannot miss this.
        self.stop.notify_one();
    }
}

/// The stream listeners of the gateway, one per listen address of the current stream routes.
pub struct StreamListeners {
    shared: Arc<Shared>,
    listeners: Mutex<HashMap<SocketAddr, BoundListener>>,
    shut_down: AtomicBool,
}

impl StreamListeners {
    pub fn new(
        snapshots: SnapshotHandle,
        counters: Arc<GatewayCounters>,
        settings: StreamSettings,
    ) -> Arc<StreamListeners> {
        let (drop_open, _) = watch::channel(false);
        Arc::new(StreamListeners {
            shared: Arc::new(Shared {
                snapshots,
                counters,
                settings,
                open: AtomicUsize::new(0),
                all_closed: Notify::new(),
                drop_open,
            }),
            listeners: Mutex::new(HashMap::new()),
            shut_down: AtomicBool::new(false),
        })
    }

    /// Starts accepting on `listen`; does nothing when it is already bound. Must run inside the
    /// tokio runtime (the control task calls it).
    pub fn bind(&self, listen: SocketAddr) -> Result<(), BindError> {
        let mut listeners = self
            .listeners
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Checked under the lock `shutdown` drains the listeners with, so no listener is added
        // after the drain.
        if self.shut_down.load(Ordering::SeqCst) {
            return Err(BindError::ShuttingDown { listen });
        }
        if listeners.contains_key(&listen) {
            return Ok(());
        }
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| BindError::NoRuntime { listen })?;
        let std_listener =
            super::listen::bind_listener(listen, self.shared.settings.listen_backlog)
                .map_err(|error| bind_error(listen, &error))?;
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(std_listener).map_err(|error| bind_error(listen, &error))?
        };
        let bound = BoundListener {
            socket: Arc::new(Mutex::new(Some(listener))),
            stop: Arc::new(Notify::new()),
        };
        runtime.spawn(accept_loop(
            self.shared.clone(),
            listen,
            bound.socket.clone(),
            bound.stop.clone(),
        ));
        listeners.insert(listen, bound);
        tracing::info!(%listen, "stream listener bound");
        Ok(())
    }

    /// Stops accepting on every bound address not in `wanted`. Their open connections continue.
    pub fn retain(&self, wanted: &HashSet<SocketAddr>) {
        let mut listeners = self
            .listeners
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        listeners.retain(|listen, bound| {
            if wanted.contains(listen) {
                return true;
            }
            bound.close();
            tracing::info!(%listen, "stream listener closed; its open connections continue");
            false
        });
    }

    pub fn bound(&self) -> Vec<SocketAddr> {
        let listeners = self
            .listeners
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut addresses: Vec<SocketAddr> = listeners.keys().copied().collect();
        addresses.sort();
        addresses
    }

    /// Connections open now on every stream listener, retired ones included.
    pub fn open_connections(&self) -> usize {
        self.shared.open.load(Ordering::SeqCst)
    }

    /// Stops accepting everywhere (later binds are refused), waits for the open connections up
    /// to the shutdown grace, then drops the rest.
    pub async fn shutdown(&self) {
        self.shut_down.store(true, Ordering::SeqCst);
        let retired: Vec<BoundListener> = {
            let mut listeners = self
                .listeners
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            listeners.drain().map(|(_, bound)| bound).collect()
        };
        for bound in &retired {
            bound.close();
        }
        let open = self.open_connections();
        if open == 0 {
            return;
        }
        let grace = self.shared.settings.shutdown_grace;
        tracing::info!(
            open_connections = open,
            "stream listeners closed; draining connections"
        );
        if tokio::time::timeout(grace, self.shared.wait_all_closed())
            .await
            .is_ok()
        {
            tracing::info!("every stream connection finished");
            return;
        }
        tracing::warn!(
            grace_ms = grace.as_millis() as u64,
            open_connections = self.open_connections(),
            "shutdown grace ran out; closing the stream connections still open"
        );
        self.shared.drop_open.send_replace(true);
        let _ = tokio::time::timeout(DROP_WAIT, self.shared.wait_all_closed()).await;
    }
}

impl Drop for StreamListeners {
    fn drop(&mut self) {
        // Without this the accept loops would hold their sockets until the runtime ends.
        let listeners = self
            .listeners
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for (_, bound) in listeners.drain() {
            bound.close();
        }
    }
}

/// Polls the slot's listener; Ready(None) once it has been retired. A connection is counted as
/// open under the slot's lock, so `shutdown` cannot miss one accepted just before the close.
fn poll_accept(
    socket: &Mutex<Option<TcpListener>>,
    shared: &Arc<Shared>,
    cx: &mut Context<'_>,
) -> Poll<Option<io::Result<(TcpStream, SocketAddr, OpenConnection)>>> {
    let slot = socket.lock().unwrap_or_else(PoisonError::into_inner);
    let Some(listener) = slot.as_ref() else {
        return Poll::Ready(None);
    };
    listener.poll_accept(cx).map(|accepted| {
        Some(accepted.map(|(stream, client)| {
            shared.open.fetch_add(1, Ordering::SeqCst);
            (stream, client, OpenConnection(shared.clone()))
        }))
    })
}

async fn accept_loop(
    shared: Arc<Shared>,
    listen: SocketAddr,
    socket: ListenerSlot,
    stop: Arc<Notify>,
) {
    loop {
        // The admin API binds a new route's address before its snapshot is live: leave
        // connections in the kernel's backlog until the route is there rather than close them
        // as unmatched.
        while shared.snapshots.load().streams().listener(listen).is_none() {
            tokio::select! {
                _ = stop.notified() => return,
                _ = tokio::time::sleep(ROUTE_WAIT_POLL) => {}
            }
        }
        let accepted = tokio::select! {
            _ = stop.notified() => break,
            accepted = poll_fn(|cx| poll_accept(&socket, &shared, cx)) => accepted,
        };
        match accepted {
            None => break,
            Some(Ok((stream, client, open))) => {
                tokio::spawn(connection::serve(
                    shared.clone(),
                    stream,
                    client,
                    listen,
                    open,
                ));
            }
            Some(Err(error)) => {
                // Out of file descriptors and similar: back off instead of spinning.
                tracing::warn!(%listen, %error, "stream accept failed");
                tokio::select! {
                    _ = stop.notified() => break,
                    _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                }
            }
        }
    }
    tracing::debug!(%listen, "stream accept loop ended");
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A connected loopback pair: (the side the test drives, the side the code under test uses).
    pub(in crate::proxy::stream) async fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (outer, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (outer.unwrap(), accepted.unwrap().0)
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn listeners_are_shared_across_threads() {
        assert_send_sync::<StreamListeners>();
    }

    #[test]
    fn bind_failure_names_the_address() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let listen = held.local_addr().unwrap();
        let error = std::net::TcpListener::bind(listen).unwrap_err();
        let message = bind_error(listen, &error).to_string();
        assert_eq!(
            message,
            format!("cannot listen on {listen}: address in use")
        );
    }
}
