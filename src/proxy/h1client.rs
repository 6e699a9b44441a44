//! The HTTP/1.1 client side of a plain `http` target's connections, written for the proxy path.
//!
//! hyper's client connection runs as a task of its own, fed through channels: every request
//! crossed two task hand-offs, and the response head and body came back through two more. Here
//! the request's own task writes the request head, streams the body, parses the response head
//! (httparse) and reads the body straight from the socket; the connection goes back to its pool
//! when the body has been read to its end.
//!
//! Framing follows RFC 9112: a response to HEAD, a 1xx, 204 or 304 has no body; otherwise
//! `Transfer-Encoding: chunked` (last) wins over `Content-Length`; without either the body runs
//! to the end of the connection. A connection is reused only when the response said nothing
//! against it (HTTP/1.1, no `Connection: close`), its body was delimited, the request body went
//! up in full before the response head came, and no byte arrived beyond the response.

use std::future::poll_fn;
use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Body, Frame, SizeHint};
use tokio::io::AsyncWrite;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::body::UpstreamRequestBody;
use super::pool::TargetPool;

/// At most this many response header fields (hyper's default too).
const MAX_HEADERS: usize = 100;
/// A response head (status line, fields) larger than this is refused.
const MAX_HEAD_BYTES: usize = 64 * 1024;
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
    #[error("reading the client's request body failed")]
    RequestBody(#[source] hyper::Error),
    #[error("the request body is longer than its Content-Length")]
    RequestBodyTooLong,
    #[error("the request body ended before its Content-Length")]
    RequestBodyTooShort,
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

/// One keep-alive connection to a target.
pub struct Connection {
    read: OwnedReadHalf,
    /// Gone when an early response left the request body still going up on its own task.
    write: Option<OwnedWriteHalf>,
    /// Bytes read from the target and not yet consumed.
    buffer: BytesMut,
    read_size: usize,
    head_scratch: HeadScratch,
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
    fn rest(&mut self) {
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

    /// Reads until a final (non-1xx, or 101) response head has been parsed.
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<Result<ResponseHead, ExchangeError>> {
        loop {
            if !self.buffer.is_empty() {
                if let Some(head) = parse_head(&mut self.buffer, &mut self.head_scratch)? {
                    let informational = head.status.is_informational()
                        && head.status != StatusCode::SWITCHING_PROTOCOLS;
                    if !informational {
                        return Poll::Ready(Ok(head));
                    }
                    // 100 Continue and its kind: the real answer follows.
                    continue;
                }
                if self.buffer.len() >= MAX_HEAD_BYTES {
                    return Poll::Ready(Err(ExchangeError::HeadTooLarge));
                }
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

/// How the request body goes up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFraming {
    None,
    Length(u64),
    Chunked,
}

/// What one attempt sends as its head, borrowed from the request kept for retries: nothing is
/// copied but into the wire bytes.
pub struct RequestHead<'a> {
    pub method: &'a Method,
    pub path_and_query: &'a str,
    pub headers: &'a HeaderMap,
    /// Sent as `Host` in place of any `Host` in `headers`.
    pub host: Option<&'a HeaderValue>,
}

/// The request head in HTTP/1.1 wire form, and how its body is framed. Like hyper's client:
/// a Content-Length given is kept; a body of unknown length goes chunked, except for GET, HEAD
/// and CONNECT, which are sent without one.
pub fn encode_head(
    head: &RequestHead<'_>,
    body: &UpstreamRequestBody,
) -> (Vec<u8>, RequestFraming) {
    let headers = head.headers;
    let declared_length = || {
        headers
            .get(header::CONTENT_LENGTH)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    let mut add_length = None;
    let mut add_chunked = false;
    let framing = if body.is_end_stream() {
        RequestFraming::None
    } else if let Some(length) = declared_length() {
        RequestFraming::Length(length)
    } else if let Some(length) = body.size_hint().exact() {
        add_length = Some(length);
        RequestFraming::Length(length)
    } else if matches!(*head.method, Method::GET | Method::HEAD | Method::CONNECT) {
        RequestFraming::None
    } else {
        add_chunked = true;
        RequestFraming::Chunked
    };

    let fields_length: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum();
    let mut wire = Vec::with_capacity(head.path_and_query.len() + fields_length + 96);
    wire.extend_from_slice(head.method.as_str().as_bytes());
    wire.push(b' ');
    // origin-form always starts with '/' (a bare "?query" or nothing means the root); "*" is
    // OPTIONS's asterisk-form.
    if !head.path_and_query.starts_with('/') && head.path_and_query != "*" {
        wire.push(b'/');
    }
    wire.extend_from_slice(head.path_and_query.as_bytes());
    wire.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = head.host {
        put_field(&mut wire, "host", host.as_bytes());
    }
    for (name, value) in headers {
        // A length that contradicts the chosen framing must not go up with it.
        let skipped = (name == header::HOST && head.host.is_some())
            || name == header::TRANSFER_ENCODING
            || (name == header::CONTENT_LENGTH && framing == RequestFraming::Chunked);
        if !skipped {
            put_field(&mut wire, name.as_str(), value.as_bytes());
        }
    }
    if let Some(length) = add_length {
        put_field(&mut wire, "content-length", length.to_string().as_bytes());
    }
    if add_chunked {
        put_field(&mut wire, "transfer-encoding", b"chunked");
    }
    wire.extend_from_slice(b"\r\n");
    (wire, framing)
}

fn put_field(wire: &mut Vec<u8>, name: &str, value: &[u8]) {
    wire.extend_from_slice(name.as_bytes());
    wire.extend_from_slice(b": ");
    wire.extend_from_slice(value);
    wire.extend_from_slice(b"\r\n");
}

struct ResponseHead {
    status: StatusCode,
    version: Version,
    headers: HeaderMap,
    /// A `Connection` field says `close` (whether or not the field went into `headers`).
    close: bool,
    /// Framing fields seen while parsing, so that the usual answer, which has only a
    /// `Content-Length`, costs no lookups for the others.
    transfer_encoding: bool,
    content_length: bool,
}

fn invalid(reason: impl std::fmt::Display) -> ExchangeError {
    ExchangeError::InvalidResponse(reason.to_string())
}

/// A field name as an origin spelled it, and what it parsed to.
struct RememberedName {
    raw: Box<[u8]>,
    name: HeaderName,
}

/// Longer field names are not remembered between responses (the usual ones are under 30
/// bytes), which bounds what a pooled connection keeps to 100 short names.
const MAX_REMEMBERED_NAME_BYTES: usize = 64;

/// What parsing a head keeps between the responses on one connection.
#[derive(Default)]
struct HeadScratch {
    /// The last response's field names. An origin answers with the same names, spelled the
    /// same way, in the same order: comparing the bytes with the name at the same place last
    /// time is cheaper than parsing a name again (a match over every standard name, or an
    /// allocation for a custom one).
    names: Vec<RememberedName>,
    /// Where each value of the head being parsed lies in it.
    values: Vec<(usize, usize)>,
}

impl HeadScratch {
    /// The name of the kept field at `index`, spelled `raw`.
    fn name_at(&mut self, index: usize, raw: &str) -> Result<HeaderName, ExchangeError> {
        if let Some(last) = self.names.get(index) {
            if *last.raw == *raw.as_bytes() {
                return Ok(last.name.clone());
            }
        }
        let name = HeaderName::from_bytes(raw.as_bytes()).map_err(invalid)?;
        // The slot is written even for a long name, since the head is built from the slots; its
        // empty spelling is never recalled, and `forget_long_names` frees the name afterwards.
        let raw = if raw.len() <= MAX_REMEMBERED_NAME_BYTES {
            raw.as_bytes().into()
        } else {
            Box::default()
        };
        let remembered = RememberedName {
            raw,
            name: name.clone(),
        };
        match self.names.get_mut(index) {
            Some(slot) => *slot = remembered,
            None => self.names.push(remembered),
        }
        Ok(name)
    }

    /// Once a head is built: the names too long to remember give their memory back. Their
    /// slots keep an empty spelling, which no field matches, so a later head parses its own
    /// name there; the placeholder name is never used.
    fn forget_long_names(&mut self) {
        for remembered in &mut self.names {
            if remembered.raw.is_empty() {
                remembered.name = header::VIA;
            }
        }
    }
}

/// Parses one response head off the front of `buffer`; `None` until it is complete. The values
/// in the map are views of one copy of the head.
fn parse_head(
    buffer: &mut BytesMut,
    scratch: &mut HeadScratch,
) -> Result<Option<ResponseHead>, ExchangeError> {
    let mut slots: [MaybeUninit<httparse::Header<'_>>; MAX_HEADERS] =
        [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut []);
    let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut response,
        buffer,
        &mut slots,
    );
    let length = match parsed {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(error) => return Err(invalid(error)),
    };
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| invalid("bad status code"))?;
    let version = match response.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let head_start = buffer.as_ptr() as usize;
    let mut close = false;
    let (mut content_length, mut transfer_encoding) = (false, false);
    let mut kept = 0;
    scratch.values.clear();
    for field in response.headers.iter() {
        // The usual connection fields are read here and never enter the map, which saves
        // building them and removing them again as hop-by-hop. A `Connection` naming anything
        // else (`upgrade`, other fields) goes in, for the hop-by-hop rules to act on.
        if field.name.eq_ignore_ascii_case("keep-alive") {
            continue;
        }
        if field.name.eq_ignore_ascii_case("connection") {
            let tokens = ConnectionTokens::of(field.value);
            close |= tokens.close;
            if tokens.only_persistence {
                continue;
            }
        }
        // Parsed (or recalled) now, while the head's bytes are borrowed; used below.
        let name = scratch.name_at(kept, field.name)?;
        if name == header::CONTENT_LENGTH {
            content_length = true;
        } else if name == header::TRANSFER_ENCODING {
            transfer_encoding = true;
        }
        let value_start = field.value.as_ptr() as usize - head_start;
        scratch
            .values
            .push((value_start, value_start + field.value.len()));
        kept += 1;
    }
    // One copy of the head, sized to it: the values are views of it. Views of the read
    // buffer itself would keep the whole buffer alive as long as any value lives, and an
    // HTTP/2 client's header table keeps some for the connection's life.
    let head = Bytes::copy_from_slice(&buffer[..length]);
    buffer.advance(length);
    // Room for the fields the proxy adds to every answer (`Via`, `X-Request-Id`), so adding
    // them does not grow the map.
    let mut headers = HeaderMap::with_capacity(kept + 2);
    for (remembered, &(start, end)) in scratch.names.iter().zip(&scratch.values) {
        let value = HeaderValue::from_maybe_shared(head.slice(start..end)).map_err(invalid)?;
        headers.append(remembered.name.clone(), value);
    }
    scratch.forget_long_names();
    Ok(Some(ResponseHead {
        status,
        version,
        headers,
        close,
        transfer_encoding,
        content_length,
    }))
}

/// What a `Connection` field value says about keeping the connection.
struct ConnectionTokens {
    close: bool,
    /// Nothing but `close` and `keep-alive`: the field need not be forwarded or looked at again.
    only_persistence: bool,
}

impl ConnectionTokens {
    fn of(value: &[u8]) -> ConnectionTokens {
        let mut tokens = ConnectionTokens {
            close: false,
            only_persistence: true,
        };
        for token in value.split(|&byte| byte == b',') {
            let token = token.trim_ascii();
            if token.eq_ignore_ascii_case(b"close") {
                tokens.close = true;
            } else if !token.is_empty() && !token.eq_ignore_ascii_case(b"keep-alive") {
                tokens.only_persistence = false;
            }
        }
        tokens
    }
}

/// How the response body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked(ChunkState),
    UntilClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// After the last chunk: trailer fields up to an empty line.
    Trailers,
}

/// RFC 9112 §6.3, for a response: `(framing, the connection may carry another exchange)`.
fn response_framing(
    method_is_head: bool,
    head: &ResponseHead,
) -> Result<(Framing, bool), ExchangeError> {
    let headers = &head.headers;
    let keep_alive = head.version == Version::HTTP_11 && !head.close;
    if method_is_head
        || head.status.is_informational()
        || head.status == StatusCode::NO_CONTENT
        || head.status == StatusCode::NOT_MODIFIED
    {
        return Ok((Framing::Length(0), keep_alive));
    }
    if head.transfer_encoding {
        let chunked_last = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .next_back()
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.rsplit(',').next())
            .is_some_and(|coding| coding.trim().eq_ignore_ascii_case("chunked"));
        // With both fields present the message is suspect: read it by Transfer-Encoding, then
        // close (§6.3 rule 3).
        let keep_alive = keep_alive && !head.content_length;
        return Ok(if chunked_last {
            (Framing::Chunked(ChunkState::Size), keep_alive)
        } else {
            (Framing::UntilClose, false)
        });
    }
    if !head.content_length {
        return Ok((Framing::UntilClose, false));
    }
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        for item in value
            .to_str()
            .map_err(|_| invalid("bad Content-Length"))?
            .split(',')
        {
            let item = item.trim();
            if item.is_empty() || !item.bytes().all(|b| b.is_ascii_digit()) {
                return Err(invalid("bad Content-Length"));
            }
            let parsed: u64 = item.parse().map_err(|_| invalid("bad Content-Length"))?;
            if length.is_some_and(|seen| seen != parsed) {
                return Err(invalid("conflicting Content-Length values"));
            }
            length = Some(parsed);
        }
    }
    Ok(match length {
        Some(length) => (Framing::Length(length), keep_alive),
        None => (Framing::UntilClose, false),
    })
}

/// Sends the request body and reads the response head on `connection`, whose request head has
/// been written. The request body goes up while the head is awaited, since a target may answer
/// early (e.g. 413); if it does, the rest of the body goes up on a task of its own and the
/// connection is closed after this exchange.
pub async fn finish_exchange(
    mut connection: Box<Connection>,
    method_is_head: bool,
    body: UpstreamRequestBody,
    framing: RequestFraming,
    pool: Arc<TargetPool>,
) -> Result<Response<ResponseBody>, ExchangeError> {
    // A body not sent (a GET's of unknown length, like hyper's client) is dropped unread,
    // which hands it back to the caller.
    let mut upload = match framing {
        RequestFraming::None => None,
        framing => Some(Upload::new(body, framing)),
    };
    // A target may refuse the body and answer at once, then reset the connection: the write
    // fails while the answer waits, readable, in the socket. So a failed write stops the upload
    // but the head is still read; the write error is what is reported only if none comes.
    let mut write_failed = None;
    let mut upload_stop = None;
    let head = match &mut upload {
        None => poll_fn(|cx| connection.poll_head(cx)).await?,
        Some(upload) => {
            poll_fn(|cx| {
                if !upload.done && write_failed.is_none() {
                    if let Some(write) = connection.write.as_mut() {
                        match upload.poll_send(cx, write) {
                            Poll::Ready(Err(error @ ExchangeError::Write(_))) => {
                                write_failed = Some(error);
                            }
                            Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                            _ => {}
                        }
                    }
                }
                match connection.poll_head(cx) {
                    Poll::Ready(Err(error)) => {
                        Poll::Ready(Err(write_failed.take().unwrap_or(error)))
                    }
                    polled => polled,
                }
            })
            .await?
        }
    };
    let (mut framing, mut reusable) = response_framing(method_is_head, &head)?;
    if write_failed.is_some() {
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
    let upgraded = head.status == StatusCode::SWITCHING_PROTOCOLS;
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
        pool,
    };
    if body.is_end_stream() && !upgraded {
        body.release();
    }
    Ok(response.map(|()| body))
}

/// A request body going up, framed as its head said.
struct Upload {
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

/// A response body read straight off its connection. The connection goes back to its pool the
/// moment the body's last byte is read (when it may be reused); a body dropped before its end
/// closes it.
pub struct ResponseBody {
    connection: Option<Box<Connection>>,
    framing: Framing,
    reusable: bool,
    upgraded: bool,
    /// Ends the task still sending the request body after an early answer, when dropped.
    upload_stop: Option<oneshot::Sender<()>>,
    pool: Arc<TargetPool>,
}

impl ResponseBody {
    fn release(&mut self) {
        if let Some(mut connection) = self.connection.take() {
            // A target that closed right after its answer is seen here, when its FIN came
            // with the answer: the pool then never holds it.
            if self.reusable && connection.is_reusable() {
                connection.rest();
                self.pool.put_back(connection);
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

enum ChunkStep {
    /// Moved on without data (a size line or a data CRLF was consumed).
    Next(ChunkState),
    Data(Bytes, ChunkState),
    /// The last chunk and trailer section were read; the trailer fields if there were any.
    End(Option<HeaderMap>),
    NeedMore,
}

/// One step of chunked decoding over the bytes buffered so far.
fn decode_chunk(buffer: &mut BytesMut, state: ChunkState) -> Result<ChunkStep, BodyError> {
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
        ChunkState::Trailers => {
            let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
            match httparse::parse_headers(buffer, &mut fields) {
                Ok(httparse::Status::Complete((length, fields))) => {
                    let trailers = (!fields.is_empty())
                        .then(|| trailer_map(fields))
                        .transpose()?;
                    buffer.advance(length);
                    Ok(ChunkStep::End(trailers))
                }
                Ok(httparse::Status::Partial) if buffer.len() > MAX_HEAD_BYTES => {
                    Err(BodyError::InvalidChunk("trailer section too large"))
                }
                Ok(httparse::Status::Partial) => Ok(ChunkStep::NeedMore),
                Err(_) => Err(BodyError::InvalidChunk("bad trailer field")),
            }
        }
    }
}

fn trailer_map(fields: &[httparse::Header<'_>]) -> Result<HeaderMap, BodyError> {
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

fn find_crlf(buffer: &[u8]) -> Option<usize> {
    buffer.windows(2).position(|pair| pair == b"\r\n")
}

/// `1*HEXDIG [ BWS ; chunk-ext ]`; the extensions are ignored.
fn parse_chunk_size(line: &[u8]) -> Result<u64, BodyError> {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn head(status: u16, version: Version, fields: &[(&str, &str)]) -> ResponseHead {
        let minor = if version == Version::HTTP_10 { 0 } else { 1 };
        let mut wire = format!("HTTP/1.{minor} {status} Whatever\r\n");
        for (name, value) in fields {
            wire.push_str(&format!("{name}: {value}\r\n"));
        }
        wire.push_str("\r\n");
        let mut buffer = BytesMut::from(wire.as_bytes());
        parse_head(&mut buffer, &mut HeadScratch::default())
            .unwrap()
            .expect("a whole head")
    }

    fn framing_of(method: Method, head: &ResponseHead) -> (Framing, bool) {
        response_framing(method == Method::HEAD, head).unwrap()
    }

    #[test]
    fn bodiless_answers_have_no_body_whatever_they_declare() {
        let declared = [("content-length", "10")];
        for status in [204, 304] {
            let answer = head(status, Version::HTTP_11, &declared);
            assert_eq!(framing_of(Method::GET, &answer), (Framing::Length(0), true));
        }
        let ok = head(200, Version::HTTP_11, &declared);
        assert_eq!(framing_of(Method::HEAD, &ok), (Framing::Length(0), true));
    }

    #[test]
    fn chunked_wins_over_a_length_and_then_the_connection_closes() {
        let both = head(
            200,
            Version::HTTP_11,
            &[
                ("content-length", "5"),
                ("transfer-encoding", "gzip, chunked"),
            ],
        );
        assert_eq!(
            framing_of(Method::GET, &both),
            (Framing::Chunked(ChunkState::Size), false)
        );
        let not_last = head(
            200,
            Version::HTTP_11,
            &[("transfer-encoding", "chunked, gzip")],
        );
        assert_eq!(
            framing_of(Method::GET, &not_last),
            (Framing::UntilClose, false)
        );
    }

    #[test]
    fn lengths_must_agree_and_be_digits() {
        let same = head(200, Version::HTTP_11, &[("content-length", "3, 3")]);
        assert_eq!(framing_of(Method::GET, &same), (Framing::Length(3), true));
        for bad in ["3, 4", "-1", "+3", "", "0x10"] {
            let answer = head(200, Version::HTTP_11, &[("content-length", bad)]);
            assert!(response_framing(false, &answer).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reuse_needs_http11_without_close_and_a_delimited_body() {
        let close = head(
            200,
            Version::HTTP_11,
            &[("content-length", "1"), ("connection", "Close")],
        );
        assert!(!framing_of(Method::GET, &close).1);
        let old = head(200, Version::HTTP_10, &[("content-length", "1")]);
        assert!(!framing_of(Method::GET, &old).1);
        let open_ended = head(200, Version::HTTP_11, &[]);
        assert_eq!(
            framing_of(Method::GET, &open_ended),
            (Framing::UntilClose, false)
        );
    }

    #[test]
    fn persistence_fields_are_read_and_left_out() {
        let mut buffer = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, close\r\nKeep-Alive: timeout=5\r\nContent-Length: 0\r\n\r\n"[..],
        );
        let parsed = parse_head(&mut buffer, &mut HeadScratch::default())
            .unwrap()
            .unwrap();
        assert!(parsed.close);
        assert_eq!(parsed.headers.len(), 1, "{:?}", parsed.headers);
        assert!(!framing_of(Method::GET, &parsed).1, "close is honoured");
        let mut upgrade = BytesMut::from(
            &b"HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\r\n"[..],
        );
        let parsed = parse_head(&mut upgrade, &mut HeadScratch::default())
            .unwrap()
            .unwrap();
        assert_eq!(
            parsed.headers["connection"], "upgrade",
            "other tokens stay for the hop-by-hop rules"
        );
        assert!(!parsed.close);
    }

    #[test]
    fn names_remembered_from_the_last_head_never_replace_different_ones() {
        let mut scratch = HeadScratch::default();
        let mut first = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nServer: a\r\nX-One: 1\r\nContent-Length: 0\r\n\r\n"[..],
        );
        let parsed = parse_head(&mut first, &mut scratch).unwrap().unwrap();
        let names: Vec<_> = parsed.headers.keys().map(|name| name.as_str()).collect();
        assert_eq!(names, ["server", "x-one", "content-length"]);
        let mut second = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nSERVER: b\r\nX-Two: 2\r\nX-One: 3\r\nContent-Length: 0\r\nX-Last: \xe9\r\n\r\n"[..],
        );
        let parsed = parse_head(&mut second, &mut scratch).unwrap().unwrap();
        let fields: Vec<_> = parsed
            .headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes()))
            .collect();
        assert_eq!(
            fields,
            [
                ("server", &b"b"[..]),
                ("x-two", b"2"),
                ("x-one", b"3"),
                ("content-length", b"0"),
                ("x-last", b"\xe9"),
            ]
        );
        let mut third = BytesMut::from(&b"HTTP/1.1 204 No Content\r\nX-Two: 4\r\n\r\n"[..]);
        let parsed = parse_head(&mut third, &mut scratch).unwrap().unwrap();
        assert_eq!(parsed.headers.len(), 1);
        assert_eq!(parsed.headers["x-two"], "4");

        let long = "X-".to_owned() + &"l".repeat(MAX_REMEMBERED_NAME_BYTES);
        for _ in 0..2 {
            let wire = format!("HTTP/1.1 200 OK\r\nServer: c\r\n{long}: 5\r\n\r\n");
            let mut head = BytesMut::from(wire.as_bytes());
            let parsed = parse_head(&mut head, &mut scratch).unwrap().unwrap();
            assert_eq!(parsed.headers[long.to_ascii_lowercase().as_str()], "5");
            assert_eq!(parsed.headers.len(), 2);
            assert!(scratch.names[1].raw.is_empty(), "a long name is not kept");
        }
        let mut after = BytesMut::from(&b"HTTP/1.1 200 OK\r\nServer: d\r\nX-Short: 6\r\n\r\n"[..]);
        let parsed = parse_head(&mut after, &mut scratch).unwrap().unwrap();
        let fields: Vec<_> = parsed.headers.keys().map(|name| name.as_str()).collect();
        assert_eq!(fields, ["server", "x-short"]);
    }

    #[test]
    fn a_head_is_parsed_only_once_complete() {
        let mut buffer = BytesMut::from(&b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-A: b"[..]);
        assert!(parse_head(&mut buffer, &mut HeadScratch::default())
            .unwrap()
            .is_none());
        buffer.extend_from_slice(b"\r\n\r\nok");
        let parsed = parse_head(&mut buffer, &mut HeadScratch::default())
            .unwrap()
            .unwrap();
        assert_eq!(parsed.status, StatusCode::OK);
        assert_eq!(parsed.headers["x-a"], "b");
        assert_eq!(&buffer[..], b"ok", "the body stays in the buffer");
        let mut garbage = BytesMut::from(&b"HTTP/1.1 2x0 OK\r\n\r\n"[..]);
        assert!(parse_head(&mut garbage, &mut HeadScratch::default()).is_err());
    }

    /// Feeds `wire` to the chunked decoder `split` bytes at a time.
    fn decode_all(wire: &[u8], split: usize) -> Result<(Vec<u8>, Option<HeaderMap>), BodyError> {
        let mut buffer = BytesMut::new();
        let mut fed = 0;
        let mut state = ChunkState::Size;
        let mut body = Vec::new();
        loop {
            match decode_chunk(&mut buffer, state)? {
                ChunkStep::Next(next) => state = next,
                ChunkStep::Data(data, next) => {
                    body.extend_from_slice(&data);
                    state = next;
                }
                ChunkStep::End(trailers) => {
                    assert!(buffer.is_empty(), "nothing beyond the body is consumed");
                    return Ok((body, trailers));
                }
                ChunkStep::NeedMore => {
                    assert!(
                        fed < wire.len(),
                        "decoder wants more than the whole message"
                    );
                    let end = (fed + split).min(wire.len());
                    buffer.extend_from_slice(&wire[fed..end]);
                    fed = end;
                }
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_across_any_split() {
        let wire = b"5;ext=1\r\nhello\r\n1A\r\nabcdefghijklmnopqrstuvwxyz\r\n0\r\nx-sum: 9\r\n\r\n";
        for split in [1, 2, 3, 7, wire.len()] {
            let (body, trailers) = decode_all(wire, split).unwrap();
            assert_eq!(body, b"helloabcdefghijklmnopqrstuvwxyz");
            assert_eq!(trailers.unwrap()["x-sum"], "9");
        }
        let (body, trailers) = decode_all(b"0\r\n\r\n", 1).unwrap();
        assert!(body.is_empty() && trailers.is_none());
    }

    #[test]
    fn broken_chunked_bodies_are_errors() {
        for wire in [
            &b"zz\r\n"[..],
            b"5\r\nhelloXX",
            b"5 x\r\nhello\r\n0\r\n\r\n",
            b"5;a\nb\r\nhello\r\n0\r\n\r\n",
        ] {
            assert!(
                decode_all(wire, 1).is_err(),
                "{:?}",
                String::from_utf8_lossy(wire)
            );
        }
    }

    #[test]
    fn heads_keep_the_given_length_or_choose_chunked() {
        let mut headers = HeaderMap::new();
        headers.insert("host", HeaderValue::from_static("client-chosen"));
        headers.insert("x-kept", HeaderValue::from_static("1"));
        let target_host = HeaderValue::from_static("svc");
        let head = |method: &'static Method, host: Option<&'static HeaderValue>| RequestHead {
            method,
            path_and_query: "/up?x=1",
            headers: Box::leak(Box::new(headers.clone())),
            host,
        };
        let (wire, framing) = encode_head(&head(&Method::GET, None), &UpstreamRequestBody::Empty);
        assert_eq!(
            wire,
            b"GET /up?x=1 HTTP/1.1\r\nhost: client-chosen\r\nx-kept: 1\r\n\r\n"
        );
        assert_eq!(framing, RequestFraming::None);
        let target_host: &'static HeaderValue = Box::leak(Box::new(target_host));
        let (wire, _) = encode_head(
            &head(&Method::POST, Some(target_host)),
            &UpstreamRequestBody::Empty,
        );
        assert_eq!(
            wire, b"POST /up?x=1 HTTP/1.1\r\nhost: svc\r\nx-kept: 1\r\n\r\n",
            "the chosen Host replaces the client's"
        );
        let bare_query = RequestHead {
            method: &Method::GET,
            path_and_query: "?x=1",
            headers: &HeaderMap::new(),
            host: None,
        };
        let (wire, _) = encode_head(&bare_query, &UpstreamRequestBody::Empty);
        assert!(
            wire.starts_with(b"GET /?x=1 HTTP/1.1\r\n"),
            "origin-form starts with '/'"
        );
    }
}

#[cfg(test)]
mod proptests;
