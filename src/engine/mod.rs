//! The engine behind [`Store`](crate::Store): the orchestrator. Opening wires the rooms together — the log, the
//! index, recovery, the NAMESPACES table (`namespaces`), the group commit, expiry
//! (`crate::expiry`) — and every operation then flows down through them:
//! `keys` (the operations on one key) → `mutation` (the one write path, with
//! `crate::lifecycle` deciding) → index and log → io. `close` has its own room, and
//! so do the counters (`crate::stats`, gathered here).

mod close;
mod keys;
mod mutation;
mod namespaces;
mod partitions;
mod records;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::clock::{MonotonicTime, UnixMs};
use crate::error::Error;
use crate::expiry::Expiry;
use crate::index::{Index, StateCounts};
use crate::io::{DirLock, Vfs};
use crate::limits;
use crate::log::Log;
use crate::log::commit::Committer;
use crate::operations::{Operations, Timed};
use crate::options::{Durability, Options};
use crate::poison::Poison;
use crate::policy::Policy;
use crate::recovery::{self, RecoveryReport};
use crate::replication::replica::Replica;
use crate::stats::Stats;
use namespaces::Namespaces;

pub(crate) use keys::{Began, Resolved, Scope};
pub(crate) use mutation::Pending;
pub use partitions::{PartitionInfo, ReleaseReport, RestoreReport};

/// One open store: the rooms, wired. Shared by every `Store` handle, `Namespace`
/// and `Claim` of it; the last one dropped closes it.
pub(crate) struct Engine {
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
    /// The index entries moved out of RAM (`memory_budget`).
    cold: Arc<crate::cold::ColdTier>,
    operations: Operations,
    /// The partition slots: ownership and shipping when replicated, the highest
    /// offset marked always.
    pub(crate) replica: Arc<Replica>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    lock: Mutex<Option<DirLock>>,
}

impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            tracing::error!(error = %e, "closing the store on drop failed");
        }
    }
}

