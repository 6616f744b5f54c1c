//! The index checkpoint: written at a clean close, used by the next open instead of
//! replaying the log when, and only when, it matches the directory exactly.
//!
//! At close ([`write`]), after every segment is sealed, trimmed and synced: the
//! segment list (seq, bucket deadline, length, xxh3 of the whole file), and per shard
//! its entries, state counts and lsn counter, go to `CHECKPOINT.tmp`, which is synced,
//! renamed to `CHECKPOINT`, and the directory synced (`docs/FORMAT.md`).
//!
//! At open ([`take`], then [`restore`]): the file is read, then deleted and the
//! directory synced before anything else happens, so that a checkpoint can never be
//! paired with segments changed after it was read. It is used only if it decodes with
//! every checksum intact, was written with the same shard count and no more
//! namespaces than `NAMESPACES` holds, and the segment files on disk are exactly the
//! ones it lists: same names, same lengths, same content hashes, none expired. Then
//! the segments are registered sealed at their lengths and the index is rebuilt from
//! the entries, one thread per core, without reading a record. In any other case the
//! caller replays the log as if there had been no checkpoint.
//!
//! A read-only open reads the checkpoint with [`read`] instead, leaves it in place
//! and syncs nothing: it changes no file, so the checkpoint still matches afterwards.

use std::path::Path;
use std::sync::Arc;

use crate::error::Error;
use crate::format::checkpoint::{self, EntryInfo, SegmentInfo};
use crate::format::segment_header;
use crate::index::{Index, StateCounts};
use crate::io::{SegmentFile, Vfs};
use crate::log::{Location, Log, Segment, SegmentSlot};

use crate::options::parallelism;

/// Runs `f(part)` for every part in `0..parts`, each on its own thread (part 0 on
/// the caller's); results in part order.
fn for_parts<R: Send>(parts: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    if parts <= 1 {
        return vec![f(0)];
    }
    std::thread::scope(|s| {
        let f = &f;
        let others: Vec<_> = (1..parts).map(|part| s.spawn(move || f(part))).collect();
        let mut results = vec![f(0)];
        results.extend(
            others
                .into_iter()
                .map(|t| t.join().expect("a checkpoint thread panicked")),
        );
        results
    })
}

/// xxh3 of the first `lens[i]` bytes of each file, computed on every core.
fn content_hashes(files: &[(&dyn SegmentFile, u64)]) -> Vec<u64> {
    let parts = parallelism().min(files.len().max(1));
    let hashed = for_parts(parts, |part| {
        (part..files.len())
            .step_by(parts)
            .map(|i| {
                let (file, len) = files[i];
                (
                    i,
                    checkpoint::content_hash(file.read_for_walk(0, len as usize)),
                )
            })
            .collect::<Vec<_>>()
    });
    let mut hashes = vec![0; files.len()];
    for (i, hash) in hashed.into_iter().flatten() {
        hashes[i] = hash;
    }
    hashes
}

/// Writes the checkpoint of a cleanly closed store: every segment is sealed and
/// trimmed, and (with `sync`) every record is synced. With `sync` the trims, the file
/// and the rename are synced too; without (`Durability::None`) nothing is, and the
/// exact match required at open rejects whatever a crash left inconsistent.
///
/// On failure the temp file (and a renamed checkpoint) are removed, best effort; the
/// log is untouched either way.
pub(crate) fn write(
    log: &Log,
    index: &Index,
    vfs: &dyn Vfs,
    namespace_count: usize,
    sync: bool,
    cold_counts: Option<&[[u64; checkpoint::STATES]]>,
) -> Result<Option<u64>, Error> {
    let started = std::time::Instant::now();
    let dir = log.dir();
    let table = log.table.read();
    let mut segments: Vec<&Arc<Segment>> = table.segments().collect();
    segments.sort_by_key(|s| s.seq);
    if segments.len() > checkpoint::SEGMENTS_MAX {
        tracing::warn!(
            segments = segments.len(),
            "too many segments for an index checkpoint; the next open replays the log"
        );
        return Ok(None);
    }
    if sync {
        // The trims of `seal_all` change the files' lengths: make them durable, so
        // the lengths listed below are the ones a power cut leaves.
        for segment in &segments {
            segment
                .file
                .sync_data()
                .map_err(|e| Error::io("syncing trimmed segment", &segment.path, e))?;
        }
    }
    let files: Vec<(&dyn SegmentFile, u64)> = segments
        .iter()
        .map(|s| (s.file.as_ref(), s.published()))
        .collect();
    let hashes = content_hashes(&files);
    let infos: Vec<SegmentInfo> = segments
        .iter()
        .zip(hashes)
        .map(|(s, content_hash)| SegmentInfo {
            seq: s.seq,
            deadline_ms: s.deadline_ms,
            valid_len: s.published(),
            content_hash,
        })
        .collect();
    // Runtime slot -> position in the list.
    let slots_len = segments
        .iter()
        .map(|s| s.slot.0 as usize + 1)
        .max()
        .unwrap_or(0);
    let mut position = vec![u32::MAX; slots_len];
    for (i, segment) in segments.iter().enumerate() {
        position[segment.slot.0 as usize] = i as u32;
    }
    let mut encoder = checkpoint::Encoder::new(index.shard_count(), namespace_count, &infos, 0);
    let mut unlisted = false;
    for (i, shard) in index.shards().enumerate() {
        let shard = shard.lock();
        // The hot keys' counts: the cold tier's keys are in the shard's counts too,
        // and go to COLD_STATE (which the next open adds back).
        let mut counts = shard.counts.counts;
        if let Some(cold) = cold_counts {
            for (count, cold) in counts.iter_mut().zip(cold[i]) {
                *count = count.saturating_sub(cold);
            }
        }
        let entries = shard.entries().map(|(fingerprint, location)| {
            let segment = position
                .get(location.slot.0 as usize)
                .copied()
                .unwrap_or(u32::MAX);
            unlisted |= segment == u32::MAX;
            EntryInfo {
                fingerprint,
                segment: segment.min(checkpoint::SEGMENTS_MAX as u32 - 1),
                offset: location.offset,
            }
        });
        encoder.shard(shard.lsn_counter(), counts, entries);
    }
    drop(table);
    if unlisted {
        // Never expected: every entry points into a segment of the table.
        tracing::error!("an index entry names no known segment; not writing a checkpoint");
        return Ok(None);
    }
    let bytes = encoder.finish();
    let temp = dir.join(crate::layout::CHECKPOINT_TEMP);
    let path = dir.join(crate::layout::CHECKPOINT);
    const OP: &str = "writing the index checkpoint (the log itself is closed cleanly; the next open replays it):";
    let written = crate::io::replace_file(vfs, dir, &temp, &path, &bytes, sync);
    if let Err((e, at)) = written {
        let _ = vfs.remove(&temp);
        let _ = vfs.remove(&path);
        return Err(Error::io(OP, at, e));
    }
    tracing::info!(
        bytes = bytes.len(),
        segments = infos.len(),
        ms = started.elapsed().as_millis() as u64,
        "wrote the index checkpoint"
    );
    Ok(Some(xxhash_rust::xxh3::xxh3_64(&bytes)))
}

