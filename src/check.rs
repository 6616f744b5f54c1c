//! [`verify`]: a read-only check of every file of a store directory.
//!
//! It decodes what recovery decodes — the `NAMESPACES` file, every segment header and
//! every record with its checksum — with the same codec (`crate::format`) and the same
//! scan (`crate::log::reader`), and reports each problem with its file and offset.
//! Unlike opening the store it changes nothing: it does not cut torn tails, delete
//! expired or empty segments, or rewrite a torn `NAMESPACES` header.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::clock::{Clock, SystemClock};
use crate::error::{Corruption, Error};
use crate::format::record::{self, DecodeError};
use crate::format::{namespace_file, segment_header};
use crate::io::{LOCK_FILE_NAME, OsVfs, SegmentFile, Vfs};
use crate::log::reader;

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
    /// Valid records found.
    pub records: u64,
    /// Bytes of segment files read.
    pub bytes: u64,
    /// Segments whose bucket deadline has passed: the next open deletes them unread.
    pub expired_segments: u64,
    /// Segments that are all zeros (a crash right after creating one): the next open
    /// deletes them.
    pub empty_segments: u64,
    /// Files that are not idemstore's (left alone by the store).
    pub foreign_files: Vec<String>,
    /// Torn tails: a write cut by a crash, with nothing valid after it. Normal after a
    /// crash, not corruption; the next open cuts them. Listed up to
    /// [`VERIFY_LISTED_MAX`].
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
        self.problem_count += 1;
        if self.problems.len() < VERIFY_LISTED_MAX {
            self.problems.push(Corruption {
                file: file.to_path_buf(),
                offset,
                reason: reason.into(),
            });
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
    let dir = dir.as_ref();
    let vfs = OsVfs;
    let names = vfs.list(dir).map_err(|e| Error::io("listing", dir, e))?;
    let _lock = if names.iter().any(|n| n == LOCK_FILE_NAME) {
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

    let mut segments: Vec<(PathBuf, u64, u64)> = Vec::new();
    for name in &names {
        match segment_header::parse_file_name(name) {
            Some((deadline_ms, seq)) => segments.push((dir.join(name), deadline_ms, seq)),
            // The index checkpoint (and its temp name) is not checked: an open uses it
            // only if it matches the segments exactly, and replays them otherwise.
            None if crate::checkpoint::is_known_file(name) => {}
            None => report.foreign_files.push(name.clone()),
        }
    }

    let namespaces_path = dir.join(namespace_file::FILE_NAME);
    let namespace_bytes = vfs
        .read_small(&namespaces_path)
        .map_err(|e| Error::io("reading", &namespaces_path, e))?;
    match namespace_bytes {
        None if !segments.is_empty() => report.problem(
            &namespaces_path,
            0,
            "missing: the segments' records cannot be named",
        ),
        None => {}
        Some(bytes) => match namespace_file::decode(&bytes) {
            Ok(decoded) => {
                report.namespaces = decoded.names.len() as u64;
                if decoded.valid_len < bytes.len() {
                    report.torn_tail(
                        &namespaces_path,
                        decoded.valid_len as u64,
                        "torn namespace entry (a crash while adding a namespace); the next open cuts it",
                    );
                }
            }
            // A header torn while the file was being created: no namespace was added.
            Err(_) if bytes.len() <= namespace_file::HEADER_LEN && segments.is_empty() => {
                report.torn_tail(
                    &namespaces_path,
                    0,
                    "torn header (a crash while creating the store); the next open rewrites it",
                );
            }
            Err((offset, reason)) => report.problem(&namespaces_path, offset as u64, reason),
        },
    }

    let mut files: Vec<(PathBuf, u64, u64, Arc<dyn SegmentFile>)> = Vec::new();
    for (path, deadline_ms, seq) in segments {
        let file = vfs
            .open_segment(&path)
            .map_err(|e| Error::io("opening segment", &path, e))?;
        files.push((path, deadline_ms, seq, file));
    }
    let total: u64 = files.iter().map(|f| f.3.capacity()).sum();
    let now_ms = SystemClock.now().0;
    let mut done = 0u64;
    progress(0, total);
    for (path, deadline_ms, seq, file) in &files {
        let len = file.capacity() as usize;
        let bytes = file.read(0, len);
        report.segments += 1;
        report.bytes += len as u64;
        if *deadline_ms <= now_ms {
            report.expired_segments += 1;
        }
        check_segment(
            &mut report,
            path,
            (*deadline_ms, *seq),
            bytes,
            &mut |checked| progress(done + checked as u64, total),
        );
        done += len as u64;
        progress(done, total);
    }
    Ok(report)
}

/// Checks one segment's header and records.
fn check_segment(
    report: &mut VerifyReport,
    path: &Path,
    (deadline_ms, seq): (u64, u64),
    bytes: &[u8],
    progress: &mut dyn FnMut(usize),
) {
    match segment_header::SegmentHeader::decode(bytes) {
        Ok(header) if header.bucket_deadline_ms == deadline_ms && header.segment_seq == seq => {}
        Ok(header) => {
            report.problem(
                path,
                0,
                format!(
                    "segment header (bucket deadline {}, seq {}) disagrees with the file name",
                    header.bucket_deadline_ms, header.segment_seq
                ),
            );
            return;
        }
        Err(_) if bytes.iter().all(|&b| b == 0) => {
            report.empty_segments += 1;
            return;
        }
        Err(reason) => {
            report.problem(path, 0, reason);
            return;
        }
    }
    let namespaces = report.namespaces;
    let mut unknown_namespace = Vec::new();
    let mut records = 0u64;
    let mut next_progress = PROGRESS_STEP_BYTES;
    let scan = reader::scan(bytes, segment_header::LEN, |offset, record| {
        records += 1;
        if u64::from(record.namespace_id) >= namespaces {
            unknown_namespace.push((offset, record.namespace_id));
        }
        if offset >= next_progress {
            progress(offset);
            next_progress = offset + PROGRESS_STEP_BYTES;
        }
    });
    report.records += records;
    for offset in scan.corrupt_offsets {
        let reason = match record::decode(&bytes[offset..]) {
            Err(DecodeError::Invalid(reason)) => format!("damaged record: {reason}"),
            Err(DecodeError::Truncated) => {
                "damaged record: its length runs past the next valid record".to_string()
            }
            Ok(_) => "damaged record".to_string(),
        };
        report.problem(path, offset as u64, reason);
    }
    for (offset, namespace_id) in unknown_namespace {
        report.problem(
            path,
            offset as u64,
            format!("record names namespace id {namespace_id}, which NAMESPACES does not hold"),
        );
    }
    if scan.torn_tail {
        report.torn_tail(
            path,
            scan.valid_end as u64,
            "torn tail (a write cut by a crash); the next open cuts it",
        );
    }
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
