//! Result values and their retention, through the executor on both stores: the last
//! value a root's steps set reaches the caller, from its last step or an earlier one,
//! and survives a restart; results are evicted
//! after their retention (sooner once acknowledged), the log forgets them, an evicted
//! id answers `Gone` (not `UnknownProcedure`, not "still running"), and its nonce is
//! free again.

mod common;

use std::time::Duration;

use proctor::messages::GetValue;
use proctor::{
    async_trait, Context, Error, Executor, ExecutorBuilder, Flow, Nonce, ProcError, ProcId,
    Procedure, ProcedureStore, Registry, WaitError, WaitValue,
};
use serde::{Deserialize, Serialize};

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Created {
    table: String,
    regions: u32,
}

/// Two steps; the last sets a value for the caller. `hold` suspends it first.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    table: String,
    step: u32,
    hold: bool,
}

#[async_trait]
impl Procedure for CreateTable {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        self.step += 1;
        // A value set before the last step is replaced by the last one set.
        ctx.set_result(&"not the result")?;
        match self.step {
            1 if self.hold => Ok(Flow::Suspend("go".into())),
            1 => Ok(Flow::MoreToDo),
            _ => {
                ctx.set_result(&Created {
                    table: self.table.clone(),
                    regions: 3,
                })?;
                Ok(Flow::Done)
            }
        }
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }

    fn rerun_after_recover(&self, _event: &str) -> bool {
        false
    }
}

fn create(table: &str, hold: bool) -> CreateTable {
    CreateTable {
        table: table.into(),
        step: 0,
        hold,
    }
}

async fn start(
    store: Box<dyn ProcedureStore>,
    configure: impl FnOnce(ExecutorBuilder) -> ExecutorBuilder,
) -> Executor {
    let mut registry = Registry::new();
    registry
        .register::<CreateTable>("create_table")
        .register::<Quiet>("quiet");
    configure(Executor::builder().registry(registry).store(store))
        .start()
        .await
        .expect("executor starts")
}

