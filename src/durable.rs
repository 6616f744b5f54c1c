//! [`Durable`]: the future of an answer that may be acted on once the store's
//! durability mode allows. The operation itself (the atomic decision and its write)
//! is done when the call is made; only the wait for the group commit is deferred to
//! the future, which the commit thread wakes (`log::commit`), so an async consumer
//! can keep many messages in flight under one fsync without blocking its executor.
//! Runtime-agnostic: a plain `std::future::Future`, woken through `std::task::Waker`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use crate::engine::{Engine, Pending};
use crate::error::Error;
use crate::replication::replica::ShipWait;

/// The durability wait of an operation already applied, then its answer.
///
/// Resolves to the operation's answer once the answer may be acted on: in
/// `Durability::Immediate` after the sync that covers the write (or the record the
/// answer reports), at once in the other modes. A failed sync, a poisoned or a closed
/// store resolves it with the same error a blocking call gets.
///
/// Dropping it before it resolves leaves the store consistent: the write stays and is
/// made durable by a later sync; a `Claim` the answer held is dropped, and so
/// released, as dropping a `Claim` does.
#[must_use = "the operation is applied; await the future before acting on its answer"]
pub struct Durable<T> {
    engine: Option<Arc<Engine>>,
    /// The commit ticket to wait for, until the commit thread covers it.
    ticket: Option<u64>,
    answer: Option<Result<T, Error>>,
    /// Then the cluster's (`ReplicationMode::Sync`), until the shipper covers it.
    ship: Option<Box<ShipWait>>,
}

impl<T> std::fmt::Debug for Durable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Durable")
            .field("ticket", &self.ticket)
            .field("ship", &self.ship)
            .field("resolved", &self.answer.is_none())
            .finish()
    }
}

// The answer is moved out by value, never pinned.
impl<T> Unpin for Durable<T> {}

impl<T> Durable<T> {
    /// An answer that needs no wait (or an error from applying the operation).
    pub(crate) fn ready(answer: Result<T, Error>) -> Durable<T> {
        Durable {
            engine: None,
            ticket: None,
            answer: Some(answer),
            ship: None,
        }
    }

    /// The answer of an applied operation, waiting for a commit ticket if it must.
    pub(crate) fn after(engine: &Arc<Engine>, pending: Pending<Result<T, Error>>) -> Durable<T> {
        if !pending.wait && pending.ship.is_none() {
            return Durable::ready(pending.value);
        }
        let ticket = if pending.wait {
            match engine.commit_ticket() {
                Ok(ticket) => Some(ticket),
                Err(e) => return Durable::ready(Err(e)),
            }
        } else {
            None
        };
        Durable {
            engine: Some(Arc::clone(engine)),
            ticket,
            answer: Some(pending.value),
            ship: pending.ship,
        }
    }

    /// `after` for an operation that failed or was applied.
    pub(crate) fn applied(engine: &Arc<Engine>, applied: Result<Pending<T>, Error>) -> Durable<T> {
        match applied {
            Ok(pending) => Durable::after(engine, pending.map(Ok)),
            Err(e) => Durable::ready(Err(e)),
        }
    }
}

impl<T> Future for Durable<T> {
    type Output = Result<T, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let (Some(ticket), Some(engine)) = (this.ticket, &this.engine) {
            match engine.poll_commit(ticket, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(waited) => {
                    this.ticket = None;
                    if let Err(e) = waited {
                        // The answer (a claim, say) is dropped here: released.
                        this.answer = None;
                        return Poll::Ready(Err(e));
                    }
                }
            }
        }
        if let Some(ship) = &this.ship {
            match ship.slot.poll(ship.target, ship.deadline, cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(waited) => {
                    let slot = Arc::clone(&ship.slot);
                    this.ship = None;
                    if let Err(e) = waited {
                        this.answer = None;
                        return Poll::Ready(Err(Error::from_wait(&slot, e)));
                    }
                }
            }
        }
        Poll::Ready(
            this.answer
                .take()
                .expect("a Durable future polled after it resolved"),
        )
    }
}

impl<T> Drop for Durable<T> {
    fn drop(&mut self) {
        if let (Some(ticket), Some(engine)) = (self.ticket, &self.engine) {
            engine.forget_commit(ticket);
        }
    }
}
