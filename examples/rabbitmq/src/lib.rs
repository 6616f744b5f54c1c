//! What the consumer and the publisher of the RabbitMQ example share: the queue
//! topology, the message format, and the stock ledger (the side effect).
//!
//! The interesting part, idemstore's claim lifecycle around a manual ack, is in
//! `src/bin/consumer.rs`.

use std::sync::mpsc;

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Queue};

/// The broker to use when `AMQP_ADDR` is not set.
pub const DEFAULT_AMQP_ADDR: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// The queue to use when `ORDERS_QUEUE` is not set.
pub const DEFAULT_QUEUE: &str = "orders";

/// `AMQP_ADDR`, or [`DEFAULT_AMQP_ADDR`].
pub fn amqp_addr() -> String {
    std::env::var("AMQP_ADDR").unwrap_or_else(|_| DEFAULT_AMQP_ADDR.to_string())
}

/// `ORDERS_QUEUE`, or [`DEFAULT_QUEUE`].
pub fn queue_name() -> String {
    std::env::var("ORDERS_QUEUE").unwrap_or_else(|_| DEFAULT_QUEUE.to_string())
}

/// The dead-letter queue of `queue`: where the consumer rejects the messages it gives
/// up on (idemstore's `Begin::Exhausted`).
pub fn dead_letter_queue(queue: &str) -> String {
    format!("{queue}.dead-letter")
}

/// Declares `queue` (durable) and its dead-letter queue; idempotent, so the publisher
/// and every consumer start call it. A message the consumer rejects without requeue
/// goes through the default exchange to the dead-letter queue.
pub async fn declare_queues(channel: &Channel, queue: &str) -> lapin::Result<Queue> {
    let dead_letter = dead_letter_queue(queue);
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(dead_letter.as_str().into(), durable, FieldTable::default())
        .await?;
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    arguments.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString(dead_letter.as_str().into()),
    );
    channel
        .queue_declare(queue.into(), durable, arguments)
        .await
}

/// The id of order `n`, which the publisher sets as the message's `message_id`: the
/// key the consumer deduplicates on. (Never the delivery tag: it changes on every
/// redelivery.)
pub fn order_id(n: u64) -> String {
    format!("order-{n:07}")
}

/// An "order created" message body: `sku=<sku> qty=<quantity>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Order {
    pub sku: u32,
    pub quantity: u32,
}

impl Order {
    /// The order the publisher sends for order number `n`.
    pub fn for_number(n: u64) -> Order {
        Order {
            sku: (n % 50) as u32,
            quantity: (n % 5) as u32 + 1,
        }
    }

    pub fn to_body(self) -> Vec<u8> {
        format!("sku={} qty={}", self.sku, self.quantity).into_bytes()
    }

    /// `None` for a body that is not an order (a poison message).
    pub fn parse(body: &[u8]) -> Option<Order> {
        let text = std::str::from_utf8(body).ok()?;
        let (sku, quantity) = text.split_once(' ')?;
        Some(Order {
            sku: sku.strip_prefix("sku=")?.parse().ok()?,
            quantity: quantity.strip_prefix("qty=")?.parse().ok()?,
        })
    }
}

/// The stock ledger: the consumer's side effect, standing in for the inventory
/// database. One line per deduction, `<order id> sku=<sku> qty=<quantity>\n`, appended
/// with a single `write` and made durable with `fsync` before the consumer goes on.
/// It lives outside idemstore and outside the consumer process, so after any crash
/// the number of lines per order id says how many times the stock was deducted.
///
/// Only one consumer process appends at a time (the idemstore directory it also
/// opens is locked to one process).
pub struct Ledger {
    path: PathBuf,
    file: File,
}

impl Ledger {
    /// Opens (or creates) the ledger. A last line without its `\n` — a process killed
    /// inside its `write` — is not a deduction; it is cut so the next append starts
    /// on a line of its own.
    pub fn open(path: impl AsRef<Path>) -> io::Result<Ledger> {
        let path = path.as_ref().to_path_buf();
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if complete < bytes.len() {
            file.set_len(complete as u64)?;
            file.sync_all()?;
        }
        file.seek(SeekFrom::End(0))?;
        Ok(Ledger { path, file })
    }

