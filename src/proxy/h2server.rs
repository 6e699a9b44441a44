//! HTTP/2 client connections (prior knowledge on the plain listener, ALPN `h2` on TLS). hyper
//! speaks the protocol; this driver adds what it leaves to the application:
//!
//! - a connection with no open stream and no new one for the idle timeout is closed
//!   gracefully (GOAWAY NO_ERROR), as NGINX and HAProxy do; PINGs do not count as use;
//! - a client that cancels most of the streams it opens (rapid reset, CVE-2023-44487, paced
//!   below the h2 crate's burst limit) is told GOAWAY ENHANCE_YOUR_CALM and cut off. A stream
//!   counts as cancelled when the client resets it before its answer was ready.
//!
//! hyper offers no way to send GOAWAY with an error code, so the connection's I/O does it: it
//! knows where the frames it wrote end ([`OutboundFrames`]), writes the GOAWAY at a frame
//! boundary once told the client is abusive, and then fails hyper's reads and writes.
//!
//! Nor does it tell when the h2 crate refuses a stream past `http2_max_concurrent_streams`
//! (RST_STREAM REFUSED_STREAM, sent before hyper sees the stream): the same frame tracking
//! counts those resets as they are written. On a server, h2 sends REFUSED_STREAM for nothing
//! else, and neither hyper nor Raahi resets a client's stream with it.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Request;
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::Watcher;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::detach::ClientBound;
use super::forward::{self, Downstream, GuardedBody};
use super::ProxyState;
use crate::snapshot::GatewayCounters;

/// A client is abusive once it has cancelled this many streams and more than half of all it
/// opened. A browser that cancels a few loads in flight on navigation stays far below.
const ABUSIVE_CANCELS: u64 = 100;

/// A stream reset sooner than this after it opened counts as a cancel. Rapid reset resets at
/// once; a gRPC call cancelled at its deadline during an upstream slowdown lived longer, and
/// must not get a healthy client's connection cut.
const QUICK_CANCEL: Duration = Duration::from_millis(50);

/// How long an idle connection told GOAWAY has to finish closing.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(1);

/// HTTP/2 error code ENHANCE_YOUR_CALM (RFC 9113 §7).
const ENHANCE_YOUR_CALM: u32 = 0xb;

/// HTTP/2 error code REFUSED_STREAM (RFC 9113 §7).
const REFUSED_STREAM: u32 = 0x7;

/// HTTP/2 frame type RST_STREAM (RFC 9113 §6.4).
const RST_STREAM: u8 = 0x3;

/// The streams of one connection, as its idle check and abuse check see them. Streams run on
/// tasks of their own, so these are shared atomics.
#[derive(Default)]
struct StreamCounts {
    open: AtomicU64,
    started: AtomicU64,
    cancelled: AtomicU64,
    abusive: AtomicBool,
    /// Wakes the driver when the client turned abusive, so hyper is polled and meets the I/O's
    /// GOAWAY even while it waits for nothing.
    turned_abusive: Notify,
}

impl StreamCounts {
    fn cancelled_one(&self) {
        let cancelled = self.cancelled.fetch_add(1, Ordering::Relaxed) + 1;
        let started = self.started.load(Ordering::Relaxed);
        if cancelled >= ABUSIVE_CANCELS
            && cancelled * 2 > started
            && !self.abusive.swap(true, Ordering::Relaxed)
        {
            self.turned_abusive.notify_one();
        }
    }
}

/// One stream, open from the request until hyper drops its response (finished or reset).
struct StreamGuard {
    counts: Arc<StreamCounts>,
    opened: Instant,
    answered: bool,
}

impl StreamGuard {
    fn start(counts: &Arc<StreamCounts>) -> StreamGuard {
        counts.started.fetch_add(1, Ordering::Relaxed);
        counts.open.fetch_add(1, Ordering::Relaxed);
        StreamGuard {
            counts: counts.clone(),
            opened: Instant::now(),
            answered: false,
        }
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        self.counts.open.fetch_sub(1, Ordering::Relaxed);
        if !self.answered && self.opened.elapsed() < QUICK_CANCEL {
            self.counts.cancelled_one();
        }
    }
}

/// What an HTTP/2 client connection is held to.
#[derive(Clone)]
pub(super) struct H2Settings {
    pub builder: http2::Builder<TokioExecutor>,
    pub idle_timeout: Duration,
}

