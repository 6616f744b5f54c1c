//! An inventory consumer of RabbitMQ with manual acks, whose side effect — deducting
//! stock, one fsynced line in a ledger file per order — happens exactly once per order
//! although RabbitMQ delivers at least once.
//!
//! Every delivery goes through idemstore's claim lifecycle, keyed by the message's
//! `message_id` (the order id the publisher set; never the delivery tag, which
//! changes on every redelivery):
//!
//! | `begin(order id)`       | the consumer                                  | RabbitMQ          |
//! |-------------------------|-----------------------------------------------|-------------------|
//! | `Acquired(claim)`       | deducts, then `claim.complete(result)`        | ack (batched)     |
//! | `Completed(record)`     | nothing: the order was deducted before        | ack (batched)     |
//! | `InProgress(record)`    | nothing yet: a claim holds a live lease       | nack + requeue once the lease has run out |
//! | `Exhausted(record)`     | nothing: failed for good, or out of attempts  | reject, no requeue: dead-lettered |
//!
//! A poison message (a body that is not an order) is `claim.fail()`ed and dead-lettered;
//! a side effect that fails is `claim.release()`d and requeued, and after
//! `MAX_ATTEMPTS` acquisitions that never completed the order is `Exhausted`.
//!
//! Acks are sent in batches (`multiple: true`), after the claims they cover are
//! complete. A crash or a lost ack therefore leaves deliveries that were processed but
//! not acked; RabbitMQ redelivers them and `begin` answers `Completed`.
//!
//! Configuration, from the environment: `AMQP_ADDR`
//! (`amqp://guest:guest@127.0.0.1:5672/%2f`), `ORDERS_QUEUE` (`orders`),
//! `IDEMSTORE_DIR` (`data/idemstore`), `LEDGER_FILE` (`data/ledger.log`),
//! `LEASE_SECS` (30), `PREFETCH` (100), `ACK_BATCH` (50). Stops cleanly on SIGTERM or
//! Ctrl-C. Prints one line per delivery and per ack batch on stdout.

use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::str::FromStr;
use std::time::Duration;

use futures_lite::StreamExt;
use idemstore::{Begin, Clock, Durability, Namespace, Policy, Store, SystemClock, UnixMs};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::FieldTable;
use lapin::{Acker, Connection, ConnectionProperties};
use tokio::signal::unix::{SignalKind, signal};

use idemstore_rabbitmq_example::{Ledger, Order, amqp_addr, declare_queues, queue_name};

