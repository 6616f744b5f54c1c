//! Misuse of the machine around the store (docs/RELIABILITY.md §7): a disk that fills up.
//!
//! The store lives on a 2 MiB tmpfs mounted by the test (CI runs as root; if mounting
//! is not permitted the test says so loudly and returns). A filler file takes part of
//! the space; keys are written until `check_and_set` fails. The failure must be
//! `Error::Io` carrying `ENOSPC` whose message says the disk is full (docs/CONTRACT.md
//! §3.5), the store must not be poisoned (reads and duplicates still answer, new keys
//! keep failing the same way, a batch fails whole or names the ids it applied), and
//! once the filler is deleted new keys are accepted again and a reopen finds every key
//! acknowledged before and after the disk filled.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Outcome, Policy, Store, UnixMs};

const T0: u64 = 1_700_000_000_000;

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(60)).lease(Duration::from_secs(30))
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
