//! The corruption matrix (docs/RELIABILITY.md §5): every kind of damage a crash, a bad
//! disk or an operator can do to a closed store directory, each applied to its own copy
//! of one pristine store and followed by a reopen.
//!
//! The pristine store (manual clock, 64 KiB segments, one shard so one log stripe) holds
//! marks, completed claims with results, claims still in progress and removed keys in two
//! namespaces with different ttls: two buckets and several segments. Before damaging
//! anything the test reads every key's exact `Record` and, by scanning each segment with
//! the same decoder recovery uses, which records (and so which keys) live at which bytes.
//!
//! The damage: truncating the last segment at every byte of its last records and of its
//! header, and a middle segment at sampled bytes; flipping one bit at every 509th byte of
//! every segment plus a seeded sample (each flip its own reopen); zeroing or overwriting
//! sampled 512-byte sectors; deleting, duplicating (under a higher seq, with the header
//! disagreeing and agreeing) and renaming segments; foreign files (including a directory
//! named like a segment); removing `NAMESPACES` or `LOCK`; and flipping every bit... of
//! every byte of `NAMESPACES`.
//!
//! What must hold: the open either succeeds or returns a typed error (`Corruption` with
//! the right file and offset); it never panics. After a successful open, every key none of
//! whose records overlaps the damage reads back exactly as before, no key absent before
//! appears, damage is counted exactly (`corrupt_records_skipped` / `torn_tails_cut`), and
//! the store accepts writes. Truncation at or after the end of the last complete record
//! (damage confined to the unsynced tail) keeps every key. `strict(true)` turns each
//! counted corruption into `Error::Corruption` naming the file and offset.
//!
//! Sampled parts use a seed printed at the start and taken from `IDEMSTORE_SEED` if set.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Policy, Record, Store, UnixMs, fuzzing};

mod support;

const START_MS: u64 = 1_700_000_000_000;
const SEGMENT_SIZE: u64 = 64 * 1024;
/// (name, ttl): the namespace ids are their positions.
const NAMESPACES: [(&str, u64); 2] = [("orders", 3_600), ("mails", 7_200)];
const ORDERS: usize = 2_600;
const MAILS: usize = 300;

/// A key: (namespace index, id).
type Key = (usize, Vec<u8>);

fn policy(ns: usize) -> Policy {
    Policy::ttl(Duration::from_secs(NAMESPACES[ns].1))
        .lease(Duration::from_secs(30))
        .max_attempts(3)
}

fn order_id(i: usize) -> Vec<u8> {
    // Lengths vary so records do not line up with a period.
    let mut id = format!("order-{i:05}-").into_bytes();
    id.extend(std::iter::repeat_n(b'x', i % 37));
    id
}

fn mail_id(i: usize) -> Vec<u8> {
    format!("mail-{i:04}").into_bytes()
}

/// Ids never written: each must read absent after any damage.
fn never_written() -> Vec<Key> {
    (0..20)
        .flat_map(|i| [(0, format!("never-{i}").into_bytes()), (1, order_id(i))])
        .collect()
}

/// The shared seeded generator (`tests/support`), with indices in `usize`.
struct Rng(support::Rng);

impl Rng {
    fn from_env() -> Rng {
        Rng(support::Rng::new(support::seed("corruption_matrix")))
    }
    fn next(&mut self) -> u64 {
        self.0.next()
    }
    fn below(&mut self, n: usize) -> usize {
        self.0.below(n as u64) as usize
    }
}

/// One record of the pristine store: where it is and whose it is.
#[derive(Debug, Clone)]
struct Located {
    offset: usize,
    len: usize,
    key: Key,
}

/// A segment of the pristine store.
#[derive(Debug, Clone)]
struct SegmentInfo {
    name: String,
    bytes: Vec<u8>,
    records: Vec<Located>,
}

/// The pristine store: its files and every key's expected state.
struct Pristine {
    _dir: tempfile::TempDir,
    files: BTreeMap<String, Vec<u8>>,
    segments: Vec<SegmentInfo>,
    expected: BTreeMap<Key, Option<Record>>,
}

