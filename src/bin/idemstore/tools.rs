//! The offline tools over a data directory: `stats`, `get`, `scan`, `verify`,
//! `export`, `import`.
//!
//! Each takes the directory lock (through `Store::open` or `idemstore::verify`), so it
//! refuses a directory that a running consumer holds instead of reading a moving
//! target, and none creates a store where there is none (only `import` fills an empty
//! or missing directory). Exit codes: 0 done, 1 a negative answer (`get` found
//! nothing, `verify` found damage), 2 an error (the message says what to do).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use idemstore::{Error, Imported, Namespace, Policy, Record, Status, Store};

use crate::progress::Progress;
use crate::record_json::{
    STATUSES, bytes_human, from_json, hex, parse_status, thousands, to_json, unhex, utc,
};

#[derive(Debug, Args)]
pub struct DirArgs {
    /// The store's data directory.
    pub dir: PathBuf,
}

#[derive(Debug, Args)]
pub struct GetArgs {
    /// The store's data directory.
    pub dir: PathBuf,
    /// The namespace (business type), e.g. `inventory`.
    pub namespace: String,
    /// The message id.
    pub id: String,
    /// The id is hex (for ids that are not UTF-8).
    #[arg(long)]
    pub hex: bool,
    /// Print the record as one JSON object (the `scan`/`export` form).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct ScanArgs {
    /// The store's data directory.
    pub dir: PathBuf,
    /// Only this namespace.
    #[arg(long = "ns")]
    pub namespace: Option<String>,
    /// Only this status: seen, in_progress, released, completed or failed.
    #[arg(long, value_parser = parse_status)]
    pub status: Option<Status>,
    /// At most this many records.
    #[arg(long)]
    pub limit: Option<u64>,
}

/// A failure, as the message to print (it says what to do).
type Failure = String;

fn finish(result: Result<ExitCode, Failure>) -> ExitCode {
    match result {
        Ok(code) => code,
        Err(message) => {
            eprintln!("idemstore: {message}");
            ExitCode::from(2)
        }
    }
}

