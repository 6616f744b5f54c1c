//! Fuzz harness (c): arbitrary operation sequences against a reference model, shared
//! by `fuzz/fuzz_targets/model_ops.rs` and `tests/fuzz_regressions.rs`.
//!
//! The same contract as `tests/model_proptest.rs` (every public operation, clock moves
//! both ways, `expire_now`, close + reopen with held claims abandoned), but the
//! sequence is decoded from fuzz bytes, so libFuzzer's coverage feedback steers it.
//! Byte 0 picks the durability mode; then each operation is one opcode byte followed
//! by its argument bytes (missing bytes read as zero). Every answer is compared with
//! the model, including exact `first_seen` and `expires_at`.

use std::collections::HashMap;
use std::time::Duration;

use idemstore::{
    Begin, Claim, Clock, Durability, Error, ManualClock, Namespace, Outcome, Policy, Record, Seen,
    Status, Store, UnixMs,
};

const WIDTH_MS: u64 = 10_000;
const START_MS: u64 = 1_700_000_003_000;
const MAX_RESULT_LEN: usize = 16;
const KEYS: usize = 4;
const OPS_MAX: usize = 256;
/// (name, ttl ms, lease ms, max attempts).
const NAMESPACES: [(&str, u64, u64, u32); 2] =
    [("orders", 30_000, 5_000, 2), ("mails", 12_000, 3_000, 3)];
const TTL_OVERRIDES_MS: [u64; 3] = [1_000, 7_000, 25_000];
const EXTEND_MS: [u64; 3] = [1_000, 4_000, 20_000];
const ADVANCE_MS: [u64; 4] = [WIDTH_MS, 5_000, 31_000, 3 * WIDTH_MS + 1];

#[derive(Debug, Clone)]
struct Entry {
    status: Status,
    first_seen: u64,
    deadline: u64,
    attempts: u32,
    lease_until: u64,
    completed_at: u64,
    result: Option<Vec<u8>>,
    payload: Option<u8>,
    token: u64,
}

