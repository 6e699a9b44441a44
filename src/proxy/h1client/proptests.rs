//! Property tests for the parts of the HTTP/1.1 client that read what a target sends: the
//! response head parser, the framing decision (RFC 9112 §6.3) and the chunked body decoder.
//!
//! Everything is reached through `super::*`, so these tests do not depend on which file of the
//! module an item lives in. The seed is fixed and failures are not persisted (see [`config`]).

use bytes::BytesMut;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{StatusCode, Version};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::RngSeed;

// The module's own items (private ones included), from the files that hold them. The outside
// types above are named here so that these tests do not lean on the parent's imports.
use super::body::{decode_chunk, parse_chunk_size, ChunkStep};
use super::parse::{next_final_head, response_framing, ChunkState, Framing};
use super::*;

/// The same cases on every run, so CI is deterministic and a failure reproduces with the same
/// command; `PROPTEST_RNG_SEED=<n>` and `PROPTEST_CASES=<n>` explore further locally (these
/// properties ran clean for 20000 cases under several seeds).
///
/// Failures are not written to `proptest-regressions/`: CI runs in a fresh clone, so a file
/// written there is lost; a persisted seed replays only while the generators and proptest stay
/// the same; and the files are named after source paths that are about to move. A case found
/// is turned into a named `#[test]` beside the properties instead (such as `an_empty_list_element_does_not_hide_chunked`).
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x5241_4148_4931_3231),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Generators: response heads
// ---------------------------------------------------------------------------------------------

/// One generated header field: its name as sent and its value without surrounding whitespace.
#[derive(Debug, Clone)]
struct Field {
    name: String,
    value: Vec<u8>,
    /// Whitespace around the value on the wire (optional whitespace, which the parser drops).
    before: &'static str,
    after: &'static str,
}

/// A generated response head and its wire form.
#[derive(Debug, Clone)]
struct GeneratedHead {
    status: u16,
    http11: bool,
    fields: Vec<Field>,
    wire: Vec<u8>,
}

const KNOWN_NAMES: &[&str] = &[
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "server",
    "date",
    "content-type",
    "via",
    "x-request-id",
    "set-cookie",
    "upgrade",
];

/// A name from `KNOWN_NAMES` spelt in a random case, or any token.
fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        (prop::sample::select(KNOWN_NAMES), any::<u64>()).prop_map(|(name, case)| {
            name.chars()
                .enumerate()
                .map(|(at, c)| {
                    if case >> (at % 64) & 1 == 1 {
                        c.to_ascii_uppercase()
                    } else {
                        c
                    }
                })
                .collect()
        }),
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,24}",
    ]
}

/// A field value: visible ASCII and obs-text with inner spaces and tabs, trimmed.
fn field_value() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        6 => 0x21u8..=0x7e,
        1 => 0x80u8..=0xff,
        1 => Just(b' '),
        1 => Just(b'\t'),
    ];
    vec(byte, 0..40).prop_map(|value| value.trim_ascii().to_vec())
}

fn ows() -> impl Strategy<Value = &'static str> {
    prop::sample::select(&["", " ", "  ", "\t", " \t"][..])
}

fn field() -> impl Strategy<Value = Field> {
    (field_name(), field_value(), ows(), ows()).prop_map(|(name, value, before, after)| Field {
        name,
        value,
        before,
        after,
    })
}

fn status_code() -> impl Strategy<Value = u16> {
    prop_oneof![
        3 => prop::sample::select(
            &[100u16, 101, 103, 200, 201, 204, 205, 206, 301, 304, 400, 404, 500, 503][..]
        ),
        2 => 100u16..=599,
        1 => 600u16..=999,
    ]
}

fn reason() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![
        8 => 0x21u8..=0x7e,
        1 => 0x80u8..=0xff,
        2 => Just(b' '),
        1 => Just(b'\t'),
    ];
    vec(byte, 0..24)
}

fn write_head(
    status: u16,
    http11: bool,
    reason: &[u8],
    fields: &[Field],
    bare_lf: &[bool],
) -> Vec<u8> {
    let newline = |at: usize| -> &'static [u8] {
        if bare_lf.get(at).copied().unwrap_or(false) {
            b"\n"
        } else {
            b"\r\n"
        }
    };
    let mut wire = format!("HTTP/1.{} {status:03}", u8::from(http11)).into_bytes();
    if !reason.is_empty() {
        wire.push(b' ');
        wire.extend_from_slice(reason);
    }
    wire.extend_from_slice(newline(0));
    for (at, field) in fields.iter().enumerate() {
        wire.extend_from_slice(field.name.as_bytes());
        wire.push(b':');
        wire.extend_from_slice(field.before.as_bytes());
        wire.extend_from_slice(&field.value);
        if !field.value.is_empty() {
            wire.extend_from_slice(field.after.as_bytes());
        }
        wire.extend_from_slice(newline(at + 1));
    }
    wire.extend_from_slice(newline(fields.len() + 1));
    wire
}

fn head_with(fields: impl Strategy<Value = Vec<Field>>) -> impl Strategy<Value = GeneratedHead> {
    (
        status_code(),
        any::<bool>(),
        reason(),
        fields,
        vec(prop::bool::weighted(0.1), 0..40),
    )
        .prop_map(|(status, http11, reason, fields, bare_lf)| {
            let wire = write_head(status, http11, &reason, &fields, &bare_lf);
            GeneratedHead {
                status,
                http11,
                fields,
                wire,
            }
        })
}

fn generated_head() -> impl Strategy<Value = GeneratedHead> {
    head_with(vec(field(), 0..24))
}

// ---------------------------------------------------------------------------------------------
// Reference model of a parsed head
// ---------------------------------------------------------------------------------------------

/// What a parsed head is compared by.
#[derive(Debug, PartialEq)]
struct HeadSummary {
    status: StatusCode,
    version: Version,
    headers: HeaderMap,
    close: bool,
    transfer_encoding: bool,
    content_length: bool,
}

fn summary(head: &ResponseHead) -> HeadSummary {
    HeadSummary {
        status: head.status,
        version: head.version,
        headers: head.headers.clone(),
        close: head.close,
        transfer_encoding: head.transfer_encoding,
        content_length: head.content_length,
    }
}

