//! The `COLD_STATE` file (issue 11): what the cold tier keeps only in RAM, written at a
//! clean close beside `CHECKPOINT` so that the next open reuses the generation files
//! instead of deleting them and replaying the log. `docs/FORMAT.md` ("The COLD_STATE
//! file") is the specification; the constants below mirror it.
//!
//! ```text
//! header (64 bytes)
//! offset size field
//! 0      8    magic             b"IDEMCST\0"
//! 8      4    version           1
//! 12     4    header_len        64
//! 16     4    shard_count       the store's shard count when it was written
//! 20     4    generation_count  generation blocks that follow
//! 24     4    segment_count     segment blocks after them
//! 28     4    reserved          zero
//! 32     8    checkpoint_hash   xxh3-64 of the CHECKPOINT file written with it
//! 40     8    next_generation   the number the next generation file gets
//! 48     8    file_len          the length of the whole file, in bytes
//! 56     8    checksum          xxh3-64 of bytes 0..56
//!
//! generation blocks, oldest generation first (the order lookups search in reverse)
//! 0      8    number            the generation (its file is <number, 16 hex>.cold)
//! 8      8    entry_count       as its file's header says
//! 16     8    header_checksum   its file's header checksum (bytes 56..64)
//! 24     8w   dead              w = ceil(entry_count / 64) words: bit i of word j set
//!                               when entry 64j + i is no longer its key's newest
//! 24+8w  8    checksum          xxh3-64 of the block's bytes 0..24+8w
//!
//! segment blocks, one per segment some of whose records' entries are cold
//! 0      8    segment_seq
//! 8      8    bucket_deadline   unix ms
//! 16     8    covered_len       its records before this offset were walked by a spill
//! 24     48s  counts            per shard (s = shard_count), 6 x u64: the keys whose
//!                               newest entry is cold and points into this segment, by
//!                               state (mark, in progress, released, completed, failed,
//!                               tombstone)
//! 24+48s 8    checksum          xxh3-64 of the block's bytes 0..24+48s
//! ```
//!
//! The decoder checks every checksum, length and count before it allocates, and never
//! panics, whatever the bytes.

use super::{read_u32, read_u64};

pub(crate) const MAGIC: [u8; 8] = *b"IDEMCST\0";
pub(crate) const VERSION: u32 = 1;
pub(crate) const HEADER_LEN: usize = 64;
/// States a key is counted in (`index::StateCounts`).
pub(crate) const STATES: usize = 6;

/// One generation as the close left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GenerationState {
    pub number: u64,
    pub entry_count: u64,
    pub header_checksum: u64,
    pub dead: Vec<u64>,
}

/// One segment with cold entries, as the close left it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SegmentState {
    pub seq: u64,
    pub deadline_ms: u64,
    pub covered_len: u64,
    /// Per shard, per state.
    pub counts: Vec<[u64; STATES]>,
}

/// The whole file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ColdState {
    pub shard_count: u32,
    pub checkpoint_hash: u64,
    pub next_generation: u64,
    pub generations: Vec<GenerationState>,
    pub segments: Vec<SegmentState>,
}

fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Encodes `state`: every generation's `dead` has `ceil(entry_count / 64)` words and
/// every segment's `counts` one row per shard.
pub(crate) fn encode(state: &ColdState) -> Vec<u8> {
    let mut out = vec![0u8; HEADER_LEN];
    for generation in &state.generations {
        assert_eq!(
            generation.dead.len() as u64,
            generation.entry_count.div_ceil(64)
        );
        let start = out.len();
        out.extend_from_slice(&generation.number.to_le_bytes());
        out.extend_from_slice(&generation.entry_count.to_le_bytes());
        out.extend_from_slice(&generation.header_checksum.to_le_bytes());
        for word in &generation.dead {
            out.extend_from_slice(&word.to_le_bytes());
        }
        let sum = checksum(&out[start..]);
        out.extend_from_slice(&sum.to_le_bytes());
    }
    for segment in &state.segments {
        assert_eq!(segment.counts.len(), state.shard_count as usize);
        let start = out.len();
        out.extend_from_slice(&segment.seq.to_le_bytes());
        out.extend_from_slice(&segment.deadline_ms.to_le_bytes());
        out.extend_from_slice(&segment.covered_len.to_le_bytes());
        for shard in &segment.counts {
            for count in shard {
                out.extend_from_slice(&count.to_le_bytes());
            }
        }
        let sum = checksum(&out[start..]);
        out.extend_from_slice(&sum.to_le_bytes());
    }
    let file_len = out.len() as u64;
    out[0..8].copy_from_slice(&MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    out[12..16].copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
    out[16..20].copy_from_slice(&state.shard_count.to_le_bytes());
    out[20..24].copy_from_slice(&(state.generations.len() as u32).to_le_bytes());
    out[24..28].copy_from_slice(&(state.segments.len() as u32).to_le_bytes());
    out[32..40].copy_from_slice(&state.checkpoint_hash.to_le_bytes());
    out[40..48].copy_from_slice(&state.next_generation.to_le_bytes());
    out[48..56].copy_from_slice(&file_len.to_le_bytes());
    let sum = checksum(&out[..56]);
    out[56..64].copy_from_slice(&sum.to_le_bytes());
    out
}

/// Decodes and verifies a whole file.
pub(crate) fn decode(bytes: &[u8]) -> Result<ColdState, &'static str> {
    if bytes.len() < HEADER_LEN {
        return Err("cold state truncated");
    }
    if bytes[0..8] != MAGIC {
        return Err("not a cold state file (bad magic)");
    }
    if read_u64(bytes, 56) != checksum(&bytes[..56]) {
        return Err("cold state header checksum mismatch");
    }
    if read_u32(bytes, 8) != VERSION {
        return Err("unsupported cold state version");
    }
    if read_u32(bytes, 12) as usize != HEADER_LEN || read_u32(bytes, 28) != 0 {
        return Err("cold state header fields out of range");
    }
    if read_u64(bytes, 48) != bytes.len() as u64 {
        return Err("cold state length disagrees with its header");
    }
    let shard_count = read_u32(bytes, 16);
    let generation_count = read_u32(bytes, 20) as usize;
    let segment_count = read_u32(bytes, 24) as usize;
    // Every block is at least 32 bytes: the counts must fit the file before anything
    // is allocated for them.
    let blocks = (generation_count as u64).saturating_add(segment_count as u64);
    if blocks.saturating_mul(32) > (bytes.len() - HEADER_LEN) as u64 {
        return Err("cold state counts exceed the file");
    }
    let mut at = HEADER_LEN;
    let mut generations = Vec::with_capacity(generation_count);
    for _ in 0..generation_count {
        if bytes.len() - at < 32 {
            return Err("cold state block beyond the file");
        }
        let entry_count = read_u64(bytes, at + 8);
        let body = block(bytes, &mut at, 24, entry_count.div_ceil(64))?;
        generations.push(GenerationState {
            number: read_u64(body, 0),
            entry_count,
            header_checksum: read_u64(body, 16),
            dead: body[24..].chunks_exact(8).map(|w| read_u64(w, 0)).collect(),
        });
    }
    let mut segments = Vec::with_capacity(segment_count);
    for _ in 0..segment_count {
        let body = block(bytes, &mut at, 24, u64::from(shard_count) * STATES as u64)?;
        segments.push(SegmentState {
            seq: read_u64(body, 0),
            deadline_ms: read_u64(body, 8),
            covered_len: read_u64(body, 16),
            counts: body[24..]
                .chunks_exact(8 * STATES)
                .map(|row| std::array::from_fn(|i| read_u64(row, i * 8)))
                .collect(),
        });
    }
    if at != bytes.len() {
        return Err("cold state longer than its blocks");
    }
    Ok(ColdState {
        shard_count,
        checkpoint_hash: read_u64(bytes, 32),
        next_generation: read_u64(bytes, 40),
        generations,
        segments,
    })
}

/// The block at `*at`: `fixed` bytes, `words` u64s, then the checksum of them all,
/// verified; moves `*at` past it.
fn block<'a>(
    bytes: &'a [u8],
    at: &mut usize,
    fixed: usize,
    words: u64,
) -> Result<&'a [u8], &'static str> {
    let len = words
        .checked_mul(8)
        .and_then(|w| w.checked_add(fixed as u64 + 8))
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
            checkpoint_hash: 0xfeed,
            next_generation: 9,
            generations: vec![
                GenerationState {
                    number: 3,
                    entry_count: 130,
                    header_checksum: 77,
                    dead: vec![1, 0, 1 << 1],
                },
                GenerationState {
                    number: 8,
                    entry_count: 64,
                    header_checksum: 78,
                    dead: vec![u64::MAX],
                },
            ],
            segments: vec![SegmentState {
                seq: 12,
                deadline_ms: 1_000,
                covered_len: 4096,
                counts: vec![[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]],
            }],
        }
    }

    #[test]
    fn the_encoding_round_trips() {
        let state = sample();
        assert_eq!(decode(&encode(&state)), Ok(state));
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
        let sum = checksum(&bytes[..56]);
        bytes[56..64].copy_from_slice(&sum.to_le_bytes());
        assert_eq!(decode(&bytes), Err("cold state counts exceed the file"));
        let mut bytes = encode(&sample());
        // The first generation's entry count: far beyond the file.
        bytes[HEADER_LEN + 8..HEADER_LEN + 16].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert_eq!(decode(&bytes), Err("cold state block beyond the file"));
    }
}
