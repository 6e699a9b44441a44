//! Why a proxied HTTP request failed, and the one place that turns that into a status and a
//! body.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

use super::failure::{Blame, NoTarget, UpstreamFailure, UpstreamFailureKind};
use super::spool::SpoolError;
use crate::snapshot::REFUSAL_CODES;

/// How much Raahi's own 5xx answers tell the client (`proxy.error_details`). The log line and
/// the events keep everything either way; 4xx answers are about the client's own request and
/// read the same in both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ErrorDetails {
    /// The code and the service: never a discovery source's name or state, a target's address
    /// or an upstream's own error text, which describe the internal network.
    #[default]
    Brief,
    /// The log line's story, sources and targets included: for trusted clients, tests,
    /// debugging.
    Full,
}

/// Why a proxied HTTP request failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches host {host:?} and path {path:?}")]
    NoRoute { host: String, path: String },
    #[error(transparent)]
    NoTarget(#[from] NoTarget),
    #[error(transparent)]
    Upstream(#[from] UpstreamFailure),
    #[error("the request body could not be read from the client: {reason}")]
    ClientBody { reason: String },
    #[error("the client sent no request body bytes for {timeout_ms} ms")]
    ClientBodyTimeout { timeout_ms: u64 },
    #[error("the client did not send its whole request body within {timeout_ms} ms")]
    ClientBodyTooSlow { timeout_ms: u64 },
    #[error("the client sent no complete request head within {timeout_ms} ms")]
    ClientHeaderTimeout { timeout_ms: u64 },
    #[error("the request carries {reason}")]
    InvalidHost { reason: &'static str },
    #[error("the request's framing is invalid: {reason}")]
    InvalidFraming { reason: &'static str },
    #[error("the request path {reason}")]
    InvalidPath { reason: &'static str },
    #[error("the transfer coding {coding:?} is not supported (only chunked)")]
    UnsupportedTransferCoding { coding: String },
    #[error("the request target is {length} bytes long, more than the {limit} allowed")]
    UriTooLong { length: usize, limit: usize },
    #[error("the request has {reason}")]
    HeadersTooLarge { reason: String },
    #[error("the request body is larger than the {limit} bytes this route accepts")]
    BodyTooLarge { limit: u64 },
    #[error("the listener has its {limit} connections open")]
    TooManyConnections { limit: usize },
    #[error("service {service}'s targets are full: {reason}")]
    UpstreamOverloaded {
        service: String,
        reason: super::accounting::Overloaded,
    },
    /// The gRPC deadline the client set (`grpc-timeout`) passed before the target answered.
    #[error(
        "the gRPC deadline of {timeout_ms} ms (grpc-timeout) passed before the target answered"
    )]
    GrpcTimeout { timeout_ms: u64 },
    /// The route's `timeouts.request_ms` passed before a target answered, retries included.
    #[error("route {route} answered nothing within its request timeout of {timeout_ms} ms")]
    RequestTimeout { route: String, timeout_ms: u64 },
    /// The request asks to switch protocols and its service's targets speak HTTP/2, which
    /// cannot carry an HTTP/1.1 `Upgrade`.
    #[error("service {service} speaks HTTP/2 (h2c) to its targets, which cannot carry an Upgrade")]
    UpgradeNotSupported { service: String },
    /// A body too large for memory could not be held in the spool.
    #[error(transparent)]
    Spool(#[from] SpoolError),
    /// The route's `rate_limit` refused the request's key.
    #[error(
        "route {route} admits {} requests per second per key; the next in {} s",
        refusal.requests_per_second,
        refusal.retry_after_s
    )]
    RateLimited {
        route: String,
        refusal: super::rate_limit::Refusal,
    },
    /// The route's `max_in_flight` requests are in flight.
    #[error("route {route} has its {limit} requests in flight (max_in_flight)")]
    TooManyRequests {
        route: String,
        limit: u32,
        /// The request has a body, not read: the connection cannot carry another request.
        with_body: bool,
    },
}

impl ProxyError {
    /// The one place a failure becomes an HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ProxyError::ClientBody { .. }
            | ProxyError::InvalidHost { .. }
            | ProxyError::InvalidFraming { .. }
            | ProxyError::InvalidPath { .. } => StatusCode::BAD_REQUEST,
            ProxyError::UnsupportedTransferCoding { .. }
            | ProxyError::UpgradeNotSupported { .. } => StatusCode::NOT_IMPLEMENTED,
            ProxyError::UriTooLong { .. } => StatusCode::URI_TOO_LONG,
            ProxyError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::BodyTooLarge { .. }
            | ProxyError::Spool(SpoolError::TooLarge { .. } | SpoolError::Full { .. }) => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            ProxyError::Spool(SpoolError::Io(_)) => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientBodyTooSlow { .. }
            | ProxyError::ClientHeaderTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::GrpcTimeout { .. } | ProxyError::RequestTimeout { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
            ProxyError::NoTarget(_)
            | ProxyError::TooManyConnections { .. }
            | ProxyError::TooManyRequests { .. }
            | ProxyError::UpstreamOverloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            ProxyError::Upstream(failure) => match failure.kind {
                UpstreamFailureKind::ConnectFailed { .. }
                | UpstreamFailureKind::TlsFailed { .. }
                | UpstreamFailureKind::Failed { .. }
                | UpstreamFailureKind::InvalidResponse { .. } => StatusCode::BAD_GATEWAY,
                UpstreamFailureKind::ConnectTimeout { .. }
                | UpstreamFailureKind::ResponseTimeout { .. }
                | UpstreamFailureKind::SendTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
                UpstreamFailureKind::Unprocessed { .. } => StatusCode::SERVICE_UNAVAILABLE,
            },
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::NoRoute { .. } => "no_route",
            ProxyError::ClientBody { .. } => "client_body_failed",
            ProxyError::ClientBodyTimeout { .. } | ProxyError::ClientBodyTooSlow { .. } => {
                "client_body_timeout"
            }
            ProxyError::ClientHeaderTimeout { .. } => "client_header_timeout",
            ProxyError::InvalidHost { .. } => "invalid_host",
            ProxyError::InvalidFraming { .. } => "invalid_framing",
            ProxyError::InvalidPath { .. } => "invalid_path",
            ProxyError::UnsupportedTransferCoding { .. } => "unsupported_transfer_coding",
            ProxyError::UpgradeNotSupported { .. } => "upgrade_not_supported",
            ProxyError::GrpcTimeout { .. } => "grpc_timeout",
            ProxyError::RequestTimeout { .. } => "request_timeout",
            ProxyError::UriTooLong { .. } => "uri_too_long",
            ProxyError::HeadersTooLarge { .. } => "request_headers_too_large",
            ProxyError::BodyTooLarge { .. }
            | ProxyError::Spool(SpoolError::TooLarge { .. } | SpoolError::Full { .. }) => {
                "request_body_too_large"
            }
            ProxyError::Spool(SpoolError::Io(_)) => "request_spool_failed",
            ProxyError::TooManyConnections { .. } => "too_many_connections",
            ProxyError::UpstreamOverloaded { .. } => "upstream_overloaded",
            ProxyError::RateLimited { .. } => "rate_limited",
            ProxyError::TooManyRequests { .. } => "too_many_requests",
            ProxyError::NoTarget(no_target) => no_target.code(),
            ProxyError::Upstream(failure) => failure.code(),
        }
    }

    pub fn blame(&self) -> Blame {
        match self {
            ProxyError::NoRoute { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientBodyTooSlow { .. }
            | ProxyError::ClientHeaderTimeout { .. }
            | ProxyError::InvalidHost { .. }
            | ProxyError::InvalidFraming { .. }
            | ProxyError::InvalidPath { .. }
            | ProxyError::UnsupportedTransferCoding { .. }
            | ProxyError::UriTooLong { .. }
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::Spool(SpoolError::TooLarge { .. })
            | ProxyError::UpgradeNotSupported { .. }
            | ProxyError::RateLimited { .. }
            // The route's own cap, reached by its clients: a refusal per request at warn would
            // flood the log exactly when the gateway is busiest; the `route` event says it once.
            | ProxyError::TooManyRequests { .. }
            | ProxyError::GrpcTimeout { .. } => Blame::Client,
            ProxyError::Spool(SpoolError::Full { .. } | SpoolError::Io(_)) => Blame::Gateway,
            ProxyError::NoTarget(no_target) => no_target.blame(),
            ProxyError::Upstream(_) | ProxyError::RequestTimeout { .. } => Blame::Upstream,
            ProxyError::TooManyConnections { .. } | ProxyError::UpstreamOverloaded { .. } => {
                Blame::Gateway
            }
        }
    }

    /// Its place in [`REFUSAL_CODES`] when it refuses a request for breaking a rule or limit.
    pub fn refusal(&self) -> Option<usize> {
        let code = self.code();
        REFUSAL_CODES.iter().position(|refusal| *refusal == code)
    }

    /// The HTTP/1.1 connection cannot carry another request after this answer: the request
    /// was refused before its body was read, or its body broke, so where the next request
    /// starts is unknown (or the client is not to be trusted with one).
    pub fn ends_connection(&self) -> bool {
        match self {
            ProxyError::NoRoute { .. }
            | ProxyError::NoTarget(_)
            | ProxyError::Upstream(_)
            | ProxyError::UpstreamOverloaded { .. }
            | ProxyError::GrpcTimeout { .. }
            | ProxyError::RequestTimeout { .. } => false,
            // Refused before the body was read: where the next request starts is unknown.
            ProxyError::UpgradeNotSupported { .. } => true,
            ProxyError::RateLimited { refusal, .. } => refusal.with_body,
            ProxyError::TooManyRequests { with_body, .. } => *with_body,
            ProxyError::ClientHeaderTimeout { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientBodyTooSlow { .. }
            | ProxyError::InvalidHost { .. }
            | ProxyError::InvalidFraming { .. }
            | ProxyError::InvalidPath { .. }
            | ProxyError::UnsupportedTransferCoding { .. }
            | ProxyError::UriTooLong { .. }
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::Spool(_)
            | ProxyError::TooManyConnections { .. } => true,
        }
    }

    /// What the client is told: the log line's story, or with `Brief` its 5xx answers without
    /// discovery sources, target addresses, upstream error texts and the file system's story
    /// (paths, devices). The log has them, under the same request id.
    pub fn client_message(&self, details: ErrorDetails) -> String {
        match (details, self) {
            (ErrorDetails::Full, _) => self.to_string(),
            (ErrorDetails::Brief, ProxyError::Upstream(failure)) => failure.brief_message(),
            (ErrorDetails::Brief, ProxyError::NoTarget(no_target)) => no_target.brief_message(),
            (ErrorDetails::Brief, ProxyError::Spool(SpoolError::Io(_))) => {
                "the gateway could not hold the request body; try again later".to_owned()
            }
            // The others name nothing of the network behind the gateway: a limit of its own,
            // or what the client sent.
            (ErrorDetails::Brief, _) => self.to_string(),
        }
    }

    /// `{"error": {"code": ..., "message": ...}}` with the status this error maps to.
    pub fn to_response(&self, details: ErrorDetails) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(self.json_body(details)));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        self.add_headers(response.headers_mut());
        response
    }

    /// Fields an answer carries beside its body: a rate limit's `Retry-After` and quota.
    fn add_headers(&self, headers: &mut http::HeaderMap) {
        if let ProxyError::RateLimited { refusal, .. } = self {
            refusal.add_headers(headers);
        }
    }

    /// The answer for a gRPC request: HTTP 200, trailers-only, the status TRAFFIC.md §2 maps
    /// the failure to, the client's message, and the code in `x-raahi-error`.
    pub fn to_grpc_response(&self, details: ErrorDetails) -> Response<Full<Bytes>> {
        let status = super::grpc::status_for_failure(self.code(), self.status());
        let mut response = super::grpc::trailers_only(status, &self.client_message(details));
        response.headers_mut().insert(
            super::grpc::RAAHI_ERROR,
            HeaderValue::from_static(self.code()),
        );
        self.add_headers(response.headers_mut());
        response
    }

    /// The same answer as [`ProxyError::to_response`], as HTTP/1.1 bytes that end the
    /// connection: for a connection no HTTP state serves any more.
    pub fn to_http1_close(&self, details: ErrorDetails) -> Vec<u8> {
        let body = self.json_body(details);
        let status = self.status();
        let mut wire = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            status.as_u16(),
            status.canonical_reason().unwrap_or(""),
            body.len()
        )
        .into_bytes();
        wire.extend_from_slice(&body);
        wire
    }

    fn json_body(&self, details: ErrorDetails) -> Bytes {
        let body = serde_json::json!({
            "error": { "code": self.code(), "message": self.client_message(details) }
        });
        Bytes::from(body.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(kind: UpstreamFailureKind) -> ProxyError {
        ProxyError::Upstream(UpstreamFailure::new("web".into(), TARGET.into(), kind))
    }

    #[test]
    fn each_error_has_its_status_and_code() {
        let no_target = ProxyError::NoTarget(NoTarget::Unavailable {
            service: "web".into(),
        });
        assert_eq!(no_target.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(no_target.code(), "no_available_target");
        assert_eq!(no_target.to_string(), "no available target for service web");
        let discovery = ProxyError::NoTarget(NoTarget::Discovery {
            service: "web".into(),
            sources: "dns (failing)".into(),
        });
        assert_eq!(discovery.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(discovery.code(), "discovery_unavailable");
        assert_eq!(discovery.blame(), Blame::Discovery);
        let cases = [
            (
                UpstreamFailureKind::ConnectFailed {
                    reason: "refused".into(),
                },
                StatusCode::BAD_GATEWAY,
                "upstream_connect_failed",
            ),
            (
                UpstreamFailureKind::ConnectTimeout { timeout_ms: 5 },
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_connect_timeout",
            ),
            (
                UpstreamFailureKind::TlsFailed {
                    reason: "invalid peer certificate: UnknownIssuer".into(),
                },
                StatusCode::BAD_GATEWAY,
                "upstream_tls_failed",
            ),
            (
                UpstreamFailureKind::ResponseTimeout { timeout_ms: 5 },
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_timeout",
            ),
            (
                UpstreamFailureKind::SendTimeout { timeout_ms: 5 },
                StatusCode::GATEWAY_TIMEOUT,
                "upstream_send_timeout",
            ),
            (
                UpstreamFailureKind::Failed {
                    reason: "reset".into(),
                },
                StatusCode::BAD_GATEWAY,
                "upstream_failed",
            ),
            (
                UpstreamFailureKind::InvalidResponse {
                    reason: "transfer coding other than chunked".into(),
                },
                StatusCode::BAD_GATEWAY,
                "upstream_invalid_response",
            ),
        ];
        for (kind, status, code) in cases {
            let error = upstream(kind);
            assert_eq!(error.status(), status, "{error}");
            assert_eq!(error.code(), code, "{error}");
            assert_eq!(error.blame(), Blame::Upstream, "{error}");
        }
        assert!(upstream(UpstreamFailureKind::TlsFailed {
            reason: "invalid peer certificate: UnknownIssuer".into()
        })
        .to_string()
        .contains("UnknownIssuer"));
    }

    #[test]
    fn every_refusal_is_counted_under_its_code() {
        let refusals = [
            ProxyError::InvalidHost { reason: "x" },
            ProxyError::InvalidFraming { reason: "x" },
            ProxyError::InvalidPath { reason: "x" },
            ProxyError::UnsupportedTransferCoding {
                coding: "gzip".into(),
            },
            ProxyError::UriTooLong {
                length: 2,
                limit: 1,
            },
            ProxyError::HeadersTooLarge { reason: "x".into() },
            ProxyError::BodyTooLarge { limit: 1 },
            ProxyError::Spool(SpoolError::TooLarge { limit: 1 }),
            ProxyError::Spool(SpoolError::Full { limit: 1 }),
            ProxyError::ClientBodyTimeout { timeout_ms: 1 },
            ProxyError::ClientBodyTooSlow { timeout_ms: 1 },
            ProxyError::UpstreamOverloaded {
                service: "web".into(),
                reason: crate::proxy::accounting::Overloaded::QueueFull { max_pending: 0 },
            },
        ];
        for refusal in &refusals {
            let index = refusal
                .refusal()
                .unwrap_or_else(|| panic!("{refusal} uncounted"));
            assert_eq!(REFUSAL_CODES[index], refusal.code());
        }
        assert_eq!(
            ProxyError::NoRoute {
                host: "a".into(),
                path: "/".into()
            }
            .refusal(),
            None
        );
    }

    #[test]
    fn a_spool_failure_is_the_gateway_s_and_tells_no_file_system_detail() {
        let error = ProxyError::Spool(SpoolError::Io(std::io::Error::other(
            "/var/spool/raahi: No space left on device",
        )));
        assert_eq!(error.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(error.code(), "request_spool_failed");
        assert_eq!(error.blame(), Blame::Gateway);
        assert!(
            error.to_string().contains("No space left"),
            "the log has it"
        );
        assert!(!error
            .client_message(ErrorDetails::Brief)
            .contains("/var/spool"));
        let full = ProxyError::Spool(SpoolError::Full { limit: 10 });
        assert_eq!(
            (full.status(), full.blame()),
            (StatusCode::PAYLOAD_TOO_LARGE, Blame::Gateway)
        );
    }

    #[test]
    fn a_closing_answer_is_a_whole_http1_response() {
        let wire =
            ProxyError::ClientHeaderTimeout { timeout_ms: 400 }.to_http1_close(ErrorDetails::Brief);
        let wire = String::from_utf8(wire).unwrap();
        let (head, body) = wire.split_once("\r\n\r\n").unwrap();
        assert!(
            head.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.contains(&format!("\r\ncontent-length: {}", body.len())),
            "{head}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "client_header_timeout");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("400 ms"));
    }

    /// What the service's failures below carry that the internal network is made of.
    const TARGET: &str = "10.0.0.7:8443";
    const SOURCE: &str = "dns-prod";
    const SOURCE_STATE: &str = "failing";
    const UPSTREAM_TEXTS: [&str; 5] = [
        "Connection refused (os error 111)",
        "invalid peer certificate: UnknownIssuer",
        "connection reset by peer",
        "/var/spool/raahi: No space left on device",
        "the transfer coding \"gzip\" is not passed on",
    ];

    /// One of each variant (each upstream failure kind too), and its place in `variant` below.
    fn one_of_each() -> Vec<ProxyError> {
        let kinds = [
            UpstreamFailureKind::ConnectFailed {
                reason: UPSTREAM_TEXTS[0].into(),
            },
            UpstreamFailureKind::ConnectTimeout { timeout_ms: 5 },
            UpstreamFailureKind::TlsFailed {
                reason: UPSTREAM_TEXTS[1].into(),
            },
            UpstreamFailureKind::ResponseTimeout { timeout_ms: 5 },
            UpstreamFailureKind::SendTimeout { timeout_ms: 5 },
            UpstreamFailureKind::Failed {
                reason: UPSTREAM_TEXTS[2].into(),
            },
            UpstreamFailureKind::InvalidResponse {
                reason: UPSTREAM_TEXTS[4].into(),
            },
            UpstreamFailureKind::Unprocessed {
                reason: UPSTREAM_TEXTS[2].into(),
            },
        ];
        let mut errors: Vec<ProxyError> = kinds.into_iter().map(upstream).collect();
        errors.extend([
            ProxyError::NoRoute {
                host: "a.test".into(),
                path: "/".into(),
            },
            ProxyError::NoTarget(NoTarget::Unavailable {
                service: "web".into(),
            }),
            ProxyError::NoTarget(NoTarget::Discovery {
                service: "web".into(),
                sources: format!("{SOURCE} ({SOURCE_STATE})"),
            }),
            ProxyError::ClientBody {
                reason: "early eof".into(),
            },
            ProxyError::ClientBodyTimeout { timeout_ms: 1 },
            ProxyError::ClientBodyTooSlow { timeout_ms: 1 },
            ProxyError::ClientHeaderTimeout { timeout_ms: 1 },
            ProxyError::InvalidHost { reason: "no Host" },
            ProxyError::InvalidFraming {
                reason: "chunked twice",
            },
            ProxyError::UnsupportedTransferCoding {
                coding: "gzip".into(),
            },
            ProxyError::UriTooLong {
                length: 2,
                limit: 1,
            },
            ProxyError::HeadersTooLarge {
                reason: "101 fields".into(),
            },
            ProxyError::BodyTooLarge { limit: 1 },
            ProxyError::TooManyConnections { limit: 3 },
            ProxyError::UpstreamOverloaded {
                service: "web".into(),
                reason: crate::proxy::accounting::Overloaded::QueueFull { max_pending: 0 },
            },
            ProxyError::UpstreamOverloaded {
                service: "web".into(),
                reason: crate::proxy::accounting::Overloaded::QueueTimeout { timeout_ms: 9 },
            },
            ProxyError::Spool(SpoolError::TooLarge { limit: 1 }),
            ProxyError::Spool(SpoolError::Full { limit: 1 }),
            ProxyError::Spool(SpoolError::Io(std::io::Error::other(UPSTREAM_TEXTS[3]))),
            ProxyError::InvalidPath {
                reason: "climbs above the root",
            },
            ProxyError::UpgradeNotSupported {
                service: "web".into(),
            },
            ProxyError::GrpcTimeout { timeout_ms: 200 },
            ProxyError::RequestTimeout {
                route: "api".into(),
                timeout_ms: 300,
            },
            ProxyError::RateLimited {
                route: "api".into(),
                refusal: super::super::rate_limit::Refusal {
                    requests_per_second: 5.0,
                    retry_after_s: 1,
                    quota: 5,
                    window_s: 1,
                    with_body: false,
                },
            },
            ProxyError::TooManyRequests {
                route: "api".into(),
                limit: 10,
                with_body: true,
            },
        ]);
        errors
    }

    /// Which variant (and upstream failure kind) an error is: a variant added without a case
    /// in `one_of_each` fails to compile here, then fails `one_of_each_covers_every_variant`.
    fn variant(error: &ProxyError) -> usize {
        match error {
            ProxyError::Upstream(failure) => match failure.kind {
                UpstreamFailureKind::ConnectFailed { .. } => 0,
                UpstreamFailureKind::ConnectTimeout { .. } => 1,
                UpstreamFailureKind::TlsFailed { .. } => 2,
                UpstreamFailureKind::ResponseTimeout { .. } => 3,
                UpstreamFailureKind::SendTimeout { .. } => 4,
                UpstreamFailureKind::Failed { .. } => 5,
                UpstreamFailureKind::InvalidResponse { .. } => 25,
                UpstreamFailureKind::Unprocessed { .. } => 26,
            },
            ProxyError::NoRoute { .. } => 6,
            ProxyError::NoTarget(NoTarget::Unavailable { .. }) => 7,
            ProxyError::NoTarget(NoTarget::Discovery { .. }) => 8,
            ProxyError::ClientBody { .. } => 9,
            ProxyError::ClientBodyTimeout { .. } => 10,
            ProxyError::ClientBodyTooSlow { .. } => 11,
            ProxyError::ClientHeaderTimeout { .. } => 12,
            ProxyError::InvalidHost { .. } => 13,
            ProxyError::InvalidFraming { .. } => 14,
            ProxyError::UnsupportedTransferCoding { .. } => 15,
            ProxyError::UriTooLong { .. } => 16,
            ProxyError::HeadersTooLarge { .. } => 17,
            ProxyError::BodyTooLarge { .. } => 18,
            ProxyError::TooManyConnections { .. } => 19,
            ProxyError::UpstreamOverloaded { .. } => 20,
            ProxyError::Spool(SpoolError::TooLarge { .. }) => 21,
            ProxyError::Spool(SpoolError::Full { .. }) => 22,
            ProxyError::Spool(SpoolError::Io(_)) => 23,
            ProxyError::InvalidPath { .. } => 24,
            ProxyError::UpgradeNotSupported { .. } => 27,
            ProxyError::GrpcTimeout { .. } => 28,
            ProxyError::RequestTimeout { .. } => 29,
            ProxyError::RateLimited { .. } => 30,
            ProxyError::TooManyRequests { .. } => 31,
        }
    }

    #[test]
    fn one_of_each_covers_every_variant() {
        let mut seen: Vec<usize> = one_of_each().iter().map(variant).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen, (0..=31).collect::<Vec<_>>());
    }

    /// The message of both bodies Raahi writes: a response, and HTTP/1.1 bytes that close.
    fn told(error: &ProxyError, details: ErrorDetails) -> String {
        let wire = String::from_utf8(error.to_http1_close(details)).unwrap();
        let (_, body) = wire.split_once("\r\n\r\n").unwrap();
        let closing: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(closing["error"]["code"], error.code());
        let response = error.to_response(details);
        assert_eq!(response.status(), error.status());
        let message = closing["error"]["message"].as_str().unwrap().to_owned();
        assert_eq!(message, error.client_message(details));
        message
    }

    /// `proxy.error_details = "brief"` (the default): a 5xx names its code and, when it has
    /// one, the service, and nothing of the network behind the gateway.
    #[test]
    fn brief_5xx_bodies_name_the_service_and_nothing_behind_the_gateway() {
        assert_eq!(ErrorDetails::default(), ErrorDetails::Brief);
        let mut checked = 0;
        for error in one_of_each()
            .iter()
            .filter(|e| e.status().is_server_error())
        {
            let message = told(error, ErrorDetails::Brief);
            let hidden = [TARGET, "10.0.0.7", SOURCE, SOURCE_STATE]
                .into_iter()
                .chain(UPSTREAM_TEXTS);
            for secret in hidden {
                assert!(!message.contains(secret), "{}: {message}", error.code());
            }
            let has_service = !matches!(
                error,
                ProxyError::TooManyConnections { .. }
                    | ProxyError::UnsupportedTransferCoding { .. }
                    | ProxyError::Spool(_)
                    | ProxyError::GrpcTimeout { .. }
                    | ProxyError::RequestTimeout { .. }
                    | ProxyError::TooManyRequests { .. }
            );
            if has_service {
                assert!(message.contains("service web"), "{message}");
            }
            checked += 1;
        }
        // Eight upstream kinds, two kinds of no target, two overloads, too many connections,
        // two 501s, a spool failure, a spent gRPC deadline, a route's request timeout, a route's
        // requests in flight.
        assert_eq!(checked, 19);
    }

    /// `proxy.error_details = "full"`: the log line's story, sources and targets included.
    #[test]
    fn full_5xx_bodies_tell_the_log_story() {
        for error in one_of_each()
            .iter()
            .filter(|e| e.status().is_server_error())
        {
            let message = told(error, ErrorDetails::Full);
            assert_eq!(message, error.to_string());
            match error {
                ProxyError::Upstream(failure) => {
                    assert!(message.contains(TARGET), "{message}");
                    if let UpstreamFailureKind::ConnectFailed { reason }
                    | UpstreamFailureKind::TlsFailed { reason }
                    | UpstreamFailureKind::Failed { reason } = &failure.kind
                    {
                        assert!(message.contains(reason.as_str()), "{message}");
                    }
                }
                ProxyError::NoTarget(NoTarget::Discovery { .. }) => {
                    assert!(message.contains(SOURCE), "{message}");
                    assert!(message.contains(SOURCE_STATE), "{message}");
                }
                _ => {}
            }
        }
    }

    /// 4xx answers are about the client's own request: the same in both modes.
    #[test]
    fn client_errors_read_the_same_in_both_modes() {
        for error in one_of_each()
            .iter()
            .filter(|e| e.status().is_client_error())
        {
            assert_eq!(
                told(error, ErrorDetails::Brief),
                told(error, ErrorDetails::Full)
            );
            assert_eq!(error.client_message(ErrorDetails::Brief), error.to_string());
        }
    }
}
