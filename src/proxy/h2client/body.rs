//! The two bodies of an HTTP/2 exchange with a target. The upload runs on a task of its own, so
//! a gRPC call can stream both ways at once (the next request message may wait for the last
//! answer); it sends only what the target's flow-control window takes, so nothing buffers
//! without bound. The response body gives window back as it is read, and ends the upload when
//! it ends or is dropped (a client that went away): the target sees the stream reset.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes};
use h2::{RecvStream, SendStream};
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tokio::sync::oneshot;

use super::connection::StreamSlot;
use crate::proxy::body::UpstreamRequestBody;

/// Starts sending `body` on `upload`; the sender ends the upload (resetting the stream if it
/// is not finished) when it is dropped.
pub(super) fn start_upload(
    body: UpstreamRequestBody,
    upload: SendStream<Bytes>,
) -> oneshot::Sender<()> {
    let (cancel, cancelled) = oneshot::channel();
    tokio::spawn(upload_body(body, upload, cancelled));
    cancel
}

/// Sends a body held whole in memory; a stream that broke meanwhile fails its response, which
/// is where the caller learns of it.
pub(super) fn send_whole(
    mut upload: SendStream<Bytes>,
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
) {
    let last_frame_is_data = trailers.is_none();
    if let Some(data) = data {
        if upload.send_data(data, last_frame_is_data).is_err() {
            return;
        }
    } else if last_frame_is_data {
        let _ = upload.send_data(Bytes::new(), true);
        return;
    }
    if let Some(trailers) = trailers {
        let _ = upload.send_trailers(trailers);
    }
}

async fn upload_body(
    body: UpstreamRequestBody,
    mut upload: SendStream<Bytes>,
    mut cancelled: oneshot::Receiver<()>,
) {
    tokio::pin!(body);
    let sent = async {
        loop {
            let frame = tokio::select! {
                frame = body.frame() => frame,
                // The target reset the stream (or answered and stopped reading).
                reset = std::future::poll_fn(|cx| upload.poll_reset(cx)) => {
                    let _ = reset;
                    return Err(UploadEnd::Reset);
                }
            };
            match frame {
                None => {
                    upload
                        .send_data(Bytes::new(), true)
                        .map_err(|_| UploadEnd::Broken)?;
                    return Ok(());
                }
                Some(Err(error)) => {
                    tracing::debug!(%error, "the client's upload failed; resetting the upstream stream");
                    return Err(UploadEnd::ClientFailed);
                }
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => send_within_window(&mut upload, data).await?,
                    Err(frame) => {
                        if let Ok(trailers) = frame.into_trailers() {
                            upload
                                .send_trailers(trailers)
                                .map_err(|_| UploadEnd::Broken)?;
                            return Ok(());
                        }
                    }
                },
            }
        }
    };
    let outcome = tokio::select! {
        outcome = sent => outcome,
        _ = &mut cancelled => Err(UploadEnd::Cancelled),
    };
    match outcome {
        Ok(()) | Err(UploadEnd::Reset) | Err(UploadEnd::Broken) => {}
        Err(UploadEnd::ClientFailed) | Err(UploadEnd::Cancelled) => {
            upload.send_reset(h2::Reason::CANCEL);
        }
    }
}

enum UploadEnd {
    /// The target reset the stream.
    Reset,
    /// The stream or connection broke.
    Broken,
    /// The client's side of the upload failed.
    ClientFailed,
    /// The exchange ended or was abandoned before the upload did.
    Cancelled,
}

/// Sends `data` in pieces as the target's window opens.
async fn send_within_window(
    upload: &mut SendStream<Bytes>,
    mut data: Bytes,
) -> Result<(), UploadEnd> {
    while data.has_remaining() {
        upload.reserve_capacity(data.len());
        let granted = std::future::poll_fn(|cx| upload.poll_capacity(cx)).await;
        let granted = match granted {
            Some(Ok(granted)) => granted,
            Some(Err(_)) | None => return Err(UploadEnd::Broken),
        };
        if granted == 0 {
            continue;
        }
        let piece = data.split_to(granted.min(data.len()));
        upload
            .send_data(piece, false)
            .map_err(|_| UploadEnd::Broken)?;
    }
    Ok(())
}

/// A target's response body: its data, then its trailers.
#[derive(Debug)]
pub struct H2ResponseBody {
    stream: RecvStream,
    trailers_next: bool,
    done: bool,
    _slot: StreamSlot,
    /// Ends the upload when this body ends or is dropped.
    _upload: Option<oneshot::Sender<()>>,
}

impl H2ResponseBody {
    pub(super) fn new(
        stream: RecvStream,
        slot: StreamSlot,
        upload: Option<oneshot::Sender<()>>,
    ) -> H2ResponseBody {
        let done = stream.is_end_stream();
        H2ResponseBody {
            stream,
            trailers_next: false,
            done,
            _slot: slot,
            _upload: upload,
        }
    }
}

impl Body for H2ResponseBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, h2::Error>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        if !this.trailers_next {
            match ready!(this.stream.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Read means taken: the target may send that much more.
                    let _ = this.stream.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                Some(Err(error)) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(error)));
                }
                None => this.trailers_next = true,
            }
        }
        let trailers: Option<HeaderMap> = match ready!(this.stream.poll_trailers(cx)) {
            Ok(trailers) => trailers,
            Err(error) => {
                this.done = true;
                return Poll::Ready(Some(Err(error)));
            }
        };
        this.done = true;
        Poll::Ready(trailers.map(|trailers| Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
