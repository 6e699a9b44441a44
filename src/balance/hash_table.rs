//! Consistent hashing for one tier (TRAFFIC.md §5): a key's hash names a slot, the slot names a
//! member, and the slots after it are the key's next choices when that member is unavailable or
//! above its load bound.
//!
//! Both tables are built only from each member's identity hash and weight, sorted by identity:
//! every gateway builds the same table for the same target set whatever order it learnt the
//! targets in, and no process seed is involved.

use std::sync::Arc;

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::maglev::Maglev;
use super::ring::Ring;

/// Slots walked from a key's own before giving up on the table's order: enough to pass every
/// unavailable or loaded member a realistic tier has in a row, and still a bounded pick.
const WALK_LIMIT: usize = 64;

/// Seed of identity hashes, distinct from the key hash's default so that a key equal to a
/// target's identity does not land on that target's own points.
const IDENTITY_SEED: u64 = 0x7261_6168_6920_6964; // "raahi id"

/// The hash of a request's key (header, cookie, query value or client address).
pub fn key_hash(key: &[u8]) -> u64 {
    xxh3_64(key)
}

/// The hash of a target's stable identity (provider key, else `host:port`).
pub fn identity_hash(identity: &str) -> u64 {
    xxh3_64_with_seed(identity.as_bytes(), IDENTITY_SEED)
}

/// SplitMix64's finaliser: spreads consecutive inputs over the whole 64-bit range. Used to derive
/// ring points and Maglev permutations from one identity hash without hashing bytes again.
pub(super) fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Which consistent hash a tier uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashKind {
    Ring,
    Maglev,
}

impl HashKind {
    pub fn as_str(self) -> &'static str {
        match self {
            HashKind::Ring => "ring_hash",
            HashKind::Maglev => "maglev",
        }
    }
}

/// Tier-local member indices, one or two bytes each while the tier allows it: tables hold 100
/// slots or more per member, so this divides the memory of every hashed service of ordinary
/// size by two or four.
#[derive(Debug)]
pub(super) enum Owners {
    Tiny(Box<[u8]>),
    Narrow(Box<[u16]>),
    Wide(Box<[u32]>),
}

impl Owners {
    pub(super) fn new(indices: impl ExactSizeIterator<Item = usize>, members: usize) -> Owners {
        if members <= usize::from(u8::MAX) + 1 {
            // Every index is below `members` ≤ 2^8.
            Owners::Tiny(indices.map(|i| i as u8).collect())
        } else if members <= usize::from(u16::MAX) + 1 {
            // Every index is below `members` ≤ 2^16.
            Owners::Narrow(indices.map(|i| i as u16).collect())
        } else {
            Owners::Wide(indices.map(|i| i as u32).collect())
        }
    }

    pub(super) fn get(&self, slot: usize) -> usize {
        match self {
            Owners::Tiny(owners) => usize::from(owners[slot]),
            Owners::Narrow(owners) => usize::from(owners[slot]),
            Owners::Wide(owners) => owners[slot] as usize,
        }
    }

    pub(super) fn len(&self) -> usize {
        match self {
            Owners::Tiny(owners) => owners.len(),
            Owners::Narrow(owners) => owners.len(),
            Owners::Wide(owners) => owners.len(),
        }
    }

    pub(super) fn bytes(&self) -> usize {
        match self {
            Owners::Tiny(owners) => owners.len(),
            Owners::Narrow(owners) => owners.len() * 2,
            Owners::Wide(owners) => owners.len() * 4,
        }
    }
}

/// A tier's table with what it was built from, so that a rebuild of the same tier can reuse it.
#[derive(Debug)]
pub struct HashTable {
    /// (identity, weight) of each tier member, in tier order: equal inputs give an equal table.
    inputs: Box<[(u64, u32)]>,
    /// Tier indices by (identity, weight): the order of the last-resort scan, the same on
    /// every gateway whatever order the tier lists its members in.
    by_identity: Box<[u32]>,
    kind: TableKind,
}

#[derive(Debug)]
enum TableKind {
    Ring(Ring),
    Maglev(Maglev),
}

impl HashTable {
    /// `inputs[i]` is the (identity hash, weight > 0) of tier member i.
    pub(super) fn build(kind: HashKind, inputs: Box<[(u64, u32)]>) -> HashTable {
        let kind = match kind {
            HashKind::Ring => TableKind::Ring(Ring::new(&inputs)),
            HashKind::Maglev => TableKind::Maglev(Maglev::new(&inputs)),
        };
        HashTable {
            by_identity: by_identity(&inputs),
            inputs,
            kind,
        }
    }

