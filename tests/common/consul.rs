//! An in-process fake of the one Consul HTTP endpoint the `consul` discovery provider reads,
//! `GET /v1/health/service/<service>`, served over HTTP/1.1 on 127.0.0.1:0, with the controls the
//! integration tests need: change the catalog, bump or rewind the raft index, fail, hang, stop
//! and restart on the same port, require an ACL token, and count what was asked.
//!
//! Written from Consul's public documentation and source (the fake must behave like the real
//! thing, not like what the client under test happens to expect):
//! - `api-docs/features/blocking.mdx`: `index` + `wait` long polling, `X-Consul-Index`, `wait`
//!   defaults to 5m and is capped at 10m, plus "up to `wait / 16`" of random extra time; a return
//!   is no guarantee of a change; indexes can go backwards (snapshot restore); an index must be
//!   sanity-checked to be at least 1.
//! - `agent/blockingquery/blockingquery.go`: `index=0` (or absent) never blocks; otherwise the
//!   query re-runs on every watched change and returns once the result's index is *greater than*
//!   the requested one, when the wait (`RPCQueryTimeout`: cap, default, then jitter) expires, or at
//!   once when the state store is abandoned by a snapshot restore.
//! - `api-docs/health.mdx` (List Service Instances for Service): the entry shape, `dc`, `tag`
//!   (repeatable, all must match), `passing`, `filter`, `ns`, `node-meta`.
//! - `agent/health_endpoint.go`: `passing` with no value means true, otherwise Go's `ParseBool`
//!   (`400 Invalid value for ?passing`); tag matching is case-insensitive
//!   (`state/catalog.go` `serviceTagFilter`).
//! - `agent/http.go`: `400 Invalid wait time`, `400 Invalid index`, `400 Cannot specify ?stale
//!   with ?consistent, conflicting semantics.`, the `X-Consul-*` answer headers, ACL errors
//!   answered `403` with the error text (`ACL not found`), token from `?token`, `X-Consul-Token`
//!   or `Authorization: Bearer`.
//! - `agent/agent.go` (`EnableServiceMaintenance`): maintenance mode is an extra critical check
//!   `_service_maintenance:<service id>` named "Service Maintenance Mode"; the service's own check
//!   is left alone (`consul maint` docs: "registering a health check in critical status").
//!
//! Simplifications (each one documented where it matters): one global raft index for every
//! table (real Consul has finer-grained indexes, so an unrelated write may or may not wake a
//! query: `touch` models the case where it does); every entry lives in namespace and partition
//! `default` (the answer has the Enterprise shape with `Namespace`/`Partition`); `filter` is
//! evaluated only for a small subset of go-bexpr and otherwise recorded and ignored.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE, VARY};
use hyper::service::service_fn;
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::TlsAcceptor;

/// Consul's `DefaultQueryTime` and `MaxQueryTime` (blocking.mdx: "defaults to 5 minutes",
/// "limited to 10 minutes").
const DEFAULT_WAIT: Duration = Duration::from_secs(5 * 60);
const MAX_WAIT: Duration = Duration::from_secs(10 * 60);
/// `structs.JitterFraction`: a blocked query may last up to `wait / 16` longer.
const JITTER_FRACTION: u32 = 16;

/// One service instance in the catalog: a service registered on a node, with one service check.
#[derive(Clone, Debug)]
pub struct Instance {
    /// `Node.Node`
    pub node: String,
    /// `Node.Address`
    pub node_address: String,
    /// `Node.Datacenter`, default "dc1"
    pub datacenter: String,
    /// `Service.ID`
    pub service_id: String,
    /// `Service.Service` (the name queried)
    pub service: String,
    /// `Service.Address` ("" means unset: Consul then reports "", and clients use `Node.Address`)
    pub address: String,
    pub port: u16,
    pub tags: Vec<String>,
    pub meta: BTreeMap<String, String>,
    /// `Service.Weights` Passing, Warning; default (1, 1)
    pub weights: (u32, u32),
    /// The status of the instance's one service check: "passing" (default), "warning",
    /// "critical", or "maintenance" (maintenance mode on, the service check itself passing).
    pub check_status: String,
}

impl Instance {
    /// node "node-<port>", node_address "127.0.0.1", dc "dc1", service_id "<service>-<port>",
    /// address "127.0.0.1", no tags/meta, weights (1,1), passing.
    pub fn new(service: &str, port: u16) -> Instance {
        Instance {
            node: format!("node-{port}"),
            node_address: "127.0.0.1".to_owned(),
            datacenter: "dc1".to_owned(),
            service_id: format!("{service}-{port}"),
            service: service.to_owned(),
            address: "127.0.0.1".to_owned(),
            port,
            tags: Vec::new(),
            meta: BTreeMap::new(),
            weights: (1, 1),
            check_status: "passing".to_owned(),
        }
    }
}

