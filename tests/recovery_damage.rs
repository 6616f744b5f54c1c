//! Guards recovery from damaged files (docs/CONTRACT.md §3.3): a torn tail is cut
//! silently, a corrupt record elsewhere is skipped and counted (or, with
//! `strict(true)`, refused with `Error::Corruption` naming the file and offset),
//! foreign files are counted and never touched, and segments whose bucket has expired
//! are deleted at open.
//!
//! Each test writes a store under a manual clock, closes it, damages the files on disk
//! the way a crash or a bad disk would, reopens it and checks exactly which keys
//! survived and what `stats()` reports. The records' offsets are computed from the
//! format in `src/format/record.rs`: a 64-byte segment header, then for a mark a
//! 32-byte record header followed by the id.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idemstore::{Durability, Error, ManualClock, Policy, Store, UnixMs};

const START_MS: u64 = 1_700_000_000_000;
const SEGMENT_HEADER_LEN: u64 = 64;
const RECORD_HEADER_LEN: u64 = 32;
const KEYS: usize = 100;

fn id(i: usize) -> String {
    format!("key-{i:03}")
}

/// Length of one mark record of `id(i)`.
const MARK_LEN: u64 = RECORD_HEADER_LEN + 7;

fn mark_offset(i: usize) -> u64 {
    SEGMENT_HEADER_LEN + MARK_LEN * i as u64
}

fn open(dir: &Path, clock: &ManualClock, strict: bool) -> Result<Store, Error> {
    // One shard, so one log stripe: every bucket is a single segment whose record
    // offsets the tests can compute.
    Store::builder(dir)
        .shards(1)
        .durability(Durability::None)
        .bucket_width(Duration::from_secs(1))
        .clock(clock.clone())
        .strict(strict)
        .open()
}

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

/// A closed store with `KEYS` marks in one segment; returns that segment's path.
fn write_marks(dir: &Path, clock: &ManualClock) -> PathBuf {
    let store = open(dir, clock, false).unwrap();
    let ns = store.namespace("damage", policy()).unwrap();
    for i in 0..KEYS {
        assert!(ns.check_and_set(id(i)).unwrap().is_first());
    }
    drop(ns);
    store.close().unwrap();
    let segments = segments(dir);
    assert_eq!(segments.len(), 1, "{segments:?}");
    assert_eq!(fs::metadata(&segments[0]).unwrap().len(), mark_offset(KEYS));
    segments[0].clone()
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            // `<16 hex deadline>-<16 hex seq>.seg`; other names are foreign files.
            let name = p.file_name().unwrap().to_str().unwrap();
            name.len() == 37 && name.ends_with(".seg") && name.as_bytes()[16] == b'-'
        })
        .collect();
    found.sort();
    found
}

/// The keys in `0..KEYS` the store remembers.
fn remembered(store: &Store) -> Vec<usize> {
    let ns = store.namespace("damage", policy()).unwrap();
    (0..KEYS)
        .filter(|&i| ns.get(id(i)).unwrap().is_some())
        .collect()
}

fn all_but(missing: &[usize]) -> Vec<usize> {
    (0..KEYS).filter(|i| !missing.contains(i)).collect()
}

#[test]
fn a_tail_torn_mid_record_is_cut_and_the_records_before_it_kept() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let segment = write_marks(dir.path(), &clock);
    // Cut the last record in the middle of its id.
    let file = fs::OpenOptions::new().write(true).open(&segment).unwrap();
    file.set_len(mark_offset(KEYS - 1) + RECORD_HEADER_LEN + 3)
        .unwrap();
    drop(file);

    let store = open(dir.path(), &clock, true).unwrap();
    let stats = store.stats();
    assert_eq!(stats.torn_tails_cut, 1);
    assert_eq!(stats.corrupt_records_skipped, 0);
    assert_eq!(stats.records_replayed, KEYS as u64 - 1);
    assert_eq!(remembered(&store), all_but(&[KEYS - 1]));
    // The store keeps working and the cut tail does not come back.
    let ns = store.namespace("damage", policy()).unwrap();
    assert!(ns.check_and_set(id(KEYS - 1)).unwrap().is_first());
    assert!(ns.check_and_set("after-the-cut").unwrap().is_first());
    drop(ns);
    store.close().unwrap();

    let store = open(dir.path(), &clock, true).unwrap();
    assert_eq!(
        store.stats().torn_tails_cut,
        0,
        "the tail was trimmed by the first open"
    );
    assert_eq!(remembered(&store), all_but(&[]));
    let ns = store.namespace("damage", policy()).unwrap();
    assert!(!ns.check_and_set("after-the-cut").unwrap().is_first());
}

