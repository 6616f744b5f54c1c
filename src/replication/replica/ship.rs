//! The shipping threads: each takes a slot with queued records, settles what its
//! owner left pending, sends one message's worth, and counts what landed; a
//! changelog error puts the batch back at the front for a retry, a fence disowns the
//! slot.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Replica, ReplicationMode, Role, Slot};
use crate::replication::owner::ReplicationError;

const RETRY_AFTER: Duration = Duration::from_millis(50);
/// How long an `Async` record may wait for more to fill its message.
const ASYNC_LINGER: Duration = Duration::from_millis(2);
/// The longest a `Sync` round waits for the callers it expects.
const LINGER: Duration = Duration::from_micros(200);

pub(super) fn ship_loop(replica: std::sync::Weak<Replica>) {
    // The buffer this thread swaps into a slot for the records it takes, so that a
    // round copies nothing and maps no fresh pages (reused round after round).
    let mut spare = Vec::new();
    loop {
        let Some(replica) = replica.upgrade() else {
            return;
        };
        let slot = {
            let mut work = replica.work.lock();
            loop {
                if work.stop {
                    return;
                }
                if let Some(slot) = work.queue.pop_front() {
                    break Some(slot);
                }
                if replica
                    .ready
                    .wait_for(&mut work, Duration::from_millis(100))
                    .timed_out()
                {
                    break None;
                }
            }
        };
        match slot {
            Some(slot) => ship(&replica, &slot, &mut spare),
            None => expire_waiters(&replica),
        }
    }
}

/// Wakes futures whose deadline passed (nothing else would), and reschedules slots
/// whose retry is due.
fn expire_waiters(replica: &Replica) {
    for slot in replica.slots() {
        let mut state = slot.state.lock();
        if !state.wakers.is_empty() {
            slot.notify(&mut state);
        }
        if state.retry_at.is_some_and(|at| at <= Instant::now()) {
            state.retry_at = None;
            replica.schedule(&slot, &mut state);
        }
    }
}

