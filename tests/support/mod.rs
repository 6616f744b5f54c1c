//! Shared by the reliability tests (`io_error_sweep`, `power_loss`, `crash_kill_loop`):
//! a seeded random generator whose seed is printed and replayable, the model of what
//! must survive, and the check of a reopened store against it.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use idemstore::{Namespace, Policy, Status, Store};

/// Replays a run: `IDEMSTORE_SEED=<n> cargo test --test <name>`.
pub const SEED_ENV: &str = "IDEMSTORE_SEED";

/// The seed of this run: `IDEMSTORE_SEED` if set, else from the clock. Printed, so a
/// failing test's output names it.
pub fn seed(test: &str) -> u64 {
    let seed = std::env::var(SEED_ENV)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("{test}: seed {seed} (replay with {SEED_ENV}={seed})");
    seed
}

/// An environment variable as a number, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// xorshift64: small, seeded, no dependency.
#[derive(Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// Start of the manual clock in every test (2023-11-14).
pub const T0_MS: u64 = 1_700_000_000_000;
/// Bucket width of the test stores: 4 s, so the background reaper wakes only every
/// second and the expiry checks below have several buckets per ttl.
pub const BUCKET_WIDTH: Duration = Duration::from_secs(4);
pub const MARK_TTL_MS: u64 = 12_000;
pub const CLAIM_TTL_MS: u64 = 20_000;
pub const LEASE_MS: u64 = 5_000;

/// The namespaces, created in this order (ids 0, 1, 2).
pub const NAMESPACES: [&str; 3] = ["marks", "claims", "fodder"];

pub fn policy(ns: usize) -> Policy {
    match ns {
        0 => Policy::ttl(Duration::from_millis(MARK_TTL_MS)),
        1 => {
            Policy::ttl(Duration::from_millis(CLAIM_TTL_MS)).lease(Duration::from_millis(LEASE_MS))
        }
        _ => Policy::ttl(Duration::from_millis(MARK_TTL_MS)),
    }
}

/// The namespace handles of an open store.
pub fn namespaces(store: &Store) -> Result<Vec<Namespace>, idemstore::Error> {
    (0..NAMESPACES.len())
        .map(|i| store.namespace(NAMESPACES[i], policy(i)))
        .collect()
}

/// What an acknowledged operation promises about a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// A `check_and_set` answered First or Duplicate: remembered (status Seen).
    Seen,
    /// A claim completed with this result.
    Completed(Vec<u8>),
}

/// One promise: key `(ns, id)` is remembered as `expect` while the clock is before
/// `until_ms`.
#[derive(Debug, Clone)]
pub struct Promise {
    pub ns: usize,
    pub id: String,
    pub expect: Expect,
    pub until_ms: u64,
}

/// The keys that must be remembered, newest promise per key.
#[derive(Default, Clone)]
pub struct Model {
    pub keys: BTreeMap<(usize, String), Promise>,
}

impl Model {
    pub fn add(&mut self, promise: Promise) {
        let key = (promise.ns, promise.id.clone());
        match self.keys.get(&key) {
            Some(old) if old.until_ms > promise.until_ms && old.expect == promise.expect => {}
            _ => {
                self.keys.insert(key, promise);
            }
        }
    }

    /// Records an acknowledged `check_and_set` answer of the marks namespace: a key is
    /// remembered for its ttl from when it was first seen (a duplicate does not extend
    /// it).
    pub fn mark(&mut self, id: &str, outcome: &idemstore::Outcome, now_ms: u64) {
        let first_seen_ms = match outcome {
            idemstore::Outcome::First => now_ms,
            idemstore::Outcome::Duplicate(seen) => {
                assert!(
                    seen.expires_at.0 >= seen.first_seen.0 + MARK_TTL_MS,
                    "{id}: expires_at {:?} is less than ttl after first_seen {:?}",
                    seen.expires_at,
                    seen.first_seen
                );
                seen.first_seen.0
            }
            idemstore::Outcome::LikelyDuplicate => {
                panic!("{id}: an exact namespace answered LikelyDuplicate")
            }
        };
        self.add(Promise {
            ns: 0,
            id: id.to_string(),
            expect: Expect::Seen,
            until_ms: first_seen_ms + MARK_TTL_MS,
        });
    }

