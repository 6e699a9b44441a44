//! Round-robin schedule: one cycle of nginx's smooth weighted round-robin, built once per snapshot
//! and walked by an atomic cursor, so a pick is one `fetch_add` instead of nginx's loop over every
//! peer under a lock.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Longest schedule built for a tier of `members` members: long enough that every member of a big
/// tier still gets its share, short enough that building and holding it stays cheap per snapshot.
/// A tier of more than 2^20 members cannot list every member within 2^20 entries; it then gets one
/// entry per member (equal weights), the only schedule that still reaches every member.
pub(super) fn cap(members: usize) -> usize {
    members.saturating_mul(64).clamp(4096, 1 << 20)
}

/// The cursor is written by every request on every core; boxed and aligned, it sits alone on its
/// cache line, so those writes do not keep evicting the read-only tier data next to it.
#[repr(align(128))]
#[derive(Debug)]
struct Cursor(AtomicUsize);

#[derive(Debug)]
pub(super) struct Schedule {
    /// Member ids in smooth-WRR order; one full cycle.
    entries: Box<[u32]>,
    cursor: Box<Cursor>,
}

impl Schedule {
    /// `ids[k]` is the member id of weight `weights[k]`; every weight is positive.
    pub(super) fn new(ids: &[u32], weights: &[u32]) -> Schedule {
        let cycle = cycle_weights(weights, cap(weights.len()));
        let entries: Box<[u32]> = smooth_order(&cycle)
            .into_iter()
            .map(|k| ids[k as usize])
            .collect();
        // Snapshots are rebuilt often; starting every new one at entry 0 would hand the first
        // requests after each rebuild to the same member on every gateway.
        let start = fastrand::usize(..entries.len());
        Schedule {
            entries,
            cursor: Box::new(Cursor(AtomicUsize::new(start))),
        }
    }

    /// The member at the cursor, advancing it for the next request.
    #[inline]
    pub(super) fn next(&self) -> usize {
        let step = self.cursor.0.fetch_add(1, Ordering::Relaxed);
        self.entries[step % self.entries.len()] as usize
    }

    /// A member drawn in proportion to its weight, without touching the cursor: a uniform draw
    /// over the cycle. Used to replace a skipped entry so that its share goes to the others in
    /// proportion to their weights, rather than all to whichever member follows it in the cycle.
    #[inline]
    pub(super) fn sample(&self) -> usize {
        self.entries[fastrand::usize(..self.entries.len())] as usize
    }

