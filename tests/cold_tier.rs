//! The cold tier (issue 11, docs/ARCHITECTURE.md "The cold tier"): with a memory
//! budget, the index entries of the oldest buckets move to cold index files on disk,
//! and every operation stays exact across the tiers: duplicates, claims, `get`,
//! `remove`, `scan`, the state counts, expiry (whole files deleted) and a reopen.
//! A budget of 1 byte spills every live bucket at each `expire_now`.

use std::path::Path;
use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Outcome, Policy, Status, Store, UnixMs};

const START_MS: u64 = 1_700_000_000_000;
const WIDTH_MS: u64 = 60_000;

fn open(dir: &Path, clock: &ManualClock, budget: Option<u64>) -> Store {
    let mut builder = Store::builder(dir)
        .durability(Durability::None)
        .bucket_width(Duration::from_millis(WIDTH_MS))
        .shards(4)
        .clock(clock.clone());
    if let Some(budget) = budget {
        builder = builder.memory_budget(budget);
    }
    builder.open().unwrap()
}

fn cold_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".cold"))
        .collect();
    names.sort();
    names
}

/// Writes `keys` keys over `buckets` bucket widths (keys `prefix-0..`), one bucket at
/// a time, spilling after each.
fn fill(store: &Store, clock: &ManualClock, prefix: &str, keys: usize, buckets: usize) {
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for b in 0..buckets {
        for k in (b * keys / buckets)..((b + 1) * keys / buckets) {
            assert!(
                ns.check_and_set(format!("{prefix}-{k}"))
                    .unwrap()
                    .is_first()
            );
        }
        store.expire_now().unwrap();
        clock.advance(Duration::from_millis(WIDTH_MS));
    }
}

#[test]
fn spilled_keys_stay_duplicates_and_fresh_keys_stay_first() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    fill(&store, &clock, "k", 3_000, 3);
    let stats = store.stats();
    assert_eq!(stats.cold.spilled_keys, 3_000, "{:?}", stats.cold);
    assert_eq!(stats.live_keys, 3_000);
    assert!(stats.cold.generations >= 1 && stats.cold.generations <= 8);
    assert_eq!(cold_files(dir.path()).len() as u64, stats.cold.generations);
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for k in 0..3_000 {
        let id = format!("k-{k}");
        assert!(
            matches!(ns.check_and_set(&id).unwrap(), Outcome::Duplicate(_)),
            "{id} forgotten after its spill"
        );
        assert_eq!(ns.get(&id).unwrap().unwrap().status, Status::Seen);
    }
    for k in 0..3_000 {
        assert!(ns.check_and_set(format!("fresh-{k}")).unwrap().is_first());
    }
    assert_eq!(store.stats().live_keys, 6_000);
    // scan lists every key once, hot or cold.
    let mut listed = std::collections::HashSet::new();
    store
        .scan(Some("orders"), |_, id, _| {
            assert!(listed.insert(id.to_vec()), "listed twice");
            true
        })
        .unwrap();
    assert_eq!(listed.len(), 6_000);
}

#[test]
fn claims_on_cold_keys_follow_the_lifecycle() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    let ns = store
        .namespace(
            "jobs",
            Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(30)),
        )
        .unwrap();
    let Begin::Acquired(done) = ns.begin("done").unwrap() else {
        panic!("done not acquired")
    };
    done.complete(Some(b"receipt-7")).unwrap();
    let Begin::Acquired(dropped) = ns.begin("dropped").unwrap() else {
        panic!("dropped not acquired")
    };
    dropped.release().unwrap();
    assert!(ns.check_and_set("removed").unwrap().is_first());
    store.expire_now().unwrap();
    // (More if the reaper's first round spilled a claim before its resolution.)
    assert!(store.stats().cold.spilled_keys >= 3);
    assert_eq!(
        store.stats().index_bytes,
        0,
        "hot tables left after the spill"
    );

    match ns.begin("done").unwrap() {
        Begin::Completed(record) => assert_eq!(record.result.as_deref(), Some(&b"receipt-7"[..])),
        other => panic!("a completed cold key answered {other:?}"),
    }
    let Begin::Acquired(again) = ns.begin("dropped").unwrap() else {
        panic!("a released cold key was not acquired again")
    };
    assert_eq!(again.attempt(), 2, "the cold record's attempts were lost");
    again.complete(None).unwrap();
    assert!(ns.remove("removed").unwrap());
    assert!(ns.check_and_set("removed").unwrap().is_first());
    let stats = store.stats();
    assert_eq!((stats.completed, stats.seen, stats.live_keys), (2, 1, 3));
    // Spilled again (a newer generation), the newest state answers.
    store.expire_now().unwrap();
    assert_eq!(
        ns.get("dropped").unwrap().unwrap().status,
        Status::Completed
    );
    assert_eq!(store.stats().completed, 2);
}

