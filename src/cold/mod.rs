//! The cold tier (docs/ARCHITECTURE.md, "The cold tier"): the index entries of old
//! buckets, moved out of the hot tables once the memory budget is exceeded, as
//! immutable generation files (`format::cold_index`) fronted in RAM by a filter and
//! the page fences. Exact: a filter hit reads the page, and every entry with the key's
//! hash is verified against its record's key bytes.
//!
//! Lookups go hot table first (the caller), then the generations newest first; the
//! first generation holding a verified record of the key answers (the newest record
//! among its entries, by lsn). A key's entry moves here only while it is the key's
//! newest, and a later write of the key is hot again, so a newer generation or the hot
//! table always shadows an older entry.
//!
//! Each generation holds an `Arc` of every segment its entries point into, so a record
//! read here is always mapped memory, whatever the reaper did meanwhile: soundness
//! rests on the reference count, never on what a file contains. A generation leaves
//! when every bucket it covers has expired; until then its entries into an expired
//! bucket answer as expired.
//!
//! A store opened again takes the generation files over (`persist`): after a clean
//! close with nothing to replay, after a crash replaying only the records no spill
//! walked. Without a usable `COLD_STATE` it deletes them and rebuilds the index from
//! the log.

mod counts;
mod merge;
mod persist;
mod reconcile;
mod reuse;
mod spill;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::format::cold_index::{self, ColdEntry, Header, PAGE_LEN, Sections};
use crate::format::record::{State, StoredRecord};
use crate::index::{Index, KeyHash};
use crate::io::SegmentFile;
use crate::log::Segment;

pub(crate) use merge::read_pages_ahead;
pub(crate) use reconcile::Screen;
pub(crate) use reuse::{Reused, load};
pub(crate) use spill::release_free_memory;

/// Beyond this many generations, the run of up to three adjacent generations with the
/// fewest entries is merged (`merge::MERGE_WIDTH`; by the merger thread, or inline by
/// `expire_now`).
pub(crate) const GENERATIONS_MAX: usize = 8;

/// Most generations a fresh key's lookup probes: spills wait while a merge brings the
/// count down (a merge of large generations takes minutes; spills go on meanwhile up
/// to this bound, so the hot tier does not grow past the budget for all of it).
pub(crate) const GENERATIONS_LIMIT: usize = 2 * GENERATIONS_MAX;

pub(crate) use counts::RowCounts;

fn new_row_counts(shards: usize) -> Arc<RowCounts> {
    Arc::new(RowCounts::new(shards))
}

/// A segment some of whose records' entries are cold.
pub(crate) struct SpilledSegment {
    pub deadline_ms: u64,
    /// Its records before this offset were walked by a spill.
    pub covered_len: u64,
    pub counts: Arc<RowCounts>,
}

/// One generation file, open.
pub(crate) struct Generation {
    pub number: u64,
    pub path: PathBuf,
    header: Header,
    /// Its header's checksum (bytes 56..64), as the cold state names it.
    header_checksum: u64,
    sections: Sections,
    file: Arc<dyn SegmentFile>,
    /// The segment of each row of the file's segment table; `None` for a segment that
    /// expired and was deleted before this open reused the file (its entries answer
    /// as expired keys do: not found).
    segments: Vec<Option<Arc<Segment>>>,
    /// The states of the keys whose newest entry is here, per segment row: counted in
    /// `Stats` until shadowed by a later write or taken out when the bucket expires.
    counts: Box<[Arc<RowCounts>]>,
    /// One bit per entry (by its position in the file): set once the entry is no
    /// longer its key's newest record, never answered from again, dropped by merges.
    /// Set when a write shadows the entry (under the key's shard lock), and by the
    /// spill for an entry whose key was written while the file was written. This keeps
    /// the tier's invariant: a key has at most one live cold entry, and none while it
    /// has a hot entry (but inside a spill, where the hot entry points at the same
    /// record), so a key whose hot entry expires never finds an older state here.
    dead: Box<[AtomicU64]>,
    /// A trusted entry was killed (only an exact handle's write can do it), or, for a
    /// generation reused at open, some entry is dead and the state does not say which:
    /// its trusted filter still holds the killed key, so approximate answers skip the
    /// generation until a merge rewrites it without its dead entries.
    trust_broken: AtomicBool,
    /// A lookup or a merge met a damaged page here: merges leave the file alone (it
    /// would fail them all), its lookups keep failing on that page, and the next open
    /// rebuilds the tier from the log.
    damaged: AtomicBool,
}

fn dead_bits(entries: u64) -> Box<[AtomicU64]> {
    (0..entries.div_ceil(64))
        .map(|_| AtomicU64::new(0))
        .collect()
}

