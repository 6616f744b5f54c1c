//! The at-least-once broker: the traffic, and the delivery loop that runs it through a
//! succession of consumer processes, redelivering the way real brokers do.
//!
//! - **Producer retries**: some orders are published twice (the second copy a few
//!   messages later), as a producer that timed out waiting for its publish ack does.
//! - **Lost acks**: the broker drops the ack of some messages and redelivers them a
//!   little later, as after a network blip or a visibility timeout.
//! - **Crashes**: at each crash point the broker waits until the consumer has handled
//!   part of the batch, then kills the process with SIGKILL. Whatever it did stays
//!   done; nothing of the batch was acked, so all of it goes to the next consumer.
//! - **Rebalances**: the consumer handles the whole batch and acks it, but the broker
//!   refuses the ack (the group's generation moved on, like Kafka's
//!   `CommitFailedException`), revokes the partition, and a new consumer process
//!   takes it over and gets the batch again.
//!
//! The traffic, the lost acks and the crash and rebalance points come from one seed,
//! so both passes of the demo see the same traffic; where exactly a SIGKILL lands is
//! up to the scheduler.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use super::consumer::LEASE;
use super::protocol::{Order, Reply, Verdict, delivery_line};
use crate::progress::Progress;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// How many SKUs the orders draw from.
const SKUS: u64 = 20;
/// Largest quantity in one order.
const QUANTITY_MAX: u64 = 5;
/// A producer retry lands this many messages after the original, at most.
const PRODUCER_RETRY_GAP_MAX: u64 = 64;
/// A message whose ack was lost comes back after this many others, at most.
const REDELIVERY_GAP_MAX: u64 = 256;
/// After the crash point, the consumer runs up to this long before the SIGKILL.
const KILL_JITTER_US_MAX: u64 = 300;
/// Batches in a row in which every message was nacked before the broker gives up.
const STUCK_BATCHES_MAX: u32 = 1_000;

/// A small deterministic generator (SplitMix64): the traffic needs repeatability,
/// not a dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0; the modulo bias is irrelevant here).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// Something the broker does to a consumer at a given point of the traffic.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event {
    /// SIGKILL the consumer once it has handled this fraction of the batch.
    Crash { fraction: f64 },
    /// Refuse the batch's ack and hand the partition to a new consumer.
    Rebalance,
}

/// Everything both passes share.
#[derive(Debug)]
pub struct Traffic {
    pub orders: u32,
    /// The published messages, in partition order (producer retries included).
    pub stream: Vec<Order>,
    pub producer_retries: u64,
    /// Per published message: the broker loses its first ack.
    pub lose_first_ack: Vec<bool>,
    /// `(delivery number, event)`: the event hits the batch holding that delivery.
    pub events: Vec<(u64, Event)>,
    pub seed: u64,
}

impl Traffic {
    /// `orders` orders; each is duplicated with probability `dup_rate`, half the time by
    /// a producer retry and half by a lost ack.
    pub fn generate(
        orders: u32,
        dup_rate: f64,
        crashes: u32,
        rebalances: u32,
        seed: u64,
    ) -> Traffic {
        let mut rng = Rng::new(seed);
        let mut keyed: Vec<(u64, Order)> = Vec::with_capacity(orders as usize + 16);
        let mut producer_retries = 0;
        for number in 1..=orders {
            let order = Order {
                number,
                sku: rng.below(SKUS) as u16 + 1,
                quantity: rng.below(QUANTITY_MAX) as u32 + 1,
            };
            // Sort keys: the original at 2n, a retry a few places later at an odd key.
            let position = 2 * u64::from(number);
            keyed.push((position, order));
            if rng.chance(dup_rate / 2.0) {
                producer_retries += 1;
                keyed.push((
                    position + 2 * (1 + rng.below(PRODUCER_RETRY_GAP_MAX)) + 1,
                    order,
                ));
            }
        }
        keyed.sort_by_key(|&(key, _)| key);
        let stream: Vec<Order> = keyed.into_iter().map(|(_, order)| order).collect();
        let lose_first_ack = stream.iter().map(|_| rng.chance(dup_rate / 2.0)).collect();

        let mut kinds: Vec<Event> = (0..crashes)
            .map(|_| Event::Crash {
                fraction: 0.1 + 0.8 * (rng.below(1000) as f64 / 1000.0),
            })
            .chain((0..rebalances).map(|_| Event::Rebalance))
            .collect();
        for i in (1..kinds.len()).rev() {
            kinds.swap(i, rng.below(i as u64 + 1) as usize);
        }
        // Spread the events evenly over the published stream, with some jitter.
        let len = stream.len() as u64;
        let spacing = len / (kinds.len() as u64 + 1);
        let events = kinds
            .into_iter()
            .enumerate()
            .map(|(i, event)| {
                let jitter = rng.below(spacing / 2 + 1);
                let at = (spacing * (i as u64 + 1) + jitter).saturating_sub(spacing / 4);
                (at.min(len.saturating_sub(1)), event)
            })
            .collect();
        Traffic {
            orders,
            stream,
            producer_retries,
            lose_first_ack,
            events,
            seed,
        }
    }

