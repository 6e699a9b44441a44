use chrono::TimeZone;
use serde_json::json;

use super::*;
use crate::discovery::reconcile::reconcile;
use crate::discovery::revision_of;
use crate::model::{Health, Id, TargetChange};

fn at(ms: i64) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(1_700_000_000_000 + ms).unwrap()
}

fn endpoint(key: &str) -> Endpoint {
    let port = key.trim_start_matches('k').parse().unwrap_or(80);
    Endpoint {
        key: key.to_owned(),
        host: "10.0.0.1".to_owned(),
        port,
        weight: 100,
        priority: 0,
        enabled: true,
        metadata: json!({"zone": "a"}),
    }
}

fn target(id: Id, key: &str) -> Target {
    let endpoint = endpoint(key);
    Target {
        id,
        service_id: 1,
        source_id: Some(7),
        host: endpoint.host,
        port: endpoint.port,
        weight: endpoint.weight,
        priority: endpoint.priority,
        enabled: endpoint.enabled,
        metadata: endpoint.metadata,
        provider_key: Some(key.to_owned()),
        state: TargetState::Active,
        health: Health::Healthy,
        ejected_until: None,
        remove_at: None,
        last_check: None,
        managed_by: None,
        created_at: at(0),
        updated_at: at(0),
    }
}

/// Targets k1..=kn, ids 1..=n.
fn targets(n: usize) -> Vec<Target> {
    (1..=n).map(|i| target(i as Id, &format!("k{i}"))).collect()
}

fn answer(keys: &[&str]) -> Discovered {
    let endpoints: Vec<Endpoint> = keys.iter().map(|key| endpoint(key)).collect();
    Discovered {
        revision: revision_of(&endpoints),
        endpoints,
        ttl: None,
        refused: None,
        departures: Vec::new(),
    }
}

fn guard() -> RemovalGuard {
    RemovalGuard {
        max_percent: 50,
        min_endpoints: 1,
        confirm_ms: 60_000,
    }
}

fn up(_: &Target) -> bool {
    false
}

fn keys(verdict: &Verdict) -> Vec<&str> {
    verdict.endpoints.iter().map(|e| e.key.as_str()).collect()
}

#[test]
fn an_answer_that_removes_nothing_passes() {
    let current = targets(3);
    let verdict = judge(
        Some(&guard()),
        &current,
        &answer(&["k1", "k2", "k3", "k4"]),
        None,
        up,
        at(0),
    );
    assert_eq!(verdict.hold, None);
    assert_eq!(verdict.change, Change::None);
    assert_eq!(keys(&verdict), ["k1", "k2", "k3", "k4"]);
}

#[test]
fn removing_half_or_fewer_passes() {
    let current = targets(4);
    let verdict = judge(
        Some(&guard()),
        &current,
        &answer(&["k1", "k2"]),
        None,
        up,
        at(0),
    );
    assert_eq!(verdict.hold, None, "2 of 4 is not more than 50 %");
    assert_eq!(keys(&verdict), ["k1", "k2"]);
}

#[test]
fn removing_more_than_half_is_held() {
    let current = targets(4);
    let verdict = judge(Some(&guard()), &current, &answer(&["k1"]), None, up, at(0));
    assert_eq!(verdict.change, Change::Started);
    let hold = verdict.hold.as_ref().expect("held");
    assert_eq!(hold.holding, 3);
    assert_eq!(hold.held, ["k2", "k3", "k4"]);
    assert_eq!(hold.since, at(0));
    assert_eq!(hold.confirmations, 1);
    assert!(hold.reason.contains("remove 3 of 4"), "{}", hold.reason);
    assert_eq!(keys(&verdict), ["k1", "k2", "k3", "k4"]);
    // Reconcile of that set changes nothing: the held targets keep serving as they are.
    assert_eq!(
        reconcile(
            &current,
            &verdict.endpoints,
            at(0),
            std::time::Duration::from_secs(60)
        ),
        []
    );
}

