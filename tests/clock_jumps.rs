//! Misuse of the clock around the store (docs/RELIABILITY.md §7): a wall clock that jumps
//! backwards or forwards.
//!
//! The store's time is a high-water mark of the clock (restored at open from the
//! segment headers), so a step back never makes a key or a lease expire early: a key
//! remembered at `t` stays `Duplicate` after the clock goes back an hour and then forward
//! to 1 ms before its `expires_at`, and is forgotten exactly at `expires_at`; a lease
//! holds until exactly its `lease_until`. A step forward is wall time passing: keys
//! whose `expires_at` it passes are forgotten (the documented limit, docs/CONTRACT.md
//! §1.4), the others are not. Each test drives a `ManualClock` with 1 s buckets and
//! checks exact `first_seen` / `expires_at` / `lease_until` values.

use std::path::Path;
use std::time::Duration;

use idemstore::{Begin, Durability, ManualClock, Outcome, Policy, Store, UnixMs};

/// A whole second, so deadlines are easy to compute with 1 s buckets.
const T0: u64 = 1_700_000_000_000;
const HOUR_MS: u64 = 3_600_000;
const TTL_MS: u64 = 60_000;

fn open(dir: &Path, clock: &ManualClock) -> Store {
    Store::builder(dir)
        .durability(Durability::None)
        .bucket_width(Duration::from_secs(1))
        .clock(clock.clone())
        .open()
        .unwrap()
}

fn policy() -> Policy {
    Policy::ttl(Duration::from_millis(TTL_MS)).lease(Duration::from_secs(30))
}

#[track_caller]
fn assert_duplicate(outcome: Outcome, first_seen: u64, expires_at: u64) {
    match outcome {
        Outcome::Duplicate(seen) => {
            assert_eq!(seen.first_seen, UnixMs(first_seen));
            assert_eq!(seen.expires_at, UnixMs(expires_at));
        }
        Outcome::First => panic!("forgotten early: expected Duplicate"),
        Outcome::LikelyDuplicate => panic!("an exact namespace answered LikelyDuplicate"),
    }
}

#[test]
fn a_clock_stepping_back_never_expires_a_key_early() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0));
    let store = open(dir.path(), &clock);
    let ns = store.namespace("orders", policy()).unwrap();
    assert!(ns.check_and_set("k").unwrap().is_first());
    let expires_at = T0 + TTL_MS; // T0 is on a bucket boundary
    assert_eq!(ns.get("k").unwrap().unwrap().expires_at, UnixMs(expires_at));

    // An hour back: still a duplicate, same first_seen and expires_at; a new key is
    // stamped with the store's time (T0), not the clock's.
    clock.set(UnixMs(T0 - HOUR_MS));
    assert_duplicate(ns.check_and_set("k").unwrap(), T0, expires_at);
    assert!(ns.check_and_set("stamped").unwrap().is_first());
    assert_eq!(ns.get("stamped").unwrap().unwrap().first_seen, UnixMs(T0));
    assert_eq!(store.expire_now().unwrap(), 0);

    // Across a close and reopen with the clock still an hour back.
    drop(ns);
    store.close().unwrap();
    let store = open(dir.path(), &clock);
    let ns = store.namespace("orders", policy()).unwrap();
    assert_duplicate(ns.check_and_set("k").unwrap(), T0, expires_at);

    // Forward to 1 ms before expires_at: remembered; reaping forgets nothing.
    clock.set(UnixMs(expires_at - 1));
    assert_eq!(store.expire_now().unwrap(), 0);
    assert_duplicate(ns.check_and_set("k").unwrap(), T0, expires_at);
    // Back again, then forward to exactly expires_at: forgotten.
    clock.set(UnixMs(T0 - HOUR_MS));
    assert_duplicate(ns.check_and_set("k").unwrap(), T0, expires_at);
    clock.set(UnixMs(expires_at));
    assert!(ns.get("k").unwrap().is_none());
    // The background reaper may take them first (its round reads the same clock).
    store.expire_now().unwrap();
    assert_eq!(
        store.stats().expired_keys,
        2,
        "k and stamped expire together"
    );
    assert!(ns.check_and_set("k").unwrap().is_first());
    assert_eq!(ns.get("k").unwrap().unwrap().first_seen, UnixMs(expires_at));
    drop(ns);
    store.close().unwrap();
}

#[test]
fn a_clock_stepping_back_never_ends_a_lease_early() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0));
    let store = open(dir.path(), &clock);
    let ns = store.namespace("payments", policy()).unwrap();
    let Begin::Acquired(claim) = ns.begin("tx").unwrap() else {
        panic!("first begin acquires")
    };
    let lease_until = T0 + 30_000;
    assert_eq!(claim.lease_until(), UnixMs(lease_until));
    std::mem::forget(claim); // the worker died holding it

    clock.set(UnixMs(T0 - HOUR_MS));
    assert!(matches!(ns.begin("tx").unwrap(), Begin::InProgress(_)));
    clock.set(UnixMs(lease_until - 1));
    match ns.begin("tx").unwrap() {
        Begin::InProgress(record) => assert_eq!(record.lease_until, Some(UnixMs(lease_until))),
        other => panic!("lease ended early: {other:?}"),
    }
    clock.set(UnixMs(lease_until));
    match ns.begin("tx").unwrap() {
        Begin::Acquired(claim) => {
            assert_eq!(claim.attempt(), 2);
            claim.complete(None).unwrap();
        }
        other => panic!("lease did not end at lease_until: {other:?}"),
    }
    drop(ns);
    store.close().unwrap();
}

#[test]
fn a_clock_stepping_forward_forgets_exactly_the_keys_it_passes() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0));
    let store = open(dir.path(), &clock);
    let short = store.namespace("short", policy()).unwrap();
    let long = store
        .namespace("long", Policy::ttl(Duration::from_millis(3 * HOUR_MS)))
        .unwrap();
    assert!(short.check_and_set("k").unwrap().is_first());
    assert!(long.check_and_set("k").unwrap().is_first());

    // Two hours forward: past the short key's expires_at, not the long one's.
    let expired_before = store.stats().expired_keys;
    clock.set(UnixMs(T0 + 2 * HOUR_MS));
    assert!(
        short.get("k").unwrap().is_none(),
        "a step forward is time passing"
    );
    assert_duplicate(long.check_and_set("k").unwrap(), T0, T0 + 3 * HOUR_MS);
    // The background reaper may take it first (its round reads the same clock).
    store.expire_now().unwrap();
    assert_eq!(store.stats().expired_keys, expired_before + 1);
    // A key written in the "future" keeps its future stamps when the clock comes back,
    // and the store's time stays there: nothing written then expires early.
    assert!(short.check_and_set("future").unwrap().is_first());
    clock.set(UnixMs(T0));
    assert_duplicate(
        short.check_and_set("future").unwrap(),
        T0 + 2 * HOUR_MS,
        T0 + 2 * HOUR_MS + TTL_MS,
    );
    assert!(short.check_and_set("k").unwrap().is_first());
    assert_eq!(
        short.get("k").unwrap().unwrap().first_seen,
        UnixMs(T0 + 2 * HOUR_MS)
    );
    drop((short, long));
    store.close().unwrap();
}
