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
//! **Many deliveries in flight, no blocked executor.** The consumer is async through
//! and through: each delivery is a task on one current-thread tokio runtime, and every
//! wait is a future — `begin_async`, `complete_async` (idemstore's durability waits,
//! woken by its commit thread) and the ledger's deduction (a group commit on a thread
//! of its own). Up to `PREFETCH` deliveries are handled at once, so one idemstore
//! fsync and one ledger fsync cover many orders instead of one each. The store runs in
//! `Durability::Immediate`: `begin_async` resolves `Acquired` only once the claim is
//! on disk, `complete_async` only once the completion is, and only then is the
//! delivery acked.
//!
//! Acks are sent in batches (`multiple: true`) on the highest delivery tag below which
//! every delivery is settled: deliveries finish out of order, and a `multiple` ack
//! must not cover one still in flight. A crash or a lost ack therefore leaves
//! deliveries that were processed but not acked; RabbitMQ redelivers them and `begin`
//! answers `Completed`. Two deliveries of one order in flight at once (a producer's
//! retry published it twice) take turns: the later asks the store once the earlier
//! has settled, and gets `Completed`.
//!
//! Configuration, from the environment: `AMQP_ADDR`
//! (`amqp://guest:guest@127.0.0.1:5672/%2f`), `ORDERS_QUEUE` (`orders`),
//! `IDEMSTORE_DIR` (`data/idemstore`), `LEDGER_FILE` (`data/ledger.log`),
//! `LEASE_SECS` (30), `PREFETCH` (100), `ACK_BATCH` (50). Stops cleanly on SIGTERM or
//! Ctrl-C. Prints one line per delivery and per ack batch on stdout.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::error::Error;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::str::FromStr;
use std::time::Duration;

use futures_lite::StreamExt;
use idemstore::{Begin, Clock, Durability, Namespace, Policy, Store, SystemClock};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::FieldTable;
use lapin::{Acker, Connection, ConnectionProperties};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::Notify;

use idemstore_rabbitmq_example::{LedgerWriter, Order, amqp_addr, declare_queues, queue_name};

/// The business type the consumer deduplicates under.
const NAMESPACE: &str = "inventory-deduct";
/// How long an order id is remembered: longer than a message can wait in the queue
/// and still be redelivered.
const TTL: Duration = Duration::from_secs(48 * 3600);
/// Acquisitions of an order that never completed before it is dead-lettered.
const MAX_ATTEMPTS: u32 = 5;
/// With nothing happening for this long, the consumer acks what it has done.
const IDLE: Duration = Duration::from_millis(200);

type Result<T> = std::result::Result<T, Box<dyn Error>>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    // Delivery tasks share the consumer's state through `Rc`: one thread, no locks.
    let tasks = tokio::task::LocalSet::new();
    match tasks.run_until(run()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("consumer: {e}");
            ExitCode::from(2)
        }
    }
}

/// What the delivery tasks share.
struct Consumer {
    inventory: Namespace,
    ledger: LedgerWriter,
    /// Order ids a delivery task is working on, each with the signal its end sends
    /// to the deliveries of the same order waiting for their turn.
    working: RefCell<HashMap<String, Rc<Notify>>>,
    /// Deliveries deducted and completed but not acked yet (for the test's crash
    /// point).
    deducted_unacked: Rc<Cell<usize>>,
}