/// The elements of a comma-separated list field value (RFC 9110 §5.6.1): optional whitespace
/// around each, empty elements ignored.
fn list_elements(value: &[u8]) -> Vec<&[u8]> {
    value
        .split(|&byte| byte == b',')
        .map(|element| {
            let start = element
                .iter()
                .position(|b| !matches!(b, b' ' | b'\t'))
                .unwrap_or(element.len());
            let end = element
                .iter()
                .rposition(|b| !matches!(b, b' ' | b'\t'))
                .map_or(start, |end| end + 1);
            &element[start..end]
        })
        .filter(|element| !element.is_empty())
        .collect()
}

/// The module's documented reading of a head: `Keep-Alive` fields and `Connection` fields that
/// say nothing but `close` / `keep-alive` are consumed; every other field is kept in order.
fn expected_head(generated: &GeneratedHead) -> HeadSummary {
    let mut headers = HeaderMap::new();
    let mut close = false;
    for field in &generated.fields {
        let name = field.name.to_ascii_lowercase();
        if name == "keep-alive" {
            continue;
        }
        if name == "connection" {
            let tokens = list_elements(&field.value);
            close |= tokens.iter().any(|t| t.eq_ignore_ascii_case(b"close"));
            let only_persistence = tokens
                .iter()
                .all(|t| t.eq_ignore_ascii_case(b"close") || t.eq_ignore_ascii_case(b"keep-alive"));
            if only_persistence {
                continue;
            }
        }
        headers.append(
            HeaderName::from_bytes(name.as_bytes()).expect("a token"),
            HeaderValue::from_bytes(&field.value).expect("a field value"),
        );
    }
    HeadSummary {
        status: StatusCode::from_u16(generated.status).unwrap(),
        version: if generated.http11 {
            Version::HTTP_11
        } else {
            Version::HTTP_10
        },
        transfer_encoding: headers.contains_key(header::TRANSFER_ENCODING),
        content_length: headers.contains_key(header::CONTENT_LENGTH),
        headers,
        close,
    }
}

fn parse_fresh(bytes: &[u8]) -> (Result<Option<ResponseHead>, ExchangeError>, BytesMut) {
    let mut buffer = BytesMut::from(bytes);
    let parsed = parse_head(&mut buffer, &mut HeadScratch::default());
    (parsed, buffer)
}

/// Cut points worth checking in a message of `len` bytes: all of them when short, else the
/// first and last few and a spread in between.
fn cut_points(len: usize) -> Vec<usize> {
    if len <= 600 {
        return (0..len).collect();
    }
    let mut cuts: Vec<usize> = (0..16).chain(len - 16..len).collect();
    cuts.extend((16..len - 16).step_by(len / 97 + 1));
    cuts
}

// ---------------------------------------------------------------------------------------------
// Fuzz inputs: raw bytes that look like a head often enough to go deep
// ---------------------------------------------------------------------------------------------

const HEAD_PIECES: &[&[u8]] = &[
    b"HTTP/1.1 ",
    b"HTTP/1.0 ",
    b"HTTP/2 ",
    b"200",
    b"101",
    b"204 ",
    b"OK",
    b"\r\n",
    b"\n",
    b"\r",
    b"\r\n\r\n",
    b": ",
    b":",
    b" : ",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Connection",
    b"Keep-Alive",
    b"chunked",
    b"close",
    b", ",
    b"5",
    b"\t",
    b" ",
    b"\x00",
    b"\x7f",
    b"\xff",
    b"X-A",
    b"\r\n ",
    b"\xe9",
];

