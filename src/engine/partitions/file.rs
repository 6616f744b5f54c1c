//! The `PARTITIONS` file (`docs/FORMAT.md`): written whole at restore, release and
//! close; read at open, with the highest offsets a replay found and, after a damaged
//! file, a re-ship of every partition in the log.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::Engine;
use crate::error::Error;
use crate::format::partitions::{self, PartitionEntry};
use crate::format::segment_header;
use crate::log::{Segment, reader};
use crate::options::Durability;
use crate::replication::replica::Role;

impl Engine {
    /// Writes `PARTITIONS` whole: temp file, fsync, rename, directory fsync.
    pub(crate) fn persist_partitions(&self) -> Result<(), Error> {
        if self.options.read_only {
            return Ok(());
        }
        let mut entries: Vec<PartitionEntry> = self
            .replica
            .slots()
            .iter()
            .filter_map(|slot| {
                let state = slot.state.lock();
                // Due a re-ship at the next restore unless every record it queued
                // is stored by the cluster and it cannot write more unseen: while
                // it owns the partition, a crash may come before its records ship.
                let reship = state.reship
                    || state.shipped < state.enqueued
                    || (state.role == Role::Owned && !self.closed.load(Ordering::Acquire));
                (state.position > 0 || state.highest_offset.is_some() || reship).then(|| {
                    PartitionEntry {
                        namespace_id: slot.namespace_id,
                        partition: slot.partition,
                        position: state.position,
                        token: state.token,
                        highest_offset: state.highest_offset,
                        reship,
                    }
                })
            })
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        entries.sort_by_key(|e| (e.namespace_id, e.partition));
        let prefix = match &self.replica.config {
            Some(config) => config.subject_prefix.clone(),
            None => self.replica.file_prefix.lock().clone().unwrap_or_default(),
        };
        let bytes = partitions::encode(&prefix, &entries);
        let vfs = self.log.vfs();
        let sync = self.options.durability != Durability::None;
        let temp = self.dir.join(crate::layout::PARTITIONS_TEMP);
        let path = self.dir.join(crate::layout::PARTITIONS);
        const OP: &str = "writing the partition positions";
        crate::io::replace_file(vfs, &self.dir, &temp, &path, &bytes, sync)
            .map_err(|(e, at)| Error::io(OP, at, e))?;
        Ok(())
    }

    /// At open: the positions and highest offsets `PARTITIONS` holds. A damaged file
    /// is an error in strict mode; otherwise it is logged and ignored (the next
    /// restores are cold: slower, never wrong), and every partition with records in
    /// the log is due a re-ship (the flags were in the file).
    ///
    /// Positions belong to the subjects of the prefix they were taken under: a store
    /// whose partitions were replicated under one prefix, opened with another, would
    /// read the new subjects from the old positions (skipping their start) and never
    /// ship its own records there. That open is refused, and changes nothing. Opened
    /// without replication, every partition it knows becomes due a re-ship: what it
    /// writes now does not ship, so its next replicated restore sends it.
    pub(in crate::engine) fn load_partitions(&self) -> Result<(), Error> {
        self.load_partitions_file()?;
        // After a crash the file has each partition's highest offset as of its last
        // write (a restore, release or close); the replayed records have the rest.
        let names = self.namespaces.names();
        let unreplicated = self.replica.config.is_none();
        for (&(namespace_id, partition), &offset) in &self.recovery.highest_offsets {
            let Some(name) = names.get(namespace_id as usize) else {
                continue;
            };
            let slot = self.replica.slot(name, namespace_id, partition);
            let mut state = slot.state.lock();
            state.highest_offset = Some(state.highest_offset.map_or(offset, |h| h.max(offset)));
            // As for the partitions the file names: what this open writes does not
            // ship, so the next replicated restore sends it.
            state.reship |= unreplicated;
        }
        Ok(())
    }

    fn load_partitions_file(&self) -> Result<(), Error> {
        let path = self.dir.join(crate::layout::PARTITIONS);
        let bytes = match self.log.vfs().read_small(&path) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(()),
            Err(e) => return Err(Error::io("reading the partition positions", &path, e)),
        };
        let file = match partitions::decode(&bytes) {
            Ok(file) => file,
            Err(why) if self.options.strict => return Err(Error::corruption(&path, 0, why)),
            Err(why) => {
                tracing::error!(path = %path.display(), reason = %why, "ignoring a damaged PARTITIONS file: restores read the changelog from the start, and every partition in the log ships its records again");
                self.reship_partitions_in_log();
                return Ok(());
            }
        };
        let configured = self.replica.config.as_ref().map(|c| &c.subject_prefix);
        if let (Some(was), Some(now)) = (&file.prefix, configured) {
            let replicated = file.entries.iter().any(|e| e.position > 0 || e.token != 0);
            if replicated && !was.is_empty() && was != now {
                return Err(Error::invalid_option(format!(
                    "replication subject prefix {now:?}: this store's partitions were replicated under {was:?} ({}); open it with that prefix, or start a store for the new one in an empty directory",
                    path.display()
                )));
            }
        }
        *self.replica.file_prefix.lock() = file.prefix.filter(|p| !p.is_empty());
        let names = self.namespaces.names();
        for entry in file.entries {
            let Some(name) = names.get(entry.namespace_id as usize) else {
                tracing::error!(
                    namespace_id = entry.namespace_id,
                    "PARTITIONS names a namespace NAMESPACES does not hold; ignored"
                );
                continue;
            };
            let slot = self.replica.slot(name, entry.namespace_id, entry.partition);
            let mut state = slot.state.lock();
            state.position = entry.position;
            state.token = entry.token;
            state.highest_offset = entry.highest_offset;
            state.reship = entry.reship || configured.is_none();
        }
        Ok(())
    }

    /// After a damaged `PARTITIONS` file: which partitions were due a re-ship is lost,
    /// so every partition with a live record in the log is due one (its positions are
    /// lost too: its next restore is cold). A read of the live log, paid only then.
    fn reship_partitions_in_log(&self) {
        let mut found: std::collections::BTreeSet<(u32, u32)> = Default::default();
        let segments: Vec<Arc<Segment>> = self.log.table.read().segments().cloned().collect();
        for segment in &segments {
            let bytes = segment
                .file
                .read_for_walk(segment_header::LEN, segment.published() as usize);
            reader::scan(bytes, segment_header::LEN, |_, stored| {
                if let Some(partition) = stored.placement.partition {
                    found.insert((stored.namespace_id, partition));
                }
            });
        }
        let names = self.namespaces.names();
        for (namespace_id, partition) in found {
            let Some(name) = names.get(namespace_id as usize) else {
                continue;
            };
            self.replica
                .slot(name, namespace_id, partition)
                .state
                .lock()
                .reship = true;
        }
    }
}
