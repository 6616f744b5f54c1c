//! Guards the offline tools of the `idemstore` binary — `stats`, `get`, `scan`,
//! `verify`, `export`, `import` — on real store directories that each test builds
//! through the library (real clock, one-hour ttl, every status present, one id that
//! is not UTF-8). Each subcommand runs as the built binary, the way an operator runs
//! it: the tests check its output, its exit code (0 done, 1 a negative answer, 2 an
//! error), that it refuses a directory a live `Store` holds, that it never creates a
//! store where there is none, that `verify` finds a flipped byte with its file and
//! offset while changing nothing on disk, and that export → import into a fresh
//! directory reproduces the same records.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use idemstore::{Begin, Policy, Store};

fn idemstore(args: &[&str], dir: &Path, stdin: Option<&[u8]>) -> Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemstore"));
    command.arg(args[0]).arg(dir).args(&args[1..]);
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("starting idemstore");
    let mut pipe = child.stdin.take().unwrap();
    pipe.write_all(stdin.unwrap_or_default()).unwrap();
    drop(pipe);
    child.wait_with_output().expect("running idemstore")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn show(output: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        output.status.code(),
        text(&output.stdout),
        text(&output.stderr)
    )
}

/// A store with 5 seen, 1 completed, 1 failed, 1 in progress in `inventory`, and 1
/// released plus 1 seen non-UTF-8 id in `payments`; one removed key.
fn build_store(dir: &Path) {
    let store = Store::open(dir).unwrap();
    let hour = Policy::ttl(Duration::from_secs(3600));
    let inventory = store.namespace("inventory", hour).unwrap();
    for i in 1..=5 {
        assert!(
            inventory
                .check_and_set(format!("order-{i}"))
                .unwrap()
                .is_first()
        );
    }
    let Begin::Acquired(claim) = inventory.begin("order-6").unwrap() else {
        panic!("order-6 not acquired")
    };
    claim.complete(Some(b"deducted 3 units")).unwrap();
    let Begin::Acquired(claim) = inventory.begin("order-7").unwrap() else {
        panic!("order-7 not acquired")
    };
    claim.fail().unwrap();
    let Begin::Acquired(claim) = inventory.begin("order-8").unwrap() else {
        panic!("order-8 not acquired")
    };
    // Still in progress when the store closes, as after a crash mid-work.
    std::mem::forget(claim);
    assert!(inventory.check_and_set("order-9").unwrap().is_first());
    assert!(inventory.remove("order-9").unwrap());
    let payments = store.namespace("payments", hour).unwrap();
    let Begin::Acquired(claim) = payments.begin("tx-1").unwrap() else {
        panic!("tx-1 not acquired")
    };
    claim.release().unwrap();
    assert!(
        payments
            .check_and_set([0xff, 0x00, 0x01])
            .unwrap()
            .is_first()
    );
    store.close().unwrap();
}

fn built() -> (tempfile::TempDir, PathBuf) {
    let temp = tempfile::tempdir().unwrap();
    let dir = temp.path().join("store");
    build_store(&dir);
    (temp, dir)
}

/// Every file in `dir` with its bytes.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            (
                entry.file_name().into_string().unwrap(),
                std::fs::read(entry.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn stats_shows_keys_by_namespace_and_status() {
    let (_temp, dir) = built();
    let output = idemstore(&["stats"], &dir, None);
    assert_eq!(output.status.code(), Some(0), "{}", show(&output));
    let out = text(&output.stdout);
    assert!(out.contains("10 live, 1 removed"), "{out}");
    let row = |name: &str| -> Vec<u64> {
        let line = out
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} row:\n{out}"));
        line.split_whitespace()
            .skip(1)
            .map(|n| n.replace(',', "").parse().unwrap())
            .collect()
    };
    // seen, in_progress, released, completed, failed, total. The builder closed with
    // order-8 claimed: the open releases that dead claim (docs/CONTRACT.md §3.6).
    assert_eq!(row("inventory"), vec![5, 0, 1, 1, 1, 8]);
    assert_eq!(row("payments"), vec![1, 0, 1, 0, 0, 2]);
    for label in [
        "buckets",
        "disk",
        "oldest expiry",
        "newest expiry",
        "corrupt records skipped 0",
        "claims released at open 1",
    ] {
        assert!(out.contains(label), "no {label:?} in:\n{out}");
    }
}

