//! The reconciliation after an open that replayed only what no spill walked
//! (`persist` has the rest of the reuse): the writes made after the last cold state
//! shadowed cold entries in RAM only, and their records are the hot entries now.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{ColdTier, Generation};
use crate::addr::Location;
use crate::error::Error;
use crate::format::record::State;
use crate::index::{Index, KeyHash};
use crate::log::Log;

impl ColdTier {
    /// After an open that replayed only the records no spill walked: each hot entry's
    /// key is probed in every generation and the newest of its records wins. A cold
    /// entry with a lower lsn is killed (a write after the state was written shadowed
    /// it; the kill was in RAM only) and its key taken out of the cold counts; a hot
    /// entry with a lower lsn than a cold one (an older record of a re-created key,
    /// which no spill walked) is dropped. Runs after `Index::finish_recovery`, so states
    /// are counted as this open sees them. Cost: a record read and the filter probes
    /// per hot key. Returns how many of the claims `finish_recovery` counted as
    /// released it took out again (claims in progress whose entry it killed or dropped:
    /// no claim was in progress there when the process died). `open_counters` are the
    /// cold state's (`restore` returns them): which of its claims it counted in progress.
    pub(crate) fn reconcile(
        &self,
        log: &Log,
        index: &Index,
        open_counters: &[u64],
    ) -> Result<u64, Error> {
        if self.is_empty() {
            return Ok(0);
        }
        let generations: Vec<Arc<Generation>> = self.generations.read().clone();
        // Shards are independent (a key lives in one): spread them over threads, more
        // than the cores, since a filter hit waits for a page from the disk when the
        // page cache does not hold the generations (after a crash at 500M keys, 2
        // threads took 4.2 s for 1.8M keys with the page cache dropped).
        let next_shard = AtomicUsize::new(0);
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .saturating_mul(4)
            .min(index.shard_count());
        let results: Vec<Result<(u64, u64, u64), Error>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut totals = (0, 0, 0);
                        loop {
                            let shard_index = next_shard.fetch_add(1, Ordering::Relaxed);
                            if shard_index >= index.shard_count() {
                                return Ok(totals);
                            }
                            let (k, d, c) = self.reconcile_shard(
                                log,
                                index,
                                shard_index,
                                &generations,
                                open_counters,
                            )?;
                            totals = (totals.0 + k, totals.1 + d, totals.2 + c);
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("a reconciliation thread panicked"))
                .collect()
        });
        let (mut killed, mut dropped, mut claims) = (0, 0, 0);
        for result in results {
            let (k, d, c) = result?;
            killed += k;
            dropped += d;
            claims += c;
        }
        if killed + dropped > 0 {
            tracing::info!(
                killed,
                dropped,
                "reconciled the replayed hot entries with the cold tier"
            );
        }
        Ok(claims)
    }

    /// `reconcile` of one shard: returns (cold entries killed, hot entries dropped,
    /// claims uncounted).
    fn reconcile_shard(
        &self,
        log: &Log,
        index: &Index,
        shard_index: usize,
        generations: &[Arc<Generation>],
        open_counters: &[u64],
    ) -> Result<(u64, u64, u64), Error> {
        let (mut killed, mut dropped, mut claims) = (0, 0, 0);
        let mut positions = Vec::new();
        let mut shard = index.lock_at(shard_index);
        let hot: Vec<Location> = shard.entries().map(|(_, at)| at).collect();
        for location in hot {
            let (hash, lsn, state, namespace_id, partition, id) =
                log.with_record(&shard, location, |_, record| {
                    (
                        KeyHash::of_record(&record),
                        record.lsn,
                        record.state,
                        record.namespace_id,
                        record.placement.partition,
                        record.id.to_vec(),
                    )
                })?;
            // Every live cold record of the key: (generation, position, entry, lsn, state).
            // The filters' reads start together, as in `find` (`prefetch.rs`).
            for generation in generations {
                generation.sections.prefetch(hash.0);
            }
            let mut cold = Vec::new();
            for generation in generations {
                self.each_record(
                    generation,
                    hash,
                    &mut positions,
                    |position, entry, record| {
                        if record.namespace_id == namespace_id
                            && record.placement.partition == partition
                            && record.id == id.as_slice()
                        {
                            cold.push((generation, position, entry, record.lsn, record.state));
                        }
                    },
                )?;
            }
            let newest = cold.iter().map(|c| c.3).max();
            for &(generation, position, entry, cold_lsn, cold_state) in &cold {
                if newest == Some(cold_lsn) && cold_lsn > lsn {
                    continue;
                }
                let row = entry.segment as usize;
                generation.kill(position, entry.trusted());
                let counted = shard.effective_state(cold_state, cold_lsn);
                if generation.count_sub(row, shard_index, counted) {
                    shard.counts.sub(counted);
                    // Counted in progress by the process that wrote the state
                    // (then released by `finish_recovery`), or released already.
                    claims += u64::from(
                        cold_state == State::InProgress
                            && open_counters
                                .get(shard_index)
                                .is_some_and(|&open| cold_lsn.counter() >= open),
                    );
                }
                killed += 1;
            }
            if newest.is_some_and(|newest| newest > lsn) {
                let counted = shard.effective_state(state, lsn);
                if shard.remove_at(hash, location) {
                    shard.counts.sub(counted);
                    claims += u64::from(state == State::InProgress);
                    dropped += 1;
                }
            }
        }
        Ok((killed, dropped, claims))
    }
}
