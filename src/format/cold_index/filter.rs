//! The filter in front of a cold index generation (issue 11, `docs/FORMAT.md`, "Cold
//! index files"): binary fuse filters with 8-bit fingerprints (`xorf::BinaryFuse8`),
//! in parts of up to 2^22 distinct hashes, over the generation's key hashes; and for
//! the trusted entries of approximate namespaces, 16-bit ones (`xorf::BinaryFuse16`),
//! whose false positives are answers (`LikelyDuplicate`), so they are wider.
//!
//! Chosen by measurement (`examples/filter_choice`, `docs/BENCHMARKS.md`, "The cold
//! tier's filter") over a split-block bloom filter: at 100M keys in 8 generations it
//! takes 1.13 bytes per key against 1.50 for the bloom filter at 12 bits per key, its
//! false-positive rate is lower (0.39% against 0.54%), and a fresh key's probe of all 8
//! generations is faster (~400 ns against ~475 ns, both bound by TLB and cache misses).
//! It builds 3–4× slower, once per spill, off the hot path.
//!
//! The filter's descriptor and fingerprints come from a file: soundness does not rest
//! on them (xorf indexes with bounds checks), and neither does a panic: `decode` refuses
//! a descriptor whose three probe positions could fall outside the fingerprints. A
//! false positive costs a page read, never a wrong answer (every hit is verified
//! against the key bytes).

use xorf::{BinaryFuse8, BinaryFuse16, Descriptor, Filter};

use crate::format::{read_u32, read_u64};

/// Bytes of the descriptor before the fingerprints: seed, segment length, its mask,
/// and the segments' total length.
pub(crate) const DESCRIPTOR_LEN: usize = 20;

/// A generation's filter: may the generation hold this key hash?
#[derive(Debug, Clone)]
pub(crate) enum ColdFilter {
    /// Holds every hash: what a generation has when the filter could not be built
    /// (xorf's construction gives up after many seeds; never seen in practice).
    Everything,
    Fuse(BinaryFuse8),
    /// 16-bit fingerprints: the filter of the entries an approximate namespace trusts
    /// (a hit answers without reading the page, so its false-positive rate is the
    /// false-duplicate rate: 2^-16 a generation).
    Fuse16(BinaryFuse16),
}

impl PartialEq for ColdFilter {
    fn eq(&self, other: &ColdFilter) -> bool {
        match (self, other) {
            (ColdFilter::Everything, ColdFilter::Everything) => true,
            (ColdFilter::Fuse(a), ColdFilter::Fuse(b)) => {
                a.descriptor == b.descriptor && a.fingerprints == b.fingerprints
            }
            (ColdFilter::Fuse16(a), ColdFilter::Fuse16(b)) => {
                a.descriptor == b.descriptor && a.fingerprints == b.fingerprints
            }
            _ => false,
        }
    }
}

impl Eq for ColdFilter {}

impl ColdFilter {
    /// The filter of `sorted` key hashes (ascending; equal ones are taken once), with
    /// 16-bit fingerprints if `wide`.
    pub(crate) fn build(sorted: &[u64], wide: bool) -> ColdFilter {
        debug_assert!(sorted.windows(2).all(|w| w[0] <= w[1]));
        let mut distinct = sorted.to_vec();
        distinct.dedup();
        ColdFilter::build_distinct(&distinct, wide)
    }

    /// The filter of `distinct` key hashes (ascending, no two equal).
    fn build_distinct(distinct: &[u64], wide: bool) -> ColdFilter {
        debug_assert!(distinct.windows(2).all(|w| w[0] < w[1]));
        let built = match wide {
            false => BinaryFuse8::try_from(distinct).map(ColdFilter::Fuse),
            true => BinaryFuse16::try_from(distinct).map(ColdFilter::Fuse16),
        };
        match built {
            Ok(filter) => filter,
            Err(why) => {
                tracing::warn!(
                    keys = distinct.len(),
                    why,
                    "no binary fuse filter for a cold generation: every lookup reads its pages"
                );
                ColdFilter::Everything
            }
        }
    }

    /// False: `key_hash` is not in the generation. True: it may be.
    #[inline]
    pub(crate) fn may_contain(&self, key_hash: u64) -> bool {
        match self {
            ColdFilter::Everything => true,
            ColdFilter::Fuse(filter) => filter.contains(&key_hash),
            ColdFilter::Fuse16(filter) => filter.contains(&key_hash),
        }
    }

