//! `idemstore`, the command-line tool.
//!
//! `idemstore demo` is the main job: it replays the duplicate-delivery incident that
//! idemstore exists to prevent, once without it and once with it, and reports how many
//! orders had their stock deducted twice. Offline tools over a data directory (stats,
//! get, scan, verify, export, import) will sit next to it as further subcommands.

mod demo;
mod progress;

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
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Demo(args) => demo::run(args),
        Command::DemoConsumer(args) => demo::consumer::run(args),
    }
}
