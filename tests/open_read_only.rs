//! Guards the read-only open (docs/CONTRACT.md §3.4): it shares the directory lock
//! with every other open, answers reads, refuses every write with `Error::ReadOnly`,
//! creates nothing where there is no store, and leaves the directory as it found it
//! (byte for byte, name for name). A store a crash left with a torn tail is the case
//! of `tests/cli_tools.rs` and `tests/verify_open_agree.rs`.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use idemstore::{Begin, Error, Policy, Status, Store};

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect()
}

fn read_only(dir: &Path) -> Result<Store, Error> {
    Store::builder(dir).read_only(true).open()
}

#[test]
fn a_read_only_store_reads_and_refuses_every_write() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path()).unwrap();
    let ns = store.namespace("orders", policy()).unwrap();
    assert!(ns.check_and_set("a").unwrap().is_first());
    let Begin::Acquired(claim) = ns.begin("b").unwrap() else {
        panic!("not acquired");
    };
    claim.complete(Some(b"done")).unwrap();
    // Held: a read-only open is refused like any other.
    assert!(matches!(read_only(dir.path()), Err(Error::Locked { .. })));
    store.close().unwrap();

    let before = files(dir.path());
    let store = read_only(dir.path()).unwrap();
    let ns = store.namespace("orders", policy()).unwrap();
    assert_eq!(ns.get("a").unwrap().unwrap().status, Status::Seen);
    assert_eq!(ns.get("b").unwrap().unwrap().result(), Some(&b"done"[..]));
    let mut scanned = 0;
    store
        .scan(None, |_, _, _| {
            scanned += 1;
            true
        })
        .unwrap();
    assert_eq!(scanned, 2);
    assert!(matches!(ns.check_and_set("c"), Err(Error::ReadOnly)));
    assert!(matches!(
        ns.check_and_set_many(&["c", "d"]),
        Err(Error::ReadOnly)
    ));
    assert!(matches!(ns.begin("c"), Err(Error::ReadOnly)));
    assert!(matches!(ns.remove("a"), Err(Error::ReadOnly)));
    assert!(matches!(store.flush(), Err(Error::ReadOnly)));
    assert!(matches!(store.expire_now(), Err(Error::ReadOnly)));
    assert!(matches!(
        store.namespace("new", policy()),
        Err(Error::ReadOnly)
    ));
    store.close().unwrap();
    assert_eq!(
        files(dir.path()),
        before,
        "a read-only open changed the directory"
    );

    // The store is as it was: a writable open still finds both keys.
    let store = Store::open(dir.path()).unwrap();
    let ns = store.namespace("orders", policy()).unwrap();
    assert!(!ns.check_and_set("a").unwrap().is_first());
    store.close().unwrap();
}

#[test]
fn a_read_only_open_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-store-here");
    assert!(matches!(read_only(&missing), Err(Error::Io { .. })));
    assert!(!missing.exists());
}
