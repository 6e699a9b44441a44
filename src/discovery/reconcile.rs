//! What a source's refreshes, staleness, disabling and the passing of time do to the targets it
//! owns (DESIGN §4), as a list of [`TargetChange`]s for the store to write. Pure: no I/O, and
//! the clock is an argument, so every rule is testable to the millisecond.
//!
//! `current` is always the targets owned by one source. Targets without a `provider_key` cannot
//! be matched to an endpoint, so `reconcile`, `mark_stale` and `drain_all` leave them alone rather
//! than guess; `expire` and `next_removal` follow draining deadlines only, whoever set them.
//!
//! Output order is deterministic so that the store writes and the tests see the same sequence:
//! creates and refreshes in endpoint order, then id-addressed changes in target id order.

use std::collections::hash_map::{Entry, HashMap};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};

use crate::model::{Endpoint, Target, TargetChange, TargetState};

/// On a *successful* refresh (possibly empty, e.g. NXDOMAIN): bring the source's targets in line
/// with `endpoints`, matched by `provider_key == endpoint.key`.
///
/// - A returning key gets `Refresh` only if a field differs or the target is not plainly
///   active (draining, stale, or carrying a deadline); an unchanged set yields no changes at all.
/// - A new key gets `Create`. Repeated endpoint keys: the first occurrence wins.
/// - A target whose key is gone is drained until `now + removal_grace`; one already draining
///   keeps its deadline, so repeated refreshes cannot postpone its removal forever.
/// - Should two targets share a key, the lowest id is the one matched and the others are
///   drained, so that each key ends with exactly one active target.
pub fn reconcile(
    current: &[Target],
    endpoints: &[Endpoint],
    now: DateTime<Utc>,
    removal_grace: Duration,
) -> Vec<TargetChange> {
    let (mut slots, surplus) = index_by_key(current, endpoints.len());
    let mut changes = Vec::new();

    for endpoint in endpoints {
        match slots.entry(endpoint.key.as_str()) {
            Entry::Vacant(vacant) => {
                vacant.insert(Slot::Claimed);
                changes.push(TargetChange::Create(endpoint.clone()));
            }
            Entry::Occupied(mut occupied) => {
                // `Claimed` here means a repeated endpoint key: the first occurrence already won.
                if let Slot::Unmatched(target) = *occupied.get() {
                    occupied.insert(Slot::Claimed);
                    if needs_refresh(target, endpoint) {
                        changes.push(TargetChange::Refresh {
                            id: target.id,
                            endpoint: endpoint.clone(),
                        });
                    }
                }
            }
        }
    }

    let unmatched = slots.into_values().filter_map(|slot| match slot {
        Slot::Unmatched(target) => Some(target),
        Slot::Claimed => None,
    });
    let remove_at = deadline(now, removal_grace);
    let gone = in_id_order(unmatched.chain(surplus).filter(|t| !is_leaving(t)));
    changes.extend(gone.into_iter().map(|target| TargetChange::Drain {
        id: target.id,
        remove_at,
    }));
    changes
}

/// The source just turned stale: its active targets stop taking new traffic but stay visible.
/// Draining targets stay draining (their removal is already decided).
pub fn mark_stale(current: &[Target]) -> Vec<TargetChange> {
    let active = current
        .iter()
        .filter(|t| is_discovered(t) && t.state == TargetState::Active);
    in_id_order(active)
        .into_iter()
        .map(|target| TargetChange::MarkStale { id: target.id })
        .collect()
}

/// The source was disabled: every target not already on its way out drains until
/// `now + removal_grace`.
pub fn drain_all(
    current: &[Target],
    now: DateTime<Utc>,
    removal_grace: Duration,
) -> Vec<TargetChange> {
    let remove_at = deadline(now, removal_grace);
    let staying = current
        .iter()
        .filter(|t| is_discovered(t) && !is_leaving(t));
    in_id_order(staying)
        .into_iter()
        .map(|target| TargetChange::Drain {
            id: target.id,
            remove_at,
        })
        .collect()
}

