//! Partitions (`docs/REPLICATION.md`): restore on assignment, flush before an offset
//! commit, release on revoke, and the `PARTITIONS` file that lets a restart restore
//! warm. The write path's side (ownership checks, queueing for the cluster) is in
//! `mutation`; the shipping threads are `replication::replica`.

mod file;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::Engine;
use super::keys::Scope;
use super::mutation::Target;
use crate::clock::UnixMs;
use crate::error::Error;
use crate::format::changelog as message;
use crate::format::record::{State, StoredRecord};
use crate::format::segment_header;
use crate::index::KeyHash;
use crate::lifecycle::Request;
use crate::log::{Location, Segment, reader};
use crate::options::Durability;
use crate::replication::replica::{Role, ShipWait, Slot};
use crate::replication::{PartitionOwner, ReplicationError};
use crate::stats::ReplicationStats;

/// What `Namespace::restore_partition` did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RestoreReport {
    /// Without replication: nothing to restore from, nothing was read.
    pub local_only: bool,
    /// The changelog position the restore read from (0: the start, a cold restore;
    /// above: a warm store's position).
    pub from: u64,
    /// The position reached: the sequence of this store's owner message.
    pub position: u64,
    /// Changelog messages read.
    pub messages: u64,
    /// Records applied to the local store.
    pub records: u64,
    /// Records whose retention had run out, not applied.
    pub expired: u64,
    /// Messages skipped as stale (a retried append's second copy, or a previous
    /// owner's message that landed after a later owner's take-over).
    pub stale: u64,
    /// Messages that failed their checksum or structure check, skipped (in strict
    /// mode the restore fails instead), with their sequence.
    pub damaged: Vec<(u64, String)>,
    /// The fencing token this store owns the partition with.
    pub token: u64,
    /// Live local records queued to ship again: this store had stopped owning the
    /// partition with records unshipped, or crashed while owning it, so its local
    /// records may hold marks the changelog lacks (`docs/REPLICATION.md`).
    pub reshipped: u64,
    /// How long the restore took.
    pub duration: Duration,
}

/// What `Namespace::release_partition` did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReleaseReport {
    /// Records the flush waited for.
    pub flushed: u64,
    /// The changelog position kept for a warm restore.
    pub position: u64,
}

/// A partition's state here (`Namespace::partition_info`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionInfo {
    /// This store may write in it: restored and not released or fenced (always true
    /// without replication).
    pub owned: bool,
    /// Another owner took it over (its token).
    pub fenced_by: Option<u64>,
    /// The highest source offset marked in it (by `check_and_set_at`/`begin_at`,
    /// or restored).
    pub highest_offset: Option<u64>,
    /// The changelog position this store's copy is complete to.
    pub position: u64,
    /// Records written and not yet stored by the cluster.
    pub queued_records: u64,
}

impl Engine {
    /// The slot of partition `partition` of the namespace `name` (id `id`).
    pub(crate) fn partition_slot(&self, name: &str, id: u32, partition: u32) -> Arc<Slot> {
        self.replica.slot(name, id, partition)
    }

