//! The cold tier (`memory_budget`) against the all-in-RAM index, side by side in one run:
//! N fresh 16-byte keys from 2 threads, then duplicates of keys spread over all of them
//! (spilled ones, with the budget), then `get` of absent keys (the lookup a fresh key
//! makes, with no write), then fresh keys that probe every generation, then the
//! open after a clean close (the generation files reused: duplicates with the page
//! cache dropped, when root, then warm), then writes after it (some spilled, some not)
//! and a kill -9 of the child, and the open after it in a new child (the generations
//! reused, the records no spill walked replayed). Reports anonymous RSS per key (`/proc/self/status`),
//! its peak (sampled every 5 ms by a thread), the hot tables' and the generations' bytes
//! per key, disk per key, rates, and call latency (p50 / p99 / p999).
//!
//! ```sh
//! cargo run --release --example cold_bench -- [keys] [budget MiB] [dir] [budget-only]
//! # default: 20 000 000 keys, a 16 MiB budget, a temp dir under /tmp, both sides
//! ```
//!
//! Each configuration runs in a child process of its own, so its RSS is its alone.
//! `COLD_BENCH_NO_REPLAY=1` skips the crash and the open after it; `COLD_BENCH_DUPS=n`
//! runs n duplicates per phase instead of 2,000,000 (data larger than the page cache
//! makes each a disk read); `COLD_BENCH_SHARDS=n` opens the store with n index shards
//! instead of 256; `COLD_BENCH_FILTER_BITS=8` gives the cold filters 8-bit
//! fingerprints instead of 16 (`cold_filter_bits`); `COLD_BENCH_TRACE=1` prints the
//! cold tier's debug events (each spill and merge, with where its time went) with
//! seconds since the store's first open, and glibc's `mallinfo2` figures (memory in
//! use against free memory the allocator holds) and where the anonymous RSS lies (main
//! heap, thread arenas, other mappings) after the final spill and the reopen;
//! `COLD_BENCH_TRIM=1` then also calls `malloc_trim` from the bench and prints the RSS
//! after it (what free memory the store's own trims left resident).

use std::time::{Duration, Instant};

use idemstore::{Durability, Outcome, Policy, Store};

const THREADS: u64 = 2;

fn key(n: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    k[8..].copy_from_slice(&n.to_le_bytes());
    k
}

/// The index shards (`COLD_BENCH_SHARDS`, default 256): a fresh key whose 20-bit
/// fingerprint matches a hot entry of its shard reads that entry's record, so the
/// hot entries per shard set how many records a fresh key reads.
fn shards() -> usize {
    std::env::var("COLD_BENCH_SHARDS")
        .ok()
        .map(|v| v.parse().expect("COLD_BENCH_SHARDS: a power of two"))
        .unwrap_or(256)
}

/// The cold filters' fingerprint bits (`COLD_BENCH_FILTER_BITS`, default 16).
fn filter_bits() -> u8 {
    std::env::var("COLD_BENCH_FILTER_BITS")
        .ok()
        .map(|v| v.parse().expect("COLD_BENCH_FILTER_BITS: 8 or 16"))
        .unwrap_or(16)
}

fn status(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(0, |kib| kib * 1024)
}

