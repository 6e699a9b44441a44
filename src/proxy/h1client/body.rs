//! A response body read straight off its connection: by length, chunked (with trailers) or
//! to the end of the connection.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http_body::{Body, Frame, SizeHint};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::parse::{ChunkState, Framing};
use super::{
    BodyError, Connection, ConnectionHome, MAX_CHUNK_LINE_BYTES, MAX_HEADERS, MAX_HEAD_BYTES,
};

/// A response body read straight off its connection. The connection goes back to its home the
/// moment the body's last byte is read (when it may be reused); a body dropped before its end
/// closes it.
pub struct ResponseBody {
    pub(super) connection: Option<Box<Connection>>,
    pub(super) framing: Framing,
    pub(super) reusable: bool,
    pub(super) upgraded: bool,
    /// Ends the task still sending the request body after an early answer, when dropped.
    pub(super) upload_stop: Option<oneshot::Sender<()>>,
    pub(super) home: Arc<dyn ConnectionHome>,
}

impl ResponseBody {
    pub(super) fn release(&mut self) {
        if let Some(connection) = self.connection.take() {
            // A target that closed right after its answer is seen here, when its FIN came
            // with the answer: the pool then never holds it.
            if self.reusable && connection.is_reusable() {
                self.home.take_back(connection);
            }
        }
    }

    fn end(&mut self) {
        self.framing = Framing::Length(0);
        self.upload_stop = None;
        self.release();
    }

    /// The connection of a `101 Switching Protocols` answer, and the bytes the target sent
    /// after the head (they belong to the new protocol).
    pub fn into_upgraded(mut self) -> Option<(TcpStream, Bytes)> {
        if !self.upgraded {
            return None;
        }
        let mut connection = self.connection.take()?;
        let write = connection.write.take()?;
        let stream = connection.read.reunite(write).ok()?;
        let already_read = std::mem::take(&mut connection.buffer).freeze();
        Some((stream, already_read))
    }

    fn poll_length(
        &mut self,
        cx: &mut Context<'_>,
        remaining: u64,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Ready(None);
        };
        if connection.buffer.is_empty()
            && ready!(connection.poll_fill(cx)).map_err(BodyError::Read)? == 0
        {
            self.connection = None;
            return Poll::Ready(Some(Err(BodyError::ClosedEarly)));
        }
        let take = (connection.buffer.len() as u64).min(remaining) as usize;
        let data = connection.buffer.split_to(take).freeze();
        let remaining = remaining - take as u64;
        if remaining == 0 {
            self.end();
        } else {
            self.framing = Framing::Length(remaining);
        }
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn poll_until_close(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let Some(connection) = self.connection.as_mut() else {
            return Poll::Ready(None);
        };
        if connection.buffer.is_empty()
            && ready!(connection.poll_fill(cx)).map_err(BodyError::Read)? == 0
        {
            self.end();
            return Poll::Ready(None);
        }
        let data = connection.buffer.split().freeze();
        Poll::Ready(Some(Ok(Frame::data(data))))
    }

    fn poll_chunked(
        &mut self,
        cx: &mut Context<'_>,
        mut state: ChunkState,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        loop {
            let Some(connection) = self.connection.as_mut() else {
                return Poll::Ready(None);
            };
            let step = match decode_chunk(&mut connection.buffer, state) {
                Ok(step) => step,
                Err(error) => {
                    self.connection = None;
                    return Poll::Ready(Some(Err(error)));
                }
            };
            match step {
                ChunkStep::Next(next) => state = next,
                ChunkStep::Data(data, next) => {
                    self.framing = Framing::Chunked(next);
                    return Poll::Ready(Some(Ok(Frame::data(data))));
                }
                ChunkStep::End(trailers) => {
                    self.end();
                    return Poll::Ready(trailers.map(|trailers| Ok(Frame::trailers(trailers))));
                }
                ChunkStep::NeedMore => {
                    self.framing = Framing::Chunked(state);
                    match ready!(connection.poll_fill(cx)) {
                        Ok(0) => {
                            self.connection = None;
                            return Poll::Ready(Some(Err(BodyError::ClosedEarly)));
                        }
                        Ok(_) => {}
                        Err(error) => {
                            self.connection = None;
                            return Poll::Ready(Some(Err(BodyError::Read(error))));
                        }
                    }
                }
            }
        }
    }
}

pub(super) enum ChunkStep {
    /// Moved on without data (a size line or a data CRLF was consumed).
    Next(ChunkState),
    Data(Bytes, ChunkState),
    /// The last chunk and trailer section were read; the trailer fields if there were any.
    End(Option<HeaderMap>),
    NeedMore,
}

