//! Recorded requests as an OTLP `ExportTraceServiceRequest`, in protobuf, written straight from
//! their facts. The OpenTelemetry SDK path (facts → `SpanData` → generated OTLP structs →
//! prost) cost about 40,000 instructions per request of two spans, as much again as the whole
//! proxied request: each nested message's length is recomputed at every level, and every
//! attribute is built, converted and grouped twice. This writes each field once, backfilling a
//! nested message's length when it closes. The field numbers are those of
//! `opentelemetry/proto/trace/v1/trace.proto`, `common/v1/common.proto` and
//! `collector/trace/v1/trace_service.proto`; the tests decode the output with the generated
//! types of `opentelemetry-proto`.

use std::fmt::Write as _;

use http::{Method, Version};

use super::record::{AttemptFacts, RequestTrace};

/// The exporting process, sent once per batch.
#[derive(Debug, Clone)]
pub struct ResourceInfo {
    pub service_name: String,
    pub service_version: &'static str,
    pub instance_id: Option<String>,
}

/// `Span.SpanKind`.
const KIND_SERVER: u64 = 2;
const KIND_CLIENT: u64 = 3;
/// `Status.StatusCode`.
const STATUS_ERROR: u64 = 2;
/// `SpanFlags`: the sampled trace flag, and whether the parent's remoteness is known and true.
const FLAG_SAMPLED: u32 = 0x01;
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LENGTH_DELIMITED: u32 = 2;
const FIXED32: u32 = 5;

/// A nested message's length is written as a varint of at most this many bytes (a batch is far
/// below 4 GiB); the room is reserved first and the content moved back if fewer were needed.
const LENGTH_ROOM: usize = 5;

/// Writes batches; keeps a scratch string between them.
#[derive(Default)]
pub struct Encoder {
    scratch: String,
}

impl Encoder {
    /// `traces` as one export request, appended to `out`; returns where the request starts in
    /// `out`. The batch's spans are written first, after room for the few bytes that wrap
    /// them; those are written last, right-aligned against the spans, so no byte of the batch
    /// is ever moved.
    pub fn encode(
        &mut self,
        out: &mut Vec<u8>,
        resource: &ResourceInfo,
        traces: &[Box<RequestTrace>],
    ) -> usize {
        // ResourceSpans.resource = Resource { attributes }, then ScopeSpans.scope =
        // InstrumentationScope { name, version }: small, and known before the spans.
        let mut resource_field = Vec::with_capacity(128);
        nested(&mut resource_field, 1, |out| {
            string_attribute(out, 1, "service.name", &resource.service_name);
            string_attribute(out, 1, "service.version", resource.service_version);
            if let Some(instance) = &resource.instance_id {
                string_attribute(out, 1, "service.instance.id", instance);
            }
        });
        let mut scope_field = Vec::with_capacity(32);
        nested(&mut scope_field, 1, |out| {
            string_field(out, 1, "raahi");
            string_field(out, 2, resource.service_version);
        });
        // Three keys and three lengths (each at most LENGTH_ROOM bytes) go before the spans.
        let room = resource_field.len() + scope_field.len() + 3 * (1 + LENGTH_ROOM);
        let base = out.len();
        out.resize(base + room, 0);
        let spans_at = out.len();
        for trace in traces {
            self.server_span(out, trace);
            for attempt in &trace.attempts {
                self.client_span(out, trace, attempt);
            }
        }
        let spans_length = out.len() - spans_at;
        let scope_spans_length = scope_field.len() + spans_length;
        let resource_spans_length = resource_field.len()
            + 1
            + varint_length(scope_spans_length as u64)
            + scope_spans_length;
        let mut prefix = Vec::with_capacity(room);
        // ExportTraceServiceRequest.resource_spans
        key(&mut prefix, 1, LENGTH_DELIMITED);
        varint(&mut prefix, resource_spans_length as u64);
        prefix.extend_from_slice(&resource_field);
        // ResourceSpans.scope_spans
        key(&mut prefix, 2, LENGTH_DELIMITED);
        varint(&mut prefix, scope_spans_length as u64);
        prefix.extend_from_slice(&scope_field);
        let start = spans_at - prefix.len();
        out[start..spans_at].copy_from_slice(&prefix);
        start
    }