#[test]
fn an_empty_answer_is_held() {
    let current = targets(2);
    let verdict = judge(Some(&guard()), &current, &answer(&[]), None, up, at(0));
    assert_eq!(verdict.hold.as_ref().map(|h| h.holding), Some(2));
    assert_eq!(keys(&verdict), ["k1", "k2"]);
}

#[test]
fn removals_up_to_min_endpoints_pass_whatever_the_share() {
    // One of one: 100 %, but not more than min_endpoints (1).
    let current = targets(1);
    assert_eq!(
        judge(Some(&guard()), &current, &answer(&[]), None, up, at(0)).hold,
        None
    );
    let wide = RemovalGuard {
        min_endpoints: 3,
        ..guard()
    };
    let current = targets(4);
    let verdict = judge(Some(&wide), &current, &answer(&["k1"]), None, up, at(0));
    assert_eq!(verdict.hold, None, "3 removals are not more than 3");
    let verdict = judge(Some(&wide), &targets(5), &answer(&["k1"]), None, up, at(0));
    assert!(verdict.hold.is_some(), "4 removals are more than 3");
}

#[test]
fn the_threshold_is_exclusive_at_every_size() {
    for active in 1..=20usize {
        for kept in 0..=active {
            let current = targets(active);
            let kept_keys: Vec<String> = (1..=kept).map(|i| format!("k{i}")).collect();
            let kept_refs: Vec<&str> = kept_keys.iter().map(String::as_str).collect();
            let verdict = judge(
                Some(&guard()),
                &current,
                &answer(&kept_refs),
                None,
                up,
                at(0),
            );
            let removed = active - kept;
            let expect_hold = removed > 1 && removed * 100 > 50 * active;
            assert_eq!(verdict.hold.is_some(), expect_hold, "{removed} of {active}");
        }
    }
}

#[test]
fn max_percent_bounds() {
    let current = targets(4);
    let never = RemovalGuard {
        max_percent: 100,
        ..guard()
    };
    assert_eq!(
        judge(Some(&never), &current, &answer(&[]), None, up, at(0)).hold,
        None
    );
    let always = RemovalGuard {
        max_percent: 0,
        min_endpoints: 0,
        ..guard()
    };
    assert!(judge(
        Some(&always),
        &current,
        &answer(&["k1", "k2", "k3"]),
        None,
        up,
        at(0)
    )
    .hold
    .is_some());
}

#[test]
fn no_guard_passes_everything_and_ends_a_hold() {
    let current = targets(4);
    let verdict = judge(None, &current, &answer(&[]), None, up, at(0));
    assert_eq!(verdict.hold, None);
    assert_eq!(verdict.change, Change::None);
    let held = judge(Some(&guard()), &current, &answer(&[]), None, up, at(0)).hold;
    let verdict = judge(None, &current, &answer(&[]), held.as_ref(), up, at(1));
    assert_eq!(verdict.change, Change::Ended);
    assert!(verdict.endpoints.is_empty());
}

#[test]
fn explicit_departures_are_never_held_nor_counted() {
    let current = targets(4);
    let mut leaving = answer(&["k1"]);
    leaving.departures = vec!["k2".into(), "k3".into(), "k4".into()];
    let verdict = judge(Some(&guard()), &current, &leaving, None, up, at(0));
    assert_eq!(verdict.hold, None, "the registry said they are going");
    assert_eq!(keys(&verdict), ["k1"]);
    // Two departing, two vanished: 2 of 4 unexplained is not more than half.
    let mut mixed = answer(&[]);
    mixed.departures = vec!["k1".into(), "k2".into()];
    assert_eq!(
        judge(Some(&guard()), &current, &mixed, None, up, at(0)).hold,
        None
    );
    // One departing, three vanished: the three are held, the departing one drains.
    let mut mostly_vanished = answer(&[]);
    mostly_vanished.departures = vec!["k1".into()];
    let verdict = judge(Some(&guard()), &current, &mostly_vanished, None, up, at(0));
    assert_eq!(verdict.hold.as_ref().unwrap().held, ["k2", "k3", "k4"]);
    assert_eq!(keys(&verdict), ["k2", "k3", "k4"]);
}

