//! Guards the input limits of docs/CONTRACT.md §4: every bounded input is tried at,
//! just below and just above its bound, through every operation that takes it, and each
//! refusal must be the specific `Error` variant (never a panic, never a truncation).
//! After every refusal the test checks that nothing was lost or half-written: keys
//! stored before are still `Duplicate`, a refused batch marked none of its ids, and a
//! claim whose call was refused still holds its key.

use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Namespace, Policy, Status, Store, UnixMs};

const HOUR: Duration = Duration::from_secs(3600);
const DEFAULT_MAX_TTL: Duration = Duration::from_secs(400 * 24 * 3600);

fn store(dir: &std::path::Path) -> Store {
    Store::builder(dir)
        .durability(Durability::None)
        .clock(ManualClock::new(UnixMs(1_700_000_000_000)))
        .open()
        .unwrap()
}

/// Marks three keys so later checks can see that an error lost nothing.
fn seed(ns: &Namespace) {
    for id in ["kept-1", "kept-2", "kept-3"] {
        assert!(ns.check_and_set(id).unwrap().is_first());
    }
}

fn assert_kept(ns: &Namespace) {
    for id in ["kept-1", "kept-2", "kept-3"] {
        assert!(!ns.check_and_set(id).unwrap().is_first(), "{id} was lost");
    }
}

#[track_caller]
fn assert_invalid_key<T: std::fmt::Debug>(result: Result<T, Error>) {
    assert!(
        matches!(result, Err(Error::InvalidKey { .. })),
        "expected InvalidKey, got {result:?}"
    );
}

#[track_caller]
fn assert_invalid_ttl<T: std::fmt::Debug>(result: Result<T, Error>) {
    assert!(
        matches!(result, Err(Error::InvalidTtl { .. })),
        "expected InvalidTtl, got {result:?}"
    );
}

#[track_caller]
fn assert_invalid_option<T: std::fmt::Debug>(result: Result<T, Error>) {
    assert!(
        matches!(result, Err(Error::InvalidOption { .. })),
        "expected InvalidOption, got {result:?}"
    );
}

#[test]
fn namespace_names_of_0_and_65_bytes_are_refused_1_and_64_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let policy = Policy::ttl(HOUR);
    let base = store.namespace("base", policy).unwrap();
    seed(&base);

    assert_invalid_key(store.namespace("", policy));
    assert_invalid_key(store.namespace(&"n".repeat(65), policy));
    // 65 bytes made of multi-byte characters: the limit is in bytes, not chars.
    assert_invalid_key(store.namespace(&"é".repeat(33), policy));
    assert_kept(&base);

    let one = store.namespace("x", policy).unwrap();
    let max = store.namespace(&"n".repeat(64), policy).unwrap();
    let max_utf8 = store.namespace(&"é".repeat(32), policy).unwrap();
    for ns in [&one, &max, &max_utf8] {
        assert!(ns.check_and_set("id").unwrap().is_first());
        assert!(!ns.check_and_set("id").unwrap().is_first());
    }
    assert_eq!(store.stats().namespaces, 4);
    assert_kept(&base);
    drop((base, one, max, max_utf8));
    store.close().unwrap();

    // The names survive a reopen, byte for byte.
    let store = self::store(dir.path());
    let max = store.namespace(&"n".repeat(64), policy).unwrap();
    assert!(!max.check_and_set("id").unwrap().is_first());
    assert_kept(&store.namespace("base", policy).unwrap());
}

/// Every operation that takes an id refuses 0 and max + 1 bytes and accepts 1 and max.
fn check_id_bounds(ns: &Namespace, max: usize) {
    seed(ns);
    let empty: &[u8] = b"";
    let too_long = vec![b'i'; max + 1];
    for bad in [empty, &too_long[..]] {
        assert_invalid_key(ns.check_and_set(bad));
        assert_invalid_key(ns.check_and_set_many(&[bad]));
        assert_invalid_key(ns.begin(bad));
        assert_invalid_key(ns.begin_with_payload(bad, b"p"));
        assert_invalid_key(ns.get(bad));
        assert_invalid_key(ns.remove(bad));
        assert_invalid_key(ns.with_ttl(HOUR).unwrap().check_and_set(bad));
        // One bad id refuses the whole batch before anything is written.
        assert_invalid_key(ns.check_and_set_many(&[&b"batch-a"[..], bad, b"batch-b"]));
        assert_eq!(ns.get("batch-a").unwrap(), None);
        assert_eq!(ns.get("batch-b").unwrap(), None);
        assert_kept(ns);
    }
    let max_id = vec![b'm'; max];
    for good in [&b"1"[..], &max_id[..]] {
        assert!(ns.check_and_set(good).unwrap().is_first());
        assert!(!ns.check_and_set(good).unwrap().is_first());
        assert_eq!(ns.get(good).unwrap().unwrap().status, Status::Seen);
        assert!(ns.remove(good).unwrap());
        let Begin::Acquired(claim) = ns.begin_with_payload(good, b"p").unwrap() else {
            panic!("a removed key must be acquirable");
        };
        let result = &good[..good.len().min(16)];
        claim.complete(Some(result)).unwrap();
        let Begin::Completed(record) = ns.begin(good).unwrap() else {
            panic!("a completed key must answer Completed");
        };
        assert_eq!(record.result(), Some(result));
    }
    assert_kept(ns);
}