/// With `COLD_BENCH_TRACE`, the allocator's view of the heap (glibc's `mallinfo2`,
/// over all arenas), to tell the memory in use from free memory the allocator holds
/// (which anonymous RSS counts as well).
fn allocator(per: u64) {
    if std::env::var_os("COLD_BENCH_TRACE").is_none() {
        return;
    }
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallinfo2 only reads the allocator's statistics; no precondition.
        let m = unsafe { libc::mallinfo2() };
        let b = |n: usize| n as f64 / per as f64;
        println!(
            "    [allocator] in use {:.2} B/key, free but held {:.2} B/key (of which releasable at the top {:.2}); heap {:.2}, mmapped {:.2}",
            b(m.uordblks + m.hblkhd),
            b(m.fordblks),
            b(m.keepcost),
            b(m.arena),
            b(m.hblkhd)
        );
    }
    // Where the anonymous RSS lies (`/proc/self/smaps`): glibc's main heap, its
    // thread arenas (64 MiB-aligned mappings of at most 64 MiB), and the rest (chunks
    // glibc maps on their own, the index tables, stacks).
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let (mut heap, mut arenas, mut other, mut region) = (0u64, 0u64, 0u64, (0u64, 0u64, false));
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if let Some((start, end)) = first.split_once('-')
            && let (Ok(start), Ok(end)) =
                (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
        {
            region = (start, end, line.ends_with("[heap]"));
        } else if first == "Anonymous:" {
            let bytes = words
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
            let (start, end, is_heap) = region;
            if is_heap {
                heap += bytes;
            } else if start % (64 << 20) == 0 && end - start <= 64 << 20 {
                arenas += bytes;
            } else {
                other += bytes;
            }
        }
    }
    if std::env::var_os("COLD_BENCH_TRIM").is_some() {
        // SAFETY: as in the store: malloc_trim only returns free pages.
        unsafe { libc::malloc_trim(0) };
        println!(
            "    [after malloc_trim] anonymous RSS {:.2} B/key",
            status("RssAnon:") as f64 / per as f64
        );
    }
    println!(
        "    [anonymous RSS] main heap {:.2} B/key, thread arenas {:.2} B/key, other mappings {:.2} B/key",
        heap as f64 / per as f64,
        arenas as f64 / per as f64,
        other as f64 / per as f64
    );
}

fn dir_bytes(path: &std::path::Path) -> u64 {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let at = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[at] as f64 / 1000.0
}

