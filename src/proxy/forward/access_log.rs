//! The access log line of one HTTP request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::uri::Authority;
use http::{header, HeaderValue, Method, Request, Response, Uri, Version};
use tokio::time::Instant;

use super::{rewrite, Exchange, ProxyBody};
use crate::snapshot::{RetryReason, RouteEntry};
use crate::telemetry::access::{self, Fields};
use crate::telemetry::trace::trace_id_hex;
use opentelemetry::trace::TraceId;

/// The request line, kept only while the access log is on. Cloning a request's URI and Host
/// shares their bytes: nothing is copied or allocated.
pub(super) struct RequestLine {
    method: Method,
    uri: Uri,
    host_header: Option<HeaderValue>,
    version: Version,
}

impl RequestLine {
    pub fn of<B>(request: &Request<B>) -> RequestLine {
        RequestLine {
            method: request.method().clone(),
            uri: request.uri().clone(),
            host_header: request.headers().get(header::HOST).cloned(),
            version: request.version(),
        }
    }

    fn host(&self) -> std::borrow::Cow<'_, str> {
        rewrite::host_of(&self.uri, self.host_header.as_ref())
    }
}

/// One request's access line, made when the answer's head is ready and written then, or, for a
/// gRPC answer, when its body ends: its `grpc-status` comes in the trailers, and the time a
/// streaming call took is its whole length.
pub(super) struct Entry {
    line: RequestLine,
    request_id: HeaderValue,
    client: SocketAddr,
    route: Option<Arc<RouteEntry>>,
    backend: Option<Arc<str>>,
    target: Option<Authority>,
    upstream_elapsed: Option<Duration>,
    retries: Retries,
    status: u16,
    bytes: Option<u64>,
    started: Instant,
    /// `grpc-status` in the head (a trailers-only answer).
    grpc_status: Option<u16>,
    grpc: bool,
    /// The trace the request belongs to: the one it came with, or the one Raahi started.
    trace_id: Option<TraceId>,
}

impl Entry {
    pub fn new(
        line: RequestLine,
        request_id: &HeaderValue,
        client: SocketAddr,
        exchange: &Exchange,
        response: &Response<ProxyBody>,
        started: Instant,
        grpc: bool,
    ) -> Entry {
        let headers = response.headers();
        Entry {
            line,
            request_id: request_id.clone(),
            client,
            route: exchange.route.clone(),
            backend: exchange.backend.clone(),
            target: exchange.target.clone(),
            upstream_elapsed: exchange.upstream_elapsed,
            retries: Retries {
                attempts: exchange.attempts,
                retried: exchange.retried,
                hedged: exchange.hedged,
                budget_exhausted: exchange.budget_exhausted,
            },
            status: response.status().as_u16(),
            bytes: headers
                .get(header::CONTENT_LENGTH)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.parse::<u64>().ok()),
            started,
            grpc_status: grpc
                .then(|| crate::proxy::grpc::status_in(headers))
                .flatten(),
            grpc,
            trace_id: exchange.trace_id,
        }
    }

    /// Writes the line; `trailer_status` is the `grpc-status` of the answer's trailers.
    pub fn write(self, trailer_status: Option<u16>) {
        let route = self.route.as_ref();
        let line = &self.line;
        let grpc_status = trailer_status.or(self.grpc_status);
        access::write(|fields| {
            fields.str("request_id", self.request_id.to_str().unwrap_or(""));
            fields.ip("client", self.client.ip());
            fields.str("method", line.method.as_str());
            fields.str("host", &line.host());
            fields.str("path", line.uri.path());
            fields.str("protocol", protocol(line.version));
            fields.opt_str("route", route.map(|route| route.route.name.as_str()));
            // The backend's label is its service's name, then its subset's labels if any.
            let backend = self.backend.as_deref();
            fields.opt_str(
                "service",
                backend.map(|label| label.split('{').next().unwrap_or(label)),
            );
            fields.opt_str("backend", backend);
            fields.opt_str("target", self.target.as_ref().map(|target| target.as_str()));
            fields.u64("status", u64::from(self.status));
            if self.grpc {
                fields.opt_u64("grpc_status", grpc_status.map(u64::from));
            }
            fields.opt_u64("bytes", self.bytes);
            fields.millis("duration_ms", self.started.elapsed());
            fields.opt_millis("upstream_ms", self.upstream_elapsed);
            self.retries.write(fields);
            if let Some(trace_id) = self.trace_id {
                let mut hex = [0u8; 32];
                fields.str("trace_id", trace_id_hex(trace_id, &mut hex));
            }
        });
    }
}

/// What the retry policy did for one request (TRAFFIC.md §5), as its access line tells it.
#[derive(Debug, Clone, Copy, Default)]
struct Retries {
    /// Attempts sent upstream, hedges included.
    attempts: u8,
    /// Why the last retry was sent.
    retried: Option<RetryReason>,
    hedged: bool,
    /// The answer is a failure the retry budget kept from being retried.
    budget_exhausted: bool,
}

impl Retries {
    /// `attempts` once one was sent, `retry_reason` when a retry was, and `hedged` and
    /// `retry_budget_exhausted` only when true: a request that went once to its target adds
    /// only `attempts=1`.
    fn write(&self, fields: &mut Fields<'_>) {
        if self.attempts >= 1 {
            fields.u64("attempts", u64::from(self.attempts));
        }
        fields.opt_str("retry_reason", self.retried.map(RetryReason::name));
        if self.hedged {
            fields.bool("hedged", true);
        }
        if self.budget_exhausted {
            fields.bool("retry_budget_exhausted", true);
        }
    }
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2.0",
        Version::HTTP_3 => "HTTP/3.0",
        _ => "HTTP/?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::access::{format_for_test, Layout};

    fn json_fields(retries: Retries) -> serde_json::Value {
        let text = format_for_test(Layout::Json, |fields| retries.write(fields));
        let mut entry: serde_json::Value = serde_json::from_str(&text).unwrap();
        entry["fields"].take()
    }

    #[test]
    fn a_request_without_an_attempt_has_no_retry_fields() {
        assert_eq!(json_fields(Retries::default()), serde_json::json!({}));
    }

    #[test]
    fn one_attempt_names_only_the_attempts() {
        let retries = Retries {
            attempts: 1,
            ..Retries::default()
        };
        assert_eq!(json_fields(retries), serde_json::json!({"attempts": 1}));
    }

    #[test]
    fn a_retried_hedged_request_names_all_four() {
        let retries = Retries {
            attempts: 3,
            retried: Some(RetryReason::PerTryTimeout),
            hedged: true,
            budget_exhausted: true,
        };
        assert_eq!(
            json_fields(retries),
            serde_json::json!({
                "attempts": 3,
                "retry_reason": "per_try_timeout",
                "hedged": true,
                "retry_budget_exhausted": true
            })
        );
        let text = format_for_test(Layout::Logfmt, |fields| retries.write(fields));
        assert!(
            text.ends_with(
                " attempts=3 retry_reason=per_try_timeout hedged=true \
                 retry_budget_exhausted=true\n"
            ),
            "{text}"
        );
    }

    #[test]
    fn a_budget_refusal_after_one_attempt_says_so_without_a_reason() {
        let retries = Retries {
            attempts: 1,
            budget_exhausted: true,
            ..Retries::default()
        };
        assert_eq!(
            json_fields(retries),
            serde_json::json!({"attempts": 1, "retry_budget_exhausted": true})
        );
    }
}
