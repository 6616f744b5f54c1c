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
    /// Generations with a damaged page are never chosen. False: no pair to merge.
    pub(super) fn merge_smallest_pair(
        &self,
        log: &Log,
        index: &Index,
        now_ms: u64,
        sync: bool,
    ) -> Result<bool, Error> {
        let Some((older, newer)) = self.smallest_pair() else {
            return Ok(false);
        };
        let started = std::time::Instant::now();
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
        // The entries to keep are the ones live when the merge starts. While the file
        // is written, `placed` records where each kept entry went (two bits an entry in
        // all), so that entries killed after the snapshot are found in the merged file
        // without reading the inputs again.
        let snapshot = [older.dead_snapshot(), newer.dead_snapshot()];
        let inputs = Inputs {
            tier: self,
            generations: [&older, &newer],
            remaps: &remaps,
            dead: &snapshot,
        };
        let mut placed = Placement::new(older.entry_count(), newer.entry_count());
        let number = self.next_generation.fetch_add(1, Ordering::Relaxed);
        let written = self.write(log.vfs(), number, &rows, segments, counts, sync, |push| {
            inputs.merge(|(from, at), entry| {
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
        // lookup that found its key in `older` or `newer` and its kill there, so their
        // dead bits are final, and the kills made since the snapshot are carried over
        // before any lookup can see the merged file.
        let publishing = self.publishing.lock();
        let shards: Vec<_> = index.shards().map(|s| s.lock()).collect();
        let mut generations = self.generations.write();
        let at = generations.iter().position(|g| Arc::ptr_eq(g, &older));
        let gone = at.is_none_or(|at| {
            generations
                .get(at + 1)
                .is_none_or(|next| !Arc::ptr_eq(next, &newer))
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
                let late: [Vec<u64>; 2] = [0, 1].map(|from| {
                    let now = inputs.generations[from].dead_snapshot();
                    late_kills(&snapshot[from], &now)
                });
                // A trusted entry killed late broke its input's trust; which of the
                // carried kills it was is not known here, so the merged file's trust
                // breaks too (until its own merge).
                let broken = inputs
                    .generations
                    .iter()
                    .any(|g| g.trust_broken.load(Ordering::Acquire));
                for position in placed.merged_positions(&late) {
                    merged.kill(position, broken);
                }
            }
        }
        let at = at.expect("checked above");
        generations.remove(at + 1);
        match &merged {
            Some(merged) => generations[at] = Arc::clone(merged),
            None => {
                generations.remove(at);
            }
        }
        self.any.store(!generations.is_empty(), Ordering::Release);
        drop((generations, shards));
        // Their files go once a cold state without them is written.
        self.leave(&[Arc::clone(&older), Arc::clone(&newer)]);
        self.dirty.store(true, Ordering::Relaxed);
        drop(publishing);
        self.merges.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(
            older = older.number,
            newer = newer.number,
            into = number,
            entries = merged.as_ref().map_or(0, |m| m.entry_count()),
            ms = started.elapsed().as_millis() as u64,
            "merged two cold generations"
        );
        Ok(true)
    }

    /// The two adjacent generations with the fewest entries between them, neither
    /// with a damaged page.
    pub(super) fn smallest_pair(&self) -> Option<(Arc<Generation>, Arc<Generation>)> {
        let generations = self.generations.read();
        generations
            .windows(2)
            .filter(|pair| pair.iter().all(|g| !g.damaged.load(Ordering::Acquire)))
            .min_by_key(|pair| pair[0].entry_count() + pair[1].entry_count())
            .map(|pair| (Arc::clone(&pair[0]), Arc::clone(&pair[1])))
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
/// and per merged position, a bit saying which input it came from.
struct Placement {
    kept: [Vec<u64>; 2],
    from_newer: Vec<u64>,
    merged: u64,
}

impl Placement {
    fn new(older: u64, newer: u64) -> Placement {
        Placement {
            kept: [older, newer].map(|n| vec![0; n.div_ceil(64) as usize]),
            from_newer: Vec::new(),
            merged: 0,
        }
    }

    fn push(&mut self, from: usize, position: u64) {
        self.kept[from][(position / 64) as usize] |= 1 << (position % 64);
        if self.merged.is_multiple_of(64) {
            self.from_newer.push(0);
        }
        if from == 1 {
            *self.from_newer.last_mut().expect("pushed above") |= 1 << (self.merged % 64);
        }
        self.merged += 1;
    }

    /// The merged positions of the input positions in `late` (ascending per input)
    /// that the merge kept.
    fn merged_positions(&self, late: &[Vec<u64>; 2]) -> Vec<u64> {
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
            for (w, &bits) in self.from_newer.iter().enumerate() {
                let Some(&rank) = wanted.peek() else { break };
                let valid = (self.merged - w as u64 * 64).min(64);
                let mask = if valid == 64 {
                    u64::MAX
                } else {
                    (1 << valid) - 1
                };
                let mut mine = if from == 1 { bits } else { !bits } & mask;
                let count = u64::from(mine.count_ones());
                if seen + count <= rank {
                    seen += count;
                    continue;
                }
                while mine != 0 {
                    let bit = u64::from(mine.trailing_zeros());
                    if wanted.peek() == Some(&seen) {
                        out.push(w as u64 * 64 + bit);
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

/// The two generations of a merge, what their rows become, and which entries to skip.
struct Inputs<'a> {
    /// For a damaged page: `ColdTier::damaged`.
    tier: &'a ColdTier,
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
            tier: self.tier,
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
        for round in 0..200 {
            let sizes = [next() % 300, next() % 300];
            let mut placement = Placement::new(sizes[0], sizes[1]);
            let mut cursors = [0u64, 0u64];
            let mut merged_of = std::collections::HashMap::new();
            loop {
                let open: Vec<usize> = (0..2).filter(|&i| cursors[i] < sizes[i]).collect();
                let Some(&from) = open.get((next() % 2) as usize % open.len().max(1)) else {
                    break;
                };
                let position = cursors[from];
                cursors[from] += 1;
                if next() % 4 == 0 {
                    continue; // dead at the snapshot, or an expired row: not kept
                }
                merged_of.insert((from, position), placement.merged);
                placement.push(from, position);
            }
            let late: [Vec<u64>; 2] =
                [0, 1].map(|i| (0..sizes[i]).filter(|_| next() % 3 == 0).collect());
            let mut expected: Vec<u64> = (0..2)
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
