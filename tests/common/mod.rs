//! Test harness: the gateway in-process on 127.0.0.1:0 with a temporary SQLite store, real
//! upstream HTTP servers, and condition waits with deadlines.
#![allow(dead_code)]

pub mod api;
pub mod browser;
pub mod consul;
pub mod fake_server;
pub mod fixed_upstream;
pub mod grpc;
pub mod knot;
pub mod kubernetes;
pub mod otlp;
pub mod postgres;
pub mod process;
pub mod registry;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use raahi::config::Config;
use raahi::gateway::Gateway;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;

// Not every test binary uses every view.
#[allow(unused_imports)]
pub use api::{assert_error, ApiError, EndpointCounts, ProxyError, SourceStatus, Target};

pub const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef";

pub struct TestGateway {
    pub gateway: Option<Gateway>,
    pub dir: Arc<tempfile::TempDir>,
    pub http: reqwest::Client,
    pub proxy: SocketAddr,
    pub admin: SocketAddr,
    config: Config,
}

pub fn test_config(dir: &std::path::Path) -> Config {
    test_config_with(dir, &[])
}

/// The test config with `overrides` in their environment form (`RAAHI_PROXY_...`).
pub fn test_config_with(dir: &std::path::Path, overrides: &[(&str, &str)]) -> Config {
    let mut env: Vec<(String, String)> = vec![
        ("RAAHI_PROXY_LISTEN".into(), "127.0.0.1:0".into()),
        ("RAAHI_ADMIN_LISTEN".into(), "127.0.0.1:0".into()),
        ("RAAHI_ADMIN_TOKEN".into(), ADMIN_TOKEN.into()),
        (
            "RAAHI_DATABASE_URL".into(),
            format!("sqlite://{}/raahi.db", dir.display()),
        ),
    ];
    env.extend(
        overrides
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string())),
    );
    Config::from_parts("test.toml", None, &env).expect("test config is valid")
}

