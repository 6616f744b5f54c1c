//! Moving entries into the cold tier: the spill of one bucket and the merge of two
//! generations, each written once to a temp file, synced, renamed into place and the
//! directory synced before lookups see it; only then do the hot entries leave.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{ColdTier, GENERATIONS_MAX, Generation, RowCounts, SpilledSegment};
use crate::addr::Location;
use crate::error::Error;
use crate::format::cold_index::{self, ColdEntry, ColdSegment};
use crate::format::record::State;
use crate::format::segment_header;
use crate::index::{Index, KeyHash, StateCounts};
use crate::io::Vfs;
use crate::log::{Log, Segment, reader};

/// What `ColdTier::enforce` did.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct SpillReport {
    pub buckets: u64,
    pub keys: u64,
    pub merges: u64,
}

/// While a spill collects entries, the state of the key's record rides in the offset's
/// top byte (offsets are below 2^24: segments are at most 16 MiB), so one 16-byte
/// entry per key is all it holds besides the file it writes.
const STATE_SHIFT: u32 = 24;
const _: () = assert!(crate::limits::SEGMENT_SIZE_BYTES_MAX <= 1 << STATE_SHIFT);

impl ColdTier {
    /// Spills the oldest buckets not spilled yet (deadline order) while the hot tables
    /// and the generations' RAM exceed `budget`, then merges generations down to
    /// `GENERATIONS_MAX`. `sync`: sync each file and the directory (every durability
    /// mode but `None`). The caller keeps the reaper out (`Expiry::pause`).
    pub(crate) fn enforce(
        &self,
        budget: u64,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
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
        while self.generations.read().len() > GENERATIONS_MAX {
            self.merge_smallest_pair(log, index, now_ms, sync)?;
            report.merges += 1;
        }
        Ok(report)
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
    fn spill(
        &self,
        log: &Log,
        index: &Index,
        segments: &[(Arc<Segment>, u64, u64)],
        sync: bool,
    ) -> Result<u64, Error> {
        let mut entries: Vec<ColdEntry> = Vec::new();
        for (row, (segment, from, covered)) in segments.iter().enumerate() {
            let bytes = segment.file.read(0, *covered as usize);
            reader::scan(bytes, *from as usize, |offset, record| {
                let hash = KeyHash::of_record(&record);
                let location = Location {
                    slot: segment.slot,
                    offset: offset as u32,
                };
                let shard = index.lock(hash);
                if shard.find(hash, |at| at == location).is_some() {
                    let state = shard.effective_state(record.state, record.lsn);
                    entries.push(ColdEntry {
                        key_hash: hash.0,
                        segment: row as u32,
                        offset: offset as u32 | (StateCounts::index(state) as u32) << STATE_SHIFT,
                    });
                }
            });
        }
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
        if entries.is_empty() {
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
        // Sorted as the file holds them (by hash): an entry's position is its index here.
        entries.sort_unstable();
        let states: Vec<u8> = entries
            .iter_mut()
            .map(|e| {
                let state = (e.offset >> STATE_SHIFT) as u8;
                e.offset &= (1 << STATE_SHIFT) - 1;
                state
            })
            .collect();
        let number = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let generation = self.write(
            log.vfs(),
            number,
            &rows,
            &entries,
            segments.iter().map(|(s, _, _)| Arc::clone(s)).collect(),
            counts,
            sync,
        )?;
        self.generations.write().push(Arc::clone(&generation));
        self.any.store(true, Ordering::Release);
        {
            let mut spilled = self.spilled.lock();
            for (segment, _, covered) in segments {
                if let Some(entry) = spilled.get_mut(&segment.seq) {
                    entry.covered_len = entry.covered_len.max(*covered);
                }
            }
        }
        let mut moved = 0;
        for (position, (e, &state)) in entries.iter().zip(&states).enumerate() {
            let location = Location {
                slot: segments[e.segment as usize].0.slot,
                offset: e.offset,
            };
            let hash = KeyHash(e.key_hash);
            let mut shard = index.lock(hash);
            if shard.remove_at(hash, location) {
                let state = State::ALL[state as usize];
                generation.count_add(e.segment as usize, index.shard_of(hash), state);
                moved += 1;
            } else {
                // Written again meanwhile: the hot entry is newer.
                generation.kill(position as u64);
            }
        }
        self.spills.fetch_add(1, Ordering::Relaxed);
        self.spilled_keys.fetch_add(moved, Ordering::Relaxed);
        tracing::debug!(
            generation = number,
            entries = entries.len(),
            moved,
            "spilled a bucket's index entries to a cold generation"
        );
        Ok(moved)
    }

    /// Merges the two adjacent generations with the fewest entries between them into
    /// one that takes the newer's place (and a new number, above every other): entries
    /// of expired buckets are dropped, equal hashes all kept (a lookup resolves them
    /// by lsn). The counters of each segment row go with it.
    fn merge_smallest_pair(
        &self,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
    ) -> Result<(), Error> {
        let (at, older, newer) = {
            let generations = self.generations.read();
            let at = (0..generations.len() - 1)
                .min_by_key(|&i| generations[i].entry_count() + generations[i + 1].entry_count())
                .expect("more than GENERATIONS_MAX generations");
            (
                at,
                Arc::clone(&generations[at]),
                Arc::clone(&generations[at + 1]),
            )
        };
        let mut rows = Vec::new();
        let mut segments = Vec::new();
        let mut counts = Vec::new();
        let mut row_of: HashMap<u64, u32> = HashMap::new();
        // Each entry with where it came from: its position in `older`, or in `newer`
        // with the top bit set.
        const NEWER: u64 = 1 << 63;
        let mut entries: Vec<(ColdEntry, u64)> = Vec::new();
        let mut origin = 0;
        for generation in [&older, &newer] {
            let mut remap = Vec::with_capacity(generation.sections.segments.len());
            for (row, segment) in generation.sections.segments.iter().enumerate() {
                if segment.bucket_deadline_ms <= now_ms {
                    remap.push(None);
                    continue;
                }
                let merged = *row_of.entry(segment.seq).or_insert_with(|| {
                    rows.push(*segment);
                    segments.push(Arc::clone(&generation.segments[row]));
                    counts.push(Arc::clone(&generation.counts[row]));
                    (rows.len() - 1) as u32
                });
                let kept: &mut ColdSegment = &mut rows[merged as usize];
                kept.covered_len = kept.covered_len.max(segment.covered_len);
                remap.push(Some(merged));
            }
            let mut page = Vec::new();
            for number in 0..generation.header.page_count {
                let at = generation.header.page_offset(number);
                page.clear();
                let bytes = generation.file.read(at, cold_index::PAGE_LEN);
                cold_index::decode_page(
                    &generation.header,
                    &generation.sections,
                    number,
                    bytes,
                    &mut page,
                )
                .map_err(|e| Error::corruption(&generation.path, at, e.reason()))?;
                let first = u64::from(number) * cold_index::PAGE_ENTRIES as u64;
                entries.extend(page.iter().enumerate().filter_map(|(i, e)| {
                    let position = first + i as u64;
                    if generation.is_dead(position) {
                        return None;
                    }
                    let segment = remap[e.segment as usize]?;
                    Some((ColdEntry { segment, ..*e }, origin | position))
                }));
            }
            origin = NEWER;
        }
        let number = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let merged = if entries.is_empty() {
            None
        } else {
            // Sorted as the file holds them: an entry's position is its index here,
            // and its origin rides beside it for the kills below.
            entries.sort_unstable();
            let (entries, origins): (Vec<ColdEntry>, Vec<u64>) = entries.into_iter().unzip();
            let merged = self.write(log.vfs(), number, &rows, &entries, segments, counts, sync)?;
            Some((merged, origins))
        };
        {
            let mut generations = self.generations.write();
            debug_assert!(Arc::ptr_eq(&generations[at], &older));
            generations.remove(at + 1);
            match &merged {
                Some((merged, _)) => generations[at] = Arc::clone(merged),
                None => {
                    generations.remove(at);
                }
            }
            self.any.store(!generations.is_empty(), Ordering::Release);
        }
        if let Some((merged, origins)) = merged {
            // A write that found its key in `older` or `newer` kills the entry there,
            // under the key's shard lock, and maybe after the dead bits were read
            // above. No lookup finds those two any more (the swap above waited for
            // every lookup holding the list), so once each shard's lock was taken
            // once, every such kill is done: carry them over. Until then the key's
            // hot entry (written with the kill, under the same lock) shadows the
            // merged entry; the reaper, the one other remover of hot entries, is
            // this thread.
            index.wait_for_writers();
            #[cfg(feature = "planted-bugs")]
            let carry = !crate::planted::planted("cold-merge-loses-kills");
            #[cfg(not(feature = "planted-bugs"))]
            let carry = true;
            for (position, &origin) in origins.iter().enumerate() {
                let from = if origin & NEWER != 0 { &newer } else { &older };
                if carry && from.is_dead(origin & !NEWER) {
                    merged.kill(position as u64);
                }
            }
        }
        self.merges.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            older = older.number,
            newer = newer.number,
            into = number,
            "merged two cold generations"
        );
        remove_files(log, &[older, newer])
    }

    /// Writes generation `number` (temp file, sync, rename, directory sync) and opens
    /// it for lookups.
    #[allow(clippy::too_many_arguments)]
    fn write(
        &self,
        vfs: &dyn Vfs,
        number: u64,
        rows: &[ColdSegment],
        entries: &[ColdEntry],
        segments: Vec<Arc<Segment>>,
        counts: Vec<Arc<RowCounts>>,
        sync: bool,
    ) -> Result<Arc<Generation>, Error> {
        let bytes = cold_index::encode(number, rows, entries);
        let path = self.dir.join(crate::layout::cold_file_name(number));
        let temp = temp_path(&path);
        const OP: &str = "writing a cold index file";
        let written = crate::io::replace_file(vfs, &self.dir, &temp, &path, &bytes, sync);
        if let Err((e, at)) = written {
            let _ = vfs.remove(&temp);
            let _ = vfs.remove(&path);
            return Err(Error::io(OP, at, e));
        }
        let file = vfs
            .open_segment(&path)
            .map_err(|e| Error::io("opening a cold index file", &path, e))?;
        let header = cold_index::decode_header(&bytes)
            .map_err(|e| Error::corruption(&path, 0, e.reason()))?;
        let sections =
            cold_index::decode_sections(&header, &bytes[header.sections_offset() as usize..])
                .map_err(|e| Error::corruption(&path, header.sections_offset(), e.reason()))?;
        Ok(Arc::new(Generation {
            number,
            path,
            header,
            sections,
            file,
            segments,
            counts: counts.into_boxed_slice(),
            dead: super::dead_bits(header.entry_count),
        }))
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

fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Deletes the files of generations that left the tier, then syncs the directory.
/// Every file is tried; the first failure is returned (a file left behind is deleted
/// at the next open, which rebuilds the index from the log).
pub(crate) fn remove_files(log: &Log, generations: &[Arc<Generation>]) -> Result<(), Error> {
    let mut result = Ok(());
    for generation in generations {
        match log.vfs().remove(&generation.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                if result.is_ok() {
                    result = Err(Error::io("deleting a cold index file", &generation.path, e));
                }
            }
        }
    }
    if !generations.is_empty()
        && let Err(e) = log.vfs().sync_dir(log.dir())
        && result.is_ok()
    {
        result = Err(Error::io("syncing directory", log.dir(), e));
    }
    result
}
