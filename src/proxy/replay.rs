//! A copy of a streamed request body, kept as it goes to a first attempt so that a retry may
//! send it again (as Envoy does): gRPC bodies always stream, since a client-streaming call
//! must not wait for its end, yet most of them are one short message that a failed attempt
//! should not make final.
//!
//! The copy lives in the upload (`UntouchedBody`) and is touched by it alone, once per frame;
//! it is handed over once, when the body ends whole, through a `OnceLock` the caller's
//! `StreamingBody` reads. It takes no more than its cap in data bytes and what the buffer
//! budget grants (charged as read-ahead is, with what is really held); past either it is
//! dropped, its budget share given back, and the body simply streams on.
//!
//! Frames of `COPY_FROM` bytes or more are kept as they came, a refcounted `Bytes`: no copy.
//! Smaller ones are copied into buffers of the copy's own, since each is cut from a read
//! buffer it would keep whole: an HTTP/2 client could otherwise pin a read buffer of several
//! KiB for each one-byte frame (its frames on other streams filling the rest), far more than
//! the budget is told of.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::{Body, Frame};

use super::body::{BufferedBody, ClientBody};
use super::budget::{Budget, Reservation};

/// Data frames this large or larger are kept as they came, sharing their bytes.
const COPY_FROM: usize = 4 * 1024;

/// The first buffer small frames are copied into; each next one is twice the last, up to
/// `LARGEST_BUFFER` (and never past what the cap leaves room for).
const FIRST_BUFFER: usize = 1024;
const LARGEST_BUFFER: usize = 16 * 1024;

/// What a kept piece costs besides its bytes: its place in the list.
const SLOT: u64 = std::mem::size_of::<Bytes>() as u64;

/// Asks a streaming body to keep a copy of itself (see [`UpstreamRequestBody::streaming_kept`]).
///
/// [`UpstreamRequestBody::streaming_kept`]: super::body::UpstreamRequestBody::streaming_kept
pub struct KeepCopy {
    /// The most data bytes the copy holds; a longer body is not kept (the route's
    /// `request_buffer_bytes`).
    pub cap: u64,
    /// The memory every held body shares.
    pub budget: Arc<Budget>,
}

/// The copy of one body as it goes up.
pub(super) struct BodyCopy {
    /// Pieces kept so far, in order; the small frames in `buffer` come after them.
    pieces: Vec<Bytes>,
    /// Small frames copied since the last piece.
    buffer: BytesMut,
    /// The capacity the last buffer was given.
    last_buffer: usize,
    trailers: Option<HeaderMap>,
    /// Data bytes kept.
    length: u64,
    cap: u64,
    budget: Arc<Budget>,
    reservation: Reservation,
    /// Set once the body ended whole.
    whole: Arc<OnceLock<BufferedBody>>,
}

impl BodyCopy {
    pub(super) fn new(keep: KeepCopy, whole: Arc<OnceLock<BufferedBody>>) -> BodyCopy {
        BodyCopy {
            pieces: Vec::new(),
            buffer: BytesMut::new(),
            last_buffer: 0,
            trailers: None,
            length: 0,
            cap: keep.cap,
            reservation: Reservation::new(&keep.budget),
            budget: keep.budget,
            whole,
        }
    }

    /// Keeps `frame`; false when it does not fit the cap or the budget, and the copy must go.
    pub(super) fn keep(&mut self, frame: &Frame<Bytes>) -> bool {
        if let Some(data) = frame.data_ref() {
            return self.keep_data(data);
        }
        if let Some(trailers) = frame.trailers_ref() {
            self.trailers = Some(trailers.clone());
        }
        true
    }

    fn keep_data(&mut self, data: &Bytes) -> bool {
        let length = data.len();
        if length == 0 {
            return true;
        }
        let room = self.cap.saturating_sub(self.length);
        if length as u64 > room {
            return false;
        }
        if length >= COPY_FROM {
            if !self
                .budget
                .grow(&mut self.reservation, length as u64 + SLOT)
            {
                return false;
            }
            self.seal_buffer();
            self.pieces.push(data.clone());
        } else {
            let spare = self.buffer.capacity() - self.buffer.len();
            let new_buffer = (spare < length).then(|| {
                (self.last_buffer * 2)
                    .clamp(FIRST_BUFFER, LARGEST_BUFFER)
                    .min(usize::try_from(room).unwrap_or(usize::MAX))
                    .max(length)
            });
            // A buffer is charged as it is allocated; a run of small frames becomes one piece.
            let mut charge = new_buffer.map_or(0, |capacity| capacity as u64);
            if new_buffer.is_some() || self.buffer.is_empty() {
                charge += SLOT;
            }
            if !self.budget.grow(&mut self.reservation, charge) {
                return false;
            }
            if let Some(capacity) = new_buffer {
                self.seal_buffer();
                self.buffer = BytesMut::with_capacity(capacity);
                self.last_buffer = capacity;
            }
            self.buffer.extend_from_slice(data);
        }
        self.length += length as u64;
        true
    }

