//! Which filter fronts a cold index tier (issue 11): the candidates side by side on the
//! same keys, in one run.
//!
//! ```sh
//! cargo run --release --example filter_choice -- [keys] [generations]
//! ```
//!
//! For `keys` random 64-bit key hashes (default 100,000,000) split into `generations`
//! immutable sets (default 8, as a fresh key probes one filter per cold generation),
//! each candidate is built per generation, then:
//! - RAM per key (the filters' bytes / keys);
//! - the measured false-positive rate of one filter (10,000,000 keys not in it), and
//!   what it means for a fresh key: the expected page reads over all generations;
//! - ns per fresh key: one key probed in every generation (all miss but the false
//!   positives), 2 threads, the keys independent (as the hot path's are);
//! - ns per member probe (a key of the last generation probed newest first);
//! - build time per key.
//!
//! Candidates: xor-family binary fuse filters (`xorf`, 8- and 16-bit fingerprints:
//! three byte reads per probe, near each other) and a split-block bloom filter
//! (Parquet's design: a 256-bit block per key, one bit in each of its 8 words: one
//! cache line per probe), at 10 and 12 bits per key. The store uses the 8-bit binary
//! fuse filter (`src/format/cold_index/filter.rs`); docs/BENCHMARKS.md has the figures.

use std::hint::black_box;
use std::time::Instant;

use xorf::{BinaryFuse8, BinaryFuse16, Filter};

/// splitmix64: the key hashes (idemstore's key hashes are xxh3: uniform).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A split-block bloom filter (Parquet's design): blocks of 8 × 32-bit words; a key
/// sets one bit in each word of one block, the block chosen by the hash's high half.
struct SplitBlockBloom {
    blocks: Vec<[u32; 8]>,
}

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

impl SplitBlockBloom {
    fn new(keys: usize, bits_per_key: usize) -> SplitBlockBloom {
        let blocks = (keys * bits_per_key).div_ceil(256).max(1);
        SplitBlockBloom {
            blocks: vec![[0; 8]; blocks],
        }
    }

    #[inline]
    fn block(&self, hash: u64) -> usize {
        (((hash >> 32) * self.blocks.len() as u64) >> 32) as usize
    }

    #[inline]
    fn masks(hash: u64) -> [u32; 8] {
        let low = hash as u32;
        std::array::from_fn(|i| 1u32 << (low.wrapping_mul(SALT[i]) >> 27))
    }

    fn insert(&mut self, hash: u64) {
        let at = self.block(hash);
        for (word, mask) in self.blocks[at].iter_mut().zip(Self::masks(hash)) {
            *word |= mask;
        }
    }

    #[inline]
    fn may_contain(&self, hash: u64) -> bool {
        let block = &self.blocks[self.block(hash)];
        block
            .iter()
            .zip(Self::masks(hash))
            .all(|(word, mask)| word & mask != 0)
    }

    fn bytes(&self) -> usize {
        self.blocks.len() * 32
    }
}

enum Candidate {
    Fuse8(Vec<BinaryFuse8>),
    Fuse16(Vec<BinaryFuse16>),
    Bloom(usize, Vec<(SplitBlockBloom, u64)>),
}

impl Candidate {
    fn name(&self) -> String {
        match self {
            Candidate::Fuse8(_) => "binary fuse, 8-bit (xorf)".into(),
            Candidate::Fuse16(_) => "binary fuse, 16-bit (xorf)".into(),
            Candidate::Bloom(bits, _) => format!("split-block bloom, {bits} bits/key"),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Candidate::Fuse8(f) => f.iter().map(|f| f.fingerprints.len() + 20).sum(),
            Candidate::Fuse16(f) => f.iter().map(|f| f.fingerprints.len() * 2 + 20).sum(),
            Candidate::Bloom(_, f) => f.iter().map(|(f, _)| f.bytes()).sum(),
        }
    }

    fn generations(&self) -> usize {
        match self {
            Candidate::Fuse8(f) => f.len(),
            Candidate::Fuse16(f) => f.len(),
            Candidate::Bloom(_, f) => f.len(),
        }
    }

