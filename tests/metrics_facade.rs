//! The `metrics` feature: `Store::export_metrics` and the sampled latency histograms
//! reach a `metrics` recorder with the right names, labels and values.
//!
//! Runs only with the feature: `cargo test --features metrics --test metrics_facade`.
//! The recorder is a few lines written here (it stores the last value of each
//! counter and gauge and every histogram sample), installed for this thread only with
//! `metrics::with_local_recorder`, so no dependency beyond the facade itself is needed.
//! The mapping from `Stats` to metric values is also unit-tested without the feature
//! (`src/telemetry.rs`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemstore::{Begin, LATENCY_SAMPLE_EVERY, ManualClock, Policy, Store, UnixMs};
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

/// `name{label=value,…}` of a key, labels sorted.
fn render(key: &Key) -> String {
    let mut labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    labels.sort();
    if labels.is_empty() {
        key.name().to_string()
    } else {
        format!("{}{{{}}}", key.name(), labels.join(","))
    }
}

#[derive(Default)]
struct Values {
    counters: BTreeMap<String, u64>,
    gauges: BTreeMap<String, f64>,
    histograms: BTreeMap<String, Vec<f64>>,
}

#[derive(Default, Clone)]
struct TestRecorder {
    values: Arc<Mutex<Values>>,
}

struct Handle {
    key: String,
    values: Arc<Mutex<Values>>,
}

impl CounterFn for Handle {
    fn increment(&self, value: u64) {
        *self
            .values
            .lock()
            .unwrap()
            .counters
            .entry(self.key.clone())
            .or_default() += value;
    }
    fn absolute(&self, value: u64) {
        self.values
            .lock()
            .unwrap()
            .counters
            .insert(self.key.clone(), value);
    }
}

impl GaugeFn for Handle {
    fn increment(&self, value: f64) {
        *self
            .values
            .lock()
            .unwrap()
            .gauges
            .entry(self.key.clone())
            .or_default() += value;
    }
    fn decrement(&self, value: f64) {
        *self
            .values
            .lock()
            .unwrap()
            .gauges
            .entry(self.key.clone())
            .or_default() -= value;
    }
    fn set(&self, value: f64) {
        self.values
            .lock()
            .unwrap()
            .gauges
            .insert(self.key.clone(), value);
    }
}

impl HistogramFn for Handle {
    fn record(&self, value: f64) {
        self.values
            .lock()
            .unwrap()
            .histograms
            .entry(self.key.clone())
            .or_default()
            .push(value);
    }
}

impl TestRecorder {
    fn handle(&self, key: &Key) -> Arc<Handle> {
        Arc::new(Handle {
            key: render(key),
            values: Arc::clone(&self.values),
        })
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.handle(key))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.handle(key))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.handle(key))
    }
}