#[test]
fn ids_are_bounded_by_the_default_max_key_len() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    check_id_bounds(&store.namespace("ids", Policy::ttl(HOUR)).unwrap(), 1024);
}

#[test]
fn ids_are_bounded_by_a_custom_max_key_len() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .max_key_len(8)
        .open()
        .unwrap();
    check_id_bounds(&store.namespace("ids", Policy::ttl(HOUR)).unwrap(), 8);

    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .max_key_len(65_535)
        .open()
        .unwrap();
    check_id_bounds(&store.namespace("ids", Policy::ttl(HOUR)).unwrap(), 65_535);
}

/// ttl 0, 999 ms and max + 1 s are refused; 1 s and max are accepted, both in a
/// namespace policy and in the per-call override.
fn check_ttl_bounds(store: &Store, max: Duration) {
    let base = store
        .namespace("ttl-base", Policy::ttl(HOUR.min(max)))
        .unwrap();
    seed(&base);
    for bad in [
        Duration::ZERO,
        Duration::from_millis(999),
        max + Duration::from_secs(1),
    ] {
        assert_invalid_ttl(store.namespace("ttl-bad", Policy::ttl(bad)));
        assert_invalid_ttl(base.with_ttl(bad));
        assert_kept(&base);
    }
    // A ttl that rounds up to max + 1 ms is over the limit too.
    assert_invalid_ttl(base.with_ttl(max + Duration::from_nanos(1)));
    for (i, good) in [Duration::from_secs(1), max].into_iter().enumerate() {
        let ns = store
            .namespace(&format!("ttl-good-{i}"), Policy::ttl(good))
            .unwrap();
        assert!(ns.check_and_set("a").unwrap().is_first());
        assert!(
            base.with_ttl(good)
                .unwrap()
                .check_and_set(format!("b{i}"))
                .unwrap()
                .is_first()
        );
    }
    assert_kept(&base);
}

#[test]
fn ttls_are_bounded_by_1_second_and_the_default_max_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    check_ttl_bounds(&store, DEFAULT_MAX_TTL);
}

#[test]
fn ttls_are_bounded_by_a_custom_max_ttl() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .max_ttl(HOUR)
        .open()
        .unwrap();
    check_ttl_bounds(&store, HOUR);
}

#[test]
fn leases_and_attempts_are_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let policy = Policy::ttl(HOUR);
    let base = store.namespace("base", policy).unwrap();
    seed(&base);
    for bad in [
        Duration::ZERO,
        Duration::from_millis(999),
        DEFAULT_MAX_TTL + Duration::from_secs(1),
    ] {
        assert_invalid_ttl(store.namespace("leases", policy.lease(bad)));
    }
    assert_invalid_option(store.namespace("attempts", policy.max_attempts(0)));
    assert_kept(&base);

    let one_attempt = store
        .namespace(
            "attempts",
            policy.lease(Duration::from_secs(1)).max_attempts(1),
        )
        .unwrap();
    let Begin::Acquired(claim) = one_attempt.begin("x").unwrap() else {
        panic!("must acquire")
    };
    claim.release().unwrap();
    assert!(matches!(one_attempt.begin("x").unwrap(), Begin::Exhausted(r) if r.attempts == 1));
    store
        .namespace("long-lease", policy.lease(DEFAULT_MAX_TTL))
        .unwrap();

    // Claim::extend takes the same bounds; a refused extend keeps the claim.
    let Begin::Acquired(mut claim) = base.begin("extend").unwrap() else {
        panic!("must acquire")
    };
    let lease_until = claim.lease_until();
    for bad in [
        Duration::ZERO,
        Duration::from_millis(999),
        DEFAULT_MAX_TTL + Duration::from_secs(1),
    ] {
        assert_invalid_ttl(claim.extend(bad));
        assert_eq!(claim.lease_until(), lease_until);
    }
    assert!(matches!(
        base.begin("extend").unwrap(),
        Begin::InProgress(_)
    ));
    claim.extend(Duration::from_secs(1)).unwrap();
    claim.extend(DEFAULT_MAX_TTL).unwrap();
    claim.complete(None).unwrap();
    assert_eq!(
        base.get("extend").unwrap().unwrap().status,
        Status::Completed
    );
    assert_kept(&base);
}