/// A catalog entry with the raft indexes Consul would report for it.
struct Entry {
    /// `check_status` here is the service check's own status, never "maintenance".
    instance: Instance,
    maintenance: bool,
    create_index: u64,
    modify_index: u64,
    check_modify_index: u64,
    maintenance_index: u64,
}

struct State {
    /// Keyed by (node, service id): iteration order is the order Consul's memdb index yields.
    entries: BTreeMap<(String, String), Entry>,
    /// Node name -> the index at which the node joined the catalog (nodes outlive services).
    nodes: BTreeMap<String, u64>,
    index: u64,
    /// Counts snapshot restores: a query blocked across one answers at once, as Consul's
    /// abandoned state store makes it.
    restores: u64,
    failure: Option<(u16, String)>,
    hang: bool,
    answer_at_once: bool,
    token: Option<String>,
    queries: Vec<String>,
    last_headers: HeaderMap,
}

struct Shared {
    state: Mutex<State>,
    /// Bumped on every change that may end a blocked query (the memdb watch channels).
    changed: watch::Sender<u64>,
    requests: AtomicUsize,
    blocking_requests: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl Shared {
    fn wake(&self) {
        self.changed.send_modify(|generation| *generation += 1);
    }

    /// One raft write: the index moves forward and blocked queries re-run.
    fn write<T>(&self, change: impl FnOnce(&mut State, u64) -> T) -> T {
        let result = {
            let mut state = self.state.lock().unwrap();
            state.index += 1;
            let index = state.index;
            change(&mut state, index)
        };
        self.wake();
        result
    }
}

/// One listening period, between `start`/`restart` and `stop`.
struct Run {
    listener: Arc<TcpListener>,
    stop: watch::Sender<bool>,
    connections: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Run {
    fn stop(self) {
        let _ = self.stop.send(true);
        // Shutting the listening socket down makes the kernel refuse new connections right
        // now, not whenever the accept task next runs: a test may connect right after `stop`.
        let _ = socket2::SockRef::from(&*self.listener).shutdown(std::net::Shutdown::Read);
        for connection in self.connections.lock().unwrap().drain(..) {
            connection.abort();
        }
    }
}

pub struct ConsulFake {
    pub addr: SocketAddr,
    /// For [`ConsulFake::start_tls`]: the PEM of the self-signed certificate it serves, for a
    /// client's `ca_pem`.
    pub ca_pem: Option<String>,
    shared: Arc<Shared>,
    run: Mutex<Option<Run>>,
    tls: Option<TlsAcceptor>,
}

impl ConsulFake {
    /// Starts serving on 127.0.0.1:0 with an empty catalog at index 1.
    pub async fn start() -> ConsulFake {
        Self::start_with(None).await
    }

    /// The same over HTTPS (Consul's `https` port), with a self-signed certificate for
    /// `127.0.0.1` that only a client given [`ConsulFake::ca_pem`] trusts.
    pub async fn start_tls() -> ConsulFake {
        let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()])
            .expect("a self-signed certificate");
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
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let mut fake = Self::start_with(Some(acceptor)).await;
        fake.ca_pem = Some(certified.cert.pem());
        fake
    }

