//! The example consumer against a real RabbitMQ (`.ci/rabbitmq` installs and starts
//! one on loopback and runs this test; `AMQP_ADDR` says where it is).
//!
//! Publishes ORDERS orders — every DUPLICATE_EVERY-th twice, as a retrying producer
//! would — and one poison message to a fresh queue, starts the async consumer (up to
//! PREFETCH deliveries in flight), SIGKILLs it mid-batch — after it has deducted
//! orders whose acks are still batched, and in the middle of one more (deducted on the
//! ledger, not `complete`d), with the other deliveries in flight wherever they were —
//! restarts it on the same store and ledger, waits until the queue is drained, and
//! checks from the outside that every order's stock was deducted exactly once, that
//! RabbitMQ redelivered what the killed consumer had not acked, that the poison
//! message went to the dead-letter queue, and that fsyncs were shared by many orders.
//!
//! It fails, never skips, when no broker is reachable.

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use idemstore::{Status, Store};
use idemstore_rabbitmq_example::{
    amqp_addr, dead_letter_queue, declare_queues, order_id, read_deductions,
};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

/// Orders published.
const ORDERS: u64 = 2000;
/// Every this-many-th order is published twice in a row (a producer's retry).
const DUPLICATE_EVERY: u64 = 97;
/// The consumer is killed in a deduction from its 737th on, one that finds deliveries
/// done but not acked yet: batches of 50 or more acked, some completed but not acked,
/// the one it stops in deducted but not completed, and others claimed or deducted in
/// flight.
const CRASH_AFTER: u64 = 737;
const ACK_BATCH: u64 = 50;
const PREFETCH: u64 = 100;
/// Short, should a lease ever have to run out (none should: the restarted consumer's
/// open releases the killed one's claim on the order it was in the middle of).
const LEASE_SECS: u64 = 2;
/// The whole test's bound.
const DEADLINE: Duration = Duration::from_secs(240);
const POISON_ID: &str = "order-poison";

