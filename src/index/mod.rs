//! The in-memory index: shards of small entries, each pointing at the newest record
//! of one key. A fingerprint match is only a candidate: the caller verifies the full
//! key against the record, so colliding hashes can never produce a false duplicate.

mod alloc;

use crossbeam_utils::CachePadded;
use hashbrown::HashTable;
use parking_lot::{Mutex, MutexGuard};

use crate::addr::{self, FINGERPRINT_MASK, Location, Lsn, ReadersDrained, SegmentSlot};
use crate::format::record::State;
use alloc::TableAlloc;

/// The 64-bit hash of `(namespace_id, partition, id)`: a key of a partition-scoped
/// namespace is its id within its partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyHash(pub u64);

impl KeyHash {
    #[inline]
    pub(crate) fn of(namespace_id: u32, partition: Option<u32>, id: &[u8]) -> KeyHash {
        // Unscoped keys hash as format v1 did (seed = the namespace id); a partition
        // goes into the seed's high half, marked so that partition 0 differs from none.
        let seed = match partition {
            None => u64::from(namespace_id),
            Some(p) => u64::from(namespace_id) ^ (u64::from(p) << 32) ^ 0x9e37_79b9_7f4a_7c15,
        };
        KeyHash(xxhash_rust::xxh3::xxh3_64_with_seed(id, seed))
    }

    /// The hash of a record's key.
    #[inline]
    pub(crate) fn of_record(record: &crate::format::record::StoredRecord<'_>) -> KeyHash {
        KeyHash::of(record.namespace_id, record.placement.partition, record.id)
    }

    /// The bits stored in the entry.
    fn fingerprint(self) -> u32 {
        (self.0 & FINGERPRINT_MASK) as u32
    }

    fn shard(self, mask: usize) -> usize {
        (self.0 >> 32) as usize & mask
    }
}

/// One index entry: 8 bytes, packed as `crate::addr` lays out.
///
/// At hashbrown's load factors (7/8 just before growth, 7/16 just after) plus one
/// control byte per bucket, that is 10.3 to 20.6 bytes of memory per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry(u64);

const _: () = assert!(std::mem::size_of::<Entry>() == 8);

impl Entry {
    fn new(fingerprint: u32, location: Location) -> Entry {
        Entry(addr::pack(fingerprint, location.slot.0, location.offset))
    }

    fn fingerprint(&self) -> u32 {
        addr::unpack(self.0).0
    }

    pub(crate) fn location(&self) -> Location {
        let (_, slot, offset) = addr::unpack(self.0);
        Location {
            slot: SegmentSlot(slot),
            offset,
        }
    }
}

