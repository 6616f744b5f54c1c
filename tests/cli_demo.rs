//! Guards the main job, `idemstore demo`, end to end: the built binary replays the
//! duplicate-delivery incident on a real store in a temporary directory, killing real
//! consumer processes with SIGKILL mid-batch, and the test reads its report the way a
//! newcomer would. It checks what the demo claims — orders deducted twice without
//! idemstore, none deducted twice or never with it — and the exit status that CI
//! relies on. Sizes are small so it runs in a few seconds.

use std::path::Path;
use std::process::{Command, Output};

fn demo(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_idemstore"))
        .arg("demo")
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .expect("running idemstore demo")
}

/// The two numbers (without, with) on the report row starting with `label`.
fn row(report: &str, label: &str) -> (u64, u64) {
    let line = report
        .lines()
        .map(str::trim_start)
        .find(|line| line.starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} row in the report:\n{report}"));
    let numbers: Vec<u64> = line[label.len()..]
        .split_whitespace()
        .map(|word| {
            word.replace(',', "")
                .parse()
                .unwrap_or_else(|_| panic!("{word:?} in {line:?} is not a count"))
        })
        .collect();
    assert_eq!(numbers.len(), 2, "{line:?} should hold two counts");
    (numbers[0], numbers[1])
}

#[test]
fn the_demo_deducts_twice_without_idemstore_and_never_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let output = demo(dir.path(), &["--messages", "2000", "--crashes", "2"]);
    let report = String::from_utf8(output.stdout).unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "demo failed ({}):\n{report}\n{stderr}",
        output.status
    );

    let (twice_without, twice_with) = row(&report, "orders deducted twice");
    assert!(twice_without > 0, "the incident did not happen:\n{report}");
    assert_eq!(twice_with, 0, "{report}");
    assert_eq!(row(&report, "orders never deducted"), (0, 0), "{report}");
    let (deliveries_without, deliveries_with) = row(&report, "deliveries");
    assert!(
        deliveries_without > 2000 && deliveries_with > 2000,
        "{report}"
    );
    let (caught_without, caught_with) = row(&report, "duplicates caught");
    assert_eq!(caught_without, 0, "{report}");
    assert!(caught_with > 0, "{report}");
    // Two kills and one rebalance: four consumer processes in each run.
    assert_eq!(row(&report, "consumer processes"), (4, 4), "{report}");
    assert!(report.contains("PASS"), "{report}");

    // The store is kept where the report says, and holds every order.
    let store = dir.path().join("with-idemstore").join("store");
    assert!(report.contains(&store.display().to_string()), "{report}");
    let store = idemstore::Store::open(&store).unwrap();
    let inventory = store
        .namespace(
            "inventory-deduct",
            idemstore::Policy::ttl(std::time::Duration::from_secs(48 * 3600)),
        )
        .unwrap();
    let record = inventory.get("order-0001999").unwrap().expect("remembered");
    assert_eq!(record.status, idemstore::Status::Completed);
    store.close().unwrap();
}

#[test]
fn the_demo_refuses_a_directory_that_is_not_empty() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("something"), b"keep me").unwrap();
    let output = demo(dir.path(), &["--messages", "10"]);
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("is not empty"), "{stderr}");
    assert_eq!(
        std::fs::read(dir.path().join("something")).unwrap(),
        b"keep me"
    );
}
