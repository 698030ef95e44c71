//! Rollback order across a tree and inside a state machine, asserted on the recorded
//! sequence of execute and rollback calls; and what each rollback is told its step did.

mod common;

use common::{run, start, stores, AddState, Adder, Scripted, Step};
use proctor::testing::restart_at_every_write;
use proctor::{
    async_trait, Context, Executor, ExecutorBuilder, Flow, Lock, ProcError, ProcState, Registry,
    StateContext, StateMachine, StateMachineProcedure, Undo,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

#[actix::test]
async fn failure_deep_in_a_chain_rolls_back_newest_first() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let child2 = Scripted::new("child2", vec![Step::Fail("child2 broke".into())]);
        let child1 = Scripted::new("child1", vec![Step::Children(vec![child2])]);
        let root = Scripted::new("root", vec![Step::Children(vec![child1])]);

        let (id, result) = run(&executor, root).await;

        assert_eq!(
            rec.calls(),
            [
                "root-exec",
                "child1-exec",
                "child2-exec",
                "child2-rollback",
                "child1-rollback",
                "root-rollback"
            ],
            "{store_name}"
        );
        let failure = result.expect_err("the tree failed");
        assert_eq!(failure.error, ProcError::failed("child2 broke"));
        assert_eq!(failure.type_name, "scripted");
        assert_ne!(failure.proc, id, "the failure names child2, not the root");
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, ProcState::RolledBack);
        assert_eq!(info.result, Some(Err(failure)));
    }
}

#[actix::test]
async fn a_child_that_succeeded_is_not_rolled_back() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let child = Scripted::new("child", vec![Step::More]);
        let root = Scripted::new(
            "root",
            vec![
                Step::Children(vec![child]),
                Step::Fail("parent broke".into()),
            ],
        );

        let (id, result) = run(&executor, root).await;

        assert_eq!(
            rec.calls(),
            [
                "root-exec",
                "child-exec",
                "root-exec",
                // One rollback per executed root step, the failed one first.
                "root-rollback",
                "root-rollback"
            ],
            "{store_name}"
        );
        let failure = result.unwrap_err();
        assert_eq!(failure.proc, id);
        assert_eq!(failure.error, ProcError::failed("parent broke"));
    }
}

#[actix::test]
async fn state_machine_adds_up_to_26() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let (_, result) = run(&executor, StateMachine::new(Adder { fail_in: None })).await;
        assert_eq!(result, Ok(()), "{store_name}");
        assert_eq!(rec.counter.load(Ordering::SeqCst), 26);
        assert_eq!(
            rec.calls(),
            ["exec One", "exec Two", "exec Three", "exec Four"]
        );
    }
}

#[actix::test]
async fn state_machine_failing_in_state_3_rolls_back_3_2_1() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let proc = StateMachine::new(Adder {
            fail_in: Some(AddState::Three),
        });
        let (id, result) = run(&executor, proc).await;
        let failure = result.unwrap_err();
        assert_eq!(failure.proc, id);
        assert_eq!(failure.error, ProcError::failed("Three failed"));
        assert_eq!(
            rec.calls(),
            [
                "exec One",
                "exec Two",
                "exec Three",
                "rollback Three",
                "rollback Two",
                "rollback One"
            ],
            "{store_name}"
        );
        assert_eq!(rec.counter.load(Ordering::SeqCst), 0);
    }
}

#[actix::test]
async fn each_rollback_is_told_whether_its_step_completed_or_failed() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let child = Scripted::new("child", vec![Step::More, Step::Fail("child broke".into())]);
        let panics = Scripted::new("panics", vec![Step::Panic("boom".into())]);
        let root = Scripted::new("root", vec![Step::More, Step::Children(vec![child])]);
        let (_, result) = run(&executor, root).await;
        assert_eq!(result.unwrap_err().error, ProcError::failed("child broke"));
        let (_, result) = run(&executor, panics).await;
        assert!(result.is_err(), "{store_name}");

        let undos = rec.undos();
        let told: Vec<(&str, Undo)> = undos
            .iter()
            .map(|(name, undo)| (name.as_str(), *undo))
            .collect();
        assert_eq!(
            told,
            [
                // The failed step first, told so; then the steps that completed.
                ("child", Undo::Failed),
                ("child", Undo::Completed),
                ("root", Undo::Completed),
                ("root", Undo::Completed),
                // A panic in a step is a failure of that step.
                ("panics", Undo::Failed),
            ],
            "{store_name}"
        );
    }
}

/// The catalog a create-table service keeps: its tables.
#[derive(Default)]
struct Catalog {
    tables: Mutex<BTreeSet<String>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Create {
    Prepare,
    Table,
    Regions,
}

/// Creates a table the safe way: a state that only checks (failing if the table
/// exists), one that creates it (failing, with nothing changed, if it exists after
/// all), then its regions (failing when told to); the table's lock held throughout.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    name: String,
    regions_fail: bool,
}

#[async_trait]
impl StateMachineProcedure<Catalog> for CreateTable {
    type State = Create;

    fn initial_state(&self) -> Create {
        Create::Prepare
    }

    fn locks(&self) -> Vec<Lock> {
        vec![Lock::exclusive(format!("table/{}", self.name))]
    }

