//! An in-memory [`Vfs`] for tests: fault injection, call counting and power-cut images.
//!
//! Every file has a *live* image (what the running process sees: the page cache) and a
//! *durable* image (what the last `sync_data` of that file made durable). Directory
//! entries (a file created or removed) become durable only on `sync_dir`. From those
//! two images the simulator builds the directory a crash would leave:
//!
//! - [`Snapshot::process_kill`]: the live image (kill -9: the page cache survives);
//! - [`Snapshot::power_cut`]: the durable image, with the unsynced bytes damaged in one
//!   of the ways of [`Damage`] (dropped, truncated at a byte, zeroed, garbage, sectors
//!   persisted out of order, directory changes lost). Bytes a completed sync covered
//!   are never damaged: that is the contract of `fdatasync` this crate relies on.
//!
//! The "lossy" backend of the kill tests (unsynced data dies with the process) is
//! `power_cut(Damage::Dropped, _)`.
//!
//! Faults: [`SimVfs::fail`] makes the k-th call of a [`CallKind`] fail, once or from then
//! on. Crashes: [`SimVfs::crash_at_call`] takes a snapshot just before the n-th counted
//! call and from then on fails every call (the process is dead);
//! [`SimVfs::snapshot_every_sync`] takes one before every sync call.
//!
//! Segment memory is allocated once per file at its full length and never moves, so
//! [`SegmentFile::read`] can hand out slices without a lock, exactly like the memory
//! map of the real backend. All writes to it happen under the simulator's one lock.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use super::{AppendFile, DirLock, SegmentFile, Vfs};

/// The unit of out-of-order write-back for [`Damage::Reordered`] (a disk sector).
pub const SECTOR_BYTES: usize = 512;

/// Each kind of call the simulator counts (and, except `SegmentWrite`, can fail).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CallKind {
    /// `Vfs::create_dir_all`.
    CreateDirAll,
    /// `Vfs::try_lock_dir`.
    LockDir,
    /// `Vfs::list`.
    List,
    /// `Vfs::read_small`.
    ReadSmall,
    /// `Vfs::open_append` (creates the file if missing).
    OpenAppend,
    /// `Vfs::create_segment` (creates and sizes the file).
    CreateSegment,
    /// `Vfs::open_segment`.
    OpenSegment,
    /// `Vfs::remove`.
    Remove,
    /// `Vfs::rename`.
    Rename,
    /// `Vfs::read_file` (the index checkpoint).
    ReadFile,
    /// `Vfs::sync_dir`.
    SyncDir,
    /// `AppendFile::set_len`.
    AppendSetLen,
    /// `AppendFile::write_at`.
    AppendWrite,
    /// `AppendFile::sync_data`.
    AppendSync,
    /// `SegmentFile::write_with`: a memcpy into the map, which cannot fail (counted only).
    SegmentWrite,
    /// `SegmentFile::allocate` (fallocate: where a full disk shows).
    SegmentAllocate,
    /// `SegmentFile::allocate_ahead` (fallocate of the next step, outside the append
    /// lock; a failure is only logged).
    SegmentAllocateAhead,
    /// `SegmentFile::sync_data`.
    SegmentSync,
    /// `SegmentFile::truncate`.
    SegmentTruncate,
}

impl CallKind {
    /// Every kind, in a fixed order.
    pub const ALL: [CallKind; 19] = [
        CallKind::CreateDirAll,
        CallKind::LockDir,
        CallKind::List,
        CallKind::ReadSmall,
        CallKind::OpenAppend,
        CallKind::CreateSegment,
        CallKind::OpenSegment,
        CallKind::Remove,
        CallKind::Rename,
        CallKind::ReadFile,
        CallKind::SyncDir,
        CallKind::AppendSetLen,
        CallKind::AppendWrite,
        CallKind::AppendSync,
        CallKind::SegmentWrite,
        CallKind::SegmentAllocate,
        CallKind::SegmentAllocateAhead,
        CallKind::SegmentSync,
        CallKind::SegmentTruncate,
    ];

    /// Whether a call of this kind can return an error (and so can be failed).
    pub fn can_fail(self) -> bool {
        self != CallKind::SegmentWrite
    }

