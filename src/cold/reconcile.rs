//! The reconciliation after an open that replayed only what no spill walked
//! (`persist` has the rest of the reuse): the writes made after the last cold state
//! shadowed cold entries in RAM only, and their records are the hot entries now.
//!
//! Only the entries of keys some generation's filter may hold can have a cold record:
//! the replay screens every key it decodes (`Screen`), and the reconciliation reads
//! the records of those entries alone. A filter has no false negatives, so an entry
//! left out has no cold record to reconcile with.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{ColdTier, Generation};
use crate::addr::Location;
use crate::error::Error;
use crate::format::cold_index::Sections;
use crate::format::record::State;
use crate::index::{Index, KeyHash};
use crate::log::Log;

/// Keys in flight in a `Screen`: each key's filter reads are started when it comes
/// and checked this many keys later, so that the cache misses of a few keys overlap.
const SCREEN_DEPTH: usize = 4;

/// Screens the keys a replay decodes against the filters of the generations the open
/// takes over: collects the hashes some filter may hold (a key in a generation, or a
/// false positive). One per replay thread.
pub(crate) struct Screen<'a> {
    filters: &'a [&'a Sections],
    in_flight: [u64; SCREEN_DEPTH],
    pushed: usize,
    hits: Vec<u64>,
}

impl<'a> Screen<'a> {
    pub(crate) fn new(filters: &'a [&'a Sections]) -> Screen<'a> {
        Screen {
            filters,
            in_flight: [0; SCREEN_DEPTH],
            pushed: 0,
            hits: Vec::new(),
        }
    }

    /// Screens `hash`: its filter reads start now, the check comes `SCREEN_DEPTH` keys
    /// later (or in `finish`).
    #[inline]
    pub(crate) fn push(&mut self, hash: KeyHash) {
        if self.filters.is_empty() {
            return;
        }
        let slot = self.pushed % SCREEN_DEPTH;
        if self.pushed >= SCREEN_DEPTH {
            self.check(self.in_flight[slot]);
        }
        for sections in self.filters {
            sections.prefetch(hash.0);
        }
        self.in_flight[slot] = hash.0;
        self.pushed += 1;
    }

    fn check(&mut self, hash: u64) {
        #[cfg(feature = "planted-bugs")]
        if crate::planted::planted("cold-screen-drops-hits") {
            return;
        }
        if self.filters.iter().any(|s| s.may_contain(hash)) {
            self.hits.push(hash);
        }
    }

    /// The hashes some filter may hold, once every key pushed is checked.
    pub(crate) fn finish(mut self) -> Vec<u64> {
        for pushed in self.pushed.saturating_sub(SCREEN_DEPTH)..self.pushed {
            self.check(self.in_flight[pushed % SCREEN_DEPTH]);
        }
        self.hits
    }
}