impl Generation {
    /// The live entries of `hash` with their positions: the filter, the fences, then
    /// each page that may hold it, its checksum verified.
    fn entries(
        &self,
        hash: KeyHash,
        out: &mut Vec<(u64, ColdEntry)>,
    ) -> Result<(), (u64, &'static str)> {
        if !self.sections.may_contain(hash.0) {
            return Ok(());
        }
        let mut found = Vec::new();
        for page in cold_index::pages_for(&self.sections.fences, hash.0) {
            let at = self.header.page_offset(page);
            if at + PAGE_LEN as u64 > self.file.capacity() {
                return Err((at, "cold index page beyond the file"));
            }
            found.clear();
            let bytes = self.file.read(at, PAGE_LEN);
            cold_index::find_in_page(
                &self.header,
                &self.sections,
                page,
                bytes,
                hash.0,
                &mut found,
            )
            .map_err(|e| (at, e.reason()))?;
            let first = u64::from(page) * cold_index::PAGE_ENTRIES as u64;
            for &(i, entry) in &found {
                let position = first + i as u64;
                if !self.is_dead(position) {
                    out.push((position, entry));
                }
            }
        }
        Ok(())
    }

    fn is_dead(&self, position: u64) -> bool {
        self.dead[(position / 64) as usize].load(Ordering::Acquire) & (1 << (position % 64)) != 0
    }

    /// The dead bits as they are now.
    fn dead_snapshot(&self) -> Box<[u64]> {
        self.dead
            .iter()
            .map(|w| w.load(Ordering::Acquire))
            .collect()
    }

    /// The entry at `position` (`trusted`: a trusted one) is no longer its key's
    /// newest record.
    pub(crate) fn kill(&self, position: u64, trusted: bool) {
        if trusted {
            self.trust_broken.store(true, Ordering::Release);
        }
        self.dead[(position / 64) as usize].fetch_or(1 << (position % 64), Ordering::AcqRel);
    }

    /// Whether an approximate lookup may answer from its trusted filter at `now_ms`:
    /// it has one, every bucket it points into is live, and no trusted entry is dead.
    fn trusted_at(&self, now_ms: u64) -> bool {
        !self.sections.trusted.is_empty()
            && self.first_deadline_ms() > now_ms
            && !self.trust_broken.load(Ordering::Acquire)
    }

    /// The earliest bucket deadline any of its entries points into.
    fn first_deadline_ms(&self) -> u64 {
        self.sections
            .segments
            .iter()
            .map(|s| s.bucket_deadline_ms)
            .min()
            .unwrap_or(0)
    }

    /// The latest bucket deadline any of its entries points into.
    fn last_deadline_ms(&self) -> u64 {
        self.sections
            .segments
            .iter()
            .map(|s| s.bucket_deadline_ms)
            .max()
            .unwrap_or(0)
    }

    /// Bytes this generation keeps in RAM: the filter, the fences, the segment table,
    /// the dead-entry bits.
    fn ram_bytes(&self) -> u64 {
        (self.sections.filter.bytes()
            + self.sections.trusted.bytes()
            + self.sections.fences.len() * 8
            + self.sections.segments.len() * (24 + 16)
            + self.dead.len() * 8) as u64
    }

    pub(crate) fn entry_count(&self) -> u64 {
        self.header.entry_count
    }

    /// A key of `state` in shard `shard` now has its newest entry here, in row `row`
    /// (under the shard's lock).
    fn count_add(&self, row: usize, shard: usize, state: State) {
        self.counts[row].add(shard, state);
    }

    /// The key of `state` in shard `shard` whose entry in row `row` was found is
    /// written again (under the shard's lock, which takes the key out of its own
    /// counts): the segment's expiry must not take it out again. Saturating: an
    /// expired row's counts may have been taken out already.
    /// Returns whether it was counted (false once the segment expired: its keys were
    /// taken out of the shard's counts then).
    pub(crate) fn count_sub(&self, row: usize, shard: usize, state: State) -> bool {
        self.counts[row].sub(shard, state)
    }
}

/// Maps a generation file for lookups: read one page each, in no order (`open_segment`
/// maps it for random reads; a merge, `verify` and `read_head` ask for their pages
/// ahead).
pub(crate) fn open_generation_file(
    vfs: &dyn crate::io::Vfs,
    path: &std::path::Path,
) -> Result<Arc<dyn SegmentFile>, crate::error::Error> {
    vfs.open_segment(path)
        .map_err(|e| crate::error::Error::io("opening a cold index file", path, e))
}

