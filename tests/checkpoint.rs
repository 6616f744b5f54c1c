//! Guards the index checkpoint (docs/RELIABILITY.md, "The index checkpoint"): a clean
//! close writes one, and the next open rebuilds the index from it only when it
//! matches the directory exactly; in every other case it replays the log, and the
//! answers are the same either way.
//!
//! Each test writes a store with marks, claims in every state (in progress, released,
//! completed with a result, failed), removed keys, in several namespaces and shards,
//! under a manual clock, and closes it. Then it compares, key by key, the store
//! reopened from the checkpoint with a copy of the directory reopened by replay (its
//! checkpoint deleted): `get` of every key, then `check_and_set` and `begin` of every
//! key, then again after both are closed and reopened by replay (which proves the lsn
//! counters were restored: a new record with a lower lsn would lose to an old one).
//! The checkpoint must be gone once a store is open. A damaged checkpoint (flipped
//! bytes, truncations, garbage appended) and a checkpoint that no longer matches the
//! segments (a segment grown, changed in place, deleted, an extra one, a bucket
//! expired at reopen, another shard count) must each fall back to replay with the
//! right answers. On the simulated file system of `idemstore::testing`, a crash at
//! every call of the close that writes the checkpoint, and at every call of the open
//! that deletes it, must leave a store with every acknowledged key (checked on the
//! kill -9 image and on power-cut images).

mod support;

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::time::Duration;

use idemstore::testing::{self, Damage, SimVfs};
use idemstore::{Begin, Clock, Durability, ManualClock, Namespace, Policy, Record, Store, UnixMs};

const T0_MS: u64 = 1_700_000_000_000;
const CHECKPOINT: &str = "CHECKPOINT";
const NAMESPACES: [&str; 3] = ["orders", "payments", "clicks"];
const SHORT_TTL: Duration = Duration::from_secs(60);
const LONG_TTL: Duration = Duration::from_secs(3600);

fn policy(ns: usize) -> Policy {
    let ttl = if ns == 2 { SHORT_TTL } else { LONG_TTL };
    Policy::ttl(ttl)
        .lease(Duration::from_secs(30))
        .max_attempts(3)
}

fn builder(dir: &Path, clock: &ManualClock, shards: usize) -> idemstore::StoreBuilder {
    Store::builder(dir)
        .shards(shards)
        .durability(Durability::Immediate)
        .bucket_width(Duration::from_secs(10))
        .segment_size(64 * 1024)
        .clock(clock.clone())
}

fn namespaces(store: &Store) -> Vec<Namespace> {
    (0..NAMESPACES.len())
        .map(|i| store.namespace(NAMESPACES[i], policy(i)).unwrap())
        .collect()
}

fn id(i: usize) -> String {
    format!("key-{i:05}")
}

/// Keys per namespace the workload touches; `get` is also asked about as many more.
const KEYS: usize = 800;

/// Every kind of state, spread over the namespaces, the shards and several buckets
/// (the clock moves while it runs); enough keys to fill several 64 KiB segments.
fn workload(store: &Store, clock: &ManualClock) {
    let ns = namespaces(store);
    for i in 0..KEYS {
        if i % 100 == 0 {
            clock.advance(Duration::from_secs(3));
        }
        for (n, space) in ns.iter().enumerate() {
            let key = id(i);
            match (i + n) % 8 {
                0..=2 => assert!(space.check_and_set(&key).unwrap().is_first()),
                3 => {
                    let Begin::Acquired(claim) = space.begin(&key).unwrap() else {
                        panic!("{key}")
                    };
                    claim
                        .complete(Some(format!("result {i}").as_bytes()))
                        .unwrap();
                }
                4 => {
                    let Begin::Acquired(claim) = space.begin_with_payload(&key, b"p").unwrap()
                    else {
                        panic!("{key}")
                    };
                    claim.release().unwrap();
                }
                5 => {
                    let Begin::Acquired(claim) = space.begin(&key).unwrap() else {
                        panic!("{key}")
                    };
                    claim.fail().unwrap();
                }
                6 => {
                    // Left in progress: the lease runs out 30 s later.
                    let Begin::Acquired(claim) = space.begin(&key).unwrap() else {
                        panic!("{key}")
                    };
                    std::mem::forget(claim);
                }
                _ => {
                    assert!(space.check_and_set(&key).unwrap().is_first());
                    assert!(space.remove(&key).unwrap());
                }
            }
        }
    }
}

