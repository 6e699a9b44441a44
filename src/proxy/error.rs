//! Why a proxied request failed, and the one place that turns that into a status and a body.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};
use http_body_util::Full;

/// Who caused a failure, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    Client,
    Upstream,
    Gateway,
    /// Service discovery left the service without targets.
    Discovery,
}

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no route matches host {host:?} and path {path:?}")]
    NoRoute { host: String, path: String },
    #[error("no available target for service {service}")]
    NoAvailableTarget { service: String },
    /// No target, and the service's discovery sources are why (none of them is healthy).
    #[error("service {service} has no target to send to: its discovery sources are not healthy: {sources}")]
    DiscoveryUnavailable { service: String, sources: String },
    #[error("could not connect to target {target} of service {service}: {reason}")]
    ConnectFailed {
        service: String,
        target: String,
        reason: String,
    },
    /// The TLS handshake with a target failed (certificate refused, no common version, not TLS);
    /// nothing was sent, so another target may be tried.
    #[error("TLS with target {target} of service {service} failed: {reason}")]
    UpstreamTlsFailed {
        service: String,
        target: String,
        reason: String,
    },
    #[error("connecting to target {target} of service {service} timed out after {timeout_ms} ms")]
    ConnectTimeout {
        service: String,
        target: String,
        timeout_ms: u64,
    },
    #[error(
        "target {target} of service {service} sent no response headers within {timeout_ms} ms"
    )]
    ResponseTimeout {
        service: String,
        target: String,
        timeout_ms: u64,
    },
    #[error("the request body could not be read from the client: {reason}")]
    ClientBody { reason: String },
    #[error("the client sent no request body bytes for {timeout_ms} ms")]
    ClientBodyTimeout { timeout_ms: u64 },
    #[error("the client sent no complete request head within {timeout_ms} ms")]
    ClientHeaderTimeout { timeout_ms: u64 },
    #[error("target {target} of service {service} read no request body bytes for {timeout_ms} ms")]
    UpstreamSendTimeout {
        service: String,
        target: String,
        timeout_ms: u64,
    },
    #[error("target {target} of service {service} failed before responding: {reason}")]
    UpstreamFailed {
        service: String,
        target: String,
        reason: String,
    },
}

