//! The key's state machine, as pure functions: from the key's newest record (if
//! any), the time and a request, the answer, or the record to append. No locks, no
//! I/O; `engine::mutation` runs the decision under the key's shard lock and writes
//! what it says. `docs/ARCHITECTURE.md`'s decision table is this file's `decide`.

use crate::addr::Lsn;
use crate::answer::{Record, Status};
use crate::clock::UnixMs;
use crate::expiry::deadline::bucket_deadline;
use crate::format::record::{ClaimFields, Placement, State};

/// A key's newest record, as the index found it. `state` is the effective state:
/// a claim in progress of an earlier process reads as released
/// (`index::Shard::effective_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Current {
    pub state: State,
    pub first_seen: UnixMs,
    /// The bucket deadline of the record's segment.
    pub deadline: UnixMs,
    pub claim: ClaimFields,
    /// Identifies the acquisition a claim holds.
    pub lsn: Lsn,
    /// The record's partition and source offset, if scoped.
    pub placement: Placement,
}

impl Current {
    /// Remembered at `now`: not removed, its bucket not expired.
    #[inline]
    pub(crate) fn is_live(&self, now: UnixMs) -> bool {
        self.state != State::Tombstone && self.deadline > now
    }
}

/// How a claim is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Resolution<'a> {
    Complete(Option<&'a [u8]>),
    Release,
    Fail,
    /// A new lease of this many ms from now.
    Extend(u64),
}

/// What a caller asks of a key. Durations are validated before (1 s ..= max_ttl).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request<'a> {
    CheckAndSet {
        ttl_ms: u64,
    },
    Begin {
        ttl_ms: u64,
        lease_ms: u64,
        max_attempts: u32,
        payload_fp: Option<u64>,
    },
    /// A claim's own operation: valid only while the key's newest record is the
    /// claim's acquisition (`attempt`, and `lsn` of the record the claim last wrote).
    Resolve {
        attempt: u32,
        lsn: Lsn,
        ttl_ms: u64,
        how: Resolution<'a>,
    },
    Remove,
    /// A record shipped by the partition's previous owner (`restore_partition`): the
    /// changelog is the partition's history, so its newer record replaces whatever
    /// the key holds here, unless its bucket has passed.
    Replicate {
        state: State,
        first_seen: UnixMs,
        claim: ClaimFields,
        result: Option<&'a [u8]>,
        deadline: UnixMs,
    },
    /// Puts an exported record back (`Namespace::import`).
    Import {
        state: State,
        first_seen: UnixMs,
        claim: ClaimFields,
        result: Option<&'a [u8]>,
        /// The record's `expires_at`: nothing is written once it has passed.
        expires_at: UnixMs,
        /// Remembered until then: `expires_at`, or the claim's lease if later.
        until: UnixMs,
        /// `until` may be at most this far from now.
        span_max_ms: u64,
    },
}

/// An answer that writes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// `check_and_set` of a live key.
    Duplicate,
    /// `begin` of a key a live lease holds.
    InProgress,
    /// `begin` of a key marked or completed.
    Completed,
    /// `begin` of a key failed, or out of attempts.
    Exhausted,
    /// `begin_with_payload` with a payload other than the recorded one.
    PayloadMismatch,
    /// A claim whose acquisition is no longer the key's newest record.
    ClaimLost,
    /// `remove` of a key not remembered.
    Absent,
    /// `import` of a key already remembered.
    AlreadyLive,
    /// `import` of a record whose `expires_at` has passed.
    Expired,
    /// `import` of a record remembered longer than `span_max_ms`.
    TooLong,
}

impl Kept {
    /// The answer reports the key's live record: it may be acted on only once that
    /// record is durable (a duplicate of a write whose sync then fails must not be
    /// skipped by one caller while another sees the error).
    #[inline]
    pub(crate) fn reports_live_record(self) -> bool {
        matches!(
            self,
            Kept::Duplicate | Kept::InProgress | Kept::Completed | Kept::Exhausted
        )
    }
}

/// The record to append: the key's new state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Write<'a> {
    pub state: State,
    pub first_seen: UnixMs,
    pub claim: ClaimFields,
    pub result: Option<&'a [u8]>,
    /// The bucket: never earlier than the deadline of a live record it replaces, so
    /// deleting a whole bucket never uncovers an older state of the key.
    pub deadline: UnixMs,
}

/// The decision for `request` on a key whose newest record is `current`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision<'a> {
    Keep(Kept),
    Append(Write<'a>),
}

