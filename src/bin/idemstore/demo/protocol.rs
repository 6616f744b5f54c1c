//! What the broker (the demo's parent process) and a consumer (a child process) say to
//! each other over the child's stdin and stdout: text, one line per message, so a
//! consumer killed mid-batch leaves whole lines behind for the broker to count.
//!
//! ```text
//! consumer → broker   READY <records replayed> <recovery µs>   once, after opening its store
//! broker → consumer   D <tag> <order> <sku> <quantity>          one per message of a batch
//!                     E                                         end of the batch
//!                     (stdin closed)                            stop: close the store, exit 0
//! consumer → broker   P <tag> <verdict>                         one per message, once handled
//!                     A                                         ack: the batch is durable
//! ```
//!
//! `A` acks every message of the batch except the nacked ones; the broker may still
//! lose it (the incident), and never receives it from a consumer it killed.

use std::fmt;

/// One "order created" message as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Order {
    /// The order number: the business key, the same on every copy of the message.
    pub number: u32,
    /// Which stock keeping unit the order takes from.
    pub sku: u16,
    /// How many units it takes.
    pub quantity: u32,
}

impl Order {
    /// The message id the consumer deduplicates on, e.g. `order-0000042`.
    pub fn id(&self) -> String {
        order_id(self.number)
    }
}

/// The id of order `number`.
pub fn order_id(number: u32) -> String {
    format!("order-{number:07}")
}

/// The order number in an id made by [`order_id`].
pub fn parse_order_id(id: &str) -> Option<u32> {
    id.strip_prefix("order-")?.parse().ok()
}

/// How a consumer handled one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// First delivery: stock deducted.
    Deducted,
    /// A claim re-acquired after its consumer was killed holding it, and the ledger
    /// shows no deduction for the order: deducted now, for the first time.
    DeductedOnRetry,
    /// A claim re-acquired after its consumer was killed holding it, and the ledger
    /// shows the killed consumer had already deducted: not deducted again.
    Reconciled,
    /// idemstore answered "already completed": a duplicate caught, nothing deducted.
    Skipped,
    /// Another consumer holds a live lease on the order: not handled, not acked.
    Nacked,
    /// The order exhausted its attempts: sent to the dead-letter queue, not deducted.
    DeadLettered,
}

impl Verdict {
    pub const ALL: [Verdict; 6] = [
        Verdict::Deducted,
        Verdict::DeductedOnRetry,
        Verdict::Reconciled,
        Verdict::Skipped,
        Verdict::Nacked,
        Verdict::DeadLettered,
    ];

    /// The word on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Deducted => "deducted",
            Verdict::DeductedOnRetry => "deducted-on-retry",
            Verdict::Reconciled => "reconciled",
            Verdict::Skipped => "skipped",
            Verdict::Nacked => "nacked",
            Verdict::DeadLettered => "dead-lettered",
        }
    }

    pub fn parse(word: &str) -> Option<Verdict> {
        Verdict::ALL.into_iter().find(|v| v.as_str() == word)
    }

    /// The verdict's position in [`Verdict::ALL`], for counting.
    pub fn index(self) -> usize {
        Verdict::ALL
            .iter()
            .position(|&v| v == self)
            .expect("every verdict is in ALL")
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A delivery line: `D <tag> <order> <sku> <quantity>`.
pub fn delivery_line(tag: u32, order: &Order) -> String {
    format!(
        "D {tag} {} {} {}\n",
        order.number, order.sku, order.quantity
    )
}

/// Parses the fields after `D `.
pub fn parse_delivery(fields: &str) -> Option<(u32, Order)> {
    let mut words = fields.split(' ');
    let tag = words.next()?.parse().ok()?;
    let order = Order {
        number: words.next()?.parse().ok()?,
        sku: words.next()?.parse().ok()?,
        quantity: words.next()?.parse().ok()?,
    };
    words.next().is_none().then_some((tag, order))
}

/// A line from a consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Ready {
        records_replayed: u64,
        recovery_us: u64,
    },
    Processed {
        tag: u32,
        verdict: Verdict,
    },
    Ack,
}

impl Reply {
    pub fn parse(line: &str) -> Option<Reply> {
        let mut words = line.trim_end_matches('\n').split(' ');
        let reply = match words.next()? {
            "READY" => Reply::Ready {
                records_replayed: words.next()?.parse().ok()?,
                recovery_us: words.next()?.parse().ok()?,
            },
            "P" => Reply::Processed {
                tag: words.next()?.parse().ok()?,
                verdict: Verdict::parse(words.next()?)?,
            },
            "A" => Reply::Ack,
            _ => return None,
        };
        words.next().is_none().then_some(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_round_trip() {
        let order = Order {
            number: 42,
            sku: 7,
            quantity: 3,
        };
        let line = delivery_line(9, &order);
        assert_eq!(
            parse_delivery(line.strip_prefix("D ").unwrap().trim_end()),
            Some((9, order))
        );
        for verdict in Verdict::ALL {
            assert_eq!(
                Reply::parse(&format!("P 5 {verdict}\n")),
                Some(Reply::Processed { tag: 5, verdict })
            );
        }
        assert_eq!(Reply::parse("A\n"), Some(Reply::Ack));
        assert_eq!(Reply::parse("P 5\n"), None);
        assert_eq!(parse_order_id(&order.id()), Some(42));
    }
}
