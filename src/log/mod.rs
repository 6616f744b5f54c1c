//! The append-only log: segment files grouped by expiry bucket.
//!
//! Every record of a key goes to a bucket whose deadline is at least that of the key's
//! previous record, so deleting a whole bucket can never bring an older state back.

pub(crate) mod commit;
pub(crate) mod reader;
pub(crate) mod segment;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

use crate::error::Error;
use crate::format::record::Record;
use crate::format::segment_header::{self, SegmentHeader};
use crate::index::SEGMENT_SLOTS_MAX;
use crate::io::Vfs;
pub(crate) use segment::{Appended, Location, Segment, SegmentSlot};

/// The segments of one expiry bucket.
#[derive(Default)]
pub(crate) struct Bucket {
    pub segments: Vec<SegmentSlot>,
    /// The segments new records of this bucket go to, one per stripe: shards append
    /// to the stripe of their index, so concurrent writers rarely share an append lock.
    pub active: Vec<Option<SegmentSlot>>,
}

#[derive(Default)]
pub(crate) struct SegmentTable {
    slots: Vec<Option<Arc<Segment>>>,
    free: Vec<u32>,
    pub buckets: BTreeMap<u64, Bucket>,
}

impl SegmentTable {
    pub(crate) fn get(&self, slot: SegmentSlot) -> Option<&Arc<Segment>> {
        self.slots.get(slot.0 as usize).and_then(Option::as_ref)
    }

    pub(crate) fn segments(&self) -> impl Iterator<Item = &Arc<Segment>> {
        self.slots.iter().flatten()
    }

    /// A free slot. A slot is reused only after its segment was deleted, which happens
    /// after every index entry pointing into it was removed and every stripe dropped
    /// its cached handle (`Log::forget_active_through`).
    fn next_slot(&mut self) -> Result<SegmentSlot, Error> {
        if let Some(slot) = self.free.pop() {
            return Ok(SegmentSlot(slot));
        }
        self.check_room()?;
        self.slots.push(None);
        Ok(SegmentSlot((self.slots.len() - 1) as u32))
    }

    /// An error if no slot is free and none can be added.
    fn check_room(&self) -> Result<(), Error> {
        if self.free.is_empty() && self.slots.len() >= SEGMENT_SLOTS_MAX {
            return Err(Error::invalid_option(format!(
                "the store holds {} segments, the most it can; use a wider bucket_width so fewer buckets are live at once",
                self.slots.len()
            )));
        }
        Ok(())
    }

    fn insert(&mut self, segment: Arc<Segment>, active_stripe: Option<usize>) {
        let slot = segment.slot;
        let bucket = self.buckets.entry(segment.deadline_ms).or_default();
        bucket.segments.push(slot);
        if let Some(stripe) = active_stripe {
            if bucket.active.len() <= stripe {
                bucket.active.resize(stripe + 1, None);
            }
            bucket.active[stripe] = Some(slot);
        }
        self.slots[slot.0 as usize] = Some(segment);
    }

    fn remove(&mut self, slot: SegmentSlot) -> Option<Arc<Segment>> {
        let segment = self.slots.get_mut(slot.0 as usize)?.take()?;
        self.free.push(slot.0);
        Some(segment)
    }
}

/// What `Log::append` did.
pub(crate) enum AppendOutcome {
    At(Location),
    /// The bucket's deadline has passed and the reaper retired it: recompute the
    /// deadline with a fresh clock reading and try again.
    Retired,
}

/// Slots per chunk of the segment directory.
const DIRECTORY_CHUNK: usize = 1024;

/// A lock-free view of the segment table's slots, for reads through an index entry:
/// the hot path then touches no shared lock word (the table's `RwLock` is a cache
/// line every reader writes). Chunks are allocated on first use and live as long as
/// the log.
///
/// A slot holds `Arc::as_ptr` of the segment the table owns, set when the segment is
/// inserted and cleared before the table drops it.
struct Directory {
    chunks: Box<[OnceLock<DirectoryChunk>]>,
}