/// The table hash of a fingerprint: spread so that hashbrown's top-7-bit tag and its
/// low-bit bucket index are both well mixed.
#[inline]
fn table_hash(fingerprint: u32) -> u64 {
    u64::from(fingerprint).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Live keys per state in one shard.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StateCounts {
    pub counts: [u64; 6],
}

impl StateCounts {
    pub(crate) fn index(state: State) -> usize {
        match state {
            State::Seen => 0,
            State::InProgress => 1,
            State::Released => 2,
            State::Completed => 3,
            State::Failed => 4,
            State::Tombstone => 5,
        }
    }

    pub(crate) fn add(&mut self, state: State) {
        self.counts[Self::index(state)] += 1;
    }

    pub(crate) fn sub(&mut self, state: State) {
        let count = &mut self.counts[Self::index(state)];
        debug_assert!(*count > 0, "state count underflow for {state:?}");
        *count = count.saturating_sub(1);
    }
}

pub(crate) struct Shard {
    table: HashTable<Entry, TableAlloc>,
    pub counts: StateCounts,
    /// This shard's index in the low 16 bits of every lsn it hands out.
    index: u16,
    /// The next lsn's high 48 bits. Lsns only need to be unique and to increase per
    /// key, and a key always maps to one shard: a counter per shard, under the shard
    /// lock, gives both without a shared atomic on the hot path.
    lsn_counter: u64,
    /// `lsn_counter` when this open finished recovery: a record whose lsn counter is
    /// below it was written by an earlier holder of the directory lock.
    open_lsn_counter: u64,
}

impl Shard {
    /// A new lsn, greater than every lsn this shard handed out or recovery saw.
    pub(crate) fn next_lsn(&mut self) -> Lsn {
        let lsn = Lsn::new(self.lsn_counter, self.index);
        self.lsn_counter += 1;
        lsn
    }

    /// The state a stored record stands for now. A claim in progress written before
    /// this open belongs to a process that no longer holds the directory lock, so it
    /// is dead: it counts as released (its attempts stay).
    pub(crate) fn effective_state(&self, state: State, lsn: Lsn) -> State {
        effective(state, lsn, self.open_lsn_counter)
    }

    /// The entry for `hash` whose record `is_key` confirms, if any.
    pub(crate) fn find(
        &self,
        hash: KeyHash,
        mut is_key: impl FnMut(Location) -> bool,
    ) -> Option<Location> {
        let fingerprint = hash.fingerprint();
        self.table
            .find(table_hash(fingerprint), |e| {
                e.fingerprint() == fingerprint && is_key(e.location())
            })
            .map(Entry::location)
    }

    /// Points the entry at `old` (found by `find`) to `new`, or inserts a new entry.
    pub(crate) fn upsert(&mut self, hash: KeyHash, old: Option<Location>, new: Location) {
        let fingerprint = hash.fingerprint();
        let entry = Entry::new(fingerprint, new);
        match old {
            Some(old) => {
                let existing = self
                    .table
                    .find_mut(table_hash(fingerprint), |e| {
                        e.fingerprint() == fingerprint && e.location() == old
                    })
                    .expect("upsert of an entry that find returned under the same lock");
                *existing = entry;
            }
            None => {
                self.table
                    .insert_unique(table_hash(fingerprint), entry, |e| {
                        table_hash(e.fingerprint())
                    });
            }
        }
    }

    /// Removes the entry that points at `location`; false if none does.
    pub(crate) fn remove_at(&mut self, hash: KeyHash, location: Location) -> bool {
        let fingerprint = hash.fingerprint();
        match self.table.find_entry(table_hash(fingerprint), |e| {
            e.fingerprint() == fingerprint && e.location() == location
        }) {
            Ok(occupied) => {
                occupied.remove();
                true
            }
            Err(_) => false,
        }
    }

    /// Removes every entry that points into one of `slots`, whatever its record says
    /// (the reaper's sweep after a walk that met damaged records). `read` gives the
    /// state and lsn of the record an entry names, if it still decodes, so its count
    /// is taken back; returns how many entries were removed and how many of those
    /// named a record that no longer decodes (their counts stay: their state is lost).
    pub(crate) fn remove_slots(
        &mut self,
        slots: &[SegmentSlot],
        mut read: impl FnMut(Location) -> Option<(State, Lsn)>,
    ) -> (u64, u64) {
        let open_lsn_counter = self.open_lsn_counter;
        let counts = &mut self.counts;
        let (mut removed, mut unreadable) = (0, 0);
        self.table.retain(|e| {
            let location = e.location();
            if !slots.contains(&location.slot) {
                return true;
            }
            removed += 1;
            match read(location) {
                Some((state, lsn)) => counts.sub(effective(state, lsn, open_lsn_counter)),
                None => unreadable += 1,
            }
            false
        });
        (removed, unreadable)
    }

    /// Gives back the table's room beyond what its entries need (after a spill).
    pub(crate) fn shrink(&mut self) {
        self.table.shrink_to_fit(|e| table_hash(e.fingerprint()));
    }

    /// The table's bucket mask: a probe for `hash` starts at bucket
    /// `table_hash(fingerprint) & mask` (hashbrown's layout, derived from its capacity,
    /// which is 7/8 of the buckets from 8 buckets up and one less below; only the
    /// order of `Index::probe_order` rests on it, never an answer).
    fn bucket_mask(&self) -> usize {
        match self.table.capacity() {
            small @ 0..8 => small,
            capacity => (capacity / 7 * 8).next_power_of_two() - 1,
        }
    }

    /// Memory held by the table, in bytes.
    pub(crate) fn allocation_size(&self) -> usize {
        self.table.allocation_size()
    }

    /// Every entry as (fingerprint, location), in table order (for a checkpoint).
    pub(crate) fn entries(&self) -> impl ExactSizeIterator<Item = (u32, Location)> + '_ {
        self.table.iter().map(|e| (e.fingerprint(), e.location()))
    }

    /// Room for `additional` more entries without growing.
    pub(crate) fn reserve(&mut self, additional: usize) {
        self.table
            .reserve(additional, |e| table_hash(e.fingerprint()));
    }

    /// Inserts an entry restored from a checkpoint: the key's fingerprint and the
    /// location of its newest record (no two restored entries name one record).
    pub(crate) fn insert_restored(&mut self, fingerprint: u32, location: Location) {
        debug_assert!(u64::from(fingerprint) <= FINGERPRINT_MASK);
        self.table.insert_unique(
            table_hash(fingerprint),
            Entry::new(fingerprint, location),
            |e| table_hash(e.fingerprint()),
        );
    }

    /// The high bits of the next lsn this shard hands out (for a checkpoint).
    pub(crate) fn lsn_counter(&self) -> u64 {
        self.lsn_counter
    }

    /// `lsn_counter` when this open finished recovery: its claims in progress are this
    /// process's from there on.
    pub(crate) fn open_lsn_counter(&self) -> u64 {
        self.open_lsn_counter
    }

    /// After a restore from a checkpoint: lsns continue at least from `counter`.
    pub(crate) fn restore_lsn_counter(&mut self, counter: u64) {
        self.lsn_counter = self.lsn_counter.max(counter);
    }
}

