//! The request head, written straight from the request kept for retries.

use http::header::{self, HeaderMap, HeaderValue};
use http::Method;
use http_body::Body;

use crate::proxy::body::UpstreamRequestBody;

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

/// The request head in HTTP/1.1 wire form, and how its body is framed: a Content-Length given
/// is kept; a body of unknown length goes chunked, whatever the method (a GET with a body,
/// as search APIs take, must reach the target whole; hyper's client would drop it).
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

pub(super) fn put_field(wire: &mut Vec<u8>, name: &str, value: &[u8]) {
    wire.extend_from_slice(name.as_bytes());
    wire.extend_from_slice(b": ");
    wire.extend_from_slice(value);
    wire.extend_from_slice(b"\r\n");
}
