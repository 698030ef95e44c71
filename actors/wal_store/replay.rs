//! The WAL store's open after the directory checks: each segment read whole and
//! indexed on a thread of its own while the next one is read ([`index_segments`]), then
//! the replay of the ops ([`replay`]): the latest op of each procedure kept as bytes, by
//! position or in a map ([`LatestIndex`]), and only the live ones decoded, split over
//! the cores by a hash of their root when there are many.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::dir::{check_log, listed_segments, open_segment, scan_path, Scanned, WalDirScan};
// `io` is both `std::io` and the helper that wraps its errors.
use super::{corrupt, io, segment_path, WalFs};
use crate::actors::recover;
use crate::fast_map::IdMap;
use crate::procedure::ProcId;
use crate::record::{ProcRecord, StoreOp};
use crate::store::StoreError;
use crate::wal::{self, OpKind, RawFrame, RawOp, SegmentSummary};

/// A segment read whole and indexed: its summary and its good frames, in order.
struct IndexedSegment {
    summary: SegmentSummary,
    frames: Vec<RawFrame>,
}

/// The frames of each segment a scan kept, oldest first, with the segment's sequence
/// number.
pub(super) type SegmentFrames = Vec<(u64, Vec<RawFrame>)>;

/// What [`WalStore::open_on`](super::WalStore::open_on) and
/// [`WalStore::load`](super::WalStore#method.load) scan: the checks of
/// [`scan_wal_dir`](super::scan_wal_dir), with each segment read whole on this thread,
/// oldest first, and indexed on another thread while the next one is read
/// ([`index_segments`]). Returns the frames of the segments that count.
pub(super) fn scan_for_replay<F: WalFs>(
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
    let threads = recover::cores();
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
            Indexing::Running(worker) => recover::joined(worker),
            Indexing::Done(indexed) => indexed,
        }
    }
}

/// A live procedure's latest op and where it lies.
pub(super) struct Latest<'a> {
    seq: u64,
    frame_offset: u64,
    op: &'a RawOp,
}

/// What replaying the frames gives.
pub(super) struct Replayed {
    /// The latest record of every live procedure, in parts that no tree spans, each
    /// in tree order (by root, then id; see [`replay_part`]).
    pub(super) parts: Vec<Vec<ProcRecord>>,
    /// Each live procedure's segment and the encoded size of its latest record.
    pub(super) live: IdMap<ProcId, (u64, u32)>,
    /// The highest id an op names.
    pub(super) max_id: u64,
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
/// ([`ProcedureStore::load_parts`](super::ProcedureStore::load_parts)).
///
/// # Errors
/// [`StoreError::Corrupt`] naming the segment and frame of a record that does not
/// decode (of the lowest id, as a replay in id order meets it first).
pub(super) fn replay(dir: &Path, segments: SegmentFrames) -> Result<Replayed, StoreError> {
    let ids = IdSpan::of(&segments);
    let threads = if ids.ops < PARALLEL_REPLAY_MIN {
        1
    } else {
        recover::cores()
    };
    replay_spanned(dir, segments, ids, threads)
}

/// [`replay`] in `threads` parts (the tests pick the count).
#[cfg(test)]
pub(super) fn replay_on(
    dir: &Path,
    segments: SegmentFrames,
    threads: usize,
) -> Result<Replayed, StoreError> {
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
    let results = recover::on_threads((0..parts).collect(), |part| {
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
pub(super) fn part_of(root: ProcId, parts: usize) -> usize {
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
pub(super) struct IdSpan {
    first: u64,
    last: u64,
    pub(super) ops: usize,
}

impl IdSpan {
    pub(super) fn of(segments: &SegmentFrames) -> IdSpan {
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
    pub(super) fn max_id(self) -> u64 {
        self.last
    }

    /// Slots for every id from the lowest to the highest, if that is at most
    /// [`DENSE_SLOTS_PER_OP`] per op.
    pub(super) fn dense_len(self) -> Option<usize> {
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
pub(super) enum LatestIndex<'a> {
    Dense {
        first: u64,
        slots: Vec<Option<Latest<'a>>>,
        /// The slots filled.
        filled: usize,
    },
    Sparse(IdMap<ProcId, Latest<'a>>),
}

impl<'a> LatestIndex<'a> {
    pub(super) fn for_span(ids: IdSpan) -> Self {
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
