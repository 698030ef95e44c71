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
//! listener answers every GET with the Prometheus text format, with the bucket bounds
//! proctor suggests installed, so its durations are histograms (which aggregate across
//! instances), not summaries. The program runs a few transfers (two fail and roll back,
//! one is retried once, one waits for an approval and is aborted) and a batch with
//! children, prints the address, and keeps serving until it is killed, or for
//! `--serve-secs` seconds. The names, kinds and labels of every metric are in the
//! `proctor::metrics` module's docs.

use std::io::IsTerminal;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use std::time::Duration;
use tokio::sync::Notify;

use clap::Parser;
use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};
use proctor::{
    async_trait, Context, Executor, FailurePolicy, Flow, ProcError, ProcId, Procedure, Registry,
    WalStore,
};
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
/// (Public, as are `Batch`, `registry` and `exporter`, for `tests/metrics.rs`, which
/// runs them.)
#[derive(Serialize, Deserialize, Default)]
pub struct Transfer {
    pub done: u32,
    pub fail_at: Option<u32>,
    /// After its first step it waits for the event `approve-<id>`.
    pub needs_approval: bool,
}

/// The ledger the transfers write to: it answers "busy" to the next `busy` calls, and
/// is told when a transfer waits for an approval.
#[derive(Default)]
pub struct Ledger {
    pub busy: AtomicU32,
    pub approval_asked: Notify,
}

impl Ledger {
    fn write(&self) -> Result<(), ProcError> {
        let busy = self
            .busy
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        match busy {
            Ok(_) => Err(ProcError::failed(BUSY)),
            Err(_) => Ok(()),
        }
    }
}

const BUSY: &str = "ledger busy";

#[async_trait]
impl Procedure<Ledger> for Transfer {
    async fn execute(&mut self, ctx: &mut Context<Ledger>) -> Result<Flow<Ledger>, ProcError> {
        ctx.env().write()?;
        self.done += 1;
        // Logged inside the engine's `procedure` and `step` spans: the line carries
        // the procedure's id, root, type and step.
        tracing::info!(step = self.done, "transfer step");
        if Some(self.done) == self.fail_at {
            return Err(ProcError::failed("insufficient funds"));
        }
        if self.done == 1 && self.needs_approval {
            self.needs_approval = false;
            ctx.env().approval_asked.notify_one();
            return Ok(Flow::Suspend(format!("approve-{}", ctx.id())));
        }
        Ok(if self.done == 3 {
            Flow::Done
        } else {
            Flow::MoreToDo
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<Ledger>) -> Result<(), ProcError> {
        Ok(())
    }

    /// A busy ledger is worth a few more tries; anything else rolls the transfer back.
    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        match error {
            ProcError::Failed(message) if message == BUSY => FailurePolicy::RetryThenRollback {
                times: 3,
                backoff_ms: 10,
            },
            _ => FailurePolicy::Rollback,
        }
    }
}

/// Starts `n` transfers as children, then ends.
#[derive(Serialize, Deserialize)]
pub struct Batch {
    pub n: u32,
    pub started: bool,
}

#[async_trait]
impl Procedure<Ledger> for Batch {
    async fn execute(&mut self, _ctx: &mut Context<Ledger>) -> Result<Flow<Ledger>, ProcError> {
        if self.started {
            return Ok(Flow::Done);
        }
        self.started = true;
        let children = (0..self.n).map(|_| Transfer::default());
        Ok(Flow::children(children))
    }

    async fn rollback(&mut self, _ctx: &mut Context<Ledger>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// The two procedure types, registered.
pub fn registry() -> Registry<Ledger> {
    let mut registry = Registry::new();
    registry
        .register::<Transfer>("transfer")
        .register::<Batch>("batch");
    registry
}

/// A Prometheus exporter serving on `addr`, with the bucket bounds proctor suggests for
/// each of its histograms.
pub fn exporter(addr: SocketAddr) -> Result<PrometheusBuilder, BuildError> {
    let mut builder = PrometheusBuilder::new().with_http_listener(addr);
    for (name, buckets) in proctor::metrics::BUCKETS {
        builder = builder.set_buckets_for_metric(Matcher::Full(name.to_string()), buckets)?;
    }
    Ok(builder)
}

/// Runs the transfers and the batch on `executor`: four transfers succeed, two roll
/// back, one is retried once before it succeeds, one is aborted while it waits for its
/// approval, and the batch's three children succeed. Returns each root's id and
/// whether it succeeded.
pub async fn transfers(
    executor: &Executor<Ledger>,
    ledger: &Ledger,
) -> Result<Vec<(ProcId, bool)>, proctor::Error> {
    let mut ids = Vec::new();
    for i in 0..6 {
        let fail_at = (i >= 4).then_some(2);
        let transfer = Transfer {
            fail_at,
            ..Transfer::default()
        };
        ids.push(executor.submit(transfer).await?);
    }
    // The ledger is busy for the next write: this transfer's first step fails once.
    ledger.busy.store(1, Ordering::Relaxed);
    ids.push(executor.submit(Transfer::default()).await?);
    let waiting = Transfer {
        needs_approval: true,
        ..Transfer::default()
    };
    let waiting = executor.submit(waiting).await?;
    ids.push(waiting);
    ids.push(
        executor
            .submit(Batch {
                n: 3,
                started: false,
            })
            .await?,
    );
    // No approval comes: once it asked, an operator aborts it (it rolls back).
    ledger.approval_asked.notified().await;
    executor.abort(waiting).await?;
    let mut outcomes = Vec::new();
    for id in ids {
        outcomes.push((id, executor.wait(id).await?.is_ok()));
    }
    Ok(outcomes)
}

async fn run(serve: Option<Duration>) -> Result<(), Box<dyn std::error::Error>> {
    // The WAL store, as a service runs it (its metrics are the WAL's): here in a
    // directory of its own, removed at the end.
    let dir = tempfile::tempdir()?;
    let ledger = Arc::new(Ledger::default());
    let executor = Executor::builder()
        .registry(registry())
        .env(ledger.clone())
        .store(WalStore::open(dir.path())?)
        .start()
        .await?;
    for (id, succeeded) in transfers(&executor, &ledger).await? {
        let outcome = if succeeded { "SUCCESS" } else { "ROLLEDBACK" };
        println!("procedure {id}: {outcome}");
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
    exporter(args.addr)?.install()?;
    println!("serving metrics on http://{}/metrics", args.addr);
    actix::System::new().block_on(run(args.serve_secs.map(Duration::from_secs)))
}
