//! Merging two adjacent generations into one, streamed: both files are read a page at
//! a time in key-hash order and the merged file is written as its pages fill, so a
//! merge holds a page of each, a snapshot of their dead bits (one bit an entry), the
//! new file's fences and filter, never the entries themselves.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{ColdTier, Generation};
use crate::error::Error;
use crate::format::cold_index::{self, ColdEntry, ColdSegment, PAGE_ENTRIES};
use crate::index::Index;
use crate::log::Log;

impl ColdTier {
    /// Merges the two adjacent generations with the fewest entries between them into
    /// one that takes the newer's place (and a new number, above every other): dead
    /// entries and entries of expired buckets are dropped, equal hashes all kept (a
    /// lookup resolves them by lsn). The counters of each segment row go with it.
    pub(super) fn merge_smallest_pair(
        &self,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
    ) -> Result<(), Error> {
        let (at, older, newer) = {
            let generations = self.generations.read();
            let at = (0..generations.len() - 1)
                .min_by_key(|&i| generations[i].entry_count() + generations[i + 1].entry_count())
                .expect("more than GENERATIONS_MAX generations");
            (
                at,
                Arc::clone(&generations[at]),
                Arc::clone(&generations[at + 1]),
            )
        };
        let mut rows: Vec<ColdSegment> = Vec::new();
        let mut segments = Vec::new();
        let mut counts = Vec::new();
        let mut row_of: HashMap<u64, u32> = HashMap::new();
        let mut remaps: [Vec<Option<u32>>; 2] = Default::default();
        for (generation, remap) in [&older, &newer].into_iter().zip(&mut remaps) {
            for (row, segment) in generation.sections.segments.iter().enumerate() {
                if segment.bucket_deadline_ms <= now_ms || generation.segments[row].is_none() {
                    remap.push(None);
                    continue;
                }
                let merged = *row_of.entry(segment.seq).or_insert_with(|| {
                    rows.push(*segment);
                    segments.push(generation.segments[row].clone());
                    counts.push(Arc::clone(&generation.counts[row]));
                    (rows.len() - 1) as u32
                });
                let kept = &mut rows[merged as usize];
                kept.covered_len = kept.covered_len.max(segment.covered_len);
                remap.push(Some(merged));
            }
        }
        // The entries to keep are the ones live when the merge starts: both passes
        // below skip the same ones, so they meet the kept entries in the same order.
        let snapshot = [older.dead_snapshot(), newer.dead_snapshot()];
        let inputs = Inputs {
            generations: [&older, &newer],
            remaps: &remaps,
            dead: &snapshot,
        };
        let number = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let merged = self.write(log.vfs(), number, &rows, segments, counts, sync, |push| {
            inputs.merge(|_, entry| push(entry))
        })?;
        {
            let mut generations = self.generations.write();
            debug_assert!(Arc::ptr_eq(&generations[at], &older));
            generations.remove(at + 1);
            match &merged {
                Some(merged) => generations[at] = Arc::clone(merged),
                None => {
                    generations.remove(at);
                }
            }
            self.any.store(!generations.is_empty(), Ordering::Release);
        }
        // Their files go once a cold state without them is written.
        self.leave(&[Arc::clone(&older), Arc::clone(&newer)]);
        self.dirty.store(true, Ordering::Relaxed);
        if let Some(merged) = &merged {
            // A write that found its key in `older` or `newer` kills the entry there,
            // under the key's shard lock, and maybe after the snapshot above. No
            // lookup finds those two any more (the swap waited for every lookup
            // holding the list), so once each shard's lock was taken once, every such
            // kill is done: carry them over, walking the inputs again in the same
            // order. Until then the killer's hot entry (written with the kill, under
            // the same lock) shadows the merged entry; the reaper, the one other
            // remover of hot entries, is this thread.
            index.wait_for_writers();
            #[cfg(feature = "planted-bugs")]
            let carry = !crate::planted::planted("cold-merge-loses-kills");
            #[cfg(not(feature = "planted-bugs"))]
            let carry = true;
            let mut position = 0u64;
            inputs.merge(|(from, at), _| {
                if carry && inputs.generations[from].is_dead(at) {
                    merged.kill(position);
                }
                position += 1;
                Ok(())
            })?;
            debug_assert_eq!(position, merged.entry_count());
        }
        self.merges.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            older = older.number,
            newer = newer.number,
            into = number,
            "merged two cold generations"
        );
        Ok(())
    }
}

/// The two generations of a merge, what their rows become, and which entries to skip.
struct Inputs<'a> {
    generations: [&'a Generation; 2],
    remaps: &'a [Vec<Option<u32>>; 2],
    dead: &'a [Box<[u64]>; 2],
}

impl Inputs<'_> {
    /// Calls `out` with each kept entry in key-hash order (the older generation's
    /// first among equal hashes), its row remapped, and where it came from: which
    /// input and its position there.
    fn merge(
        &self,
        mut out: impl FnMut((usize, u64), ColdEntry) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut cursors = [0, 1].map(|i| Cursor {
            generation: self.generations[i],
            remap: &self.remaps[i],
            dead: &self.dead[i],
            page: 0,
            entries: Vec::with_capacity(PAGE_ENTRIES),
            next: 0,
        });
        let mut heads = [cursors[0].next()?, cursors[1].next()?];
        loop {
            let from = match (&heads[0], &heads[1]) {
                (None, None) => return Ok(()),
                (Some(_), None) => 0,
                (None, Some(_)) => 1,
                (Some((_, a)), Some((_, b))) => usize::from(a.key_hash > b.key_hash),
            };
            let (position, entry) = heads[from].take().expect("picked a head");
            out((from, position), entry)?;
            heads[from] = cursors[from].next()?;
        }
    }
}

/// Reads one generation's kept entries in order, a page at a time.
struct Cursor<'a> {
    generation: &'a Generation,
    remap: &'a [Option<u32>],
    dead: &'a [u64],
    /// The next page to read.
    page: u32,
    entries: Vec<ColdEntry>,
    next: usize,
}

impl Cursor<'_> {
    fn next(&mut self) -> Result<Option<(u64, ColdEntry)>, Error> {
        let generation = self.generation;
        loop {
            if self.next == self.entries.len() {
                if self.page == generation.header.page_count {
                    return Ok(None);
                }
                let at = generation.header.page_offset(self.page);
                if at + cold_index::PAGE_LEN as u64 > generation.file.capacity() {
                    return Err(Error::corruption(
                        &generation.path,
                        at,
                        "cold index page beyond the file",
                    ));
                }
                self.entries.clear();
                cold_index::decode_page(
                    &generation.header,
                    &generation.sections,
                    self.page,
                    generation.file.read(at, cold_index::PAGE_LEN),
                    &mut self.entries,
                )
                .map_err(|e| Error::corruption(&generation.path, at, e.reason()))?;
                self.page += 1;
                self.next = 0;
                continue;
            }
            let position = u64::from(self.page - 1) * PAGE_ENTRIES as u64 + self.next as u64;
            let entry = self.entries[self.next];
            self.next += 1;
            if self.dead[(position / 64) as usize] & (1 << (position % 64)) != 0 {
                continue;
            }
            if let Some(segment) = self.remap[entry.segment as usize] {
                return Ok(Some((position, ColdEntry { segment, ..entry })));
            }
        }
    }
}
