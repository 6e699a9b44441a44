//! What a recorded request's spans say, in the OpenTelemetry HTTP semantic conventions: the
//! server span (the client's request to Raahi) and a client span per upstream attempt. Only
//! called for sampled requests; an unsampled one never reaches this file.

use http::{header, HeaderValue, Method, Request, Response, Version};
use opentelemetry::{KeyValue, Value};

use super::rewrite::Outgoing;
use super::Downstream;
use crate::proxy::body::BodyEnd;
use crate::proxy::connect_timing::ConnectTiming;
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
    trace.set_name(method_name(request.method()));
    trace.attribute(KeyValue::new(
        "http.request.method",
        method_name(request.method()),
    ));
    trace.attribute(KeyValue::new("url.path", owned(request.uri().path())));
    if let Some(query) = request.uri().query() {
        trace.attribute(KeyValue::new("url.query", owned(query)));
    }
    trace.attribute(KeyValue::new(
        "url.scheme",
        if downstream.over_tls { "https" } else { "http" },
    ));
    trace.attribute(KeyValue::new("server.address", owned(host)));
    trace.attribute(KeyValue::new(
        "client.address",
        downstream.client.ip().to_string(),
    ));
    trace.attribute(KeyValue::new(
        "network.protocol.version",
        protocol_version(request.version()),
    ));
    if let Some(agent) = header_text(request.headers().get(header::USER_AGENT)) {
        trace.attribute(KeyValue::new("user_agent.original", agent));
    }
    if let Some(id) = header_text(Some(request_id)) {
        trace.attribute(KeyValue::new("raahi.request_id", id));
    }
}

/// The route the request matched.
pub(super) fn routed(trace: &mut RequestTrace, method: &Method, route: &RouteEntry) {
    trace.set_name(format!("{} {}", method_name(method), route.route.name));
    trace.attribute(KeyValue::new("raahi.route", route.route.name.clone()));
}

/// The route's backend the request goes to (its label: the service's name, then a subset's
/// labels if any).
pub(super) fn backend_chosen(trace: &mut RequestTrace, backend: &str) {
    trace.attribute(KeyValue::new(
        "raahi.service",
        owned(backend.split('{').next().unwrap_or(backend)),
    ));
    trace.attribute(KeyValue::new("raahi.backend", owned(backend)));
}

/// Opens the client span of attempt `attempt` (1-based) on `target` and sets the next hop's
/// `traceparent` to it. A `tracestate` came with the caller's context and goes on with it; a
/// trace Raahi started has none.
pub(super) fn attempt_started(
    trace: &mut RequestTrace,
    outgoing: &mut Outgoing,
    target: &TargetRuntime,
    scheme: &'static str,
    attempt: usize,
    retry_reason: Option<&'static str>,
) {
    let traceparent = trace.start_attempt(method_name(&outgoing.method));
    outgoing.headers.insert(TRACEPARENT.clone(), traceparent);
    if !trace.continues_caller() {
        outgoing.headers.remove(&TRACESTATE);
    }
    trace.attempt_attribute(KeyValue::new(
        "http.request.method",
        method_name(&outgoing.method),
    ));
    trace.attempt_attribute(KeyValue::new(
        "server.address",
        owned(target.authority.host()),
    ));
    if let Some(port) = target.authority.port_u16() {
        trace.attempt_attribute(KeyValue::new("server.port", i64::from(port)));
    }
    trace.attempt_attribute(KeyValue::new(
        "url.full",
        format!("{scheme}://{}{}", target.authority, outgoing.path_and_query),
    ));
    trace.attempt_attribute(KeyValue::new("raahi.attempt", attempt as i64));
    if attempt > 1 {
        trace.attempt_attribute(KeyValue::new(
            "http.request.resend_count",
            (attempt - 1) as i64,
        ));
    }
    if let Some(reason) = retry_reason {
        trace.attempt_attribute(KeyValue::new("raahi.retry_reason", reason));
    }
}

/// The target answered the attempt (its span ends with the response body).
pub(super) fn attempt_answered<B>(trace: &mut RequestTrace, response: &Response<B>) {
    let status = response.status();
    trace.attempt_attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status.as_u16()),
    ));
    trace.attempt_attribute(KeyValue::new(
        "network.protocol.version",
        protocol_version(response.version()),
    ));
    if let Some(timing) = response.extensions().get::<ConnectTiming>() {
        trace.attempt_attribute(KeyValue::new(
            "raahi.upstream.connect_ms",
            timing.connect.as_secs_f64() * 1e3,
        ));
        if let Some(tls) = timing.tls {
            trace.attempt_attribute(KeyValue::new(
                "raahi.upstream.tls_ms",
                tls.as_secs_f64() * 1e3,
            ));
        }
    }
    // A client span's 4xx is an error too (the request did not get what it asked for).
    if status.is_client_error() || status.is_server_error() {
        trace.attempt_attribute(KeyValue::new("error.type", status.as_str().to_owned()));
        trace.fail_attempt(format!("HTTP {}", status.as_u16()));
    }
}

/// The attempt got no usable answer (`code` names why, as the error answers do).
pub(super) fn attempt_failed(trace: &mut RequestTrace, code: &'static str) {
    trace.attempt_attribute(KeyValue::new("error.type", code));
    trace.fail_attempt(code);
}

/// The answer's head as it goes to the client; `error` is Raahi's own failure code.
pub(super) fn answered<B>(
    trace: &mut RequestTrace,
    response: &Response<B>,
    error: Option<&'static str>,
) {
    let status = response.status();
    trace.attribute(KeyValue::new(
        "http.response.status_code",
        i64::from(status.as_u16()),
    ));
    if let Some(code) = error {
        trace.attribute(KeyValue::new("error.type", code));
    }
    // A server span's 4xx is the client's doing, not a failure of the hop.
    if status.is_server_error() {
        if error.is_none() {
            trace.attribute(KeyValue::new("error.type", status.as_str().to_owned()));
        }
        trace.fail(error.unwrap_or("server error"));
    }
}

/// The answer's body ended (or was cut short): the spans end and go to the exporter.
pub(super) fn finished(mut trace: Box<RequestTrace>, end: BodyEnd, grpc: bool) {
    trace.attribute(KeyValue::new("http.response.body.size", end.bytes as i64));
    if grpc {
        if let Some(status) = end.grpc_status {
            trace.attribute(KeyValue::new("rpc.system", "grpc"));
            trace.attribute(KeyValue::new("rpc.grpc.status_code", i64::from(status)));
        }
    }
    if !end.complete {
        trace.attribute(KeyValue::new("raahi.response_cut", true));
    }
    trace.finish();
}

fn method_name(method: &Method) -> &'static str {
    // The standard methods are static: no allocation for them.
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        Method::PATCH => "PATCH",
        Method::CONNECT => "CONNECT",
        Method::TRACE => "TRACE",
        // The conventions name any other method `_OTHER`, keeping span names bounded.
        _ => "_OTHER",
    }
}

fn protocol_version(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "0.9",
        Version::HTTP_10 => "1.0",
        Version::HTTP_11 => "1.1",
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        _ => "",
    }
}

fn owned(text: &str) -> Value {
    Value::from(text.to_owned())
}

fn header_text(value: Option<&HeaderValue>) -> Option<Value> {
    value
        .and_then(|value| value.to_str().ok())
        .map(|text| Value::from(text.to_owned()))
}
