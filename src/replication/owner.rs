//! The fencing protocol of one replicated partition, over any [`Changelog`].
//!
//! Ownership is the right to append to the partition's subject, and the log enforces
//! it: every append names the subject's last sequence its writer knows, so once a new
//! owner has appended its owner message, every append of the previous owner names a
//! sequence that is no longer the last and is refused. Step by step:
//!
//! 1. **Take over** ([`PartitionOwner::take_over`]): read the subject from the position
//!    the local store already has to its end, handing every message to the caller
//!    (the restore), then append an owner message (a fresh owner token, batch 1) with
//!    the last sequence read as the expected one. Refused (the old owner appended in
//!    between): read on, and try again. Ambiguous (a timeout): resolve (step 3).
//! 2. **Append** ([`PartitionOwner::append`]): a records message with this owner's
//!    token and its next batch number, expecting the last sequence this owner wrote.
//! 3. **Resolve** every outcome that is not a clean answer by reading the entry right
//!    after the last one this owner wrote: this owner's message with this batch
//!    number → it landed (a lost ack); none → it did not land, send it again;
//!    anything else → another owner has appended since: **fenced**. A take-over skips
//!    what a replicated log may land late: a second copy of a message, and a message
//!    of an owner after a later owner's owner message (counted as stale).
//! 4. **Fenced** is final for this owner: every later append answers
//!    [`ReplicationError::Fenced`] without touching the log.
//!
//! A message whose outcome could not be resolved (the log unreachable) stays pending;
//! the next append resolves or resends it first, so a partition's messages land in
//! the order they were written and none lands twice.

use std::sync::atomic::{AtomicU64, Ordering};

use super::changelog::{Changelog, ChangelogError, Entry};
use crate::format::changelog::{self as message, Kind, MessageError, MessageHeader};

/// How many times one call sends a message whose outcome was "not applied" before it
/// returns the error (the message stays pending for the next call).
const SENDS_PER_CALL: usize = 3;
/// Entries read per call of [`Changelog::read`] during a take-over.
const READ_BATCH: usize = 1024;
/// Rounds of "read to the end, append the owner message" before a take-over gives up
/// (each refused round means the previous owner appended meanwhile).
const TAKE_OVER_ROUNDS: usize = 64;

/// Why a replicated append or take-over did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationError {
    /// Another owner has taken the partition over: this owner's appends are refused,
    /// now and from now on. A records message whose append answered this may or may
    /// not have landed before the new owner's owner message (if it did, the new owner
    /// restored it).
    Fenced {
        /// The subject of the partition.
        subject: String,
        /// The owner token of the message that showed it (0: not decodable).
        by: u64,
    },
    /// The changelog did not complete the call (timeout, unavailable, or a take-over
    /// refused round after round). A message whose outcome is unknown stays pending.
    Changelog(ChangelogError),
}

impl std::fmt::Display for ReplicationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicationError::Fenced { subject, by } => write!(
                f,
                "fenced: another owner (token {by:#x}) has taken over {subject}; this store \
                 may no longer write in that partition"
            ),
            ReplicationError::Changelog(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ReplicationError {}

impl From<ChangelogError> for ReplicationError {
    fn from(e: ChangelogError) -> ReplicationError {
        ReplicationError::Changelog(e)
    }
}

/// One message of the partition as a take-over reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shipped<'a> {
    /// Its sequence in the changelog.
    pub seq: u64,
    /// The owner token of the owner that wrote it.
    pub owner: u64,
    /// That owner's message counter (1: its owner message).
    pub batch: u64,
    /// An owner message (a take-over), not records.
    pub is_owner: bool,
    /// Records in it.
    pub records: usize,
    /// The whole message, as stored (`docs/FORMAT.md`, "Changelog messages").
    pub bytes: &'a [u8],
}

/// What a take-over found on its way to the end of the subject.
#[derive(Debug)]
pub struct Restored {
    /// The partition's owner now.
    pub owner: PartitionOwner,
    /// Messages read and handed to the caller.
    pub messages: u64,
    /// Messages that did not decode (sequence and why), skipped: counted, as recovery
    /// counts a damaged record.
    pub damaged: Vec<(u64, String)>,
    /// Messages skipped as stale: a second copy of a message, or a message of an
    /// owner read after a later owner's owner message.
    pub stale: u64,
}

