//! The upstream HTTP/2 client for `h2c` targets: one small pool of multiplexed connections per
//! target, beside the HTTP/1.1 one (`plain_target`), chosen by `client::UpstreamClients`.
//!
//! A request takes a stream on the oldest connection with room — room being the lower of
//! `limits.max_streams_per_connection` and the target's `SETTINGS_MAX_CONCURRENT_STREAMS` — so
//! the newest connections go idle and close first; a connection is dialled only when every
//! other is full, and never past `limits.max_connections_per_target` (then the least loaded
//! one takes the stream, and h2 holds it until the target makes room). A connection the target
//! sent GOAWAY on takes no new stream and finishes the ones it has. The pool's lock is this
//! target's alone and is held to choose, never across an await.
//!
//! The h2 crate does the framing and flow control; what it leaves to a client is here: the
//! choice of connection, the GOAWAY's last stream id (`sniff`), keep-alive PINGs and idle
//! closing (`connection`), and the two bodies (`body`).

mod body;
mod connection;
mod sniff;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};

pub use body::H2ResponseBody;
use connection::{mark_closed, H2Connection};
pub use connection::{Dial, DialError, DialFuture, TcpDial, Transport};

use super::body::UpstreamRequestBody;
use super::connect_timing::ConnectTiming;
use crate::snapshot::ServiceCounters;

/// What a target's connections are made and kept with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct H2Settings {
    pub connect_timeout: Duration,
    pub idle_timeout: Duration,
    /// PING a connection with open streams that has been silent this long; null: never.
    pub keepalive: Option<Duration>,
    pub max_streams_per_connection: usize,
    /// Null: no limit.
    pub max_connections: Option<usize>,
}

