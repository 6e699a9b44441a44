//! HTTPS termination (certificates by SNI from the API and the config file, TLS versions, ALPN)
//! and upstream TLS for `https` services (SNI, Host, verification, CA bundles, HTTP/2).

use crate::common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{test_config, wait_until, ApiError, ProxyError, TestGateway, Upstream};
use http_body_util::Full;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use raahi::config::Config;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

const WAIT: Duration = Duration::from_secs(10);

/// A test certificate authority issuing leaf certificates.
struct Pki {
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A leaf certificate and its key, in PEM and DER.
#[derive(Clone)]
struct Leaf {
    cert_pem: String,
    key_pem: String,
    der: Vec<u8>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        Pki {
            ca_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A leaf for `names` (DNS names or IP addresses).
    fn leaf(&self, names: &[&str]) -> Leaf {
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        self.issue(CertificateParams::new(names).expect("leaf params"))
    }

    /// A leaf for `names` that expires at the start of `year` (UTC).
    fn leaf_until(&self, names: &[&str], year: i32) -> Leaf {
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        params.not_after = rcgen::date_time_ymd(year, 1, 1);
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let cert = params
            .signed_by(&key, &self.issuer)
            .expect("leaf certificate");
        Leaf {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
        }
    }
}

/// A gateway with an HTTPS listener whose config-file (default) certificate is `default`.
async fn tls_gateway(default: &Leaf) -> (TestGateway, SocketAddr) {
    let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
    let cert_file = dir.path().join("default.crt");
    let key_file = dir.path().join("default.key");
    std::fs::write(&cert_file, &default.cert_pem).expect("write cert");
    std::fs::write(&key_file, &default.key_pem).expect("write key");
    let base = test_config(dir.path());
    let env: Vec<(String, String)> = vec![
        ("RAAHI_PROXY_LISTEN".into(), "127.0.0.1:0".into()),
        ("RAAHI_ADMIN_LISTEN".into(), "127.0.0.1:0".into()),
        ("RAAHI_PROXY_TLS_LISTEN".into(), "127.0.0.1:0".into()),
        ("RAAHI_ADMIN_TOKEN".into(), common::ADMIN_TOKEN.into()),
        ("RAAHI_DATABASE_URL".into(), base.database.url.clone()),
        (
            "RAAHI_TLS_CERT_FILE".into(),
            cert_file.display().to_string(),
        ),
        ("RAAHI_TLS_KEY_FILE".into(), key_file.display().to_string()),
    ];
    let config = Config::from_parts("test.toml", None, &env).expect("TLS test config is valid");
    let gateway = TestGateway::start_with(dir, config).await;
    let tls_addr = gateway
        .gateway
        .as_ref()
        .and_then(|gateway| gateway.tls_addr)
        .expect("the gateway listens for HTTPS");
    (gateway, tls_addr)
}

/// Accepts any server certificate: these tests look at which certificate was served.
#[derive(Debug)]
struct AcceptAny(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AcceptAny {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

fn client_config(
    versions: &[&'static rustls::SupportedProtocolVersion],
    alpn: &[&[u8]],
) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(versions)
        .expect("versions")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAny(provider)))
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// A TLS handshake with the gateway; `sni` None sends no server name.
async fn handshake(
    addr: SocketAddr,
    sni: Option<&str>,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = match sni {
        Some(sni) => ServerName::try_from(sni.to_string()).expect("valid name"),
        None => ServerName::IpAddress(addr.ip().into()),
    };
    let tcp = TcpStream::connect(addr).await?;
    TlsConnector::from(config).connect(name, tcp).await
}

/// The leaf certificate the gateway serves for `sni` (None: no SNI).
async fn served_cert(addr: SocketAddr, sni: Option<&str>) -> Option<Vec<u8>> {
    let config = client_config(&[&rustls::version::TLS13], &[b"http/1.1"]);
    let stream = handshake(addr, sni, config).await.ok()?;
    let (_, session) = stream.get_ref();
    session
        .peer_certificates()
        .and_then(|chain| chain.first())
        .map(|leaf| leaf.as_ref().to_vec())
}

async fn add_certificate(gateway: &TestGateway, leaf: &Leaf, snis: Option<&[&str]>) -> i64 {
    let mut body = json!({ "cert_pem": leaf.cert_pem, "key_pem": leaf.key_pem });
    if let Some(snis) = snis {
        body["snis"] = json!(snis);
    }
    gateway.create("/api/v1/certificates", body).await
}

/// A route for every host to a plain upstream, so HTTPS requests have somewhere to go.
async fn route_everything_to(gateway: &TestGateway, upstream: &Upstream) {
    let service = gateway
        .service_with_targets("plain", &[common::target(upstream, 100, 0)])
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": "all", "path_prefix": "/", "service_id": service }),
        )
        .await;
}

#[tokio::test]
async fn sni_picks_between_api_certificates_and_falls_back_to_the_default() {
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test", "127.0.0.1"]);
    let alpha = pki.leaf(&["alpha.test"]);
    let beta = pki.leaf(&["*.beta.test"]);
    let (gateway, tls_addr) = tls_gateway(&default).await;
    add_certificate(&gateway, &alpha, None).await;
    add_certificate(&gateway, &beta, Some(&["*.beta.test"])).await;

    wait_until("the API certificates are served", WAIT, || async {
        served_cert(tls_addr, Some("alpha.test")).await.as_deref() == Some(&alpha.der[..])
            && served_cert(tls_addr, Some("www.beta.test"))
                .await
                .as_deref()
                == Some(&beta.der[..])
    })
    .await;
    assert_eq!(
        served_cert(tls_addr, Some("ALPHA.test")).await,
        Some(alpha.der.clone()),
        "server names are case-insensitive"
    );
    assert_eq!(
        served_cert(tls_addr, None).await,
        Some(default.der.clone()),
        "a client without SNI gets the default certificate"
    );
    assert_eq!(
        served_cert(tls_addr, Some("unknown.test")).await,
        Some(default.der.clone()),
        "an unknown server name gets the default certificate"
    );
    assert_eq!(
        served_cert(tls_addr, Some("default.test")).await,
        Some(default.der.clone())
    );
}

#[tokio::test]
async fn https_requests_are_proxied_with_forwarded_proto_https() {
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test", "127.0.0.1"]);
    let (gateway, tls_addr) = tls_gateway(&default).await;
    let upstream = Upstream::start("plain-upstream").await;
    route_everything_to(&gateway, &upstream).await;

    let client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap())
        .resolve("default.test", tls_addr)
        .build()
        .unwrap();
    let url = format!("https://default.test:{}/hello", tls_addr.port());
    wait_until("the route serves over HTTPS", WAIT, || async {
        matches!(client.get(&url).send().await, Ok(r) if r.status() == reqwest::StatusCode::OK)
    })
    .await;
    let seen = upstream.last_seen();
    assert_eq!(seen.header("x-forwarded-proto"), Some("https"));
    assert_eq!(seen.path, "/hello");

