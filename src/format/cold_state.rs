//! The `COLD_STATE` file (issue 11): what the cold tier keeps only in RAM, written
//! after every spill, merge or expiry that changed the tier, and at a clean close
//! beside `CHECKPOINT`, so that the next open reuses the generation files instead of
//! deleting them and replaying the whole log. `docs/FORMAT.md` ("The COLD_STATE file")
//! is the specification; the constants below mirror it.
//!
//! ```text
//! header (80 bytes)
//! offset size field
//! 0      8    magic             b"IDEMCST\0"
//! 8      4    version           3
//! 12     4    header_len        80
//! 16     4    shard_count       the store's shard count when it was written
//! 20     4    generation_count  generation blocks that follow
//! 24     4    segment_count     segment blocks after them
//! 28     4    partition_count   entries of the partition block after them
//! 32     8    checkpoint_hash   xxh3-64 of the CHECKPOINT file written with it (flag 0),
//!                               else zero
//! 40     8    next_generation   the number the next generation file gets
//! 48     8    file_len          the length of the whole file, in bytes
//! 56     8    lsn_floor         every record in the log when it was written has an lsn
//!                               counter (lsn >> 16) below this
//! 64     4    flags             bit 0: written at a clean close with a checkpoint;
//!                               other bits zero
//! 68     4    reserved          zero
//! 72     8    checksum          xxh3-64 of bytes 0..72
//!
//! generation blocks, oldest generation first (the order lookups search in reverse)
//! 0      8    number            the generation (its file is <number, 16 hex>.cold)
//! 8      8    entry_count       as its file's header says
//! 16     8    header_checksum   its file's header checksum (bytes 56..64)
//! 24     8    dead_count        d: the non-zero words of its dead bits that follow
//! 32     16d  dead              (word index u64, word u64), indexes strictly increasing
//!                               and below ceil(entry_count / 64), words non-zero: bit i
//!                               of word j set when entry 64j + i is no longer its key's
//!                               newest record
//! 32+16d 8    checksum          xxh3-64 of the block's bytes 0..32+16d
//!
//! segment blocks, one per segment some of whose records were walked by a spill
//! 0      8    segment_seq
//! 8      8    bucket_deadline   unix ms
//! 16     8    covered_len       its records before this offset were walked by a spill
//! 24     8    states            bit i (i < 6) set: state i has a row below (states in
//!                               the order mark, in progress, released, completed,
//!                               failed, tombstone); other bits zero
//! 32     4sk  rows              k = the bits set, s = shard_count: per state set, in
//!                               that order, one u32 per shard: the keys of that state
//!                               whose newest entry is cold and points into this
//!                               segment (a state without a row: none in any shard)
//! 32+4sk 8    checksum          xxh3-64 of the block's bytes 0..32+4sk
//!
//! partition block (always present), p = partition_count entries, sorted and distinct
//! 0      16p  entries           namespace_id u32, partition u32, highest_offset u64:
//!                               the highest source offset among the walked records
//! 16p    8    checksum          xxh3-64 of the block's bytes 0..16p
//!
//! open counter block (always present), one u64 per shard
//! 0      8s   open_counters     per shard, the first lsn counter of the process that
//!                               wrote it: a claim in progress is counted in progress
//!                               (not released) in `counts` iff its counter is at or
//!                               above its shard's
//! 8s     8    checksum          xxh3-64 of the block's bytes 0..8s
//! ```
//!
//! The decoder checks every checksum, length and count before it allocates, and never
//! panics, whatever the bytes.

use super::{read_u32, read_u64};

pub(crate) const MAGIC: [u8; 8] = *b"IDEMCST\0";
pub(crate) const VERSION: u32 = 3;
pub(crate) const HEADER_LEN: usize = 80;
/// States a key is counted in (`index::StateCounts`).
pub(crate) const STATES: usize = 6;
const FLAG_CHECKPOINT: u32 = 1;

/// One generation as it stood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GenerationState {
    pub number: u64,
    pub entry_count: u64,
    pub header_checksum: u64,
    /// The non-zero words of its dead bits: (word index, word), by index.
    pub dead: Vec<(u64, u64)>,
}

/// One segment whose records a spill walked, as it stood.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentState {
    pub seq: u64,
    pub deadline_ms: u64,
    pub covered_len: u64,
    /// Per state (`StateCounts::index` order), one count per shard, or `None` where no
    /// shard has one.
    pub rows: [Option<Vec<u32>>; STATES],
}

