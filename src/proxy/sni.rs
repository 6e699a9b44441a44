//! Reading the server name from a TLS ClientHello without terminating TLS.
//!
//! A [`HelloReader`] is fed the bytes buffered so far after each read; the caller reads more
//! while the answer is [`Hello::Incomplete`]. The ClientHello may be split over several TLS
//! records (RFC 8446 §5.1 allows fragmenting handshake messages) and over several reads. The
//! reader looks at each byte once, as it arrives, so its answer is a function of the bytes the
//! client sent — never of how they were cut into reads — and costs no more for a client that
//! trickles them.
//!
//! Bounds (refusals, the same for any split): the handshake message is at most one record's
//! payload ([`MAX_RECORD_PAYLOAD`], 16 KiB); it spans at most [`MAX_CLIENT_HELLO_RECORDS`]
//! records; so at most [`MAX_CLIENT_HELLO_BUFFER`] bytes are read, enough for any split within
//! both bounds. Every length is checked before it is used: malformed input gives an error,
//! never a panic.

/// Real clients send their ClientHello in one record, rarely a few; more than this many
/// fragments is a client wasting the gateway's time.
pub const MAX_CLIENT_HELLO_RECORDS: usize = 32;

/// Most bytes buffered while waiting for a complete ClientHello: the largest handshake message
/// accepted, split into as many records as accepted. Real ClientHellos (even with post-quantum
/// key shares) are a few KiB in one record.
pub const MAX_CLIENT_HELLO_BUFFER: usize =
    MAX_RECORD_PAYLOAD + MAX_CLIENT_HELLO_RECORDS * RECORD_HEADER_LEN;

const RECORD_HEADER_LEN: usize = 5;
const CONTENT_TYPE_HANDSHAKE: u8 = 22;
const HANDSHAKE_CLIENT_HELLO: u8 = 1;
const HANDSHAKE_HEADER_LEN: usize = 4;
/// TLS record payloads are at most 2^14 bytes (plus expansion only for protected records, which
/// a ClientHello never is). The ClientHello message is held to the same size.
const MAX_RECORD_PAYLOAD: usize = 16 * 1024;
const EXTENSION_SERVER_NAME: u16 = 0;
const NAME_TYPE_HOST_NAME: u8 = 0;
/// RFC 1035: a DNS name is at most 253 characters in text form (255 octets on the wire).
const MAX_HOST_NAME_LEN: usize = 255;

/// What the buffered bytes say so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// A valid prefix of a ClientHello: read more.
    Incomplete,
    /// A complete ClientHello; `sni` is its `host_name` server name, lower case, if it has one.
    Complete { sni: Option<String> },
}

/// Why the bytes are not a ClientHello whose SNI can be read. No retry: the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HelloError {
    #[error("not a TLS handshake record")]
    NotTls,
    #[error("the first handshake message is not a ClientHello")]
    NotClientHello,
    #[error("the ClientHello does not fit in {MAX_RECORD_PAYLOAD} bytes")]
    TooLarge,
    #[error("malformed ClientHello: {0}")]
    Malformed(&'static str),
}

/// Parses the ClientHello at the start of `buffered`, the first bytes a client sent: the
/// reader fed them all at once, what tests hold the fed-as-they-come reader to.
#[cfg(test)]
pub fn parse_client_hello(buffered: &[u8]) -> Result<Hello, HelloError> {
    HelloReader::default().read(buffered)
}

/// Reassembles the first handshake message from records as their bytes arrive, and parses it
/// once it is whole.
#[derive(Debug, Default)]
pub struct HelloReader {
    /// The handshake message so far: the payload bytes of the records read.
    message: Vec<u8>,
    /// How much of the input has been taken: whole record headers and the payload bytes
    /// appended to `message`.
    consumed: usize,
    /// Payload bytes of the current record still to come.
    record_left: usize,
    records: usize,
}