    /// Whether this is one of the sync calls (the durability points).
    pub fn is_sync(self) -> bool {
        matches!(
            self,
            CallKind::SyncDir | CallKind::AppendSync | CallKind::SegmentSync
        )
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How the unsynced part of the image is damaged by a power cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Damage {
    /// Every unsynced byte and directory change is lost (the "lossy" kill).
    Dropped,
    /// Unsynced bytes persisted in order up to a random byte, per file; directory
    /// changes persisted or lost at random, per entry.
    Truncated,
    /// Unsynced bytes read back as zeros; directory changes at random.
    Zeroed,
    /// Unsynced bytes read back as random garbage; directory changes at random.
    Garbage,
    /// Each unsynced sector persisted or lost independently (write-back out of order);
    /// directory changes at random.
    Reordered,
    /// All data persisted, but every directory change since the last `sync_dir` lost.
    DirectoryLost,
}

impl Damage {
    /// Every kind of damage.
    pub const ALL: [Damage; 6] = [
        Damage::Dropped,
        Damage::Truncated,
        Damage::Zeroed,
        Damage::Garbage,
        Damage::Reordered,
        Damage::DirectoryLost,
    ];
}

/// A fault injected with [`SimVfs::fail`] that fired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultHit {
    /// The kind of call that failed.
    pub kind: CallKind,
    /// Which call of that kind (1-based).
    pub nth: u64,
    /// Which counted call overall (1-based), comparable with [`SimVfs::total_calls`].
    pub call: u64,
    /// The name of the thread that made the call.
    pub thread: Option<String>,
}

struct Fault {
    kind: CallKind,
    nth: u64,
    forever: bool,
}

/// A segment's memory: allocated once at its full length, never moved or resized.
struct SegmentBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain bytes owned by this struct. Shared access follows the
// `SegmentFile` contract: every write happens under the simulator's state lock into a
// range no reader is reading (unpublished), and lock-free reads touch only published
// ranges, which are never written again.
unsafe impl Send for SegmentBuffer {}
// SAFETY: as above.
unsafe impl Sync for SegmentBuffer {}

impl SegmentBuffer {
    fn new(bytes: &[u8], len: usize) -> SegmentBuffer {
        let mut boxed = vec![0u8; len].into_boxed_slice();
        let n = bytes.len().min(len);
        boxed[..n].copy_from_slice(&bytes[..n]);
        let len = boxed.len();
        let ptr = NonNull::new(Box::into_raw(boxed).cast::<u8>()).expect("Box is never null");
        SegmentBuffer { ptr, len }
    }

    /// # Safety
    /// `offset + len <= self.len`, and no write to the range may happen while the slice
    /// lives.
    unsafe fn slice(&self, offset: usize, len: usize) -> &[u8] {
        debug_assert!(offset + len <= self.len);
        // SAFETY: in bounds (caller), the allocation lives as long as `self`, and the
        // caller guarantees no concurrent write to the range.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) }
    }

    /// # Safety
    /// `offset + len <= self.len`, and nobody else reads or writes the range while the
    /// slice lives.
    #[expect(
        clippy::mut_from_ref,
        reason = "interior mutability through a raw pointer, exclusive by the caller's contract"
    )]
    unsafe fn slice_mut(&self, offset: usize, len: usize) -> &mut [u8] {
        debug_assert!(offset + len <= self.len);
        // SAFETY: in bounds (caller); exclusive access to the range (caller).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset), len) }
    }
}

impl Drop for SegmentBuffer {
    fn drop(&mut self) {
        let raw = std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.len);
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of this length
        // in `new`, and are freed only here, once.
        drop(unsafe { Box::from_raw(raw) });
    }
}

enum Live {
    /// A file read and written with calls (the namespace table).
    Bytes(Vec<u8>),
    /// A mapped segment: `buffer[..len]` is the file.
    Mapped {
        buffer: Arc<SegmentBuffer>,
        len: usize,
        allocated: usize,
    },
}

struct FileData {
    live: Live,
    durable: Arc<Vec<u8>>,
    /// `write_with` extents since this file came into being in this simulator.
    writes: Vec<(usize, usize)>,
}

impl FileData {
    fn new(bytes: Vec<u8>) -> FileData {
        FileData {
            durable: Arc::new(bytes.clone()),
            live: Live::Bytes(bytes),
            writes: Vec::new(),
        }
    }

    /// The live bytes. Called under the state lock, which every writer holds.
    fn live_bytes(&self) -> &[u8] {
        match &self.live {
            Live::Bytes(bytes) => bytes,
            // SAFETY: `len <= buffer.len`; every write to the buffer happens under the
            // state lock, which our caller holds, so nothing writes while this lives.
            Live::Mapped { buffer, len, .. } => unsafe { buffer.slice(0, *len) },
        }
    }

    fn bytes_mut(&mut self) -> io::Result<&mut Vec<u8>> {
        match &mut self.live {
            Live::Bytes(bytes) => Ok(bytes),
            Live::Mapped { .. } => Err(io::Error::other(
                "simulated file system: a mapped segment used as an append file",
            )),
        }
    }
}

type FileId = u64;