#[test]
fn garbage_after_the_last_record_is_a_torn_tail_and_zeros_are_not() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let segment = write_marks(dir.path(), &clock);
    let mut bytes = fs::read(&segment).unwrap();
    bytes.extend(std::iter::repeat_n(0u8, 4096));
    fs::write(&segment, &bytes).unwrap();
    let store = open(dir.path(), &clock, true).unwrap();
    assert_eq!(
        store.stats().torn_tails_cut,
        0,
        "preallocated zeros are a clean end"
    );
    assert_eq!(remembered(&store), all_but(&[]));
    store.close().unwrap();

    let mut bytes = fs::read(&segment).unwrap();
    bytes.extend((0..300u32).map(|i| (i * 37 + 11) as u8));
    fs::write(&segment, &bytes).unwrap();
    let store = open(dir.path(), &clock, false).unwrap();
    let stats = store.stats();
    assert_eq!(stats.torn_tails_cut, 1);
    assert_eq!(stats.corrupt_records_skipped, 0);
    assert_eq!(remembered(&store), all_but(&[]));
    store.close().unwrap();
    assert_eq!(
        fs::metadata(&segment).unwrap().len(),
        mark_offset(KEYS),
        "the garbage was trimmed"
    );
}

#[test]
fn a_corrupt_record_in_the_middle_is_skipped_and_the_records_after_it_kept() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let segment = write_marks(dir.path(), &clock);
    let original = fs::read(&segment).unwrap();
    let damaged_at = mark_offset(3);
    let mut bytes = original.clone();
    bytes[(damaged_at + RECORD_HEADER_LEN + 2) as usize] ^= 0x5a; // inside the id
    bytes[(damaged_at + 20) as usize] ^= 0x01; // inside the lsn
    fs::write(&segment, &bytes).unwrap();

    // Strict: refused, pointing at the damaged record.
    match open(dir.path(), &clock, true) {
        Err(Error::Corruption(c)) => {
            assert_eq!(c.file(), segment.as_path());
            assert_eq!(c.offset(), damaged_at);
            assert!(!c.reason().is_empty());
        }
        other => panic!("expected Error::Corruption, got {other:?}"),
    }
    assert_eq!(
        fs::read(&segment).unwrap(),
        bytes,
        "a refused strict open must not modify the file"
    );

    // Default: opens, skips exactly that record, keeps every record after it.
    let store = open(dir.path(), &clock, false).unwrap();
    let stats = store.stats();
    assert!(stats.corrupt_records_skipped >= 1);
    assert_eq!(stats.torn_tails_cut, 0);
    assert_eq!(stats.records_replayed, KEYS as u64 - 1);
    assert_eq!(remembered(&store), all_but(&[3]));
    store.close().unwrap();
}

#[test]
fn a_corrupt_segment_header_is_counted_or_refused_in_strict_mode() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let segment = write_marks(dir.path(), &clock);
    let mut bytes = fs::read(&segment).unwrap();
    bytes[33] ^= 0xff; // created_ms
    fs::write(&segment, &bytes).unwrap();
    match open(dir.path(), &clock, true) {
        Err(Error::Corruption(c)) => {
            assert_eq!(c.file(), segment.as_path());
            assert_eq!(c.offset(), 0);
        }
        other => panic!("expected Error::Corruption, got {other:?}"),
    }
    let store = open(dir.path(), &clock, false).unwrap();
    assert_eq!(store.stats().corrupt_records_skipped, 1);
    assert_eq!(remembered(&store), Vec::<usize>::new());
    store.close().unwrap();
    assert_eq!(
        fs::read(&segment).unwrap(),
        bytes,
        "a damaged segment is left for inspection"
    );
}

