//! The survey: what a store directory holds and what recovery does with each file, as
//! a value. The open (`recovery::recover`) applies it and `idemstore verify`
//! (`crate::check`) reports it, so the two can never disagree.
//!
//! Nothing here changes the directory: files are opened and read through the `Vfs`,
//! never written, deleted, trimmed or synced. The caller passes the listing and the
//! time, so the survey of a given image at a given instant is always the same.
//!
//! Per file ([`survey`]):
//! - a name idemstore does not write, or a directory named like a segment: foreign,
//!   counted and left alone;
//! - `NAMESPACES` ([`namespace_file`]): missing, a torn header (rewritten at open), a
//!   torn entry (cut at open), or damaged (the open refuses);
//! - a segment whose bucket deadline has passed: expired, deleted unread;
//! - a segment of zeros only (a crash right after creating it): empty, deleted;
//! - a segment whose header is damaged or disagrees with its name: skipped, counted as
//!   one corrupt record (refused in strict mode);
//! - any other segment: live, its records replayed.
//!
//! Per live segment ([`scan_records`], run by the replay itself so the log is read
//! once): records naming a namespace `NAMESPACES` does not hold (the open refuses even
//! without strict mode), damaged records that valid ones follow (skipped and counted,
//! refused in strict mode), and a torn tail (cut: the segment ends where the valid
//! records do).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::addr::Lsn;
use crate::error::{Corruption, Error};
use crate::format::namespace_file;
use crate::format::record::{self, DecodeError, StoredRecord};
use crate::format::segment_header::SegmentHeader;
use crate::io::{SegmentFile, Vfs};
use crate::log::reader;

/// What the `NAMESPACES` file holds, and what the open does about it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NamespaceFile {
    /// No file: the open creates it; no namespace exists yet.
    Missing,
    /// Shorter than its header, or a header-long file that does not decode: a crash
    /// while the store was being created, before any namespace was added. The open
    /// writes the header again; no namespace exists yet.
    TornHeader,
    /// Decoded. With `torn_tail`, bytes after `decoded.valid_len` are a namespace entry
    /// torn by a crash (never used): the open cuts them once recovery has accepted the
    /// directory.
    Decoded {
        decoded: namespace_file::Decoded,
        torn_tail: bool,
    },
    /// Damaged before its end: the open refuses (the ids records carry cannot be named).
    Damaged { offset: usize, reason: String },
}

impl NamespaceFile {
    /// Namespaces it holds (none unless decoded).
    pub(crate) fn count(&self) -> usize {
        match self {
            NamespaceFile::Decoded { decoded, .. } => decoded.names.len(),
            _ => 0,
        }
    }
}

/// Classifies the content of `NAMESPACES` (`None`: there is no such file). Never panics.
pub(crate) fn namespace_file(bytes: Option<&[u8]>) -> NamespaceFile {
    let Some(bytes) = bytes else {
        return NamespaceFile::Missing;
    };
    match namespace_file::decode(bytes) {
        Ok(decoded) if decoded.valid_len < namespace_file::HEADER_LEN => NamespaceFile::TornHeader,
        Ok(decoded) => NamespaceFile::Decoded {
            torn_tail: bytes.len() > decoded.valid_len,
            decoded,
        },
        Err(_) if bytes.len() <= namespace_file::HEADER_LEN => NamespaceFile::TornHeader,
        Err((offset, reason)) => NamespaceFile::Damaged { offset, reason },
    }
}

/// A directory: every file classified.
pub(crate) struct Survey {
    /// Names idemstore does not write, and directories named like a segment: counted,
    /// never opened, changed or deleted.
    pub foreign: Vec<String>,
    /// Every file named like a segment, in listing order.
    pub segments: Vec<SurveyedSegment>,
    /// The highest seq any segment name carries (0 if none): new segments are numbered
    /// after it, so no name is ever reused.
    pub max_seq: u64,
}

/// A file named like a segment.
pub(crate) struct SurveyedSegment {
    pub path: PathBuf,
    /// The file, mapped at its length.
    pub file: Arc<dyn SegmentFile>,
    pub verdict: Verdict,
}