fn check_result_bounds(store: &Store, max: usize) {
    let ns = store.namespace("results", Policy::ttl(HOUR)).unwrap();
    seed(&ns);
    let Begin::Acquired(claim) = ns.begin("over").unwrap() else {
        panic!("must acquire")
    };
    let err = claim.complete(Some(&vec![1u8; max + 1])).unwrap_err();
    assert!(
        matches!(err, Error::ResultTooLarge { len, max: m } if len == max + 1 && m == max),
        "{err:?}"
    );
    // The refused claim was released on drop: the key can be acquired again.
    assert_eq!(ns.get("over").unwrap().unwrap().status, Status::Released);
    let Begin::Acquired(claim) = ns.begin("over").unwrap() else {
        panic!("must acquire again")
    };
    assert_eq!(claim.attempt(), 2);
    let at_max = vec![2u8; max];
    claim.complete(Some(&at_max)).unwrap();
    let Begin::Completed(record) = ns.begin("over").unwrap() else {
        panic!("must be completed")
    };
    assert_eq!(record.result(), Some(&at_max[..]));
    assert_kept(&ns);
}

#[test]
fn results_are_bounded_by_the_default_max_result_len() {
    let dir = tempfile::tempdir().unwrap();
    check_result_bounds(&store(dir.path()), 4096);
}

#[test]
fn results_are_bounded_by_a_custom_max_result_len() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .max_result_len(100)
        .open()
        .unwrap();
    check_result_bounds(&store, 100);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .max_result_len(0)
        .open()
        .unwrap();
    check_result_bounds(&store, 0);
}

#[test]
fn a_batch_over_the_limit_is_refused_whole() {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path());
    let ns = store.namespace("batch", Policy::ttl(HOUR)).unwrap();
    seed(&ns);
    let ids: Vec<String> = (0..(1 << 16) + 1).map(|i| format!("b{i}")).collect();
    assert_invalid_option(ns.check_and_set_many(&ids));
    assert_eq!(ns.get("b0").unwrap(), None);
    let outcomes = ns.check_and_set_many(&ids[..1 << 16]).unwrap();
    assert_eq!(outcomes.len(), 1 << 16);
    assert!(outcomes.iter().all(|o| o.is_first()));
    assert!(!ns.check_and_set("b0").unwrap().is_first());
    assert!(ns.check_and_set(&ids[1 << 16]).unwrap().is_first());
    assert_kept(&ns);
}

#[test]
fn invalid_builder_options_are_refused_and_leave_the_store_openable() {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = store(dir.path());
        seed(&store.namespace("base", Policy::ttl(HOUR)).unwrap());
        store.close().unwrap();
    }
    let b = || {
        Store::builder(dir.path())
            .durability(Durability::None)
            .clock(ManualClock::new(UnixMs(1_700_000_000_000)))
    };
    for shards in [0, 3, 6, 100, 1 << 17] {
        assert_invalid_option(b().shards(shards).open());
    }
    assert_invalid_option(b().bucket_width(Duration::from_millis(999)).open());
    assert_invalid_option(b().bucket_width(Duration::ZERO).open());
    assert_invalid_option(b().bucket_width(Duration::from_secs(24 * 3600 + 1)).open());
    assert_invalid_option(b().max_key_len(0).open());
    assert_invalid_option(b().max_key_len(65_536).open());
    assert_invalid_option(b().max_result_len((1 << 20) + 1).open());
    assert_invalid_option(b().max_ttl(Duration::from_millis(999)).open());
    assert_invalid_option(
        b().max_ttl(Duration::from_secs(100 * 366 * 24 * 3600 + 1))
            .open(),
    );
    assert_invalid_option(b().segment_size(64 * 1024 - 1).open());
    assert_invalid_option(b().segment_size((16 << 20) + 1).open());
    // A segment must hold the largest record the key and result limits allow.
    assert_invalid_option(b().segment_size(64 * 1024).max_result_len(64 * 1024).open());
    assert_invalid_option(
        b().segment_size(64 * 1024)
            .max_key_len(65_535)
            .max_result_len(0)
            .open(),
    );
    assert_invalid_option(b().durability(Durability::Interval(Duration::ZERO)).open());
    assert_invalid_option(
        b().durability(Durability::Interval(HOUR + Duration::from_secs(1)))
            .open(),
    );

    // Each bound itself is accepted, and none of the refusals held the lock or lost data.
    for builder in [
        b().shards(1),
        b().shards(1 << 16),
        b().bucket_width(Duration::from_secs(1)),
        b().bucket_width(Duration::from_secs(24 * 3600)),
        b().max_key_len(6).max_result_len(1 << 20),
        b().max_ttl(Duration::from_secs(1)),
        b().segment_size(64 * 1024),
        b().segment_size(16 << 20),
        // 32 + 12 (a partition's scope) + 1024 + 40 + result + 64-byte header == the
        // segment size exactly.
        b().segment_size(64 * 1024)
            .max_result_len(64 * 1024 - 32 - 12 - 1024 - 40 - 64),
        b().durability(Durability::Interval(Duration::from_millis(1))),
    ] {
        let store = builder.open().unwrap();
        let one_second = Duration::from_secs(1);
        let ns = store
            .namespace("base", Policy::ttl(one_second).lease(one_second))
            .unwrap();
        for id in ["kept-1", "kept-2", "kept-3"] {
            assert!(ns.get(id).unwrap().is_some(), "{id} was lost");
        }
        drop(ns);
        store.close().unwrap();
    }
}
