//! Test support, not a supported API: the simulated file system and a way to open a
//! store on it, for the reliability tests under `tests/`, and the reference model of
//! the operation contract ([`model`]) that the model test and the fuzz target share.
//!
//! Always compiled (it costs nothing at run time), so `cargo test` runs every test.

use std::sync::Arc;

pub mod model;

pub use crate::io::sim::{CallKind, Damage, FaultHit, SECTOR_BYTES, SimVfs, Snapshot};
use crate::{Error, Store, StoreBuilder};

/// Opens the store `builder` describes on the simulated file system `vfs`; the
/// builder's directory is a path inside the simulator.
pub fn open(builder: StoreBuilder, vfs: &SimVfs) -> Result<Store, Error> {
    builder.open_on(Arc::new(vfs.clone()))
}

/// The environment variable that selects a planted bug (feature `planted-bugs`).
pub const PLANTED_BUG_ENV: &str = "IDEMSTORE_PLANTED_BUG";

/// The bugs the `planted-bugs` feature can plant, one at a time, for the negative
/// controls: the reliability tests must fail with each.
pub const PLANTED_BUGS: [&str; 5] = [
    // Committer::wait_durable returns once the sync is requested, before it completes.
    "ack-before-fsync",
    // Log::sync never syncs the directory, so new segment files can vanish.
    "skip-dir-fsync",
    // Log::sync ignores a failed segment fdatasync: no poisoning, the round succeeds.
    "ignore-fsync-error",
    // The scan treats the first damaged record as the end even if valid ones follow.
    "eager-torn-tail",
    // Log::bucket_deadline rounds one bucket width early.
    "early-expiry",
];

/// Whether the planted bug `name` is switched on (always false without the feature).
#[cfg(feature = "planted-bugs")]
pub(crate) fn planted(name: &str) -> bool {
    static BUG: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let bug = BUG.get_or_init(|| {
        let bug = std::env::var(PLANTED_BUG_ENV)
            .ok()
            .filter(|b| !b.is_empty());
        if let Some(bug) = &bug {
            assert!(
                PLANTED_BUGS.contains(&bug.as_str()),
                "{PLANTED_BUG_ENV}={bug} is not one of {PLANTED_BUGS:?}"
            );
        }
        bug
    });
    debug_assert!(PLANTED_BUGS.contains(&name));
    bug.as_deref() == Some(name)
}
