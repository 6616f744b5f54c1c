//! Fuzz harness (e): the cold index file decoder (`docs/FORMAT.md`, "Cold index
//! files"), shared by `fuzz/fuzz_targets/cold_index.rs` and `tests/fuzz_regressions.rs`.
//!
//! Checks, for any bytes: nothing panics; a file that decodes re-encodes to exactly the
//! bytes it was decoded from (one encoding per file: the filter and the fences are
//! derived from the entries, so damage to any of them cannot pass for another file),
//! its filter holds every entry, its entries are sorted and name segments it has. The
//! same bytes go to the `COLD_STATE` decoder (the other file of the cold tier, read at
//! open): nothing panics, and a state that decodes re-encodes to its own bytes.

use idemstore::fuzzing;

pub fn run(data: &[u8]) {
    if let Ok(reencoded) = fuzzing::reencode_cold_state(data) {
        assert_eq!(reencoded, data, "cold state re-encoding differs");
    }
    if let Ok(file) = fuzzing::decode_cold_index(data) {
        assert_eq!(file.reencoded, data, "re-encoding differs");
        assert!(file.filter_holds_every_entry, "a filter misses an entry");
        assert!(!file.entries.is_empty() && !file.segments.is_empty());
        assert!(file.entries.windows(2).all(|w| w[0].0 <= w[1].0));
        assert!(
            file.entries
                .iter()
                .all(|e| (e.1 as usize) < file.segments.len())
        );
    }
}
