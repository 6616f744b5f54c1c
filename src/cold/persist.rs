//! The cold tier across a clean close: at close, what it keeps only in RAM (each
//! generation's dead bits, each spilled segment's covered length and cold counts) goes
//! to `COLD_STATE` beside `CHECKPOINT` (`format::cold_state`); the next open, when the
//! checkpoint is used, checks the generation files against it (names, lengths, header
//! checksums, sections' checksums, the segments they need) and takes them over without
//! reading a page or replaying a record. In any other case — a crash, a damaged or
//! missing file, a checkpoint that does not match — the open deletes the generation
//! files and rebuilds the index from the log, as before (counted in `Stats`).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{ColdTier, Generation, SpilledSegment};
use crate::error::Error;
use crate::format::cold_index::{self, Header, Sections};
use crate::format::cold_state::{self, ColdState, GenerationState, STATES, SegmentState};
use crate::format::read_u64;
use crate::index::{Index, StateCounts};
use crate::io::{SegmentFile, Vfs};
use crate::log::Log;

/// Generation files a clean close left, checked against the directory and ready to be
/// taken over (`ColdTier::restore`).
pub(crate) struct Reused {
    generations: Vec<Loaded>,
    segments: Vec<SegmentState>,
    next_generation: u64,
}

struct Loaded {
    number: u64,
    path: PathBuf,
    header: Header,
    sections: Sections,
    file: Arc<dyn SegmentFile>,
    dead: Vec<u64>,
}

impl std::fmt::Debug for Reused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reused")
            .field(
                "generations",
                &self
                    .generations
                    .iter()
                    .map(|g| g.number)
                    .collect::<Vec<_>>(),
            )
            .field("segments", &self.segments.len())
            .finish()
    }
}

impl Reused {
    pub(crate) fn generations(&self) -> usize {
        self.generations.len()
    }
}

/// Checks the cold state a clean close left (`state`, written with the checkpoint
/// whose bytes are `checkpoint`) against the directory listing `names`, and opens the
/// generation files it lists. `Ok(Err(reason))` if anything disagrees: the caller
/// replays the log instead. `Err` for an I/O error opening a file (as a replay would
/// meet opening a segment).
pub(crate) fn load(
    vfs: &dyn Vfs,
    dir: &std::path::Path,
    names: &[String],
    state: &[u8],
    checkpoint: &[u8],
    shards: usize,
    now_ms: u64,
) -> Result<Result<Reused, String>, Error> {
    let state = match cold_state::decode(state) {
        Ok(state) => state,
        Err(reason) => return Ok(Err(reason.to_string())),
    };
    let ColdState {
        shard_count,
        checkpoint_hash,
        next_generation,
        generations,
        segments,
    } = state;
    if shard_count as usize != shards {
        return Ok(Err(format!(
            "the cold state was written with {shard_count} shards, the store opens with {shards}"
        )));
    }
    if checkpoint_hash != xxhash_rust::xxh3::xxh3_64(checkpoint) {
        return Ok(Err(
            "the cold state was not written with this checkpoint".to_string()
        ));
    }
    let on_disk: BTreeSet<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| crate::layout::is_cold_file(n) && !n.ends_with(".tmp"))
        .collect();
    let listed: BTreeSet<String> = generations
        .iter()
        .map(|g| crate::layout::cold_file_name(g.number))
        .collect();
    if listed.len() != generations.len()
        || !on_disk
            .iter()
            .copied()
            .eq(listed.iter().map(String::as_str))
    {
        return Ok(Err(format!(
            "the directory holds {} cold index files, the cold state lists {} (or other names)",
            on_disk.len(),
            generations.len()
        )));
    }
    let segment_files: BTreeSet<u64> = names
        .iter()
        .filter_map(|n| crate::layout::parse_segment_file_name(n))
        .map(|(_, seq)| seq)
        .collect();
    let mut loaded = Vec::with_capacity(generations.len());
    for generation in generations {
        match open_generation(vfs, dir, generation, &segment_files, now_ms)? {
            Ok(generation) => loaded.push(generation),
            Err(reason) => return Ok(Err(reason)),
        }
    }
    Ok(Ok(Reused {
        generations: loaded,
        segments,
        next_generation,
    }))
}

