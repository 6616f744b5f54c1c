//! Guards that `verify` and the open can never disagree about a store directory: both
//! apply one survey (`src/recovery/survey.rs`), and this test holds them to it. It
//! also guards that a read-only recovery changes nothing, byte or name.
//!
//! A store is built on the simulator (`idemstore::testing`) under a manual clock: two
//! namespaces whose ttls fall in different buckets, several 64 KiB segments, marks,
//! completed claims with results and removed keys, closed cleanly (so it leaves an
//! index checkpoint). Each case damages its own copy of that image in one of the ways
//! the survey classifies — a foreign file, a directory named like a segment, expired
//! segments (the clock moved on), an all-zero or empty segment, a damaged header, a
//! header that disagrees with its name, a torn tail (cut or garbage), a damaged record
//! valid ones follow, damage inside an expired segment, `NAMESPACES` missing, torn,
//! short of an entry or damaged, a bit flip at sampled bytes of every segment — plus
//! power-cut images of a store killed with unsynced writes, for every `Damage` kind of
//! the simulator. On each, `verify` at the open's time, a read-only recovery, a lenient
//! open and a strict open run on separate copies, and must agree: a strict open
//! refuses exactly when `verify` reports damage, at a place `verify` lists; the lenient
//! open skips as many corrupt records as `verify` lists problems, cuts as many torn
//! tails, counts the same foreign files and deletes exactly the expired and empty
//! segments `verify` counts; the read-only recovery finds the same as the lenient open
//! and leaves every file and name as it was, with no mutating call at all.
//!
//! The sampled bit flips use a seed printed at the start (`IDEMSTORE_SEED` replays it).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use idemstore::testing::{self, CallKind, Damage, RecoverOptions, SimVfs};
use idemstore::{Begin, Durability, Error, ManualClock, Policy, Store, StoreBuilder, UnixMs};

mod support;

const DIR: &str = "/store";
const T0_MS: u64 = support::T0_MS;
const SHARDS: usize = 1;
const NAMESPACES: [(&str, u64); 2] = [("orders", 3_600), ("mails", 7_200)];
const SEGMENT_HEADER_LEN: usize = 64;
const CHECKPOINT: &str = "CHECKPOINT";

fn dir() -> &'static Path {
    Path::new(DIR)
}

fn builder(now_ms: u64, strict: bool, durability: Durability) -> StoreBuilder {
    Store::builder(DIR)
        .clock(ManualClock::new(UnixMs(now_ms)))
        .shards(SHARDS)
        .segment_size(64 * 1024)
        .bucket_width(Duration::from_secs(600))
        .durability(durability)
        .strict(strict)
}

/// Never syncs by itself during a test: what is not flushed stays unsynced.
const LAZY: Durability = Durability::Interval(Duration::from_secs(3600));

/// Writes the store's keys; with `flush_halfway`, flushes after half of them.
fn fill(store: &Store, flush_halfway: bool) {
    let policy = |ns: usize| {
        Policy::ttl(Duration::from_secs(NAMESPACES[ns].1)).lease(Duration::from_secs(30))
    };
    let orders = store.namespace(NAMESPACES[0].0, policy(0)).unwrap();
    let mails = store.namespace(NAMESPACES[1].0, policy(1)).unwrap();
    for i in 0..1_800 {
        assert!(
            orders
                .check_and_set(format!("order-{i:05}"))
                .unwrap()
                .is_first()
        );
        if i % 9 == 0 {
            assert!(
                mails
                    .check_and_set(format!("mail-{i:05}"))
                    .unwrap()
                    .is_first()
            );
        }
        if i % 50 == 0 {
            match orders.begin(format!("claim-{i}")).unwrap() {
                Begin::Acquired(claim) => claim.complete(Some(b"receipt")).unwrap(),
                other => panic!("claim-{i}: {other:?}"),
            }
        }
        if i % 70 == 0 {
            assert!(orders.remove(format!("order-{i:05}")).unwrap());
        }
        if flush_halfway && i == 900 {
            store.flush().unwrap();
        }
    }
}

/// The pristine image: a store written and closed cleanly.
fn pristine() -> SimVfs {
    let vfs = SimVfs::new();
    let store = testing::open(builder(T0_MS, false, LAZY), &vfs).unwrap();
    fill(&store, false);
    store.close().unwrap();
    vfs
}

