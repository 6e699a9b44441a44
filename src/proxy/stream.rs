//! Raw TCP and TLS passthrough stream routes: listeners, SNI routing and byte copying.
//!
//! One accept loop per listen address of the snapshot's [`StreamTable`]; the control task binds
//! and retires them through [`StreamListeners`] as routes come and go, without a restart.
//! A connection:
//! - reads the current snapshot once to learn whether its address routes by SNI; if so it reads
//!   the client's ClientHello (bounded by [`StreamSettings::handshake_timeout`] and by
//!   [`MAX_CLIENT_HELLO_BUFFER`]) without terminating TLS, and those bytes go upstream first;
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

use std::collections::{HashMap, HashSet};
use std::future::poll_fn;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::Authority;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::body::InFlight;
use super::error::Blame;
use super::forward::{record_outcome, ACCESS_LOG_TARGET};
use super::sni::{parse_client_hello, Hello, HelloError, RecordBoundary, MAX_CLIENT_HELLO_BUFFER};
use crate::balance::FailureCause;
use crate::model::Id;
use crate::snapshot::{
    GatewayCounters, ServiceRuntime, SnapshotHandle, StreamRouteEntry, StreamStats,
};

/// Upper bound on connect attempts whatever a service asks for (as for HTTP).
const MAX_ATTEMPTS: usize = 10;
/// Per direction and connection: large enough for loopback throughput, small enough for many
/// idle connections.
const COPY_BUFFER: usize = 16 * 1024;
/// How often an accept loop looks for its route while the route's snapshot is not live yet.
const ROUTE_WAIT_POLL: Duration = Duration::from_millis(5);
/// Read size while waiting for a ClientHello, which is usually well under this.
const HELLO_READ_CHUNK: usize = 4 * 1024;
/// After the shutdown grace, how long the dropped connections get to write their log lines.
const DROP_WAIT: Duration = Duration::from_secs(1);

/// Why a stream listener could not be bound or a connection could not be proxied.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The address is taken, not local, or not allowed: the operator must choose another or
    /// free it; retrying as is will fail the same way.
    #[error("cannot listen on {listen}: {reason}")]
    Bind { listen: SocketAddr, reason: String },
    #[error("cannot listen on {listen}: the gateway is shutting down")]
    ShuttingDown { listen: SocketAddr },
    #[error("cannot listen on {listen}: not called inside the async runtime")]
    NoRuntime { listen: SocketAddr },
    #[error("the client sent no complete ClientHello within {timeout_ms} ms")]
    HelloTimeout { timeout_ms: u64 },
    #[error("the client closed the connection before its ClientHello was complete")]
    HelloTruncated,
    #[error("unreadable ClientHello: {0}")]
    BadHello(#[from] HelloError),
    #[error("reading the ClientHello failed: {0}")]
    ClientRead(io::Error),
    #[error("no stream route on {listen} matches server name {sni:?}")]
    NoRoute {
        listen: SocketAddr,
        sni: Option<String>,
    },
    #[error("no available target for service {service}")]
    NoAvailableTarget { service: String },
    #[error("service {service} has no target to connect to: its discovery sources are not healthy: {sources}")]
    DiscoveryUnavailable { service: String, sources: String },
    #[error("could not connect to target {target} of service {service}: {reason}")]
    ConnectFailed {
        service: String,
        target: String,
        reason: String,
    },
    #[error("connecting to target {target} of service {service} timed out after {timeout_ms} ms")]
    ConnectTimeout {
        service: String,
        target: String,
        timeout_ms: u64,
    },
}

impl StreamError {
    pub fn blame(&self) -> Blame {
        match self {
            StreamError::HelloTimeout { .. }
            | StreamError::HelloTruncated
            | StreamError::BadHello(_)
            | StreamError::ClientRead(_)
            | StreamError::NoRoute { .. } => Blame::Client,
            StreamError::ConnectFailed { .. } | StreamError::ConnectTimeout { .. } => {
                Blame::Upstream
            }
            StreamError::Bind { .. }
            | StreamError::ShuttingDown { .. }
            | StreamError::NoRuntime { .. }
            | StreamError::NoAvailableTarget { .. } => Blame::Gateway,
            StreamError::DiscoveryUnavailable { .. } => Blame::Discovery,
        }
    }

