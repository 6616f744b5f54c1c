//! Entry points for the fuzz targets in `fuzz/` and their regression replays in
//! `tests/fuzz_regressions.rs`. Not part of the supported API: thin wrappers over the
//! crate-private codecs, so the targets exercise exactly the code recovery runs.
//!
//! Every function here must never panic, whatever the bytes: that is what the fuzz
//! targets check.

use crate::format::{namespace_file, record, segment_header};
use crate::log::reader;

/// A record decoded from the start of a buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedRecord {
    /// Encoded length: the record is `bytes[..len]`.
    pub len: usize,
    /// The namespace id the record names.
    pub namespace_id: u32,
    /// Its log sequence number.
    pub lsn: u64,
    /// The id bytes.
    pub id: Vec<u8>,
    /// The record encoded again from its decoded fields.
    pub reencoded: Vec<u8>,
}

/// Decodes and verifies the record at the start of `bytes`; `Err` says why not.
pub fn decode_record(bytes: &[u8]) -> Result<DecodedRecord, String> {
    let (decoded, len) = record::decode(bytes).map_err(|e| format!("{e:?}"))?;
    let mut reencoded = vec![0u8; decoded.encoded_len()];
    decoded.encode_into(&mut reencoded);
    Ok(DecodedRecord {
        len,
        namespace_id: decoded.namespace_id,
        lsn: decoded.lsn.0,
        id: decoded.id.to_vec(),
        reencoded,
    })
}

/// Encodes a `check_and_set` mark record (for seeds and hand-made damage).
pub fn encode_mark(namespace_id: u32, lsn: u64, first_seen_ms: u64, id: &[u8]) -> Vec<u8> {
    let record = record::StoredRecord {
        state: record::State::Seen,
        namespace_id,
        placement: record::Placement::UNSCOPED,
        lsn: crate::addr::Lsn(lsn),
        first_seen_ms,
        id,
        claim: record::ClaimFields::default(),
        result: None,
    };
    let mut out = vec![0u8; record.encoded_len()];
    record.encode_into(&mut out);
    out
}

/// Encodes a partition-scoped `check_and_set` mark record (format v2), as a
/// partition's changelog carries them.
pub fn encode_scoped_mark(
    partition: u32,
    offset: Option<u64>,
    lsn: u64,
    first_seen_ms: u64,
    id: &[u8],
) -> Vec<u8> {
    let record = record::StoredRecord {
        state: record::State::Seen,
        namespace_id: 0,
        placement: record::Placement {
            partition: Some(partition),
            offset,
        },
        lsn: crate::addr::Lsn(lsn),
        first_seen_ms,
        id,
        claim: record::ClaimFields::default(),
        result: None,
    };
    let mut out = vec![0u8; record.encoded_len()];
    record.encode_into(&mut out);
    out
}

/// The fields of a segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeaderFields {
    /// The format version (1 or 2).
    pub version: u32,
    /// Unix ms at which every key in the segment is forgotten.
    pub bucket_deadline_ms: u64,
    /// Segment sequence number.
    pub segment_seq: u64,
    /// Unix ms of creation (the store clock's floor at open).
    pub created_ms: u64,
    /// Bucket width in force at creation.
    pub bucket_width_ms: u64,
}

/// Length of a segment header; the first record starts here.
pub const SEGMENT_HEADER_LEN: usize = segment_header::LEN;

/// Decodes a segment header; `Err` says what is wrong.
pub fn decode_segment_header(bytes: &[u8]) -> Result<SegmentHeaderFields, String> {
    segment_header::SegmentHeader::decode(bytes).map(|h| SegmentHeaderFields {
        version: h.version,
        bucket_deadline_ms: h.bucket_deadline_ms,
        segment_seq: h.segment_seq,
        created_ms: h.created_ms,
        bucket_width_ms: h.bucket_width_ms,
    })
}

/// Encodes a segment header.
pub fn encode_segment_header(fields: SegmentHeaderFields) -> [u8; SEGMENT_HEADER_LEN] {
    segment_header::SegmentHeader {
        version: fields.version,
        bucket_deadline_ms: fields.bucket_deadline_ms,
        segment_seq: fields.segment_seq,
        created_ms: fields.created_ms,
        bucket_width_ms: fields.bucket_width_ms,
    }
    .encode()
}