/// Every file of the store directory with its bytes.
fn image(vfs: &SimVfs) -> BTreeMap<String, Vec<u8>> {
    vfs.file_names(dir())
        .into_iter()
        .map(|name| {
            let bytes = vfs.read_file(&dir().join(&name)).unwrap();
            (name, bytes)
        })
        .collect()
}

/// An independent copy of `vfs`'s files.
fn copy(vfs: &SimVfs) -> SimVfs {
    vfs.snapshot().process_kill()
}

fn segment_names(vfs: &SimVfs) -> Vec<String> {
    let mut names: Vec<String> = vfs
        .file_names(dir())
        .into_iter()
        .filter(|n| n.ends_with(".seg"))
        .collect();
    names.sort();
    names
}

fn deadline(name: &str) -> u64 {
    support::deadline_of(Path::new(name)).unwrap()
}

fn segment_name(deadline_ms: u64, seq: u64) -> String {
    format!("{deadline_ms:016x}-{seq:016x}.seg")
}

/// The calls that change a file system.
const MUTATING: [CallKind; 13] = [
    CallKind::CreateDirAll,
    CallKind::OpenAppend,
    CallKind::CreateSegment,
    CallKind::Remove,
    CallKind::Rename,
    CallKind::SyncDir,
    CallKind::AppendSetLen,
    CallKind::AppendWrite,
    CallKind::AppendSync,
    CallKind::SegmentWrite,
    CallKind::SegmentAllocate,
    CallKind::SegmentSync,
    CallKind::SegmentTruncate,
];

fn mutating_calls(vfs: &SimVfs) -> Vec<u64> {
    MUTATING.iter().map(|&kind| vfs.calls(kind)).collect()
}

/// What the lenient open did.
struct Opened {
    corrupt: u64,
    torn_tails: u64,
    foreign: u64,
    records_replayed: u64,
    from_checkpoint: bool,
    segments_deleted: usize,
}

