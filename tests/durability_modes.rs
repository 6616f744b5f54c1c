//! Guards the durability modes of docs/CONTRACT.md §3.1 as far as a test without power
//! loss can: in `Immediate` mode every acknowledged mark and claim is there after
//! flush, close and reopen, and concurrent callers share fsyncs (group commit: fewer
//! sync rounds than operations, counted by `stats()`); in `Interval` mode with an
//! interval too long to fire during the test, `close` (and `flush`) still sync, so
//! everything is there after reopen. Each test writes marks and claims, reopens the
//! directory and checks every answer and stored result.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use idemstore::{Begin, Durability, Policy, Status, Store};

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

/// Writes `n` marks and `n / 10` completed claims; returns nothing, checks answers.
fn write(store: &Store, n: usize) {
    let marks = store.namespace("marks", policy()).unwrap();
    let claims = store.namespace("claims", policy()).unwrap();
    for i in 0..n {
        assert!(marks.check_and_set(format!("m{i}")).unwrap().is_first());
    }
    for i in 0..n / 10 {
        let Begin::Acquired(claim) = claims.begin(format!("c{i}")).unwrap() else {
            panic!("c{i} must be acquired");
        };
        claim.complete(Some(format!("r{i}").as_bytes())).unwrap();
    }
}

fn check(store: &Store, n: usize) {
    let marks = store.namespace("marks", policy()).unwrap();
    let claims = store.namespace("claims", policy()).unwrap();
    for i in 0..n {
        assert!(
            !marks.check_and_set(format!("m{i}")).unwrap().is_first(),
            "m{i} lost"
        );
    }
    for i in 0..n / 10 {
        let Begin::Completed(record) = claims.begin(format!("c{i}")).unwrap() else {
            panic!("c{i} must be completed");
        };
        assert_eq!(record.status, Status::Completed);
        assert_eq!(record.result(), Some(format!("r{i}").as_bytes()));
    }
    assert_eq!(store.stats().live_keys, (n + n / 10) as u64);
}

#[test]
fn immediate_mode_keeps_everything_across_flush_close_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        Store::builder(dir.path())
            .durability(Durability::Immediate)
            .open()
            .unwrap()
    };
    let store = open();
    write(&store, 200);
    let stats = store.stats();
    assert!(stats.sync_rounds >= 1);
    assert!(
        stats.durable_waits >= 220,
        "every acknowledged write waits for its sync: {stats:?}"
    );
    store.flush().unwrap();
    store.close().unwrap();
    let store = open();
    check(&store, 200);
    store.close().unwrap();
}

#[test]
fn immediate_mode_shares_fsyncs_between_concurrent_callers() {
    const THREADS: usize = 4;
    const PER_THREAD: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::Immediate)
        .open()
        .unwrap();
    let ns = store.namespace("group", policy()).unwrap();
    let barrier = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let ns = ns.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..PER_THREAD {
                    assert!(ns.check_and_set(format!("t{t}-{i}")).unwrap().is_first());
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let operations = (THREADS * PER_THREAD) as u64;
    let stats = store.stats();
    println!("{operations} operations, {} sync rounds", stats.sync_rounds);
    assert!(stats.durable_waits >= operations);
    assert!(
        stats.sync_rounds < operations,
        "no group commit: {} sync rounds for {operations} operations",
        stats.sync_rounds
    );
    drop(ns);
    store.close().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::Immediate)
        .open()
        .unwrap();
    let ns = store.namespace("group", policy()).unwrap();
    for t in 0..THREADS {
        for i in 0..PER_THREAD {
            assert!(!ns.check_and_set(format!("t{t}-{i}")).unwrap().is_first());
        }
    }
}

#[test]
fn interval_mode_keeps_everything_after_close_even_before_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let open = || {
        Store::builder(dir.path())
            .durability(Durability::Interval(Duration::from_secs(3600)))
            .open()
            .unwrap()
    };
    let store = open();
    write(&store, 300);
    assert_eq!(
        store.stats().durable_waits,
        0,
        "interval mode answers without waiting for a sync"
    );
    let rounds = store.stats().sync_rounds;
    store.flush().unwrap();
    assert!(store.stats().sync_rounds > rounds, "flush syncs now");
    store.close().unwrap();
    let store = open();
    check(&store, 300);
    // Writes after a reopen (into recovered buckets) survive the next close too.
    let more = store.namespace("marks", policy()).unwrap();
    assert!(more.check_and_set("after-reopen").unwrap().is_first());
    drop(more);
    store.close().unwrap();
    let store = open();
    assert!(
        !store
            .namespace("marks", policy())
            .unwrap()
            .check_and_set("after-reopen")
            .unwrap()
            .is_first()
    );
}
