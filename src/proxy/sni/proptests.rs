//! Property tests for the ClientHello server-name reader: a TLS passthrough route is chosen by
//! what it answers, from bytes a client sends before anything is authenticated.
//!
//! The seed is fixed and failures are not persisted: see `config` in
//! `proxy/h1client/proptests.rs`, whose reasons hold here too.

use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::RngSeed;

use super::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x5241_4148_4931_3232),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Generated ClientHellos, built by hand from RFC 8446 §4.1.2 and RFC 6066 §3
// ---------------------------------------------------------------------------------------------

/// A host name as RFC 6066 allows it (and a little more: `_`), in random case, at most
/// `MAX_HOST_NAME_LEN` bytes.
fn host_name() -> impl Strategy<Value = String> {
    let label = prop_oneof![
        8 => "[A-Za-z0-9]([A-Za-z0-9-]{0,20}[A-Za-z0-9])?",
        1 => "[A-Za-z0-9_-]{1,63}",
    ];
    vec(label, 1..8).prop_map(|labels| {
        let mut name = labels.join(".");
        name.truncate(MAX_HOST_NAME_LEN);
        // A cut may leave a trailing dot; RFC 6066 names have none.
        while name.ends_with('.') {
            name.pop();
        }
        name
    })
}

/// A long name, up to the limit, to reach the length check.
fn long_host_name() -> impl Strategy<Value = String> {
    (200..=MAX_HOST_NAME_LEN).prop_map(|len| {
        let mut name: String = "abcdefghij.".repeat(len / 11 + 1);
        name.truncate(len);
        name.replace_range(len - 1.., "z");
        name
    })
}

fn block8(data: &[u8]) -> Vec<u8> {
    let mut out = vec![u8::try_from(data.len()).unwrap()];
    out.extend_from_slice(data);
    out
}

fn block16(data: &[u8]) -> Vec<u8> {
    let mut out = u16::try_from(data.len()).unwrap().to_be_bytes().to_vec();
    out.extend_from_slice(data);
    out
}

fn extension(kind: u16, data: &[u8]) -> Vec<u8> {
    let mut out = kind.to_be_bytes().to_vec();
    out.extend_from_slice(&block16(data));
    out
}

/// The server_name extension's `server_name_list`: entries of other name types may come
/// before and after the one `host_name`.
#[derive(Debug, Clone)]
struct ServerNameList {
    before: Vec<(u8, Vec<u8>)>,
    host: Option<String>,
    after: Vec<(u8, Vec<u8>)>,
}

impl ServerNameList {
    fn encode(&self) -> Vec<u8> {
        let mut list = Vec::new();
        let mut entry = |kind: u8, name: &[u8]| {
            list.push(kind);
            list.extend_from_slice(&block16(name));
        };
        for (kind, name) in &self.before {
            entry(*kind, name);
        }
        if let Some(host) = &self.host {
            entry(NAME_TYPE_HOST_NAME, host.as_bytes());
        }
        for (kind, name) in &self.after {
            entry(*kind, name);
        }
        extension(EXTENSION_SERVER_NAME, &block16(&list))
    }
}

fn other_name_entries() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
    prop_oneof![
        4 => Just(Vec::new()),
        1 => vec((1u8..=255, vec(any::<u8>(), 0..16)), 1..3),
    ]
}

fn server_name_list() -> impl Strategy<Value = ServerNameList> {
    (
        other_name_entries(),
        prop_oneof![8 => host_name().prop_map(Some), 1 => long_host_name().prop_map(Some), 1 => Just(None)],
        other_name_entries(),
    )
        .prop_map(|(before, host, after)| ServerNameList {
            before,
            host,
            after,
        })
        .prop_filter("a list has at least one entry", |list| {
            list.host.is_some() || !list.before.is_empty() || !list.after.is_empty()
        })
}

/// Extensions other than server_name: common ones with plausible bodies, unknown ones, and
/// now and then a large padding extension.
fn other_extension() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        4 => (1u16..=0xffff, vec(any::<u8>(), 0..48)).prop_map(|(kind, data)| extension(kind, &data)),
        2 => prop::sample::select(vec![
            extension(0x000a, &[0, 4, 0, 0x1d, 0, 0x17]),
            extension(0x000b, &[1, 0]),
            extension(0x000d, &[0, 4, 4, 3, 8, 4]),
            extension(0x0010, &[0, 3, 2, b'h', b'2']),
            extension(0x002b, &[4, 3, 4, 3, 3]),
            extension(0x002d, &[1, 1]),
            extension(0x0017, &[]),
            extension(0xff01, &[0]),
        ]),
        1 => (0usize..3000).prop_map(|len| extension(0x0015, &vec![0; len])),
    ]
}

