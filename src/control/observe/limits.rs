//! Routes' limits tripping and clearing (TRAFFIC.md §1, "Visible"): the request path only
//! counts refusals in the route's atomics; each runtime look compares the counts with the last
//! ones, so a limit that starts refusing is one event, however many requests it refuses, and one
//! more once it has refused none for [`QUIET_BEFORE_CLEARED`].

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::Observer;
use crate::events::{EventBody, RouteChangeKind, RouteEvent, RouteLimit};
use crate::model::{Id, RateLimit, RateLimitKey, RateLimitScope};
use crate::snapshot::{RouteEntry, Snapshot};

/// How long a tripped limit must refuse nothing to be reported cleared: long enough that a
/// client retrying after `Retry-After` does not flap it, short enough to tell an operator
/// the pressure is over.
pub(super) const QUIET_BEFORE_CLEARED: Duration = Duration::from_secs(10);

/// One limit of one route as last looked at.
#[derive(Debug)]
pub(super) struct LimitWatch {
    /// The limit's refusal counter at the last look.
    count: u64,
    looked_at: Instant,
    /// The last look that saw refusals, while the limit is tripped.
    refusing_at: Option<Instant>,
}

/// A limit that tripped or cleared at a look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Turn {
    /// It refused `refused` requests in `over` after refusing none.
    Tripped { refused: u64, over: Duration },
    /// It refused none for [`QUIET_BEFORE_CLEARED`].
    Cleared,
}

impl LimitWatch {
    /// Watches from `count` on.
    pub(super) fn new(count: u64, now: Instant) -> LimitWatch {
        LimitWatch {
            count,
            looked_at: now,
            refusing_at: None,
        }
    }

    pub(super) fn tripped(&self) -> bool {
        self.refusing_at.is_some()
    }

    /// The limit is off: its counter stands still, and a tripped limit is cleared.
    pub(super) fn turn_off(&mut self, now: Instant) -> bool {
        self.looked_at = now;
        self.refusing_at.take().is_some()
    }

    /// Takes the counter's value at `now`; says whether the limit tripped or cleared.
    pub(super) fn look(&mut self, count: u64, now: Instant) -> Option<Turn> {
        let refused = count.saturating_sub(self.count);
        let over = now.saturating_duration_since(self.looked_at);
        self.count = count;
        self.looked_at = now;
        if refused > 0 {
            return self
                .refusing_at
                .replace(now)
                .is_none()
                .then_some(Turn::Tripped { refused, over });
        }
        match self.refusing_at {
            Some(last) if now.saturating_duration_since(last) >= QUIET_BEFORE_CLEARED => {
                self.refusing_at = None;
                Some(Turn::Cleared)
            }
            _ => None,
        }
    }
}

/// What the observer keeps per limit of a route, beside its watch, to name it once it is gone.
#[derive(Debug)]
pub(super) struct WatchedLimit {
    watch: LimitWatch,
    name: String,
    service_id: Option<Id>,
}

impl Observer {
    /// Looks at every route's limits; records each that tripped or cleared since the last look.
    ///
    /// A limit first seen is watched from 0: its route is new, or the gateway is, so every
    /// refusal counted is news (a short burst at a new route still trips it). A watch
    /// lives as long as its route, the limit on or off: the counter stands still while it is
    /// off, and its old value is no news when the limit is set again.
    pub(in crate::control) fn report_limits(&mut self, snapshot: &Snapshot, now: Instant) {
        if !self.primed {
            return;
        }
        let mut present = HashSet::new();
        for entry in snapshot.routes() {
            for (limit, on, count) in limit_counts(entry) {
                let key = (entry.route.id, limit);
                if !on && !self.limits.contains_key(&key) {
                    continue;
                }
                present.insert(key);
                let Some(watched) = self.limits.get_mut(&key) else {
                    // Refusals already counted are told at the next look, over its interval.
                    self.limits.insert(
                        key,
                        WatchedLimit {
                            watch: LimitWatch::new(0, now),
                            name: entry.route.name.clone(),
                            service_id: entry.route.service_id,
                        },
                    );
                    continue;
                };
                watched.name.clone_from(&entry.route.name);
                watched.service_id = entry.route.service_id;
                if !on {
                    if watched.watch.turn_off(now) {
                        let reason = format!("the route's {} was removed", limit.as_str());
                        self.record_limit(key, RouteChangeKind::Cleared, 0, count, reason);
                    }
                    continue;
                }
                let Some(turn) = watched.watch.look(count, now) else {
                    continue;
                };
                let (change, refused, reason) = match turn {
                    Turn::Tripped { refused, over } => (
                        RouteChangeKind::Tripped,
                        refused,
                        tripped_reason(entry, limit, refused, over),
                    ),
                    Turn::Cleared => (
                        RouteChangeKind::Cleared,
                        0,
                        format!(
                            "no request refused for {} s",
                            QUIET_BEFORE_CLEARED.as_secs()
                        ),
                    ),
                };
                self.record_limit(key, change, refused, count, reason);
            }
        }
        let mut gone: Vec<(Id, RouteLimit)> = self
            .limits
            .keys()
            .filter(|key| !present.contains(*key))
            .copied()
            .collect();
        gone.sort_unstable();
        for key in gone {
            let watched = &self.limits[&key];
            if watched.watch.tripped() {
                let count = watched.watch.count;
                let reason = "the route was deleted".to_owned();
                self.record_limit(key, RouteChangeKind::Cleared, 0, count, reason);
            }
            self.limits.remove(&key);
        }
    }

