//! Reading every consumption record back ([`Store::scan`]) and the namespace names:
//! what the offline tools (`idemstore scan`, `stats`, `export`) are built on.

use std::sync::Arc;

use crate::answer::Record;
use crate::clock::UnixMs;
use crate::error::Error;
use crate::format::record::State;
use crate::format::segment_header;
use crate::index::KeyHash;
use crate::lifecycle::{self, Current};
use crate::log::{Location, Segment, reader};
use crate::store::Store;

impl Store {
    /// Calls `f(namespace, id, record)` for every key the store remembers (not removed,
    /// not expired), until `f` returns `false`. `namespace` limits the walk to one
    /// namespace (an unknown name matches nothing).
    ///
    /// The walk reads the log bucket by bucket, oldest expiry first, and reports each
    /// record that the index holds as its key's newest: every key once, in no
    /// particular order within a bucket. Memory stays bounded (one segment handle per
    /// segment, no copy of the records); each record costs one shard lock, released
    /// before `f` runs, so `f` may call the store. It is not a snapshot: a key written
    /// while the walk runs may be reported in its old state, its new one, both or
    /// neither. Offline (the `idemstore` tool holds the directory alone) it is exact.
    pub fn scan(
        &self,
        namespace: Option<&str>,
        mut f: impl FnMut(&str, &[u8], &Record) -> bool,
    ) -> Result<(), Error> {
        let inner = &self.inner;
        inner.check_open()?;
        let names = inner.namespaces.names();
        let only = match namespace {
            Some(name) => match names.iter().position(|n| n == name) {
                Some(id) => Some(id as u32),
                None => return Ok(()),
            },
            None => None,
        };
        let mut segments: Vec<Arc<Segment>> = inner.log.table.read().segments().cloned().collect();
        segments.sort_by_key(|s| (s.deadline_ms, s.seq));
        let now = inner.time.now();
        let mut go_on = true;
        for segment in segments.iter().filter(|s| s.deadline_ms > now.0) {
            let bytes = segment.file.read(0, segment.published() as usize);
            reader::scan(bytes, segment_header::LEN, |offset, stored| {
                if !go_on
                    || stored.state == State::Tombstone
                    || only.is_some_and(|only| only != stored.namespace_id)
                {
                    return;
                }
                let Some(name) = names.get(stored.namespace_id as usize) else {
                    return;
                };
                let location = Location {
                    slot: segment.slot,
                    offset: offset as u32,
                };
                let hash = KeyHash::of(stored.namespace_id, stored.id);
                let current = {
                    let shard = inner.index.lock(hash);
                    shard.find(hash, |at| at == location).map(|_| Current {
                        state: shard.effective_state(stored.state, stored.lsn),
                        first_seen: UnixMs(stored.first_seen_ms),
                        deadline: UnixMs(segment.deadline_ms),
                        claim: stored.claim,
                        lsn: stored.lsn,
                    })
                };
                if let Some(current) = current {
                    let record = lifecycle::public_record(&current, stored.result);
                    go_on = f(name, stored.id, &record);
                }
            });
            if !go_on {
                break;
            }
        }
        Ok(())
    }

    /// The names of the store's namespaces, in the order they were created.
    pub fn namespace_names(&self) -> Vec<String> {
        self.inner.namespaces.names()
    }
}
