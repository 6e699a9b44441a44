//! A route's retry policy as a request follows it (TRAFFIC.md §5): which failed attempt may be
//! followed by another, how long to wait first, and when to hedge. The attempts themselves are
//! `forward::retry`'s; the budget's window is the service's (`snapshot::RetryCounters`).

use std::time::Duration;

use http::{HeaderMap, HeaderName, Method, StatusCode};

use super::failure::{is_idempotent, Retry, UpstreamFailure, UpstreamFailureKind};
use super::grpc;
use crate::model::{RetryBackoff, RetryBudget, RetryOn, RetryPolicy, MAX_ATTEMPTS};
use crate::snapshot::RetryReason;

/// The header that makes any method safe to repeat: the target deduplicates by its value.
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The conditions of a policy as bits, so a request asks them without a search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Conditions(u16);

impl Conditions {
    fn of(on: &[RetryOn]) -> Conditions {
        Conditions(on.iter().fold(0, |bits, on| bits | (1 << *on as u16)))
    }

    fn has(self, on: RetryOn) -> bool {
        self.0 & (1 << on as u16) != 0
    }
}

/// The conditions a route without `retry` follows: what cannot have been processed, and an
/// exchange that broke before its answer.
const SERVICE_DEFAULT: Conditions = Conditions(
    1 << RetryOn::ConnectFailure as u16 | 1 << RetryOn::Refused as u16 | 1 << RetryOn::Reset as u16,
);

/// One request's retry policy: the route's `retry`, or the service's `max_attempts` with the
/// default rules and budget. Built per request without allocating.
#[derive(Debug, Clone, Copy)]
pub struct RetryRule<'a> {
    pub attempts: usize,
    on: Conditions,
    statuses: &'a [u16],
    pub per_try_timeout: Option<Duration>,
    pub backoff: RetryBackoff,
    pub budget: RetryBudget,
    pub hedge_after: Option<Duration>,
}

/// Another attempt may follow, for this reason, after the policy's wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retriable {
    pub reason: RetryReason,
    /// The target asked to be left alone this long (`Retry-After`), within the backoff's cap.
    pub retry_after: Option<Duration>,
}

/// Why an answer the policy names is passed on as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotRetried {
    /// Its status (or gRPC status) is not one the policy retries.
    NotNamed,
    /// The request may have been processed and is not safe to repeat.
    Unsafe,
    /// The target's `Retry-After` is longer than the backoff's cap.
    RetryAfterTooLong,
}

