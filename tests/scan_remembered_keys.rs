//! Guards `Store::scan`, the library side of `idemstore scan` and `export`: under a
//! manual clock it reports exactly the remembered keys — not removed, not expired
//! (reaped or not, before and after a reopen), each once, in its newest state, the
//! same `Record` that `get` answers — filtered by namespace, and stops when the
//! callback says so. The test writes marks and completed claims in two namespaces with
//! different ttls, removes one, and compares the scan with the counts it must find.

use std::collections::BTreeMap;
use std::time::Duration;

use idemstore::{Begin, ManualClock, Policy, Record, Status, Store, UnixMs};

const START: UnixMs = UnixMs(1_700_000_000_000);

fn open(dir: &std::path::Path, clock: &ManualClock) -> Store {
    Store::builder(dir).clock(clock.clone()).open().unwrap()
}

fn scan_all(store: &Store, namespace: Option<&str>) -> BTreeMap<(String, Vec<u8>), Record> {
    let mut found = BTreeMap::new();
    store
        .scan(namespace, |ns, id, record| {
            let previous = found.insert((ns.to_string(), id.to_vec()), record.clone());
            assert!(previous.is_none(), "{ns}/{id:?} reported twice");
            true
        })
        .unwrap();
    found
}

#[test]
fn scan_reports_each_remembered_key_once_in_its_newest_state() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    let store = open(dir.path(), &clock);
    let short = store
        .namespace("short", Policy::ttl(Duration::from_secs(60)))
        .unwrap();
    let long = store
        .namespace("long", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for i in 0..100 {
        assert!(short.check_and_set(format!("s{i}")).unwrap().is_first());
    }
    for i in 0..50 {
        let Begin::Acquired(claim) = long.begin(format!("l{i}")).unwrap() else {
            panic!()
        };
        claim.complete(Some(format!("r{i}").as_bytes())).unwrap();
    }
    assert!(long.remove("l0").unwrap());
    let all = scan_all(&store, None);
    assert_eq!(all.len(), 149);
    let l7 = &all[&("long".to_string(), b"l7".to_vec())];
    assert_eq!(l7.status, Status::Completed);
    assert_eq!(l7.result(), Some(&b"r7"[..]));
    assert_eq!(Some(l7), long.get("l7").unwrap().as_ref());
    assert_eq!(scan_all(&store, Some("long")).len(), 49);
    assert_eq!(scan_all(&store, Some("absent")).len(), 0);
    assert_eq!(store.namespace_names(), vec!["short", "long"]);

    // Stopping early.
    let mut seen = 0;
    store
        .scan(None, |_, _, _| {
            seen += 1;
            seen < 10
        })
        .unwrap();
    assert_eq!(seen, 10);

    // Expired keys are not reported, reaped or not; nor after a reopen.
    clock.advance(Duration::from_secs(3 * 60));
    assert_eq!(scan_all(&store, None).len(), 49);
    store.close().unwrap();
    let store = open(dir.path(), &clock);
    assert_eq!(scan_all(&store, None).len(), 49);
}
