//! Guards on-disk format version 1 with a golden store directory committed under
//! `tests/fixtures/format_v1/` (`NAMESPACES` and the segment files; never `LOCK`).
//! `format_v1_writer/` also holds the `CHECKPOINT` its clean close wrote (checkpoint
//! version 1): opened with its shard count it rebuilds the index from it without
//! replaying a record, with the same answers; opened with another it is replayed.
//!
//! `format_v1/` was written by the first writer (one global lsn counter) and is kept
//! as it is: every later build must read it. `format_v1_writer/` is what the current
//! writer produces (lsns counted per shard; the format is unchanged); it is rewritten
//! by `golden_writer_reproduces_the_fixture` below when run with
//! `IDEMSTORE_WRITE_GOLDEN=1`. Both hold a store under a manual clock fixed at
//! 1 700 000 000 000 ms holding two marks, a completed claim with a result, a released
//! claim with a payload fingerprint, a failed claim, a removed key, and a mark in a
//! second namespace. Without the variable the same test regenerates the directory in a
//! temp dir and requires it to be byte-for-byte the fixture, so a change to what the
//! writer puts on disk cannot slip in unnoticed. The reader test copies the fixture,
//! opens it at the same epoch and checks every key's exact `Record`, and pins the raw
//! bytes of the segment header and of the first record.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Policy, Record, Status, Store, UnixMs};

const EPOCH_MS: u64 = 1_700_000_000_000;
const TTL: Duration = Duration::from_secs(30 * 24 * 3600);
const OTHER_TTL: Duration = Duration::from_secs(24 * 3600);
/// ceil((EPOCH + 30 days) / 1 min) * 1 min: the bucket of every key of "golden".
const DEADLINE_MS: u64 = 1_702_592_040_000;
/// ceil((EPOCH + 10 s + 1 day) / 1 min) * 1 min: the bucket of "other".
const OTHER_DEADLINE_MS: u64 = 1_700_086_440_000;
/// The current writer rounds a 30-day span to 42 min (`max(width, ttl / 1024)` in
/// whole widths, docs/CONTRACT.md §1.3): ceil((EPOCH + 30 days) / 42 min) * 42 min.
const WRITER_DEADLINE_MS: u64 = 1_702_592_640_000;
const SEGMENT: &str = "0000018c6a64cc40-0000000000000001.seg";
const WRITER_SEGMENT: &str = "0000018c6a6df400-0000000000000001.seg";
const OTHER_SEGMENT: &str = "0000018bd50c6040-0000000000000002.seg";

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format_v1")
}

/// What the v1 writer produced (see the file comment), kept as it is.
fn writer_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format_v1_writer")
}

/// What the current writer produces: the v1 writer's store plus one partition-scoped
/// mark with its source offset (format v2: segment header version 2, kind 0xB1).
fn v2_writer_fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format_v2_writer")
}

/// The partition and offset of the v2 fixture's scoped mark.
const PARTITION: u32 = 3;
const OFFSET: u64 = 4242;

fn policy() -> Policy {
    Policy::ttl(TTL)
        .lease(Duration::from_secs(30))
        .max_attempts(3)
}

fn at(seconds: u64) -> UnixMs {
    UnixMs(EPOCH_MS + seconds * 1000)
}

/// Writes the golden store into `dir`, one operation per second of manual clock.
fn write_golden(dir: &Path) {
    let clock = ManualClock::new(UnixMs(EPOCH_MS));
    let tick = || clock.advance(Duration::from_secs(1));
    // One shard, so one log stripe: the layout does not depend on the core count.
    let store = Store::builder(dir)
        .durability(Durability::Immediate)
        .shards(1)
        .clock(clock.clone())
        .open()
        .unwrap();
    let ns = store.namespace("golden", policy()).unwrap();
    assert!(ns.check_and_set("mark-1").unwrap().is_first()); // t0
    tick();
    assert!(ns.check_and_set("mark-2").unwrap().is_first()); // t1
    tick();
    let Begin::Acquired(claim) = ns.begin("claim-done").unwrap() else {
        panic!()
    }; // t2
    tick();
    claim.complete(Some(b"receipt-42")).unwrap(); // t3
    tick();
    let Begin::Acquired(claim) = ns.begin_with_payload("claim-released", b"payload").unwrap()
    else {
        panic!()
    }; // t4
    tick();
    claim.release().unwrap(); // t5
    tick();
    let Begin::Acquired(claim) = ns.begin("claim-failed").unwrap() else {
        panic!()
    }; // t6
    tick();
    claim.fail().unwrap(); // t7
    tick();
    assert!(ns.check_and_set("removed").unwrap().is_first()); // t8
    tick();
    assert!(ns.remove("removed").unwrap()); // t9
    tick();
    let other = store.namespace("other", Policy::ttl(OTHER_TTL)).unwrap();
    assert!(other.check_and_set("mark-1").unwrap().is_first()); // t10
    tick();
    // v2: the same id in a partition is another key, with its source offset.
    let partition = ns.partition(PARTITION).unwrap();
    assert!(
        partition
            .check_and_set_at("mark-1", OFFSET)
            .unwrap()
            .is_first()
    ); // t11
    drop((ns, other, partition));
    store.close().unwrap();
}

