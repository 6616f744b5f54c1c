//! `idemstore demo --machines N`: partitions that move between machines.
//!
//! N consumer processes (`demo/machine.rs`), each with its own store directory (its
//! "machine"), share the partitions of an order topic that this process brokers:
//! every partition has one owner at a time, offsets are committed every 64
//! deliveries (after `flush_partition` in `Async`), and every 300 deliveries something
//! happens, as it does to a consumer group: a rebalance through revoke (flush,
//! release, restore elsewhere), a handoff without revoke that leaves a zombie writing
//! (in `Sync`), a consumer killed with SIGKILL and restarted on its directory, and
//! once per run a machine lost with its whole directory. Producer retries deliver 5%
//! of the orders twice. With replication a NATS node is also SIGKILLed and restarted
//! mid-run.
//!
//! The same schedule runs without replication, in `Async` and in `Sync`. Each
//! machine appends every deduction to a ledger outside its store directory (the
//! world's side effect, which survives the machine's loss); the report counts
//! deductions per order from the ledgers. Without replication a partition's new owner
//! has none of the old owner's marks and orders are deducted twice; with replication
//! none are, except in `Async` after a machine loss, where the count is reported
//! beside its bound: the marks the lost machine wrote since its last flush.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use idemstore::replication::{LocalCluster, NatsConfig, nats_server_binary};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const COMMIT_EVERY: u64 = 64;
const EVENT_EVERY: u64 = 300;

/// What the coordinator is asked to run.
pub struct MachinesPlan {
    pub machines: usize,
    pub partitions: u32,
    pub orders: u64,
    pub seed: u64,
    pub modes: Vec<String>,
    pub json: bool,
    pub dir: PathBuf,
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One consumer machine: its process and its directory.
struct Machine {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

struct Spawn<'a> {
    mode: &'a str,
    servers: String,
    stream: String,
    prefix: String,
}

impl Machine {
    fn start(spawn: &Spawn<'_>, dir: &Path, ledger: &Path) -> Result<Machine> {
        let mut child = Command::new(std::env::current_exe()?)
            .arg("demo-machine")
            .arg("--dir")
            .arg(dir)
            .arg("--ledger")
            .arg(ledger)
            .args(["--mode", spawn.mode])
            .args(["--servers", &spawn.servers])
            .args(["--stream", &spawn.stream])
            .args(["--prefix", &spawn.prefix])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().ok_or("no stdin")?;
        let stdout = BufReader::new(child.stdout.take().ok_or("no stdout")?);
        let mut machine = Machine {
            child,
            stdin,
            stdout,
        };
        let ready = machine.read()?;
        if ready != "READY" {
            return Err(format!("a machine did not start: {ready:?}").into());
        }
        Ok(machine)
    }

    fn read(&mut self) -> Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            return Err("a machine exited (see its message above)".into());
        }
        Ok(line.trim_end().to_string())
    }

    fn ask(&mut self, request: &str) -> Result<String> {
        writeln!(self.stdin, "{request}")?;
        self.stdin.flush()?;
        self.read()
    }

    fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn stop(mut self) -> Result<()> {
        drop(self.stdin);
        let status = self.child.wait()?;
        if !status.success() {
            return Err(format!("a machine exited with {status}").into());
        }
        Ok(())
    }
}

struct Partition {
    /// The order numbers in the partition, by offset.
    log: Vec<u64>,
    next: usize,
    committed: usize,
    owner: usize,
    /// `First` answers since the partition's last flush (the Async loss window).
    unflushed: u64,
}

/// What one run (one mode) did.
#[derive(Debug, Default)]
pub struct RunReport {
    pub mode: String,
    pub orders: u64,
    pub deliveries: u64,
    pub deducted_twice: u64,
    pub never_deducted: u64,
    pub rebalances: u64,
    pub zombie_handoffs: u64,
    pub zombie_writes_refused: u64,
    pub kills: u64,
    pub machines_lost: u64,
    /// Async: the marks the lost machines wrote since their partitions' last flush.
    pub loss_window: u64,
    pub nats_node_restarts: u64,
    pub errors: u64,
    pub restore_max_us: u64,
    pub seconds: f64,
}