async fn run() -> Result<()> {
    let settings = Settings::from_env()?;
    let queue = queue_name();

    // One store per consumer process: idemstore is embedded, and a second process
    // opening the same directory gets `Error::Locked`.
    //
    // `Durability::Immediate`: `begin_async` and `complete_async` resolve only once
    // their record is on disk. The ledger line is fsynced too, so even after a power
    // cut the store never knows less than the ledger: a `begin` lost after its
    // deduction reached the disk would come back as attempt 1 and deduct again. (The
    // default, `Interval(100 ms)`, is safe against kill -9 but not against a power cut.)
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
    let consumer = Rc::new(Consumer {
        inventory,
        ledger: LedgerWriter::open(&settings.ledger_path)?,
        working: RefCell::default(),
        deducted_unacked: Rc::default(),
    });
    println!(
        "ready store={} records_replayed={} ledger={}",
        settings.store_dir.display(),
        store.stats().records_replayed,
        settings.ledger_path.display()
    );

    let connection = Connection::connect(&amqp_addr(), ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    declare_queues(&channel, &queue).await?;
    // At most `prefetch` deliveries unacked at once: the consumer's depth in flight.
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
    let (handled_tx, mut handled_rx) = tokio::sync::mpsc::unbounded_channel::<Handled>();
    let mut window = AckWindow::new(Rc::clone(&consumer.deducted_unacked));
    let mut tally = Tally::default();
    let mut busy = false;
    loop {
        tokio::select! {
            _ = terminate.recv() => break,
            _ = interrupt.recv() => break,
            handled = handled_rx.recv() => {
                let handled = handled.expect("the loop holds a sender");
                settle(handled, &mut window, &mut tally, settings.ack_batch).await?;
                busy = true;
            }
            next = deliveries.next() => {
                let Some(delivery) = next else { break }; // the broker cancelled us
                let delivery = delivery?;
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
                    delivery.reject(BasicRejectOptions { requeue: false }).await?;
                    continue;
                };
                window.open(delivery.delivery_tag, delivery.acker);
                let (consumer, handled) = (Rc::clone(&consumer), handled_tx.clone());
                let (tag, redelivered, body) =
                    (delivery.delivery_tag, delivery.redelivered, delivery.data);
                tokio::task::spawn_local(async move {
                    let settle = handle(&consumer, &id, &body).await;
                    let _ = handled.send(Handled { tag, id, redelivered, settle });
                });
            }
            _ = tokio::time::sleep(IDLE) => {
                if busy {
                    window.ack_settled().await?;
                        println!("idle");
                    busy = false;
                }
            }
        }
    }

    // Clean stop: take no new delivery, let those in flight finish (each is a
    // durability wait, or at most one lease), ack what is done. What is not acked
    // is requeued by the broker when the channel closes.
    while window.in_flight() > 0 {
        let handled = handled_rx.recv().await.expect("the loop holds a sender");
        settle(handled, &mut window, &mut tally, usize::MAX).await?;
    }
    window.ack_settled().await?;
    channel.close(200, "consumer stopping".into()).await?;
    connection.close(200, "consumer stopping".into()).await?;
    let sync_rounds = store.stats().sync_rounds;
    store.close()?;
    println!(
        "stopped deducted={} store_sync_rounds={sync_rounds} ledger_fsyncs={}",
        tally.deducted,
        consumer.ledger.rounds()
    );
    Ok(())
}

/// A delivery task's end: what to tell RabbitMQ about its delivery.
struct Handled {
    tag: u64,
    id: String,
    redelivered: bool,
    settle: Result<Settle>,
}

