//! Weighted draws in O(1): Vose's alias method, built once per snapshot.
//!
//! Built with exact integer arithmetic, so no floating-point drift leaves a slot short of mass and
//! the only error is the 2^-32 resolution of each slot's coin.

/// A coin below `keep_below` (out of 2^32) keeps the slot's own member, otherwise its alias.
#[derive(Debug, Clone, Copy)]
struct Slot {
    keep_below: u64,
    keep: u32,
    alias: u32,
}

const FULL: u64 = 1 << 32;

#[derive(Debug)]
pub(super) struct AliasTable {
    slots: Box<[Slot]>,
}

impl AliasTable {
    /// `ids[k]` is the member id of weight `weights[k]`; every weight is positive and there are
    /// fewer than 2^32 of them.
    pub(super) fn new(ids: &[u32], weights: &[u32]) -> AliasTable {
        let n = weights.len() as u128;
        // Every slot holds `total` units of mass: member k brings `weight·n` of them.
        let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
        let mut mass: Vec<u128> = weights.iter().map(|&w| u128::from(w) * n).collect();
        let mut slots: Vec<Slot> = ids
            .iter()
            .map(|&id| Slot {
                keep_below: FULL,
                keep: id,
                alias: id,
            })
            .collect();
        let (mut small, mut large): (Vec<usize>, Vec<usize>) =
            (0..weights.len()).partition(|&k| mass[k] < total);
        while let (Some(&s), Some(&l)) = (small.last(), large.last()) {
            small.pop();
            // mass[s] < total, so the quotient is below 2^32.
            slots[s].keep_below = ((mass[s] << 32) / total) as u64;
            slots[s].alias = ids[l];
            mass[l] -= total - mass[s];
            if mass[l] < total {
                large.pop();
                small.push(l);
            }
        }
        // Exact arithmetic: whatever is left holds exactly `total` and keeps its FULL slot.
        AliasTable {
            slots: slots.into_boxed_slice(),
        }
    }

    /// A member id, drawn in proportion to its weight. One random u64: its high half picks the
    /// slot (multiply-shift; bias below n/2^32), its low half is the slot's coin.
    #[inline]
    pub(super) fn draw(&self) -> usize {
        let r = fastrand::u64(..);
        let slot = ((r >> 32) * self.slots.len() as u64) >> 32;
        let slot = &self.slots[slot as usize];
        let chosen = if (r & (FULL - 1)) < slot.keep_below {
            slot.keep
        } else {
            slot.alias
        };
        chosen as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probability of each id the table implies, summed over slots, scaled by n·2^32.
    fn implied(table: &AliasTable, ids: usize) -> Vec<u128> {
        let mut p = vec![0u128; ids];
        for slot in table.slots.iter() {
            p[slot.keep as usize] += u128::from(slot.keep_below);
            p[slot.alias as usize] += u128::from(FULL - slot.keep_below);
        }
        p
    }

    #[test]
    fn table_implies_the_weights() {
        let weights = [1u32, 3, 5, 7, 0x7fff_ffff];
        let ids: Vec<u32> = (0..weights.len() as u32).collect();
        let table = AliasTable::new(&ids, &weights);
        let p = implied(&table, weights.len());
        let total: u128 = weights.iter().map(|&w| u128::from(w)).sum();
        let scale = weights.len() as u128 * u128::from(FULL);
        for (k, &w) in weights.iter().enumerate() {
            let expected = u128::from(w) * scale / total;
            // Each slot's coin is truncated to 1/2^32: at most one unit off per slot.
            assert!(
                p[k].abs_diff(expected) <= weights.len() as u128,
                "member {k}"
            );
        }
    }

    #[test]
    fn draws_follow_weights_and_map_ids() {
        fastrand::seed(3);
        let table = AliasTable::new(&[40, 41], &[1, 3]);
        let draws = 40_000;
        let forty_one = (0..draws).filter(|_| table.draw() == 41).count();
        let share = forty_one as f64 / draws as f64;
        assert!((share - 0.75).abs() < 0.02, "{share}");
    }

    #[test]
    fn single_member_always_drawn() {
        let table = AliasTable::new(&[9], &[5]);
        assert!((0..100).all(|_| table.draw() == 9));
    }
}