/// The highest source offset of one partition among the records spills walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct PartitionOffset {
    pub namespace_id: u32,
    pub partition: u32,
    pub highest_offset: u64,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ColdState {
    pub shard_count: u32,
    /// The hash of the `CHECKPOINT` written with it at a clean close; `None` for a
    /// state written while the store ran.
    pub checkpoint_hash: Option<u64>,
    pub next_generation: u64,
    pub lsn_floor: u64,
    pub generations: Vec<GenerationState>,
    pub segments: Vec<SegmentState>,
    pub partitions: Vec<PartitionOffset>,
    /// Per shard: claims in progress with an lsn counter at or above it were counted
    /// in progress by the process that wrote it.
    pub open_counters: Vec<u64>,
}

fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Encodes `state`: every generation's `dead` sorted by index, each index below
/// `ceil(entry_count / 64)`, each word non-zero; every segment's rows one count per
/// shard; `partitions` sorted and distinct.
pub(crate) fn encode(state: &ColdState) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    for generation in &state.generations {
        let words = generation.entry_count.div_ceil(64);
        assert!(
            generation.dead.windows(2).all(|w| w[0].0 < w[1].0)
                && generation.dead.iter().all(|&(i, w)| i < words && w != 0)
        );
        let start = out.len();
        out.extend_from_slice(&generation.number.to_le_bytes());
        out.extend_from_slice(&generation.entry_count.to_le_bytes());
        out.extend_from_slice(&generation.header_checksum.to_le_bytes());
        out.extend_from_slice(&(generation.dead.len() as u64).to_le_bytes());
        for &(index, word) in &generation.dead {
            out.extend_from_slice(&index.to_le_bytes());
            out.extend_from_slice(&word.to_le_bytes());
        }
        let sum = checksum(&out[start..]);
        out.extend_from_slice(&sum.to_le_bytes());
    }
    for segment in &state.segments {
        let start = out.len();
        out.extend_from_slice(&segment.seq.to_le_bytes());
        out.extend_from_slice(&segment.deadline_ms.to_le_bytes());
        out.extend_from_slice(&segment.covered_len.to_le_bytes());
        let states = (0..STATES)
            .filter(|&i| segment.rows[i].is_some())
            .fold(0u64, |bits, i| bits | 1 << i);
        out.extend_from_slice(&states.to_le_bytes());
        for row in segment.rows.iter().flatten() {
            assert_eq!(row.len(), state.shard_count as usize);
            for count in row {
                out.extend_from_slice(&count.to_le_bytes());
            }
        }
        let sum = checksum(&out[start..]);
        out.extend_from_slice(&sum.to_le_bytes());
    }
    assert!(state.partitions.windows(2).all(|w| key(&w[0]) < key(&w[1])));
    let start = out.len();
    for p in &state.partitions {
        out.extend_from_slice(&p.namespace_id.to_le_bytes());
        out.extend_from_slice(&p.partition.to_le_bytes());
        out.extend_from_slice(&p.highest_offset.to_le_bytes());
    }
    let sum = checksum(&out[start..]);
    out.extend_from_slice(&sum.to_le_bytes());
    assert_eq!(state.open_counters.len(), state.shard_count as usize);
    let start = out.len();
    for counter in &state.open_counters {
        out.extend_from_slice(&counter.to_le_bytes());
    }
    let sum = checksum(&out[start..]);
    out.extend_from_slice(&sum.to_le_bytes());
    let file_len = out.len() as u64;
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    out[16..20].copy_from_slice(&state.shard_count.to_le_bytes());
    out[20..24].copy_from_slice(&(state.generations.len() as u32).to_le_bytes());
    out[24..28].copy_from_slice(&(state.segments.len() as u32).to_le_bytes());
    out[28..32].copy_from_slice(&(state.partitions.len() as u32).to_le_bytes());
    out[32..40].copy_from_slice(&state.checkpoint_hash.unwrap_or(0).to_le_bytes());
    out[40..48].copy_from_slice(&state.next_generation.to_le_bytes());
    out[48..56].copy_from_slice(&file_len.to_le_bytes());
    out[56..64].copy_from_slice(&state.lsn_floor.to_le_bytes());
    let flags = if state.checkpoint_hash.is_some() {
        FLAG_CHECKPOINT
    } else {
        0
    };
    out[64..68].copy_from_slice(&flags.to_le_bytes());
    let sum = checksum(&out[..72]);
    out[72..80].copy_from_slice(&sum.to_le_bytes());
    out
}

fn key(p: &PartitionOffset) -> (u32, u32) {
    (p.namespace_id, p.partition)
}

