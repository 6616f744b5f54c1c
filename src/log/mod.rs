//! The append-only log: segment files grouped by expiry bucket.
//!
//! Every record of a key goes to a bucket whose deadline is at least that of the key's
//! previous record, so deleting a whole bucket can never bring an older state back.

pub(crate) mod commit;
mod directory;
pub(crate) mod reader;
pub(crate) mod segment;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crossbeam_utils::CachePadded;
use parking_lot::{Mutex, RwLock};

pub(crate) use crate::addr::{Location, SegmentSlot};
use crate::addr::{ReadersDrained, SEGMENT_SLOTS_MAX};
use crate::error::Error;
use crate::format::record::StoredRecord;
use crate::format::segment_header::SegmentHeader;
use crate::index::{Drained, Shard};
use crate::io::Vfs;
use crate::poison::Poison;
use directory::Directory;
pub(crate) use segment::{Appended, Segment, Tee};

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
    /// after the reaper removed the index entries pointing into it and readers were
    /// drained (`Log::delete_segments`).
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

    /// Takes the segment out of its slot; the slot stays reserved until `free`.
    fn take(&mut self, slot: SegmentSlot) -> Option<Arc<Segment>> {
        self.slots.get_mut(slot.0 as usize)?.take()
    }

    /// Makes a slot emptied by `take` reusable.
    fn free(&mut self, slot: SegmentSlot) {
        debug_assert!(self.get(slot).is_none());
        self.free.push(slot.0);
    }
}

/// What the log holds (`Log::usage`).
#[derive(Debug, Default)]
pub(crate) struct LogUsage {
    pub segments: u64,
    pub buckets: u64,
    /// Disk space reserved by segment files.
    pub disk_bytes: u64,
    /// Bytes of records.
    pub log_bytes: u64,
    /// The earliest bucket deadline of any segment (`u64::MAX` with none).
    pub oldest_deadline_ms: u64,
}

/// What `Log::append` did.
pub(crate) enum AppendOutcome {
    At(Location),
    /// The bucket's deadline has passed and the reaper retired it: recompute the
    /// deadline with a fresh clock reading and try again.
    Retired,
}

/// A stripe's cached active segment and its bucket deadline.
type ActiveSegment = Option<(u64, Arc<Segment>)>;

pub(crate) struct Log {
    pub dir: PathBuf,
    vfs: Arc<dyn Vfs>,
    segment_size_bytes: u64,
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
    /// The store's sticky failure: set by a failed sync, refuses all writes.
    poison: Arc<Poison>,
    /// The store closed: every segment is sealed and no new one may be opened.
    closed: AtomicBool,
}

