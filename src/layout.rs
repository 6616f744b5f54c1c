//! The store directory's layout: every file name the store owns, in one place. Any
//! other file in the directory is foreign: counted, and left alone.

/// The namespace table (`format::namespace_file`).
pub(crate) const NAMESPACES: &str = "NAMESPACES";
/// The index checkpoint of a clean close (`format::checkpoint`).
pub(crate) const CHECKPOINT: &str = "CHECKPOINT";
/// The checkpoint while it is written, renamed to `CHECKPOINT` once synced.
pub(crate) const CHECKPOINT_TEMP: &str = "CHECKPOINT.tmp";
/// The replicated partitions' changelog positions (`format::partitions`).
pub(crate) const PARTITIONS: &str = "PARTITIONS";
/// `PARTITIONS` while it is written.
pub(crate) const PARTITIONS_TEMP: &str = "PARTITIONS.tmp";
/// The file the directory lock (`flock`) is taken on.
pub(crate) const LOCK: &str = "LOCK";

/// The file name of a segment: `<bucket deadline, 16 hex>-<segment seq, 16 hex>.seg`.
pub(crate) fn segment_file_name(bucket_deadline_ms: u64, segment_seq: u64) -> String {
    format!("{bucket_deadline_ms:016x}-{segment_seq:016x}.seg")
}

/// Parses a segment file name exactly as `segment_file_name` writes it (lowercase
/// hex, 16 digits each); `None` for any other name.
pub(crate) fn parse_segment_file_name(name: &str) -> Option<(u64, u64)> {
    let stem = name.strip_suffix(".seg")?;
    let (deadline, seq) = stem.split_once('-')?;
    let hex = |digits: &str| {
        (digits.len() == 16
            && digits
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)))
        .then(|| u64::from_str_radix(digits, 16).ok())
        .flatten()
    };
    Some((hex(deadline)?, hex(seq)?))
}

/// The file name of a cold index generation: `<generation, 16 hex>.cold`; while it is
/// written, the same with `.tmp` after it.
pub(crate) fn cold_file_name(generation: u64) -> String {
    format!("{generation:016x}.cold")
}

/// A cold index generation file or its temp file (`cold_file_name`).
pub(crate) fn is_cold_file(name: &str) -> bool {
    let stem = name.strip_suffix(".tmp").unwrap_or(name);
    stem.strip_suffix(".cold").is_some_and(|hex| {
        hex.len() == 16
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// The generation number of a cold index file's name (not of its temp file).
pub(crate) fn parse_cold_file_name(name: &str) -> Option<u64> {
    if !is_cold_file(name) || name.ends_with(".tmp") {
        return None;
    }
    u64::from_str_radix(name.strip_suffix(".cold")?, 16).ok()
}

/// What the cold tier keeps only in RAM, written at a clean close beside `CHECKPOINT`
/// (`format::cold_state`).
pub(crate) const COLD_STATE: &str = "COLD_STATE";
pub(crate) const COLD_STATE_TEMP: &str = "COLD_STATE.tmp";

/// `CHECKPOINT` or its temp file.
pub(crate) fn is_checkpoint_file(name: &str) -> bool {
    name == CHECKPOINT || name == CHECKPOINT_TEMP
}

/// Whether `name` is a file idemstore writes in a store directory.
pub(crate) fn is_known_file(name: &str) -> bool {
    name == NAMESPACES
        || name == LOCK
        || name == PARTITIONS
        || name == PARTITIONS_TEMP
        || is_checkpoint_file(name)
        || name == COLD_STATE
        || name == COLD_STATE_TEMP
        || is_cold_file(name)
        || parse_segment_file_name(name).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_names_round_trip_and_nothing_else_parses() {
        let name = segment_file_name(0xabc, 42);
        assert_eq!(name, "0000000000000abc-000000000000002a.seg");
        assert_eq!(parse_segment_file_name(&name), Some((0xabc, 42)));
        for other in [
            "LOCK",
            "0000000000000abc-2a.seg",
            "zzzzzzzzzzzzzzzz-000000000000002a.seg",
            "0000000000000ABC-000000000000002a.seg",
            "+000000000000abc-000000000000002a.seg",
        ] {
            assert_eq!(parse_segment_file_name(other), None, "{other}");
        }
    }

    #[test]
    fn every_name_the_store_writes_is_known() {
        for name in [
            NAMESPACES,
            CHECKPOINT,
            CHECKPOINT_TEMP,
            LOCK,
            PARTITIONS,
            PARTITIONS_TEMP,
            COLD_STATE,
            COLD_STATE_TEMP,
        ] {
            assert!(is_known_file(name), "{name}");
        }
        assert!(is_known_file(&segment_file_name(1, 2)));
        assert!(is_known_file(&cold_file_name(7)));
        assert_eq!(parse_cold_file_name(&cold_file_name(0x7f)), Some(0x7f));
        assert_eq!(
            parse_cold_file_name(&format!("{}.tmp", cold_file_name(7))),
            None
        );
        assert!(is_known_file(&format!("{}.tmp", cold_file_name(7))));
        assert!(!is_known_file("0000000000000007.cold.old"));
        assert!(!is_known_file("notes.txt"));
    }
}