/// `Shard::effective_state` for a shard whose recovery ended at `open_lsn_counter`.
fn effective(state: State, lsn: Lsn, open_lsn_counter: u64) -> State {
    if state == State::InProgress && lsn.counter() < open_lsn_counter {
        State::Released
    } else {
        state
    }
}

pub(crate) struct Index {
    shards: Box<[CachePadded<Mutex<Shard>>]>,
    mask: usize,
}

impl Index {
    /// `budgeted`: the store has a memory budget (`TableAlloc::for_store`).
    pub(crate) fn new(shards: usize, budgeted: bool) -> Index {
        debug_assert!(shards.is_power_of_two());
        let tables = TableAlloc::for_store(budgeted);
        Index {
            shards: (0..shards)
                .map(|index| {
                    CachePadded::new(Mutex::new(Shard {
                        table: HashTable::new_in(tables),
                        counts: StateCounts::default(),
                        index: index as u16,
                        lsn_counter: 1,
                        open_lsn_counter: 0,
                    }))
                })
                .collect(),
            mask: shards - 1,
        }
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(crate) fn shard_of(&self, hash: KeyHash) -> usize {
        hash.shard(self.mask)
    }

    pub(crate) fn lock_at(&self, shard: usize) -> MutexGuard<'_, Shard> {
        self.shards[shard].lock()
    }

