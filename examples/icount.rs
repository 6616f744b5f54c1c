//! The hot path's instruction count, for A/B comparisons of two commits: N fresh
//! 16-byte ids on one thread with `Durability::None`, then (with `dup`) the same N
//! again as duplicates. Per key = (the 100k run − the 50k run) / 50k, so setup cancels:
//!
//! ```sh
//! cargo build --release --example icount
//! for a in 100000 50000 "50000 dup"; do
//!   valgrind --tool=callgrind target/release/examples/icount $a 2>&1 | grep Collected
//! done
//! ```
//!
//! `icount N scoped` marks in partition 0 without replication, `icount N async` the
//! same with `Async` replication to the in-process changelog: the writer's own
//! instructions are the main thread's (`--separate-threads=yes`, the `-01` file), the
//! shipping thread's are in another file.

use std::time::Duration;

use std::sync::Arc;

use idemstore::replication::MemoryChangelog;
use idemstore::{Durability, Policy, Replication, ReplicationMode, Store};

fn key(i: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    k[8..].copy_from_slice(&i.to_le_bytes());
    k
}

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .expect("usage: icount N [dup]");
    let mode = std::env::args().nth(2).unwrap_or_default();
    let dups = mode == "dup";
    let replicated = mode == "async";
    let scoped = replicated || mode == "scoped";
    let dir = tempfile::tempdir().unwrap();
    let mut builder = Store::builder(dir.path()).durability(Durability::None);
    if replicated {
        builder = builder.replication(
            Replication::new(Arc::new(MemoryChangelog::new()), "icount")
                .mode(ReplicationMode::Async)
                .buffer_bytes(1 << 30),
        );
    }
    let store = builder.open().unwrap();
    let ns = store
        .namespace("bench", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    if scoped {
        let p = ns.partition(0).unwrap();
        p.restore_partition().unwrap();
        for i in 0..n {
            assert!(p.check_and_set_at(key(i), i).unwrap().is_first());
        }
        p.flush_partition().unwrap();
    } else {
        for i in 0..n {
            assert!(ns.check_and_set(key(i)).unwrap().is_first());
        }
    }
    if dups {
        for i in 0..n {
            assert!(!ns.check_and_set(key(i)).unwrap().is_first());
        }
    }
    // Skip the close (its checkpoint write would count too).
    std::mem::forget(store);
}