    /// Whether another target may be tried: only when nothing reached the failed one.
    pub fn retry_allowed(&self) -> bool {
        matches!(
            self,
            StreamError::ConnectFailed { .. } | StreamError::ConnectTimeout { .. }
        )
    }

    /// The access log's `outcome` of a connection that ended with this error.
    pub fn code(&self) -> &'static str {
        match self {
            StreamError::Bind { .. } => "bind_failed",
            StreamError::ShuttingDown { .. } => "shutting_down",
            StreamError::NoRuntime { .. } => "no_runtime",
            StreamError::HelloTimeout { .. } => "client_hello_timeout",
            StreamError::HelloTruncated | StreamError::ClientRead(_) => "client_closed",
            StreamError::BadHello(_) => "bad_client_hello",
            StreamError::NoRoute { .. } => "no_route",
            StreamError::NoAvailableTarget { .. } => "no_available_target",
            StreamError::DiscoveryUnavailable { .. } => "discovery_unavailable",
            StreamError::ConnectFailed { .. } => "upstream_connect_failed",
            StreamError::ConnectTimeout { .. } => "upstream_connect_timeout",
        }
    }

    /// Connections that no route took: they count as `stream_unmatched`.
    fn is_unmatched(&self) -> bool {
        matches!(
            self,
            StreamError::HelloTimeout { .. }
                | StreamError::HelloTruncated
                | StreamError::BadHello(_)
                | StreamError::ClientRead(_)
                | StreamError::NoRoute { .. }
        )
    }
}

fn bind_error(listen: SocketAddr, error: &io::Error) -> StreamError {
    let reason = match error.kind() {
        io::ErrorKind::AddrInUse => "address in use".to_owned(),
        io::ErrorKind::AddrNotAvailable => "address not available on this host".to_owned(),
        io::ErrorKind::PermissionDenied => "permission denied".to_owned(),
        _ => error.to_string(),
    };
    StreamError::Bind { listen, reason }
}

#[derive(Debug, Clone, Copy)]
pub struct StreamSettings {
    /// Longest wait for a complete ClientHello on a TLS passthrough listener.
    pub handshake_timeout: Duration,
    /// On shutdown, how long open connections may take to finish before they are dropped.
    pub shutdown_grace: Duration,
}

