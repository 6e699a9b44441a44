//! The HTTP/1.1 client side of a plain `http` target's connections, written for the proxy path.
//!
//! hyper's client connection runs as a task of its own, fed through channels: every request
//! crossed two task hand-offs, and the response head and body came back through two more. Here
//! the request's own task writes the request head, streams the body, parses the response head
//! (httparse) and reads the body straight from the socket; the connection goes back to its
//! [`ConnectionHome`] (its pool, which this codec never names) when the body has been read to
//! its end.
//!
//! By file: `encode` (the request head), `parse` (the response head and its framing), `body`
//! (reading a delimited or chunked body), `exchange` (one request and its response on a
//! connection); this file holds the connection and the errors.
//!
//! Framing follows RFC 9112: a response to HEAD, a 1xx, 204 or 304 has no body; otherwise
//! `Transfer-Encoding: chunked` (last) wins over `Content-Length`; without either the body runs
//! to the end of the connection. A connection is reused only when the response said nothing
//! against it (HTTP/1.1, no `Connection: close`), its body was delimited, the request body went
//! up in full before the response head came, and no byte arrived beyond the response.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::BytesMut;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

mod body;
mod encode;
mod exchange;
mod parse;
#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use body::ResponseBody;
pub use encode::{encode_head, RequestHead};
pub use exchange::finish_exchange;
#[cfg(test)]
use parse::parse_head;
use parse::{next_final_head, HeadScratch, ResponseHead};
pub use parse::{TRANSFER_CODING_REFUSED, UNASKED_SWITCH};

/// At most this many response header fields (hyper's default too).
const MAX_HEADERS: usize = 100;
/// A response head (status line, fields), or a trailer section, larger than this is refused,
/// however its bytes arrive.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// At most this many interim (1xx other than 101) heads may come before the final one: a
/// target sending them without end would hold the exchange until its timeout, parsing.
pub const MAX_INTERIM_RESPONSES: usize = 16;
/// A chunk-size line longer than this is refused.
const MAX_CHUNK_LINE_BYTES: usize = 4 * 1024;
/// Reads start at this size and grow, while they fill the buffer, up to the largest.
const FIRST_READ_BYTES: usize = 8 * 1024;
const LARGEST_READ_BYTES: usize = 64 * 1024;

