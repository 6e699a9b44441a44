//! The request body before a target is picked: held to the route's size limit, and read whole
//! when the route buffers bodies, so a slow uploader costs the upstream nothing (no
//! connection waits on the client's pace) and the request may be retried.
//!
//! A body is held in memory while it fits the route's `request_buffer_bytes` and the memory
//! budget, and must then arrive whole within `client_body_timeout` (408). One that outgrows
//! either goes to a spool file (see `spool`), within `request_spool_bytes` and the disk budget
//! (413 past them); it must keep coming, with no pause as long as `client_body_timeout`. With
//! spooling off, such a body streams from where the reading stopped: its bytes read so far go
//! first. gRPC bodies and routes with `request_buffer_bytes: 0` always stream.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::HeaderMap;
use http_body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::rewrite::PendingBody;
use crate::model::Route;
use crate::proxy::body::{BufferedBody, ClientBody};
use crate::proxy::budget::{Budget, Reservation};
use crate::proxy::error::ProxyError;
use crate::proxy::spool::{SpoolSettings, SpoolWriter};

/// The smallest buffer a body is copied into: a client sending a byte at a time holds about
/// this much, not a read buffer per byte.
const FIRST_BUFFER: usize = 4 * 1024;

/// What the listener gives request bodies.
#[derive(Debug, Clone)]
pub struct BodySettings {
    /// A body held in memory must arrive whole within this long; a spooled one may not pause
    /// for this long.
    pub client_body_timeout: Duration,
    /// Memory all bodies held before a pick may take together.
    pub budget: std::sync::Arc<Budget>,
    /// Where bodies too large for memory go; None: they stream.
    pub spool: Option<SpoolSettings>,
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
    let streams = buffer_limit == 0 || (declared.is_none() && is_grpc(headers));
    if streams {
        return Ok(PendingBody::Streaming(ClientBody::streaming(body, limit)));
    }
    let mut reader = ReadAhead {
        settings,
        limit,
        buffer_limit,
        memory: MemoryBody::new(&settings.budget, declared.unwrap_or(buffer_limit)),
        spool: None,
        trailers: None,
    };
    if let Some(declared) = declared.filter(|declared| *declared > buffer_limit) {
        let Some(spool) = &settings.spool else {
            return Ok(PendingBody::Streaming(ClientBody::streaming(body, limit)));
        };
        // Refused before a byte is read: the client learns at once, not after its upload.
        spool.admits(declared)?;
        reader.spool = Some(SpoolWriter::create(spool).await?);
    }
    // Boxed: its timer, frames and buffers would otherwise make every request's future
    // larger, bodies or not, and hyper moves that future into a box of its own per request.
    Box::pin(reader.run(body)).await
}

/// gRPC's client-streaming and bidirectional calls send a message and wait for an answer
/// before the next: a body read whole first would never end. (Their bodies carry no
/// Content-Length.)
fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|value| value.as_bytes().starts_with(b"application/grpc"))
}

/// One body being read whole.
struct ReadAhead<'a> {
    settings: &'a BodySettings,
    limit: Option<u64>,
    buffer_limit: u64,
    memory: MemoryBody,
    /// Set once the body outgrew memory: everything read so far is in it.
    spool: Option<SpoolWriter>,
    trailers: Option<HeaderMap>,
}

impl ReadAhead<'_> {
    async fn run(mut self, mut body: Incoming) -> Result<PendingBody, ProxyError> {
        let timeout = self.settings.client_body_timeout;
        // One timer, armed only if a frame is not there at once: most bodies arrive with
        // their request head. In memory it bounds the whole body; spooling, each pause.
        let deadline = tokio::time::sleep_until(Instant::now() + timeout);
        tokio::pin!(deadline);
        let mut read = 0u64;
        loop {
            let next = tokio::select! {
                biased;
                next = body.frame() => next,
                () = &mut deadline => return Err(self.too_slow()),
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
                    self.trailers = frame.into_trailers().ok();
                    continue;
                }
            };
            read += data.len() as u64;
            if let Some(limit) = self.limit.filter(|limit| read > *limit) {
                return Err(ProxyError::BodyTooLarge { limit });
            }
            if let Some(spool) = &mut self.spool {
                spool.push(data).await?;
                deadline.as_mut().reset(Instant::now() + timeout);
                continue;
            }
            let data = if read <= self.buffer_limit {
                match self.memory.take(data) {
                    Ok(()) => continue,
                    Err(refused) => refused,
                }
            } else {
                data
            };
            // Too large to hold, or no memory left: spool it, or stream it from here.
            let Some(spool_settings) = &self.settings.spool else {
                let (held, reservation) = self.memory.into_parts();
                let read_ahead = [held, data]
                    .into_iter()
                    .filter(|piece| !piece.is_empty())
                    .collect();
                return Ok(PendingBody::Streaming(ClientBody::new(
                    read_ahead,
                    Some(reservation),
                    body,
                    self.limit,
                )));
            };
            let mut spool = SpoolWriter::create(spool_settings).await?;
            let (held, _released) =
                std::mem::replace(&mut self.memory, MemoryBody::new(&self.settings.budget, 0))
                    .into_parts();
            spool.push(held).await?;
            spool.push(data).await?;
            self.spool = Some(spool);
            deadline.as_mut().reset(Instant::now() + timeout);
        }
        let body = match self.spool {
            Some(spool) => BufferedBody::spooled(spool.finish().await?, self.trailers),
            None => {
                let (held, reservation) = self.memory.into_parts();
                BufferedBody::in_memory(held, self.trailers, reservation)
            }
        };
        Ok(PendingBody::Buffered(body))
    }

    fn too_slow(&self) -> ProxyError {
        let timeout_ms = self.settings.client_body_timeout.as_millis() as u64;
        if self.spool.is_some() {
            ProxyError::ClientBodyTimeout { timeout_ms }
        } else {
            ProxyError::ClientBodyTooSlow { timeout_ms }
        }
    }
}