#[test]
fn foreign_files_are_counted_and_left_untouched() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    write_marks(dir.path(), &clock);
    let foreign: [(&str, &[u8]); 4] = [
        ("notes.txt", b"operator notes"),
        ("backup.seg.old", b"\0\0\0"),
        ("0000000000000001-0000000000000001.seg.tmp", b"IDEMSEG\0"),
        ("abc-def.seg", b"not ours either"),
    ];
    for (name, content) in foreign {
        fs::write(dir.path().join(name), content).unwrap();
    }
    fs::create_dir(dir.path().join("subdir")).unwrap();
    fs::write(dir.path().join("subdir").join("inner.seg"), b"x").unwrap();

    let untouched = || {
        for (name, content) in foreign {
            assert_eq!(
                fs::read(dir.path().join(name)).unwrap(),
                content,
                "{name} was touched"
            );
        }
        assert_eq!(
            fs::read(dir.path().join("subdir").join("inner.seg")).unwrap(),
            b"x"
        );
    };
    let store = open(dir.path(), &clock, true).unwrap();
    assert_eq!(store.stats().foreign_files, 5);
    assert_eq!(store.stats().corrupt_records_skipped, 0);
    assert_eq!(remembered(&store), all_but(&[]));
    clock.advance(Duration::from_secs(7200)); // every key expires
    assert_eq!(store.expire_now().unwrap(), KEYS as u64);
    store.close().unwrap();
    untouched();

    let store = open(dir.path(), &clock, true).unwrap();
    assert_eq!(store.stats().foreign_files, 5);
    assert_eq!(remembered(&store), Vec::<usize>::new());
    store.close().unwrap();
    untouched();
    assert!(
        segments(dir.path()).is_empty(),
        "expired segments are deleted"
    );
}

#[test]
fn expired_segments_are_deleted_at_open_and_live_ones_kept() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    {
        let store = open(dir.path(), &clock, false).unwrap();
        let short = store
            .namespace("short", Policy::ttl(Duration::from_secs(10)))
            .unwrap();
        let long = store
            .namespace("long", Policy::ttl(Duration::from_secs(3600)))
            .unwrap();
        for i in 0..10 {
            assert!(short.check_and_set(id(i)).unwrap().is_first());
            assert!(long.check_and_set(id(i)).unwrap().is_first());
        }
        drop((short, long));
        store.close().unwrap();
    }
    let before = segments(dir.path());
    assert_eq!(before.len(), 2);

    // Reopen just before the short bucket's deadline: nothing is deleted.
    clock.set(UnixMs(START_MS + 9_999));
    let store = open(dir.path(), &clock, true).unwrap();
    assert_eq!(segments(dir.path()), before);
    let short = store
        .namespace("short", Policy::ttl(Duration::from_secs(10)))
        .unwrap();
    assert!(short.get(id(0)).unwrap().is_some());
    drop(short);
    store.close().unwrap();

    // Reopen at the deadline: the short bucket's segment is gone, its keys forgotten.
    clock.set(UnixMs(START_MS + 10_000));
    let store = open(dir.path(), &clock, true).unwrap();
    let after = segments(dir.path());
    assert_eq!(after.len(), 1);
    assert!(before.contains(&after[0]));
    assert_eq!(store.stats().live_keys, 10);
    let short = store
        .namespace("short", Policy::ttl(Duration::from_secs(10)))
        .unwrap();
    let long = store
        .namespace("long", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for i in 0..10 {
        assert!(
            !long.check_and_set(id(i)).unwrap().is_first(),
            "long {i} lost"
        );
        assert!(
            short.check_and_set(id(i)).unwrap().is_first(),
            "short {i} not forgotten"
        );
    }
    drop((short, long));
    store.close().unwrap();
}

#[test]
fn a_clock_behind_the_segments_at_open_does_not_make_keys_expire_early() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    {
        let store = open(dir.path(), &clock, false).unwrap();
        let ns = store
            .namespace("short", Policy::ttl(Duration::from_secs(10)))
            .unwrap();
        clock.advance(Duration::from_secs(5));
        assert!(ns.check_and_set("k").unwrap().is_first());
        drop(ns);
        store.close().unwrap();
    }
    // The clock jumps back an hour: the store's time starts from the segment's
    // creation time instead, so the key still expires at its deadline, not later
    // than ttl + width from when it was first seen, and is remembered until then.
    clock.set(UnixMs(START_MS - 3_600_000));
    let store = open(dir.path(), &clock, true).unwrap();
    let ns = store
        .namespace("short", Policy::ttl(Duration::from_secs(10)))
        .unwrap();
    let record = ns.get("k").unwrap().expect("remembered");
    assert_eq!(record.first_seen, UnixMs(START_MS + 5_000));
    assert_eq!(record.expires_at, UnixMs(START_MS + 15_000));
    // A new key is stamped with the restored time, not the clock's.
    assert!(ns.check_and_set("new").unwrap().is_first());
    assert_eq!(
        ns.get("new").unwrap().unwrap().first_seen,
        UnixMs(START_MS + 5_000)
    );
}
