//! Health checks speak the service's protocol (issue 19): an `https` service's HTTP checks go over
//! TLS with the server name, verification and CA its traffic uses; `tls` handshake checks for
//! `https` and `tls` services; and where a `tls` check is refused. Real sockets throughout.

use crate::common;
use common::*;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;

const H2_AND_H1: &[&[u8]] = &[b"h2", b"http/1.1"];

/// A self-signed certificate for `names`; its PEM is also the CA a service trusts for it.
struct Cert {
    cert_pem: String,
    key_pem: String,
}

impl Cert {
    /// Every such certificate has the same subject, so one of them, trusted as a CA, looks like
    /// the issuer of another to a verifier, which then finds the signature wrong.
    fn new(names: &[&str]) -> Cert {
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names).expect("certificate params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "raahi health test");
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = params.self_signed(&key).expect("a certificate");
        Cert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    /// A server config with this certificate, choosing among `alpn` by the client's offer.
    fn acceptor(&self, alpn: &[&[u8]]) -> TlsAcceptor {
        let chain = vec![CertificateDer::from_pem_slice(self.cert_pem.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
        TlsAcceptor::from(Arc::new(config))
    }
}

/// What an origin speaks on its one port.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Speaks {
    /// TLS only: a plaintext request gets a failed handshake.
    Tls,
    /// TLS, or plain HTTP when the first byte is not a TLS handshake record: a target that
    /// passes a plaintext check and still serves TLS traffic.
    TlsOrPlain,
}

/// One request an origin answered.
#[derive(Debug, Clone)]
struct Seen {
    path: String,
    host: Option<String>,
    /// The server name of its connection; None over plain HTTP or without SNI.
    sni: Option<String>,
    tls: bool,
    version: hyper::Version,
}

/// An HTTP origin (HTTP/1.1 and HTTP/2 over TLS by ALPN) on 127.0.0.1:0 that answers 200 with
/// its name and records every request and the server name of every completed handshake.
struct Origin {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    handshakes: Arc<Mutex<Vec<Option<String>>>>,
    task: JoinHandle<()>,
}

impl Origin {
    async fn start(name: &str, acceptor: TlsAcceptor, speaks: Speaks) -> Origin {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handshakes = Arc::new(Mutex::new(Vec::new()));
        let name = Arc::new(name.to_owned());
        let (recorded, shaken) = (seen.clone(), handshakes.clone());
        let task = tokio::spawn(async move {
            // Dropped with the task: aborting it closes every open connection too.
            let mut connections = JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let connection = Connection {
                    name: name.clone(),
                    seen: recorded.clone(),
                    handshakes: shaken.clone(),
                };
                connections.spawn(connection.serve(tcp, acceptor.clone(), speaks));
                while connections.try_join_next().is_some() {}
            }
        });
        Origin {
            addr,
            seen,
            handshakes,
            task,
        }
    }

    /// Health check requests (`/health`).
    fn checks(&self) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|request| request.path == "/health")
            .cloned()
            .collect()
    }

    /// Requests other than health checks.
    fn traffic(&self) -> Vec<Seen> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|request| request.path != "/health")
            .cloned()
            .collect()
    }

    fn handshake_snis(&self) -> Vec<Option<String>> {
        self.handshakes.lock().unwrap().clone()
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Connection {
    name: Arc<String>,
    seen: Arc<Mutex<Vec<Seen>>>,
    handshakes: Arc<Mutex<Vec<Option<String>>>>,
}

impl Connection {
    async fn serve(self, tcp: TcpStream, acceptor: TlsAcceptor, speaks: Speaks) {
        let mut first = [0u8; 1];
        let is_tls = matches!(tcp.peek(&mut first).await, Ok(1) if first[0] == 0x16);
        if speaks == Speaks::TlsOrPlain && !is_tls {
            self.answer(TokioIo::new(tcp), None, false).await;
            return;
        }
        let Ok(stream) = acceptor.accept(tcp).await else {
            return;
        };
        let sni = stream.get_ref().1.server_name().map(str::to_owned);
        self.handshakes.lock().unwrap().push(sni.clone());
        self.answer(TokioIo::new(stream), sni, true).await;
    }

    async fn answer<IO>(self, io: TokioIo<IO>, sni: Option<String>, tls: bool)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let service = service_fn(move |request: Request<Incoming>| {
            self.seen.lock().unwrap().push(Seen {
                path: request.uri().path().to_owned(),
                host: request
                    .headers()
                    .get(hyper::header::HOST)
                    .and_then(|host| host.to_str().ok())
                    .or_else(|| request.uri().authority().map(|a| a.as_str()))
                    .map(str::to_owned),
                sni: sni.clone(),
                tls,
                version: request.version(),
            });
            let body = Bytes::from(self.name.as_str().to_owned());
            async move { Ok::<_, Infallible>(Response::new(Full::new(body))) }
        });
        let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
            .serve_connection(io, service)
            .await;
    }
}

