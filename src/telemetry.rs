//! The store's figures as metrics: names, kinds and values derived from [`Stats`],
//! and (feature `metrics`) their export through the `metrics` crate facade, so any
//! `metrics` exporter (Prometheus, StatsD, …) works unchanged.
//!
//! The mapping from `Stats` to metrics is plain code compiled in every build and
//! unit-tested below; only the few lines that hand values to the facade depend on the
//! feature (tested by `tests/metrics_facade.rs`).

use crate::stats::Stats;

/// Whether a metric counts up since open or is a level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MetricKind {
    Counter,
    Gauge,
}

/// One metric and its value now.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct MetricValue {
    pub name: &'static str,
    pub kind: MetricKind,
    /// At most one label: `(name, value)`.
    pub label: Option<(&'static str, &'static str)>,
    pub value: f64,
}

/// Sampled latencies (feature `metrics`), in seconds.
#[cfg(feature = "metrics")]
pub(crate) const CHECK_AND_SET_SECONDS: &str = "idemstore_check_and_set_seconds";
#[cfg(feature = "metrics")]
pub(crate) const BEGIN_SECONDS: &str = "idemstore_begin_seconds";

/// Every metric `Store::export_metrics` reports, from `stats`.
pub(crate) fn metric_values(stats: &Stats) -> Vec<MetricValue> {
    use MetricKind::{Counter, Gauge};
    let metric = |name, kind, label, value: u64| MetricValue {
        name,
        kind,
        label,
        value: value as f64,
    };
    let ops = &stats.operations;
    let mut values = vec![
        metric(
            "idemstore_check_and_set_total",
            Counter,
            Some(("outcome", "first")),
            ops.check_and_set_first,
        ),
        metric(
            "idemstore_check_and_set_total",
            Counter,
            Some(("outcome", "duplicate")),
            ops.check_and_set_duplicate,
        ),
        metric(
            "idemstore_check_and_set_total",
            Counter,
            Some(("outcome", "likely_duplicate")),
            ops.check_and_set_likely_duplicate,
        ),
        metric(
            "idemstore_begin_total",
            Counter,
            Some(("answer", "acquired")),
            ops.begin_acquired,
        ),
        metric(
            "idemstore_begin_total",
            Counter,
            Some(("answer", "in_progress")),
            ops.begin_in_progress,
        ),
        metric(
            "idemstore_begin_total",
            Counter,
            Some(("answer", "completed")),
            ops.begin_completed,
        ),
        metric(
            "idemstore_begin_total",
            Counter,
            Some(("answer", "exhausted")),
            ops.begin_exhausted,
        ),
        metric(
            "idemstore_claims_resolved_total",
            Counter,
            Some(("how", "complete")),
            ops.complete,
        ),
        metric(
            "idemstore_claims_resolved_total",
            Counter,
            Some(("how", "release")),
            ops.release,
        ),
        metric(
            "idemstore_claims_resolved_total",
            Counter,
            Some(("how", "fail")),
            ops.fail,
        ),
        metric("idemstore_removed_total", Counter, None, ops.remove),
        metric(
            "idemstore_expired_buckets_total",
            Counter,
            None,
            stats.expired_buckets,
        ),
        metric(
            "idemstore_expired_keys_total",
            Counter,
            None,
            stats.expired_keys,
        ),
        metric(
            "idemstore_sync_rounds_total",
            Counter,
            None,
            stats.sync_rounds,
        ),
        metric(
            "idemstore_durable_waits_total",
            Counter,
            None,
            stats.durable_waits,
        ),
        metric(
            "idemstore_corrupt_records_skipped_total",
            Counter,
            None,
            stats.corrupt_records_skipped,
        ),
        metric(
            "idemstore_torn_tails_cut_total",
            Counter,
            None,
            stats.torn_tails_cut,
        ),
        metric(
            "idemstore_keys",
            Gauge,
            Some(("status", "seen")),
            stats.seen,
        ),
        metric(
            "idemstore_keys",
            Gauge,
            Some(("status", "in_progress")),
            stats.in_progress,
        ),
        metric(
            "idemstore_keys",
            Gauge,
            Some(("status", "released")),
            stats.released,
        ),
        metric(
            "idemstore_keys",
            Gauge,
            Some(("status", "completed")),
            stats.completed,
        ),
        metric(
            "idemstore_keys",
            Gauge,
            Some(("status", "failed")),
            stats.failed,
        ),
        metric("idemstore_tombstones", Gauge, None, stats.tombstones),
        metric("idemstore_namespaces", Gauge, None, stats.namespaces),
        metric("idemstore_index_bytes", Gauge, None, stats.index_bytes),
        metric("idemstore_disk_bytes", Gauge, None, stats.disk_bytes),
        metric("idemstore_log_bytes", Gauge, None, stats.log_bytes),
        metric("idemstore_segments", Gauge, None, stats.segments),
        metric("idemstore_buckets", Gauge, None, stats.buckets),
    ];
    let repl = &stats.replication;
    values.extend([
        metric(
            "idemstore_replication_partitions",
            Gauge,
            Some(("state", "known")),
            repl.partitions,
        ),
        metric(
            "idemstore_replication_partitions",
            Gauge,
            Some(("state", "owned")),
            repl.owned,
        ),
        metric(
            "idemstore_replication_partitions",
            Gauge,
            Some(("state", "fenced")),
            repl.fenced,
        ),
        metric(
            "idemstore_replication_queued_records",
            Gauge,
            None,
            repl.queued_records,
        ),
        metric(
            "idemstore_replication_queued_bytes",
            Gauge,
            None,
            repl.queued_bytes,
        ),
    ]);
    for (name, value) in [
        (
            "idemstore_replication_shipped_records_total",
            repl.shipped_records,
        ),
        (
            "idemstore_replication_shipped_messages_total",
            repl.shipped_messages,
        ),
        (
            "idemstore_replication_shipped_bytes_total",
            repl.shipped_bytes,
        ),
        ("idemstore_replication_restores_total", repl.restores),
        (
            "idemstore_replication_restored_messages_total",
            repl.restored_messages,
        ),
        (
            "idemstore_replication_restored_records_total",
            repl.restored_records,
        ),
        (
            "idemstore_replication_damaged_messages_total",
            repl.damaged_messages,
        ),
        (
            "idemstore_replication_reshipped_records_total",
            repl.reshipped_records,
        ),
    ] {
        values.push(metric(name, Counter, None, value));
    }
    let cold = &stats.cold;
    values.extend([
        metric("idemstore_cold_generations", Gauge, None, cold.generations),
        metric("idemstore_cold_entries", Gauge, None, cold.entries),
        metric("idemstore_cold_ram_bytes", Gauge, None, cold.ram_bytes),
        metric("idemstore_cold_disk_bytes", Gauge, None, cold.disk_bytes),
        metric("idemstore_cold_spills_total", Counter, None, cold.spills),
        metric("idemstore_cold_merges_total", Counter, None, cold.merges),
        metric(
            "idemstore_cold_spilled_keys_total",
            Counter,
            None,
            cold.spilled_keys,
        ),
        metric(
            "idemstore_cold_reused_at_open",
            Gauge,
            None,
            cold.reused_at_open,
        ),
        metric(
            "idemstore_cold_rebuilt_at_open",
            Gauge,
            None,
            cold.rebuilt_at_open,
        ),
        metric(
            "idemstore_cold_damaged_pages_total",
            Counter,
            None,
            cold.damaged_pages,
        ),
    ]);
    values.push(MetricValue {
        name: "idemstore_replication_lag_seconds",
        kind: Gauge,
        label: None,
        value: repl.lag.as_secs_f64(),
    });
    values.push(MetricValue {
        name: "idemstore_expiry_lag_seconds",
        kind: Gauge,
        label: None,
        value: stats.expiry_lag.as_secs_f64(),
    });
    values.push(MetricValue {
        name: "idemstore_recovery_seconds",
        kind: Gauge,
        label: None,
        value: stats.recovery_time.as_secs_f64(),
    });
    for (name, histogram) in [
        (
            "idemstore_check_and_set_latency_seconds",
            &ops.check_and_set_latency,
        ),
        ("idemstore_begin_latency_seconds", &ops.begin_latency),
    ] {
        for (quantile, value) in [
            ("0.5", histogram.p50()),
            ("0.99", histogram.p99()),
            ("0.999", histogram.p999()),
        ] {
            values.push(MetricValue {
                name,
                kind: Gauge,
                label: Some(("quantile", quantile)),
                value: value.as_secs_f64(),
            });
        }
    }
    values
}

