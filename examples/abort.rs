//! Abort: start a long-running procedure, send it an abort message, and watch it roll
//! back. Run it with
//!
//! ```sh
//! cargo run --release --example abort
//! ```
//!
//! The procedure drains a server one region per step, sleeping between steps (the
//! engine holds no worker while it sleeps). The operator's `Abort` message is accepted
//! between steps; the engine then calls `rollback` once per executed step, newest first,
//! and the procedure ends ROLLEDBACK with the abort as its error.

use std::io::IsTerminal;
use std::sync::Arc;

use proctor::messages::Abort;
use proctor::{
    async_trait, Context, Executor, Flow, ProcError, ProcState, Procedure, Registry, WalStore,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

#[derive(Serialize, Deserialize)]
struct DrainServer {
    server: String,
    moved: Vec<String>,
}

/// Lets `main` know the procedure is under way before it aborts it.
struct Progress(Notify);

#[async_trait]
impl Procedure<Progress> for DrainServer {
    async fn execute(&mut self, ctx: &mut Context<Progress>) -> Result<Flow<Progress>, ProcError> {
        let region = format!("region-{}", self.moved.len());
        println!("[procedure {}] move {region} off {}", ctx.id(), self.server);
        self.moved.push(region);
        if self.moved.len() == 3 {
            ctx.env().0.notify_one();
        }
        // Plenty of regions to go: sleep 20 ms, then the next step.
        Ok(Flow::SleepUntil(ctx.now_ms() + 20))
    }

    async fn rollback(&mut self, ctx: &mut Context<Progress>) -> Result<(), ProcError> {
        // One call per executed step: move the newest region back.
        if let Some(region) = self.moved.pop() {
            println!(
                "[procedure {}] move {region} back to {}",
                ctx.id(),
                self.server
            );
        }
        Ok(())
    }
}

#[actix::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The engine's log on stderr as `RUST_LOG` says: with `RUST_LOG=info`, the abort
    // accepted, the tree rolled back, and the procedure finished ROLLEDBACK.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let mut registry = Registry::new();
    registry.register::<DrainServer>("drain_server");
    let progress = Arc::new(Progress(Notify::new()));
    let dir = tempfile::tempdir()?;
    let executor = Executor::builder()
        .registry(registry)
        .store(WalStore::open(dir.path())?)
        .env(progress.clone())
        .start()
        .await?;

    let id = executor
        .submit(DrainServer {
            server: "rs-7".into(),
            moved: Vec::new(),
        })
        .await?;
    progress.0.notified().await;

    // The abort is a message to the executor actor, like any other.
    let accepted = executor.addr()?.send(Abort(id)).await??;
    println!("abort of procedure {id} accepted: {accepted}");

    let result = executor.wait(id).await?;
    let state = executor.state(id).await?.state;
    match result {
        Err(failure) if state == ProcState::RolledBack => {
            println!("procedure {id} rolled back ({state}): {}", failure.error);
            Ok(())
        }
        other => Err(format!("procedure {id} ended {state}: {other:?}").into()),
    }
}