    async fn start_with(tls: Option<TlsAcceptor>) -> ConsulFake {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().unwrap();
        let (changed, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                entries: BTreeMap::new(),
                nodes: BTreeMap::new(),
                index: 1,
                restores: 0,
                failure: None,
                hang: false,
                answer_at_once: false,
                token: None,
                queries: Vec::new(),
                last_headers: HeaderMap::new(),
            }),
            changed,
            requests: AtomicUsize::new(0),
            blocking_requests: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let run = serve(shared.clone(), listener, tls.clone());
        ConsulFake {
            addr,
            ca_pem: None,
            shared,
            run: Mutex::new(Some(run)),
            tls,
        }
    }

    /// `http://127.0.0.1:PORT` (`https` for [`ConsulFake::start_tls`])
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// Registers (or replaces, same node+service id) a service instance; bumps the raft index.
    /// Re-registering keeps the entry's `CreateIndex`, as Consul does.
    pub fn register(&self, instance: Instance) {
        assert_status(&instance.check_status);
        self.shared.write(|state, index| {
            state.nodes.entry(instance.node.clone()).or_insert(index);
            let key = (instance.node.clone(), instance.service_id.clone());
            let previous = state.entries.remove(&key);
            let maintenance = instance.check_status == "maintenance";
            let mut instance = instance;
            if maintenance {
                // Maintenance mode does not touch the service check: keep what it was.
                instance.check_status = previous
                    .as_ref()
                    .map(|entry| entry.instance.check_status.clone())
                    .unwrap_or_else(|| "passing".to_owned());
            }
            let create_index = previous.as_ref().map_or(index, |entry| entry.create_index);
            let maintenance_index = match &previous {
                Some(entry) if entry.maintenance && maintenance => entry.maintenance_index,
                _ => index,
            };
            state.entries.insert(
                key,
                Entry {
                    instance,
                    maintenance,
                    create_index,
                    modify_index: index,
                    check_modify_index: index,
                    maintenance_index,
                },
            );
        });
    }

    /// Deregisters node/service_id; bumps the index. No-op (no bump) if absent.
    pub fn deregister(&self, node: &str, service_id: &str) {
        let key = (node.to_owned(), service_id.to_owned());
        if !self.shared.state.lock().unwrap().entries.contains_key(&key) {
            return;
        }
        self.shared.write(|state, _| {
            state.entries.remove(&key);
        });
    }

    /// Sets the status ("passing" | "warning" | "critical" | "maintenance") of the one service
    /// check of node/service_id; bumps the index (as a check update with new output would).
    /// "maintenance" adds Consul's `_service_maintenance:<id>` critical check and leaves the
    /// service check as it was; any other status also ends maintenance mode.
    pub fn set_check(&self, node: &str, service_id: &str, status: &str) {
        assert_status(status);
        let key = (node.to_owned(), service_id.to_owned());
        assert!(
            self.shared.state.lock().unwrap().entries.contains_key(&key),
            "set_check: no instance {service_id} registered on node {node}"
        );
        self.shared.write(|state, index| {
            let entry = state.entries.get_mut(&key).expect("entry checked above");
            if status == "maintenance" {
                if !entry.maintenance {
                    entry.maintenance = true;
                    entry.maintenance_index = index;
                }
            } else {
                entry.maintenance = false;
                entry.instance.check_status = status.to_owned();
                entry.check_modify_index = index;
            }
        });
    }

    /// Bumps the index without changing any entry (like an unrelated write in Consul's state
    /// store that still touches this table): blocked queries wake and answer the same body with
    /// a higher index.
    pub fn touch(&self) {
        self.shared.write(|_, _| ());
    }

    /// Current X-Consul-Index.
    pub fn index(&self) -> u64 {
        self.shared.state.lock().unwrap().index
    }

    /// Simulates a server restart / snapshot restore: the index becomes `index` (lower than
    /// before), entries stay; blocked queries are answered at once with the new lower index.
    /// `0` is allowed, to exercise the client's "index is at least 1" sanity check.
    ///
    /// A query that arrives *later* still carrying an index above the new one blocks until the
    /// index passes it or its wait expires, because that is what `blockingquery.Query` does
    /// (it returns only once the result's index is greater than the requested one); blocking.mdx
    /// warns that a client which does not reset its index "may miss future updates for an
    /// unbounded time". Only queries blocked *during* the restore return at once (the restore
    /// abandons the state store they watch).
    pub fn reset_index(&self, index: u64) {
        {
            let mut state = self.shared.state.lock().unwrap();
            state.index = index;
            state.restores += 1;
            // The restored snapshot cannot hold writes newer than itself.
            for entry in state.entries.values_mut() {
                entry.create_index = entry.create_index.min(index);
                entry.modify_index = entry.modify_index.min(index);
                entry.check_modify_index = entry.check_modify_index.min(index);
                entry.maintenance_index = entry.maintenance_index.min(index);
            }
            for joined in state.nodes.values_mut() {
                *joined = (*joined).min(index);
            }
        }
        self.shared.wake();
    }

    /// From now on every /v1/health/service request answers `status` with `body` (text/plain)
    /// at once (e.g. 500, 403 "Permission denied"); queries blocked right now answer it too, as
    /// they do when a Consul server loses its leader. `None` goes back to normal.
    pub fn fail_with(&self, failure: Option<(u16, String)>) {
        if let Some((status, _)) = &failure {
            StatusCode::from_u16(*status).expect("fail_with: a valid HTTP status");
        }
        self.shared.state.lock().unwrap().failure = failure;
        self.shared.wake();
    }

    /// From now on requests are accepted and their headers read, but never answered (the
    /// connection stays open, silent) until `hang(false)`. Queries blocked right now go silent
    /// too. Requests already hanging stay silent until their client gives up (or `stop`).
    pub fn hang(&self, on: bool) {
        self.shared.state.lock().unwrap().hang = on;
        self.shared.wake();
    }

    /// From now on blocking queries do NOT block: they answer at once with the current index
    /// even if unchanged (a misbehaving server; the client must rate-limit itself). Queries
    /// blocked right now answer at once too.
    pub fn answer_at_once(&self, on: bool) {
        self.shared.state.lock().unwrap().answer_at_once = on;
        self.shared.wake();
    }

    /// Requires this ACL token (or none when None: ACLs disabled, any token ignored). Without
    /// it, or with another one, requests get 403 "ACL not found". Like Consul, the token is
    /// read from `?token=`, `X-Consul-Token` or `Authorization: Bearer`; check
    /// [`ConsulFake::last_headers`] and [`ConsulFake::queries`] to see which the client used.
    pub fn require_token(&self, token: Option<&str>) {
        self.shared.state.lock().unwrap().token = token.map(str::to_owned);
    }

    /// Requests to /v1/health/service/* so far (every one, blocking or not).
    pub fn requests(&self) -> usize {
        self.shared.requests.load(Ordering::SeqCst)
    }

    /// Requests whose query had an `index` parameter (blocking queries).
    pub fn blocking_requests(&self) -> usize {
        self.shared.blocking_requests.load(Ordering::SeqCst)
    }

    /// The raw query strings ("index=5&wait=1000ms&tag=a&tag=b", "" for none) of every request
    /// so far, in order.
    pub fn queries(&self) -> Vec<String> {
        self.shared.state.lock().unwrap().queries.clone()
    }

    /// The headers of the last request (empty before the first).
    pub fn last_headers(&self) -> HeaderMap {
        self.shared.state.lock().unwrap().last_headers.clone()
    }

    /// Requests being served (blocked or hanging) right now.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::SeqCst)
    }

    /// The most requests ever served at once.
    pub fn max_in_flight(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// Stops listening and drops every open connection (an agent going down). After stop,
    /// connects are refused.
    pub fn stop(&self) {
        if let Some(run) = self.run.lock().unwrap().take() {
            run.stop();
        }
    }

    /// Starts listening again on the same port, entries and index kept. Does nothing while
    /// already listening.
    pub async fn restart(&self) {
        if self.run.lock().unwrap().is_some() {
            return;
        }
        // The old accept task may still hold the port for a moment after `stop`.
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(listener) => break listener,
                Err(error) if Instant::now() < deadline => {
                    let _ = error;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(error) => panic!("restart: cannot bind {} again: {error}", self.addr),
            }
        };
        let run = serve(self.shared.clone(), listener, self.tls.clone());
        *self.run.lock().unwrap() = Some(run);
    }
}

