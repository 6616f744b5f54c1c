//! Replays every input under `tests/fixtures/fuzz/<target>/` through the same harness
//! the fuzz target `<target>` runs (`fuzz/harness/<target>.rs`, compiled into this
//! test too), so a crash found once by fuzzing stays fixed. Files named `seed-*` are
//! seeds (the golden fixture's files and hand-made inputs) that keep the harnesses
//! exercised even without a crash; every other file is a crash input, listed in
//! `CRASHES` below with a sentence on its root cause, and a test checks that the list
//! and the directory agree.

use std::path::{Path, PathBuf};

#[path = "../fuzz/harness/changelog_message.rs"]
mod changelog_message;
#[path = "../fuzz/harness/cold_index.rs"]
mod cold_index;
#[path = "../fuzz/harness/model_ops.rs"]
mod model_ops;
#[path = "../fuzz/harness/open_dir.rs"]
mod open_dir;
#[path = "../fuzz/harness/record_decoder.rs"]
mod record_decoder;

/// Every crash input (target, file name) and its root cause.
const CRASHES: &[(&str, &str, &str)] = &[
    (
        "record_decoder",
        "crash-payload-fp-without-its-flag",
        "a claim record with the has-payload flag clear but a nonzero payload fingerprint \
         (its checksum made valid by libFuzzer's comparison tracing) decoded, then re-encoded \
         with the field zeroed: not a record the writer produces; src/format/record.rs now \
         refuses a fingerprint without its flag",
    ),
    (
        "open_dir",
        "crash-segment-seq-u64-max",
        "a segment file named with sequence number ffffffffffffffff made recovery compute \
         `max_seq + 1` and panic on overflow (overflow checks are on in every profile); \
         src/recovery.rs now saturates",
    ),
    (
        "open_dir",
        "crash-segment-seq-wraps-onto-existing-name",
        "with a file named with seq ffffffffffffffff the next segment sequence wrapped to \
         0, 1, ... and creating a segment failed with `Error::Io` (file exists) on every \
         write to that bucket; src/log/mod.rs `open_segment` now skips a taken name",
    ),
    (
        "open_dir",
        "crash-records-of-a-lost-namespace-adopted",
        "segments whose records name namespace ids with no NAMESPACES file were skipped, \
         then the first namespace created took id 0 and at the next open inherited those \
         records (a key read absent came back as seen); src/recovery.rs now refuses the \
         open with `Error::Corruption` when a record names an unknown namespace id",
    ),
    (
        "open_dir",
        "crash-one-lsn-in-two-buckets",
        "two segments of different buckets (so different expiries) held the same record, \
         one key under one LSN; replay kept whichever its threads applied first, so a key's \
         `expires_at` changed across a clean close and reopen; src/recovery/replay.rs now \
         breaks an LSN tie by the log's order (bucket deadline, segment seq, offset)",
    ),
    (
        "cold_index",
        "crash-filter-forged-checksum",
        "a cold index file whose filter section differs from the filter its entries make, \
         its checksum made valid by libFuzzer's comparison tracing: it decoded, and the \
         re-encoding (which builds the filter from the entries) differed; decode_file now \
         rebuilds the filter and refuses one that is not the entries' own",
    ),
    (
        "cold_index",
        "crash-filter-forged-checksum-2",
        "the same root cause as crash-filter-forged-checksum, another forged filter",
    ),
];

fn inputs(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz")
        .join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no inputs in {}", dir.display());
    files
}

fn replay(target: &str, run: fn(&[u8])) {
    for file in inputs(target) {
        let bytes = std::fs::read(&file).unwrap();
        eprintln!("replaying {}", file.display());
        run(&bytes);
    }
}

#[test]
fn record_decoder_inputs() {
    replay("record_decoder", record_decoder::run);
}

#[test]
fn open_dir_inputs() {
    replay("open_dir", open_dir::run);
}

#[test]
fn model_ops_inputs() {
    replay("model_ops", model_ops::run);
}

#[test]
fn changelog_message_inputs() {
    replay("changelog_message", changelog_message::run);
}

