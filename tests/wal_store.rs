//! The WAL store on its own: what it gives back after reopening, how big it stays, and
//! what it does with torn and corrupt files. Every check compares against a
//! `MemoryStore` fed the same ops (the reference model).

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use proctor::{MemoryStore, ProcId, ProcedureStore, StoreError, WalOptions, WalStore};

use proctor::store::{ProcRecord, StoreOp};

fn record(id: u64, root: u64, version: u8) -> ProcRecord {
    common::wal::record(id, root, version, 40)
}

fn small() -> WalOptions {
    WalOptions {
        segment_bytes: 16 << 10,
        max_segments: 4,
        sync: false,
    }
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    common::wal::segments(dir)
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

/// A log big enough for open to replay it in parts: `load` gives exactly the model's
/// records, and `load_parts` the same records in parts that no tree spans, each by id.
#[test]
fn a_large_log_loads_whole_and_in_parts() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = MemoryStore::new();
    {
        let mut wal = WalStore::open(dir.path()).unwrap();
        for first in (1..=6_000u64).step_by(3) {
            let (root, a, b) = (first, first + 1, first + 2);
            let mut ops = vec![StoreOp::Insert(record(root, root, 0))];
            ops.extend([a, b].map(|c| StoreOp::Insert(record(c, root, 0))));
            for version in 1..=3 {
                ops.extend([root, a, b].map(|id| StoreOp::Update(record(id, root, version))));
            }
            if root % 4 == 1 {
                ops.push(StoreOp::Delete(ProcId(a)));
            }
            append(&mut wal, &mut model, ops);
        }
    }
    let expected = model.load().unwrap();
    let mut wal = WalStore::open(dir.path()).unwrap();
    let loaded = wal.load_parts().unwrap();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get().min(8));
    assert_eq!(loaded.parts.len(), threads);
    let mut part_of_root = std::collections::BTreeMap::new();
    for (i, part) in loaded.parts.iter().enumerate() {
        assert!(part.windows(2).all(|w| w[0].id < w[1].id));
        for r in part {
            assert_eq!(*part_of_root.entry(r.root).or_insert(i), i);
        }
    }
    assert_eq!(loaded.into_snapshot(), expected);
    assert_eq!(wal.load().unwrap(), expected);
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
    // What it tells operators agrees with its counters and the files, and its bytes
    // are within the bound it states.
    let status = wal.status();
    assert_eq!(status.kind, "wal");
    let fact = |name: &str| -> u64 {
        let (_, value) = status.facts.iter().find(|(n, _)| *n == name).unwrap();
        value.parse().unwrap()
    };
    let stats = wal.stats();
    assert_eq!(fact("segments"), live_segments as u64);
    assert_eq!(fact("live_bytes"), stats.live_bytes);
    assert_eq!(fact("segment_bytes"), stats.segment_bytes);
    assert!(
        fact("segment_bytes") <= fact("bound_bytes"),
        "{:?}",
        status.facts
    );
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

    let err = WalStore::open_with(dir.path(), small()).expect_err("open refuses");
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
    let err = WalStore::open(dir.path()).expect_err("locked");
    assert!(matches!(err, StoreError::Locked { .. }), "{err}");
    drop(first);
    WalStore::open(dir.path()).expect("the lock goes with the store");
}

/// The encoded size of a record as the store counts it (an `Update` is what a
/// checkpoint writes; every op tag has the same length).
fn encoded(r: &ProcRecord) -> u64 {
    rmp_serde::to_vec(&StoreOp::Update(r.clone()))
        .unwrap()
        .len() as u64
}

/// The segment files as the file system sees them: their count and total bytes.
fn on_disk(dir: &Path) -> (usize, u64) {
    let files = segments(dir);
    let bytes = files.iter().map(|f| fs::metadata(f).unwrap().len()).sum();
    (files.len(), bytes)
}

/// The segment-count bound of `actors/wal_store/mod.rs` for `M` segments, `L` live bytes,
/// segments of `S` bytes and `F` the longest frame plus 61 bytes: every segment but
/// the newest is at least `S − F` bytes, and at least 90 (a header, a frame, a seal).
fn count_bound(m: u64, l: u64, s: u64, f: u64) -> usize {
    m.max(1 + (2 * l + m * s) / s.saturating_sub(f).max(90)) as usize
}