fn open(dir: &Path, strict: bool) -> Result<Store, Error> {
    Store::builder(dir)
        .durability(Durability::Interval(Duration::from_millis(100)))
        .segment_size(SEGMENT_SIZE)
        .shards(1)
        .clock(ManualClock::new(UnixMs(START_MS)))
        .strict(strict)
        .open()
}

fn all_keys() -> Vec<Key> {
    (0..ORDERS)
        .map(|i| (0, order_id(i)))
        .chain((0..MAILS).map(|i| (1, mail_id(i))))
        .chain(never_written())
        .collect()
}

fn read_all(store: &Store) -> BTreeMap<Key, Option<Record>> {
    let namespaces: Vec<_> = (0..NAMESPACES.len())
        .map(|ns| store.namespace(NAMESPACES[ns].0, policy(ns)).unwrap())
        .collect();
    all_keys()
        .into_iter()
        .map(|(ns, id)| {
            let record = namespaces[ns].get(&id).unwrap();
            ((ns, id), record)
        })
        .collect()
}

fn pristine() -> Pristine {
    let dir = tempfile::tempdir().unwrap();
    {
        let store = open(dir.path(), true).unwrap();
        let orders = store.namespace(NAMESPACES[0].0, policy(0)).unwrap();
        let mails = store.namespace(NAMESPACES[1].0, policy(1)).unwrap();
        for i in 0..ORDERS {
            let id = order_id(i);
            match i % 13 {
                0 => match orders.begin(&id).unwrap() {
                    Begin::Acquired(claim) => claim.complete(Some(&id[..8])).unwrap(),
                    other => panic!("{other:?}"),
                },
                5 => match orders.begin(&id).unwrap() {
                    Begin::Acquired(claim) => std::mem::forget(claim), // held at the close
                    other => panic!("{other:?}"),
                },
                9 => {
                    assert!(orders.check_and_set(&id).unwrap().is_first());
                    assert!(orders.remove(&id).unwrap());
                }
                _ => assert!(orders.check_and_set(&id).unwrap().is_first()),
            }
            if i % 8 == 0 && i / 8 < MAILS {
                assert!(mails.check_and_set(mail_id(i / 8)).unwrap().is_first());
            }
        }
        drop((orders, mails));
        store.close().unwrap();
    }
    let store = open(dir.path(), true).unwrap();
    let expected = read_all(&store);
    store.close().unwrap();
    drop(store);

    let mut files = BTreeMap::new();
    let mut segments = Vec::new();
    for entry in fs::read_dir(dir.path()).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap().to_string();
        if name == "LOCK" {
            continue;
        }
        let bytes = fs::read(&path).unwrap();
        if fuzzing::parse_segment_file_name(&name).is_some() {
            let scan = fuzzing::scan_segment(&bytes, fuzzing::SEGMENT_HEADER_LEN);
            assert!(scan.corrupt_offsets.is_empty() && !scan.torn_tail);
            assert_eq!(scan.valid_end, bytes.len(), "{name} is trimmed at close");
            let records = scan
                .records
                .iter()
                .map(|&(offset, len)| {
                    let record = fuzzing::decode_record(&bytes[offset..]).unwrap();
                    Located {
                        offset,
                        len,
                        key: (record.namespace_id as usize, record.id),
                    }
                })
                .collect();
            segments.push(SegmentInfo {
                name: name.clone(),
                bytes: bytes.clone(),
                records,
            });
        }
        files.insert(name, bytes);
    }
    segments.sort_by_key(|s| fuzzing::parse_segment_file_name(&s.name).unwrap().1);
    assert!(
        segments.len() >= 4,
        "the matrix needs several segments in two buckets, got {}",
        segments.len()
    );
    let deadlines: BTreeSet<u64> = segments
        .iter()
        .map(|s| fuzzing::parse_segment_file_name(&s.name).unwrap().0)
        .collect();
    assert_eq!(deadlines.len(), 2);
    let live = expected.values().filter(|r| r.is_some()).count();
    assert!(live > ORDERS, "pristine store holds {live} keys");
    Pristine {
        _dir: dir,
        files,
        segments,
        expected,
    }
}