    pub fn must_remember(&self, ns: usize, id: &str, now_ms: u64) -> bool {
        self.keys
            .get(&(ns, id.to_string()))
            .is_some_and(|p| p.until_ms > now_ms)
    }

    /// Drops promises that ran out before `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        self.keys.retain(|_, p| p.until_ms > now_ms);
    }

    /// Checks every live promise against a store whose clock reads `now_ms`; returns
    /// the first violation.
    pub fn check(&self, namespaces: &[Namespace], now_ms: u64) -> Result<usize, String> {
        let mut checked = 0;
        for p in self.keys.values() {
            if p.until_ms <= now_ms {
                continue;
            }
            checked += 1;
            let got = namespaces[p.ns]
                .get(&p.id)
                .map_err(|e| format!("get {}/{}: {e}", NAMESPACES[p.ns], p.id))?;
            let ok = match (&p.expect, &got) {
                (Expect::Seen, Some(r)) => r.status == Status::Seen,
                (Expect::Completed(result), Some(r)) => {
                    r.status == Status::Completed && r.result() == Some(&result[..])
                }
                (_, None) => false,
            };
            if !ok {
                return Err(format!(
                    "{}/{} acknowledged as {:?} (remembered until {} ms, now {} ms) but the store has {:?}",
                    NAMESPACES[p.ns],
                    p.id,
                    p.expect,
                    p.until_ms - T0_MS,
                    now_ms - T0_MS,
                    got
                ));
            }
        }
        Ok(checked)
    }
}

/// Records found intact in a crash image: `(namespace id, id, lsn, kind)`, decoded
/// with the layout of docs/FORMAT.md (checksum 0..4, kind 4, status 5, id_len 6..8,
/// namespace 8..12, lsn 16..24, id from 32).
pub fn decode_intact(bytes: &[u8]) -> Option<(u32, String, u64, u8)> {
    if bytes.len() < 32 {
        return None;
    }
    let kind = bytes[4];
    let id_len = u16::from_le_bytes([bytes[6], bytes[7]]) as usize;
    let ns = u32::from_le_bytes(bytes[8..12].try_into().ok()?);
    let lsn = u64::from_le_bytes(bytes[16..24].try_into().ok()?);
    let id = String::from_utf8(bytes.get(32..32 + id_len)?.to_vec()).ok()?;
    Some((ns, id, lsn, kind))
}

/// The bucket deadline in a segment file name (`<16 hex deadline>-<16 hex seq>.seg`).
pub fn deadline_of(path: &std::path::Path) -> Option<u64> {
    let name = path.file_name()?.to_str()?;
    u64::from_str_radix(name.get(..16)?, 16).ok()
}

/// Every record that survived intact in a crash image must be replayed: a damaged
/// record must never hide the valid ones after it (docs/CONTRACT.md §3.3). Checks the
/// keys of `marks` and `claims` whose newest intact record is not a tombstone and whose
/// bucket has not expired at `now_ms`.
pub fn check_intact(
    writes: &[(std::path::PathBuf, Vec<u8>)],
    namespaces: &[Namespace],
    now_ms: u64,
) -> Result<usize, String> {
    const TOMBSTONE: u8 = 0xA3;
    let mut newest: HashMap<(u32, String), (u64, u8)> = HashMap::new();
    for (path, bytes) in writes {
        if deadline_of(path).is_none_or(|d| d <= now_ms) {
            continue;
        }
        if let Some((ns, id, lsn, kind)) = decode_intact(bytes) {
            let entry = newest.entry((ns, id)).or_insert((lsn, kind));
            if lsn > entry.0 {
                *entry = (lsn, kind);
            }
        }
    }
    let mut checked = 0;
    for ((ns, id), (_, kind)) in newest {
        if kind == TOMBSTONE || ns > 1 {
            continue;
        }
        checked += 1;
        let got = namespaces[ns as usize]
            .get(&id)
            .map_err(|e| format!("get {id}: {e}"))?;
        if got.is_none() {
            return Err(format!(
                "{}/{id}: its record is intact in the crash image but recovery did not replay it",
                NAMESPACES[ns as usize]
            ));
        }
    }
    Ok(checked)
}
