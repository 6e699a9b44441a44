//! One HTTP request: route, pick, forward, retry within bounds, answer.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{header, HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

use super::body::{
    InFlight, StreamingBody, UpstreamBody, UpstreamRequestBody, UpstreamResponseBody,
};
use super::client::{UpstreamClient, UpstreamError};
use super::connector::UpstreamTlsError;
use super::error::ProxyError;
use super::h1client::RequestHead;
use super::headers::{self, X_REQUEST_ID};
use super::ProxyState;
use crate::balance::{unix_ms, FailureCause};
use crate::model::Id;
use crate::snapshot::{RouteEntry, ServiceRuntime, TargetRuntime};

pub type ProxyBody = Either<UpstreamResponseBody, Full<Bytes>>;

/// Upper bound on attempts whatever a service asks for.
const MAX_ATTEMPTS: usize = 10;

/// The access log's tracing target: one line per request at INFO.
pub const ACCESS_LOG_TARGET: &str = "raahi::access";

/// What one request did, for the access log and metrics.
#[derive(Default)]
struct Exchange {
    route: Option<Arc<RouteEntry>>,
    /// The target of the last attempt.
    target: Option<Authority>,
    /// From the first attempt's start to the upstream's response headers (or the failure).
    upstream_elapsed: Option<Duration>,
}

/// The request line, kept only while the access log is on.
struct RequestLine {
    method: Method,
    host: String,
    path: String,
    version: Version,
}

pub async fn handle(
    state: &ProxyState,
    request: Request<Incoming>,
    downstream: &Downstream,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let request_id = headers::request_id(request.headers());
    let http1 = request.version() <= Version::HTTP_11;
    let request_line =
        tracing::enabled!(target: ACCESS_LOG_TARGET, tracing::Level::INFO).then(|| RequestLine {
            method: request.method().clone(),
            host: request_host(&request).into_owned(),
            path: request.uri().path().to_owned(),
            version: request.version(),
        });
    let mut exchange = Exchange::default();
    let mut response = match forward(state, request, downstream, &request_id, &mut exchange).await {
        Ok(response) => response,
        Err(error) => {
            // Upstream and gateway failures are what an operator must see; a client's own
            // mistakes (no route, a broken upload) only at debug level.
            match error.blame() {
                super::Blame::Client => {
                    tracing::debug!(request_id = ?request_id, code = error.code(), %error, "request failed")
                }
                super::Blame::Upstream | super::Blame::Gateway | super::Blame::Discovery => {
                    tracing::warn!(request_id = ?request_id, code = error.code(), %error, "request failed")
                }
            }
            error.to_response().map(Either::Right)
        }
    };
    let elapsed = started.elapsed();
    match &exchange.route {
        Some(route) => route.stats.record(response.status().as_u16(), elapsed),
        None => {
            state.counters.unrouted.fetch_add(1, Ordering::Relaxed);
        }
    }
    if let Some(line) = request_line {
        log_access(
            &line,
            &request_id,
            downstream.client,
            &exchange,
            &response,
            elapsed,
        );
    }
    response
        .headers_mut()
        .insert(X_REQUEST_ID.clone(), request_id);
    if http1 && state.draining() && response.status() != StatusCode::SWITCHING_PROTOCOLS {
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    response
}

fn log_access(
    line: &RequestLine,
    request_id: &HeaderValue,
    client: SocketAddr,
    exchange: &Exchange,
    response: &Response<ProxyBody>,
    elapsed: Duration,
) {
    let route = exchange.route.as_ref();
    let bytes = response
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    tracing::info!(
        target: ACCESS_LOG_TARGET,
        request_id = request_id.to_str().unwrap_or(""),
        client = %client.ip(),
        method = %line.method,
        host = %line.host,
        path = %line.path,
        protocol = ?line.version,
        route = route.map(|route| route.route.name.as_str()),
        service = route.map(|route| route.service.service.name.as_str()),
        target = exchange.target.as_ref().map(|target| target.as_str()),
        status = response.status().as_u16(),
        bytes,
        duration_ms = elapsed.as_secs_f64() * 1000.0,
        upstream_ms = exchange.upstream_elapsed.map(|upstream| upstream.as_secs_f64() * 1000.0),
    );
}

/// The host a request is for: lower case, without port.
fn request_host(request: &Request<Incoming>) -> Cow<'_, str> {
    let raw = request
        .uri()
        .authority()
        .map(|authority| authority.as_str())
        .or_else(|| {
            request
                .headers()
                .get(header::HOST)
                .and_then(|value| value.to_str().ok())
        })
        .unwrap_or("");
    let host = strip_port(raw);
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(host.to_ascii_lowercase())
    } else {
        Cow::Borrowed(host)
    }
}