/// Runs verify, a read-only recovery, a lenient and a strict open on copies of `vfs`
/// at `now_ms`, and checks that they agree; returns the verify report.
fn agree(case: &str, vfs: &SimVfs, now_ms: u64) -> idemstore::VerifyReport {
    let now = UnixMs(now_ms);
    let report = testing::verify(&copy(vfs), dir(), now)
        .unwrap_or_else(|e| panic!("{case}: verify failed: {e}"));
    let segment_torn_tails = report
        .torn_tails
        .iter()
        .filter(|t| t.file().extension().is_some_and(|e| e == "seg"))
        .count() as u64;

    // The read-only recovery: nothing changes, not a byte, not a name, no call.
    let read_only = copy(vfs);
    let before = image(&read_only);
    let calls_before = mutating_calls(&read_only);
    let how = RecoverOptions {
        now,
        shards: SHARDS,
        strict: false,
        read_only: true,
    };
    let recovered = testing::recover(&read_only, dir(), how);
    assert_eq!(
        image(&read_only),
        before,
        "{case}: read-only recovery changed the image"
    );
    assert_eq!(
        mutating_calls(&read_only),
        calls_before,
        "{case}: read-only recovery made a mutating call ({MUTATING:?})"
    );

    // The strict open refuses exactly when verify reports damage, at a listed place.
    let strict = copy(vfs);
    match testing::open(builder(now_ms, true, LAZY), &strict) {
        Ok(store) => {
            assert!(
                report.is_clean(),
                "{case}: strict open accepted {report:#?}"
            );
            drop(store);
        }
        Err(Error::Corruption(c)) => {
            assert!(
                !report.is_clean(),
                "{case}: strict open refused {c:?}, verify is clean"
            );
            assert!(
                report.problems.contains(&c),
                "{case}: strict open refused {c:?}, which verify does not list: {:#?}",
                report.problems
            );
        }
        Err(e) => panic!("{case}: strict open failed: {e}"),
    }
    // A strict read-only recovery refuses the same.
    let strict_read_only = testing::recover(
        &copy(vfs),
        dir(),
        RecoverOptions {
            strict: true,
            ..how
        },
    );
    assert_eq!(
        strict_read_only.is_err(),
        !report.is_clean(),
        "{case}: strict read-only recovery {strict_read_only:?}"
    );

    // The lenient open: refuses only what cannot be skipped, and counts the rest.
    let lenient = copy(vfs);
    let segments_before = segment_names(&lenient);
    let opened = match testing::open(builder(now_ms, false, LAZY), &lenient) {
        Ok(store) => {
            let stats = store.stats();
            let opened = Opened {
                corrupt: stats.corrupt_records_skipped,
                torn_tails: stats.torn_tails_cut,
                foreign: stats.foreign_files,
                records_replayed: stats.records_replayed,
                from_checkpoint: stats.opened_from_checkpoint,
                segments_deleted: segments_before.len() - segment_names(&lenient).len(),
            };
            drop(store);
            Some(opened)
        }
        Err(Error::Corruption(c)) => {
            assert!(
                report.problems.contains(&c),
                "{case}: lenient open refused {c:?}, which verify does not list: {:#?}",
                report.problems
            );
            None
        }
        Err(e) => panic!("{case}: lenient open failed: {e}"),
    };
    let Some(opened) = opened else {
        assert!(
            recovered.is_err(),
            "{case}: read-only recovery accepted what the open refused"
        );
        return report;
    };
    let recovered = recovered.unwrap_or_else(|e| panic!("{case}: read-only recovery: {e}"));
    let from_verify = (
        report.problem_count,
        segment_torn_tails,
        report.foreign_files.len() as u64,
        report.expired_segments + report.empty_segments,
    );
    let from_open = (
        opened.corrupt,
        opened.torn_tails,
        opened.foreign,
        opened.segments_deleted as u64,
    );
    // Counts of the checkpoint path are those of a clean directory.
    if !opened.from_checkpoint {
        assert_eq!(
            from_open, from_verify,
            "{case}: (corrupt, torn tails, foreign, deleted segments) of the open, then of verify"
        );
        if report.expired_segments == 0 {
            assert_eq!(opened.records_replayed, report.records, "{case}: records");
        }
    } else {
        assert!(
            report.is_clean() && segment_torn_tails == 0,
            "{case}: {report:#?}"
        );
        assert_eq!(opened.foreign, report.foreign_files.len() as u64, "{case}");
    }
    let from_read_only = (
        recovered.corrupt_records_skipped,
        recovered.torn_tails_cut,
        recovered.foreign_files,
        recovered.expired_segments + recovered.empty_segments,
    );
    assert_eq!(
        (
            from_read_only,
            recovered.records_replayed,
            recovered.opened_from_checkpoint
        ),
        (from_open, opened.records_replayed, opened.from_checkpoint),
        "{case}: the read-only recovery, then the open"
    );
    assert_eq!(
        (recovered.expired_segments, recovered.empty_segments),
        (report.expired_segments, report.empty_segments),
        "{case}: (expired, empty) of the read-only recovery, then of verify"
    );
    report
}

/// A copy of `vfs` with `f` applied to the bytes of `name`.
fn edited(vfs: &SimVfs, name: &str, f: impl FnOnce(&mut Vec<u8>)) -> SimVfs {
    let out = copy(vfs);
    let path = dir().join(name);
    let mut bytes = out.read_file(&path).unwrap();
    f(&mut bytes);
    out.put_file(&path, &bytes);
    out
}

