//! Guards docs/CONTRACT.md §3.1's durability table under power loss: in `Immediate`
//! mode an acknowledged First / Acquired / complete survives a power cut; in `Interval`
//! mode everything a completed sync covered (here: everything acknowledged before a
//! `flush` that returned) survives a power cut, and everything acknowledged survives a
//! kill -9; a torn tail is cut and a damaged record never hides the intact ones after
//! it; and recovery itself survives a second crash.
//!
//! A random workload (marks, repeats, batches, claims with results, removes, clock
//! moves, flushes) runs on the simulated file system, which takes a snapshot of the
//! live and durable images before every sync call (every sync point) and once at the
//! end. Each operation's acknowledgement is stamped with the number of snapshots
//! taken when it returned, so the test knows exactly which snapshots must hold it.
//! For every snapshot, for every kind of damage to the unsynced part (dropped,
//! truncated at a random byte, zeroed, garbage, sectors persisted out of order,
//! directory changes lost) × several seeds, the test reopens the damaged image and
//! checks every promise, plus that every record that survived byte-for-byte in the
//! image was replayed. Then it crashes again at a random call during that recovery,
//! damages the result once more, and checks again (double crash).

mod support;

use std::sync::Arc;
use std::time::Duration;

use idemstore::testing::{self, Damage, SimVfs, Snapshot};
use idemstore::{Begin, Clock, Durability, ManualClock, Outcome, Store, UnixMs};
use support::{Expect, Model, Promise, Rng};

const DIR: &str = "/sim/store";
const SEEDS_PER_DAMAGE: u64 = 2;

fn builder(clock: &ManualClock, durability: Durability, budget: bool) -> idemstore::StoreBuilder {
    let builder = Store::builder(DIR)
        .durability(durability)
        .bucket_width(support::BUCKET_WIDTH)
        .segment_size(64 * 1024)
        .clock(clock.clone());
    if budget {
        builder.memory_budget(1)
    } else {
        builder
    }
}

/// An acknowledged promise and the number of snapshots taken when it returned.
struct Ack {
    promise: Promise,
    stamp: u64,
}

struct Recorded {
    acks: Vec<Ack>,
    /// (acks before the flush, stamp when the flush returned).
    flushes: Vec<(usize, u64)>,
    snapshots: Vec<Arc<Snapshot>>,
    end_ms: u64,
}

