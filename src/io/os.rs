//! The real backend: files, `mmap`, `fallocate`, `fdatasync`, `flock`.

use std::fs::{self, File, OpenOptions, TryLockError};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};

use super::{AppendFile, DirLock, SegmentFile, Vfs};

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct OsVfs;

impl Vfs for OsVfs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn try_lock_dir(&self, dir: &Path) -> io::Result<Option<DirLock>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(dir.join(crate::layout::LOCK))?;
        // flock: held per open file description, so a second open in this process
        // conflicts too; released by the kernel when the holder dies.
        match file.try_lock() {
            Ok(()) => Ok(Some(Box::new(HeldLock(file)))),
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(e)) => Err(e),
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            if let Ok(name) = entry.file_name().into_string() {
                names.push(name);
            }
        }
        names.sort();
        Ok(names)
    }

    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match fs::read(path) {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn AppendFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        Ok(Box::new(OsAppendFile { file }))
    }

    fn create_segment(&self, path: &Path, capacity: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)?;
        // The file starts empty and grows as `allocate` reserves blocks; only the
        // mapping is `capacity` long. Pages past the end of the file are never touched
        // (writes stay inside what was allocated), and after a crash recovery reads no
        // more than one allocation step of unused space.
        //
        // Reads of a segment are one record at a time in no order (a duplicate's check)
        // or walks that ask for their pages ahead (`read_for_walk`): a fault on a page
        // the page cache lacks reads that page alone, never the device's whole
        // read-ahead window around it (8 MiB on this VM, which made each check of a
        // cold duplicate at a billion keys cost milliseconds, and at open made 1,474
        // segment headers cost 4.8 s). Writes fault nothing in: their blocks are
        // allocated unwritten and `prepare_write` maps them.
        let mapped = OsSegmentFile::map_len(file, capacity)?;
        mapped.read_randomly();
        Ok(Arc::new(mapped) as Arc<dyn SegmentFile>)
    }

    fn open_segment(&self, path: &Path) -> io::Result<Arc<dyn SegmentFile>> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let mapped = OsSegmentFile::map(file)?;
        // As in `create_segment`: an open reads only the header page of every file it
        // surveys, and replay walks ask for their pages ahead.
        mapped.read_randomly();
        Ok(Arc::new(mapped) as Arc<dyn SegmentFile>)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn read_file(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        self.read_small(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }
}

/// The directory lock. Dropping it unlocks explicitly: closing the descriptor alone is
/// not enough when a child process forked by another thread still holds a duplicate of
/// it until its `exec`, and a reopen right after `close` would then see `Locked`.
struct HeldLock(File);

impl Drop for HeldLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

struct OsAppendFile {
    file: File,
}

impl AppendFile for OsAppendFile {
    fn set_len(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        self.file.write_all_at(bytes, offset)
    }
    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}

struct OsSegmentFile {
    file: File,
    /// `None` for an empty file (nothing to map).
    map: Option<MmapRaw>,
    capacity: u64,
}

impl OsSegmentFile {
    fn map(file: File) -> io::Result<OsSegmentFile> {
        let len = file.metadata()?.len();
        OsSegmentFile::map_len(file, len)
    }

    fn map_len(file: File, capacity: u64) -> io::Result<OsSegmentFile> {
        let len =
            usize::try_from(capacity).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let map = if len == 0 {
            None
        } else {
            Some(MmapOptions::new().len(len).map_raw(&file)?)
        };
        Ok(OsSegmentFile {
            file,
            map,
            capacity,
        })
    }

