//! Recovery: rebuild the index by replaying every live segment at open.
//!
//! 1. Files that are not ours are counted and left alone.
//! 2. A segment whose bucket deadline has passed is deleted unread.
//! 3. A segment that is all zeros (a crash right after it was created) is deleted.
//! 4. A segment with a damaged header, or whose header disagrees with its name, is
//!    counted as corrupt and skipped (in strict mode: `Error::Corruption`).
//! 5. Records are replayed in any order: for each key the record with the highest
//!    lsn wins. A damaged record followed by valid ones is counted and skipped; a
//!    damaged tail with nothing valid after it is a torn write and is cut.

use std::time::Instant;

use crate::error::Error;
use crate::format::namespace_file;
use crate::format::segment_header::{self, SegmentHeader};
use crate::index::{Index, KeyHash};
use crate::io::Vfs;
use crate::log::reader;
use crate::log::{Location, Log, Segment};
use crate::options::Options;

/// What recovery found.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecoveryReport {
    pub records_replayed: u64,
    pub corrupt_records_skipped: u64,
    pub torn_tails_cut: u64,
    pub foreign_files: u64,
    pub expired_segments_deleted: u64,
    /// The latest creation time of any segment: the store's clock never reads earlier.
    pub clock_floor_ms: u64,
    pub duration: std::time::Duration,
}

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
    let mut max_lsn = 0u64;
    let mut max_seq = 0u64;
    let names = vfs.list(&dir).map_err(|e| Error::io("listing", &dir, e))?;
    for name in names {
        let Some((name_deadline_ms, name_seq)) = segment_header::parse_file_name(&name) else {
            if name != namespace_file::FILE_NAME && name != crate::io::LOCK_FILE_NAME {
                tracing::warn!(file = %name, "ignoring a file idemstore did not write");
                report.foreign_files += 1;
            }
            continue;
        };
        let path = dir.join(&name);
        max_seq = max_seq.max(name_seq);
        if name_deadline_ms <= now_ms {
            vfs.remove(&path)
                .map_err(|e| Error::io("deleting expired segment", &path, e))?;
            report.expired_segments_deleted += 1;
            continue;
        }
        let file = vfs
            .open_segment(&path)
            .map_err(|e| Error::io("opening segment", &path, e))?;
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
        let mut slot = None;
        log.add_recovered(|s| {
            slot = Some(s);
            Segment::recovered(
                s,
                header.segment_seq,
                header.bucket_deadline_ms,
                path.clone(),
                file.clone(),
                len as u64,
            )
        });
        let slot = slot.expect("add_recovered calls its closure");
        let mut unknown_namespace = Vec::new();
        let scan = reader::scan(bytes, segment_header::LEN, |offset, record| {
            if record.namespace_id as usize >= namespace_count {
                unknown_namespace.push(offset);
                return;
            }
            max_lsn = max_lsn.max(record.lsn);
            report.records_replayed += 1;
            let hash = KeyHash::of(record.namespace_id, record.id);
            let location = Location {
                slot,
                offset: offset as u32,
            };
            let mut shard = index.lock(hash);
            let mut existing = None;
            shard.find(hash, |candidate| {
                let found = log
                    .with_record(candidate, None, |_, other| {
                        (other.namespace_id == record.namespace_id && other.id == record.id)
                            .then_some((other.lsn, other.state))
                    })
                    .ok()
                    .flatten();
                if found.is_some() {
                    existing = found.map(|(lsn, state)| (candidate, lsn, state));
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
        });
        for offset in scan.corrupt_offsets.iter().chain(&unknown_namespace) {
            corrupt(
                options,
                &mut report,
                &path,
                *offset as u64,
                "record failed its checksum or names an unknown namespace",
            )?;
        }
        if scan.torn_tail {
            report.torn_tails_cut += 1;
            tracing::info!(file = %path.display(), offset = scan.valid_end, "cut a torn tail");
        }
        log.set_recovered_len(slot, scan.valid_end as u64);
    }
    log.set_next_seq(max_seq + 1);
    index.set_lsn_floor(max_lsn);
    report.duration = started.elapsed();
    tracing::info!(
        records = report.records_replayed,
        corrupt = report.corrupt_records_skipped,
        torn_tails = report.torn_tails_cut,
        expired_segments = report.expired_segments_deleted,
        ms = report.duration.as_millis() as u64,
        "recovered"
    );
    Ok(report)
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
