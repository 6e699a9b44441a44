//! A route's limits (TRAFFIC.md §6): its request rate per key and its requests in flight.

use super::route::header_name;
use super::ValidationError;
use crate::model::{RateLimit, RateLimitKey};

/// Fastest rate a route may ask for, per key.
const MAX_REQUESTS_PER_SECOND: f64 = 1_000_000.0;
const MAX_BURST: u32 = 1_000_000;
/// Each key takes 32 bytes whether used or not: a million keys is 32 MiB per route.
const MAX_KEYS: u32 = 1_000_000;
const MAX_IN_FLIGHT: u32 = 1_000_000;

pub fn rate_limit(rate_limit: &mut RateLimit) -> Result<(), ValidationError> {
    let rate = rate_limit.requests_per_second;
    if !(rate.is_finite() && rate > 0.0 && rate <= MAX_REQUESTS_PER_SECOND) {
        return Err(ValidationError::new(
            "rate_limit.requests_per_second",
            format!("greater than 0, at most {MAX_REQUESTS_PER_SECOND}"),
        ));
    }
    // One request a day is the slowest rate a key's table keeps time for.
    if rate < 1.0 / 86_400.0 {
        return Err(ValidationError::new(
            "rate_limit.requests_per_second",
            "at least one request a day (0.0000116)",
        ));
    }
    if let Some(burst) = rate_limit.burst {
        if !(1..=MAX_BURST).contains(&burst) {
            return Err(ValidationError::new(
                "rate_limit.burst",
                format!("1 to {MAX_BURST}, or null for one second's worth"),
            ));
        }
    }
    if let RateLimitKey::Header(name) = &mut rate_limit.key {
        *name = header_name(name).ok_or_else(|| {
            ValidationError::new("rate_limit.key.header", "not a valid header name")
        })?;
    }
    if !(1..=MAX_KEYS).contains(&rate_limit.max_keys) {
        return Err(ValidationError::new(
            "rate_limit.max_keys",
            format!("1 to {MAX_KEYS}"),
        ));
    }
    Ok(())
}

pub fn max_in_flight(max_in_flight: Option<u32>) -> Result<(), ValidationError> {
    match max_in_flight {
        Some(limit) if !(1..=MAX_IN_FLIGHT).contains(&limit) => Err(ValidationError::new(
            "max_in_flight",
            format!("1 to {MAX_IN_FLIGHT}, or null for no limit"),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RateLimitScope;

    fn limit() -> RateLimit {
        RateLimit {
            requests_per_second: 10.0,
            burst: None,
            key: RateLimitKey::ClientIp,
            scope: RateLimitScope::Instance,
            max_keys: 100,
        }
    }

    fn field_of(mut rate_limit: RateLimit) -> String {
        self::rate_limit(&mut rate_limit).unwrap_err().field
    }

    #[test]
    fn each_bad_field_is_named() {
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY, 2e6, 1e-6] {
            assert_eq!(
                field_of(RateLimit {
                    requests_per_second: rate,
                    ..limit()
                }),
                "rate_limit.requests_per_second",
                "{rate}"
            );
        }
        assert_eq!(
            field_of(RateLimit {
                burst: Some(0),
                ..limit()
            }),
            "rate_limit.burst"
        );
        assert_eq!(
            field_of(RateLimit {
                key: RateLimitKey::Header("bad header".to_owned()),
                ..limit()
            }),
            "rate_limit.key.header"
        );
        for max_keys in [0, 1_000_001] {
            assert_eq!(
                field_of(RateLimit {
                    max_keys,
                    ..limit()
                }),
                "rate_limit.max_keys"
            );
        }
        assert_eq!(max_in_flight(Some(0)).unwrap_err().field, "max_in_flight");
        assert!(max_in_flight(None).is_ok());
        assert!(max_in_flight(Some(1)).is_ok());
    }

    #[test]
    fn a_header_key_is_kept_in_lower_case() {
        let mut rate_limit = RateLimit {
            key: RateLimitKey::Header("X-Api-Key".to_owned()),
            ..limit()
        };
        self::rate_limit(&mut rate_limit).unwrap();
        assert_eq!(rate_limit.key, RateLimitKey::Header("x-api-key".to_owned()));
    }
}