    /// The small frames copied so far become a piece; later ones go after it, in the same
    /// buffer while it has room.
    fn seal_buffer(&mut self) {
        if !self.buffer.is_empty() {
            self.pieces.push(self.buffer.split().freeze());
        }
    }

    /// The upload stopped without reading the body's end: a target's client sends no more
    /// than the declared length, and an HTTP/2 client may end its stream in an empty frame of
    /// its own after the last byte, or with trailers. What is already there is looked at
    /// (the body is being dropped): only an empty frame, trailers, or the end may follow for
    /// the copy to be whole.
    pub(super) fn finish_if_ended(mut self, body: &mut ClientBody) {
        let mut cx = Context::from_waker(Waker::noop());
        // An empty frame, the trailers, the end.
        for _ in 0..3 {
            if body.is_end_stream() {
                return self.finish();
            }
            match Pin::new(&mut *body).poll_frame(&mut cx) {
                Poll::Ready(None) => return self.finish(),
                Poll::Ready(Some(Ok(frame))) => {
                    let nothing_more = frame.data_ref().is_none_or(Bytes::is_empty);
                    if !nothing_more || !self.keep(&frame) {
                        return;
                    }
                }
                Poll::Ready(Some(Err(_))) | Poll::Pending => return,
            }
        }
    }