impl Engine {
    /// Opens the store in `dir`: validates the options, takes the directory lock,
    /// reads the namespaces, recovers the index and starts the background threads.
    pub(crate) fn open(
        dir: PathBuf,
        options: Options,
        vfs: Arc<dyn Vfs>,
    ) -> Result<Arc<Engine>, Error> {
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
        let recover = |reuse_cold| {
            recover_index(
                &dir,
                &options,
                &vfs,
                &poison,
                namespaces.count(),
                reuse_cold,
            )
        };
        let Recovered {
            log,
            index,
            recovery,
            cold,
            kept,
            claims_released_at_open,
        } = match recover(true)? {
            Ok(recovered) => recovered,
            Err(e) => {
                // The reconciliation met damage (a cold page, or a record it names):
                // never an open refused for it, the whole log is replayed instead.
                tracing::error!(error = %e, "the cold index files cannot be reused; replaying the whole log");
                recover(false)??
            }
        };
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
        let replica = Replica::new(if read_only {
            None
        } else {
            options.replication.clone()
        });

        if !read_only {
            cold.remove_leftovers(kept.as_ref())?;
        }
        let inner = Arc::new(Engine {
            dir: dir.clone(),
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
            cold: Arc::new(cold),
            operations: Operations::new(options.shards),
            replica,
            threads: Mutex::new(Vec::new()),
            lock: Mutex::new(Some(lock)),
            options,
        });
        inner.load_partitions()?;
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
                    .spawn(Arc::downgrade(&inner), period_ms, |inner: &Engine| {
                        inner.reap(false)
                    });
            inner.threads.lock().extend([commit_thread, reaper_thread]);
            if inner.options.memory_budget.is_some() {
                let merger_thread = spawn_merger(Arc::downgrade(&inner), period_ms);
                inner.threads.lock().push(merger_thread);
            }
        }
        Ok(inner)
    }

    /// The id of the namespace `name`, created on first use; validates `policy`.
    pub(crate) fn namespace_id(&self, name: &str, policy: &Policy) -> Result<u32, Error> {
        self.check_open()?;
        if name.is_empty() || name.len() > limits::NAMESPACE_LEN_MAX {
            return Err(Error::invalid_key(format!(
                "namespace {name:?} is {} bytes; it must be 1 to {} bytes",
                name.len(),
                limits::NAMESPACE_LEN_MAX
            )));
        }
        self.validate_policy(policy)?;
        let id = self.namespaces.id(name, &self.poison)?;
        if policy.approximate.is_some() {
            self.cold.trust_namespace(id);
        }
        Ok(id)
    }

    pub(crate) fn flush(&self) -> Result<(), Error> {
        self.check_writable()?;
        self.committer.wait_durable()
    }

    /// `flush` before its wait: always waits, whatever the durability mode.
    pub(crate) fn flush_ticket(&self) -> Result<Pending<Result<(), Error>>, Error> {
        self.check_writable()?;
        Ok(Pending::local(Ok(()), true))
    }

    pub(crate) fn expire_now(&self) -> Result<u64, Error> {
        self.check_writable()?;
        self.reap(true)
    }

    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// The names of the namespaces, in the order they were created.
    pub(crate) fn namespace_names(&self) -> Vec<String> {
        self.namespaces.names()
    }

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

    /// A commit ticket covering every write made so far (`Durable`).
    pub(crate) fn commit_ticket(&self) -> Result<u64, Error> {
        self.committer.ticket()
    }

    /// Polls a commit ticket, registering `cx`'s waker with the commit thread.
    pub(crate) fn poll_commit(
        &self,
        ticket: u64,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Error>> {
        self.committer.poll(ticket, cx)
    }

    /// Wakers the commit thread holds now.
    #[cfg(feature = "testing")]
    pub(crate) fn pending_wakers(&self) -> usize {
        self.committer.pending_wakers()
    }

    /// Drops the waker of a ticket whose future was dropped.
    pub(crate) fn forget_commit(&self, ticket: u64) {
        self.committer.forget(ticket);
    }

    /// Records the latency of a call started at `started` (`operations::start_timer`).
    pub(crate) fn record_latency(&self, timed: Timed, started: Option<Instant>) {
        let Some(_elapsed) = self.operations.record_latency(timed, started) else {
            return;
        };
        #[cfg(feature = "metrics")]
        crate::telemetry::record_latency(timed, _elapsed);
    }

    /// A reaper round: expire the buckets whose deadline passed, hot and cold, hold
    /// the index to the memory budget, then write the cold state if the tier changed
    /// (after the log is durable: `ColdTier::write_state`), which lets the files of
    /// the generations that left it go. `merge`: merge the generations down here
    /// (`expire_now`), not on the merger thread.
    fn reap(&self, merge: bool) -> Result<u64, Error> {
        let now = self.time.now();
        let hot = self.expiry.reap(&self.log, &self.index, now);
        // The cold tier's share of the retired buckets, whatever the hot part met.
        let _reaping = self.expiry.pause();
        let (cold, dropped) = self.cold.expire(&self.index, now.0);
        self.expiry.count_forgotten(cold, dropped);
        let sync = self.options.durability != Durability::None;
        let durable = || match sync {
            true => self.committer.wait_durable(),
            false => Ok(()),
        };
        let enforced = match self.options.memory_budget {
            Some(budget) => {
                self.cold
                    .enforce(budget, &self.log, &self.index, now.0, sync, merge, &durable)
            }
            None => Ok(Default::default()),
        };
        // What changed before any failure above is persisted all the same.
        let persisted = self.cold.persist(&self.index, durable, sync);
        if self.options.memory_budget.is_some()
            && (merge || enforced.as_ref().is_ok_and(|r| r.buckets + r.merges > 0))
        {
            // Last, once the round's buffers (the spills' entries and pages, the merged
            // generations, the cold state's encoding) are all free: give their pages
            // back (`release_free_memory`). An `expire_now` trims even when it spilled
            // nothing: the index tables come from the heap under a budget
            // (`index::TableAlloc`), and what the writers' table growth freed since the
            // last round is handed back too.
            crate::cold::release_free_memory();
        }
        let forgotten = hot? + cold;
        enforced?;
        persisted?;
        Ok(forgotten)
    }

    /// A merger round: merge the cold generations down to `GENERATIONS_MAX`.
    fn merge_generations(&self) -> Result<u64, Error> {
        let sync = self.options.durability != Durability::None;
        let durable = || match sync {
            true => self.committer.wait_durable(),
            false => Ok(()),
        };
        // (`merge_down` gives the merges' freed pages back before it lets a waiting
        // `expire_now` in.)
        self.cold
            .merge_down(&self.log, &self.index, self.time.now().0, sync, &durable)
    }

    pub(crate) fn stats(&self) -> Stats {
        let mut counts = StateCounts::default();
        let mut index_bytes = 0u64;
        for shard in self.index.shards() {
            let shard = shard.lock();
            for (total, count) in counts.counts.iter_mut().zip(shard.counts.counts) {
                *total += count;
            }
            index_bytes += shard.allocation_size() as u64;
        }
        let cold = self.cold.stats();
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
            replication: self.replication_stats(),
            cold: crate::stats::ColdTierStats {
                generations: cold.generations,
                entries: cold.keys,
                ram_bytes: cold.ram_bytes,
                disk_bytes: cold.disk_bytes,
                spills: cold.spills,
                merges: cold.merges,
                spilled_keys: cold.spilled_keys,
                reused_at_open: cold.reused_at_open,
                rebuilt_at_open: cold.rebuilt_at_open,
                damaged_pages: cold.damaged_pages,
            },
        }
    }
}

