//! Property tests for what the stub resolver takes from a DNS response: the question check,
//! the records of the asked type behind a CNAME chain, their smallest TTL, and the provider
//! keys made of the addresses. Responses come from the network, so they are fed as bytes
//! through hickory's decoder, as `udp_exchange` and `tcp_exchange` do.
//!
//! The seed is fixed and failures are not persisted: see `config` in
//! `proxy/h1client/proptests.rs`, whose reasons hold here too.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA, CNAME, MX, SRV, TXT};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::RngSeed;

use super::*;

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x5241_4148_4931_3233),
        ..ProptestConfig::default()
    }
}

const SERVER: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 53)), 53);

// ---------------------------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------------------------

/// An absolute name under a given first label, the rest random; spelt in random case.
fn name_under(first: String, rest: &[String], case: u64) -> Name {
    let text: String = std::iter::once(first)
        .chain(rest.iter().cloned())
        .collect::<Vec<_>>()
        .join(".")
        .chars()
        .enumerate()
        .map(|(at, c)| {
            if case >> (at % 64) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c
            }
        })
        .collect();
    let mut name = Name::from_ascii(&text).unwrap();
    name.set_fqdn(true);
    name
}

fn labels() -> impl Strategy<Value = Vec<String>> + Clone {
    vec("[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", 1..4)
}

/// `name` spelt in another random case: the same name to DNS (RFC 4343).
fn recase(name: &Name, case: u64) -> Name {
    let text: String = name
        .to_ascii()
        .chars()
        .enumerate()
        .map(|(at, c)| {
            if case >> (at % 64) & 1 == 1 {
                c.to_ascii_uppercase()
            } else {
                c.to_ascii_lowercase()
            }
        })
        .collect();
    Name::from_ascii(text).unwrap()
}

fn ttl() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(0u32),
        1u32..=600,
        // RFC 2181 §8: TTLs are 31-bit values...
        0u32..=0x7fff_ffff,
        // ...and a server may still send the top bit set.
        0x8000_0000u32..=u32::MAX,
    ]
}

/// The TTL a cache must take from a record: RFC 2181 §8 treats one with the top bit set as 0.
fn rfc2181(ttl: u32) -> u32 {
    if ttl >= 1 << 31 {
        0
    } else {
        ttl
    }
}

fn rdata_of(kind: RecordType) -> BoxedStrategy<RData> {
    match kind {
        RecordType::A => any::<[u8; 4]>()
            .prop_map(|ip| RData::A(A(ip.into())))
            .boxed(),
        RecordType::AAAA => any::<[u8; 16]>()
            .prop_map(|ip| RData::AAAA(AAAA(ip.into())))
            .boxed(),
        RecordType::SRV => (
            any::<u16>(),
            any::<u16>(),
            any::<u16>(),
            labels(),
            any::<u64>(),
        )
            .prop_map(|(priority, weight, port, labels, case)| {
                let target = name_under("t".to_owned(), &labels, case);
                RData::SRV(SRV::new(priority, weight, port, target))
            })
            .boxed(),
        RecordType::TXT => vec("[ -~]{0,20}", 1..3)
            .prop_map(|texts| RData::TXT(TXT::new(texts)))
            .boxed(),
        RecordType::MX => (any::<u16>(), labels(), any::<u64>())
            .prop_map(|(preference, labels, case)| {
                RData::MX(MX::new(
                    preference,
                    name_under("mx".to_owned(), &labels, case),
                ))
            })
            .boxed(),
        other => unreachable!("no generator for {other}"),
    }
}

const ASKED_TYPES: &[RecordType] = &[RecordType::A, RecordType::AAAA, RecordType::SRV];
const ALL_TYPES: &[RecordType] = &[
    RecordType::A,
    RecordType::AAAA,
    RecordType::SRV,
    RecordType::TXT,
    RecordType::MX,
];

