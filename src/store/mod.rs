//! [`Store`]: the orchestrator. Opening wires the rooms together — the log, the
//! index, recovery, the NAMESPACES table (`namespaces`), the group commit, expiry
//! (`crate::expiry`) — and every operation then flows down through them:
//! `keys` (the operations on one key) → `mutation` (the one write path, with
//! `crate::lifecycle` deciding) → index and log → io. `close` has its own room, and
//! so do the counters (`crate::stats`, gathered here).

mod close;
mod keys;
mod mutation;
mod namespaces;
mod records;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::{Clock, MonotonicTime, UnixMs, duration_ms_ceil};
use crate::error::Error;
use crate::expiry::Expiry;
use crate::index::{Index, StateCounts};
use crate::io::{DirLock, OsVfs, Vfs};
use crate::log::Log;
use crate::log::commit::Committer;
use crate::namespace::{Namespace, Policy};
use crate::operations::{Operations, Timed};
use crate::options::{Durability, Options, limits};
use crate::poison::Poison;
use crate::recovery::{self, RecoveryReport};
use crate::stats::Stats;
use namespaces::Namespaces;

pub(crate) use keys::Resolved;

/// An open store. Cheap to clone; every clone is the same store. `Send + Sync`.
///
/// The last handle dropped closes the store; [`Store::close`] does it explicitly and
/// reports errors.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.inner.dir)
            .finish()
    }
}

/// Options for [`Store::builder`].
pub struct StoreBuilder {
    dir: PathBuf,
    options: Options,
}

impl StoreBuilder {
    /// How acknowledged operations survive crashes (default `Interval(100 ms)`).
    pub fn durability(mut self, durability: Durability) -> Self {
        self.options.durability = durability;
        self
    }

    /// Width of an expiry bucket (default 1 min, at least 1 s). A key is remembered
    /// for at most its ttl plus one width.
    pub fn bucket_width(mut self, width: Duration) -> Self {
        self.options.bucket_width_ms = duration_ms_ceil(width);
        self
    }

    /// Number of index shards, a power of two (default 64).
    pub fn shards(mut self, shards: usize) -> Self {
        self.options.shards = shards;
        self
    }

    /// Longest id in bytes (default 1024, at most 65535).
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.options.max_key_len = len;
        self
    }

    /// Longest stored result in bytes (default 4096, at most 1 MiB).
    pub fn max_result_len(mut self, len: usize) -> Self {
        self.options.max_result_len = len;
        self
    }

    /// Longest ttl or lease a policy may ask for (default 400 days).
    pub fn max_ttl(mut self, ttl: Duration) -> Self {
        self.options.max_ttl_ms = duration_ms_ceil(ttl);
        self
    }

    /// Size of one segment file (default and largest 16 MiB, at least 64 KiB and at least
    /// the largest record the key and result limits allow).
    pub fn segment_size(mut self, bytes: u64) -> Self {
        self.options.segment_size_bytes = bytes;
        self
    }

    /// Opens for reading only (default false): the open changes nothing in the
    /// directory (no torn tail is cut, no expired file deleted, no checkpoint
    /// rewritten, nothing synced), holds the directory lock like any open, runs no
    /// background thread, and every write answers `Error::ReadOnly`. For tools that
    /// inspect a store (`idemstore stats`, `get`, `scan`, `export`).
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.options.read_only = read_only;
        self
    }

    /// Refuse to open on any damaged record (`Error::Corruption` with file and offset)
    /// instead of skipping and counting it (default false).
    pub fn strict(mut self, strict: bool) -> Self {
        self.options.strict = strict;
        self
    }

    /// Where time comes from (default the system clock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.options.clock = Arc::new(clock);
        self
    }

    /// Opens the store, creating the directory if needed, and replays the log.
    pub fn open(self) -> Result<Store, Error> {
        Store::open_with(self.dir, self.options, Arc::new(OsVfs))
    }

    /// Opens the store on another file system backend (the simulator of
    /// `idemstore::testing`).
    #[cfg(feature = "testing")]
    pub(crate) fn open_on(self, vfs: Arc<dyn Vfs>) -> Result<Store, Error> {
        Store::open_with(self.dir, self.options, vfs)
    }
}

