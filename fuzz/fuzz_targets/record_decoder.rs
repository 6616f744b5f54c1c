//! Fuzz target: see `fuzz/harness/record_decoder.rs` for what it checks. Crashes found here
//! become files under `tests/fixtures/fuzz/record_decoder/`, replayed by `tests/fuzz_regressions.rs`.
#![no_main]

#[path = "../harness/record_decoder.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
