//! Fuzz harness (c): arbitrary operation sequences against the reference model of
//! `idemstore::testing::model`, shared by `fuzz/fuzz_targets/model_ops.rs` and
//! `tests/fuzz_regressions.rs`.
//!
//! The same contract and the same model as `tests/model_proptest.rs` (every public
//! operation, clock moves both ways, `expire_now`, close + reopen with held claims
//! abandoned), but the sequence is decoded from fuzz bytes, so libFuzzer's coverage
//! feedback steers it. Byte 0 picks the durability mode; then each operation is one
//! opcode byte followed by its argument bytes (missing bytes read as zero). Every
//! answer is compared with the model, including exact `first_seen` and `expires_at`.

use std::time::Duration;

use idemstore::Durability;
use idemstore::testing::model::{
    EXTEND_MS, KEYS, MAX_RESULT_LEN, NAMESPACES, Op, PAST_LONG_MS, Replay, TTL_OVERRIDES_MS,
    WIDTH_MS,
};

const OPS_MAX: usize = 256;
const ADVANCE_MS: [u64; 5] = [WIDTH_MS, 5_000, 31_000, 3 * WIDTH_MS + 1, PAST_LONG_MS];

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

    /// Decodes the next operation.
    fn op(&mut self) -> Op {
        let ns_count = NAMESPACES.len();
        match self.byte() % 14 {
            0 => Op::CheckAndSet {
                ns: self.pick(ns_count),
                key: self.pick(KEYS),
                ttl: self.maybe(TTL_OVERRIDES_MS.len()),
            },
            1 => {
                let ns = self.pick(ns_count);
                let n = 1 + self.pick(4);
                let keys = (0..n).map(|_| self.pick(KEYS)).collect();
                Op::CheckAndSetMany { ns, keys }
            }
            2 => Op::Begin {
                ns: self.pick(ns_count),
                key: self.pick(KEYS),
                payload: self.maybe(3).map(|p| p as u8),
                ttl: self.maybe(TTL_OVERRIDES_MS.len()),
            },
            3 => {
                let (claim, len) = (usize::from(self.byte()), self.pick(MAX_RESULT_LEN + 2));
                let with_result = self.byte() & 1 == 1;
                Op::Complete {
                    claim,
                    result_len: with_result.then_some(len),
                }
            }
            4 => Op::Release {
                claim: usize::from(self.byte()),
            },
            5 => Op::Fail {
                claim: usize::from(self.byte()),
            },
            6 => Op::DropClaim {
                claim: usize::from(self.byte()),
            },
            7 => Op::Extend {
                claim: usize::from(self.byte()),
                lease: self.pick(EXTEND_MS.len()),
            },
            8 => Op::Get {
                ns: self.pick(ns_count),
                key: self.pick(KEYS),
            },
            9 => Op::Remove {
                ns: self.pick(ns_count),
                key: self.pick(KEYS),
            },
            10 => {
                let b = self.byte();
                let ms = if b < 200 {
                    u64::from(b) * 13 + 1
                } else {
                    ADVANCE_MS[usize::from(b) % ADVANCE_MS.len()]
                };
                Op::Advance { ms }
            }
            11 => Op::ClockBack {
                ms: 1 + u64::from(self.byte()) * 80,
            },
            12 => Op::ExpireNow,
            _ => Op::Reopen,
        }
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
    let mut replay = Replay::new(dir.path(), durability);
    let mut steps = 0;
    while !input.0.is_empty() && steps < OPS_MAX {
        steps += 1;
        let op = input.op();
        if let Err(difference) = replay.apply(op) {
            panic!("{difference}");
        }
    }
    if let Err(e) = replay.finish() {
        panic!("{e}");
    }
}
