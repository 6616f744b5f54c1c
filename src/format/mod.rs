//! The on-disk format: a pure codec, no I/O. `docs/FORMAT.md` is the specification;
//! the offset constants here mirror it field by field.
//!
//! Every decoder in this module returns an error for malformed input and never panics,
//! whatever the bytes.

pub(crate) mod changelog;
pub(crate) mod checkpoint;
// The cold index tier's codecs (issue 11): the files and the state kept at a clean
// close. (Some of `cold_index` only the fuzz target and the tests use.)
#[allow(dead_code)]
pub(crate) mod cold_index;
pub(crate) mod cold_state;
pub(crate) mod namespace_file;
pub(crate) mod partitions;
pub(crate) mod record;
pub(crate) mod segment_header;

/// Reads a little-endian `u16` at `at`; the caller has checked the bounds.
#[inline]
pub(crate) fn read_u16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

#[inline]
pub(crate) fn read_u32(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

#[inline]
pub(crate) fn read_u64(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

/// The checksum used for records and namespace entries: the low 32 bits of xxh3-64.
#[inline]
pub(crate) fn checksum32(bytes: &[u8]) -> u32 {
    xxhash_rust::xxh3::xxh3_64(bytes) as u32
}
