//! [`Store`]: opening, the operations behind [`Namespace`], stats and close.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::clock::{Clock, MonotonicTime, UnixMs, duration_ms_ceil};
use crate::error::Error;
use crate::format::namespace_file;
use crate::format::record::{self, ClaimFields, State};
use crate::index::{Index, KeyHash, Shard, StateCounts};
use crate::io::{AppendFile, DirLock, OsVfs, Vfs};
use crate::log::commit::Committer;
use crate::log::{AppendOutcome, Location, Log};
use crate::namespace::{
    Begin, Claim, Namespace, Outcome, Policy, Record, Resolution, Seen, Status,
};
use crate::operations::{Counter, OperationStats, Operations};
use crate::options::{Durability, Options, limits};
use crate::recovery::survey::{self, NamespaceFile};
use crate::recovery::{self, RecoveryReport};

mod records;

pub use records::Imported;

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
        self.options.segment_size_bytes_max = bytes;
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
    pub(crate) fn open_on(self, vfs: Arc<dyn Vfs>) -> Result<Store, Error> {
        Store::open_with(self.dir, self.options, vfs)
    }
}

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
}

struct Namespaces {
    by_name: HashMap<String, u32>,
    names: Vec<String>,
    file: Box<dyn AppendFile>,
    file_len: u64,
    /// Bytes after `file_len` (a torn entry) to trim once recovery has accepted the
    /// directory: a refused open leaves the file as it found it.
    torn_tail: bool,
}

struct Reaper {
    stop: Mutex<bool>,
    wake: Condvar,
}

pub(crate) struct Inner {
    pub(crate) options: Options,
    pub(crate) dir: PathBuf,
    time: MonotonicTime,
    index: Index,
    log: Arc<Log>,
    committer: Arc<Committer>,
    namespaces: Mutex<Namespaces>,
    closed: AtomicBool,
    recovery: RecoveryReport,
    reaper: Arc<Reaper>,
    expired_buckets: AtomicU64,
    expired_keys: AtomicU64,
    operations: Operations,
    /// Held while reaping, so `expire_now` returns only after every bucket retired
    /// before it (possibly by the background reaper) is unindexed.
    reaping: Mutex<()>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    lock: Mutex<Option<DirLock>>,
}

/// The state of a key found in the index.
#[derive(Debug, Clone, Copy)]
struct Current {
    location: Location,
    state: State,
    first_seen_ms: u64,
    deadline_ms: u64,
    claim: ClaimFields,
    /// The lsn of the key's newest record: identifies the acquisition a claim holds.
    lsn: u64,
    durable: bool,
}

impl Current {
    fn is_live(&self, now_ms: u64) -> bool {
        self.state != State::Tombstone && self.deadline_ms > now_ms
    }
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
        vfs.create_dir_all(&dir)
            .map_err(|e| Error::io("creating directory", &dir, e))?;
        let lock = vfs
            .try_lock_dir(&dir)
            .map_err(|e| Error::io("locking directory", &dir, e))?
            .ok_or_else(|| Error::Locked { path: dir.clone() })?;

        let namespaces = open_namespaces(vfs.as_ref(), &dir)?;
        let log = Arc::new(Log::new(
            dir.clone(),
            Arc::clone(&vfs),
            options.segment_size_bytes_max,
            options.bucket_width_ms,
            log_stripes(options.shards),
            1,
        ));
        let index = Index::new(options.shards);
        let names = namespaces.names.len();
        let recovery = recovery::recover(&log, &index, vfs.as_ref(), &options, names, false)?;
        if namespaces.torn_tail {
            let path = dir.join(namespace_file::FILE_NAME);
            namespaces
                .file
                .set_len(namespaces.file_len)
                .map_err(|e| Error::io("trimming", &path, e))?;
        }
        let time = MonotonicTime::new(Arc::clone(&options.clock), UnixMs(recovery.clock_floor_ms));
        let committer = Arc::new(Committer::new());

