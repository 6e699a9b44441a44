//! Ring hash (Karger et al., as in Envoy's `RING_HASH`): each member owns points on a 32-bit
//! circle in proportion to its weight, and a key belongs to the first point at or after its hash.
//! A new member takes keys only from the arcs its own points cut, about 1/N of them.

use super::hash_table::{by_identity, mix};

/// Points per unit of weight: 100 points at the default weight of 100.
const POINTS_PER_WEIGHT: u64 = 1;
/// Most points in one ring (about 10,000 members at weight 100); past it every member's count is
/// scaled down in proportion, keeping at least one each.
const MAX_POINTS: u64 = 1 << 20;
/// Points per bucket of the lookup index, on average: the scan after the index stays within a
/// cache line or two.
const POINTS_PER_BUCKET: usize = 4;
/// At most 2^15 buckets (128 KiB): a larger index misses the cache more than the longer scan
/// it saves costs (a 10,000-target ring: 30 points a bucket, 56 ns a pick against 64 with 4).
const MAX_BUCKET_BITS: u32 = 15;
/// Steps between the points of one member, fed to `mix` (the 64-bit golden ratio).
const REPLICA_STEP: u64 = 0x9e37_79b9_7f4a_7c15;

/// A point and the tier member owning it, side by side: a lookup reads one cache line for
/// both. Five bytes while the tier has at most 256 members (5,000 services of 20 targets hold
/// 52 MiB of rings), six up to 2^16.
trait Point: Copy {
    fn new(position: u32, owner: usize) -> Self;
    fn position(self) -> u32;
    fn owner(self) -> usize;
}

#[derive(Debug, Clone, Copy)]
#[repr(C, packed)]
struct TinyPoint {
    position: u32,
    owner: u8,
}

#[derive(Debug, Clone, Copy)]
#[repr(C, packed(2))]
struct NarrowPoint {
    position: u32,
    owner: u16,
}

#[derive(Debug, Clone, Copy)]
struct WidePoint {
    position: u32,
    owner: u32,
}

impl Point for TinyPoint {
    fn new(position: u32, owner: usize) -> Self {
        // Only built for tiers of at most 256 members.
        TinyPoint {
            position,
            owner: owner as u8,
        }
    }
    fn position(self) -> u32 {
        self.position
    }
    fn owner(self) -> usize {
        usize::from(self.owner)
    }
}

impl Point for NarrowPoint {
    fn new(position: u32, owner: usize) -> Self {
        // Only built for tiers of at most 2^16 members.
        NarrowPoint {
            position,
            owner: owner as u16,
        }
    }
    fn position(self) -> u32 {
        self.position
    }
    fn owner(self) -> usize {
        usize::from(self.owner)
    }
}

impl Point for WidePoint {
    fn new(position: u32, owner: usize) -> Self {
        WidePoint {
            position,
            owner: owner as u32,
        }
    }
    fn position(self) -> u32 {
        self.position
    }
    fn owner(self) -> usize {
        self.owner as usize
    }
}

#[derive(Debug)]
enum Points {
    Tiny(Box<[TinyPoint]>),
    Narrow(Box<[NarrowPoint]>),
    Wide(Box<[WidePoint]>),
}

