//! Request bodies on the forwarding path: the client's as it is read, held or streamed, and
//! what is sent upstream. Below the upstream codecs, which name it; the response side is in
//! `response_body.rs`.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::{oneshot, Notify};

use super::budget::Reservation;
use super::replay::{BodyCopy, KeepCopy};
use super::spool::{SpoolReader, SpooledBody};
use crate::clock::unix_ms;

/// Why reading the client's request body failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientBodyError {
    #[error(transparent)]
    Read(#[from] hyper::Error),
    #[error("the request body is larger than the {limit} bytes the route accepts")]
    TooLarge { limit: u64 },
    /// The gateway's own spool file could not be read back.
    #[error("reading the spooled request body failed: {0}")]
    Spool(std::io::Error),
}

/// The client's request body as it streams up: what was read ahead of the upload, then the
/// rest as the client sends it, held to the route's size limit.
pub struct ClientBody {
    read_ahead: VecDeque<Bytes>,
    /// The buffer budget the read-ahead bytes hold, given back once they are sent.
    reservation: Option<Reservation>,
    rest: Incoming,
    limit: Option<u64>,
    /// Bytes of the body so far, read ahead or streamed.
    seen: u64,
}

impl ClientBody {
    pub fn new(
        read_ahead: Vec<Bytes>,
        reservation: Option<Reservation>,
        rest: Incoming,
        limit: Option<u64>,
    ) -> ClientBody {
        let seen = read_ahead.iter().map(|chunk| chunk.len() as u64).sum();
        ClientBody {
            read_ahead: read_ahead.into(),
            reservation,
            rest,
            limit,
            seen,
        }
    }

    /// The body streams from its start.
    pub fn streaming(rest: Incoming, limit: Option<u64>) -> ClientBody {
        ClientBody::new(Vec::new(), None, rest, limit)
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = &mut *self;
        if let Some(chunk) = this.read_ahead.pop_front() {
            if this.read_ahead.is_empty() {
                this.reservation = None;
            }
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        let frame = match ready!(Pin::new(&mut this.rest).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(error)) => return Poll::Ready(Some(Err(error.into()))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref() {
            this.seen += data.len() as u64;
            if let Some(limit) = this.limit.filter(|limit| this.seen > *limit) {
                return Poll::Ready(Some(Err(ClientBodyError::TooLarge { limit })));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.read_ahead.is_empty() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let ahead: u64 = self.read_ahead.iter().map(|chunk| chunk.len() as u64).sum();
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + ahead);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + ahead);
        }
        hint
    }
}

/// A request body read whole before a target was picked: the same bytes go to every attempt,
/// so a request with a body may be retried like one without. Held in memory, or in a spool
/// file when it was too large for memory.
#[derive(Clone)]
pub struct BufferedBody {
    content: HeldContent,
    trailers: Option<HeaderMap>,
}

#[derive(Clone)]
enum HeldContent {
    Memory {
        data: Bytes,
        /// Held while any attempt still has the bytes.
        _reservation: Arc<Reservation>,
    },
    /// A streamed body kept as it went to a first attempt (see `replay`).
    Pieces {
        pieces: Arc<[Bytes]>,
        /// Their bytes together.
        length: u64,
        _reservation: Arc<Reservation>,
    },
    Spooled(SpooledBody),
}

impl BufferedBody {
    pub fn in_memory(
        data: Bytes,
        trailers: Option<HeaderMap>,
        reservation: Reservation,
    ) -> BufferedBody {
        BufferedBody {
            content: HeldContent::Memory {
                data,
                _reservation: Arc::new(reservation),
            },
            trailers,
        }
    }

    pub fn spooled(body: SpooledBody, trailers: Option<HeaderMap>) -> BufferedBody {
        BufferedBody {
            content: HeldContent::Spooled(body),
            trailers,
        }
    }