    pub fn crashes(&self) -> usize {
        self.events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Crash { .. }))
            .count()
    }

    pub fn rebalances(&self) -> usize {
        self.events.len() - self.crashes()
    }
}

/// Where one pass keeps its side effects, and whether its consumers use idemstore.
#[derive(Debug, Clone)]
pub struct Pass {
    pub label: &'static str,
    pub ledger_dir: PathBuf,
    pub store_dir: Option<PathBuf>,
    pub batch_len: usize,
}

/// What the broker saw in one pass.
#[derive(Debug, Default)]
pub struct PassReport {
    pub deliveries: u64,
    /// Per [`Verdict::ALL`] index: how many deliveries got that verdict.
    pub verdicts: [u64; 6],
    pub lost_acks: u64,
    pub crashes: u64,
    pub rebalances: u64,
    pub consumers: u32,
    /// Orders that a consumer re-acquired after a kill (attempt > 1).
    pub retried_orders: Vec<(u32, Verdict)>,
    /// The longest recovery of a consumer reopening the store, and its record count.
    pub slowest_recovery: Option<(Duration, u64)>,
    pub wall_time: Duration,
    /// Of the wall time, how long consumers took to stop and start (process start,
    /// store recovery): the broker delivers nothing meanwhile.
    pub restart_time: Duration,
    /// The clock offset of the last consumer (to reopen the store afterwards).
    pub clock_offset_ms: u64,
}

impl PassReport {
    pub fn count(&self, verdict: Verdict) -> u64 {
        self.verdicts[verdict.index()]
    }

    fn record(&mut self, traffic: &Traffic, tag: u32, verdict: Verdict) {
        self.verdicts[verdict.index()] += 1;
        if matches!(verdict, Verdict::Reconciled | Verdict::DeductedOnRetry) {
            self.retried_orders
                .push((traffic.stream[tag as usize].number, verdict));
        }
    }
}

/// A running consumer process.
struct Consumer {
    name: String,
    child: Child,
    stdin: Option<BufWriter<ChildStdin>>,
    stdout: BufReader<ChildStdout>,
    line: String,
}

