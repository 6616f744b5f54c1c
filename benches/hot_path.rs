#![expect(
    missing_docs,
    reason = "criterion_group! generates an undocumented public function"
)]
//! Criterion benches of idemstore's hot path, each next to the in-memory ceiling.
//!
//! Names carry their scale. Run: `cargo bench --bench hot_path`.
//! The side-by-side comparison with Redis and sled is `examples/bench.rs`.

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use idemstore::{Begin, Durability, Namespace, Policy, Store};

const TTL: Duration = Duration::from_secs(3600);

fn key(n: u64) -> [u8; 22] {
    let mut out = *b"order-0000000000000000";
    let mut rest = n;
    for digit in out[6..].iter_mut().rev() {
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    out
}

fn open(durability: Durability) -> (tempfile::TempDir, Store, Namespace) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(durability)
        .open()
        .unwrap();
    let ns = store.namespace("bench", Policy::ttl(TTL)).unwrap();
    (dir, store, ns)
}

/// Runs `iters` operations split over `threads` threads; returns the wall time.
fn parallel(threads: u64, iters: u64, next: &AtomicU64, op: impl Fn(u64) + Sync) -> Duration {
    let start = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for _ in 0..iters / threads {
                    op(next.fetch_add(1, Ordering::Relaxed));
                }
            });
        }
    });
    start.elapsed()
}

fn check_and_set(c: &mut Criterion) {
    let mut group = c.benchmark_group("check_and_set");
    group.throughput(Throughput::Elements(1));
    for threads in [1u64, 2] {
        let (_dir, _store, ns) = open(Durability::default());
        let next = AtomicU64::new(0);
        group.bench_function(
            BenchmarkId::new("fresh, interval", format!("{threads} threads")),
            |b| {
                b.iter_custom(|iters| {
                    parallel(threads, iters, &next, |n| {
                        assert!(ns.check_and_set(key(n)).unwrap().is_first());
                    })
                })
            },
        );
    }
    for threads in [1u64, 2] {
        let (_dir, _store, ns) = open(Durability::default());
        const KEYS: u64 = 100_000;
        for n in 0..KEYS {
            let _ = ns.check_and_set(key(n)).unwrap();
        }
        let next = AtomicU64::new(0);
        group.bench_function(
            BenchmarkId::new(
                "duplicate, interval, 100k keys",
                format!("{threads} threads"),
            ),
            |b| {
                b.iter_custom(|iters| {
                    parallel(threads, iters, &next, |n| {
                        assert!(!ns.check_and_set(key(n % KEYS)).unwrap().is_first());
                    })
                })
            },
        );
    }
    {
        // What the Interval mode's background syncs cost the writers.
        let (_dir, _store, ns) = open(Durability::None);
        let next = AtomicU64::new(0);
        group.bench_function(BenchmarkId::new("fresh, no sync", "2 threads"), |b| {
            b.iter_custom(|iters| {
                parallel(2, iters, &next, |n| {
                    assert!(ns.check_and_set(key(n)).unwrap().is_first());
                })
            })
        });
    }
    {
        let (_dir, _store, ns) = open(Durability::Immediate);
        let next = AtomicU64::new(0);
        group.sample_size(10);
        group.bench_function(BenchmarkId::new("fresh, immediate", "2 threads"), |b| {
            b.iter_custom(|iters| {
                parallel(2, iters.max(2), &next, |n| {
                    assert!(ns.check_and_set(key(n)).unwrap().is_first());
                })
            })
        });
    }
    group.finish();
}

fn batches(c: &mut Criterion) {
    let mut group = c.benchmark_group("check_and_set_many");
    group.throughput(Throughput::Elements(1000));
    group.sample_size(10);
    for (name, durability) in [
        ("interval", Durability::default()),
        ("immediate", Durability::Immediate),
    ] {
        let (_dir, _store, ns) = open(durability);
        let mut next = 0u64;
        group.bench_function(BenchmarkId::new("batch of 1000 fresh", name), |b| {
            b.iter(|| {
                let ids: Vec<[u8; 22]> = (next..next + 1000).map(key).collect();
                next += 1000;
                black_box(ns.check_and_set_many(&ids).unwrap())
            })
        });
    }
    group.finish();
}

fn claims(c: &mut Criterion) {
    let mut group = c.benchmark_group("claim");
    group.throughput(Throughput::Elements(1));
    let (_dir, _store, ns) = open(Durability::default());
    let mut next = 0u64;
    group.bench_function("begin + complete, interval, 1 thread", |b| {
        b.iter(|| {
            next += 1;
            match ns.begin(key(next)).unwrap() {
                Begin::Acquired(claim) => claim.complete(Some(b"ok")).unwrap(),
                other => panic!("expected Acquired, got {other:?}"),
            }
        })
    });
    group.finish();
}

fn ceiling(c: &mut Criterion) {
    let mut group = c.benchmark_group("ceiling");
    group.throughput(Throughput::Elements(1));
    let mut set = hashbrown::HashSet::<[u8; 22]>::new();
    let mut next = 0u64;
    group.bench_function("hashbrown insert-if-absent, 1 thread", |b| {
        b.iter(|| {
            next += 1;
            black_box(set.insert(key(next)))
        })
    });
    let shared = Arc::new(parking_lot::Mutex::new(
        hashbrown::HashSet::<[u8; 22]>::new(),
    ));
    let counter = AtomicU64::new(0);
    group.bench_function(
        "hashbrown insert-if-absent behind one mutex, 2 threads",
        |b| {
            b.iter_custom(|iters| {
                parallel(2, iters, &counter, |n| {
                    assert!(shared.lock().insert(key(n)))
                })
            })
        },
    );
    group.finish();
}

fn recovery(c: &mut Criterion) {
    let mut group = c.benchmark_group("open");
    group.sample_size(10);
    const KEYS: u64 = 1_000_000;
    let dir = tempfile::tempdir().unwrap();
    {
        let store = Store::builder(dir.path())
            .durability(Durability::None)
            .open()
            .unwrap();
        let ns = store.namespace("bench", Policy::ttl(TTL)).unwrap();
        for n in 0..KEYS {
            let _ = ns.check_and_set(key(n)).unwrap();
        }
        store.close().unwrap();
    }
    group.throughput(Throughput::Elements(KEYS));
    // A clean close writes an index checkpoint and the next open loads (and removes)
    // it; removing it first makes the open replay every record.
    let checkpoint = dir.path().join("CHECKPOINT");
    // Only the open is timed; each close writes the checkpoint again.
    let timed_open = |iters: u64, replay: bool| {
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            if replay {
                let _ = std::fs::remove_file(&checkpoint);
            }
            let start = Instant::now();
            let store = Store::open(dir.path()).unwrap();
            total += start.elapsed();
            assert_eq!(store.stats().live_keys, KEYS);
            store.close().unwrap();
        }
        total
    };
    group.bench_function("open of 1M keys from a checkpoint", |b| {
        b.iter_custom(|iters| timed_open(iters, false))
    });
    group.bench_function("open (replay) of 1M keys", |b| {
        b.iter_custom(|iters| timed_open(iters, true))
    });
    group.finish();
}

criterion_group!(benches, check_and_set, batches, claims, ceiling, recovery);
criterion_main!(benches);