        let inner = Arc::new(Inner {
            dir,
            time,
            index,
            log: Arc::clone(&log),
            committer: Arc::clone(&committer),
            namespaces: Mutex::new(namespaces),
            closed: AtomicBool::new(false),
            recovery,
            reaper: Arc::new(Reaper {
                stop: Mutex::new(false),
                wake: Condvar::new(),
            }),
            expired_buckets: AtomicU64::new(0),
            expired_keys: AtomicU64::new(0),
            operations: Operations::new(options.shards),
            reaping: Mutex::new(()),
            threads: Mutex::new(Vec::new()),
            lock: Mutex::new(Some(lock)),
            options,
        });
        let interval = match inner.options.durability {
            Durability::Interval(d) => Some(d),
            Durability::Immediate | Durability::None => None,
        };
        let commit_thread = committer.spawn(log, interval);
        let reaper_thread = spawn_reaper(Arc::downgrade(&inner), Arc::clone(&inner.reaper));
        inner.threads.lock().extend([commit_thread, reaper_thread]);
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
        let id = self.inner.namespace_id(name)?;
        Ok(Namespace {
            inner: Arc::clone(&self.inner),
            id,
            name: Arc::from(name),
            policy,
        })
    }

    /// Makes every operation acknowledged so far durable, whatever the durability mode.
    pub fn flush(&self) -> Result<(), Error> {
        self.inner.check_open()?;
        self.inner.committer.wait_durable()
    }

    /// Expires every bucket whose deadline has passed now, instead of waiting for the
    /// background reaper. Returns the number of keys forgotten.
    pub fn expire_now(&self) -> Result<u64, Error> {
        self.inner.check_open()?;
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

    /// Syncs everything, stops the background threads and releases the directory.
    /// Every later operation on this store or its namespaces returns `Error::Closed`.
    pub fn close(&self) -> Result<(), Error> {
        self.inner.close()
    }
}

/// One active segment per bucket for each core, up to 8 (and at most one per shard):
/// writers on different cores then rarely contend for a segment's append lock.
fn log_stripes(shards: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    cores.clamp(1, 8).min(shards)
}

fn open_namespaces(vfs: &dyn Vfs, dir: &Path) -> Result<Namespaces, Error> {
    let path = dir.join(namespace_file::FILE_NAME);
    let existing = vfs
        .read_small(&path)
        .map_err(|e| Error::io("reading", &path, e))?;
    // The classification `verify` reports (`recovery::survey`).
    let decoded = match survey::namespace_file(existing.as_deref()) {
        // A header torn by a crash while the file was being created (it is synced
        // before any namespace is added): no entry follows it, so no record can name a
        // namespace from it, and it is written again below.
        NamespaceFile::Missing | NamespaceFile::TornHeader => namespace_file::Decoded::default(),
        NamespaceFile::Decoded { decoded, .. } => decoded,
        NamespaceFile::Damaged { offset, reason } => {
            return Err(Error::corruption(&path, offset as u64, reason));
        }
    };
    let file = vfs
        .open_append(&path)
        .map_err(|e| Error::io("opening", &path, e))?;
    let mut file_len = decoded.valid_len as u64;
    if file_len < namespace_file::HEADER_LEN as u64 {
        let header = namespace_file::encode_header();
        file.set_len(0)
            .map_err(|e| Error::io("writing", &path, e))?;
        file.write_at(0, &header)
            .map_err(|e| Error::io("writing", &path, e))?;
        file.sync_data()
            .map_err(|e| Error::io("syncing", &path, e))?;
        vfs.sync_dir(dir)
            .map_err(|e| Error::io("syncing directory", dir, e))?;
        file_len = header.len() as u64;
    } else {
        // What was read may not be durable: an fsync of an entry failed, then the
        // process was restarted and read it from the page cache. Records may only name
        // a namespace whose entry is on disk, so make it durable before any can.
        file.sync_data()
            .map_err(|e| Error::io("syncing", &path, e))?;
    }
    // A torn entry from a crash while adding a namespace: it was never used, and is
    // trimmed after recovery (`Namespaces::torn_tail`).
    let torn_tail = existing.as_ref().is_some_and(|b| b.len() as u64 > file_len);
    let by_name = decoded
        .names
        .iter()
        .enumerate()
        .map(|(i, name)| (name.clone(), i as u32))
        .collect();
    Ok(Namespaces {
        by_name,
        names: decoded.names,
        file,
        file_len,
        torn_tail,
    })
}

