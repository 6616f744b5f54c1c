//! The public face of one business type: [`Namespace`], its [`Policy`], and the
//! answers and claims its operations return.

use std::sync::Arc;
use std::time::Duration;

use crate::addr::Lsn;
use crate::answer::{Imported, Outcome, Record};
use crate::clock::{UnixMs, duration_ms_ceil};
use crate::durable::Durable;
use crate::engine::{
    Began, Engine, PartitionInfo, Pending, ReleaseReport, Resolved, RestoreReport, Scope,
};
use crate::error::Error;
use crate::lifecycle::Resolution;
use crate::operations::{self, Timed};
use crate::policy::Policy;

/// The answer of [`Namespace::begin`].
#[derive(Debug)]
#[must_use]
pub enum Begin {
    /// This caller holds the key: do the work, then `complete`, `release` or `fail`.
    Acquired(Claim),
    /// Another worker holds a live lease on the key: retry later.
    InProgress(Record),
    /// Already done: replay `record.result()`.
    Completed(Record),
    /// `max_attempts` acquisitions did not complete, or a claim failed: dead-letter it.
    Exhausted(Record),
}

/// A namespace handle: cheap to clone, safe to share across threads.
///
/// It reaches the engine only through the operations on one key that
/// `engine::keys` gives `Engine` (check_and_set, begin, resolve, get, remove,
/// import), naming the namespace by id and policy.
#[derive(Clone)]
pub struct Namespace {
    inner: Arc<Engine>,
    pub(crate) id: u32,
    name: Arc<str>,
    pub(crate) policy: Policy,
    scope: Scope,
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Namespace")
            .field("name", &self.name)
            .field("policy", &self.policy)
            .finish()
    }
}

impl Namespace {
    pub(crate) fn new(inner: Arc<Engine>, id: u32, name: &str, policy: Policy) -> Namespace {
        Namespace {
            inner,
            id,
            name: Arc::from(name),
            policy,
            scope: Scope::new(id, &policy),
        }
    }

    fn scope(&self) -> &Scope {
        &self.scope
    }

    fn begin_scoped(
        &self,
        id: &[u8],
        offset: Option<u64>,
        payload_fp: Option<u64>,
    ) -> Result<Begin, Error> {
        // On a failed wait an acquired claim drops here and is released (best effort).
        self.inner
            .settle(self.begin_pending(id, offset, payload_fp)?)
    }

    /// `begin` applied, its answer built (a `Claim` for an acquisition), before the
    /// durability wait.
    fn begin_pending(
        &self,
        id: &[u8],
        offset: Option<u64>,
        payload_fp: Option<u64>,
    ) -> Result<Pending<Begin>, Error> {
        let offset = self.offset(offset)?;
        let pending = self.inner.begin(self.scope(), id, offset, payload_fp)?;
        let answer = match pending.value {
            Began::Acquired {
                attempt,
                lsn,
                lease_until,
            } => Begin::Acquired(Claim {
                namespace: self.clone(),
                id: id.to_vec(),
                offset,
                attempt,
                lsn,
                lease_until,
                resolved: false,
            }),
            Began::InProgress(record) => Begin::InProgress(record),
            Began::Completed(record) => Begin::Completed(record),
            Began::Exhausted(record) => Begin::Exhausted(record),
        };
        Ok(Pending {
            value: answer,
            wait: pending.wait,
            ship: pending.ship,
        })
    }

    /// A source offset to record: only on a partition handle, never `u64::MAX`.
    fn offset(&self, offset: Option<u64>) -> Result<Option<u64>, Error> {
        match offset {
            Some(_) if self.scope.partition.is_none() => Err(Error::invalid_option(
                "a source offset is recorded only in a partition: use namespace.partition(p)",
            )),
            Some(u64::MAX) => Err(Error::invalid_option(
                "source offset u64::MAX is reserved (it encodes \"none\")",
            )),
            other => Ok(other),
        }
    }

