//! The replay: every live segment's records into the index, on every core.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::MutexGuard;

use super::survey::{self, RecordSurvey};
use crate::format::record::StoredRecord;
use crate::index::{Index, KeyHash, Shard};
use crate::io::SegmentFile;
use crate::log::{Location, Log, SegmentSlot};

/// A segment registered in the log, waiting to be replayed.
pub(super) struct Pending {
    pub slot: SegmentSlot,
    pub path: PathBuf,
    pub file: Arc<dyn SegmentFile>,
}

impl Pending {
    pub(super) fn bytes(&self) -> &[u8] {
        self.file.read(0, self.file.capacity() as usize)
    }
}

/// Replays every pending segment; the survey of each one's records, in order.
///
/// Each of up to one thread per core locks its own share of the shards for the whole
/// replay, reads every segment and applies only the records of its shards: no lock
/// operation per record (a locked instruction per record would serialize the table's
/// cache misses), and no two threads ever share a shard. Reading and hashing a record
/// once per thread costs far less.
pub(super) fn replay_all(
    log: &Log,
    index: &Index,
    pending: &[Pending],
    namespace_count: usize,
) -> Vec<RecordSurvey> {
    let parts = crate::options::parallelism().min(index.shard_count());
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
/// survey (records, damage) covers the whole segment.
fn replay(
    log: &Log,
    index: &Index,
    shards: &mut [MutexGuard<'_, Shard>],
    segment: &Pending,
    namespace_count: usize,
    part: usize,
    parts: usize,
) -> RecordSurvey {
    survey::scan_records(segment.bytes(), namespace_count, |offset, record| {
        let hash = KeyHash::of_record(record);
        let shard = index.shard_of(hash);
        if shard % parts == part {
            apply(
                log,
                &mut shards[shard / parts],
                hash,
                segment.slot,
                offset,
                record,
            );
        }
    })
}

/// Makes `record` the indexed state of its key unless a newer record already is.
fn apply(
    log: &Log,
    shard: &mut Shard,
    hash: KeyHash,
    slot: SegmentSlot,
    offset: usize,
    record: &StoredRecord<'_>,
) {
    let location = Location {
        slot,
        offset: offset as u32,
    };
    let mut existing = None;
    let held: &Shard = shard;
    held.find(hash, |candidate| {
        let found = log
            .with_record(held, candidate, |_, other| {
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