#[derive(Default)]
struct State {
    dirs: BTreeSet<PathBuf>,
    live_dir: BTreeMap<PathBuf, FileId>,
    durable_dir: BTreeMap<PathBuf, FileId>,
    files: BTreeMap<FileId, FileData>,
    next_file: FileId,
    locks: BTreeSet<PathBuf>,
    counts: [u64; CallKind::ALL.len()],
    total: u64,
    faults: Vec<Fault>,
    hits: Vec<FaultHit>,
    crash_at_call: Option<u64>,
    snapshot_every_sync: bool,
    dead: bool,
    snapshots: Vec<Arc<Snapshot>>,
    /// Bytes written by `write_with` that survive intact in this image (set when the
    /// simulator was built from a crash image).
    intact_writes: Vec<(PathBuf, Vec<u8>)>,
}

impl State {
    fn add_file(&mut self, path: &Path, data: FileData) -> FileId {
        let id = self.next_file;
        self.next_file += 1;
        self.files.insert(id, data);
        self.live_dir.insert(path.to_path_buf(), id);
        id
    }

    fn live(&self, path: &Path) -> Option<FileId> {
        self.live_dir.get(path).copied()
    }

    /// `IsADirectory` if `path` is a directory, as a file call on one fails.
    fn not_a_directory(&self, path: &Path) -> io::Result<()> {
        if self.dirs.contains(path) {
            return Err(io::Error::from(io::ErrorKind::IsADirectory));
        }
        Ok(())
    }

    fn snapshot(&self) -> Snapshot {
        let mut files = BTreeMap::new();
        for (&id, data) in &self.files {
            let live = data.live_bytes();
            let durable = &data.durable;
            let mut sectors = Vec::new();
            let mut at = 0;
            while at < live.len() {
                let to = (at + SECTOR_BYTES).min(live.len());
                let old = durable.get(at..to.min(durable.len())).unwrap_or(&[]);
                if old != &live[at..to] {
                    sectors.push((at, live[at..to].to_vec()));
                }
                at = to;
            }
            files.insert(
                id,
                SnapshotFile {
                    durable: Arc::clone(&data.durable),
                    live_len: live.len(),
                    sectors,
                    writes: data.writes.clone(),
                    mapped: matches!(data.live, Live::Mapped { .. }),
                },
            );
        }
        Snapshot {
            dirs: self.dirs.clone(),
            live_dir: self.live_dir.clone(),
            durable_dir: self.durable_dir.clone(),
            files,
            calls: self.total,
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// Mirrors `State::snapshots.len()` for cheap reads.
    snapshots_taken: AtomicU64,
    /// Run before every `rename` (outside the state's lock): a test's way to act
    /// inside a window of the store's own work (`SimVfs::before_rename`).
    rename_hook: Mutex<Option<RenameHook>>,
}

type RenameHook = Arc<dyn Fn(&Path) + Send + Sync>;

/// The in-memory file system. Clones share the same files.
#[derive(Clone)]
pub struct SimVfs {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for SimVfs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = self.shared.state.lock();
        f.debug_struct("SimVfs")
            .field("files", &state.live_dir.keys().collect::<Vec<_>>())
            .field("calls", &state.total)
            .finish()
    }
}

impl Default for SimVfs {
    fn default() -> SimVfs {
        SimVfs::new()
    }
}

fn injected(kind: CallKind, nth: u64) -> io::Error {
    io::Error::other(format!("simulated I/O error: {kind:?} call #{nth}"))
}

fn dead() -> io::Error {
    io::Error::other("simulated crash: the process is dead")
}

impl SimVfs {
    /// An empty file system.
    pub fn new() -> SimVfs {
        SimVfs::from_state(State::default())
    }

    fn from_state(state: State) -> SimVfs {
        SimVfs {
            shared: Arc::new(Shared {
                state: Mutex::new(state),
                snapshots_taken: AtomicU64::new(0),
                rename_hook: Mutex::new(None),
            }),
        }
    }

    /// Makes the `nth` call (1-based, counted since this simulator was made) of `kind`
    /// fail; with `forever`, every later call of that kind fails too.
    pub fn fail(&self, kind: CallKind, nth: u64, forever: bool) {
        assert!(kind.can_fail(), "{kind:?} cannot fail");
        self.shared
            .state
            .lock()
            .faults
            .push(Fault { kind, nth, forever });
    }

    /// Runs `hook` with the target path before every later `rename`, on the renaming
    /// thread and outside the simulator's lock (it may call the store): a test's way
    /// to act at a chosen point of a spill or a merge, which rename their files into
    /// place just before publishing them.
    pub fn before_rename(&self, hook: impl Fn(&Path) + Send + Sync + 'static) {
        *self.shared.rename_hook.lock() = Some(Arc::new(hook));
    }

    /// Removes every injected fault (hits already recorded stay).
    pub fn clear_faults(&self) {
        self.shared.state.lock().faults.clear();
    }

    /// The injected faults that fired, in order.
    pub fn fault_hits(&self) -> Vec<FaultHit> {
        self.shared.state.lock().hits.clone()
    }

