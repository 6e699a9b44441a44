//! Watches the frames an HTTP/2 target sends, without parsing them for h2: the h2 crate tells a
//! client neither that a GOAWAY came nor its last stream id, and would go on opening streams on
//! a connection the target has stopped taking new ones on (they would hang until it closes).
//! Reading the 9-byte frame headers as the bytes pass costs a few comparisons per frame.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

const FRAME_HEADER: usize = 9;
const SETTINGS: u8 = 0x4;
const SETTINGS_ACK: u8 = 0x1;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;
/// A setting is a 16-bit id and a 32-bit value.
const SETTING: usize = 6;
const GOAWAY: u8 = 0x7;
/// A GOAWAY payload starts with the last stream id and the error code.
const GOAWAY_FIXED: usize = 8;

/// What the connection's reader saw, shared with the pool and the keep-alive watch.
#[derive(Debug)]
pub struct Seen {
    /// The lowest last-stream-id of any GOAWAY received; `u32::MAX` before the first.
    goaway_last_stream: AtomicU32,
    /// The error code of the last GOAWAY received.
    goaway_code: AtomicU32,
    going_away: AtomicBool,
    /// The target's `SETTINGS_MAX_CONCURRENT_STREAMS`; `u32::MAX` until it sends one.
    max_concurrent_streams: AtomicU32,
    /// Its first SETTINGS frame came: what it did not set there is unlimited.
    settings_seen: AtomicBool,
    /// Milliseconds after `start` when bytes last arrived.
    last_read_ms: AtomicU64,
    start: Instant,
}

impl Seen {
    pub fn new() -> Seen {
        Seen {
            goaway_last_stream: AtomicU32::new(u32::MAX),
            goaway_code: AtomicU32::new(0),
            going_away: AtomicBool::new(false),
            max_concurrent_streams: AtomicU32::new(u32::MAX),
            settings_seen: AtomicBool::new(false),
            last_read_ms: AtomicU64::new(0),
            start: Instant::now(),
        }
    }

    /// The target said it takes no new streams.
    pub fn going_away(&self) -> bool {
        self.going_away.load(Ordering::Acquire)
    }

    /// Whether a stream with this id was never processed by the target: it is above the last
    /// stream id of a GOAWAY (RFC 9113 §6.8), so it may go anywhere else whatever its method.
    pub fn unprocessed(&self, stream_id: u32) -> bool {
        self.going_away() && stream_id > self.goaway_last_stream.load(Ordering::Acquire)
    }

    /// The streams the target takes at once, once its SETTINGS came (h2 learns it at the
    /// same moment, from the same frame).
    pub fn max_concurrent_streams(&self) -> Option<u32> {
        self.settings_seen
            .load(Ordering::Acquire)
            .then(|| self.max_concurrent_streams.load(Ordering::Acquire))
    }

    pub fn goaway_code(&self) -> u32 {
        self.goaway_code.load(Ordering::Acquire)
    }

    /// Milliseconds since bytes last came from the target.
    pub fn silent_for_ms(&self) -> u64 {
        self.now_ms()
            .saturating_sub(self.last_read_ms.load(Ordering::Relaxed))
    }

    pub fn now_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn read_something(&self) {
        self.last_read_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    fn setting(&self, id: u16, value: u32) {
        if id == SETTINGS_MAX_CONCURRENT_STREAMS {
            self.max_concurrent_streams.store(value, Ordering::Release);
        }
    }

    fn settings_end(&self) {
        self.settings_seen.store(true, Ordering::Release);
    }

    fn goaway(&self, last_stream: u32, code: u32) {
        self.goaway_last_stream
            .fetch_min(last_stream & 0x7fff_ffff, Ordering::AcqRel);
        self.goaway_code.store(code, Ordering::Release);
        self.going_away.store(true, Ordering::Release);
    }
}

/// Where the reader is in the frame sequence.
#[derive(Debug, Default)]
pub struct FrameTracker {
    header: [u8; FRAME_HEADER],
    header_len: usize,
    /// Bytes of the current frame's payload still to pass.
    payload_left: usize,
    /// The current frame is a GOAWAY: its first bytes are kept here.
    goaway: Option<([u8; GOAWAY_FIXED], usize)>,
    /// The current frame is a SETTINGS frame: the setting being read.
    setting: Option<([u8; SETTING], usize)>,
}

impl FrameTracker {
    /// Takes the next bytes read from the target.
    pub fn feed(&mut self, mut bytes: &[u8], seen: &Seen) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let take = self.payload_left.min(bytes.len());
                if let Some((entry, have)) = &mut self.setting {
                    let mut rest = &bytes[..take];
                    while !rest.is_empty() {
                        let wanted = (SETTING - *have).min(rest.len());
                        entry[*have..*have + wanted].copy_from_slice(&rest[..wanted]);
                        *have += wanted;
                        rest = &rest[wanted..];
                        if *have == SETTING {
                            let id = u16::from_be_bytes([entry[0], entry[1]]);
                            let value =
                                u32::from_be_bytes([entry[2], entry[3], entry[4], entry[5]]);
                            seen.setting(id, value);
                            *have = 0;
                        }
                    }
                    if self.payload_left == take {
                        seen.settings_end();
                        self.setting = None;
                    }
                }
                if let Some((fixed, have)) = &mut self.goaway {
                    let wanted = (GOAWAY_FIXED - *have).min(take);
                    fixed[*have..*have + wanted].copy_from_slice(&bytes[..wanted]);
                    *have += wanted;
                    if *have == GOAWAY_FIXED {
                        let last = u32::from_be_bytes([fixed[0], fixed[1], fixed[2], fixed[3]]);
                        let code = u32::from_be_bytes([fixed[4], fixed[5], fixed[6], fixed[7]]);
                        seen.goaway(last, code);
                        self.goaway = None;
                    }
                }
                self.payload_left -= take;
                bytes = &bytes[take..];
                continue;
            }
            let wanted = (FRAME_HEADER - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + wanted]
                .copy_from_slice(&bytes[..wanted]);
            self.header_len += wanted;
            bytes = &bytes[wanted..];
            if self.header_len < FRAME_HEADER {
                return;
            }
            self.header_len = 0;
            let length = usize::from(self.header[0]) << 16
                | usize::from(self.header[1]) << 8
                | usize::from(self.header[2]);
            self.payload_left = length;
            // A GOAWAY shorter than its fixed part is a protocol error h2 reports itself.
            let kind = self.header[3];
            self.goaway =
                (kind == GOAWAY && length >= GOAWAY_FIXED).then_some(([0; GOAWAY_FIXED], 0));
            let settings = kind == SETTINGS && self.header[4] & SETTINGS_ACK == 0;
            self.setting = settings.then_some(([0; SETTING], 0));
            if settings && length == 0 {
                seen.settings_end();
                self.setting = None;
            }
        }
    }
}

