//! Every state × every request × lease live/expired × attempts below/at max, each
//! checked against the contract's table written out independently below.

use super::*;

const WIDTH: u64 = 1_000;
const NOW: UnixMs = UnixMs(1_000_000);
const TTL: u64 = 60_000;
const LEASE: u64 = 5_000;
const MAX_ATTEMPTS: u32 = 3;
const LSN: Lsn = Lsn(77 << 16);

/// The key's newest record in one of the situations the table distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Situation {
    Absent,
    Expired,
    Live {
        state: State,
        lease_live: bool,
        attempts_at_max: bool,
    },
}

fn situations() -> Vec<Situation> {
    let mut all = vec![Situation::Absent, Situation::Expired];
    for state in State::ALL {
        for lease_live in [false, true] {
            for attempts_at_max in [false, true] {
                all.push(Situation::Live {
                    state,
                    lease_live,
                    attempts_at_max,
                });
            }
        }
    }
    all
}

const DEADLINE: UnixMs = UnixMs(NOW.0 + 30_000);

fn current(situation: Situation) -> Option<Current> {
    let (state, lease_live, at_max, deadline) = match situation {
        Situation::Absent => return None,
        Situation::Expired => (State::Completed, false, false, UnixMs(NOW.0)),
        Situation::Live {
            state,
            lease_live,
            attempts_at_max,
        } => (state, lease_live, attempts_at_max, DEADLINE),
    };
    Some(Current {
        state,
        first_seen: UnixMs(NOW.0 - 10_000),
        deadline,
        claim: ClaimFields {
            attempts: if at_max { MAX_ATTEMPTS } else { 1 },
            lease_until_ms: if lease_live { NOW.0 + 1 } else { NOW.0 },
            completed_ms: 0,
            payload_fp: Some(0xFEED),
        },
        lsn: LSN,
        placement: Default::default(),
    })
}

fn begin(payload_fp: Option<u64>) -> Request<'static> {
    Request::Begin {
        ttl_ms: TTL,
        lease_ms: LEASE,
        max_attempts: MAX_ATTEMPTS,
        payload_fp,
    }
}

