//! The operations on one key, as `Namespace` and `Claim` call them: the narrow
//! interface between the public face (`crate::namespace`) and the engine. Each
//! validates its input, states its request to `lifecycle`, runs it through the
//! mutation skeleton (`mutation::apply`) and turns the result into its answer.

use std::time::Duration;

use std::sync::Arc;

use super::Engine;
use super::mutation::{Applied, Pending, Target};
use crate::addr::Lsn;
use crate::answer::{Imported, Outcome, Record, Seen, Status};
use crate::clock::{UnixMs, duration_ms_ceil};
use crate::error::Error;
use crate::expiry::deadline::rounding_ms;
use crate::format::record::{ClaimFields, Placement};
use crate::index::KeyHash;
use crate::lifecycle::{self, Kept, Request, Resolution};
use crate::limits;
use crate::policy::Policy;
use crate::replication::replica::Slot;

/// The namespace an operation is for: its id, the partition a partition handle is
/// scoped to (and its slot), and the policy of the handle (which a per-call ttl may
/// have changed), in ms, computed once per handle.
#[derive(Clone)]
pub(crate) struct Scope {
    pub id: u32,
    pub partition: Option<u32>,
    pub slot: Option<Arc<Slot>>,
    pub ttl_ms: u64,
    pub lease_ms: u64,
    pub max_attempts: u32,
    /// `Policy::approximate`: cold keys may answer `LikelyDuplicate`.
    pub approximate: bool,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("id", &self.id)
            .field("partition", &self.partition)
            .finish()
    }
}

impl Scope {
    pub(crate) fn new(id: u32, policy: &Policy) -> Scope {
        Scope {
            id,
            partition: None,
            slot: None,
            ttl_ms: policy.ttl_ms(),
            lease_ms: policy.lease_ms(),
            max_attempts: policy.max_attempts,
            approximate: policy.approximate.is_some(),
        }
    }

    /// The same scope for another policy.
    pub(crate) fn with_policy(&self, policy: &Policy) -> Scope {
        Scope {
            ttl_ms: policy.ttl_ms(),
            lease_ms: policy.lease_ms(),
            max_attempts: policy.max_attempts,
            approximate: policy.approximate.is_some(),
            ..self.clone()
        }
    }

    /// Where a record written for the message at `offset` belongs.
    pub(crate) fn placement(&self, offset: Option<u64>) -> Placement {
        Placement {
            partition: self.partition,
            offset: self.partition.and(offset),
        }
    }

    /// The target of a write of `id` at `offset`.
    pub(crate) fn target<'a>(&'a self, id: &'a [u8], offset: Option<u64>) -> Target<'a> {
        Target {
            namespace_id: self.id,
            placement: self.placement(offset),
            id,
            slot: self.slot.as_ref(),
        }
    }
}

/// What `begin` found, before the public face wraps an acquisition in a `Claim`.
#[derive(Debug)]
pub(crate) enum Began {
    Acquired {
        attempt: u32,
        lsn: Lsn,
        lease_until: UnixMs,
    },
    InProgress(Record),
    Completed(Record),
    Exhausted(Record),
}

/// What a claim's own operation changed: the lease (for extend) and the lsn of the
/// record it wrote, which identifies the acquisition from then on.
pub(crate) struct Resolved {
    pub lease_until: UnixMs,
    pub lsn: Lsn,
}

impl Engine {
    fn validate_id(&self, id: &[u8]) -> Result<(), Error> {
        if id.is_empty() || id.len() > self.options.max_key_len {
            return Err(Error::invalid_key(format!(
                "id is {} bytes; it must be 1 to {} bytes (max_key_len)",
                id.len(),
                self.options.max_key_len
            )));
        }
        Ok(())
    }

    /// A ttl or lease: 1 s to max_ttl.
    fn validate_duration(&self, duration: Duration) -> Result<(), Error> {
        let ms = duration_ms_ceil(duration);
        if ms < limits::TTL_MS_MIN || ms > self.options.max_ttl_ms {
            return Err(Error::InvalidTtl {
                ttl: duration,
                max: Duration::from_millis(self.options.max_ttl_ms),
            });
        }
        Ok(())
    }