#[test]
fn expiry_deletes_whole_generations_and_forgets_their_keys() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    fill(&store, &clock, "k", 2_000, 4);
    assert!(!cold_files(dir.path()).is_empty());
    clock.advance(Duration::from_secs(2 * 3600));
    store.expire_now().unwrap();
    let stats = store.stats();
    assert_eq!(stats.cold.generations, 0);
    assert_eq!(stats.live_keys, 0);
    assert_eq!(stats.expired_keys, 2_000);
    assert_eq!(cold_files(dir.path()), Vec::<String>::new());
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    assert!(ns.check_and_set("k-17").unwrap().is_first());
}

#[test]
fn generations_are_merged_down_to_eight() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    fill(&store, &clock, "k", 2_400, 24);
    let stats = store.stats();
    // 24 spills or more (the background reaper may split a bucket's) down to 8
    // generations: a merge takes up to three, so it removes at most two.
    assert!(stats.cold.spills >= 24, "{:?}", stats.cold);
    assert!(
        stats.cold.merges >= (stats.cold.spills - 8).div_ceil(2),
        "{:?}",
        stats.cold
    );
    assert!(stats.cold.generations <= 8, "{:?}", stats.cold);
    assert_eq!(stats.cold.entries, 2_400);
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for k in 0..2_400 {
        assert!(matches!(
            ns.check_and_set(format!("k-{k}")).unwrap(),
            Outcome::Duplicate(_)
        ));
    }
}

/// Every key of `fill` answers `Duplicate`.
fn assert_all_duplicates(store: &Store, prefix: &str, keys: usize) {
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for k in 0..keys {
        let outcome = ns.check_and_set(format!("{prefix}-{k}")).unwrap();
        assert!(
            matches!(outcome, Outcome::Duplicate(_)),
            "{prefix}-{k}: {outcome:?}"
        );
    }
}

/// Acquires "claimed" in the namespace "claims" (one-hour lease) and never completes
/// nor releases it: the process "dies" holding it.
fn abandon_a_claim(store: &Store) {
    let long = Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(3600));
    match store
        .namespace("claims", long)
        .unwrap()
        .begin("claimed")
        .unwrap()
    {
        Begin::Acquired(claim) => std::mem::forget(claim),
        other => panic!("{other:?}"),
    }
}

/// A clean close leaves COLD_STATE beside CHECKPOINT; the next open takes the
/// generation files over without replaying a record, and everything the tier knew
/// holds: duplicates, counts, a killed entry staying dead, a claim in progress of the
/// closed process released, expiry deleting the files.
#[test]
fn a_clean_reopen_reuses_the_generations() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    {
        let store = open(dir.path(), &clock, Some(1));
        let ns = store
            .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
            .unwrap();
        abandon_a_claim(&store);
        assert!(ns.check_and_set("recreated").unwrap().is_first());
        fill(&store, &clock, "k", 1_000, 2);
        // Its spilled entry is killed by the remove; the short chain expires first.
        assert!(ns.remove("recreated").unwrap());
        let short = ns.with_ttl(Duration::from_secs(1)).unwrap();
        assert!(short.check_and_set("recreated").unwrap().is_first());
        store.expire_now().unwrap();
        assert!(store.stats().cold.generations >= 2);
        assert_eq!(store.stats().in_progress, 1);
        store.close().unwrap();
    }
    let files = cold_files(dir.path());
    assert!(dir.path().join("COLD_STATE").exists());
    let store = open(dir.path(), &clock, Some(1));
    let stats = store.stats();
    assert!(stats.opened_from_checkpoint, "{stats:?}");
    assert_eq!(stats.records_replayed, 0);
    assert_eq!(stats.cold.reused_at_open, files.len() as u64);
    assert_eq!(stats.cold.rebuilt_at_open, 0);
    assert_eq!(cold_files(dir.path()), files);
    assert!(
        dir.path().join("COLD_STATE").exists(),
        "kept: true of the files taken over"
    );
    assert_eq!(stats.live_keys, 1_002);
    assert_eq!((stats.in_progress, stats.released), (0, 1));
    assert_eq!(stats.claims_released_at_open, 1);
    assert_all_duplicates(&store, "k", 1_000);
    let long = Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(3600));
    let claims = store.namespace("claims", long).unwrap();
    assert!(matches!(
        claims.begin("claimed").unwrap(),
        Begin::Acquired(_)
    ));
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    clock.advance(Duration::from_secs(3 * 60));
    store.expire_now().unwrap();
    assert_eq!(
        ns.get("recreated").unwrap(),
        None,
        "the killed state came back"
    );
    assert_eq!(store.stats().live_keys, 1_001);
    // Past every ttl: the generations go, files and all.
    clock.advance(Duration::from_secs(2 * 3600));
    store.expire_now().unwrap();
    assert_eq!(store.stats().live_keys, 0);
    assert_eq!(store.stats().cold.generations, 0);
    assert!(cold_files(dir.path()).is_empty());
}

