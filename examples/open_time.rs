//! Open time of a store of N live keys, from the index checkpoint a clean close
//! writes, and by replaying the log (the checkpoint deleted).
//!
//! `cargo run --release --example open_time -- [keys] [dir]` (default 10 000 000 keys
//! in a temp dir).

use std::time::{Duration, Instant};

use idemstore::{Durability, Policy, Store};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let keys: u64 = args.next().map_or(Ok(10_000_000), |a| a.parse())?;
    let temp = tempfile::tempdir()?;
    let dir = args
        .next()
        .map_or_else(|| temp.path().to_path_buf(), Into::into);
    let open = || {
        Store::builder(&dir)
            .durability(Durability::Interval(Duration::from_millis(100)))
            .open()
    };

    let store = open()?;
    let ns = store.namespace("bench", Policy::ttl(Duration::from_secs(3600)))?;
    let started = Instant::now();
    let mut ids = Vec::with_capacity(1000);
    for batch in 0..keys.div_ceil(1000) {
        ids.clear();
        ids.extend((batch * 1000..((batch + 1) * 1000).min(keys)).map(|i| format!("key-{i:012}")));
        ns.check_and_set_many(&ids)?;
    }
    println!("wrote {keys} keys in {:.2?}", started.elapsed());
    drop(ns);
    let started = Instant::now();
    store.close()?;
    println!("close (with checkpoint) {:.2?}", started.elapsed());

    for round in 0..2 {
        let started = Instant::now();
        let store = open()?;
        let elapsed = started.elapsed();
        let stats = store.stats();
        println!(
            "open from checkpoint {}: {elapsed:.2?} (recovery {:.2?}, {} keys, {} records replayed)",
            stats.opened_from_checkpoint,
            stats.recovery_time,
            stats.live_keys,
            stats.records_replayed
        );
        assert_eq!(stats.live_keys, keys);
        if round == 0 {
            store.close()?;
        } else {
            drop(store);
        }
    }
    // `drop` closed it and wrote a checkpoint again: delete it to measure the replay.
    for round in 0..2 {
        std::fs::remove_file(dir.join("CHECKPOINT"))?;
        let started = Instant::now();
        let store = open()?;
        let elapsed = started.elapsed();
        let stats = store.stats();
        println!(
            "open by replay (round {round}): {elapsed:.2?} (recovery {:.2?}, {} keys, {} records replayed)",
            stats.recovery_time, stats.live_keys, stats.records_replayed
        );
        assert!(!stats.opened_from_checkpoint);
        store.close()?;
    }
    Ok(())
}
