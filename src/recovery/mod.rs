//! Recovery: rebuild the index at open, from the checkpoint or by replaying every live
//! segment.
//!
//! 0. The directory is surveyed ([`survey`]): every file classified, nothing changed.
//!    Files that are not ours are counted and left alone.
//! 1. An index checkpoint left by a clean close is read and deleted (`checkpoint`);
//!    if it matches the directory exactly, the index is rebuilt from it and nothing
//!    below runs (no record is read). Otherwise, and without one:
//! 2. A segment with a damaged header, or whose header disagrees with its name, is
//!    counted as corrupt and skipped (in strict mode: `Error::Corruption`).
//! 3. Records are replayed in any order, by several threads at once: for each key the
//!    record with the highest lsn wins. A damaged record followed by valid ones is
//!    counted and skipped (in strict mode: `Error::Corruption`); a record naming a
//!    namespace `NAMESPACES` does not hold is refused in any mode.
//! 4. Only once nothing more can be refused is the directory changed: segments whose
//!    bucket deadline has passed are deleted unread, segments that are all zeros (a
//!    crash right after one was created) are deleted, a damaged tail with nothing valid
//!    after it (a torn write) is cut, and every replayed segment is synced.
//!
//! In read-only mode step 4 changes nothing on disk: the checkpoint is read and left
//! in place, expired and empty segments are left unregistered and in place, a torn
//! tail is cut only in memory (the segment's length), and nothing is synced.

mod replay;
pub(crate) mod survey;

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use self::replay::Pending;
use self::survey::Verdict;
use crate::addr::Lsn;
use crate::checkpoint;
use crate::error::{Corruption, Error};
use crate::format::segment_header;
use crate::index::Index;
use crate::io::Vfs;
use crate::log::{Log, Segment};
use crate::options::Options;

/// What recovery found.
#[derive(Debug, Clone, Default)]
pub(crate) struct RecoveryReport {
    pub records_replayed: u64,
    pub corrupt_records_skipped: u64,
    /// Torn tails cut (in read-only mode, only from the in-memory length).
    pub torn_tails_cut: u64,
    pub foreign_files: u64,
    /// Expired segments deleted (in read-only mode: found, left in place).
    pub expired_segments: u64,
    /// All-zero segments deleted (in read-only mode: found, left in place).
    pub empty_segments: u64,
    /// The index was rebuilt from a checkpoint written at a clean close, not by replay.
    pub opened_from_checkpoint: bool,
    /// The latest creation time of any segment: the store's clock never reads earlier.
    pub clock_floor_ms: u64,
    /// The highest source offset of each partition `(namespace id, partition)` among
    /// the records replayed (empty when opened from the checkpoint, which a clean close
    /// writes after `PARTITIONS` has every offset).
    pub highest_offsets: std::collections::HashMap<(u32, u32), u64>,
    pub duration: std::time::Duration,
    /// The cold index files an earlier open left, checked and ready to be taken over
    /// (`Arc` so the report stays `Clone`).
    pub cold: Option<Arc<crate::cold::Reused>>,
    /// The replay skipped the records spills walked: the hot entries must be
    /// reconciled with the cold tier once it is restored (`ColdTier::reconcile`),
    /// those of these key hashes (the replayed keys some generation's filter may
    /// hold) alone.
    pub cold_reconcile: Option<Vec<u64>>,
}

/// Average bytes per record assumed when sizing the index before replay.
const RECORD_LEN_ESTIMATE: u64 = 48;

