//! Consistent hashing through `Balancer::pick_hashed` (TRAFFIC.md §5): the same table for the
//! same target set in any order, about 1/N of the keys moving when one target comes or goes,
//! unaffected keys staying put when a target is skipped, and bounded load holding.

use std::sync::Arc;

use proptest::prelude::*;
use proptest::test_runner::RngSeed;

use super::hash_table::mix;
use super::*;

const KEYS: u64 = 20_000;
const HASHING: [LbPolicy; 2] = [LbPolicy::RingHash, LbPolicy::Maglev];

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        rng_seed: RngSeed::Fixed(0x5241_4148_4933_3335),
        ..ProptestConfig::default()
    }
}

/// One tier of members with these identities and weights.
fn members(spec: &[(u64, u32)]) -> Vec<Member> {
    spec.iter()
        .map(|&(identity, weight)| Member {
            weight,
            priority: 0,
            load: Arc::default(),
            identity,
        })
        .collect()
}

fn key(k: u64) -> u64 {
    key_hash(&k.to_le_bytes())
}

/// The identity each of the first `KEYS` keys is sent to.
fn owners(balancer: &Balancer, spec: &[(u64, u32)], skip: impl Fn(usize) -> bool) -> Vec<u64> {
    (0..KEYS)
        .map(|k| {
            let member = balancer.pick_hashed(key(k), None, &skip).expect("a member");
            spec[member].0
        })
        .collect()
}

fn moved(before: &[u64], after: &[u64]) -> f64 {
    let moved = before.iter().zip(after).filter(|(a, b)| a != b).count();
    moved as f64 / before.len() as f64
}

fn spec_of(n: u64) -> Vec<(u64, u32)> {
    (0..n)
        .map(|i| {
            (
                identity_hash(&format!("10.0.{}.{}:80", i / 250, i % 250)),
                100,
            )
        })
        .collect()
}

#[test]
fn adding_a_target_moves_about_one_nth_of_the_keys() {
    for policy in HASHING {
        // Maglev's bound holds while the targets are few and no table size is crossed (at 21
        // and 164 members every key moves): its extra disruption grows with N (about 2.3/N at
        // 100, benches/README.md).
        let sizes: &[u64] = match policy {
            LbPolicy::RingHash => &[5, 10, 30, 100, 1000],
            _ => &[5, 10, 19, 30, 50],
        };
        for &n in sizes {
            let before_spec = spec_of(n);
            let before = Balancer::new(policy, members(&before_spec));
            let after_spec = spec_of(n + 1);
            let after = Balancer::reusing(policy, members(&after_spec), &before.hash_tables());
            let share = moved(
                &owners(&before, &before_spec, |_| false),
                &owners(&after, &after_spec, |_| false),
            );
            let n = n as f64;
            let limit = match policy {
                LbPolicy::RingHash => 1.0 / n + 0.02,
                _ => 2.0 / n,
            };
            assert!(
                share <= limit,
                "{policy:?} {n} → {}: {share:.4} moved, limit {limit:.4}",
                n + 1.0
            );
            assert!(
                share >= 0.5 / (n + 1.0),
                "{policy:?}: the new target takes its share ({share:.4})"
            );
        }
    }
}

#[test]
fn removing_a_target_moves_its_keys_and_few_others() {
    for policy in HASHING {
        let spec = spec_of(20);
        let full = Balancer::new(policy, members(&spec));
        let fewer_spec: Vec<(u64, u32)> = spec[..19].to_vec();
        let fewer = Balancer::reusing(policy, members(&fewer_spec), &full.hash_tables());
        let before = owners(&full, &spec, |_| false);
        let after = owners(&fewer, &fewer_spec, |_| false);
        let gone = spec[19].0;
        let others_moved = before
            .iter()
            .zip(&after)
            .filter(|(a, b)| **a != gone && a != b)
            .count() as f64
            / KEYS as f64;
        match policy {
            LbPolicy::RingHash => assert_eq!(
                others_moved, 0.0,
                "a ring moves only the removed target's keys"
            ),
            _ => assert!(
                others_moved <= 1.0 / 20.0,
                "Maglev: {others_moved:.4} of other keys moved"
            ),
        }
        assert!(moved(&before, &after) <= 2.0 / 20.0, "{policy:?}");
    }
}