/// A record at `owner` of a random type other than `not`.
fn other_type_record(owner: Name, not: RecordType) -> impl Strategy<Value = Record> {
    let kinds: Vec<RecordType> = ALL_TYPES.iter().copied().filter(|&k| k != not).collect();
    (prop::sample::select(kinds), any::<u64>()).prop_flat_map(move |(kind, case)| {
        let owner = recase(&owner, case);
        (rdata_of(kind), ttl())
            .prop_map(move |(data, ttl)| Record::from_rdata(owner.clone(), ttl, data))
    })
}

/// Why a record is in the answer section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    /// Of the asked type, owned by the end of the CNAME chain: part of the answer.
    Wanted,
    /// A CNAME of the chain from the question's name.
    Chain,
    /// Anything else: other types, other owners, CNAMEs of other names.
    Unrelated,
}

/// A generated response and what the resolver must take from it.
#[derive(Debug, Clone)]
struct GeneratedResponse {
    qname: Name,
    qtype: RecordType,
    /// CNAME hops from the question's name to the records.
    hops: usize,
    answers: Vec<(Record, Role)>,
    /// Records of the asked type at the end of the chain in the additional or authority
    /// section, which are not answers.
    elsewhere: Vec<Record>,
}

impl GeneratedResponse {
    fn message(&self) -> Message {
        let mut message = Message::new();
        message
            .set_id(7)
            .set_message_type(MessageType::Response)
            .set_op_code(OpCode::Query)
            .set_recursion_desired(true)
            .set_recursion_available(true)
            .add_query(Query::query(self.qname.clone(), self.qtype))
            .add_answers(self.answers.iter().map(|(record, _)| record.clone()));
        for (at, record) in self.elsewhere.iter().enumerate() {
            if at % 2 == 0 {
                message.add_additional(record.clone());
            } else {
                message.add_name_server(record.clone());
            }
        }
        message
    }

    /// The wanted records in answer order, unless the chain is longer than followed.
    fn expected_records(&self) -> Vec<Record> {
        if self.hops > MAX_CNAME_HOPS {
            return Vec::new();
        }
        self.answers
            .iter()
            .filter(|(_, role)| *role == Role::Wanted)
            .map(|(record, _)| record.clone())
            .collect()
    }

    /// The smallest TTL of the chain and the records, when there are records; a TTL of 2^31
    /// or more counts as 0.
    fn expected_ttl(&self) -> Option<u32> {
        if self.expected_records().is_empty() {
            return None;
        }
        self.answers
            .iter()
            .filter(|(_, role)| *role != Role::Unrelated)
            .map(|(record, _)| rfc2181(record.ttl()))
            .min()
    }
}

