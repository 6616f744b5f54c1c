//! The one path every write takes: read the clock, lock the key's shard, find its
//! newest record, let `lifecycle::decide` answer, append what it says, repoint the
//! index, count, unlock; then, if the answer must be durable before it is acted on,
//! wait for the group commit. Retried with a fresh clock reading when the bucket it
//! chose was retired meanwhile.

use std::sync::Arc;

use crate::addr::{Location, Lsn};
use crate::answer::Record;
use crate::cold::ColdHit;
use crate::error::Error;
use crate::format::record::{ClaimFields, Placement, State, StoredRecord};
use crate::index::{KeyHash, Shard};
use crate::lifecycle::{self, Current, Decision, Kept, Request};
use crate::log::AppendOutcome;
use crate::operations::Counter;
use crate::options::Durability;
use crate::replication::replica::{Role, ShipWait, Slot};

use super::Engine;

/// The key's newest record and where it is. Small and `Copy`: the hot path moves it
/// around; a record found in the cold tier travels with its `ColdHit` beside it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Found {
    /// Where the hot entry points (for a cold record: its segment's slot when found;
    /// only the `ColdHit` may be read through).
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
    #[inline(always)]
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

    /// `find`, then the cold tier if the hot table has no entry for the key: a record
    /// found there comes with its `ColdHit` in `cold`. (`found` is changed only on a
    /// hot miss, so the hot path moves nothing.)
    #[inline(always)]
    pub(super) fn find_any(
        &self,
        shard: &Shard,
        hash: KeyHash,
        key: (u32, Option<u32>, &[u8]),
        found: &mut Option<Found>,
        cold: &mut Option<ColdHit>,
    ) -> Result<(), Error> {
        let (namespace_id, partition, id) = key;
        *found = self.find(shard, hash, namespace_id, partition, id)?;
        #[cfg(feature = "planted-bugs")]
        if crate::planted::planted("cold-lookup-skipped") {
            return Ok(());
        }
        if found.is_none()
            && !self.cold.is_empty()
            && let Some((f, hit)) = self.find_cold(shard, hash, namespace_id, partition, id)?
        {
            *found = Some(f);
            *cold = Some(hit);
        }
        Ok(())
    }

    /// For an approximate namespace: whether the key has no hot entry and the trusted
    /// filter of a cold generation whose buckets are all live holds its hash
    /// (`Outcome::LikelyDuplicate`, answered without reading a page or a record).
    /// Counted here, under the shard's lock.
    pub(super) fn likely_duplicate(&self, target: Target<'_>) -> Result<bool, Error> {
        if self.cold.is_empty() {
            return Ok(false);
        }
        let (namespace_id, partition, id) =
            (target.namespace_id, target.placement.partition, target.id);
        let hash = KeyHash::of(namespace_id, partition, id);
        let now = self.time.now();
        let shard = self.index.lock(hash);
        if self
            .find(&shard, hash, namespace_id, partition, id)?
            .is_some()
        {
            return Ok(false);
        }
        let likely = self.cold.trusts(hash, now.0);
        if likely {
            self.operations.count_locked(
                self.index.shard_of(hash),
                Counter::CheckAndSetLikelyDuplicate,
            );
        }
        Ok(likely)
    }

    /// The key's newest record in the cold tier (after a miss in the hot table).
    #[cold]
    #[inline(never)]
    fn find_cold(
        &self,
        shard: &Shard,
        hash: KeyHash,
        namespace_id: u32,
        partition: Option<u32>,
        id: &[u8],
    ) -> Result<Option<(Found, ColdHit)>, Error> {
        let Some(hit) = self.cold.find(hash, |record| {
            record.namespace_id == namespace_id
                && record.placement.partition == partition
                && record.id == id
        })?
        else {
            return Ok(None);
        };
        let segment = hit.segment();
        let record = hit
            .record()
            .map_err(|reason| Error::corruption(&segment.path, u64::from(hit.offset), reason))?;
        let found = Found {
            location: Location {
                slot: segment.slot,
                offset: hit.offset,
            },
            current: Current {
                state: shard.effective_state(record.state, record.lsn),
                first_seen: crate::clock::UnixMs(record.first_seen_ms),
                deadline: crate::clock::UnixMs(segment.deadline_ms),
                claim: record.claim,
                lsn: record.lsn,
                placement: record.placement,
            },
            durable: segment.is_durable(hit.offset),
        };
        Ok(Some((found, hit)))
    }

    /// Whether the record `stored` at `location` of `segment` is its key's newest (what
    /// scans list): the hot entry points at it, or the key has none and the cold tier's
    /// newest entry of the key does.
    pub(super) fn is_current(
        &self,
        shard: &Shard,
        hash: KeyHash,
        segment: &crate::log::Segment,
        location: Location,
        stored: &StoredRecord<'_>,
    ) -> Result<bool, Error> {
        if shard.find(hash, |at| at == location).is_some() {
            return Ok(true);
        }
        if self.cold.is_empty() {
            return Ok(false);
        }
        let (mut found, mut hit) = (None, None);
        let key = (stored.namespace_id, stored.placement.partition, stored.id);
        self.find_any(shard, hash, key, &mut found, &mut hit)?;
        Ok(
            hit.is_some_and(|hit| {
                hit.segment().seq == segment.seq && hit.offset == location.offset
            }),
        )
    }

    /// The public record of a live key found in `shard` (the result is read from
    /// its record only for a completed key).
    pub(super) fn public_record(
        &self,
        shard: &Shard,
        found: &Found,
        cold: Option<&ColdHit>,
    ) -> Result<Record, Error> {
        if found.current.state != State::Completed {
            return Ok(lifecycle::public_record(&found.current, None));
        }
        if let Some(hit) = cold {
            let record = hit.record().map_err(|reason| {
                Error::corruption(&hit.segment().path, u64::from(hit.offset), reason)
            })?;
            return Ok(lifecycle::public_record(&found.current, record.result));
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
            let (mut found, mut cold) = (None, None);
            let key = (namespace_id, placement.partition, id);
            self.find_any(&shard, hash, key, &mut found, &mut cold)?;
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
                            Some(Box::new(self.public_record(&shard, live, cold.as_ref())?))
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
            if let Some(hit) = &cold {
                // The cold entry is shadowed from now on: its segment's expiry must not
                // take the key out of the counts again.
                let state = found.map_or(State::Seen, |f| f.current.state);
                #[cfg(feature = "planted-bugs")]
                let counted = !crate::planted::planted("cold-shadow-uncounted");
                #[cfg(not(feature = "planted-bugs"))]
                let counted = true;
                if counted && hit.generation.count_sub(hit.row, shard_index, state) {
                    shard.counts.sub(state);
                }
                // Never answered again: the key's newest record is hot now, and a
                // re-created key's chain may expire before this entry's bucket.
                #[cfg(feature = "planted-bugs")]
                let kill = !crate::planted::planted("cold-shadow-not-killed");
                #[cfg(not(feature = "planted-bugs"))]
                let kill = true;
                if kill {
                    hit.generation.kill(hit.position, hit.trusted);
                }
                shard.upsert(hash, None, location);
            } else {
                shard.upsert(hash, found.map(|f| f.location), location);
                if let Some(old) = found {
                    shard.counts.sub(old.current.state);
                }
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
