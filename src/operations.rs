//! Per-operation counters and latency histograms: what [`Stats::operations`]
//! reports.
//!
//! Counters live in one cache-padded slot per index shard and are bumped while the
//! caller holds that shard's lock, so a bump is a plain load and store (no locked
//! instruction, no cache line shared with another shard). Latencies are sampled: one
//! call in [`LATENCY_SAMPLE_EVERY`] per thread reads the clock twice and adds one
//! count to a log-bucketed histogram, so the hot path pays for neither `Instant::now`
//! nor an atomic add on the other calls.
//!
//! [`Stats::operations`]: crate::Stats::operations

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

/// One call in this many (per thread) is timed.
pub const LATENCY_SAMPLE_EVERY: u32 = 8;

/// Sub-buckets per power of two: a bucket is at most 1/8 (12.5 %) wide.
const SUB_BUCKET_BITS: u32 = 3;
const SUB_BUCKETS: usize = 1 << SUB_BUCKET_BITS;
/// Latencies below 2^6 ns share the first bucket; the top bucket holds 2^40 ns (18
/// minutes) and longer.
const SMALLEST_POWER: u32 = 6;
const LARGEST_POWER: u32 = 40;
/// Number of buckets of a [`LatencyHistogram`].
const BUCKETS: usize = (LARGEST_POWER - SMALLEST_POWER + 1) as usize * SUB_BUCKETS;
/// Histograms are striped so that threads timing at once rarely share a cache line.
const HISTOGRAM_STRIPES: usize = 8;

const _: () = assert!(LATENCY_SAMPLE_EVERY.is_power_of_two());
const _: () = assert!(BUCKETS == 280);

/// The counters of one shard, in this order.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    CheckAndSetFirst,
    CheckAndSetDuplicate,
    BeginAcquired,
    BeginInProgress,
    BeginCompleted,
    BeginExhausted,
    Complete,
    Release,
    Fail,
    Remove,
    CheckAndSetLikelyDuplicate,
}
const COUNTERS: usize = Counter::CheckAndSetLikelyDuplicate as usize + 1;

/// The operations whose latency is sampled.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Timed {
    CheckAndSet,
    Begin,
}
const TIMED: usize = 2;

/// The store's operation counters and latency histograms.
pub(crate) struct Operations {
    shards: Box<[CachePadded<[AtomicU64; COUNTERS]>]>,
    latency: Box<[CachePadded<[[AtomicU64; BUCKETS]; TIMED]>]>,
}

thread_local! {
    /// Calls made on this thread, for sampling.
    static CALLS: Cell<u32> = const { Cell::new(0) };
    /// This thread's histogram stripe, handed out round-robin.
    static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
}

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

/// A sampled call's start; `None` for calls that are not timed.
pub(crate) fn start_timer() -> Option<Instant> {
    CALLS.with(|calls| {
        let n = calls.get().wrapping_add(1);
        calls.set(n);
        (n % LATENCY_SAMPLE_EVERY == 0).then(Instant::now)
    })
}

fn stripe() -> usize {
    STRIPE.with(|stripe| {
        if stripe.get() == usize::MAX {
            stripe.set(NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % HISTOGRAM_STRIPES);
        }
        stripe.get()
    })
}