    /// Calls of `kind` so far.
    pub fn calls(&self, kind: CallKind) -> u64 {
        self.shared.state.lock().counts[kind.index()]
    }

    /// Counted calls of every kind so far.
    pub fn total_calls(&self) -> u64 {
        self.shared.state.lock().total
    }

    /// Takes a snapshot just before the `n`-th counted call (1-based) and from then on
    /// fails every call: the process died there. See [`SimVfs::crashed`].
    pub fn crash_at_call(&self, n: u64) {
        self.shared.state.lock().crash_at_call = Some(n);
    }

    /// Takes a snapshot now and fails every later call: the process dies now.
    pub fn crash_now(&self) -> Arc<Snapshot> {
        let mut state = self.shared.state.lock();
        let snapshot = Arc::new(state.snapshot());
        if !state.dead {
            state.dead = true;
            state.snapshots.push(Arc::clone(&snapshot));
            self.shared
                .snapshots_taken
                .store(state.snapshots.len() as u64, Ordering::SeqCst);
        }
        snapshot
    }

    /// Whether the simulated process died (by `crash_at_call` or `crash_now`).
    pub fn crashed(&self) -> bool {
        self.shared.state.lock().dead
    }

    /// Takes a snapshot before every sync call from now on.
    pub fn snapshot_every_sync(&self, on: bool) {
        self.shared.state.lock().snapshot_every_sync = on;
    }

    /// Snapshots taken so far; cheap (no lock). A caller that reads `m` after an
    /// operation returned knows the operation returned before snapshot `m + 1`.
    pub fn snapshots_taken(&self) -> u64 {
        self.shared.snapshots_taken.load(Ordering::SeqCst)
    }

    /// The snapshots taken so far, oldest first.
    pub fn snapshots(&self) -> Vec<Arc<Snapshot>> {
        self.shared.state.lock().snapshots.clone()
    }

    /// A snapshot of the current state (does not stop anything).
    pub fn snapshot(&self) -> Snapshot {
        self.shared.state.lock().snapshot()
    }

    /// Bytes of `write_with` calls (records, segment headers excluded) that survived
    /// intact into this image, with the file they are in, for simulators built from a
    /// crash image: only files present in the image whose header is intact count.
    pub fn intact_writes(&self) -> Vec<(PathBuf, Vec<u8>)> {
        self.shared.state.lock().intact_writes.clone()
    }

    /// The names of the live files in `dir`.
    pub fn file_names(&self, dir: &Path) -> Vec<String> {
        let state = self.shared.state.lock();
        names_in(&state.live_dir, dir)
    }

    /// The live bytes of `path`, if it exists.
    pub fn read_file(&self, path: &Path) -> Option<Vec<u8>> {
        let state = self.shared.state.lock();
        let id = state.live(path)?;
        Some(state.files[&id].live_bytes().to_vec())
    }

    /// Test setup, not a counted call: makes `path` a file holding `bytes`, live and
    /// durable, replacing any file there (damage written by hand).
    pub fn put_file(&self, path: &Path, bytes: &[u8]) {
        let mut state = self.shared.state.lock();
        if let Some(dir) = path.parent() {
            state.dirs.extend(dir.ancestors().map(Path::to_path_buf));
        }
        let id = state.add_file(path, FileData::new(bytes.to_vec()));
        state.durable_dir.insert(path.to_path_buf(), id);
    }

    /// Test damage, not a counted call: flips the bits of `mask` in byte `offset` of the
    /// live file `path` in place, as a bad page would under a running store: a mapped
    /// segment changes under its open handles. The caller makes sure no read of that
    /// byte is in flight (no store operation runs during the call).
    pub fn flip_live_byte(&self, path: &Path, offset: usize, mask: u8) {
        let mut state = self.shared.state.lock();
        let id = *state
            .live_dir
            .get(path)
            .expect("flip_live_byte: no such file");
        let file = state.files.get_mut(&id).expect("a listed file exists");
        match &mut file.live {
            Live::Bytes(bytes) => bytes[offset] ^= mask,
            Live::Mapped { buffer, len, .. } => {
                assert!(offset < *len, "flip_live_byte: {offset} is past the end");
                // SAFETY: in bounds (offset < len <= buffer length); the state lock is
                // held, and the caller guarantees no read of this byte is in flight.
                let byte = unsafe { buffer.slice_mut(offset, 1) };
                byte[0] ^= mask;
            }
        }
    }

    /// Test setup, not a counted call: removes the file `path`, live and durable.
    /// Whether it existed.
    pub fn delete_file(&self, path: &Path) -> bool {
        let mut state = self.shared.state.lock();
        state.durable_dir.remove(path);
        state.live_dir.remove(path).is_some()
    }

