//! Guards the whole operation contract of DESIGN.md §1–2 against a reference model.
//!
//! Proptest generates random sequences of every public operation — `check_and_set`,
//! `check_and_set_many`, `begin`/`begin_with_payload` followed by `complete`,
//! `release`, `fail`, `extend` or a plain drop of the claim, `get`, `remove`, the
//! per-call ttl override, manual clock moves (small steps, whole bucket widths, jumps
//! past every ttl, and jumps backwards), `expire_now`, and close + reopen — and
//! replays each sequence against the store and against a plain `HashMap` that encodes
//! the documented semantics. Every answer is compared step by step, including exact
//! `first_seen` / `expires_at` values: the expiry deadline is deterministic
//! (`ceil((now + ttl) / width) * width` for these short spans), so the model computes
//! it. Claims still held at a reopen are abandoned as if their worker crashed: the
//! open releases them (their process is gone), keeping their attempts.

use std::collections::HashMap;
use std::time::Duration;

use idemstore::{
    Begin, Claim, Durability, Error, ManualClock, Namespace, Outcome, Policy, Record, Seen, Status,
    Store, UnixMs,
};
use proptest::prelude::*;

const WIDTH_MS: u64 = 10_000;
const START_MS: u64 = 1_700_000_003_000;
const MAX_RESULT_LEN: usize = 16;
const KEYS: usize = 4;

/// Namespace policies: (name, ttl ms, lease ms, max attempts).
const NAMESPACES: [(&str, u64, u64, u32); 2] =
    [("orders", 30_000, 5_000, 2), ("mails", 12_000, 3_000, 3)];
/// Per-call ttl overrides.
const TTL_OVERRIDES_MS: [u64; 3] = [1_000, 7_000, 25_000];
/// Leases passed to `Claim::extend`.
const EXTEND_MS: [u64; 3] = [1_000, 4_000, 20_000];
/// Result lengths passed to `Claim::complete` (the last is over the limit).
const RESULT_LENS: [Option<usize>; 5] = [
    None,
    Some(0),
    Some(5),
    Some(MAX_RESULT_LEN),
    Some(MAX_RESULT_LEN + 1),
];

#[derive(Debug, Clone)]
enum Op {
    CheckAndSet {
        ns: usize,
        key: usize,
        ttl: Option<usize>,
    },
    CheckAndSetMany {
        ns: usize,
        keys: Vec<usize>,
    },
    Begin {
        ns: usize,
        key: usize,
        payload: Option<u8>,
        ttl: Option<usize>,
    },
    Complete {
        claim: usize,
        result: usize,
    },
    Release {
        claim: usize,
    },
    Fail {
        claim: usize,
    },
    Extend {
        claim: usize,
        lease: usize,
    },
    DropClaim {
        claim: usize,
    },
    Get {
        ns: usize,
        key: usize,
    },
    Remove {
        ns: usize,
        key: usize,
    },
    Advance {
        ms: u64,
    },
    ClockBack {
        ms: u64,
    },
    ExpireNow,
    Reopen,
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let ns = 0..NAMESPACES.len();
    let key = 0..KEYS;
    let ttl = proptest::option::weighted(0.3, 0..TTL_OVERRIDES_MS.len());
    prop_oneof![
        4 => (ns.clone(), key.clone(), ttl.clone()).prop_map(|(ns, key, ttl)| Op::CheckAndSet { ns, key, ttl }),
        1 => (ns.clone(), proptest::collection::vec(key.clone(), 1..5)).prop_map(|(ns, keys)| Op::CheckAndSetMany { ns, keys }),
        5 => (ns.clone(), key.clone(), proptest::option::of(0u8..3), ttl).prop_map(|(ns, key, payload, ttl)| Op::Begin { ns, key, payload, ttl }),
        2 => (0..4usize, 0..RESULT_LENS.len()).prop_map(|(claim, result)| Op::Complete { claim, result }),
        1 => (0..4usize).prop_map(|claim| Op::Release { claim }),
        1 => (0..4usize).prop_map(|claim| Op::Fail { claim }),
        1 => (0..4usize, 0..EXTEND_MS.len()).prop_map(|(claim, lease)| Op::Extend { claim, lease }),
        1 => (0..4usize).prop_map(|claim| Op::DropClaim { claim }),
        2 => (ns.clone(), key.clone()).prop_map(|(ns, key)| Op::Get { ns, key }),
        1 => (ns, key).prop_map(|(ns, key)| Op::Remove { ns, key }),
        4 => prop_oneof![1u64..2_500, Just(WIDTH_MS), Just(5_000u64), Just(31_000u64), Just(3 * WIDTH_MS + 1)]
            .prop_map(|ms| Op::Advance { ms }),
        1 => (1u64..20_000).prop_map(|ms| Op::ClockBack { ms }),
        1 => Just(Op::ExpireNow),
        1 => Just(Op::Reopen),
    ]
}

/// The model's view of one key.
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
    /// Which acquisition holds the key (a claim is valid only for its own).
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
    InvalidTtl,
    Other,
}

