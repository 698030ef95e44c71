//! Fairness: do short procedures get through while long ones hog the workers? Run it
//! with
//!
//! ```sh
//! cargo run --release --example fairness
//! ```
//!
//! Five phases, each on a fresh executor over the in-memory store with few workers
//! (default 4): short procedures of 3 steps alone; then the same beside background
//! procedures that run many long steps (default 6 of them, each up to 150 steps that
//! hold a worker for 20 to 50 ms, running alone for `--warmup-ms` first, as procedures
//! that have been running a while) under the default multilevel fair queue
//! (`Scheduling::Fair`, with its default reserved worker); then the same under
//! `Scheduling::Fifo`; then under the fair queue with the background starting together
//! with the short ones ("cold": for their first second of step time the background
//! trees are young too, on level 0 beside the short ones); then cold again with the
//! short procedures' type registered as a system procedure (`Registry::register_system`:
//! their steps go first and have a worker of their own, `ExecutorBuilder::system_workers`).
//! The short procedures are submitted at a steady pace (default one every 20 ms, 200 of them), each timed from
//! submit to the end of its `wait`. Once the short ones are done the background ones
//! stop at their next step.
//!
//! The last line is one JSON object (a contract, see `examples/README.md`) with the
//! short procedures' p50 and p99 latency in each phase (`short_p99_alone_ms`,
//! `short_p99_fair_ms`, `short_p99_fifo_ms`, `short_p99_fair_cold_ms`,
//! `short_p99_system_cold_ms`, ...), their
//! counts and each phase's duration.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use proctor::{
    async_trait, Context, Executor, Flow, MemoryStore, ProcError, Procedure, Registry, Scheduling,
};
use serde::{Deserialize, Serialize};

/// The engine allocates a few small objects per step; mimalloc makes that cheaper than
/// the system allocator. The library leaves this choice to the program that uses it.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug, Clone)]
#[command(
    about = "Short procedures' latency alone, beside long ones under the fair queue, and under FIFO"
)]
struct Args {
    /// Concurrent steps.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// Workers kept for young trees under the fair queue (default: the engine's, 1
    /// with 4 workers or more).
    #[arg(long)]
    reserved_workers: Option<usize>,
    /// Workers of their own for system procedures (the last phase's short ones; default:
    /// the engine's, 1).
    #[arg(long)]
    system_workers: Option<usize>,
    /// Background procedures that run many long steps.
    #[arg(long, default_value_t = 6)]
    background: u32,
    /// Steps of each background procedure (it stops earlier once the short ones are
    /// done).
    #[arg(long, default_value_t = 150)]
    background_steps: u32,
    /// How long the background procedures run alone before the short ones start, in
    /// ms: long enough for them to pass a second of step time (the fair queue's level
    /// 1), as procedures that have been running for a while have.
    #[arg(long, default_value_t = 2000)]
    warmup_ms: u64,
    /// Shortest and longest background step, in ms (a sleep inside the step, holding
    /// its worker).
    #[arg(long, default_value_t = 20)]
    step_ms_min: u64,
    #[arg(long, default_value_t = 50)]
    step_ms_max: u64,
    /// How long each step of a short procedure takes, in ms (a sleep inside the step).
    #[arg(long, default_value_t = 5)]
    short_step_ms: u64,
    /// Short procedures per phase.
    #[arg(long, default_value_t = 200)]
    shorts: u32,
    /// One short procedure is submitted every this many ms (whether the earlier ones
    /// have finished or not).
    #[arg(long, default_value_t = 20)]
    every_ms: u64,
}

/// What every step sees: the step lengths, and the flag that stops the background.
struct Env {
    args: Args,
    stop: AtomicBool,
}

/// A short procedure: three steps of `short_step_ms` each.
#[derive(Serialize, Deserialize)]
struct Short {
    left: u32,
}