/// A gateway's config as instance `instance_id` of several sharing the PostgreSQL database
/// `database_url`, with short leases so takeovers take seconds, and a resync far beyond every wait
/// in the tests (changes must arrive by notification).
pub fn cluster_config(database_url: &str, instance_id: &str, lease_ms: u64) -> Config {
    let env: Vec<(String, String)> = [
        ("RAAHI_PROXY_LISTEN", "127.0.0.1:0".to_owned()),
        ("RAAHI_ADMIN_LISTEN", "127.0.0.1:0".to_owned()),
        ("RAAHI_ADMIN_TOKEN", ADMIN_TOKEN.to_owned()),
        ("RAAHI_DATABASE_URL", database_url.to_owned()),
        ("RAAHI_CLUSTER_INSTANCE_ID", instance_id.to_owned()),
        ("RAAHI_CLUSTER_LEASE_MS", lease_ms.to_string()),
        ("RAAHI_CLUSTER_RESYNC_MS", "600000".to_owned()),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    Config::from_parts("cluster-test.toml", None, &env).expect("cluster test config is valid")
}

impl TestGateway {
    pub async fn start() -> TestGateway {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let config = test_config(dir.path());
        Self::start_with(dir, config).await
    }

    /// A gateway whose 5xx answers tell what its log tells (`proxy.error_details = "full"`),
    /// for tests that read a source's state or an upstream's error from the answer.
    pub async fn start_with_full_errors() -> TestGateway {
        let dir = Arc::new(tempfile::tempdir().expect("temp dir"));
        let mut config = test_config(dir.path());
        config.proxy.error_details = raahi::config::ErrorDetails::Full;
        Self::start_with(dir, config).await
    }

    pub async fn start_with(dir: Arc<tempfile::TempDir>, config: Config) -> TestGateway {
        let gateway = Gateway::start(&config).await.expect("gateway starts");
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(16)
            .build()
            .unwrap();
        TestGateway {
            proxy: gateway.proxy_addr,
            admin: gateway.admin_addr,
            gateway: Some(gateway),
            dir,
            http,
            config,
        }
    }

    /// Stops this gateway and starts a new one on the same store (new ports).
    pub async fn restart(mut self) -> TestGateway {
        if let Some(gateway) = self.gateway.take() {
            gateway.shutdown().await;
        }
        Self::start_with(self.dir.clone(), self.config.clone()).await
    }

    /// The HTTPS listener's address; the config must set `proxy.tls_listen` (e.g. 127.0.0.1:0).
    pub fn tls_addr(&self) -> SocketAddr {
        self.gateway
            .as_ref()
            .and_then(|gateway| gateway.tls_addr)
            .expect("gateway started with proxy.tls_listen")
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin, path)
    }

    pub fn proxy_url(&self, path: &str) -> String {
        format!("http://{}{}", self.proxy, path)
    }

    /// An admin API call with the admin token; returns status and JSON body (Null when empty).
    pub async fn api(&self, method: &str, path: &str, body: Option<Value>) -> (StatusCode, Value) {
        self.api_as(Some(ADMIN_TOKEN), method, path, body).await
    }

    pub async fn api_as(
        &self,
        token: Option<&str>,
        method: &str,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let mut request = self.http.request(method, self.admin_url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("admin API answers");
        let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
        let text = response.text().await.unwrap();
        let value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, value)
    }

    /// An admin call with a raw body (for malformed input).
    pub async fn api_raw(
        &self,
        method: &str,
        path: &str,
        body: &'static str,
    ) -> (StatusCode, Value) {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let response = self
            .http
            .request(method, self.admin_url(path))
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = StatusCode::from_u16(response.status().as_u16()).unwrap();
        let value = response.json().await.unwrap_or(Value::Null);
        (status, value)
    }

    /// Creates an object and returns its id, failing the test on anything but 201.
    pub async fn create(&self, path: &str, body: Value) -> i64 {
        let (status, value) = self.api("POST", path, Some(body)).await;
        assert_eq!(status, StatusCode::CREATED, "POST {path}: {value}");
        value["id"].as_i64().expect("created object has an id")
    }

    /// A route named `all` that sends every request, whatever its host and path, to `service`.
    pub async fn route_all_to(&self, service: i64) -> i64 {
        self.create(
            "/api/v1/routes",
            json!({"name": "all", "service_id": service}),
        )
        .await
    }

    /// Like [`TestGateway::route_all_to`], for a route that streams request bodies as they
    /// come (`request_buffer_bytes: 0`) instead of reading them whole first.
    pub async fn route_all_streaming_to(&self, service: i64) -> i64 {
        self.create(
            "/api/v1/routes",
            json!({"name": "all", "service_id": service, "request_buffer_bytes": 0}),
        )
        .await
    }

    /// A service with the given targets (no route: add one for traffic to reach it).
    pub async fn service_with_targets(&self, name: &str, targets: &[Value]) -> i64 {
        let service = self
            .create("/api/v1/services", json!({ "name": name }))
            .await;
        for target in targets {
            self.create(
                &format!("/api/v1/services/{service}/targets"),
                target.clone(),
            )
            .await;
        }
        service
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.http
            .get(self.proxy_url(path))
            .send()
            .await
            .expect("proxy answers")
    }
}

/// An object of the admin API with an id: its JSON, or a typed view.
pub trait HasId {
    fn id(&self) -> i64;
}

impl HasId for Value {
    fn id(&self) -> i64 {
        self["id"]
            .as_i64()
            .unwrap_or_else(|| panic!("no id: {self}"))
    }
}

impl HasId for Target {
    fn id(&self) -> i64 {
        self.id
    }
}

impl<T: HasId + ?Sized> HasId for &T {
    fn id(&self) -> i64 {
        (**self).id()
    }
}

/// The `id` of an object in an answer.
pub fn id_of(object: &impl HasId) -> i64 {
    object.id()
}

/// A target body for an upstream.
pub fn target(upstream: &Upstream, weight: u32, priority: i32) -> Value {
    json!({
        "host": upstream.addr.ip().to_string(),
        "port": upstream.addr.port(),
        "weight": weight,
        "priority": priority,
    })
}

/// What an upstream saw of one request.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub headers: BTreeMap<String, Vec<String>>,
    pub body_len: usize,
}

impl Seen {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .and_then(|v| v.first())
            .map(String::as_str)
    }
}

/// A real HTTP/1.1 upstream on 127.0.0.1:0. It answers `200` with its name as the body and
/// records what it saw. `/slow/MS` waits MS milliseconds before answering; `/status/N` answers N.
pub struct Upstream {
    pub name: String,
    pub addr: SocketAddr,
    pub hits: Arc<AtomicUsize>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    /// Bytes of request bodies received, streamed and counted.
    pub body_bytes: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    /// True once the listener and every open connection are closed.
    closed: watch::Receiver<bool>,
}

