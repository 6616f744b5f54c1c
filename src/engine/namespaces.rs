//! The NAMESPACES table: namespace names and their ids, kept in the NAMESPACES
//! file (docs/FORMAT.md), which an entry is synced to before any record can name it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use crate::error::Error;
use crate::format::namespace_file;
use crate::io::{AppendFile, Vfs};
use crate::limits;
use crate::poison::Poison;
use crate::recovery::survey::{self, NamespaceFile};

/// The namespaces of one store.
pub(crate) struct Namespaces {
    path: PathBuf,
    table: Mutex<Table>,
}

struct Table {
    by_name: HashMap<String, u32>,
    names: Vec<String>,
    /// `None` in a read-only store.
    file: Option<Box<dyn AppendFile>>,
    file_len: u64,
    /// Bytes after `file_len` (a torn entry) to trim once recovery has accepted the
    /// directory: a refused open leaves the file as it found it.
    torn_tail: bool,
}

impl Namespaces {
    /// Reads the NAMESPACES file of `dir`. Writable: creates it if missing, and makes
    /// what it read durable. Read-only: changes nothing, and a missing file is an
    /// empty table.
    pub(crate) fn open(vfs: &dyn Vfs, dir: &Path, read_only: bool) -> Result<Namespaces, Error> {
        let path = dir.join(crate::layout::NAMESPACES);
        let table = open_table(vfs, dir, &path, read_only)?;
        Ok(Namespaces {
            path,
            table: Mutex::new(table),
        })
    }

    /// Names in id order.
    pub(crate) fn names(&self) -> Vec<String> {
        self.table.lock().names.clone()
    }

    pub(crate) fn count(&self) -> usize {
        self.table.lock().names.len()
    }

    /// Trims a torn entry found at open, once recovery accepted the directory.
    pub(crate) fn trim_torn_tail(&self) -> Result<(), Error> {
        let table = self.table.lock();
        if let (true, Some(file)) = (table.torn_tail, &table.file) {
            file.set_len(table.file_len)
                .map_err(|e| Error::io("trimming", &self.path, e))?;
        }
        Ok(())
    }

    /// The id of `name`, added (and synced) if new. A failed write poisons the store.
    pub(crate) fn id(&self, name: &str, poison: &Poison) -> Result<u32, Error> {
        let mut namespaces = self.table.lock();
        if let Some(&id) = namespaces.by_name.get(name) {
            return Ok(id);
        }
        if namespaces.names.len() >= limits::NAMESPACES_MAX {
            return Err(Error::invalid_option(format!(
                "a store holds at most {} namespaces",
                limits::NAMESPACES_MAX
            )));
        }
        poison.check()?;
        let Some(file) = &namespaces.file else {
            return Err(Error::ReadOnly);
        };
        let id = namespaces.names.len() as u32;
        let entry = namespace_file::encode_entry(id, name);
        let at = namespaces.file_len;
        let written = file.write_at(at, &entry).and_then(|()| file.sync_data());
        if let Err(e) = written {
            let error = Error::io("adding a namespace to", &self.path, e);
            poison.set(&error);
            return Err(error);
        }
        namespaces.file_len += entry.len() as u64;
        namespaces.names.push(name.to_string());
        namespaces.by_name.insert(name.to_string(), id);
        Ok(id)
    }
}

fn open_table(vfs: &dyn Vfs, dir: &Path, path: &Path, read_only: bool) -> Result<Table, Error> {
    let existing = vfs
        .read_small(path)
        .map_err(|e| Error::io("reading", path, e))?;
    // The classification `verify` reports (`recovery::survey`).
    let decoded = match survey::namespace_file(existing.as_deref()) {
        // A header torn by a crash while the file was being created (it is synced
        // before any namespace is added): no entry follows it, so no record can name a
        // namespace from it, and it is written again below.
        NamespaceFile::Missing | NamespaceFile::TornHeader => namespace_file::Decoded::default(),
        NamespaceFile::Decoded { decoded, .. } => decoded,
        NamespaceFile::Damaged { offset, reason } => {
            return Err(Error::corruption(path, offset as u64, reason));
        }
    };
    let mut file_len = decoded.valid_len as u64;
    // A torn entry from a crash while adding a namespace: it was never used, and is
    // trimmed after recovery (`Namespaces::trim_torn_tail`).
    let torn_tail = existing.as_ref().is_some_and(|b| b.len() as u64 > file_len);
    let by_name = decoded
        .names
        .iter()
        .enumerate()
        .map(|(i, name)| (name.clone(), i as u32))
        .collect();
    if read_only {
        return Ok(Table {
            by_name,
            names: decoded.names,
            file: None,
            file_len,
            torn_tail: false,
        });
    }
    let file = vfs
        .open_append(path)
        .map_err(|e| Error::io("opening", path, e))?;
    if file_len < namespace_file::HEADER_LEN as u64 {
        let header = namespace_file::encode_header();
        file.set_len(0).map_err(|e| Error::io("writing", path, e))?;
        file.write_at(0, &header)
            .map_err(|e| Error::io("writing", path, e))?;
        file.sync_data()
            .map_err(|e| Error::io("syncing", path, e))?;
        vfs.sync_dir(dir)
            .map_err(|e| Error::io("syncing directory", dir, e))?;
        file_len = header.len() as u64;
    } else {
        // What was read may not be durable: an fsync of an entry failed, then the
        // process was restarted and read it from the page cache. Records may only name
        // a namespace whose entry is on disk, so make it durable before any can.
        file.sync_data()
            .map_err(|e| Error::io("syncing", path, e))?;
    }
    Ok(Table {
        by_name,
        names: decoded.names,
        file: Some(file),
        file_len,
        torn_tail,
    })
}