/// An admin accepted the removals the guard held: the active targets with these keys drain
/// until `now + removal_grace`.
pub fn drain_keys(
    current: &[Target],
    keys: &[String],
    now: DateTime<Utc>,
    removal_grace: Duration,
) -> Vec<TargetChange> {
    let remove_at = deadline(now, removal_grace);
    let named = current.iter().filter(|t| {
        t.state == TargetState::Active
            && t.provider_key
                .as_ref()
                .is_some_and(|key| keys.contains(key))
    });
    in_id_order(named)
        .into_iter()
        .map(|target| TargetChange::Drain {
            id: target.id,
            remove_at,
        })
        .collect()
}

/// Draining targets whose grace has ended (`remove_at <= now`) are deleted.
pub fn expire(current: &[Target], now: DateTime<Utc>) -> Vec<TargetChange> {
    let due = current
        .iter()
        .filter(|t| draining_deadline(t).is_some_and(|at| at <= now));
    in_id_order(due)
        .into_iter()
        .map(|target| TargetChange::Delete { id: target.id })
        .collect()
}

/// The earliest deadline among draining targets: when the caller must wake up to `expire` next.
pub fn next_removal(current: &[Target]) -> Option<DateTime<Utc>> {
    current.iter().filter_map(draining_deadline).min()
}

/// The earliest removal deadline once `changes` (made from `current`) are written: what reading
/// the source's targets back would give, without reading them back.
pub fn next_removal_after(current: &[Target], changes: &[TargetChange]) -> Option<DateTime<Utc>> {
    let mut deadlines: HashMap<crate::model::Id, Option<DateTime<Utc>>> = current
        .iter()
        .map(|target| (target.id, draining_deadline(target)))
        .collect();
    for change in changes {
        match change {
            // New targets are active.
            TargetChange::Create(_) => {}
            TargetChange::Refresh { id, .. } | TargetChange::MarkStale { id } => {
                if let Some(deadline) = deadlines.get_mut(id) {
                    *deadline = None;
                }
            }
            TargetChange::Drain { id, remove_at } => {
                if let Some(deadline) = deadlines.get_mut(id) {
                    *deadline = Some(*remove_at);
                }
            }
            TargetChange::Delete { id } => {
                deadlines.remove(id);
            }
        }
    }
    deadlines.into_values().flatten().min()
}

/// A key's state during one reconcile.
#[derive(Clone, Copy)]
enum Slot<'a> {
    /// A target with this key that no endpoint has matched yet.
    Unmatched(&'a Target),
    /// An endpoint with this key was seen; later endpoints with the same key are ignored.
    Claimed,
}

/// Targets by provider key, and the targets that lost a key collision (lowest id wins, so the
/// choice does not depend on the order the store returned them in).
fn index_by_key(
    current: &[Target],
    endpoint_count: usize,
) -> (HashMap<&str, Slot<'_>>, Vec<&Target>) {
    // Room for every target and every new endpoint key: the map never grows mid-reconcile.
    let mut slots = HashMap::with_capacity(current.len() + endpoint_count);
    let mut surplus = Vec::new();
    for target in current {
        let Some(key) = target.provider_key.as_deref() else {
            continue;
        };
        match slots.entry(key) {
            Entry::Vacant(vacant) => {
                vacant.insert(Slot::Unmatched(target));
            }
            Entry::Occupied(mut occupied) => {
                if let Slot::Unmatched(held) = *occupied.get() {
                    if target.id < held.id {
                        occupied.insert(Slot::Unmatched(target));
                        surplus.push(held);
                    } else {
                        surplus.push(target);
                    }
                }
            }
        }
    }
    (slots, surplus)
}