/// The business type the consumer deduplicates under.
const NAMESPACE: &str = "inventory-deduct";
/// How long an order id is remembered: longer than a message can wait in the queue
/// and still be redelivered.
const TTL: Duration = Duration::from_secs(48 * 3600);
/// Acquisitions of an order that never completed before it is dead-lettered.
const MAX_ATTEMPTS: u32 = 5;
/// With no delivery for this long, the consumer acks what it has done.
const IDLE: Duration = Duration::from_millis(200);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("consumer: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run() -> Result<()> {
    let settings = Settings::from_env()?;
    let queue = queue_name();

    // One store per consumer process: idemstore is embedded, and a second process
    // opening the same directory gets `Error::Locked`.
    //
    // `Durability::Immediate`: `begin` and `complete` return only once their record is
    // on disk. The ledger line is fsynced too, so even after a power cut the store
    // never knows less than the ledger: a `begin` lost after its deduction reached the
    // disk would come back as attempt 1 and deduct again. (The default,
    // `Interval(100 ms)`, is safe against kill -9 but not against a power cut.)
    let store = Store::builder(&settings.store_dir)
        .durability(Durability::Immediate)
        .open()?;
    let inventory = store.namespace(
        NAMESPACE,
        Policy::ttl(TTL)
            .lease(settings.lease)
            .max_attempts(MAX_ATTEMPTS),
    )?;
    if let Some(parent) = settings.ledger_path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut ledger = Ledger::open(&settings.ledger_path)?;
    println!(
        "ready store={} records_replayed={} ledger={}",
        settings.store_dir.display(),
        store.stats().records_replayed,
        settings.ledger_path.display()
    );

    let connection = Connection::connect(&amqp_addr(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    declare_queues(&channel, &queue).await?;
    channel
        .basic_qos(settings.prefetch, BasicQosOptions::default())
        .await?;
    // `no_ack: false` (the default): manual acks.
    let mut deliveries = channel
        .basic_consume(
            queue.as_str().into(),
            "inventory".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;

    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut acks = AckBatch::default();
    let mut deducted = 0u64;
    let mut busy = false;
    loop {
        let next = tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            next = tokio::time::timeout(IDLE, deliveries.next()) => next,
        };
        let delivery = match next {
            Err(_idle) => {
                if busy {
                    acks.send().await?;
                    println!("idle");
                    busy = false;
                }
                continue;
            }
            Ok(None) => break, // the broker cancelled the consumer
            Ok(Some(delivery)) => delivery?,
        };
        busy = true;
        let Some(id) = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
        else {
            // No key, no deduplication: nothing can process it safely.
            println!(
                "delivery id=- redelivered={} outcome=no-message-id",
                delivery.redelivered
            );
            delivery
                .reject(BasicRejectOptions { requeue: false })
                .await?;
            continue;
        };

        let settle = handle(&inventory, &mut ledger, &id, &delivery.data)?;
        let outcome = match &settle {
            Settle::Ack(outcome) | Settle::Requeue(outcome) | Settle::DeadLetter(outcome) => {
                outcome
            }
            Settle::RequeueAfter(_) => "in-progress",
        };
        println!(
            "delivery id={id} redelivered={} outcome={outcome}",
            delivery.redelivered
        );
        match settle {
            Settle::Ack(outcome) => {
                if outcome == "deducted" {
                    deducted += 1;
                }
                acks.push(id, delivery.acker);
                if acks.len() >= settings.ack_batch {
                    acks.send().await?;
                }
            }
            Settle::RequeueAfter(lease_until) => {
                // Another claim holds a live lease: only this process can have taken
                // it (a killed predecessor's claims are released when the store
                // opens). Requeueing at once would make RabbitMQ hand the message
                // straight back, over and over until the lease ran out; instead wait
                // it out (at most one lease), then requeue.
                acks.send().await?;
                let wait = lease_until.0.saturating_sub(SystemClock.now().0) + 50;
                tokio::time::sleep(Duration::from_millis(wait)).await;
                delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    })
                    .await?;
            }
            Settle::Requeue(_) => {
                delivery
                    .nack(BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    })
                    .await?;
            }
            Settle::DeadLetter(_) => {
                // Rejected without requeue: the queue's dead-letter exchange routes it
                // to the dead-letter queue.
                delivery
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
            }
        }
    }

    // Clean stop: ack what is done; what is not is requeued when the channel closes.
    acks.send().await?;
    channel.close(200, "consumer stopping".into()).await?;
    connection.close(200, "consumer stopping".into()).await?;
    store.close()?;
    println!("stopped deducted={deducted}");
    Ok(())
}

