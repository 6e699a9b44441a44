//! The stub DNS client both DNS providers share.
//!
//! Written on hickory-proto messages rather than a caching resolver library because the contract
//! needs exact control: every refresh must ask the server (no cache), and the response code
//! decides the outcome class — NOERROR and NXDOMAIN are successful answers (possibly empty),
//! SERVFAIL/REFUSED/... are failed refreshes, silence and garbage are lookup failures. Queries go
//! over UDP and are repeated over TCP when the answer is truncated.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use hickory_proto::op::{Edns, Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};
use tokio::time::{timeout_at, Instant};

use crate::discovery::config::inner_budget;
use crate::discovery::DiscoveryError;

/// Each server gets this many tries per query, spread over the refresh budget: a second try
/// covers one lost UDP datagram without retrying forever.
pub(crate) const ROUNDS: usize = 2;
/// Advertised EDNS UDP payload size: the DNS flag day 2020 value that avoids IP fragmentation.
const EDNS_PAYLOAD: u16 = 1232;
/// Longest CNAME chain followed inside one answer.
const MAX_CNAME_HOPS: usize = 16;
const RESOLV_CONF: &str = "/etc/resolv.conf";

/// The provider key of an address endpoint: `ip:port`, IPv6 in brackets.
pub(crate) fn address_key(ip: IpAddr, port: u16) -> String {
    SocketAddr::new(ip, port).to_string()
}

/// A record's TTL as a cache must read it: RFC 2181 §8 makes TTLs 31-bit values and says one
/// with the most significant bit set is to be treated as 0, so a server cannot stretch (or, by
/// wrapping, garble) the refresh hint. A 0 then means "refresh soon": the runner's floor applies.
fn record_ttl(record: &Record) -> u32 {
    const LARGEST: u32 = 0x7fff_ffff;
    match record.ttl() {
        ttl @ 0..=LARGEST => ttl,
        _ => 0,
    }
}

/// The smallest TTL among answers that had records, as the refresh hint.
pub(crate) fn min_ttl(ttls: impl Iterator<Item = Option<u32>>) -> Option<Duration> {
    ttls.flatten()
        .min()
        .map(|ttl| Duration::from_secs(u64::from(ttl)))
}

/// Where queries go: one configured server, or whatever /etc/resolv.conf says at refresh time.
#[derive(Debug, Clone)]
pub(crate) struct Resolver {
    server: Option<SocketAddr>,
    budget: Duration,
    resolv_conf: PathBuf,
}

impl Resolver {
    pub(crate) fn new(server: Option<SocketAddr>, timeout: Duration) -> Self {
        Resolver {
            server,
            budget: inner_budget(timeout),
            resolv_conf: PathBuf::from(RESOLV_CONF),
        }
    }

    /// Starts one refresh: its servers and search rules, and the deadline all its queries share.
    /// resolv.conf is read each time so a changed file applies without a restart.
    pub(crate) async fn session(&self) -> Session {
        let conf = match self.server {
            Some(server) => SystemConf::single(server),
            None => match tokio::fs::read_to_string(&self.resolv_conf).await {
                Ok(text) => SystemConf::parse(&text),
                // As the C library does: no readable file means a server on localhost.
                Err(_) => SystemConf::parse(""),
            },
        };
        let started = Instant::now();
        Session {
            conf,
            started,
            deadline: started + self.budget,
        }
    }
}

/// The parts of resolv.conf a stub resolver needs.
#[derive(Debug, Clone, PartialEq)]
struct SystemConf {
    servers: Vec<SocketAddr>,
    search: Vec<String>,
    ndots: usize,
}

impl SystemConf {
    /// An explicitly configured server takes names as absolute, like nginx and HAProxy resolvers.
    fn single(server: SocketAddr) -> Self {
        SystemConf {
            servers: vec![server],
            search: Vec::new(),
            ndots: 1,
        }
    }

