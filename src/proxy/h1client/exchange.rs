//! One exchange on a connection whose request head is written: the request body goes up
//! while the response head is awaited.

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use http::{Response, StatusCode};
use http_body::Body;
use tokio::io::AsyncWrite;
use tokio::net::tcp::OwnedWriteHalf;
use tokio::sync::oneshot;

use super::body::ResponseBody;
use super::encode::RequestFraming;
use super::parse::{invalid, response_framing, Framing, UNASKED_SWITCH};
use super::{Connection, ConnectionHome, ExchangeError};
use crate::proxy::body::UpstreamRequestBody;

/// Sends the request body and reads the response head on `connection`, whose request head has
/// been written. The request body goes up while the head is awaited, since a target may answer
/// early (e.g. 413); if it does, the rest of the body goes up on a task of its own and the
/// connection is closed after this exchange. A `101` is an answer only when the request head
/// carried an `Upgrade` (`upgrade_asked`).
///
/// The exchange is a plain struct, `Unpin`: one that must finish on its own after its client
/// left (`detach`) moves to a task of its own as it is, without being boxed beforehand.
pub fn finish_exchange(
    connection: Box<Connection>,
    method_is_head: bool,
    upgrade_asked: bool,
    body: UpstreamRequestBody,
    framing: RequestFraming,
    home: Arc<dyn ConnectionHome>,
) -> FinishExchange {
    // A body that had already ended is dropped unread, which hands it back to the caller.
    let upload = match framing {
        RequestFraming::None => None,
        framing => Some(Upload::new(body, framing)),
    };
    FinishExchange {
        connection: Some(connection),
        method_is_head,
        upgrade_asked,
        upload,
        write_failed: None,
        home: Some(home),
    }
}

/// The exchange [`finish_exchange`] makes: ready with the response head.
pub struct FinishExchange {
    /// Gone once the head came (into the response body).
    connection: Option<Box<Connection>>,
    method_is_head: bool,
    upgrade_asked: bool,
    upload: Option<Upload>,
    /// A target may refuse the body and answer at once, then reset the connection: the write
    /// fails while the answer waits, readable, in the socket. So a failed write stops the
    /// upload but the head is still read; the write error is what is reported only if none
    /// comes.
    write_failed: Option<ExchangeError>,
    home: Option<Arc<dyn ConnectionHome>>,
}

impl Future for FinishExchange {
    type Output = Result<Response<ResponseBody>, ExchangeError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(connection) = this.connection.as_mut() else {
            return Poll::Pending;
        };
        if let Some(upload) = this.upload.as_mut() {
            if !upload.done && this.write_failed.is_none() {
                if let Some(write) = connection.write.as_mut() {
                    match upload.poll_send(cx, write) {
                        Poll::Ready(Err(error @ ExchangeError::Write(_))) => {
                            this.write_failed = Some(error);
                        }
                        Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                        _ => {}
                    }
                }
            }
        }
        let head = match ready!(connection.poll_head(cx)) {
            Ok(head) => head,
            Err(error) => return Poll::Ready(Err(this.write_failed.take().unwrap_or(error))),
        };
        let (Some(connection), Some(home)) = (this.connection.take(), this.home.take()) else {
            return Poll::Pending;
        };
        Poll::Ready(answer(
            connection,
            head,
            this.method_is_head,
            this.upgrade_asked,
            this.upload.take(),
            this.write_failed.is_some(),
            home,
        ))
    }
}

/// The response whose head came: its body reads the rest off `connection`.
fn answer(
    mut connection: Box<Connection>,
    head: super::parse::ResponseHead,
    method_is_head: bool,
    upgrade_asked: bool,
    upload: Option<Upload>,
    write_failed: bool,
    home: Arc<dyn ConnectionHome>,
) -> Result<Response<ResponseBody>, ExchangeError> {
    let upgraded = head.status == StatusCode::SWITCHING_PROTOCOLS;
    if upgraded && !upgrade_asked {
        return Err(invalid(UNASKED_SWITCH));
    }
    let (mut framing, mut reusable) = response_framing(method_is_head, &head)?;
    let mut upload_stop = None;
    if write_failed {
        reusable = false;
    } else if let Some(upload) = upload.filter(|upload| !upload.done) {
        reusable = false;
        // The rest goes up on its own task until it is sent or the response is over (read to
        // its end or dropped): nothing would read the target's reaction to it after that.
        // With `Connection: close` the target has said it will not read it (RFC 9112 §9.6).
        if !head.close {
            if let Some(write) = connection.write.take() {
                let (stop, stopped) = tokio::sync::oneshot::channel();
                upload_stop = Some(stop);
                tokio::spawn(upload.finish(write, stopped));
            }
        }
    }
    if upgraded {
        framing = Framing::Length(0);
        reusable = false;
    }
    let mut response = Response::new(());
    *response.status_mut() = head.status;
    *response.version_mut() = head.version;
    *response.headers_mut() = head.headers;
    let mut body = ResponseBody {
        connection: Some(connection),
        framing,
        reusable,
        upgraded,
        upload_stop,
        home,
    };
    if body.is_end_stream() && !upgraded {
        body.release();
    }
    Ok(response.map(|()| body))
}