impl Pristine {
    /// A fresh copy of the pristine directory.
    fn copy(&self) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (name, bytes) in &self.files {
            fs::write(dir.path().join(name), bytes).unwrap();
        }
        dir
    }

    /// The keys with a record overlapping `range` of segment `segment`.
    fn touched(&self, segment: usize, range: std::ops::Range<usize>) -> BTreeSet<Key> {
        let info = &self.segments[segment];
        if range.start < fuzzing::SEGMENT_HEADER_LEN {
            return info.records.iter().map(|r| r.key.clone()).collect();
        }
        info.records
            .iter()
            .filter(|r| r.offset < range.end && r.offset + r.len > range.start)
            .map(|r| r.key.clone())
            .collect()
    }

    fn segment_keys(&self, segment: usize) -> BTreeSet<Key> {
        self.touched(segment, 0..usize::MAX)
    }

    /// Checks a store opened on damaged files: every key not in `touched` reads back
    /// exactly as before, no absent key appears, and the store accepts writes.
    #[track_caller]
    fn check(&self, store: &Store, touched: &BTreeSet<Key>, case: &str) {
        let now = read_all(store);
        for (key, before) in &self.expected {
            let after = &now[key];
            if touched.contains(key) {
                // Lost, or rolled back to an older record of the key (a removed key whose
                // tombstone is damaged is remembered again as it was before `remove`).
                // Keys never written are never touched: checked below like the rest.
                continue;
            }
            assert_eq!(after, before, "{case}: untouched key {key:?} changed");
        }
        let ns = store.namespace(NAMESPACES[0].0, policy(0)).unwrap();
        assert!(
            ns.check_and_set(format!("after-{case}"))
                .unwrap()
                .is_first()
        );
        if let Some(key) = touched.iter().find(|k| k.0 == 0) {
            let _ = ns.check_and_set(&key.1).unwrap();
        }
    }
}

/// Opens strict, then default, on damage that must be counted: strict refuses with
/// `Corruption` at `file`/`offset`; the default open counts `corrupt` and `torn`.
#[track_caller]
fn expect_counted(
    pristine: &Pristine,
    dir: &Path,
    file: &str,
    (offset, corrupt, torn): (u64, u64, u64),
    touched: &BTreeSet<Key>,
    case: &str,
) {
    if corrupt > 0 {
        match open(dir, true) {
            Err(Error::Corruption(c)) => {
                assert_eq!(c.file(), dir.join(file), "{case}");
                assert_eq!(c.offset(), offset, "{case}");
            }
            other => panic!("{case}: strict open gave {other:?}"),
        }
    }
    let store = open(dir, false).unwrap_or_else(|e| panic!("{case}: open failed: {e}"));
    let stats = store.stats();
    assert_eq!(
        stats.corrupt_records_skipped, corrupt,
        "{case}: corrupt count"
    );
    assert_eq!(stats.torn_tails_cut, torn, "{case}: torn tails");
    pristine.check(&store, touched, case);
    store.close().unwrap();
}

