//! `idemstore demo`: replays the incident idemstore exists to prevent
//! (docs/CONTRACT.md §0).
//!
//! An inventory service consumes "order created" messages from an at-least-once
//! broker and deducts stock for each. The broker (this process, `demo/broker.rs`)
//! redelivers the way real ones do: producer retries, lost acks, consumers killed with
//! SIGKILL mid-batch, and a rebalance that hands the partition to a new consumer. Each
//! consumer is a real child process (this binary re-executed with the hidden
//! `demo-consumer` subcommand, `demo/consumer.rs`). The same traffic runs twice:
//! without idemstore, then with it. The stock lives in an append-only ledger outside
//! the consumer (`demo/ledger.rs`), so it survives the kills, and the report counts
//! deductions per order from the ledger itself: "deducted twice" and "never deducted"
//! are measured, not inferred from what the consumers said.
//!
//! # Why the consumer is safe under kill -9 (the order of the three steps)
//!
//! With idemstore each delivery goes `begin(order id)` → deduct (one ledger append) →
//! `claim.complete(result)`, and each batch is acked only after the ledger is synced
//! and `store.flush()` has made the claims durable. The store runs in its default
//! `Durability::Interval` mode, in which every acknowledged operation survives a
//! process kill. A SIGKILL can land anywhere:
//!
//! 1. Before `begin` wrote its record: nothing happened. The order is redelivered
//!    and acquired as attempt 1, and deducted once.
//! 2. After `begin`, before the ledger append: the order is `InProgress` under the
//!    killed consumer's claim. The next consumer's open releases that claim (the
//!    directory lock proves its holder is gone, docs/CONTRACT.md §3.6), so the
//!    redelivery acquires it at once as attempt 2; the ledger has no line for it, so
//!    it deducts once.
//! 3. After the ledger append, before `complete`: the same attempt 2, but this time
//!    the ledger has the deduction, so the consumer completes without deducting
//!    ("reconciled").
//! 4. After `complete`: the order is `Completed`; every redelivery is skipped.
//!
//! So the ledger is read only when `attempt > 1`: idemstore's attempt counter tells
//! the consumer exactly which deliveries a crash may have left half done — a handful
//! per kill — and only those need to look at the side effect itself. That is the
//! reconciliation a consumer whose side effect lives outside one row must do anyway.
//!
//! The one-shot `check_and_set` before deducting would not do: a kill between the mark
//! and the deduction leaves the order marked and never deducted (the Redis `SET NX`
//! flaw of docs/CONTRACT.md §0), and marking after deducting brings the double deduction
//! back. With the claim lifecycle the report can truthfully say 0 orders deducted
//! twice and 0 orders never deducted; the demo exits 1 if either is not 0.
//!
//! The consumers' leases are the real 30 s, but a killed consumer's claims do not
//! wait for them: the next consumer's open releases them. The broker still starts the
//! next consumer with its clock 31 s further ahead (a [`consumer::ShiftedClock`]),
//! standing for the time a restart takes.

mod broker;
pub mod consumer;
mod ledger;
#[cfg(feature = "nats")]
pub mod machine;
#[cfg(feature = "nats")]
mod machines;
mod protocol;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use idemstore::Store;