/// Serves one HTTP/2 client connection to its end: the client closes it, it idles past the
/// idle timeout, the client turns abusive, or the listener shuts down (GOAWAY, streams in
/// flight finish; `watcher` keeps the listener's grace period waiting for them).
pub(super) async fn serve<I>(
    io: I,
    client: SocketAddr,
    over_tls: bool,
    state: Arc<ProxyState>,
    settings: &H2Settings,
    watcher: Watcher,
    mut shutdown: watch::Receiver<bool>,
) where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let counts = Arc::new(StreamCounts::default());
    let downstream = Downstream::new(client, over_tls);
    let service_counts = counts.clone();
    let service_state = state.clone();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        let mut guard = StreamGuard::start(&service_counts);
        let state = service_state.clone();
        let downstream = downstream.clone();
        // Boxed: hyper spawns a task per stream holding this future, and the spawn moves it
        // several times; a pointer moves cheaper than the exchange's few kilobytes of state.
        // Dropped unfinished, its client reset the stream or left (see `detach`).
        ClientBound::new(Box::pin(async move {
            let response = forward::handle(&state, request, &downstream).await;
            guard.answered = true;
            // The body keeps its stream counted as open.
            Ok::<_, Infallible>(response.map(|inner| GuardedBody::new(inner, guard)))
        }))
    });
    let io = GuardedIo {
        inner: io,
        frames: OutboundFrames::default(),
        counts: counts.clone(),
        gateway: state.counters.clone(),
        goaway: None,
    };
    let connection = settings.builder.serve_connection(TokioIo::new(io), service);
    tokio::pin!(connection);
    let check_every = (settings.idle_timeout / 4).max(Duration::from_millis(10));
    let mut idle = IdleCheck::new(&counts);
    let mut closing = false;
    let mut closing_idle = false;
    let result = loop {
        tokio::select! {
            result = connection.as_mut() => break result,
            _ = shutdown.wait_for(|stop| *stop), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
            _ = tokio::time::sleep(check_every), if !closing => {
                if idle.idle_for(&counts) >= settings.idle_timeout {
                    tracing::debug!(%client, "HTTP/2 connection idle past its timeout; closing");
                    connection.as_mut().graceful_shutdown();
                    closing = true;
                    closing_idle = true;
                }
            }
            // hyper's graceful close waits for the client's PING acknowledgement; an idle
            // client that never sends it is not waited for, unless a stream it opened meanwhile
            // is still being answered.
            _ = tokio::time::sleep(IDLE_CLOSE_GRACE), if closing_idle => {
                if counts.open.load(Ordering::Relaxed) == 0 {
                    break Ok(());
                }
            }
            // Polled again, the connection meets the GOAWAY its I/O now writes.
            _ = counts.turned_abusive.notified() => {
                state.counters.http2_calmed_connections.fetch_add(1, Ordering::Relaxed);
                // An attacker reconnecting at once would otherwise write the log: a cut-off is
                // told at most once a minute, and every one counted in /metrics.
                if warn_now() {
                    tracing::warn!(
                        %client,
                        cancelled = counts.cancelled.load(Ordering::Relaxed),
                        started = counts.started.load(Ordering::Relaxed),
                        "HTTP/2 client cancels most streams it opens (rapid reset); GOAWAY \
                         ENHANCE_YOUR_CALM; later ones count in raahi_http2_calmed_connections_total"
                    );
                } else {
                    tracing::debug!(%client, "HTTP/2 rapid reset; GOAWAY ENHANCE_YOUR_CALM");
                }
            }
        }
    };
    drop(watcher);
    if let Err(error) = result {
        tracing::debug!(%client, %error, "HTTP/2 client connection ended with an error");
    }
}