impl Upstream {
    pub async fn start(name: &str) -> Upstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(name, listener)
    }

    /// Serves on a given address (to bring an upstream back on the same port).
    pub async fn start_on(name: &str, addr: SocketAddr) -> Upstream {
        let listener = TcpListener::bind(addr).await.unwrap();
        Self::serve(name, listener)
    }

    fn serve(name: &str, listener: TcpListener) -> Upstream {
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let body_bytes = Arc::new(AtomicU64::new(0));
        let (stop, mut stopped) = watch::channel(false);
        let (closing, closed) = watch::channel(false);
        let upstream = Upstream {
            name: name.to_owned(),
            addr,
            hits: hits.clone(),
            seen: seen.clone(),
            body_bytes: body_bytes.clone(),
            stop,
            closed,
        };
        let name = Arc::new(name.to_owned());
        tokio::spawn(async move {
            let mut connections = Vec::new();
            loop {
                let (stream, _) = tokio::select! {
                    accepted = listener.accept() => match accepted { Ok(a) => a, Err(_) => continue },
                    _ = stopped.wait_for(|s| *s) => break,
                };
                let name = name.clone();
                let hits = hits.clone();
                let seen = seen.clone();
                let body_bytes = body_bytes.clone();
                let service = service_fn(move |request| {
                    answer(
                        request,
                        name.clone(),
                        hits.clone(),
                        seen.clone(),
                        body_bytes.clone(),
                    )
                });
                connections.push(tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                }));
            }
            // Stopping closes every open connection too, as a killed process would.
            for connection in &connections {
                connection.abort();
            }
            for connection in connections {
                let _ = connection.await;
            }
            drop(listener);
            let _ = closing.send(true);
        });
        upstream
    }

    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn last_seen(&self) -> Seen {
        self.seen
            .lock()
            .unwrap()
            .last()
            .cloned()
            .expect("upstream saw a request")
    }

    /// Stops listening and drops open connections.
    pub fn stop(&self) {
        let _ = self.stop.send(true);
    }

    /// Stops, and returns once the listener and every open connection are closed: no request
    /// sent after it can reach this upstream.
    pub async fn stop_and_wait(&self) {
        self.stop();
        let mut closed = self.closed.clone();
        let _ = closed.wait_for(|closed| *closed).await;
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn answer(
    request: Request<Incoming>,
    name: Arc<String>,
    hits: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    body_bytes: Arc<AtomicU64>,
) -> Result<Response<http_body_util::combinators::BoxBody<Bytes, Infallible>>, Infallible> {
    hits.fetch_add(1, Ordering::SeqCst);
    let path = request.uri().path().to_owned();
    let mut headers: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (key, value) in request.headers() {
        headers
            .entry(key.as_str().to_owned())
            .or_default()
            .push(value.to_str().unwrap_or("").to_owned());
    }
    let method = request.method().to_string();
    let query = request.uri().query().map(str::to_owned);

    if path == "/ws" {
        return Ok(upgrade_echo(request));
    }
    let mut body = request.into_body();
    let mut body_len = 0usize;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Some(data) = frame.data_ref() {
                    body_len += data.len();
                    body_bytes.fetch_add(data.len() as u64, Ordering::SeqCst);
                }
            }
            Err(_) => break,
        }
    }
    seen.lock().unwrap().push(Seen {
        method,
        query,
        path: path.clone(),
        headers,
        body_len,
    });
    if let Some(ms) = path
        .strip_prefix("/slow/")
        .and_then(|ms| ms.parse::<u64>().ok())
    {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(size) = path
        .strip_prefix("/bytes/")
        .and_then(|n| n.parse::<u64>().ok())
    {
        return Ok(Response::new(streamed_bytes(size)));
    }
    let status = path
        .strip_prefix("/status/")
        .and_then(|code| code.parse::<u16>().ok())
        .and_then(|code| StatusCode::from_u16(code).ok())
        .unwrap_or(StatusCode::OK);
    let mut response = Response::new(
        Full::new(Bytes::from(name.as_str().to_owned()))
            .map_err(|e| match e {})
            .boxed(),
    );
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert("x-upstream", name.as_str().parse().unwrap());
    response
        .headers_mut()
        .insert("connection", "keep-alive, x-hop".parse().unwrap());
    response
        .headers_mut()
        .insert("x-hop", "secret".parse().unwrap());
    Ok(response)
}

