//! Exchanges that outlive their client. A client that goes away (an HTTP/2 stream reset, an
//! HTTP/1.1 connection closed with its request in flight, a load generator stopping) drops its
//! request's future; an upstream HTTP/1.1 exchange dropped mid-way loses its connection, so
//! every request so cut would cost the target a reconnect. Dropped because its client left,
//! a [`FinishOnDrop`] exchange whose request was sent carries on as a task of its own instead,
//! reads its answer to the end (within bounds) so its connection goes back to its pool, and
//! counts against its target (and its service and route, where they count) meanwhile.
//!
//! Only a client leaving does that. An exchange Raahi gives up itself (its response-header or
//! upload-stall timeout, the route's timeout, a hedge that lost, a failure) is cut at once:
//! its connection closed, its counts released. The two are told apart by where the drop comes
//! from: a request's future, as its client's connection holds it, is a [`ClientBound`], and
//! only the drop of a `ClientBound` that had not finished is a client leaving; everything
//! dropped inside it then sees [`client_left`]. Nothing is paid while the exchange finishes
//! with its caller: no flag, no count, no wake, no box (an `https` target's exchange is
//! hyper-util's future, which hyper-util boxes itself).

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Buf;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Duration;

use super::accounting::{Abandoned, InFlight};

/// How long an exchange its client abandoned may take to finish (answer read to its end), and
/// how much of an answer it reads, before its connection is given up after all.
const ABANDONED_EXCHANGE_TIME: Duration = Duration::from_secs(10);
const ABANDONED_ANSWER_BYTES: usize = 1024 * 1024;

thread_local! {
    /// True while a request's future is being dropped because its client went away: a drop
    /// is synchronous, so whatever that future held is dropped on this thread meanwhile.
    static CLIENT_LEFT: Cell<bool> = const { Cell::new(false) };
}

/// Whether what is being dropped now goes because its client left (rather than because Raahi
/// gave it up).
fn client_left() -> bool {
    CLIENT_LEFT.with(Cell::get)
}

pin_project_lite::pin_project! {
    /// A request's future as its client's connection (hyper) holds it. Dropped before it
    /// finished, its client went away: the exchanges inside it may finish on their own. The
    /// future is held inline (no box of its own per request) and dropped in place.
    pub struct ClientBound<F> {
        #[pin]
        request: Option<F>,
    }

    impl<F> PinnedDrop for ClientBound<F> {
        fn drop(this: Pin<&mut Self>) {
            let mut request = this.project().request;
            if request.is_some() {
                let _leaving = Leaving::enter();
                request.set(None);
            }
        }
    }
}

impl<F> ClientBound<F> {
    pub fn new(request: F) -> ClientBound<F> {
        ClientBound {
            request: Some(request),
        }
    }
}

impl<F: Future> Future for ClientBound<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let mut request = self.project().request;
        let Some(pending) = request.as_mut().as_pin_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(pending.poll(cx));
        // Finished: what it held is dropped now, with no departure to tell.
        request.set(None);
        Poll::Ready(output)
    }
}

/// Marks the thread as dropping a departed client's request, until dropped itself (nested
/// drops restore what they found).
struct Leaving(bool);

impl Leaving {
    fn enter() -> Leaving {
        Leaving(CLIENT_LEFT.with(|left| left.replace(true)))
    }
}

impl Drop for Leaving {
    fn drop(&mut self) {
        let before = self.0;
        CLIENT_LEFT.with(|left| left.set(before));
    }
}

/// An upstream exchange that finishes on its own if its client goes away once its request was
/// sent. Dropped at any other time, it is dropped: the connection closes. The exchange is
/// `Unpin` (a plain struct, or boxed by the caller), so it moves to a task of its own as it is.
pub struct FinishOnDrop<'a, F: Future + Unpin, S: Fn() -> bool> {
    exchange: Option<F>,
    /// Whether the request was handed to its connection: one not sent yet is not sent at all.
    sent: S,
    /// What the exchange counts against once its caller's count is gone.
    counts: Abandoned<'a>,
    finish_abandoned: fn(F, InFlight),
}