#[test]
fn truncating_the_last_segment_at_every_byte_of_its_last_records() {
    let p = pristine();
    let last = p.segments.len() - 1;
    let info = &p.segments[last];
    let len = info.bytes.len();
    let from = info.records[info.records.len() - 4].offset;
    let cuts = (0..=fuzzing::SEGMENT_HEADER_LEN).chain(from..=len);
    let mut count = 0;
    for cut in cuts {
        count += 1;
        let dir = p.copy();
        let path = dir.path().join(&info.name);
        fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(cut as u64)
            .unwrap();
        let case = format!("{} cut at {cut}", info.name);
        if cut == 0 {
            // A crash right after creating the file: deleted, nothing in it counted.
            expect_counted(
                &p,
                dir.path(),
                &info.name,
                (0, 0, 0),
                &p.segment_keys(last),
                &case,
            );
            assert!(!path.exists(), "{case}: the empty segment is deleted");
        } else if cut < fuzzing::SEGMENT_HEADER_LEN {
            expect_counted(
                &p,
                dir.path(),
                &info.name,
                (0, 1, 0),
                &p.segment_keys(last),
                &case,
            );
        } else if cut == fuzzing::SEGMENT_HEADER_LEN {
            expect_counted(
                &p,
                dir.path(),
                &info.name,
                (0, 0, 0),
                &p.segment_keys(last),
                &case,
            );
        } else {
            // The unsynced tail: every record ending at or before the cut is kept, the
            // one the cut falls in is lost, and the store opens even in strict mode.
            let on_boundary = info.records.iter().any(|r| r.offset + r.len == cut);
            let touched = p.touched(last, cut..len);
            let store = open(dir.path(), true).unwrap_or_else(|e| panic!("{case}: {e}"));
            assert_eq!(
                store.stats().torn_tails_cut,
                u64::from(!on_boundary),
                "{case}"
            );
            assert_eq!(store.stats().corrupt_records_skipped, 0, "{case}");
            p.check(&store, &touched, &case);
            store.close().unwrap();
        }
    }
    assert!(count > 150, "{count} cuts");
}

#[test]
fn truncating_a_sealed_segment_cuts_only_its_tail() {
    let p = pristine();
    let mut rng = Rng::from_env();
    for segment in 0..p.segments.len() - 1 {
        let info = &p.segments[segment];
        for _ in 0..12 {
            let cut = fuzzing::SEGMENT_HEADER_LEN + 1 + rng.below(info.bytes.len() - 65);
            let dir = p.copy();
            fs::OpenOptions::new()
                .write(true)
                .open(dir.path().join(&info.name))
                .unwrap()
                .set_len(cut as u64)
                .unwrap();
            // Torn unless only zeros follow the last whole record: a cut one byte
            // into a record whose checksum starts with a zero byte is a clean end.
            let whole_end = info
                .records
                .iter()
                .map(|r| r.offset + r.len)
                .filter(|&end| end <= cut)
                .max()
                .unwrap_or(fuzzing::SEGMENT_HEADER_LEN);
            let torn = info.bytes[whole_end..cut].iter().any(|&b| b != 0);
            let case = format!("{} cut at {cut}", info.name);
            let touched = p.touched(segment, cut..info.bytes.len());
            expect_counted(
                &p,
                dir.path(),
                &info.name,
                (0, 0, u64::from(torn)),
                &touched,
                &case,
            );
        }
    }
}

/// The damage a flip (or overwritten region) at `range` of `segment` must be counted as.
fn expected_damage(p: &Pristine, segment: usize, range: std::ops::Range<usize>) -> (u64, u64, u64) {
    let info = &p.segments[segment];
    if range.start < fuzzing::SEGMENT_HEADER_LEN {
        return (0, 1, 0); // header: the segment is skipped, offset 0
    }
    let first = info
        .records
        .iter()
        .find(|r| r.offset + r.len > range.start)
        .expect("range inside the records");
    let last_damaged_end = info
        .records
        .iter()
        .filter(|r| r.offset < range.end)
        .map(|r| r.offset + r.len)
        .max()
        .unwrap();
    if last_damaged_end == info.bytes.len() {
        (first.offset as u64, 0, 1) // nothing valid follows: a torn tail
    } else {
        (first.offset as u64, 1, 0)
    }
}

/// Flip every `STRIDE`th byte (a prime, so the flips walk every field offset of the
/// records) plus `SAMPLES` seeded positions per segment.
const STRIDE: usize = 509;
const SAMPLES: usize = 20;