/// `size` bytes in 64 KiB chunks, generated as they are sent (memory stays flat).
fn streamed_bytes(size: u64) -> http_body_util::combinators::BoxBody<Bytes, Infallible> {
    GeneratedBody {
        remaining: size,
        chunk: Bytes::from(vec![b'x'; 64 * 1024]),
    }
    .boxed()
}

pub struct GeneratedBody {
    pub remaining: u64,
    pub chunk: Bytes,
}

impl GeneratedBody {
    pub fn new(size: u64) -> GeneratedBody {
        GeneratedBody {
            remaining: size,
            chunk: Bytes::from(vec![b'x'; 64 * 1024]),
        }
    }
}

impl hyper::body::Body for GeneratedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Infallible>>> {
        if self.remaining == 0 {
            return std::task::Poll::Ready(None);
        }
        let take = self.remaining.min(self.chunk.len() as u64) as usize;
        self.remaining -= take as u64;
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(self.chunk.slice(..take)))))
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.remaining)
    }
}

/// Answers a WebSocket-style upgrade with 101, then echoes bytes on the upgraded connection.
fn upgrade_echo(
    mut request: Request<Incoming>,
) -> Response<http_body_util::combinators::BoxBody<Bytes, Infallible>> {
    let on_upgrade = hyper::upgrade::on(&mut request);
    tokio::spawn(async move {
        if let Ok(upgraded) = on_upgrade.await {
            let mut io = TokioIo::new(upgraded);
            let (mut reader, mut writer) = tokio::io::split(&mut io);
            let _ = tokio::io::copy(&mut reader, &mut writer).await;
        }
    });
    let mut response = Response::new(Full::new(Bytes::new()).map_err(|e| match e {}).boxed());
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    response
        .headers_mut()
        .insert("upgrade", "echo".parse().unwrap());
    response
        .headers_mut()
        .insert("connection", "upgrade".parse().unwrap());
    response
}

/// `count` GETs of `path` through the proxy over `concurrency` parallel loops, each of which
/// must answer 200; counts answers by body (the upstream's name).
pub async fn spread(
    gateway: &TestGateway,
    path: &str,
    count: usize,
    concurrency: usize,
) -> std::collections::HashMap<String, usize> {
    use std::collections::HashMap;
    let url = gateway.proxy_url(path);
    let mut workers = Vec::new();
    for worker in 0..concurrency {
        let client = gateway.http.clone();
        let url = url.clone();
        let share = count / concurrency + usize::from(worker < count % concurrency);
        workers.push(tokio::spawn(async move {
            let mut counts: HashMap<String, usize> = HashMap::new();
            for _ in 0..share {
                let response = client.get(&url).send().await.expect("proxy answers");
                let status = response.status().as_u16();
                let body = response.text().await.unwrap();
                assert_eq!(status, 200, "GET {url}: {body}");
                *counts.entry(body).or_default() += 1;
            }
            counts
        }));
    }
    let mut total: HashMap<String, usize> = HashMap::new();
    for worker in workers {
        for (name, n) in worker.await.expect("worker finished") {
            *total.entry(name).or_default() += n;
        }
    }
    total
}

/// How long the harness's waits for the gateway to act (a refresh, a reconcile, a check) give it
/// by default.
pub const WAIT_FOR_GATEWAY: Duration = Duration::from_secs(15);

impl TestGateway {
    /// `GET path` on the admin API, which must answer 200; its JSON body.
    pub async fn get_ok(&self, path: &str) -> Value {
        let (status, body) = self.api("GET", path, None).await;
        assert_eq!(status, StatusCode::OK, "GET {path}: {body}");
        body
    }

    /// `GET /api/v1/discovery-sources/{source}/status`, which must answer 200.
    pub async fn source_status(&self, source: i64) -> SourceStatus {
        let path = format!("/api/v1/discovery-sources/{source}/status");
        SourceStatus::read(self.get_ok(&path).await)
    }

    /// Polls the source's status until `done` holds, for at most `within`; returns that status.
    pub async fn wait_source_status(
        &self,
        source: i64,
        what: &str,
        within: Duration,
        done: impl Fn(&SourceStatus) -> bool,
    ) -> SourceStatus {
        let done = &done;
        wait_until(&format!("source {source}: {what}"), within, || async move {
            let status = self.source_status(source).await;
            if done(&status) {
                Ok(status)
            } else {
                Err(status)
            }
        })
        .await
    }

