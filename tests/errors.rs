//! `?` inside a step: any `std::error::Error` becomes the procedure's failure with its
//! message, type and chain of sources, and the caller receives exactly that, also from
//! the next engine after a restart. An error that says it is worth trying again
//! (`ProcError::retryable`) is retried under its step's retry policy before its tree
//! rolls back; one that says it is not (`ProcError::terminal`) is never retried; a
//! plain `?` rolls back at once, as the default policy says. A failure's code reaches
//! the waiter, who matches on it, also after a restart. On every store.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use proctor::{
    async_trait, Context, ErrorKind, Executor, FailurePolicy, Flow, ProcError, ProcState,
    Procedure, Registry, RetryPolicy, WaitError,
};
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
    /// The tables that exist.
    tables: Mutex<Vec<String>>,
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

/// How a step returns the region server's error.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Mark {
    /// `?` alone.
    Plain,
    /// `.map_err(ProcError::retryable)?`
    Retryable,
    /// `.map_err(ProcError::terminal)?`
    Terminal,
}

/// Three steps; the second connects to the region server and returns its error as
/// `mark` says, under the retry policy `retry` (if any). Step 1 can be the point of no
/// return.
#[derive(Serialize, Deserialize)]
struct OpenRegion {
    at: u32,
    mark: Mark,
    retry: Option<RetryPolicy>,
    policy: FailurePolicy,
    irreversible: bool,
}

impl OpenRegion {
    fn new(mark: Mark) -> Self {
        OpenRegion {
            at: 0,
            mark,
            retry: None,
            policy: FailurePolicy::Rollback,
            irreversible: false,
        }
    }

    fn retrying(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }
}

#[async_trait]
impl Procedure<World> for OpenRegion {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        self.at += 1;
        world.record(format!("exec {}", self.at));
        if self.at == 1 && self.irreversible {
            ctx.set_irreversible();
        }
        if self.at == 2 {
            if let Some(retry) = self.retry {
                ctx.set_retry_policy(retry);
            }
            match self.mark {
                Mark::Plain => world.connect()?,
                Mark::Retryable => world.connect().map_err(ProcError::retryable)?,
                Mark::Terminal => world.connect().map_err(ProcError::terminal)?,
            }
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

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        self.policy
    }
}

/// Creates a table: fails with the code `already_exists` if it exists.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    name: String,
}

#[async_trait]
impl Procedure<World> for CreateTable {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let mut tables = ctx.env().tables.lock().unwrap();
        if tables.contains(&self.name) {
            let exists = format!("table {} exists", self.name);
            return Err(ProcError::with_code("already_exists", exists));
        }
        tables.push(self.name.clone());
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }
}

async fn start_world(
    store: Box<dyn proctor::ProcedureStore>,
    world: Arc<World>,
) -> Executor<World> {
    let mut registry = Registry::new();
    registry
        .register::<OpenRegion>("open-region")
        .register::<CreateTable>("create-table");
    Executor::builder()
        .registry(registry)
        .store(store)
        .env(world)
        .start()
        .await
        .expect("starts")
}

/// Fast retries, for the tests.
fn retries(n: u32) -> RetryPolicy {
    RetryPolicy::new(n).backoff_ms(1).max_delay_ms(5)
}

