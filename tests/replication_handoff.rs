//! Partitions moving between stores ("machines") over the in-process changelog, with
//! injected faults: the handoff protocol through the store's public API
//! (`docs/REPLICATION.md`). Every store is a real store in its own directory; only
//! the replicated engine is the in-process model (`MemoryChangelog`), so that faults
//! land exactly where the schedule puts them. The same API runs against a real NATS
//! JetStream cluster in `tests/nats_handoff.rs`.
//!
//! The property: in `Sync`, no order is answered `First` twice across all the stores,
//! whatever the schedule does — rebalances with and without revoke (zombies that keep
//! writing), lost acks and the duplicate message a retry then writes, timeouts, leader
//! changes mid-publish, a machine lost with its directory. In `Async`, none for
//! handoffs that went through `release_partition`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemstore::replication::{Changelog, Fault, MemoryChangelog};
use idemstore::{
    Begin, Durability, Error, Namespace, Outcome, Policy, Replication, ReplicationMode, Store,
};

const PREFIX: &str = "idemstore.orders";
const PARTITIONS: u32 = 6;

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(600))
}

fn replication(log: &Arc<MemoryChangelog>, mode: ReplicationMode) -> Replication {
    Replication::new(Arc::clone(log) as Arc<dyn Changelog>, PREFIX)
        .mode(mode)
        .timeout(Duration::from_secs(10))
}

/// One consumer machine: a store in its own directory.
struct Machine {
    dir: PathBuf,
    store: Option<Store>,
    orders: Option<Namespace>,
}

impl Machine {
    fn open(dir: PathBuf, replication: Replication) -> Machine {
        let store = Store::builder(&dir)
            .durability(Durability::None)
            .replication(replication)
            .open()
            .unwrap();
        let orders = store.namespace("orders", policy()).unwrap();
        Machine {
            dir,
            store: Some(store),
            orders: Some(orders),
        }
    }

    fn partition(&self, p: u32) -> Namespace {
        self.orders.as_ref().unwrap().partition(p).unwrap()
    }

    /// Restores `p`, retrying what an injected fault makes fail.
    fn restore(&self, p: u32) {
        let partition = self.partition(p);
        for _ in 0..20 {
            match partition.restore_partition() {
                Ok(_) => return,
                Err(Error::Replication { .. }) => continue,
                Err(e) => panic!("restore of partition {p}: {e}"),
            }
        }
        panic!("partition {p} not restored after 20 tries");
    }

    /// Closes the store cleanly (a deploy), keeping its directory.
    fn close(&mut self) {
        drop(self.orders.take());
        self.store.take().unwrap().close().unwrap();
    }

    /// Loses the machine: closes the store (as a crash would stop it) and deletes its
    /// whole directory.
    fn lose(&mut self) {
        drop(self.orders.take());
        drop(self.store.take());
        std::fs::remove_dir_all(&self.dir).unwrap();
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Default)]
struct Tally {
    /// Times each order was answered `First`, by any store.
    firsts: HashMap<u64, u32>,
    rebalances: u64,
    revoked: u64,
    zombie_writes: u64,
    zombie_refused: u64,
    faults: u64,
    machines_lost: u64,
    errors: u64,
}

impl std::fmt::Debug for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} orders, {} processed twice, {} rebalances ({} revoked), {} zombie writes ({} refused), {} faults, {} machines lost, {} errors",
            self.firsts.len(),
            self.processed_twice(),
            self.rebalances,
            self.revoked,
            self.zombie_writes,
            self.zombie_refused,
            self.faults,
            self.machines_lost,
            self.errors
        )
    }
}

impl Tally {
    fn processed_twice(&self) -> usize {
        self.firsts.values().filter(|&&n| n > 1).count()
    }
}

