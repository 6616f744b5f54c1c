//! Moving entries into the cold tier: the spill of one bucket and the merge of two
//! generations, each written once to a temp file, synced, renamed into place and the
//! directory synced before lookups see it; only then do the hot entries leave.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{ColdTier, GENERATIONS_LIMIT, GENERATIONS_MAX, Generation, RowCounts, SpilledSegment};
use crate::addr::{Location, Lsn};
use crate::error::Error;
use crate::format::cold_index::{self, ColdEntry, ColdSegment, ColdWriter};
use crate::format::record::State;
use crate::format::segment_header;
use crate::index::{Index, KeyHash, Shard, StateCounts};
use crate::io::Vfs;
use crate::log::{Log, Segment, reader};

/// What `ColdTier::enforce` did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SpillReport {
    pub buckets: u64,
    pub keys: u64,
    pub merges: u64,
}

/// While a spill collects entries, the state of the key's record rides in bits 24..27
/// of the offset field (offsets are below 2^24: segments are at most 16 MiB; bit 31 is
/// the trusted flag), so one 16-byte entry per key is all it holds besides the file
/// it writes.
const STATE_SHIFT: u32 = 24;
const STATE_MASK: u32 = 0x7;
const _: () = assert!(crate::limits::SEGMENT_SIZE_BYTES_MAX <= 1 << STATE_SHIFT);
const _: () = assert!(
    (STATE_MASK << STATE_SHIFT) & cold_index::TRUSTED_BIT == 0
        && crate::format::record::State::ALL.len() <= 8
);

/// `e` with its state bits set to `state`'s.
fn with_state(e: ColdEntry, state: State) -> ColdEntry {
    let field = e.field & !(STATE_MASK << STATE_SHIFT);
    ColdEntry {
        field: field | (StateCounts::index(state) as u32) << STATE_SHIFT,
        ..e
    }
}

/// The state a collected entry carries.
fn state_of(e: &ColdEntry) -> State {
    State::ALL[((e.field >> STATE_SHIFT) & STATE_MASK) as usize]
}

/// A collected entry as the file holds it: without its state bits.
fn without_state(e: &ColdEntry) -> ColdEntry {
    ColdEntry {
        field: e.field & !(STATE_MASK << STATE_SHIFT),
        ..*e
    }
}

/// While a spill collects entries, bit 30 of the offset field marks one whose key's
/// hot entry points elsewhere (not collected after all).
const GONE: u32 = 1 << 30;
const _: () = assert!(GONE & (cold_index::TRUSTED_BIT | (STATE_MASK << STATE_SHIFT)) == 0);

/// Most entries a spill handles under one taking of a shard's lock: writers of that
/// shard wait for at most this many lookups.
const LOCK_RUN: usize = 256;

/// Calls `f` with each entry, its shard locked and that shard's number. `entries` go
/// in their order; a shard's lock is taken once per run of up to [`LOCK_RUN`]
/// consecutive entries of that shard.
fn for_each_locked(
    index: &Index,
    entries: &mut [ColdEntry],
    mut f: impl FnMut(&mut Shard, usize, &mut ColdEntry),
) {
    let mut at = 0;
    while at < entries.len() {
        let number = index.shard_of(KeyHash(entries[at].key_hash));
        let mut shard = index.lock_at(number);
        let end = entries.len().min(at + LOCK_RUN);
        while at < end && index.shard_of(KeyHash(entries[at].key_hash)) == number {
            f(&mut shard, number, &mut entries[at]);
            at += 1;
        }
    }
}

