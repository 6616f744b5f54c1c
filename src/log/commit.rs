//! Group commit: one thread syncs the log; callers that need durability wait for the
//! round that covers their write, so concurrent callers share one fsync.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Log;
use crate::error::Error;

#[derive(Default)]
struct State {
    /// The highest ticket handed out. A ticket is taken after the caller's write.
    requested: u64,
    /// Every ticket up to this one is covered by a completed sync.
    completed: u64,
    /// The first sync failure; sticky.
    failure: Option<(std::io::ErrorKind, String)>,
    stop: bool,
}

pub(crate) struct Committer {
    state: Mutex<State>,
    wake: Condvar,
    /// Completed sync rounds (for stats and tests of group commit).
    pub(crate) rounds: AtomicU64,
    /// Tickets waited for (operations that needed a durable answer).
    pub(crate) waits: AtomicU64,
}

impl Committer {
    pub(crate) fn new() -> Committer {
        Committer {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            rounds: AtomicU64::new(0),
            waits: AtomicU64::new(0),
        }
    }

    /// Waits until every write made before this call is durable.
    pub(crate) fn wait_durable(&self) -> Result<(), Error> {
        self.waits.fetch_add(1, Ordering::Relaxed);
        let mut state = self.state.lock();
        if state.stop {
            return Err(Error::Closed);
        }
        state.requested += 1;
        let ticket = state.requested;
        self.wake.notify_all();
        loop {
            if let Some((kind, message)) = &state.failure {
                return Err(failure_error(*kind, message));
            }
            if state.completed >= ticket {
                return Ok(());
            }
            if state.stop {
                return Err(Error::Closed);
            }
            self.wake.wait(&mut state);
        }
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
        loop {
            let target = {
                let mut state = self.state.lock();
                loop {
                    if state.failure.is_some() {
                        // Poisoned: nothing more will be synced; wake anyone waiting.
                        self.wake.notify_all();
                        if state.stop {
                            return;
                        }
                        self.wake.wait(&mut state);
                        continue;
                    }
                    if state.requested > state.completed {
                        break state.requested;
                    }
                    if state.stop {
                        return;
                    }
                    match next_periodic {
                        Some(at) if Instant::now() >= at => break state.requested,
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
            let result = log.sync();
            self.rounds.fetch_add(1, Ordering::Relaxed);
            let mut state = self.state.lock();
            match result {
                Ok(()) => state.completed = state.completed.max(target),
                Err(e) => {
                    log.poison();
                    tracing::error!(error = %e, "fsync failed; the store refuses writes until reopened");
                    let (kind, message) = match &e {
                        Error::Io { source, .. } => (source.kind(), e.to_string()),
                        _ => (std::io::ErrorKind::Other, e.to_string()),
                    };
                    state.failure = Some((kind, message));
                }
            }
            self.wake.notify_all();
        }
    }

    /// Stops the thread after the current round; waiters get `Closed`.
    pub(crate) fn stop(&self) {
        let mut state = self.state.lock();
        state.stop = true;
        self.wake.notify_all();
    }

    pub(crate) fn failure(&self) -> Option<Error> {
        let state = self.state.lock();
        state
            .failure
            .as_ref()
            .map(|(kind, message)| failure_error(*kind, message))
    }
}

fn failure_error(kind: std::io::ErrorKind, message: &str) -> Error {
    Error::Io {
        op: "syncing the log (earlier failure; the store is poisoned)",
        path: std::path::PathBuf::new(),
        source: std::io::Error::new(kind, message.to_string()),
    }
}
