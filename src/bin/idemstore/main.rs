//! `idemstore`, the command-line tool.
//!
//! `idemstore demo` is the main job: it replays the duplicate-delivery incident that
//! idemstore exists to prevent, once without it and once with it, and reports how many
//! orders had their stock deducted twice. Offline tools over a data directory (stats,
//! get, scan, verify, export, import) sit next to it (`tools.rs`).

mod demo;
mod progress;
mod record_json;
mod tools;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// An embedded, crash-safe dedup store for at-least-once message consumers.
#[derive(Debug, Parser)]
#[command(name = "idemstore", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay the incident idemstore prevents: an inventory consumer on an
    /// at-least-once queue (lost acks, kill -9 mid-batch, a rebalance), run twice over
    /// the same traffic, without and with idemstore. Exits 1 if any order's stock was
    /// deducted twice (or never) with idemstore on.
    Demo(demo::DemoArgs),
    /// One consumer process of the demo (the demo starts and kills these itself).
    #[command(name = "demo-consumer", hide = true)]
    DemoConsumer(demo::consumer::ConsumerArgs),
    /// One consumer machine of `demo --machines` (the demo starts and kills these).
    #[cfg(feature = "nats")]
    #[command(name = "demo-machine", hide = true)]
    DemoMachine(demo::machine::MachineArgs),
    /// Keys by namespace and status, buckets, disk use, oldest and newest expiry,
    /// corrupt records skipped.
    Stats(tools::DirArgs),
    /// The consumption record of one key: status, first seen, attempts, lease,
    /// completed at, expires at, result. Exits 1 if the key is not remembered.
    Get(tools::GetArgs),
    /// List consumption records as JSON lines, optionally of one namespace or status.
    Scan(tools::ScanArgs),
    /// Check every segment header, record and checksum and the NAMESPACES file without
    /// changing anything; report each problem with file and offset. Exits 1 on damage.
    Verify(tools::DirArgs),
    /// Write every consumption record to stdout as JSON lines (a backup, or a move).
    Export(tools::DirArgs),
    /// Read JSON lines (as `export` writes them) from stdin into the store in DIR
    /// (created if missing or empty). Keys already remembered are left as they are.
    Import(tools::DirArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Demo(args) => demo::run(args),
        Command::DemoConsumer(args) => demo::consumer::run(args),
        #[cfg(feature = "nats")]
        Command::DemoMachine(args) => demo::machine::run(args),
        Command::Stats(args) => tools::stats(args),
        Command::Get(args) => tools::get(args),
        Command::Scan(args) => tools::scan(args),
        Command::Verify(args) => tools::verify(args),
        Command::Export(args) => tools::export(args),
        Command::Import(args) => tools::import(args),
    }
}
