//! Attempts on picked targets, as the route's retry policy (`proxy::retry`) allows: retries
//! after failures and answers it names, within the service's retry budget, with a jittered
//! backoff between them, and hedged attempts; the per-try timeout and the stalled-upload rule
//! bound each attempt.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::Response;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::rewrite::{h2_request, tls_request, Outgoing, PendingBody};
use super::Exchange;
use crate::balance::FailureCause;
use crate::clock::unix_ms;
use crate::error_chain;
use crate::model::{Id, MAX_ATTEMPTS};
use crate::proxy::accounting::{record_outcome, InFlight};
use crate::proxy::body::{ClientBody, StreamingBody, UpstreamRequestBody};
use crate::proxy::client::{send_tls, UpstreamClient, UpstreamError};
use crate::proxy::connector::UpstreamTlsError;
use crate::proxy::detach::FinishOnDrop;
use crate::proxy::error::ProxyError;
use crate::proxy::failure::{NoTarget, UpstreamFailure};
use crate::proxy::h1client::RequestHead;
use crate::proxy::replay::KeepCopy;
use crate::proxy::response_body::UpstreamBody;
use crate::proxy::retry::{Resend, Retriable, RetryRule, IDEMPOTENCY_KEY};
use crate::proxy::ProxyState;
use crate::snapshot::{
    BackendRuntime, Pick, Preference, RetryReason, RouteStats, ServiceRuntime, TargetRuntime,
};

static GRPC_TIMEOUT: http::HeaderName = http::HeaderName::from_static("grpc-timeout");

/// At most this many targets per request.
const ATTEMPTS_LIMIT: usize = MAX_ATTEMPTS as usize;

/// How many times one attempt sends a request again that an `https` target's connection gave
/// back unwritten (see `UpstreamError::is_unsent`), before that counts as a failure to
/// connect: enough for the few idle connections a target may close at once, bounded for one
/// that closes every connection before taking a request.
const UNSENT_RESENDS: u8 = 3;

/// How each attempt of one request is bounded and sent.
struct Attempts<'a> {
    state: &'a ProxyState,
    service: &'a ServiceRuntime,
    grpc: bool,
    /// One attempt's wait for response headers.
    response_timeout: Duration,
    /// The longest pause of a streaming upload in which no byte moves: the service's and the
    /// route's attempt timeout, not the retry policy's per-try one, which is about answers.
    stall_timeout: Duration,
    /// The client's gRPC deadline and the timeout it came as.
    grpc_deadline: Option<(Instant, Duration)>,
    /// A route holding its requests to `max_in_flight` counts the ones its clients abandon too.
    counted_route: Option<Arc<RouteStats>>,
    /// The most of a streaming gRPC body kept while it goes, so a retry can send it again
    /// (the route's `request_buffer_bytes`); None: nothing is kept.
    keep_streamed: Option<u64>,
}

/// How one attempt ended, when it did not end the request.
enum AttemptEnd {
    Answered(Response<UpstreamBody>, InFlight),
    Failed(UpstreamFailure),
}

/// What the request path learns from sending: the answer, its place among the target's
/// requests, and which target gave it.
pub(super) type Sent = (Response<UpstreamBody>, InFlight, Id);