fn spawn_reaper(inner: Weak<Inner>, reaper: Arc<Reaper>) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name("idemstore-reaper".to_string())
        .spawn(move || {
            loop {
                // Hold the store only while reaping, so dropping the last handle
                // closes it without waiting for this thread.
                let period_ms = {
                    let Some(strong) = inner.upgrade() else {
                        return;
                    };
                    if let Err(e) = strong.reap() {
                        tracing::error!(error = %e, "expiring buckets failed; will retry");
                    }
                    (strong.options.bucket_width_ms / 4).clamp(10, 1_000)
                };
                let mut stop = reaper.stop.lock();
                if !*stop {
                    reaper
                        .wake
                        .wait_for(&mut stop, Duration::from_millis(period_ms));
                }
                if *stop {
                    return;
                }
            }
        })
        .expect("spawning the idemstore reaper thread")
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "closing the store on drop failed");
        }
    }
}

impl Inner {
    fn check_open(&self) -> Result<(), Error> {
        if self.closed.load(Ordering::Acquire) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    fn immediate(&self) -> bool {
        self.options.durability == Durability::Immediate
    }

    fn validate_id(&self, id: &[u8]) -> Result<(), Error> {
        if id.is_empty() || id.len() > self.options.max_key_len {
            return Err(Error::invalid_key(format!(
                "id is {} bytes; it must be 1 to {} bytes (max_key_len)",
                id.len(),
                self.options.max_key_len
            )));
        }
        Ok(())
    }

    fn validate_duration_ms(&self, duration: Duration) -> Result<u64, Error> {
        let ms = duration_ms_ceil(duration);
        if ms < limits::TTL_MS_MIN || ms > self.options.max_ttl_ms {
            return Err(Error::InvalidTtl {
                ttl: duration,
                max: Duration::from_millis(self.options.max_ttl_ms),
            });
        }
        Ok(ms)
    }

    pub(crate) fn validate_policy(&self, policy: &Policy) -> Result<(), Error> {
        self.validate_duration_ms(policy.ttl)?;
        // A lease has the same bounds as a ttl: 1 s to max_ttl.
        self.validate_duration_ms(policy.lease)?;
        if policy.max_attempts == 0 {
            return Err(Error::invalid_option(
                "max_attempts = 0: it must be at least 1",
            ));
        }
        Ok(())
    }

    fn namespace_id(&self, name: &str) -> Result<u32, Error> {
        let mut namespaces = self.namespaces.lock();
        if let Some(&id) = namespaces.by_name.get(name) {
            return Ok(id);
        }
        if namespaces.names.len() >= limits::NAMESPACES_MAX {
            return Err(Error::invalid_option(format!(
                "a store holds at most {} namespaces",
                limits::NAMESPACES_MAX
            )));
        }
        if self.log.is_poisoned() {
            return Err(Error::Poisoned);
        }
        let id = namespaces.names.len() as u32;
        let entry = namespace_file::encode_entry(id, name);
        let path = self.dir.join(namespace_file::FILE_NAME);
        let at = namespaces.file_len;
        let written = namespaces
            .file
            .write_at(at, &entry)
            .and_then(|()| namespaces.file.sync_data());
        if let Err(e) = written {
            self.log.poison();
            return Err(Error::io("adding a namespace to", path, e));
        }
        namespaces.file_len += entry.len() as u64;
        namespaces.names.push(name.to_string());
        namespaces.by_name.insert(name.to_string(), id);
        Ok(id)
    }

    /// The key `(namespace_id, id)` in a locked shard, verified against its record.
    fn find(
        &self,
        shard: &Shard,
        hash: KeyHash,
        namespace_id: u32,
        id: &[u8],
    ) -> Result<Option<Current>, Error> {
        let mut found = None;
        let mut error = None;
        shard.find(hash, |location| {
            let read = self.log.with_record(location, |segment, record| {
                (record.namespace_id == namespace_id && record.id == id).then(|| Current {
                    location,
                    state: record.state,
                    first_seen_ms: record.first_seen_ms,
                    deadline_ms: segment.deadline_ms,
                    claim: record.claim,
                    lsn: record.lsn,
                    durable: segment.is_durable(location.offset),
                })
            });
            match read {
                Ok(Some(current)) => {
                    found = Some(current);
                    true
                }
                Ok(None) => false,
                Err(e) => {
                    error = Some(e);
                    true
                }
            }
        });
        match error {
            Some(e) => Err(e),
            None => Ok(found),
        }
    }

    /// Appends `record` and points the key's entry at it. `None` if the bucket was
    /// retired meanwhile: the caller retries with a fresh clock reading.
    fn write(
        &self,
        shard: &mut Shard,
        hash: KeyHash,
        old: Option<&Current>,
        deadline_ms: u64,
        now_ms: u64,
        record: &record::Record<'_>,
    ) -> Result<Option<Location>, Error> {
        debug_assert!(deadline_ms > now_ms);
        debug_assert!(old.is_none_or(|old| !old.is_live(now_ms) || deadline_ms >= old.deadline_ms));
        match self.log.append(deadline_ms, now_ms, record)? {
            AppendOutcome::Retired => Ok(None),
            AppendOutcome::At(location) => {
                shard.upsert(hash, old.map(|o| o.location), location);
                if let Some(old) = old {
                    shard.counts.sub(old.state);
                }
                shard.counts.add(record.state);
                Ok(Some(location))
            }
        }
    }

    fn public_record(&self, current: &Current) -> Result<Record, Error> {
        let result = if current.state == State::Completed {
            self.log.with_record(current.location, |_, record| {
                record.result.map(<[u8]>::to_vec)
            })?
        } else {
            None
        };
        let status = match current.state {
            State::Mark => Status::Seen,
            State::InProgress => Status::InProgress,
            State::Released => Status::Released,
            State::Completed => Status::Completed,
            State::Failed => Status::Failed,
            State::Tombstone => unreachable!("tombstones are never live"),
        };
        Ok(Record {
            status,
            first_seen: UnixMs(current.first_seen_ms),
            expires_at: UnixMs(current.deadline_ms),
            attempts: current.claim.attempts,
            lease_until: (current.state == State::InProgress)
                .then_some(UnixMs(current.claim.lease_until_ms)),
            completed_at: (current.state == State::Completed)
                .then_some(UnixMs(current.claim.completed_ms)),
            result,
        })
    }

    pub(crate) fn check_and_set(&self, namespace: &Namespace, id: &[u8]) -> Result<Outcome, Error> {
        self.check_open()?;
        self.validate_id(id)?;
        let (outcome, wait) = self.check_and_set_one(namespace, id)?;
        if wait {
            self.committer.wait_durable()?;
        }
        Ok(outcome)
    }

    pub(crate) fn check_and_set_many<I: AsRef<[u8]>>(
        &self,
        namespace: &Namespace,
        ids: &[I],
    ) -> Result<Vec<Outcome>, Error> {
        self.check_open()?;
        if ids.len() > limits::BATCH_LEN_MAX {
            return Err(Error::invalid_option(format!(
                "a batch of {} ids; split it into batches of at most {}",
                ids.len(),
                limits::BATCH_LEN_MAX
            )));
        }
        for id in ids {
            self.validate_id(id.as_ref())?;
        }
        let mut outcomes = Vec::with_capacity(ids.len());
        let mut wait = false;
        for id in ids {
            match self.check_and_set_one(namespace, id.as_ref()) {
                Ok((outcome, needs_wait)) => {
                    wait |= needs_wait;
                    outcomes.push(outcome);
                }
                // Nothing of the batch was applied: a plain error, safe to retry whole.
                Err(e) if outcomes.is_empty() => return Err(e),
                // Part of the batch was applied: the caller must learn which ids were
                // answered `First`, or a retry of the whole batch would get `Duplicate`
                // for them and nobody would process those messages.
                Err(e) => {
                    if wait {
                        self.committer.wait_durable()?;
                    }
                    return Err(Error::PartialBatch {
                        outcomes,
                        source: Box::new(e),
                    });
                }
            }
        }
        if wait {
            self.committer.wait_durable()?;
        }
        Ok(outcomes)
    }

    /// One check-and-set; also whether the answer must wait for a sync.
    fn check_and_set_one(
        &self,
        namespace: &Namespace,
        id: &[u8],
    ) -> Result<(Outcome, bool), Error> {
        let hash = KeyHash::of(namespace.id, id);
        let shard_index = self.index.shard_of(hash);
        loop {
            let now_ms = self.time.now().0;
            let mut shard = self.index.lock(hash);
            let current = self.find(&shard, hash, namespace.id, id)?;
            if let Some(current) = current.filter(|c| c.is_live(now_ms)) {
                let seen = Seen {
                    first_seen: UnixMs(current.first_seen_ms),
                    expires_at: UnixMs(current.deadline_ms),
                };
                self.operations
                    .count_locked(shard_index, Counter::CheckAndSetDuplicate);
                return Ok((
                    Outcome::Duplicate(seen),
                    self.immediate() && !current.durable,
                ));
            }
            let deadline_ms = self
                .log
                .bucket_deadline(now_ms.saturating_add(namespace.policy.ttl_ms()));
            let record = record::Record {
                state: State::Mark,
                namespace_id: namespace.id,
                lsn: shard.next_lsn(),
                first_seen_ms: now_ms,
                id,
                claim: ClaimFields::default(),
                result: None,
            };
            if self
                .write(
                    &mut shard,
                    hash,
                    current.as_ref(),
                    deadline_ms,
                    now_ms,
                    &record,
                )?
                .is_some()
            {
                self.operations
                    .count_locked(shard_index, Counter::CheckAndSetFirst);
                return Ok((Outcome::First, self.immediate()));
            }
        }
    }

    pub(crate) fn begin(
        &self,
        namespace: &Namespace,
        id: &[u8],
        payload_fp: Option<u64>,
    ) -> Result<Begin, Error> {
        self.check_open()?;
        self.validate_id(id)?;
        let hash = KeyHash::of(namespace.id, id);
        let shard_index = self.index.shard_of(hash);
        let policy = namespace.policy;
        loop {
            let now_ms = self.time.now().0;
            let mut shard = self.index.lock(hash);
            let current = self.find(&shard, hash, namespace.id, id)?;
            let live = current.filter(|c| c.is_live(now_ms));
            let (attempts, first_seen_ms, fingerprint, base_deadline_ms) = match live {
                Some(c) => {
                    if let (Some(asked), Some(stored)) = (payload_fp, c.claim.payload_fp)
                        && asked != stored
                    {
                        return Err(Error::PayloadMismatch);
                    }
                    let answer = match c.state {
                        State::Mark | State::Completed => {
                            Some(Begin::Completed as fn(Record) -> Begin)
                        }
                        State::Failed => Some(Begin::Exhausted as fn(Record) -> Begin),
                        State::InProgress if c.claim.lease_until_ms > now_ms => {
                            Some(Begin::InProgress as fn(Record) -> Begin)
                        }
                        State::InProgress | State::Released
                            if c.claim.attempts >= policy.max_attempts =>
                        {
                            Some(Begin::Exhausted as fn(Record) -> Begin)
                        }
                        State::InProgress | State::Released | State::Tombstone => None,
                    };
                    if let Some(answer) = answer {
                        let answer = answer(self.public_record(&c)?);
                        self.operations.count_begin_locked(shard_index, &answer);
                        drop(shard);
                        if self.immediate() && !c.durable {
                            self.committer.wait_durable()?;
                        }
                        return Ok(answer);
                    }
                    (
                        c.claim.attempts,
                        c.first_seen_ms,
                        c.claim.payload_fp.or(payload_fp),
                        c.deadline_ms,
                    )
                }
                None => (
                    0,
                    now_ms,
                    payload_fp,
                    self.log
                        .bucket_deadline(now_ms.saturating_add(policy.ttl_ms())),
                ),
            };
            let lease_until_ms = now_ms.saturating_add(policy.lease_ms());
            let deadline_ms = base_deadline_ms.max(self.log.bucket_deadline(lease_until_ms));
            let attempt = attempts.saturating_add(1);
            let record = record::Record {
                state: State::InProgress,
                namespace_id: namespace.id,
                lsn: shard.next_lsn(),
                first_seen_ms,
                id,
                claim: ClaimFields {
                    attempts: attempt,
                    lease_until_ms,
                    completed_ms: 0,
                    payload_fp: fingerprint,
                },
                result: None,
            };
            if self
                .write(
                    &mut shard,
                    hash,
                    current.as_ref(),
                    deadline_ms,
                    now_ms,
                    &record,
                )?
                .is_some()
            {
                self.operations
                    .count_locked(shard_index, Counter::BeginAcquired);
                drop(shard);
                let claim = Claim {
                    namespace: namespace.clone(),
                    id: id.to_vec(),
                    attempt,
                    lsn: record.lsn,
                    lease_until: UnixMs(lease_until_ms),
                    resolved: false,
                };
                if self.immediate() {
                    // On failure the claim drops and is released (best effort).
                    self.committer.wait_durable()?;
                }
                return Ok(Begin::Acquired(claim));
            }
        }
    }

    /// Completes, releases, fails or extends the claim `attempt` on `id` whose last
    /// record has `lsn`; returns the lease deadline (for extend) and the new record's lsn.
    pub(crate) fn resolve(
        &self,
        namespace: &Namespace,
        id: &[u8],
        attempt: u32,
        lsn: u64,
        how: Resolution<'_>,
    ) -> Result<(UnixMs, u64), Error> {
        self.check_open()?;
        if let Resolution::Complete(Some(result)) = how
            && result.len() > self.options.max_result_len
        {
            return Err(Error::ResultTooLarge {
                len: result.len(),
                max: self.options.max_result_len,
            });
        }
        if let Resolution::Extend(lease_ms) = how
            && (lease_ms < limits::TTL_MS_MIN || lease_ms > self.options.max_ttl_ms)
        {
            return Err(Error::InvalidTtl {
                ttl: Duration::from_millis(lease_ms),
                max: Duration::from_millis(self.options.max_ttl_ms),
            });
        }
        let hash = KeyHash::of(namespace.id, id);
        loop {
            let now_ms = self.time.now().0;
            let mut shard = self.index.lock(hash);
            let current = self.find(&shard, hash, namespace.id, id)?;
            let Some(c) = current.filter(|c| {
                c.is_live(now_ms)
                    && c.state == State::InProgress
                    && c.claim.attempts == attempt
                    && c.lsn == lsn
            }) else {
                return Err(Error::ClaimLost);
            };
            let mut claim = ClaimFields {
                lease_until_ms: 0,
                ..c.claim
            };
            let (state, deadline_ms, result) = match how {
                Resolution::Complete(result) => {
                    claim.completed_ms = now_ms;
                    let retention = self
                        .log
                        .bucket_deadline(now_ms.saturating_add(namespace.policy.ttl_ms()));
                    (State::Completed, c.deadline_ms.max(retention), result)
                }
                Resolution::Release => (State::Released, c.deadline_ms, None),
                Resolution::Fail => (State::Failed, c.deadline_ms, None),
                Resolution::Extend(lease_ms) => {
                    claim.lease_until_ms = now_ms.saturating_add(lease_ms);
                    let lease_deadline = self.log.bucket_deadline(claim.lease_until_ms);
                    (State::InProgress, c.deadline_ms.max(lease_deadline), None)
                }
            };
            let record = record::Record {
                state,
                namespace_id: namespace.id,
                lsn: shard.next_lsn(),
                first_seen_ms: c.first_seen_ms,
                id,
                claim,
                result,
            };
            if self
                .write(&mut shard, hash, Some(&c), deadline_ms, now_ms, &record)?
                .is_some()
            {
                let counter = match how {
                    Resolution::Complete(_) => Some(Counter::Complete),
                    Resolution::Release => Some(Counter::Release),
                    Resolution::Fail => Some(Counter::Fail),
                    Resolution::Extend(_) => None,
                };
                if let Some(counter) = counter {
                    self.operations
                        .count_locked(self.index.shard_of(hash), counter);
                }
                drop(shard);
                if self.immediate() {
                    self.committer.wait_durable()?;
                }
                return Ok((UnixMs(claim.lease_until_ms), record.lsn));
            }
        }
    }

    pub(crate) fn get(&self, namespace: &Namespace, id: &[u8]) -> Result<Option<Record>, Error> {
        self.check_open()?;
        self.validate_id(id)?;
        let hash = KeyHash::of(namespace.id, id);
        let now_ms = self.time.now().0;
        let shard = self.index.lock(hash);
        match self.find(&shard, hash, namespace.id, id)? {
            Some(c) if c.is_live(now_ms) => self.public_record(&c).map(Some),
            _ => Ok(None),
        }
    }

    pub(crate) fn remove(&self, namespace: &Namespace, id: &[u8]) -> Result<bool, Error> {
        self.check_open()?;
        self.validate_id(id)?;
        let hash = KeyHash::of(namespace.id, id);
        loop {
            let now_ms = self.time.now().0;
            let mut shard = self.index.lock(hash);
            let Some(c) = self
                .find(&shard, hash, namespace.id, id)?
                .filter(|c| c.is_live(now_ms))
            else {
                return Ok(false);
            };
            let record = record::Record {
                state: State::Tombstone,
                namespace_id: namespace.id,
                lsn: shard.next_lsn(),
                first_seen_ms: c.first_seen_ms,
                id,
                claim: ClaimFields::default(),
                result: None,
            };
            if self
                .write(&mut shard, hash, Some(&c), c.deadline_ms, now_ms, &record)?
                .is_some()
            {
                self.operations
                    .count_locked(self.index.shard_of(hash), Counter::Remove);
                drop(shard);
                if self.immediate() {
                    self.committer.wait_durable()?;
                }
                return Ok(true);
            }
        }
    }

    /// Expires every bucket whose deadline has passed: unindexes its keys (walking the
    /// bucket's own records) and deletes its files. Returns the keys forgotten.
    fn reap(&self) -> Result<u64, Error> {
        let _reaping = self.reaping.lock();
        let now_ms = self.time.now().0;
        let segments = self.log.retire_through(now_ms);
        if segments.is_empty() {
            return Ok(0);
        }
        let started = std::time::Instant::now();
        // Stripes may cache a retired segment as their active one: drop those handles
        // so the deleted files are unmapped.
        self.log.forget_active_through(now_ms);
        let mut forgotten = 0;
        let mut deadlines = std::collections::BTreeSet::new();
        for segment in &segments {
            deadlines.insert(segment.deadline_ms);
            let published = segment.published() as usize;
            let bytes = segment.file.read(0, published);
            crate::log::reader::scan(
                bytes,
                crate::format::segment_header::LEN,
                |offset, record| {
                    let hash = KeyHash::of(record.namespace_id, record.id);
                    let location = Location {
                        slot: segment.slot,
                        offset: offset as u32,
                    };
                    let mut shard = self.index.lock(hash);
                    if shard.remove_at(hash, location) {
                        shard.counts.sub(record.state);
                        if record.state != State::Tombstone {
                            forgotten += 1;
                        }
                    }
                },
            );
            self.log.delete_segment(segment)?;
        }
        self.expired_buckets
            .fetch_add(deadlines.len() as u64, Ordering::Relaxed);
        self.expired_keys.fetch_add(forgotten, Ordering::Relaxed);
        tracing::info!(
            buckets = deadlines.len(),
            segments = segments.len(),
            keys = forgotten,
            oldest_deadline_ms = deadlines.first().copied().unwrap_or(0),
            lag_ms = now_ms.saturating_sub(deadlines.first().copied().unwrap_or(now_ms)),
            ms = started.elapsed().as_millis() as u64,
            "expired buckets"
        );
        Ok(forgotten)
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
        let (mut disk_bytes, mut log_bytes, mut segments) = (0u64, 0u64, 0u64);
        let buckets;
        let now_ms = self.time.now().0;
        let mut oldest_passed_deadline_ms = now_ms;
        {
            let table = self.log.table.read();
            for segment in table.segments() {
                segments += 1;
                disk_bytes += segment.allocated();
                log_bytes += segment.published();
                oldest_passed_deadline_ms = oldest_passed_deadline_ms.min(segment.deadline_ms);
            }
            buckets = table.buckets.len() as u64;
        }
        Stats {
            live_keys: seen + in_progress + released + completed + failed,
            seen,
            in_progress,
            released,
            completed,
            failed,
            tombstones,
            namespaces: self.namespaces.lock().names.len() as u64,
            index_bytes,
            disk_bytes,
            log_bytes,
            segments,
            buckets,
            corrupt_records_skipped: self.recovery.corrupt_records_skipped,
            torn_tails_cut: self.recovery.torn_tails_cut,
            foreign_files: self.recovery.foreign_files,
            records_replayed: self.recovery.records_replayed,
            recovery_time: self.recovery.duration,
            opened_from_checkpoint: self.recovery.opened_from_checkpoint,
            expired_buckets: self.expired_buckets.load(Ordering::Relaxed),
            expired_keys: self.expired_keys.load(Ordering::Relaxed),
            sync_rounds: self.committer.rounds.load(Ordering::Relaxed),
            durable_waits: self.committer.waits.load(Ordering::Relaxed),
            operations: self.operations.snapshot(),
            expiry_lag: Duration::from_millis(now_ms - oldest_passed_deadline_ms),
        }
    }

    fn close(&self) -> Result<(), Error> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        *self.reaper.stop.lock() = true;
        self.reaper.wake.notify_all();
        self.committer.stop();
        let current = std::thread::current().id();
        for thread in self.threads.lock().drain(..) {
            if thread.thread().id() != current {
                let _ = thread.join();
            }
        }
        let result = if let Some(failure) = self.committer.failure() {
            Err(failure)
        } else if self.log.is_poisoned() {
            Err(Error::Poisoned)
        } else if self.options.durability == Durability::None {
            self.log.seal_all()
        } else {
            self.log.sync().and_then(|()| self.log.seal_all())
        };
        let result = result.and_then(|()| self.write_checkpoint());
        self.lock.lock().take();
        result
    }

    /// At a clean close, after every segment is sealed, trimmed and synced: the index
    /// checkpoint the next open rebuilds from (`crate::checkpoint`). Not written when
    /// this open skipped damaged data, so that the next open reports it again.
    fn write_checkpoint(&self) -> Result<(), Error> {
        if self.recovery.corrupt_records_skipped > 0 {
            tracing::info!(
                corrupt = self.recovery.corrupt_records_skipped,
                "not writing an index checkpoint: damaged data was skipped at open"
            );
            return Ok(());
        }
        // No reaping (`expire_now` on another thread) while the segments are listed.
        let _reaping = self.reaping.lock();
        let namespace_count = self.namespaces.lock().names.len();
        crate::checkpoint::write(
            &self.log,
            &self.index,
            self.log.vfs(),
            namespace_count,
            self.options.durability != Durability::None,
        )
    }
}
