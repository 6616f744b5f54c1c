//! Recovery: rebuild the index by replaying every live segment at open.
//!
//! 0. An index checkpoint left by a clean close is read and deleted (`checkpoint`);
//!    if it matches the directory exactly, the index is rebuilt from it and nothing
//!    below runs (no record is read). Otherwise, and without one:
//! 1. Files that are not ours are counted and left alone.
//! 2. A segment whose bucket deadline has passed is deleted unread.
//! 3. A segment that is all zeros (a crash right after it was created) is deleted.
//! 4. A segment with a damaged header, or whose header disagrees with its name, is
//!    counted as corrupt and skipped (in strict mode: `Error::Corruption`).
//! 5. Records are replayed in any order, by several threads at once: for each key the
//!    record with the highest lsn wins. A damaged record followed by valid ones is
//!    counted and skipped; a damaged tail with nothing valid after it is a torn write
//!    and is cut.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crate::checkpoint;
use crate::error::Error;
use crate::format::record::Record;
use crate::format::segment_header::{self, SegmentHeader};
use crate::index::{Index, KeyHash, Shard};
use crate::io::{SegmentFile, Vfs};
use crate::log::reader;
use crate::log::{Location, Log, Segment, SegmentSlot};
use crate::options::Options;
use parking_lot::MutexGuard;

/// What recovery found.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecoveryReport {
    pub records_replayed: u64,
    pub corrupt_records_skipped: u64,
    pub torn_tails_cut: u64,
    pub foreign_files: u64,
    pub expired_segments_deleted: u64,
    /// The index was rebuilt from a checkpoint written at a clean close, not by replay.
    pub opened_from_checkpoint: bool,
    /// The latest creation time of any segment: the store's clock never reads earlier.
    pub clock_floor_ms: u64,
    pub duration: std::time::Duration,
}

/// A segment registered in the log, waiting to be replayed.
struct Pending {
    slot: SegmentSlot,
    path: PathBuf,
    file: Arc<dyn SegmentFile>,
}

/// What replaying one segment found.
#[derive(Default)]
struct Replayed {
    records: u64,
    max_lsn: u64,
    scan: reader::ScanReport,
    unknown_namespace: Vec<usize>,
}

/// Average bytes per record assumed when sizing the index before replay.
const RECORD_LEN_ESTIMATE: u64 = 48;

