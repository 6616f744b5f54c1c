//! The one public error type.
//!
//! An expected outcome is a value, not an error: a duplicate is
//! [`Outcome::Duplicate`](crate::Outcome::Duplicate), a held lease is
//! [`Begin::InProgress`](crate::Begin::InProgress). `Error` is for what the caller did
//! wrong or what the machine did to us, and every message says what to do about it.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Everything that can go wrong in idemstore.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// A namespace or id is empty, too long, or (for a namespace) not UTF-8.
    InvalidKey {
        /// Why the key was refused.
        reason: String,
    },
    /// A ttl or lease is shorter than 1 s or longer than the store's `max_ttl`.
    InvalidTtl {
        /// The duration that was refused.
        ttl: Duration,
        /// The largest duration this store accepts.
        max: Duration,
    },
    /// A builder option or policy value is out of range.
    InvalidOption {
        /// Which option, and why.
        reason: String,
    },
    /// A result passed to `Claim::complete` is longer than `max_result_len`.
    ResultTooLarge {
        /// The result's length in bytes.
        len: usize,
        /// The store's limit in bytes.
        max: usize,
    },
    /// The same key arrived with a different payload than the one first recorded.
    PayloadMismatch,
    /// The claim is no longer ours: its lease ran out and another worker acquired the
    /// key, or the key was removed or expired.
    ClaimLost,
    /// Another `Store` (in this or another process) holds the directory.
    Locked {
        /// The directory that is held.
        path: PathBuf,
    },
    /// A file failed its checksum or structure check. At open: a damaged record or
    /// segment header only in `strict` mode (by default they are skipped and counted in
    /// `Stats`); in any mode, records naming a namespace `NAMESPACES` does not hold, or
    /// a damaged `NAMESPACES` entry that valid ones follow. While the store runs, in any
    /// mode: a record the index names no longer reads back (a segment missing or
    /// damaged under the running store).
    Corruption(Corruption),
    /// The store was opened read-only (`StoreBuilder::read_only`): it answers reads and
    /// refuses every write.
    ReadOnly,
    /// An earlier write or fsync failed; the store refuses writes until it is reopened.
    /// Every caller after the failure gets the same error: what failed, where.
    Poisoned {
        /// What the store was doing when it first failed.
        op: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The operating system's error of that first failure.
        source: io::Error,
    },
    /// An I/O operation failed.
    Io {
        /// What the store was doing.
        op: &'static str,
        /// The file or directory involved.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The store was closed.
    Closed,
    /// `check_and_set_many` failed partway: `outcomes` answers the first
    /// `outcomes.len()` ids of the batch (those are applied and, in `Immediate` mode,
    /// durable); the rest were not touched. Process the ids answered `First`, then
    /// retry the rest of the batch.
    PartialBatch {
        /// The answers for the leading ids of the batch, in order.
        outcomes: Vec<crate::Outcome>,
        /// Why the batch stopped.
        source: Box<Error>,
    },
    /// A write in a replicated partition this store does not own: it was never
    /// restored here (`Store::restore_partition`), or it was released.
    NotOwned {
        /// The namespace.
        namespace: String,
        /// The partition.
        partition: u32,
    },
    /// Another store took the partition over (its fencing token is `by`): this store
    /// refuses writes in it until it restores the partition again. The consumer lost
    /// the partition: stop processing its messages.
    Fenced {
        /// The namespace.
        namespace: String,
        /// The partition.
        partition: u32,
        /// The fencing token of the owner that took it over.
        by: u64,
    },
    /// `ReplicationMode::Async` holds `budget` bytes of the partition's records that
    /// the cluster has not stored yet: the write is refused (nothing was written).
    /// Retry after a moment, or call `flush_partition`.
    ReplicationBacklog {
        /// The namespace.
        namespace: String,
        /// The partition.
        partition: u32,
        /// Bytes queued for the cluster.
        queued_bytes: usize,
        /// `Replication::buffer_bytes`.
        budget: usize,
    },
    /// The cluster did not store the partition's records in time, or refused them:
    /// `reason` says what happened. The write is applied locally; in `Sync` do not act
    /// on it as replicated (retry the call: it answers from the local record and waits
    /// for the cluster again).
    Replication {
        /// The namespace.
        namespace: String,
        /// The partition.
        partition: u32,
        /// What failed.
        reason: String,
    },
}

/// Where a file is damaged: opaque apart from its location and a description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corruption {
    pub(crate) file: PathBuf,
    pub(crate) offset: u64,
    pub(crate) reason: String,
}