impl Operations {
    pub(crate) fn new(shards: usize) -> Operations {
        Operations {
            shards: (0..shards)
                .map(|_| CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
            latency: (0..HISTOGRAM_STRIPES)
                .map(|_| {
                    CachePadded::new(std::array::from_fn(|_| {
                        std::array::from_fn(|_| AtomicU64::new(0))
                    }))
                })
                .collect(),
        }
    }

    /// Counts one `counter` on `shard`. The caller holds that shard's lock: every
    /// writer of this slot does, so a load and a store cannot lose an update.
    #[inline]
    pub(crate) fn count_locked(&self, shard: usize, counter: Counter) {
        let slot = &self.shards[shard][counter as usize];
        slot.store(slot.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
    }

    /// Records the latency of a call started at `started` (from `start_timer`);
    /// returns it, for a call that was timed.
    #[inline]
    pub(crate) fn record_latency(
        &self,
        timed: Timed,
        started: Option<Instant>,
    ) -> Option<Duration> {
        let elapsed = started?.elapsed();
        let bucket = bucket_of(u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX));
        self.latency[stripe()][timed as usize][bucket].fetch_add(1, Ordering::Relaxed);
        Some(elapsed)
    }

    /// A snapshot of every counter and histogram.
    pub(crate) fn snapshot(&self) -> OperationStats {
        let mut totals = [0u64; COUNTERS];
        for shard in self.shards.iter() {
            for (total, count) in totals.iter_mut().zip(shard.iter()) {
                *total += count.load(Ordering::Relaxed);
            }
        }
        let histogram = |timed: Timed| {
            let mut buckets = vec![0u64; BUCKETS];
            for stripe in self.latency.iter() {
                for (total, count) in buckets.iter_mut().zip(stripe[timed as usize].iter()) {
                    *total += count.load(Ordering::Relaxed);
                }
            }
            LatencyHistogram { buckets }
        };
        OperationStats {
            check_and_set_first: totals[Counter::CheckAndSetFirst as usize],
            check_and_set_duplicate: totals[Counter::CheckAndSetDuplicate as usize],
            check_and_set_likely_duplicate: totals[Counter::CheckAndSetLikelyDuplicate as usize],
            begin_acquired: totals[Counter::BeginAcquired as usize],
            begin_in_progress: totals[Counter::BeginInProgress as usize],
            begin_completed: totals[Counter::BeginCompleted as usize],
            begin_exhausted: totals[Counter::BeginExhausted as usize],
            complete: totals[Counter::Complete as usize],
            release: totals[Counter::Release as usize],
            fail: totals[Counter::Fail as usize],
            remove: totals[Counter::Remove as usize],
            check_and_set_latency: histogram(Timed::CheckAndSet),
            begin_latency: histogram(Timed::Begin),
        }
    }
}

/// The bucket of a latency of `nanos`: the power of two, then 8 linear steps in it.
fn bucket_of(nanos: u64) -> usize {
    let nanos = nanos.max(1);
    let power = 63 - nanos.leading_zeros();
    if power < SMALLEST_POWER {
        // Below 64 ns (faster than any operation here): the first bucket.
        return 0;
    }
    if power > LARGEST_POWER {
        return BUCKETS - 1;
    }
    let sub = (nanos >> (power - SUB_BUCKET_BITS)) as usize & (SUB_BUCKETS - 1);
    (power - SMALLEST_POWER) as usize * SUB_BUCKETS + sub
}

/// The largest latency, in nanoseconds, that falls in `bucket`.
fn bucket_upper_nanos(bucket: usize) -> u64 {
    let power = SMALLEST_POWER + (bucket / SUB_BUCKETS) as u32;
    let sub = (bucket % SUB_BUCKETS) as u64;
    let step = 1u64 << (power - SUB_BUCKET_BITS);
    (1u64 << power) + (sub + 1) * step - 1
}

/// Counts of the store's operations since open, and sampled latency histograms.
///
/// The counts are exact. The histograms hold one call in [`LATENCY_SAMPLE_EVERY`]
/// per thread, timed from the call to its return (including any durability wait).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OperationStats {
    /// `check_and_set` answers `First` (each id of `check_and_set_many` counts).
    pub check_and_set_first: u64,
    /// `check_and_set` answers `Duplicate`.
    pub check_and_set_duplicate: u64,
    /// `check_and_set` answers `LikelyDuplicate` (approximate namespaces only).
    pub check_and_set_likely_duplicate: u64,
    /// `begin` answers `Acquired`.
    pub begin_acquired: u64,
    /// `begin` answers `InProgress`.
    pub begin_in_progress: u64,
    /// `begin` answers `Completed`.
    pub begin_completed: u64,
    /// `begin` answers `Exhausted`.
    pub begin_exhausted: u64,
    /// Claims completed.
    pub complete: u64,
    /// Claims released (explicitly or by dropping them).
    pub release: u64,
    /// Claims failed.
    pub fail: u64,
    /// Keys removed.
    pub remove: u64,
    /// Sampled latency of `Namespace::check_and_set`.
    pub check_and_set_latency: LatencyHistogram,
    /// Sampled latency of `Namespace::begin` and `begin_with_payload`.
    pub begin_latency: LatencyHistogram,
}

/// A log-bucketed latency histogram: each power of two of nanoseconds is cut into 8
/// buckets, so a quantile is exact to within 12.5 % (it reports its bucket's upper
/// bound, never less than the true value). Covers 1 ns to 18 minutes.
#[derive(Clone, PartialEq, Eq)]
pub struct LatencyHistogram {
    buckets: Vec<u64>,
}

impl Default for LatencyHistogram {
    fn default() -> LatencyHistogram {
        LatencyHistogram {
            buckets: vec![0; BUCKETS],
        }
    }
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.count())
            .field("p50", &self.p50())
            .field("p99", &self.p99())
            .field("p999", &self.p999())
            .finish()
    }
}

