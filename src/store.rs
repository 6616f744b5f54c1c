//! [`Store`], the public handle of an open store, and its [`StoreBuilder`]. Every
//! call goes to the engine (`crate::engine`), which the handles share.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::answer::Record;
use crate::clock::{Clock, duration_ms_ceil};
use crate::durable::Durable;
use crate::engine::Engine;
use crate::error::Error;
use crate::io::{OsVfs, Vfs};
use crate::namespace::Namespace;
use crate::options::{Durability, Options};
use crate::policy::Policy;
use crate::stats::Stats;

/// An open store. Cheap to clone; every clone is the same store. `Send + Sync`.
///
/// The last handle dropped closes the store; [`Store::close`] does it explicitly and
/// reports errors.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Engine>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("dir", &self.inner.dir())
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

    /// Width of an expiry bucket (default 1 min, 1 s to 1 day). A key is remembered
    /// for at most its ttl plus `max(width, ttl / 1024)` (docs/CONTRACT.md §1.3).
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

    /// Replicates the store's partition handles (`Namespace::partition`) to a
    /// changelog (`docs/REPLICATION.md`): each partition is written only where it is
    /// owned (`restore_partition` on assignment, `release_partition` on revoke), and
    /// its records ship to the changelog, in the background (`ReplicationMode::Async`,
    /// with `flush_partition`) or before each call returns (`Sync`). Namespaces used
    /// without a partition stay local.
    pub fn replication(mut self, replication: crate::Replication) -> Self {
        self.options.replication = Some(replication);
        self
    }

    /// Bytes of RAM the index may use (default: no limit). While the hot index fits,
    /// nothing changes; beyond it, the background reaper moves the index entries of
    /// the oldest buckets to immutable cold index files on disk, each fronted in RAM by
    /// a binary fuse filter and its page fences (about 2.4 bytes per cold key with the
    /// dead bits, 1.3 with `cold_filter_bits(8)`). Lookups stay exact: a filter hit
    /// reads one page and the record, and the key's bytes are compared
    /// (docs/ARCHITECTURE.md, "The cold tier"). The budget is checked each reaper round (every `bucket_width / 4`, 10 ms to 1 s), so the
    /// index can exceed it by what one round writes. A reopened store takes the
    /// generation files over (through `COLD_STATE`, after a clean close or a crash) and
    /// replays only the records no spill walked; without a usable state it rebuilds the
    /// index from the log, then spills again.
    pub fn memory_budget(mut self, bytes: u64) -> Self {
        self.options.memory_budget = Some(bytes);
        self
    }

    /// Bits of each fingerprint in the filters of the cold tier's generations: 16 (the
    /// default) or 8. A fresh key probes every generation's filter, and a false
    /// positive reads one page of its index file, from disk once the cold files
    /// outgrow the page cache: 16-bit fingerprints make that once in 65,536 probes
    /// for about 2.3 bytes of RAM per cold key, 8-bit ones once in 256 for about 1.1
    /// (docs/BENCHMARKS.md, "The cold filter's width at a billion keys"). Files
    /// written with either width are read with either setting; a merge writes the
    /// current one.
    pub fn cold_filter_bits(mut self, bits: u8) -> Self {
        self.options.cold_filter_bits = bits;
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

impl Store {
    pub(crate) fn open_with(
        dir: PathBuf,
        options: Options,
        vfs: Arc<dyn Vfs>,
    ) -> Result<Store, Error> {
        Ok(Store {
            inner: Engine::open(dir, options, vfs)?,
        })
    }

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

    /// A handle for the namespace `name` (created on first use) with `policy`.
    pub fn namespace(&self, name: &str, policy: Policy) -> Result<Namespace, Error> {
        let id = self.inner.namespace_id(name, &policy)?;
        Ok(Namespace::new(Arc::clone(&self.inner), id, name, policy))
    }

    /// Makes every operation acknowledged so far durable, whatever the durability mode.
    pub fn flush(&self) -> Result<(), Error> {
        self.inner.flush()
    }

    /// Futures' wakers the commit thread holds (test support: cancellation must not
    /// leak them).
    #[cfg(feature = "testing")]
    pub(crate) fn pending_wakers(&self) -> usize {
        self.inner.pending_wakers()
    }

    /// [`flush`](Store::flush) as a future, woken by the commit thread.
    pub fn flush_async(&self) -> Durable<()> {
        match self.inner.flush_ticket() {
            Ok(pending) => Durable::after(&self.inner, pending),
            Err(e) => Durable::ready(Err(e)),
        }
    }

    /// Expires every bucket whose deadline has passed now, instead of waiting for the
    /// background reaper. Returns the number of keys forgotten.
    pub fn expire_now(&self) -> Result<u64, Error> {
        self.inner.expire_now()
    }

    /// The store's counters.
    pub fn stats(&self) -> Stats {
        self.inner.stats()
    }

    /// The directory this store lives in.
    pub fn path(&self) -> &Path {
        self.inner.dir()
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

impl Store {
    /// Calls `f(namespace, id, record)` for every key the store remembers (not removed,
    /// not expired), until `f` returns `false`. `namespace` limits the walk to one
    /// namespace (an unknown name matches nothing).
    ///
    /// The walk reads the log bucket by bucket, oldest expiry first, and reports each
    /// record that the index holds as its key's newest: every key once, in no
    /// particular order within a bucket. Memory stays bounded (one segment handle per
    /// segment, no copy of the records); each record costs one shard lock, released
    /// before `f` runs, so `f` may call the store. It is not a snapshot: a key written
    /// while the walk runs may be reported in its old state, its new one, both or
    /// neither. Offline (the `idemstore` tool holds the directory alone) it is exact.
    pub fn scan(
        &self,
        namespace: Option<&str>,
        f: impl FnMut(&str, &[u8], &Record) -> bool,
    ) -> Result<(), Error> {
        self.inner.scan(namespace, f)
    }

    /// The names of the store's namespaces, in the order they were created.
    pub fn namespace_names(&self) -> Vec<String> {
        self.inner.namespace_names()
    }
}