pub(crate) struct Inner {
    pub(crate) options: Options,
    pub(crate) dir: PathBuf,
    time: MonotonicTime,
    index: Index,
    log: Arc<Log>,
    committer: Arc<Committer>,
    poison: Arc<Poison>,
    namespaces: Namespaces,
    closed: AtomicBool,
    recovery: RecoveryReport,
    claims_released_at_open: u64,
    expiry: Arc<Expiry>,
    operations: Operations,
    threads: Mutex<Vec<JoinHandle<()>>>,
    lock: Mutex<Option<DirLock>>,
}

impl Store {
    /// Opens (or creates) the store in `dir` with the defaults.
    pub fn open(dir: impl AsRef<Path>) -> Result<Store, Error> {
        Store::builder(dir).open()
    }

    /// A builder for a store in `dir`.
    pub fn builder(dir: impl AsRef<Path>) -> StoreBuilder {
        StoreBuilder {
            dir: dir.as_ref().to_path_buf(),
            options: Options::default(),
        }
    }

    pub(crate) fn open_with(
        dir: PathBuf,
        options: Options,
        vfs: Arc<dyn Vfs>,
    ) -> Result<Store, Error> {
        options.validate()?;
        let read_only = options.read_only;
        if read_only {
            // Nothing is created: a missing directory is an error.
            vfs.list(&dir)
                .map_err(|e| Error::io("opening read-only", &dir, e))?;
        } else {
            vfs.create_dir_all(&dir)
                .map_err(|e| Error::io("creating directory", &dir, e))?;
        }
        let lock = vfs
            .try_lock_dir(&dir)
            .map_err(|e| Error::io("locking directory", &dir, e))?
            .ok_or_else(|| Error::Locked { path: dir.clone() })?;

        let namespaces = Namespaces::open(vfs.as_ref(), &dir, read_only)?;
        let poison = Arc::new(Poison::default());
        let log = Arc::new(Log::new(
            dir.clone(),
            Arc::clone(&vfs),
            Arc::clone(&poison),
            options.segment_size_bytes,
            options.bucket_width_ms,
            options.log_stripes(),
            1,
        ));
        let index = Index::new(options.shards);
        let recovery = recovery::recover(
            &log,
            &index,
            vfs.as_ref(),
            &options,
            namespaces.count(),
            read_only,
        )?;
        let claims_released_at_open = index.finish_recovery();
        if claims_released_at_open > 0 {
            tracing::info!(
                claims = claims_released_at_open,
                "released the claims in progress of the process that held the store before"
            );
        }
        if !read_only {
            namespaces.trim_torn_tail()?;
        }
        let time = MonotonicTime::new(Arc::clone(&options.clock), UnixMs(recovery.clock_floor_ms));
        let committer = Arc::new(Committer::new(Arc::clone(&poison)));

        let inner = Arc::new(Inner {
            dir,
            time,
            index,
            log: Arc::clone(&log),
            committer: Arc::clone(&committer),
            poison,
            namespaces,
            closed: AtomicBool::new(false),
            recovery,
            claims_released_at_open,
            expiry: Arc::new(Expiry::default()),
            operations: Operations::new(options.shards),
            threads: Mutex::new(Vec::new()),
            lock: Mutex::new(Some(lock)),
            options,
        });
        if !read_only {
            let interval = match inner.options.durability {
                Durability::Interval(d) => Some(d),
                Durability::Immediate | Durability::None => None,
            };
            let commit_thread = committer.spawn(log, interval);
            let period_ms = (inner.options.bucket_width_ms / 4).clamp(10, 1_000);
            let reaper_thread =
                inner
                    .expiry
                    .spawn(Arc::downgrade(&inner), period_ms, |inner: &Inner| {
                        inner.reap()
                    });
            inner.threads.lock().extend([commit_thread, reaper_thread]);
        }
        Ok(Store { inner })
    }

    /// A handle for the namespace `name` (created on first use) with `policy`.
    pub fn namespace(&self, name: &str, policy: Policy) -> Result<Namespace, Error> {
        self.inner.check_open()?;
        if name.is_empty() || name.len() > limits::NAMESPACE_LEN_MAX {
            return Err(Error::invalid_key(format!(
                "namespace {name:?} is {} bytes; it must be 1 to {} bytes",
                name.len(),
                limits::NAMESPACE_LEN_MAX
            )));
        }
        self.inner.validate_policy(&policy)?;
        let id = self.inner.namespaces.id(name, &self.inner.poison)?;
        Ok(Namespace::new(Arc::clone(&self.inner), id, name, policy))
    }

