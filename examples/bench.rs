//! `cargo run --release --example bench` — idemstore side by side with its peers, in one
//! run on one machine: the bare hashbrown ceiling, sled `compare_and_swap`, and Redis
//! `SET NX EX` through `redis-benchmark` (when `redis-server` is installed; it starts its
//! own on a loopback port and stops it).
//!
//! Prints ops/s, latency percentiles, memory per key (RSS delta), disk per key and open
//! time. `--keys N` (default 1,000,000), `--threads N` (default 2), `--json`.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use idemstore::{Durability, Policy, Store};

const TTL: Duration = Duration::from_secs(3600);

struct Args {
    keys: u64,
    threads: u64,
    json: bool,
    /// Only idemstore and the in-memory ceiling (for sweeps over sizes and threads).
    skip_peers: bool,
}

fn parse_args() -> Args {
    let mut args = Args {
        keys: 1_000_000,
        threads: 2,
        json: false,
        skip_peers: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--keys" => args.keys = it.next().and_then(|v| v.parse().ok()).expect("--keys N"),
            "--threads" => {
                args.threads = it.next().and_then(|v| v.parse().ok()).expect("--threads N")
            }
            "--json" => args.json = true,
            "--skip-peers" => args.skip_peers = true,
            "--bench" => {} // passed by `cargo bench`-style runners
            other => {
                panic!("unknown argument {other}; use --keys N, --threads N, --json, --skip-peers")
            }
        }
    }
    args
}

/// A 16-byte message id, unique per `n`.
fn key(n: u64) -> [u8; 16] {
    let mut out = *b"msg-000000000000";
    let mut rest = n;
    for digit in out[4..].iter_mut().rev() {
        *digit = b'0' + (rest % 10) as u8;
        rest /= 10;
    }
    out
}

/// The wall clock in Unix milliseconds.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Resident memory of this process in bytes: (anonymous, file-backed).
fn rss() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("RssAnon:"), field("RssFile:") + field("RssShmem:"))
}

fn dir_bytes(path: &std::path::Path) -> u64 {
    let mut total = 0;
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.flatten() {
            let meta = entry.metadata().unwrap();
            if meta.is_dir() {
                total += dir_bytes(&entry.path());
            } else {
                use std::os::unix::fs::MetadataExt;
                total += meta.blocks() * 512;
            }
        }
    }
    total
}

#[derive(Default, Clone)]
struct Row {
    ops_per_s: f64,
    p50_ns: u64,
    p99_ns: u64,
    p999_ns: u64,
    note: String,
}

