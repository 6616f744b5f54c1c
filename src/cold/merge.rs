//! Merging adjacent generations into one, streamed: every input file is read a page at
//! a time in key-hash order and the merged file is written as its pages fill, so a
//! merge holds a page of each input, a snapshot of their dead bits (one bit an entry),
//! the new file's fences and filter, never the entries themselves.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{ColdTier, Generation};
use crate::error::Error;
use crate::format::cold_index::{self, ColdEntry, ColdSegment, PAGE_ENTRIES};
use crate::index::Index;
use crate::log::Log;

/// Generations a merge takes at once: the adjacent run of this many with the fewest
/// entries (fewer if fewer exist). Three rather than two: a merge brings the count
/// down by two, so the entries that reach a generation of a given size are rewritten
/// fewer times. Replayed against the 22 spill sizes of a 1B-key run, pairs rewrite
/// 1.76 entries a key in 14 merges and runs of three 1.13 in 7; measured at 1B, the
/// merges during the writes rewrote 1.40 entries a key before, 0.78–1.00 after
/// (`docs/BENCHMARKS.md`).
pub(super) const MERGE_WIDTH: usize = 3;
const _: () = assert!(MERGE_WIDTH >= 2 && MERGE_WIDTH <= 4); // two bits an origin

impl ColdTier {
    /// Merges the run of up to [`MERGE_WIDTH`] adjacent generations with the fewest
    /// entries into one that takes their place (and a new number, above every other):
    /// dead entries and entries of expired buckets are dropped, equal hashes all kept
    /// (a lookup resolves them by lsn). The counters of each segment row go with it.
    /// Generations with a damaged page are never chosen. False: no run to merge.
    pub(super) fn merge_smallest_run(
        &self,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
    ) -> Result<bool, Error> {
        let Some(inputs) = self.smallest_run() else {
            return Ok(false);
        };
        let started = std::time::Instant::now();
        let mut rows: Vec<ColdSegment> = Vec::new();
        let mut segments = Vec::new();
        let mut counts = Vec::new();
        let mut row_of: HashMap<u64, u32> = HashMap::new();
        let mut remaps: Vec<Vec<Option<u32>>> = vec![Vec::new(); inputs.len()];
        for (generation, remap) in inputs.iter().zip(&mut remaps) {
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
        // The entries to keep are the ones live when the merge starts. While the file
        // is written, `placed` records where each kept entry went (three bits an entry
        // in all), so that entries killed after the snapshot are found in the merged
        // file without reading the inputs again.
        let snapshot: Vec<Box<[u64]>> = inputs.iter().map(|g| g.dead_snapshot()).collect();
        let merging = Inputs {
            tier: self,
            generations: inputs.iter().map(|g| &**g).collect(),
            remaps: &remaps,
            dead: &snapshot,
        };
        let mut placed = Placement::new(inputs.iter().map(|g| g.entry_count()));
        let number = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let written = self.write(log.vfs(), number, &rows, segments, counts, sync, |push| {
            merging.merge(|(from, at), entry| {
                if placed.merged.is_multiple_of(4096) && self.stopping.load(Ordering::Relaxed) {
                    return Err(Error::Closed);
                }
                placed.push(from, at);
                push(entry)
            })
        });
        let merged = match written {
            Err(Error::Closed) if self.stopping.load(Ordering::Relaxed) => {
                // The store is closing: the temp file is gone, the inputs stay.
                return Ok(true);
            }
            written => written?,
        };
        // Published under `publishing` (no spill moves hot entries, no cold state
        // copies dead bits meanwhile) and every shard's lock: no write is between the
        // lookup that found its key in an input and its kill there, so their dead bits
        // are final, and the kills made since the snapshot are carried over before any
        // lookup can see the merged file.
        let publishing = self.publishing.lock();
        let shards: Vec<_> = index.shards().map(|s| s.lock()).collect();
        let mut generations = self.generations.write();
        let at = generations.iter().position(|g| Arc::ptr_eq(g, &inputs[0]));
        let gone = at.is_none_or(|at| {
            inputs.iter().enumerate().any(|(i, input)| {
                generations
                    .get(at + i)
                    .is_none_or(|g| !Arc::ptr_eq(g, input))
            })
        });
        if gone {
            // An input expired meanwhile (expiry drops whole generations): this merge
            // is dropped, and the next one chooses again.
            drop((generations, shards, publishing));
            if let Some(merged) = merged {
                let _ = super::spill::remove_files(
                    self.vfs.as_ref(),
                    &self.dir,
                    std::slice::from_ref(&merged.path),
                );
            }
            return Ok(true);
        }
        if let Some(merged) = &merged {
            #[cfg(feature = "planted-bugs")]
            let carry = !crate::planted::planted("cold-merge-loses-kills");
            #[cfg(not(feature = "planted-bugs"))]
            let carry = true;
            if carry {
                let late: Vec<Vec<u64>> = inputs
                    .iter()
                    .zip(&snapshot)
                    .map(|(g, before)| late_kills(before, &g.dead_snapshot()))
                    .collect();
                // A trusted entry killed late broke its input's trust; which of the
                // carried kills it was is not known here, so the merged file's trust
                // breaks too (until its own merge).
                let broken = inputs
                    .iter()
                    .any(|g| g.trust_broken.load(Ordering::Acquire));
                for position in placed.merged_positions(&late) {
                    merged.kill(position, broken);
                }
            }
        }
        let at = at.expect("checked above");
        generations.drain(at + 1..at + inputs.len());
        match &merged {
            Some(merged) => generations[at] = Arc::clone(merged),
            None => {
                generations.remove(at);
            }
        }
        self.any.store(!generations.is_empty(), Ordering::Release);
        drop((generations, shards));
        // Their files go once a cold state without them is written.
        self.leave(&inputs);
        self.dirty.store(true, Ordering::Relaxed);
        drop(publishing);
        self.merges.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            inputs = ?inputs.iter().map(|g| g.number).collect::<Vec<_>>(),
            into = number,
            entries = merged.as_ref().map_or(0, |m| m.entry_count()),
            ms = started.elapsed().as_millis() as u64,
            "merged cold generations"
        );
        Ok(true)
    }

