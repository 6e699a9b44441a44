use std::time::Duration;

use tokio::time::Instant;

use super::*;

fn limit(requests_per_second: f64, burst: Option<u32>) -> RateLimit {
    RateLimit {
        requests_per_second,
        burst,
        key: RateLimitKey::ClientIp,
        scope: RateLimitScope::Instance,
        max_keys: 1000,
    }
}

fn admitted(decision: Decision) -> bool {
    matches!(decision, Decision::Admitted { .. })
}

/// Requests of `key` admitted at once from now.
fn admitted_now(limiter: &RateLimiter, key: u64) -> usize {
    let now = Instant::now();
    (0..10_000)
        .take_while(|_| admitted(limiter.check(key, now)))
        .count()
}

#[tokio::test(start_paused = true)]
async fn a_key_at_rest_sends_its_burst_at_once_then_waits_one_interval() {
    let limiter = RateLimiter::new(&limit(10.0, Some(5)));
    let now = Instant::now();
    let decisions: Vec<_> = (0..5).map(|_| limiter.check(7, now)).collect();
    assert_eq!(
        decisions,
        (0..5)
            .rev()
            .map(|remaining| Decision::Admitted { remaining })
            .collect::<Vec<_>>()
    );
    assert_eq!(
        limiter.check(7, now),
        Decision::Limited {
            retry_after_ns: 100_000_000
        }
    );
    tokio::time::advance(Duration::from_millis(99)).await;
    assert!(!admitted(limiter.check(7, Instant::now())));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(admitted(limiter.check(7, Instant::now())));
    assert!(!admitted(limiter.check(7, Instant::now())));
    assert_eq!(limiter.admitted.load(Ordering::Relaxed), 6);
    assert_eq!(limiter.limited.load(Ordering::Relaxed), 3);
}

