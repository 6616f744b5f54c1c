//! The `CHECKPOINT` file: the index as it was at a clean close, with the exact list of
//! segment files it describes. `docs/FORMAT.md` ("The CHECKPOINT file") is the
//! specification; the constants below mirror it.
//!
//! ```text
//! header (64 bytes)
//! offset size field
//! 0      8    magic            b"IDEMCKP\0"
//! 8      4    version          1
//! 12     4    header_len       64
//! 16     4    shard_count      the store's shard count when it was written
//! 20     4    segment_count    entries of the segment table
//! 24     4    namespace_count  namespaces defined when it was written
//! 28     4    reserved         zero
//! 32     8    entry_count      index entries in all shard blocks
//! 40     8    file_len         the length of the whole file, in bytes
//! 48     8    reserved         zero
//! 56     8    checksum         xxh3-64 of bytes 0..56
//!
//! segment table: segment_count entries of 32 bytes, then an 8-byte xxh3-64 of them
//! 0      8    segment_seq
//! 8      8    bucket_deadline  unix ms
//! 16     8    valid_len        the file's exact length in bytes
//! 24     8    content_hash     xxh3-64 of the file's bytes 0..valid_len
//!
//! shard blocks, one per shard in shard order
//! 0      8    entry_count      n
//! 8      8    lsn_counter      the shard's next lsn, high 48 bits
//! 16     48   state_counts     6 x u64: mark, in progress, released, completed,
//!                              failed, tombstone (they sum to n)
//! 64     8n   entries          fingerprint:20 | segment:20 | offset:24
//! 64+8n  8    checksum         xxh3-64 of the block's bytes 0..64+8n
//! ```
//!
//! `segment` in an entry is a position in the segment table, never a runtime slot.
//! The decoder checks every checksum, length, count and entry bound, allocates nothing
//! and never panics, whatever the bytes.

use super::{read_u32, read_u64, segment_header};
use crate::addr;

pub(crate) const MAGIC: [u8; 8] = *b"IDEMCKP\0";
pub(crate) const VERSION: u32 = 1;

const MAGIC_OFFSET: usize = 0;
const VERSION_OFFSET: usize = MAGIC_OFFSET + 8;
const HEADER_LEN_OFFSET: usize = VERSION_OFFSET + 4;
const SHARD_COUNT_OFFSET: usize = HEADER_LEN_OFFSET + 4;
const SEGMENT_COUNT_OFFSET: usize = SHARD_COUNT_OFFSET + 4;
const NAMESPACE_COUNT_OFFSET: usize = SEGMENT_COUNT_OFFSET + 4;
const RESERVED_1_OFFSET: usize = NAMESPACE_COUNT_OFFSET + 4;
const ENTRY_COUNT_OFFSET: usize = RESERVED_1_OFFSET + 4;
const FILE_LEN_OFFSET: usize = ENTRY_COUNT_OFFSET + 8;
const RESERVED_2_OFFSET: usize = FILE_LEN_OFFSET + 8;
const CHECKSUM_OFFSET: usize = RESERVED_2_OFFSET + 8;
/// Length of the header; the segment table starts here.
pub(crate) const HEADER_LEN: usize = CHECKSUM_OFFSET + 8;
const _: () = assert!(HEADER_LEN == 64);

const SEGMENT_SEQ_OFFSET: usize = 0;
const SEGMENT_DEADLINE_OFFSET: usize = SEGMENT_SEQ_OFFSET + 8;
const SEGMENT_VALID_LEN_OFFSET: usize = SEGMENT_DEADLINE_OFFSET + 8;
const SEGMENT_HASH_OFFSET: usize = SEGMENT_VALID_LEN_OFFSET + 8;
/// Length of one segment table entry.
pub(crate) const SEGMENT_LEN: usize = SEGMENT_HASH_OFFSET + 8;
const _: () = assert!(SEGMENT_LEN == 32);

