//! Exchanges that outlive their caller. A client that cancels its request (an HTTP/2 stream
//! reset) drops the request's future; an upstream exchange dropped mid-way loses its
//! connection, so a client resetting streams as fast as it opens them would cost the target a
//! connection each. Run on a task of its own, the exchange finishes instead, and its answer is
//! read to the end (within bounds), so the connection goes back to its pool.

use std::future::Future;

use bytes::Buf;
use http::Response;
use http_body::Body;
use http_body_util::BodyExt;
use tokio::sync::oneshot;
use tokio::time::Duration;

/// How long an exchange its caller abandoned may take to finish (answer read to its end), and
/// how much of an answer it reads, before its connection is given up after all.
const ABANDONED_EXCHANGE_TIME: Duration = Duration::from_secs(10);
const ABANDONED_ANSWER_BYTES: usize = 1024 * 1024;

/// Runs `exchange` on a task of its own and waits for its answer; None if the task died.
pub async fn finish_even_if_abandoned<F, B, E>(exchange: F) -> Option<Result<Response<B>, E>>
where
    F: Future<Output = Result<Response<B>, E>> + Send + 'static,
    B: Body + Send + Unpin + 'static,
    B::Data: Send,
    E: Send + 'static,
{
    let (answer, answered) = oneshot::channel();
    tokio::spawn(finish_unless_abandoned(exchange, answer));
    answered.await.ok()
}

/// Runs `exchange` for a caller waiting on `answer`; if the caller goes away first, finishes it
/// anyway and reads the answer, so its connection goes home.
async fn finish_unless_abandoned<F, B, E>(
    exchange: F,
    mut answer: oneshot::Sender<Result<Response<B>, E>>,
) where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body + Unpin,
{
    tokio::pin!(exchange);
    let result = tokio::select! {
        result = &mut exchange => result,
        () = answer.closed() => {
            match tokio::time::timeout(ABANDONED_EXCHANGE_TIME, exchange).await {
                Ok(result) => result,
                Err(_) => return,
            }
        }
    };
    if let Err(Ok(response)) = answer.send(result) {
        let reading = read_to_end(response.into_body(), ABANDONED_ANSWER_BYTES);
        let _ = tokio::time::timeout(ABANDONED_EXCHANGE_TIME, reading).await;
    }
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
