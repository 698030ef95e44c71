//! The WAL store on its own: what it gives back after reopening, how big it stays, and
//! what it does with torn and corrupt files. Every check compares against a
//! `MemoryStore` fed the same ops (the reference model).

use std::fs;
use std::path::{Path, PathBuf};

use proctor::{
    MemoryStore, ProcId, ProcRecord, ProcState, ProcedureStore, StoreError, StoreOp, WalOptions,
    WalStore,
};

fn record(id: u64, root: u64, version: u8) -> ProcRecord {
    ProcRecord {
        id: ProcId(id),
        parent: (id != root).then_some(ProcId(root)),
        root: ProcId(root),
        type_name: "t".into(),
        state: ProcState::Runnable,
        stack_indexes: vec![u32::from(version)],
        failure: None,
        submitted_ms: 1,
        updated_ms: u64::from(version),
        wake_at_ms: None,
        event: None,
        data: vec![version; 40],
    }
}

fn small() -> WalOptions {
    WalOptions {
        segment_bytes: 16 << 10,
        max_segments: 4,
        sync: false,
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "wal"))
        .collect();
    files.sort();
    files
}

/// Appends to both the WAL and the model.
fn append(wal: &mut WalStore, model: &mut MemoryStore, ops: Vec<StoreOp>) {
    wal.append(&ops).unwrap();
    model.append(&ops).unwrap();
}

#[test]
fn reopen_gives_back_the_latest_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = MemoryStore::new();
    {
        let mut wal = WalStore::open(dir.path()).unwrap();
        append(&mut wal, &mut model, vec![StoreOp::Insert(record(1, 1, 0))]);
        append(
            &mut wal,
            &mut model,
            vec![
                StoreOp::Update(record(1, 1, 1)),
                StoreOp::Insert(record(2, 1, 0)),
            ],
        );
        append(&mut wal, &mut model, vec![StoreOp::Delete(ProcId(2))]);
    }
    let mut wal = WalStore::open(dir.path()).unwrap();
    assert_eq!(wal.load().unwrap(), model.load().unwrap());
    assert_eq!(wal.load().unwrap().max_id, 2);
}

#[test]
fn churn_leaves_a_few_segments_and_long_waiters_survive() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = MemoryStore::new();
    let mut wal = WalStore::open_with(dir.path(), small()).unwrap();
    // Procedure 1 waits for the whole run: written once, never again.
    append(&mut wal, &mut model, vec![StoreOp::Insert(record(1, 1, 0))]);
    for root in (2..20_000u64).step_by(2) {
        let child = root + 1;
        append(
            &mut wal,
            &mut model,
            vec![StoreOp::Insert(record(root, root, 0))],
        );
        append(
            &mut wal,
            &mut model,
            vec![
                StoreOp::Update(record(root, root, 1)),
                StoreOp::Insert(record(child, root, 0)),
            ],
        );
        append(
            &mut wal,
            &mut model,
            vec![StoreOp::Update(record(child, root, 1))],
        );
        append(
            &mut wal,
            &mut model,
            vec![
                StoreOp::Update(record(root, root, 2)),
                StoreOp::Delete(ProcId(child)),
            ],
        );
        // The root finishes and is evicted.
        append(&mut wal, &mut model, vec![StoreOp::Delete(ProcId(root))]);
    }
    let stats = wal.stats();
    assert!(stats.segments_deleted > 50, "{stats:?}");
    assert!(
        stats.records_rewritten > 0,
        "procedure 1 was carried forward"
    );
    let live_segments = segments(dir.path()).len();
    assert!(live_segments <= 5, "{live_segments} segments");
    drop(wal);
    let mut reopened = WalStore::open_with(dir.path(), small()).unwrap();
    let snapshot = reopened.load().unwrap();
    assert_eq!(snapshot, model.load().unwrap());
    assert_eq!(snapshot.max_id, 19_999, "ids stay above every id ever used");
}

