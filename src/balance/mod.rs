//! Choosing one member of a service: priority tiers, weights within a tier, and a policy
//! (DESIGN.md §5).
//!
//! Everything costly (round-robin schedules, alias tables) is built once in [`Balancer::new`],
//! i.e. once per routing snapshot. [`Balancer::pick`] is then O(1) in the number of members while
//! the preferred tier has an available member, allocates nothing and takes no lock: the only
//! shared write is round-robin's cursor step.

mod alias;
mod hash_table;
mod health;
mod maglev;
mod marks;
mod ring;
mod schedule;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::model::LbPolicy;

use alias::AliasTable;
pub use hash_table::{identity_hash, ip_hash, key_hash, HashKind, HashTable};
pub use health::{Admission, EjectionCause, FailureCause, TargetHealth, Trial};
pub use marks::{ChangeMarks, Mark, Moved, Slots};
use schedule::Schedule;

/// Random schedule entries tried after the cursor's entry is skipped, before scanning the tier.
const PROBES: usize = 16;
/// Weighted draws tried for a non-skipped member (Random, LeastRequest's first choice).
const DRAWS: usize = 8;
/// Draws tried for LeastRequest's second choice, which must be another, non-skipped member.
const SECOND_DRAWS: usize = 4;

/// Per-target load counters shared across routing snapshots (the caller keeps one Arc per target
/// id and passes the same Arc into every new Balancer).
#[derive(Debug, Default)]
pub struct TargetLoad {
    in_flight: AtomicU32,
    /// Requests waiting for this target to have room under their service's limit.
    waiting: AtomicU32,
    /// Told when a request finishes while some wait.
    room: tokio::sync::Notify,
}

impl TargetLoad {
    #[inline]
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn start_request(&self) {
        // 2^32 requests in flight to one target cannot happen; a plain add keeps this one instruction.
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// Starts a request if fewer than `max` are in flight.
    pub fn try_start_request(&self, max: u32) -> bool {
        // SeqCst here, in `finish_request` and around `waiting`: a waiter counts itself and then
        // checks for room while a finisher frees room and then checks for waiters; weaker
        // orderings would let each miss the other (free on x86, where these are locked anyway).
        self.in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Whether requests wait for room: a newcomer queues behind them rather than take the
    /// room first.
    pub fn has_waiters(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) > 0
    }

    /// Counts a request as waiting for room until the returned guard is dropped; its `room()`
    /// is told when a request finishes.
    pub fn wait_for_room(&self) -> Waiter<'_> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Waiter { load: self }
    }

    /// Saturates at zero: a finish that outlives a counter reset (or is reported twice) must not
    /// wrap to 4 billion and starve the target under least-request.
    pub fn finish_request(&self) {
        // Err only means the counter was already zero, which is the saturation we want.
        let _ = self
            .in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.room.notify_one();
        }
    }
}

/// A request waiting for room at its target (see [`TargetLoad::wait_for_room`]).
pub struct Waiter<'a> {
    load: &'a TargetLoad,
}

impl Waiter<'_> {
    /// Told (one waiter at a time, in order) when a request at the target finishes.
    pub fn room(&self) -> &tokio::sync::Notify {
        &self.load.room
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        self.load.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug, Clone)]
pub struct Member {
    pub weight: u32,
    pub priority: i32,
    pub load: Arc<TargetLoad>,
    /// [`identity_hash`] of the target's stable identity; read only by hashing policies.
    pub identity: u64,
}

/// HAProxy's bounded load for a hashed pick: no member may take a request that would put it
/// above `factor_percent` / 100 × its weighted share of the load, counting the request (with
/// equal weights: the tier's mean).
#[derive(Debug, Clone, Copy)]
pub struct LoadBound {
    /// ≥ 100.
    pub factor_percent: u32,
    /// Requests in flight now to the whole service.
    pub in_flight: u64,
}

impl LoadBound {
    /// The most requests a member of weight `weight` in a tier weighing `tier_weight` may hold,
    /// this one included.
    fn limit(self, weight: u32, tier_weight: u64) -> u64 {
        let scaled =
            u128::from(self.factor_percent) * u128::from(self.in_flight + 1) * u128::from(weight);
        let share = scaled.div_ceil(100 * u128::from(tier_weight.max(1)));
        u64::try_from(share).unwrap_or(u64::MAX)
    }
}