/// Whether `dir` holds a store: a `NAMESPACES` file or a segment.
fn holds_store(dir: &Path) -> Result<bool, Failure> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        format!(
            "cannot read {}: {e}; check the path and your permissions",
            dir.display()
        )
    })?;
    for entry in entries {
        let entry = entry.map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name == "NAMESPACES" || name.ends_with(".seg") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Refuses a path that is not a store, so that no tool creates one by mistake.
fn require_store(dir: &Path) -> Result<(), Failure> {
    if !dir.exists() {
        return Err(format!(
            "{} does not exist; give the data directory of an idemstore store",
            dir.display()
        ));
    }
    if !holds_store(dir)? {
        return Err(format!(
            "{} is not an idemstore store (no NAMESPACES or *.seg files); give the directory the consumer passes to Store::open",
            dir.display()
        ));
    }
    Ok(())
}

/// What to say about a store error, with what to do.
fn explain(dir: &Path, command: &str, error: Error) -> Failure {
    match error {
        Error::Locked { .. } => format!(
            "{} is held by a running process (a consumer has the store open), so it cannot be read consistently; stop that process, or copy the directory and run `idemstore {command}` on the copy",
            dir.display()
        ),
        other => other.to_string(),
    }
}

/// Opens an existing store read-only (the tool changes nothing in the directory:
/// no torn tail cut, no expired file deleted, no checkpoint rewritten), with limits
/// wide enough for any record.
fn open(dir: &Path, command: &str) -> Result<Store, Failure> {
    require_store(dir)?;
    open_with(dir, command, true)
}

fn open_with(dir: &Path, command: &str, read_only: bool) -> Result<Store, Failure> {
    Store::builder(dir)
        .read_only(read_only)
        .max_key_len(u16::MAX as usize)
        .max_result_len(1 << 20)
        .max_ttl(Duration::from_secs(100 * 365 * 86_400))
        .open()
        .map_err(|e| explain(dir, command, e))
}

fn close(store: Store) -> Result<(), Failure> {
    store.close().map_err(|e| e.to_string())
}

fn lookup_policy() -> Policy {
    Policy::ttl(Duration::from_secs(3600))
}

/// An existing namespace's handle (without creating it), `None` if unknown.
fn existing_namespace(store: &Store, name: &str) -> Result<Option<Namespace>, Failure> {
    if !store.namespace_names().iter().any(|n| n == name) {
        return Ok(None);
    }
    store
        .namespace(name, lookup_policy())
        .map(Some)
        .map_err(|e| e.to_string())
}

pub fn stats(args: DirArgs) -> ExitCode {
    finish(stats_inner(&args.dir))
}

fn stats_inner(dir: &Path) -> Result<ExitCode, Failure> {
    let store = open(dir, "stats")?;
    let mut by_namespace: BTreeMap<String, [u64; 5]> = BTreeMap::new();
    for name in store.namespace_names() {
        by_namespace.insert(name, [0; 5]);
    }
    let (mut oldest, mut newest) = (None, None);
    store
        .scan(None, |namespace, _, record| {
            let column = STATUSES
                .iter()
                .position(|s| *s == record.status)
                .unwrap_or(0);
            by_namespace.entry(namespace.to_string()).or_default()[column] += 1;
            oldest = Some(oldest.map_or(record.expires_at, |o: idemstore::UnixMs| {
                o.min(record.expires_at)
            }));
            newest = Some(newest.map_or(record.expires_at, |n: idemstore::UnixMs| {
                n.max(record.expires_at)
            }));
            true
        })
        .map_err(|e| e.to_string())?;
    let stats = store.stats();
    let mut out = std::io::stdout().lock();
    let line =
        |out: &mut dyn Write, label: &str, value: String| writeln!(out, "{label:<24}{value}");
    let mut write = || -> std::io::Result<()> {
        let out: &mut dyn Write = &mut out;
        line(out, "store", dir.display().to_string())?;
        line(
            out,
            "keys",
            format!(
                "{} live, {} removed (tombstones until their bucket expires)",
                thousands(stats.live_keys),
                thousands(stats.tombstones)
            ),
        )?;
        let width = by_namespace
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0)
            .max(9);
        writeln!(
            out,
            "  {:<width$}  {:>10} {:>11} {:>10} {:>10} {:>10} {:>10}",
            "namespace", "seen", "in_progress", "released", "completed", "failed", "total"
        )?;
        for (name, counts) in &by_namespace {
            writeln!(
                out,
                "  {name:<width$}  {:>10} {:>11} {:>10} {:>10} {:>10} {:>10}",
                thousands(counts[0]),
                thousands(counts[1]),
                thousands(counts[2]),
                thousands(counts[3]),
                thousands(counts[4]),
                thousands(counts.iter().sum()),
            )?;
        }
        line(
            out,
            "buckets",
            format!("{} ({} segment files)", stats.buckets, stats.segments),
        )?;
        line(
            out,
            "disk",
            format!(
                "{} reserved, {} of records",
                bytes_human(stats.disk_bytes),
                bytes_human(stats.log_bytes)
            ),
        )?;
        let when = |t: Option<idemstore::UnixMs>| t.map_or("-".to_string(), utc);
        line(out, "oldest expiry", when(oldest))?;
        line(out, "newest expiry", when(newest))?;
        line(
            out,
            "corrupt records skipped",
            format!(
                "{}{}",
                stats.corrupt_records_skipped,
                if stats.corrupt_records_skipped > 0 {
                    " (run `idemstore verify` for files and offsets)"
                } else {
                    ""
                }
            ),
        )?;
        line(out, "torn tails cut", stats.torn_tails_cut.to_string())?;
        line(out, "foreign files", stats.foreign_files.to_string())?;
        line(
            out,
            "claims released at open",
            stats.claims_released_at_open.to_string(),
        )?;
        let open = if stats.opened_from_checkpoint {
            format!(
                "loaded the index checkpoint of a clean close in {:.1} ms",
                stats.recovery_time.as_secs_f64() * 1e3
            )
        } else {
            format!(
                "replayed {} records in {:.1} ms",
                thousands(stats.records_replayed),
                stats.recovery_time.as_secs_f64() * 1e3
            )
        };
        line(out, "open", open)?;
        Ok(())
    };
    write().map_err(|e| format!("writing to stdout: {e}"))?;
    close(store)?;
    Ok(ExitCode::SUCCESS)
}