use broker::{Pass, PassReport, Traffic};
use protocol::{Verdict, order_id};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The options of `idemstore demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Orders to publish.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u32).range(1..=5_000_000))]
    messages: u32,
    /// Fraction of orders delivered a second time, half by a producer retry and half
    /// by a lost ack (on top of what crashes and rebalances redeliver).
    #[arg(long, default_value_t = 0.05, value_parser = parse_fraction)]
    dup_rate: f64,
    /// Consumer processes killed with SIGKILL mid-batch, in each run.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(0..=1_000))]
    crashes: u32,
    /// Rebalances handing the partition to a new consumer process, in each run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(0..=1_000))]
    rebalances: u32,
    /// Where to keep the store and the stock ledgers; must be empty or absent
    /// [default: a new directory in the system's temp directory].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Messages per polled batch.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=4_096))]
    batch: u32,
    /// Seed of the traffic: the same seed gives the same orders, duplicates and crash points.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Run the partitions-moving-between-machines scenario instead, with this many
    /// consumer machines (each a process with its own store directory), without
    /// replication and with it on a 3-node NATS JetStream cluster it starts on
    /// loopback (needs nats-server and a build with `--features nats`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..=16))]
    machines: Option<u32>,
    /// Orders of the --machines scenario.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=10_000_000))]
    orders: u64,
    /// Partitions of the --machines scenario.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(u32).range(1..=1_024))]
    partitions: u32,
    /// Which runs of the --machines scenario: any of none, async, sync, comma separated.
    #[arg(long, default_value = "none,async,sync")]
    modes: String,
    /// --machines: one JSON line per run instead of the report (for tests).
    #[arg(long)]
    json: bool,
}

fn parse_fraction(text: &str) -> std::result::Result<f64, String> {
    let value: f64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number"))?;
    if (0.0..=1.0).contains(&value) {
        Ok(value)
    } else {
        Err(format!("{value} is not between 0 and 1"))
    }
}

/// Runs the demo: exit 0 if idemstore kept every order to exactly one deduction, 1 if
/// not, 2 if the demo itself failed.
pub fn run(args: DemoArgs) -> ExitCode {
    if let Some(machines) = args.machines {
        return run_machines(&args, machines as usize);
    }
    match demo(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("idemstore demo: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(feature = "nats")]
fn run_machines(args: &DemoArgs, machines: usize) -> ExitCode {
    let modes: Vec<String> = args
        .modes
        .split(',')
        .map(|m| m.trim().to_string())
        .collect();
    if let Some(bad) = modes
        .iter()
        .find(|m| !["none", "async", "sync"].contains(&m.as_str()))
    {
        eprintln!("idemstore demo: --modes {bad:?}: use none, async and/or sync");
        return ExitCode::from(2);
    }
    let dir = match prepare_dir(args.dir.as_deref()) {
        Ok(dir) => dir,
        Err(e) => {
            eprintln!("idemstore demo: {e}");
            return ExitCode::from(2);
        }
    };
    let plan = machines::MachinesPlan {
        machines,
        partitions: args.partitions,
        orders: args.orders,
        seed: args.seed,
        modes,
        json: args.json,
        dir: dir.clone(),
    };
    let result = machines::run(&plan);
    if args.dir.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("idemstore demo: {e}");
            ExitCode::from(2)
        }
    }
}

#[cfg(not(feature = "nats"))]
fn run_machines(_args: &DemoArgs, _machines: usize) -> ExitCode {
    eprintln!(
        "idemstore demo --machines: this build has no replication; build it with the nats feature:\n  \
         cargo run --release --features nats -- demo --machines 3\n\
         (and install nats-server: apt-get install nats-server)"
    );
    ExitCode::from(2)
}

/// What the ledger of one pass says happened to the stock.
#[derive(Debug, Default)]
struct Outcome {
    /// Orders whose stock was deducted more than once.
    orders_deducted_twice: u64,
    /// Units deducted beyond one deduction per order.
    units_deducted_twice: u64,
    /// Orders never deducted.
    orders_never_deducted: u64,
    torn_lines: u64,
}

fn demo(args: &DemoArgs) -> Result<bool> {
    let root = prepare_dir(args.dir.as_deref())?;
    let exe = std::env::current_exe()
        .map_err(|e| format!("finding this program to start consumers from: {e}"))?;
    let traffic = Traffic::generate(
        args.messages,
        args.dup_rate,
        args.crashes,
        args.rebalances,
        args.seed,
    );

    let without = Pass {
        label: "without idemstore",
        ledger_dir: root.join("without-idemstore").join("ledger"),
        store_dir: None,
        batch_len: args.batch as usize,
    };
    let with = Pass {
        label: "with idemstore",
        ledger_dir: root.join("with-idemstore").join("ledger"),
        store_dir: Some(root.join("with-idemstore").join("store")),
        batch_len: args.batch as usize,
    };
    let mut runs = Vec::new();
    for pass in [&without, &with] {
        std::fs::create_dir_all(&pass.ledger_dir)
            .map_err(|e| format!("creating {}: {e}", pass.ledger_dir.display()))?;
        let report = broker::run(&exe, &traffic, pass)?;
        let outcome = count_deductions(&traffic, &pass.ledger_dir)?;
        runs.push((report, outcome));
    }
    let store_dir = with
        .store_dir
        .as_deref()
        .expect("the second pass has a store");
    let (with_report, with_outcome) = &runs[1];
    let store_summary = inspect_store(store_dir, with_report)?;

    print_report(
        &traffic,
        &runs[0],
        &runs[1],
        &root,
        store_dir,
        &store_summary,
    );
    Ok(with_outcome.orders_deducted_twice == 0 && with_outcome.orders_never_deducted == 0)
}

/// The demo's directory: `dir` if empty or absent, else a new one under the temp dir.
fn prepare_dir(dir: Option<&Path>) -> Result<PathBuf> {
    let root = match dir {
        Some(dir) => dir.to_path_buf(),
        None => {
            let unix_ns = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            std::env::temp_dir().join(format!("idemstore-demo-{}-{unix_ns:x}", std::process::id()))
        }
    };
    if let Ok(mut entries) = std::fs::read_dir(&root)
        && entries.next().is_some()
    {
        return Err(format!(
            "{} is not empty; give --dir an empty or new directory \
             (the demo needs a fresh store and fresh ledgers)",
            root.display()
        )
        .into());
    }
    std::fs::create_dir_all(&root).map_err(|e| format!("creating {}: {e}", root.display()))?;
    Ok(root)
}

/// Counts deductions per order in a pass's ledgers.
fn count_deductions(traffic: &Traffic, ledger_dir: &Path) -> Result<Outcome> {
    let scan = ledger::scan(ledger_dir)
        .map_err(|e| format!("reading the ledgers in {}: {e}", ledger_dir.display()))?;
    let mut count = vec![0u32; traffic.orders as usize + 1];
    let mut outcome = Outcome {
        torn_lines: scan.torn_lines,
        ..Outcome::default()
    };
    for deduction in &scan.deductions {
        let Some(seen) = count.get_mut(deduction.order as usize) else {
            return Err(format!("the ledger deducts unknown order {}", deduction.order).into());
        };
        *seen += 1;
        if *seen > 1 {
            outcome.units_deducted_twice += u64::from(deduction.quantity);
        }
        if *seen == 2 {
            outcome.orders_deducted_twice += 1;
        }
    }
    outcome.orders_never_deducted = count[1..].iter().filter(|&&c| c == 0).count() as u64;
    Ok(outcome)
}

/// What the store holds after the pass with idemstore.
struct StoreSummary {
    completed: u64,
    live_keys: u64,
    disk_bytes: u64,
    /// One re-acquired order's consumption record, as `get` returns it.
    sample: Option<(String, idemstore::Record)>,
}

fn inspect_store(dir: &Path, report: &PassReport) -> Result<StoreSummary> {
    let store = Store::builder(dir)
        .clock(consumer::ShiftedClock {
            offset_ms: report.clock_offset_ms,
        })
        .open()?;
    let inventory = store.namespace(consumer::NAMESPACE, consumer::policy())?;
    let sample = report
        .retried_orders
        .iter()
        .find(|(_, verdict)| *verdict == Verdict::Reconciled)
        .or(report.retried_orders.first())
        .map(|&(number, _)| order_id(number));
    let sample = match sample {
        Some(id) => inventory.get(&id)?.map(|record| (id, record)),
        None => None,
    };
    let stats = store.stats();
    store.close()?;
    Ok(StoreSummary {
        completed: stats.completed,
        live_keys: stats.live_keys,
        disk_bytes: stats.disk_bytes,
        sample,
    })
}

fn print_report(
    traffic: &Traffic,
    (without, without_outcome): &(PassReport, Outcome),
    (with, with_outcome): &(PassReport, Outcome),
    root: &Path,
    store_dir: &Path,
    store: &StoreSummary,
) {
    // Deliveries per second of consuming: process starts and store recovery, when the
    // broker delivers nothing, are shown on their own row.
    let rate = |r: &PassReport| {
        let consuming = r.wall_time.saturating_sub(r.restart_time);
        r.deliveries as f64 / consuming.as_secs_f64().max(1e-6)
    };
    let caught = |r: &PassReport| r.count(Verdict::Skipped) + r.count(Verdict::Reconciled);
    let seconds = |r: &PassReport, d: fn(&PassReport) -> std::time::Duration| {
        format!("{:.2} s", d(r).as_secs_f64())
    };
    let row = |label: &str, a: String, b: String| println!("  {label:<30}{a:>19}{b:>16}");
    let margin = "              ";

    println!();
    println!("idemstore demo: an inventory consumer deducting stock per \"order created\" message");
    println!();
    println!(
        "  traffic     {} orders, {} published ({} producer retries), seed {}",
        thousands(u64::from(traffic.orders)),
        thousands(traffic.stream.len() as u64),
        thousands(traffic.producer_retries),
        traffic.seed
    );
    println!(
        "  broker      at-least-once; in each run {}, {} killed with SIGKILL",
        plural(with.lost_acks, "ack lost", "acks lost"),
        plural(traffic.crashes() as u64, "consumer", "consumers"),
    );
    println!(
        "{margin}mid-batch, {} to a new consumer process",
        plural(traffic.rebalances() as u64, "rebalance", "rebalances"),
    );
    println!();
    row("", "without idemstore".into(), "with idemstore".into());
    row(
        "deliveries",
        thousands(without.deliveries),
        thousands(with.deliveries),
    );
    row(
        "duplicates caught",
        thousands(caught(without)),
        thousands(caught(with)),
    );
    row(
        "orders deducted twice",
        thousands(without_outcome.orders_deducted_twice),
        thousands(with_outcome.orders_deducted_twice),
    );
    row(
        "units of stock deducted twice",
        thousands(without_outcome.units_deducted_twice),
        thousands(with_outcome.units_deducted_twice),
    );
    row(
        "orders never deducted",
        thousands(without_outcome.orders_never_deducted),
        thousands(with_outcome.orders_never_deducted),
    );
    row(
        "consumer processes",
        thousands(u64::from(without.consumers)),
        thousands(u64::from(with.consumers)),
    );
    row(
        "wall time",
        seconds(without, |r| r.wall_time),
        seconds(with, |r| r.wall_time),
    );
    row(
        "  of it, consumer restarts",
        seconds(without, |r| r.restart_time),
        seconds(with, |r| r.restart_time),
    );
    row(
        "throughput (deliveries/s)",
        thousands(rate(without) as u64),
        thousands(rate(with) as u64),
    );
    println!();

    let reconciled = with.count(Verdict::Reconciled);
    let on_retry = with.count(Verdict::DeductedOnRetry);
    if reconciled + on_retry == 0 {
        println!("  kills       no claim was open when a consumer was killed (each kill landed");
        println!("{margin}between two messages or in a batch's fsync); more --crashes hit one");
    } else {
        println!(
            "  kills       {} open when their consumer was killed; the next open released",
            plural(reconciled + on_retry, "claim was", "claims were")
        );
        println!(
            "{margin}{} (its process was gone); the next consumer re-acquired {} and checked the ledger:",
            if reconciled + on_retry == 1 {
                "it"
            } else {
                "them"
            },
            if reconciled + on_retry == 1 {
                "it"
            } else {
                "each"
            }
        );
        println!(
            "{margin}{} already deducted (completed, not deducted again), {} not yet (deducted once)",
            thousands(reconciled),
            thousands(on_retry)
        );
    }
    let nacked = with.count(Verdict::Nacked);
    let dead = with.count(Verdict::DeadLettered);
    if nacked + dead > 0 {
        println!(
            "{margin}{} nacked (lease still held), {} dead-lettered",
            plural(nacked, "delivery", "deliveries"),
            thousands(dead)
        );
    }
    if let (Some((recovery, records)), true) = (with.slowest_recovery, with.consumers > 1) {
        println!(
            "  recovery    the store was reopened {} after kills and rebalances;",
            plural(u64::from(with.consumers - 1), "time", "times")
        );
        println!(
            "{margin}the slowest open replayed {} records in {:.1} ms",
            thousands(records),
            recovery.as_secs_f64() * 1e3
        );
    }
    println!("  store       {}", store_dir.display());
    println!(
        "{margin}{} keys ({} completed), {} reserved on disk",
        thousands(store.live_keys),
        thousands(store.completed),
        bytes(store.disk_bytes)
    );
    if let Some((id, record)) = &store.sample {
        println!(
            "  record      get({id:?}): {}, {}, result:",
            record.status.as_str(),
            plural(u64::from(record.attempts), "attempt", "attempts"),
        );
        println!(
            "{margin}{:?}",
            String::from_utf8_lossy(record.result().unwrap_or_default())
        );
    }
    println!(
        "  ledgers     {}",
        root.join("{without,with}-idemstore")
            .join("ledger")
            .join("consumer-*.log")
            .display()
    );
    let torn = without_outcome.torn_lines + with_outcome.torn_lines;
    if torn > 0 {
        println!(
            "{margin}{} from kills inside a ledger write (not deductions)",
            plural(torn, "torn last line", "torn last lines")
        );
    }
    println!();
    if with_outcome.orders_deducted_twice == 0 && with_outcome.orders_never_deducted == 0 {
        println!(
            "  PASS  with idemstore every order's stock was deducted exactly once \
             (without: {} twice)",
            thousands(without_outcome.orders_deducted_twice)
        );
    } else {
        println!(
            "  FAIL  with idemstore {} deducted twice and {} never: a bug;",
            plural(
                with_outcome.orders_deducted_twice,
                "order was",
                "orders were"
            ),
            thousands(with_outcome.orders_never_deducted)
        );
        println!("        please report it with the directory above");
    }
}

/// `1 order`, `2 orders`.
fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", thousands(n), if n == 1 { one } else { many })
}

/// `1234567` → `1,234,567`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A byte count for people.
fn bytes(n: u64) -> String {
    const MIB: f64 = 1024.0 * 1024.0;
    if n as f64 >= MIB {
        format!("{:.1} MiB", n as f64 / MIB)
    } else {
        format!("{:.1} KiB", n as f64 / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separates_groups() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1_000), "1,000");
        assert_eq!(thousands(1_234_567), "1,234,567");
    }

    #[test]
    fn the_same_seed_gives_the_same_traffic() {
        let a = Traffic::generate(1_000, 0.1, 3, 1, 7);
        let b = Traffic::generate(1_000, 0.1, 3, 1, 7);
        assert_eq!(a.stream, b.stream);
        assert_eq!(a.lose_first_ack, b.lose_first_ack);
        assert_eq!(a.events, b.events);
        assert_eq!(a.crashes(), 3);
        assert_eq!(a.rebalances(), 1);
        assert!(a.events.iter().all(|&(at, _)| at < a.stream.len() as u64));
    }
}
