//! Addresses: where a record lives (a segment slot and an offset), the 64-bit word an
//! index entry packs them into with the key's fingerprint, and the log sequence
//! number. A leaf: `index`, `log` and `format::checkpoint` all use it, and it uses
//! nothing of theirs, so the bit layout and its limits are written down once.

use crate::limits;

/// Index of a segment in the segment table (what index entries store).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct SegmentSlot(pub u32);

/// Where a record lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Location {
    pub slot: SegmentSlot,
    pub offset: u32,
}

/// Bits of an entry word, low to high: offset in the segment, segment slot,
/// fingerprint (`fingerprint:20 | slot:20 | offset:24`).
pub(crate) const OFFSET_BITS: u32 = 24;
pub(crate) const SLOT_BITS: u32 = 20;
pub(crate) const FINGERPRINT_BITS: u32 = 64 - OFFSET_BITS - SLOT_BITS;
pub(crate) const OFFSET_MASK: u64 = (1 << OFFSET_BITS) - 1;
pub(crate) const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
pub(crate) const FINGERPRINT_MASK: u64 = (1 << FINGERPRINT_BITS) - 1;

/// Most segments a store can hold at once (slots are reused after deletion).
pub(crate) const SEGMENT_SLOTS_MAX: usize = 1 << SLOT_BITS;

// Every offset of the largest segment fits the offset field.
const _: () = assert!(limits::SEGMENT_SIZE_BYTES_MAX <= 1 << OFFSET_BITS);
const _: () = assert!(FINGERPRINT_BITS == 20);
// The shard is picked from bits 32.. of the key hash, the fingerprint from bits ..20:
// independent.
const _: () = assert!(FINGERPRINT_BITS <= 32);

/// Packs an entry word. Each field must fit its bits.
#[inline]
pub(crate) fn pack(fingerprint: u32, slot: u32, offset: u32) -> u64 {
    debug_assert!(u64::from(fingerprint) <= FINGERPRINT_MASK);
    debug_assert!(u64::from(slot) <= SLOT_MASK);
    debug_assert!(u64::from(offset) <= OFFSET_MASK);
    (u64::from(fingerprint) << (SLOT_BITS + OFFSET_BITS))
        | (u64::from(slot) << OFFSET_BITS)
        | u64::from(offset)
}

/// The fields of an entry word: (fingerprint, slot, offset).
#[inline]
pub(crate) fn unpack(word: u64) -> (u32, u32, u32) {
    (
        (word >> (SLOT_BITS + OFFSET_BITS)) as u32,
        ((word >> OFFSET_BITS) & SLOT_MASK) as u32,
        (word & OFFSET_MASK) as u32,
    )
}

/// Bits of an lsn that name the shard that handed it out (the low bits).
pub(crate) const LSN_SHARD_BITS: u32 = 16;
const _: () = assert!(limits::SHARDS_MAX <= 1 << LSN_SHARD_BITS);

/// A log sequence number: `counter << 16 | shard`. Unique in a store, and
/// increasing per key (a key always maps to one shard, whose counter only grows);
/// every lsn handed out after an open exceeds every lsn recovered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub(crate) struct Lsn(pub u64);

impl Lsn {
    pub(crate) fn new(counter: u64, shard: u16) -> Lsn {
        Lsn((counter << LSN_SHARD_BITS) | u64::from(shard))
    }

    /// The counter part: which of its shard's lsns this is.
    pub(crate) fn counter(self) -> u64 {
        self.0 >> LSN_SHARD_BITS
    }
}

/// Proof that every reader that could have loaded a segment pointer from the log's
/// lock-free directory before a given moment has finished: made only by
/// `Index::drain_readers`, which takes every shard lock once after that moment.
/// `Log::delete_segments` requires one before it lets a segment's memory go.
pub(crate) struct ReadersDrained(());

impl ReadersDrained {
    /// # Safety
    ///
    /// Every index shard lock was acquired (and released) after the directory slots
    /// this proof is for were cleared. Readers dereference directory pointers only
    /// while holding a shard lock (`Log::with_record` takes the guard's `&Shard`),
    /// so none still holds such a pointer.
    pub(crate) unsafe fn new() -> ReadersDrained {
        ReadersDrained(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_pack_every_field_at_its_extremes() {
        for fingerprint in [0, 1, FINGERPRINT_MASK as u32] {
            for slot in [0, 1, SLOT_MASK as u32] {
                for offset in [0, 64, OFFSET_MASK as u32] {
                    assert_eq!(
                        unpack(pack(fingerprint, slot, offset)),
                        (fingerprint, slot, offset)
                    );
                }
            }
        }
    }

    #[test]
    fn lsns_order_by_counter_then_shard() {
        let a = Lsn::new(5, 3);
        let b = Lsn::new(6, 0);
        assert!(a < b);
        assert_eq!((a.counter(), b.counter()), (5, 6));
    }
}
