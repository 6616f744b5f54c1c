//! [`verify`]: a read-only check of every file of a store directory.
//!
//! It reports the survey the open applies (`crate::recovery::survey`): the same
//! classification of every file — foreign, expired, empty, damaged header, live — and
//! of every live segment's records, with each problem's file and offset. So verify
//! reports damage exactly where a strict open refuses, and counts what a lenient open
//! skips and cuts. Unlike opening the store it changes nothing: it does not cut torn
//! tails, delete expired or empty segments, or rewrite a torn `NAMESPACES` header.

use std::path::Path;

use crate::clock::{Clock, SystemClock, UnixMs};
use crate::error::{Corruption, Error};
use crate::format::segment_header::{self, SegmentHeader};
use crate::io::{OsVfs, Vfs};
use crate::log::reader;
use crate::recovery::survey::{self, NamespaceFile, Verdict};

/// Most problems (and torn tails) a report lists; more are only counted.
pub const VERIFY_LISTED_MAX: usize = 1_000;

/// Bytes checked between two progress calls, at most.
const PROGRESS_STEP_BYTES: usize = 4 << 20;

/// What [`verify`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Namespaces in the `NAMESPACES` file.
    pub namespaces: u64,
    /// Segment files checked.
    pub segments: u64,
    /// Cold index files (`memory_budget`) checked, page by page.
    pub cold_files: u64,
    /// Valid records found.
    pub records: u64,
    /// Bytes of segment files read.
    pub bytes: u64,
    /// Segments whose bucket deadline has passed: the next open deletes them unread,
    /// so damage in them is not reported (their valid records count in `records`).
    pub expired_segments: u64,
    /// Segments that are all zeros (a crash right after creating one): the next open
    /// deletes them.
    pub empty_segments: u64,
    /// Files that are not idemstore's, and directories named like a segment (left
    /// alone by the store).
    pub foreign_files: Vec<String>,
    /// Torn tails: a write cut by a crash, with nothing valid after it (in a segment,
    /// or a torn `NAMESPACES` entry or header). Normal after a crash, not corruption;
    /// the next open cuts them. Listed up to [`VERIFY_LISTED_MAX`].
    pub torn_tails: Vec<Corruption>,
    /// Damage: each with its file, offset and reason, up to [`VERIFY_LISTED_MAX`].
    pub problems: Vec<Corruption>,
    /// Every problem found, including those past the listed ones.
    pub problem_count: u64,
}

impl VerifyReport {
    /// `true` if nothing is damaged (torn tails, expired and empty segments are normal).
    pub fn is_clean(&self) -> bool {
        self.problem_count == 0
    }

    fn problem(&mut self, file: &Path, offset: u64, reason: impl Into<String>) {
        self.push_problem(Corruption {
            file: file.to_path_buf(),
            offset,
            reason: reason.into(),
        });
    }

    fn push_problem(&mut self, problem: Corruption) {
        self.problem_count += 1;
        if self.problems.len() < VERIFY_LISTED_MAX {
            self.problems.push(problem);
        }
    }

    fn torn_tail(&mut self, file: &Path, offset: u64, reason: impl Into<String>) {
        if self.torn_tails.len() < VERIFY_LISTED_MAX {
            self.torn_tails.push(Corruption {
                file: file.to_path_buf(),
                offset,
                reason: reason.into(),
            });
        }
    }
}

/// Checks every file of the store in `dir` without changing anything on disk: the
/// `NAMESPACES` file, and every segment's header, records and checksums. Returns what
/// it found (see [`VerifyReport::is_clean`]); `Err` only if it could not look.
///
/// Takes the directory lock while it reads, so it answers `Error::Locked` if a live
/// `Store` (in any process) holds the directory: close that store first. A directory
/// without a `LOCK` file was never opened by a store and is read without one.
pub fn verify(dir: impl AsRef<Path>) -> Result<VerifyReport, Error> {
    verify_with_progress(dir, |_, _| {})
}

/// [`verify`], calling `progress(bytes_checked, bytes_total)` as it goes (for a
/// progress bar).
pub fn verify_with_progress(
    dir: impl AsRef<Path>,
    mut progress: impl FnMut(u64, u64),
) -> Result<VerifyReport, Error> {
    verify_on(&OsVfs, dir.as_ref(), SystemClock.now(), &mut progress)
}

