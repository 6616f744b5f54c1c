//! The replay: one sequence of operations against a real store and the model.

use super::*;
use std::path::Path;
use std::time::Duration;

/// One step of a replay. Indexes pick a namespace of [`NAMESPACES`], a key below
/// [`KEYS`], an entry of [`TTL_OVERRIDES_MS`] / [`EXTEND_MS`], or a held claim (modulo
/// how many are held; nothing happens when none is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `check_and_set`, with a per-call ttl override if `ttl` is set.
    CheckAndSet {
        ns: usize,
        key: usize,
        ttl: Option<usize>,
    },
    /// `check_and_set_many`.
    CheckAndSetMany { ns: usize, keys: Vec<usize> },
    /// `begin`, or `begin_with_payload` if `payload` is set; an acquired claim is held.
    Begin {
        ns: usize,
        key: usize,
        payload: Option<u8>,
        ttl: Option<usize>,
    },
    /// `Claim::complete` with a result of this length, or none.
    Complete {
        claim: usize,
        result_len: Option<usize>,
    },
    /// `Claim::release`.
    Release { claim: usize },
    /// `Claim::fail`.
    Fail { claim: usize },
    /// `Claim::extend`.
    Extend { claim: usize, lease: usize },
    /// Dropping the claim unresolved.
    DropClaim { claim: usize },
    /// `get`.
    Get { ns: usize, key: usize },
    /// `remove`.
    Remove { ns: usize, key: usize },
    /// The clock moves forward.
    Advance { ms: u64 },
    /// The clock steps back.
    ClockBack { ms: u64 },
    /// `Store::expire_now`, then the counts of `stats()`.
    ExpireNow,
    /// `close`, then open again; claims still held are abandoned, as if their worker
    /// died with the process: the open releases them, and their handles are lost.
    Reopen,
}

/// Opens the scenario's store on `dir` under `clock`, with its namespaces in the order
/// of [`NAMESPACES`].
pub fn open(dir: &Path, clock: &ManualClock, durability: Durability) -> (Store, Vec<Namespace>) {
    open_with_budget(dir, clock, durability, None)
}

/// [`open`] with a memory budget: a tiny one sends every key through the cold tier
/// (each reaper round and `expire_now` spill every live bucket, merges follow).
pub fn open_with_budget(
    dir: &Path,
    clock: &ManualClock,
    durability: Durability,
    budget: Option<u64>,
) -> (Store, Vec<Namespace>) {
    let mut builder = Store::builder(dir);
    if let Some(budget) = budget {
        builder = builder.memory_budget(budget);
    }
    let store = builder
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

/// The id of key index `key`.
pub fn id(key: usize) -> String {
    format!("msg-{key}")
}

struct Held {
    claim: Claim,
    model: ClaimModel,
}

/// Returns `Err` with the step and both values unless `got == want`.
macro_rules! check_eq {
    ($step:expr, $got:expr, $want:expr, $($what:tt)+) => {{
        let (got, want) = (&$got, &$want);
        if got != want {
            return Err(format!(
                "step {}: {}: the store answered {:?}, the model {:?}",
                $step,
                format!($($what)+),
                got,
                want
            ));
        }
    }};
}

/// One sequence of operations run against a store on a real directory and against the
/// model, every answer compared.
pub struct Replay<'a> {
    dir: &'a Path,
    durability: Durability,
    budget: Option<u64>,
    clock: ManualClock,
    store: Store,
    namespaces: Vec<Namespace>,
    model: Model,
    held: Vec<Held>,
    step: usize,
}

