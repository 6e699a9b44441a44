//! The response head (httparse) and what it says about the body's framing and the
//! connection's reuse (RFC 9112 §6.3, §9).

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Version};

use super::{ExchangeError, MAX_HEADERS, MAX_HEAD_BYTES, MAX_INTERIM_RESPONSES};
use crate::proxy::headers::is_chunked_alone;

pub(super) struct ResponseHead {
    pub(super) status: StatusCode,
    pub(super) version: Version,
    pub(super) headers: HeaderMap,
    /// A `Connection` field says `close` (whether or not the field went into `headers`).
    pub(super) close: bool,
    /// Framing fields seen while parsing, so that the usual answer, which has only a
    /// `Content-Length`, costs no lookups for the others.
    pub(super) transfer_encoding: bool,
    pub(super) content_length: bool,
}

/// Why a response framed by another transfer coding than `chunked` alone is refused.
pub const TRANSFER_CODING_REFUSED: &str = "a transfer coding other than chunked";
/// Why a `101` is refused when the request sent no `Upgrade`: HTTP/1.1 would take what follows
/// as another protocol, and HTTP/2 has no `101` at all.
pub const UNASKED_SWITCH: &str = "101 Switching Protocols to a request that asked for no upgrade";

pub(super) fn invalid(reason: impl std::fmt::Display) -> ExchangeError {
    ExchangeError::InvalidResponse(reason.to_string())
}

/// A field name as an origin spelled it, and what it parsed to.
pub(super) struct RememberedName {
    pub(super) raw: Box<[u8]>,
    name: HeaderName,
}

/// Longer field names are not remembered between responses (the usual ones are under 30
/// bytes), which bounds what a pooled connection keeps to 100 short names.
pub(super) const MAX_REMEMBERED_NAME_BYTES: usize = 64;

/// What parsing a head keeps between the responses on one connection.
#[derive(Default)]
pub(super) struct HeadScratch {
    /// The last response's field names. An origin answers with the same names, spelled the
    /// same way, in the same order: comparing the bytes with the name at the same place last
    /// time is cheaper than parsing a name again (a match over every standard name, or an
    /// allocation for a custom one).
    pub(super) names: Vec<RememberedName>,
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
/// in the map are views of one copy of the head. A head longer than `MAX_HEAD_BYTES` is refused
/// even when it came whole in one read, so the limit does not depend on how the bytes arrive.
pub(super) fn parse_head(
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
        Ok(httparse::Status::Complete(length)) if length > MAX_HEAD_BYTES => {
            return Err(ExchangeError::HeadTooLarge)
        }
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

/// Takes the heads the bytes read so far hold, up to the final one (not 1xx, or 101): `None`
/// while it has not come whole. Interim heads are skipped, counted in `interim` (the exchange's
/// so far, set back to 0 with the final head), and the one past [`MAX_INTERIM_RESPONSES`] is
/// refused as it arrives. A head is refused past `MAX_HEAD_BYTES` whether it came whole or in
/// pieces: the decision depends on the bytes, never on how the reads cut them.
pub(super) fn next_final_head(
    buffer: &mut BytesMut,
    scratch: &mut HeadScratch,
    interim: &mut usize,
) -> Result<Option<ResponseHead>, ExchangeError> {
    while !buffer.is_empty() {
        let Some(head) = parse_head(buffer, scratch)? else {
            // Incomplete and already at the limit: the head is larger.
            if buffer.len() >= MAX_HEAD_BYTES {
                return Err(ExchangeError::HeadTooLarge);
            }
            return Ok(None);
        };
        if !head.status.is_informational() || head.status == StatusCode::SWITCHING_PROTOCOLS {
            *interim = 0;
            return Ok(Some(head));
        }
        // 100 Continue and its kind: the real answer follows.
        *interim += 1;
        if *interim > MAX_INTERIM_RESPONSES {
            return Err(ExchangeError::TooManyInterim);
        }
    }
    Ok(None)
}

/// What a `Connection` field value says about keeping the connection.
pub(super) struct ConnectionTokens {
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
pub(super) enum Framing {
    Length(u64),
    Chunked(ChunkState),
    UntilClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ChunkState {
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
pub(super) fn response_framing(
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
        // Any other coding would reach the client as the body itself once the field is
        // removed (it is hop-by-hop), and a coded body cannot be passed on as one: refused, as
        // HAProxy does.
        if !is_chunked_alone(headers) {
            return Err(invalid(TRANSFER_CODING_REFUSED));
        }
        // With both fields present the message is suspect: read it by Transfer-Encoding, then
        // close (§6.3 rule 3).
        let keep_alive = keep_alive && !head.content_length;
        return Ok((Framing::Chunked(ChunkState::Size), keep_alive));
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