impl Drop for ConsulFake {
    fn drop(&mut self) {
        self.stop();
    }
}

fn assert_status(status: &str) {
    assert!(
        matches!(status, "passing" | "warning" | "critical" | "maintenance"),
        "check status must be passing, warning, critical or maintenance, not {status:?}"
    );
}

fn serve(shared: Arc<Shared>, listener: TcpListener, tls: Option<TlsAcceptor>) -> Run {
    let listener = Arc::new(listener);
    let (stop, mut stopped) = watch::channel(false);
    let connections: Arc<Mutex<Vec<AbortHandle>>> = Arc::new(Mutex::new(Vec::new()));
    let accepting = listener.clone();
    let tracked = connections.clone();
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                accepted = accepting.accept() => accepted,
                _ = stopped.wait_for(|stop| *stop) => break,
            };
            let stream = match accepted {
                Ok((stream, _)) => stream,
                // After `stop` shut the socket down, accept fails until this task sees the flag.
                Err(_) if *stopped.borrow() => break,
                Err(_) => {
                    tokio::task::yield_now().await;
                    continue;
                }
            };
            let shared = shared.clone();
            let service = service_fn(move |request| answer(request, shared.clone()));
            let tls = tls.clone();
            let connection = tokio::spawn(async move {
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    None => {
                        let _ = http.serve_connection(TokioIo::new(stream), service).await;
                    }
                    // A client that refuses the certificate ends the handshake here.
                    Some(acceptor) => {
                        if let Ok(stream) = acceptor.accept(stream).await {
                            let _ = http.serve_connection(TokioIo::new(stream), service).await;
                        }
                    }
                }
            });
            let mut connections = tracked.lock().unwrap();
            connections.retain(|handle| !handle.is_finished());
            connections.push(connection.abort_handle());
        }
    });
    Run {
        listener,
        stop,
        connections,
    }
}

/// Counts a request as in flight for as long as its answer future lives, including when the
/// client disconnects or `stop` drops the connection mid-request.
struct InFlight(Arc<Shared>);

