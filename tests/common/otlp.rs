//! A test OpenTelemetry collector: an HTTP server on 127.0.0.1:0 that takes OTLP/HTTP
//! protobuf on `POST /v1/traces` (the OTLP specification's exporter path), decodes it with the
//! protocol's own message types and keeps every span. It can be told to answer 500 or to hang,
//! as a broken or overloaded collector does.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;
use serde_json::{json, Value};
use tokio::net::TcpListener;

/// `Span.SpanKind` in the OTLP protocol.
pub const KIND_SERVER: i32 = 2;
pub const KIND_CLIENT: i32 = 3;
/// `Status.StatusCode` in the OTLP protocol.
pub const STATUS_ERROR: i32 = 2;

/// One span as the collector received it, ids in hex as `traceparent` writes them.
#[derive(Debug, Clone)]
pub struct CollectedSpan {
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    pub name: String,
    pub kind: i32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub status_code: i32,
    pub attributes: BTreeMap<String, Value>,
    /// The exporting resource's `service.name`.
    pub service_name: String,
    pub scope: String,
}

impl CollectedSpan {
    pub fn attribute(&self, key: &str) -> &Value {
        self.attributes.get(key).unwrap_or(&Value::Null)
    }
}

/// How the collector answers exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Accept = 0,
    /// 500 to every export.
    Fail = 1,
    /// Reads the export and never answers.
    Hang = 2,
}

pub struct Collector {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<CollectedSpan>>>,
    mode: Arc<AtomicU8>,
    /// Export calls received, answered or not.
    pub exports: Arc<AtomicUsize>,
}

impl Collector {
    pub async fn start() -> Collector {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let collector = Collector {
            addr: listener.local_addr().unwrap(),
            spans: Arc::default(),
            mode: Arc::new(AtomicU8::new(Mode::Accept as u8)),
            exports: Arc::default(),
        };
        let (spans, mode, exports) = (
            collector.spans.clone(),
            collector.mode.clone(),
            collector.exports.clone(),
        );
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (spans, mode, exports) = (spans.clone(), mode.clone(), exports.clone());
                let service = service_fn(move |request| {
                    receive(request, spans.clone(), mode.clone(), exports.clone())
                });
                tokio::spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        collector
    }

    /// The base URL `tracing.otlp_endpoint` takes.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_mode(&self, mode: Mode) {
        self.mode.store(mode as u8, Ordering::SeqCst);
    }

    pub fn spans(&self) -> Vec<CollectedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// The spans of trace `trace_id`, once `count` of them arrived (fails after `deadline`).
    pub async fn trace(
        &self,
        trace_id: &str,
        count: usize,
        deadline: Duration,
    ) -> Vec<CollectedSpan> {
        let what = format!("{count} spans of trace {trace_id}");
        self.wait_for(&what, deadline, |spans| {
            let found: Vec<_> = spans
                .iter()
                .filter(|span| span.trace_id == trace_id)
                .cloned()
                .collect();
            (found.len() >= count).then_some(found)
        })
        .await
    }

    /// The first span named `name` that arrives (fails after `deadline`).
    pub async fn span_named(&self, name: &str, deadline: Duration) -> CollectedSpan {
        self.wait_for(&format!("a span named {name:?}"), deadline, |spans| {
            spans.iter().find(|span| span.name == name).cloned()
        })
        .await
    }

    /// What `found` finds in the spans received so far, once it finds it.
    async fn wait_for<T>(
        &self,
        what: &str,
        deadline: Duration,
        found: impl Fn(&[CollectedSpan]) -> Option<T>,
    ) -> T {
        let give_up = tokio::time::Instant::now() + deadline;
        loop {
            let spans = self.spans();
            if let Some(value) = found(&spans) {
                return value;
            }
            assert!(
                tokio::time::Instant::now() < give_up,
                "waited {deadline:?} for {what}; received: {spans:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn receive(
    request: Request<Incoming>,
    spans: Arc<Mutex<Vec<CollectedSpan>>>,
    mode: Arc<AtomicU8>,
    exports: Arc<AtomicUsize>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let answer = |status: StatusCode| {
        let mut response = Response::new(Full::new(Bytes::new()));
        *response.status_mut() = status;
        Ok(response)
    };
    if request.method() != hyper::Method::POST || request.uri().path() != "/v1/traces" {
        return answer(StatusCode::NOT_FOUND);
    }
    let content_type = request
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let Ok(body) = request.into_body().collect().await else {
        return answer(StatusCode::BAD_REQUEST);
    };
    exports.fetch_add(1, Ordering::SeqCst);
    match mode.load(Ordering::SeqCst) {
        m if m == Mode::Fail as u8 => return answer(StatusCode::INTERNAL_SERVER_ERROR),
        m if m == Mode::Hang as u8 => std::future::pending::<()>().await,
        _ => {}
    }
    if content_type != "application/x-protobuf" {
        return answer(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
    let Ok(export) = ExportTraceServiceRequest::decode(body.to_bytes()) else {
        return answer(StatusCode::BAD_REQUEST);
    };
    let mut received = Vec::new();
    for resource_spans in export.resource_spans {
        let service_name = resource_spans
            .resource
            .as_ref()
            .and_then(|resource| {
                attributes(&resource.attributes)
                    .get("service.name")
                    .and_then(|name| name.as_str().map(str::to_owned))
            })
            .unwrap_or_default();
        for scope_spans in resource_spans.scope_spans {
            let scope = scope_spans
                .scope
                .as_ref()
                .map(|scope| scope.name.clone())
                .unwrap_or_default();
            for span in scope_spans.spans {
                received.push(CollectedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    kind: span.kind,
                    start_ns: span.start_time_unix_nano,
                    end_ns: span.end_time_unix_nano,
                    status_code: span.status.map_or(0, |status| status.code),
                    attributes: attributes(&span.attributes),
                    service_name: service_name.clone(),
                    scope: scope.clone(),
                });
            }
        }
    }
    spans.lock().unwrap().extend(received);
    answer(StatusCode::OK)
}

fn attributes(pairs: &[KeyValue]) -> BTreeMap<String, Value> {
    pairs
        .iter()
        .map(|pair| {
            let value = match pair.value.as_ref().and_then(|value| value.value.as_ref()) {
                Some(AnyValue::StringValue(text)) => json!(text),
                Some(AnyValue::BoolValue(flag)) => json!(flag),
                Some(AnyValue::IntValue(number)) => json!(number),
                Some(AnyValue::DoubleValue(number)) => json!(number),
                Some(other) => json!(format!("{other:?}")),
                None => Value::Null,
            };
            (pair.key.clone(), value)
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}