#[test]
fn flipping_one_bit_anywhere_in_any_segment() {
    let p = pristine();
    let mut rng = Rng::from_env();
    let mut cases = 0;
    for segment in 0..p.segments.len() {
        let info = &p.segments[segment];
        let len = info.bytes.len();
        let mut positions: BTreeSet<usize> = (0..len).step_by(STRIDE).collect();
        positions.extend((0..SAMPLES).map(|_| rng.below(len)));
        positions.insert(len - 1);
        for at in positions {
            let bit = 1u8 << rng.below(8);
            let dir = p.copy();
            let mut bytes = info.bytes.clone();
            bytes[at] ^= bit;
            fs::write(dir.path().join(&info.name), &bytes).unwrap();
            let case = format!("{} bit {bit:#04x} at {at}", info.name);
            let (offset, corrupt, torn) = expected_damage(&p, segment, at..at + 1);
            let touched = p.touched(segment, at..at + 1);
            expect_counted(
                &p,
                dir.path(),
                &info.name,
                (offset, corrupt, torn),
                &touched,
                &case,
            );
            cases += 1;
        }
    }
    eprintln!("{cases} single-bit flips");
    assert!(cases > 400, "{cases} flips");
}

#[test]
fn zeroed_and_garbage_sectors() {
    let p = pristine();
    let mut rng = Rng::from_env();
    for round in 0..24 {
        let segment = rng.below(p.segments.len());
        let info = &p.segments[segment];
        let len = info.bytes.len();
        let start = rng.below(len - 1);
        let end = (start + 512).min(len);
        let mut bytes = info.bytes.clone();
        for b in &mut bytes[start..end] {
            *b = if round % 2 == 0 { 0 } else { rng.next() as u8 };
        }
        // The damage is what changed: zeros written over zeros are no damage.
        let Some(first) = (start..end).find(|&i| bytes[i] != info.bytes[i]) else {
            continue;
        };
        let last = (start..end).rfind(|&i| bytes[i] != info.bytes[i]).unwrap();
        let (start, end) = if round % 2 == 0 && end == len {
            (first, end)
        } else {
            (first, last + 1)
        };
        let dir = p.copy();
        fs::write(dir.path().join(&info.name), &bytes).unwrap();
        let kind = if round % 2 == 0 { "zeroed" } else { "garbage" };
        let case = format!("{} {kind} {start}..{end}", info.name);
        let touched = p.touched(segment, start..end);
        if start >= fuzzing::SEGMENT_HEADER_LEN && end == len && round % 2 == 0 {
            // Zeros to the end: from a record boundary they are the preallocated clean
            // end; from inside a record they leave its written prefix, exactly what a
            // torn write leaves. Either way the tail is cut without an error.
            let at_boundary = info.records.iter().any(|r| r.offset == start);
            let store = open(dir.path(), true).unwrap();
            assert_eq!(
                store.stats().torn_tails_cut,
                u64::from(!at_boundary),
                "{case}"
            );
            p.check(&store, &touched, &case);
            store.close().unwrap();
            continue;
        }
        let (offset, corrupt, torn) = expected_damage(&p, segment, start..end);
        expect_counted(
            &p,
            dir.path(),
            &info.name,
            (offset, corrupt, torn),
            &touched,
            &case,
        );
    }
}

#[test]
fn a_deleted_segment_loses_only_its_own_keys() {
    let p = pristine();
    for segment in 0..p.segments.len() {
        let dir = p.copy();
        fs::remove_file(dir.path().join(&p.segments[segment].name)).unwrap();
        // No manifest lists the segments, so a deleted one cannot be detected: its keys
        // are gone (a known limit), and nothing else may change.
        let case = format!("deleted {}", p.segments[segment].name);
        expect_counted(
            &p,
            dir.path(),
            "",
            (0, 0, 0),
            &p.segment_keys(segment),
            &case,
        );
    }
}