    /// Reads `nameserver`, `search`/`domain` (the last one wins) and `options ndots:N`; the
    /// defaults follow the C library (localhost, no search, ndots 1).
    fn parse(text: &str) -> Self {
        let mut conf = SystemConf {
            servers: Vec::new(),
            search: Vec::new(),
            ndots: 1,
        };
        for line in text.lines() {
            let line = line.split(['#', ';']).next().unwrap_or_default();
            let mut words = line.split_whitespace();
            match words.next() {
                // Link-local addresses with a zone (`fe80::1%eth0`) do not parse and are skipped.
                Some("nameserver") => {
                    if let Some(ip) = words.next().and_then(|word| word.parse::<IpAddr>().ok()) {
                        conf.servers.push(SocketAddr::new(ip, 53));
                    }
                }
                Some("search") | Some("domain") => {
                    conf.search = words
                        .map(|domain| domain.trim_end_matches('.').to_owned())
                        .filter(|domain| !domain.is_empty())
                        .collect();
                }
                Some("options") => {
                    for option in words {
                        if let Some(value) = option.strip_prefix("ndots:") {
                            conf.ndots = value.parse::<usize>().map_or(1, |ndots| ndots.min(15));
                        }
                    }
                }
                _ => {}
            }
        }
        if conf.servers.is_empty() {
            conf.servers
                .push(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 53));
        }
        conf
    }

    /// The names to try, in order, for `name` (the C library's search-list rules).
    fn candidates(&self, name: &str) -> Result<Vec<Name>, String> {
        if name.ends_with('.') || self.search.is_empty() {
            return Ok(vec![absolute_name(name)?]);
        }
        let as_is = absolute_name(name)?;
        let searched = self
            .search
            .iter()
            .filter_map(|domain| absolute_name(&format!("{name}.{domain}")).ok());
        let dots = name.matches('.').count();
        Ok(if dots >= self.ndots {
            std::iter::once(as_is).chain(searched).collect()
        } else {
            searched.chain(std::iter::once(as_is)).collect()
        })
    }
}

fn absolute_name(name: &str) -> Result<Name, String> {
    let mut parsed =
        Name::from_ascii(name).map_err(|err| format!("{name:?} is not a valid DNS name: {err}"))?;
    parsed.set_fqdn(true);
    Ok(parsed)
}

/// The records of one type a query found (following CNAMEs), with their smallest TTL.
#[derive(Debug, Clone, Default)]
pub(crate) struct Answer {
    pub records: Vec<Record>,
    /// None when there are no records: "no such records" carries no refresh hint. Read with
    /// `record_ttl`, so never above 2^31 − 1.
    pub ttl: Option<u32>,
}

impl Answer {
    pub(crate) fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.records
            .iter()
            .filter_map(|record| match record.data() {
                RData::A(a) => Some(IpAddr::V4(a.0)),
                RData::AAAA(aaaa) => Some(IpAddr::V6(aaaa.0)),
                _ => None,
            })
    }
}

/// One refresh's view of the resolver: shared servers, search rules and deadline.
pub(crate) struct Session {
    conf: SystemConf,
    started: Instant,
    deadline: Instant,
}

impl Session {
    /// Records of `record_type` for `name`. NXDOMAIN and NODATA are an empty answer; error
    /// codes are `DnsResponse`; silence, network trouble and garbage are `DnsLookup`.
    pub(crate) async fn lookup(
        &self,
        name: &str,
        record_type: RecordType,
    ) -> Result<Answer, DiscoveryError> {
        let fail = |reason: String| DiscoveryError::DnsLookup {
            name: name.to_owned(),
            record_type: record_type.to_string(),
            reason,
        };
        for candidate in self.conf.candidates(name).map_err(fail)? {
            let answer = self
                .query(&candidate, record_type)
                .await
                .map_err(|failure| failure.into_error(name, record_type, self.started))?;
            if !answer.records.is_empty() {
                return Ok(answer);
            }
        }
        Ok(Answer::default())
    }

