//! Reading every consumption record back ([`Store::scan`]), the namespace names, and
//! putting a record back ([`Namespace::import`]): what the offline tools (`idemstore
//! scan`, `stats`, `export`, `import`) are built on.

use std::sync::Arc;
use std::time::Instant;

use super::Inner;
use crate::clock::UnixMs;
use crate::error::Error;
use crate::format::record::{self, ClaimFields, State};
use crate::format::segment_header;
use crate::index::KeyHash;
use crate::log::{Location, Segment, reader};
use crate::namespace::{Namespace, Record, Status};
use crate::operations::Timed;
use crate::store::Store;

/// What [`Namespace::import`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Imported {
    /// The record is now the key's state.
    Written,
    /// The key is already remembered here: left as it is.
    AlreadyLive,
    /// The record's `expires_at` has passed: nothing written (it would be forgotten at
    /// once).
    Expired,
}

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
        let names = self.namespace_names();
        let only = match namespace {
            Some(name) => match names.iter().position(|n| n == name) {
                Some(id) => Some(id as u32),
                None => return Ok(()),
            },
            None => None,
        };
        let mut segments: Vec<Arc<Segment>> = inner.log.table.read().segments().cloned().collect();
        segments.sort_by_key(|s| (s.deadline_ms, s.seq));
        let now_ms = inner.time.now().0;
        let mut go_on = true;
        for segment in segments.iter().filter(|s| s.deadline_ms > now_ms) {
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
                let state = {
                    let shard = inner.index.lock(hash);
                    shard
                        .find(hash, |at| at == location)
                        .map(|_| shard.effective_state(stored.state, stored.lsn))
                };
                if let Some(state) = state {
                    go_on = f(
                        name,
                        stored.id,
                        &public_record(&stored, state, segment.deadline_ms),
                    );
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
        self.inner.namespaces.lock().names.clone()
    }
}

/// The public form of a stored record whose bucket deadline is `deadline_ms` and
/// whose state is now `state` (`Shard::effective_state`).
fn public_record(stored: &record::Record<'_>, state: State, deadline_ms: u64) -> Record {
    let status = match state {
        State::Mark => Status::Seen,
        State::InProgress => Status::InProgress,
        State::Released => Status::Released,
        State::Completed => Status::Completed,
        State::Failed => Status::Failed,
        State::Tombstone => unreachable!("the scan skips tombstones"),
    };
    Record {
        status,
        first_seen: UnixMs(stored.first_seen_ms),
        expires_at: UnixMs(deadline_ms),
        attempts: stored.claim.attempts,
        lease_until: (state == State::InProgress).then_some(UnixMs(stored.claim.lease_until_ms)),
        completed_at: (state == State::Completed).then_some(UnixMs(stored.claim.completed_ms)),
        result: if state == State::Completed {
            stored.result.map(<[u8]>::to_vec)
        } else {
            None
        },
    }
}

impl Namespace {
    /// Puts a consumption record back (a restore from `idemstore export`, or a move
    /// between stores): if `id` is not remembered here, it becomes remembered with
    /// `record`'s state — status, first seen, attempts, lease, completed at, result —
    /// until `record.expires_at`, rounded up to this store's bucket width.
    ///
    /// - A key that is already remembered is left alone ([`Imported::AlreadyLive`]):
    ///   the live state wins, so importing twice, or into a store that kept running,
    ///   never rolls a key back.
    /// - A record whose `expires_at` has passed is not written ([`Imported::Expired`]).
    /// - A `Seen` record is a `check_and_set` mark: its attempts, lease and completion
    ///   are ignored. Only a `Completed` record may carry a result (else
    ///   `Error::InvalidOption`), at most `max_result_len` bytes (else
    ///   `Error::ResultTooLarge`); an `InProgress` record needs `lease_until`.
    /// - `expires_at` may be at most `max_ttl` plus its deadline rounding (one bucket width,
    ///   or `max_ttl / 1024` when that is longer) from now (else
    ///   `Error::InvalidTtl`). The namespace's policy ttl does not apply.
    /// - The payload fingerprint of `begin_with_payload` is not part of [`Record`], so
    ///   an imported key does not detect a payload mismatch.
    ///
    /// The write is as durable as any other under the store's durability mode.
    pub fn import(&self, id: impl AsRef<[u8]>, record: &Record) -> Result<Imported, Error> {
        self.inner.import(self, id.as_ref(), record)
    }
}