#[test]
fn a_duplicated_segment_changes_nothing() {
    let p = pristine();
    let max_seq = p
        .segments
        .iter()
        .map(|s| fuzzing::parse_segment_file_name(&s.name).unwrap().1)
        .max()
        .unwrap();
    for segment in 0..p.segments.len() {
        let info = &p.segments[segment];
        let (deadline, _) = fuzzing::parse_segment_file_name(&info.name).unwrap();
        let copy_name = fuzzing::segment_file_name(deadline, max_seq + 1);

        // A plain copy: its header names the original seq, so it is counted and skipped.
        let dir = p.copy();
        fs::write(dir.path().join(&copy_name), &info.bytes).unwrap();
        let case = format!("{} copied as {copy_name}", info.name);
        expect_counted(
            &p,
            dir.path(),
            &copy_name,
            (0, 1, 0),
            &BTreeSet::new(),
            &case,
        );
        assert_eq!(
            fs::read(dir.path().join(&copy_name)).unwrap(),
            info.bytes,
            "{case}: kept"
        );

        // A copy whose header agrees with its new name: every record replayed twice,
        // the first replay wins, nothing changes, and expiry deletes both copies.
        let dir = p.copy();
        let mut bytes = info.bytes.clone();
        let mut header = fuzzing::decode_segment_header(&bytes).unwrap();
        header.segment_seq = max_seq + 1;
        bytes[..fuzzing::SEGMENT_HEADER_LEN]
            .copy_from_slice(&fuzzing::encode_segment_header(header));
        fs::write(dir.path().join(&copy_name), &bytes).unwrap();
        let case = format!("{} duplicated as {copy_name}", info.name);
        let store = open(dir.path(), true).unwrap();
        let stats = store.stats();
        assert_eq!(stats.corrupt_records_skipped, 0, "{case}");
        let total: usize = p.segments.iter().map(|s| s.records.len()).sum();
        assert_eq!(
            stats.records_replayed as usize,
            total + info.records.len(),
            "{case}"
        );
        p.check(&store, &BTreeSet::new(), &case);
        store.close().unwrap();
        let clock = ManualClock::new(UnixMs(START_MS + 3 * 3_600_000));
        let store = Store::builder(dir.path())
            .segment_size(SEGMENT_SIZE)
            .shards(1)
            .clock(clock)
            .open()
            .unwrap();
        assert_eq!(store.stats().live_keys, 0, "{case}: expired");
        store.close().unwrap();
        assert!(
            !dir.path().join(&copy_name).exists(),
            "{case}: expired copy deleted"
        );
    }
}

#[test]
fn a_renamed_segment_is_counted_and_kept() {
    let p = pristine();
    for segment in 0..p.segments.len() {
        let info = &p.segments[segment];
        let (deadline, seq) = fuzzing::parse_segment_file_name(&info.name).unwrap();
        for new_name in [
            fuzzing::segment_file_name(deadline, seq + 1_000),
            fuzzing::segment_file_name(deadline + 60_000, seq),
        ] {
            let dir = p.copy();
            fs::rename(dir.path().join(&info.name), dir.path().join(&new_name)).unwrap();
            let case = format!("{} renamed {new_name}", info.name);
            expect_counted(
                &p,
                dir.path(),
                &new_name,
                (0, 1, 0),
                &p.segment_keys(segment),
                &case,
            );
            assert_eq!(
                fs::read(dir.path().join(&new_name)).unwrap(),
                info.bytes,
                "{case}"
            );
        }
        // Renamed to a deadline in the past: by its name the bucket has expired, so it
        // is deleted unread (recovery case 1), like any expired segment.
        let dir = p.copy();
        let past = fuzzing::segment_file_name(START_MS - 60_000, seq);
        fs::rename(dir.path().join(&info.name), dir.path().join(&past)).unwrap();
        let case = format!("{} renamed into the past", info.name);
        expect_counted(
            &p,
            dir.path(),
            &past,
            (0, 0, 0),
            &p.segment_keys(segment),
            &case,
        );
        assert!(!dir.path().join(&past).exists());
    }
}