/// What the generated ClientHello is made of.
#[derive(Debug, Clone)]
struct GeneratedHello {
    /// The handshake message, header included.
    message: Vec<u8>,
    /// The server name the reader must find.
    sni: Option<String>,
}

fn client_hello_with(
    extensions_block: impl Strategy<Value = (Option<Vec<u8>>, Option<String>)>,
) -> impl Strategy<Value = GeneratedHello> {
    (
        0u8..=4,
        vec(any::<u8>(), 32),
        vec(any::<u8>(), 0..=32),
        vec(any::<u8>(), 1..=48),
        vec(any::<u8>(), 1..=4),
        extensions_block,
    )
        .prop_map(
            |(minor, random, session_id, suites, compression, (extensions, sni))| {
                let mut body = vec![3, minor];
                body.extend_from_slice(&random);
                body.extend_from_slice(&block8(&session_id));
                // Whole cipher suites: an even number of bytes.
                let suites = &suites[..suites.len() & !1];
                let suites = if suites.is_empty() {
                    &[0x13, 0x01][..]
                } else {
                    suites
                };
                body.extend_from_slice(&block16(suites));
                body.extend_from_slice(&block8(&compression));
                if let Some(extensions) = extensions {
                    body.extend_from_slice(&block16(&extensions));
                }
                let mut message = vec![HANDSHAKE_CLIENT_HELLO];
                message.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
                message.extend_from_slice(&body);
                GeneratedHello { message, sni }
            },
        )
}

/// A ClientHello with random fields and extensions, with a server_name extension at a random
/// place among them or none (then perhaps no extensions block at all).
fn client_hello() -> impl Strategy<Value = GeneratedHello> {
    let with_extensions = (
        vec(other_extension(), 0..8),
        proptest::option::weighted(0.85, (server_name_list(), any::<Index>())),
    )
        .prop_map(|(mut extensions, server_name)| {
            let sni = server_name.map(|(list, at)| {
                extensions.insert(at.index(extensions.len() + 1), list.encode());
                list.host.map(|host| host.to_ascii_lowercase())
            });
            (Some(extensions.concat()), sni.flatten())
        });
    client_hello_with(prop_oneof![
        9 => with_extensions,
        1 => Just((None, None)),
    ])
}

/// `message` cut at `cuts` into handshake records with random legacy record versions.
fn into_records(message: &[u8], cuts: &[usize], versions: &[u8]) -> (Vec<u8>, usize) {
    let mut ends: Vec<usize> = cuts
        .iter()
        .map(|&cut| cut.min(message.len()))
        .filter(|&cut| cut > 0)
        .collect();
    ends.push(message.len());
    ends.sort_unstable();
    ends.dedup();
    // No record may carry more than 2^14 bytes.
    let mut bounded = Vec::new();
    let mut start = 0;
    for end in ends {
        while end - start > MAX_RECORD_PAYLOAD {
            start += MAX_RECORD_PAYLOAD;
            bounded.push(start);
        }
        bounded.push(end);
        start = end;
    }
    let mut wire = Vec::new();
    let mut start = 0;
    for (at, &end) in bounded.iter().enumerate() {
        let fragment = &message[start..end];
        let version = versions.get(at).copied().unwrap_or(1);
        wire.extend_from_slice(&[CONTENT_TYPE_HANDSHAKE, 3, version]);
        wire.extend_from_slice(&block16(fragment));
        start = end;
    }
    (wire, bounded.len())
}

/// A hello on the wire: its records and how many there are.
#[derive(Debug, Clone)]
struct WireHello {
    hello: GeneratedHello,
    wire: Vec<u8>,
    records: usize,
}

fn wire_hello(max_cuts: usize) -> impl Strategy<Value = WireHello> {
    (
        client_hello(),
        prop_oneof![
            3 => Just(Vec::new()),
            2 => vec(any::<Index>(), 1..max_cuts),
        ],
        vec(0u8..=4, 0..64),
    )
        .prop_map(|(hello, cuts, versions)| {
            let len = hello.message.len();
            let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(len)).collect();
            let (wire, records) = into_records(&hello.message, &cuts, &versions);
            WireHello {
                hello,
                wire,
                records,
            }
        })
}