/// The file name of a segment.
pub fn segment_file_name(bucket_deadline_ms: u64, segment_seq: u64) -> String {
    crate::layout::segment_file_name(bucket_deadline_ms, segment_seq)
}

/// Parses a segment file name into (bucket deadline, seq).
pub fn parse_segment_file_name(name: &str) -> Option<(u64, u64)> {
    crate::layout::parse_segment_file_name(name)
}

/// Decodes a `NAMESPACES` file: the names in id order and the valid length, or the
/// offset and reason of damage before the end.
pub fn decode_namespace_file(bytes: &[u8]) -> Result<(Vec<String>, usize), (usize, String)> {
    namespace_file::decode(bytes).map(|d| (d.names, d.valid_len))
}

/// Encodes a `NAMESPACES` file holding `names` (ids 0, 1, ...).
pub fn encode_namespace_file(names: &[&str]) -> Vec<u8> {
    let mut out = namespace_file::encode_header().to_vec();
    for (id, name) in names.iter().enumerate() {
        out.extend(namespace_file::encode_entry(id as u32, name));
    }
    out
}

/// What a scan of a segment buffer found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scan {
    /// (offset, encoded length) of every valid record, in order.
    pub records: Vec<(usize, usize)>,
    /// End of the last valid record.
    pub valid_end: usize,
    /// Offsets of damaged regions that valid records follow.
    pub corrupt_offsets: Vec<usize>,
    /// Whether undecodable, non-zero bytes end the buffer.
    pub torn_tail: bool,
}

/// Scans `bytes[start..]` the way recovery scans a segment.
pub fn scan_segment(bytes: &[u8], start: usize) -> Scan {
    let mut records = Vec::new();
    let report = reader::scan(bytes, start, |offset, record| {
        records.push((offset, record.encoded_len()));
    });
    Scan {
        records,
        valid_end: report.valid_end,
        corrupt_offsets: report.corrupt_offsets,
        torn_tail: report.torn_tail,
    }
}

/// A changelog message decoded (`docs/FORMAT.md`, "Changelog messages").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedChangelogMessage {
    /// The owner token of its writer.
    pub owner: u64,
    /// Its writer's message counter.
    pub batch: u64,
    /// The partition.
    pub partition: u32,
    /// `(bucket deadline, source offset, id)` of each record.
    pub records: Vec<(u64, Option<u64>, Vec<u8>)>,
    /// The message encoded again from its decoded fields.
    pub reencoded: Vec<u8>,
}

/// Decodes and verifies a changelog message; `Err` says why not.
pub fn decode_changelog_message(bytes: &[u8]) -> Result<DecodedChangelogMessage, String> {
    use crate::format::changelog;
    let message = changelog::decode(bytes).map_err(|e| format!("{e:?}"))?;
    let encoded: Vec<(u64, Vec<u8>)> = message
        .records
        .iter()
        .map(|(deadline, record)| {
            let mut out = vec![0u8; record.encoded_len()];
            record.encode_into(&mut out);
            (*deadline, out)
        })
        .collect();
    let borrowed: Vec<(u64, &[u8])> = encoded.iter().map(|(d, r)| (*d, r.as_slice())).collect();
    Ok(DecodedChangelogMessage {
        owner: message.header.owner,
        batch: message.header.batch,
        partition: message.header.partition,
        records: message
            .records
            .iter()
            .map(|(deadline, record)| (*deadline, record.placement.offset, record.id.to_vec()))
            .collect(),
        reencoded: changelog::encode(&message.header, &borrowed),
    })
}

/// Encodes a records changelog message (for seeds and tests): `records` are
/// `(bucket deadline, record bytes)`, e.g. from [`encode_scoped_mark`].
pub fn encode_changelog_message(
    namespace: &str,
    partition: u32,
    owner: u64,
    batch: u64,
    records: &[(u64, Vec<u8>)],
) -> Vec<u8> {
    use crate::format::changelog;
    let borrowed: Vec<(u64, &[u8])> = records.iter().map(|(d, r)| (*d, r.as_slice())).collect();
    let header = changelog::MessageHeader {
        kind: changelog::Kind::Records,
        namespace,
        partition,
        owner,
        batch,
    };
    changelog::encode(&header, &borrowed)
}

