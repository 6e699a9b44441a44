//! One recorded request: its server span and a client span per upstream attempt, kept as plain
//! facts while the request runs and turned into OpenTelemetry spans only by the exporter, off
//! the request path.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::SystemTime;

use http::HeaderValue;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};

use super::context::traceparent;
use super::Shared;

/// A request the gateway records. Boxed, and only for sampled requests: an unsampled request
/// carries a `None` through the path.
pub struct RequestTrace {
    shared: Arc<Shared>,
    trace_id: TraceId,
    span_id: SpanId,
    /// The caller's span, when the request came with a trace context.
    remote_parent: Option<SpanId>,
    flags: TraceFlags,
    start: SystemTime,
    /// `{method} {route}` once the route is known, `{method}` before.
    name: Cow<'static, str>,
    attributes: Vec<KeyValue>,
    error: Option<Cow<'static, str>>,
    attempts: Vec<Attempt>,
}

/// One upstream attempt's client span.
struct Attempt {
    span_id: SpanId,
    name: Cow<'static, str>,
    start: SystemTime,
    end: Option<SystemTime>,
    attributes: Vec<KeyValue>,
    error: Option<Cow<'static, str>>,
}

impl RequestTrace {
    pub(super) fn new(
        shared: Arc<Shared>,
        trace_id: TraceId,
        remote_parent: Option<SpanId>,
        start: SystemTime,
    ) -> Box<RequestTrace> {
        Box::new(RequestTrace {
            shared,
            trace_id,
            span_id: SpanId::from(nonzero_u64()),
            remote_parent,
            flags: TraceFlags::SAMPLED,
            start,
            name: Cow::Borrowed("HTTP"),
            attributes: Vec::with_capacity(16),
            error: None,
            attempts: Vec::new(),
        })
    }

    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }

    /// The trace came with the request (Raahi continues its caller's trace).
    pub fn continues_caller(&self) -> bool {
        self.remote_parent.is_some()
    }

    pub fn set_name(&mut self, name: impl Into<Cow<'static, str>>) {
        self.name = name.into();
    }

    /// Adds an attribute to the server span.
    pub fn attribute(&mut self, attribute: KeyValue) {
        self.attributes.push(attribute);
    }

    /// The server span failed: its status becomes an error with this description.
    pub fn fail(&mut self, description: impl Into<Cow<'static, str>>) {
        self.error = Some(description.into());
    }

    /// Starts a client span for the next upstream attempt and gives the `traceparent` that
    /// names it as the parent of the target's work.
    pub fn start_attempt(&mut self, name: impl Into<Cow<'static, str>>) -> HeaderValue {
        self.end_attempt();
        let span_id = SpanId::from(nonzero_u64());
        self.attempts.push(Attempt {
            span_id,
            name: name.into(),
            start: SystemTime::now(),
            end: None,
            attributes: Vec::with_capacity(12),
            error: None,
        });
        traceparent(self.trace_id, span_id, self.flags)
    }

    /// Adds an attribute to the current attempt's client span.
    pub fn attempt_attribute(&mut self, attribute: KeyValue) {
        if let Some(attempt) = self.attempts.last_mut() {
            attempt.attributes.push(attribute);
        }
    }

    /// The current attempt failed: its client span's status becomes an error.
    pub fn fail_attempt(&mut self, description: impl Into<Cow<'static, str>>) {
        if let Some(attempt) = self.attempts.last_mut() {
            attempt.error = Some(description.into());
        }
        self.end_attempt();
    }

    /// Ends the current attempt's client span now (an attempt that answered ends with the
    /// response body, in [`finish`](Self::finish)).
    pub fn end_attempt(&mut self) {
        if let Some(attempt) = self.attempts.last_mut() {
            attempt.end.get_or_insert_with(SystemTime::now);
        }
    }

    /// Ends the request's spans now and hands them to the exporter's queue, or counts them
    /// dropped when the queue is full: the request never waits for the exporter.
    pub fn finish(mut self: Box<Self>) {
        let end = SystemTime::now();
        for attempt in &mut self.attempts {
            attempt.end.get_or_insert(end);
        }
        let shared = self.shared.clone();
        shared.enqueue(Finished { trace: self, end });
    }
}

/// A request whose spans are complete, waiting in the exporter's queue.
pub(super) struct Finished {
    trace: Box<RequestTrace>,
    end: SystemTime,
}

impl Finished {
    pub fn span_count(&self) -> usize {
        1 + self.trace.attempts.len()
    }

    /// The server span, then a client span per attempt, as the exporter sends them.
    pub fn into_spans(
        self,
        scope: &opentelemetry::InstrumentationScope,
        spans: &mut Vec<SpanData>,
    ) {
        let Finished { trace, end } = self;
        let RequestTrace {
            trace_id,
            span_id: server_id,
            remote_parent,
            flags,
            start,
            name,
            attributes,
            error,
            attempts,
            ..
        } = *trace;
        spans.push(span(SpanFacts {
            trace_id,
            span_id: server_id,
            parent: remote_parent.unwrap_or(SpanId::INVALID),
            parent_is_remote: remote_parent.is_some(),
            flags,
            kind: SpanKind::Server,
            name,
            start,
            end,
            attributes,
            error,
            scope,
        }));
        for attempt in attempts {
            spans.push(span(SpanFacts {
                trace_id,
                span_id: attempt.span_id,
                parent: server_id,
                parent_is_remote: false,
                flags,
                kind: SpanKind::Client,
                name: attempt.name,
                start: attempt.start,
                end: attempt.end.unwrap_or(end),
                attributes: attempt.attributes,
                error: attempt.error,
                scope,
            }));
        }
    }
}

