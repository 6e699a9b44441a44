use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use tokio::time::Instant;

use super::SourceTable;
use crate::control::sources::SourceEntry;
use crate::model::{DiscoverySource, Id, ProviderKind, SourceState};

fn at(seconds: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + seconds, 0).unwrap()
}

fn source(id: Id) -> DiscoverySource {
    DiscoverySource {
        id,
        service_id: 1,
        name: format!("source-{id}"),
        provider: ProviderKind::Dns,
        config: serde_json::json!({}),
        enabled: true,
        stale_after_ms: 10_000,
        removal_grace_ms: 1_000,
        removal_guard: None,
        managed_by: None,
        created_at: at(0),
        updated_at: at(0),
    }
}

/// What the table must answer, worked out by walking every entry.
fn walked_next_timer(table: &SourceTable) -> Option<DateTime<Utc>> {
    table
        .entries()
        .values()
        .filter_map(SourceEntry::timer_deadline)
        .min()
}

fn walked_due(table: &SourceTable, now: DateTime<Utc>) -> Vec<Id> {
    let mut due: Vec<(DateTime<Utc>, Id)> = table
        .entries()
        .values()
        .filter_map(|entry| entry.timer_deadline().map(|at| (at, entry.source.id)))
        .filter(|(at, _)| *at <= now)
        .collect();
    due.sort_unstable();
    due.into_iter().map(|(_, id)| id).collect()
}

fn walked_leases_ended(table: &SourceTable, now: Instant) -> Vec<Id> {
    let mut ended: Vec<(Instant, Id)> = table
        .entries()
        .values()
        .filter_map(|entry| entry.lease_until().map(|at| (at, entry.source.id)))
        .filter(|(at, _)| *at <= now)
        .collect();
    ended.sort_unstable();
    ended.into_iter().map(|(_, id)| id).collect()
}

/// Sets one of the three timers (or the lease) of `entry` at random.
fn change_one_timer(rng: &mut fastrand::Rng, entry: &mut SourceEntry, base: Instant) {
    let maybe_at = |rng: &mut fastrand::Rng| rng.bool().then(|| at(rng.i64(0..100)));
    match rng.u8(0..5) {
        0 => entry.next_removal = maybe_at(rng),
        1 => entry.guard_reread_at = maybe_at(rng),
        2 => {
            let failing = rng.bool();
            entry.progress.state = if failing {
                SourceState::Failing
            } else {
                SourceState::Healthy
            };
            entry.progress.failing_since = failing.then(|| at(rng.i64(0..100)));
        }
        3 => {
            let lease = rng
                .bool()
                .then(|| base + Duration::from_secs(rng.u64(0..100)));
            entry.set_lease_until(lease);
        }
        _ => entry.source.stale_after_ms = rng.u64(0..50) * 1_000,
    }
}

fn assert_agrees(table: &SourceTable, step: usize, base: Instant) {
    assert_eq!(table.next_timer(), walked_next_timer(table), "step {step}");
    for seconds in [0, 25, 50, 75, 200] {
        assert_eq!(
            table.due_timers(at(seconds)),
            walked_due(table, at(seconds)),
            "step {step}, due at {seconds}"
        );
        let now = base + Duration::from_secs(seconds as u64);
        assert_eq!(
            table.leases_ended(now),
            walked_leases_ended(table, now),
            "step {step}, leases ended at {seconds}"
        );
    }
    let walked_lease_end = table
        .entries()
        .values()
        .filter_map(SourceEntry::lease_until)
        .min();
    assert_eq!(table.next_lease_end(), walked_lease_end, "step {step}");
}

#[test]
fn the_order_follows_every_way_an_entry_changes() {
    let base = Instant::now();
    let mut rng = fastrand::Rng::with_seed(38);
    let mut table = SourceTable::default();
    for step in 0..5_000 {
        let id = rng.i64(1..40);
        match rng.u8(0..6) {
            0 => {
                let mut entry = SourceEntry::for_tests(source(id), Some(base));
                for _ in 0..3 {
                    change_one_timer(&mut rng, &mut entry, base);
                }
                table.insert(entry);
            }
            1 => {
                table.remove(&id);
            }
            2 => {
                // Taken out, changed, put back: how the control task changes most entries.
                if let Some(mut entry) = table.remove(&id) {
                    change_one_timer(&mut rng, &mut entry, base);
                    table.insert(entry);
                }
            }
            3 => {
                if let Some(mut entry) = table.get_mut(&id) {
                    change_one_timer(&mut rng, &mut entry, base);
                }
            }
            4 => {
                let cut = rng.i64(1..40);
                table.for_each_mut(|entry| {
                    if entry.source.id > cut {
                        entry.set_lease_until(None);
                    }
                });
            }
            _ => {
                let cut = rng.i64(1..40);
                table.retain(|entry| entry.source.id % 7 != cut % 7);
            }
        }
        assert_agrees(&table, step, base);
    }
}

#[test]
fn a_source_held_by_another_instance_has_no_timer_but_keeps_its_place_in_the_table() {
    let base = Instant::now();
    let mut table = SourceTable::default();
    let mut entry = SourceEntry::for_tests(source(1), Some(base + Duration::from_secs(9)));
    entry.next_removal = Some(at(5));
    table.insert(entry);
    assert_eq!(table.next_timer(), Some(at(5)));
    assert_eq!(table.due_timers(at(5)), vec![1]);
    assert_eq!(table.due_timers(at(4)), Vec::<Id>::new());
    assert_eq!(table.next_lease_end(), Some(base + Duration::from_secs(9)));

    table.get_mut(&1).unwrap().set_lease_until(None);
    assert_eq!(table.next_timer(), None);
    assert_eq!(table.next_lease_end(), None);
    assert!(table.contains_key(&1));
    assert_eq!(table.due_timers(at(100)), Vec::<Id>::new());
}