/// Runs `op(i)` for i in `range` split over `THREADS` threads; returns calls/s and the
/// sorted latencies (ns) of every `sample`-th call.
fn run(range: std::ops::Range<u64>, sample: u64, op: impl Fn(u64) + Sync) -> (f64, Vec<u64>) {
    let started = Instant::now();
    let per = (range.end - range.start).div_ceil(THREADS);
    let mut latencies: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let op = &op;
                let from = range.start + t * per;
                let to = (from + per).min(range.end);
                s.spawn(move || {
                    let mut lat = Vec::with_capacity(((to - from) / sample + 1) as usize);
                    for i in from..to {
                        if i % sample == 0 {
                            let at = Instant::now();
                            op(i);
                            lat.push(at.elapsed().as_nanos() as u64);
                        } else {
                            op(i);
                        }
                    }
                    lat
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    latencies.sort_unstable();
    let rate = (range.end - range.start) as f64 / started.elapsed().as_secs_f64();
    (rate, latencies)
}

fn report(what: &str, keys: u64, (rate, lat): &(f64, Vec<u64>)) {
    println!(
        "  {what:<44} {:>7.2} M/s   p50 {:>6.2} µs  p99 {:>7.2} µs  p999 {:>8.2} µs  ({keys} calls)",
        rate / 1e6,
        percentile(lat, 0.50),
        percentile(lat, 0.99),
        percentile(lat, 0.999),
    );
}

/// The largest anonymous RSS seen since `start`, sampled every 5 ms.
struct PeakAnon {
    peak: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl PeakAnon {
    fn start() -> PeakAnon {
        let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let sampled = std::sync::Arc::clone(&peak);
        std::thread::spawn(move || {
            loop {
                sampled.fetch_max(status("RssAnon:"), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        PeakAnon { peak }
    }

    /// The peak so far, and a new period from now.
    fn take(&self) -> u64 {
        self.peak
            .swap(status("RssAnon:"), std::sync::atomic::Ordering::Relaxed)
    }
}

fn child(keys: u64, budget: Option<u64>, dir: &std::path::Path) {
    let print = PrintInfo::new();
    if print.trace.is_some() {
        let _ = tracing::subscriber::set_global_default(print);
    }
    let open = || {
        let builder = Store::builder(dir)
            .durability(Durability::Interval(Duration::from_millis(100)))
            .shards(shards())
            .cold_filter_bits(filter_bits());
        match budget {
            Some(b) => builder.memory_budget(b).open(),
            None => builder.open(),
        }
        .unwrap()
    };
    let label = match budget {
        Some(b) => format!("budget {} MiB", b >> 20),
        None => "no budget (all in RAM)".to_string(),
    };
    println!("== {label}, {keys} keys");
    let peak = PeakAnon::start();
    let store = open();
    let ns = store
        .namespace("bench", Policy::ttl(Duration::from_secs(24 * 3600)))
        .unwrap();
    let fresh = run(0..keys, 64, |i| {
        assert_eq!(ns.check_and_set(key(i)).unwrap(), Outcome::First);
    });
    report("fresh check_and_set, 2 threads", keys, &fresh);
    let started = Instant::now();
    store.expire_now().unwrap();
    let stats = store.stats();
    println!(
        "  final spill {:.2?}; hot index {:.2} B/key, cold RAM {:.2} B/key ({} generations, {} entries, {} spills, {} merges)",
        started.elapsed(),
        stats.index_bytes as f64 / keys as f64,
        stats.cold.ram_bytes as f64 / keys as f64,
        stats.cold.generations,
        stats.cold.entries,
        stats.cold.spills,
        stats.cold.merges
    );
    println!(
        "  anonymous RSS {:.2} B/key (peak while writing {:.2} B/key); disk {:.1} B/key (log {:.1}, cold files {:.1})",
        status("RssAnon:") as f64 / keys as f64,
        peak.take() as f64 / keys as f64,
        dir_bytes(dir) as f64 / keys as f64,
        stats.log_bytes as f64 / keys as f64,
        stats.cold.disk_bytes as f64 / keys as f64,
    );
    allocator(keys);
    // Duplicates of the oldest keys (spilled first), a pseudo-random walk over them.
    // `COLD_BENCH_DUPS`: fewer duplicates per phase, for sizes whose data outgrows the
    // page cache (each one then reads from disk).
    let dups = std::env::var("COLD_BENCH_DUPS")
        .ok()
        .and_then(|d| d.parse().ok())
        .unwrap_or(2_000_000)
        .min(keys / 4);
    let spread = |i: u64| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) % keys;
    let duplicate = |i: u64| {
        assert!(matches!(
            ns.check_and_set(key(spread(i))).unwrap(),
            Outcome::Duplicate(_)
        ));
    };
    report(
        "duplicates, spread over every key",
        dups,
        &run(0..dups, 1, duplicate),
    );
    let more = (keys / 10).min(2_000_000);
    // The lookup a fresh key makes, alone: a miss in the hot table, then every
    // generation's filter (and a page read on a false positive). Nothing is written.
    let absent = keys + 2 * more;
    report(
        "absent keys, get (read-only)",
        more,
        &run(absent..absent + more, 1, |i| {
            assert!(ns.get(key(i)).unwrap().is_none());
        }),
    );
    report(
        "fresh keys after the spill",
        more,
        &run(keys..keys + more, 1, |i| {
            assert_eq!(ns.check_and_set(key(i)).unwrap(), Outcome::First);
        }),
    );
    drop(ns);
    store.close().unwrap();
    drop(store);
    // A clean close wrote CHECKPOINT and (with generations) COLD_STATE: the open takes
    // the generation files over. With the page cache dropped first (root only), the
    // first duplicates read their pages from disk.
    let cold_cache = drop_page_cache();
    peak.take();
    let started = Instant::now();
    let store = open();
    let opened = started.elapsed();
    let stats = store.stats();
    println!(
        "  reopen after a clean close {opened:.2?} ({} generations reused, {} records replayed; peak anonymous RSS {:.2} B/key), then {:.2} B/key",
        stats.cold.reused_at_open,
        stats.records_replayed,
        peak.take() as f64 / (keys + more) as f64,
        status("RssAnon:") as f64 / (keys + more) as f64
    );
    allocator(keys + more);
    let ns = store
        .namespace("bench", Policy::ttl(Duration::from_secs(24 * 3600)))
        .unwrap();
    let duplicate = |i: u64| {
        assert!(matches!(
            ns.check_and_set(key(spread(i))).unwrap(),
            Outcome::Duplicate(_)
        ));
    };
    let first = if cold_cache {
        "duplicates after it, cold page cache"
    } else {
        "duplicates after it (page cache not dropped: not root)"
    };
    report(first, dups, &run(dups..2 * dups, 1, duplicate));
    report(
        "the same keys again, warm page cache",
        dups,
        &run(dups..2 * dups, 1, duplicate),
    );
    drop(ns);
    store.close().unwrap();
    drop(store);
    if std::env::var_os("COLD_BENCH_NO_REPLAY").is_some() {
        println!("  reopen after a crash: skipped (COLD_BENCH_NO_REPLAY)");
        return;
    }
    // A crash: writes after the clean reopen, some spilled (a reaper round writes the
    // cold state), more after it that no spill walked, then kill -9 of this process.
    // The parent opens the directory again in a child of its own (`reopen`).
    let store = open();
    let ns = store
        .namespace("bench", Policy::ttl(Duration::from_secs(24 * 3600)))
        .unwrap();
    let extra = (keys / 100).max(10_000);
    for i in 0..2 * extra {
        assert_eq!(
            ns.check_and_set(key(CRASH_KEYS + i)).unwrap(),
            Outcome::First
        );
        if i + 1 == extra {
            store.expire_now().unwrap();
        }
    }
    store.flush().unwrap();
    println!("  {extra} keys written and spilled, {extra} more written, then kill -9");
    use std::io::Write;
    std::io::stdout().flush().unwrap();
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("kill")
        .args(["-9", &pid])
        .status();
    unreachable!("kill -9 of this process returned");
}

/// The first key of the crash phase's writes (far from every other key).
const CRASH_KEYS: u64 = 1 << 62;

/// The open after the kill -9 of `child`: its time, what it replayed and rebuilt, its
/// peak anonymous RSS, and duplicates of spilled and of replayed keys.
fn reopen_after_crash(keys: u64, budget: Option<u64>, dir: &std::path::Path) {
    // The open's phases (survey, cold load, replay, sync, restore, reconcile) are
    // logged at info: print them.
    let _ = tracing::subscriber::set_global_default(PrintInfo::new());
    // A machine that restarts after a crash starts with nothing cached: the page cache
    // is dropped first (when root).
    let cold_cache = drop_page_cache();
    let peak = PeakAnon::start();
    let started = Instant::now();
    let mut builder = Store::builder(dir)
        .durability(Durability::Interval(Duration::from_millis(100)))
        .shards(shards())
        .cold_filter_bits(filter_bits());
    if let Some(b) = budget {
        builder = builder.memory_budget(b);
    }
    let store = builder.open().unwrap();
    let opened = started.elapsed();
    let stats = store.stats();
    let extra = (keys / 100).max(10_000);
    println!(
        "  reopen after kill -9 {opened:.2?}{} ({} records replayed, {} generations reused, {} cold files rebuilt; peak anonymous RSS {:.2} B/key), then {:.2} B/key",
        if cold_cache {
            ", page cache dropped"
        } else {
            ""
        },
        stats.records_replayed,
        stats.cold.reused_at_open,
        stats.cold.rebuilt_at_open,
        peak.take() as f64 / keys as f64,
        status("RssAnon:") as f64 / keys as f64
    );
    let ns = store
        .namespace("bench", Policy::ttl(Duration::from_secs(24 * 3600)))
        .unwrap();
    let spread = |i: u64| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) % keys;
    for i in 0..100_000 {
        assert!(matches!(
            ns.check_and_set(key(spread(i))).unwrap(),
            Outcome::Duplicate(_)
        ));
    }
    for i in 0..2 * extra {
        assert!(matches!(
            ns.check_and_set(key(CRASH_KEYS + i)).unwrap(),
            Outcome::Duplicate(_)
        ));
    }
    println!(
        "  after it: 100000 spread keys and the {} crash-phase keys all duplicates",
        2 * extra
    );
}

/// Drops the kernel's clean page cache (needs root); whether it did.
fn drop_page_cache() -> bool {
    // `sync` first, so that dirty pages are clean and can be dropped.
    let synced = std::process::Command::new("sync")
        .status()
        .is_ok_and(|s| s.success());
    synced && std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

fn main() {
    let mut args = std::env::args().skip(1);
    if let Some(spec) = std::env::var_os("COLD_BENCH_CHILD") {
        let spec = spec.into_string().unwrap();
        let mut parts = spec.split(';');
        let keys: u64 = parts.next().unwrap().parse().unwrap();
        let budget: u64 = parts.next().unwrap().parse().unwrap();
        let dir = std::path::Path::new(parts.next().unwrap());
        let budget = (budget > 0).then_some(budget);
        match parts.next() {
            Some("reopen") => reopen_after_crash(keys, budget, dir),
            _ => child(keys, budget, dir),
        }
        return;
    }
    let keys: u64 = args.next().map_or(20_000_000, |a| a.parse().unwrap());
    let budget_mib: u64 = args.next().map_or(16, |a| a.parse().unwrap());
    let base = args.next().map_or_else(std::env::temp_dir, Into::into);
    // `budget-only`: skip the all-in-RAM side (beyond the RAM its replay needs).
    let configs: &[u64] = match args.next().as_deref() {
        Some("budget-only") => &[budget_mib << 20],
        _ => &[budget_mib << 20, 0],
    };
    for &budget in configs {
        let dir = tempfile::tempdir_in(&base).unwrap();
        let spec = format!("{keys};{budget};{}", dir.path().display());
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .env("COLD_BENCH_CHILD", &spec)
            .status()
            .unwrap();
        if std::env::var_os("COLD_BENCH_NO_REPLAY").is_some() {
            assert!(status.success(), "the benchmark child failed: {status:?}");
            continue;
        }
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            status.signal(),
            Some(9),
            "the benchmark child did not end by its kill -9: {status:?}"
        );
        let status = std::process::Command::new(std::env::current_exe().unwrap())
            .env("COLD_BENCH_CHILD", format!("{spec};reopen"))
            .status()
            .unwrap();
        assert!(status.success(), "the reopen child failed: {status:?}");
    }
}

/// A minimal subscriber: prints each event at info or above, its fields on one line;
/// with `COLD_BENCH_TRACE`, the cold tier's debug events too, each with the seconds
/// since the subscriber was made.
struct PrintInfo {
    /// `Some(start)` with `COLD_BENCH_TRACE`.
    trace: Option<Instant>,
}

impl PrintInfo {
    fn new() -> PrintInfo {
        PrintInfo {
            trace: std::env::var_os("COLD_BENCH_TRACE").map(|_| Instant::now()),
        }
    }
}

impl tracing::Subscriber for PrintInfo {
    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        *metadata.level() <= tracing::Level::INFO
            || (self.trace.is_some() && metadata.target().starts_with("idemstore::cold"))
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, event: &tracing::Event<'_>) {
        struct Line(String);
        impl tracing::field::Visit for Line {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                self.0.push_str(&format!(" {}={value:?}", field.name()));
            }
        }
        let mut line = Line(String::new());
        event.record(&mut line);
        match self.trace {
            Some(start) => {
                let at = start.elapsed().as_secs_f64();
                println!("    [{} {at:.3}s]{}", event.metadata().level(), line.0);
            }
            None => println!("    [{}]{}", event.metadata().level(), line.0),
        }
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}
