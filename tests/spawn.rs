//! `Flow::WaitAny`: a parent woken as each child succeeds, through the actors (the
//! core's rules are table-tested in `src/root_stack.rs`; the DAG, its main user, in
//! `tests/dag.rs`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::stores;
use proctor::{
    async_trait, Context, Executor, Flow, ProcError, ProcState, Procedure, ProcedureStore, Registry,
};
use serde::{Deserialize, Serialize};

#[derive(Default)]
struct World {
    calls: Mutex<Vec<String>>,
    gate: tokio::sync::Notify,
}

impl World {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

/// Step 1 marks the point of no return and spawns a quick child and a gated one; step 2
/// returns `Done` while the gated one runs (a mistake the engine refuses); later steps
/// wait for the children, then end.
#[derive(Clone, Serialize, Deserialize)]
struct Parent {
    at: u32,
}

#[derive(Clone, Serialize, Deserialize)]
struct Kid {
    gated: bool,
}

#[async_trait]
impl Procedure<World> for Parent {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        self.at += 1;
        ctx.env()
            .calls
            .lock()
            .unwrap()
            .push(format!("parent {}", self.at));
        Ok(match self.at {
            1 => {
                ctx.set_irreversible();
                Flow::WaitAny(vec![
                    Box::new(Kid { gated: false }),
                    Box::new(Kid { gated: true }),
                ])
            }
            2 => Flow::Done,
            _ if ctx.children().iter().all(|(_, s)| *s == ProcState::Success) => Flow::Done,
            _ => Flow::WaitAny(Vec::new()),
        })
    }

    async fn rollback(&mut self, _: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }
}

#[async_trait]
impl Procedure<World> for Kid {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        if self.gated {
            ctx.env_arc().clone().gate.notified().await;
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }
}

async fn start(store: Box<dyn ProcedureStore>, world: Arc<World>) -> Executor<World> {
    let mut registry = Registry::new();
    registry.register::<Parent>("parent").register::<Kid>("kid");
    Executor::builder()
        .registry(registry)
        .store(store)
        .env(world)
        .start()
        .await
        .unwrap()
}

/// Past the point of no return the refused `Done` pauses the parent; continued, it runs
/// its next step (its cell had taken the `Done` as final and skipped every later step:
/// the tree hung RUNNABLE).
#[actix::test]
async fn a_parent_paused_for_finishing_before_its_children_runs_when_continued() {
    for (store_name, store, _dir) in stores() {
        let world = Arc::new(World::default());
        let executor = start(store, world.clone()).await;
        let id = executor.submit(Parent { at: 0 }).await.unwrap();
        while executor.state(id).await.unwrap().state != ProcState::Paused {
            tokio::task::yield_now().await;
        }
        let paused = executor.state(id).await.unwrap();
        let why = paused.steering.paused.expect("why it paused");
        let error = why.error.expect("the refused step's error").to_string();
        assert!(
            error.contains("returned Flow::Done with 1 children unfinished"),
            "{store_name}: {error}"
        );
        executor.resume(id).await.unwrap();
        world.gate.notify_one();
        let result = tokio::time::timeout(Duration::from_secs(30), executor.wait(id)).await;
        let state = executor.state(id).await.map(|i| i.state);
        let result = result.unwrap_or_else(|_| {
            panic!(
                "{store_name}: the tree hangs: parent is {state:?}, calls {:?}",
                world.calls()
            )
        });
        assert_eq!(result.unwrap(), Ok(()), "{store_name}");
        let calls = world.calls();
        assert_eq!(calls[..2], ["parent 1", "parent 2"], "{store_name}");
        // Step 3 ends it, or waits for the gated child and step 4 does.
        let last = calls.last().map(String::as_str);
        assert!(
            matches!(last, Some("parent 3" | "parent 4")),
            "{store_name}: {calls:?}"
        );
        executor.shutdown().await.unwrap();
    }
}