impl Consumer {
    fn spawn(
        exe: &Path,
        pass: &Pass,
        name: String,
        clock_offset_ms: u64,
    ) -> Result<(Consumer, Reply)> {
        let mut command = Command::new(exe);
        command
            .arg("demo-consumer")
            .arg("--name")
            .arg(&name)
            .arg("--ledger")
            .arg(&pass.ledger_dir)
            .arg("--clock-offset-ms")
            .arg(clock_offset_ms.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(store) = &pass.store_dir {
            command.arg("--store").arg(store);
        }
        let mut child = command
            .spawn()
            .map_err(|e| format!("starting consumer process {}: {e}", exe.display()))?;
        let stdin = child.stdin.take().map(BufWriter::new);
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped"));
        let mut consumer = Consumer {
            name,
            child,
            stdin,
            stdout,
            line: String::new(),
        };
        let ready = consumer.expect_reply()?;
        if !matches!(ready, Reply::Ready { .. }) {
            return Err(format!("{}: expected READY, got {ready:?}", consumer.name).into());
        }
        Ok((consumer, ready))
    }

    fn send_batch(&mut self, traffic: &Traffic, batch: &[u32]) -> Result<()> {
        let stdin = self.stdin.as_mut().expect("stdin is open until stop");
        for &tag in batch {
            stdin.write_all(delivery_line(tag, &traffic.stream[tag as usize]).as_bytes())?;
        }
        stdin.write_all(b"E\n")?;
        stdin.flush()?;
        Ok(())
    }

    /// The next reply; `None` at end of output.
    fn reply(&mut self) -> Result<Option<Reply>> {
        self.line.clear();
        if self.stdout.read_line(&mut self.line)? == 0 {
            return Ok(None);
        }
        Reply::parse(&self.line)
            .map(Some)
            .ok_or_else(|| format!("{}: bad reply {:?}", self.name, self.line).into())
    }

    fn expect_reply(&mut self) -> Result<Reply> {
        match self.reply()? {
            Some(reply) => Ok(reply),
            None => {
                let status = self.child.wait()?;
                Err(format!("consumer {} stopped unexpectedly ({status})", self.name).into())
            }
        }
    }

    /// SIGKILL, then every reply the process wrote before it died.
    fn kill(mut self) -> Result<Vec<Reply>> {
        self.child.kill()?;
        self.child.wait()?;
        let mut rest = Vec::new();
        while let Some(reply) = self.reply()? {
            rest.push(reply);
        }
        Ok(rest)
    }

    /// Closes stdin (the consumer closes its store and exits) and waits for it.
    fn stop(mut self) -> Result<()> {
        drop(self.stdin.take());
        if let Some(reply) = self.reply()? {
            return Err(format!("{}: unexpected {reply:?} after stop", self.name).into());
        }
        let status = self.child.wait()?;
        if !status.success() {
            return Err(format!("consumer {} failed ({status})", self.name).into());
        }
        Ok(())
    }
}

/// Runs the whole traffic through consumer processes started from `exe`.
pub fn run(exe: &Path, traffic: &Traffic, pass: &Pass) -> Result<PassReport> {
    let started = Instant::now();
    let mut report = PassReport::default();
    let mut rng = Rng::new(traffic.seed ^ 0x5EED);
    let mut progress = Progress::new(pass.label, traffic.stream.len() as u64);
    let mut pending: VecDeque<u32> = (0..traffic.stream.len() as u32).collect();
    let mut lose_first_ack = traffic.lose_first_ack.clone();
    let mut events = traffic.events.iter().copied().peekable();
    let mut acked: u64 = 0;
    let mut stuck_batches = 0;
    let mut clock_offset_ms = 0;
    let lease_ms = LEASE.as_millis() as u64;

    let start_consumer = |report: &mut PassReport, clock_offset_ms: u64| -> Result<Consumer> {
        let started = Instant::now();
        report.consumers += 1;
        let name = format!("consumer-{}", report.consumers);
        let (consumer, ready) = Consumer::spawn(exe, pass, name, clock_offset_ms)?;
        if let Reply::Ready {
            records_replayed,
            recovery_us,
        } = ready
        {
            let recovery = Duration::from_micros(recovery_us);
            if report
                .slowest_recovery
                .is_none_or(|(slowest, _)| recovery > slowest)
            {
                report.slowest_recovery = Some((recovery, records_replayed));
            }
        }
        report.restart_time += started.elapsed();
        Ok(consumer)
    };
    let mut consumer = start_consumer(&mut report, clock_offset_ms)?;

    while !pending.is_empty() {
        let len = pass.batch_len.min(pending.len());
        let batch: Vec<u32> = pending.drain(..len).collect();
        let event = events
            .next_if(|&(at, _)| report.deliveries + len as u64 > at)
            .map(|(_, event)| event);
        report.deliveries += len as u64;
        consumer.send_batch(traffic, &batch)?;
        match event {
            Some(Event::Crash { fraction }) => {
                // Kill mid-batch: after the consumer has handled some messages, before
                // it acks. The kill lands wherever the consumer is by then.
                let kill_after = ((len as f64 * fraction) as usize).clamp(1, len.max(2) - 1);
                let mut handled = 0;
                while handled < kill_after {
                    match consumer.expect_reply()? {
                        Reply::Processed { tag, verdict } => {
                            report.record(traffic, tag, verdict);
                            handled += 1;
                        }
                        Reply::Ack => break,
                        Reply::Ready { .. } => return Err("READY twice".into()),
                    }
                }
                // The consumer runs in lockstep with this loop (each reply wakes it),
                // so killing at once would always land between two messages. Let it
                // run a random little while longer: the kill lands anywhere, including
                // between a claim's `begin` and its `complete`.
                std::thread::sleep(Duration::from_micros(rng.below(KILL_JITTER_US_MAX)));
                let rest = consumer.kill()?;
                for reply in rest {
                    if let Reply::Processed { tag, verdict } = reply {
                        report.record(traffic, tag, verdict);
                    }
                }
                report.crashes += 1;
                // Nothing of the batch was acked: all of it is redelivered first.
                for &tag in batch.iter().rev() {
                    pending.push_front(tag);
                }
                // The restart takes time (a lease's worth); the killed consumer's claims
                // are released by the new consumer's open whatever the clock says.
                clock_offset_ms += lease_ms + 1_000;
                consumer = start_consumer(&mut report, clock_offset_ms)?;
            }
            Some(Event::Rebalance) => {
                loop {
                    match consumer.expect_reply()? {
                        Reply::Processed { tag, verdict } => report.record(traffic, tag, verdict),
                        Reply::Ack => break,
                        Reply::Ready { .. } => return Err("READY twice".into()),
                    }
                }
                // The ack arrives after the group moved on: refused. The partition
                // goes to a new consumer, which gets the whole batch again.
                let stopping = Instant::now();
                consumer.stop()?;
                report.restart_time += stopping.elapsed();
                report.rebalances += 1;
                for &tag in batch.iter().rev() {
                    pending.push_front(tag);
                }
                consumer = start_consumer(&mut report, clock_offset_ms)?;
            }
            None => {
                let mut handled = Vec::with_capacity(len);
                loop {
                    match consumer.expect_reply()? {
                        Reply::Processed { tag, verdict } => {
                            report.record(traffic, tag, verdict);
                            handled.push((tag, verdict));
                        }
                        Reply::Ack => break,
                        Reply::Ready { .. } => return Err("READY twice".into()),
                    }
                }
                if handled.len() != len || handled.iter().zip(&batch).any(|((a, _), b)| a != b) {
                    return Err(
                        format!("{}: the replies do not match the batch", consumer.name).into(),
                    );
                }
                let mut progressed = false;
                for (tag, verdict) in handled {
                    if verdict == Verdict::Nacked {
                        pending.push_back(tag);
                    } else if std::mem::take(&mut lose_first_ack[tag as usize]) {
                        report.lost_acks += 1;
                        let gap = 16 + rng.below(REDELIVERY_GAP_MAX) as usize;
                        pending.insert(gap.min(pending.len()), tag);
                    } else {
                        acked += 1;
                        progressed = true;
                    }
                }
                stuck_batches = if progressed { 0 } else { stuck_batches + 1 };
                if stuck_batches > STUCK_BATCHES_MAX {
                    return Err("no progress: every delivery was nacked for too long".into());
                }
            }
        }
        progress.set(
            acked,
            &format!(
                "{} deliveries, kills {}/{}, rebalances {}/{}",
                super::thousands(report.deliveries),
                report.crashes,
                traffic.crashes(),
                report.rebalances,
                traffic.rebalances()
            ),
        );
    }
    consumer.stop()?;
    report.wall_time = started.elapsed();
    report.clock_offset_ms = clock_offset_ms;
    progress.finish(&format!(
        "{} deliveries to {} consumer processes in {:.2} s",
        super::thousands(report.deliveries),
        report.consumers,
        report.wall_time.as_secs_f64()
    ));
    Ok(report)
}
