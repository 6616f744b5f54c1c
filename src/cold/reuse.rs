//! Taking over the generation files an earlier open left (`persist` writes the state
//! that lists them): `load` checks the cold state against the directory and opens
//! every file it lists, several at once, without reading a page; `Reused` holds them
//! until `ColdTier::restore` takes them over.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::Error;
use crate::format::cold_index::{Header, Sections};
use crate::format::cold_state::{self, ColdState, GenerationState, PartitionOffset, SegmentState};
use crate::io::{SegmentFile, Vfs};

/// Generation files an earlier open left, checked against the directory and ready to
/// be taken over (`ColdTier::restore`).
pub(crate) struct Reused {
    pub(super) generations: Vec<Loaded>,
    pub(super) segments: Vec<SegmentState>,
    pub(super) next_generation: u64,
    pub(super) lsn_floor: u64,
    pub(super) partitions: Vec<PartitionOffset>,
    pub(super) open_counters: Vec<u64>,
    /// The clock when it was loaded: segments whose bucket expired by then were
    /// deleted by the recovery, and their keys are not counted.
    pub(super) now_ms: u64,
}

pub(super) struct Loaded {
    pub(super) number: u64,
    pub(super) path: PathBuf,
    pub(super) header: Header,
    pub(super) header_checksum: u64,
    pub(super) sections: Sections,
    pub(super) file: Arc<dyn SegmentFile>,
    pub(super) dead: Vec<(u64, u64)>,
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

    /// Each generation's sections (its filters): what the replay screens keys with.
    pub(crate) fn sections(&self) -> Vec<&Sections> {
        self.generations.iter().map(|g| &g.sections).collect()
    }

    /// The generation numbers taken over (their files stay; any other is deleted).
    pub(crate) fn numbers(&self) -> BTreeSet<u64> {
        self.generations.iter().map(|g| g.number).collect()
    }

    /// Per segment seq, the length before which a spill walked its records (a replay
    /// starts there), with the segment's bucket deadline.
    pub(crate) fn covered(&self) -> HashMap<u64, (u64, u64)> {
        self.segments
            .iter()
            .map(|s| (s.seq, (s.covered_len, s.deadline_ms)))
            .collect()
    }

    /// Every record in the log when the state was written has an lsn counter below it.
    pub(crate) fn lsn_floor(&self) -> u64 {
        self.lsn_floor
    }

    /// The highest source offset of each partition among the walked records.
    pub(crate) fn highest_offsets(&self) -> impl Iterator<Item = ((u32, u32), u64)> + '_ {
        self.partitions
            .iter()
            .map(|p| ((p.namespace_id, p.partition), p.highest_offset))
    }
}

/// A generation file opened and checked (`Ok(Ok)`), refused (`Ok(Err(reason))`), or
/// an I/O error.
type Opened = Result<Result<Loaded, String>, Error>;

/// Threads that open the generation files at once (`load`).
const LOAD_THREADS: usize = 8;

/// Checks the cold state an earlier open left (`state`) against the directory listing
/// `names`, and opens the generation files it lists. With `checkpoint` (the bytes of
/// the checkpoint the open rebuilds the hot index from), the state must have been
/// written with it at a clean close; without, any state will do (the caller replays
/// what it does not cover). `Ok(Err(reason))` if anything disagrees: the caller
/// replays the whole log instead. `Err` for an I/O error opening a file (as a replay
/// would meet opening a segment).
pub(crate) fn load(
    vfs: &dyn Vfs,
    dir: &std::path::Path,
    names: &[String],
    state: &[u8],
    checkpoint: Option<&[u8]>,
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
        lsn_floor,
        generations,
        segments,
        partitions,
        open_counters,
    } = state;
    if shard_count as usize != shards {
        return Ok(Err(format!(
            "the cold state was written with {shard_count} shards, the store opens with {shards}"
        )));
    }
    if let Some(checkpoint) = checkpoint
        && checkpoint_hash != Some(xxhash_rust::xxh3::xxh3_64(checkpoint))
    {
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
    // Files it does not list were written after it (a spill or merge the crash cut
    // short) or are waiting to be deleted: leftovers. A file it lists must be there.
    if listed.len() != generations.len() || !listed.iter().all(|n| on_disk.contains(n.as_str())) {
        return Ok(Err(format!(
            "the cold state lists {} cold index files, {} of them missing (or twice)",
            generations.len(),
            listed
                .iter()
                .filter(|n| !on_disk.contains(n.as_str()))
                .count()
        )));
    }
    // (deadline, seq) of every segment file.
    let segment_files: BTreeSet<(u64, u64)> = names
        .iter()
        .filter_map(|n| crate::layout::parse_segment_file_name(n))
        .collect();
    // Files opened on up to `LOAD_THREADS` threads: each reads its sections (filters,
    // fences, segment table) from the disk and decodes them, and the disk serves the
    // reads together (after a crash the page cache holds none of them; here one file
    // at a time read at 0.6–1 GB/s, several at once at 2.9 GB/s).
    // Dealt out in turn, with their positions, so the order is kept.
    let threads = LOAD_THREADS.min(generations.len());
    let mut dealt: Vec<Vec<(usize, GenerationState)>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, generation) in generations.into_iter().enumerate() {
        dealt[i % threads].push((i, generation));
    }
    let segment_files = &segment_files;
    let mut opened: Vec<(usize, Opened)> = std::thread::scope(|scope| {
        let threads: Vec<_> = dealt
            .into_iter()
            .map(|share| {
                scope.spawn(move || {
                    share
                        .into_iter()
                        .map(|(i, g)| (i, open_generation(vfs, dir, g, segment_files, now_ms)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        threads
            .into_iter()
            .flat_map(|t| {
                t.join()
                    .expect("a thread opening cold index files panicked")
            })
            .collect()
    });
    opened.sort_unstable_by_key(|&(i, _)| i);
    let mut loaded = Vec::with_capacity(opened.len());
    for (_, generation) in opened {
        match generation? {
            Ok(generation) => loaded.push(generation),
            Err(reason) => return Ok(Err(reason)),
        }
    }
    Ok(Ok(Reused {
        generations: loaded,
        segments,
        next_generation,
        lsn_floor,
        partitions,
        open_counters,
        now_ms,
    }))
}

/// Opens one listed generation file and checks it: its header against the state, its
/// sections' checksums, and every segment it needs whose bucket has not expired.
fn open_generation(
    vfs: &dyn Vfs,
    dir: &std::path::Path,
    state: GenerationState,
    segment_files: &BTreeSet<(u64, u64)>,
    now_ms: u64,
) -> Opened {
    let path = dir.join(crate::layout::cold_file_name(state.number));
    let refuse = |why: &str| Ok(Err(format!("{}: {why}", path.display())));
    let file = super::open_generation_file(vfs, &path)?;
    let (header, header_checksum, sections) = match super::read_head(file.as_ref()) {
        Ok(head) => head,
        Err((_, reason)) => return refuse(reason),
    };
    if header.generation != state.number
        || header.entry_count != state.entry_count
        || header_checksum != state.header_checksum
    {
        return refuse("does not match the cold state");
    }
    if let Some(missing) = sections.segments.iter().find(|s| {
        s.bucket_deadline_ms > now_ms && !segment_files.contains(&(s.bucket_deadline_ms, s.seq))
    }) {
        return refuse(&format!(
            "needs segment seq {}, which is missing",
            missing.seq
        ));
    }
    Ok(Ok(Loaded {
        number: state.number,
        path,
        header,
        header_checksum: state.header_checksum,
        sections,
        file,
        dead: state.dead,
    }))
}
