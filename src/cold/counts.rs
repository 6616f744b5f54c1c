//! Per segment, per shard, the keys per state whose newest entry is cold and points
//! into that segment: what to take out of each shard's counts when the segment's
//! bucket expires.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::format::cold_state::STATES;
use crate::format::record::State;
use crate::index::StateCounts;

/// One segment's counters. The shard's own `counts` keep counting those keys (a spill
/// moves no count, so `Stats` never sees a key twice or not at all); these say what
/// to take out of each shard's counts when the segment's bucket expires. Changed only
/// under the shard's lock (atomics for the shared handle), and shared by the
/// generations that hold a row of the segment in turn (a merge hands the same
/// counters on).
///
/// Per state, one `u32` per shard, allocated when the state is first counted: a store
/// of marks allocates the `Seen` row only, 4 bytes a shard (at 4,096 shards and a
/// billion keys in 2,909 segments, 48 MB where one `[u64; 6]` a shard took 572 MB).
/// `u32` holds any count: a segment holds at most 16 MiB of records of 30 bytes or
/// more, far fewer than 2^32.
pub(crate) struct RowCounts {
    by_state: [OnceLock<Box<[AtomicU32]>>; STATES],
    shards: usize,
}

impl RowCounts {
    pub(crate) fn new(shards: usize) -> RowCounts {
        RowCounts {
            by_state: Default::default(),
            shards,
        }
    }

    fn row(&self, state: State) -> &[AtomicU32] {
        self.by_state[StateCounts::index(state)]
            .get_or_init(|| (0..self.shards).map(|_| AtomicU32::new(0)).collect())
    }

    /// A key of `state` in `shard` now has its newest entry in this segment.
    pub(crate) fn add(&self, shard: usize, state: State) {
        self.row(state)[shard].fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one key of `state` in `shard` out, if one is counted (false once the
    /// segment expired: its keys were taken out of the shard's counts then).
    pub(crate) fn sub(&self, shard: usize, state: State) -> bool {
        self.by_state[StateCounts::index(state)]
            .get()
            .is_some_and(|row| {
                row[shard]
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                    .is_ok()
            })
    }

    /// `shard`'s counts, by state (`State::ALL` order).
    pub(crate) fn get(&self, shard: usize) -> [u64; STATES] {
        std::array::from_fn(|i| {
            self.by_state[i]
                .get()
                .map_or(0, |row| u64::from(row[shard].load(Ordering::Relaxed)))
        })
    }

    /// Sets `shard`'s counts (a cold state's, at open). A count above `u32::MAX` (no
    /// segment holds so many records) is kept as `u32::MAX`.
    pub(crate) fn set(&self, shard: usize, counts: [u64; STATES]) {
        for (state, n) in State::ALL.into_iter().zip(counts) {
            if n > 0 {
                let n = u32::try_from(n).unwrap_or(u32::MAX);
                self.row(state)[shard].store(n, Ordering::Relaxed);
            } else if let Some(row) = self.by_state[StateCounts::index(state)].get() {
                row[shard].store(0, Ordering::Relaxed);
            }
        }
    }

    /// Takes `shard`'s counts out, leaving zeros (the segment's expiry).
    pub(crate) fn take(&self, shard: usize) -> [u64; STATES] {
        std::array::from_fn(|i| {
            self.by_state[i]
                .get()
                .map_or(0, |row| u64::from(row[shard].swap(0, Ordering::Relaxed)))
        })
    }

    /// Its rows as a cold state holds them: per state, one count per shard, or `None`
    /// where none was ever counted.
    pub(crate) fn rows(&self) -> [Option<Vec<u32>>; STATES] {
        std::array::from_fn(|i| {
            self.by_state[i]
                .get()
                .map(|row| row.iter().map(|n| n.load(Ordering::Relaxed)).collect())
        })
    }

    /// Bytes of RAM its counters take.
    pub(crate) fn bytes(&self) -> usize {
        self.by_state.iter().filter(|r| r.get().is_some()).count() * self.shards * 4
    }
}

impl super::ColdTier {
    /// RAM the generations keep (filters, fences, segment tables) and the spilled
    /// segments' counters.
    pub(crate) fn ram_bytes(&self) -> u64 {
        let counts = self.counts_bytes();
        self.generations
            .read()
            .iter()
            .map(|g| g.ram_bytes())
            .sum::<u64>()
            + counts
    }

    /// RAM the spilled segments' counters take.
    pub(super) fn counts_bytes(&self) -> u64 {
        let spilled = self.spilled.lock();
        spilled.values().map(|s| s.counts.bytes() as u64).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_allocate_a_state_when_first_counted_and_never_go_below_zero() {
        let counts = RowCounts::new(4);
        assert_eq!(counts.bytes(), 0);
        assert!(!counts.sub(1, State::Seen), "nothing counted");
        counts.add(1, State::Seen);
        counts.add(1, State::Seen);
        counts.add(3, State::Completed);
        assert_eq!(counts.bytes(), 2 * 4 * 4);
        let seen = StateCounts::index(State::Seen);
        let completed = StateCounts::index(State::Completed);
        assert_eq!(counts.get(1)[seen], 2);
        assert_eq!(counts.get(3)[completed], 1);
        assert_eq!(counts.get(0), [0; STATES]);
        assert!(counts.sub(1, State::Seen));
        assert!(!counts.sub(3, State::Seen), "shard 3 has no Seen key");
        assert_eq!(counts.take(1)[seen], 1);
        assert_eq!(counts.get(1), [0; STATES]);
        assert!(!counts.sub(1, State::Seen));
        let mut row = [0; STATES];
        row[completed] = 7;
        row[seen] = u64::from(u32::MAX) + 5;
        counts.set(2, row);
        row[seen] = u64::from(u32::MAX);
        assert_eq!(counts.get(2), row);
        counts.set(2, [0; STATES]);
        assert_eq!(counts.get(2), [0; STATES]);
    }
}
