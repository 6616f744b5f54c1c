//! Guards per-key atomicity under threads (docs/CONTRACT.md §2.1): for one key, exactly
//! one caller gets `First` / `Acquired` per retention window and per expired lease.
//!
//! Four threads race on the same 16 keys in rounds separated by a barrier. In each
//! round every thread calls `check_and_set` and `begin` on every key several times in
//! its own order; the acquirer of a claim holds it until the round ends. Afterwards
//! the test counts, per key, how many calls were answered `First` and `Acquired`: it
//! must be exactly one each. Between rounds a manual clock moves past the ttl (a new
//! retention window: the race starts over) or only past the lease (the next `begin`
//! race must yield exactly one re-acquisition with the next attempt number, and the
//! claim of the previous round must then be lost). Over 100k operations in total.

use std::collections::HashMap;
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use idemstore::{Begin, Claim, Durability, Error, ManualClock, Policy, Store, UnixMs};

const THREADS: usize = 4;
const KEYS: usize = 16;
const PASSES: usize = 4;
const ROUNDS: usize = 200;

#[derive(Default)]
struct Tally {
    first: HashMap<usize, usize>,
    acquired: HashMap<usize, Vec<u32>>,
    operations: usize,
}

#[test]
fn exactly_one_first_and_one_acquired_per_key_per_window() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(1_700_000_000_000));
    let store = Store::builder(dir.path())
        .durability(Durability::Interval(Duration::from_millis(100)))
        .bucket_width(Duration::from_secs(1))
        .shards(4)
        .clock(clock.clone())
        .open()
        .unwrap();
    let ttl = Duration::from_secs(10);
    let lease = Duration::from_secs(2);
    let marks = store.namespace("marks", Policy::ttl(ttl)).unwrap();
    let claims = store
        .namespace("claims", Policy::ttl(ttl).lease(lease))
        .unwrap();

    let start = Arc::new(Barrier::new(THREADS + 1));
    let end = Arc::new(Barrier::new(THREADS + 1));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let held: Arc<Mutex<Vec<(usize, Claim)>>> = Arc::new(Mutex::new(Vec::new()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (marks, claims) = (marks.clone(), claims.clone());
            let (start, end, tally, held) = (
                Arc::clone(&start),
                Arc::clone(&end),
                Arc::clone(&tally),
                Arc::clone(&held),
            );
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    start.wait();
                    let mut local = Tally::default();
                    for pass in 0..PASSES {
                        for k in 0..KEYS {
                            // A different order per thread, pass and round.
                            let key = (k * 7 + t * 5 + pass * 3 + round) % KEYS;
                            let id = format!("key-{key}");
                            if marks.check_and_set(&id).unwrap().is_first() {
                                *local.first.entry(key).or_default() += 1;
                            }
                            match claims.begin(&id).unwrap() {
                                Begin::Acquired(claim) => {
                                    local.acquired.entry(key).or_default().push(claim.attempt());
                                    held.lock().unwrap().push((key, claim));
                                }
                                Begin::InProgress(_) | Begin::Completed(_) => {}
                                Begin::Exhausted(r) => panic!("unexpected exhausted {r:?}"),
                            }
                            local.operations += 2;
                        }
                    }
                    let mut total = tally.lock().unwrap();
                    for (key, n) in local.first {
                        *total.first.entry(key).or_default() += n;
                    }
                    for (key, attempts) in local.acquired {
                        total.acquired.entry(key).or_default().extend(attempts);
                    }
                    total.operations += local.operations;
                    drop(total);
                    end.wait();
                }
            })
        })
        .collect();

    let mut operations = 0;
    let mut previous: Vec<(usize, Claim)> = Vec::new();
    for round in 0..ROUNDS {
        // Even rounds open a new retention window; odd rounds only let the leases run out.
        let new_window = round % 2 == 0;
        start.wait();
        end.wait();
        let mut tally = std::mem::take(&mut *tally.lock().unwrap());
        operations += tally.operations;
        for key in 0..KEYS {
            let firsts = tally.first.remove(&key).unwrap_or(0);
            let acquired = tally.acquired.remove(&key).unwrap_or_default();
            assert_eq!(
                firsts,
                if new_window { 1 } else { 0 },
                "round {round} key {key}: First answers"
            );
            let expected_attempt = if new_window { 1 } else { 2 };
            assert_eq!(
                acquired,
                vec![expected_attempt],
                "round {round} key {key}: acquisitions"
            );
        }
        // Claims of the round before were overtaken by this round's acquisitions.
        for (key, claim) in previous.drain(..) {
            assert!(
                matches!(claim.complete(None), Err(Error::ClaimLost)),
                "round {round} key {key}: an overtaken claim still completed"
            );
        }
        previous = std::mem::take(&mut *held.lock().unwrap());
        assert_eq!(previous.len(), KEYS);
        if new_window {
            clock.advance(lease + Duration::from_millis(1));
        } else {
            clock.advance(ttl + Duration::from_secs(2));
            for (_, claim) in previous.drain(..) {
                // The key expired under it: the claim is lost.
                assert!(matches!(claim.release(), Err(Error::ClaimLost)));
            }
        }
    }
    for thread in threads {
        thread.join().unwrap();
    }
    println!("{operations} operations");
    assert!(operations >= 100_000, "only {operations} operations");
    drop((marks, claims));
    store.close().unwrap();
}
