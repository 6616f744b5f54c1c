//! One segment file: a header, then records appended under one lock.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::addr::SegmentSlot;
use crate::format::record::{self, StoredRecord};
use crate::format::segment_header;
use crate::io::SegmentFile;

/// How far ahead of the appends pages are mapped writable: a fault-in of 32 pages
/// every 128 KiB of appends, outside the append lock. Small, because a write fault on
/// a shared file mapping marks the page dirty: each sync writes (and then
/// write-protects) whatever is mapped ahead at that moment.
const WRITE_WINDOW: u64 = 128 * 1024;

/// Smallest and largest step of disk preallocation.
const ALLOCATE_STEP_MIN: u64 = 64 * 1024;
const ALLOCATE_STEP_MAX: u64 = 4 << 20;

/// Handed a record's bytes as an append writes them (`Segment::append`).
pub(crate) type Tee<'r, 'f> = &'r mut (dyn FnMut(&[u8]) + 'f);

pub(crate) struct Segment {
    pub slot: SegmentSlot,
    pub seq: u64,
    pub deadline_ms: u64,
    pub path: PathBuf,
    pub file: Arc<dyn SegmentFile>,
    append: Mutex<AppendState>,
    /// Signalled when an extension of the reserved space finishes.
    extended: Condvar,
    /// Bytes from the start of the file that hold complete records; advanced with
    /// `Release` after each record is written.
    published: AtomicU64,
    /// Published bytes that the last sync made durable.
    durable: AtomicU64,
    /// Bytes up to which the commit thread released the written pages from the
    /// process's page tables (`SegmentFile::release_written`).
    released: AtomicU64,
}

struct AppendState {
    /// Bytes reserved on disk with `allocate`.
    allocated: u64,
    /// An appender is reserving the next step outside the lock (see `append`).
    extending: bool,
    /// Bytes up to which pages were mapped writable ahead of the appends.
    prepared: u64,
    /// An appender is mapping the next write window outside the lock.
    preparing: bool,
    /// No more appends (full, or its bucket is retired, or recovered from disk).
    sealed: bool,
    /// The segment has writes the commit thread has not synced yet (it is on the log's
    /// dirty list). Under the append lock, so that publishing a record and checking
    /// this flag need no memory fence of their own.
    dirty: bool,
}

/// What an append did.
pub(crate) enum Appended {
    /// Written at this offset; `newly_dirty` if the caller must put the segment on the
    /// log's dirty list (the first write since the last sync).
    At { offset: u32, newly_dirty: bool },
    /// The segment cannot take this record; open a new one.
    Full,
}

impl Segment {
    /// A new, empty segment whose header is already written to `file`.
    pub(crate) fn new_active(
        slot: SegmentSlot,
        seq: u64,
        deadline_ms: u64,
        path: PathBuf,
        file: Arc<dyn SegmentFile>,
        allocated: u64,
    ) -> Segment {
        Segment {
            slot,
            seq,
            deadline_ms,
            path,
            file,
            append: Mutex::new(AppendState {
                allocated,
                extending: false,
                prepared: segment_header::LEN as u64,
                preparing: false,
                sealed: false,
                dirty: true,
            }),
            extended: Condvar::new(),
            published: AtomicU64::new(segment_header::LEN as u64),
            durable: AtomicU64::new(0),
            released: AtomicU64::new(0),
        }
    }

    /// A segment recovered from disk: sealed, its valid records durable.
    pub(crate) fn recovered(
        slot: SegmentSlot,
        seq: u64,
        deadline_ms: u64,
        path: PathBuf,
        file: Arc<dyn SegmentFile>,
        valid_len: u64,
    ) -> Segment {
        Segment {
            slot,
            seq,
            deadline_ms,
            path,
            file,
            append: Mutex::new(AppendState {
                allocated: valid_len,
                extending: false,
                prepared: valid_len,
                preparing: false,
                sealed: true,
                dirty: false,
            }),
            extended: Condvar::new(),
            published: AtomicU64::new(valid_len),
            durable: AtomicU64::new(valid_len),
            released: AtomicU64::new(valid_len),
        }
    }