impl ColdTier {
    /// Spills the oldest buckets not spilled yet (deadline order) while the hot tables
    /// and the generations' RAM exceed `budget`, and while fewer than
    /// `GENERATIONS_LIMIT` generations exist. `merge`: merge generations down to
    /// `GENERATIONS_MAX` here (`expire_now`); otherwise the merger thread is woken to
    /// do it while spills go on. `sync`: sync each file and the directory (every
    /// durability mode but `None`). The caller keeps the reaper out (`Expiry::pause`).
    /// `durable` makes the log durable before each cold state is written: one after
    /// the spills, one after each merge (what the spills walked must not wait for a
    /// merge to be skipped by a replay).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn enforce(
        &self,
        budget: u64,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
        merge: bool,
        durable: &dyn Fn() -> Result<(), Error>,
    ) -> Result<SpillReport, Error> {
        let stopped = self.working.lock();
        let mut report = SpillReport::default();
        if *stopped {
            return Ok(report);
        }
        // Oldest bucket first, each once a round: a bucket spilled before is walked
        // again from where its last spill stopped (writes that arrived since).
        for segments in live_buckets_after(log, now_ms) {
            if self.hot_and_cold_bytes(index) <= budget {
                break;
            }
            if self.generations.read().len() >= GENERATIONS_LIMIT && merge {
                report.merges += self.merge_down(log, index, now_ms, sync, durable)?;
            }
            if self.generations.read().len() >= GENERATIONS_LIMIT {
                // The merger is behind (or only damaged generations are left to
                // merge): the next round spills again.
                tracing::debug!("spills wait for a merge: {GENERATIONS_LIMIT} cold generations");
                break;
            }
            let segments: Vec<(Arc<Segment>, u64, u64)> = {
                let spilled = self.spilled.lock();
                segments
                    .into_iter()
                    .map(|(segment, published)| {
                        let from = spilled
                            .get(&segment.seq)
                            .map_or(segment_header::LEN as u64, |s| {
                                s.covered_len.max(segment_header::LEN as u64)
                            });
                        (segment, from, published)
                    })
                    .filter(|(_, from, published)| published > from)
                    .collect()
            };
            if segments.is_empty() {
                continue;
            }
            report.keys += self.spill(log, index, &segments, sync)?;
            report.buckets += 1;
            for shard in index.shards() {
                shard.lock().shrink();
            }
        }
        drop(stopped);
        self.persist(index, durable, sync)?;
        if merge {
            report.merges += self.merge_down(log, index, now_ms, sync, durable)?;
        } else if self.needs_merge() {
            self.merge_wake.notify_all();
        }
        Ok(report)
    }

    /// Merges generations down to `GENERATIONS_MAX`, writing the cold state after
    /// each merge. Returns the merges made.
    pub(crate) fn merge_down(
        &self,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
        durable: &dyn Fn() -> Result<(), Error>,
    ) -> Result<u64, Error> {
        let stopped = self.merging.lock();
        let mut merges = 0;
        while !*stopped && !self.stopping.load(Ordering::Relaxed) && self.needs_merge() {
            if !self.merge_smallest_run(log, index, now_ms, sync)? {
                break;
            }
            merges += 1;
            self.persist(index, durable, sync)?;
        }
        if merges > 0 {
            // The generations merged away and the merges' buffers are free now: their
            // pages go back before the lock does, so an `expire_now` that waited on
            // this merge finds them returned.
            release_free_memory();
        }
        Ok(merges)
    }

    /// More than `GENERATIONS_MAX` generations, and two adjacent ones without a
    /// damaged page to merge.
    fn needs_merge(&self) -> bool {
        self.generations.read().len() > GENERATIONS_MAX && self.smallest_run().is_some()
    }

    /// The merger thread's wait: until a spill leaves more than `GENERATIONS_MAX`
    /// generations, or `period`. False once the store closes.
    pub(crate) fn wait_for_merges(&self, period: std::time::Duration) -> bool {
        let mut stopped = self.merging.lock();
        if !*stopped && !self.needs_merge() {
            self.merge_wake.wait_for(&mut stopped, period);
        }
        !*stopped
    }

    fn hot_and_cold_bytes(&self, index: &Index) -> u64 {
        let hot: u64 = index
            .shards()
            .map(|s| s.lock().allocation_size() as u64)
            .sum();
        hot + self.ram_bytes()
    }

    /// Spills one bucket's segments, each from where an earlier spill stopped to the
    /// length snapshotted: collects every hot entry that points at one of those
    /// records, writes the generation, publishes it, then removes each collected entry
    /// that still points where it did.
    ///
    /// The records are decoded and hashed first, with no lock; the lookups and then
    /// the removals go in the tables' memory order (`Index::probe_order`), each shard
    /// locked once per run of up to [`LOCK_RUN`] keys. In the walk's order every
    /// lookup was a cache miss in tables of hundreds of megabytes (and a lock), and so
    /// was every removal in the file's hash order.
    fn spill(
        &self,
        log: &Log,
        index: &Index,
        segments: &[(Arc<Segment>, u64, u64)],
        sync: bool,
    ) -> Result<u64, Error> {
        // No cold state copies a spill half done, and no merge publishes meanwhile.
        let _publishing = self.publishing.lock();
        let started = std::time::Instant::now();
        let mut collected: Vec<ColdEntry> = Vec::new();
        // The lsn of each claim in progress: whether it is this process's or a dead
        // one's (released) depends on its shard.
        let mut claims: HashMap<(u32, u32), Lsn> = HashMap::new();
        let mut offsets: HashMap<(u32, u32), u64> = HashMap::new();
        let trusted = self.trusted_namespaces.read().clone();
        for (row, (segment, from, covered)) in segments.iter().enumerate() {
            let bytes = segment
                .file
                .read_for_walk(*from as usize, *covered as usize);
            reader::scan(bytes, *from as usize, |offset, record| {
                if let (Some(partition), Some(source)) =
                    (record.placement.partition, record.placement.offset)
                {
                    let highest = offsets
                        .entry((record.namespace_id, partition))
                        .or_insert(source);
                    *highest = (*highest).max(source);
                }
                let hash = KeyHash::of_record(&record);
                // Only marks: a claim's or a tombstone's state is not a filter's to
                // answer (and a mark's state is what it says, whatever its shard).
                let trusted = !trusted.is_empty()
                    && record.state == State::Seen
                    && trusted.contains(&record.namespace_id);
                let entry = ColdEntry::new(hash.0, row as u32, offset as u32, trusted);
                if record.state == State::InProgress {
                    claims.insert((row as u32, offset as u32), record.lsn);
                }
                collected.push(with_state(entry, record.state));
            });
        }
        let decoded = started.elapsed();
        // In the tables' order: the entries still hot, with their states as they stand.
        let masks = index.probe_masks();
        collected.sort_unstable_by_key(|e| index.probe_order(KeyHash(e.key_hash), &masks));
        for_each_locked(index, &mut collected, |shard, _, e| {
            let location = Location {
                slot: segments[e.segment as usize].0.slot,
                offset: e.offset(),
            };
            if shard.find(KeyHash(e.key_hash), |l| l == location).is_none() {
                e.field |= GONE;
            } else if let Some(&lsn) = claims.get(&(e.segment, e.offset())) {
                *e = with_state(*e, shard.effective_state(State::InProgress, lsn));
            }
        });
        collected.retain(|e| e.field & GONE == 0);
        let mut live = collected;
        {
            let mut covered = self.covered_offsets.lock();
            for (key, offset) in offsets {
                let highest = covered.entry(key).or_insert(offset);
                *highest = (*highest).max(offset);
            }
        }
        self.dirty.store(true, Ordering::Relaxed);
        let counts: Vec<Arc<RowCounts>> = {
            let mut spilled = self.spilled.lock();
            segments
                .iter()
                .map(|(segment, _, _)| {
                    let entry = spilled
                        .entry(segment.seq)
                        .or_insert_with(|| SpilledSegment {
                            deadline_ms: segment.deadline_ms,
                            covered_len: 0,
                            counts: super::new_row_counts(index.shard_count()),
                        });
                    Arc::clone(&entry.counts)
                })
                .collect()
        };
        if live.is_empty() {
            let mut spilled = self.spilled.lock();
            for (segment, _, covered) in segments {
                if let Some(entry) = spilled.get_mut(&segment.seq) {
                    entry.covered_len = entry.covered_len.max(*covered);
                }
            }
            return Ok(0);
        }
        let rows: Vec<ColdSegment> = segments
            .iter()
            .map(|(segment, _, covered)| ColdSegment {
                seq: segment.seq,
                bucket_deadline_ms: segment.deadline_ms,
                covered_len: *covered,
            })
            .collect();
        let walked = started.elapsed();
        // Sorted as the file holds them (by hash), without the states: an entry's
        // position is its index here.
        let mut entries: Vec<ColdEntry> = live.iter().map(without_state).collect();
        entries.sort_unstable();
        let sorted = started.elapsed();
        let number = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let generation = self
            .write(
                log.vfs(),
                number,
                &rows,
                segments
                    .iter()
                    .map(|(s, _, _)| Some(Arc::clone(s)))
                    .collect(),
                counts,
                sync,
                |push| entries.iter().try_for_each(|&entry| push(entry)),
            )?
            .expect("a spill writes one entry or more");
        self.generations.write().push(Arc::clone(&generation));
        self.any.store(true, Ordering::Release);
        let written = started.elapsed();
        {
            let mut spilled = self.spilled.lock();
            for (segment, _, covered) in segments {
                if let Some(entry) = spilled.get_mut(&segment.seq) {
                    entry.covered_len = entry.covered_len.max(*covered);
                }
            }
        }
        let mut moved = 0;
        let mut rewritten = Vec::new();
        for_each_locked(index, &mut live, |shard, number, e| {
            let location = Location {
                slot: segments[e.segment as usize].0.slot,
                offset: e.offset(),
            };
            if shard.remove_at(KeyHash(e.key_hash), location) {
                generation.count_add(e.segment as usize, number, state_of(e));
                moved += 1;
            } else {
                // Written again meanwhile: the hot entry is newer.
                rewritten.push(without_state(e));
            }
        });
        for e in rewritten {
            let position = entries
                .binary_search(&e)
                .expect("every collected entry was written");
            generation.kill(position as u64, e.trusted());
        }
        self.spills.fetch_add(1, Ordering::Relaxed);
        self.spilled_keys.fetch_add(moved, Ordering::Relaxed);
        // Where a spill's time goes (the spills' pace against the writers' is what
        // bounds the hot tier while writing).
        tracing::debug!(
            generation = number,
            entries = entries.len(),
            moved,
            walk_ms = decoded.as_millis() as u64,
            lookup_ms = (walked - decoded).as_millis() as u64,
            sort_ms = (sorted - walked).as_millis() as u64,
            write_ms = (written - sorted).as_millis() as u64,
            remove_ms = (started.elapsed() - written).as_millis() as u64,
            "spilled a bucket's index entries to a cold generation"
        );
        Ok(moved)
    }

    /// Writes generation `number` (temp file, sync, rename, directory sync) and opens
    /// it for lookups: `fill` pushes its entries in key-hash order, each written as
    /// its page fills (the file is never whole in RAM). `None` if `fill` pushed none
    /// (no file is left).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn write(
        &self,
        vfs: &dyn Vfs,
        number: u64,
        rows: &[ColdSegment],
        segments: Vec<Option<Arc<Segment>>>,
        counts: Vec<Arc<RowCounts>>,
        sync: bool,
        fill: impl FnOnce(&mut dyn FnMut(ColdEntry) -> Result<(), Error>) -> Result<(), Error>,
    ) -> Result<Option<Arc<Generation>>, Error> {
        const OP: &str = "writing a cold index file";
        let path = self.dir.join(crate::layout::cold_file_name(number));
        let temp = temp_path(&path);
        let written = (|| {
            let file = vfs
                .open_append(&temp)
                .map_err(|e| Error::io(OP, &temp, e))?;
            file.set_len(0).map_err(|e| Error::io(OP, &temp, e))?;
            let sink = |at: u64, bytes: &[u8]| file.write_at(at, bytes);
            let mut writer = ColdWriter::new(sink, cold_index::PART_KEYS, self.wide_filters);
            fill(&mut |entry| writer.push(entry).map_err(|e| Error::io(OP, &temp, e)))?;
            let done = writer
                .finish(number, rows)
                .map_err(|e| Error::io(OP, &temp, e))?;
            if done.is_some() && sync {
                file.sync_data().map_err(|e| Error::io(OP, &temp, e))?;
            }
            Ok(done)
        })();
        let (header, sections) = match written {
            Ok(Some(done)) => done,
            Ok(None) => {
                let _ = vfs.remove(&temp);
                return Ok(None);
            }
            Err(e) => {
                let _ = vfs.remove(&temp);
                return Err(e);
            }
        };
        let published = vfs
            .rename(&temp, &path)
            .map_err(|e| Error::io(OP, &path, e))
            .and_then(|()| match sync {
                true => vfs
                    .sync_dir(&self.dir)
                    .map_err(|e| Error::io("syncing directory", &self.dir, e)),
                false => Ok(()),
            })
            .and_then(|()| super::open_generation_file(vfs, &path));
        let file = match published {
            Ok(file) => file,
            Err(e) => {
                let _ = vfs.remove(&temp);
                let _ = vfs.remove(&path);
                return Err(e);
            }
        };
        let header_checksum = crate::format::read_u64(file.read(0, cold_index::HEADER_LEN), 56);
        Ok(Some(Arc::new(Generation {
            number,
            path,
            header,
            header_checksum,
            sections,
            file,
            segments,
            counts: counts.into_boxed_slice(),
            dead: super::dead_bits(header.entry_count),
            trust_broken: AtomicBool::new(false),
            damaged: AtomicBool::new(false),
        })))
    }
}