/// The size bound of `actors/wal_store/mod.rs`, checked after every append of a workload
/// that used to stall compaction: long-lived procedures written once at the start pin
/// the oldest segments (more than half live, so the old rule never rewrote them), while
/// thousands of procedures behind them insert, update and finish, half of them keeping
/// their final record (as finished roots do) and half evicted.
#[test]
fn the_log_stays_within_its_size_bound_at_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let options = small();
    let (s, m) = (options.segment_bytes, options.max_segments as u64);
    let mut model = MemoryStore::new();
    let mut wal = WalStore::open_with(dir.path(), options.clone()).unwrap();
    let mut steps = 0u64;
    let mut check = |wal: &WalStore, model: &mut MemoryStore| {
        steps += 1;
        let stats = wal.stats();
        // F: the longest frame, plus a segment header and a seal.
        let f = stats.largest_frame + 61;
        let l = stats.live_bytes;
        assert!(
            stats.segment_bytes <= 2 * l + m * (s + f),
            "step {steps}: {} bytes > 2·{l} + {m}·({s} + {f})",
            stats.segment_bytes
        );
        let count_bound = count_bound(m, l, s, f);
        assert!(
            stats.segments <= count_bound,
            "step {steps}: {} segments > {count_bound}",
            stats.segments
        );
        // The store's own figures are the truth, checked now and then (it is slow).
        if steps.is_multiple_of(97) {
            assert_eq!(on_disk(dir.path()), (stats.segments, stats.segment_bytes));
            let live: u64 = model.load().unwrap().records.iter().map(encoded).sum();
            assert_eq!(l, live, "step {steps}: live bytes");
        }
    };
    for id in 1..=120 {
        append(
            &mut wal,
            &mut model,
            vec![StoreOp::Insert(record(id, id, 0))],
        );
        check(&wal, &mut model);
    }
    for id in 1000..7000u64 {
        for ops in [
            vec![StoreOp::Insert(record(id, id, 0))],
            vec![StoreOp::Update(record(id, id, 1))],
            vec![StoreOp::Update(record(id, id, 2))],
        ] {
            append(&mut wal, &mut model, ops);
            check(&wal, &mut model);
        }
        if id.is_multiple_of(2) {
            append(&mut wal, &mut model, vec![StoreOp::Delete(ProcId(id))]);
            check(&wal, &mut model);
        }
    }
    let stats = wal.stats();
    assert!(stats.largest_frame < s / 2, "{stats:?}");
    assert!(
        stats.records_rewritten > 0 && stats.segments_deleted > 50,
        "{stats:?}"
    );
    drop(wal);
    let mut reopened = WalStore::open_with(dir.path(), small()).unwrap();
    let snapshot = reopened.load().unwrap();
    assert_eq!(snapshot.records, model.load().unwrap().records);
    assert!(snapshot.repairs.is_empty());
}

/// A crash during a roll: the next segment is created (header synced), then the
/// current one is sealed. Each row cuts the roll at a different point; the store opens
/// with every acknowledged record, reporting what it removed or truncated.
#[test]
fn an_interrupted_roll_recovers() {
    type Cut = fn(&Path, &Path);
    let rows: [(&str, Cut, &[&str]); 4] = [
        ("no seal yet", |prev, _| truncate_by(prev, 21), &["removed"]),
        (
            "half a seal",
            |prev, _| truncate_by(prev, 10),
            &["removed", "truncated"],
        ),
        (
            "no seal, torn header of the new segment",
            |prev, newest| {
                truncate_by(prev, 21);
                fs::write(newest, [0u8; 17]).unwrap();
            },
            &["removed"],
        ),
        ("sealed: a complete roll", |_, _| {}, &[]),
    ];
    for (row, cut, repairs) in rows {
        let dir = tempfile::tempdir().unwrap();
        let mut model = MemoryStore::new();
        let mut wal = WalStore::open_with(dir.path(), small()).unwrap();
        let mut id = 1;
        // Append until an append rolls; that append is the one a crash loses.
        let before = loop {
            let before = model.load().unwrap();
            let count = segments(dir.path()).len();
            append(
                &mut wal,
                &mut model,
                vec![StoreOp::Insert(record(id, id, 0))],
            );
            id += 1;
            if segments(dir.path()).len() > count {
                break before;
            }
        };
        drop(wal);
        let files = segments(dir.path());
        let (prev, newest) = (&files[files.len() - 2], &files[files.len() - 1]);
        // The new segment's only frame was never written.
        let header = fs::read(newest).unwrap()[..proctor::ops::wal::SEGMENT_HEADER_LEN].to_vec();
        fs::write(newest, header).unwrap();
        cut(prev, newest);
        let mut wal =
            WalStore::open_with(dir.path(), small()).unwrap_or_else(|e| panic!("{row}: {e}"));
        let snapshot = wal.load().unwrap();
        assert_eq!(snapshot.records, before.records, "{row}");
        assert_eq!(
            snapshot.repairs.len(),
            repairs.len(),
            "{row}: {:?}",
            snapshot.repairs
        );
        for (got, word) in snapshot.repairs.iter().zip(repairs) {
            assert!(got.contains(word), "{row}: {got}");
        }
        if !repairs.is_empty() {
            assert!(!newest.exists(), "{row}: the empty segment is gone");
        }
        // The log goes on, rolls again, and reopens clean.
        for more in 0..200 {
            wal.append(&[StoreOp::Insert(record(10_000 + more, 10_000 + more, 0))])
                .unwrap();
        }
        drop(wal);
        let mut again = WalStore::open_with(dir.path(), small()).unwrap();
        let snapshot = again.load().unwrap();
        assert!(snapshot.repairs.is_empty(), "{row}: {:?}", snapshot.repairs);
        assert_eq!(snapshot.records.len(), before.records.len() + 200, "{row}");
    }
}