/// `DIRECTORY_CHUNK` slots.
type DirectoryChunk = Box<[AtomicPtr<Segment>]>;

impl Directory {
    fn new() -> Directory {
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

    fn set(&self, segment: &Arc<Segment>) {
        self.slot(segment.slot)
            .store(Arc::as_ptr(segment).cast_mut(), Ordering::Release);
    }

    fn clear(&self, slot: SegmentSlot) {
        self.slot(slot)
            .store(std::ptr::null_mut(), Ordering::Release);
    }

    /// Calls `f` with the segment in `slot`, if any.
    ///
    /// The caller must hold (or own, during recovery) the index shard whose entry
    /// names `slot`. That makes the dereference sound: a segment leaves the table
    /// only in `Log::delete_segment`, which the reaper calls after it removed every
    /// entry pointing into the segment, each under its shard's lock. While the
    /// caller's shard still holds an entry naming `slot`, that has not happened, so
    /// the table's `Arc` keeps the segment alive for the whole call.
    fn with<R>(&self, slot: SegmentSlot, f: impl FnOnce(&Segment) -> R) -> Option<R> {
        let chunk = self.chunks.get(slot.0 as usize / DIRECTORY_CHUNK)?.get()?;
        let pointer = chunk[slot.0 as usize % DIRECTORY_CHUNK].load(Ordering::Acquire);
        if pointer.is_null() {
            return None;
        }
        // SAFETY: non-null pointers in the directory come from `Arc::as_ptr` of a
        // segment the table holds, and stay valid while it does (see above).
        Some(f(unsafe { &*pointer }))
    }
}

/// A stripe's cached active segment and its bucket deadline.
type ActiveSegment = Option<(u64, Arc<Segment>)>;

pub(crate) struct Log {
    pub dir: PathBuf,
    vfs: Arc<dyn Vfs>,
    segment_capacity: u64,
    bucket_width_ms: u64,
    /// Active segments per bucket (at most the number of shards).
    stripes: usize,
    /// Per stripe, the segment it last appended to, by bucket deadline: appends skip
    /// the segment table's lock. A thread appends to its own stripe, so this lock and
    /// the segment's tail stay in that core's cache.
    stripe_cache: Box<[CachePadded<Mutex<ActiveSegment>>]>,
    pub table: RwLock<SegmentTable>,
    directory: Directory,
    next_seq: AtomicU64,
    /// Buckets with a deadline at or before this are retired: no appends.
    retired_through_ms: AtomicU64,
    /// Segments with unsynced writes, for the commit thread.
    dirty: Mutex<Vec<Arc<Segment>>>,
    /// A file was created or removed since the last directory sync.
    dir_dirty: AtomicBool,
    /// A write or sync failed: refuse all writes.
    poisoned: AtomicBool,
    /// The store closed: every segment is sealed and no new one may be opened.
    closed: AtomicBool,
}

impl Log {
    pub(crate) fn new(
        dir: PathBuf,
        vfs: Arc<dyn Vfs>,
        segment_capacity: u64,
        bucket_width_ms: u64,
        stripes: usize,
        next_seq: u64,
    ) -> Log {
        debug_assert!(stripes >= 1);
        Log {
            dir,
            vfs,
            segment_capacity,
            bucket_width_ms,
            stripes,
            stripe_cache: (0..stripes)
                .map(|_| CachePadded::new(Mutex::new(None)))
                .collect(),
            table: RwLock::new(SegmentTable::default()),
            directory: Directory::new(),
            next_seq: AtomicU64::new(next_seq),
            retired_through_ms: AtomicU64::new(0),
            dirty: Mutex::new(Vec::new()),
            dir_dirty: AtomicBool::new(false),
            poisoned: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        }
    }