fn response() -> impl Strategy<Value = GeneratedResponse> {
    (
        labels(),
        any::<u64>(),
        prop::sample::select(ASKED_TYPES),
        prop_oneof![6 => 0usize..=3, 2 => 0usize..=MAX_CNAME_HOPS, 1 => (MAX_CNAME_HOPS + 1)..=20],
    )
        .prop_flat_map(|(qlabels, qcase, qtype, hops)| {
            let qname = name_under("q".to_owned(), &qlabels, qcase);
            // The chain: q -> h1 -> ... -> h<hops>; names are distinct by their first label.
            let chain: Vec<Name> = std::iter::once(qname.clone())
                .chain((1..=hops).map(|hop| name_under(format!("h{hop}"), &qlabels, qcase)))
                .collect();
            let end = chain[hops].clone();
            let cnames = vec((ttl(), any::<u64>(), any::<u64>()), hops).prop_map({
                let chain = chain.clone();
                move |spellings| {
                    spellings
                        .into_iter()
                        .enumerate()
                        .map(|(hop, (ttl, owner_case, target_case))| {
                            let owner = recase(&chain[hop], owner_case);
                            let target = recase(&chain[hop + 1], target_case);
                            (
                                Record::from_rdata(owner, ttl, RData::CNAME(CNAME(target))),
                                Role::Chain,
                            )
                        })
                        .collect::<Vec<_>>()
                }
            });
            let wanted = vec((rdata_of(qtype), ttl(), any::<u64>()), 0..6).prop_map({
                let end = end.clone();
                move |records| {
                    records
                        .into_iter()
                        .map(|(data, ttl, case)| {
                            (
                                Record::from_rdata(recase(&end, case), ttl, data),
                                Role::Wanted,
                            )
                        })
                        .collect::<Vec<_>>()
                }
            });
            // Unrelated: other types at the end of the chain; the asked type at other names;
            // CNAMEs from other names, into the chain or elsewhere.
            let unrelated_owner = (labels(), any::<u64>(), 0..1000u32)
                .prop_map(|(labels, case, n)| name_under(format!("u{n}"), &labels, case));
            let into = prop_oneof![prop::sample::select(chain.clone()), unrelated_owner.clone(),];
            let unrelated = vec(
                prop_oneof![
                    other_type_record(end.clone(), qtype),
                    (unrelated_owner.clone(), rdata_of(qtype), ttl())
                        .prop_map(|(owner, data, ttl)| Record::from_rdata(owner, ttl, data)),
                    (unrelated_owner, into, ttl()).prop_map(|(owner, target, ttl)| {
                        Record::from_rdata(owner, ttl, RData::CNAME(CNAME(target)))
                    }),
                ]
                .prop_map(|record| (record, Role::Unrelated)),
                0..6,
            );
            let elsewhere = vec(
                (rdata_of(qtype), ttl()).prop_map({
                    let end = end.clone();
                    move |(data, ttl)| Record::from_rdata(end.clone(), ttl, data)
                }),
                0..3,
            );
            (
                Just((qname, qtype, hops)),
                (cnames, wanted, unrelated)
                    .prop_map(|(a, b, c)| [a, b, c].concat())
                    .prop_shuffle(),
                elsewhere,
            )
        })
        .prop_map(
            |((qname, qtype, hops), answers, elsewhere)| GeneratedResponse {
                qname,
                qtype,
                hops,
                answers,
                elsewhere,
            },
        )
}

/// A message as the resolver meets it: encoded by a server, decoded from the bytes.
fn through_the_wire(message: &Message) -> Message {
    Message::from_vec(&message.to_vec().expect("encodes")).expect("decodes")
}

// ---------------------------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(256))]

    /// The records of the asked type at the end of the CNAME chain (followed for at most
    /// `MAX_CNAME_HOPS` hops, names compared without case), in answer order, with the smallest
    /// TTL of the chain and the records (RFC 2181 §8: one ≥ 2^31 is 0); nothing from other
    /// names, other types, or other sections.
    #[test]
    fn the_answer_is_exactly_the_records_behind_the_chain(generated in response(), port in any::<u16>()) {
        let message = through_the_wire(&generated.message());
        let qname = generated.qname.clone();
        prop_assert!(check_question(SERVER, &message, &qname, generated.qtype).is_ok());
        let answer = answer_of(&message, &qname, generated.qtype);
        let expected = generated.expected_records();
        prop_assert_eq!(&answer.records, &expected);
        prop_assert_eq!(answer.ttl, generated.expected_ttl());
        prop_assert_eq!(
            min_ttl(std::iter::once(answer.ttl)),
            generated.expected_ttl().map(|ttl| Duration::from_secs(u64::from(ttl)))
        );
        let addresses: Vec<IpAddr> = answer.addresses().collect();
        let expected_addresses: Vec<IpAddr> = expected
            .iter()
            .filter_map(|record| match record.data() {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(aaaa) => Some(IpAddr::V6(aaaa.0)),
                _ => None,
            })
            .collect();
        prop_assert_eq!(&addresses, &expected_addresses);
        for ip in addresses {
            let key = address_key(ip, port);
            prop_assert_eq!(key.parse::<SocketAddr>().ok(), Some(SocketAddr::new(ip, port)));
            prop_assert_eq!(key.starts_with('['), ip.is_ipv6());
        }
    }

    /// A response to another question (another name, type or class) is refused; the same
    /// question spelt in another case is accepted.
    #[test]
    fn a_response_to_another_question_is_refused(
        generated in response(),
        change in 0..4usize,
        other_labels in labels(),
        other_type in prop::sample::select(ALL_TYPES),
        other_class in prop::sample::select(&[DNSClass::CH, DNSClass::HS, DNSClass::NONE, DNSClass::ANY][..]),
        case in any::<u64>(),
        code in prop::sample::select(&[ResponseCode::NoError, ResponseCode::NXDomain, ResponseCode::ServFail][..]),
    ) {
        let asked = generated.qname.clone();
        let mut message = generated.message();
        message.set_response_code(code);
        let mut question = Query::query(recase(&asked, case), generated.qtype);
        let same = match change {
            0 => true,
            1 => {
                question.set_name(name_under("other".to_owned(), &other_labels, case));
                false
            }
            2 => {
                question.set_query_type(other_type);
                other_type == generated.qtype
            }
            _ => {
                question.set_query_class(other_class);
                false
            }
        };
        message.queries_mut()[0] = question;
        let message = through_the_wire(&message);
        let checked = check_question(SERVER, &message, &asked, generated.qtype);
        prop_assert_eq!(
            checked.is_ok(),
            same,
            "asked {} {}, answered {:?}: {:?}",
            asked,
            generated.qtype,
            message.query(),
            checked
        );
    }
}