    /// The run of up to [`MERGE_WIDTH`] adjacent generations with the fewest entries
    /// between them, none with a damaged page; `None` unless two or more such are
    /// adjacent.
    pub(super) fn smallest_run(&self) -> Option<Vec<Arc<Generation>>> {
        let generations = self.generations.read();
        let healthy: Vec<bool> = generations
            .iter()
            .map(|g| !g.damaged.load(Ordering::Acquire))
            .collect();
        // The widest runs there are, up to MERGE_WIDTH: where every run of three
        // touches a damaged generation, pairs.
        (2..=MERGE_WIDTH.min(generations.len()))
            .rev()
            .find_map(|width| {
                (0..=generations.len() - width)
                    .filter(|&at| healthy[at..at + width].iter().all(|&h| h))
                    .min_by_key(|&at| {
                        generations[at..at + width]
                            .iter()
                            .map(|g| g.entry_count())
                            .sum::<u64>()
                    })
                    .map(|at| generations[at..at + width].to_vec())
            })
    }
}

/// The positions whose dead bit is set in `now` and not in `before`, ascending.
fn late_kills(before: &[u64], now: &[u64]) -> Vec<u64> {
    let mut late = Vec::new();
    for (i, (&b, &n)) in before.iter().zip(now).enumerate() {
        let mut bits = n & !b;
        while bits != 0 {
            late.push(i as u64 * 64 + u64::from(bits.trailing_zeros()));
            bits &= bits - 1;
        }
    }
    late
}

