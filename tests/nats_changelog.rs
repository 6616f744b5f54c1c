//! The changelog on a real NATS JetStream cluster (feature `nats`): three
//! `nats-server` nodes with JetStream on loopback, started by this test in temporary
//! directories (Debian's `nats-server` 2.9; `.ci/nats` installs it and runs this
//! test). It fails, never skips, when `nats-server` is missing.
//!
//! - the stream is created, and a second open with other settings is refused and
//!   changes nothing;
//! - an unreachable cluster is a typed error, not a hang;
//! - the fencing protocol of `tests/changelog_fencing.rs` on the real engine: a
//!   zombie's append is refused by JetStream's expected last subject sequence, and a
//!   take-over hands over every message before its owner message;
//! - a node killed with SIGKILL mid-run and restarted: every append answered `Ok` is
//!   in the stream once, in order, none twice.

use std::time::{Duration, Instant};

use idemstore::fuzzing;
use idemstore::replication::{
    Changelog, ChangelogError, LocalCluster, NatsChangelog, NatsConfig, NatsOpenError,
    PartitionOwner, ReplicationError,
};

const NAMESPACE: &str = "inventory";

/// The test's cluster: three real nodes; fails (never skips) without nats-server.
fn start_cluster() -> LocalCluster {
    LocalCluster::start(3).unwrap_or_else(|e| {
        panic!("{e}: this test needs nats-server (.ci/nats installs it and runs this test)")
    })
}

fn config(cluster: &LocalCluster, stream: &str) -> NatsConfig {
    let mut config = NatsConfig::new(cluster.urls());
    config.stream = stream.into();
    config.subject_prefix = format!("idemstore.{}", stream.to_lowercase());
    config.timeout = Duration::from_secs(3);
    config
}

/// The bucket deadline the shipped records carry.
const DEADLINE: u64 = 1_700_000_600_000;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A mark of partition `partition`, with its message's offset `n`.
fn mark(partition: u32, n: u64) -> Vec<u8> {
    fuzzing::encode_scoped_mark(
        partition,
        Some(n),
        n,
        1_700_000_000_000,
        format!("order-{n}").as_bytes(),
    )
}

fn decode(message: &[u8]) -> (u64, u64) {
    let m = fuzzing::decode_changelog_message(message).expect("a message in the stream decodes");
    (m.owner, m.batch)
}