impl ProxyError {
    /// Why `service` has no target to pick: its discovery, or its targets.
    pub fn no_target(service: &crate::snapshot::ServiceRuntime) -> ProxyError {
        let name = service.service.name.clone();
        match &service.discovery_gap {
            Some(sources) => ProxyError::DiscoveryUnavailable {
                service: name,
                sources: sources.to_string(),
            },
            None => ProxyError::NoAvailableTarget { service: name },
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::NoRoute { .. } => StatusCode::NOT_FOUND,
            ProxyError::ClientBody { .. } => StatusCode::BAD_REQUEST,
            ProxyError::ClientBodyTimeout { .. } | ProxyError::ClientHeaderTimeout { .. } => {
                StatusCode::REQUEST_TIMEOUT
            }
            ProxyError::UpstreamSendTimeout { .. } => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::NoAvailableTarget { .. } | ProxyError::DiscoveryUnavailable { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ProxyError::ConnectFailed { .. }
            | ProxyError::UpstreamTlsFailed { .. }
            | ProxyError::UpstreamFailed { .. } => StatusCode::BAD_GATEWAY,
            ProxyError::ConnectTimeout { .. } | ProxyError::ResponseTimeout { .. } => {
                StatusCode::GATEWAY_TIMEOUT
            }
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ProxyError::NoRoute { .. } => "no_route",
            ProxyError::ClientBody { .. } => "client_body_failed",
            ProxyError::ClientBodyTimeout { .. } => "client_body_timeout",
            ProxyError::ClientHeaderTimeout { .. } => "client_header_timeout",
            ProxyError::UpstreamSendTimeout { .. } => "upstream_send_timeout",
            ProxyError::NoAvailableTarget { .. } => "no_available_target",
            ProxyError::DiscoveryUnavailable { .. } => "discovery_unavailable",
            ProxyError::ConnectFailed { .. } => "upstream_connect_failed",
            ProxyError::UpstreamTlsFailed { .. } => "upstream_tls_failed",
            ProxyError::ConnectTimeout { .. } => "upstream_connect_timeout",
            ProxyError::ResponseTimeout { .. } => "upstream_timeout",
            ProxyError::UpstreamFailed { .. } => "upstream_failed",
        }
    }

    pub fn blame(&self) -> Blame {
        match self {
            ProxyError::NoRoute { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientHeaderTimeout { .. } => Blame::Client,
            ProxyError::NoAvailableTarget { .. } => Blame::Gateway,
            ProxyError::DiscoveryUnavailable { .. } => Blame::Discovery,
            _ => Blame::Upstream,
        }
    }

    /// What the client is told: the log line's story without the targets' addresses, which
    /// are internal network details. The log has them, under the same request id.
    pub fn client_message(&self) -> String {
        match self {
            ProxyError::ConnectFailed {
                service, reason, ..
            } => format!("could not connect to a target of service {service}: {reason}"),
            ProxyError::UpstreamTlsFailed {
                service, reason, ..
            } => format!("TLS with a target of service {service} failed: {reason}"),
            ProxyError::ConnectTimeout {
                service,
                timeout_ms,
                ..
            } => format!(
                "connecting to a target of service {service} timed out after {timeout_ms} ms"
            ),
            ProxyError::ResponseTimeout {
                service,
                timeout_ms,
                ..
            } => format!(
                "a target of service {service} sent no response headers within {timeout_ms} ms"
            ),
            ProxyError::UpstreamSendTimeout {
                service,
                timeout_ms,
                ..
            } => format!(
                "a target of service {service} read no request body bytes for {timeout_ms} ms"
            ),
            ProxyError::UpstreamFailed {
                service, reason, ..
            } => format!("a target of service {service} failed before responding: {reason}"),
            ProxyError::NoRoute { .. }
            | ProxyError::NoAvailableTarget { .. }
            | ProxyError::DiscoveryUnavailable { .. }
            | ProxyError::ClientBody { .. }
            | ProxyError::ClientBodyTimeout { .. }
            | ProxyError::ClientHeaderTimeout { .. } => self.to_string(),
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

    #[test]
    fn each_error_has_its_status_and_code() {
        let no_target = ProxyError::NoAvailableTarget {
            service: "web".into(),
        };
        assert_eq!(no_target.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(no_target.to_string(), "no available target for service web");
        let timeout = ProxyError::ResponseTimeout {
            service: "web".into(),
            target: "10.0.0.1:80".into(),
            timeout_ms: 5,
        };
        assert_eq!(timeout.status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(timeout.code(), "upstream_timeout");
        let tls = ProxyError::UpstreamTlsFailed {
            service: "web".into(),
            target: "10.0.0.1:443".into(),
            reason: "invalid peer certificate: UnknownIssuer".into(),
        };
        assert_eq!(tls.status(), StatusCode::BAD_GATEWAY);
        assert_eq!(tls.code(), "upstream_tls_failed");
        assert_eq!(tls.blame(), Blame::Upstream);
        assert!(tls.to_string().contains("UnknownIssuer"));
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
            ProxyError::ConnectFailed {
                service: "web".into(),
                target: "10.0.0.7:8443".into(),
                reason: "connection refused".into(),
            },
            ProxyError::UpstreamTlsFailed {
                service: "web".into(),
                target: "10.0.0.7:8443".into(),
                reason: "invalid peer certificate: UnknownIssuer".into(),
            },
            ProxyError::ConnectTimeout {
                service: "web".into(),
                target: "10.0.0.7:8443".into(),
                timeout_ms: 5,
            },
            ProxyError::ResponseTimeout {
                service: "web".into(),
                target: "10.0.0.7:8443".into(),
                timeout_ms: 5,
            },
            ProxyError::UpstreamSendTimeout {
                service: "web".into(),
                target: "10.0.0.7:8443".into(),
                timeout_ms: 5,
            },
            ProxyError::UpstreamFailed {
                service: "web".into(),
                target: "10.0.0.7:8443".into(),
                reason: "connection reset".into(),
            },
        ];
        for failure in failures {
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
