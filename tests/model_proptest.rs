//! Guards the operation contract of docs/CONTRACT.md §1–2 against a reference model.
//!
//! Proptest generates random sequences of every public operation — `check_and_set`,
//! `check_and_set_many`, `begin`/`begin_with_payload` followed by `complete`,
//! `release`, `fail`, `extend` or a plain drop of the claim, `get`, `remove`, the
//! per-call ttl override (including a 6 h ttl and lease, whose deadlines round to two
//! bucket widths), manual clock moves (small steps, whole bucket widths, jumps past
//! every ttl, and jumps backwards), `expire_now`, and close + reopen — and
//! replays each sequence against the store and against the plain map of
//! `idemstore::testing::model`, which encodes the documented semantics (the fuzz
//! target `model_ops` replays byte-decoded sequences through the same model). Every
//! answer is compared step by step, including exact `first_seen` / `expires_at`
//! values: bucket deadlines are deterministic (§1.3), so the model computes them. Claims
//! still held at a reopen are abandoned as if their worker crashed: the open releases
//! them (their process is gone), keeping their attempts.

use std::time::Duration;

use idemstore::testing::model::{self, EXTEND_MS, KEYS, MAX_RESULT_LEN, NAMESPACES, Op, Replay};
use idemstore::{Begin, Durability, Error, ManualClock, Status, UnixMs};
use proptest::prelude::*;

/// Result lengths passed to `Claim::complete` (the last is over the limit).
const RESULT_LENS: [Option<usize>; 5] = [
    None,
    Some(0),
    Some(5),
    Some(MAX_RESULT_LEN),
    Some(MAX_RESULT_LEN + 1),
];

fn op_strategy() -> impl Strategy<Value = Op> {
    let ns = 0..NAMESPACES.len();
    let key = 0..KEYS;
    let ttl = proptest::option::weighted(0.3, 0..model::TTL_OVERRIDES_MS.len());
    prop_oneof![
        4 => (ns.clone(), key.clone(), ttl.clone()).prop_map(|(ns, key, ttl)| Op::CheckAndSet { ns, key, ttl }),
        1 => (ns.clone(), proptest::collection::vec(key.clone(), 1..5)).prop_map(|(ns, keys)| Op::CheckAndSetMany { ns, keys }),
        5 => (ns.clone(), key.clone(), proptest::option::of(0u8..3), ttl).prop_map(|(ns, key, payload, ttl)| Op::Begin { ns, key, payload, ttl }),
        2 => (0..4usize, 0..RESULT_LENS.len()).prop_map(|(claim, result)| Op::Complete { claim, result_len: RESULT_LENS[result] }),
        1 => (0..4usize).prop_map(|claim| Op::Release { claim }),
        1 => (0..4usize).prop_map(|claim| Op::Fail { claim }),
        1 => (0..4usize, 0..EXTEND_MS.len()).prop_map(|(claim, lease)| Op::Extend { claim, lease }),
        1 => (0..4usize).prop_map(|claim| Op::DropClaim { claim }),
        2 => (ns.clone(), key.clone()).prop_map(|(ns, key)| Op::Get { ns, key }),
        1 => (ns, key).prop_map(|(ns, key)| Op::Remove { ns, key }),
        4 => prop_oneof![1u64..2_500, Just(model::WIDTH_MS), Just(5_000u64), Just(31_000u64), Just(3 * model::WIDTH_MS + 1), Just(model::PAST_LONG_MS)]
            .prop_map(|ms| Op::Advance { ms }),
        1 => (1u64..20_000).prop_map(|ms| Op::ClockBack { ms }),
        1 => Just(Op::ExpireNow),
        1 => Just(Op::Reopen),
    ]
}

fn run(ops: Vec<Op>, durability: Durability) -> Result<(), TestCaseError> {
    run_with_budget(ops, durability, None)
}

fn run_with_budget(
    ops: Vec<Op>,
    durability: Durability,
    budget: Option<u64>,
) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let mut replay = Replay::with_budget(dir.path(), durability, budget);
    for op in ops {
        replay.apply(op).map_err(TestCaseError::fail)?;
    }
    replay.finish().map_err(TestCaseError::fail)
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

    /// The same with a 1-byte memory budget: every `expire_now` (and reaper round)
    /// spills every live bucket to the cold tier and merges generations beyond 8, so
    /// keys are answered, claimed, removed and expired from cold generations, and
    /// every answer and count must still match the model.
    #[test]
    fn store_matches_the_model_through_the_cold_tier(
        ops in proptest::collection::vec(op_strategy(), 1..80),
        durable in any::<bool>(),
    ) {
        let durability = if durable { Durability::Interval(Duration::from_millis(50)) } else { Durability::None };
        run_with_budget(ops, durability, Some(1))?;
    }
}

/// Regression: a claim whose key was removed and then acquired again by another
/// worker must not be able to resolve the new worker's claim (found by the model).
#[test]
fn a_stale_claim_cannot_resolve_a_newer_acquisition_of_the_same_attempt_number() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(model::START_MS));
    let (store, namespaces) = model::open(dir.path(), &clock, Durability::None);
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
/// (docs/CONTRACT.md §2: a claim dropped without resolution is released).
#[test]
fn a_claim_refused_for_a_too_large_result_is_released() {
    let dir = tempfile::tempdir().unwrap();
    let clock = ManualClock::new(UnixMs(model::START_MS));
    let (store, namespaces) = model::open(dir.path(), &clock, Durability::None);
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