    /// Makes every operation acknowledged so far durable, whatever the durability mode.
    pub fn flush(&self) -> Result<(), Error> {
        self.inner.check_writable()?;
        self.inner.committer.wait_durable()
    }

    /// Expires every bucket whose deadline has passed now, instead of waiting for the
    /// background reaper. Returns the number of keys forgotten.
    pub fn expire_now(&self) -> Result<u64, Error> {
        self.inner.check_writable()?;
        self.inner.reap()
    }

    /// The store's counters.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// The directory this store lives in.
    pub fn path(&self) -> &Path {
        &self.inner.dir
    }

    /// Syncs everything (but in `Durability::None`), stops the background threads,
    /// writes the index checkpoint and releases the directory. Every later operation
    /// on this store or its namespaces returns `Error::Closed`. A read-only store
    /// only releases the directory.
    pub fn close(&self) -> Result<(), Error> {
        self.inner.close()
    }

    /// Reports the store's figures through the `metrics` facade (feature `metrics`);
    /// call it periodically, e.g. before each scrape. Counters (`*_total`: operations
    /// by answer, expired buckets and keys, sync rounds, corrupt records skipped) are
    /// set to their totals since open; gauges hold keys by status, disk and index
    /// bytes, segments, buckets, `idemstore_expiry_lag_seconds`, and the sampled
    /// latency quantiles (`idemstore_*_latency_seconds{quantile="0.5"|"0.99"|"0.999"}`).
    /// Sampled latencies are also recorded as they happen, into the histograms
    /// `idemstore_check_and_set_seconds` and `idemstore_begin_seconds`.
    ///
    /// The metrics carry no store label: a process with several stores should export
    /// from one of them, or read [`Store::stats`] itself.
    #[cfg(feature = "metrics")]
    pub fn export_metrics(&self) {
        crate::telemetry::export(&self.stats());
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "closing the store on drop failed");
        }
    }
}

impl Inner {
    pub(crate) fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// Open, and not read-only.
    pub(crate) fn check_writable(&self) -> Result<(), Error> {
        self.check_open()?;
        if self.options.read_only {
            return Err(Error::ReadOnly);
        }
        Ok(())
    }

    /// Records the latency of a call started at `started` (`operations::start_timer`).
    pub(crate) fn record_latency(&self, timed: Timed, started: Option<Instant>) {
        let Some(_elapsed) = self.operations.record_latency(timed, started) else {
            return;
        };
        #[cfg(feature = "metrics")]
        crate::telemetry::record_latency(timed, _elapsed);
    }

    fn reap(&self) -> Result<u64, Error> {
        self.expiry.reap(&self.log, &self.index, self.time.now())
    }

    fn stats(&self) -> Stats {
        let mut counts = StateCounts::default();
        let mut index_bytes = 0u64;
        for shard in self.index.shards() {
            let shard = shard.lock();
            for (total, count) in counts.counts.iter_mut().zip(shard.counts.counts) {
                *total += count;
            }
            index_bytes += shard.allocation_size() as u64;
        }
        let [seen, in_progress, released, completed, failed, tombstones] = counts.counts;
        let now_ms = self.time.now().0;
        let log = self.log.usage();
        let (expired_buckets, expired_keys) = self.expiry.totals();
        Stats {
            live_keys: seen + in_progress + released + completed + failed,
            seen,
            in_progress,
            released,
            completed,
            failed,
            tombstones,
            namespaces: self.namespaces.count() as u64,
            index_bytes,
            disk_bytes: log.disk_bytes,
            log_bytes: log.log_bytes,
            segments: log.segments,
            buckets: log.buckets,
            corrupt_records_skipped: self.recovery.corrupt_records_skipped,
            torn_tails_cut: self.recovery.torn_tails_cut,
            foreign_files: self.recovery.foreign_files,
            records_replayed: self.recovery.records_replayed,
            claims_released_at_open: self.claims_released_at_open,
            recovery_time: self.recovery.duration,
            opened_from_checkpoint: self.recovery.opened_from_checkpoint,
            expired_buckets,
            expired_keys,
            sync_rounds: self.committer.rounds.load(Ordering::Relaxed),
            durable_waits: self.committer.waits.load(Ordering::Relaxed),
            operations: self.operations.snapshot(),
            expiry_lag: Duration::from_millis(now_ms - log.oldest_deadline_ms.min(now_ms)),
        }
    }
}