#[test]
fn a_skipped_target_sends_its_keys_on_and_no_other_key_moves() {
    for policy in HASHING {
        let spec = spec_of(10);
        let balancer = Balancer::new(policy, members(&spec));
        let before = owners(&balancer, &spec, |_| false);
        let after = owners(&balancer, &spec, |member| member == 3);
        for (k, (a, b)) in before.iter().zip(&after).enumerate() {
            if *a == spec[3].0 {
                assert_ne!(b, a, "{policy:?} key {k} left the skipped target");
            } else {
                assert_eq!(
                    b, a,
                    "{policy:?} key {k} moved although its target is available"
                );
            }
        }
        // The skipped target's keys spread over the others rather than pile onto one.
        let mut spread = std::collections::HashSet::new();
        for (a, b) in before.iter().zip(&after) {
            if *a == spec[3].0 {
                spread.insert(*b);
            }
        }
        assert!(
            spread.len() >= 5,
            "{policy:?}: to {} targets only",
            spread.len()
        );
    }
}

#[test]
fn shares_follow_weights() {
    for policy in HASHING {
        let mut spec = spec_of(4);
        spec[0].1 = 300;
        let balancer = Balancer::new(policy, members(&spec));
        let owners = owners(&balancer, &spec, |_| false);
        let heavy = owners.iter().filter(|&&o| o == spec[0].0).count() as f64 / KEYS as f64;
        assert!(
            (heavy - 0.5).abs() < 0.08,
            "{policy:?}: weight 300 of 600 took {heavy:.3}"
        );
    }
}

#[test]
fn every_tier_is_hashed_and_a_lower_one_serves_only_when_the_first_is_skipped() {
    for policy in HASHING {
        let mut members = members(&spec_of(6));
        for member in &mut members[3..] {
            member.priority = 1;
        }
        let balancer = Balancer::new(policy, members);
        assert_eq!(balancer.hash_tables().tiers().count(), 2);
        for k in 0..1000 {
            assert!(balancer.pick_hashed(key(k), None, |_| false).unwrap() < 3);
            let failover = balancer.pick_hashed(key(k), None, |m| m < 3).unwrap();
            assert!(failover >= 3);
            assert_eq!(
                balancer.pick_hashed(key(k), None, |m| m < 3),
                Some(failover),
                "stable"
            );
        }
        assert_eq!(balancer.pick_hashed(key(1), None, |_| true), None);
    }
}

#[test]
fn an_unchanged_tier_keeps_its_table_and_a_changed_one_is_rebuilt() {
    for policy in HASHING {
        let spec = spec_of(8);
        let first = Balancer::new(policy, members(&spec));
        let same = Balancer::reusing(policy, members(&spec), &first.hash_tables());
        let first_table = first.tiers[0].table.as_ref().unwrap();
        assert!(Arc::ptr_eq(
            first_table,
            same.tiers[0].table.as_ref().unwrap()
        ));
        let mut heavier = spec.clone();
        heavier[2].1 = 200;
        let changed = Balancer::reusing(policy, members(&heavier), &first.hash_tables());
        assert!(!Arc::ptr_eq(
            first_table,
            changed.tiers[0].table.as_ref().unwrap()
        ));
    }
}

/// Gateways on one store must build the same table whatever each built before: one that grew
/// a service from 8 to 15 targets and one that started at 15 send every key alike.
#[test]
fn a_table_depends_on_its_members_not_on_the_tables_before_it() {
    for policy in HASHING {
        let grown_from: Vec<Balancer> = [8u64, 20, 200]
            .iter()
            .map(|&start| Balancer::new(policy, members(&spec_of(start))))
            .collect();
        let spec = spec_of(15);
        let fresh = owners(&Balancer::new(policy, members(&spec)), &spec, |_| false);
        for before in &grown_from {
            let grown = Balancer::reusing(policy, members(&spec), &before.hash_tables());
            assert_eq!(owners(&grown, &spec, |_| false), fresh, "{policy:?}");
        }
    }
}

#[test]
fn keyless_picks_of_a_hashing_policy_are_round_robin() {
    let balancer = Balancer::new(LbPolicy::Maglev, members(&spec_of(3)));
    let mut counts = [0; 3];
    for _ in 0..300 {
        counts[balancer.pick(|_| false).unwrap()] += 1;
    }
    assert_eq!(counts, [100, 100, 100]);
}

