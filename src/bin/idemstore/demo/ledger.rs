//! The stock ledger: the side effect, kept outside idemstore the way an inventory
//! database would be, so that it survives the consumer's crash and can be counted
//! honestly afterwards.
//!
//! Each consumer process appends to its own file, `<consumer>.log`, one line per
//! deduction: `<order id> <sku> <quantity> <consumer> <attempt>\n`, written with one
//! `write` call on an unbuffered file, so a deduction is in the page cache (and
//! survives `kill -9`) before the consumer goes on. A line is a deduction only once its
//! `\n` is there: a consumer killed inside the `write` can at worst leave a torn last
//! line in its own file (no other process appends to it), and that line is not a
//! deduction, for the consumer that reconciles and for the report alike.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

use super::protocol::{Order, parse_order_id};

/// The extension of ledger files.
const EXTENSION: &str = "log";

/// One consumer process's ledger file, open for appending.
pub struct LedgerWriter {
    file: File,
    consumer: String,
}

impl LedgerWriter {
    /// Creates `<dir>/<consumer>.log`; refuses an existing file (a consumer name is
    /// used once per run).
    pub fn create(dir: &Path, consumer: &str) -> io::Result<LedgerWriter> {
        let path = dir.join(format!("{consumer}.{EXTENSION}"));
        let file = OpenOptions::new()
            .append(true)
            .create_new(true)
            .open(&path)?;
        Ok(LedgerWriter {
            file,
            consumer: consumer.to_string(),
        })
    }

    /// Deducts `order.quantity` units of the order's SKU: appends one line.
    pub fn deduct(&mut self, order: &Order, attempt: u32) -> io::Result<()> {
        let line = format!(
            "{} sku-{:02} {} {} {attempt}\n",
            order.id(),
            order.sku,
            order.quantity,
            self.consumer
        );
        self.file.write_all(line.as_bytes())
    }

    /// Makes every deduction so far durable (before the consumer acks its batch).
    pub fn sync(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// One deduction read back from a ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deduction {
    pub order: u32,
    pub quantity: u32,
}

/// What the ledgers in a directory hold.
#[derive(Debug, Default)]
pub struct LedgerScan {
    pub deductions: Vec<Deduction>,
    /// Torn last lines (a consumer killed inside its `write`): not deductions.
    pub torn_lines: u64,
}

/// Reads every ledger file in `dir` (bounded by the files' lengths).
pub fn scan(dir: &Path) -> io::Result<LedgerScan> {
    let mut found = LedgerScan::default();
    let mut paths = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == EXTENSION) {
            paths.push(path);
        }
    }
    paths.sort();
    for path in paths {
        let bytes = std::fs::read(&path)?;
        let complete_len = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        if complete_len < bytes.len() {
            found.torn_lines += 1;
        }
        let text = std::str::from_utf8(&bytes[..complete_len])
            .map_err(|_| invalid_data(format!("{} is not UTF-8", path.display())))?;
        for (number, line) in text.lines().enumerate() {
            let deduction = parse_line(line).ok_or_else(|| {
                invalid_data(format!(
                    "{} line {}: {line:?} is not a deduction",
                    path.display(),
                    number + 1
                ))
            })?;
            found.deductions.push(deduction);
        }
    }
    Ok(found)
}

/// Whether any ledger in `dir` holds a deduction for `order` (how a consumer that
/// re-acquires a crashed claim finds out whether the crashed attempt deducted).
pub fn contains(dir: &Path, order: u32) -> io::Result<bool> {
    Ok(scan(dir)?.deductions.iter().any(|d| d.order == order))
}

fn parse_line(line: &str) -> Option<Deduction> {
    let mut words = line.split(' ');
    let order = parse_order_id(words.next()?)?;
    let _sku = words.next()?.strip_prefix("sku-")?;
    let quantity = words.next()?.parse().ok()?;
    let _consumer = words.next()?;
    let _attempt: u32 = words.next()?.parse().ok()?;
    words
        .next()
        .is_none()
        .then_some(Deduction { order, quantity })
}

fn invalid_data(message: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_torn_last_line_is_not_a_deduction() {
        let temp = tempfile::tempdir().unwrap();
        let dir = temp.path();
        let order = Order {
            number: 7,
            sku: 1,
            quantity: 2,
        };
        let mut writer = LedgerWriter::create(dir, "consumer-1").unwrap();
        writer.deduct(&order, 1).unwrap();
        writer.file.write_all(b"order-0000008 sku-0").unwrap();
        let found = scan(dir).unwrap();
        assert_eq!(
            found.deductions,
            vec![Deduction {
                order: 7,
                quantity: 2
            }]
        );
        assert_eq!(found.torn_lines, 1);
        assert!(contains(dir, 7).unwrap());
        assert!(!contains(dir, 8).unwrap());
    }
}
