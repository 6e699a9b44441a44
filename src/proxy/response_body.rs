//! Response bodies on the forwarding path: a target's body, whichever client read it, and the
//! wrapper that holds its in-flight count and reports how it ended.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use super::accounting::{Answering, InFlight};
use super::h1client::ResponseBody;
use super::h2client::H2ResponseBody;

/// A response body from a target: read by hyper's client (`https` targets) or straight off a
/// plain target's pooled connection, which goes back to its pool at the body's end.
pub enum UpstreamBody {
    Hyper(Incoming),
    Pooled(ResponseBody),
    H2(H2ResponseBody),
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
            UpstreamBody::H2(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            UpstreamBody::Hyper(body) => body.is_end_stream(),
            UpstreamBody::Pooled(body) => body.is_end_stream(),
            UpstreamBody::H2(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            UpstreamBody::Hyper(body) => body.size_hint(),
            UpstreamBody::Pooled(body) => body.size_hint(),
            UpstreamBody::H2(body) => body.size_hint(),
        }
    }
}

/// The upstream response body, holding the target's in-flight count until it ends.
///
/// A body that fails (the target closed mid-way, a broken chunk, a trailer section over the
/// limit) is logged and counted against its target, and the failure reaches the server one
/// poll late: hyper's HTTP/1.1 server drops what it has buffered when a body fails, so without
/// a pause in between, a head and data read together with the failure would never reach the
/// client, which would lose an answer already begun rather than get it cut short.
///
/// A gRPC answer's trailers are read on the way: `grpc-status` 14 (UNAVAILABLE) counts against
/// the target like a 503, and whoever waits for the end (the access line) is told the status.
pub struct UpstreamResponseBody {
    inner: UpstreamBody,
    _in_flight: InFlight,
    answering: Answering,
    held: Option<BoxError>,
    grpc: bool,
    grpc_status: Option<u16>,
    /// Data bytes passed on so far.
    sent: u64,
    at_end: Option<AtEnd>,
}

/// How an answer's body ended, for whoever waits for the end (the access line, the spans).
#[derive(Debug, Clone, Copy)]
pub struct BodyEnd {
    /// `grpc-status` from the trailers.
    pub grpc_status: Option<u16>,
    /// Data bytes passed on.
    pub bytes: u64,
    /// The body reached its end; false when it failed or was dropped before.
    pub complete: bool,
}

impl BodyEnd {
    /// A body Raahi wrote itself (an error, a redirect, a preflight), handed over whole.
    pub fn whole<B: Body>(response: &http::Response<B>) -> BodyEnd {
        BodyEnd {
            grpc_status: super::grpc::status_in(response.headers()),
            bytes: response.body().size_hint().exact().unwrap_or(0),
            complete: true,
        }
    }
}

/// Told how the body ended, once it ends or is dropped.
pub type AtEnd = Box<dyn FnOnce(BodyEnd) + Send + Sync>;

impl UpstreamResponseBody {
    pub fn new(inner: UpstreamBody, in_flight: InFlight, answering: Answering, grpc: bool) -> Self {
        UpstreamResponseBody {
            inner,
            _in_flight: in_flight,
            answering,
            held: None,
            grpc,
            grpc_status: None,
            sent: 0,
            at_end: None,
        }
    }

    pub fn at_end(&mut self, at_end: AtEnd) {
        self.at_end = Some(at_end);
    }

    fn ended(&mut self, complete: bool) {
        if let Some(at_end) = self.at_end.take() {
            at_end(BodyEnd {
                grpc_status: self.grpc_status,
                bytes: self.sent,
                complete,
            });
        }
    }
}

impl Drop for UpstreamResponseBody {
    fn drop(&mut self) {
        // hyper may drop a body that says it is at its end without polling it once more.
        let complete = self.held.is_none() && self.inner.is_end_stream();
        self.ended(complete);
    }
}

impl Body for UpstreamResponseBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(error) = self.held.take() {
            return Poll::Ready(Some(Err(error)));
        }
        match ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
            Some(Err(error)) => {
                self.answering.failed(error.as_ref());
                // The server flushes what it holds while the body is pending.
                self.held = Some(error);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    self.sent += data.len() as u64;
                }
                if self.grpc {
                    if let Some(trailers) = frame.trailers_ref() {
                        self.grpc_status = super::grpc::status_in(trailers);
                        if self.grpc_status == Some(super::grpc::UNAVAILABLE) {
                            self.answering.grpc_unavailable();
                        }
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                self.ended(true);
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