/// Where a merge put each kept entry: per input, a bit per position (kept or not),
/// and per merged position, two bits saying which input it came from.
struct Placement {
    kept: Vec<Vec<u64>>,
    /// Origins, 32 a word: merged position `p` is bits `2 * (p % 32)..` of word `p / 32`.
    origins: Vec<u64>,
    merged: u64,
}

/// Bit 0 of every two-bit field of a word.
const LOW_BITS: u64 = 0x5555_5555_5555_5555;

impl Placement {
    /// For inputs of these entry counts.
    fn new(inputs: impl Iterator<Item = u64>) -> Placement {
        Placement {
            kept: inputs.map(|n| vec![0; n.div_ceil(64) as usize]).collect(),
            origins: Vec::new(),
            merged: 0,
        }
    }

    fn push(&mut self, from: usize, position: u64) {
        self.kept[from][(position / 64) as usize] |= 1 << (position % 64);
        if self.merged.is_multiple_of(32) {
            self.origins.push(0);
        }
        *self.origins.last_mut().expect("pushed above") |=
            (from as u64) << (2 * (self.merged % 32));
        self.merged += 1;
    }

    /// The merged positions of the input positions in `late` (one list per input,
    /// ascending) that the merge kept.
    fn merged_positions(&self, late: &[Vec<u64>]) -> Vec<u64> {
        let mut out = Vec::new();
        for (from, (kept, late)) in self.kept.iter().zip(late).enumerate() {
            // The rank of each kept late position among its input's kept entries ...
            let mut ranks = Vec::new();
            let (mut word, mut below) = (0usize, 0u64);
            for &position in late {
                let (w, bit) = ((position / 64) as usize, position % 64);
                if kept[w] & (1 << bit) == 0 {
                    continue;
                }
                while word < w {
                    below += u64::from(kept[word].count_ones());
                    word += 1;
                }
                ranks.push(below + u64::from((kept[w] & ((1 << bit) - 1)).count_ones()));
            }
            // ... is its rank among the merged entries that came from that input.
            let mut wanted = ranks.into_iter().peekable();
            let mut seen = 0u64;
            let pattern = from as u64 * LOW_BITS;
            for (w, &origins) in self.origins.iter().enumerate() {
                let Some(&rank) = wanted.peek() else { break };
                let valid = (self.merged - w as u64 * 32).min(32);
                // Bit 2i set where field i is `from` and holds a merged position.
                let equal = !(origins ^ pattern);
                let mut mine = equal & (equal >> 1) & LOW_BITS;
                if valid < 32 {
                    mine &= (1 << (2 * valid)) - 1;
                }
                let count = u64::from(mine.count_ones());
                if seen + count <= rank {
                    seen += count;
                    continue;
                }
                while mine != 0 {
                    let field = u64::from(mine.trailing_zeros()) / 2;
                    if wanted.peek() == Some(&seen) {
                        out.push(w as u64 * 32 + field);
                        wanted.next();
                    }
                    seen += 1;
                    mine &= mine - 1;
                }
            }
        }
        out
    }
}

/// The generations of a merge, what their rows become, and which entries to skip.
struct Inputs<'a> {
    /// For a damaged page: `ColdTier::damaged`.
    tier: &'a ColdTier,
    /// Oldest first.
    generations: Vec<&'a Generation>,
    remaps: &'a [Vec<Option<u32>>],
    dead: &'a [Box<[u64]>],
}

