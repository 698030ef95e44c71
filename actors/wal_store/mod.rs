//! [`WalStore`]: the embedded default store, a segmented write-ahead log on local disk.
//! The byte format, the seal and LSN rules and the torn-tail rule are in [`crate::wal`];
//! this module is the file system shell around them.
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
//!
//! The module is in five files: `mod.rs` (this one: [`WalStore`], its options and
//! counters, the append, the roll, the compaction and the open, and the helpers the
//! other files share), `fs.rs` (the file-system seam: [`WalFs`] and [`StdFs`]), `dir.rs`
//! (the directory checks and scans shared with `proctor wal verify`: [`scan_wal_dir`],
//! [`view_wal_dir`], the repairs open makes), `replay.rs` (the open's indexing of the
//! segments and its replay of their ops) and `tests.rs` (the unit tests of the replay
//! and of the view of a directory).

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::fast_map::IdMap;
use crate::procedure::ProcId;
use crate::record::StoreOp;
use crate::store::{LastStop, ProcedureStore, StoreError, StoreParts, StoreSnapshot, StoreStatus};
use crate::wal::{self, FrameKind, OpKind, RawOp, ScanEnd};

mod dir;
mod fs;
mod replay;
#[cfg(test)]
mod tests;

use dir::{prepare_dir, scan_path};
pub use dir::{
    scan_wal_dir, scan_wal_dir_on, scan_wal_dir_with, view_wal_dir, view_wal_dir_on, DirView,
    Repair, SegmentReport, WalDirScan, VIEW_ATTEMPTS,
};
pub use fs::{Entry, LockProbe, StdFs, WalFs};
use replay::{replay, scan_for_replay};

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
            tracing::warn!(target: crate::targets::WAL, %repair, "repaired the WAL");
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
        #[cfg(feature = "simulation")]
        if crate::mutation::on(crate::mutation::Mutation::WalNoSync) {
            return Ok(());
        }
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

    fn status(&self) -> StoreStatus {
        let stats = self.stats();
        let (s, m) = (self.options.segment_bytes, self.options.max_segments as u64);
        // The size bound of the module docs: 2·L + M·(S + F), F the longest frame + 61.
        let f = stats.largest_frame + 61;
        let bound = 2 * stats.live_bytes + m * (s + f);
        StoreStatus {
            kind: "wal",
            facts: vec![
                ("dir", self.dir.display().to_string()),
                ("segments", stats.segments.to_string()),
                ("segment_bytes", stats.segment_bytes.to_string()),
                ("live_bytes", stats.live_bytes.to_string()),
                ("bound_bytes", bound.to_string()),
                ("largest_frame", stats.largest_frame.to_string()),
                ("segments_deleted", stats.segments_deleted.to_string()),
                ("records_rewritten", stats.records_rewritten.to_string()),
            ],
        }
    }
}