/// Hands every metric of `stats` to the `metrics` facade (`Store::export_metrics`).
#[cfg(feature = "metrics")]
pub(crate) fn export(stats: &Stats) {
    for metric in metric_values(stats) {
        let labels: Vec<metrics::Label> = metric
            .label
            .map(|(key, value)| metrics::Label::from_static_parts(key, value))
            .into_iter()
            .collect();
        match metric.kind {
            MetricKind::Counter => {
                metrics::counter!(metric.name, labels).absolute(metric.value as u64);
            }
            MetricKind::Gauge => metrics::gauge!(metric.name, labels).set(metric.value),
        }
    }
}

/// Hands one sampled latency to the facade's histogram.
#[cfg(feature = "metrics")]
pub(crate) fn record_latency(timed: crate::operations::Timed, elapsed: std::time::Duration) {
    let name = match timed {
        crate::operations::Timed::CheckAndSet => CHECK_AND_SET_SECONDS,
        crate::operations::Timed::Begin => BEGIN_SECONDS,
    };
    metrics::histogram!(name).record(elapsed.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn every_figure_of_stats_maps_to_one_metric_with_its_value() {
        let mut stats = Stats {
            seen: 3,
            completed: 5,
            disk_bytes: 4096,
            expiry_lag: Duration::from_millis(1500),
            ..Stats::default()
        };
        stats.operations.check_and_set_first = 7;
        stats.operations.begin_exhausted = 2;
        stats.replication.owned = 4;
        stats.replication.queued_records = 11;
        stats.replication.shipped_records = 900;
        stats.replication.lag = Duration::from_millis(250);
        stats.cold.ram_bytes = 1_300;
        stats.cold.spilled_keys = 1_000;
        let values = metric_values(&stats);
        let value = |name: &str, label: Option<(&str, &str)>| {
            let found: Vec<_> = values
                .iter()
                .filter(|m| m.name == name && m.label == label)
                .collect();
            assert_eq!(
                found.len(),
                1,
                "{name} {label:?} appears {} times",
                found.len()
            );
            found[0].value
        };
        assert_eq!(
            value("idemstore_check_and_set_total", Some(("outcome", "first"))),
            7.0
        );
        assert_eq!(
            value("idemstore_begin_total", Some(("answer", "exhausted"))),
            2.0
        );
        assert_eq!(value("idemstore_keys", Some(("status", "seen"))), 3.0);
        assert_eq!(value("idemstore_keys", Some(("status", "completed"))), 5.0);
        assert_eq!(value("idemstore_disk_bytes", None), 4096.0);
        assert_eq!(value("idemstore_expiry_lag_seconds", None), 1.5);
        assert_eq!(
            value("idemstore_replication_partitions", Some(("state", "owned"))),
            4.0
        );
        assert_eq!(value("idemstore_replication_queued_records", None), 11.0);
        assert_eq!(
            value("idemstore_replication_shipped_records_total", None),
            900.0
        );
        assert_eq!(value("idemstore_replication_lag_seconds", None), 0.25);
        assert_eq!(value("idemstore_cold_ram_bytes", None), 1_300.0);
        assert_eq!(value("idemstore_cold_spilled_keys_total", None), 1_000.0);
        assert_eq!(
            value(
                "idemstore_check_and_set_latency_seconds",
                Some(("quantile", "0.99"))
            ),
            0.0
        );
        for metric in &values {
            assert!(metric.name.starts_with("idemstore_"));
            assert_eq!(
                metric.kind == MetricKind::Counter,
                metric.name.ends_with("_total"),
                "{} is a counter exactly when it ends in _total",
                metric.name
            );
        }
    }
}