fn strip_port(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        // IPv6 literal: keep the brackets off, as route hosts are written without them.
        return rest.split(']').next().unwrap_or(rest);
    }
    authority.split(':').next().unwrap_or(authority)
}

/// What the client sent, kept so the request can be sent again to another target.
struct Outgoing {
    method: Method,
    path_and_query: PathAndQuery,
    headers: HeaderMap,
    /// No Host was chosen for the whole request: each attempt sends its target's authority in
    /// place of the Host in `headers` (the client's, if it sent one).
    host_from_target: bool,
    /// The request switches protocols, so it must reach the upstream over HTTP/1.1.
    upgrade: bool,
    /// The Host is the client's (a route with `preserve_host`): unbounded values, so over TLS
    /// the request goes over HTTP/1.1 on the target's own pool rather than a pool (and an
    /// HTTP/2 connection for its `:authority`) per value a client chooses.
    host_from_client: bool,
    body: PendingBody,
}

impl Outgoing {
    /// The request must not ride an HTTP/2 connection keyed by its Host.
    fn http1_only(&self) -> bool {
        self.upgrade || self.host_from_client
    }
}

enum PendingBody {
    Empty,
    Streaming(Incoming),
    /// Sent (at least partly) to a target that then failed: the request cannot be repeated.
    Consumed,
}

async fn forward(
    state: &ProxyState,
    mut request: Request<Incoming>,
    downstream: &Downstream,
    request_id: &HeaderValue,
    exchange: &mut Exchange,
) -> Result<Response<ProxyBody>, ProxyError> {
    let route = {
        let snapshot = state.snapshots.load();
        let host = request_host(&request);
        let path = request.uri().path();
        snapshot
            .find_route(&host, path, request.method())
            .cloned()
            .ok_or_else(|| ProxyError::NoRoute {
                host: host.into_owned(),
                path: path.to_owned(),
            })?
    };
    let service = route.service.clone();
    exchange.route = Some(route.clone());

    let upgrade = headers::is_upgrade_request(request.version(), request.headers()).then(|| {
        let protocol = request.headers().get(header::UPGRADE).cloned();
        (hyper::upgrade::on(&mut request), protocol)
    });
    let outgoing = prepare(
        &route,
        &service,
        request,
        downstream,
        request_id,
        upgrade.as_ref().and_then(|(_, p)| p.clone()),
    );
    let (upstream, in_flight) = send_with_retries(state, &service, outgoing, exchange).await?;
    Ok(respond(
        upstream,
        in_flight,
        upgrade.map(|(on_upgrade, _)| on_upgrade),
        downstream,
    ))
}

/// The client connection a request came on, with what every request on it forwards about it,
/// worked out once per connection.
#[derive(Clone)]
pub struct Downstream {
    client: SocketAddr,
    /// The connection is TLS (the HTTPS listener).
    over_tls: bool,
    /// The client's address as an `X-Forwarded-For` entry.
    forwarded_for: HeaderValue,
    /// Where an upgraded exchange leaves its upstream side when the connection's own driver
    /// runs the tunnel (see `http1`); without it the tunnel runs on hyper's upgrade.
    upgrade_handoff: Option<Arc<UpgradeHandoff>>,
}

impl Downstream {
    pub fn new(client: SocketAddr, over_tls: bool) -> Downstream {
        Downstream {
            client,
            over_tls,
            forwarded_for: headers::forwarded_for(client.ip()),
            upgrade_handoff: None,
        }
    }