    /// A handle to partition `partition` of this namespace (a Kafka partition, a
    /// queue index): its keys are the partition's own — the same id in two partitions
    /// is two keys — and its records carry the partition, so that the partition can
    /// move between stores (`restore_partition`, `release_partition`). In a store
    /// opened with [`replication`](crate::StoreBuilder::replication), writes are
    /// refused (`Error::NotOwned`) until the partition is restored here.
    pub fn partition(&self, partition: u32) -> Result<Namespace, Error> {
        if partition == u32::MAX {
            return Err(Error::invalid_key(
                "partition u32::MAX is reserved (it encodes \"no partition\")",
            ));
        }
        let slot = self.inner.partition_slot(&self.name, self.id, partition);
        Ok(Namespace {
            scope: Scope {
                partition: Some(partition),
                slot: Some(slot),
                ..self.scope.clone()
            },
            ..self.clone()
        })
    }

    /// The partition of a partition handle.
    pub fn partition_id(&self) -> Option<u32> {
        self.scope.partition
    }

    /// On assignment: reads the partition's changelog from where this store's copy
    /// is (nothing: from the start; a warm copy: only what was written since), applies
    /// it, and takes the partition over, fencing the previous owner: from then on its
    /// appends are refused by the changelog and it gets `Error::Fenced`. Call before
    /// processing the partition's first message. Without replication, nothing to do.
    pub fn restore_partition(&self) -> Result<RestoreReport, Error> {
        self.inner.restore_partition(self.scope())
    }

    /// Returns once every record of the partition written so far is stored by the
    /// cluster (a quorum), or a typed error within the replication timeout. Call it
    /// before committing the source offsets (Async mode). Without replication, at once.
    pub fn flush_partition(&self) -> Result<(), Error> {
        self.inner.flush_partition(self.scope())
    }

    /// [`flush_partition`](Namespace::flush_partition) as a future, woken by the
    /// shipping thread.
    pub fn flush_partition_async(&self) -> Durable<()> {
        match self.inner.flush_partition_wait(self.scope()) {
            Ok(ship) => Durable::after(
                &self.inner,
                Pending {
                    value: Ok(()),
                    wait: false,
                    ship: ship.map(Box::new),
                },
            ),
            Err(e) => Durable::ready(Err(e)),
        }
    }

    /// On revoke: flushes the partition, then gives it up (writes answer
    /// `Error::NotOwned` until it is restored here again). The local records stay as
    /// a warm standby. If the flush failed the partition is given up all the same and
    /// the error says so: its unflushed records may be missing on the next owner.
    pub fn release_partition(&self) -> Result<ReleaseReport, Error> {
        self.inner.release_partition(self.scope())
    }

    /// The partition's state here: owned, fenced, its highest source offset marked,
    /// its changelog position.
    pub fn partition_info(&self) -> Result<PartitionInfo, Error> {
        self.inner.partition_info(self.scope())
    }

    /// [`check_and_set`](Namespace::check_and_set) of the message at source position
    /// `offset` (a Kafka offset, a stream sequence), recorded with the mark: `get`,
    /// `scan` and `export` show it, and the partition tracks the highest offset marked.
    /// Only on a partition handle.
    pub fn check_and_set_at(&self, id: impl AsRef<[u8]>, offset: u64) -> Result<Outcome, Error> {
        let started = operations::start_timer();
        let offset = self.offset(Some(offset))?;
        let outcome = self.inner.check_and_set(self.scope(), id.as_ref(), offset);
        self.inner.record_latency(Timed::CheckAndSet, started);
        outcome
    }

    /// [`check_and_set_at`](Namespace::check_and_set_at) as a future.
    pub fn check_and_set_at_async(&self, id: impl AsRef<[u8]>, offset: u64) -> Durable<Outcome> {
        let pending = self.offset(Some(offset)).and_then(|offset| {
            self.inner
                .check_and_set_pending(self.scope(), id.as_ref(), offset)
        });
        Durable::applied(&self.inner, pending)
    }

    /// [`begin`](Namespace::begin) of the message at source position `offset`; the
    /// claim's records carry it. Only on a partition handle.
    pub fn begin_at(&self, id: impl AsRef<[u8]>, offset: u64) -> Result<Begin, Error> {
        let started = operations::start_timer();
        let answer = self.begin_scoped(id.as_ref(), Some(offset), None);
        self.inner.record_latency(Timed::Begin, started);
        answer
    }