/// Sends the request to picked targets until one gives an answer to pass on, following the
/// route's retry policy (`proxy::retry`): a failure or an answer the policy names may be
/// followed by another attempt, preferably on a target not tried yet, after a jittered
/// backoff (or the target's `Retry-After`), while the service's retry budget allows it. An
/// answer kept from a retry (the budget spent, no attempts left, no target, or not safe to
/// repeat) goes to the client as it is.
#[allow(clippy::too_many_arguments)]
pub(super) async fn send_with_retries(
    state: &ProxyState,
    backend: &BackendRuntime,
    mut outgoing: Outgoing,
    exchange: &mut Exchange,
    grpc: bool,
    attempt_timeout: Option<Duration>,
    preference: Preference,
    rule: RetryRule<'_>,
) -> Result<Sent, ProxyError> {
    let service: &ServiceRuntime = &backend.service;
    let started = Instant::now();
    service.counters.retries.request(started);
    let idempotency_key = outgoing.headers.contains_key(&IDEMPOTENCY_KEY);
    let attempts = Attempts::new(
        state,
        service,
        &outgoing,
        exchange,
        grpc,
        attempt_timeout,
        &rule,
        started,
        idempotency_key,
    );
    let body_at_hand = matches!(outgoing.body, PendingBody::Empty | PendingBody::Buffered(_));
    if let Some(hedge_after) = rule
        .hedges(&resend(&outgoing, idempotency_key))
        .filter(|_| body_at_hand && !outgoing.upgrade)
    {
        return Box::pin(send_hedged(
            &attempts,
            backend,
            outgoing,
            exchange,
            preference,
            &rule,
            hedge_after,
        ))
        .await;
    }
    let mut tried = Tried::default();
    let mut last_failure: Option<UpstreamFailure> = None;
    // A pick is held from before its backoff to past its attempt's recorded outcome: a
    // half-open trial must not pass to another request before its verdict.
    let mut next = pick(backend, preference, &tried, true, false);
    let mut attempt = 0;
    while let Some(picked) = next.take() {
        attempt += 1;
        let target = picked.target;
        tried.push(target.id);
        exchange.target = Some(target.authority.clone());
        exchange.attempts = exchange.attempts.saturating_add(1);
        if let Some(trace) = exchange.trace.as_deref_mut() {
            super::span::attempt_started(
                trace,
                &mut outgoing,
                target,
                scheme_name(service),
                exchange.retried.map(RetryReason::name),
            );
        }
        let may_retry_later = attempt < rule.attempts;
        let end = attempts.send(target, &mut outgoing, may_retry_later).await;
        // The outcome is recorded: the trial (if it was one) is over.
        drop(picked);
        exchange.upstream_elapsed = Some(started.elapsed());
        let failure = match end? {
            AttemptEnd::Answered(response, in_flight) => {
                if let Some(trace) = exchange.trace.as_deref_mut() {
                    super::span::attempt_answered(trace, &response);
                }
                let retriable = rule
                    .after_answer(
                        response.status(),
                        response.headers(),
                        grpc,
                        &resend(&outgoing, idempotency_key),
                    )
                    .ok()
                    .filter(|_| may_retry_later);
                let retry = retriable.and_then(|retriable| {
                    let again = pick(backend, preference, &tried, false, true)?;
                    let delay = attempts.allow_retry(
                        &rule,
                        attempt,
                        retriable.retry_after,
                        retriable.reason,
                        exchange,
                    )?;
                    Some((again, delay))
                });
                let Some((again, delay)) = retry else {
                    return Ok((response, in_flight, target.id));
                };
                discard(response, in_flight);
                tokio::time::sleep(delay).await;
                next = Some(again);
                continue;
            }
            AttemptEnd::Failed(failure) => failure,
        };
        if let Some(trace) = exchange.trace.as_deref_mut() {
            trace.fail_attempt(failure.code());
        }
        tracing::debug!(target = %target.authority, attempt, error = %failure, "upstream attempt failed");
        if failure.is_unprocessed() {
            // The target declined only this stream (it was going away, or full): another of
            // its connections may take it, so it stays a candidate for the next attempt.
            tried.forget(target.id);
        }
        let reason = rule
            .after_failure(&failure, &resend(&outgoing, idempotency_key))
            .filter(|_| may_retry_later);
        last_failure = Some(failure);
        let retry = reason.and_then(|reason| {
            let again = pick(backend, preference, &tried, false, false)?;
            let delay = attempts.allow_retry(&rule, attempt, None, reason, exchange)?;
            Some((again, delay))
        });
        if let Some((again, delay)) = retry {
            tokio::time::sleep(delay).await;
            next = Some(again);
        }
    }
    Err(match last_failure {
        Some(failure) => ProxyError::Upstream(failure),
        None => ProxyError::NoTarget(NoTarget::of_backend(service, &backend.label)),
    })
}

