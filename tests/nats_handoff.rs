//! End to end on a real NATS JetStream cluster (feature `nats`; `.ci/nats` installs
//! `nats-server` and runs this): `idemstore demo --machines 3` as a child process,
//! which starts three JetStream nodes on loopback and three consumer processes with a
//! store directory each, sharing 6 partitions of 10,000 orders with 5% producer
//! retries; a rebalance, a handoff without revoke (Sync) or a `kill -9` of a consumer
//! every 300 deliveries (a few hundred ms), one consumer's directory deleted (machine
//! loss), one NATS node `kill -9`ed and restarted mid-run. It fails, never skips,
//! when `nats-server` is missing. Deductions are counted from the consumers' ledgers.

use std::process::Command;

fn field(line: &str, name: &str) -> u64 {
    let key = format!("\"{name}\":");
    let at = line
        .find(&key)
        .unwrap_or_else(|| panic!("{name} in {line}"))
        + key.len();
    line[at..]
        .split([',', '}'])
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|e| panic!("{name} in {line}: {e}"))
}

#[test]
fn partitions_move_between_consumer_processes_without_double_processing() {
    assert!(
        idemstore::replication::nats_server_binary().is_some(),
        "this test needs nats-server (.ci/nats installs it and runs this test)"
    );
    let dir = tempfile::tempdir().unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .args([
            "demo",
            "--machines",
            "3",
            "--orders",
            "10000",
            "--json",
            "--dir",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    let run = |mode: &str| -> String {
        stdout
            .lines()
            .find(|l| l.contains(&format!("\"mode\":\"{mode}\"")))
            .unwrap_or_else(|| panic!("no {mode} run in: {stdout}\n{stderr}"))
            .to_string()
    };
    let (none, asynch, sync) = (run("none"), run("async"), run("sync"));
    for line in [&none, &asynch, &sync] {
        assert!(field(line, "deliveries") > 10_000, "{line}");
        assert!(field(line, "rebalances") >= 10, "{line}");
        assert!(field(line, "kills") >= 3, "{line}");
        assert_eq!(field(line, "machines_lost"), 1, "{line}");
    }
    for line in [&asynch, &sync] {
        assert_eq!(field(line, "nats_node_restarts"), 1, "{line}");
    }
    // The negative control: without replication, each new owner lacks the marks.
    assert!(field(&none, "deducted_twice") > 0, "{none}");
    // Sync: never, whatever happened; its zombies were refused.
    assert_eq!(field(&sync, "deducted_twice"), 0, "{sync}");
    // (A zombie's message may also be answered Duplicate from its own marks, when it
    // is a producer retry of an order it processed: harmless, and not counted.)
    assert!(field(&sync, "zombie_writes_refused") > 0, "{sync}");
    // Async: only after the machine loss, and within its unflushed window.
    assert!(
        field(&asynch, "deducted_twice") <= field(&asynch, "loss_window"),
        "{asynch}"
    );
    assert!(output.status.success(), "exit {:?}", output.status);
}
