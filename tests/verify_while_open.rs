//! Guards `idemstore::verify`, the library side of `idemstore verify`: it answers
//! `Error::Locked` while a store holds the directory (it takes the lock, like every
//! offline tool), and on a closed store it reports the namespaces, segments and records
//! it checked — including segments whose bucket has expired by the wall clock — while
//! changing nothing on disk (an open would delete those segments). The test compares
//! the directory listing before and after.

use std::time::Duration;

use idemstore::{Error, ManualClock, Policy, Store, UnixMs};

const START: UnixMs = UnixMs(1_700_000_000_000);

fn open(dir: &std::path::Path, clock: &ManualClock) -> Store {
    Store::builder(dir).clock(clock.clone()).open().unwrap()
}

#[test]
fn verify_answers_locked_while_a_store_is_open_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    let store = open(dir.path(), &clock);
    let ns = store
        .namespace("ns", Policy::ttl(Duration::from_secs(60)))
        .unwrap();
    for i in 0..10 {
        assert!(ns.check_and_set(format!("k{i}")).unwrap().is_first());
    }
    assert!(matches!(
        idemstore::verify(dir.path()),
        Err(Error::Locked { .. })
    ));
    store.close().unwrap();
    let listing = || {
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        names
    };
    let before = listing();
    let report = idemstore::verify(dir.path()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.namespaces, report.records), (1, 10));
    // Every segment has expired by the wall clock (the store's clock is in 2023):
    // verify reports them, and deletes nothing, unlike an open would.
    assert_eq!(report.expired_segments, report.segments);
    assert_eq!(listing(), before);
}