#[test]
fn foreign_files_and_directories_are_ignored() {
    let p = pristine();
    let dir = p.copy();
    let segment_like = fuzzing::segment_file_name(START_MS + 3_600_000, 9_999);
    fs::create_dir(dir.path().join(&segment_like)).unwrap();
    fs::write(dir.path().join(&segment_like).join("x"), b"x").unwrap();
    fs::write(dir.path().join("NAMESPACES.bak"), b"IDEMNSP\0").unwrap();
    fs::write(dir.path().join(".hidden"), [0xA1u8; 100]).unwrap();
    fs::write(dir.path().join("LOCK.old"), b"").unwrap();
    std::os::unix::fs::symlink("/nonexistent", dir.path().join("dangling")).unwrap();
    let store = open(dir.path(), true).unwrap_or_else(|e| panic!("foreign files: {e}"));
    assert_eq!(store.stats().foreign_files, 5);
    p.check(&store, &BTreeSet::new(), "foreign files");
    store.close().unwrap();
    assert!(dir.path().join(&segment_like).join("x").exists());
    assert!(dir.path().join("LOCK.old").exists());
    assert!(fs::symlink_metadata(dir.path().join("dangling")).is_ok());
}

#[test]
fn a_missing_namespaces_file_refuses_the_open_and_changes_no_segment() {
    let p = pristine();
    let dir = p.copy();
    fs::remove_file(dir.path().join("NAMESPACES")).unwrap();
    for strict in [true, false] {
        match open(dir.path(), strict) {
            // Skipping the records would let the next namespace created take id 0 and
            // inherit them: refused in both modes, naming a segment and a record.
            Err(Error::Corruption(c)) => {
                assert!(c.reason().contains("NAMESPACES"), "{}", c.reason());
                assert!(
                    p.segments
                        .iter()
                        .any(|s| c.file() == dir.path().join(&s.name))
                );
            }
            other => panic!("strict {strict}: {other:?}"),
        }
    }
    for info in &p.segments {
        assert_eq!(fs::read(dir.path().join(&info.name)).unwrap(), info.bytes);
    }
    // Restoring the file restores everything.
    fs::write(dir.path().join("NAMESPACES"), &p.files["NAMESPACES"]).unwrap();
    let store = open(dir.path(), true).unwrap();
    p.check(&store, &BTreeSet::new(), "NAMESPACES restored");
    store.close().unwrap();
}

#[test]
fn every_bit_of_the_namespaces_file() {
    let p = pristine();
    let original = &p.files["NAMESPACES"];
    for at in 0..original.len() {
        for bit in 0..8 {
            let dir = p.copy();
            let mut bytes = original.clone();
            bytes[at] ^= 1 << bit;
            fs::write(dir.path().join("NAMESPACES"), &bytes).unwrap();
            let case = format!("NAMESPACES bit {bit} at {at}");
            match open(dir.path(), false) {
                // Only the reserved header word is not checked.
                Ok(store) => {
                    assert!((12..16).contains(&at), "{case}: accepted");
                    p.check(&store, &BTreeSet::new(), &case);
                    store.close().unwrap();
                }
                Err(Error::Corruption(_)) => {
                    assert!(
                        segments_unchanged(&p, dir.path()),
                        "{case}: a refused open changed a segment"
                    );
                    assert_eq!(
                        fs::read(dir.path().join("NAMESPACES")).unwrap(),
                        bytes,
                        "{case}: a refused open changed NAMESPACES"
                    );
                }
                Err(e) => panic!("{case}: {e:?}"),
            }
        }
    }
}

fn segments_unchanged(p: &Pristine, dir: &Path) -> bool {
    p.segments
        .iter()
        .all(|s| fs::read(dir.join(&s.name)).ok().as_ref() == Some(&s.bytes))
}

#[test]
fn a_missing_lock_file_is_recreated() {
    let p = pristine();
    let dir = p.copy();
    let lock: PathBuf = dir.path().join("LOCK");
    assert!(!lock.exists());
    let store = open(dir.path(), true).unwrap();
    assert!(lock.exists());
    assert_eq!(store.stats().foreign_files, 0);
    p.check(&store, &BTreeSet::new(), "no LOCK");
    store.close().unwrap();
}
