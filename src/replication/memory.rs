//! An in-process changelog with injected faults: the deterministic stand-in for a
//! replicated engine in tests of the protocol, beside the real one.

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use super::changelog::{Changelog, ChangelogError, Entry};

/// A fault the next changelog call meets (see [`MemoryChangelog::inject`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The call is not applied and answers [`ChangelogError::Unavailable`].
    Unavailable,
    /// The call is not applied and answers [`ChangelogError::Timeout`].
    TimeoutBefore,
    /// An append is applied, but its ack is lost: it answers
    /// [`ChangelogError::Timeout`]. (A read just times out.)
    LostAck,
    /// An append is applied by the old leader and the answer is a leader change:
    /// [`ChangelogError::Unavailable`]. (A read just fails.)
    LeaderChangeAfterApply,
}

/// A [`Changelog`] in memory: every subject's entries, one sequence counter for the
/// whole log (as a JetStream stream), and a queue of faults that the next calls meet
/// in turn. Never times out by itself.
#[derive(Debug, Default)]
pub struct MemoryChangelog {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    last_seq: u64,
    subjects: HashMap<String, Vec<Entry>>,
    faults: VecDeque<Fault>,
    appends_applied: u64,
    down: bool,
}

impl MemoryChangelog {
    /// An empty changelog with no fault queued.
    pub fn new() -> MemoryChangelog {
        MemoryChangelog::default()
    }

    /// Queues a fault for the next call (append or read) that has none queued
    /// before it.
    pub fn inject(&self, fault: Fault) {
        self.inner.lock().faults.push_back(fault);
    }

    /// An outage: while `down`, every call answers [`ChangelogError::Unavailable`]
    /// and applies nothing (queued faults wait for it to end).
    pub fn set_down(&self, down: bool) {
        self.inner.lock().down = down;
    }

    /// Faults queued and not met yet.
    pub fn faults_pending(&self) -> usize {
        self.inner.lock().faults.len()
    }

    /// Every entry of `subject`, in order (for checks; no fault applies).
    pub fn entries(&self, subject: &str) -> Vec<Entry> {
        self.inner
            .lock()
            .subjects
            .get(subject)
            .cloned()
            .unwrap_or_default()
    }

    /// Appends applied so far, whatever their callers were told.
    pub fn appends_applied(&self) -> u64 {
        self.inner.lock().appends_applied
    }

    /// Damages the message of the entry at `seq` by flipping one bit of byte `at`
    /// (for tests of damaged changelog messages); false if there is no such entry.
    pub fn flip_bit(&self, seq: u64, at: usize) -> bool {
        let mut inner = self.inner.lock();
        for entries in inner.subjects.values_mut() {
            if let Some(byte) = entries
                .iter_mut()
                .find(|e| e.seq == seq)
                .and_then(|entry| entry.message.get_mut(at))
            {
                *byte ^= 1;
                return true;
            }
        }
        false
    }
}

fn refused(fault: Fault) -> ChangelogError {
    match fault {
        Fault::Unavailable => ChangelogError::Unavailable("injected: no leader".into()),
        Fault::TimeoutBefore | Fault::LostAck => ChangelogError::Timeout,
        Fault::LeaderChangeAfterApply => {
            ChangelogError::Unavailable("injected: leader changed mid-call".into())
        }
    }
}

impl Changelog for MemoryChangelog {
    fn append(
        &self,
        subject: &str,
        expected_last: u64,
        message: &[u8],
    ) -> Result<u64, ChangelogError> {
        let mut inner = self.inner.lock();
        if inner.down {
            return Err(ChangelogError::Unavailable("injected: cluster down".into()));
        }
        let fault = inner.faults.pop_front();
        if let Some(fault @ (Fault::Unavailable | Fault::TimeoutBefore)) = fault {
            return Err(refused(fault));
        }
        let actual = inner
            .subjects
            .get(subject)
            .and_then(|entries| entries.last())
            .map_or(0, |entry| entry.seq);
        if actual != expected_last {
            return Err(ChangelogError::WrongLastSequence);
        }
        inner.last_seq += 1;
        inner.appends_applied += 1;
        let seq = inner.last_seq;
        inner
            .subjects
            .entry(subject.to_string())
            .or_default()
            .push(Entry {
                seq,
                message: message.to_vec(),
            });
        match fault {
            Some(fault) => Err(refused(fault)),
            None => Ok(seq),
        }
    }

    fn read(&self, subject: &str, after: u64, max: usize) -> Result<Vec<Entry>, ChangelogError> {
        let mut inner = self.inner.lock();
        if inner.down {
            return Err(ChangelogError::Unavailable("injected: cluster down".into()));
        }
        if let Some(fault) = inner.faults.pop_front() {
            return Err(refused(fault));
        }
        let entries = inner.subjects.get(subject).map_or(&[][..], Vec::as_slice);
        let start = entries.partition_point(|entry| entry.seq <= after);
        Ok(entries[start..].iter().take(max).cloned().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn appends_check_the_subjects_last_sequence_and_faults_apply_in_turn() {
        let log = MemoryChangelog::new();
        assert_eq!(log.append("a", 0, b"1"), Ok(1));
        assert_eq!(log.append("b", 0, b"x"), Ok(2));
        assert_eq!(
            log.append("a", 0, b"2"),
            Err(ChangelogError::WrongLastSequence)
        );
        log.inject(Fault::LostAck);
        assert_eq!(log.append("a", 1, b"2"), Err(ChangelogError::Timeout));
        assert_eq!(
            log.entries("a").last().unwrap().seq,
            3,
            "applied all the same"
        );
        log.inject(Fault::TimeoutBefore);
        assert_eq!(log.append("a", 3, b"3"), Err(ChangelogError::Timeout));
        assert_eq!(log.entries("a").len(), 2, "not applied");
        log.inject(Fault::Unavailable);
        assert!(log.read("a", 0, 10).is_err());
        let read = log.read("a", 1, 10).unwrap();
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].message, b"2");
        assert_eq!(log.appends_applied(), 3);
        assert_eq!(log.faults_pending(), 0);
    }
}