    fn record_limit(
        &self,
        (route_id, limit): (Id, RouteLimit),
        change: RouteChangeKind,
        refused: u64,
        refused_total: u64,
        reason: String,
    ) {
        let Some(watched) = self.limits.get(&(route_id, limit)) else {
            return;
        };
        self.log.record(
            watched.service_id,
            EventBody::Route(RouteEvent {
                route_id,
                name: watched.name.clone(),
                change,
                limit,
                refused,
                refused_total,
                reason,
            }),
        );
    }
}

/// Each limit's refusal counter on `entry`, and whether the route has the limit now.
fn limit_counts(entry: &RouteEntry) -> [(RouteLimit, bool, u64); 2] {
    [
        (
            RouteLimit::RateLimit,
            entry.limiter.is_some(),
            entry.stats.rate_limited.load(Ordering::Relaxed),
        ),
        (
            RouteLimit::MaxInFlight,
            entry.route.max_in_flight.is_some(),
            entry.stats.in_flight_refused.load(Ordering::Relaxed),
        ),
    ]
}

fn tripped_reason(entry: &RouteEntry, limit: RouteLimit, refused: u64, over: Duration) -> String {
    let refusals = format!(
        "{refused} {} refused in {} ms",
        if refused == 1 { "request" } else { "requests" },
        over.as_millis()
    );
    match limit {
        RouteLimit::RateLimit => match &entry.limiter {
            Some(limiter) => format!(
                "{refusals}: {}",
                rate_text(limiter.spec(), limiter.default_rate())
            ),
            None => refusals,
        },
        RouteLimit::MaxInFlight => match entry.route.max_in_flight {
            Some(max) => format!("{refusals}: max_in_flight {max} reached"),
            None => refusals,
        },
    }
}

/// "over 5 requests per second per client IP, burst 5", and under `cluster` this gateway's
/// default share.
fn rate_text(spec: &RateLimit, default_rate: f64) -> String {
    let per = match &spec.key {
        RateLimitKey::ClientIp => "per client IP".to_owned(),
        RateLimitKey::Header(name) => format!("per {name} header"),
        RateLimitKey::Route => "for the whole route".to_owned(),
    };
    let mut text = format!(
        "over {} requests per second {per}, burst {}",
        spec.requests_per_second,
        spec.effective_burst()
    );
    if spec.scope == RateLimitScope::Cluster {
        text.push_str(&format!(
            " (cluster: this gateway's default share {} per second)",
            round_rate(default_rate)
        ));
    }
    text
}