/// HAProxy's bound, by weight: after each pick, no member holds more than
/// ⌈factor × requests × its weight / (100 × the tier's weight)⌉, even when half the requests
/// share one key.
#[test]
fn bounded_load_never_puts_a_target_above_the_factor_times_its_weighted_share() {
    for policy in HASHING {
        for factor_percent in [100, 125, 150, 200] {
            let mut spec = spec_of(10);
            for (i, member) in spec.iter_mut().enumerate() {
                member.1 = [100, 300, 50][i % 3];
            }
            let tier_weight: u64 = spec.iter().map(|&(_, w)| u64::from(w)).sum();
            let balancer = Balancer::new(policy, members(&spec));
            let mut total = 0u64;
            for k in 0..2_000u64 {
                let hash = if k % 2 == 0 { key(7) } else { key(k) };
                let bound = LoadBound {
                    factor_percent,
                    in_flight: total,
                };
                let member = balancer.pick_hashed(hash, Some(bound), |_| false).unwrap();
                balancer.loads[member].start_request();
                total += 1;
                for (id, load) in balancer.loads.iter().enumerate() {
                    let limit = (u64::from(factor_percent) * total * u64::from(spec[id].1))
                        .div_ceil(100 * tier_weight);
                    let held = u64::from(load.in_flight());
                    assert!(
                        held <= limit,
                        "{policy:?} ×{factor_percent}%: member {id} holds {held} > {limit} after {total}"
                    );
                }
            }
        }
    }
}

#[test]
fn bounded_load_keeps_a_key_on_its_target_while_it_is_not_loaded() {
    let spec = spec_of(10);
    let balancer = Balancer::new(LbPolicy::RingHash, members(&spec));
    let own = balancer.pick_hashed(key(1), None, |_| false).unwrap();
    let bound = LoadBound {
        factor_percent: 125,
        in_flight: 0,
    };
    assert_eq!(
        balancer.pick_hashed(key(1), Some(bound), |_| false),
        Some(own)
    );
}

proptest! {
    #![proptest_config(config(24))]

    /// Gateways may list a service's targets in any order: the tables, and so every key's
    /// target, must not depend on it.
    #[test]
    fn the_choice_does_not_depend_on_member_order(
        ids in prop::collection::hash_set(any::<u64>(), 1..40),
        weights in prop::collection::vec(1u32..400, 40),
        rotate in 0usize..40,
        reverse in any::<bool>(),
    ) {
        let spec: Vec<(u64, u32)> = ids.iter().zip(&weights).map(|(&i, &w)| (mix(i), w)).collect();
        let mut shuffled = spec.clone();
        let len = shuffled.len();
        shuffled.rotate_left(rotate % len);
        if reverse {
            shuffled.reverse();
        }
        for policy in HASHING {
            let a = Balancer::new(policy, members(&spec));
            let b = Balancer::new(policy, members(&shuffled));
            for k in 0..500 {
                let in_a = spec[a.pick_hashed(key(k), None, |_| false).unwrap()].0;
                let in_b = shuffled[b.pick_hashed(key(k), None, |_| false).unwrap()].0;
                prop_assert_eq!(in_a, in_b, "{:?} key {}", policy, k);
                // Skipping the same identity on both sides also agrees.
                let skipped = spec[0].0;
                let in_a = a.pick_hashed(key(k), None, |m| spec[m].0 == skipped).map(|m| spec[m].0);
                let in_b = b.pick_hashed(key(k), None, |m| shuffled[m].0 == skipped).map(|m| shuffled[m].0);
                prop_assert_eq!(in_a, in_b);
            }
        }
    }

    /// One target more or less moves keys only to or from it (ring), or few others (Maglev).
    #[test]
    fn one_target_more_moves_keys_only_to_it_on_a_ring(
        ids in prop::collection::hash_set(any::<u64>(), 2..30),
    ) {
        let spec: Vec<(u64, u32)> = ids.iter().map(|&i| (mix(i), 100)).collect();
        let fewer = &spec[1..];
        let before = Balancer::new(LbPolicy::RingHash, members(fewer));
        let after = Balancer::new(LbPolicy::RingHash, members(&spec));
        for k in 0..2_000 {
            let old = fewer[before.pick_hashed(key(k), None, |_| false).unwrap()].0;
            let new = spec[after.pick_hashed(key(k), None, |_| false).unwrap()].0;
            prop_assert!(old == new || new == spec[0].0, "key {} moved between old targets", k);
        }
    }
}