impl LatencyHistogram {
    /// Calls timed.
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    /// The latency that a fraction `q` (0.0 to 1.0) of the timed calls did not exceed
    /// (to within 12.5 %, rounded up); zero if nothing was timed.
    pub fn quantile(&self, q: f64) -> Duration {
        let count = self.count();
        if count == 0 {
            return Duration::ZERO;
        }
        // The rank of the call at quantile q, 1-based: at least the first call.
        let rank = ((q.clamp(0.0, 1.0) * count as f64).ceil() as u64).clamp(1, count);
        let mut seen = 0u64;
        for (bucket, &n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return Duration::from_nanos(bucket_upper_nanos(bucket));
            }
        }
        Duration::from_nanos(bucket_upper_nanos(BUCKETS - 1))
    }

    /// The median.
    pub fn p50(&self) -> Duration {
        self.quantile(0.5)
    }

    /// The 99th percentile.
    pub fn p99(&self) -> Duration {
        self.quantile(0.99)
    }

    /// The 99.9th percentile.
    pub fn p999(&self) -> Duration {
        self.quantile(0.999)
    }

    /// The non-empty buckets as `(upper bound, calls)`, in increasing order.
    pub fn buckets(&self) -> impl Iterator<Item = (Duration, u64)> + '_ {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(bucket, &n)| (Duration::from_nanos(bucket_upper_nanos(bucket)), n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_latency_lands_in_a_bucket_whose_bounds_hold_it() {
        let mut previous_upper = 0u64;
        for bucket in 0..BUCKETS {
            let upper = bucket_upper_nanos(bucket);
            assert!(upper >= previous_upper, "bucket {bucket} bounds decrease");
            previous_upper = upper;
        }
        let mut samples: Vec<u64> = (0..200).collect();
        samples.extend((0..63).map(|p| 1u64 << p));
        samples.extend((1..63).map(|p| (1u64 << p) - 1));
        samples.extend([999, 1_000, 12_345, 1_000_000, 987_654_321, u64::MAX]);
        for nanos in samples {
            let bucket = bucket_of(nanos);
            assert!(bucket < BUCKETS);
            let upper = bucket_upper_nanos(bucket);
            if bucket < BUCKETS - 1 {
                assert!(
                    nanos <= upper,
                    "{nanos} ns above its bucket's bound {upper}"
                );
                let lower = if bucket == 0 {
                    0
                } else {
                    bucket_upper_nanos(bucket - 1) + 1
                };
                assert!(
                    nanos >= lower,
                    "{nanos} ns below its bucket's lower bound {lower}"
                );
                assert!(
                    nanos < 64 || (upper - nanos) as f64 <= nanos as f64 / 8.0,
                    "{nanos} ns reported as {upper}: more than 12.5 % off"
                );
            }
        }
    }

    #[test]
    fn quantiles_pick_the_bucket_of_the_ranked_call() {
        let mut histogram = LatencyHistogram::default();
        // 989 calls of about 1 µs, 10 of about 1 ms, 1 of about 1 s.
        histogram.buckets[bucket_of(1_000)] = 989;
        histogram.buckets[bucket_of(1_000_000)] = 10;
        histogram.buckets[bucket_of(1_000_000_000)] = 1;
        assert_eq!(histogram.count(), 1_000);
        let near = |d: Duration, nanos: u64| {
            let got = d.as_nanos() as u64;
            got >= nanos && got <= nanos + nanos / 8
        };
        assert!(near(histogram.p50(), 1_000), "{:?}", histogram.p50());
        assert!(near(histogram.p99(), 1_000_000), "{:?}", histogram.p99());
        assert!(near(histogram.p999(), 1_000_000), "{:?}", histogram.p999());
        assert!(near(histogram.quantile(1.0), 1_000_000_000));
        assert_eq!(LatencyHistogram::default().p99(), Duration::ZERO);
        assert_eq!(histogram.buckets().count(), 3);
    }

    #[test]
    fn counters_and_latencies_add_up_across_shards_and_threads() {
        let operations = Operations::new(4);
        operations.count_locked(0, Counter::CheckAndSetFirst);
        operations.count_locked(3, Counter::CheckAndSetFirst);
        operations.count_locked(2, Counter::Fail);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    operations.record_latency(Timed::Begin, Some(Instant::now()));
                });
            }
        });
        operations.record_latency(Timed::Begin, None);
        let stats = operations.snapshot();
        assert_eq!(stats.check_and_set_first, 2);
        assert_eq!(stats.fail, 1);
        assert_eq!(stats.begin_latency.count(), 3);
        assert_eq!(stats.check_and_set_latency.count(), 0);
    }

    #[test]
    fn one_call_in_eight_is_timed() {
        let timed = (0..8 * LATENCY_SAMPLE_EVERY)
            .filter(|_| start_timer().is_some())
            .count();
        assert_eq!(timed, 8);
    }
}
