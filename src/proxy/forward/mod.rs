//! One HTTP request: route, pick, forward, retry within bounds, answer. The request's way
//! through, by file: this entry (route, answer, statistics), `rewrite` (what goes upstream),
//! `retry` (attempts on picked targets and the timeouts that bound them), `upgrade`
//! (switched protocols), `access_log`. Passive ejection is `accounting`'s, shared with L4.

mod access_log;
mod checks;
mod mirror;
mod request_body;
mod retry;
mod rewrite;
mod span;
mod upgrade;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{header, HeaderValue, Request, Response, StatusCode, Version};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use tokio::time::Instant;

use super::accounting::{Answering, InFlight, RouteSlot};
use super::canary::CanaryTally;
use super::error::ProxyError;
use super::failure::Blame;
use super::headers::{self, X_REQUEST_ID};
use super::response_body::{BodyEnd, UpstreamBody, UpstreamResponseBody};
use super::ProxyState;
use crate::snapshot::{RequestView, RouteEntry, Variables};
use crate::telemetry::trace::{RequestTrace, TraceParent};

pub use request_body::BodySettings;
pub use upgrade::{tunnel, UpgradeHandoff};

pub type ProxyBody = Either<UpstreamResponseBody, Full<Bytes>>;

/// A response body that holds `guard` for as long as hyper has it: until the answer is sent
/// or cut short.
pub struct GuardedBody<G> {
    inner: ProxyBody,
    _guard: G,
}

impl<G> GuardedBody<G> {
    pub fn new(inner: ProxyBody, guard: G) -> GuardedBody<G> {
        GuardedBody {
            inner,
            _guard: guard,
        }
    }
}

