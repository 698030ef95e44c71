//! Unit tests of the WAL store: the replay (in parts, by position, its errors) and the
//! view of a directory that a running engine keeps changing.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::sync::Arc;

use super::replay::{part_of, replay_on, IdSpan, LatestIndex, SegmentFrames};
use super::*;
use crate::procedure::ProcState;
use crate::record::ProcRecord;
use crate::wal::RawFrame;

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
        nonce_fingerprint: None,
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