impl InFlight {
    fn new(shared: Arc<Shared>) -> InFlight {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(shared)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

type Answer = Response<Full<Bytes>>;

/// What a blocked query does after a wake-up.
enum Wake {
    Hang,
    Fail((u16, String)),
    Answer,
    Block,
}

fn text(status: u16, body: &str) -> Answer {
    let mut response = Response::new(Full::new(Bytes::from(body.to_owned())));
    *response.status_mut() = StatusCode::from_u16(status).unwrap();
    // What Go's net/http sniffs for a plain `fmt.Fprint` error body.
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Never returns: the request stays open and silent until the client or `stop` drops it.
async fn silence() -> Infallible {
    std::future::pending::<Infallible>().await
}

async fn answer(request: Request<Incoming>, shared: Arc<Shared>) -> Result<Answer, Infallible> {
    let Some(service) = request.uri().path().strip_prefix("/v1/health/service/") else {
        return Ok(text(404, "Not found"));
    };
    let service = percent_decode(service);
    let raw_query = request.uri().query().unwrap_or("").to_owned();
    let query = Query::parse(&raw_query);
    let _in_flight = InFlight::new(shared.clone());
    shared.requests.fetch_add(1, Ordering::SeqCst);
    if query.has("index") {
        shared.blocking_requests.fetch_add(1, Ordering::SeqCst);
    }
    let (arrived_restores, failure, hang, required_token) = {
        let mut state = shared.state.lock().unwrap();
        state.queries.push(raw_query.clone());
        state.last_headers = request.headers().clone();
        (
            state.restores,
            state.failure.clone(),
            state.hang,
            state.token.clone(),
        )
    };
    if hang {
        match silence().await {}
    }
    if let Some((status, body)) = failure {
        return Ok(text(status, &body));
    }
    if request.method() != Method::GET {
        // Consul's `MethodNotAllowedError`.
        let mut response = text(405, &format!("method {} not allowed", request.method()));
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET"));
        return Ok(response);
    }
    if let Some(required) = required_token {
        if request_token(&request, &query).as_deref() != Some(required.as_str()) {
            return Ok(text(403, "ACL not found"));
        }
    }
    if service.is_empty() {
        return Ok(text(400, "Missing service name"));
    }

    let stale = query.has("stale");
    let consistent = query.has("consistent");
    if stale && consistent {
        return Ok(text(
            400,
            "Cannot specify ?stale with ?consistent, conflicting semantics.",
        ));
    }
    let wait = match query.get("wait").filter(|wait| !wait.is_empty()) {
        None => 0,
        Some(wait) => match parse_go_duration(wait) {
            Some(nanos) => nanos,
            None => return Ok(text(400, "Invalid wait time")),
        },
    };
    let min_index = match query.get("index").filter(|index| !index.is_empty()) {
        None => 0,
        Some(index) => match parse_go_uint(index) {
            Some(index) => index,
            None => return Ok(text(400, "Invalid index")),
        },
    };
    let passing = match query.get("passing") {
        None => false,
        Some(value) => match parse_go_bool(value) {
            Some(passing) => passing,
            None => return Ok(text(400, "Invalid value for ?passing")),
        },
    };
    let datacenter = query
        .get("dc")
        .filter(|dc| !dc.is_empty())
        .unwrap_or("dc1")
        .to_owned();
    {
        let state = shared.state.lock().unwrap();
        let known = datacenter == "dc1"
            || state
                .entries
                .values()
                .any(|entry| entry.instance.datacenter == datacenter);
        if !known {
            return Ok(text(500, "No path to datacenter"));
        }
    }

    if min_index > 0 {
        // `RPCQueryTimeout`: no wait (or a non-positive one) means the default, a longer one is
        // capped, then up to a sixteenth more at random.
        let wait = if wait <= 0 {
            DEFAULT_WAIT
        } else {
            Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX)).min(MAX_WAIT)
        };
        let spread = u64::try_from((wait / JITTER_FRACTION).as_nanos()).unwrap_or(u64::MAX);
        let jitter = if spread == 0 {
            0
        } else {
            fastrand::u64(0..spread)
        };
        let deadline = Instant::now() + wait + Duration::from_nanos(jitter);
        let mut changes = shared.changed.subscribe();
        loop {
            changes.borrow_and_update();
            let wake = {
                let state = shared.state.lock().unwrap();
                if state.hang {
                    Wake::Hang
                } else if let Some(failure) = &state.failure {
                    Wake::Fail(failure.clone())
                } else if state.answer_at_once
                    || state.restores != arrived_restores
                    || state.index > min_index
                {
                    Wake::Answer
                } else {
                    Wake::Block
                }
            };
            match wake {
                Wake::Hang => match silence().await {},
                Wake::Fail((status, body)) => return Ok(text(status, &body)),
                Wake::Answer => break,
                Wake::Block => {}
            }
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = tokio::time::sleep_until(deadline) => break,
            }
        }
    }

