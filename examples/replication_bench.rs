//! Replication through the store on a real 3-node NATS JetStream cluster (feature
//! `nats`), side by side with the same store work without replication, in one run.
//!
//! ```sh
//! cargo run --release --features nats --example replication_bench -- [--marks 2000000] [--sync 20000] [--restore 1000000] [--handoff 100000]
//! ```
//!
//! 1. `Async` marks/s from 2 threads (one partition each) against the same with no
//!    replication and with unscoped keys, each from a fresh store, then a flush; and
//!    `Async` to the in-process changelog, which separates the store's own cost from
//!    the cluster's three servers sharing this machine's cores; each row with the CPU
//!    time per mark of this process and of the three servers (`/proc/<pid>/stat`);
//! 2. `Sync` single calls from 2 threads: p50/p99 and marks per cluster round trip;
//! 3. `flush_partition` p50/p99 while a writer marks 100,000/s;
//! 4. restore of a partition with `--restore` live marks into an empty store (cold),
//!    and a warm one that has all but the last 10,000;
//! 5. handoff downtime for `--handoff` live marks: `release_partition` on machine A →
//!    `restore_partition` on B → B's first mark answered, cold and warm.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemstore::replication::{Changelog, LocalCluster, MemoryChangelog, NatsConfig};
use idemstore::{Durability, Namespace, Policy, Replication, ReplicationMode, Store};

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

/// CPU seconds (user + system) a process has used so far: `/proc/<pid>/stat`.
fn cpu_seconds(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name (which may hold spaces) in parentheses:
    // utime and stime are the 12th and 13th of them.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // SAFETY: sysconf reads a constant of the system; no memory is shared.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (ticks(11) + ticks(12)) / per_second
}

/// CPU seconds of this process and of the cluster's servers, so far.
fn cpu(cluster: &LocalCluster) -> (f64, f64) {
    let servers = cluster
        .pids()
        .iter()
        .map(|p| cpu_seconds(&p.to_string()))
        .sum();
    (cpu_seconds("self"), servers)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Bench {
    root: tempfile::TempDir,
    log: Arc<dyn Changelog>,
    n: u32,
}

impl Bench {
    fn store(&mut self, mode: Option<ReplicationMode>) -> Store {
        let log = Arc::clone(&self.log);
        self.store_on(mode, log)
    }

    fn store_on(&mut self, mode: Option<ReplicationMode>, log: Arc<dyn Changelog>) -> Store {
        self.n += 1;
        let mut builder = Store::builder(self.root.path().join(format!("s{}", self.n)))
            .durability(Durability::default());
        if let Some(mode) = mode {
            builder = builder.replication(
                Replication::new(log, format!("idemstore.bench.r{}", self.n))
                    .mode(mode)
                    .timeout(Duration::from_secs(30))
                    .buffer_bytes(512 << 20),
            );
        }
        builder.open().unwrap()
    }

    fn store_at(&mut self, name: &str, prefix: &str) -> Store {
        Store::builder(self.root.path().join(name))
            .replication(
                Replication::new(Arc::clone(&self.log), prefix)
                    .timeout(Duration::from_secs(30))
                    .buffer_bytes(512 << 20),
            )
            .open()
            .unwrap()
    }
}

/// CPU seconds the calling thread has used so far (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a pointer to a local that
    // lives for the call.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// One row of section 1: the rate, and the hot path proper: the writer threads'
/// own CPU time per mark and the latency of their calls (every 16th call timed).
struct Marked {
    rate: f64,
    writer_cpu_us: f64,
    p50: Duration,
    p99: Duration,
}

/// Marks `per_thread` fresh keys from 2 threads, each in its own partition (or
/// unscoped).
fn marks_per_second(ns: &Namespace, scoped: bool, per_thread: u64) -> Marked {
    let started = Instant::now();
    let mut writer_cpu = 0.0;
    let mut sampled: Vec<Duration> = Vec::new();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2u32)
            .map(|t| {
                let ns = if scoped {
                    ns.partition(t).unwrap()
                } else {
                    ns.clone()
                };
                if scoped {
                    ns.restore_partition().unwrap();
                }
                s.spawn(move || {
                    let mut own = Vec::with_capacity((per_thread / 16) as usize + 1);
                    let cpu = thread_cpu_seconds();
                    for n in 0..per_thread {
                        let id = format!("order-{t}-{n}");
                        let at = (n % 16 == 0).then(Instant::now);
                        let first = if scoped {
                            ns.check_and_set_at(&id, n).unwrap()
                        } else {
                            ns.check_and_set(&id).unwrap()
                        };
                        if let Some(at) = at {
                            own.push(at.elapsed());
                        }
                        assert!(first.is_first());
                    }
                    (thread_cpu_seconds() - cpu, own)
                })
            })
            .collect();
        for h in handles {
            let (cpu, own) = h.join().unwrap();
            writer_cpu += cpu;
            sampled.extend(own);
        }
    });
    let rate = (2 * per_thread) as f64 / started.elapsed().as_secs_f64();
    sampled.sort();
    Marked {
        rate,
        writer_cpu_us: writer_cpu * 1e6 / (2 * per_thread) as f64,
        p50: percentile(&sampled, 0.5),
        p99: percentile(&sampled, 0.99),
    }
}