/// Reads the checkpoint, if the directory listing `names` has one, and leaves it in
/// place (a read-only open: the store changes nothing, so the checkpoint still
/// matches at the next open). `None` if there is none or it could not be read
/// (logged: the log is replayed).
pub(crate) fn read(vfs: &dyn Vfs, dir: &Path, names: &[String]) -> Option<Vec<u8>> {
    read_named(vfs, dir, names, crate::layout::CHECKPOINT)
}

/// Reads the checkpoint, if the directory listing `names` has one, then deletes it
/// and its temp file and syncs the directory. `Ok(None)` if there is none or it
/// could not be read (logged: the log is replayed). An error only if a file could not
/// be deleted, or the directory synced: a checkpoint left behind must never meet the
/// segments the store is about to change.
pub(crate) fn take(vfs: &dyn Vfs, dir: &Path, names: &[String]) -> Result<Option<Vec<u8>>, Error> {
    take_named(
        vfs,
        dir,
        names,
        [crate::layout::CHECKPOINT, crate::layout::CHECKPOINT_TEMP],
    )
}

/// [`read`] of the file `name` (`CHECKPOINT` or `COLD_STATE`).
pub(crate) fn read_named(
    vfs: &dyn Vfs,
    dir: &Path,
    names: &[String],
    name: &str,
) -> Option<Vec<u8>> {
    if !names.iter().any(|n| n == name) {
        return None;
    }
    let path = dir.join(name);
    match vfs.read_file(&path) {
        Ok(read) => read,
        Err(e) => {
            tracing::warn!(
                file = %path.display(),
                error = %e,
                "could not read a file a clean close wrote; replaying the log"
            );
            None
        }
    }
}

/// [`take`] of the file `[name, its temp file]` (`CHECKPOINT` or `COLD_STATE`).
pub(crate) fn take_named(
    vfs: &dyn Vfs,
    dir: &Path,
    names: &[String],
    files: [&str; 2],
) -> Result<Option<Vec<u8>>, Error> {
    let bytes = read_named(vfs, dir, names, files[0]);
    let mut removed = false;
    for name in files {
        if !names.iter().any(|n| n == name) {
            continue;
        }
        let file = dir.join(name);
        match vfs.remove(&file) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("deleting a file a clean close wrote", &file, e)),
        }
    }
    if removed {
        vfs.sync_dir(dir)
            .map_err(|e| Error::io("syncing directory", dir, e))?;
    }
    Ok(bytes)
}

/// What a restore from a checkpoint found.
pub(crate) struct Restored {
    pub segments: usize,
    pub entries: u64,
    /// The latest creation time of any segment.
    pub clock_floor_ms: u64,
}