#[derive(Debug)]
pub(super) struct Ring {
    /// Ascending by position.
    points: Points,
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
        let owner_of = |p: u64| ranked[(p & 0xffff_ffff) as usize] as usize;
        let positions = packed.iter().map(|&p| (p >> 32) as u32);
        let bits = (packed.len() / POINTS_PER_BUCKET)
            .max(1)
            .ilog2()
            .min(MAX_BUCKET_BITS);
        let shift = 32 - bits;
        let index = bucket_index(positions, 1usize << bits, shift);
        let points = if inputs.len() <= usize::from(u8::MAX) + 1 {
            Points::Tiny(
                packed
                    .iter()
                    .map(|&p| Point::new((p >> 32) as u32, owner_of(p)))
                    .collect(),
            )
        } else if inputs.len() <= usize::from(u16::MAX) + 1 {
            Points::Narrow(
                packed
                    .iter()
                    .map(|&p| Point::new((p >> 32) as u32, owner_of(p)))
                    .collect(),
            )
        } else {
            Points::Wide(
                packed
                    .iter()
                    .map(|&p| Point::new((p >> 32) as u32, owner_of(p)))
                    .collect(),
            )
        };
        Ring {
            points,
            index,
            shift,
        }
    }

    pub(super) fn len(&self) -> usize {
        match &self.points {
            Points::Tiny(points) => points.len(),
            Points::Narrow(points) => points.len(),
            Points::Wide(points) => points.len(),
        }
    }

    pub(super) fn owner(&self, slot: usize) -> usize {
        match &self.points {
            Points::Tiny(points) => points[slot].owner(),
            Points::Narrow(points) => points[slot].owner(),
            Points::Wide(points) => points[slot].owner(),
        }
    }

    pub(super) fn heap_bytes(&self) -> usize {
        let points = match &self.points {
            Points::Tiny(points) => std::mem::size_of_val(&**points),
            Points::Narrow(points) => std::mem::size_of_val(&**points),
            Points::Wide(points) => std::mem::size_of_val(&**points),
        };
        points + self.index.len() * 4
    }

    /// The first point at or after the key's position, wrapping past the last.
    pub(super) fn slot_of(&self, hash: u64) -> usize {
        let position = (hash >> 32) as u32;
        let start = self.index[(u64::from(position) >> self.shift) as usize] as usize;
        match &self.points {
            Points::Tiny(points) => first_at_or_after(points, start, position),
            Points::Narrow(points) => first_at_or_after(points, start, position),
            Points::Wide(points) => first_at_or_after(points, start, position),
        }
    }

    #[cfg(test)]
    fn position(&self, slot: usize) -> u32 {
        match &self.points {
            Points::Tiny(points) => points[slot].position(),
            Points::Narrow(points) => points[slot].position(),
            Points::Wide(points) => points[slot].position(),
        }
    }
}

/// `index[b]` for each of `buckets` buckets: the first of the (ascending) positions whose
/// bucket is ≥ b.
fn bucket_index(
    positions: impl ExactSizeIterator<Item = u32>,
    buckets: usize,
    shift: u32,
) -> Box<[u32]> {
    let len = positions.len() as u32;
    let mut index = Vec::with_capacity(buckets);
    for (slot, position) in positions.enumerate() {
        let bucket = (u64::from(position) >> shift) as usize;
        while index.len() <= bucket {
            index.push(slot as u32);
        }
    }
    index.resize(buckets, len);
    index.into_boxed_slice()
}

/// The first slot from `start` whose position is ≥ `position`, wrapping to 0 past the end.
fn first_at_or_after<P: Point>(points: &[P], start: usize, position: u32) -> usize {
    let mut slot = start;
    while slot < points.len() && points[slot].position() < position {
        slot += 1;
    }
    if slot == points.len() {
        0
    } else {
        slot
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
        let positions: Vec<u32> = (0..ring.len()).map(|slot| ring.position(slot)).collect();
        let slot = positions.partition_point(|&p| p < position) % ring.len();
        ring.owner(slot)
    }

    #[test]
    fn indexed_lookup_matches_a_binary_search() {
        for n in [1, 2, 3, 10, 100] {
            let ring = Ring::new(&inputs(n));
            for k in 0..20_000u64 {
                let hash = mix(k);
                assert_eq!(ring.owner(ring.slot_of(hash)), owner_by_search(&ring, hash));
            }
            // Positions past the last point wrap to the first.
            assert_eq!(
                ring.slot_of(u64::MAX),
                if ring.position(ring.len() - 1) == u32::MAX {
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
            counts[ring.owner(slot)] += 1;
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
            (0..ring.len()).any(|slot| ring.owner(slot) == 20),
            "the light member keeps a point"
        );
    }
}
