//! Why a request or connection got nothing from a target, shared by HTTP and L4. A failure
//! carries, from the moment it is made, who failed and whether another target may be tried;
//! `ProxyError` (HTTP) and `StreamError` (L4) hold it as it is and only map it to their answer.

use http::Method;

use crate::balance::FailureCause;
use crate::snapshot::{ServiceRuntime, TargetRuntime};

/// Who caused a failure, for logs and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blame {
    Client,
    Upstream,
    Gateway,
    /// Service discovery left the service without targets.
    Discovery,
}

/// Whether a failed attempt may be repeated on another target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Nothing of the request reached the target: any request may go elsewhere.
    Any,
    /// The target may have acted on the request: only a method that means the same when
    /// repeated (RFC 9110 §9.2.2), or a request carrying `Idempotency-Key`, may go elsewhere.
    IfIdempotent,
    /// Part of the body went and the rest cannot follow.
    Never,
}

impl Retry {
    /// Whether a request with `method` may go to another target after this failure; a body
    /// already sent (in part) cannot be sent again, so it rules a retry out.
    pub fn allows(self, method: &Method, body_repeatable: bool, idempotency_key: bool) -> bool {
        body_repeatable
            && match self {
                Retry::Any => true,
                Retry::IfIdempotent => idempotency_key || is_idempotent(method),
                Retry::Never => false,
            }
    }
}

/// A method that means the same when repeated (RFC 9110 §9.2.2).
pub fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// What went wrong with one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamFailureKind {
    ConnectFailed {
        reason: String,
    },
    ConnectTimeout {
        timeout_ms: u64,
    },
    /// The TLS handshake failed (certificate refused, no common version, not TLS).
    TlsFailed {
        reason: String,
    },
    /// The request was sent and no response head came in time.
    ResponseTimeout {
        timeout_ms: u64,
    },
    /// The target took no request body bytes for the whole timeout.
    SendTimeout {
        timeout_ms: u64,
    },
    /// The exchange broke after the request (or part of it) was sent.
    Failed {
        reason: String,
    },
    /// The target answered with a response Raahi will not pass on (unparseable, over a limit,
    /// framed by a coding it cannot forward, an unasked-for `101`): none of it reaches the
    /// client, and the connection is closed.
    InvalidResponse {
        reason: String,
    },
    /// The target did not process the request (an HTTP/2 stream it refused, or one above the
    /// last stream id of its GOAWAY): it is shedding load or going away, not failing.
    Unprocessed {
        reason: String,
    },
}

/// One target's failure: which service and target, what happened, and whether another target
/// may be tried. The messages name the target for the log; [`UpstreamFailure::brief_message`]
/// leaves it out, as target addresses are internal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe(Some(&self.target)))]
pub struct UpstreamFailure {
    pub service: String,
    pub target: String,
    pub kind: UpstreamFailureKind,
}

impl UpstreamFailure {
    pub fn new(service: String, target: String, kind: UpstreamFailureKind) -> Self {
        UpstreamFailure {
            service,
            target,
            kind,
        }
    }

    fn at(service: &ServiceRuntime, target: &TargetRuntime, kind: UpstreamFailureKind) -> Self {
        Self::new(
            service.service.name.clone(),
            target.authority.to_string(),
            kind,
        )
    }

    pub fn connect_failed(
        service: &ServiceRuntime,
        target: &TargetRuntime,
        reason: String,
    ) -> Self {
        Self::at(
            service,
            target,
            UpstreamFailureKind::ConnectFailed { reason },
        )
    }

    pub fn connect_timeout(service: &ServiceRuntime, target: &TargetRuntime) -> Self {
        let timeout_ms = service.service.timeouts.connect_ms;
        Self::at(
            service,
            target,
            UpstreamFailureKind::ConnectTimeout { timeout_ms },
        )
    }

    pub fn tls_failed(service: &ServiceRuntime, target: &TargetRuntime, reason: String) -> Self {
        Self::at(service, target, UpstreamFailureKind::TlsFailed { reason })
    }

    pub fn response_timeout(service: &ServiceRuntime, target: &TargetRuntime) -> Self {
        let timeout_ms = service.service.timeouts.response_header_ms;
        Self::at(
            service,
            target,
            UpstreamFailureKind::ResponseTimeout { timeout_ms },
        )
    }

