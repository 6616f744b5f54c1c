//! The store side of replication (`docs/REPLICATION.md`): one [`Slot`] per
//! partition of a namespace, holding the records written in it that the changelog
//! has not stored yet, the partition's owner (`PartitionOwner`) and who waits; and
//! the shipping threads that drain the slots into the changelog.
//!
//! The write path enqueues a record into its partition's slot under the key's shard
//! lock, right after the local append, so a key's records are queued in the order
//! they were written. A shipper takes everything a slot has queued (up to one
//! message's worth), appends it as one message, and counts it shipped: waiters of
//! `Sync` and `flush_partition` wait for the count to pass their record's number, so
//! concurrent callers share one round trip, as they share an fsync in `Immediate`.

use std::collections::HashMap;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

pub(crate) use super::config::{Replication, ReplicationMode};
use super::owner::PartitionOwner;

mod ship;
use super::config::subject_token;
use ship::ship_loop;

/// Who may write in a partition here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Never restored, or released: writes are refused (`Error::NotOwned`).
    NotOwned,
    /// `restore_partition` is reading the changelog.
    Restoring,
    Owned,
    /// Another owner took the partition over (token): writes are refused
    /// (`Error::Fenced`) until it is restored again.
    Fenced(u64),
}

/// Why a wait for the cluster ended without the records stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WaitError {
    Fenced(u64),
    /// The timeout passed; the last shipping error, if any.
    Timeout(Option<String>),
    /// The partition was released or the store closed with the records unshipped.
    Dropped,
}

pub(crate) struct SlotState {
    pub role: Role,
    owner: Option<PartitionOwner>,
    /// Queued entries, each `[u64 deadline][record]`, and where each ends.
    buf: Vec<u8>,
    ends: Vec<usize>,
    /// Records ever queued, and shipped (stored by the changelog), in order.
    pub enqueued: u64,
    pub shipped: u64,
    /// Ranges `(after, through]` of record numbers dropped unshipped (fenced, or
    /// released with an unreachable cluster), the latest last: waiters on them get an
    /// error. At most `DROPPED_RANGES`.
    dropped: Vec<(u64, u64)>,
    /// Records in the owner's pending message (sent, outcome unknown), and their
    /// bytes as they were queued.
    in_owner: u64,
    in_owner_bytes: usize,
    /// A shipper holds the owner, and the records (and their bytes) it took from
    /// the queue for this round: still queued, for the budget and the stats.
    in_flight: bool,
    in_flight_records: u64,
    in_flight_bytes: usize,
    scheduled: bool,
    retry_at: Option<Instant>,
    oldest_queued: Option<Instant>,
    pub last_error: Option<String>,
    /// The changelog position this store has reached in the partition.
    pub position: u64,
    pub token: u64,
    pub highest_offset: Option<u64>,
    /// The local records of the partition may include some the changelog lacks
    /// (records dropped unshipped, or a crash while owning it): the next restore
    /// ships the partition's live local records again.
    pub reship: bool,
    pub(super) wakers: Vec<(u64, Instant, Waker)>,
    /// Threads blocked in `wait`, with their targets, and the threads the last round
    /// released: the shipper's estimate of how many callers are about to queue a
    /// record, so that it can linger a moment for them (group commit).
    pub(super) blocked: Vec<(std::thread::ThreadId, u64)>,
    pub(super) released: Vec<std::thread::ThreadId>,
    pub records_shipped: u64,
    pub messages_shipped: u64,
    pub bytes_shipped: u64,
}

/// One partition of one namespace.
pub(crate) struct Slot {
    pub namespace: String,
    pub namespace_id: u32,
    pub partition: u32,
    pub subject: String,
    pub state: Mutex<SlotState>,
    changed: Condvar,
}

/// What a waiter waits for: the slot's shipped count to reach `target`.
#[derive(Clone)]
pub(crate) struct ShipWait {
    pub slot: Arc<Slot>,
    pub target: u64,
    pub deadline: Instant,
}

impl std::fmt::Debug for ShipWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ShipWait({}, {})", self.slot.subject, self.target)
    }
}

impl Slot {
    fn new(namespace: &str, namespace_id: u32, partition: u32, prefix: &str) -> Slot {
        Slot {
            namespace: namespace.to_string(),
            namespace_id,
            partition,
            subject: format!("{prefix}.{}.{partition}", subject_token(namespace)),
            state: Mutex::new(SlotState {
                role: Role::NotOwned,
                owner: None,
                buf: Vec::new(),
                ends: Vec::new(),
                enqueued: 0,
                shipped: 0,
                dropped: Vec::new(),
                in_owner: 0,
                in_owner_bytes: 0,
                in_flight_records: 0,
                in_flight_bytes: 0,
                in_flight: false,
                scheduled: false,
                retry_at: None,
                oldest_queued: None,
                last_error: None,
                position: 0,
                token: 0,
                highest_offset: None,
                reship: false,
                wakers: Vec::new(),
                blocked: Vec::new(),
                released: Vec::new(),
                records_shipped: 0,
                messages_shipped: 0,
                bytes_shipped: 0,
            }),
            changed: Condvar::new(),
        }
    }