#[test]
fn verify_and_the_open_agree_on_every_kind_of_damage() {
    let pristine = pristine();
    let segments = segment_names(&pristine);
    assert!(segments.len() >= 3, "{segments:?}");
    let deadlines: Vec<u64> = segments.iter().map(|n| deadline(n)).collect();
    let first_deadline = *deadlines.iter().min().unwrap();
    let last_deadline = *deadlines.iter().max().unwrap();
    assert!(
        first_deadline < last_deadline,
        "one bucket only: {segments:?}"
    );
    let last = segments.last().unwrap().clone();
    let max_seq = segments.len() as u64 + 10;
    let future = last_deadline;

    let report = agree("pristine", &pristine, T0_MS);
    assert!(
        report.is_clean() && report.torn_tails.is_empty(),
        "{report:#?}"
    );
    assert_eq!(report.segments, segments.len() as u64);

    let without_checkpoint = copy(&pristine);
    assert!(without_checkpoint.delete_file(&dir().join(CHECKPOINT)));
    let report = agree("no checkpoint", &without_checkpoint, T0_MS);
    assert!(report.is_clean(), "{report:#?}");

    let foreign = copy(&pristine);
    foreign.put_file(&dir().join("notes.txt"), b"mine");
    foreign.put_dir(&dir().join(segment_name(future, max_seq)));
    let report = agree("foreign file and directory", &foreign, T0_MS);
    assert_eq!(report.foreign_files.len(), 2, "{report:#?}");

    let report = agree("first bucket expired", &without_checkpoint, first_deadline);
    assert!(report.expired_segments > 0, "{report:#?}");
    let report = agree("every bucket expired", &pristine, last_deadline);
    assert_eq!(
        report.expired_segments,
        segments.len() as u64,
        "{report:#?}"
    );

    let empty = copy(&pristine);
    empty.put_file(&dir().join(segment_name(future, max_seq)), &[0; 4096]);
    empty.put_file(&dir().join(segment_name(future, max_seq + 1)), &[]);
    let report = agree("all-zero and empty segments", &empty, T0_MS);
    assert_eq!(report.empty_segments, 2, "{report:#?}");

    let header = edited(&pristine, &last, |b| b[20] ^= 0x01);
    let report = agree("damaged header", &header, T0_MS);
    assert_eq!(report.problem_count, 1, "{report:#?}");

    let mismatch = copy(&pristine);
    let bytes = mismatch.read_file(&dir().join(&last)).unwrap();
    mismatch.put_file(&dir().join(segment_name(deadline(&last), max_seq)), &bytes);
    let report = agree("header disagrees with its name", &mismatch, T0_MS);
    assert_eq!(report.problem_count, 1, "{report:#?}");

    let cut = edited(&pristine, &last, |b| b.truncate(b.len() - 5));
    let report = agree("torn tail, cut", &cut, T0_MS);
    assert_eq!(report.torn_tails.len(), 1, "{report:#?}");

    let garbage = edited(&pristine, &last, |b| b.extend([0x5a; 40]));
    let report = agree("torn tail, garbage", &garbage, T0_MS);
    assert_eq!(report.torn_tails.len(), 1, "{report:#?}");

    let record = edited(&pristine, &last, |b| b[SEGMENT_HEADER_LEN + 10] ^= 0x40);
    let report = agree("damaged record", &record, T0_MS);
    assert_eq!(report.problem_count, 1, "{report:#?}");
    let report = agree("damaged record, expired", &record, last_deadline);
    assert!(report.is_clean(), "{report:#?}");

    // NAMESPACES: header 16 bytes, then one entry of 9 + name bytes per namespace.
    let first_entry_end = 16 + 9 + NAMESPACES[0].0.len();
    let short = edited(&pristine, "NAMESPACES", |b| b.truncate(first_entry_end));
    let report = agree("NAMESPACES lost an entry", &short, T0_MS);
    assert!(!report.is_clean(), "{report:#?}");
    let torn_entry = edited(&pristine, "NAMESPACES", |b| b.extend([3, 0, 0, 0, 2]));
    let report = agree("NAMESPACES torn entry", &torn_entry, T0_MS);
    assert!(
        report.is_clean() && report.torn_tails.len() == 1,
        "{report:#?}"
    );
    let damaged = edited(&pristine, "NAMESPACES", |b| b[0] ^= 0x01);
    let report = agree("NAMESPACES damaged", &damaged, T0_MS);
    assert!(!report.is_clean(), "{report:#?}");
    let torn_header = edited(&pristine, "NAMESPACES", |b| b.truncate(10));
    let report = agree("NAMESPACES torn header", &torn_header, T0_MS);
    assert!(!report.is_clean(), "{report:#?}");
    let missing = copy(&pristine);
    assert!(missing.delete_file(&dir().join("NAMESPACES")));
    let report = agree("NAMESPACES missing", &missing, T0_MS);
    assert!(!report.is_clean(), "{report:#?}");
    let report = agree("NAMESPACES missing, all expired", &missing, last_deadline);
    assert!(report.is_clean(), "{report:#?}");

    let mut all = copy(&cut);
    all.put_file(&dir().join("notes.txt"), b"mine");
    all.put_file(&dir().join(segment_name(future, max_seq)), &[0; 512]);
    all = edited(&all, &segments[0], |b| b[SEGMENT_HEADER_LEN + 10] ^= 0x40);
    let report = agree("several at once", &all, first_deadline);
    assert!(
        report.expired_segments > 0 && report.empty_segments == 1,
        "{report:#?}"
    );

    // A bit flip at sampled bytes of every segment.
    let mut rng = support::Rng::new(support::seed("verify_open_agree"));
    for name in &segments {
        let len = pristine.read_file(&dir().join(name)).unwrap().len();
        for _ in 0..12 {
            let at = rng.below(len as u64) as usize;
            let bit = rng.below(8);
            let flipped = edited(&pristine, name, |b| b[at] ^= 1 << bit);
            agree(&format!("{name}: bit {bit} of byte {at}"), &flipped, T0_MS);
        }
    }
}