/// A closed store with the workload in `dir`.
fn write_store(dir: &Path, clock: &ManualClock, shards: usize) {
    let store = builder(dir, clock, shards).open().unwrap();
    workload(&store, clock);
    store.close().unwrap();
    assert!(
        dir.join(CHECKPOINT).exists(),
        "a clean close must write the checkpoint"
    );
}

fn copy_dir(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_name() != "LOCK" {
            fs::copy(entry.path(), to.path().join(entry.file_name())).unwrap();
        }
    }
    to
}

fn segment_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    files.sort();
    files
}

/// Every answer `get` gives, for the touched keys and as many untouched ones.
fn gets(store: &Store) -> BTreeMap<(usize, String), Option<Record>> {
    let ns = namespaces(store);
    let mut out = BTreeMap::new();
    for (n, space) in ns.iter().enumerate() {
        for i in 0..2 * KEYS {
            out.insert((n, id(i)), space.get(id(i)).unwrap());
        }
    }
    out
}

/// A comparable form of a `begin` answer.
fn begin_answer(begin: Begin) -> (String, Option<Record>) {
    match begin {
        Begin::Acquired(claim) => (format!("acquired attempt {}", claim.attempt()), None),
        Begin::InProgress(r) => ("in progress".into(), Some(r)),
        Begin::Completed(r) => ("completed".into(), Some(r)),
        Begin::Exhausted(r) => ("exhausted".into(), Some(r)),
    }
}

/// Mutating answers: `begin` of namespace 0 and 1 keys, `check_and_set` of
/// namespace 2 keys, of touched and untouched keys.
fn operate(store: &Store) -> Vec<String> {
    let ns = namespaces(store);
    let mut out = Vec::new();
    for i in (0..2 * KEYS).step_by(3) {
        for (n, space) in ns.iter().enumerate() {
            let answer = if n == 2 {
                format!("{:?}", space.check_and_set(id(i)).unwrap())
            } else {
                format!("{:?}", begin_answer(space.begin(id(i)).unwrap()))
            };
            out.push(format!("{n}/{}: {answer}", id(i)));
        }
    }
    out
}

/// Counters that must not depend on how the index was rebuilt.
fn counts(store: &Store) -> [u64; 9] {
    let s = store.stats();
    [
        s.live_keys,
        s.seen,
        s.in_progress,
        s.released,
        s.completed,
        s.failed,
        s.tombstones,
        s.segments,
        s.namespaces,
    ]
}

/// Opens `checkpointed` (expected to use its checkpoint iff `expect_checkpoint`) and a
/// copy of it without the checkpoint, and requires the same answers of both, before
/// and after writes, and after both are closed and replayed.
fn assert_same_as_replay(
    checkpointed: &Path,
    clock: &ManualClock,
    shards: usize,
    expect_checkpoint: bool,
    what: &str,
) {
    let replayed = copy_dir(checkpointed);
    let _ = fs::remove_file(replayed.path().join(CHECKPOINT));
    let a = builder(checkpointed, clock, shards).open().unwrap();
    let b = builder(replayed.path(), clock, shards).open().unwrap();
    assert_eq!(
        a.stats().opened_from_checkpoint,
        expect_checkpoint,
        "{what}: opened_from_checkpoint"
    );
    assert!(!b.stats().opened_from_checkpoint);
    if expect_checkpoint {
        assert_eq!(a.stats().records_replayed, 0, "{what}");
    } else {
        assert!(a.stats().records_replayed > 0, "{what}");
    }
    assert!(
        !checkpointed.join(CHECKPOINT).exists(),
        "{what}: the checkpoint must be deleted by the open"
    );
    assert_eq!(counts(&a), counts(&b), "{what}: stats");
    let (ga, gb) = (gets(&a), gets(&b));
    assert!(ga.values().filter(|r| r.is_some()).count() > KEYS, "{what}");
    for (key, answer) in &ga {
        assert_eq!(answer, &gb[key], "{what}: get {key:?}");
    }
    let (oa, ob) = (operate(&a), operate(&b));
    for (x, y) in oa.iter().zip(&ob) {
        assert_eq!(x, y, "{what}: after writes");
    }
    assert_eq!(counts(&a), counts(&b), "{what}: stats after writes");
    a.close().unwrap();
    b.close().unwrap();
    // Both replayed: the records written after a restore must win over older ones.
    fs::remove_file(checkpointed.join(CHECKPOINT)).unwrap();
    fs::remove_file(replayed.path().join(CHECKPOINT)).unwrap();
    let a = builder(checkpointed, clock, shards).open().unwrap();
    let b = builder(replayed.path(), clock, shards).open().unwrap();
    let (ga, gb) = (gets(&a), gets(&b));
    for (key, answer) in &ga {
        assert_eq!(
            answer, &gb[key],
            "{what}: get {key:?} after writes and replay"
        );
    }
    a.close().unwrap();
    b.close().unwrap();
}