    pub(crate) fn lock(&self, hash: KeyHash) -> MutexGuard<'_, Shard> {
        self.shards[hash.shard(self.mask)].lock()
    }

    /// Each shard's bucket mask now, for [`Index::probe_order`].
    pub(crate) fn probe_masks(&self) -> Vec<usize> {
        self.shards()
            .map(|shard| shard.lock().bucket_mask())
            .collect()
    }

    /// A sort key that visits the tables in memory order: the shard, then the bucket
    /// where a probe for `hash` starts (`masks` from [`Index::probe_masks`]; a table
    /// that grew or shrank since only makes the order less sequential). Work on many
    /// keys (a spill's lookups and removals) sorted by it reads each table front to
    /// back instead of missing the cache on every key.
    pub(crate) fn probe_order(&self, hash: KeyHash, masks: &[usize]) -> u64 {
        let shard = hash.shard(self.mask);
        let start = table_hash(hash.fingerprint()) as usize & masks[shard];
        (shard as u64) << 40 | (start as u64 & ((1 << 40) - 1))
    }

    pub(crate) fn shards(&self) -> impl Iterator<Item = &Mutex<Shard>> {
        self.shards.iter().map(|shard| &**shard)
    }

    /// Makes room for about `keys` entries in all, spread over the shards (before
    /// replay, so the tables do not grow and rehash while it runs).
    pub(crate) fn reserve(&self, keys: usize) {
        let per_shard = keys / self.shards.len() + 1;
        for shard in self.shards() {
            shard
                .lock()
                .table
                .reserve(per_shard, |e| table_hash(e.fingerprint()));
        }
    }

    /// At the end of recovery: every record recovered so far was written by an earlier
    /// process, so its claims in progress are dead (`Shard::effective_state`). Moves
    /// their counts to released; returns how many claims that released.
    pub(crate) fn finish_recovery(&self) -> u64 {
        let in_progress = StateCounts::index(State::InProgress);
        let released = StateCounts::index(State::Released);
        let mut dead_claims = 0;
        for shard in self.shards() {
            let mut shard = shard.lock();
            shard.open_lsn_counter = shard.lsn_counter;
            let moved = std::mem::take(&mut shard.counts.counts[in_progress]);
            shard.counts.counts[released] += moved;
            dead_claims += moved;
        }
        dead_claims
    }

    /// After recovery: every lsn handed out from now on exceeds `max_lsn`.
    pub(crate) fn set_lsn_floor(&self, max_lsn: Lsn) {
        for shard in self.shards() {
            let mut shard = shard.lock();
            shard.lsn_counter = shard.lsn_counter.max(max_lsn.counter() + 1);
        }
    }

    /// Takes every shard lock once: a grace period. Readers dereference the log's
    /// directory pointers only while holding a shard lock, so once this returns, no
    /// reader still holds a pointer loaded before the call. Under each lock, also
    /// removes every entry that points into one of `sweep` (`Shard::remove_slots`).
    pub(crate) fn drain_readers(
        &self,
        sweep: &[SegmentSlot],
        mut read: impl FnMut(Location) -> Option<(State, Lsn)>,
    ) -> Drained {
        let (mut swept, mut unreadable) = (0, 0);
        for shard in self.shards() {
            let mut shard = shard.lock();
            if !sweep.is_empty() {
                let (removed, lost) = shard.remove_slots(sweep, &mut read);
                swept += removed;
                unreadable += lost;
            }
        }
        Drained {
            // SAFETY: every shard lock was acquired and released above, and the
            // caller cleared the directory slots before calling (`Log::unpublish`).
            proof: unsafe { ReadersDrained::new() },
            swept,
            unreadable,
        }
    }
}

/// What `Index::drain_readers` did.
pub(crate) struct Drained {
    pub proof: ReadersDrained,
    /// Entries removed by slot.
    pub swept: u64,
    /// Of those, entries whose record no longer decodes.
    pub unreadable: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_keep_every_field_at_its_extremes() {
        let location = Location {
            slot: SegmentSlot(addr::SLOT_MASK as u32),
            offset: addr::OFFSET_MASK as u32,
        };
        let entry = Entry::new(FINGERPRINT_MASK as u32, location);
        assert_eq!(entry.fingerprint(), FINGERPRINT_MASK as u32);
        assert_eq!(entry.location(), location);
    }

    /// The bucket mask `probe_order` derives from the capacity is the table's own: the
    /// allocation is that many 8-byte entries and control bytes, plus one SSE2 group
    /// of control bytes (x86-64's layout; elsewhere hashbrown's group may be narrower).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_bucket_mask_is_the_tables_own() {
        let index = Index::new(1, false);
        let mut shard = index.lock_at(0);
        assert_eq!(shard.bucket_mask(), 0, "an empty table");
        for n in 1..5_000u32 {
            let location = Location {
                slot: SegmentSlot(1),
                offset: n,
            };
            shard.upsert(KeyHash(u64::from(n) * 0x9E37_79B9), None, location);
            if n.is_power_of_two() || n % 97 == 0 {
                let buckets = shard.bucket_mask() + 1;
                assert!(buckets.is_power_of_two(), "{n}");
                assert_eq!(shard.allocation_size(), buckets * 9 + 16, "{n} entries");
            }
        }
    }

    #[test]
    fn state_counts_follow_the_order_of_every_state() {
        for (i, state) in State::ALL.into_iter().enumerate() {
            assert_eq!(StateCounts::index(state), i);
        }
    }

    #[test]
    fn lsns_are_unique_across_shards_and_exceed_the_recovered_floor() {
        let index = Index::new(4, false);
        let floor = Lsn::new(5, 3);
        index.set_lsn_floor(floor);
        let mut seen = std::collections::BTreeSet::new();
        for shard in 0..4 {
            let mut guard = index.lock_at(shard);
            for _ in 0..3 {
                let lsn = guard.next_lsn();
                assert!(lsn > floor);
                assert!(seen.insert(lsn), "lsn {lsn:?} handed out twice");
            }
        }
    }
}
