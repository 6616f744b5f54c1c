//! The inventory consumer: one child process of the demo, started by the broker with
//! the hidden `demo-consumer` subcommand and, at the crash points, killed with SIGKILL.
//!
//! It reads a batch of deliveries from stdin, handles each one, reports a verdict per
//! message on stdout, makes its work durable and acks the batch. Without `--store` it
//! deducts stock for every delivery, as a consumer with no dedup does. With `--store`
//! it runs every delivery through idemstore's claim lifecycle first (see the comment
//! at the top of `demo.rs` for why that order is the one that is safe under kill -9).

use std::io::{self, BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use idemstore::{Begin, Clock, Namespace, Policy, Store, SystemClock, UnixMs};

use super::ledger::{self, LedgerWriter};
use super::protocol::{Order, Verdict, parse_delivery};

/// The business type the consumer deduplicates under.
pub const NAMESPACE: &str = "inventory-deduct";
/// How long an order id is remembered: longer than any broker retries it.
pub const TTL: Duration = Duration::from_secs(48 * 3600);
/// How long a claim is held before another consumer may take the order over.
pub const LEASE: Duration = Duration::from_secs(30);
/// Acquisitions before an order is dead-lettered.
pub const MAX_ATTEMPTS: u32 = 5;

/// The namespace policy every consumer of the demo uses.
pub fn policy() -> Policy {
    Policy::ttl(TTL).lease(LEASE).max_attempts(MAX_ATTEMPTS)
}

/// The arguments the broker starts a consumer with.
#[derive(Debug, clap::Args)]
pub struct ConsumerArgs {
    /// This consumer's name (`consumer-3`): names its ledger file.
    #[arg(long)]
    pub name: String,
    /// The directory of ledger files.
    #[arg(long)]
    pub ledger: PathBuf,
    /// The idemstore directory; without it the consumer does no deduplication.
    #[arg(long)]
    pub store: Option<PathBuf>,
    /// How far this consumer's clock runs ahead of the system clock, in ms. The broker
    /// moves it on by a lease after each kill, standing for the time a restart takes,
    /// so the killed consumer's leases have run out without the demo sleeping.
    #[arg(long, default_value_t = 0)]
    pub clock_offset_ms: u64,
}

/// The system clock, `offset_ms` ahead.
#[derive(Debug, Clone, Copy)]
pub struct ShiftedClock {
    pub offset_ms: u64,
}

impl Clock for ShiftedClock {
    fn now(&self) -> UnixMs {
        UnixMs(SystemClock.now().0.saturating_add(self.offset_ms))
    }
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Runs the consumer until stdin closes; exit status 2 on any error.
pub fn run(args: ConsumerArgs) -> ExitCode {
    match serve(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemstore demo: {}: {e}", args.name);
            ExitCode::from(2)
        }
    }
}

/// The idemstore side of a consumer that deduplicates.
struct Dedup {
    store: Store,
    inventory: Namespace,
}

fn serve(args: &ConsumerArgs) -> Result<()> {
    let mut ledger = LedgerWriter::create(&args.ledger, &args.name)
        .map_err(|e| format!("creating its ledger in {}: {e}", args.ledger.display()))?;
    let dedup = match &args.store {
        Some(dir) => {
            let store = Store::builder(dir)
                .clock(ShiftedClock {
                    offset_ms: args.clock_offset_ms,
                })
                .open()?;
            let inventory = store.namespace(NAMESPACE, policy())?;
            Some(Dedup { store, inventory })
        }
        None => None,
    };
    // Stdout is line buffered: every reply is one `write`, so the broker sees each
    // verdict as soon as it is final, and a kill loses no whole line.
    let mut out = io::stdout().lock();
    let (records_replayed, recovery_us) = dedup.as_ref().map_or((0, 0), |d| {
        let stats = d.store.stats();
        (
            stats.records_replayed,
            stats.recovery_time.as_micros() as u64,
        )
    });
    writeln!(out, "READY {records_replayed} {recovery_us}")?;

    let mut batch: Vec<(u32, Order)> = Vec::new();
    for line in io::stdin().lock().lines() {
        let line = line?;
        if let Some(fields) = line.strip_prefix("D ") {
            let delivery =
                parse_delivery(fields).ok_or_else(|| format!("bad delivery line {line:?}"))?;
            batch.push(delivery);
        } else if line == "E" {
            for (tag, order) in batch.drain(..) {
                let verdict = match &dedup {
                    Some(dedup) => handle_with_idemstore(dedup, &mut ledger, args, &order)?,
                    None => {
                        ledger.deduct(&order, 1)?;
                        Verdict::Deducted
                    }
                };
                writeln!(out, "P {tag} {verdict}")?;
            }
            // Ack only what is durable: the deductions, and the claims that say so.
            ledger.sync()?;
            if let Some(dedup) = &dedup {
                dedup.store.flush()?;
            }
            writeln!(out, "A")?;
        } else {
            return Err(format!("bad line from the broker: {line:?}").into());
        }
    }
    // Stdin closed: the broker stopped us (end of traffic, or the partition was
    // revoked by a rebalance). Close the store so the next consumer can open it.
    if let Some(dedup) = dedup {
        dedup.store.close()?;
    }
    ledger.sync()?;
    Ok(())
}

/// One delivery through the claim lifecycle: `begin` → deduct → `complete`.
fn handle_with_idemstore(
    dedup: &Dedup,
    ledger: &mut LedgerWriter,
    args: &ConsumerArgs,
    order: &Order,
) -> Result<Verdict> {
    let id = order.id();
    match dedup.inventory.begin(&id)? {
        Begin::Acquired(claim) => {
            let attempt = claim.attempt();
            // Attempt 1: nobody ever held this order, so nothing was deducted for it.
            // Attempt > 1: a consumer acquired it and was killed before `complete`; it
            // may or may not have deducted. Only now is the ledger consulted — for the
            // handful of orders a kill left open, not for every delivery.
            let already_deducted = attempt > 1 && ledger::contains(&args.ledger, order.number)?;
            let (verdict, result) = if already_deducted {
                (
                    Verdict::Reconciled,
                    format!(
                        "{} found the deduction of attempt {} in the ledger; not deducted again",
                        args.name,
                        attempt - 1
                    ),
                )
            } else {
                ledger.deduct(order, attempt)?;
                let verdict = if attempt > 1 {
                    Verdict::DeductedOnRetry
                } else {
                    Verdict::Deducted
                };
                (
                    verdict,
                    format!(
                        "{} deducted {} x sku-{:02} (attempt {attempt})",
                        args.name, order.quantity, order.sku
                    ),
                )
            };
            claim.complete(Some(result.as_bytes()))?;
            Ok(verdict)
        }
        Begin::Completed(_) => Ok(Verdict::Skipped),
        Begin::InProgress(_) => Ok(Verdict::Nacked),
        Begin::Exhausted(_) => Ok(Verdict::DeadLettered),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shifted_clock_runs_ahead() {
        let clock = ShiftedClock { offset_ms: 31_000 };
        let ahead = clock.now().0 - SystemClock.now().0;
        assert!((30_000..=31_000).contains(&ahead), "{ahead}");
    }
}
