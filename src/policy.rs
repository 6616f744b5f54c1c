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
}

impl Policy {
    /// Keys are remembered for at least `ttl` (and at most `max(bucket width, ttl / 1024)`
    /// longer, docs/CONTRACT.md §1.3).
    /// The lease defaults to 30 s and attempts are unlimited.
    pub fn ttl(ttl: Duration) -> Policy {
        Policy {
            ttl,
            lease: Duration::from_secs(30),
            max_attempts: u32::MAX,
        }
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