impl HelloReader {
    /// What the client's bytes say so far. `buffered` is everything the client sent: the
    /// bytes of the last call with the new ones after them. After an answer other than
    /// `Incomplete` the reader is done; do not call it again.
    pub fn read(&mut self, buffered: &[u8]) -> Result<Hello, HelloError> {
        loop {
            if let Some(needed) = message_len(&self.message)? {
                if self.message.len() >= needed {
                    let sni = server_name(&self.message[..needed])?;
                    return Ok(Hello::Complete { sni });
                }
            }
            let rest = buffered.get(self.consumed..).unwrap_or_default();
            if self.record_left > 0 {
                // A partial record is used as far as it goes: its first bytes already tell
                // whether a ClientHello starts here, how long it is, and may complete it.
                if rest.is_empty() {
                    return incomplete(buffered);
                }
                let taken = rest.len().min(self.record_left);
                self.message.extend_from_slice(&rest[..taken]);
                self.consumed += taken;
                self.record_left -= taken;
                continue;
            }
            let payload_len = match record_header(rest, self.message.is_empty())? {
                Some(len) => len,
                None => return incomplete(buffered),
            };
            self.records += 1;
            if self.records > MAX_CLIENT_HELLO_RECORDS {
                return Err(HelloError::Malformed(
                    "ClientHello split into too many records",
                ));
            }
            self.consumed += RECORD_HEADER_LEN;
            self.record_left = payload_len;
        }
    }
}

/// The payload length of the handshake record starting `rest`, once its header is in. The
/// first bytes are judged as soon as they arrive, so a non-TLS client is refused without
/// waiting for a full record header.
fn record_header(rest: &[u8], first: bool) -> Result<Option<usize>, HelloError> {
    let Some(&content_type) = rest.first() else {
        return Ok(None);
    };
    if content_type != CONTENT_TYPE_HANDSHAKE {
        return Err(if first {
            HelloError::NotTls
        } else {
            HelloError::Malformed("ClientHello interleaved with another record type")
        });
    }
    if rest.get(1).is_some_and(|&major| major != 3) {
        return Err(HelloError::NotTls);
    }
    if rest.len() < RECORD_HEADER_LEN {
        return Ok(None);
    }
    let payload_len = usize::from(u16::from_be_bytes([rest[3], rest[4]]));
    if payload_len == 0 {
        return Err(HelloError::Malformed("empty handshake record"));
    }
    if payload_len > MAX_RECORD_PAYLOAD {
        return Err(HelloError::Malformed("record longer than 2^14 bytes"));
    }
    Ok(Some(payload_len))
}

/// More bytes are needed; the caller never buffers more than [`MAX_CLIENT_HELLO_BUFFER`], which
/// holds any ClientHello within the bounds, so a full buffer without one is refused.
fn incomplete(buffered: &[u8]) -> Result<Hello, HelloError> {
    if buffered.len() >= MAX_CLIENT_HELLO_BUFFER {
        Err(HelloError::TooLarge)
    } else {
        Ok(Hello::Incomplete)
    }
}

/// The total length of the handshake message once its header is in, checking it is a
/// ClientHello that can fit.
fn message_len(message: &[u8]) -> Result<Option<usize>, HelloError> {
    if message.is_empty() {
        return Ok(None);
    }
    if message[0] != HANDSHAKE_CLIENT_HELLO {
        return Err(HelloError::NotClientHello);
    }
    if message.len() < HANDSHAKE_HEADER_LEN {
        return Ok(None);
    }
    let body_len = u32::from_be_bytes([0, message[1], message[2], message[3]]) as usize;
    let total = HANDSHAKE_HEADER_LEN + body_len;
    if total > MAX_RECORD_PAYLOAD {
        return Err(HelloError::TooLarge);
    }
    Ok(Some(total))
}

