//! Guards docs/CONTRACT.md §3.2's crash promise at scale: kill -9 at any instant —
//! including during open and recovery and around segment roll-over — loses no
//! acknowledged operation and never lets a remembered key be `First` again; with
//! unsynced data dying too (power loss), nothing a completed sync covered is lost.
//!
//! Two loops share one model of what must be remembered, checked after every crash:
//!
//! - `lossy_kill_loop` (in process, ≥ 2,000 cycles): each cycle reopens the store on
//!   the simulated file system left by the previous crash — with a crash planned at a
//!   random I/O call, so some cycles die inside open/recovery — checks every promise
//!   and that every record intact in the image was replayed, then runs operations
//!   (marks, repeats, claims with results, flushes, clock moves) until the planned
//!   crash. The crash image rotates between `Immediate` + power cut with random damage
//!   (every acknowledgement must survive), `Interval` + kill -9 (the page cache
//!   survives: every acknowledgement must survive) and `Interval` + power cut (what a
//!   returned `flush` covered must survive). An operation counts as acknowledged only
//!   if it returned before the crash.
//! - `real_files_kill_loop` (≥ 500 cycles): the test binary re-runs itself as a child
//!   that opens a real directory — in `Interval` mode, every third cycle in
//!   `Immediate` — and walks ids from a start the parent chooses (overlapping earlier
//!   cycles' ids): `check_and_set` on most, `begin` + `complete` with a result on every
//!   fourth, printing each answer (and each acquisition with its attempt number) only
//!   after the call returned. The parent SIGKILLs it at a random moment (every fifth
//!   cycle without waiting for the open, so some kills land in recovery; every 25th
//!   after 50–100 ms of writing, so the child fills 64 KiB segments and the kill lands
//!   around a roll-over, which the parent asserts from the segment files the child
//!   created), reopens the directory and checks that every acknowledged mark is
//!   `Duplicate` and every completed claim `Completed` with its result and the attempt
//!   that completed it; across cycles, that no key was ever `First` twice, no claim
//!   completed twice, and no attempt number handed out twice; and that a kill leaves
//!   no corruption. A replayed result that differs is a failure too.
//!
//! `IDEMSTORE_SOAK_CYCLES=<n>` runs n lossy cycles and n / 4 real ones (at least the CI
//! counts); `IDEMSTORE_SEED` replays a run.

mod support;

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idemstore::testing::{self, Damage, SimVfs};
use idemstore::{Begin, Clock, Durability, ManualClock, Outcome, Policy, Status, Store, UnixMs};
use support::{Expect, Model, Promise, Rng};

const SOAK_ENV: &str = "IDEMSTORE_SOAK_CYCLES";
const LOSSY_CYCLES: u64 = 2_000;
const REAL_CYCLES: u64 = 500;

fn soak() -> u64 {
    support::env_u64(SOAK_ENV, 0)
}

fn sim_builder(clock: &ManualClock, durability: Durability) -> idemstore::StoreBuilder {
    Store::builder("/sim/store")
        .durability(durability)
        .bucket_width(support::BUCKET_WIDTH)
        .segment_size(64 * 1024)
        .clock(clock.clone())
}