/// A check every 100 ms whose every result counts at once.
fn fast_check(kind: &str) -> Value {
    json!({
        "type": kind, "path": "/health", "interval_ms": 100, "timeout_ms": 2000,
        "healthy_threshold": 1, "unhealthy_threshold": 1
    })
}

/// A service `name` with `fields`, and for an HTTP service a route for `/{name}`.
async fn create_service(gateway: &TestGateway, name: &str, fields: Value) -> i64 {
    let mut body = json!({ "name": name });
    for (key, value) in fields.as_object().expect("fields object") {
        body[key] = value.clone();
    }
    let service = gateway.create("/api/v1/services", body.clone()).await;
    if body["protocol"] == "tls" {
        return service;
    }
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": name, "path_prefix": format!("/{name}"), "service_id": service }),
        )
        .await;
    service
}

async fn add_target(gateway: &TestGateway, service: i64, addr: SocketAddr, priority: i32) -> i64 {
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({ "host": addr.ip().to_string(), "port": addr.port(), "priority": priority }),
        )
        .await
}

async fn patch_service(gateway: &TestGateway, service: i64, patch: Value) {
    let (status, body) = gateway
        .api("PATCH", &format!("/api/v1/services/{service}"), Some(patch))
        .await;
    assert_eq!(status, 200, "PATCH service {service}: {body}");
}

fn health(view: &Target) -> &str {
    view.health.as_str()
}

/// Whether the target's last check passed; `None` before its first check.
fn passed(view: &Target) -> Option<bool> {
    view.last_check.as_ref().map(|check| check.passed)
}

/// `health` is `wanted` and the stored `last_check` agrees with it. (Health is live, set as each
/// check ends; `last_check` is stored when the round ends, so for a moment it lags behind.)
fn settled(view: &Target, wanted: &str) -> bool {
    health(view) == wanted && passed(view) == Some(wanted == "healthy")
}

fn detail(view: &Target) -> &str {
    view.last_check
        .as_ref()
        .map_or("", |check| check.detail.as_str())
}

/// The view's last check was made after `after`.
fn checked_after(view: &Target, after: chrono::DateTime<chrono::Utc>) -> bool {
    view.last_check
        .as_ref()
        .is_some_and(|check| check.at > after)
}

// ---------------------------------------------------------------------------------------------

