//! Code that changes while procedures are in flight, and logs written by an earlier
//! release.
//!
//! `tests/fixtures/wal-0.1.0/` is a WAL written by proctor 0.1.0 with the `v1` types
//! below: three trees waiting on the event `go` when the engine was stopped (a state
//! machine, a saga waiting for its child, a plain procedure). Today's engine resumes it
//! with the `v2` types — the same registered names; a state struct that gained a field
//! (`#[serde(default)]`), a state machine whose state that was next gained a state
//! after it, a saga that gained a step after the ones it journaled — and every tree
//! finishes, running the new code from where the old one stopped.
//!
//! The fixture is made once per release whose format it pins, by
//! `cargo test --test evolution -- --ignored write_the_fixture` with that release's
//! code; a later release adds a fixture of its own beside it rather than rewriting
//! this one.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use proctor::{Executor, ProcState, Registry, WalStore};

/// What the procedures did, in order.
#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn say(&self, line: impl Into<String>) {
        self.0.lock().unwrap().push(line.into());
    }

    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

type Env = Arc<Log>;

/// The code as it was when the log was written.
mod v1 {
    use super::Env;
    use proctor::{
        async_trait, Context, Flow, ProcError, Procedure, SagaContext, SagaProcedure, StateContext,
        StateMachineProcedure, Undoing,
    };
    use serde::{Deserialize, Serialize};

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub enum GrowState {
        Prepare,
        Wait,
        Finish,
    }

    /// A state machine: prepares, waits for `go`, finishes.
    #[derive(Serialize, Deserialize)]
    pub struct Grow {
        pub table: String,
    }

    #[async_trait]
    impl StateMachineProcedure<Env> for Grow {
        type State = GrowState;

        fn initial_state(&self) -> GrowState {
            GrowState::Prepare
        }

        async fn execute_from_state(
            &mut self,
            ctx: &mut StateContext<'_, GrowState, Env>,
            state: GrowState,
        ) -> Result<Flow<Env>, ProcError> {
            ctx.env().say(format!("v1 grow {} {state:?}", self.table));
            match state {
                GrowState::Prepare => {
                    ctx.set_next_state(GrowState::Wait);
                    Ok(Flow::MoreToDo)
                }
                GrowState::Wait => {
                    ctx.set_next_state(GrowState::Finish);
                    Ok(Flow::Suspend("go".into()))
                }
                GrowState::Finish => Ok(Flow::Done),
            }
        }

        async fn rollback_state(
            &mut self,
            _: &mut Context<Env>,
            _: GrowState,
        ) -> Result<(), ProcError> {
            Ok(())
        }
    }

    /// A child that waits for `go`, then sets its value.
    #[derive(Serialize, Deserialize)]
    pub struct Waiter {
        pub woken: bool,
    }

    #[async_trait]
    impl Procedure<Env> for Waiter {
        async fn execute(&mut self, ctx: &mut Context<Env>) -> Result<Flow<Env>, ProcError> {
            if !self.woken {
                self.woken = true;
                ctx.env().say("v1 waiter waits");
                return Ok(Flow::Suspend("go".into()));
            }
            ctx.env().say("waiter woken");
            ctx.set_result(&5u32)?;
            Ok(Flow::Done)
        }

        async fn rollback(&mut self, _: &mut Context<Env>) -> Result<(), ProcError> {
            Ok(())
        }
    }

    /// A saga: reserves, then waits for its child.
    #[derive(Serialize, Deserialize)]
    pub struct Provision {
        pub node: String,
    }

    #[async_trait]
    impl SagaProcedure<Env> for Provision {
        type Output = u32;