    /// `GET /api/v1/targets/{id}`, which must answer 200.
    pub async fn target(&self, id: i64) -> Target {
        Target::read(self.get_ok(&format!("/api/v1/targets/{id}")).await)
    }

    /// Every target of `service` (one page of up to 1000).
    pub async fn targets(&self, service: i64) -> Vec<Target> {
        let path = format!("/api/v1/services/{service}/targets?limit=1000");
        let list = self.get_ok(&path).await;
        let items = list["items"]
            .as_array()
            .unwrap_or_else(|| panic!("GET {path}: no items: {list}"));
        items.iter().cloned().map(Target::read).collect()
    }
}

/// Polls the source's status until `done` holds (for at most [`WAIT_FOR_GATEWAY`]); returns that
/// status.
pub async fn wait_status(
    gateway: &TestGateway,
    source: i64,
    what: &str,
    done: impl Fn(&SourceStatus) -> bool,
) -> SourceStatus {
    gateway
        .wait_source_status(source, what, WAIT_FOR_GATEWAY, done)
        .await
}

/// Polls `GET /api/v1/targets/{target}` (which must answer 200) until `done` holds (for at most
/// [`WAIT_FOR_GATEWAY`]); returns that target.
pub async fn wait_target(
    gateway: &TestGateway,
    target: i64,
    what: &str,
    done: impl Fn(&Target) -> bool,
) -> Target {
    let done = &done;
    let what = format!("target {target}: {what}");
    wait_until(&what, WAIT_FOR_GATEWAY, || async move {
        let view = gateway.target(target).await;
        if done(&view) {
            Ok(view)
        } else {
            Err(view)
        }
    })
    .await
}

/// Polls the source's status until its state is `state`; returns that status.
pub async fn wait_state(gateway: &TestGateway, source: i64, state: &str) -> SourceStatus {
    wait_status(gateway, source, &format!("state {state}"), |s| {
        s.state == state
    })
    .await
}

/// Active, draining and stale targets, to compare with a status's `endpoints`.
pub fn counts(active: u64, draining: u64, stale: u64) -> EndpointCounts {
    EndpointCounts {
        active,
        draining,
        stale,
    }
}

/// A TLS acceptor with a fresh self-signed certificate for `names` (ring, as the gateway uses),
/// and that certificate's PEM for a client that should trust it.
pub fn self_signed_acceptor(names: &[&str]) -> (tokio_rustls::TlsAcceptor, String) {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let names: Vec<String> = names.iter().map(|name| (*name).to_owned()).collect();
    let certified = rcgen::generate_simple_self_signed(names).expect("a self-signed certificate");
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        certified.signing_key.serialize_der(),
    ));
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_no_client_auth()
    .with_single_cert(vec![certified.cert.der().clone()], key)
    .expect("a server certificate");
    (
        tokio_rustls::TlsAcceptor::from(Arc::new(config)),
        certified.cert.pem(),
    )
}

impl TestGateway {
    /// Status and body of a GET through the proxy; status 0 when the proxy does not answer
    /// (closed, or shut down).
    pub async fn fetch_status(&self, path: &str) -> (u16, String) {
        match self.http.get(self.proxy_url(path)).send().await {
            Ok(response) => {
                let status = response.status().as_u16();
                (status, response.text().await.unwrap_or_default())
            }
            Err(_) => (0, String::new()),
        }
    }

    /// `GET /readyz` (no token): its status code and body.
    pub async fn readyz(&self) -> (u16, api::Readiness) {
        let response = self
            .http
            .get(self.admin_url("/readyz"))
            .send()
            .await
            .expect("the admin listener answers");
        let status = response.status().as_u16();
        let body = response.json().await.expect("a JSON body");
        (status, api::Readiness::read(body))
    }

    /// `GET /metrics` on the admin listener, which must answer 200, as text.
    pub async fn metrics_text(&self) -> String {
        let response = self
            .http
            .get(self.admin_url("/metrics"))
            .send()
            .await
            .expect("the admin listener answers");
        assert_eq!(response.status(), 200, "GET /metrics");
        response.text().await.expect("a text body")
    }

