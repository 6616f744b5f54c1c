//! Fuzz target: see `fuzz/harness/cold_index.rs` for what it checks. Crashes found
//! here become files under `tests/fixtures/fuzz/cold_index/`, replayed by
//! `tests/fuzz_regressions.rs`.
#![no_main]

#[path = "../harness/cold_index.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
