//! Approximate mode (issue 11 item 4, `Policy::approximate`, docs/CONTRACT.md): once a
//! key of an approximate namespace is cold, `check_and_set` answers `LikelyDuplicate`
//! from a trusted filter in RAM, and a fresh key is taken for a duplicate at most at
//! the configured rate. Everything else stays exact: keys in RAM, exact namespaces
//! beside it (never `LikelyDuplicate`), `get`, the counts, expiry, a reopen, `verify`.

use std::time::Duration;

use idemstore::{
    APPROXIMATE_RATE_MIN, Durability, Error, ManualClock, Outcome, Policy, Status, Store, UnixMs,
};

const START_MS: u64 = 1_700_000_000_000;
const RATE: f64 = 1e-3;

fn open(dir: &std::path::Path, clock: &ManualClock) -> Store {
    Store::builder(dir)
        .durability(Durability::None)
        .bucket_width(Duration::from_secs(60))
        .shards(4)
        .clock(clock.clone())
        .memory_budget(1)
        .open()
        .unwrap()
}

fn ttl() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

#[test]
fn cold_keys_of_an_approximate_namespace_answer_likely_duplicate_and_fresh_ones_stay_first() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock);
    let approximate = store.namespace("clicks", ttl().approximate(RATE)).unwrap();
    let exact = store.namespace("orders", ttl()).unwrap();
    assert_eq!(approximate.policy().false_duplicate_rate(), Some(RATE));
    assert_eq!(exact.policy().false_duplicate_rate(), None);
    const KEYS: usize = 20_000;
    // The background reaper may spill while these are written (a 1-byte budget): a
    // fresh key of the approximate namespace may then be a false duplicate already,
    // and such a key is never written. Every answer is counted.
    let (mut likely, mut firsts, mut false_duplicates) = (0usize, 0usize, 0usize);
    let mut written = vec![false; KEYS];
    for (i, written) in written.iter_mut().enumerate() {
        match approximate.check_and_set(format!("a-{i}")).unwrap() {
            Outcome::First => (*written, firsts) = (true, firsts + 1),
            Outcome::LikelyDuplicate => {
                (likely, false_duplicates) = (likely + 1, false_duplicates + 1)
            }
            other => panic!("a-{i}: {other:?}"),
        }
        assert!(exact.check_and_set(format!("e-{i}")).unwrap().is_first());
    }
    // In RAM: exact answers. (A reaper round may spill the key between the two calls:
    // then another key, with the spill seen in the counts.)
    let mut hot_answered = false;
    for n in 0..100 {
        let spilled = store.stats().cold.spilled_keys;
        let key = format!("hot-{n}");
        if !approximate.check_and_set(&key).unwrap().is_first() {
            continue; // a false duplicate, never written
        }
        firsts += 1;
        match approximate.check_and_set(&key).unwrap() {
            Outcome::Duplicate(_) => {
                hot_answered = true;
                break;
            }
            Outcome::LikelyDuplicate if store.stats().cold.spilled_keys > spilled => likely += 1,
            other => panic!("{key} in RAM: {other:?}"),
        }
    }
    assert!(hot_answered, "no key in RAM answered Duplicate");
    store.expire_now().unwrap();
    let cold = store.stats().cold;
    assert_eq!(cold.spilled_keys, (KEYS + firsts) as u64, "{cold:?}");
    for (i, &written) in written.iter().enumerate() {
        match approximate.check_and_set(format!("a-{i}")).unwrap() {
            Outcome::LikelyDuplicate => likely += 1,
            // A key a false duplicate kept out, which the filters now let through.
            Outcome::First if !written => firsts += 1,
            other => panic!("a-{i} (written: {written}): {other:?}"),
        }
        let again = exact.check_and_set(format!("e-{i}")).unwrap();
        assert!(matches!(again, Outcome::Duplicate(_)), "e-{i}: {again:?}");
    }
    // `get` reads the record: exact.
    let record = approximate.get("a-0").unwrap().unwrap();
    assert_eq!(record.status, Status::Seen);
    // Fresh keys: First, but for at most the configured share.
    const FRESH: usize = 200_000;
    for i in 0..FRESH {
        match approximate.check_and_set(format!("fresh-{i}")).unwrap() {
            Outcome::First => firsts += 1,
            Outcome::LikelyDuplicate => {
                (likely, false_duplicates) = (likely + 1, false_duplicates + 1)
            }
            other => panic!("fresh-{i}: {other:?}"),
        }
        // An exact namespace never answers from a filter alone.
        assert!(
            exact
                .check_and_set(format!("fresh-{i}"))
                .unwrap()
                .is_first()
        );
    }
    let rate = false_duplicates as f64 / (KEYS + FRESH) as f64;
    assert!(rate <= RATE, "false-duplicate rate {rate} above {RATE}");
    let stats = store.stats();
    assert_eq!(
        stats.operations.check_and_set_likely_duplicate,
        likely as u64
    );
    // A false duplicate writes nothing: the live keys are the ones answered First.
    assert_eq!(stats.live_keys, (KEYS + FRESH + firsts) as u64, "{stats:?}");
}

