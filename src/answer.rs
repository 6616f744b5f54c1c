//! The answers the store gives: plain values, no handles.

use crate::clock::UnixMs;

/// The answer of [`Namespace::check_and_set`](crate::Namespace::check_and_set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Outcome {
    /// The first time within the retention: process the message.
    First,
    /// Seen before: skip it.
    Duplicate(Seen),
    /// Only from a namespace whose policy is [`Policy::approximate`](crate::Policy::approximate):
    /// the key has no hot entry and the trusted filter of a cold generation holds its
    /// hash, answered without reading a page or a record. A duplicate, or, at most at
    /// the namespace's configured false-duplicate rate, a fresh key: skip it. No
    /// record is read, so there is no [`Seen`]. An exact namespace never answers it.
    LikelyDuplicate,
}

impl Outcome {
    /// `true` for [`Outcome::First`].
    pub fn is_first(&self) -> bool {
        matches!(self, Outcome::First)
    }
}

/// When a duplicate key was first seen and when it will be forgotten.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    /// When the key was first seen.
    pub first_seen: UnixMs,
    /// When the key will be forgotten (bucket deadline).
    pub expires_at: UnixMs,
}

/// The lifecycle status of a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Status {
    /// Marked by `check_and_set`.
    Seen,
    /// A claim holds (or held, if its lease ran out) the key.
    InProgress,
    /// The last claim was released: a later `begin` may acquire it again.
    Released,
    /// Processed; a result may be stored.
    Completed,
    /// Failed for good: `begin` answers `Exhausted`.
    Failed,
}

impl Status {
    /// A lowercase name (`"seen"`, `"in_progress"`, …).
    pub fn as_str(&self) -> &'static str {
        match self {
            Status::Seen => "seen",
            Status::InProgress => "in_progress",
            Status::Released => "released",
            Status::Completed => "completed",
            Status::Failed => "failed",
        }
    }
}

/// The consumption record of one key (what [`Namespace::get`](crate::Namespace::get) returns, and what
/// [`Begin`](crate::Begin) carries).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// The key's status.
    pub status: Status,
    /// When the key was first seen in this retention.
    pub first_seen: UnixMs,
    /// When the key will be forgotten.
    pub expires_at: UnixMs,
    /// How many times a claim acquired the key.
    pub attempts: u32,
    /// Until when the current claim holds the key (in progress only).
    pub lease_until: Option<UnixMs>,
    /// When the key was completed.
    pub completed_at: Option<UnixMs>,
    /// The result stored by `Claim::complete`.
    pub result: Option<Vec<u8>>,
    /// The partition of a partition-scoped key (`Namespace::partition`).
    pub partition: Option<u32>,
    /// The source offset its newest record was written for (`check_and_set_at`,
    /// `begin_at`, and the claim's later records), if any.
    pub offset: Option<u64>,
}

impl Record {
    /// The stored result, if any.
    pub fn result(&self) -> Option<&[u8]> {
        self.result.as_deref()
    }
}

/// What [`Namespace::import`](crate::Namespace::import) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Imported {
    /// The record is now the key's state.
    Written,
    /// The key is already remembered here: left as it is.
    AlreadyLive,
    /// The record's `expires_at` has passed: nothing written (it would be forgotten at
    /// once).
    Expired,
}