    // The wait may have ended at its deadline after `hang(true)`: a hung agent answers nothing.
    let hung = shared.state.lock().unwrap().hang;
    if hung {
        match silence().await {}
    }
    let state = shared.state.lock().unwrap();
    let tags: Vec<String> = query
        .all("tag")
        .into_iter()
        .map(str::to_lowercase)
        .collect();
    let node_meta: Vec<(&str, &str)> = query
        .all("node-meta")
        .into_iter()
        .map(|pair| pair.split_once(':').unwrap_or((pair, "")))
        .collect();
    // Every entry lives in namespace and partition "default": another one holds nothing.
    let in_default = |key: &str| {
        query
            .get(key)
            .is_none_or(|value| value.is_empty() || value == "default")
    };
    let filter = query.get("filter").filter(|filter| !filter.is_empty());
    let mut entries = Vec::new();
    if in_default("ns") && in_default("partition") {
        for entry in state.entries.values() {
            let instance = &entry.instance;
            if instance.service != service || instance.datacenter != datacenter {
                continue;
            }
            let tagged = tags
                .iter()
                .all(|tag| instance.tags.iter().any(|have| have.to_lowercase() == *tag));
            if !tagged {
                continue;
            }
            let value = render(entry, &state.nodes);
            if passing
                && !value["Checks"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|check| check["Status"] == "passing")
            {
                continue;
            }
            let node_meta_ok = node_meta
                .iter()
                .all(|(key, want)| value["Node"]["Meta"][*key].as_str() == Some(*want));
            if !node_meta_ok {
                continue;
            }
            if let Some(filter) = filter {
                if filter_matches(filter, &value) == Some(false) {
                    continue;
                }
            }
            entries.push(value);
        }
    }
    let index = state.index;
    let acl_policy = if state.token.is_some() {
        "deny"
    } else {
        "allow"
    };
    drop(state);

    let body = if query.has("pretty") {
        let mut buffer = Vec::new();
        let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
        let mut serializer = serde_json::Serializer::with_formatter(&mut buffer, formatter);
        serde::Serialize::serialize(&Value::Array(entries), &mut serializer).unwrap();
        buffer.push(b'\n');
        buffer
    } else {
        serde_json::to_vec(&Value::Array(entries)).unwrap()
    };
    let consistency = if consistent {
        "consistent"
    } else if stale {
        "stale"
    } else {
        "leader"
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(VARY, HeaderValue::from_static("Accept-Encoding"));
    headers.insert("x-consul-index", HeaderValue::from(index));
    headers.insert("x-consul-knownleader", HeaderValue::from_static("true"));
    headers.insert("x-consul-lastcontact", HeaderValue::from_static("0"));
    headers.insert(
        "x-consul-effective-consistency",
        HeaderValue::from_static(consistency),
    );
    headers.insert(
        "x-consul-query-backend",
        HeaderValue::from_static("blocking-query"),
    );
    headers.insert(
        "x-consul-default-acl-policy",
        HeaderValue::from_static(acl_policy),
    );
    Ok(response)
}

/// Consul's `parseToken` order: `?token=`, then `X-Consul-Token`, then `Authorization: Bearer`.
fn request_token(request: &Request<Incoming>, query: &Query) -> Option<String> {
    if let Some(token) = query.get("token").filter(|token| !token.is_empty()) {
        return Some(token.to_owned());
    }
    let headers = request.headers();
    if let Some(token) = headers
        .get("x-consul-token")
        .and_then(|value| value.to_str().ok())
        .filter(|token| !token.is_empty())
    {
        return Some(token.to_owned());
    }
    let authorization = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = authorization.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_owned())
}

