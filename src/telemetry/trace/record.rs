//! One recorded request: the facts of its server span and of a client span per upstream
//! attempt, kept as typed values (clones of the request's shared bytes, static codes, numbers)
//! while the request runs. They become OTLP spans only in the exporter task, off the request
//! path: recording allocates little and formats nothing.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, PathAndQuery};
use http::{HeaderValue, Method, Version};
use opentelemetry::trace::{SpanId, TraceFlags, TraceId};

use super::context::traceparent;
use super::Shared;
use crate::clock::unix_nanos;

/// A request the gateway records. Boxed, and only for sampled requests: an unsampled request
/// carries a `None` through the path.
pub struct RequestTrace {
    shared: Arc<Shared>,
    pub(super) trace_id: TraceId,
    pub(super) span_id: SpanId,
    /// The caller's span, when the request came with a trace context.
    pub(super) remote_parent: Option<SpanId>,
    pub(super) start_ns: u64,
    pub(super) end_ns: u64,
    /// What the server span says.
    pub server: ServerFacts,
    pub(super) attempts: Vec<AttemptFacts>,
}

/// The request as the client sent it and as it was answered.
#[derive(Debug, Default)]
pub struct ServerFacts {
    pub method: Method,
    pub path_and_query: Option<PathAndQuery>,
    pub over_tls: bool,
    pub host: String,
    pub client: Option<IpAddr>,
    pub version: Version,
    pub user_agent: Option<HeaderValue>,
    pub request_id: Option<HeaderValue>,
    pub route: Option<Arc<str>>,
    /// The backend's label: its service's name, then a subset's labels if any.
    pub backend: Option<Arc<str>>,
    pub status: u16,
    /// Raahi's error code when Raahi answered for a failure.
    pub error: Option<&'static str>,
    pub body_bytes: u64,
    pub grpc: bool,
    pub grpc_status: Option<u16>,
    /// The answer's body ended before its end (the client went away, or the target broke off).
    pub cut: bool,
}

/// One upstream attempt.
#[derive(Debug)]
pub struct AttemptFacts {
    pub(super) span_id: SpanId,
    pub(super) start_ns: u64,
    /// 0 while the attempt's span is open.
    pub(super) end_ns: u64,
    pub method: Method,
    pub scheme: &'static str,
    pub authority: Authority,
    pub path_and_query: PathAndQuery,
    /// 1-based.
    pub attempt: u32,
    /// The previous attempt's error code, for a retry.
    pub retry_reason: Option<&'static str>,
    /// The target's answer (0: none).
    pub status: u16,
    pub version: Option<Version>,
    /// Why the attempt failed, when it did.
    pub error: Option<&'static str>,
    /// Opening the connection, when this attempt opened it.
    pub connect: Option<Duration>,
}

impl RequestTrace {
    pub(super) fn new(
        shared: Arc<Shared>,
        trace_id: TraceId,
        remote_parent: Option<SpanId>,
    ) -> Box<RequestTrace> {
        Box::new(RequestTrace {
            shared,
            trace_id,
            span_id: SpanId::from(nonzero_u64()),
            remote_parent,
            start_ns: unix_nanos(),
            end_ns: 0,
            server: ServerFacts::default(),
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

    /// Opens the client span of an upstream attempt and gives the `traceparent` that names it
    /// as the parent of the target's work.
    pub fn start_attempt(
        &mut self,
        method: Method,
        scheme: &'static str,
        authority: Authority,
        path_and_query: PathAndQuery,
        retry_reason: Option<&'static str>,
    ) -> HeaderValue {
        self.end_attempt();
        self.open_attempt(method, scheme, authority, path_and_query, retry_reason)
    }

    /// Opens the client span of a hedged attempt, beside the one still running.
    pub fn start_hedge(
        &mut self,
        method: Method,
        scheme: &'static str,
        authority: Authority,
        path_and_query: PathAndQuery,
    ) -> HeaderValue {
        self.open_attempt(method, scheme, authority, path_and_query, Some("hedge"))
    }

    /// The attempt numbered `attempt` (from 1), to note what came of it.
    pub fn attempt_numbered(&mut self, attempt: u32) -> Option<&mut AttemptFacts> {
        self.attempts.get_mut((attempt as usize).checked_sub(1)?)
    }

    /// Attempt `attempt` failed with `code` (or, cancelled, lost to its hedge twin): its span
    /// ends now.
    pub fn fail_attempt_numbered(&mut self, attempt: u32, code: &'static str) {
        if let Some(facts) = self.attempt_numbered(attempt) {
            facts.error = Some(code);
            if facts.end_ns == 0 {
                facts.end_ns = unix_nanos();
            }
        }
    }

    /// The number the next attempt's span gets.
    pub fn next_attempt(&self) -> u32 {
        self.attempts.len() as u32 + 1
    }

    fn open_attempt(
        &mut self,
        method: Method,
        scheme: &'static str,
        authority: Authority,
        path_and_query: PathAndQuery,
        retry_reason: Option<&'static str>,
    ) -> HeaderValue {
        let span_id = SpanId::from(nonzero_u64());
        let attempt = self.attempts.len() as u32 + 1;
        self.attempts.push(AttemptFacts {
            span_id,
            start_ns: unix_nanos(),
            end_ns: 0,
            method,
            scheme,
            authority,
            path_and_query,
            attempt,
            retry_reason,
            status: 0,
            version: None,
            error: None,
            connect: None,
        });
        traceparent(self.trace_id, span_id, TraceFlags::SAMPLED)
    }

    /// The current attempt, to note what came of it.
    pub fn attempt(&mut self) -> Option<&mut AttemptFacts> {
        self.attempts.last_mut()
    }

    /// The current attempt failed with `code`: its span ends now.
    pub fn fail_attempt(&mut self, code: &'static str) {
        self.fail_attempt_numbered(self.attempts.len() as u32, code);
    }

    fn end_attempt(&mut self) {
        if let Some(attempt) = self.attempts.last_mut() {
            if attempt.end_ns == 0 {
                attempt.end_ns = unix_nanos();
            }
        }
    }

    /// Ends the request's spans now and hands them to the exporter's queue, or counts them
    /// dropped when the queue is full: the request never waits for the exporter.
    pub fn finish(mut self: Box<Self>) {
        self.end_ns = unix_nanos();
        let end = self.end_ns;
        for attempt in &mut self.attempts {
            if attempt.end_ns == 0 {
                attempt.end_ns = end;
            }
        }
        let shared = self.shared.clone();
        shared.enqueue(self);
    }

    /// The spans this request exports: its server span and one per attempt.
    pub(super) fn span_count(&self) -> usize {
        1 + self.attempts.len()
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