/// Without the cold state (a crash, or a close that could not write it) or with a
/// damaged generation file, the open deletes the generation files and rebuilds the
/// index from the log: counted, never a wrong answer.
#[test]
fn a_reopen_that_cannot_reuse_the_generations_rebuilds_from_the_log() {
    type Damage = fn(&Path);
    let damages: [(&str, Damage); 3] = [
        ("no cold state", |dir| {
            std::fs::remove_file(dir.join("COLD_STATE")).unwrap()
        }),
        ("a damaged filter", |dir| {
            let path = dir.join(&cold_files(dir)[0]);
            let mut bytes = std::fs::read(&path).unwrap();
            // The sections follow the pages; flip a byte inside the filter.
            let at = bytes.len() - 200;
            bytes[at] ^= 0x10;
            std::fs::write(&path, &bytes).unwrap();
        }),
        ("a missing generation file", |dir| {
            std::fs::remove_file(dir.join(&cold_files(dir)[0])).unwrap()
        }),
    ];
    for (what, damage) in damages {
        let dir = tempfile::tempdir().unwrap();
        let clock = ManualClock::new(UnixMs(START_MS));
        {
            let store = open(dir.path(), &clock, Some(1));
            fill(&store, &clock, "k", 1_000, 2);
            store.close().unwrap();
        }
        let before = cold_files(dir.path()).len() as u64;
        damage(dir.path());
        let store = open(dir.path(), &clock, None);
        let stats = store.stats();
        assert!(!stats.opened_from_checkpoint, "{what}");
        assert_eq!(stats.cold.reused_at_open, 0, "{what}");
        let expected = if what == "a missing generation file" {
            before - 1
        } else {
            before
        };
        assert_eq!(stats.cold.rebuilt_at_open, expected, "{what}");
        assert_eq!(cold_files(dir.path()), Vec::<String>::new(), "{what}");
        assert_eq!(stats.live_keys, 1_000, "{what}");
        assert_all_duplicates(&store, "k", 1_000);
    }
}

#[test]
fn a_damaged_cold_page_is_an_error_never_a_wrong_answer() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    fill(&store, &clock, "k", 500, 1);
    // One file, or two if a reaper round spilled before `expire_now`.
    let files = cold_files(dir.path());
    assert!(!files.is_empty());
    // Flip a byte of each file's first entry page (mapped shared: the store sees it).
    for file in &files {
        let path = dir.path().join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096 + 3] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
    }
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    let mut errors = 0;
    for k in 0..500 {
        match ns.check_and_set(format!("k-{k}")) {
            Ok(Outcome::Duplicate(_)) => {}
            Ok(other) => panic!("k-{k} answered {other:?} from a damaged generation"),
            Err(Error::Corruption(damage)) => {
                assert!(
                    files.iter().any(|f| damage.file().ends_with(f)),
                    "{damage:?}"
                );
                errors += 1;
            }
            Err(e) => panic!("k-{k}: {e}"),
        }
    }
    assert!(errors > 0, "no lookup read the damaged page");
    assert_eq!(store.stats().cold.damaged_pages, errors);
    // The state that would reuse the file is gone; neither a spill nor the close
    // writes one again.
    assert!(!dir.path().join("COLD_STATE").exists());
    fill(&store, &clock, "more", 10, 1);
    store.close().unwrap();
    drop(store);
    assert!(!dir.path().join("COLD_STATE").exists());
    // `verify` finds the damaged page.
    let report = idemstore::verify(dir.path()).unwrap();
    assert!(report.cold_files >= 1, "{report:?}");
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.file().ends_with(&files[0]) && p.offset() == 4096)
            && report.problems.len() == files.len(),
        "{report:?}"
    );
    // The next open rebuilds the tier from the log, and every key answers.
    let store = open(dir.path(), &clock, Some(1));
    let stats = store.stats();
    assert!(stats.cold.rebuilt_at_open >= 1, "{stats:?}");
    assert_eq!(stats.cold.reused_at_open, 0);
    assert_all_duplicates(&store, "k", 500);
    store.close().unwrap();
    assert!(idemstore::verify(dir.path()).unwrap().is_clean());
}