pub fn get(args: GetArgs) -> ExitCode {
    finish(get_inner(&args))
}

fn get_inner(args: &GetArgs) -> Result<ExitCode, Failure> {
    let id = if args.hex {
        unhex(&args.id)
            .map_err(|e| format!("ID is not hex ({e}); drop --hex to pass it as text"))?
    } else {
        args.id.as_bytes().to_vec()
    };
    let store = open(&args.dir, "get")?;
    let record = match existing_namespace(&store, &args.namespace)? {
        Some(namespace) => namespace.get(&id).map_err(|e| e.to_string())?,
        None => None,
    };
    let Some(record) = record else {
        let known = store.namespace_names();
        close(store)?;
        eprintln!(
            "idemstore: {}/{} is not remembered (never seen, removed, or expired){}",
            args.namespace,
            args.id,
            if known.contains(&args.namespace) {
                String::new()
            } else {
                format!(
                    "; there is no namespace {:?} (namespaces: {})",
                    args.namespace,
                    known.join(", ")
                )
            }
        );
        return Ok(ExitCode::from(1));
    };
    close(store)?;
    if args.json {
        println!("{}", to_json(&args.namespace, &id, &record));
    } else {
        print!("{}", describe(&args.namespace, &id, &record));
    }
    Ok(ExitCode::SUCCESS)
}

/// The human form of one record.
fn describe(namespace: &str, id: &[u8], record: &Record) -> String {
    let printable = |bytes: &[u8]| match std::str::from_utf8(bytes) {
        Ok(text) => format!("{text:?}"),
        Err(_) => format!("0x{}", hex(bytes)),
    };
    let when = |t: Option<idemstore::UnixMs>| {
        t.map_or("-".to_string(), |t| format!("{} ({})", utc(t), t.0))
    };
    let mut out = String::new();
    let mut line = |label: &str, value: String| out.push_str(&format!("{label:<14}{value}\n"));
    line("namespace", namespace.to_string());
    line("id", printable(id));
    line("status", record.status.as_str().to_string());
    line("first seen", when(Some(record.first_seen)));
    line("attempts", record.attempts.to_string());
    line("lease until", when(record.lease_until));
    line("completed at", when(record.completed_at));
    line("expires at", when(Some(record.expires_at)));
    line(
        "result",
        record.result.as_deref().map_or("-".to_string(), |r| {
            format!("{} ({} bytes)", printable(r), r.len())
        }),
    );
    out
}

pub fn scan(args: ScanArgs) -> ExitCode {
    finish(scan_records(
        &args.dir,
        "scan",
        args.namespace.as_deref(),
        args.status,
        args.limit,
    ))
}

pub fn export(args: DirArgs) -> ExitCode {
    finish(scan_records(&args.dir, "export", None, None, None))
}

/// Writes the matching records as JSON lines; the count goes to stderr.
fn scan_records(
    dir: &Path,
    command: &str,
    namespace: Option<&str>,
    status: Option<Status>,
    limit: Option<u64>,
) -> Result<ExitCode, Failure> {
    let store = open(dir, command)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut written = 0u64;
    let mut write_error = None;
    if limit != Some(0) {
        store
            .scan(namespace, |ns, id, record| {
                if status.is_some_and(|s| s != record.status) {
                    return true;
                }
                if let Err(e) = writeln!(out, "{}", to_json(ns, id, record)) {
                    write_error = Some(e);
                    return false;
                }
                written += 1;
                limit.is_none_or(|limit| written < limit)
            })
            .map_err(|e| e.to_string())?;
    }
    let flushed = out.flush();
    close(store)?;
    if let Some(e) = write_error.or(flushed.err()) {
        // A closed pipe (`| head`) is the reader's choice, not a failure.
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            return Ok(ExitCode::SUCCESS);
        }
        return Err(format!("writing to stdout: {e}"));
    }
    eprintln!("idemstore {command}: {} records", thousands(written));
    Ok(ExitCode::SUCCESS)
}

pub fn import(args: DirArgs) -> ExitCode {
    finish(import_inner(&args.dir))
}