fn truncate_by(path: &Path, bytes: u64) {
    let len = fs::metadata(path).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len - bytes)
        .unwrap();
}

#[test]
fn the_lock_error_names_the_lock_file() {
    let dir = tempfile::tempdir().unwrap();
    let _first = WalStore::open(dir.path()).unwrap();
    let err = WalStore::open(dir.path()).expect_err("locked");
    let lock = dir.path().join("LOCK").display().to_string();
    assert!(
        matches!(&err, StoreError::Locked { file } if *file == lock),
        "{err}"
    );
    assert!(err.to_string().contains(&lock), "{err}");
}

/// Paths that are not a usable WAL directory: each error says what is wrong with it.
#[test]
fn a_bad_wal_path_says_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("wal-is-a-file");
    fs::write(&file, b"x").unwrap();
    let err = WalStore::open(&file).expect_err("a file is no directory");
    let text = err.to_string();
    assert!(text.contains("is a regular file"), "{text}");
    assert!(text.contains(&file.display().to_string()), "{text}");
    assert!(!text.contains("File exists"), "{text}");

    // A missing directory, several levels deep, is created.
    let deep = dir.path().join("a/b/wal");
    WalStore::open(&deep).expect("created");
    assert!(deep.join("LOCK").exists());
}

/// Peak resident memory of this process, from /proc (Linux), in KiB.
fn peak_rss_kib() -> Option<u64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// A huge sparse newest segment (a good header, then 128 MiB of holes) is a torn tail:
/// the scan streams it and never holds it in memory.
#[test]
fn a_huge_sparse_segment_costs_no_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (file, _, _) = three_frames(dir.path());
    let good_len = fs::metadata(&file).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let before = peak_rss_kib();
    let mut wal = WalStore::open(dir.path()).unwrap();
    let after = peak_rss_kib();
    if let (Some(before), Some(after)) = (before, after) {
        assert!(
            after - before < 64 << 10,
            "peak RSS grew by {} KiB",
            after - before
        );
    }
    let snapshot = wal.load().unwrap();
    assert_eq!(snapshot.records.len(), 2);
    assert_eq!(snapshot.repairs.len(), 1, "{:?}", snapshot.repairs);
    assert!(snapshot.repairs[0].contains(&format!("byte {good_len}")));
    assert_eq!(fs::metadata(&file).unwrap().len(), good_len);
}

