//! Fuzz target: see `fuzz/harness/open_dir.rs` for what it checks. Crashes found here
//! become files under `tests/fixtures/fuzz/open_dir/`, replayed by `tests/fuzz_regressions.rs`.
#![no_main]

#[path = "../harness/open_dir.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
