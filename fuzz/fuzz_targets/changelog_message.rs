//! Fuzz target: see `fuzz/harness/changelog_message.rs` for what it checks. Crashes
//! found here become files under `tests/fixtures/fuzz/changelog_message/`, replayed by
//! `tests/fuzz_regressions.rs`.
#![no_main]

#[path = "../harness/changelog_message.rs"]
mod harness;

libfuzzer_sys::fuzz_target!(|data: &[u8]| harness::run(data));
