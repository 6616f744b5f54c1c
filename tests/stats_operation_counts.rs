//! Guards what `stats()` reports about operations: the counts of every answer
//! (`check_and_set` first / duplicate, including a batch; `begin` acquired, in
//! progress, completed, exhausted; complete, release, fail, remove), the sampled
//! latency histograms (one call in `LATENCY_SAMPLE_EVERY` timed per thread), and the
//! reaper's lag behind the clock, which `expire_now` brings back to zero. The test
//! runs a known sequence under a manual clock and compares the exact counts.

use std::time::Duration;

use idemstore::{Begin, ManualClock, Policy, Store, UnixMs};

const START: UnixMs = UnixMs(1_700_000_000_000);

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
