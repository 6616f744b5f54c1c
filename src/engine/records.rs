//! Reading every consumption record back (`Store::scan`):
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

use super::Engine;

impl Engine {
    /// `Store::scan`.
    pub(crate) fn scan(
        &self,
        namespace: Option<&str>,
        mut f: impl FnMut(&str, &[u8], &Record) -> bool,
    ) -> Result<(), Error> {
        let inner = self;
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
        let mut failure = None;
        for segment in segments.iter().filter(|s| s.deadline_ms > now.0) {
            let bytes = segment
                .file
                .read_for_walk(segment_header::LEN, segment.published() as usize);
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
                let hash = KeyHash::of_record(&stored);
                let current = {
                    let shard = inner.index.lock(hash);
                    let is_current =
                        match inner.is_current(&shard, hash, segment, location, &stored) {
                            Ok(is) => is,
                            Err(e) => {
                                failure.get_or_insert(e);
                                go_on = false;
                                return;
                            }
                        };
                    is_current.then(|| Current {
                        state: shard.effective_state(stored.state, stored.lsn),
                        first_seen: UnixMs(stored.first_seen_ms),
                        deadline: UnixMs(segment.deadline_ms),
                        claim: stored.claim,
                        lsn: stored.lsn,
                        placement: stored.placement,
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
        failure.map_or(Ok(()), Err)
    }
}