pub(crate) fn recover(
    log: &Log,
    index: &Index,
    vfs: &dyn Vfs,
    options: &Options,
    namespace_count: usize,
) -> Result<RecoveryReport, Error> {
    let started = Instant::now();
    let dir = log.dir().to_path_buf();
    let now_ms = options.clock.now().0;
    let mut report = RecoveryReport::default();
    let names = vfs.list(&dir).map_err(|e| Error::io("listing", &dir, e))?;
    for name in names.iter().filter(|n| !checkpoint::is_known_file(n)) {
        tracing::warn!(file = %name, "ignoring a file idemstore did not write");
        report.foreign_files += 1;
    }
    if let Some(bytes) = checkpoint::take(vfs, &dir, &names)? {
        match checkpoint::restore(&bytes, log, index, vfs, namespace_count, &names, now_ms)? {
            Ok(restored) => {
                report.opened_from_checkpoint = true;
                report.clock_floor_ms = restored.clock_floor_ms;
                report.duration = started.elapsed();
                tracing::info!(
                    keys = restored.entries,
                    segments = restored.segments,
                    ms = report.duration.as_millis() as u64,
                    "recovered from the index checkpoint"
                );
                return Ok(report);
            }
            Err(reason) => tracing::warn!(
                reason,
                "the index checkpoint does not match the directory; replaying the log"
            ),
        }
    }
    let mut max_seq = 0u64;
    let mut pending = Vec::new();
    for name in names {
        // Other names were counted as foreign above.
        let Some((name_deadline_ms, name_seq)) = segment_header::parse_file_name(&name) else {
            continue;
        };
        let path = dir.join(&name);
        max_seq = max_seq.max(name_seq);
        // A directory named like a segment is not ours: counted, never opened or deleted.
        let foreign_directory = |e: &std::io::Error, report: &mut RecoveryReport| {
            let is_dir = e.kind() == std::io::ErrorKind::IsADirectory;
            if is_dir {
                tracing::warn!(file = %name, "ignoring a directory named like a segment");
                report.foreign_files += 1;
            }
            is_dir
        };
        if name_deadline_ms <= now_ms {
            match vfs.remove(&path) {
                Ok(()) => report.expired_segments_deleted += 1,
                Err(e) if foreign_directory(&e, &mut report) => {}
                Err(e) => return Err(Error::io("deleting expired segment", &path, e)),
            }
            continue;
        }
        let file = match vfs.open_segment(&path) {
            Ok(file) => file,
            Err(e) if foreign_directory(&e, &mut report) => continue,
            Err(e) => return Err(Error::io("opening segment", &path, e)),
        };
        let len = file.capacity() as usize;
        let bytes = file.read(0, len);
        let header = match SegmentHeader::decode(bytes) {
            Ok(header)
                if header.bucket_deadline_ms == name_deadline_ms
                    && header.segment_seq == name_seq =>
            {
                header
            }
            Ok(_) => {
                corrupt(
                    options,
                    &mut report,
                    &path,
                    0,
                    "segment header disagrees with the file name",
                )?;
                continue;
            }
            Err(_) if bytes.iter().all(|&b| b == 0) => {
                // Created, then a crash before its header reached the disk: never used.
                drop(file);
                vfs.remove(&path)
                    .map_err(|e| Error::io("deleting empty segment", &path, e))?;
                continue;
            }
            Err(reason) => {
                corrupt(options, &mut report, &path, 0, &reason)?;
                continue;
            }
        };
        report.clock_floor_ms = report.clock_floor_ms.max(header.created_ms);
        let slot = log.add_recovered(|slot| {
            Segment::recovered(
                slot,
                header.segment_seq,
                header.bucket_deadline_ms,
                path.clone(),
                Arc::clone(&file),
                len as u64,
            )
        })?;
        pending.push(Pending { slot, path, file });
    }

    let total_bytes: u64 = pending.iter().map(|p| p.file.capacity()).sum();
    index.reserve(usize::try_from(total_bytes / RECORD_LEN_ESTIMATE).unwrap_or(usize::MAX));
    let replayed = replay_all(log, index, &pending, namespace_count);

    let mut max_lsn = 0u64;
    for (segment, replayed) in pending.iter().zip(replayed) {
        max_lsn = max_lsn.max(replayed.max_lsn);
        report.records_replayed += replayed.records;
        for offset in &replayed.scan.corrupt_offsets {
            corrupt(
                options,
                &mut report,
                &segment.path,
                *offset as u64,
                "damaged record",
            )?;
        }
        // Refused even without `strict`: skipping such a record is not enough, since
        // the next namespace created takes the missing id and would inherit it (false
        // duplicates, resurrected keys) at the following open.
        if let Some(&offset) = replayed.unknown_namespace.first() {
            return Err(Error::corruption(
                &segment.path,
                offset as u64,
                "record names a namespace id the NAMESPACES file does not hold: NAMESPACES \
                 is missing or lost entries; restore it from a backup, or move the segment \
                 files away to start empty",
            ));
        }
        if replayed.scan.torn_tail {
            report.torn_tails_cut += 1;
            tracing::info!(file = %segment.path.display(), offset = replayed.scan.valid_end, "cut a torn tail");
        }
        log.set_recovered_len(segment.slot, replayed.scan.valid_end as u64);
        // What was just replayed may exist only in the page cache (a kill -9 in
        // `Interval` mode, or a failed fsync and a reopen in the same boot), yet the
        // store will answer `Duplicate` from it as durable: make it durable first.
        segment
            .file
            .sync_data()
            .map_err(|e| Error::io("syncing recovered segment", &segment.path, e))?;
    }
    // Saturating: a file named with seq u64::MAX (damage, or not ours) must not panic.
    log.set_next_seq(max_seq.saturating_add(1));
    index.set_lsn_floor(max_lsn);
    report.duration = started.elapsed();
    tracing::info!(
        records = report.records_replayed,
        segments = pending.len(),
        corrupt = report.corrupt_records_skipped,
        torn_tails = report.torn_tails_cut,
        expired_segments = report.expired_segments_deleted,
        ms = report.duration.as_millis() as u64,
        "recovered"
    );
    Ok(report)
}

