//! The store's one sticky failure: the first fatal I/O error (a failed sync of the
//! log, a failed write of the NAMESPACES file) is kept here, and every later writer
//! or durability waiter gets it back as `Error::Poisoned`, with the operation and the
//! path that failed, until the store is reopened (what reached the disk is unknown).

use std::io;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::Error;

/// The first fatal failure, once set.
#[derive(Default)]
pub(crate) struct Poison {
    first: OnceLock<Failure>,
}

struct Failure {
    op: &'static str,
    path: PathBuf,
    kind: io::ErrorKind,
    message: String,
}

impl Poison {
    /// Poisons the store with `error` unless it already is; returns the error every
    /// caller from now on gets (the first failure's).
    pub(crate) fn set(&self, error: &Error) -> Error {
        self.first.get_or_init(|| {
            tracing::error!(error = %error, "the store refuses writes until it is reopened");
            match error {
                Error::Io { op, path, source } => Failure {
                    op,
                    path: path.clone(),
                    kind: source.kind(),
                    message: source.to_string(),
                },
                Error::Poisoned { op, path, source } => Failure {
                    op,
                    path: path.clone(),
                    kind: source.kind(),
                    message: source.to_string(),
                },
                other => Failure {
                    op: "writing",
                    path: PathBuf::new(),
                    kind: io::ErrorKind::Other,
                    message: other.to_string(),
                },
            }
        });
        self.error().expect("set above")
    }

    /// `Err(Error::Poisoned)` once poisoned.
    #[inline]
    pub(crate) fn check(&self) -> Result<(), Error> {
        match self.first.get() {
            None => Ok(()),
            Some(_) => Err(self.error().expect("set")),
        }
    }

    pub(crate) fn is_set(&self) -> bool {
        self.first.get().is_some()
    }

    /// The error every caller gets once poisoned.
    pub(crate) fn error(&self) -> Option<Error> {
        self.first.get().map(|f| Error::Poisoned {
            op: f.op,
            path: f.path.clone(),
            source: io::Error::new(f.kind, f.message.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_failure_is_kept_and_given_to_everyone() {
        let poison = Poison::default();
        assert!(poison.check().is_ok());
        let first = Error::io(
            "syncing segment",
            "/data/a.seg",
            io::Error::from(io::ErrorKind::StorageFull),
        );
        let second = Error::io(
            "adding a namespace to",
            "/data/NAMESPACES",
            io::Error::other("x"),
        );
        poison.set(&first);
        poison.set(&second);
        for error in [poison.check().unwrap_err(), poison.error().unwrap()] {
            let Error::Poisoned { op, path, source } = error else {
                panic!("not Poisoned: {error:?}");
            };
            assert_eq!(op, "syncing segment");
            assert_eq!(path, PathBuf::from("/data/a.seg"));
            assert_eq!(source.kind(), io::ErrorKind::StorageFull);
        }
    }
}
