//! Plain HTTP/1.1 client connections that give their HTTP state back while idle.
//!
//! hyper keeps a connection's read buffer (8–16 KiB) and write buffer for as long as the
//! connection lives, so ten thousand keep-alive clients resting between requests would hold a
//! quarter of a gigabyte. Here a connection that has been quiet for a whole idle check is
//! *parked*: hyper is asked to stop while idle, hands back the socket and any bytes it had
//! read but not parsed, and the connection waits as a bare socket (the same small wait as a
//! connection that has sent nothing yet). The next bytes build a fresh HTTP/1.1 connection
//! state, fed first with the bytes hyper handed back, so nothing the client sent is lost and
//! the client sees one ordinary keep-alive connection.
//!
//! Upgrades (`101 Switching Protocols`) are finished here as well: hyper hands the socket back
//! after writing the 101, and the tunnel runs on it with the upstream side that the forwarding
//! code left in the connection's [`UpgradeHandoff`].

use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use hyper_util::server::graceful::Watcher;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};

use super::detach::ClientBound;
use super::error::{ErrorDetails, ProxyError};
use super::forward::{self, Downstream, GuardedBody, UpgradeHandoff};
use super::{bytes_arrive, ProxyState};

/// What one client connection has been doing, as seen by its idle check. Every field is
/// written only from the connection's own task (its socket, hyper's dispatch and the response
/// bodies hyper drops all run there), so plain loads and stores suffice: no locked
/// read-modify-write on the request path.
#[derive(Default)]
pub(super) struct ConnectionActivity {
    /// Bumped when bytes move either way or a request starts.
    moves: AtomicU64,
    /// Requests started on this connection.
    requests: AtomicU64,
    /// Requests whose response hyper has not finished with (dropped) yet.
    in_flight: AtomicU32,
    /// The last write found the client's socket full: hyper still holds bytes to send.
    write_blocked: AtomicBool,
}

impl ConnectionActivity {
    fn bump(counter: &AtomicU64) {
        counter.store(
            counter.load(Ordering::Relaxed).wrapping_add(1),
            Ordering::Relaxed,
        );
    }

    fn moved(&self) {
        Self::bump(&self.moves);
    }

    fn request_started(&self) {
        Self::bump(&self.moves);
        Self::bump(&self.requests);
        let in_flight = &self.in_flight;
        in_flight.store(in_flight.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    fn request_finished(&self) {
        let in_flight = &self.in_flight;
        in_flight.store(
            in_flight.load(Ordering::Relaxed).saturating_sub(1),
            Ordering::Relaxed,
        );
    }

    fn moves(&self) -> u64 {
        self.moves.load(Ordering::Relaxed)
    }

    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) > 0 || self.write_blocked.load(Ordering::Relaxed)
    }
}

/// Decides, once per idle check, whether a connection may be parked: it has served a request
/// (hyper counts a connection as between requests only after its first one), nothing moved
/// since the previous check, no request is in flight and no response bytes wait for the
/// client. hyper is then between requests; a partial request head may sit in its buffer, and
/// is handed back.
struct IdleCheck {
    moves_at_last_check: u64,
    /// The request count once this HTTP state has served one. A connection rebuilt around a
    /// partial head thus parks again only after that request, so a client dribbling a head
    /// gets the header timeout, not a fresh one at every park.
    park_after_requests: u64,
}

impl IdleCheck {
    fn new(activity: &ConnectionActivity) -> IdleCheck {
        IdleCheck {
            moves_at_last_check: activity.moves(),
            park_after_requests: activity.requests() + 1,
        }
    }

    fn may_park(&mut self, activity: &ConnectionActivity) -> bool {
        let moves = activity.moves();
        let quiet = moves == self.moves_at_last_check;
        self.moves_at_last_check = moves;
        quiet && !activity.busy() && activity.requests() >= self.park_after_requests
    }
}

/// The client's socket, with the bytes a previous HTTP state read but did not parse put back
/// in front of it, counting what moves for the idle check.
pub(super) struct ClientIo {
    stream: TcpStream,
    replay: Bytes,
    activity: Arc<ConnectionActivity>,
}

impl AsyncRead for ClientIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if !this.replay.is_empty() {
            let n = this.replay.len().min(buf.remaining());
            buf.put_slice(&this.replay[..n]);
            this.replay.advance(n);
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.stream).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.activity.moved();
        }
        polled
    }
}