fn piecewise(pieces: &'static [&'static [u8]], max: usize) -> impl Strategy<Value = Vec<u8>> {
    vec(prop::sample::select(pieces), 0..max).prop_map(|pieces| pieces.concat())
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(Index, u8),
    Insert(Index, u8),
    Remove(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let byte = prop_oneof![
        any::<u8>(),
        prop::sample::select(&b"\r\n \t:,;\x00\x7f0aF"[..]),
    ];
    prop_oneof![
        (any::<Index>(), byte.clone()).prop_map(|(at, b)| Mutation::Set(at, b)),
        (any::<Index>(), byte).prop_map(|(at, b)| Mutation::Insert(at, b)),
        any::<Index>().prop_map(Mutation::Remove),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for mutation in mutations {
        match mutation {
            Mutation::Set(at, byte) if !bytes.is_empty() => {
                let at = at.index(bytes.len());
                bytes[at] = *byte;
            }
            Mutation::Insert(at, byte) => {
                let at = at.index(bytes.len() + 1);
                bytes.insert(at, *byte);
            }
            Mutation::Remove(at) if !bytes.is_empty() => {
                let at = at.index(bytes.len());
                bytes.remove(at);
            }
            _ => {}
        }
    }
}

fn head_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..512),
        piecewise(HEAD_PIECES, 64),
        (piecewise(HEAD_PIECES, 32), vec(any::<u8>(), 0..64)).prop_map(|(mut a, b)| {
            a.splice(0..0, b"HTTP/1.1 200 OK\r\n".iter().copied());
            a.extend(b);
            a
        }),
        (generated_head(), vec(mutation(), 1..6)).prop_map(|(head, mutations)| {
            let mut wire = head.wire;
            mutate(&mut wire, &mutations);
            wire
        }),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    /// Any bytes: no panic; `None` leaves the buffer as it was; a head is taken only whole,
    /// from exactly the bytes consumed, and what follows it stays in the buffer.
    #[test]
    fn arbitrary_bytes_never_panic_and_a_head_is_taken_whole(bytes in head_like_bytes()) {
        let (parsed, buffer) = parse_fresh(&bytes);
        match parsed {
            Ok(None) => prop_assert_eq!(&buffer[..], &bytes[..]),
            Err(_) => {}
            Ok(Some(head)) => {
                let used = bytes.len() - buffer.len();
                prop_assert_eq!(&buffer[..], &bytes[used..], "only the head is consumed");
                let consumed = &bytes[..used];
                prop_assert!(
                    consumed.ends_with(b"\n\r\n") || consumed.ends_with(b"\n\n"),
                    "a head ends with an empty line"
                );
                // The same head from exactly those bytes, and none from any prefix of them.
                let (again, rest) = parse_fresh(consumed);
                prop_assert!(rest.is_empty());
                prop_assert_eq!(summary(&again.unwrap().unwrap()), summary(&head));
                for cut in cut_points(used) {
                    let (prefix, _) = parse_fresh(&consumed[..cut]);
                    prop_assert!(matches!(prefix, Ok(None)), "prefix of {} bytes", cut);
                }
                for (_, value) in &head.headers {
                    prop_assert!(
                        !value.as_bytes().iter().any(|b| matches!(b, b'\r' | b'\n' | 0)),
                        "no CR, LF or NUL in a value: {:?}", value
                    );
                }
                // Framing is decided without panicking, whatever the fields say.
                let _ = response_framing(false, &head);
                let _ = response_framing(true, &head);
            }
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Generated heads, several back to back on one connection (one scratch): each parses to
    /// exactly its status, version and fields, with remembered names never standing in for
    /// different ones, and the bytes after the last head stay in the buffer.
    #[test]
    fn generated_heads_parse_to_exactly_their_fields(
        heads in vec(generated_head(), 1..5),
        tail in vec(any::<u8>(), 0..32),
    ) {
        let mut wire: Vec<u8> = heads.iter().flat_map(|head| head.wire.clone()).collect();
        wire.extend_from_slice(&tail);
        let mut buffer = BytesMut::from(&wire[..]);
        let mut scratch = HeadScratch::default();
        for head in &heads {
            let parsed = parse_head(&mut buffer, &mut scratch)
                .map_err(|error| TestCaseError::fail(format!("{error}: {head:?}")))?;
            let parsed = parsed.expect("a whole head");
            prop_assert_eq!(summary(&parsed), expected_head(head));
        }
        prop_assert_eq!(&buffer[..], &tail[..]);
    }

    /// Every strict prefix of a head is incomplete: never an error, never a head. (The read
    /// loop parses again after each read, so this is the same as any split of the wire.)
    #[test]
    fn a_head_is_incomplete_until_its_last_byte(head in generated_head()) {
        for cut in cut_points(head.wire.len()) {
            let (parsed, buffer) = parse_fresh(&head.wire[..cut]);
            prop_assert!(
                matches!(parsed, Ok(None)),
                "prefix of {} bytes: {:?}", cut, parsed.map(|head| head.map(|h| summary(&h)))
            );
            prop_assert_eq!(buffer.len(), cut, "nothing consumed");
        }
        let (parsed, buffer) = parse_fresh(&head.wire);
        prop_assert!(buffer.is_empty());
        prop_assert_eq!(summary(&parsed.unwrap().unwrap()), expected_head(&head));
    }

    /// Malformed field lines that could make two parsers see different fields (RFC 9112 §5.1,
    /// §5.2, §2.2: whitespace before the colon, obs-fold, a bare CR, a NUL or a bare name) are
    /// refused, never read as some other head.
    #[test]
    fn ambiguous_field_lines_are_errors(
        head in head_with(vec(field(), 1..12)),
        at in any::<Index>(),
        defect in 0..5usize,
    ) {
        let mut fields = head.fields.clone();
        let field = &mut fields[at.index(head.fields.len())];
        let mut value = field.value.clone();
        match defect {
            0 => field.name.push(' '),
            1 => {
                value.extend_from_slice(b"\r\n folded");
            }
            2 => {
                value.extend_from_slice(b"\rx");
            }
            3 => value.insert(value.len() / 2, 0),
            _ => {
                field.name.push_str("\r\nno-colon");
            }
        }
        field.value = value;
        let reason = b"Whatever".to_vec();
        let wire = write_head(head.status, head.http11, &reason, &fields, &[]);
        let (parsed, _) = parse_fresh(&wire);
        prop_assert!(
            parsed.is_err(),
            "defect {} gave {:?} for {:?}",
            defect,
            parsed.map(|head| head.map(|h| summary(&h))),
            String::from_utf8_lossy(&wire)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Framing: RFC 9112 §6.3 as a small reference model
// ---------------------------------------------------------------------------------------------

/// What RFC 9112 §6.3 says the body of a response is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelBody {
    Length(u64),
    Chunked,
    UntilClose,
}

/// The RFC's answer, `Err` for a response that must be treated as an error (an invalid or
/// conflicting Content-Length, §6.3 rule 5).
#[derive(Debug, PartialEq, Eq)]
enum ModelFraming {
    /// Exactly this framing and reuse.
    Exactly(ModelBody, bool),
    /// An HTTP/1.0 message with Transfer-Encoding: its framing is faulty (§6.1); reading it by
    /// Transfer-Encoding or refusing it are both fine as long as the connection is not reused.
    FaultyThenClose,
    Error,
}

fn model_framing(
    method_is_head: bool,
    status: u16,
    http11: bool,
    fields: &[(String, Vec<u8>)],
) -> ModelFraming {
    let values = |wanted: &str| -> Vec<&[u8]> {
        fields
            .iter()
            .filter(|(name, _)| name.eq_ignore_ascii_case(wanted))
            .map(|(_, value)| value.as_slice())
            .collect()
    };
    let close = values("connection")
        .iter()
        .flat_map(|value| list_elements(value))
        .any(|token| token.eq_ignore_ascii_case(b"close"));
    // Persistence (§9.3): HTTP/1.1 without `close`. HTTP/1.0 keep-alive is not used (allowed:
    // a client may always close).
    let persistent = http11 && !close;
    // Rule 1: no body whatever the fields say.
    if method_is_head || (100..200).contains(&status) || status == 204 || status == 304 {
        return ModelFraming::Exactly(ModelBody::Length(0), persistent);
    }
    let transfer_encoding = values("transfer-encoding");
    let content_length = values("content-length");
    if !transfer_encoding.is_empty() {
        if !http11 {
            return ModelFraming::FaultyThenClose;
        }
        // The field values of all lines form one list (RFC 9110 §5.3). Only `chunked` alone
        // can be passed on: any other coding (rule 4 would read it to the connection's end)
        // would reach the client as the body itself, so the answer is refused.
        let codings: Vec<&[u8]> = transfer_encoding
            .iter()
            .flat_map(|value| list_elements(value))
            .collect();
        let chunked_alone = codings.len() == 1 && codings[0].eq_ignore_ascii_case(b"chunked");
        return if chunked_alone {
            // Rule 3: with a Content-Length too, read by Transfer-Encoding, then close.
            ModelFraming::Exactly(ModelBody::Chunked, persistent && content_length.is_empty())
        } else {
            ModelFraming::Error
        };
    }
    if content_length.is_empty() {
        // Rule 8.
        return ModelFraming::Exactly(ModelBody::UntilClose, false);
    }
    // Rule 5 with RFC 9110 §8.6: Content-Length is 1*DIGIT; a list of identical values may be
    // taken as that value; anything else is an unrecoverable error.
    let mut length: Option<u64> = None;
    for value in content_length {
        for item in value.split(|&b| b == b',') {
            let item = item.trim_ascii();
            if item.is_empty() || !item.iter().all(u8::is_ascii_digit) {
                return ModelFraming::Error;
            }
            let Some(parsed) = std::str::from_utf8(item)
                .ok()
                .and_then(|item| item.parse::<u64>().ok())
            else {
                // Longer than the client can count: refused rather than misread.
                return ModelFraming::Error;
            };
            if length.is_some_and(|seen| seen != parsed) {
                return ModelFraming::Error;
            }
            length = Some(parsed);
        }
    }
    ModelFraming::Exactly(ModelBody::Length(length.unwrap()), persistent)
}

fn framing_kind(framing: Framing) -> ModelBody {
    match framing {
        Framing::Length(length) => ModelBody::Length(length),
        Framing::Chunked(state) => {
            assert_eq!(state, ChunkState::Size, "a body starts with a size line");
            ModelBody::Chunked
        }
        Framing::UntilClose => ModelBody::UntilClose,
    }
}

fn list_value(elements: &'static [&'static str], max: usize) -> impl Strategy<Value = Vec<u8>> {
    (
        vec(prop::sample::select(elements), 1..max),
        prop::sample::select(&[",", ", ", " ,", "\t,\t", " , "][..]),
    )
        .prop_map(|(elements, separator)| elements.join(separator).trim().as_bytes().to_vec())
}

fn content_length_value() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => "[0-9]{1,6}".prop_map(String::into_bytes),
        2 => ("[0-9]{1,4}", 2..4usize, prop::sample::select(&[",", ", ", " , "][..]))
            .prop_map(|(n, times, sep)| vec![n; times].join(sep).into_bytes()),
        1 => "[0-9]{1,3}(, ?[0-9]{1,3}){1,3}".prop_map(String::into_bytes),
        1 => "[0-9]{19,24}".prop_map(String::into_bytes),
        1 => prop::sample::select(
            &["-1", "+3", "", "0x10", "3 3", "3,", ",3", "3,,3", "1e3", "٣", "0", "00", "007"][..]
        )
        .prop_map(|v| v.as_bytes().to_vec()),
    ]
}

/// Transfer codings; the empty one makes empty list elements ("chunked, ", ", chunked"),
/// which RFC 9110 §5.6.1 tells recipients to ignore.
const CODINGS: &[&str] = &[
    "chunked", "Chunked", "CHUNKED", "gzip", "deflate", "identity", "compress", "x-custom", "",
];

fn framing_field() -> impl Strategy<Value = (String, Vec<u8>)> {
    let name = |name: &'static str| {
        prop::sample::select(vec![
            name.to_owned(),
            name.to_ascii_uppercase(),
            name[..1].to_ascii_uppercase() + &name[1..],
        ])
    };
    prop_oneof![
        3 => (name("content-length"), content_length_value()),
        3 => (name("transfer-encoding"), list_value(CODINGS, 4)),
        2 => (
            name("connection"),
            list_value(&["close", "Close", "keep-alive", "upgrade", "x-foo", ""], 3)
        ),
        1 => (name("keep-alive"), Just(b"timeout=5".to_vec())),
        1 => ("x-[a-z]{1,8}", Just(b"1".to_vec())),
    ]
}

