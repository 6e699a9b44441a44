//! The zone split decided from targets' health at given instants (the wall clock is an argument,
//! so ejections run out exactly when a test says), and picks under each decision.

use std::collections::BTreeMap;

use http::uri::Authority;
use http::HeaderValue;
use serde_json::json;

use super::*;
use crate::balance::{FailureCause, TargetHealth};
use crate::model::{Ejection, Health, Target};
use crate::snapshot::tests::service;
use crate::snapshot::{Preference, ServiceRuntime, Subset};

const NOW: u64 = 1_000_000_000;

fn locality(min_available_percent: u32) -> Locality {
    Locality {
        min_available_percent,
    }
}

/// A target `id` with `metadata`, weight 100, priority `priority`.
fn target(id: i64, priority: i32, metadata: Value) -> TargetRuntime {
    let authority = format!("10.0.0.{id}:80");
    TargetRuntime {
        spec: Arc::new(Target {
            id,
            weight: 100,
            priority,
            metadata,
            ..Target::default()
        }),
        id,
        host_header: HeaderValue::from_str(&authority).unwrap(),
        authority: Authority::try_from(authority).unwrap(),
        load: Arc::default(),
        health: Arc::new(TargetHealth::default()),
        identity: crate::balance::identity_hash(&id.to_string()),
    }
}

fn zoned(id: i64, zone: &str) -> TargetRuntime {
    target(id, 0, json!({ "zone": zone }))
}

/// A service of `targets` with `policy`, split for zone `a` when `min` is given.
fn service_of(targets: Vec<TargetRuntime>, policy: LbPolicy, min: Option<u32>) -> ServiceRuntime {
    let mut runtime = service(1);
    Arc::make_mut(&mut runtime.service).lb_policy = policy;
    Arc::make_mut(&mut runtime.service).locality = min.map(locality);
    let members = targets
        .iter()
        .map(|target| Member {
            weight: target.spec.weight,
            priority: target.spec.priority,
            load: target.load.clone(),
            identity: target.identity,
        })
        .collect();
    runtime.balancer = Balancer::new(policy, members);
    runtime.locality = min.map(|min| {
        Box::new(ZoneSplit::build(
            "a".into(),
            locality(min),
            policy,
            &targets,
            NOW,
        ))
    });
    runtime.targets = targets;
    runtime
}

/// Three targets in zone a (ids 1–3), three in zone b (ids 4–6).
fn three_and_three(min: u32) -> ServiceRuntime {
    let targets = (1..=6)
        .map(|id| zoned(id, if id <= 3 { "a" } else { "b" }))
        .collect();
    service_of(targets, LbPolicy::RoundRobin, Some(min))
}

fn split(runtime: &ServiceRuntime) -> &ZoneSplit {
    runtime.locality.as_deref().unwrap()
}

fn refresh(runtime: &ServiceRuntime, now_ms: u64) -> ZoneDecision {
    split(runtime).refresh(&runtime.targets, now_ms)
}

/// Picks per target id over `n` picks.
fn picks(runtime: &ServiceRuntime, n: usize) -> BTreeMap<i64, usize> {
    let mut counts = BTreeMap::new();
    for _ in 0..n {
        let pick = runtime.pick(|_| false, true).expect("a pick");
        *counts.entry(pick.target.id).or_default() += 1;
    }
    counts
}

fn ejection() -> Ejection {
    Ejection {
        base_ejection_ms: 10_000,
        ..Ejection::default()
    }
}

#[test]
fn a_healthy_zone_takes_every_pick_spread_evenly_over_its_targets() {
    let runtime = three_and_three(70);
    let decision = split(&runtime).decision();
    assert_eq!(decision.in_force, Some(0));
    assert_eq!((decision.available, decision.total), (3, 3));
    assert_eq!(split(&runtime).basis(), ZoneBasis::Labels);
    assert_eq!(
        picks(&runtime, 600),
        BTreeMap::from([(1, 200), (2, 200), (3, 200)])
    );
    assert_eq!(runtime.counters.zone_picks.load(Ordering::Relaxed), 600);
    assert_eq!(runtime.counters.all_zone_picks.load(Ordering::Relaxed), 0);
    assert_eq!(
        split(&runtime).reason(decision),
        "3 of 3 targets in zone a available (100 % ≥ 70 %)"
    );
}

