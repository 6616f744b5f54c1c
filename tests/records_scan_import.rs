//! Guards the library side of the offline tools and of observability, under a manual
//! clock: `Store::scan` reports exactly the remembered keys (not removed, not expired,
//! each once, newest state), `Namespace::import` writes only where nothing is live and
//! refuses what it must, `verify` changes nothing and answers `Locked` while a store
//! is open, and `stats()` counts operations by answer and reports the reaper's lag.

use std::collections::BTreeMap;
use std::time::Duration;

use idemstore::{Begin, Error, Imported, ManualClock, Policy, Record, Status, Store, UnixMs};

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

#[test]
fn import_writes_only_where_nothing_is_live_and_refuses_bad_records() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    let store = open(dir.path(), &clock);
    let ns = store
        .namespace("ns", Policy::ttl(Duration::from_secs(60)))
        .unwrap();
    let completed = Record {
        status: Status::Completed,
        first_seen: UnixMs(START.0 - 5_000),
        // On a bucket boundary (1 min): kept exactly.
        expires_at: UnixMs(1_700_000_640_000),
        attempts: 2,
        lease_until: None,
        completed_at: Some(UnixMs(START.0 - 1_000)),
        result: Some(b"done".to_vec()),
    };
    assert_eq!(ns.import("a", &completed).unwrap(), Imported::Written);
    assert_eq!(ns.get("a").unwrap().as_ref(), Some(&completed));
    assert!(matches!(ns.begin("a").unwrap(), Begin::Completed(r) if r == completed));
    assert_eq!(ns.import("a", &completed).unwrap(), Imported::AlreadyLive);

    assert!(ns.check_and_set("b").unwrap().is_first());
    let before = ns.get("b").unwrap();
    assert_eq!(ns.import("b", &completed).unwrap(), Imported::AlreadyLive);
    assert_eq!(ns.get("b").unwrap(), before, "a live key was overwritten");

    // Between boundaries: rounded up to the next one, never down.
    let unaligned = Record {
        expires_at: UnixMs(1_700_000_600_001),
        ..completed.clone()
    };
    assert_eq!(ns.import("g", &unaligned).unwrap(), Imported::Written);
    assert_eq!(
        ns.get("g").unwrap().unwrap().expires_at,
        UnixMs(1_700_000_640_000)
    );

    let expired = Record {
        expires_at: START,
        ..completed.clone()
    };
    assert_eq!(ns.import("c", &expired).unwrap(), Imported::Expired);
    assert_eq!(ns.get("c").unwrap(), None);

    let seen_with_result = Record {
        status: Status::Seen,
        ..completed.clone()
    };
    assert!(matches!(
        ns.import("d", &seen_with_result),
        Err(Error::InvalidOption { .. })
    ));
    let no_lease = Record {
        status: Status::InProgress,
        result: None,
        ..completed.clone()
    };
    assert!(matches!(
        ns.import("d", &no_lease),
        Err(Error::InvalidOption { .. })
    ));
    let too_late = Record {
        expires_at: UnixMs(START.0 + 500 * 86_400_000),
        ..completed.clone()
    };
    assert!(matches!(
        ns.import("d", &too_late),
        Err(Error::InvalidTtl { .. })
    ));
    assert_eq!(ns.get("d").unwrap(), None);

    // An imported in-progress claim holds its lease, then can be re-acquired.
    let held = Record {
        status: Status::InProgress,
        lease_until: Some(UnixMs(START.0 + 30_000)),
        completed_at: None,
        result: None,
        ..completed.clone()
    };
    assert_eq!(ns.import("e", &held).unwrap(), Imported::Written);
    assert!(matches!(ns.begin("e").unwrap(), Begin::InProgress(_)));
    clock.advance(Duration::from_secs(31));
    match ns.begin("e").unwrap() {
        Begin::Acquired(claim) => assert_eq!(claim.attempt(), 3),
        other => panic!("{other:?}"),
    }

    // Imports survive a reopen.
    store.close().unwrap();
    let store = open(dir.path(), &clock);
    let ns = store
        .namespace("ns", Policy::ttl(Duration::from_secs(60)))
        .unwrap();
    assert_eq!(ns.get("a").unwrap().as_ref(), Some(&completed));
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

#[test]
fn stats_count_operations_by_answer_and_report_the_expiry_lag() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(START);
    let store = Store::builder(dir.path())
        .clock(clock.clone())
        .bucket_width(Duration::from_secs(3600))
        .open()
        .unwrap();
    let ns = store
        .namespace(
            "ns",
            Policy::ttl(Duration::from_secs(60))
                .lease(Duration::from_secs(10))
                .max_attempts(1),
        )
        .unwrap();
    for i in 0..20 {
        assert!(ns.check_and_set(format!("k{i}")).unwrap().is_first());
    }
    assert!(!ns.check_and_set("k0").unwrap().is_first());
    let outcomes = ns.check_and_set_many(&["k1", "new"]).unwrap();
    assert_eq!(outcomes.iter().filter(|o| o.is_first()).count(), 1);
    let Begin::Acquired(claim) = ns.begin("c").unwrap() else {
        panic!()
    };
    assert!(matches!(ns.begin("c").unwrap(), Begin::InProgress(_)));
    claim.release().unwrap();
    assert!(matches!(ns.begin("c").unwrap(), Begin::Exhausted(_)));
    assert!(matches!(ns.begin("k0").unwrap(), Begin::Completed(_)));
    let Begin::Acquired(claim) = ns.begin("d").unwrap() else {
        panic!()
    };
    claim.complete(None).unwrap();
    let Begin::Acquired(claim) = ns.begin("f").unwrap() else {
        panic!()
    };
    claim.fail().unwrap();
    assert!(ns.remove("k5").unwrap());

    let ops = store.stats().operations;
    assert_eq!(
        (ops.check_and_set_first, ops.check_and_set_duplicate),
        (21, 2)
    );
    assert_eq!(
        (
            ops.begin_acquired,
            ops.begin_in_progress,
            ops.begin_completed,
            ops.begin_exhausted
        ),
        (3, 1, 1, 1)
    );
    assert_eq!(
        (ops.complete, ops.release, ops.fail, ops.remove),
        (1, 1, 1, 1)
    );
    // 21 single check_and_set calls and 6 begins on this thread: sampled one in 8.
    let timed = ops.check_and_set_latency.count() + ops.begin_latency.count();
    assert!((2..=4).contains(&timed), "{timed} calls timed of 27");
    assert!(
        ops.check_and_set_latency.count() == 0 || ops.check_and_set_latency.p99() > Duration::ZERO
    );

    assert_eq!(store.stats().expiry_lag, Duration::ZERO);
    // Past the one-hour bucket's deadline by 90 s: the reaper (woken every 1 s) may
    // not have run yet; after expire_now it is caught up.
    clock.advance(Duration::from_secs(3600 + 90));
    let lag = store.stats().expiry_lag;
    assert!(
        lag == Duration::ZERO || lag >= Duration::from_secs(90),
        "{lag:?}"
    );
    store.expire_now().unwrap();
    assert_eq!(store.stats().expiry_lag, Duration::ZERO);
}