#[test]
fn a_clean_close_reopens_from_the_checkpoint_with_the_answers_of_a_replay() {
    for shards in [1, 8] {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(UnixMs(T0_MS));
        write_store(dir.path(), &clock, shards);
        assert!(segment_files(dir.path()).len() > 3);
        clock.advance(Duration::from_secs(1));
        assert_same_as_replay(
            dir.path(),
            &clock,
            shards,
            true,
            &format!("{shards} shards"),
        );
    }
}

#[test]
fn the_checkpoint_is_deleted_at_open_and_rewritten_at_close() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0_MS));
    write_store(dir.path(), &clock, 4);
    fs::write(dir.path().join("notes.txt"), b"not ours").unwrap();
    let store = builder(dir.path(), &clock, 4).open().unwrap();
    assert!(store.stats().opened_from_checkpoint);
    assert_eq!(store.stats().foreign_files, 1);
    assert!(!dir.path().join(CHECKPOINT).exists());
    assert!(!dir.path().join("CHECKPOINT.tmp").exists());
    store.close().unwrap();
    assert!(dir.path().join(CHECKPOINT).exists());
    // A leftover temp file (a crash while writing) is not foreign, and is deleted.
    fs::write(dir.path().join("CHECKPOINT.tmp"), b"half written").unwrap();
    let store = builder(dir.path(), &clock, 4).open().unwrap();
    assert!(store.stats().opened_from_checkpoint);
    assert_eq!(store.stats().foreign_files, 1);
    assert!(!dir.path().join("CHECKPOINT.tmp").exists());
    // The checkpoint file is accepted by verify.
    store.close().unwrap();
    let report = idemstore::verify(dir.path()).unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.foreign_files, vec!["notes.txt".to_string()]);
}

#[test]
fn a_damaged_checkpoint_falls_back_to_replay() {
    let original = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0_MS));
    write_store(original.path(), &clock, 4);
    let len = fs::metadata(original.path().join(CHECKPOINT))
        .unwrap()
        .len() as usize;
    type Damager = Box<dyn Fn(&mut Vec<u8>)>;
    let mut damages: Vec<(String, Damager)> = Vec::new();
    for at in [0, 17, 70, len / 2, len - 1] {
        damages.push((
            format!("flip byte {at}"),
            Box::new(move |b: &mut Vec<u8>| b[at] ^= 0x04),
        ));
    }
    for to in [0, 63, len / 2, len - 1] {
        damages.push((
            format!("truncate to {to}"),
            Box::new(move |b: &mut Vec<u8>| b.truncate(to)),
        ));
    }
    damages.push((
        "garbage appended".into(),
        Box::new(|b: &mut Vec<u8>| b.extend([0xAB; 16])),
    ));
    damages.push((
        "all zeros".into(),
        Box::new(|b: &mut Vec<u8>| b.iter_mut().for_each(|x| *x = 0)),
    ));
    for (what, damage) in damages {
        let dir = copy_dir(original.path());
        let path = dir.path().join(CHECKPOINT);
        let mut bytes = fs::read(&path).unwrap();
        damage(&mut bytes);
        fs::write(&path, bytes).unwrap();
        assert_same_as_replay(dir.path(), &clock, 4, false, &what);
    }
}