    /// Writes the header of a new segment file and reserves its first blocks.
    pub(crate) fn initialize(
        file: &dyn SegmentFile,
        header: &segment_header::SegmentHeader,
    ) -> io::Result<u64> {
        let first = ALLOCATE_STEP_MIN.min(file.capacity());
        file.allocate(0, first)?;
        let bytes = header.encode();
        file.write_with(0, bytes.len(), &mut |out| out.copy_from_slice(&bytes));
        Ok(first)
    }

    pub(crate) fn published(&self) -> u64 {
        self.published.load(Ordering::Acquire)
    }

    pub(crate) fn durable(&self) -> u64 {
        self.durable.load(Ordering::Acquire)
    }

    /// Whether the record at `offset` is covered by a completed sync.
    pub(crate) fn is_durable(&self, offset: u32) -> bool {
        u64::from(offset) < self.durable()
    }

    /// Appends `record`; returns its offset, or `Full` if it does not fit (or the
    /// segment is sealed). An error means the disk refused to reserve space: nothing
    /// was written. `tee`, if given, is handed the record's bytes right after they are
    /// encoded, once the append can no longer fail (the replication queue copies them
    /// instead of encoding the record a second time).
    ///
    /// Space is reserved ahead in growing steps. When less than half a step is left,
    /// the appender that notices reserves the next step *after* releasing the append
    /// lock (an `fallocate` of up to 4 MiB takes milliseconds), so other writers keep
    /// appending into the space already reserved. Only an append that finds no
    /// reserved room left reserves under the lock, or waits for the extension running.
    /// Likewise the appender that comes within half a write window of the pages mapped
    /// writable maps the next window, after releasing the lock.
    pub(crate) fn append(
        &self,
        record: &StoredRecord<'_>,
        tee: Option<Tee<'_, '_>>,
    ) -> io::Result<Appended> {
        let len = record.encoded_len() as u64;
        let mut state = self.append.lock();
        let (offset, end) = loop {
            if state.sealed {
                return Ok(Appended::Full);
            }
            let offset = self.published.load(Ordering::Relaxed);
            let end = offset + len;
            if end > self.file.capacity() {
                state.sealed = true;
                return Ok(Appended::Full);
            }
            if end <= state.allocated {
                break (offset, end);
            }
            if state.extending {
                self.extended.wait(&mut state);
                continue;
            }
            let new_allocated = self.next_allocation(state.allocated).max(end);
            self.file
                .allocate(state.allocated, new_allocated - state.allocated)?;
            state.allocated = new_allocated;
        };
        match tee {
            None => self
                .file
                .write_with(offset, len as usize, &mut |out| record.encode_into(out)),
            Some(tee) => self.file.write_with(offset, len as usize, &mut |out| {
                record.encode_into(out);
                tee(out);
            }),
        }
        debug_assert!(record::decode(self.file.read(offset, len as usize)).is_ok());
        self.published.store(end, Ordering::Release);
        let newly_dirty = !state.dirty;
        state.dirty = true;
        let extend = (!state.extending
            && state.allocated < self.file.capacity()
            && state.allocated - end < self.step(state.allocated) / 2)
            .then(|| {
                state.extending = true;
                (state.allocated, self.next_allocation(state.allocated))
            });
        let prepare = (!state.preparing
            && end + WRITE_WINDOW / 2 > state.prepared
            && state.prepared.max(end) < state.allocated)
            .then(|| {
                state.preparing = true;
                let from = state.prepared.max(end);
                (from, (from + WRITE_WINDOW).min(state.allocated))
            });
        drop(state);
        if let Some((from, to)) = prepare {
            // Outside the lock: mapping the window takes a fault per page.
            self.file.prepare_write(from, to - from);
            let mut state = self.append.lock();
            state.prepared = state.prepared.max(to);
            state.preparing = false;
        }
        if let Some((from, to)) = extend {
            // A failure here is not this append's: it is written. The next append
            // that finds no room reserves under the lock and reports the error.
            let reserved = match self.file.allocate_ahead(from, to - from) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(file = %self.path.display(), error = %e, "could not reserve the next step of a segment ahead of need");
                    false
                }
            };
            let mut state = self.append.lock();
            if reserved {
                state.allocated = state.allocated.max(to);
            }
            state.extending = false;
            drop(state);
            self.extended.notify_all();
        }
        // Offsets fit in u32: capacity is at most SEGMENT_SIZE_BYTES_MAX.
        Ok(Appended::At {
            offset: offset as u32,
            newly_dirty,
        })
    }

    /// The size of the reservation step after `allocated` bytes: doubling from 64 KiB
    /// up to 4 MiB.
    fn step(&self, allocated: u64) -> u64 {
        allocated.clamp(ALLOCATE_STEP_MIN, ALLOCATE_STEP_MAX)
    }

    /// The reserved length after one more step, within the capacity.
    fn next_allocation(&self, allocated: u64) -> u64 {
        (allocated + self.step(allocated)).min(self.file.capacity())
    }

    /// Stops appends to this segment (its bucket is retired or it is being closed).
    pub(crate) fn seal(&self) {
        let mut state = self.append.lock();
        // An extension running outside the lock must end first: sealing comes before
        // trimming the file at close, and a late `fallocate` would grow it again.
        while state.extending {
            self.extended.wait(&mut state);
        }
        state.sealed = true;
    }

    /// Bytes reserved on disk for this segment.
    pub(crate) fn allocated(&self) -> u64 {
        self.append.lock().allocated
    }

    /// Making every published record durable, first half (commit thread only): takes
    /// the published length to make durable, starts writing its pages back, and
    /// returns what `finish_sync` must be given. The commit thread starts every dirty
    /// segment before finishing any, so their writes reach the disk together instead
    /// of one fsync after another.
    pub(crate) fn start_sync(&self) -> u64 {
        let published = {
            let mut state = self.append.lock();
            state.dirty = false;
            self.published.load(Ordering::Relaxed)
        };
        // Pages written through the map are write-protected by the sync, one TLB
        // shootdown (an IPI to every core running a writer) per page; unmapping the
        // fully written ones first costs one shootdown for the whole range. Bytes below
        // `published` are never written again.
        let released = self.released.load(Ordering::Relaxed);
        if published > released {
            self.file.release_written(released, published - released);
            self.released.store(published, Ordering::Relaxed);
        }
        self.file.start_writeback();
        published
    }

    /// Making every published record durable, second half: waits until the
    /// `published` bytes `start_sync` returned are durable.
    pub(crate) fn finish_sync(&self, published: u64) -> io::Result<()> {
        self.file.sync_data()?;
        self.durable.fetch_max(published, Ordering::AcqRel);
        Ok(())
    }

    /// The verified record at `offset`; an error if it fails its checksum.
    ///
    /// One slice of the published log, up to the longest record a segment can hold,
    /// and one decode: the decoder checks the record's own length against the slice
    /// (the header is decoded once, not once here and again in the decoder).
    pub(crate) fn read(&self, offset: u32) -> Result<StoredRecord<'_>, &'static str> {
        let published = self.published();
        let offset = u64::from(offset);
        if offset + record::HEADER_LEN as u64 > published {
            return Err("record offset beyond the published log");
        }
        let available = (published - offset).min(record::RECORD_LEN_MAX as u64) as usize;
        match record::decode(self.file.read(offset, available)) {
            Ok((record, _)) => Ok(record),
            Err(record::DecodeError::Truncated) => Err("record runs past the published log"),
            Err(record::DecodeError::Invalid(reason)) => Err(reason),
        }
    }

    /// Sets the valid length of a recovered (sealed) segment.
    pub(crate) fn set_recovered_len(&self, len: u64) {
        let mut state = self.append.lock();
        debug_assert!(state.sealed);
        state.allocated = len;
        self.published.store(len, Ordering::SeqCst);
        self.durable.store(len, Ordering::SeqCst);
    }
}
