//! The reference model of the operation contract (`docs/CONTRACT.md` §1–2), and the
//! replay that runs one sequence of operations against a real store and the model side
//! by side. Shared by `tests/model_proptest.rs` (proptest generates the sequences) and
//! the fuzz target `model_ops` (`fuzz/harness/model_ops.rs` decodes them from bytes),
//! so the semantics they check are written down once.
//!
//! The model is a plain map from (namespace, key) to the key's state under a manual
//! clock: status, first seen, deadline, attempts, lease, result, payload fingerprint,
//! and which acquisition holds a claim. Deadlines are deterministic (§1, "Retention and
//! expiry"), so the model computes them exactly and every `first_seen` / `expires_at`
//! the store answers is compared to the millisecond.

use std::collections::HashMap;

use crate::{
    Begin, Claim, Clock, Durability, Error, ManualClock, Namespace, Outcome, Policy, Record, Seen,
    Status, Store, UnixMs,
};

/// The store's bucket width in the scenario.
pub const WIDTH_MS: u64 = 10_000;
/// Where the manual clock starts.
pub const START_MS: u64 = 1_700_000_003_000;
/// The store's `max_result_len` in the scenario.
pub const MAX_RESULT_LEN: usize = 16;
/// Keys per namespace (`msg-0` … `msg-3`): few, so operations meet on the same keys.
pub const KEYS: usize = 4;
/// Namespace policies: (name, ttl ms, lease ms, max attempts).
pub const NAMESPACES: [(&str, u64, u64, u32); 2] =
    [("orders", 30_000, 5_000, 2), ("mails", 12_000, 3_000, 3)];
/// Per-call ttl overrides. The last is long enough (over 2 × 1024 bucket widths) that
/// its deadlines round to a step of two widths (§1.3).
pub const TTL_OVERRIDES_MS: [u64; 4] = [1_000, 7_000, 25_000, LONG_MS];
/// Leases passed to `Claim::extend`; the last rounds like the long ttl.
pub const EXTEND_MS: [u64; 4] = [1_000, 4_000, 20_000, LONG_MS];
/// A span of 6 h: with 10 s buckets its deadlines are rounded to 20 s.
pub const LONG_MS: u64 = 6 * 3600 * 1000;
/// A clock jump past every ttl and lease, the long ones included.
pub const PAST_LONG_MS: u64 = LONG_MS + 3 * WIDTH_MS;

const _: () = assert!(LONG_MS / (1024 * WIDTH_MS) == 2);

/// One namespace's policy, as the model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPolicy {
    /// The retention.
    pub ttl_ms: u64,
    /// The lease of an acquired claim.
    pub lease_ms: u64,
    /// Acquisitions before `begin` answers `Exhausted`.
    pub max_attempts: u32,
}

/// The model's view of one key.
#[derive(Debug, Clone)]
struct Entry {
    status: Status,
    first_seen: u64,
    deadline: u64,
    attempts: u32,
    lease_until: u64,
    completed_at: u64,
    result: Option<Vec<u8>>,
    payload: Option<u8>,
    /// Which acquisition holds the key (a claim is valid only for its own).
    token: u64,
    /// Released by an open, not written since: the key's newest record is still the
    /// dead claim's `InProgress` record, which every later open counts again.
    released_at_open: bool,
}

impl Entry {
    fn record(&self) -> Record {
        Record {
            status: self.status,
            first_seen: UnixMs(self.first_seen),
            expires_at: UnixMs(self.deadline),
            attempts: self.attempts,
            lease_until: (self.status == Status::InProgress).then_some(UnixMs(self.lease_until)),
            completed_at: (self.status == Status::Completed).then_some(UnixMs(self.completed_at)),
            result: if self.status == Status::Completed {
                self.result.clone()
            } else {
                None
            },
            partition: None,
            offset: None,
        }
    }
}

/// An error, reduced to what the model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrKind {
    /// `Error::PayloadMismatch`.
    PayloadMismatch,
    /// `Error::ClaimLost`.
    ClaimLost,
    /// `Error::ResultTooLarge`.
    ResultTooLarge,
    /// `Error::InvalidTtl`.
    InvalidTtl,
    /// `Error::Closed`.
    Closed,
    /// Anything else (the model never predicts it).
    Other,
}

impl ErrKind {
    /// The kind of `e`.
    pub fn of(e: &Error) -> ErrKind {
        match e {
            Error::PayloadMismatch => ErrKind::PayloadMismatch,
            Error::ClaimLost => ErrKind::ClaimLost,
            Error::ResultTooLarge { .. } => ErrKind::ResultTooLarge,
            Error::InvalidTtl { .. } => ErrKind::InvalidTtl,
            Error::Closed => ErrKind::Closed,
            _ => ErrKind::Other,
        }
    }
}