/// Waits (polling, as a client would) until `id` is gone.
async fn wait_until_gone(executor: &Executor, id: ProcId) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match executor.state(id).await {
            Err(Error::Gone(gone)) if gone == id => return,
            Ok(_) => {}
            other => panic!("{other:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "{id} never evicted");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Sets its value in step 1 only, then waits for an event in step 2, then finishes.
#[derive(Serialize, Deserialize)]
struct EarlyValue {
    step: u32,
}

#[async_trait]
impl Procedure for EarlyValue {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        self.step += 1;
        Ok(match self.step {
            1 => {
                ctx.set_result(&"set in step 1")?;
                Flow::MoreToDo
            }
            2 => Flow::Suspend("early-go".into()),
            _ => Flow::Done,
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

/// A value set in an earlier step, not the last, reaches the caller: it is recorded
/// with its step, so it survives a restart between that step and the root's end.
#[actix::test]
async fn a_value_set_before_the_last_step_reaches_the_caller_across_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let with_early = |b: ExecutorBuilder| {
            let mut registry = Registry::new();
            registry.register::<EarlyValue>("early_value");
            b.registry(registry)
        };
        let executor = with_early(Executor::builder().store(store.open()))
            .start()
            .await
            .unwrap();
        let id = executor.submit(EarlyValue { step: 0 }).await.unwrap();
        common::wait_for_state(&executor, id, proctor::ProcState::Waiting).await;
        executor.shutdown_now().await.unwrap();

        let executor = with_early(Executor::builder().store(store.open()))
            .start()
            .await
            .unwrap();
        executor.wake_event("early-go").await.unwrap();
        let value = executor.wait_value::<String>(id).await.unwrap();
        assert_eq!(value, "set in step 1", "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn the_last_steps_value_reaches_the_caller_and_survives_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let executor = start(store.open(), |b| b).await;
        let id = executor.submit(create("t1", false)).await.unwrap();
        let expected = Created {
            table: "t1".into(),
            regions: 3,
        };
        let value = executor.wait_value::<Created>(id).await.unwrap();
        assert_eq!(value, expected, "{name}");
        // The wrong type is a typed error, not a panic.
        match executor.wait_value::<Vec<u64>>(id).await {
            Err(WaitError::Engine(Error::ValueType { id: got, .. })) => assert_eq!(got, id),
            other => panic!("{name}: {other:?}"),
        }
        executor.shutdown_now().await.unwrap();

        let executor = start(store.open(), |b| b).await;
        let value = executor.wait_value::<Created>(id).await.unwrap();
        assert_eq!(
            value,
            Created {
                table: "t1".into(),
                regions: 3
            },
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn results_are_evicted_after_their_retention_and_the_log_forgets_them() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let executor = start(store.open(), |b| {
            b.retention(Duration::from_millis(30))
                .cleaner_interval(Duration::from_millis(5))
                .nonce_retention(Duration::from_millis(30))
        })
        .await;
        let nonce = Nonce { group: 1, nonce: 1 };
        let done = executor
            .submit_with_nonce(create("t1", false), nonce)
            .await
            .unwrap();
        let running = executor.submit(create("t2", true)).await.unwrap();
        assert!(executor.wait(done).await.unwrap().is_ok());
        wait_until_gone(&executor, done).await;
        // Three different answers: gone, never issued, still running.
        assert!(
            matches!(executor.wait(done).await, Err(Error::Gone(_))),
            "{name}"
        );
        assert!(matches!(
            executor.state(ProcId(1 << 40)).await,
            Err(Error::UnknownProcedure(_))
        ));
        assert!(matches!(
            executor
                .addr()
                .unwrap()
                .send(proctor::messages::GetValue::<Created>::new(running))
                .await
                .unwrap(),
            Err(Error::NotFinished(_))
        ));
        // The nonce, remembered no longer than the result, went with it: the same
        // nonce is a new submission.
        let again = executor
            .submit_with_nonce(create("t1", false), nonce)
            .await
            .unwrap();
        assert_ne!(again, done, "{name}");
        executor.shutdown_now().await.unwrap();
        // Nothing of it is left in the store.
        let snapshot = store.open().load().unwrap();
        assert!(
            snapshot.records.iter().all(|r| r.id != done),
            "{name}: the evicted root is still stored"
        );
        let executor = start(store.open(), |b| b).await;
        assert!(
            matches!(executor.wait(done).await, Err(Error::Gone(_))),
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn an_acknowledged_result_goes_sooner() {
    for (name, store, _dir) in common::stores() {
        let executor = start(store, |b| {
            b.retention(Duration::from_secs(3600))
                .retention_after_ack(Duration::from_millis(20))
                .cleaner_interval(Duration::from_millis(5))
        })
        .await;
        let kept = executor.submit(create("kept", false)).await.unwrap();
        let acked = executor.submit(create("acked", false)).await.unwrap();
        assert!(executor.wait(kept).await.unwrap().is_ok());
        assert!(executor.wait(acked).await.unwrap().is_ok());
        executor.ack_result(acked).await.unwrap();
        wait_until_gone(&executor, acked).await;
        assert!(executor.state(kept).await.is_ok(), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// One step that sets no value; it fails when asked to.
#[derive(Serialize, Deserialize)]
struct Quiet {
    fail: bool,
}

#[async_trait]
impl Procedure for Quiet {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        if self.fail {
            return Err(ProcError::failed("quietly broke"));
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

#[actix::test]
async fn wait_value_tells_a_failure_no_value_a_gone_id_and_an_engine_error_apart() {
    for (name, store, _dir) in common::stores() {
        let executor = start(store, |b| {
            b.retention(Duration::from_millis(30))
                .cleaner_interval(Duration::from_millis(5))
        })
        .await;
        let failed = executor.submit(Quiet { fail: true }).await.unwrap();
        match executor.wait_value::<u32>(failed).await {
            Err(WaitError::Failed(failure)) => {
                assert_eq!(failure.proc, failed);
                assert_eq!(failure.error, ProcError::failed("quietly broke"), "{name}");
            }
            other => panic!("{name}: {other:?}"),
        }
        let quiet = executor.submit(Quiet { fail: false }).await.unwrap();
        assert!(
            matches!(executor.wait_value::<u32>(quiet).await, Err(WaitError::NoValue(id)) if id == quiet),
            "{name}"
        );
        wait_until_gone(&executor, quiet).await;
        assert!(
            matches!(executor.wait_value::<u32>(quiet).await, Err(WaitError::Gone(id)) if id == quiet),
            "{name}"
        );
        assert!(
            matches!(
                executor.wait_value::<u32>(ProcId(1 << 40)).await,
                Err(WaitError::Engine(Error::UnknownProcedure(_)))
            ),
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn an_actor_reads_a_typed_value_with_wait_value_and_get_value() {
    for (name, store, _dir) in common::stores() {
        let executor = start(store, |b| b).await;
        let id = executor.submit(create("t9", false)).await.unwrap();
        let addr = executor.addr().unwrap();
        let waited: Created = addr.send(WaitValue::new(id)).await.unwrap().unwrap();
        assert_eq!(waited.table, "t9", "{name}");
        let got: Option<Created> = addr.send(GetValue::new(id)).await.unwrap().unwrap();
        assert_eq!(got, Some(waited), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// Sets its name as its value; with `hold`, waits for the event "region-go" first.
#[derive(Serialize, Deserialize)]
struct Region {
    name: String,
    hold: bool,
    step: u32,
}

#[async_trait]
impl Procedure for Region {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        self.step += 1;
        ctx.set_result(&self.name)?;
        if self.hold && self.step == 1 {
            return Ok(Flow::Suspend("region-go".into()));
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }

    fn rerun_after_recover(&self, _event: &str) -> bool {
        false
    }
}

/// Starts its regions, then answers the names they set, in order.
#[derive(Serialize, Deserialize)]
struct Regions {
    names: Vec<String>,
    started: bool,
}

#[async_trait]
impl Procedure for Regions {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        if !self.started {
            self.started = true;
            let children = self.names.iter().enumerate().map(|(i, name)| Region {
                name: name.clone(),
                hold: i == 0,
                step: 0,
            });
            return Ok(Flow::children(children));
        }
        let names: Vec<String> = ctx
            .child_results::<String>()?
            .into_iter()
            .map(|(_, name)| name)
            .collect();
        // One child's, by id, agrees.
        let first = ctx.children()[0].0;
        assert_eq!(ctx.child_result::<String>(first)?.as_ref(), names.first());
        ctx.set_result(&names)?;
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

#[actix::test]
async fn a_parent_reads_its_childrens_values_even_across_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let with_regions = |b: ExecutorBuilder| {
            let mut registry = Registry::new();
            registry
                .register::<Region>("region")
                .register::<Regions>("regions");
            b.registry(registry)
        };
        let executor = with_regions(Executor::builder().store(store.open()))
            .start()
            .await
            .unwrap();
        let names = vec!["r-0".to_string(), "r-1".to_string(), "r-2".to_string()];
        let id = executor
            .submit(Regions {
                names: names.clone(),
                started: false,
            })
            .await
            .unwrap();
        // r-1 and r-2 finish; r-0 waits for its event. Then the engine stops.
        common::waiting_children(&executor, id, 1).await;
        // (A child that has finished leaves the executor's table.)
        for child in [ProcId(id.0 + 2), ProcId(id.0 + 3)] {
            while !matches!(executor.state(child).await, Err(Error::Gone(_))) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        executor.shutdown_now().await.unwrap();

        // The values r-1 and r-2 set were recorded with them.
        let executor = with_regions(Executor::builder().store(store.open()))
            .start()
            .await
            .unwrap();
        executor.wake_event("region-go").await.unwrap();
        let got: Vec<String> = executor.wait_value(id).await.unwrap();
        assert_eq!(got, names, "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// A child that finished while its tree still runs is forgotten as it finishes: asking
/// for it answers `Gone`, whose text says a finished child may belong to a running tree
/// (it spoke only of "a child of a finished tree").
#[actix::test]
async fn a_finished_child_of_a_running_tree_is_gone_and_the_error_says_so() {
    use common::{Scripted, Step};
    let (executor, rec) = common::start(Box::new(proctor::MemoryStore::new()), 4).await;
    let child_plan = Scripted::new("child", vec![Step::Gate]);
    let root = executor
        .submit(Scripted::new(
            "root",
            vec![Step::Children(vec![child_plan]), Step::Hold],
        ))
        .await
        .unwrap();
    // The child, while it runs (held at its gate).
    let child = loop {
        let list = executor
            .list(proctor::List::new().root(root))
            .await
            .unwrap();
        if let Some(child) = list.iter().find(|p| p.parent == Some(root)) {
            break child.id;
        }
        tokio::task::yield_now().await;
    };
    rec.gate.notify_one();
    // The root's next step runs, and holds: its child has finished.
    rec.signal.notified().await;
    let gone = loop {
        match executor.state(child).await {
            Ok(_) => tokio::task::yield_now().await,
            Err(e) => break e,
        }
    };
    assert!(matches!(gone, Error::Gone(id) if id == child), "{gone:?}");
    let tree = executor.state(root).await.unwrap();
    assert!(
        !tree.state.is_finished(),
        "the tree still runs: {}",
        tree.state
    );
    assert_eq!(
        gone.to_string(),
        format!(
            "procedure {child} is gone: its result was evicted, it was a child procedure \
             and has finished (its tree may still be running), or its submit never became \
             durable"
        )
    );
    rec.gate.notify_one();
    executor.wait(root).await.unwrap().unwrap();
    executor.shutdown().await.unwrap();
}