    /// The body ended: the copy is handed over whole, with its budget share.
    pub(super) fn finish(mut self) {
        self.seal_buffer();
        let body = BufferedBody::pieces(self.pieces, self.length, self.trailers, self.reservation);
        let _ = self.whole.set(body);
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Mutex;

    use http::{HeaderValue, Request, Response};
    use http_body_util::{BodyExt, Empty};
    use hyper::body::Incoming;
    use hyper::service::service_fn;
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::oneshot;

    use super::*;
    use crate::proxy::body::{StreamingBody, UpstreamRequestBody};

    /// A request body as hyper's HTTP/2 server hands it over, fed by `upload`, the client's
    /// side of the stream, frame by frame.
    struct Upload {
        body: Option<Incoming>,
        upload: h2::SendStream<Bytes>,
        ping: h2::PingPong,
        _response: h2::client::ResponseFuture,
        _client: h2::client::SendRequest<Bytes>,
    }

    impl Upload {
        async fn start() -> Upload {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            let (hand_over, handed) = oneshot::channel();
            tokio::spawn(async move {
                let (stream, _) = listener.accept().await.unwrap();
                let hand_over = Mutex::new(Some(hand_over));
                let service = service_fn(move |request: Request<Incoming>| {
                    if let Some(hand_over) = hand_over.lock().unwrap().take() {
                        let _ = hand_over.send(request.into_body());
                    }
                    // No answer: the request body stays open for the test.
                    std::future::pending::<Result<Response<Empty<Bytes>>, Infallible>>()
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
            let tcp = TcpStream::connect(address).await.unwrap();
            let (client, mut connection) = h2::client::handshake(tcp).await.unwrap();
            let ping = connection.ping_pong().unwrap();
            tokio::spawn(connection);
            let mut client = client.ready().await.unwrap();
            let request = Request::post(format!("http://{address}/"))
                .body(())
                .unwrap();
            let (response, upload) = client.send_request(request, false).unwrap();
            Upload {
                body: Some(handed.await.unwrap()),
                upload,
                ping,
                _response: response,
                _client: client,
            }
        }

        fn client_body(&mut self) -> ClientBody {
            ClientBody::streaming(self.body.take().unwrap(), None)
        }

        fn send(&mut self, data: &[u8]) {
            self.upload
                .send_data(Bytes::copy_from_slice(data), false)
                .unwrap();
        }

        fn end(&mut self) {
            self.upload.send_data(Bytes::new(), true).unwrap();
        }

        fn trailers(&mut self, trailers: HeaderMap) {
            self.upload.send_trailers(trailers).unwrap();
        }

        /// Returns once the server has taken in every frame sent so far (it answers a ping
        /// after them).
        async fn arrived(&mut self) {
            self.ping.ping(h2::Ping::opaque()).await.unwrap();
        }
    }

    fn kept(cap: u64, budget: &Arc<Budget>) -> Option<KeepCopy> {
        Some(KeepCopy {
            cap,
            budget: budget.clone(),
        })
    }

    fn grpc_trailers() -> HeaderMap {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-checksum", HeaderValue::from_static("1234"));
        trailers.insert("x-count", HeaderValue::from_static("4"));
        trailers
    }

    /// Every frame of `body` to its end: data pieces (but empty ones, such as the frame an
    /// HTTP/2 client may end its stream with) and trailers.
    async fn drain<B>(body: &mut B) -> (Vec<Bytes>, Option<HeaderMap>)
    where
        B: Body<Data = Bytes> + Unpin,
        B::Error: std::fmt::Debug,
    {
        let mut data = Vec::new();
        let mut trailers = None;
        while let Some(frame) = body.frame().await {
            match frame.unwrap().into_data() {
                Ok(piece) if piece.is_empty() => {}
                Ok(piece) => data.push(piece),
                Err(frame) => trailers = Some(frame.into_trailers().unwrap()),
            }
        }
        (data, trailers)
    }

    async fn next_data(body: &mut UpstreamRequestBody) -> Bytes {
        body.frame().await.unwrap().unwrap().into_data().unwrap()
    }

    fn joined(pieces: &[Bytes]) -> Vec<u8> {
        pieces.concat()
    }

    #[tokio::test]
    async fn a_body_that_ended_within_the_cap_is_sent_again_as_it_went() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(64 * 1024, &budget));
        upload.send(&[b'a'; 5000]);
        upload.send(&[b'b'; 10]);
        upload.send(&[b'c'; 20]);
        upload.send(&[b'd'; 6000]);
        upload.trailers(grpc_trailers());
        let (first, trailers) = drain(&mut body).await;
        assert_eq!(trailers, Some(grpc_trailers()));
        let lengths: Vec<usize> = first.iter().map(Bytes::len).collect();
        assert_eq!(lengths, [5000, 10, 20, 6000]);

        let whole = streaming
            .kept_whole()
            .expect("the body ended within the cap");
        let (again, trailers) = drain(&mut UpstreamRequestBody::buffered(&whole)).await;
        assert_eq!(trailers, Some(grpc_trailers()));
        assert_eq!(joined(&again), joined(&first));
        // The small frames went into one piece; the large ones are the frames that came.
        let lengths: Vec<usize> = again.iter().map(Bytes::len).collect();
        assert_eq!(lengths, [5000, 30, 6000]);
        assert_eq!(again[0].as_ptr(), first[0].as_ptr(), "no copy");
        assert_eq!(again[2].as_ptr(), first[3].as_ptr(), "no copy");

        // Any number of retries may send it.
        let (once_more, trailers) = drain(&mut UpstreamRequestBody::buffered(&whole)).await;
        assert_eq!(
            (joined(&once_more), trailers),
            (joined(&first), Some(grpc_trailers()))
        );
    }

    #[tokio::test]
    async fn a_copy_in_pieces_says_its_length_and_its_end() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        upload.send(&[1; 5000]);
        upload.send(&[2; 5000]);
        upload.end();
        drain(&mut body).await;
        let whole = streaming.kept_whole().unwrap();
        let mut again = UpstreamRequestBody::buffered(&whole);
        assert!(matches!(again, UpstreamRequestBody::Pieces { .. }));
        assert_eq!(again.size_hint().exact(), Some(10_000));
        assert!(!again.is_end_stream());
        assert_eq!(next_data(&mut again).await.len(), 5000);
        assert_eq!(again.size_hint().exact(), Some(5000));
        assert_eq!(next_data(&mut again).await.len(), 5000);
        assert!(again.is_end_stream(), "no trailers to follow");
        assert!(again.frame().await.is_none());
    }

    #[tokio::test]
    async fn a_body_in_one_frame_is_sent_again_like_one_read_ahead() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        upload
            .upload
            .send_data(Bytes::from_static(b"one message"), true)
            .unwrap();
        assert_eq!(&next_data(&mut body).await[..], b"one message");
        // The frame ended the stream: the copy is whole without a poll for the end.
        let whole = streaming.kept_whole().expect("whole at its last frame");
        let again = UpstreamRequestBody::buffered(&whole);
        let UpstreamRequestBody::Buffered { data, trailers, .. } = &again else {
            panic!("one piece is sent as a body read ahead");
        };
        assert_eq!(data.as_deref(), Some(&b"one message"[..]));
        assert!(trailers.is_none());
    }

    #[tokio::test]
    async fn small_frames_are_copied_together() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        for byte in 0..200u8 {
            upload.send(&[byte]);
        }
        upload.end();
        let (first, _) = drain(&mut body).await;
        assert_eq!(first.len(), 200);
        drop(body);
        let (again, _) = drain(&mut UpstreamRequestBody::buffered(
            &streaming.kept_whole().unwrap(),
        ))
        .await;
        assert_eq!(again.len(), 1);
        assert_eq!(joined(&again), (0..200u8).collect::<Vec<_>>());
        // One buffer of its own, not a read buffer per byte.
        assert_eq!(budget.used(), FIRST_BUFFER as u64 + SLOT);
    }