fn main() {
    let mut marks: u64 = 2_000_000;
    let mut sync_calls: u64 = 20_000;
    let mut restore: u64 = 1_000_000;
    let mut handoff: u64 = 100_000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{arg} takes a number"))
        };
        match arg.as_str() {
            "--marks" => marks = value(),
            "--sync" => sync_calls = value(),
            "--restore" => restore = value(),
            "--handoff" => handoff = value(),
            other => panic!("unknown argument {other}; see the file's doc comment"),
        }
    }
    let cluster = LocalCluster::start(3).unwrap_or_else(|e| {
        eprintln!("replication_bench: {e}");
        std::process::exit(2)
    });
    let mut config = NatsConfig::new(cluster.urls());
    config.stream = "RBENCH".into();
    config.subject_prefix = "idemstore.bench".into();
    let log: Arc<dyn Changelog> = Arc::new(
        cluster
            .open(&config, Duration::from_secs(30))
            .expect("the cluster comes up"),
    );
    println!("3-node JetStream cluster on loopback (nats-server, R3, file storage)");
    let mut bench = Bench {
        root: tempfile::tempdir().unwrap(),
        log,
        n: 0,
    };

    // 1. Async marks/s, side by side.
    let per_thread = marks / 2;
    let mut rows = Vec::new();
    let memory: Arc<dyn Changelog> = Arc::new(MemoryChangelog::new());
    for (name, mode, scoped, in_process) in [
        ("unscoped, no replication", None, false, false),
        ("partitions, no replication", None, true, false),
        (
            "partitions, Async",
            Some(ReplicationMode::Async),
            true,
            false,
        ),
        (
            "partitions, Async in-process",
            Some(ReplicationMode::Async),
            true,
            true,
        ),
    ] {
        let store = if in_process {
            bench.store_on(mode, Arc::clone(&memory))
        } else {
            bench.store(mode)
        };
        let ns = store.namespace("orders", policy()).unwrap();
        let before = cpu(&cluster);
        let marked = marks_per_second(&ns, scoped, per_thread);
        let flushed = Instant::now();
        if scoped {
            for p in 0..2 {
                ns.partition(p).unwrap().flush_partition().unwrap();
            }
        }
        let flush = flushed.elapsed();
        let after = cpu(&cluster);
        // CPU µs per mark, marking and flushing included: this process (the writers
        // and the shipping threads) and the three servers.
        let per_mark = |s: f64| s * 1e6 / (2 * per_thread) as f64;
        let (own, servers) = (per_mark(after.0 - before.0), per_mark(after.1 - before.1));
        let stats = store.stats().replication;
        println!(
            "{name:<28} {:>10.0} marks/s from 2 threads; hot path: writers' CPU {:.3} us per mark, call p50 {:.0} ns, p99 {:.0} ns; CPU per mark: {own:.2} us in this process, {servers:.2} us in the servers{}",
            marked.rate,
            marked.writer_cpu_us,
            marked.p50.as_nanos(),
            marked.p99.as_nanos(),
            if mode.is_some() {
                format!(
                    "; then flushed in {:.0} ms ({:.0} marks/s sustained, marking and flush); {} marks in {} messages",
                    ms(flush),
                    (2 * per_thread) as f64
                        / ((2 * per_thread) as f64 / marked.rate + flush.as_secs_f64()),
                    stats.shipped_records,
                    stats.shipped_messages
                )
            } else {
                String::new()
            }
        );
        rows.push(marked);
    }
    println!(
        "Async / partitions without replication: throughput {:.2}; / unscoped: {:.2}; Async to the in-process changelog (no cluster on these cores) / partitions without replication: {:.2}",
        rows[2].rate / rows[1].rate,
        rows[2].rate / rows[0].rate,
        rows[3].rate / rows[1].rate
    );
    println!(
        "the hot path, Async / partitions without replication: writers' CPU per mark {:.2} (in-process changelog {:.2}), call p50 {:.2}, p99 {:.2}",
        rows[2].writer_cpu_us / rows[1].writer_cpu_us,
        rows[3].writer_cpu_us / rows[1].writer_cpu_us,
        rows[2].p50.as_secs_f64() / rows[1].p50.as_secs_f64(),
        rows[2].p99.as_secs_f64() / rows[1].p99.as_secs_f64()
    );

    // 2. Sync single calls from 2 threads.
    let store = bench.store(Some(ReplicationMode::Sync));
    let ns = store.namespace("orders", policy()).unwrap();
    let mut latencies: Vec<Duration> = Vec::new();
    let started = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..2u32)
            .map(|t| {
                let p = ns.partition(0).unwrap();
                if t == 0 {
                    p.restore_partition().unwrap();
                }
                s.spawn(move || {
                    let mut own = Vec::with_capacity((sync_calls / 2) as usize);
                    for n in 0..sync_calls / 2 {
                        let at = Instant::now();
                        assert!(
                            p.check_and_set_at(format!("s-{t}-{n}"), n)
                                .unwrap()
                                .is_first()
                        );
                        own.push(at.elapsed());
                    }
                    own
                })
            })
            .collect();
        for h in handles {
            latencies.extend(h.join().unwrap());
        }
    });
    let elapsed = started.elapsed();
    latencies.sort();
    let stats = store.stats().replication;
    println!(
        "Sync, 2 threads, one partition: {:.0} calls/s, p50 {:.2} ms, p99 {:.2} ms; {} marks in {} cluster round trips = {:.2} per round trip",
        sync_calls as f64 / elapsed.as_secs_f64(),
        ms(percentile(&latencies, 0.5)),
        ms(percentile(&latencies, 0.99)),
        stats.shipped_records,
        stats.shipped_messages,
        stats.shipped_records as f64 / stats.shipped_messages.max(1) as f64
    );
    drop((ns, store));

    // 3. flush_partition while a writer marks 100,000/s.
    let store = bench.store(Some(ReplicationMode::Async));
    let p = store
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    p.restore_partition().unwrap();
    let stop = AtomicBool::new(false);
    let mut flushes: Vec<Duration> = Vec::new();
    std::thread::scope(|s| {
        let writer = p.clone();
        let stop = &stop;
        s.spawn(move || {
            let started = Instant::now();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Paced: n marks by n / 100,000 s.
                let due = Duration::from_micros(n * 10);
                if started.elapsed() < due {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                assert!(
                    writer
                        .check_and_set_at(format!("f-{n}"), n)
                        .unwrap()
                        .is_first()
                );
                n += 1;
            }
        });
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            let at = Instant::now();
            p.flush_partition().unwrap();
            flushes.push(at.elapsed());
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
    });
    flushes.sort();
    println!(
        "flush_partition at 100,000 marks/s: {} flushes, p50 {:.2} ms, p99 {:.2} ms",
        flushes.len(),
        ms(percentile(&flushes, 0.5)),
        ms(percentile(&flushes, 0.99))
    );
    drop((p, store));

    // 4. Restores: cold (empty store) and warm (all but the last 10,000).
    let prefix = "idemstore.bench.restore";
    let a = bench.store_at("restore-a", prefix);
    let pa = a
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    pa.restore_partition().unwrap();
    let warm_gap = 10_000.min(restore);
    for n in 0..restore - warm_gap {
        assert!(pa.check_and_set_at(format!("r-{n}"), n).unwrap().is_first());
    }
    pa.release_partition().unwrap();
    let warm = bench.store_at("restore-warm", prefix);
    let pw = warm
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    pw.restore_partition().unwrap();
    pw.release_partition().unwrap();
    pa.restore_partition().unwrap();
    for n in restore - warm_gap..restore {
        assert!(pa.check_and_set_at(format!("r-{n}"), n).unwrap().is_first());
    }
    pa.release_partition().unwrap();
    let cold = bench.store_at("restore-cold", prefix);
    let pc = cold
        .namespace("orders", policy())
        .unwrap()
        .partition(0)
        .unwrap();
    let report = pc.restore_partition().unwrap();
    println!(
        "restore of {} live marks into an empty store: {:.0} ms ({} messages)",
        report.records,
        ms(report.duration),
        report.messages
    );
    let report = pw.restore_partition().unwrap();
    println!(
        "warm restore (all but the last {warm_gap}): {:.1} ms ({} records read)",
        ms(report.duration),
        report.records
    );
    drop((pa, pw, pc, a, warm, cold));

    // 5. Handoff downtime: release on A -> restore on B -> B's first mark.
    for kind in ["cold", "warm"] {
        let prefix = format!("idemstore.bench.handoff{kind}");
        let a = bench.store_at(&format!("handoff-{kind}-a"), &prefix);
        let b = bench.store_at(&format!("handoff-{kind}-b"), &prefix);
        let pa = a
            .namespace("orders", policy())
            .unwrap()
            .partition(0)
            .unwrap();
        let pb = b
            .namespace("orders", policy())
            .unwrap()
            .partition(0)
            .unwrap();
        pa.restore_partition().unwrap();
        let half = if kind == "warm" {
            handoff - 1_000
        } else {
            handoff
        };
        for n in 0..half {
            assert!(pa.check_and_set_at(format!("h-{n}"), n).unwrap().is_first());
        }
        if kind == "warm" {
            // B held the partition before (a warm standby): it has all but the last
            // 1,000 marks.
            pa.release_partition().unwrap();
            pb.restore_partition().unwrap();
            pb.release_partition().unwrap();
            pa.restore_partition().unwrap();
            for n in half..handoff {
                assert!(pa.check_and_set_at(format!("h-{n}"), n).unwrap().is_first());
            }
        }
        let started = Instant::now();
        pa.release_partition().unwrap();
        let report = pb.restore_partition().unwrap();
        assert!(
            pb.check_and_set_at("first-after", handoff)
                .unwrap()
                .is_first()
        );
        let downtime = started.elapsed();
        println!(
            "handoff of {handoff} live marks, {kind}: {:.1} ms from revoke to the first mark on the new owner ({} records restored)",
            ms(downtime),
            report.records
        );
    }
}
