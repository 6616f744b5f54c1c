//! Limits that hold for every store: a leaf every module may use.

/// Longest namespace name, in bytes.
pub const NAMESPACE_LEN_MAX: usize = 64;
/// Largest configurable `max_key_len` (ids are framed with a `u16` length).
pub const KEY_LEN_MAX: usize = u16::MAX as usize;
/// Largest configurable `max_result_len`.
pub const RESULT_LEN_MAX: usize = 1 << 20;
/// Most namespaces one store can hold.
pub const NAMESPACES_MAX: usize = 1 << 16;
/// Most shards.
pub const SHARDS_MAX: usize = 1 << 16;
/// Smallest and largest segment size (offsets in the index are `u32`).
pub const SEGMENT_SIZE_BYTES_MIN: u64 = 64 * 1024;
pub const SEGMENT_SIZE_BYTES_MAX: u64 = 16 << 20;
/// Smallest bucket width and ttl.
pub const BUCKET_WIDTH_MS_MIN: u64 = 1_000;
pub const TTL_MS_MIN: u64 = 1_000;
/// Largest `max_ttl`: 100 years.
pub const TTL_MS_MAX: u64 = 100 * 366 * 24 * 3600 * 1000;
/// Most ids in one `check_and_set_many` call.
pub const BATCH_LEN_MAX: usize = 1 << 16;

const _: () = assert!(SEGMENT_SIZE_BYTES_MIN < SEGMENT_SIZE_BYTES_MAX);
const _: () = assert!(KEY_LEN_MAX + RESULT_LEN_MAX + 128 < SEGMENT_SIZE_BYTES_MIN as usize * 32);
const _: () = assert!(NAMESPACE_LEN_MAX <= u8::MAX as usize);