/// The hash tables of a balancer's tiers by priority, to build the next snapshot's balancer of
/// the same service without rebuilding an unchanged tier's table.
#[derive(Debug, Clone, Default)]
pub struct HashTables(Vec<(i32, Arc<HashTable>)>);

impl HashTables {
    fn of(&self, priority: i32) -> Option<&Arc<HashTable>> {
        self.0.iter().find(|(p, _)| *p == priority).map(|(_, t)| t)
    }

    /// (priority, table) of each tier, most preferred first.
    pub fn tiers(&self) -> impl Iterator<Item = (i32, &HashTable)> {
        self.0.iter().map(|(priority, table)| (*priority, &**table))
    }
}

/// All members of one priority value, with the policy's structure over them.
struct Tier {
    priority: i32,
    /// Member ids (indices into the `members` given to `Balancer::new`), for the fallback scan.
    members: Box<[u32]>,
    chooser: Chooser,
    /// Hashing policies: the tier's consistent-hash table (`chooser` then serves keyless picks).
    table: Option<Arc<HashTable>>,
    /// The members' weights summed, for the bounded load's shares.
    total_weight: u64,
}

enum Chooser {
    RoundRobin(Schedule),
    Random(AliasTable),
    LeastRequest(AliasTable),
}

pub struct Balancer {
    policy: LbPolicy,
    /// Ascending priority value, i.e. most preferred first; only weight > 0 members.
    tiers: Box<[Tier]>,
    /// Indexed by member id, like `loads`; least-request compares load per weight.
    weights: Box<[u32]>,
    loads: Box<[Arc<TargetLoad>]>,
    len: usize,
}

impl Balancer {
    /// Members with weight 0 are never picked. Lower `priority` value = preferred tier.
    pub fn new(policy: LbPolicy, members: Vec<Member>) -> Balancer {
        Balancer::reusing(policy, members, &HashTables::default())
    }

    /// [`Balancer::new`], taking each tier's hash table from `previous` when it was built from
    /// the same members (identities and weights, in order).
    pub fn reusing(policy: LbPolicy, members: Vec<Member>, previous: &HashTables) -> Balancer {
        let mut by_priority: BTreeMap<i32, Vec<u32>> = BTreeMap::new();
        for (id, member) in members.iter().enumerate() {
            if member.weight > 0 {
                let id = u32::try_from(id).expect("a service has fewer than 2^32 targets");
                by_priority.entry(member.priority).or_default().push(id);
            }
        }
        let weights: Box<[u32]> = members.iter().map(|m| m.weight).collect();
        let tiers: Box<[Tier]> = by_priority
            .into_iter()
            .map(|(priority, ids)| {
                let mut tier = Tier::new(policy, priority, ids, &weights);
                if let Some(kind) = hash_kind(policy) {
                    let inputs = tier
                        .members
                        .iter()
                        .map(|&id| (members[id as usize].identity, weights[id as usize]))
                        .collect();
                    tier.table = Some(HashTable::reuse_or_build(
                        kind,
                        inputs,
                        previous.of(priority),
                    ));
                }
                tier
            })
            .collect();
        Balancer {
            policy,
            len: tiers.iter().map(|t| t.members.len()).sum(),
            tiers,
            weights,
            loads: members.into_iter().map(|m| m.load).collect(),
        }
    }

    /// Returns the index (into the `members` vector given to `new`) of the chosen member, or None.
    /// `skip(i)` true means member i is unavailable right now (unhealthy, already tried by this
    /// request...). Tiers are tried lowest priority value first; the next tier only when every
    /// member of the lower tier is skipped. Weight applies within a tier, never across tiers.
    ///
    /// O(1) while the preferred tier's fast path finds a member; proving a whole tier skipped
    /// costs one `skip` call per member of that tier, since `skip` is opaque. The member returned
    /// is always one `skip` was called for and returned false (callers rely on it).
    ///
    /// The preferred tier's fast path is inlined into the caller, where `skip` is known; the
    /// rest, which nearly every pick skips, is not.
    #[inline(always)]
    pub fn pick(&self, skip: impl Fn(usize) -> bool) -> Option<usize> {
        let preferred = self.tiers.first()?;
        match self.pick_fast(preferred, &skip) {
            Some(id) => Some(id),
            None => self.pick_past_fast(&skip),
        }
    }

