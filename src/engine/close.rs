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
        if !self.cold.is_empty() {
            // The checkpoint holds hot entries only: the next open replays the log.
            tracing::info!("not writing an index checkpoint: the cold tier holds entries");
            return Ok(());
        }
        // No reaping (`expire_now` on another thread) while the segments are listed.
        let _reaping = self.expiry.pause();
        crate::checkpoint::write(
            &self.log,
            &self.index,
            self.log.vfs(),
            self.namespaces.count(),
            self.options.durability != Durability::None,
        )
    }
}