/// Rebuilds the log's segment table and the index from checkpoint `bytes`, if it
/// matches the directory exactly (see the module docs).
///
/// With `sync`, the segments are synced once registered (as after a replay); a
/// read-only open passes `false` and changes nothing.
///
/// `Ok(Err(reason))`: it does not match; nothing was changed, and the caller replays.
/// `Err`: an I/O error (opening a listed segment, or syncing one after the log and
/// index were changed).
pub(crate) fn restore(
    bytes: &[u8],
    log: &Log,
    index: &Index,
    namespace_count: usize,
    names: &[String],
    now_ms: u64,
    sync: bool,
) -> Result<Result<Restored, String>, Error> {
    let dir = log.dir();
    let vfs = log.vfs();
    let decoded = match checkpoint::decode(bytes) {
        Ok(decoded) => decoded,
        Err(reason) => return Ok(Err(reason)),
    };
    if decoded.shard_count != index.shard_count() {
        return Ok(Err(format!(
            "written with {} shards, the store opens with {}",
            decoded.shard_count,
            index.shard_count()
        )));
    }
    if decoded.namespace_count > namespace_count {
        return Ok(Err(format!(
            "written with {} namespaces, NAMESPACES holds {namespace_count}",
            decoded.namespace_count
        )));
    }
    // The segment files on disk must be exactly the listed ones.
    let mut on_disk: Vec<(u64, u64)> = names
        .iter()
        .filter_map(|name| crate::layout::parse_segment_file_name(name))
        .map(|(deadline_ms, seq)| (seq, deadline_ms))
        .collect();
    on_disk.sort_unstable();
    let listed: Vec<(u64, u64)> = decoded
        .segments
        .iter()
        .map(|s| (s.seq, s.deadline_ms))
        .collect();
    if on_disk != listed {
        return Ok(Err(format!(
            "the directory holds {} segment files, the checkpoint lists {} (or other names)",
            on_disk.len(),
            listed.len()
        )));
    }
    if let Some(expired) = decoded.segments.iter().find(|s| s.deadline_ms <= now_ms) {
        return Ok(Err(format!(
            "segment seq {} expired since it was written",
            expired.seq
        )));
    }
    let mut files = Vec::with_capacity(decoded.segments.len());
    let mut clock_floor_ms = 0;
    for info in &decoded.segments {
        let path = dir.join(crate::layout::segment_file_name(info.deadline_ms, info.seq));
        let file = match vfs.open_segment(&path) {
            Ok(file) => file,
            // An I/O error, as it would be in a replay (the listing matched, so the
            // file is there): the open fails and the next one replays.
            Err(e) => return Err(Error::io("opening segment", &path, e)),
        };
        if file.capacity() != info.valid_len {
            return Ok(Err(format!(
                "{} is {} bytes, the checkpoint says {}",
                path.display(),
                file.capacity(),
                info.valid_len
            )));
        }
        match segment_header::SegmentHeader::decode(file.read(0, segment_header::LEN)) {
            Ok(header)
                if header.segment_seq == info.seq
                    && header.bucket_deadline_ms == info.deadline_ms =>
            {
                clock_floor_ms = clock_floor_ms.max(header.created_ms);
            }
            _ => return Ok(Err(format!("{}: segment header damaged", path.display()))),
        }
        files.push((path, file));
    }
    let lens: Vec<(&dyn SegmentFile, u64)> = files
        .iter()
        .zip(&decoded.segments)
        .map(|((_, file), info)| (file.as_ref(), info.valid_len))
        .collect();
    let hashes = content_hashes(&lens);
    drop(lens);
    for ((path, _), (info, hash)) in files.iter().zip(decoded.segments.iter().zip(hashes)) {
        if hash != info.content_hash {
            return Ok(Err(format!(
                "{} changed since the checkpoint was written",
                path.display()
            )));
        }
    }

    // It matches: register the segments, then rebuild the index.
    let mut slots: Vec<SegmentSlot> = Vec::with_capacity(files.len());
    for ((path, file), info) in files.iter().zip(&decoded.segments) {
        slots.push(log.add_recovered(|slot| {
            Segment::recovered(
                slot,
                info.seq,
                info.deadline_ms,
                path.clone(),
                Arc::clone(file),
                info.valid_len,
            )
        })?);
    }
    let parts = parallelism().min(index.shard_count());
    for_parts(parts, |part| {
        for i in (part..index.shard_count()).step_by(parts) {
            let block = &decoded.shards[i];
            let mut shard = index.lock_at(i);
            shard.reserve(block.len());
            for entry in block.entries() {
                shard.insert_restored(
                    entry.fingerprint,
                    Location {
                        slot: slots[entry.segment as usize],
                        offset: entry.offset,
                    },
                );
            }
            shard.counts = StateCounts {
                counts: block.state_counts,
            };
            shard.restore_lsn_counter(block.lsn_counter);
        }
    });
    // As after a replay: what the store answers from must be durable (the close that
    // wrote the checkpoint may have run without syncing, in `Durability::None`).
    for (path, file) in files.iter().filter(|_| sync) {
        file.sync_data()
            .map_err(|e| Error::io("syncing recovered segment", path, e))?;
    }
    let max_seq = decoded.segments.last().map_or(0, |s| s.seq);
    log.set_next_seq(max_seq.saturating_add(1));
    Ok(Ok(Restored {
        segments: files.len(),
        entries: decoded.entry_count,
        clock_floor_ms,
    }))
}