    pub(crate) fn validate_policy(&self, policy: &Policy) -> Result<(), Error> {
        self.validate_duration(policy.ttl)?;
        // A lease has the same bounds as a ttl: 1 s to max_ttl.
        self.validate_duration(policy.lease)?;
        if policy.max_attempts == 0 {
            return Err(Error::invalid_option(
                "max_attempts = 0: it must be at least 1",
            ));
        }
        if let Some(rate) = policy.false_duplicate_rate()
            && !(crate::policy::APPROXIMATE_RATE_MIN..1.0).contains(&rate)
        {
            return Err(Error::invalid_option(format!(
                "false_duplicate_rate {rate}: approximate mode meets rates from {:.3e} (16 cold generations, 16-bit fingerprints) up to below 1; use an exact namespace for a lower one",
                crate::policy::APPROXIMATE_RATE_MIN
            )));
        }
        Ok(())
    }

    /// Claims and removal need an exact namespace: a filter cannot forget a key.
    fn check_exact(&self, namespace: &Scope, what: &str) -> Result<(), Error> {
        match namespace.approximate {
            false => Ok(()),
            true => Err(Error::invalid_option(format!(
                "{what} on an approximate namespace (Policy::approximate): claims and remove need an exact namespace"
            ))),
        }
    }

    /// Open, writable, and `id` in bounds.
    fn check_write(&self, id: &[u8]) -> Result<(), Error> {
        self.check_writable()?;
        self.validate_id(id)
    }

    pub(crate) fn check_and_set_pending(
        &self,
        namespace: &Scope,
        id: &[u8],
        offset: Option<u64>,
    ) -> Result<Pending<Outcome>, Error> {
        self.check_write(id)?;
        self.check_and_set_checked(namespace, id, offset)
    }

    /// `check_and_set_pending` once the store and `id` are checked.
    fn check_and_set_checked(
        &self,
        namespace: &Scope,
        id: &[u8],
        offset: Option<u64>,
    ) -> Result<Pending<Outcome>, Error> {
        if namespace.approximate
            && namespace.slot.is_none()
            && self.likely_duplicate(namespace.target(id, offset))?
        {
            return Ok(Pending::local(Outcome::LikelyDuplicate, false));
        }
        let request = Request::CheckAndSet {
            ttl_ms: namespace.ttl_ms,
        };
        let pending = self.apply(namespace.target(id, offset), &request)?;
        Ok(pending.map(|value| match value {
            Applied::Written { .. } => Outcome::First,
            Applied::Kept {
                current: Some(c), ..
            } => Outcome::Duplicate(Seen {
                first_seen: c.first_seen,
                expires_at: c.deadline,
            }),
            Applied::Kept { kept, .. } => unreachable!("check_and_set kept {kept:?}"),
        }))
    }

    pub(crate) fn check_and_set(
        &self,
        namespace: &Scope,
        id: &[u8],
        offset: Option<u64>,
    ) -> Result<Outcome, Error> {
        let pending = self.check_and_set_pending(namespace, id, offset)?;
        self.settle(pending)
    }

    pub(crate) fn check_and_set_many<I: AsRef<[u8]>>(
        &self,
        namespace: &Scope,
        ids: &[I],
    ) -> Result<Vec<Outcome>, Error> {
        let pending = self.check_and_set_many_pending(namespace, ids)?;
        let (value, waits) = (
            pending.value,
            Pending {
                value: (),
                wait: pending.wait,
                ship: pending.ship,
            },
        );
        self.settle(waits)?;
        value
    }

