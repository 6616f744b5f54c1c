//! Fuzz target: see `fuzz/harness/model_ops.rs` for what it checks. Crashes found here
//! become files under `tests/fixtures/fuzz/model_ops/`, replayed by `tests/fuzz_regressions.rs`.
#![no_main]

#[path = "../harness/model_ops.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
