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
//! ```
//!
//! Prints one JSON line. `benches/compare.sh` runs it beside `examples/workload` and
//! prints the ratios (BENCHMARKS.md, "The cost of a step against the bare design").

#[path = "common/framed_log.rs"]
mod framed_log;
#[path = "../examples/workload/rss.rs"]
mod rss;

use std::fs::File;
use std::sync::mpsc;
use std::time::Instant;

use actix::prelude::*;
use clap::Parser;
use serde::Serialize;

/// Like the workload, the benchmark uses mimalloc, with the same options.
#[path = "common/allocator.rs"]
mod allocator;

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
            framed_log::append_batch(file, &mut buf, batch.iter().map(|job| &job.record[..]))?;
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
    let cpu_started = rss::cpu_s();
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
    let cpu_s = rss::cpu_s() - cpu_started;
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
        "cpu_s": round3(cpu_s),
        "cpu_us_per_step": round3(cpu_s * 1e6 / steps.max(1) as f64),
        "batches": batches,
        "records_per_batch": round3(steps as f64 / batches.max(1) as f64),
        "peak_rss_mb": round3(rss::peak_rss_mb()),
    }))
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    allocator::keep_freed_memory();
    let args = Args::parse();
    let report = actix::System::new().block_on(run(&args))?;
    println!("{report}");
    Ok(())
}
