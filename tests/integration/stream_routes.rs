//! L4 stream routes through real sockets (DESIGN.md §6): plain TCP with half-close, balancing
//! across connections, TLS passthrough chosen by SNI without terminating TLS, listeners bound and
//! retired at runtime, bind conflicts, connect failover, draining targets, and shutdown drain. A
//! gigabyte with flat memory is measured in `tests/memory/stream_routes.rs`, in its own process.

use crate::common;
use common::*;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

const DEADLINE: Duration = Duration::from_secs(10);
/// Bound on any single socket operation of a test, so a hang fails instead of blocking forever.
const IO_TIMEOUT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Upstreams
// ---------------------------------------------------------------------------------------------

/// A raw TCP upstream. Each connection echoes what it reads; when the client ends its writes it
/// appends `|eof:NAME` and closes, which proves it saw the half-close and could still reply.
struct EchoUpstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl EchoUpstream {
    async fn start(name: &str) -> EchoUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let counted = connections.clone();
        let trailer = format!("|eof:{name}");
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut stream, _)) = listener.accept().await else {
                    continue;
                };
                counted.fetch_add(1, Ordering::SeqCst);
                let trailer = trailer.clone();
                tokio::spawn(async move {
                    let mut buffer = vec![0u8; 16 * 1024];
                    loop {
                        match stream.read(&mut buffer).await {
                            Ok(0) => break,
                            Ok(n) => {
                                if stream.write_all(&buffer[..n]).await.is_err() {
                                    return;
                                }
                            }
                            Err(_) => return,
                        }
                    }
                    let _ = stream.write_all(trailer.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        EchoUpstream {
            addr,
            connections,
            task,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn target(&self) -> Value {
        json!({"host": "127.0.0.1", "port": self.addr.port()})
    }
}

impl Drop for EchoUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TLS upstream with its own certificate for `name`; after the handshake it sends its name and
/// then waits for the client to close.
struct TlsUpstream {
    addr: SocketAddr,
    certificate: CertificateDer<'static>,
    task: tokio::task::JoinHandle<()>,
}

/// A test CA and the leaf certificates it issues.
struct TestCa {
    issuer: rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
}

impl TestCa {
    fn new() -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "raahi stream test CA");
        let key = rcgen::KeyPair::generate().unwrap();
        TestCa {
            issuer: rcgen::CertifiedIssuer::self_signed(params, key).unwrap(),
        }
    }

    fn root(&self) -> CertificateDer<'static> {
        self.issuer.der().clone()
    }

    fn leaf(&self, name: &str) -> (CertificateDer<'static>, PrivateKeyDer<'static>) {
        let params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let certificate = params.signed_by(&key, &self.issuer).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
        (certificate.der().clone(), key)
    }
}

fn ring() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsUpstream {
    async fn start(ca: &TestCa, name: &str) -> TlsUpstream {
        let (certificate, key) = ca.leaf(name);
        let config = rustls::ServerConfig::builder_with_provider(ring())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![certificate.clone()], key)
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let greeting = name.as_bytes().to_vec();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let greeting = greeting.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(stream).await else {
                        return;
                    };
                    let _ = tls.write_all(&greeting).await;
                    let _ = tls.flush().await;
                    let mut rest = Vec::new();
                    let _ = tls.read_to_end(&mut rest).await;
                });
            }
        });
        TlsUpstream {
            addr,
            certificate,
            task,
        }
    }

    fn target(&self) -> Value {
        json!({"host": "127.0.0.1", "port": self.addr.port()})
    }
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// Waits until an exchange through `addr` reaches an upstream; returns its name.
async fn wait_for_echo(addr: SocketAddr) -> String {
    wait_until("the stream route answers", DEADLINE, || async {
        match exchange(addr, b"hi").await {
            Ok(answer) => upstream_name(&answer, b"hi")
                .ok_or_else(|| format!("{:?}", String::from_utf8_lossy(&answer))),
            Err(error) => Err(error.to_string()),
        }
    })
    .await
}

/// The upstream's name from an echo answer to `payload`, if the answer is complete.
fn upstream_name(answer: &[u8], payload: &[u8]) -> Option<String> {
    let rest = answer.strip_prefix(payload)?;
    let name = rest.strip_prefix(b"|eof:")?;
    Some(String::from_utf8_lossy(name).into_owned())
}

/// A round trip on an open connection: writes `line`, reads the same bytes back.
async fn round_trip(stream: &mut TcpStream, line: &[u8]) {
    stream.write_all(line).await.expect("write to the gateway");
    let mut echoed = vec![0u8; line.len()];
    tokio::time::timeout(IO_TIMEOUT, stream.read_exact(&mut echoed))
        .await
        .expect("echo in time")
        .expect("echo read");
    assert_eq!(echoed, line);
}