impl RunReport {
    fn json(&self) -> String {
        format!(
            "{{\"mode\":\"{}\",\"orders\":{},\"deliveries\":{},\"deducted_twice\":{},\"never_deducted\":{},\"rebalances\":{},\"zombie_handoffs\":{},\"zombie_writes_refused\":{},\"kills\":{},\"machines_lost\":{},\"loss_window\":{},\"nats_node_restarts\":{},\"errors\":{},\"restore_max_us\":{},\"seconds\":{:.2}}}",
            self.mode,
            self.orders,
            self.deliveries,
            self.deducted_twice,
            self.never_deducted,
            self.rebalances,
            self.zombie_handoffs,
            self.zombie_writes_refused,
            self.kills,
            self.machines_lost,
            self.loss_window,
            self.nats_node_restarts,
            self.errors,
            self.restore_max_us,
            self.seconds
        )
    }
}

/// Runs every mode of the plan; `Ok(true)` when the replicated runs kept their
/// promise (0 twice in Sync, 0 in Async beyond the loss window).
pub fn run(plan: &MachinesPlan) -> Result<bool> {
    let replicated = plan.modes.iter().any(|m| m != "none");
    let mut cluster = None;
    if replicated {
        if nats_server_binary().is_none() {
            return Err(
                "the --machines scenario with replication needs nats-server on this machine: \
                 apt-get install nats-server (Debian), or download it from https://nats.io; \
                 or run only --modes none"
                    .into(),
            );
        }
        let started = LocalCluster::start(3)?;
        if !plan.json {
            println!(
                "started a 3-node NATS JetStream cluster on loopback: {}",
                started.urls().join(", ")
            );
        }
        cluster = Some(started);
    }
    let mut ok = true;
    let mut reports = Vec::new();
    for mode in &plan.modes {
        let cluster = if mode == "none" {
            None
        } else {
            cluster.as_mut()
        };
        let report = run_mode(plan, mode, cluster)?;
        if plan.json {
            println!("{}", report.json());
        } else {
            print_report(&report);
        }
        match mode.as_str() {
            "sync" => ok &= report.deducted_twice == 0,
            "async" => ok &= report.deducted_twice <= report.loss_window,
            _ => {}
        }
        reports.push(report);
    }
    if !plan.json {
        println!();
        for r in &reports {
            println!(
                "  {:<6} {:>6} orders deducted twice{}",
                r.mode,
                r.deducted_twice,
                match r.mode.as_str() {
                    "none" => " (no replication: each new owner has none of the marks)".to_string(),
                    "async" => format!(
                        " (after a machine loss; bound: {} marks unflushed on it)",
                        r.loss_window
                    ),
                    _ => String::new(),
                }
            );
        }
    }
    Ok(ok)
}

fn print_report(r: &RunReport) {
    println!();
    println!(
        "== replication {}: {} orders, {} deliveries in {:.1} s",
        r.mode, r.orders, r.deliveries, r.seconds
    );
    println!(
        "   {} rebalances ({} without revoke, their zombies refused {} writes), {} consumers killed -9, {} machine(s) lost with their directory, {} NATS node(s) killed -9 and restarted",
        r.rebalances,
        r.zombie_handoffs,
        r.zombie_writes_refused,
        r.kills,
        r.machines_lost,
        r.nats_node_restarts
    );
    println!(
        "   deducted twice: {}   never deducted: {}   (slowest restore {:.1} ms, {} calls answered an error and were redelivered)",
        r.deducted_twice,
        r.never_deducted,
        r.restore_max_us as f64 / 1000.0,
        r.errors
    );
}