/// One `CheckServiceNode` as `/v1/health/service` renders it.
fn render(entry: &Entry, nodes: &BTreeMap<String, u64>) -> Value {
    let instance = &entry.instance;
    let node_index = nodes
        .get(&instance.node)
        .copied()
        .unwrap_or(entry.create_index);
    let check = |check_id: String,
                 name: String,
                 status: &str,
                 notes: &str,
                 output: String,
                 service: bool,
                 check_type: &str,
                 create_index: u64,
                 modify_index: u64| {
        json!({
            "Node": instance.node,
            "CheckID": check_id,
            "Name": name,
            "Status": status,
            "Notes": notes,
            "Output": output,
            "ServiceID": if service { instance.service_id.as_str() } else { "" },
            "ServiceName": if service { instance.service.as_str() } else { "" },
            "ServiceTags": if service { instance.tags.clone() } else { Vec::new() },
            "Type": check_type,
            "Interval": "",
            "Timeout": "",
            "ExposedPort": 0,
            "Definition": {},
            "Namespace": "default",
            "Partition": "default",
            "CreateIndex": create_index,
            "ModifyIndex": modify_index,
        })
    };
    let status = instance.check_status.as_str();
    let mut checks = vec![
        check(
            "serfHealth".to_owned(),
            "Serf Health Status".to_owned(),
            "passing",
            "",
            "Agent alive and reachable".to_owned(),
            false,
            "",
            node_index,
            node_index,
        ),
        check(
            format!("service:{}", instance.service_id),
            format!("Service '{}' check", instance.service),
            status,
            "",
            format!("TTL check set to {status} by the test"),
            true,
            "ttl",
            entry.create_index,
            entry.check_modify_index,
        ),
    ];
    if entry.maintenance {
        checks.push(check(
            format!("_service_maintenance:{}", instance.service_id),
            "Service Maintenance Mode".to_owned(),
            "critical",
            "Maintenance mode is enabled for this service, but no reason was provided. This is a default message.",
            String::new(),
            true,
            "",
            entry.maintenance_index,
            entry.maintenance_index,
        ));
    }
    // memdb yields a node's checks in CheckID order.
    checks.sort_by(|a, b| a["CheckID"].as_str().cmp(&b["CheckID"].as_str()));
    json!({
        "Node": {
            "ID": node_id(&instance.node),
            "Node": instance.node,
            "Address": instance.node_address,
            "Datacenter": instance.datacenter,
            "TaggedAddresses": {
                "lan": instance.node_address,
                "lan_ipv4": instance.node_address,
                "wan": instance.node_address,
                "wan_ipv4": instance.node_address,
            },
            "Meta": {"consul-network-segment": ""},
            "CreateIndex": node_index,
            "ModifyIndex": node_index,
        },
        "Service": {
            "ID": instance.service_id,
            "Service": instance.service,
            "Tags": instance.tags,
            "Address": instance.address,
            "TaggedAddresses": {},
            "Meta": instance.meta,
            "Port": instance.port,
            "Weights": {"Passing": instance.weights.0, "Warning": instance.weights.1},
            "EnableTagOverride": false,
            "Proxy": {"Mode": "", "MeshGateway": {}, "Expose": {}},
            "Connect": {},
            "Namespace": "default",
            "Partition": "default",
            "CreateIndex": entry.create_index,
            "ModifyIndex": entry.modify_index,
        },
        "Checks": checks,
    })
}

/// A stable UUID-shaped node ID derived from the node name (agents generate a random one once
/// and keep it).
fn node_id(node: &str) -> String {
    let hash = |seed: u64| {
        node.bytes().fold(seed, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        })
    };
    let high = hash(0xcbf2_9ce4_8422_2325);
    let low = hash(0x8422_2325_cbf2_9ce4);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

/// A query string as Go's `url.ParseQuery` sees it: `&`-separated, `+` is a space, `%XX`
/// escapes; a key may repeat.
struct Query {
    pairs: Vec<(String, String)>,
}

impl Query {
    fn parse(raw: &str) -> Query {
        let pairs = raw
            .split('&')
            .filter(|pair| !pair.is_empty())
            .map(|pair| {
                let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                (percent_decode(key), percent_decode(value))
            })
            .collect();
        Query { pairs }
    }

    fn has(&self, key: &str) -> bool {
        self.pairs.iter().any(|(have, _)| have == key)
    }