    /// Deducts the order's stock: one line, one `write`, then `fsync`.
    pub fn deduct(&mut self, order_id: &str, order: Order) -> io::Result<()> {
        self.deduct_many(&[deduction_line(order_id, order)])
    }

    /// Deducts several orders with one `write` of their lines and one `fsync`: the
    /// ledger's group commit (see [`LedgerWriter`]).
    pub fn deduct_many(&mut self, lines: &[String]) -> io::Result<()> {
        self.file.write_all(lines.concat().as_bytes())?;
        self.file.sync_data()
    }

    /// Whether the ledger holds a deduction for `order_id`. In a real service this is
    /// the query "is there a stock movement for this order?"; the consumer asks it
    /// only for the few deliveries a crash may have left half done.
    pub fn contains(&self, order_id: &str) -> io::Result<bool> {
        ledger_contains(&self.path, order_id)
    }
}

/// The ledger line of one deduction.
fn deduction_line(order_id: &str, order: Order) -> String {
    format!("{order_id} sku={} qty={}\n", order.sku, order.quantity)
}

/// The ledger behind a group commit, for a consumer with many deliveries in flight:
/// a thread of its own owns the [`Ledger`], takes every deduction queued since its
/// last round, writes their lines with one `write`, makes them durable with one
/// `fsync`, and only then answers each [`deduct`](LedgerWriter::deduct) future. The
/// async consumer never blocks its executor on the ledger's fsync, and one fsync
/// covers as many deductions as are in flight — the same shape as idemstore's own
/// group commit under `Durability::Immediate`.
///
/// A deduction whose future has resolved is on disk. One whose future has not may be
/// on disk or not (a crash mid-round): the consumer treats it as unknown, which is why
/// it consults the ledger for a claim's later attempts.
pub struct LedgerWriter {
    path: PathBuf,
    requests: Option<mpsc::Sender<(String, tokio::sync::oneshot::Sender<io::Result<()>>)>>,
    thread: Option<std::thread::JoinHandle<()>>,
    rounds: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl LedgerWriter {
    /// Opens the ledger at `path` (as [`Ledger::open`]) and starts its writer thread.
    pub fn open(path: impl AsRef<Path>) -> io::Result<LedgerWriter> {
        let mut ledger = Ledger::open(path)?;
        let path = ledger.path.clone();
        let (requests, queue) =
            mpsc::channel::<(String, tokio::sync::oneshot::Sender<io::Result<()>>)>();
        let rounds = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = std::sync::Arc::clone(&rounds);
        let thread = std::thread::Builder::new()
            .name("ledger-writer".into())
            .spawn(move || {
                // Ends when every sender is gone and the queue is drained.
                while let Ok(first) = queue.recv() {
                    let round: Vec<_> = std::iter::once(first).chain(queue.try_iter()).collect();
                    let lines: Vec<String> = round.iter().map(|(line, _)| line.clone()).collect();
                    let written = ledger.deduct_many(&lines);
                    counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    for (_, answer) in round {
                        let result = match &written {
                            Ok(()) => Ok(()),
                            Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
                        };
                        // A deduction whose caller has gone (its future dropped) is
                        // on disk all the same; nobody is told.
                        let _ = answer.send(result);
                    }
                }
            })?;
        Ok(LedgerWriter {
            path,
            requests: Some(requests),
            thread: Some(thread),
            rounds,
        })
    }

    /// Deducts the order's stock; resolves once its line is on disk (fsynced), with
    /// the error of the round's `write` or `fsync` if either failed.
    pub async fn deduct(&self, order_id: &str, order: Order) -> io::Result<()> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let stopped = || io::Error::other("the ledger writer has stopped");
        self.requests
            .as_ref()
            .ok_or_else(stopped)?
            .send((deduction_line(order_id, order), answer))
            .map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }

    /// Whether the ledger holds a deduction for `order_id` (see [`Ledger::contains`]).
    /// Every deduction whose future has resolved is seen.
    pub fn contains(&self, order_id: &str) -> io::Result<bool> {
        ledger_contains(&self.path, order_id)
    }

    /// Write-and-fsync rounds so far: deductions per round is the group commit's gain.
    pub fn rounds(&self) -> u64 {
        self.rounds.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for LedgerWriter {
    /// Lets the writer finish the deductions queued so far, then joins it.
    fn drop(&mut self) {
        drop(self.requests.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Whether the ledger at `path` holds a deduction for `order_id`.
fn ledger_contains(path: &Path, order_id: &str) -> io::Result<bool> {
    Ok(read_deductions(path)?
        .iter()
        .any(|line| line.order_id == order_id))
}

/// One line of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deduction {
    pub order_id: String,
    pub order: Order,
}

/// Every complete line of the ledger at `path` (a torn last line is not one).
pub fn read_deductions(path: &Path) -> io::Result<Vec<Deduction>> {
    let bytes = std::fs::read(path)?;
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    let text = std::str::from_utf8(&bytes[..complete])
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    text.lines()
        .map(|line| {
            let (order_id, body) = line.split_once(' ').unwrap_or((line, ""));
            let order = Order::parse(body.as_bytes()).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: {line:?} is not a deduction", path.display()),
                )
            })?;
            Ok(Deduction {
                order_id: order_id.to_string(),
                order,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_round_trip_and_poison_does_not_parse() {
        let order = Order::for_number(123);
        assert_eq!(Order::parse(&order.to_body()), Some(order));
        assert_eq!(Order::parse(b"not an order"), None);
        assert_eq!(order_id(42), "order-0000042");
    }

    #[test]
    fn the_ledger_cuts_a_torn_last_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.log");
        let mut ledger = Ledger::open(&path).unwrap();
        ledger.deduct("order-1", Order::for_number(1)).unwrap();
        ledger.file.write_all(b"order-2 sku=").unwrap();
        assert_eq!(read_deductions(&path).unwrap().len(), 1);
        drop(ledger);
        let mut ledger = Ledger::open(&path).unwrap();
        ledger.deduct("order-3", Order::for_number(3)).unwrap();
        let ids: Vec<_> = read_deductions(&path)
            .unwrap()
            .into_iter()
            .map(|d| d.order_id)
            .collect();
        assert_eq!(ids, ["order-1", "order-3"]);
        assert!(ledger.contains("order-3").unwrap());
        assert!(!ledger.contains("order-2").unwrap());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn the_writer_answers_after_the_line_is_written_and_shares_rounds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ledger.log");
        let writer = LedgerWriter::open(&path).unwrap();
        let ids: Vec<String> = (1..=200).map(order_id).collect();
        let deductions = ids.iter().map(|id| writer.deduct(id, Order::for_number(1)));
        for result in join_all(deductions.collect()).await {
            result.unwrap();
        }
        // Every resolved deduction is readable, once.
        let lines = read_deductions(&path).unwrap();
        assert_eq!(lines.len(), 200);
        assert!(writer.contains(&order_id(200)).unwrap());
        // All 200 were queued in one pass before any answer could come back, so the
        // writer took several in a round: a writer without a group commit does 200.
        assert!(writer.rounds() < 200, "{} rounds", writer.rounds());
        drop(writer);
        assert_eq!(read_deductions(&path).unwrap().len(), 200);
    }

    /// Polls every future to completion together (the test's own `join_all`).
    async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
        let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
        let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
        std::future::poll_fn(|cx| {
            let mut pending = false;
            for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
                if output.is_none() {
                    match future.as_mut().poll(cx) {
                        std::task::Poll::Ready(value) => *output = Some(value),
                        std::task::Poll::Pending => pending = true,
                    }
                }
            }
            if pending {
                std::task::Poll::Pending
            } else {
                std::task::Poll::Ready(())
            }
        })
        .await;
        outputs.into_iter().map(Option::unwrap).collect()
    }
}