/// Whether the handshake message is within the size bound (what `message_len` checks).
fn fits(hello: &GeneratedHello) -> bool {
    hello.message.len() <= MAX_RECORD_PAYLOAD
}

fn cut_points(len: usize) -> Vec<usize> {
    if len <= 700 {
        return (0..len).collect();
    }
    let mut cuts: Vec<usize> = (0..24).chain(len - 24..len).collect();
    cuts.extend((24..len - 24).step_by(len / 151 + 1));
    cuts
}

/// How the caller's read loop (`read_client_hello` in `proxy/stream.rs`) ends when the client
/// sends `wire` in reads ending at `cuts`.
#[derive(Debug, PartialEq)]
enum Driven {
    Hello(Option<String>),
    /// The client sent everything and stopped without completing a ClientHello.
    Truncated,
    Refused(HelloError),
}

/// The caller's loop: feed the reader everything buffered after each read; never buffer more
/// than `MAX_CLIENT_HELLO_BUFFER`.
fn drive(wire: &[u8], cuts: &[usize]) -> Driven {
    let mut ends: Vec<usize> = cuts.iter().map(|&cut| cut.min(wire.len())).collect();
    ends.push(wire.len());
    ends.sort_unstable();
    ends.dedup();
    let mut buffered: Vec<u8> = Vec::new();
    let mut reader = HelloReader::default();
    let mut sent = 0;
    loop {
        match reader.read(&buffered) {
            Ok(Hello::Complete { sni }) => return Driven::Hello(sni),
            Ok(Hello::Incomplete) => {}
            Err(error) => return Driven::Refused(error),
        }
        let room = MAX_CLIENT_HELLO_BUFFER.saturating_sub(buffered.len());
        if room == 0 {
            return Driven::Refused(HelloError::TooLarge);
        }
        // The next read: up to the client's next cut, and no more than there is room for.
        let Some(&end) = ends.iter().find(|&&end| end > sent) else {
            return Driven::Truncated;
        };
        let end = end.min(sent + room);
        buffered.extend_from_slice(&wire[sent..end]);
        sent = end;
    }
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(256))]

    /// A generated ClientHello, in one record or fragmented over up to
    /// `MAX_CLIENT_HELLO_RECORDS`, yields exactly its server name; so does the same with other
    /// records after it. Over more records it is refused.
    #[test]
    fn a_generated_hello_yields_exactly_its_server_name(
        wire_hello in wire_hello(40),
        after in vec(any::<u8>(), 0..40),
    ) {
        let WireHello { hello, wire, records } = &wire_hello;
        let expected = if !fits(hello) {
            Err(HelloError::TooLarge)
        } else if *records > MAX_CLIENT_HELLO_RECORDS {
            Err(HelloError::Malformed("ClientHello split into too many records"))
        } else {
            Ok(Hello::Complete { sni: hello.sni.clone() })
        };
        prop_assert_eq!(&parse_client_hello(wire), &expected);
        let mut followed = wire.clone();
        followed.extend_from_slice(&[23, 3, 3]);
        followed.extend_from_slice(&block16(&after));
        prop_assert_eq!(&parse_client_hello(&followed), &expected);
    }

    /// Every strict prefix of a hello's records within the bounds asks for more: never an
    /// error, never a name.
    #[test]
    fn every_strict_prefix_is_incomplete(wire_hello in wire_hello(40)) {
        let WireHello { hello, wire, records } = &wire_hello;
        prop_assume!(fits(hello) && *records <= MAX_CLIENT_HELLO_RECORDS);
        prop_assert!(wire.len() <= MAX_CLIENT_HELLO_BUFFER);
        for cut in cut_points(wire.len()) {
            prop_assert_eq!(parse_client_hello(&wire[..cut]), Ok(Hello::Incomplete), "prefix of {} bytes", cut);
        }
    }

    /// Through the caller's read loop, with the client's bytes arriving in random reads: the
    /// server name when the hello is within the bounds (a message of `MAX_RECORD_PAYLOAD`
    /// bytes, `MAX_CLIENT_HELLO_RECORDS` records), else a refusal naming the bound; never
    /// another name.
    #[test]
    fn read_in_pieces_a_hello_within_the_bounds_yields_its_name(
        wire_hello in wire_hello(48),
        reads in vec(any::<Index>(), 0..24),
    ) {
        let WireHello { hello, wire, records } = &wire_hello;
        let reads: Vec<usize> = reads.iter().map(|cut| cut.index(wire.len() + 1)).collect();
        let driven = drive(wire, &reads);
        if !fits(hello) {
            prop_assert_eq!(driven, Driven::Refused(HelloError::TooLarge));
        } else if *records > MAX_CLIENT_HELLO_RECORDS {
            prop_assert!(
                matches!(driven, Driven::Refused(HelloError::Malformed(_))),
                "{} records: {:?}", records, driven
            );
        } else {
            prop_assert_eq!(driven, Driven::Hello(hello.sni.clone()));
        }
    }
}