impl ClientIo {
    fn after_write(&self, polled: &Poll<io::Result<usize>>) {
        let blocked = polled.is_pending();
        self.activity
            .write_blocked
            .store(blocked, Ordering::Relaxed);
        if !blocked {
            self.activity.moved();
        }
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.after_write(&polled);
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.after_write(&polled);
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Holds a request against its connection's in-flight count until hyper drops the response
/// (the body is finished, or the connection ended).
struct RequestGuard(Arc<ConnectionActivity>);

impl RequestGuard {
    fn start(activity: &Arc<ConnectionActivity>) -> RequestGuard {
        activity.request_started();
        RequestGuard(activity.clone())
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A response body that keeps its request counted as in flight.
type TrackedBody = GuardedBody<RequestGuard>;

/// Boxed, and bound to the client: dropped unfinished, its client left (see `detach`).
type ResponseFuture =
    ClientBound<Pin<Box<dyn Future<Output = Result<Response<TrackedBody>, Infallible>> + Send>>>;

/// hyper's `poll_without_shutdown`, which hands the socket back, needs an `Unpin` request
/// future: hence the box, one per request (hyper itself keeps one place per connection).
#[derive(Clone)]
struct Http1Service {
    state: Arc<ProxyState>,
    downstream: Downstream,
    activity: Arc<ConnectionActivity>,
}

impl hyper::service::Service<Request<Incoming>> for Http1Service {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, request: Request<Incoming>) -> ResponseFuture {
        let guard = RequestGuard::start(&self.activity);
        let state = self.state.clone();
        let downstream = self.downstream.clone();
        ClientBound::new(Box::pin(async move {
            let response = forward::handle(&state, request, &downstream).await;
            Ok(response.map(|inner| GuardedBody::new(inner, guard)))
        }))
    }
}

type Connection = http1::Connection<TokioIo<ClientIo>, Http1Service>;

/// How a run of hyper over the connection ended.
enum Ended {
    /// Idle, state dropped: the socket waits for the client's next bytes.
    Parked,
    /// The client closed, keep-alive ended, or the connection was upgraded.
    Finished,
    /// No request head was completed within the header timeout.
    HeaderTimeout,
}

/// Serves one plain HTTP/1.1 client connection to its end, parking it whenever it rests.
pub(super) async fn serve(
    stream: TcpStream,
    client: SocketAddr,
    state: Arc<ProxyState>,
    builder: http1::Builder,
    settings: ParkSettings,
    watcher: Watcher,
    mut shutdown: watch::Receiver<bool>,
) {
    let activity = Arc::new(ConnectionActivity::default());
    let handoff = Arc::new(UpgradeHandoff::default());
    let service = Http1Service {
        state: state.clone(),
        downstream: Downstream::new(client, false).with_upgrade_handoff(handoff.clone()),
        activity: activity.clone(),
    };
    let mut io = ClientIo {
        stream,
        replay: Bytes::new(),
        activity: activity.clone(),
    };
    loop {
        let connection = Box::pin(builder.serve_connection(TokioIo::new(io), service.clone()));
        let check = IdleCheck::new(&activity);
        // Boxed, like the tunnel below: between requests the task keeps only the parked wait's
        // small state, not room for these.
        let driven = Box::pin(drive(
            connection,
            check,
            &activity,
            &settings,
            &mut shutdown,
        ));
        let (connection, ended) = match driven.await {
            Ok(done) => done,
            Err(error) => {
                tracing::debug!(%client, %error, "client connection ended with an error");
                return;
            }
        };
        let upgraded = match ended {
            Ended::Finished => handoff.take(),
            Ended::Parked | Ended::HeaderTimeout => None,
        };
        if matches!(ended, Ended::Finished) && upgraded.is_none() {
            // Nothing needs the socket back: dropping hyper's state closes it, and costs less
            // than taking the state apart first.
            return;
        }
        // The handed-back bytes are a view of hyper's whole read buffer: they are copied and
        // the rest of `parts` dropped here, so a parked connection holds none of it.
        io = {
            let parts = Pin::into_inner(connection).into_parts();
            let mut io = parts.io.into_inner();
            io.replay = Bytes::copy_from_slice(&parts.read_buf);
            io
        };
        let counters = &state.counters;
        if matches!(ended, Ended::Parked) {
            // Counted even when a partial request head came back and the state is rebuilt at
            // once: hyper's buffers were still given back.
            counters
                .client_connection_parks
                .fetch_add(1, Ordering::Relaxed);
        }
        match ended {
            Ended::Finished => {
                if let Some((upstream, in_flight)) = upgraded {
                    // An upgraded connection is no longer an HTTP exchange: the drain on
                    // shutdown does not wait for it (as with every other tunnel).
                    drop(watcher);
                    Box::pin(forward::tunnel(io, upstream, in_flight)).await;
                }
                return;
            }
            Ended::HeaderTimeout => {
                end_head_wait(io, client, settings.header_timeout, state.error_details).await;
                return;
            }
            Ended::Parked if !io.replay.is_empty() => continue,
            Ended::Parked => {
                let _parked = ParkedGauge::enter(&counters.parked_client_connections);
                if !bytes_arrive(&io.stream, client, settings.parked_wait, &mut shutdown).await {
                    return;
                }
            }
        }
    }
}

/// Counts a connection as parked for as long as it lives, however the wait ends.
struct ParkedGauge<'a>(&'a AtomicU64);

impl<'a> ParkedGauge<'a> {
    fn enter(gauge: &'a AtomicU64) -> ParkedGauge<'a> {
        gauge.fetch_add(1, Ordering::Relaxed);
        ParkedGauge(gauge)
    }
}

impl Drop for ParkedGauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Timing of the idle check.
#[derive(Debug, Clone, Copy)]
pub(super) struct ParkSettings {
    /// How often a connection's activity is looked at; a connection quiet for a whole period
    /// is parked, so it parks after one to two periods of rest.
    pub idle_check: Duration,
    /// How long a parked connection may wait for the client's next request.
    pub parked_wait: Duration,
    /// How long a client may take over a request head, or rest between requests without
    /// parking (before its first request on this HTTP state): enforced by the idle check.
    pub header_timeout: Duration,
}

impl ParkSettings {
    /// Parks after 0.5–1 s of rest (sooner when the header timeout is shorter): a client that
    /// sends its requests back to back keeps its HTTP state, thousands that paused give theirs
    /// back soon. The whole idle time of a keep-alive connection stays near the client header
    /// timeout hyper applies.
    pub fn for_header_timeout(client_header_timeout: Duration) -> ParkSettings {
        let idle_check = Duration::from_millis(500).min(client_header_timeout / 2);
        ParkSettings {
            idle_check,
            parked_wait: client_header_timeout.saturating_sub(idle_check),
            header_timeout: client_header_timeout,
        }
    }
}

/// The idle check's timer, looked at cheaply: the connection's task wakes for every byte that
/// moves, and polling a tokio timer each time walks its state, where seeing whether the
/// registered deadline has passed is one load.
struct IdleTicks {
    sleep: Pin<Box<Sleep>>,
    period: Duration,
    /// The sleep was polled since its last reset, so the timer wakes this task at its deadline.
    registered: bool,
}

impl IdleTicks {
    fn new(period: Duration) -> IdleTicks {
        IdleTicks {
            sleep: Box::pin(tokio::time::sleep(period)),
            period,
            registered: false,
        }
    }

    /// Ready with the time, once per period; a tick missed while the task was busy is not
    /// made up for.
    fn poll_tick(&mut self, cx: &mut Context<'_>) -> Poll<Instant> {
        if self.registered && !self.sleep.is_elapsed() {
            return Poll::Pending;
        }
        // With the task's cooperative budget spent, tokio answers Pending without registering
        // the timer (it wakes the task to try again instead): such a poll must not count as
        // registered, or the timer would never wake this task again.
        let may_register = tokio::task::coop::has_budget_remaining();
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => {
                let now = Instant::now();
                self.sleep.as_mut().reset(now + self.period);
                self.registered = false;
                Poll::Ready(now)
            }
            Poll::Pending => {
                self.registered = may_register;
                Poll::Pending
            }
        }
    }
}

/// How long the connection has waited for a request head, seen at the idle checks. hyper's
/// own header timeout would cost a timer set and cleared on every request; this costs nothing
/// between checks. The wait starts at the first check that finds no request in flight, so it is
/// never overestimated: a client gets the whole timeout, and at most one check period more.
struct HeadWait {
    since: Option<Instant>,
    requests_seen: u64,
}

impl HeadWait {
    /// For an HTTP state that starts now, with its first bytes in hand or on their way.
    fn new(activity: &ConnectionActivity, now: Instant) -> HeadWait {
        HeadWait {
            since: (!activity.busy()).then_some(now),
            requests_seen: activity.requests(),
        }
    }

    /// At an idle check: whether no request head has been completed for `timeout` while no
    /// request was in flight.
    fn timed_out(
        &mut self,
        activity: &ConnectionActivity,
        now: Instant,
        timeout: Duration,
    ) -> bool {
        let requests = activity.requests();
        let request_started = requests != self.requests_seen;
        self.requests_seen = requests;
        if activity.busy() {
            self.since = None;
            return false;
        }
        match self.since {
            Some(since) if !request_started => now.duration_since(since) >= timeout,
            _ => {
                self.since = Some(now);
                false
            }
        }
    }
}

/// Runs hyper until the connection ends, parks or runs out of time for a request head.
/// Shutdown turns keep-alive off (a request in flight finishes, then the connection closes); a
/// park attempt that finds a request begun after all does the same.
async fn drive(
    mut connection: Pin<Box<Connection>>,
    mut check: IdleCheck,
    activity: &ConnectionActivity,
    settings: &ParkSettings,
    shutdown: &mut watch::Receiver<bool>,
) -> hyper::Result<(Pin<Box<Connection>>, Ended)> {
    let mut ticks = IdleTicks::new(settings.idle_check);
    let mut head_wait = HeadWait::new(activity, Instant::now());
    let mut stop = std::pin::pin!(shutdown.wait_for(|stop| *stop));
    let mut closing = false;
    let ended = poll_fn(|cx| {
        if !closing && stop.as_mut().poll(cx).is_ready() {
            connection.as_mut().graceful_shutdown();
            closing = true;
        }
        if let Poll::Ready(result) = connection.poll_without_shutdown(cx) {
            return Poll::Ready(result.map(|()| Ended::Finished));
        }
        while let Poll::Ready(now) = ticks.poll_tick(cx) {
            if head_wait.timed_out(activity, now, settings.header_timeout) {
                // No request is in flight and hyper is reading a head: nothing of an answer
                // is left to write, so the socket can be taken back as it is.
                return Poll::Ready(Ok(Ended::HeaderTimeout));
            }
            if closing || !check.may_park(activity) {
                continue;
            }
            // Between requests hyper stops at once and hands everything back; if a request
            // did begin, keep-alive is now off and the connection closes after it.
            connection.as_mut().graceful_shutdown();
            match connection.poll_without_shutdown(cx) {
                Poll::Ready(result) => return Poll::Ready(result.map(|()| Ended::Parked)),
                Poll::Pending => closing = true,
            }
        }
        Poll::Pending
    })
    .await?;
    Ok((connection, ended))
}

/// How long the answer to a timed-out head may take to go out.
const HEAD_TIMEOUT_ANSWER_WRITE: Duration = Duration::from_secs(1);

/// Ends a connection whose client took longer than the header timeout over a request head:
/// a named 408 when part of a head had arrived, a silent close when nothing had (hyper closed
/// silently in both cases). Empty lines between requests are allowed (RFC 9112 §2.2) and are
/// not part of a head: a client that sent only those gets no unasked answer on an idle
/// keep-alive connection, which its pool could take for the answer to its next request.
async fn end_head_wait(
    mut io: ClientIo,
    client: SocketAddr,
    timeout: Duration,
    details: ErrorDetails,
) {
    if io.replay.iter().all(|&byte| byte == b'\r' || byte == b'\n') {
        return;
    }
    tracing::debug!(%client, "client took longer than the header timeout over a request head");
    let error = ProxyError::ClientHeaderTimeout {
        timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
    };
    // A few hundred bytes into a socket with nothing else in flight: the write completes at
    // once unless the client stopped reading, and it is bounded for that client.
    let answer = async {
        io.stream.write_all(&error.to_http1_close(details)).await?;
        io.stream.shutdown().await
    };
    let _ = tokio::time::timeout(HEAD_TIMEOUT_ANSWER_WRITE, answer).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_parks_only_after_a_whole_quiet_period() {
        let activity = Arc::new(ConnectionActivity::default());
        let mut check = IdleCheck::new(&activity);
        drop(RequestGuard::start(&activity));
        assert!(
            !check.may_park(&activity),
            "bytes moved since the last check"
        );
        assert!(check.may_park(&activity), "quiet for a whole period");
    }

    #[test]
    fn a_request_in_flight_or_a_blocked_write_keeps_the_connection() {
        let activity = Arc::new(ConnectionActivity::default());
        let mut check = IdleCheck::new(&activity);
        let guard = RequestGuard::start(&activity);
        assert!(!check.may_park(&activity));
        assert!(
            !check.may_park(&activity),
            "a slow upstream moves no bytes, but the request is in flight"
        );
        drop(guard);
        activity.write_blocked.store(true, Ordering::Relaxed);
        assert!(
            !check.may_park(&activity),
            "response bytes still wait for the client"
        );
        activity.write_blocked.store(false, Ordering::Relaxed);
        assert!(check.may_park(&activity));
    }

    #[test]
    fn a_connection_parks_only_once_it_served_a_request() {
        let activity = Arc::new(ConnectionActivity::default());
        drop(RequestGuard::start(&activity));
        let mut check = IdleCheck::new(&activity);
        assert!(!check.may_park(&activity));
        assert!(
            !check.may_park(&activity),
            "quiet, but this HTTP state has not served a request (a partial head may wait)"
        );
        drop(RequestGuard::start(&activity));
        assert!(!check.may_park(&activity), "the request moved");
        assert!(check.may_park(&activity));
    }

    #[test]
    fn the_head_wait_counts_only_time_without_a_request_in_flight() {
        let activity = Arc::new(ConnectionActivity::default());
        let start = Instant::now();
        let at = |millis| start + Duration::from_millis(millis);
        let timeout = Duration::from_millis(1000);
        let mut wait = HeadWait::new(&activity, start);
        assert!(!wait.timed_out(&activity, at(500), timeout));
        assert!(
            wait.timed_out(&activity, at(1000), timeout),
            "a whole timeout"
        );

        let mut wait = HeadWait::new(&activity, start);
        let guard = RequestGuard::start(&activity);
        assert!(
            !wait.timed_out(&activity, at(1500), timeout),
            "a request in flight is not waiting for a head"
        );
        drop(guard);
        assert!(
            !wait.timed_out(&activity, at(2000), timeout),
            "the wait starts again at the first check without a request in flight"
        );
        assert!(!wait.timed_out(&activity, at(2500), timeout));
        assert!(wait.timed_out(&activity, at(3000), timeout));

        let mut wait = HeadWait::new(&activity, start);
        assert!(!wait.timed_out(&activity, at(500), timeout));
        drop(RequestGuard::start(&activity));
        assert!(
            !wait.timed_out(&activity, at(1000), timeout),
            "a request came and went between checks: a new wait begins"
        );
        assert!(!wait.timed_out(&activity, at(1500), timeout));
        assert!(wait.timed_out(&activity, at(2000), timeout));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_ticks_come_once_a_period() {
        let period = Duration::from_millis(500);
        let mut ticks = IdleTicks::new(period);
        let start = Instant::now();
        let first = poll_fn(|cx| ticks.poll_tick(cx)).await;
        assert_eq!(first - start, period);
        assert!(
            poll_fn(|cx| Poll::Ready(ticks.poll_tick(cx).is_pending())).await,
            "no second tick at the same time"
        );
        let second = poll_fn(|cx| ticks.poll_tick(cx)).await;
        assert_eq!(second - first, period);
    }

    #[tokio::test(start_paused = true)]
    async fn a_tick_first_polled_without_budget_still_comes() {
        let period = Duration::from_millis(500);
        let mut ticks = IdleTicks::new(period);
        let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
        for _ in 0..1_000 {
            sender.send(()).unwrap();
        }
        poll_fn(|cx| {
            // The channel answers Pending with messages still queued once the task's
            // cooperative budget is spent: the timer is then polled without it.
            while receiver.poll_recv(cx).is_ready() {}
            assert!(!tokio::task::coop::has_budget_remaining());
            assert!(ticks.poll_tick(cx).is_pending());
            Poll::Ready(())
        })
        .await;
        let tick = tokio::time::timeout(period * 4, poll_fn(|cx| ticks.poll_tick(cx))).await;
        assert!(tick.is_ok(), "the timer was never registered");
    }

    #[test]
    fn park_settings_follow_the_header_timeout() {
        let default = ParkSettings::for_header_timeout(Duration::from_secs(30));
        assert_eq!(default.idle_check, Duration::from_millis(500));
        assert_eq!(default.parked_wait, Duration::from_millis(29_500));
        assert_eq!(default.header_timeout, Duration::from_secs(30));
        let short = ParkSettings::for_header_timeout(Duration::from_millis(600));
        assert_eq!(short.idle_check, Duration::from_millis(300));
        assert_eq!(short.parked_wait, Duration::from_millis(300));
    }
}
