//! The fencing protocol of a replicated partition (`idemstore::replication`,
//! `PartitionOwner`) against the in-process changelog with injected faults: lost
//! acks, timeouts before and after the log applied an append, leader changes
//! mid-publish, and zombies that keep writing after another writer took the
//! partition over. Random schedules of three writers on one partition; after every
//! step the log and the writers' answers are checked against what the protocol
//! promises:
//!
//! - a message that landed lands once: no (owner, batch) twice in the log;
//! - an owner's messages land in its order, batches 1, 2, 3, … with no gap;
//! - once an owner message is in the log, no earlier owner's message follows it;
//! - an append answered `Ok(seq)` is in the log at `seq`, as written;
//! - a take-over handed its caller every entry between its starting position and its
//!   owner message, in order;
//! - fenced is final;
//! - a key is processed at most once, counting only work whose append was answered
//!   `Ok` (the `Sync` mode's rule: act once the cluster has the record), by writers
//!   that skip keys they know from their own appends and their restores.

use std::collections::{BTreeMap, HashMap, HashSet};

use idemstore::fuzzing;
use idemstore::replication::{
    Changelog, Fault, MemoryChangelog, PartitionOwner, ReplicationError, Shipped,
};
use proptest::prelude::*;

const SUBJECT: &str = "idem.test.inventory.7";
const NAMESPACE: &str = "inventory";
const PARTITION: u32 = 7;
/// The bucket deadline the shipped records carry.
const DEADLINE: u64 = 1_700_000_600_000;
const WRITERS: usize = 3;
const KEYS: u8 = 12;

#[derive(Debug, Clone)]
enum Step {
    /// Writer `w` processes key `k`: unless it knows the key, it appends its record.
    Process(usize, u8),
    /// Writer `w` takes the partition over (warm: from the position it has).
    TakeOver(usize),
    /// The next changelog call meets this fault.
    Inject(Fault),
    /// Writer `w` resolves a message left pending.
    Settle(usize),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..WRITERS, 0..KEYS).prop_map(|(w, k)| Step::Process(w, k)),
        1 => (0..WRITERS).prop_map(Step::TakeOver),
        3 => prop_oneof![
            Just(Fault::LostAck),
            Just(Fault::TimeoutBefore),
            Just(Fault::Unavailable),
            Just(Fault::LeaderChangeAfterApply),
        ]
        .prop_map(Step::Inject),
        1 => (0..WRITERS).prop_map(Step::Settle),
    ]
}

/// One consumer process: its owner of the partition, if it has taken it over, and
/// the keys it knows are done (restored, or appended with `Ok`).
#[derive(Default)]
struct Writer {
    owner: Option<PartitionOwner>,
    known: HashSet<u8>,
    /// The changelog position its local store has (a warm standby keeps it).
    position: u64,
    fenced: bool,
}

struct World {
    log: MemoryChangelog,
    writers: Vec<Writer>,
    /// What each (owner token, batch) the test wrote carries: the key.
    keys: HashMap<(u64, u64), u8>,
    /// Answers `Ok(seq)` given: seq → (token, batch).
    acked: BTreeMap<u64, (u64, u64)>,
    /// Processed, counting only work whose append was answered `Ok`.
    processed: HashMap<u8, u32>,
}

fn decode(entry_message: &[u8]) -> (u64, u64) {
    let m = fuzzing::decode_changelog_message(entry_message)
        .unwrap_or_else(|e| panic!("a message in the log does not decode: {e}"));
    (m.owner, m.batch)
}

impl World {
    fn new() -> World {
        World {
            log: MemoryChangelog::new(),
            writers: (0..WRITERS).map(|_| Writer::default()).collect(),
            keys: HashMap::new(),
            acked: BTreeMap::new(),
            processed: HashMap::new(),
        }
    }