/// A random schedule of deliveries, redeliveries, rebalances (with revoke or not),
/// zombie writes, injected faults and (if `lose_machines`) machine losses.
fn run_schedule(
    seed: u64,
    mode: ReplicationMode,
    steps: usize,
    always_revoke: bool,
    lose_machines: bool,
) -> Tally {
    let root = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    let mut rng = Rng(seed);
    let mut generation = 0;
    let mut fresh_dir = |m: usize| {
        generation += 1;
        root.path().join(format!("machine-{m}-{generation}"))
    };
    let mut machines: Vec<Machine> = (0..3)
        .map(|m| Machine::open(fresh_dir(m), replication(&log, mode)))
        .collect();
    let mut owner: Vec<usize> = (0..PARTITIONS as usize).map(|p| p % 3).collect();
    // Stores that lost a partition without a revoke and may still write in it.
    let mut zombies: Vec<(usize, u32)> = Vec::new();
    for p in 0..PARTITIONS {
        machines[owner[p as usize]].restore(p);
    }
    let mut tally = Tally::default();
    let mut produced = 0u64;
    let mut offsets = [0u64; PARTITIONS as usize];
    let faults = [
        Fault::LostAck,
        Fault::TimeoutBefore,
        Fault::Unavailable,
        Fault::LeaderChangeAfterApply,
    ];
    for _ in 0..steps {
        let roll = rng.below(1000);
        if roll < 40 {
            // A rebalance: p moves to another machine.
            let p = rng.below(PARTITIONS as u64) as u32;
            let from = owner[p as usize];
            let to = (from + 1 + rng.below(2) as usize) % 3;
            if always_revoke || rng.below(2) == 0 {
                tally.revoked += 1;
                match machines[from].partition(p).release_partition() {
                    Ok(_) => {}
                    // A flush that met a fault past its retries, or a zombie's own
                    // fence: the partition is given up all the same.
                    Err(Error::Replication { .. } | Error::Fenced { .. }) => tally.errors += 1,
                    Err(e) => panic!("release: {e}"),
                }
            } else {
                zombies.push((from, p));
            }
            machines[to].restore(p);
            zombies.retain(|&(m, q)| !(m == to && q == p));
            owner[p as usize] = to;
            tally.rebalances += 1;
        } else if roll < 70 {
            log.inject(faults[rng.below(faults.len() as u64) as usize]);
            tally.faults += 1;
        } else if roll < 110 && !zombies.is_empty() {
            // A zombie processes a message of the partition it lost.
            let (m, p) = zombies[rng.below(zombies.len() as u64) as usize];
            let order = produced * PARTITIONS as u64 + p as u64;
            produced += 1;
            tally.zombie_writes += 1;
            match machines[m]
                .partition(p)
                .check_and_set_at(order.to_string(), 0)
            {
                Ok(Outcome::First) => *tally.firsts.entry(order).or_default() += 1,
                Ok(_) => {}
                Err(Error::Fenced { .. }) => tally.zombie_refused += 1,
                Err(Error::Replication { .. }) => tally.errors += 1,
                Err(e) => panic!("zombie write: {e}"),
            }
            // Async: the zombie learns of the fence when its records ship; the same
            // message is then redelivered to the partition's owner.
            let p_owner = owner[p as usize];
            if let Ok(Outcome::First) = machines[p_owner]
                .partition(p)
                .check_and_set_at(order.to_string(), 0)
            {
                *tally.firsts.entry(order).or_default() += 1;
            }
        } else if roll < 113 && lose_machines {
            // A machine lost with its whole directory; its partitions are assigned
            // to a fresh store in its place (a new machine).
            let m = rng.below(3) as usize;
            machines[m].lose();
            machines[m] = Machine::open(fresh_dir(m), replication(&log, mode));
            zombies.retain(|&(z, _)| z != m);
            for p in 0..PARTITIONS {
                if owner[p as usize] == m {
                    machines[m].restore(p);
                }
            }
            tally.machines_lost += 1;
        } else {
            // A delivery: a new order, or a redelivery of an earlier one.
            let order = if produced > 0 && rng.below(3) == 0 {
                rng.below(produced * PARTITIONS as u64)
            } else {
                produced += 1;
                produced * PARTITIONS as u64 + rng.below(PARTITIONS as u64)
            };
            let p = (order % PARTITIONS as u64) as u32;
            offsets[p as usize] += 1;
            let m = owner[p as usize];
            match machines[m]
                .partition(p)
                .check_and_set_at(order.to_string(), offsets[p as usize])
            {
                Ok(Outcome::First) => *tally.firsts.entry(order).or_default() += 1,
                Ok(_) => {}
                // Not acted on: the broker redelivers it later.
                Err(Error::Replication { .. }) => tally.errors += 1,
                Err(e) => panic!("delivery of {order} to machine {m}: {e}"),
            }
        }
    }
    tally
}