proptest! {
    #![proptest_config(config(1024))]

    /// The framing decision and whether the connection may be reused equal RFC 9112 §6.3
    /// (and §9.3 for persistence), for any mix of Content-Length, Transfer-Encoding and
    /// Connection fields, status and method.
    #[test]
    fn framing_follows_rfc_9112_section_6_3(
        method_is_head in prop::bool::weighted(0.1),
        status in status_code(),
        http11 in prop::bool::weighted(0.8),
        fields in vec(framing_field(), 0..6),
    ) {
        let as_fields: Vec<Field> = fields
            .iter()
            .map(|(name, value)| Field {
                name: name.clone(),
                value: value.clone(),
                before: " ",
                after: "",
            })
            .collect();
        let wire = write_head(status, http11, b"X", &as_fields, &[]);
        let (parsed, _) = parse_fresh(&wire);
        let head = parsed.unwrap().expect("a whole head");
        let actual = response_framing(method_is_head, &head)
            .map(|(framing, reuse)| (framing_kind(framing), reuse));
        let expected = model_framing(method_is_head, status, http11, &fields);
        let agrees = match (&expected, &actual) {
            (ModelFraming::Exactly(body, reuse), Ok(actual)) => (*body, *reuse) == *actual,
            (ModelFraming::FaultyThenClose, Ok((_, reuse))) => !reuse,
            (ModelFraming::FaultyThenClose, Err(_)) | (ModelFraming::Error, Err(_)) => true,
            _ => false,
        };
        prop_assert!(
            agrees,
            "expected {:?}, got {:?} for {:?}",
            expected,
            actual.map_err(|error| error.to_string()),
            String::from_utf8_lossy(&wire)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Chunked bodies
// ---------------------------------------------------------------------------------------------

/// How decoding a whole wire went.
#[derive(Debug, PartialEq)]
enum Decoded {
    /// The body ended: its trailers, and the bytes after it (left in the buffer or not fed).
    End {
        trailers: Option<HeaderMap>,
        rest: Vec<u8>,
    },
    /// The decoder wanted more than the whole wire.
    Incomplete,
    Error(String),
}

/// Feeds `wire` to the chunked decoder in pieces ending at `cuts` (then the rest), the next
/// piece only when the decoder asks for more. Returns the data read and how it ended. Checks
/// on the way that every step makes progress, so a decoder that loops fails here.
fn decode_pieces(wire: &[u8], cuts: &[usize]) -> (Vec<u8>, Decoded) {
    let mut ends: Vec<usize> = cuts.iter().map(|&cut| cut.min(wire.len())).collect();
    ends.push(wire.len());
    ends.sort_unstable();
    ends.dedup();
    let mut ends = ends.into_iter();
    let mut fed = 0;
    let mut buffer = BytesMut::new();
    let mut state = ChunkState::Size;
    let mut payload = Vec::new();
    // Each step consumes a byte, moves from a size line or data end to the next state, or asks
    // for a piece: bounded by a few steps a byte.
    let step_limit = 4 * wire.len() + 16;
    for _ in 0..step_limit {
        let before = buffer.len();
        let step = match decode_chunk(&mut buffer, state) {
            Ok(step) => step,
            Err(error) => return (payload, Decoded::Error(error.to_string())),
        };
        match step {
            ChunkStep::Next(next) => {
                assert!(buffer.len() < before, "a step without data consumes bytes");
                state = next;
            }
            ChunkStep::Data(data, next) => {
                assert!(!data.is_empty(), "no empty data frames");
                assert_eq!(buffer.len() + data.len(), before);
                if let ChunkState::Data(remaining) = state {
                    let left = remaining - data.len() as u64;
                    let expected = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                    assert_eq!(next, expected);
                } else {
                    panic!("data outside a chunk");
                }
                payload.extend_from_slice(&data);
                state = next;
            }
            ChunkStep::End(trailers) => {
                let mut rest = buffer.to_vec();
                rest.extend_from_slice(&wire[fed..]);
                return (payload, Decoded::End { trailers, rest });
            }
            ChunkStep::NeedMore => {
                assert_eq!(buffer.len(), before, "asking for more consumes nothing");
                let Some(end) = ends.find(|&end| end > fed) else {
                    return (payload, Decoded::Incomplete);
                };
                buffer.extend_from_slice(&wire[fed..end]);
                fed = end;
            }
        }
    }
    panic!("the decoder made no progress in {step_limit} steps");
}

/// One chunk as generated: its data and how its size line is spelt.
#[derive(Debug, Clone)]
struct Chunk {
    data: Vec<u8>,
    leading_zeros: usize,
    upper_case: bool,
    extensions: Vec<u8>,
}

/// A generated chunked body: its wire form, payload and trailers, and where each size line's
/// digits are (for corrupting them).
#[derive(Debug, Clone)]
struct ChunkedBody {
    wire: Vec<u8>,
    payload: Vec<u8>,
    trailers: Vec<(String, Vec<u8>)>,
    /// `(start of the line, end of its digits, end of the line before CRLF)` per size line,
    /// the last chunk's included.
    lines: Vec<(usize, usize, usize)>,
}

/// `chunk-ext = *( BWS ";" BWS chunk-ext-name [ BWS "=" BWS chunk-ext-val ] )` (RFC 9112 §7.1.1).
fn chunk_extensions() -> impl Strategy<Value = Vec<u8>> {
    let bws = || prop::sample::select(&["", " ", "\t", " \t "][..]);
    let quoted = vec(
        prop_oneof![0x20u8..=0x7e, 0x80u8..=0xff, Just(b'\t'),],
        0..12,
    )
    .prop_map(|content| {
        let mut out = vec![b'"'];
        for byte in content {
            if byte == b'"' || byte == b'\\' {
                out.push(b'\\');
            }
            out.push(byte);
        }
        out.push(b'"');
        out
    });
    let value = prop_oneof![
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,10}".prop_map(String::into_bytes),
        quoted,
    ];
    let one = (
        bws(),
        bws(),
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,10}",
        proptest::option::of((bws(), bws(), value)),
    )
        .prop_map(|(before, after, name, value)| {
            let mut out = before.as_bytes().to_vec();
            out.push(b';');
            out.extend_from_slice(after.as_bytes());
            out.extend_from_slice(name.as_bytes());
            if let Some((before, after, value)) = value {
                out.extend_from_slice(before.as_bytes());
                out.push(b'=');
                out.extend_from_slice(after.as_bytes());
                out.extend_from_slice(&value);
            }
            out
        });
    prop_oneof![
        3 => Just(Vec::new()),
        2 => vec(one, 1..4).prop_map(|all| all.concat()),
    ]
}

fn chunk() -> impl Strategy<Value = Chunk> {
    let data = prop_oneof![
        6 => vec(any::<u8>(), 1..64),
        2 => vec(prop::sample::select(&b"0123456789abcdef\r\n;"[..]), 1..64),
        1 => vec(any::<u8>(), 64..6000),
    ];
    (data, 0..4usize, any::<bool>(), chunk_extensions()).prop_map(
        |(data, leading_zeros, upper_case, extensions)| Chunk {
            data,
            leading_zeros,
            upper_case,
            extensions,
        },
    )
}

fn size_line(size: usize, chunk_zeros: usize, upper_case: bool, extensions: &[u8]) -> Vec<u8> {
    let digits = if upper_case {
        format!("{size:X}")
    } else {
        format!("{size:x}")
    };
    // At most 15 digits in all: the decoder's documented limit.
    let zeros = chunk_zeros.min(15 - digits.len());
    let mut line = "0".repeat(zeros).into_bytes();
    line.extend_from_slice(digits.as_bytes());
    line.extend_from_slice(extensions);
    line
}

fn trailer_field() -> impl Strategy<Value = (String, Vec<u8>)> {
    ("[A-Za-z][A-Za-z0-9-]{0,15}", field_value())
}

/// A chunked body of at least `min_chunks` chunks with data (and the last chunk).
fn chunked_body(min_chunks: usize) -> impl Strategy<Value = ChunkedBody> {
    (
        vec(chunk(), min_chunks..8),
        1..4usize,
        chunk_extensions(),
        prop_oneof![2 => Just(Vec::new()), 1 => vec(trailer_field(), 1..5)],
    )
        .prop_map(|(chunks, last_zeros, last_extensions, trailers)| {
            let mut wire = Vec::new();
            let mut payload = Vec::new();
            let mut lines = Vec::new();
            let mut push_line = |wire: &mut Vec<u8>, line: Vec<u8>, digits: usize| {
                let start = wire.len();
                wire.extend_from_slice(&line);
                lines.push((start, start + digits, wire.len()));
                wire.extend_from_slice(b"\r\n");
            };
            for chunk in &chunks {
                let line = size_line(
                    chunk.data.len(),
                    chunk.leading_zeros,
                    chunk.upper_case,
                    &chunk.extensions,
                );
                let digits = line.len() - chunk.extensions.len();
                push_line(&mut wire, line, digits);
                wire.extend_from_slice(&chunk.data);
                wire.extend_from_slice(b"\r\n");
                payload.extend_from_slice(&chunk.data);
            }
            let mut last = "0".repeat(last_zeros).into_bytes();
            last.extend_from_slice(&last_extensions);
            push_line(&mut wire, last, last_zeros);
            for (name, value) in &trailers {
                wire.extend_from_slice(name.as_bytes());
                wire.extend_from_slice(b": ");
                wire.extend_from_slice(value);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"\r\n");
            ChunkedBody {
                wire,
                payload,
                trailers,
                lines,
            }
        })
}

fn expected_trailers(fields: &[(String, Vec<u8>)]) -> Option<HeaderMap> {
    if fields.is_empty() {
        return None;
    }
    let mut map = HeaderMap::new();
    for (name, value) in fields {
        map.append(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_bytes(value).unwrap(),
        );
    }
    Some(map)
}

/// Bytes that look like chunked framing often enough to go deep.
const CHUNK_PIECES: &[&[u8]] = &[
    b"0",
    b"1",
    b"5",
    b"a",
    b"F",
    b"ffffffffffffffff",
    b"\r\n",
    b"\n",
    b"\r",
    b";",
    b";x=1",
    b" ",
    b"\t",
    b"hello",
    b"x-t: 1\r\n",
    b": ",
    b"\x00",
    b"\xff",
    b"-",
    b"0x",
    b"\r\n\r\n",
];

fn chunk_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..256),
        piecewise(CHUNK_PIECES, 48),
        (chunked_body(0), vec(mutation(), 1..5)).prop_map(|(body, mutations)| {
            let mut wire = body.wire;
            mutate(&mut wire, &mutations);
            wire
        }),
    ]
}