    /// [`begin_at`](Namespace::begin_at) as a future.
    pub fn begin_at_async(&self, id: impl AsRef<[u8]>, offset: u64) -> Durable<Begin> {
        Durable::applied(
            &self.inner,
            self.begin_pending(id.as_ref(), Some(offset), None),
        )
    }

    /// [`check_and_set`](Namespace::check_and_set) for async consumers: the mark is
    /// decided and written when this is called (atomically, as the blocking call);
    /// only the wait for durability is the future's, woken by the commit thread, so an
    /// executor thread never blocks and many calls share one fsync.
    pub fn check_and_set_async(&self, id: impl AsRef<[u8]>) -> Durable<Outcome> {
        Durable::applied(
            &self.inner,
            self.inner
                .check_and_set_pending(self.scope(), id.as_ref(), None),
        )
    }

    /// [`check_and_set_many`](Namespace::check_and_set_many) with one durability wait
    /// for the batch, as a future.
    pub fn check_and_set_many_async<I: AsRef<[u8]>>(&self, ids: &[I]) -> Durable<Vec<Outcome>> {
        match self.inner.check_and_set_many_pending(self.scope(), ids) {
            Ok(pending) => Durable::after(&self.inner, pending),
            Err(e) => Durable::ready(Err(e)),
        }
    }

    /// [`begin`](Namespace::begin) for async consumers: the claim is acquired (or the
    /// answer decided) when this is called; the future resolves once it may be acted
    /// on. Dropped before it resolves, an acquired claim is released.
    pub fn begin_async(&self, id: impl AsRef<[u8]>) -> Durable<Begin> {
        Durable::applied(&self.inner, self.begin_pending(id.as_ref(), None, None))
    }

    /// [`begin_with_payload`](Namespace::begin_with_payload) for async consumers.
    pub fn begin_with_payload_async(&self, id: impl AsRef<[u8]>, payload: &[u8]) -> Durable<Begin> {
        let fingerprint = xxhash_rust::xxh3::xxh3_64(payload);
        Durable::applied(
            &self.inner,
            self.begin_pending(id.as_ref(), None, Some(fingerprint)),
        )
    }

    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace's policy.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// A handle to the same namespace whose operations use `ttl` instead of the
    /// policy's (the per-call ttl override): `ns.with_ttl(d).check_and_set(id)`.
    pub fn with_ttl(&self, ttl: Duration) -> Result<Namespace, Error> {
        let policy = Policy { ttl, ..self.policy };
        self.inner.validate_policy(&policy)?;
        Ok(Namespace {
            policy,
            scope: self.scope.with_policy(&policy),
            ..self.clone()
        })
    }

    /// `First` if `id` was not seen within its retention (and marks it), else
    /// `Duplicate`. The drop-in for Redis `SET key 1 NX EX ttl`. A namespace opened
    /// with `Policy::approximate` may also answer `LikelyDuplicate` for a key that is
    /// not in RAM (a filter hit, not verified: `docs/CONTRACT.md` §2.2).
    pub fn check_and_set(&self, id: impl AsRef<[u8]>) -> Result<Outcome, Error> {
        let started = operations::start_timer();
        let outcome = self.inner.check_and_set(self.scope(), id.as_ref(), None);
        self.inner.record_latency(Timed::CheckAndSet, started);
        outcome
    }

    /// `check_and_set` for a polled batch, with one durability wait for the batch.
    /// Outcomes are in the order of `ids`; a repeated id is `Duplicate` after its first.
    pub fn check_and_set_many<I: AsRef<[u8]>>(&self, ids: &[I]) -> Result<Vec<Outcome>, Error> {
        self.inner.check_and_set_many(self.scope(), ids)
    }

    /// Starts processing `id`: acquires a claim unless the key is done, held by a live
    /// lease, or exhausted. `Error::InvalidOption` on a namespace opened with
    /// `Policy::approximate` (claims need exact answers).
    pub fn begin(&self, id: impl AsRef<[u8]>) -> Result<Begin, Error> {
        let started = operations::start_timer();
        let answer = self.begin_scoped(id.as_ref(), None, None);
        self.inner.record_latency(Timed::Begin, started);
        answer
    }