    /// One metric series' value as `/metrics` shows it, `series` with its labels as written
    /// there (0 when absent).
    pub async fn metric(&self, series: &str) -> u64 {
        let text = self.metrics_text().await;
        text.lines()
            .find_map(|line| line.strip_prefix(series)?.strip_prefix(' '))
            .map(|value| value.trim().parse::<f64>().expect("a number") as u64)
            .unwrap_or(0)
    }
}

/// How often [`wait_until`] and [`holds_for`] probe. (Tests that assert on the data path right
/// after a status wait rely on this not being much shorter than the snapshot lags the store.)
const POLL_EVERY: Duration = Duration::from_millis(20);

/// What a probe of [`wait_until`] or [`holds_for`] answers: whether the condition holds and, when
/// it does not, what the probe saw (for the failure message).
///
/// - `bool`: holds or not; nothing to report.
/// - `Option<T>`: `Some(value)` holds and yields `value`.
/// - `Result<T, E>`: `Ok(value)` holds and yields `value`; `Err(state)` describes what was seen.
pub trait Probe {
    type Value;
    /// `Ok(value)` when the condition holds; otherwise the state seen, if the probe described it.
    fn outcome(self) -> Result<Self::Value, Option<String>>;
}

impl Probe for bool {
    type Value = ();
    fn outcome(self) -> Result<(), Option<String>> {
        if self {
            Ok(())
        } else {
            Err(None)
        }
    }
}

impl<T> Probe for Option<T> {
    type Value = T;
    fn outcome(self) -> Result<T, Option<String>> {
        self.ok_or(None)
    }
}

impl<T, E: std::fmt::Display> Probe for Result<T, E> {
    type Value = T;
    fn outcome(self) -> Result<T, Option<String>> {
        self.map_err(|state| Some(state.to_string()))
    }
}

/// The suite's one wait: polls `probe` until it holds (see [`Probe`]) and returns what it
/// yielded; after `deadline` panics naming `what` and the last state the probe described.
pub async fn wait_until<P, F, Fut>(what: &str, deadline: Duration, mut probe: F) -> P::Value
where
    P: Probe,
    F: FnMut() -> Fut,
    Fut: Future<Output = P>,
{
    let end = tokio::time::Instant::now() + deadline;
    loop {
        let last = match probe().await.outcome() {
            Ok(value) => return value,
            Err(last) => last,
        };
        if tokio::time::Instant::now() > end {
            match last {
                Some(state) => {
                    panic!("timed out after {deadline:?} waiting for: {what}\nlast seen: {state}")
                }
                None => panic!("timed out after {deadline:?} waiting for: {what}"),
            }
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// The suite's one "nothing happens" check: asserts that `check` holds (see [`Probe`]) on every
/// poll for all of `window`, for claims that need an observation period rather than a condition
/// to wait for; panics naming `what` and what was seen at the first poll where it did not.
pub async fn holds_for<P, F, Fut>(what: &str, window: Duration, mut check: F)
where
    P: Probe,
    F: FnMut() -> Fut,
    Fut: Future<Output = P>,
{
    let start = tokio::time::Instant::now();
    let end = start + window;
    loop {
        if let Err(state) = check().await.outcome() {
            let state = state.unwrap_or_else(|| "it did not hold".to_owned());
            panic!(
                "expected {what} for {window:?}, but after {:?}: {state}",
                start.elapsed()
            );
        }
        if tokio::time::Instant::now() >= end {
            return;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// A raw HTTP/1.1 exchange over a fresh TCP connection (for requests reqwest will not send).
pub async fn raw_http(addr: SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response)).await;
    String::from_utf8_lossy(&response).into_owned()
}

/// A loopback address nothing listens on right now: bound once, read, released.
pub fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// A service of `protocol` (`tcp` or `tls` for stream routes) with a 2 s connect timeout and the
/// given targets.
pub async fn stream_service(
    gateway: &TestGateway,
    name: &str,
    protocol: &str,
    targets: &[Value],
) -> i64 {
    let service = gateway
        .create(
            "/api/v1/services",
            json!({"name": name, "protocol": protocol, "timeouts": {"connect_ms": 2000}}),
        )
        .await;
    for target in targets {
        gateway
            .create(
                &format!("/api/v1/services/{service}/targets"),
                target.clone(),
            )
            .await;
    }
    service
}

/// A stream route listening on `listen` (for TLS, matching `sni`) to `service`.
pub async fn stream_route(
    gateway: &TestGateway,
    listen: SocketAddr,
    sni: Option<&str>,
    service: i64,
) -> i64 {
    let mut body = json!({"listen": listen.to_string(), "service_id": service});
    if let Some(sni) = sni {
        body["sni"] = json!(sni);
    }
    gateway.create("/api/v1/stream-routes", body).await
}

/// One exchange on a fresh connection: sends `payload`, ends the writes (half-close), reads
/// everything until the gateway closes.
pub async fn exchange(addr: SocketAddr, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let work = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        stream.write_all(payload).await?;
        stream.shutdown().await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok(answer)
    };
    tokio::time::timeout(Duration::from_secs(10), work)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "exchange timed out"))?
}

/// Resident memory of this process in KiB (Linux).
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|line| line.starts_with("VmRSS:"))
                .and_then(|line| line.split_whitespace().nth(1))
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0)
}

