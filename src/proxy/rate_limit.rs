//! A route's `rate_limit` on the request path (TRAFFIC.md §6): the request's key is checked in
//! the route's table (`snapshot::rate_limit`) before its body is read or a target is picked;
//! a refusal answers 429 `rate_limited` with `Retry-After` and the quota in the IETF
//! `RateLimit-Policy` / `RateLimit` fields (draft-ietf-httpapi-ratelimit-headers).

use std::net::IpAddr;
use std::sync::atomic::Ordering;

use http::{HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;

use super::error::ProxyError;
use crate::snapshot::{Decision, RateLimiter, RouteEntry};

static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

const NANOS_PER_SECOND: u64 = 1_000_000_000;

/// Why and for how long a request's key is refused.
#[derive(Debug, Clone, PartialEq)]
pub struct Refusal {
    pub requests_per_second: f64,
    /// Whole seconds until a request of the key would be admitted (at least 1).
    pub retry_after_s: u64,
    /// Requests a key at rest may send at once.
    pub quota: u32,
    /// Seconds the quota takes to refill.
    pub window_s: u64,
    /// The request has a body, not read: its HTTP/1.1 connection cannot carry another request.
    pub with_body: bool,
}

impl Refusal {
    pub fn add_headers(&self, headers: &mut HeaderMap) {
        headers.insert(
            http::header::RETRY_AFTER,
            HeaderValue::from(self.retry_after_s),
        );
        let policy = format!("\"default\";q={};w={}", self.quota, self.window_s);
        let state = format!("\"default\";r=0;t={}", self.retry_after_s);
        for (name, value) in [(&RATELIMIT_POLICY, policy), (&RATELIMIT, state)] {
            if let Ok(value) = HeaderValue::try_from(value) {
                headers.insert(name.clone(), value);
            }
        }
    }
}

/// Admits the request or refuses it with the route's 429.
pub(super) fn check(
    route: &RouteEntry,
    limiter: &RateLimiter,
    headers: &HeaderMap,
    client: IpAddr,
    with_body: bool,
) -> Result<(), ProxyError> {
    let key = limiter.key_of(headers, client);
    match limiter.check(key, Instant::now()) {
        Decision::Admitted { .. } => Ok(()),
        Decision::Limited { retry_after_ns } => {
            route.stats.rate_limited.fetch_add(1, Ordering::Relaxed);
            let spec = limiter.spec();
            let quota = spec.effective_burst();
            Err(ProxyError::RateLimited {
                route: route.route.name.clone(),
                refusal: Refusal {
                    requests_per_second: spec.requests_per_second,
                    retry_after_s: retry_after_ns.div_ceil(NANOS_PER_SECOND).max(1),
                    quota,
                    window_s: (f64::from(quota) / spec.requests_per_second)
                        .ceil()
                        .max(1.0) as u64,
                    with_body,
                },
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_tells_when_to_come_back_and_the_quota() {
        let refusal = Refusal {
            requests_per_second: 10.0,
            retry_after_s: 3,
            quota: 20,
            window_s: 2,
            with_body: false,
        };
        let mut headers = HeaderMap::new();
        refusal.add_headers(&mut headers);
        assert_eq!(headers["retry-after"], "3");
        assert_eq!(headers["ratelimit-policy"], "\"default\";q=20;w=2");
        assert_eq!(headers["ratelimit"], "\"default\";r=0;t=3");
    }
}
