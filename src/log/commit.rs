//! Group commit: one thread syncs the log; callers that need durability wait for the
//! round that covers their write, so concurrent callers share one fsync.
//!
//! A caller takes a *ticket* after its write; the round that completes it covers the
//! write. Blocking callers wait for their ticket on the condition variable; futures
//! (`Durable`) register a `Waker` for it, which the commit thread wakes when a round
//! covers the ticket, fails, or the store closes. One mechanism, two ways to wait.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Log;
use crate::error::Error;
use crate::poison::Poison;

#[derive(Default)]
struct State {
    /// The highest ticket handed out. A ticket is taken after the caller's write.
    requested: u64,
    /// Every ticket up to this one is covered by a completed sync.
    completed: u64,
    /// A sync failed: the log's poison holds the error.
    failed: bool,
    /// Futures waiting for their ticket, woken by the commit thread.
    wakers: Vec<(u64, Waker)>,
    stop: bool,
}

/// The longest a round waits for more callers to join it.
const GATHER_MAX: Duration = Duration::from_micros(500);

pub(crate) struct Committer {
    state: Mutex<State>,
    poison: Arc<Poison>,
    wake: Condvar,
    /// Completed sync rounds (for stats and tests of group commit).
    pub(crate) rounds: AtomicU64,
    /// Tickets waited for (operations that needed a durable answer).
    pub(crate) waits: AtomicU64,
}

impl Committer {
    pub(crate) fn new(poison: Arc<Poison>) -> Committer {
        Committer {
            state: Mutex::new(State::default()),
            poison,
            wake: Condvar::new(),
            rounds: AtomicU64::new(0),
            waits: AtomicU64::new(0),
        }
    }

    /// Waits until every write made before this call is durable.
    pub(crate) fn wait_durable(&self) -> Result<(), Error> {
        let ticket = self.ticket()?;
        self.wait(ticket)
    }

    /// A ticket covering every write made before this call; the commit thread is
    /// asked for a round.
    pub(crate) fn ticket(&self) -> Result<u64, Error> {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock();
        if state.stop {
            return Err(Error::Closed);
        }
        state.requested += 1;
        self.wake.notify_all();
        Ok(state.requested)
    }

    /// Blocks until `ticket` is covered by a completed sync.
    pub(crate) fn wait(&self, ticket: u64) -> Result<(), Error> {
        let mut state = self.state.lock();
        loop {
            if let Some(answer) = self.answer(&state, ticket) {
                return answer;
            }
            self.wake.wait(&mut state);
        }
    }

    /// `Ready` once `ticket` is covered by a completed sync (or never will be);
    /// else registers `cx`'s waker, which the commit thread wakes.
    pub(crate) fn poll(&self, ticket: u64, cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        let mut state = self.state.lock();
        if let Some(answer) = self.answer(&state, ticket) {
            return Poll::Ready(answer);
        }
        match state.wakers.iter_mut().find(|(t, _)| *t == ticket) {
            Some((_, waker)) => waker.clone_from(cx.waker()),
            None => state.wakers.push((ticket, cx.waker().clone())),
        }
        Poll::Pending
    }

    /// Wakers registered and not yet woken or forgotten (for tests of cancellation).
    #[cfg(feature = "testing")]
    pub(crate) fn pending_wakers(&self) -> usize {
        self.state.lock().wakers.len()
    }

    /// Forgets the waker of a ticket whose future was dropped before it resolved.
    pub(crate) fn forget(&self, ticket: u64) {
        self.state.lock().wakers.retain(|(t, _)| *t != ticket);
    }

    /// The answer for `ticket` if it has one now.
    fn answer(&self, state: &State, ticket: u64) -> Option<Result<(), Error>> {
        #[cfg(feature = "planted-bugs")]
        if crate::planted::planted("ack-before-fsync") {
            return Some(Ok(()));
        }
        if state.failed || self.poison.is_set() {
            return Some(Err(self.poisoned()));
        }
        if state.completed >= ticket {
            return Some(Ok(()));
        }
        if state.stop {
            return Some(Err(Error::Closed));
        }
        None
    }

    /// Wakes the futures whose ticket is answered now (all of them after a failure
    /// or at stop). Called with the state locked, after it changed.
    fn wake_answered(&self, state: &mut State) {
        let all = state.failed || state.stop || self.poison.is_set();
        let completed = state.completed;
        state.wakers.retain(|(ticket, waker)| {
            let answered = all || *ticket <= completed;
            if answered {
                waker.wake_by_ref();
            }
            !answered
        });
    }

    /// Starts the commit thread. With `interval`, it also syncs on that period.
    pub(crate) fn spawn(
        self: &Arc<Self>,
        log: Arc<Log>,
        interval: Option<Duration>,
    ) -> JoinHandle<()> {
        let committer = Arc::clone(self);
        std::thread::Builder::new()
            .name("idemstore-commit".to_string())
            .spawn(move || committer.run(&log, interval))
            .expect("spawning the idemstore commit thread")
    }

    fn run(&self, log: &Log, interval: Option<Duration>) {
        let mut next_periodic = interval.map(|d| Instant::now() + d);
        // Callers seen around the last round: those it covered plus those that arrived
        // while it synced. They are likely to come back within a fraction of an fsync.
        let mut expected_callers = 0u64;
        let mut last_sync = Duration::ZERO;
        loop {
            let mut gather_until: Option<Instant> = None;
            let (target, completed_before) = {
                let mut state = self.state.lock();
                loop {
                    if state.failed {
                        // Poisoned: nothing more will be synced; wake anyone waiting.
                        self.wake_answered(&mut state);
                        self.wake.notify_all();
                        if state.stop {
                            return;
                        }
                        self.wake.wait(&mut state);
                        continue;
                    }
                    if state.requested > state.completed {
                        // Group commit: if fewer callers are waiting than took part in
                        // the last round, give the others a moment (a fraction of an
                        // fsync) to join this one instead of paying for their own.
                        let waiting = state.requested - state.completed;
                        let until = *gather_until.get_or_insert_with(|| {
                            Instant::now() + (last_sync / 2).min(GATHER_MAX)
                        });
                        if waiting < expected_callers && !state.stop && Instant::now() < until {
                            self.wake.wait_until(&mut state, until);
                            continue;
                        }
                        break (state.requested, state.completed);
                    }
                    if state.stop {
                        return;
                    }
                    match next_periodic {
                        Some(at) if Instant::now() >= at => {
                            break (state.requested, state.completed);
                        }
                        Some(at) => {
                            self.wake.wait_until(&mut state, at);
                        }
                        None => self.wake.wait(&mut state),
                    }
                }
            };
            if let Some(d) = interval {
                next_periodic = Some(Instant::now() + d);
            }
            let started = Instant::now();
            let result = log.sync();
            last_sync = started.elapsed();
            self.rounds.fetch_add(1, Ordering::Relaxed);
            let mut state = self.state.lock();
            expected_callers = state.requested - completed_before;
            match result {
                Ok(()) => state.completed = state.completed.max(target),
                Err(e) => {
                    self.poison.set(&e);
                    state.failed = true;
                }
            }
            self.wake_answered(&mut state);
            self.wake.notify_all();
        }
    }

    /// Stops the thread after the current round; waiters get `Closed`.
    pub(crate) fn stop(&self) {
        let mut state = self.state.lock();
        state.stop = true;
        self.wake_answered(&mut state);
        self.wake.notify_all();
    }

    /// The error of a failed sync, which every waiter gets.
    fn poisoned(&self) -> Error {
        self.poison
            .error()
            .expect("a failed round poisons the store before it is marked failed")
    }
}