/// An answer the policy retries is not read: one with a small body of known length is read to
/// its end on a task of its own, so its HTTP/1.1 connection goes back to the pool rather than
/// close (a retried 503 each time would otherwise cost a connection each time).
fn discard(response: Response<UpstreamBody>, in_flight: InFlight) {
    const SMALL: u64 = 64 * 1024;
    let small = http_body::Body::size_hint(response.body())
        .upper()
        .is_some_and(|upper| upper <= SMALL);
    if !small || http_body::Body::is_end_stream(response.body()) {
        return;
    }
    tokio::spawn(async move {
        super::mirror::drain(response.into_body(), Duration::from_secs(1)).await;
        drop(in_flight);
    });
}

/// An attempt of a hedged request: its own copy of the request on its way, its pick, and the
/// number of its span when the request is traced.
struct Running<'s, F> {
    attempt: Pin<Box<F>>,
    pick: Pick<'s>,
    span: Option<u32>,
}

/// Sends an idempotent request whose body is at hand, and when no answer came after
/// `hedge_after`, the same request to another target as well, within the budget and the
/// policy's attempts: the first answer to pass on wins, and dropping the other attempt cancels
/// it. Once no attempt runs, a failure (or an answer the policy names) is retried as without
/// hedging.
async fn send_hedged<'s>(
    attempts: &Attempts<'s>,
    backend: &'s BackendRuntime,
    outgoing: Outgoing,
    exchange: &mut Exchange,
    preference: Preference,
    rule: &RetryRule<'_>,
    hedge_after: Duration,
) -> Result<Sent, ProxyError> {
    let started = Instant::now();
    let counters = &attempts.service.counters.retries;
    let mut tried = Tried::default();
    let mut last_failure: Option<UpstreamFailure> = None;
    // An answer the policy would retry, kept while another attempt may still do better.
    let mut held: Option<(Response<UpstreamBody>, InFlight, Id, Retriable)> = None;
    let mut sent = 0;
    let mut running = [None, None];
    let mut next = launch(
        attempts, backend, &outgoing, exchange, preference, &tried, true, false, false,
    );
    while let Some(first) = next.take() {
        tried.push(first.pick.target.id);
        sent += 1;
        running[0] = Some(first);
        let mut hedge_at = Some(Instant::now() + hedge_after);
        while running.iter().any(Option::is_some) {
            let busy = running.iter().filter(|slot| slot.is_some()).count();
            let hedge = hedge_at.filter(|_| busy == 1 && sent < rule.attempts);
            let [one, two] = &mut running;
            let (slot, end) = tokio::select! {
                end = finish(one) => (0, end),
                end = finish(two) => (1, end),
                _ = sleep_until_some(hedge) => {
                    hedge_at = None;
                    let Some(hedged) = launch(attempts, backend, &outgoing, exchange, preference, &tried, false, false, true) else {
                        continue;
                    };
                    // Not started yet: refused by the budget, it is dropped unsent.
                    if !counters.try_spend(Instant::now(), &rule.budget) {
                        continue;
                    }
                    counters.hedges.fetch_add(1, Ordering::Relaxed);
                    exchange.hedged = true;
                    tried.push(hedged.pick.target.id);
                    sent += 1;
                    let free = running.iter_mut().find(|slot| slot.is_none());
                    *free.expect("a hedge starts beside one attempt") = Some(hedged);
                    continue;
                }
            };
            exchange.upstream_elapsed = Some(started.elapsed());
            let finished = running[slot]
                .take()
                .expect("a finished attempt was running");
            let target = finished.pick.target;
            let others_run = running.iter().any(Option::is_some);
            let end = match end {
                // A full target's queue refused this attempt; the other may still answer.
                Err(ProxyError::UpstreamOverloaded { .. }) if others_run => continue,
                end => end?,
            };
            match end {
                AttemptEnd::Answered(response, in_flight) => {
                    let retriable = rule.after_answer(
                        response.status(),
                        response.headers(),
                        attempts.grpc,
                        &resend(&outgoing, false),
                    );
                    let Ok(retriable) = retriable else {
                        // The winner: the attempt still running is dropped with `running`.
                        exchange.target = Some(target.authority.clone());
                        if let Some(trace) = exchange.trace.as_deref_mut() {
                            if let Some(number) = finished.span {
                                super::span::numbered_attempt_answered(trace, number, &response);
                            }
                            for loser in running.iter().flatten() {
                                if let Some(number) = loser.span {
                                    trace.fail_attempt_numbered(number, "cancelled");
                                }
                            }
                        }
                        return Ok((response, in_flight, target.id));
                    };
                    if let (Some(trace), Some(number)) =
                        (exchange.trace.as_deref_mut(), finished.span)
                    {
                        super::span::numbered_attempt_answered(trace, number, &response);
                    }
                    if let Some((response, in_flight, _, _)) = held.take() {
                        discard(response, in_flight);
                    }
                    held = Some((response, in_flight, target.id, retriable));
                }
                AttemptEnd::Failed(failure) => {
                    tracing::debug!(target = %target.authority, error = %failure, "upstream attempt failed");
                    if let (Some(trace), Some(number)) =
                        (exchange.trace.as_deref_mut(), finished.span)
                    {
                        trace.fail_attempt_numbered(number, failure.code());
                    }
                    if failure.is_unprocessed() {
                        tried.forget(target.id);
                    }
                    if held.is_none() {
                        exchange.target = Some(target.authority.clone());
                    }
                    last_failure = Some(failure);
                }
            }
        }
        // Nothing runs: retry what the policy names, after its wait, or pass on what came.
        let after_answer = held.is_some();
        let reason = match &held {
            Some((_, _, _, retriable)) => Some((retriable.reason, retriable.retry_after)),
            None => last_failure
                .as_ref()
                .and_then(|failure| rule.after_failure(failure, &resend(&outgoing, false)))
                .map(|reason| (reason, None)),
        };
        let retry = reason
            .filter(|_| sent < rule.attempts)
            .and_then(|(reason, retry_after)| {
                let again = launch(
                    attempts,
                    backend,
                    &outgoing,
                    exchange,
                    preference,
                    &tried,
                    false,
                    after_answer,
                    false,
                )?;
                let delay = attempts.allow_retry(rule, sent, retry_after, reason, exchange)?;
                Some((again, delay))
            });
        let Some((again, delay)) = retry else {
            break;
        };
        // A retry replaces the answer it follows, as without hedging.
        if let Some((response, in_flight, _, _)) = held.take() {
            discard(response, in_flight);
        }
        tokio::time::sleep(delay).await;
        next = Some(again);
    }
    if let Some((response, in_flight, target, _)) = held {
        return Ok((response, in_flight, target));
    }
    Err(match last_failure {
        Some(failure) => ProxyError::Upstream(failure),
        None => ProxyError::NoTarget(NoTarget::of_backend(attempts.service, &backend.label)),
    })
}

