use std::sync::Arc;
use std::thread;

use super::*;

const POLICIES: [LbPolicy; 3] = [
    LbPolicy::RoundRobin,
    LbPolicy::Random,
    LbPolicy::LeastRequest,
];

/// Members from (weight, priority) pairs, each with its own idle load.
fn members(spec: &[(u32, i32)]) -> Vec<Member> {
    spec.iter()
        .map(|&(weight, priority)| Member {
            weight,
            priority,
            load: Arc::default(),
            identity: 0,
        })
        .collect()
}

/// How often each member is picked over `picks` picks.
fn counts(balancer: &Balancer, picks: usize, skip: impl Fn(usize) -> bool) -> Vec<usize> {
    let mut counts = vec![0; balancer.weights.len()];
    for _ in 0..picks {
        counts[balancer.pick(&skip).expect("a member is available")] += 1;
    }
    counts
}

fn share(counts: &[usize], id: usize) -> f64 {
    counts[id] as f64 / counts.iter().sum::<usize>() as f64
}

fn assert_share(counts: &[usize], id: usize, expected: f64, tolerance: f64) {
    let actual = share(counts, id);
    assert!(
        (actual - expected).abs() <= tolerance,
        "member {id}: share {actual:.4}, expected {expected} ± {tolerance} ({counts:?})"
    );
}

fn schedule_of(balancer: &Balancer, tier: usize) -> &[u32] {
    match &balancer.tiers[tier].chooser {
        Chooser::RoundRobin(schedule) => schedule.entries(),
        _ => panic!("not round-robin"),
    }
}

#[test]
fn smooth_round_robin_5_1_1_is_nginx_sequence() {
    fastrand::seed(1);
    let balancer = Balancer::new(LbPolicy::RoundRobin, members(&[(5, 0), (1, 0), (1, 0)]));
    let expected: [usize; 7] = [0, 0, 1, 0, 2, 0, 0];
    assert_eq!(schedule_of(&balancer, 0), [0, 0, 1, 0, 2, 0, 0]);
    // The cursor starts anywhere, so picks are the cycle from some offset, then repeat it.
    let picks: Vec<usize> = (0..14).map(|_| balancer.pick(|_| false).unwrap()).collect();
    let offset = (0..7)
        .find(|&o| (0..14).all(|k| picks[k] == expected[(o + k) % 7]))
        .unwrap_or_else(|| panic!("{picks:?} is not a rotation of {expected:?}"));
    assert!(offset < 7);
}

#[test]
fn round_robin_1_to_3_is_exact_over_whole_cycles() {
    fastrand::seed(2);
    let balancer = Balancer::new(LbPolicy::RoundRobin, members(&[(1, 0), (3, 0)]));
    for cycles in [1, 10, 2_500] {
        let counts = counts(&balancer, 4 * cycles, |_| false);
        assert_eq!(counts, vec![cycles, 3 * cycles]);
    }
    // Interleaved, not bursts: member 0 never appears twice in a row.
    let schedule = schedule_of(&balancer, 0);
    assert_eq!(schedule.iter().filter(|&&id| id == 0).count(), 1);
}

#[test]
fn weight_zero_is_never_picked() {
    fastrand::seed(3);
    for policy in POLICIES {
        let balancer = Balancer::new(policy, members(&[(0, 0), (2, 0), (0, 0), (1, 0)]));
        assert_eq!(balancer.len(), 2);
        let counts = counts(&balancer, 3_000, |_| false);
        assert_eq!((counts[0], counts[2]), (0, 0), "{policy:?}");
        // Even when the weighted member is skipped, the weight-0 ones stay out.
        assert_eq!(balancer.pick(|id| id == 1), Some(3), "{policy:?}");
        assert_eq!(balancer.pick(|id| id == 1 || id == 3), None, "{policy:?}");
    }
}

#[test]
fn only_weight_zero_members_pick_none() {
    for policy in POLICIES {
        let balancer = Balancer::new(policy, members(&[(0, 0), (0, 5)]));
        assert!(balancer.is_empty());
        assert_eq!(balancer.len(), 0);
        assert_eq!(balancer.pick(|_| false), None);
        assert_eq!(balancer.policy(), policy);
        let empty = Balancer::new(policy, Vec::new());
        assert!(empty.is_empty());
        assert_eq!(empty.pick(|_| false), None);
    }
}

