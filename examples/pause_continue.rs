//! Pause and continue: an operator pauses a rolling upgrade (a DAG of tasks) while it
//! runs, reads its state back from the executor, and continues it. Run it with
//!
//! ```sh
//! cargo run --release --example pause_continue
//! ```
//!
//! It prints the tasks as they run, then `procedure N is PAUSED (...)` read back from the
//! executor, then the rest of the tasks, and ends with `procedure N finished: SUCCESS`
//! (exit code 0). The pause takes effect at the DAG's next step: the tasks of the wave
//! that is running finish, the next wave does not start until the continue. The paused
//! state is durable (here in a WAL in a temporary directory) and would survive a
//! restart.

use std::sync::Arc;
use std::time::Duration;

use proctor::{
    async_trait, Context, Dag, DagBuilder, DagTask, Executor, ProcError, ProcState, Registry, Task,
    WalStore,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

/// What the tasks tell `main`: a task has finished.
#[derive(Default)]
struct Progress {
    task_done: Notify,
}

/// One step of upgrading a node.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum Upgrade {
    Drain(String),
    Install(String),
    Restart(String),
}

#[async_trait]
impl Task<Progress> for Upgrade {
    async fn execute(&self, ctx: &mut Context<Progress>) -> Result<(), ProcError> {
        // Stands in for the remote call; idempotent in a real service.
        tokio::time::sleep(Duration::from_millis(50)).await;
        println!("  [task {}] {self:?} done", ctx.id());
        ctx.env().task_done.notify_one();
        Ok(())
    }

    async fn rollback(&self, _ctx: &mut Context<Progress>) -> Result<(), ProcError> {
        Ok(())
    }
}

fn upgrade(nodes: &[&str]) -> Result<Dag<Upgrade>, proctor::DagError> {
    let mut dag = DagBuilder::new();
    let mut restarts = Vec::new();
    for node in nodes {
        let drain = dag.add(Upgrade::Drain(node.to_string()));
        let install = dag.add(Upgrade::Install(node.to_string()));
        let restart = dag.add(Upgrade::Restart(node.to_string()));
        dag.edge(drain, install).edge(install, restart);
        restarts.push(restart);
    }
    // One node restarts at a time.
    for pair in restarts.windows(2) {
        dag.edge(pair[0], pair[1]);
    }
    dag.parallelism(2);
    dag.build()
}

/// What the run saw: the state read back after the pause, and the final one.
#[derive(Debug)]
#[cfg_attr(not(test), allow(dead_code))] // read by the test
struct Seen {
    paused: ProcState,
    finished: ProcState,
}

/// The whole flow, on a WAL in `dir`.
async fn run(dir: &std::path::Path) -> Result<Seen, Box<dyn std::error::Error>> {
    let progress = Arc::new(Progress::default());
    let mut registry = Registry::new();
    registry
        .register::<Dag<Upgrade>>("rolling_upgrade")
        .register::<DagTask<Upgrade>>("upgrade_task");
    let executor = Executor::builder()
        .registry(registry)
        .env(progress.clone())
        .store(WalStore::open(dir)?)
        .start()
        .await?;

    let id = executor.submit(upgrade(&["dn-1", "dn-2", "dn-3"])?).await?;
    println!("submitted the rolling upgrade as procedure {id}");

    // Once it is under way, an operator pauses it; the answer comes when it is PAUSED.
    progress.task_done.notified().await;
    println!("pausing procedure {id}");
    executor.pause(id).await?;
    let info = executor.state(id).await?;
    println!(
        "procedure {id} is {} ({})",
        info.state,
        info.state_name.as_deref().unwrap_or("-")
    );
    let paused = info.state;
    if paused != ProcState::Paused {
        return Err(format!("procedure {id} is {paused}, not PAUSED").into());
    }

    println!("continuing procedure {id}");
    executor.resume(id).await?;
    let result = executor.wait(id).await?;
    let finished = executor.state(id).await?.state;
    executor.shutdown().await?;
    match result {
        Ok(()) => {
            println!("procedure {id} finished: {finished}");
            Ok(Seen { paused, finished })
        }
        Err(failure) => Err(format!("procedure {id} ended {finished}: {failure}").into()),
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    run(dir.path()).await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread")]
    async fn the_upgrade_pauses_and_continues_to_success() {
        let dir = tempfile::tempdir().unwrap();
        let seen = run(dir.path()).await.unwrap();
        assert_eq!(seen.paused, ProcState::Paused);
        assert_eq!(seen.finished, ProcState::Success);
    }
}