    fn server_span(&mut self, out: &mut Vec<u8>, trace: &RequestTrace) {
        let facts = &trace.server;
        // ScopeSpans.spans
        nested(out, 2, |out| {
            let mut flags = FLAG_SAMPLED | FLAG_HAS_IS_REMOTE;
            let parent = trace.remote_parent.map(|parent| {
                flags |= FLAG_IS_REMOTE;
                parent.to_bytes()
            });
            span_head(
                out,
                SpanHead {
                    trace_id: &trace.trace_id.to_bytes(),
                    span_id: &trace.span_id.to_bytes(),
                    parent: parent.as_ref().map(|id| &id[..]),
                    flags,
                    kind: KIND_SERVER,
                    start_ns: trace.start_ns,
                    end_ns: trace.end_ns,
                },
            );
            let method = method_name(&facts.method);
            self.scratch.clear();
            self.scratch.push_str(method);
            if let Some(route) = &facts.route {
                self.scratch.push(' ');
                self.scratch.push_str(route);
            }
            string_field(out, 5, &self.scratch);

            string_attribute(out, 9, "http.request.method", method);
            if method == OTHER_METHOD {
                string_attribute(
                    out,
                    9,
                    "http.request.method_original",
                    facts.method.as_str(),
                );
            }
            if let Some(path) = &facts.path_and_query {
                string_attribute(out, 9, "url.path", path.path());
                if let Some(query) = path.query() {
                    string_attribute(out, 9, "url.query", query);
                }
            }
            string_attribute(
                out,
                9,
                "url.scheme",
                if facts.over_tls { "https" } else { "http" },
            );
            if !facts.host.is_empty() {
                string_attribute(out, 9, "server.address", &facts.host);
            }
            if let Some(client) = facts.client {
                self.scratch.clear();
                let _ = write!(self.scratch, "{client}");
                string_attribute(out, 9, "client.address", &self.scratch);
            }
            string_attribute(
                out,
                9,
                "network.protocol.version",
                protocol_version(facts.version),
            );
            if let Some(agent) = facts
                .user_agent
                .as_ref()
                .and_then(|value| value.to_str().ok())
            {
                string_attribute(out, 9, "user_agent.original", agent);
            }
            if let Some(id) = facts
                .request_id
                .as_ref()
                .and_then(|value| value.to_str().ok())
            {
                string_attribute(out, 9, "raahi.request_id", id);
            }
            if let Some(route) = &facts.route {
                string_attribute(out, 9, "raahi.route", route);
            }
            if let Some(backend) = &facts.backend {
                let service = backend.split('{').next().unwrap_or(backend);
                string_attribute(out, 9, "raahi.service", service);
                string_attribute(out, 9, "raahi.backend", backend);
            }
            if facts.status != 0 {
                int_attribute(out, 9, "http.response.status_code", i64::from(facts.status));
            }
            int_attribute(out, 9, "http.response.body.size", facts.body_bytes as i64);
            if facts.grpc {
                string_attribute(out, 9, "rpc.system", "grpc");
                if let Some(status) = facts.grpc_status {
                    int_attribute(out, 9, "rpc.grpc.status_code", i64::from(status));
                }
            }
            if facts.cut {
                bool_attribute(out, 9, "raahi.response_cut", true);
            }
            // A server span's 4xx is the client's doing, not a failure of the hop.
            let failed = facts.status >= 500;
            let error = facts.error.filter(|_| failed || facts.status == 0);
            match error {
                Some(code) => string_attribute(out, 9, "error.type", code),
                None if failed => {
                    self.scratch.clear();
                    let _ = write!(self.scratch, "{}", facts.status);
                    string_attribute(out, 9, "error.type", &self.scratch);
                }
                None => {}
            }
            if failed {
                error_status(out, error.unwrap_or("server error"));
            }
        });
    }

