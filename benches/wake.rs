//! Waking idle procedures: what a procedure suspended on an event of its own costs in
//! resident memory, and how long waking every one of them takes until all have finished.
//!
//! ```sh
//! cargo bench --bench wake -- --procs 100000          # memory store
//! cargo bench --bench wake -- --procs 100000 --wal    # WAL store in a temp directory
//! ```
//!
//! Each root's first step suspends on its own event (`wake/<n>`); its second step
//! finishes. The benchmark submits `--procs` roots, waits until every one is suspended
//! (its first step counted in the environment, the schedulers idle and the listing
//! showing them all WAITING), and takes the growth of the resident set over the
//! submits ÷ `--procs` as `rss_bytes_per_idle_proc`. Then it asks to be told when each
//! root finishes (`Executor::wait`, which only notes a waiter), wakes every event, and
//! times from the first wake until every root has finished: `wake_all_s`, and the CPU
//! time every thread of the process used meanwhile: `wake_cpu_s` (on a machine whose
//! cores are busy with other work, the wall time follows the CPU time).
//!
//! Prints one JSON line.

#[path = "../examples/workload/rss.rs"]
#[allow(dead_code)] // the peak is not reported
mod rss;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use proctor::{
    async_trait, Context as ProcContext, Executor, Flow, List, MemoryStore, ProcError, ProcId,
    ProcState, Procedure, Registry, WalStore,
};
use serde::{Deserialize, Serialize};

/// Like the other benchmarks, mimalloc, with the same options.
#[path = "common/allocator.rs"]
mod allocator;

#[derive(Parser, Debug)]
struct Args {
    /// Root procedures to suspend and wake.
    #[arg(long, default_value_t = 100_000)]
    procs: u64,
    /// The WAL store in a temporary directory (the memory store otherwise).
    #[arg(long)]
    wal: bool,
    /// Wakes in flight at once: a wave of this many is sent, then awaited.
    #[arg(long, default_value_t = 1000)]
    wave: u64,
    /// Arbiters (threads, each a shard of the trees); the executor's default (the
    /// machine's available parallelism) without it.
    #[arg(long)]
    arbiters: Option<usize>,
    /// `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The environment: how many first steps (suspensions) and second steps have run.
#[derive(Default)]
struct Counts {
    suspended: AtomicU64,
    resumed: AtomicU64,
}

/// A root that suspends on its own event (`wake/<n>`) at its first step and finishes
/// at its second.
#[derive(Serialize, Deserialize)]
struct Sleeper {
    n: u64,
    woken: bool,
    state: [u8; 16],
}

#[async_trait]
impl Procedure<Counts> for Sleeper {
    async fn execute(&mut self, ctx: &mut ProcContext<Counts>) -> Result<Flow<Counts>, ProcError> {
        if self.woken {
            ctx.env().resumed.fetch_add(1, Ordering::Relaxed);
            return Ok(Flow::Done);
        }
        self.woken = true;
        ctx.env().suspended.fetch_add(1, Ordering::Relaxed);
        Ok(Flow::Suspend(event(self.n)))
    }
    async fn rollback(&mut self, _: &mut ProcContext<Counts>) -> Result<(), ProcError> {
        Ok(())
    }
}

fn event(n: u64) -> String {
    format!("wake/{n}")
}

/// How often the conditions waited on are checked.
const POLL: Duration = Duration::from_millis(10);

/// Submits in flight at once: a wave of this many is sent, then awaited.
const WAVE: u64 = 1000;

async fn run(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let n = args.procs.max(1);
    let counts = Arc::new(Counts::default());
    let mut registry = Registry::new();
    registry.register::<Sleeper>("sleeper");
    let wal_dir = tempfile::tempdir()?;
    let builder = Executor::builder().registry(registry).env(counts.clone());
    let builder = match args.arbiters {
        Some(arbiters) => builder.arbiters(arbiters),
        None => builder,
    };
    let builder = if args.wal {
        builder.store(WalStore::open(wal_dir.path())?)
    } else {
        builder.store(MemoryStore::new())
    };
    let executor = builder.start().await?;

    // The ids are the benchmark's, not the procedures': their memory is touched before
    // the first reading.
    let mut ids: Vec<ProcId> = vec![ProcId(0); n as usize];
    let before = rss::rss_bytes();
    // In waves: a submit answers once its insert is durable, and on the WAL store a
    // wave is one group commit.
    let mut next = 0;
    while next < n {
        let end = (next + WAVE).min(n);
        let wave: Vec<_> = (next..end)
            .map(|i| {
                let executor = executor.clone();
                actix::spawn(async move {
                    executor
                        .submit(Sleeper {
                            n: i,
                            woken: false,
                            state: [1; 16],
                        })
                        .await
                })
            })
            .collect();
        for (i, submitted) in (next..end).zip(wave) {
            ids[i as usize] = submitted.await??;
        }
        next = end;
    }
    // Every first step has run, nothing is queued or running, and the listing shows
    // every root WAITING. The resident set is read before the listing, whose rows
    // must not count.
    while counts.suspended.load(Ordering::Relaxed) < n {
        tokio::time::sleep(POLL).await;
    }
    let after = loop {
        let stats = executor.scheduler_stats().await?;
        if stats.queued == 0 && stats.running == 0 {
            let after = rss::rss_bytes();
            let waiting = executor
                .list(List::new().state(ProcState::Waiting))
                .await?
                .len() as u64;
            if waiting == n {
                break after;
            }
        }
        tokio::time::sleep(POLL).await;
    };
    let rss_per_proc = after.saturating_sub(before) as f64 / n as f64;

    // A waiter for each root, noted by the executor before the first wake (the stats
    // round trip comes after every wait's message).
    let waits: Vec<_> = ids
        .iter()
        .map(|&id| {
            let executor = executor.clone();
            actix::spawn(async move { executor.wait(id).await })
        })
        .collect();
    tokio::task::yield_now().await;
    executor.scheduler_stats().await?;
    executor.scheduler_stats().await?;

    let start = Instant::now();
    let cpu_start = rss::cpu_s();
    let mut next = 0;
    while next < n {
        let end = (next + args.wave.max(1)).min(n);
        let wakes: Vec<_> = (next..end)
            .map(|i| {
                let executor = executor.clone();
                actix::spawn(async move { executor.wake_event(event(i)).await })
            })
            .collect();
        for woken in wakes {
            woken.await??;
        }
        next = end;
    }
    for finished in waits {
        if let Err(failure) = finished.await?? {
            return Err(format!("a root failed: {failure:?}").into());
        }
    }
    let wake_all_s = start.elapsed().as_secs_f64();
    let wake_cpu_s = rss::cpu_s() - cpu_start;
    let resumed = counts.resumed.load(Ordering::Relaxed);
    if resumed != n {
        return Err(format!("{resumed} of {n} roots ran their second step").into());
    }
    executor.shutdown_now().await?;
    Ok(serde_json::json!({
        "procs": n,
        "rss_bytes_per_idle_proc": rss_per_proc.round(),
        "wake_all_s": (wake_all_s * 1000.0).round() / 1000.0,
        "wake_cpu_s": (wake_cpu_s * 100.0).round() / 100.0,
        "store": if args.wal { "wal" } else { "memory" },
    }))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    allocator::keep_freed_memory();
    let args = Args::parse();
    let report = actix::System::new().block_on(run(&args))?;
    println!("{report}");
    Ok(())
}
