//! Guards docs/CONTRACT.md §3.5 — disk full, I/O errors and fsync failures are returned
//! as errors; after a failed fsync the store refuses writes — and the durability
//! promise under every such failure.
//!
//! A deterministic `Immediate`-mode workload (marks, repeats, batches, claims with
//! results, release + re-acquire, remove, expiry, flush, a clean close and reopen, a
//! final close) runs on the simulated file system of `idemstore::testing`. For every
//! kind of I/O call that can fail and for k = 1, 2, … until the workload makes fewer
//! than k calls of that kind, the k-th call is failed — once, and then from the k-th
//! on ("forever"). After each run the test asserts: the operation during which the
//! call failed returned an error (except where the engine documents that it only logs:
//! the reaper and merger threads, trimming a recovered segment's tail at open, reserving a
//! segment's next step ahead of need, after the append that triggered it, and reading
//! the index checkpoint at open, which falls back to replaying the log); a failed
//! write of the index checkpoint at close is an `Error::Io` that names the checkpoint
//! (the log itself was synced before, so the next open replays it); a failed sync
//! or namespace write poisons the store (a fresh write returns exactly
//! `Error::Poisoned`, no later write is acknowledged, and `close` reports the failure
//! without trimming anything), while a failed create / allocate / remove / truncate is
//! a plain error and the store goes on; no acknowledged key is ever answered `First`
//! again; and a store reopened on the durable image a power cut would leave at the end
//! (unsynced bytes and directory changes dropped) has every acknowledged mark and
//! completed claim. It prints each call site (kind of call × operation × thread) it
//! failed and asserts every kind of call was failed at least once in each mode.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use idemstore::testing::{self, CallKind, Damage, SimVfs};
use idemstore::{Begin, Durability, Error, ManualClock, Namespace, Outcome, Store, UnixMs};
use support::{Expect, Model, Promise, Rng};

const DIR: &str = "/sim/store";

#[derive(Debug, Clone)]
enum Step {
    Open,
    Mark(String),
    Batch(Vec<String>),
    Claim {
        id: String,
        result_len: usize,
        release_first: bool,
    },
    RemoveFodder(String),
    Advance(u64),
    Expire,
    Flush,
    Close,
}

impl Step {
    fn label(&self) -> &'static str {
        match self {
            Step::Open => "open",
            Step::Mark(_) => "check_and_set",
            Step::Batch(_) => "check_and_set_many",
            Step::Claim { .. } => "begin/complete",
            Step::RemoveFodder(_) => "remove",
            Step::Advance(_) => "advance",
            Step::Expire => "expire_now",
            Step::Flush => "flush",
            Step::Close => "close",
        }
    }
}

fn workload(seed: u64) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut steps = vec![Step::Open];
    let mut marks: Vec<String> = Vec::new();
    let mut n = 0;
    let mut fresh = |prefix: &str| {
        n += 1;
        format!("{prefix}-{n:05}")
    };
    for round in 0..14 {
        if round == 1 {
            // One bucket receives more than one allocation step (64 KiB).
            for _ in 0..20 {
                steps.push(Step::Claim {
                    id: fresh("big"),
                    result_len: 3_500 + rng.below(500) as usize,
                    release_first: false,
                });
            }
        }
        for _ in 0..3 + rng.below(4) {
            let id = fresh("m");
            marks.push(id.clone());
            steps.push(Step::Mark(id));
        }
        for _ in 0..2 {
            if !marks.is_empty() {
                let back = rng.below(marks.len().min(20) as u64) as usize;
                steps.push(Step::Mark(marks[marks.len() - 1 - back].clone()));
            }
        }
        steps.push(Step::Claim {
            id: fresh("c"),
            result_len: rng.below(200) as usize,
            release_first: rng.chance(40),
        });
        if rng.chance(40) {
            steps.push(Step::Batch((0..3).map(|_| fresh("b")).collect()));
        }
        if rng.chance(30) {
            steps.push(Step::RemoveFodder(fresh("rm")));
        }
        steps.push(Step::Advance(1_000 + rng.below(2_000)));
        if round % 3 == 2 {
            steps.push(Step::Expire);
        }
        if round % 4 == 3 {
            steps.push(Step::Flush);
        }
        if round == 7 {
            steps.push(Step::Close);
            steps.push(Step::Open);
        }
    }
    steps.push(Step::Close);
    steps
}

/// With `budget`, a 1-byte memory budget: every `expire_now` (and reaper round) spills
/// every live bucket to a cold index file and merges beyond 8 generations, so the
/// workload's later repeats and claims are answered from the cold tier.
fn builder(clock: &ManualClock, budget: bool) -> idemstore::StoreBuilder {
    let builder = Store::builder(DIR)
        .durability(Durability::Immediate)
        .bucket_width(support::BUCKET_WIDTH)
        .segment_size(256 * 1024)
        .clock(clock.clone());
    if budget {
        builder.memory_budget(1)
    } else {
        builder
    }
}