/// One step of chunked decoding over the bytes buffered so far.
pub(super) fn decode_chunk(
    buffer: &mut BytesMut,
    state: ChunkState,
) -> Result<ChunkStep, BodyError> {
    match state {
        ChunkState::Size => {
            let Some(line_end) = find_crlf(buffer) else {
                if buffer.len() > MAX_CHUNK_LINE_BYTES {
                    return Err(BodyError::InvalidChunk("chunk-size line too long"));
                }
                return Ok(ChunkStep::NeedMore);
            };
            if line_end > MAX_CHUNK_LINE_BYTES {
                return Err(BodyError::InvalidChunk("chunk-size line too long"));
            }
            let size = parse_chunk_size(&buffer[..line_end])?;
            buffer.advance(line_end + 2);
            Ok(ChunkStep::Next(if size == 0 {
                ChunkState::Trailers
            } else {
                ChunkState::Data(size)
            }))
        }
        ChunkState::Data(remaining) => {
            if buffer.is_empty() {
                return Ok(ChunkStep::NeedMore);
            }
            let take = (buffer.len() as u64).min(remaining) as usize;
            let data = buffer.split_to(take).freeze();
            let remaining = remaining - take as u64;
            let next = if remaining == 0 {
                ChunkState::DataEnd
            } else {
                ChunkState::Data(remaining)
            };
            Ok(ChunkStep::Data(data, next))
        }
        ChunkState::DataEnd => {
            if buffer.len() < 2 {
                return Ok(ChunkStep::NeedMore);
            }
            if &buffer[..2] != b"\r\n" {
                return Err(BodyError::InvalidChunk("chunk data not followed by CRLF"));
            }
            buffer.advance(2);
            Ok(ChunkStep::Next(ChunkState::Size))
        }
        // The trailer section is held to the response head's limit, whether it came whole in
        // one read or not.
        ChunkState::Trailers => {
            let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::parse_headers(buffer, &mut fields) {
                Ok(httparse::Status::Complete((length, _))) if length > MAX_HEAD_BYTES => {
                    Err(BodyError::InvalidChunk("trailer section too large"))
                }
                Ok(httparse::Status::Complete((length, fields))) => {
                    let trailers = (!fields.is_empty())
                        .then(|| trailer_map(fields))
                        .transpose()?;
                    buffer.advance(length);
                    Ok(ChunkStep::End(trailers))
                }
                Ok(httparse::Status::Partial) if buffer.len() >= MAX_HEAD_BYTES => {
                    Err(BodyError::InvalidChunk("trailer section too large"))
                }
                Ok(httparse::Status::Partial) => Ok(ChunkStep::NeedMore),
                Err(_) => Err(BodyError::InvalidChunk("bad trailer field")),
            }
        }
    }
}

pub(super) fn trailer_map(fields: &[httparse::Header<'_>]) -> Result<HeaderMap, BodyError> {
    let mut trailers = HeaderMap::with_capacity(fields.len());
    for field in fields {
        let name = HeaderName::from_bytes(field.name.as_bytes())
            .map_err(|_| BodyError::InvalidChunk("bad trailer field"))?;
        let value = HeaderValue::from_bytes(field.value)
            .map_err(|_| BodyError::InvalidChunk("bad trailer field"))?;
        trailers.append(name, value);
    }
    Ok(trailers)
}

pub(super) fn find_crlf(buffer: &[u8]) -> Option<usize> {
    buffer.windows(2).position(|pair| pair == b"\r\n")
}

/// `1*HEXDIG [ BWS ; chunk-ext ]`; the extensions are ignored.
pub(super) fn parse_chunk_size(line: &[u8]) -> Result<u64, BodyError> {
    // No control bytes (a bare LF or CR included) anywhere in the line, as hyper refuses them.
    if line
        .iter()
        .any(|&byte| (byte < 0x20 && byte != b'\t') || byte == 0x7f)
    {
        return Err(BodyError::InvalidChunk("control byte in a chunk-size line"));
    }
    let digits_end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    let (digits, rest) = line.split_at(digits_end);
    if digits.is_empty() || digits.len() > 15 {
        return Err(BodyError::InvalidChunk("bad chunk size"));
    }
    let rest_ok = rest.is_empty()
        || matches!(
            rest.iter().find(|b| !matches!(b, b' ' | b'\t')),
            Some(b';') | None
        );
    if !rest_ok {
        return Err(BodyError::InvalidChunk("bad chunk size"));
    }
    let digits =
        std::str::from_utf8(digits).map_err(|_| BodyError::InvalidChunk("bad chunk size"))?;
    u64::from_str_radix(digits, 16).map_err(|_| BodyError::InvalidChunk("bad chunk size"))
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.framing {
            Framing::Length(0) => Poll::Ready(None),
            Framing::Length(remaining) => self.poll_length(cx, remaining),
            Framing::UntilClose => self.poll_until_close(cx),
            Framing::Chunked(state) => self.poll_chunked(cx, state),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing == Framing::Length(0)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(remaining) => SizeHint::with_exact(remaining),
            _ => SizeHint::default(),
        }
    }
}
