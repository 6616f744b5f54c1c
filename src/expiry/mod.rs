//! Expiry: retiring the buckets whose deadline has passed, unindexing their keys,
//! deleting their files, and the reaper thread that does it in the background.
//!
//! A reap round:
//! 1. `Log::retire_through(now)`: no append goes to those buckets any more; their
//!    segments are sealed.
//! 2. Each segment's own records are walked; an index entry that still points at
//!    that exact record is removed (O(expired keys), no scan of the index).
//! 3. The segments leave the log's directory (`Log::unpublish`): no new read finds
//!    them.
//! 4. A grace period (`Index::drain_readers`) takes every shard lock once, so every
//!    read that loaded a segment pointer before step 3 is over. If the walk of step 2
//!    met a record that no longer decodes, its entry may still be in the index: the
//!    same pass then removes every entry that points into a retired segment, by slot,
//!    whatever the files say.
//! 5. Only then are the slots freed, the files deleted and the memory let go
//!    (`Log::delete_segments`, which runs the grace period itself and holds each
//!    segment in an `Unpublished` handle until then).

pub(crate) mod deadline;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::addr::{Location, SegmentSlot};
use crate::clock::UnixMs;
use crate::error::Error;
use crate::format::record::State;
use crate::format::segment_header;
use crate::index::{Index, KeyHash};
use crate::log::{Log, reader};

/// The expiry state of one store.
#[derive(Default)]
pub(crate) struct Expiry {
    /// Held while reaping, so `expire_now` returns only after every bucket retired
    /// before it (possibly by the background reaper) is unindexed, and a checkpoint
    /// lists no segment a reap is deleting.
    reaping: Mutex<()>,
    stop: Mutex<bool>,
    wake: Condvar,
    expired_buckets: AtomicU64,
    expired_keys: AtomicU64,
    /// Index entries removed by slot after a walk met damaged records.
    swept_entries: AtomicU64,
}

impl Expiry {
    /// Buckets expired and keys forgotten since open.
    pub(crate) fn totals(&self) -> (u64, u64) {
        (
            self.expired_buckets.load(Ordering::Relaxed),
            self.expired_keys.load(Ordering::Relaxed),
        )
    }

    /// Counts keys and files expiry forgot outside `reap` (the cold tier's).
    pub(crate) fn count_forgotten(&self, keys: u64, _files: u64) {
        self.expired_keys.fetch_add(keys, Ordering::Relaxed);
    }

    /// No reap runs while the guard lives.
    pub(crate) fn pause(&self) -> MutexGuard<'_, ()> {
        self.reaping.lock()
    }

    /// Expires every bucket whose deadline is at or before `now`. Returns the keys
    /// forgotten.
    pub(crate) fn reap(&self, log: &Log, index: &Index, now: UnixMs) -> Result<u64, Error> {
        let _reaping = self.reaping.lock();
        let segments = log.retire_through(now.0);
        if segments.is_empty() {
            return Ok(0);
        }
        let started = Instant::now();
        // Stripes may cache a retired segment as their active one: drop those handles
        // so the deleted files are unmapped.
        log.forget_active_through(now.0);
        let mut forgotten = 0;
        let mut deadlines = BTreeSet::new();
        let mut damaged: Vec<SegmentSlot> = Vec::new();
        let mut unpublished = Vec::with_capacity(segments.len());
        for segment in &segments {
            deadlines.insert(segment.deadline_ms);
            let bytes = segment
                .file
                .read_for_walk(segment_header::LEN, segment.published() as usize);
            let report = reader::scan(bytes, segment_header::LEN, |offset, record| {
                let hash = KeyHash::of_record(&record);
                let location = Location {
                    slot: segment.slot,
                    offset: offset as u32,
                };
                let mut shard = index.lock(hash);
                if shard.remove_at(hash, location) {
                    let state = shard.effective_state(record.state, record.lsn);
                    shard.counts.sub(state);
                    if state != State::Tombstone {
                        forgotten += 1;
                    }
                }
            });
            // Every byte published decoded as a record: every entry into this segment
            // was met. Otherwise some may be left for the sweep by slot.
            if report.valid_end < bytes.len() || !report.corrupt_offsets.is_empty() {
                damaged.push(segment.slot);
            }
            unpublished.push(log.unpublish(segment));
        }
        let read = |location: Location| {
            let segment = segments.iter().find(|s| s.slot == location.slot)?;
            let record = segment.read(location.offset).ok()?;
            Some((record.state, record.lsn))
        };
        let (drained, deleted) =
            log.delete_segments(unpublished, || index.drain_readers(&damaged, read));
        if drained.swept > 0 {
            tracing::warn!(
                entries = drained.swept,
                unreadable = drained.unreadable,
                "removed index entries of expired segments whose records no longer decode"
            );
            self.swept_entries
                .fetch_add(drained.swept, Ordering::Relaxed);
            forgotten += drained.swept;
        }
        deleted?;
        self.expired_buckets
            .fetch_add(deadlines.len() as u64, Ordering::Relaxed);
        self.expired_keys.fetch_add(forgotten, Ordering::Relaxed);
        tracing::info!(
            buckets = deadlines.len(),
            segments = segments.len(),
            keys = forgotten,
            oldest_deadline_ms = deadlines.first().copied().unwrap_or(0),
            lag_ms = now
                .0
                .saturating_sub(deadlines.first().copied().unwrap_or(now.0)),
            ms = started.elapsed().as_millis() as u64,
            "expired buckets"
        );
        Ok(forgotten)
    }

    /// Starts the reaper thread: `reap` every `period_ms`, while `store` lives.
    /// `reap` gets the store back for one round only, so dropping the last handle
    /// closes the store without waiting for this thread.
    pub(crate) fn spawn<S: Send + Sync + 'static>(
        self: &Arc<Self>,
        store: Weak<S>,
        period_ms: u64,
        reap: fn(&S) -> Result<u64, Error>,
    ) -> JoinHandle<()> {
        let expiry = Arc::clone(self);
        std::thread::Builder::new()
            .name("idemstore-reaper".to_string())
            .spawn(move || {
                loop {
                    {
                        let Some(strong) = store.upgrade() else {
                            return;
                        };
                        if let Err(e) = reap(&strong) {
                            tracing::error!(error = %e, "expiring buckets failed; will retry");
                        }
                    }
                    let mut stop = expiry.stop.lock();
                    if !*stop {
                        expiry
                            .wake
                            .wait_for(&mut stop, Duration::from_millis(period_ms));
                    }
                    if *stop {
                        return;
                    }
                }
            })
            .expect("spawning the idemstore reaper thread")
    }

    /// Stops the reaper thread after its current round.
    pub(crate) fn stop(&self) {
        *self.stop.lock() = true;
        self.wake.notify_all();
    }
}
