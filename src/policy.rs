//! [`Policy`]: a namespace's defaults.

use std::time::Duration;

use crate::clock::duration_ms_ceil;

/// A namespace's defaults: how long keys are remembered, how long a claim's lease
/// lasts, and how many acquisitions a key gets before it is exhausted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub(crate) ttl: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_attempts: u32,
    /// The false-duplicate rate of an approximate namespace (`f64` bits), if it is one.
    pub(crate) approximate: Option<u64>,
}

/// The lowest false-duplicate rate approximate mode meets: a fresh key probes at most
/// 16 cold generations (`GENERATIONS_LIMIT`), each trusted filter with 16-bit
/// fingerprints (a false positive 2^-16 of the time), so at most 16 × 2^-16.
pub const APPROXIMATE_RATE_MIN: f64 = 16.0 / 65536.0;

impl Policy {
    /// Keys are remembered for at least `ttl` (and at most `max(bucket width, ttl / 1024)`
    /// longer, docs/CONTRACT.md §1.3).
    /// The lease defaults to 30 s and attempts are unlimited.
    pub fn ttl(ttl: Duration) -> Policy {
        Policy {
            ttl,
            lease: Duration::from_secs(30),
            max_attempts: u32::MAX,
            approximate: None,
        }
    }

    /// Approximate mode (never the default): once a key of this namespace moves to the
    /// cold tier (`StoreBuilder::memory_budget`), `check_and_set` answers from RAM
    /// alone, by a filter with 16-bit fingerprints, without reading the page and the
    /// record an exact lookup reads: [`Outcome::LikelyDuplicate`](crate::Outcome::LikelyDuplicate).
    /// A fresh key is taken for a duplicate (and its message dropped) at most at
    /// `false_duplicate_rate`, which must be at least [`APPROXIMATE_RATE_MIN`]
    /// (16 × 2^-16 ≈ 2.4e-4) and below 1. Keys in RAM still answer exactly; `get`,
    /// `scan` and `export` stay exact; claims (`begin`) and `remove` are refused, since
    /// a filter cannot forget a key. A trusted filter costs about 2.3 bytes a key in RAM
    /// (the exact tier's filter costs 1.1, about 1.3 with its fences and dead bits,
    /// plus a page read on a hit).
    pub fn approximate(self, false_duplicate_rate: f64) -> Policy {
        Policy {
            approximate: Some(false_duplicate_rate.to_bits()),
            ..self
        }
    }

    /// The false-duplicate rate of an approximate namespace; `None` for an exact one.
    pub fn false_duplicate_rate(&self) -> Option<f64> {
        self.approximate.map(f64::from_bits)
    }

    /// How long an acquired claim is held before another worker may take the key.
    pub fn lease(self, lease: Duration) -> Policy {
        Policy { lease, ..self }
    }

    /// After this many acquisitions that did not complete, `begin` answers
    /// [`Begin::Exhausted`](crate::Begin::Exhausted) (the dead-letter signal). At least 1.
    pub fn max_attempts(self, max_attempts: u32) -> Policy {
        Policy {
            max_attempts,
            ..self
        }
    }

    /// The ttl: how long a key is remembered at least. Its bucket deadline may be
    /// up to `max(bucket width, ttl / 1024)` later (docs/CONTRACT.md), so the
    /// retention a key actually gets is this plus that rounding.
    pub fn retention(&self) -> Duration {
        self.ttl
    }

    pub(crate) fn ttl_ms(&self) -> u64 {
        duration_ms_ceil(self.ttl)
    }

    pub(crate) fn lease_ms(&self) -> u64 {
        duration_ms_ceil(self.lease)
    }
}
