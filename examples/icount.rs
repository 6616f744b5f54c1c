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

use std::time::Duration;

use idemstore::{Durability, Policy, Store};

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
    let dups = std::env::args().nth(2).as_deref() == Some("dup");
    let dir = tempfile::tempdir().unwrap();
    let store = Store::builder(dir.path())
        .durability(Durability::None)
        .open()
        .unwrap();
    let ns = store
        .namespace("bench", Policy::ttl(Duration::from_secs(3600)))
        .unwrap();
    for i in 0..n {
        assert!(ns.check_and_set(key(i)).unwrap().is_first());
    }
    if dups {
        for i in 0..n {
            assert!(!ns.check_and_set(key(i)).unwrap().is_first());
        }
    }
    // Skip the close (its checkpoint write would count too).
    std::mem::forget(store);
}
