//! The only module that touches the operating system.
//!
//! All file and directory access goes through [`Vfs`] and [`SegmentFile`] so that
//! tests can substitute a backend that injects faults or produces crash images.

use std::any::Any;
use std::io;
use std::path::Path;
use std::sync::Arc;

mod os;
#[cfg(feature = "testing")]
pub(crate) mod sim;

pub(crate) use os::OsVfs;

/// A held directory lock; dropping it releases the lock.
pub(crate) type DirLock = Box<dyn Any + Send + Sync>;

/// Files and directories.
pub(crate) trait Vfs: Send + Sync + 'static {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Takes the exclusive lock on `dir`; `Ok(None)` if another holder has it.
    fn try_lock_dir(&self, dir: &Path) -> io::Result<Option<DirLock>>;
    /// File names (not paths) in `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<String>>;
    /// The whole content of a small file, `Ok(None)` if it does not exist.
    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Opens (creating if missing) a small append-only file.
    fn open_append(&self, path: &Path) -> io::Result<Box<dyn AppendFile>>;
    /// Creates a new segment file of `capacity` bytes (sparse) and maps it for random
    /// reads (see `open_segment`).
    fn create_segment(&self, path: &Path, capacity: u64) -> io::Result<Arc<dyn SegmentFile>>;
    /// Maps an existing segment file (its current length; log segments and cold
    /// generation files) for random reads: its pages are read one at a time and in no
    /// order (a log record per duplicate's check, a cold page per lookup), so a fault
    /// reads its page alone (`MADV_RANDOM`). Without that, a fault on a page the page
    /// cache lacks reads the device's whole read-ahead window around it (8 MiB on this
    /// VM), which evicts pages that are needed. A walk in order asks for its pages
    /// ahead (`SegmentFile::read_for_walk`, `read_soon`).
    fn open_segment(&self, path: &Path) -> io::Result<Arc<dyn SegmentFile>>;
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Renames `from` to `to` in the same directory, replacing `to` if it exists.
    /// Durable only after `sync_dir`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// The whole content of a file of any size (the index checkpoint), `Ok(None)` if
    /// it does not exist.
    fn read_file(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;
    /// Makes directory entries (creations, removals) in `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
}

/// Writes `bytes` as the whole of `path`, replacing it atomically: into `temp`, synced
/// (with `sync`), renamed over `path`, and the directory `dir` synced (with `sync`).
/// On failure, the error and the path it concerns; the caller decides what to remove.
pub(crate) fn replace_file<'p>(
    vfs: &dyn Vfs,
    dir: &'p Path,
    temp: &'p Path,
    path: &'p Path,
    bytes: &[u8],
    sync: bool,
) -> Result<(), (io::Error, &'p Path)> {
    let file = vfs.open_append(temp).map_err(|e| (e, temp))?;
    file.set_len(0).map_err(|e| (e, temp))?;
    file.write_at(0, bytes).map_err(|e| (e, temp))?;
    if sync {
        file.sync_data().map_err(|e| (e, temp))?;
    }
    drop(file);
    vfs.rename(temp, path).map_err(|e| (e, path))?;
    if sync {
        vfs.sync_dir(dir).map_err(|e| (e, dir))?;
    }
    Ok(())
}

/// A small file written by appends (the namespace table).
pub(crate) trait AppendFile: Send + Sync {
    fn set_len(&self, len: u64) -> io::Result<()>;
    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()>;
    fn sync_data(&self) -> io::Result<()>;
}

/// A memory-mapped segment file.
///
/// The contract that makes sharing it sound: a byte range is written once, by one
/// writer holding the segment's append lock, before it is published (the published
/// length is advanced with `Release` after the write); readers only read published
/// ranges, which are never written again.
pub(crate) trait SegmentFile: Send + Sync {
    /// The mapped length in bytes.
    fn capacity(&self) -> u64;
    /// The bytes at `offset..offset + len`, which must be published and inside the map.
    fn read(&self, offset: u64, len: usize) -> &[u8];
    /// Lets `fill` write `offset..offset + len` in place; the caller holds the append
    /// lock and the range is unpublished and inside the allocated part of the map.
    fn write_with(&self, offset: u64, len: usize, fill: &mut dyn FnMut(&mut [u8]));
    /// Reserves disk blocks for `offset..offset + len` so that writes through the map
    /// cannot fail for lack of space (that would be a SIGBUS, not an error).
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()>;
    /// `allocate` done ahead of need, outside the append lock: a failure is only
    /// logged, since the append that later needs the space reserves it again (under
    /// the lock) and reports the error then.
    fn allocate_ahead(&self, offset: u64, len: u64) -> io::Result<()> {
        self.allocate(offset, len)
    }
    /// A hint: `offset..offset + len` (allocated, unpublished) is about to be written:
    /// map its pages writable now, so the appends that fill it take no page fault.
    fn prepare_write(&self, _offset: u64, _len: u64) {}
    /// A hint: `offset..offset + len` is written and will not be written again, so
    /// its pages may leave this process's page tables (the bytes stay in the page
    /// cache; a later read maps them back). Called before a sync, it spares the sync
    /// write-protecting each of those pages with its own TLB shootdown.
    fn release_written(&self, _offset: u64, _len: u64) {}
    /// A hint: start writing the dirty pages back now (`sync_file_range`), without
    /// waiting; `sync_data` still makes them durable.
    fn start_writeback(&self) {}
    /// A hint: `offset..offset + len` will be read soon, in order (a merge's next
    /// pages, a file's sections at open, a segment walk's `read_for_walk`): start
    /// reading it now, although the map is for random reads.
    fn read_soon(&self, _offset: u64, _len: u64) {}
    /// `read(0, len)` for a walk of a log segment's records in order from `from`: asks
    /// for `from..len` ahead (`read_soon`) first, since segments are mapped for
    /// random reads (`Vfs::open_segment`).
    fn read_for_walk(&self, from: usize, len: usize) -> &[u8] {
        self.read_soon(from as u64, len.saturating_sub(from) as u64);
        self.read(0, len)
    }
    /// Makes every write before this call durable (`fdatasync`).
    fn sync_data(&self) -> io::Result<()>;
    /// Shrinks the file to `len` bytes; no published byte lies beyond `len`.
    fn truncate(&self, len: u64) -> io::Result<()>;
}