#[test]
fn claims_and_removal_are_refused_and_bad_rates_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock);
    let ns = store.namespace("clicks", ttl().approximate(RATE)).unwrap();
    assert!(ns.check_and_set("k").unwrap().is_first());
    for e in [ns.begin("k").unwrap_err(), ns.remove("k").unwrap_err()] {
        assert!(
            matches!(&e, Error::InvalidOption { reason } if reason.contains("approximate")),
            "{e:?}"
        );
    }
    for rate in [0.0, APPROXIMATE_RATE_MIN / 2.0, 1.0, f64::NAN, -1.0] {
        let e = store
            .namespace("other", ttl().approximate(rate))
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidOption { reason } if reason.contains("false_duplicate_rate")),
            "{rate}: {e:?}"
        );
    }
    assert!(
        store
            .namespace("other", ttl().approximate(APPROXIMATE_RATE_MIN))
            .is_ok()
    );
    // The key written before is untouched (in RAM, or spilled by the reaper).
    assert!(matches!(
        ns.check_and_set("k").unwrap(),
        Outcome::Duplicate(_) | Outcome::LikelyDuplicate
    ));
}

/// Expiry: a generation one of whose buckets expired is not trusted (its expired keys
/// answer `First`, as exact ones do; the merges put the short-lived keys' bucket, the
/// smallest, into a generation with long-lived ones), and a dropped generation takes
/// its filter with it.
/// A reopen reuses the generations and their trusted filters; `verify` checks them.
#[test]
fn expiry_and_a_reopen_keep_the_answers_and_verify_checks_the_trusted_filter() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock);
    let ns = store.namespace("clicks", ttl().approximate(RATE)).unwrap();
    let short = ns.with_ttl(Duration::from_secs(1200)).unwrap();
    const PER_BUCKET: usize = 2_000;
    // Half a bucket of short-lived keys: their generation is the smallest, so the
    // first merge takes it with its long-lived neighbours (a merge takes the adjacent
    // run with the fewest entries). (The background reaper may spill some of them
    // first: a later one may then be taken for a duplicate, and is not written.)
    const SHORT: usize = PER_BUCKET / 2;
    let mut short_written = Vec::new();
    for i in 0..SHORT {
        let key = format!("s-{i}");
        match short.check_and_set(&key).unwrap() {
            Outcome::First => short_written.push(key),
            Outcome::LikelyDuplicate => {}
            other => panic!("{key}: {other:?}"),
        }
    }
    assert!(short_written.len() >= SHORT - 20);
    store.expire_now().unwrap();
    // Ten more buckets of long-lived keys, a generation each: merges follow. (A fresh
    // key may be taken for a duplicate here, about 2^-16 a trusted generation: it is
    // not written, and not checked below.)
    let mut written = Vec::new();
    for b in 0..10 {
        clock.advance(Duration::from_secs(60));
        for i in 0..PER_BUCKET {
            let key = format!("l-{b}-{i}");
            match ns.check_and_set(&key).unwrap() {
                Outcome::First => written.push(key),
                Outcome::LikelyDuplicate => {}
                other => panic!("{key}: {other:?}"),
            }
        }
        store.expire_now().unwrap();
    }
    assert!(written.len() >= 10 * PER_BUCKET - 20, "{}", written.len());
    let cold = store.stats().cold;
    assert!(cold.merges > 0 && cold.generations <= 8, "{cold:?}");
    assert_eq!(
        ns.check_and_set(&short_written[1]).unwrap(),
        Outcome::LikelyDuplicate
    );
    store.close().unwrap();
    let report = idemstore::verify(dir.path()).unwrap();
    assert!(
        report.cold_files > 0 && report.problems.is_empty(),
        "{report:?}"
    );

    let store = open(dir.path(), &clock);
    let ns = store.namespace("clicks", ttl().approximate(RATE)).unwrap();
    assert!(store.stats().cold.reused_at_open > 0);
    for key in &short_written {
        assert_eq!(
            ns.check_and_set(key).unwrap(),
            Outcome::LikelyDuplicate,
            "{key}"
        );
    }
    for key in &written {
        assert_eq!(
            ns.check_and_set(key).unwrap(),
            Outcome::LikelyDuplicate,
            "{key}"
        );
    }
    // The short-lived keys' bucket expires; the long-lived ones' do not.
    let generations = store.stats().cold.generations;
    clock.advance(Duration::from_secs(1200));
    store.expire_now().unwrap();
    // Their generation holds live buckets too (merged: no generation was dropped), so
    // it must not be trusted. A fresh key may still meet another generation's false
    // positive (2^-16 each).
    assert_eq!(store.stats().cold.generations, generations);
    let mut likely = 0;
    for i in 0..SHORT {
        assert!(ns.get(format!("s-{i}")).unwrap().is_none(), "s-{i}");
        match ns.check_and_set(format!("s-{i}")).unwrap() {
            Outcome::First => {}
            Outcome::LikelyDuplicate => likely += 1,
            other => panic!("s-{i}: {other:?}"),
        }
    }
    assert!(
        likely <= SHORT / 100,
        "{likely} expired keys answered LikelyDuplicate"
    );
    for key in &written {
        let long = ns.check_and_set(key).unwrap();
        assert!(
            matches!(long, Outcome::LikelyDuplicate | Outcome::Duplicate(_)),
            "{key}: {long:?}"
        );
    }
    store.close().unwrap();
}