/// Whether a rapid-reset cut-off may be logged at WARN now: at most once a minute, process-wide.
fn warn_now() -> bool {
    static LAST_WARNED_MS: AtomicU64 = AtomicU64::new(0);
    let now = crate::clock::unix_ms();
    let last = LAST_WARNED_MS.load(Ordering::Relaxed);
    (last == 0 || now.saturating_sub(last) >= 60_000)
        && LAST_WARNED_MS
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// Time since the connection last had a stream open or started one, as seen at its checks:
/// a stream seen at one check counts as ending at the next, so the connection closes late
/// rather than early.
struct IdleCheck {
    started: u64,
    busy_at_last_check: bool,
    quiet_since: Instant,
}

impl IdleCheck {
    fn new(counts: &StreamCounts) -> IdleCheck {
        IdleCheck {
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

/// Where the frames written so far end: a server's side of an HTTP/2 connection is nothing but
/// frames (its preface is a SETTINGS frame), each a 9-byte header and the payload it sizes.
/// RST_STREAM payloads (one error code) are read on the way, to count refused streams.
#[derive(Default, Debug)]
struct OutboundFrames {
    header: [u8; 9],
    header_filled: usize,
    payload_left: usize,
    /// The error code of the RST_STREAM being written, as far as it went out.
    reset_code: Option<([u8; 4], usize)>,
}

impl OutboundFrames {
    /// Follows `bytes` written after the others; returns how many RST_STREAM REFUSED_STREAM
    /// frames they completed.
    fn wrote(&mut self, mut bytes: &[u8]) -> u64 {
        let mut refused = 0;
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let taken = self.payload_left.min(bytes.len());
                if let Some((code, filled)) = &mut self.reset_code {
                    let copied = (4 - *filled).min(taken);
                    code[*filled..*filled + copied].copy_from_slice(&bytes[..copied]);
                    *filled += copied;
                    if *filled == 4 {
                        refused += u64::from(u32::from_be_bytes(*code) == REFUSED_STREAM);
                        self.reset_code = None;
                    }
                }
                self.payload_left -= taken;
                bytes = &bytes[taken..];
                continue;
            }
            let taken = (9 - self.header_filled).min(bytes.len());
            self.header[self.header_filled..self.header_filled + taken]
                .copy_from_slice(&bytes[..taken]);
            self.header_filled += taken;
            bytes = &bytes[taken..];
            if self.header_filled == 9 {
                let h = self.header;
                self.payload_left =
                    usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                self.header_filled = 0;
                self.reset_code =
                    (h[3] == RST_STREAM && self.payload_left == 4).then_some(([0; 4], 0));
            }
        }
        refused
    }

    fn at_boundary(&self) -> bool {
        self.header_filled == 0 && self.payload_left == 0
    }

    /// GOAWAY naming the highest stream id there is as the last one processed: streams taken
    /// up may still be finishing upstream (see `detach`), so the client must not take any of
    /// them for unprocessed and retry it.
    fn goaway(error_code: u32) -> [u8; 17] {
        let mut frame = [0u8; 17];
        frame[..9].copy_from_slice(&[0, 0, 8, 7, 0, 0, 0, 0, 0]);
        frame[9..13].copy_from_slice(&0x7fff_ffff_u32.to_be_bytes());
        frame[13..].copy_from_slice(&error_code.to_be_bytes());
        frame
    }
}

/// The client connection's I/O under hyper: tracks frame boundaries and, once the client is
/// abusive, writes GOAWAY ENHANCE_YOUR_CALM and fails every further read and write.
struct GuardedIo<I> {
    inner: I,
    frames: OutboundFrames,
    counts: Arc<StreamCounts>,
    /// Where refused streams are counted.
    gateway: Arc<GatewayCounters>,
    /// The GOAWAY being written and how much of it went out; `None` until the client is
    /// abusive.
    goaway: Option<([u8; 17], usize)>,
}

impl<I: AsyncWrite + Unpin> GuardedIo<I> {
    /// Writes the GOAWAY (when the frames written so far end cleanly) and reports the
    /// connection over.
    fn poll_cut_off(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        if self.goaway.is_none() {
            if !self.frames.at_boundary() {
                // hyper is mid-frame on a full socket: a GOAWAY now would corrupt the stream.
                return Poll::Ready(cut_off());
            }
            self.goaway = Some((OutboundFrames::goaway(ENHANCE_YOUR_CALM), 0));
        }
        let Some((frame, sent)) = &mut self.goaway else {
            return Poll::Ready(cut_off());
        };
        while *sent < frame.len() {
            match Pin::new(&mut self.inner).poll_write(cx, &frame[*sent..]) {
                Poll::Ready(Ok(0)) | Poll::Ready(Err(_)) => return Poll::Ready(cut_off()),
                Poll::Ready(Ok(n)) => *sent += n,
                Poll::Pending => return Poll::Pending,
            }
        }
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(_) => Poll::Ready(cut_off()),
        }
    }

    fn abusive(&self) -> bool {
        self.counts.abusive.load(Ordering::Relaxed)
    }

    fn follow(&mut self, written: &[u8]) {
        let refused = self.frames.wrote(written);
        if refused > 0 {
            self.gateway
                .http2_streams_refused
                .fetch_add(refused, Ordering::Relaxed);
        }
    }
}

fn cut_off() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "client cancels most streams it opens",
    )
}