proptest! {
    #![proptest_config(config(64))]

    /// A response without a question cannot be matched to the query. Only an error code
    /// (a failed refresh either way) may come without it; NOERROR and NXDOMAIN are answers
    /// that change the endpoint set, so they must say which question they answer.
    #[test]
    fn only_an_error_may_come_without_the_question(
        generated in response(),
        code in prop::sample::select(&[
            ResponseCode::NoError,
            ResponseCode::NXDomain,
            ResponseCode::ServFail,
            ResponseCode::Refused,
            ResponseCode::FormErr,
            ResponseCode::NotImp,
        ][..]),
    ) {
        let mut message = generated.message();
        message.set_response_code(code);
        message.take_queries();
        let message = through_the_wire(&message);
        let checked = check_question(SERVER, &message, &generated.qname, generated.qtype);
        let is_answer = matches!(code, ResponseCode::NoError | ResponseCode::NXDomain);
        prop_assert_eq!(checked.is_ok(), !is_answer, "{:?}: {:?}", code, checked);
    }
}

/// Bytes for the decoder: random, a header followed by random sections, or a generated
/// response with bytes changed.
fn dns_like_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..512),
        (any::<[u8; 2]>(), 0u16..4, 0u16..8, vec(any::<u8>(), 0..400)).prop_map(
            |(id, questions, answers, rest)| {
                let mut bytes = id.to_vec();
                bytes.extend_from_slice(&[0x81, 0x80]);
                bytes.extend_from_slice(&questions.to_be_bytes());
                bytes.extend_from_slice(&answers.to_be_bytes());
                bytes.extend_from_slice(&[0, 0, 0, 0]);
                bytes.extend(rest);
                bytes
            }
        ),
        (
            response(),
            vec((any::<Index>(), any::<u8>()), 1..6),
            any::<Index>()
        )
            .prop_map(|(generated, changes, cut)| {
                let mut bytes = generated.message().to_vec().unwrap();
                for (at, byte) in changes {
                    let at = at.index(bytes.len());
                    bytes[at] = byte;
                }
                let keep = cut.index(bytes.len() + 1).max(bytes.len() * 3 / 4);
                bytes.truncate(keep);
                bytes
            }),
    ]
}

