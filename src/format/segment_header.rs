//! The 64-byte header at the start of every segment file.
//!
//! ```text
//! offset size field
//! 0      8    magic            b"IDEMSEG\0"
//! 8      4    version          2 (this build writes 2 and reads 1 and 2: v1 segments
//!                             have no partition-scoped records)
//! 12     4    header_len       64
//! 16     8    bucket_deadline  unix ms: every key in this segment is forgotten at this time
//! 24     8    segment_seq      unique per store, increasing
//! 32     8    created_ms       unix ms when the segment was created
//! 40     8    bucket_width_ms  the bucket width in force when it was created
//! 48     8    reserved         zero
//! 56     8    checksum         xxh3-64 of bytes 0..56
//! ```

use super::read_u64;

pub(crate) const MAGIC: [u8; 8] = *b"IDEMSEG\0";
pub(crate) const VERSION: u32 = 2;
/// The oldest segment version this build reads.
pub(crate) const VERSION_MIN: u32 = 1;

const MAGIC_OFFSET: usize = 0;
const VERSION_OFFSET: usize = MAGIC_OFFSET + 8;
const HEADER_LEN_OFFSET: usize = VERSION_OFFSET + 4;
const BUCKET_DEADLINE_OFFSET: usize = HEADER_LEN_OFFSET + 4;
const SEGMENT_SEQ_OFFSET: usize = BUCKET_DEADLINE_OFFSET + 8;
const CREATED_OFFSET: usize = SEGMENT_SEQ_OFFSET + 8;
const BUCKET_WIDTH_OFFSET: usize = CREATED_OFFSET + 8;
const RESERVED_OFFSET: usize = BUCKET_WIDTH_OFFSET + 8;
const CHECKSUM_OFFSET: usize = RESERVED_OFFSET + 8;
/// Length of the segment header; the first record starts here.
pub(crate) const LEN: usize = CHECKSUM_OFFSET + 8;

const _: () = assert!(LEN == 64);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    /// The format version the header carries (`VERSION` for every segment this build
    /// creates; an older one for a segment it only reads).
    pub version: u32,
    pub bucket_deadline_ms: u64,
    pub segment_seq: u64,
    pub created_ms: u64,
    pub bucket_width_ms: u64,
}

impl SegmentHeader {
    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        out[MAGIC_OFFSET..VERSION_OFFSET].copy_from_slice(&MAGIC);
        out[VERSION_OFFSET..HEADER_LEN_OFFSET].copy_from_slice(&self.version.to_le_bytes());
        out[HEADER_LEN_OFFSET..BUCKET_DEADLINE_OFFSET].copy_from_slice(&(LEN as u32).to_le_bytes());
        out[BUCKET_DEADLINE_OFFSET..SEGMENT_SEQ_OFFSET]
            .copy_from_slice(&self.bucket_deadline_ms.to_le_bytes());
        out[SEGMENT_SEQ_OFFSET..CREATED_OFFSET].copy_from_slice(&self.segment_seq.to_le_bytes());
        out[CREATED_OFFSET..BUCKET_WIDTH_OFFSET].copy_from_slice(&self.created_ms.to_le_bytes());
        out[BUCKET_WIDTH_OFFSET..RESERVED_OFFSET]
            .copy_from_slice(&self.bucket_width_ms.to_le_bytes());
        let checksum = xxhash_rust::xxh3::xxh3_64(&out[..CHECKSUM_OFFSET]);
        out[CHECKSUM_OFFSET..LEN].copy_from_slice(&checksum.to_le_bytes());
        out
    }

    /// Decodes a header; an error names what is wrong. Never panics.
    pub(crate) fn decode(bytes: &[u8]) -> Result<SegmentHeader, String> {
        if bytes.len() < LEN {
            return Err(format!(
                "segment header truncated: {} of {LEN} bytes",
                bytes.len()
            ));
        }
        if bytes[MAGIC_OFFSET..VERSION_OFFSET] != MAGIC {
            return Err("not an idemstore segment (bad magic)".to_string());
        }
        let checksum = read_u64(bytes, CHECKSUM_OFFSET);
        if checksum != xxhash_rust::xxh3::xxh3_64(&bytes[..CHECKSUM_OFFSET]) {
            return Err("segment header checksum mismatch".to_string());
        }
        let version = super::read_u32(bytes, VERSION_OFFSET);
        if !(VERSION_MIN..=VERSION).contains(&version) {
            return Err(format!(
                "segment format version {version} is not supported (this build reads versions {VERSION_MIN} to {VERSION})"
            ));
        }
        let header_len = super::read_u32(bytes, HEADER_LEN_OFFSET);
        if header_len as usize != LEN {
            return Err(format!(
                "segment header length {header_len}, expected {LEN}"
            ));
        }
        if read_u64(bytes, RESERVED_OFFSET) != 0 {
            return Err("segment header reserved field is not zero".to_string());
        }
        Ok(SegmentHeader {
            version,
            bucket_deadline_ms: read_u64(bytes, BUCKET_DEADLINE_OFFSET),
            segment_seq: read_u64(bytes, SEGMENT_SEQ_OFFSET),
            created_ms: read_u64(bytes, CREATED_OFFSET),
            bucket_width_ms: read_u64(bytes, BUCKET_WIDTH_OFFSET),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_rejects_damage() {
        let header = SegmentHeader {
            version: VERSION,
            bucket_deadline_ms: 1_700_000_060_000,
            segment_seq: 7,
            created_ms: 1_700_000_000_000,
            bucket_width_ms: 60_000,
        };
        let bytes = header.encode();
        assert_eq!(SegmentHeader::decode(&bytes), Ok(header));
        for i in 0..LEN {
            let mut damaged = bytes;
            damaged[i] ^= 0x10;
            assert!(
                SegmentHeader::decode(&damaged).is_err(),
                "flip at byte {i} accepted"
            );
        }
        assert!(SegmentHeader::decode(&bytes[..63]).is_err());
        assert!(SegmentHeader::decode(&[0u8; LEN]).is_err());
    }
}