impl<I: AsyncRead + AsyncWrite + Unpin> AsyncRead for GuardedIo<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.abusive() {
            return self.poll_cut_off(cx).map(Err);
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for GuardedIo<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.abusive() {
            return self.poll_cut_off(cx).map(Err);
        }
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(written)) = polled {
            this.follow(&buf[..written]);
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.abusive() {
            return self.poll_cut_off(cx).map(Err);
        }
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(mut written)) = polled {
            for buf in bufs {
                let taken = written.min(buf.len());
                this.follow(&buf[..taken]);
                written -= taken;
                if written == 0 {
                    break;
                }
            }
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let length = payload.len() as u32;
        let mut bytes = length.to_be_bytes()[1..].to_vec();
        bytes.push(kind);
        bytes.push(0);
        bytes.extend_from_slice(&stream.to_be_bytes());
        bytes.extend_from_slice(payload);
        bytes
    }

    #[test]
    fn frame_boundaries_are_followed_across_split_writes() {
        let mut wire = frame(4, 0, &[0; 12]); // SETTINGS
        wire.extend(frame(1, 7, b"head")); // HEADERS
        wire.extend(frame(0, 7, &[1; 300])); // DATA
        wire.extend(frame(3, 9, &[0; 4])); // RST_STREAM
        wire.extend(frame(8, 0, &[0; 4])); // WINDOW_UPDATE on the connection
        for split in [1, 2, 5, 9, 10, 64, wire.len()] {
            let mut frames = OutboundFrames::default();
            let mut boundaries = 0;
            for chunk in wire.chunks(split) {
                frames.wrote(chunk);
                boundaries += usize::from(frames.at_boundary());
            }
            assert!(frames.at_boundary(), "split {split}");
            assert!(boundaries >= 1);
        }
        let mut frames = OutboundFrames::default();
        frames.wrote(&wire[..wire.len() - 2]);
        assert!(!frames.at_boundary(), "mid-frame");
    }

    #[test]
    fn refused_stream_resets_are_counted_across_split_writes() {
        let mut wire = frame(4, 0, &[0; 6]); // SETTINGS
        wire.extend(frame(3, 5, &REFUSED_STREAM.to_be_bytes()));
        wire.extend(frame(3, 7, &8u32.to_be_bytes())); // CANCEL
        wire.extend(frame(0, 1, &[0, 0, 0, 7])); // DATA that looks like the code
        wire.extend(frame(3, 9, &REFUSED_STREAM.to_be_bytes()));
        for split in [1, 2, 3, 9, 11, 13, wire.len()] {
            let mut frames = OutboundFrames::default();
            let refused: u64 = wire.chunks(split).map(|chunk| frames.wrote(chunk)).sum();
            assert_eq!(refused, 2, "split {split}");
        }
    }

    #[test]
    fn the_goaway_claims_every_stream_and_names_the_code() {
        let goaway = OutboundFrames::goaway(ENHANCE_YOUR_CALM);
        assert_eq!(&goaway[..9], &[0, 0, 8, 7, 0, 0, 0, 0, 0]);
        assert_eq!(
            u32::from_be_bytes(goaway[9..13].try_into().unwrap()),
            0x7fff_ffff
        );
        assert_eq!(u32::from_be_bytes(goaway[13..].try_into().unwrap()), 0xb);
    }

    #[test]
    fn a_client_is_abusive_once_it_cancels_most_of_many_streams() {
        let counts = Arc::new(StreamCounts::default());
        // 150 answered, then 99 cancelled: not yet.
        for _ in 0..150 {
            StreamGuard::start(&counts).answered = true;
        }
        for _ in 0..99 {
            drop(StreamGuard::start(&counts));
        }
        assert!(!counts.abusive.load(Ordering::Relaxed));
        // 100 cancelled out of 250: fewer than half.
        drop(StreamGuard::start(&counts));
        assert!(!counts.abusive.load(Ordering::Relaxed));
        for _ in 0..60 {
            drop(StreamGuard::start(&counts));
        }
        assert!(
            counts.abusive.load(Ordering::Relaxed),
            "past half: 155 of 305"
        );
        assert_eq!(counts.open.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn only_quick_cancels_count_toward_abuse() {
        let counts = Arc::new(StreamCounts::default());
        // Calls cancelled at a 100 ms deadline, say during an upstream slowdown.
        for _ in 0..200 {
            let stream = StreamGuard::start(&counts);
            tokio::time::advance(Duration::from_millis(100)).await;
            drop(stream);
        }
        assert_eq!(counts.cancelled.load(Ordering::Relaxed), 0);
        assert!(!counts.abusive.load(Ordering::Relaxed));
        for _ in 0..201 {
            drop(StreamGuard::start(&counts));
        }
        assert!(
            counts.abusive.load(Ordering::Relaxed),
            "201 of 401 reset at once"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn idle_time_counts_from_the_last_stream() {
        let counts = Arc::new(StreamCounts::default());
        let mut idle = IdleCheck::new(&counts);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(idle.idle_for(&counts), Duration::from_secs(5));
        let open = StreamGuard::start(&counts);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(idle.idle_for(&counts), Duration::ZERO, "a stream is open");
        tokio::time::advance(Duration::from_secs(5)).await;
        drop(open);
        assert_eq!(idle.idle_for(&counts), Duration::ZERO, "it started since");
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(idle.idle_for(&counts), Duration::from_secs(3));
    }
}