/// The segments of every bucket whose deadline is after `now_ms`, oldest bucket
/// first, each with the length it has published now.
fn live_buckets_after(log: &Log, now_ms: u64) -> Vec<Vec<(Arc<Segment>, u64)>> {
    let table = log.table.read();
    table
        .buckets
        .range(now_ms.saturating_add(1)..)
        .map(|(_, bucket)| {
            bucket
                .segments
                .iter()
                .filter_map(|&slot| table.get(slot))
                .map(|segment| (Arc::clone(segment), segment.published()))
                .collect()
        })
        .collect()
}

/// Hands the allocator's free memory back to the system after a spill or a merge: the
/// entries, filter construction arrays and page buffers they freed sit between the
/// filters they kept, and glibc returns heap memory only from its top unless asked
/// (measured: 5.1–5.9 B/key of anonymous RSS after spilling 20M keys without this,
/// against 1.28 B/key the tier keeps).
pub(crate) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free pages of the allocator's own arenas to the
    // system; it touches no allocation in use and has no precondition.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Deletes the files of generations that left the tier, then syncs the directory.
/// Every file is tried; the first failure is returned (a file left behind is not
/// listed by the cold state, so the next open deletes it).
pub(crate) fn remove_files(vfs: &dyn Vfs, dir: &Path, paths: &[PathBuf]) -> Result<(), Error> {
    let mut result = Ok(());
    for path in paths {
        match vfs.remove(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                if result.is_ok() {
                    result = Err(Error::io("deleting a cold index file", path, e));
                }
            }
        }
    }
    if !paths.is_empty()
        && let Err(e) = vfs.sync_dir(dir)
        && result.is_ok()
    {
        result = Err(Error::io("syncing directory", dir, e));
    }
    result
}