#[test]
fn get_prints_the_full_record_human_and_json() {
    let (_temp, dir) = built();
    let output = idemstore(&["get", "inventory", "order-6"], &dir, None);
    assert_eq!(output.status.code(), Some(0), "{}", show(&output));
    let out = text(&output.stdout);
    for expected in [
        "status        completed",
        "attempts      1",
        "lease until   -",
        "result        \"deducted 3 units\" (16 bytes)",
        "completed at  20",
        "expires at    20",
    ] {
        assert!(out.contains(expected), "no {expected:?} in:\n{out}");
    }

    let output = idemstore(&["get", "inventory", "order-8", "--json"], &dir, None);
    assert_eq!(output.status.code(), Some(0), "{}", show(&output));
    let out = text(&output.stdout);
    assert!(
        out.starts_with("{\"namespace\":\"inventory\",\"id\":\"order-8\",\"status\":\"released\""),
        "{out}"
    );
    assert!(out.contains("\"attempts\":1"), "{out}");
    assert!(out.contains("\"lease_until_ms\":null"), "{out}");
    assert_eq!(out.lines().count(), 1);

    let output = idemstore(
        &["get", "payments", "ff0001", "--hex", "--json"],
        &dir,
        None,
    );
    assert_eq!(output.status.code(), Some(0), "{}", show(&output));
    assert!(
        text(&output.stdout).contains("\"id_hex\":\"ff0001\""),
        "{}",
        show(&output)
    );

    for (namespace, id) in [
        ("inventory", "order-9"),
        ("inventory", "nope"),
        ("nope", "order-1"),
    ] {
        let output = idemstore(&["get", namespace, id], &dir, None);
        assert_eq!(output.status.code(), Some(1), "{}", show(&output));
        assert!(
            text(&output.stderr).contains("is not remembered"),
            "{}",
            show(&output)
        );
    }
    // Looking up an unknown namespace did not create it.
    let store = Store::open(&dir).unwrap();
    assert_eq!(store.namespace_names(), vec!["inventory", "payments"]);
}

#[test]
fn scan_lists_json_lines_filtered_by_namespace_status_and_limit() {
    let (_temp, dir) = built();
    let lines = |args: &[&str]| -> Vec<String> {
        let output = idemstore(args, &dir, None);
        assert_eq!(output.status.code(), Some(0), "{}", show(&output));
        text(&output.stdout).lines().map(str::to_string).collect()
    };
    let all = lines(&["scan"]);
    assert_eq!(all.len(), 10, "{all:#?}");
    assert!(all.iter().all(|l| l.starts_with("{\"namespace\":\"")));
    assert!(
        !all.iter().any(|l| l.contains("order-9")),
        "a removed key was listed"
    );

    let seen = lines(&["scan", "--ns", "inventory", "--status", "seen"]);
    assert_eq!(seen.len(), 5, "{seen:#?}");
    assert!(
        seen.iter()
            .all(|l| l.contains("\"status\":\"seen\"") && l.contains("inventory"))
    );

    assert_eq!(lines(&["scan", "--ns", "payments"]).len(), 2);
    assert_eq!(lines(&["scan", "--limit", "3"]).len(), 3);
    assert_eq!(lines(&["scan", "--ns", "unknown"]).len(), 0);

    let output = idemstore(&["scan", "--status", "done"], &dir, None);
    assert_eq!(output.status.code(), Some(2), "{}", show(&output));
    assert!(
        text(&output.stderr).contains("completed"),
        "{}",
        show(&output)
    );
}