    fn holds_lock(&self) -> bool {
        true
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, Create, Catalog>,
        state: Create,
    ) -> Result<Flow<Catalog>, ProcError> {
        match state {
            Create::Prepare => {
                if ctx.env().tables.lock().unwrap().contains(&self.name) {
                    return Err(ProcError::failed(format!("table {} exists", self.name)));
                }
                ctx.set_next_state(Create::Table);
                Ok(Flow::MoreToDo)
            }
            Create::Table => {
                if !ctx.env().tables.lock().unwrap().insert(self.name.clone()) {
                    return Err(ProcError::failed(format!("table {} exists", self.name)));
                }
                ctx.set_next_state(Create::Regions);
                Ok(Flow::MoreToDo)
            }
            Create::Regions if self.regions_fail => Err(ProcError::failed("no region server")),
            Create::Regions => Ok(Flow::Done),
        }
    }

    async fn rollback_state(
        &mut self,
        ctx: &mut Context<Catalog>,
        state: Create,
    ) -> Result<(), ProcError> {
        if state == Create::Table && ctx.undoing() != Undo::Failed {
            ctx.env().tables.lock().unwrap().remove(&self.name);
        }
        Ok(())
    }
}

#[actix::test]
async fn a_create_of_an_existing_table_rolls_back_without_dropping_it() {
    for (store_name, store, _dir) in stores() {
        let catalog = Arc::new(Catalog::default());
        let executor = catalog_engine(&catalog)
            .store(store)
            .start()
            .await
            .expect("starts");
        let id = executor.submit(create("users", false)).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");

        // The same table again: the create fails in its first state, which is rolled
        // back (as the failed state, which changed nothing), and the table stays.
        let id = executor.submit(create("users", false)).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::failed("table users exists"));
        assert!(
            catalog.tables.lock().unwrap().contains("users"),
            "{store_name}"
        );

        // A create that fails later drops the table it created.
        let id = executor.submit(create("orders", true)).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::failed("no region server"));
        let tables: Vec<String> = catalog.tables.lock().unwrap().iter().cloned().collect();
        assert_eq!(tables, ["users"], "{store_name}");
        executor.shutdown().await.unwrap();
    }
}

fn create(name: &str, regions_fail: bool) -> StateMachine<CreateTable, Catalog> {
    StateMachine::new(CreateTable {
        name: name.into(),
        regions_fail,
    })
}

fn catalog_engine(catalog: &Arc<Catalog>) -> ExecutorBuilder<Catalog> {
    let mut registry = Registry::new();
    registry.register_state_machine::<CreateTable>("create_table");
    Executor::builder().registry(registry).env(catalog.clone())
}

#[actix::test]
async fn a_crash_at_any_write_of_a_failing_create_never_drops_a_table_it_did_not_create() {
    // A create of a table that exists, and one that fails after creating its table:
    // whatever write the crash hits, the first leaves the table and the second
    // leaves nothing.
    for (name, regions_fail, error) in [
        ("users", false, "table users exists"),
        ("orders", true, "no region server"),
    ] {
        let catalog = Arc::new(Catalog::default());
        let runs = restart_at_every_write(
            || {
                let mut tables = catalog.tables.lock().unwrap();
                *tables = BTreeSet::from(["users".to_string()]);
                drop(tables);
                catalog_engine(&catalog)
            },
            || create(name, regions_fail),
            |run| {
                if let Some(result) = &run.result {
                    assert_eq!(result.as_ref().unwrap_err().error, ProcError::failed(error));
                }
                let tables: Vec<String> = catalog.tables.lock().unwrap().iter().cloned().collect();
                assert_eq!(tables, ["users"], "{name}: {run:?}");
            },
        )
        .await
        .expect("runs");
        assert!(runs.len() >= 6, "{name}: {} runs", runs.len());
    }
}

/// What an operator sees of a tree while it rolls back (`Executor::tree`): the steps
/// left on its execution stack, and the steps undone so far in the order their
/// rollbacks ran, as the recorder saw them; once finished, the tree has no stack.
#[actix::test]
async fn the_tree_view_shows_the_stack_left_and_the_rollback_so_far() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let root = executor.submit(common::Unwind::root()).await.unwrap();
        // The root's second rollback call holds.
        rec.signal.notified().await;
        let tree = executor.tree(root).await.unwrap();
        let executed = common::recorded(&rec, "exec ");
        let undone = common::recorded(&rec, "rollback ");
        let child = proctor::ProcId(executed[2]);
        assert_eq!(executed, [root.0, root.0, child.0, child.0], "{store_name}");
        assert_eq!(tree.root, root, "{store_name}");
        assert!(tree.rolling_back, "{store_name}");
        assert_eq!(tree.stack, [root], "{store_name}: what is left to undo");
        assert_eq!(
            tree.rolled_back,
            [child, child, root],
            "{store_name}: newest step first"
        );
        assert_eq!(
            undone,
            [child.0, child.0, root.0, root.0],
            "{store_name}: the held call is the next"
        );
        // A child rolled back to its end has left the table.
        assert!(
            matches!(executor.tree(child).await, Err(proctor::Error::Gone(_))),
            "{store_name}"
        );

        rec.gate.notify_one();
        assert!(executor.wait(root).await.unwrap().is_err(), "{store_name}");
        assert!(
            matches!(
                executor.tree(root).await,
                Err(proctor::Error::Finished { .. })
            ),
            "{store_name}"
        );
        executor.shutdown().await.unwrap();
    }
}
