//! Pooled keep-alive upstream connections, one pool per target, so a pool's lock is shared only
//! by the requests of one target, never by all requests.
//!
//! Plain `http` targets use our own HTTP/1.1 pool (`pool.rs`). `https` targets use hyper-util's
//! client, one per target: the request URI's authority is then free to carry the `Host` chosen
//! for the request, which HTTP/2 sends as `:authority`, while the connector dials the target. A
//! pool is keyed by everything its connections were made with, so a changed setting (address,
//! TLS, timeout) gets a new pool and old connections are not reused.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use foldhash::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::task::AtomicWaker;
use http::uri::Authority;
use http::{header, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::{capture_connection, CaptureConnection, Connect};
use hyper_util::client::legacy::{Client, ResponseFuture};
use hyper_util::rt::{TokioExecutor, TokioTimer};

use super::body::UpstreamRequestBody;
use super::connector::UpstreamTlsError;
use super::connector::{AlpnChoice, AlpnOffer, TlsTargetConnector};
use super::h1client::{MAX_INTERIM_RESPONSES, TRANSFER_CODING_REFUSED, UNASKED_SWITCH};
use super::h2client::{Dial, DialError, DialFuture, H2Error, H2Settings, H2Target, Transport};
use super::headers::is_chunked_alone;
use super::plain_target::{PlainTarget, PlainTargetError};
use crate::model::{Id, Protocol, Service};
use crate::snapshot::{ServiceRuntime, TargetRuntime};

pub type TlsClient = Client<TlsTargetConnector, UpstreamRequestBody>;

/// The client one attempt uses.
#[derive(Clone)]
pub enum UpstreamClient {
    Plain(Arc<PlainTarget>),
    Tls(Arc<TlsClient>),
    /// `h2c` targets: HTTP/2 with prior knowledge, multiplexed.
    H2(Arc<H2Target>),
}

/// Why one attempt got no response.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error(transparent)]
    Plain(#[from] PlainTargetError),
    #[error(transparent)]
    Tls(#[from] hyper_util::client::legacy::Error),
    #[error(transparent)]
    H2(#[from] H2Error),
    /// An `https` target's answer that the plain client would refuse too.
    #[error("{0}")]
    Refused(&'static str),
    /// An `https` target sent more interim answers than the plain client takes.
    #[error("more than {MAX_INTERIM_RESPONSES} interim (1xx) responses")]
    TooManyInterim,
}

impl UpstreamError {
    /// Nothing of the request reached the target.
    pub fn is_connect(&self) -> bool {
        match self {
            UpstreamError::Plain(error) => error.is_connect(),
            UpstreamError::Tls(error) => error.is_connect() || tls_unsent(error),
            UpstreamError::H2(error) => error.is_connect(),
            UpstreamError::Refused(_) | UpstreamError::TooManyInterim => false,
        }
    }

    /// An `https` request hyper-util gave back unwritten: the connection it was handed to
    /// (an idle pooled one, most often) closed before taking it. It may go again whatever its
    /// method; hyper-util's own resend is off (see [`build_client`]).
    pub fn is_unsent(&self) -> bool {
        match self {
            UpstreamError::Tls(error) => tls_unsent(error),
            _ => false,
        }
    }

    /// The target declined to process the request (an HTTP/2 stream refused or above a
    /// GOAWAY's last stream id): it may go elsewhere whatever its method.
    pub fn unprocessed(&self) -> Option<String> {
        match self {
            UpstreamError::H2(error) if error.is_unprocessed() => Some(error.to_string()),
            _ => None,
        }
    }

    /// Why the target's response was refused, when it sent one Raahi will not pass on rather
    /// than breaking the exchange: for `https` targets, also what hyper could not parse.
    pub fn refused_response(&self) -> Option<String> {
        match self {
            UpstreamError::Plain(error) => error.refused_response(),
            UpstreamError::H2(_) => None,
            UpstreamError::Refused(_) | UpstreamError::TooManyInterim => Some(self.to_string()),
            UpstreamError::Tls(error) => {
                let hyper = crate::error_chain::find::<hyper::Error>(error)?;
                hyper.is_parse().then(|| hyper.to_string())
            }
        }
    }
}

/// Whether hyper-util gave the request back unwritten. hyper cancels a request with its
/// message returned (and only then): the connection closed, or was not ready, before the
/// request was written; hyper-util then answers with its `Canceled` error over that cause.
fn tls_unsent(error: &hyper_util::client::legacy::Error) -> bool {
    // Only the direct cause: hyper-util puts the error of a request given back there.
    crate::error_chain::causes(error)
        .nth(1)
        .and_then(|cause| cause.downcast_ref::<hyper::Error>())
        .is_some_and(hyper::Error::is_canceled)
}

/// Sends one request to an `https` target, refusing what the plain client refuses beyond what
/// hyper does itself: a body framed by a transfer coding other than `chunked` alone (hyper
/// reads any), a `101` to a request that sent no `Upgrade`, and interim (1xx) answers past
/// [`MAX_INTERIM_RESPONSES`] (hyper skips them without limit, telling only a callback of each;
/// the exchange is dropped as soon as one too many comes). A refused answer's connection is
/// poisoned, so the pool never hands it out again. HTTP/2 connections never get here: the h2
/// crate refuses a `Transfer-Encoding` and skips interim answers, a `101` among them.
///
/// With `watch_sent`, also tells whether the request was handed to a connection yet (see
/// [`TlsSent`]).
pub fn send_tls(
    client: &TlsClient,
    mut request: Request<UpstreamRequestBody>,
    watch_sent: bool,
) -> (TlsExchange, Option<TlsSent>) {
    let method_is_head = request.method() == Method::HEAD;
    let upgrade_asked = request.headers().contains_key(header::UPGRADE);
    let interim = Arc::new(InterimCount::default());
    let counter = interim.clone();
    hyper::ext::on_informational(&mut request, move |_| counter.one_more());
    let connection = capture_connection(&mut request);
    let sent = watch_sent.then(|| TlsSent(connection.clone()));
    let exchange = TlsExchange {
        response: client.request(request),
        interim,
        connection,
        method_is_head,
        upgrade_asked,
    };
    (exchange, sent)
}

/// One exchange with an `https` target (see [`send_tls`]): hyper-util's future and what its
/// answer is checked against. A named `Unpin` future, so an exchange whose client left moves
/// to a task of its own without a box.
pub struct TlsExchange {
    response: ResponseFuture,
    interim: Arc<InterimCount>,
    connection: CaptureConnection,
    method_is_head: bool,
    upgrade_asked: bool,
}

impl Future for TlsExchange {
    type Output = Result<Response<Incoming>, UpstreamError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let refused = match Pin::new(&mut this.response).poll(cx) {
            Poll::Ready(response) => {
                let response = response?;
                // The final head may come in the same read as interim ones past the limit.
                if this.interim.exceeded() {
                    UpstreamError::TooManyInterim
                } else {
                    match refusal(&response, this.method_is_head, this.upgrade_asked) {
                        None => return Poll::Ready(Ok(response)),
                        Some(reason) => UpstreamError::Refused(reason),
                    }
                }
            }
            Poll::Pending => {
                // Registered before the count is read: one more interim answer wakes this.
                this.interim.waker.register(cx.waker());
                if !this.interim.exceeded() {
                    return Poll::Pending;
                }
                UpstreamError::TooManyInterim
            }
        };
        if let Some(connected) = this.connection.connection_metadata().as_ref() {
            if !connected.is_negotiated_h2() {
                connected.poison();
            }
        }
        Poll::Ready(Err(refused))
    }
}

/// Whether an `https` request was handed to its connection: hyper-util notes the connection
/// just before it passes the request on to be written. A request dropped before that was not
/// sent (nor is one whose connection had not taken it yet: hyper skips a cancelled request).
/// The noted connection is the only one the request may go on: hyper-util's resend on another
/// is off ([`build_client`]), so an exchange left to finish after this sends nothing new.
pub struct TlsSent(CaptureConnection);

impl TlsSent {
    pub fn sent(&self) -> bool {
        self.0.connection_metadata().is_some()
    }
}

/// Why hyper's answer must not be passed on, when it must not.
fn refusal(
    response: &Response<Incoming>,
    method_is_head: bool,
    upgrade_asked: bool,
) -> Option<&'static str> {
    let status = response.status();
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return (!upgrade_asked).then_some(UNASKED_SWITCH);
    }
    let bodiless =
        method_is_head || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    let coded = !bodiless
        && response.headers().contains_key(header::TRANSFER_ENCODING)
        && !is_chunked_alone(response.headers());
    coded.then_some(TRANSFER_CODING_REFUSED)
}

/// Interim answers to one request so far. They are told on the connection's task: the one
/// past the limit wakes the exchange's.
#[derive(Default)]
struct InterimCount {
    seen: AtomicUsize,
    waker: AtomicWaker,
}

impl InterimCount {
    fn one_more(&self) {
        if self.seen.fetch_add(1, Ordering::Relaxed) == MAX_INTERIM_RESPONSES {
            self.waker.wake();
        }
    }

    fn exceeded(&self) -> bool {
        self.seen.load(Ordering::Relaxed) > MAX_INTERIM_RESPONSES
    }
}

impl PlainTarget {
    fn matches(&self, service: &Service, target: &Authority) -> bool {
        *self.target() == *target
            && self.connect_timeout() == Duration::from_millis(service.timeouts.connect_ms)
            && self.idle_timeout() == Duration::from_millis(service.timeouts.idle_ms)
    }
}

/// What a target's TLS connections were made with; compared on each request (no hashing of the
/// CA bundle on the request path).
#[derive(Debug, Clone, PartialEq, Eq)]
struct TlsPoolSettings {
    target: Authority,
    server_name: String,
    verify: bool,
    ca_pem: Option<String>,
    connect_ms: u64,
    idle_ms: u64,
}

impl TlsPoolSettings {
    fn matches(&self, service: &Service, target: &Authority) -> bool {
        self.target == *target
            && self.verify == service.tls_verify
            && self.connect_ms == service.timeouts.connect_ms
            && self.idle_ms == service.timeouts.idle_ms
            && self.server_name == server_name(service, target)
            && self.ca_pem == service.tls_ca_pem
    }

    fn of(service: &Service, target: &Authority) -> TlsPoolSettings {
        TlsPoolSettings {
            target: target.clone(),
            server_name: server_name(service, target).to_string(),
            verify: service.tls_verify,
            ca_pem: service.tls_ca_pem.clone(),
            connect_ms: service.timeouts.connect_ms,
            idle_ms: service.timeouts.idle_ms,
        }
    }
}

fn server_name<'a>(service: &'a Service, target: &'a Authority) -> &'a str {
    crate::tls::upstream_server_name(
        service.tls_sni.as_deref(),
        service.upstream_authority.as_deref(),
        target,
    )
}

/// One target's TLS pools: the usual one, and one offering only HTTP/1.1 (made on first need)
/// for requests that switch protocols (an HTTP/2 connection cannot carry an HTTP/1.1 `Upgrade`)
/// or carry a client's own Host (see `forward::Outgoing::host_from_client`).
///
/// Requests that need no HTTP/1.1 go first to Raahi's own multiplexed HTTP/2 pool (`h2`), whose
/// connections offer both protocols too: while the target chooses `h2` they stay there; when a
/// connection chooses HTTP/1.1, the attempt goes on unsent over hyper's client, and so do later
/// requests until one of its connections chooses `h2` again.
struct TlsTargetPools {
    settings: TlsPoolSettings,
    config: Result<Arc<rustls::ClientConfig>, String>,
    main: Arc<TlsClient>,
    upgrade: OnceLock<Arc<TlsClient>>,
    /// What ALPN chose last on a connection offering both protocols (an [`AlpnChoice`]).
    chose_h2: Arc<AtomicU8>,
    h2: Arc<H2Target>,
}

impl TlsTargetPools {
    fn new(
        settings: TlsPoolSettings,
        h2_settings: H2Settings,
        counters: Arc<crate::snapshot::ServiceCounters>,
    ) -> TlsTargetPools {
        let config = crate::tls::client_config(settings.verify, settings.ca_pem.as_deref())
            .map_err(|error| error.to_string());
        let chose_h2 = Arc::new(AtomicU8::new(AlpnChoice::Unknown as u8));
        let main = Arc::new(build_client(
            tls_connector(&settings, &config, AlpnOffer::Http2AndHttp1)
                .telling_alpn(chose_h2.clone()),
            settings.idle_ms,
        ));
        let dial = TlsDial {
            connector: tls_connector(&settings, &config, AlpnOffer::Http2AndHttp1)
                .telling_alpn(chose_h2.clone()),
            timeout_ms: settings.connect_ms,
        };
        let h2 = Arc::new(H2Target::with_dial(
            settings.target.to_string(),
            Box::new(dial),
            h2_settings,
            counters,
        ));
        TlsTargetPools {
            settings,
            config,
            main,
            upgrade: OnceLock::new(),
            chose_h2,
            h2,
        }
    }

    fn http1_client(&self) -> Arc<TlsClient> {
        self.upgrade
            .get_or_init(|| {
                Arc::new(build_client(
                    tls_connector(&self.settings, &self.config, AlpnOffer::Http1Only),
                    self.settings.idle_ms,
                ))
            })
            .clone()
    }
}

/// Pools are created on first use and kept; the request path reads them lock-free.
#[derive(Default)]
pub struct UpstreamClients {
    // foldhash, not SipHash: looked up on every request, keyed by our own ids.
    plain: ArcSwap<HashMap<(Id, Id), Arc<PlainTarget>>>,
    tls: ArcSwap<HashMap<(Id, Id), Arc<TlsTargetPools>>>,
    h2: ArcSwap<HashMap<(Id, Id), Arc<H2Target>>>,
}

impl UpstreamClients {
    /// The client for one attempt at `target` of `service`. An `upgrade` must go over
    /// HTTP/1.1; so must a request with the client's own Host (`host_from_client`) on hyper's
    /// pool, which would keep an HTTP/2 connection per `:authority` (Raahi's own HTTP/2 pool
    /// sends any authority on its connections).
    pub fn for_target(
        &self,
        service: &ServiceRuntime,
        target: &TargetRuntime,
        upgrade: bool,
        host_from_client: bool,
    ) -> UpstreamClient {
        let settings = &service.service;
        let key = (settings.id, target.id);
        if settings.protocol == Protocol::H2c {
            return UpstreamClient::H2(match self.h2.load().get(&key) {
                Some(pool) if h2_matches(pool, settings, &target.authority) => pool.clone(),
                _ => self.new_h2_pool(key, service, &target.authority),
            });
        }
        if settings.protocol != Protocol::Https {
            return UpstreamClient::Plain(match self.plain.load().get(&key) {
                Some(pool) if pool.matches(settings, &target.authority) => pool.clone(),
                _ => self.new_plain_pool(key, service, &target.authority),
            });
        }
        let pools = match self.tls.load().get(&key) {
            Some(pools)
                if pools.settings.matches(settings, &target.authority)
                    && *pools.h2.settings() == h2_settings(settings) =>
            {
                pools.clone()
            }
            _ => self.new_tls_pools(key, service, &target.authority),
        };
        // Until a connection tells, the HTTP/2 pool dials and learns (falling back unsent).
        if !upgrade && pools.chose_h2.load(Ordering::Relaxed) != AlpnChoice::Http1 as u8 {
            return UpstreamClient::H2(pools.h2.clone());
        }
        UpstreamClient::Tls(if upgrade || host_from_client {
            pools.http1_client()
        } else {
            pools.main.clone()
        })
    }

    fn new_tls_pools(
        &self,
        key: (Id, Id),
        runtime: &ServiceRuntime,
        target: &Authority,
    ) -> Arc<TlsTargetPools> {
        let service = &runtime.service;
        let live_targets: HashSet<Id> = runtime.targets.iter().map(|target| target.id).collect();
        let created = Arc::new(TlsTargetPools::new(
            TlsPoolSettings::of(service, target),
            h2_settings(service),
            runtime.counters.clone(),
        ));
        let mut chosen = created.clone();
        self.tls.rcu(|current| {
            let mut next = HashMap::clone(current);
            // A miss is rare (first use, a changed setting, a new target): the moment to forget
            // the pools of this service's targets that are gone.
            next.retain(|(service_id, target_id), _| {
                *service_id != key.0 || live_targets.contains(target_id)
            });
            let entry = next.entry(key).or_insert_with(|| created.clone());
            if !entry.settings.matches(service, target)
                || *entry.h2.settings() != h2_settings(service)
            {
                *entry = created.clone();
            }
            chosen = entry.clone();
            next
        });
        chosen
    }

    fn new_plain_pool(
        &self,
        key: (Id, Id),
        runtime: &ServiceRuntime,
        target: &Authority,
    ) -> Arc<PlainTarget> {
        let service = &runtime.service;
        let live_targets: HashSet<Id> = runtime.targets.iter().map(|target| target.id).collect();
        let created = Arc::new(PlainTarget::new(
            target.clone(),
            Duration::from_millis(service.timeouts.connect_ms),
            Duration::from_millis(service.timeouts.idle_ms),
        ));
        let mut chosen = created.clone();
        self.plain.rcu(|current| {
            let mut next = HashMap::clone(current);
            // As for TLS pools: a miss is the moment to forget the pools of gone targets.
            next.retain(|(service_id, target_id), _| {
                *service_id != key.0 || live_targets.contains(target_id)
            });
            let entry = next.entry(key).or_insert_with(|| created.clone());
            if !entry.matches(service, target) {
                *entry = created.clone();
            }
            chosen = entry.clone();
            next
        });
        chosen
    }
}

impl UpstreamClients {
    fn new_h2_pool(
        &self,
        key: (Id, Id),
        runtime: &ServiceRuntime,
        target: &Authority,
    ) -> Arc<H2Target> {
        let service = &runtime.service;
        let live_targets: HashSet<Id> = runtime.targets.iter().map(|target| target.id).collect();
        let created = Arc::new(H2Target::new(
            target.to_string(),
            h2_settings(service),
            runtime.counters.clone(),
        ));
        let mut chosen = created.clone();
        self.h2.rcu(|current| {
            let mut next = HashMap::clone(current);
            // As for the other pools: a miss is the moment to forget the pools of gone targets.
            next.retain(|(service_id, target_id), _| {
                *service_id != key.0 || live_targets.contains(target_id)
            });
            let entry = next.entry(key).or_insert_with(|| created.clone());
            if !h2_matches(entry, service, target) {
                *entry = created.clone();
            }
            chosen = entry.clone();
            next
        });
        chosen
    }
}

fn h2_settings(service: &Service) -> H2Settings {
    H2Settings {
        connect_timeout: Duration::from_millis(service.timeouts.connect_ms),
        idle_timeout: Duration::from_millis(service.timeouts.idle_ms),
        keepalive: service.timeouts.keepalive_ms.map(Duration::from_millis),
        max_streams_per_connection: service.limits.max_streams_per_connection as usize,
        max_connections: service
            .limits
            .max_connections_per_target
            .map(|max| max as usize),
    }
}

fn h2_matches(pool: &H2Target, service: &Service, target: &Authority) -> bool {
    pool.address() == target.as_str() && *pool.settings() == h2_settings(service)
}

fn tls_connector(
    settings: &TlsPoolSettings,
    config: &Result<Arc<rustls::ClientConfig>, String>,
    alpn: AlpnOffer,
) -> TlsTargetConnector {
    TlsTargetConnector::new(
        settings.target.clone(),
        &settings.server_name,
        config.clone(),
        alpn,
        Duration::from_millis(settings.connect_ms),
    )
}

/// TLS connections for the HTTP/2 pool of an `https` target: usable only when ALPN chose `h2`.
struct TlsDial {
    connector: TlsTargetConnector,
    timeout_ms: u64,
}

impl Dial for TlsDial {
    fn dial(&self) -> DialFuture {
        let dialling = self.connector.clone().dial_tls();
        let timeout_ms = self.timeout_ms;
        Box::pin(async move {
            let stream = dialling.await.map_err(|error| {
                if let Some(tls) = UpstreamTlsError::find_in(error.as_ref()) {
                    return DialError::Tls {
                        detail: tls.detail(),
                    };
                }
                match error.downcast::<std::io::Error>() {
                    Ok(io) if io.kind() == std::io::ErrorKind::TimedOut => {
                        DialError::Timeout { timeout_ms }
                    }
                    Ok(io) => DialError::Connect(Arc::new(*io)),
                    Err(other) => DialError::Connect(Arc::new(std::io::Error::other(other))),
                }
            })?;
            if stream.get_ref().1.alpn_protocol() != Some(b"h2") {
                return Err(DialError::NotH2);
            }
            Ok(Box::new(stream) as Box<dyn Transport>)
        })
    }
}

/// hyper-util's resend of a request its pooled connection gave back unwritten is off: it
/// would go on another connection under the same [`TlsSent`], which would then tell "sent" of a
/// request still waiting for a dial. Raahi resends it itself, as a new exchange
/// (`forward::retry`).
fn build_client<C: Connect + Clone>(connector: C, idle_ms: u64) -> Client<C, UpstreamRequestBody> {
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_millis(idle_ms))
        .retry_canceled_requests(false)
        .build(connector)
}