/// Ends the client's writes and reads the rest: the upstream's trailer.
async fn finish(mut stream: TcpStream) -> String {
    stream.shutdown().await.expect("half-close");
    let mut rest = Vec::new();
    tokio::time::timeout(IO_TIMEOUT, stream.read_to_end(&mut rest))
        .await
        .expect("trailer in time")
        .expect("trailer read");
    String::from_utf8_lossy(&rest).into_owned()
}

/// Whether a fresh connection to `addr` is refused (nothing listens).
async fn refused(addr: SocketAddr) -> bool {
    matches!(
        TcpStream::connect(addr).await,
        Err(error) if error.kind() == io::ErrorKind::ConnectionRefused
    )
}

fn tls_client(roots: &[CertificateDer<'static>]) -> tokio_rustls::TlsConnector {
    let mut store = rustls::RootCertStore::empty();
    for root in roots {
        store.add(root.clone()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(ring())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(store)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A TLS handshake through the gateway naming `sni`; returns the certificate the server showed
/// and the greeting it sent.
async fn tls_hello(
    connector: &tokio_rustls::TlsConnector,
    addr: SocketAddr,
    sni: &str,
) -> io::Result<(CertificateDer<'static>, String)> {
    let work = async {
        let tcp = TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from(sni.to_owned())
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error))?;
        let mut tls = connector.connect(name, tcp).await?;
        let certificate = tls
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first().cloned())
            .ok_or_else(|| io::Error::other("no peer certificate"))?;
        let mut greeting = vec![0u8; sni.len()];
        tls.read_exact(&mut greeting).await?;
        let _ = tls.shutdown().await;
        Ok((certificate, String::from_utf8_lossy(&greeting).into_owned()))
    };
    tokio::time::timeout(IO_TIMEOUT, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS exchange timed out"))?
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_echo_with_half_close() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("alpha").await;
    let service = stream_service(&gateway, "echo", "tcp", &[upstream.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;

    // The client ends its writes first; the upstream sees EOF, still replies, and the client
    // reads the whole reply.
    let payload = vec![b'x'; 300 * 1024];
    let answer = exchange(listen, &payload).await.expect("exchange");
    assert_eq!(answer.len(), payload.len() + "|eof:alpha".len());
    assert_eq!(upstream_name(&answer, &payload).as_deref(), Some("alpha"));

    // Interactive traffic on one connection, then the half-close.
    let mut stream = TcpStream::connect(listen).await.unwrap();
    round_trip(&mut stream, b"ping").await;
    round_trip(&mut stream, b"pong").await;
    assert_eq!(finish(stream).await, "|eof:alpha");
}

/// A tcp service's `limits.max_connections_per_target` holds its target to that many open
/// connections: one more waits for room in the queue and goes through when a connection ends;
/// past `max_pending_requests` a connection is closed at once, unforwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_tcp_target_queues_connections_then_refuses_them() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("narrow").await;
    let service = stream_service(&gateway, "narrow", "tcp", &[upstream.target()]).await;
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"limits": {
                "max_connections_per_target": 1,
                "max_pending_requests": 1,
                "queue_timeout_ms": 10000,
            }})),
        )
        .await;
    assert_eq!(status.as_u16(), 200, "{body}");
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;

    let mut first = TcpStream::connect(listen).await.unwrap();
    round_trip(&mut first, b"one").await;
    // The second waits in the queue: its bytes are not echoed while the first is open.
    let mut second = TcpStream::connect(listen).await.unwrap();
    second.write_all(b"two").await.unwrap();
    wait_until("the second connection to queue", DEADLINE, || async {
        gateway
            .metrics_text()
            .await
            .contains("raahi_service_queued_requests{service=\"narrow\"} 1")
    })
    .await;
    // A third finds the queue full: closed without reaching the target.
    let third = exchange(listen, b"three").await.unwrap_or_default();
    assert!(third.is_empty(), "{:?}", String::from_utf8_lossy(&third));
    let connections_before = upstream.connections.load(Ordering::SeqCst);
    // The first ends; the queued second goes through.
    assert_eq!(finish(first).await, "|eof:narrow");
    let mut echoed = [0u8; 3];
    tokio::time::timeout(IO_TIMEOUT, second.read_exact(&mut echoed))
        .await
        .expect("the queued connection is served")
        .unwrap();
    assert_eq!(&echoed, b"two");
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        connections_before + 1
    );
    assert!(gateway
        .metrics_text()
        .await
        .contains("raahi_service_overloaded_requests_total{service=\"narrow\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_over_two_tcp_upstreams_across_connections() {
    let gateway = TestGateway::start().await;
    let a = EchoUpstream::start("a").await;
    let b = EchoUpstream::start("b").await;
    let service = stream_service(&gateway, "pair", "tcp", &[a.target(), b.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;

    let mut counts = std::collections::HashMap::<String, usize>::new();
    for _ in 0..20 {
        let answer = exchange(listen, b"q").await.expect("exchange");
        let name = upstream_name(&answer, b"q").expect("an echo answer");
        *counts.entry(name).or_default() += 1;
    }
    assert_eq!(counts.get("a"), Some(&10), "{counts:?}");
    assert_eq!(counts.get("b"), Some(&10), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_passthrough_picks_the_upstream_by_sni() {
    let gateway = TestGateway::start().await;
    let ca = TestCa::new();
    let a = TlsUpstream::start(&ca, "a.test").await;
    let b = TlsUpstream::start(&ca, "b.test").await;
    let service_a = stream_service(&gateway, "tls-a", "tls", &[a.target()]).await;
    let service_b = stream_service(&gateway, "tls-b", "tls", &[b.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, Some("a.test"), service_a).await;
    stream_route(&gateway, listen, Some("b.test"), service_b).await;
    let client = tls_client(&[ca.root()]);

    let answer = std::sync::Mutex::new(None);
    wait_until("TLS passthrough answers", DEADLINE, || async {
        let reached = tls_hello(&client, listen, "a.test").await.ok();
        let done = reached.is_some();
        *answer.lock().unwrap() = reached;
        done
    })
    .await;
    // The certificate is the upstream's own: the gateway did not terminate TLS.
    let (certificate, greeting) = answer.lock().unwrap().take().unwrap();
    assert_eq!(certificate, a.certificate);
    assert_eq!(greeting, "a.test");

    let (certificate, greeting) = tls_hello(&client, listen, "b.test").await.expect("b.test");
    assert_eq!(certificate, b.certificate);
    assert_eq!(greeting, "b.test");
    assert_ne!(a.certificate, b.certificate);

    // No route for this name and no route without SNI: the gateway closes the connection.
    let unmatched = tls_hello(&client, listen, "c.test").await;
    assert!(unmatched.is_err(), "c.test must not be answered");
    // Closed by the gateway as unmatched, not sent to an upstream that refused the name.
    wait_until("c.test is counted as unmatched", DEADLINE, || async {
        metric(
            &gateway.metrics_text().await,
            "raahi_stream_unmatched_connections_total",
            &[],
        )
        .unwrap_or(0.0)
            >= 1.0
    })
    .await;
    // A client that does not speak TLS at all is closed too, without an answer.
    let garbage = exchange(listen, b"GET / HTTP/1.1\r\nHost: a.test\r\n\r\n").await;
    assert!(
        matches!(&garbage, Ok(answer) if answer.is_empty()) || garbage.is_err(),
        "{garbage:?}"
    );
    // And the listener still serves matching names afterwards.
    let (certificate, _) = tls_hello(&client, listen, "b.test").await.expect("b.test");
    assert_eq!(certificate, b.certificate);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_without_sni_takes_the_other_tls_names() {
    let gateway = TestGateway::start().await;
    let ca = TestCa::new();
    let named = TlsUpstream::start(&ca, "a.test").await;
    let rest = TlsUpstream::start(&ca, "other.test").await;
    let service_named = stream_service(&gateway, "named", "tls", &[named.target()]).await;
    let service_rest = stream_service(&gateway, "rest", "tls", &[rest.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, Some("a.test"), service_named).await;
    stream_route(&gateway, listen, None, service_rest).await;
    let client = tls_client(&[ca.root()]);

    wait_until("TLS passthrough answers", DEADLINE, || async {
        tls_hello(&client, listen, "a.test").await.is_ok()
    })
    .await;
    let (certificate, greeting) = tls_hello(&client, listen, "other.test")
        .await
        .expect("the route without SNI takes other.test");
    assert_eq!(certificate, rest.certificate);
    assert_eq!(greeting, "other.test");
}

/// A ClientHello handshake message naming `name`, padded to about `padding` more bytes (RFC
/// 8446 §4.1.2, RFC 6066 §3, padding extension RFC 7685), built by hand so its records can be
/// cut at will.
fn crafted_client_hello(name: &str, padding: usize) -> Vec<u8> {
    let block16 = |data: &[u8]| {
        let mut out = u16::try_from(data.len()).unwrap().to_be_bytes().to_vec();
        out.extend_from_slice(data);
        out
    };
    let mut entry = vec![0u8];
    entry.extend(block16(name.as_bytes()));
    let mut extensions = vec![0, 0];
    extensions.extend(block16(&block16(&entry)));
    extensions.extend([0, 0x15]);
    extensions.extend(block16(&vec![0; padding]));
    let mut body = vec![3, 3];
    body.extend([7; 32]);
    body.push(0);
    body.extend(block16(&[0x13, 0x01]));
    body.extend([1, 0]);
    body.extend(block16(&extensions));
    let mut message = vec![1];
    message.extend(&u32::try_from(body.len()).unwrap().to_be_bytes()[1..]);
    message.extend(body);
    message
}

/// `message` as exactly `count` handshake records of nearly equal size.
fn in_records(message: &[u8], count: usize) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut start = 0;
    for at in 1..=count {
        let end = message.len() * at / count;
        wire.extend([22, 3, 1]);
        wire.extend(u16::try_from(end - start).unwrap().to_be_bytes());
        wire.extend(&message[start..end]);
        start = end;
    }
    wire
}

/// Sends `bytes` in writes of at most `piece` bytes, ends the writes, reads until closed.
async fn exchange_in_pieces(addr: SocketAddr, bytes: &[u8], piece: usize) -> io::Result<Vec<u8>> {
    let work = async {
        let mut stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        for chunk in bytes.chunks(piece) {
            stream.write_all(chunk).await?;
            stream.flush().await?;
        }
        stream.shutdown().await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok(answer)
    };
    tokio::time::timeout(IO_TIMEOUT, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "exchange timed out"))?
}

/// A passthrough listener decides on a ClientHello from its bytes, not from how they came
/// (issue 31): a hello within the bounds (≤ 16 KiB in ≤ 32 records) is routed even when
/// records of early data follow it in the same flight, and one split into more records is
/// refused even when it arrives in a single read. The echo upstream sends back what reached it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_hello_is_judged_the_same_however_its_records_and_reads_fall() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("tls-echo").await;
    let service = stream_service(&gateway, "split-hello", "tls", &[upstream.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, Some("split.test"), service).await;
    let simple = in_records(&crafted_client_hello("split.test", 0), 1);
    wait_until("the passthrough route answers", DEADLINE, || async {
        exchange(listen, &simple)
            .await
            .is_ok_and(|answer| upstream_name(&answer, &simple).is_some())
    })
    .await;

    // 6 KiB in 30 records, then 5 records of early data: more than the gateway's 4 KiB read,
    // so it comes in at least two reads, the second completing the hello and the early data.
    let mut routed = in_records(&crafted_client_hello("split.test", 6000), 30);
    for _ in 0..5 {
        routed.extend([23, 3, 3, 0, 100]);
        routed.extend([0xee; 100]);
    }
    let answer = exchange(listen, &routed).await.expect("one write");
    assert_eq!(
        upstream_name(&answer, &routed).as_deref(),
        Some("tls-echo"),
        "in one write: {} bytes back",
        answer.len()
    );
    let answer = exchange_in_pieces(listen, &routed, 97)
        .await
        .expect("in pieces");
    assert_eq!(
        upstream_name(&answer, &routed).as_deref(),
        Some("tls-echo"),
        "in pieces: {} bytes back",
        answer.len()
    );

    // 40 records: refused, in one small write (read at once) as in pieces.
    let refused_hello = in_records(&crafted_client_hello("split.test", 100), 40);
    for piece in [refused_hello.len(), 7] {
        let answer = exchange_in_pieces(listen, &refused_hello, piece).await;
        assert!(
            matches!(&answer, Ok(bytes) if bytes.is_empty()) || answer.is_err(),
            "writes of {piece} bytes: {answer:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creating_binds_and_deleting_stops_accepting_while_open_connections_continue() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("live").await;
    let service = stream_service(&gateway, "live", "tcp", &[upstream.target()]).await;
    let listen = free_addr();
    assert!(refused(listen).await, "nothing listens before the route");

    let route = stream_route(&gateway, listen, None, service).await;
    assert_eq!(wait_for_echo(listen).await, "live");

    let mut open = TcpStream::connect(listen).await.unwrap();
    round_trip(&mut open, b"before").await;

    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/stream-routes/{route}"), None)
        .await;
    assert_eq!(status, 204, "{body}");
    wait_until("the listener stops accepting", DEADLINE, || refused(listen)).await;

    // The connection accepted before the deletion keeps working to its end.
    round_trip(&mut open, b"after").await;
    assert_eq!(finish(open).await, "|eof:live");

    // Creating it again binds the same address again.
    stream_route(&gateway, listen, None, service).await;
    assert_eq!(wait_for_echo(listen).await, "live");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bind_failure_is_a_conflict_naming_the_address() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("x").await;
    let service = stream_service(&gateway, "x", "tcp", &[upstream.target()]).await;
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = held.local_addr().unwrap();

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/stream-routes",
            Some(json!({"listen": listen.to_string(), "service_id": service})),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("listen"),
        "{body}"
    );
    let message = ApiError::read(&body).message;
    assert!(message.contains(&listen.to_string()), "{body}");

    // Nothing was kept: the list is empty and, once the address is free, the route can be made.
    let (status, list) = gateway.api("GET", "/api/v1/stream-routes", None).await;
    assert_eq!(status, 200);
    assert_eq!(list["items"].as_array().map(Vec::len), Some(0), "{list}");
    drop(held);
    stream_route(&gateway, listen, None, service).await;
    assert_eq!(wait_for_echo(listen).await, "x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_failure_falls_over_to_another_target() {
    let gateway = TestGateway::start().await;
    let live = EchoUpstream::start("live").await;
    let dead = free_addr();
    let service = stream_service(&gateway, "failover", "tcp", &[]).await;
    let targets = format!("/api/v1/services/{service}/targets");
    // The dead target is heavier, so most first picks go to it and must fail over.
    let dead_target = gateway
        .create(
            &targets,
            json!({"host": "127.0.0.1", "port": dead.port(), "weight": 300}),
        )
        .await;
    gateway
        .create(
            &targets,
            json!({"host": "127.0.0.1", "port": live.addr.port(), "weight": 100}),
        )
        .await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;
    for round in 0..12 {
        let answer = exchange(listen, b"f").await.expect("exchange");
        assert_eq!(
            upstream_name(&answer, b"f").as_deref(),
            Some("live"),
            "connection {round} must reach the live target"
        );
    }
    assert!(live.connections() >= 13);
    // The connect failures count as passive failures, as for HTTP: the dead target is ejected
    // (default policy: 5 failures within 30 s).
    let (status, dead_state) = gateway
        .api("GET", &format!("/api/v1/targets/{dead_target}"), None)
        .await;
    assert_eq!(status, 200);
    assert!(
        !dead_state["ejected_until"].is_null(),
        "the dead target is ejected: {dead_state}"
    );
}

/// A stream target's entry in its service's runtime view.
async fn runtime_entry(gateway: &TestGateway, service: i64, target: i64) -> Value {
    let (status, view) = gateway
        .api("GET", &format!("/api/v1/services/{service}/runtime"), None)
        .await;
    assert_eq!(status, 200, "{view}");
    view["targets"]
        .as_array()
        .and_then(|targets| targets.iter().find(|entry| entry["id"] == target))
        .cloned()
        .unwrap_or_else(|| panic!("target {target} not in the runtime view: {view}"))
}

/// For a stream a connection that connects is the verdict: when an ejection ends, the one trial
/// connection restores the target once it connects (DESIGN.md §5, half-open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trial_connection_that_connects_restores_an_ejected_target() {
    let gateway = TestGateway::start().await;
    let live = EchoUpstream::start("live").await;
    let away = free_addr();
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "comeback", "protocol": "tcp", "timeouts": {"connect_ms": 2000},
                   "ejection": {"failures": 1, "base_ejection_ms": 300}}),
        )
        .await;
    let targets = format!("/api/v1/services/{service}/targets");
    let away_target = gateway
        .create(
            &targets,
            json!({"host": "127.0.0.1", "port": away.port(), "weight": 300}),
        )
        .await;
    gateway
        .create(
            &targets,
            json!({"host": "127.0.0.1", "port": live.addr.port(), "weight": 100}),
        )
        .await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_until(
        "its refused connect ejects the target",
        DEADLINE,
        || async {
            let _ = exchange(listen, b"e").await;
            !runtime_entry(&gateway, service, away_target).await["ejected_until"].is_null()
        },
    )
    .await;

    // It comes back on its address; once the ejection has ended it is half-open.
    let back = TcpListener::bind(away).await.unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    let accepting = tokio::spawn(async move {
        while let Ok((stream, _)) = back.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
            drop(stream);
        }
    });
    wait_until("the ejection ends", DEADLINE, || async {
        runtime_entry(&gateway, service, away_target).await["half_open"] == true
    })
    .await;
    assert_eq!(accepted.load(Ordering::SeqCst), 0);
    wait_until("a trial connection reaches it", DEADLINE, || async {
        let _ = exchange(listen, b"t").await;
        accepted.load(Ordering::SeqCst) > 0
    })
    .await;
    let entry = runtime_entry(&gateway, service, away_target).await;
    assert_eq!(entry["half_open"], false, "restored: {entry}");
    assert_eq!(entry["ejections"], 0, "{entry}");
    assert_eq!(entry["available"], true, "{entry}");
    accepting.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draining_target_keeps_its_open_connection() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("old").await;
    let service = stream_service(&gateway, "drain", "tcp", &[upstream.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;

    let mut open = TcpStream::connect(listen).await.unwrap();
    round_trip(&mut open, b"one").await;

    let (status, targets) = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await;
    assert_eq!(status, 200);
    let target = targets["items"][0]["id"].as_i64().expect("a target id");
    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/targets/{target}"), None)
        .await;
    assert_eq!(status, 204, "{body}");

    // New connections no longer reach it...
    wait_until("new connections are no longer served", DEADLINE, || async {
        let answer = exchange(listen, b"n").await.unwrap_or_default();
        upstream_name(&answer, b"n").is_none()
    })
    .await;
    // ...while the open one keeps going until it ends.
    round_trip(&mut open, b"two").await;
    assert_eq!(finish(open).await, "|eof:old");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_stops_accepting_and_waits_for_open_connections() {
    let mut gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("up").await;
    let service = stream_service(&gateway, "up", "tcp", &[upstream.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;

    let mut open = TcpStream::connect(listen).await.unwrap();
    round_trip(&mut open, b"a").await;
    let running = gateway.gateway.take().expect("a running gateway");
    let shutdown = tokio::spawn(running.shutdown());

    wait_until("the stream listener closes", DEADLINE, || refused(listen)).await;
    assert!(
        !shutdown.is_finished(),
        "shutdown waits for the open stream"
    );
    round_trip(&mut open, b"b").await;
    assert_eq!(finish(open).await, "|eof:up");
    tokio::time::timeout(DEADLINE, shutdown)
        .await
        .expect("shutdown ends once the stream has closed")
        .unwrap();
}

/// The value of the first series named `name` whose labels include every one of `labels`.
fn metric(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .find(|line| labels.iter().all(|label| line.contains(label)))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|number| number.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_stream_connections_bytes_and_unmatched() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("m").await;
    let service_id = stream_service(&gateway, "metered", "tcp", &[upstream.target()]).await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service_id).await;
    wait_for_echo(listen).await;

    let listen_label = format!("listen=\"{listen}\"");
    let series = |metrics: &str, name: &str, direction: Option<&str>| {
        let mut labels = vec![listen_label.as_str()];
        let direction = direction.map(|direction| format!("direction=\"{direction}\""));
        if let Some(direction) = &direction {
            labels.push(direction);
        }
        metric(metrics, name, &labels).unwrap_or(0.0)
    };
    // Wait for the warm-up connection's close to be counted before taking the baseline.
    wait_until("no stream connection is open", DEADLINE, || async {
        series(
            &gateway.metrics_text().await,
            "raahi_stream_active_connections",
            None,
        ) == 0.0
    })
    .await;
    let before = gateway.metrics_text().await;
    for _ in 0..3 {
        let answer = exchange(listen, b"abc").await.expect("exchange");
        assert_eq!(upstream_name(&answer, b"abc").as_deref(), Some("m"));
    }
    let reply_len = ("abc".len() + "|eof:m".len()) as f64;
    let expected = [
        ("raahi_stream_connections_total", None, 3.0),
        (
            "raahi_stream_sent_bytes_total",
            Some("client_to_upstream"),
            9.0,
        ),
        (
            "raahi_stream_sent_bytes_total",
            Some("upstream_to_client"),
            3.0 * reply_len,
        ),
    ];
    wait_until("the three connections are counted", DEADLINE, || async {
        let now = gateway.metrics_text().await;
        expected.iter().all(|(name, direction, delta)| {
            series(&now, name, *direction) - series(&before, name, *direction) == *delta
        })
    })
    .await;

    // A passthrough listener closes a client that sends no ClientHello, and counts it.
    let passthrough = free_addr();
    stream_route(&gateway, passthrough, Some("only.test"), {
        stream_service(&gateway, "tls-only", "tls", &[upstream.target()]).await
    })
    .await;
    let unmatched_before = metric(
        &gateway.metrics_text().await,
        "raahi_stream_unmatched_connections_total",
        &[],
    )
    .unwrap_or(0.0);
    wait_until(
        "a non-TLS client is counted as unmatched",
        DEADLINE,
        || async {
            let _ = exchange(passthrough, b"not tls at all").await;
            metric(
                &gateway.metrics_text().await,
                "raahi_stream_unmatched_connections_total",
                &[],
            )
            .unwrap_or(0.0)
                > unmatched_before
        },
    )
    .await;

    // A connection that stays open shows its bytes while it lasts, not only when it closes.
    let counted = series(
        &gateway.metrics_text().await,
        "raahi_stream_sent_bytes_total",
        Some("client_to_upstream"),
    );
    let mut open = TcpStream::connect(listen).await.expect("connect");
    round_trip(&mut open, b"still open\n").await;
    wait_until(
        "an open connection's bytes are counted",
        DEADLINE,
        || async {
            let now = gateway.metrics_text().await;
            series(&now, "raahi_stream_active_connections", None) == 1.0
                && series(
                    &now,
                    "raahi_stream_sent_bytes_total",
                    Some("client_to_upstream"),
                ) >= counted + "still open\n".len() as f64
        },
    )
    .await;
    drop(open);
}

/// One access-log line per stream connection, with what an operator filters on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_has_one_line_per_stream_connection() {
    let upstream = EchoUpstream::start("logged").await;
    let mut process = common::process::RaahiProcess::serve(&[
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN),
        ("RAAHI_LOG_FORMAT", "json"),
    ])
    .await;
    let service = process
        .create(
            "/api/v1/services",
            json!({"name": "logged", "protocol": "tcp"}),
        )
        .await["id"]
        .as_i64()
        .unwrap();
    process
        .create(
            &format!("/api/v1/services/{service}/targets"),
            upstream.target(),
        )
        .await;
    let listen = free_addr();
    let route = process
        .create(
            "/api/v1/stream-routes",
            json!({"listen": listen.to_string(), "service_id": service}),
        )
        .await["id"]
        .as_i64()
        .unwrap();
    let payload = b"twelve bytes";
    wait_until("the stream route answers", DEADLINE, || async {
        let answer = exchange(listen, payload).await.unwrap_or_default();
        upstream_name(&answer, payload).is_some()
    })
    .await;

    let line = process
        .stderr_line(|line| {
            line.contains("raahi::access") && line.contains("\"outcome\":\"closed\"")
        })
        .await;
    let entry: Value = serde_json::from_str(&line).expect("a JSON line");
    let fields = &entry["fields"];
    assert_eq!(fields["kind"], "stream", "{line}");
    assert_eq!(fields["listen"], listen.to_string(), "{line}");
    assert_eq!(fields["route"], route, "{line}");
    assert_eq!(fields["service"], "logged", "{line}");
    assert_eq!(fields["target"], upstream.addr.to_string(), "{line}");
    assert_eq!(fields["bytes_client_to_upstream"], 12, "{line}");
    assert_eq!(
        fields["bytes_upstream_to_client"],
        12 + "|eof:logged".len(),
        "{line}"
    );
    assert!(fields["client"]
        .as_str()
        .unwrap_or_default()
        .starts_with("127.0.0.1:"));
    assert!(fields["duration_ms"].as_f64().is_some(), "{line}");
}

/// No byte either way for the service's `timeouts.idle_ms` closes the connection; traffic keeps
/// it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_stream_is_closed_after_the_idle_timeout() {
    let gateway = TestGateway::start().await;
    let upstream = EchoUpstream::start("quiet").await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": "quiet", "protocol": "tcp", "timeouts": {"idle_ms": 400}}),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            upstream.target(),
        )
        .await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    wait_for_echo(listen).await;

    let mut stream = TcpStream::connect(listen).await.unwrap();
    let opened = tokio::time::Instant::now();
    // Traffic every 100 ms for over twice the idle timeout keeps the connection open.
    let mut last_traffic = opened;
    while opened.elapsed() < Duration::from_millis(1000) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        round_trip(&mut stream, b"keepalive").await;
        last_traffic = tokio::time::Instant::now();
    }
    // Then silence: the gateway closes it, without the upstream's trailer (no half-close
    // reached the upstream; the connection was dropped).
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(IO_TIMEOUT, stream.read_to_end(&mut rest))
        .await
        .expect("the idle connection is closed");
    assert!(rest.is_empty(), "{rest:?}");
    // Some slack: the gateway saw the last byte slightly before the client read it.
    assert!(last_traffic.elapsed() >= Duration::from_millis(300));
}

/// A target that discovery stops listing turns draining: new connections go to the endpoint
/// that replaced it while the connection already open keeps its target until it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_drained_by_discovery_keeps_its_open_connection() {
    let gateway = TestGateway::start().await;
    let old = EchoUpstream::start("old").await;
    let new = EchoUpstream::start("new").await;
    let registry = common::registry::Registry::start().await;
    let endpoint = |upstream: &EchoUpstream, key: &str| json!({"host": upstream.addr.ip().to_string(), "port": upstream.addr.port(), "key": key});
    registry.set_json(json!([endpoint(&old, "old")]));
    let service = stream_service(&gateway, "discovered", "tcp", &[]).await;
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({
                "name": "registry",
                "provider": "http",
                "config": {"url": registry.url("/endpoints"), "interval_ms": 600000},
                "removal_grace_ms": 600000
            }),
        )
        .await;
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    assert_eq!(wait_for_echo(listen).await, "old");

    let mut open = TcpStream::connect(listen).await.unwrap();
    round_trip(&mut open, b"one").await;

    registry.set_json(json!([endpoint(&new, "new")]));
    let (status, body) = gateway
        .api(
            "POST",
            &format!("/api/v1/discovery-sources/{source}/refresh"),
            None,
        )
        .await;
    assert_eq!(status, 202, "{body}");
    wait_until(
        "new connections reach the new endpoint",
        DEADLINE,
        || async {
            let answer = exchange(listen, b"n").await.unwrap_or_default();
            upstream_name(&answer, b"n").as_deref() == Some("new")
        },
    )
    .await;
    let (_, targets) = gateway
        .api("GET", &format!("/api/v1/services/{service}/targets"), None)
        .await;
    let old_state = targets["items"]
        .as_array()
        .expect("targets")
        .iter()
        .find(|target| target["provider_key"] == "old")
        .map(|target| target["state"].clone());
    assert_eq!(old_state, Some(json!("draining")), "{targets}");

    round_trip(&mut open, b"two").await;
    assert_eq!(finish(open).await, "|eof:old");
}