/// A transport whose reads pass through a [`FrameTracker`].
pub struct Sniffed<T> {
    inner: T,
    tracker: FrameTracker,
    seen: std::sync::Arc<Seen>,
}

impl<T> Sniffed<T> {
    pub fn new(inner: T, seen: std::sync::Arc<Seen>) -> Sniffed<T> {
        Sniffed {
            inner,
            tracker: FrameTracker::default(),
            seen,
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Sniffed<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = result {
            let read = &buf.filled()[before..];
            if !read.is_empty() {
                this.seen.read_something();
                this.tracker.feed(read, &this.seen);
            }
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Sniffed<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut bytes = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            0,
            0,
            0,
            0,
            0,
        ];
        bytes.extend_from_slice(payload);
        bytes
    }

    fn goaway(last: u32, code: u32, debug: &[u8]) -> Vec<u8> {
        let mut payload = last.to_be_bytes().to_vec();
        payload.extend_from_slice(&code.to_be_bytes());
        payload.extend_from_slice(debug);
        frame(GOAWAY, &payload)
    }

    /// SETTINGS, DATA whose payload looks like a GOAWAY header, then a real GOAWAY.
    fn conversation() -> Vec<u8> {
        let mut wire = frame(0x4, &[0, 3, 0, 0, 0, 10]);
        wire.extend(frame(0x0, &goaway(1, 2, b"not a frame")));
        wire.extend(goaway(7, 0, b"bye"));
        wire
    }

    #[tokio::test]
    async fn a_goaway_is_seen_with_its_last_stream_and_code() {
        let seen = Seen::new();
        let mut tracker = FrameTracker::default();
        tracker.feed(&conversation(), &seen);
        assert!(seen.going_away());
        assert_eq!(seen.goaway_code(), 0);
        assert_eq!(seen.max_concurrent_streams(), Some(10));
        assert!(!seen.unprocessed(7), "stream 7 may have been processed");
        assert!(seen.unprocessed(9));
    }

    #[tokio::test]
    async fn data_that_looks_like_a_goaway_is_not_one() {
        let seen = Seen::new();
        let mut tracker = FrameTracker::default();
        tracker.feed(&frame(0x0, &goaway(1, 2, b"")), &seen);
        assert!(!seen.going_away());
        assert!(!seen.unprocessed(u32::MAX >> 1));
    }

    #[tokio::test]
    async fn settings_without_a_stream_limit_mean_unlimited_and_acks_are_not_settings() {
        let seen = Seen::new();
        let mut tracker = FrameTracker::default();
        assert_eq!(seen.max_concurrent_streams(), None, "not known yet");
        let ack = {
            let mut frame = frame(SETTINGS, &[]);
            frame[4] = SETTINGS_ACK;
            frame
        };
        tracker.feed(&ack, &seen);
        assert_eq!(seen.max_concurrent_streams(), None);
        // INITIAL_WINDOW_SIZE only.
        tracker.feed(&frame(SETTINGS, &[0, 4, 0, 1, 0, 0]), &seen);
        assert_eq!(seen.max_concurrent_streams(), Some(u32::MAX));
        tracker.feed(&frame(SETTINGS, &[0, 3, 0, 0, 0, 0]), &seen);
        assert_eq!(seen.max_concurrent_streams(), Some(0));
    }

    #[tokio::test]
    async fn a_later_goaway_never_raises_the_last_stream() {
        let seen = Seen::new();
        let mut tracker = FrameTracker::default();
        tracker.feed(&goaway(5, 0, b""), &seen);
        tracker.feed(&goaway(9, 11, b""), &seen);
        assert!(seen.unprocessed(7));
        assert_eq!(seen.goaway_code(), 11);
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]
        /// However the reads split the bytes, the same GOAWAY is seen.
        #[test]
        fn any_split_of_the_reads_sees_the_same(cuts in proptest::collection::vec(0usize..64, 0..12)) {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let _guard = runtime.enter();
            let wire = conversation();
            let seen = Seen::new();
            let mut tracker = FrameTracker::default();
            let mut at = 0;
            for cut in cuts {
                let end = (at + cut).min(wire.len());
                tracker.feed(&wire[at..end], &seen);
                at = end;
            }
            tracker.feed(&wire[at..], &seen);
            prop_assert!(seen.going_away());
            prop_assert_eq!(seen.max_concurrent_streams(), Some(10));
            prop_assert!(!seen.unprocessed(7));
            prop_assert!(seen.unprocessed(9));
        }
    }
}
