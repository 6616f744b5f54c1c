//! Guards the soundness of the lock-free read through an index entry against the
//! reaper (docs/ARCHITECTURE.md, "Buckets and expiry"; src/expiry/mod.rs): a record
//! that was indexed and then stopped decoding (a flipped bit in a page under the
//! running store) must not let a reader touch its segment after the reaper freed it,
//! and must not leave its entry behind once its bucket is gone.
//!
//! On the simulated file system a segment's memory is a heap buffer, so a read after
//! it is freed is a use after free that Miri (`.ci/run` runs this file under it when
//! the component is installed) or the address sanitizer reports. The test indexes
//! keys in one shard, flips a byte inside one key's record, lets the bucket expire,
//! and reaps it while two threads keep reading that very key (whose entry names the
//! damaged record) and writing others in the same shard. Then the damaged key must be
//! forgotten (its entry removed by slot, whatever the record says) and new again.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idemstore::testing::{self, SimVfs};
use idemstore::{Durability, Error, ManualClock, Policy, Store, UnixMs};

const KEYS: usize = 32;
const DAMAGED: usize = 7;

fn key(i: usize) -> String {
    format!("key-{i:02}")
}

/// Offset of `id` in the only segment file of `dir`, and the file.
fn find_id(vfs: &SimVfs, dir: &Path, id: &[u8]) -> (std::path::PathBuf, usize) {
    let segments: Vec<String> = vfs
        .file_names(dir)
        .into_iter()
        .filter(|name| name.ends_with(".seg"))
        .collect();
    assert_eq!(segments.len(), 1, "one bucket, one stripe: {segments:?}");
    let path = dir.join(&segments[0]);
    let bytes = vfs.read_file(&path).expect("segment readable");
    let at = bytes
        .windows(id.len())
        .position(|w| w == id)
        .expect("the id is in the segment");
    (path, at)
}

#[test]
fn reaping_a_damaged_indexed_record_while_readers_hammer_its_shard() {
    let rounds = if cfg!(miri) { 2 } else { 20 };
    let iterations = if cfg!(miri) { 30 } else { 2_000 };
    for round in 0..rounds {
        let vfs = SimVfs::new();
        let dir = Path::new("/sim/store");
        let clock = ManualClock::new(UnixMs(1_700_000_000_000));
        let store = testing::open(
            Store::builder(dir)
                .shards(1)
                .durability(Durability::None)
                .bucket_width(Duration::from_secs(1))
                .clock(clock.clone()),
            &vfs,
        )
        .unwrap();
        let ns = store
            .namespace("orders", Policy::ttl(Duration::from_secs(1)))
            .unwrap();
        for i in 0..KEYS {
            assert!(ns.check_and_set(key(i)).unwrap().is_first());
        }
        // A bit flips inside the damaged key's id: its record no longer decodes, but
        // the index still names it.
        let (segment, at) = find_id(&vfs, dir, key(DAMAGED).as_bytes());
        vfs.flip_live_byte(&segment, at + 1, 0x20);
        assert!(
            matches!(ns.get(key(DAMAGED)), Err(Error::Corruption(_))),
            "round {round}: the damaged record must read as corruption"
        );

        clock.advance(Duration::from_secs(3));
        let stop = Arc::new(AtomicBool::new(false));
        let workers: Vec<_> = (0..2)
            .map(|worker| {
                let ns = ns.clone();
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || {
                    for n in 0..iterations {
                        if stop.load(Ordering::Relaxed) && n > 10 {
                            break;
                        }
                        // Before the reap: the damaged record (corruption) or, once its
                        // bucket is past, not live. After: forgotten. Never a crash.
                        match ns.get(key(DAMAGED)) {
                            Ok(None) | Err(Error::Corruption(_)) => {}
                            other => panic!("damaged key read as {other:?}"),
                        }
                        assert!(
                            ns.check_and_set(format!("new-{worker}-{n}"))
                                .unwrap()
                                .is_first()
                        );
                    }
                })
            })
            .collect();
        // The background reaper may get there first: expire_now returns once every
        // bucket past is reaped, by either.
        store.expire_now().unwrap();
        stop.store(true, Ordering::Relaxed);
        for worker in workers {
            worker.join().unwrap();
        }
        assert_eq!(
            store.stats().expired_keys,
            KEYS as u64,
            "round {round}: every expired key is forgotten, the damaged one by its slot"
        );
        assert_eq!(ns.get(key(DAMAGED)).unwrap(), None, "round {round}");
        assert!(ns.check_and_set(key(DAMAGED)).unwrap().is_first());
        store.close().unwrap();
    }
}
