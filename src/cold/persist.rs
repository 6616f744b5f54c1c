//! The cold tier across a close or a crash: what it keeps only in RAM (each
//! generation's dead bits, each spilled segment's covered length and cold counts, the
//! lsn floor and the partitions' highest offsets of the records spills walked) goes to
//! `COLD_STATE` (`format::cold_state`) after every spill, merge or expiry that changed
//! the tier, and at a clean close beside `CHECKPOINT`. The next open checks the
//! generation files it lists (names, lengths, header checksums, sections' checksums,
//! the segments they need; `reuse`) and takes them over without reading a page:
//!
//! - after a clean close, with the checkpoint written with it: nothing is replayed;
//! - after a crash (or with a checkpoint it cannot use): only the records no spill
//!   walked are replayed (each segment from its covered length), each replayed key is
//!   screened against the generations' filters, and the hot entries of the keys some
//!   filter may hold are probed in the tier (`reconcile`), which re-derives the kills
//!   their records made after the state was written.
//!
//! A generation file leaves the directory only once a state that does not list it is
//! durable (`leave`), and the log is made durable before a state is written, so the
//! record that killed an entry (or that a covered record was superseded by) is never
//! lost while the state says so. In any other case — no state, a damaged or missing
//! file, a segment shorter than its covered length — the open deletes the generation
//! files and rebuilds the index from the whole log (counted in `Stats`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::reuse::Reused;
use super::{ColdTier, Generation, SpilledSegment};
use crate::error::Error;
use crate::format::cold_state::{
    self, ColdState, GenerationState, PartitionOffset, STATES, SegmentState,
};
use crate::index::{Index, StateCounts};
use crate::log::Log;

impl ColdTier {
    /// Per shard, by state, the keys of the shard's counts whose newest entry is cold.
    pub(crate) fn cold_counts(&self, shards: usize) -> Vec<[u64; STATES]> {
        let mut out = vec![[0u64; STATES]; shards];
        for segment in self.spilled.lock().values() {
            for (shard, total) in out.iter_mut().enumerate() {
                for (total, count) in total.iter_mut().zip(segment.counts.get(shard)) {
                    *total += count;
                }
            }
        }
        out
    }

    /// Writes `COLD_STATE` (temp file, sync, rename, directory sync, with `sync`): at
    /// a clean close right after the checkpoint whose bytes hash to `checkpoint_hash`,
    /// and while the store runs after a spill, merge or expiry changed the tier (under
    /// `publishing`, which spills, a merge's publication and expiry hold too: the
    /// files `leave` hands over before the snapshot are the only ones it deletes after
    /// writing). What it holds is taken under
    /// every shard lock, so the dead bits and the counts agree; then `durable` makes
    /// every record appended so far durable (each kill it holds was made by a record
    /// appended before it, and each covered record a spill did not take was superseded
    /// by one); then the file is written. Once it is, the files of the generations
    /// that left the tier are deleted (`leave`).
    pub(crate) fn write_state(
        &self,
        index: &Index,
        checkpoint_hash: Option<u64>,
        durable: impl FnOnce() -> Result<(), Error>,
        sync: bool,
    ) -> Result<(), Error> {
        let _publishing = self.publishing.lock();
        self.write_state_held(index, checkpoint_hash, durable, sync)
    }