/// What every connection task shares.
struct Shared {
    snapshots: SnapshotHandle,
    counters: Arc<GatewayCounters>,
    settings: StreamSettings,
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
struct OpenConnection(Arc<Shared>);

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
    pub fn bind(&self, listen: SocketAddr) -> Result<(), StreamError> {
        let mut listeners = self
            .listeners
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // Checked under the lock `shutdown` drains the listeners with, so no listener is added
        // after the drain.
        if self.shut_down.load(Ordering::SeqCst) {
            return Err(StreamError::ShuttingDown { listen });
        }
        if listeners.contains_key(&listen) {
            return Ok(());
        }
        let runtime =
            tokio::runtime::Handle::try_current().map_err(|_| StreamError::NoRuntime { listen })?;
        // std's bind sets SO_REUSEADDR on Unix as tokio's does, so a port whose old connections
        // linger in TIME_WAIT can be bound again at once.
        let std_listener =
            std::net::TcpListener::bind(listen).map_err(|error| bind_error(listen, &error))?;
        std_listener
            .set_nonblocking(true)
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
                tokio::spawn(serve_connection(
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

#[derive(Debug, Clone, Copy)]
enum Direction {
    ClientToUpstream,
    UpstreamToClient,
}

/// Bytes moved by one connection, and when a byte last moved either way.
struct Progress {
    started: Instant,
    client_to_upstream: AtomicU64,
    upstream_to_client: AtomicU64,
    /// The route's statistics, once the connection has a route.
    route_stats: Option<Arc<StreamStats>>,
    /// Milliseconds after `started`.
    last_moved_ms: AtomicU64,
}

impl Progress {
    fn new() -> Progress {
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

/// What one connection did, for the access log and the route's statistics.
struct ConnectionRecord {
    listen: SocketAddr,
    sni: Option<String>,
    route: Option<Arc<StreamRouteEntry>>,
    /// The target of the last connect attempt.
    target: Option<Authority>,
    progress: Progress,
}

/// How a connection that reached its upstream ended.
#[derive(Debug)]
enum Ended {
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
    fn code(&self) -> &'static str {
        match self {
            Ended::Closed => "closed",
            Ended::IdleTimeout => "idle_timeout",
            Ended::ClientFailed(_) => "client_error",
            Ended::UpstreamFailed(_) => "upstream_error",
            Ended::Shutdown => "shutdown",
        }
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    client_stream: TcpStream,
    client: SocketAddr,
    listen: SocketAddr,
    open: OpenConnection,
) {
    let mut drop_open = shared.drop_open.subscribe();
    let mut record = ConnectionRecord {
        listen,
        sni: None,
        route: None,
        target: None,
        progress: Progress::new(),
    };
    let result = tokio::select! {
        result = proxy_connection(&shared, client_stream, &mut record) => result,
        // An error (the sender gone) cannot happen while this task holds `shared`.
        _ = drop_open.wait_for(|drop| *drop) => Ok(Ended::Shutdown),
    };
    let client_to_upstream = record.progress.client_to_upstream.load(Ordering::Relaxed);
    let upstream_to_client = record.progress.upstream_to_client.load(Ordering::Relaxed);
    if let Some(route) = &record.route {
        route.stats.closed();
    }
    let outcome = match &result {
        Ok(ended) => {
            if let Ended::ClientFailed(error) | Ended::UpstreamFailed(error) = ended {
                tracing::debug!(%client, %listen, %error, "stream connection ended with an error");
            }
            ended.code()
        }
        Err(error) => {
            if error.is_unmatched() {
                shared
                    .counters
                    .stream_unmatched
                    .fetch_add(1, Ordering::Relaxed);
            }
            match error.blame() {
                Blame::Client => {
                    tracing::debug!(%client, %listen, code = error.code(), %error, "stream connection refused")
                }
                Blame::Upstream | Blame::Gateway | Blame::Discovery => {
                    tracing::warn!(%client, %listen, code = error.code(), %error, "stream connection failed")
                }
            }
            error.code()
        }
    };
    let route = record.route.as_deref();
    tracing::info!(
        target: ACCESS_LOG_TARGET,
        kind = "stream",
        client = %client,
        listen = %listen,
        sni = record.sni.as_deref(),
        route = route.map(|route| route.route.id),
        service = route.map(|route| route.service.service.name.as_str()),
        target = record.target.as_ref().map(Authority::as_str),
        bytes_client_to_upstream = client_to_upstream,
        bytes_upstream_to_client = upstream_to_client,
        duration_ms = record.progress.started.elapsed().as_secs_f64() * 1000.0,
        outcome,
    );
    drop(open);
}

async fn proxy_connection(
    shared: &Shared,
    mut client: TcpStream,
    record: &mut ConnectionRecord,
) -> Result<Ended, StreamError> {
    let _ = client.set_nodelay(true);
    let listen = record.listen;
    let passthrough = {
        let snapshot = shared.snapshots.load();
        let routes = snapshot.streams().listener(listen);
        match routes {
            Some(routes) => routes.is_passthrough(),
            // The route went away between the accept and now.
            None => return Err(StreamError::NoRoute { listen, sni: None }),
        }
    };
    let hello = if passthrough {
        let (hello, sni) =
            read_client_hello(&mut client, shared.settings.handshake_timeout).await?;
        record.sni = sni;
        hello
    } else {
        Vec::new()
    };
    let route = {
        let snapshot = shared.snapshots.load();
        snapshot
            .streams()
            .listener(listen)
            .and_then(|routes| routes.route_for(record.sni.as_deref()))
            .cloned()
    };
    let route = route.ok_or_else(|| StreamError::NoRoute {
        listen,
        sni: record.sni.clone(),
    })?;
    route.stats.opened();
    record.progress.route_stats = Some(route.stats.clone());
    record.route = Some(route.clone());
    let service = &route.service;
    let (upstream, in_flight) = connect_upstream(service, &route, &mut record.target).await?;
    let _ = upstream.set_nodelay(true);
    let idle = Duration::from_millis(service.service.timeouts.idle_ms);
    let ended = relay(client, upstream, &hello, idle, &record.progress).await;
    drop(in_flight);
    Ok(ended)
}

/// Reads until the buffered bytes hold a complete ClientHello; returns them (they must go
/// upstream first) with the server name.
async fn read_client_hello(
    client: &mut TcpStream,
    timeout: Duration,
) -> Result<(Vec<u8>, Option<String>), StreamError> {
    let deadline = Instant::now() + timeout;
    let mut buffered = Vec::new();
    let mut boundary = RecordBoundary::default();
    let mut judged_first_bytes = false;
    loop {
        // The first bytes are judged at once (a non-TLS client is refused without waiting for a
        // record); after that, only a newly completed record can complete the ClientHello.
        let worth_parsing = !buffered.is_empty() && !judged_first_bytes;
        if worth_parsing || boundary.advance(&buffered)? {
            judged_first_bytes = true;
            if let Hello::Complete { sni } = parse_client_hello(&buffered)? {
                return Ok((buffered, sni));
            }
        }
        let room = MAX_CLIENT_HELLO_BUFFER.saturating_sub(buffered.len());
        if room == 0 {
            return Err(HelloError::TooLarge.into());
        }
        let filled = buffered.len();
        buffered.resize(filled + room.min(HELLO_READ_CHUNK), 0);
        let read = tokio::time::timeout_at(deadline, client.read(&mut buffered[filled..]))
            .await
            .map_err(|_| StreamError::HelloTimeout {
                timeout_ms: timeout.as_millis() as u64,
            })?
            .map_err(StreamError::ClientRead)?;
        buffered.truncate(filled + read);
        if read == 0 {
            return Err(StreamError::HelloTruncated);
        }
    }
}

/// Connects to a picked target, trying other targets after connect failures. The target's
/// in-flight count covers the connection from its connect to its end (for least_request).
async fn connect_upstream(
    service: &ServiceRuntime,
    route: &StreamRouteEntry,
    last_target: &mut Option<Authority>,
) -> Result<(TcpStream, InFlight), StreamError> {
    let attempts = (service.service.max_attempts as usize).clamp(1, MAX_ATTEMPTS);
    let connect_timeout = Duration::from_millis(service.service.timeouts.connect_ms);
    let mut tried: Vec<Id> = Vec::with_capacity(attempts);
    let mut last_error = None;
    for attempt in 1..=attempts {
        // Like HTTP: only the first pick may fall back to unhealthy or ejected targets.
        let first_attempt = attempt == 1;
        // Held past the recorded outcome, like HTTP: a connect is a half-open trial's verdict.
        let Some(pick) = service.pick(|candidate| tried.contains(&candidate.id), first_attempt)
        else {
            break;
        };
        let target = pick.target;
        tried.push(target.id);
        *last_target = Some(target.authority.clone());
        let in_flight = InFlight::start(&target.load);
        let error = match tokio::time::timeout(
            connect_timeout,
            TcpStream::connect(target.authority.as_str()),
        )
        .await
        {
            Ok(Ok(stream)) => {
                record_outcome(service, target, None);
                return Ok((stream, in_flight));
            }
            Ok(Err(error)) => StreamError::ConnectFailed {
                service: service.service.name.clone(),
                target: target.authority.to_string(),
                reason: error.to_string(),
            },
            Err(_) => StreamError::ConnectTimeout {
                service: service.service.name.clone(),
                target: target.authority.to_string(),
                timeout_ms: service.service.timeouts.connect_ms,
            },
        };
        drop(in_flight);
        route.stats.connect_failed();
        service
            .counters
            .connect_errors
            .fetch_add(1, Ordering::Relaxed);
        let cause = match error {
            StreamError::ConnectTimeout { .. } => FailureCause::Timeout,
            _ => FailureCause::ConnectFailed,
        };
        record_outcome(service, target, Some(cause));
        tracing::debug!(target = %target.authority, attempt, %error, "stream connect attempt failed");
        let retry_allowed = error.retry_allowed();
        last_error = Some(error);
        if !retry_allowed {
            break;
        }
    }
    Err(last_error.unwrap_or_else(|| {
        let name = service.service.name.clone();
        match &service.discovery_gap {
            Some(sources) => StreamError::DiscoveryUnavailable {
                service: name,
                sources: sources.to_string(),
            },
            None => StreamError::NoAvailableTarget { service: name },
        }
    }))
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
async fn relay(
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

    #[test]
    fn only_connect_failures_may_try_another_target() {
        let failed = StreamError::ConnectFailed {
            service: "db".into(),
            target: "127.0.0.1:1".into(),
            reason: "refused".into(),
        };
        assert!(failed.retry_allowed());
        assert_eq!(failed.blame(), Blame::Upstream);
        let unmatched = StreamError::NoRoute {
            listen: "127.0.0.1:443".parse().unwrap(),
            sni: Some("x.test".into()),
        };
        assert!(!unmatched.retry_allowed());
        assert!(unmatched.is_unmatched());
        assert_eq!(unmatched.blame(), Blame::Client);
    }

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

    /// A connected loopback pair: (the side the test drives, the side the code under test uses).
    async fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (outer, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (outer.unwrap(), accepted.unwrap().0)
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

    #[tokio::test]
    async fn client_hello_is_read_across_writes_and_kept_whole() {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from("db.example.org").unwrap();
        let mut tls = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut hello = Vec::new();
        tls.write_tls(&mut hello).unwrap();

        let (mut client, mut gateway_side) = socket_pair().await;
        let sent = hello.clone();
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(50) {
                client.write_all(piece).await.unwrap();
                client.flush().await.unwrap();
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            client
        });
        let (buffered, sni) = read_client_hello(&mut gateway_side, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(sni.as_deref(), Some("db.example.org"));
        assert_eq!(buffered, hello);
        drop(writer.await.unwrap());
    }

    #[tokio::test]
    async fn a_silent_or_non_tls_client_is_refused() {
        let (_client, mut gateway_side) = socket_pair().await;
        let silent = read_client_hello(&mut gateway_side, Duration::from_millis(50)).await;
        assert!(matches!(silent, Err(StreamError::HelloTimeout { .. })));

        let (mut client, mut gateway_side) = socket_pair().await;
        client.write_all(b"SSH-2.0-OpenSSH\r\n").await.unwrap();
        let garbage = read_client_hello(&mut gateway_side, Duration::from_secs(5)).await;
        assert!(matches!(
            garbage,
            Err(StreamError::BadHello(HelloError::NotTls))
        ));

        let (mut client, mut gateway_side) = socket_pair().await;
        client.write_all(&[22, 3, 1, 0, 200, 1]).await.unwrap();
        client.shutdown().await.unwrap();
        let truncated = read_client_hello(&mut gateway_side, Duration::from_secs(5)).await;
        assert!(matches!(truncated, Err(StreamError::HelloTruncated)));
    }
}