    /// Bytes queued and not yet stored by the cluster: in the queue, taken by a
    /// shipper this round, or in the owner's pending message.
    pub(crate) fn queued_bytes(state: &SlotState) -> usize {
        state.buf.len() + state.in_flight_bytes + state.in_owner_bytes
    }

    /// Records queued and not yet stored by the cluster, counted as
    /// [`Slot::queued_bytes`] counts their bytes.
    pub(crate) fn queued_records(state: &SlotState) -> u64 {
        state.ends.len() as u64 + state.in_flight_records + state.in_owner
    }

    /// Queues one record (called under the key's shard lock, after its local append).
    /// Returns the record's number, to wait for.
    pub(crate) fn enqueue(
        state: &mut SlotState,
        deadline_ms: u64,
        len: usize,
        encode: impl FnOnce(&mut [u8]),
    ) -> u64 {
        let start = state.buf.len();
        state.buf.extend_from_slice(&deadline_ms.to_le_bytes());
        state.buf.resize(start + 8 + len, 0);
        encode(&mut state.buf[start + 8..]);
        state.ends.push(state.buf.len());
        state.oldest_queued.get_or_insert_with(Instant::now);
        state.enqueued += 1;
        state.enqueued
    }

    /// Blocks until `wait` is met, fails, or its deadline passes.
    pub(crate) fn wait(&self, target: u64, deadline: Instant) -> Result<(), WaitError> {
        let mut state = self.state.lock();
        if let Some(done) = outcome(&state, target) {
            return done;
        }
        let me = std::thread::current().id();
        state.blocked.push((me, target));
        let done = loop {
            if let Some(done) = outcome(&state, target) {
                break done;
            }
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                break outcome(&state, target)
                    .unwrap_or_else(|| Err(WaitError::Timeout(state.last_error.clone())));
            }
        };
        if let Some(i) = state
            .blocked
            .iter()
            .position(|&(t, n)| t == me && n == target)
        {
            state.blocked.swap_remove(i);
        }
        done
    }

    /// How many distinct threads are about to have a record queued: those blocked on
    /// a record not shipped yet, and those the last round released (which a `Sync`
    /// caller follows with its next call).
    pub(super) fn expected_writers(state: &SlotState) -> usize {
        let blocked = state
            .blocked
            .iter()
            .filter(|&&(_, target)| target > state.shipped)
            .map(|&(t, _)| t);
        let mut threads: Vec<std::thread::ThreadId> = Vec::new();
        for t in blocked.chain(state.released.iter().copied()) {
            if !threads.contains(&t) {
                threads.push(t);
            }
        }
        threads.len()
    }

    /// The threads blocked on records up to `shipped` (released by this round).
    pub(super) fn note_released(state: &mut SlotState) {
        let shipped = state.shipped;
        state.released = state
            .blocked
            .iter()
            .filter(|&&(_, target)| target <= shipped)
            .map(|&(t, _)| t)
            .collect();
    }

    /// Polls `wait`, registering `cx`'s waker for the shipper to wake.
    pub(crate) fn poll(
        &self,
        target: u64,
        deadline: Instant,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), WaitError>> {
        let mut state = self.state.lock();
        if let Some(done) = outcome(&state, target) {
            return Poll::Ready(done);
        }
        if Instant::now() >= deadline {
            return Poll::Ready(Err(WaitError::Timeout(state.last_error.clone())));
        }
        match state
            .wakers
            .iter_mut()
            .find(|(t, _, w)| *t == target && w.will_wake(cx.waker()))
        {
            Some(_) => {}
            None => state.wakers.push((target, deadline, cx.waker().clone())),
        }
        Poll::Pending
    }

    fn notify(&self, state: &mut SlotState) {
        self.changed.notify_all();
        let now = Instant::now();
        let mut i = 0;
        while i < state.wakers.len() {
            let (target, deadline, _) = &state.wakers[i];
            if outcome(state, *target).is_some() || now >= *deadline {
                state.wakers.swap_remove(i).2.wake();
            } else {
                i += 1;
            }
        }
    }

    /// Takes the partition: the owner a take-over made, at its position.
    pub(crate) fn own(&self, owner: PartitionOwner) {
        let mut state = self.state.lock();
        state.position = owner.last_seq();
        state.token = owner.token();
        state.owner = Some(owner);
        // Every record queued before is shipped or dropped: the new owner's records
        // are numbered from here.
        state.shipped = state.enqueued;
        state.role = Role::Owned;
        state.last_error = None;
        self.changed.notify_all();
    }

    /// Drops the owner and whatever is still queued (counted), and the role.
    pub(crate) fn disown(&self, role: Role) -> u64 {
        let mut state = self.state.lock();
        let dropped = state.enqueued - state.shipped;
        drop_unshipped(&mut state);
        state.buf.clear();
        state.ends.clear();
        state.in_owner = 0;
        state.in_owner_bytes = 0;
        state.oldest_queued = None;
        if !state.in_flight {
            state.owner = None;
        }
        state.role = role;
        self.notify(&mut state);
        dropped
    }
}

const DROPPED_RANGES: usize = 64;

