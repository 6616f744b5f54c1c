//! Guards docs/CONTRACT.md §1.3, the bound on bucket deadlines: a record that must be
//! remembered for a span is remembered at least that long and at most
//! `max(bucket_width, span / 1024)` longer, so a trickle of writes with a long ttl
//! fills a bounded number of buckets (≤ ~2,048 per span) instead of one per bucket
//! width. The tests write one key a minute under a manual clock and check every
//! `expires_at` against the bound and the number of buckets the store holds.

use std::time::Duration;

use idemstore::{Begin, Durability, ManualClock, Outcome, Policy, Store, UnixMs};

const WIDTH_MS: u64 = 60_000;
const START_MS: u64 = 1_700_000_000_000;

fn open(dir: &std::path::Path, clock: &ManualClock) -> Store {
    Store::builder(dir)
        .durability(Durability::None)
        .bucket_width(Duration::from_millis(WIDTH_MS))
        .clock(clock.clone())
        .open()
        .unwrap()
}

/// Writes one key a minute for `minutes` with `ttl`; returns each key's lateness
/// (`expires_at - (now + ttl)`) and the store's bucket count at the end.
fn trickle(ttl: Duration, minutes: u64) -> (Vec<u64>, u64) {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock);
    let ns = store.namespace("orders", Policy::ttl(ttl)).unwrap();
    let mut lateness = Vec::new();
    for minute in 0..minutes {
        let now_ms = START_MS + minute * WIDTH_MS + 7_000;
        clock.set(UnixMs(now_ms));
        let id = format!("order-{minute}");
        assert!(ns.check_and_set(&id).unwrap().is_first());
        let Outcome::Duplicate(seen) = ns.check_and_set(&id).unwrap() else {
            panic!("{id} forgotten at once");
        };
        let until_ms = now_ms + ttl.as_millis() as u64;
        assert!(seen.expires_at.0 >= until_ms, "{id} expires before its ttl");
        lateness.push(seen.expires_at.0 - until_ms);
    }
    let buckets = store.stats().buckets;
    (lateness, buckets)
}

fn bound_ms(ttl: Duration) -> u64 {
    WIDTH_MS.max(ttl.as_millis() as u64 / 1024)
}

#[test]
fn a_400_day_ttl_trickle_fills_a_bucket_per_9_hours_not_per_minute() {
    let ttl = Duration::from_secs(400 * 24 * 3600);
    let (lateness, buckets) = trickle(ttl, 24 * 60);
    assert!(lateness.iter().all(|&l| l <= bound_ms(ttl)), "{lateness:?}");
    // 400 days / 1024 = 9.375 h, rounded down to whole minutes: 562 min. One day of
    // writes spans at most 4 such buckets (it was 1,440 with 1-minute rounding).
    assert!(buckets <= 4, "{buckets} buckets for one day of writes");
}

#[test]
fn a_48_hour_ttl_is_at_most_169_seconds_late() {
    let ttl = Duration::from_secs(48 * 3600);
    let (lateness, buckets) = trickle(ttl, 240);
    assert!(bound_ms(ttl) <= 169_000);
    assert!(lateness.iter().all(|&l| l <= bound_ms(ttl)), "{lateness:?}");
    // 48 h / 1024 = 168.75 s: deadlines on 2-minute steps, 240 minutes of writes.
    assert!(buckets <= 121, "{buckets} buckets");
}

#[test]
fn short_ttls_keep_the_bucket_width() {
    let ttl = Duration::from_secs(3600);
    let (lateness, buckets) = trickle(ttl, 30);
    assert!(lateness.iter().all(|&l| l < WIDTH_MS), "{lateness:?}");
    assert_eq!(buckets, 30);
}

#[test]
fn a_long_lease_is_rounded_by_its_own_span() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS + 7_000));
    let store = open(dir.path(), &clock);
    let lease = Duration::from_secs(30 * 24 * 3600);
    let ns = store
        .namespace("jobs", Policy::ttl(Duration::from_secs(60)).lease(lease))
        .unwrap();
    let Begin::Acquired(claim) = ns.begin("job").unwrap() else {
        panic!("not acquired");
    };
    let record = ns.get("job").unwrap().unwrap();
    let lease_until = claim.lease_until().0;
    assert!(record.expires_at.0 >= lease_until);
    assert!(record.expires_at.0 - lease_until <= bound_ms(lease));
    claim.release().unwrap();
}