/// One round of one slot: settle what the owner has pending, then send one message of
/// what is queued. `spare` is the shipping thread's reusable buffer.
fn ship(replica: &Replica, slot: &Arc<Slot>, spare: &mut Vec<u8>) {
    let Some(config) = replica.config.as_ref() else {
        return;
    };
    let log = config.changelog.as_ref();
    let (mut owner, batch, count) = {
        let mut state = slot.state.lock();
        state.scheduled = false;
        if state.role != Role::Owned || state.in_flight {
            return;
        }
        if let Some(at) = state.retry_at
            && at > Instant::now()
        {
            return; // expire_waiters reschedules it
        }
        // Group commit for `Sync`: callers released by the last round are about to
        // queue their next records; linger a moment (at most LINGER) so that one round
        // trip carries them all.
        if config.mode == ReplicationMode::Sync {
            let until = Instant::now() + LINGER;
            while state.ends.len() < Slot::expected_writers(&state) && Instant::now() < until {
                drop(state);
                std::thread::yield_now();
                state = slot.state.lock();
            }
            state.released.clear();
            if state.role != Role::Owned || state.in_flight {
                return;
            }
        }
        // Async: ship full messages rather than many small ones (fewer round trips,
        // fewer wake-ups of the writers' cores), waiting up to ASYNC_LINGER after the
        // oldest queued record, unless someone waits for the partition (a flush).
        if config.mode == ReplicationMode::Async
            && state.blocked.is_empty()
            && state.wakers.is_empty()
            && state.buf.len() < config.message_bytes / 2
            && let Some(oldest) = state.oldest_queued
        {
            let due = oldest + ASYNC_LINGER;
            let now = Instant::now();
            if now < due {
                drop(state);
                std::thread::sleep(due - now);
                state = slot.state.lock();
                if state.role != Role::Owned || state.in_flight {
                    return;
                }
            }
        }
        let Some(owner) = state.owner.take() else {
            return;
        };
        // One message's worth of the queue.
        let limit = config.message_bytes;
        let mut take = 0;
        while take < state.ends.len() && (take == 0 || state.ends[take] <= limit) {
            take += 1;
        }
        let batch: Vec<u8> = if take == state.ends.len() {
            // All of it (the common case): swap the queue with the spare buffer.
            let mut batch = std::mem::take(spare);
            batch.clear();
            std::mem::swap(&mut state.buf, &mut batch);
            state.ends.clear();
            batch
        } else {
            let cut = state.ends[take - 1];
            let batch = state.buf.drain(..cut).collect();
            state.ends.drain(..take);
            for end in &mut state.ends {
                *end -= cut;
            }
            batch
        };
        state.in_flight = true;
        state.in_flight_records = take as u64;
        state.in_flight_bytes = batch.len();
        (owner, batch, take as u64)
    };
    let mut result: Result<(), ReplicationError> = Ok(());
    let mut landed = 0u64;
    let mut landed_messages = 0u64;
    let mut requeue: Option<Vec<u8>> = None;
    let in_owner = slot.state.lock().in_owner;
    // 1. The message an earlier round left pending.
    if owner.has_pending() {
        match owner.settle_pending(log) {
            Ok(_) => {
                landed += in_owner;
                landed_messages += 1;
            }
            Err(e) => {
                result = Err(e);
                requeue = Some(batch.clone());
            }
        }
    }
    // 2. This round's records.
    let mut now_in_owner = if result.is_ok() { 0 } else { in_owner };
    // The bytes of the owner's pending message after this round: the earlier one's
    // (unchanged) or this round's batch.
    let mut pending_is_batch = false;
    if result.is_ok() && count > 0 {
        let records = split(&batch);
        match owner.append(log, &records) {
            Ok(_) => {
                landed += count;
                landed_messages += 1;
            }
            Err(e) => {
                if owner.has_pending() {
                    now_in_owner = count;
                    pending_is_batch = true;
                } else {
                    requeue = Some(batch.clone());
                }
                result = Err(e);
            }
        }
    }
    let mut state = slot.state.lock();
    // A restore or release meanwhile replaced the owner: this one's outcome is its own.
    let current = state.token == owner.token();
    state.in_flight = false;
    state.in_flight_records = 0;
    state.in_flight_bytes = 0;
    if current {
        state.in_owner = now_in_owner;
        if now_in_owner == 0 {
            state.in_owner_bytes = 0;
        } else if pending_is_batch {
            state.in_owner_bytes = batch.len();
        }
        state.shipped = (state.shipped + landed).min(state.enqueued);
        state.position = owner.last_seq();
    }
    state.records_shipped += landed;
    state.messages_shipped += landed_messages;
    if landed > 0 {
        state.bytes_shipped += batch.len() as u64;
    }
    match result {
        Ok(()) => {
            state.last_error = None;
            state.retry_at = None;
        }
        Err(ReplicationError::Fenced { .. }) if !current => {}
        Err(ReplicationError::Fenced { by, .. }) => {
            tracing::warn!(subject = %slot.subject, by, "fenced: another owner took the partition over");
            drop(state);
            let dropped = slot.disown(Role::Fenced(by));
            if dropped > 0 {
                tracing::warn!(subject = %slot.subject, records = dropped, "records of a fenced partition not shipped");
            }
            return;
        }
        Err(ReplicationError::Changelog(_)) if !current => {}
        Err(ReplicationError::Changelog(e)) => {
            state.last_error = Some(e.to_string());
            state.retry_at = Some(Instant::now() + RETRY_AFTER);
            if let Some(back) = requeue {
                // Back at the front, in order.
                let n = back.len();
                let mut ends = Vec::new();
                let mut at = 0;
                while at < n {
                    at += record_len_at(&back, at);
                    ends.push(at);
                }
                for end in &mut state.ends {
                    *end += n;
                }
                ends.append(&mut state.ends);
                state.ends = ends;
                let mut buf = back;
                buf.append(&mut state.buf);
                state.buf = buf;
            }
        }
    }
    // A restore or release meanwhile replaced or dropped the owner: this one is stale.
    if current && state.role == Role::Owned && state.owner.is_none() {
        state.owner = Some(owner);
    }
    if state.buf.is_empty() && state.in_owner == 0 {
        state.oldest_queued = None;
    }
    let more = !state.buf.is_empty() || state.in_owner > 0;
    Slot::note_released(&mut state);
    slot.notify(&mut state);
    if more && state.retry_at.is_none() {
        replica.schedule(slot, &mut state);
    }
    drop(state);
    if batch.capacity() > spare.capacity() {
        *spare = batch;
    }
}

/// The length of the entry (`[u64 deadline][record]`) at `at`.
fn record_len_at(buf: &[u8], at: usize) -> usize {
    let header = crate::format::record::Header::decode(&buf[at + 8..])
        .expect("queued records are well formed");
    8 + header.record_len()
}

/// `(deadline, record bytes)` of each queued entry.
fn split(buf: &[u8]) -> Vec<(u64, &[u8])> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let len = record_len_at(buf, at);
        let deadline = u64::from_le_bytes(buf[at..at + 8].try_into().expect("8 bytes"));
        out.push((deadline, &buf[at + 8..at + len]));
        at += len;
    }
    out
}