    /// The bucket deadline of a record written at `now_ms` that must be remembered
    /// until at least `until_ms`: `until_ms` rounded up to `deadline_rounding_ms`.
    pub(crate) fn bucket_deadline(&self, now_ms: u64, until_ms: u64) -> u64 {
        let rounding = deadline_rounding_ms(self.bucket_width_ms, until_ms.saturating_sub(now_ms));
        let deadline = until_ms.div_ceil(rounding).saturating_mul(rounding);
        #[cfg(feature = "planted-bugs")]
        if crate::testing::planted("early-expiry") {
            return deadline - rounding;
        }
        deadline
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    pub(crate) fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    /// Registers a segment recovered at open; returns its slot.
    pub(crate) fn add_recovered(
        &self,
        make: impl FnOnce(SegmentSlot) -> Segment,
    ) -> Result<SegmentSlot, Error> {
        let mut table = self.table.write();
        let slot = table.next_slot()?;
        let segment = Arc::new(make(slot));
        self.directory.set(&segment);
        table.insert(segment, None);
        Ok(slot)
    }

    /// Sets where a recovered segment's valid records end, and trims what lies after
    /// (a torn tail or unused preallocated space).
    pub(crate) fn set_recovered_len(&self, slot: SegmentSlot, len: u64) {
        let table = self.table.read();
        if let Some(segment) = table.get(slot) {
            segment.set_recovered_len(len);
            if segment.file.capacity() > len
                && let Err(e) = segment.file.truncate(len)
            {
                tracing::warn!(file = %segment.path.display(), error = %e, "could not trim a recovered segment");
            }
        }
    }

    /// Sets the next segment sequence after recovery.
    pub(crate) fn set_next_seq(&self, seq: u64) {
        self.next_seq.store(seq, Ordering::Relaxed);
    }

    /// Appends `record` to the calling thread's stripe of the active segments of the
    /// bucket `deadline_ms`.
    pub(crate) fn append(
        &self,
        deadline_ms: u64,
        now_ms: u64,
        record: &Record<'_>,
    ) -> Result<AppendOutcome, Error> {
        if self.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let stripe = thread_stripe(self.stripes);
        let mut cache = self.stripe_cache[stripe].lock();
        let cache = &mut *cache;
        // Fast path: no table lock. A retired bucket's segments are sealed under their
        // append lock before the reaper scans them, so an append here either lands
        // before the scan or finds the segment sealed and takes the slow path.
        if let Some((cached_deadline, segment)) = cache.as_ref()
            && *cached_deadline == deadline_ms
            && let Some(location) = self.append_to(segment, record)?
        {
            return Ok(AppendOutcome::At(location));
        }
        loop {
            let full_slot = {
                let table = self.table.read();
                if deadline_ms <= self.retired_through_ms.load(Ordering::Acquire) {
                    return Ok(AppendOutcome::Retired);
                }
                let active = table
                    .buckets
                    .get(&deadline_ms)
                    .and_then(|b| b.active.get(stripe).copied().flatten());
                match active.and_then(|slot| table.get(slot)) {
                    Some(segment) => match self.append_to(segment, record)? {
                        Some(location) => {
                            *cache = Some((deadline_ms, Arc::clone(segment)));
                            return Ok(AppendOutcome::At(location));
                        }
                        None => Some(segment.slot),
                    },
                    None => None,
                }
            };
            self.open_segment(deadline_ms, now_ms, stripe, full_slot)?;
        }
    }

    /// Appends to `segment`; `None` if it is full or sealed.
    fn append_to(
        &self,
        segment: &Arc<Segment>,
        record: &Record<'_>,
    ) -> Result<Option<Location>, Error> {
        match segment.append(record) {
            Ok(Appended::At {
                offset,
                newly_dirty,
            }) => {
                if newly_dirty {
                    self.dirty.lock().push(Arc::clone(segment));
                }
                Ok(Some(Location {
                    slot: segment.slot,
                    offset,
                }))
            }
            Ok(Appended::Full) => Ok(None),
            Err(e) => Err(Error::io("reserving space in", &segment.path, e)),
        }
    }

    /// Makes a new active segment for `deadline_ms`, unless another thread already
    /// replaced `full_slot` (the active segment that was found full, if any).
    fn open_segment(
        &self,
        deadline_ms: u64,
        now_ms: u64,
        stripe: usize,
        full_slot: Option<SegmentSlot>,
    ) -> Result<(), Error> {
        let mut table = self.table.write();
        if self.closed.load(Ordering::Acquire) {
            // Closing sealed every segment: an append that raced with close ends here.
            return Err(Error::Closed);
        }
        if deadline_ms <= self.retired_through_ms.load(Ordering::Acquire) {
            return Ok(()); // append() will see the retirement
        }
        let active = table
            .buckets
            .get(&deadline_ms)
            .and_then(|b| b.active.get(stripe).copied().flatten());
        if active.is_some() && active != full_slot {
            return Ok(());
        }
        table.check_room()?;
        // A name may be taken once the sequence wrapped (a file found at open named with
        // a seq near u64::MAX): skip to the next seq, a bounded number of times.
        let mut taken = 0;
        let (seq, path, file) = loop {
            let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
            let path = self.dir.join(segment_header::file_name(deadline_ms, seq));
            match self.vfs.create_segment(&path, self.segment_capacity) {
                Ok(file) => break (seq, path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && taken < 64 => {
                    taken += 1;
                }
                Err(e) => return Err(Error::io("creating segment", &path, e)),
            }
        };
        let header = SegmentHeader {
            bucket_deadline_ms: deadline_ms,
            segment_seq: seq,
            created_ms: now_ms,
            bucket_width_ms: self.bucket_width_ms,
        };
        let allocated = match Segment::initialize(file.as_ref(), &header) {
            Ok(allocated) => allocated,
            Err(e) => {
                let _ = self.vfs.remove(&path);
                return Err(Error::io("reserving space in", &path, e));
            }
        };
        self.dir_dirty.store(true, Ordering::SeqCst);
        let slot = table.next_slot()?;
        let segment = Arc::new(Segment::new_active(
            slot,
            seq,
            deadline_ms,
            path,
            file,
            allocated,
        ));
        self.dirty.lock().push(Arc::clone(&segment));
        self.directory.set(&segment);
        table.insert(segment, Some(stripe));
        tracing::debug!(deadline_ms, seq, "opened segment");
        Ok(())
    }

    /// Calls `f` with the verified record at `location`, which an index entry names:
    /// the caller holds (or, in recovery, owns) that entry's shard.
    pub(crate) fn with_record<R>(
        &self,
        location: Location,
        f: impl FnOnce(&Segment, Record<'_>) -> R,
    ) -> Result<R, Error> {
        let read = |segment: &Segment| match segment.read(location.offset) {
            Ok(record) => Ok(f(segment, record)),
            Err(reason) => Err(Error::corruption(
                &segment.path,
                u64::from(location.offset),
                reason,
            )),
        };
        self.directory.with(location.slot, read).unwrap_or_else(|| {
            Err(Error::corruption(
                &self.dir,
                u64::from(location.offset),
                "index points to a missing segment",
            ))
        })
    }

    /// Syncs every segment with unsynced writes, and the directory if files changed.
    pub(crate) fn sync(&self) -> Result<(), Error> {
        #[cfg(feature = "planted-bugs")]
        if crate::testing::planted("skip-dir-fsync") {
            self.dir_dirty.store(false, Ordering::SeqCst);
        }
        if self.dir_dirty.swap(false, Ordering::SeqCst)
            && let Err(e) = self.vfs.sync_dir(&self.dir)
        {
            self.dir_dirty.store(true, Ordering::SeqCst);
            return Err(Error::io("syncing directory", &self.dir, e));
        }
        let dirty = std::mem::take(&mut *self.dirty.lock());
        let started: Vec<u64> = dirty.iter().map(|segment| segment.start_sync()).collect();
        for (segment, published) in dirty.iter().zip(started) {
            if let Err(e) = segment.finish_sync(published) {
                #[cfg(feature = "planted-bugs")]
                if crate::testing::planted("ignore-fsync-error") {
                    continue;
                }
                return Err(Error::io("syncing segment", &segment.path, e));
            }
        }
        Ok(())
    }

    /// Retires every bucket whose deadline is at or before `now_ms`: no more appends
    /// go to them. Returns their segments, for the reaper to unindex and delete.
    pub(crate) fn retire_through(&self, now_ms: u64) -> Vec<Arc<Segment>> {
        let mut table = self.table.write();
        self.retired_through_ms.fetch_max(now_ms, Ordering::AcqRel);
        let expired: Vec<u64> = table
            .buckets
            .range(..=now_ms)
            .map(|(&deadline, _)| deadline)
            .collect();
        let mut segments = Vec::new();
        for deadline in expired {
            if let Some(bucket) = table.buckets.remove(&deadline) {
                for slot in bucket.segments {
                    if let Some(segment) = table.get(slot) {
                        segment.seal();
                        segments.push(Arc::clone(segment));
                    }
                }
            }
        }
        segments
    }

    /// Drops a retired segment whose records are no longer indexed, and deletes its file.
    pub(crate) fn delete_segment(&self, segment: &Segment) -> Result<(), Error> {
        {
            let mut table = self.table.write();
            self.directory.clear(segment.slot);
            table.remove(segment.slot);
        }
        tracing::debug!(
            seq = segment.seq,
            deadline_ms = segment.deadline_ms,
            "deleting expired segment"
        );
        self.dir_dirty.store(true, Ordering::SeqCst);
        match self.vfs.remove(&segment.path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io("deleting expired segment", &segment.path, e)),
        }
    }

    /// Seals every segment and trims the unused preallocated tails (at close).
    pub(crate) fn seal_all(&self) -> Result<(), Error> {
        // Under the write lock: no segment can be opened after this.
        let table = self.table.write();
        self.closed.store(true, Ordering::Release);
        for segment in table.segments() {
            segment.seal();
            let published = segment.published();
            if segment.file.capacity() > published {
                segment
                    .file
                    .truncate(published)
                    .map_err(|e| Error::io("trimming segment", &segment.path, e))?;
            }
        }
        Ok(())
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// Drops the cached active segments of buckets at or before `deadline_ms`, so a
    /// retired segment is unmapped (and its file's space freed) once deleted.
    pub(crate) fn forget_active_through(&self, deadline_ms: u64) {
        for cache in &self.stripe_cache {
            let mut cache = cache.lock();
            if cache.as_ref().is_some_and(|(d, _)| *d <= deadline_ms) {
                *cache = None;
            }
        }
    }

    pub(crate) fn vfs(&self) -> &dyn Vfs {
        self.vfs.as_ref()
    }
}

/// The step deadlines are rounded up to, for a record that must be remembered for
/// `span_ms` more: the bucket width, or for long spans the largest multiple of it
/// that is at most `span_ms / 1024`. A deadline is then at most
/// `max(bucket_width, span / 1024)` late, and the deadlines of records written with
/// one span over any stretch of time fall in at most ~2,048 buckets per span
/// (a 400-day ttl and 1-minute buckets: 2.3 buckets a day, not 1,440).
pub(crate) fn deadline_rounding_ms(bucket_width_ms: u64, span_ms: u64) -> u64 {
    const SPAN_PER_ROUNDING: u64 = 1024;
    bucket_width_ms * (span_ms / SPAN_PER_ROUNDING / bucket_width_ms).max(1)
}

/// The log stripe the calling thread appends to. Threads are numbered in the order
/// they first append, and take the stripes round-robin: with no more threads than
/// stripes (one per core by default), no two threads share a segment's tail.
fn thread_stripe(stripes: usize) -> usize {
    use std::cell::Cell;
    use std::sync::atomic::AtomicUsize;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static THREAD: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    THREAD.with(|thread| {
        if thread.get() == usize::MAX {
            thread.set(NEXT.fetch_add(1, Ordering::Relaxed));
        }
        thread.get() % stripes
    })
}