/// Connections share their service's retry budget (TRAFFIC.md §5): with every target down, a
/// connection's connect retries stop once the window's retries reach 20 % of its connections
/// plus the floor of 10 a second, where three attempts each would triple the connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_retries_of_a_service_that_is_down_stay_within_the_budget() {
    let gateway = TestGateway::start().await;
    let dead: Vec<Value> = (0..3)
        .map(|_| json!({"host": "127.0.0.1", "port": free_addr().port()}))
        .collect();
    let service = stream_service(&gateway, "down", "tcp", &dead).await;
    // Ejection off: every target stays in rotation, so only the budget can stop the retries.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{service}"),
            Some(json!({"ejection": false})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let listen = free_addr();
    stream_route(&gateway, listen, None, service).await;
    // A whole exchange, so the probe's own attempts are over before the baseline is read.
    wait_until("the stream route listens", DEADLINE, || async {
        !matches!(
            exchange(listen, b"x").await,
            Err(error) if error.kind() == io::ErrorKind::ConnectionRefused
        )
    })
    .await;
    let before = gateway.metrics_text().await;
    let errors = |metrics: &str| {
        metric(
            metrics,
            "raahi_upstream_connect_errors_total",
            &["service=\"down\""],
        )
        .unwrap_or(0.0)
    };
    let started = std::time::Instant::now();
    const CONNECTIONS: u32 = 150;
    for _ in 0..CONNECTIONS {
        // The gateway closes each connection once its attempts are spent.
        let _ = exchange(listen, b"x").await;
    }
    let windows = started.elapsed().as_secs() / 10 + 1;
    let metrics = gateway.metrics_text().await;
    let connects = errors(&metrics) - errors(&before);
    let retried = |metrics: &str| {
        metric(
            metrics,
            "raahi_retries_total",
            &["service=\"down\"", "reason=\"connect_failure\""],
        )
        .unwrap_or(0.0)
    };
    let retries = retried(&metrics) - retried(&before);
    let n = f64::from(CONNECTIONS);
    assert!(
        connects >= n + 100.0,
        "the floor's retries were sent: {connects} connects for {n} connections"
    );
    assert!(
        connects <= n + 0.2 * n + 100.0 * windows as f64,
        "{connects} connects for {n} connections: past the budget (three attempts each: {})",
        3.0 * n
    );
    assert_eq!(retries, connects - n, "each retry is counted:\n{metrics}");
    let exhausted = metric(
        &metrics,
        "raahi_retry_budget_exhausted_total",
        &["service=\"down\""],
    )
    .unwrap_or(0.0);
    assert!(exhausted >= 1.0, "refusals are counted:\n{metrics}");
}