/// What one run of the workload did.
struct Run {
    vfs: SimVfs,
    clock: ManualClock,
    budget: bool,
    store: Option<Store>,
    ns: Vec<Namespace>,
    model: Model,
    /// (step label, calls before, calls after, error if any) for each executed step.
    log: Vec<(&'static str, u64, u64, Option<String>)>,
    /// A fault hit a sync or namespace write since the last open: the store is poisoned.
    poisoned: bool,
}

impl Run {
    fn now(&self) -> u64 {
        use idemstore::Clock;
        self.clock.now().0
    }

    fn first(&mut self, ns: usize, id: &str, what: &str) {
        assert!(
            !self.model.must_remember(ns, id, self.now()),
            "{what}: {id} was acknowledged before and is answered First again"
        );
        assert!(
            !self.poisoned,
            "{what}: a poisoned store acknowledged a new write of {id}"
        );
    }

    /// Executes one step; `Err` only when the workload cannot go on.
    fn step(&mut self, step: &Step) -> Result<Option<Error>, ()> {
        let now = self.now();
        let err = match step {
            Step::Open => {
                self.store = None;
                self.ns.clear();
                self.poisoned = false;
                let store = match testing::open(builder(&self.clock, self.budget), &self.vfs) {
                    Ok(store) => store,
                    Err(e) => return self.retry_open(e),
                };
                match support::namespaces(&store) {
                    Ok(ns) => {
                        self.ns = ns;
                        self.store = Some(store);
                        None
                    }
                    Err(e) => {
                        self.store = Some(store);
                        Some(e)
                    }
                }
            }
            Step::Mark(id) => match self.ns[0].check_and_set(id) {
                Ok(outcome) => {
                    if outcome == Outcome::First {
                        self.first(0, id, "check_and_set");
                    }
                    self.model.mark(id, &outcome, now);
                    None
                }
                Err(e) => Some(e),
            },
            Step::Batch(ids) => match self.ns[0].check_and_set_many(ids) {
                Ok(outcomes) => {
                    for (id, outcome) in ids.iter().zip(outcomes) {
                        if outcome == Outcome::First {
                            self.first(0, id, "check_and_set_many");
                        }
                        self.model.mark(id, &outcome, now);
                    }
                    None
                }
                Err(e) => Some(e),
            },
            Step::Claim {
                id,
                result_len,
                release_first,
            } => self.claim(id, *result_len, *release_first).err(),
            Step::RemoveFodder(id) => self.ns[2]
                .check_and_set(id)
                .and_then(|_| self.ns[2].remove(id))
                .err(),
            Step::Advance(ms) => {
                self.clock.advance(Duration::from_millis(*ms));
                None
            }
            Step::Expire => self.store.as_ref().unwrap().expire_now().err(),
            Step::Flush => self.store.as_ref().unwrap().flush().err(),
            Step::Close => {
                let store = self.store.take().unwrap();
                self.ns.clear();
                self.close(store).err()
            }
        };
        Ok(err)
    }

    fn retry_open(&mut self, first: Error) -> Result<Option<Error>, ()> {
        // The open failed: a second attempt (fail-once faults let it through).
        match testing::open(builder(&self.clock, self.budget), &self.vfs)
            .and_then(|store| Ok((support::namespaces(&store)?, store)))
        {
            Ok((ns, store)) => {
                self.ns = ns;
                self.store = Some(store);
                Ok(Some(first))
            }
            Err(_) => Err(()),
        }
    }

    fn claim(&mut self, id: &str, result_len: usize, release_first: bool) -> Result<(), Error> {
        let now = self.now();
        let result: Vec<u8> = (0..result_len).map(|i| (i % 251) as u8).collect();
        let mut attempts = if release_first { 2 } else { 1 };
        loop {
            match self.ns[1].begin(id)? {
                Begin::Acquired(claim) => {
                    self.first(1, id, "begin");
                    attempts -= 1;
                    if attempts > 0 {
                        claim.release()?;
                        continue;
                    }
                    claim.complete(Some(&result))?;
                    self.model.add(Promise {
                        ns: 1,
                        id: id.to_string(),
                        expect: Expect::Completed(result),
                        until_ms: now + support::CLAIM_TTL_MS,
                    });
                    return Ok(());
                }
                other => panic!("begin of a fresh key {id}: {other:?}"),
            }
        }
    }