/// The owner of one replicated partition: the only writer whose appends land.
#[derive(Debug)]
pub struct PartitionOwner {
    subject: String,
    namespace: String,
    partition: u32,
    token: u64,
    /// The batch number of the next message.
    next_batch: u64,
    /// The subject's last sequence as this owner knows it: its own last message's.
    last: u64,
    /// A message sent whose outcome is unknown, with its batch number.
    pending: Option<(u64, Vec<u8>)>,
    fenced_by: Option<u64>,
}

impl PartitionOwner {
    /// A fresh owner token: unique per take-over in this process, and across
    /// processes and machines with overwhelming probability (time, process id and a
    /// counter, hashed).
    pub fn new_token() -> u64 {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut seed = [0u8; 24];
        seed[..8].copy_from_slice(&nanos.to_le_bytes());
        seed[8..16].copy_from_slice(&u64::from(std::process::id()).to_le_bytes());
        seed[16..].copy_from_slice(&COUNTER.fetch_add(1, Ordering::Relaxed).to_le_bytes());
        xxhash_rust::xxh3::xxh3_64(&seed).max(1)
    }

    /// Takes partition `partition` of `namespace` over on `subject`: reads every
    /// message after sequence `from` (0: all; a warm store passes the position it
    /// has) to the subject's end, handing each to `restore` in order, then appends
    /// this owner's owner message. From then on every append of any earlier owner is
    /// refused by the log. `token` must be new for every take-over
    /// ([`PartitionOwner::new_token`]); it is never 0.
    pub fn take_over(
        log: &dyn Changelog,
        subject: &str,
        namespace: &str,
        partition: u32,
        token: u64,
        from: u64,
        restore: &mut dyn FnMut(Shipped<'_>),
    ) -> Result<Restored, ReplicationError> {
        assert!(token != 0, "an owner token is never 0");
        assert!(
            !namespace.is_empty() && namespace.len() <= message::NAMESPACE_LEN_MAX,
            "a namespace name of 1..={} bytes",
            message::NAMESPACE_LEN_MAX
        );
        let mut owner = PartitionOwner {
            subject: subject.to_string(),
            namespace: namespace.to_string(),
            partition,
            token,
            next_batch: 1,
            last: from,
            pending: None,
            fenced_by: None,
        };
        let mut messages = 0;
        let mut damaged = Vec::new();
        let mut stale = 0;
        // The owner whose messages count now, and each owner's highest batch read: a
        // message of an owner after a later owner's owner message, or a second copy
        // of a batch, is stale (a replicated log may land an in-flight append late)
        // and is skipped. A warm take-over accepts records until it reads an owner
        // message.
        let mut current: Option<u64> = None;
        let mut highest: std::collections::HashMap<u64, u64> = Default::default();
        let fence = owner.encode(Kind::Owner, 1, &[]);
        for _ in 0..TAKE_OVER_ROUNDS {
            // To the end of the subject as it stands.
            loop {
                let entries = log.read(subject, owner.last, READ_BATCH)?;
                let full = entries.len() == READ_BATCH;
                for entry in &entries {
                    match shipped(entry) {
                        Ok(shipped) => {
                            let copy = highest.get(&shipped.owner) >= Some(&shipped.batch);
                            let retired = !shipped.is_owner
                                && current.is_some_and(|owner| owner != shipped.owner);
                            if copy || retired {
                                stale += 1;
                            } else {
                                if shipped.is_owner {
                                    current = Some(shipped.owner);
                                }
                                highest.insert(shipped.owner, shipped.batch);
                                restore(shipped);
                            }
                        }
                        Err(e) => damaged.push((entry.seq, format!("{e:?}"))),
                    }
                    messages += 1;
                    owner.last = entry.seq;
                }
                if !full {
                    break;
                }
            }
            match owner.send(log, 1, &fence) {
                Ok(_) => {
                    owner.next_batch = 2;
                    return Ok(Restored {
                        owner,
                        messages,
                        damaged,
                        stale,
                    });
                }
                // Someone appended after the end this owner read: read on. The
                // fence was not applied (the subject's last is not ours).
                Err(ReplicationError::Fenced { .. }) => owner.fenced_by = None,
                Err(e) => return Err(e),
            }
        }
        Err(ReplicationError::Changelog(
            ChangelogError::WrongLastSequence,
        ))
    }

    /// Appends one records message: `records` are `(bucket deadline, record bytes)`,
    /// partition-scoped records of this partition in the store's record encoding. Returns its sequence once the log stored it, or
    /// [`ReplicationError::Fenced`] once another owner has taken the partition over.
    /// A message left pending by an earlier call that could not reach the log is
    /// resolved or sent first.
    pub fn append(
        &mut self,
        log: &dyn Changelog,
        records: &[(u64, &[u8])],
    ) -> Result<u64, ReplicationError> {
        self.check_fenced()?;
        if self.pending.is_some() {
            self.send_pending(log)?;
        }
        let batch = self.next_batch;
        let bytes = self.encode(Kind::Records, batch, records);
        self.next_batch += 1;
        self.pending = Some((batch, bytes));
        self.send_pending(log)
    }

    /// Resolves or sends the message left pending by a call that could not reach
    /// the log; `Ok(None)` when none is pending.
    pub fn settle_pending(&mut self, log: &dyn Changelog) -> Result<Option<u64>, ReplicationError> {
        self.check_fenced()?;
        if self.pending.is_none() {
            return Ok(None);
        }
        self.send_pending(log).map(Some)
    }

    /// This owner's token.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The batch number the next message this owner writes gets.
    pub fn next_batch(&self) -> u64 {
        self.next_batch
    }

    /// The subject's last sequence as this owner knows it.
    pub fn last_seq(&self) -> u64 {
        self.last
    }

    /// Whether a message's outcome is still unknown.
    pub fn has_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Whether another owner has taken the partition over.
    pub fn is_fenced(&self) -> bool {
        self.fenced_by.is_some()
    }

    fn check_fenced(&self) -> Result<(), ReplicationError> {
        match self.fenced_by {
            Some(by) => Err(self.fenced(by)),
            None => Ok(()),
        }
    }

    fn fenced(&self, by: u64) -> ReplicationError {
        ReplicationError::Fenced {
            subject: self.subject.clone(),
            by,
        }
    }

    fn encode(&self, kind: Kind, batch: u64, records: &[(u64, &[u8])]) -> Vec<u8> {
        let header = MessageHeader {
            kind,
            namespace: &self.namespace,
            partition: self.partition,
            owner: self.token,
            batch,
        };
        message::encode(&header, records)
    }

    /// Sends the pending message until its outcome is known: landed (its sequence),
    /// fenced, or — after [`SENDS_PER_CALL`] sends that did not land, or when even the
    /// entry after this owner's last cannot be read — the changelog's error, and the
    /// message stays pending.
    fn send_pending(&mut self, log: &dyn Changelog) -> Result<u64, ReplicationError> {
        let (batch, bytes) = self.pending.take().expect("a pending message");
        let sent = self.send(log, batch, &bytes);
        if let Err(ReplicationError::Changelog(_)) = sent {
            self.pending = Some((batch, bytes));
        }
        sent
    }

    fn send(
        &mut self,
        log: &dyn Changelog,
        batch: u64,
        bytes: &[u8],
    ) -> Result<u64, ReplicationError> {
        let mut error = None;
        for _ in 0..SENDS_PER_CALL {
            match log.append(&self.subject, self.last, bytes) {
                Ok(seq) => return Ok(self.landed(seq)),
                Err(e) => error = Some(e),
            }
            // Not a clean answer: what comes right after this owner's last message?
            // (Not the subject's last entry: under a leader change JetStream 2.9 can
            // land an in-flight append after one that was checked against the same
            // expected sequence, so only the entry next to ours tells whether ours
            // is the one that counts.)
            let next = log.read(&self.subject, self.last, 1)?;
            let Some(entry) = next.first() else {
                continue; // did not land
            };
            return match shipped(entry) {
                Ok(s) if s.owner == self.token && s.batch == batch => Ok(self.landed(entry.seq)),
                #[cfg(feature = "planted-bugs")]
                Ok(_) if crate::planted::planted("zombie-catches-up") => {
                    self.last = entry.seq;
                    continue;
                }
                Ok(s) => Err(self.fence(s.owner)),
                Err(_) => Err(self.fence(0)),
            };
        }
        Err(ReplicationError::Changelog(
            error.expect("at least one send"),
        ))
    }

    fn landed(&mut self, seq: u64) -> u64 {
        self.last = seq;
        seq
    }

    fn fence(&mut self, by: u64) -> ReplicationError {
        self.fenced_by = Some(by);
        self.fenced(by)
    }
}

fn shipped(entry: &Entry) -> Result<Shipped<'_>, MessageError> {
    let decoded = message::decode(&entry.message)?;
    Ok(Shipped {
        seq: entry.seq,
        owner: decoded.header.owner,
        batch: decoded.header.batch,
        is_owner: decoded.header.kind == Kind::Owner,
        records: decoded.records.len(),
        bytes: &entry.message,
    })
}