#[test]
fn verify_passes_a_sound_store_and_finds_a_flipped_byte_with_file_and_offset() {
    let (_temp, dir) = built();
    let before = files(&dir);
    let output = idemstore(&["verify"], &dir, None);
    assert_eq!(output.status.code(), Some(0), "{}", show(&output));
    assert!(
        text(&output.stdout).contains("OK: no damage found"),
        "{}",
        show(&output)
    );
    assert!(
        text(&output.stdout).contains("2 namespaces"),
        "{}",
        show(&output)
    );

    // Damage the id of the first record of the segment with the most records: valid
    // records follow it, so it is corruption, not a torn tail.
    let (name, bytes) = before
        .iter()
        .filter(|(name, _)| name.ends_with(".seg"))
        .max_by_key(|(_, bytes)| bytes.len())
        .unwrap();
    assert!(bytes.len() > 64 + 2 * 40, "{name} holds one record only");
    let mut damaged = bytes.clone();
    damaged[64 + 33] ^= 0x40;
    std::fs::write(dir.join(name), &damaged).unwrap();
    let before = files(&dir);

    let output = idemstore(&["verify"], &dir, None);
    assert_eq!(output.status.code(), Some(1), "{}", show(&output));
    let out = text(&output.stdout);
    let expected = format!(
        "DAMAGE  {} at offset 64: damaged record: checksum mismatch",
        dir.join(name).display()
    );
    assert!(out.contains(&expected), "no {expected:?} in:\n{out}");
    assert!(out.contains("DAMAGED: 1 problems"), "{out}");
    assert_eq!(files(&dir), before, "verify changed the directory");

    // The library says the same.
    let report = idemstore::verify(&dir).unwrap();
    assert_eq!(report.problem_count, 1);
    assert_eq!(report.problems[0].file(), dir.join(name));
    assert_eq!(report.problems[0].offset(), 64);

    // The store still opens; stats counts the skipped record.
    let output = idemstore(&["stats"], &dir, None);
    assert_eq!(output.status.code(), Some(0), "{}", show(&output));
    assert!(
        text(&output.stdout).contains("corrupt records skipped 1 (run `idemstore verify`"),
        "{}",
        show(&output)
    );
}