fn resolve(how: Resolution<'static>, ours: bool) -> Request<'static> {
    Request::Resolve {
        attempt: if ours { 1 } else { 2 },
        lsn: LSN,
        ttl_ms: TTL,
        how,
    }
}

/// The live situation, if any, with its state.
fn live(situation: Situation) -> Option<(State, bool, bool)> {
    match situation {
        Situation::Live {
            state: State::Tombstone,
            ..
        } => None,
        Situation::Live {
            state,
            lease_live,
            attempts_at_max,
        } => Some((state, lease_live, attempts_at_max)),
        _ => None,
    }
}

fn decide_at(request: Request<'static>, situation: Situation) -> Decision<'static> {
    decide(&request, current(situation).as_ref(), NOW, WIDTH)
}

fn ceil(ms: u64) -> UnixMs {
    UnixMs(ms.div_ceil(WIDTH) * WIDTH)
}

#[test]
fn check_and_set_marks_what_is_not_live_and_answers_duplicate_otherwise() {
    for situation in situations() {
        let decision = decide_at(Request::CheckAndSet { ttl_ms: TTL }, situation);
        match live(situation) {
            Some(_) => assert_eq!(decision, Decision::Keep(Kept::Duplicate), "{situation:?}"),
            None => assert_eq!(
                decision,
                Decision::Append(Write {
                    state: State::Seen,
                    first_seen: NOW,
                    claim: ClaimFields::default(),
                    result: None,
                    deadline: ceil(NOW.0 + TTL),
                }),
                "{situation:?}"
            ),
        }
    }
}

#[test]
fn begin_follows_the_decision_table() {
    for situation in situations() {
        for payload in [None, Some(0xFEED), Some(0xBAD)] {
            let decision = decide_at(begin(payload), situation);
            let expected = match live(situation) {
                None => Decision::Append(Write {
                    state: State::InProgress,
                    first_seen: NOW,
                    claim: ClaimFields {
                        attempts: 1,
                        lease_until_ms: NOW.0 + LEASE,
                        completed_ms: 0,
                        payload_fp: payload,
                    },
                    result: None,
                    deadline: ceil(NOW.0 + TTL),
                }),
                Some(_) if payload == Some(0xBAD) => Decision::Keep(Kept::PayloadMismatch),
                Some((State::Seen | State::Completed, _, _)) => Decision::Keep(Kept::Completed),
                Some((State::Failed, _, _)) => Decision::Keep(Kept::Exhausted),
                Some((State::InProgress, true, _)) => Decision::Keep(Kept::InProgress),
                Some((State::InProgress | State::Released, _, true)) => {
                    Decision::Keep(Kept::Exhausted)
                }
                Some((State::InProgress | State::Released, _, false)) => Decision::Append(Write {
                    state: State::InProgress,
                    first_seen: UnixMs(NOW.0 - 10_000),
                    claim: ClaimFields {
                        attempts: 2,
                        lease_until_ms: NOW.0 + LEASE,
                        completed_ms: 0,
                        payload_fp: Some(0xFEED),
                    },
                    result: None,
                    // The live record's bucket: later than the lease's.
                    deadline: DEADLINE,
                }),
                Some((State::Tombstone, _, _)) => unreachable!("tombstones are never live"),
            };
            assert_eq!(decision, expected, "{situation:?} payload {payload:?}");
        }
    }
}

#[test]
fn a_lease_longer_than_the_bucket_pushes_the_deadline() {
    let situation = Situation::Live {
        state: State::Released,
        lease_live: false,
        attempts_at_max: false,
    };
    let request = Request::Begin {
        ttl_ms: TTL,
        lease_ms: 45_000,
        max_attempts: MAX_ATTEMPTS,
        payload_fp: None,
    };
    let Decision::Append(write) = decide_at(request, situation) else {
        panic!("not acquired");
    };
    assert_eq!(write.deadline, ceil(NOW.0 + 45_000));
    assert!(write.deadline > DEADLINE);
}

#[test]
fn claim_operations_need_their_own_live_acquisition() {
    let hows = [
        Resolution::Complete(Some(b"result")),
        Resolution::Complete(None),
        Resolution::Release,
        Resolution::Fail,
        Resolution::Extend(45_000),
    ];
    for situation in situations() {
        for how in hows {
            for ours in [true, false] {
                let decision = decide_at(resolve(how, ours), situation);
                let held = ours && matches!(live(situation), Some((State::InProgress, _, false)));
                if !held {
                    assert_eq!(decision, Decision::Keep(Kept::ClaimLost), "{situation:?}");
                    continue;
                }
                let c = current(situation).unwrap();
                let cleared = ClaimFields {
                    lease_until_ms: 0,
                    ..c.claim
                };
                let expected = match how {
                    Resolution::Complete(result) => Write {
                        state: State::Completed,
                        first_seen: c.first_seen,
                        claim: ClaimFields {
                            completed_ms: NOW.0,
                            ..cleared
                        },
                        result,
                        deadline: ceil(NOW.0 + TTL),
                    },
                    Resolution::Release => Write {
                        state: State::Released,
                        first_seen: c.first_seen,
                        claim: cleared,
                        result: None,
                        deadline: DEADLINE,
                    },
                    Resolution::Fail => Write {
                        state: State::Failed,
                        first_seen: c.first_seen,
                        claim: cleared,
                        result: None,
                        deadline: DEADLINE,
                    },
                    Resolution::Extend(ms) => Write {
                        state: State::InProgress,
                        first_seen: c.first_seen,
                        claim: ClaimFields {
                            lease_until_ms: NOW.0 + ms,
                            ..c.claim
                        },
                        result: None,
                        deadline: ceil(NOW.0 + ms),
                    },
                };
                assert_eq!(
                    decision,
                    Decision::Append(expected),
                    "{situation:?} {how:?}"
                );
            }
        }
    }
}

#[test]
fn a_claim_of_another_acquisition_with_the_same_attempt_is_lost() {
    let situation = Situation::Live {
        state: State::InProgress,
        lease_live: true,
        attempts_at_max: false,
    };
    let request = Request::Resolve {
        attempt: 1,
        lsn: Lsn(LSN.0 + (1 << 16)),
        ttl_ms: TTL,
        how: Resolution::Release,
    };
    assert_eq!(
        decide_at(request, situation),
        Decision::Keep(Kept::ClaimLost)
    );
}

#[test]
fn remove_writes_a_tombstone_in_the_keys_own_bucket() {
    for situation in situations() {
        let decision = decide_at(Request::Remove, situation);
        match live(situation) {
            None => assert_eq!(decision, Decision::Keep(Kept::Absent), "{situation:?}"),
            Some(_) => assert_eq!(
                decision,
                Decision::Append(Write {
                    state: State::Tombstone,
                    first_seen: UnixMs(NOW.0 - 10_000),
                    claim: ClaimFields::default(),
                    result: None,
                    deadline: DEADLINE,
                }),
                "{situation:?}"
            ),
        }
    }
}

#[test]
fn import_writes_only_over_what_is_not_live_and_only_in_range() {
    let import = |expires_at: u64, until: u64| Request::Import {
        state: State::Completed,
        first_seen: UnixMs(5),
        claim: ClaimFields {
            attempts: 2,
            ..ClaimFields::default()
        },
        result: Some(b"r"),
        expires_at: UnixMs(expires_at),
        until: UnixMs(until),
        span_max_ms: TTL,
    };
    for situation in situations() {
        assert_eq!(
            decide_at(import(NOW.0, NOW.0 + 10), situation),
            Decision::Keep(Kept::Expired)
        );
        assert_eq!(
            decide_at(import(NOW.0 + 1, NOW.0 + TTL + 1), situation),
            Decision::Keep(Kept::TooLong)
        );
        let decision = decide_at(import(NOW.0 + 10, NOW.0 + 1_500), situation);
        match live(situation) {
            Some(_) => assert_eq!(decision, Decision::Keep(Kept::AlreadyLive)),
            None => assert_eq!(
                decision,
                Decision::Append(Write {
                    state: State::Completed,
                    first_seen: UnixMs(5),
                    claim: ClaimFields {
                        attempts: 2,
                        ..ClaimFields::default()
                    },
                    result: Some(b"r"),
                    deadline: ceil(NOW.0 + 1_500),
                })
            ),
        }
    }
}

#[test]
fn a_write_never_moves_a_live_key_to_an_earlier_bucket() {
    let requests = [
        Request::CheckAndSet { ttl_ms: TTL },
        begin(None),
        resolve(Resolution::Complete(None), true),
        resolve(Resolution::Release, true),
        resolve(Resolution::Fail, true),
        resolve(Resolution::Extend(1_000), true),
        Request::Remove,
    ];
    for situation in situations() {
        for request in requests {
            if let (Some(c), Decision::Append(write)) = (
                current(situation).filter(|c| c.is_live(NOW)),
                decide_at(request, situation),
            ) {
                assert!(write.deadline >= c.deadline, "{situation:?} {request:?}");
            }
        }
    }
}

#[test]
fn status_and_state_map_one_to_one() {
    for state in State::ALL {
        match status_of(state) {
            Some(status) => assert_eq!(state_of(status), state),
            None => assert_eq!(state, State::Tombstone),
        }
    }
}