/// A body held in memory as it arrives. Its first piece is kept as it came (most bodies
/// arrive in one); from the second on, pieces are copied into one buffer that grows with what
/// arrived, up to the expected length, so a client sending a byte per packet pins no read
/// buffer per byte. The memory budget is charged with what is allocated.
struct MemoryBody {
    first: Option<Bytes>,
    buffer: BytesMut,
    /// The most the buffer is ever sized to: the declared length, else the route's limit.
    expected: u64,
    reservation: Reservation,
}

impl MemoryBody {
    fn new(budget: &std::sync::Arc<Budget>, expected: u64) -> MemoryBody {
        MemoryBody {
            first: None,
            buffer: BytesMut::new(),
            expected,
            reservation: Reservation::new(budget),
        }
    }

    fn budget(&self) -> std::sync::Arc<Budget> {
        self.reservation.budget().clone()
    }

    fn held(&self) -> usize {
        self.buffer.len() + self.first.as_ref().map_or(0, Bytes::len)
    }

    /// Takes `data`, or hands it back when the memory budget cannot hold it.
    fn take(&mut self, data: Bytes) -> Result<(), Bytes> {
        if data.is_empty() {
            return Ok(());
        }
        let budget = self.budget();
        if self.first.is_none() && self.buffer.capacity() == 0 {
            if !budget.grow(&mut self.reservation, data.len() as u64) {
                return Err(data);
            }
            self.first = Some(data);
            return Ok(());
        }
        let needed = self.held() + data.len();
        if needed > self.buffer.capacity() {
            let capacity = self.buffer.capacity();
            let grown = (capacity * 2)
                .max(FIRST_BUFFER)
                .min(usize::try_from(self.expected).unwrap_or(usize::MAX))
                .max(needed);
            // Charged for the new buffer while the old one (or the first piece) still exists.
            if !budget.grow(&mut self.reservation, grown as u64) {
                return Err(data);
            }
            let mut buffer = BytesMut::with_capacity(grown);
            if let Some(first) = self.first.take() {
                buffer.extend_from_slice(&first);
            }
            buffer.extend_from_slice(&self.buffer);
            self.buffer = buffer;
            self.reservation.shrink_to(self.buffer.capacity() as u64);
        }
        self.buffer.extend_from_slice(&data);
        Ok(())
    }

    /// The bytes held, and the budget's share for them.
    fn into_parts(self) -> (Bytes, Reservation) {
        let held = match self.first {
            Some(first) => first,
            None => self.buffer.freeze(),
        };
        (held, self.reservation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_in_one_piece_is_kept_as_it_came() {
        let budget = Budget::standalone(1 << 20);
        let mut memory = MemoryBody::new(&budget, 5);
        let piece = Bytes::from_static(b"hello");
        memory.take(piece.clone()).unwrap();
        let (held, reservation) = memory.into_parts();
        assert_eq!(held.as_ptr(), piece.as_ptr(), "no copy");
        assert_eq!(reservation.bytes(), 5);
    }

    #[test]
    fn a_byte_at_a_time_costs_about_the_bytes_not_a_buffer_each() {
        let budget = Budget::standalone(1 << 20);
        let mut memory = MemoryBody::new(&budget, 100_000);
        let mut pieces = Vec::new();
        for i in 0..10_000u32 {
            let piece = Bytes::from(vec![(i % 251) as u8]);
            pieces.push(piece.clone());
            memory.take(piece).unwrap();
        }
        // The pieces the client sent are not what is held: the copies are.
        drop(pieces);
        assert_eq!(memory.held(), 10_000);
        assert!(
            memory.buffer.capacity() <= 2 * 10_000,
            "capacity {}",
            memory.buffer.capacity()
        );
        assert_eq!(budget.used(), memory.buffer.capacity() as u64);
        let (held, _reservation) = memory.into_parts();
        let expected: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        assert_eq!(&held[..], &expected[..]);
    }

    #[test]
    fn the_buffer_never_outgrows_the_declared_length() {
        let budget = Budget::standalone(1 << 20);
        let mut memory = MemoryBody::new(&budget, 6_000);
        for _ in 0..6_000 {
            memory.take(Bytes::from_static(b"x")).unwrap();
        }
        assert_eq!(memory.buffer.capacity(), 6_000);
        assert_eq!(budget.used(), 6_000);
    }

    #[test]
    fn a_full_budget_hands_the_piece_back_and_keeps_what_it_had() {
        let budget = Budget::standalone(FIRST_BUFFER as u64 + 3);
        let mut memory = MemoryBody::new(&budget, 1 << 20);
        memory.take(Bytes::from_static(b"ab")).unwrap();
        memory.take(Bytes::from_static(b"c")).unwrap();
        assert_eq!(budget.used(), FIRST_BUFFER as u64);
        let big = Bytes::from(vec![0; FIRST_BUFFER]);
        assert_eq!(memory.take(big.clone()), Err(big));
        assert_eq!(
            budget.used(),
            FIRST_BUFFER as u64,
            "a refused grant takes nothing"
        );
        let (held, reservation) = memory.into_parts();
        assert_eq!(&held[..], b"abc");
        drop(reservation);
        assert_eq!(budget.used(), 0);
    }
}
