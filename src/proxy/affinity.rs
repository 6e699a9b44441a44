//! Affinity of a request (TRAFFIC.md §5): the hash key a hashing policy picks by, and the
//! session cookie that pins a client to a target, read before the pick and renewed after the
//! answer.

use std::net::IpAddr;
use std::sync::atomic::Ordering;

use http::header::SET_COOKIE;
use http::{HeaderMap, HeaderValue};

use super::session_cookie::SessionCookie;
use crate::balance::key_hash;
use crate::model::{HashOn, Id, SessionPersistence};
use crate::snapshot::{cookie_value, query_value, BackendRuntime, Preference, ServiceRuntime};

/// What a request brings to its service's pick, and what its answer must say back.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Affinity {
    pub preference: Preference,
    /// The live session the request's cookie holds for this service.
    session: Option<SessionCookie>,
}

/// The request's facts affinity may read.
pub(super) struct Asked<'a> {
    pub headers: &'a HeaderMap,
    pub query: Option<&'a str>,
    pub client: IpAddr,
}

impl Affinity {
    /// Affinity for a request to `service`; nothing is read unless the service hashes or keeps
    /// sessions.
    pub(super) fn of(service: &ServiceRuntime, asked: &Asked<'_>) -> Affinity {
        let config = &service.service;
        let hash = match &config.hash_on {
            Some(on) if config.lb_policy.is_hashing() => request_key_hash(on, asked),
            _ => None,
        };
        let session = config.session_persistence.as_ref().and_then(|persistence| {
            live_session(persistence, service.service.id, asked.headers, now_s())
        });
        Affinity {
            preference: Preference {
                pinned: session.map(|session| session.target_id),
                hash,
            },
            session,
        }
    }

    /// After `target` answered: a `Set-Cookie` starting or renewing the session when it needs
    /// one (a new session, a re-pinned one, or an idle timeout to push back), and the count of
    /// sessions whose target could not take them.
    pub(super) fn answered(
        &self,
        service: &ServiceRuntime,
        target: Id,
        over_tls: bool,
        headers: &mut HeaderMap,
    ) {
        let Some(persistence) = &service.service.session_persistence else {
            return;
        };
        let now = now_s();
        let cookie = match self.session {
            Some(session) if session.target_id == target => {
                if persistence.idle_timeout_s.is_none() {
                    return;
                }
                SessionCookie {
                    used_s: now,
                    ..session
                }
            }
            repinned => {
                if repinned.is_some() {
                    service
                        .counters
                        .sessions_repinned
                        .fetch_add(1, Ordering::Relaxed);
                }
                SessionCookie {
                    service_id: service.service.id,
                    target_id: target,
                    began_s: now,
                    used_s: now,
                }
            }
        };
        if let Ok(value) = HeaderValue::from_str(&set_cookie(persistence, &cookie, now, over_tls)) {
            headers.append(SET_COOKIE, value);
        }
    }
}

/// The backend of a route with several that a live session cookie pins the request to: one
/// whose service keeps sessions, with weight > 0, whose subset holds the cookie's target and
/// where that target takes the session now. A session stays with its backend whatever the
/// weights say; one whose backend cannot take it is picked anew by weight (and re-pinned).
pub(super) fn pinned_backend<'a>(
    backends: &'a [BackendRuntime],
    headers: &HeaderMap,
) -> Option<&'a BackendRuntime> {
    if backends.len() < 2 {
        return None;
    }
    let mut now = None;
    backends.iter().find(|backend| {
        let service = &backend.service;
        let Some(persistence) = &service.service.session_persistence else {
            return false;
        };
        if backend.weight == 0 {
            return false;
        }
        let now = *now.get_or_insert_with(now_s);
        live_session(persistence, service.service.id, headers, now).is_some_and(|session| {
            service.takes_session(session.target_id, backend.subset.as_ref())
        })
    })
}

/// The service's session in the request's cookie, unless it timed out.
fn live_session(
    persistence: &SessionPersistence,
    service_id: Id,
    headers: &HeaderMap,
    now: u32,
) -> Option<SessionCookie> {
    let session = SessionCookie::decode(cookie_value(headers, &persistence.cookie)?)?;
    if session.service_id != service_id {
        return None;
    }
    let over = |since: u32, limit: Option<u64>| {
        limit.is_some_and(|limit| u64::from(now.saturating_sub(since)) >= limit)
    };
    // A time ahead of the clock was not written by any gateway of a sane fleet: it would keep
    // a session from ever timing out.
    let ahead = |time: u32| time > now.saturating_add(300);
    if ahead(session.began_s)
        || ahead(session.used_s)
        || over(session.began_s, persistence.absolute_timeout_s)
        || over(session.used_s, persistence.idle_timeout_s)
    {
        return None;
    }
    Some(session)
}

