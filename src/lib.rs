//! # idemstore
//!
//! An embedded, log-structured, crash-safe dedup store for consumers of at-least-once
//! queues (Kafka, RocketMQ, RabbitMQ, SQS, …). Link it into the consumer and ask, for
//! every delivery, "first time, or duplicate?" — atomically, durably, with no server.
//!
//! ```
//! use idemstore::{Store, Policy, Outcome, Begin};
//! use std::time::Duration;
//!
//! # let dir = tempfile::tempdir().unwrap();
//! let store = Store::open(dir.path())?;
//! let inventory = store.namespace("inventory", Policy::ttl(Duration::from_secs(48 * 3600)))?;
//! match inventory.check_and_set("order-42")? {
//!     Outcome::First => { /* deduct stock */ }
//!     Outcome::Duplicate(seen) => println!("skip, first seen at {}", seen.first_seen),
//!     Outcome::LikelyDuplicate => { /* only a namespace with Policy::approximate */ }
//! }
//! assert!(!inventory.check_and_set("order-42")?.is_first());
//!
//! // The claim lifecycle, for work that can fail.
//! let payments = store.namespace("payments",
//!     Policy::ttl(Duration::from_secs(3600)).lease(Duration::from_secs(30)).max_attempts(5))?;
//! match payments.begin("tx-7")? {
//!     Begin::Acquired(claim) => claim.complete(Some(b"receipt-1"))?,
//!     Begin::Completed(record) => assert_eq!(record.result(), Some(&b"receipt-1"[..])),
//!     Begin::InProgress(_) | Begin::Exhausted(_) => {}
//! }
//! store.close()?;
//! # Ok::<(), idemstore::Error>(())
//! ```
//!
//! See `docs/ARCHITECTURE.md` for how it works and `docs/FORMAT.md` for the bytes.

mod addr;
mod answer;
mod check;
mod checkpoint;
mod clock;
mod cold;
mod durable;
mod engine;
mod error;
mod expiry;
mod format;
mod index;
mod io;
mod layout;
mod lifecycle;
mod limits;
mod log;
mod namespace;
mod operations;
mod options;
#[cfg(feature = "testing")]
mod planted;
mod poison;
mod policy;
mod recovery;
pub mod replication;
mod stats;
mod store;
#[cfg_attr(
    not(any(feature = "metrics", test)),
    expect(
        dead_code,
        reason = "the metric mapping is used by the `metrics` feature and tested without it"
    )
)]
mod telemetry;

pub use answer::{Imported, Outcome, Record, Seen, Status};
pub use check::{VERIFY_LISTED_MAX, VerifyReport, verify, verify_with_progress};
pub use clock::{Clock, ManualClock, SystemClock, UnixMs};
pub use durable::Durable;
pub use engine::{PartitionInfo, ReleaseReport, RestoreReport};
pub use error::{Corruption, Error};
pub use namespace::{Begin, Claim, Namespace};
pub use operations::{LATENCY_SAMPLE_EVERY, LatencyHistogram, OperationStats};
pub use options::Durability;
pub use policy::{APPROXIMATE_RATE_MIN, Policy};
pub use replication::{Replication, ReplicationMode};
pub use stats::{ColdTierStats, ReplicationStats, Stats};
pub use store::{Store, StoreBuilder};

/// Entry points for the fuzz targets in `fuzz/` (feature `testing`; not a supported
/// API).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod fuzzing;

/// The simulated file system, the reference model and the planted bugs of the
/// reliability tests (feature `testing`; not a supported API).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod testing;