/// A refresh is written only when it would change something: a no-op refresh of a large source
/// must cost no store writes and no snapshot rebuild.
fn needs_refresh(target: &Target, endpoint: &Endpoint) -> bool {
    target.state != TargetState::Active
        || target.remove_at.is_some()
        || !same_fields(target, endpoint)
}

fn same_fields(target: &Target, endpoint: &Endpoint) -> bool {
    target.host == endpoint.host
        && target.port == endpoint.port
        && target.weight == endpoint.weight
        && target.priority == endpoint.priority
        && target.enabled == endpoint.enabled
        && target.metadata == endpoint.metadata
}

fn is_discovered(target: &Target) -> bool {
    target.provider_key.is_some()
}

/// Already draining with a deadline: draining it again would only push the deadline back. A
/// draining target without a deadline (a damaged row) is not leaving: it would never be deleted.
fn is_leaving(target: &Target) -> bool {
    draining_deadline(target).is_some()
}

fn draining_deadline(target: &Target) -> Option<DateTime<Utc>> {
    match target.state {
        TargetState::Draining => target.remove_at,
        TargetState::Active | TargetState::Stale => None,
    }
}

/// `now + grace`, saturating: an absurd grace must mean "never", not a panic or a wrap into the past.
fn deadline(now: DateTime<Utc>, grace: Duration) -> DateTime<Utc> {
    TimeDelta::from_std(grace)
        .ok()
        .and_then(|grace| now.checked_add_signed(grace))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn in_id_order<'a>(targets: impl Iterator<Item = &'a Target>) -> Vec<&'a Target> {
    let mut targets: Vec<&Target> = targets.collect();
    targets.sort_by_key(|target| target.id);
    targets
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, HashSet};

    use serde_json::json;

    use super::*;
    use crate::model::{Health, Id};

    const GRACE: Duration = Duration::from_millis(60_000);

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(ms).unwrap()
    }

    fn now() -> DateTime<Utc> {
        at(1_700_000_000_000)
    }

    fn endpoint(key: &str) -> Endpoint {
        Endpoint {
            key: key.to_owned(),
            host: "10.0.0.1".to_owned(),
            port: 8080,
            weight: 100,
            priority: 0,
            enabled: true,
            metadata: json!({}),
        }
    }

    /// An active discovered target whose fields equal `endpoint(key)`.
    fn target(id: Id, key: &str) -> Target {
        let ep = endpoint(key);
        Target {
            id,
            service_id: 1,
            source_id: Some(7),
            host: ep.host,
            port: ep.port,
            weight: ep.weight,
            priority: ep.priority,
            enabled: ep.enabled,
            metadata: ep.metadata,
            provider_key: Some(key.to_owned()),
            state: TargetState::Active,
            health: Health::Healthy,
            ejected_until: None,
            remove_at: None,
            last_check: None,
            managed_by: None,
            created_at: at(1_600_000_000_000),
            updated_at: at(1_600_000_000_000),
        }
    }

    #[test]
    fn the_next_removal_after_changes_is_what_a_read_back_would_give() {
        let current = [
            target(1, "a"),
            draining(2, "b", at(5_000)),
            draining(3, "c", at(3_000)),
            target(4, "d"),
        ];
        assert_eq!(next_removal_after(&current, &[]), Some(at(3_000)));
        let changes = [
            TargetChange::Refresh {
                id: 3,
                endpoint: endpoint("c"),
            },
            TargetChange::Drain {
                id: 4,
                remove_at: at(4_000),
            },
            TargetChange::Create(endpoint("e")),
        ];
        assert_eq!(next_removal_after(&current, &changes), Some(at(4_000)));
        let gone = [
            TargetChange::Delete { id: 2 },
            TargetChange::Delete { id: 3 },
            TargetChange::MarkStale { id: 1 },
        ];
        assert_eq!(next_removal_after(&current, &gone), None);
        let unknown = [TargetChange::Drain {
            id: 99,
            remove_at: at(1_000),
        }];
        assert_eq!(
            next_removal_after(&current, &unknown),
            Some(at(3_000)),
            "the store only writes the source's own targets"
        );
    }

    fn draining(id: Id, key: &str, remove_at: DateTime<Utc>) -> Target {
        Target {
            state: TargetState::Draining,
            remove_at: Some(remove_at),
            ..target(id, key)
        }
    }

    fn stale(id: Id, key: &str) -> Target {
        Target {
            state: TargetState::Stale,
            ..target(id, key)
        }
    }

    /// An operator target: no source, no key.
    fn operator(id: Id) -> Target {
        Target {
            source_id: None,
            provider_key: None,
            ..target(id, "unused")
        }
    }

    fn drain(id: Id, remove_at: DateTime<Utc>) -> TargetChange {
        TargetChange::Drain { id, remove_at }
    }

    fn refresh(id: Id, endpoint: Endpoint) -> TargetChange {
        TargetChange::Refresh { id, endpoint }
    }

    fn grace_end() -> DateTime<Utc> {
        now() + TimeDelta::milliseconds(60_000)
    }

    // --- reconcile -------------------------------------------------------------------------

    #[test]
    fn new_key_is_created() {
        let changes = reconcile(&[], &[endpoint("a")], now(), GRACE);
        assert_eq!(changes, vec![TargetChange::Create(endpoint("a"))]);
    }

    #[test]
    fn unchanged_endpoint_produces_no_change() {
        let current = [target(1, "a"), target(2, "b")];
        let changes = reconcile(&current, &[endpoint("b"), endpoint("a")], now(), GRACE);
        assert_eq!(changes, vec![]);
    }

    #[test]
    fn each_field_change_refreshes_keeping_the_id() {
        type Edit = (&'static str, fn(&mut Endpoint));
        let edits: [Edit; 6] = [
            ("host", |e| e.host = "10.0.0.2".to_owned()),
            ("port", |e| e.port = 9090),
            ("weight", |e| e.weight = 5),
            ("priority", |e| e.priority = -1),
            ("enabled", |e| e.enabled = false),
            ("metadata", |e| e.metadata = json!({"zone": "b"})),
        ];
        for (field, edit) in edits {
            let mut changed = endpoint("a");
            edit(&mut changed);
            let changes = reconcile(&[target(3, "a")], &[changed.clone()], now(), GRACE);
            assert_eq!(changes, vec![refresh(3, changed)], "{field}");
        }
    }

    #[test]
    fn metadata_compares_by_value_not_key_order() {
        let mut current = target(1, "a");
        current.metadata = json!({"zone": "a", "rack": 2});
        let mut ep = endpoint("a");
        ep.metadata = serde_json::from_str(r#"{"rack": 2, "zone": "a"}"#).unwrap();
        assert_eq!(reconcile(&[current], &[ep], now(), GRACE), vec![]);
    }

    #[test]
    fn draining_target_returns_active_with_same_id() {
        let current = [draining(4, "a", now())];
        let changes = reconcile(&current, &[endpoint("a")], now(), GRACE);
        assert_eq!(changes, vec![refresh(4, endpoint("a"))]);
    }

    #[test]
    fn stale_target_returns_active_with_same_id() {
        let changes = reconcile(&[stale(5, "a")], &[endpoint("a")], now(), GRACE);
        assert_eq!(changes, vec![refresh(5, endpoint("a"))]);
    }

    #[test]
    fn active_target_with_leftover_deadline_is_refreshed_to_clear_it() {
        let current = [Target {
            remove_at: Some(now()),
            ..target(6, "a")
        }];
        let changes = reconcile(&current, &[endpoint("a")], now(), GRACE);
        assert_eq!(changes, vec![refresh(6, endpoint("a"))]);
    }

    #[test]
    fn absent_active_target_drains_until_exact_deadline() {
        let changes = reconcile(&[target(1, "a")], &[endpoint("b")], now(), GRACE);
        assert_eq!(
            changes,
            vec![
                TargetChange::Create(endpoint("b")),
                drain(1, at(1_700_000_060_000))
            ]
        );
    }

    #[test]
    fn absent_stale_target_drains() {
        let changes = reconcile(&[stale(2, "a")], &[], now(), GRACE);
        assert_eq!(changes, vec![drain(2, grace_end())]);
    }

    #[test]
    fn absent_draining_target_keeps_its_old_deadline() {
        let old = now() + TimeDelta::milliseconds(5);
        let changes = reconcile(&[draining(3, "a", old)], &[], now(), GRACE);
        assert_eq!(changes, vec![]);
    }

    #[test]
    fn absent_draining_target_without_deadline_gets_one() {
        let current = [Target {
            remove_at: None,
            ..draining(3, "a", now())
        }];
        assert_eq!(
            reconcile(&current, &[], now(), GRACE),
            vec![drain(3, grace_end())]
        );
    }

    #[test]
    fn duplicate_endpoint_keys_first_occurrence_wins() {
        let mut second = endpoint("a");
        second.port = 1;
        // New key: one create, of the first occurrence.
        let changes = reconcile(&[], &[endpoint("a"), second.clone()], now(), GRACE);
        assert_eq!(changes, vec![TargetChange::Create(endpoint("a"))]);
        // Known key: the first occurrence matches the target exactly, so nothing changes.
        let changes = reconcile(
            &[target(1, "a")],
            &[endpoint("a"), second.clone()],
            now(),
            GRACE,
        );
        assert_eq!(changes, vec![]);
        // And the other way round the second occurrence is ignored too.
        let changes = reconcile(
            &[target(1, "a")],
            &[second.clone(), endpoint("a")],
            now(),
            GRACE,
        );
        assert_eq!(changes, vec![refresh(1, second)]);
    }

    #[test]
    fn duplicate_target_keys_keep_lowest_id_and_drain_the_rest() {
        let current = [target(9, "a"), target(2, "a"), target(5, "a")];
        let changes = reconcile(&current, &[endpoint("a")], now(), GRACE);
        assert_eq!(changes, vec![drain(5, grace_end()), drain(9, grace_end())]);
        // With the key gone, all of them drain, once each.
        let changes = reconcile(&current, &[], now(), GRACE);
        let expected = vec![
            drain(2, grace_end()),
            drain(5, grace_end()),
            drain(9, grace_end()),
        ];
        assert_eq!(changes, expected);
    }

    #[test]
    fn empty_endpoint_list_drains_everything_not_already_draining() {
        let old = now() + TimeDelta::milliseconds(1);
        let current = [target(3, "c"), draining(1, "a", old), stale(2, "b")];
        let changes = reconcile(&current, &[], now(), GRACE);
        assert_eq!(changes, vec![drain(2, grace_end()), drain(3, grace_end())]);
    }

    #[test]
    fn operator_targets_without_key_are_untouched() {
        let current = [operator(1), target(2, "a")];
        assert_eq!(reconcile(&current, &[endpoint("a")], now(), GRACE), vec![]);
        assert_eq!(
            reconcile(&current, &[], now(), GRACE),
            vec![drain(2, grace_end())]
        );
        let stale_operator = Target {
            state: TargetState::Stale,
            ..operator(3)
        };
        assert_eq!(reconcile(&[stale_operator], &[], now(), GRACE), vec![]);
    }

    #[test]
    fn output_order_is_endpoints_then_drains_by_id() {
        let mut moved = endpoint("b");
        moved.port = 1;
        let current = [
            target(30, "x"),
            target(10, "b"),
            target(20, "y"),
            target(5, "z"),
        ];
        let endpoints = [endpoint("n2"), moved.clone(), endpoint("n1")];
        let expected = vec![
            TargetChange::Create(endpoint("n2")),
            refresh(10, moved),
            TargetChange::Create(endpoint("n1")),
            drain(5, grace_end()),
            drain(20, grace_end()),
            drain(30, grace_end()),
        ];
        // The same answer whatever order the store returned the targets in.
        let mut reversed = current.clone();
        reversed.reverse();
        assert_eq!(reconcile(&current, &endpoints, now(), GRACE), expected);
        assert_eq!(reconcile(&reversed, &endpoints, now(), GRACE), expected);
    }

    #[test]
    fn zero_grace_drains_until_now() {
        let changes = reconcile(&[target(1, "a")], &[], now(), Duration::ZERO);
        assert_eq!(changes, vec![drain(1, now())]);
    }

    #[test]
    fn huge_grace_saturates_instead_of_panicking() {
        let changes = reconcile(&[target(1, "a")], &[], now(), Duration::MAX);
        assert_eq!(changes, vec![drain(1, DateTime::<Utc>::MAX_UTC)]);
        let changes = drain_all(&[target(1, "a")], now(), Duration::from_secs(u64::MAX / 4));
        assert_eq!(changes, vec![drain(1, DateTime::<Utc>::MAX_UTC)]);
    }

    // --- mark_stale --------------------------------------------------------------------------

    #[test]
    fn mark_stale_marks_only_active_targets_in_id_order() {
        let current = [
            target(3, "c"),
            draining(1, "a", now()),
            stale(2, "b"),
            target(0, "z"),
            operator(9),
        ];
        assert_eq!(
            mark_stale(&current),
            vec![
                TargetChange::MarkStale { id: 0 },
                TargetChange::MarkStale { id: 3 }
            ]
        );
    }

    #[test]
    fn mark_stale_of_nothing_is_nothing() {
        assert_eq!(mark_stale(&[]), vec![]);
        assert_eq!(mark_stale(&[stale(1, "a")]), vec![]);
    }

    // --- drain_all ---------------------------------------------------------------------------

    #[test]
    fn drain_keys_drains_only_the_named_active_targets() {
        let current = [
            target(1, "a"),
            target(2, "b"),
            draining(3, "c", now() + TimeDelta::seconds(5)),
            target(4, "d"),
        ];
        let keys = ["b".to_owned(), "c".to_owned(), "zz".to_owned()];
        assert_eq!(
            drain_keys(&current, &keys, now(), GRACE),
            [TargetChange::Drain {
                id: 2,
                remove_at: now() + TimeDelta::seconds(60)
            }]
        );
    }

    #[test]
    fn drain_all_drains_active_and_stale_but_keeps_existing_deadlines() {
        let old = now() + TimeDelta::milliseconds(1);
        let current = [
            target(3, "c"),
            draining(1, "a", old),
            stale(2, "b"),
            operator(4),
        ];
        assert_eq!(
            drain_all(&current, now(), GRACE),
            vec![drain(2, grace_end()), drain(3, grace_end())]
        );
        assert_eq!(drain_all(&[], now(), GRACE), vec![]);
    }

    // --- expire ------------------------------------------------------------------------------

    #[test]
    fn expire_deletes_draining_targets_at_or_past_their_deadline() {
        let current = [
            draining(3, "c", now()),                              // exactly now: due
            draining(1, "a", now() - TimeDelta::milliseconds(1)), // past: due
            draining(2, "b", now() + TimeDelta::milliseconds(1)), // 1 ms to go
            Target {
                remove_at: Some(now() - TimeDelta::milliseconds(1)),
                ..target(4, "d") // active: a deadline only counts while draining
            },
            Target {
                remove_at: None,
                ..draining(5, "e", now())
            },
        ];
        assert_eq!(
            expire(&current, now()),
            vec![
                TargetChange::Delete { id: 1 },
                TargetChange::Delete { id: 3 }
            ]
        );
        assert_eq!(expire(&[], now()), vec![]);
    }

    #[test]
    fn expire_follows_deadlines_even_without_a_key() {
        let current = [Target {
            state: TargetState::Draining,
            remove_at: Some(now()),
            ..operator(1)
        }];
        assert_eq!(
            expire(&current, now()),
            vec![TargetChange::Delete { id: 1 }]
        );
    }

    // --- next_removal ------------------------------------------------------------------------

    #[test]
    fn next_removal_is_the_earliest_draining_deadline() {
        let current = [
            draining(1, "a", at(300)),
            draining(2, "b", at(100)),
            draining(3, "c", at(200)),
            Target {
                remove_at: Some(at(50)),
                ..stale(4, "d") // not draining: ignored
            },
        ];
        assert_eq!(next_removal(&current), Some(at(100)));
    }

    #[test]
    fn next_removal_is_none_without_draining_targets() {
        assert_eq!(next_removal(&[]), None);
        assert_eq!(next_removal(&[target(1, "a"), stale(2, "b")]), None);
        let no_deadline = Target {
            remove_at: None,
            ..draining(3, "c", now())
        };
        assert_eq!(next_removal(&[no_deadline]), None);
    }

    // --- property ----------------------------------------------------------------------------

    /// Applies changes the way the store does, to a map of targets by id.
    fn apply(model: &mut BTreeMap<Id, Target>, changes: &[TargetChange], next_id: &mut Id) {
        let mut touched = HashSet::new();
        for change in changes {
            match change {
                TargetChange::Create(ep) => {
                    *next_id += 1;
                    let created = Target {
                        host: ep.host.clone(),
                        port: ep.port,
                        weight: ep.weight,
                        priority: ep.priority,
                        enabled: ep.enabled,
                        metadata: ep.metadata.clone(),
                        health: Health::Unknown,
                        ..target(*next_id, &ep.key)
                    };
                    model.insert(*next_id, created);
                }
                TargetChange::Refresh { id, endpoint: ep } => {
                    assert!(touched.insert(*id), "target {id} changed twice");
                    let t = model.get_mut(id).expect("refresh of a known target");
                    assert_eq!(t.provider_key.as_deref(), Some(ep.key.as_str()));
                    t.host = ep.host.clone();
                    t.port = ep.port;
                    t.weight = ep.weight;
                    t.priority = ep.priority;
                    t.enabled = ep.enabled;
                    t.metadata = ep.metadata.clone();
                    t.state = TargetState::Active;
                    t.remove_at = None;
                }
                TargetChange::Drain { id, remove_at } => {
                    assert!(touched.insert(*id), "target {id} changed twice");
                    let t = model.get_mut(id).expect("drain of a known target");
                    t.state = TargetState::Draining;
                    t.remove_at = Some(*remove_at);
                }
                TargetChange::MarkStale { id } => {
                    model.get_mut(id).expect("known target").state = TargetState::Stale;
                }
                TargetChange::Delete { id } => {
                    model.remove(id).expect("delete of a known target");
                }
            }
        }
    }

    fn random_endpoint(rng: &mut fastrand::Rng, key: String) -> Endpoint {
        Endpoint {
            key,
            host: format!("10.0.0.{}", rng.u8(1..4)),
            port: rng.u16(8080..8083),
            weight: rng.u32(0..3),
            priority: rng.i32(-1..2),
            enabled: rng.bool(),
            metadata: if rng.bool() {
                json!({})
            } else {
                json!({"zone": rng.u8(0..2)})
            },
        }
    }

    /// The endpoint a target was made from.
    fn endpoint_of(target: &Target) -> Endpoint {
        target.discovered_endpoint().expect("a discovered target")
    }

    fn random_target(rng: &mut fastrand::Rng, id: Id, key: String) -> Target {
        let ep = random_endpoint(rng, key.clone());
        let state = [
            TargetState::Active,
            TargetState::Stale,
            TargetState::Draining,
        ][rng.usize(0..3)];
        Target {
            host: ep.host,
            port: ep.port,
            weight: ep.weight,
            priority: ep.priority,
            enabled: ep.enabled,
            metadata: ep.metadata,
            state,
            remove_at: (state == TargetState::Draining)
                .then(|| now() + TimeDelta::milliseconds(rng.i64(-5..5))),
            ..target(id, &key)
        }
    }

    #[test]
    fn property_applied_changes_leave_endpoint_keys_active_and_the_rest_draining() {
        let mut rng = fastrand::Rng::with_seed(0x5eed_4a41);
        for round in 0..500 {
            let pool = rng.usize(0..25);
            // Unique keys among the current targets, in a shuffled id order, plus operator targets.
            let mut ids: Vec<Id> = (1..=pool as Id).collect();
            rng.shuffle(&mut ids);
            let mut model = BTreeMap::new();
            for (slot, id) in ids.iter().enumerate() {
                if rng.bool() {
                    model.insert(*id, random_target(&mut rng, *id, format!("k{slot}")));
                }
            }
            let operator_id = 1_000 + round;
            model.insert(operator_id, operator(operator_id));
            let before = model.clone();

            // Endpoints: a random subset of the pool and some new keys, with repeats. Half of
            // the known keys come back unchanged, so that state alone must decide the refresh.
            let endpoints: Vec<Endpoint> = (0..rng.usize(0..30))
                .map(|_| {
                    let key = format!("k{}", rng.usize(0..pool + 5));
                    let known = before
                        .values()
                        .find(|t| t.provider_key.as_ref() == Some(&key));
                    match known {
                        Some(t) if rng.bool() => endpoint_of(t),
                        _ => random_endpoint(&mut rng, key),
                    }
                })
                .collect();

            let current: Vec<Target> = model.values().cloned().collect();
            let changes = reconcile(&current, &endpoints, now(), GRACE);
            let mut next_id = 10_000;
            apply(&mut model, &changes, &mut next_id);

            // Each distinct endpoint key: exactly one active target, with the first occurrence's fields.
            let mut first: BTreeMap<&str, &Endpoint> = BTreeMap::new();
            for ep in &endpoints {
                first.entry(ep.key.as_str()).or_insert(ep);
            }
            for (key, ep) in &first {
                let matching: Vec<&Target> = model
                    .values()
                    .filter(|t| t.provider_key.as_deref() == Some(key))
                    .collect();
                assert_eq!(matching.len(), 1, "round {round} key {key}");
                let t = matching[0];
                assert_eq!(t.state, TargetState::Active, "round {round} key {key}");
                assert_eq!(t.remove_at, None);
                assert!(same_fields(t, ep), "round {round} key {key}");
                // A returning key keeps its id.
                if let Some(old) = before
                    .values()
                    .find(|o| o.provider_key.as_deref() == Some(key))
                {
                    assert_eq!(t.id, old.id, "round {round} key {key}");
                }
            }
            // Every other discovered target drains; an earlier deadline is kept.
            for t in model.values().filter(|t| is_discovered(t)) {
                let key = t.provider_key.as_deref().unwrap();
                if first.contains_key(key) {
                    continue;
                }
                assert_eq!(t.state, TargetState::Draining, "round {round} key {key}");
                let old = &before[&t.id];
                let expected = match old.state {
                    TargetState::Draining => old.remove_at,
                    _ => Some(grace_end()),
                };
                assert_eq!(t.remove_at, expected, "round {round} key {key}");
            }
            assert_eq!(model[&operator_id], before[&operator_id]);

            // Reconciling the result against the same endpoints is a no-op.
            let current: Vec<Target> = model.values().cloned().collect();
            assert_eq!(
                reconcile(&current, &endpoints, now(), GRACE),
                vec![],
                "round {round}"
            );
            // And once the grace has passed, only the endpoint keys (and the operator) remain.
            let late = grace_end().max(now() + TimeDelta::milliseconds(5));
            apply(&mut model, &expire(&current, late), &mut next_id);
            assert_eq!(model.len(), first.len() + 1, "round {round}");
        }
    }
}