/// Decides `request` at `now` on a key whose newest record is `current` (live or
/// not), with buckets `bucket_width_ms` wide. Inlined into the mutation skeleton,
/// where each operation's request is known, so only its arm is compiled there.
#[inline(always)]
pub(crate) fn decide<'a>(
    request: &Request<'a>,
    current: Option<&Current>,
    now: UnixMs,
    bucket_width_ms: u64,
) -> Decision<'a> {
    let live = current.filter(|c| c.is_live(now));
    let deadline = |until_ms: u64| bucket_deadline(bucket_width_ms, now, UnixMs(until_ms));
    let after = |ms: u64| now.0.saturating_add(ms);
    match *request {
        Request::CheckAndSet { ttl_ms } => match live {
            Some(_) => Decision::Keep(Kept::Duplicate),
            None => Decision::Append(Write {
                state: State::Seen,
                first_seen: now,
                claim: ClaimFields::default(),
                result: None,
                deadline: deadline(after(ttl_ms)),
            }),
        },
        Request::Begin {
            ttl_ms,
            lease_ms,
            max_attempts,
            payload_fp,
        } => {
            let lease_until_ms = after(lease_ms);
            let acquire = |attempts: u32, first_seen, payload_fp, base: UnixMs| {
                Decision::Append(Write {
                    state: State::InProgress,
                    first_seen,
                    claim: ClaimFields {
                        attempts: attempts.saturating_add(1),
                        lease_until_ms,
                        completed_ms: 0,
                        payload_fp,
                    },
                    result: None,
                    deadline: base.max(deadline(lease_until_ms)),
                })
            };
            let Some(c) = live else {
                return acquire(0, now, payload_fp, deadline(after(ttl_ms)));
            };
            if let (Some(asked), Some(stored)) = (payload_fp, c.claim.payload_fp)
                && asked != stored
            {
                return Decision::Keep(Kept::PayloadMismatch);
            }
            match c.state {
                State::Seen | State::Completed => Decision::Keep(Kept::Completed),
                State::Failed => Decision::Keep(Kept::Exhausted),
                State::InProgress if c.claim.lease_until_ms > now.0 => {
                    Decision::Keep(Kept::InProgress)
                }
                _ if c.claim.attempts >= max_attempts => Decision::Keep(Kept::Exhausted),
                // A lease that ran out, or a released claim: acquire again.
                State::InProgress | State::Released | State::Tombstone => acquire(
                    c.claim.attempts,
                    c.first_seen,
                    c.claim.payload_fp.or(payload_fp),
                    c.deadline,
                ),
            }
        }
        Request::Resolve {
            attempt,
            lsn,
            ttl_ms,
            how,
        } => {
            let Some(c) = live.filter(|c| {
                c.state == State::InProgress && c.claim.attempts == attempt && c.lsn == lsn
            }) else {
                return Decision::Keep(Kept::ClaimLost);
            };
            let mut claim = ClaimFields {
                lease_until_ms: 0,
                ..c.claim
            };
            let (state, deadline, result) = match how {
                Resolution::Complete(result) => {
                    claim.completed_ms = now.0;
                    let retention = deadline(after(ttl_ms));
                    (State::Completed, c.deadline.max(retention), result)
                }
                Resolution::Release => (State::Released, c.deadline, None),
                Resolution::Fail => (State::Failed, c.deadline, None),
                Resolution::Extend(lease_ms) => {
                    claim.lease_until_ms = after(lease_ms);
                    let lease = deadline(claim.lease_until_ms);
                    (State::InProgress, c.deadline.max(lease), None)
                }
            };
            Decision::Append(Write {
                state,
                first_seen: c.first_seen,
                claim,
                result,
                deadline,
            })
        }
        Request::Remove => match live {
            None => Decision::Keep(Kept::Absent),
            // The tombstone goes to the key's own bucket: it hides the key's older
            // records for as long as they can exist.
            Some(c) => Decision::Append(Write {
                state: State::Tombstone,
                first_seen: c.first_seen,
                claim: ClaimFields::default(),
                result: None,
                deadline: c.deadline,
            }),
        },
        Request::Replicate {
            state,
            first_seen,
            claim,
            result,
            deadline,
        } => {
            if deadline <= now {
                Decision::Keep(Kept::Expired)
            } else {
                Decision::Append(Write {
                    state,
                    first_seen,
                    claim,
                    result,
                    // Never earlier than the live record it replaces (a bucket's
                    // deletion must not uncover it).
                    deadline: live.map_or(deadline, |c| c.deadline.max(deadline)),
                })
            }
        }
        Request::Import {
            state,
            first_seen,
            claim,
            result,
            expires_at,
            until,
            span_max_ms,
        } => {
            if expires_at <= now {
                Decision::Keep(Kept::Expired)
            } else if until.0.saturating_sub(now.0) > span_max_ms {
                Decision::Keep(Kept::TooLong)
            } else if live.is_some() {
                Decision::Keep(Kept::AlreadyLive)
            } else {
                Decision::Append(Write {
                    state,
                    first_seen,
                    claim,
                    result,
                    deadline: deadline(until.0),
                })
            }
        }
    }
}

/// The public status of a stored state; `None` for a tombstone (never live).
pub(crate) fn status_of(state: State) -> Option<Status> {
    Some(match state {
        State::Seen => Status::Seen,
        State::InProgress => Status::InProgress,
        State::Released => Status::Released,
        State::Completed => Status::Completed,
        State::Failed => Status::Failed,
        State::Tombstone => return None,
    })
}

/// The stored state of a public status.
pub(crate) fn state_of(status: Status) -> State {
    match status {
        Status::Seen => State::Seen,
        Status::InProgress => State::InProgress,
        Status::Released => State::Released,
        Status::Completed => State::Completed,
        Status::Failed => State::Failed,
    }
}

/// The public record of a live key; `result` is the stored result, read only for a
/// completed key.
pub(crate) fn public_record(current: &Current, result: Option<&[u8]>) -> Record {
    let status = status_of(current.state).expect("a live key is never a tombstone");
    Record {
        status,
        first_seen: current.first_seen,
        expires_at: current.deadline,
        attempts: current.claim.attempts,
        lease_until: (current.state == State::InProgress)
            .then_some(UnixMs(current.claim.lease_until_ms)),
        completed_at: (current.state == State::Completed)
            .then_some(UnixMs(current.claim.completed_ms)),
        result: if current.state == State::Completed {
            result.map(<[u8]>::to_vec)
        } else {
            None
        },
        partition: current.placement.partition,
        offset: current.placement.offset,
    }
}

#[cfg(test)]
mod tests;