#[test]
fn below_the_threshold_every_zone_takes_picks_and_the_zone_takes_them_back_when_it_recovers() {
    let runtime = three_and_three(70);
    runtime.targets[0].health.set_health(Health::Unhealthy);
    let decision = refresh(&runtime, NOW);
    assert_eq!(decision.in_force, None, "2 of 3 is 66 % < 70 %");
    assert_eq!((decision.available, decision.total), (2, 3));
    assert_eq!(
        split(&runtime).reason(decision),
        "2 of 3 targets in zone a available (66 % < 70 %)"
    );
    let spread = picks(&runtime, 500);
    assert_eq!(spread.keys().copied().collect::<Vec<_>>(), [2, 3, 4, 5, 6]);
    // A skipped schedule entry goes to a random other member: about even, not exact.
    assert!(
        spread.values().all(|&n| (70..=130).contains(&n)),
        "{spread:?}"
    );
    assert_eq!(runtime.counters.all_zone_picks.load(Ordering::Relaxed), 500);

    runtime.targets[0].health.set_health(Health::Healthy);
    assert_eq!(refresh(&runtime, NOW).in_force, Some(0));
    assert_eq!(
        picks(&runtime, 3).keys().copied().collect::<Vec<_>>(),
        [1, 2, 3]
    );
}

#[test]
fn the_threshold_is_inclusive_and_zero_still_needs_one_available_target() {
    let runtime = three_and_three(66);
    runtime.targets[0].health.set_health(Health::Unhealthy);
    assert_eq!(refresh(&runtime, NOW).in_force, Some(0), "66 % ≥ 66 %");

    let runtime = three_and_three(100);
    assert_eq!(refresh(&runtime, NOW).in_force, Some(0));
    runtime.targets[2].health.set_health(Health::Unhealthy);
    assert_eq!(
        refresh(&runtime, NOW).in_force,
        None,
        "100 % needs every target"
    );

    let runtime = three_and_three(0);
    runtime.targets[0].health.set_health(Health::Unhealthy);
    runtime.targets[1].health.set_health(Health::Unhealthy);
    assert_eq!(
        refresh(&runtime, NOW).in_force,
        Some(0),
        "one of three is enough at 0 %"
    );
    runtime.targets[2].health.set_health(Health::Unhealthy);
    let decision = refresh(&runtime, NOW);
    assert_eq!(decision.in_force, None);
    assert_eq!(
        split(&runtime).reason(decision),
        "none of the 3 targets in zone a is available"
    );
}

#[test]
fn an_ejected_target_counts_again_once_its_ejection_runs_out() {
    let runtime = three_and_three(70);
    runtime.targets[1]
        .health
        .eject(NOW, &ejection(), FailureCause::ConnectFailed)
        .expect("ejected");
    assert_eq!(refresh(&runtime, NOW + 1).in_force, None);
    assert_eq!(refresh(&runtime, NOW + 9_999).in_force, None);
    // Half-open from here: it takes its one trial, and counts as available.
    let decision = refresh(&runtime, NOW + 10_000);
    assert_eq!(decision.in_force, Some(0));
    assert_eq!(decision.available, 3);
}

#[test]
fn a_zone_emptied_between_two_looks_spills_over_at_once_without_panicking_in_it() {
    let runtime = three_and_three(70);
    assert_eq!(split(&runtime).decision().in_force, Some(0));
    for target in &runtime.targets[..3] {
        target.health.set_health(Health::Unhealthy);
    }
    // No look since: the zone's tier is still in force, and finds nothing available.
    assert_eq!(split(&runtime).decision().in_force, Some(0));
    let spread = picks(&runtime, 30);
    assert_eq!(spread.keys().copied().collect::<Vec<_>>(), [4, 5, 6]);
    assert_eq!(runtime.counters.panic_picks.load(Ordering::Relaxed), 0);
}

#[test]
fn when_every_zone_is_down_the_panic_pick_spans_every_zone() {
    let runtime = three_and_three(70);
    for target in &runtime.targets {
        target.health.set_health(Health::Unhealthy);
    }
    let decision = refresh(&runtime, NOW);
    assert_eq!(decision.in_force, None);
    assert_eq!((decision.available, decision.total), (0, 3));
    let spread = picks(&runtime, 600);
    assert_eq!(spread.len(), 6, "panic picks over all zones: {spread:?}");
    assert!(
        runtime.pick(|_| false, false).is_none(),
        "a retry finds nothing"
    );
}