#[test]
fn tier_failover_across_three_tiers() {
    fastrand::seed(4);
    // Given out of priority order on purpose, with a negative priority as the best tier.
    let spec = [(1, 10), (1, -1), (1, 20), (1, 10), (1, -1)];
    let tier0 = |id: usize| id == 1 || id == 4;
    let tier10 = |id: usize| id == 0 || id == 3;
    for policy in POLICIES {
        let balancer = Balancer::new(policy, members(&spec));
        let all = counts(&balancer, 2_000, |_| false);
        assert_eq!(
            all[1] + all[4],
            2_000,
            "{policy:?}: only the best tier {all:?}"
        );
        let no_tier0 = counts(&balancer, 2_000, tier0);
        assert_eq!(no_tier0[0] + no_tier0[3], 2_000, "{policy:?}: {no_tier0:?}");
        let only_last = counts(&balancer, 500, |id| tier0(id) || tier10(id));
        assert_eq!(only_last[2], 500, "{policy:?}");
        // One member left in tier 0 keeps all the traffic there.
        let one_left = counts(&balancer, 1_000, |id| id == 1);
        assert_eq!(one_left[4], 1_000, "{policy:?}");
        assert_eq!(balancer.pick(|_| true), None, "{policy:?}");
    }
}

#[test]
fn weight_never_crosses_tiers() {
    fastrand::seed(5);
    for policy in POLICIES {
        let balancer = Balancer::new(policy, members(&[(1_000_000, 1), (1, 0)]));
        let counts = counts(&balancer, 2_000, |_| false);
        assert_eq!(counts, vec![0, 2_000], "{policy:?}");
    }
}

#[test]
fn skipped_members_share_goes_to_the_rest_by_weight() {
    fastrand::seed(6);
    // Member 0 is skipped; the others are 1:2:5 in weight.
    let spec = [(4, 0), (1, 0), (2, 0), (5, 0), (100, 1)];
    for policy in POLICIES {
        let balancer = Balancer::new(policy, members(&spec));
        let counts = counts(&balancer, 40_000, |id| id == 0);
        assert_eq!(counts[0] + counts[4], 0, "{policy:?}: {counts:?}");
        if policy == LbPolicy::LeastRequest {
            // Idle members: the +1 rule prefers the heavier of two draws, checked below.
            continue;
        }
        assert_share(&counts, 1, 1.0 / 8.0, 0.03);
        assert_share(&counts, 2, 2.0 / 8.0, 0.03);
        assert_share(&counts, 3, 5.0 / 8.0, 0.03);
    }
}

/// Cycle 1,1,2 is `c a b c`: handing a skipped `a`'s slot to its successor in the cycle would
/// give `b` and `c` 1:1 instead of their 1:2 weights.
#[test]
fn skipped_slot_is_not_handed_to_its_successor() {
    fastrand::seed(12);
    let balancer = Balancer::new(LbPolicy::RoundRobin, members(&[(1, 0), (1, 0), (2, 0)]));
    assert_eq!(schedule_of(&balancer, 0), [2, 0, 1, 2]);
    let counts = counts(&balancer, 30_000, |id| id == 0);
    assert_share(&counts, 1, 1.0 / 3.0, 0.02);
    assert_share(&counts, 2, 2.0 / 3.0, 0.02);
}

#[test]
fn random_1_to_3_within_3_points() {
    fastrand::seed(7);
    let balancer = Balancer::new(LbPolicy::Random, members(&[(1, 0), (3, 0)]));
    let counts = counts(&balancer, 40_000, |_| false);
    assert_share(&counts, 0, 0.25, 0.03);
    assert_share(&counts, 1, 0.75, 0.03);
}