#[test]
fn export_then_import_into_a_fresh_directory_reproduces_every_record() {
    let (temp, dir) = built();
    let export = idemstore(&["export"], &dir, None);
    assert_eq!(export.status.code(), Some(0), "{}", show(&export));
    assert!(
        text(&export.stderr).contains("10 records"),
        "{}",
        show(&export)
    );

    let fresh = temp.path().join("restored");
    let import = idemstore(&["import"], &fresh, Some(&export.stdout));
    assert_eq!(import.status.code(), Some(0), "{}", show(&import));
    assert!(
        text(&import.stderr).contains("10 records written, 0 already remembered"),
        "{}",
        show(&import)
    );

    let again = idemstore(&["export"], &fresh, None);
    assert_eq!(again.status.code(), Some(0), "{}", show(&again));
    let sorted = |bytes: &[u8]| {
        let mut lines: Vec<String> = text(bytes).lines().map(str::to_string).collect();
        lines.sort();
        lines
    };
    assert_eq!(sorted(&again.stdout), sorted(&export.stdout));

    // The restored store answers like the original: a duplicate, a replayed result.
    let store = Store::open(&fresh).unwrap();
    let inventory = store
        .namespace("inventory", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    assert!(!inventory.check_and_set("order-1").unwrap().is_first());
    match inventory.begin("order-6").unwrap() {
        Begin::Completed(record) => assert_eq!(record.result(), Some(&b"deducted 3 units"[..])),
        other => panic!("order-6 after import: {other:?}"),
    }
    store.close().unwrap();

    // Importing again changes nothing.
    let import = idemstore(&["import"], &fresh, Some(&export.stdout));
    assert_eq!(import.status.code(), Some(0), "{}", show(&import));
    assert!(
        text(&import.stderr).contains("0 records written, 10 already remembered"),
        "{}",
        show(&import)
    );

    // A bad line stops the import and says where and what to do.
    let import = idemstore(
        &["import"],
        &fresh,
        Some(b"{\"namespace\":\"inventory\"}\n"),
    );
    assert_eq!(import.status.code(), Some(2), "{}", show(&import));
    assert!(
        text(&import.stderr).contains("line 1: missing \"id\""),
        "{}",
        show(&import)
    );
}

#[test]
fn every_subcommand_refuses_a_directory_a_live_store_holds() {
    let (_temp, dir) = built();
    let store = Store::open(&dir).unwrap();
    let before = files(&dir);
    for args in [
        &["stats"][..],
        &["get", "inventory", "order-1"],
        &["scan"],
        &["verify"],
        &["export"],
        &["import"],
    ] {
        let output = idemstore(args, &dir, Some(b""));
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", show(&output));
        let stderr = text(&output.stderr);
        assert!(
            stderr.contains("is held by a running process") && stderr.contains("stop that process"),
            "{args:?}: {}",
            show(&output)
        );
        assert!(output.stdout.is_empty(), "{args:?}: {}", show(&output));
    }
    assert_eq!(files(&dir), before);
    store.close().unwrap();
}

#[test]
fn no_subcommand_creates_a_store_where_there_is_none() {
    let temp = tempfile::tempdir().unwrap();
    let missing = temp.path().join("missing");
    let empty = temp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for args in [
        &["stats"][..],
        &["get", "inventory", "order-1"],
        &["scan"],
        &["verify"],
        &["export"],
    ] {
        let output = idemstore(args, &missing, None);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", show(&output));
        assert!(
            text(&output.stderr).contains("does not exist; give the data directory"),
            "{}",
            show(&output)
        );
        assert!(!missing.exists(), "{args:?} created {}", missing.display());

        let output = idemstore(args, &empty, None);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {}", show(&output));
        assert!(
            text(&output.stderr).contains("is not an idemstore store"),
            "{}",
            show(&output)
        );
        assert_eq!(
            std::fs::read_dir(&empty).unwrap().count(),
            0,
            "{args:?} wrote into {}",
            empty.display()
        );
    }
    // import fills only an empty or new directory, not one with other files in it.
    std::fs::write(empty.join("notes.txt"), "mine").unwrap();
    let output = idemstore(&["import"], &empty, Some(b""));
    assert_eq!(output.status.code(), Some(2), "{}", show(&output));
    assert!(
        text(&output.stderr).contains("holds files but no idemstore store"),
        "{}",
        show(&output)
    );
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 1);
}

#[test]
fn the_reading_tools_change_nothing_in_the_directory() {
    let (_temp, dir) = built();
    // A torn tail a writable open would cut, and a checkpoint it would delete and
    // rewrite: the reading tools open read-only and must leave both as they are.
    let segment = files(&dir)
        .into_keys()
        .find(|name| name.ends_with(".seg"))
        .expect("a segment");
    let mut bytes = std::fs::read(dir.join(&segment)).unwrap();
    bytes.extend_from_slice(b"\x07torn tail of a crashed write");
    std::fs::write(dir.join(&segment), &bytes).unwrap();
    let before = files(&dir);
    assert!(before.contains_key("CHECKPOINT"), "{:?}", before.keys());
    for args in [
        &["stats"][..],
        &["get", "inventory", "order-6"],
        &["scan"],
        &["export"],
    ] {
        let output = idemstore(args, &dir, None);
        assert_eq!(output.status.code(), Some(0), "{args:?}: {}", show(&output));
        assert!(
            files(&dir) == before,
            "idemstore {args:?} changed the directory"
        );
    }
    // The control: a writable open cuts the tail.
    Store::open(&dir).unwrap().close().unwrap();
    assert!(files(&dir)[&segment].len() < bytes.len());
}
