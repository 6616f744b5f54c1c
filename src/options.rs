//! Store options and their limits.

use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock};
use crate::error::Error;
use crate::format::{record, segment_header};
use crate::limits;

/// How much of an acknowledged operation survives a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Survives process crash, OS crash and power loss: calls return only after
    /// `fdatasync`. Concurrent callers share one fsync (group commit).
    Immediate,
    /// Survives a process crash (kill -9) always; an OS crash or power loss loses at
    /// most the last interval. A background thread syncs every interval.
    Interval(Duration),
    /// Nothing is promised after a crash. For tests and caches.
    None,
}

impl Default for Durability {
    fn default() -> Durability {
        Durability::Interval(Duration::from_millis(100))
    }
}

/// The options a store was opened with.
#[derive(Clone)]
pub(crate) struct Options {
    pub durability: Durability,
    pub bucket_width_ms: u64,
    pub shards: usize,
    pub max_key_len: usize,
    pub max_result_len: usize,
    pub max_ttl_ms: u64,
    pub segment_size_bytes: u64,
    pub strict: bool,
    pub read_only: bool,
    pub clock: Arc<dyn Clock>,
    pub replication: Option<crate::replication::replica::Replication>,
    /// Bytes of RAM the index may hold before the oldest buckets' entries move to
    /// the cold tier (`None`: no limit, everything stays in RAM).
    pub memory_budget: Option<u64>,
    /// Bits of each fingerprint in a cold generation's filter: 16 (a fresh key's probe
    /// of a generation reads a page once in 65,536) or 8 (once in 256, for half the
    /// filter's RAM).
    pub cold_filter_bits: u8,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            durability: Durability::default(),
            bucket_width_ms: 60_000,
            shards: 64,
            max_key_len: 1024,
            max_result_len: 4096,
            max_ttl_ms: 400 * 24 * 3600 * 1000,
            segment_size_bytes: 16 << 20,
            strict: false,
            read_only: false,
            clock: Arc::new(SystemClock),
            replication: None,
            memory_budget: None,
            cold_filter_bits: 16,
        }
    }
}

impl Options {
    pub(crate) fn validate(&self) -> Result<(), Error> {
        if let Durability::Interval(d) = self.durability
            && (d < Duration::from_millis(1) || d > Duration::from_secs(3600))
        {
            return Err(Error::invalid_option(format!(
                "Durability::Interval({d:?}): the interval must be between 1 ms and 1 hour"
            )));
        }
        if self.bucket_width_ms < limits::BUCKET_WIDTH_MS_MIN
            || self.bucket_width_ms > 24 * 3600 * 1000
        {
            return Err(Error::invalid_option(format!(
                "bucket_width of {} ms: it must be between 1 s and 1 day",
                self.bucket_width_ms
            )));
        }
        if !self.shards.is_power_of_two() || self.shards > limits::SHARDS_MAX {
            return Err(Error::invalid_option(format!(
                "shards = {}: it must be a power of two from 1 to {}",
                self.shards,
                limits::SHARDS_MAX
            )));
        }
        if self.max_key_len == 0 || self.max_key_len > limits::KEY_LEN_MAX {
            return Err(Error::invalid_option(format!(
                "max_key_len = {}: it must be from 1 to {}",
                self.max_key_len,
                limits::KEY_LEN_MAX
            )));
        }
        if self.max_result_len > limits::RESULT_LEN_MAX {
            return Err(Error::invalid_option(format!(
                "max_result_len = {}: it must be at most {}",
                self.max_result_len,
                limits::RESULT_LEN_MAX
            )));
        }
        if self.max_ttl_ms < limits::TTL_MS_MIN || self.max_ttl_ms > limits::TTL_MS_MAX {
            return Err(Error::invalid_option(format!(
                "max_ttl of {} ms: it must be between 1 s and 100 years",
                self.max_ttl_ms
            )));
        }
        if self.segment_size_bytes < limits::SEGMENT_SIZE_BYTES_MIN
            || self.segment_size_bytes > limits::SEGMENT_SIZE_BYTES_MAX
        {
            return Err(Error::invalid_option(format!(
                "segment_size of {} bytes: it must be between {} and {}",
                self.segment_size_bytes,
                limits::SEGMENT_SIZE_BYTES_MIN,
                limits::SEGMENT_SIZE_BYTES_MAX
            )));
        }
        if self.memory_budget == Some(0) {
            return Err(Error::invalid_option(
                "memory_budget of 0 bytes: give at least 1 byte, or no budget for an index kept wholly in RAM",
            ));
        }
        if !matches!(self.cold_filter_bits, 8 | 16) {
            return Err(Error::invalid_option(format!(
                "cold_filter_bits of {}: the cold tier's filters have 8- or 16-bit fingerprints",
                self.cold_filter_bits
            )));
        }
        if let Some(replication) = &self.replication {
            if self.read_only {
                return Err(Error::invalid_option(
                    "replication on a read-only store: a read-only store does not write, so it cannot own partitions",
                ));
            }
            replication.validate().map_err(Error::invalid_option)?;
        }
        // The largest record these limits allow must fit in one segment after its header.
        let record_len_max = record::HEADER_LEN
            + record::SCOPE_LEN
            + self.max_key_len
            + record::CLAIM_BODY_LEN
            + self.max_result_len;
        if (record_len_max + segment_header::LEN) as u64 > self.segment_size_bytes {
            return Err(Error::invalid_option(format!(
                "segment_size of {} bytes cannot hold the largest record that max_key_len ({}) and max_result_len ({}) allow ({record_len_max} bytes + a {}-byte header); raise segment_size or lower the limits",
                self.segment_size_bytes,
                self.max_key_len,
                self.max_result_len,
                segment_header::LEN
            )));
        }
        Ok(())
    }
}

/// Threads for the work that spreads over cores (replay, checkpoint rebuild) and
/// log stripes: one per core, at most 8.
pub(crate) fn parallelism() -> usize {
    const THREADS_MAX: usize = 8;
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, THREADS_MAX)
}

impl Options {
    /// One active segment per bucket for each core, up to 8 (and at most one per
    /// shard): writers on different cores then rarely contend for a segment's append
    /// lock.
    pub(crate) fn log_stripes(&self) -> usize {
        parallelism().min(self.shards)
    }
}
