//! The one path every write takes: read the clock, lock the key's shard, find its
//! newest record, let `lifecycle::decide` answer, append what it says, repoint the
//! index, count, unlock; then, if the answer must be durable before it is acted on,
//! wait for the group commit. Retried with a fresh clock reading when the bucket it
//! chose was retired meanwhile.

use std::sync::Arc;

use crate::addr::{Location, Lsn};
use crate::answer::Record;
use crate::error::Error;
use crate::format::record::{ClaimFields, Placement, State, StoredRecord};
use crate::index::{KeyHash, Shard};
use crate::lifecycle::{self, Current, Decision, Kept, Request};
use crate::log::AppendOutcome;
use crate::operations::Counter;
use crate::options::Durability;
use crate::replication::replica::{Role, ShipWait, Slot};

use super::Engine;

/// The key's newest record and where it is.
#[derive(Debug, Clone, Copy)]
pub(super) struct Found {
    pub location: Location,
    pub current: Current,
    /// Covered by a completed sync.
    pub durable: bool,
}

/// What `Inner::apply` did.
#[derive(Debug)]
pub(super) enum Applied {
    /// Nothing written. `record` is the key's live record when a `begin` answer
    /// reports it (boxed: the hot answers, duplicates, carry none).
    Kept {
        kept: Kept,
        current: Option<Current>,
        record: Option<Box<Record>>,
    },
    /// A record was appended.
    Written { lsn: Lsn, claim: ClaimFields },
}

/// An answer, and whether it may be acted on only after a durability wait
/// (`Engine::settle`), and a replication wait (`ReplicationMode::Sync`).
#[must_use]
pub(crate) struct Pending<T> {
    pub value: T,
    pub wait: bool,
    /// Boxed: only `Sync` has one, and every answer carries the field.
    pub ship: Option<Box<ShipWait>>,
}

impl<T> Pending<T> {
    /// An answer with only a local durability wait, if `wait`.
    pub(crate) fn local(value: T, wait: bool) -> Pending<T> {
        Pending {
            value,
            wait,
            ship: None,
        }
    }

    /// The same waits for another value.
    pub(crate) fn map<U>(self, f: impl FnOnce(T) -> U) -> Pending<U> {
        Pending {
            value: f(self.value),
            wait: self.wait,
            ship: self.ship,
        }
    }
}

/// The key a mutation is for, where it belongs, and the partition slot whose rules
/// apply to its write (ownership, shipping, the highest offset): none for unscoped
/// keys and for records a restore applies.
#[derive(Clone, Copy)]
pub(crate) struct Target<'a> {
    pub namespace_id: u32,
    pub placement: Placement,
    pub id: &'a [u8],
    pub slot: Option<&'a Arc<Slot>>,
}