/// A merge that meets a damaged page leaves that generation alone from then on: one
/// error, then the other generations merge down to the bound as before (the damaged
/// one used to be chosen again by every merge, and every `expire_now` failed while the
/// generations piled up). Lookups elsewhere answer; the next open rebuilds.
#[test]
fn a_damaged_generation_is_left_out_of_merges() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    // Seven generations of 100 keys, then one of 20: the smallest, so every merge's
    // smallest pair includes it.
    fill(&store, &clock, "k", 700, 7);
    fill(&store, &clock, "small", 20, 1);
    let files = cold_files(dir.path());
    let smallest = files
        .iter()
        .min_by_key(|f| std::fs::metadata(dir.path().join(f)).unwrap().len())
        .unwrap()
        .clone();
    let path = dir.path().join(&smallest);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096 + 3] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    let damaged = |e: Error| match e {
        Error::Corruption(damage) if damage.file().ends_with(&smallest) => {}
        e => panic!("{e}"),
    };
    let (mut errors, mut written) = (0, Vec::new());
    for b in 0..10 {
        for k in 0..100 {
            // A fresh key the damaged generation's filter lets through (about 1 in
            // 256) reads the damaged page: an error, and nothing written.
            let key = format!("m-{b}-{k}");
            match ns.check_and_set(&key) {
                Ok(outcome) => {
                    assert!(outcome.is_first(), "{key}: {outcome:?}");
                    written.push(key);
                }
                Err(e) => damaged(e),
            }
        }
        if let Err(e) = store.expire_now() {
            damaged(e);
            errors += 1;
        }
        clock.advance(Duration::from_millis(WIDTH_MS));
    }
    let stats = store.stats();
    assert!(
        errors <= 1,
        "{errors} failed expire_now calls: {:?}",
        stats.cold
    );
    assert!(stats.cold.damaged_pages >= 1, "{:?}", stats.cold);
    assert!(stats.cold.generations <= 8, "{:?}", stats.cold);
    assert!(cold_files(dir.path()).contains(&smallest));
    assert!(written.len() >= 950, "{} of 1000 written", written.len());
    let old = (0..700).map(|k| format!("k-{k}"));
    for key in written.into_iter().chain(old) {
        match ns.check_and_set(&key) {
            Ok(again) => assert!(matches!(again, Outcome::Duplicate(_)), "{key}: {again:?}"),
            Err(e) => damaged(e),
        }
    }
    store.close().unwrap();
    drop(store);
    let store = open(dir.path(), &clock, Some(1));
    assert!(store.stats().cold.rebuilt_at_open >= 1);
    assert_all_duplicates(&store, "small", 20);
    assert_all_duplicates(&store, "k", 700);
}

/// A crash-reopen whose reconciliation reads a damaged page does not fail: it falls
/// back to the replay of the whole log.
#[test]
fn a_damaged_page_met_by_the_reconciliation_falls_back_to_a_full_replay() {
    let vfs = idemstore::testing::SimVfs::new();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = sim_open(&vfs, &clock);
    fill(&store, &clock, "k", 500, 1);
    // Written after the last state: replayed and reconciled at the next open, each
    // probing the generation's page for its key.
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for k in 0..500 {
        assert!(ns.remove(format!("k-{k}")).unwrap());
    }
    let image = vfs.crash_now().process_kill();
    drop(store);
    let cold: Vec<String> = image
        .file_names(Path::new("/db"))
        .into_iter()
        .filter(|n| n.ends_with(".cold"))
        .collect();
    assert!(!cold.is_empty());
    for name in &cold {
        image.flip_live_byte(&Path::new("/db").join(name), 4096 + 3, 0x40);
    }
    let store = sim_open(&image, &clock);
    let stats = store.stats();
    assert_eq!(stats.cold.reused_at_open, 0, "{stats:?}");
    assert_eq!(stats.cold.rebuilt_at_open, cold.len() as u64, "{stats:?}");
    assert_eq!(stats.records_replayed, 1_000);
    assert_eq!(stats.live_keys, 0);
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    assert_eq!(ns.get("k-7").unwrap(), None);
}

#[test]
fn a_budget_the_hot_index_fits_spills_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(64 << 20));
    fill(&store, &clock, "k", 5_000, 2);
    let stats = store.stats();
    assert_eq!(stats.cold.spills, 0);
    assert_eq!(stats.cold.generations, 0);
    assert!(cold_files(dir.path()).is_empty());
}

#[test]
fn a_zero_budget_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let err = Store::builder(dir.path())
        .memory_budget(0)
        .open()
        .unwrap_err();
    assert!(err.to_string().contains("memory_budget"), "{err}");
}

#[test]
fn a_filter_width_other_than_8_or_16_bits_is_refused() {
    for bits in [0, 4, 12, 32] {
        let dir = tempfile::tempdir().unwrap();
        let err = Store::builder(dir.path())
            .memory_budget(1)
            .cold_filter_bits(bits)
            .open()
            .unwrap_err();
        assert!(
            matches!(err, idemstore::Error::InvalidOption { .. }),
            "{bits}: {err}"
        );
        assert!(err.to_string().contains("cold_filter_bits"), "{err}");
    }
}

