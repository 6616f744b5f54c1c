//! Test support, not a supported API: the simulated file system and a way to open a
//! store on it, for the reliability tests under `tests/`, and the reference model of
//! the operation contract ([`model`]) that the model test and the fuzz target share.
//!
//! Compiled only with the feature `testing`, which `cargo test` turns on (the crate's
//! dev-dependency on itself) and the fuzz crate asks for; the default library has
//! none of it.

use std::path::Path;
use std::sync::Arc;

pub mod model;

use crate::io::Vfs;
pub use crate::io::sim::{CallKind, Damage, FaultHit, SECTOR_BYTES, SimVfs, Snapshot};
use crate::recovery::survey::{self, NamespaceFile};
use crate::{Error, ManualClock, Store, StoreBuilder, UnixMs, VerifyReport};

/// Opens the store `builder` describes on the simulated file system `vfs`; the
/// builder's directory is a path inside the simulator.
pub fn open(builder: StoreBuilder, vfs: &SimVfs) -> Result<Store, Error> {
    builder.open_on(Arc::new(vfs.clone()))
}

/// How many futures' wakers the store's commit thread holds: none once every
/// `Durable` future resolved or was dropped.
pub fn pending_wakers(store: &Store) -> usize {
    store.pending_wakers()
}

/// [`crate::verify`] of the store in `dir` on the simulated file system `vfs`, at the
/// time `now` (which decides the expired segments).
pub fn verify(vfs: &SimVfs, dir: &Path, now: UnixMs) -> Result<VerifyReport, Error> {
    crate::check::verify_on(vfs, dir, now, &mut |_, _| {})
}

/// How [`recover`] runs: the open's options that matter to recovery.
#[derive(Debug, Clone, Copy)]
pub struct RecoverOptions {
    /// The clock's reading.
    pub now: UnixMs,
    /// Index shards (a checkpoint is used only if written with as many).
    pub shards: usize,
    /// Refuse damage instead of skipping it.
    pub strict: bool,
    /// Change nothing in the directory.
    pub read_only: bool,
}

/// What [`recover`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub records_replayed: u64,
    pub corrupt_records_skipped: u64,
    pub torn_tails_cut: u64,
    pub foreign_files: u64,
    pub expired_segments: u64,
    pub empty_segments: u64,
    pub opened_from_checkpoint: bool,
    /// Entries in the rebuilt index (removed keys' tombstones included).
    pub index_entries: u64,
}

/// The recovery of an open, alone, on the simulated file system: `NAMESPACES` is read
/// (and refused if damaged, as the open does) but never created, rewritten or
/// trimmed, the directory is not locked, and no store is started.
pub fn recover(vfs: &SimVfs, dir: &Path, how: RecoverOptions) -> Result<Recovered, Error> {
    let path = dir.join(crate::layout::NAMESPACES);
    let bytes = vfs
        .read_small(&path)
        .map_err(|e| Error::io("reading", &path, e))?;
    let namespaces = survey::namespace_file(bytes.as_deref());
    if let NamespaceFile::Damaged { offset, reason } = namespaces {
        return Err(Error::corruption(&path, offset as u64, reason));
    }
    let options = crate::options::Options {
        shards: how.shards,
        strict: how.strict,
        clock: Arc::new(ManualClock::new(how.now)),
        ..crate::options::Options::default()
    };
    options.validate()?;
    let log = crate::log::Log::new(
        dir.to_path_buf(),
        Arc::new(vfs.clone()),
        Arc::default(),
        options.segment_size_bytes,
        options.bucket_width_ms,
        1,
        1,
    );
    let index = crate::index::Index::new(options.shards, options.memory_budget.is_some());
    let report = crate::recovery::recover(
        &log,
        &index,
        vfs,
        &options,
        namespaces.count(),
        how.read_only,
        true,
    )?;
    let index_entries = index
        .shards()
        .map(|shard| shard.lock().entries().count() as u64)
        .sum();
    Ok(Recovered {
        records_replayed: report.records_replayed,
        corrupt_records_skipped: report.corrupt_records_skipped,
        torn_tails_cut: report.torn_tails_cut,
        foreign_files: report.foreign_files,
        expired_segments: report.expired_segments,
        empty_segments: report.empty_segments,
        opened_from_checkpoint: report.opened_from_checkpoint,
        index_entries,
    })
}

pub use crate::planted::{PLANTED_BUG_ENV, PLANTED_BUGS};