#[test]
fn a_checkpoint_that_no_longer_matches_the_segments_falls_back_to_replay() {
    let original = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0_MS));
    write_store(original.path(), &clock, 4);
    let segments = segment_files(original.path());
    let name = |p: &Path| p.file_name().unwrap().to_owned();

    // A segment grown after the checkpoint was written (bytes appended).
    let dir = copy_dir(original.path());
    let grown = dir.path().join(name(&segments[1]));
    let mut bytes = fs::read(&grown).unwrap();
    bytes.extend([0u8; 100]);
    fs::write(&grown, bytes).unwrap();
    assert_same_as_replay(dir.path(), &clock, 4, false, "segment grown");

    // A segment changed in place, same length: a damaged record, found by replay.
    let dir = copy_dir(original.path());
    let changed = dir.path().join(name(&segments[2]));
    let mut bytes = fs::read(&changed).unwrap();
    bytes[64 + 10] ^= 0x01;
    fs::write(&changed, bytes).unwrap();
    let store = builder(dir.path(), &clock, 4).open().unwrap();
    assert!(!store.stats().opened_from_checkpoint);
    assert_eq!(store.stats().corrupt_records_skipped, 1);
    store.close().unwrap();
    assert!(
        !dir.path().join(CHECKPOINT).exists(),
        "no checkpoint after an open that skipped damage, so the next one reports it too"
    );

    // A segment missing.
    let dir = copy_dir(original.path());
    fs::remove_file(dir.path().join(name(&segments[0]))).unwrap();
    assert_same_as_replay(dir.path(), &clock, 4, false, "segment missing");

    // An extra segment: the store was written to after the checkpoint was copied.
    let dir = copy_dir(original.path());
    let stale = fs::read(dir.path().join(CHECKPOINT)).unwrap();
    let store = builder(dir.path(), &clock, 4).open().unwrap();
    assert!(store.stats().opened_from_checkpoint);
    let ns = namespaces(&store);
    for i in 0..50 {
        assert!(ns[0].check_and_set(format!("late-{i}")).unwrap().is_first());
    }
    drop(ns);
    store.close().unwrap();
    fs::write(dir.path().join(CHECKPOINT), &stale).unwrap();
    assert_same_as_replay(dir.path(), &clock, 4, false, "extra segment");
    let store = builder(dir.path(), &clock, 4).open().unwrap();
    assert!(
        namespaces(&store)[0].get("late-7").unwrap().is_some(),
        "a key written after the stale checkpoint was lost"
    );
    store.close().unwrap();

    // Another shard count.
    let dir = copy_dir(original.path());
    let store = builder(dir.path(), &clock, 8).open().unwrap();
    assert!(!store.stats().opened_from_checkpoint);
    drop(store);
    let dir = copy_dir(original.path());
    assert_same_as_replay(dir.path(), &clock, 8, false, "other shard count");
}

#[test]
fn a_bucket_expired_at_reopen_falls_back_to_replay() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0_MS));
    write_store(dir.path(), &clock, 4);
    // The short-ttl namespace's first buckets are past; the long ones are not.
    clock.advance(SHORT_TTL);
    let expired_copy = copy_dir(dir.path());
    let before = segment_files(dir.path()).len();
    let store = builder(dir.path(), &clock, 4).open().unwrap();
    let stats = store.stats();
    assert!(!stats.opened_from_checkpoint);
    assert!(
        segment_files(dir.path()).len() < before,
        "no expired segment was deleted"
    );
    assert_eq!(stats.segments as usize, segment_files(dir.path()).len());
    let ns = namespaces(&store);
    assert_eq!(ns[2].get(id(0)).unwrap(), None, "an expired key survived");
    assert!(ns[0].get(id(0)).unwrap().is_some());
    drop(ns);
    store.close().unwrap();
    assert_same_as_replay(expired_copy.path(), &clock, 4, false, "expired bucket");
}

#[test]
fn the_clock_floor_comes_from_the_segments_when_opened_from_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(T0_MS));
    write_store(dir.path(), &clock, 2);
    let newest = clock.now().0;
    // The wall clock stepped back while the store was closed.
    clock.set(UnixMs(T0_MS));
    let store = builder(dir.path(), &clock, 2).open().unwrap();
    assert!(store.stats().opened_from_checkpoint);
    let ns = namespaces(&store);
    assert!(ns[0].check_and_set("after the step").unwrap().is_first());
    let record = ns[0].get("after the step").unwrap().unwrap();
    assert!(
        record.first_seen.0 >= newest - 3_000,
        "the store's clock read {} ms, before the newest segment ({} ms)",
        record.first_seen.0 - T0_MS,
        newest - T0_MS
    );
}

// ---- crashes, on the simulated file system ----

const SIM_DIR: &str = "/sim/store";

fn sim_builder(clock: &ManualClock) -> idemstore::StoreBuilder {
    Store::builder(SIM_DIR)
        .durability(Durability::Immediate)
        .shards(4)
        .bucket_width(support::BUCKET_WIDTH)
        .segment_size(64 * 1024)
        .clock(clock.clone())
}

/// A store on `vfs` with acknowledged marks and completed claims; returns the model.
fn sim_workload(vfs: &SimVfs, clock: &ManualClock) -> (Store, support::Model) {
    let store = testing::open(sim_builder(clock), vfs).unwrap();
    let ns = support::namespaces(&store).unwrap();
    let mut model = support::Model::default();
    for i in 0..120 {
        let now = clock.now().0;
        let key = format!("k-{i:04}");
        if i % 3 == 0 {
            let Begin::Acquired(claim) = ns[1].begin(&key).unwrap() else {
                panic!("{key}")
            };
            claim.complete(Some(key.as_bytes())).unwrap();
            model.add(support::Promise {
                ns: 1,
                id: key,
                expect: support::Expect::Completed(format!("k-{i:04}").into_bytes()),
                until_ms: now + support::CLAIM_TTL_MS,
            });
        } else {
            let outcome = ns[0].check_and_set(&key).unwrap();
            model.mark(&key, &outcome, now);
        }
        if i % 40 == 39 {
            clock.advance(Duration::from_secs(2));
        }
    }
    (store, model)
}

