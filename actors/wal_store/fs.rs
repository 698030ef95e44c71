//! The file-system seam of the WAL store: [`WalFs`], every file call the store and the
//! directory scans make, so that a test can put a simulated disk under them, and
//! [`StdFs`], the real file system, with what a listing and a lock probe find
//! ([`Entry`], [`LockProbe`]).

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, Write};
use std::path::{Path, PathBuf};

/// One directory entry, as [`WalFs::list`] sees it (links not followed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Its path.
    pub path: PathBuf,
    /// Whether it is a regular file.
    pub regular: bool,
    /// What it is, for messages ("regular file", "symlink", ...).
    pub kind: String,
}

/// Every file system call of the WAL store, so that a test can run the store on a
/// simulated disk (one that loses unsynced data at a power cut). [`StdFs`] is the real
/// one. The calls mean what their `std::fs` namesakes mean.
pub trait WalFs: Send + 'static {
    /// A file open for appending.
    type Appender: Write + Send + 'static;
    /// A file open for reading.
    type Reader: Read + Seek;
    /// `Some(true)` for a directory, `Some(false)` for anything else, `None` if missing.
    ///
    /// # Errors
    /// The OS error of any failure but a missing path.
    fn is_dir(&self, path: &Path) -> io::Result<Option<bool>>;
    /// Creates a directory and its missing parents.
    ///
    /// # Errors
    /// The OS error (a path component that is not a directory included).
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Makes the directory's entries durable (an fsync of the directory).
    ///
    /// # Errors
    /// The OS error of opening or syncing the directory.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Takes the exclusive lock on the lock file `path`, creating it; `Ok(None)` if
    /// another holder has it. Dropping the guard releases the lock.
    ///
    /// # Errors
    /// The OS error of creating, opening or locking the file; a lock held elsewhere is
    /// `Ok(None)`, not an error.
    fn lock(&self, path: &Path) -> io::Result<Option<Box<dyn Send>>>;
    /// Tries the exclusive lock on an existing lock file `path` without creating it and
    /// without waiting: what a reader that must not change the directory
    /// ([`view_wal_dir`](super::view_wal_dir)) asks. The default takes it through
    /// [`lock`](WalFs::lock), which creates a missing file.
    ///
    /// # Errors
    /// The OS error of opening or locking the file; a missing file or a lock held
    /// elsewhere is an `Ok` answer, not an error.
    fn probe_lock(&self, path: &Path) -> io::Result<LockProbe> {
        Ok(match self.lock(path)? {
            Some(guard) => LockProbe::Taken(guard),
            None => LockProbe::Held,
        })
    }
    /// The entries of a directory, in any order.
    ///
    /// # Errors
    /// The OS error of reading the directory or an entry's type (a missing directory
    /// included).
    fn list(&self, dir: &Path) -> io::Result<Vec<Entry>>;
    /// Opens a file for reading.
    ///
    /// # Errors
    /// The OS error (a missing file included).
    fn open_read(&self, path: &Path) -> io::Result<Self::Reader>;
    /// A file's length.
    ///
    /// # Errors
    /// The OS error (a missing file included).
    fn len(&self, path: &Path) -> io::Result<u64>;
    /// Creates a new file (an existing one is an error) for appending.
    ///
    /// # Errors
    /// The OS error; [`io::ErrorKind::AlreadyExists`] if the file exists.
    fn create_new(&self, path: &Path) -> io::Result<Self::Appender>;
    /// Opens an existing file for appending.
    ///
    /// # Errors
    /// The OS error (a missing file included).
    fn open_append(&self, path: &Path) -> io::Result<Self::Appender>;
    /// Makes what was appended to `file` durable (`fdatasync`).
    ///
    /// # Errors
    /// The OS error. What was appended since the last good sync may then be lost
    /// whatever a retry reports: the store refuses later appends.
    fn sync(&self, file: &mut Self::Appender) -> io::Result<()>;
    /// Cuts a file to `len` bytes, durably.
    ///
    /// # Errors
    /// The OS error of opening, cutting or syncing the file.
    fn truncate(&self, path: &Path, len: u64) -> io::Result<()>;
    /// Removes a file (durably only after [`sync_dir`](WalFs::sync_dir)).
    ///
    /// # Errors
    /// The OS error (a missing file included).
    fn remove_file(&self, path: &Path) -> io::Result<()>;
}

