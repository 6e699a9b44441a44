//! Why a proxied HTTP request failed, and the one place that turns that into a status and a
//! body.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

use super::failure::{Blame, NoTarget, UpstreamFailure, UpstreamFailureKind};
use crate::snapshot::REFUSAL_CODES;

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
}

impl ProxyError {
    /// The one place a failure becomes an HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ProxyError::ClientBody { .. }
            | ProxyError::InvalidHost { .. }
            | ProxyError::InvalidFraming { .. } => StatusCode::BAD_REQUEST,
            ProxyError::UnsupportedTransferCoding { .. } => StatusCode::NOT_IMPLEMENTED,
            ProxyError::UriTooLong { .. } => StatusCode::URI_TOO_LONG,
            ProxyError::HeadersTooLarge { .. } => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            ProxyError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientBodyTooSlow { .. }
            | ProxyError::ClientHeaderTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ProxyError::NoTarget(_)
            | ProxyError::TooManyConnections { .. }
            | ProxyError::UpstreamOverloaded { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ProxyError::Upstream(failure) => match failure.kind {
                UpstreamFailureKind::ConnectFailed { .. }
                | UpstreamFailureKind::TlsFailed { .. }
                | UpstreamFailureKind::Failed { .. }
                | UpstreamFailureKind::InvalidResponse { .. } => StatusCode::BAD_GATEWAY,
                UpstreamFailureKind::ConnectTimeout { .. }
                | UpstreamFailureKind::ResponseTimeout { .. }
                | UpstreamFailureKind::SendTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
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
            ProxyError::UnsupportedTransferCoding { .. } => "unsupported_transfer_coding",
            ProxyError::UriTooLong { .. } => "uri_too_long",
            ProxyError::HeadersTooLarge { .. } => "request_headers_too_large",
            ProxyError::BodyTooLarge { .. } => "request_body_too_large",
            ProxyError::TooManyConnections { .. } => "too_many_connections",
            ProxyError::UpstreamOverloaded { .. } => "upstream_overloaded",
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
            | ProxyError::UnsupportedTransferCoding { .. }
            | ProxyError::UriTooLong { .. }
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::BodyTooLarge { .. } => Blame::Client,
            ProxyError::NoTarget(no_target) => no_target.blame(),
            ProxyError::Upstream(_) => Blame::Upstream,
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
            | ProxyError::UpstreamOverloaded { .. } => false,
            ProxyError::ClientHeaderTimeout { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientBodyTooSlow { .. }
            | ProxyError::InvalidHost { .. }
            | ProxyError::InvalidFraming { .. }
            | ProxyError::UnsupportedTransferCoding { .. }
            | ProxyError::UriTooLong { .. }
            | ProxyError::HeadersTooLarge { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::TooManyConnections { .. } => true,
        }
    }

    /// What the client is told: the log line's story without the targets' addresses, which
    /// are internal network details. The log has them, under the same request id.
    pub fn client_message(&self) -> String {
        match self {
            ProxyError::Upstream(failure) => failure.client_message(),
            _ => self.to_string(),
        }
    }

    /// `{"error": {"code": ..., "message": ...}}` with the status this error maps to.
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        let mut response = Response::new(Full::new(self.json_body()));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        response
    }

    /// The same answer as [`ProxyError::to_response`], as HTTP/1.1 bytes that end the
    /// connection: for a connection no HTTP state serves any more.
    pub fn to_http1_close(&self) -> Vec<u8> {
        let body = self.json_body();
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

    fn json_body(&self) -> Bytes {
        let body = serde_json::json!({
            "error": { "code": self.code(), "message": self.client_message() }
        });
        Bytes::from(body.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(kind: UpstreamFailureKind) -> ProxyError {
        ProxyError::Upstream(UpstreamFailure::new(
            "web".into(),
            "10.0.0.7:8443".into(),
            kind,
        ))
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
            ProxyError::UnsupportedTransferCoding {
                coding: "gzip".into(),
            },
            ProxyError::UriTooLong {
                length: 2,
                limit: 1,
            },
            ProxyError::HeadersTooLarge { reason: "x".into() },
            ProxyError::BodyTooLarge { limit: 1 },
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
    fn a_closing_answer_is_a_whole_http1_response() {
        let wire = ProxyError::ClientHeaderTimeout { timeout_ms: 400 }.to_http1_close();
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

    #[test]
    fn clients_are_not_told_target_addresses() {
        let failures = [
            UpstreamFailureKind::ConnectFailed {
                reason: "connection refused".into(),
            },
            UpstreamFailureKind::TlsFailed {
                reason: "invalid peer certificate: UnknownIssuer".into(),
            },
            UpstreamFailureKind::ConnectTimeout { timeout_ms: 5 },
            UpstreamFailureKind::ResponseTimeout { timeout_ms: 5 },
            UpstreamFailureKind::SendTimeout { timeout_ms: 5 },
            UpstreamFailureKind::Failed {
                reason: "connection reset".into(),
            },
            UpstreamFailureKind::InvalidResponse {
                reason: "the response head is larger than 65536 bytes".into(),
            },
        ];
        for kind in failures {
            let failure = upstream(kind);
            assert!(
                failure.to_string().contains("10.0.0.7:8443"),
                "the log has it"
            );
            let told = failure.client_message();
            assert!(!told.contains("10.0.0.7"), "{told}");
            assert!(told.contains("service web"), "{told}");
        }
    }
}
