//! `?` inside a step: any `std::error::Error` becomes the procedure's failure with its
//! message, type and chain of sources, and the caller receives exactly that, also from
//! the next engine after a restart.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use proctor::{async_trait, Context, Executor, Flow, ProcError, Procedure, Registry};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
#[error("region r-17 unavailable")]
struct RegionError {
    #[source]
    cause: std::io::Error,
}

fn reach_region() -> Result<(), RegionError> {
    Err(RegionError {
        cause: std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"),
    })
}

#[derive(Serialize, Deserialize)]
struct MoveRegion;

#[async_trait]
impl Procedure for MoveRegion {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        reach_region()?;
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

async fn start(store: Box<dyn proctor::ProcedureStore>) -> Executor {
    let mut registry = Registry::new();
    registry.register::<MoveRegion>("move-region");
    Executor::builder()
        .registry(registry)
        .store(store)
        .start()
        .await
        .expect("starts")
}

#[actix::test]
async fn a_step_error_returned_with_question_mark_keeps_its_type_and_sources() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let executor = start(store.open()).await;
        let id = executor.submit(MoveRegion).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        let expected = ProcError::Error {
            message: "region r-17 unavailable".into(),
            type_name: "errors::RegionError".into(),
            sources: vec!["connection refused".into()],
        };
        assert_eq!(failure.error, expected, "{name}");
        assert_eq!(
            failure.to_string(),
            format!(
                "procedure {id} (move-region) failed: region r-17 unavailable: connection refused"
            ),
            "{name}"
        );
        executor.shutdown().await.unwrap();

        let executor = start(store.open()).await;
        let again = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(again.error, expected, "{name}: the same after a restart");
        executor.shutdown().await.unwrap();
    }
}

/// What the region server and the procedures below did, as the test sees it.
#[derive(Default)]
struct World {
    calls: Mutex<Vec<String>>,
    /// How many more connections the region server refuses.
    refusals: AtomicU32,
}

impl World {
    fn refusing(refusals: u32) -> Arc<World> {
        let world = World::default();
        world.refusals.store(refusals, Ordering::SeqCst);
        Arc::new(world)
    }

    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    /// The region server: refuses the connection while it has refusals left.
    fn connect(&self) -> Result<(), std::io::Error> {
        let refused = self
            .refusals
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if refused {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionRefused,
                "connection refused",
            ));
        }
        Ok(())
    }
}

/// Three steps; the second connects to the region server and returns its error with `?`.
#[derive(Serialize, Deserialize)]
struct OpenRegion {
    at: u32,
}

#[async_trait]
impl Procedure<World> for OpenRegion {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        self.at += 1;
        world.record(format!("exec {}", self.at));
        if self.at == 2 {
            world.connect()?;
        }
        Ok(if self.at < 3 {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        ctx.env()
            .record(format!("rollback {} ({})", self.at, ctx.undoing()));
        self.at -= 1;
        Ok(())
    }
}

async fn start_world(
    store: Box<dyn proctor::ProcedureStore>,
    world: Arc<World>,
) -> Executor<World> {
    let mut registry = Registry::<World>::default();
    registry.register::<OpenRegion>("open-region");
    Executor::builder()
        .registry(registry)
        .store(store)
        .env(world)
        .start()
        .await
        .expect("starts")
}

#[actix::test]
async fn a_transient_io_error_returned_with_question_mark_rolls_back_at_once() {
    for name in common::STORES {
        // The region server refuses once, and would answer the next call: a plain `?`
        // does not say so, and the tree rolls back at once, the failed step first.
        let world = World::refusing(1);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let id = executor.submit(OpenRegion { at: 0 }).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error.to_string(), "connection refused", "{name}");
        let expected = [
            "exec 1",
            "exec 2",
            "rollback 2 (failed)",
            "rollback 1 (completed)",
        ];
        assert_eq!(world.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();
    }
}
