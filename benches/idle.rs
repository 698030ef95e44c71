//! Bytes per idle procedure: what a procedure costs while it waits, in the bare design
//! (`benches/bare.rs`: an actix actor holding a running procedure's fields) and in
//! proctor (a procedure suspended on an event of its own that never comes), on the
//! memory store and on the WAL store.
//!
//! ```sh
//! cargo bench --bench idle -- --procs 100000   # each design in a process of its own
//! ```
//!
//! Two figures per design, each the growth over `--procs` procedures ÷ `--procs`:
//! - `live`: the heap bytes the procedures hold, counted by this program's allocator
//!   (mimalloc under a counter of the sizes asked for): exact, and blind to what the
//!   allocator keeps around its blocks (size classes, pages freed but not returned);
//! - `rss`: the growth of the resident set, which sees all of that, and also memory the
//!   run used for a while and freed (mimalloc keeps freed pages for reuse).
//!
//! Prints one JSON line. `benches/compare.sh` runs it beside the other benchmarks.

#[path = "../examples/workload/rss.rs"]
mod rss;

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use actix::prelude::*;
use clap::Parser;
use proctor::{
    async_trait, Context as ProcContext, Executor, Flow, MemoryStore, ProcError, Procedure,
    Registry, WalStore,
};
use serde::{Deserialize, Serialize};

/// mimalloc, like the workload and the bare benchmark, under a counter of live bytes.
struct Counting;

/// Heap bytes allocated and not freed, as asked for.
static LIVE: AtomicIsize = AtomicIsize::new(0);

fn count(bytes: usize, sign: isize) {
    let bytes = isize::try_from(bytes).unwrap_or(isize::MAX);
    LIVE.fetch_add(sign * bytes, Ordering::Relaxed);
}

// SAFETY: every call goes to mimalloc unchanged; the counter only adds up sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { mimalloc::MiMalloc.alloc(layout) };
        if !p.is_null() {
            count(layout.size(), 1);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size(), 1);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) };
        count(layout.size(), -1);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(layout.size(), -1);
            count(new_size, 1);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live_bytes() -> i64 {
    i64::try_from(LIVE.load(Ordering::Relaxed)).unwrap_or(i64::MAX)
}

#[derive(Parser, Debug)]
struct Args {
    /// Idle procedures to hold.
    #[arg(long, default_value_t = 100_000)]
    procs: u64,
    /// Measure one design only, in this process (without it, each design runs in a
    /// process of its own, so memory one freed is not reused by the next).
    #[arg(long, value_enum)]
    design: Option<Design>,
    /// `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Which design to measure.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Design {
    /// An actix actor per procedure, holding a running procedure's fields.
    Bare,
    /// proctor on the memory store, whose copy of each record counts.
    Proctor,
    /// proctor on the WAL store (in a temporary directory), which keeps an index entry
    /// per live record in memory.
    ProctorWal,
}

impl Design {
    fn key(self) -> &'static str {
        match self {
            Design::Bare => "bare",
            Design::Proctor => "proctor",
            Design::ProctorWal => "proctor_wal",
        }
    }
}

/// An idle bare procedure: an actor with a running procedure's fields (as in
/// `benches/bare.rs`), waiting for its next message.
struct Idle {
    _id: u64,
    _step: u16,
    _steps: u16,
    _state: [u8; 16],
    _writer: mpsc::Sender<Option<(u64, Vec<u8>)>>,
    _done: tokio::sync::mpsc::UnboundedSender<()>,
}

impl Actor for Idle {
    type Context = Context<Self>;
}

/// An idle proctor procedure: suspended on its own event (`reply/<n>`), which never
/// comes.
#[derive(Serialize, Deserialize)]
struct Parked {
    n: u64,
    state: [u8; 16],
}

#[async_trait]
impl Procedure for Parked {
    async fn execute(&mut self, _: &mut ProcContext) -> Result<Flow, ProcError> {
        Ok(Flow::Suspend(format!("reply/{}", self.n)))
    }
    async fn rollback(&mut self, _: &mut ProcContext) -> Result<(), ProcError> {
        Ok(())
    }
}