impl<G: Unpin> http_body::Body for GuardedBody<G> {
    type Data = Bytes;
    type Error = <ProxyBody as http_body::Body>::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// What one request did, for the access log and metrics.
#[derive(Default)]
pub(super) struct Exchange {
    pub route: Option<Arc<RouteEntry>>,
    /// The route's backend the request went to (its metrics label).
    pub backend: Option<Arc<str>>,
    /// Its position in the route's backends.
    pub backend_index: Option<usize>,
    /// The target of the last attempt.
    pub target: Option<Authority>,
    /// From the first attempt's start to the upstream's response headers (or the failure).
    pub upstream_elapsed: Option<Duration>,
    /// Attempts sent upstream, hedges included (0: none reached a target's pick).
    pub attempts: u8,
    /// Why the last retry was sent, when there was one.
    pub retried: Option<crate::snapshot::RetryReason>,
    /// A hedged attempt was sent.
    pub hedged: bool,
    /// The answer passed on is a failure the retry budget kept from being retried.
    pub budget_exhausted: bool,
    /// The request's spans, when it is recorded.
    pub trace: Option<Box<RequestTrace>>,
    /// The trace the request belongs to: the one it came with, or the one Raahi started.
    pub trace_id: Option<opentelemetry::trace::TraceId>,
}

/// Not an `async fn`: its parameters would be kept twice in the future (as arguments and as
/// the locals they are moved into), and the request's head alone is 264 bytes. The future is
/// moved whole into its box for every request.
#[allow(clippy::manual_async_fn)]
pub fn handle<'a>(
    state: &'a Arc<ProxyState>,
    request: Request<Incoming>,
    downstream: &'a Downstream,
) -> impl std::future::Future<Output = Response<ProxyBody>> + Send + 'a {
    async move {
        let started = Instant::now();
        let request_id = headers::request_id(request.headers());
        let grpc = super::grpc::is_grpc(request.headers());
        let http1 = request.version() <= Version::HTTP_11;
        let request_line =
            crate::telemetry::access::enabled().then(|| access_log::RequestLine::of(&request));
        let mut exchange = Exchange::default();
        if state.tracer.is_some() || request_line.is_some() {
            start_trace(state, &request, downstream, &request_id, &mut exchange);
        }
        let mut error_code = None;
        let mut response = match forward(
            state,
            request,
            downstream,
            &request_id,
            &mut exchange,
            grpc,
        )
        .await
        {
            Ok(response) => response,
            Err(error) => {
                error_code = Some(error.code());
                // Upstream and gateway failures are what an operator must see; a client's own
                // mistakes (no route, a broken upload) only at debug level.
                match error.blame() {
                    Blame::Client => {
                        tracing::debug!(request_id = ?request_id, code = error.code(), %error, "request failed")
                    }
                    Blame::Upstream | Blame::Gateway | Blame::Discovery => {
                        tracing::warn!(request_id = ?request_id, code = error.code(), %error, "request failed")
                    }
                }
                if let Some(refusal) = error.refusal() {
                    state.counters.requests_refused[refusal].fetch_add(1, Ordering::Relaxed);
                }
                let mut response = if grpc {
                    error.to_grpc_response(state.error_details)
                } else {
                    error.to_response(state.error_details)
                }
                .map(Either::Right);
                if http1 && error.ends_connection() {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                response
            }
        };
        let elapsed = started.elapsed();
        let mut canary = None;
        match &exchange.route {
            Some(route) => {
                let status = response.status().as_u16();
                route.stats.record(status, elapsed);
                canary = CanaryTally::of(route, exchange.backend_index, status, elapsed);
            }
            None => {
                state.counters.unrouted.fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut trace = exchange.trace.take();
        if let Some(trace) = trace.as_deref_mut() {
            span::answered(trace, &response, error_code, grpc);
        }
        let mut entry = request_line.map(|line| {
            access_log::Entry::new(
                line,
                &request_id,
                downstream.client,
                &exchange,
                &response,
                started,
                grpc,
            )
        });
        // A gRPC answer's line waits for its trailers' status; other lines are written now.
        if !grpc {
            if let Some(entry) = entry.take() {
                entry.write(None);
            }
        }
        // A gRPC answer's canary outcome waits for its trailers' status too.
        let canary_at_end = canary.take_if(|_| grpc);
        if let Some(canary) = canary {
            canary.count(None);
        }
        match response.body_mut() {
            Either::Left(body) if entry.is_some() || trace.is_some() || canary_at_end.is_some() => {
                body.at_end(Box::new(move |end| {
                    if let Some(entry) = entry {
                        entry.write(end.grpc_status);
                    }
                    if let Some(trace) = trace {
                        span::finished(trace, end);
                    }
                    if let Some(canary) = canary_at_end {
                        canary.count(end.grpc_status);
                    }
                }))
            }
            _ => {
                if let Some(canary) = canary_at_end {
                    canary.count(super::grpc::status_in(response.headers()));
                }
                if let Some(entry) = entry {
                    entry.write(None);
                }
                if let Some(trace) = trace {
                    span::finished(trace, BodyEnd::whole(&response));
                }
            }
        }
        // Never indexed in HPACK (HTTP/1.1 ignores the flag): a value unique to each response would
        // only churn the connection's dynamic table, evicting the entries that do repeat.
        let mut request_id = request_id;
        request_id.set_sensitive(true);
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
}

/// Reads the request's trace context and starts recording it when the tracer samples it; the
/// trace id goes to the access line either way.
fn start_trace(
    state: &ProxyState,
    request: &Request<Incoming>,
    downstream: &Downstream,
    request_id: &HeaderValue,
    exchange: &mut Exchange,
) {
    let trace_parent = TraceParent::of(request.headers());
    if let Some(tracer) = &state.tracer {
        exchange.trace = tracer.begin(trace_parent.as_ref());
        if let Some(trace) = exchange.trace.as_deref_mut() {
            let host = rewrite::request_host(request);
            span::request_started(trace, request, &host, downstream, request_id);
        }
    }
    exchange.trace_id = match &exchange.trace {
        Some(trace) => Some(trace.trace_id()),
        None => trace_parent.map(|parent| parent.trace_id),
    };
}

/// Not an `async fn`, for the reason [`handle`] gives.
#[allow(clippy::manual_async_fn)]
fn forward<'a>(
    state: &'a Arc<ProxyState>,
    mut request: Request<Incoming>,
    downstream: &'a Downstream,
    request_id: &'a HeaderValue,
    exchange: &'a mut Exchange,
    grpc: bool,
) -> impl std::future::Future<Output = Result<Response<ProxyBody>, ProxyError>> + Send + 'a {
    async move {
        checks::check_request(&request, &state.limits)?;
        let client_http1 = request.version() <= Version::HTTP_11;
        // Routed, and sent upstream, in its normal form: the target must serve what the route
        // was chosen for. The access log keeps what the client sent.
        rewrite::normalize_path(&mut request, state.limits.escaped_slashes)?;
        let preflight = super::cors::is_preflight(request.method(), request.headers());
        let route = find_route(state, &request, preflight)?;
        exchange.route = Some(route.clone());
        if let Some(trace) = exchange.trace.as_deref_mut() {
            span::routed(trace, &route);
        }
        if let Some(cors) = route.route.cors.as_ref().filter(|_| preflight) {
            return Ok(super::cors::preflight(cors, request.headers()).map(Either::Right));
        }
        let route_slot = admit(&route, &request, downstream)?;
        if let Some(redirect) = &route.route.redirect {
            route.stats.redirects.fetch_add(1, Ordering::Relaxed);
            let host = rewrite::request_host(&request);
            let requested = super::redirect::Requested {
                uri: request.uri(),
                host: &host,
                port: rewrite::request_port(&request),
                over_tls: downstream.over_tls,
            };
            return Ok(
                super::redirect::answer(redirect, &route.route, &requested).map(Either::Right)
            );
        }
        let pinned = super::affinity::pinned_backend(route.backends.list(), request.headers());
        let Some(backend) = pinned.or_else(|| route.backends.choose()) else {
            // Validation gives every route without a redirect a backend.
            return Err(ProxyError::NoRoute {
                host: rewrite::request_host(&request).into_owned(),
                path: request.uri().path().to_owned(),
            });
        };
        backend.requests.fetch_add(1, Ordering::Relaxed);
        let service = backend.service.clone();
        exchange.backend = Some(backend.label.clone());
        // Only a canary counts by backend position (a short search: backends are few).
        if route.canary.is_some() {
            exchange.backend_index = route
                .backends
                .list()
                .iter()
                .position(|listed| std::ptr::eq(listed, backend));
        }
        if let Some(trace) = exchange.trace.as_deref_mut() {
            span::backend_chosen(trace, &backend.label);
        }
        let origin = route
            .route
            .cors
            .as_ref()
            .and_then(|_| request.headers().get(header::ORIGIN).cloned());

        let affinity = super::affinity::Affinity::of(
            &service,
            &super::affinity::Asked {
                headers: request.headers(),
                query: request.uri().query(),
                client: downstream.client.ip(),
            },
        );
        let upgrade_asked = upgrade_passed(&mut request, &route);
        if upgrade_asked.is_some() && service.service.protocol == crate::model::Protocol::H2c {
            return Err(ProxyError::UpgradeNotSupported {
                service: service.service.name.clone(),
            });
        }
        let upgrade =
            upgrade_asked.map(|protocol| (hyper::upgrade::on(&mut request), Some(protocol)));
        let response_variables = route.response_headers().map(|_| {
            (
                rewrite::request_host(&request).into_owned(),
                downstream.client.ip(),
            )
        });
        let (parts, body) = request.into_parts();
        let body =
            request_body::read_request_body(body, &parts.headers, &route.route, &state.bodies)
                .await?;
        let outgoing = rewrite::prepare(
            &route,
            &service,
            parts,
            body,
            downstream,
            request_id,
            upgrade.as_ref().and_then(|(_, p)| p.clone()),
        );
        if route.mirror.is_some() && !outgoing.upgrade {
            mirror::maybe_copy(state, &route, &outgoing);
        }
        let timeouts = route.route.timeouts;
        let rule =
            super::retry::RetryRule::of(route.route.retry.as_ref(), service.service.max_attempts);
        let attempt_timeout = timeouts.backend_request_ms.map(Duration::from_millis);
        let (upstream, in_flight, target) = match timeouts.request_ms {
            None => {
                retry::send_with_retries(
                    state,
                    backend,
                    outgoing,
                    exchange,
                    grpc,
                    attempt_timeout,
                    affinity.preference,
                    rule,
                )
                .await?
            }
            // Boxed: the exchange's future is kilobytes, and a second copy of it inline (inside
            // the timeout) would grow every request's future, which is moved as a whole.
            Some(timeout_ms) => {
                let sending = Box::pin(retry::send_with_retries(
                    state,
                    backend,
                    outgoing,
                    exchange,
                    grpc,
                    attempt_timeout,
                    affinity.preference,
                    rule,
                ));
                tokio::time::timeout(Duration::from_millis(timeout_ms), sending)
                    .await
                    .map_err(|_| ProxyError::RequestTimeout {
                        route: route.route.name.clone(),
                        timeout_ms,
                    })??
            }
        };
        let mut response = respond(
            upstream,
            in_flight.holding(route_slot),
            Answering::new(service, target),
            upgrade.map(|(on_upgrade, _)| on_upgrade),
            downstream,
            client_http1,
            grpc,
        );
        if let (Some(filter), Some((host, client_ip))) =
            (route.response_headers(), &response_variables)
        {
            filter.apply(
                response.headers_mut(),
                &Variables {
                    client_ip: *client_ip,
                    request_id,
                    host,
                    scheme: if downstream.over_tls { "https" } else { "http" },
                },
            );
        }
        if let Some(cors) = &route.route.cors {
            super::cors::decorate(cors, origin.as_ref(), response.headers_mut());
        }
        affinity.answered(
            &backend.service,
            target,
            downstream.over_tls,
            response.headers_mut(),
        );
        Ok(response)
    }
}

/// Holds the request to its route's limits, before its body is read or a target picked: its
/// key's rate, then its place among the requests in flight.
fn admit(
    route: &RouteEntry,
    request: &Request<Incoming>,
    downstream: &Downstream,
) -> Result<Option<RouteSlot>, ProxyError> {
    let with_body = !http_body::Body::is_end_stream(request.body());
    if let Some(limiter) = &route.limiter {
        super::rate_limit::check(
            route,
            limiter,
            request.headers(),
            downstream.client.ip(),
            with_body,
        )?;
    }
    let Some(limit) = route.route.max_in_flight else {
        return Ok(None);
    };
    match RouteSlot::take(&route.stats, limit) {
        Some(slot) => Ok(Some(slot)),
        None => Err(ProxyError::TooManyRequests {
            route: route.route.name.clone(),
            limit,
            with_body,
        }),
    }
}

/// The route for `request`. A CORS preflight is matched by the method it asks about when the
/// route its own `OPTIONS` finds does not answer preflights.
fn find_route(
    state: &ProxyState,
    request: &Request<Incoming>,
    preflight: bool,
) -> Result<Arc<RouteEntry>, ProxyError> {
    let snapshot = state.snapshots.load();
    let host = rewrite::request_host(request);
    let path = request.uri().path();
    let view = |method| RequestView {
        method,
        headers: request.headers(),
        query: request.uri().query(),
    };
    let found = snapshot.find_route(&host, path, &view(request.method()));
    let found = match found {
        Some(route) if !preflight || route.route.cors.is_some() => Some(route),
        other if preflight => {
            let asked = super::cors::requested_method(request.headers());
            asked
                .as_ref()
                .and_then(|method| snapshot.find_route(&host, path, &view(method)))
                .filter(|route| route.route.cors.is_some())
                .or(other)
        }
        other => other,
    };
    found.cloned().ok_or_else(|| ProxyError::NoRoute {
        host: host.into_owned(),
        path: path.to_owned(),
    })
}

/// The `Upgrade` a request asks for when its route passes it. An upgrade the route does not
/// pass is not refused: the request goes up as a plain one (`Upgrade` is hop-by-hop), as a
/// server that ignores an upgrade answers (RFC 9110 §7.8), and h2c's settings go with it.
fn upgrade_passed<B>(request: &mut Request<B>, route: &RouteEntry) -> Option<HeaderValue> {
    if !headers::is_upgrade_request(request.version(), request.headers()) {
        return None;
    }
    let protocol = request.headers().get(header::UPGRADE)?;
    if headers::upgrade_allowed(protocol, &route.route.upgrades) {
        return Some(protocol.clone());
    }
    request.headers_mut().remove(&headers::HTTP2_SETTINGS);
    None
}

/// The client connection a request came on, with what every request on it forwards about it,
/// worked out once per connection.
#[derive(Clone)]
pub struct Downstream {
    pub(super) client: SocketAddr,
    /// The connection is TLS (the HTTPS listener).
    pub(super) over_tls: bool,
    /// The client's address as an `X-Forwarded-For` entry.
    pub(super) forwarded_for: HeaderValue,
    /// Where an upgraded exchange leaves its upstream side when the connection's own driver
    /// runs the tunnel (see `h1server`); without it the tunnel runs on hyper's upgrade.
    upgrade_handoff: Option<Arc<UpgradeHandoff>>,
    /// The connection's place under its listener's `max_connections`, held by a tunnel that
    /// runs on a task of its own.
    slot: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

impl Downstream {
    pub fn new(client: SocketAddr, over_tls: bool) -> Downstream {
        Downstream {
            client,
            over_tls,
            forwarded_for: headers::forwarded_for(client.ip()),
            upgrade_handoff: None,
            slot: None,
        }
    }

    pub fn holding_slot(mut self, slot: Arc<dyn std::any::Any + Send + Sync>) -> Downstream {
        self.slot = Some(slot);
        self
    }

    pub fn with_upgrade_handoff(mut self, handoff: Arc<UpgradeHandoff>) -> Downstream {
        self.upgrade_handoff = Some(handoff);
        self
    }
}

fn respond(
    upstream: Response<UpstreamBody>,
    in_flight: InFlight,
    answering: Answering,
    client_upgrade: Option<OnUpgrade>,
    downstream: &Downstream,
    client_http1: bool,
    grpc: bool,
) -> Response<ProxyBody> {
    if upstream.status() == StatusCode::SWITCHING_PROTOCOLS {
        if let Some(client_upgrade) = client_upgrade {
            return upgrade::switch_protocols(
                upstream,
                in_flight,
                client_upgrade,
                downstream.upgrade_handoff.as_ref(),
                downstream.slot.clone(),
            );
        }
    }
    if grpc && !super::grpc::is_grpc(upstream.headers()) {
        // A gRPC client reads an answer that is not gRPC as an opaque failure: tell it what
        // happened in its own terms (the target's body, an HTML or JSON page, is dropped).
        let status = upstream.status();
        let message = format!(
            "the target answered HTTP {} instead of gRPC",
            status.as_u16()
        );
        return super::grpc::trailers_only(super::grpc::status_for_http(status), &message)
            .map(Either::Right);
    }
    let (mut parts, body) = upstream.into_parts();
    // A length beside a transfer coding is wrong, and the body was read by the coding; passed
    // on, the client's side would cut the body at that length (RFC 9112 §6.3 says remove it).
    if parts.headers.contains_key(header::TRANSFER_ENCODING) {
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    // Only a body framed by chunks can carry trailers to an HTTP/1.1 client.
    let trailers_announced = (client_http1 && !parts.headers.contains_key(header::CONTENT_LENGTH))
        .then(|| headers::trailer_names(&parts.headers));
    headers::strip_hop_by_hop(&mut parts.headers);
    if let Some(announced) = trailers_announced {
        headers::announce_trailers(&mut parts.headers, announced);
    }
    headers::add_via(&mut parts.headers, parts.version);
    // The client connection keeps its own protocol whatever the upstream spoke.
    parts.version = Version::default();
    Response::from_parts(
        parts,
        Either::Left(UpstreamResponseBody::new(body, in_flight, answering, grpc)),
    )
}
