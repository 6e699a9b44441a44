//! Which targets' runtime state (health, ejection) moved since the control task last looked.
//!
//! Whoever moves a target's state (a health check, the request path ejecting or restoring it)
//! sets the target's bit, without a lock or a channel; the control task takes the set bits, so
//! its look every few hundred milliseconds costs what changed instead of every target. A slot is
//! a target's place in the bitmap, given by the control task and reused after the target is
//! gone: a stale holder of a reused slot only makes the new owner be looked at for nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

const WORD_BITS: usize = 64;
const WORDS_PER_BLOCK: usize = 64;
const BLOCK_SLOTS: usize = WORD_BITS * WORDS_PER_BLOCK;
const BLOCKS: usize = 1024;
/// Slots the bitmap holds (4,194,304); targets beyond them share [`ChangeMarks::overflowed`].
pub const SLOTS: usize = BLOCK_SLOTS * BLOCKS;

type Block = [AtomicU64; WORDS_PER_BLOCK];

/// One gateway's bitmap of moved targets, with a summary bit per block of 4,096 slots.
pub struct ChangeMarks {
    blocks: Box<[OnceLock<Box<Block>>]>,
    summary: [AtomicU64; BLOCKS / WORD_BITS],
    /// A target without a slot moved: look at every target.
    overflowed: AtomicBool,
}

impl std::fmt::Debug for ChangeMarks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChangeMarks")
    }
}

impl Default for ChangeMarks {
    fn default() -> Self {
        ChangeMarks {
            blocks: (0..BLOCKS).map(|_| OnceLock::new()).collect(),
            summary: std::array::from_fn(|_| AtomicU64::new(0)),
            overflowed: AtomicBool::new(false),
        }
    }
}

/// What moved since the last take.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Moved {
    /// The slots whose bit was set, ascending.
    pub slots: Vec<u32>,
    /// A target without a slot moved: every target must be looked at.
    pub everything: bool,
}

impl ChangeMarks {
    /// The mark of the target in `slot` (None: more targets than slots, marks overflow).
    pub fn mark(self: &Arc<Self>, slot: Option<u32>) -> Mark {
        let slot = slot.filter(|slot| (*slot as usize) < SLOTS);
        if let Some(slot) = slot {
            // Made by the control task before the target is published, never on the request path.
            self.blocks[slot as usize / BLOCK_SLOTS]
                .get_or_init(|| Box::new(std::array::from_fn(|_| AtomicU64::new(0))));
        }
        Mark {
            marks: self.clone(),
            slot: slot.unwrap_or(u32::MAX),
        }
    }

    fn set(&self, slot: u32) {
        if slot == u32::MAX {
            self.overflowed.store(true, Ordering::Release);
            return;
        }
        let slot = slot as usize;
        let block = slot / BLOCK_SLOTS;
        let Some(words) = self.blocks[block].get() else {
            self.overflowed.store(true, Ordering::Release);
            return;
        };
        let bit = 1u64 << (slot % WORD_BITS);
        let word = &words[(slot % BLOCK_SLOTS) / WORD_BITS];
        // Always a read-modify-write, even when the bit looks set: it is ordered with the
        // control task's swap on the same word, so either the swap sees this move's state
        // (Release pairs with its Acquire) or the bit stays set for its next look. An early
        // return on a plain load could see the bit just before the swap cleared it and lose
        // the move. Moves are rare next to picks, so the cost does not matter.
        word.fetch_or(bit, Ordering::Release);
        self.summary[block / WORD_BITS].fetch_or(1 << (block % WORD_BITS), Ordering::Release);
    }

    /// Takes every set bit, clearing it: the state read after this is at least as new as what
    /// set it.
    pub fn take(&self) -> Moved {
        let mut moved = Moved {
            slots: Vec::new(),
            everything: self.overflowed.swap(false, Ordering::Acquire),
        };
        for (summary_index, summary) in self.summary.iter().enumerate() {
            let mut blocks = summary.swap(0, Ordering::Acquire);
            while blocks != 0 {
                let block = summary_index * WORD_BITS + blocks.trailing_zeros() as usize;
                blocks &= blocks - 1;
                let Some(words) = self.blocks[block].get() else {
                    continue;
                };
                for (word_index, word) in words.iter().enumerate() {
                    let mut bits = word.swap(0, Ordering::Acquire);
                    while bits != 0 {
                        let slot = block * BLOCK_SLOTS
                            + word_index * WORD_BITS
                            + bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        moved.slots.push(slot as u32);
                    }
                }
            }
        }
        moved
    }
}

/// Where one target's moves are marked.
#[derive(Debug, Clone)]
pub struct Mark {
    marks: Arc<ChangeMarks>,
    slot: u32,
}

impl Mark {
    pub fn set(&self) {
        self.marks.set(self.slot);
    }

    /// Its slot, for the control task to give back when the target is gone.
    pub fn slot(&self) -> Option<u32> {
        (self.slot != u32::MAX).then_some(self.slot)
    }
}

/// The control task's allocation of slots to target ids.
#[derive(Debug, Default)]
pub struct Slots {
    owners: Vec<crate::model::Id>,
    free: Vec<u32>,
}

impl Slots {
    /// A slot for `id` (None once every slot is taken).
    pub fn take(&mut self, id: crate::model::Id) -> Option<u32> {
        if let Some(slot) = self.free.pop() {
            self.owners[slot as usize] = id;
            return Some(slot);
        }
        if self.owners.len() >= SLOTS {
            return None;
        }
        self.owners.push(id);
        Some((self.owners.len() - 1) as u32)
    }

    pub fn give_back(&mut self, slot: u32) {
        if let Some(owner) = self.owners.get_mut(slot as usize) {
            *owner = 0;
            self.free.push(slot);
        }
    }

    /// The target holding `slot` now (None when free).
    pub fn owner(&self, slot: u32) -> Option<crate::model::Id> {
        self.owners
            .get(slot as usize)
            .copied()
            .filter(|id| *id != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_bit_is_taken_once_across_blocks() {
        let marks = Arc::new(ChangeMarks::default());
        let first = marks.mark(Some(3));
        let far = marks.mark(Some(5 * BLOCK_SLOTS as u32 + 70));
        assert_eq!(marks.take(), Moved::default());
        far.set();
        first.set();
        first.set();
        assert_eq!(marks.take().slots, [3, 5 * BLOCK_SLOTS as u32 + 70]);
        assert_eq!(marks.take(), Moved::default(), "taken, so cleared");
        marks.mark(None).set();
        assert!(marks.take().everything);
    }

    #[test]
    fn slots_are_reused_after_their_target_is_gone() {
        let mut slots = Slots::default();
        assert_eq!(slots.take(10), Some(0));
        assert_eq!(slots.take(11), Some(1));
        slots.give_back(0);
        assert_eq!(slots.owner(0), None);
        assert_eq!(slots.take(12), Some(0));
        assert_eq!(slots.owner(0), Some(12));
    }
}
