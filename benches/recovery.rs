//! Recovery benchmark, in the shape of HBase's WAL loader benchmark: write N unfinished
//! procedures with small state (an insert and four updates each, in group-commit-sized
//! batches), delete half of them, then time how long a new engine takes to open the WAL
//! and plan the recovery of the rest, against the time to read the same files warm
//! (`recover_over_raw_read`). Prints one JSON line.
//!
//! ```sh
//! cargo bench --bench recovery                 # 1 000 000 procedures
//! cargo bench --bench recovery -- 100000       # fewer
//! ```

#[path = "../examples/workload/rss.rs"]
mod rss;

use std::path::Path;
use std::time::Instant;

use proctor::internals::recovery;
use proctor::{ProcId, ProcRecord, ProcState, ProcedureStore, StoreOp, WalStore};

const BATCH: u64 = 1000;
const UPDATES: u8 = 4;

fn record(id: u64, version: u8) -> ProcRecord {
    ProcRecord {
        id: ProcId(id),
        parent: None,
        root: ProcId(id),
        type_name: "bench".into(),
        state: ProcState::Runnable,
        stack_indexes: (0..u32::from(version)).collect(),
        failure: None,
        failure_seq: None,
        submitted_ms: 1_700_000_000_000,
        updated_ms: 1_700_000_000_000 + u64::from(version),
        wake_at_ms: None,
        event: None,
        data: vec![version; 16],
        locks: None,
        deadline_ms: None,
        nonce: None,
        result: None,
        bypassed: false,
        steering: Default::default(),
    }
}

/// Decoding a million records allocates a lot; like the workload, the benchmark uses
/// mimalloc (the library leaves the allocator to the program).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Reads every file of `dir` into memory once (the page cache is warm: the files were
/// just written and read once before), the floor for any recovery: seconds.
fn raw_read_s(dir: &Path) -> std::io::Result<f64> {
    let read_all = || -> std::io::Result<u64> {
        let mut bytes = 0;
        for entry in std::fs::read_dir(dir)? {
            bytes += std::fs::read(entry?.path())?.len() as u64;
        }
        Ok(bytes)
    };
    read_all()?; // warm
    let started = Instant::now();
    std::hint::black_box(read_all()?);
    Ok(started.elapsed().as_secs_f64())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` passes `--bench`; the first number is the procedure count.
    let procs: u64 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let dir = tempfile::tempdir()?;

    let started = Instant::now();
    let mut wal = WalStore::open(dir.path())?;
    let mut written = 0u64;
    for first in (1..=procs).step_by(BATCH as usize) {
        let ids = first..(first + BATCH).min(procs + 1);
        let inserts: Vec<StoreOp> = ids
            .clone()
            .map(|id| StoreOp::Insert(record(id, 0)))
            .collect();
        wal.append(&inserts)?;
        for version in 1..=UPDATES {
            let updates: Vec<StoreOp> = ids
                .clone()
                .map(|id| StoreOp::Update(record(id, version)))
                .collect();
            wal.append(&updates)?;
        }
        let deletes: Vec<StoreOp> = ids
            .clone()
            .filter(|id| id % 2 == 0)
            .map(|id| StoreOp::Delete(ProcId(id)))
            .collect();
        wal.append(&deletes)?;
        written += (ids.end - ids.start) * (1 + u64::from(UPDATES));
    }
    let stats = wal.stats();
    drop(wal);
    let write_s = started.elapsed().as_secs_f64();
    let bytes_on_disk = dir_bytes(dir.path());
    let raw_s = raw_read_s(dir.path())?;

    let started = Instant::now();
    let mut wal = WalStore::open(dir.path())?;
    let snapshot = wal.load()?;
    let open_s = started.elapsed().as_secs_f64();
    let live = snapshot.records.len();
    let plan = recovery::plan(snapshot.records, |n| (n == "bench").then_some("bench"), 0);
    let recover_s = started.elapsed().as_secs_f64();
    assert_eq!(plan.trees.len() as u64, procs - procs / 2);
    assert!(plan.corrupt.is_empty());

    println!(
        "{}",
        serde_json::json!({
            "procs": procs,
            "records_written": written,
            "wal_bytes_appended": stats.bytes_appended,
            "bytes_per_record": (stats.bytes_appended as f64 / written as f64).round(),
            "wal_bytes_on_disk": bytes_on_disk,
            "records_rewritten": stats.records_rewritten,
            "segments_deleted": stats.segments_deleted,
            "write_s": (write_s * 1000.0).round() / 1000.0,
            "open_and_load_s": (open_s * 1000.0).round() / 1000.0,
            "recover_s": (recover_s * 1000.0).round() / 1000.0,
            "raw_read_s": (raw_s * 10000.0).round() / 10000.0,
            "recover_over_raw_read": (recover_s / raw_s.max(1e-9) * 10.0).round() / 10.0,
            "live_procs": live,
            "peak_rss_mb": rss::peak_rss_mb().round(),
        })
    );
    Ok(())
}