/// What `begin` answers, comparable (a `Claim` is not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeginAnswer {
    /// `Begin::Acquired`, by the claim's attempt number and lease.
    Acquired {
        /// `Claim::attempt`.
        attempt: u32,
        /// `Claim::lease_until`.
        lease_until: UnixMs,
    },
    /// `Begin::InProgress`.
    InProgress(Record),
    /// `Begin::Completed`.
    Completed(Record),
    /// `Begin::Exhausted`.
    Exhausted(Record),
}

impl BeginAnswer {
    /// The comparable form of the store's answer.
    pub fn of(begin: &Begin) -> BeginAnswer {
        match begin {
            Begin::Acquired(c) => BeginAnswer::Acquired {
                attempt: c.attempt(),
                lease_until: c.lease_until(),
            },
            Begin::InProgress(r) => BeginAnswer::InProgress(r.clone()),
            Begin::Completed(r) => BeginAnswer::Completed(r.clone()),
            Begin::Exhausted(r) => BeginAnswer::Exhausted(r.clone()),
        }
    }
}

/// The model's side of a claim that `begin` acquired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimModel {
    ns: usize,
    key: usize,
    token: u64,
    ttl_ms: u64,
}

/// How a claim is resolved (or extended).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum How {
    /// `Claim::complete` with this result.
    Complete(Option<Vec<u8>>),
    /// `Claim::release`, or dropping the claim.
    Release,
    /// `Claim::fail`.
    Fail,
    /// `Claim::extend` by this lease.
    Extend(u64),
}

/// What an open released (`Model::reopen`), for `Stats::claims_released_at_open`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReleasedAtOpen {
    /// Remembered keys whose claim was in progress at the close: this open released them.
    pub claims: u64,
    /// Remembered keys an earlier open released and nothing wrote since: their newest
    /// record is still the dead claim's, so an open that replays the log finds it again.
    pub earlier: u64,
}

/// The reference model: a map of (namespace index, key index) to the key's state.
#[derive(Debug)]
pub struct Model {
    now_ms: u64,
    bucket_width_ms: u64,
    max_result_len: usize,
    policies: Vec<ModelPolicy>,
    entries: HashMap<(usize, usize), Entry>,
    next_token: u64,
}

impl Model {
    /// An empty store at `now_ms` with these options and namespaces (by index).
    pub fn new(
        now_ms: u64,
        bucket_width_ms: u64,
        max_result_len: usize,
        policies: Vec<ModelPolicy>,
    ) -> Model {
        Model {
            now_ms,
            bucket_width_ms,
            max_result_len,
            policies,
            entries: HashMap::new(),
            next_token: 0,
        }
    }

    /// The model's time: the highest clock reading seen (time never goes back).
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// The store read the clock at `clock_ms`: time moves forward only.
    pub fn observe(&mut self, clock_ms: u64) {
        self.now_ms = self.now_ms.max(clock_ms);
    }

    /// The bucket deadline of a record written now that must be remembered until
    /// `until_ms` (`docs/CONTRACT.md` §1.3): `until_ms` rounded up to a step `g` that
    /// grows with the span, `g = W * max(1, span / (1024 * W))` for bucket width `W`.
    pub fn deadline(&self, until_ms: u64) -> u64 {
        let width = self.bucket_width_ms;
        let span = until_ms - self.now_ms;
        let step = width * (span / (1024 * width)).max(1);
        until_ms.div_ceil(step) * step
    }

    fn live(&self, ns: usize, key: usize) -> Option<&Entry> {
        self.entries
            .get(&(ns, key))
            .filter(|e| e.deadline > self.now_ms)
    }

    /// What `get` answers.
    pub fn get(&self, ns: usize, key: usize) -> Option<Record> {
        self.live(ns, key).map(Entry::record)
    }

    /// `check_and_set` with retention `ttl_ms`.
    pub fn check_and_set(&mut self, ns: usize, key: usize, ttl_ms: u64) -> Outcome {
        if let Some(e) = self.live(ns, key) {
            return Outcome::Duplicate(Seen {
                first_seen: UnixMs(e.first_seen),
                expires_at: UnixMs(e.deadline),
            });
        }
        let entry = Entry {
            status: Status::Seen,
            first_seen: self.now_ms,
            deadline: self.deadline(self.now_ms + ttl_ms),
            attempts: 0,
            lease_until: 0,
            completed_at: 0,
            result: None,
            payload: None,
            token: 0,
            released_at_open: false,
        };
        self.entries.insert((ns, key), entry);
        Outcome::First
    }

