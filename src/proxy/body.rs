//! Body wrappers on the forwarding path.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use tokio::sync::{oneshot, Notify};

use super::accounting::InFlight;
use super::h1client::ResponseBody;
use crate::clock::unix_ms;

/// A response body from a target: read by hyper's client (`https` targets) or straight off a
/// plain target's pooled connection, which goes back to its pool at the body's end.
pub enum UpstreamBody {
    Hyper(Incoming),
    Pooled(ResponseBody),
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            UpstreamBody::Hyper(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            UpstreamBody::Pooled(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Hyper(body) => body.is_end_stream(),
            UpstreamBody::Pooled(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Hyper(body) => body.size_hint(),
            UpstreamBody::Pooled(body) => body.size_hint(),
        }
    }
}

/// The upstream response body, holding the target's in-flight count until it ends.
pub struct UpstreamResponseBody {
    inner: UpstreamBody,
    _in_flight: InFlight,
}

impl UpstreamResponseBody {
    pub fn new(inner: UpstreamBody, in_flight: InFlight) -> Self {
        UpstreamResponseBody {
            inner,
            _in_flight: in_flight,
        }
    }
}

impl Body for UpstreamResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The request body sent upstream. A streaming body that the upstream client never started to
/// read (the connection failed first) is handed back, so the request can go to another target.
pub enum UpstreamRequestBody {
    Empty,
    Streaming(UntouchedBody),
}

pub struct UntouchedBody {
    inner: Option<Incoming>,
    polled: bool,
    give_back: Option<oneshot::Sender<Incoming>>,
    /// Told when the last byte has been handed to the upstream connection.
    sent: Arc<Notify>,
    /// Set when reading the client's body failed (the client went away mid-upload).
    failed: Arc<AtomicBool>,
    progress: Arc<BodyProgress>,
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
    pub returned: oneshot::Receiver<Incoming>,
    /// Notified once the whole body has been sent.
    pub sent: Arc<Notify>,
    /// The client's side failed, not the upstream's.
    pub failed: Arc<AtomicBool>,
    pub progress: Arc<BodyProgress>,
}

impl UpstreamRequestBody {
    /// Wraps `body`; the receiver yields it back if it is dropped before its first read.
    pub fn streaming(body: Incoming) -> (UpstreamRequestBody, StreamingBody) {
        let (give_back, returned) = oneshot::channel();
        let sent = Arc::new(Notify::new());
        let failed = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(BodyProgress::started(unix_ms()));
        let body = UntouchedBody {
            inner: Some(body),
            polled: false,
            give_back: Some(give_back),
            sent: sent.clone(),
            failed: failed.clone(),
            progress: progress.clone(),
        };
        (
            UpstreamRequestBody::Streaming(body),
            StreamingBody {
                returned,
                sent,
                failed,
                progress,
            },
        )
    }
}

impl Drop for UntouchedBody {
    fn drop(&mut self) {
        if self.polled {
            return;
        }
        if let (Some(body), Some(give_back)) = (self.inner.take(), self.give_back.take()) {
            let _ = give_back.send(body);
        }
    }
}

impl Body for UpstreamRequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match &mut *self {
            UpstreamRequestBody::Empty => Poll::Ready(None),
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
                    Poll::Ready(Some(Err(_))) => {
                        body.failed.store(true, Ordering::Relaxed);
                        true
                    }
                    Poll::Ready(None) => true,
                    Poll::Pending => false,
                };
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
            UpstreamRequestBody::Streaming(body) => {
                body.inner.as_ref().is_none_or(Body::is_end_stream)
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamRequestBody::Empty => SizeHint::with_exact(0),
            UpstreamRequestBody::Streaming(body) => body
                .inner
                .as_ref()
                .map(Body::size_hint)
                .unwrap_or_else(|| SizeHint::with_exact(0)),
        }
    }
}