    /// A body held as the `pieces` it came in, `length` bytes together; one piece (or none)
    /// is held like a body read ahead.
    pub(super) fn pieces(
        mut pieces: Vec<Bytes>,
        length: u64,
        trailers: Option<HeaderMap>,
        reservation: Reservation,
    ) -> BufferedBody {
        if pieces.len() <= 1 {
            let data = pieces.pop().unwrap_or_default();
            return BufferedBody::in_memory(data, trailers, reservation);
        }
        BufferedBody {
            content: HeldContent::Pieces {
                pieces: pieces.into(),
                length,
                _reservation: Arc::new(reservation),
            },
            trailers,
        }
    }
}

/// The request body sent upstream. A streaming body that the upstream client never started to
/// read (the connection failed first) is handed back, so the request can go to another target.
pub enum UpstreamRequestBody {
    Empty,
    Buffered {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
        _reservation: Arc<Reservation>,
    },
    /// Held in memory in several pieces, each sent as a data frame of its own.
    Pieces {
        pieces: Arc<[Bytes]>,
        /// The next piece to send.
        next: usize,
        /// Bytes of the pieces not sent yet.
        remaining: u64,
        trailers: Option<HeaderMap>,
        _reservation: Arc<Reservation>,
    },
    Spooled {
        reader: SpoolReader,
        trailers: Option<HeaderMap>,
    },
    Streaming(UntouchedBody),
}

impl UpstreamRequestBody {
    pub fn buffered(body: &BufferedBody) -> UpstreamRequestBody {
        let trailers = body.trailers.clone();
        match &body.content {
            HeldContent::Memory { data, _reservation } => UpstreamRequestBody::Buffered {
                data: Some(data.clone()).filter(|data| !data.is_empty()),
                trailers,
                _reservation: _reservation.clone(),
            },
            HeldContent::Pieces {
                pieces,
                length,
                _reservation,
            } => UpstreamRequestBody::Pieces {
                pieces: pieces.clone(),
                next: 0,
                remaining: *length,
                trailers,
                _reservation: _reservation.clone(),
            },
            HeldContent::Spooled(spooled) => UpstreamRequestBody::Spooled {
                reader: spooled.reader(),
                trailers,
            },
        }
    }
}

pub struct UntouchedBody {
    inner: Option<ClientBody>,
    polled: bool,
    give_back: Option<oneshot::Sender<ClientBody>>,
    /// Told when the last byte has been handed to the upstream connection.
    sent: Arc<Notify>,
    /// Set when reading the client's body failed (the client went away mid-upload).
    failed: Arc<AtomicBool>,
    /// Set when the body went past the route's size limit.
    too_large: Arc<AtomicBool>,
    progress: Arc<BodyProgress>,
    /// What went up so far, kept for a retry to send again (`streaming_kept`).
    copy: Option<Box<BodyCopy>>,
}

/// How a streaming upload moves, to tell a stalled upload from a slow one and say who stalls.
#[derive(Debug, Default)]
pub struct BodyProgress {
    /// Unix ms when a chunk last moved (or the upload started).
    last_moved_ms: AtomicU64,
    /// The upstream asked for more and the client has not sent it yet.
    waiting_on_client: AtomicBool,
}

impl BodyProgress {
    fn started(now_ms: u64) -> BodyProgress {
        BodyProgress {
            last_moved_ms: AtomicU64::new(now_ms),
            waiting_on_client: AtomicBool::new(false),
        }
    }

    pub fn last_moved_ms(&self) -> u64 {
        self.last_moved_ms.load(Ordering::Relaxed)
    }