#[test]
fn least_request_prefers_fewer_in_flight() {
    fastrand::seed(8);
    let spec = [(1, 0), (1, 0), (1, 0)];
    let members = members(&spec);
    for _ in 0..50 {
        members[0].load.start_request();
        members[1].load.start_request();
    }
    let balancer = Balancer::new(LbPolicy::LeastRequest, members);
    let counts = counts(&balancer, 10_000, |_| false);
    // Member 2 loses only when neither of the two (distinct) draws is member 2: about 1/3.
    assert!(share(&counts, 2) > 0.55, "{counts:?}");
    assert!(
        counts[2] > 3 * counts[0] && counts[2] > 3 * counts[1],
        "{counts:?}"
    );
}

#[test]
fn least_request_compares_load_per_weight() {
    fastrand::seed(9);
    let members = members(&[(1, 0), (3, 0)]);
    // (11 + 1) in flight over weight 3 is heavier than (0 + 1) over weight 1.
    for _ in 0..11 {
        members[1].load.start_request();
    }
    let balancer = Balancer::new(LbPolicy::LeastRequest, members);
    assert_eq!(balancer.lighter(0, 1), 0);
    assert_eq!(balancer.lighter(1, 0), 0);
    // (3 + 1) per 1 equals (11 + 1) per 3: a tie keeps the first draw.
    for _ in 0..3 {
        balancer.loads[0].start_request();
    }
    assert_eq!(balancer.lighter(0, 1), 0);
    assert_eq!(balancer.lighter(1, 0), 1);
    let counts = counts(&balancer, 4_000, |_| false);
    assert!(counts[0] > 0 && counts[1] > 0, "{counts:?}");
}

/// Equal load per request: a closed loop with a fixed number of requests in flight, where any
/// of them is equally likely to finish next (the same latency on every member). Picks then have
/// to follow the weights, because least-request steers in-flight counts towards weight.
#[test]
fn least_request_equal_latency_follows_weights() {
    fastrand::seed(10);
    let members = members(&[(1, 0), (3, 0), (4, 0)]);
    let loads: Vec<Arc<TargetLoad>> = members.iter().map(|m| m.load.clone()).collect();
    let balancer = Balancer::new(LbPolicy::LeastRequest, members);
    let mut in_flight: Vec<usize> = Vec::new();
    let mut counts = vec![0; 3];
    for step in 0..60_000 {
        if in_flight.len() == 200 {
            let done = in_flight.swap_remove(fastrand::usize(..in_flight.len()));
            loads[done].finish_request();
        }
        let id = balancer.pick(|_| false).unwrap();
        loads[id].start_request();
        in_flight.push(id);
        if step >= 20_000 {
            counts[id] += 1;
        }
    }
    assert_share(&counts, 0, 1.0 / 8.0, 0.03);
    assert_share(&counts, 1, 3.0 / 8.0, 0.03);
    assert_share(&counts, 2, 4.0 / 8.0, 0.03);
}

#[test]
fn huge_weights_schedule_stays_within_cap_and_proportional() {
    fastrand::seed(11);
    let n = 10_000;
    // Weights 1..=1_000_000, spread evenly; all in one tier.
    let weights: Vec<u32> = (0..n as u32).map(|k| 1 + k * 100).collect();
    let spec: Vec<(u32, i32)> = weights.iter().map(|&w| (w, 0)).collect();
    let balancer = Balancer::new(LbPolicy::RoundRobin, members(&spec));
    let schedule = schedule_of(&balancer, 0);
    assert!(schedule.len() <= schedule::cap(n), "{}", schedule.len());
    assert!(schedule.len() >= schedule::cap(n) / 2, "{}", schedule.len());
    let mut per_member = vec![0usize; n];
    for &id in schedule {
        per_member[id as usize] += 1;
    }
    assert!(per_member.iter().all(|&c| c >= 1), "every member stays in");
    // Heavy members keep their proportions: weight 999_901 vs 499_901 is ≈ 2.
    let ratio = per_member[9_999] as f64 / per_member[4_999] as f64;
    assert!((ratio - 2.0).abs() < 0.05, "{ratio}");
    // The top tenth by weight keeps about its share of the total weight (≈ 19 %).
    let top: usize = per_member[9_000..].iter().sum();
    let top_weight: u64 = weights[9_000..].iter().map(|&w| u64::from(w)).sum();
    let all_weight: u64 = weights.iter().map(|&w| u64::from(w)).sum();
    let expected = top_weight as f64 / all_weight as f64;
    let actual = top as f64 / schedule.len() as f64;
    assert!((actual - expected).abs() < 0.01, "{actual} vs {expected}");
}

