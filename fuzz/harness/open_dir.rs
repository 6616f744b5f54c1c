//! Fuzz harness (b): open a directory of arbitrary files, shared by
//! `fuzz/fuzz_targets/open_dir.rs` and `tests/fuzz_regressions.rs`.
//!
//! The input is cut into a `NAMESPACES` file and up to four segment files (see
//! [`Layout`]). The directory is opened strict and non-strict (each on its own copy);
//! an open may fail only with a typed error (`Corruption`, or `Io` for a file the
//! store cannot map). After a successful non-strict open, a few operations run on
//! the namespaces the file names and on ids found in the segments, then the store is
//! closed and reopened: every key acknowledged `First` in this session (and not
//! removed) must still be remembered, every key touched must read back exactly as it
//! did before the close (no record may come back or change meaning), and nothing may
//! panic.

use std::path::Path;
use std::time::Duration;

use idemstore::{Begin, Durability, Error, ManualClock, Policy, Store, UnixMs, fuzzing};

/// The clock the directory is opened at: the golden fixture's epoch plus 10 s, so the
/// fixture's segments are live.
pub const NOW_MS: u64 = 1_700_000_010_000;
/// The deadline of a segment whose name does not come from its header.
const DEFAULT_DEADLINE_MS: u64 = 1_700_003_600_000;
const SEGMENTS_MAX: usize = 4;

/// The files an input describes.
///
/// Byte 0 holds flags: bit 0 writes a `NAMESPACES` file; bit 1 opens strict first;
/// bits 2..6 name segment `i` from its own header (deadline at bytes 16..24, seq at
/// 24..32) instead of a default live name. Then come length-prefixed chunks (`u16`
/// little-endian length, clamped to what is left): the `NAMESPACES` bytes (if bit 0),
/// then each segment's bytes.
pub struct Layout<'a> {
    pub namespaces: Option<&'a [u8]>,
    pub segments: Vec<(String, &'a [u8])>,
    pub strict_first: bool,
}

pub fn parse(data: &[u8]) -> Layout<'_> {
    let flags = data.first().copied().unwrap_or(0);
    let mut rest = data.get(1..).unwrap_or(&[]);
    let mut chunk = || -> Option<&[u8]> {
        if rest.is_empty() {
            return None;
        }
        let len = match rest {
            [a, b, ..] => usize::from(u16::from_le_bytes([*a, *b])),
            _ => 0,
        };
        let body = rest.get(2..).unwrap_or(&[]);
        let len = len.min(body.len());
        let (taken, left) = body.split_at(len);
        rest = left;
        Some(taken)
    };
    let namespaces = if flags & 1 != 0 { chunk() } else { None };
    let mut segments = Vec::new();
    while segments.len() < SEGMENTS_MAX {
        let Some(bytes) = chunk() else { break };
        let i = segments.len();
        let from_header = flags & (1 << (2 + i)) != 0 && bytes.len() >= 32;
        let (deadline, seq) = if from_header {
            let mut d = [0u8; 8];
            d.copy_from_slice(&bytes[16..24]);
            let mut s = [0u8; 8];
            s.copy_from_slice(&bytes[24..32]);
            (u64::from_le_bytes(d), u64::from_le_bytes(s))
        } else {
            (DEFAULT_DEADLINE_MS, i as u64 + 1)
        };
        let name = fuzzing::segment_file_name(deadline, seq);
        if segments.iter().any(|(n, _)| *n == name) {
            continue;
        }
        segments.push((name, bytes));
    }
    Layout {
        namespaces,
        segments,
        strict_first: flags & 2 != 0,
    }
}

fn write(dir: &Path, layout: &Layout<'_>) {
    if let Some(bytes) = layout.namespaces {
        std::fs::write(dir.join("NAMESPACES"), bytes).unwrap();
    }
    for (name, bytes) in &layout.segments {
        std::fs::write(dir.join(name), bytes).unwrap();
    }
}

fn open(dir: &Path, clock: &ManualClock, strict: bool) -> Result<Store, Error> {
    Store::builder(dir)
        .durability(Durability::None)
        .segment_size(64 * 1024)
        .shards(2)
        .clock(clock.clone())
        .strict(strict)
        .open()
}

/// The only errors a damaged directory may produce at open.
fn assert_typed(e: &Error) {
    assert!(
        matches!(e, Error::Corruption(_) | Error::Io { .. }),
        "unexpected error at open: {e:?}"
    );
    assert!(!e.to_string().is_empty());
}

