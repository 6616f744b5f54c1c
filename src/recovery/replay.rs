//! The replay: every live segment's records into the index, on every core.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use parking_lot::MutexGuard;

use super::survey::{self, RecordSurvey};
use crate::addr::Lsn;
use crate::cold::Screen;
use crate::format::cold_index::Sections;
use crate::format::record::{self, State, StoredRecord};
use crate::index::{Index, KeyHash, Shard};
use crate::io::SegmentFile;
use crate::log::{Location, Log, SegmentSlot};

/// A segment registered in the log, waiting to be replayed.
pub(super) struct Pending {
    pub slot: SegmentSlot,
    pub path: PathBuf,
    pub file: Arc<dyn SegmentFile>,
    /// Its bucket's deadline and its seq, from its header: with the offset, a record's
    /// place in the log's order.
    pub deadline_ms: u64,
    pub seq: u64,
    /// Where its replay starts: past the header, or past the records a spill walked
    /// (their entries are in the cold tier).
    pub from: usize,
}

impl Pending {
    pub(super) fn bytes(&self) -> &[u8] {
        self.file.read(0, self.file.capacity() as usize)
    }
}

/// A decoded record on its way to the thread that holds its shard: what applying it
/// needs, without decoding it again (its key is read back only if the shard already
/// holds an entry with the same fingerprint).
struct Routed {
    hash: KeyHash,
    lsn: Lsn,
    offset: u32,
    state: State,
}

/// One segment's records for one thread's shards.
struct Batch {
    segment: usize,
    records: Vec<Routed>,
}

/// Replays every pending segment; the survey of each one's records, in order, and the
/// key hashes of the records that a generation in `cold` may hold (`Screen`: only
/// their entries are reconciled with the cold tier).
///
/// Up to one thread per core. Each locks its own share of the shards (`shard % parts`)
/// for the whole replay, so applying a record takes no lock operation (a locked
/// instruction per record would serialize the table's cache misses) and no two
/// threads ever share a shard. The segments are split between the threads: each
/// decodes and verifies the segments it takes (every record is decoded, checksummed
/// and hashed once, by one thread), applies the records of its own shards, and hands
/// each other thread its records in one batch per segment; between segments, and once
/// no segment is left, it applies the batches handed to it.
pub(super) fn replay_all(
    log: &Log,
    index: &Index,
    pending: &[Pending],
    namespace_count: usize,
    cold: &[&Sections],
) -> (Vec<RecordSurvey>, Vec<u64>) {
    let parts = crate::options::parallelism()
        .min(index.shard_count())
        .min(pending.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..parts).map(|_| mpsc::channel()).unzip();
    let worker = Worker {
        log,
        index,
        pending,
        namespace_count,
        parts,
        next: &next,
        cold,
    };
    let (mut surveys, hits) = std::thread::scope(|s| {
        let mut receivers = receivers.into_iter();
        let own = receivers.next().expect("at least one part");
        let others: Vec<_> = receivers
            .enumerate()
            .map(|(i, inbox)| {
                let senders = senders.clone();
                let worker = &worker;
                s.spawn(move || worker.run(i + 1, senders, inbox))
            })
            .collect();
        // Every thread holds the senders it needs: once all have run out of
        // segments and dropped theirs, each inbox ends.
        let (mut surveys, mut hits) = worker.run(0, senders, own);
        for other in others {
            let (more, more_hits) = other.join().expect("a recovery thread panicked");
            surveys.extend(more);
            hits.extend(more_hits);
        }
        (surveys, hits)
    });
    surveys.sort_unstable_by_key(|&(segment, _)| segment);
    debug_assert!(surveys.iter().enumerate().all(|(i, &(s, _))| i == s));
    (
        surveys.into_iter().map(|(_, survey)| survey).collect(),
        hits,
    )
}

struct Worker<'a> {
    log: &'a Log,
    index: &'a Index,
    pending: &'a [Pending],
    namespace_count: usize,
    parts: usize,
    next: &'a AtomicUsize,
    cold: &'a [&'a Sections],
}