#[tokio::test(flavor = "current_thread")]
async fn every_order_is_deducted_exactly_once_across_a_sigkill() {
    let started = Instant::now();
    let addr = amqp_addr();
    let connection = Connection::connect(&addr, ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RabbitMQ is not reachable at {addr} ({e}). This test needs a broker: run \
                 .ci/rabbitmq (installs and starts one on loopback, then runs this test), \
                 or set AMQP_ADDR to a running one."
            )
        });
    let channel = connection.create_channel().await.unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let queue = format!("idemstore-e2e-{}-{nanos}", std::process::id());
    declare_queues(&channel, &queue).await.unwrap();

    // The poison message first, then the orders through the example's publisher.
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let confirm = channel
        .basic_publish(
            "".into(),
            queue.as_str().into(),
            BasicPublishOptions::default(),
            b"not an order",
            BasicProperties::default().with_message_id(POISON_ID.into()),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(matches!(confirm, Confirmation::Ack(_)), "{confirm:?}");
    let published = Command::new(env!("CARGO_BIN_EXE_publisher"))
        .arg(ORDERS.to_string())
        .env("AMQP_ADDR", &addr)
        .env("ORDERS_QUEUE", &queue)
        .env("DUPLICATE_EVERY", DUPLICATE_EVERY.to_string())
        .status()
        .await
        .unwrap();
    assert!(published.success(), "publisher: {published}");
    let order_messages = ORDERS + ORDERS / DUPLICATE_EVERY;
    assert_eq!(ready(&channel, &queue).await, order_messages + 1);

    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let ledger = dir.path().join("ledger.log");

    // Run 1: killed with SIGKILL in its CRASH_AFTER-th deduction.
    let mut first = Consumer::start(&addr, &queue, &store_dir, &ledger, Some(CRASH_AFTER));
    let mut run1 = Run::default();
    let crash_id = loop {
        let line = first.next_line(started).await;
        if let Some(id) = line.strip_prefix("crash-point id=") {
            break id.to_string();
        }
        run1.record(&line);
    };
    first.child.start_kill().unwrap(); // SIGKILL
    let status = first.child.wait().await.unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL),
        "{status}"
    );

    // What the killed consumer had done but not acked: orders deducted and completed
    // whose batch ack was not sent yet; and orders on the ledger whose completion it
    // never reported — the one it stopped in, and others in flight at the kill.
    let run1_deducted = run1.ids_with("deducted");
    let completed_unacked: BTreeSet<String> =
        run1_deducted.difference(&run1.acked).cloned().collect();
    let deducted_before_kill = count_per_order(&ledger);
    assert_eq!(
        deducted_before_kill.get(&crash_id),
        Some(&1),
        "the crash point comes after the deduction of {crash_id}"
    );
    for id in &run1_deducted {
        assert_eq!(deducted_before_kill.get(id), Some(&1), "{id} on the ledger");
    }
    let half_done: BTreeSet<String> = deducted_before_kill
        .keys()
        .filter(|id| !run1_deducted.contains(*id))
        .cloned()
        .collect();
    assert!(half_done.contains(&crash_id));
    assert!(
        !completed_unacked.is_empty(),
        "the kill must land with deducted, completed orders not acked yet"
    );
    assert!(
        run1.in_flight_max > 1,
        "the consumer must have had more than one delivery in flight"
    );
    // The broker agrees: everything it did not get an ack for is back in the queue
    // (the poison message was rejected to the dead-letter queue).
    let expected_ready = order_messages - run1.acked_deliveries;
    let requeued = Instant::now();
    while ready(&channel, &queue).await != expected_ready {
        assert!(
            requeued.elapsed() < Duration::from_secs(10),
            "the broker did not requeue the killed consumer's unacked deliveries: {} ready, \
             expected {expected_ready}",
            ready(&channel, &queue).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Run 2: the restarted consumer, on the same store and ledger, until the queue is
    // drained; then stopped with SIGTERM.
    let mut second = Consumer::start(&addr, &queue, &store_dir, &ledger, None);
    let mut run2 = Run::default();
    loop {
        let line = second.next_line(started).await;
        run2.record(&line);
        if line == "idle"
            && count_per_order(&ledger).len() as u64 == ORDERS
            && ready(&channel, &queue).await == 0
        {
            break;
        }
    }
    let pid = second.child.id().expect("the consumer is running") as libc::pid_t;
    // SAFETY: kill(2) on our own child's pid; no memory is involved.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    while let Some(line) = second.lines.next_line().await.unwrap() {
        run2.record(&line);
    }
    let status = tokio::time::timeout(Duration::from_secs(30), second.child.wait())
        .await
        .expect("the consumer stops on SIGTERM")
        .unwrap();
    assert!(status.success(), "consumer: {status}");

    // Every order deducted exactly once, counted on the ledger.
    let deducted = count_per_order(&ledger);
    let duplicates: Vec<_> = deducted.iter().filter(|(_, n)| **n > 1).collect();
    let never: Vec<_> = (1..=ORDERS)
        .map(order_id)
        .filter(|id| !deducted.contains_key(id))
        .collect();
    assert!(
        duplicates.is_empty(),
        "deducted more than once: {duplicates:?}"
    );
    assert!(never.is_empty(), "never deducted: {never:?}");
    assert_eq!(deducted.len() as u64, ORDERS, "{deducted:?}");
    assert!(!deducted.contains_key(POISON_ID));

    // RabbitMQ redelivered what run 1 had not acked; the restarted consumer skipped the
    // completed ones and reconciled the half-done ones from the ledger (or found them
    // completed: the kill can land after a completion was written, before it was
    // reported).
    let redelivered = run2.redelivered.len();
    assert!(redelivered > 0, "RabbitMQ redelivered nothing");
    let outcomes = |id: &str| run2.outcomes.get(id).cloned().unwrap_or_default();
    for id in &completed_unacked {
        assert!(run2.redelivered.contains(id), "{id} was not redelivered");
        assert!(
            outcomes(id).iter().all(|o| o == "skipped"),
            "{id}: {:?}",
            outcomes(id)
        );
    }
    for id in &half_done {
        assert!(run2.redelivered.contains(id), "{id} was not redelivered");
        assert!(
            outcomes(id)
                .iter()
                .all(|o| o == "reconciled" || o == "skipped"),
            "{id}: {:?}",
            outcomes(id)
        );
    }
    assert!(
        outcomes(&crash_id).iter().any(|o| o == "reconciled"),
        "{crash_id}: {:?}",
        outcomes(&crash_id)
    );
    // The producer's second copies, delivered while or after the first was handled
    // in the same process, were skipped: deducted once.
    let copies_skipped = run1.skipped_fresh + run2.skipped_fresh;
    assert!(
        copies_skipped > 0,
        "no second copy of a retried publish was skipped"
    );
    // Many deliveries in flight share the fsyncs: a consumer handling one at a time
    // needs one ledger fsync per deduction.
    let stopped = run2
        .stopped
        .clone()
        .expect("the consumer printed its stop line");
    let run2_deducted = run2.count("deducted") as u64;
    let ledger_fsyncs = number_field(&stopped, "ledger_fsyncs");
    let store_syncs = number_field(&stopped, "store_sync_rounds");
    assert!(
        ledger_fsyncs < run2_deducted,
        "{ledger_fsyncs} ledger fsyncs for {run2_deducted} deductions: no group commit"
    );
    // The killed consumer's claim on the half-done order was released when run 2
    // opened the store (its process was gone): nothing waited for a lease.
    assert_eq!(
        run2.in_progress, 0,
        "the open released the dead claim; no order waits for its lease"
    );
    assert_eq!(ready(&channel, &queue).await, 0, "every delivery acked");
    assert_eq!(ready(&channel, &dead_letter_queue(&queue)).await, 1);

    // The consumption records agree.
    let store = Store::open(&store_dir).unwrap();
    let inventory = store
        .namespace(
            "inventory-deduct",
            idemstore::Policy::ttl(Duration::from_secs(48 * 3600)),
        )
        .unwrap();
    for n in 1..=ORDERS {
        let record = inventory.get(order_id(n)).unwrap().expect("remembered");
        assert_eq!(record.status, Status::Completed, "{}", order_id(n));
    }
    for id in run2.ids_with("reconciled") {
        let reconciled = inventory.get(&id).unwrap().unwrap();
        assert_eq!(reconciled.attempts, 2, "{id}");
    }
    let poison = inventory.get(POISON_ID).unwrap().unwrap();
    assert_eq!(poison.status, Status::Failed);
    store.close().unwrap();

    println!(
        "\nend to end against {addr}, queue {queue}\n\
         \x20 published     {} messages: {ORDERS} orders ({} of them twice) + 1 poison\n\
         \x20 run 1         {} deliveries, up to {} in flight: {} orders deducted, 1 poison failed \
         and dead-lettered; {} acked in batches of {ACK_BATCH} or more\n\
         \x20 SIGKILL       with {} orders completed but not acked, and {} deducted but not \
         reported completed ({crash_id} among them)\n\
         \x20 run 2         {} deliveries, up to {} in flight, {redelivered} with the redelivered \
         flag: {} deducted, {} skipped (already completed), {} reconciled from the ledger \
         (attempt 2), {} requeued behind a live lease\n\
         \x20 copies        {copies_skipped} second copies of a retried publish skipped\n\
         \x20 fsyncs        run 2: {run2_deducted} deductions in {ledger_fsyncs} ledger fsyncs; \
         {store_syncs} store syncs for their begins and completions\n\
         \x20 ledger        {} orders, {} deductions: duplicates 0, missing 0\n\
         \x20 queues        {queue}: 0 left, {}: 1 (the poison)\n\
         \x20 time          {:.1} s",
        order_messages + 1,
        ORDERS / DUPLICATE_EVERY,
        run1.deliveries,
        run1.in_flight_max,
        run1_deducted.len(),
        run1.acked_deliveries,
        completed_unacked.len(),
        half_done.len(),
        run2.deliveries,
        run2.in_flight_max,
        run2.count("deducted"),
        run2.count("skipped"),
        run2.count("reconciled"),
        run2.in_progress,
        deducted.len(),
        deducted.values().sum::<u64>(),
        dead_letter_queue(&queue),
        started.elapsed().as_secs_f64(),
    );

    for name in [queue.clone(), dead_letter_queue(&queue)] {
        channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await
            .unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
}

/// One consumer child process and its stdout.
struct Consumer {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl Consumer {
    fn start(
        addr: &str,
        queue: &str,
        store_dir: &Path,
        ledger: &Path,
        crash_after: Option<u64>,
    ) -> Consumer {
        let mut command = Command::new(env!("CARGO_BIN_EXE_consumer"));
        command
            .env("AMQP_ADDR", addr)
            .env("ORDERS_QUEUE", queue)
            .env("IDEMSTORE_DIR", store_dir)
            .env("LEDGER_FILE", ledger)
            .env("LEASE_SECS", LEASE_SECS.to_string())
            .env("PREFETCH", PREFETCH.to_string())
            .env("ACK_BATCH", ACK_BATCH.to_string())
            .env_remove("CRASH_AFTER")
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        if let Some(k) = crash_after {
            command.env("CRASH_AFTER", k.to_string());
        }
        let mut child = command.spawn().expect("starting the consumer");
        let lines = BufReader::new(child.stdout.take().unwrap()).lines();
        Consumer { child, lines }
    }

    /// The consumer's next line of output; panics at the test's deadline or if the
    /// consumer exits.
    async fn next_line(&mut self, started: Instant) -> String {
        let left = DEADLINE.saturating_sub(started.elapsed());
        match tokio::time::timeout(left, self.lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) => panic!("the consumer exited: {:?}", self.child.wait().await),
            Ok(Err(e)) => panic!("reading the consumer's output: {e}"),
            Err(_) => panic!("the test did not finish within {DEADLINE:?}"),
        }
    }
}

/// What one consumer process said it did.
#[derive(Default)]
struct Run {
    deliveries: u64,
    /// The outcomes per order id, in order.
    outcomes: HashMap<String, Vec<String>>,
    /// Order ids delivered with the redelivered flag.
    redelivered: BTreeSet<String>,
    /// Order ids in ack batches (printed before each batch ack is sent).
    acked: BTreeSet<String>,
    /// Deliveries in ack batches.
    acked_deliveries: u64,
    /// Deliveries skipped as already completed without the redelivered flag: second
    /// copies of a retried publish.
    skipped_fresh: u64,
    /// The most deliveries in flight when one ended.
    in_flight_max: u64,
    /// The consumer's `stopped` line.
    stopped: Option<String>,
    /// Deliveries answered `InProgress` (requeued once the lease ran out); none is
    /// expected, since the open releases the killed consumer's claims.
    in_progress: u64,
}

impl Run {
    fn record(&mut self, line: &str) {
        if let Some(fields) = line.strip_prefix("delivery ") {
            let field = |name: &str| {
                fields
                    .split(' ')
                    .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
                    .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                    .to_string()
            };
            let (id, outcome) = (field("id"), field("outcome"));
            self.deliveries += 1;
            if field("redelivered") == "true" {
                self.redelivered.insert(id.clone());
            }
            if outcome == "in-progress" {
                self.in_progress += 1;
            }
            if outcome == "skipped" && field("redelivered") == "false" {
                self.skipped_fresh += 1;
            }
            self.in_flight_max = self.in_flight_max.max(field("in_flight").parse().unwrap());
            self.outcomes.entry(id).or_default().push(outcome);
        } else if let Some(fields) = line.strip_prefix("ack ") {
            let ids = fields.split(' ').find_map(|f| f.strip_prefix("ids="));
            let ids = ids.unwrap_or_default().split(',').map(str::to_string);
            self.acked_deliveries += number_field(line, "n");
            self.acked.extend(ids);
        } else if line.starts_with("stopped ") {
            self.stopped = Some(line.to_string());
        }
    }

    /// Deliveries with this outcome.
    fn count(&self, outcome: &str) -> usize {
        self.outcomes
            .values()
            .flatten()
            .filter(|o| *o == outcome)
            .count()
    }

    /// Order ids with a delivery of this outcome.
    fn ids_with(&self, outcome: &str) -> BTreeSet<String> {
        self.outcomes
            .iter()
            .filter(|(_, outcomes)| outcomes.iter().any(|o| o == outcome))
            .map(|(id, _)| id.clone())
            .collect()
    }
}

/// The number in field `name=` of a line of the consumer's.
fn number_field(line: &str, name: &str) -> u64 {
    line.split(' ')
        .find_map(|f| f.strip_prefix(name)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {name}= in {line:?}"))
}

/// Deductions per order id on the ledger.
fn count_per_order(ledger: &Path) -> HashMap<String, u64> {
    let mut counts = HashMap::new();
    for deduction in read_deductions(ledger).unwrap() {
        *counts.entry(deduction.order_id).or_insert(0) += 1;
    }
    counts
}

/// Messages ready in `queue` (not counting deliveries not acked yet).
async fn ready(channel: &Channel, queue: &str) -> u64 {
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let declared = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
        .unwrap();
    u64::from(declared.message_count())
}