fn kind(e: &Error) -> ErrKind {
    match e {
        Error::PayloadMismatch => ErrKind::PayloadMismatch,
        Error::ClaimLost => ErrKind::ClaimLost,
        Error::ResultTooLarge { .. } => ErrKind::ResultTooLarge,
        Error::InvalidTtl { .. } => ErrKind::InvalidTtl,
        _ => ErrKind::Other,
    }
}

/// What `begin` answers, comparable.
#[derive(Debug, PartialEq, Eq)]
enum BeginAnswer {
    Acquired { attempt: u32, lease_until: UnixMs },
    InProgress(Record),
    Completed(Record),
    Exhausted(Record),
}

#[derive(Default)]
struct Model {
    now: u64,
    entries: HashMap<(usize, usize), Entry>,
    next_token: u64,
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

    /// `begin`; on acquisition also the claim token.
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

    /// A claim operation; returns the new lease deadline for `Extend`.
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

    /// A reopen: the claims in progress belonged to the process that held the store
    /// before, so the open releases them; their attempts stay.
    fn release_dead_claims(&mut self) {
        for e in self.entries.values_mut() {
            if e.status == Status::InProgress {
                e.status = Status::Released;
                e.lease_until = 0;
            }
        }
    }

    fn remove(&mut self, ns: usize, key: usize) -> bool {
        let live = self.live(ns, key).is_some();
        self.entries.remove(&(ns, key));
        live
    }

    /// Live keys per status: (seen, in progress, released, completed, failed).
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

struct HeldModel {
    ns: usize,
    key: usize,
    token: u64,
    ttl_ms: u64,
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

fn run(ops: Vec<Op>, durability: Durability) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let (mut store, mut namespaces) = open(dir.path(), &clock, durability);
    let mut model = Model {
        now: START_MS,
        ..Model::default()
    };
    let mut held: Vec<Held> = Vec::new();

    for (step, op) in ops.into_iter().enumerate() {
        model.now = model.now.max(clock_now(&clock));
        match op {
            Op::CheckAndSet { ns, key, ttl } => {
                let (handle, ttl_ms) = handle(&namespaces, ns, ttl);
                let got = handle.check_and_set(id(key)).map_err(|e| kind(&e));
                let want = Ok(model.check_and_set(ns, key, ttl_ms));
                prop_assert_eq!(got, want, "step {}: check_and_set {} {}", step, ns, key);
            }
            Op::CheckAndSetMany { ns, keys } => {
                let ids: Vec<String> = keys.iter().map(|&k| id(k)).collect();
                let got = namespaces[ns]
                    .check_and_set_many(&ids)
                    .map_err(|e| kind(&e));
                let want: Vec<Outcome> = keys
                    .iter()
                    .map(|&k| model.check_and_set(ns, k, NAMESPACES[ns].1))
                    .collect();
                prop_assert_eq!(
                    got,
                    Ok(want),
                    "step {}: check_and_set_many {:?}",
                    step,
                    keys
                );
            }
            Op::Begin {
                ns,
                key,
                payload,
                ttl,
            } => {
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
                        prop_assert_eq!(got, want, "step {}: begin", step);
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
                        prop_assert_eq!(
                            got.map_err(|e| kind(&e)),
                            want.map(|(a, _)| a),
                            "step {}: begin {} {}",
                            step,
                            ns,
                            key
                        );
                    }
                }
            }
            Op::Complete { claim, result } => {
                if held.is_empty() {
                    continue;
                }
                let Held { claim, model: h } = held.remove(claim % held.len());
                let result: Option<Vec<u8>> =
                    RESULT_LENS[result].map(|len| (0..len).map(|i| (step + i) as u8).collect());
                let got = claim.complete(result.as_deref()).map_err(|e| kind(&e));
                let want = model.resolve(&h, How::Complete(result)).map(|_| ());
                if want == Err(ErrKind::ResultTooLarge) {
                    // The refused claim is dropped, which releases it.
                    let _ = model.resolve(&h, How::Release);
                }
                prop_assert_eq!(got, want, "step {}: complete", step);
            }
            Op::Release { claim } | Op::Fail { claim } | Op::DropClaim { claim } => {
                if held.is_empty() {
                    continue;
                }
                let Held { claim: c, model: h } = held.remove(claim % held.len());
                match op {
                    Op::Release { .. } => {
                        let got = c.release().map_err(|e| kind(&e));
                        prop_assert_eq!(
                            got,
                            model.resolve(&h, How::Release).map(|_| ()),
                            "step {}: release",
                            step
                        );
                    }
                    Op::Fail { .. } => {
                        let got = c.fail().map_err(|e| kind(&e));
                        prop_assert_eq!(
                            got,
                            model.resolve(&h, How::Fail).map(|_| ()),
                            "step {}: fail",
                            step
                        );
                    }
                    _ => {
                        drop(c);
                        let _ = model.resolve(&h, How::Release);
                    }
                }
            }
            Op::Extend { claim, lease } => {
                if held.is_empty() {
                    continue;
                }
                let i = claim % held.len();
                let lease_ms = EXTEND_MS[lease];
                let got = held[i]
                    .claim
                    .extend(Duration::from_millis(lease_ms))
                    .map_err(|e| kind(&e));
                let want = model.resolve(&held[i].model, How::Extend(lease_ms));
                prop_assert_eq!(got, want.map(|_| ()), "step {}: extend", step);
                if let Ok(until) = want {
                    prop_assert_eq!(
                        held[i].claim.lease_until(),
                        UnixMs(until),
                        "step {}: lease after extend",
                        step
                    );
                }
            }
            Op::Get { ns, key } => {
                let got = namespaces[ns].get(id(key)).map_err(|e| kind(&e));
                let want = model.live(ns, key).map(Entry::record);
                prop_assert_eq!(got, Ok(want), "step {}: get {} {}", step, ns, key);
            }
            Op::Remove { ns, key } => {
                let got = namespaces[ns].remove(id(key)).map_err(|e| kind(&e));
                prop_assert_eq!(
                    got,
                    Ok(model.remove(ns, key)),
                    "step {}: remove {} {}",
                    step,
                    ns,
                    key
                );
            }
            Op::Advance { ms } => clock.advance(Duration::from_millis(ms)),
            Op::ClockBack { ms } => {
                // Let the store read the current time first (the background reaper may or
                // may not have): its high-water mark is then exactly the model's `now`.
                prop_assert_eq!(namespaces[0].get("probe").map_err(|e| kind(&e)), Ok(None));
                clock.set(UnixMs(clock_now(&clock) - ms));
            }
            Op::ExpireNow => {
                store.expire_now().expect("expire_now");
                prop_assert_eq!(
                    counts(&store),
                    model.counts(),
                    "step {}: stats after expire_now",
                    step
                );
            }
            Op::Reopen => {
                store.close().expect("close");
                // Claims still held belong to a worker that died with the process: dropping
                // them now cannot release anything (the store is closed).
                held.clear();
                model.release_dead_claims();
                drop(namespaces);
                drop(store);
                clock.set(UnixMs(model.now));
                (store, namespaces) = open(dir.path(), &clock, durability);
                prop_assert_eq!(
                    counts(&store),
                    model.counts(),
                    "step {}: stats after reopen",
                    step
                );
            }
        }
    }
    drop(held);
    store.close().expect("final close");
    Ok(())
}

