//! The admin page's response time with many procedures: an engine holding `--procs`
//! finished roots (their results kept), and `--requests` GETs of one page of the
//! procedures (100 rows), as HTML and as JSON, and of a filtered page.
//!
//! ```sh
//! cargo bench --bench admin -- --procs 100000 --requests 200
//! ```
//!
//! Prints one JSON line per request kind: p50, p99 and max in ms.

use std::time::{Duration, Instant};

use clap::Parser;
use hdrhistogram::Histogram;
use proctor::admin::AdminConfig;
use proctor::{async_trait, Context, Executor, Flow, MemoryStore, ProcError, Procedure, Registry};
use serde::{Deserialize, Serialize};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
struct Args {
    /// Finished roots the engine holds.
    #[arg(long, default_value_t = 100_000)]
    procs: u64,
    /// Requests per kind.
    #[arg(long, default_value_t = 200)]
    requests: u32,
    /// `cargo bench` passes `--bench`.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Serialize, Deserialize)]
struct Noop;

#[async_trait]
impl Procedure for Noop {
    async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
        Ok(Flow::Done)
    }
    async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let mut registry = Registry::new();
        registry.register::<Noop>("noop");
        let executor = Executor::builder()
            .registry(registry)
            .store(MemoryStore::new())
            .start()
            .await?;
        let window = std::sync::Arc::new(tokio::sync::Semaphore::new(1000));
        let mut tasks = Vec::new();
        for _ in 0..args.procs {
            let permit = window.clone().acquire_owned().await?;
            let executor = executor.clone();
            tasks.push(tokio::spawn(async move {
                let id = executor.submit(Noop).await.expect("submit");
                let _ = executor.wait(id).await;
                drop(permit);
            }));
        }
        for task in tasks {
            task.await?;
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}/", listener.local_addr()?);
        tokio::spawn(AdminConfig::default().serve_on(listener, executor.clone()));
        let http = reqwest::Client::new();
        for (kind, path, json) in [
            ("html page 1", "procedures", false),
            ("json page 1", "procedures", true),
            (
                "json page 500, state SUCCESS",
                "procedures?state=SUCCESS&page=500",
                true,
            ),
        ] {
            let mut times = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
            for _ in 0..args.requests {
                let started = Instant::now();
                let mut request = http.get(format!("{base}{path}"));
                if json {
                    request = request.header("accept", "application/json");
                }
                let body = request.send().await?.bytes().await?;
                assert!(body.len() > 100);
                times.record(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX))?;
            }
            let ms = |us: u64| Duration::from_micros(us).as_secs_f64() * 1000.0;
            println!(
                "{}",
                serde_json::json!({
                    "request": kind,
                    "procedures": args.procs,
                    "p50_ms": ms(times.value_at_quantile(0.5)),
                    "p99_ms": ms(times.value_at_quantile(0.99)),
                    "max_ms": ms(times.max()),
                })
            );
        }
        executor.shutdown().await?;
        Ok(())
    })
}