/// The seed of the changelog_message target is what the encoder writes today.
#[test]
fn the_changelog_message_seed_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz/changelog_message/seed-two-records");
    let expected = changelog_seed();
    if std::env::var_os("IDEMSTORE_WRITE_SEEDS").is_some() {
        std::fs::write(&path, &expected).unwrap();
    }
    let seed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(seed, expected, "regenerate with IDEMSTORE_WRITE_SEEDS=1");
    changelog_message::run(&seed);
}

fn changelog_seed() -> Vec<u8> {
    use idemstore::fuzzing;
    let records = vec![
        (
            1_700_000_600_000,
            fuzzing::encode_scoped_mark(3, Some(41), 7, 1_700_000_000_000, b"order-1"),
        ),
        (
            1_700_000_660_000,
            fuzzing::encode_scoped_mark(3, None, 8, 1_700_000_000_001, b"order-2"),
        ),
    ];
    fuzzing::encode_changelog_message("inventory", 3, 0xfeed, 2, &records)
}

#[test]
fn cold_index_inputs() {
    replay("cold_index", cold_index::run);
}

/// The seed of the cold_index target is what the encoder writes today: two pages, an
/// equal-hash pair across their boundary, three segments.
#[test]
fn the_cold_index_seed_is_current() {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz/cold_index/seed-two-pages");
    let expected = cold_index_seed();
    if std::env::var_os("IDEMSTORE_WRITE_SEEDS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &expected).unwrap();
    }
    let seed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(seed, expected, "regenerate with IDEMSTORE_WRITE_SEEDS=1");
    let decoded = idemstore::fuzzing::decode_cold_index(&seed).unwrap();
    assert_eq!(decoded.entries.len(), 300);
    cold_index::run(&seed);
}

/// The cold state seed of the cold_index target (its harness decodes both files) is
/// what the encoder writes today.
#[test]
fn the_cold_state_seed_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/fuzz/cold_index/seed-cold-state");
    let expected = idemstore::fuzzing::cold_state_seed();
    if std::env::var_os("IDEMSTORE_WRITE_SEEDS").is_some() {
        std::fs::write(&path, &expected).unwrap();
    }
    let seed = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(seed, expected, "regenerate with IDEMSTORE_WRITE_SEEDS=1");
    assert_eq!(
        idemstore::fuzzing::reencode_cold_state(&seed),
        Ok(seed.clone())
    );
    cold_index::run(&seed);
}

fn cold_index_seed() -> Vec<u8> {
    let mut entries: Vec<(u64, u32, u32)> = (0..300u32)
        .map(|i| {
            // Every fourth entry trusted (an approximate namespace's): both filters.
            let trusted = if i % 4 == 0 { 1 << 31 } else { 0 };
            (
                u64::from(i) * 0x0101_0101_0101,
                i % 3,
                (64 + 48 * i) | trusted,
            )
        })
        .collect();
    // Entries 254 and 255 (the last of page 0, the first of page 1) share a hash.
    entries[255].0 = entries[254].0;
    idemstore::fuzzing::encode_cold_index(
        4,
        &[
            (10, 1_700_000_060_000, 1 << 20),
            (11, 1_700_000_060_000, 70_000),
            (12, 1_700_000_120_000, 4_096),
        ],
        &entries,
    )
}

#[test]
fn every_crash_input_is_explained() {
    for target in [
        "record_decoder",
        "open_dir",
        "model_ops",
        "changelog_message",
        "cold_index",
    ] {
        for file in inputs(target) {
            let name = file.file_name().unwrap().to_str().unwrap();
            if name.starts_with("seed-") {
                continue;
            }
            assert!(
                CRASHES.iter().any(|&(t, n, _)| t == target && n == name),
                "{target}/{name} has no root cause in CRASHES"
            );
        }
    }
    for &(target, name, cause) in CRASHES {
        assert!(!cause.is_empty());
        assert!(
            inputs(target).iter().any(|f| f.ends_with(name)),
            "CRASHES lists {target}/{name}, which is missing"
        );
    }
}
