//! A lock-free view of the segment table's slots, for reads through an index entry:
//! the hot path then touches no shared lock word (the table's `RwLock` is a cache
//! line every reader writes). Chunks are allocated on first use and live as long as
//! the log.
//!
//! A slot holds `Arc::as_ptr` of the segment the table owns, set when the segment is
//! inserted and cleared (`Log::unpublish`) before the table lets it go.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};

use super::Segment;
use crate::addr::{SEGMENT_SLOTS_MAX, SegmentSlot};

/// Slots per chunk of the directory.
const DIRECTORY_CHUNK: usize = 1024;

/// `DIRECTORY_CHUNK` slots.
type DirectoryChunk = Box<[AtomicPtr<Segment>]>;

pub(super) struct Directory {
    chunks: Box<[OnceLock<DirectoryChunk>]>,
}

impl Directory {
    pub(super) fn new() -> Directory {
        Directory {
            chunks: (0..SEGMENT_SLOTS_MAX.div_ceil(DIRECTORY_CHUNK))
                .map(|_| OnceLock::new())
                .collect(),
        }
    }

    fn slot(&self, slot: SegmentSlot) -> &AtomicPtr<Segment> {
        let slot = slot.0 as usize;
        &self.chunks[slot / DIRECTORY_CHUNK].get_or_init(|| {
            (0..DIRECTORY_CHUNK)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect()
        })[slot % DIRECTORY_CHUNK]
    }

    /// Publishes `segment`, which the segment table holds from now until after
    /// `clear` and a reader drain.
    pub(super) fn set(&self, segment: &Arc<Segment>) {
        self.slot(segment.slot)
            .store(Arc::as_ptr(segment).cast_mut(), Ordering::Release);
    }

    pub(super) fn clear(&self, slot: SegmentSlot) {
        self.slot(slot)
            .store(std::ptr::null_mut(), Ordering::Release);
    }

    /// Calls `f` with the segment in `slot`, if any.
    ///
    /// # Safety
    ///
    /// The caller holds an index shard lock for the whole call, and a segment's
    /// memory is released only after its slot was cleared and then every shard lock
    /// was taken once (`Index::drain_readers`, whose `ReadersDrained` proof
    /// `Log::delete_segments` requires). A pointer loaded here was therefore set by
    /// `set` from an `Arc` that is still alive until this call returns.
    pub(super) unsafe fn with<R>(
        &self,
        slot: SegmentSlot,
        f: impl FnOnce(&Segment) -> R,
    ) -> Option<R> {
        let chunk = self.chunks.get(slot.0 as usize / DIRECTORY_CHUNK)?.get()?;
        let pointer = chunk[slot.0 as usize % DIRECTORY_CHUNK].load(Ordering::Acquire);
        if pointer.is_null() {
            return None;
        }
        // SAFETY: non-null pointers come from `Arc::as_ptr` in `set`, and by this
        // function's contract that `Arc` outlives the call.
        Some(f(unsafe { &*pointer }))
    }
}
