//! `cargo run --release --example async_bench` — an async consumer loop on one tokio
//! current-thread runtime, in `Durability::Immediate`, with N = 1, 64 and 1,000
//! messages in flight: durable `check_and_set`/s and `begin` + `complete` pairs/s,
//! operations per fsync, and p50/p99 of the future (call to resolution). Side by side,
//! the blocking call inside `spawn_blocking` with the same number in flight.
//!
//! `--ops N` (default 200,000 per row; a fiftieth with one in flight, a quarter for
//! the blocking rows), `--json`.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use idemstore::{Begin, Durability, Namespace, Policy, Store};

const IN_FLIGHT: [usize; 3] = [1, 64, 1_000];

struct Row {
    name: String,
    ops_per_s: f64,
    ops_per_fsync: f64,
    p50_us: f64,
    p99_us: f64,
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let at = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[at].as_secs_f64() * 1e6
}

/// Runs `tasks` tasks, each taking the next of `ops` ids and calling `op` on it,
/// and measures the store's syncs and every call's latency.
fn run<F, Fut>(store: &Store, name: String, tasks: usize, ops: usize, op: F) -> Row
where
    F: Fn(Namespace, String) -> Fut + Clone + 'static,
    Fut: std::future::Future<Output = ()> + 'static,
{
    let ns = store
        .namespace(
            &format!("ns-{}", name.len()),
            Policy::ttl(Duration::from_secs(3600)),
        )
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let next = Rc::new(RefCell::new(0usize));
    let latencies = Rc::new(RefCell::new(Vec::with_capacity(ops)));
    let rounds = store.stats().sync_rounds;
    let started = Instant::now();
    let tag = name.clone();
    runtime.block_on(async {
        let local = tokio::task::LocalSet::new();
        for _ in 0..tasks {
            let (ns, next, latencies, op, tag) = (
                ns.clone(),
                Rc::clone(&next),
                Rc::clone(&latencies),
                op.clone(),
                tag.clone(),
            );
            local.spawn_local(async move {
                loop {
                    let i = {
                        let mut next = next.borrow_mut();
                        if *next >= ops {
                            return;
                        }
                        *next += 1;
                        *next
                    };
                    let called = Instant::now();
                    op(ns.clone(), format!("{tag}-{i:012}")).await;
                    latencies.borrow_mut().push(called.elapsed());
                }
            });
        }
        local.await;
    });
    let elapsed = started.elapsed().as_secs_f64();
    let syncs = (store.stats().sync_rounds - rounds).max(1);
    let mut latencies = latencies.take();
    latencies.sort_unstable();
    Row {
        name,
        ops_per_s: ops as f64 / elapsed,
        ops_per_fsync: ops as f64 / syncs as f64,
        p50_us: percentile(&latencies, 0.5),
        p99_us: percentile(&latencies, 0.99),
    }
}

fn main() {
    let mut ops = 200_000usize;
    let mut json = false;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--ops" => ops = args.next().and_then(|v| v.parse().ok()).expect("--ops N"),
            "--json" => json = true,
            "--bench" => {}
            other => panic!("unknown argument {other}; use --ops N, --json"),
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::Immediate)
        .open()
        .unwrap();
    let mut rows = Vec::new();
    for n in IN_FLIGHT {
        rows.push(run(
            &store,
            format!("check_and_set_async, {n} in flight"),
            n,
            ops,
            |ns, id| async move {
                assert!(ns.check_and_set_async(id).await.unwrap().is_first());
            },
        ));
        rows.push(run(
            &store,
            format!("begin_async + complete_async, {n} in flight"),
            n,
            ops / 2,
            |ns, id| async move {
                let Begin::Acquired(claim) = ns.begin_async(id).await.unwrap() else {
                    panic!("not acquired");
                };
                claim.complete_async(None).await.unwrap();
            },
        ));
        // The blocking call from async code, done right: on the blocking pool.
        let blocking_ops = if n == 1 { ops } else { ops / 4 };
        rows.push(run(
            &store,
            format!("check_and_set in spawn_blocking, {n} in flight"),
            n,
            blocking_ops,
            |ns, id| async move {
                let first =
                    tokio::task::spawn_blocking(move || ns.check_and_set(id).unwrap().is_first())
                        .await
                        .unwrap();
                assert!(first);
            },
        ));
    }
    store.close().unwrap();
    if json {
        let fields: Vec<String> = rows
            .iter()
            .map(|r| {
                format!(
                    "{{\"name\":\"{}\",\"ops_per_s\":{:.0},\"ops_per_fsync\":{:.1},\"p50_us\":{:.1},\"p99_us\":{:.1}}}",
                    r.name, r.ops_per_s, r.ops_per_fsync, r.p50_us, r.p99_us
                )
            })
            .collect();
        println!("[{}]", fields.join(","));
        return;
    }
    println!(
        "{:<52} {:>12} {:>10} {:>10} {:>10}",
        "Immediate, one current-thread runtime", "durable/s", "ops/fsync", "p50 µs", "p99 µs"
    );
    for r in rows {
        println!(
            "{:<52} {:>12.0} {:>10.1} {:>10.1} {:>10.1}",
            r.name, r.ops_per_s, r.ops_per_fsync, r.p50_us, r.p99_us
        );
    }
}