    /// `begin`, also recording a fingerprint of `payload`: if the key was recorded with
    /// a different payload, the answer is `Error::PayloadMismatch`.
    pub fn begin_with_payload(&self, id: impl AsRef<[u8]>, payload: &[u8]) -> Result<Begin, Error> {
        let started = operations::start_timer();
        let fingerprint = xxhash_rust::xxh3::xxh3_64(payload);
        let answer = self.begin_scoped(id.as_ref(), None, Some(fingerprint));
        self.inner.record_latency(Timed::Begin, started);
        answer
    }

    /// The consumption record of `id`, or `None` if it is not remembered.
    pub fn get(&self, id: impl AsRef<[u8]>) -> Result<Option<Record>, Error> {
        self.inner.get(self.scope(), id.as_ref())
    }

    /// Forgets `id`; `true` if it was remembered. `Error::InvalidOption` on a
    /// namespace opened with `Policy::approximate` (a filter cannot forget a key).
    pub fn remove(&self, id: impl AsRef<[u8]>) -> Result<bool, Error> {
        self.inner.remove(self.scope(), id.as_ref())
    }

    /// Puts a consumption record back (a restore from `idemstore export`, or a move
    /// between stores): if `id` is not remembered here, it becomes remembered with
    /// `record`'s state — status, first seen, attempts, lease, completed at, result —
    /// until `record.expires_at`, rounded up as any deadline is (docs/CONTRACT.md).
    ///
    /// - A key that is already remembered is left alone ([`Imported::AlreadyLive`]):
    ///   the live state wins, so importing twice, or into a store that kept running,
    ///   never rolls a key back.
    /// - A record whose `expires_at` has passed is not written ([`Imported::Expired`]).
    /// - A `Seen` record is a `check_and_set` mark: its attempts, lease and completion
    ///   are ignored. Only a `Completed` record may carry a result (else
    ///   `Error::InvalidOption`), at most `max_result_len` bytes (else
    ///   `Error::ResultTooLarge`); an `InProgress` record needs `lease_until`.
    /// - `expires_at` may be at most `max_ttl` plus its deadline rounding (one bucket width,
    ///   or `max_ttl / 1024` when that is longer) from now (else
    ///   `Error::InvalidTtl`). The namespace's policy ttl does not apply.
    /// - The payload fingerprint of `begin_with_payload` is not part of [`Record`], so
    ///   an imported key does not detect a payload mismatch.
    ///
    /// The write is as durable as any other under the store's durability mode.
    /// - A record with a `partition` goes into that partition (on a handle of another
    ///   partition: `Error::InvalidOption`), with its `offset`; in a replicated store
    ///   the partition must be owned here.
    pub fn import(&self, id: impl AsRef<[u8]>, record: &Record) -> Result<Imported, Error> {
        match (record.partition, self.scope.partition) {
            (None, _) => self.inner.import(self.scope(), id.as_ref(), None, record),
            (Some(p), None) => {
                let partition = self.partition(p)?;
                let offset = partition.offset(record.offset)?;
                self.inner
                    .import(partition.scope(), id.as_ref(), offset, record)
            }
            (Some(p), Some(here)) if p == here => {
                let offset = self.offset(record.offset)?;
                self.inner.import(self.scope(), id.as_ref(), offset, record)
            }
            (Some(p), Some(here)) => Err(Error::invalid_option(format!(
                "a record of partition {p} imported through a handle of partition {here}"
            ))),
        }
    }
}

/// A held claim on one key. Resolve it with [`complete`](Claim::complete),
/// [`release`](Claim::release) or [`fail`](Claim::fail); dropping it unresolved
/// releases it (so a panic or early return lets a retry run it again).
#[must_use = "an unresolved claim is released when dropped"]
pub struct Claim {
    pub(crate) namespace: Namespace,
    pub(crate) id: Vec<u8>,
    /// The source offset the claim was begun at: its records carry it.
    pub(crate) offset: Option<u64>,
    pub(crate) attempt: u32,
    /// The lsn of the record this claim last wrote: any other write to the key since
    /// (a re-acquisition after the lease ran out or the key expired, a remove) means
    /// the claim is lost, even if the new acquisition has the same attempt number.
    pub(crate) lsn: Lsn,
    pub(crate) lease_until: UnixMs,
    pub(crate) resolved: bool,
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("namespace", &self.namespace.name)
            .field("id", &String::from_utf8_lossy(&self.id))
            .field("attempt", &self.attempt)
            .field("lease_until", &self.lease_until)
            .finish()
    }
}