/// A generation file's header, its header checksum and its sections, checked: the
/// file is as long as its header says and every checksum holds (pages are not read).
/// `Err((offset, reason))` otherwise. The open that reuses a file and `verify` both
/// start here.
pub(crate) fn read_head(
    file: &dyn SegmentFile,
) -> Result<(Header, u64, Sections), (u64, &'static str)> {
    if file.capacity() < cold_index::HEADER_LEN as u64 {
        return Err((0, "cold index file shorter than its header"));
    }
    let head = file.read(0, cold_index::HEADER_LEN);
    let header = cold_index::decode_header(head).map_err(|e| (0, e.reason()))?;
    if header.file_len() != file.capacity() {
        return Err((0, "cold index file length disagrees with its header"));
    }
    let at = header.sections_offset();
    // Read in order (and ahead, also in a file opened to be read randomly).
    file.read_soon(at, header.sections_len());
    let sections =
        cold_index::decode_sections(&header, file.read(at, header.sections_len() as usize))
            .map_err(|e| (at, e.reason()))?;
    Ok((header, crate::format::read_u64(head, 56), sections))
}

/// A key's newest record found in a generation.
#[derive(Clone)]
pub(crate) struct ColdHit {
    pub generation: Arc<Generation>,
    /// The row of the generation's segment table the record is in.
    pub row: usize,
    pub offset: u32,
    /// The entry's position in the generation (`Generation::kill`).
    pub position: u64,
    /// The entry is trusted (`Generation::kill`).
    pub trusted: bool,
}

impl ColdHit {
    pub(crate) fn segment(&self) -> &Arc<Segment> {
        self.generation.segments[self.row]
            .as_ref()
            .expect("a hit is in a row with its segment")
    }

    /// The record (it was verified when found; the segment is held by the generation).
    pub(crate) fn record(&self) -> Result<StoredRecord<'_>, &'static str> {
        self.segment().read(self.offset)
    }
}

/// What the cold tier holds and did, for `Stats`.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct ColdStats {
    pub generations: u64,
    pub keys: u64,
    pub ram_bytes: u64,
    pub disk_bytes: u64,
    pub spills: u64,
    pub merges: u64,
    pub spilled_keys: u64,
    pub reused_at_open: u64,
    pub rebuilt_at_open: u64,
    pub damaged_pages: u64,
}

/// The cold tier of one store.
pub(crate) struct ColdTier {
    /// Oldest first.
    generations: RwLock<Vec<Arc<Generation>>>,
    /// Any generation: the hot path's one check when none is.
    any: AtomicBool,
    next_generation: AtomicU64,
    /// Per segment with spilled entries (by seq): how far its records are covered
    /// and its keys' counts, shared by every generation holding a row of it.
    spilled: Mutex<std::collections::HashMap<u64, SpilledSegment>>,
    /// Held by the spills of a round; `true` after close (no spill runs after it).
    working: Mutex<bool>,
    /// Held by a merge; `true` after close (no merge runs after it).
    merging: Mutex<bool>,
    /// Held while a cold state is written, while a spill runs and while a merge
    /// publishes its file and carries late kills over, so a state never copies a
    /// half-published change; `true` after close (only close's own state is written).
    publishing: Mutex<bool>,
    /// Namespaces opened with `Policy::approximate` (this open): a spill marks their
    /// keys' entries trusted.
    trusted_namespaces: RwLock<std::collections::HashSet<u32>>,
    /// Close began: a running merge gives up at its next page.
    stopping: AtomicBool,
    /// Wakes the merger thread (a spill left more than `GENERATIONS_MAX`, or close).
    merge_wake: parking_lot::Condvar,
    /// The files of generations that left the tier, deleted once a cold state that
    /// does not list them is written (`write_state`).
    leaving: Mutex<Vec<PathBuf>>,
    /// The tier changed (a spill, merge or dropped generation) since the last cold
    /// state was written.
    dirty: AtomicBool,
    /// The highest source offset of each partition `(namespace id, partition)` among
    /// the records spills walked: an open that skips them learns it from the state.
    covered_offsets: Mutex<std::collections::HashMap<(u32, u32), u64>>,
    spills: AtomicU64,
    merges: AtomicU64,
    spilled_keys: AtomicU64,
    /// Generations this open took over from an earlier one.
    reused: AtomicU64,
    /// Generation files this open found but could not reuse (deleted; the index was
    /// rebuilt from the log).
    rebuilt: AtomicU64,
    /// Damaged pages lookups met; after the first, no cold state is written again.
    damaged_pages: AtomicU64,
    dir: PathBuf,
    vfs: Arc<dyn crate::io::Vfs>,
    read_only: bool,
    /// The exact filters it writes have 16-bit fingerprints (`cold_filter_bits`).
    wide_filters: bool,
}