    fn run(&mut self, step: &Step) {
        match *step {
            Step::Inject(fault) => self.log.inject(fault),
            Step::TakeOver(w) => self.take_over(w),
            Step::Settle(w) => {
                let log = &self.log;
                let writer = &mut self.writers[w];
                if let Some(owner) = writer.owner.as_mut() {
                    match owner.settle_pending(log) {
                        Ok(Some(seq)) => {
                            // A message whose earlier call failed has landed: the work
                            // was not acted on then; it is known now.
                            let entries = log.entries(SUBJECT);
                            let entry = entries.iter().find(|e| e.seq == seq).unwrap();
                            let key = self.keys[&decode(&entry.message)];
                            writer.known.insert(key);
                            writer.position = seq;
                        }
                        Ok(None) => {}
                        Err(ReplicationError::Fenced { .. }) => writer.fenced = true,
                        Err(ReplicationError::Changelog(_)) => {}
                    }
                }
            }
            Step::Process(w, key) => self.process(w, key),
        }
    }

    fn take_over(&mut self, w: usize) {
        let from = self.writers[w].position;
        let token = PartitionOwner::new_token();
        let mut seen = Vec::new();
        let restored = PartitionOwner::take_over(
            &self.log,
            SUBJECT,
            NAMESPACE,
            PARTITION,
            token,
            from,
            &mut |shipped: Shipped<'_>| {
                seen.push((shipped.seq, shipped.owner, shipped.batch, shipped.is_owner))
            },
        );
        let Ok(restored) = restored else {
            return; // unreachable log: the assignment fails; try again later
        };
        assert!(restored.damaged.is_empty());
        let fence_seq = restored.owner.last_seq();
        // Every entry between `from` and the owner message, in order, was handed over.
        let expected: Vec<(u64, u64, u64)> = self
            .log
            .entries(SUBJECT)
            .iter()
            .filter(|e| e.seq > from && e.seq < fence_seq)
            .map(|e| {
                let (owner, batch) = decode(&e.message);
                (e.seq, owner, batch)
            })
            .collect();
        let got: Vec<(u64, u64, u64)> = seen.iter().map(|&(s, o, b, _)| (s, o, b)).collect();
        assert_eq!(got, expected, "the take-over did not hand over every entry");
        let fence = self.log.entries(SUBJECT);
        let fence = fence
            .iter()
            .find(|e| e.seq == fence_seq)
            .expect("the owner message");
        assert_eq!(decode(&fence.message), (token, 1));
        let writer = &mut self.writers[w];
        for &(_, owner, batch, is_owner) in &seen {
            if !is_owner {
                writer.known.insert(self.keys[&(owner, batch)]);
            }
        }
        writer.owner = Some(restored.owner);
        writer.position = fence_seq;
        writer.fenced = false;
    }

    fn process(&mut self, w: usize, key: u8) {
        let writer = &mut self.writers[w];
        let Some(owner) = writer.owner.as_mut() else {
            return; // not assigned
        };
        if writer.known.contains(&key) {
            return; // a duplicate: skipped
        }
        let id = format!("key-{key}");
        let record = fuzzing::encode_scoped_mark(
            PARTITION,
            Some(u64::from(key)),
            u64::from(key),
            1_700_000_000_000,
            id.as_bytes(),
        );
        let token = owner.token();
        // The key of the message this call writes, whatever the answer: a take-over
        // may restore a message whose append was not answered `Ok`.
        self.keys.insert((token, owner.next_batch()), key);
        let answer = owner.append(&self.log, &[(DEADLINE, &record)]);
        if writer.fenced {
            assert!(
                matches!(answer, Err(ReplicationError::Fenced { .. })),
                "fenced is final: {answer:?}"
            );
        }
        match answer {
            Ok(seq) => {
                let entries = self.log.entries(SUBJECT);
                let entry = entries
                    .iter()
                    .find(|e| e.seq == seq)
                    .expect("acked entry in the log");
                let (owner_token, batch) = decode(&entry.message);
                assert_eq!(owner_token, token);
                assert_eq!(self.keys[&(owner_token, batch)], key);
                assert!(self.acked.insert(seq, (owner_token, batch)).is_none());
                writer.known.insert(key);
                writer.position = seq;
                *self.processed.entry(key).or_default() += 1;
            }
            Err(ReplicationError::Fenced { .. }) => writer.fenced = true,
            Err(ReplicationError::Changelog(_)) => {}
        }
    }

    fn check(&self) {
        let entries = self.log.entries(SUBJECT);
        let mut seen = HashSet::new();
        let mut next_batch: HashMap<u64, u64> = HashMap::new();
        let mut retired: HashSet<u64> = HashSet::new();
        let mut current: Option<u64> = None;
        for entry in &entries {
            let (owner, batch) = decode(&entry.message);
            assert!(
                seen.insert((owner, batch)),
                "({owner:#x}, {batch}) landed twice"
            );
            let expected = next_batch.entry(owner).or_insert(1);
            assert_eq!(batch, *expected, "owner {owner:#x}'s batches out of order");
            *expected += 1;
            assert!(
                !retired.contains(&owner),
                "a fenced owner's message landed after the fence"
            );
            if current != Some(owner) {
                if let Some(previous) = current {
                    retired.insert(previous);
                }
                current = Some(owner);
            }
        }
        for (&seq, &(owner, batch)) in &self.acked {
            let entry = entries
                .iter()
                .find(|e| e.seq == seq)
                .expect("an acked seq is in the log");
            assert_eq!(decode(&entry.message), (owner, batch));
        }
        for (key, &count) in &self.processed {
            assert!(count <= 1, "key {key} processed {count} times");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn random_handoffs_with_faults_keep_the_protocol(steps in prop::collection::vec(step(), 1..120)) {
        let mut world = World::new();
        for step in &steps {
            world.run(step);
            world.check();
        }
    }
}

/// The owner of a fresh take-over of the test's partition, from the start.
fn fresh_owner(log: &MemoryChangelog, token: u64) -> PartitionOwner {
    PartitionOwner::take_over(log, SUBJECT, NAMESPACE, PARTITION, token, 0, &mut |_| {})
        .unwrap()
        .owner
}

#[test]
fn a_zombie_is_fenced_and_stays_fenced() {
    let log = MemoryChangelog::new();
    let record = fuzzing::encode_scoped_mark(PARTITION, None, 1, 1, b"order-1");
    let mut old = fresh_owner(&log, 11);
    let first = old.append(&log, &[(DEADLINE, &record)]).unwrap();
    let mut restored = Vec::new();
    let new = PartitionOwner::take_over(&log, SUBJECT, NAMESPACE, PARTITION, 22, 0, &mut |s| {
        restored.push((s.seq, s.owner, s.batch))
    })
    .unwrap();
    assert_eq!(restored, [(1, 11, 1), (first, 11, 2)]);
    assert_eq!(new.messages, 2);
    let zombie = old.append(&log, &[(DEADLINE, &record)]);
    assert_eq!(
        zombie,
        Err(ReplicationError::Fenced {
            subject: SUBJECT.into(),
            by: 22
        })
    );
    assert!(old.is_fenced());
    assert_eq!(log.appends_applied(), 3, "the zombie's append never landed");
    // Final: not even an attempt any more.
    assert!(old.append(&log, &[(DEADLINE, &record)]).is_err());
    assert_eq!(log.appends_applied(), 3);
}

#[test]
fn a_lost_ack_is_resolved_as_landed_without_a_second_copy() {
    let log = MemoryChangelog::new();
    let record = fuzzing::encode_scoped_mark(PARTITION, None, 1, 1, b"order-1");
    let mut owner = fresh_owner(&log, 5);
    log.inject(Fault::LostAck);
    let seq = owner.append(&log, &[(DEADLINE, &record)]).unwrap();
    assert_eq!(log.entries(SUBJECT).len(), 2);
    assert_eq!(log.entries(SUBJECT)[1].seq, seq);
    log.inject(Fault::LeaderChangeAfterApply);
    let seq = owner.append(&log, &[(DEADLINE, &record)]).unwrap();
    assert_eq!(log.entries(SUBJECT).len(), 3);
    assert_eq!(owner.last_seq(), seq);
}

#[test]
fn an_unreachable_log_leaves_the_message_pending_and_the_next_call_sends_it_first() {
    let log = MemoryChangelog::new();
    let (a, b) = (
        fuzzing::encode_scoped_mark(PARTITION, None, 1, 1, b"order-1"),
        fuzzing::encode_scoped_mark(PARTITION, None, 2, 1, b"order-2"),
    );
    let mut owner = fresh_owner(&log, 5);
    // The send and the look at the entry after it both fail: outcome unknown.
    log.inject(Fault::TimeoutBefore);
    log.inject(Fault::Unavailable);
    assert!(matches!(
        owner.append(&log, &[(DEADLINE, &a)]),
        Err(ReplicationError::Changelog(_))
    ));
    assert!(owner.has_pending());
    let seq_b = owner.append(&log, &[(DEADLINE, &b)]).unwrap();
    let batches: Vec<u64> = log
        .entries(SUBJECT)
        .iter()
        .map(|e| decode(&e.message).1)
        .collect();
    assert_eq!(batches, [1, 2, 3], "a's message first, then b's, once each");
    assert_eq!(log.entries(SUBJECT)[2].seq, seq_b);
}

#[test]
fn a_damaged_message_is_skipped_and_counted_with_its_sequence() {
    let log = MemoryChangelog::new();
    let record = fuzzing::encode_scoped_mark(PARTITION, None, 1, 1, b"order-1");
    let mut owner = fresh_owner(&log, 5);
    let seq = owner.append(&log, &[(DEADLINE, &record)]).unwrap();
    assert!(log.flip_bit(seq, 40));
    let mut handed = 0;
    let restored =
        PartitionOwner::take_over(&log, SUBJECT, NAMESPACE, PARTITION, 6, 0, &mut |_| {
            handed += 1
        })
        .unwrap();
    assert_eq!(handed, 1, "the owner message only");
    assert_eq!(restored.messages, 2);
    assert_eq!(restored.damaged.len(), 1);
    assert_eq!(restored.damaged[0].0, seq);
}

#[test]
fn a_warm_take_over_reads_only_what_it_does_not_have() {
    let log = MemoryChangelog::new();
    let record = fuzzing::encode_scoped_mark(PARTITION, None, 1, 1, b"order-1");
    let mut first = fresh_owner(&log, 5);
    for _ in 0..10 {
        first.append(&log, &[(DEADLINE, &record)]).unwrap();
    }
    let have = log.entries(SUBJECT)[7].seq;
    let mut handed = Vec::new();
    PartitionOwner::take_over(&log, SUBJECT, NAMESPACE, PARTITION, 6, have, &mut |s| {
        handed.push(s.seq)
    })
    .unwrap();
    let expected: Vec<u64> = log.entries(SUBJECT)[8..11].iter().map(|e| e.seq).collect();
    assert_eq!(handed, expected);
    // The changelog trait is object safe: a store holds `dyn Changelog`.
    let _: &dyn Changelog = &log;
}

#[test]
fn a_take_over_skips_a_second_copy_and_a_retired_owners_late_message() {
    // What a replicated log may land late (JetStream 2.9 across a leader change):
    // written here straight to the log, past the protocol.
    let log = MemoryChangelog::new();
    let mut a = fresh_owner(&log, 0xa);
    let record = fuzzing::encode_scoped_mark(PARTITION, None, 1, 1, b"order-1");
    let landed = a.append(&log, &[(DEADLINE, &record)]).unwrap();
    let copy = fuzzing::encode_changelog_message(
        NAMESPACE,
        PARTITION,
        0xa,
        2,
        &[(DEADLINE, record.clone())],
    );
    let copy_seq = log.append(SUBJECT, landed, &copy).unwrap();
    let b = fresh_owner(&log, 0xb);
    let late = fuzzing::encode_changelog_message(
        NAMESPACE,
        PARTITION,
        0xa,
        3,
        &[(DEADLINE, record.clone())],
    );
    log.append(SUBJECT, b.last_seq(), &late).unwrap();
    let mut handed = Vec::new();
    let restored =
        PartitionOwner::take_over(&log, SUBJECT, NAMESPACE, PARTITION, 0xc, 0, &mut |s| {
            handed.push((s.owner, s.batch))
        })
        .unwrap();
    assert_eq!(handed, [(0xa, 1), (0xa, 2), (0xb, 1)]);
    assert_eq!(
        restored.stale, 2,
        "the copy at {copy_seq} and A's batch 3 after B's owner message"
    );
    assert_eq!(restored.messages, 5);
}