/// Starts the merger thread (stores with a memory budget): merges cold generations
/// while the reaper's spills go on, woken by a spill that leaves too many, or every
/// `period_ms`. Holds the store only for a round, like the reaper.
fn spawn_merger(engine: std::sync::Weak<Engine>, period_ms: u64) -> std::thread::JoinHandle<()> {
    let Some(cold) = engine.upgrade().map(|e| Arc::clone(&e.cold)) else {
        unreachable!("the merger starts while the store is being opened");
    };
    std::thread::Builder::new()
        .name("idemstore-merger".to_string())
        .spawn(move || {
            while cold.wait_for_merges(std::time::Duration::from_millis(period_ms)) {
                let Some(engine) = engine.upgrade() else {
                    return;
                };
                if let Err(e) = engine.merge_generations() {
                    tracing::error!(error = %e, "merging cold generations failed; will retry");
                }
            }
        })
        .expect("spawning the idemstore merger thread")
}

/// What recovery rebuilt: the log's segment table, the index, the cold tier, and the
/// claims of the previous process released.
struct Recovered {
    log: Arc<Log>,
    index: Index,
    recovery: recovery::RecoveryReport,
    cold: crate::cold::ColdTier,
    /// The generations taken over (their files stay).
    kept: Option<std::collections::BTreeSet<u64>>,
    claims_released_at_open: u64,
}

/// Recovers the index (`recovery::recover`), then takes over the cold tier an earlier
/// open left (`reuse_cold`), before the claims of the previous process are released
/// (its own counts included), and reconciles it with a replay. `Ok(Err)`: the
/// reconciliation failed (damage in a cold page or a record it names), and a recovery
/// without the cold tier is the way on.
fn recover_index(
    dir: &Path,
    options: &Options,
    vfs: &Arc<dyn Vfs>,
    poison: &Arc<Poison>,
    namespace_count: usize,
    reuse_cold: bool,
) -> Result<Result<Recovered, Error>, Error> {
    let log = Arc::new(Log::new(
        dir.to_path_buf(),
        Arc::clone(vfs),
        Arc::clone(poison),
        options.segment_size_bytes,
        options.bucket_width_ms,
        options.log_stripes(),
        1,
    ));
    let index = Index::new(options.shards, options.memory_budget.is_some());
    let mut recovery = recovery::recover(
        &log,
        &index,
        vfs.as_ref(),
        options,
        namespace_count,
        options.read_only,
        reuse_cold,
    )?;
    let cold = crate::cold::ColdTier::new(
        dir.to_path_buf(),
        Arc::clone(vfs),
        options.read_only,
        options.cold_filter_bits == 16,
    );
    let started = std::time::Instant::now();
    let (kept, open_counters) = match recovery.cold.take() {
        Some(reused) => {
            let reused = Arc::try_unwrap(reused).expect("the report's one handle");
            let numbers = reused.numbers();
            (Some(numbers), cold.restore(reused, &log, &index))
        }
        None => (None, Vec::new()),
    };
    let restore_ms = started.elapsed().as_millis() as u64;
    let mut claims_released_at_open = index.finish_recovery();
    #[cfg(feature = "planted-bugs")]
    let reconcile = !crate::planted::planted("cold-crash-skips-reconcile");
    #[cfg(not(feature = "planted-bugs"))]
    let reconcile = true;
    if let Some(screened) = recovery
        .cold_reconcile
        .take()
        .filter(|_| reconcile && kept.is_some())
    {
        let started = std::time::Instant::now();
        let reconciled = cold.reconcile(&log, &index, &open_counters, &screened);
        tracing::info!(
            restore_ms,
            screened = screened.len(),
            reconcile_ms = started.elapsed().as_millis() as u64,
            "reconciled the cold tier with the replayed records"
        );
        match reconciled {
            Ok(uncounted) => {
                debug_assert!(uncounted <= claims_released_at_open);
                claims_released_at_open = claims_released_at_open.saturating_sub(uncounted);
            }
            Err(e) => return Ok(Err(e)),
        }
    }
    if !cold.is_empty() {
        // Taking the generations over decoded each file's sections and the cold state
        // into buffers now freed: give their pages back, as a spill does.
        crate::cold::release_free_memory();
    }
    Ok(Ok(Recovered {
        log,
        index,
        recovery,
        cold,
        kept,
        claims_released_at_open,
    }))
}