    /// Bytes of memory the filter takes.
    pub(crate) fn bytes(&self) -> usize {
        match self {
            ColdFilter::Everything => 0,
            ColdFilter::Fuse(filter) => filter.fingerprints.len() + DESCRIPTOR_LEN,
            ColdFilter::Fuse16(filter) => 2 * filter.fingerprints.len() + DESCRIPTOR_LEN,
        }
    }

    /// The filter's kind byte in the file: 0 none (holds everything), 1 binary fuse 8,
    /// 2 binary fuse 16.
    pub(crate) fn kind(&self) -> u8 {
        match self {
            ColdFilter::Everything => 0,
            ColdFilter::Fuse(_) => 1,
            ColdFilter::Fuse16(_) => 2,
        }
    }

    /// The filter section: nothing for `Everything`; for a fuse filter the descriptor
    /// (u64 seed, u32 segment length, u32 mask, u32 segments' total length) and the
    /// fingerprints.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        let d = match self {
            ColdFilter::Everything => return,
            ColdFilter::Fuse(filter) => &filter.descriptor,
            ColdFilter::Fuse16(filter) => &filter.descriptor,
        };
        out.extend_from_slice(&d.seed.to_le_bytes());
        out.extend_from_slice(&d.segment_length.to_le_bytes());
        out.extend_from_slice(&d.segment_length_mask.to_le_bytes());
        out.extend_from_slice(&d.segment_count_length.to_le_bytes());
        match self {
            ColdFilter::Everything => {}
            ColdFilter::Fuse(filter) => out.extend_from_slice(&filter.fingerprints),
            ColdFilter::Fuse16(filter) => {
                for f in filter.fingerprints.iter() {
                    out.extend_from_slice(&f.to_le_bytes());
                }
            }
        }
    }

    /// A filter from its kind byte and section; `None` if they do not make one whose
    /// every probe stays inside its fingerprints.
    pub(crate) fn decode(kind: u8, bytes: &[u8]) -> Option<ColdFilter> {
        if kind == 0 {
            return bytes.is_empty().then_some(ColdFilter::Everything);
        }
        if bytes.len() <= DESCRIPTOR_LEN {
            return None;
        }
        let descriptor = Descriptor {
            seed: read_u64(bytes, 0),
            segment_length: read_u32(bytes, 8),
            segment_length_mask: read_u32(bytes, 12),
            segment_count_length: read_u32(bytes, 16),
        };
        let fingerprints = &bytes[DESCRIPTOR_LEN..];
        match kind {
            1 => probes_in_bounds(&descriptor, fingerprints.len()).then(|| {
                ColdFilter::Fuse(BinaryFuse8 {
                    descriptor,
                    fingerprints: fingerprints.into(),
                })
            }),
            2 if fingerprints.len().is_multiple_of(2) => {
                probes_in_bounds(&descriptor, fingerprints.len() / 2).then(|| {
                    ColdFilter::Fuse16(BinaryFuse16 {
                        descriptor,
                        fingerprints: fingerprints
                            .chunks_exact(2)
                            .map(|f| u16::from_le_bytes([f[0], f[1]]))
                            .collect(),
                    })
                })
            }
            _ => None,
        }
    }
}

/// Distinct key hashes per filter part: a part is built from at most this many, so
/// building a generation's filter never holds more than one part's keys and xorf's
/// construction arrays (about 30 bytes a key) at once, whatever the generation's size.
pub(crate) const PART_KEYS: usize = 1 << 22;

/// Bytes before each part's filter in the section: its first key hash (u64), its kind
/// (u8), three zero bytes and its length (u32).
const PART_HEADER_LEN: usize = 16;

/// A generation's filter: one binary fuse filter per run of up to [`PART_KEYS`]
/// distinct key hashes, in hash order. A probe binary-searches the parts' first hashes
/// (a handful for the largest generations) and probes one filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FilterParts {
    /// Each part's first key hash, ascending: part `i` covers `firsts[i]` up to the
    /// next part's first.
    firsts: Vec<u64>,
    parts: Vec<ColdFilter>,
}

impl FilterParts {
    /// The filter of `sorted` key hashes (ascending; equal ones are taken once), in
    /// parts of `part_keys` distinct hashes.
    pub(crate) fn build(sorted: &[u64], part_keys: usize, wide: bool) -> FilterParts {
        let mut builder = FilterBuilder::new(part_keys, wide);
        for &hash in sorted {
            builder.push(hash);
        }
        builder.finish()
    }