    // The plain listener still says http.
    let response = gateway.get("/plain").await;
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    assert_eq!(
        upstream.last_seen().header("x-forwarded-proto"),
        Some("http")
    );
}

#[tokio::test]
async fn adding_and_deleting_a_certificate_takes_effect_without_restart() {
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test"]);
    let fresh = pki.leaf(&["fresh.test"]);
    let (gateway, tls_addr) = tls_gateway(&default).await;
    assert_eq!(
        served_cert(tls_addr, Some("fresh.test")).await,
        Some(default.der.clone())
    );

    let id = add_certificate(&gateway, &fresh, None).await;
    wait_until("the added certificate is served", WAIT, || async {
        served_cert(tls_addr, Some("fresh.test")).await.as_deref() == Some(&fresh.der[..])
    })
    .await;

    let (status, body) = gateway
        .api("DELETE", &format!("/api/v1/certificates/{id}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{body}");
    wait_until(
        "the deleted certificate is no longer served",
        WAIT,
        || async {
            served_cert(tls_addr, Some("fresh.test")).await.as_deref() == Some(&default.der[..])
        },
    )
    .await;
}

#[tokio::test]
async fn bad_certificates_are_refused_and_keys_never_returned() {
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test"]);
    let good = pki.leaf(&["good.test"]);
    let other = pki.leaf(&["good.test"]);
    let (gateway, _) = tls_gateway(&default).await;

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({ "cert_pem": "not a certificate", "key_pem": good.key_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("cert_pem"),
        "{body}"
    );

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({ "cert_pem": good.cert_pem, "key_pem": other.key_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("key_pem"),
        "{body}"
    );

    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({ "cert_pem": good.cert_pem, "key_pem": "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n" })),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("key_pem"),
        "{body}"
    );

    let (status, created) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({ "cert_pem": good.cert_pem, "key_pem": good.key_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{created}");
    assert_eq!(created["snis"], json!(["good.test"]));
    assert!(created["not_after"].is_string(), "{created}");
    let id = created["id"].as_i64().expect("id");

    let (_, one) = gateway
        .api("GET", &format!("/api/v1/certificates/{id}"), None)
        .await;
    let (_, list) = gateway.api("GET", "/api/v1/certificates", None).await;
    for shown in [&created, &one, &list] {
        let text = shown.to_string();
        assert!(!text.contains("key_pem"), "key field returned: {text}");
        assert!(!text.contains("PRIVATE KEY"), "key returned: {text}");
    }
    assert_eq!(one["cert_pem"], Value::String(good.cert_pem.clone()));
}

#[tokio::test]
async fn tls_1_2_and_1_3_both_handshake_and_resume() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test"]);
    let (_gateway, tls_addr) = tls_gateway(&default).await;
    for (version, expected) in [
        (&rustls::version::TLS12, rustls::ProtocolVersion::TLSv1_2),
        (&rustls::version::TLS13, rustls::ProtocolVersion::TLSv1_3),
    ] {
        let config = client_config(&[version], &[]);
        let mut stream = handshake(tls_addr, Some("default.test"), config.clone())
            .await
            .unwrap_or_else(|error| panic!("{expected:?} handshake: {error}"));
        assert_eq!(stream.get_ref().1.protocol_version(), Some(expected));
        assert_eq!(
            stream.get_ref().1.handshake_kind(),
            Some(rustls::HandshakeKind::Full)
        );
        // One exchange, so the client also reads the TLS 1.3 session tickets.
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: default.test\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let _ = stream.read_to_end(&mut answer).await;
        assert!(
            answer.starts_with(b"HTTP/1.1 404"),
            "{}",
            String::from_utf8_lossy(&answer)
        );

        let again = handshake(tls_addr, Some("default.test"), config)
            .await
            .expect("second handshake");
        assert_eq!(
            again.get_ref().1.handshake_kind(),
            Some(rustls::HandshakeKind::Resumed),
            "{expected:?} session resumed"
        );
    }
}

#[tokio::test]
async fn alpn_chooses_http2_or_http1() {
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test"]);
    let (gateway, tls_addr) = tls_gateway(&default).await;
    let upstream = Upstream::start("plain-upstream").await;
    route_everything_to(&gateway, &upstream).await;

    let stream = handshake(
        tls_addr,
        Some("default.test"),
        client_config(&[&rustls::version::TLS13], &[b"h2", b"http/1.1"]),
    )
    .await
    .expect("handshake");
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));

    let root = reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap();
    let url = format!("https://default.test:{}/alpn", tls_addr.port());
    let h2 = reqwest::Client::builder()
        .add_root_certificate(root.clone())
        .resolve("default.test", tls_addr)
        .build()
        .unwrap();
    let h1 = reqwest::Client::builder()
        .add_root_certificate(root)
        .resolve("default.test", tls_addr)
        .http1_only()
        .build()
        .unwrap();
    wait_until("the route serves over HTTPS", WAIT, || async {
        matches!(h2.get(&url).send().await, Ok(r) if r.status() == reqwest::StatusCode::OK)
    })
    .await;
    let response = h2.get(&url).send().await.expect("h2 request");
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    assert_eq!(response.text().await.unwrap(), "plain-upstream");
    assert_eq!(upstream.last_seen().header("via"), Some("2 raahi"));

    let response = h1.get(&url).send().await.expect("http/1.1 request");
    assert_eq!(response.version(), reqwest::Version::HTTP_11);
    assert_eq!(response.text().await.unwrap(), "plain-upstream");
    assert_eq!(upstream.last_seen().header("via"), Some("1.1 raahi"));
}

/// What a TLS upstream saw of one request.
#[derive(Debug, Clone)]
struct TlsSeen {
    sni: Option<String>,
    host: Option<String>,
    authority: Option<String>,
    version: http::Version,
}

/// An HTTPS upstream on 127.0.0.1:0 recording the SNI of each connection and the Host,
/// `:authority` and HTTP version of each request; it answers 200 with its name.
struct TlsUpstream {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<TlsSeen>>>,
    /// Completed TLS handshakes.
    connections: Arc<AtomicUsize>,
    /// Requests answered (`/slow/MS` after MS milliseconds).
    answered: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TlsUpstream {
    async fn start(name: &str, leaf: &Leaf, alpn: &[&[u8]]) -> TlsUpstream {
        use rustls::pki_types::pem::PemObject;
        let chain = vec![CertificateDer::from_pem_slice(leaf.cert_pem.as_bytes()).unwrap()];
        let key =
            rustls::pki_types::PrivateKeyDer::from_pem_slice(leaf.key_pem.as_bytes()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let name = Arc::new(name.to_string());
        let recorded = seen.clone();
        let connections = Arc::new(AtomicUsize::new(0));
        let handshakes = connections.clone();
        let answered = Arc::new(AtomicUsize::new(0));
        let answers = answered.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                let recorded = recorded.clone();
                let name = name.clone();
                let handshakes = handshakes.clone();
                let answers = answers.clone();
                tokio::spawn(async move {
                    let Ok(stream) = acceptor.accept(tcp).await else {
                        return;
                    };
                    handshakes.fetch_add(1, Ordering::SeqCst);
                    let sni = stream.get_ref().1.server_name().map(str::to_string);
                    let service = service_fn(move |request: Request<hyper::body::Incoming>| {
                        recorded.lock().unwrap().push(TlsSeen {
                            sni: sni.clone(),
                            host: request
                                .headers()
                                .get(http::header::HOST)
                                .and_then(|host| host.to_str().ok())
                                .map(str::to_string),
                            authority: request.uri().authority().map(|a| a.to_string()),
                            version: request.version(),
                        });
                        let name = name.clone();
                        let answers = answers.clone();
                        async move {
                            let delay = request
                                .uri()
                                .path()
                                .strip_prefix("/slow/")
                                .and_then(|ms| ms.parse().ok());
                            if let Some(ms) = delay {
                                tokio::time::sleep(Duration::from_millis(ms)).await;
                            }
                            let answer = tls_upstream_answer(request, &name);
                            answers.fetch_add(1, Ordering::SeqCst);
                            Ok::<_, Infallible>(answer)
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection_with_upgrades(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        TlsUpstream {
            addr,
            seen,
            connections,
            answered,
            task,
        }
    }

    fn last_seen(&self) -> TlsSeen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("the TLS upstream saw a request")
    }
}

/// `/ws` switches to an echo protocol (HTTP/1.1 only); anything else gets 200 and the name.
fn tls_upstream_answer(
    mut request: Request<hyper::body::Incoming>,
    name: &str,
) -> Response<Full<Bytes>> {
    if request.uri().path() != "/ws" {
        return Response::new(Full::new(Bytes::from(name.to_owned())));
    }
    let on_upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        if let Ok(upgraded) = on_upgrade.await {
            let mut io = TokioIo::new(upgraded);
            let (mut reader, mut writer) = tokio::io::split(&mut io);
            let _ = tokio::io::copy(&mut reader, &mut writer).await;
        }
    });
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    response.headers_mut().insert(
        http::header::UPGRADE,
        http::HeaderValue::from_static("echo"),
    );
    response.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("upgrade"),
    );
    response
}

impl Drop for TlsUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An `https` service with `fields` (beside name and protocol), one target at `upstream`, and a
/// route for `path_prefix`.
async fn https_service(
    gateway: &TestGateway,
    name: &str,
    fields: Value,
    upstream: &TlsUpstream,
    path_prefix: &str,
) -> i64 {
    let mut body = json!({ "name": name, "protocol": "https" });
    for (key, value) in fields.as_object().expect("fields object") {
        body[key] = value.clone();
    }
    let service = gateway.create("/api/v1/services", body).await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({ "host": upstream.addr.ip().to_string(), "port": upstream.addr.port() }),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": name, "path_prefix": path_prefix, "service_id": service }),
        )
        .await;
    service
}

/// GETs `path` through the plain listener until it answers `status`; returns the body.
async fn get_until(gateway: &TestGateway, path: &str, status: u16) -> Value {
    wait_until(&format!("GET {path} to answer {status}"), WAIT, || async {
        let response = gateway.get(path).await;
        let got = response.status().as_u16();
        let text = response.text().await.unwrap_or_default();
        let last = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if got == status {
            Ok(last)
        } else {
            Err(format!("{got}: {last}"))
        }
    })
    .await
}

/// A client that cancels its HTTP/2 streams while an `https` target works on them (rapid
/// reset's pattern) costs the target no connection per stream: the exchange finishes on its
/// own and its connection is reused.
#[tokio::test]
async fn cancelled_http2_streams_do_not_cost_an_https_target_its_connections() {
    let pki = Pki::new("upstream CA");
    let leaf = pki.leaf(&["slow.test"]);
    let upstream = TlsUpstream::start("slow-tls", &leaf, &[b"http/1.1"]).await;
    let gateway = TestGateway::start().await;
    https_service(
        &gateway,
        "slow-tls",
        json!({ "tls_sni": "slow.test", "tls_ca_pem": pki.ca_pem }),
        &upstream,
        "/",
    )
    .await;
    get_until(&gateway, "/warm", 200).await;
    let client = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    const ROUNDS: usize = 10;
    for round in 1..=ROUNDS {
        let seen_before = upstream.seen.lock().unwrap().len();
        let answered_before = upstream.answered.load(Ordering::SeqCst);
        let request = client.get(gateway.proxy_url("/slow/150")).send();
        let request = tokio::spawn(request);
        wait_until("the target to get the request", WAIT, || async {
            upstream.seen.lock().unwrap().len() > seen_before
        })
        .await;
        // The client gives up: its stream is reset while the target works on it.
        request.abort();
        wait_until("the target to answer it anyway", WAIT, || async {
            upstream.answered.load(Ordering::SeqCst) > answered_before
        })
        .await;
        let _ = round;
    }
    let connections = upstream.connections.load(Ordering::SeqCst);
    assert!(
        connections <= ROUNDS / 2,
        "{connections} TLS connections for {ROUNDS} cancelled streams (and a warm-up)"
    );
}

#[tokio::test]
async fn https_upstream_gets_sni_by_the_three_rules_and_the_expected_host() {
    let pki = Pki::new("upstream CA");
    let leaf = pki.leaf(&["sni.test", "authority.test", "127.0.0.1"]);
    let upstream = TlsUpstream::start("tls-upstream", &leaf, &[b"http/1.1"]).await;
    let gateway = TestGateway::start().await;
    let target_authority = format!("127.0.0.1:{}", upstream.addr.port());

    https_service(
        &gateway,
        "by-sni",
        json!({ "tls_sni": "sni.test", "upstream_authority": "authority.test:8443", "tls_ca_pem": pki.ca_pem }),
        &upstream,
        "/by-sni",
    )
    .await;
    https_service(
        &gateway,
        "by-authority",
        json!({ "upstream_authority": "authority.test:8443", "tls_ca_pem": pki.ca_pem }),
        &upstream,
        "/by-authority",
    )
    .await;
    https_service(
        &gateway,
        "by-target",
        json!({ "tls_ca_pem": pki.ca_pem }),
        &upstream,
        "/by-target",
    )
    .await;

    assert_eq!(get_until(&gateway, "/by-sni", 200).await, "tls-upstream");
    let seen = upstream.last_seen();
    assert_eq!(seen.sni.as_deref(), Some("sni.test"));
    assert_eq!(seen.host.as_deref(), Some("authority.test:8443"));
    assert_eq!(seen.version, http::Version::HTTP_11);

    assert_eq!(
        get_until(&gateway, "/by-authority", 200).await,
        "tls-upstream"
    );
    let seen = upstream.last_seen();
    assert_eq!(seen.sni.as_deref(), Some("authority.test"));
    assert_eq!(seen.host.as_deref(), Some("authority.test:8443"));

    // An IP target sends no SNI, and the certificate is checked against the IP address.
    assert_eq!(get_until(&gateway, "/by-target", 200).await, "tls-upstream");
    let seen = upstream.last_seen();
    assert_eq!(seen.sni, None);
    assert_eq!(seen.host.as_deref(), Some(target_authority.as_str()));
}

#[tokio::test]
async fn untrusted_upstream_certificate_is_a_named_502_until_its_ca_is_trusted() {
    let pki = Pki::new("private CA");
    let leaf = pki.leaf(&["private.test"]);
    let upstream = TlsUpstream::start("private-upstream", &leaf, &[b"http/1.1"]).await;
    // The 502 is read for the TLS reason: told only with `proxy.error_details = "full"`.
    let gateway = TestGateway::start_with_full_errors().await;

    let verified = https_service(
        &gateway,
        "verified",
        json!({ "tls_sni": "private.test" }),
        &upstream,
        "/verified",
    )
    .await;
    https_service(
        &gateway,
        "unverified",
        json!({ "tls_sni": "private.test", "tls_verify": false }),
        &upstream,
        "/unverified",
    )
    .await;

    let body = get_until(&gateway, "/verified", 502).await;
    let error = ProxyError::read(&body);
    assert_eq!(error.code, "upstream_tls_failed", "{body}");
    let message = error.message;
    assert!(message.contains("UnknownIssuer"), "{message}");
    assert!(
        upstream.seen.lock().unwrap().is_empty(),
        "no request reached the upstream"
    );

    assert_eq!(
        get_until(&gateway, "/unverified", 200).await,
        "private-upstream"
    );

    // Trusting the private CA makes the same service work: the new setting gets a new pool.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{verified}"),
            Some(json!({ "tls_ca_pem": pki.ca_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(
        get_until(&gateway, "/verified", 200).await,
        "private-upstream"
    );

    // A certificate for another name still fails verification, with the reason.
    let (status, body) = gateway
        .api(
            "PATCH",
            &format!("/api/v1/services/{verified}"),
            Some(json!({ "tls_sni": "other.test" })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let body = get_until(&gateway, "/verified", 502).await;
    let error = ProxyError::read(&body);
    assert_eq!(error.code, "upstream_tls_failed", "{body}");
    let message = error.message;
    assert!(message.contains("not valid for name"), "{message}");
}

#[tokio::test]
async fn upstream_speaks_http2_when_alpn_offers_it() {
    let pki = Pki::new("upstream CA");
    let leaf = pki.leaf(&["h2.test"]);
    let h2_upstream = TlsUpstream::start("h2-upstream", &leaf, &[b"h2", b"http/1.1"]).await;
    let h1_upstream = TlsUpstream::start("h1-upstream", &leaf, &[b"http/1.1"]).await;
    let gateway = TestGateway::start().await;
    https_service(
        &gateway,
        "h2",
        json!({ "upstream_authority": "h2.test", "tls_ca_pem": pki.ca_pem }),
        &h2_upstream,
        "/h2",
    )
    .await;
    https_service(
        &gateway,
        "h1",
        json!({ "upstream_authority": "h2.test", "tls_ca_pem": pki.ca_pem }),
        &h1_upstream,
        "/h1",
    )
    .await;

    assert_eq!(get_until(&gateway, "/h2", 200).await, "h2-upstream");
    let seen = h2_upstream.last_seen();
    assert_eq!(seen.version, http::Version::HTTP_2);
    assert_eq!(seen.sni.as_deref(), Some("h2.test"));
    // HTTP/2 carries the chosen host as :authority, and a Host header may only repeat it.
    assert_eq!(seen.authority.as_deref(), Some("h2.test"));
    assert!(
        matches!(seen.host.as_deref(), None | Some("h2.test")),
        "{seen:?}"
    );

    // Later requests share the one HTTP/2 connection.
    for _ in 0..5 {
        assert_eq!(get_until(&gateway, "/h2", 200).await, "h2-upstream");
    }
    assert!(h2_upstream
        .seen
        .lock()
        .unwrap()
        .iter()
        .all(|seen| seen.version == http::Version::HTTP_2));
    assert_eq!(h2_upstream.connections.load(Ordering::SeqCst), 1);

    assert_eq!(get_until(&gateway, "/h1", 200).await, "h1-upstream");
    assert_eq!(h1_upstream.last_seen().version, http::Version::HTTP_11);
}

#[tokio::test]
async fn upgrade_to_an_http2_capable_upstream_goes_over_http1() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new("upstream CA");
    let leaf = pki.leaf(&["ws.test"]);
    let upstream = TlsUpstream::start("ws-upstream", &leaf, &[b"h2", b"http/1.1"]).await;
    let gateway = TestGateway::start().await;
    https_service(
        &gateway,
        "ws",
        json!({ "tls_sni": "ws.test", "tls_ca_pem": pki.ca_pem }),
        &upstream,
        "/",
    )
    .await;
    // An ordinary request first, so the HTTP/2 pool exists when the upgrade comes.
    assert_eq!(get_until(&gateway, "/plain", 200).await, "ws-upstream");
    assert_eq!(upstream.last_seen().version, http::Version::HTTP_2);

    let mut stream = TcpStream::connect(gateway.proxy).await.unwrap();
    stream
        .write_all(
            b"GET /ws HTTP/1.1\r\nHost: ws.test\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
        )
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let read = tokio::time::timeout(WAIT, stream.read(&mut byte))
            .await
            .expect("101 in time")
            .expect("read");
        assert_eq!(
            read,
            1,
            "connection closed after {:?}",
            String::from_utf8_lossy(&head)
        );
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head);
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert_eq!(upstream.last_seen().version, http::Version::HTTP_11);

    stream.write_all(b"ping over tls").await.unwrap();
    let mut echoed = [0u8; 13];
    tokio::time::timeout(WAIT, stream.read_exact(&mut echoed))
        .await
        .expect("echo in time")
        .expect("echo");
    assert_eq!(&echoed, b"ping over tls");
}

#[tokio::test]
async fn a_tls_handshake_that_never_finishes_is_a_connect_timeout() {
    // Accepts TCP and then says nothing, like a server stuck before its ServerHello.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            open.push(stream);
        }
    });
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({ "name": "mute", "protocol": "https", "timeouts": { "connect_ms": 300 } }),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({ "host": "127.0.0.1", "port": addr.port() }),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": "mute", "path_prefix": "/", "service_id": service }),
        )
        .await;
    let started = std::time::Instant::now();
    let body = get_until(&gateway, "/", 504).await;
    assert_eq!(
        ProxyError::read(&body).code,
        "upstream_connect_timeout",
        "{body}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    held.abort();
}

#[tokio::test]
async fn a_certificate_is_renewed_in_place_and_an_api_certificate_beats_the_file_one() {
    let pki = Pki::new("test CA");
    let default = pki.leaf(&["default.test", "shared.test"]);
    let old = pki.leaf(&["renew.test"]);
    let renewed = pki.leaf(&["renew.test", "www.renew.test"]);
    let (gateway, tls_addr) = tls_gateway(&default).await;

    let id = add_certificate(&gateway, &old, None).await;
    wait_until("the first certificate is served", WAIT, || async {
        served_cert(tls_addr, Some("renew.test")).await.as_deref() == Some(&old.der[..])
    })
    .await;
    // PUT swaps certificate, key and names in one step: the name never falls back to the
    // default, and the answer is the renewed object (without its key).
    let (status, body) = gateway
        .api(
            "PUT",
            &format!("/api/v1/certificates/{id}"),
            Some(json!({ "cert_pem": renewed.cert_pem, "key_pem": renewed.key_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["snis"], json!(["renew.test", "www.renew.test"]));
    assert!(body.get("key_pem").is_none(), "{body}");
    assert_eq!(
        served_cert(tls_addr, Some("www.renew.test")).await,
        Some(renewed.der.clone()),
        "live once the PUT returns"
    );
    assert_eq!(
        served_cert(tls_addr, Some("renew.test")).await,
        Some(renewed.der.clone())
    );
    // A renewal whose key does not match is refused and changes nothing.
    let (status, body) = gateway
        .api(
            "PUT",
            &format!("/api/v1/certificates/{id}"),
            Some(json!({ "cert_pem": old.cert_pem, "key_pem": renewed.key_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("key_pem"),
        "{body}"
    );
    assert_eq!(
        served_cert(tls_addr, Some("renew.test")).await,
        Some(renewed.der.clone())
    );

    // A name the config file's certificate also covers is served from the API's certificate.
    let shared = pki.leaf(&["shared.test"]);
    add_certificate(&gateway, &shared, None).await;
    assert_eq!(
        served_cert(tls_addr, Some("shared.test")).await,
        Some(shared.der.clone())
    );
    assert_eq!(
        served_cert(tls_addr, None).await,
        Some(default.der.clone()),
        "the file certificate stays the default"
    );
}

#[tokio::test]
async fn a_private_key_pasted_into_cert_pem_is_refused_not_stored() {
    let pki = Pki::new("test CA");
    let leaf = pki.leaf(&["combined.test"]);
    let gateway = TestGateway::start().await;
    let combined = format!("{}{}", leaf.cert_pem, leaf.key_pem);
    let (status, body) = gateway
        .api(
            "POST",
            "/api/v1/certificates",
            Some(json!({ "cert_pem": combined, "key_pem": leaf.key_pem })),
        )
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(
        ApiError::read(&body).field.as_deref(),
        Some("cert_pem"),
        "{body}"
    );
    let (_, listed) = gateway.api("GET", "/api/v1/certificates", None).await;
    assert_eq!(listed["items"], json!([]));
    assert!(!listed.to_string().contains("PRIVATE KEY"));
}

/// With `preserve_host` the Host is the client's to choose: distinct values must not each open
/// (and keep) their own upstream TLS connection. Raahi's HTTP/2 pool carries them all on the
/// target's connections.
#[tokio::test]
async fn client_chosen_hosts_share_the_targets_connections() {
    let pki = Pki::new("upstream CA");
    let leaf = pki.leaf(&["h2.test"]);
    let upstream = TlsUpstream::start("h2-upstream", &leaf, &[b"h2", b"http/1.1"]).await;
    let gateway = TestGateway::start().await;
    let service = gateway
        .create(
            "/api/v1/services",
            json!({ "name": "kept", "protocol": "https", "tls_sni": "h2.test", "tls_ca_pem": pki.ca_pem }),
        )
        .await;
    gateway
        .create(
            &format!("/api/v1/services/{service}/targets"),
            json!({ "host": upstream.addr.ip().to_string(), "port": upstream.addr.port() }),
        )
        .await;
    gateway
        .create(
            "/api/v1/routes",
            json!({ "name": "kept", "service_id": service, "preserve_host": true }),
        )
        .await;
    // One at a time, each with a Host of its own.
    for port in 1..=30 {
        let response = gateway
            .http
            .get(gateway.proxy_url("/"))
            .header("host", format!("client-{port}.test:{port}"))
            .send()
            .await
            .expect("request");
        assert_eq!(response.status(), reqwest::StatusCode::OK);
    }
    let seen = upstream.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 30);
    // Raahi's HTTP/2 pool sends any `:authority` on the target's connections, so the
    // client's Host rides HTTP/2 as `:authority`.
    assert_eq!(
        seen.last()
            .and_then(|seen| seen.authority.clone())
            .as_deref(),
        Some("client-30.test:30"),
        "the client's Host reaches the upstream"
    );
    assert!(seen
        .iter()
        .all(|seen| seen.version == http::Version::HTTP_2));
    let handshakes = upstream.connections.load(Ordering::SeqCst);
    assert!(
        handshakes <= 2,
        "30 client Hosts opened {handshakes} upstream TLS connections"
    );
}

/// `raahi_certificate_not_after_seconds` reports the certificate files beside the API
/// certificates, told apart by `source`, and a reload (what SIGHUP does) replaces a file's series.
#[tokio::test]
async fn the_expiry_metric_covers_certificate_files_and_follows_a_reload() {
    const START_OF_2031: u64 = 1_924_992_000;
    const START_OF_2032: u64 = 1_956_528_000;
    const START_OF_2033: u64 = 1_988_150_400;
    let pki = Pki::new("test CA");
    let (gateway, _) = tls_gateway(&pki.leaf_until(&["default.test"], 2031)).await;
    let id = add_certificate(&gateway, &pki.leaf_until(&["api.test"], 2033), None).await;
    let files = raahi::config::TlsConfig {
        cert_file: Some(gateway.dir.path().join("default.crt")),
        key_file: Some(gateway.dir.path().join("default.key")),
        certificates: Vec::new(),
    };
    let file_series = format!(
        "raahi_certificate_not_after_seconds{{source=\"file\",cert_file=\"{}\",sni=\"default.test\"}}",
        gateway.dir.path().join("default.crt").display()
    );
    let api_series = format!(
        "raahi_certificate_not_after_seconds{{source=\"api\",certificate_id=\"{id}\",sni=\"api.test\"}} {START_OF_2033}\n"
    );
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains(&format!("{file_series} {START_OF_2031}\n")),
        "{metrics}"
    );
    assert!(metrics.contains(&api_series), "{metrics}");

    let renewed = pki.leaf_until(&["default.test"], 2032);
    std::fs::write(files.cert_file.as_ref().unwrap(), &renewed.cert_pem).unwrap();
    std::fs::write(files.key_file.as_ref().unwrap(), &renewed.key_pem).unwrap();
    let running = gateway.gateway.as_ref().expect("running");
    running
        .reload_certificate_files(&files)
        .await
        .expect("the renewed files load");
    let metrics = gateway.metrics_text().await;
    assert!(
        metrics.contains(&format!("{file_series} {START_OF_2032}\n")),
        "{metrics}"
    );
    assert_eq!(
        metrics.matches("source=\"file\"").count(),
        1,
        "the renewed file replaces its series: {metrics}"
    );
    assert!(metrics.contains(&api_series), "{metrics}");
}

/// What SIGHUP does for certificate files: read them again and serve them; a file that fails
/// to load changes nothing.
#[tokio::test]
async fn certificate_files_are_read_again_on_reload() {
    let pki = Pki::new("test CA");
    let first = pki.leaf(&["default.test"]);
    let renewed = pki.leaf(&["default.test"]);
    let (gateway, tls_addr) = tls_gateway(&first).await;
    let files = raahi::config::TlsConfig {
        cert_file: Some(gateway.dir.path().join("default.crt")),
        key_file: Some(gateway.dir.path().join("default.key")),
        certificates: Vec::new(),
    };
    let running = gateway.gateway.as_ref().expect("running");
    assert_eq!(served_cert(tls_addr, None).await, Some(first.der.clone()));

    // A half-written renewal (new certificate, old key) is refused; the first one stays.
    std::fs::write(files.cert_file.as_ref().unwrap(), &renewed.cert_pem).unwrap();
    let refused = running.reload_certificate_files(&files).await;
    assert!(refused.is_err(), "a key that does not match is refused");
    assert_eq!(served_cert(tls_addr, None).await, Some(first.der.clone()));

    std::fs::write(files.key_file.as_ref().unwrap(), &renewed.key_pem).unwrap();
    running
        .reload_certificate_files(&files)
        .await
        .expect("the renewed files load");
    assert_eq!(served_cert(tls_addr, None).await, Some(renewed.der.clone()));
    assert_eq!(
        served_cert(tls_addr, Some("default.test")).await,
        Some(renewed.der.clone())
    );
}