    fn client_span(&mut self, out: &mut Vec<u8>, trace: &RequestTrace, attempt: &AttemptFacts) {
        nested(out, 2, |out| {
            span_head(
                out,
                SpanHead {
                    trace_id: &trace.trace_id.to_bytes(),
                    span_id: &attempt.span_id.to_bytes(),
                    parent: Some(&trace.span_id.to_bytes()),
                    flags: FLAG_SAMPLED | FLAG_HAS_IS_REMOTE,
                    kind: KIND_CLIENT,
                    start_ns: attempt.start_ns,
                    end_ns: attempt.end_ns,
                },
            );
            let method = method_name(&attempt.method);
            string_field(out, 5, method);
            string_attribute(out, 9, "http.request.method", method);
            string_attribute(out, 9, "server.address", attempt.authority.host());
            if let Some(port) = attempt.authority.port_u16() {
                int_attribute(out, 9, "server.port", i64::from(port));
            }
            self.scratch.clear();
            let _ = write!(
                self.scratch,
                "{}://{}{}",
                attempt.scheme, attempt.authority, attempt.path_and_query
            );
            string_attribute(out, 9, "url.full", &self.scratch);
            int_attribute(out, 9, "raahi.attempt", i64::from(attempt.attempt));
            if attempt.attempt > 1 {
                int_attribute(
                    out,
                    9,
                    "http.request.resend_count",
                    i64::from(attempt.attempt - 1),
                );
            }
            if let Some(reason) = attempt.retry_reason {
                string_attribute(out, 9, "raahi.retry_reason", reason);
            }
            if attempt.status != 0 {
                int_attribute(
                    out,
                    9,
                    "http.response.status_code",
                    i64::from(attempt.status),
                );
            }
            if let Some(version) = attempt.version {
                string_attribute(
                    out,
                    9,
                    "network.protocol.version",
                    protocol_version(version),
                );
            }
            if let Some(connect) = attempt.connect {
                double_attribute(
                    out,
                    9,
                    "raahi.upstream.connect_ms",
                    connect.as_secs_f64() * 1e3,
                );
            }
            // A client span's 4xx is an error too: the request did not get what it asked for.
            let answered_badly = attempt.status >= 400;
            match attempt.error {
                Some(code) => {
                    string_attribute(out, 9, "error.type", code);
                    error_status(out, code);
                }
                None if answered_badly => {
                    self.scratch.clear();
                    let _ = write!(self.scratch, "{}", attempt.status);
                    string_attribute(out, 9, "error.type", &self.scratch);
                    error_status(out, &self.scratch);
                }
                None => {}
            }
        });
    }
}

struct SpanHead<'a> {
    trace_id: &'a [u8],
    span_id: &'a [u8],
    parent: Option<&'a [u8]>,
    flags: u32,
    kind: u64,
    start_ns: u64,
    end_ns: u64,
}

fn span_head(out: &mut Vec<u8>, head: SpanHead<'_>) {
    bytes_field(out, 1, head.trace_id);
    bytes_field(out, 2, head.span_id);
    if let Some(parent) = head.parent {
        bytes_field(out, 4, parent);
    }
    key(out, 6, VARINT);
    varint(out, head.kind);
    key(out, 7, FIXED64);
    out.extend_from_slice(&head.start_ns.to_le_bytes());
    key(out, 8, FIXED64);
    out.extend_from_slice(&head.end_ns.max(head.start_ns).to_le_bytes());
    key(out, 16, FIXED32);
    out.extend_from_slice(&head.flags.to_le_bytes());
}

/// `Span.status` = `Status { message, code: ERROR }`.
fn error_status(out: &mut Vec<u8>, message: &str) {
    nested(out, 15, |out| {
        string_field(out, 2, message);
        key(out, 3, VARINT);
        varint(out, STATUS_ERROR);
    });
}

const OTHER_METHOD: &str = "_OTHER";

/// The conventions' method names: the standard ones, `_OTHER` for the rest (span names stay
/// bounded).
fn method_name(method: &Method) -> &'static str {
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
        _ => OTHER_METHOD,
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

/// `KeyValue { key, value: AnyValue { … } }` as field `field`, where `value` is the AnyValue's
/// content (`value_length` bytes, written by `write_value`). Lengths are known up front: no
/// backfill.
fn attribute(
    out: &mut Vec<u8>,
    field: u32,
    name: &str,
    value_length: usize,
    write_value: impl FnOnce(&mut Vec<u8>),
) {
    let key_value_length = 1
        + varint_length(name.len() as u64)
        + name.len()
        + 1
        + varint_length(value_length as u64)
        + value_length;
    key(out, field, LENGTH_DELIMITED);
    varint(out, key_value_length as u64);
    string_field(out, 1, name);
    key(out, 2, LENGTH_DELIMITED);
    varint(out, value_length as u64);
    write_value(out);
}

fn string_attribute(out: &mut Vec<u8>, field: u32, name: &str, value: &str) {
    let length = 1 + varint_length(value.len() as u64) + value.len();
    attribute(out, field, name, length, |out| string_field(out, 1, value));
}

fn bool_attribute(out: &mut Vec<u8>, field: u32, name: &str, value: bool) {
    attribute(out, field, name, 2, |out| {
        key(out, 2, VARINT);
        varint(out, u64::from(value));
    });
}

fn int_attribute(out: &mut Vec<u8>, field: u32, name: &str, value: i64) {
    // int64 is written as its two's complement varint.
    let length = 1 + varint_length(value as u64);
    attribute(out, field, name, length, |out| {
        key(out, 3, VARINT);
        varint(out, value as u64);
    });
}

