//! The replication options of a store (`StoreBuilder::replication`): the changelog,
//! the subjects, the mode, and the bounds on waiting and buffering.

use std::sync::Arc;
use std::time::Duration;

use super::changelog::Changelog;

/// How a replicated partition's records reach the cluster, as `Durability` says how
/// they reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicationMode {
    /// Records ship in the background. `flush_partition` returns once every record of
    /// the partition written before it is stored by the cluster: call it before
    /// committing offsets and in the revoke callback. A machine lost with its disk
    /// loses at most the records not flushed.
    Async,
    /// `check_and_set`, `begin` and a claim's `complete`/`release`/`fail` return only
    /// once their record is stored by the cluster (a quorum); concurrent callers of a
    /// partition share one round trip.
    Sync,
}

/// Replication of a store's partition-scoped namespaces to a changelog
/// ([`StoreBuilder::replication`](crate::StoreBuilder::replication)).
#[derive(Clone)]
pub struct Replication {
    pub(crate) changelog: Arc<dyn Changelog>,
    pub(crate) subject_prefix: String,
    pub(crate) mode: ReplicationMode,
    pub(crate) timeout: Duration,
    pub(crate) buffer_bytes: usize,
    pub(crate) message_bytes: usize,
    pub(crate) shippers: usize,
}

impl std::fmt::Debug for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replication")
            .field("subject_prefix", &self.subject_prefix)
            .field("mode", &self.mode)
            .field("timeout", &self.timeout)
            .field("buffer_bytes", &self.buffer_bytes)
            .finish()
    }
}

impl Replication {
    /// Replicates to `changelog`, one subject per partition below `subject_prefix`
    /// (`<prefix>.<namespace>.<partition>`; for [`NatsChangelog`](crate::replication)
    /// the prefix must be below the stream's `subject_prefix`, e.g. `idemstore.orders`
    /// for a consumer group `orders`). Defaults: `Async`, 5 s timeout, 64 MiB buffer,
    /// messages of at most 512 KiB, 4 shipping threads.
    pub fn new(changelog: Arc<dyn Changelog>, subject_prefix: impl Into<String>) -> Replication {
        Replication {
            changelog,
            subject_prefix: subject_prefix.into(),
            mode: ReplicationMode::Async,
            timeout: Duration::from_secs(5),
            buffer_bytes: 64 << 20,
            message_bytes: 512 << 10,
            shippers: 4,
        }
    }

    /// `Async` (default) or `Sync`.
    pub fn mode(mut self, mode: ReplicationMode) -> Replication {
        self.mode = mode;
        self
    }

    /// The bound on every wait for the cluster: a `Sync` call, `flush_partition`,
    /// `restore_partition` calls of the changelog (default 5 s). Past it the caller
    /// gets `Error::Replication`; shipping goes on in the background.
    pub fn timeout(mut self, timeout: Duration) -> Replication {
        self.timeout = timeout;
        self
    }

    /// The most bytes of records a partition may hold unshipped (default 64 MiB):
    /// beyond it, writes in the partition answer `Error::ReplicationBacklog` until
    /// the cluster catches up (pushback, not unbounded memory).
    pub fn buffer_bytes(mut self, bytes: usize) -> Replication {
        self.buffer_bytes = bytes;
        self
    }

    /// The largest changelog message (default 512 KiB; NATS refuses messages above
    /// its `max_payload`, 1 MiB by default).
    pub fn message_bytes(mut self, bytes: usize) -> Replication {
        self.message_bytes = bytes;
        self
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.subject_prefix.is_empty()
            || self
                .subject_prefix
                .split('.')
                .any(|t| t.is_empty() || !t.bytes().all(subject_byte))
        {
            return Err(format!(
                "replication subject prefix {:?}: dot-separated tokens of A-Z a-z 0-9 _ -",
                self.subject_prefix
            ));
        }
        if self.timeout < Duration::from_millis(1) || self.timeout > Duration::from_secs(3600) {
            return Err(format!(
                "replication timeout {:?}: between 1 ms and 1 hour",
                self.timeout
            ));
        }
        if self.message_bytes < 4096 || self.message_bytes > 64 << 20 {
            return Err(format!(
                "replication message_bytes {}: between 4 KiB and 64 MiB",
                self.message_bytes
            ));
        }
        if self.buffer_bytes < self.message_bytes {
            return Err(format!(
                "replication buffer_bytes {} is below message_bytes {}",
                self.buffer_bytes, self.message_bytes
            ));
        }
        Ok(())
    }
}

fn subject_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_' || b == b'-'
}

/// The subject token of a namespace name: the name itself when it is made of subject
/// bytes, else `~` and its hex.
pub(crate) fn subject_token(name: &str) -> String {
    if name.bytes().all(subject_byte) {
        name.to_string()
    } else {
        let mut out = String::from("~");
        for b in name.bytes() {
            out.push_str(&format!("{b:02x}"));
        }
        out
    }
}