/// Records a client may send right behind its ClientHello in the same flight (TLS 1.3 early
/// data, a middlebox-compatibility ChangeCipherSpec, a second handshake record): the reader
/// must decide without them.
fn records_after() -> impl Strategy<Value = Vec<u8>> {
    vec(
        (
            prop::sample::select(vec![20u8, 22, 23]),
            vec(any::<u8>(), 1..64),
        ),
        0..8,
    )
    .prop_map(|records| {
        let mut wire = Vec::new();
        for (kind, payload) in records {
            wire.extend_from_slice(&[kind, 3, 3]);
            wire.extend_from_slice(&block16(&payload));
        }
        wire
    })
}

/// A hello of any size up to a little past the largest handshake message the reader takes,
/// so that splits into records meet the buffer limit.
fn hello_near_the_limit() -> impl Strategy<Value = GeneratedHello> {
    (
        host_name(),
        (MAX_RECORD_PAYLOAD - 600)..=(MAX_RECORD_PAYLOAD + 20),
    )
        .prop_map(|(name, target)| {
            let message_with = |padding: usize| {
                let mut extensions = ServerNameList {
                    before: Vec::new(),
                    host: Some(name.clone()),
                    after: Vec::new(),
                }
                .encode();
                extensions.extend(extension(0x0015, &vec![0; padding]));
                let mut body = vec![3, 3];
                body.extend_from_slice(&[7; 32]);
                body.extend_from_slice(&block8(&[9; 32]));
                body.extend_from_slice(&block16(&[0x13, 0x01]));
                body.extend_from_slice(&block8(&[0]));
                body.extend_from_slice(&block16(&extensions));
                let mut message = vec![HANDSHAKE_CLIENT_HELLO];
                message.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
                message.extend_from_slice(&body);
                message
            };
            let message = message_with(target.saturating_sub(message_with(0).len()));
            GeneratedHello {
                message,
                sni: Some(name.to_ascii_lowercase()),
            }
        })
}