/// Picks a target for the next attempt of a hedged request and readies it on its own copy of
/// the request; it starts when first polled, so one dropped before is never sent.
#[allow(clippy::too_many_arguments)]
fn launch<'s>(
    attempts: &Attempts<'s>,
    backend: &'s BackendRuntime,
    outgoing: &Outgoing,
    exchange: &mut Exchange,
    preference: Preference,
    tried: &Tried,
    first_attempt: bool,
    again_after_answer: bool,
    hedge: bool,
) -> Option<Running<'s, impl std::future::Future<Output = Result<AttemptEnd, ProxyError>> + 's>> {
    let mut copy = outgoing.try_clone()?;
    let pick = pick(
        backend,
        preference,
        tried,
        first_attempt,
        again_after_answer,
    )?;
    let target = pick.target;
    exchange.target = Some(target.authority.clone());
    exchange.attempts = exchange.attempts.saturating_add(1);
    let span = exchange.trace.as_deref_mut().map(|trace| {
        let scheme = scheme_name(attempts.service);
        if hedge {
            super::span::hedge_started(trace, &mut copy, target, scheme)
        } else {
            let reason = exchange.retried.map(RetryReason::name);
            super::span::attempt_started(trace, &mut copy, target, scheme, reason);
            trace.next_attempt() - 1
        }
    });
    let sending = attempts.clone_for_hedge();
    let attempt = Box::pin(async move {
        let mut copy = copy;
        sending.send(target, &mut copy, true).await
    });
    Some(Running {
        attempt,
        pick,
        span,
    })
}