#[test]
fn targets_taken_out_by_health_or_ejection_are_not_held() {
    let current = targets(4);
    let down = |target: &Target| target.id == 3;
    let verdict = judge(
        Some(&guard()),
        &current,
        &answer(&["k1"]),
        None,
        down,
        at(0),
    );
    let hold = verdict.hold.as_ref().unwrap();
    assert_eq!(hold.held, ["k2", "k4"], "k3 is down anyway and drains");
    assert_eq!(hold.holding, 2);
    assert_eq!(keys(&verdict), ["k1", "k2", "k4"]);
    let all_down = |_: &Target| true;
    let verdict = judge(
        Some(&guard()),
        &current,
        &answer(&["k1"]),
        None,
        all_down,
        at(0),
    );
    assert_eq!(verdict.hold, None);
    assert_eq!(verdict.change, Change::None);
}

#[test]
fn a_held_target_that_goes_down_is_released_alone() {
    let current = targets(4);
    let first = judge(Some(&guard()), &current, &answer(&["k1"]), None, up, at(0));
    let down = |target: &Target| target.id == 2;
    let second = judge(
        Some(&guard()),
        &current,
        &answer(&["k1"]),
        first.hold.as_ref(),
        down,
        at(1_000),
    );
    let hold = second.hold.as_ref().unwrap();
    assert_eq!(hold.held, ["k3", "k4"]);
    assert_eq!(hold.confirmations, 2, "still the same set");
    assert_eq!(second.change, Change::StillHolding);
    let changes = reconcile(
        &current,
        &second.endpoints,
        at(1_000),
        std::time::Duration::from_secs(60),
    );
    assert!(
        matches!(changes.as_slice(), [TargetChange::Drain { id: 2, .. }]),
        "{changes:?}"
    );
}

/// Applies `answers` at the given times, feeding each hold into the next.
fn run(current: &[Target], steps: &[(i64, &Discovered)]) -> Vec<Verdict> {
    let mut hold = None;
    steps
        .iter()
        .map(|(ms, discovered)| {
            let verdict = judge(
                Some(&guard()),
                current,
                discovered,
                hold.as_ref(),
                up,
                at(*ms),
            );
            hold = verdict.hold.clone();
            verdict
        })
        .collect()
}

#[test]
fn confirmation_needs_both_the_time_and_three_refreshes() {
    let current = targets(3);
    let small = answer(&["k1"]);
    // Three refreshes within a second: not yet confirm_ms.
    let quick = run(&current, &[(0, &small), (500, &small), (1_000, &small)]);
    assert_eq!(quick[2].change, Change::StillHolding);
    assert_eq!(quick[2].hold.as_ref().unwrap().confirmations, 3);
    // Two refreshes a long time apart: not yet three.
    let slow = run(&current, &[(0, &small), (120_000, &small)]);
    assert_eq!(slow[1].change, Change::StillHolding);
    // Three, the last at confirm_ms: confirmed, the removals apply.
    let confirmed = run(&current, &[(0, &small), (30_000, &small), (60_000, &small)]);
    assert_eq!(confirmed[2].change, Change::Confirmed);
    assert_eq!(confirmed[2].hold, None);
    assert_eq!(keys(&confirmed[2]), ["k1"]);
    // One millisecond short.
    let short = run(&current, &[(0, &small), (30_000, &small), (59_999, &small)]);
    assert_eq!(short[2].change, Change::StillHolding);
}