    /// `write_state`, for a caller that holds `publishing`.
    fn write_state_held(
        &self,
        index: &Index,
        checkpoint_hash: Option<u64>,
        durable: impl FnOnce() -> Result<(), Error>,
        sync: bool,
    ) -> Result<(), Error> {
        if self.is_damaged() {
            // A lookup met a damaged page and removed the state: the next open rebuilds.
            return Ok(());
        }
        let state = {
            let shards: Vec<_> = index.shards().map(|s| s.lock()).collect();
            let lsn_floor = shards.iter().map(|s| s.lsn_counter()).max().unwrap_or(0);
            let open_counters = shards.iter().map(|s| s.open_lsn_counter()).collect();
            let generations = self.generations.read();
            let mut segments: Vec<SegmentState> = self
                .spilled
                .lock()
                .iter()
                .map(|(&seq, s)| SegmentState {
                    seq,
                    deadline_ms: s.deadline_ms,
                    covered_len: s.covered_len,
                    rows: s.counts.rows(),
                })
                .collect();
            segments.sort_by_key(|s| s.seq);
            let mut partitions: Vec<PartitionOffset> = self
                .covered_offsets
                .lock()
                .iter()
                .map(
                    |(&(namespace_id, partition), &highest_offset)| PartitionOffset {
                        namespace_id,
                        partition,
                        highest_offset,
                    },
                )
                .collect();
            partitions.sort();
            ColdState {
                shard_count: shards.len() as u32,
                checkpoint_hash,
                next_generation: self.next_generation.load(Ordering::Relaxed),
                lsn_floor,
                generations: generations
                    .iter()
                    .map(|g| GenerationState {
                        number: g.number,
                        entry_count: g.header.entry_count,
                        header_checksum: g.header_checksum,
                        dead: g
                            .dead
                            .iter()
                            .enumerate()
                            .map(|(i, w)| (i as u64, w.load(Ordering::Acquire)))
                            .filter(|&(_, w)| w != 0)
                            .collect(),
                    })
                    .collect(),
                segments,
                partitions,
                open_counters,
            }
        };
        #[cfg(feature = "planted-bugs")]
        let durable = || match crate::planted::planted("cold-state-before-durable") {
            true => Ok(()),
            false => durable(),
        };
        durable()?;
        let bytes = cold_state::encode(&state);
        let temp = self.dir.join(crate::layout::COLD_STATE_TEMP);
        let path = self.dir.join(crate::layout::COLD_STATE);
        let written =
            crate::io::replace_file(self.vfs.as_ref(), &self.dir, &temp, &path, &bytes, sync);
        if let Err((e, at)) = written {
            // The state before it is still in place, and every file it lists too.
            let _ = self.vfs.remove(&temp);
            return Err(Error::io("writing the cold state", at, e));
        }
        if self.is_damaged() {
            // A lookup met a damaged page while it was written: gone again.
            let _ = self.vfs.remove(&path);
            return Ok(());
        }
        tracing::debug!(
            bytes = bytes.len(),
            generations = state.generations.len(),
            clean = checkpoint_hash.is_some(),
            "wrote the cold state"
        );
        let leaving = std::mem::take(&mut *self.leaving.lock());
        super::spill::remove_files(self.vfs.as_ref(), &self.dir, &leaving)
    }

    /// While the store runs: writes the cold state if the tier changed since the last
    /// one (`write_state`, without a checkpoint). A failure leaves the tier marked
    /// changed, for the next reaper round.
    pub(crate) fn persist(
        &self,
        index: &Index,
        durable: impl FnOnce() -> Result<(), Error>,
        sync: bool,
    ) -> Result<(), Error> {
        // After close (`stop`): the close wrote the last state, with its checkpoint.
        let stopped = self.publishing.lock();
        if *stopped || !self.dirty.swap(false, Ordering::AcqRel) {
            return Ok(());
        }
        let written = self.write_state_held(index, None, durable, sync);
        if written.is_err() {
            self.dirty.store(true, Ordering::Release);
        }
        written
    }

    /// Generations that left the tier (merged or expired): their files are deleted once
    /// a cold state that does not list them is written.
    pub(crate) fn leave(&self, generations: &[Arc<Generation>]) {
        self.leaving
            .lock()
            .extend(generations.iter().map(|g| g.path.clone()));
    }