/// The situation: tier 0 is TLS-only; tier 1 also answers plaintext. A plaintext check
/// would mark tier 0 unhealthy and tier 1 healthy, and traffic would fail over to tier 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_service_checks_its_tls_only_target_over_tls_and_traffic_stays_in_its_tier() {
    let gateway = TestGateway::start().await;
    let cert = Cert::new(&["origin.test"]);
    let primary = Origin::start("primary", cert.acceptor(H2_AND_H1), Speaks::Tls).await;
    let backup = Origin::start("backup", cert.acceptor(H2_AND_H1), Speaks::TlsOrPlain).await;
    let service = create_service(
        &gateway,
        "shop",
        json!({
            "protocol": "https", "tls_sni": "origin.test", "tls_ca_pem": cert.cert_pem,
            "health_check": fast_check("http")
        }),
    )
    .await;
    let primary_id = add_target(&gateway, service, primary.addr, 0).await;
    let backup_id = add_target(&gateway, service, backup.addr, 1).await;
    for target in [primary_id, backup_id] {
        wait_target(&gateway, target, "a verdict", |view| {
            settled(view, "healthy") || settled(view, "unhealthy")
        })
        .await;
    }

    for _ in 0..20 {
        let (status, body) = gateway.fetch_status("/shop/item").await;
        assert_eq!(
            (status, body.as_str()),
            (200, "primary"),
            "traffic must stay in tier 0; primary {}, backup {}",
            gateway.target(primary_id).await,
            gateway.target(backup_id).await
        );
    }
    assert!(backup.traffic().is_empty(), "{:?}", backup.traffic());
    let traffic_version = primary.traffic()[0].version;
    assert_eq!(traffic_version, hyper::Version::HTTP_2, "ALPN chose h2");

    let view = gateway.target(primary_id).await;
    assert_eq!(health(&view), "healthy", "{view}");
    assert_eq!(passed(&view), Some(true), "{view}");
    assert_eq!(detail(&view), "HTTP 200", "{view}");
    let backup_view = gateway.target(backup_id).await;
    assert_eq!(health(&backup_view), "healthy", "{backup_view}");

    // Both were checked the way traffic reaches them: over TLS, with the service's SNI.
    for origin in [&primary, &backup] {
        let checks = origin.checks();
        assert!(!checks.is_empty(), "no check reached {}", origin.addr);
        for check in &checks {
            assert!(check.tls, "a plaintext check: {check:?}");
            assert_eq!(check.version, traffic_version, "{check:?}");
            assert_eq!(check.sni.as_deref(), Some("origin.test"), "{check:?}");
            assert_eq!(
                check.host.as_deref(),
                Some(origin.addr.to_string().as_str()),
                "{check:?}"
            );
        }
    }
    let view = gateway
        .api("GET", &format!("/api/v1/services/{service}/runtime"), None)
        .await
        .1;
    assert_eq!(view["panic_picks"], 0, "{view}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_refused_by_verification_names_the_tls_error_and_passes_without_verification() {
    let gateway = TestGateway::start().await;
    let cert = Cert::new(&["origin.test"]);
    let origin = Origin::start("origin", cert.acceptor(H2_AND_H1), Speaks::Tls).await;
    // `tls_verify` is on by default, and the public roots do not know the self-signed cert.
    let service = create_service(
        &gateway,
        "strict",
        json!({ "protocol": "https", "tls_sni": "origin.test", "health_check": fast_check("http") }),
    )
    .await;
    let target = add_target(&gateway, service, origin.addr, 0).await;
    let view = wait_target(&gateway, target, "unhealthy", |view| {
        settled(view, "unhealthy")
    })
    .await;
    assert_eq!(
        detail(&view),
        "TLS handshake: invalid peer certificate: UnknownIssuer (server name \"origin.test\")"
    );

    // A CA that did not issue the target's certificate is no better. It bears the issuer's
    // name, so the check, trusting it, finds the signature wrong (the public roots above did
    // not even know the name): proof it uses the service's CA.
    let wrong_ca = Cert::new(&["origin.test"]);
    let patched_at = chrono::Utc::now();
    patch_service(
        &gateway,
        service,
        json!({ "tls_ca_pem": wrong_ca.cert_pem }),
    )
    .await;
    let view = wait_target(&gateway, target, "a check with the wrong CA", |view| {
        checked_after(view, patched_at) && !detail(view).contains("UnknownIssuer")
    })
    .await;
    assert_eq!(health(&view), "unhealthy", "{view}");
    assert_eq!(
        detail(&view),
        "TLS handshake: invalid peer certificate: BadSignature (server name \"origin.test\")"
    );
    assert!(origin.checks().is_empty(), "{:?}", origin.checks());

    // Without verification the same target passes, as its traffic would. (The wait includes
    // the detail: a round the replaced check loop had already sent to the store may land just
    // after the new loop's first one.)
    patch_service(&gateway, service, json!({ "tls_verify": false })).await;
    wait_target(&gateway, target, "healthy, HTTP 200", |view| {
        settled(view, "healthy") && detail(view) == "HTTP 200"
    })
    .await;
    assert_eq!(
        gateway.fetch_status("/strict").await,
        (200, "origin".to_owned())
    );
}