    /// Asks each server in turn until one gives a usable answer, within the session deadline.
    async fn query(&self, name: &Name, record_type: RecordType) -> Result<Answer, Failure> {
        let tries = ROUNDS * self.conf.servers.len();
        let mut last = Failure::Silent {
            server: self.conf.servers[0],
        };
        for (index, server) in self.conf.servers.iter().cycle().take(tries).enumerate() {
            let now = Instant::now();
            if now >= self.deadline {
                break;
            }
            // The remaining time is shared evenly among the remaining tries.
            let share = (self.deadline - now) / u32::try_from(tries - index).unwrap_or(1);
            match exchange(*server, name, record_type, now + share, self.deadline).await {
                Ok(response) => match response.response_code() {
                    ResponseCode::NoError => return Ok(answer_of(&response, name, record_type)),
                    ResponseCode::NXDomain => return Ok(Answer::default()),
                    code => last = Failure::Code(code),
                },
                Err(failure) => last = failure,
            }
        }
        Err(last)
    }
}

/// Why a query got no usable answer from a server.
#[derive(Debug)]
enum Failure {
    Silent { server: SocketAddr },
    Network { server: SocketAddr, reason: String },
    Malformed { server: SocketAddr, reason: String },
    Code(ResponseCode),
}

impl Failure {
    fn into_error(self, name: &str, record_type: RecordType, started: Instant) -> DiscoveryError {
        let reason = match self {
            Failure::Code(code) => {
                return DiscoveryError::DnsResponse {
                    name: name.to_owned(),
                    record_type: record_type.to_string(),
                    code: rcode_name(code),
                }
            }
            Failure::Silent { server } => format!(
                "no response from {server} within {} ms",
                started.elapsed().as_millis()
            ),
            Failure::Network { server, reason } => format!("network error with {server}: {reason}"),
            Failure::Malformed { server, reason } => {
                format!("malformed response from {server}: {reason}")
            }
        };
        DiscoveryError::DnsLookup {
            name: name.to_owned(),
            record_type: record_type.to_string(),
            reason,
        }
    }
}

/// The mnemonic operators know from dig (hickory's Display gives prose such as "Server Failure").
fn rcode_name(code: ResponseCode) -> String {
    let name = match code {
        ResponseCode::NoError => "NOERROR",
        ResponseCode::FormErr => "FORMERR",
        ResponseCode::ServFail => "SERVFAIL",
        ResponseCode::NXDomain => "NXDOMAIN",
        ResponseCode::NotImp => "NOTIMP",
        ResponseCode::Refused => "REFUSED",
        ResponseCode::YXDomain => "YXDOMAIN",
        ResponseCode::YXRRSet => "YXRRSET",
        ResponseCode::NXRRSet => "NXRRSET",
        ResponseCode::NotAuth => "NOTAUTH",
        ResponseCode::NotZone => "NOTZONE",
        ResponseCode::BADVERS => "BADVERS",
        ResponseCode::BADCOOKIE => "BADCOOKIE",
        other => return format!("RCODE{}", u16::from(other)),
    };
    name.to_owned()
}

/// One query to one server: UDP until `try_until`, then TCP (until `deadline`) if truncated.
async fn exchange(
    server: SocketAddr,
    name: &Name,
    record_type: RecordType,
    try_until: Instant,
    deadline: Instant,
) -> Result<Message, Failure> {
    let id = fastrand::u16(..);
    let request = query_message(id, name, record_type)
        .to_vec()
        .map_err(|err| Failure::Malformed {
            server,
            reason: format!("cannot encode the query: {err}"),
        })?;
    let response = udp_exchange(server, &request, id, try_until).await?;
    let response = if response.truncated() {
        tcp_exchange(server, &request, id, deadline).await?
    } else {
        response
    };
    check_question(server, &response, name, record_type)?;
    Ok(response)
}

fn query_message(id: u16, name: &Name, record_type: RecordType) -> Message {
    let mut edns = Edns::new();
    edns.set_max_payload(EDNS_PAYLOAD);
    let mut message = Message::new();
    message
        .set_id(id)
        .set_message_type(MessageType::Query)
        .set_op_code(OpCode::Query)
        .set_recursion_desired(true)
        .add_query(Query::query(name.clone(), record_type))
        .set_edns(edns);
    message
}