#[test]
fn another_smaller_set_starts_the_confirmation_over() {
    let current = targets(4);
    let one = answer(&["k1"]);
    let other = answer(&["k2"]);
    let verdicts = run(
        &current,
        &[
            (0, &one),
            (30_000, &one),
            (50_000, &other),
            (61_000, &other),
        ],
    );
    assert_eq!(verdicts[2].change, Change::Started);
    let hold = verdicts[3].hold.as_ref().unwrap();
    assert_eq!(hold.since, at(50_000));
    assert_eq!(hold.confirmations, 2);
    assert_eq!(hold.held, ["k1", "k3", "k4"]);
}

#[test]
fn a_recovered_registry_ends_the_hold() {
    let current = targets(4);
    let all = answer(&["k1", "k2", "k3", "k4"]);
    let verdicts = run(&current, &[(0, &answer(&[])), (1_000, &all)]);
    assert_eq!(verdicts[1].change, Change::Ended);
    assert_eq!(verdicts[1].hold, None);
    assert_eq!(keys(&verdicts[1]), ["k1", "k2", "k3", "k4"]);
    // Partly recovered: three of four back, the one still missing drains.
    let three = answer(&["k1", "k2", "k3"]);
    let verdicts = run(&current, &[(0, &answer(&[])), (1_000, &three)]);
    assert_eq!(verdicts[1].change, Change::Ended);
    assert_eq!(keys(&verdicts[1]), ["k1", "k2", "k3"]);
}

#[test]
fn a_gradual_scale_down_is_never_held() {
    let mut current = targets(6);
    let mut live: Vec<String> = (1..=6).map(|i| format!("k{i}")).collect();
    let mut hold = None;
    for step in 0..5 {
        live.pop();
        let refs: Vec<&str> = live.iter().map(String::as_str).collect();
        let verdict = judge(
            Some(&guard()),
            &current,
            &answer(&refs),
            hold.as_ref(),
            up,
            at(step * 1_000),
        );
        assert_eq!(verdict.hold, None, "step {step}");
        hold = verdict.hold;
        // The removed target drains, as reconcile would make it.
        current
            .iter_mut()
            .filter(|t| !live.contains(t.provider_key.as_ref().unwrap()))
            .for_each(|t| t.state = TargetState::Draining);
    }
}

#[test]
fn only_active_discovered_targets_count() {
    let mut current = targets(4);
    current[1].state = TargetState::Draining;
    current[2].state = TargetState::Stale;
    current[3].provider_key = None;
    // k1 is the only active discovered target: removing it is one removal.
    let verdict = judge(Some(&guard()), &current, &answer(&[]), None, up, at(0));
    assert_eq!(verdict.hold, None);
    // A source whose targets all turned stale comes back small: nothing active to protect.
    let all_stale: Vec<Target> = targets(4)
        .into_iter()
        .map(|t| Target {
            state: TargetState::Stale,
            ..t
        })
        .collect();
    assert_eq!(
        judge(
            Some(&guard()),
            &all_stale,
            &answer(&["k1"]),
            None,
            up,
            at(0)
        )
        .hold,
        None
    );
}

#[test]
fn held_targets_keep_their_fields() {
    let mut current = targets(3);
    current[2].weight = 7;
    current[2].priority = 2;
    current[2].metadata = json!({"zone": "b"});
    let verdict = judge(Some(&guard()), &current, &answer(&["k1"]), None, up, at(0));
    let held = verdict.endpoints.iter().find(|e| e.key == "k3").unwrap();
    assert_eq!((held.weight, held.priority), (7, 2));
    assert_eq!(held.metadata, json!({"zone": "b"}));
}

#[test]
fn weight_or_metadata_churn_keeps_confirming() {
    let current = targets(4);
    let small = answer(&["k1"]);
    let mut churned = answer(&["k1"]);
    churned.endpoints[0].weight = 7;
    churned.endpoints[0].metadata = json!({"heartbeat": 2});
    churned.revision = revision_of(&churned.endpoints);
    let verdicts = run(
        &current,
        &[(0, &small), (30_000, &churned), (60_000, &small)],
    );
    assert_eq!(verdicts[1].change, Change::StillHolding);
    assert_eq!(
        verdicts[2].change,
        Change::Confirmed,
        "the same removals, three times"
    );
}

