//! Ring hash (Karger et al., as in Envoy's `RING_HASH`): each member owns points on a 32-bit
//! circle in proportion to its weight, and a key belongs to the first point at or after its hash.
//! A new member takes keys only from the arcs its own points cut, about 1/N of them.

use super::hash_table::{by_identity, mix, Owners};

/// Points per unit of weight: 100 points at the default weight of 100.
const POINTS_PER_WEIGHT: u64 = 1;
/// Most points in one ring (about 10,000 members at weight 100); past it every member's count is
/// scaled down in proportion, keeping at least one each.
const MAX_POINTS: u64 = 1 << 20;
/// Points per bucket of the lookup index, on average: the scan after the index stays within a
/// cache line or two.
const POINTS_PER_BUCKET: usize = 4;
/// Steps between the points of one member, fed to `mix` (the 64-bit golden ratio).
const REPLICA_STEP: u64 = 0x9e37_79b9_7f4a_7c15;

#[derive(Debug)]
pub(super) struct Ring {
    /// Point positions, ascending.
    points: Box<[u32]>,
    /// The tier member owning each point.
    owners: Owners,
    /// `index[b]`: the first point whose position's top `bits` are ≥ b.
    index: Box<[u32]>,
    /// 32 − bits: a position shifted right by it is its bucket.
    shift: u32,
}

impl Ring {
    /// `inputs[i]` is the (identity hash, weight > 0) of tier member i.
    pub(super) fn new(inputs: &[(u64, u32)]) -> Ring {
        let total: u64 = inputs.iter().map(|&(_, w)| u64::from(w)).sum::<u64>() * POINTS_PER_WEIGHT;
        let points_of = |weight: u32| -> u64 {
            let wanted = u64::from(weight) * POINTS_PER_WEIGHT;
            if total <= MAX_POINTS {
                wanted
            } else {
                (wanted * MAX_POINTS / total).max(1)
            }
        };
        // Members ranked by identity: the rank breaks ties between equal positions, so the ring
        // does not depend on the order the tier lists its members in.
        let ranked = by_identity(inputs);
        let mut packed: Vec<u64> = Vec::new();
        for (rank, &member) in ranked.iter().enumerate() {
            let (identity, weight) = inputs[member as usize];
            for replica in 0..points_of(weight) {
                let position = mix(identity.wrapping_add(replica.wrapping_mul(REPLICA_STEP))) >> 32;
                packed.push(position << 32 | rank as u64);
            }
        }
        packed.sort_unstable();
        let points: Box<[u32]> = packed.iter().map(|&p| (p >> 32) as u32).collect();
        let owners = Owners::new(
            packed
                .iter()
                .map(|&p| ranked[(p & 0xffff_ffff) as usize] as usize),
            inputs.len(),
        );
        let bits = (points.len() / POINTS_PER_BUCKET).max(1).ilog2().min(24);
        let shift = 32 - bits;
        let buckets = 1usize << bits;
        let mut index = Vec::with_capacity(buckets);
        let mut next = 0usize;
        for bucket in 0..buckets {
            while next < points.len() && ((points[next] as u64) >> shift) < bucket as u64 {
                next += 1;
            }
            index.push(next as u32);
        }
        Ring {
            points,
            owners,
            index: index.into_boxed_slice(),
            shift,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.points.len()
    }

    pub(super) fn owners(&self) -> &Owners {
        &self.owners
    }

    pub(super) fn heap_bytes(&self) -> usize {
        self.points.len() * 4 + self.owners.bytes() + self.index.len() * 4
    }

    /// The first point at or after the key's position, wrapping past the last.
    pub(super) fn slot_of(&self, hash: u64) -> usize {
        let position = (hash >> 32) as u32;
        let mut slot = self.index[(u64::from(position) >> self.shift) as usize] as usize;
        while slot < self.points.len() && self.points[slot] < position {
            slot += 1;
        }
        if slot == self.points.len() {
            0
        } else {
            slot
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(n: u64) -> Vec<(u64, u32)> {
        (0..n).map(|i| (mix(i + 1), 100)).collect()
    }

    /// The owner by a plain binary search, against which the indexed lookup is checked.
    fn owner_by_search(ring: &Ring, hash: u64) -> usize {
        let position = (hash >> 32) as u32;
        let slot = ring.points.partition_point(|&p| p < position) % ring.points.len();
        ring.owners.get(slot)
    }

    #[test]
    fn indexed_lookup_matches_a_binary_search() {
        for n in [1, 2, 3, 10, 100] {
            let ring = Ring::new(&inputs(n));
            for k in 0..20_000u64 {
                let hash = mix(k);
                assert_eq!(
                    ring.owners.get(ring.slot_of(hash)),
                    owner_by_search(&ring, hash)
                );
            }
            // Positions past the last point wrap to the first.
            assert_eq!(
                ring.slot_of(u64::MAX),
                if ring.points[ring.len() - 1] == u32::MAX {
                    ring.len() - 1
                } else {
                    0
                }
            );
        }
    }

    #[test]
    fn points_follow_weight() {
        let ring = Ring::new(&[(mix(1), 100), (mix(2), 300), (mix(3), 1)]);
        assert_eq!(ring.len(), 401);
        let mut counts = [0; 3];
        for slot in 0..ring.len() {
            counts[ring.owners.get(slot)] += 1;
        }
        assert_eq!(counts, [100, 300, 1]);
    }

    #[test]
    fn huge_weights_are_scaled_to_the_cap_keeping_one_point_each() {
        let mut members: Vec<(u64, u32)> = (0..20).map(|i| (mix(i), 65_535)).collect();
        members.push((mix(99), 1));
        let ring = Ring::new(&members);
        assert!(ring.len() as u64 <= MAX_POINTS + 21, "{}", ring.len());
        assert!(
            (0..ring.len()).any(|slot| ring.owners.get(slot) == 20),
            "the light member keeps a point"
        );
    }
}