        async fn run(&self, ctx: &mut SagaContext<'_, Env>) -> Result<u32, ProcError> {
            let env = ctx.env();
            let slot: u32 = ctx
                .step(
                    "reserve",
                    || async {
                        env.say("v1 reserve");
                        Ok(7u32)
                    },
                    |_: Undoing<u32>| async { Ok(()) },
                )
                .await?;
            let woken: Vec<u32> = ctx
                .children(
                    "wait",
                    || vec![Waiter { woken: false }],
                    |_: Undoing<Vec<u32>>| async { Ok(()) },
                )
                .await?;
            Ok(slot + woken.iter().sum::<u32>())
        }
    }

    /// A plain procedure that counts its steps and waits for `go` after the first.
    #[derive(Serialize, Deserialize)]
    pub struct Count {
        pub steps: u32,
    }

    #[async_trait]
    impl Procedure<Env> for Count {
        async fn execute(&mut self, ctx: &mut Context<Env>) -> Result<Flow<Env>, ProcError> {
            self.steps += 1;
            ctx.env().say(format!("v1 count {}", self.steps));
            Ok(Flow::Suspend("go".into()))
        }

        async fn rollback(&mut self, _: &mut Context<Env>) -> Result<(), ProcError> {
            Ok(())
        }
    }
}

/// The code of the next deploy: the same names, each type changed as a service's code
/// changes between releases.
mod v2 {
    use super::Env;
    use proctor::{
        async_trait, Context, Flow, ProcError, Procedure, SagaContext, SagaProcedure, StateContext,
        StateMachineProcedure, Undoing,
    };
    use serde::{Deserialize, Serialize};

    /// A state added after `Finish`: states are recorded by name, so the old ones
    /// still decode.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    pub enum GrowState {
        Prepare,
        Wait,
        Finish,
        Announce,
    }

    #[derive(Serialize, Deserialize)]
    pub struct Grow {
        pub table: String,
        /// New: a record written without it decodes with the default.
        #[serde(default)]
        pub replicas: u32,
    }

    #[async_trait]
    impl StateMachineProcedure<Env> for Grow {
        type State = GrowState;

        fn initial_state(&self) -> GrowState {
            GrowState::Prepare
        }

        async fn execute_from_state(
            &mut self,
            ctx: &mut StateContext<'_, GrowState, Env>,
            state: GrowState,
        ) -> Result<Flow<Env>, ProcError> {
            ctx.env().say(format!(
                "v2 grow {} {state:?} replicas {}",
                self.table, self.replicas
            ));
            match state {
                GrowState::Prepare => {
                    ctx.set_next_state(GrowState::Wait);
                    Ok(Flow::MoreToDo)
                }
                GrowState::Wait => {
                    ctx.set_next_state(GrowState::Finish);
                    Ok(Flow::Suspend("go".into()))
                }
                GrowState::Finish => {
                    ctx.set_next_state(GrowState::Announce);
                    Ok(Flow::MoreToDo)
                }
                GrowState::Announce => {
                    ctx.set_result(&self.table)?;
                    Ok(Flow::Done)
                }
            }
        }

        async fn rollback_state(
            &mut self,
            _: &mut Context<Env>,
            _: GrowState,
        ) -> Result<(), ProcError> {
            Ok(())
        }
    }

    pub use super::v1::Waiter;

    #[derive(Serialize, Deserialize)]
    pub struct Provision {
        pub node: String,
    }

    #[async_trait]
    impl SagaProcedure<Env> for Provision {
        type Output = u32;

        async fn run(&self, ctx: &mut SagaContext<'_, Env>) -> Result<u32, ProcError> {
            let env = ctx.env();
            let slot: u32 = ctx
                .step(
                    "reserve",
                    || async {
                        env.say("v2 reserve");
                        Ok(7u32)
                    },
                    |_: Undoing<u32>| async { Ok(()) },
                )
                .await?;
            let woken: Vec<u32> = ctx
                .children(
                    "wait",
                    || vec![Waiter { woken: false }],
                    |_: Undoing<Vec<u32>>| async { Ok(()) },
                )
                .await?;
            // New: a step after the ones the old code journaled.
            ctx.step(
                "announce",
                || async {
                    env.say(format!("v2 announce {}", self.node));
                    Ok(())
                },
                |_: Undoing<()>| async { Ok(()) },
            )
            .await?;
            Ok(100 + slot + woken.iter().sum::<u32>())
        }
    }

    #[derive(Serialize, Deserialize)]
    pub struct Count {
        pub steps: u32,
        /// New, with a default other than the type's.
        #[serde(default = "Count::default_limit")]
        pub limit: u32,
    }

    impl Count {
        fn default_limit() -> u32 {
            2
        }
    }

    #[async_trait]
    impl Procedure<Env> for Count {
        async fn execute(&mut self, ctx: &mut Context<Env>) -> Result<Flow<Env>, ProcError> {
            self.steps += 1;
            ctx.env()
                .say(format!("v2 count {} of {}", self.steps, self.limit));
            if self.steps < self.limit {
                return Ok(Flow::MoreToDo);
            }
            ctx.set_result(&self.steps)?;
            Ok(Flow::Done)
        }

        async fn rollback(&mut self, _: &mut Context<Env>) -> Result<(), ProcError> {
            Ok(())
        }
    }
}

