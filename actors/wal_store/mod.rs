//! [`WalStore`]: the embedded default store, a segmented write-ahead log on local disk.
//! The byte format, the seal and LSN rules and the torn-tail rule are in [`crate::wal`];
//! this file is the file system shell around them.
//!
//! - **Append**: one frame per call, one `write` and one `fdatasync`; the group commit
//!   calls it from its writer thread with everything that arrived during the previous
//!   sync. After a failed write or sync the store refuses every
//!   later append: the file's state is unknown, and retrying an fsync can report success
//!   for data the kernel already dropped.
//! - **Roll and seal**: once a frame would take the current segment past
//!   `segment_bytes`, the store creates the next segment (header synced, directory
//!   synced), then appends a seal frame to the current one and syncs it, so that every
//!   complete segment says so and a lost or cut segment is found at open. The new
//!   segment's first frame is a start frame restating where the log begins, written and
//!   synced with the frame that made the roll, so the newest segment knows where the
//!   log begins even if the oldest file, which may hold the last start frame, is lost.
//! - **Where the log begins**: before compaction deletes segments it appends and syncs a
//!   start frame naming the first segment it keeps, then deletes the ones below it and
//!   syncs the directory (see [`crate::wal`], *Where the log begins*). At open, segment
//!   files below the newest start frame are leftovers of an interrupted deletion and
//!   are removed (a reported repair); a lowest file above it is a missing oldest
//!   segment, and the store refuses to open, naming it.
//! - **Bounded size**: the store knows which segment holds each live procedure's latest
//!   record and how many bytes that record takes (its encoded size, the *live bytes*
//!   `L`). After every append (and at open) it deletes the oldest segment while it holds
//!   no live record, and while there are more than `max_segments` (`M`) segments **and**
//!   the segment files hold more than `2·L + M·segment_bytes` bytes, it rewrites the
//!   oldest segment's live records forward as checkpoint frames, whatever its live ratio,
//!   and deletes it (HBase's answer to its WAL pile-up), so a procedure that waits for
//!   hours pins nothing. Beyond `M` segments it also rewrites an oldest segment that is at
//!   most half live (by bytes) even under the bound: that rewrite frees more than it
//!   writes, and keeps a mostly dead log small. The bound, after every successful append: with `S` =
//!   `segment_bytes` and `F` the longest frame written plus 61 bytes (a segment holds at
//!   most `max(S, 69 + frame)` bytes before its 21-byte seal, its header and the roll's
//!   start frame included, so at most `S + F`),
//!
//!   ```text
//!   total segment bytes  ≤  2·L + M·(S + F)
//!   segments             ≤  max(M, 1 + (2·L + M·S) / max(S − F, 90))
//!   ```
//!
//!   Either there are at most `M` segments, each at most `S + F` bytes, or the rewrites
//!   ran until the total fell to `2·L + M·S`; then every segment but the newest is
//!   sealed and holds more than `S − F` bytes (it rolled because a frame of at most
//!   `F − 61` bytes did not fit), and at least 90 (a 40-byte header, one frame of at
//!   least 29 bytes, a 21-byte seal). The 90 is what bounds the count when frames
//!   outgrow the segments (`F ≥ S`): a frame larger than `S` takes a segment of its own
//!   and the next small frame another, so segments can be that small, and the count
//!   grows with the live bytes rather than with `M` (with `S` = 4 KiB, `M` = 3 and
//!   `L` = 1 MiB: up to about 23 000 segments, while the bytes stay within their
//!   bound). Segments are not refused for being smaller than a frame: the largest
//!   frame is known only when it is written, and a store that refused it would lose the
//!   append; choose `segment_bytes` well above the largest group commit. (One segment
//!   may be smaller than 90 bytes: the empty newest segment of an older format, sealed
//!   by the roll at the first open of this format.) The rewrites always get there
//!   within one pass over the segments that exist when the append starts: after
//!   rewriting all of them, the log holds the current segment (at most `S + F`) and the
//!   live records once. That pass
//!   is the worst-case work of one append (about `L + S` bytes written). Usually the
//!   oldest segment is the one most overwritten since, so a rewrite frees more than it
//!   writes and the amortised cost is below one rewritten byte per appended byte.
//! - **Directory changes are durable before they are relied on**: every segment creation
//!   and deletion (garbage collection, a torn or interrupted-roll segment or a leftover
//!   removed at open) is followed by an fsync of the directory ([`sync_dir`]), and so is
//!   the creation of the WAL directory itself (its parent's fsync). Compaction deletes
//!   a run of segments and then syncs once: the start frame before it already says that
//!   any of them a crash leaves behind is a leftover, so the order in which the
//!   deletions reach the disk does not matter.
//! - **One engine per directory**: the store holds an exclusive lock on `DIR/LOCK`.
//!   `proctor wal verify` ([`view_wal_dir`]) holds it too for its scan when it is free;
//!   beside a running engine it checks a consistent view instead (listed, scanned,
//!   listed again, and retried while a roll or a compaction changed the listing), so
//!   the engine's work in flight never passes for damage.
//! - **Open**: checks the directory (canonical names, regular files), reads each segment
//!   whole, oldest first, and indexes it on a thread of its own while the next is read,
//!   then checks the whole log: where it begins (its newest start frame), no gaps from
//!   there on, the LSN chain and the seals; removes the leftovers below the start and
//!   the empty segment of an interrupted roll, truncates a torn tail of the newest
//!   segment, reports each repair
//!   in [`StoreSnapshot::repairs`], and stops with [`StoreError::Corrupt`] (file and
//!   offset) on any other damage. Then it replays the ops: the latest op of each
//!   procedure is kept as bytes and only the live ones are decoded, the trees split
//!   over the cores by a hash of their root when there are many (the parts
//!   [`ProcedureStore::load_parts`] hands over). Until the replay ends,
//!   open holds the payloads of every segment (the log's size, which the bound above
//!   limits) and an index entry of 40 bytes per op; a segment file above 64 MiB is
//!   streamed on the opening thread rather than read whole. The read-only scan
//!   ([`scan_wal_dir`], `proctor wal verify`) streams instead: one frame in memory at a
//!   time.

use std::collections::BTreeMap;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::fast_map::IdMap;
use crate::procedure::ProcId;
use crate::record::{ProcRecord, StoreOp};
use crate::store::{LastStop, ProcedureStore, StoreError, StoreParts, StoreSnapshot};
use crate::wal::{
    self, Frame, FrameError, FrameKind, OpKind, RawFrame, RawOp, ScanEnd, SegmentSummary,
};

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
    /// ([`view_wal_dir`]) asks. The default takes it through [`lock`](WalFs::lock),
    /// which creates a missing file.
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
        match file.try_lock() {
            Ok(()) => Ok(Some(Box::new(file))),
            Err(fs::TryLockError::WouldBlock) => Ok(None),
            Err(fs::TryLockError::Error(e)) => Err(e),
        }
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

/// Tuning of a [`WalStore`].
#[derive(Clone, Debug)]
pub struct WalOptions {
    /// Roll to a new segment once the current one reaches this size (default 32 MiB).
    pub segment_bytes: u64,
    /// Rewrite the oldest segment's live records forward when there are more segments
    /// than this and the log is over its size bound (default 4; at least 2).
    pub max_segments: usize,
    /// `fdatasync` every append (default `true`). Turning it off trades durability
    /// across power loss for speed; a process crash still loses nothing written.
    pub sync: bool,
}

impl Default for WalOptions {
    fn default() -> Self {
        WalOptions {
            segment_bytes: 32 << 20,
            max_segments: 4,
            sync: true,
        }
    }
}

/// One segment file as the whole log sees it.
#[derive(Debug)]
struct Segment {
    path: PathBuf,
    /// Live procedures whose latest record is in this segment.
    live: usize,
    /// The encoded bytes of those records.
    live_bytes: u64,
    /// The file's length.
    bytes: u64,
}

/// Counters, for benchmarks and the `proctor` command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalStats {
    /// Frame bytes appended since open (checkpoints and seals included).
    pub bytes_appended: u64,
    /// Appends (frames) since open.
    pub appends: u64,
    /// Segments deleted since open.
    pub segments_deleted: u64,
    /// Records rewritten forward by compaction since open.
    pub records_rewritten: u64,
    /// The longest frame written since open, header included (`F` of the size bound).
    pub largest_frame: u64,
    /// Now: the encoded bytes of every live procedure's latest record (`L`).
    pub live_bytes: u64,
    /// Now: the bytes of all segment files.
    pub segment_bytes: u64,
    /// Now: the number of segment files.
    pub segments: usize,
}

/// A segmented write-ahead log in a directory. See the module docs.
///
/// ```
/// use proctor::{ProcedureStore, WalStore};
/// let dir = tempfile::tempdir().unwrap();
/// let mut store = WalStore::open(dir.path()).unwrap();
/// assert!(store.load().unwrap().records.is_empty());
/// // A second engine on the same directory is refused.
/// assert!(WalStore::open(dir.path()).is_err());
/// ```
pub struct WalStore<F: WalFs = StdFs> {
    fs: F,
    dir: PathBuf,
    options: WalOptions,
    _lock: Box<dyn Send>,
    segments: BTreeMap<u64, Segment>,
    current: F::Appender,
    current_seq: u64,
    current_len: u64,
    /// The LSN the next frame gets.
    next_lsn: u64,
    /// Where each live procedure's latest record is, and its encoded size.
    live: IdMap<ProcId, (u64, u32)>,
    live_bytes: u64,
    /// The bytes of all segment files.
    total_bytes: u64,
    max_id: u64,
    /// What open found, handed out by the first `load` or `load_parts`.
    opened: Option<StoreParts>,
    failed: Option<String>,
    buf: Vec<u8>,
    stats: WalStats,
}

impl<F: WalFs> std::fmt::Debug for WalStore<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalStore")
            .field("dir", &self.dir)
            .field("segments", &self.segments.len())
            .field("current_seq", &self.current_seq)
            .field("live", &self.live.len())
            .field("total_bytes", &self.total_bytes)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

