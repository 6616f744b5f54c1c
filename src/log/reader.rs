//! Reading a segment's records back: the scan shared by recovery, the reaper and
//! `verify`. Pure over bytes; never panics, whatever they hold.

use crate::format::record::{self, StoredRecord};

/// What a scan found besides the records.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ScanReport {
    /// End of the last valid record.
    pub valid_end: usize,
    /// Offsets where a damaged region starts that valid records follow.
    pub corrupt_offsets: Vec<usize>,
    /// Bytes after `valid_end` that are neither records nor zeros: a torn tail.
    pub torn_tail: bool,
}

/// Calls `each(offset, record)` for every valid record in `bytes[start..]`.
///
/// A region that fails to decode is a torn tail if no valid record follows it
/// (cut silently), the clean end if only zeros follow (preallocated space), and
/// corruption otherwise: the scan resynchronizes on the next valid record, so a
/// damaged record never hides the valid ones after it.
pub(crate) fn scan<'a>(
    bytes: &'a [u8],
    start: usize,
    mut each: impl FnMut(usize, StoredRecord<'a>),
) -> ScanReport {
    let mut report = ScanReport {
        valid_end: start.min(bytes.len()),
        ..ScanReport::default()
    };
    let mut at = start;
    while at < bytes.len() {
        match record::decode(&bytes[at..]) {
            Ok((record, len)) => {
                each(at, record);
                at += len;
                report.valid_end = at;
            }
            Err(_) => {
                if bytes[at..].iter().all(|&b| b == 0) {
                    break;
                }
                match next_valid(bytes, at + 1) {
                    #[cfg(feature = "planted-bugs")]
                    Some(_) if crate::planted::planted("eager-torn-tail") => {
                        report.torn_tail = true;
                        break;
                    }
                    Some(next) => {
                        report.corrupt_offsets.push(at);
                        at = next;
                    }
                    None => {
                        report.torn_tail = true;
                        break;
                    }
                }
            }
        }
    }
    report
}

/// The first offset at or after `from` where a valid record starts.
fn next_valid(bytes: &[u8], from: usize) -> Option<usize> {
    const KIND_OFFSET: usize = 4;
    (from..bytes.len().saturating_sub(record::HEADER_LEN - 1)).find(|&at| {
        record::is_kind(bytes[at + KIND_OFFSET]) && record::decode(&bytes[at..]).is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::record::{ClaimFields, State};

    fn mark(lsn: u64, id: &[u8]) -> Vec<u8> {
        StoredRecord {
            state: State::Seen,
            namespace_id: 0,
            placement: record::Placement::UNSCOPED,
            lsn: crate::addr::Lsn(lsn),
            first_seen_ms: 1,
            id,
            claim: ClaimFields::default(),
            result: None,
        }
        .encode()
    }

    fn lsns(bytes: &[u8]) -> (Vec<u64>, ScanReport) {
        let mut seen = Vec::new();
        let report = scan(bytes, 0, |_, r| seen.push(r.lsn.0));
        (seen, report)
    }

    #[test]
    fn zeros_after_the_records_are_a_clean_end() {
        let mut log = [mark(1, b"a"), mark(2, b"b")].concat();
        let end = log.len();
        log.extend([0u8; 100]);
        let (seen, report) = lsns(&log);
        assert_eq!(seen, vec![1, 2]);
        assert_eq!(
            report,
            ScanReport {
                valid_end: end,
                corrupt_offsets: vec![],
                torn_tail: false
            }
        );
    }

    #[test]
    fn a_torn_last_record_is_cut() {
        let log = [mark(1, b"a"), mark(2, b"bbbbbbbb")].concat();
        let first = mark(1, b"a").len();
        for cut in first + 1..log.len() {
            let (seen, report) = lsns(&log[..cut]);
            assert_eq!(seen, vec![1], "cut at {cut}");
            assert_eq!(report.valid_end, first);
            assert!(report.torn_tail);
            assert!(report.corrupt_offsets.is_empty());
        }
    }

    #[test]
    fn a_damaged_record_in_the_middle_is_skipped_and_the_rest_kept() {
        let mut log = [mark(1, b"a"), mark(2, b"b"), mark(3, b"c")].concat();
        let second = mark(1, b"a").len();
        log[second + 10] ^= 0xff;
        let (seen, report) = lsns(&log);
        assert_eq!(seen, vec![1, 3]);
        assert_eq!(report.corrupt_offsets, vec![second]);
        assert_eq!(report.valid_end, log.len());
    }
}