fn double_attribute(out: &mut Vec<u8>, field: u32, name: &str, value: f64) {
    attribute(out, field, name, 9, |out| {
        key(out, 4, FIXED64);
        out.extend_from_slice(&value.to_le_bytes());
    });
}

fn varint_length(value: u64) -> usize {
    (64 - (value | 1).leading_zeros() as usize).div_ceil(7)
}

fn string_field(out: &mut Vec<u8>, field: u32, value: &str) {
    bytes_field(out, field, value.as_bytes());
}

fn bytes_field(out: &mut Vec<u8>, field: u32, value: &[u8]) {
    key(out, field, LENGTH_DELIMITED);
    varint(out, value.len() as u64);
    out.extend_from_slice(value);
}

/// A length-delimited field whose content `write` appends; its length is backfilled.
fn nested(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    key(out, field, LENGTH_DELIMITED);
    let length_at = out.len();
    out.extend_from_slice(&[0; LENGTH_ROOM]);
    let content_at = out.len();
    write(out);
    let length = out.len() - content_at;
    let mut encoded = [0u8; LENGTH_ROOM];
    let used = varint_into(&mut encoded, length as u64);
    out[length_at..length_at + used].copy_from_slice(&encoded[..used]);
    if used < LENGTH_ROOM {
        out.copy_within(content_at.., length_at + used);
        out.truncate(out.len() - (LENGTH_ROOM - used));
    }
}