/// Waits for the attempt in `slot`, or forever when none runs there.
async fn finish<F: std::future::Future>(slot: &mut Option<Running<'_, F>>) -> F::Output {
    match slot {
        Some(running) => running.attempt.as_mut().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// The next attempt's target: an available one not tried yet, else, after an answer the
/// policy retries (`again_after_answer`), one tried already: a target that answered 503 a
/// backoff ago is alive and may answer otherwise now (a service of one target, restarting).
/// After a failure to connect or exchange, a tried target is not tried again.
fn pick<'s>(
    backend: &'s BackendRuntime,
    preference: Preference,
    tried: &Tried,
    first_attempt: bool,
    again_after_answer: bool,
) -> Option<Pick<'s>> {
    let service = &backend.service;
    // A retry keeps the hash key's order (its next choice) but not the session's target,
    // which just failed it.
    let preference = Preference {
        pinned: preference.pinned.filter(|_| first_attempt),
        ..preference
    };
    let subset = backend.subset.as_ref();
    // A retry goes only to an available target: falling back to an ejected or unhealthy one
    // after a failure would add latency, not a chance of success.
    service
        .pick_preferring(
            subset,
            preference,
            |candidate| tried.contains(candidate.id),
            first_attempt,
        )
        .or_else(|| {
            again_after_answer
                .then(|| service.pick_preferring(subset, preference, |_| false, false))
                .flatten()
        })
}

/// What decides whether the request can be sent again.
fn resend(outgoing: &Outgoing, idempotency_key: bool) -> Resend<'_> {
    Resend {
        method: &outgoing.method,
        body_repeatable: !matches!(outgoing.body, PendingBody::Consumed),
        idempotency_key,
    }
}