    /// Closes `store`; while poisoned, close must fail and trim nothing.
    fn close(&mut self, store: Store) -> Result<(), Error> {
        let truncates = self.vfs.calls(CallKind::SegmentTruncate);
        let result = store.close();
        if self.poisoned {
            assert!(result.is_err(), "close of a poisoned store claimed success");
            assert_eq!(
                self.vfs.calls(CallKind::SegmentTruncate),
                truncates,
                "close of a poisoned store trimmed segments"
            );
        }
        result
    }
}

/// A call site: kind of call, the operation during which it failed, and the thread.
type Site = (CallKind, &'static str, String);

/// Runs the workload with the `nth` call of `kind` failing (once or forever). Returns
/// `None` if the workload made fewer than `nth` such calls, else the site of the failure.
fn run_with_fault(
    steps: &[Step],
    kind: CallKind,
    nth: u64,
    (forever, budget): (bool, bool),
) -> Option<Site> {
    let vfs = SimVfs::new();
    vfs.fail(kind, nth, forever);
    let clock = ManualClock::new(UnixMs(support::T0_MS));
    let mut run = Run {
        vfs: vfs.clone(),
        clock: clock.clone(),
        budget,
        store: None,
        ns: Vec::new(),
        model: Model::default(),
        log: Vec::new(),
        poisoned: false,
    };
    let context = format!(
        "{kind:?} call #{nth} failing {}{}",
        if forever { "forever" } else { "once" },
        if budget { ", 1-byte memory budget" } else { "" }
    );
    let mut probed = false;
    let mut site = None;
    let mut before_final_close = None;
    for (i, step) in steps.iter().enumerate() {
        if i + 1 == steps.len() {
            // The image a power cut would leave now, before the final close syncs.
            before_final_close = Some(vfs.snapshot());
        }
        if run.store.is_none() && !matches!(step, Step::Open) {
            continue;
        }
        if run.ns.is_empty() && !matches!(step, Step::Open | Step::Close | Step::Advance(_)) {
            continue;
        }
        let before = vfs.total_calls();
        let outcome = run.step(step);
        let after = vfs.total_calls();
        let (error, stop) = match outcome {
            Ok(error) => (error.map(|e| e.to_string()), false),
            Err(()) => (Some("open failed twice".to_string()), true),
        };
        run.log.push((step.label(), before, after, error));
        let hits = vfs.fault_hits();
        let Some(hit) = hits.first().filter(|_| !probed) else {
            if stop {
                break;
            }
            continue;
        };
        probed = true;
        // The first failure: which operation was running, and on which thread?
        let thread = match hit.thread.as_deref() {
            Some(name @ ("idemstore-commit" | "idemstore-reaper" | "idemstore-merger")) => {
                name.to_string()
            }
            _ => "caller".to_string(),
        };
        let label = run
            .log
            .iter()
            .find(|(_, b, a, _)| *b < hit.call && hit.call <= *a)
            .map_or("between operations", |(l, ..)| *l);
        let step_error = run
            .log
            .iter()
            .find(|(_, b, a, _)| *b < hit.call && hit.call <= *a)
            .and_then(|(_, _, _, e)| e.clone());
        site = Some((kind, label, thread.clone()));
        // Reserving space ahead of need runs after the append that triggered it
        // succeeded: its failure is logged, and an append that then finds no room
        // reserves under the lock (SegmentAllocate) and reports it.
        // An unreadable checkpoint at open is logged and the log replayed instead.
        let background = thread == "idemstore-reaper" || thread == "idemstore-merger";
        let logged_only = background
            || (kind == CallKind::SegmentTruncate && label == "open")
            || (kind == CallKind::ReadFile && label == "open")
            || kind == CallKind::SegmentAllocateAhead;
        // At close, these calls are made only to write the index checkpoint and (with
        // a cold tier) the cold state: a failure is a clear error naming it, after the
        // log was synced and trimmed. (A reaper round still running when the close
        // began makes them too, for a spill or a cold state: logged, as above.)
        let checkpoint_write = label == "close"
            && !background
            && matches!(
                kind,
                CallKind::OpenAppend
                    | CallKind::AppendSetLen
                    | CallKind::AppendWrite
                    | CallKind::AppendSync
                    | CallKind::Rename
            );
        if checkpoint_write {
            assert!(
                matches!(&step_error, Some(e) if e.contains("index checkpoint") || e.contains("cold state")),
                "{context}: a failed checkpoint write at close must be an error naming it, got {step_error:?}"
            );
        }
        // Failing forever, later calls of the kind fail too once the reaper met the
        // first (with a budget the reaper spills at open, beside the caller): the step
        // may fail of one of those, on its own thread or the commit thread.
        let (from, to) = run
            .log
            .iter()
            .find(|(_, b, a, _)| *b < hit.call && hit.call <= *a)
            .map_or((0, 0), |(_, b, a, _)| (*b, *a));
        let later_hit_too = forever
            && hits.iter().skip(1).any(|h| {
                !matches!(
                    h.thread.as_deref(),
                    Some("idemstore-reaper" | "idemstore-merger")
                ) && from < h.call
                    && h.call <= to
            });
        if logged_only {
            assert!(
                step_error.is_none() || label == "between operations" || later_hit_too,
                "{context}: the engine only logs this failure, yet {label} failed: {step_error:?}"
            );
        } else {
            assert!(
                step_error.is_some(),
                "{context}: the failing call during {label} (thread {thread}) surfaced no error"
            );
        }
        let poisons = thread == "idemstore-commit"
            || (label == "open"
                && matches!(kind, CallKind::AppendWrite | CallKind::AppendSync)
                && run.store.is_some()
                && run.ns.is_empty());
        // Probe: a fresh write tells whether the store is poisoned.
        if let (Some(store), true) = (&run.store, label != "close") {
            run.poisoned = poisons;
            let probe = match run.ns.first() {
                Some(ns) => ns.check_and_set(format!("probe-{nth}")).map(|_| ()),
                None => store.namespace("probe", support::policy(0)).map(|_| ()),
            };
            if poisons {
                assert!(
                    matches!(&probe, Err(Error::Poisoned { path, .. }) if !path.as_os_str().is_empty()),
                    "{context}: after a failed sync a write must return Error::Poisoned with the failed path, got {probe:?}"
                );
            } else if !forever {
                assert!(
                    probe.is_ok(),
                    "{context}: a failed {kind:?} must not poison the store, got {probe:?}"
                );
            } else {
                // Failing forever, the probe's own write may need the failing call
                // (its sync): then it gets the poison of that failure, with its path.
                assert!(
                    match &probe {
                        Ok(()) | Err(Error::Io { .. }) => true,
                        Err(Error::Poisoned { path, .. }) => !path.as_os_str().is_empty(),
                        Err(_) => false,
                    },
                    "{context}: a failed {kind:?} must not poison the store before the probe, got {probe:?}"
                );
            }
        }
        if run.ns.is_empty()
            && let Some(store) = run.store.take()
        {
            // Namespaces could not be created: nothing more to run; close reports it.
            let _ = run.close(store);
        }
        if stop {
            break;
        }
    }
    if let Some(store) = run.store.take() {
        // The workload stopped early (the store could not go on): the power cut is now.
        before_final_close = Some(vfs.snapshot());
        let _ = run.close(store);
    }
    if vfs.fault_hits().is_empty() {
        return None;
    }
    let image = before_final_close
        .unwrap_or_else(|| vfs.snapshot())
        .power_cut(Damage::Dropped, 0);
    let now = run.now();
    let reopened = testing::open(builder(&clock, budget), &image)
        .unwrap_or_else(|e| panic!("{context}: reopening the surviving image failed: {e}"));
    let ns = support::namespaces(&reopened).unwrap();
    if let Err(violation) = run.model.check(&ns, now) {
        panic!("{context}: after reopening the surviving durable image: {violation}");
    }
    drop(ns);
    reopened.close().unwrap();
    Some(site.expect("a fault that fired was analysed"))
}

fn sweep(forever: bool, budget: bool) {
    let seed = support::seed(match (forever, budget) {
        (false, false) => "sweep once",
        (true, false) => "sweep forever",
        (false, true) => "sweep once, budget",
        (true, true) => "sweep forever, budget",
    });
    let steps = workload(seed);
    let mut sites: BTreeSet<Site> = BTreeSet::new();
    let mut runs = 0;
    let mut per_kind = Vec::new();
    for kind in CallKind::ALL.into_iter().filter(|k| k.can_fail()) {
        let mut k = 1;
        while let Some(site) = run_with_fault(&steps, kind, k, (forever, budget)) {
            sites.insert(site);
            k += 1;
        }
        runs += k;
        per_kind.push((kind, k - 1));
    }
    println!("{} runs; failed calls per kind: {per_kind:?}", runs);
    println!("{} call sites covered:", sites.len());
    for (kind, op, thread) in &sites {
        println!("  {kind:?} during {op} on thread {thread}");
    }
    for (kind, count) in &per_kind {
        // With a cold tier too: the close writes the checkpoint and the cold state,
        // and the reopen reads both (ReadFile).
        assert!(*count > 0, "the workload never made a {kind:?} call");
    }
}

#[test]
fn every_failed_call_once_is_an_error_and_loses_nothing_acknowledged() {
    sweep(false, false);
}

#[test]
fn every_failed_call_forever_is_an_error_and_loses_nothing_acknowledged() {
    sweep(true, false);
}

#[test]
fn with_a_memory_budget_every_failed_call_once_is_an_error_and_loses_nothing() {
    sweep(false, true);
}

#[test]
fn with_a_memory_budget_every_failed_call_forever_is_an_error_and_loses_nothing() {
    sweep(true, true);
}
