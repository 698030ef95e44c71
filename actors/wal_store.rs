//! [`WalStore`]: the embedded default store, a segmented write-ahead log on local disk.
//! The byte format and the torn-tail rules are in [`crate::wal`]; this file is the file
//! system shell around them.
//!
//! - **Append**: one frame per call, one `write` and one `fdatasync`; the persistence
//!   actor calls it from its writer thread with everything that arrived during the
//!   previous sync (group commit). After a failed write or sync the store refuses every
//!   later append: the file's state is unknown, and retrying an fsync can report success
//!   for data the kernel already dropped.
//! - **Bounded size**: segments roll at `segment_bytes`. The store knows which segment
//!   holds each live procedure's latest record; the oldest segment is deleted once it
//!   holds none, and when there are more than `max_segments` and at most half of the
//!   oldest one's records are still live, those are rewritten forward as a checkpoint
//!   frame (HBase's answer to its WAL pile-up), so a procedure that waits for hours pins
//!   nothing. The half rule bounds the work: a rewrite always frees more than it writes,
//!   and the log stays within about twice the live data plus `max_segments` segments.
//! - **One engine per directory**: the store holds an exclusive lock on `DIR/LOCK`.
//! - **Open**: scans every segment, truncates a torn tail of the newest one, and stops
//!   with [`StoreError::Corrupt`] (file and offset) on any other damage.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::procedure::ProcId;
use crate::record::{ProcRecord, StoreOp};
use crate::store::{ProcedureStore, StoreError, StoreSnapshot};
use crate::wal::{self, FrameKind, ScanEnd, SegmentScan};

/// Tuning of a [`WalStore`].
#[derive(Clone, Debug)]
pub struct WalOptions {
    /// Roll to a new segment once the current one reaches this size (default 32 MiB).
    pub segment_bytes: u64,
    /// Rewrite the oldest segment's live records forward when there are more segments
    /// than this (default 4).
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
    /// Records (inserts and updates) written to this segment.
    records: usize,
}

/// Counters, for benchmarks and the `proctor` command.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WalStats {
    /// Frame bytes appended since open (checkpoints included).
    pub bytes_appended: u64,
    /// Appends (frames) since open.
    pub appends: u64,
    /// Segments deleted since open.
    pub segments_deleted: u64,
    /// Records rewritten forward by compaction since open.
    pub records_rewritten: u64,
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
pub struct WalStore {
    dir: PathBuf,
    options: WalOptions,
    _lock: File,
    segments: BTreeMap<u64, Segment>,
    current: File,
    current_seq: u64,
    current_len: u64,
    /// Where each live procedure's latest record is.
    live: HashMap<ProcId, u64>,
    max_id: u64,
    /// What open found, handed out by the first `load`.
    opened: Option<StoreSnapshot>,
    failed: Option<String>,
    buf: Vec<u8>,
    stats: WalStats,
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> StoreError {
    let context = context.into();
    move |source| StoreError::Io { context, source }
}

fn segment_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("{seq:020}.wal"))
}

/// The segment files of a WAL directory, oldest first.
pub(crate) fn segment_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let mut files = Vec::new();
    let entries = fs::read_dir(dir).map_err(io(format!("reading {}", dir.display())))?;
    for entry in entries {
        let path = entry
            .map_err(io(format!("reading {}", dir.display())))?
            .path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if let Some(seq) = name
            .strip_suffix(".wal")
            .and_then(|s| s.parse::<u64>().ok())
        {
            files.push((seq, path));
        }
    }
    files.sort();
    Ok(files)
}

/// Scans one segment file; `newest` as in [`wal::scan_segment`]. A header whose
/// sequence number disagrees with the file name is corruption.
fn scan_file(seq: u64, path: &Path, newest: bool) -> Result<SegmentScan, StoreError> {
    let bytes = fs::read(path).map_err(io(format!("reading {}", path.display())))?;
    let mut scan = wal::scan_segment(&bytes, newest);
    if let Some(header) = scan.header.filter(|h| h.seq != seq) {
        scan.end = ScanEnd::Corrupt {
            offset: 0,
            reason: wal::FrameError::Header(format!(
                "header says segment {}, the file name says {seq}",
                header.seq
            )),
        };
    }
    Ok(scan)
}

