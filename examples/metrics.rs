//! Metrics: the engine's metrics served to Prometheus, and its log as `RUST_LOG` says.
//! Run it with
//!
//! ```sh
//! RUST_LOG=info cargo run --release --example metrics -- --addr 127.0.0.1:9091
//! curl -s http://127.0.0.1:9091/metrics | grep proctor_
//! ```
//!
//! proctor records its metrics through the `metrics` facade and installs nothing; the
//! application picks the exporter. Here it is `metrics-exporter-prometheus`, whose HTTP
//! listener answers every GET with the Prometheus text format. The program runs a few
//! transfers (two fail and roll back) and a batch with children, prints the address, and
//! keeps serving until it is killed, or for `--serve-secs` seconds. The names, kinds and
//! labels of every metric are in the `proctor::metrics` module's docs.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use metrics_exporter_prometheus::PrometheusBuilder;
use proctor::{async_trait, Context, Executor, Flow, ProcError, Procedure, Registry, WalStore};
use serde::{Deserialize, Serialize};

#[derive(Parser)]
struct Args {
    /// Where the Prometheus endpoint listens.
    #[arg(long, default_value = "127.0.0.1:9091")]
    addr: SocketAddr,
    /// Stop serving after this many seconds (default: serve until killed).
    #[arg(long)]
    serve_secs: Option<u64>,
}

/// Three steps; fails at `fail_at` (the rollback then undoes the steps before it).
/// (Public, as are `Batch` and `registry`, for `tests/metrics.rs`, which runs them.)
#[derive(Serialize, Deserialize)]
pub struct Transfer {
    pub done: u32,
    pub fail_at: Option<u32>,
}

#[async_trait]
impl Procedure for Transfer {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        self.done += 1;
        // Logged inside the engine's `procedure` and `step` spans: the line carries
        // the procedure's id, root, type and step.
        tracing::info!(step = self.done, "transfer step");
        if Some(self.done) == self.fail_at {
            return Err(ProcError::failed("insufficient funds"));
        }
        Ok(if self.done == 3 {
            Flow::Done
        } else {
            Flow::MoreToDo
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

/// Starts `n` transfers as children, then ends.
#[derive(Serialize, Deserialize)]
pub struct Batch {
    pub n: u32,
    pub started: bool,
}

#[async_trait]
impl Procedure for Batch {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        if self.started {
            return Ok(Flow::Done);
        }
        self.started = true;
        let children = (0..self.n).map(|_| Transfer {
            done: 0,
            fail_at: None,
        });
        Ok(Flow::children(children))
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

/// The two procedure types, registered.
pub fn registry() -> Registry {
    let mut registry = Registry::new();
    registry
        .register::<Transfer>("transfer")
        .register::<Batch>("batch");
    registry
}

async fn run(serve: Option<Duration>) -> Result<(), Box<dyn std::error::Error>> {
    // The WAL store, as a service runs it (its metrics are the WAL's): here in a
    // directory of its own, removed at the end.
    let dir = tempfile::tempdir()?;
    let executor = Executor::builder()
        .registry(registry())
        .store(WalStore::open(dir.path())?)
        .start()
        .await?;

    let mut ids = Vec::new();
    for i in 0..6 {
        let fail_at = (i >= 4).then_some(2);
        ids.push(executor.submit(Transfer { done: 0, fail_at }).await?);
    }
    ids.push(
        executor
            .submit(Batch {
                n: 3,
                started: false,
            })
            .await?,
    );
    for id in ids {
        match executor.wait(id).await? {
            Ok(()) => println!("procedure {id}: SUCCESS"),
            Err(failure) => println!("procedure {id}: ROLLEDBACK ({})", failure.error),
        }
    }
    match serve {
        Some(d) => actix::clock::sleep(d).await,
        None => std::future::pending().await,
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // Installed before the actix system exists, so the exporter runs its HTTP listener
    // on a thread of its own.
    PrometheusBuilder::new()
        .with_http_listener(args.addr)
        .install()?;
    println!("serving metrics on http://{}/metrics", args.addr);
    actix::System::new().block_on(run(args.serve_secs.map(Duration::from_secs)))
}