impl Engine {
    /// The key `(namespace_id, id)` in a locked shard, verified against its record.
    #[inline]
    pub(super) fn find(
        &self,
        shard: &Shard,
        hash: KeyHash,
        namespace_id: u32,
        partition: Option<u32>,
        id: &[u8],
    ) -> Result<Option<Found>, Error> {
        let mut found = None;
        let mut error = None;
        shard.find(hash, |location| {
            let read = self.log.with_record(shard, location, |segment, record| {
                (record.namespace_id == namespace_id
                    && record.placement.partition == partition
                    && record.id == id)
                    .then(|| Found {
                        location,
                        current: Current {
                            state: shard.effective_state(record.state, record.lsn),
                            first_seen: crate::clock::UnixMs(record.first_seen_ms),
                            deadline: crate::clock::UnixMs(segment.deadline_ms),
                            claim: record.claim,
                            lsn: record.lsn,
                            placement: record.placement,
                        },
                        durable: segment.is_durable(location.offset),
                    })
            });
            match read {
                Ok(Some(f)) => {
                    found = Some(f);
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

    /// The public record of a live key found in `shard` (the result is read from
    /// its record only for a completed key).
    pub(super) fn public_record(&self, shard: &Shard, found: &Found) -> Result<Record, Error> {
        if found.current.state != State::Completed {
            return Ok(lifecycle::public_record(&found.current, None));
        }
        self.log.with_record(shard, found.location, |_, record| {
            lifecycle::public_record(&found.current, record.result)
        })
    }

    /// Runs `request` on `(namespace_id, id)`: the one mutation skeleton. Inlined
    /// into each operation, so the decision for its request folds to its one arm.
    #[inline(always)]
    pub(super) fn apply(
        &self,
        target: Target<'_>,
        request: &Request<'_>,
    ) -> Result<Pending<Applied>, Error> {
        let Target {
            namespace_id,
            placement,
            id,
            slot,
        } = target;
        let hash = KeyHash::of(namespace_id, placement.partition, id);
        let shard_index = self.index.shard_of(hash);
        let immediate = self.options.durability == Durability::Immediate;
        let replication = self.replica.config.as_ref();
        let sync = replication.is_some_and(|r| r.mode == crate::replication::ReplicationMode::Sync);
        loop {
            let now = self.time.now();
            let mut shard = self.index.lock(hash);
            let found = self.find(&shard, hash, namespace_id, placement.partition, id)?;
            let live = found.filter(|f| f.current.is_live(now));
            let decision = lifecycle::decide(
                request,
                found.as_ref().map(|f| &f.current),
                now,
                self.options.bucket_width_ms,
            );
            let write = match decision {
                Decision::Keep(kept) => {
                    if let Some(counter) = kept_counter(request, kept) {
                        self.operations.count_locked(shard_index, counter);
                    }
                    let reports = kept.reports_live_record();
                    let record = match (reports, &live) {
                        (true, Some(live)) if !matches!(kept, Kept::Duplicate) => {
                            Some(Box::new(self.public_record(&shard, live)?))
                        }
                        _ => None,
                    };
                    let wait = reports && immediate && live.is_some_and(|l| !l.durable);
                    // In Sync, the live record reported may still be on its way to the
                    // cluster: wait for everything queued so far.
                    let ship = match slot {
                        Some(slot) if sync && reports && live.is_some() => {
                            let state = slot.state.lock();
                            (state.shipped < state.enqueued)
                                .then(|| self.ship_wait(slot, state.enqueued))
                        }
                        _ => None,
                    };
                    return Ok(Pending {
                        value: Applied::Kept {
                            kept,
                            current: live.map(|l| l.current),
                            record,
                        },
                        wait,
                        ship,
                    });
                }
                Decision::Append(write) => write,
            };
            debug_assert!(write.deadline > now);
            let lsn = shard.next_lsn();
            let record = StoredRecord {
                state: write.state,
                namespace_id,
                placement,
                lsn,
                first_seen_ms: write.first_seen.0,
                id,
                claim: write.claim,
                result: write.result,
            };
            // A partition's write is checked, appended and queued for the cluster
            // under its slot's lock: a fence (which takes the lock) is never crossed
            // by a write that it did not refuse.
            let mut slot_state = match slot {
                Some(slot) => {
                    let state = slot.state.lock();
                    if let Some(replication) = replication {
                        match state.role {
                            Role::Owned => {}
                            Role::Fenced(by) => {
                                return Err(Error::Fenced {
                                    namespace: slot.namespace.clone(),
                                    partition: slot.partition,
                                    by,
                                });
                            }
                            Role::NotOwned | Role::Restoring => {
                                return Err(Error::NotOwned {
                                    namespace: slot.namespace.clone(),
                                    partition: slot.partition,
                                });
                            }
                        }
                        let queued = Slot::queued_bytes(&state);
                        if queued + record.encoded_len() + 8 > replication.buffer_bytes {
                            return Err(Error::ReplicationBacklog {
                                namespace: slot.namespace.clone(),
                                partition: slot.partition,
                                queued_bytes: queued,
                                budget: replication.buffer_bytes,
                            });
                        }
                    }
                    Some((slot, state))
                }
                None => None,
            };
            // Queued for the cluster as the log writes it: the tee copies the bytes the
            // log just encoded, under the slot's lock taken above.
            let mut number = None;
            let appended = match (replication, slot_state.as_mut()) {
                (Some(_), Some((_, state))) => {
                    let deadline = write.deadline.0;
                    let mut tee = |bytes: &[u8]| {
                        number = Some(Slot::enqueue(state, deadline, bytes.len(), |out| {
                            out.copy_from_slice(bytes)
                        }));
                    };
                    self.log.append(deadline, now.0, &record, Some(&mut tee))?
                }
                _ => self.log.append(write.deadline.0, now.0, &record, None)?,
            };
            let location = match appended {
                AppendOutcome::Retired => continue,
                AppendOutcome::At(location) => location,
            };
            let mut ship = None;
            if let Some((slot, state)) = slot_state.as_mut() {
                if let Some(offset) = placement.offset {
                    state.highest_offset =
                        Some(state.highest_offset.map_or(offset, |h| h.max(offset)));
                }
                if let Some(number) = number {
                    self.replica.schedule(slot, state);
                    #[cfg(feature = "planted-bugs")]
                    let sync = sync && !crate::planted::planted("sync-acks-before-ship");
                    if sync {
                        ship = Some(self.ship_wait(slot, number));
                    }
                }
            }
            drop(slot_state);
            shard.upsert(hash, found.map(|f| f.location), location);
            if let Some(old) = found {
                shard.counts.sub(old.current.state);
            }
            shard.counts.add(write.state);
            if let Some(counter) = written_counter(request) {
                self.operations.count_locked(shard_index, counter);
            }
            return Ok(Pending {
                value: Applied::Written {
                    lsn,
                    claim: write.claim,
                },
                wait: immediate,
                ship,
            });
        }
    }

    fn ship_wait(&self, slot: &Arc<Slot>, target: u64) -> Box<ShipWait> {
        let timeout = self
            .replica
            .config
            .as_ref()
            .map_or(std::time::Duration::ZERO, |r| r.timeout);
        Box::new(ShipWait {
            slot: Arc::clone(slot),
            target,
            deadline: std::time::Instant::now() + timeout,
        })
    }

    /// Waits for the group commit if `wait`, and for the cluster if `ship`.
    pub(crate) fn settle<T>(&self, pending: Pending<T>) -> Result<T, Error> {
        if pending.wait {
            self.committer.wait_durable()?;
        }
        if let Some(ship) = pending.ship {
            ship.slot
                .wait(ship.target, ship.deadline)
                .map_err(|e| Error::from_wait(&ship.slot, e))?;
        }
        Ok(pending.value)
    }
}

/// The counter of an answer that wrote nothing.
#[inline(always)]
fn kept_counter(request: &Request<'_>, kept: Kept) -> Option<Counter> {
    Some(match (request, kept) {
        (Request::CheckAndSet { .. }, Kept::Duplicate) => Counter::CheckAndSetDuplicate,
        (Request::Begin { .. }, Kept::InProgress) => Counter::BeginInProgress,
        (Request::Begin { .. }, Kept::Completed) => Counter::BeginCompleted,
        (Request::Begin { .. }, Kept::Exhausted) => Counter::BeginExhausted,
        _ => return None,
    })
}

/// The counter of a request that wrote.
#[inline(always)]
fn written_counter(request: &Request<'_>) -> Option<Counter> {
    use crate::lifecycle::Resolution;
    Some(match request {
        Request::CheckAndSet { .. } => Counter::CheckAndSetFirst,
        Request::Begin { .. } => Counter::BeginAcquired,
        Request::Resolve { how, .. } => match how {
            Resolution::Complete(_) => Counter::Complete,
            Resolution::Release => Counter::Release,
            Resolution::Fail => Counter::Fail,
            Resolution::Extend(_) => return None,
        },
        Request::Remove => Counter::Remove,
        Request::Import { .. } | Request::Replicate { .. } => return None,
    })
}