/// Reopens every image a crash left (kill -9, and power cuts of each kind) and checks
/// every acknowledged key; returns how many opens used a checkpoint.
fn check_images(
    snapshot: &testing::Snapshot,
    model: &support::Model,
    clock: &ManualClock,
    what: &str,
) -> usize {
    let mut from_checkpoint = 0;
    let mut images = vec![("kill -9".to_string(), snapshot.process_kill())];
    for (s, damage) in Damage::ALL.into_iter().enumerate() {
        images.push((
            format!("{damage:?}"),
            snapshot.power_cut(damage, s as u64 + 1),
        ));
    }
    for (kind, image) in images {
        let store = testing::open(sim_builder(clock), &image)
            .unwrap_or_else(|e| panic!("{what}, {kind}: reopening failed: {e}"));
        from_checkpoint += usize::from(store.stats().opened_from_checkpoint);
        assert!(
            !image
                .file_names(Path::new(SIM_DIR))
                .iter()
                .any(|n| n.starts_with(CHECKPOINT)),
            "{what}, {kind}: a checkpoint file is left after open"
        );
        let ns = support::namespaces(&store).unwrap();
        if let Err(violation) = model.check(&ns, clock.now().0) {
            panic!("{what}, {kind}: {violation}");
        }
        // Writable, and a second clean close and open agree.
        assert!(ns[2].check_and_set("after").unwrap().is_first());
        drop(ns);
        store.close().unwrap();
        let store = testing::open(sim_builder(clock), &image).unwrap();
        assert!(store.stats().opened_from_checkpoint, "{what}, {kind}");
        let ns = support::namespaces(&store).unwrap();
        if let Err(violation) = model.check(&ns, clock.now().0) {
            panic!("{what}, {kind}, second open: {violation}");
        }
        assert!(!ns[2].check_and_set("after").unwrap().is_first());
        drop(ns);
        store.close().unwrap();
    }
    from_checkpoint
}

#[test]
fn a_crash_at_every_call_of_the_close_that_writes_the_checkpoint_loses_nothing() {
    let mut k = 1;
    let mut used = 0;
    loop {
        let vfs = SimVfs::new();
        let clock = ManualClock::new(UnixMs(support::T0_MS));
        let (store, model) = sim_workload(&vfs, &clock);
        let before = vfs.total_calls();
        vfs.crash_at_call(before + k);
        let closed = store.close();
        if !vfs.crashed() {
            closed.unwrap();
            assert!(
                vfs.file_names(Path::new(SIM_DIR))
                    .contains(&CHECKPOINT.to_string())
            );
            assert!(k > 5, "close made only {k} calls: no checkpoint written?");
            break;
        }
        assert!(
            closed.is_err(),
            "close at a crash at its call {k} claimed success"
        );
        let snapshot = vfs.snapshots().last().cloned().unwrap();
        used += check_images(
            &snapshot,
            &model,
            &clock,
            &format!("crash at close call {k}"),
        );
        k += 1;
    }
    // The crashes after the rename reached the disk leave a usable checkpoint.
    assert!(used > 0, "no crash image was opened from its checkpoint");
}

#[test]
fn a_crash_at_every_call_of_the_open_that_deletes_the_checkpoint_loses_nothing() {
    let vfs = SimVfs::new();
    let clock = ManualClock::new(UnixMs(support::T0_MS));
    let (store, model) = sim_workload(&vfs, &clock);
    store.close().unwrap();
    let closed = vfs.snapshot();
    let mut k = 1;
    loop {
        let image = closed.process_kill();
        image.crash_at_call(k);
        let opened = testing::open(sim_builder(&clock), &image);
        if !image.crashed() {
            let store = opened.unwrap();
            assert!(store.stats().opened_from_checkpoint);
            break;
        }
        drop(opened);
        let snapshot = image.snapshots().last().cloned().unwrap();
        check_images(
            &snapshot,
            &model,
            &clock,
            &format!("crash at open call {k}"),
        );
        k += 1;
    }
    assert!(k > 4, "open made only {k} calls");
}