impl Worker<'_> {
    /// Thread `part`'s replay: the surveys of the segments it decoded, and the key
    /// hashes among their records that the cold tier's filters may hold.
    fn run(
        &self,
        part: usize,
        senders: Vec<mpsc::Sender<Batch>>,
        inbox: mpsc::Receiver<Batch>,
    ) -> (Vec<(usize, RecordSurvey)>, Vec<u64>) {
        let index = self.index;
        let mut shards: Vec<MutexGuard<'_, Shard>> = (part..index.shard_count())
            .step_by(self.parts)
            .map(|i| index.lock_at(i))
            .collect();
        let mut surveys = Vec::new();
        let mut screen = Screen::new(self.cold);
        loop {
            let segment = self.next.fetch_add(1, Ordering::Relaxed);
            if segment >= self.pending.len() {
                break;
            }
            let mut outboxes: Vec<Vec<Routed>> = (0..self.parts).map(|_| Vec::new()).collect();
            let pending = &self.pending[segment];
            let from = pending.from;
            let bytes = pending
                .file
                .read_for_walk(from, pending.file.capacity() as usize);
            let survey =
                survey::scan_records(bytes, from, self.namespace_count, |offset, record| {
                    let hash = KeyHash::of_record(record);
                    screen.push(hash);
                    outboxes[index.shard_of(hash) % self.parts].push(Routed {
                        hash,
                        lsn: record.lsn,
                        offset: offset as u32,
                        state: record.state,
                    });
                });
            surveys.push((segment, survey));
            for (to, records) in outboxes.into_iter().enumerate() {
                let batch = Batch { segment, records };
                if to == part {
                    self.apply(&mut shards, batch);
                } else if !batch.records.is_empty() {
                    senders[to]
                        .send(batch)
                        .expect("every replay thread receives until all senders are gone");
                }
            }
            while let Ok(batch) = inbox.try_recv() {
                self.apply(&mut shards, batch);
            }
        }
        drop(senders);
        for batch in inbox {
            self.apply(&mut shards, batch);
        }
        (surveys, screen.finish())
    }

    /// Applies a batch of records of this thread's shards.
    fn apply(&self, shards: &mut [MutexGuard<'_, Shard>], batch: Batch) {
        let segment = &self.pending[batch.segment];
        let bytes = segment.bytes();
        for routed in &batch.records {
            let shard = self.index.shard_of(routed.hash) / self.parts;
            let location = Location {
                slot: segment.slot,
                offset: routed.offset,
            };
            let order = (segment.deadline_ms, segment.seq, routed.offset);
            apply(
                self.log,
                &mut shards[shard],
                routed,
                location,
                order,
                || {
                    record::decode(&bytes[routed.offset as usize..])
                        .expect("the scan decoded this record")
                        .0
                },
            );
        }
    }
}

/// Makes the record at `location` the indexed state of its key unless a newer record
/// already is. `record` decodes it again, only needed if the shard holds an entry with
/// the same fingerprint (the same key written twice, or a fingerprint collision).
///
/// Newer is the higher LSN. The writer never gives two records the same LSN, but a
/// damaged or hand-assembled directory can hold a key's record twice under one LSN (in
/// segments of different buckets, so with different expiries): then the one later in
/// the log's order, `order` = (bucket deadline, segment seq, offset), wins, so the
/// answer is the same at every open whatever order the replay threads apply them in.
fn apply<'r>(
    log: &Log,
    shard: &mut Shard,
    routed: &Routed,
    location: Location,
    order: (u64, u64, u32),
    record: impl FnOnce() -> StoredRecord<'r>,
) {
    let mut existing = None;
    let mut record = Some(record);
    let mut key: Option<StoredRecord<'r>> = None;
    let held: &Shard = shard;
    held.find(routed.hash, |candidate| {
        let ours = key.get_or_insert_with(|| (record.take().expect("decoded once"))());
        let found = log
            .with_record(held, candidate, |segment, other| {
                (other.namespace_id == ours.namespace_id
                    && other.placement.partition == ours.placement.partition
                    && other.id == ours.id)
                    .then(|| {
                        let at = (segment.deadline_ms, segment.seq, candidate.offset);
                        ((other.lsn, at), other.state)
                    })
            })
            .ok()
            .flatten();
        if let Some((newest, state)) = found {
            existing = Some((candidate, newest, state));
        }
        found.is_some()
    });
    match existing {
        Some((_, newest, _)) if newest >= (routed.lsn, order) => {}
        Some((old, _, old_state)) => {
            shard.upsert(routed.hash, Some(old), location);
            shard.counts.sub(old_state);
            shard.counts.add(routed.state);
        }
        None => {
            shard.upsert(routed.hash, None, location);
            shard.counts.add(routed.state);
        }
    }
}