/// 16-bit filters (the default) take a byte more per cold key than 8-bit ones; files of
/// either width are read with either setting, and merges write the current one.
#[test]
fn generations_of_either_filter_width_are_read_with_either_setting() {
    let clock = ManualClock::new(UnixMs(START_MS));
    let opener = |dir: &Path, bits: u8| {
        Store::builder(dir)
            .durability(Durability::None)
            .bucket_width(Duration::from_millis(WIDTH_MS))
            .shards(4)
            .clock(clock.clone())
            .memory_budget(1)
            .cold_filter_bits(bits)
            .open()
            .unwrap()
    };
    let mut ram = Vec::new();
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    for (dir, bits) in dirs.iter().zip([8, 16]) {
        let store = opener(dir.path(), bits);
        fill(&store, &clock, "k", 3_000, 3);
        let cold = store.stats().cold;
        assert_eq!(cold.entries, 3_000);
        ram.push(cold.ram_bytes);
        store.close().unwrap();
    }
    assert!(
        ram[1] >= ram[0] + 3_000,
        "16-bit {} against 8-bit {}",
        ram[1],
        ram[0]
    );
    for (dir, bits) in dirs.iter().zip([16, 8]) {
        // Reopened with the other width: the files are taken over, every key answers.
        let store = opener(dir.path(), bits);
        assert!(store.stats().cold.reused_at_open > 0);
        let ns = store
            .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
            .unwrap();
        for k in 0..3_000 {
            assert!(
                !ns.check_and_set(format!("k-{k}")).unwrap().is_first(),
                "{k}"
            );
        }
        // Enough spills to merge every generation into files of the new width.
        fill(&store, &clock, "more", 3_000, 12);
        assert!(store.stats().cold.merges > 0);
        for k in 0..3_000 {
            assert!(
                !ns.check_and_set(format!("k-{k}")).unwrap().is_first(),
                "{k}"
            );
            assert!(
                !ns.check_and_set(format!("more-{k}")).unwrap().is_first(),
                "{k}"
            );
        }
        assert!(ns.check_and_set("never-seen").unwrap().is_first());
        drop(ns);
        store.close().unwrap();
        let report = idemstore::verify(dir.path()).unwrap();
        assert!(report.cold_files > 0 && report.is_clean(), "{report:?}");
    }
}

/// A key removed and re-created with a shorter ttl starts a new chain that can expire
/// before the bucket of its old, spilled record: the old state must not come back.
#[test]
fn a_re_created_key_never_finds_its_old_cold_state() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let store = open(dir.path(), &clock, Some(1));
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    assert!(ns.check_and_set("k").unwrap().is_first());
    store.expire_now().unwrap();
    assert_eq!(store.stats().cold.spilled_keys, 1);
    assert!(ns.remove("k").unwrap());
    let short = ns.with_ttl(Duration::from_secs(1)).unwrap();
    assert!(short.check_and_set("k").unwrap().is_first());
    clock.advance(Duration::from_secs(3 * 60));
    store.expire_now().unwrap();
    assert_eq!(ns.get("k").unwrap(), None, "the spilled state came back");
    assert!(!ns.remove("k").unwrap());
    assert!(ns.check_and_set("k").unwrap().is_first());
    assert_eq!(store.stats().live_keys, 1);
}