/// A request body going up, framed as its head said.
pub(super) struct Upload {
    body: UpstreamRequestBody,
    framing: RequestFraming,
    sent: u64,
    /// Encoded bytes not yet written: a chunk's size line, its data, its CRLF.
    pending: Vec<Bytes>,
    body_ended: bool,
    done: bool,
}

impl Upload {
    fn new(body: UpstreamRequestBody, framing: RequestFraming) -> Upload {
        Upload {
            body,
            framing,
            sent: 0,
            pending: Vec::with_capacity(3),
            body_ended: false,
            done: false,
        }
    }

    fn poll_send(
        &mut self,
        cx: &mut Context<'_>,
        write: &mut OwnedWriteHalf,
    ) -> Poll<Result<(), ExchangeError>> {
        loop {
            if !self.pending.is_empty() {
                ready!(self.poll_write_pending(cx, write)).map_err(ExchangeError::Write)?;
                continue;
            }
            if self.body_ended {
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    // Trailers of a request are dropped, as hyper's client does when no
                    // `Trailer` field announced them (it is hop-by-hop, so never forwarded).
                    if let Ok(data) = frame.into_data() {
                        self.encode(data)?;
                    }
                }
                Some(Err(error)) => return Poll::Ready(Err(ExchangeError::RequestBody(error))),
                None => {
                    self.body_ended = true;
                    match self.framing {
                        RequestFraming::Chunked => {
                            self.pending.push(Bytes::from_static(b"0\r\n\r\n"))
                        }
                        RequestFraming::Length(length) if self.sent < length => {
                            return Poll::Ready(Err(ExchangeError::RequestBodyTooShort))
                        }
                        _ => {}
                    }
                }
            }
        }
    }

    fn encode(&mut self, data: Bytes) -> Result<(), ExchangeError> {
        if data.is_empty() {
            return Ok(());
        }
        self.sent += data.len() as u64;
        match self.framing {
            RequestFraming::Chunked => {
                self.pending
                    .push(Bytes::from(format!("{:x}\r\n", data.len())));
                self.pending.push(data);
                self.pending.push(Bytes::from_static(b"\r\n"));
            }
            RequestFraming::Length(length) if self.sent > length => {
                return Err(ExchangeError::RequestBodyTooLong)
            }
            RequestFraming::Length(length) => {
                self.pending.push(data);
                // Every declared byte is queued: the body is complete even if the client's
                // end-of-body signal comes later (HTTP/2 may send it in a frame of its own).
                self.body_ended |= self.sent == length;
            }
            RequestFraming::None => self.pending.push(data),
        }
        Ok(())
    }

    fn poll_write_pending(
        &mut self,
        cx: &mut Context<'_>,
        write: &mut OwnedWriteHalf,
    ) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            let slices: Vec<io::IoSlice<'_>> = self
                .pending
                .iter()
                .map(|bytes| io::IoSlice::new(bytes))
                .collect();
            let mut written = ready!(Pin::new(&mut *write).poll_write_vectored(cx, &slices))?;
            if written == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            while written > 0 {
                let first = &mut self.pending[0];
                if written >= first.len() {
                    written -= first.len();
                    self.pending.remove(0);
                } else {
                    first.advance(written);
                    written = 0;
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    /// Sends what is left after the target answered early.
    async fn finish(mut self, mut write: OwnedWriteHalf, stopped: oneshot::Receiver<()>) {
        tokio::select! {
            sent = poll_fn(|cx| self.poll_send(cx, &mut write)) => {
                if let Err(error) = sent {
                    tracing::debug!(%error, "the rest of a request body did not go up");
                }
            }
            _ = stopped => {}
        }
    }
}
