//! `cargo run --release --example async_bench` — an async consumer loop on one tokio
//! current-thread runtime, in `Durability::Immediate`, with N = 1, 64 and 1,000
//! messages in flight: durable `check_and_set`/s and `begin` + `complete` pairs/s,
//! operations per fsync, and p50/p99 of the future (call to resolution). Side by side,
//! the blocking call inside `spawn_blocking` with the same number in flight.
//!
//! Also Redis `SET key 1 NX EX 3600` with AOF `appendfsync always` (durable before the
//! reply, like `Immediate`) through the async `redis` client's multiplexed connection
//! with the same number in flight, when `redis-server` is installed (it starts its own
//! on a loopback port and stops it; otherwise the rows say they are skipped).
//!
//! `--ops N` (default 200,000 per row; a fiftieth with one in flight, a quarter for
//! the blocking and Redis rows), `--json`.

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
    match redis_rows(ops / 4) {
        Ok(redis) => rows.extend(redis),
        Err(why) => eprintln!("Redis rows skipped: {why}"),
    }
    if json {
        let fields: Vec<String> = rows
            .iter()
            .map(|r| {
                let per_fsync = if r.ops_per_fsync.is_nan() {
                    "null".to_string()
                } else {
                    format!("{:.1}", r.ops_per_fsync)
                };
                format!(
                    "{{\"name\":\"{}\",\"ops_per_s\":{:.0},\"ops_per_fsync\":{per_fsync},\"p50_us\":{:.1},\"p99_us\":{:.1}}}",
                    r.name, r.ops_per_s, r.p50_us, r.p99_us
                )
            })
            .collect();
        println!("[{}]", fields.join(","));
        return;
    }
    println!(
        "{:<60} {:>12} {:>10} {:>10} {:>10}",
        "Immediate, one current-thread runtime", "durable/s", "ops/fsync", "p50 µs", "p99 µs"
    );
    for r in rows {
        let per_fsync = if r.ops_per_fsync.is_nan() {
            "-".to_string()
        } else {
            format!("{:.1}", r.ops_per_fsync)
        };
        println!(
            "{:<60} {:>12.0} {:>10} {:>10.1} {:>10.1}",
            r.name, r.ops_per_s, per_fsync, r.p50_us, r.p99_us
        );
    }
}

/// Redis `SET NX EX` with AOF `always`, async multiplexed client, N in flight.
fn redis_rows(ops: usize) -> Result<Vec<Row>, String> {
    use std::process::{Command, Stdio};
    let installed = Command::new("sh")
        .arg("-c")
        .arg("command -v redis-server")
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        return Err("redis-server is not installed (apt-get install redis-server)".into());
    }
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let port = 28_000 + (std::process::id() % 1000) as u16;
    let mut server = Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .args(["--appendonly", "yes", "--appendfsync", "always"])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let result = runtime.block_on(async {
        let client =
            redis::Client::open(format!("redis://127.0.0.1:{port}/")).map_err(|e| e.to_string())?;
        // The server takes a moment to listen.
        let mut connection = None;
        for _ in 0..100 {
            match client.get_multiplexed_async_connection().await {
                Ok(c) => {
                    connection = Some(c);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
        let connection = connection.ok_or("redis-server did not start listening")?;
        let mut rows = Vec::new();
        for n in IN_FLIGHT {
            let ops = if n == 1 { ops / 12 } else { ops };
            let next = Rc::new(RefCell::new(0usize));
            let latencies = Rc::new(RefCell::new(Vec::with_capacity(ops)));
            let started = Instant::now();
            let local = tokio::task::LocalSet::new();
            for _ in 0..n {
                let (mut connection, next, latencies) =
                    (connection.clone(), Rc::clone(&next), Rc::clone(&latencies));
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
                        let set: Option<String> = redis::cmd("SET")
                            .arg(format!("redis-{n}-{i:012}"))
                            .arg(1)
                            .arg("NX")
                            .arg("EX")
                            .arg(3600)
                            .query_async(&mut connection)
                            .await
                            .expect("SET NX EX");
                        assert!(set.is_some(), "a fresh key was a duplicate");
                        latencies.borrow_mut().push(called.elapsed());
                    }
                });
            }
            local.await;
            let elapsed = started.elapsed().as_secs_f64();
            let mut latencies = latencies.take();
            latencies.sort_unstable();
            rows.push(Row {
                name: format!("Redis SET NX EX, AOF always, async client, {n} in flight"),
                ops_per_s: ops as f64 / elapsed,
                // Redis fsyncs once per event-loop pass; it does not say how often.
                ops_per_fsync: f64::NAN,
                p50_us: percentile(&latencies, 0.5),
                p99_us: percentile(&latencies, 0.99),
            });
        }
        Ok::<_, String>(rows)
    });
    let _ = server.kill();
    let _ = server.wait();
    result
}
