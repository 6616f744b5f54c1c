//! Bucket deadlines: until when a record is remembered. Pure arithmetic.
//!
//! A record that must be remembered until `until_ms` goes to the bucket whose
//! deadline is `until_ms` rounded up to a step: the bucket width, or for long spans
//! the largest multiple of it that is at most `span / 1024` (the span counted from
//! the write). A key is then remembered at least as long as asked and at most
//! `max(bucket_width, span / 1024)` longer, and records written with one span over
//! any stretch of time fall into at most ~2,048 buckets per span: a 400-day ttl with
//! 1-minute buckets fills a bucket every 9.4 hours, not every minute.
//! (docs/CONTRACT.md, "Retention".)

use crate::clock::UnixMs;

/// How many rounding steps a span holds at least, once it is long enough to round
/// by more than one bucket width.
pub(crate) const STEPS_PER_SPAN: u64 = 1024;

/// The step a deadline `span_ms` from now is rounded up to.
#[inline]
pub(crate) fn rounding_ms(bucket_width_ms: u64, span_ms: u64) -> u64 {
    debug_assert!(bucket_width_ms > 0);
    // Spans under two steps of the widest kind keep the width (no division on the
    // hot path for the usual ttls).
    let steps_of_width = STEPS_PER_SPAN.saturating_mul(bucket_width_ms);
    if span_ms < steps_of_width.saturating_mul(2) {
        return bucket_width_ms;
    }
    bucket_width_ms * (span_ms / steps_of_width)
}

/// The bucket deadline of a record written at `now` that must be remembered until
/// at least `until`.
#[inline]
pub(crate) fn bucket_deadline(bucket_width_ms: u64, now: UnixMs, until: UnixMs) -> UnixMs {
    let rounding = rounding_ms(bucket_width_ms, until.0.saturating_sub(now.0));
    let deadline = until.0.div_ceil(rounding).saturating_mul(rounding);
    #[cfg(feature = "planted-bugs")]
    if crate::planted::planted("early-expiry") {
        return UnixMs(deadline - rounding);
    }
    UnixMs(deadline)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: u64 = 60_000;
    const DAY: u64 = 24 * 3600 * 1000;

    #[test]
    fn short_spans_round_to_the_bucket_width() {
        let now = UnixMs(1_700_000_000_123);
        let until = UnixMs(now.0 + 3600 * 1000);
        let deadline = bucket_deadline(MINUTE, now, until);
        assert_eq!(deadline.0 % MINUTE, 0);
        assert!(deadline >= until && deadline.0 - until.0 < MINUTE);
        // An exact boundary is not pushed a width later.
        assert_eq!(
            bucket_deadline(MINUTE, now, UnixMs(60 * MINUTE)).0,
            60 * MINUTE
        );
    }

    #[test]
    fn long_spans_are_at_most_a_1024th_late_and_on_width_boundaries() {
        for span in [2 * DAY, 30 * DAY, 400 * DAY, 36_600 * DAY] {
            let step = rounding_ms(MINUTE, span);
            assert_eq!(step % MINUTE, 0);
            assert!(step <= MINUTE.max(span / STEPS_PER_SPAN), "span {span}");
            // At most 2,048 steps per span: the bound on live buckets.
            assert!(span / step <= 2 * STEPS_PER_SPAN, "span {span}");
            let now = UnixMs(1_700_000_000_123);
            let until = UnixMs(now.0 + span);
            let deadline = bucket_deadline(MINUTE, now, until);
            assert!(deadline >= until && deadline.0 - until.0 < step);
        }
        // 48 h: 168.75 s / 1 min rounds down to 2 min.
        assert_eq!(rounding_ms(MINUTE, 2 * DAY), 2 * MINUTE);
    }

    #[test]
    fn with_one_span_deadlines_never_decrease_as_time_passes() {
        let mut last = UnixMs(0);
        for i in 0..5_000u64 {
            let now = UnixMs(1_700_000_000_000 + i * 997);
            let deadline = bucket_deadline(MINUTE, now, UnixMs(now.0 + 2 * DAY));
            assert!(deadline >= last);
            last = deadline;
        }
    }
}