fn fixture(version: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("wal-{version}"))
}

fn copy_dir(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&target).unwrap();
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// Writes `tests/fixtures/wal-<this version>/` with the `v1` code. Run by hand, once per
/// release whose format a fixture pins.
#[actix::test]
#[ignore = "writes the fixture of this release: run by hand"]
async fn write_the_fixture() {
    let dir = fixture(env!("CARGO_PKG_VERSION"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut registry = Registry::new();
    registry
        .register_state_machine::<v1::Grow>("grow")
        .register_saga::<v1::Provision>("provision")
        .register::<v1::Waiter>("waiter")
        .register::<v1::Count>("count");
    let log = Env::default();
    let executor = Executor::builder()
        .registry(registry)
        .store(WalStore::open(&dir).unwrap())
        .env(log.clone())
        .start()
        .await
        .unwrap();
    let grow = executor
        .submit(proctor::StateMachine::new(v1::Grow {
            table: "users".into(),
        }))
        .await
        .unwrap();
    let provision = executor
        .submit(proctor::Saga::new(v1::Provision { node: "n1".into() }))
        .await
        .unwrap();
    let count = executor.submit(v1::Count { steps: 0 }).await.unwrap();
    for id in [grow, provision, count] {
        wait_for(&executor, id, ProcState::Waiting).await;
    }
    executor.shutdown().await.unwrap();
    // The engine's lock file is not part of the log.
    let _ = std::fs::remove_file(dir.join("LOCK"));
    println!("wrote {} ({:?})", dir.display(), log.lines());
}

/// The log proctor 0.1.0 wrote, resumed by today's engine with changed code: every
/// tree finishes, each from where it stopped, through the new code.
#[actix::test]
async fn a_log_written_by_0_1_0_is_resumed_by_changed_code() {
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("0.1.0"), dir.path());
    let mut registry = Registry::new();
    registry
        .register_state_machine::<v2::Grow>("grow")
        .register_saga::<v2::Provision>("provision")
        .register::<v2::Waiter>("waiter")
        .register::<v2::Count>("count");
    let log = Env::default();
    let executor = Executor::builder()
        .registry(registry)
        .store(WalStore::open(dir.path()).unwrap())
        .env(log.clone())
        .start()
        .await
        .unwrap();
    let recovery = executor.recovery();
    assert!(recovery.corrupt.is_empty(), "{:?}", recovery.corrupt);
    assert_eq!(recovery.recovered_roots.len(), 3);
    let waiting = executor
        .list(proctor::List::new().state(ProcState::Waiting))
        .await
        .unwrap();
    let types: Vec<&str> = waiting.iter().map(|p| p.type_name).collect();
    assert_eq!(
        types,
        ["grow", "provision", "count", "waiter"],
        "{waiting:?}"
    );
    let ids: Vec<_> = waiting
        .iter()
        .filter(|p| p.parent.is_none())
        .map(|p| p.id)
        .collect();
    executor.wake_event("go").await.unwrap();

    let table: String = executor.wait_value(ids[0]).await.unwrap();
    assert_eq!(table, "users");
    let provisioned: u32 = executor.wait_value(ids[1]).await.unwrap();
    assert_eq!(provisioned, 100 + 7 + 5);
    let counted: u32 = executor.wait_value(ids[2]).await.unwrap();
    assert_eq!(counted, 2);
    executor.shutdown().await.unwrap();

    let mut lines = log.lines();
    lines.sort();
    assert_eq!(
        lines,
        [
            "v2 announce n1",
            "v2 count 2 of 2",
            "v2 grow users Announce replicas 0",
            "v2 grow users Finish replicas 0",
            "waiter woken",
        ],
        "only the new code ran, each from where the old one stopped (a saga replays its journaled steps without running them)"
    );
}

/// A field added without a default: the old records of that type do not decode. The
/// engine starts, names each such procedure with the reason in `Recovery::corrupt`,
/// runs the rest, and leaves the record in the log for the next deploy (a fixed type
/// recovers it).
#[actix::test]
async fn a_field_added_without_a_default_leaves_its_records_for_an_operator() {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct StrictCount {
        steps: u32,
        limit: u32,
    }
    #[proctor::async_trait]
    impl proctor::Procedure<Env> for StrictCount {
        async fn execute(
            &mut self,
            _: &mut proctor::Context<Env>,
        ) -> Result<proctor::Flow<Env>, proctor::ProcError> {
            Ok(proctor::Flow::Done)
        }
        async fn rollback(
            &mut self,
            _: &mut proctor::Context<Env>,
        ) -> Result<(), proctor::ProcError> {
            Ok(())
        }
    }
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("0.1.0"), dir.path());
    let start = |count_type: bool| {
        let mut registry = Registry::new();
        registry
            .register_state_machine::<v2::Grow>("grow")
            .register_saga::<v2::Provision>("provision")
            .register::<v2::Waiter>("waiter");
        if count_type {
            registry.register::<StrictCount>("count");
        } else {
            registry.register::<v2::Count>("count");
        }
        Executor::builder()
            .registry(registry)
            .store(WalStore::open(dir.path()).unwrap())
            .env(Env::default())
            .start()
    };
    let executor = start(true).await.unwrap();
    let corrupt = &executor.recovery().corrupt;
    assert_eq!(corrupt.len(), 1, "{corrupt:?}");
    let why = format!("{:?}", corrupt[0]);
    assert!(why.contains("count") && why.contains("limit"), "{why}");
    assert_eq!(executor.recovery().recovered_roots.len(), 2);
    executor.shutdown().await.unwrap();

    // The next deploy has the field's default: the procedure is back, and finishes.
    let executor = start(false).await.unwrap();
    assert!(executor.recovery().corrupt.is_empty());
    assert_eq!(executor.recovery().recovered_roots.len(), 3);
    executor.wake_event("go").await.unwrap();
    let counted: u32 = executor.wait_value(proctor::ProcId(3)).await.unwrap();
    assert_eq!(counted, 2);
    executor.shutdown().await.unwrap();
}