    pub fn waiting_on_client(&self) -> bool {
        self.waiting_on_client.load(Ordering::Relaxed)
    }
}

/// The caller's side of a streaming request body.
pub struct StreamingBody {
    /// Yields the body back if the attempt dropped it unread.
    pub returned: oneshot::Receiver<ClientBody>,
    /// Notified once the whole body has been sent.
    pub sent: Arc<Notify>,
    /// The client's side failed, not the upstream's.
    pub failed: Arc<AtomicBool>,
    /// The client's body went past the route's size limit.
    pub too_large: Arc<AtomicBool>,
    pub progress: Arc<BodyProgress>,
    /// Where the copy of a body streamed with `streaming_kept` is left once it ended whole.
    kept: Option<Arc<OnceLock<BufferedBody>>>,
}

impl StreamingBody {
    /// The whole body as it went up, to send again like a body read ahead: only when it was
    /// streamed with a copy kept (`UpstreamRequestBody::streaming_kept`), reached its end, and
    /// stayed within the copy's cap and the buffer budget. The body holds its budget share
    /// until it and its clones are gone.
    pub fn kept_whole(&self) -> Option<BufferedBody> {
        self.kept.as_ref()?.get().cloned()
    }
}

impl UpstreamRequestBody {
    /// Wraps `body`; the receiver yields it back if it is dropped before its first read. With
    /// `keep`, a copy of what goes up is kept (see `replay`) for
    /// [`StreamingBody::kept_whole`].
    pub fn streaming_kept(
        body: ClientBody,
        keep: Option<KeepCopy>,
    ) -> (UpstreamRequestBody, StreamingBody) {
        let (copy, kept) = match keep {
            Some(keep) => {
                let kept = Arc::new(OnceLock::new());
                (
                    Some(Box::new(BodyCopy::new(keep, kept.clone()))),
                    Some(kept),
                )
            }
            None => (None, None),
        };
        let (give_back, returned) = oneshot::channel();
        let sent = Arc::new(Notify::new());
        let failed = Arc::new(AtomicBool::new(false));
        let too_large = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(BodyProgress::started(unix_ms()));
        let body = UntouchedBody {
            inner: Some(body),
            polled: false,
            give_back: Some(give_back),
            sent: sent.clone(),
            failed: failed.clone(),
            too_large: too_large.clone(),
            progress: progress.clone(),
            copy,
        };
        (
            UpstreamRequestBody::Streaming(body),
            StreamingBody {
                returned,
                sent,
                failed,
                too_large,
                progress,
                kept,
            },
        )
    }
}

impl Drop for UntouchedBody {
    fn drop(&mut self) {
        if self.polled {
            if let (Some(copy), Some(inner)) = (self.copy.take(), self.inner.as_mut()) {
                copy.finish_if_ended(inner);
            }
            return;
        }
        if let (Some(body), Some(give_back)) = (self.inner.take(), self.give_back.take()) {
            let _ = give_back.send(body);
        }
    }
}

impl Body for UpstreamRequestBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        match &mut *self {
            UpstreamRequestBody::Empty => Poll::Ready(None),
            UpstreamRequestBody::Buffered { data, trailers, .. } => {
                Poll::Ready(match data.take() {
                    Some(data) => Some(Ok(Frame::data(data))),
                    None => trailers
                        .take()
                        .map(|trailers| Ok(Frame::trailers(trailers))),
                })
            }
            UpstreamRequestBody::Pieces {
                pieces,
                next,
                remaining,
                trailers,
                ..
            } => Poll::Ready(match pieces.get(*next) {
                Some(piece) => {
                    *next += 1;
                    *remaining -= piece.len() as u64;
                    Some(Ok(Frame::data(piece.clone())))
                }
                None => trailers
                    .take()
                    .map(|trailers| Ok(Frame::trailers(trailers))),
            }),
            UpstreamRequestBody::Spooled { reader, trailers } => {
                Poll::Ready(match ready!(reader.poll_chunk(cx)) {
                    Some(Ok(data)) => Some(Ok(Frame::data(data))),
                    Some(Err(error)) => Some(Err(ClientBodyError::Spool(error))),
                    None => trailers
                        .take()
                        .map(|trailers| Ok(Frame::trailers(trailers))),
                })
            }
            UpstreamRequestBody::Streaming(body) => {
                body.polled = true;
                let Some(inner) = body.inner.as_mut() else {
                    return Poll::Ready(None);
                };
                let polled = Pin::new(&mut *inner).poll_frame(cx);
                let waiting = polled.is_pending();
                body.progress
                    .waiting_on_client
                    .store(waiting, Ordering::Relaxed);
                if !waiting {
                    body.progress
                        .last_moved_ms
                        .store(unix_ms(), Ordering::Relaxed);
                }
                let finished = match &polled {
                    Poll::Ready(Some(Ok(_))) => inner.is_end_stream(),
                    Poll::Ready(Some(Err(error))) => {
                        let flag = match error {
                            ClientBodyError::TooLarge { .. } => &body.too_large,
                            ClientBodyError::Read(_) | ClientBodyError::Spool(_) => &body.failed,
                        };
                        flag.store(true, Ordering::Relaxed);
                        true
                    }
                    Poll::Ready(None) => true,
                    Poll::Pending => false,
                };
                if let Some(copy) = body.copy.as_deref_mut() {
                    let kept = match &polled {
                        Poll::Ready(Some(Ok(frame))) => copy.keep(frame),
                        Poll::Ready(Some(Err(_))) => false,
                        Poll::Ready(None) | Poll::Pending => true,
                    };
                    if !kept {
                        body.copy = None;
                    } else if finished {
                        if let Some(copy) = body.copy.take() {
                            copy.finish();
                        }
                    }
                }
                if finished {
                    body.sent.notify_one();
                }
                polled
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamRequestBody::Empty => true,
            UpstreamRequestBody::Buffered { data, trailers, .. } => {
                data.is_none() && trailers.is_none()
            }
            UpstreamRequestBody::Pieces {
                pieces,
                next,
                trailers,
                ..
            } => *next == pieces.len() && trailers.is_none(),
            UpstreamRequestBody::Spooled { reader, trailers } => {
                reader.remaining() == 0 && trailers.is_none()
            }
            UpstreamRequestBody::Streaming(body) => {
                body.inner.as_ref().is_none_or(Body::is_end_stream)
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamRequestBody::Empty => SizeHint::with_exact(0),
            UpstreamRequestBody::Buffered { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |data| data.len() as u64))
            }
            UpstreamRequestBody::Pieces { remaining, .. } => SizeHint::with_exact(*remaining),
            UpstreamRequestBody::Spooled { reader, .. } => SizeHint::with_exact(reader.remaining()),
            UpstreamRequestBody::Streaming(body) => body
                .inner
                .as_ref()
                .map(Body::size_hint)
                .unwrap_or_else(|| SizeHint::with_exact(0)),
        }
    }
}