#[test]
fn endpoints_the_suspicious_answer_adds_do_not_dilute_the_share() {
    // Four known targets; the registry answers four others (a wrong environment).
    let mut current = targets(4);
    let strangers = answer(&["k5", "k6", "k7", "k8"]);
    let first = judge(Some(&guard()), &current, &strangers, None, up, at(0));
    assert_eq!(
        first.hold.as_ref().map(|h| (h.holding, h.base)),
        Some((4, 4))
    );
    // Reconcile created them: 4 of 8 active would be only half, but the hold measures against 4.
    current.extend((5..=8).map(|i| target(i, &format!("k{i}"))));
    let second = judge(
        Some(&guard()),
        &current,
        &strangers,
        first.hold.as_ref(),
        up,
        at(1_000),
    );
    assert_eq!(second.change, Change::StillHolding);
    assert_eq!(second.hold.as_ref().unwrap().confirmations, 2);
}

#[test]
fn keys_that_come_back_keep_the_confirmation_going() {
    let current = targets(10);
    let two = answer(&["k1", "k2"]);
    let three = answer(&["k1", "k2", "k3"]);
    let verdicts = run(&current, &[(0, &two), (30_000, &three), (60_000, &three)]);
    assert_eq!(
        verdicts[1].change,
        Change::StillHolding,
        "k3 returned: fewer removals"
    );
    assert_eq!(verdicts[1].hold.as_ref().unwrap().held.len(), 7);
    assert_eq!(verdicts[2].change, Change::Confirmed);
    assert_eq!(keys(&verdicts[2]), ["k1", "k2", "k3"]);
}

#[test]
fn a_hold_whose_targets_all_went_down_is_released() {
    let current = targets(3);
    let first = judge(Some(&guard()), &current, &answer(&[]), None, up, at(0));
    let all_down = |_: &Target| true;
    let second = judge(
        Some(&guard()),
        &current,
        &answer(&[]),
        first.hold.as_ref(),
        all_down,
        at(1),
    );
    assert_eq!(second.change, Change::Released);
    assert_eq!(second.hold, None);
    assert!(second.endpoints.is_empty(), "they drain");
}

#[test]
fn an_acceptance_releases_the_hold_it_saw_and_never_a_later_one() {
    let current = targets(4);
    let first = judge(Some(&guard()), &current, &answer(&["k1"]), None, up, at(0));
    let seen = first.hold.clone().expect("held");
    // The same removals answered again: the same hold (same `since`), released.
    let again = judge(
        Some(&guard()),
        &current,
        &answer(&["k1"]),
        Some(&seen),
        up,
        at(1_000),
    );
    let still = again.hold.expect("still held");
    assert_eq!(still.since, seen.since);
    assert!(acceptance_releases(Some(&seen), Some(&still)));
    // A key missing anew restarts the hold after the request: not released by it.
    let grown = judge(
        Some(&guard()),
        &current,
        &answer(&[]),
        Some(&still),
        up,
        at(2_000),
    )
    .hold
    .expect("held again");
    assert!(grown.since > seen.since);
    assert!(!acceptance_releases(Some(&seen), Some(&grown)));
    // A later hold stamped by a gateway whose clock lags (after a takeover): still not released.
    let mut lagging = grown.clone();
    lagging.since = seen.since - chrono::Duration::seconds(5);
    assert!(!acceptance_releases(Some(&seen), Some(&lagging)));
    // The same time but a key the request never saw held: not the hold it covered.
    let mut wider = still.clone();
    wider.held.push("k-other".into());
    assert!(!acceptance_releases(Some(&seen), Some(&wider)));
    // A request that saw no hold releases none; nothing held, nothing released.
    assert!(!acceptance_releases(None, Some(&still)));
    assert!(!acceptance_releases(Some(&seen), None));
}