/// Replays every pending segment; results in order.
///
/// Each of up to one thread per core locks its own share of the shards for the whole
/// replay, reads every segment and applies only the records of its shards: no lock
/// operation per record (a locked instruction per record would serialize the table's
/// cache misses), and no two threads ever share a shard. Reading and hashing a record
/// once per thread costs far less.
fn replay_all(
    log: &Log,
    index: &Index,
    pending: &[Pending],
    namespace_count: usize,
) -> Vec<Replayed> {
    let parts = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8)
        .min(index.shard_count());
    let replay_part = |part: usize| {
        let mut shards: Vec<MutexGuard<'_, Shard>> = (part..index.shard_count())
            .step_by(parts)
            .map(|i| index.lock_at(i))
            .collect();
        pending
            .iter()
            .map(|segment| {
                replay(
                    log,
                    index,
                    &mut shards,
                    segment,
                    namespace_count,
                    part,
                    parts,
                )
            })
            .collect::<Vec<_>>()
    };
    if parts <= 1 || pending.is_empty() {
        return replay_part(0);
    }
    std::thread::scope(|s| {
        let others: Vec<_> = (1..parts)
            .map(|part| s.spawn(move || replay_part(part)))
            .collect();
        let first = replay_part(0);
        for other in others {
            other.join().expect("a recovery thread panicked");
        }
        first
    })
}

/// Replays one segment's records of the shards `part` of `parts` into the index; the
/// report (records, damage) covers the whole segment.
fn replay(
    log: &Log,
    index: &Index,
    shards: &mut [MutexGuard<'_, Shard>],
    segment: &Pending,
    namespace_count: usize,
    part: usize,
    parts: usize,
) -> Replayed {
    let mut replayed = Replayed::default();
    let bytes = segment.file.read(0, segment.file.capacity() as usize);
    replayed.scan = reader::scan(bytes, segment_header::LEN, |offset, record| {
        if record.namespace_id as usize >= namespace_count {
            replayed.unknown_namespace.push(offset);
            return;
        }
        replayed.max_lsn = replayed.max_lsn.max(record.lsn);
        replayed.records += 1;
        let hash = KeyHash::of(record.namespace_id, record.id);
        let shard = index.shard_of(hash);
        if shard % parts == part {
            apply(
                log,
                &mut shards[shard / parts],
                hash,
                segment.slot,
                offset,
                &record,
            );
        }
    });
    replayed
}

/// Makes `record` the indexed state of its key unless a newer record already is.
fn apply(
    log: &Log,
    shard: &mut Shard,
    hash: KeyHash,
    slot: SegmentSlot,
    offset: usize,
    record: &Record<'_>,
) {
    let location = Location {
        slot,
        offset: offset as u32,
    };
    let mut existing = None;
    shard.find(hash, |candidate| {
        let found = log
            .with_record(candidate, |_, other| {
                (other.namespace_id == record.namespace_id && other.id == record.id)
                    .then_some((other.lsn, other.state))
            })
            .ok()
            .flatten();
        if let Some((lsn, state)) = found {
            existing = Some((candidate, lsn, state));
        }
        found.is_some()
    });
    match existing {
        Some((_, lsn, _)) if lsn >= record.lsn => {}
        Some((old, _, old_state)) => {
            shard.upsert(hash, Some(old), location);
            shard.counts.sub(old_state);
            shard.counts.add(record.state);
        }
        None => {
            shard.upsert(hash, None, location);
            shard.counts.add(record.state);
        }
    }
}

fn corrupt(
    options: &Options,
    report: &mut RecoveryReport,
    path: &std::path::Path,
    offset: u64,
    reason: &str,
) -> Result<(), Error> {
    if options.strict {
        return Err(Error::corruption(path, offset, reason));
    }
    tracing::error!(file = %path.display(), offset, reason, "skipping damaged data");
    report.corrupt_records_skipped += 1;
    Ok(())
}