fn run_mode(
    plan: &MachinesPlan,
    mode: &str,
    cluster: Option<&mut LocalCluster>,
) -> Result<RunReport> {
    let started = Instant::now();
    let root = plan.dir.join(format!("machines-{mode}"));
    std::fs::create_dir_all(&root)?;
    let ledgers = root.join("ledgers");
    std::fs::create_dir_all(&ledgers)?;
    let stream = format!("IDEMSTORE_DEMO_{}", mode.to_uppercase());
    let prefix = format!("idemstore.demo{mode}");
    let spawn = Spawn {
        mode,
        servers: cluster
            .as_ref()
            .map_or(String::new(), |c| c.urls().join(",")),
        stream: stream.clone(),
        prefix: prefix.clone(),
    };
    let mut cluster = cluster;
    if let Some(cluster) = cluster.as_deref() {
        // The stream is created once, before the machines open it.
        let mut config = NatsConfig::new(cluster.urls());
        config.stream = stream.clone();
        config.subject_prefix = prefix.clone();
        drop(cluster.open(&config, Duration::from_secs(30))?);
    }
    let mut rng = Rng(plan.seed);
    let mut generation = 0u64;
    let mut new_home = |m: usize| {
        generation += 1;
        (
            root.join(format!("machine-{m}.{generation}")),
            ledgers.join(format!("machine-{m}.{generation}")),
        )
    };
    // The traffic: orders spread over the partitions, 5% sent again by a producer
    // retry a little later in the same partition.
    let mut parts: Vec<Partition> = (0..plan.partitions)
        .map(|p| Partition {
            log: Vec::new(),
            next: 0,
            committed: 0,
            owner: p as usize % plan.machines,
            unflushed: 0,
        })
        .collect();
    let mut retries: Vec<(usize, u32, u64)> = Vec::new();
    for order in 0..plan.orders {
        let p = rng.below(plan.partitions as u64) as u32;
        parts[p as usize].log.push(order);
        if rng.below(100) < 5 {
            let at = parts[p as usize].log.len() + 1 + rng.below(200) as usize;
            retries.push((at, p, order));
        }
        retries.retain(|&(at, q, o)| {
            if q == p && at <= parts[p as usize].log.len() {
                parts[p as usize].log.push(o);
                false
            } else {
                true
            }
        });
    }
    for (_, p, o) in retries {
        parts[p as usize].log.push(o);
    }

    let mut homes: Vec<(PathBuf, PathBuf)> = (0..plan.machines).map(&mut new_home).collect();
    let mut machines: Vec<Option<Machine>> = Vec::new();
    for (dir, ledger) in &homes {
        machines.push(Some(Machine::start(&spawn, dir, ledger)?));
    }
    let mut report = RunReport {
        mode: mode.to_string(),
        orders: plan.orders,
        ..RunReport::default()
    };
    let assign = |machines: &mut Vec<Option<Machine>>,
                  m: usize,
                  p: u32,
                  report: &mut RunReport|
     -> Result<()> {
        for _ in 0..30 {
            let answer = machines[m]
                .as_mut()
                .ok_or("no machine")?
                .ask(&format!("A {p}"))?;
            if let Some(rest) = answer.strip_prefix("OK ") {
                let us: u64 = rest.split(' ').nth(2).unwrap_or("0").parse().unwrap_or(0);
                report.restore_max_us = report.restore_max_us.max(us);
                return Ok(());
            }
            report.errors += 1;
            std::thread::sleep(Duration::from_millis(200));
        }
        Err(format!("partition {p} could not be restored on machine {m}").into())
    };
    for p in 0..plan.partitions {
        let owner = parts[p as usize].owner;
        assign(&mut machines, owner, p, &mut report)?;
    }
    let total: usize = parts.iter().map(|p| p.log.len()).sum();
    let node_kill_at = (total / 3) as u64;
    let node_start_at = (total / 2) as u64;
    let mut killed_node = None;
    let lose_at = (total as u64 * 2) / 3;
    let mut lost = false;
    let mut since_event = 0u64;
    loop {
        let mut delivered_any = false;
        for p in 0..plan.partitions {
            let part = &mut parts[p as usize];
            if part.next >= part.log.len() {
                continue;
            }
            delivered_any = true;
            let order = part.log[part.next];
            let owner = part.owner;
            let answer = machines[owner]
                .as_mut()
                .ok_or("no machine")?
                .ask(&format!("M {p} {} {order}", part.next))?;
            report.deliveries += 1;
            if answer == "FIRST" {
                part.unflushed += 1;
            }
            if answer.starts_with("ERR") {
                // Not acted on: redelivered (the offset does not move).
                report.errors += 1;
                std::thread::sleep(Duration::from_millis(20));
            } else {
                part.next += 1;
            }
            if (part.next - part.committed) as u64 >= COMMIT_EVERY {
                commit(&mut machines, part, p, mode, &mut report)?;
            }
            since_event += 1;
        }
        if !delivered_any {
            break;
        }
        if let Some(cluster) = cluster.as_deref_mut() {
            if report.deliveries >= node_kill_at
                && killed_node.is_none()
                && report.nats_node_restarts == 0
            {
                let node = rng.below(3) as usize;
                cluster.kill_node(node);
                killed_node = Some(node);
            }
            if report.deliveries >= node_start_at
                && let Some(node) = killed_node.take()
            {
                cluster.start_node(node)?;
                report.nats_node_restarts += 1;
            }
        }
        if since_event < EVENT_EVERY {
            continue;
        }
        since_event = 0;
        let roll = rng.below(100);
        if !lost && report.deliveries >= lose_at {
            // A machine lost with its whole directory; a new machine takes its place
            // and its partitions.
            lost = true;
            let m = rng.below(plan.machines as u64) as usize;
            machines[m].take().ok_or("no machine")?.kill();
            std::fs::remove_dir_all(&homes[m].0)?;
            for part in parts.iter_mut().filter(|part| part.owner == m) {
                if mode == "async" {
                    report.loss_window += part.unflushed;
                }
                part.next = part.committed;
                part.unflushed = 0;
            }
            homes[m] = new_home(m);
            machines[m] = Some(Machine::start(&spawn, &homes[m].0, &homes[m].1)?);
            for p in 0..plan.partitions {
                if parts[p as usize].owner == m {
                    assign(&mut machines, m, p, &mut report)?;
                }
            }
            report.machines_lost += 1;
        } else if roll < 25 {
            // A consumer killed -9, restarted on its directory; its partitions come
            // back to it (a sticky assignment) from their committed offsets.
            let m = rng.below(plan.machines as u64) as usize;
            machines[m].take().ok_or("no machine")?.kill();
            for part in parts.iter_mut().filter(|part| part.owner == m) {
                part.next = part.committed;
            }
            machines[m] = Some(Machine::start(&spawn, &homes[m].0, &homes[m].1)?);
            for p in 0..plan.partitions {
                if parts[p as usize].owner == m {
                    assign(&mut machines, m, p, &mut report)?;
                }
            }
            report.kills += 1;
        } else {
            let p = rng.below(plan.partitions as u64) as u32;
            let from = parts[p as usize].owner;
            let to = (from + 1 + rng.below(plan.machines as u64 - 1) as usize) % plan.machines;
            let zombie = mode == "sync" && roll < 45;
            if zombie {
                // The old owner is not told (a network partition, a long GC pause): it
                // goes on processing one more message of the partition after the new
                // owner restored it. Its store must refuse.
                assign(&mut machines, to, p, &mut report)?;
                let part = &mut parts[p as usize];
                // The zombie's message: the next one, which nobody has processed.
                if let Some(&order) = part.log.get(part.next) {
                    let answer = machines[from]
                        .as_mut()
                        .ok_or("no machine")?
                        .ask(&format!("M {p} {} {order}", part.next))?;
                    if answer.starts_with("ERR fenced") {
                        report.zombie_writes_refused += 1;
                    }
                    report.zombie_handoffs += 1;
                }
                part.next = part.committed;
            } else {
                // The revoke callback: flush and release, commit; then the assignment.
                let answer = machines[from]
                    .as_mut()
                    .ok_or("no machine")?
                    .ask(&format!("R {p}"))?;
                let part = &mut parts[p as usize];
                if answer == "OK" {
                    part.committed = part.next;
                    part.unflushed = 0;
                } else {
                    report.errors += 1;
                    part.next = part.committed;
                }
                assign(&mut machines, to, p, &mut report)?;
            }
            parts[p as usize].owner = to;
            report.rebalances += 1;
        }
    }
    for machine in machines.into_iter().flatten() {
        machine.stop()?;
    }
    if let (Some(cluster), Some(node)) = (cluster, killed_node) {
        cluster.start_node(node)?;
    }
    let (twice, never) = count_deductions(&ledgers, plan.orders)?;
    report.deducted_twice = twice;
    report.never_deducted = never;
    report.seconds = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Commits the partition's offsets, after a flush in Async (and Sync: a no-op wait).
fn commit(
    machines: &mut [Option<Machine>],
    part: &mut Partition,
    p: u32,
    mode: &str,
    report: &mut RunReport,
) -> Result<()> {
    if mode != "none" {
        let answer = machines[part.owner]
            .as_mut()
            .ok_or("no machine")?
            .ask(&format!("F {p}"))?;
        if answer != "OK" {
            report.errors += 1;
            return Ok(());
        }
    }
    part.committed = part.next;
    part.unflushed = 0;
    Ok(())
}

/// Deductions per order, from every ledger: (orders deducted more than once, orders
/// never deducted).
fn count_deductions(ledgers: &Path, orders: u64) -> Result<(u64, u64)> {
    let mut counts: HashMap<u64, u32> = HashMap::new();
    for entry in std::fs::read_dir(ledgers)? {
        let text = std::fs::read_to_string(entry?.path())?;
        // Only whole lines count (each is one write, but be strict).
        let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        for line in whole.lines() {
            if let Ok(order) = line.parse::<u64>() {
                *counts.entry(order).or_default() += 1;
            }
        }
    }
    let twice = counts.values().filter(|&&n| n > 1).count() as u64;
    let never = (0..orders).filter(|o| !counts.contains_key(o)).count() as u64;
    Ok((twice, never))
}