    /// [`Balancer::pick`] once the preferred tier's fast path found nothing: that tier's scan,
    /// then the next tiers.
    #[inline(never)]
    fn pick_past_fast(&self, skip: &impl Fn(usize) -> bool) -> Option<usize> {
        let (preferred, others) = self.tiers.split_first()?;
        preferred.first_available(skip).or_else(|| {
            others.iter().find_map(|tier| {
                self.pick_fast(tier, skip)
                    .or_else(|| tier.first_available(skip))
            })
        })
    }

    /// Like [`Balancer::pick`] but weighted-random within the tier and without moving the
    /// round-robin cursor: for a second pass over the same request (panic fallback), which must
    /// not bend the rotation of ordinary picks.
    pub fn pick_random(&self, skip: impl Fn(usize) -> bool) -> Option<usize> {
        self.tiers.iter().find_map(|tier| {
            let sampled = (0..PROBES)
                .map(|_| match &tier.chooser {
                    Chooser::RoundRobin(schedule) => schedule.sample(),
                    Chooser::Random(table) | Chooser::LeastRequest(table) => table.draw(),
                })
                .find(|&id| !skip(id));
            sampled.or_else(|| tier.first_available(&skip))
        })
    }

    /// A consistent-hash pick for a request whose key hashed to `hash`: in the first tier with
    /// a member not skipped, the key's member or its next choices (see [`HashTable`]); with a
    /// `bound`, passing over members at their bounded load. A balancer of a policy without
    /// tables picks as [`Balancer::pick`] does. Either way, only a member `skip` returned false
    /// for is returned.
    pub fn pick_hashed(
        &self,
        hash: u64,
        bound: Option<LoadBound>,
        skip: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        self.tiers.iter().find_map(|tier| {
            let Some(table) = &tier.table else {
                return self
                    .pick_fast(tier, &skip)
                    .or_else(|| tier.first_available(&skip));
            };
            let member = |index: usize| tier.members[index] as usize;
            let fits = |index: usize| {
                let id = member(index);
                bound.is_none_or(|bound| {
                    let limit = bound.limit(self.weights[id], tier.total_weight);
                    u64::from(self.loads[id].in_flight()) < limit
                })
            };
            table
                .choose(hash, |index| skip(member(index)), fits)
                .map(member)
        })
    }

    /// The hash tables of the tiers (empty for policies without them).
    pub fn hash_tables(&self) -> HashTables {
        HashTables(
            self.tiers
                .iter()
                .filter_map(|tier| Some((tier.priority, tier.table.clone()?)))
                .collect(),
        )
    }

    /// Members of the tier of `priority`, as ids, in the order its hash table numbers them.
    pub fn tier_members(&self, priority: i32) -> Option<&[u32]> {
        self.tiers
            .iter()
            .find(|tier| tier.priority == priority)
            .map(|tier| &*tier.members)
    }

    pub fn policy(&self) -> LbPolicy {
        self.policy
    }

    /// Members with weight > 0.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The policy's O(1) attempt; None when it only met skipped members.
    #[inline(always)]
    fn pick_fast(&self, tier: &Tier, skip: &impl Fn(usize) -> bool) -> Option<usize> {
        match &tier.chooser {
            Chooser::RoundRobin(schedule) => {
                let next = schedule.next();
                if !skip(next) {
                    return Some(next);
                }
                (0..PROBES).map(|_| schedule.sample()).find(|&id| !skip(id))
            }
            Chooser::Random(table) => {
                let first = table.draw();
                if !skip(first) {
                    return Some(first);
                }
                draw_again(table, DRAWS - 1, |id| !skip(id))
            }
            Chooser::LeastRequest(table) => {
                let mut first = table.draw();
                if skip(first) {
                    first = draw_again(table, DRAWS - 1, |id| !skip(id))?;
                }
                if tier.members.len() == 1 {
                    return Some(first);
                }
                let second = match table.draw() {
                    second if second != first && !skip(second) => Some(second),
                    _ => tier.second_choice(table, first, skip),
                };
                Some(second.map_or(first, |second| self.lighter(first, second)))
            }
        }
    }

