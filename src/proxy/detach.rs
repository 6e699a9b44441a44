//! Exchanges that outlive their caller. A client that cancels its request (an HTTP/2 stream
//! reset) drops the request's future; an upstream exchange dropped mid-way loses its
//! connection, so a client resetting streams as fast as it opens them would cost the target a
//! connection each. Dropped before it finished, a [`FinishOnDrop`] exchange carries on as a task
//! of its own instead, reads its answer to the end (within bounds) so its connection goes back
//! to its pool, and counts against its target (and its service and route, where they count)
//! meanwhile. Only then is a task spawned: an
//! exchange that finishes with its caller costs one box.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Buf;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use tokio::time::Duration;

use super::accounting::{Abandoned, InFlight};

/// How long an exchange its caller abandoned may take to finish (answer read to its end), and
/// how much of an answer it reads, before its connection is given up after all.
const ABANDONED_EXCHANGE_TIME: Duration = Duration::from_secs(10);
const ABANDONED_ANSWER_BYTES: usize = 1024 * 1024;

/// An upstream exchange that finishes even if its caller goes away.
///
/// Its first poll only yields: hyper polls a stream's future before it looks for the client's
/// reset, so an exchange started at once would write its request (on a pooled connection, in
/// that very poll) for a stream the client had already cancelled. Dropped before it started,
/// the exchange is simply dropped: nothing of it went anywhere.
pub struct FinishOnDrop<F: Future> {
    exchange: Option<Pin<Box<F>>>,
    yielded: bool,
    /// The exchange was polled: it may have dialled or sent something.
    started: bool,
    /// Told when the caller went away, so a request not yet written is not sent at all.
    abandoned: Option<Arc<AtomicBool>>,
    /// What the exchange counts against once its caller's count is gone.
    counts: Abandoned,
    finish_abandoned: fn(Pin<Box<F>>, InFlight),
}

impl<F, B, E> FinishOnDrop<F>
where
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    E: Send + 'static,
{
    pub fn new(
        exchange: F,
        abandoned: Option<Arc<AtomicBool>>,
        counts: Abandoned,
    ) -> FinishOnDrop<F> {
        FinishOnDrop {
            exchange: Some(Box::pin(exchange)),
            yielded: false,
            started: false,
            abandoned,
            counts,
            finish_abandoned: |exchange, in_flight| {
                tokio::spawn(finish(exchange, in_flight));
            },
        }
    }
}

impl<F: Future> Future for FinishOnDrop<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        if !self.yielded {
            self.yielded = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.started = true;
        let Some(exchange) = self.exchange.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(exchange.as_mut().poll(cx));
        self.exchange = None;
        Poll::Ready(output)
    }
}

impl<F: Future> Drop for FinishOnDrop<F> {
    fn drop(&mut self) {
        let Some(exchange) = self.exchange.take() else {
            return;
        };
        if !self.started {
            return;
        }
        if let Some(abandoned) = &self.abandoned {
            abandoned.store(true, Ordering::Relaxed);
        }
        // No runtime: the process is going away, and the exchange with it.
        if tokio::runtime::Handle::try_current().is_ok() {
            (self.finish_abandoned)(exchange, self.counts.start());
        }
    }
}

/// Finishes an exchange its caller abandoned and reads the answer, so its connection goes home.
async fn finish<F, B, E>(exchange: Pin<Box<F>>, in_flight: InFlight)
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