    /// Takes over the generations an earlier open left (the hot index came from the
    /// checkpoint, or from a replay of the records no spill walked: either holds the
    /// hot entries and counts only), and adds their keys to the shards' counts. Runs
    /// before `Index::finish_recovery`, which
    /// releases (and counts) the claims in progress of the previous process in the
    /// shards' counts; each segment's cold counters release theirs here (their lsns
    /// are all below this open's).
    /// Returns the state's open counters, for `reconcile`.
    pub(crate) fn restore(&self, reused: Reused, log: &Log, index: &Index) -> Vec<u64> {
        // A row names its segment by sequence and bucket deadline. Numbers are never
        // taken again while a generation may name them (below), the deadline makes
        // sure of it.
        let by_seq: HashMap<(u64, u64), Arc<crate::log::Segment>> = log
            .table
            .read()
            .segments()
            .map(|s| ((s.seq, s.deadline_ms), Arc::clone(s)))
            .collect();
        let named = reused
            .segments
            .iter()
            .map(|s| s.seq)
            .chain(
                reused
                    .generations
                    .iter()
                    .flat_map(|g| g.sections.segments.iter().map(|r| r.seq)),
            )
            .max();
        if let Some(seq) = named {
            log.set_next_seq(seq.saturating_add(1));
        }
        let shards = index.shard_count();
        let (in_progress, released) = (
            StateCounts::index(crate::format::record::State::InProgress),
            StateCounts::index(crate::format::record::State::Released),
        );
        let mut spilled = self.spilled.lock();
        for segment in reused.segments {
            if segment.deadline_ms <= reused.now_ms {
                // Expired since the state was written: deleted unread by the recovery,
                // its cold keys forgotten (their rows answer as expired ones do).
                continue;
            }
            let counts = super::new_row_counts(shards);
            for shard in 0..shards {
                let mut row: [u64; STATES] = std::array::from_fn(|i| {
                    segment.rows[i].as_ref().map_or(0, |r| u64::from(r[shard]))
                });
                if row == [0; STATES] {
                    continue;
                }
                // The shard's counts get them as they were (`finish_recovery` moves
                // and counts the claims); the segment's counters as they are now.
                let mut guard = index.lock_at(shard);
                for (total, &n) in guard.counts.counts.iter_mut().zip(&row) {
                    *total += n;
                }
                row[released] += std::mem::take(&mut row[in_progress]);
                counts.set(shard, row);
            }
            spilled.insert(
                segment.seq,
                SpilledSegment {
                    deadline_ms: segment.deadline_ms,
                    covered_len: segment.covered_len,
                    counts,
                },
            );
        }
        #[cfg(feature = "planted-bugs")]
        let forget_kills = crate::planted::planted("cold-state-forgets-kills");
        #[cfg(not(feature = "planted-bugs"))]
        let forget_kills = false;
        let mut generations = Vec::with_capacity(reused.generations.len());
        for loaded in reused.generations {
            let rows = &loaded.sections.segments;
            let segments = rows
                .iter()
                .map(|r| by_seq.get(&(r.seq, r.bucket_deadline_ms)).cloned())
                .collect();
            let counts = rows
                .iter()
                .map(|r| {
                    spilled
                        .get(&r.seq)
                        .map_or_else(|| super::new_row_counts(shards), |s| Arc::clone(&s.counts))
                })
                .collect();
            let dead = super::dead_bits(loaded.header.entry_count);
            // Which dead entries were trusted the state does not say: any dead entry
            // keeps approximate answers off the generation until a merge.
            let mut any_dead = false;
            if !forget_kills {
                for (word, bits) in loaded.dead {
                    if let Some(word) = dead.get(word as usize) {
                        word.store(bits, Ordering::Relaxed);
                        any_dead |= bits != 0;
                    }
                }
            }
            generations.push(Arc::new(Generation {
                number: loaded.number,
                path: loaded.path,
                header: loaded.header,
                header_checksum: loaded.header_checksum,
                sections: loaded.sections,
                file: loaded.file,
                segments,
                counts,
                dead,
                trust_broken: std::sync::atomic::AtomicBool::new(any_dead),
                damaged: std::sync::atomic::AtomicBool::new(false),
            }));
        }
        drop(spilled);
        self.covered_offsets.lock().extend(
            reused
                .partitions
                .iter()
                .map(|p| ((p.namespace_id, p.partition), p.highest_offset)),
        );
        let next = generations.iter().map(|g| g.number + 1).max().unwrap_or(1);
        self.next_generation
            .store(reused.next_generation.max(next), Ordering::Relaxed);
        self.reused
            .store(generations.len() as u64, Ordering::Relaxed);
        self.any.store(!generations.is_empty(), Ordering::Release);
        *self.generations.write() = generations;
        reused.open_counters
    }
}

impl ColdTier {
    /// Deletes what an earlier open left and this one does not use: temp files, the
    /// generation files not in `kept` (written after the cold state this open used,
    /// or waiting to be deleted) and, without `kept` (nothing was reused: the log's
    /// replay rebuilt their keys, counted in `Stats`), every generation file and the
    /// cold state.
    pub(crate) fn remove_leftovers(
        &self,
        kept: Option<&std::collections::BTreeSet<u64>>,
    ) -> Result<(), crate::error::Error> {
        let dir = &self.dir;
        let names = self
            .vfs
            .list(dir)
            .map_err(|e| crate::error::Error::io("listing", dir, e))?;
        let (mut removed, mut generations) = (0, 0);
        for name in &names {
            let temp = name.ends_with(".tmp");
            let cold = crate::layout::is_cold_file(name);
            let unused = match kept {
                Some(kept) => crate::layout::parse_cold_file_name(name)
                    .is_none_or(|number| !kept.contains(&number)),
                None => true,
            };
            let leftover = (cold && (temp || unused))
                || name == crate::layout::COLD_STATE_TEMP
                || (kept.is_none() && name == crate::layout::COLD_STATE);
            if !leftover {
                continue;
            }
            let path = dir.join(name);
            self.vfs.remove(&path).map_err(|e| {
                crate::error::Error::io("deleting a cold index file of an earlier open", &path, e)
            })?;
            removed += 1;
            generations += u64::from(cold && !temp && kept.is_none());
        }
        if removed > 0 {
            self.vfs
                .sync_dir(dir)
                .map_err(|e| crate::error::Error::io("syncing directory", dir, e))?;
        }
        if generations > 0 {
            self.rebuilt.store(generations, Ordering::Relaxed);
            tracing::info!(
                files = generations,
                "deleted cold index files an earlier open left without a usable cold state; the index was rebuilt from the log"
            );
        }
        Ok(())
    }
}