#[test]
fn priority_comes_before_locality() {
    // Zone a: 1, 2 in tier 0 and 3 in tier 1; zone b: 4, 5 in tier 0.
    let targets = vec![
        target(1, 0, json!({"zone": "a"})),
        target(2, 0, json!({"zone": "a"})),
        target(3, 1, json!({"zone": "a"})),
        target(4, 0, json!({"zone": "b"})),
        target(5, 0, json!({"zone": "b"})),
    ];
    let runtime = service_of(targets, LbPolicy::RoundRobin, Some(50));
    assert_eq!(
        picks(&runtime, 4).keys().copied().collect::<Vec<_>>(),
        [1, 2]
    );
    // Zone a's primary tier is down: zone b's primary tier, not zone a's backup.
    runtime.targets[0].health.set_health(Health::Unhealthy);
    runtime.targets[1].health.set_health(Health::Unhealthy);
    let decision = refresh(&runtime, NOW);
    assert_eq!(
        (decision.in_force, decision.available, decision.total),
        (None, 0, 2)
    );
    assert_eq!(
        picks(&runtime, 4).keys().copied().collect::<Vec<_>>(),
        [4, 5]
    );
    // Every zone's primary tier is down: zone a's backup tier is the zone's in that tier.
    runtime.targets[3].health.set_health(Health::Unhealthy);
    runtime.targets[4].health.set_health(Health::Unhealthy);
    let decision = refresh(&runtime, NOW);
    assert_eq!(decision.in_force, Some(1));
    assert_eq!(
        split(&runtime).reason(decision),
        "1 of 1 targets in zone a available (100 % ≥ 50 %), priority tier 1"
    );
    assert_eq!(picks(&runtime, 3).keys().copied().collect::<Vec<_>>(), [3]);
}

#[test]
fn a_zone_label_comes_from_metadata_meta_or_labels_and_no_label_is_out_of_zone() {
    let targets = vec![
        target(1, 0, json!({"zone": "a"})),
        target(2, 0, json!({"meta": {"zone": "a"}})),
        target(3, 0, json!({"labels": {"zone": "a"}})),
        target(4, 0, json!({})),
        target(5, 0, json!({"zone": "ab"})),
    ];
    let runtime = service_of(targets, LbPolicy::Random, Some(70));
    let members: Vec<bool> = (0..5)
        .map(|index| split(&runtime).contains(index))
        .collect();
    assert_eq!(members, [true, true, true, false, false]);
    assert_eq!(
        picks(&runtime, 300).keys().copied().collect::<Vec<_>>(),
        [1, 2, 3]
    );
}

#[test]
fn hints_decide_when_every_ready_target_has_them_and_one_names_the_zone() {
    let hinted =
        |id, zone: &str, hints: &[&str]| target(id, 0, json!({"zone": zone, "zone_hints": hints}));
    // The controller lent zone b's target 3 to zone a.
    let targets = vec![
        hinted(1, "a", &["a"]),
        hinted(2, "a", &["a"]),
        hinted(3, "b", &["a"]),
        hinted(4, "b", &["b"]),
    ];
    let runtime = service_of(targets, LbPolicy::RoundRobin, Some(70));
    assert_eq!(split(&runtime).basis(), ZoneBasis::Hints);
    assert_eq!(
        picks(&runtime, 300),
        BTreeMap::from([(1, 100), (2, 100), (3, 100)])
    );

    // One ready target without hints: the labels decide (kube-proxy ignores every hint then).
    let targets = vec![
        hinted(1, "a", &["a"]),
        hinted(2, "a", &["a"]),
        hinted(3, "b", &["a"]),
        zoned(4, "b"),
    ];
    let runtime = service_of(targets, LbPolicy::RoundRobin, Some(70));
    assert_eq!(split(&runtime).basis(), ZoneBasis::Labels);
    assert_eq!(
        picks(&runtime, 4).keys().copied().collect::<Vec<_>>(),
        [1, 2]
    );

    // Hints that name only other zones: kube-proxy's fallback, the labels decide.
    let targets = vec![hinted(1, "a", &["b"]), hinted(2, "b", &["b"])];
    let runtime = service_of(targets, LbPolicy::RoundRobin, Some(70));
    assert_eq!(split(&runtime).basis(), ZoneBasis::Labels);
    assert_eq!(picks(&runtime, 4).keys().copied().collect::<Vec<_>>(), [1]);

    // Serving-terminating targets (the set while none is ready) are never hint-decided.
    let terminating = |id, zone: &str| target(id, 0, json!({"zone": zone, "terminating": true}));
    let targets = vec![terminating(1, "a"), terminating(2, "b")];
    let runtime = service_of(targets, LbPolicy::RoundRobin, Some(70));
    assert_eq!(split(&runtime).basis(), ZoneBasis::Labels);
}