    /// The first value, like Go's `Values.Get`.
    fn get(&self, key: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(have, _)| have == key)
            .map(|(_, value)| value.as_str())
    }

    fn all(&self, key: &str) -> Vec<&str> {
        self.pairs
            .iter()
            .filter(|(have, _)| have == key)
            .map(|(_, value)| value.as_str())
            .collect()
    }
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b'%' => {
                let escaped = bytes
                    .get(i + 1..i + 3)
                    .and_then(|hex| std::str::from_utf8(hex).ok())
                    .and_then(|hex| u8::from_str_radix(hex, 16).ok());
                match escaped {
                    Some(byte) => {
                        out.push(byte);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            byte => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Go's `time.ParseDuration`, in nanoseconds: "500ms", "5s", "1m30s", "1.5h", "-2s", "0".
fn parse_go_duration(text: &str) -> Option<i128> {
    let (negative, mut rest) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    if rest == "0" {
        return Some(0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..number_end];
        if number.is_empty() || number == "." {
            return None;
        }
        let value: f64 = number.parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_end] {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return None,
        };
        total += value * unit;
        rest = &rest[unit_end..];
    }
    let nanos = total.round() as i128;
    Some(if negative { -nanos } else { nanos })
}

/// Go's `strconv.ParseUint(text, 10, 64)`: digits only, no sign.
fn parse_go_uint(text: &str) -> Option<u64> {
    if text.is_empty() || !text.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// Consul's `getBoolQueryParam`: present without a value is true, else Go's `ParseBool`.
fn parse_go_bool(text: &str) -> Option<bool> {
    match text {
        "" | "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Evaluates a small subset of Consul's filter language (go-bexpr) against a rendered entry:
/// clauses joined by `and`, each `<Selector> == "v"`, `!= "v"`, `"v" in <Selector>`,
/// `"v" not in <Selector>`, `<Selector> contains "v"`, `not contains`, `is empty` or
/// `is not empty`, where the selector is a dotted path through objects (`Service.Meta.version`,
/// `Service.Tags`, `Node.Node`). `None` means the expression is outside the subset: the caller
/// then ignores the filter (it is still recorded in `queries()`).
fn filter_matches(expression: &str, entry: &Value) -> Option<bool> {
    let mut matched = true;
    for clause in split_outside_quotes(expression, " and ")? {
        matched &= clause_matches(clause.trim(), entry)?;
    }
    Some(matched)
}

/// Splits on `separator` outside quoted strings; `None` if the expression uses grouping or
/// `or`/`not` at the top level, which this subset does not evaluate.
fn split_outside_quotes<'a>(expression: &'a str, separator: &str) -> Option<Vec<&'a str>> {
    let mut parts = Vec::new();
    let mut quote = None;
    let mut escaped = false;
    let mut start = 0;
    let mut skip_until = 0;
    for (i, c) in expression.char_indices() {
        if i < skip_until {
            continue;
        }
        let rest = &expression[i..];
        match quote {
            Some(_) if escaped => escaped = false,
            Some('"') if c == '\\' => escaped = true,
            Some(open) if c == open => quote = None,
            Some(_) => {}
            None if c == '"' || c == '`' => quote = Some(c),
            None if c == '(' || c == ')' || rest.starts_with(" or ") => return None,
            None if rest.starts_with(separator) => {
                parts.push(&expression[start..i]);
                start = i + separator.len();
                skip_until = start;
            }
            None => {}
        }
    }
    if quote.is_some() {
        return None;
    }
    parts.push(&expression[start..]);
    Some(parts)
}

fn clause_matches(clause: &str, entry: &Value) -> Option<bool> {
    if let Some(selector) = clause.strip_suffix(" is not empty") {
        return Some(!is_empty(select(entry, selector.trim())?));
    }
    if let Some(selector) = clause.strip_suffix(" is empty") {
        return Some(is_empty(select(entry, selector.trim())?));
    }
    for operator in [
        " == ",
        " != ",
        " not in ",
        " in ",
        " not contains ",
        " contains ",
    ] {
        let Some(parts) = split_outside_quotes(clause, operator) else {
            continue;
        };
        let [left, right] = parts[..] else {
            continue;
        };
        let (left, right) = (left.trim(), right.trim());
        return Some(match operator {
            " == " => as_text(select(entry, left)?) == literal(right)?,
            " != " => as_text(select(entry, left)?) != literal(right)?,
            " in " => holds(select(entry, right)?, &literal(left)?),
            " not in " => !holds(select(entry, right)?, &literal(left)?),
            " contains " => holds(select(entry, left)?, &literal(right)?),
            _ => !holds(select(entry, left)?, &literal(right)?),
        });
    }
    None
}

/// The value at a dotted path; a missing map key is null (so it equals nothing). Paths through
/// lists (`Checks.Status`) are outside the subset.
fn select<'a>(entry: &'a Value, selector: &str) -> Option<&'a Value> {
    let mut value = entry;
    for field in selector.split('.') {
        if field.is_empty() || value.is_array() {
            return None;
        }
        value = value.get(field).unwrap_or(&Value::Null);
    }
    Some(value)
}

fn literal(text: &str) -> Option<String> {
    let quoted = |open: char| text.strip_prefix(open).and_then(|t| t.strip_suffix(open));
    if let Some(inner) = quoted('"') {
        return Some(inner.replace("\\\"", "\"").replace("\\\\", "\\"));
    }
    if let Some(inner) = quoted('`') {
        return Some(inner.to_owned());
    }
    let bare = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    bare.then(|| text.to_owned())
}

fn as_text(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn holds(container: &Value, wanted: &str) -> bool {
    match container {
        Value::Array(items) => items.iter().any(|item| as_text(item) == wanted),
        Value::Object(map) => map.contains_key(wanted),
        Value::String(text) => text.contains(wanted),
        _ => false,
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Array(items) => items.is_empty(),
        Value::Object(map) => map.is_empty(),
        Value::String(text) => text.is_empty(),
        Value::Null => true,
        _ => false,
    }
}