/// What to tell RabbitMQ about one delivery.
enum Settle {
    /// Done, now or before: ack it (in the next batch).
    Ack(&'static str),
    /// A live lease holds the order until then: requeue it once the lease has run out.
    RequeueAfter(UnixMs),
    /// The side effect failed and the claim was released: requeue it to try again.
    Requeue(&'static str),
    /// Never to be processed: reject it without requeue, to the dead-letter queue.
    DeadLetter(&'static str),
}

/// One delivery through the claim lifecycle: `begin` → deduct → `complete`.
fn handle(inventory: &Namespace, ledger: &mut Ledger, id: &str, body: &[u8]) -> Result<Settle> {
    match inventory.begin(id)? {
        Begin::Acquired(claim) => {
            let Some(order) = Order::parse(body) else {
                // A poison message: no retry can fix it. `fail` marks the order failed
                // for good; any redelivery of it is `Exhausted`.
                claim.fail()?;
                return Ok(Settle::DeadLetter("failed"));
            };
            // The crash window. A consumer killed after its deduction reached the
            // ledger but before `complete` leaves the order in progress: RabbitMQ
            // redelivers it (never acked), the restarted consumer's open releases the
            // dead claim, and `begin` acquires it again with `attempt() > 1`. Attempt 1 means no
            // claim ever held the order, so nothing was deducted for it; only a later
            // attempt may find its side effect already done, so only then is the
            // ledger consulted: a handful of orders per crash, not every delivery.
            if claim.attempt() > 1 && ledger.contains(id)? {
                let result = format!(
                    "attempt {} found the deduction in the ledger; not deducted again",
                    claim.attempt()
                );
                claim.complete(Some(result.as_bytes()))?;
                return Ok(Settle::Ack("reconciled"));
            }
            if let Err(e) = ledger.deduct(id, order) {
                // Retriable: give the order back; a redelivery is a new attempt, and
                // after MAX_ATTEMPTS it is `Exhausted` and dead-lettered.
                eprintln!("consumer: deducting {id}: {e}");
                claim.release()?;
                return Ok(Settle::Requeue("released"));
            }
            crash_point(id);
            let result = format!(
                "deducted {} x sku {} (attempt {})",
                order.quantity,
                order.sku,
                claim.attempt()
            );
            claim.complete(Some(result.as_bytes()))?;
            Ok(Settle::Ack("deducted"))
        }
        // Deducted before; its ack was lost or never sent (a crash before the batch
        // ack). `record.result()` holds what the deduction said.
        Begin::Completed(_record) => Ok(Settle::Ack("skipped")),
        Begin::InProgress(record) => Ok(Settle::RequeueAfter(
            record.lease_until.unwrap_or_else(|| SystemClock.now()),
        )),
        Begin::Exhausted(_record) => Ok(Settle::DeadLetter("exhausted")),
    }
}

/// Test hook for `tests/end_to_end.rs`: with `CRASH_AFTER=K`, after the K-th deduction
/// of this process — on the ledger, before `complete` and before any ack — the
/// consumer says so and stops still, for the test to SIGKILL it.
fn crash_point(id: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static DEDUCTIONS: AtomicU64 = AtomicU64::new(0);
    let Some(crash_after) = std::env::var("CRASH_AFTER")
        .ok()
        .and_then(|k| k.parse::<u64>().ok())
    else {
        return;
    };
    if DEDUCTIONS.fetch_add(1, Ordering::Relaxed) + 1 == crash_after {
        println!("crash-point id={id}");
        loop {
            std::thread::park();
        }
    }
}

/// Completed deliveries not acked yet. Acked together with one `multiple` ack on the
/// last one's tag: deliveries are handled in tag order and every other outcome is
/// settled on the spot, so the ack covers exactly these.
#[derive(Default)]
struct AckBatch {
    ids: Vec<String>,
    last: Option<Acker>,
}

impl AckBatch {
    fn push(&mut self, id: String, acker: Acker) {
        self.ids.push(id);
        self.last = Some(acker);
    }

    fn len(&self) -> usize {
        self.ids.len()
    }

    async fn send(&mut self) -> Result<()> {
        if let Some(last) = self.last.take() {
            println!("ack n={} ids={}", self.ids.len(), self.ids.join(","));
            last.ack(BasicAckOptions { multiple: true }).await?;
            self.ids.clear();
        }
        Ok(())
    }
}

struct Settings {
    store_dir: PathBuf,
    ledger_path: PathBuf,
    lease: Duration,
    prefetch: u16,
    ack_batch: usize,
}

impl Settings {
    fn from_env() -> Result<Settings> {
        Ok(Settings {
            store_dir: env_or("IDEMSTORE_DIR", PathBuf::from("data/idemstore"))?,
            ledger_path: env_or("LEDGER_FILE", PathBuf::from("data/ledger.log"))?,
            lease: Duration::from_secs(env_or("LEASE_SECS", 30)?),
            prefetch: env_or("PREFETCH", 100)?,
            ack_batch: env_or("ACK_BATCH", 50)?,
        })
    }
}

fn env_or<T: FromStr>(name: &str, default: T) -> Result<T> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .map_err(|_| format!("{name}={value:?} is not valid").into()),
        Err(_) => Ok(default),
    }
}