/// [`verify_with_progress`] on any file system, at the time `now` (which decides the
/// expired segments).
pub(crate) fn verify_on(
    vfs: &dyn Vfs,
    dir: &Path,
    now: UnixMs,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<VerifyReport, Error> {
    let names = vfs.list(dir).map_err(|e| Error::io("listing", dir, e))?;
    let _lock = if names.iter().any(|n| n == crate::layout::LOCK) {
        Some(
            vfs.try_lock_dir(dir)
                .map_err(|e| Error::io("locking directory", dir, e))?
                .ok_or_else(|| Error::Locked {
                    path: dir.to_path_buf(),
                })?,
        )
    } else {
        None
    };
    let mut report = VerifyReport::default();

    let namespaces_path = dir.join(crate::layout::NAMESPACES);
    let namespace_bytes = vfs
        .read_small(&namespaces_path)
        .map_err(|e| Error::io("reading", &namespaces_path, e))?;
    let namespaces = survey::namespace_file(namespace_bytes.as_deref());
    report.namespaces = namespaces.count() as u64;
    match namespaces {
        // Records then name namespaces it does not hold: each is reported below.
        NamespaceFile::Missing => {}
        NamespaceFile::TornHeader => report.torn_tail(
            &namespaces_path,
            0,
            "torn header (a crash while creating the store); the next open rewrites it",
        ),
        NamespaceFile::Decoded { decoded, torn_tail } => {
            if torn_tail {
                report.torn_tail(
                    &namespaces_path,
                    decoded.valid_len as u64,
                    "torn namespace entry (a crash while adding a namespace); the next open cuts it",
                );
            }
        }
        NamespaceFile::Damaged { offset, reason } => {
            report.problem(&namespaces_path, offset as u64, reason);
        }
    }

    // The index checkpoint (and its temp name) is not checked: an open uses it only if
    // it matches the segments exactly, and replays them otherwise.
    let survey = survey::survey(vfs, dir, &names, now.0)?;
    report.foreign_files = survey.foreign.clone();
    let total: u64 = survey.segments.iter().map(|s| s.file.capacity()).sum();
    let mut done = 0u64;
    progress(0, total);
    for segment in &survey.segments {
        let len = segment.file.capacity() as usize;
        let bytes = match &segment.verdict {
            // Walked below: asked for ahead (the map is for random reads).
            Verdict::Expired | Verdict::Live(_) => segment.file.read_for_walk(0, len),
            Verdict::Empty | Verdict::Damaged(_) => segment.file.read(0, len),
        };
        report.segments += 1;
        report.bytes += bytes.len() as u64;
        match &segment.verdict {
            Verdict::Expired => {
                report.expired_segments += 1;
                // Deleted unread at the next open, so its damage does not matter; its
                // valid records are still counted.
                if SegmentHeader::decode(bytes).is_ok() {
                    reader::scan(bytes, segment_header::LEN, |_, _| report.records += 1);
                }
            }
            Verdict::Empty => report.empty_segments += 1,
            Verdict::Damaged(damage) => report.push_problem(damage.clone()),
            Verdict::Live(_) => {
                let mut next_progress = PROGRESS_STEP_BYTES;
                let records = survey::scan_records(
                    bytes,
                    segment_header::LEN,
                    report.namespaces as usize,
                    |offset, _| {
                        if offset >= next_progress {
                            progress(done + offset as u64, total);
                            next_progress = offset + PROGRESS_STEP_BYTES;
                        }
                    },
                );
                report.records += records.valid_records();
                for finding in records.findings(&segment.path, bytes) {
                    report.push_problem(finding.damage);
                }
                if records.scan.torn_tail {
                    report.torn_tail(
                        &segment.path,
                        records.scan.valid_end as u64,
                        "torn tail (a write cut by a crash); the next open cuts it",
                    );
                }
            }
        }
        done += bytes.len() as u64;
        progress(done, total);
    }
    for name in names
        .iter()
        .filter(|n| crate::layout::parse_cold_file_name(n).is_some())
    {
        verify_cold_file(vfs, &dir.join(name), &mut report)?;
    }
    Ok(report)
}

/// Checks one cold index file whole, a page at a time: its header, its sections, every
/// page's checksum and order, and that the filter holds every entry (a filter that
/// misses one would take a duplicate for a fresh key). Damage here loses nothing (the
/// log holds every record): the next open that cannot use the file rebuilds from it.
fn verify_cold_file(vfs: &dyn Vfs, path: &Path, report: &mut VerifyReport) -> Result<(), Error> {
    use crate::format::cold_index::{self, PAGE_LEN};
    const REBUILT: &str = "; the log holds its keys: an open without COLD_STATE rebuilds them";
    let file = crate::cold::open_generation_file(vfs, path)?;
    report.cold_files += 1;
    report.bytes += file.capacity();
    let (header, _, sections) = match crate::cold::read_head(file.as_ref()) {
        Ok(head) => head,
        Err((at, reason)) => {
            report.problem(path, at, format!("{reason}{REBUILT}"));
            return Ok(());
        }
    };
    let mut entries = Vec::new();
    for page in 0..header.page_count {
        let at = header.page_offset(page);
        crate::cold::read_pages_ahead(file.as_ref(), page, at);
        entries.clear();
        let decoded = cold_index::decode_page(
            &header,
            &sections,
            page,
            file.read(at, PAGE_LEN),
            &mut entries,
        );
        if let Err(e) = decoded {
            report.problem(path, at, format!("{}{REBUILT}", e.reason()));
        } else if entries.iter().any(|e| match e.trusted() {
            false => !sections.filter.may_contain(e.key_hash),
            true => !sections.trusted.may_contain(e.key_hash),
        }) {
            report.problem(
                path,
                at,
                format!("cold index filter misses an entry of this page{REBUILT}"),
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_directory_is_clean_and_stays_empty() {
        let dir = tempfile::tempdir().unwrap();
        let report = verify(dir.path()).unwrap();
        assert!(report.is_clean());
        assert_eq!(report.segments, 0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_missing_directory_is_an_io_error() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        assert!(matches!(verify(&missing), Err(Error::Io { .. })));
        assert!(!missing.exists());
    }
}
