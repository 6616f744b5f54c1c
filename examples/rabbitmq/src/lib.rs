//! What the consumer and the publisher of the RabbitMQ example share: the queue
//! topology, the message format, and the stock ledger (the side effect).
//!
//! The interesting part, idemstore's claim lifecycle around a manual ack, is in
//! `src/bin/consumer.rs`.

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
        let line = format!("{order_id} sku={} qty={}\n", order.sku, order.quantity);
        self.file.write_all(line.as_bytes())?;
        self.file.sync_data()
    }

    /// Whether the ledger holds a deduction for `order_id`. In a real service this is
    /// the query "is there a stock movement for this order?"; the consumer asks it
    /// only for the few deliveries a crash may have left half done.
    pub fn contains(&self, order_id: &str) -> io::Result<bool> {
        Ok(read_deductions(&self.path)?
            .iter()
            .any(|line| line.order_id == order_id))
    }
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
}