/// A cold index file (issue 11) decoded whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedColdIndex {
    /// Its generation number.
    pub generation: u64,
    /// `(segment seq, bucket deadline, covered length)` of each segment its entries
    /// point into.
    pub segments: Vec<(u64, u64, u64)>,
    /// `(key hash, segment position, offset)` of each entry, in file order.
    pub entries: Vec<(u64, u32, u32)>,
    /// Whether the file's filter says "may contain" for every entry's key hash.
    pub filter_holds_every_entry: bool,
    /// The file encoded again from its decoded fields.
    pub reencoded: Vec<u8>,
}

/// Decodes and verifies a whole cold index file; `Err` says why not.
pub fn decode_cold_index(bytes: &[u8]) -> Result<DecodedColdIndex, String> {
    use crate::format::cold_index;
    let decoded = cold_index::decode_file(bytes).map_err(|e| format!("{e:?}"))?;
    let sections = &decoded.sections;
    Ok(DecodedColdIndex {
        generation: decoded.header.generation,
        segments: decoded
            .sections
            .segments
            .iter()
            .map(|s| (s.seq, s.bucket_deadline_ms, s.covered_len))
            .collect(),
        entries: decoded
            .entries
            .iter()
            .map(|e| (e.key_hash, e.segment, e.field))
            .collect(),
        filter_holds_every_entry: decoded.entries.iter().all(|e| match e.trusted() {
            false => sections.filter.may_contain(e.key_hash),
            true => sections.trusted.may_contain(e.key_hash),
        }),
        reencoded: cold_index::encode(
            decoded.header.generation,
            &decoded.sections.segments,
            &decoded.entries,
            decoded.sections.filter.is_wide(),
        ),
    })
}

/// Encodes a cold index file (for seeds and tests): `segments` are `(seq, bucket
/// deadline, covered length)`, `entries` `(key hash, segment position, offset field)`
/// (the offset, with bit 31 set for a trusted entry), sorted here.
pub fn encode_cold_index(
    generation: u64,
    segments: &[(u64, u64, u64)],
    entries: &[(u64, u32, u32)],
) -> Vec<u8> {
    use crate::format::cold_index::{self, ColdEntry, ColdSegment};
    let segments: Vec<ColdSegment> = segments
        .iter()
        .map(|&(seq, bucket_deadline_ms, covered_len)| ColdSegment {
            seq,
            bucket_deadline_ms,
            covered_len,
        })
        .collect();
    let mut entries: Vec<ColdEntry> = entries
        .iter()
        .map(|&(key_hash, segment, field)| {
            ColdEntry::decode(key_hash, segment, field).expect("an offset below 2^24")
        })
        .collect();
    entries.sort();
    cold_index::encode(generation, &segments, &entries, true)
}

/// Decodes a `COLD_STATE` file (issue 11) and encodes what it decoded again: a file
/// that decodes must re-encode to exactly its own bytes. `Err` says why it does not
/// decode.
pub fn reencode_cold_state(bytes: &[u8]) -> Result<Vec<u8>, String> {
    use crate::format::cold_state;
    let state = cold_state::decode(bytes)?;
    Ok(cold_state::encode(&state))
}

/// A `COLD_STATE` file (for seeds and tests): two generations, one segment, 2 shards.
pub fn cold_state_seed() -> Vec<u8> {
    use crate::format::cold_state::{
        self, ColdState, GenerationState, PartitionOffset, SegmentState,
    };
    cold_state::encode(&ColdState {
        shard_count: 2,
        checkpoint_hash: Some(0x1234_5678_9abc_def0),
        next_generation: 12,
        lsn_floor: 0x0001_0000,
        generations: vec![
            GenerationState {
                number: 3,
                entry_count: 300,
                header_checksum: 0xfeed_f00d,
                dead: vec![(0, 0b1010), (3, 1 << 63)],
            },
            GenerationState {
                number: 11,
                entry_count: 7,
                header_checksum: 0xdead_beef,
                dead: Vec::new(),
            },
        ],
        segments: vec![SegmentState {
            seq: 5,
            deadline_ms: 1_700_000_060_000,
            covered_len: 8192,
            rows: [
                Some(vec![100, 90]),
                Some(vec![1, 0]),
                None,
                Some(vec![3, 7]),
                Some(vec![4, 0]),
                Some(vec![5, 1]),
            ],
        }],
        partitions: vec![PartitionOffset {
            namespace_id: 1,
            partition: 7,
            highest_offset: 4_242,
        }],
        open_counters: vec![3, 4],
    })
}