/// What to tell RabbitMQ about one delivery.
enum Settle {
    /// Done, now or before: ack it (in the next batch).
    Ack(&'static str),
    /// Not done: requeue it to try again (the side effect failed and the claim was
    /// released, or a live lease held the order until it ran out).
    Requeue(&'static str),
    /// Never to be processed: reject it without requeue, to the dead-letter queue.
    DeadLetter(&'static str),
}

#[derive(Default)]
struct Tally {
    deducted: u64,
}

/// Prints what a delivery task did and settles its delivery with the broker.
async fn settle(
    handled: Handled,
    window: &mut AckWindow,
    tally: &mut Tally,
    ack_batch: usize,
) -> Result<()> {
    let Handled {
        tag,
        id,
        redelivered,
        settle,
    } = handled;
    let settle = settle?;
    let (Settle::Ack(outcome) | Settle::Requeue(outcome) | Settle::DeadLetter(outcome)) = settle;
    // Counting this one: how many deliveries were in flight when it ended.
    let in_flight = window.in_flight();
    println!("delivery id={id} redelivered={redelivered} outcome={outcome} in_flight={in_flight}");
    match settle {
        Settle::Ack(outcome) => {
            if outcome == "deducted" {
                tally.deducted += 1;
            }
            window.done(tag, id, outcome == "deducted");
            if window.settled() >= ack_batch {
                window.ack_settled().await?;
            }
        }
        Settle::Requeue(_) => {
            window
                .take(tag)
                .nack(BasicNackOptions {
                    requeue: true,
                    multiple: false,
                })
                .await?;
        }
        Settle::DeadLetter(_) => {
            // Rejected without requeue: the queue's dead-letter exchange routes it
            // to the dead-letter queue.
            window
                .take(tag)
                .reject(BasicRejectOptions { requeue: false })
                .await?;
        }
    }
    Ok(())
}

/// One delivery through the claim lifecycle: `begin` → deduct → `complete`, each an
/// awaited future. Runs as a task of its own, beside the others in flight.
async fn handle(consumer: &Rc<Consumer>, id: &str, body: &[u8]) -> Result<Settle> {
    let _turn = Turn::take(consumer, id).await;
    match consumer.inventory.begin_async(id).await? {
        Begin::Acquired(claim) => {
            let Some(order) = Order::parse(body) else {
                // A poison message: no retry can fix it. `fail` marks the order failed
                // for good; any redelivery of it is `Exhausted`.
                claim.fail_async().await?;
                return Ok(Settle::DeadLetter("failed"));
            };
            // The crash window. A consumer killed after its deduction reached the
            // ledger but before `complete` leaves the order in progress: RabbitMQ
            // redelivers it (never acked), the restarted consumer's open releases the
            // dead claim, and `begin` acquires it again with `attempt() > 1`. Attempt
            // 1 means no claim ever held the order, so nothing was deducted for it;
            // only a later attempt may find its side effect already done, so only
            // then is the ledger consulted: the orders in flight at a crash, not every
            // delivery.
            if claim.attempt() > 1 && consumer.ledger.contains(id)? {
                let result = format!(
                    "attempt {} found the deduction in the ledger; not deducted again",
                    claim.attempt()
                );
                claim.complete_async(Some(result.as_bytes())).await?;
                return Ok(Settle::Ack("reconciled"));
            }
            if let Err(e) = consumer.ledger.deduct(id, order).await {
                // Retriable: give the order back; a redelivery is a new attempt, and
                // after MAX_ATTEMPTS it is `Exhausted` and dead-lettered.
                eprintln!("consumer: deducting {id}: {e}");
                claim.release_async().await?;
                return Ok(Settle::Requeue("released"));
            }
            crash_point(consumer, id);
            let result = format!(
                "deducted {} x sku {} (attempt {})",
                order.quantity,
                order.sku,
                claim.attempt()
            );
            claim.complete_async(Some(result.as_bytes())).await?;
            Ok(Settle::Ack("deducted"))
        }
        // Deducted before: its ack was lost or never sent (a crash before the batch
        // ack), or a second copy of the message waited its turn behind the first.
        // `record.result()` holds what the deduction said.
        Begin::Completed(_record) => Ok(Settle::Ack("skipped")),
        Begin::InProgress(record) => {
            // A claim this process does not hold (deliveries of one order take turns
            // here, and a killed predecessor's claims are released when the store
            // opens): wait its lease out in this task — the others go on — and then
            // requeue. Requeueing at once would make RabbitMQ hand the message
            // straight back, over and over until the lease ran out.
            let until = record.lease_until.unwrap_or_else(|| SystemClock.now());
            let wait = until.0.saturating_sub(SystemClock.now().0) + 50;
            tokio::time::sleep(Duration::from_millis(wait)).await;
            Ok(Settle::Requeue("in-progress"))
        }
        Begin::Exhausted(_record) => Ok(Settle::DeadLetter("exhausted")),
    }
}

/// A delivery task's turn on its order id: deliveries of one order in flight at once
/// go one after the other, so the later sees what the earlier left in the store.
struct Turn {
    consumer: Rc<Consumer>,
    id: String,
}

impl Turn {
    async fn take(consumer: &Rc<Consumer>, id: &str) -> Turn {
        loop {
            let working = consumer.working.borrow().get(id).cloned();
            match working {
                // `notified()` is registered as soon as it is made, before the holder
                // can end its turn: no wakeup is lost.
                Some(ended) => ended.notified().await,
                None => break,
            }
        }
        consumer
            .working
            .borrow_mut()
            .insert(id.to_string(), Rc::new(Notify::new()));
        Turn {
            consumer: Rc::clone(consumer),
            id: id.to_string(),
        }
    }
}

impl Drop for Turn {
    fn drop(&mut self) {
        if let Some(ended) = self.consumer.working.borrow_mut().remove(&self.id) {
            ended.notify_waiters();
        }
    }
}

/// Test hook for `tests/end_to_end.rs`: with `CRASH_AFTER=K`, at the first deduction
/// from the K-th of this process on that finds deliveries deducted and completed but
/// not acked yet —
/// on the ledger, before `complete` and before any ack — the consumer says so and
/// stops still (the whole runtime: this task parks its only thread), for the test to
/// SIGKILL it mid-batch. Other deliveries in flight are left wherever they were:
/// claimed, deducted, completed but not acked.
fn crash_point(consumer: &Consumer, id: &str) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static DEDUCTIONS: AtomicU64 = AtomicU64::new(0);
    let Some(crash_after) = std::env::var("CRASH_AFTER")
        .ok()
        .and_then(|k| k.parse::<u64>().ok())
    else {
        return;
    };
    if DEDUCTIONS.fetch_add(1, Ordering::Relaxed) + 1 >= crash_after
        && consumer.deducted_unacked.get() > 0
    {
        println!("crash-point id={id}");
        loop {
            std::thread::park();
        }
    }
}

/// The deliveries not settled with the broker yet, by delivery tag: in flight, or
/// done and waiting for their ack. Deliveries finish out of order; one `multiple`
/// ack on tag T settles every unsettled delivery up to T, so it is sent only on the
/// highest tag below which every delivery is done (requeued and rejected ones are
/// settled on their own at once and leave the window).
struct AckWindow {
    slots: BTreeMap<u64, Slot>,
    /// How many slots are done by a deduction, kept current for the crash point.
    deducted_unacked: Rc<Cell<usize>>,
}

struct Slot {
    acker: Acker,
    /// The order id, once the delivery is done and may be acked.
    done: Option<String>,
    /// Done by deducting the order now (not found done before).
    deducted: bool,
}

impl AckWindow {
    fn new(deducted_unacked: Rc<Cell<usize>>) -> AckWindow {
        AckWindow {
            slots: BTreeMap::new(),
            deducted_unacked,
        }
    }

    fn open(&mut self, tag: u64, acker: Acker) {
        self.slots.insert(
            tag,
            Slot {
                acker,
                done: None,
                deducted: false,
            },
        );
    }

    fn done(&mut self, tag: u64, id: String, deducted: bool) {
        if let Some(slot) = self.slots.get_mut(&tag) {
            slot.done = Some(id);
            slot.deducted = deducted;
        }
        self.deducted_unacked.set(self.deducted_unacked());
    }

    /// Takes a delivery out of the window, to settle it on its own.
    fn take(&mut self, tag: u64) -> Acker {
        self.slots
            .remove(&tag)
            .expect("every delivery handed to a task has a slot")
            .acker
    }

    /// Deliveries done by a deduction and not acked yet.
    fn deducted_unacked(&self) -> usize {
        self.slots
            .values()
            .filter(|s| s.done.is_some() && s.deducted)
            .count()
    }

    /// Deliveries still in flight.
    fn in_flight(&self) -> usize {
        self.slots.values().filter(|s| s.done.is_none()).count()
    }

    /// How many deliveries one `multiple` ack would settle now.
    fn settled(&self) -> usize {
        self.slots.values().take_while(|s| s.done.is_some()).count()
    }

    /// Acks every done delivery below the first one in flight, with one `multiple` ack.
    async fn ack_settled(&mut self) -> Result<()> {
        let mut ids = Vec::new();
        let mut last = None;
        while let Some(entry) = self.slots.first_entry() {
            if entry.get().done.is_none() {
                break;
            }
            let slot = entry.remove();
            ids.extend(slot.done);
            last = Some(slot.acker);
        }
        self.deducted_unacked.set(self.deducted_unacked());
        if let Some(last) = last {
            println!("ack n={} ids={}", ids.len(), ids.join(","));
            last.ack(BasicAckOptions { multiple: true }).await?;
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