    /// The previous table when it was built from exactly these inputs, else a new one: a table
    /// depends on its inputs alone, so reusing it only saves the build.
    pub(super) fn reuse_or_build(
        kind: HashKind,
        inputs: Box<[(u64, u32)]>,
        previous: Option<&Arc<HashTable>>,
    ) -> Arc<HashTable> {
        match previous {
            Some(table) if table.kind() == kind && table.inputs == inputs => table.clone(),
            _ => Arc::new(HashTable::build(kind, inputs)),
        }
    }

    pub fn kind(&self) -> HashKind {
        match self.kind {
            TableKind::Ring(_) => HashKind::Ring,
            TableKind::Maglev(_) => HashKind::Maglev,
        }
    }

    /// Ring points or Maglev entries.
    pub fn slots(&self) -> usize {
        match &self.kind {
            TableKind::Ring(ring) => ring.len(),
            TableKind::Maglev(maglev) => maglev.len(),
        }
    }

    /// Heap bytes held by the table (for the memory figures in benches/README.md).
    pub fn heap_bytes(&self) -> usize {
        let inputs = self.inputs.len() * std::mem::size_of::<(u64, u32)>();
        inputs
            + self.by_identity.len() * 4
            + match &self.kind {
                TableKind::Ring(ring) => ring.heap_bytes(),
                TableKind::Maglev(maglev) => maglev.heap_bytes(),
            }
    }

    /// Slots owned by each tier member (its share of the keys is slots / `slots()`).
    pub fn slots_per_member(&self) -> Vec<usize> {
        let mut counts = vec![0; self.inputs.len()];
        for slot in 0..self.slots() {
            counts[self.owner(slot)] += 1;
        }
        counts
    }

    /// The tier member owning `slot`.
    fn owner(&self, slot: usize) -> usize {
        match &self.kind {
            TableKind::Ring(ring) => ring.owner(slot),
            TableKind::Maglev(maglev) => maglev.owners().get(slot),
        }
    }

    /// The slot a key hash lands on.
    fn slot_of(&self, hash: u64) -> usize {
        match &self.kind {
            TableKind::Ring(ring) => ring.slot_of(hash),
            TableKind::Maglev(maglev) => maglev.slot_of(hash),
        }
    }

    /// The tier member (index into the tier) for `hash`: the owner of its slot, else of the next
    /// slots in order, passing over members for which `skip` is true and, while one can be
    /// found, members for which `fits` is false (bounded load). Past [`WALK_LIMIT`] slots,
    /// members are scanned from a start the hash decides, in identity order. Every choice depends
    /// only on the table, the hash and the two predicates, so gateways with the same view
    /// decide alike.
    pub(super) fn choose(
        &self,
        hash: u64,
        skip: impl Fn(usize) -> bool,
        fits: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let len = self.slots();
        let start = self.slot_of(hash);
        let mut first_unskipped = None;
        for step in 0..len.min(WALK_LIMIT) {
            let member = self.owner((start + step) % len);
            if skip(member) {
                continue;
            }
            if fits(member) {
                return Some(member);
            }
            first_unskipped.get_or_insert(member);
        }
        // Rare: a long run of unavailable or loaded members. Members in identity order from a
        // start the hash decides: while some member was met unskipped, only another
        // WALK_LIMIT of them (the bound may be out of reach when many are unavailable, and a
        // pick stays bounded); else every member, to find one that is not skipped at all.
        let members = self.by_identity.len();
        // The high bits: the low ones already chose the slot in a small Maglev table.
        let from = ((hash >> 32) % members as u64) as usize;
        let budget = if first_unskipped.is_some() {
            members.min(WALK_LIMIT)
        } else {
            members
        };
        let scan = (0..budget)
            .map(|step| self.by_identity[(from + step) % members] as usize)
            .filter(|&member| !skip(member));
        let mut scanned_unskipped = None;
        for member in scan {
            if fits(member) {
                return Some(member);
            }
            scanned_unskipped.get_or_insert(member);
        }
        first_unskipped.or(scanned_unskipped)
    }
}

/// Tier indices sorted by (identity, weight); equal pairs keep tier order (the same target
/// twice: either is as good).
pub(super) fn by_identity(inputs: &[(u64, u32)]) -> Box<[u32]> {
    let mut order: Vec<u32> = (0..inputs.len() as u32).collect();
    order.sort_by_key(|&i| inputs[i as usize]);
    order.into_boxed_slice()
}

/// The hash of a client address, the key of `hash_on: "client_ip"` (HTTP and L4 alike). An
/// IPv4-mapped IPv6 address hashes as its IPv4 form, as the client is the same.
pub fn ip_hash(ip: std::net::IpAddr) -> u64 {
    match ip.to_canonical() {
        std::net::IpAddr::V4(v4) => key_hash(&v4.octets()),
        std::net::IpAddr::V6(v6) => key_hash(&v6.octets()),
    }
}