const BLOCK_ENTRY_COUNT_OFFSET: usize = 0;
const BLOCK_LSN_COUNTER_OFFSET: usize = BLOCK_ENTRY_COUNT_OFFSET + 8;
const BLOCK_COUNTS_OFFSET: usize = BLOCK_LSN_COUNTER_OFFSET + 8;
/// Length of a shard block's header; its entries start here.
const BLOCK_HEADER_LEN: usize = BLOCK_COUNTS_OFFSET + STATES * 8;
const _: () = assert!(BLOCK_HEADER_LEN == 64);
const CHECKSUM_LEN: usize = 8;

/// Live keys are counted per state, six of them (`index::StateCounts`).
pub(crate) const STATES: usize = 6;

/// Most segments a checkpoint can list: an entry names one in its slot field
/// (the entry word is the index's, `crate::addr`).
pub(crate) const SEGMENTS_MAX: usize = addr::SEGMENT_SLOTS_MAX;
/// Most shards a checkpoint can hold (the store's own limit).
const SHARDS_MAX: usize = crate::limits::SHARDS_MAX;

/// One segment file a checkpoint covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentInfo {
    pub seq: u64,
    pub deadline_ms: u64,
    pub valid_len: u64,
    pub content_hash: u64,
}

/// An index entry: the key's 20-bit fingerprint, and its newest record's segment
/// (a position in the segment table) and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct EntryInfo {
    pub fingerprint: u32,
    pub segment: u32,
    pub offset: u32,
}

impl EntryInfo {
    fn pack(self) -> u64 {
        addr::pack(self.fingerprint, self.segment, self.offset)
    }

    fn unpack(word: u64) -> EntryInfo {
        let (fingerprint, segment, offset) = addr::unpack(word);
        EntryInfo {
            fingerprint,
            segment,
            offset,
        }
    }
}

/// The content hash of a segment file's `bytes` (its whole valid length).
pub(crate) fn content_hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Writes a checkpoint: `new`, then one `shard` per shard in order, then `finish`.
pub(crate) struct Encoder {
    out: Vec<u8>,
    shards_left: usize,
    entries: u64,
}

impl Encoder {
    pub(crate) fn new(
        shard_count: usize,
        namespace_count: usize,
        segments: &[SegmentInfo],
        entries_hint: usize,
    ) -> Encoder {
        assert!(shard_count <= SHARDS_MAX && segments.len() <= SEGMENTS_MAX);
        let len = HEADER_LEN
            + segments.len() * SEGMENT_LEN
            + CHECKSUM_LEN
            + shard_count * (BLOCK_HEADER_LEN + CHECKSUM_LEN)
            + entries_hint * 8;
        let mut out = Vec::with_capacity(len);
        out.resize(HEADER_LEN, 0);
        out[MAGIC_OFFSET..VERSION_OFFSET].copy_from_slice(&MAGIC);
        out[VERSION_OFFSET..HEADER_LEN_OFFSET].copy_from_slice(&VERSION.to_le_bytes());
        out[HEADER_LEN_OFFSET..SHARD_COUNT_OFFSET]
            .copy_from_slice(&(HEADER_LEN as u32).to_le_bytes());
        out[SHARD_COUNT_OFFSET..SEGMENT_COUNT_OFFSET]
            .copy_from_slice(&(shard_count as u32).to_le_bytes());
        out[SEGMENT_COUNT_OFFSET..NAMESPACE_COUNT_OFFSET]
            .copy_from_slice(&(segments.len() as u32).to_le_bytes());
        out[NAMESPACE_COUNT_OFFSET..RESERVED_1_OFFSET]
            .copy_from_slice(&(namespace_count as u32).to_le_bytes());
        let table_start = out.len();
        for segment in segments {
            out.extend(segment.seq.to_le_bytes());
            out.extend(segment.deadline_ms.to_le_bytes());
            out.extend(segment.valid_len.to_le_bytes());
            out.extend(segment.content_hash.to_le_bytes());
        }
        let checksum = xxhash_rust::xxh3::xxh3_64(&out[table_start..]);
        out.extend(checksum.to_le_bytes());
        Encoder {
            out,
            shards_left: shard_count,
            entries: 0,
        }
    }

