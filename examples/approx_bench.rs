//! Approximate mode (`Policy::approximate`) against the exact cold tier, side by side
//! in one run: N fresh 16-byte keys into a store with a memory budget, all spilled,
//! then duplicates of cold keys, then fresh keys counted for false duplicates; once
//! with an exact namespace, once with an approximate one at the configured rate. Reports
//! the cold tier's RAM per key, the duplicates' latency, and the measured
//! false-duplicate rate against the configured one (and its 16 × 2^-16 bound's share
//! per generation probed).
//!
//! ```sh
//! cargo run --release --example approx_bench -- [keys] [rate] [fresh probes] [dir]
//! # default: 10 000 000 keys, rate 1e-3, 10 000 000 fresh probes, a temp dir under /tmp
//! ```

use std::time::{Duration, Instant};

use idemstore::{Durability, Outcome, Policy, Store};

fn key(n: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&n.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    k[8..].copy_from_slice(&n.to_le_bytes());
    k
}

fn percentile(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize] as f64 / 1000.0
}

fn side(keys: u64, rate: Option<f64>, probes: u64, base: &std::path::Path) {
    let dir = tempfile::tempdir_in(base).unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::Interval(Duration::from_millis(100)))
        .shards(256)
        .memory_budget(16 << 20)
        .open()
        .unwrap();
    let mut policy = Policy::ttl(Duration::from_secs(24 * 3600));
    if let Some(rate) = rate {
        policy = policy.approximate(rate);
    }
    let ns = store.namespace("bench", policy).unwrap();
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..2 {
            let ns = &ns;
            s.spawn(move || {
                for i in (t..keys).step_by(2) {
                    assert!(ns.check_and_set(key(i)).unwrap().is_first());
                }
            });
        }
    });
    let fresh_rate = keys as f64 / started.elapsed().as_secs_f64();
    store.expire_now().unwrap();
    let cold = store.stats().cold;
    // Duplicates of cold keys, spread over all of them.
    let spread = |i: u64| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11) % keys;
    let duplicates = 1_000_000.min(keys);
    let mut latencies = Vec::with_capacity(duplicates as usize);
    let (mut likely, mut exact) = (0u64, 0u64);
    let started = Instant::now();
    for i in 0..duplicates {
        let at = Instant::now();
        let outcome = ns.check_and_set(key(spread(i))).unwrap();
        latencies.push(at.elapsed().as_nanos() as u64);
        match outcome {
            Outcome::LikelyDuplicate => likely += 1,
            Outcome::Duplicate(_) => exact += 1,
            Outcome::First => panic!("a written key answered First"),
        }
    }
    let duplicate_rate = duplicates as f64 / started.elapsed().as_secs_f64();
    latencies.sort_unstable();
    // Fresh keys: how many are taken for duplicates.
    let mut false_duplicates = 0u64;
    for i in 0..probes {
        if ns.check_and_set(key(keys + 1_000_000_000 + i)).unwrap() == Outcome::LikelyDuplicate {
            false_duplicates += 1;
        }
    }
    let measured = false_duplicates as f64 / probes as f64;
    // The probes were written (the ones answered First) and spills went on meanwhile.
    let generations_after = store.stats().cold.generations;
    let name = match rate {
        Some(rate) => format!("approximate, rate {rate:e}"),
        None => "exact".to_string(),
    };
    println!(
        "{name:<28} cold RAM {:.2} B/key ({} generations), fresh {:.2} M/s; cold duplicates {:.2} M/s p50 {:.2} µs p99 {:.2} µs ({likely} likely, {exact} exact); false duplicates {false_duplicates} of {probes} fresh = {measured:.2e}{}",
        cold.ram_bytes as f64 / keys as f64,
        cold.generations,
        fresh_rate / 1e6,
        duplicate_rate / 1e6,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        match rate {
            Some(rate) => format!(
                " (configured {rate:e}; {}..{generations_after} generations × 2^-16 = {:.2e}..{:.2e})",
                cold.generations,
                cold.generations as f64 / 65536.0,
                generations_after as f64 / 65536.0
            ),
            None => String::new(),
        }
    );
    store.close().unwrap();
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: u64 = args.next().map_or(10_000_000, |a| a.parse().unwrap());
    let rate: f64 = args.next().map_or(1e-3, |a| a.parse().unwrap());
    let probes: u64 = args.next().map_or(10_000_000, |a| a.parse().unwrap());
    let base = args
        .next()
        .map_or(std::env::temp_dir(), std::path::PathBuf::from);
    println!("== {keys} keys, 16 MiB budget, {probes} fresh probes");
    side(keys, None, probes, &base);
    side(keys, Some(rate), probes, &base);
}