impl Log {
    pub(crate) fn new(
        dir: PathBuf,
        vfs: Arc<dyn Vfs>,
        poison: Arc<Poison>,
        segment_size_bytes: u64,
        bucket_width_ms: u64,
        stripes: usize,
        next_seq: u64,
    ) -> Log {
        debug_assert!(stripes >= 1);
        Log {
            dir,
            vfs,
            segment_size_bytes,
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
            poison,
            closed: AtomicBool::new(false),
        }
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

    /// Raises the next segment sequence after recovery (never lowers it: the cold
    /// tier's rows name segments by sequence, and one that expired must never have
    /// its number taken by a new segment).
    pub(crate) fn set_next_seq(&self, seq: u64) {
        self.next_seq.fetch_max(seq, Ordering::Relaxed);
    }

    /// Appends `record` to the calling thread's stripe of the active segments of the
    /// bucket `deadline_ms`. `tee` is handed the encoded bytes of the record once it is
    /// written (never for an append that fails or finds the bucket retired).
    pub(crate) fn append(
        &self,
        deadline_ms: u64,
        now_ms: u64,
        record: &StoredRecord<'_>,
        mut tee: Option<Tee<'_, '_>>,
    ) -> Result<AppendOutcome, Error> {
        self.poison.check()?;
        let stripe = thread_stripe(self.stripes);
        let mut cache = self.stripe_cache[stripe].lock();
        let cache = &mut *cache;
        // Fast path: no table lock. A retired bucket's segments are sealed under their
        // append lock before the reaper scans them, so an append here either lands
        // before the scan or finds the segment sealed and takes the slow path.
        if let Some((cached_deadline, segment)) = cache.as_ref()
            && *cached_deadline == deadline_ms
            && let Some(location) = self.append_to(segment, record, tee.as_deref_mut())?
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
                    Some(segment) => match self.append_to(segment, record, tee.as_deref_mut())? {
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
        record: &StoredRecord<'_>,
        tee: Option<Tee<'_, '_>>,
    ) -> Result<Option<Location>, Error> {
        match segment.append(record, tee) {
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
            let path = self
                .dir
                .join(crate::layout::segment_file_name(deadline_ms, seq));
            match self.vfs.create_segment(&path, self.segment_size_bytes) {
                Ok(file) => break (seq, path, file),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && taken < 64 => {
                    taken += 1;
                }
                Err(e) => return Err(Error::io("creating segment", &path, e)),
            }
        };
        let header = SegmentHeader {
            version: crate::format::segment_header::VERSION,
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

    /// Calls `f` with the verified record at `location`, which an index entry names.
    /// `_held` is the caller's locked shard: the proof, checked by the borrow, that
    /// this read finishes before any segment it could name is freed (a segment is
    /// freed only after `Index::drain_readers` took every shard lock).
    pub(crate) fn with_record<R>(
        &self,
        _held: &Shard,
        location: Location,
        f: impl FnOnce(&Segment, StoredRecord<'_>) -> R,
    ) -> Result<R, Error> {
        let read = |segment: &Segment| match segment.read(location.offset) {
            Ok(record) => Ok(f(segment, record)),
            Err(reason) => Err(Error::corruption(
                &segment.path,
                u64::from(location.offset),
                reason,
            )),
        };
        // SAFETY: `_held` borrows a `Shard`, reachable only through its mutex guard
        // (or, in recovery, the same guard), so a shard lock is held for this whole
        // call; segments leave the directory only through `unpublish` +
        // `delete_segments`, which requires `ReadersDrained`, made after every shard
        // lock was taken once following the slot's clearing.
        let found = unsafe { self.directory.with(location.slot, read) };
        found.unwrap_or_else(|| {
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
        if crate::planted::planted("skip-dir-fsync") {
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
                if crate::planted::planted("ignore-fsync-error") {
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

    /// Takes a retired segment out of the directory and the segment table: no new
    /// read can find it. The returned handle keeps its memory and its slot until
    /// `delete_segments`.
    pub(crate) fn unpublish(&self, segment: &Segment) -> Unpublished {
        let mut table = self.table.write();
        self.directory.clear(segment.slot);
        Unpublished(table.take(segment.slot))
    }

    /// Deletes unpublished segments: calls `drain` (the index's grace period, which
    /// alone can make its proof) once they are all out of the directory, then frees
    /// their slots, deletes their files and lets their memory go. Returns what `drain`
    /// returned and the first deletion error; every segment is released either way.
    pub(crate) fn delete_segments(
        &self,
        segments: Vec<Unpublished>,
        drain: impl FnOnce() -> Drained,
    ) -> (Drained, Result<(), Error>) {
        let drained = drain();
        let mut result = Ok(());
        for mut unpublished in segments {
            let Some(segment) = unpublished.0.take() else {
                continue;
            };
            self.table.write().free(segment.slot);
            tracing::debug!(
                seq = segment.seq,
                deadline_ms = segment.deadline_ms,
                "deleting expired segment"
            );
            self.dir_dirty.store(true, Ordering::SeqCst);
            match self.vfs.remove(&segment.path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    if result.is_ok() {
                        result = Err(Error::io("deleting expired segment", &segment.path, e));
                    }
                }
            }
            // Readers are drained (`drained.proof`): this handle may be the last.
            release(segment, &drained.proof);
        }
        (drained, result)
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

    /// What the log holds now, for `Stats`.
    pub(crate) fn usage(&self) -> LogUsage {
        let table = self.table.read();
        let mut usage = LogUsage {
            buckets: table.buckets.len() as u64,
            oldest_deadline_ms: u64::MAX,
            ..LogUsage::default()
        };
        for segment in table.segments() {
            usage.segments += 1;
            usage.disk_bytes += segment.allocated();
            usage.log_bytes += segment.published();
            usage.oldest_deadline_ms = usage.oldest_deadline_ms.min(segment.deadline_ms);
        }
        usage
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

/// A segment taken out of the directory by `Log::unpublish`. A read that loaded its
/// pointer before may still be using it, so its memory must stay until the readers
/// are drained: only `Log::delete_segments` releases it. Dropped any other way (an
/// unwinding panic), it leaks the segment rather than free memory a reader may hold.
pub(crate) struct Unpublished(Option<Arc<Segment>>);

impl Drop for Unpublished {
    fn drop(&mut self) {
        if let Some(segment) = self.0.take() {
            tracing::error!(
                file = %segment.path.display(),
                "an unpublished segment was dropped before readers were drained: leaked"
            );
            std::mem::forget(segment);
        }
    }
}

/// Drops a segment handle once readers are drained.
fn release(segment: Arc<Segment>, _drained: &ReadersDrained) {
    drop(segment);
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