pub fn run(data: &[u8]) {
    let layout = parse(data);
    for pass in 0..2 {
        let strict = (pass == 0) == layout.strict_first;
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), &layout);
        let clock = ManualClock::new(UnixMs(NOW_MS));
        match open(dir.path(), &clock, strict) {
            Ok(store) if !strict => exercise(dir.path(), &clock, store, &layout),
            Ok(store) => {
                let stats = store.stats();
                assert_eq!(
                    stats.corrupt_records_skipped, 0,
                    "strict open skipped damage"
                );
                store.close().unwrap();
            }
            Err(e) => assert_typed(&e),
        }
    }
}

/// Operations on an opened directory, then close, reopen and check.
fn exercise(dir: &Path, clock: &ManualClock, store: Store, layout: &Layout<'_>) {
    let policy = Policy::ttl(Duration::from_secs(3600))
        .lease(Duration::from_secs(5))
        .max_attempts(3);
    let mut names: Vec<String> = layout
        .namespaces
        .and_then(|bytes| fuzzing::decode_namespace_file(bytes).ok())
        .map(|(names, _)| names.into_iter().take(2).collect())
        .unwrap_or_default();
    names.push("fuzz".to_string());
    let mut ids: Vec<Vec<u8>> = vec![b"fresh-1".to_vec(), b"fresh-2".to_vec()];
    for (_, bytes) in &layout.segments {
        let scan = fuzzing::scan_segment(bytes, fuzzing::SEGMENT_HEADER_LEN);
        for &(offset, _) in scan.records.iter().take(4) {
            if let Ok(record) = fuzzing::decode_record(&bytes[offset..])
                && !ids.contains(&record.id)
            {
                ids.push(record.id);
            }
        }
    }
    let mut acknowledged = Vec::new();
    for name in &names {
        let ns = match store.namespace(name, policy) {
            Ok(ns) => ns,
            Err(e) => panic!("namespace {name:?}: {e:?}"),
        };
        for (i, id) in ids.iter().enumerate() {
            if id.len() > 1024 {
                assert!(matches!(
                    ns.check_and_set(id),
                    Err(Error::InvalidKey { .. })
                ));
                continue;
            }
            let _ = ns.get(id).unwrap();
            match i % 3 {
                0 => {
                    if ns.check_and_set(id).unwrap().is_first() {
                        acknowledged.push((name.clone(), id.clone()));
                    }
                    assert!(!ns.check_and_set(id).unwrap().is_first());
                }
                1 => match ns.begin(id).unwrap() {
                    Begin::Acquired(claim) => {
                        claim.complete(Some(b"done")).unwrap();
                        acknowledged.push((name.clone(), id.clone()));
                    }
                    Begin::InProgress(_) | Begin::Completed(_) | Begin::Exhausted(_) => {}
                },
                _ => {
                    let _ = ns.remove(id).unwrap();
                    let _ = ns.get(id).unwrap();
                }
            }
        }
    }
    // The exact state of every key touched, to compare after a clean reopen.
    let mut before = Vec::new();
    for name in &names {
        let ns = store.namespace(name, policy).unwrap();
        for id in ids.iter().filter(|id| id.len() <= 1024) {
            before.push((name.clone(), id.clone(), ns.get(id).unwrap()));
        }
    }
    let _ = store.stats();
    store.flush().unwrap();
    store.close().unwrap();
    drop(store);

    let store = match open(dir, clock, false) {
        Ok(store) => store,
        Err(e) => panic!("reopening a directory this store just closed: {e:?}"),
    };
    for (name, id) in &acknowledged {
        let ns = store.namespace(name, policy).unwrap();
        assert!(
            ns.get(id).unwrap().is_some(),
            "acknowledged key {name:?}/{id:?} lost after a clean reopen"
        );
    }
    for (name, id, record) in &before {
        let ns = store.namespace(name, policy).unwrap();
        assert_eq!(
            &ns.get(id).unwrap(),
            record,
            "{name:?}/{id:?} changed across a clean close and reopen"
        );
    }
    // Expire everything: the reaper walks whatever segments recovery accepted.
    clock.advance(Duration::from_secs(400 * 24 * 3600));
    let _ = store.expire_now().unwrap();
    store.close().unwrap();
}