    pub fn send_timeout(service: &ServiceRuntime, target: &TargetRuntime) -> Self {
        let timeout_ms = service.service.timeouts.response_header_ms;
        Self::at(
            service,
            target,
            UpstreamFailureKind::SendTimeout { timeout_ms },
        )
    }

    pub fn failed(service: &ServiceRuntime, target: &TargetRuntime, reason: String) -> Self {
        Self::at(service, target, UpstreamFailureKind::Failed { reason })
    }

    pub fn invalid_response(
        service: &ServiceRuntime,
        target: &TargetRuntime,
        reason: String,
    ) -> Self {
        Self::at(
            service,
            target,
            UpstreamFailureKind::InvalidResponse { reason },
        )
    }

    pub fn unprocessed(service: &ServiceRuntime, target: &TargetRuntime, reason: String) -> Self {
        Self::at(service, target, UpstreamFailureKind::Unprocessed { reason })
    }

    /// Whether another target may be tried: fixed by what happened, so it is known from the
    /// moment the failure is made.
    pub fn retry(&self) -> Retry {
        match self.kind {
            UpstreamFailureKind::ConnectFailed { .. }
            | UpstreamFailureKind::ConnectTimeout { .. }
            | UpstreamFailureKind::TlsFailed { .. }
            | UpstreamFailureKind::Unprocessed { .. } => Retry::Any,
            // The target saw the request before its answer was refused, or before the attempt's
            // time ran out (a route's retry policy decides whether that time may be spent again).
            UpstreamFailureKind::Failed { .. }
            | UpstreamFailureKind::InvalidResponse { .. }
            | UpstreamFailureKind::ResponseTimeout { .. } => Retry::IfIdempotent,
            UpstreamFailureKind::SendTimeout { .. } => Retry::Never,
        }
    }

    /// Nothing reached the target (a connect, timeout or TLS failure).
    pub fn is_connect(&self) -> bool {
        matches!(
            self.kind,
            UpstreamFailureKind::ConnectFailed { .. }
                | UpstreamFailureKind::ConnectTimeout { .. }
                | UpstreamFailureKind::TlsFailed { .. }
        )
    }

    /// The target declined the request without processing it.
    pub fn is_unprocessed(&self) -> bool {
        matches!(self.kind, UpstreamFailureKind::Unprocessed { .. })
    }

    pub fn is_timeout(&self) -> bool {
        matches!(
            self.kind,
            UpstreamFailureKind::ConnectTimeout { .. }
                | UpstreamFailureKind::ResponseTimeout { .. }
                | UpstreamFailureKind::SendTimeout { .. }
        )
    }

    /// What passive ejection counts this failure as; nothing for a request the target declined
    /// to process (it said so: it works as it should).
    pub fn ejection_cause(&self) -> Option<FailureCause> {
        Some(match self.kind {
            UpstreamFailureKind::Unprocessed { .. } => return None,
            UpstreamFailureKind::ConnectFailed { .. } | UpstreamFailureKind::TlsFailed { .. } => {
                FailureCause::ConnectFailed
            }
            UpstreamFailureKind::ConnectTimeout { .. }
            | UpstreamFailureKind::ResponseTimeout { .. }
            | UpstreamFailureKind::SendTimeout { .. } => FailureCause::Timeout,
            UpstreamFailureKind::Failed { .. } | UpstreamFailureKind::InvalidResponse { .. } => {
                FailureCause::ConnectionError
            }
        })
    }