    #[tokio::test]
    async fn a_body_past_the_cap_is_not_kept_and_its_share_is_given_back() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(10_000, &budget));
        upload.send(&[0; 6000]);
        next_data(&mut body).await;
        assert_eq!(budget.used(), 6000 + SLOT);
        upload.send(&[0; 6000]);
        assert_eq!(next_data(&mut body).await.len(), 6000, "it streams on");
        assert_eq!(budget.used(), 0);
        upload.send(&[0; 10]);
        upload.end();
        let (rest, _) = drain(&mut body).await;
        assert_eq!(joined(&rest).len(), 10);
        assert!(streaming.kept_whole().is_none());
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_past_the_budget_is_not_kept() {
        let budget = Budget::standalone(8000);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        upload.send(&[0; 5000]);
        upload.send(&[0; 5000]);
        upload.end();
        let (all, _) = drain(&mut body).await;
        assert_eq!(joined(&all).len(), 10_000, "it streamed whole");
        assert!(streaming.kept_whole().is_none());
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_is_not_kept() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        upload.send(&[0; 5000]);
        next_data(&mut body).await;
        assert!(budget.used() > 0);
        assert!(streaming.kept_whole().is_none(), "not ended yet");
        drop(body);
        assert!(streaming.kept_whole().is_none());
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn a_body_dropped_at_its_end_unasked_is_kept() {
        for with_trailers in [false, true] {
            let budget = Budget::standalone(1 << 20);
            let mut upload = Upload::start().await;
            let (mut body, streaming) =
                UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
            upload.send(b"all of it");
            next_data(&mut body).await;
            // The end comes in a frame of its own, which the upload never asks for.
            if with_trailers {
                upload.trailers(grpc_trailers());
            } else {
                upload.end();
            }
            upload.arrived().await;
            assert!(streaming.kept_whole().is_none());
            drop(body);
            let (again, trailers) = drain(&mut UpstreamRequestBody::buffered(
                &streaming.kept_whole().expect("whole"),
            ))
            .await;
            assert_eq!(joined(&again), b"all of it");
            assert_eq!(trailers, with_trailers.then(grpc_trailers));
        }
    }

    #[tokio::test]
    async fn a_body_dropped_with_more_to_come_is_not_kept() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        upload.send(b"first");
        next_data(&mut body).await;
        upload.send(b"second");
        upload.end();
        upload.arrived().await;
        drop(body);
        assert!(
            streaming.kept_whole().is_none(),
            "the second part never went up"
        );
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn the_budget_is_held_until_every_copy_is_gone() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        upload.send(&[7; 5000]);
        upload.send(&[8; 5000]);
        upload.trailers(grpc_trailers());
        drain(&mut body).await;
        drop(body);
        let held = 2 * (5000 + SLOT);
        assert_eq!(budget.used(), held);
        let whole = streaming.kept_whole().unwrap();
        let copy = whole.clone();
        let mut retry = UpstreamRequestBody::buffered(&copy);
        drop(streaming);
        drop(whole);
        assert_eq!(budget.used(), held);
        drop(copy);
        assert_eq!(budget.used(), held, "an attempt still sends it");
        assert_eq!(next_data(&mut retry).await.len(), 5000);
        drop(retry);
        assert_eq!(budget.used(), 0);
    }

    #[tokio::test]
    async fn without_a_copy_nothing_is_kept() {
        let mut upload = Upload::start().await;
        let (mut body, streaming): (_, StreamingBody) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), None);
        upload.send(b"streamed");
        upload.end();
        let (all, _) = drain(&mut body).await;
        assert_eq!(joined(&all), b"streamed");
        assert!(streaming.kept_whole().is_none());
    }

    #[tokio::test]
    async fn a_body_dropped_unread_comes_back_and_holds_nothing() {
        let budget = Budget::standalone(1 << 20);
        let mut upload = Upload::start().await;
        let (body, mut streaming) =
            UpstreamRequestBody::streaming_kept(upload.client_body(), kept(1 << 20, &budget));
        drop(body);
        let returned = streaming.returned.try_recv().expect("handed back");
        assert!(streaming.kept_whole().is_none());
        assert_eq!(budget.used(), 0);
        // Streamed again, with a copy this time too.
        let (mut body, streaming) =
            UpstreamRequestBody::streaming_kept(returned, kept(1 << 20, &budget));
        upload.send(b"later");
        upload.end();
        drain(&mut body).await;
        assert!(streaming.kept_whole().is_some());
    }
}