    /// `begin` (with a payload fingerprint if `payload` is set) with retention
    /// `ttl_ms`; on acquisition also the model's side of the claim.
    pub fn begin(
        &mut self,
        ns: usize,
        key: usize,
        payload: Option<u8>,
        ttl_ms: u64,
    ) -> Result<(BeginAnswer, Option<ClaimModel>), ErrKind> {
        let ModelPolicy {
            lease_ms,
            max_attempts,
            ..
        } = self.policies[ns];
        let now = self.now_ms;
        let lease_until = now + lease_ms;
        let entry = match self.live(ns, key).cloned() {
            Some(e) => {
                if let (Some(asked), Some(stored)) = (payload, e.payload)
                    && asked != stored
                {
                    return Err(ErrKind::PayloadMismatch);
                }
                match e.status {
                    Status::Seen | Status::Completed => {
                        return Ok((BeginAnswer::Completed(e.record()), None));
                    }
                    Status::Failed => return Ok((BeginAnswer::Exhausted(e.record()), None)),
                    Status::InProgress if e.lease_until > now => {
                        return Ok((BeginAnswer::InProgress(e.record()), None));
                    }
                    _ if e.attempts >= max_attempts => {
                        return Ok((BeginAnswer::Exhausted(e.record()), None));
                    }
                    _ => {}
                }
                Entry {
                    status: Status::InProgress,
                    deadline: e.deadline.max(self.deadline(lease_until)),
                    attempts: e.attempts + 1,
                    lease_until,
                    completed_at: 0,
                    result: None,
                    payload: e.payload.or(payload),
                    released_at_open: false,
                    ..e
                }
            }
            None => Entry {
                status: Status::InProgress,
                first_seen: now,
                deadline: self.deadline(now + ttl_ms).max(self.deadline(lease_until)),
                attempts: 1,
                lease_until,
                completed_at: 0,
                result: None,
                payload,
                token: 0,
                released_at_open: false,
            },
        };
        self.next_token += 1;
        let token = self.next_token;
        let answer = BeginAnswer::Acquired {
            attempt: entry.attempts,
            lease_until: UnixMs(lease_until),
        };
        self.entries.insert((ns, key), Entry { token, ..entry });
        let claim = ClaimModel {
            ns,
            key,
            token,
            ttl_ms,
        };
        Ok((answer, Some(claim)))
    }

    /// Resolves or extends `claim`; returns the lease deadline afterwards (the new one
    /// for `Extend`). A `complete` refused for its result's length releases the claim,
    /// as dropping the refused `Claim` does.
    pub fn resolve(&mut self, claim: &ClaimModel, how: How) -> Result<u64, ErrKind> {
        if let How::Complete(Some(result)) = &how
            && result.len() > self.max_result_len
        {
            let _ = self.resolve(claim, How::Release);
            return Err(ErrKind::ResultTooLarge);
        }
        let now = self.now_ms;
        let complete_deadline = self.deadline(now + claim.ttl_ms);
        let extend_deadline = match how {
            How::Extend(lease_ms) => self.deadline(now + lease_ms),
            _ => 0,
        };
        let Some(e) = self.entries.get_mut(&(claim.ns, claim.key)).filter(|e| {
            e.deadline > now && e.status == Status::InProgress && e.token == claim.token
        }) else {
            return Err(ErrKind::ClaimLost);
        };
        match how {
            How::Complete(result) => {
                e.status = Status::Completed;
                e.completed_at = now;
                e.deadline = e.deadline.max(complete_deadline);
                e.result = result;
                e.lease_until = 0;
            }
            How::Release => {
                e.status = Status::Released;
                e.lease_until = 0;
            }
            How::Fail => {
                e.status = Status::Failed;
                e.lease_until = 0;
            }
            How::Extend(lease_ms) => {
                e.lease_until = now + lease_ms;
                e.deadline = e.deadline.max(extend_deadline);
            }
        }
        Ok(e.lease_until)
    }

    /// `remove`: whether the key was remembered.
    pub fn remove(&mut self, ns: usize, key: usize) -> bool {
        let live = self.live(ns, key).is_some();
        self.entries.remove(&(ns, key));
        live
    }

    /// The store was closed and opened again: the claims in progress belonged to the
    /// process that held the store before, so the open releases them
    /// (`docs/CONTRACT.md` §3.6); their attempts stay.
    pub fn reopen(&mut self) -> ReleasedAtOpen {
        let mut released = ReleasedAtOpen::default();
        for e in self.entries.values_mut() {
            let live = u64::from(e.deadline > self.now_ms);
            if e.status == Status::InProgress {
                e.status = Status::Released;
                e.lease_until = 0;
                e.released_at_open = true;
                released.claims += live;
            } else if e.released_at_open {
                released.earlier += live;
            }
        }
        released
    }

    /// Live keys per status: (seen, in progress, released, completed, failed), as
    /// `Stats` counts them.
    pub fn counts(&self) -> [u64; 5] {
        let mut counts = [0; 5];
        for e in self.entries.values().filter(|e| e.deadline > self.now_ms) {
            let i = match e.status {
                Status::Seen => 0,
                Status::InProgress => 1,
                Status::Released => 2,
                Status::Completed => 3,
                _ => 4,
            };
            counts[i] += 1;
        }
        counts
    }
}

mod replay;

pub use replay::{Op, Replay, block_on, id, open};