#[actix::test]
async fn a_transient_io_error_returned_with_question_mark_rolls_back_at_once() {
    for name in common::STORES {
        // The region server refuses once, and would answer the next call: a plain `?`
        // does not say so, and the tree rolls back at once, the failed step first —
        // the step's retry policy is for retryable errors only.
        let world = World::refusing(1);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let id = executor
            .submit(OpenRegion::new(Mark::Plain).retrying(retries(3)))
            .await
            .unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error.to_string(), "connection refused", "{name}");
        assert_eq!(failure.error.kind(), None, "{name}");
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

#[actix::test]
async fn a_retryable_error_is_retried_until_its_step_succeeds() {
    for name in common::STORES {
        // Refused twice, three retries: the third attempt connects, and nothing is
        // rolled back.
        let world = World::refusing(2);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let id = executor
            .submit(OpenRegion::new(Mark::Retryable).retrying(retries(3)))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = ["exec 1", "exec 2", "exec 2", "exec 2", "exec 3"];
        assert_eq!(world.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();

        // Without a retry policy of its step, under the default one (5 retries, from
        // 200 ms): refused once, it connects on the retry.
        let world = World::refusing(1);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let id = executor
            .submit(OpenRegion::new(Mark::Retryable))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = ["exec 1", "exec 2", "exec 2", "exec 3"];
        assert_eq!(world.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_retryable_error_past_its_retries_rolls_back_as_a_terminal_one() {
    for name in common::STORES {
        // Refused for ever, two retries: three attempts, then the last is rolled back
        // (told it failed) with the step before it, once each.
        let world = World::refusing(u32::MAX);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let id = executor
            .submit(OpenRegion::new(Mark::Retryable).retrying(retries(2)))
            .await
            .unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        let expected = [
            "exec 1",
            "exec 2",
            "exec 2",
            "exec 2",
            "rollback 2 (failed)",
            "rollback 1 (completed)",
        ];
        assert_eq!(world.calls(), expected, "{name}");
        // The caller sees the error as the step returned it: retryable, an io error.
        assert_eq!(failure.error.kind(), Some(ErrorKind::Retryable), "{name}");
        assert!(
            matches!(failure.error.cause(), ProcError::Error { type_name, .. } if type_name.contains("io")),
            "{name}: {:?}",
            failure.error
        );
        assert_eq!(failure.error.to_string(), "connection refused", "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_terminal_error_is_not_retried_even_under_a_retrying_policy() {
    for name in common::STORES {
        let policy = FailurePolicy::RetryThenRollback {
            times: 3,
            backoff_ms: 1,
        };
        // Not marked, the procedure's policy retries it (as before): refused once, it
        // connects on the retry.
        let world = World::refusing(1);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let mut plain = OpenRegion::new(Mark::Plain);
        plain.policy = policy;
        let id = executor.submit(plain).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(
            world.calls(),
            ["exec 1", "exec 2", "exec 2", "exec 3"],
            "{name}"
        );
        executor.shutdown().await.unwrap();

        // Marked terminal: rolled back at once.
        let world = World::refusing(1);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let mut terminal = OpenRegion::new(Mark::Terminal);
        terminal.policy = policy;
        let id = executor.submit(terminal).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error.kind(), Some(ErrorKind::Terminal), "{name}");
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

#[actix::test]
async fn a_retryable_error_past_the_point_of_no_return_pauses_after_its_retries() {
    for name in common::STORES {
        // Step 1 is the point of no return: once step 2's retries are spent it pauses
        // (nothing rolls back), and an operator's continue runs it again.
        let world = World::refusing(u32::MAX);
        let executor = start_world(common::Reopen::new(name).open(), world.clone()).await;
        let mut open = OpenRegion::new(Mark::Retryable).retrying(retries(2));
        open.irreversible = true;
        let id = executor.submit(open).await.unwrap();
        common::wait_for_state(&executor, id, ProcState::Paused).await;
        let info = executor.state(id).await.unwrap();
        let paused = info.steering.paused.as_deref().expect("paused, saying why");
        assert_eq!(paused.retries, 2, "{name}");
        assert_eq!(
            paused.error.as_ref().and_then(ProcError::kind),
            Some(ErrorKind::Retryable),
            "{name}"
        );
        assert_eq!(
            world.calls(),
            ["exec 1", "exec 2", "exec 2", "exec 2"],
            "{name}"
        );

        world.refusals.store(0, Ordering::SeqCst);
        executor.resume(id).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = ["exec 1", "exec 2", "exec 2", "exec 2", "exec 2", "exec 3"];
        assert_eq!(world.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// What a service answers for a failure: its code, mapped to an HTTP status.
fn http_status(failure: &proctor::Failure) -> u16 {
    match failure.code() {
        Some("already_exists") => 409,
        Some(_) => 400,
        None => 500,
    }
}

#[actix::test]
async fn a_failure_with_a_code_reaches_the_waiter_who_matches_on_it() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let world = World::refusing(0);
        world.tables.lock().unwrap().push("t1".into());
        let executor = start_world(store.open(), world.clone()).await;
        let id = executor
            .submit(CreateTable { name: "t1".into() })
            .await
            .unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.code(), Some("already_exists"), "{name}");
        assert_eq!(http_status(&failure), 409, "{name}");
        assert_eq!(failure.error.to_string(), "table t1 exists", "{name}");
        // Through `wait_value` too.
        match executor.wait_value::<()>(id).await {
            Err(WaitError::Failed(failure)) => assert_eq!(http_status(&failure), 409, "{name}"),
            other => panic!("{name}: {other:?}"),
        }
        // A table that does not exist yet is created.
        let created = executor
            .submit(CreateTable { name: "t2".into() })
            .await
            .unwrap();
        assert_eq!(executor.wait(created).await.unwrap(), Ok(()), "{name}");
        executor.shutdown().await.unwrap();

        // The code is recorded with the failure: the next engine answers the same.
        let executor = start_world(store.open(), world.clone()).await;
        let again = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(again, failure, "{name}: the same after a restart");
        assert_eq!(http_status(&again), 409, "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// The executor's default retry policy (`ExecutorBuilder::retry_policy`) retries a
/// retryable error of a step that set none: refused 7 times, the step connects on its
/// 8th attempt under a default of 10 fast retries (the built-in default, 5 retries,
/// would have rolled it back). A step's own policy still comes first: with 3 retries
/// of its own, the same step rolls back.
#[actix::test]
async fn the_executors_retry_policy_is_the_default_for_steps_that_set_none() {
    for name in common::STORES {
        let start = |world: Arc<World>| {
            let mut registry = Registry::new();
            registry.register::<OpenRegion>("open-region");
            Executor::builder()
                .registry(registry)
                .store(common::Reopen::new(name).open())
                .env(world)
                .retry_policy(retries(10))
                .start()
        };
        let world = World::refusing(7);
        let executor = start(world.clone()).await.unwrap();
        let id = executor
            .submit(OpenRegion::new(Mark::Retryable))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let attempts = world.calls().iter().filter(|c| *c == "exec 2").count();
        assert_eq!(attempts, 8, "{name}: {:?}", world.calls());
        executor.shutdown().await.unwrap();

        let world = World::refusing(7);
        let executor = start(world.clone()).await.unwrap();
        let id = executor
            .submit(OpenRegion::new(Mark::Retryable).retrying(retries(3)))
            .await
            .unwrap();
        assert!(executor.wait(id).await.unwrap().is_err(), "{name}");
        let attempts = world.calls().iter().filter(|c| *c == "exec 2").count();
        assert_eq!(attempts, 4, "{name}: the step's own 3 retries");
        executor.shutdown().await.unwrap();
    }
}