    /// No parts: holds no hash (a generation's trusted filter when it has no entry of
    /// an approximate namespace).
    pub(crate) fn empty() -> FilterParts {
        FilterParts {
            firsts: Vec::new(),
            parts: Vec::new(),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Whether its parts have 16-bit fingerprints (a section never mixes widths).
    pub(crate) fn is_wide(&self) -> bool {
        self.parts.iter().any(|p| p.kind() == 2)
    }

    /// For a trusted filter: true only if a part with 16-bit fingerprints says "may
    /// contain" (a part that holds everything, because its filter could not be built,
    /// never answers for sure: an approximate lookup falls through to the exact one).
    #[inline]
    pub(crate) fn holds_for_sure(&self, key_hash: u64) -> bool {
        match self.firsts.partition_point(|&first| first <= key_hash) {
            0 => false,
            i => match &self.parts[i - 1] {
                ColdFilter::Fuse16(filter) => filter.contains(&key_hash),
                ColdFilter::Everything | ColdFilter::Fuse(_) => false,
            },
        }
    }

    /// False: `key_hash` is not in the generation. True: it may be.
    #[inline]
    pub(crate) fn may_contain(&self, key_hash: u64) -> bool {
        match self.firsts.partition_point(|&first| first <= key_hash) {
            0 => false,
            i => self.parts[i - 1].may_contain(key_hash),
        }
    }

    /// Starts the reads that `may_contain(key_hash)` makes (`prefetch.rs`).
    #[inline]
    pub(crate) fn prefetch(&self, key_hash: u64) {
        if let i @ 1.. = self.firsts.partition_point(|&first| first <= key_hash) {
            self.parts[i - 1].prefetch(key_hash);
        }
    }

    /// Bytes of memory the parts take.
    pub(crate) fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.bytes() + 8).sum()
    }

    /// The section's length in the file.
    pub(crate) fn encoded_len(&self) -> usize {
        4 + self
            .parts
            .iter()
            .map(|p| PART_HEADER_LEN + p.bytes())
            .sum::<usize>()
    }

    /// The section, a piece at a time (a part's fingerprints are one piece): u32 part
    /// count, then per part its first hash, kind, three zeros, length and filter.
    pub(crate) fn encode(&self, mut out: impl FnMut(&[u8])) {
        out(&(self.parts.len() as u32).to_le_bytes());
        let mut bytes = Vec::new();
        for (first, part) in self.firsts.iter().zip(&self.parts) {
            bytes.clear();
            part.encode_into(&mut bytes);
            let mut head = [0u8; PART_HEADER_LEN];
            head[0..8].copy_from_slice(&first.to_le_bytes());
            head[8] = part.kind();
            head[12..16].copy_from_slice(&(bytes.len() as u32).to_le_bytes());
            out(&head);
            out(&bytes);
        }
    }

    /// Whether these are the parts `sorted` hashes make, split where these split, each
    /// part rebuilt at its own fingerprint width (a whole-file check: a filter that
    /// misses an entry would take a duplicate for a fresh key, whatever its checksum
    /// says).
    pub(crate) fn is_built_from(&self, sorted: &[u64]) -> bool {
        if sorted.first() != self.firsts.first() {
            return false;
        }
        let mut rest = sorted;
        for (i, part) in self.parts.iter().enumerate() {
            let end = self
                .firsts
                .get(i + 1)
                .map_or(rest.len(), |&next| rest.partition_point(|&h| h < next));
            let rebuilt = ColdFilter::build(&rest[..end], part.kind() == 2);
            if rest.first() != Some(&self.firsts[i]) || rebuilt != *part {
                return false;
            }
            rest = &rest[end..];
        }
        rest.is_empty()
    }

    /// The parts from their section; `None` unless every part decodes, is of a kind
    /// the section may hold (`trusted`: the trusted filter's, 16-bit fingerprints or
    /// none; the exact filter's: 8-bit, 16-bit or none), the first hashes ascend
    /// strictly and the section ends with the last part.
    pub(crate) fn decode(bytes: &[u8], trusted: bool) -> Option<FilterParts> {
        if bytes.len() < 4 {
            return None;
        }
        let count = read_u32(bytes, 0) as usize;
        if count > (bytes.len() - 4) / PART_HEADER_LEN {
            return None;
        }
        let (mut firsts, mut parts) = (Vec::with_capacity(count), Vec::with_capacity(count));
        let mut width = None;
        let mut at = 4;
        for _ in 0..count {
            let head = bytes.get(at..at + PART_HEADER_LEN)?;
            let (first, kind, len) = (read_u64(head, 0), head[8], read_u32(head, 12) as usize);
            if head[9..12] != [0, 0, 0] || firsts.last().is_some_and(|&last| last >= first) {
                return None;
            }
            at += PART_HEADER_LEN;
            let body = bytes.get(at..at.checked_add(len)?)?;
            if trusted && kind == 1 || kind != 0 && *width.get_or_insert(kind) != kind {
                return None;
            }
            parts.push(ColdFilter::decode(kind, body)?);
            firsts.push(first);
            at += len;
        }
        (at == bytes.len()).then_some(FilterParts { firsts, parts })
    }
}