/// An origin that serves each accepted connection with `serve`, counting the connections.
pub async fn counting_origin<F, Fut>(serve: F) -> (SocketAddr, Arc<AtomicU64>)
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicU64::new(0));
    let counter = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(stream));
        }
    });
    (address, accepted)
}

/// Reads until the end of an HTTP response head (within 10 s); returns the head and the bytes
/// after it.
pub async fn read_head<R: tokio::io::AsyncRead + Unpin>(stream: &mut R) -> (String, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let mut buffer = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            let rest = buffer.split_off(end + 4);
            return (String::from_utf8_lossy(&buffer).into_owned(), rest);
        }
        let n = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut chunk))
            .await
            .expect("response head within 10 s")
            .expect("read");
        assert!(
            n > 0,
            "connection closed before the end of the response head: {:?}",
            String::from_utf8_lossy(&buffer)
        );
        buffer.extend_from_slice(&chunk[..n]);
    }
}

/// Values of one header (any case) in a raw head.
pub fn head_values(head: &str, name: &str) -> Vec<String> {
    head.split("\r\n")
        .skip(1)
        .filter_map(|line| line.split_once(':'))
        .filter(|(key, _)| key.trim().eq_ignore_ascii_case(name))
        .map(|(_, value)| value.trim().to_owned())
        .collect()
}

/// The `error` of the proxy's named JSON error answer, checking that it is one.
pub fn json_error(status: u16, content_type: &str, body: &str) -> ProxyError {
    assert!(
        content_type.starts_with("application/json"),
        "error answer {status} is not JSON ({content_type:?}): {body}"
    );
    let value: Value = serde_json::from_str(body)
        .unwrap_or_else(|error| panic!("error answer {status} is not JSON ({error}): {body}"));
    ProxyError::read(&value)
}

/// An event-stream client (`GET /api/v1/events`) on a socket with a small receive buffer,
/// which then never reads: what the gateway hands it piles up on the gateway's side.
pub async fn stuck_event_client(gateway: &TestGateway) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stream = socket.connect(gateway.admin).await.unwrap();
    let request = format!(
        "GET /api/v1/events HTTP/1.1\r\nHost: raahi\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\
         Connection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// A service "heavy" with `targets` targets of 15 KB of metadata each, found by one refresh of
/// a registry (returned: keep it running): an event-stream snapshot of about `targets` × 15 KB.
pub async fn heavy_discovered_service(
    gateway: &TestGateway,
    targets: u16,
    deadline: Duration,
) -> registry::Registry {
    let service = gateway
        .create("/api/v1/services", json!({"name": "heavy"}))
        .await;
    let registry = registry::Registry::start().await;
    let endpoints: Vec<Value> = (0..targets)
        .map(|port| {
            json!({"key": format!("t{port}"), "host": "127.0.0.1", "port": 10_000 + port,
                   "metadata": {"padding": "x".repeat(15_000)}})
        })
        .collect();
    registry.set_json(Value::Array(endpoints));
    let source = gateway
        .create(
            &format!("/api/v1/services/{service}/discovery-sources"),
            json!({"name": "heavy", "provider": "http",
                   "config": {"url": registry.url("/v1/endpoints"), "interval_ms": 600_000}}),
        )
        .await;
    gateway
        .wait_source_status(source, "every target found", deadline, |status| {
            status.endpoints.active == u64::from(targets)
        })
        .await;
    registry
}
