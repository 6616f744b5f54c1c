//! Guards DESIGN.md §3's crash promise: kill -9 at any instant loses no acknowledged
//! operation and never lets a remembered key be reported `First` again.
//!
//! The test re-runs its own binary as a child (selected by an environment variable).
//! The child opens the store — mostly in `Interval` mode, every third cycle in
//! `Immediate` mode — and walks ids from a start the parent chooses (overlapping the
//! ids of earlier cycles), calling `check_and_set` on most and `begin` + `complete`
//! with a result on every fifth; it prints one line per acknowledged answer, only
//! after the call returned. The parent SIGKILLs it at a random moment, 20+ times.
//! After each kill the parent reopens the store and checks that every key any child
//! saw acknowledged is still remembered (marks are `Duplicate`, completed claims are
//! `Completed` with their result), and across all cycles that no key was ever
//! reported `First` (or `Acquired`) twice. Small segments make the children roll over
//! to new segment files, so kills also land around segment creation.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use idemstore::{Begin, Durability, Outcome, Policy, Status, Store};

const CHILD_ENV: &str = "IDEMSTORE_CRASH_CHILD";
const TEST_NAME: &str = "kill_9_at_random_moments_loses_no_acknowledged_operation";
const CYCLES: u64 = 24;

fn marks_policy() -> Policy {
    Policy::ttl(Duration::from_secs(24 * 3600))
}

fn claims_policy() -> Policy {
    Policy::ttl(Duration::from_secs(24 * 3600)).lease(Duration::from_secs(3600))
}

fn open(dir: &str, immediate: bool) -> Store {
    Store::builder(dir)
        .durability(if immediate {
            Durability::Immediate
        } else {
            Durability::Interval(Duration::from_millis(20))
        })
        .segment_size(64 * 1024)
        .open()
        .unwrap()
}

fn is_claim(i: u64) -> bool {
    i % 5 == 4
}

fn result_of(i: u64) -> Vec<u8> {
    format!("result-{i}").into_bytes()
}

/// Child mode: write until killed, printing each acknowledged answer.
fn child(spec: &str) -> ! {
    let mut parts = spec.split(';');
    let dir = parts.next().unwrap();
    let start: u64 = parts.next().unwrap().parse().unwrap();
    let immediate = parts.next().unwrap() == "immediate";
    let store = open(dir, immediate);
    let marks = store.namespace("marks", marks_policy()).unwrap();
    let claims = store.namespace("claims", claims_policy()).unwrap();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    for i in start.. {
        let id = format!("id-{i}");
        let line = if is_claim(i) {
            match claims.begin(&id).unwrap() {
                Begin::Acquired(claim) => {
                    claim.complete(Some(&result_of(i))).unwrap();
                    format!("completed {i}")
                }
                Begin::Completed(record) => {
                    assert_eq!(record.result(), Some(&result_of(i)[..]));
                    format!("replayed {i}")
                }
                // A claim a killed child acquired but never completed: its lease is live.
                Begin::InProgress(_) => format!("held {i}"),
                Begin::Exhausted(record) => panic!("unexpected exhausted {record:?}"),
            }
        } else {
            match marks.check_and_set(&id).unwrap() {
                Outcome::First => format!("first {i}"),
                Outcome::Duplicate(_) => format!("duplicate {i}"),
            }
        };
        writeln!(out, "{line}").unwrap();
        out.flush().unwrap();
    }
    unreachable!()
}

/// A small xorshift generator seeded from the clock (the seed is printed).
struct Rng(u64);

impl Rng {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % below
    }
}

#[test]
fn kill_9_at_random_moments_loses_no_acknowledged_operation() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    println!("seed {seed}");
    let mut rng = Rng(seed);
    let dir = tempfile::tempdir().unwrap();
    let dir_str = dir.path().to_str().unwrap().to_string();

    let mut acknowledged_marks: HashSet<u64> = HashSet::new();
    let mut reported_first: HashSet<u64> = HashSet::new();
    let mut completed: HashSet<u64> = HashSet::new();
    let mut highest = 0u64;
    let mut total_lines = 0usize;

    for cycle in 0..CYCLES {
        let immediate = cycle % 3 == 2;
        // Revisit up to 300 ids of earlier cycles (some acknowledged, some maybe not).
        let start = highest.saturating_sub(rng.next(300));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(
                CHILD_ENV,
                format!(
                    "{dir_str};{start};{}",
                    if immediate { "immediate" } else { "interval" }
                ),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut reader = BufReader::new(stdout);
            let mut lines = Vec::new();
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                // A line without its newline was cut by the kill: not acknowledged.
                if line.ends_with('\n') {
                    if line.ends_with("ready\n") {
                        let _ = ready_tx.send(());
                    }
                    lines.push(line.trim_end().to_string());
                }
                line.clear();
            }
            lines
        });
        // Wait until the child has the store open, then kill it at a random moment.
        let ready = ready_rx.recv_timeout(Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(rng.next(100)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let lines = reader.join().unwrap();
        assert!(
            ready.is_ok(),
            "cycle {cycle}: the child never opened the store"
        );

        for line in &lines {
            let Some((what, i)) = line.split_once(' ') else {
                continue;
            };
            let Ok(i) = i.parse::<u64>() else { continue };
            highest = highest.max(i + 1);
            total_lines += 1;
            match what {
                "first" => {
                    assert!(
                        reported_first.insert(i),
                        "cycle {cycle}: id-{i} reported First twice"
                    );
                    acknowledged_marks.insert(i);
                }
                "duplicate" => {
                    acknowledged_marks.insert(i);
                }
                "completed" => {
                    assert!(
                        completed.insert(i),
                        "cycle {cycle}: claim id-{i} acquired and completed twice"
                    );
                }
                "replayed" => {
                    completed.insert(i);
                }
                "held" => {}
                other => panic!("unexpected line {other}"),
            }
        }

        // Every acknowledged answer must have survived the kill.
        let store = open(&dir_str, false);
        let marks = store.namespace("marks", marks_policy()).unwrap();
        let claims = store.namespace("claims", claims_policy()).unwrap();
        for &i in &acknowledged_marks {
            let outcome = marks.check_and_set(format!("id-{i}")).unwrap();
            assert!(
                !outcome.is_first(),
                "cycle {cycle}: acknowledged id-{i} is First again"
            );
        }
        for &i in &completed {
            let record = claims
                .get(format!("id-{i}"))
                .unwrap()
                .unwrap_or_else(|| panic!("cycle {cycle}: completed claim id-{i} lost"));
            assert_eq!(record.status, Status::Completed, "cycle {cycle}: id-{i}");
            assert_eq!(
                record.result(),
                Some(&result_of(i)[..]),
                "cycle {cycle}: id-{i}"
            );
            assert_eq!(record.attempts, 1, "cycle {cycle}: id-{i}");
        }
        let stats = store.stats();
        assert_eq!(
            stats.corrupt_records_skipped, 0,
            "cycle {cycle}: a kill must only leave torn tails"
        );
        drop((marks, claims));
        store.close().unwrap();
    }
    println!(
        "{CYCLES} kills, {total_lines} acknowledged answers, {} marks, {} completed claims",
        acknowledged_marks.len(),
        completed.len()
    );
    assert!(
        acknowledged_marks.len() > 100,
        "the children acknowledged too little to test anything"
    );
    assert!(!completed.is_empty());
}
