//! A procedure's declared output reaches its caller typed, on every store: a saga's
//! output, a state machine's declared result, a plain procedure's value, an output of
//! `()` or `Option` left unset; a tree that rolls back gives its failure; a value that
//! does not decode as the declared output (or is missing) is an error naming the type;
//! a typed submit with a nonce retried after a restart waits for the same output.

mod common;

use proctor::{
    async_trait, Context, Dag, DagBuilder, DagTask, Error, Executor, Flow, Nonce, ProcError,
    Procedure, ProcedureStore, ProducesOutput, Registry, Saga, SagaContext, SagaProcedure,
    StateContext, StateMachine, StateMachineProcedure, Submitted, Task, Undoing,
};
use serde::{Deserialize, Serialize};

/// A saga whose output is the regions it created.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    name: String,
    regions: u32,
    fail: bool,
}

#[async_trait]
impl SagaProcedure for CreateTable {
    type Output = Vec<String>;

    async fn run(&self, ctx: &mut SagaContext<'_>) -> Result<Vec<String>, ProcError> {
        let created = ctx
            .step(
                "regions",
                || async {
                    let name = &self.name;
                    Ok((0..self.regions).map(|r| format!("{name}-r{r}")).collect())
                },
                |_: Undoing<Vec<String>>| async { Ok(()) },
            )
            .await?;
        if self.fail {
            return Err(ProcError::failed("no server takes the regions"));
        }
        Ok(created)
    }
}

fn create(name: &str, regions: u32) -> Saga<CreateTable> {
    Saga::new(CreateTable {
        name: name.into(),
        regions,
        fail: false,
    })
}

/// A state machine whose declared result is the sum of what its states added.
#[derive(Serialize, Deserialize)]
struct Sum {
    total: u64,
}

#[async_trait]
impl StateMachineProcedure for Sum {
    type State = u8;

    fn initial_state(&self) -> u8 {
        1
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, u8>,
        state: u8,
    ) -> Result<Flow, ProcError> {
        self.total += u64::from(state);
        if state == 3 {
            ctx.set_result(&self.total)?;
            return Ok(Flow::Done);
        }
        ctx.set_next_state(state + 1);
        Ok(Flow::MoreToDo)
    }

    async fn rollback_state(&mut self, _: &mut Context, _: u8) -> Result<(), ProcError> {
        Ok(())
    }
}

impl ProducesOutput for Sum {
    type Output = u64;
}

/// A plain procedure: sets `value` (MessagePack of whatever it holds) unless `None`.
#[derive(Serialize, Deserialize)]
struct Sets<T> {
    value: Option<T>,
}

#[async_trait]
impl<T: Serialize + for<'de> Deserialize<'de> + Send + Sync + 'static> Procedure for Sets<T> {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        if let Some(value) = &self.value {
            ctx.set_result(value)?;
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

/// A greeting, declared as a `String`.
type Greets = Sets<String>;
impl ProducesOutput for Greets {
    type Output = String;
}

/// Sets nothing, and says so: its output is `()`.
type Quiet = Sets<()>;
impl ProducesOutput for Quiet {
    type Output = ();
}

/// May set a number: its output is an `Option`.
type Maybe = Sets<u32>;
impl ProducesOutput for Maybe {
    type Output = Option<u32>;
}

/// Sets a number but declares a `String`: a procedure at odds with its declaration.
type Liar = Sets<u64>;
impl ProducesOutput for Liar {
    type Output = String;
}

/// Sets nothing but declares a `u32`.
type Forgets = Sets<bool>;
impl ProducesOutput for Forgets {
    type Output = u32;
}

/// A DAG's task that does nothing.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Noop;