fn import_inner(dir: &Path) -> Result<ExitCode, Failure> {
    // The one tool that may create a store: in a missing or empty directory.
    if dir.exists() && !holds_store(dir)? && std::fs::read_dir(dir).map_or(0, |d| d.count()) > 0 {
        return Err(format!(
            "{} holds files but no idemstore store; import into an empty or new directory, or into an existing store",
            dir.display()
        ));
    }
    let store = open_with(dir, "import", false)?;
    let mut namespaces: HashMap<String, Namespace> = HashMap::new();
    let (mut written, mut live, mut expired) = (0u64, 0u64, 0u64);
    let stdin = std::io::stdin().lock();
    for (number, line) in stdin.lines().enumerate() {
        let number = number + 1;
        let line = line.map_err(|e| format!("reading stdin: {e}"))?;
        if line.trim().is_empty() {
            continue;
        }
        let stop = |reason: String| {
            format!(
                "line {number}: {reason}; fix or remove that line and run import again ({written} records before it were imported; importing them again changes nothing)"
            )
        };
        let (name, id, record) = from_json(&line).map_err(stop)?;
        let namespace = match namespaces.get(&name) {
            Some(namespace) => namespace,
            None => {
                let namespace = store
                    .namespace(&name, lookup_policy())
                    .map_err(|e| stop(e.to_string()))?;
                namespaces.entry(name).or_insert(namespace)
            }
        };
        match namespace
            .import(&id, &record)
            .map_err(|e| stop(e.to_string()))?
        {
            Imported::Written => written += 1,
            Imported::AlreadyLive => live += 1,
            Imported::Expired => expired += 1,
            _ => {}
        }
    }
    close(store)?;
    eprintln!(
        "idemstore import: {} records written, {} already remembered (left as they were), {} already expired (skipped)",
        thousands(written),
        thousands(live),
        thousands(expired)
    );
    Ok(ExitCode::SUCCESS)
}

pub fn verify(args: DirArgs) -> ExitCode {
    finish(verify_inner(&args.dir))
}

fn verify_inner(dir: &Path) -> Result<ExitCode, Failure> {
    require_store(dir)?;
    let mut progress: Option<Progress> = None;
    let report = idemstore::verify_with_progress(dir, |done, total| {
        progress
            .get_or_insert_with(|| Progress::new("verifying", total))
            .set(
                done,
                &format!("{} of {}", bytes_human(done), bytes_human(total)),
            );
    })
    .map_err(|e| explain(dir, "verify", e))?;
    if let Some(progress) = progress.as_mut() {
        progress.finish(&format!("{} read", bytes_human(report.bytes)));
    }
    println!(
        "{}: {} namespaces, {} segments ({}), {} records",
        dir.display(),
        report.namespaces,
        report.segments,
        bytes_human(report.bytes),
        thousands(report.records)
    );
    if report.cold_files > 0 {
        println!(
            "  cold  {} cold index files checked page by page (memory_budget)",
            report.cold_files
        );
    }
    for name in &report.foreign_files {
        println!("  note  {name}: not an idemstore file (left alone)");
    }
    if report.expired_segments > 0 {
        println!(
            "  note  {} segments have expired; the next open deletes them",
            report.expired_segments
        );
    }
    if report.empty_segments > 0 {
        println!(
            "  note  {} empty segments (a crash right after creating them); the next open deletes them",
            report.empty_segments
        );
    }
    for torn in &report.torn_tails {
        println!(
            "  note  {} at offset {}: {}",
            torn.file().display(),
            torn.offset(),
            torn.reason()
        );
    }
    for problem in &report.problems {
        println!(
            "  DAMAGE  {} at offset {}: {}",
            problem.file().display(),
            problem.offset(),
            problem.reason()
        );
    }
    if report.is_clean() {
        println!("OK: no damage found");
        Ok(ExitCode::SUCCESS)
    } else {
        let unlisted = report.problem_count - report.problems.len() as u64;
        if unlisted > 0 {
            println!("  … and {unlisted} more");
        }
        println!(
            "DAMAGED: {} problems. By default the store still opens: damaged records are skipped (each costs at most one duplicate processing of its key). Keep a copy of the directory, check the disk (dmesg, smartctl), and restore from an `idemstore export` backup if keys must not be lost.",
            report.problem_count
        );
        Ok(ExitCode::from(1))
    }
}
