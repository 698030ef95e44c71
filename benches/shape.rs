//! The engine's actor shape with nothing else in it, to measure what the shape itself
//! costs a step before the engine's rules go in: per shard (one arbiter thread) a
//! scheduler actor (a FIFO ready queue under a worker bound) and, per tree, a
//! root-stack actor that supervises its procedure's actor; one persistence actor on a
//! thread of its own, in front of a group-commit writer thread. A step travels as the
//! engine's would:
//!
//! ```text
//! scheduler ──RunStep──▶ procedure ──StepDone(record)──▶ root stack
//! root stack ──Persist──▶ persistence ──(batch: write, fdatasync)──▶ Durable ──▶ root stack
//! root stack ──StepFinished──▶ scheduler (frees the worker)
//! root stack ──Enqueue──▶ scheduler (the next step, once the last one is durable)
//! ```
//!
//! With `--batch`, a courier actor on each shard gathers its root stacks' `Persist`s
//! into one message to the persistence actor and takes their `Durable`s back as one,
//! so the hops across threads are one message per batch and shard, not per step.
//!
//! With `--passivate`, a procedure's actor stops after each step, handing its state to
//! its root stack, which starts a new one (activation) for the next step: the cost of
//! keeping no procedure actor alive between steps, against keeping it (the default).
//! Each tree is one procedure, as most trees are. There is no lock table, no core
//! bookkeeping, no procedure table and no recovery: this is the floor under the shape,
//! beside `benches/bare.rs` (one actor per procedure and the writer, no scheduler).
//!
//! ```sh
//! cargo bench --bench shape -- --procs 100000 --concurrency 1000             # durable
//! cargo bench --bench shape -- --procs 100000 --concurrency 1000 --memory    # no file
//! cargo bench --bench shape -- --procs 100000 --shards 1 --batch --passivate
//! ```
//!
//! Prints one JSON line, as `benches/bare.rs` does.

#[path = "common/framed_log.rs"]
mod framed_log;
#[path = "../examples/workload/rss.rs"]
mod rss;

use std::collections::VecDeque;
use std::fs::File;
use std::sync::mpsc;
use std::time::Instant;

use actix::prelude::*;
use clap::Parser;
use serde::Serialize;
use tokio::sync::oneshot;

/// Like the workload and the bare benchmark, mimalloc, with the same options.
#[path = "common/allocator.rs"]
mod allocator;

#[derive(Parser, Debug)]
struct Args {
    /// Procedures (each a tree of its own) to run.
    #[arg(long, default_value_t = 100_000)]
    procs: u64,
    /// Steps per procedure.
    #[arg(long, default_value_t = 3)]
    steps: u16,
    /// Procedures in flight at once.
    #[arg(long, default_value_t = 1000)]
    concurrency: u64,
    /// Shards (arbiter threads, each with its scheduler); default one per core.
    #[arg(long)]
    shards: Option<usize>,
    /// Steps running at once, split over the shards (the workload's default).
    #[arg(long, default_value_t = 64)]
    workers: usize,
    /// Stop a procedure's actor after each step and start a new one for the next.
    #[arg(long)]
    passivate: bool,
    /// Batch the hops across threads: each shard's courier actor gathers its root
    /// stacks' `Persist`s into one message, and gets their `Durable`s back as one.
    #[arg(long)]
    batch: bool,
    /// No file: the writer acknowledges at once.
    #[arg(long)]
    memory: bool,
    /// `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A procedure's state: what its steps change and its records carry.
#[derive(Clone, Copy)]
struct State {
    id: u64,
    step: u16,
    bytes: [u8; 16],
}

/// The record of one step.
#[derive(Serialize)]
struct Record<'a> {
    id: u64,
    step: u16,
    #[serde(with = "serde_bytes")]
    state: &'a [u8],
}

// ---- the procedure actor and what it receives ----

struct Procedure {
    state: State,
    root: Addr<RootStack>,
    passivate: bool,
}

impl Actor for Procedure {
    type Context = Context<Self>;
}

/// Run your next step (from the scheduler).
#[derive(Message)]
#[rtype(result = "()")]
struct RunStep;

impl Handler<RunStep> for Procedure {
    type Result = ();