    fn slot_of<'a>(&self, scope: &'a Scope) -> Result<&'a Arc<Slot>, Error> {
        scope.slot.as_ref().ok_or_else(|| {
            Error::invalid_option(
                "a partition operation on a handle without a partition: use namespace.partition(p)",
            )
        })
    }

    /// Reads the partition's changelog from the position this store has, applies its
    /// records, and takes the partition over: from then on an earlier owner's appends
    /// are refused by the changelog, and this store may write in the partition.
    pub(crate) fn restore_partition(&self, scope: &Scope) -> Result<RestoreReport, Error> {
        self.check_writable()?;
        let slot = self.slot_of(scope)?;
        let started = Instant::now();
        let Some(config) = self.replica.config.as_ref() else {
            // Nothing to restore from: the local store is the partition's whole state.
            return Ok(RestoreReport {
                local_only: true,
                duration: started.elapsed(),
                ..RestoreReport::default()
            });
        };
        // Owned already (a consumer that restarts its assignment, or a zombie that
        // has not learned it was fenced): what it queued ships first, then the
        // take-over runs as for any other assignment, so that ownership is always
        // proven against the changelog, never assumed.
        let owned = slot.state.lock().role == Role::Owned;
        if owned {
            match self.flush_partition(scope) {
                Ok(()) | Err(Error::Fenced { .. }) => {}
                Err(e) => return Err(e),
            }
            slot.disown(Role::NotOwned);
        }
        let from = {
            let mut state = slot.state.lock();
            if state.role == Role::Restoring {
                return Err(Error::invalid_option(format!(
                    "partition {} of namespace {:?} is being restored by another call",
                    slot.partition, slot.namespace
                )));
            }
            state.role = Role::Restoring;
            state.position
        };
        // Each shard's next lsn before the changelog is applied: the records to ship
        // again are the live ones written before it (the import's own are after).
        let reship_before: Option<Vec<u64>> = slot.state.lock().reship.then(|| {
            self.index
                .shards()
                .map(|shard| shard.lock().lsn_counter())
                .collect()
        });
        let restored = self.read_and_take_over(scope, slot, config.changelog.as_ref(), from);
        let (report, owner) = match restored {
            Ok(done) => done,
            Err(e) => {
                slot.state.lock().role = Role::NotOwned;
                return Err(e);
            }
        };
        slot.own(owner);
        let reshipped = match reship_before {
            Some(before) => self.reship(scope, slot, &before)?,
            None => 0,
        };
        let counters = &self.replica.restores;
        counters[0].fetch_add(1, Ordering::Relaxed);
        counters[1].fetch_add(report.messages, Ordering::Relaxed);
        counters[2].fetch_add(report.records, Ordering::Relaxed);
        counters[3].fetch_add(report.damaged.len() as u64, Ordering::Relaxed);
        if let Err(e) = self.persist_partitions() {
            tracing::warn!(error = %e, "keeping the partition positions; the next restore after a restart is cold");
        }
        tracing::info!(
            namespace = %slot.namespace,
            partition = slot.partition,
            from,
            messages = report.messages,
            records = report.records,
            damaged = report.damaged.len(),
            reshipped,
            "restored a partition"
        );
        Ok(RestoreReport {
            duration: started.elapsed(),
            reshipped,
            ..report
        })
    }

    /// Queues again every live local record of the partition written before
    /// `before` (each shard's next lsn when the restore began), in the order the log
    /// holds them: after a crash or a drop, the changelog may lack some of them. A
    /// superset (records that did ship go again, and are applied as the copies they
    /// are); its cost is a read of the live log, paid only after such an end. Runs
    /// once the partition is owned: a key the consumer writes meanwhile has a newer
    /// record, so its old one is no longer live and is not queued (checked under the
    /// key's shard lock, then the slot's, the write path's order).
    fn reship(&self, scope: &Scope, slot: &Arc<Slot>, before: &[u64]) -> Result<u64, Error> {
        let mut segments: Vec<Arc<Segment>> = self.log.table.read().segments().cloned().collect();
        segments.sort_by_key(|s| s.seq);
        let now = self.time.now();
        let mut queued = 0u64;
        let mut owned = true;
        let mut failure = None;
        for segment in segments.iter().filter(|s| s.deadline_ms > now.0) {
            let bytes = segment
                .file
                .read_for_walk(segment_header::LEN, segment.published() as usize);
            reader::scan(bytes, segment_header::LEN, |offset, stored| {
                if !owned
                    || stored.state == State::Tombstone
                    || stored.namespace_id != scope.id
                    || stored.placement.partition != Some(slot.partition)
                {
                    return;
                }
                let hash = KeyHash::of_record(&stored);
                if stored.lsn.counter() >= before[self.index.shard_of(hash)] {
                    return;
                }
                let location = Location {
                    slot: segment.slot,
                    offset: offset as u32,
                };
                let shard = self.index.lock(hash);
                match self.is_current(&shard, hash, segment, location, &stored) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => {
                        failure.get_or_insert(e);
                        return;
                    }
                }
                let mut state = slot.state.lock();
                if state.role != Role::Owned {
                    owned = false; // fenced or released meanwhile: nothing to ship to
                    return;
                }
                let record = StoredRecord {
                    state: shard.effective_state(stored.state, stored.lsn),
                    ..stored
                };
                Slot::enqueue(
                    &mut state,
                    segment.deadline_ms,
                    record.encoded_len(),
                    |out| record.encode_into(out),
                );
                self.replica.schedule(slot, &mut state);
                queued += 1;
            });
        }
        if let Some(e) = failure {
            return Err(e);
        }
        if owned {
            slot.state.lock().reship = false;
        }
        self.replica.restores[4].fetch_add(queued, Ordering::Relaxed);
        Ok(queued)
    }

    fn read_and_take_over(
        &self,
        scope: &Scope,
        slot: &Arc<Slot>,
        log: &dyn crate::replication::Changelog,
        from: u64,
    ) -> Result<(RestoreReport, PartitionOwner), Error> {
        let mut report = RestoreReport {
            from,
            ..RestoreReport::default()
        };
        let mut failed: Option<Error> = None;
        let mut highest: Option<u64> = None;
        let token = PartitionOwner::new_token();
        let mut apply = |shipped: crate::replication::Shipped<'_>| {
            if failed.is_some() || shipped.is_owner {
                return;
            }
            let decoded = match message::decode(shipped.bytes) {
                Ok(decoded) => decoded,
                // The take-over decoded it already: never expected.
                Err(e) => {
                    report.damaged.push((shipped.seq, format!("{e:?}")));
                    return;
                }
            };
            for (deadline, record) in &decoded.records {
                let request = Request::Replicate {
                    state: record.state,
                    first_seen: UnixMs(record.first_seen_ms),
                    claim: record.claim,
                    result: record.result,
                    deadline: UnixMs(*deadline),
                };
                let target = Target {
                    namespace_id: scope.id,
                    placement: record.placement,
                    id: record.id,
                    slot: None,
                };
                match self.apply(target, &request) {
                    Ok(pending) => match pending.value {
                        super::mutation::Applied::Written { .. } => {
                            report.records += 1;
                            if let Some(offset) = record.placement.offset {
                                highest = Some(highest.map_or(offset, |h| h.max(offset)));
                            }
                        }
                        super::mutation::Applied::Kept { .. } => report.expired += 1,
                    },
                    Err(e) => {
                        failed = Some(e);
                        return;
                    }
                }
            }
        };
        let taken = PartitionOwner::take_over(
            log,
            &slot.subject,
            &slot.namespace,
            slot.partition,
            token,
            from,
            &mut apply,
        );
        let restored = match taken {
            Ok(restored) => restored,
            Err(ReplicationError::Fenced { by, .. }) => {
                return Err(Error::Fenced {
                    namespace: slot.namespace.clone(),
                    partition: slot.partition,
                    by,
                });
            }
            Err(ReplicationError::Changelog(e)) => {
                return Err(Error::Replication {
                    namespace: slot.namespace.clone(),
                    partition: slot.partition,
                    reason: format!("restoring from the changelog: {e}"),
                });
            }
        };
        if let Some(e) = failed {
            return Err(e);
        }
        report.damaged.extend(restored.damaged.iter().cloned());
        for (seq, why) in &report.damaged {
            tracing::error!(subject = %slot.subject, seq, reason = %why, "a damaged changelog message, skipped");
        }
        if self.options.strict
            && let Some((seq, why)) = report.damaged.first()
        {
            return Err(Error::corruption(
                format!("changelog subject {}", slot.subject),
                *seq,
                format!("changelog message at stream sequence {seq}: {why} (strict mode)"),
            ));
        }
        // The restored records are durable here before the position that says so.
        if self.options.durability != Durability::None {
            self.committer.wait_durable()?;
        }
        report.messages = restored.messages;
        report.stale = restored.stale;
        report.position = restored.owner.last_seq();
        report.token = restored.owner.token();
        if let Some(h) = highest {
            let mut state = slot.state.lock();
            state.highest_offset = Some(state.highest_offset.map_or(h, |o| o.max(h)));
        }
        Ok((report, restored.owner))
    }

    /// The wait of `flush_partition`: every record of the partition written so far,
    /// stored by the cluster. `None`: nothing to wait for.
    pub(crate) fn flush_partition_wait(&self, scope: &Scope) -> Result<Option<ShipWait>, Error> {
        self.check_writable()?;
        let slot = self.slot_of(scope)?;
        let Some(config) = self.replica.config.as_ref() else {
            return Ok(None);
        };
        let state = slot.state.lock();
        if let Role::Fenced(by) = state.role {
            return Err(Error::Fenced {
                namespace: slot.namespace.clone(),
                partition: slot.partition,
                by,
            });
        }
        if state.shipped >= state.enqueued {
            return Ok(None);
        }
        Ok(Some(ShipWait {
            slot: Arc::clone(slot),
            target: state.enqueued,
            deadline: Instant::now() + config.timeout,
        }))
    }

    pub(crate) fn flush_partition(&self, scope: &Scope) -> Result<(), Error> {
        match self.flush_partition_wait(scope)? {
            None => Ok(()),
            Some(wait) => wait
                .slot
                .wait(wait.target, wait.deadline)
                .map_err(|e| Error::from_wait(&wait.slot, e)),
        }
    }

    /// Flushes the partition, then gives it up: writes in it are refused
    /// (`Error::NotOwned`) until it is restored again. The local records stay, a
    /// warm standby: a later restore here reads only what was written since.
    pub(crate) fn release_partition(&self, scope: &Scope) -> Result<ReleaseReport, Error> {
        self.check_writable()?;
        let slot = self.slot_of(scope)?;
        if self.replica.config.is_none() {
            return Ok(ReleaseReport::default());
        }
        let before = {
            let state = slot.state.lock();
            state.enqueued - state.shipped
        };
        let flushed = self.flush_partition(scope);
        slot.disown(Role::NotOwned);
        if self.options.durability != Durability::None {
            self.committer.wait_durable()?;
        }
        self.persist_partitions()?;
        flushed?;
        Ok(ReleaseReport {
            flushed: before,
            position: slot.state.lock().position,
        })
    }

    pub(crate) fn partition_info(&self, scope: &Scope) -> Result<PartitionInfo, Error> {
        self.check_open()?;
        let slot = self.slot_of(scope)?;
        let replicated = self.replica.config.is_some();
        let state = slot.state.lock();
        Ok(PartitionInfo {
            owned: !replicated || state.role == Role::Owned,
            fenced_by: match state.role {
                Role::Fenced(by) => Some(by),
                _ => None,
            },
            highest_offset: state.highest_offset,
            position: state.position,
            queued_records: state.enqueued - state.shipped,
        })
    }

    pub(super) fn replication_stats(&self) -> ReplicationStats {
        let r = &self.replica.restores;
        ReplicationStats {
            restores: r[0].load(Ordering::Relaxed),
            restored_messages: r[1].load(Ordering::Relaxed),
            restored_records: r[2].load(Ordering::Relaxed),
            damaged_messages: r[3].load(Ordering::Relaxed),
            reshipped_records: r[4].load(Ordering::Relaxed),
            ..self.replica.totals()
        }
    }
}