#[test]
fn sync_never_processes_an_order_twice_whatever_the_schedule() {
    for seed in 1..=4 {
        let tally = run_schedule(seed, ReplicationMode::Sync, 2500, false, true);
        assert_eq!(tally.processed_twice(), 0, "seed {seed}: {tally:?}");
        // The schedule did what it is for.
        assert!(tally.rebalances > 50, "{tally:?}");
        assert!(tally.zombie_writes > 10, "{tally:?}");
        assert_eq!(tally.zombie_refused, tally.zombie_writes, "{tally:?}");
        assert!(tally.machines_lost > 0, "{tally:?}");
        assert!(tally.firsts.len() > 1000, "{tally:?}");
    }
}

#[test]
fn async_never_processes_an_order_twice_across_revoked_handoffs() {
    for seed in 11..=14 {
        let tally = run_schedule(seed, ReplicationMode::Async, 2500, true, false);
        assert_eq!(tally.processed_twice(), 0, "seed {seed}: {tally:?}");
        assert!(tally.rebalances > 50, "{tally:?}");
        assert!(tally.firsts.len() > 1000, "{tally:?}");
    }
}

#[test]
fn negative_control_without_replication_handoffs_process_orders_twice() {
    // The same kind of handoff with stores that do not replicate: the new owner has
    // none of the old owner's marks, and every redelivered order is processed again.
    let root = tempfile::tempdir().unwrap();
    let a = Store::open(root.path().join("a")).unwrap();
    let b = Store::open(root.path().join("b")).unwrap();
    let pa = a
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    let pb = b
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    for n in 0..100 {
        assert!(pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    assert!(pa.release_partition().is_ok());
    pb.restore_partition().unwrap();
    let twice = marked_again(&pb, 0..100);
    assert_eq!(twice, 100);
}

/// How many of the orders `o{n}` for `n` in `orders` the handle marks as first: each
/// one is an order the new owner would process again.
fn marked_again(p: &Namespace, orders: impl Iterator<Item = u64>) -> usize {
    orders
        .filter(|n| p.check_and_set_at(format!("o{n}"), *n).unwrap().is_first())
        .count()
}

fn pair(mode: ReplicationMode) -> (tempfile::TempDir, Arc<MemoryChangelog>, Machine, Machine) {
    let root = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    let a = Machine::open(root.path().join("a"), replication(&log, mode));
    let b = Machine::open(root.path().join("b"), replication(&log, mode));
    (root, log, a, b)
}

#[test]
fn writes_before_restore_are_refused_not_owned() {
    let (_root, _log, a, _b) = pair(ReplicationMode::Async);
    let p = a.partition(2);
    assert!(matches!(
        p.check_and_set_at("o1", 1),
        Err(Error::NotOwned { partition: 2, .. })
    ));
    assert!(matches!(p.begin("o1"), Err(Error::NotOwned { .. })));
    // Namespaces used without a partition stay local and writable.
    assert!(
        a.orders
            .as_ref()
            .unwrap()
            .check_and_set("local")
            .unwrap()
            .is_first()
    );
    p.restore_partition().unwrap();
    assert!(p.check_and_set_at("o1", 1).unwrap().is_first());
    assert!(p.partition_info().unwrap().owned);
    assert_eq!(p.partition_info().unwrap().highest_offset, Some(1));
}

#[test]
fn a_fenced_zombie_gets_a_typed_error_and_refuses_writes() {
    for mode in [ReplicationMode::Sync, ReplicationMode::Async] {
        let (_root, _log, a, b) = pair(mode);
        let (pa, pb) = (a.partition(0), b.partition(0));
        pa.restore_partition().unwrap();
        assert!(pa.check_and_set_at("o1", 1).unwrap().is_first());
        pa.flush_partition().unwrap();
        // B takes the partition over without A's revoke.
        let report = pb.restore_partition().unwrap();
        assert_eq!(report.records, 1);
        assert!(!pb.check_and_set_at("o1", 1).unwrap().is_first());
        // A, the zombie, writes on.
        let zombie = pa.check_and_set_at("o2", 2);
        match mode {
            ReplicationMode::Sync => {
                assert!(
                    matches!(zombie, Err(Error::Fenced { partition: 0, .. })),
                    "{zombie:?}"
                )
            }
            // Async answers from the local store and learns of the fence when the
            // record ships: flush (before committing offsets) says so.
            ReplicationMode::Async => {
                assert!(zombie.unwrap().is_first());
                assert!(matches!(pa.flush_partition(), Err(Error::Fenced { .. })));
            }
        }
        // From then on every write in the partition is refused.
        assert!(matches!(
            pa.check_and_set_at("o3", 3),
            Err(Error::Fenced { .. })
        ));
        assert!(matches!(pa.begin_at("o4", 4), Err(Error::Fenced { .. })));
        assert_eq!(pa.partition_info().unwrap().fenced_by, Some(report.token));
        assert_eq!(a.store.as_ref().unwrap().stats().replication.fenced, 1);
        // B never sees the zombie's records; B's own go on.
        assert!(pb.check_and_set_at("o2", 2).unwrap().is_first());
        pb.flush_partition().unwrap();
        // A takes it back (a later rebalance): warm, from its own position.
        let back = pa.restore_partition().unwrap();
        assert!(back.from > 0 && back.records >= 1, "{back:?}");
        assert!(!pa.check_and_set_at("o2", 2).unwrap().is_first());
        let late = pb.check_and_set_at("o5", 5);
        match mode {
            ReplicationMode::Sync => assert!(matches!(late, Err(Error::Fenced { .. })), "{late:?}"),
            ReplicationMode::Async => {
                assert!(matches!(pb.flush_partition(), Err(Error::Fenced { .. })))
            }
        }
    }
}

/// An `Async` store on the in-process changelog with a byte budget, messages of
/// 4 KiB and a 300 ms timeout, owning partition 0.
fn budgeted(budget: usize) -> (tempfile::TempDir, Arc<MemoryChangelog>, Machine) {
    let root = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    let machine = Machine::open(
        root.path().join("a"),
        replication(&log, ReplicationMode::Async)
            .buffer_bytes(budget)
            .message_bytes(4096)
            .timeout(Duration::from_millis(300)),
    );
    machine.partition(0).restore_partition().unwrap();
    (root, log, machine)
}

#[test]
fn async_buffers_up_to_its_budget_then_pushes_back() {
    let budget = 64 << 10;
    let (root, log, machine) = budgeted(budget);
    let p = machine.partition(0);
    log.set_down(true);
    let mut accepted = 0;
    let refused = loop {
        match p.check_and_set_at(format!("order-{accepted}"), accepted) {
            Ok(outcome) => {
                assert!(outcome.is_first());
                accepted += 1;
                assert!(accepted < 10_000, "no pushback");
            }
            Err(e) => break e,
        }
    };
    let Error::ReplicationBacklog {
        queued_bytes,
        budget: b,
        partition: 0,
        ..
    } = refused
    else {
        panic!("{refused:?}")
    };
    assert_eq!(b, budget);
    assert!(
        queued_bytes <= budget && queued_bytes > budget - 200,
        "{queued_bytes}"
    );
    // The refused write wrote nothing.
    assert_eq!(p.get(format!("order-{accepted}")).unwrap(), None);
    let stats = machine.store.as_ref().unwrap().stats().replication;
    assert_eq!(stats.queued_records, accepted);
    // A flush while the cluster is down answers a typed error within the timeout.
    let started = Instant::now();
    let flushed = p.flush_partition();
    assert!(
        matches!(flushed, Err(Error::Replication { .. })),
        "{flushed:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "a flush hung");
    // The cluster comes back: the shipper catches up on its own, writes go on.
    log.set_down(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    while p.flush_partition().is_err() {
        assert!(Instant::now() < deadline, "never caught up");
    }
    assert_eq!(
        machine
            .store
            .as_ref()
            .unwrap()
            .stats()
            .replication
            .queued_records,
        0
    );
    assert!(p.check_and_set_at("after", accepted).unwrap().is_first());
    // `Async`: only what a flush returned for is sure to be in the cluster before
    // another owner takes the partition over.
    p.flush_partition().unwrap();
    // Every accepted mark reached the changelog, in order.
    let other = Machine::open(
        root.path().join("b"),
        replication(&log, ReplicationMode::Async),
    );
    let restored = other.partition(0).restore_partition().unwrap();
    assert_eq!(restored.records, accepted + 1);
}

#[test]
fn a_message_whose_ack_was_lost_still_counts_against_the_budget() {
    let budget = 16 << 10;
    let (_root, log, machine) = budgeted(budget);
    let p = machine.partition(0);
    // Ids of 200 bytes: a queued record is at least its deadline (8 bytes), its id
    // and the record's 32 bytes of header and checksum.
    let id = |n: u64| format!("{n:0>200}");
    let entry_min = 8 + 200 + 32;
    // The first message lands but its ack is lost, and then the cluster goes away
    // (well before the shipper's retry could settle it): the owner's message stays
    // pending, its outcome unknown, its records not stored as far as the store knows.
    // The calls after it fail too (the owner's read to settle the message among
    // them), until the outage below begins.
    log.inject(Fault::LostAck);
    for _ in 0..100 {
        log.inject(Fault::Unavailable);
    }
    let mut accepted = 0u64;
    let started = Instant::now();
    while log.faults_pending() > 100 {
        match p.check_and_set_at(id(accepted), accepted) {
            Ok(outcome) => {
                assert!(outcome.is_first());
                accepted += 1;
            }
            // The budget filled before the shipper's first round: it comes.
            Err(Error::ReplicationBacklog { .. }) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("{e:?}"),
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the fault was never met"
        );
    }
    log.set_down(true);
    let refused = loop {
        match p.check_and_set_at(id(accepted), accepted) {
            Ok(outcome) => {
                assert!(outcome.is_first());
                accepted += 1;
                assert!(accepted < 10_000, "no pushback");
            }
            Err(e) => break e,
        }
    };
    assert!(
        matches!(refused, Error::ReplicationBacklog { .. }),
        "{refused:?}"
    );
    let stats = machine.store.as_ref().unwrap().stats().replication;
    assert_eq!(
        stats.queued_records, accepted,
        "the pending message's records"
    );
    assert!(
        stats.queued_bytes <= budget as u64,
        "{}",
        stats.queued_bytes
    );
    // The budget bounds every record not known stored, the pending message's too.
    assert!(
        accepted as usize * entry_min <= budget,
        "{accepted} records of at least {entry_min} bytes buffered under a budget of {budget}"
    );
}

#[test]
fn sync_calls_time_out_with_a_typed_error_and_answer_once_the_cluster_is_back() {
    let root = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    let machine = Machine::open(
        root.path().join("a"),
        replication(&log, ReplicationMode::Sync).timeout(Duration::from_millis(200)),
    );
    let p = machine.partition(1);
    p.restore_partition().unwrap();
    log.set_down(true);
    let started = Instant::now();
    let answer = p.check_and_set_at("o1", 1);
    let Err(Error::Replication {
        reason,
        partition: 1,
        ..
    }) = &answer
    else {
        panic!("{answer:?}")
    };
    assert!(reason.contains("cluster down"), "{reason}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "a Sync call hung"
    );
    // A claim's begin fails the same way, and its claim is released.
    assert!(matches!(
        p.begin_at("o2", 2),
        Err(Error::Replication { .. })
    ));
    log.set_down(false);
    // Retried: the mark is already local, and the answer waits until the cluster has it.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match p.check_and_set_at("o1", 1) {
            Ok(outcome) => {
                assert!(!outcome.is_first());
                break;
            }
            Err(Error::Replication { .. }) => assert!(Instant::now() < deadline),
            Err(e) => panic!("{e}"),
        }
    }
    p.flush_partition().unwrap();
    let Begin::Acquired(claim) = p.begin_at("o2", 2).unwrap() else {
        panic!("o2 was released when its begin failed")
    };
    claim.complete(Some(b"done")).unwrap();
}

#[test]
fn a_damaged_changelog_message_is_skipped_and_counted_or_refused_in_strict_mode() {
    let (root, log, a, b) = pair(ReplicationMode::Async);
    let pa = a.partition(0);
    pa.restore_partition().unwrap();
    for n in 0..10 {
        assert!(pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
        pa.flush_partition().unwrap();
    }
    pa.release_partition().unwrap();
    let subject = format!("{PREFIX}.orders.0");
    let entries = log.entries(&subject);
    // Message 1 is A's owner message; damage the third records message.
    let damaged_seq = entries[3].seq;
    assert!(log.flip_bit(damaged_seq, 40));
    // Strict: a typed Corruption naming the stream sequence; the partition stays
    // unowned.
    let strict = Store::builder(root.path().join("strict"))
        .strict(true)
        .replication(replication(&log, ReplicationMode::Async))
        .open()
        .unwrap();
    let ps = strict
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    let refused = ps.restore_partition();
    let Err(Error::Corruption(c)) = &refused else {
        panic!("{refused:?}")
    };
    assert_eq!(c.offset(), damaged_seq);
    assert!(
        c.reason()
            .contains(&format!("stream sequence {damaged_seq}")),
        "{c:?}"
    );
    assert!(matches!(
        ps.check_and_set_at("x", 1),
        Err(Error::NotOwned { .. })
    ));
    // Default: skipped and counted, the rest restored.
    let pb = b.partition(0);
    let report = pb.restore_partition().unwrap();
    assert_eq!(report.damaged.len(), 1);
    assert_eq!(report.damaged[0].0, damaged_seq);
    assert_eq!(report.records, 9);
    assert_eq!(
        b.store
            .as_ref()
            .unwrap()
            .stats()
            .replication
            .damaged_messages,
        1
    );
}

#[test]
fn restores_are_warm_from_the_position_kept_across_a_restart() {
    let (root, log, mut a, b) = pair(ReplicationMode::Async);
    let pa = a.partition(4);
    pa.restore_partition().unwrap();
    for n in 0..500 {
        assert!(pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    let released = pa.release_partition().unwrap();
    assert!(released.flushed <= 500, "{released:?}");
    assert_eq!(pa.partition_info().unwrap().queued_records, 0);
    let pb = b.partition(4);
    let cold = pb.restore_partition().unwrap();
    assert_eq!((cold.from, cold.records), (0, 500));
    assert_eq!(pb.partition_info().unwrap().highest_offset, Some(499));
    for n in 500..510 {
        assert!(pb.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    pb.release_partition().unwrap();
    // A restarts (a deploy), keeping its directory, and gets the partition back: it
    // reads only what B wrote.
    drop(pa);
    a.close();
    let a = Machine::open(a.dir.clone(), replication(&log, ReplicationMode::Async));
    let pa = a.partition(4);
    assert_eq!(pa.partition_info().unwrap().highest_offset, Some(499));
    let warm = pa.restore_partition().unwrap();
    assert_eq!(warm.from, released.position);
    assert_eq!(warm.records, 10, "{warm:?}");
    assert_eq!(pa.partition_info().unwrap().highest_offset, Some(509));
    for n in 0..510 {
        assert!(!pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    // Machine loss: a fresh directory restores everything, cold.
    let c = Machine::open(
        root.path().join("c"),
        replication(&log, ReplicationMode::Async),
    );
    let pc = c.partition(4);
    let lost = pc.restore_partition().unwrap();
    assert_eq!((lost.from, lost.records), (0, 510));
    assert!(matches!(
        pa.check_and_set_at("late", 1),
        Ok(_) | Err(Error::Fenced { .. })
    ));
}

#[test]
fn claims_in_progress_move_with_their_lease_or_at_once_when_released() {
    let (_root, _log, a, b) = pair(ReplicationMode::Sync);
    let (pa, pb) = (a.partition(0), b.partition(0));
    pa.restore_partition().unwrap();
    let Begin::Acquired(held) = pa.begin_at("held", 1).unwrap() else {
        panic!()
    };
    let Begin::Acquired(given_back) = pa.begin_at("given-back", 2).unwrap() else {
        panic!()
    };
    let Begin::Acquired(done) = pa.begin_at("done", 3).unwrap() else {
        panic!()
    };
    done.complete(Some(b"receipt")).unwrap();
    // The revoke callback gives back the claim it will not finish.
    given_back.release().unwrap();
    pa.release_partition().unwrap();
    pb.restore_partition().unwrap();
    // Held by A's live lease: the new owner waits for it to run out.
    let Begin::InProgress(record) = pb.begin_at("held", 1).unwrap() else {
        panic!("a live lease must be honored by the new owner")
    };
    assert_eq!((record.partition, record.offset), (Some(0), Some(1)));
    assert!(record.lease_until.is_some());
    let Begin::Acquired(again) = pb.begin_at("given-back", 2).unwrap() else {
        panic!("a released claim is acquirable at once")
    };
    assert_eq!(again.attempt(), 2);
    let Begin::Completed(record) = pb.begin_at("done", 3).unwrap() else {
        panic!()
    };
    assert_eq!(record.result(), Some(&b"receipt"[..]));
    // A's claim can no longer be resolved: A does not own the partition.
    assert!(matches!(held.complete(None), Err(Error::NotOwned { .. })));
    drop(again);
}

#[test]
fn misconfiguration_is_a_clear_error_that_changes_nothing() {
    let root = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    for (bad, why) in [
        (
            Replication::new(Arc::clone(&log) as Arc<dyn Changelog>, "bad prefix"),
            "subject prefix",
        ),
        (
            Replication::new(Arc::clone(&log) as Arc<dyn Changelog>, "a..b"),
            "subject prefix",
        ),
        (
            replication(&log, ReplicationMode::Async).timeout(Duration::ZERO),
            "timeout",
        ),
        (
            replication(&log, ReplicationMode::Async).buffer_bytes(1),
            "buffer_bytes",
        ),
    ] {
        let dir = root.path().join("store");
        let opened = Store::builder(&dir).replication(bad).open();
        let Err(Error::InvalidOption { reason }) = &opened else {
            panic!("{opened:?}")
        };
        assert!(reason.contains(why), "{reason}");
        assert!(!dir.exists(), "a refused open created {}", dir.display());
    }
    let read_only = Store::builder(root.path())
        .read_only(true)
        .replication(replication(&log, ReplicationMode::Async))
        .open();
    assert!(matches!(read_only, Err(Error::InvalidOption { .. })));
    assert_eq!(log.appends_applied(), 0);
}

#[test]
fn sync_callers_share_round_trips() {
    let root = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    let machine = Arc::new(Machine::open(
        root.path().join("a"),
        replication(&log, ReplicationMode::Sync),
    ));
    let p = machine.partition(0);
    p.restore_partition().unwrap();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let p = p.clone();
            std::thread::spawn(move || {
                for n in 0..500u64 {
                    assert!(
                        p.check_and_set_at(format!("{t}-{n}"), n)
                            .unwrap()
                            .is_first()
                    );
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = machine.store.as_ref().unwrap().stats().replication;
    assert_eq!(stats.shipped_records, 4000);
    // Every record in a message of its own would be 4000 messages.
    assert!(stats.shipped_messages < 4000, "{stats:?}");
}

#[test]
fn records_a_store_could_not_ship_go_again_at_its_next_restore() {
    let (_root, log, mut a, b) = pair(ReplicationMode::Async);
    let pa = a.partition(2);
    pa.restore_partition().unwrap();
    // Another partition of the same store, shipped: not part of the re-ship.
    let other = a.partition(3);
    other.restore_partition().unwrap();
    for n in 0..50 {
        assert!(
            other
                .check_and_set_at(format!("x{n}"), n)
                .unwrap()
                .is_first()
        );
    }
    other.flush_partition().unwrap();
    // The cluster is down: the marks are answered (Async) and stay queued.
    log.set_down(true);
    for n in 0..300 {
        assert!(pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    assert_eq!(pa.partition_info().unwrap().queued_records, 300);
    // The store closes (a deploy) with its records unshipped; the cluster comes back.
    drop((pa, other));
    a.close();
    log.set_down(false);
    let a = Machine::open(a.dir.clone(), replication(&log, ReplicationMode::Async));
    let pa = a.partition(2);
    let restored = pa.restore_partition().unwrap();
    assert_eq!(restored.reshipped, 300, "{restored:?}");
    assert_eq!(
        a.store
            .as_ref()
            .unwrap()
            .stats()
            .replication
            .reshipped_records,
        300
    );
    pa.release_partition().unwrap();
    // The next owner has every mark: none is processed twice.
    let pb = b.partition(2);
    pb.restore_partition().unwrap();
    let twice = marked_again(&pb, 0..300);
    assert_eq!(twice, 0);
    pb.release_partition().unwrap();
    // A clean release leaves nothing to ship again.
    let again = pa.restore_partition().unwrap();
    assert_eq!(again.reshipped, 0, "{again:?}");
}

#[test]
fn a_damaged_partitions_file_still_ships_what_the_store_could_not() {
    let (_root, log, mut a, b) = pair(ReplicationMode::Async);
    let pa = a.partition(4);
    pa.restore_partition().unwrap();
    log.set_down(true);
    for n in 0..120 {
        assert!(pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    drop(pa);
    a.close();
    log.set_down(false);
    // The file that says partition 4 is due a re-ship is damaged while the store is
    // closed (a bad sector): the open ignores it, and must not forget the re-ship.
    let partitions = a.dir.join("PARTITIONS");
    let mut bytes = std::fs::read(&partitions).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&partitions, &bytes).unwrap();
    let a = Machine::open(a.dir.clone(), replication(&log, ReplicationMode::Async));
    let pa = a.partition(4);
    let restored = pa.restore_partition().unwrap();
    assert_eq!(
        restored.from, 0,
        "the positions went with the file: a cold restore"
    );
    assert_eq!(restored.reshipped, 120, "{restored:?}");
    pa.release_partition().unwrap();
    let pb = b.partition(4);
    pb.restore_partition().unwrap();
    let twice = marked_again(&pb, 0..120);
    assert_eq!(twice, 0);
}

#[test]
fn a_store_replicated_under_one_prefix_is_refused_under_another_and_nothing_changes() {
    let (_root, log, mut a, _b) = pair(ReplicationMode::Sync);
    let pa = a.partition(1);
    pa.restore_partition().unwrap();
    for n in 0..20 {
        assert!(pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
    }
    drop(pa);
    a.close();
    let partitions = a.dir.join("PARTITIONS");
    let before = std::fs::read(&partitions).unwrap();
    let appends = log.appends_applied();
    // Opened as a member of another group: its positions are not of that group's
    // subjects (a warm restore from them would skip their start).
    let other = Replication::new(Arc::clone(&log) as Arc<dyn Changelog>, "idemstore.payments");
    let opened = Store::builder(&a.dir).replication(other).open();
    let Err(Error::InvalidOption { reason }) = &opened else {
        panic!("{opened:?}")
    };
    assert!(
        reason.contains("idemstore.payments") && reason.contains(PREFIX),
        "{reason}"
    );
    assert_eq!(std::fs::read(&partitions).unwrap(), before);
    assert_eq!(log.appends_applied(), appends);
    // Under its own prefix it opens, warm, with every mark.
    let a = Machine::open(a.dir.clone(), replication(&log, ReplicationMode::Sync));
    let pa = a.partition(1);
    let warm = pa.restore_partition().unwrap();
    assert!(warm.from > 0, "{warm:?}");
    assert!((0..20).all(|n| !pa.check_and_set_at(format!("o{n}"), n).unwrap().is_first()));
}

#[test]
fn marks_written_while_opened_without_replication_ship_at_the_next_replicated_restore() {
    let (_root, log, mut a, b) = pair(ReplicationMode::Async);
    let pa = a.partition(5);
    pa.restore_partition().unwrap();
    assert!(pa.check_and_set_at("o-shipped", 0).unwrap().is_first());
    pa.release_partition().unwrap();
    drop(pa);
    a.close();
    // A run without replication (an operator's mistake, or replication turned on
    // later): its marks reach no changelog.
    {
        let store = Store::builder(&a.dir)
            .durability(Durability::None)
            .open()
            .unwrap();
        let p5 = store
            .namespace("orders", policy())
            .unwrap()
            .partition(5)
            .unwrap();
        for n in 1..=40 {
            assert!(p5.check_and_set_at(format!("o{n}"), n).unwrap().is_first());
        }
        store.close().unwrap();
    }
    let a = Machine::open(a.dir.clone(), replication(&log, ReplicationMode::Async));
    let pa = a.partition(5);
    let restored = pa.restore_partition().unwrap();
    assert!(restored.reshipped >= 40, "{restored:?}");
    pa.release_partition().unwrap();
    let pb = b.partition(5);
    pb.restore_partition().unwrap();
    let twice = marked_again(&pb, 1..=40);
    assert_eq!(twice, 0);
}

#[test]
fn the_highest_offset_survives_a_crash() {
    use idemstore::testing::{self, SimVfs};
    let dir = std::path::Path::new("/sim/store");
    let open = |vfs: &SimVfs| {
        let store = testing::open(Store::builder(dir), vfs).unwrap();
        let p = store
            .namespace("orders", policy())
            .unwrap()
            .partition(3)
            .unwrap();
        (store, p)
    };
    let mark = |p: &Namespace, offsets: std::ops::Range<u64>| {
        for n in offsets {
            assert!(p.check_and_set_at(format!("a{n}"), n).unwrap().is_first());
        }
    };
    let vfs = SimVfs::new();
    let (store, p) = open(&vfs);
    mark(&p, 0..10);
    drop(p);
    store.close().unwrap();
    // PARTITIONS now says 9; the next run marks up to 49 and is killed before any
    // restore, release or close writes the file again.
    let (store, p) = open(&vfs);
    mark(&p, 10..50);
    store.flush().unwrap();
    let image = vfs.crash_now().process_kill();
    drop((p, store));
    let (store, p) = open(&image);
    assert!(store.stats().records_replayed >= 50);
    assert_eq!(p.partition_info().unwrap().highest_offset, Some(49));
}