/// Opens one listed generation file and checks it: its header against the state, its
/// sections' checksums, and every segment it needs whose bucket has not expired.
fn open_generation(
    vfs: &dyn Vfs,
    dir: &std::path::Path,
    state: GenerationState,
    segment_files: &BTreeSet<u64>,
    now_ms: u64,
) -> Result<Result<Loaded, String>, Error> {
    let path = dir.join(crate::layout::cold_file_name(state.number));
    let refuse = |why: &str| Ok(Err(format!("{}: {why}", path.display())));
    let file = vfs
        .open_segment(&path)
        .map_err(|e| Error::io("opening a cold index file", &path, e))?;
    if file.capacity() < cold_index::HEADER_LEN as u64 {
        return refuse("shorter than a header");
    }
    let head = file.read(0, cold_index::HEADER_LEN);
    let header = match cold_index::decode_header(head) {
        Ok(header) => header,
        Err(e) => return refuse(e.reason()),
    };
    if header.generation != state.number
        || header.entry_count != state.entry_count
        || read_u64(head, 56) != state.header_checksum
        || header.file_len() != file.capacity()
    {
        return refuse("does not match the cold state");
    }
    let sections = match cold_index::decode_sections(
        &header,
        file.read(header.sections_offset(), header.sections_len() as usize),
    ) {
        Ok(sections) => sections,
        Err(e) => return refuse(e.reason()),
    };
    if let Some(missing) = sections
        .segments
        .iter()
        .find(|s| s.bucket_deadline_ms > now_ms && !segment_files.contains(&s.seq))
    {
        return refuse(&format!(
            "needs segment seq {}, which is missing",
            missing.seq
        ));
    }
    Ok(Ok(Loaded {
        number: state.number,
        path,
        header,
        sections,
        file,
        dead: state.dead,
    }))
}

impl ColdTier {
    /// Per shard, by state, the keys of the shard's counts whose newest entry is cold.
    pub(crate) fn cold_counts(&self, shards: usize) -> Vec<[u64; STATES]> {
        let mut out = vec![[0u64; STATES]; shards];
        for segment in self.spilled.lock().values() {
            for (total, row) in out.iter_mut().zip(segment.counts.iter()) {
                for (total, count) in total.iter_mut().zip(row) {
                    *total += count.load(Ordering::Relaxed);
                }
            }
        }
        out
    }

    /// At a clean close (no write, spill or merge runs any more), right after the
    /// checkpoint whose bytes hash to `checkpoint_hash` was written: `COLD_STATE`
    /// (temp file, sync, rename, directory sync, with `sync`).
    pub(crate) fn write_state(
        &self,
        vfs: &dyn Vfs,
        shards: usize,
        checkpoint_hash: u64,
        sync: bool,
    ) -> Result<(), Error> {
        let generations = self.generations.read();
        let mut segments: Vec<SegmentState> = self
            .spilled
            .lock()
            .iter()
            .map(|(&seq, s)| SegmentState {
                seq,
                deadline_ms: s.deadline_ms,
                covered_len: s.covered_len,
                counts: s
                    .counts
                    .iter()
                    .map(|row| std::array::from_fn(|i| row[i].load(Ordering::Relaxed)))
                    .collect(),
            })
            .collect();
        segments.sort_by_key(|s| s.seq);
        let state = ColdState {
            shard_count: shards as u32,
            checkpoint_hash,
            next_generation: self.next_generation.load(Ordering::Relaxed),
            generations: generations
                .iter()
                .map(|g| GenerationState {
                    number: g.number,
                    entry_count: g.header.entry_count,
                    header_checksum: read_u64(g.file.read(0, cold_index::HEADER_LEN), 56),
                    dead: g.dead_snapshot().into_vec(),
                })
                .collect(),
            segments,
        };
        drop(generations);
        let bytes = cold_state::encode(&state);
        let temp = self.dir.join(crate::layout::COLD_STATE_TEMP);
        let path = self.dir.join(crate::layout::COLD_STATE);
        let written = crate::io::replace_file(vfs, &self.dir, &temp, &path, &bytes, sync);
        if let Err((e, at)) = written {
            let _ = vfs.remove(&temp);
            let _ = vfs.remove(&path);
            return Err(Error::io(
                "writing the cold state (the next open replays the log)",
                at,
                e,
            ));
        }
        tracing::info!(
            bytes = bytes.len(),
            generations = state.generations.len(),
            "wrote the cold state"
        );
        Ok(())
    }

