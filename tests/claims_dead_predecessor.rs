//! Guards docs/CONTRACT.md §3.6, a dead predecessor's claims: the directory lock
//! proves that the process which held the claims in progress at open is gone, so the
//! open releases them (counted in `Stats::claims_released_at_open`) instead of letting
//! their keys wait out the lease; their attempt counts stay.
//!
//! Each test "kills" the holder by forgetting its `Claim` (so nothing releases it)
//! and closing the store, then reopens: once through the checkpoint of the clean
//! close and once by replay (another shard count makes the checkpoint not match),
//! so both open paths are held to the rule. A claim acquired by this open is never
//! touched, and a `Claim` handle kept across the reopen answers `Error::Closed`.

use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Policy, Status, Store, UnixMs};

const LEASE: Duration = Duration::from_secs(3600);

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(24 * 3600))
        .lease(LEASE)
        .max_attempts(2)
}

fn open(dir: &std::path::Path, clock: &ManualClock, shards: usize) -> Store {
    Store::builder(dir)
        .durability(Durability::None)
        .shards(shards)
        .clock(clock.clone())
        .open()
        .unwrap()
}

fn acquire_and_die(store: &Store, id: &str) {
    let ns = store.namespace("jobs", policy()).unwrap();
    match ns.begin(id).unwrap() {
        // The worker dies holding the claim: nothing releases it.
        Begin::Acquired(claim) => std::mem::forget(claim),
        other => panic!("{id} not acquired: {other:?}"),
    }
}

fn dead_claims_are_released_at_open(shards_after: usize, from_checkpoint: bool) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(1_700_000_000_000));
    let store = open(dir.path(), &clock, 8);
    acquire_and_die(&store, "a");
    acquire_and_die(&store, "b");
    store
        .namespace("jobs", policy())
        .unwrap()
        .check_and_set("c")
        .unwrap()
        .is_first()
        .then_some(())
        .expect("c is new");
    store.close().unwrap();

    // One second later: the leases (1 h) are far from running out.
    clock.advance(Duration::from_secs(1));
    let store = open(dir.path(), &clock, shards_after);
    let stats = store.stats();
    assert_eq!(stats.opened_from_checkpoint, from_checkpoint);
    assert_eq!(stats.claims_released_at_open, 2);
    assert_eq!((stats.in_progress, stats.released, stats.seen), (0, 2, 1));
    let ns = store.namespace("jobs", policy()).unwrap();
    let a = ns.get("a").unwrap().expect("a is remembered");
    assert_eq!(a.status, Status::Released);
    assert_eq!(a.attempts, 1);
    assert_eq!(a.lease_until, None);
    let mut scanned = Vec::new();
    store
        .scan(Some("jobs"), |_, id, record| {
            scanned.push((String::from_utf8_lossy(id).into_owned(), record.status));
            true
        })
        .unwrap();
    scanned.sort_by(|x, y| x.0.cmp(&y.0));
    assert_eq!(
        scanned,
        vec![
            ("a".to_string(), Status::Released),
            ("b".to_string(), Status::Released),
            ("c".to_string(), Status::Seen),
        ]
    );

    // Acquirable at once, as the second attempt; dies again.
    match ns.begin("a").unwrap() {
        Begin::Acquired(claim) => {
            assert_eq!(claim.attempt(), 2);
            std::mem::forget(claim);
        }
        other => panic!("a not acquired after the holder died: {other:?}"),
    }
    // A claim of this open is live: never released by the rule.
    let Begin::Acquired(held) = ns.begin("b").unwrap() else {
        panic!("b not acquired");
    };
    assert!(matches!(ns.begin("b").unwrap(), Begin::InProgress(_)));
    assert_eq!(store.stats().in_progress, 2);
    store.close().unwrap();

    let store = open(dir.path(), &clock, 8);
    assert_eq!(store.stats().claims_released_at_open, 2);
    let ns = store.namespace("jobs", policy()).unwrap();
    // Two acquisitions did not complete: the dead-letter signal, not a third try.
    assert!(matches!(ns.begin("a").unwrap(), Begin::Exhausted(_)));
    // The handle kept across the reopen belongs to the closed store.
    assert!(matches!(held.complete(None), Err(Error::Closed)));
    let b = ns.get("b").unwrap().unwrap();
    assert_eq!((b.status, b.attempts), (Status::Released, 2));
    store.close().unwrap();
}

#[test]
fn dead_claims_are_released_at_an_open_from_the_checkpoint() {
    dead_claims_are_released_at_open(8, true);
}

#[test]
fn dead_claims_are_released_at_an_open_by_replay() {
    dead_claims_are_released_at_open(16, false);
}

#[test]
fn an_open_with_no_claims_in_progress_releases_none() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(1_700_000_000_000));
    let store = open(dir.path(), &clock, 8);
    let ns = store.namespace("jobs", policy()).unwrap();
    let Begin::Acquired(claim) = ns.begin("done").unwrap() else {
        panic!("not acquired");
    };
    claim.complete(Some(b"ok")).unwrap();
    store.close().unwrap();
    let store = open(dir.path(), &clock, 8);
    assert_eq!(store.stats().claims_released_at_open, 0);
    assert_eq!(store.stats().completed, 1);
}