#[test]
fn target_load_finish_never_underflows() {
    let load = TargetLoad::default();
    load.finish_request();
    assert_eq!(load.in_flight(), 0);
    load.start_request();
    load.start_request();
    load.finish_request();
    assert_eq!(load.in_flight(), 1);
    load.finish_request();
    load.finish_request();
    load.finish_request();
    assert_eq!(load.in_flight(), 0);
    load.start_request();
    assert_eq!(load.in_flight(), 1);
}

#[test]
fn concurrent_picks_keep_the_distribution() {
    for policy in POLICIES {
        let balancer = Arc::new(Balancer::new(policy, members(&[(1, 0), (3, 0)])));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let balancer = Arc::clone(&balancer);
                thread::spawn(move || {
                    fastrand::seed(100 + t);
                    counts(&balancer, 10_000, |_| false)
                })
            })
            .collect();
        let mut total = vec![0; 2];
        for handle in threads {
            for (sum, count) in total.iter_mut().zip(handle.join().expect("no panic")) {
                *sum += count;
            }
        }
        match policy {
            // Every fetch_add is a distinct cycle slot: 40,000 picks are 10,000 whole cycles.
            LbPolicy::RoundRobin => assert_eq!(total, vec![10_000, 30_000]),
            LbPolicy::Random => assert_share(&total, 0, 0.25, 0.03),
            // Idle members: the heavier of two draws wins, so member 1 takes nearly everything.
            LbPolicy::LeastRequest => assert!(total[1] > total[0], "{total:?}"),
            LbPolicy::RingHash | LbPolicy::Maglev => unreachable!("not in POLICIES"),
        }
    }
}

#[test]
fn balancer_is_send_and_sync() {
    fn shared<T: Send + Sync>() {}
    shared::<Balancer>();
    shared::<Arc<Balancer>>();
}

#[test]
fn debug_is_a_summary() {
    let balancer = Balancer::new(LbPolicy::Random, members(&[(1, 3), (1, 3), (2, 0)]));
    let text = format!("{balancer:?}");
    assert!(
        text.contains("Random") && text.contains("(0, 1), (3, 2)"),
        "{text}"
    );
}

#[test]
fn pick_random_spreads_by_weight_and_leaves_the_rotation_alone() {
    let balancer = Balancer::new(LbPolicy::RoundRobin, members(&[(1, 0), (1, 0), (1, 10)]));
    let mut seen = [0usize; 3];
    for _ in 0..2_000 {
        seen[balancer.pick_random(|_| false).unwrap()] += 1;
    }
    assert_eq!(seen[2], 0, "the preferred tier wins");
    assert!(seen[0] > 800 && seen[1] > 800, "spread over both: {seen:?}");
    // Ordinary picks keep alternating whatever pick_random did in between.
    let first = balancer.pick(|_| false).unwrap();
    balancer.pick_random(|_| false);
    let second = balancer.pick(|_| false).unwrap();
    assert_ne!(first, second);
    assert_eq!(
        balancer.pick_random(|id| id != 2),
        Some(2),
        "failover to the next tier"
    );
    assert_eq!(balancer.pick_random(|_| true), None);
}

#[test]
fn a_target_takes_requests_up_to_its_limit() {
    let load = TargetLoad::default();
    assert!(load.try_start_request(2));
    assert!(load.try_start_request(2));
    assert!(!load.try_start_request(2), "full at 2");
    load.finish_request();
    assert!(load.try_start_request(2), "room again");
    assert_eq!(load.in_flight(), 2);
}

#[test]
fn waiters_are_counted_while_they_wait() {
    let load = TargetLoad::default();
    assert!(!load.has_waiters());
    let waiter = load.wait_for_room();
    assert!(load.has_waiters());
    assert!(load.try_start_request(1));
    load.finish_request();
    drop(waiter);
    assert!(
        !load.has_waiters(),
        "a waiter that leaves is no longer counted"
    );
}
