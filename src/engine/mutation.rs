//! The one path every write takes: read the clock, lock the key's shard, find its
//! newest record, let `lifecycle::decide` answer, append what it says, repoint the
//! index, count, unlock; then, if the answer must be durable before it is acted on,
//! wait for the group commit. Retried with a fresh clock reading when the bucket it
//! chose was retired meanwhile.

use crate::addr::{Location, Lsn};
use crate::answer::Record;
use crate::error::Error;
use crate::format::record::{ClaimFields, State, StoredRecord};
use crate::index::{KeyHash, Shard};
use crate::lifecycle::{self, Current, Decision, Kept, Request};
use crate::log::AppendOutcome;
use crate::operations::Counter;
use crate::options::Durability;

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
/// (`Engine::settle`).
#[must_use]
pub(crate) struct Pending<T> {
    pub value: T,
    pub wait: bool,
}

impl Engine {
    /// The key `(namespace_id, id)` in a locked shard, verified against its record.
    #[inline]
    pub(super) fn find(
        &self,
        shard: &Shard,
        hash: KeyHash,
        namespace_id: u32,
        id: &[u8],
    ) -> Result<Option<Found>, Error> {
        let mut found = None;
        let mut error = None;
        shard.find(hash, |location| {
            let read = self.log.with_record(shard, location, |segment, record| {
                (record.namespace_id == namespace_id && record.id == id).then(|| Found {
                    location,
                    current: Current {
                        state: shard.effective_state(record.state, record.lsn),
                        first_seen: crate::clock::UnixMs(record.first_seen_ms),
                        deadline: crate::clock::UnixMs(segment.deadline_ms),
                        claim: record.claim,
                        lsn: record.lsn,
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
        namespace_id: u32,
        id: &[u8],
        request: &Request<'_>,
    ) -> Result<Pending<Applied>, Error> {
        let hash = KeyHash::of(namespace_id, id);
        let shard_index = self.index.shard_of(hash);
        let immediate = self.options.durability == Durability::Immediate;
        loop {
            let now = self.time.now();
            let mut shard = self.index.lock(hash);
            let found = self.find(&shard, hash, namespace_id, id)?;
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
                    return Ok(Pending {
                        value: Applied::Kept {
                            kept,
                            current: live.map(|l| l.current),
                            record,
                        },
                        wait,
                    });
                }
                Decision::Append(write) => write,
            };
            debug_assert!(write.deadline > now);
            let lsn = shard.next_lsn();
            let record = StoredRecord {
                state: write.state,
                namespace_id,
                lsn,
                first_seen_ms: write.first_seen.0,
                id,
                claim: write.claim,
                result: write.result,
            };
            let location = match self.log.append(write.deadline.0, now.0, &record)? {
                AppendOutcome::Retired => continue,
                AppendOutcome::At(location) => location,
            };
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
            });
        }
    }

    /// Waits for the group commit if `wait`.
    pub(crate) fn settle<T>(&self, pending: Pending<T>) -> Result<T, Error> {
        if pending.wait {
            self.committer.wait_durable()?;
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
        Request::Import { .. } => return None,
    })
}
