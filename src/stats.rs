//! [`Stats`]: a snapshot of the store's counters. Plain data; `Store::stats`
//! gathers it from the rooms that keep each figure.

use std::time::Duration;

use crate::operations::OperationStats;

/// A snapshot of the store's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Keys remembered (any status; removed keys excluded).
    pub live_keys: u64,
    /// Keys marked by `check_and_set`.
    pub seen: u64,
    /// Keys held by a claim (including claims whose lease ran out).
    pub in_progress: u64,
    /// Keys released by their last claim.
    pub released: u64,
    /// Keys completed.
    pub completed: u64,
    /// Keys failed for good.
    pub failed: u64,
    /// Removed keys whose tombstone is still indexed (until its bucket expires).
    pub tombstones: u64,
    /// Namespaces defined.
    pub namespaces: u64,
    /// Memory held by the index tables, in bytes.
    pub index_bytes: u64,
    /// Disk space reserved by segment files, in bytes.
    pub disk_bytes: u64,
    /// Bytes of records in the log.
    pub log_bytes: u64,
    /// Segment files.
    pub segments: u64,
    /// Expiry buckets with at least one segment.
    pub buckets: u64,
    /// Damaged records skipped at open (each logged at error level).
    pub corrupt_records_skipped: u64,
    /// Torn tails cut at open (normal after a crash).
    pub torn_tails_cut: u64,
    /// Files in the directory that are not idemstore's (left alone).
    pub foreign_files: u64,
    /// Records replayed at open.
    pub records_replayed: u64,
    /// Claims in progress found at open, released because the process that held them
    /// is gone (the directory lock proves it); their attempt counts stay.
    pub claims_released_at_open: u64,
    /// How long the last open's recovery took.
    pub recovery_time: Duration,
    /// The last open rebuilt the index from the checkpoint a clean close wrote,
    /// without replaying the log (`records_replayed` is then 0).
    pub opened_from_checkpoint: bool,
    /// Buckets expired and deleted since open.
    pub expired_buckets: u64,
    /// Keys forgotten by expiry since open.
    pub expired_keys: u64,
    /// Completed sync rounds (group commits) since open.
    pub sync_rounds: u64,
    /// Operations that waited for a sync since open.
    pub durable_waits: u64,
    /// Per-operation counts and sampled latencies since open.
    pub operations: OperationStats,
    /// How far behind the reaper is: now minus the oldest bucket deadline that has
    /// passed but whose files are not deleted yet; zero when it is caught up. (Keys of
    /// such a bucket are already treated as forgotten; only their space is held.)
    pub expiry_lag: Duration,
    /// Replication of partition-scoped namespaces (all zero when not replicated).
    pub replication: ReplicationStats,
    /// The cold tier: index entries moved to disk under a `memory_budget` (all zero
    /// without one). `index_bytes` counts the hot tables only.
    pub cold: ColdTierStats,
}

/// What the cold tier holds and did (`Stats::cold`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ColdTierStats {
    /// Generation files open now (at most 16; the merger thread brings them down to 8).
    pub generations: u64,
    /// Index entries in them (keys since rewritten, whose newer entry is hot or in a
    /// newer generation, included until a merge or expiry drops them).
    pub entries: u64,
    /// RAM the cold tier keeps: the generations' filters, page fences, segment tables
    /// and dead bits, and the spilled segments' per-shard counters.
    pub ram_bytes: u64,
    /// Bytes of generation files on disk.
    pub disk_bytes: u64,
    /// Buckets spilled since open.
    pub spills: u64,
    /// Merges since open (each merges two or three adjacent generations into one).
    pub merges: u64,
    /// Index entries moved out of the hot tables since open.
    pub spilled_keys: u64,
    /// Generation files this open took over from the previous one (`COLD_STATE`),
    /// after a clean close or a crash.
    pub reused_at_open: u64,
    /// Generation files this open found but could not reuse — no usable cold state, a
    /// damaged or missing file: deleted, and their keys rebuilt from the log by the
    /// replay.
    pub rebuilt_at_open: u64,
    /// Damaged generation pages lookups and merges met since open (for a lookup, an
    /// `Error::Corruption` for the call that met it, never an answer; a merge fails and
    /// its generation is left out of later merges). The first one removes
    /// `COLD_STATE`, so that the next open rebuilds the tier from the log.
    pub damaged_pages: u64,
}

/// What replication did and holds (`Stats::replication`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReplicationStats {
    /// Partitions this store has state for (restored, released or fenced).
    pub partitions: u64,
    /// Partitions this store owns now.
    pub owned: u64,
    /// Partitions another owner took over from this store.
    pub fenced: u64,
    /// Records written and not yet stored by the cluster.
    pub queued_records: u64,
    /// Their bytes (the `buffer_bytes` budget applies per partition).
    pub queued_bytes: u64,
    /// Records stored by the cluster since open.
    pub shipped_records: u64,
    /// Changelog messages stored since open.
    pub shipped_messages: u64,
    /// Bytes of records stored since open.
    pub shipped_bytes: u64,
    /// How long the oldest record queued now has waited (zero when none is).
    pub lag: Duration,
    /// Restores since open, and the changelog messages they read.
    pub restores: u64,
    /// Changelog messages restores read.
    pub restored_messages: u64,
    /// Records restores applied.
    pub restored_records: u64,
    /// Changelog messages that failed their checksum or structure check, skipped.
    pub damaged_messages: u64,
    /// Live local records restores queued to ship again, after this store stopped
    /// owning a partition with records unshipped or crashed owning it.
    pub reshipped_records: u64,
}
