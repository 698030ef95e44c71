//! The bare design, to measure proctor's cost per step against: one actix actor per
//! procedure and one group-commit writer, nothing else. A procedure runs a step,
//! encodes a small record (its id, its step and 16 bytes of state, MessagePack),
//! hands it to the writer and waits; the writer takes every record queued, appends
//! them as CRC-framed records to one file, calls `fdatasync` once for the batch, and
//! then sends each procedure one message: durable, run your next step. The same
//! guarantee as proctor's (a step is on disk before the next one runs) with none of
//! its machinery: no scheduler, no worker bound, no locks, no tree, no recovery, no
//! table of procedures, no results kept.
//!
//! ```sh
//! cargo bench --bench bare -- --procs 100000 --concurrency 1000          # durable
//! cargo bench --bench bare -- --procs 100000 --concurrency 1000 --memory # no file
//! cargo bench --bench bare -- --idle 100000   # bytes per idle procedure, both designs,
//!                                             # each in a process of its own
//! ```
//!
//! Prints one JSON line. `benches/compare.sh` runs it beside `examples/workload` and
//! prints the ratios (BENCHMARKS.md, "The cost of a step against a bare design").

#[path = "../examples/workload/rss.rs"]
mod rss;

use std::fs::File;
use std::io::Write;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use clap::Parser;
use proctor::{
    async_trait, Context as ProcContext, Executor, Flow, MemoryStore, ProcError, Procedure,
    Registry, WalStore,
};
use serde::{Deserialize, Serialize};

/// Like the workload, the benchmark uses mimalloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
struct Args {
    /// Procedures to run.
    #[arg(long, default_value_t = 100_000)]
    procs: u64,
    /// Steps per procedure.
    #[arg(long, default_value_t = 3)]
    steps: u16,
    /// Procedures in flight at once.
    #[arg(long, default_value_t = 1000)]
    concurrency: u64,
    /// Threads the procedure actors are spread over (proctor's default: one per core).
    #[arg(long)]
    arbiters: Option<usize>,
    /// No file: the writer acknowledges at once.
    #[arg(long)]
    memory: bool,
    /// Instead: the memory taken by this many idle procedures, in the bare design (an
    /// actor holding a procedure's fields) and in proctor (a procedure suspended on an
    /// event of its own, in the memory store).
    #[arg(long)]
    idle: Option<u64>,
    /// With `--idle`: measure one design only, in this process (without it, `--idle`
    /// runs each in a process of its own).
    #[arg(long, value_enum, requires = "idle")]
    idle_design: Option<Design>,
    /// `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// What a procedure hands the writer; `None` ends the writer.
struct Job {
    record: Vec<u8>,
    to: Addr<Proc>,
}

type ToWriter = mpsc::Sender<Option<Job>>;

/// The record of one step.
#[derive(Serialize)]
struct Record<'a> {
    id: u64,
    step: u16,
    #[serde(with = "serde_bytes")]
    state: &'a [u8],
}

/// The writer acknowledges a step: it is durable.
#[derive(Message)]
#[rtype(result = "()")]
struct Durable;

struct Proc {
    id: u64,
    step: u16,
    steps: u16,
    state: [u8; 16],
    writer: ToWriter,
    done: tokio::sync::mpsc::UnboundedSender<()>,
    /// Its own address until it is done: an actix actor whose last address is dropped
    /// may stop before it handles a message already queued (the writer drops the
    /// job's address right after sending `Durable`).
    me: Option<Addr<Proc>>,
}

impl Proc {
    fn run_step(&mut self, ctx: &mut Context<Self>) {
        // The step's work: change the state.
        self.state[usize::from(self.step) % 16] ^= 1;
        let record = rmp_serde::to_vec_named(&Record {
            id: self.id,
            step: self.step,
            state: &self.state,
        })
        .expect("a record encodes");
        let job = Job {
            record,
            to: ctx.address(),
        };
        if self.writer.send(Some(job)).is_err() {
            ctx.stop();
        }
    }
}

impl Actor for Proc {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.me = Some(ctx.address());
        self.run_step(ctx);
    }
}

impl Handler<Durable> for Proc {
    type Result = ();

    fn handle(&mut self, _: Durable, ctx: &mut Context<Self>) {
        self.step += 1;
        if self.step < self.steps {
            self.run_step(ctx);
        } else {
            let _ = self.done.send(());
            self.me = None;
            ctx.stop();
        }
    }
}

/// The group-commit writer: every queued record in one write and one `fdatasync`,
/// then one message to each procedure. Returns the number of batches.
fn writer(jobs: mpsc::Receiver<Option<Job>>, mut file: Option<File>) -> std::io::Result<u64> {
    let mut batches = 0;
    let mut buf = Vec::new();
    let mut batch = Vec::new();
    // Ends at `None`: the procedures' actors may outlive the run, holding senders.
    while let Ok(Some(first)) = jobs.recv() {
        batch.clear();
        batch.push(first);
        let mut end = false;
        for job in jobs.try_iter() {
            match job {
                Some(job) => batch.push(job),
                None => end = true,
            }
        }
        if let Some(file) = file.as_mut() {
            buf.clear();
            for job in &batch {
                let len = u32::try_from(job.record.len()).unwrap_or(u32::MAX);
                buf.extend_from_slice(&len.to_le_bytes());
                buf.extend_from_slice(&crc32c::crc32c(&job.record).to_le_bytes());
                buf.extend_from_slice(&job.record);
            }
            file.write_all(&buf)?;
            file.sync_data()?;
        }
        batches += 1;
        for job in batch.drain(..) {
            job.to.do_send(Durable);
        }
        if end {
            break;
        }
    }
    Ok(batches)
}