fn clock_now(clock: &ManualClock) -> u64 {
    use idemstore::Clock;
    clock.now().0
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn store_matches_the_model(
        ops in proptest::collection::vec(op_strategy(), 1..60),
        durable in any::<bool>(),
    ) {
        let durability = if durable { Durability::Interval(Duration::from_millis(50)) } else { Durability::None };
        run(ops, durability)?;
    }
}

/// Regression: a claim whose key was removed and then acquired again by another
/// worker must not be able to resolve the new worker's claim (found by the model).
#[test]
fn a_stale_claim_cannot_resolve_a_newer_acquisition_of_the_same_attempt_number() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let (store, namespaces) = open(dir.path(), &clock, Durability::None);
    let ns = &namespaces[0];
    let Begin::Acquired(old) = ns.begin("k").unwrap() else {
        panic!("first begin must acquire")
    };
    assert!(ns.remove("k").unwrap());
    let Begin::Acquired(new) = ns.begin("k").unwrap() else {
        panic!("begin after remove must acquire")
    };
    assert_eq!(old.attempt(), new.attempt());
    assert!(matches!(
        old.complete(Some(b"stale")),
        Err(Error::ClaimLost)
    ));
    new.complete(Some(b"fresh")).unwrap();
    assert_eq!(ns.get("k").unwrap().unwrap().result(), Some(&b"fresh"[..]));
    drop(namespaces);
    store.close().unwrap();
}

/// Regression: `complete` refused with `ResultTooLarge` must still release the claim
/// (DESIGN.md: a claim dropped without resolution is released).
#[test]
fn a_claim_refused_for_a_too_large_result_is_released() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(START_MS));
    let (store, namespaces) = open(dir.path(), &clock, Durability::None);
    let ns = &namespaces[0];
    let Begin::Acquired(claim) = ns.begin("k").unwrap() else {
        panic!("first begin must acquire")
    };
    let err = claim
        .complete(Some(&[0u8; MAX_RESULT_LEN + 1]))
        .unwrap_err();
    assert!(
        matches!(err, Error::ResultTooLarge { len, max } if len == MAX_RESULT_LEN + 1 && max == MAX_RESULT_LEN)
    );
    assert_eq!(ns.get("k").unwrap().unwrap().status, Status::Released);
    let Begin::Acquired(again) = ns.begin("k").unwrap() else {
        panic!("a released key must be acquirable")
    };
    assert_eq!(again.attempt(), 2);
    again.complete(None).unwrap();
    drop(namespaces);
    store.close().unwrap();
}