#[test]
fn verify_and_the_open_agree_on_power_cut_images() {
    let vfs = SimVfs::new();
    let store = testing::open(builder(T0_MS, false, LAZY), &vfs).unwrap();
    fill(&store, true);
    let snapshot = vfs.snapshot();
    assert!(snapshot.has_unsynced());
    drop(store);
    let mut torn = 0;
    for damage in Damage::ALL {
        for seed in 0..4 {
            let image = snapshot.power_cut(damage, seed);
            let report = agree(&format!("power cut {damage:?}, seed {seed}"), &image, T0_MS);
            torn += report.torn_tails.len();
        }
    }
    assert!(
        torn > 0,
        "no power cut left a torn tail: the cases are too mild"
    );
}

#[test]
fn a_read_only_recovery_changes_nothing_a_read_write_one_would() {
    let pristine = pristine();
    let segments = segment_names(&pristine);
    let last = segments.last().unwrap();
    let first_deadline = segments.iter().map(|n| deadline(n)).min().unwrap();
    // Expired segments, an all-zero one, a torn tail, a torn NAMESPACES entry, and a
    // checkpoint that no longer matches: each something a read-write open changes.
    let image_vfs = edited(&pristine, last, |b| b.truncate(b.len() - 5));
    let zeros = segment_name(deadline(last), segments.len() as u64 + 10);
    image_vfs.put_file(&dir().join(&zeros), &[0; 512]);
    let image_vfs = edited(&image_vfs, "NAMESPACES", |b| b.extend([3, 0, 0, 0, 2]));
    let before = image(&image_vfs);
    assert!(before.contains_key(CHECKPOINT));

    let how = RecoverOptions {
        now: UnixMs(first_deadline),
        shards: SHARDS,
        strict: false,
        read_only: true,
    };
    let read_only = copy(&image_vfs);
    let calls_before = mutating_calls(&read_only);
    let found = testing::recover(&read_only, dir(), how).unwrap();
    assert!(
        found.expired_segments > 0
            && found.empty_segments == 1
            && found.torn_tails_cut == 1
            && found.records_replayed > 0
            && found.index_entries > 0,
        "{found:?}"
    );
    assert_eq!(image(&read_only), before, "names or bytes changed");
    assert_eq!(mutating_calls(&read_only), calls_before);

    // The negative control: the same recovery, read-write, changes the image.
    let read_write = copy(&image_vfs);
    let changed = testing::recover(
        &read_write,
        dir(),
        RecoverOptions {
            read_only: false,
            ..how
        },
    )
    .unwrap();
    assert_eq!(
        changed, found,
        "read-only and read-write recoveries found different things"
    );
    let after = image(&read_write);
    assert!(!after.contains_key(CHECKPOINT) && !after.contains_key(&zeros));
    assert!(after.len() < before.len());
    assert!(
        after[last].len() < before[last].len(),
        "the torn tail was not cut"
    );

    // From a matching checkpoint: read, used, and left in place.
    let checkpointed = copy(&pristine);
    let before = image(&checkpointed);
    let found = testing::recover(
        &checkpointed,
        dir(),
        RecoverOptions {
            now: UnixMs(T0_MS),
            ..how
        },
    )
    .unwrap();
    assert!(
        found.opened_from_checkpoint && found.index_entries > 0,
        "{found:?}"
    );
    assert_eq!(image(&checkpointed), before);
}