    #[inline]
    fn contains(&self, generation: usize, hash: u64) -> bool {
        match self {
            Candidate::Fuse8(f) => f[generation].contains(&hash),
            Candidate::Fuse16(f) => f[generation].contains(&hash),
            Candidate::Bloom(_, f) => f[generation].0.may_contain(mix(hash ^ f[generation].1)),
        }
    }

    /// How many generations claim `hash` (newest first).
    #[inline]
    fn hits(&self, hash: u64) -> usize {
        (0..self.generations())
            .rev()
            .filter(|&g| self.contains(g, hash))
            .count()
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: usize = args.next().map_or(100_000_000, |a| a.parse().unwrap());
    let generations: usize = args.next().map_or(8, |a| a.parse().unwrap());
    let per = keys / generations;
    let hash = |g: usize, i: usize| mix((g * per + i) as u64);
    let absent = |i: usize| mix((keys + i) as u64 | 1 << 63);
    println!("{keys} keys in {generations} generations of {per}; 2 threads for the probes");

    let builders: Vec<Box<dyn Fn() -> Candidate>> = vec![
        Box::new(|| {
            Candidate::Fuse8(
                (0..generations)
                    .map(|g| BinaryFuse8::try_from_iterator((0..per).map(|i| hash(g, i))).unwrap())
                    .collect(),
            )
        }),
        Box::new(|| {
            Candidate::Fuse16(
                (0..generations)
                    .map(|g| BinaryFuse16::try_from_iterator((0..per).map(|i| hash(g, i))).unwrap())
                    .collect(),
            )
        }),
        Box::new(|| bloom(generations, per, 10, &hash)),
        Box::new(|| bloom(generations, per, 12, &hash)),
    ];
    println!(
        "{:<30} {:>9} {:>11} {:>17} {:>16} {:>15} {:>13}",
        "filter", "B/key", "FPR", "page reads/fresh", "ns/fresh key", "ns/member", "build ns/key"
    );
    for build in builders {
        let started = Instant::now();
        let candidate = build();
        let build_ns = started.elapsed().as_nanos() as f64 / (per * generations) as f64;
        let probes = 10_000_000;
        let false_positives = (0..probes)
            .filter(|&i| candidate.contains(0, absent(i)))
            .count();
        let fpr = false_positives as f64 / probes as f64;
        // A fresh key probes every generation; 2 threads, keys independent.
        let fresh = 4_000_000;
        let (reads, fresh_ns) = on_two_threads(fresh, |i| candidate.hits(absent(probes + i)));
        // Members of the oldest generation: every newer one probed first.
        let (found, member_ns) = on_two_threads(fresh, |i| candidate.hits(hash(0, i % per)));
        assert!(found >= fresh, "a filter lost a member");
        println!(
            "{:<30} {:>9.3} {:>10.4}% {:>17.4} {:>16.1} {:>15.1} {:>13.1}",
            candidate.name(),
            candidate.bytes() as f64 / (per * generations) as f64,
            fpr * 100.0,
            reads as f64 / fresh as f64,
            fresh_ns,
            member_ns,
            build_ns
        );
    }
}

/// `probe(i)` for `i` in `0..n`, half on each of 2 threads: the sum of the answers, and
/// ns per probe per thread.
fn on_two_threads(n: usize, probe: impl Fn(usize) -> usize + Sync) -> (usize, f64) {
    let started = Instant::now();
    let total = std::thread::scope(|s| {
        let probe = &probe;
        let handles: Vec<_> = (0..2)
            .map(|t| {
                s.spawn(move || {
                    (t * n / 2..(t + 1) * n / 2)
                        .map(|i| probe(black_box(i)))
                        .sum::<usize>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    (total, started.elapsed().as_nanos() as f64 * 2.0 / n as f64)
}

fn bloom(
    generations: usize,
    per: usize,
    bits: usize,
    hash: &dyn Fn(usize, usize) -> u64,
) -> Candidate {
    Candidate::Bloom(
        bits,
        (0..generations)
            .map(|g| {
                // Seeded per generation, so false positives are independent.
                let (mut filter, seed) = (SplitBlockBloom::new(per, bits), g as u64);
                for i in 0..per {
                    filter.insert(mix(hash(g, i) ^ seed));
                }
                (filter, seed)
            })
            .collect(),
    )
}