/// A cursor over a byte slice whose reads fail instead of panicking when the input runs out.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, len: usize, what: &'static str) -> Result<&'a [u8], HelloError> {
        if self.bytes.len() < len {
            return Err(HelloError::Malformed(what));
        }
        let (taken, rest) = self.bytes.split_at(len);
        self.bytes = rest;
        Ok(taken)
    }

    fn u8(&mut self, what: &'static str) -> Result<u8, HelloError> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &'static str) -> Result<u16, HelloError> {
        let bytes = self.take(2, what)?;
        Ok(u16::from_be_bytes([bytes[0], bytes[1]]))
    }

    /// A block prefixed by its one-byte length.
    fn block8(&mut self, what: &'static str) -> Result<&'a [u8], HelloError> {
        let len = usize::from(self.u8(what)?);
        self.take(len, what)
    }

    /// A block prefixed by its two-byte length.
    fn block16(&mut self, what: &'static str) -> Result<&'a [u8], HelloError> {
        let len = usize::from(self.u16(what)?);
        self.take(len, what)
    }

    fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

/// The `host_name` of the server_name extension (RFC 6066 §3) of a complete ClientHello
/// message (handshake header included).
fn server_name(message: &[u8]) -> Result<Option<String>, HelloError> {
    let mut hello = Reader {
        bytes: message.get(HANDSHAKE_HEADER_LEN..).unwrap_or(&[]),
    };
    hello.take(2, "legacy_version")?;
    hello.take(32, "random")?;
    let session_id = hello.block8("legacy_session_id")?;
    if session_id.len() > 32 {
        return Err(HelloError::Malformed(
            "legacy_session_id longer than 32 bytes",
        ));
    }
    let cipher_suites = hello.block16("cipher_suites")?;
    if cipher_suites.is_empty() || cipher_suites.len() % 2 != 0 {
        return Err(HelloError::Malformed("cipher_suites"));
    }
    if hello.block8("legacy_compression_methods")?.is_empty() {
        return Err(HelloError::Malformed("legacy_compression_methods"));
    }
    if hello.is_empty() {
        // A TLS 1.0-1.2 ClientHello may end here: no extensions, so no SNI.
        return Ok(None);
    }
    let mut extensions = Reader {
        bytes: hello.block16("extensions")?,
    };
    if !hello.is_empty() {
        return Err(HelloError::Malformed("bytes after the extensions"));
    }
    let mut found = None;
    while !extensions.is_empty() {
        let kind = extensions.u16("extension type")?;
        let data = extensions.block16("extension data")?;
        if kind != EXTENSION_SERVER_NAME {
            continue;
        }
        if found.is_some() {
            return Err(HelloError::Malformed("two server_name extensions"));
        }
        found = Some(host_name(data)?);
    }
    Ok(found.flatten())
}

fn host_name(extension: &[u8]) -> Result<Option<String>, HelloError> {
    let mut outer = Reader { bytes: extension };
    let mut list = Reader {
        bytes: outer.block16("server_name_list")?,
    };
    if !outer.is_empty() {
        return Err(HelloError::Malformed("bytes after server_name_list"));
    }
    while !list.is_empty() {
        let name_type = list.u8("server name type")?;
        let name = list.block16("server name")?;
        if name_type != NAME_TYPE_HOST_NAME {
            continue;
        }
        return valid_host_name(name).map(Some);
    }
    Ok(None)
}

/// Host names are ASCII letters, digits, `-`, `_`, and dots (RFC 6066 §3: no trailing dot,
/// no IP literals — an IP is accepted here only to be matched against nothing).
fn valid_host_name(name: &[u8]) -> Result<String, HelloError> {
    if name.is_empty() || name.len() > MAX_HOST_NAME_LEN {
        return Err(HelloError::Malformed("server name length"));
    }
    let allowed = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    if !name.iter().all(allowed) {
        return Err(HelloError::Malformed("server name characters"));
    }
    // Checked as ASCII just above, so this cannot fail; map it anyway rather than unwrap.
    let text = std::str::from_utf8(name).map_err(|_| HelloError::Malformed("server name"))?;
    Ok(text.to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ClientHello handshake message (header included) with the given extensions.
    fn client_hello_message(extensions: Option<Vec<u8>>) -> Vec<u8> {
        let mut body = Vec::new();
        body.extend_from_slice(&[3, 3]);
        body.extend_from_slice(&[7; 32]);
        body.push(32);
        body.extend_from_slice(&[9; 32]);
        body.extend_from_slice(&[0, 4, 0x13, 0x01, 0x13, 0x02]);
        body.extend_from_slice(&[1, 0]);
        if let Some(extensions) = extensions {
            body.extend_from_slice(&(extensions.len() as u16).to_be_bytes());
            body.extend_from_slice(&extensions);
        }
        let mut message = vec![HANDSHAKE_CLIENT_HELLO];
        message.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
        message.extend_from_slice(&body);
        message
    }

    fn extension(kind: u16, data: &[u8]) -> Vec<u8> {
        let mut out = kind.to_be_bytes().to_vec();
        out.extend_from_slice(&(data.len() as u16).to_be_bytes());
        out.extend_from_slice(data);
        out
    }

    fn sni_extension(names: &[(u8, &[u8])]) -> Vec<u8> {
        let mut list = Vec::new();
        for (kind, name) in names {
            list.push(*kind);
            list.extend_from_slice(&(name.len() as u16).to_be_bytes());
            list.extend_from_slice(name);
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend_from_slice(&list);
        extension(EXTENSION_SERVER_NAME, &data)
    }

    /// `message` split into TLS handshake records of at most `fragment` payload bytes.
    fn records(message: &[u8], fragment: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for chunk in message.chunks(fragment) {
            out.extend_from_slice(&[CONTENT_TYPE_HANDSHAKE, 3, 1]);
            out.extend_from_slice(&(chunk.len() as u16).to_be_bytes());
            out.extend_from_slice(chunk);
        }
        out
    }

    fn hello_with_sni(name: &str) -> Vec<u8> {
        let mut extensions = extension(0x000a, &[0, 2, 0, 0x1d]);
        extensions.extend(sni_extension(&[(0, name.as_bytes())]));
        extensions.extend(extension(0x002b, &[2, 3, 4]));
        records(&client_hello_message(Some(extensions)), MAX_RECORD_PAYLOAD)
    }

    fn sni(name: &str) -> Result<Hello, HelloError> {
        Ok(Hello::Complete {
            sni: Some(name.to_owned()),
        })
    }

    #[test]
    fn reads_the_server_name() {
        assert_eq!(
            parse_client_hello(&hello_with_sni("api.example.com")),
            sni("api.example.com")
        );
    }

    #[test]
    fn server_name_is_lower_cased() {
        assert_eq!(
            parse_client_hello(&hello_with_sni("API.Example.COM")),
            sni("api.example.com")
        );
    }

    #[test]
    fn hello_without_sni_or_without_extensions() {
        let no_sni = records(
            &client_hello_message(Some(extension(0x000a, &[0, 2, 0, 0x1d]))),
            MAX_RECORD_PAYLOAD,
        );
        assert_eq!(
            parse_client_hello(&no_sni),
            Ok(Hello::Complete { sni: None })
        );
        let bare = records(&client_hello_message(None), MAX_RECORD_PAYLOAD);
        assert_eq!(parse_client_hello(&bare), Ok(Hello::Complete { sni: None }));
    }

    #[test]
    fn every_prefix_is_incomplete_not_an_error() {
        let full = hello_with_sni("a.test");
        for cut in 0..full.len() {
            assert_eq!(
                parse_client_hello(&full[..cut]),
                Ok(Hello::Incomplete),
                "prefix of {cut} bytes"
            );
        }
        assert_eq!(parse_client_hello(&full), sni("a.test"));
    }

    #[test]
    fn reassembles_a_hello_split_over_many_records() {
        let mut extensions = sni_extension(&[(0, b"split.test")]);
        extensions.extend(extension(0xfe0d, &[0xab; 2000]));
        let message = client_hello_message(Some(extensions));
        // 70 bytes a record: 31 records, within the bound (fewer, smaller ones are refused:
        // `a_hello_in_more_records_than_allowed_is_refused`).
        for fragment in [70, 100, 1000] {
            let bytes = records(&message, fragment);
            assert_eq!(parse_client_hello(&bytes), sni("split.test"), "{fragment}");
            // And every prefix of the split form asks for more.
            for cut in (0..bytes.len()).step_by(97) {
                assert_eq!(parse_client_hello(&bytes[..cut]), Ok(Hello::Incomplete));
            }
        }
    }

    #[test]
    fn bytes_after_the_hello_are_ignored() {
        let mut bytes = hello_with_sni("a.test");
        bytes.extend_from_slice(&[23, 3, 3, 0, 2, 1, 2]);
        assert_eq!(parse_client_hello(&bytes), sni("a.test"));
    }

    #[test]
    fn non_tls_input_is_refused_at_once() {
        assert_eq!(parse_client_hello(b"G"), Err(HelloError::NotTls));
        assert_eq!(
            parse_client_hello(b"GET / HTTP/1.1\r\n\r\n"),
            Err(HelloError::NotTls)
        );
        assert_eq!(
            parse_client_hello(b"SSH-2.0-x\r\n"),
            Err(HelloError::NotTls)
        );
        // SSLv2-compatible hello.
        assert_eq!(
            parse_client_hello(&[0x80, 0x2e, 0x01, 0x03, 0x01]),
            Err(HelloError::NotTls)
        );
        // A handshake content type with a wrong version byte.
        assert_eq!(parse_client_hello(&[22, 9]), Err(HelloError::NotTls));
    }

    #[test]
    fn other_handshake_messages_are_refused() {
        let mut message = client_hello_message(None);
        message[0] = 2; // ServerHello
        assert_eq!(
            parse_client_hello(&records(&message, MAX_RECORD_PAYLOAD)),
            Err(HelloError::NotClientHello)
        );
    }

    #[test]
    fn oversized_hellos_are_refused() {
        // A handshake header that announces more than the buffer may hold.
        let bytes = [22, 3, 1, 0, 4, 1, 0x01, 0x00, 0x00];
        assert_eq!(parse_client_hello(&bytes), Err(HelloError::TooLarge));
        // A record longer than TLS allows.
        let bytes = [22, 3, 1, 0x40, 0x01, 1];
        assert!(matches!(
            parse_client_hello(&bytes),
            Err(HelloError::Malformed(_))
        ));
    }

    /// `message` split into exactly `count` handshake records of nearly equal size.
    fn records_exactly(message: &[u8], count: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut start = 0;
        for at in 1..=count {
            let end = message.len() * at / count;
            out.extend_from_slice(&records(&message[start..end], MAX_RECORD_PAYLOAD));
            start = end;
        }
        out
    }

    #[test]
    fn a_hello_in_more_records_than_allowed_is_refused() {
        let message = client_hello_message(Some(sni_extension(&[(0, b"a.test")])));
        assert_eq!(
            parse_client_hello(&records_exactly(&message, MAX_CLIENT_HELLO_RECORDS)),
            sni("a.test"),
            "{MAX_CLIENT_HELLO_RECORDS} records are read"
        );
        let bytes = records_exactly(&message, MAX_CLIENT_HELLO_RECORDS + 1);
        assert_eq!(
            parse_client_hello(&bytes),
            Err(HelloError::Malformed(
                "ClientHello split into too many records"
            ))
        );
        // Refused as soon as the header of the record past the bound is in, not later.
        let mut starts = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            starts.push(at);
            at +=
                RECORD_HEADER_LEN + usize::from(u16::from_be_bytes([bytes[at + 3], bytes[at + 4]]));
        }
        let extra = starts[MAX_CLIENT_HELLO_RECORDS];
        assert_eq!(
            parse_client_hello(&bytes[..extra + RECORD_HEADER_LEN - 1]),
            Ok(Hello::Incomplete)
        );
        assert!(matches!(
            parse_client_hello(&bytes[..extra + RECORD_HEADER_LEN]),
            Err(HelloError::Malformed(_))
        ));
    }

    /// The largest hello accepted, in as many records as accepted, fits the read buffer.
    #[test]
    fn the_largest_hello_in_the_most_records_fits_the_buffer() {
        let bare = client_hello_message(Some(sni_extension(&[(0, b"big.test")]))).len();
        let padding = MAX_RECORD_PAYLOAD - bare - 4;
        let mut extensions = sni_extension(&[(0, b"big.test")]);
        extensions.extend(extension(0x0015, &vec![0; padding]));
        let message = client_hello_message(Some(extensions));
        assert_eq!(message.len(), MAX_RECORD_PAYLOAD);
        let bytes = records(&message, MAX_RECORD_PAYLOAD / MAX_CLIENT_HELLO_RECORDS);
        assert_eq!(bytes.len(), MAX_CLIENT_HELLO_BUFFER);
        assert_eq!(parse_client_hello(&bytes), sni("big.test"));
        assert_eq!(
            parse_client_hello(&records(&message, MAX_RECORD_PAYLOAD)),
            sni("big.test")
        );
        // One byte more is too large, in one record or many.
        let mut extensions = sni_extension(&[(0, b"big.test")]);
        extensions.extend(extension(0x0015, &vec![0; padding + 1]));
        let message = client_hello_message(Some(extensions));
        assert_eq!(
            parse_client_hello(&records(&message, MAX_RECORD_PAYLOAD)),
            Err(HelloError::TooLarge)
        );
    }

    /// Cases the split properties found, each decided differently by the old reader depending
    /// on how the reads fell: now the same answer for every split into reads.
    #[test]
    fn the_answer_is_the_same_for_every_split_into_reads() {
        let message = client_hello_message(Some(sni_extension(&[(0, b"a.test")])));
        let over_many = records_exactly(&message, MAX_CLIENT_HELLO_RECORDS + 1);
        let mut then_early_data = records_exactly(&message, 30);
        for _ in 0..5 {
            then_early_data.extend_from_slice(&[23, 3, 3, 0, 2, 1, 2]);
        }
        // A record carrying the end of the hello and more bytes that never come.
        let mut in_a_longer_record = records(&message, MAX_RECORD_PAYLOAD);
        in_a_longer_record[4] += 9;
        let partial_record_of_another_message = [22, 3, 1, 0, 85, 2, 0, 0];
        for bytes in [
            &over_many[..],
            &then_early_data,
            &in_a_longer_record,
            &partial_record_of_another_message,
        ] {
            let whole = parse_client_hello(bytes);
            for split in [1, 2, 5, 7, 64] {
                let mut reader = HelloReader::default();
                let mut answer = Ok(Hello::Incomplete);
                for end in (split..bytes.len()).step_by(split).chain([bytes.len()]) {
                    answer = reader.read(&bytes[..end]);
                    if answer != Ok(Hello::Incomplete) {
                        break;
                    }
                }
                assert_eq!(answer, whole, "reads of {split} bytes");
            }
        }
    }

    #[test]
    fn truncated_fields_inside_a_complete_message_are_malformed() {
        let full = client_hello_message(Some(sni_extension(&[(0, b"a.test")])));
        // Shorten the body while keeping the declared handshake length consistent: every
        // field boundary cut must give an error, never a panic or a wrong name.
        for cut in HANDSHAKE_HEADER_LEN..full.len() {
            let mut message = full[..cut].to_vec();
            let body_len = (cut - HANDSHAKE_HEADER_LEN) as u32;
            message[1..4].copy_from_slice(&body_len.to_be_bytes()[1..]);
            let result = parse_client_hello(&records(&message, MAX_RECORD_PAYLOAD));
            let fine_without_extensions = result == Ok(Hello::Complete { sni: None });
            assert!(
                matches!(result, Err(HelloError::Malformed(_))) || fine_without_extensions,
                "cut at {cut}: {result:?}"
            );
        }
    }

    #[test]
    fn malformed_server_names_are_refused() {
        let with = |extensions: Vec<u8>| {
            parse_client_hello(&records(
                &client_hello_message(Some(extensions)),
                MAX_RECORD_PAYLOAD,
            ))
        };
        assert!(matches!(
            with(sni_extension(&[(0, b"")])),
            Err(HelloError::Malformed(_))
        ));
        assert!(matches!(
            with(sni_extension(&[(0, "bücher.test".as_bytes())])),
            Err(HelloError::Malformed(_))
        ));
        assert!(matches!(
            with(sni_extension(&[(0, b"a test")])),
            Err(HelloError::Malformed(_))
        ));
        let mut twice = sni_extension(&[(0, b"a.test")]);
        twice.extend(sni_extension(&[(0, b"b.test")]));
        assert!(matches!(with(twice), Err(HelloError::Malformed(_))));
        // A list length longer than the extension.
        assert!(matches!(
            with(extension(0, &[0, 9, 0, 0, 1, b'a'])),
            Err(HelloError::Malformed(_))
        ));
        // An unknown name type is skipped; the host_name after it is used.
        assert_eq!(
            with(sni_extension(&[(7, b"xx"), (0, b"b.test")])),
            sni("b.test")
        );
    }

    #[test]
    fn interleaved_non_handshake_record_is_malformed() {
        let message = client_hello_message(Some(sni_extension(&[(0, b"a.test")])));
        let mut bytes = records(&message[..10], MAX_RECORD_PAYLOAD);
        bytes.extend_from_slice(&[21, 3, 3, 0, 2, 2, 40]);
        assert!(matches!(
            parse_client_hello(&bytes),
            Err(HelloError::Malformed(_))
        ));
    }

    #[test]
    fn garbage_never_panics() {
        // A small deterministic generator: no dependency, same inputs every run.
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let valid = hello_with_sni("fuzz.example.com");
        for round in 0..20_000 {
            let mut bytes = if round % 2 == 0 {
                valid.clone()
            } else {
                let len = (next() % 600) as usize;
                let mut random: Vec<u8> = (0..len).map(|_| next() as u8).collect();
                // Often start like a handshake record so the parser goes deep.
                if random.len() >= 3 {
                    random[0] = 22;
                    random[1] = 3;
                }
                random
            };
            for _ in 0..(next() % 4) {
                if bytes.is_empty() {
                    break;
                }
                let at = (next() as usize) % bytes.len();
                bytes[at] = next() as u8;
            }
            let cut = (next() as usize) % (bytes.len() + 1);
            let _ = parse_client_hello(&bytes[..cut]);
        }
    }

    #[test]
    fn a_real_rustls_client_hello() {
        use std::sync::Arc;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth();
        let name = rustls_pki_types::ServerName::try_from("Real.Example.org").unwrap();
        let mut client = rustls::ClientConnection::new(Arc::new(config), name).unwrap();
        let mut bytes = Vec::new();
        client.write_tls(&mut bytes).unwrap();
        assert_eq!(parse_client_hello(&bytes), sni("real.example.org"));
    }
}

#[cfg(test)]
mod proptests;