/// Builds a generation's [`FilterParts`] as its key hashes arrive in ascending order.
pub(crate) struct FilterBuilder {
    part_keys: usize,
    /// 16-bit fingerprints.
    wide: bool,
    firsts: Vec<u64>,
    parts: Vec<ColdFilter>,
    /// The current part's distinct hashes.
    pending: Vec<u64>,
}

impl FilterBuilder {
    pub(crate) fn new(part_keys: usize, wide: bool) -> FilterBuilder {
        assert!(part_keys > 0);
        FilterBuilder {
            part_keys,
            wide,
            firsts: Vec::new(),
            parts: Vec::new(),
            pending: Vec::new(),
        }
    }

    /// The next key hash (not below the last one).
    pub(crate) fn push(&mut self, hash: u64) {
        match self.pending.last() {
            Some(&last) if last == hash => return,
            Some(&last) => debug_assert!(last < hash),
            None => debug_assert!(self.firsts.last().is_none_or(|&f| f < hash)),
        }
        if self.pending.len() == self.part_keys {
            self.seal();
        }
        self.pending.push(hash);
    }

    fn seal(&mut self) {
        if let Some(&first) = self.pending.first() {
            self.parts
                .push(ColdFilter::build_distinct(&self.pending, self.wide));
            self.firsts.push(first);
            self.pending.clear();
        }
    }

    pub(crate) fn finish(mut self) -> FilterParts {
        self.seal();
        FilterParts {
            firsts: self.firsts,
            parts: self.parts,
        }
    }
}

