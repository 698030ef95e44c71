//! Recovery benchmark, in the shape of HBase's WAL loader benchmark: write N unfinished
//! procedures with small state (an insert and four updates each, in group-commit-sized
//! batches), delete half of them, then time how long a new engine takes to open the WAL
//! and plan the recovery of the rest, against the time to read the same files warm
//! (`recover_over_raw_read`). Prints one JSON line.
//!
//! With `--start`, it then times a whole executor's start on the same log as well
//! (`start_s`, `start_over_raw_read`): open, load, plan, decode every procedure's state
//! through the registry, publish the procedure table, hand every tree to its shard and
//! queue its next step, until the scheduler counts every recovered step. The recovered
//! procedures' steps wait for the shutdown (one worker: one step runs, every other is
//! queued), so nothing is written while it is timed.
//!
//! ```sh
//! cargo bench --bench recovery                 # 1 000 000 procedures
//! cargo bench --bench recovery -- 100000       # fewer
//! cargo bench --bench recovery -- --dir D      # write into D, or reuse the log D holds
//! cargo bench --bench recovery -- --start      # and time an executor's start
//! ```
//!
//! With `--dir`, a directory that already holds a log is only recovered (for profiling
//! recovery alone: `perf record` on the second run).

#[path = "../examples/workload/rss.rs"]
mod rss;

use std::path::{Path, PathBuf};
use std::time::Instant;

use proctor::ops::plan_recovery;
use proctor::store::{ProcRecord, StoreOp};
use proctor::{
    async_trait, Context, Executor, Flow, ProcError, ProcId, ProcState, Procedure, ProcedureStore,
    Registry, WalStats, WalStore,
};
use serde::{Deserialize, Serialize};

const BATCH: u64 = 1000;
const UPDATES: u8 = 4;

/// The benchmark's procedure type (`bench`): 15 bytes of state, 16 encoded. A step
/// waits for the shutdown's cancellation (after which nothing is recorded).
#[derive(Serialize, Deserialize)]
struct Bench([u8; 15]);

#[async_trait]
impl Procedure for Bench {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        ctx.cancelled().await;
        Err(ProcError::Aborted)
    }

    async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

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
        data: rmp_serde::to_vec(&Bench([version; 15])).expect("a state encodes"),
        locks: None,
        deadline_ms: None,
        nonce: None,
        result: None,
        bypassed: false,
        steering: Default::default(),
        nonce_fingerprint: None,
    }
}

/// Decoding a million records allocates a lot; like the workload, the benchmark uses
/// mimalloc, with the same options (the library leaves the allocator to the program).
#[path = "common/allocator.rs"]
mod allocator;

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
    allocator::keep_freed_memory();
    // `cargo bench` passes `--bench`; the first number is the procedure count.
    let args: Vec<String> = std::env::args().skip(1).collect();
    let procs: u64 = args
        .iter()
        .find_map(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let temp = tempfile::tempdir()?;
    let dir = match args.iter().position(|a| a == "--dir") {
        Some(i) => PathBuf::from(args.get(i + 1).ok_or("--dir needs a directory")?),
        None => temp.path().to_path_buf(),
    };
    let reuse = std::fs::read_dir(&dir).is_ok_and(|mut entries| {
        entries.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "wal")))
    });
    let written = if reuse {
        None
    } else {
        Some(write(&dir, procs)?)
    };
    let dir = dir.as_path();
    let bytes_on_disk = dir_bytes(dir);
    let raw_s = raw_read_s(dir)?;

    let started = Instant::now();
    let mut wal = WalStore::open(dir)?;
    let loaded = wal.load_parts()?;
    let open_s = started.elapsed().as_secs_f64();
    let open_peak_rss_mb = rss::peak_rss_mb().round();
    let live: usize = loaded.parts.iter().map(Vec::len).sum();
    let plan = plan_recovery(
        loaded.parts,
        &|n| (n == "bench").then_some("bench"),
        &|_| true,
        0,
    );
    let recover_s = started.elapsed().as_secs_f64();
    assert_eq!(plan.tree_count() as u64, procs - procs / 2);
    assert!(plan.corrupt.is_empty());

    let ms = |s: f64| (s * 1000.0).round() / 1000.0;
    // Seconds as a multiple of the raw read, to one decimal.
    let over_raw_read = |s: f64| (s / raw_s.max(1e-9) * 10.0).round() / 10.0;
    let mut report = serde_json::json!({
        "procs": procs,
        "wal_bytes_on_disk": bytes_on_disk,
        "open_and_load_s": ms(open_s),
        "recover_s": ms(recover_s),
        "raw_read_s": (raw_s * 10000.0).round() / 10000.0,
        "recover_over_raw_read": over_raw_read(recover_s),
        "live_procs": live,
        "open_peak_rss_mb": open_peak_rss_mb,
        "peak_rss_mb": rss::peak_rss_mb().round(),
    });
    if let Some(w) = written {
        report["records_written"] = w.records.into();
        report["wal_bytes_appended"] = w.stats.bytes_appended.into();
        report["bytes_per_record"] = (w.stats.bytes_appended as f64 / w.records as f64)
            .round()
            .into();
        report["records_rewritten"] = w.stats.records_rewritten.into();
        report["segments_deleted"] = w.stats.segments_deleted.into();
        report["write_s"] = ms(w.seconds).into();
    }
    if args.iter().any(|a| a == "--start") {
        drop((plan, wal));
        let start_s = start_executor(dir, live)?;
        report["start_s"] = ms(start_s).into();
        report["start_over_raw_read"] = over_raw_read(start_s).into();
        report["start_peak_rss_mb"] = rss::peak_rss_mb().round().into();
    }
    println!("{report}");
    Ok(())
}

/// Starts an executor on the log in `dir` and waits until a step of each of the `live`
/// procedures is queued or running: seconds.
fn start_executor(dir: &Path, live: usize) -> Result<f64, Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let started = Instant::now();
        let mut registry = Registry::new();
        registry.register::<Bench>("bench");
        let executor = Executor::builder()
            .registry(registry)
            .store(WalStore::open(dir)?)
            .workers(1)
            .start()
            .await?;
        // The executor answers once it has handed every tree to its shard; the shards
        // queue the trees' steps meanwhile: the start ends when every step is queued.
        let mut stats = executor.scheduler_stats().await?;
        while stats.running + stats.queued < live {
            tokio::task::yield_now().await;
            stats = executor.scheduler_stats().await?;
        }
        let seconds = started.elapsed().as_secs_f64();
        assert_eq!(stats.running + stats.queued, live, "{stats:?}");
        executor.shutdown().await?;
        Ok(seconds)
    })
}

/// What writing the log did.
struct Written {
    records: u64,
    stats: WalStats,
    seconds: f64,
}

/// Writes the log into `dir`: `procs` procedures, each inserted and updated `UPDATES`
/// times in batches of `BATCH`, then half of them deleted.
fn write(dir: &Path, procs: u64) -> Result<Written, Box<dyn std::error::Error>> {
    let started = Instant::now();
    let mut wal = WalStore::open(dir)?;
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
    Ok(Written {
        records: written,
        stats,
        seconds: started.elapsed().as_secs_f64(),
    })
}
