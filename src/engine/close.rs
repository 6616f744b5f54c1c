//! Closing a store: stop the background threads, make everything durable, seal and
//! trim the segments, write the index checkpoint the next open rebuilds from, and
//! release the directory.

use std::sync::atomic::Ordering;

use super::Engine;
use crate::error::Error;
use crate::options::Durability;

impl Engine {
    pub(crate) fn close(&self) -> Result<(), Error> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        self.expiry.stop();
        self.cold.stop();
        // Shipping stops first: what is queued stays unshipped (its waiters get an
        // error); the positions reached are kept for a warm restore.
        self.replica.stop();
        self.committer.stop();
        let current = std::thread::current().id();
        for thread in self.threads.lock().drain(..) {
            if thread.thread().id() != current {
                let _ = thread.join();
            }
        }
        let result = if self.options.read_only {
            // Nothing was written: nothing to sync, seal or checkpoint.
            Ok(())
        } else if let Some(poisoned) = self.poison.error() {
            Err(poisoned)
        } else if self.options.durability == Durability::None {
            self.log.seal_all()
        } else {
            self.log.sync().and_then(|()| self.log.seal_all())
        };
        let result = result.and_then(|()| {
            if self.options.read_only {
                Ok(())
            } else {
                self.persist_partitions()?;
                self.write_checkpoint()
            }
        });
        self.lock.lock().take();
        result
    }

    /// At a clean close, after every segment is sealed, trimmed and synced: the index
    /// checkpoint the next open rebuilds from (`crate::checkpoint`). Not written when
    /// this open skipped damaged data, so that the next open reports it again.
    fn write_checkpoint(&self) -> Result<(), Error> {
        if self.recovery.corrupt_records_skipped > 0 {
            tracing::info!(
                corrupt = self.recovery.corrupt_records_skipped,
                "not writing an index checkpoint: damaged data was skipped at open"
            );
            return Ok(());
        }
        // No reaping (`expire_now` on another thread) while the segments are listed.
        let _reaping = self.expiry.pause();
        let sync = self.options.durability != Durability::None;
        let shards = self.index.shard_count();
        // The checkpoint holds the hot entries and counts; with a cold tier, the cold
        // state written after it (and naming it) holds the rest.
        let cold_counts = (!self.cold.is_empty()).then(|| self.cold.cold_counts(shards));
        let written = crate::checkpoint::write(
            &self.log,
            &self.index,
            self.log.vfs(),
            self.namespaces.count(),
            sync,
            cold_counts.as_deref(),
        )?;
        match (written, cold_counts) {
            (Some(hash), Some(_)) => {
                // Every segment was synced above: nothing is left to make durable.
                self.cold
                    .write_state(&self.index, Some(hash), || Ok(()), sync)
            }
            _ => Ok(()),
        }
    }
}
