//! The example consumer against a real RabbitMQ (`.ci/rabbitmq` installs and starts
//! one on loopback and runs this test; `AMQP_ADDR` says where it is).
//!
//! Publishes ORDERS orders and one poison message to a fresh queue, starts the
//! consumer, SIGKILLs it mid-batch — after it has deducted orders whose acks are still
//! batched, and in the middle of one more (deducted on the ledger, not `complete`d) —
//! restarts it on the same store and ledger, waits until the queue is drained, and
//! checks from the outside that every order's stock was deducted exactly once, that
//! RabbitMQ redelivered what the killed consumer had not acked, and that the poison
//! message went to the dead-letter queue.
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
/// The consumer is killed in its 737th deduction: 14 batches of 50 acked, 36 deducted
/// and completed but not acked, and one deducted but not completed.
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
        .status()
        .await
        .unwrap();
    assert!(published.success(), "publisher: {published}");
    assert_eq!(ready(&channel, &queue).await, ORDERS + 1);

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
    // whose batch ack was not sent yet, and the one it was in the middle of.
    let completed_unacked: BTreeSet<String> = run1
        .outcomes
        .iter()
        .filter(|(id, outcome)| outcome.as_str() == "deducted" && !run1.acked.contains(*id))
        .map(|(id, _)| id.clone())
        .collect();
    let deducted_before_kill = count_per_order(&ledger);
    assert_eq!(
        deducted_before_kill.get(&crash_id),
        Some(&1),
        "the crash point comes after the deduction of {crash_id}"
    );
    let processed_unacked = completed_unacked.len() + 1;
    assert!(
        !completed_unacked.is_empty(),
        "the kill must land with deducted, completed orders not acked yet"
    );
    assert_eq!(
        deducted_before_kill.len() as u64,
        run1.acked.len() as u64 + processed_unacked as u64
    );
    // The broker agrees: everything it did not get an ack for is back in the queue.
    let expected_ready = ORDERS - run1.acked.len() as u64;
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
    // completed ones and reconciled the half-done one from the ledger.
    let redelivered = run2.redelivered.len();
    assert!(redelivered > 0, "RabbitMQ redelivered nothing");
    for id in &completed_unacked {
        assert!(run2.redelivered.contains(id), "{id} was not redelivered");
        assert_eq!(
            run2.outcomes.get(id).map(String::as_str),
            Some("skipped"),
            "{id}"
        );
    }
    assert!(run2.redelivered.contains(&crash_id));
    assert_eq!(
        run2.outcomes.get(&crash_id).map(String::as_str),
        Some("reconciled"),
        "{crash_id}"
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
    let crashed = inventory.get(&crash_id).unwrap().unwrap();
    assert_eq!(crashed.attempts, 2);
    let poison = inventory.get(POISON_ID).unwrap().unwrap();
    assert_eq!(poison.status, Status::Failed);
    store.close().unwrap();

    println!(
        "\nend to end against {addr}, queue {queue}\n\
         \x20 published     {} messages: {ORDERS} orders + 1 poison\n\
         \x20 run 1         {} deliveries: {} orders deducted, 1 poison failed and dead-lettered; \
         {} acked in batches of {ACK_BATCH}\n\
         \x20 SIGKILL       with {processed_unacked} orders processed but not acked: {} completed, \
         and {crash_id} deducted but not completed\n\
         \x20 run 2         {} deliveries, {redelivered} with the redelivered flag: {} deducted, \
         {} skipped (already completed), {} reconciled from the ledger (attempt 2), \
         {} requeued behind a live lease\n\
         \x20 ledger        {} orders, {} deductions: duplicates 0, missing 0\n\
         \x20 queues        {queue}: 0 left, {}: 1 (the poison)\n\
         \x20 time          {:.1} s",
        ORDERS + 1,
        run1.deliveries + 1, // the one the kill cut short printed no line
        deducted_before_kill.len(),
        run1.acked.len(),
        completed_unacked.len(),
        run2.deliveries,
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
    /// The last outcome per order id.
    outcomes: HashMap<String, String>,
    /// Order ids delivered with the redelivered flag.
    redelivered: BTreeSet<String>,
    /// Order ids in ack batches (printed before each batch ack is sent).
    acked: BTreeSet<String>,
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
            self.outcomes.insert(id, outcome);
        } else if let Some(fields) = line.strip_prefix("ack ") {
            let ids = fields.split(' ').find_map(|f| f.strip_prefix("ids="));
            self.acked
                .extend(ids.unwrap_or_default().split(',').map(str::to_string));
        }
    }

    fn count(&self, outcome: &str) -> usize {
        self.outcomes.values().filter(|o| *o == outcome).count()
    }
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
