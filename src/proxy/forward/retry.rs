//! Attempts on picked targets: a failure may go to another target when its [`Retry`] allows
//! (see `failure`), within the service's `max_attempts`; the response-header timeout and the
//! stalled-upload rule bound each attempt.

use std::sync::atomic::Ordering;
use std::time::Duration;

use http::Response;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::rewrite::{h2_request, tls_request, Outgoing, PendingBody};
use super::Exchange;
use crate::balance::FailureCause;
use crate::clock::unix_ms;
use crate::model::{Id, MAX_ATTEMPTS};
use crate::proxy::accounting::{record_outcome, InFlight};
use crate::proxy::body::{ClientBody, StreamingBody, UpstreamBody, UpstreamRequestBody};
use crate::proxy::client::{send_tls, UpstreamClient, UpstreamError};
use crate::proxy::connector::UpstreamTlsError;
use crate::proxy::detach::FinishOnDrop;
use crate::proxy::error::ProxyError;
use crate::proxy::failure::{NoTarget, UpstreamFailure};
use crate::proxy::h1client::RequestHead;
use crate::proxy::ProxyState;
use crate::snapshot::{BackendRuntime, Preference, ServiceRuntime, TargetRuntime};

static GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// At most this many targets per request.
const ATTEMPTS_LIMIT: usize = MAX_ATTEMPTS as usize;