#[tokio::test(start_paused = true)]
async fn over_ten_seconds_a_busy_key_gets_the_rate_plus_its_burst() {
    let limiter = RateLimiter::new(&limit(100.0, Some(20)));
    let mut admitted_total = 0;
    // A request every millisecond: ten times the rate.
    for _ in 0..10_000 {
        if admitted(limiter.check(3, Instant::now())) {
            admitted_total += 1;
        }
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    assert!(
        (1019..=1021).contains(&admitted_total),
        "{admitted_total} admitted"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fractional_rate_admits_one_request_per_interval() {
    let limiter = RateLimiter::new(&limit(0.5, None));
    assert_eq!(limiter.spec().effective_burst(), 1);
    assert!(admitted(limiter.check(9, Instant::now())));
    assert_eq!(
        limiter.check(9, Instant::now()),
        Decision::Limited {
            retry_after_ns: 2_000_000_000
        }
    );
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(admitted(limiter.check(9, Instant::now())));
}

#[tokio::test(start_paused = true)]
async fn keys_are_limited_apart() {
    let limiter = RateLimiter::new(&limit(1.0, Some(3)));
    assert_eq!(admitted_now(&limiter, 100), 3);
    assert_eq!(admitted_now(&limiter, 200), 3);
    assert_eq!(limiter.keys(), 2);
}

#[test]
fn keys_come_from_the_client_a_header_or_the_route() {
    let client: std::net::IpAddr = "192.0.2.7".parse().unwrap();
    let other: std::net::IpAddr = "192.0.2.8".parse().unwrap();
    let mapped: std::net::IpAddr = "::ffff:192.0.2.7".parse().unwrap();
    let mut headers = http::HeaderMap::new();
    let by_ip = RateLimiter::new(&limit(1.0, None));
    assert_eq!(
        by_ip.key_of(&headers, client),
        by_ip.key_of(&headers, mapped)
    );
    assert_ne!(
        by_ip.key_of(&headers, client),
        by_ip.key_of(&headers, other)
    );

    let by_header = RateLimiter::new(&RateLimit {
        key: RateLimitKey::Header("X-Api-Key".to_owned()),
        ..limit(1.0, None)
    });
    // Without the header, the client's address.
    assert_eq!(
        by_header.key_of(&headers, client),
        by_ip.key_of(&headers, client)
    );
    headers.insert("x-api-key", "alpha".parse().unwrap());
    let alpha = by_header.key_of(&headers, client);
    assert_eq!(alpha, by_header.key_of(&headers, other));
    headers.insert("x-api-key", "beta".parse().unwrap());
    assert_ne!(alpha, by_header.key_of(&headers, client));
    assert!(alpha > ROUTE_KEY);

    let by_route = RateLimiter::new(&RateLimit {
        key: RateLimitKey::Route,
        ..limit(1.0, None)
    });
    assert_eq!(
        by_route.key_of(&headers, client),
        by_route.key_of(&headers, other)
    );
}

#[tokio::test(start_paused = true)]
async fn past_max_keys_the_idlest_key_is_forgotten_and_the_table_never_grows() {
    let limiter = RateLimiter::new(&RateLimit {
        max_keys: 8,
        ..limit(1.0, Some(2))
    });
    assert_eq!(limiter.capacity(), 8);
    // Key 1 is limited (its TAT runs ahead); the rest are one request in.
    assert_eq!(admitted_now(&limiter, 1), 2);
    for key in 2..=8 {
        assert!(admitted(limiter.check(key, Instant::now())));
    }
    tokio::time::advance(Duration::from_millis(10)).await;
    // Thousands of new keys, one request each: each takes the idlest slot, never key 1's.
    for key in 1000..5000 {
        assert!(admitted(limiter.check(key, Instant::now())));
    }
    assert_eq!(limiter.keys(), 8);
    assert!(limiter.evicted.load(Ordering::Relaxed) >= 3990);
    assert!(
        !admitted(limiter.check(1, Instant::now())),
        "the limited key kept its state"
    );
}

#[test]
fn a_table_of_max_keys_takes_32_bytes_a_key() {
    assert_eq!(std::mem::size_of::<Bucket>(), 32 * WAYS);
    let limiter = RateLimiter::new(&RateLimit {
        max_keys: 100_000,
        ..limit(1.0, None)
    });
    assert_eq!(limiter.capacity(), 100_000);
}

#[tokio::test(start_paused = true)]
async fn a_share_slows_its_key_and_keeps_its_burst_in_proportion() {
    let limiter = RateLimiter::new(&RateLimit {
        scope: RateLimitScope::Cluster,
        ..limit(100.0, Some(100))
    });
    // Known only once it has been seen.
    assert!(!limiter.set_share(5, Some(25.0)));
    assert!(admitted(limiter.check(5, Instant::now())));
    assert!(limiter.set_share(5, Some(25.0)));
    assert_eq!(limiter.rate_of_key(5), Some(25.0));
    tokio::time::advance(Duration::from_secs(10)).await;
    // A quarter of the rate, a quarter of the burst.
    assert_eq!(admitted_now(&limiter, 5), 25);
    // A share above the whole rate is held to it.
    assert!(limiter.set_share(5, Some(1000.0)));
    assert_eq!(limiter.rate_of_key(5), Some(100.0));
    assert!(limiter.set_share(5, None));
    limiter.set_default_rate(50.0);
    assert_eq!(limiter.rate_of_key(5), Some(50.0));
    assert_eq!(limiter.default_rate(), 50.0);
}

#[tokio::test(start_paused = true)]
async fn a_share_below_one_burst_still_admits_a_request_per_interval() {
    let limiter = RateLimiter::new(&limit(10.0, Some(1)));
    assert!(admitted(limiter.check(4, Instant::now())));
    assert!(limiter.set_share(4, Some(1.0)));
    tokio::time::advance(Duration::from_secs(5)).await;
    assert!(admitted(limiter.check(4, Instant::now())));
    tokio::time::advance(Duration::from_millis(999)).await;
    assert!(!admitted(limiter.check(4, Instant::now())));
    tokio::time::advance(Duration::from_millis(1)).await;
    assert!(admitted(limiter.check(4, Instant::now())));
}

#[tokio::test(start_paused = true)]
async fn under_cluster_scope_the_offered_requests_are_counted_and_taken() {
    let limiter = RateLimiter::new(&RateLimit {
        scope: RateLimitScope::Cluster,
        ..limit(1.0, Some(1))
    });
    for _ in 0..5 {
        limiter.check(11, Instant::now());
    }
    limiter.check(12, Instant::now());
    assert!(limiter.set_share(12, Some(0.5)));
    let mut uses = Vec::new();
    limiter.take_use(Instant::now(), |used| uses.push(used));
    uses.sort_by_key(|used| used.key);
    assert_eq!(
        uses,
        vec![
            KeyUse {
                key: 11,
                offered: 5,
                shared: false,
                near_limit: true
            },
            KeyUse {
                key: 12,
                offered: 1,
                shared: true,
                near_limit: true
            }
        ]
    );
    let mut again = Vec::new();
    limiter.take_use(Instant::now(), |used| again.push(used));
    assert_eq!(
        again,
        vec![KeyUse {
            key: 12,
            offered: 0,
            shared: true,
            near_limit: true
        }]
    );
}

#[tokio::test(start_paused = true)]
async fn a_key_is_near_its_limit_once_refused_or_past_half_its_burst() {
    let limiter = RateLimiter::new(&RateLimit {
        scope: RateLimitScope::Cluster,
        ..limit(10.0, Some(10))
    });
    let near = |limiter: &RateLimiter| {
        let mut near = Vec::new();
        limiter.take_use(Instant::now(), |used| {
            near.push((used.key, used.near_limit))
        });
        near
    };
    for _ in 0..5 {
        limiter.check(1, Instant::now());
    }
    assert_eq!(near(&limiter), vec![(1, false)], "half the burst spent");
    limiter.check(1, Instant::now());
    assert_eq!(near(&limiter), vec![(1, true)], "more than half");
    tokio::time::advance(Duration::from_secs(1)).await;
    limiter.check(1, Instant::now());
    assert_eq!(near(&limiter), vec![(1, false)], "refilled");
    // A refusal counts even when the key has refilled by the time the count is taken.
    let slow = RateLimiter::new(&RateLimit {
        scope: RateLimitScope::Cluster,
        ..limit(10.0, Some(1))
    });
    slow.check(2, Instant::now());
    slow.check(2, Instant::now());
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(near(&slow), vec![(2, true)]);
    assert_eq!(near(&slow), vec![]);
}

#[tokio::test(start_paused = true)]
async fn instance_scope_counts_nothing_for_the_control_task() {
    let limiter = RateLimiter::new(&limit(1.0, Some(1)));
    limiter.check(11, Instant::now());
    let mut uses = Vec::new();
    limiter.take_use(Instant::now(), |used| uses.push(used));
    assert!(uses.is_empty());
}