/// Three significant decimals are plenty for a reason, and avoid 0.30000000000000004.
fn round_rate(rate: f64) -> f64 {
    (rate * 1000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::events::{EventLog, EventSettings};
    use crate::model::Route;
    use crate::snapshot::RouteStats;

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    #[test]
    fn a_limit_trips_once_and_clears_after_ten_quiet_seconds() {
        let start = Instant::now();
        let mut watch = LimitWatch::new(4, start);
        assert_eq!(
            watch.look(4, at(start, 250)),
            None,
            "refusals before it are old"
        );
        assert_eq!(
            watch.look(10, at(start, 500)),
            Some(Turn::Tripped {
                refused: 6,
                over: Duration::from_millis(250)
            })
        );
        assert!(watch.tripped());
        // Refusing on: no new event, whatever the number.
        assert_eq!(watch.look(500, at(start, 750)), None);
        assert_eq!(watch.look(500, at(start, 1_000)), None);
        // A refusal 9.9 s into the quiet restarts it.
        assert_eq!(watch.look(500, at(start, 10_600)), None);
        assert_eq!(watch.look(501, at(start, 10_650)), None);
        assert_eq!(watch.look(501, at(start, 20_600)), None, "9.95 s quiet");
        assert_eq!(watch.look(501, at(start, 20_650)), Some(Turn::Cleared));
        assert!(!watch.tripped());
        assert_eq!(watch.look(501, at(start, 40_000)), None, "cleared once");
        assert_eq!(
            watch.look(502, at(start, 40_250)),
            Some(Turn::Tripped {
                refused: 1,
                over: Duration::from_millis(250)
            }),
            "and trips again"
        );
    }

    #[test]
    fn a_counter_that_went_back_is_no_refusal() {
        let start = Instant::now();
        let mut watch = LimitWatch::new(9, start);
        assert_eq!(watch.look(0, at(start, 250)), None);
        assert_eq!(
            watch.look(1, at(start, 500)),
            Some(Turn::Tripped {
                refused: 1,
                over: Duration::from_millis(250)
            })
        );
    }

    fn route_events(log: &EventLog, after: u64) -> Vec<RouteEvent> {
        use crate::events::variant_of;
        log.subscribe(Some(after))
            .backlog
            .unwrap()
            .iter()
            .map(|event| event.parsed())
            .filter(|(kind, _)| kind == "route")
            .map(|(_, data)| RouteEvent {
                route_id: data["route_id"].as_i64().unwrap(),
                name: data["name"].as_str().unwrap().to_owned(),
                change: variant_of(
                    &data["change"],
                    &[RouteChangeKind::Tripped, RouteChangeKind::Cleared],
                ),
                limit: variant_of(
                    &data["limit"],
                    &[RouteLimit::RateLimit, RouteLimit::MaxInFlight],
                ),
                refused: data["refused"].as_u64().unwrap(),
                refused_total: data["refused_total"].as_u64().unwrap(),
                reason: data["reason"].as_str().unwrap().to_owned(),
            })
            .collect()
    }

    /// Through the observer: one event when the limit starts refusing, none while it goes on,
    /// one after ten quiet seconds, and one when the route goes while it refuses.
    #[tokio::test(start_paused = true)]
    async fn the_observer_tells_each_limit_tripping_and_clearing_once() {
        let log = Arc::new(EventLog::new(EventSettings::default()));
        let mut observer = Observer::new(log.clone(), "me".into());
        observer.primed = true;
        let route = Route {
            id: 7,
            name: "api".into(),
            max_in_flight: Some(2),
            rate_limit: Some(RateLimit {
                requests_per_second: 5.0,
                burst: None,
                key: RateLimitKey::ClientIp,
                scope: RateLimitScope::Instance,
                max_keys: 10,
            }),
            ..Route::default()
        };
        let stats = Arc::new(RouteStats::default());
        let build = |generation: u64, routes: Vec<Route>| {
            Snapshot::with_route_stats(generation, Vec::new(), routes, |_| stats.clone())
        };
        let snapshot = build(1, vec![route.clone()]);
        let base = log.last_id();
        let tick = |observer: &mut Observer, snapshot: &Snapshot| {
            observer.report_limits(snapshot, Instant::now());
        };
        tick(&mut observer, &snapshot);
        let look = async |observer: &mut Observer, snapshot: &Snapshot| {
            tokio::time::advance(Duration::from_millis(250)).await;
            tick(observer, snapshot);
        };
        stats.in_flight_refused.fetch_add(3, Ordering::Relaxed);
        look(&mut observer, &snapshot).await;
        let events = route_events(&log, base);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(
            (events[0].route_id, events[0].name.as_str(), events[0].limit),
            (7, "api", RouteLimit::MaxInFlight)
        );
        assert_eq!(events[0].change, RouteChangeKind::Tripped);
        assert_eq!((events[0].refused, events[0].refused_total), (3, 3));
        assert_eq!(
            events[0].reason,
            "3 requests refused in 250 ms: max_in_flight 2 reached"
        );
        // Refusing for 5 s more: no event.
        for _ in 0..20 {
            stats.in_flight_refused.fetch_add(1, Ordering::Relaxed);
            look(&mut observer, &snapshot).await;
        }
        assert_eq!(route_events(&log, base).len(), 1);
        // 9.75 s quiet: still tripped; 10 s: cleared.
        for _ in 0..39 {
            look(&mut observer, &snapshot).await;
        }
        assert_eq!(route_events(&log, base).len(), 1);
        look(&mut observer, &snapshot).await;
        let events = route_events(&log, base);
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(events[1].change, RouteChangeKind::Cleared);
        assert_eq!((events[1].refused, events[1].refused_total), (0, 23));
        assert_eq!(events[1].reason, "no request refused for 10 s");

        // The rate limit trips; the route is deleted while it refuses.
        stats.rate_limited.fetch_add(1, Ordering::Relaxed);
        look(&mut observer, &snapshot).await;
        let events = route_events(&log, base);
        assert_eq!(events.len(), 3, "{events:?}");
        assert_eq!(
            (events[2].limit, events[2].change),
            (RouteLimit::RateLimit, RouteChangeKind::Tripped)
        );
        assert_eq!(
            events[2].reason,
            "1 request refused in 250 ms: over 5 requests per second per client IP, burst 5"
        );
        let empty = build(2, Vec::new());
        look(&mut observer, &empty).await;
        let events = route_events(&log, base);
        assert_eq!(events.len(), 4, "{events:?}");
        assert_eq!(
            (events[3].limit, events[3].change, events[3].reason.as_str()),
            (
                RouteLimit::RateLimit,
                RouteChangeKind::Cleared,
                "the route was deleted"
            )
        );
        assert!(observer.limits.is_empty());

        // Back (its counters are those of before), tripped, then its max_in_flight removed.
        look(&mut observer, &snapshot).await;
        stats.in_flight_refused.fetch_add(1, Ordering::Relaxed);
        look(&mut observer, &snapshot).await;
        let without = Route {
            max_in_flight: None,
            ..route.clone()
        };
        let unlimited = build(3, vec![without]);
        look(&mut observer, &unlimited).await;
        let events = route_events(&log, base);
        let told: Vec<_> = events[4..]
            .iter()
            .map(|e| (e.limit, e.change, e.refused, e.reason.as_str()))
            .collect();
        assert_eq!(
            told,
            [
                (
                    RouteLimit::RateLimit,
                    RouteChangeKind::Tripped,
                    1,
                    "1 request refused in 250 ms: over 5 requests per second per client IP, burst 5"
                ),
                (
                    RouteLimit::MaxInFlight,
                    RouteChangeKind::Tripped,
                    24,
                    "24 requests refused in 250 ms: max_in_flight 2 reached"
                ),
                (
                    RouteLimit::MaxInFlight,
                    RouteChangeKind::Cleared,
                    0,
                    "the route's max_in_flight was removed"
                ),
            ],
            "a route first seen is watched from 0"
        );
        // Set again: the refusals counted before are no news.
        look(&mut observer, &snapshot).await;
        look(&mut observer, &snapshot).await;
        assert_eq!(route_events(&log, base).len(), 7);
    }

    #[test]
    fn the_rate_reads_as_an_operator_wrote_it() {
        let spec = RateLimit {
            requests_per_second: 5.0,
            burst: None,
            key: RateLimitKey::Header("x-user".into()),
            scope: RateLimitScope::Cluster,
            max_keys: 10,
        };
        assert_eq!(
            rate_text(&spec, 1.0 / 3.0),
            "over 5 requests per second per x-user header, burst 5 \
             (cluster: this gateway's default share 0.333 per second)"
        );
        let spec = RateLimit {
            requests_per_second: 0.5,
            burst: Some(2),
            key: RateLimitKey::ClientIp,
            scope: RateLimitScope::Instance,
            max_keys: 10,
        };
        assert_eq!(
            rate_text(&spec, 0.5),
            "over 0.5 requests per second per client IP, burst 2"
        );
    }
}
