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

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemstore::fuzzing;
use idemstore::replication::{
    Changelog, ChangelogError, NatsChangelog, NatsConfig, NatsOpenError, PartitionOwner,
    ReplicationError,
};

const NAMESPACE: &str = "inventory";

/// Three JetStream nodes on loopback; stopped (SIGKILL) when dropped.
struct Cluster {
    nodes: Vec<Option<Child>>,
    args: Vec<Vec<String>>,
    client_ports: Vec<u16>,
    monitor_ports: Vec<u16>,
    _dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn nats_server() -> String {
    for candidate in ["/usr/sbin/nats-server", "/usr/bin/nats-server"] {
        if Path::new(candidate).exists() {
            return candidate.to_string();
        }
    }
    panic!(
        "nats-server is not installed: this test needs it (Debian: apt-get install \
         nats-server, or run .ci/nats, which installs it and runs this test)"
    );
}

impl Cluster {
    fn start() -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let client_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let route_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let monitor_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let routes = route_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        let args: Vec<Vec<String>> = (0..3)
            .map(|i| {
                let store = dir.path().join(format!("n{i}"));
                vec![
                    "-js".into(),
                    "-sd".into(),
                    store.display().to_string(),
                    "-n".into(),
                    format!("n{i}"),
                    "-a".into(),
                    "127.0.0.1".into(),
                    "-p".into(),
                    client_ports[i].to_string(),
                    "-m".into(),
                    monitor_ports[i].to_string(),
                    "--cluster_name".into(),
                    "idemstore-test".into(),
                    "--cluster".into(),
                    format!("nats://127.0.0.1:{}", route_ports[i]),
                    "--routes".into(),
                    routes.clone(),
                ]
            })
            .collect();
        let mut cluster = Cluster {
            nodes: vec![None, None, None],
            args,
            client_ports,
            monitor_ports,
            _dir: dir,
        };
        for i in 0..3 {
            cluster.start_node(i);
        }
        cluster
    }

    fn start_node(&mut self, i: usize) {
        let child = Command::new(nats_server())
            .args(&self.args[i])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server");
        self.nodes[i] = Some(child);
    }

    fn kill_node(&mut self, i: usize) {
        if let Some(mut child) = self.nodes[i].take() {
            child.kill().unwrap(); // SIGKILL
            child.wait().unwrap();
        }
    }

    /// The node that leads `stream` now, from the monitoring endpoint of a node
    /// that is up (`/jsz?streams=true`).
    fn stream_leader(&self, stream: &str) -> Option<usize> {
        use std::io::{Read, Write};
        for (i, port) in self.monitor_ports.iter().enumerate() {
            if self.nodes[i].is_none() {
                continue;
            }
            let Ok(mut http) = std::net::TcpStream::connect(("127.0.0.1", *port)) else {
                continue;
            };
            let _ = http.set_read_timeout(Some(Duration::from_secs(2)));
            let request = "GET /jsz?streams=true HTTP/1.0\r\nHost: localhost\r\n\r\n";
            if http.write_all(request.as_bytes()).is_err() {
                continue;
            }
            let mut body = String::new();
            let _ = http.read_to_string(&mut body);
            body.retain(|c| !c.is_whitespace());
            // ... "name":"<stream>", ... "cluster":{ ... "leader":"n<i>" ...
            let at = body.find(&format!("\"name\":\"{stream}\""))?;
            let rest = &body[at..];
            let leader = rest.find("\"leader\":\"n")?;
            let digit = rest[leader + 11..].chars().next()?;
            return digit.to_digit(10).map(|d| d as usize);
        }
        None
    }

    fn urls(&self) -> Vec<String> {
        self.client_ports
            .iter()
            .map(|p| format!("nats://127.0.0.1:{p}"))
            .collect()
    }

    fn config(&self, stream: &str) -> NatsConfig {
        let mut config = NatsConfig::new(self.urls());
        config.stream = stream.into();
        config.subject_prefix = format!("idemstore.{}", stream.to_lowercase());
        config.timeout = Duration::from_secs(3);
        config
    }

    /// Opens the changelog, retrying while the cluster elects its first leaders.
    fn open(&self, config: &NatsConfig) -> NatsChangelog {
        let started = Instant::now();
        loop {
            match NatsChangelog::open(config) {
                Ok(log) => return log,
                Err(e) if started.elapsed() < Duration::from_secs(30) => {
                    eprintln!("waiting for the cluster: {e}");
                    std::thread::sleep(Duration::from_millis(250));
                }
                Err(e) => panic!("the cluster did not come up in 30 s: {e}"),
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for i in 0..3 {
            self.kill_node(i);
        }
    }
}

fn mark(n: u64) -> Vec<u8> {
    fuzzing::encode_mark(0, n, 1_700_000_000_000, format!("order-{n}").as_bytes())
}

fn decode(message: &[u8]) -> (u64, u64) {
    let m = fuzzing::decode_changelog_message(message).expect("a message in the stream decodes");
    (m.owner, m.batch)
}

#[test]
fn the_changelog_on_a_real_cluster() {
    let mut cluster = Cluster::start();
    let config = cluster.config("FENCING");
    let log = cluster.open(&config);

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
    assert_eq!(log.last(&subject).unwrap().unwrap().seq, first);
    assert_eq!(log.read(&subject, 0, 10).unwrap().len(), 1);

    // Fencing: A owns partition 2, B takes it over, A is a zombie.
    let subject = format!("{}.{NAMESPACE}.2", config.subject_prefix);
    let mut a = PartitionOwner::take_over(&log, &subject, NAMESPACE, 2, 0xa, 0, &mut |_| {})
        .unwrap()
        .owner;
    let mut acked = Vec::new();
    for n in 0..50 {
        acked.push(a.append(&log, &[(Some(n), &mark(n))]).unwrap());
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
    match a.append(&log, &[(None, &mark(99))]) {
        Err(ReplicationError::Fenced { by, .. }) => assert_eq!(by, 0xb),
        other => panic!("the zombie was not fenced: {other:?}"),
    }
    b.append(&log, &[(None, &mark(100))]).unwrap();
    let in_stream: Vec<(u64, u64)> = log
        .read(&subject, 0, 1000)
        .unwrap()
        .iter()
        .map(|e| decode(&e.message))
        .collect();
    assert_eq!(in_stream.len(), 53);
    assert!(
        !in_stream[52..].contains(&(0xa, 52)),
        "the zombie's append never landed"
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
            cluster.start_node(victim);
        }
        let mut answer = owner.append(&log, &[(Some(n), &mark(n))]);
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