/// Every other cycle of both loops runs with a 1-byte memory budget: each
/// `expire_now` (and reaper round) spills every live bucket to cold index files, so
/// repeats are answered from the cold tier and crashes land inside spills and merges.
fn budgeted(cycle: u64) -> bool {
    cycle % 2 == 1
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Crash {
    ImmediatePowerCut,
    IntervalKill,
    IntervalPowerCut,
}

#[test]
fn lossy_kill_loop() {
    let cycles = LOSSY_CYCLES.max(soak());
    let seed = support::seed("lossy kill loop");
    let mut rng = Rng::new(seed);
    let clock = ManualClock::new(UnixMs(support::T0_MS));
    let mut vfs = SimVfs::new();
    let mut model = Model::default();
    let mut next = 0u64;
    let mut recent: Vec<String> = Vec::new();
    let (mut acknowledged, mut crashed_in_open, mut checked, mut intact_checked) =
        (0u64, 0u64, 0u64, 0u64);
    let mut spilled = 0u64;
    let started = Instant::now();
    for cycle in 0..cycles {
        let crash = match cycle % 3 {
            0 => Crash::ImmediatePowerCut,
            1 => Crash::IntervalKill,
            _ => Crash::IntervalPowerCut,
        };
        let durability = match crash {
            Crash::ImmediatePowerCut => Durability::Immediate,
            _ => Durability::Interval(Duration::from_millis(1)),
        };
        let context = format!("cycle {cycle} ({crash:?})");
        // Recovery of the previous crash makes ~3 calls per segment: some crashes land there.
        let window = if rng.chance(25) { 60 } else { 400 };
        vfs.crash_at_call(1 + rng.below(window));
        let intact = vfs.intact_writes();
        let mut pending: Vec<Promise> = Vec::new();
        let mut flushed = 0usize;
        let mut builder = sim_builder(&clock, durability);
        if budgeted(cycle) {
            builder = builder.memory_budget(1);
        }
        let store = testing::open(builder, &vfs);
        let opened = store
            .as_ref()
            .ok()
            .and_then(|store| support::namespaces(store).ok());
        match (&store, opened) {
            (Ok(store), Some(ns)) => {
                let now = clock.now().0;
                match model.check(&ns, now) {
                    Ok(n) => checked += n as u64,
                    Err(violation) => panic!("{context}: after recovery: {violation}"),
                }
                match support::check_intact(&intact, &ns, now) {
                    Ok(n) => intact_checked += n as u64,
                    Err(violation) => panic!("{context}: after recovery: {violation}"),
                }
                for _ in 0..40 {
                    if vfs.crashed() {
                        break;
                    }
                    let now = clock.now().0;
                    let dice = rng.below(100);
                    let done: Option<Promise> = if dice < 60 || recent.is_empty() {
                        next += 1;
                        let id = format!("m-{next}");
                        match ns[0].check_and_set(&id) {
                            Ok(outcome) => {
                                recent.push(id.clone());
                                let mut m = Model::default();
                                m.mark(&id, &outcome, now);
                                m.keys.into_values().next()
                            }
                            Err(_) => None,
                        }
                    } else if dice < 75 {
                        let id = recent
                            [recent.len() - 1 - rng.below(recent.len().min(50) as u64) as usize]
                            .clone();
                        match ns[0].check_and_set(&id) {
                            Ok(outcome) => {
                                if outcome == Outcome::First && !vfs.crashed() {
                                    assert!(
                                        !model.must_remember(0, &id, now),
                                        "{context}: {id} is remembered but answered First again"
                                    );
                                }
                                let mut m = Model::default();
                                m.mark(&id, &outcome, now);
                                m.keys.into_values().next()
                            }
                            Err(_) => None,
                        }
                    } else if dice < 90 {
                        next += 1;
                        let id = format!("c-{next}");
                        let result = format!("result of {id}").repeat(1 + rng.below(8) as usize);
                        match ns[1].begin(&id) {
                            Ok(Begin::Acquired(claim)) => claim
                                .complete(Some(result.as_bytes()))
                                .ok()
                                .map(|()| Promise {
                                    ns: 1,
                                    id,
                                    expect: Expect::Completed(result.into_bytes()),
                                    until_ms: now + support::CLAIM_TTL_MS,
                                }),
                            Ok(other) => panic!("{context}: fresh claim {id}: {other:?}"),
                            Err(_) => None,
                        }
                    } else if dice < 95 {
                        if store.flush().is_ok() && !vfs.crashed() {
                            flushed = pending.len();
                        }
                        None
                    } else if dice < 98 {
                        clock.advance(Duration::from_millis(rng.below(1_000)));
                        None
                    } else {
                        // Spills everything live on a budgeted cycle; an error here is
                        // the planned crash or its fallout, never a lost answer.
                        let _ = store.expire_now();
                        None
                    };
                    // Acknowledged only if it returned before the process died.
                    if let Some(promise) = done
                        && !vfs.crashed()
                    {
                        pending.push(promise);
                    }
                }
            }
            _ => crashed_in_open += 1,
        }
        if let Ok(store) = &store {
            spilled += store.stats().cold.spilled_keys;
        }
        let snapshot = vfs.crash_now();
        drop(store);
        acknowledged += pending.len() as u64;
        let guaranteed = match crash {
            Crash::ImmediatePowerCut | Crash::IntervalKill => &pending[..],
            Crash::IntervalPowerCut => &pending[..flushed],
        };
        for promise in guaranteed {
            model.add(promise.clone());
        }
        vfs = match crash {
            Crash::IntervalKill => snapshot.process_kill(),
            _ => snapshot.power_cut(Damage::ALL[rng.below(6) as usize], rng.next()),
        };
        clock.advance(Duration::from_millis(rng.below(2_000)));
        model.expire(clock.now().0);
        if recent.len() > 500 {
            recent.drain(..250);
        }
    }
    let store = testing::open(sim_builder(&clock, Durability::Immediate), &vfs).unwrap();
    let ns = support::namespaces(&store).unwrap();
    model.check(&ns, clock.now().0).unwrap();
    println!(
        "{cycles} lossy kill cycles in {:.1} s: {acknowledged} acknowledged operations, {crashed_in_open} crashes during open, {checked} promises and {intact_checked} intact records checked, {spilled} index entries spilled to the cold tier, 0 lost",
        started.elapsed().as_secs_f64()
    );
    assert!(
        spilled > cycles,
        "the budgeted cycles spilled too little: {spilled}"
    );
    assert!(
        acknowledged > cycles * 3,
        "the cycles acknowledged too little"
    );
    assert!(
        crashed_in_open > cycles / 50,
        "too few crashes landed in open/recovery"
    );
}

const CHILD_ENV: &str = "IDEMSTORE_KILL_LOOP_CHILD";
const REAL_TEST_NAME: &str = "real_files_kill_loop";

fn real_policy(claims: bool) -> Policy {
    let policy = Policy::ttl(Duration::from_secs(3600));
    if claims {
        policy.lease(Duration::from_secs(3600))
    } else {
        policy
    }
}

fn real_open(dir: &str, immediate: bool, budget: bool) -> Result<Store, idemstore::Error> {
    let builder = Store::builder(dir)
        .durability(if immediate {
            Durability::Immediate
        } else {
            Durability::Interval(Duration::from_millis(10))
        })
        .segment_size(64 * 1024);
    if budget {
        builder.memory_budget(1).open()
    } else {
        builder.open()
    }
}

/// Child: writes ids from `start` until killed, printing each answer after it returned:
/// `first`/`duplicate` for marks; for claims `acquired <attempt>` once `begin`
/// acquired, `completed <attempt>` once `complete` returned, `replayed` when `begin`
/// found it completed with its result (`mismatch` with another), `held` when a live
/// lease holds it.
fn child(spec: &str) -> ! {
    let mut parts = spec.split(';');
    let dir = parts.next().unwrap();
    let start: u64 = parts.next().unwrap().parse().unwrap();
    let immediate = parts.next().unwrap() == "immediate";
    let budget = parts.next().unwrap() == "budget";
    let store = real_open(dir, immediate, budget).unwrap();
    let marks = store.namespace("marks", real_policy(false)).unwrap();
    let claims = store.namespace("claims", real_policy(true)).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    for i in start.. {
        if budget && i % 64 == 0 {
            store.expire_now().unwrap();
        }
        let id = format!("id-{i}");
        let line = if i % 4 == 3 {
            match claims.begin(&id).unwrap() {
                Begin::Acquired(claim) => {
                    let attempt = claim.attempt();
                    writeln!(out, "acquired {i} {attempt}").unwrap();
                    out.flush().unwrap();
                    claim.complete(Some(id.as_bytes())).unwrap();
                    format!("completed {i} {attempt}")
                }
                Begin::Completed(record) if record.result() == Some(id.as_bytes()) => {
                    format!("replayed {i}")
                }
                Begin::Completed(_) => format!("mismatch {i}"),
                Begin::InProgress(_) => format!("held {i}"),
                Begin::Exhausted(r) => panic!("exhausted {r:?}"),
            }
        } else {
            match marks.check_and_set(&id).unwrap() {
                Outcome::First => format!("first {i}"),
                Outcome::Duplicate(_) => format!("duplicate {i}"),
                Outcome::LikelyDuplicate => panic!("an exact namespace answered LikelyDuplicate"),
            }
        };
        writeln!(out, "{line}").unwrap();
        out.flush().unwrap();
    }
    unreachable!()
}

/// The segment files in `dir`.
fn segment_files(dir: &str) -> HashSet<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect()
}