/// Why an exchange on a connection failed after its request head was written. The messages
/// leave the target's address out: they reach clients inside error answers.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    #[error("writing the request to the target failed")]
    Write(#[source] io::Error),
    #[error("reading the response from the target failed")]
    Read(#[source] io::Error),
    #[error("the target closed the connection before answering")]
    ClosedBeforeResponse,
    #[error("the target closed the connection in the middle of the response head")]
    ClosedInHead,
    #[error("the response head is larger than {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("invalid response from the target: {0}")]
    InvalidResponse(String),
    #[error("more than {MAX_INTERIM_RESPONSES} interim (1xx) responses")]
    TooManyInterim,
    #[error("reading the client's request body failed")]
    RequestBody(#[source] crate::proxy::body::ClientBodyError),
    #[error("the request body is longer than its Content-Length")]
    RequestBodyTooLong,
    #[error("the request body ended before its Content-Length")]
    RequestBodyTooShort,
}

impl ExchangeError {
    /// Why the response was refused, when the target sent one Raahi will not pass on (rather
    /// than breaking the exchange).
    pub fn refused_response(&self) -> Option<String> {
        match self {
            ExchangeError::InvalidResponse(reason) => Some(reason.clone()),
            ExchangeError::HeadTooLarge | ExchangeError::TooManyInterim => Some(self.to_string()),
            _ => None,
        }
    }
}

/// Why reading a response body failed.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("reading the response body from the target failed")]
    Read(#[source] io::Error),
    #[error("the target closed the connection before the end of the response body")]
    ClosedEarly,
    #[error("invalid chunked response body: {0}")]
    InvalidChunk(&'static str),
}

/// Where a connection goes when its exchange ended cleanly and it may carry another: the codec
/// hands it back without knowing who keeps it (a pool, in practice).
pub trait ConnectionHome: Send + Sync + 'static {
    fn take_back(&self, connection: Box<Connection>);
}

/// One keep-alive connection to a target.
pub struct Connection {
    read: OwnedReadHalf,
    /// Gone when an early response left the request body still going up on its own task.
    write: Option<OwnedWriteHalf>,
    /// Bytes read from the target and not yet consumed.
    buffer: BytesMut,
    read_size: usize,
    head_scratch: HeadScratch,
    /// Interim heads of the exchange under way so far.
    interim_heads: usize,
    /// The first bytes of `buffer`, found to be an incomplete head: a head can only end at a
    /// line feed, so the next parse waits for one (a head trickled a byte at a time is parsed
    /// once per line, not once per byte).
    incomplete_head: usize,
    /// Head parses so far, for the tests of the line rule above.
    #[cfg(test)]
    head_parses: usize,
}

impl Connection {
    pub fn new(stream: TcpStream) -> Box<Connection> {
        let (read, write) = stream.into_split();
        Box::new(Connection {
            read,
            write: Some(write),
            buffer: BytesMut::new(),
            read_size: FIRST_READ_BYTES,
            head_scratch: HeadScratch::default(),
            interim_heads: 0,
            incomplete_head: 0,
            #[cfg(test)]
            head_parses: 0,
        })
    }

    /// Whether the connection can carry another request: the target has neither closed it nor
    /// sent anything unasked. Costs no system call unless the socket was reported readable.
    pub fn is_reusable(&self) -> bool {
        if self.write.is_none() || !self.buffer.is_empty() {
            return false;
        }
        // `try_read` reads only when tokio saw the socket readable (else it answers WouldBlock
        // at once), and uses neither the task's budget nor a waker. Readable means stale
        // readiness from the last response (the read then blocks), or the target closed or
        // wrote out of turn.
        let mut probe = [0u8; 1];
        matches!(self.read.try_read(&mut probe), Err(error) if error.kind() == io::ErrorKind::WouldBlock)
    }

    /// Before idling: a read buffer grown by a large body is given back, so an idle
    /// connection holds at most a small one.
    pub fn rest(&mut self) {
        // `capacity()` shows only the unused tail of an allocation that bodies were split from,
        // so growth is told by the read size, which grows only when reads fill the buffer.
        if self.read_size > FIRST_READ_BYTES {
            self.buffer = BytesMut::new();
            self.read_size = FIRST_READ_BYTES;
        }
    }

    /// Writes a request head made by [`encode_head`].
    pub async fn write_head(&mut self, head: &[u8]) -> io::Result<()> {
        use tokio::io::AsyncWriteExt;
        let write = self
            .write
            .as_mut()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))?;
        write.write_all(head).await
    }

    /// Reads into the buffer; `Ok(0)` is the end of the connection.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buffer.capacity() - self.buffer.len() < self.read_size / 4 {
            self.buffer.reserve(self.read_size);
        }
        let room = self.buffer.capacity() - self.buffer.len();
        let read = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.read),
            cx,
            &mut self.buffer
        ))?;
        if read == room && self.read_size < LARGEST_READ_BYTES {
            self.read_size *= 2;
        }
        Poll::Ready(Ok(read))
    }

    /// Reads until a final (non-1xx, or 101) response head has been parsed, skipping at most
    /// [`MAX_INTERIM_RESPONSES`] interim ones.
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<ResponseHead, ExchangeError>> {
        loop {
            let may_end = self.buffer[self.incomplete_head..].contains(&b'\n');
            if may_end {
                #[cfg(test)]
                {
                    self.head_parses += 1;
                }
                if let Some(head) = next_final_head(
                    &mut self.buffer,
                    &mut self.head_scratch,
                    &mut self.interim_heads,
                )? {
                    self.incomplete_head = 0;
                    return Poll::Ready(Ok(head));
                }
                self.incomplete_head = self.buffer.len();
            } else if self.buffer.len() >= MAX_HEAD_BYTES {
                // The same answer the parse would give: incomplete at the limit.
                return Poll::Ready(Err(ExchangeError::HeadTooLarge));
            }
            let had = self.buffer.len();
            if ready!(self.poll_fill(cx)).map_err(ExchangeError::Read)? == 0 {
                return Poll::Ready(Err(if had == 0 {
                    ExchangeError::ClosedBeforeResponse
                } else {
                    ExchangeError::ClosedInHead
                }));
            }
        }
    }
}
