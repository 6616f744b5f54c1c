//! Prefetching a fresh key's filter probes across generations (issue 11): a fresh key
//! probes every generation's filter, three fingerprints each, and at a billion keys
//! each of those reads misses the caches and the TLB. Probed one generation after the
//! other, the misses barely overlap (the binary search over a filter's parts and the
//! page read a hit would need sit between them). `prefetch` computes the positions of
//! all three reads and asks the CPU to start them, so that a lookup issues every
//! generation's prefetches first and then probes them: the misses overlap.
//!
//! The positions are xorf's (`bfuse_contains_impl` in xorf 0.13: murmur3's finalizer of
//! `key + seed`, then `hash_of_hash`), which xorf does not export. A wrong position
//! would only waste a prefetch, never change an answer (the probe itself is xorf's
//! `contains`); a test checks that these positions answer exactly as `contains` does.

use xorf::Descriptor;

use super::filter::ColdFilter;

/// murmur3's 64-bit finalizer (xorf's `mix` of `key + seed`).
#[inline]
fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xff51_afd7_ed55_8ccd);
    k ^= k >> 33;
    k = k.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    k ^ (k >> 33)
}

/// The hash a binary fuse filter derives from `key`, and the three fingerprint
/// positions its `contains` reads.
#[inline]
fn positions(d: &Descriptor, key: u64) -> (u64, [usize; 3]) {
    let hash = fmix64(key.wrapping_add(d.seed));
    let h0 = ((u128::from(hash) * u128::from(d.segment_count_length)) >> 64) as u32;
    let h1 = h0.wrapping_add(d.segment_length) ^ ((hash >> 18) as u32 & d.segment_length_mask);
    let h2 = h0
        .wrapping_add(d.segment_length)
        .wrapping_add(d.segment_length)
        ^ (hash as u32 & d.segment_length_mask);
    (hash, [h0 as usize, h1 as usize, h2 as usize])
}

/// Asks the CPU to bring the cache line at `at` in. Any address will do.
#[inline(always)]
fn prefetch_line<T>(at: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint. It has no memory-safety precondition: it reads
    // nothing the program sees and never faults, whatever the address (an address
    // outside the process is dropped). `at` comes from `wrapping_add`, which has no
    // bounds requirement either.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(at.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = at;
}

impl ColdFilter {
    /// Starts the reads of the three fingerprints that `may_contain(key_hash)` reads,
    /// without waiting for them.
    #[inline]
    pub(crate) fn prefetch(&self, key_hash: u64) {
        let (d, base, width) = match self {
            ColdFilter::Everything => return,
            ColdFilter::Fuse(f) => (&f.descriptor, f.fingerprints.as_ptr().cast::<u8>(), 1),
            ColdFilter::Fuse16(f) => (&f.descriptor, f.fingerprints.as_ptr().cast::<u8>(), 2),
        };
        for at in positions(d, key_hash).1 {
            prefetch_line(base.wrapping_add(at * width));
        }
    }
}

#[cfg(test)]
mod tests {
    use xorf::{BinaryFuse8, BinaryFuse16};

    use super::*;
    use crate::format::cold_index::filter::tests::hashes;

    /// `contains` recomputed from `positions`: equal to xorf's for members and
    /// non-members alike, so the prefetched lines are the ones the probe reads.
    #[test]
    fn the_prefetched_positions_are_the_ones_contains_reads() {
        for n in [1, 7, 1_000, 300_000] {
            let keys = hashes(n, 11);
            let probes: Vec<u64> = keys.iter().copied().chain(hashes(200_000, 12)).collect();
            let f8 = BinaryFuse8::try_from(&keys[..]).unwrap();
            let f16 = BinaryFuse16::try_from(&keys[..]).unwrap();
            let (mut hits8, mut hits16) = (0, 0);
            let kinds = [
                ColdFilter::Fuse(f8.clone()),
                ColdFilter::Fuse16(f16.clone()),
                ColdFilter::Everything,
            ];
            for &k in &probes {
                let (hash, [a, b, c]) = positions(&f8.descriptor, k);
                let fp = (hash ^ (hash >> 32)) as u8;
                let mine = fp ^ f8.fingerprints[a] ^ f8.fingerprints[b] ^ f8.fingerprints[c] == 0;
                assert_eq!(mine, xorf::Filter::contains(&f8, &k), "8-bit, {n} keys");
                hits8 += usize::from(mine);
                let (hash, [a, b, c]) = positions(&f16.descriptor, k);
                let fp = (hash ^ (hash >> 32)) as u16;
                let mine =
                    fp ^ f16.fingerprints[a] ^ f16.fingerprints[b] ^ f16.fingerprints[c] == 0;
                assert_eq!(mine, xorf::Filter::contains(&f16, &k), "16-bit, {n} keys");
                hits16 += usize::from(mine);
                // Every filter kind takes a prefetch (it only has to run: a prefetch
                // has no result to check).
                for filter in &kinds {
                    filter.prefetch(k);
                }
            }
            // Every member is among the hits (not a vacuous comparison).
            assert!(hits8 >= keys.len() && hits16 >= keys.len(), "{n}");
        }
    }
}