/// An exact handle of the same namespace may still remove its keys: the removed key's
/// trusted entry is killed, and the generation stops answering from its trusted filter
/// (the filter cannot forget), so the approximate handle answers exactly there: `First`
/// for the removed key.
#[test]
fn a_key_removed_through_an_exact_handle_is_never_a_likely_duplicate() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock);
    let approximate = store.namespace("clicks", ttl().approximate(RATE)).unwrap();
    let exact = store.namespace("clicks", ttl()).unwrap();
    // (A key taken for a duplicate after a background spill is not written.)
    let mut written = Vec::new();
    for i in 0..1_000 {
        let key = format!("k-{i}");
        match approximate.check_and_set(&key).unwrap() {
            Outcome::First => written.push(key),
            Outcome::LikelyDuplicate => {}
            other => panic!("{key}: {other:?}"),
        }
    }
    let [one, three] = [1, 3].map(|i| written[i].clone());
    store.expire_now().unwrap();
    assert_eq!(
        approximate.check_and_set(&one).unwrap(),
        Outcome::LikelyDuplicate
    );
    assert!(exact.remove(&one).unwrap());
    assert!(exact.remove(&three).unwrap());
    // The tombstones are spilled too: they are not trusted.
    store.expire_now().unwrap();
    assert!(approximate.check_and_set(&one).unwrap().is_first());
    // The same after a reopen (the state's dead bits do not say which entries were
    // trusted: a generation with a dead entry is not trusted).
    store.close().unwrap();
    let store = open(dir.path(), &clock);
    let approximate = store.namespace("clicks", ttl().approximate(RATE)).unwrap();
    assert!(store.stats().cold.reused_at_open > 0);
    assert!(approximate.check_and_set(&three).unwrap().is_first());
    // Their neighbours answer exactly until a merge rewrites the generation. (Which
    // keys share it depends on where a reaper round split the writes: some do.)
    let exactly = written
        .iter()
        .filter(|k| **k != one && **k != three)
        .map(|k| approximate.check_and_set(k).unwrap())
        .filter(|answer| matches!(answer, Outcome::Duplicate(_)))
        .count();
    assert!(
        exactly > 0,
        "every key of a generation with a killed entry answered from its filter"
    );
    store.close().unwrap();
}