#[test]
fn the_changelog_on_a_real_cluster() {
    let mut cluster = start_cluster();
    let config = config(&cluster, "FENCING");
    let log = cluster
        .open(&config, Duration::from_secs(30))
        .expect("the cluster comes up");

    // Misconfiguration: the stream exists with 3 replicas; asking for 1 is refused.
    let mut other = config.clone();
    other.replicas = 1;
    match NatsChangelog::open(&other) {
        Err(NatsOpenError::Misconfigured(why)) => assert!(why.contains("replicas"), "{why}"),
        other => panic!("expected Misconfigured, got {other:?}"),
    }
    let mut other = config.clone();
    other.subject_prefix = "somewhere.else".into();
    assert!(matches!(
        NatsChangelog::open(&other),
        Err(NatsOpenError::Misconfigured(_))
    ));

    // Unreachable: a port nothing listens on.
    let mut nowhere = NatsConfig::new([format!("nats://127.0.0.1:{}", free_port())]);
    nowhere.timeout = Duration::from_secs(1);
    let tried = Instant::now();
    let refused = NatsChangelog::open(&nowhere);
    assert!(
        matches!(refused, Err(NatsOpenError::Unreachable(_))),
        "{refused:?}"
    );
    eprintln!("unreachable answered in {:?}", tried.elapsed());

    // The optimistic-concurrency primitive itself.
    let subject = format!("{}.{NAMESPACE}.1", config.subject_prefix);
    let first = log.append(&subject, 0, b"one").unwrap();
    assert_eq!(
        log.append(&subject, 0, b"two"),
        Err(ChangelogError::WrongLastSequence)
    );
    let read = log.read(&subject, 0, 10).unwrap();
    assert_eq!(read.len(), 1);
    assert_eq!(
        (read[0].seq, read[0].message.as_slice()),
        (first, &b"one"[..])
    );

    // Fencing: A owns partition 2, B takes it over, A is a zombie.
    let subject = format!("{}.{NAMESPACE}.2", config.subject_prefix);
    let mut a = PartitionOwner::take_over(&log, &subject, NAMESPACE, 2, 0xa, 0, &mut |_| {})
        .unwrap()
        .owner;
    let mut acked = Vec::new();
    for n in 0..50 {
        acked.push(a.append(&log, &[(DEADLINE, &mark(2, n))]).unwrap());
    }
    let mut handed = Vec::new();
    let restored = PartitionOwner::take_over(&log, &subject, NAMESPACE, 2, 0xb, 0, &mut |s| {
        handed.push(s.seq)
    })
    .unwrap();
    assert_eq!(
        restored.messages, 51,
        "A's owner message and its 50 batches"
    );
    assert_eq!(&handed[1..], &acked[..]);
    let mut b = restored.owner;
    match a.append(&log, &[(DEADLINE, &mark(2, 99))]) {
        Err(ReplicationError::Fenced { by, .. }) => assert_eq!(by, 0xb),
        other => panic!("the zombie was not fenced: {other:?}"),
    }
    b.append(&log, &[(DEADLINE, &mark(2, 100))]).unwrap();
    let in_stream: Vec<(u64, u64)> = log
        .read(&subject, 0, 1000)
        .unwrap()
        .iter()
        .map(|e| decode(&e.message))
        .collect();
    assert_eq!(in_stream.len(), 53);
    assert_eq!(
        in_stream[51..],
        [(0xb, 1), (0xb, 2)],
        "after B's owner message only B's: the zombie's append never landed"
    );

    // A node SIGKILLed mid-run and restarted: appends go on (retried through the
    // outage within a bound), and each landed once, in order.
    let subject = format!("{}.{NAMESPACE}.3", config.subject_prefix);
    let mut owner = PartitionOwner::take_over(&log, &subject, NAMESPACE, 3, 0xc, 0, &mut |_| {})
        .unwrap()
        .owner;
    let mut landed = Vec::new();
    let mut errors = 0;
    let started = Instant::now();
    let leader = cluster.stream_leader(&config.stream);
    let victim = leader.unwrap_or(0);
    eprintln!("stream leader: {leader:?}; SIGKILL of node {victim} after 200 appends");
    for n in 0..600u64 {
        if n == 200 {
            cluster.kill_node(victim);
        }
        if n == 400 {
            cluster.start_node(victim).unwrap();
        }
        let mut answer = owner.append(&log, &[(DEADLINE, &mark(3, n))]);
        while let Err(ReplicationError::Changelog(e)) = &answer {
            errors += 1;
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the cluster did not recover: {e}"
            );
            std::thread::sleep(Duration::from_millis(100));
            answer = owner.settle_pending(&log).map(|s| s.expect("pending"));
        }
        landed.push(answer.unwrap());
    }
    // What a take-over restores: each batch once, in order, at the sequence its
    // append was answered with; copies a leader change landed twice are skipped as
    // stale. (Reads too may fail while the restarted node catches up: retried.)
    let (restored, handed) = loop {
        let mut handed = Vec::new();
        match PartitionOwner::take_over(&log, &subject, NAMESPACE, 3, 0xd, 0, &mut |s| {
            handed.push((s.seq, s.owner, s.batch))
        }) {
            Ok(restored) => break (restored, handed),
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "the cluster did not recover: {e}"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    let batches: Vec<u64> = handed.iter().map(|&(_, _, b)| b).collect();
    assert_eq!(
        batches,
        (1..=601).collect::<Vec<u64>>(),
        "each once, in order"
    );
    assert!(handed.iter().all(|&(_, owner, _)| owner == 0xc));
    let seqs: Vec<u64> = handed.iter().skip(1).map(|&(s, _, _)| s).collect();
    assert_eq!(
        seqs, landed,
        "restored at the sequences the appends were answered with"
    );
    assert!(restored.damaged.is_empty());
    eprintln!(
        "600 appends through the SIGKILL and restart of node {victim}: {errors} retried calls, \
         {} stale copies skipped by the restore, {:?}",
        restored.stale,
        started.elapsed()
    );
}