async fn run(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let file = if args.memory {
        None
    } else {
        Some(File::create(dir.path().join("log"))?)
    };
    let (tx, rx) = mpsc::channel();
    let writer = std::thread::spawn(move || writer(rx, file));
    let arbiters: Vec<Arbiter> = (0..args
        .arbiters
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get())))
        .map(|_| Arbiter::new())
        .collect();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let started = Instant::now();
    let mut next = 0u64;
    let start_one = |next: &mut u64| {
        let proc = Proc {
            id: *next,
            step: 0,
            steps: args.steps,
            state: [0; 16],
            writer: tx.clone(),
            done: done_tx.clone(),
            me: None,
        };
        let arbiter = &arbiters[*next as usize % arbiters.len()];
        Proc::start_in_arbiter(&arbiter.handle(), move |_| proc);
        *next += 1;
    };
    while next < args.procs.min(args.concurrency.max(1)) {
        start_one(&mut next);
    }
    let mut finished = 0;
    while finished < args.procs {
        done_rx.recv().await.ok_or("a procedure actor died")?;
        finished += 1;
        if next < args.procs {
            start_one(&mut next);
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let _ = tx.send(None);
    for arbiter in &arbiters {
        arbiter.stop();
    }
    let batches = writer.join().map_err(|_| "the writer panicked")??;
    let steps = args.procs * u64::from(args.steps);
    Ok(serde_json::json!({
        "design": "bare",
        "store": if args.memory { "memory" } else { "file" },
        "procs": args.procs,
        "concurrency": args.concurrency,
        "steps": steps,
        "wall_s": round3(wall_s),
        "steps_per_s": round3(steps as f64 / wall_s),
        "batches": batches,
        "records_per_batch": round3(steps as f64 / batches.max(1) as f64),
        "peak_rss_mb": round3(rss::peak_rss_mb()),
    }))
}

/// An idle bare procedure: an actor with a running procedure's fields, waiting for its
/// next message.
struct Idle {
    _id: u64,
    _step: u16,
    _steps: u16,
    _state: [u8; 16],
    _writer: ToWriter,
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

/// Which design `--idle` measures in this process.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum Design {
    Bare,
    /// proctor on the memory store, whose copy of each record counts.
    Proctor,
    /// proctor on the WAL store (in a temporary directory), which keeps an index entry
    /// per live record in memory.
    ProctorWal,
}

/// `--idle N`: each design in a process of its own (memory the first measurement freed
/// must not be reused by the second), merged into one line.
fn idle_both(n: u64) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let mut report = serde_json::json!({ "idle_procs": n });
    for design in ["bare", "proctor", "proctor-wal"] {
        let out = std::process::Command::new(std::env::current_exe()?)
            .args(["--idle", &n.to_string(), "--idle-design", design])
            .stderr(std::process::Stdio::inherit())
            .output()?;
        if !out.status.success() {
            return Err(format!("--idle-design {design}: {}", out.status).into());
        }
        let line = String::from_utf8(out.stdout)?;
        let one: serde_json::Value = serde_json::from_str(line.trim())?;
        let key = format!("{}_bytes_per_idle_proc", design.replace('-', "_"));
        report[&key] = one[&key].clone();
    }
    Ok(report)
}

async fn idle(n: u64, design: Design) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let per_proc = match design {
        Design::Bare => {
            let (writer, _jobs) = mpsc::channel();
            let (done, _finished) = tokio::sync::mpsc::unbounded_channel();
            let before = rss::rss_bytes();
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
            let per_proc = (rss::rss_bytes().saturating_sub(before)) as f64 / n as f64;
            drop(actors);
            per_proc
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
            let before = rss::rss_bytes();
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
            // Every procedure has run its step and is suspended. The resident size is
            // read before the listing that checks it: the listing's own memory (one
            // row per procedure) must not count.
            let per_proc = loop {
                let stats = executor.scheduler_stats().await?;
                if stats.queued == 0 && stats.running == 0 {
                    let rss = rss::rss_bytes();
                    let waiting = executor
                        .list(proctor::List::new().state(proctor::ProcState::Waiting))
                        .await?
                        .len() as u64;
                    if waiting == n {
                        break (rss.saturating_sub(before)) as f64 / n as f64;
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            executor.shutdown_now().await?;
            per_proc
        }
    };
    let key = match design {
        Design::Bare => "bare_bytes_per_idle_proc",
        Design::Proctor => "proctor_bytes_per_idle_proc",
        Design::ProctorWal => "proctor_wal_bytes_per_idle_proc",
    };
    Ok(serde_json::json!({ "idle_procs": n, key: per_proc.round() }))
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let report = match (args.idle, args.idle_design) {
        (Some(n), None) => idle_both(n.max(1))?,
        (idle_procs, design) => actix::System::new().block_on(async {
            match (idle_procs, design) {
                (Some(n), Some(design)) => idle(n.max(1), design).await,
                _ => run(&args).await,
            }
        })?,
    };
    println!("{report}");
    Ok(())
}
