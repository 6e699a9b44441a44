//! The control task's discovery sources by id, with their timer deadlines and lease ends kept in
//! order, so each turn of the control loop finds the next deadline, and a timer turn the due
//! sources, without walking every source (5,000 sources cost about 350 µs a turn that way).
//!
//! The order is kept right by construction: an entry can only be changed while out of the table
//! (`remove` … `insert`) or through [`EntryMut`], and both index it again.

use std::collections::{BTreeSet, HashMap};
use std::ops::{Deref, DerefMut};

use chrono::{DateTime, Utc};
use tokio::time::Instant;

use super::sources::SourceEntry;
use crate::model::Id;

#[derive(Default)]
pub(super) struct SourceTable {
    entries: HashMap<Id, SourceEntry>,
    index: DeadlineIndex,
}

impl SourceTable {
    pub(super) fn entries(&self) -> &HashMap<Id, SourceEntry> {
        &self.entries
    }

    pub(super) fn get(&self, id: &Id) -> Option<&SourceEntry> {
        self.entries.get(id)
    }

    pub(super) fn contains_key(&self, id: &Id) -> bool {
        self.entries.contains_key(id)
    }

    pub(super) fn ids(&self) -> Vec<Id> {
        self.entries.keys().copied().collect()
    }

    pub(super) fn insert(&mut self, entry: SourceEntry) {
        let id = entry.source.id;
        self.index.set(id, Keys::of(&entry));
        self.entries.insert(id, entry);
    }

    pub(super) fn remove(&mut self, id: &Id) -> Option<SourceEntry> {
        let entry = self.entries.remove(id)?;
        self.index.set(*id, Keys::default());
        Some(entry)
    }

    /// The entry, indexed again when the returned guard is dropped.
    pub(super) fn get_mut(&mut self, id: &Id) -> Option<EntryMut<'_>> {
        let entry = self.entries.get_mut(id)?;
        Some(EntryMut {
            entry,
            index: &mut self.index,
        })
    }

    /// Calls `change` on every entry, indexing each again.
    pub(super) fn for_each_mut(&mut self, mut change: impl FnMut(&mut SourceEntry)) {
        for (id, entry) in &mut self.entries {
            change(entry);
            self.index.set(*id, Keys::of(entry));
        }
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&SourceEntry) -> bool) {
        let index = &mut self.index;
        self.entries.retain(|id, entry| {
            let kept = keep(entry);
            if !kept {
                index.set(*id, Keys::default());
            }
            kept
        });
    }

    /// The earliest removal, stale or guard re-read deadline of a source whose lease this
    /// instance holds.
    pub(super) fn next_timer(&self) -> Option<DateTime<Utc>> {
        self.index.timers.first().map(|(at, _)| *at)
    }

    /// The sources with a timer deadline at or before `now`, earliest first.
    pub(super) fn due_timers(&self, now: DateTime<Utc>) -> Vec<Id> {
        self.index
            .timers
            .range(..=(now, Id::MAX))
            .map(|(_, id)| *id)
            .collect()
    }

    /// When the earliest lease this instance holds ends.
    pub(super) fn next_lease_end(&self) -> Option<Instant> {
        self.index.lease_ends.first().map(|(at, _)| *at)
    }

    /// The sources whose lease this instance holds until `now` or earlier.
    pub(super) fn leases_ended(&self, now: Instant) -> Vec<Id> {
        self.index
            .lease_ends
            .range(..=(now, Id::MAX))
            .map(|(_, id)| *id)
            .collect()
    }
}

/// A mutable borrow of one entry that indexes it again when dropped.
pub(super) struct EntryMut<'a> {
    entry: &'a mut SourceEntry,
    index: &'a mut DeadlineIndex,
}

impl Deref for EntryMut<'_> {
    type Target = SourceEntry;

    fn deref(&self) -> &SourceEntry {
        self.entry
    }
}

impl DerefMut for EntryMut<'_> {
    fn deref_mut(&mut self) -> &mut SourceEntry {
        self.entry
    }
}

impl Drop for EntryMut<'_> {
    fn drop(&mut self) {
        self.index.set(self.entry.source.id, Keys::of(self.entry));
    }
}

/// What an entry is ordered by.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
struct Keys {
    timer: Option<DateTime<Utc>>,
    lease_end: Option<Instant>,
}

impl Keys {
    fn of(entry: &SourceEntry) -> Keys {
        Keys {
            timer: entry.timer_deadline(),
            lease_end: entry.lease_until(),
        }
    }
}

#[derive(Default)]
struct DeadlineIndex {
    /// Each indexed entry's keys, to find its place in the sets when they change.
    keys: HashMap<Id, Keys>,
    timers: BTreeSet<(DateTime<Utc>, Id)>,
    lease_ends: BTreeSet<(Instant, Id)>,
}

impl DeadlineIndex {
    fn set(&mut self, id: Id, keys: Keys) {
        let previous = if keys == Keys::default() {
            self.keys.remove(&id)
        } else {
            self.keys.insert(id, keys)
        }
        .unwrap_or_default();
        if previous.timer != keys.timer {
            if let Some(at) = previous.timer {
                self.timers.remove(&(at, id));
            }
            if let Some(at) = keys.timer {
                self.timers.insert((at, id));
            }
        }
        if previous.lease_end != keys.lease_end {
            if let Some(at) = previous.lease_end {
                self.lease_ends.remove(&(at, id));
            }
            if let Some(at) = keys.lease_end {
                self.lease_ends.insert((at, id));
            }
        }
    }
}

#[cfg(test)]
mod tests;