fn run_workload(
    durability: Durability,
    budget: bool,
    ops: usize,
    rng: &mut Rng,
    clock: &ManualClock,
) -> Recorded {
    let vfs = SimVfs::new();
    vfs.snapshot_every_sync(true);
    let store = testing::open(builder(clock, durability, budget), &vfs).unwrap();
    let ns = support::namespaces(&store).unwrap();
    let mut acks: Vec<Ack> = Vec::new();
    let mut flushes = Vec::new();
    let mut model = Model::default();
    let mut marks: Vec<String> = Vec::new();
    let interval = matches!(durability, Durability::Interval(_));
    for i in 0..ops {
        if budget && i % 20 == 19 {
            // Spills (and merges) at fixed steps too, whatever the dice say.
            store.expire_now().unwrap();
        }
        let now = clock.now().0;
        let dice = rng.below(100);
        let touched = if dice < 55 || (dice < 65 && marks.is_empty()) {
            let id = format!("m-{i:05}");
            let outcome = ns[0].check_and_set(&id).unwrap();
            assert_eq!(outcome, Outcome::First, "{id}");
            model.mark(&id, &outcome, now);
            marks.push(id.clone());
            (0, id)
        } else if dice < 65 {
            let back = rng.below(marks.len().min(30) as u64) as usize;
            let id = marks[marks.len() - 1 - back].clone();
            let outcome = ns[0].check_and_set(&id).unwrap();
            if outcome.is_first() {
                assert!(!model.must_remember(0, &id, now), "{id} First twice");
            }
            model.mark(&id, &outcome, now);
            (0, id)
        } else if dice < 85 {
            let id = format!("c-{i:05}");
            let len = if rng.chance(20) {
                2_000 + rng.below(2_000)
            } else {
                rng.below(100)
            };
            let result: Vec<u8> = (0..len).map(|b| (b % 253) as u8).collect();
            let Begin::Acquired(claim) = ns[1].begin(&id).unwrap() else {
                panic!("fresh claim {id} not acquired");
            };
            claim.complete(Some(&result)).unwrap();
            model.add(Promise {
                ns: 1,
                id: id.clone(),
                expect: Expect::Completed(result),
                until_ms: now + support::CLAIM_TTL_MS,
            });
            (1, id)
        } else if dice < 90 {
            let id = format!("rm-{i:05}");
            let _ = ns[2].check_and_set(&id).unwrap();
            assert!(ns[2].remove(&id).unwrap());
            continue;
        } else if dice < 96 {
            clock.advance(Duration::from_millis(rng.below(1_500)));
            continue;
        } else {
            if interval {
                store.flush().unwrap();
                flushes.push((acks.len(), vfs.snapshots_taken()));
            } else if budget || rng.chance(30) {
                store.expire_now().unwrap();
            }
            continue;
        };
        // Stamped after the call returned: snapshots taken later must hold it.
        let stamp = vfs.snapshots_taken();
        acks.push(Ack {
            promise: model.keys[&touched].clone(),
            stamp,
        });
        if interval && i % 8 == 0 {
            // Let the periodic sync run now and then.
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    if budget {
        let cold = store.stats().cold;
        assert!(
            cold.spills >= 5 && cold.spilled_keys >= 50,
            "the budgeted workload spilled too little: {cold:?}"
        );
        println!(
            "spilled {} entries in {} spills, {} merges",
            cold.spilled_keys, cold.spills, cold.merges
        );
    }
    let end = vfs.crash_now();
    drop(ns);
    drop(store);
    let mut snapshots = vfs.snapshots();
    if !snapshots.last().is_some_and(|s| Arc::ptr_eq(s, &end)) {
        snapshots.push(end);
    }
    Recorded {
        acks,
        flushes,
        snapshots,
        end_ms: clock.now().0,
    }
}

/// Reopens `image`; checks `model` and that every intact record was replayed.
/// With `budget`, the reopened store spills everything first: every check is then
/// answered from the cold tier.
fn verify(
    image: &SimVfs,
    model: &Model,
    clock: &ManualClock,
    (durability, budget): (Durability, bool),
    what: &str,
) {
    let now = clock.now().0;
    let store = testing::open(builder(clock, durability, budget), image)
        .unwrap_or_else(|e| panic!("{what}: reopening failed: {e}"));
    if budget {
        store
            .expire_now()
            .unwrap_or_else(|e| panic!("{what}: spilling after the reopen failed: {e}"));
    }
    let ns = support::namespaces(&store).unwrap();
    if let Err(violation) = model.check(&ns, now) {
        panic!("{what}: {violation}");
    }
    if let Err(violation) = support::check_intact(&image.intact_writes(), &ns, now) {
        panic!("{what}: {violation}");
    }
    drop(ns);
    drop(store);
}

fn power_loss(durability: Durability, budget: bool, ops: usize, name: &str) {
    let seed = support::seed(name);
    let mut rng = Rng::new(seed);
    let clock = ManualClock::new(UnixMs(support::T0_MS));
    let recorded = run_workload(durability, budget, ops, &mut rng, &clock);
    let mode = (durability, budget);
    let interval = matches!(durability, Durability::Interval(_));
    let mut images = 0;
    for (i, snapshot) in recorded.snapshots.iter().enumerate() {
        let i = i as u64;
        // Acknowledged before this snapshot was taken.
        let acked = recorded.acks.iter().filter(|a| a.stamp <= i);
        let mut all = Model::default();
        for ack in acked {
            all.add(ack.promise.clone());
        }
        let durable = if interval {
            let flushed = recorded
                .flushes
                .iter()
                .rev()
                .find(|(_, stamp)| *stamp <= i)
                .map_or(0, |(n, _)| *n);
            let mut m = Model::default();
            for ack in &recorded.acks[..flushed] {
                m.add(ack.promise.clone());
            }
            m
        } else {
            all.clone()
        };
        let what = |d: &str| {
            format!(
                "{name}, sync point {i} of {}, {d}",
                recorded.snapshots.len()
            )
        };
        if interval {
            // kill -9: the page cache survives, so every acknowledged operation does.
            verify(
                &snapshot.process_kill(),
                &all,
                &clock,
                mode,
                &what("kill -9"),
            );
            images += 1;
        }
        for damage in Damage::ALL {
            // Dropped and DirectoryLost involve no random choice: one image each.
            let seeds = match damage {
                Damage::Dropped | Damage::DirectoryLost => 1,
                _ => SEEDS_PER_DAMAGE,
            };
            for s in 0..seeds {
                let image = snapshot.power_cut(damage, rng.next() ^ s);
                verify(
                    &image,
                    &durable,
                    &clock,
                    mode,
                    &what(&format!("{damage:?}")),
                );
                images += 1;
            }
        }
        // Double crash: crash again at a random call of the recovery, then once more.
        let first = Damage::ALL[rng.below(6) as usize];
        let second = Damage::ALL[rng.below(6) as usize];
        let image = snapshot.power_cut(first, rng.next());
        let crash_at = 1 + rng.below(30);
        image.crash_at_call(crash_at);
        if let Ok(store) = testing::open(builder(&clock, durability, budget), &image) {
            if budget {
                let _ = store.expire_now();
            }
            image.crash_now();
            drop(store);
        }
        let again = image.snapshots().last().cloned().expect("crashed");
        verify(
            &again.power_cut(second, rng.next()),
            &durable,
            &clock,
            mode,
            &what(&format!(
                "{first:?}, crash at recovery call {crash_at}, {second:?}"
            )),
        );
        images += 1;
    }
    assert!(
        recorded.acks.len() > ops / 2,
        "too few acknowledged operations"
    );
    println!(
        "{name}: {} acknowledged operations, {} sync points, {images} crash images verified, clock moved {} s",
        recorded.acks.len(),
        recorded.snapshots.len(),
        (recorded.end_ms - support::T0_MS) / 1000
    );
}

#[test]
fn immediate_mode_loses_no_acknowledged_operation_at_any_sync_point() {
    power_loss(Durability::Immediate, false, 160, "power loss, Immediate");
}

/// With a 1-byte memory budget every few operations spill every live bucket to a cold
/// index file (temp file synced, renamed, directory synced) and merges follow: a power
/// cut at each of those sync points, and during the recovery after it, loses nothing.
#[test]
fn a_budgeted_store_loses_nothing_at_any_sync_point_of_its_spills() {
    power_loss(
        Durability::Immediate,
        true,
        160,
        "power loss, Immediate, 1-byte budget",
    );
}

#[test]
fn interval_mode_loses_nothing_a_completed_sync_covered() {
    power_loss(
        Durability::Interval(Duration::from_millis(2)),
        false,
        500,
        "power loss, Interval",
    );
}