/// What recovery does with one segment file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its bucket deadline has passed: deleted unread (every key in it has expired).
    Expired,
    /// Zeros only: created, then a crash before its header reached the disk. Never
    /// used, so deleted.
    Empty,
    /// Its header is damaged or disagrees with its name: skipped whole, counted as one
    /// corrupt record; refused in strict mode.
    Damaged(Corruption),
    /// Replayed: its records go to the index (see [`scan_records`]).
    Live(SegmentHeader),
}

/// Surveys the files `names` (the listing of `dir`) at `now_ms`. `Err` only if a file
/// named like a segment could not be opened.
pub(crate) fn survey(
    vfs: &dyn Vfs,
    dir: &Path,
    names: &[String],
    now_ms: u64,
) -> Result<Survey, Error> {
    let mut survey = Survey {
        foreign: Vec::new(),
        segments: Vec::new(),
        max_seq: 0,
    };
    let mut named = Vec::new();
    for name in names {
        if !crate::layout::is_known_file(name) {
            survey.foreign.push(name.clone());
            continue;
        }
        let Some((deadline_ms, seq)) = crate::layout::parse_segment_file_name(name) else {
            continue;
        };
        survey.max_seq = survey.max_seq.max(seq);
        named.push((name, deadline_ms, seq));
    }
    // Each file's open and header read is a disk read when the page cache does not hold
    // it (after a crash at 500M keys: 1,474 files, 1.8 s one at a time), so a large
    // directory is surveyed by several threads, each a contiguous share of the names.
    let threads = match named.len() {
        n if n >= SURVEY_PARALLEL_FROM => SURVEY_THREADS,
        _ => 1,
    };
    let share = named.len().div_ceil(threads).max(1);
    let opened: Vec<Result<Option<SurveyedSegment>, Error>> = std::thread::scope(|scope| {
        let workers: Vec<_> = named
            .chunks(share)
            .map(|chunk| {
                scope.spawn(move || {
                    chunk
                        .iter()
                        .map(|&(name, deadline_ms, seq)| {
                            open_segment(vfs, dir, name, (deadline_ms, seq), now_ms)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a survey thread panicked"))
            .collect()
    });
    for ((name, ..), opened) in named.iter().zip(opened) {
        match opened? {
            Some(segment) => survey.segments.push(segment),
            None => survey.foreign.push((*name).clone()),
        }
    }
    Ok(survey)
}

/// From this many files named like segments, the survey runs on [`SURVEY_THREADS`].
const SURVEY_PARALLEL_FROM: usize = 64;
/// Threads of a large survey: its work is waiting for the disk, not the cores.
const SURVEY_THREADS: usize = 8;

/// Opens one file named like a segment and gives its verdict; `None` for a directory
/// (a foreign file).
fn open_segment(
    vfs: &dyn Vfs,
    dir: &Path,
    name: &str,
    (deadline_ms, seq): (u64, u64),
    now_ms: u64,
) -> Result<Option<SurveyedSegment>, Error> {
    let path = dir.join(name);
    let file = match vfs.open_segment(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::IsADirectory => return Ok(None),
        Err(e) => return Err(Error::io("opening segment", &path, e)),
    };
    let verdict = if deadline_ms <= now_ms {
        Verdict::Expired
    } else {
        let bytes = file.read(0, file.capacity() as usize);
        segment_verdict(&path, (deadline_ms, seq), bytes)
    };
    Ok(Some(SurveyedSegment {
        path,
        file,
        verdict,
    }))
}

/// The verdict on a segment that has not expired, from its bytes.
fn segment_verdict(path: &Path, (deadline_ms, seq): (u64, u64), bytes: &[u8]) -> Verdict {
    let damaged = |reason: String| {
        Verdict::Damaged(Corruption {
            file: path.to_path_buf(),
            offset: 0,
            reason,
        })
    };
    match SegmentHeader::decode(bytes) {
        Ok(header) if header.bucket_deadline_ms == deadline_ms && header.segment_seq == seq => {
            Verdict::Live(header)
        }
        Ok(header) => damaged(format!(
            "segment header (bucket deadline {}, seq {}) disagrees with the file name",
            header.bucket_deadline_ms, header.segment_seq
        )),
        Err(_) if bytes.iter().all(|&b| b == 0) => Verdict::Empty,
        Err(reason) => damaged(reason),
    }
}

/// What the records of one live segment hold.
#[derive(Debug, Default, Clone)]
pub(crate) struct RecordSurvey {
    /// Valid records naming a namespace `NAMESPACES` holds: replayed.
    pub records: u64,
    /// The highest lsn among them.
    pub max_lsn: Lsn,
    /// Offsets of valid records naming a namespace id `NAMESPACES` does not hold, with
    /// that id: the open refuses, even without strict mode (the next namespace created
    /// would take the id and inherit the records).
    pub unknown_namespace: Vec<(usize, u32)>,
    /// Damage, where the valid records end and whether a torn tail follows them.
    pub scan: reader::ScanReport,
    /// The highest source offset of each partition `(namespace id, partition)` among
    /// them (partition-scoped records that carry one).
    pub highest_offsets: HashMap<(u32, u32), u64>,
}

impl RecordSurvey {
    /// Every problem found, in the order the open meets them: damaged records
    /// (skipped and counted, refused in strict mode), then records of unknown
    /// namespaces (refused always).
    pub(crate) fn findings(&self, path: &Path, bytes: &[u8]) -> Vec<Finding> {
        let damaged = self.scan.corrupt_offsets.iter().map(|&offset| {
            let reason = match record::decode(&bytes[offset..]) {
                Err(DecodeError::Invalid(reason)) => format!("damaged record: {reason}"),
                Err(DecodeError::Truncated) => {
                    "damaged record: its length runs past the next valid record".to_string()
                }
                Ok(_) => "damaged record".to_string(),
            };
            Finding::new(path, offset, reason, false)
        });
        let unknown = self.unknown_namespace.iter().map(|&(offset, id)| {
            let reason = format!(
                "record names namespace id {id}, which NAMESPACES does not hold: NAMESPACES \
                 is missing or lost entries; restore it from a backup, or move the segment \
                 files away to start empty"
            );
            Finding::new(path, offset, reason, true)
        });
        damaged.chain(unknown).collect()
    }

    /// Valid records, including those of unknown namespaces.
    pub(crate) fn valid_records(&self) -> u64 {
        self.records + self.unknown_namespace.len() as u64
    }
}

/// A problem in a live segment's records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Finding {
    pub damage: Corruption,
    /// The open refuses even without strict mode.
    pub always_refused: bool,
}

impl Finding {
    fn new(path: &Path, offset: usize, reason: String, always_refused: bool) -> Finding {
        Finding {
            damage: Corruption {
                file: path.to_path_buf(),
                offset: offset as u64,
                reason,
            },
            always_refused,
        }
    }
}

/// Scans a live segment's records from offset `from` (a record boundary: the end of the
/// header, or of the records a spill walked; `bytes` is the whole file), calling
/// `each(offset, record)` for every valid record of a known namespace: the ones the
/// open replays. Never panics.
pub(crate) fn scan_records<'a>(
    bytes: &'a [u8],
    from: usize,
    namespace_count: usize,
    mut each: impl FnMut(usize, &StoredRecord<'a>),
) -> RecordSurvey {
    let mut survey = RecordSurvey::default();
    // The partition of the last scoped record and its highest offset so far: runs of
    // one partition's records update no map.
    let mut run: Option<((u32, u32), u64)> = None;
    let offsets = &mut survey.highest_offsets;
    survey.scan = reader::scan(bytes, from, |offset, record| {
        if record.namespace_id as usize >= namespace_count {
            survey.unknown_namespace.push((offset, record.namespace_id));
            return;
        }
        survey.records += 1;
        survey.max_lsn = survey.max_lsn.max(record.lsn);
        if let (Some(partition), Some(source)) =
            (record.placement.partition, record.placement.offset)
        {
            let key = (record.namespace_id, partition);
            match &mut run {
                Some((k, highest)) if *k == key => *highest = (*highest).max(source),
                _ => {
                    if let Some((k, highest)) = run.replace((key, source)) {
                        note_offset(offsets, k, highest);
                    }
                }
            }
        }
        each(offset, &record);
    });
    if let Some((k, highest)) = run {
        note_offset(&mut survey.highest_offsets, k, highest);
    }
    survey
}

fn note_offset(offsets: &mut HashMap<(u32, u32), u64>, key: (u32, u32), offset: u64) {
    let highest = offsets.entry(key).or_insert(offset);
    *highest = (*highest).max(offset);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::record::{ClaimFields, State};
    use crate::format::segment_header;

    fn mark(namespace_id: u32, lsn: u64) -> Vec<u8> {
        StoredRecord {
            state: State::Seen,
            namespace_id,
            placement: Default::default(),
            lsn: Lsn(lsn),
            first_seen_ms: 1,
            id: b"key",
            claim: ClaimFields::default(),
            result: None,
        }
        .encode()
    }

    #[test]
    fn namespaces_file_classes() {
        assert_eq!(namespace_file(None), NamespaceFile::Missing);
        assert_eq!(namespace_file(Some(&[])), NamespaceFile::TornHeader);
        assert_eq!(namespace_file(Some(b"IDEM")), NamespaceFile::TornHeader);
        assert_eq!(namespace_file(Some(&[7; 16])), NamespaceFile::TornHeader);
        let mut bytes = namespace_file::encode_header().to_vec();
        bytes.extend(namespace_file::encode_entry(0, "a"));
        let whole = namespace_file(Some(&bytes));
        assert_eq!(whole.count(), 1);
        assert!(matches!(
            whole,
            NamespaceFile::Decoded {
                torn_tail: false,
                ..
            }
        ));
        bytes.extend(&namespace_file::encode_entry(1, "b")[..5]);
        assert!(matches!(
            namespace_file(Some(&bytes)),
            NamespaceFile::Decoded {
                torn_tail: true,
                ..
            }
        ));
        bytes[0] ^= 1;
        assert!(matches!(
            namespace_file(Some(&bytes)),
            NamespaceFile::Damaged { offset: 0, .. }
        ));
    }

    #[test]
    fn segment_verdicts() {
        let path = Path::new("s");
        let header = SegmentHeader {
            version: crate::format::segment_header::VERSION,
            bucket_deadline_ms: 10,
            segment_seq: 3,
            created_ms: 1,
            bucket_width_ms: 5,
        };
        let bytes = header.encode();
        assert_eq!(
            segment_verdict(path, (10, 3), &bytes),
            Verdict::Live(header)
        );
        assert!(matches!(
            segment_verdict(path, (10, 4), &bytes),
            Verdict::Damaged(c) if c.reason.contains("disagrees")
        ));
        assert_eq!(segment_verdict(path, (10, 3), &[0; 100]), Verdict::Empty);
        assert_eq!(segment_verdict(path, (10, 3), &[]), Verdict::Empty);
        let mut torn = bytes.to_vec();
        torn[60] ^= 1;
        assert!(matches!(
            segment_verdict(path, (10, 3), &torn),
            Verdict::Damaged(c) if c.offset == 0
        ));
    }

    #[test]
    fn records_of_unknown_namespaces_are_found_and_not_replayed() {
        let mut bytes = vec![0u8; segment_header::LEN];
        let first = mark(0, 1);
        let second = mark(2, 2);
        bytes.extend(&first);
        bytes.extend(&second);
        bytes.extend(mark(1, 3));
        let mut replayed = Vec::new();
        let survey = scan_records(&bytes, segment_header::LEN, 2, |_, r| {
            replayed.push(r.lsn.0)
        });
        assert_eq!(replayed, vec![1, 3]);
        assert_eq!((survey.records, survey.max_lsn), (2, Lsn(3)));
        let at = segment_header::LEN + first.len();
        assert_eq!(survey.unknown_namespace, vec![(at, 2)]);
        assert_eq!(survey.valid_records(), 3);
        let findings = survey.findings(Path::new("s"), &bytes);
        assert_eq!(findings.len(), 1);
        assert!(findings[0].always_refused);
        assert_eq!(findings[0].damage.offset, at as u64);
    }

    #[test]
    fn a_damaged_record_is_a_finding_refused_only_in_strict_mode() {
        let mut bytes = vec![0u8; segment_header::LEN];
        let first = mark(0, 1);
        bytes.extend(&first);
        bytes.extend(mark(0, 2));
        bytes[segment_header::LEN + 10] ^= 0xff;
        let survey = scan_records(&bytes, segment_header::LEN, 1, |_, _| {});
        let findings = survey.findings(Path::new("s"), &bytes);
        assert_eq!(findings.len(), 1);
        assert!(!findings[0].always_refused);
        assert_eq!(findings[0].damage.offset, segment_header::LEN as u64);
        assert!(
            findings[0].damage.reason.starts_with("damaged record"),
            "{}",
            findings[0].damage.reason
        );
    }
}