    /// `check_and_set_many` before its durability wait: the outcomes, or the
    /// `PartialBatch` error of a batch that stopped partway (its applied ids wait too).
    pub(crate) fn check_and_set_many_pending<I: AsRef<[u8]>>(
        &self,
        namespace: &Scope,
        ids: &[I],
    ) -> Result<Pending<Result<Vec<Outcome>, Error>>, Error> {
        self.check_writable()?;
        if ids.len() > limits::BATCH_LEN_MAX {
            return Err(Error::invalid_option(format!(
                "a batch of {} ids; split it into batches of at most {}",
                ids.len(),
                limits::BATCH_LEN_MAX
            )));
        }
        for id in ids {
            self.validate_id(id.as_ref())?;
        }
        let mut outcomes = Pending {
            value: Vec::with_capacity(ids.len()),
            wait: false,
            ship: None,
        };
        for id in ids {
            match self.check_and_set_checked(namespace, id.as_ref(), None) {
                Ok(pending) => {
                    outcomes.wait |= pending.wait;
                    // One slot for the batch: waiting for its last record covers all.
                    if pending.ship.is_some() {
                        outcomes.ship = pending.ship;
                    }
                    outcomes.value.push(pending.value);
                }
                // Nothing of the batch was applied: a plain error, safe to retry whole.
                Err(e) if outcomes.value.is_empty() => return Err(e),
                // Part of the batch was applied: the caller must learn which ids were
                // answered `First`, or a retry of the whole batch would get `Duplicate`
                // for them and nobody would process those messages.
                Err(e) => {
                    return Ok(outcomes.map(|outcomes| {
                        Err(Error::PartialBatch {
                            outcomes,
                            source: Box::new(e),
                        })
                    }));
                }
            }
        }
        Ok(outcomes.map(Ok))
    }

    /// `begin`; the caller settles the durability wait once it holds the claim, so
    /// that a failed wait drops (and releases) it.
    pub(crate) fn begin(
        &self,
        namespace: &Scope,
        id: &[u8],
        offset: Option<u64>,
        payload_fp: Option<u64>,
    ) -> Result<Pending<Began>, Error> {
        self.check_write(id)?;
        self.check_exact(namespace, "begin")?;
        let request = Request::Begin {
            ttl_ms: namespace.ttl_ms,
            lease_ms: namespace.lease_ms,
            max_attempts: namespace.max_attempts,
            payload_fp,
        };
        let pending = self.apply(namespace.target(id, offset), &request)?;
        let ship = pending.ship.clone();
        let answer = match pending.value {
            Applied::Written { lsn, claim } => Began::Acquired {
                attempt: claim.attempts,
                lsn,
                lease_until: UnixMs(claim.lease_until_ms),
            },
            Applied::Kept {
                kept: Kept::PayloadMismatch,
                ..
            } => return Err(Error::PayloadMismatch),
            Applied::Kept {
                kept,
                record: Some(record),
                ..
            } => match kept {
                Kept::InProgress => Began::InProgress(*record),
                Kept::Completed => Began::Completed(*record),
                Kept::Exhausted => Began::Exhausted(*record),
                other => unreachable!("begin kept {other:?}"),
            },
            Applied::Kept { kept, .. } => unreachable!("begin kept {kept:?} with no record"),
        };
        Ok(Pending {
            value: answer,
            wait: pending.wait,
            ship,
        })
    }

    /// Completes, releases, fails or extends the claim `attempt` on `id` whose last
    /// record has `lsn`; the caller settles the durability wait.
    pub(crate) fn resolve(
        &self,
        namespace: &Scope,
        id: &[u8],
        offset: Option<u64>,
        attempt: u32,
        lsn: Lsn,
        how: Resolution<'_>,
    ) -> Result<Pending<Resolved>, Error> {
        self.check_writable()?;
        if let Resolution::Complete(Some(result)) = how
            && result.len() > self.options.max_result_len
        {
            return Err(Error::ResultTooLarge {
                len: result.len(),
                max: self.options.max_result_len,
            });
        }
        if let Resolution::Extend(lease_ms) = how {
            self.validate_duration(Duration::from_millis(lease_ms))?;
        }
        self.check_exact(namespace, "completing, failing or releasing a claim")?;
        let request = Request::Resolve {
            attempt,
            lsn,
            ttl_ms: namespace.ttl_ms,
            how,
        };
        let pending = self.apply(namespace.target(id, offset), &request)?;
        let ship = pending.ship.clone();
        let resolved = match pending.value {
            Applied::Written { lsn, claim } => Resolved {
                lease_until: UnixMs(claim.lease_until_ms),
                lsn,
            },
            Applied::Kept { .. } => return Err(Error::ClaimLost),
        };
        Ok(Pending {
            value: resolved,
            wait: pending.wait,
            ship,
        })
    }

