//! The filter in front of a cold index generation (issue 11, `docs/FORMAT.md`, "Cold
//! index files"): a split-block bloom filter, Parquet's design. A key sets one bit in
//! each of the 8 32-bit words of one 256-bit block, so a probe reads one cache line.
//!
//! Chosen by measurement over binary fuse filters (`examples/filter_choice`,
//! `docs/BENCHMARKS.md`): once the filters outgrow the caches, a fresh key probes one
//! filter per cold generation, and a block probe is one memory access where a binary
//! fuse probe is three; it also builds 3–4× faster. It costs more bits for the same
//! false-positive rate (12 bits per key for ~0.55% against 9 bits for ~0.39%), which
//! the memory budget affords.
//!
//! Soundness and answers never rest on the bytes: the block is picked by a
//! multiply-shift over the block count (always in range), and a false positive costs a
//! page read, never a wrong answer (every hit is verified against the key bytes).

/// Bits of filter per key at the sizes the store builds.
pub(crate) const BITS_PER_KEY: usize = 12;
/// Bytes of one block: 8 little-endian `u32` words.
pub(crate) const BLOCK_LEN: usize = 32;

const SALT: [u32; 8] = [
    0x47b6_137b,
    0x4497_4d91,
    0x8824_ad5b,
    0xa2b7_289d,
    0x7054_95c7,
    0x2df1_424b,
    0x9efc_4947,
    0x5c6b_fb31,
];

/// A split-block bloom filter over 64-bit key hashes, with a seed of its own (so that
/// the false positives of two generations are independent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockFilter {
    seed: u64,
    blocks: Vec<[u32; 8]>,
}

impl BlockFilter {
    /// An empty filter sized for `keys` keys at [`BITS_PER_KEY`].
    pub fn with_capacity(keys: usize, seed: u64) -> BlockFilter {
        BlockFilter::with_bits_per_key(keys, BITS_PER_KEY, seed)
    }

    /// An empty filter of `bits_per_key` bits for each of `keys` keys (the store uses
    /// [`BITS_PER_KEY`]; `examples/filter_choice` measures others).
    pub fn with_bits_per_key(keys: usize, bits_per_key: usize, seed: u64) -> BlockFilter {
        let blocks = (keys.saturating_mul(bits_per_key)).div_ceil(256).max(1);
        BlockFilter {
            seed,
            blocks: vec![[0; 8]; blocks],
        }
    }

    /// Blocks the filter for `keys` keys has (what `with_capacity` allocates).
    pub(crate) fn blocks_for(keys: usize) -> usize {
        (keys.saturating_mul(BITS_PER_KEY)).div_ceil(256).max(1)
    }