/// Scans every segment of a WAL directory without changing anything: what
/// `proctor wal verify` and `proctor wal dump` read.
pub fn scan_wal_dir(dir: &Path) -> Result<Vec<(PathBuf, SegmentScan)>, StoreError> {
    let files = segment_files(dir)?;
    let last = files.len().saturating_sub(1);
    let mut scans = Vec::with_capacity(files.len());
    for (i, (seq, path)) in files.into_iter().enumerate() {
        let scan = scan_file(seq, &path, i == last)?;
        scans.push((path, scan));
    }
    Ok(scans)
}

impl WalStore {
    /// Opens (or creates) the WAL in `dir` with default options.
    pub fn open(dir: impl AsRef<Path>) -> Result<WalStore, StoreError> {
        Self::open_with(dir, WalOptions::default())
    }

    /// Opens (or creates) the WAL in `dir`: locks it, scans it, truncates a torn tail.
    pub fn open_with(dir: impl AsRef<Path>, options: WalOptions) -> Result<WalStore, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        assert!(options.max_segments >= 2, "max_segments must be at least 2");
        assert!(options.segment_bytes > wal::SEGMENT_HEADER_LEN as u64);
        fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
        let lock_path = dir.join("LOCK");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(format!("opening {}", lock_path.display())))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(StoreError::Locked {
                    dir: dir.display().to_string(),
                })
            }
            Err(fs::TryLockError::Error(e)) => {
                return Err(io(format!("locking {}", lock_path.display()))(e))
            }
        }

        let mut records: BTreeMap<ProcId, ProcRecord> = BTreeMap::new();
        let mut live = HashMap::new();
        let mut max_id = 0;
        let mut segments = BTreeMap::new();
        let files = segment_files(&dir)?;
        let last = files.len().saturating_sub(1);
        // One segment in memory at a time: decoded frames are applied and dropped.
        for (i, (file_seq, path)) in files.into_iter().enumerate() {
            let scan = scan_file(file_seq, &path, i == last)?;
            match &scan.end {
                ScanEnd::Clean => {}
                ScanEnd::Corrupt { offset, reason } => {
                    return Err(StoreError::Corrupt {
                        file: path.display().to_string(),
                        offset: *offset,
                        reason: reason.to_string(),
                    })
                }
                ScanEnd::TornTail { offset, reason } => {
                    tracing::warn!(file = %path.display(), offset, %reason, "truncating torn WAL tail");
                    if *offset == 0 {
                        fs::remove_file(&path)
                            .map_err(io(format!("removing torn {}", path.display())))?;
                        continue;
                    }
                    let file = OpenOptions::new()
                        .write(true)
                        .open(&path)
                        .map_err(io(format!("opening {}", path.display())))?;
                    file.set_len(*offset)
                        .and_then(|()| file.sync_all())
                        .map_err(io(format!("truncating {}", path.display())))?;
                }
            }
            let header = scan
                .header
                .expect("a clean or truncated segment has a header");
            let seq = header.seq;
            max_id = max_id.max(header.max_id);
            let mut written = 0;
            for frame in scan.frames {
                for op in frame.ops {
                    max_id = max_id.max(op.proc_id().0);
                    match op {
                        StoreOp::Insert(r) | StoreOp::Update(r) => {
                            written += 1;
                            live.insert(r.id, seq);
                            records.insert(r.id, r);
                        }
                        StoreOp::Delete(id) => {
                            live.remove(&id);
                            records.remove(&id);
                        }
                    }
                }
            }
            segments.insert(
                seq,
                Segment {
                    path,
                    live: 0,
                    records: written,
                },
            );
        }
        for seq in live.values() {
            if let Some(s) = segments.get_mut(seq) {
                s.live += 1;
            }
        }

        let (current_seq, current, current_len) = match segments.iter().next_back() {
            Some((&seq, segment)) => {
                let file = OpenOptions::new()
                    .append(true)
                    .open(&segment.path)
                    .map_err(io(format!("opening {}", segment.path.display())))?;
                let len = file
                    .metadata()
                    .map_err(io(format!("reading {}", segment.path.display())))?
                    .len();
                (seq, file, len)
            }
            None => {
                let (file, path) = create_segment(&dir, 1, max_id)?;
                segments.insert(
                    1,
                    Segment {
                        path,
                        live: 0,
                        records: 0,
                    },
                );
                (1, file, wal::SEGMENT_HEADER_LEN as u64)
            }
        };
        let mut store = WalStore {
            dir,
            options,
            _lock: lock,
            segments,
            current,
            current_seq,
            current_len,
            live,
            max_id,
            opened: Some(StoreSnapshot {
                records: records.into_values().collect(),
                max_id,
            }),
            failed: None,
            buf: Vec::new(),
            stats: WalStats::default(),
        };
        store.collect_garbage()?;
        Ok(store)
    }

    /// What the store has done since it was opened.
    pub fn stats(&self) -> WalStats {
        self.stats
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes one frame to the current segment (rolling first if it is full) and syncs.
    fn write_frame(&mut self, kind: FrameKind, ops: &[StoreOp]) -> Result<(), StoreError> {
        self.buf.clear();
        wal::encode_frame(kind, ops, &mut self.buf).map_err(|e| StoreError::Io {
            context: "encoding a WAL frame".into(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
        })?;
        let len = self.buf.len() as u64;
        if self.current_len + len > self.options.segment_bytes
            && self.current_len > wal::SEGMENT_HEADER_LEN as u64
        {
            self.roll()?;
        }
        let path = &self.segments[&self.current_seq].path;
        let written = self.current.write_all(&self.buf).and_then(|()| {
            if self.options.sync {
                self.current.sync_data()
            } else {
                Ok(())
            }
        });
        if let Err(e) = written {
            let err = io(format!("appending to {}", path.display()))(e);
            self.failed = Some(err.to_string());
            return Err(err);
        }
        self.current_len += len;
        self.stats.bytes_appended += len;
        for op in ops {
            self.max_id = self.max_id.max(op.proc_id().0);
        }
        self.stats.appends += 1;
        for op in ops {
            let old = match op {
                StoreOp::Insert(r) | StoreOp::Update(r) => {
                    if let Some(s) = self.segments.get_mut(&self.current_seq) {
                        s.live += 1;
                        s.records += 1;
                    }
                    self.live.insert(r.id, self.current_seq)
                }
                StoreOp::Delete(id) => self.live.remove(id),
            };
            if let Some(s) = old.and_then(|seq| self.segments.get_mut(&seq)) {
                s.live -= 1;
            }
        }
        Ok(())
    }

    fn roll(&mut self) -> Result<(), StoreError> {
        let seq = self.current_seq + 1;
        let (file, path) = create_segment(&self.dir, seq, self.max_id).inspect_err(|e| {
            self.failed = Some(e.to_string());
        })?;
        self.segments.insert(
            seq,
            Segment {
                path,
                live: 0,
                records: 0,
            },
        );
        self.current = file;
        self.current_seq = seq;
        self.current_len = wal::SEGMENT_HEADER_LEN as u64;
        Ok(())
    }

    /// Deletes old segments that hold no live record, oldest first; then, while there
    /// are too many segments and the oldest is at most half live, rewrites its live
    /// records forward (at most `max_segments` rewrites per call).
    fn collect_garbage(&mut self) -> Result<(), StoreError> {
        let mut rewrites = 0;
        loop {
            let Some((&oldest, segment)) = self.segments.iter().next() else {
                return Ok(());
            };
            if oldest == self.current_seq {
                return Ok(());
            }
            if segment.live == 0 {
                // Oldest first, so a Delete in a later segment never outlives what it
                // deletes: nothing older than this segment is left to resurrect.
                let path = segment.path.clone();
                fs::remove_file(&path).map_err(io(format!("removing {}", path.display())))?;
                self.segments.remove(&oldest);
                self.stats.segments_deleted += 1;
                continue;
            }
            let mostly_live = segment.live * 2 > segment.records;
            if self.segments.len() <= self.options.max_segments
                || mostly_live
                || rewrites == self.options.max_segments
            {
                return Ok(());
            }
            rewrites += 1;
            self.rewrite_forward(oldest)?;
        }
    }

    /// Appends the latest records still in segment `seq` as a checkpoint frame.
    fn rewrite_forward(&mut self, seq: u64) -> Result<(), StoreError> {
        let path = self.segments[&seq].path.clone();
        let bytes = fs::read(&path).map_err(io(format!("reading {}", path.display())))?;
        let scan = wal::scan_segment(&bytes, false);
        if let ScanEnd::Corrupt { offset, reason } | ScanEnd::TornTail { offset, reason } = scan.end
        {
            return Err(StoreError::Corrupt {
                file: path.display().to_string(),
                offset,
                reason: reason.to_string(),
            });
        }
        let mut latest: BTreeMap<ProcId, ProcRecord> = BTreeMap::new();
        for op in scan.frames.into_iter().flat_map(|f| f.ops) {
            op.apply_to(&mut latest);
        }
        let ops: Vec<StoreOp> = latest
            .into_values()
            .filter(|r| self.live.get(&r.id) == Some(&seq))
            .map(StoreOp::Update)
            .collect();
        assert_eq!(
            ops.len(),
            self.segments[&seq].live,
            "segment {seq}'s live count disagrees with its records"
        );
        self.stats.records_rewritten += ops.len() as u64;
        // Bounded chunks, so one checkpoint never makes a giant frame.
        for chunk in ops.chunks(4096) {
            self.write_frame(FrameKind::Checkpoint, chunk)?;
        }
        assert_eq!(self.segments[&seq].live, 0);
        Ok(())
    }
}

fn create_segment(dir: &Path, seq: u64, max_id: u64) -> Result<(File, PathBuf), StoreError> {
    let path = segment_path(dir, seq);
    let mut file = OpenOptions::new()
        .create_new(true)
        .append(true)
        .open(&path)
        .map_err(io(format!("creating {}", path.display())))?;
    file.write_all(&wal::segment_header(seq, max_id))
        .and_then(|()| file.sync_all())
        .map_err(io(format!("writing the header of {}", path.display())))?;
    // The new name must be durable before anything in it is acknowledged.
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(format!("syncing directory {}", dir.display())))?;
    Ok((file, path))
}

impl ProcedureStore for WalStore {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        if let Some(reason) = &self.failed {
            return Err(StoreError::Failed(reason.clone()));
        }
        if ops.is_empty() {
            return Ok(());
        }
        self.opened = None;
        self.write_frame(FrameKind::Batch, ops)?;
        self.collect_garbage().inspect_err(|e| {
            self.failed = Some(e.to_string());
        })
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        if let Some(snapshot) = self.opened.take() {
            return Ok(snapshot);
        }
        let mut records = BTreeMap::new();
        for (path, scan) in scan_wal_dir(&self.dir)? {
            if let ScanEnd::Corrupt { offset, reason } = scan.end {
                return Err(StoreError::Corrupt {
                    file: path.display().to_string(),
                    offset,
                    reason: reason.to_string(),
                });
            }
            for op in scan.frames.into_iter().flat_map(|f| f.ops) {
                op.apply_to(&mut records);
            }
        }
        Ok(StoreSnapshot {
            records: records.into_values().collect(),
            max_id: self.max_id,
        })
    }
}