    /// Test setup, not a counted call: makes the directory `path`. Its parent lists
    /// it; used as a file (opened, read or removed) it fails with `IsADirectory`.
    pub fn put_dir(&self, path: &Path) {
        let mut state = self.shared.state.lock();
        state.dirs.extend(path.ancestors().map(Path::to_path_buf));
    }

    /// Counts a call, applies crash plans and faults; on success returns the state.
    fn enter(&self, kind: CallKind) -> io::Result<MutexGuard<'_, State>> {
        let mut state = self.shared.state.lock();
        if state.dead {
            return Err(dead());
        }
        state.counts[kind.index()] += 1;
        state.total += 1;
        let nth = state.counts[kind.index()];
        let call = state.total;
        if state.crash_at_call == Some(call) {
            let snapshot = Arc::new(state.snapshot());
            state.snapshots.push(snapshot);
            self.shared
                .snapshots_taken
                .store(state.snapshots.len() as u64, Ordering::SeqCst);
            state.dead = true;
            return Err(dead());
        }
        if state.snapshot_every_sync && kind.is_sync() {
            let snapshot = Arc::new(state.snapshot());
            state.snapshots.push(snapshot);
            self.shared
                .snapshots_taken
                .store(state.snapshots.len() as u64, Ordering::SeqCst);
        }
        let fires = state
            .faults
            .iter()
            .any(|f| f.kind == kind && (nth == f.nth || (f.forever && nth > f.nth)));
        if fires {
            let thread = std::thread::current().name().map(str::to_string);
            state.hits.push(FaultHit {
                kind,
                nth,
                call,
                thread,
            });
            return Err(injected(kind, nth));
        }
        Ok(state)
    }
}

fn names_in(dir_map: &BTreeMap<PathBuf, FileId>, dir: &Path) -> Vec<String> {
    dir_map
        .keys()
        .filter(|path| path.parent() == Some(dir))
        .filter_map(|path| path.file_name()?.to_str().map(str::to_string))
        .collect()
}

/// A held simulated directory lock.
struct SimLock {
    shared: Arc<Shared>,
    dir: PathBuf,
}

impl Drop for SimLock {
    fn drop(&mut self) {
        self.shared.state.lock().locks.remove(&self.dir);
    }
}