impl Inputs<'_> {
    /// Calls `out` with each kept entry in key-hash order (the older generation's
    /// first among equal hashes), its row remapped, and where it came from: which
    /// input and its position there.
    fn merge(
        &self,
        mut out: impl FnMut((usize, u64), ColdEntry) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut cursors: Vec<Cursor> = (0..self.generations.len())
            .map(|i| Cursor {
                tier: self.tier,
                generation: self.generations[i],
                remap: &self.remaps[i],
                dead: &self.dead[i],
                page: 0,
                entries: Vec::with_capacity(PAGE_ENTRIES),
                next: 0,
            })
            .collect();
        let mut heads = Vec::with_capacity(cursors.len());
        for cursor in &mut cursors {
            heads.push(cursor.next()?);
        }
        loop {
            // The lowest hash; among equal ones, the oldest input's.
            let mut from = None;
            for (i, head) in heads.iter().enumerate() {
                if let Some((_, entry)) = head
                    && from.is_none_or(|(_, hash)| entry.key_hash < hash)
                {
                    from = Some((i, entry.key_hash));
                }
            }
            let Some((from, _)) = from else {
                return Ok(());
            };
            let (position, entry) = heads[from].take().expect("picked a head");
            out((from, position), entry)?;
            heads[from] = cursors[from].next()?;
        }
    }
}

/// Every this many pages (1 MiB), a walk of a generation file in order asks for its
/// next 2 MiB: its lead over the reads is 1 to 2 MiB.
const READ_AHEAD_PAGES: u32 = 256;

/// For a walk of `file`'s pages in order (a merge's input, `verify`), before reading
/// `page` at `at`: the map is read randomly (one page per lookup), so the walk asks
/// for its next pages ahead itself.
pub(crate) fn read_pages_ahead(file: &dyn crate::io::SegmentFile, page: u32, at: u64) {
    if page.is_multiple_of(READ_AHEAD_PAGES) {
        file.read_soon(
            at,
            2 * u64::from(READ_AHEAD_PAGES) * cold_index::PAGE_LEN as u64,
        );
    }
}

/// Reads one generation's kept entries in order, a page at a time.
struct Cursor<'a> {
    tier: &'a ColdTier,
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
                    return Err(self.tier.damaged(
                        generation,
                        at,
                        "cold index page beyond the file",
                    ));
                }
                super::read_pages_ahead(generation.file.as_ref(), self.page, at);
                self.entries.clear();
                cold_index::decode_page(
                    &generation.header,
                    &generation.sections,
                    self.page,
                    generation.file.read(at, cold_index::PAGE_LEN),
                    &mut self.entries,
                )
                .map_err(|e| self.tier.damaged(generation, at, e.reason()))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `merged_positions` against a plain model: every kept late kill is found at the
    /// merged position its entry was pushed to, and no other.
    #[test]
    fn late_kills_are_found_where_the_merge_placed_their_entries() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..300 {
            let inputs = 2 + round % (MERGE_WIDTH - 1);
            let sizes: Vec<u64> = (0..inputs).map(|_| next() % 300).collect();
            let mut placement = Placement::new(sizes.iter().copied());
            let mut cursors = vec![0u64; inputs];
            let mut merged_of = std::collections::HashMap::new();
            loop {
                let open: Vec<usize> = (0..inputs).filter(|&i| cursors[i] < sizes[i]).collect();
                if open.is_empty() {
                    break;
                }
                let from = open[(next() % open.len() as u64) as usize];
                let position = cursors[from];
                cursors[from] += 1;
                if next() % 4 == 0 {
                    continue; // dead at the snapshot, or an expired row: not kept
                }
                merged_of.insert((from, position), placement.merged);
                placement.push(from, position);
            }
            let late: Vec<Vec<u64>> = sizes
                .iter()
                .map(|&size| (0..size).filter(|_| next() % 3 == 0).collect())
                .collect();
            let mut expected: Vec<u64> = (0..inputs)
                .flat_map(|i| late[i].iter().map(move |&p| (i, p)))
                .filter_map(|key| merged_of.get(&key).copied())
                .collect();
            let mut found = placement.merged_positions(&late);
            expected.sort_unstable();
            found.sort_unstable();
            assert_eq!(found, expected, "round {round}, sizes {sizes:?}");
        }
    }

    #[test]
    fn late_kills_are_the_bits_set_since_the_snapshot() {
        assert_eq!(
            late_kills(&[0b0101, 0], &[0b1111, 1 << 63]),
            vec![1, 3, 127]
        );
    }
}