/// Sends the request to picked targets until one answers (with the answering target's id) or
/// the failure's [`Retry`] rule ends it: a connect failure may always go elsewhere (nothing
/// reached the upstream); another failure before a response (a response refused included) only
/// for idempotent methods whose body can still be sent in full; a response or send timeout
/// never (the time was spent).
///
/// [`Retry`]: crate::proxy::failure::Retry
pub(super) async fn send_with_retries(
    state: &ProxyState,
    backend: &BackendRuntime,
    mut outgoing: Outgoing,
    exchange: &mut Exchange,
    grpc: bool,
    attempt_timeout: Option<Duration>,
    preference: Preference,
) -> Result<(Response<UpstreamBody>, InFlight, Id), ProxyError> {
    let service: &ServiceRuntime = &backend.service;
    let started = Instant::now();
    let counters = &service.counters;
    let attempts = (service.service.max_attempts as usize).clamp(1, ATTEMPTS_LIMIT);
    // A route's per-attempt timeout shortens the service's, never lengthens it.
    let service_response_timeout =
        Duration::from_millis(service.service.timeouts.response_header_ms)
            .min(attempt_timeout.unwrap_or(Duration::MAX));
    let mut tried = Tried::default();
    // The client's gRPC deadline bounds the wait for an answer, and each attempt passes on
    // what is left of it.
    let grpc_deadline = grpc
        .then(|| outgoing.headers.get(&GRPC_TIMEOUT))
        .flatten()
        .and_then(crate::proxy::grpc::parse_timeout)
        .map(|timeout| (started + timeout, timeout));
    let mut last_failure = None;
    // A route holding its requests to `max_in_flight` counts the ones its clients abandon too.
    let counted_route = exchange
        .route
        .as_ref()
        .filter(|route| route.route.max_in_flight.is_some())
        .map(|route| route.stats.clone());

    for attempt in 1..=attempts {
        // A retry goes only to an available target: falling back to an ejected or unhealthy
        // one after a failure would add latency, not a chance of success.
        let first_attempt = attempt == 1;
        // Held to the end of the attempt, past its recorded outcome: a half-open trial must
        // not pass to the next request before its verdict.
        // A retry keeps the hash key's order (its next choice) but not the session's target,
        // which just failed it.
        let preference = Preference {
            pinned: preference.pinned.filter(|_| first_attempt),
            ..preference
        };
        let Some(pick) = service.pick_preferring(
            backend.subset.as_ref(),
            preference,
            |candidate| tried.contains(candidate.id),
            first_attempt,
        ) else {
            break;
        };
        let target = pick.target;
        tried.push(target.id);
        exchange.target = Some(target.authority.clone());
        if let Some(trace) = exchange.trace.as_deref_mut() {
            super::span::attempt_started(
                trace,
                &mut outgoing,
                target,
                scheme_name(service),
                last_failure.as_ref().map(UpstreamFailure::code),
            );
        }
        let in_flight = InFlight::start_within(service, target)
            .await
            .map_err(|reason| ProxyError::UpstreamOverloaded {
                service: service.service.name.clone(),
                reason,
            })?;
        let may_retry_later = attempt < attempts;
        let mut response_timeout = service_response_timeout;
        let mut deadline_binds = false;
        if let Some((deadline, timeout)) = grpc_deadline {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ProxyError::GrpcTimeout {
                    timeout_ms: timeout.as_millis() as u64,
                });
            }
            outgoing.headers.insert(
                GRPC_TIMEOUT.clone(),
                crate::proxy::grpc::encode_timeout(left),
            );
            if left < response_timeout {
                response_timeout = left;
                deadline_binds = true;
            }
        }
        let mut client =
            state
                .clients
                .for_target(service, target, outgoing.upgrade, outgoing.host_from_client);
        let mut fell_back = false;
        let (outcome, streaming) = loop {
            let (body, streaming) = take_body(&mut outgoing);
            let outcome = match &client {
                UpstreamClient::Plain(plain) => {
                    // Written straight from the request kept for retries: no copy of its fields.
                    let head = RequestHead {
                        method: &outgoing.method,
                        path_and_query: outgoing.path_and_query.as_str(),
                        headers: &outgoing.headers,
                        host: outgoing.host_from_target.then_some(&target.host_header),
                    };
                    let finish_if_abandoned = outgoing
                        .finish_if_abandoned
                        .then(|| in_flight.if_abandoned(counted_route.clone()));
                    let sending = async {
                        let response = plain.send(head, body, finish_if_abandoned).await?;
                        Ok::<_, UpstreamError>(response.map(UpstreamBody::Pooled))
                    };
                    await_response(sending, streaming.as_ref(), response_timeout).await
                }
                UpstreamClient::Tls(tls) => {
                    let request = tls_request(&mut outgoing, body, target, may_retry_later);
                    let finish_if_abandoned = outgoing.finish_if_abandoned;
                    let sending = async {
                        let exchange = send_tls(tls, request);
                        let response = if finish_if_abandoned {
                            let counts = in_flight.if_abandoned(counted_route.clone());
                            FinishOnDrop::new(exchange, None, counts).await?
                        } else {
                            exchange.await?
                        };
                        Ok::<_, UpstreamError>(response.map(UpstreamBody::Hyper))
                    };
                    await_response(sending, streaming.as_ref(), response_timeout).await
                }
                UpstreamClient::H2(h2) => {
                    // A client that goes away resets the upstream stream: on HTTP/2 that costs the
                    // target no connection, so nothing is left to finish on its own.
                    let scheme = match service.service.protocol {
                        crate::model::Protocol::Https => http::uri::Scheme::HTTPS,
                        _ => http::uri::Scheme::HTTP,
                    };
                    // An `https` target may turn out to choose HTTP/1.1: the request then goes on
                    // hyper's client, whole.
                    let keep = may_retry_later || scheme == http::uri::Scheme::HTTPS;
                    let request = h2_request(&mut outgoing, target, keep, scheme);
                    let sending = async {
                        let response = h2.send(request, body).await?;
                        Ok::<_, UpstreamError>(response.map(UpstreamBody::H2))
                    };
                    await_response(sending, streaming.as_ref(), response_timeout).await
                }
            };
            if let Ok(Err(UpstreamError::H2(error))) = &outcome {
                if error.alpn_chose_http1() && !fell_back {
                    // Nothing was sent: the same attempt goes over HTTP/1.1.
                    fell_back = true;
                    if let Some(streaming) = streaming {
                        outgoing.body = reclaim(streaming.returned);
                    }
                    client = state.clients.for_target(
                        service,
                        target,
                        outgoing.upgrade,
                        outgoing.host_from_client,
                    );
                    continue;
                }
            }
            break (outcome, streaming);
        };
        exchange.upstream_elapsed = Some(started.elapsed());
        if !deadline_binds
            && matches!(
                outcome,
                Err(NoResponse::HeadersLate)
                    | Err(NoResponse::BodyStalled {
                        client_stalled: false
                    })
            )
        {
            counters.timeouts.fetch_add(1, Ordering::Relaxed);
        }
        let failure = match outcome {
            Ok(Ok(response)) => {
                if let Some(trace) = exchange.trace.as_deref_mut() {
                    super::span::attempt_answered(trace, &response);
                }
                let status = response.status().as_u16();
                let failure = service
                    .service
                    .ejection
                    .failure_statuses
                    .contains(&status)
                    .then_some(FailureCause::Status(status))
                    .or_else(|| {
                        // A trailers-only gRPC answer carries its status in the head.
                        let unavailable = grpc
                            && crate::proxy::grpc::status_in(response.headers())
                                == Some(crate::proxy::grpc::UNAVAILABLE);
                        unavailable.then_some(FailureCause::GrpcUnavailable)
                    });
                record_outcome(service, target, failure);
                return Ok((response, in_flight, target.id));
            }
            Ok(Err(error)) => {
                if let Some(limit) = streaming
                    .as_ref()
                    .filter(|streaming| streaming.too_large.load(Ordering::Relaxed))
                    .and(outgoing.body_limit)
                {
                    return Err(ProxyError::BodyTooLarge { limit });
                }
                let client_failed = streaming
                    .as_ref()
                    .is_some_and(|streaming| streaming.failed.load(Ordering::Relaxed));
                if client_failed {
                    // The client's upload broke, not the target: no ejection, no retry.
                    return Err(ProxyError::ClientBody {
                        reason: error_chain(&error),
                    });
                }
                classify(service, target, &error)
            }
            // The client's own deadline passed: no fault of the target's, and no time left.
            Err(NoResponse::HeadersLate | NoResponse::BodyStalled { .. }) if deadline_binds => {
                drop(in_flight);
                return Err(ProxyError::GrpcTimeout {
                    timeout_ms: grpc_deadline.map_or(0, |(_, timeout)| timeout.as_millis() as u64),
                });
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
            }) => UpstreamFailure::send_timeout(service, target),
            Err(NoResponse::HeadersLate) => UpstreamFailure::response_timeout(service, target),
        };
        if let Some(trace) = exchange.trace.as_deref_mut() {
            trace.fail_attempt(failure.code());
        }
        // A target that declined the request (an HTTP/2 stream it never processed) is neither
        // failing nor proven well: its health is left as it is.
        if let Some(cause) = failure.ejection_cause() {
            record_outcome(service, target, Some(cause));
        }
        drop(in_flight);
        if let Some(streaming) = streaming {
            outgoing.body = reclaim(streaming.returned);
        }
        if failure.is_connect() {
            counters.connect_errors.fetch_add(1, Ordering::Relaxed);
        }
        let body_repeatable = !matches!(outgoing.body, PendingBody::Consumed);
        tracing::debug!(target = %target.authority, attempt, error = %failure, "upstream attempt failed");
        let retry_allowed = failure.retry().allows(&outgoing.method, body_repeatable);
        if failure.is_unprocessed() {
            // The target declined only this stream (it was going away, or full): another of
            // its connections may take it, so it stays a candidate for the next attempt.
            tried.forget(target.id);
        }
        last_failure = Some(failure);
        if !retry_allowed {
            break;
        }
    }
    Err(match last_failure {
        Some(failure) => ProxyError::Upstream(failure),
        None => ProxyError::NoTarget(NoTarget::of_backend(service, &backend.label)),
    })
}

