//! Maglev hashing (Eisenbud et al., NSDI 2016, with Envoy's weighting): a lookup table of a prime
//! size filled from each member's own permutation of the slots, so that a key is one multiply
//! away from its member and a member joining or leaving moves few keys.

use super::hash_table::{by_identity, mix, Owners};

/// Table sizes (primes): the first with at least 100 entries per member. The size is a function
/// of the member count alone, so every gateway on a store computes the same table whatever it
/// built before (a size kept from a gateway's own history would not be); and as a new size
/// reshuffles every key, the rungs are far apart: that happens only at 21 and 164 members.
const LADDER: [usize; 3] = [2039, 16381, 65537];
const OFFSET_SEED: u64 = 0x6f66_6673_6574; // "offset"
const SKIP_SEED: u64 = 0x736b_6970; // "skip"
const EMPTY: u32 = u32::MAX;

#[derive(Debug)]
pub(super) struct Maglev {
    owners: Owners,
}

/// The table size for `members` members.
pub(super) fn table_size(members: usize) -> usize {
    LADDER
        .iter()
        .copied()
        .find(|&size| size >= members.saturating_mul(100))
        .unwrap_or(LADDER[LADDER.len() - 1])
}

struct Filler {
    member: u32,
    offset: u64,
    skip: u64,
    weight: u64,
    /// Position in this member's permutation.
    next: u64,
    /// Envoy's weighting: the member fills a slot in round r only once r · weight reaches this,
    /// which grows by the largest weight per slot taken.
    due: u64,
}

impl Maglev {
    /// `inputs[i]` is the (identity hash, weight > 0) of tier member i.
    pub(super) fn new(inputs: &[(u64, u32)]) -> Maglev {
        let size = table_size(inputs.len());
        let modulus = size as u64;
        // Members fill in identity order, so the table does not depend on the tier's order.
        let mut fillers: Vec<Filler> = by_identity(inputs)
            .iter()
            .map(|&member| {
                let (identity, weight) = inputs[member as usize];
                Filler {
                    member,
                    offset: mix(identity ^ OFFSET_SEED) % modulus,
                    skip: mix(identity ^ SKIP_SEED) % (modulus - 1) + 1,
                    weight: u64::from(weight),
                    next: 0,
                    due: 0,
                }
            })
            .collect();
        let heaviest = fillers.iter().map(|f| f.weight).max().unwrap_or(1);
        let mut table = vec![EMPTY; size];
        let mut filled = 0;
        let mut round = 0u64;
        while filled < size && !fillers.is_empty() {
            for filler in fillers.iter_mut() {
                if filled == size {
                    break;
                }
                if round * filler.weight < filler.due {
                    continue;
                }
                filler.due += heaviest;
                // A prime size makes every permutation visit every slot: this ends.
                loop {
                    let slot = ((filler.offset + filler.skip * filler.next) % modulus) as usize;
                    filler.next += 1;
                    if table[slot] == EMPTY {
                        table[slot] = filler.member;
                        filled += 1;
                        break;
                    }
                }
            }
            round += 1;
        }
        Maglev {
            owners: Owners::new(table.into_iter().map(|m| m as usize), inputs.len()),
        }
    }

    pub(super) fn len(&self) -> usize {
        self.owners.len()
    }

    pub(super) fn owners(&self) -> &Owners {
        &self.owners
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.owners.bytes()
    }

    /// Lemire's multiply-shift range reduction: uniform like `hash % len`, without a division.
    pub(super) fn slot_of(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.owners.len() as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_is_the_first_rung_at_100_per_member_whatever_came_before() {
        assert_eq!(table_size(1), 2039);
        assert_eq!(table_size(20), 2039);
        assert_eq!(table_size(21), 16381);
        assert_eq!(table_size(163), 16381);
        assert_eq!(table_size(164), 65537);
        assert_eq!(table_size(10_000), 65537);
    }

    #[test]
    fn entries_follow_weight() {
        let table = Maglev::new(&[(mix(1), 100), (mix(2), 300)]);
        let mut counts = [0usize; 2];
        for slot in 0..table.len() {
            counts[table.owners.get(slot)] += 1;
        }
        assert_eq!(table.len(), 2039);
        let share = counts[1] as f64 / 2039.0;
        assert!((share - 0.75).abs() < 0.01, "{counts:?}");
    }

    #[test]
    fn every_slot_is_filled_and_every_member_has_slots() {
        let inputs: Vec<(u64, u32)> = (0..37).map(|i| (mix(i), 1 + (i % 5) as u32 * 20)).collect();
        let table = Maglev::new(&inputs);
        let mut counts = vec![0usize; inputs.len()];
        for slot in 0..table.len() {
            counts[table.owners.get(slot)] += 1;
        }
        assert!(counts.iter().all(|&c| c > 0), "{counts:?}");
        assert_eq!(counts.iter().sum::<usize>(), table.len());
    }
}
