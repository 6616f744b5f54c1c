//! Guards the single-opener rule of docs/CONTRACT.md §3.4: a second `Store` on a directory
//! gets `Error::Locked` at once, whether it is in the same process or another one, and
//! the lock goes away with its holder — on `close()`, on dropping the last handle, and
//! when the holding process is killed with SIGKILL (the kernel drops the lock; no stale
//! lock file blocks the next open). The cross-process case re-runs this test binary as
//! a child that opens the store, writes a key, reports "ready" and waits to be killed.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use idemstore::{Durability, Error, Policy, Store};

const CHILD_ENV: &str = "IDEMSTORE_LOCK_CHILD_DIR";

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

#[track_caller]
fn assert_locked(result: Result<Store, Error>, dir: &std::path::Path) {
    match result {
        Err(Error::Locked { path }) => assert_eq!(path, dir),
        other => panic!("expected Error::Locked, got {other:?}"),
    }
}

#[test]
fn a_second_opener_in_the_same_process_is_locked_out_until_close() {
    let dir = tempfile::tempdir().unwrap();
    let first = Store::builder(dir.path())
        .durability(Durability::None)
        .open()
        .unwrap();
    let ns = first.namespace("locks", policy()).unwrap();
    assert!(ns.check_and_set("a").unwrap().is_first());

    assert_locked(Store::open(dir.path()), dir.path());
    assert_locked(
        Store::builder(dir.path())
            .durability(Durability::Immediate)
            .open(),
        dir.path(),
    );
    // A clone of the handle is the same store, not a second opener.
    let clone = first.clone();
    assert!(
        !clone
            .namespace("locks", policy())
            .unwrap()
            .check_and_set("a")
            .unwrap()
            .is_first()
    );

    // close() releases the lock even while namespace handles are still alive.
    first.close().unwrap();
    assert!(matches!(ns.check_and_set("b"), Err(Error::Closed)));
    let second = Store::open(dir.path()).unwrap();
    assert!(
        !second
            .namespace("locks", policy())
            .unwrap()
            .check_and_set("a")
            .unwrap()
            .is_first()
    );
    assert_locked(Store::open(dir.path()), dir.path());
    drop((ns, clone));
    second.close().unwrap();
    Store::open(dir.path()).unwrap().close().unwrap();
}

#[test]
fn dropping_the_last_handle_releases_the_lock() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let ns = store.namespace("locks", policy()).unwrap();
    assert!(ns.check_and_set("a").unwrap().is_first());
    drop(store);
    // The namespace handle still holds the store open.
    assert_locked(Store::open(dir.path()), dir.path());
    drop(ns);
    let store = Store::open(dir.path()).unwrap();
    assert!(
        !store
            .namespace("locks", policy())
            .unwrap()
            .check_and_set("a")
            .unwrap()
            .is_first()
    );
}

/// Child mode: open the store, write a key, report readiness, and wait to be killed.
fn hold_the_store(dir: &str) -> ! {
    let store = Store::open(dir).unwrap();
    let ns = store.namespace("locks", policy()).unwrap();
    assert!(ns.check_and_set("from-child").unwrap().is_first());
    println!("ready");
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

#[test]
fn another_process_holding_the_store_locks_it_out_until_killed() {
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        hold_the_store(&dir);
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "another_process_holding_the_store_locks_it_out_until_killed",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        match lines.next() {
            Some(Ok(line)) if line.ends_with("ready") => break,
            Some(Ok(_)) => continue,
            other => {
                let _ = child.kill();
                panic!("child ended before it was ready: {other:?}");
            }
        }
    }
    for _ in 0..3 {
        assert_locked(Store::open(dir.path()), dir.path());
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();

    let store = Store::open(dir.path()).unwrap();
    let ns = store.namespace("locks", policy()).unwrap();
    assert!(
        !ns.check_and_set("from-child").unwrap().is_first(),
        "the child's acknowledged key was lost"
    );
    assert_locked(Store::open(dir.path()), dir.path());
    drop(ns);
    store.close().unwrap();
}