#[test]
fn without_a_zone_target_the_reason_says_so_and_every_zone_takes_picks() {
    let runtime = service_of(
        vec![zoned(1, "b"), zoned(2, "c")],
        LbPolicy::RoundRobin,
        Some(70),
    );
    let decision = split(&runtime).decision();
    assert_eq!(decision.in_force, None);
    assert_eq!(
        split(&runtime).reason(decision),
        "no target is labelled with zone a"
    );
    assert_eq!(
        picks(&runtime, 4).keys().copied().collect::<Vec<_>>(),
        [1, 2]
    );
}

#[test]
fn weight_zero_targets_are_not_counted() {
    let mut idle = zoned(3, "a");
    idle.spec = Arc::new(Target {
        weight: 0,
        ..Target::clone(&idle.spec)
    });
    let runtime = service_of(
        vec![zoned(1, "a"), zoned(2, "a"), idle, zoned(4, "b")],
        LbPolicy::RoundRobin,
        Some(100),
    );
    let decision = split(&runtime).decision();
    assert_eq!((decision.in_force, decision.total), (Some(0), 2));
}

#[test]
fn a_hashed_pick_keeps_a_key_on_one_zone_target_and_follows_the_split() {
    let targets = (1..=6)
        .map(|id| zoned(id, if id <= 3 { "a" } else { "b" }))
        .collect();
    let runtime = service_of(targets, LbPolicy::RingHash, Some(70));
    let hashed = |hash| {
        runtime
            .pick_preferring(
                None,
                Preference {
                    pinned: None,
                    hash: Some(hash),
                },
                |_| false,
                true,
            )
            .unwrap()
            .target
            .id
    };
    let mut owners = BTreeMap::new();
    for key in 0..300u64 {
        let hash = crate::balance::key_hash(key.to_string().as_bytes());
        let owner = hashed(hash);
        assert_eq!(hashed(hash), owner, "a key keeps its target");
        *owners.entry(owner).or_insert(0) += 1;
    }
    assert_eq!(owners.keys().copied().collect::<Vec<_>>(), [1, 2, 3]);
    runtime.targets[0].health.set_health(Health::Unhealthy);
    refresh(&runtime, NOW);
    let spread: std::collections::BTreeSet<i64> = (0..300u64)
        .map(|key| hashed(crate::balance::key_hash(key.to_string().as_bytes())))
        .collect();
    assert_eq!(spread.into_iter().collect::<Vec<_>>(), [2, 3, 4, 5, 6]);
}

#[test]
fn a_subset_pick_ignores_the_split() {
    let targets = (1..=4)
        .map(|id| {
            target(
                id,
                0,
                json!({"zone": if id <= 2 { "a" } else { "b" }, "version": "v2"}),
            )
        })
        .collect();
    let service = std::sync::Arc::new(service_of(targets, LbPolicy::RoundRobin, Some(70)));
    let backend = crate::snapshot::BackendRuntime::new(
        service.clone(),
        &crate::model::Backend {
            subset: BTreeMap::from([("version".to_owned(), "v2".to_owned())]),
            ..crate::model::Backend::whole(1)
        },
        |_| Arc::default(),
    );
    let subset: &Subset = backend.subset.as_ref().unwrap();
    let spread: std::collections::BTreeSet<i64> = (0..8)
        .map(|_| {
            service
                .pick_in(Some(subset), |_| false, true)
                .unwrap()
                .target
                .id
        })
        .collect();
    assert_eq!(spread.into_iter().collect::<Vec<_>>(), [1, 2, 3, 4]);
}

#[test]
fn a_decision_word_round_trips() {
    let runtime = three_and_three(70);
    let decided = refresh(&runtime, NOW);
    assert_eq!(split(&runtime).decision(), decided);
    runtime.targets[0].health.set_health(Health::Unhealthy);
    let decided = refresh(&runtime, NOW);
    assert_eq!(split(&runtime).decision(), decided);
}