    pub fn with_upgrade_handoff(mut self, handoff: Arc<UpgradeHandoff>) -> Downstream {
        self.upgrade_handoff = Some(handoff);
        self
    }
}

/// The upstream side of an upgraded exchange, waiting for the client connection's driver to
/// get the client's socket back from hyper.
#[derive(Default)]
pub struct UpgradeHandoff {
    upstream: std::sync::Mutex<Option<(UpstreamUpgrade, InFlight)>>,
}

impl UpgradeHandoff {
    fn put(&self, upstream: UpstreamUpgrade, in_flight: InFlight) {
        if let Ok(mut slot) = self.upstream.lock() {
            *slot = Some((upstream, in_flight));
        }
    }

    pub fn take(&self) -> Option<(UpstreamUpgrade, InFlight)> {
        self.upstream.lock().ok()?.take()
    }
}

/// The upstream side of a switched protocol: hyper's upgrade still to complete (`https`
/// targets), or a plain target's connection with the bytes it already sent past the 101.
pub enum UpstreamUpgrade {
    Pending(OnUpgrade),
    Plain {
        stream: TcpStream,
        already_read: Bytes,
    },
}

fn prepare(
    route: &RouteEntry,
    service: &ServiceRuntime,
    request: Request<Incoming>,
    downstream: &Downstream,
    request_id: &HeaderValue,
    upgrade_protocol: Option<HeaderValue>,
) -> Outgoing {
    let (parts, body) = request.into_parts();
    let mut headers = parts.headers;
    // hyper sized the map for the client's fields: make room once for the ones added below
    // (X-Forwarded-*, Via, X-Request-Id, Host), rather than growing it field by field.
    headers.reserve(6);
    // The authority of an absolute-form or HTTP/2 request wins over a Host header (RFC 9112
    // §3.2.2), as it did for routing.
    let original_host = parts
        .uri
        .authority()
        .and_then(|authority| HeaderValue::from_str(authority.as_str()).ok())
        .or_else(|| headers.get(header::HOST).cloned());
    if parts.version == Version::HTTP_2 {
        join_cookies(&mut headers);
    }
    headers::strip_hop_by_hop(&mut headers);
    headers::add_forwarding_headers(
        &mut headers,
        &downstream.forwarded_for,
        downstream.over_tls,
        original_host.as_ref(),
        parts.version,
    );
    headers.insert(X_REQUEST_ID.clone(), request_id.clone());
    let upgrade = upgrade_protocol.is_some();
    if let Some(protocol) = upgrade_protocol {
        headers.insert(header::UPGRADE, protocol);
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    let (chosen_host, host_from_client) = match (route.route.preserve_host, &original_host) {
        (true, Some(host)) => (Some(host.clone()), true),
        _ => (service.upstream_host.clone(), false),
    };
    let host_from_target = chosen_host.is_none();
    // Without a chosen Host the client's stays in the map: each attempt replaces it with its
    // target's authority, so removing it here would only cost a hashed removal per request.
    if let Some(host) = chosen_host {
        headers.insert(header::HOST, host);
    }
    Outgoing {
        method: parts.method,
        path_and_query: upstream_path_and_query(route, &parts.uri),
        headers,
        host_from_target,
        upgrade,
        host_from_client,
        body: if http_body::Body::is_end_stream(&body) {
            PendingBody::Empty
        } else {
            PendingBody::Streaming(body)
        },
    }
}

/// HTTP/2 clients split `cookie` into several fields; an HTTP/1.1 upstream expects one, joined
/// with "; " (RFC 9113 §8.2.3).
fn join_cookies(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().nth(1).is_none() {
        return;
    }
    let joined = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .collect::<Vec<_>>()
        .join("; ");
    if let Ok(joined) = HeaderValue::from_str(&joined) {
        headers.insert(header::COOKIE, joined);
    }
}

fn upstream_path_and_query(route: &RouteEntry, uri: &Uri) -> PathAndQuery {
    let original = uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    if !route.route.strip_prefix {
        return original;
    }
    let path = route.upstream_path(original.path());
    let rewritten = match original.query() {
        Some(query) => format!("{path}?{query}"),
        None => path.into_owned(),
    };
    PathAndQuery::try_from(rewritten).unwrap_or(original)
}

fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Sends the request to picked targets until one answers or retrying is no longer allowed:
/// a connect failure may always go elsewhere (nothing reached the upstream); another failure
/// before a response only for idempotent methods whose body can still be sent in full.
async fn send_with_retries(
    state: &ProxyState,
    service: &ServiceRuntime,
    mut outgoing: Outgoing,
    exchange: &mut Exchange,
) -> Result<(Response<UpstreamBody>, InFlight), ProxyError> {
    let started = Instant::now();
    let counters = &service.counters;
    let attempts = (service.service.max_attempts as usize).clamp(1, MAX_ATTEMPTS);
    let response_timeout = Duration::from_millis(service.service.timeouts.response_header_ms);
    let mut tried = Tried::default();
    let mut last_error = None;

    for attempt in 1..=attempts {
        // A retry goes only to an available target: falling back to an ejected or unhealthy
        // one after a failure would add latency, not a chance of success.
        let first_attempt = attempt == 1;
        // Held to the end of the attempt, past its recorded outcome: a half-open trial must
        // not pass to the next request before its verdict.
        let Some(pick) = service.pick(|candidate| tried.contains(candidate.id), first_attempt)
        else {
            break;
        };
        let target = pick.target;
        tried.push(target.id);
        exchange.target = Some(target.authority.clone());
        let may_retry_later = attempt < attempts;
        let client = state
            .clients
            .for_target(service, target, outgoing.http1_only());
        let (body, streaming) = take_body(&mut outgoing);
        let in_flight = InFlight::start(&target.load);
        let outcome = match &client {
            UpstreamClient::Plain(pool) => {
                // Written straight from the request kept for retries: no copy of its fields.
                let head = RequestHead {
                    method: &outgoing.method,
                    path_and_query: outgoing.path_and_query.as_str(),
                    headers: &outgoing.headers,
                    host: outgoing.host_from_target.then_some(&target.host_header),
                };
                let sending = async {
                    let response = pool.send(head, body).await?;
                    Ok::<_, UpstreamError>(response.map(UpstreamBody::Pooled))
                };
                await_response(sending, streaming.as_ref(), response_timeout).await
            }
            UpstreamClient::Tls(tls) => {
                let request = tls_request(&mut outgoing, body, target, may_retry_later);
                let sending = async {
                    let response = tls.request(request).await?;
                    Ok::<_, UpstreamError>(response.map(UpstreamBody::Hyper))
                };
                await_response(sending, streaming.as_ref(), response_timeout).await
            }
        };
        exchange.upstream_elapsed = Some(started.elapsed());
        if matches!(
            outcome,
            Err(NoResponse::HeadersLate)
                | Err(NoResponse::BodyStalled {
                    client_stalled: false
                })
        ) {
            counters.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        let error = match outcome {
            Ok(Ok(response)) => {
                let status = response.status().as_u16();
                let failure = service
                    .service
                    .ejection
                    .failure_statuses
                    .contains(&status)
                    .then_some(FailureCause::Status(status));
                record_outcome(service, target, failure);
                return Ok((response, in_flight));
            }
            Ok(Err(error)) => {
                let client_failed = streaming
                    .as_ref()
                    .is_some_and(|streaming| streaming.failed.load(Ordering::Relaxed));
                if client_failed {
                    // The client's upload broke, not the target: no ejection, no retry.
                    return Err(ProxyError::ClientBody {
                        reason: error_chain(&error),
                    });
                }
                error
            }
            Err(NoResponse::BodyStalled {
                client_stalled: true,
            }) => {
                return Err(ProxyError::ClientBodyTimeout {
                    timeout_ms: service.service.timeouts.response_header_ms,
                });
            }
            Err(NoResponse::BodyStalled {
                client_stalled: false,
            }) => {
                record_outcome(service, target, Some(FailureCause::Timeout));
                return Err(ProxyError::UpstreamSendTimeout {
                    service: service.service.name.clone(),
                    target: target.authority.to_string(),
                    timeout_ms: service.service.timeouts.response_header_ms,
                });
            }
            Err(NoResponse::HeadersLate) => {
                record_outcome(service, target, Some(FailureCause::Timeout));
                return Err(ProxyError::ResponseTimeout {
                    service: service.service.name.clone(),
                    target: target.authority.to_string(),
                    timeout_ms: service.service.timeouts.response_header_ms,
                });
            }
        };
        record_outcome(service, target, Some(FailureCause::ConnectionError));
        drop(in_flight);
        if let Some(streaming) = streaming {
            outgoing.body = reclaim(streaming.returned);
        }
        let connect_failed = error.is_connect();
        if connect_failed {
            counters.connect_errors.fetch_add(1, Ordering::Relaxed);
        }
        let body_repeatable = !matches!(outgoing.body, PendingBody::Consumed);
        let failure = classify(service, target, &error);
        tracing::debug!(target = %target.authority, attempt, error = %failure, "upstream attempt failed");
        last_error = Some(failure);
        let retry_allowed = body_repeatable && (connect_failed || is_idempotent(&outgoing.method));
        if !retry_allowed {
            break;
        }
    }
    Err(last_error.unwrap_or_else(|| ProxyError::no_target(service)))
}

/// Why no response headers came in time.
enum NoResponse {
    /// Nothing moved for the whole timeout while the request body was streaming; true when the
    /// upstream was waiting for the client's bytes.
    BodyStalled { client_stalled: bool },
    /// The body was sent (or there was none) and the headers did not follow in time.
    HeadersLate,
}

/// Waits for the upstream's response headers. Their timeout starts once the request body has
/// been sent in full: a slow upload is the client's pace, not a slow upstream. While the body
/// streams, the same timeout bounds a pause in which no byte moves, so a hung upstream or a
/// vanished client cannot hold the request forever. An upstream may still answer early (e.g.
/// 413) while the body is streaming.
async fn await_response<F: std::future::Future>(
    response: F,
    body: Option<&StreamingBody>,
    timeout: Duration,
) -> Result<F::Output, NoResponse> {
    tokio::pin!(response);
    if let Some(body) = body {
        let limit_ms = timeout.as_millis() as u64;
        loop {
            let moved_ms = body.progress.last_moved_ms();
            let idle_ms = unix_ms().saturating_sub(moved_ms);
            let left = Duration::from_millis(limit_ms.saturating_sub(idle_ms));
            tokio::select! {
                biased;
                result = &mut response => return Ok(result),
                _ = body.sent.notified() => break,
                _ = tokio::time::sleep(left) => {
                    if body.progress.last_moved_ms() == moved_ms {
                        return Err(NoResponse::BodyStalled {
                            client_stalled: body.progress.waiting_on_client(),
                        });
                    }
                }
            }
        }
    }
    tokio::time::timeout(timeout, response)
        .await
        .map_err(|_| NoResponse::HeadersLate)
}

/// Feeds passive ejection: a failure (connect error, timeout, a failure status) may take the
/// target out; a success clears its record and ends a half-open trial by restoring the target.
pub(super) fn record_outcome(
    service: &ServiceRuntime,
    target: &TargetRuntime,
    failure: Option<FailureCause>,
) {
    let policy = &service.service.ejection;
    // With ejection turned off after a target was ejected, nothing would judge its trials and it
    // would stay half-open (one request at a time) for good: any outcome restores it instead,
    // once the ejection has run out.
    let Some(cause) = failure.filter(|_| policy.enabled) else {
        target.health.record_success(unix_ms);
        return;
    };
    let now = unix_ms();
    if !target.health.record_failure(now, policy) || !ejection_allowed(service, now) {
        return;
    }
    if let Some(until) = target.health.eject(now, policy, cause) {
        tracing::warn!(
            service = %service.service.name,
            target = %target.authority,
            ejected_for_ms = until.saturating_sub(now),
            "target ejected after failures"
        );
    }
}

/// `max_ejection_percent` of the service's targets may be out at once, and always at least one.
fn ejection_allowed(service: &ServiceRuntime, now: u64) -> bool {
    let percent = service.service.ejection.max_ejection_percent as usize;
    if percent == 0 {
        return false;
    }
    let allowed = (service.targets.len() * percent / 100).max(1);
    let ejected = service
        .targets
        .iter()
        .filter(|target| target.health.ejected_until(now).is_some())
        .count();
    ejected < allowed
}

/// Targets this request already tried, without allocating.
#[derive(Default)]
struct Tried {
    ids: [Id; MAX_ATTEMPTS],
    len: usize,
}

impl Tried {
    fn contains(&self, id: Id) -> bool {
        self.ids[..self.len].contains(&id)
    }

    fn push(&mut self, id: Id) {
        if self.len < MAX_ATTEMPTS {
            self.ids[self.len] = id;
            self.len += 1;
        }
    }
}

/// The body for one attempt: a streaming body goes to it (and comes back if the attempt drops
/// it unread); an empty one can be sent again.
fn take_body(outgoing: &mut Outgoing) -> (UpstreamRequestBody, Option<StreamingBody>) {
    match std::mem::replace(&mut outgoing.body, PendingBody::Consumed) {
        PendingBody::Empty => {
            outgoing.body = PendingBody::Empty;
            (UpstreamRequestBody::Empty, None)
        }
        PendingBody::Streaming(body) => {
            let (body, streaming) = UpstreamRequestBody::streaming(body);
            (body, Some(streaming))
        }
        PendingBody::Consumed => (UpstreamRequestBody::Empty, None),
    }
}

/// One attempt's request to an `https` target, for hyper-util's client. Headers are copied
/// only while another attempt may follow. The URI says `https`; the connector dials the target
/// whatever the URI names. The URI's authority keys the pool: when HTTP/2 may be used it is
/// the request's Host (sent as `:authority`; one of the service's few values), otherwise the
/// target's, and the upstream reads the Host header.
fn tls_request(
    outgoing: &mut Outgoing,
    body: UpstreamRequestBody,
    target: &TargetRuntime,
    may_retry_later: bool,
) -> Request<UpstreamRequestBody> {
    let headers = if may_retry_later {
        outgoing.headers.clone()
    } else {
        std::mem::take(&mut outgoing.headers)
    };
    let mut request = Request::new(body);
    *request.method_mut() = outgoing.method.clone();
    *request.version_mut() = Version::HTTP_11;
    *request.headers_mut() = headers;
    if outgoing.host_from_target {
        request
            .headers_mut()
            .insert(header::HOST, target.host_header.clone());
    }
    let host_authority = (!outgoing.http1_only())
        .then(|| request.headers().get(header::HOST))
        .flatten()
        .and_then(|host| Authority::try_from(host.as_bytes()).ok());
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(Scheme::HTTPS);
    uri.authority = Some(host_authority.unwrap_or_else(|| target.authority.clone()));
    uri.path_and_query = Some(outgoing.path_and_query.clone());
    *request.uri_mut() = Uri::from_parts(uri).expect("scheme, authority and path make a URI");
    request
}

fn reclaim(mut returned: oneshot::Receiver<Incoming>) -> PendingBody {
    match returned.try_recv() {
        Ok(body) => PendingBody::Streaming(body),
        Err(_) => PendingBody::Consumed,
    }
}

fn classify(service: &ServiceRuntime, target: &TargetRuntime, error: &UpstreamError) -> ProxyError {
    let reason = error_chain(error);
    if error.is_connect() {
        if let Some(tls) = UpstreamTlsError::find_in(error) {
            return ProxyError::UpstreamTlsFailed {
                service: service.service.name.clone(),
                target: target.authority.to_string(),
                reason: tls.detail(),
            };
        }
        let plain_timeout =
            matches!(error, UpstreamError::Plain(plain) if plain.is_connect_timeout());
        if plain_timeout || is_timeout(error) {
            return ProxyError::ConnectTimeout {
                service: service.service.name.clone(),
                target: target.authority.to_string(),
                timeout_ms: service.service.timeouts.connect_ms,
            };
        }
        return ProxyError::ConnectFailed {
            service: service.service.name.clone(),
            target: target.authority.to_string(),
            reason,
        };
    }
    ProxyError::UpstreamFailed {
        service: service.service.name.clone(),
        target: target.authority.to_string(),
        reason,
    }
}

fn is_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(error) = current {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
        }
        current = error.source();
    }
    false
}

fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut current = error.source();
    while let Some(source) = current {
        text.push_str(": ");
        text.push_str(&source.to_string());
        current = source.source();
    }
    text
}

fn respond(
    mut upstream: Response<UpstreamBody>,
    in_flight: InFlight,
    client_upgrade: Option<OnUpgrade>,
    downstream: &Downstream,
) -> Response<ProxyBody> {
    if upstream.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            let hyper_upgrade = matches!(upstream.body(), UpstreamBody::Hyper(_))
                .then(|| hyper::upgrade::on(&mut upstream));
            let (parts, body) = upstream.into_parts();
            let upstream_upgrade = match (hyper_upgrade, body) {
                (Some(pending), _) => Some(UpstreamUpgrade::Pending(pending)),
                (None, UpstreamBody::Pooled(body)) => {
                    body.into_upgraded()
                        .map(|(stream, already_read)| UpstreamUpgrade::Plain {
                            stream,
                            already_read,
                        })
                }
                (None, UpstreamBody::Hyper(_)) => None,
            };
            match (upstream_upgrade, &downstream.upgrade_handoff) {
                (Some(upstream_upgrade), Some(handoff)) => handoff.put(upstream_upgrade, in_flight),
                (Some(upstream_upgrade), None) => {
                    tokio::spawn(async move {
                        match client_upgrade.await {
                            Ok(client) => {
                                tunnel(TokioIo::new(client), upstream_upgrade, in_flight).await
                            }
                            Err(error) => tracing::debug!(%error, "protocol upgrade failed"),
                        }
                    });
                }
                // The request body was still going up when the target switched protocols:
                // its connection is no longer whole.
                (None, _) => tracing::warn!("the target switched protocols while the request body was still being sent; the upgrade is abandoned"),
            }
            let mut response = Response::from_parts(parts, Either::Right(Full::new(Bytes::new())));
            headers::add_via(response.headers_mut(), Version::HTTP_11);
            return response;
        }
    }
    let (mut parts, body) = upstream.into_parts();
    // A length beside a transfer coding is wrong, and the body was read by the coding; passed
    // on, the client's side would cut the body at that length (RFC 9112 §6.3 says remove it).
    if parts.headers.contains_key(header::TRANSFER_ENCODING) {
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    headers::strip_hop_by_hop(&mut parts.headers);
    headers::add_via(&mut parts.headers, parts.version);
    // The client connection keeps its own protocol whatever the upstream spoke.
    parts.version = Version::default();
    Response::from_parts(
        parts,
        Either::Left(UpstreamResponseBody::new(body, in_flight)),
    )
}

/// Copies bytes both ways between the upgraded client and upstream connections.
pub async fn tunnel<C>(mut client: C, upstream: UpstreamUpgrade, in_flight: InFlight)
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let copied = match upstream {
        UpstreamUpgrade::Pending(on_upgrade) => match on_upgrade.await {
            Ok(upgraded) => {
                tokio::io::copy_bidirectional(&mut client, &mut TokioIo::new(upgraded)).await
            }
            Err(error) => {
                tracing::debug!(%error, "protocol upgrade failed");
                return;
            }
        },
        UpstreamUpgrade::Plain {
            mut stream,
            already_read,
        } => match client.write_all(&already_read).await {
            Ok(()) => tokio::io::copy_bidirectional(&mut client, &mut stream).await,
            Err(error) => Err(error),
        },
    };
    if let Err(error) = copied {
        tracing::debug!(%error, "upgraded connection ended with an error");
    }
    drop(in_flight);
}