/// Marks every record queued and not shipped as dropped.
fn drop_unshipped(state: &mut SlotState) {
    if state.enqueued > state.shipped {
        state.reship = true;
        if state.dropped.len() == DROPPED_RANGES {
            state.dropped.remove(0);
        }
        state.dropped.push((state.shipped, state.enqueued));
    }
}

/// The outcome of a wait for `target`, if it is decided.
fn outcome(state: &SlotState, target: u64) -> Option<Result<(), WaitError>> {
    let dropped = state
        .dropped
        .iter()
        .any(|&(after, through)| after < target && target <= through);
    if dropped {
        Some(Err(match state.role {
            Role::Fenced(by) => WaitError::Fenced(by),
            _ => WaitError::Dropped,
        }))
    } else if state.shipped >= target {
        Some(Ok(()))
    } else if let Role::Fenced(by) = state.role {
        Some(Err(WaitError::Fenced(by)))
    } else {
        None
    }
}

/// The slots of a store and its shipping threads.
pub(crate) struct Replica {
    /// None when the store is not replicated: the slots then only track each
    /// partition's highest offset, and no shipping thread runs.
    pub config: Option<Replication>,
    slots: Mutex<HashMap<(u32, u32), Arc<Slot>>>,
    work: Mutex<Work>,
    ready: Condvar,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Restores since open, the messages they read, the records they applied and the
    /// damaged messages they skipped.
    pub restores: [std::sync::atomic::AtomicU64; 5],
    /// The subject prefix `PARTITIONS` was written under, kept so that a store opened
    /// without replication writes it back unchanged.
    pub file_prefix: Mutex<Option<String>>,
}

#[derive(Default)]
struct Work {
    queue: std::collections::VecDeque<Arc<Slot>>,
    stop: bool,
}

impl Replica {
    pub(crate) fn new(config: Option<Replication>) -> Arc<Replica> {
        let replica = Arc::new(Replica {
            config,
            slots: Mutex::new(HashMap::new()),
            work: Mutex::new(Work::default()),
            ready: Condvar::new(),
            threads: Mutex::new(Vec::new()),
            restores: Default::default(),
            file_prefix: Mutex::new(None),
        });
        let shippers = replica.config.as_ref().map_or(0, |c| c.shippers.max(1));
        let mut threads = replica.threads.lock();
        for n in 0..shippers {
            let weak = Arc::downgrade(&replica);
            let spawned = std::thread::Builder::new()
                .name(format!("idemstore-ship-{n}"))
                .spawn(move || ship_loop(weak));
            match spawned {
                Ok(handle) => threads.push(handle),
                Err(e) => tracing::error!(error = %e, "starting a replication shipping thread"),
            }
        }
        drop(threads);
        replica
    }

    /// The slot of partition `partition` of the namespace, created on first use.
    pub(crate) fn slot(&self, namespace: &str, namespace_id: u32, partition: u32) -> Arc<Slot> {
        let mut slots = self.slots.lock();
        Arc::clone(slots.entry((namespace_id, partition)).or_insert_with(|| {
            Arc::new(Slot::new(
                namespace,
                namespace_id,
                partition,
                self.config
                    .as_ref()
                    .map_or("", |c| c.subject_prefix.as_str()),
            ))
        }))
    }

    pub(crate) fn slots(&self) -> Vec<Arc<Slot>> {
        self.slots.lock().values().cloned().collect()
    }

    /// Hands a slot with queued records to a shipper (once: until it has shipped).
    pub(crate) fn schedule(&self, slot: &Arc<Slot>, state: &mut SlotState) {
        if state.scheduled || state.in_flight {
            return;
        }
        state.scheduled = true;
        self.work.lock().queue.push_back(Arc::clone(slot));
        self.ready.notify_one();
    }

    /// What the slots hold and the shipping threads did (`Stats::replication`; the
    /// restore counters are the caller's).
    pub(crate) fn totals(&self) -> crate::stats::ReplicationStats {
        let mut totals = crate::stats::ReplicationStats::default();
        let now = Instant::now();
        for slot in self.slots() {
            let state = slot.state.lock();
            totals.partitions += 1;
            match state.role {
                Role::Owned => totals.owned += 1,
                Role::Fenced(_) => totals.fenced += 1,
                Role::NotOwned | Role::Restoring => {}
            }
            totals.queued_records += Slot::queued_records(&state);
            totals.queued_bytes += Slot::queued_bytes(&state) as u64;
            totals.shipped_records += state.records_shipped;
            totals.shipped_messages += state.messages_shipped;
            totals.shipped_bytes += state.bytes_shipped;
            if let Some(oldest) = state.oldest_queued {
                totals.lag = totals.lag.max(now - oldest);
            }
        }
        totals
    }

    /// Stops the shipping threads (what is queued stays unshipped).
    pub(crate) fn stop(&self) {
        self.work.lock().stop = true;
        self.ready.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock());
        for thread in threads {
            let _ = thread.join();
        }
        for slot in self.slots() {
            let mut state = slot.state.lock();
            drop_unshipped(&mut state);
            slot.notify(&mut state);
        }
    }
}