/// The hash of the request's key, None when the request does not carry it (then the pick is
/// round robin).
fn request_key_hash(on: &HashOn, asked: &Asked<'_>) -> Option<u64> {
    match on {
        HashOn::Header(name) => asked
            .headers
            .get(name.as_str())
            .map(|value| key_hash(value.as_bytes())),
        HashOn::Cookie(name) => cookie_value(asked.headers, name).map(|v| key_hash(v.as_bytes())),
        HashOn::Query(name) => query_value(asked.query, name).map(|v| key_hash(v.as_bytes())),
        HashOn::ClientIp => Some(crate::balance::ip_hash(asked.client)),
    }
}

/// `name=value; Path=/; Max-Age=…; HttpOnly; SameSite=Lax[; Secure]`. Max-Age is what is left
/// of the session by either timeout; none: the session lasts as long as the browser's.
fn set_cookie(
    persistence: &SessionPersistence,
    cookie: &SessionCookie,
    now: u32,
    over_tls: bool,
) -> String {
    let idle_left = persistence.idle_timeout_s;
    let absolute_left = persistence
        .absolute_timeout_s
        .map(|limit| limit.saturating_sub(u64::from(now.saturating_sub(cookie.began_s))));
    let max_age = match (idle_left, absolute_left) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    let mut text = format!("{}={}; Path=/", persistence.cookie, cookie.encode());
    if let Some(seconds) = max_age {
        text.push_str(&format!("; Max-Age={seconds}"));
    }
    text.push_str("; HttpOnly; SameSite=Lax");
    if over_tls {
        text.push_str("; Secure");
    }
    text
}

fn now_s() -> u32 {
    u32::try_from(crate::clock::unix_ms() / 1000).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn persistence(absolute: Option<u64>, idle: Option<u64>) -> SessionPersistence {
        SessionPersistence {
            cookie: "sticky".into(),
            absolute_timeout_s: absolute,
            idle_timeout_s: idle,
        }
    }

    fn headers_with(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::COOKIE,
            HeaderValue::from_str(&format!("a=b; sticky={value}")).unwrap(),
        );
        headers
    }

    fn cookie(service_id: Id, began_s: u32, used_s: u32) -> SessionCookie {
        SessionCookie {
            service_id,
            target_id: 42,
            began_s,
            used_s,
        }
    }

    #[test]
    fn a_session_holds_within_both_timeouts_and_for_its_own_service_only() {
        let now = 1_000_000;
        let p = persistence(Some(3600), Some(60));
        let live = cookie(5, now - 3000, now - 59);
        let headers = headers_with(&live.encode());
        assert_eq!(live_session(&p, 5, &headers, now), Some(live));
        assert_eq!(
            live_session(&p, 6, &headers, now),
            None,
            "another service's"
        );
        let idle = headers_with(&cookie(5, now - 100, now - 60).encode());
        assert_eq!(live_session(&p, 5, &idle, now), None, "idle timeout");
        let old = headers_with(&cookie(5, now - 3600, now).encode());
        assert_eq!(live_session(&p, 5, &old, now), None, "absolute timeout");
        let future = headers_with(&cookie(5, now + 301, now).encode());
        assert_eq!(live_session(&p, 5, &future, now), None, "from the future");
        let used_later = headers_with(&cookie(5, now - 10, now + 301).encode());
        assert_eq!(
            live_session(&p, 5, &used_later, now),
            None,
            "last used in the future"
        );
        assert_eq!(
            live_session(&persistence(None, None), 5, &old, now),
            Some(cookie(5, now - 3600, now))
        );
        assert_eq!(live_session(&p, 5, &headers_with("10.0.0.1:80"), now), None);
    }

    #[test]
    fn max_age_is_what_is_left_of_the_session() {
        let now = 1_000_000;
        let c = cookie(5, now - 3500, now);
        let text = set_cookie(&persistence(Some(3600), Some(600)), &c, now, true);
        assert_eq!(
            text,
            format!(
                "sticky={}; Path=/; Max-Age=100; HttpOnly; SameSite=Lax; Secure",
                c.encode()
            )
        );
        let text = set_cookie(&persistence(None, None), &c, now, false);
        assert_eq!(
            text,
            format!("sticky={}; Path=/; HttpOnly; SameSite=Lax", c.encode())
        );
    }
}