impl ColdTier {
    pub(crate) fn new(
        dir: PathBuf,
        vfs: Arc<dyn crate::io::Vfs>,
        read_only: bool,
        wide_filters: bool,
    ) -> ColdTier {
        ColdTier {
            generations: RwLock::new(Vec::new()),
            any: AtomicBool::new(false),
            next_generation: AtomicU64::new(1),
            spilled: Mutex::new(std::collections::HashMap::new()),
            working: Mutex::new(false),
            merging: Mutex::new(false),
            publishing: Mutex::new(false),
            trusted_namespaces: RwLock::new(std::collections::HashSet::new()),
            stopping: AtomicBool::new(false),
            merge_wake: parking_lot::Condvar::new(),
            leaving: Mutex::new(Vec::new()),
            dirty: AtomicBool::new(false),
            covered_offsets: Mutex::new(std::collections::HashMap::new()),
            spills: AtomicU64::new(0),
            merges: AtomicU64::new(0),
            spilled_keys: AtomicU64::new(0),
            reused: AtomicU64::new(0),
            rebuilt: AtomicU64::new(0),
            damaged_pages: AtomicU64::new(0),
            dir,
            vfs,
            read_only,
            wide_filters,
        }
    }

    /// Whether any generation exists (a relaxed hint; lookups take the lock).
    #[inline]
    pub(crate) fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    /// The key's newest cold record: generations newest first, the first one with a
    /// verified record of the key answers (its highest lsn). `is_key` compares a
    /// record's key with the caller's. A damaged page is an error naming the file.
    pub(crate) fn find(
        &self,
        hash: KeyHash,
        mut is_key: impl FnMut(&StoredRecord<'_>) -> bool,
    ) -> Result<Option<ColdHit>, crate::error::Error> {
        if self.is_empty() {
            return Ok(None);
        }
        let generations = self.generations.read();
        // Every generation's filter reads start before the first is checked, so that
        // their cache and TLB misses overlap (`prefetch.rs`).
        for generation in generations.iter().rev() {
            generation.sections.prefetch(hash.0);
        }
        let mut entries = Vec::new();
        for generation in generations.iter().rev() {
            let mut best: Option<(crate::addr::Lsn, ColdEntry, u64)> = None;
            self.each_record(generation, hash, &mut entries, |position, entry, record| {
                if is_key(record) && best.is_none_or(|(lsn, ..)| record.lsn > lsn) {
                    best = Some((record.lsn, entry, position));
                }
            })?;
            if let Some((_, entry, position)) = best {
                return Ok(Some(ColdHit {
                    generation: Arc::clone(generation),
                    row: entry.segment as usize,
                    offset: entry.offset(),
                    position,
                    trusted: entry.trusted(),
                }));
            }
        }
        Ok(None)
    }

    /// Whether the trusted filter of a generation whose buckets are all live at `now_ms`
    /// and none of whose trusted entries is dead holds `hash` (an approximate
    /// namespace's answer from RAM: `LikelyDuplicate`). Other generations are left to
    /// the exact lookup, which skips expired and dead entries.
    pub(crate) fn trusts(&self, hash: KeyHash, now_ms: u64) -> bool {
        #[cfg(feature = "planted-bugs")]
        let now_ms = match crate::planted::planted("approximate-trusts-expired") {
            true => 0,
            false => now_ms,
        };
        self.generations
            .read()
            .iter()
            .rev()
            .any(|g| g.trusted_at(now_ms) && g.sections.trusted.holds_for_sure(hash.0))
    }

    /// Namespaces whose keys spills mark trusted: `Policy::approximate` opened them.
    pub(crate) fn trust_namespace(&self, namespace_id: u32) {
        self.trusted_namespaces.write().insert(namespace_id);
    }

    /// Calls `each(position, entry, record)` for every live entry of `hash` in
    /// `generation` whose segment is still there, with its record (`entries` is a
    /// buffer). A damaged page (`damaged`) or record is an error naming its file.
    fn each_record(
        &self,
        generation: &Generation,
        hash: KeyHash,
        entries: &mut Vec<(u64, ColdEntry)>,
        mut each: impl FnMut(u64, ColdEntry, &StoredRecord<'_>),
    ) -> Result<(), crate::error::Error> {
        entries.clear();
        generation
            .entries(hash, entries)
            .map_err(|(at, reason)| self.damaged(generation, at, reason))?;
        for &(position, entry) in entries.iter() {
            let row = entry.segment as usize;
            let Some(segment) = &generation.segments[row] else {
                continue;
            };
            let record = segment.read(entry.offset()).map_err(|reason| {
                crate::error::Error::corruption(&segment.path, u64::from(entry.offset()), reason)
            })?;
            each(position, entry, &record);
        }
        Ok(())
    }

    /// A lookup or a merge met a damaged page at `at` of `generation`: the error for
    /// its caller (never an answer). Merges leave the generation alone from now on. The
    /// first one removes `COLD_STATE` (and no state is written after it), so that the
    /// next open deletes the generation files and rebuilds the index from the log.
    #[cold]
    pub(crate) fn damaged(
        &self,
        generation: &Generation,
        at: u64,
        reason: &'static str,
    ) -> crate::error::Error {
        generation.damaged.store(true, Ordering::Release);
        if self.damaged_pages.fetch_add(1, Ordering::AcqRel) == 0 {
            tracing::error!(file = %generation.path.display(), offset = at, reason, "a damaged cold index page: its lookups fail until the next open rebuilds the index from the log");
            let path = self.dir.join(crate::layout::COLD_STATE);
            if !self.read_only
                && let Err(e) = self.vfs.remove(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::error!(error = %e, "could not remove the cold state: the next open may reuse the damaged file, and its lookups fail again");
            }
        }
        crate::error::Error::corruption(&generation.path, at, reason)
    }

    /// Whether a lookup met a damaged page (no cold state may be written).
    pub(crate) fn is_damaged(&self) -> bool {
        self.damaged_pages.load(Ordering::Acquire) > 0
    }

    /// Takes out of the shards' counts the cold keys of every segment whose bucket
    /// deadline is at or before `now_ms`, and drops the generations all of whose
    /// segments are: the caller deletes their files (O(files)). Returns the keys
    /// forgotten (tombstones aside) and the generations dropped (their files are
    /// deleted once a cold state without them is written: `persist`).
    pub(crate) fn expire(&self, index: &Index, now_ms: u64) -> (u64, u64) {
        // No cold state is taken while this drops segments and generations (one taken
        // before must not delete the files of generations dropped after it: `leave`).
        let _publishing = self.publishing.lock();
        let mut expired = Vec::new();
        self.spilled.lock().retain(|_, segment| {
            let live = segment.deadline_ms > now_ms;
            if !live {
                expired.push(Arc::clone(&segment.counts));
            }
            live
        });
        let mut forgotten = 0;
        if !expired.is_empty() {
            // The state must stop naming them: their files go now.
            self.dirty.store(true, Ordering::Relaxed);
            for (i, shard) in index.shards().enumerate() {
                let mut shard = shard.lock();
                for counts in &expired {
                    for (state, n) in State::ALL.into_iter().zip(counts.take(i)) {
                        for _ in 0..n {
                            shard.counts.sub(state);
                        }
                        if state != State::Tombstone {
                            forgotten += n;
                        }
                    }
                }
            }
        }
        let mut generations = self.generations.write();
        let (dropped, kept): (Vec<_>, Vec<_>) = generations
            .drain(..)
            .partition(|g| g.last_deadline_ms() <= now_ms);
        *generations = kept;
        self.any.store(!generations.is_empty(), Ordering::Release);
        drop(generations);
        if !dropped.is_empty() {
            // Their files go once a cold state without them is written.
            self.leave(&dropped);
            self.dirty.store(true, Ordering::Relaxed);
        }
        (forgotten, dropped.len() as u64)
    }

    pub(crate) fn stats(&self) -> ColdStats {
        let counts = self.counts_bytes();
        let generations = self.generations.read();
        let mut stats = ColdStats {
            generations: generations.len() as u64,
            spills: self.spills.load(Ordering::Relaxed),
            merges: self.merges.load(Ordering::Relaxed),
            spilled_keys: self.spilled_keys.load(Ordering::Relaxed),
            reused_at_open: self.reused.load(Ordering::Relaxed),
            rebuilt_at_open: self.rebuilt.load(Ordering::Relaxed),
            damaged_pages: self.damaged_pages.load(Ordering::Relaxed),
            ram_bytes: counts,
            ..ColdStats::default()
        };
        for generation in generations.iter() {
            stats.keys += generation.header.entry_count;
            stats.ram_bytes += generation.ram_bytes();
            stats.disk_bytes += generation.header.file_len();
        }
        stats
    }

    /// No spill or merge runs, and no cold state is written but close's, after this
    /// returns (close). A running merge gives up at its next page.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        *self.working.lock() = true;
        *self.merging.lock() = true;
        self.merge_wake.notify_all();
        *self.publishing.lock() = true;
    }
}