/// A step inserted between two steps that sagas in flight have journaled: without a
/// marker the saga in the log fails (its journal has another name there); behind
/// `SagaContext::version` it keeps its old sequence, and a saga submitted after the
/// deploy takes the new one.
#[actix::test]
async fn a_step_inserted_behind_a_version_marker_leaves_sagas_in_flight_on_their_way() {
    /// The saga with "audit" inserted after "reserve", behind the marker if `marked`.
    async fn provision(
        ctx: &mut proctor::SagaContext<'_, Env>,
        node: &str,
        marked: bool,
    ) -> Result<u32, proctor::ProcError> {
        let slot: u32 = ctx
            .step(
                "reserve",
                || async { Ok(7u32) },
                |_: proctor::Undoing<u32>| async { Ok(()) },
            )
            .await?;
        if !marked || ctx.version("audit", 1, 2).await? >= 2 {
            let env = ctx.env();
            ctx.step(
                "audit",
                || async {
                    env.say(format!("audit {node}"));
                    Ok(())
                },
                |_: proctor::Undoing<()>| async { Ok(()) },
            )
            .await?;
        }
        let woken: Vec<u32> = ctx
            .children(
                "wait",
                || vec![v2::Waiter { woken: false }],
                |_: proctor::Undoing<Vec<u32>>| async { Ok(()) },
            )
            .await?;
        Ok(slot + woken.iter().sum::<u32>())
    }
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Inserted {
        node: String,
    }
    #[proctor::async_trait]
    impl proctor::SagaProcedure<Env> for Inserted {
        type Output = u32;
        async fn run(
            &self,
            ctx: &mut proctor::SagaContext<'_, Env>,
        ) -> Result<u32, proctor::ProcError> {
            provision(ctx, &self.node, false).await
        }
    }
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Marked {
        node: String,
    }
    #[proctor::async_trait]
    impl proctor::SagaProcedure<Env> for Marked {
        type Output = u32;
        async fn run(
            &self,
            ctx: &mut proctor::SagaContext<'_, Env>,
        ) -> Result<u32, proctor::ProcError> {
            provision(ctx, &self.node, true).await
        }
    }
    async fn start(dir: &Path, marked: bool) -> (Executor<Env>, Env) {
        let mut registry = Registry::new();
        registry
            .register_state_machine::<v2::Grow>("grow")
            .register::<v2::Waiter>("waiter")
            .register::<v2::Count>("count");
        if marked {
            registry.register_saga::<Marked>("provision");
        } else {
            registry.register_saga::<Inserted>("provision");
        }
        let log = Env::default();
        let executor = Executor::builder()
            .registry(registry)
            .store(WalStore::open(dir).unwrap())
            .env(log.clone())
            .start()
            .await
            .unwrap();
        (executor, log)
    }
    // The fixture's saga is procedure 2, journaled "reserve" then "wait".
    let in_flight = proctor::ProcId(2);

    // Without the marker it fails: the journal has "wait" where the code asks "audit".
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("0.1.0"), dir.path());
    let (executor, _) = start(dir.path(), false).await;
    executor.wake_event("go").await.unwrap();
    let failure = executor
        .wait(in_flight)
        .await
        .unwrap()
        .expect_err("changed under it");
    assert!(failure.to_string().contains("\"audit\""), "{failure}");
    executor.shutdown().await.unwrap();

    // Behind the marker the saga in flight keeps its way, and a new one takes the new.
    let dir = tempfile::tempdir().unwrap();
    copy_dir(&fixture("0.1.0"), dir.path());
    let (executor, log) = start(dir.path(), true).await;
    let fresh = executor
        .submit(proctor::Saga::new(Marked { node: "n2".into() }))
        .await
        .unwrap();
    let waiting = |id| wait_for(&executor, id, ProcState::Waiting);
    waiting(fresh).await;
    executor.wake_event("go").await.unwrap();
    assert_eq!(executor.wait_value::<u32>(in_flight).await.unwrap(), 7 + 5);
    assert_eq!(executor.wait_value::<u32>(fresh).await.unwrap(), 7 + 5);
    executor.shutdown().await.unwrap();
    // Only the new saga ran the inserted step.
    let audits: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("audit"))
        .collect();
    assert_eq!(audits, ["audit n2"]);
}

async fn wait_for(executor: &Executor<Env>, id: proctor::ProcId, state: ProcState) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while executor.state(id).await.map(|i| i.state).ok() != Some(state) {
        assert!(
            std::time::Instant::now() < deadline,
            "procedure {id} never reached {state}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}