async fn udp_exchange(
    server: SocketAddr,
    request: &[u8],
    id: u16,
    until: Instant,
) -> Result<Message, Failure> {
    let network = |err: std::io::Error| Failure::Network {
        server,
        reason: err.to_string(),
    };
    let local: SocketAddr = match server {
        SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let socket = UdpSocket::bind(local).await.map_err(network)?;
    // A connected socket only receives datagrams from the server itself.
    socket.connect(server).await.map_err(network)?;
    socket.send(request).await.map_err(network)?;
    let mut buffer = vec![0u8; usize::from(u16::MAX)];
    loop {
        let length = match timeout_at(until, socket.recv(&mut buffer)).await {
            Err(_elapsed) => return Err(Failure::Silent { server }),
            Ok(received) => received.map_err(network)?,
        };
        let response = Message::from_vec(&buffer[..length]).map_err(|err| Failure::Malformed {
            server,
            reason: err.to_string(),
        })?;
        // A late answer to an earlier try is not ours; keep waiting for the right one.
        if response.id() == id && response.message_type() == MessageType::Response {
            return Ok(response);
        }
    }
}

async fn tcp_exchange(
    server: SocketAddr,
    request: &[u8],
    id: u16,
    deadline: Instant,
) -> Result<Message, Failure> {
    let network = |err: std::io::Error| Failure::Network {
        server,
        reason: format!("over TCP: {err}"),
    };
    let length = u16::try_from(request.len()).map_err(|_| Failure::Malformed {
        server,
        reason: "query too long for TCP".to_owned(),
    })?;
    let mut framed = Vec::with_capacity(request.len() + 2);
    framed.extend_from_slice(&length.to_be_bytes());
    framed.extend_from_slice(request);
    let transfer = async {
        let mut stream = TcpStream::connect(server).await?;
        stream.write_all(&framed).await?;
        let length = stream.read_u16().await?;
        let mut buffer = vec![0u8; usize::from(length)];
        stream.read_exact(&mut buffer).await?;
        Ok::<_, std::io::Error>(buffer)
    };
    let buffer = timeout_at(deadline, transfer)
        .await
        .map_err(|_elapsed| Failure::Silent { server })?
        .map_err(network)?;
    let response = Message::from_vec(&buffer).map_err(|err| Failure::Malformed {
        server,
        reason: format!("over TCP: {err}"),
    })?;
    if response.id() != id {
        return Err(Failure::Malformed {
            server,
            reason: "TCP answer carries another query id".to_owned(),
        });
    }
    Ok(response)
}

/// A response must answer the question asked; anything else cannot be trusted as "the set".
fn check_question(
    server: SocketAddr,
    response: &Message,
    name: &Name,
    record_type: RecordType,
) -> Result<(), Failure> {
    // RFC 5452 §9.1: an answer matches its question by name, type and class.
    let asked = |query: &Query| {
        query.name() == name
            && query.query_type() == record_type
            && query.query_class() == DNSClass::IN
    };
    match response.query() {
        Some(query) if asked(query) => Ok(()),
        // Error responses (e.g. FORMERR) may omit the question; the code speaks for itself.
        // Not NXDOMAIN: it empties the source, so it must be an answer to this question.
        None if !matches!(
            response.response_code(),
            ResponseCode::NoError | ResponseCode::NXDomain
        ) =>
        {
            Ok(())
        }
        _ => Err(Failure::Malformed {
            server,
            reason: format!("the answer is not for {name} {record_type}"),
        }),
    }
}

/// Records of `record_type` owned by `name` or by a name its CNAME chain leads to.
fn answer_of(response: &Message, name: &Name, record_type: RecordType) -> Answer {
    let answers = response.answers();
    let mut chain = vec![name.clone()];
    let mut ttls = Vec::new();
    while chain.len() <= MAX_CNAME_HOPS {
        let current = &chain[chain.len() - 1];
        let next = answers.iter().find_map(|record| match record.data() {
            RData::CNAME(target) if record.name() == current && !chain.contains(&target.0) => {
                Some((target.0.clone(), record_ttl(record)))
            }
            _ => None,
        });
        let Some((target, ttl)) = next else { break };
        chain.push(target);
        ttls.push(ttl);
    }
    let records: Vec<Record> = answers
        .iter()
        .filter(|record| record.record_type() == record_type && chain.contains(record.name()))
        .cloned()
        .collect();
    if records.is_empty() {
        return Answer::default();
    }
    ttls.extend(records.iter().map(record_ttl));
    Answer {
        ttl: ttls.into_iter().min(),
        records,
    }
}

/// An in-process DNS server for tests: answers from a table, or with an error code, or not at all.
#[cfg(test)]
pub(crate) mod test_server {
    use std::collections::HashMap;
    use std::net::SocketAddr;
    use std::str::FromStr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    use hickory_proto::op::{Message, MessageType, ResponseCode};
    use hickory_proto::rr::rdata::{A, AAAA, CNAME, SRV};
    use hickory_proto::rr::{Name, RData, Record, RecordType};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, UdpSocket};
    use tokio::task::JoinHandle;

    #[derive(Debug, Clone)]
    pub(crate) enum Reply {
        Records(Vec<Record>),
        Code(ResponseCode),
        Silence,
        /// Truncated over UDP; the records come over TCP.
        Truncated(Vec<Record>),
    }

    type Table = Arc<Mutex<HashMap<(Name, RecordType), Reply>>>;

    pub(crate) struct TestDns {
        pub addr: SocketAddr,
        table: Table,
        udp_queries: Arc<AtomicUsize>,
        tcp_queries: Arc<AtomicUsize>,
        tasks: Vec<JoinHandle<()>>,
    }

    impl Drop for TestDns {
        fn drop(&mut self) {
            for task in &self.tasks {
                task.abort();
            }
        }
    }

    pub(crate) fn name(text: &str) -> Name {
        let mut name = Name::from_str(text).unwrap();
        name.set_fqdn(true);
        name
    }
    pub(crate) fn a(owner: &str, ttl: u32, ip: &str) -> Record {
        Record::from_rdata(name(owner), ttl, RData::A(A(ip.parse().unwrap())))
    }
    pub(crate) fn aaaa(owner: &str, ttl: u32, ip: &str) -> Record {
        Record::from_rdata(name(owner), ttl, RData::AAAA(AAAA(ip.parse().unwrap())))
    }
    pub(crate) fn cname(owner: &str, ttl: u32, target: &str) -> Record {
        Record::from_rdata(name(owner), ttl, RData::CNAME(CNAME(name(target))))
    }
    pub(crate) fn srv(
        owner: &str,
        ttl: u32,
        priority: u16,
        weight: u16,
        port: u16,
        target: &str,
    ) -> Record {
        let target = if target == "." {
            Name::root()
        } else {
            name(target)
        };
        Record::from_rdata(
            name(owner),
            ttl,
            RData::SRV(SRV::new(priority, weight, port, target)),
        )
    }

    impl TestDns {
        pub(crate) async fn start() -> TestDns {
            // UDP and TCP must share a port; retry in the rare case TCP's is taken.
            let (udp, tcp) = loop {
                let udp = UdpSocket::bind("127.0.0.1:0").await.unwrap();
                if let Ok(tcp) = TcpListener::bind(udp.local_addr().unwrap()).await {
                    break (udp, tcp);
                }
            };
            let addr = udp.local_addr().unwrap();
            let table: Table = Arc::default();
            let udp_queries = Arc::new(AtomicUsize::new(0));
            let tcp_queries = Arc::new(AtomicUsize::new(0));
            let tasks = vec![
                tokio::spawn(serve_udp(udp, table.clone(), udp_queries.clone())),
                tokio::spawn(serve_tcp(tcp, table.clone(), tcp_queries.clone())),
            ];
            TestDns {
                addr,
                table,
                udp_queries,
                tcp_queries,
                tasks,
            }
        }

        pub(crate) fn set(&self, owner: &str, record_type: RecordType, reply: Reply) {
            self.table
                .lock()
                .unwrap()
                .insert((name(owner), record_type), reply);
        }

        pub(crate) fn udp_queries(&self) -> usize {
            self.udp_queries.load(Ordering::SeqCst)
        }

        pub(crate) fn tcp_queries(&self) -> usize {
            self.tcp_queries.load(Ordering::SeqCst)
        }
    }

    /// The reply for a query, or None for silence. Unknown names are NXDOMAIN; known names
    /// without the asked type are NODATA, as an authoritative server answers.
    fn respond(table: &Table, query: &Message, over_tcp: bool) -> Option<Message> {
        let question = query.query()?.clone();
        let mut response = Message::new();
        response
            .set_id(query.id())
            .set_message_type(MessageType::Response)
            .set_op_code(query.op_code())
            .set_recursion_desired(query.recursion_desired())
            .set_recursion_available(true)
            .add_query(question.clone());
        let table = table.lock().unwrap();
        match table.get(&(question.name().clone(), question.query_type())) {
            Some(Reply::Silence) => return None,
            Some(Reply::Code(code)) => {
                response.set_response_code(*code);
            }
            Some(Reply::Records(records)) => {
                response.add_answers(records.iter().cloned());
            }
            Some(Reply::Truncated(records)) if over_tcp => {
                response.add_answers(records.iter().cloned());
            }
            Some(Reply::Truncated(_)) => {
                response.set_truncated(true);
            }
            None => {
                let known = table.keys().any(|(owner, _)| owner == question.name());
                if !known {
                    response.set_response_code(ResponseCode::NXDomain);
                }
            }
        }
        Some(response)
    }

    async fn serve_udp(socket: UdpSocket, table: Table, queries: Arc<AtomicUsize>) {
        let mut buffer = vec![0u8; 65_535];
        loop {
            let Ok((length, peer)) = socket.recv_from(&mut buffer).await else {
                continue;
            };
            queries.fetch_add(1, Ordering::SeqCst);
            let Ok(query) = Message::from_vec(&buffer[..length]) else {
                continue;
            };
            if let Some(response) = respond(&table, &query, false) {
                let _ = socket.send_to(&response.to_vec().unwrap(), peer).await;
            }
        }
    }

    async fn serve_tcp(listener: TcpListener, table: Table, queries: Arc<AtomicUsize>) {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                continue;
            };
            let table = table.clone();
            let queries = queries.clone();
            tokio::spawn(async move {
                let Ok(length) = stream.read_u16().await else {
                    return;
                };
                let mut buffer = vec![0u8; usize::from(length)];
                if stream.read_exact(&mut buffer).await.is_err() {
                    return;
                }
                queries.fetch_add(1, Ordering::SeqCst);
                let Ok(query) = Message::from_vec(&buffer) else {
                    return;
                };
                if let Some(response) = respond(&table, &query, true) {
                    let bytes = response.to_vec().unwrap();
                    let _ = stream.write_all(&(bytes.len() as u16).to_be_bytes()).await;
                    let _ = stream.write_all(&bytes).await;
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolv_conf_is_read_like_the_c_library() {
        let conf = SystemConf::parse(
            "# comment\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\nnameserver fd00::53 ; x\n\
             domain old.example\nsearch svc.cluster.local cluster.local.\noptions ndots:5 timeout:1\n",
        );
        assert_eq!(
            conf.servers,
            [
                "10.0.0.2:53".parse().unwrap(),
                "[fd00::53]:53".parse().unwrap()
            ]
        );
        assert_eq!(conf.search, ["svc.cluster.local", "cluster.local"]);
        assert_eq!(conf.ndots, 5);
        let names: Vec<String> = conf
            .candidates("api.ns")
            .unwrap()
            .iter()
            .map(Name::to_string)
            .collect();
        assert_eq!(
            names,
            [
                "api.ns.svc.cluster.local.",
                "api.ns.cluster.local.",
                "api.ns."
            ]
        );
        assert_eq!(conf.candidates("api.ns.").unwrap().len(), 1);
        assert_eq!(
            SystemConf::parse("").servers,
            ["127.0.0.1:53".parse().unwrap()]
        );
        let few_dots = SystemConf { ndots: 1, ..conf };
        assert_eq!(
            few_dots.candidates("api.ns").unwrap()[0].to_string(),
            "api.ns."
        );
    }

    #[test]
    fn rcode_names_are_the_dig_mnemonics() {
        assert_eq!(rcode_name(ResponseCode::ServFail), "SERVFAIL");
        assert_eq!(rcode_name(ResponseCode::NotImp), "NOTIMP");
        assert_eq!(rcode_name(ResponseCode::Unknown(3841)), "RCODE3841");
    }
}

#[cfg(test)]
mod proptests;