    /// The machine-readable code, the same in HTTP error bodies and the L4 access log.
    pub fn code(&self) -> &'static str {
        match self.kind {
            UpstreamFailureKind::ConnectFailed { .. } => "upstream_connect_failed",
            UpstreamFailureKind::ConnectTimeout { .. } => "upstream_connect_timeout",
            UpstreamFailureKind::TlsFailed { .. } => "upstream_tls_failed",
            UpstreamFailureKind::ResponseTimeout { .. } => "upstream_timeout",
            UpstreamFailureKind::SendTimeout { .. } => "upstream_send_timeout",
            UpstreamFailureKind::Failed { .. } => "upstream_failed",
            UpstreamFailureKind::InvalidResponse { .. } => "upstream_invalid_response",
            UpstreamFailureKind::Unprocessed { .. } => "upstream_refused",
        }
    }

    /// What a client is told unless told everything: the service and what happened, without
    /// the target's address or the upstream's own error text (an OS error, a TLS alert), which
    /// describe the internal network. The log line has both.
    pub fn brief_message(&self) -> String {
        self.describe(None)
    }

    /// The whole story with `target`; without, the brief one.
    fn describe(&self, target: Option<&str>) -> String {
        let service = &self.service;
        let which = match target {
            Some(target) => format!("target {target}"),
            None => "a target".to_owned(),
        };
        let because = |reason: &str| match target {
            Some(_) => format!(": {reason}"),
            None => String::new(),
        };
        match &self.kind {
            UpstreamFailureKind::ConnectFailed { reason } => {
                format!(
                    "could not connect to {which} of service {service}{}",
                    because(reason)
                )
            }
            UpstreamFailureKind::ConnectTimeout { timeout_ms } => {
                format!(
                    "connecting to {which} of service {service} timed out after {timeout_ms} ms"
                )
            }
            UpstreamFailureKind::TlsFailed { reason } => {
                format!(
                    "TLS with {which} of service {service} failed{}",
                    because(reason)
                )
            }
            UpstreamFailureKind::ResponseTimeout { timeout_ms } => {
                format!(
                    "{which} of service {service} sent no response headers within {timeout_ms} ms"
                )
            }
            UpstreamFailureKind::SendTimeout { timeout_ms } => {
                format!(
                    "{which} of service {service} read no request body bytes for {timeout_ms} ms"
                )
            }
            UpstreamFailureKind::Failed { reason } => {
                format!(
                    "{which} of service {service} failed before responding{}",
                    because(reason)
                )
            }
            UpstreamFailureKind::InvalidResponse { reason } => {
                format!(
                    "{which} of service {service} sent an invalid response{}",
                    because(reason)
                )
            }
            UpstreamFailureKind::Unprocessed { reason } => {
                format!(
                    "{which} of service {service} did not process the request{}",
                    because(reason)
                )
            }
        }
    }
}

/// A service with no target to send to, and whether its discovery is why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoTarget {
    #[error("no available target for service {service}")]
    Unavailable { service: String },
    /// No target, and the service's discovery sources are why (none of them is healthy).
    #[error("service {service} has no target to send to: its discovery sources are not healthy: {sources}")]
    Discovery { service: String, sources: String },
}

impl NoTarget {
    pub fn of(service: &ServiceRuntime) -> NoTarget {
        let name = service.service.name.clone();
        match &service.discovery_gap {
            Some(sources) => NoTarget::Discovery {
                service: name,
                sources: sources.to_string(),
            },
            None => NoTarget::Unavailable { service: name },
        }
    }

    /// Like [`NoTarget::of`], naming the subset (`web{version=v2}`) when the backend has one.
    pub fn of_backend(service: &ServiceRuntime, label: &str) -> NoTarget {
        match NoTarget::of(service) {
            NoTarget::Unavailable { .. } => NoTarget::Unavailable {
                service: label.to_owned(),
            },
            discovery => discovery,
        }
    }

    pub fn blame(&self) -> Blame {
        match self {
            NoTarget::Unavailable { .. } => Blame::Gateway,
            NoTarget::Discovery { .. } => Blame::Discovery,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            NoTarget::Unavailable { .. } => "no_available_target",
            NoTarget::Discovery { .. } => "discovery_unavailable",
        }
    }

