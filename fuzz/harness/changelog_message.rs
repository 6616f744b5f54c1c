//! Fuzz harness (d): the changelog message decoder (`docs/FORMAT.md`, "Changelog
//! messages"), shared by `fuzz/fuzz_targets/changelog_message.rs` and
//! `tests/fuzz_regressions.rs`.
//!
//! Checks, for any bytes: nothing panics; a message that decodes re-encodes to exactly
//! the bytes it was decoded from (one encoding per message, so a damaged message can
//! never pass for another), and names an owner token other than 0.

use idemstore::fuzzing;

pub fn run(data: &[u8]) {
    if let Ok(message) = fuzzing::decode_changelog_message(data) {
        assert_ne!(message.owner, 0);
        assert_eq!(message.reencoded, data, "re-encoding differs");
        for (_, _, id) in &message.records {
            assert!(!id.is_empty());
        }
    }
}