    /// Power of two choices: the member with less load per weight, counting the request about
    /// to be sent (hence +1, so an idle heavy member beats an idle light one). Ties keep `a`, the
    /// first draw, so equal loads follow the weighted draw.
    #[inline]
    fn lighter(&self, a: usize, b: usize) -> usize {
        let load = |id: usize| u64::from(self.loads[id].in_flight()) + 1;
        let weight = |id: usize| u64::from(self.weights[id]);
        // (2^32)·(2^32 − 1) < 2^64: no overflow.
        if load(b) * weight(a) < load(a) * weight(b) {
            b
        } else {
            a
        }
    }
}

impl Tier {
    fn new(policy: LbPolicy, priority: i32, members: Vec<u32>, all_weights: &[u32]) -> Tier {
        let weights: Vec<u32> = members.iter().map(|&id| all_weights[id as usize]).collect();
        let chooser = match policy {
            // Hashing policies send keyless requests round robin.
            LbPolicy::RoundRobin | LbPolicy::RingHash | LbPolicy::Maglev => {
                Chooser::RoundRobin(Schedule::new(&members, &weights))
            }
            LbPolicy::Random => Chooser::Random(AliasTable::new(&members, &weights)),
            LbPolicy::LeastRequest => Chooser::LeastRequest(AliasTable::new(&members, &weights)),
        };
        Tier {
            priority,
            members: members.into_boxed_slice(),
            chooser,
            table: None,
            total_weight: weights.iter().map(|&w| u64::from(w)).sum(),
        }
    }

    /// LeastRequest's second choice once its first draw for it met `first` or a skipped
    /// member: more draws, then a uniform pick among the others (small tiers often draw `first`
    /// again; a tier of two then always compares with the other one).
    #[cold]
    #[inline(never)]
    fn second_choice(
        &self,
        table: &AliasTable,
        first: usize,
        skip: &impl Fn(usize) -> bool,
    ) -> Option<usize> {
        draw_again(table, SECOND_DRAWS - 1, |id| id != first && !skip(id))
            .or_else(|| self.other_than(first, skip))
    }

    /// LeastRequest's second choice once its draws kept meeting `first` or skipped members: a
    /// uniform pick among the others (of a tier of two or more).
    fn other_than(&self, first: usize, skip: &impl Fn(usize) -> bool) -> Option<usize> {
        let others = self.members.len() - 1;
        let start = fastrand::usize(..others);
        (0..others.min(SECOND_DRAWS))
            .map(|step| {
                let index = (start + step) % others;
                let id = self.members[index] as usize;
                if id == first {
                    self.members[others] as usize
                } else {
                    id
                }
            })
            .find(|&id| id != first && !skip(id))
    }

    /// Fallback once the policy kept meeting skipped members: the first available member from a
    /// random start (a fixed start would pile every fallback onto the same member).
    fn first_available(&self, skip: &impl Fn(usize) -> bool) -> Option<usize> {
        let start = fastrand::usize(..self.members.len());
        let (before, after) = self.members.split_at(start);
        after
            .iter()
            .chain(before)
            .map(|&id| id as usize)
            .find(|&id| !skip(id))
    }
}

fn hash_kind(policy: LbPolicy) -> Option<HashKind> {
    match policy {
        LbPolicy::RingHash => Some(HashKind::Ring),
        LbPolicy::Maglev => Some(HashKind::Maglev),
        LbPolicy::RoundRobin | LbPolicy::Random | LbPolicy::LeastRequest => None,
    }
}

impl fmt::Debug for Balancer {
    /// A summary: the schedules and tables are too large to be worth printing.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tiers: Vec<(i32, usize)> = self
            .tiers
            .iter()
            .map(|t| (t.priority, t.members.len()))
            .collect();
        f.debug_struct("Balancer")
            .field("policy", &self.policy)
            .field("len", &self.len)
            .field("tiers (priority, members)", &tiers)
            .finish()
    }
}

/// Up to `draws` more weighted draws from `table`: the first that `takes` accepts. Out of line:
/// the pick's first draw nearly always does.
#[cold]
#[inline(never)]
fn draw_again(table: &AliasTable, draws: usize, takes: impl Fn(usize) -> bool) -> Option<usize> {
    (0..draws).map(|_| table.draw()).find(|&id| takes(id))
}

#[cfg(test)]
mod hash_tests;
#[cfg(test)]
mod tests;
