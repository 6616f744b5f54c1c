//! Guards `Namespace::import`, the library side of `idemstore import`: under a manual
//! clock, an imported record keeps its state, attempts, result and expiry (rounded up
//! to the bucket width, never down), is written only where no live key is (`AlreadyLive`
//! leaves a live key exactly as it was, so importing twice changes nothing), is skipped
//! when already expired, and an inconsistent record (a mark with a result, a claim in
//! progress without a lease, an expiry past `max_ttl`) is refused with a typed error
//! and writes nothing. An imported claim in progress holds its lease, then is
//! re-acquired with the next attempt; imports survive a reopen.

use std::time::Duration;

use idemstore::{Begin, Error, Imported, ManualClock, Policy, Record, Status, Store, UnixMs};

const START: UnixMs = UnixMs(1_700_000_000_000);

fn open(dir: &std::path::Path, clock: &ManualClock) -> Store {
    Store::builder(dir).clock(clock.clone()).open().unwrap()
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
        partition: None,
        offset: None,
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
