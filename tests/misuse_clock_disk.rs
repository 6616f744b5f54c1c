//! Misuse of the machine around the store (issue 3, test 7): a wall clock that jumps
//! backwards or forwards, and a disk that fills up.
//!
//! Clock: the store's time is a high-water mark of the clock (restored at open from the
//! segment headers), so a step back never makes a key or a lease expire early: a key
//! remembered at `t` stays `Duplicate` after the clock goes back an hour and then forward
//! to 1 ms before its `expires_at`, and is forgotten exactly at `expires_at`. A step
//! forward is wall time passing: keys whose `expires_at` it passes are forgotten (the
//! documented limit), the others are not.
//!
//! Disk full: the store lives on a 2 MiB tmpfs mounted by the test (CI runs as root; if
//! mounting is not permitted the test says so loudly and returns). A filler file takes
//! part of the space; keys are written until `check_and_set` fails. The failure must be
//! `Error::Io` carrying `ENOSPC` whose message says the disk is full, the store must not
//! be poisoned (reads and duplicates still answer, new keys keep failing the same way),
//! and once the filler is deleted new keys are accepted again and a reopen finds every
//! key acknowledged before and after the disk filled.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Outcome, Policy, Store, UnixMs};

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
    assert_eq!(
        store.expire_now().unwrap(),
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
    clock.set(UnixMs(T0 + 2 * HOUR_MS));
    assert!(
        short.get("k").unwrap().is_none(),
        "a step forward is time passing"
    );
    assert_duplicate(long.check_and_set("k").unwrap(), T0, T0 + 3 * HOUR_MS);
    assert_eq!(store.expire_now().unwrap(), 1);
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

/// A tmpfs mounted for the test, unmounted on drop.
struct Mount {
    path: PathBuf,
    _parent: tempfile::TempDir,
}

impl Mount {
    /// `None` if this process may not mount (not root, or no CAP_SYS_ADMIN).
    fn tmpfs(size: &str) -> Option<Mount> {
        let parent = tempfile::tempdir().unwrap();
        let path = parent.path().join("tmpfs");
        std::fs::create_dir(&path).unwrap();
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .status();
        match status {
            Ok(s) if s.success() => Some(Mount {
                path,
                _parent: parent,
            }),
            other => {
                eprintln!(
                    "\n!!! DISK-FULL TEST NOT RUN: mounting a tmpfs failed ({other:?}); \
                     run as root (CI does) to prove the disk-full behaviour !!!\n"
                );
                None
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}

fn is_disk_full(e: &Error) -> bool {
    let enospc = match e {
        Error::Io { source, .. } => source.raw_os_error() == Some(libc_enospc()),
        _ => false,
    };
    enospc && e.to_string().contains("the disk is full")
}

/// ENOSPC on Linux (no libc dependency for one constant).
fn libc_enospc() -> i32 {
    28
}

fn id(i: usize) -> String {
    // ~200-byte ids: the 2 MiB fill up after a few thousand keys.
    format!("{i:08}-{}", "p".repeat(190))
}

#[test]
fn a_full_disk_is_an_io_error_that_loses_nothing_and_passes_when_space_is_freed() {
    let Some(mount) = Mount::tmpfs("2m") else {
        return;
    };
    let dir = mount.path.join("store");
    let filler = mount.path.join("filler");
    std::fs::write(&filler, vec![1u8; 512 * 1024]).unwrap();
    let clock = ManualClock::new(UnixMs(T0));
    let open = || {
        Store::builder(&dir)
            .durability(Durability::Immediate)
            .segment_size(64 * 1024)
            .clock(clock.clone())
            .open()
            .unwrap()
    };
    let store = open();
    let ns = store.namespace("orders", policy()).unwrap();

    let mut acknowledged = Vec::new();
    let error = loop {
        let i = acknowledged.len();
        assert!(i < 100_000, "a 2 MiB disk never filled");
        match ns.check_and_set(id(i)) {
            Ok(Outcome::First) => acknowledged.push(i),
            Ok(other) => panic!("key {i}: {other:?}"),
            Err(e) => break e,
        }
    };
    assert!(
        is_disk_full(&error),
        "expected Error::Io(ENOSPC), got {error:?}: {error}"
    );
    assert!(acknowledged.len() > 1_000, "{} keys", acknowledged.len());
    eprintln!("disk full after {} keys: {error}", acknowledged.len());

    // Full, not poisoned: duplicates and reads still answer, new keys keep failing with
    // the same error, a claim cannot start, and flush succeeds.
    for &i in acknowledged.iter().step_by(97) {
        assert!(!ns.check_and_set(id(i)).unwrap().is_first(), "key {i}");
        assert!(ns.get(id(i)).unwrap().is_some());
    }
    let failed = acknowledged.len();
    for _ in 0..3 {
        let e = ns.check_and_set(id(failed)).unwrap_err();
        assert!(is_disk_full(&e), "{e:?}");
    }
    // A batch either fails whole (nothing applied) or says exactly which leading ids it
    // applied, so a consumer can process those and retry the rest: never an error that
    // leaves ids marked behind the caller's back.
    let batch: Vec<String> = (0..64).map(|k| id(failed + 10_000 + k)).collect();
    let applied = match ns.check_and_set_many(&batch) {
        Err(Error::PartialBatch { outcomes, source }) => {
            assert!(is_disk_full(&source), "{source:?}");
            assert!(outcomes.iter().all(Outcome::is_first), "{outcomes:?}");
            outcomes.len()
        }
        Err(e) => {
            assert!(is_disk_full(&e), "{e:?}");
            0
        }
        Ok(outcomes) => panic!("a batch on a full disk succeeded: {outcomes:?}"),
    };
    for (k, batch_id) in batch.iter().enumerate() {
        assert_eq!(
            ns.get(batch_id).unwrap().is_some(),
            k < applied,
            "batch id {k} of {applied} applied"
        );
    }
    eprintln!("a batch of 64 on the full disk applied {applied} ids");
    acknowledged.extend((0..applied).map(|k| failed + 10_000 + k));

    // A claim lands in its own shard's log stripe, whose segment may still have
    // reserved room: it either succeeds or fails with the same error.
    let mut claim_completed = false;
    match ns.begin("claim-while-full") {
        Err(e) => assert!(is_disk_full(&e), "{e:?}"),
        Ok(Begin::Acquired(claim)) => match claim.complete(None) {
            Ok(()) => claim_completed = true,
            Err(e) => assert!(is_disk_full(&e), "{e:?}"),
        },
        Ok(other) => panic!("begin on a new key: {other:?}"),
    }
    assert!(
        ns.get(id(failed)).unwrap().is_none(),
        "a refused key is not half-written"
    );
    store.flush().unwrap();

    // Space freed: the store keeps working without a reopen.
    std::fs::remove_file(&filler).unwrap();
    for i in failed..failed + 500 {
        assert!(
            ns.check_and_set(id(i)).unwrap().is_first(),
            "key {i} after freeing"
        );
        acknowledged.push(i);
    }
    drop(ns);
    store.close().unwrap();
    drop(store);

    // Nothing acknowledged, before or after the disk filled, is lost.
    let store = open();
    assert_eq!(store.stats().corrupt_records_skipped, 0);
    let ns = store.namespace("orders", policy()).unwrap();
    for &i in &acknowledged {
        assert!(!ns.check_and_set(id(i)).unwrap().is_first(), "key {i} lost");
    }
    assert_eq!(
        store.stats().live_keys,
        acknowledged.len() as u64 + u64::from(claim_completed)
    );
    if claim_completed {
        assert!(matches!(
            ns.begin("claim-while-full").unwrap(),
            Begin::Completed(_)
        ));
    }
    drop(ns);
    store.close().unwrap();
}