impl Claim {
    /// The id this claim holds.
    pub fn id(&self) -> &[u8] {
        &self.id
    }

    /// Which acquisition this is (1 for the first).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Until when the lease holds.
    pub fn lease_until(&self) -> UnixMs {
        self.lease_until
    }

    /// Marks the key done, storing `result` for later `begin`s to replay; the key is
    /// then remembered for the ttl, counted from now.
    pub fn complete(mut self, result: Option<&[u8]>) -> Result<(), Error> {
        let completed = self.resolve(Resolution::Complete(result));
        // A refused result leaves the key untouched: dropping the claim releases it.
        self.resolved = !matches!(completed, Err(Error::ResultTooLarge { .. }));
        completed.map(|_| ())
    }

    /// Gives the key back: a later `begin` may acquire it (and counts an attempt).
    pub fn release(mut self) -> Result<(), Error> {
        self.resolved = true;
        self.resolve(Resolution::Release).map(|_| ())
    }

    /// Marks the key failed for good: later `begin`s answer `Exhausted`.
    pub fn fail(mut self) -> Result<(), Error> {
        self.resolved = true;
        self.resolve(Resolution::Fail).map(|_| ())
    }

    /// Extends the lease to `lease` from now.
    pub fn extend(&mut self, lease: Duration) -> Result<(), Error> {
        let pending = self.extend_pending(lease)?;
        self.namespace.inner.settle(pending)
    }

    /// [`complete`](Claim::complete), with the durability wait as a future: the key
    /// is completed when this is called; the future resolves once that may be acted
    /// on (in `Durability::Immediate`, after the sync that covers it).
    pub fn complete_async(mut self, result: Option<&[u8]>) -> Durable<()> {
        let completed = self.resolve_pending(Resolution::Complete(result));
        self.resolved = !matches!(completed, Err(Error::ResultTooLarge { .. }));
        self.durable(completed)
    }

    /// [`release`](Claim::release), with the durability wait as a future.
    pub fn release_async(mut self) -> Durable<()> {
        self.resolved = true;
        let released = self.resolve_pending(Resolution::Release);
        self.durable(released)
    }

    /// [`fail`](Claim::fail), with the durability wait as a future.
    pub fn fail_async(mut self) -> Durable<()> {
        self.resolved = true;
        let failed = self.resolve_pending(Resolution::Fail);
        self.durable(failed)
    }

    /// [`extend`](Claim::extend), with the durability wait as a future: the lease is
    /// extended when this is called.
    pub fn extend_async(&mut self, lease: Duration) -> Durable<()> {
        let extended = self.extend_pending(lease);
        Durable::applied(&self.namespace.inner, extended)
    }

    fn extend_pending(&mut self, lease: Duration) -> Result<Pending<()>, Error> {
        let lease_ms = duration_ms_ceil(lease);
        let pending = self.resolve_pending(Resolution::Extend(lease_ms))?;
        // The write is made: from now on the claim is this record's acquisition.
        self.lease_until = pending.value.lease_until;
        self.lsn = pending.value.lsn;
        Ok(pending.map(|_| ()))
    }

    fn durable(&self, resolved: Result<Pending<Resolved>, Error>) -> Durable<()> {
        let done = resolved.map(|pending| pending.map(|_| ()));
        Durable::applied(&self.namespace.inner, done)
    }

    fn resolve(&self, how: Resolution<'_>) -> Result<Resolved, Error> {
        let pending = self.resolve_pending(how)?;
        self.namespace.inner.settle(pending)
    }

    fn resolve_pending(&self, how: Resolution<'_>) -> Result<Pending<Resolved>, Error> {
        self.namespace.inner.resolve(
            self.namespace.scope(),
            &self.id,
            self.offset,
            self.attempt,
            self.lsn,
            how,
        )
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if !self.resolved
            && let Err(e) = self.resolve(Resolution::Release)
        {
            tracing::warn!(error = %e, "releasing a dropped claim failed; its lease will run out instead");
        }
    }
}