fn io(context: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

fn corrupt(file: &Path, offset: u64, reason: impl fmt::Display) -> StoreError {
    StoreError::Corrupt {
        file: file.display().to_string(),
        offset,
        reason: reason.to_string(),
    }
}

fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:020}.wal"))
}

fn file_name(path: &Path) -> String {
    path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    )
}

/// Makes the directory's entries durable: what every creation or deletion of a
/// segment needs before anything relies on it. The one place that does it.
fn sync_dir(fs: &impl WalFs, dir: &Path) -> Result<(), StoreError> {
    fs.sync_dir(dir)
        .map_err(io(format!("syncing directory {}", dir.display())))
}

/// The segment files of a WAL directory, oldest first. Anything named `*.wal` must be a
/// regular file with a canonical name (`{seq:020}.wal`): a stray copy or a device must
/// never be replayed, and a FIFO must never be opened (it would block).
fn segment_files(fs: &impl WalFs, dir: &Path) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let mut files = Vec::new();
    let entries = fs
        .list(dir)
        .map_err(io(format!("reading {}", dir.display())))?;
    for entry in entries {
        let path = entry.path;
        let name = file_name(&path);
        let Some(stem) = name.strip_suffix(".wal") else {
            continue;
        };
        let seq = (stem.len() == 20 && stem.bytes().all(|b| b.is_ascii_digit()))
            .then(|| stem.parse::<u64>().ok())
            .flatten()
            .filter(|&seq| seq > 0 && seq <= wal::MAX_SEQ_OR_LSN)
            .ok_or_else(|| {
                corrupt(
                    &path,
                    0,
                    "unexpected file named like a segment: segment names are twenty \
                     digits, `{seq:020}.wal`, from 1 to 2^63 - 1; move it out of the WAL \
                     directory",
                )
            })?;
        // Checked before anything opens it: opening a FIFO would block.
        if !entry.regular {
            return Err(corrupt(
                &path,
                0,
                format!(
                    "not a regular file (a {}); a segment must be one",
                    entry.kind
                ),
            ));
        }
        files.push((seq, path));
    }
    files.sort();
    Ok(files)
}

/// A change that opening the store makes to repair what a crash left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Repair {
    /// The newest segment's torn tail is cut off at `offset`.
    Truncate {
        /// The segment.
        path: PathBuf,
        /// Where the good frames end.
        offset: u64,
        /// What was found there.
        reason: String,
    },
    /// A segment with no frame is removed (a torn first segment header, or the empty
    /// newest segment of an interrupted roll).
    Remove {
        /// The segment.
        path: PathBuf,
        /// Why it holds nothing.
        reason: String,
    },
    /// A segment below the start of the log is removed: compaction recorded that the
    /// log begins at segment `start`, and a crash came before the deletion of this one.
    Leftover {
        /// The segment.
        path: PathBuf,
        /// The segment the log begins at.
        start: u64,
    },
}

impl fmt::Display for Repair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Repair::Truncate {
                path,
                offset,
                reason,
            } => write!(
                f,
                "{}: torn tail truncated at byte {offset} ({reason})",
                path.display()
            ),
            Repair::Remove { path, reason } => write!(
                f,
                "{}: removed at byte 0, it holds no frame ({reason})",
                path.display()
            ),
            Repair::Leftover { path, start } => write!(
                f,
                "{}: removed, a leftover of an interrupted compaction below the start of \
                 the log (segment {start})",
                path.display()
            ),
        }
    }
}

/// One segment as a directory scan found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentReport {
    /// Its sequence number.
    pub seq: u64,
    /// Its file.
    pub path: PathBuf,
    /// Good frames, the seal included.
    pub frames: u64,
    /// Where its good frames end (its length once a torn tail is cut).
    pub good_len: u64,
    /// The header's `max_id`.
    pub max_id: u64,
    /// Whether it ends with a seal.
    pub sealed: bool,
    /// The format version of its header.
    pub version: u16,
    /// The LSN the frame after its good ones gets.
    pub next_lsn: u64,
}

/// What a read-only scan of a WAL directory found.
#[derive(Debug, Default)]
pub struct WalDirScan {
    /// The segments the log is made of, oldest first (without any the repairs remove).
    pub segments: Vec<SegmentReport>,
    /// What opening the store would repair, in order.
    pub repairs: Vec<Repair>,
    /// The damage that stopped the scan, always [`StoreError::Corrupt`]: the store
    /// refuses to open on it. The segments before it are in `segments`.
    pub damage: Option<StoreError>,
    /// The segment the log's newest start frame says it begins at; `None` if it has no
    /// start frame (see [`crate::wal`], *Where the log begins*).
    pub start: Option<u64>,
    /// How the last engine on the log stopped, as its stop frames say (see
    /// [`crate::wal`], *How the engine stopped*); [`LastStop::Unknown`] with damage.
    pub last_stop: LastStop,
}

/// Scans every segment of a WAL directory without changing anything: what
/// `proctor wal verify` reads, and what [`WalStore::open`] checks before it repairs.
/// Every frame of the log is decoded, so a record that does not decode is damage.
///
/// # Errors
/// [`StoreError::Io`] if the directory (a missing one included) or a segment cannot be
/// listed, opened or read. Damage is not an error: it is [`WalDirScan::damage`].
pub fn scan_wal_dir(dir: &Path) -> Result<WalDirScan, StoreError> {
    check_dir(&StdFs, dir).map(|(scan, _)| scan)
}

/// [`scan_wal_dir`], then every good frame of the log that precedes any damage (with
/// its segment's sequence number) handed to `on_frame`, oldest first: one frame in
/// memory at a time. Which segments count is known only once every segment has been
/// read (a start frame near the end of the log says where it begins), so their frames
/// are read a second time; leftovers below the start are not handed out, nor any
/// segment after a missing one.
///
/// # Errors
/// As [`scan_wal_dir`].
pub fn scan_wal_dir_with(
    dir: &Path,
    on_frame: &mut dyn FnMut(u64, Frame),
) -> Result<WalDirScan, StoreError> {
    scan_wal_dir_on(&StdFs, dir, on_frame)
}

/// [`scan_wal_dir_with`] on any [`WalFs`].
///
/// # Errors
/// As [`scan_wal_dir`], for any error `fs` returns.
pub fn scan_wal_dir_on<F: WalFs>(
    fs: &F,
    dir: &Path,
    on_frame: &mut dyn FnMut(u64, Frame),
) -> Result<WalDirScan, StoreError> {
    let (scan, counted) = check_dir(fs, dir)?;
    for segment in counted {
        scan_path(fs, &segment.path, segment.newest, None, &mut |raw| {
            on_frame(segment.seq, raw.decode()?);
            Ok(())
        })?;
    }
    Ok(scan)
}

/// How `proctor wal verify` saw a WAL directory (see [`view_wal_dir`]).
#[derive(Debug)]
pub enum DirView {
    /// A scan of the directory as it was: no engine changed its segments meanwhile.
    Stable {
        /// What the scan found.
        scan: WalDirScan,
        /// Whether a running engine holds the directory's lock. Then the view is the
        /// log as of the scan, and what a crash would leave for open to repair (a torn
        /// tail of the newest segment, the empty segment of a roll, leftovers below
        /// the start) is the engine's work in flight, not damage: [`WalDirScan::repairs`]
        /// lists it all the same.
        in_use: bool,
        /// The scans it took to see the directory unchanged from before to after one.
        attempts: u32,
    },
    /// A running engine changed the directory's segments during every scan: no
    /// verdict.
    Unstable {
        /// The scans tried.
        attempts: u32,
    },
}

/// How many scans [`view_wal_dir`] tries before it gives up on a directory that a
/// running engine keeps changing.
pub const VIEW_ATTEMPTS: u32 = 50;

/// [`scan_wal_dir`] for a directory an engine may be running on. If the lock is free,
/// it is held for the scan, so no engine starts and changes the directory meanwhile. If
/// a running engine holds it (or there is no lock file to take), the scan is of a
/// consistent view: the segment files are listed, scanned, and listed again, and the
/// scan is tried again (up to [`VIEW_ATTEMPTS`] times, with a short backoff) while the
/// two listings differ (a segment created or deleted, or a segment but the newest
/// changed length, as a seal does) or a file vanished during the scan. Compaction and
/// rolls then never pass for damage: a stable listing means none ran during the scan.
///
/// # Errors
/// As [`scan_wal_dir`], and [`StoreError::Io`] if the lock file cannot be probed.
pub fn view_wal_dir(dir: &Path) -> Result<DirView, StoreError> {
    view_wal_dir_on(&StdFs, dir)
}

