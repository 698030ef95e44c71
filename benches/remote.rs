//! Remote operations through the dispatcher, beside the same operations called directly
//! from the step, in one run. Each procedure sends one operation to one of `--targets`
//! fake targets and finishes once it is reported; `--concurrency` procedures are in
//! flight. The fake targets answer every request at once with the reports of all its
//! operations (a request-response RPC), so what is measured is the engine's side: the
//! dispatcher, its batching and the operation's child procedure.
//!
//! ```sh
//! cargo bench --bench remote -- --procs 20000 --concurrency 1000 --targets 10
//! ```
//!
//! Prints one JSON line per mode: `dispatched` (through the dispatcher, with the default
//! batching of 32 operations or 150 ms, then with `--short-age-ms`) and `direct` (the
//! step awaits the target's call itself): operations per second, requests per
//! operation, and the procedures' latency (p50, p99).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use proctor::{
    async_trait, Context, Executor, Flow, MemoryStore, OpId, ProcError, Procedure, Registry,
    RemoteOptions, Report, Transport, TransportError,
};
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
struct Args {
    /// Procedures (one operation each) per mode.
    #[arg(long, default_value_t = 20_000)]
    procs: u64,
    /// Procedures in flight at once.
    #[arg(long, default_value_t = 1000)]
    concurrency: usize,
    /// Fake targets.
    #[arg(long, default_value_t = 10)]
    targets: u64,
    /// The short batching age of the second dispatched run, in ms.
    #[arg(long, default_value_t = 5)]
    short_age_ms: u64,
    /// `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The fake targets: count requests, answer each with its operations' reports.
#[derive(Default)]
struct Targets {
    requests: AtomicU64,
}

impl Targets {
    async fn call(&self, ops: &[(OpId, u32)]) -> Vec<Report> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        ops.iter()
            .filter_map(|(id, region)| Report::ok(*id, region).ok())
            .collect()
    }
}

struct Fake(Arc<Targets>);

#[async_trait]
impl Transport for Fake {
    type Op = u32;
    async fn send(&self, _: &str, ops: Vec<(OpId, u32)>) -> Result<Vec<Report>, TransportError> {
        Ok(self.0.call(&ops).await)
    }
}

/// What the procedures reach: the targets, for the direct calls.
struct Env {
    targets: Arc<Targets>,
    count: u64,
}

/// Sends one operation to its target and finishes when it is reported (`direct`: the
/// step calls the target itself).
#[derive(Serialize, Deserialize)]
struct OneOp {
    n: u64,
    direct: bool,
    sent: bool,
}

#[async_trait]
impl Procedure<Env> for OneOp {
    async fn execute(&mut self, ctx: &mut Context<Env>) -> Result<Flow<Env>, ProcError> {
        if self.direct {
            let reports = ctx.env().targets.call(&[(OpId(self.n), 1)]).await;
            assert_eq!(reports.len(), 1);
            return Ok(Flow::Done);
        }
        if self.sent {
            let results = ctx.remote_results();
            let _: u32 = results[0].value()?;
            return Ok(Flow::Done);
        }
        let target = format!("t{}", self.n % ctx.env().count);
        ctx.dispatch::<Fake>(target, &1u32)?;
        self.sent = true;
        Ok(ctx.await_remote())
    }
    async fn rollback(&mut self, _: &mut Context<Env>) -> Result<(), ProcError> {
        Ok(())
    }
}

async fn run(
    args: &Args,
    mode: &str,
    age_ms: u64,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let targets = Arc::new(Targets::default());
    let mut registry = Registry::new();
    registry.register::<OneOp>("one_op");
    let executor = Executor::builder()
        .registry(registry)
        .store(MemoryStore::new())
        .env(Env {
            targets: targets.clone(),
            count: args.targets,
        })
        .remote(
            Fake(targets.clone()),
            RemoteOptions::default().max_age(Duration::from_millis(age_ms)),
        )
        .start()
        .await?;
    let window = Arc::new(tokio::sync::Semaphore::new(args.concurrency));
    let latency = Arc::new(std::sync::Mutex::new(Histogram::<u64>::new_with_bounds(
        1,
        600_000_000,
        3,
    )?));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for n in 0..args.procs {
        let permit = window.clone().acquire_owned().await?;
        let (executor, latency) = (executor.clone(), latency.clone());
        let direct = mode == "direct";
        tasks.push(actix::spawn(async move {
            let t0 = Instant::now();
            let id = executor
                .submit(OneOp {
                    n,
                    direct,
                    sent: false,
                })
                .await
                .expect("submit");
            assert!(executor.wait(id).await.expect("wait").is_ok());
            let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
            latency.lock().unwrap().saturating_record(us);
            drop(permit);
        }));
    }
    for task in tasks {
        task.await?;
    }
    let wall = started.elapsed().as_secs_f64();
    executor.shutdown().await?;
    let requests = targets.requests.load(Ordering::Relaxed);
    let latency = latency.lock().unwrap();
    let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    Ok(serde_json::json!({
        "mode": mode,
        "max_age_ms": if mode == "direct" { None } else { Some(age_ms) },
        "ops": args.procs,
        "ops_per_s": (args.procs as f64 / wall).round(),
        "requests": requests,
        "requests_per_op": (requests as f64 / args.procs as f64 * 1000.0).round() / 1000.0,
        "p50_ms": ms(0.5),
        "p99_ms": ms(0.99),
    }))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    actix::System::new().block_on(async {
        for (mode, age) in [
            ("dispatched", 150),
            ("dispatched", args.short_age_ms),
            ("direct", 0),
        ] {
            println!("{}", run(&args, mode, age).await?);
        }
        Ok(())
    })
}