    #[inline]
    fn mixed(&self, key_hash: u64) -> u64 {
        // The store's key hashes are xxh3 (uniform); mixing in the seed decorrelates
        // generations and the shard bits the hot index takes from the same hash.
        let mut z = key_hash ^ self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    #[inline]
    fn block(&self, mixed: u64) -> usize {
        // (high 32 bits × blocks) >> 32 < blocks: in range whatever the hash.
        (((mixed >> 32) * self.blocks.len() as u64) >> 32) as usize
    }

    #[inline]
    fn masks(mixed: u64) -> [u32; 8] {
        let low = mixed as u32;
        std::array::from_fn(|i| 1u32 << (low.wrapping_mul(SALT[i]) >> 27))
    }

    /// Adds a key hash.
    pub fn insert(&mut self, key_hash: u64) {
        let mixed = self.mixed(key_hash);
        let at = self.block(mixed);
        for (word, mask) in self.blocks[at].iter_mut().zip(Self::masks(mixed)) {
            *word |= mask;
        }
    }

    /// False: `key_hash` was never inserted. True: it may have been.
    #[inline]
    pub fn may_contain(&self, key_hash: u64) -> bool {
        let mixed = self.mixed(key_hash);
        let block = &self.blocks[self.block(mixed)];
        block
            .iter()
            .zip(Self::masks(mixed))
            .all(|(word, mask)| word & mask != 0)
    }

    pub(crate) fn seed(&self) -> u64 {
        self.seed
    }

    pub(crate) fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// Bytes of memory the blocks take.
    pub fn bytes(&self) -> usize {
        self.blocks.len() * BLOCK_LEN
    }

    /// The blocks as the file stores them: each word little-endian, block after block.
    pub(crate) fn encode_into(&self, out: &mut Vec<u8>) {
        out.reserve(self.bytes());
        for block in &self.blocks {
            for word in block {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
    }

    /// A filter from blocks as `encode_into` wrote them; `None` if `bytes` is empty or
    /// not a whole number of blocks. Any bytes make a usable filter: a damaged one
    /// can only answer "may contain" wrongly, which the file's checksum catches first.
    pub(crate) fn decode(seed: u64, bytes: &[u8]) -> Option<BlockFilter> {
        if bytes.is_empty() || !bytes.len().is_multiple_of(BLOCK_LEN) {
            return None;
        }
        let blocks = bytes
            .chunks_exact(BLOCK_LEN)
            .map(|block| std::array::from_fn(|i| crate::format::read_u32(block, i * 4)))
            .collect();
        Some(BlockFilter { seed, blocks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(i: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&i.to_le_bytes())
    }

    #[test]
    fn never_a_false_negative_and_about_the_designed_false_positive_rate() {
        let keys = 200_000;
        let mut filter = BlockFilter::with_capacity(keys, 7);
        for i in 0..keys as u64 {
            filter.insert(hash(i));
        }
        assert!((0..keys as u64).all(|i| filter.may_contain(hash(i))));
        let probes = 1_000_000u64;
        let false_positives = (0..probes)
            .filter(|&i| filter.may_contain(hash(i + (1 << 40))))
            .count();
        let rate = false_positives as f64 / probes as f64;
        // Split-block bloom at 12 bits per key: ~0.55% (examples/filter_choice).
        assert!((0.002..0.012).contains(&rate), "false-positive rate {rate}");
        assert_eq!(filter.bytes(), BlockFilter::blocks_for(keys) * BLOCK_LEN);
    }

    #[test]
    fn seeds_make_independent_filters() {
        let keys = 50_000;
        let build = |seed| {
            let mut f = BlockFilter::with_capacity(keys, seed);
            (0..keys as u64).for_each(|i| f.insert(hash(i)));
            f
        };
        let (a, b) = (build(1), build(2));
        let probes = 400_000u64;
        let (mut in_a, mut in_both) = (0, 0);
        for i in 0..probes {
            let h = hash(i + (1 << 40));
            if a.may_contain(h) {
                in_a += 1;
                in_both += usize::from(b.may_contain(h));
            }
        }
        assert!(in_a > 500, "{in_a}");
        // Independent: a false positive of one is one of the other at the base rate.
        assert!(in_both * 20 < in_a, "{in_both} of {in_a}");
    }

    #[test]
    fn the_encoding_round_trips_and_odd_lengths_are_refused() {
        let mut filter = BlockFilter::with_capacity(1000, 99);
        (0..1000).for_each(|i| filter.insert(hash(i)));
        let mut bytes = Vec::new();
        filter.encode_into(&mut bytes);
        assert_eq!(bytes.len(), filter.bytes());
        assert_eq!(BlockFilter::decode(99, &bytes), Some(filter));
        assert_eq!(BlockFilter::decode(99, &bytes[..bytes.len() - 1]), None);
        assert_eq!(BlockFilter::decode(99, &[]), None);
        // Any whole blocks decode and probe in range: all ones hold everything, all
        // zeros nothing.
        let full = BlockFilter::decode(1, &[0xFF; 3 * BLOCK_LEN]).unwrap();
        let empty = BlockFilter::decode(1, &[0; 3 * BLOCK_LEN]).unwrap();
        assert!((0..1000).all(|i| full.may_contain(hash(i)) && !empty.may_contain(hash(i))));
    }
}
