//! What a recorded request's spans say: the facts of the server span (the client's request to
//! Raahi) and of a client span per upstream attempt, noted as the request goes. Only called for
//! sampled requests; `telemetry::trace` turns the facts into OTLP spans off the request path.

use std::sync::Arc;

use http::{header, HeaderValue, Request, Response};

use super::rewrite::Outgoing;
use super::Downstream;
use crate::proxy::connect_timing::ConnectTiming;
use crate::proxy::response_body::BodyEnd;
use crate::snapshot::{RouteEntry, TargetRuntime};
use crate::telemetry::trace::{RequestTrace, TRACEPARENT, TRACESTATE};

/// The request as it arrived.
pub(super) fn request_started<B>(
    trace: &mut RequestTrace,
    request: &Request<B>,
    host: &str,
    downstream: &Downstream,
    request_id: &HeaderValue,
) {
    let server = &mut trace.server;
    server.method = request.method().clone();
    server.path_and_query = request.uri().path_and_query().cloned();
    server.over_tls = downstream.over_tls;
    server.host = host.to_owned();
    server.client = Some(downstream.client.ip());
    server.version = request.version();
    server.user_agent = request.headers().get(header::USER_AGENT).cloned();
    server.request_id = Some(request_id.clone());
}

/// The route the request matched.
pub(super) fn routed(trace: &mut RequestTrace, route: &RouteEntry) {
    trace.server.route = Some(Arc::from(route.route.name.as_str()));
}

/// The route's backend the request goes to (its label: the service's name, then a subset's
/// labels if any).
pub(super) fn backend_chosen(trace: &mut RequestTrace, backend: &Arc<str>) {
    trace.server.backend = Some(backend.clone());
}

/// Opens the client span of the next attempt on `target` and sets the next hop's
/// `traceparent` to it. A `tracestate` came with the caller's context and goes on with it; a
/// trace Raahi started has none.
pub(super) fn attempt_started(
    trace: &mut RequestTrace,
    outgoing: &mut Outgoing,
    target: &TargetRuntime,
    scheme: &'static str,
    retry_reason: Option<&'static str>,
) {
    let traceparent = trace.start_attempt(
        outgoing.method.clone(),
        scheme,
        target.authority.clone(),
        outgoing.path_and_query.clone(),
        retry_reason,
    );
    outgoing.headers.insert(TRACEPARENT.clone(), traceparent);
    if !trace.continues_caller() {
        outgoing.headers.remove(&TRACESTATE);
    }
}

/// Opens the client span of a hedged attempt on `target`, beside the attempt still running,
/// and gives its number.
pub(super) fn hedge_started(
    trace: &mut RequestTrace,
    outgoing: &mut Outgoing,
    target: &TargetRuntime,
    scheme: &'static str,
) -> u32 {
    let number = trace.next_attempt();
    let traceparent = trace.start_hedge(
        outgoing.method.clone(),
        scheme,
        target.authority.clone(),
        outgoing.path_and_query.clone(),
    );
    outgoing.headers.insert(TRACEPARENT.clone(), traceparent);
    if !trace.continues_caller() {
        outgoing.headers.remove(&TRACESTATE);
    }
    number
}

/// The target answered the attempt (its span ends with the response body).
pub(super) fn attempt_answered<B>(trace: &mut RequestTrace, response: &Response<B>) {
    let number = trace.next_attempt() - 1;
    numbered_attempt_answered(trace, number, response);
}

/// The target answered attempt `number` (its span ends with the response body).
pub(super) fn numbered_attempt_answered<B>(
    trace: &mut RequestTrace,
    number: u32,
    response: &Response<B>,
) {
    let Some(attempt) = trace.attempt_numbered(number) else {
        return;
    };
    attempt.status = response.status().as_u16();
    attempt.version = Some(response.version());
    if let Some(timing) = response.extensions().get::<ConnectTiming>() {
        attempt.connect = Some(timing.connect);
    }
}

/// The answer's head as it goes to the client; `error` is Raahi's own failure code.
pub(super) fn answered<B>(
    trace: &mut RequestTrace,
    response: &Response<B>,
    error: Option<&'static str>,
    grpc: bool,
) {
    trace.server.status = response.status().as_u16();
    trace.server.error = error;
    trace.server.grpc = grpc;
}

/// The answer's body ended (or was cut short): the spans end and go to the exporter.
pub(super) fn finished(mut trace: Box<RequestTrace>, end: BodyEnd) {
    trace.server.body_bytes = end.bytes;
    trace.server.grpc_status = end.grpc_status;
    trace.server.cut = !end.complete;
    trace.finish();
}
