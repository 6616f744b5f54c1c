//! The changelog on a real 3-node NATS JetStream cluster (feature `nats`): what one
//! partition's owner costs on this machine, before the store uses it.
//!
//! ```sh
//! cargo run --release --features nats --example changelog_bench -- [--marks 1000000] [--batch 1000] [--single 2000]
//! ```
//!
//! Starts three `nats-server` nodes on loopback (`LocalCluster`, R3 file storage) and
//! measures, for one partition:
//! - single-record appends, one after the other: each one cluster round trip
//!   (publish with the expected last subject sequence, quorum ack) — p50/p99 and /s;
//! - appends of `--batch` marks per message up to `--marks` marks: marks/s;
//! - a cold take-over of that partition (read and verify every message and record
//!   from the start, then the owner message): the changelog side of a restore, not
//!   applying the records to a store (which does not exist yet);
//! - a warm take-over that has all but the last 10,000 marks.

use std::time::{Duration, Instant};

use idemstore::fuzzing;
use idemstore::replication::{LocalCluster, NatsConfig, PartitionOwner};

fn main() {
    let mut marks: u64 = 1_000_000;
    let mut batch: u64 = 1000;
    let mut single: u64 = 2000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || -> u64 {
            args.next()
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("{arg} takes a number"))
        };
        match arg.as_str() {
            "--marks" => marks = value(),
            "--batch" => batch = value(),
            "--single" => single = value(),
            other => panic!("unknown argument {other}; see the file's doc comment"),
        }
    }
    assert!(batch > 0 && marks >= batch);

    let cluster = LocalCluster::start(3).unwrap_or_else(|e| {
        eprintln!("changelog_bench: {e}");
        std::process::exit(2)
    });
    let mut config = NatsConfig::new(cluster.urls());
    config.stream = "BENCH".into();
    config.subject_prefix = "idemstore.bench".into();
    let log = cluster
        .open(&config, Duration::from_secs(30))
        .expect("the cluster comes up");
    println!("3-node JetStream cluster on loopback (nats-server, R3, file storage)");

    // Single-record appends: one cluster round trip each.
    let subject = "idemstore.bench.inventory.0";
    let mut owner = PartitionOwner::take_over(&log, subject, "inventory", 0, 1, 0, &mut |_| {})
        .expect("take-over")
        .owner;
    let mut latencies = Vec::with_capacity(single as usize);
    let started = Instant::now();
    for n in 0..single {
        let record = mark(0, n);
        let t = Instant::now();
        owner.append(&log, &[(DEADLINE, &record)]).expect("append");
        latencies.push(t.elapsed());
    }
    let elapsed = started.elapsed();
    latencies.sort();
    println!(
        "single-record appends  {single:>9}  {:>10.0} appends/s  p50 {:?}  p99 {:?}",
        single as f64 / elapsed.as_secs_f64(),
        latencies[latencies.len() / 2],
        latencies[latencies.len() * 99 / 100]
    );

    // Batches of marks.
    let subject = "idemstore.bench.inventory.1";
    let mut owner = PartitionOwner::take_over(&log, subject, "inventory", 1, 2, 0, &mut |_| {})
        .expect("take-over")
        .owner;
    let records: Vec<Vec<u8>> = (0..marks).map(|n| mark(1, n)).collect();
    let started = Instant::now();
    let mut positions = Vec::new();
    for chunk in records.chunks(batch as usize) {
        let shipped: Vec<(u64, &[u8])> = chunk.iter().map(|r| (DEADLINE, r.as_slice())).collect();
        positions.push(owner.append(&log, &shipped).expect("append"));
    }
    let elapsed = started.elapsed();
    println!(
        "appends of {batch} marks   {marks:>9}  {:>10.0} marks/s   ({} messages, {:.1} s)",
        marks as f64 / elapsed.as_secs_f64(),
        positions.len(),
        elapsed.as_secs_f64()
    );

    // Cold take-over: everything from the start.
    let mut restored_records = 0;
    let started = Instant::now();
    let cold = PartitionOwner::take_over(&log, subject, "inventory", 1, 3, 0, &mut |s| {
        restored_records += s.records
    })
    .expect("take-over");
    let elapsed = started.elapsed();
    assert_eq!(restored_records as u64, marks);
    assert!(cold.damaged.is_empty());
    println!(
        "cold take-over         {marks:>9}  marks read and verified in {:.3} s ({} messages)",
        elapsed.as_secs_f64(),
        cold.messages
    );

    // Warm take-over: all but the last 10,000 marks are present.
    let missing = 10_000.min(marks);
    let have_messages = positions.len() - (missing / batch).max(1) as usize;
    let from = positions[have_messages - 1];
    let mut warm_records = 0;
    let started = Instant::now();
    PartitionOwner::take_over(&log, subject, "inventory", 1, 4, from, &mut |s| {
        warm_records += s.records
    })
    .expect("take-over");
    let elapsed = started.elapsed();
    println!(
        "warm take-over         {warm_records:>9}  marks read (all but the last {missing} present) in {:.3} s",
        elapsed.as_secs_f64()
    );
}

/// The bucket deadline the shipped records carry.
const DEADLINE: u64 = 1_700_000_600_000;

fn mark(partition: u32, n: u64) -> Vec<u8> {
    fuzzing::encode_scoped_mark(
        partition,
        Some(n),
        n + 1,
        1_700_000_000_000,
        format!("order-{n:09}").as_bytes(),
    )
}