    /// Takes over the generations a clean close left (an open whose index came from
    /// the checkpoint, which holds the hot entries and counts only), and adds their
    /// keys to the shards' counts. Runs before `Index::finish_recovery`, which
    /// releases (and counts) the claims in progress of the previous process in the
    /// shards' counts; each segment's cold counters release theirs here (their lsns
    /// are all below this open's).
    pub(crate) fn restore(&self, reused: Reused, log: &Log, index: &Index) {
        let by_seq: HashMap<u64, Arc<crate::log::Segment>> = log
            .table
            .read()
            .segments()
            .map(|s| (s.seq, Arc::clone(s)))
            .collect();
        let shards = index.shard_count();
        let (in_progress, released) = (
            StateCounts::index(crate::format::record::State::InProgress),
            StateCounts::index(crate::format::record::State::Released),
        );
        let mut spilled = self.spilled.lock();
        for segment in reused.segments {
            let counts = super::new_row_counts(shards);
            for (shard, row) in segment.counts.iter().enumerate() {
                // The shard's counts get them as they were (`finish_recovery` moves
                // and counts the claims); the segment's counters as they are now.
                let mut guard = index.lock_at(shard);
                for (total, &n) in guard.counts.counts.iter_mut().zip(row) {
                    *total += n;
                }
                let mut row = *row;
                row[released] += std::mem::take(&mut row[in_progress]);
                for (counter, n) in counts[shard].iter().zip(row) {
                    counter.store(n, Ordering::Relaxed);
                }
            }
            spilled.insert(
                segment.seq,
                SpilledSegment {
                    deadline_ms: segment.deadline_ms,
                    covered_len: segment.covered_len,
                    counts,
                },
            );
        }
        #[cfg(feature = "planted-bugs")]
        let forget_kills = crate::planted::planted("cold-state-forgets-kills");
        #[cfg(not(feature = "planted-bugs"))]
        let forget_kills = false;
        let mut generations = Vec::with_capacity(reused.generations.len());
        for loaded in reused.generations {
            let rows = &loaded.sections.segments;
            let segments = rows.iter().map(|r| by_seq.get(&r.seq).cloned()).collect();
            let counts = rows
                .iter()
                .map(|r| {
                    spilled
                        .get(&r.seq)
                        .map_or_else(|| super::new_row_counts(shards), |s| Arc::clone(&s.counts))
                })
                .collect();
            generations.push(Arc::new(Generation {
                number: loaded.number,
                path: loaded.path,
                header: loaded.header,
                sections: loaded.sections,
                file: loaded.file,
                segments,
                counts,
                dead: loaded
                    .dead
                    .into_iter()
                    .map(|word| AtomicU64::new(if forget_kills { 0 } else { word }))
                    .collect(),
            }));
        }
        drop(spilled);
        let next = generations.iter().map(|g| g.number + 1).max().unwrap_or(1);
        self.next_generation
            .store(reused.next_generation.max(next), Ordering::Relaxed);
        self.reused
            .store(generations.len() as u64, Ordering::Relaxed);
        self.any.store(!generations.is_empty(), Ordering::Release);
        *self.generations.write() = generations;
    }
}