    #[cfg(test)]
    pub(super) fn entries(&self) -> &[u32] {
        &self.entries
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Weights of one cycle: divided by their gcd (weights 2,6 cycle like 1,3) and, when the cycle
/// would still be longer than `cap`, scaled down in proportion with every weight kept ≥ 1.
fn cycle_weights(weights: &[u32], cap: usize) -> Vec<u64> {
    let reduce = |w: Vec<u64>| {
        let g = w.iter().copied().fold(0, gcd).max(1);
        w.into_iter().map(|x| x / g).collect::<Vec<u64>>()
    };
    let reduced = reduce(weights.iter().map(|&w| u64::from(w)).collect());
    // n < 2^32 weights below 2^32 each: the sum fits in u64.
    let total: u64 = reduced.iter().sum();
    let cap = cap as u64;
    if total <= cap {
        return reduced;
    }
    // Rounding adds at most +1/2 per member and the ≥ 1 floor at most +1, so a budget of
    // `cap - n` keeps the scaled cycle within `cap`.
    let budget = cap.saturating_sub(reduced.len() as u64);
    let scaled = reduced
        .iter()
        .map(|&w| {
            let share =
                (u128::from(w) * u128::from(budget) + u128::from(total / 2)) / u128::from(total);
            // share <= budget < 2^64.
            (share as u64).max(1)
        })
        .collect();
    reduce(scaled)
}

const NONE: u32 = u32::MAX;
const NEVER: i64 = i64::MAX;

/// One cycle of nginx's smooth weighted round-robin over `weights` (all positive, summing to
/// at most 2^20), as indices into `weights`.
///
/// nginx, each step: every peer's `current += weight`; the largest `current` wins (first peer on
/// ties) and pays `current -= total`. After step t that is `t·w_i − total·c_i` (c_i = wins so
/// far): lines in t that drop by `total` when they win. Scanning all of them each step, as nginx
/// does, costs O(n) per entry, far too slow for 10,000 members and a 640,000-entry cycle. A
/// kinetic tournament keeps the argmax of those lines with amortised O(log² n) work per step and
/// yields exactly nginx's sequence.
fn smooth_order(weights: &[u64]) -> Vec<u32> {
    let total: u64 = weights.iter().sum();
    let mut race = Race::new(weights);
    let total = total as i64;
    (1..=total)
        .map(|t| {
            race.refresh(1, t);
            let winner = race.winner[1];
            race.charge(winner, total, t);
            winner
        })
        .collect()
}

/// Kinetic tournament tree over the lines `slope_i·t − debt_i`. Each inner node keeps the winner
/// of its subtree as of the last time it was computed, and `expires`: the first time at which
/// that winner may change (a child's winner changes, or its loser overtakes it).
struct Race {
    slope: Vec<i64>,
    debt: Vec<i64>,
    leaves: usize,
    winner: Vec<u32>,
    expires: Vec<i64>,
}

impl Race {
    fn new(weights: &[u64]) -> Race {
        let leaves = weights.len().next_power_of_two().max(2);
        let mut winner = vec![NONE; 2 * leaves];
        for (k, slot) in winner[leaves..leaves + weights.len()]
            .iter_mut()
            .enumerate()
        {
            *slot = k as u32;
        }
        let mut race = Race {
            // Each weight is at most the total, at most 2^20.
            slope: weights.iter().map(|&w| w as i64).collect(),
            debt: vec![0; weights.len()],
            leaves,
            winner,
            expires: vec![NEVER; 2 * leaves],
        };
        for node in (1..leaves).rev() {
            race.combine(node, 1);
        }
        race
    }

    fn value(&self, k: u32, t: i64) -> i64 {
        self.slope[k as usize] * t - self.debt[k as usize]
    }

    /// Whether `a` is ahead of `b` at time t: higher value, or equal value and earlier peer.
    fn ahead(&self, a: u32, b: u32, t: i64) -> bool {
        if a == NONE || b == NONE {
            return b == NONE && a != NONE;
        }
        let (va, vb) = (self.value(a, t), self.value(b, t));
        va > vb || (va == vb && a < b)
    }

    /// First time after t at which `loser` gets ahead of `leader`, if their debts stay put.
    fn overtaken_at(&self, leader: u32, loser: u32, t: i64) -> i64 {
        if leader == NONE || loser == NONE {
            return NEVER;
        }
        let gain = self.slope[loser as usize] - self.slope[leader as usize];
        if gain <= 0 {
            return NEVER;
        }
        let lead = self.value(leader, t) - self.value(loser, t);
        if loser < leader {
            // A tie is enough for the earlier peer, and lead > 0 here (it lost at t).
            t + (lead + gain - 1) / gain
        } else {
            t + lead / gain + 1
        }
    }

    fn combine(&mut self, node: usize, t: i64) {
        let (left, right) = (2 * node, 2 * node + 1);
        let (a, b) = (self.winner[left], self.winner[right]);
        let (leader, loser) = if self.ahead(a, b, t) { (a, b) } else { (b, a) };
        self.winner[node] = leader;
        self.expires[node] = self.expires[left]
            .min(self.expires[right])
            .min(self.overtaken_at(leader, loser, t));
    }

    /// Brings `node`'s subtree up to time t. A node's expiry is the minimum of its subtree's, so
    /// a node still valid at t has only valid nodes below it. Leaves never expire.
    fn refresh(&mut self, node: usize, t: i64) {
        if self.expires[node] > t {
            return;
        }
        self.refresh(2 * node, t);
        self.refresh(2 * node + 1, t);
        self.combine(node, t);
    }

    /// `k` won step t: it pays the total, and every node above it is recomputed.
    fn charge(&mut self, k: u32, total: i64, t: i64) {
        self.debt[k as usize] += total;
        let mut node = (self.leaves + k as usize) / 2;
        while node >= 1 {
            self.combine(node, t);
            node /= 2;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nginx's loop, literally (ngx_http_upstream_get_peer), as the reference.
    fn nginx_order(weights: &[u64]) -> Vec<u32> {
        let total: i64 = weights.iter().map(|&w| w as i64).sum();
        let mut current = vec![0i64; weights.len()];
        (0..total)
            .map(|_| {
                let mut best = 0;
                for (k, &w) in weights.iter().enumerate() {
                    current[k] += w as i64;
                    if current[k] > current[best] {
                        best = k;
                    }
                }
                current[best] -= total;
                best as u32
            })
            .collect()
    }

    #[test]
    fn five_one_one_is_nginx_sequence() {
        assert_eq!(smooth_order(&[5, 1, 1]), vec![0, 0, 1, 0, 2, 0, 0]);
    }

    #[test]
    fn matches_nginx_on_random_weights() {
        fastrand::seed(11);
        for _ in 0..2_000 {
            let n = fastrand::usize(1..=12);
            let weights: Vec<u64> = (0..n).map(|_| fastrand::u64(1..=30)).collect();
            assert_eq!(smooth_order(&weights), nginx_order(&weights), "{weights:?}");
        }
    }

    #[test]
    fn matches_nginx_on_many_members() {
        fastrand::seed(12);
        let weights: Vec<u64> = (0..300).map(|_| fastrand::u64(1..=50)).collect();
        assert_eq!(smooth_order(&weights), nginx_order(&weights));
    }

    #[test]
    fn cycle_is_divided_by_gcd() {
        assert_eq!(cycle_weights(&[2, 6], 4096), vec![1, 3]);
        assert_eq!(cycle_weights(&[7], 4096), vec![1]);
    }

    #[test]
    fn long_cycle_is_scaled_into_cap() {
        let cycle = cycle_weights(&[1, 1_000_000, 3_000_000], 4096);
        assert!(cycle.iter().sum::<u64>() <= 4096);
        assert_eq!(cycle[0], 1, "a tiny weight is kept at 1, not dropped");
        let ratio = cycle[2] as f64 / cycle[1] as f64;
        assert!((ratio - 3.0).abs() < 0.01, "{cycle:?}");
    }

    #[test]
    fn cap_bounds() {
        assert_eq!(cap(1), 4096);
        assert_eq!(cap(10_000), 640_000);
        assert_eq!(cap(100_000), 1 << 20);
    }
}