    /// Maps the pages of `offset..offset + len` writable now, in one call, so that
    /// appends do not take a page fault per page while holding the segment's append
    /// lock. Best effort: an old kernel without `MADV_POPULATE_WRITE` faults lazily.
    ///
    /// A write fault on a shared file mapping marks the page dirty: the next sync
    /// writes the prefaulted pages (zeros) too. So only a small window ahead of the
    /// appends is prefaulted, never a whole reserved step.
    fn prefault(&self, offset: u64, len: u64) {
        // Every page the range touches (the first one may hold published records:
        // populating it writes nothing).
        let page = page_size();
        let start = offset / page * page;
        let end = offset.saturating_add(len).min(self.capacity);
        // MADV_POPULATE_WRITE only faults the pages in, writing nothing (the file's
        // bytes there are already allocated).
        self.advise(start, end, libc::MADV_POPULATE_WRITE);
    }

    /// Advises the whole map for random reads (`MADV_RANDOM`, its last partial page
    /// too: the kernel rounds the length up); see `Vfs::open_segment`.
    fn read_randomly(&self) {
        self.advise(0, self.capacity, libc::MADV_RANDOM);
    }

    /// Unmaps the whole pages inside `offset..offset + len` (`MADV_DONTNEED` on a
    /// shared file mapping drops only the page-table entries; dirty data stays in the
    /// page cache and is written back as usual, and any later access faults them back
    /// in). No byte of the range may still be written: the caller passes published,
    /// never-rewritten bytes; a concurrent reader merely takes a page fault.
    fn unmap_pages(&self, offset: u64, len: u64) {
        let page = page_size();
        let start = offset.next_multiple_of(page);
        let end = offset.saturating_add(len).min(self.capacity) / page * page;
        self.advise(start, end, libc::MADV_DONTNEED);
    }

    /// `madvise(advice)` on `start..end` of the mapping; `start` is page-aligned and
    /// `end <= capacity`. Best effort: a failure is traced, nothing more.
    fn advise(&self, start: u64, end: u64, advice: libc::c_int) {
        let Some(map) = &self.map else { return };
        if end <= start {
            return;
        }
        debug_assert!(start.is_multiple_of(page_size()) && end <= self.capacity);
        // SAFETY: start..end lies inside the mapping (end <= capacity, the mapping's
        // length) and start is page-aligned. The advices used keep the file's bytes as
        // they are (see `prefault` and `unmap_pages`; `MADV_RANDOM` only turns read-
        // ahead off for the range, `MADV_WILLNEED` only starts reading it into the
        // page cache).
        let rc = unsafe {
            libc::madvise(
                map.as_mut_ptr().add(start as usize).cast(),
                (end - start) as usize,
                advice,
            )
        };
        if rc != 0 {
            tracing::trace!(advice, error = %io::Error::last_os_error(), "madvise failed");
        }
    }

    fn check_range(&self, offset: u64, len: usize) -> *mut u8 {
        let end = offset.checked_add(len as u64);
        assert!(
            end.is_some_and(|end| end <= self.capacity),
            "segment access {offset}+{len} outside the map of {} bytes",
            self.capacity
        );
        match &self.map {
            // SAFETY: offset + len <= capacity == the mapping's length, checked above.
            Some(map) => unsafe { map.as_mut_ptr().add(offset as usize) },
            None => std::ptr::NonNull::dangling().as_ptr(),
        }
    }
}

/// The system's page size.
fn page_size() -> u64 {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf has no memory-safety preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        u64::try_from(size).ok().filter(|&s| s > 0).unwrap_or(4096)
    })
}

/// How far past the end of an append the next cache line is prefetched.
#[cfg(target_arch = "x86_64")]
const PREFETCH_AHEAD: usize = 128;

impl SegmentFile for OsSegmentFile {
    fn capacity(&self) -> u64 {
        self.capacity
    }