proptest! {
    #![proptest_config(config(1024))]

    /// Any bytes through hickory's decoder and then our checks: no panic, and an answer taken
    /// from a decoded message only ever holds records of the asked type from its answer
    /// section, with a TTL that is one of theirs or their chain's (31 bits, RFC 2181 §8).
    #[test]
    fn arbitrary_bytes_never_panic(
        bytes in dns_like_bytes(),
        asked_type in prop::sample::select(ASKED_TYPES),
    ) {
        let Ok(message) = Message::from_vec(&bytes) else { return Ok(()) };
        let asked = message
            .query()
            .map(|query| query.name().clone())
            .unwrap_or_else(Name::root);
        let _ = check_question(SERVER, &message, &asked, asked_type);
        let answer = answer_of(&message, &asked, asked_type);
        for record in &answer.records {
            prop_assert_eq!(record.record_type(), asked_type);
            prop_assert!(message.answers().contains(record));
        }
        if let Some(ttl) = answer.ttl {
            prop_assert!(ttl < 1 << 31);
            prop_assert!(message.answers().iter().any(|record| rfc2181(record.ttl()) == ttl));
            prop_assert!(answer.records.iter().all(|record| rfc2181(record.ttl()) >= ttl));
        } else {
            prop_assert!(answer.records.is_empty());
        }
        for ip in answer.addresses() {
            prop_assert!(address_key(ip, 53).parse::<SocketAddr>().is_ok());
        }
    }

    /// `min_ttl` is the smallest TTL among the answers that had one, in whole seconds.
    #[test]
    fn min_ttl_is_the_smallest_known_ttl(ttls in vec(proptest::option::of(any::<u32>()), 0..8)) {
        let expected = ttls.iter().flatten().min().map(|&ttl| Duration::from_secs(u64::from(ttl)));
        prop_assert_eq!(min_ttl(ttls.into_iter()), expected);
    }
}

/// A response to `svc.example. IN A` as a server would send it, with `edit` applied.
fn response_to_svc(edit: impl FnOnce(&mut Message)) -> (Message, Name) {
    let name = test_server::name("svc.example.");
    let mut message = Message::new();
    message
        .set_id(1)
        .set_message_type(MessageType::Response)
        .add_query(Query::query(name.clone(), RecordType::A))
        .add_answer(test_server::a("svc.example.", 30, "192.0.2.1"));
    edit(&mut message);
    (through_the_wire(&message), name)
}

/// Found by `a_response_to_another_question_is_refused`: the question's class was not
/// compared, so an answer for `svc.example. CH A` was taken for the `IN A` asked.
#[test]
fn a_response_in_another_class_is_refused() {
    let (message, name) = response_to_svc(|message| {
        message.queries_mut()[0].set_query_class(DNSClass::CH);
    });
    assert!(check_question(SERVER, &message, &name, RecordType::A).is_err());
}

/// Found by `only_an_error_may_come_without_the_question`: NXDOMAIN without the question was
/// accepted, yet NXDOMAIN is an empty answer that drains the source (DESIGN §4).
#[test]
fn nxdomain_without_the_question_is_refused() {
    let (message, name) = response_to_svc(|message| {
        message.set_response_code(ResponseCode::NXDomain);
        message.take_queries();
        message.take_answers();
    });
    assert!(check_question(SERVER, &message, &name, RecordType::A).is_err());
}

/// Found by `the_answer_is_exactly_the_records_behind_the_chain` once TTLs with the top bit set
/// were generated: 2^31 was taken as 68 years, so the answer never refreshed before the
/// interval. RFC 2181 §8 says to treat it as 0, which the runner floors to 1 s.
#[test]
fn a_ttl_with_the_top_bit_set_is_zero() {
    for (ttl, expected) in [(0x8000_0000, 0), (u32::MAX, 0), (0x7fff_ffff, 0x7fff_ffff)] {
        let (message, name) = response_to_svc(|message| {
            message.answers_mut()[0].set_ttl(ttl);
        });
        let answer = answer_of(&message, &name, RecordType::A);
        assert_eq!(answer.ttl, Some(expected), "TTL {ttl:#x}");
    }
    // In a CNAME chain too.
    let (message, name) = response_to_svc(|message| {
        message.take_answers();
        message.add_answer(test_server::cname(
            "svc.example.",
            0x8000_0000,
            "real.example.",
        ));
        message.add_answer(test_server::a("real.example.", 30, "192.0.2.1"));
    });
    assert_eq!(answer_of(&message, &name, RecordType::A).ttl, Some(0));
}