impl<'a> Attempts<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        state: &'a ProxyState,
        service: &'a ServiceRuntime,
        outgoing: &Outgoing,
        exchange: &Exchange,
        grpc: bool,
        attempt_timeout: Option<Duration>,
        rule: &RetryRule<'_>,
        started: Instant,
        idempotency_key: bool,
    ) -> Attempts<'a> {
        // A route's per-attempt timeouts shorten the service's, never lengthen it.
        let stall_timeout = Duration::from_millis(service.service.timeouts.response_header_ms)
            .min(attempt_timeout.unwrap_or(Duration::MAX));
        let response_timeout = stall_timeout.min(rule.per_try_timeout.unwrap_or(Duration::MAX));
        // The client's gRPC deadline bounds the wait for an answer, and each attempt passes on
        // what is left of it.
        let grpc_deadline = grpc
            .then(|| outgoing.headers.get(&GRPC_TIMEOUT))
            .flatten()
            .and_then(crate::proxy::grpc::parse_timeout)
            .map(|timeout| (started + timeout, timeout));
        let counted_route = exchange
            .route
            .as_ref()
            .filter(|route| route.route.max_in_flight.is_some())
            .map(|route| route.stats.clone());
        // gRPC bodies always stream (a call may stream both ways); a unary call's is small and
        // ends at once, so a copy kept as it goes lets the policy retry the call. A call is a
        // POST: only one with `Idempotency-Key` may be sent again once a target had it.
        let keep_streamed = exchange
            .route
            .as_ref()
            .map(|route| route.route.request_buffer_bytes)
            .filter(|cap| grpc && idempotency_key && *cap > 0 && rule.attempts > 1);
        Attempts {
            state,
            service,
            grpc,
            response_timeout,
            stall_timeout,
            grpc_deadline,
            counted_route,
            keep_streamed,
        }
    }

    /// A copy a hedged attempt's task can own.
    fn clone_for_hedge(&self) -> Attempts<'a> {
        Attempts {
            state: self.state,
            service: self.service,
            grpc: self.grpc,
            response_timeout: self.response_timeout,
            stall_timeout: self.stall_timeout,
            grpc_deadline: self.grpc_deadline,
            counted_route: self.counted_route.clone(),
            keep_streamed: self.keep_streamed,
        }
    }

    /// Whether retry number `retry` may go, and after how long: it must fit within the
    /// client's gRPC deadline and the service's budget. A retry allowed is counted.
    fn allow_retry(
        &self,
        rule: &RetryRule<'_>,
        retry: usize,
        retry_after: Option<Duration>,
        reason: RetryReason,
        exchange: &mut Exchange,
    ) -> Option<Duration> {
        let delay = rule.delay_before(retry as u32, retry_after);
        if let Some((deadline, _)) = self.grpc_deadline {
            if Instant::now() + delay >= deadline {
                return None;
            }
        }
        let counters = &self.service.counters.retries;
        if !counters.try_spend(Instant::now(), &rule.budget) {
            exchange.budget_exhausted = true;
            return None;
        }
        counters.sent(reason);
        exchange.retried = Some(reason);
        exchange.budget_exhausted = false;
        Some(delay)
    }

    /// One attempt on `target`: the request goes with what is left of the client's deadline,
    /// and its outcome counts toward the target's passive ejection. A failure gives a streaming
    /// body back to `outgoing` when the target did not read it.
    async fn send(
        &self,
        target: &TargetRuntime,
        outgoing: &mut Outgoing,
        may_retry_later: bool,
    ) -> Result<AttemptEnd, ProxyError> {
        let (state, service, grpc) = (self.state, self.service, self.grpc);
        let counters = &service.counters;
        let in_flight = InFlight::start_within(service, target)
            .await
            .map_err(|reason| ProxyError::UpstreamOverloaded {
                service: service.service.name.clone(),
                reason,
            })?;
        let mut response_timeout = self.response_timeout;
        let mut stall_timeout = self.stall_timeout;
        let mut deadline_binds = false;
        if let Some((deadline, timeout)) = self.grpc_deadline {
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
            stall_timeout = stall_timeout.min(left);
        }
        let counted_route = &self.counted_route;
        let mut client =
            state
                .clients
                .for_target(service, target, outgoing.upgrade, outgoing.host_from_client);
        let mut fell_back = false;
        let mut resent = 0;
        let (outcome, streaming) = loop {
            let keep = self
                .keep_streamed
                .filter(|_| may_retry_later)
                .map(|cap| KeepCopy {
                    cap,
                    budget: state.bodies.budget.clone(),
                });
            let (body, streaming) = take_body(outgoing, keep);
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
                        .then(|| in_flight.if_abandoned(counted_route.as_ref()));
                    let yield_first = outgoing.yield_first;
                    let sending = async {
                        if yield_first {
                            tokio::task::yield_now().await;
                        }
                        let response = plain.send(head, body, finish_if_abandoned).await?;
                        Ok::<_, UpstreamError>(response.map(UpstreamBody::Pooled))
                    };
                    await_response(sending, streaming.as_ref(), response_timeout, stall_timeout)
                        .await
                }
                UpstreamClient::Tls(tls) => {
                    let request = tls_request(outgoing, body, target);
                    let finish_if_abandoned = outgoing.finish_if_abandoned;
                    let yield_first = outgoing.yield_first;
                    let in_flight = &in_flight;
                    let sending = async move {
                        if yield_first {
                            tokio::task::yield_now().await;
                        }
                        let (exchange, sent) = send_tls(tls, request, finish_if_abandoned);
                        let response = match sent {
                            Some(sent) => {
                                let counts = in_flight.if_abandoned(counted_route.as_ref());
                                FinishOnDrop::new(exchange, move || sent.sent(), counts).await?
                            }
                            None => exchange.await?,
                        };
                        Ok::<_, UpstreamError>(response.map(UpstreamBody::Hyper))
                    };
                    await_response(sending, streaming.as_ref(), response_timeout, stall_timeout)
                        .await
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
                    let request = h2_request(outgoing, target, keep, scheme);
                    let sending = async {
                        let response = h2.send(request, body).await?;
                        Ok::<_, UpstreamError>(response.map(UpstreamBody::H2))
                    };
                    await_response(sending, streaming.as_ref(), response_timeout, stall_timeout)
                        .await
                }
            };
            if let Ok(Err(error)) = &outcome {
                if error.is_unsent() && resent < UNSENT_RESENDS {
                    // Its connection closed before taking it (an idle one the target ended
                    // meanwhile): nothing was sent, so the request goes again, whatever its
                    // method, on another connection to the same target.
                    resent += 1;
                    if let Some(streaming) = streaming {
                        outgoing.body = reclaim(streaming.returned);
                    }
                    continue;
                }
            }
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
                // A body sent whole and kept may go again if the policy retries this answer.
                if let Some(whole) = streaming.as_ref().and_then(StreamingBody::kept_whole) {
                    outgoing.body = PendingBody::Buffered(whole);
                }
                return Ok(AttemptEnd::Answered(response, in_flight));
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
                        reason: error_chain::text(&error),
                    });
                }
                classify(service, target, &error)
            }
            // The client's own deadline passed: no fault of the target's, and no time left.
            Err(NoResponse::HeadersLate | NoResponse::BodyStalled { .. }) if deadline_binds => {
                drop(in_flight);
                return Err(ProxyError::GrpcTimeout {
                    timeout_ms: self
                        .grpc_deadline
                        .map_or(0, |(_, timeout)| timeout.as_millis() as u64),
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
        // A target that declined the request (an HTTP/2 stream it never processed) is neither
        // failing nor proven well: its health is left as it is.
        if let Some(cause) = failure.ejection_cause() {
            record_outcome(service, target, Some(cause));
        }
        drop(in_flight);
        if let Some(streaming) = streaming {
            outgoing.body = match streaming.kept_whole() {
                Some(whole) => PendingBody::Buffered(whole),
                None => reclaim(streaming.returned),
            };
        }
        if failure.is_connect() {
            counters.connect_errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(AttemptEnd::Failed(failure))
    }
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
/// streams, `stall` bounds a pause in which no byte moves, so a hung upstream or a vanished
/// client cannot hold the request forever. An upstream may still answer early (e.g.
/// 413) while the body is streaming.
async fn await_response<F: std::future::Future>(
    response: F,
    body: Option<&StreamingBody>,
    timeout: Duration,
    stall: Duration,
) -> Result<F::Output, NoResponse> {
    tokio::pin!(response);
    if let Some(body) = body {
        let limit_ms = stall.as_millis() as u64;
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
/// it unread, or as the copy `keep` asks for when it was sent whole); an empty one can be sent
/// again.
fn take_body(
    outgoing: &mut Outgoing,
    keep: Option<KeepCopy>,
) -> (UpstreamRequestBody, Option<StreamingBody>) {
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
            let (body, streaming) = UpstreamRequestBody::streaming_kept(body, keep);
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
        return UpstreamFailure::failed(service, target, error_chain::text(error));
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
    UpstreamFailure::connect_failed(service, target, error_chain::text(error))
}

fn is_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    error_chain::causes(error).any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
    })
}