    fn read(&self, offset: u64, len: usize) -> &[u8] {
        let ptr = self.check_range(offset, len);
        // SAFETY: the range is inside the mapping, which lives as long as `self`; by the
        // trait contract it is published and never written again, so no write aliases it.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    fn write_with(&self, offset: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        let ptr = self.check_range(offset, len);
        // SAFETY: the range is inside the mapping; by the trait contract the caller holds
        // the append lock and the range is unpublished, so nobody else reads or writes it
        // while this exclusive slice lives.
        fill(unsafe { std::slice::from_raw_parts_mut(ptr, len) });
        // The next records go right after this one: ask for their cache line now, so
        // the next append does not stall on a cold line of the page cache.
        #[cfg(target_arch = "x86_64")]
        if offset + (len + PREFETCH_AHEAD) as u64 <= self.capacity() {
            // SAFETY: a prefetch is only a hint and never faults; the address is inside
            // the mapping (checked above).
            unsafe {
                use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
                _mm_prefetch::<_MM_HINT_T0>(ptr.add(len + PREFETCH_AHEAD).cast::<i8>());
            }
        }
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(len_i)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        };
        // SAFETY: fallocate on a file descriptor we own; no memory is passed.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, off, len_i) };
        if rc != 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
                return Err(err);
            }
            // A file system without fallocate: write zeros to get the blocks.
            let zeros = vec![0u8; len as usize];
            self.file.write_all_at(&zeros, offset)?;
        }
        Ok(())
    }

    fn prepare_write(&self, offset: u64, len: u64) {
        self.prefault(offset, len);
    }

    fn release_written(&self, offset: u64, len: u64) {
        self.unmap_pages(offset, len);
    }

    fn read_soon(&self, offset: u64, len: u64) {
        // The kernel reads at most the larger of the device's read-ahead window and its
        // largest request per call (8 MiB here; 128 KiB to 1 MiB on common defaults)
        // and drops the rest of the range: ask in steps below that. Each call only
        // starts the reads.
        const STEP: u64 = 256 << 10;
        if len == 0 {
            return;
        }
        let mut start = offset / page_size() * page_size();
        let end = offset.saturating_add(len).min(self.capacity);
        while start < end {
            self.advise(start, end.min(start + STEP), libc::MADV_WILLNEED);
            start += STEP;
        }
    }

    fn start_writeback(&self) {
        // SAFETY: sync_file_range on a file descriptor we own; no memory is passed.
        // Best effort: an error here shows again in the fdatasync that follows.
        let _ = unsafe {
            libc::sync_file_range(self.file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE)
        };
    }

    fn sync_data(&self) -> io::Result<()> {
        // On Linux the page cache is unified: fdatasync writes back pages dirtied
        // through the shared mapping as well as the allocation metadata.
        self.file.sync_data()
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The read hints change no byte and stay inside the map, whatever range they get.
    #[test]
    fn read_hints_keep_the_bytes_and_the_bounds() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..3 * page_size() + 100)
            .map(|i| (i % 251) as u8)
            .collect();
        std::fs::write(&path, &bytes).unwrap();
        let file = OsVfs.open_segment(&path).unwrap();
        for (offset, len) in [
            (0, u64::MAX),
            (1, 10),
            (page_size() + 7, 3 * page_size()),
            (u64::MAX, 1),
        ] {
            file.read_soon(offset, len);
        }
        assert_eq!(file.read(0, bytes.len()), &bytes[..]);
        // A walk from anywhere, past the end too, reads the same bytes from 0.
        for from in [0, 1, page_size() as usize + 3, bytes.len(), bytes.len() + 9] {
            assert_eq!(file.read_for_walk(from, bytes.len()), &bytes[..]);
        }
        // A segment created here (mapped for random reads from the start) is written
        // through its map and read back.
        let created = OsVfs
            .create_segment(&dir.path().join("new"), 4 * page_size())
            .unwrap();
        created.allocate(0, 2 * page_size()).unwrap();
        created.write_with(0, bytes.len().min(2 * page_size() as usize), &mut |out| {
            out.copy_from_slice(&bytes[..out.len()])
        });
        let written = 2 * page_size() as usize;
        assert_eq!(created.read_for_walk(1, written), &bytes[..written]);
        let empty = dir.path().join("empty");
        std::fs::write(&empty, b"").unwrap();
        let file = OsVfs.open_segment(&empty).unwrap();
        file.read_soon(0, 1 << 30);
    }
}