#[async_trait]
impl Task for Noop {
    async fn execute(&self, _: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
    async fn rollback(&self, _: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

async fn start(store: Box<dyn ProcedureStore>) -> Executor {
    let mut registry = Registry::new();
    registry
        .register_saga::<CreateTable>("create_table")
        .register_state_machine::<Sum>("sum")
        .register::<Greets>("greets")
        .register::<Quiet>("quiet")
        .register::<Maybe>("maybe")
        .register::<Liar>("liar")
        .register::<Forgets>("forgets")
        .register::<Dag<Noop>>("dag")
        .register::<DagTask<Noop>>("dag_task");
    Executor::builder()
        .registry(registry)
        .store(store)
        .start()
        .await
        .expect("executor starts")
}

#[actix::test]
async fn a_typed_submit_waits_for_the_declared_output() {
    for (name, store, _dir) in common::stores() {
        let executor = start(store).await;

        // A saga's output: the regions, typed as the saga declares them.
        let created = executor.submit(create("users", 2)).typed().await.unwrap();
        let regions: Vec<String> = created.wait().await.unwrap().unwrap();
        assert_eq!(regions, ["users-r0", "users-r1"], "{name}");
        assert_eq!(
            executor.state(created.id()).await.unwrap().state,
            proctor::ProcState::Success,
            "{name}"
        );

        // A state machine's declared result; a plain procedure's value.
        let sum = executor
            .submit(StateMachine::new(Sum { total: 0 }))
            .typed()
            .await
            .unwrap();
        let greets = executor
            .submit(Greets {
                value: Some("hello".into()),
            })
            .typed()
            .await
            .unwrap();
        assert_eq!(sum.wait().await.unwrap(), Ok(6u64), "{name}");
        assert_eq!(greets.wait().await.unwrap().unwrap(), "hello", "{name}");

        // Outputs left unset: `()`, `None`; and a DAG's, which sets none.
        let quiet = executor
            .submit(Quiet { value: None })
            .typed()
            .await
            .unwrap();
        assert_eq!(quiet.wait().await.unwrap(), Ok(()), "{name}");
        let none = executor
            .submit(Maybe { value: None })
            .typed()
            .await
            .unwrap();
        let some = executor
            .submit(Maybe { value: Some(7) })
            .typed()
            .await
            .unwrap();
        assert_eq!(none.wait().await.unwrap(), Ok(None), "{name}");
        assert_eq!(some.wait().await.unwrap(), Ok(Some(7)), "{name}");
        let mut dag = DagBuilder::new();
        let (a, b) = (dag.add(Noop), dag.add(Noop));
        dag.edge(a, b);
        let dag = executor.submit(dag.build().unwrap()).typed().await.unwrap();
        assert_eq!(dag.wait().await.unwrap(), Ok(()), "{name}");

        // A tree that rolls back: its failure, as `wait` gives it.
        let failing = Saga::new(CreateTable {
            name: "orders".into(),
            regions: 1,
            fail: true,
        });
        let failed = executor.submit(failing).typed().await.unwrap();
        let failure = failed.wait().await.unwrap().unwrap_err();
        assert_eq!(failure.proc, failed.id(), "{name}");
        assert_eq!(
            failure.error,
            ProcError::failed("no server takes the regions"),
            "{name}"
        );
        // The handle clones, and waits again after the result is in.
        let again: Submitted<Vec<String>> = created.clone();
        assert_eq!(again.wait().await.unwrap().unwrap().len(), 2, "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// A value that does not decode as the declared output, or a missing one the output
/// cannot be, is `Error::ValueType` naming the declared type; the procedure itself
/// succeeded.
#[actix::test]
async fn a_value_at_odds_with_the_declared_output_is_an_error_naming_the_type() {
    for (name, store, _dir) in common::stores() {
        let executor = start(store).await;
        let liar = executor
            .submit(Liar { value: Some(3) })
            .typed()
            .await
            .unwrap();
        match liar.wait().await {
            Err(Error::ValueType { id, reason }) => {
                assert_eq!(id, liar.id(), "{name}");
                assert!(reason.contains("String"), "{name}: {reason}");
            }
            other => panic!("{name}: a value type error, not {other:?}"),
        }
        let forgets = executor
            .submit(Forgets { value: None })
            .typed()
            .await
            .unwrap();
        let message = forgets.wait().await.unwrap_err().to_string();
        assert!(
            message.contains(&format!("procedure {}", forgets.id()))
                && message.contains("set none")
                && message.contains("u32"),
            "{name}: {message}"
        );
        // Untyped, the same values read as they are.
        assert_eq!(executor.wait_value::<u64>(liar.id()).await.unwrap(), 3);
        assert_eq!(executor.wait(forgets.id()).await.unwrap(), Ok(()));
        executor.shutdown().await.unwrap();
    }
}

/// A typed submit with a nonce, retried after a restart (the same saga, the same
/// arguments), is the same root, and waits for the same output.
#[actix::test]
async fn a_typed_retry_after_a_restart_waits_for_the_same_output() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let nonce = Nonce::from_key("create users");
        let executor = start(store.open()).await;
        let first = executor
            .submit(create("users", 3))
            .nonce(nonce)
            .typed()
            .await
            .unwrap();
        let regions = first.wait().await.unwrap().unwrap();
        assert_eq!(regions.len(), 3, "{name}");
        executor.shutdown().await.unwrap();

        let executor = start(store.open()).await;
        let retry = executor
            .submit(create("users", 3))
            .nonce(nonce)
            .typed()
            .await
            .unwrap();
        assert_eq!(retry.id(), first.id(), "{name}");
        assert_eq!(retry.wait().await.unwrap(), Ok(regions), "{name}");
        // Another table under the same nonce is refused, typed or not.
        let other = executor
            .submit(create("orders", 3))
            .nonce(nonce)
            .typed()
            .await;
        assert!(
            matches!(other, Err(Error::NonceConflict { existing, .. }) if existing == first.id()),
            "{name}: {other:?}"
        );
        executor.shutdown().await.unwrap();
    }
}