impl Vfs for SimVfs {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.enter(CallKind::CreateDirAll)?;
        for ancestor in dir.ancestors() {
            state.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    fn try_lock_dir(&self, dir: &Path) -> io::Result<Option<DirLock>> {
        let mut state = self.enter(CallKind::LockDir)?;
        if !state.dirs.contains(dir) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        if !state.locks.insert(dir.to_path_buf()) {
            return Ok(None);
        }
        Ok(Some(Box::new(SimLock {
            shared: Arc::clone(&self.shared),
            dir: dir.to_path_buf(),
        })))
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<String>> {
        let state = self.enter(CallKind::List)?;
        if !state.dirs.contains(dir) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let mut names = names_in(&state.live_dir, dir);
        let subdirs = state.dirs.iter().filter(|d| d.parent() == Some(dir));
        names.extend(subdirs.filter_map(|d| d.file_name()?.to_str().map(str::to_string)));
        Ok(names)
    }

    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let state = self.enter(CallKind::ReadSmall)?;
        state.not_a_directory(path)?;
        Ok(state
            .live(path)
            .map(|id| state.files[&id].live_bytes().to_vec()))
    }

    fn open_append(&self, path: &Path) -> io::Result<Box<dyn AppendFile>> {
        let mut state = self.enter(CallKind::OpenAppend)?;
        if !path.parent().is_some_and(|dir| state.dirs.contains(dir)) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let id = match state.live(path) {
            Some(id) => id,
            None => state.add_file(path, FileData::new(Vec::new())),
        };
        Ok(Box::new(SimAppendFile {
            vfs: self.clone(),
            id,
        }))
    }

    fn create_segment(&self, path: &Path, capacity: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let mut state = self.enter(CallKind::CreateSegment)?;
        if !path.parent().is_some_and(|dir| state.dirs.contains(dir)) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        if state.live(path).is_some() {
            return Err(io::Error::from(io::ErrorKind::AlreadyExists));
        }
        // Like the real backend: the file starts empty and grows with `allocate`; only
        // the map (here, the buffer) is `capacity` long.
        let len = usize::try_from(capacity).map_err(|_| io::ErrorKind::InvalidInput)?;
        let buffer = Arc::new(SegmentBuffer::new(&[], len));
        let id = state.add_file(
            path,
            FileData {
                live: Live::Mapped {
                    buffer: Arc::clone(&buffer),
                    len: 0,
                    allocated: 0,
                },
                durable: Arc::new(Vec::new()),
                writes: Vec::new(),
            },
        );
        Ok(Arc::new(SimSegmentFile {
            vfs: self.clone(),
            id,
            buffer,
            capacity: len,
        }))
    }

    fn open_segment(&self, path: &Path) -> io::Result<Arc<dyn SegmentFile>> {
        let mut state = self.enter(CallKind::OpenSegment)?;
        state.not_a_directory(path)?;
        let id = state
            .live(path)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let data = state.files.get_mut(&id).expect("a listed file exists");
        let (buffer, capacity) = match &data.live {
            Live::Mapped { buffer, len, .. } => (Arc::clone(buffer), *len),
            Live::Bytes(bytes) => {
                let len = bytes.len();
                let buffer = Arc::new(SegmentBuffer::new(bytes, len));
                data.live = Live::Mapped {
                    buffer: Arc::clone(&buffer),
                    len,
                    allocated: len,
                };
                (buffer, len)
            }
        };
        Ok(Arc::new(SimSegmentFile {
            vfs: self.clone(),
            id,
            buffer,
            capacity,
        }))
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut state = self.enter(CallKind::Remove)?;
        state.not_a_directory(path)?;
        match state.live_dir.remove(path) {
            Some(_) => Ok(()),
            None => Err(io::Error::from(io::ErrorKind::NotFound)),
        }
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let hook = self.shared.rename_hook.lock().clone();
        if let Some(hook) = hook {
            hook(to);
        }
        let mut state = self.enter(CallKind::Rename)?;
        if from.parent() != to.parent() {
            return Err(io::Error::other(
                "simulated file system: rename across directories",
            ));
        }
        // Like rename(2): the live entry moves at once; the durable directory keeps the
        // old names until `sync_dir`, so a power cut may leave either.
        let id = state
            .live_dir
            .remove(from)
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        state.live_dir.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn read_file(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let state = self.enter(CallKind::ReadFile)?;
        state.not_a_directory(path)?;
        Ok(state
            .live(path)
            .map(|id| state.files[&id].live_bytes().to_vec()))
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut state = self.enter(CallKind::SyncDir)?;
        if !state.dirs.contains(dir) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let state = &mut *state;
        state
            .durable_dir
            .retain(|path, _| path.parent() != Some(dir));
        for (path, &id) in &state.live_dir {
            if path.parent() == Some(dir) {
                state.durable_dir.insert(path.clone(), id);
            }
        }
        Ok(())
    }
}

struct SimAppendFile {
    vfs: SimVfs,
    id: FileId,
}

impl AppendFile for SimAppendFile {
    fn set_len(&self, len: u64) -> io::Result<()> {
        let mut state = self.vfs.enter(CallKind::AppendSetLen)?;
        let len = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        let file = state.files.get_mut(&self.id).expect("open file exists");
        file.bytes_mut()?.resize(len, 0);
        Ok(())
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let mut state = self.vfs.enter(CallKind::AppendWrite)?;
        let offset = usize::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
        let file = state.files.get_mut(&self.id).expect("open file exists");
        let live = file.bytes_mut()?;
        if live.len() < offset + bytes.len() {
            live.resize(offset + bytes.len(), 0);
        }
        live[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut state = self.vfs.enter(CallKind::AppendSync)?;
        let file = state.files.get_mut(&self.id).expect("open file exists");
        file.durable = Arc::new(file.live_bytes().to_vec());
        Ok(())
    }
}

struct SimSegmentFile {
    vfs: SimVfs,
    id: FileId,
    buffer: Arc<SegmentBuffer>,
    /// The length when this handle was mapped (like the real map's length).
    capacity: usize,
}

impl SimSegmentFile {
    fn allocate_as(&self, kind: CallKind, offset: u64, len: u64) -> io::Result<()> {
        let mut state = self.vfs.enter(kind)?;
        let end = offset
            .checked_add(len)
            .and_then(|end| usize::try_from(end).ok())
            .ok_or(io::ErrorKind::InvalidInput)?;
        let file = state.files.get_mut(&self.id).expect("open file exists");
        if let Live::Mapped {
            len: file_len,
            allocated,
            ..
        } = &mut file.live
        {
            if end > self.capacity {
                return Err(io::Error::other("allocate beyond the end of the map"));
            }
            if end > *file_len {
                // fallocate extends the file, and an extension reads as zeros.
                // SAFETY: in bounds (end <= capacity <= buffer length); the range lies
                // beyond the end of the file, so nothing is published there, and we
                // hold the state lock under which every write happens.
                unsafe { self.buffer.slice_mut(*file_len, end - *file_len) }.fill(0);
                *file_len = end;
            }
            *allocated = (*allocated).max(end);
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, len: usize) -> usize {
        let offset = usize::try_from(offset).unwrap_or(usize::MAX);
        assert!(
            offset
                .checked_add(len)
                .is_some_and(|end| end <= self.capacity),
            "segment access {offset}+{len} outside the map of {} bytes",
            self.capacity
        );
        offset
    }
}

impl SegmentFile for SimSegmentFile {
    fn capacity(&self) -> u64 {
        self.capacity as u64
    }

    fn read(&self, offset: u64, len: usize) -> &[u8] {
        let offset = self.check_range(offset, len);
        // SAFETY: in bounds (checked against the handle's capacity, which is at most the
        // buffer's length); by the `SegmentFile` contract the range is published and
        // never written again, so no write aliases the returned slice.
        unsafe { self.buffer.slice(offset, len) }
    }

    fn write_with(&self, offset: u64, len: usize, fill: &mut dyn FnMut(&mut [u8])) {
        let offset = self.check_range(offset, len);
        // A memcpy into the map cannot fail; a dead process's writes are simply lost
        // (the snapshot was taken), but we still perform them so the caller's own
        // read-back checks hold.
        let mut state = match self.vfs.enter(CallKind::SegmentWrite) {
            Ok(state) => state,
            Err(_) => self.vfs.shared.state.lock(),
        };
        let file = state.files.get_mut(&self.id).expect("open file exists");
        if let Live::Mapped {
            len: file_len,
            allocated,
            ..
        } = &file.live
        {
            assert!(
                offset + len <= *file_len,
                "write past the end of the file: a SIGBUS on a real map"
            );
            assert!(
                offset + len <= *allocated,
                "write {offset}+{len} beyond the {allocated} allocated bytes: on a full disk this is a SIGBUS"
            );
        }
        file.writes.push((offset, len));
        // SAFETY: in bounds (checked above). We hold the state lock, under which every
        // write happens, and by the `SegmentFile` contract the range is unpublished, so
        // no lock-free reader reads it: the exclusive slice does not alias.
        fill(unsafe { self.buffer.slice_mut(offset, len) });
    }

    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        self.allocate_as(CallKind::SegmentAllocate, offset, len)
    }

    fn allocate_ahead(&self, offset: u64, len: u64) -> io::Result<()> {
        self.allocate_as(CallKind::SegmentAllocateAhead, offset, len)
    }

    fn sync_data(&self) -> io::Result<()> {
        let mut state = self.vfs.enter(CallKind::SegmentSync)?;
        let file = state.files.get_mut(&self.id).expect("open file exists");
        file.durable = Arc::new(file.live_bytes().to_vec());
        Ok(())
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        let mut state = self.vfs.enter(CallKind::SegmentTruncate)?;
        let new_len = usize::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
        let file = state.files.get_mut(&self.id).expect("open file exists");
        match &mut file.live {
            Live::Mapped {
                buffer,
                len,
                allocated,
            } => {
                if new_len > buffer.len {
                    return Err(io::Error::other(
                        "simulated file system: cannot grow a mapped segment",
                    ));
                }
                if new_len > *len {
                    // SAFETY: in bounds; the range lies beyond the old end of the file,
                    // so nothing is published there; we hold the state lock.
                    unsafe { buffer.slice_mut(*len, new_len - *len) }.fill(0);
                }
                *len = new_len;
                *allocated = (*allocated).min(new_len);
            }
            Live::Bytes(bytes) => bytes.resize(new_len, 0),
        }
        Ok(())
    }
}

struct SnapshotFile {
    durable: Arc<Vec<u8>>,
    live_len: usize,
    /// Sectors whose live bytes differ from the durable ones (or lie beyond them).
    sectors: Vec<(usize, Vec<u8>)>,
    writes: Vec<(usize, usize)>,
    mapped: bool,
}

impl SnapshotFile {
    fn live(&self) -> Vec<u8> {
        let mut out = self.durable.as_ref().clone();
        out.resize(self.live_len, 0);
        for (at, bytes) in &self.sectors {
            out[*at..*at + bytes.len()].copy_from_slice(bytes);
        }
        out
    }
}

/// The state of a simulated file system at one instant: live and durable images.
pub struct Snapshot {
    dirs: BTreeSet<PathBuf>,
    live_dir: BTreeMap<PathBuf, FileId>,
    durable_dir: BTreeMap<PathBuf, FileId>,
    files: BTreeMap<FileId, SnapshotFile>,
    calls: u64,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot")
            .field("calls", &self.calls)
            .field("live", &self.live_dir.keys().collect::<Vec<_>>())
            .field("durable", &self.durable_dir.keys().collect::<Vec<_>>())
            .finish()
    }
}

/// A small xorshift generator: the simulator's only randomness, seeded by the caller.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

impl Snapshot {
    /// Counted calls made before this snapshot was taken.
    pub fn calls(&self) -> u64 {
        self.calls
    }

    /// Whether any byte or directory entry is not yet durable.
    pub fn has_unsynced(&self) -> bool {
        self.live_dir != self.durable_dir
            || self
                .files
                .values()
                .any(|f| !f.sectors.is_empty() || f.live_len != f.durable.len())
    }

    /// The file system a kill -9 leaves: every write and directory change survives.
    pub fn process_kill(&self) -> SimVfs {
        let mut state = State {
            dirs: self.dirs.clone(),
            ..State::default()
        };
        for (path, id) in &self.live_dir {
            let bytes = self.files[id].live();
            let new_id = state.add_file(path, FileData::new(bytes));
            state.durable_dir.insert(path.clone(), new_id);
        }
        SimVfs::from_state(state)
    }

    /// The file system a power cut leaves, the unsynced part damaged by `damage`
    /// (random choices from `seed`). The result is fully durable (a rebooted machine).
    pub fn power_cut(&self, damage: Damage, seed: u64) -> SimVfs {
        let mut rng = Rng::new(seed);
        let mut state = State {
            dirs: self.dirs.clone(),
            ..State::default()
        };
        // Which directory entries exist after the cut.
        let mut entries: BTreeMap<PathBuf, FileId> = BTreeMap::new();
        let paths: BTreeSet<&PathBuf> = self
            .live_dir
            .keys()
            .chain(self.durable_dir.keys())
            .collect();
        for path in paths {
            let live = self.live_dir.get(path);
            let durable = self.durable_dir.get(path);
            let chosen = match damage {
                Damage::Dropped | Damage::DirectoryLost => durable,
                _ if live == durable => live,
                _ => {
                    if rng.coin() {
                        live
                    } else {
                        durable
                    }
                }
            };
            if let Some(&id) = chosen {
                entries.insert(path.clone(), id);
            }
        }
        for (path, id) in entries {
            let file = &self.files[&id];
            let (bytes, intact) = damage_file(file, damage, &mut rng);
            let header_intact = file
                .writes
                .iter()
                .zip(&intact)
                .filter(|((offset, _), _)| *offset == 0)
                .all(|(_, ok)| *ok);
            if file.mapped && header_intact {
                for (&(offset, len), ok) in file.writes.iter().zip(&intact) {
                    if offset != 0 && *ok {
                        state
                            .intact_writes
                            .push((path.clone(), bytes[offset..offset + len].to_vec()));
                    }
                }
            }
            let new_id = state.add_file(&path, FileData::new(bytes));
            state.durable_dir.insert(path, new_id);
        }
        SimVfs::from_state(state)
    }
}

/// The bytes of one file after a power cut, and for each `write_with` extent whether
/// it survived exactly.
fn damage_file(file: &SnapshotFile, damage: Damage, rng: &mut Rng) -> (Vec<u8>, Vec<bool>) {
    let durable = file.durable.as_ref();
    let mut out = match damage {
        Damage::DirectoryLost => file.live(),
        _ => durable.clone(),
    };
    if !matches!(damage, Damage::Dropped | Damage::DirectoryLost) {
        // Length: a grown file keeps its new length (the size is metadata written with
        // the data); a shrunk one may come back at either length.
        let len = if file.live_len >= durable.len() || rng.coin() {
            file.live_len
        } else {
            durable.len()
        };
        out.resize(len, 0);
        fn changed<'a>(
            at: usize,
            bytes: &'a [u8],
            durable: &'a [u8],
        ) -> impl DoubleEndedIterator<Item = usize> + 'a {
            (0..bytes.len())
                .map(move |j| at + j)
                .filter(move |&i| bytes[i - at] != durable.get(i).copied().unwrap_or(0))
        }
        let first = file
            .sectors
            .iter()
            .find_map(|(at, b)| changed(*at, b, durable).next());
        let last = file
            .sectors
            .iter()
            .rev()
            .find_map(|(at, b)| changed(*at, b, durable).next_back());
        let cut = match (first, last) {
            (Some(first), Some(last)) => first + rng.below((last + 2 - first) as u64) as usize,
            _ => 0,
        };
        for (at, bytes) in &file.sectors {
            let keep_sector = rng.coin();
            for i in changed(*at, bytes, durable) {
                if i >= len {
                    break;
                }
                let new = bytes[i - at];
                out[i] = match damage {
                    Damage::Truncated if i < cut => new,
                    Damage::Truncated => out[i],
                    Damage::Zeroed => 0,
                    Damage::Garbage => rng.next() as u8,
                    Damage::Reordered if keep_sector => new,
                    Damage::Reordered => out[i],
                    Damage::Dropped | Damage::DirectoryLost => unreachable!("no damage"),
                };
            }
        }
    }
    let intact = if file.writes.is_empty() {
        Vec::new()
    } else {
        let live = file.live();
        file.writes
            .iter()
            .map(|&(offset, len)| out.get(offset..offset + len) == live.get(offset..offset + len))
            .collect()
    };
    (out, intact)
}
