//! The pieces replication is built from (`docs/REPLICATION.md`): a partition's records
//! ship to a replicated log — a *changelog* — so that the partition's next owner, on
//! another machine, can restore them, and the previous owner, should it keep writing
//! after it lost the partition (a zombie), is refused by the log itself.
//!
//! - [`Changelog`]: the small trait a replicated log implements — append with an
//!   expected last sequence (the optimistic-concurrency primitive of NATS JetStream's
//!   `Nats-Expected-Last-Subject-Sequence`), and read from a position.
//! - [`MemoryChangelog`]: an in-process implementation with injected faults (lost
//!   acks, timeouts, leader changes mid-publish), for deterministic tests of the
//!   protocol beside the real engine.
//! - [`PartitionOwner`]: the fencing protocol over any [`Changelog`]: take a partition
//!   over (read to the end, then append an owner message that moves the partition's
//!   last sequence), append batches that only land while this owner still owns it,
//!   and resolve every ambiguous outcome (a timeout after the log applied the append)
//!   by reading the entry right after its own last one instead of guessing.
//!
//! - `NatsChangelog` (feature `nats`): [`Changelog`] on a NATS JetStream stream, with
//!   `async-nats` on a runtime thread of its own; the core stays synchronous.
//!   `LocalCluster` starts real `nats-server` nodes on loopback for tests, benchmarks
//!   and the demo.
//!
//! - [`Replication`] and [`ReplicationMode`]: the store side
//!   ([`StoreBuilder::replication`](crate::StoreBuilder::replication)): a slot per
//!   partition, shipping threads, and `Namespace::{restore,flush,release}_partition`.

mod changelog;
mod config;
#[cfg(feature = "nats")]
mod local_cluster;
mod memory;
#[cfg(feature = "nats")]
mod nats;
mod owner;
pub(crate) mod replica;

pub use changelog::{Changelog, ChangelogError, Entry};
pub use config::{Replication, ReplicationMode};
#[cfg(feature = "nats")]
pub use local_cluster::{LocalCluster, nats_server_binary};
pub use memory::{Fault, MemoryChangelog};
#[cfg(feature = "nats")]
pub use nats::{NatsChangelog, NatsConfig, NatsOpenError};
pub use owner::{PartitionOwner, ReplicationError, Restored, Shipped};