    fn handle(&mut self, _: RunStep, ctx: &mut Context<Self>) {
        let s = &mut self.state;
        s.bytes[usize::from(s.step) % 16] ^= 1;
        let record = rmp_serde::to_vec_named(&Record {
            id: s.id,
            step: s.step,
            state: &s.bytes,
        })
        .unwrap_or_default();
        let passive = self.passivate.then_some(self.state);
        self.root.do_send(StepDone { record, passive });
        if self.passivate {
            ctx.stop();
        }
    }
}

// ---- the root-stack actor and what it receives ----

struct RootStack {
    state: State,
    steps: u16,
    /// Its procedure's actor while it is active.
    proc: Option<Addr<Procedure>>,
    scheduler: Addr<Scheduler>,
    /// The persistence actor, or the shard's courier in front of it.
    persistence: Recipient<Persist>,
    done: tokio::sync::mpsc::UnboundedSender<()>,
    passivate: bool,
    /// Its own address until it is done: an actix actor whose last address is dropped
    /// may stop before it handles a message already queued (the persistence actor drops
    /// its address right after sending `Durable`, and a passivated procedure holds none).
    me: Option<Addr<RootStack>>,
}

impl RootStack {
    /// The procedure's actor, started again (activated) if it was passivated.
    fn activate(&mut self, ctx: &mut Context<Self>) -> Addr<Procedure> {
        if let Some(addr) = &self.proc {
            return addr.clone();
        }
        let addr = Procedure {
            state: self.state,
            root: ctx.address(),
            passivate: self.passivate,
        }
        .start();
        self.proc = Some(addr.clone());
        addr
    }

    fn enqueue(&mut self, ctx: &mut Context<Self>) {
        let proc = self.activate(ctx);
        self.scheduler.do_send(Enqueue(proc));
    }
}

impl Actor for RootStack {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.me = Some(ctx.address());
        self.enqueue(ctx);
    }
}

/// A step ended (from the procedure): its record, and its state if it passivated.
#[derive(Message)]
#[rtype(result = "()")]
struct StepDone {
    record: Vec<u8>,
    passive: Option<State>,
}

impl Handler<StepDone> for RootStack {
    type Result = ();

    fn handle(&mut self, msg: StepDone, ctx: &mut Context<Self>) {
        if let Some(state) = msg.passive {
            self.state = state;
            self.proc = None;
        }
        self.persistence.do_send(Persist {
            record: msg.record,
            to: ctx.address(),
        });
        self.scheduler.do_send(StepFinished);
    }
}

/// The step's record is durable (from the persistence actor).
#[derive(Message)]
#[rtype(result = "()")]
struct Durable;

impl Handler<Durable> for RootStack {
    type Result = ();

    fn handle(&mut self, _: Durable, ctx: &mut Context<Self>) {
        self.state.step += 1;
        if self.state.step < self.steps {
            self.enqueue(ctx);
        } else {
            if let Some(proc) = self.proc.take() {
                proc.do_send(Stop);
            }
            let _ = self.done.send(());
            self.me = None;
            ctx.stop();
        }
    }
}

/// Stop (a finished procedure's actor, from its root stack).
#[derive(Message)]
#[rtype(result = "()")]
struct Stop;

impl Handler<Stop> for Procedure {
    type Result = ();

    fn handle(&mut self, _: Stop, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

// ---- the scheduler actor (one per shard) and what it receives ----

struct Scheduler {
    ready: VecDeque<Addr<Procedure>>,
    free: usize,
}

impl Actor for Scheduler {
    type Context = Context<Self>;
}

impl Scheduler {
    fn dispatch(&mut self) {
        while self.free > 0 {
            let Some(proc) = self.ready.pop_front() else {
                return;
            };
            self.free -= 1;
            proc.do_send(RunStep);
        }
    }
}

/// Queue this procedure's next step (from its root stack).
#[derive(Message)]
#[rtype(result = "()")]
struct Enqueue(Addr<Procedure>);

impl Handler<Enqueue> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Enqueue, _: &mut Context<Self>) {
        self.ready.push_back(msg.0);
        self.dispatch();
    }
}