    pub(crate) fn get(&self, namespace: &Scope, id: &[u8]) -> Result<Option<Record>, Error> {
        self.check_open()?;
        self.validate_id(id)?;
        let hash = KeyHash::of(namespace.id, namespace.partition, id);
        let now = self.time.now();
        let shard = self.index.lock(hash);
        let (mut found, mut cold) = (None, None);
        let key = (namespace.id, namespace.partition, id);
        self.find_any(&shard, hash, key, &mut found, &mut cold)?;
        match found {
            Some(found) if found.current.is_live(now) => {
                self.public_record(&shard, &found, cold.as_ref()).map(Some)
            }
            _ => Ok(None),
        }
    }

    pub(crate) fn remove(&self, namespace: &Scope, id: &[u8]) -> Result<bool, Error> {
        self.check_write(id)?;
        self.check_exact(namespace, "remove")?;
        let pending = self.apply(namespace.target(id, None), &Request::Remove)?;
        self.settle(pending.map(|value| matches!(value, Applied::Written { .. })))
    }

    pub(crate) fn import(
        &self,
        namespace: &Scope,
        id: &[u8],
        offset: Option<u64>,
        imported: &Record,
    ) -> Result<Imported, Error> {
        self.check_write(id)?;
        let state = lifecycle::state_of(imported.status);
        let claim = match imported.status {
            Status::Seen => ClaimFields::default(),
            Status::InProgress => {
                let Some(lease_until) = imported.lease_until else {
                    return Err(Error::invalid_option(
                        "an in-progress record needs lease_until; export it again or set one",
                    ));
                };
                ClaimFields {
                    attempts: imported.attempts,
                    lease_until_ms: lease_until.0,
                    completed_ms: 0,
                    payload_fp: None,
                }
            }
            Status::Released | Status::Completed | Status::Failed => ClaimFields {
                attempts: imported.attempts,
                lease_until_ms: 0,
                completed_ms: match imported.status {
                    Status::Completed => imported.completed_at.map_or(0, |t| t.0),
                    _ => 0,
                },
                payload_fp: None,
            },
        };
        let result = imported.result.as_deref();
        if let Some(result) = result {
            if imported.status != Status::Completed {
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
        // At most what a record with the longest ttl may be remembered until.
        let max_ttl_ms = self.options.max_ttl_ms;
        let request = Request::Import {
            state,
            first_seen: imported.first_seen,
            claim,
            result,
            expires_at: imported.expires_at,
            // A claim's records live in a bucket at least as late as its lease.
            until: UnixMs(imported.expires_at.0.max(claim.lease_until_ms)),
            span_max_ms: max_ttl_ms
                .saturating_add(rounding_ms(self.options.bucket_width_ms, max_ttl_ms)),
        };
        let pending = self.apply(namespace.target(id, offset), &request)?;
        let answer = match &pending.value {
            Applied::Written { .. } => Imported::Written,
            Applied::Kept {
                kept: Kept::AlreadyLive,
                ..
            } => Imported::AlreadyLive,
            Applied::Kept {
                kept: Kept::Expired,
                ..
            } => Imported::Expired,
            Applied::Kept { .. } => {
                let now = self.time.now();
                return Err(Error::InvalidTtl {
                    ttl: Duration::from_millis(imported.expires_at.0.saturating_sub(now.0)),
                    max: Duration::from_millis(max_ttl_ms),
                });
            }
        };
        self.settle(pending.map(|_| answer))
    }
}