/// Why an attempt on an HTTP/2 target got no response. Messages leave the target's address
/// out: they may reach clients (the failure carries the target for the log).
#[derive(Debug, thiserror::Error)]
pub enum H2Error {
    #[error(transparent)]
    Dial(#[from] DialError),
    /// The target never processed the stream: it refused it (`REFUSED_STREAM`), or it was
    /// above the last stream id of the target's GOAWAY, or the connection could not open it.
    #[error("the target did not process the request: {reason}")]
    Unprocessed { reason: String },
    /// The stream broke after the request (or part of it) went out.
    #[error("the HTTP/2 stream failed: {0}")]
    Stream(#[source] h2::Error),
    #[error("the connection failed: no PING answer within {timeout_ms} ms while streams waited")]
    PingTimeout { timeout_ms: u64 },
}

impl H2Error {
    /// Nothing reached the target (the connection could not be made).
    pub fn is_connect(&self) -> bool {
        matches!(self, H2Error::Dial(_))
    }

    pub fn is_connect_timeout(&self) -> bool {
        matches!(self, H2Error::Dial(DialError::Timeout { .. }))
    }

    /// An `https` target chose HTTP/1.1 by ALPN: nothing was sent, and the request may go to it
    /// over HTTP/1.1 in the same attempt.
    pub fn alpn_chose_http1(&self) -> bool {
        matches!(self, H2Error::Dial(DialError::NotH2))
    }

    /// The TLS handshake failed, with its detail.
    pub fn tls_failure(&self) -> Option<&str> {
        match self {
            H2Error::Dial(DialError::Tls { detail }) => Some(detail),
            _ => None,
        }
    }

    /// The target did not act on the request: it may go anywhere else, whatever its method.
    pub fn is_unprocessed(&self) -> bool {
        matches!(
            self,
            H2Error::Unprocessed { .. } | H2Error::Dial(DialError::NotH2)
        )
    }
}

pub struct H2Target {
    /// `host:port` dialled.
    address: String,
    dial: Box<dyn Dial>,
    settings: H2Settings,
    counters: Arc<ServiceCounters>,
    /// Oldest first.
    connections: Mutex<Vec<Arc<H2Connection>>>,
    /// The streams at once the target last announced (`usize::MAX` before it did).
    learned_max_streams: AtomicUsize,
}

impl H2Target {
    /// A target dialled over plain TCP (`h2c`).
    pub fn new(address: String, settings: H2Settings, counters: Arc<ServiceCounters>) -> Self {
        let dial = TcpDial {
            address: address.clone(),
            timeout: settings.connect_timeout,
        };
        Self::with_dial(address, Box::new(dial), settings, counters)
    }

    pub fn with_dial(
        address: String,
        dial: Box<dyn Dial>,
        settings: H2Settings,
        counters: Arc<ServiceCounters>,
    ) -> Self {
        H2Target {
            address,
            dial,
            settings,
            counters,
            connections: Mutex::new(Vec::new()),
            learned_max_streams: AtomicUsize::new(usize::MAX),
        }
    }

    pub fn settings(&self) -> &H2Settings {
        &self.settings
    }

    pub fn address(&self) -> &str {
        &self.address
    }

    /// Sends `request` (its URI carries the scheme and `:authority`) with `body` on a stream of
    /// one of the target's connections.
    pub async fn send(
        self: &Arc<Self>,
        request: Request<()>,
        body: UpstreamRequestBody,
    ) -> Result<Response<H2ResponseBody>, H2Error> {
        let (slot, opens_connection) = self.choose();
        let connection = slot.connection().clone();
        let waited = tokio::time::Instant::now();
        let sender = connection.sender(self).await?;
        // The stream that made the pool open a connection carries how long that took (TCP,
        // TLS for an https target, and the HTTP/2 handshake).
        let opened = opens_connection.then(|| waited.elapsed());
        let mut sender = sender.ready().await.map_err(|error| H2Error::Unprocessed {
            reason: format!("the connection could not open a stream: {error}"),
        })?;
        let ends_at_headers = matches!(body, UpstreamRequestBody::Empty);
        let (response, upload) = sender
            .send_request(request, ends_at_headers)
            .map_err(|error| unsent(&connection, error))?;
        let stream_id = u32::from(response.stream_id());
        let cancel = match body {
            UpstreamRequestBody::Empty => None,
            // Already whole in memory: handed to h2 at once (it holds the same bytes, and
            // sends them as the target's window opens), with no task of its own.
            UpstreamRequestBody::Buffered { data, trailers, .. } => {
                body::send_whole(upload, data, trailers);
                None
            }
            streamed => Some(body::start_upload(streamed, upload)),
        };
        match response.await {
            Ok(response) => {
                let mut response = response.map(|stream| H2ResponseBody::new(stream, slot, cancel));
                if let Some(connect) = opened {
                    response.extensions_mut().insert(ConnectTiming { connect });
                }
                Ok(response)
            }
            Err(error) => Err(self.failed(&connection, stream_id, error)),
        }
    }

    /// What a new connection may assume of the target's stream limit before it says.
    fn learned_max_streams(&self) -> usize {
        self.learned_max_streams
            .load(Ordering::Relaxed)
            .min(self.settings.max_streams_per_connection)
    }

    /// The connection for the next stream, with the stream counted on it, and whether it is a
    /// new connection that this stream opens.
    fn choose(self: &Arc<Self>) -> (connection::StreamSlot, bool) {
        let ours = self.settings.max_streams_per_connection;
        let mut connections = self.lock();
        connections.retain(|connection| !connection.retired() || connection.open_streams() > 0);
        if let Some(theirs) = connections
            .iter()
            .rev()
            .find_map(|connection| connection.seen.max_concurrent_streams())
        {
            self.learned_max_streams
                .store(theirs as usize, Ordering::Relaxed);
        }
        let learned = self.learned_max_streams.load(Ordering::Relaxed);
        let live = || {
            connections
                .iter()
                .filter(|connection| !connection.retired())
        };
        if let Some(roomy) =
            live().find(|connection| connection.open_streams() < connection.capacity(ours, learned))
        {
            return (roomy.reserve(&self.counters), false);
        }
        let at_limit = self
            .settings
            .max_connections
            .is_some_and(|max| live().count() >= max);
        if at_limit {
            if let Some(least) = live().min_by_key(|connection| connection.open_streams()) {
                return (least.reserve(&self.counters), false);
            }
        }
        let fresh = Arc::new(H2Connection::new());
        let slot = fresh.reserve(&self.counters);
        connections.push(fresh);
        (slot, true)
    }

    /// Drops a connection that ended or could not be made.
    pub(super) fn forget(&self, gone: &Arc<H2Connection>) {
        self.lock()
            .retain(|connection| !Arc::ptr_eq(connection, gone));
    }

    /// Closes `idle` unless a request chose it since its driver looked: both happen under the
    /// lock, so no stream can be reserved on a connection that is then closed.
    pub(super) fn retire_if_idle(&self, idle: &Arc<H2Connection>) -> bool {
        let mut connections = self.lock();
        if idle.open_streams() > 0 {
            return false;
        }
        mark_closed(idle);
        connections.retain(|connection| !Arc::ptr_eq(connection, idle));
        true
    }

    fn failed(&self, connection: &H2Connection, stream_id: u32, error: h2::Error) -> H2Error {
        if connection.ping_failed.load(Ordering::Acquire) {
            return H2Error::PingTimeout {
                timeout_ms: self.settings.connect_timeout.as_millis() as u64,
            };
        }
        if error.reason() == Some(h2::Reason::REFUSED_STREAM) && error.is_remote() {
            self.counters.h2_unprocessed.fetch_add(1, Ordering::Relaxed);
            return H2Error::Unprocessed {
                reason: "the target refused the stream (REFUSED_STREAM)".to_owned(),
            };
        }
        if connection.seen.unprocessed(stream_id) {
            self.counters.h2_unprocessed.fetch_add(1, Ordering::Relaxed);
            return H2Error::Unprocessed {
                reason: format!(
                    "the target ended the connection (GOAWAY, code {}) before this stream",
                    connection.seen.goaway_code()
                ),
            };
        }
        H2Error::Stream(error)
    }

    #[cfg(test)]
    fn connection_count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<H2Connection>>> {
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// `send_request` refused before a frame went out: the connection is closing or broken.
fn unsent(connection: &H2Connection, error: h2::Error) -> H2Error {
    mark_closed(connection);
    H2Error::Unprocessed {
        reason: format!("the connection could not open a stream: {error}"),
    }
}

#[cfg(test)]
mod tests;