proptest! {
    #![proptest_config(config(512))]

    /// Any bytes, fed whole or in pieces: no panic, progress on every step, nothing consumed
    /// past the end of the body, and the same answer however the bytes were split (a body
    /// read differently depending on how TCP cut it would desynchronise the connection).
    #[test]
    fn arbitrary_chunked_bytes_decode_the_same_across_any_split(
        wire in chunk_like_bytes(),
        cuts in vec(0..300usize, 0..12),
    ) {
        let (whole_payload, whole) = decode_pieces(&wire, &[]);
        let (split_payload, split) = decode_pieces(&wire, &cuts);
        let (bytewise_payload, bytewise) =
            decode_pieces(&wire, &(1..wire.len()).collect::<Vec<_>>());
        match (&whole, &split, &bytewise) {
            (Decoded::Error(_), Decoded::Error(_), Decoded::Error(_)) => {}
            _ => {
                prop_assert_eq!(&whole, &split);
                prop_assert_eq!(&whole, &bytewise);
            }
        }
        if let Decoded::End { rest, .. } = &whole {
            prop_assert!(wire.ends_with(rest));
        }
        prop_assert_eq!(&whole_payload, &split_payload);
        prop_assert_eq!(&whole_payload, &bytewise_payload);
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// A well-formed body (random chunk sizes, size spellings, extensions, trailers) decodes to
    /// exactly its payload and trailers across any split, and leaves what follows it alone.
    #[test]
    fn a_generated_chunked_body_decodes_to_its_payload(
        body in chunked_body(0),
        after in vec(any::<u8>(), 0..16),
        cuts in vec(any::<Index>(), 0..16),
    ) {
        let mut wire = body.wire.clone();
        wire.extend_from_slice(&after);
        let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        for cuts in [Vec::new(), cuts] {
            let (payload, decoded) = decode_pieces(&wire, &cuts);
            prop_assert_eq!(&payload, &body.payload);
            prop_assert_eq!(
                &decoded,
                &Decoded::End { trailers: expected_trailers(&body.trailers), rest: after.clone() }
            );
        }
        // And byte by byte, the hardest split (skipped for long bodies to keep this fast).
        if wire.len() <= 2048 {
            let (payload, decoded) = decode_pieces(&wire, &(1..wire.len()).collect::<Vec<_>>());
            prop_assert_eq!(&payload, &body.payload);
            prop_assert!(matches!(decoded, Decoded::End { .. }), "{:?}", decoded);
        }
        // Every strict prefix of the body is incomplete, never an error or an end.
        for cut in cut_points(body.wire.len()) {
            let (payload, decoded) = decode_pieces(&body.wire[..cut], &[]);
            prop_assert_eq!(&decoded, &Decoded::Incomplete, "prefix of {} bytes", cut);
            prop_assert!(body.payload.starts_with(&payload));
        }
    }

    /// A body whose size line is corrupted is an error, whatever the split, and the data read
    /// before the error is exactly the chunks before the bad line: never another payload.
    #[test]
    fn a_corrupted_size_line_is_an_error_never_another_payload(
        body in chunked_body(0),
        which in any::<Index>(),
        corruption in 0..6usize,
        position in any::<Index>(),
        bad in prop::sample::select(&b"gGxXzZ-+.@\"/:=,"[..]),
        control in prop::sample::select(&b"\n\r\x00\x7f\x01\x1b"[..]),
        cuts in vec(any::<Index>(), 0..8),
    ) {
        let line = which.index(body.lines.len());
        let (start, digits_end, end) = body.lines[line];
        let mut wire = body.wire.clone();
        match corruption {
            // No digits at all.
            0 => {
                wire.drain(start..digits_end);
            }
            // A byte that is neither a hex digit, whitespace nor ';' among or right after the
            // digits ("1g0", "-5", "+5", "5=").
            1 => wire.insert(start + position.index(digits_end - start + 1), bad),
            // A hexadecimal prefix.
            2 => {
                wire.insert(start, b'x');
                wire.insert(start, b'0');
            }
            // A control byte (bare LF or CR included) anywhere in the line.
            3 => wire.insert(start + position.index(end - start + 1), control),
            // The line ends with a bare LF instead of CRLF.
            4 => {
                wire.remove(end);
            }
            // Whitespace inside the number ("1 0"), or before it (" 5").
            _ if digits_end - start >= 2 => {
                wire.insert(start + 1 + position.index(digits_end - start - 1), b' ')
            }
            _ => wire.insert(start, b' '),
        }
        // The chunks before the corrupted line; the last chunk's line is the last one.
        let before: usize = body
            .lines
            .iter()
            .take(line)
            .zip(body.lines.iter().skip(1))
            .map(|(&(_, _, line_end), &(next_start, _, _))| next_start - line_end - 4)
            .sum();
        let expected_payload = &body.payload[..before];
        let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        for cuts in [Vec::new(), cuts, (1..wire.len()).collect()] {
            let (payload, decoded) = decode_pieces(&wire, &cuts);
            prop_assert!(
                matches!(decoded, Decoded::Error(_)),
                "corruption {} of line {}: {:?} from {:?}",
                corruption,
                line,
                decoded,
                String::from_utf8_lossy(&wire[start..(end + 4).min(wire.len())])
            );
            prop_assert_eq!(payload.as_slice(), expected_payload);
        }
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// A chunk's data not followed by exactly CRLF (a byte changed, dropped or added there) is
    /// an error, whatever the split; the data read is that chunk and the ones before it.
    #[test]
    fn chunk_data_not_followed_by_crlf_is_an_error(
        body in chunked_body(1),
        which in any::<Index>(),
        damage in 0..3usize,
        second in any::<bool>(),
        byte in any::<u8>(),
        cuts in vec(any::<Index>(), 0..8),
    ) {
        // Chunks with data have a next size line; the CRLF ends right before it.
        let chunk = which.index(body.lines.len() - 1);
        let data_end = body.lines[chunk + 1].0 - 2;
        let mut wire = body.wire.clone();
        let at = data_end + usize::from(second);
        match damage {
            0 => {
                let wanted = wire[at];
                wire[at] = if byte == wanted { byte.wrapping_add(1) } else { byte };
            }
            1 => {
                wire.remove(at);
            }
            _ => wire.insert(data_end, byte),
        }
        // The data of this chunk and the ones before it: everything before its CRLF, less the
        // size lines and CRLFs.
        let read: usize = body.lines[..=chunk]
            .iter()
            .zip(&body.lines[1..])
            .map(|(&(_, _, line_end), &(next_start, _, _))| next_start - line_end - 4)
            .sum();
        let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        for cuts in [Vec::new(), cuts] {
            let (payload, decoded) = decode_pieces(&wire, &cuts);
            prop_assert!(matches!(decoded, Decoded::Error(_)), "{:?}", decoded);
            prop_assert_eq!(payload.as_slice(), &body.payload[..read]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// parse_chunk_size against the RFC grammar
// ---------------------------------------------------------------------------------------------

/// Whether `line` is `chunk-size [ chunk-ext ]` exactly as RFC 9112 §7.1 writes it, and its
/// size if so (`None` for anything else).
fn rfc_chunk_size(line: &[u8]) -> Option<u64> {
    fn is_tchar(b: u8) -> bool {
        b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
    }
    let digits_end = line
        .iter()
        .position(|b| !b.is_ascii_hexdigit())
        .unwrap_or(line.len());
    if digits_end == 0 {
        return None;
    }
    let mut at = digits_end;
    let bws = |at: &mut usize| {
        while line.get(*at).is_some_and(|b| matches!(b, b' ' | b'\t')) {
            *at += 1;
        }
    };
    let token = |at: &mut usize| {
        let start = *at;
        while line.get(*at).copied().is_some_and(is_tchar) {
            *at += 1;
        }
        *at > start
    };
    while at < line.len() {
        bws(&mut at);
        if line.get(at) != Some(&b';') {
            return None;
        }
        at += 1;
        bws(&mut at);
        if !token(&mut at) {
            return None;
        }
        let mut look = at;
        bws(&mut look);
        if line.get(look) == Some(&b'=') {
            at = look + 1;
            bws(&mut at);
            if line.get(at) == Some(&b'"') {
                at += 1;
                loop {
                    match line.get(at) {
                        Some(b'"') => {
                            at += 1;
                            break;
                        }
                        Some(b'\\') => match line.get(at + 1) {
                            Some(&b) if b == b'\t' || b >= 0x20 && b != 0x7f => at += 2,
                            _ => return None,
                        },
                        Some(&b) if b == b'\t' || b >= 0x20 && b != 0x7f => at += 1,
                        _ => return None,
                    }
                }
            } else if !token(&mut at) {
                return None;
            }
        }
    }
    // Past 64 bits: the RFC asks recipients to refuse rather than overflow.
    u64::from_str_radix(std::str::from_utf8(&line[..digits_end]).ok()?, 16).ok()
}

fn chunk_size_line() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        ("[0-9a-fA-F]{1,15}", chunk_extensions()).prop_map(|(digits, ext)| [
            digits.into_bytes(),
            ext
        ]
        .concat()),
        (
            "[0-9a-fA-F]{0,18}",
            chunk_extensions(),
            vec(mutation(), 0..3)
        )
            .prop_map(|(digits, ext, mutations)| {
                let mut line = [digits.into_bytes(), ext].concat();
                mutate(&mut line, &mutations);
                line
            }),
        piecewise(CHUNK_PIECES, 8),
        vec(any::<u8>(), 0..24),
    ]
}

proptest! {
    #![proptest_config(config(2048))]

    /// A line the RFC grammar accepts gives its size; a line without a valid size, or with a
    /// control byte, is an error; where the decoder is laxer than the grammar (it ignores the
    /// extensions' syntax), it still reads only the size the digits say.
    #[test]
    fn chunk_size_lines_follow_the_rfc_grammar(line in chunk_size_line()) {
        let parsed = parse_chunk_size(&line).ok();
        let digits_end = line.iter().position(|b| !b.is_ascii_hexdigit()).unwrap_or(line.len());
        let has_control = line.iter().any(|&b| (b < 0x20 && b != b'\t') || b == 0x7f);
        match rfc_chunk_size(&line) {
            Some(size) if digits_end <= 15 && !has_control => {
                prop_assert_eq!(parsed, Some(size), "{:?}", String::from_utf8_lossy(&line));
            }
            // Over 15 digits (leading zeros included) the decoder may refuse: a limit.
            Some(_) => {}
            None => {
                if let Some(size) = parsed {
                    // Laxer only in what follows ';'.
                    prop_assert!(!has_control && digits_end > 0);
                    let rest = &line[digits_end..];
                    let first = rest.iter().find(|b| !matches!(b, b' ' | b'\t'));
                    prop_assert!(first.is_none() || first == Some(&b';'));
                    let digits = std::str::from_utf8(&line[..digits_end]).unwrap();
                    prop_assert_eq!(Some(size), u64::from_str_radix(digits, 16).ok());
                }
            }
        }
        if has_control {
            prop_assert_eq!(parsed, None);
        }
    }
}

/// Found by `framing_follows_rfc_9112_section_6_3`: an empty list element after `chunked` once
/// hid it, and a chunked body was read to the connection's end, its framing passed on as body.
#[test]
fn an_empty_list_element_does_not_hide_chunked() {
    for wire in [
        &b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked,\r\n\r\n"[..],
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: , chunked ,\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding:\r\n\r\n",
    ] {
        let (parsed, _) = parse_fresh(wire);
        let head = parsed.unwrap().unwrap();
        assert_eq!(
            response_framing(false, &head).unwrap(),
            (Framing::Chunked(ChunkState::Size), true),
            "{:?}",
            String::from_utf8_lossy(wire)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Limits and decisions whatever the reads: interim heads, head and trailer sizes
// ---------------------------------------------------------------------------------------------

/// How reading heads up to the final one went.
#[derive(Debug, PartialEq)]
enum HeadsRead {
    /// The final head's status and its `x-pad` length, and the bytes left after it.
    Final(u16, usize, Vec<u8>),
    Incomplete,
    TooLarge,
    TooManyInterim,
    Invalid(String),
}

/// Feeds `wire` to [`next_final_head`] in pieces ending at `cuts` (then the rest), as the
/// connection's reads would bring them.
fn read_heads(wire: &[u8], cuts: &[usize]) -> HeadsRead {
    let mut ends: Vec<usize> = cuts.iter().map(|&cut| cut.min(wire.len())).collect();
    ends.push(wire.len());
    ends.sort_unstable();
    ends.dedup();
    let mut buffer = BytesMut::new();
    let (mut scratch, mut interim, mut fed) = (HeadScratch::default(), 0, 0);
    for end in ends.into_iter().filter(|&end| end > 0) {
        buffer.extend_from_slice(&wire[fed..end]);
        fed = end;
        match next_final_head(&mut buffer, &mut scratch, &mut interim) {
            Ok(None) => {}
            Ok(Some(head)) => {
                let pad = head.headers.get("x-pad").map_or(0, |value| value.len());
                let mut rest = buffer.to_vec();
                rest.extend_from_slice(&wire[fed..]);
                return HeadsRead::Final(head.status.as_u16(), pad, rest);
            }
            Err(ExchangeError::HeadTooLarge) => return HeadsRead::TooLarge,
            Err(ExchangeError::TooManyInterim) => return HeadsRead::TooManyInterim,
            Err(error) => return HeadsRead::Invalid(error.to_string()),
        }
    }
    HeadsRead::Incomplete
}

/// A head of `status` that is `length` bytes long (at least its bare form) by an `x-pad` field.
fn padded_head(status: u16, length: usize) -> Vec<u8> {
    let bare = format!("HTTP/1.1 {status} X\r\nx-pad: \r\n\r\n").len();
    let pad = "p".repeat(length.saturating_sub(bare));
    format!("HTTP/1.1 {status} X\r\nx-pad: {pad}\r\n\r\n").into_bytes()
}

/// Lengths around the limit, far over it, and ordinary.
fn head_length() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0..200usize,
        1 => Just(MAX_HEAD_BYTES),
        1 => Just(MAX_HEAD_BYTES + 1),
        1 => (MAX_HEAD_BYTES - 3000)..(MAX_HEAD_BYTES + 3000),
        1 => Just(120 * 1024),
    ]
}

proptest! {
    #![proptest_config(config(128))]

    /// Interim heads (some large), then a final one (perhaps over the limit), then body bytes:
    /// fed whole, in arbitrary pieces or in small even ones, the decision is the same, and it
    /// is the model's: the first head over `MAX_HEAD_BYTES` or the 17th interim head refuses
    /// the answer, whichever comes first.
    #[test]
    fn head_limits_and_interim_counts_hold_for_any_split_of_the_reads(
        interim in vec((prop::sample::select(&[100u16, 102, 103][..]), head_length()), 0..20),
        last in (prop::sample::select(&[200u16, 101, 404][..]), head_length()),
        after in vec(any::<u8>(), 0..32),
        cuts in vec(any::<Index>(), 0..12),
        piece in 1000..20_000usize,
    ) {
        let mut wire = Vec::new();
        let mut expected = None;
        for (count, &(status, length)) in interim.iter().enumerate() {
            let head = padded_head(status, length);
            if expected.is_none() {
                if head.len() > MAX_HEAD_BYTES {
                    expected = Some(HeadsRead::TooLarge);
                } else if count + 1 > MAX_INTERIM_RESPONSES {
                    expected = Some(HeadsRead::TooManyInterim);
                }
            }
            wire.extend_from_slice(&head);
        }
        let final_head = padded_head(last.0, last.1);
        let pad = final_head.len() - padded_head(last.0, 0).len();
        let expected = expected.unwrap_or(if final_head.len() > MAX_HEAD_BYTES {
            HeadsRead::TooLarge
        } else {
            HeadsRead::Final(last.0, pad, after.clone())
        });
        wire.extend_from_slice(&final_head);
        wire.extend_from_slice(&after);
        let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        let even: Vec<usize> = (piece..wire.len()).step_by(piece).collect();
        for cuts in [Vec::new(), cuts, even] {
            prop_assert_eq!(&read_heads(&wire, &cuts), &expected, "cuts {:?}", cuts);
        }
    }

    /// A chunked body whose trailer section is ordinary, at the limit or over it, fed in any
    /// pieces: the trailers arrive whole exactly when the section is within `MAX_HEAD_BYTES`,
    /// and the body is an error otherwise, however the reads cut it.
    #[test]
    fn the_trailer_limit_holds_for_any_split_of_the_reads(
        lengths in vec(head_length(), 1..4),
        cuts in vec(any::<Index>(), 0..12),
        piece in 1000..20_000usize,
    ) {
        let mut section = Vec::new();
        for (at, length) in lengths.iter().enumerate() {
            let bare = format!("x-t{at}: \r\n").len();
            section.extend_from_slice(
                format!("x-t{at}: {}\r\n", "t".repeat(length.saturating_sub(bare))).as_bytes(),
            );
        }
        section.extend_from_slice(b"\r\n");
        let mut wire = b"5\r\nhello\r\n0\r\n".to_vec();
        wire.extend_from_slice(&section);
        let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        let even: Vec<usize> = (piece..wire.len()).step_by(piece).collect();
        for cuts in [Vec::new(), cuts, even] {
            let (payload, decoded) = decode_pieces(&wire, &cuts);
            prop_assert_eq!(&payload, b"hello");
            if section.len() > MAX_HEAD_BYTES {
                prop_assert_eq!(
                    &decoded,
                    &Decoded::Error("invalid chunked response body: trailer section too large".into()),
                    "cuts {:?}", cuts
                );
            } else {
                let trailers = match &decoded {
                    Decoded::End { trailers: Some(trailers), rest } if rest.is_empty() => trailers,
                    other => panic!("expected trailers, got {other:?} (cuts {cuts:?})"),
                };
                prop_assert_eq!(trailers.len(), lengths.len());
            }
        }
    }
}
