//! Unit tests of the codec's pieces.

use super::body::{decode_chunk, ChunkStep};
use super::encode::RequestFraming;
use super::parse::{
    next_final_head, response_framing, ChunkState, Framing, MAX_REMEMBERED_NAME_BYTES,
};
use super::*;
use crate::proxy::body::UpstreamRequestBody;
use bytes::BytesMut;
use http::header::{HeaderMap, HeaderValue};
use http::{Method, StatusCode, Version};

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
        &[("content-length", "5"), ("transfer-encoding", "chunked")],
    );
    assert_eq!(
        framing_of(Method::GET, &both),
        (Framing::Chunked(ChunkState::Size), false)
    );
}

/// Transfer-Encoding is hop-by-hop: a body under any coding but `chunked` alone would reach the
/// client as the coded bytes themselves, so the answer is refused (HAProxy's 502), whatever
/// else frames it. A bodiless answer says nothing by it.
#[test]
fn a_coding_other_than_chunked_alone_is_refused() {
    for coding in [
        "gzip",
        "gzip, chunked",
        "chunked, gzip",
        "chunked, chunked",
        "identity",
        "x-custom",
    ] {
        let coded = head(200, Version::HTTP_11, &[("transfer-encoding", coding)]);
        let error = response_framing(false, &coded).expect_err(coding);
        assert!(
            matches!(&error, ExchangeError::InvalidResponse(reason) if reason == TRANSFER_CODING_REFUSED),
            "{coding}: {error}"
        );
        assert!(error.refused_response().is_some());
        let with_length = head(
            200,
            Version::HTTP_11,
            &[("transfer-encoding", coding), ("content-length", "3")],
        );
        assert!(response_framing(false, &with_length).is_err(), "{coding}");
    }
    let split = head(
        200,
        Version::HTTP_11,
        &[
            ("transfer-encoding", "gzip"),
            ("transfer-encoding", "chunked"),
        ],
    );
    assert!(response_framing(false, &split).is_err());
    let not_modified = head(304, Version::HTTP_11, &[("transfer-encoding", "gzip")]);
    assert_eq!(
        framing_of(Method::GET, &not_modified),
        (Framing::Length(0), true)
    );
    let ok = head(200, Version::HTTP_11, &[("transfer-encoding", "gzip")]);
    assert_eq!(framing_of(Method::HEAD, &ok), (Framing::Length(0), true));
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

/// What reading heads off `wire`, fed in pieces of `piece` bytes, comes to: the final head's
/// status, or the error.
fn final_head_in_pieces(wire: &[u8], piece: usize) -> Result<Option<StatusCode>, ExchangeError> {
    let mut buffer = BytesMut::new();
    let (mut scratch, mut interim) = (HeadScratch::default(), 0);
    for piece in wire.chunks(piece) {
        buffer.extend_from_slice(piece);
        if let Some(head) = next_final_head(&mut buffer, &mut scratch, &mut interim)? {
            return Ok(Some(head.status));
        }
    }
    Ok(None)
}

/// A final head of exactly `length` bytes.
fn head_of_length(length: usize) -> Vec<u8> {
    let bare = b"HTTP/1.1 200 OK\r\nx-pad: \r\ncontent-length: 0\r\n\r\n".len();
    format!(
        "HTTP/1.1 200 OK\r\nx-pad: {}\r\ncontent-length: 0\r\n\r\n",
        "p".repeat(length - bare)
    )
    .into_bytes()
}

#[test]
fn a_head_over_the_limit_is_refused_whole_or_in_pieces() {
    let at_limit = head_of_length(MAX_HEAD_BYTES);
    assert_eq!(at_limit.len(), MAX_HEAD_BYTES);
    for piece in [1000, 8 * 1024, at_limit.len()] {
        assert_eq!(
            final_head_in_pieces(&at_limit, piece).unwrap(),
            Some(StatusCode::OK),
            "pieces of {piece}"
        );
    }
    for length in [MAX_HEAD_BYTES + 1, 120 * 1024] {
        let over = head_of_length(length);
        for piece in [1000, 8 * 1024, 64 * 1024, over.len()] {
            let error = final_head_in_pieces(&over, piece).expect_err("over the limit");
            assert!(
                matches!(error, ExchangeError::HeadTooLarge),
                "{length} bytes in pieces of {piece}: {error}"
            );
        }
    }
}

#[test]
fn sixteen_interim_heads_pass_and_the_seventeenth_is_refused() {
    let interim = |count: usize| {
        let mut wire = Vec::new();
        for at in 0..count {
            let status = [100, 102, 103][at % 3];
            wire.extend_from_slice(
                format!("HTTP/1.1 {status} Interim\r\nx-n: {at}\r\n\r\n").as_bytes(),
            );
        }
        wire
    };
    let mut sixteen = interim(MAX_INTERIM_RESPONSES);
    sixteen.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
    let mut seventeen = interim(MAX_INTERIM_RESPONSES + 1);
    seventeen.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
    for piece in [1, 7, 64, 1 << 20] {
        assert_eq!(
            final_head_in_pieces(&sixteen, piece).unwrap(),
            Some(StatusCode::OK)
        );
        let error = final_head_in_pieces(&seventeen, piece).expect_err("17 interim heads");
        assert!(matches!(error, ExchangeError::TooManyInterim), "{error}");
        // Refused as the 17th arrives, before any final head.
        let error = final_head_in_pieces(&interim(17), piece).expect_err("17, nothing after");
        assert!(matches!(error, ExchangeError::TooManyInterim), "{error}");
    }
    // A 101 is final, and the count is the exchange's: the next one may have 16 again.
    let mut buffer = BytesMut::from(&sixteen[..]);
    buffer.extend_from_slice(&sixteen);
    buffer.extend_from_slice(&interim(3));
    buffer.extend_from_slice(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n\r\n");
    let (mut scratch, mut count) = (HeadScratch::default(), 0);
    for expected in [200, 200, 101] {
        let head = next_final_head(&mut buffer, &mut scratch, &mut count)
            .unwrap()
            .unwrap();
        assert_eq!(head.status, expected);
        assert_eq!(count, 0);
    }
}

#[test]
fn a_trailer_section_over_the_limit_is_refused_whole_or_in_pieces() {
    let body = |section: usize| {
        let bare = b"x-pad: \r\n\r\n".len();
        format!(
            "5\r\nhello\r\n0\r\nx-pad: {}\r\n\r\n",
            "t".repeat(section - bare)
        )
        .into_bytes()
    };
    let at_limit = body(MAX_HEAD_BYTES);
    for split in [1000, 8 * 1024, at_limit.len()] {
        let (payload, trailers) = decode_all(&at_limit, split).unwrap();
        assert_eq!(payload, b"hello");
        assert_eq!(trailers.unwrap()["x-pad"].len(), MAX_HEAD_BYTES - 11);
    }
    for section in [MAX_HEAD_BYTES + 1, 120 * 1024] {
        let over = body(section);
        for split in [1000, 8 * 1024, 64 * 1024, over.len()] {
            let error = decode_all(&over, split).expect_err("over the limit");
            assert!(
                error.to_string().contains("trailer section too large"),
                "{section} bytes in pieces of {split}: {error}"
            );
        }
    }
}

/// A head trickled a byte at a time is parsed when a line ends, not for every byte: a target
/// writing its head slowly costs one parse per line, not one per byte (quadratic in the head).
#[tokio::test]
async fn a_head_trickled_a_byte_at_a_time_is_parsed_once_per_line() {
    use std::task::Poll;
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (mut target, _) = listener.accept().await.unwrap();
    let mut connection = Connection::new(client);
    let mut wire = b"HTTP/1.1 200 OK\r\n".to_vec();
    for field in 0..50 {
        wire.extend_from_slice(format!("x-field-{field}: {}\r\n", "v".repeat(100)).as_bytes());
    }
    wire.extend_from_slice(b"content-length: 0\r\n\r\n");
    let lines = 53;
    let mut head = None;
    for byte in &wire {
        // On loopback the byte is in the connection's socket once the write returns; a yield
        // lets the runtime see it readable: each poll below reads what was written so far.
        target.write_all(&[*byte]).await.unwrap();
        tokio::task::yield_now().await;
        match std::future::poll_fn(|cx| Poll::Ready(connection.poll_head(cx))).await {
            Poll::Ready(answer) => {
                head = Some(answer.unwrap());
                break;
            }
            Poll::Pending => {}
        }
    }
    let head = match head {
        Some(head) => head,
        None => std::future::poll_fn(|cx| connection.poll_head(cx))
            .await
            .unwrap(),
    };
    assert_eq!(head.status, StatusCode::OK);
    assert_eq!(head.headers.len(), 51);
    assert!(
        connection.head_parses <= lines,
        "{} parses for {} bytes in {lines} lines",
        connection.head_parses,
        wire.len()
    );
}
