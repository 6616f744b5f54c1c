//! The changelog trait: what idemstore needs of a replicated log.

use std::fmt;

/// One entry of a changelog subject: its sequence in the log and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The entry's sequence in the whole log (a JetStream stream sequence): unique,
    /// increasing in the order entries were appended, never 0.
    pub seq: u64,
    /// The message bytes, as appended.
    pub message: Vec<u8>,
}

/// Why a changelog call did not do what it was asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangelogError {
    /// The append was refused, nothing written: the subject's last sequence is not
    /// the one the caller expected (another writer appended since).
    WrongLastSequence,
    /// No answer within the implementation's timeout. For an append the outcome is
    /// unknown: the log may have applied it.
    Timeout,
    /// The log could not be reached, or answered with an error. For an append the
    /// outcome is unknown, as for [`ChangelogError::Timeout`].
    Unavailable(String),
}

impl fmt::Display for ChangelogError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChangelogError::WrongLastSequence => write!(
                f,
                "the changelog refused the append: the subject's last sequence is not the \
                 expected one (another writer appended)"
            ),
            ChangelogError::Timeout => write!(f, "the changelog did not answer in time"),
            ChangelogError::Unavailable(why) => write!(f, "the changelog is unavailable: {why}"),
        }
    }
}

impl std::error::Error for ChangelogError {}

/// A replicated, ordered log of subjects — one subject per replicated partition —
/// that refuses an append unless the subject's last sequence is the one the writer
/// expects. NATS JetStream is the engine this is shaped after: a stream, a subject
/// per partition, `Nats-Expected-Last-Subject-Sequence` on every publish, the stream
/// sequence of the publish ack.
///
/// Every call returns within the implementation's own timeout: never a hang.
pub trait Changelog: Send + Sync {
    /// Appends `message` to `subject` if the subject's last sequence is
    /// `expected_last` (0: the subject has no entry); returns the new entry's sequence
    /// once the log has stored it (a quorum, for a replicated log).
    fn append(
        &self,
        subject: &str,
        expected_last: u64,
        message: &[u8],
    ) -> Result<u64, ChangelogError>;

    /// Up to `max` entries of `subject` with a sequence above `after`, in order. Fewer
    /// than `max` (or none) means the caller has reached the subject's end as the log
    /// stood when it answered.
    fn read(&self, subject: &str, after: u64, max: usize) -> Result<Vec<Entry>, ChangelogError>;
}