impl Corruption {
    /// The damaged file.
    pub fn file(&self) -> &std::path::Path {
        &self.file
    }
    /// The byte offset in that file where the damage starts.
    pub fn offset(&self) -> u64 {
        self.offset
    }
    /// What is wrong there.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidKey { reason } => write!(
                f,
                "invalid key: {reason}; a namespace is 1-64 bytes of UTF-8 and an id 1..=max_key_len bytes"
            ),
            Error::InvalidTtl { ttl, max } => write!(
                f,
                "invalid duration {ttl:?}: it must be at least 1 s and at most {max:?} (raise max_ttl when opening the store)"
            ),
            Error::InvalidOption { reason } => write!(f, "invalid option: {reason}"),
            Error::ResultTooLarge { len, max } => write!(
                f,
                "result of {len} bytes exceeds max_result_len ({max} bytes); store a reference to the result instead, or raise max_result_len"
            ),
            Error::PayloadMismatch => write!(
                f,
                "payload mismatch: this key was first recorded with a different payload; the producer is reusing message ids for different messages"
            ),
            Error::ClaimLost => write!(
                f,
                "claim lost: the lease ran out and another worker acquired the key (or it was removed); use a longer lease or call Claim::extend while working"
            ),
            Error::Locked { path } => write!(
                f,
                "{} is in use by another idemstore Store (this or another process); close it first or use another directory",
                path.display()
            ),
            Error::Corruption(c) => write!(
                f,
                "corruption in {} at offset {}: {}; open without strict mode to skip damaged records, or run `idemstore verify`",
                c.file.display(),
                c.offset,
                c.reason
            ),
            Error::Poisoned { op, path, source } => write!(
                f,
                "the store refuses writes after an earlier failure while {op} {}: {source} (what reached the disk is unknown); fix the disk and reopen the store",
                path.display()
            ),
            Error::Io { op, path, source } => {
                write!(f, "I/O error while {op} {}: {source}", path.display())?;
                if source.raw_os_error() == Some(libc::ENOSPC) {
                    write!(f, "; the disk is full: free space, then retry")?;
                }
                Ok(())
            }
            Error::Closed => write!(f, "the store is closed; open it again to continue"),
            Error::ReadOnly => write!(
                f,
                "the store was opened read-only; open it without read_only to write"
            ),
            Error::PartialBatch { outcomes, source } => write!(
                f,
                "the batch stopped after its first {} ids: {source}; those ids are answered in `outcomes` (process the ones answered First), retry the rest",
                outcomes.len()
            ),
            Error::NotOwned {
                namespace,
                partition,
            } => write!(
                f,
                "partition {partition} of namespace {namespace:?} is not owned by this store: call restore_partition({partition}) when it is assigned to this consumer"
            ),
            Error::Fenced {
                namespace,
                partition,
                by,
            } => write!(
                f,
                "partition {partition} of namespace {namespace:?} was taken over by another owner (fencing token {by}): this consumer lost it; stop processing its messages"
            ),
            Error::ReplicationBacklog {
                namespace,
                partition,
                queued_bytes,
                budget,
            } => write!(
                f,
                "partition {partition} of namespace {namespace:?} has {queued_bytes} bytes not yet stored by the cluster (budget {budget}): nothing was written; retry shortly or call flush_partition, and check the cluster"
            ),
            Error::Replication {
                namespace,
                partition,
                reason,
            } => write!(
                f,
                "replication of partition {partition} of namespace {namespace:?}: {reason}"
            ),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } | Error::Poisoned { source, .. } => Some(source),
            Error::PartialBatch { source, .. } => Some(source.as_ref()),
            _ => None,
        }
    }
}

impl Error {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Error {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// The error a failed wait for the cluster gives its caller.
    pub(crate) fn from_wait(
        slot: &crate::replication::replica::Slot,
        wait: crate::replication::replica::WaitError,
    ) -> Error {
        use crate::replication::replica::WaitError;
        let (namespace, partition) = (slot.namespace.clone(), slot.partition);
        match wait {
            WaitError::Fenced(by) => Error::Fenced {
                namespace,
                partition,
                by,
            },
            WaitError::Timeout(last) => Error::Replication {
                namespace,
                partition,
                reason: match last {
                    Some(e) => format!("not stored by the cluster within the timeout; last error: {e}"),
                    None => "not stored by the cluster within the timeout".to_string(),
                },
            },
            WaitError::Dropped => Error::Replication {
                namespace,
                partition,
                reason: "the partition was released or the store closed before its records were stored by the cluster".to_string(),
            },
        }
    }

    pub(crate) fn invalid_key(reason: impl Into<String>) -> Error {
        Error::InvalidKey {
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid_option(reason: impl Into<String>) -> Error {
        Error::InvalidOption {
            reason: reason.into(),
        }
    }

    pub(crate) fn corruption(
        file: impl Into<PathBuf>,
        offset: u64,
        reason: impl Into<String>,
    ) -> Error {
        Error::Corruption(Corruption {
            file: file.into(),
            offset,
            reason: reason.into(),
        })
    }
}