/// Runs `op(n)` for n in 0..count over `threads` threads; sampled latencies.
fn run(threads: u64, count: u64, op: impl Fn(u64) + Sync) -> Row {
    let barrier = Barrier::new(threads as usize);
    let start = Instant::now();
    let mut samples: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (op, barrier) = (&op, &barrier);
                s.spawn(move || {
                    let mut samples = Vec::with_capacity((count / threads / 64 + 1) as usize);
                    barrier.wait();
                    let mut n = t;
                    while n < count {
                        if n % 64 == t % 64 {
                            let at = Instant::now();
                            op(n);
                            samples.push(at.elapsed().as_nanos() as u64);
                        } else {
                            op(n);
                        }
                        n += threads;
                    }
                    samples
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let elapsed = start.elapsed();
    samples.sort_unstable();
    let pct = |p: f64| {
        samples
            .get(((samples.len() as f64 * p) as usize).min(samples.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Row {
        ops_per_s: count as f64 / elapsed.as_secs_f64(),
        p50_ns: pct(0.50),
        p99_ns: pct(0.99),
        p999_ns: pct(0.999),
        note: String::new(),
    }
}

fn progress(step: &str) {
    eprint!("\r\x1b[2K[bench] {step}…");
    let _ = std::io::stderr().flush();
}

fn main() {
    let args = parse_args();
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    let mut facts: BTreeMap<String, String> = BTreeMap::new();
    let n = args.keys;
    let t = args.threads;

    // The in-memory ceiling: one hashbrown set, insert-if-absent, one thread.
    progress("hashbrown ceiling");
    {
        let mut set = hashbrown::HashSet::<[u8; 16]>::with_capacity(0);
        let start = Instant::now();
        for i in 0..n {
            assert!(set.insert(key(i)));
        }
        let insert = n as f64 / start.elapsed().as_secs_f64();
        let start = Instant::now();
        for i in 0..n {
            assert!(set.contains(&key(i)));
        }
        let lookup = n as f64 / start.elapsed().as_secs_f64();
        rows.insert(
            "ceiling: hashbrown insert-if-absent (1 thread)".into(),
            Row {
                ops_per_s: insert,
                ..Row::default()
            },
        );
        rows.insert(
            "ceiling: hashbrown lookup (1 thread)".into(),
            Row {
                ops_per_s: lookup,
                ..Row::default()
            },
        );
    }

    // idemstore, Interval mode (the default).
    progress("idemstore check_and_set, interval");
    let dir = tempfile::tempdir().unwrap();
    {
        let (anon_before, file_before) = rss();
        let store = Store::builder(dir.path()).open().unwrap();
        let ns = store.namespace("bench", Policy::ttl(TTL)).unwrap();
        let fresh = run(t, n, |i| {
            assert!(ns.check_and_set(key(i)).unwrap().is_first())
        });
        rows.insert(
            format!("idemstore check_and_set fresh, interval ({t} threads, {n} keys)"),
            fresh,
        );
        let (anon_after, file_after) = rss();
        progress("idemstore duplicates");
        let dup = run(t, n, |i| {
            assert!(!ns.check_and_set(key(i)).unwrap().is_first())
        });
        rows.insert(
            format!("idemstore check_and_set duplicate, interval ({t} threads)"),
            dup,
        );
        let stats = store.stats();
        facts.insert(
            "memory per key, anonymous RSS delta (bytes)".into(),
            format!(
                "{:.1}",
                (anon_after.saturating_sub(anon_before)) as f64 / n as f64
            ),
        );
        facts.insert(
            "memory per key, file-backed RSS delta: mapped log pages (bytes)".into(),
            format!(
                "{:.1}",
                (file_after.saturating_sub(file_before)) as f64 / n as f64
            ),
        );
        facts.insert(
            "index bytes per key (table allocation)".into(),
            format!("{:.1}", stats.index_bytes as f64 / n as f64),
        );
        facts.insert(
            "log bytes per key (16-byte ids)".into(),
            format!("{:.1}", stats.log_bytes as f64 / n as f64),
        );
        store.close().unwrap();
        facts.insert(
            "disk bytes per key after close (du)".into(),
            format!("{:.1}", dir_bytes(dir.path()) as f64 / n as f64),
        );
        // A clean close leaves an index checkpoint: the first open loads it. Then the
        // checkpoint is removed and the store opened again, replaying every record.
        progress("idemstore open (checkpoint)");
        let checkpoint = dir.path().join("CHECKPOINT");
        if checkpoint.exists() {
            let start = Instant::now();
            let store = Store::open(dir.path()).unwrap();
            let open = start.elapsed();
            assert_eq!(store.stats().live_keys, n);
            facts.insert(
                format!("open of {n} keys from the checkpoint of a clean close (ms)"),
                format!("{}", open.as_millis()),
            );
            store.close().unwrap();
            std::fs::remove_file(&checkpoint).unwrap();
        } else {
            facts.insert(
                format!("open of {n} keys from the checkpoint of a clean close (ms)"),
                "no checkpoint was written".into(),
            );
        }
        progress("idemstore open (replay)");
        let start = Instant::now();
        let store = Store::open(dir.path()).unwrap();
        let open = start.elapsed();
        assert_eq!(store.stats().live_keys, n);
        facts.insert(
            format!("open (replay) of {n} keys (ms)"),
            format!("{}", open.as_millis()),
        );
        facts.insert(
            "replay rate (records/s)".into(),
            format!("{:.0}", n as f64 / open.as_secs_f64()),
        );
        store.close().unwrap();
    }

    // Expiry: how soon after its bucket's deadline the space of an expired bucket is
    // returned (1-second buckets and ttl, so the run stays short).
    progress("idemstore expiry");
    {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::builder(dir.path())
            .bucket_width(Duration::from_secs(1))
            .open()
            .unwrap();
        let ns = store
            .namespace("expiring", Policy::ttl(Duration::from_secs(1)))
            .unwrap();
        let count = n.min(100_000);
        for i in 0..count {
            assert!(ns.check_and_set(key(i)).unwrap().is_first());
        }
        let written_ms = unix_ms();
        let disk_before = store.stats().disk_bytes;
        // The last key's bucket: its deadline is its expiry rounded up to a width.
        let deadline_ms = (written_ms + 1_000).div_ceil(1_000) * 1_000;
        let returned_ms = loop {
            let stats = store.stats();
            if stats.segments == 0 && stats.live_keys == 0 {
                break unix_ms();
            }
            assert!(
                unix_ms() < deadline_ms + 10_000,
                "expired buckets were not deleted within 10 s of their deadline"
            );
            std::thread::sleep(Duration::from_millis(2));
        };
        facts.insert(
            "expired bucket's space returned after its deadline (ms; 1 s buckets)".into(),
            format!(
                "{} ({} bytes freed)",
                returned_ms.saturating_sub(deadline_ms),
                disk_before
            ),
        );
        store.close().unwrap();
    }

    // idemstore without syncs (`Durability::None`): what the `Interval` mode's
    // background fdatasync costs the writers (on a VM, its TLB-shootdown IPIs).
    progress("idemstore check_and_set, no sync");
    {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::builder(dir.path())
            .durability(Durability::None)
            .open()
            .unwrap();
        let ns = store.namespace("bench", Policy::ttl(TTL)).unwrap();
        let fresh = run(t, n, |i| {
            assert!(ns.check_and_set(key(i)).unwrap().is_first())
        });
        rows.insert(
            format!("idemstore check_and_set fresh, no sync ({t} threads, {n} keys)"),
            fresh,
        );
        store.close().unwrap();

        // The same with one store per thread: nothing shared at all. The gap to the
        // row above is what threads sharing one store's shards cost.
        let dirs: Vec<_> = (0..t).map(|_| tempfile::tempdir().unwrap()).collect();
        let stores: Vec<Store> = dirs
            .iter()
            .map(|dir| {
                Store::builder(dir.path())
                    .durability(Durability::None)
                    .open()
                    .unwrap()
            })
            .collect();
        let namespaces: Vec<_> = stores
            .iter()
            .map(|store| store.namespace("bench", Policy::ttl(TTL)).unwrap())
            .collect();
        // `run` hands thread k the ids k, k + t, k + 2t, ...: id % t is the thread.
        let fresh = run(t, n, |i| {
            assert!(
                namespaces[(i % t) as usize]
                    .check_and_set(key(i))
                    .unwrap()
                    .is_first()
            )
        });
        rows.insert(
            format!(
                "idemstore check_and_set fresh, no sync, one store per thread ({t} threads, {n} keys)"
            ),
            fresh,
        );
        for store in &stores {
            store.close().unwrap();
        }
    }

    // idemstore, Immediate mode.
    progress("idemstore immediate");
    {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::builder(dir.path())
            .durability(Durability::Immediate)
            .open()
            .unwrap();
        let ns = store.namespace("bench", Policy::ttl(TTL)).unwrap();
        // Batches of 1,000 fresh ids, from one thread and then from `t` threads (their
        // batches share fsyncs through group commit).
        let batches = (n / 1000).clamp(1, 200);
        for (run, threads) in [1, t].into_iter().enumerate() {
            let base = (run as u64 + 1) * 20_000_000;
            let next = std::sync::atomic::AtomicU64::new(0);
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(|| {
                        loop {
                            let b = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            if b >= batches {
                                break;
                            }
                            let ids: Vec<[u8; 16]> =
                                (base + b * 1000..base + (b + 1) * 1000).map(key).collect();
                            let outcomes = ns.check_and_set_many(&ids).unwrap();
                            assert!(outcomes.iter().all(|o| o.is_first()));
                        }
                    });
                }
            });
            let rate = (batches * 1000) as f64 / start.elapsed().as_secs_f64();
            rows.insert(
                format!(
                    "idemstore check_and_set_many, immediate, batches of 1000 ({threads} thread{})",
                    if threads == 1 { "" } else { "s" }
                ),
                Row {
                    ops_per_s: rate,
                    ..Row::default()
                },
            );
        }
        let before = store.stats();
        let singles = 4000.min(n);
        let row = run(t, singles, |i| {
            assert!(ns.check_and_set(key(10_000_000 + i)).unwrap().is_first())
        });
        let after = store.stats();
        let rounds = after.sync_rounds - before.sync_rounds;
        let mut row = row;
        row.note = format!(
            "{:.2} operations per fsync",
            singles as f64 / rounds.max(1) as f64
        );
        rows.insert(
            format!("idemstore check_and_set, immediate, single calls ({t} threads)"),
            row,
        );
        store.close().unwrap();
    }

    // sled compare_and_swap.
    if !args.skip_peers {
        progress("sled compare_and_swap");
        let dir = tempfile::tempdir().unwrap();
        let (anon_before, _) = rss();
        let db = sled::open(dir.path()).unwrap();
        let count = n.min(1_000_000);
        let row = run(t, count, |i| {
            assert!(
                db.compare_and_swap(key(i), None as Option<&[u8]>, Some(&b"1"[..]))
                    .unwrap()
                    .is_ok()
            );
        });
        rows.insert(
            format!("sled 0.34 compare_and_swap fresh ({t} threads, {count} keys)"),
            row,
        );
        db.flush().unwrap();
        let (anon_after, _) = rss();
        facts.insert(
            "sled memory per key, anonymous RSS delta (bytes)".into(),
            format!(
                "{:.1}",
                anon_after.saturating_sub(anon_before) as f64 / count as f64
            ),
        );
        facts.insert(
            "sled disk bytes per key (du)".into(),
            format!("{:.1}", dir_bytes(dir.path()) as f64 / count as f64),
        );

        // Redis SET NX EX through redis-benchmark, if installed.
        progress("redis");
        match redis(n.min(1_000_000)) {
            Ok(redis_rows) => rows.extend(redis_rows),
            Err(why) => {
                facts.insert("redis".into(), format!("skipped: {why}"));
            }
        }
    }
    eprintln!("\r\x1b[2K[bench] done");

    if args.json {
        let mut out = String::from("{\"rows\":{");
        let parts: Vec<String> = rows
            .iter()
            .map(|(k, r)| format!("{:?}:{{\"ops_per_s\":{:.0},\"p50_ns\":{},\"p99_ns\":{},\"p999_ns\":{},\"note\":{:?}}}", k, r.ops_per_s, r.p50_ns, r.p99_ns, r.p999_ns, r.note))
            .collect();
        out.push_str(&parts.join(","));
        out.push_str("},\"facts\":{");
        let parts: Vec<String> = facts.iter().map(|(k, v)| format!("{k:?}:{v:?}")).collect();
        out.push_str(&parts.join(","));
        out.push_str("}}");
        println!("{out}");
        return;
    }
    println!(
        "{:<78} {:>12} {:>9} {:>9} {:>9}  note",
        "benchmark", "ops/s", "p50 ns", "p99 ns", "p999 ns"
    );
    for (name, r) in &rows {
        println!(
            "{name:<78} {:>12.0} {:>9} {:>9} {:>9}  {}",
            r.ops_per_s, r.p50_ns, r.p99_ns, r.p999_ns, r.note
        );
    }
    println!();
    for (name, value) in &facts {
        println!("{name:<70} {value}");
    }
}

/// Starts a private redis-server on a loopback port, runs redis-benchmark against it
/// in three configurations, and stops it.
fn redis(requests: u64) -> Result<Vec<(String, Row)>, String> {
    let found = |bin: &str| {
        Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {bin}"))
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    };
    if !found("redis-server") || !found("redis-benchmark") {
        return Err(
            "redis-server / redis-benchmark not installed (apt-get install redis-server)".into(),
        );
    }
    let mut rows = Vec::new();
    for (label, persistence) in [
        ("no persistence", "--save '' --appendonly no"),
        (
            "AOF everysec",
            "--save '' --appendonly yes --appendfsync everysec",
        ),
        (
            "AOF always",
            "--save '' --appendonly yes --appendfsync always",
        ),
    ] {
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = 27_000 + (std::process::id() % 1000) as u16;
        let mut server = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "exec redis-server --port {port} --bind 127.0.0.1 --dir {} {persistence}",
                dir.path().display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        std::thread::sleep(Duration::from_millis(300));
        for (pipeline, name) in [(1, "unpipelined"), (64, "pipelined x64")] {
            let output = Command::new("redis-benchmark")
                .args([
                    "-h",
                    "127.0.0.1",
                    "-p",
                    &port.to_string(),
                    "-c",
                    "50",
                    "-n",
                    &requests.to_string(),
                    "-P",
                    &pipeline.to_string(),
                    "-r",
                    "100000000",
                    "--csv",
                ])
                .args(["SET", "key:__rand_int__", "1", "NX", "EX", "3600"])
                .output()
                .map_err(|e| e.to_string())?;
            let text = String::from_utf8_lossy(&output.stdout);
            // CSV: "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
            let line = text.lines().last().unwrap_or_default();
            let fields: Vec<f64> = line
                .split(',')
                .skip(1)
                .map(|f| f.trim_matches('"').parse().unwrap_or(0.0))
                .collect();
            if fields.len() >= 6 {
                rows.push((
                    format!("redis 7 SET NX EX, {label}, {name}, 50 clients"),
                    Row {
                        ops_per_s: fields[0],
                        p50_ns: (fields[3] * 1e6) as u64,
                        p99_ns: (fields[5] * 1e6) as u64,
                        p999_ns: 0,
                        note: "latency includes the loopback round trip".into(),
                    },
                ));
            }
        }
        let _ = server.kill();
        let _ = server.wait();
    }
    Ok(rows)
}