/// What [`WalFs::probe_lock`] found.
pub enum LockProbe {
    /// The lock is now held by the caller, until the guard is dropped.
    Taken(Box<dyn Send>),
    /// Another holder has it: a running engine.
    Held,
    /// There is no lock file (or it is not a regular file): no engine has opened the
    /// directory, and nothing can be locked without creating one.
    Missing,
}

impl fmt::Debug for LockProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LockProbe::Taken(_) => "Taken",
            LockProbe::Held => "Held",
            LockProbe::Missing => "Missing",
        })
    }
}

/// The real file system.
#[derive(Clone, Copy, Debug, Default)]
pub struct StdFs;

impl WalFs for StdFs {
    type Appender = File;
    type Reader = BufReader<File>;

    fn is_dir(&self, path: &Path) -> io::Result<Option<bool>> {
        match fs::metadata(path) {
            Ok(meta) => Ok(Some(meta.is_dir())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        fs::create_dir_all(path)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn lock(&self, path: &Path) -> io::Result<Option<Box<dyn Send>>> {
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        // A child this process is spawning holds a copy of every descriptor, the lock's
        // of a store just dropped included, until its `exec` closes them: a lock held
        // only so lets go within moments. One held by another engine is still held
        // after the last try.
        for pause_ms in [0, 1, 5, 20, 50, 100] {
            std::thread::sleep(std::time::Duration::from_millis(pause_ms));
            match file.try_lock() {
                Ok(()) => return Ok(Some(Box::new(file))),
                Err(fs::TryLockError::WouldBlock) => {}
                Err(fs::TryLockError::Error(e)) => return Err(e),
            }
        }
        Ok(None)
    }

    fn probe_lock(&self, path: &Path) -> io::Result<LockProbe> {
        // Never opened unless it is a regular file: opening a FIFO would block.
        match fs::symlink_metadata(path) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => return Ok(LockProbe::Missing),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LockProbe::Missing),
            Err(e) => return Err(e),
        }
        // A lock (flock) needs no write access: the reader opens it read-only.
        let file = match File::open(path) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(LockProbe::Missing),
            Err(e) => return Err(e),
        };
        match file.try_lock() {
            Ok(()) => Ok(LockProbe::Taken(Box::new(file))),
            Err(fs::TryLockError::WouldBlock) => Ok(LockProbe::Held),
            Err(fs::TryLockError::Error(e)) => Err(e),
        }
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<Entry>> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            // `DirEntry::file_type` does not follow symlinks: a link is not regular.
            let kind = entry.file_type()?;
            let name = if kind.is_file() {
                "regular file"
            } else if kind.is_dir() {
                "directory"
            } else if kind.is_symlink() {
                "symlink"
            } else {
                "FIFO, socket or device"
            };
            out.push(Entry {
                path: entry.path(),
                regular: kind.is_file(),
                kind: name.into(),
            });
        }
        Ok(out)
    }

    fn open_read(&self, path: &Path) -> io::Result<Self::Reader> {
        Ok(BufReader::with_capacity(256 << 10, File::open(path)?))
    }

    fn len(&self, path: &Path) -> io::Result<u64> {
        Ok(fs::metadata(path)?.len())
    }

    fn create_new(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new().create_new(true).append(true).open(path)
    }

    fn open_append(&self, path: &Path) -> io::Result<File> {
        OpenOptions::new().append(true).open(path)
    }

    fn sync(&self, file: &mut File) -> io::Result<()> {
        file.sync_data()
    }

    fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let file = OpenOptions::new().write(true).open(path)?;
        file.set_len(len)?;
        file.sync_all()
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }
}