/// A write that kills a cold entry while a merge of its generation is being written
/// (after the merge read the dead bits, before it swapped the merged generation in)
/// must stay killed in the merged generation: the key, re-created with a short ttl
/// that expires first, never finds its old state. The simulated file system runs the
/// writes inside the merge's rename of its file into place (the first rename of a
/// cold file while more than eight generations are published is a merge's).
#[test]
fn a_write_during_a_merge_stays_killed_in_the_merged_generation() {
    use idemstore::testing::{self, SimVfs};
    use std::sync::{Arc, Mutex};

    let vfs = SimVfs::new();
    let clock = ManualClock::new(UnixMs(START_MS));
    let builder = Store::builder("/merge")
        .durability(Durability::None)
        .bucket_width(Duration::from_millis(WIDTH_MS))
        .shards(4)
        .clock(clock.clone())
        .memory_budget(1);
    let store = Arc::new(testing::open(builder, &vfs).unwrap());
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    let written: Arc<Mutex<Vec<String>>> = Arc::default();
    let killed: Arc<Mutex<Vec<String>>> = Arc::default();
    {
        let (store, written, killed) = (
            Arc::clone(&store),
            Arc::clone(&written),
            Arc::clone(&killed),
        );
        vfs.before_rename(move |to| {
            let cold = to.extension().is_some_and(|e| e == "cold");
            if !cold || store.stats().cold.generations <= 8 || !killed.lock().unwrap().is_empty() {
                return;
            }
            let ns = store
                .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
                .unwrap();
            let short = ns.with_ttl(Duration::from_secs(1)).unwrap();
            let keys = written.lock().unwrap().clone();
            for key in &keys {
                assert!(ns.remove(key).unwrap(), "{key}");
                assert!(short.check_and_set(key).unwrap().is_first(), "{key}");
            }
            *killed.lock().unwrap() = keys;
        });
    }
    // One generation a bucket: the ninth makes the first merge.
    const PER_BUCKET: usize = 50;
    for b in 0..12 {
        for i in 0..PER_BUCKET {
            let key = format!("k-{b}-{i}");
            assert!(ns.check_and_set(&key).unwrap().is_first());
            written.lock().unwrap().push(key);
        }
        store.expire_now().unwrap();
        clock.advance(Duration::from_millis(WIDTH_MS));
    }
    vfs.before_rename(|_| {}); // drops the hook's handle on the store
    let killed = killed.lock().unwrap().clone();
    assert!(!killed.is_empty(), "no merge renamed its file");
    assert!(store.stats().cold.merges >= 1, "{:?}", store.stats().cold);
    // The short records expire; the merged generation must not answer for them.
    clock.advance(Duration::from_secs(3 * 60));
    store.expire_now().unwrap();
    let written = written.lock().unwrap().clone();
    for key in &written {
        let got = ns.get(key).unwrap();
        if killed.contains(key) {
            assert_eq!(
                got, None,
                "{key}: a state killed during the merge came back"
            );
        } else {
            assert!(got.is_some(), "{key} was lost");
        }
    }
    assert_eq!(
        store.stats().live_keys,
        (written.len() - killed.len()) as u64
    );
}

fn sim_open(vfs: &idemstore::testing::SimVfs, clock: &ManualClock) -> Store {
    let builder = Store::builder("/db")
        .durability(Durability::Immediate)
        .bucket_width(Duration::from_millis(WIDTH_MS))
        .shards(4)
        .memory_budget(1)
        .clock(clock.clone());
    idemstore::testing::open(builder, vfs).unwrap()
}

/// The state figures a crash must keep (claims in progress aside: the open releases
/// them).
fn counted(store: &Store) -> [u64; 5] {
    let s = store.stats();
    [
        s.live_keys,
        s.seen,
        s.in_progress + s.released,
        s.completed,
        s.tombstones,
    ]
}

/// After a kill -9 the open takes the generation files over with the cold state the
/// last spill wrote, replays only the records no spill walked, and re-derives what
/// the writes after that state did to cold keys (kills it held only in RAM): the same
/// answers and counts as before the crash, twice in a row.
#[test]
fn a_crash_reopen_reuses_the_generations_and_replays_only_the_hot_records() {
    let vfs = idemstore::testing::SimVfs::new();
    let clock = ManualClock::new(UnixMs(START_MS));
    let short = Policy::ttl(Duration::from_secs(1));
    let long = Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(3600));
    let store = sim_open(&vfs, &clock);
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    abandon_a_claim(&store);
    // Spilled while in progress, completed after the last cold state: no claim was in
    // progress there at the crash.
    let Begin::Acquired(later) = store
        .namespace("claims", long)
        .unwrap()
        .begin("later")
        .unwrap()
    else {
        panic!("later not acquired")
    };
    assert!(ns.check_and_set("recreated").unwrap().is_first());
    assert!(ns.check_and_set("removed").unwrap().is_first());
    fill(&store, &clock, "k", 1_000, 2);
    assert!(store.stats().cold.generations >= 2);
    // Records written so far: two claims, two keys, the fill.
    let written = 1_004;
    // After the last cold state: hot writes, and writes that shadow cold keys.
    later.complete(None).unwrap();
    for k in 0..100 {
        assert!(ns.check_and_set(format!("h-{k}")).unwrap().is_first());
    }
    assert!(ns.remove("removed").unwrap());
    assert!(ns.remove("recreated").unwrap());
    let short_ns = store.namespace("orders", short).unwrap();
    assert!(short_ns.check_and_set("recreated").unwrap().is_first());
    let before = counted(&store);
    let image = vfs.crash_now().process_kill();
    drop(store);

    let store = sim_open(&image, &clock);
    let stats = store.stats();
    assert!(!stats.opened_from_checkpoint, "{stats:?}");
    assert!(stats.cold.reused_at_open >= 1, "{stats:?}");
    assert_eq!(stats.cold.rebuilt_at_open, 0, "{stats:?}");
    assert!(
        stats.records_replayed < written / 2,
        "replayed {} of {written}",
        stats.records_replayed
    );
    assert_eq!(counted(&store), before, "{stats:?}");
    assert_eq!(stats.claims_released_at_open, 1);
    assert_all_duplicates(&store, "k", 1_000);
    assert_all_duplicates(&store, "h", 100);
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    assert_eq!(ns.get("removed").unwrap(), None);
    let claims = store.namespace("claims", long).unwrap();
    assert!(matches!(
        claims.begin("claimed").unwrap(),
        Begin::Acquired(_)
    ));
    // Spill what is hot now, then crash again: the second open uses the new state.
    store.expire_now().unwrap();
    let before = counted(&store);
    let image = image.crash_now().process_kill();
    drop(store);
    let store = sim_open(&image, &clock);
    assert_eq!(counted(&store), before, "{:?}", store.stats());
    assert_eq!(store.stats().cold.rebuilt_at_open, 0);
    // The short chain expires: the long state it shadowed stays dead.
    clock.advance(Duration::from_secs(3 * 60));
    store.expire_now().unwrap();
    let ns = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    assert_eq!(
        ns.get("recreated").unwrap(),
        None,
        "the killed state came back"
    );
    assert_eq!(ns.get("removed").unwrap(), None);
    assert_all_duplicates(&store, "k", 1_000);
    assert_all_duplicates(&store, "h", 100);
}

