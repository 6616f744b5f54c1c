//! The replay splits the segments between its threads (`recovery::replay`): each
//! decodes the segments it takes and hands every other thread the records of that
//! thread's shards. This test writes a store across many small segments, so that every
//! thread decodes some and a key's records sit in segments different threads decode
//! (a claim begun in one and completed, released or failed in a later one; keys
//! removed later; the same ids in two partitions and unscoped), closes it, and opens
//! two copies: one from the index checkpoint the close wrote (no record read) and one
//! by replay (its checkpoint deleted). Every key must read the same in both, and the
//! state counts must agree.

use std::path::Path;
use std::time::Duration;

use idemstore::{Begin, Durability, Policy, Store};

const KEYS: u64 = 12_000;
const CLAIMS: u64 = 3_000;

fn open(dir: &Path) -> Store {
    Store::builder(dir)
        .durability(Durability::None)
        .segment_size(64 * 1024)
        .open()
        .unwrap()
}

fn policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn a_replay_split_between_threads_reads_every_key_as_the_checkpoint_does() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("store");
    let store = open(&dir);
    let orders = store.namespace("orders", policy()).unwrap();
    let scoped = store.namespace("scoped", policy()).unwrap();
    let (p0, p1) = (scoped.partition(0).unwrap(), scoped.partition(1).unwrap());
    for p in [&p0, &p1] {
        p.restore_partition().unwrap();
    }
    // Claims begun first, in the earliest segments.
    let mut claims = Vec::new();
    for i in 0..CLAIMS {
        match orders.begin(format!("claim-{i}")).unwrap() {
            Begin::Acquired(claim) => claims.push(claim),
            other => panic!("claim-{i}: {other:?}"),
        }
    }
    // Marks, the same ids unscoped and in both partitions.
    for i in 0..KEYS {
        let id = format!("key-{i}");
        assert!(orders.check_and_set(&id).unwrap().is_first());
        assert!(p0.check_and_set_at(&id, i).unwrap().is_first());
        if i % 2 == 0 {
            assert!(p1.check_and_set_at(&id, i).unwrap().is_first());
        }
    }
    // The claims end in later segments: completed, released, failed, or left held.
    for (i, claim) in claims.into_iter().enumerate() {
        match i % 4 {
            0 => claim
                .complete(Some(format!("done-{i}").as_bytes()))
                .unwrap(),
            1 => claim.release().unwrap(),
            2 => claim.fail().unwrap(),
            _ => std::mem::forget(claim),
        }
    }
    // Some keys removed, in the last segments.
    for i in (0..KEYS).step_by(7) {
        assert!(orders.remove(format!("key-{i}")).unwrap());
        assert!(p0.remove(format!("key-{i}")).unwrap());
    }
    let before = store.stats();
    drop((orders, scoped, p0, p1));
    store.close().unwrap();
    assert!(
        before.segments >= 8,
        "the test needs many segments, so that every replay thread decodes some: {}",
        before.segments
    );

    let replayed_dir = root.path().join("replayed");
    copy_dir(&dir, &replayed_dir);
    std::fs::remove_file(replayed_dir.join("CHECKPOINT")).unwrap();
    let from_checkpoint = open(&dir);
    let replayed = open(&replayed_dir);
    let (a, b) = (from_checkpoint.stats(), replayed.stats());
    assert!(a.opened_from_checkpoint && a.records_replayed == 0);
    assert!(!b.opened_from_checkpoint);
    assert!(b.records_replayed > KEYS * 3, "{}", b.records_replayed);
    assert_eq!(
        (
            a.live_keys,
            a.seen,
            a.in_progress,
            a.released,
            a.completed,
            a.failed,
            a.tombstones
        ),
        (
            b.live_keys,
            b.seen,
            b.in_progress,
            b.released,
            b.completed,
            b.failed,
            b.tombstones
        )
    );
    assert_eq!(a.live_keys, before.live_keys);

    let handles = |store: &Store| {
        let orders = store.namespace("orders", policy()).unwrap();
        let scoped = store.namespace("scoped", policy()).unwrap();
        let parts = [scoped.partition(0).unwrap(), scoped.partition(1).unwrap()];
        (orders, parts)
    };
    let (orders_a, parts_a) = handles(&from_checkpoint);
    let (orders_b, parts_b) = handles(&replayed);
    let mut compared = 0;
    for i in 0..CLAIMS {
        let id = format!("claim-{i}");
        let (x, y) = (orders_a.get(&id).unwrap(), orders_b.get(&id).unwrap());
        assert!(x.is_some(), "{id}");
        assert_eq!(x, y, "{id}");
        compared += 1;
    }
    for i in 0..KEYS {
        let id = format!("key-{i}");
        assert_eq!(
            orders_a.get(&id).unwrap(),
            orders_b.get(&id).unwrap(),
            "{id}"
        );
        for (p, (pa, pb)) in parts_a.iter().zip(&parts_b).enumerate() {
            let (x, y) = (pa.get(&id).unwrap(), pb.get(&id).unwrap());
            let written = p == 0 || i % 2 == 0;
            let removed = p == 0 && i % 7 == 0;
            assert_eq!(x.is_some(), written && !removed, "partition {p}, {id}");
            assert_eq!(x, y, "partition {p}, {id}");
            compared += 1;
        }
    }
    assert_eq!(compared, CLAIMS + 2 * KEYS);
}