/// Writes three frames and returns the offset where the last one starts.
fn three_frames(dir: &Path) -> (PathBuf, u64, MemoryStore) {
    let mut model = MemoryStore::new();
    let mut wal = WalStore::open(dir).unwrap();
    append(&mut wal, &mut model, vec![StoreOp::Insert(record(1, 1, 0))]);
    append(&mut wal, &mut model, vec![StoreOp::Update(record(1, 1, 1))]);
    let file = segments(dir).pop().unwrap();
    let before_last = fs::metadata(&file).unwrap().len();
    let mut unsynced = MemoryStore::new();
    unsynced
        .append(&[StoreOp::Insert(record(1, 1, 0))])
        .unwrap();
    wal.append(&[
        StoreOp::Update(record(1, 1, 2)),
        StoreOp::Insert(record(2, 1, 0)),
    ])
    .unwrap();
    (file, before_last, model)
}

#[test]
fn a_torn_tail_at_every_byte_of_the_last_frame_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let (file, last_frame, mut model) = three_frames(dir.path());
    let full = fs::read(&file).unwrap();
    let expected = model.load().unwrap();
    for cut in last_frame..full.len() as u64 {
        fs::write(&file, &full[..cut as usize]).unwrap();
        let mut wal = WalStore::open(dir.path())
            .unwrap_or_else(|e| panic!("cut at {cut} of {}: {e}", full.len()));
        let snapshot = wal.load().unwrap();
        assert_eq!(snapshot.records, expected.records, "cut at {cut}");
        assert_eq!(snapshot.max_id, expected.max_id, "cut at {cut}");
        // A cut inside the frame is repaired, and the repair is reported with its byte.
        let repaired = cut > last_frame;
        assert_eq!(
            snapshot.repairs.len(),
            usize::from(repaired),
            "cut at {cut}"
        );
        if repaired {
            assert!(
                snapshot.repairs[0].contains(&format!("byte {last_frame}")),
                "{:?}",
                snapshot.repairs
            );
        }
        assert_eq!(
            fs::metadata(&file).unwrap().len(),
            last_frame,
            "truncated to the last good frame"
        );
        // Appends continue from the last good frame.
        wal.append(&[StoreOp::Insert(record(9, 9, 0))]).unwrap();
        drop(wal);
        let mut again = WalStore::open(dir.path()).unwrap();
        assert!(again
            .load()
            .unwrap()
            .records
            .iter()
            .any(|r| r.id == ProcId(9)));
    }
}

#[test]
fn a_zero_filled_tail_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _, _) = three_frames(dir.path());
    let mut bytes = fs::read(&file).unwrap();
    let good_len = bytes.len() as u64;
    bytes.extend([0u8; 8192]);
    fs::write(&file, &bytes).unwrap();
    let mut wal = WalStore::open(dir.path()).unwrap();
    assert_eq!(wal.load().unwrap().records.len(), 2);
    assert_eq!(fs::metadata(&file).unwrap().len(), good_len);
}

#[test]
fn a_flipped_byte_in_an_older_segment_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut wal = WalStore::open_with(dir.path(), small()).unwrap();
        for id in 1..400 {
            wal.append(&[StoreOp::Insert(record(id, id, 0))]).unwrap();
        }
    }
    let files = segments(dir.path());
    assert!(files.len() >= 2, "the test needs an older segment");
    let older = &files[0];
    let mut bytes = fs::read(older).unwrap();
    bytes[100] ^= 0x10;
    fs::write(older, &bytes).unwrap();

    let err = WalStore::open_with(dir.path(), small())
        .err()
        .expect("open refuses");
    let name = older.file_name().unwrap().to_str().unwrap();
    match &err {
        StoreError::Corrupt {
            file,
            offset,
            reason,
        } => {
            assert!(file.ends_with(name), "{file}");
            assert!(*offset <= 100, "{offset}");
            assert!(reason.contains("checksum"), "{reason}");
        }
        other => panic!("expected corruption, got {other}"),
    }
    assert!(err.to_string().contains("corrupt store"), "{err}");
}

#[test]
fn one_engine_per_directory() {
    let dir = tempfile::tempdir().unwrap();
    let first = WalStore::open(dir.path()).unwrap();
    let err = WalStore::open(dir.path()).err().expect("locked");
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    drop(first);
    WalStore::open(dir.path()).expect("the lock goes with the store");
}