#[test]
fn real_files_kill_loop() {
    if let Ok(spec) = std::env::var(CHILD_ENV) {
        child(&spec);
    }
    let cycles = REAL_CYCLES.max(soak() / 4);
    let seed = support::seed("real files kill loop");
    let mut rng = Rng::new(seed);
    // A fresh directory every ROUND cycles keeps each open short (every kill leaves
    // new segments behind, and recovered segments are sealed).
    const ROUND: u64 = 50;
    // Every LONG-th cycle the child writes for 50-100 ms in `Interval` mode, long
    // enough to fill 64 KiB segments, so kills also land around segment roll-over.
    const LONG: u64 = 25;
    let mut dir = tempfile::tempdir().unwrap();
    let mut dir_str = dir.path().to_str().unwrap().to_string();
    let mut marks: HashSet<u64> = HashSet::new();
    let mut firsts: HashSet<u64> = HashSet::new();
    let mut completed: HashSet<u64> = HashSet::new();
    // The attempt of each acknowledged acquisition and completion, per id.
    let mut acquired: HashMap<u64, u32> = HashMap::new();
    let mut completed_attempt: HashMap<u64, u32> = HashMap::new();
    let (mut highest, mut answers, mut early_kills) = (0u64, 0u64, 0u64);
    let (mut total_marks, mut total_completed) = (0usize, 0usize);
    let (mut long_cycles, mut rolled_over, mut immediate_cycles) = (0u64, 0u64, 0u64);
    let mut spilled = 0u64;
    let started = Instant::now();
    for cycle in 0..cycles {
        if cycle % ROUND == 0 && cycle > 0 {
            dir = tempfile::tempdir().unwrap();
            dir_str = dir.path().to_str().unwrap().to_string();
            (highest, marks, firsts, completed) =
                (0, HashSet::new(), HashSet::new(), HashSet::new());
            (acquired, completed_attempt) = (HashMap::new(), HashMap::new());
        }
        if cycle % 100 == 0 {
            eprintln!(
                "real kill loop: cycle {cycle} at {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        let long = cycle % LONG == LONG / 2;
        let immediate = cycle % 3 == 2 && !long;
        immediate_cycles += u64::from(immediate);
        let segments_before = segment_files(&dir_str);
        let start = highest.saturating_sub(rng.below(100));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([REAL_TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(
                CHILD_ENV,
                format!(
                    "{dir_str};{start};{};{}",
                    if immediate { "immediate" } else { "interval" },
                    if budgeted(cycle) { "budget" } else { "none" }
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
            let (mut lines, mut line) = (Vec::new(), String::new());
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                // A line cut by the kill was not acknowledged.
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
        if cycle % 5 == 4 {
            // Kill without waiting for the open: some kills land in recovery.
            std::thread::sleep(Duration::from_micros(rng.below(15_000)));
            early_kills += 1;
        } else {
            ready_rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("cycle {cycle}: the child never opened the store"));
            let micros = if long {
                50_000 + rng.below(50_000)
            } else {
                rng.below(20_000)
            };
            std::thread::sleep(Duration::from_micros(micros));
        }
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        if long {
            // Segments the child created: more than one in a bucket means it rolled over.
            let created: Vec<PathBuf> = segment_files(&dir_str)
                .difference(&segments_before)
                .cloned()
                .collect();
            let buckets: HashSet<u64> = created
                .iter()
                .map(|p| support::deadline_of(p).unwrap())
                .collect();
            long_cycles += 1;
            rolled_over += u64::from(created.len() > buckets.len());
        }
        // Check what this cycle acknowledged, a sample of the older keys, and every
        // key every 50 cycles (checking all of them every cycle grows quadratically).
        let mut new_marks = Vec::new();
        let mut new_completed = Vec::new();
        for line in reader.join().unwrap() {
            let mut words = line.split(' ');
            let (Some(what), Some(Ok(i))) = (words.next(), words.next().map(str::parse::<u64>))
            else {
                continue;
            };
            // Lines of the test harness ("running 1 test") are not answers.
            let attempt = match words.next().map(str::parse::<u32>) {
                None => None,
                Some(Ok(attempt)) => Some(attempt),
                Some(Err(_)) => continue,
            };
            highest = highest.max(i + 1);
            answers += 1;
            match (what, attempt) {
                ("first", None) => {
                    assert!(firsts.insert(i), "cycle {cycle}: id-{i} First twice");
                    marks.insert(i);
                    new_marks.push(i);
                }
                ("duplicate", None) => {
                    marks.insert(i);
                    new_marks.push(i);
                }
                ("acquired", Some(attempt)) => {
                    // A claim whose worker died may be acquired again, but never
                    // with an attempt number already handed out.
                    if let Some(earlier) = acquired.insert(i, attempt) {
                        assert!(
                            attempt > earlier,
                            "cycle {cycle}: claim id-{i} acquired as attempt {attempt} after attempt {earlier}"
                        );
                    }
                }
                ("completed", Some(attempt)) => {
                    assert!(
                        completed.insert(i),
                        "cycle {cycle}: claim id-{i} acquired and completed twice"
                    );
                    assert_eq!(acquired.get(&i), Some(&attempt), "cycle {cycle}: id-{i}");
                    completed_attempt.insert(i, attempt);
                    new_completed.push(i);
                }
                ("replayed", None) => {
                    completed.insert(i);
                    new_completed.push(i);
                }
                ("held", None) => {}
                _ => panic!("cycle {cycle}: unexpected line {line}"),
            }
        }
        let store = real_open(&dir_str, false, budgeted(cycle)).unwrap();
        if budgeted(cycle) {
            // Every key checked below is then answered from the cold tier.
            store.expire_now().unwrap();
            spilled += store.stats().cold.spilled_keys;
        }
        let m = store.namespace("marks", real_policy(false)).unwrap();
        let c = store.namespace("claims", real_policy(true)).unwrap();
        let full = cycle % ROUND == ROUND - 1 || cycle + 1 == cycles;
        let sample = |all: &HashSet<u64>, new: Vec<u64>, rng: &mut Rng| -> Vec<u64> {
            if full {
                return all.iter().copied().collect();
            }
            let mut ids = new;
            if highest > 0 {
                ids.extend(
                    (0..100)
                        .map(|_| rng.below(highest))
                        .filter(|i| all.contains(i)),
                );
            }
            ids
        };
        for i in sample(&marks, new_marks, &mut rng) {
            assert!(
                !m.check_and_set(format!("id-{i}")).unwrap().is_first(),
                "cycle {cycle}: acknowledged id-{i} is First again after kill -9"
            );
        }
        for i in sample(&completed, new_completed, &mut rng) {
            let record = c
                .get(format!("id-{i}"))
                .unwrap()
                .unwrap_or_else(|| panic!("cycle {cycle}: completed claim id-{i} lost"));
            assert_eq!(record.status, Status::Completed, "cycle {cycle}: id-{i}");
            assert_eq!(record.result(), Some(format!("id-{i}").as_bytes()));
            if let Some(&attempt) = completed_attempt.get(&i) {
                assert_eq!(record.attempts, attempt, "cycle {cycle}: id-{i}");
            }
        }
        assert_eq!(
            store.stats().corrupt_records_skipped,
            0,
            "cycle {cycle}: a kill must leave no corruption"
        );
        drop((m, c));
        store.close().unwrap();
        if cycle % ROUND == ROUND - 1 || cycle + 1 == cycles {
            total_marks += marks.len();
            total_completed += completed.len();
            assert!(
                marks.len() as u64 > ROUND.min(cycles),
                "the children acknowledged too little"
            );
            assert!(!completed.is_empty(), "the children completed no claim");
        }
    }
    println!(
        "{cycles} real kill -9 cycles in {:.1} s ({early_kills} without waiting for the open, {immediate_cycles} in Immediate mode, {rolled_over} of {long_cycles} long ones across a segment roll-over, every other one with a 1-byte memory budget: {spilled} index entries spilled and checked from the cold tier): {answers} acknowledged answers; {total_marks} marks and {total_completed} completed claims, each checked after the kill that followed it, 100 random older ones after every kill and all of them every {ROUND} cycles (a new directory each time), 0 lost",
        started.elapsed().as_secs_f64(),
    );
    assert!(immediate_cycles > 0, "no cycle ran in Immediate mode");
    assert!(
        spilled > cycles,
        "the budgeted cycles spilled too little: {spilled}"
    );
    assert!(
        rolled_over > 0,
        "no child filled a segment: the kills never landed around a roll-over"
    );
}