/// The scheme a target of `service` is reached by, as a span's `url.full` names it.
fn scheme_name(service: &ServiceRuntime) -> &'static str {
    match service.service.protocol {
        crate::model::Protocol::Https => "https",
        _ => "http",
    }
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

/// Targets this request already tried, without allocating.
#[derive(Default)]
struct Tried {
    ids: [Id; ATTEMPTS_LIMIT],
    len: usize,
}

impl Tried {
    fn contains(&self, id: Id) -> bool {
        self.ids[..self.len].contains(&id)
    }

    fn forget(&mut self, id: Id) {
        if let Some(at) = self.ids[..self.len].iter().position(|tried| *tried == id) {
            self.ids.copy_within(at + 1..self.len, at);
            self.len -= 1;
        }
    }

    fn push(&mut self, id: Id) {
        if self.len < ATTEMPTS_LIMIT {
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
        PendingBody::Buffered(body) => {
            let upload = UpstreamRequestBody::buffered(&body);
            outgoing.body = PendingBody::Buffered(body);
            (upload, None)
        }
        PendingBody::Streaming(body) => {
            let (body, streaming) = UpstreamRequestBody::streaming(body);
            (body, Some(streaming))
        }
        PendingBody::Consumed => (UpstreamRequestBody::Empty, None),
    }
}

fn reclaim(mut returned: oneshot::Receiver<ClientBody>) -> PendingBody {
    match returned.try_recv() {
        Ok(body) => PendingBody::Streaming(body),
        Err(_) => PendingBody::Consumed,
    }
}

/// The failure one attempt's error means, made once, with its retry rule.
fn classify(
    service: &ServiceRuntime,
    target: &TargetRuntime,
    error: &UpstreamError,
) -> UpstreamFailure {
    if let Some(reason) = error.refused_response() {
        return UpstreamFailure::invalid_response(service, target, reason);
    }
    if let Some(reason) = error.unprocessed() {
        return UpstreamFailure::unprocessed(service, target, reason);
    }
    if !error.is_connect() {
        return UpstreamFailure::failed(service, target, error_chain(error));
    }
    if let Some(tls) = UpstreamTlsError::find_in(error) {
        return UpstreamFailure::tls_failed(service, target, tls.detail());
    }
    if let UpstreamError::H2(h2) = error {
        if let Some(detail) = h2.tls_failure() {
            return UpstreamFailure::tls_failed(service, target, detail.to_owned());
        }
    }
    let plain_timeout = match error {
        UpstreamError::Plain(plain) => plain.is_connect_timeout(),
        UpstreamError::H2(h2) => h2.is_connect_timeout(),
        _ => false,
    };
    if plain_timeout || is_timeout(error) {
        return UpstreamFailure::connect_timeout(service, target);
    }
    UpstreamFailure::connect_failed(service, target, error_chain(error))
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