#[test]
fn export_metrics_reports_counters_gauges_and_sampled_latencies() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(1_700_000_000_000));
    let store = Store::builder(dir.path())
        .clock(clock.clone())
        .open()
        .unwrap();
    let recorder = TestRecorder::default();
    let calls = 8 * LATENCY_SAMPLE_EVERY as usize;
    metrics::with_local_recorder(&recorder, || {
        let orders = store
            .namespace("orders", Policy::ttl(Duration::from_secs(60)))
            .unwrap();
        for i in 0..calls {
            assert!(
                orders
                    .check_and_set(format!("order-{i}"))
                    .unwrap()
                    .is_first()
            );
        }
        for i in 0..3 {
            assert!(
                !orders
                    .check_and_set(format!("order-{i}"))
                    .unwrap()
                    .is_first()
            );
        }
        match orders.begin("payment-1").unwrap() {
            Begin::Acquired(claim) => claim.complete(Some(b"ok")).unwrap(),
            other => panic!("expected Acquired, got {other:?}"),
        }
        assert!(matches!(
            orders.begin("payment-1").unwrap(),
            Begin::Completed(_)
        ));
        // Expire everything; the reaper has not run (expire_now is not called).
        clock.advance(Duration::from_secs(3 * 60));
        store.export_metrics();
    });

    let values = recorder.values.lock().unwrap();
    let counter = |key: &str| {
        *values
            .counters
            .get(key)
            .unwrap_or_else(|| panic!("no counter {key}"))
    };
    let gauge = |key: &str| {
        *values
            .gauges
            .get(key)
            .unwrap_or_else(|| panic!("no gauge {key}"))
    };
    assert_eq!(
        counter("idemstore_check_and_set_total{outcome=first}"),
        calls as u64
    );
    assert_eq!(
        counter("idemstore_check_and_set_total{outcome=duplicate}"),
        3
    );
    assert_eq!(counter("idemstore_begin_total{answer=acquired}"), 1);
    assert_eq!(counter("idemstore_begin_total{answer=completed}"), 1);
    assert_eq!(counter("idemstore_claims_resolved_total{how=complete}"), 1);
    assert_eq!(counter("idemstore_claims_resolved_total{how=fail}"), 0);
    assert_eq!(gauge("idemstore_keys{status=seen}"), calls as f64);
    assert_eq!(gauge("idemstore_keys{status=completed}"), 1.0);
    assert_eq!(gauge("idemstore_namespaces"), 1.0);
    assert!(gauge("idemstore_disk_bytes") > 0.0);
    // Every bucket deadline is at most 2 min after the start; 3 min have passed.
    let lag = gauge("idemstore_expiry_lag_seconds");
    assert!((60.0..=180.0).contains(&lag), "expiry lag {lag} s");
    // The check_and_set calls were made on this thread: exactly one in
    // LATENCY_SAMPLE_EVERY was timed, whatever the sampling phase.
    let samples = &values.histograms["idemstore_check_and_set_seconds"];
    let expected = (calls + 3) / LATENCY_SAMPLE_EVERY as usize;
    assert!(
        samples.len() == expected || samples.len() == expected + 1,
        "{} samples for {} calls",
        samples.len(),
        calls + 3
    );
    assert!(samples.iter().all(|s| *s > 0.0 && *s < 10.0));
    let p99 = gauge("idemstore_check_and_set_latency_seconds{quantile=0.99}");
    assert!(p99 > 0.0 && p99 < 10.0, "p99 {p99}");
    drop(values);
    store.close().unwrap();
}

#[test]
fn export_metrics_reports_replication_shipping_and_its_lag() {
    use idemstore::replication::{Changelog, MemoryChangelog};
    use idemstore::{Replication, ReplicationMode};

    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(MemoryChangelog::new());
    let store = Store::builder(dir.path())
        .replication(
            Replication::new(Arc::clone(&log) as Arc<dyn Changelog>, "idemstore.orders")
                .mode(ReplicationMode::Async),
        )
        .open()
        .unwrap();
    let recorder = TestRecorder::default();
    metrics::with_local_recorder(&recorder, || {
        let orders = store
            .namespace("orders", Policy::ttl(Duration::from_secs(60)))
            .unwrap();
        let p3 = orders.partition(3).unwrap();
        p3.restore_partition().unwrap();
        for i in 0..25 {
            assert!(p3.check_and_set(format!("order-{i}")).unwrap().is_first());
        }
        p3.flush_partition().unwrap();
        store.export_metrics();
    });
    let values = recorder.values.lock().unwrap();
    let counter = |key: &str| values.counters[key];
    let gauge = |key: &str| values.gauges[key];
    assert_eq!(gauge("idemstore_replication_partitions{state=owned}"), 1.0);
    assert_eq!(gauge("idemstore_replication_partitions{state=fenced}"), 0.0);
    assert_eq!(counter("idemstore_replication_shipped_records_total"), 25);
    assert!(counter("idemstore_replication_shipped_messages_total") >= 1);
    assert_eq!(counter("idemstore_replication_restores_total"), 1);
    // Flushed: nothing is queued, so nothing waits.
    assert_eq!(gauge("idemstore_replication_queued_records"), 0.0);
    assert_eq!(gauge("idemstore_replication_lag_seconds"), 0.0);
    drop(values);
    store.close().unwrap();
}