impl Entry {
    fn record(&self) -> Record {
        Record {
            status: self.status,
            first_seen: UnixMs(self.first_seen),
            expires_at: UnixMs(self.deadline),
            attempts: self.attempts,
            lease_until: (self.status == Status::InProgress).then_some(UnixMs(self.lease_until)),
            completed_at: (self.status == Status::Completed).then_some(UnixMs(self.completed_at)),
            result: if self.status == Status::Completed {
                self.result.clone()
            } else {
                None
            },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ErrKind {
    PayloadMismatch,
    ClaimLost,
    ResultTooLarge,
    Other,
}

fn kind(e: &Error) -> ErrKind {
    match e {
        Error::PayloadMismatch => ErrKind::PayloadMismatch,
        Error::ClaimLost => ErrKind::ClaimLost,
        Error::ResultTooLarge { .. } => ErrKind::ResultTooLarge,
        _ => ErrKind::Other,
    }
}

#[derive(Debug, PartialEq, Eq)]
enum BeginAnswer {
    Acquired { attempt: u32, lease_until: UnixMs },
    InProgress(Record),
    Completed(Record),
    Exhausted(Record),
}

enum How {
    Complete(Option<Vec<u8>>),
    Release,
    Fail,
    Extend(u64),
}

fn deadline(until_ms: u64) -> u64 {
    until_ms.div_ceil(WIDTH_MS) * WIDTH_MS
}

#[derive(Default)]
struct Model {
    now: u64,
    entries: HashMap<(usize, usize), Entry>,
    next_token: u64,
}

struct HeldModel {
    ns: usize,
    key: usize,
    token: u64,
    ttl_ms: u64,
}

impl Model {
    fn live(&self, ns: usize, key: usize) -> Option<&Entry> {
        self.entries
            .get(&(ns, key))
            .filter(|e| e.deadline > self.now)
    }

    fn check_and_set(&mut self, ns: usize, key: usize, ttl_ms: u64) -> Outcome {
        if let Some(e) = self.live(ns, key) {
            return Outcome::Duplicate(Seen {
                first_seen: UnixMs(e.first_seen),
                expires_at: UnixMs(e.deadline),
            });
        }
        let entry = Entry {
            status: Status::Seen,
            first_seen: self.now,
            deadline: deadline(self.now + ttl_ms),
            attempts: 0,
            lease_until: 0,
            completed_at: 0,
            result: None,
            payload: None,
            token: 0,
        };
        self.entries.insert((ns, key), entry);
        Outcome::First
    }

    fn begin(
        &mut self,
        ns: usize,
        key: usize,
        payload: Option<u8>,
        ttl_ms: u64,
    ) -> Result<(BeginAnswer, u64), ErrKind> {
        let (_, _, lease_ms, max_attempts) = NAMESPACES[ns];
        let now = self.now;
        let lease_until = now + lease_ms;
        self.next_token += 1;
        let token = self.next_token;
        let entry = match self.live(ns, key).cloned() {
            Some(e) => {
                if let (Some(asked), Some(stored)) = (payload, e.payload)
                    && asked != stored
                {
                    return Err(ErrKind::PayloadMismatch);
                }
                match e.status {
                    Status::Seen | Status::Completed => {
                        return Ok((BeginAnswer::Completed(e.record()), 0));
                    }
                    Status::Failed => return Ok((BeginAnswer::Exhausted(e.record()), 0)),
                    Status::InProgress if e.lease_until > now => {
                        return Ok((BeginAnswer::InProgress(e.record()), 0));
                    }
                    _ if e.attempts >= max_attempts => {
                        return Ok((BeginAnswer::Exhausted(e.record()), 0));
                    }
                    _ => {}
                }
                Entry {
                    status: Status::InProgress,
                    deadline: e.deadline.max(deadline(lease_until)),
                    attempts: e.attempts + 1,
                    lease_until,
                    completed_at: 0,
                    result: None,
                    payload: e.payload.or(payload),
                    token,
                    ..e
                }
            }
            None => Entry {
                status: Status::InProgress,
                first_seen: now,
                deadline: deadline(now + ttl_ms).max(deadline(lease_until)),
                attempts: 1,
                lease_until,
                completed_at: 0,
                result: None,
                payload,
                token,
            },
        };
        let answer = BeginAnswer::Acquired {
            attempt: entry.attempts,
            lease_until: UnixMs(lease_until),
        };
        self.entries.insert((ns, key), entry);
        Ok((answer, token))
    }

    fn resolve(&mut self, held: &HeldModel, how: How) -> Result<u64, ErrKind> {
        if let How::Complete(Some(result)) = &how
            && result.len() > MAX_RESULT_LEN
        {
            return Err(ErrKind::ResultTooLarge);
        }
        let now = self.now;
        let Some(e) = self.entries.get_mut(&(held.ns, held.key)).filter(|e| {
            e.deadline > now && e.status == Status::InProgress && e.token == held.token
        }) else {
            return Err(ErrKind::ClaimLost);
        };
        match how {
            How::Complete(result) => {
                e.status = Status::Completed;
                e.completed_at = now;
                e.deadline = e.deadline.max(deadline(now + held.ttl_ms));
                e.result = result;
                e.lease_until = 0;
            }
            How::Release => {
                e.status = Status::Released;
                e.lease_until = 0;
            }
            How::Fail => {
                e.status = Status::Failed;
                e.lease_until = 0;
            }
            How::Extend(lease_ms) => {
                e.lease_until = now + lease_ms;
                e.deadline = e.deadline.max(deadline(e.lease_until));
            }
        }
        Ok(e.lease_until)
    }

    fn remove(&mut self, ns: usize, key: usize) -> bool {
        let live = self.live(ns, key).is_some();
        self.entries.remove(&(ns, key));
        live
    }

    fn counts(&self) -> [u64; 5] {
        let mut counts = [0; 5];
        for e in self.entries.values().filter(|e| e.deadline > self.now) {
            let i = match e.status {
                Status::Seen => 0,
                Status::InProgress => 1,
                Status::Released => 2,
                Status::Completed => 3,
                _ => 4,
            };
            counts[i] += 1;
        }
        counts
    }
}

struct Held {
    claim: Claim,
    model: HeldModel,
}

fn id(key: usize) -> String {
    format!("msg-{key}")
}

fn open(
    dir: &std::path::Path,
    clock: &ManualClock,
    durability: Durability,
) -> (Store, Vec<Namespace>) {
    let store = Store::builder(dir)
        .durability(durability)
        .bucket_width(Duration::from_millis(WIDTH_MS))
        .max_result_len(MAX_RESULT_LEN)
        .segment_size(64 * 1024)
        .shards(4)
        .clock(clock.clone())
        .open()
        .expect("open");
    let namespaces = NAMESPACES
        .iter()
        .map(|&(name, ttl, lease, attempts)| {
            store
                .namespace(
                    name,
                    Policy::ttl(Duration::from_millis(ttl))
                        .lease(Duration::from_millis(lease))
                        .max_attempts(attempts),
                )
                .expect("namespace")
        })
        .collect();
    (store, namespaces)
}

fn handle(namespaces: &[Namespace], ns: usize, ttl: Option<usize>) -> (Namespace, u64) {
    match ttl {
        Some(i) => (
            namespaces[ns]
                .with_ttl(Duration::from_millis(TTL_OVERRIDES_MS[i]))
                .expect("with_ttl"),
            TTL_OVERRIDES_MS[i],
        ),
        None => (namespaces[ns].clone(), NAMESPACES[ns].1),
    }
}

fn counts(store: &Store) -> [u64; 5] {
    let s = store.stats();
    [s.seen, s.in_progress, s.released, s.completed, s.failed]
}

/// Reads argument bytes; missing bytes are zero.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }
    fn pick(&mut self, n: usize) -> usize {
        usize::from(self.byte()) % n
    }
    /// `None` for even bytes, else `Some(0..n)`.
    fn maybe(&mut self, n: usize) -> Option<usize> {
        let b = self.byte();
        (b & 1 == 1).then_some(usize::from(b >> 1) % n)
    }
}

pub fn run(data: &[u8]) {
    let mut input = Bytes(data);
    let durability = if input.byte() & 1 == 1 {
        Durability::Interval(Duration::from_millis(50))
    } else {
        Durability::None
    };
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let (mut store, mut namespaces) = open(dir.path(), &clock, durability);
    let mut model = Model {
        now: START_MS,
        ..Model::default()
    };
    let mut held: Vec<Held> = Vec::new();

    let mut step = 0;
    while !input.0.is_empty() && step < OPS_MAX {
        step += 1;
        model.now = model.now.max(clock.now().0);
        match input.byte() % 14 {
            0 => {
                let (ns, key, ttl) = (input.pick(2), input.pick(KEYS), input.maybe(3));
                let (handle, ttl_ms) = handle(&namespaces, ns, ttl);
                let got = handle.check_and_set(id(key)).map_err(|e| kind(&e));
                assert_eq!(
                    got,
                    Ok(model.check_and_set(ns, key, ttl_ms)),
                    "step {step}: check_and_set"
                );
            }
            1 => {
                let ns = input.pick(2);
                let n = 1 + input.pick(4);
                let keys: Vec<usize> = (0..n).map(|_| input.pick(KEYS)).collect();
                let ids: Vec<String> = keys.iter().map(|&k| id(k)).collect();
                let got = namespaces[ns]
                    .check_and_set_many(&ids)
                    .map_err(|e| kind(&e));
                let want: Vec<Outcome> = keys
                    .iter()
                    .map(|&k| model.check_and_set(ns, k, NAMESPACES[ns].1))
                    .collect();
                assert_eq!(got, Ok(want), "step {step}: check_and_set_many");
            }
            2 => {
                let (ns, key) = (input.pick(2), input.pick(KEYS));
                let payload = input.maybe(3).map(|p| p as u8);
                let ttl = input.maybe(3);
                let (handle, ttl_ms) = handle(&namespaces, ns, ttl);
                let got = match payload {
                    Some(p) => handle.begin_with_payload(id(key), &[p, 7, 7]),
                    None => handle.begin(id(key)),
                };
                let want = model.begin(ns, key, payload, ttl_ms);
                match (got, want) {
                    (
                        Ok(Begin::Acquired(claim)),
                        Ok((want @ BeginAnswer::Acquired { .. }, token)),
                    ) => {
                        let got = BeginAnswer::Acquired {
                            attempt: claim.attempt(),
                            lease_until: claim.lease_until(),
                        };
                        assert_eq!(got, want, "step {step}: begin");
                        held.push(Held {
                            claim,
                            model: HeldModel {
                                ns,
                                key,
                                token,
                                ttl_ms,
                            },
                        });
                    }
                    (got, want) => {
                        let got = got.map(|b| match b {
                            Begin::Acquired(c) => BeginAnswer::Acquired {
                                attempt: c.attempt(),
                                lease_until: c.lease_until(),
                            },
                            Begin::InProgress(r) => BeginAnswer::InProgress(r),
                            Begin::Completed(r) => BeginAnswer::Completed(r),
                            Begin::Exhausted(r) => BeginAnswer::Exhausted(r),
                        });
                        assert_eq!(
                            got.map_err(|e| kind(&e)),
                            want.map(|(a, _)| a),
                            "step {step}: begin"
                        );
                    }
                }
            }
            3 => {
                let (pick, len) = (input.byte(), input.pick(MAX_RESULT_LEN + 2));
                let with_result = input.byte() & 1 == 1;
                if held.is_empty() {
                    continue;
                }
                let Held { claim, model: h } = held.remove(usize::from(pick) % held.len());
                let result: Option<Vec<u8>> =
                    with_result.then(|| (0..len).map(|i| (step + i) as u8).collect());
                let got = claim.complete(result.as_deref()).map_err(|e| kind(&e));
                let want = model.resolve(&h, How::Complete(result)).map(|_| ());
                if want == Err(ErrKind::ResultTooLarge) {
                    let _ = model.resolve(&h, How::Release);
                }
                assert_eq!(got, want, "step {step}: complete");
            }
            op @ 4..=6 => {
                let pick = input.byte();
                if held.is_empty() {
                    continue;
                }
                let Held { claim, model: h } = held.remove(usize::from(pick) % held.len());
                match op {
                    4 => {
                        let got = claim.release().map_err(|e| kind(&e));
                        assert_eq!(
                            got,
                            model.resolve(&h, How::Release).map(|_| ()),
                            "step {step}: release"
                        );
                    }
                    5 => {
                        let got = claim.fail().map_err(|e| kind(&e));
                        assert_eq!(
                            got,
                            model.resolve(&h, How::Fail).map(|_| ()),
                            "step {step}: fail"
                        );
                    }
                    _ => {
                        drop(claim);
                        let _ = model.resolve(&h, How::Release);
                    }
                }
            }
            7 => {
                let (pick, lease) = (input.byte(), input.pick(EXTEND_MS.len()));
                if held.is_empty() {
                    continue;
                }
                let i = usize::from(pick) % held.len();
                let lease_ms = EXTEND_MS[lease];
                let got = held[i]
                    .claim
                    .extend(Duration::from_millis(lease_ms))
                    .map_err(|e| kind(&e));
                let want = model.resolve(&held[i].model, How::Extend(lease_ms));
                assert_eq!(got, want.map(|_| ()), "step {step}: extend");
                if let Ok(until) = want {
                    assert_eq!(
                        held[i].claim.lease_until(),
                        UnixMs(until),
                        "step {step}: lease"
                    );
                }
            }
            8 => {
                let (ns, key) = (input.pick(2), input.pick(KEYS));
                let got = namespaces[ns].get(id(key)).map_err(|e| kind(&e));
                assert_eq!(
                    got,
                    Ok(model.live(ns, key).map(Entry::record)),
                    "step {step}: get"
                );
            }
            9 => {
                let (ns, key) = (input.pick(2), input.pick(KEYS));
                let got = namespaces[ns].remove(id(key)).map_err(|e| kind(&e));
                assert_eq!(got, Ok(model.remove(ns, key)), "step {step}: remove");
            }
            10 => {
                let b = input.byte();
                let ms = if b < 200 {
                    u64::from(b) * 13 + 1
                } else {
                    ADVANCE_MS[usize::from(b) % ADVANCE_MS.len()]
                };
                clock.advance(Duration::from_millis(ms));
            }
            11 => {
                let ms = 1 + u64::from(input.byte()) * 80;
                // Let the store read the current time first, so its high-water mark is
                // exactly the model's `now`.
                assert_eq!(namespaces[0].get("probe").map_err(|e| kind(&e)), Ok(None));
                clock.set(UnixMs(clock.now().0 - ms));
            }
            12 => {
                store.expire_now().expect("expire_now");
                assert_eq!(
                    counts(&store),
                    model.counts(),
                    "step {step}: stats after expire_now"
                );
            }
            _ => {
                store.close().expect("close");
                held.clear();
                drop(namespaces);
                drop(store);
                clock.set(UnixMs(model.now));
                (store, namespaces) = open(dir.path(), &clock, durability);
                assert_eq!(
                    counts(&store),
                    model.counts(),
                    "step {step}: stats after reopen"
                );
            }
        }
    }
    drop(held);
    store.close().expect("final close");
}
