//! One consumer machine of `idemstore demo --machines N`: a child process with its own
//! store directory, started by the coordinator (`demo/machines.rs`) with the hidden
//! `demo-machine` subcommand, and killed with SIGKILL, or lost with its directory, by
//! it. It speaks a line protocol on stdin/stdout, one answer per request:
//!
//! - `A <p>`: partition `p` is assigned: `restore_partition` → `OK <records> <from> <us>`
//! - `R <p>`: `p` is revoked: `release_partition` (flush, then give up) → `OK`
//! - `F <p>`: `flush_partition` before the coordinator commits `p`'s offsets → `OK`
//! - `M <p> <offset> <order>`: a delivery: `check_and_set_at`; on `First` the
//!   deduction is appended to this machine's ledger (outside the store directory, so
//!   it survives the machine's loss) before the answer `FIRST`; else `DUP`
//! - any error: `ERR <kind> <message>` (`fenced`, `not-owned`, `backlog`,
//!   `replication`, `other`)

use std::io::{self, BufRead, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use idemstore::replication::{Changelog, NatsChangelog, NatsConfig};
use idemstore::{Error, Policy, Replication, ReplicationMode, Store};

/// The arguments the coordinator starts a machine with.
#[derive(Debug, clap::Args)]
pub struct MachineArgs {
    /// The store directory ("the machine's disk").
    #[arg(long)]
    pub dir: PathBuf,
    /// This machine's ledger file: one order number per deduction.
    #[arg(long)]
    pub ledger: PathBuf,
    /// `none` (no replication), `async` or `sync`.
    #[arg(long)]
    pub mode: String,
    /// NATS server URLs, comma separated.
    #[arg(long, default_value = "")]
    pub servers: String,
    /// The JetStream stream.
    #[arg(long, default_value = "IDEMSTORE_DEMO")]
    pub stream: String,
    /// The stream's subject prefix (the partitions' subjects are below it).
    #[arg(long, default_value = "idemstore.demo")]
    pub prefix: String,
}

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub fn run(args: MachineArgs) -> ExitCode {
    match serve(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idemstore demo machine {}: {e}", args.dir.display());
            ExitCode::from(2)
        }
    }
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::Fenced { .. } => "fenced",
        Error::NotOwned { .. } => "not-owned",
        Error::ReplicationBacklog { .. } => "backlog",
        Error::Replication { .. } => "replication",
        _ => "other",
    }
}

fn serve(args: &MachineArgs) -> Result<()> {
    let mut builder = Store::builder(&args.dir);
    let mode = match args.mode.as_str() {
        "none" => None,
        "async" => Some(ReplicationMode::Async),
        "sync" => Some(ReplicationMode::Sync),
        other => return Err(format!("--mode {other:?}: none, async or sync").into()),
    };
    if let Some(mode) = mode {
        let mut config = NatsConfig::new(args.servers.split(','));
        config.stream = args.stream.clone();
        config.subject_prefix = args.prefix.clone();
        // A call to a node that was just killed waits this long before the client
        // tries another: short, so a leader's loss costs the consumers little.
        config.timeout = Duration::from_secs(2);
        let changelog: Arc<dyn Changelog> = Arc::new(NatsChangelog::open(&config)?);
        builder = builder.replication(
            Replication::new(changelog, args.prefix.clone())
                .mode(mode)
                .timeout(Duration::from_secs(10)),
        );
    }
    let store = builder.open()?;
    let orders = store.namespace("orders", Policy::ttl(Duration::from_secs(3600)))?;
    let mut ledger = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&args.ledger)?;
    let mut out = io::stdout().lock();
    writeln!(out, "READY")?;
    for line in io::stdin().lock().lines() {
        let line = line?;
        let fields: Vec<&str> = line.split(' ').collect();
        let partition =
            |i: usize| -> Result<u32> { Ok(fields.get(i).ok_or("missing field")?.parse::<u32>()?) };
        let answer: std::result::Result<String, Error> = match fields[0] {
            "A" => orders
                .partition(partition(1)?)?
                .restore_partition()
                .map(|r| format!("OK {} {} {}", r.records, r.from, r.duration.as_micros())),
            "R" => orders
                .partition(partition(1)?)?
                .release_partition()
                .map(|_| "OK".to_string()),
            "F" => orders
                .partition(partition(1)?)?
                .flush_partition()
                .map(|_| "OK".to_string()),
            "M" => {
                let offset: u64 = fields.get(2).ok_or("missing offset")?.parse()?;
                let order = *fields.get(3).ok_or("missing order")?;
                match orders
                    .partition(partition(1)?)?
                    .check_and_set_at(order, offset)
                {
                    Ok(outcome) if outcome.is_first() => {
                        // The deduction: one line in the ledger, the world outside.
                        // One write of one whole line.
                        ledger.write_all(format!("{order}\n").as_bytes())?;
                        Ok("FIRST".to_string())
                    }
                    Ok(_) => Ok("DUP".to_string()),
                    Err(e) => Err(e),
                }
            }
            other => return Err(format!("bad request {other:?}").into()),
        };
        match answer {
            Ok(text) => writeln!(out, "{text}")?,
            Err(e) => writeln!(out, "ERR {} {}", kind(&e), e.to_string().replace('\n', " "))?,
        }
    }
    drop(orders);
    store.close()?;
    Ok(())
}