impl<'a> Replay<'a> {
    /// Opens the scenario's store on the empty directory `dir`.
    pub fn new(dir: &'a Path, durability: Durability) -> Replay<'a> {
        Replay::with_budget(dir, durability, None)
    }

    /// [`Replay::new`] with a memory budget ([`open_with_budget`]).
    pub fn with_budget(dir: &'a Path, durability: Durability, budget: Option<u64>) -> Replay<'a> {
        let clock = ManualClock::new(UnixMs(START_MS));
        let (store, namespaces) = open_with_budget(dir, &clock, durability, budget);
        let policies = NAMESPACES
            .iter()
            .map(|&(_, ttl_ms, lease_ms, max_attempts)| ModelPolicy {
                ttl_ms,
                lease_ms,
                max_attempts,
            })
            .collect();
        Replay {
            dir,
            durability,
            budget,
            clock,
            store,
            namespaces,
            model: Model::new(START_MS, WIDTH_MS, MAX_RESULT_LEN, policies),
            held: Vec::new(),
            step: 0,
        }
    }

    /// A handle with the per-call ttl override `ttl`, and the ttl it applies.
    fn handle(&self, ns: usize, ttl: Option<usize>) -> (Namespace, u64) {
        match ttl {
            Some(i) => (
                self.namespaces[ns]
                    .with_ttl(Duration::from_millis(TTL_OVERRIDES_MS[i]))
                    .expect("with_ttl"),
                TTL_OVERRIDES_MS[i],
            ),
            None => (self.namespaces[ns].clone(), NAMESPACES[ns].1),
        }
    }

    fn counts(&self) -> [u64; 5] {
        let s = self.store.stats();
        [s.seen, s.in_progress, s.released, s.completed, s.failed]
    }

    /// Runs `op` on both; `Err` says where and how the store and the model differ.
    pub fn apply(&mut self, op: Op) -> Result<(), String> {
        self.step += 1;
        let step = self.step;
        // Odd steps call the async forms (awaited on a minimal executor), even steps
        // the blocking ones: one model holds both to the same contract.
        let async_call = step % 2 == 1;
        self.model.observe(self.clock.now().0);
        match op {
            Op::CheckAndSet { ns, key, ttl } => {
                let (handle, ttl_ms) = self.handle(ns, ttl);
                let got = if async_call {
                    block_on(handle.check_and_set_async(id(key)))
                } else {
                    handle.check_and_set(id(key))
                };
                let got = got.map_err(|e| ErrKind::of(&e));
                let want = Ok(self.model.check_and_set(ns, key, ttl_ms));
                check_eq!(step, got, want, "check_and_set {ns} {key}");
            }
            Op::CheckAndSetMany { ns, keys } => {
                let ids: Vec<String> = keys.iter().map(|&k| id(k)).collect();
                let got = if async_call {
                    block_on(self.namespaces[ns].check_and_set_many_async(&ids))
                } else {
                    self.namespaces[ns].check_and_set_many(&ids)
                };
                let got = got.map_err(|e| ErrKind::of(&e));
                let want: Vec<Outcome> = keys
                    .iter()
                    .map(|&k| self.model.check_and_set(ns, k, NAMESPACES[ns].1))
                    .collect();
                check_eq!(step, got, Ok(want), "check_and_set_many {ns} {keys:?}");
            }
            Op::Begin {
                ns,
                key,
                payload,
                ttl,
            } => {
                let (handle, ttl_ms) = self.handle(ns, ttl);
                let got = match (payload, async_call) {
                    (Some(p), false) => handle.begin_with_payload(id(key), &[p, 7, 7]),
                    (Some(p), true) => {
                        block_on(handle.begin_with_payload_async(id(key), &[p, 7, 7]))
                    }
                    (None, false) => handle.begin(id(key)),
                    (None, true) => block_on(handle.begin_async(id(key))),
                };
                let want = self.model.begin(ns, key, payload, ttl_ms);
                let got_answer = got.as_ref().map(BeginAnswer::of).map_err(ErrKind::of);
                let want_answer = want.as_ref().map(|(a, _)| a.clone()).map_err(|e| *e);
                check_eq!(
                    step,
                    got_answer,
                    want_answer,
                    "begin {ns} {key} payload {payload:?} ttl {ttl_ms}"
                );
                if let (Ok(Begin::Acquired(claim)), Ok((_, Some(model)))) = (got, want) {
                    self.held.push(Held { claim, model });
                }
            }
            Op::Complete { claim, result_len } => {
                if self.held.is_empty() {
                    return Ok(());
                }
                let Held { claim, model: h } = self.held.remove(claim % self.held.len());
                let result: Option<Vec<u8>> =
                    result_len.map(|len| (0..len).map(|i| (step + i) as u8).collect());
                let got = if async_call {
                    block_on(claim.complete_async(result.as_deref()))
                } else {
                    claim.complete(result.as_deref())
                };
                let got = got.map_err(|e| ErrKind::of(&e));
                let want = self.model.resolve(&h, How::Complete(result)).map(|_| ());
                check_eq!(step, got, want, "complete {} {}", h.ns, h.key);
            }
            Op::Release { claim } | Op::Fail { claim } | Op::DropClaim { claim } => {
                if self.held.is_empty() {
                    return Ok(());
                }
                let Held { claim: c, model: h } = self.held.remove(claim % self.held.len());
                match op {
                    Op::Release { .. } => {
                        let got = if async_call {
                            block_on(c.release_async())
                        } else {
                            c.release()
                        };
                        let got = got.map_err(|e| ErrKind::of(&e));
                        let want = self.model.resolve(&h, How::Release).map(|_| ());
                        check_eq!(step, got, want, "release {} {}", h.ns, h.key);
                    }
                    Op::Fail { .. } => {
                        let got = if async_call {
                            block_on(c.fail_async())
                        } else {
                            c.fail()
                        };
                        let got = got.map_err(|e| ErrKind::of(&e));
                        let want = self.model.resolve(&h, How::Fail).map(|_| ());
                        check_eq!(step, got, want, "fail {} {}", h.ns, h.key);
                    }
                    _ => {
                        drop(c);
                        let _ = self.model.resolve(&h, How::Release);
                    }
                }
            }
            Op::Extend { claim, lease } => {
                if self.held.is_empty() {
                    return Ok(());
                }
                let i = claim % self.held.len();
                let held = &mut self.held[i];
                let lease_ms = EXTEND_MS[lease];
                let lease = Duration::from_millis(lease_ms);
                let got = if async_call {
                    block_on(held.claim.extend_async(lease))
                } else {
                    held.claim.extend(lease)
                };
                let got = got.map_err(|e| ErrKind::of(&e));
                let want = self.model.resolve(&held.model, How::Extend(lease_ms));
                check_eq!(step, got, want.map(|_| ()), "extend by {lease_ms}");
                if let Ok(until) = want {
                    check_eq!(
                        step,
                        held.claim.lease_until(),
                        UnixMs(until),
                        "lease after extend"
                    );
                }
            }
            Op::Get { ns, key } => {
                let got = self.namespaces[ns]
                    .get(id(key))
                    .map_err(|e| ErrKind::of(&e));
                check_eq!(step, got, Ok(self.model.get(ns, key)), "get {ns} {key}");
            }
            Op::Remove { ns, key } => {
                let got = self.namespaces[ns]
                    .remove(id(key))
                    .map_err(|e| ErrKind::of(&e));
                check_eq!(
                    step,
                    got,
                    Ok(self.model.remove(ns, key)),
                    "remove {ns} {key}"
                );
            }
            Op::Advance { ms } => self.clock.advance(Duration::from_millis(ms)),
            Op::ClockBack { ms } => {
                // Let the store read the current time first (the background reaper may or
                // may not have): its high-water mark is then exactly the model's `now`.
                let probe = self.namespaces[0].get("probe").map_err(|e| ErrKind::of(&e));
                check_eq!(step, probe, Ok(None), "get of a key never written");
                let now = self.clock.now().0;
                self.clock.set(UnixMs(now.saturating_sub(ms)));
            }
            Op::ExpireNow => {
                self.store
                    .expire_now()
                    .map_err(|e| format!("expire_now: {e}"))?;
                check_eq!(
                    step,
                    self.counts(),
                    self.model.counts(),
                    "stats after expire_now"
                );
            }
            Op::Reopen => {
                self.store.close().map_err(|e| format!("close: {e}"))?;
                // Claims still held belong to a worker that died with the process; the
                // open releases them (§3.6).
                let stale = std::mem::take(&mut self.held);
                self.namespaces.clear();
                self.clock.set(UnixMs(self.model.now_ms()));
                let released = self.model.reopen();
                (self.store, self.namespaces) =
                    open_with_budget(self.dir, &self.clock, self.durability, self.budget);
                check_eq!(
                    step,
                    self.counts(),
                    self.model.counts(),
                    "stats after reopen"
                );
                // An open from the checkpoint of the clean close counts exactly the
                // claims it released. An open that replays the log (the checkpoint no
                // longer matched) also counts again the claims an earlier open released
                // whose keys nothing wrote since: their newest record is still the dead
                // claim's. Either way the keys' states are the same (checked above).
                let stats = self.store.stats();
                let counted = stats.claims_released_at_open;
                if stats.opened_from_checkpoint {
                    check_eq!(step, counted, released.claims, "claims released at open");
                } else if !(released.claims..=released.claims + released.earlier).contains(&counted)
                {
                    return Err(format!(
                        "step {step}: claims released at a replaying open: the store counted \
                         {counted}, the model {released:?}"
                    ));
                }
                // A handle kept across the reopen belongs to the closed store: it is
                // lost and resolves nothing in the reopened one.
                for held in stale {
                    let got = held.claim.release().map_err(|e| ErrKind::of(&e));
                    check_eq!(
                        step,
                        got,
                        Err(ErrKind::Closed),
                        "a claim held across the reopen"
                    );
                }
                check_eq!(
                    step,
                    self.counts(),
                    self.model.counts(),
                    "stats after releasing stale claims"
                );
            }
        }
        Ok(())
    }

    /// Drops the claims still held and closes the store.
    pub fn finish(mut self) -> Result<(), String> {
        self.held.clear();
        self.store.close().map_err(|e| format!("final close: {e}"))
    }
}

/// A minimal executor for the async steps (and the async tests): polls `future` on
/// this thread, parking between wakes (the commit thread's wake unparks it).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(output) => return output,
            Poll::Pending => std::thread::park(),
        }
    }
}
