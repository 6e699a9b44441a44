//! A route's retry policy (TRAFFIC.md §5, after Envoy's retry policy and GEP-3388's budgets):
//! which failures another attempt may follow, how long to wait before it, how long one attempt
//! may take, when to hedge, and the budget that keeps retries from multiplying a failure.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

/// Route `retry`. Without it a route's requests follow the service's `max_attempts` with
/// [`RetryPolicy::service_default`]'s conditions, under the default budget.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all, the first included (1 turns retries off; at most `MAX_ATTEMPTS`).
    #[serde(default = "default_attempts")]
    pub attempts: u32,
    /// What another attempt may follow.
    #[serde(default = "default_on")]
    pub on: Vec<RetryOn>,
    /// The statuses `retriable_status` names (100–599).
    #[serde(default)]
    pub statuses: Vec<u16>,
    /// One attempt's wait for response headers; shorter than the service's and the route's
    /// `timeouts.backend_request_ms` wins. Null: theirs.
    #[serde(default)]
    pub per_try_timeout_ms: Option<u64>,
    #[serde(default)]
    pub backoff: RetryBackoff,
    #[serde(default)]
    pub budget: RetryBudget,
    /// When an idempotent request with a resendable body has no response headers after this
    /// long, a second attempt goes to another target; the first answer wins and the other is
    /// cancelled. Null: no hedging.
    #[serde(default)]
    pub hedge_after_ms: Option<u64>,
}

/// What a retry may follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RetryOn {
    /// The connection or TLS handshake to the target failed or timed out: nothing was sent.
    ConnectFailure,
    /// An HTTP/2 stream the target refused (`REFUSED_STREAM`) or above its GOAWAY's last
    /// stream id: never processed.
    Refused,
    /// The exchange broke after the request (or part of it) was sent, or the answer could not
    /// be passed on.
    Reset,
    /// A 502, 503 or 504 answer, and a per-try timeout.
    GatewayError,
    /// Any 5xx answer, and a per-try timeout.
    #[serde(rename = "5xx")]
    FiveXx,
    /// A 409 answer.
    #[serde(rename = "retriable_4xx")]
    Retriable4xx,
    /// An answer whose status is in `statuses`.
    RetriableStatus,
    /// One attempt's wait for response headers ran out.
    PerTryTimeout,
    /// gRPC `UNAVAILABLE` (14) in a trailers-only answer.
    Unavailable,
    /// gRPC `RESOURCE_EXHAUSTED` (8) in a trailers-only answer.
    ResourceExhausted,
    /// gRPC `DEADLINE_EXCEEDED` (4) in a trailers-only answer.
    DeadlineExceeded,
}

impl RetryOn {
    pub const ALL: [RetryOn; 11] = [
        RetryOn::ConnectFailure,
        RetryOn::Refused,
        RetryOn::Reset,
        RetryOn::GatewayError,
        RetryOn::FiveXx,
        RetryOn::Retriable4xx,
        RetryOn::RetriableStatus,
        RetryOn::PerTryTimeout,
        RetryOn::Unavailable,
        RetryOn::ResourceExhausted,
        RetryOn::DeadlineExceeded,
    ];

    /// The name the API uses.
    pub fn name(self) -> &'static str {
        match self {
            RetryOn::ConnectFailure => "connect_failure",
            RetryOn::Refused => "refused",
            RetryOn::Reset => "reset",
            RetryOn::GatewayError => "gateway_error",
            RetryOn::FiveXx => "5xx",
            RetryOn::Retriable4xx => "retriable_4xx",
            RetryOn::RetriableStatus => "retriable_status",
            RetryOn::PerTryTimeout => "per_try_timeout",
            RetryOn::Unavailable => "unavailable",
            RetryOn::ResourceExhausted => "resource_exhausted",
            RetryOn::DeadlineExceeded => "deadline_exceeded",
        }
    }
}

/// Full-jitter exponential backoff: before retry n, a wait drawn uniformly from
/// [0, min(`max_ms`, `base_ms` × 2^(n−1))].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryBackoff {
    #[serde(default = "default_backoff_base_ms")]
    pub base_ms: u64,
    /// Also the longest `Retry-After` waited for; a longer one ends the retries.
    #[serde(default = "default_backoff_max_ms")]
    pub max_ms: u64,
}

impl Default for RetryBackoff {
    fn default() -> Self {
        RetryBackoff {
            base_ms: default_backoff_base_ms(),
            max_ms: default_backoff_max_ms(),
        }
    }
}

/// Retries and hedges per service and gateway over a sliding 10 s window may be at most
/// `percent` of the window's requests plus `min_per_second` × 10.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryBudget {
    /// 0–100.
    #[serde(default = "default_budget_percent")]
    pub percent: f64,
    /// Retries always allowed per second, however few the requests.
    #[serde(default = "default_budget_min_per_second")]
    pub min_per_second: u32,
}

impl Default for RetryBudget {
    fn default() -> Self {
        RetryBudget {
            percent: default_budget_percent(),
            min_per_second: default_budget_min_per_second(),
        }
    }
}

/// Longest backoff or per-try timeout the API accepts (1 hour).
pub const MAX_RETRY_DELAY_MS: u64 = 3_600_000;

impl RetryPolicy {
    /// What a route without `retry` follows: the service's `max_attempts`, retrying what
    /// cannot have been processed or broke before an answer (the rules before route retries
    /// existed), with the default backoff and budget.
    pub fn service_default(max_attempts: u32) -> RetryPolicy {
        RetryPolicy {
            attempts: max_attempts,
            on: vec![RetryOn::ConnectFailure, RetryOn::Refused, RetryOn::Reset],
            statuses: Vec::new(),
            per_try_timeout_ms: None,
            backoff: RetryBackoff::default(),
            budget: RetryBudget::default(),
            hedge_after_ms: None,
        }
    }
}

fn default_attempts() -> u32 {
    3
}

fn default_on() -> Vec<RetryOn> {
    vec![
        RetryOn::ConnectFailure,
        RetryOn::Refused,
        RetryOn::Reset,
        RetryOn::GatewayError,
    ]
}

fn default_backoff_base_ms() -> u64 {
    25
}

fn default_backoff_max_ms() -> u64 {
    250
}

fn default_budget_percent() -> f64 {
    20.0
}

fn default_budget_min_per_second() -> u32 {
    10
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_retry_takes_every_default() {
        let policy: RetryPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(policy.attempts, 3);
        assert_eq!(policy.on, default_on());
        assert_eq!(policy.backoff, RetryBackoff::default());
        assert_eq!(policy.budget, RetryBudget::default());
        assert_eq!(policy.hedge_after_ms, None);
    }

    #[test]
    fn conditions_use_their_api_names() {
        for on in RetryOn::ALL {
            let json = serde_json::to_string(&on).unwrap();
            assert_eq!(json, format!("\"{}\"", on.name()));
            assert_eq!(serde_json::from_str::<RetryOn>(&json).unwrap(), on);
        }
    }
}