/// Whether every probe of a filter with `descriptor` falls inside `len` fingerprints.
/// A probe reads `h0 < segment_count_length`, then `h0 + segment_length` and
/// `h0 + 2 × segment_length`, each with low bits flipped inside its aligned segment
/// (`segment_length` a power of two, the mask its low bits): all below
/// `segment_count_length + 2 × segment_length` when `segment_count_length` is a
/// multiple of `segment_length`, and that sum is the fingerprints' length (as xorf
/// builds them), with no `u32` overflow on the way.
fn probes_in_bounds(d: &Descriptor, len: usize) -> bool {
    let sl = u64::from(d.segment_length);
    let total = u64::from(d.segment_count_length) + 2 * sl;
    d.segment_length.is_power_of_two()
        && d.segment_length_mask == d.segment_length - 1
        && d.segment_count_length >= d.segment_length
        && u64::from(d.segment_count_length).is_multiple_of(sl)
        && total <= u64::from(u32::MAX)
        && total == len as u64
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `n` key hashes, ascending (distinct: 64-bit hashes of distinct integers).
    pub(in crate::format::cold_index) fn hashes(n: u64, salt: u64) -> Vec<u64> {
        let mut out: Vec<u64> = (0..n)
            .map(|i| xxhash_rust::xxh3::xxh3_64_with_seed(&i.to_le_bytes(), salt))
            .collect();
        out.sort_unstable();
        out
    }

    #[test]
    fn never_a_false_negative_and_about_the_designed_false_positive_rate() {
        let keys = hashes(200_000, 1);
        let filter = ColdFilter::build(&keys, false);
        assert_eq!(filter.kind(), 1);
        assert!(keys.iter().all(|&k| filter.may_contain(k)));
        let probes = hashes(1_000_000, 2);
        let false_positives = probes.iter().filter(|&&k| filter.may_contain(k)).count();
        let rate = false_positives as f64 / probes.len() as f64;
        // 8-bit fingerprints: 1/256 = 0.39%.
        assert!((0.002..0.006).contains(&rate), "false-positive rate {rate}");
        let per_key = filter.bytes() as f64 / keys.len() as f64;
        assert!((1.0..1.3).contains(&per_key), "{per_key} bytes per key");
    }

    #[test]
    fn tiny_and_repeated_key_sets_build() {
        for n in [1, 2, 3, 10, 100] {
            let mut keys = hashes(n, 3);
            keys.extend(keys.clone());
            keys.sort_unstable();
            let filter = ColdFilter::build(&keys, false);
            assert!(keys.iter().all(|&k| filter.may_contain(k)), "{n}");
            let mut bytes = Vec::new();
            filter.encode_into(&mut bytes);
            assert_eq!(
                ColdFilter::decode(filter.kind(), &bytes),
                Some(filter),
                "{n}"
            );
        }
    }

    #[test]
    fn the_encoding_round_trips_and_an_unsafe_descriptor_is_refused() {
        let filter = ColdFilter::build(&hashes(5_000, 4), false);
        let mut bytes = Vec::new();
        filter.encode_into(&mut bytes);
        assert_eq!(bytes.len(), filter.bytes());
        assert_eq!(ColdFilter::decode(1, &bytes), Some(filter.clone()));
        assert_eq!(ColdFilter::decode(0, &[]), Some(ColdFilter::Everything));
        assert_eq!(ColdFilter::decode(0, &bytes), None);
        assert_eq!(ColdFilter::decode(2, &bytes), None);
        assert_eq!(ColdFilter::decode(1, &bytes[..DESCRIPTOR_LEN]), None);
        // One fingerprint short or long, and each descriptor field off by one bit.
        assert_eq!(ColdFilter::decode(1, &bytes[..bytes.len() - 1]), None);
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(ColdFilter::decode(1, &longer), None);
        for (at, bit) in [(8, 0), (8, 5), (12, 0), (12, 7), (16, 0), (17, 2), (19, 7)] {
            let mut damaged = bytes.clone();
            damaged[at] ^= 1 << bit;
            assert_eq!(ColdFilter::decode(1, &damaged), None, "byte {at} bit {bit}");
        }
        // The seed is any number: a damaged one only changes answers (the checksum's
        // business), and probing stays in bounds.
        let mut reseeded = bytes.clone();
        reseeded[0] ^= 1;
        let other = ColdFilter::decode(1, &reseeded).unwrap();
        let _ = hashes(10_000, 5)
            .iter()
            .filter(|&&k| other.may_contain(k))
            .count();
    }

    /// The exact filter's section holds 8- or 16-bit parts, never both; the trusted
    /// filter's only 16-bit ones. Each is checked against its entries at its width.
    #[test]
    fn a_section_is_one_width_and_checked_at_it() {
        let keys = hashes(3_000, 8);
        let encoded = |parts: &FilterParts| {
            let mut bytes = Vec::new();
            parts.encode(|piece| bytes.extend_from_slice(piece));
            bytes
        };
        for wide in [false, true] {
            let parts = FilterParts::build(&keys, 1_000, wide);
            assert_eq!(parts.is_wide(), wide);
            let bytes = encoded(&parts);
            assert_eq!(FilterParts::decode(&bytes, false), Some(parts.clone()));
            assert_eq!(FilterParts::decode(&bytes, true).is_some(), wide);
            assert!(parts.is_built_from(&keys));
            assert!(!parts.is_built_from(&keys[1..]));
        }
        let narrow = FilterParts::build(&keys, 1_000, false);
        let wide = FilterParts::build(&keys, 1_000, true);
        let mixed = FilterParts {
            firsts: narrow.firsts.clone(),
            parts: vec![
                narrow.parts[0].clone(),
                wide.parts[1].clone(),
                narrow.parts[2].clone(),
            ],
        };
        assert!(mixed.is_built_from(&keys), "each part is its keys' own");
        assert_eq!(FilterParts::decode(&encoded(&mixed), false), None);
    }

    #[test]
    fn sixteen_bit_fingerprints_round_trip_at_about_their_designed_rate() {
        let keys = hashes(200_000, 6);
        let filter = ColdFilter::build(&keys, true);
        assert_eq!(filter.kind(), 2);
        assert!(keys.iter().all(|&k| filter.may_contain(k)));
        let probes = hashes(2_000_000, 7);
        let false_positives = probes.iter().filter(|&&k| filter.may_contain(k)).count();
        // 2^-16 ≈ 1.5e-5: about 30 of 2M.
        assert!(
            (5..100).contains(&false_positives),
            "{false_positives} false positives"
        );
        let per_key = filter.bytes() as f64 / keys.len() as f64;
        assert!((2.0..2.6).contains(&per_key), "{per_key} bytes per key");
        let mut bytes = Vec::new();
        filter.encode_into(&mut bytes);
        assert_eq!(bytes.len(), filter.bytes());
        assert_eq!(ColdFilter::decode(2, &bytes), Some(filter));
        assert_eq!(ColdFilter::decode(2, &bytes[..bytes.len() - 1]), None);
        assert_eq!(ColdFilter::decode(2, &bytes[..bytes.len() - 2]), None);
        assert_eq!(ColdFilter::decode(1, &bytes), None);
    }
}
