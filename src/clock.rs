//! Time, only through the [`Clock`] trait, so expiry is testable without sleeping.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: the one unit of wall time in idemstore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct UnixMs(pub u64);

impl UnixMs {
    /// This instant as a `SystemTime`.
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }

    /// `self + d`, saturating.
    pub fn saturating_add(self, d: Duration) -> UnixMs {
        UnixMs(self.0.saturating_add(duration_ms_ceil(d)))
    }
}

impl fmt::Display for UnixMs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// A duration in whole milliseconds, rounded up (retention is never shortened).
pub(crate) fn duration_ms_ceil(d: Duration) -> u64 {
    let ms = d.as_millis();
    let ceil = if d.as_nanos().is_multiple_of(1_000_000) {
        ms
    } else {
        ms + 1
    };
    u64::try_from(ceil).unwrap_or(u64::MAX)
}

/// Where the store reads wall time from.
///
/// The store never lets its own view of time move backwards: it keeps the largest
/// value it has read, so a clock that jumps back never makes a key expire early.
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> UnixMs;
}

/// The system's wall clock (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[inline]
    fn now(&self) -> UnixMs {
        // One vDSO call and integer arithmetic: this runs on every operation, and
        // `SystemTime::duration_since` adds checked conversions around the same call.
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec for the duration of the call.
        if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) } == 0
            && let (Ok(secs), Ok(nanos)) = (u64::try_from(ts.tv_sec), u64::try_from(ts.tv_nsec))
        {
            return UnixMs(secs.saturating_mul(1000).saturating_add(nanos / 1_000_000));
        }
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        UnixMs(u64::try_from(since_epoch.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to; clones share the same time.
///
/// ```
/// use idemstore::{ManualClock, Clock, UnixMs};
/// use std::time::Duration;
/// let clock = ManualClock::new(UnixMs(1_000));
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(clock.now(), UnixMs(3_000));
/// ```
#[derive(Debug, Clone)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock showing `start`.
    pub fn new(start: UnixMs) -> ManualClock {
        ManualClock {
            now_ms: Arc::new(AtomicU64::new(start.0)),
        }
    }

    /// Move the clock forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now_ms.fetch_add(duration_ms_ceil(d), Ordering::SeqCst);
    }

    /// Set the clock to any time, including one in the past.
    pub fn set(&self, t: UnixMs) {
        self.now_ms.store(t.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> UnixMs {
        UnixMs(self.now_ms.load(Ordering::SeqCst))
    }
}

/// The store's view of time: the clock, never moving backwards.
pub(crate) struct MonotonicTime {
    clock: Arc<dyn Clock>,
    high_water_ms: AtomicU64,
}

impl MonotonicTime {
    pub(crate) fn new(clock: Arc<dyn Clock>, floor: UnixMs) -> MonotonicTime {
        MonotonicTime {
            clock,
            high_water_ms: AtomicU64::new(floor.0),
        }
    }

    pub(crate) fn now(&self) -> UnixMs {
        let read = self.clock.now().0;
        // A plain load first: the read-modify-write only when time moved, so threads
        // do not bounce this cache line on every operation.
        let current = self.high_water_ms.load(Ordering::Acquire);
        if read <= current {
            return UnixMs(current);
        }
        let previous = self.high_water_ms.fetch_max(read, Ordering::AcqRel);
        UnixMs(previous.max(read))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_up_to_whole_milliseconds() {
        assert_eq!(duration_ms_ceil(Duration::from_micros(1)), 1);
        assert_eq!(duration_ms_ceil(Duration::from_millis(7)), 7);
        assert_eq!(duration_ms_ceil(Duration::from_nanos(7_000_001)), 8);
    }

    #[test]
    fn the_system_clock_reads_the_same_time_as_system_time() {
        let ms = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        for _ in 0..100 {
            let before = ms(SystemTime::now());
            let read = SystemClock.now().0;
            let after = ms(SystemTime::now());
            assert!(
                before <= read && read <= after,
                "SystemClock read {read}, between {before} and {after}"
            );
        }
    }

    #[test]
    fn monotonic_time_ignores_a_clock_moving_backwards() {
        let clock = ManualClock::new(UnixMs(10_000));
        let time = MonotonicTime::new(Arc::new(clock.clone()), UnixMs(0));
        assert_eq!(time.now(), UnixMs(10_000));
        clock.set(UnixMs(5_000));
        assert_eq!(time.now(), UnixMs(10_000));
        clock.set(UnixMs(12_000));
        assert_eq!(time.now(), UnixMs(12_000));
    }
}