#[async_trait]
impl Procedure<Env> for Short {
    async fn execute(&mut self, ctx: &mut Context<Env>) -> Result<Flow<Env>, ProcError> {
        let ms = ctx.env().args.short_step_ms;
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        self.left -= 1;
        Ok(if self.left == 0 {
            Flow::Done
        } else {
            Flow::MoreToDo
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<Env>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// A background procedure: many steps, each holding its worker for 20 to 50 ms.
#[derive(Serialize, Deserialize)]
struct Long {
    left: u32,
    seed: u64,
}

#[async_trait]
impl Procedure<Env> for Long {
    async fn execute(&mut self, ctx: &mut Context<Env>) -> Result<Flow<Env>, ProcError> {
        let env = ctx.env();
        if env.stop.load(Ordering::Relaxed) {
            return Ok(Flow::Done);
        }
        let mut rng = fastrand::Rng::with_seed(self.seed.wrapping_add(u64::from(self.left)));
        let ms = rng.u64(env.args.step_ms_min..=env.args.step_ms_max.max(env.args.step_ms_min));
        tokio::time::sleep(Duration::from_millis(ms)).await;
        self.left -= 1;
        Ok(if self.left == 0 {
            Flow::Done
        } else {
            Flow::MoreToDo
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<Env>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// One phase's short-procedure latencies (µs) and its duration.
struct Phase {
    latencies: Histogram<u64>,
    wall: Duration,
}

impl Phase {
    fn ms(&self, quantile: f64) -> f64 {
        self.latencies.value_at_quantile(quantile) as f64 / 1000.0
    }
}

/// What a phase runs beside the short procedures, and how.
#[derive(Clone, Copy)]
struct Setup {
    scheduling: Scheduling,
    /// Background procedures run beside the short ones.
    background: bool,
    /// They run alone for `--warmup-ms` first.
    warmup: bool,
    /// The short procedures' type is a system procedure's.
    short_is_system: bool,
}

async fn phase(args: &Args, setup: Setup) -> Result<Phase, Box<dyn std::error::Error>> {
    let Setup {
        scheduling,
        background,
        warmup,
        short_is_system,
    } = setup;
    let mut registry = Registry::new();
    if short_is_system {
        registry.register_system::<Short>("short");
    } else {
        registry.register::<Short>("short");
    }
    registry.register::<Long>("long");
    let env = Arc::new(Env {
        args: args.clone(),
        stop: AtomicBool::new(false),
    });
    let executor = Executor::builder()
        .registry(registry)
        .env(env.clone())
        .store(MemoryStore::new())
        .workers(args.workers)
        .scheduling(scheduling);
    let executor = match args.reserved_workers {
        Some(n) => executor.reserved_workers(n),
        None => executor,
    };
    let executor = match args.system_workers {
        Some(n) => executor.system_workers(n),
        None => executor,
    };
    let executor = executor.start().await?;
    let started = Instant::now();
    let mut longs = Vec::new();
    if background {
        for seed in 0..args.background {
            let long = Long {
                left: args.background_steps,
                seed: u64::from(seed) * 7919,
            };
            longs.push(executor.submit(long).await?);
        }
        if warmup {
            tokio::time::sleep(Duration::from_millis(args.warmup_ms)).await;
        }
    }
    // Open loop: the submits keep their pace however long the earlier ones take.
    let mut shorts = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(args.every_ms.max(1)));
    for _ in 0..args.shorts {
        tick.tick().await;
        let executor = executor.clone();
        shorts.push(actix::spawn(async move {
            let t = Instant::now();
            let id = executor.submit(Short { left: 3 }).await?;
            executor.wait(id).await?.map_err(|f| f.to_string())?;
            let us = u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX);
            Ok::<_, Box<dyn std::error::Error>>(us.max(1))
        }));
    }
    let mut latencies = Histogram::<u64>::new(3)?;
    for short in shorts {
        latencies.record(short.await?.map_err(|e| e.to_string())?)?;
    }
    let wall = started.elapsed();
    env.stop.store(true, Ordering::Relaxed);
    for id in longs {
        executor.wait(id).await?.map_err(|f| f.to_string())?;
    }
    executor.shutdown().await?;
    Ok(Phase { latencies, wall })
}

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let report = run(&Args::parse()).await?;
    println!("{report}");
    Ok(())
}

/// Runs the five phases, logs each to stderr, and gives the report (the last line).
async fn run(args: &Args) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    if args.workers == 0 || args.shorts == 0 {
        return Err("need --workers >= 1 and --shorts >= 1".into());
    }
    let setup = |scheduling, background, warmup, short_is_system| Setup {
        scheduling,
        background,
        warmup,
        short_is_system,
    };
    let alone = phase(args, setup(Scheduling::Fair, false, false, false)).await?;
    let fair = phase(args, setup(Scheduling::Fair, true, true, false)).await?;
    let fifo = phase(args, setup(Scheduling::Fifo, true, true, false)).await?;
    let cold = phase(args, setup(Scheduling::Fair, true, false, false)).await?;
    let system = phase(args, setup(Scheduling::Fair, true, false, true)).await?;
    for (name, p) in [
        ("alone", &alone),
        ("fair", &fair),
        ("fifo", &fifo),
        ("fair, no warm-up", &cold),
        ("system, no warm-up", &system),
    ] {
        eprintln!(
            "{name:>18}: {} short procedures in {:.1} s, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            p.latencies.len(),
            p.wall.as_secs_f64(),
            p.ms(0.5),
            p.ms(0.99),
            p.ms(1.0),
        );
    }
    let round = |ms: f64| (ms * 100.0).round() / 100.0;
    let report = serde_json::json!({
        "workers": args.workers,
        "background": args.background,
        "short_step_ms": args.short_step_ms,
        "short_count_alone": alone.latencies.len(),
        "short_count_fair": fair.latencies.len(),
        "short_count_fifo": fifo.latencies.len(),
        "short_p50_alone_ms": round(alone.ms(0.5)),
        "short_p50_fair_ms": round(fair.ms(0.5)),
        "short_p50_fifo_ms": round(fifo.ms(0.5)),
        "short_p99_alone_ms": round(alone.ms(0.99)),
        "short_p99_fair_ms": round(fair.ms(0.99)),
        "short_p99_fifo_ms": round(fifo.ms(0.99)),
        "short_p50_fair_cold_ms": round(cold.ms(0.5)),
        "short_p99_fair_cold_ms": round(cold.ms(0.99)),
        "short_p50_system_cold_ms": round(system.ms(0.5)),
        "short_p99_system_cold_ms": round(system.ms(0.99)),
        "fair_cold_over_alone_p99": round(cold.ms(0.99) / alone.ms(0.99).max(0.001)),
        "system_cold_over_alone_p99": round(system.ms(0.99) / alone.ms(0.99).max(0.001)),
        "fair_over_alone_p99": round(fair.ms(0.99) / alone.ms(0.99).max(0.001)),
        "fifo_over_alone_p99": round(fifo.ms(0.99) / alone.ms(0.99).max(0.001)),
        "wall_s_alone": round(alone.wall.as_secs_f64()),
        "wall_s_fair": round(fair.wall.as_secs_f64()),
        "wall_s_fifo": round(fifo.wall.as_secs_f64()),
        "wall_s_fair_cold": round(cold.wall.as_secs_f64()),
        "wall_s_system_cold": round(system.wall.as_secs_f64()),
        "reserved_workers": args.reserved_workers,
        "system_workers": args.system_workers,
        "warmup_ms": args.warmup_ms,
    });
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report's shape (the contract's keys, every short procedure counted), on a
    /// run small enough for `cargo test`. Its figures are timings: they are measured
    /// by the full run (BENCHMARKS.md), not asserted here.
    #[actix::test]
    async fn the_report_has_every_phase_and_the_contracts_keys() {
        let args = Args::parse_from([
            "fairness",
            "--workers=2",
            "--background=2",
            "--background-steps=30",
            "--warmup-ms=50",
            "--step-ms-min=1",
            "--step-ms-max=3",
            "--short-step-ms=1",
            "--shorts=20",
            "--every-ms=2",
        ]);
        let report = run(&args).await.unwrap();
        for key in [
            "short_p99_alone_ms",
            "short_p99_fair_ms",
            "short_p99_fifo_ms",
            "short_p99_fair_cold_ms",
            "short_p99_system_cold_ms",
            "fair_over_alone_p99",
        ] {
            let ms = report[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key}: {report}"));
            // Three steps of 1 ms each at the least.
            assert!(ms > 0.0, "{key}: {report}");
        }
        for key in ["short_count_alone", "short_count_fair", "short_count_fifo"] {
            assert_eq!(report[key], 20, "{key}: {report}");
        }
        // One line: what outside checks read.
        assert!(!report.to_string().contains('\n'));
    }
}