fn key(out: &mut Vec<u8>, field: u32, wire_type: u32) {
    varint(out, u64::from((field << 3) | wire_type));
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn varint_into(out: &mut [u8; LENGTH_ROOM], mut value: u64) -> usize {
    let mut used = 0;
    while value >= 0x80 {
        out[used] = (value as u8) | 0x80;
        value >>= 7;
        used += 1;
    }
    out[used] = value as u8;
    used + 1
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::trace::{Shared, TraceCounters};
    use opentelemetry::trace::{SpanId, TraceId};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::tonic::common::v1::any_value::Value;
    use prost::Message;
    use std::sync::Arc;
    use std::time::Duration;

    fn attribute<'s>(
        span: &'s opentelemetry_proto::tonic::trace::v1::Span,
        name: &str,
    ) -> Option<&'s Value> {
        span.attributes
            .iter()
            .find(|pair| pair.key == name)
            .and_then(|pair| pair.value.as_ref())
            .and_then(|value| value.value.as_ref())
    }

    fn recorded(remote_parent: Option<SpanId>) -> Box<RequestTrace> {
        let (queue, _waiting) = tokio::sync::mpsc::channel(1);
        let shared = Arc::new(Shared {
            queue,
            counters: Arc::new(TraceCounters::default()),
        });
        let mut trace = RequestTrace::new(shared, TraceId::from(0xabcd_u128), remote_parent);
        trace.server.method = Method::POST;
        trace.server.path_and_query = Some("/orders?x=1".parse().unwrap());
        trace.server.host = "shop.example".to_owned();
        trace.server.client = Some("10.1.2.3".parse().unwrap());
        trace.server.route = Some("orders".into());
        trace.server.backend = Some("api{zone=a}".into());
        trace.server.status = 503;
        trace.server.error = Some("upstream_connect_failed");
        trace.server.body_bytes = 1234;
        trace.start_attempt(
            Method::POST,
            "http",
            "10.0.0.1:8080".parse().unwrap(),
            "/orders?x=1".parse().unwrap(),
            None,
        );
        trace.fail_attempt("upstream_connect_failed");
        trace.start_attempt(
            Method::POST,
            "http",
            "10.0.0.2:8080".parse().unwrap(),
            "/orders?x=1".parse().unwrap(),
            Some("upstream_connect_failed"),
        );
        let attempt = trace.attempt().unwrap();
        attempt.status = 200;
        attempt.connect = Some(Duration::from_micros(1500));
        trace.end_ns = trace.start_ns + 5_000;
        trace
    }

    #[test]
    fn the_official_types_decode_what_is_written() {
        let caller = SpanId::from(0x00f0_67aa_0ba9_02b7_u64);
        let traces = vec![recorded(Some(caller)), recorded(None)];
        let resource = ResourceInfo {
            service_name: "edge".to_owned(),
            service_version: "1.2.3",
            instance_id: Some("raahi-1".to_owned()),
        };
        let mut out = vec![0xee; 3];
        let start = Encoder::default().encode(&mut out, &resource, &traces);
        assert!(start >= 3, "what was in the buffer stays");
        let decoded = ExportTraceServiceRequest::decode(&out[start..]).expect("valid protobuf");

        let [resource_spans] = &decoded.resource_spans[..] else {
            panic!("one resource: {decoded:?}");
        };
        let resource_attributes = &resource_spans.resource.as_ref().unwrap().attributes;
        assert_eq!(resource_attributes.len(), 3);
        assert_eq!(resource_attributes[0].key, "service.name");
        let scope_spans = &resource_spans.scope_spans[0];
        assert_eq!(scope_spans.scope.as_ref().unwrap().name, "raahi");
        let spans = &scope_spans.spans;
        assert_eq!(spans.len(), 6);

        let server = &spans[0];
        assert_eq!(server.name, "POST orders");
        assert_eq!(server.kind, KIND_SERVER as i32);
        assert_eq!(server.trace_id, TraceId::from(0xabcd_u128).to_bytes());
        assert_eq!(server.parent_span_id, caller.to_bytes());
        assert_eq!(
            server.flags,
            FLAG_SAMPLED | FLAG_HAS_IS_REMOTE | FLAG_IS_REMOTE
        );
        assert_eq!(
            server.end_time_unix_nano - server.start_time_unix_nano,
            5_000
        );
        assert_eq!(
            attribute(server, "url.path"),
            Some(&Value::StringValue("/orders".into()))
        );
        assert_eq!(
            attribute(server, "url.query"),
            Some(&Value::StringValue("x=1".into()))
        );
        assert_eq!(
            attribute(server, "client.address"),
            Some(&Value::StringValue("10.1.2.3".into()))
        );
        assert_eq!(
            attribute(server, "raahi.service"),
            Some(&Value::StringValue("api".into()))
        );
        assert_eq!(
            attribute(server, "http.response.status_code"),
            Some(&Value::IntValue(503))
        );
        assert_eq!(
            attribute(server, "http.response.body.size"),
            Some(&Value::IntValue(1234))
        );
        assert_eq!(
            attribute(server, "error.type"),
            Some(&Value::StringValue("upstream_connect_failed".into()))
        );
        assert_eq!(server.status.as_ref().unwrap().code, STATUS_ERROR as i32);

        let (failed, answered) = (&spans[1], &spans[2]);
        for client in [failed, answered] {
            assert_eq!(client.kind, KIND_CLIENT as i32);
            assert_eq!(client.parent_span_id, server.span_id);
            assert_eq!(client.name, "POST");
        }
        assert_eq!(
            attribute(failed, "raahi.attempt"),
            Some(&Value::IntValue(1))
        );
        assert_eq!(failed.status.as_ref().unwrap().code, STATUS_ERROR as i32);
        assert_eq!(
            attribute(answered, "raahi.attempt"),
            Some(&Value::IntValue(2))
        );
        assert_eq!(
            attribute(answered, "http.request.resend_count"),
            Some(&Value::IntValue(1))
        );
        assert_eq!(
            attribute(answered, "server.port"),
            Some(&Value::IntValue(8080))
        );
        assert_eq!(
            attribute(answered, "url.full"),
            Some(&Value::StringValue(
                "http://10.0.0.2:8080/orders?x=1".into()
            ))
        );
        assert_eq!(
            attribute(answered, "raahi.upstream.connect_ms"),
            Some(&Value::DoubleValue(1.5))
        );
        assert!(answered.status.is_none());
        assert!(failed.end_time_unix_nano <= answered.start_time_unix_nano);

        let second_server = &spans[3];
        assert!(
            second_server.parent_span_id.is_empty(),
            "a new trace has no parent"
        );
        assert_eq!(second_server.flags, FLAG_SAMPLED | FLAG_HAS_IS_REMOTE);
    }

    #[test]
    fn varint_lengths_are_exact() {
        for value in [
            0u64,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            varint(&mut out, value);
            assert_eq!(varint_length(value), out.len(), "{value}");
        }
    }

    #[test]
    fn lengths_of_every_size_are_backfilled_minimally() {
        for size in [0usize, 1, 127, 128, 300, 16_383, 16_384, 70_000, 2_100_000] {
            let mut out = Vec::new();
            nested(&mut out, 1, |out| out.resize(out.len() + size, 7));
            let mut expected = Vec::new();
            key(&mut expected, 1, LENGTH_DELIMITED);
            varint(&mut expected, size as u64);
            expected.resize(expected.len() + size, 7);
            assert_eq!(out, expected, "{size}");
        }
    }
}