/// The certificate names only `api.test` (no IP address): a check that sent another name, or
/// none, would fail verification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_send_the_server_name_traffic_sends() {
    let gateway = TestGateway::start().await;
    let cert = Cert::new(&["api.test"]);
    let origin = Origin::start("origin", cert.acceptor(H2_AND_H1), Speaks::Tls).await;
    let service = create_service(
        &gateway,
        "named",
        json!({
            "protocol": "https", "upstream_authority": "api.test:8443",
            "tls_ca_pem": cert.cert_pem, "health_check": fast_check("http")
        }),
    )
    .await;
    let target = add_target(&gateway, service, origin.addr, 0).await;
    wait_target(&gateway, target, "healthy", |view| settled(view, "healthy")).await;
    assert_eq!(
        gateway.fetch_status("/named").await,
        (200, "origin".to_owned())
    );

    let traffic = origin.traffic();
    let checks = origin.checks();
    assert!(!checks.is_empty());
    assert_eq!(traffic.len(), 1, "{traffic:?}");
    // By DESIGN §6: no tls_sni, so upstream_authority's host, for checks and traffic alike.
    assert_eq!(traffic[0].sni.as_deref(), Some("api.test"));
    for check in &checks {
        assert_eq!(check.sni, traffic[0].sni, "{check:?}");
        assert_eq!(check.host.as_deref(), Some("api.test:8443"), "{check:?}");
    }
    assert!(origin
        .handshake_snis()
        .iter()
        .all(|sni| sni.as_deref() == Some("api.test")));

    // `tls_sni` wins over the authority, for checks too: the certificate does not cover it.
    let patched_at = chrono::Utc::now();
    patch_service(&gateway, service, json!({ "tls_sni": "other.test" })).await;
    let view = wait_target(&gateway, target, "a check with the new name", |view| {
        checked_after(view, patched_at) && detail(view).contains("other.test")
    })
    .await;
    assert_eq!(health(&view), "unhealthy", "{view}");
    assert!(
        detail(&view).starts_with("TLS handshake: invalid peer certificate: ")
            && detail(&view).ends_with("(server name \"other.test\")"),
        "{view}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_check_passes_a_tls_listener_and_fails_one_that_does_not_speak_tls() {
    let gateway = TestGateway::start().await;
    let cert = Cert::new(&["db.test"]);
    // A TLS server with its own application protocol: a check offering h2 or http/1.1 by ALPN
    // would be refused (no_application_protocol) though its clients are served.
    let tls_origin = Origin::start("tls", cert.acceptor(&[b"x-db"]), Speaks::Tls).await;
    let plain = Upstream::start("plain").await;
    let service = create_service(
        &gateway,
        "db",
        json!({
            "protocol": "tls", "tls_sni": "db.test", "tls_ca_pem": cert.cert_pem,
            "health_check": fast_check("tls")
        }),
    )
    .await;
    let tls_target = add_target(&gateway, service, tls_origin.addr, 0).await;
    let plain_target = add_target(&gateway, service, plain.addr, 0).await;

    let view = wait_target(&gateway, tls_target, "healthy", |view| {
        settled(view, "healthy")
    })
    .await;
    assert_eq!(detail(&view), "TLS handshake completed", "{view}");
    assert!(!tls_origin.handshake_snis().is_empty());
    assert!(tls_origin
        .handshake_snis()
        .iter()
        .all(|sni| sni.as_deref() == Some("db.test")));
    assert!(
        tls_origin.checks().is_empty(),
        "a handshake check sends no request"
    );

    let view = wait_target(&gateway, plain_target, "unhealthy", |view| {
        settled(view, "unhealthy")
    })
    .await;
    assert_eq!(passed(&view), Some(false), "{view}");
    assert!(
        detail(&view).starts_with("TLS handshake: ")
            && detail(&view).ends_with("(server name \"db.test\")"),
        "{view}"
    );

    // On an `https` service a handshake check means the same, with the service's trust.
    let https_origin = Origin::start("web", cert.acceptor(H2_AND_H1), Speaks::Tls).await;
    let https = create_service(
        &gateway,
        "web",
        json!({
            "protocol": "https", "tls_sni": "db.test", "tls_ca_pem": cert.cert_pem,
            "health_check": fast_check("tls")
        }),
    )
    .await;
    let https_target = add_target(&gateway, https, https_origin.addr, 0).await;
    let view = wait_target(&gateway, https_target, "healthy", |view| {
        settled(view, "healthy")
    })
    .await;
    assert_eq!(detail(&view), "TLS handshake completed", "{view}");
}

#[tokio::test]
async fn a_tls_check_is_refused_where_targets_do_not_speak_tls() {
    let gateway = TestGateway::start().await;
    for protocol in ["http", "tcp"] {
        let (status, body) = gateway
            .api(
                "POST",
                "/api/v1/services",
                Some(json!({
                    "name": format!("plain-{protocol}"), "protocol": protocol,
                    "health_check": { "type": "tls" }
                })),
            )
            .await;
        assert_eq!(status, 422, "{protocol}: {body}");
        assert_eq!(
            ApiError::read(&body).field.as_deref(),
            Some("health_check.type"),
            "{body}"
        );
    }
    let mut created = Vec::new();
    for protocol in ["https", "tls"] {
        let id = gateway
            .create(
                "/api/v1/services",
                json!({
                    "name": format!("secure-{protocol}"), "protocol": protocol,
                    "health_check": { "type": "tls" }
                }),
            )
            .await;
        created.push(id);
    }
    // A change of protocol is checked against the check it keeps.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{}", created[0]),
            Some(json!({ "protocol": "http" })),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("health_check.type"),
        "{body}"
    );

    let (status, document) = gateway.api("GET", "/api/v1/openapi.json", None).await;
    assert_eq!(status, 200);
    let kinds = document["components"]["schemas"]["HealthCheckKind"].to_string();
    for kind in ["\"http\"", "\"tcp\"", "\"tls\""] {
        assert!(kinds.contains(kind), "{kind} missing from {kinds}");
    }
}