/// Every design in a process of its own, merged into one line.
fn all(n: u64) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let mut report = serde_json::json!({ "idle_procs": n });
    for design in ["bare", "proctor", "proctor-wal"] {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(["--procs", &n.to_string(), "--design", design])
            .stderr(std::process::Stdio::inherit())
            .output()?;
        if !out.status.success() {
            return Err(format!("--design {design}: {}", out.status).into());
        }
        let line = String::from_utf8(out.stdout)?;
        let one: serde_json::Value = serde_json::from_str(line.trim())?;
        for (key, value) in one.as_object().into_iter().flatten() {
            report[key] = value.clone();
        }
    }
    Ok(report)
}

/// The growth of the live heap and of the resident set since `before`, per procedure.
struct Mark {
    live: i64,
    rss: u64,
}

impl Mark {
    fn now() -> Self {
        Mark {
            live: live_bytes(),
            rss: rss::rss_bytes(),
        }
    }

    fn per_proc(&self, n: u64) -> (f64, f64) {
        let now = Mark::now();
        (
            (now.live - self.live) as f64 / n as f64,
            now.rss.saturating_sub(self.rss) as f64 / n as f64,
        )
    }
}

async fn one(n: u64, design: Design) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let (live, rss) = match design {
        Design::Bare => {
            let (writer, _jobs) = mpsc::channel();
            let (done, _finished) = tokio::sync::mpsc::unbounded_channel();
            let before = Mark::now();
            let actors: Vec<Addr<Idle>> = (0..n)
                .map(|id| {
                    Idle {
                        _id: id,
                        _step: 1,
                        _steps: 3,
                        _state: [1; 16],
                        _writer: writer.clone(),
                        _done: done.clone(),
                    }
                    .start()
                })
                .collect();
            // Let every actor start.
            tokio::time::sleep(Duration::from_millis(500)).await;
            // The addresses are the caller's, not the procedures': they do not count.
            let addresses = n as f64 * std::mem::size_of::<Addr<Idle>>() as f64;
            let (live, rss) = before.per_proc(n);
            drop(actors);
            (live - addresses / n as f64, rss)
        }
        Design::Proctor | Design::ProctorWal => {
            let mut registry = Registry::new();
            registry.register::<Parked>("parked");
            let wal_dir = tempfile::tempdir()?;
            let builder = Executor::builder().registry(registry);
            let builder = match design {
                Design::ProctorWal => builder.store(WalStore::open(wal_dir.path())?),
                _ => builder.store(MemoryStore::new()),
            };
            let executor = builder.start().await?;
            let before = Mark::now();
            // In waves of a thousand: a submit answers once its insert is durable, and
            // the WAL store makes a wave one group commit.
            let mut next = 0;
            while next < n {
                let wave: Vec<_> = (next..(next + 1000).min(n))
                    .map(|i| {
                        let executor = executor.clone();
                        actix::spawn(async move {
                            executor
                                .submit(Parked {
                                    n: i,
                                    state: [1; 16],
                                })
                                .await
                        })
                    })
                    .collect();
                for submitted in wave {
                    submitted.await??;
                }
                next = (next + 1000).min(n);
            }
            // Every procedure has run its step and is suspended. Memory is read before
            // the listing that checks it: the listing's own (one row per procedure)
            // must not count.
            let per_proc = loop {
                let stats = executor.scheduler_stats().await?;
                if stats.queued == 0 && stats.running == 0 {
                    let per_proc = before.per_proc(n);
                    let waiting = executor
                        .list(proctor::List::new().state(proctor::ProcState::Waiting))
                        .await?
                        .len() as u64;
                    if waiting == n {
                        break per_proc;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            executor.shutdown_now().await?;
            per_proc
        }
    };
    let key = design.key();
    Ok(serde_json::json!({
        "idle_procs": n,
        format!("{key}_live_bytes_per_idle_proc"): live.round(),
        format!("{key}_rss_bytes_per_idle_proc"): rss.round(),
        format!("{key}_peak_rss_mb"): (rss::peak_rss_mb() * 1000.0).round() / 1000.0,
    }))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let n = args.procs.max(1);
    let report = match args.design {
        None => all(n)?,
        Some(design) => actix::System::new().block_on(one(n, design))?,
    };
    println!("{report}");
    Ok(())
}