impl<'a, F, B, E, S> FinishOnDrop<'a, F, S>
where
    F: Future<Output = Result<Response<B>, E>> + Send + Unpin + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    E: Send + 'static,
    S: Fn() -> bool,
{
    pub fn new(exchange: F, sent: S, counts: Abandoned<'a>) -> FinishOnDrop<'a, F, S> {
        FinishOnDrop {
            exchange: Some(exchange),
            sent,
            counts,
            finish_abandoned: |exchange, in_flight| {
                tokio::spawn(finish(exchange, in_flight));
            },
        }
    }
}

impl<F: Future + Unpin, S: Fn() -> bool + Unpin> Future for FinishOnDrop<'_, F, S> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let Some(exchange) = self.exchange.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(Pin::new(exchange).poll(cx));
        self.exchange = None;
        Poll::Ready(output)
    }
}

impl<F: Future + Unpin, S: Fn() -> bool> Drop for FinishOnDrop<'_, F, S> {
    fn drop(&mut self) {
        let Some(exchange) = self.exchange.take() else {
            return;
        };
        // Raahi gave the exchange up itself, or the request never went: cut here.
        if !client_left() || !(self.sent)() {
            return;
        }
        // No runtime: the process is going away, and the exchange with it.
        if tokio::runtime::Handle::try_current().is_ok() {
            (self.finish_abandoned)(exchange, self.counts.start());
        }
    }
}

/// Finishes an exchange its client abandoned and reads the answer, so its connection goes home.
async fn finish<F, B, E>(exchange: F, in_flight: InFlight)
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body + Unpin,
{
    let finished = async {
        if let Ok(response) = exchange.await {
            read_to_end(response.into_body(), ABANDONED_ANSWER_BYTES).await;
        }
    };
    let _ = tokio::time::timeout(ABANDONED_EXCHANGE_TIME, finished).await;
    drop(in_flight);
}

/// Reads a body to its end (which hands its connection back), unless it is larger than
/// `limit`.
async fn read_to_end<B: Body + Unpin>(mut body: B, mut limit: usize) {
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            return;
        };
        let size = frame.data_ref().map_or(0, |data| data.remaining());
        if size > limit {
            return;
        }
        limit -= size;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// Notes, when dropped, whether its drop came from a departed client.
    struct Witness(Arc<AtomicBool>);

    impl Drop for Witness {
        fn drop(&mut self) {
            self.0.store(client_left(), Ordering::SeqCst);
        }
    }

    #[test]
    fn only_what_a_pending_client_bound_future_drops_sees_its_client_leave() {
        let seen = Arc::new(AtomicBool::new(false));
        let witness = Witness(seen.clone());
        // Boxed here only to be moved after pinning; the request's future sits inline in it.
        let mut request = Box::pin(ClientBound::new(async move {
            let _witness = witness;
            std::future::pending::<()>().await
        }));
        // Polled once, so the witness lives inside the suspended future.
        let waker = std::task::Waker::noop();
        assert!(request
            .as_mut()
            .poll(&mut Context::from_waker(waker))
            .is_pending());
        drop(request);
        assert!(seen.load(Ordering::SeqCst), "dropped as its client left");
        assert!(!client_left(), "the mark ends with the drop");

        // Finished, its future is gone: what it held was dropped by its own code.
        let seen = Arc::new(AtomicBool::new(true));
        let witness = Witness(seen.clone());
        let mut request = Box::pin(ClientBound::new(async move {
            drop(witness);
        }));
        assert!(request
            .as_mut()
            .poll(&mut Context::from_waker(waker))
            .is_ready());
        drop(request);
        assert!(!seen.load(Ordering::SeqCst));

        // Dropped by its own code (a timeout), not by the client: no departure.
        let seen = Arc::new(AtomicBool::new(true));
        drop(Witness(seen.clone()));
        assert!(!seen.load(Ordering::SeqCst));
    }
}