    /// Appends the next shard's block.
    pub(crate) fn shard(
        &mut self,
        lsn_counter: u64,
        state_counts: [u64; STATES],
        entries: impl ExactSizeIterator<Item = EntryInfo>,
    ) {
        assert!(self.shards_left > 0, "more shard blocks than shards");
        self.shards_left -= 1;
        let start = self.out.len();
        let n = entries.len();
        self.out.extend((n as u64).to_le_bytes());
        self.out.extend(lsn_counter.to_le_bytes());
        for count in state_counts {
            self.out.extend(count.to_le_bytes());
        }
        self.out.reserve(n * 8 + CHECKSUM_LEN);
        let mut written = 0;
        for entry in entries {
            self.out.extend(entry.pack().to_le_bytes());
            written += 1;
        }
        assert_eq!(written, n, "an ExactSizeIterator gave a wrong length");
        let checksum = xxhash_rust::xxh3::xxh3_64(&self.out[start..]);
        self.out.extend(checksum.to_le_bytes());
        self.entries += n as u64;
    }

    /// The finished file.
    pub(crate) fn finish(mut self) -> Vec<u8> {
        assert_eq!(self.shards_left, 0, "fewer shard blocks than shards");
        let len = self.out.len() as u64;
        self.out[ENTRY_COUNT_OFFSET..FILE_LEN_OFFSET].copy_from_slice(&self.entries.to_le_bytes());
        self.out[FILE_LEN_OFFSET..RESERVED_2_OFFSET].copy_from_slice(&len.to_le_bytes());
        let checksum = xxhash_rust::xxh3::xxh3_64(&self.out[..CHECKSUM_OFFSET]);
        self.out[CHECKSUM_OFFSET..HEADER_LEN].copy_from_slice(&checksum.to_le_bytes());
        self.out
    }
}

/// A decoded checkpoint, borrowing the file's bytes.
#[derive(Debug)]
pub(crate) struct Decoded<'a> {
    pub shard_count: usize,
    pub namespace_count: usize,
    pub entry_count: u64,
    pub segments: Vec<SegmentInfo>,
    pub shards: Vec<ShardBlock<'a>>,
}

/// One shard's part of a checkpoint.
#[derive(Debug)]
pub(crate) struct ShardBlock<'a> {
    pub lsn_counter: u64,
    pub state_counts: [u64; STATES],
    entries: &'a [u8],
}

impl ShardBlock<'_> {
    pub(crate) fn len(&self) -> usize {
        self.entries.len() / 8
    }

    pub(crate) fn entries(&self) -> impl ExactSizeIterator<Item = EntryInfo> + '_ {
        self.entries
            .chunks_exact(8)
            .map(|word| EntryInfo::unpack(read_u64(word, 0)))
    }
}