/// A log whose newest segment an older build wrote (format 2), and which compaction
/// had already shortened (it begins at segment 5): the store reads it, and appends to
/// a new segment of its own format rather than under the old header, so the older
/// build, reading the log again, refuses the new segment by its header instead of
/// taking the new records for damage. The older format recorded no start, so the log
/// begins at its oldest segment, and the store says so in a start frame: from then on
/// the loss of that segment is seen.
#[test]
fn a_segment_of_an_older_format_is_read_and_not_appended_to() {
    use proctor::ops::wal::{scan_segment, FrameKind, VERSION};

    let dir = tempfile::tempdir().unwrap();
    let mut model = MemoryStore::new();
    {
        let mut wal = WalStore::open(dir.path()).unwrap();
        append(&mut wal, &mut model, vec![StoreOp::Insert(record(1, 1, 0))]);
    }
    let old = segments(dir.path());
    assert_eq!(old.len(), 1);
    // Segment 1 becomes segment 5 of format 2.
    let fifth = dir.path().join(format!("{:020}.wal", 5));
    let mut bytes = fs::read(&old[0]).unwrap();
    bytes[8..10].copy_from_slice(&2u16.to_le_bytes());
    bytes[12..20].copy_from_slice(&5u64.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[0..36]);
    bytes[36..40].copy_from_slice(&crc.to_le_bytes());
    fs::write(&fifth, bytes).unwrap();
    fs::remove_file(&old[0]).unwrap();
    let version = |path: &Path| {
        let bytes = fs::read(path).unwrap();
        u16::from_le_bytes([bytes[8], bytes[9]])
    };
    {
        let mut wal = WalStore::open(dir.path()).unwrap();
        assert_eq!(wal.load().unwrap(), model.load().unwrap());
        append(&mut wal, &mut model, vec![StoreOp::Insert(record(2, 2, 0))]);
    }
    let now = segments(dir.path());
    assert_eq!(now.len(), 2, "{now:?}");
    assert_eq!((version(&now[0]), version(&now[1])), (2, VERSION));
    let first = scan_segment(&fs::read(&now[1]).unwrap(), true).frames;
    assert_eq!(first[0].kind, FrameKind::Start, "{first:?}");
    let mut wal = WalStore::open(dir.path()).unwrap();
    assert_eq!(wal.load().unwrap(), model.load().unwrap());
    // Reopened, the newest segment is of this format: appended to, no new one.
    append(&mut wal, &mut model, vec![StoreOp::Insert(record(3, 3, 0))]);
    drop(wal);
    assert_eq!(segments(dir.path()).len(), 2);
    fs::remove_file(&fifth).unwrap();
    match WalStore::open(dir.path()) {
        Err(StoreError::Corrupt { file, .. }) => assert!(file.ends_with("00005.wal"), "{file}"),
        other => panic!("the loss of the oldest segment is not seen: {other:?}"),
    }
}

/// A crash after compaction wrote its start marker and before it deleted the segments
/// below it leaves them behind (a segment deleted, then put back, plays that part):
/// `proctor wal verify` says they will be removed, and open removes them, reports it,
/// and loads exactly the records the log held.
#[test]
fn a_leftover_of_an_interrupted_compaction_is_removed_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4 << 10,
        max_segments: 3,
        sync: false,
    };
    let mut model = MemoryStore::new();
    let mut wal = WalStore::open_with(dir.path(), options.clone()).unwrap();
    append(&mut wal, &mut model, vec![StoreOp::Insert(record(1, 1, 0))]);
    // The oldest segment as it was before compaction deleted it.
    let mut oldest: Option<(PathBuf, Vec<u8>)> = None;
    let mut id = 2;
    let (path, bytes) = loop {
        let files = segments(dir.path());
        if files.len() > 1 && oldest.as_ref().is_none_or(|(p, _)| *p != files[0]) {
            oldest = Some((files[0].clone(), fs::read(&files[0]).unwrap()));
        }
        append(
            &mut wal,
            &mut model,
            vec![StoreOp::Insert(record(id, id, 0))],
        );
        append(&mut wal, &mut model, vec![StoreOp::Delete(ProcId(id))]);
        id += 1;
        match &oldest {
            Some((path, _)) if !path.exists() => break oldest.take().unwrap(),
            _ => {}
        }
    };
    drop(wal);
    fs::write(&path, bytes).unwrap();
    let name = path.file_name().unwrap().to_string_lossy().into_owned();

    let verify = std::process::Command::new(env!("CARGO_BIN_EXE_proctor"))
        .args(["wal", "verify"])
        .arg(dir.path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&verify.stdout).into_owned();
    assert_eq!(verify.status.code(), Some(3), "{out}");
    assert!(
        out.contains(&name) && out.contains("will be removed at next start"),
        "{out}"
    );

    let mut wal = WalStore::open_with(dir.path(), options.clone()).unwrap();
    let snapshot = wal.load().unwrap();
    assert_eq!(snapshot.records, model.load().unwrap().records);
    assert!(
        snapshot.repairs.len() == 1
            && snapshot.repairs[0].contains(&name)
            && snapshot.repairs[0].contains("leftover"),
        "{:?}",
        snapshot.repairs
    );
    assert!(!path.exists(), "the leftover is removed");
    append(
        &mut wal,
        &mut model,
        vec![StoreOp::Insert(record(9000, 9000, 0))],
    );
    drop(wal);
    let mut again = WalStore::open_with(dir.path(), options).unwrap();
    let snapshot = again.load().unwrap();
    assert_eq!(snapshot.records, model.load().unwrap().records);
    assert!(snapshot.repairs.is_empty(), "{:?}", snapshot.repairs);
}

