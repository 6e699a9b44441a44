//! A service's affinity settings (TRAFFIC.md §5): the hashing key and bounded load of
//! `ring_hash` and `maglev`, and cookie session persistence.

use super::route::{cookie_name, header_name, query_name};
use super::ValidationError;
use crate::model::{HashOn, Protocol, ServiceSpec};

/// Largest `hash_balance_factor`: 100 × the mean load is already no bound worth having.
const MAX_BALANCE_FACTOR: u32 = 10_000;
/// Longest session timeout: a year.
const MAX_SESSION_TIMEOUT_S: u64 = 365 * 24 * 3600;

pub(super) fn affinity(spec: &mut ServiceSpec) -> Result<(), ValidationError> {
    let streams = matches!(spec.protocol, Protocol::Tcp | Protocol::Tls);
    let hashing = spec.lb_policy.is_hashing();
    match &mut spec.hash_on {
        None if hashing => {
            return Err(ValidationError::new(
                "hash_on",
                format!(
                    "lb_policy {} needs hash_on: {{\"header\": name}}, {{\"cookie\": name}}, {{\"query\": name}} or \"client_ip\"",
                    spec.lb_policy.as_str()
                ),
            ));
        }
        Some(_) if !hashing => {
            return Err(ValidationError::new(
                "hash_on",
                "hash_on is for lb_policy ring_hash or maglev",
            ));
        }
        Some(HashOn::ClientIp) | None => {}
        Some(_) if streams => {
            return Err(ValidationError::new(
                "hash_on",
                "a tcp or tls service can hash only on \"client_ip\"",
            ));
        }
        Some(HashOn::Header(name)) => *name = valid("hash_on.header", name, header_name)?,
        Some(HashOn::Cookie(name)) => *name = valid("hash_on.cookie", name, cookie_name)?,
        Some(HashOn::Query(name)) => *name = valid("hash_on.query", name, query_name)?,
    }
    if let Some(factor) = spec.hash_balance_factor {
        if !hashing {
            return Err(ValidationError::new(
                "hash_balance_factor",
                "hash_balance_factor is for lb_policy ring_hash or maglev",
            ));
        }
        if !(100..=MAX_BALANCE_FACTOR).contains(&factor) {
            return Err(ValidationError::new(
                "hash_balance_factor",
                format!("hash_balance_factor must be from 100 to {MAX_BALANCE_FACTOR} (percent of the mean load)"),
            ));
        }
    }
    if let Some(persistence) = &mut spec.session_persistence {
        if streams {
            return Err(ValidationError::new(
                "session_persistence",
                "session_persistence needs HTTP: a tcp or tls service carries no cookie",
            ));
        }
        persistence.cookie = valid(
            "session_persistence.cookie",
            &persistence.cookie,
            cookie_name,
        )?;
        for (field, timeout) in [
            (
                "session_persistence.absolute_timeout_s",
                persistence.absolute_timeout_s,
            ),
            (
                "session_persistence.idle_timeout_s",
                persistence.idle_timeout_s,
            ),
        ] {
            if let Some(seconds) = timeout {
                if !(1..=MAX_SESSION_TIMEOUT_S).contains(&seconds) {
                    return Err(ValidationError::new(
                        field,
                        format!("{field} must be from 1 to {MAX_SESSION_TIMEOUT_S} seconds"),
                    ));
                }
            }
        }
    }
    Ok(())
}

fn valid(
    field: &str,
    name: &str,
    check: fn(&str) -> Option<String>,
) -> Result<String, ValidationError> {
    check(name).ok_or_else(|| {
        ValidationError::new(field, format!("{name:?} is not a valid name for {field}"))
    })
}