    /// What a client is told unless told everything: the service, without its discovery
    /// sources' names and states (the log line and the events have them).
    pub fn brief_message(&self) -> String {
        match self {
            NoTarget::Unavailable { .. } => self.to_string(),
            NoTarget::Discovery { service, .. } => format!(
                "service {service} has no target to send to: its discovery sources are not healthy"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(kind: UpstreamFailureKind) -> UpstreamFailure {
        UpstreamFailure::new("web".into(), "10.0.0.7:80".into(), kind)
    }

    fn connect_failed() -> UpstreamFailure {
        failure(UpstreamFailureKind::ConnectFailed {
            reason: "refused".into(),
        })
    }

    fn broke() -> UpstreamFailure {
        failure(UpstreamFailureKind::Failed {
            reason: "reset".into(),
        })
    }

    #[test]
    fn each_failure_knows_its_retry_rule_from_the_start() {
        let cases = [
            (connect_failed(), Retry::Any),
            (
                failure(UpstreamFailureKind::ConnectTimeout { timeout_ms: 1 }),
                Retry::Any,
            ),
            (
                failure(UpstreamFailureKind::TlsFailed {
                    reason: "UnknownIssuer".into(),
                }),
                Retry::Any,
            ),
            (broke(), Retry::IfIdempotent),
            (
                failure(UpstreamFailureKind::InvalidResponse {
                    reason: "transfer coding gzip".into(),
                }),
                Retry::IfIdempotent,
            ),
            (
                failure(UpstreamFailureKind::ResponseTimeout { timeout_ms: 1 }),
                Retry::IfIdempotent,
            ),
            (
                failure(UpstreamFailureKind::SendTimeout { timeout_ms: 1 }),
                Retry::Never,
            ),
        ];
        for (failure, retry) in cases {
            assert_eq!(failure.retry(), retry, "{failure}");
            assert_eq!(failure.is_connect(), retry == Retry::Any, "{failure}");
        }
    }

    #[test]
    fn the_retry_rule_weighs_the_method_and_the_body() {
        let idempotent = [
            Method::GET,
            Method::HEAD,
            Method::OPTIONS,
            Method::TRACE,
            Method::PUT,
            Method::DELETE,
        ];
        let not_idempotent = [Method::POST, Method::PATCH, Method::CONNECT];
        for method in idempotent.iter().chain(&not_idempotent) {
            assert!(Retry::Any.allows(method, true, false), "{method}");
            assert!(
                !Retry::Any.allows(method, false, false),
                "{method}: body gone"
            );
            assert!(!Retry::Never.allows(method, true, true), "{method}");
            assert!(
                Retry::IfIdempotent.allows(method, true, true),
                "{method} with Idempotency-Key"
            );
            assert!(
                !Retry::IfIdempotent.allows(method, false, true),
                "{method}: body gone"
            );
        }
        for method in &idempotent {
            assert!(Retry::IfIdempotent.allows(method, true, false), "{method}");
            assert!(
                !Retry::IfIdempotent.allows(method, false, false),
                "{method}"
            );
        }
        for method in &not_idempotent {
            assert!(!Retry::IfIdempotent.allows(method, true, false), "{method}");
        }
    }

    #[test]
    fn ejection_counts_each_failure_by_what_happened() {
        assert_eq!(
            connect_failed().ejection_cause(),
            Some(FailureCause::ConnectFailed)
        );
        assert_eq!(
            broke().ejection_cause(),
            Some(FailureCause::ConnectionError)
        );
        let refused = failure(UpstreamFailureKind::InvalidResponse {
            reason: "an unasked-for 101".into(),
        });
        assert_eq!(
            refused.ejection_cause(),
            Some(FailureCause::ConnectionError)
        );
        let late = failure(UpstreamFailureKind::ResponseTimeout { timeout_ms: 1 });
        assert_eq!(late.ejection_cause(), Some(FailureCause::Timeout));
        let unprocessed = failure(UpstreamFailureKind::Unprocessed {
            reason: "REFUSED_STREAM".into(),
        });
        assert_eq!(
            unprocessed.ejection_cause(),
            None,
            "a target that declines a stream is not failing"
        );
        assert_eq!(unprocessed.retry(), Retry::Any);
        assert!(late.is_timeout());
        assert!(!broke().is_timeout());
    }

    #[test]
    fn the_log_names_the_target_and_the_client_is_not_told() {
        let failure = failure(UpstreamFailureKind::ConnectTimeout { timeout_ms: 250 });
        assert_eq!(
            failure.to_string(),
            "connecting to target 10.0.0.7:80 of service web timed out after 250 ms"
        );
        assert_eq!(
            failure.brief_message(),
            "connecting to a target of service web timed out after 250 ms"
        );
        let refused = connect_failed();
        assert_eq!(
            refused.to_string(),
            "could not connect to target 10.0.0.7:80 of service web: refused"
        );
        assert_eq!(
            refused.brief_message(),
            "could not connect to a target of service web"
        );
    }

    #[test]
    fn a_discovery_gap_is_told_without_its_sources() {
        let gap = NoTarget::Discovery {
            service: "web".into(),
            sources: "consul-prod (failing)".into(),
        };
        assert!(gap.to_string().contains("consul-prod (failing)"), "the log");
        assert_eq!(
            gap.brief_message(),
            "service web has no target to send to: its discovery sources are not healthy"
        );
        let none = NoTarget::Unavailable {
            service: "web".into(),
        };
        assert_eq!(none.brief_message(), none.to_string());
    }
}
