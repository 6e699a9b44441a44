//! The request body before a target is picked: held to the route's size limit, and read whole
//! when the route buffers bodies of its size, so a slow uploader costs the upstream nothing (no
//! connection waits on the client's pace) and the request may be retried.
//!
//! A body is read ahead while it fits the route's `request_buffer_bytes` and the listener's
//! buffer budget; it must arrive whole within `client_body_timeout` (408). One that outgrows
//! either streams from where the reading stopped: its bytes read so far go first.

use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::rewrite::PendingBody;
use crate::model::Route;
use crate::proxy::body::{BufferBudget, BufferedBody, ClientBody, Reservation};
use crate::proxy::error::ProxyError;

/// What the listener gives request bodies.
#[derive(Debug, Clone)]
pub struct BodySettings {
    /// A body read ahead must arrive whole within this long.
    pub client_body_timeout: Duration,
    pub budget: std::sync::Arc<BufferBudget>,
}

pub(super) async fn read_request_body(
    body: Incoming,
    headers: &HeaderMap,
    route: &Route,
    settings: &BodySettings,
) -> Result<PendingBody, ProxyError> {
    if body.is_end_stream() {
        return Ok(PendingBody::Empty);
    }
    let limit = route.max_request_body_bytes;
    let declared = body.size_hint().exact();
    if let (Some(limit), Some(declared)) = (limit, declared) {
        if declared > limit {
            return Err(ProxyError::BodyTooLarge { limit });
        }
    }
    let buffer_limit = route.request_buffer_bytes;
    let streams = buffer_limit == 0
        || declared.is_some_and(|declared| declared > buffer_limit)
        || (declared.is_none() && is_grpc(headers));
    if streams {
        return Ok(PendingBody::Streaming(ClientBody::streaming(body, limit)));
    }
    // Boxed: its timer and frames would otherwise make every request's future larger, bodies
    // or not, and hyper moves that future into a box of its own per request.
    Box::pin(read_ahead(body, limit, buffer_limit, settings)).await
}

/// gRPC's client-streaming and bidirectional calls send a message and wait for an answer
/// before the next: a body read whole first would never end. (Their bodies carry no
/// Content-Length.)
fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

async fn read_ahead(
    mut body: Incoming,
    limit: Option<u64>,
    buffer_limit: u64,
    settings: &BodySettings,
) -> Result<PendingBody, ProxyError> {
    // One timer for the whole body, armed only if a frame is not there at once: most bodies
    // arrive with their request head.
    let deadline = tokio::time::sleep_until(Instant::now() + settings.client_body_timeout);
    tokio::pin!(deadline);
    let mut reservation = Reservation::new(&settings.budget);
    let mut chunks = Vec::new();
    let mut read = 0u64;
    let mut trailers: Option<HeaderMap> = None;
    loop {
        let next = tokio::select! {
            biased;
            next = body.frame() => next,
            () = &mut deadline => {
                return Err(ProxyError::ClientBodyTooSlow {
                    timeout_ms: settings.client_body_timeout.as_millis() as u64,
                })
            }
        };
        let frame = match next {
            None => break,
            Some(Err(error)) => {
                return Err(ProxyError::ClientBody {
                    reason: error.to_string(),
                })
            }
            Some(Ok(frame)) => frame,
        };
        let data = match frame.into_data() {
            Ok(data) => data,
            Err(frame) => {
                trailers = frame.into_trailers().ok();
                continue;
            }
        };
        read += data.len() as u64;
        if let Some(limit) = limit.filter(|limit| read > *limit) {
            return Err(ProxyError::BodyTooLarge { limit });
        }
        let fits =
            read <= buffer_limit && settings.budget.grow(&mut reservation, data.len() as u64);
        push(&mut chunks, data);
        if !fits {
            // Too large to hold, or no budget left: what was read goes first, the rest streams.
            return Ok(PendingBody::Streaming(ClientBody::new(
                chunks,
                Some(reservation),
                body,
                limit,
            )));
        }
    }
    Ok(PendingBody::Buffered(BufferedBody::new(
        chunks,
        trailers,
        reservation,
    )))
}

fn push(chunks: &mut Vec<Bytes>, data: Bytes) {
    if !data.is_empty() {
        chunks.push(data);
    }
}