struct SpanFacts<'s> {
    trace_id: TraceId,
    span_id: SpanId,
    parent: SpanId,
    parent_is_remote: bool,
    flags: TraceFlags,
    kind: SpanKind,
    name: Cow<'static, str>,
    start: SystemTime,
    end: SystemTime,
    attributes: Vec<KeyValue>,
    error: Option<Cow<'static, str>>,
    scope: &'s opentelemetry::InstrumentationScope,
}

fn span(facts: SpanFacts<'_>) -> SpanData {
    SpanData {
        span_context: SpanContext::new(
            facts.trace_id,
            facts.span_id,
            facts.flags,
            false,
            TraceState::NONE,
        ),
        parent_span_id: facts.parent,
        parent_span_is_remote: facts.parent_is_remote,
        span_kind: facts.kind,
        name: facts.name,
        start_time: facts.start,
        end_time: facts.end.max(facts.start),
        attributes: facts.attributes,
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: match facts.error {
            Some(description) => Status::Error { description },
            None => Status::Unset,
        },
        instrumentation_scope: facts.scope.clone(),
    }
}

/// Trace and span ids must not be all zeros (W3C Trace Context §3.2.2).
pub(super) fn nonzero_u64() -> u64 {
    loop {
        let id = fastrand::u64(..);
        if id != 0 {
            return id;
        }
    }
}

pub(super) fn nonzero_u128() -> u128 {
    loop {
        let id = fastrand::u128(..);
        if id != 0 {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::trace::TraceCounters;

    fn shared() -> (Arc<Shared>, tokio::sync::mpsc::Receiver<Finished>) {
        let (queue, waiting) = tokio::sync::mpsc::channel(8);
        let shared = Arc::new(Shared {
            queue,
            counters: Arc::new(TraceCounters::default()),
        });
        (shared, waiting)
    }

    #[test]
    fn attempts_are_children_of_the_hop_and_the_hop_of_the_caller() {
        let (shared, mut waiting) = shared();
        let caller = SpanId::from(0x00f0_67aa_0ba9_02b7_u64);
        let trace_id = TraceId::from(0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736_u128);
        let mut trace = RequestTrace::new(shared, trace_id, Some(caller), SystemTime::now());
        trace.set_name("GET shop");
        trace.attribute(KeyValue::new("http.request.method", "GET"));
        let first = trace.start_attempt("GET");
        trace.fail_attempt("upstream_connect_failed");
        let second = trace.start_attempt("GET");
        trace.attempt_attribute(KeyValue::new("raahi.attempt", 2));
        trace.finish();

        let finished = waiting.try_recv().expect("queued");
        assert_eq!(finished.span_count(), 3);
        let scope = opentelemetry::InstrumentationScope::builder("raahi").build();
        let mut spans = Vec::new();
        finished.into_spans(&scope, &mut spans);
        let [server, failed, answered] = &spans[..] else {
            panic!("three spans: {spans:?}");
        };
        assert_eq!(server.span_kind, SpanKind::Server);
        assert_eq!(server.name, "GET shop");
        assert_eq!(server.parent_span_id, caller);
        assert!(server.parent_span_is_remote);
        for (attempt, header) in [(failed, &first), (answered, &second)] {
            assert_eq!(attempt.span_kind, SpanKind::Client);
            assert_eq!(attempt.parent_span_id, server.span_context.span_id());
            assert_eq!(attempt.span_context.trace_id(), trace_id);
            let expected = format!("00-{trace_id}-{}-01", attempt.span_context.span_id());
            assert_eq!(header.to_str().unwrap(), expected);
            assert!(attempt.start_time >= server.start_time);
            assert!(attempt.end_time <= server.end_time);
        }
        assert!(matches!(failed.status, Status::Error { .. }));
        assert_eq!(answered.status, Status::Unset);
        assert_eq!(answered.attributes, vec![KeyValue::new("raahi.attempt", 2)]);
        assert!(
            failed.end_time <= answered.start_time,
            "a failed attempt ends when it fails"
        );
    }

    #[test]
    fn a_new_trace_has_no_parent() {
        let (shared, mut waiting) = shared();
        let trace = RequestTrace::new(shared, TraceId::from(7_u128), None, SystemTime::now());
        assert!(!trace.continues_caller());
        trace.finish();
        let scope = opentelemetry::InstrumentationScope::builder("raahi").build();
        let mut spans = Vec::new();
        waiting.try_recv().unwrap().into_spans(&scope, &mut spans);
        assert_eq!(spans[0].parent_span_id, SpanId::INVALID);
        assert!(!spans[0].parent_span_is_remote);
    }
}