impl ColdTier {
    /// After an open that replayed only the records no spill walked: each hot entry
    /// whose key the replay's screen found in some filter (`screened`: their hashes,
    /// in any order, repeats allowed) is probed in every generation and the newest of
    /// its records wins. A cold entry with a lower lsn is killed (a write after the
    /// state was written shadowed it; the kill was in RAM only) and its key taken out
    /// of the cold counts; a hot entry with a lower lsn than a cold one (an older
    /// record of a re-created key, which no spill walked) is dropped. Runs after
    /// `Index::finish_recovery`, so states are counted as this open sees them. Cost: a
    /// record read and the filter probes per hot key. Returns how many of the claims
    /// `finish_recovery` counted as released it took out again (claims in progress
    /// whose entry it killed or dropped: no claim was in progress there when the
    /// process died). `open_counters` are the cold state's (`restore` returns them):
    /// which of its claims it counted in progress.
    pub(crate) fn reconcile(
        &self,
        log: &Log,
        index: &Index,
        open_counters: &[u64],
        screened: &[u64],
    ) -> Result<u64, Error> {
        if self.is_empty() {
            return Ok(0);
        }
        let generations: Vec<Arc<Generation>> = self.generations.read().clone();
        // The screened hashes of each shard.
        let mut by_shard: Vec<(usize, KeyHash)> = screened
            .iter()
            .map(|&h| (index.shard_of(KeyHash(h)), KeyHash(h)))
            .collect();
        by_shard.sort_unstable_by_key(|&(shard, hash)| (shard, hash.0));
        by_shard.dedup();
        let shards: Vec<&[(usize, KeyHash)]> = by_shard.chunk_by(|a, b| a.0 == b.0).collect();
        // Shards are independent (a key lives in one): spread them over threads, more
        // than the cores, since a filter hit waits for a page from the disk when the
        // page cache does not hold the generations (after a crash at 500M keys, 2
        // threads took 4.2 s for 1.8M keys with the page cache dropped).
        let next_shard = AtomicUsize::new(0);
        let threads = std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .saturating_mul(4)
            .min(shards.len());
        let results: Vec<Result<(u64, u64, u64), Error>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut totals = (0, 0, 0);
                        loop {
                            let next = next_shard.fetch_add(1, Ordering::Relaxed);
                            let Some(&hashes) = shards.get(next) else {
                                return Ok(totals);
                            };
                            let (k, d, c) = self.reconcile_shard(
                                log,
                                index,
                                hashes,
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

    /// `reconcile` of the entries of one shard's screened hashes (`hashes`, all of the
    /// shard, none twice): returns (cold entries killed, hot entries dropped, claims
    /// uncounted).
    fn reconcile_shard(
        &self,
        log: &Log,
        index: &Index,
        hashes: &[(usize, KeyHash)],
        generations: &[Arc<Generation>],
        open_counters: &[u64],
    ) -> Result<(u64, u64, u64), Error> {
        let (mut killed, mut dropped, mut claims) = (0, 0, 0);
        let mut positions = Vec::new();
        let shard_index = hashes[0].0;
        let mut shard = index.lock_at(shard_index);
        // Every entry a screened hash's fingerprint names (another key's too, on a
        // fingerprint collision: its record says which key it is).
        let mut hot: Vec<Location> = Vec::new();
        for &(_, hash) in hashes {
            shard.find(hash, |at| {
                hot.push(at);
                false
            });
        }
        hot.sort_unstable_by_key(|at| (at.slot.0, at.offset));
        hot.dedup();
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::cold_index::{self, ColdEntry, ColdSegment};

    fn sections(generation: u64, hashes: &[u64]) -> Sections {
        let segments = [ColdSegment {
            seq: 1,
            bucket_deadline_ms: 1_000,
            covered_len: 4096,
        }];
        let mut entries: Vec<ColdEntry> = hashes
            .iter()
            .map(|&h| ColdEntry::new(h, 0, 64, false))
            .collect();
        entries.sort();
        let bytes = cold_index::encode(generation, &segments, &entries, true);
        let header = cold_index::decode_header(&bytes).unwrap();
        cold_index::decode_sections(&header, &bytes[header.sections_offset() as usize..]).unwrap()
    }

    fn hash(i: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes())
    }

    /// Whatever the number of keys pushed (below, at and past the keys in flight), the
    /// screen reports exactly the pushed hashes some filter may hold: every key of a
    /// generation, and no other key but a filter's false positives.
    #[test]
    fn the_screen_reports_exactly_the_keys_some_filter_may_hold() {
        let first: Vec<u64> = (0..5_000).map(hash).collect();
        let second: Vec<u64> = (5_000..8_000).map(hash).collect();
        let generations = [sections(1, &first), sections(2, &second)];
        let filters: Vec<&Sections> = generations.iter().collect();
        for pushed in [
            0,
            1,
            SCREEN_DEPTH - 1,
            SCREEN_DEPTH,
            SCREEN_DEPTH + 1,
            50,
            20_000,
        ] {
            // Members of both generations among keys of neither.
            let keys: Vec<u64> = (0..pushed as u64)
                .map(|i| match i % 3 {
                    0 => first[(i as usize / 3) % first.len()],
                    1 => second[(i as usize / 3) % second.len()],
                    _ => hash(1_000_000 + i),
                })
                .collect();
            let mut screen = Screen::new(&filters);
            for &k in &keys {
                screen.push(KeyHash(k));
            }
            let hits = screen.finish();
            let expected: Vec<u64> = keys
                .iter()
                .copied()
                .filter(|&k| filters.iter().any(|s| s.may_contain(k)))
                .collect();
            assert_eq!(hits, expected, "{pushed} keys pushed");
            // Every key of a generation is among them (a filter has no false negative).
            let members = (0..pushed).filter(|i| i % 3 != 2).map(|i| keys[i]);
            assert!(
                members.clone().all(|m| hits.contains(&m)),
                "{pushed} keys pushed"
            );
            assert!(
                hits.len() < members.count() + pushed / 100 + 2,
                "{pushed} keys pushed"
            );
        }
        // No generation: nothing is screened in.
        let mut screen = Screen::new(&[]);
        screen.push(KeyHash(first[0]));
        assert!(screen.finish().is_empty());
    }
}