impl Inner {
    pub(crate) fn record_latency(&self, timed: Timed, started: Option<Instant>) {
        self.operations.record_latency(timed, started);
    }

    fn import(
        &self,
        namespace: &Namespace,
        id: &[u8],
        imported: &Record,
    ) -> Result<Imported, Error> {
        self.check_open()?;
        self.validate_id(id)?;
        let (state, claim) = match imported.status {
            Status::Seen => (State::Mark, ClaimFields::default()),
            Status::InProgress => {
                let Some(lease_until) = imported.lease_until else {
                    return Err(Error::invalid_option(
                        "an in-progress record needs lease_until; export it again or set one",
                    ));
                };
                (
                    State::InProgress,
                    ClaimFields {
                        attempts: imported.attempts,
                        lease_until_ms: lease_until.0,
                        completed_ms: 0,
                        payload_fp: None,
                    },
                )
            }
            Status::Released | Status::Completed | Status::Failed => (
                match imported.status {
                    Status::Released => State::Released,
                    Status::Completed => State::Completed,
                    _ => State::Failed,
                },
                ClaimFields {
                    attempts: imported.attempts,
                    lease_until_ms: 0,
                    completed_ms: if imported.status == Status::Completed {
                        imported.completed_at.map_or(0, |t| t.0)
                    } else {
                        0
                    },
                    payload_fp: None,
                },
            ),
        };
        let result = imported.result.as_deref();
        if let Some(result) = result {
            if state != State::Completed {
                return Err(Error::invalid_option(format!(
                    "a {} record carries a result; only completed records may",
                    imported.status.as_str()
                )));
            }
            if result.len() > self.options.max_result_len {
                return Err(Error::ResultTooLarge {
                    len: result.len(),
                    max: self.options.max_result_len,
                });
            }
        }
        let hash = KeyHash::of(namespace.id, id);
        loop {
            let now_ms = self.time.now().0;
            if imported.expires_at.0 <= now_ms {
                return Ok(Imported::Expired);
            }
            // A claim's records live in a bucket at least as late as its lease.
            let until_ms = imported.expires_at.0.max(claim.lease_until_ms);
            // At most what a record with the longest ttl may be remembered until.
            let latest_ms = now_ms
                .saturating_add(self.options.max_ttl_ms)
                .saturating_add(crate::log::deadline_rounding_ms(
                    self.options.bucket_width_ms,
                    self.options.max_ttl_ms,
                ));
            if until_ms > latest_ms {
                return Err(Error::InvalidTtl {
                    ttl: std::time::Duration::from_millis(imported.expires_at.0 - now_ms),
                    max: std::time::Duration::from_millis(self.options.max_ttl_ms),
                });
            }
            let deadline_ms = self.log.bucket_deadline(now_ms, until_ms);
            let mut shard = self.index.lock(hash);
            let current = self.find(&shard, hash, namespace.id, id)?;
            if current.is_some_and(|c| c.is_live(now_ms)) {
                return Ok(Imported::AlreadyLive);
            }
            let record = record::Record {
                state,
                namespace_id: namespace.id,
                lsn: shard.next_lsn(),
                first_seen_ms: imported.first_seen.0,
                id,
                claim,
                result,
            };
            if self
                .write(
                    &mut shard,
                    hash,
                    current.as_ref(),
                    deadline_ms,
                    now_ms,
                    &record,
                )?
                .is_some()
            {
                drop(shard);
                if self.immediate() {
                    self.committer.wait_durable()?;
                }
                return Ok(Imported::Written);
            }
        }
    }
}