/// Rebuilds `index` and `log`'s segment table from the directory of `log`. With
/// `read_only`, changes nothing in the directory (see the module docs). Without
/// `reuse_cold`, the cold state is ignored (the generation files are rebuilt).
pub(crate) fn recover(
    log: &Log,
    index: &Index,
    vfs: &dyn Vfs,
    options: &Options,
    namespace_count: usize,
    read_only: bool,
    reuse_cold: bool,
) -> Result<RecoveryReport, Error> {
    let started = Instant::now();
    let dir = log.dir().to_path_buf();
    let now_ms = options.clock.now().0;
    let mut report = RecoveryReport::default();
    let names = vfs.list(&dir).map_err(|e| Error::io("listing", &dir, e))?;
    let survey = survey::survey(vfs, &dir, &names, now_ms)?;
    let survey_ms = started.elapsed().as_millis() as u64;
    for name in &survey.foreign {
        tracing::warn!(file = %name, "ignoring a file idemstore did not write");
        report.foreign_files += 1;
    }
    let checkpoint = if read_only {
        checkpoint::read(vfs, &dir, &names)
    } else {
        checkpoint::take(vfs, &dir, &names)?
    };
    // Kept in place: it stays true of the generation files this open takes over
    // (deleted with them by `ColdTier::remove_leftovers` otherwise).
    let cold_state = reuse_cold
        .then(|| checkpoint::read_named(vfs, &dir, &names, crate::layout::COLD_STATE))
        .flatten();
    if let Some(bytes) = checkpoint {
        // The checkpoint holds the hot entries only: with cold index files in the
        // directory it is used only together with the cold state written with it.
        let has_cold = names
            .iter()
            .any(|n| crate::layout::is_cold_file(n) && !n.ends_with(".tmp"));
        let cold = match (has_cold, &cold_state) {
            (false, _) => Ok(None),
            (true, None) => Err("cold index files without a cold state".to_string()),
            (true, Some(state)) => crate::cold::load(
                vfs,
                &dir,
                &names,
                state,
                Some(&bytes),
                options.shards,
                now_ms,
            )?
            .map(Some),
        };
        let restored = match cold {
            Ok(cold) => {
                let sync = !read_only;
                checkpoint::restore(&bytes, log, index, namespace_count, &names, now_ms, sync)?
                    .map(|restored| (restored, cold))
            }
            Err(reason) => Err(format!("the cold index files cannot be reused: {reason}")),
        };
        match restored {
            Ok((restored, cold)) => {
                report.cold = cold.map(Arc::new);
                report.opened_from_checkpoint = true;
                report.clock_floor_ms = restored.clock_floor_ms;
                report.duration = started.elapsed();
                tracing::info!(
                    keys = restored.entries,
                    segments = restored.segments,
                    cold_generations = report.cold.as_ref().map_or(0, |c| c.generations()),
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

    // The generation files an earlier open left, with the state it wrote last: only
    // the records no spill walked are replayed (`cold::persist`).
    let phase = Instant::now();
    let reused = match &cold_state {
        Some(state) => {
            match crate::cold::load(vfs, &dir, &names, state, None, options.shards, now_ms)?
                .and_then(|reused| {
                    covered_segments_agree(&reused, &survey, now_ms).map(|()| reused)
                }) {
                Ok(reused) => Some(reused),
                Err(reason) => {
                    tracing::warn!(
                        reason,
                        "the cold index files cannot be reused; replaying the whole log"
                    );
                    None
                }
            }
        }
        None => None,
    };
    let cold_load_ms = phase.elapsed().as_millis() as u64;
    let covered = reused.as_ref().map(|r| r.covered()).unwrap_or_default();
    let mut pending = Vec::new();
    for segment in &survey.segments {
        match &segment.verdict {
            Verdict::Damaged(damage) => corrupt(options, &mut report, damage)?,
            Verdict::Live(header) => {
                let from = match covered.get(&header.segment_seq) {
                    Some(&(len, deadline)) if deadline == header.bucket_deadline_ms => {
                        (len as usize).max(segment_header::LEN)
                    }
                    _ => segment_header::LEN,
                };
                report.clock_floor_ms = report.clock_floor_ms.max(header.created_ms);
                let slot = log.add_recovered(|slot| {
                    Segment::recovered(
                        slot,
                        header.segment_seq,
                        header.bucket_deadline_ms,
                        segment.path.clone(),
                        Arc::clone(&segment.file),
                        segment.file.capacity(),
                    )
                })?;
                pending.push(Pending {
                    slot,
                    path: segment.path.clone(),
                    file: Arc::clone(&segment.file),
                    deadline_ms: header.bucket_deadline_ms,
                    seq: header.segment_seq,
                    from,
                });
            }
            Verdict::Expired | Verdict::Empty => {}
        }
    }

    let total_bytes: u64 = pending
        .iter()
        .map(|p| p.file.capacity().saturating_sub(p.from as u64))
        .sum();
    index.reserve(usize::try_from(total_bytes / RECORD_LEN_ESTIMATE).unwrap_or(usize::MAX));
    let phase = Instant::now();
    let filters = reused.as_ref().map(|r| r.sections()).unwrap_or_default();
    let (surveys, screened) = replay::replay_all(log, index, &pending, namespace_count, &filters);
    let replay_ms = phase.elapsed().as_millis() as u64;
    let mut max_lsn = Lsn(0);
    for (segment, records) in pending.iter().zip(&surveys) {
        max_lsn = max_lsn.max(records.max_lsn);
        report.records_replayed += records.records;
        for (&key, &offset) in &records.highest_offsets {
            let highest = report.highest_offsets.entry(key).or_insert(offset);
            *highest = (*highest).max(offset);
        }
        for finding in records.findings(&segment.path, segment.bytes()) {
            if finding.always_refused {
                return Err(Error::Corruption(finding.damage));
            }
            corrupt(options, &mut report, &finding.damage)?;
        }
    }

    // Nothing more can be refused: from here on the directory changes (unless
    // read-only).
    let phase = Instant::now();
    for segment in &survey.segments {
        let (what, count) = match segment.verdict {
            Verdict::Expired => ("deleting expired segment", &mut report.expired_segments),
            Verdict::Empty => ("deleting empty segment", &mut report.empty_segments),
            Verdict::Damaged(_) | Verdict::Live(_) => continue,
        };
        *count += 1;
        if !read_only {
            remove(vfs, &segment.path, what)?;
        }
    }
    for (segment, records) in pending.iter().zip(&surveys) {
        if records.scan.torn_tail {
            report.torn_tails_cut += 1;
            tracing::info!(file = %segment.path.display(), offset = records.scan.valid_end, "cut a torn tail");
        }
        let valid_end = records.scan.valid_end as u64;
        if read_only {
            if let Some(recovered) = log.table.read().get(segment.slot) {
                recovered.set_recovered_len(valid_end);
            }
            continue;
        }
        log.set_recovered_len(segment.slot, valid_end);
        // What was just replayed may exist only in the page cache (a kill -9 in
        // `Interval` mode, or a failed fsync and a reopen in the same boot), yet the
        // store will answer `Duplicate` from it as durable: make it durable first.
        segment
            .file
            .sync_data()
            .map_err(|e| Error::io("syncing recovered segment", &segment.path, e))?;
    }
    let sync_ms = phase.elapsed().as_millis() as u64;
    // Saturating: a file named with seq u64::MAX (damage, or not ours) must not panic.
    log.set_next_seq(survey.max_seq.saturating_add(1));
    index.set_lsn_floor(max_lsn);
    if let Some(reused) = reused {
        // What the skipped records would have told: their lsns and source offsets.
        if let Some(floor) = reused.lsn_floor().checked_sub(1) {
            index.set_lsn_floor(Lsn::new(floor, 0));
        }
        for (key, offset) in reused.highest_offsets() {
            let highest = report.highest_offsets.entry(key).or_insert(offset);
            *highest = (*highest).max(offset);
        }
        report.cold_reconcile = Some(screened);
        report.cold = Some(Arc::new(reused));
    }
    report.duration = started.elapsed();
    tracing::info!(
        records = report.records_replayed,
        segments = pending.len(),
        corrupt = report.corrupt_records_skipped,
        torn_tails = report.torn_tails_cut,
        expired_segments = report.expired_segments,
        empty_segments = report.empty_segments,
        read_only,
        ms = report.duration.as_millis() as u64,
        survey_ms,
        cold_load_ms,
        replay_ms,
        sync_ms,
        "recovered"
    );
    Ok(report)
}

/// Every segment the cold state says a spill walked, and whose bucket is live, must be
/// a live segment at least as long as the walked part: the replay skips that part.
fn covered_segments_agree(
    reused: &crate::cold::Reused,
    survey: &survey::Survey,
    now_ms: u64,
) -> Result<(), String> {
    let live: std::collections::HashMap<(u64, u64), u64> = survey
        .segments
        .iter()
        .filter_map(|s| match &s.verdict {
            Verdict::Live(header) => Some((
                (header.segment_seq, header.bucket_deadline_ms),
                s.file.capacity(),
            )),
            _ => None,
        })
        .collect();
    for (seq, (covered_len, deadline_ms)) in reused.covered() {
        if deadline_ms <= now_ms {
            continue;
        }
        match live.get(&(seq, deadline_ms)) {
            Some(&len) if len >= covered_len => {}
            Some(&len) => {
                return Err(format!(
                    "segment seq {seq} is {len} bytes, shorter than the {covered_len} a spill walked"
                ));
            }
            None => {
                return Err(format!(
                    "segment seq {seq}, which a spill walked, is not live"
                ));
            }
        }
    }
    Ok(())
}

/// Deletes a segment recovery does not keep.
fn remove(vfs: &dyn Vfs, path: &Path, what: &'static str) -> Result<(), Error> {
    vfs.remove(path).map_err(|e| Error::io(what, path, e))
}

/// Skips and counts `damage`, or refuses it in strict mode.
fn corrupt(
    options: &Options,
    report: &mut RecoveryReport,
    damage: &Corruption,
) -> Result<(), Error> {
    if options.strict {
        return Err(Error::Corruption(damage.clone()));
    }
    tracing::error!(
        file = %damage.file.display(),
        offset = damage.offset,
        reason = damage.reason,
        "skipping damaged data"
    );
    report.corrupt_records_skipped += 1;
    Ok(())
}