/// A step's worker is free (from a root stack).
#[derive(Message)]
#[rtype(result = "()")]
struct StepFinished;

impl Handler<StepFinished> for Scheduler {
    type Result = ();

    fn handle(&mut self, _: StepFinished, _: &mut Context<Self>) {
        self.free += 1;
        self.dispatch();
    }
}

// ---- the persistence actor and what it receives ----

// ---- the courier (one per shard, with `--batch`) and what it receives ----

/// Gathers its shard's `Persist`s into one message to the persistence actor, and
/// hands the batch's `Durable`s back to each root stack on its own thread.
struct Courier {
    persistence: Addr<Persistence>,
    records: Vec<Vec<u8>>,
    to: Vec<Addr<RootStack>>,
}

impl Actor for Courier {
    type Context = Context<Self>;
}

impl Handler<Persist> for Courier {
    type Result = ();

    fn handle(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        if self.to.is_empty() {
            // After what is already in the mailbox: those join this batch.
            ctx.notify(Flush);
        }
        self.records.push(msg.record);
        self.to.push(msg.to);
    }
}

/// Send what has gathered (from the courier itself).
#[derive(Message)]
#[rtype(result = "()")]
struct Flush;

impl Handler<Flush> for Courier {
    type Result = ();

    fn handle(&mut self, _: Flush, ctx: &mut Context<Self>) {
        self.persistence.do_send(PersistBatch {
            records: std::mem::take(&mut self.records),
            to: std::mem::take(&mut self.to),
            courier: ctx.address(),
        });
    }
}

/// A batch's root stacks, whose records are durable (from the persistence actor).
#[derive(Message)]
#[rtype(result = "()")]
struct DurableBatch(Vec<Addr<RootStack>>);

impl Handler<DurableBatch> for Courier {
    type Result = ();

    fn handle(&mut self, msg: DurableBatch, _: &mut Context<Self>) {
        for root in msg.0 {
            root.do_send(Durable);
        }
    }
}

/// A batch handed to the writer thread, answered once durable; `None` ends the writer.
type Batch = Option<(Vec<Vec<u8>>, oneshot::Sender<Vec<Vec<u8>>>)>;

struct Persistence {
    writer: mpsc::Sender<Batch>,
    pending: Vec<Vec<u8>>,
    waiting: Vec<Addr<RootStack>>,
    /// Batches from couriers, answered to each courier as one message.
    waiting_batches: Vec<(Addr<Courier>, Vec<Addr<RootStack>>)>,
    in_flight: bool,
}

impl Actor for Persistence {
    type Context = Context<Self>;
}

impl Persistence {
    /// Hands what is pending to the writer as one batch, and answers its root stacks
    /// once it is durable.
    fn flush(&mut self, ctx: &mut Context<Self>) {
        if self.in_flight || (self.waiting.is_empty() && self.waiting_batches.is_empty()) {
            return;
        }
        let (tx, rx) = oneshot::channel();
        let records = std::mem::take(&mut self.pending);
        let acks = std::mem::take(&mut self.waiting);
        let batches = std::mem::take(&mut self.waiting_batches);
        if self.writer.send(Some((records, tx))).is_err() {
            return;
        }
        self.in_flight = true;
        ctx.spawn(rx.into_actor(self).map(move |buffer, act, ctx| {
            act.in_flight = false;
            for root in acks {
                root.do_send(Durable);
            }
            for (courier, roots) in batches {
                courier.do_send(DurableBatch(roots));
            }
            if let Ok(mut buffer) = buffer {
                buffer.clear();
                act.pending = buffer;
            }
            act.flush(ctx);
        }));
    }
}

/// Make this record durable, then tell `to`.
#[derive(Message)]
#[rtype(result = "()")]
struct Persist {
    record: Vec<u8>,
    to: Addr<RootStack>,
}

impl Handler<Persist> for Persistence {
    type Result = ();

    fn handle(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        self.pending.push(msg.record);
        self.waiting.push(msg.to);
        self.flush(ctx);
    }
}

/// Make these records durable, then tell their courier (from a courier).
#[derive(Message)]
#[rtype(result = "()")]
struct PersistBatch {
    records: Vec<Vec<u8>>,
    to: Vec<Addr<RootStack>>,
    courier: Addr<Courier>,
}

