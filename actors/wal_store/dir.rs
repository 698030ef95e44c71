//! The directory checks and scans of the WAL store, shared with `proctor wal verify`:
//! canonical segment names, where the log begins, no gaps from there, the LSN chain and
//! the seals, and the repairs open makes ([`Repair`]). [`scan_wal_dir`] and its variants
//! read a directory without changing it, one frame in memory at a time;
//! [`view_wal_dir`] views one that an engine may be running on. The open checks the
//! log it reads with the same [`check_log`]; [`prepare_dir`] refuses a WAL path that
//! is not a directory and creates a missing one.

use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

// `io` is both `std::io` and the helper that wraps its errors.
use super::{corrupt, file_name, io, segment_path, sync_dir, LockProbe, StdFs, WalFs};
use crate::store::{LastStop, StoreError};
use crate::wal::{self, Frame, FrameError, RawFrame, ScanEnd, SegmentSummary};

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
/// `proctor wal verify` reads, and what [`WalStore::open`](super::WalStore::open) checks
/// before it repairs. Every frame of the log is decoded, so a record that does not
/// decode is damage.
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

pub(super) fn open_segment<F: WalFs>(fs: &F, path: &Path) -> Result<F::Reader, StoreError> {
    fs.open_read(path)
        .map_err(io(format!("opening {}", path.display())))
}

pub(super) fn scan_path(
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
pub(super) struct Scanned {
    pub(super) seq: u64,
    pub(super) path: PathBuf,
    /// Whether it was scanned as the newest segment (the only one a crash can tear).
    pub(super) newest: bool,
    pub(super) summary: SegmentSummary,
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
pub(super) fn listed_segments(
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
pub(super) fn check_log(dir: &Path, scanned: &[Scanned], out: &mut WalDirScan) -> Vec<usize> {
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
pub(super) fn prepare_dir(fs: &impl WalFs, dir: &Path) -> Result<(), StoreError> {
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