/// Decodes and checks a whole checkpoint: every checksum, the file length, the
/// framing of every block, that each shard's state counts sum to its entries, and
/// that every entry names a listed segment at an offset inside its records. An error
/// names what is wrong. Never panics.
pub(crate) fn decode(bytes: &[u8]) -> Result<Decoded<'_>, String> {
    if bytes.len() < HEADER_LEN {
        return Err(format!(
            "checkpoint truncated: {} bytes, shorter than its {HEADER_LEN}-byte header",
            bytes.len()
        ));
    }
    if bytes[MAGIC_OFFSET..VERSION_OFFSET] != MAGIC {
        return Err("not an idemstore checkpoint (bad magic)".to_string());
    }
    if read_u64(bytes, CHECKSUM_OFFSET) != xxhash_rust::xxh3::xxh3_64(&bytes[..CHECKSUM_OFFSET]) {
        return Err("checkpoint header checksum mismatch".to_string());
    }
    let version = read_u32(bytes, VERSION_OFFSET);
    if version != VERSION {
        return Err(format!(
            "checkpoint version {version} is not supported (this build reads version {VERSION})"
        ));
    }
    if read_u32(bytes, HEADER_LEN_OFFSET) as usize != HEADER_LEN
        || read_u32(bytes, RESERVED_1_OFFSET) != 0
        || read_u64(bytes, RESERVED_2_OFFSET) != 0
    {
        return Err("checkpoint header has a wrong length or non-zero reserved fields".into());
    }
    let file_len = read_u64(bytes, FILE_LEN_OFFSET);
    if file_len != bytes.len() as u64 {
        return Err(format!(
            "checkpoint is {} bytes, its header says {file_len}",
            bytes.len()
        ));
    }
    let shard_count = read_u32(bytes, SHARD_COUNT_OFFSET) as usize;
    let segment_count = read_u32(bytes, SEGMENT_COUNT_OFFSET) as usize;
    let namespace_count = read_u32(bytes, NAMESPACE_COUNT_OFFSET) as usize;
    let entry_count = read_u64(bytes, ENTRY_COUNT_OFFSET);
    if shard_count == 0 || shard_count > SHARDS_MAX || segment_count > SEGMENTS_MAX {
        return Err(format!(
            "checkpoint lists {shard_count} shards and {segment_count} segments: out of range"
        ));
    }
    // Every length below is bounded by the file length before it is used.
    let table_end = HEADER_LEN + segment_count * SEGMENT_LEN;
    if bytes.len() < table_end + CHECKSUM_LEN {
        return Err("checkpoint truncated inside its segment table".to_string());
    }
    let table = &bytes[HEADER_LEN..table_end];
    if read_u64(bytes, table_end) != xxhash_rust::xxh3::xxh3_64(table) {
        return Err("checkpoint segment table checksum mismatch".to_string());
    }
    let segments: Vec<SegmentInfo> = table
        .chunks_exact(SEGMENT_LEN)
        .map(|s| SegmentInfo {
            seq: read_u64(s, SEGMENT_SEQ_OFFSET),
            deadline_ms: read_u64(s, SEGMENT_DEADLINE_OFFSET),
            valid_len: read_u64(s, SEGMENT_VALID_LEN_OFFSET),
            content_hash: read_u64(s, SEGMENT_HASH_OFFSET),
        })
        .collect();
    for (i, segment) in segments.iter().enumerate() {
        if segment.valid_len < segment_header::LEN as u64
            || segment.valid_len > addr::OFFSET_MASK + 1
        {
            return Err(format!(
                "checkpoint segment {i} has an impossible length {}",
                segment.valid_len
            ));
        }
        if i > 0 && segments[i - 1].seq >= segment.seq {
            return Err("checkpoint segment table is not in increasing seq order".to_string());
        }
    }
    let mut at = table_end + CHECKSUM_LEN;
    let mut shards = Vec::with_capacity(shard_count);
    let mut total = 0u64;
    for shard in 0..shard_count {
        let Some(header) = bytes.get(at..at + BLOCK_HEADER_LEN) else {
            return Err(format!(
                "checkpoint truncated in the block of shard {shard}"
            ));
        };
        let n = read_u64(header, BLOCK_ENTRY_COUNT_OFFSET);
        let block_len = usize::try_from(n)
            .ok()
            .and_then(|n| n.checked_mul(8))
            .and_then(|len| len.checked_add(BLOCK_HEADER_LEN));
        let Some(block) = block_len.and_then(|len| bytes.get(at..at.checked_add(len)?)) else {
            return Err(format!(
                "checkpoint truncated in the block of shard {shard}"
            ));
        };
        let end = at + block.len();
        let Some(checksum) = bytes.get(end..end + CHECKSUM_LEN) else {
            return Err(format!(
                "checkpoint truncated in the block of shard {shard}"
            ));
        };
        if read_u64(checksum, 0) != xxhash_rust::xxh3::xxh3_64(block) {
            return Err(format!(
                "checkpoint block of shard {shard}: checksum mismatch"
            ));
        }
        let mut state_counts = [0u64; STATES];
        for (i, count) in state_counts.iter_mut().enumerate() {
            *count = read_u64(header, BLOCK_COUNTS_OFFSET + i * 8);
        }
        if state_counts.iter().try_fold(0u64, |a, &c| a.checked_add(c)) != Some(n) {
            return Err(format!(
                "checkpoint block of shard {shard}: state counts do not sum to its {n} entries"
            ));
        }
        let block = ShardBlock {
            lsn_counter: read_u64(header, BLOCK_LSN_COUNTER_OFFSET),
            state_counts,
            entries: &block[BLOCK_HEADER_LEN..],
        };
        for entry in block.entries() {
            let fits = segments.get(entry.segment as usize).is_some_and(|s| {
                entry.offset as usize >= segment_header::LEN
                    && u64::from(entry.offset) < s.valid_len
            });
            if !fits {
                return Err(format!(
                    "checkpoint block of shard {shard}: an entry points outside the listed segments"
                ));
            }
        }
        total += n;
        shards.push(block);
        at = end + CHECKSUM_LEN;
    }
    if at != bytes.len() {
        return Err("checkpoint has bytes after its last shard block".to_string());
    }
    if total != entry_count {
        return Err(format!(
            "checkpoint shard blocks hold {total} entries, its header says {entry_count}"
        ));
    }
    Ok(Decoded {
        shard_count,
        namespace_count,
        entry_count,
        segments,
        shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let segments = [
            SegmentInfo {
                seq: 3,
                deadline_ms: 1_700_000_060_000,
                valid_len: 200,
                content_hash: 0xDEAD,
            },
            SegmentInfo {
                seq: 9,
                deadline_ms: 1_700_000_120_000,
                valid_len: 1 << 24,
                content_hash: 0xBEEF,
            },
        ];
        let mut encoder = Encoder::new(2, 3, &segments, 3);
        let a = [
            EntryInfo {
                fingerprint: (1 << 20) - 1,
                segment: 1,
                offset: (1 << 24) - 1,
            },
            EntryInfo {
                fingerprint: 0,
                segment: 0,
                offset: 64,
            },
        ];
        encoder.shard(5, [1, 0, 0, 1, 0, 0], a.into_iter());
        encoder.shard(
            7,
            [0, 0, 0, 0, 0, 1],
            [EntryInfo {
                fingerprint: 12345,
                segment: 0,
                offset: 199,
            }]
            .into_iter(),
        );
        encoder.finish()
    }

    #[test]
    fn a_checkpoint_round_trips() {
        let bytes = sample();
        let decoded = decode(&bytes).unwrap();
        assert_eq!((decoded.shard_count, decoded.namespace_count), (2, 3));
        assert_eq!(decoded.entry_count, 3);
        assert_eq!(decoded.segments[1].valid_len, 1 << 24);
        assert_eq!(decoded.shards[0].lsn_counter, 5);
        assert_eq!(decoded.shards[1].state_counts, [0, 0, 0, 0, 0, 1]);
        let entries: Vec<_> = decoded.shards[0].entries().collect();
        assert_eq!(entries[0].fingerprint, (1 << 20) - 1);
        assert_eq!(entries[0].offset, (1 << 24) - 1);
        assert_eq!(entries[1].segment, 0);
        assert_eq!(
            decoded.shards[1].entries().next().unwrap().fingerprint,
            12345
        );
    }

    #[test]
    fn every_flipped_byte_and_every_truncation_is_rejected() {
        let bytes = sample();
        for i in 0..bytes.len() {
            for bit in [0x01, 0x80] {
                let mut damaged = bytes.clone();
                damaged[i] ^= bit;
                assert!(
                    decode(&damaged).is_err(),
                    "flip {bit:#x} at byte {i} accepted"
                );
            }
        }
        for len in 0..bytes.len() {
            assert!(
                decode(&bytes[..len]).is_err(),
                "truncation to {len} accepted"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&longer).is_err());
        assert!(decode(&vec![0u8; bytes.len()]).is_err());
    }
}