impl<'a> RetryRule<'a> {
    pub fn of(route: Option<&'a RetryPolicy>, max_attempts: u32) -> RetryRule<'a> {
        let attempts_limit = MAX_ATTEMPTS as usize;
        match route {
            Some(policy) => RetryRule {
                attempts: (policy.attempts as usize).clamp(1, attempts_limit),
                on: Conditions::of(&policy.on),
                statuses: &policy.statuses,
                per_try_timeout: policy.per_try_timeout_ms.map(Duration::from_millis),
                backoff: policy.backoff,
                budget: policy.budget,
                hedge_after: policy.hedge_after_ms.map(Duration::from_millis),
            },
            None => RetryRule {
                attempts: (max_attempts as usize).clamp(1, attempts_limit),
                on: SERVICE_DEFAULT,
                statuses: &[],
                per_try_timeout: None,
                backoff: RetryBackoff::default(),
                budget: RetryBudget::default(),
                hedge_after: None,
            },
        }
    }

    /// Whether a failed attempt may be followed by another: the policy must name what
    /// happened, and the request must be safe to send again after it.
    pub fn after_failure(
        &self,
        failure: &UpstreamFailure,
        request: &Resend<'_>,
    ) -> Option<RetryReason> {
        let reason = match failure.kind {
            UpstreamFailureKind::ConnectFailed { .. }
            | UpstreamFailureKind::ConnectTimeout { .. }
            | UpstreamFailureKind::TlsFailed { .. } => self
                .on
                .has(RetryOn::ConnectFailure)
                .then_some(RetryReason::ConnectFailure),
            UpstreamFailureKind::Unprocessed { .. } => self
                .on
                .has(RetryOn::Refused)
                .then_some(RetryReason::Refused),
            UpstreamFailureKind::Failed { .. } | UpstreamFailureKind::InvalidResponse { .. } => {
                self.on.has(RetryOn::Reset).then_some(RetryReason::Reset)
            }
            UpstreamFailureKind::ResponseTimeout { .. } => self
                .names_per_try_timeout()
                .then_some(RetryReason::PerTryTimeout),
            UpstreamFailureKind::SendTimeout { .. } => None,
        }?;
        failure
            .retry()
            .allows(
                request.method,
                request.body_repeatable,
                request.idempotency_key,
            )
            .then_some(reason)
    }

    /// Whether an answer may be dropped for another attempt: its status (or, for gRPC, the
    /// status of a trailers-only answer) is one the policy names, and the request is safe to
    /// repeat, since the target may have acted on it.
    pub fn after_answer(
        &self,
        status: StatusCode,
        headers: &HeaderMap,
        grpc: bool,
        request: &Resend<'_>,
    ) -> Result<Retriable, NotRetried> {
        let reason = self
            .names_status(status.as_u16())
            .then_some(RetryReason::Status)
            .or_else(|| {
                let grpc_status = grpc.then(|| grpc::status_in(headers)).flatten()?;
                self.names_grpc_status(grpc_status)
                    .then_some(RetryReason::GrpcStatus)
            })
            .ok_or(NotRetried::NotNamed)?;
        if !Retry::IfIdempotent.allows(
            request.method,
            request.body_repeatable,
            request.idempotency_key,
        ) {
            return Err(NotRetried::Unsafe);
        }
        let retry_after = match retry_after(headers) {
            Some(wait) if wait > Duration::from_millis(self.backoff.max_ms) => {
                return Err(NotRetried::RetryAfterTooLong)
            }
            wait => wait,
        };
        Ok(Retriable {
            reason,
            retry_after,
        })
    }

    /// Whether a request may be hedged: it must be safe to have two targets act on it at once,
    /// and its body must be at hand for both.
    pub fn hedges(&self, request: &Resend<'_>) -> Option<Duration> {
        let hedge_after = self.hedge_after?;
        (self.attempts > 1 && request.body_repeatable && is_idempotent(request.method))
            .then_some(hedge_after)
    }

    /// The wait before retry number `retry` (1 for the first): full jitter, a uniform draw
    /// from zero to the exponential step, capped.
    pub fn backoff(&self, retry: u32, draw: impl FnOnce(u64) -> u64) -> Duration {
        let step = self
            .backoff
            .base_ms
            .saturating_mul(1u64 << (retry.saturating_sub(1)).min(32))
            .min(self.backoff.max_ms);
        Duration::from_millis(draw(step).min(step))
    }

    /// The wait before retry number `retry`: the target's `Retry-After` when it gave one,
    /// else the jittered backoff.
    pub fn delay_before(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        retry_after.unwrap_or_else(|| self.backoff(retry, |step| fastrand::u64(0..=step)))
    }

    fn names_per_try_timeout(&self) -> bool {
        self.on.has(RetryOn::PerTryTimeout)
            || self.on.has(RetryOn::GatewayError)
            || self.on.has(RetryOn::FiveXx)
    }

    fn names_status(&self, status: u16) -> bool {
        (self.on.has(RetryOn::GatewayError) && matches!(status, 502..=504))
            || (self.on.has(RetryOn::FiveXx) && (500..=599).contains(&status))
            || (self.on.has(RetryOn::Retriable4xx) && status == 409)
            || (self.on.has(RetryOn::RetriableStatus) && self.statuses.contains(&status))
    }

    fn names_grpc_status(&self, status: u16) -> bool {
        match status {
            grpc::UNAVAILABLE => self.on.has(RetryOn::Unavailable),
            grpc::RESOURCE_EXHAUSTED => self.on.has(RetryOn::ResourceExhausted),
            grpc::DEADLINE_EXCEEDED => self.on.has(RetryOn::DeadlineExceeded),
            _ => false,
        }
    }
}

/// What decides whether a request can be sent again.
#[derive(Debug, Clone, Copy)]
pub struct Resend<'a> {
    pub method: &'a Method,
    /// The whole body is at hand to send again (none, or read ahead).
    pub body_repeatable: bool,
    /// The request carries `Idempotency-Key`.
    pub idempotency_key: bool,
}

/// The wait a `Retry-After` asks for: delay-seconds or an HTTP-date (RFC 9110 §10.2.3); a date
/// already passed asks for none, an unreadable value is ignored.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    let now = std::time::UNIX_EPOCH + Duration::from_millis(crate::clock::unix_ms());
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests;