/// Decodes and verifies a whole file.
pub(crate) fn decode(bytes: &[u8]) -> Result<ColdState, &'static str> {
    if bytes.len() < HEADER_LEN {
        return Err("cold state truncated");
    }
    if bytes[0..8] != MAGIC {
        return Err("not a cold state file (bad magic)");
    }
    if read_u64(bytes, 72) != checksum(&bytes[..72]) {
        return Err("cold state header checksum mismatch");
    }
    if read_u32(bytes, 8) != VERSION {
        return Err("unsupported cold state version");
    }
    let flags = read_u32(bytes, 64);
    let checkpoint_hash = read_u64(bytes, 32);
    if read_u32(bytes, 12) as usize != HEADER_LEN
        || flags & !FLAG_CHECKPOINT != 0
        || read_u32(bytes, 68) != 0
        || (flags & FLAG_CHECKPOINT == 0 && checkpoint_hash != 0)
    {
        return Err("cold state header fields out of range");
    }
    if read_u64(bytes, 48) != bytes.len() as u64 {
        return Err("cold state length disagrees with its header");
    }
    let shard_count = read_u32(bytes, 16);
    if shard_count == 0 {
        return Err("cold state header fields out of range");
    }
    let generation_count = read_u32(bytes, 20) as usize;
    let segment_count = read_u32(bytes, 24) as usize;
    let partition_count = read_u32(bytes, 28) as u64;
    // Every block is at least 32 bytes, a partition entry 16, an open counter 8, and the
    // last two blocks have their checksums: the counts must fit the file before
    // anything is allocated.
    let need = (generation_count as u64 + segment_count as u64) * 32
        + partition_count * 16
        + u64::from(shard_count) * 8
        + 16;
    if need > (bytes.len() - HEADER_LEN) as u64 {
        return Err("cold state counts exceed the file");
    }
    let mut at = HEADER_LEN;
    let mut generations = Vec::with_capacity(generation_count);
    for _ in 0..generation_count {
        if bytes.len() - at < 40 {
            return Err("cold state block beyond the file");
        }
        let entry_count = read_u64(bytes, at + 8);
        let dead_count = read_u64(bytes, at + 24);
        let body = block(bytes, &mut at, 32, dead_count.saturating_mul(16))?;
        let words = entry_count.div_ceil(64);
        let dead: Vec<(u64, u64)> = body[32..]
            .chunks_exact(16)
            .map(|pair| (read_u64(pair, 0), read_u64(pair, 8)))
            .collect();
        if !dead.windows(2).all(|w| w[0].0 < w[1].0)
            || !dead.iter().all(|&(index, word)| index < words && word != 0)
        {
            return Err("cold state dead words out of order or range");
        }
        generations.push(GenerationState {
            number: read_u64(body, 0),
            entry_count,
            header_checksum: read_u64(body, 16),
            dead,
        });
    }
    let mut segments = Vec::with_capacity(segment_count);
    for _ in 0..segment_count {
        if bytes.len() - at < 40 {
            return Err("cold state block beyond the file");
        }
        let states = read_u64(bytes, at + 24);
        if states >> STATES != 0 {
            return Err("cold state segment names an unknown state");
        }
        let row_len = u64::from(shard_count) * 4;
        let body = block(bytes, &mut at, 32, row_len * u64::from(states.count_ones()))?;
        let mut rows = body[32..].chunks_exact(row_len as usize);
        segments.push(SegmentState {
            seq: read_u64(body, 0),
            deadline_ms: read_u64(body, 8),
            covered_len: read_u64(body, 16),
            // The block holds exactly one row per bit set.
            rows: std::array::from_fn(|i| {
                (states & 1 << i != 0)
                    .then(|| rows.next())
                    .flatten()
                    .map(|row| row.chunks_exact(4).map(|c| read_u32(c, 0)).collect())
            }),
        });
    }
    let body = block(bytes, &mut at, 0, partition_count * 16)?;
    let partitions: Vec<PartitionOffset> = body
        .chunks_exact(16)
        .map(|e| PartitionOffset {
            namespace_id: read_u32(e, 0),
            partition: read_u32(e, 4),
            highest_offset: read_u64(e, 8),
        })
        .collect();
    if !partitions.windows(2).all(|w| key(&w[0]) < key(&w[1])) {
        return Err("cold state partitions out of order");
    }
    let body = block(bytes, &mut at, 0, u64::from(shard_count) * 8)?;
    let open_counters: Vec<u64> = body.chunks_exact(8).map(|c| read_u64(c, 0)).collect();
    if at != bytes.len() {
        return Err("cold state longer than its blocks");
    }
    Ok(ColdState {
        shard_count,
        checkpoint_hash: (flags & FLAG_CHECKPOINT != 0).then_some(checkpoint_hash),
        next_generation: read_u64(bytes, 40),
        lsn_floor: read_u64(bytes, 56),
        generations,
        segments,
        partitions,
        open_counters,
    })
}
/// The block at `*at`: `fixed` bytes, `more` bytes, then the checksum of them all,
/// verified; moves `*at` past it.
fn block<'a>(
    bytes: &'a [u8],
    at: &mut usize,
    fixed: usize,
    more: u64,
) -> Result<&'a [u8], &'static str> {
    let len = more
        .checked_add(fixed as u64 + 8)
        .filter(|&len| len <= (bytes.len() - *at) as u64)
        .ok_or("cold state block beyond the file")? as usize;
    let body = &bytes[*at..*at + len - 8];
    if read_u64(bytes, *at + len - 8) != checksum(body) {
        return Err("cold state block checksum mismatch");
    }
    *at += len;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ColdState {
        ColdState {
            shard_count: 2,
            checkpoint_hash: Some(0xfeed),
            next_generation: 9,
            lsn_floor: 1 << 20,
            generations: vec![
                GenerationState {
                    number: 3,
                    entry_count: 130,
                    header_checksum: 77,
                    dead: vec![(0, 1), (2, 1 << 1)],
                },
                GenerationState {
                    number: 8,
                    entry_count: 64,
                    header_checksum: 78,
                    dead: vec![(0, u64::MAX)],
                },
            ],
            segments: vec![
                SegmentState {
                    seq: 12,
                    deadline_ms: 1_000,
                    covered_len: 4096,
                    rows: [
                        Some(vec![1, 7]),
                        None,
                        Some(vec![0, 0]),
                        Some(vec![4, u32::MAX]),
                        None,
                        Some(vec![6, 12]),
                    ],
                },
                SegmentState {
                    seq: 13,
                    deadline_ms: 2_000,
                    covered_len: 64,
                    rows: Default::default(),
                },
            ],
            partitions: vec![
                PartitionOffset {
                    namespace_id: 0,
                    partition: 3,
                    highest_offset: 77,
                },
                PartitionOffset {
                    namespace_id: 1,
                    partition: 0,
                    highest_offset: 5,
                },
            ],
            open_counters: vec![7, 9],
        }
    }

    #[test]
    fn the_encoding_round_trips() {
        let state = sample();
        assert_eq!(decode(&encode(&state)), Ok(state.clone()));
        let running = ColdState {
            checkpoint_hash: None,
            partitions: Vec::new(),
            ..state
        };
        assert_eq!(decode(&encode(&running)), Ok(running));
    }

    /// Every single-byte change and every truncation is refused, never a panic and
    /// never a different state.
    #[test]
    fn any_damage_is_refused() {
        let bytes = encode(&sample());
        for at in 0..bytes.len() {
            for mask in [0x01, 0x80, 0xff] {
                let mut damaged = bytes.clone();
                damaged[at] ^= mask;
                assert!(decode(&damaged).is_err(), "byte {at} ^ {mask:#x} accepted");
            }
        }
        for len in 0..bytes.len() {
            assert!(decode(&bytes[..len]).is_err(), "truncated to {len}");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
    }

    #[test]
    fn huge_counts_are_refused_before_allocating() {
        let mut bytes = encode(&sample());
        bytes[20..24].copy_from_slice(&u32::MAX.to_le_bytes());
        let sum = checksum(&bytes[..72]);
        bytes[72..80].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(decode(&bytes), Err("cold state counts exceed the file"));
        let mut bytes = encode(&sample());
        // The first generation's dead word count: far beyond the file.
        bytes[HEADER_LEN + 24..HEADER_LEN + 32].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert_eq!(decode(&bytes), Err("cold state block beyond the file"));
    }

    /// A segment block's state bits say how long it is: a bit beyond the six states
    /// is refused even with its checksum made valid.
    #[test]
    fn a_segment_naming_an_unknown_state_is_refused() {
        let bytes = encode(&sample());
        // The second segment block (no rows), after the generations' blocks (2 and 1
        // dead words) and the first segment's (4 rows of 2 shards).
        let segment = HEADER_LEN + (40 + 2 * 16) + (40 + 16) + (40 + 4 * 2 * 4);
        assert_eq!(read_u64(&bytes, segment), 13, "the second segment's seq");
        assert_eq!(read_u64(&bytes, segment + 24), 0, "no rows");
        let mut forged = bytes.clone();
        forged[segment + 24] = 1 << 6;
        let sum = checksum(&forged[segment..segment + 32]);
        forged[segment + 32..segment + 40].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(
            decode(&forged),
            Err("cold state segment names an unknown state")
        );
    }
}