/// The cold state may hold a kill only once the record that made it is durable: in
/// `Interval` mode a write that shadows a cold key while a spill runs (here, inside
/// the rename of its file) is made durable before the state that kills the cold
/// entry is written. A power cut right after then finds the key in one state or the
/// other, never in neither.
#[test]
fn a_cold_state_never_holds_a_kill_whose_record_a_power_cut_can_lose() {
    use idemstore::testing::{self, Damage, SimVfs};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let vfs = SimVfs::new();
    let clock = ManualClock::new(UnixMs(START_MS));
    let builder = || {
        Store::builder("/db")
            .durability(Durability::Interval(Duration::from_secs(3600)))
            .bucket_width(Duration::from_millis(WIDTH_MS))
            .shards(4)
            .memory_budget(1)
            .clock(clock.clone())
    };
    let policy = Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(3600));
    let store = Arc::new(testing::open(builder(), &vfs).unwrap());
    let jobs = store.namespace("jobs", policy).unwrap();
    let Begin::Acquired(claim) = jobs.begin("k").unwrap() else {
        panic!("k not acquired")
    };
    claim.release().unwrap();
    store.flush().unwrap();
    store.expire_now().unwrap();
    assert!(store.stats().cold.spilled_keys >= 1);
    // The hook fires on this thread only, inside a spill of its own `expire_now`: a
    // spill by the background reaper (every second) fires nothing, so no later
    // `flush` here can make the claim durable behind the test's back.
    let fired = Arc::new(AtomicBool::new(false));
    let armed = Arc::new(AtomicBool::new(false));
    {
        let (store, fired, armed, policy) = (
            Arc::clone(&store),
            Arc::clone(&fired),
            Arc::clone(&armed),
            policy,
        );
        let test_thread = std::thread::current().id();
        vfs.before_rename(move |to| {
            if to.extension().is_none_or(|e| e != "cold")
                || std::thread::current().id() != test_thread
                || !armed.load(Ordering::SeqCst)
                || fired.swap(true, Ordering::SeqCst)
            {
                return;
            }
            let jobs = store.namespace("jobs", policy).unwrap();
            match jobs.begin("k").unwrap() {
                Begin::Acquired(claim) => std::mem::forget(claim),
                other => panic!("{other:?}"),
            }
        });
    }
    let orders = store
        .namespace("orders", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    // The reaper may spill the fresh key first (then this spill renames nothing):
    // another fresh key, until this thread's spill fires the hook.
    for attempt in 0..100 {
        if fired.load(Ordering::SeqCst) {
            break;
        }
        assert!(
            orders
                .check_and_set(format!("fresh-{attempt}"))
                .unwrap()
                .is_first()
        );
        // Durable before the spill that walks it: otherwise the power cut shortens its
        // segment below the state's covered length, the open refuses the state and
        // replays the whole log, and the test cannot see the state's kill.
        store.flush().unwrap();
        armed.store(true, Ordering::SeqCst);
        store.expire_now().unwrap();
        armed.store(false, Ordering::SeqCst);
    }
    vfs.before_rename(|_| {});
    assert!(fired.load(Ordering::SeqCst), "no spill renamed its file");
    for seed in 0..4 {
        let image = vfs.snapshot().power_cut(Damage::Dropped, seed);
        let store = testing::open(builder(), &image).unwrap();
        let jobs = store.namespace("jobs", policy).unwrap();
        let got = jobs.get("k").unwrap();
        assert!(
            got.as_ref().is_some_and(|r| r.status == Status::Released),
            "seed {seed}: {got:?} (stats {:?})",
            store.stats()
        );
    }
}