impl Handler<PersistBatch> for Persistence {
    type Result = ();

    fn handle(&mut self, msg: PersistBatch, ctx: &mut Context<Self>) {
        self.pending.extend(msg.records);
        self.waiting_batches.push((msg.courier, msg.to));
        self.flush(ctx);
    }
}

/// The writer thread: each batch in one write and one `fdatasync`. Returns the number
/// of batches.
fn writer(batches: mpsc::Receiver<Batch>, mut file: Option<File>) -> std::io::Result<u64> {
    let mut count = 0;
    let mut buf = Vec::new();
    // Ends at `None`: actors that hold the persistence actor's address may outlive
    // the run.
    while let Ok(Some((records, done))) = batches.recv() {
        if let Some(file) = file.as_mut() {
            framed_log::append_batch(file, &mut buf, records.iter().map(|r| &r[..]))?;
        }
        count += 1;
        let _ = done.send(records);
    }
    Ok(count)
}

async fn run(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let file = if args.memory {
        None
    } else {
        Some(File::create(dir.path().join("log"))?)
    };
    let (tx, rx) = mpsc::channel();
    let end = tx.clone();
    let writer = std::thread::spawn(move || writer(rx, file));
    let persistence_arbiter = Arbiter::new();
    let persistence =
        Persistence::start_in_arbiter(&persistence_arbiter.handle(), move |_| Persistence {
            writer: tx,
            pending: Vec::new(),
            waiting: Vec::new(),
            waiting_batches: Vec::new(),
            in_flight: false,
        });
    let shards = args
        .shards
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()))
        .max(1);
    let arbiters: Vec<Arbiter> = (0..shards).map(|_| Arbiter::new()).collect();
    let schedulers: Vec<Addr<Scheduler>> = arbiters
        .iter()
        .enumerate()
        .map(|(i, arbiter)| {
            // The workers split over the shards, the first ones taking the remainder.
            let free = args.workers / shards + usize::from(i < args.workers % shards);
            Scheduler::start_in_arbiter(&arbiter.handle(), move |_| Scheduler {
                ready: VecDeque::new(),
                free: free.max(1),
            })
        })
        .collect();
    let persist_to: Vec<Recipient<Persist>> = arbiters
        .iter()
        .map(|arbiter| {
            if !args.batch {
                return persistence.clone().recipient();
            }
            let persistence = persistence.clone();
            Courier::start_in_arbiter(&arbiter.handle(), move |_| Courier {
                persistence,
                records: Vec::new(),
                to: Vec::new(),
            })
            .recipient()
        })
        .collect();
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let started = Instant::now();
    let cpu_started = rss::cpu_s();
    let mut next = 0u64;
    let start_one = |next: &mut u64| {
        let shard = *next as usize % shards;
        let root = RootStack {
            state: State {
                id: *next,
                step: 0,
                bytes: [0; 16],
            },
            steps: args.steps,
            proc: None,
            scheduler: schedulers[shard].clone(),
            persistence: persist_to[shard].clone(),
            done: done_tx.clone(),
            passivate: args.passivate,
            me: None,
        };
        RootStack::start_in_arbiter(&arbiters[shard].handle(), move |_| root);
        *next += 1;
    };
    while next < args.procs.min(args.concurrency.max(1)) {
        start_one(&mut next);
    }
    let mut finished = 0;
    while finished < args.procs {
        done_rx.recv().await.ok_or("a root stack died")?;
        finished += 1;
        if next < args.procs {
            start_one(&mut next);
        }
    }
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_s = rss::cpu_s() - cpu_started;
    for arbiter in arbiters.iter().chain([&persistence_arbiter]) {
        arbiter.stop();
    }
    for arbiter in arbiters.into_iter().chain([persistence_arbiter]) {
        let _ = arbiter.join();
    }
    let _ = end.send(None);
    let batches = writer.join().map_err(|_| "the writer panicked")??;
    let steps = args.procs * u64::from(args.steps);
    Ok(serde_json::json!({
        "design": "shape",
        "store": if args.memory { "memory" } else { "file" },
        "passivate": args.passivate,
        "batch": args.batch,
        "shards": shards,
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