/// The size bound when frames outgrow the segments (`F > S`): each such frame takes a
/// segment of its own, and a small frame after it another, so a segment is no longer
/// at least `S − F` bytes; it is still at least a header, a frame and a seal, and the
/// count bound says so. Checked after every append, with long-lived procedures pinning
/// the oldest segments and finished ones deleted.
#[test]
fn the_log_stays_within_its_size_bound_when_frames_outgrow_segments() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_bytes: 4 << 10,
        max_segments: 3,
        sync: false,
    };
    let (s, m) = (options.segment_bytes, options.max_segments as u64);
    let mut wal = WalStore::open_with(dir.path(), options.clone()).unwrap();
    let mut model = MemoryStore::new();
    let mut most = 0;
    for id in 1..=1500u64 {
        // Every third procedure is large (a frame above the segment size) and every
        // fifth lives on; the rest finish and are deleted.
        let data = if id % 3 == 0 { 6 << 10 } else { 40 };
        let r = common::wal::record(id, id, 0, data);
        append(&mut wal, &mut model, vec![StoreOp::Insert(r)]);
        if id % 5 != 0 && id > 4 {
            append(&mut wal, &mut model, vec![StoreOp::Delete(ProcId(id - 4))]);
        }
        let stats = wal.stats();
        let f = stats.largest_frame + 61;
        let l = stats.live_bytes;
        assert!(
            stats.segment_bytes <= 2 * l + m * (s + f),
            "append {id}: {} bytes > 2·{l} + {m}·({s} + {f})",
            stats.segment_bytes
        );
        let bound = count_bound(m, l, s, f);
        assert!(
            stats.segments <= bound,
            "append {id}: {} segments > {bound}",
            stats.segments
        );
        most = most.max(stats.segments);
    }
    assert!(
        most > 2 * m as usize,
        "the case is exercised: {most} segments"
    );
    drop(wal);
    let mut reopened = WalStore::open_with(dir.path(), options).unwrap();
    assert_eq!(
        reopened.load().unwrap().records,
        model.load().unwrap().records
    );
}

/// How the last engine stopped, on both stores: a drained mark (with the procedures
/// it names) until the next append or running mark, on a reopened WAL as in memory; a
/// torn mark is truncated like any torn tail and says nothing.
#[test]
fn a_drained_stop_is_reported_until_the_next_write() {
    use proctor::store::LastStop;
    let drained = LastStop::Drained {
        cut_off: vec![ProcId(3), ProcId(7)],
    };
    for name in common::STORES {
        let reopen = common::Reopen::new(name);
        let mut store = reopen.open();
        store.append(&[StoreOp::Insert(record(1, 1, 0))]).unwrap();
        assert_eq!(store.load().unwrap().last_stop, LastStop::Unknown, "{name}");
        store.mark_drained(&[ProcId(3), ProcId(7)]).unwrap();
        drop(store);
        // Reported, and again at the next open: loading runs nothing.
        for _ in 0..2 {
            let loaded = reopen.open().load().unwrap();
            assert_eq!(loaded.last_stop, drained, "{name}");
            assert_eq!(loaded.records.len(), 1, "{name}");
        }
        // The next engine's running mark ends it.
        let mut store = reopen.open();
        store.mark_running().unwrap();
        drop(store);
        assert_eq!(
            reopen.open().load().unwrap().last_stop,
            LastStop::Unknown,
            "{name}"
        );
        // So does any append after it.
        let mut store = reopen.open();
        store.mark_drained(&[]).unwrap();
        store.append(&[StoreOp::Update(record(1, 1, 1))]).unwrap();
        drop(store);
        assert_eq!(
            reopen.open().load().unwrap().last_stop,
            LastStop::Unknown,
            "{name}"
        );
        if name == "wal" {
            // A torn mark: the last frame cut short is a torn tail, truncated.
            let mut store = reopen.open();
            store.mark_drained(&[ProcId(9)]).unwrap();
            drop(store);
            let newest = segments(reopen.dir()).pop().unwrap();
            truncate_by(&newest, 3);
            let loaded = reopen.open().load().unwrap();
            assert_eq!(loaded.last_stop, LastStop::Unknown);
            assert_eq!(loaded.repairs.len(), 1, "{:?}", loaded.repairs);
        }
    }
}