/// The merger thread merges while writers run and the reaper spills (no
/// `expire_now`): writers answer fresh keys `First`, their earlier keys `Duplicate`, and
/// remove and re-create with a short TTL keys whose cold entries a running merge is
/// copying (the late kills a merge carries over: once the short TTL passes, those keys
/// must be gone, not back in their old state). The generations stay within the probe
/// bound; the counts, a clean reopen and `verify` agree with what was written.
#[test]
fn background_merges_keep_every_answer_exact_while_writers_run() {
    use std::collections::BTreeSet;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    // A 1 s bucket width: the reaper runs every 250 ms and spills what arrived.
    let open = || {
        Store::builder(dir.path())
            .durability(Durability::None)
            .bucket_width(Duration::from_secs(1))
            .shards(4)
            .clock(clock.clone())
            .memory_budget(1)
            .open()
            .unwrap()
    };
    let store = Arc::new(open());
    let policy = Policy::ttl(Duration::from_secs(3600));
    let stop = Arc::new(AtomicBool::new(false));
    let most_generations = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2)
        .map(|t| {
            let (store, stop, most) = (
                Arc::clone(&store),
                Arc::clone(&stop),
                Arc::clone(&most_generations),
            );
            std::thread::spawn(move || {
                let ns = store.namespace("orders", policy).unwrap();
                let short_ttl = ns.with_ttl(Duration::from_secs(5)).unwrap();
                let (mut live, mut short) = (BTreeSet::new(), BTreeSet::new());
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("w{t}-{i}");
                    assert_eq!(ns.check_and_set(&key).unwrap(), Outcome::First, "{key}");
                    live.insert(key);
                    if i.is_multiple_of(3) {
                        let old = format!("w{t}-{}", i / 2);
                        let again = ns.check_and_set(&old).unwrap();
                        assert!(matches!(again, Outcome::Duplicate(_)), "{old}: {again:?}");
                    }
                    if i.is_multiple_of(7) && i > 0 {
                        // A key spilled long ago: removed, then written again to expire
                        // first.
                        let old = format!("w{t}-{}", i / 3);
                        assert!(ns.remove(&old).unwrap(), "{old}");
                        let again = short_ttl.check_and_set(&old).unwrap();
                        assert_eq!(again, Outcome::First, "{old}");
                        short.insert(old);
                    }
                    if i.is_multiple_of(256) {
                        most.fetch_max(store.stats().cold.generations, Ordering::Relaxed);
                        // Small spills, many of them: about 20,000 keys a reaper round.
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    i += 1;
                }
                (live, short)
            })
        })
        .collect();
    let started = std::time::Instant::now();
    while store.stats().cold.merges < 12 && started.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let (mut live, mut short) = (BTreeSet::new(), BTreeSet::new());
    for writer in writers {
        let (l, s) = writer.join().unwrap();
        live.extend(l);
        short.extend(s);
    }
    let stats = store.stats();
    assert!(
        stats.cold.merges >= 12,
        "the merger merged too little: {:?}",
        stats.cold
    );
    assert!(stats.cold.spilled_keys > 0, "{:?}", stats.cold);
    assert!(
        most_generations.load(Ordering::Relaxed) <= 16,
        "more generations than the probe bound: {}",
        most_generations.load(Ordering::Relaxed)
    );
    assert_eq!(stats.live_keys, live.len() as u64, "{stats:?}");
    let check = |store: &Store, fresh: &str| {
        let ns = store.namespace("orders", policy).unwrap();
        for key in &live {
            assert_eq!(
                ns.get(key).unwrap().map(|r| r.status),
                Some(Status::Seen),
                "{key}"
            );
        }
        assert!(ns.check_and_set(fresh).unwrap().is_first());
    };
    check(&store, "fresh-1");
    Arc::try_unwrap(store).ok().unwrap().close().unwrap();
    let report = idemstore::verify(dir.path()).unwrap();
    assert!(report.cold_files > 0, "{report:?}");
    let store = open();
    assert_eq!(store.stats().live_keys, live.len() as u64 + 1);
    check(&store, "fresh-2");
    // The short-lived keys expire: none comes back in the state it had before its
    // removal (a kill lost by a merge would bring it back).
    clock.advance(Duration::from_secs(10));
    store.expire_now().unwrap();
    let ns = store.namespace("orders", policy).unwrap();
    assert!(!short.is_empty());
    for key in &short {
        assert_eq!(ns.get(key).unwrap(), None, "{key}");
    }
    assert_eq!(
        store.stats().live_keys,
        (live.len() - short.len()) as u64 + 2,
        "{:?}",
        store.stats()
    );
    store.close().unwrap();
}