/// `hello` cut into records at `cuts`, the cuts bounded so that at most `max_records` records
/// result (fewer if `MAX_RECORD_PAYLOAD` allows).
fn records_of(hello: &GeneratedHello, cuts: &[Index], max_records: usize) -> (Vec<u8>, usize) {
    let len = hello.message.len();
    let cuts: Vec<usize> = cuts.iter().map(|cut| cut.index(len)).collect();
    let mut keep = cuts.len();
    loop {
        let (wire, records) = into_records(&hello.message, &cuts[..keep], &[]);
        if records <= max_records || keep == 0 {
            return (wire, records);
        }
        keep -= 1;
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// RFC 8446 §5.1 lets a client fragment its ClientHello into records as it likes: within
    /// the documented bounds (a message of at most `MAX_RECORD_PAYLOAD` bytes in at most
    /// `MAX_CLIENT_HELLO_RECORDS` records) every split yields the same server name, read whole
    /// or through the caller's loop; one of more records is refused, whatever the split.
    #[test]
    fn the_decision_does_not_depend_on_the_record_split(
        hello in prop_oneof![3 => client_hello(), 1 => hello_near_the_limit()],
        first in vec(any::<Index>(), 0..48),
        second in vec(any::<Index>(), 0..48),
        reads in vec(any::<Index>(), 0..24),
    ) {
        let expected = if hello.message.len() <= MAX_RECORD_PAYLOAD {
            Ok(Hello::Complete { sni: hello.sni.clone() })
        } else {
            Err(HelloError::TooLarge)
        };
        for cuts in [&first, &second] {
            let (wire, records) = records_of(&hello, cuts, usize::MAX);
            let reads: Vec<usize> = reads.iter().map(|cut| cut.index(wire.len() + 1)).collect();
            let whole = parse_client_hello(&wire);
            let driven = drive(&wire, &reads);
            if records <= MAX_CLIENT_HELLO_RECORDS || expected.is_err() {
                prop_assert_eq!(&whole, &expected, "{} records", records);
                prop_assert_eq!(
                    driven,
                    match &expected {
                        Ok(_) => Driven::Hello(hello.sni.clone()),
                        Err(error) => Driven::Refused(error.clone()),
                    },
                    "{} records", records
                );
            } else {
                prop_assert!(matches!(whole, Err(HelloError::Malformed(_))), "{} records: {:?}", records, whole);
                prop_assert!(matches!(driven, Driven::Refused(HelloError::Malformed(_))), "{} records: {:?}", records, driven);
            }
        }
    }

    /// The caller's loop decides from the bytes the client sent, never from how they arrived:
    /// any two splits of the same bytes into reads end alike (the same name, the same refusal,
    /// or both waiting for more), whatever follows the hello in the same flight.
    #[test]
    fn the_decision_does_not_depend_on_the_reads(
        wire_hello in wire_hello(48),
        after in records_after(),
        first in vec(any::<Index>(), 0..24),
        second in vec(any::<Index>(), 0..24),
    ) {
        let mut wire = wire_hello.wire.clone();
        wire.extend_from_slice(&after);
        let split = |reads: &Vec<Index>| -> Vec<usize> {
            reads.iter().map(|cut| cut.index(wire.len() + 1)).collect()
        };
        let one_read = drive(&wire, &[]);
        let first = drive(&wire, &split(&first));
        let second = drive(&wire, &split(&second));
        prop_assert_eq!(&first, &one_read, "{} records", wire_hello.records);
        prop_assert_eq!(&second, &one_read, "{} records", wire_hello.records);
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// Large hellos around the size bound: a message longer than `MAX_RECORD_PAYLOAD` is
    /// refused as too large as soon as its handshake header is in, and one within it is read.
    #[test]
    fn hellos_around_the_buffer_limit(
        target in (MAX_RECORD_PAYLOAD - 300)..(MAX_RECORD_PAYLOAD + 50),
        name in host_name(),
        fragment in prop_oneof![Just(MAX_RECORD_PAYLOAD), 1000usize..MAX_RECORD_PAYLOAD],
    ) {
        let message_with = |padding: usize| {
            let mut extensions = ServerNameList {
                before: Vec::new(),
                host: Some(name.clone()),
                after: Vec::new(),
            }
            .encode();
            extensions.extend(extension(0x0015, &vec![0; padding]));
            let mut body = vec![3, 3];
            body.extend_from_slice(&[7; 32]);
            body.extend_from_slice(&block8(&[9; 32]));
            body.extend_from_slice(&block16(&[0x13, 0x01]));
            body.extend_from_slice(&block8(&[0]));
            body.extend_from_slice(&block16(&extensions));
            let mut message = vec![HANDSHAKE_CLIENT_HELLO];
            message.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
            message.extend_from_slice(&body);
            message
        };
        // Padded to exactly `target` bytes.
        let message = message_with(target - message_with(0).len());
        prop_assert_eq!(message.len(), target);
        let cuts: Vec<usize> = (fragment..message.len()).step_by(fragment).collect();
        let (wire, _) = into_records(&message, &cuts, &[]);
        let hello = GeneratedHello { message, sni: Some(name.to_ascii_lowercase()) };
        if fits(&hello) {
            prop_assert_eq!(
                parse_client_hello(&wire),
                Ok(Hello::Complete { sni: hello.sni.clone() })
            );
            prop_assert!(wire.len() <= MAX_CLIENT_HELLO_BUFFER);
            prop_assert_eq!(parse_client_hello(&wire[..wire.len() - 1]), Ok(Hello::Incomplete));
        } else {
            // Refused once the handshake header (record header and 4 bytes) is in.
            prop_assert_eq!(
                parse_client_hello(&wire[..RECORD_HEADER_LEN + 3]),
                Ok(Hello::Incomplete)
            );
            prop_assert_eq!(
                parse_client_hello(&wire[..RECORD_HEADER_LEN + 4]),
                Err(HelloError::TooLarge)
            );
            prop_assert_eq!(parse_client_hello(&wire), Err(HelloError::TooLarge));
        }
    }
}

/// Bytes that look like TLS often enough to go deep: a handshake record header, then random
/// bytes or a mutated real hello.
fn tls_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    let mutation = prop_oneof![
        (any::<Index>(), any::<u8>()).prop_map(|(at, byte)| (at, Some(byte))),
        any::<Index>().prop_map(|at| (at, None)),
    ];
    prop_oneof![
        vec(any::<u8>(), 0..400),
        vec(any::<u8>(), 0..400).prop_map(|mut bytes| {
            bytes.splice(0..0, [22, 3, 1]);
            bytes
        }),
        (wire_hello(8), vec(mutation, 1..6)).prop_map(|(hello, mutations)| {
            let mut wire = hello.wire;
            for (at, byte) in mutations {
                if wire.is_empty() {
                    break;
                }
                let at = at.index(wire.len());
                match byte {
                    Some(byte) => wire[at] = byte,
                    None => {
                        wire.remove(at);
                    }
                }
            }
            wire
        }),
    ]
}

proptest! {
    #![proptest_config(config(1024))]

    /// Any bytes, sent in any two splits into reads, end alike: the reader's answer is a
    /// function of the bytes, not of when they came.
    #[test]
    fn for_any_bytes_the_decision_does_not_depend_on_the_reads(
        bytes in tls_like_bytes(),
        first in vec(any::<Index>(), 0..12),
        second in vec(any::<Index>(), 0..12),
    ) {
        let split = |reads: &Vec<Index>| -> Vec<usize> {
            reads.iter().map(|cut| cut.index(bytes.len() + 1)).collect()
        };
        let one_read = drive(&bytes, &[]);
        prop_assert_eq!(&drive(&bytes, &split(&first)), &one_read);
        prop_assert_eq!(&drive(&bytes, &split(&second)), &one_read);
    }

    /// Any bytes: no panic; a name found is a valid lower-case host name; and an answer, once
    /// given for a prefix, is never contradicted by more bytes: a complete hello stays the
    /// same hello, an error stays an error, and a name is never found from fewer bytes than
    /// the full answer needs and then changed.
    #[test]
    fn arbitrary_bytes_never_panic_and_answers_never_change(
        bytes in tls_like_bytes(),
        cut in any::<Index>(),
    ) {
        let full = parse_client_hello(&bytes);
        if let Ok(Hello::Complete { sni: Some(name) }) = &full {
            prop_assert!(!name.is_empty() && name.len() <= MAX_HOST_NAME_LEN);
            prop_assert!(name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b)));
        }
        let cut = cut.index(bytes.len() + 1);
        let prefix = parse_client_hello(&bytes[..cut]);
        match &prefix {
            Ok(Hello::Incomplete) => {}
            Ok(Hello::Complete { .. }) => prop_assert_eq!(&full, &prefix),
            Err(_) => prop_assert!(full.is_err(), "{:?} then {:?}", prefix, full),
        }
        // The reader fed the prefix, then all the bytes, answers as if fed them at once.
        let mut reader = HelloReader::default();
        match reader.read(&bytes[..cut]) {
            Ok(Hello::Incomplete) => prop_assert_eq!(reader.read(&bytes), full),
            answer => prop_assert_eq!(answer, prefix),
        }
    }

    /// The reader fed bytes as they grow answers, at every step, what `parse_client_hello`
    /// answers for the bytes so far: it keeps nothing from earlier calls that the bytes do not
    /// say.
    #[test]
    fn the_reader_answers_as_the_whole_parse_at_every_step(
        bytes in prop_oneof![
            tls_like_bytes(),
            (wire_hello(48), records_after()).prop_map(|(hello, after)| [hello.wire, after].concat()),
        ],
        reads in vec(any::<Index>(), 0..40),
    ) {
        let mut ends: Vec<usize> = reads.iter().map(|cut| cut.index(bytes.len() + 1)).collect();
        ends.push(bytes.len());
        ends.sort_unstable();
        let mut reader = HelloReader::default();
        for end in ends {
            let answer = reader.read(&bytes[..end]);
            prop_assert_eq!(&answer, &parse_client_hello(&bytes[..end]), "after {} bytes", end);
            if answer != Ok(Hello::Incomplete) {
                break;
            }
        }
    }
}