/// The fixture's files (no `LOCK`), sorted by name.
fn fixture_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != "LOCK")
        .map(|e| {
            (
                e.file_name().into_string().unwrap(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    files.sort();
    files
}

#[test]
fn golden_writer_reproduces_the_fixture() {
    let dir = tempfile::tempdir().unwrap();
    write_golden(dir.path());
    let written = fixture_files(dir.path());
    if std::env::var_os("IDEMSTORE_WRITE_GOLDEN").is_some() {
        let fixture = v2_writer_fixture_dir();
        let _ = std::fs::remove_dir_all(&fixture);
        std::fs::create_dir_all(&fixture).unwrap();
        for (name, bytes) in &written {
            std::fs::write(fixture.join(name), bytes).unwrap();
        }
    }
    let names: Vec<&str> = written.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        vec![
            OTHER_SEGMENT,
            WRITER_SEGMENT,
            "CHECKPOINT",
            "NAMESPACES",
            "PARTITIONS"
        ]
    );
    assert!(
        written == fixture_files(&v2_writer_fixture_dir()),
        "the writer no longer produces format v2 byte for byte; if the format changed on purpose, bump its version and add tests/fixtures/format_v3"
    );
}

fn copy_fixture(from: &Path) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in fixture_files(from) {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    dir
}

fn record(
    deadline_ms: u64,
    status: Status,
    first_seen: UnixMs,
    attempts: u32,
    completed_at: Option<UnixMs>,
    result: Option<&[u8]>,
) -> Record {
    Record {
        status,
        first_seen,
        expires_at: UnixMs(deadline_ms),
        attempts,
        lease_until: None,
        completed_at,
        result: result.map(<[u8]>::to_vec),
        partition: None,
        offset: None,
    }
}

#[test]
fn format_v1_fixtures_open_with_every_record_intact() {
    check_fixture(&fixture_dir(), 64, false, DEADLINE_MS);
    // The writer's checkpoint was written with one shard: with 64 it is replayed.
    check_fixture(&writer_fixture_dir(), 64, false, WRITER_DEADLINE_MS);
}

#[test]
fn format_v1_writer_checkpoint_rebuilds_the_index_without_replay() {
    check_fixture(&writer_fixture_dir(), 1, true, WRITER_DEADLINE_MS);
}

#[test]
fn format_v2_fixture_opens_with_its_partition_mark() {
    check_fixture(&v2_writer_fixture_dir(), 64, false, WRITER_DEADLINE_MS);
    check_fixture(&v2_writer_fixture_dir(), 1, true, WRITER_DEADLINE_MS);
}

#[test]
fn a_version_2_partitions_file_still_reads() {
    // The v2 writer's store as an earlier build left it: PARTITIONS version 2 (no
    // subject prefix), everything else the same.
    let dir = copy_fixture(&v2_writer_fixture_dir());
    let old = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/partitions_v2/PARTITIONS");
    let old = std::fs::read(old).unwrap();
    assert_eq!(old[4], 2);
    std::fs::write(dir.path().join("PARTITIONS"), old).unwrap();
    check_fixture(dir.path(), 64, false, WRITER_DEADLINE_MS);
}

#[test]
fn format_v2_bytes_of_the_scoped_record() {
    let bytes = std::fs::read(v2_writer_fixture_dir().join(WRITER_SEGMENT)).unwrap();
    assert_eq!(
        &bytes[8..12],
        &2u32.to_le_bytes(),
        "segment header version 2"
    );
    // The last record of the segment: the scoped mark of "mark-1" in partition 3.
    let mut scoped = Vec::new();
    scoped.extend([0xB1, 0]); // kind mark | scoped, status 0
    scoped.extend(6u16.to_le_bytes()); // id_len
    scoped.extend(0u32.to_le_bytes()); // namespace_id
    scoped.extend(0u32.to_le_bytes()); // body_len
    let at = bytes
        .windows(scoped.len())
        .rposition(|w| w == &scoped[..])
        .expect("a scoped mark record") as usize;
    let le = |v: u64| v.to_le_bytes();
    // (bytes 12..20 are its lsn)
    let mut rest = Vec::new();
    rest.extend(le(EPOCH_MS + 11_000)); // first_seen_ms
    rest.extend(PARTITION.to_le_bytes());
    rest.extend(le(OFFSET));
    rest.extend(b"mark-1");
    assert_eq!(&bytes[at + 20..at + 20 + rest.len()], &rest[..]);
    // PARTITIONS (its own version 3): no subject prefix (never replicated), one
    // 40-byte entry, namespace 0 partition 3, no changelog position, the highest
    // offset marked, no re-ship due.
    let partitions = std::fs::read(v2_writer_fixture_dir().join("PARTITIONS")).unwrap();
    assert_eq!(&partitions[..16], b"IDPT\x03\0\0\0\x01\0\0\0\0\0\0\0");
    assert_eq!(&partitions[16..24], &[0, 0, 0, 0, 3, 0, 0, 0]);
    assert_eq!(&partitions[40..48], &le(OFFSET));
    assert_eq!(&partitions[48..56], &[0; 8]);
    assert_eq!(partitions.len(), 16 + 40 + 8);
}

fn check_fixture(fixture: &Path, shards: usize, from_checkpoint: bool, deadline_ms: u64) {
    let v2 = fixture.join("PARTITIONS").exists();
    let record = |status, first_seen, attempts, completed_at, result| {
        record(
            deadline_ms,
            status,
            first_seen,
            attempts,
            completed_at,
            result,
        )
    };
    let dir = copy_fixture(fixture);
    let clock = ManualClock::new(UnixMs(EPOCH_MS));
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .shards(shards)
        .strict(true)
        .clock(clock.clone())
        .open()
        .unwrap();
    let stats = store.stats();
    assert_eq!(stats.opened_from_checkpoint, from_checkpoint);
    assert!(!dir.path().join("CHECKPOINT").exists());
    let records = if v2 { 12 } else { 11 };
    assert_eq!(
        stats.records_replayed,
        if from_checkpoint { 0 } else { records }
    );
    assert_eq!(stats.corrupt_records_skipped, 0);
    assert_eq!(stats.torn_tails_cut, 0);
    assert_eq!(stats.foreign_files, 0);
    assert_eq!(stats.namespaces, 2);
    assert_eq!(
        (stats.seen, stats.released, stats.completed, stats.failed),
        (if v2 { 4 } else { 3 }, 1, 1, 1)
    );
    assert_eq!(stats.tombstones, 1);

    let ns = store.namespace("golden", policy()).unwrap();
    let other = store.namespace("other", Policy::ttl(OTHER_TTL)).unwrap();
    assert_eq!(
        ns.get("mark-1").unwrap(),
        Some(record(Status::Seen, at(0), 0, None, None))
    );
    assert_eq!(
        ns.get("mark-2").unwrap(),
        Some(record(Status::Seen, at(1), 0, None, None))
    );
    assert_eq!(
        ns.get("claim-done").unwrap(),
        Some(record(
            Status::Completed,
            at(2),
            1,
            Some(at(3)),
            Some(b"receipt-42")
        ))
    );
    assert_eq!(
        ns.get("claim-released").unwrap(),
        Some(record(Status::Released, at(4), 1, None, None))
    );
    assert_eq!(
        ns.get("claim-failed").unwrap(),
        Some(record(Status::Failed, at(6), 1, None, None))
    );
    assert_eq!(ns.get("removed").unwrap(), None);
    assert_eq!(
        other.get("mark-1").unwrap(),
        Some(Record {
            expires_at: UnixMs(OTHER_DEADLINE_MS),
            ..record(Status::Seen, at(10), 0, None, None)
        })
    );
    assert_eq!(other.get("mark-2").unwrap(), None);
    let partition = ns.partition(PARTITION).unwrap();
    if v2 {
        assert_eq!(
            partition.get("mark-1").unwrap(),
            Some(Record {
                partition: Some(PARTITION),
                offset: Some(OFFSET),
                ..record(Status::Seen, at(11), 0, None, None)
            })
        );
        assert_eq!(
            partition.partition_info().unwrap().highest_offset,
            Some(OFFSET)
        );
    } else {
        assert_eq!(partition.get("mark-1").unwrap(), None);
    }

    // The stored state drives the operations, too.
    let Begin::Completed(done) = ns.begin("claim-done").unwrap() else {
        panic!("claim-done")
    };
    assert_eq!(done.result(), Some(&b"receipt-42"[..]));
    assert!(matches!(
        ns.begin("claim-failed").unwrap(),
        Begin::Exhausted(_)
    ));
    assert!(matches!(
        ns.begin_with_payload("claim-released", b"other"),
        Err(Error::PayloadMismatch)
    ));
    let Begin::Acquired(claim) = ns.begin_with_payload("claim-released", b"payload").unwrap()
    else {
        panic!("claim-released must be acquirable again")
    };
    assert_eq!(claim.attempt(), 2);
    drop(claim);
    assert!(!ns.check_and_set("mark-1").unwrap().is_first());
    assert!(ns.check_and_set("removed").unwrap().is_first());
}

#[test]
fn format_v1_bytes_of_the_segment_header_and_first_record() {
    let bytes = std::fs::read(fixture_dir().join(SEGMENT)).unwrap();
    let le = |v: u64| v.to_le_bytes();
    // Segment header, checksum (bytes 56..64) excluded.
    let mut header = Vec::new();
    header.extend(b"IDEMSEG\0");
    header.extend(1u32.to_le_bytes()); // version
    header.extend(64u32.to_le_bytes()); // header_len
    header.extend(le(DEADLINE_MS));
    header.extend(le(1)); // segment_seq
    header.extend(le(EPOCH_MS)); // created_ms
    header.extend(le(60_000)); // bucket_width_ms
    header.extend(le(0)); // reserved
    assert_eq!(&bytes[..56], &header[..]);

    // The first record: the mark of "mark-1" in namespace 0, lsn 1.
    let mut record = Vec::new();
    record.extend([0xA1, 0]); // kind mark, status 0
    record.extend(6u16.to_le_bytes()); // id_len
    record.extend(0u32.to_le_bytes()); // namespace_id
    record.extend(0u32.to_le_bytes()); // body_len
    record.extend(le(1)); // lsn
    record.extend(le(EPOCH_MS)); // first_seen_ms
    record.extend(b"mark-1");
    assert_eq!(&bytes[68..64 + 38], &record[..]);
    // Its checksum, as written by format v1 (low 32 bits of xxh3-64 over bytes 4..).
    assert_eq!(&bytes[64..68], &CHECKSUM_OF_FIRST_RECORD);

    // NAMESPACES: header, then "golden" as id 0 and "other" as id 1.
    let names = std::fs::read(fixture_dir().join("NAMESPACES")).unwrap();
    assert_eq!(&names[..16], b"IDEMNSP\0\x01\0\0\0\0\0\0\0");
    assert_eq!(&names[20..31], b"\0\0\0\0\x06golden");
    assert_eq!(&names[35..45], b"\x01\0\0\0\x05other");
    assert_eq!(names.len(), 45);
}

#[test]
fn checkpoint_v1_header_bytes() {
    let bytes = std::fs::read(writer_fixture_dir().join("CHECKPOINT")).unwrap();
    let mut header = Vec::new();
    header.extend(b"IDEMCKP\0");
    header.extend(1u32.to_le_bytes()); // version
    header.extend(64u32.to_le_bytes()); // header_len
    header.extend(1u32.to_le_bytes()); // shard_count
    header.extend(2u32.to_le_bytes()); // segment_count
    header.extend(2u32.to_le_bytes()); // namespace_count
    header.extend(0u32.to_le_bytes()); // reserved
    header.extend(7u64.to_le_bytes()); // entry_count: 6 keys of "golden", 1 of "other"
    header.extend((bytes.len() as u64).to_le_bytes()); // file_len
    header.extend(0u64.to_le_bytes()); // reserved
    assert_eq!(&bytes[..56], &header[..]);
    // 64 header + 2 x 32 segment table + 8 + one shard block (64 + 7 x 8 + 8).
    assert_eq!(bytes.len(), 64 + 64 + 8 + 64 + 56 + 8);
    // The segment table, in seq order: seq 1 is the "golden" bucket.
    let le = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    assert_eq!((le(64), le(72)), (1, WRITER_DEADLINE_MS));
    assert_eq!((le(96), le(104)), (2, OTHER_DEADLINE_MS));
    let segment_len = std::fs::metadata(writer_fixture_dir().join(WRITER_SEGMENT))
        .unwrap()
        .len();
    assert_eq!(le(80), segment_len);
    // The shard block: 7 entries; counts mark 3, in progress 0, released 1,
    // completed 1, failed 1, tombstone 1.
    let block = 64 + 64 + 8;
    assert_eq!(le(block), 7);
    let counts: Vec<u64> = (0..6).map(|i| le(block + 16 + 8 * i)).collect();
    assert_eq!(counts, [3, 0, 1, 1, 1, 1]);
}

const CHECKSUM_OF_FIRST_RECORD: [u8; 4] = [0x33, 0x28, 0x22, 0xd2];