/// [`view_wal_dir`] on any [`WalFs`].
///
/// # Errors
/// As [`view_wal_dir`], for any error `fs` returns.
pub fn view_wal_dir_on<F: WalFs>(fs: &F, dir: &Path) -> Result<DirView, StoreError> {
    let lock_path = dir.join("LOCK");
    let in_use = match fs
        .probe_lock(&lock_path)
        .map_err(io(format!("probing the lock {}", lock_path.display())))?
    {
        LockProbe::Taken(guard) => {
            let scan = scan_wal_dir_on(fs, dir, &mut |_, _| {});
            drop(guard);
            return scan.map(|scan| DirView::Stable {
                scan,
                in_use: false,
                attempts: 1,
            });
        }
        LockProbe::Held => true,
        LockProbe::Missing => false,
    };
    for attempt in 1..=VIEW_ATTEMPTS {
        let before = listing(fs, dir)?;
        match check_dir(fs, dir) {
            Ok((scan, _)) => {
                if listing(fs, dir)? == before {
                    return Ok(DirView::Stable {
                        scan,
                        in_use,
                        attempts: attempt,
                    });
                }
            }
            // A segment deleted between the listing and its reading.
            Err(StoreError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        // The engine is amid a roll or a compaction: let it finish.
        std::thread::sleep(std::time::Duration::from_micros(200 << attempt.min(6)));
    }
    Ok(DirView::Unstable {
        attempts: VIEW_ATTEMPTS,
    })
}

/// What a consistent view compares before and after its scan: each segment file's
/// number and, but for the newest (which a running engine appends to), its length.
/// Names that are not canonical give an empty listing: the scan reports them.
fn listing<F: WalFs>(fs: &F, dir: &Path) -> Result<Vec<(u64, Option<u64>)>, StoreError> {
    let files = match segment_files(fs, dir) {
        Ok(files) => files,
        Err(StoreError::Corrupt { .. }) => Vec::new(),
        Err(e) => return Err(e),
    };
    let last = files.len().saturating_sub(1);
    Ok(files
        .iter()
        .enumerate()
        .map(|(i, (seq, path))| (*seq, (i != last).then(|| fs.len(path).ok()).flatten()))
        .collect())
}

fn open_segment<F: WalFs>(fs: &F, path: &Path) -> Result<F::Reader, StoreError> {
    fs.open_read(path)
        .map_err(io(format!("opening {}", path.display())))
}

fn scan_path(
    fs: &impl WalFs,
    path: &Path,
    newest: bool,
    expect_first_lsn: Option<u64>,
    on_frame: &mut dyn FnMut(RawFrame) -> Result<(), FrameError>,
) -> Result<SegmentSummary, StoreError> {
    let mut reader = open_segment(fs, path)?;
    wal::scan_stream(&mut reader, newest, expect_first_lsn, on_frame)
        .map_err(io(format!("reading {}", path.display())))
}

/// Whether the segment's last frame is a seal (reads only its last bytes).
fn ends_with_seal(fs: &impl WalFs, path: &Path) -> Result<bool, StoreError> {
    let read = || -> io::Result<bool> {
        let len = fs.len(path)?;
        let mut file = fs.open_read(path)?;
        let tail = wal::FRAME_HEADER_LEN as u64;
        if len < (wal::SEGMENT_HEADER_LEN as u64) + tail {
            return Ok(false);
        }
        file.seek(SeekFrom::Start(len - tail))?;
        let mut buf = vec![0u8; wal::FRAME_HEADER_LEN];
        file.read_exact(&mut buf)?;
        Ok(wal::is_seal(&buf))
    };
    read().map_err(io(format!("reading {}", path.display())))
}

/// One segment file as a scan of the whole directory read it.
struct Scanned {
    seq: u64,
    path: PathBuf,
    /// Whether it was scanned as the newest segment (the only one a crash can tear).
    newest: bool,
    summary: SegmentSummary,
}

/// A segment whose good frames belong to the log and precede any damage.
struct Counted {
    seq: u64,
    path: PathBuf,
    newest: bool,
}

/// The read-only scan: every segment file streamed once (frames decoded, so that one
/// that does not decode is damage), then the checks of the whole log ([`check_log`]).
/// Returns the segments whose frames count, oldest first.
fn check_dir<F: WalFs>(fs: &F, dir: &Path) -> Result<(WalDirScan, Vec<Counted>), StoreError> {
    let mut out = WalDirScan::default();
    let Some(files) = listed_segments(fs, dir, &mut out)? else {
        return Ok((out, Vec::new()));
    };
    let last = files.len().saturating_sub(1);
    let mut scanned = Vec::with_capacity(files.len());
    for (i, (seq, path)) in files.into_iter().enumerate() {
        let newest = i == last;
        let summary = scan_path(fs, &path, newest, None, &mut |raw| raw.decode().map(drop))?;
        scanned.push(Scanned {
            seq,
            path,
            newest,
            summary,
        });
    }
    let counted = check_log(dir, &scanned, &mut out)
        .into_iter()
        .map(|i| Counted {
            seq: scanned[i].seq,
            path: scanned[i].path.clone(),
            newest: scanned[i].newest,
        })
        .collect();
    Ok((out, counted))
}

/// [`segments_to_scan`] for a scan, which reports damage rather than failing on it:
/// `None`, the damage in `out.damage`.
fn listed_segments(
    fs: &impl WalFs,
    dir: &Path,
    out: &mut WalDirScan,
) -> Result<Option<Vec<(u64, PathBuf)>>, StoreError> {
    match segments_to_scan(fs, dir, out) {
        Ok(files) => Ok(Some(files)),
        Err(damage @ StoreError::Corrupt { .. }) => {
            out.damage = Some(damage);
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The segment files of a log, oldest first: names checked, and the empty newest
/// segment of an interrupted roll left out (its removal queued in `out.repairs`).
/// Gaps are left to [`check_log`]: whether a gap is damage depends on where the log
/// begins, which only its start frames tell.
fn segments_to_scan(
    fs: &impl WalFs,
    dir: &Path,
    out: &mut WalDirScan,
) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let mut files = segment_files(fs, dir)?;
    // A crash mid-roll leaves a newest segment with no frame beside an unsealed
    // predecessor: the roll never finished, so the predecessor is the newest segment.
    if let [.., (before, previous), (last, newest)] = &files[..] {
        if *last == before + 1 {
            let has_frames = wal::first_frame_is_valid(&mut open_segment(fs, newest)?)
                .map_err(io(format!("reading {}", newest.display())))?;
            if !has_frames && !ends_with_seal(fs, previous)? {
                let summary = scan_path(fs, newest, true, None, &mut |_| Ok(()))?;
                if let ScanEnd::Corrupt { offset, reason } = summary.end {
                    return Err(corrupt(newest, offset, reason));
                }
                out.repairs.push(Repair::Remove {
                    path: newest.clone(),
                    reason: format!(
                        "the empty segment of an interrupted roll: {} is not sealed",
                        file_name(previous)
                    ),
                });
                files.pop();
            }
        }
    }
    Ok(files)
}

/// Checks the scans of every segment file, oldest first, as one log: where it begins
/// (its newest start frame), which files below that are leftovers (queued for removal
/// in `out.repairs`), then each segment of the log against its neighbours (no missing
/// number, header sequence number, LSN chain, seals, where a torn tail may be),
/// recording each in `out.segments`, each repair in `out.repairs`, and the first damage
/// in `out.damage`. Returns the indexes in `scanned` of the segments whose good frames
/// count: those of the log that precede the damage (the damaged one's frames before
/// the damage included).
fn check_log(dir: &Path, scanned: &[Scanned], out: &mut WalDirScan) -> Vec<usize> {
    let mut counted = Vec::new();
    match check_log_into(dir, scanned, out, &mut counted) {
        Err(damage) => out.damage = Some(damage),
        Ok(()) => {
            out.last_stop = counted.iter().fold(LastStop::Unknown, |before, &i| {
                scanned[i].summary.last_stop_after(before)
            });
        }
    }
    counted
}

fn check_log_into(
    dir: &Path,
    scanned: &[Scanned],
    out: &mut WalDirScan,
    counted: &mut Vec<usize>,
) -> Result<(), StoreError> {
    let Some(oldest) = scanned.first() else {
        return Ok(());
    };
    let newest_start = scanned
        .iter()
        .rev()
        .find_map(|s| s.summary.start.map(|m| (s, m)));
    let (start, why) = match (newest_start, oldest.summary.header) {
        (Some((s, m)), _) => (
            m.first,
            format!(
                "as its newest start frame says, in {} at byte {}",
                file_name(&s.path),
                m.offset
            ),
        ),
        // An older format recorded no start; and a bad header is damage of its own.
        (None, Some(h)) if h.version >= wal::FIRST_WITH_START => (
            1,
            "it has no start frame, so it begins at segment 1".to_string(),
        ),
        (None, _) => (oldest.seq, String::new()),
    };
    out.start = newest_start.map(|(_, m)| m.first);
    for leftover in scanned.iter().filter(|s| s.seq < start) {
        out.repairs.push(Repair::Leftover {
            path: leftover.path.clone(),
            start,
        });
    }
    let log: Vec<(usize, &Scanned)> = scanned
        .iter()
        .enumerate()
        .filter(|(_, s)| s.seq >= start)
        .collect();
    let only = log.len() == 1;
    let mut expect_first_lsn = None;
    let mut previous: Option<&Scanned> = None;
    for (i, s) in log {
        let (seq, path, summary) = (s.seq, &s.path, &s.summary);
        let expect_seq = previous.map_or(start, |p| p.seq + 1);
        if seq != expect_seq {
            let reason = match previous {
                None => format!(
                    "missing oldest segment: the log begins at segment {start} ({why}), and \
                     the oldest segment file is {}",
                    file_name(path)
                ),
                Some(p) => format!(
                    "missing segment: {} and {} exist, and segments are only deleted \
                     oldest first",
                    file_name(&p.path),
                    file_name(path)
                ),
            };
            return Err(corrupt(&segment_path(dir, expect_seq), 0, reason));
        }
        if let Some(header) = summary.header.filter(|h| h.seq != seq) {
            return Err(corrupt(
                path,
                0,
                format!(
                    "the header says segment {}, the file name says {seq}",
                    header.seq
                ),
            ));
        }
        let mismatch = summary
            .header
            .as_ref()
            .and_then(|h| wal::first_lsn_mismatch(h, expect_first_lsn));
        if let Some(ScanEnd::Corrupt { offset, reason } | ScanEnd::TornTail { offset, reason }) =
            mismatch
        {
            return Err(corrupt(path, offset, reason));
        }
        match summary.end.clone() {
            ScanEnd::Clean => {}
            ScanEnd::Corrupt { offset, reason } => {
                counted.push(i);
                return Err(corrupt(path, offset, reason));
            }
            ScanEnd::TornTail { offset: 0, reason } => {
                // A segment header is synced before anything else happens, so only the
                // creation of the very first segment can leave it torn.
                if !only || seq != 1 {
                    return Err(corrupt(path, 0, reason));
                }
                out.repairs.push(Repair::Remove {
                    path: path.clone(),
                    reason: format!("torn header of the first segment: {reason}"),
                });
                continue;
            }
            ScanEnd::TornTail { offset, reason } => out.repairs.push(Repair::Truncate {
                path: path.clone(),
                offset,
                reason: reason.to_string(),
            }),
        }
        let Some(header) = summary.header else {
            return Err(corrupt(path, 0, "no segment header"));
        };
        counted.push(i);
        if let Some(m) = summary.start.filter(|m| m.first > start) {
            return Err(corrupt(
                path,
                m.offset,
                format!(
                    "a start frame names segment {}, and a later one names {start}: the \
                     start of the log never moves back",
                    m.first
                ),
            ));
        }
        if !s.newest && !summary.sealed {
            return Err(corrupt(
                path,
                summary.good_len,
                format!(
                    "segment {seq} ends without a seal frame but segment {} follows: its \
                     end was cut off or lost",
                    seq + 1
                ),
            ));
        }
        if s.newest && summary.sealed {
            return Err(corrupt(
                &segment_path(dir, seq + 1),
                0,
                format!(
                    "missing newest segment: {} is sealed, so its successor was created, \
                     and it is gone",
                    file_name(path)
                ),
            ));
        }
        let next_lsn = summary.next_lsn().unwrap_or(header.first_lsn);
        expect_first_lsn = Some(next_lsn);
        previous = Some(s);
        out.segments.push(SegmentReport {
            seq,
            path: path.clone(),
            frames: summary.frames,
            good_len: summary.good_len,
            max_id: header.max_id,
            sealed: summary.sealed,
            version: header.version,
            next_lsn,
        });
    }
    Ok(())
}

/// Prepares the WAL directory: refuses a path that is not a directory, and creates a
/// missing one durably (each new directory's parent synced).
fn prepare_dir(fs: &impl WalFs, dir: &Path) -> Result<(), StoreError> {
    let kind = fs
        .is_dir(dir)
        .map_err(io(format!("opening {}", dir.display())))?;
    match kind {
        Some(true) => Ok(()),
        Some(false) => Err(StoreError::Io {
            context: format!(
                "{} is a regular file (or not a directory), not a WAL directory",
                dir.display()
            ),
            source: io::Error::from(io::ErrorKind::NotADirectory),
        }),
        None => {
            // Remember which ancestors are new: each one's entry in its parent must be
            // made durable too.
            let mut created = Vec::new();
            let mut at = Some(dir);
            while let Some(path) = at.filter(|p| !p.as_os_str().is_empty()) {
                let missing = fs
                    .is_dir(path)
                    .map_err(io(format!("opening {}", path.display())))?
                    .is_none();
                if !missing {
                    break;
                }
                created.push(path.to_path_buf());
                at = path.parent();
            }
            fs.create_dir_all(dir)
                .map_err(io(format!("creating {}", dir.display())))?;
            for path in created.iter().rev() {
                let parent = path
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                sync_dir(fs, parent)?;
            }
            Ok(())
        }
    }
}

/// A segment read whole and indexed: its summary and its good frames, in order.
struct IndexedSegment {
    summary: SegmentSummary,
    frames: Vec<RawFrame>,
}

/// The frames of each segment a scan kept, oldest first, with the segment's sequence
/// number.
type SegmentFrames = Vec<(u64, Vec<RawFrame>)>;

/// What [`WalStore::open_on`] and [`WalStore::load`] scan: the checks of
/// [`scan_wal_dir`], with each segment read whole on this thread, oldest first, and
/// indexed on another thread while the next one is read ([`index_segments`]). Returns
/// the frames of the segments that count.
fn scan_for_replay<F: WalFs>(
    fs: &F,
    dir: &Path,
) -> Result<(WalDirScan, SegmentFrames), StoreError> {
    let mut out = WalDirScan::default();
    let Some(files) = listed_segments(fs, dir, &mut out)? else {
        return Ok((out, Vec::new()));
    };
    let last = files.len().saturating_sub(1);
    let mut scanned = Vec::with_capacity(files.len());
    let mut frames = Vec::with_capacity(files.len());
    let indexed = index_segments(fs, &files);
    for (i, ((seq, path), segment)) in files.into_iter().zip(indexed).enumerate() {
        let IndexedSegment { summary, frames: f } = segment?;
        scanned.push(Scanned {
            seq,
            path,
            newest: i == last,
            summary,
        });
        frames.push(f);
    }
    let mut kept = Vec::new();
    for i in check_log(dir, &scanned, &mut out) {
        let f = std::mem::take(&mut frames[i]);
        if !f.is_empty() {
            kept.push((scanned[i].seq, f));
        }
    }
    Ok((out, kept))
}

/// Larger segment files are scanned as a stream on the opening thread, one frame in
/// memory at a time, not read whole: a segment is normally at most `segment_bytes` and
/// a frame, and a huge file (a sparse newest segment, say) must not cost its size.
const WHOLE_SEGMENT_MAX: u64 = 64 << 20;

/// Reads each of `files` whole, oldest first, on this thread, and indexes each on a
/// thread of its own (as many at once as there are cores) while the next is read. Each
/// segment's result is in its place.
fn index_segments<F: WalFs>(
    fs: &F,
    files: &[(u64, PathBuf)],
) -> Vec<Result<IndexedSegment, StoreError>> {
    let last = files.len().saturating_sub(1);
    let streamed = |path: &Path, newest: bool| {
        let mut frames = Vec::new();
        let summary = scan_path(fs, path, newest, None, &mut |f| {
            frames.push(f);
            Ok(())
        })?;
        Ok(IndexedSegment { summary, frames })
    };
    let threads = super::recover::cores();
    if threads == 1 || files.len() < 2 {
        return files
            .iter()
            .enumerate()
            .map(|(i, (_, path))| streamed(path, i == last))
            .collect();
    }
    let read = |path: &Path| -> Result<Option<Vec<u8>>, StoreError> {
        let len = fs
            .len(path)
            .map_err(io(format!("reading {}", path.display())))?;
        if len > WHOLE_SEGMENT_MAX {
            return Ok(None);
        }
        let mut bytes = Vec::new();
        open_segment(fs, path)?
            .read_to_end(&mut bytes)
            .map_err(io(format!("reading {}", path.display())))?;
        Ok(Some(bytes))
    };
    let index = |path: &Path, bytes: Vec<u8>, newest: bool| {
        let mut frames = Vec::new();
        let summary = wal::scan_shared(Arc::new(bytes), newest, &mut |f| {
            frames.push(f);
            Ok(())
        })
        .map_err(io(format!("reading {}", path.display())))?;
        Ok(IndexedSegment { summary, frames })
    };
    std::thread::scope(|scope| {
        let mut indexed = Vec::with_capacity(files.len());
        let mut running = std::collections::VecDeque::with_capacity(threads + 1);
        for (i, (_, path)) in files.iter().enumerate() {
            let newest = i == last;
            running.push_back(match read(path) {
                Ok(Some(bytes)) => {
                    Indexing::Running(scope.spawn(move || index(path, bytes, newest)))
                }
                Ok(None) => Indexing::Done(streamed(path, newest)),
                Err(e) => Indexing::Done(Err(e)),
            });
            if running.len() > threads {
                indexed.extend(running.pop_front().map(Indexing::joined));
            }
        }
        indexed.extend(running.into_iter().map(Indexing::joined));
        indexed
    })
}

/// A segment being indexed by [`index_segments`].
enum Indexing<'scope> {
    Running(std::thread::ScopedJoinHandle<'scope, Result<IndexedSegment, StoreError>>),
    Done(Result<IndexedSegment, StoreError>),
}

impl Indexing<'_> {
    /// The segment indexed; a worker's panic goes on in this thread.
    fn joined(self) -> Result<IndexedSegment, StoreError> {
        match self {
            Indexing::Running(worker) => super::recover::joined(worker),
            Indexing::Done(indexed) => indexed,
        }
    }
}

/// A live procedure's latest op and where it lies.
struct Latest<'a> {
    seq: u64,
    frame_offset: u64,
    op: &'a RawOp,
}

/// What replaying the frames gives.
struct Replayed {
    /// The latest record of every live procedure, in parts that no tree spans, each
    /// in tree order (by root, then id; see [`replay_part`]).
    parts: Vec<Vec<ProcRecord>>,
    /// Each live procedure's segment and the encoded size of its latest record.
    live: IdMap<ProcId, (u64, u32)>,
    /// The highest id an op names.
    max_id: u64,
}

/// The procedures of one part of a replay (see [`replay`]).
struct ReplayPart {
    records: Vec<ProcRecord>,
    live: Vec<(ProcId, (u64, u32))>,
    max_id: u64,
}

/// Below this many ops, a replay stays on the opening thread.
const PARALLEL_REPLAY_MIN: usize = 16_384;

/// Replays the frames of `segments` (oldest first): keeps the latest op of each
/// procedure, indexed, and decodes only the live ones, so a record that a later one
/// supersedes costs its index, not its decoding. With many ops the trees are split over
/// the cores by a hash of their root: each thread walks every frame, keeps the inserts
/// and updates of its own trees and every delete, and decodes its live records, so the
/// parts come out ready for a recovery that plans them on several threads
/// ([`ProcedureStore::load_parts`]).
///
/// # Errors
/// [`StoreError::Corrupt`] naming the segment and frame of a record that does not
/// decode (of the lowest id, as a replay in id order meets it first).
fn replay(dir: &Path, segments: SegmentFrames) -> Result<Replayed, StoreError> {
    let ids = IdSpan::of(&segments);
    let threads = if ids.ops < PARALLEL_REPLAY_MIN {
        1
    } else {
        super::recover::cores()
    };
    replay_spanned(dir, segments, ids, threads)
}

/// [`replay`] in `threads` parts (the tests pick the count).
#[cfg(test)]
fn replay_on(dir: &Path, segments: SegmentFrames, threads: usize) -> Result<Replayed, StoreError> {
    let ids = IdSpan::of(&segments);
    replay_spanned(dir, segments, ids, threads)
}

/// [`replay`] in `threads` parts, the ids of `segments` being `ids`.
fn replay_spanned(
    dir: &Path,
    segments: SegmentFrames,
    ids: IdSpan,
    threads: usize,
) -> Result<Replayed, StoreError> {
    if threads > 1 {
        if let Some(replayed) = split_replay(dir, &segments, ids, threads) {
            return Ok(replayed);
        }
        // The parts do not add up: a procedure whose records name two roots is live in
        // two parts, or a record does not decode (and which error a replay in order
        // meets first is the one to report). The replay in order decides.
    }
    let part = replay_part(dir, &segments, ids, 0, 1).map_err(|(_, e)| e)?;
    Ok(Replayed {
        parts: vec![part.records],
        live: part.live.into_iter().collect(),
        max_id: part.max_id,
    })
}

/// The replay in `parts` parts on scoped threads, or `None` if a part meets a record
/// that does not decode or a procedure is live in two parts. Otherwise the parts give
/// exactly what a replay in order gives: a procedure's inserts and updates after its
/// last delete all name one root (or it would be live in two parts), so they are all
/// in that root's part, in order.
fn split_replay(
    dir: &Path,
    segments: &SegmentFrames,
    ids: IdSpan,
    parts: usize,
) -> Option<Replayed> {
    let results = super::recover::on_threads((0..parts).collect(), |part| {
        replay_part(dir, segments, ids, part, parts)
    });
    let live_count = results
        .iter()
        .map(|part| part.as_ref().map_or(0, |p| p.live.len()))
        .sum();
    let mut replayed = Replayed {
        parts: Vec::with_capacity(parts),
        live: IdMap::with_capacity_and_hasher(live_count, Default::default()),
        max_id: 0,
    };
    for part in results {
        let part = part.ok()?;
        for (id, at) in part.live {
            if replayed.live.insert(id, at).is_some() {
                return None;
            }
        }
        replayed.max_id = replayed.max_id.max(part.max_id);
        replayed.parts.push(part.records);
    }
    Some(replayed)
}

/// Which of `parts` parts of a replay the tree of root `root` belongs to: a
/// multiplicative hash, since ids often share a stride (every other root, say).
fn part_of(root: ProcId, parts: usize) -> usize {
    (root.0.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % parts
}

/// Part `part` of [`replay`]: the live procedures of the trees of that part, their
/// records decoded in tree order (by root, then id); or the lowest id whose record does
/// not decode, with the error.
fn replay_part(
    dir: &Path,
    segments: &SegmentFrames,
    ids: IdSpan,
    part: usize,
    parts: usize,
) -> Result<ReplayPart, (ProcId, StoreError)> {
    let mut latest = LatestIndex::for_span(ids);
    for (seq, frames) in segments {
        for frame in frames {
            for op in &frame.ops {
                match op.kind {
                    OpKind::Insert | OpKind::Update => {
                        if parts > 1 && part_of(op.root, parts) != part {
                            continue;
                        }
                        let at = Latest {
                            seq: *seq,
                            frame_offset: frame.offset,
                            op,
                        };
                        latest.set(op.id, Some(at));
                    }
                    // A delete names no root: every part applies it.
                    OpKind::Delete => latest.set(op.id, None),
                }
            }
        }
    }
    // Decoded in tree order (by root, then id), so the records come out grouped as
    // recovery plans them and need not move again. The keys are copied out of the
    // index first: sorting through a pointer per comparison misses the cache.
    let mut latest = latest.into_keyed();
    latest.sort_unstable_by_key(|&(key, _)| key);
    let mut records = Vec::with_capacity(latest.len());
    // The error to report is the lowest id's, as a replay in id order meets it first.
    let mut bad: Option<(ProcId, StoreError)> = None;
    for (_, l) in &latest {
        let why = match l.op.decode() {
            // The index may not have read the root (a record in another form): one
            // that lands in another tree's part sends the replay back to order.
            Ok(StoreOp::Insert(r) | StoreOp::Update(r)) if parts > 1 && r.root != l.op.root => {
                format!("indexed as root {}, its record says {}", l.op.root, r.root)
            }
            Ok(StoreOp::Insert(r) | StoreOp::Update(r)) => {
                records.push(r);
                continue;
            }
            Ok(StoreOp::Delete(_)) => unreachable!("a delete is never live"),
            Err(e) => e.to_string(),
        };
        if bad.as_ref().is_none_or(|(id, _)| l.op.id < *id) {
            let at = corrupt(&segment_path(dir, l.seq), l.frame_offset, why);
            bad = Some((l.op.id, at));
        }
    }
    if let Some(bad) = bad {
        return Err(bad);
    }
    Ok(ReplayPart {
        records,
        live: latest
            .iter()
            .map(|(_, l)| (l.op.id, (l.seq, l.op.size())))
            .collect(),
        max_id: ids.max_id(),
    })
}

/// The ids the ops of a log name: the lowest, the highest, and how many ops.
#[derive(Clone, Copy, Debug, PartialEq)]
struct IdSpan {
    first: u64,
    last: u64,
    ops: usize,
}

impl IdSpan {
    fn of(segments: &SegmentFrames) -> IdSpan {
        let mut span = IdSpan {
            first: u64::MAX,
            last: 0,
            ops: 0,
        };
        for op in segments.iter().flat_map(|(_, f)| f).flat_map(|f| &f.ops) {
            span.first = span.first.min(op.id.0);
            span.last = span.last.max(op.id.0);
            span.ops += 1;
        }
        span
    }

    /// The highest id an op names (0 for none).
    fn max_id(self) -> u64 {
        self.last
    }

    /// Slots for every id from the lowest to the highest, if that is at most
    /// [`DENSE_SLOTS_PER_OP`] per op.
    fn dense_len(self) -> Option<usize> {
        if self.ops == 0 {
            return None;
        }
        let len = usize::try_from(self.last - self.first)
            .ok()?
            .checked_add(1)?;
        (len <= self.ops.saturating_mul(DENSE_SLOTS_PER_OP)).then_some(len)
    }
}

/// How many slots (24 bytes each) per op a replay part's index may take to keep
/// latest ops by position rather than in a map. A map holds an entry of 32 bytes per
/// live id, at a load of 1/2 to 7/8 after growing through every smaller table, so up to
/// four slots per op cost about what it does, with no hashing and no growth.
const DENSE_SLOTS_PER_OP: usize = 4;

/// A replay part's latest op of each procedure. Ids are handed out in order and a log
/// keeps the recent ones, so they usually fill their span: then by position (a slot
/// per id from the lowest); ids spread thin (a few old procedures among many newer
/// ones, long deleted) go in a map.
enum LatestIndex<'a> {
    Dense {
        first: u64,
        slots: Vec<Option<Latest<'a>>>,
        /// The slots filled.
        filled: usize,
    },
    Sparse(IdMap<ProcId, Latest<'a>>),
}

impl<'a> LatestIndex<'a> {
    fn for_span(ids: IdSpan) -> Self {
        match ids.dense_len() {
            Some(len) => {
                let mut slots = Vec::with_capacity(len);
                slots.resize_with(len, || None);
                LatestIndex::Dense {
                    first: ids.first,
                    slots,
                    filled: 0,
                }
            }
            None => LatestIndex::Sparse(IdMap::default()),
        }
    }

    /// Sets `id`'s latest op (`None`: it was deleted).
    fn set(&mut self, id: ProcId, at: Option<Latest<'a>>) {
        match self {
            LatestIndex::Dense {
                first,
                slots,
                filled,
            } => {
                let slot = &mut slots[Self::slot(*first, id)];
                *filled = *filled + usize::from(at.is_some()) - usize::from(slot.is_some());
                *slot = at;
            }
            LatestIndex::Sparse(map) => match at {
                Some(at) => {
                    map.insert(id, at);
                }
                None => {
                    map.remove(&id);
                }
            },
        }
    }

    /// Every id's slot: the span was taken over the same ops.
    fn slot(first: u64, id: ProcId) -> usize {
        (id.0 - first) as usize
    }

    /// The latest ops, each keyed by its tree order (root, then id), in no order.
    fn into_keyed(self) -> Vec<((ProcId, ProcId), Latest<'a>)> {
        let keyed = |l: Latest<'a>| ((l.op.root, l.op.id), l);
        match self {
            LatestIndex::Dense { slots, filled, .. } => {
                // Sized up front: a filtered iterator's `collect` grows from a guess.
                let mut out = Vec::with_capacity(filled);
                out.extend(slots.into_iter().flatten().map(keyed));
                out
            }
            LatestIndex::Sparse(map) => map.into_values().map(keyed).collect(),
        }
    }
}

impl WalStore<StdFs> {
    /// Opens (or creates) the WAL in `dir` with default options.
    ///
    /// # Errors
    /// As [`WalStore::open_with`].
    pub fn open(dir: impl AsRef<Path>) -> Result<WalStore, StoreError> {
        Self::open_with(dir, WalOptions::default())
    }

    /// Opens (or creates) the WAL in `dir`: locks it, scans it, repairs what a crash
    /// left (reported by the first [`load`](ProcedureStore::load)), and refuses damage.
    ///
    /// # Errors
    /// [`StoreError::Locked`] if another engine holds `DIR/LOCK`; [`StoreError::Corrupt`]
    /// (file and offset) for damage a crash cannot explain (see the module docs);
    /// [`StoreError::Io`] if `dir` is not a directory or cannot be created, or a file
    /// cannot be locked, read, repaired, created or compacted; [`StoreError::Failed`] if
    /// compaction at open finds a segment's live records miscounted (a bug).
    ///
    /// # Panics
    /// If `max_segments < 2` or `segment_bytes` cannot hold a header and a frame header.
    pub fn open_with(dir: impl AsRef<Path>, options: WalOptions) -> Result<WalStore, StoreError> {
        WalStore::open_on(StdFs, dir, options)
    }
}

impl<F: WalFs> WalStore<F> {
    /// [`WalStore::open_with`] on the file system `fs`.
    ///
    /// # Errors
    /// As [`WalStore::open_with`], for any error `fs` returns.
    ///
    /// # Panics
    /// If `max_segments < 2` or `segment_bytes` cannot hold a header and a frame header.
    pub fn open_on(fs: F, dir: impl AsRef<Path>, options: WalOptions) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        assert!(options.max_segments >= 2, "max_segments must be at least 2");
        assert!(
            options.segment_bytes > (wal::SEGMENT_HEADER_LEN + wal::FRAME_HEADER_LEN) as u64,
            "segment_bytes is too small"
        );
        prepare_dir(&fs, &dir)?;
        let lock_path = dir.join("LOCK");
        let lock = fs
            .lock(&lock_path)
            .map_err(io(format!("locking {}", lock_path.display())))?
            .ok_or_else(|| StoreError::Locked {
                file: lock_path.display().to_string(),
            })?;

        let (scan, segments) = scan_for_replay(&fs, &dir)?;
        if let Some(damage) = scan.damage {
            return Err(damage);
        }
        let replayed = replay(&dir, segments)?;
        let parts = replayed.parts;
        let mut repairs = Vec::new();
        for repair in &scan.repairs {
            match repair {
                Repair::Truncate { path, offset, .. } => {
                    fs.truncate(path, *offset)
                        .map_err(io(format!("truncating {}", path.display())))?;
                }
                Repair::Remove { path, .. } | Repair::Leftover { path, .. } => {
                    fs.remove_file(path)
                        .map_err(io(format!("removing {}", path.display())))?;
                    sync_dir(&fs, &dir)?;
                }
            }
            tracing::warn!(%repair, "repaired the WAL");
            repairs.push(repair.to_string());
        }

        let mut max_id = replayed.max_id;
        let mut segments = BTreeMap::new();
        for report in &scan.segments {
            max_id = max_id.max(report.max_id);
            segments.insert(
                report.seq,
                Segment {
                    path: report.path.clone(),
                    live: 0,
                    live_bytes: 0,
                    bytes: report.good_len,
                },
            );
        }
        let mut live_bytes = 0;
        let live = replayed.live;
        for &(seq, size) in live.values() {
            if let Some(s) = segments.get_mut(&seq) {
                s.live += 1;
                s.live_bytes += u64::from(size);
                live_bytes += u64::from(size);
            }
        }
        let (current_seq, current, current_len, next_lsn) = match scan.segments.last() {
            Some(report) => {
                let file = fs
                    .open_append(&report.path)
                    .map_err(io(format!("opening {}", report.path.display())))?;
                (report.seq, file, report.good_len, report.next_lsn)
            }
            None => {
                let (file, path) = create_segment(&fs, &dir, 1, max_id, 1)?;
                let bytes = wal::SEGMENT_HEADER_LEN as u64;
                segments.insert(
                    1,
                    Segment {
                        path,
                        live: 0,
                        live_bytes: 0,
                        bytes,
                    },
                );
                (1, file, bytes, 1)
            }
        };
        let total_bytes = segments.values().map(|s| s.bytes).sum();
        let mut store = WalStore {
            fs,
            dir,
            options,
            _lock: lock,
            segments,
            current,
            current_seq,
            current_len,
            next_lsn,
            live,
            live_bytes,
            total_bytes,
            max_id,
            opened: Some(StoreParts {
                parts,
                max_id,
                repairs,
                last_stop: scan.last_stop.clone(),
            }),
            failed: None,
            buf: Vec::new(),
            stats: WalStats::default(),
        };
        if scan
            .segments
            .last()
            .is_some_and(|s| s.version < wal::VERSION && !s.sealed)
        {
            // Written by an older build: this one's records go to a segment of its own
            // version, so that the older build, reading the log again, refuses the new
            // segment by its header rather than taking its records for damage.
            store.roll()?;
        }
        match scan.segments.first() {
            Some(oldest) if scan.start.is_none() && oldest.version < wal::FIRST_WITH_START => {
                // An older format recorded no start, so the log began at its oldest
                // segment: said now, a loss of that segment is seen from here on.
                store.write_start(oldest.seq)?;
            }
            _ => {}
        }
        store.collect_garbage()?;
        Ok(store)
    }

    /// What the store has done since it was opened, and its size now.
    pub fn stats(&self) -> WalStats {
        WalStats {
            live_bytes: self.live_bytes,
            segment_bytes: self.total_bytes,
            segments: self.segments.len(),
            ..self.stats
        }
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn fail(&mut self, err: StoreError) -> StoreError {
        self.failed = Some(err.to_string());
        err
    }

    /// Writes one frame to the current segment (rolling first if it is full) and syncs.
    fn write_frame(&mut self, kind: FrameKind, ops: &[StoreOp]) -> Result<(), StoreError> {
        self.buf.clear();
        let sizes = wal::encode_frame(kind, self.next_lsn, ops, &mut self.buf).map_err(|e| {
            StoreError::Io {
                context: "encoding a WAL frame".into(),
                source: io::Error::new(io::ErrorKind::InvalidData, e),
            }
        })?;
        self.write_encoded(
            ops.iter()
                .zip(sizes)
                .map(|(op, size)| (OpKind::of(op), op.proc_id(), size)),
        )
    }

    /// Writes a checkpoint frame of ops copied as they are, not re-encoded.
    fn write_checkpoint(&mut self, ops: &[RawOp]) -> Result<(), StoreError> {
        self.buf.clear();
        wal::encode_raw_frame(
            FrameKind::Checkpoint,
            self.next_lsn,
            ops.iter().map(RawOp::bytes),
            &mut self.buf,
        )
        .map_err(|e| StoreError::Io {
            context: "encoding a WAL checkpoint".into(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        self.write_encoded(ops.iter().map(|op| (op.kind, op.id, op.size())))
    }

    /// Writes the frame encoded in `buf`, holding `ops` (kind, procedure, encoded size),
    /// and counts its records live.
    fn write_encoded(
        &mut self,
        ops: impl Iterator<Item = (OpKind, ProcId, u32)>,
    ) -> Result<(), StoreError> {
        let len = self.buf.len() as u64;
        let mut start_len = 0;
        if self.current_len + len > self.options.segment_bytes
            && self.current_len > wal::SEGMENT_HEADER_LEN as u64
        {
            self.roll()?;
            // A new segment begins by saying where the log begins, so that the newest
            // segment knows it even when the older one that said it last is lost. It
            // goes in the same write and sync as the frame, which takes the LSN after
            // it (the seal took the one the frame was encoded with).
            let first = self
                .segments
                .keys()
                .next()
                .copied()
                .unwrap_or(self.current_seq);
            let mut both = Vec::with_capacity(self.buf.len() + 32);
            wal::encode_start_frame(self.next_lsn, first, &mut both);
            start_len = both.len() as u64;
            wal::set_frame_lsn(&mut self.buf, self.next_lsn + 1);
            both.extend_from_slice(&self.buf);
            self.buf = both;
        }
        if let Err(e) = self.write_current() {
            let path = self.segments[&self.current_seq].path.display().to_string();
            return Err(self.fail(io(format!("appending to {path}"))(e)));
        }
        if start_len > 0 {
            self.account_written(start_len);
        }
        self.account_written(len);
        for (kind, id, size) in ops {
            self.max_id = self.max_id.max(id.0);
            let old = match kind {
                OpKind::Insert | OpKind::Update => {
                    if let Some(s) = self.segments.get_mut(&self.current_seq) {
                        s.live += 1;
                        s.live_bytes += u64::from(size);
                    }
                    self.live_bytes += u64::from(size);
                    self.live.insert(id, (self.current_seq, size))
                }
                OpKind::Delete => self.live.remove(&id),
            };
            if let Some((seq, size)) = old {
                if let Some(s) = self.segments.get_mut(&seq) {
                    s.live -= 1;
                    s.live_bytes -= u64::from(size);
                }
                self.live_bytes -= u64::from(size);
            }
        }
        Ok(())
    }

    /// Writes `buf` to the current segment and syncs it (if configured).
    fn write_current(&mut self) -> io::Result<()> {
        self.current.write_all(&self.buf)?;
        if self.options.sync {
            self.fs.sync(&mut self.current)?;
        }
        Ok(())
    }

    /// Counts `len` bytes just written to the current segment, which took one LSN.
    fn account_written(&mut self, len: u64) {
        self.current_len += len;
        self.total_bytes += len;
        if let Some(s) = self.segments.get_mut(&self.current_seq) {
            s.bytes += len;
        }
        self.next_lsn += 1;
        self.stats.bytes_appended += len;
        self.stats.appends += 1;
        self.stats.largest_frame = self.stats.largest_frame.max(len);
    }

    /// Creates the next segment, then seals the current one: in that order, so that a
    /// sealed segment always has a successor on disk (see [`crate::wal`]).
    fn roll(&mut self) -> Result<(), StoreError> {
        let seal_lsn = self.next_lsn;
        let seq = self.current_seq + 1;
        let (file, path) = create_segment(&self.fs, &self.dir, seq, self.max_id, seal_lsn + 1)
            .map_err(|e| self.fail(e))?;
        let mut seal = Vec::new();
        // A seal holds no ops, so encoding it cannot fail.
        let _ = wal::encode_frame(FrameKind::Seal, seal_lsn, &[], &mut seal);
        let frame = std::mem::replace(&mut self.buf, seal);
        let written = self.write_current();
        let seal_len = self.buf.len() as u64;
        self.buf = frame;
        if let Err(e) = written {
            let path = self.segments[&self.current_seq].path.display().to_string();
            return Err(self.fail(io(format!("sealing {path}"))(e)));
        }
        self.account_written(seal_len);
        let header = wal::SEGMENT_HEADER_LEN as u64;
        self.segments.insert(
            seq,
            Segment {
                path,
                live: 0,
                live_bytes: 0,
                bytes: header,
            },
        );
        self.total_bytes += header;
        self.current = file;
        self.current_seq = seq;
        self.current_len = header;
        Ok(())
    }

    /// Whether the log is over its size bound: more than `max_segments` segments and
    /// more than `2·L + M·S` bytes (see the module docs).
    fn over_bound(&self) -> bool {
        let m = self.options.max_segments as u64;
        self.segments.len() as u64 > m
            && self.total_bytes > 2 * self.live_bytes + m.saturating_mul(self.options.segment_bytes)
    }

    /// Deletes the oldest segment while it holds no live record; rewrites the oldest
    /// segment's live records forward while the log is over its bound, or has more than
    /// `max_segments` segments and the oldest is at most half live (that rewrite frees
    /// more than it writes); at most once per segment that exists when the call starts
    /// (one pass always suffices for the bound).
    fn collect_garbage(&mut self) -> Result<(), StoreError> {
        let mut rewrites_left = self.segments.len();
        loop {
            let Some((&oldest, segment)) = self.segments.iter().next() else {
                return Ok(());
            };
            if oldest == self.current_seq {
                return Ok(());
            }
            if segment.live == 0 {
                self.delete_oldest()?;
                continue;
            }
            let mostly_dead = self.segments.len() > self.options.max_segments
                && segment.live_bytes * 2 <= segment.bytes;
            if !(mostly_dead || self.over_bound()) || rewrites_left == 0 {
                return Ok(());
            }
            rewrites_left -= 1;
            self.rewrite_forward(oldest)?;
        }
    }

    /// Deletes the run of oldest segments that hold no live record (the current one
    /// aside). Oldest first, so a Delete in a later segment never outlives what it
    /// deletes: nothing older is left to resurrect. First a start frame says where the
    /// log now begins, synced, so that a crash amid the deletions leaves leftovers below
    /// the start (removed at open) rather than a log that seems to begin later, and so
    /// that a segment lost from the oldest end is seen (see [`crate::wal`], *Where the
    /// log begins*). One directory sync after the run makes the deletions durable.
    fn delete_oldest(&mut self) -> Result<(), StoreError> {
        let dead: Vec<u64> = self
            .segments
            .iter()
            .take_while(|&(&seq, s)| seq != self.current_seq && s.live == 0)
            .map(|(&seq, _)| seq)
            .collect();
        let Some(&last) = dead.last() else {
            return Ok(());
        };
        self.write_start(last + 1)?;
        for seq in dead {
            let Some(path) = self.segments.get(&seq).map(|s| s.path.clone()) else {
                continue;
            };
            self.fs
                .remove_file(&path)
                .map_err(io(format!("removing {}", path.display())))?;
            if let Some(segment) = self.segments.remove(&seq) {
                self.total_bytes -= segment.bytes;
                self.stats.segments_deleted += 1;
            }
        }
        sync_dir(&self.fs, &self.dir)
    }

    /// Appends a stop frame, synced: how the engine stopped (see [`crate::wal`], *How
    /// the engine stopped*).
    fn write_stop(&mut self, stop: &LastStop) -> Result<(), StoreError> {
        if let Some(reason) = &self.failed {
            return Err(StoreError::Failed(reason.clone()));
        }
        self.opened = None;
        self.buf.clear();
        wal::encode_stop_frame(self.next_lsn, stop, &mut self.buf).map_err(|e| StoreError::Io {
            context: "encoding a WAL stop frame".into(),
            source: io::Error::new(io::ErrorKind::InvalidData, e),
        })?;
        self.write_encoded(std::iter::empty())?;
        self.collect_garbage().map_err(|e| self.fail(e))
    }

    /// Appends a start frame: the log begins at segment `first`.
    fn write_start(&mut self, first: u64) -> Result<(), StoreError> {
        self.buf.clear();
        wal::encode_start_frame(self.next_lsn, first, &mut self.buf);
        self.write_encoded(std::iter::empty())
    }

    /// Appends the latest records still in segment `seq` as checkpoint frames of about a
    /// quarter segment each.
    fn rewrite_forward(&mut self, seq: u64) -> Result<(), StoreError> {
        let path = self.segments[&seq].path.clone();
        // The latest op of each procedure in the segment, copied forward as written:
        // nothing is decoded.
        let mut latest: BTreeMap<ProcId, RawOp> = BTreeMap::new();
        let summary = scan_path(&self.fs, &path, false, None, &mut |frame| {
            for op in frame.ops {
                match op.kind {
                    OpKind::Insert | OpKind::Update => {
                        latest.insert(op.id, op);
                    }
                    OpKind::Delete => {
                        latest.remove(&op.id);
                    }
                }
            }
            Ok(())
        })?;
        if let ScanEnd::Corrupt { offset, reason } | ScanEnd::TornTail { offset, reason } =
            summary.end
        {
            return Err(corrupt(&path, offset, reason));
        }
        let ops: Vec<RawOp> = latest
            .into_values()
            .filter(|op| {
                // The store's count says which is live here, and its size must agree.
                matches!(self.live.get(&op.id), Some(&(at, size)) if at == seq && size == op.size())
            })
            .collect();
        if ops.len() != self.segments[&seq].live {
            return Err(StoreError::Failed(format!(
                "segment {seq} holds {} live records, the store counted {}",
                ops.len(),
                self.segments[&seq].live
            )));
        }
        self.stats.records_rewritten += ops.len() as u64;
        // Bounded chunks, so one checkpoint never makes a giant frame.
        let target = (self.options.segment_bytes / 4).max(1);
        let mut chunk = Vec::new();
        let mut chunk_bytes = 0;
        for op in ops {
            chunk_bytes += u64::from(op.size());
            chunk.push(op);
            if chunk_bytes >= target {
                self.write_checkpoint(&chunk)?;
                chunk.clear();
                chunk_bytes = 0;
            }
        }
        if !chunk.is_empty() {
            self.write_checkpoint(&chunk)?;
        }
        Ok(())
    }
}

fn create_segment<F: WalFs>(
    fs: &F,
    dir: &Path,
    seq: u64,
    max_id: u64,
    first_lsn: u64,
) -> Result<(F::Appender, PathBuf), StoreError> {
    let path = segment_path(dir, seq);
    let mut file = fs
        .create_new(&path)
        .map_err(io(format!("creating {}", path.display())))?;
    file.write_all(&wal::segment_header(seq, max_id, first_lsn))
        .and_then(|()| fs.sync(&mut file))
        .map_err(io(format!("writing the header of {}", path.display())))?;
    // The new name must be durable before anything relies on it (a seal of the
    // previous segment, or a frame in this one).
    sync_dir(fs, dir)?;
    Ok((file, path))
}

impl<F: WalFs> ProcedureStore for WalStore<F> {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        if let Some(reason) = &self.failed {
            return Err(StoreError::Failed(reason.clone()));
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.opened = None;
        self.write_frame(FrameKind::Batch, ops)?;
        self.collect_garbage().map_err(|e| self.fail(e))
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        self.load_parts().map(StoreParts::into_snapshot)
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        self.write_stop(&LastStop::Drained {
            cut_off: cut_off.to_vec(),
        })
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        self.write_stop(&LastStop::Unknown)
    }

    fn load_parts(&mut self) -> Result<StoreParts, StoreError> {
        if let Some(parts) = self.opened.take() {
            return Ok(parts);
        }
        let (scan, segments) = scan_for_replay(&self.fs, &self.dir)?;
        if let Some(damage) = scan.damage {
            return Err(damage);
        }
        Ok(StoreParts {
            parts: replay(&self.dir, segments)?.parts,
            max_id: self.max_id,
            repairs: Vec::new(),
            last_stop: scan.last_stop,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::procedure::ProcState;

    /// Procedure `id`'s record: in the tree of root `id - id % 5` (itself for a
    /// multiple of 5, and for ids below 5).
    fn record(id: u64, version: u64) -> ProcRecord {
        let root = Some(id - id % 5).filter(|&r| r != 0 && r != id);
        ProcRecord {
            id: ProcId(id),
            parent: root.map(ProcId),
            root: ProcId(root.unwrap_or(id)),
            type_name: "t".into(),
            state: ProcState::Runnable,
            stack_indexes: (0..(version % 5) as u32).collect(),
            failure: None,
            failure_seq: None,
            submitted_ms: 0,
            updated_ms: version,
            wake_at_ms: None,
            event: None,
            data: version.to_be_bytes().to_vec(),
            locks: None,
            deadline_ms: None,
            nonce: None,
            result: None,
            bypassed: false,
            steering: Default::default(),
        }
    }

    /// A frame at `offset` holding `ops`, indexed as a scan indexes it.
    fn frame(offset: u64, ops: &[StoreOp]) -> RawFrame {
        let payload = rmp_serde::to_vec(ops).unwrap();
        RawFrame {
            offset,
            len: payload.len() as u64,
            lsn: offset,
            kind: FrameKind::Batch,
            ops: wal::index_payload(FrameKind::Batch, Arc::new(payload)).unwrap(),
        }
    }

    /// Three segments of seeded inserts, updates and deletes over 300 ids, and what
    /// applying them in order leaves.
    fn log() -> (SegmentFrames, BTreeMap<ProcId, ProcRecord>) {
        log_spread(1)
    }

    /// As [`log`], with the ids `stride` apart.
    fn log_spread(stride: u64) -> (SegmentFrames, BTreeMap<ProcId, ProcRecord>) {
        let mut model = BTreeMap::new();
        let mut segments = Vec::new();
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        for seq in 1..=3 {
            let mut frames = Vec::new();
            for f in 0..40 {
                let ops: Vec<StoreOp> = (0..25)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let id = 1 + (x % 300) * stride;
                        match x >> 60 {
                            0..=2 => StoreOp::Delete(ProcId(id)),
                            _ => StoreOp::Update(record(id, x >> 40)),
                        }
                    })
                    .collect();
                for op in &ops {
                    op.clone().apply_to(&mut model);
                }
                frames.push(frame(f * 1000, &ops));
            }
            segments.push((seq, frames));
        }
        (segments, model)
    }

    /// The real file system, as seen beside an engine that holds the lock and changes
    /// the length of some older segment between any two looks.
    struct Churning(std::sync::atomic::AtomicU64);

    impl WalFs for Churning {
        type Appender = File;
        type Reader = BufReader<File>;

        fn is_dir(&self, path: &Path) -> io::Result<Option<bool>> {
            StdFs.is_dir(path)
        }
        fn create_dir_all(&self, path: &Path) -> io::Result<()> {
            StdFs.create_dir_all(path)
        }
        fn sync_dir(&self, dir: &Path) -> io::Result<()> {
            StdFs.sync_dir(dir)
        }
        fn lock(&self, path: &Path) -> io::Result<Option<Box<dyn Send>>> {
            StdFs.lock(path)
        }
        fn probe_lock(&self, _path: &Path) -> io::Result<LockProbe> {
            Ok(LockProbe::Held)
        }
        fn list(&self, dir: &Path) -> io::Result<Vec<Entry>> {
            StdFs.list(dir)
        }
        fn open_read(&self, path: &Path) -> io::Result<Self::Reader> {
            StdFs.open_read(path)
        }
        fn len(&self, path: &Path) -> io::Result<u64> {
            let looks = self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(StdFs.len(path)? + looks)
        }
        fn create_new(&self, path: &Path) -> io::Result<File> {
            StdFs.create_new(path)
        }
        fn open_append(&self, path: &Path) -> io::Result<File> {
            StdFs.open_append(path)
        }
        fn sync(&self, file: &mut File) -> io::Result<()> {
            StdFs.sync(file)
        }
        fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
            StdFs.truncate(path, len)
        }
        fn remove_file(&self, path: &Path) -> io::Result<()> {
            StdFs.remove_file(path)
        }
    }

    /// A directory whose segments change between every two listings gives no view, and
    /// no verdict; the same directory at rest, its lock held elsewhere, gives a view of
    /// the log, in use.
    #[test]
    fn a_directory_that_never_holds_still_gives_no_verdict() {
        let dir = tempfile::tempdir().unwrap();
        let options = WalOptions {
            segment_bytes: 1 << 10,
            max_segments: 100,
            sync: false,
        };
        let mut wal = WalStore::open_with(dir.path(), options).unwrap();
        for id in 1..60 {
            wal.append(&[StoreOp::Insert(record(id, 0))]).unwrap();
        }
        let churning = Churning(std::sync::atomic::AtomicU64::new(0));
        match view_wal_dir_on(&churning, dir.path()).unwrap() {
            DirView::Unstable { attempts } => assert_eq!(attempts, VIEW_ATTEMPTS),
            other => panic!("a view of a moving directory: {other:?}"),
        }
        match view_wal_dir(dir.path()).unwrap() {
            DirView::Stable {
                scan,
                in_use: true,
                attempts: 1,
            } => {
                assert!(scan.damage.is_none() && scan.segments.len() > 2, "{scan:?}");
            }
            other => panic!("{other:?}"),
        }
        drop(wal);
        assert!(matches!(
            view_wal_dir(dir.path()).unwrap(),
            DirView::Stable { in_use: false, .. }
        ));
    }

    #[test]
    fn a_replay_in_parts_is_the_replay_in_order() {
        let (segments, model) = log();
        let expected: Vec<ProcRecord> = model.into_values().collect();
        assert!(expected.len() > 100, "{} live", expected.len());
        for threads in [1, 2, 3, 8] {
            let replayed = replay_on(Path::new("wal"), segments.clone(), threads).unwrap();
            assert_eq!(replayed.parts.len(), threads);
            // No tree spans two parts, and each part is in tree order.
            let mut part_of_root = BTreeMap::new();
            for (i, part) in replayed.parts.iter().enumerate() {
                assert!(part
                    .windows(2)
                    .all(|w| (w[0].root, w[0].id) < (w[1].root, w[1].id)));
                for r in part {
                    assert_eq!(
                        *part_of_root.entry(r.root).or_insert(i),
                        i,
                        "{threads} parts"
                    );
                }
            }
            let mut records = replayed.parts.concat();
            records.sort_unstable_by_key(|r| r.id);
            assert_eq!(records, expected, "{threads} parts");
            assert_eq!(replayed.live.len(), expected.len(), "{threads} parts");
            for r in &expected {
                let (seq, size) = replayed.live[&r.id];
                let written_in = segments
                    .iter()
                    .rev()
                    .find(|(_, frames)| frames.iter().flat_map(|f| &f.ops).any(|op| op.id == r.id))
                    .map(|(seq, _)| *seq);
                assert_eq!(Some(seq), written_in, "procedure {}", r.id);
                assert!(size > 0);
            }
            let max_id = segments
                .iter()
                .flat_map(|(_, frames)| frames)
                .flat_map(|f| &f.ops)
                .map(|op| op.id.0)
                .max();
            assert_eq!(Some(replayed.max_id), max_id, "{threads} parts");
        }
    }

    #[test]
    fn latest_ops_are_kept_by_position_when_the_ids_fill_their_span() {
        // (ids `stride` apart over 300 ids in 3 000 ops) → slots by position?
        let cases = [
            (1, Some(300)),
            (10, Some(2_991)),
            (41, None),
            (1 << 40, None),
        ];
        for (stride, dense) in cases {
            let (segments, model) = log_spread(stride);
            let ids = IdSpan::of(&segments);
            assert_eq!(ids.ops, 3_000, "stride {stride}");
            assert_eq!(ids.dense_len(), dense, "stride {stride}");
            let index = LatestIndex::for_span(ids);
            assert_eq!(
                matches!(index, LatestIndex::Dense { .. }),
                dense.is_some(),
                "stride {stride}"
            );
            let expected: Vec<ProcRecord> = model.into_values().collect();
            for threads in [1, 2] {
                let replayed = replay_on(Path::new("wal"), segments.clone(), threads).unwrap();
                let mut records = replayed.parts.concat();
                records.sort_unstable_by_key(|r| r.id);
                assert_eq!(records, expected, "stride {stride}, {threads} parts");
                assert_eq!(Some(replayed.max_id), model_max(&segments));
            }
        }
        let none = IdSpan::of(&Vec::new());
        assert_eq!((none.dense_len(), none.max_id()), (None, 0));
    }

    fn model_max(segments: &SegmentFrames) -> Option<u64> {
        segments
            .iter()
            .flat_map(|(_, frames)| frames)
            .flat_map(|f| &f.ops)
            .map(|op| op.id.0)
            .max()
    }

    #[test]
    fn a_replay_in_parts_reports_the_bad_record_of_the_lowest_id() {
        let threads = 3;
        // Two live records that do not decode (no type name), in different parts.
        let low = ProcId(7);
        let high = (8..)
            .map(ProcId)
            .find(|&id| part_of(id, threads) != part_of(low, threads))
            .unwrap();
        let bad = |id: ProcId, offset: u64| {
            let r = ProcRecord {
                type_name: "".into(),
                ..record(id.0, 1)
            };
            frame(offset, &[StoreOp::Update(r)])
        };
        let segments = vec![
            (
                1,
                vec![frame(0, &[StoreOp::Insert(record(3, 0))]), bad(high, 90)],
            ),
            (
                2,
                vec![bad(low, 40), frame(80, &[StoreOp::Update(record(9, 2))])],
            ),
        ];
        let in_order = replay_on(Path::new("wal"), segments.clone(), 1)
            .err()
            .unwrap();
        let in_parts = replay_on(Path::new("wal"), segments.clone(), threads)
            .err()
            .unwrap();
        assert_eq!(in_parts.to_string(), in_order.to_string());
        let message = in_parts.to_string();
        assert!(message.contains("00000000000000000002.wal"), "{message}");
        assert!(message.contains("40"), "{message}");
    }

    #[test]
    fn a_record_whose_root_the_index_cannot_read_is_replayed_in_order() {
        let child = ProcRecord {
            parent: Some(ProcId(3)),
            root: ProcId(3),
            ..record(50, 2)
        };
        // The tag, the array of 19 fields, id 50, then the parent 3: written as an int8
        // instead of a fixint, a form serde reads and the index does not.
        let mut op = rmp_serde::to_vec(&StoreOp::Update(child.clone())).unwrap();
        let at = 1 + 7 + 3 + 1;
        assert_eq!(op[at..at + 2], [0x03, 0x03]);
        op.splice(at..=at, [0xd0, 0x03]);
        let mut payload = vec![0x92];
        payload.extend(rmp_serde::to_vec(&StoreOp::Insert(record(3, 0))).unwrap());
        payload.extend(op);
        let len = payload.len() as u64;
        let ops = wal::index_payload(FrameKind::Batch, Arc::new(payload)).unwrap();
        assert_eq!(ops[1].root, ProcId(50), "the index did not read the root");
        let frame = RawFrame {
            offset: 0,
            len,
            lsn: 1,
            kind: FrameKind::Batch,
            ops,
        };
        let threads = (2..)
            .find(|&t| part_of(ProcId(50), t) != part_of(ProcId(3), t))
            .unwrap();
        let replayed = replay_on(Path::new("wal"), vec![(1, vec![frame])], threads).unwrap();
        assert_eq!(replayed.parts.len(), 1, "replayed in order");
        assert_eq!(replayed.parts[0], vec![record(3, 0), child]);
    }

    #[test]
    fn a_procedure_whose_records_name_two_roots_is_replayed_in_order() {
        // Procedure 50 inserted as a root, then updated as a child of 3 (a log no engine
        // writes, but one that decodes): only its last record counts.
        let threads = (2..)
            .find(|&t| part_of(ProcId(50), t) != part_of(ProcId(3), t))
            .unwrap();
        let child = ProcRecord {
            parent: Some(ProcId(3)),
            root: ProcId(3),
            ..record(50, 2)
        };
        let segments = vec![(
            1,
            vec![
                frame(
                    0,
                    &[
                        StoreOp::Insert(record(3, 0)),
                        StoreOp::Insert(record(50, 1)),
                    ],
                ),
                frame(90, &[StoreOp::Update(child.clone())]),
            ],
        )];
        let replayed = replay_on(Path::new("wal"), segments, threads).unwrap();
        let mut records = replayed.parts.concat();
        records.sort_unstable_by_key(|r| r.id);
        assert_eq!(records, vec![record(3, 0), child]);
        assert_eq!(replayed.live.len(), 2);
    }
}
