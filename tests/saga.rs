//! Straight-line procedures (`SagaProcedure`): each step journaled and run once, its
//! value replayed; on failure or abort the undos run newest first, told what their
//! steps did; an undo that fails is retried; a crash at any write leaves the world as
//! the result says; children started from a saga give it their values, and a failing
//! one rolls it back. A step's retryable error is retried under the retry policy set
//! before it, then the saga's failure policy decides: roll back, pause for an operator,
//! or retry first (a terminal error never). A step's undo borrows what its `run`
//! borrows; an abort drops a step that does not watch for it (undone as failed), unless
//! the step is uncancellable. On every store.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::{Arc, Mutex};

use common::stores;
use proctor::testing::{restart_at_every_write, CrashRun};
use proctor::{
    async_trait, ChildType, Context, ErrorKind, Executor, ExecutorBuilder, FailurePolicy, Flow,
    OpId, ProcError, ProcState, Procedure, ProcedureStore, Registry, Report, RetryPolicy, Saga,
    SagaContext, SagaProcedure, Transport, TransportError, Undo, Undoing, WaitError,
};
use serde::{Deserialize, Serialize};

/// The world a saga changes, and what it saw.
#[derive(Default)]
struct Cluster {
    tables: Mutex<BTreeSet<String>>,
    regions: Mutex<BTreeSet<String>>,
    calls: Mutex<Vec<String>>,
    /// Undos of this name fail this many times first.
    flaky_undo: Mutex<(String, u32)>,
    in_step: tokio::sync::Notify,
    /// Steps told to wait do so only while this is set.
    hold: std::sync::atomic::AtomicBool,
    /// How many more connections the region server refuses.
    refusals: std::sync::atomic::AtomicU32,
}

impl Cluster {
    fn call(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn state(&self) -> (Vec<String>, Vec<String>) {
        (
            self.tables.lock().unwrap().iter().cloned().collect(),
            self.regions.lock().unwrap().iter().cloned().collect(),
        )
    }
}

/// Create a table: the table, then its regions (one step each), then enable it. It can
/// fail in a step, or wait in one for the test.
#[derive(Clone, Serialize, Deserialize)]
struct CreateTable {
    name: String,
    regions: u32,
    fail_at: Option<String>,
    wait_at: Option<String>,
}

impl CreateTable {
    fn new(name: &str, regions: u32) -> Self {
        CreateTable {
            name: name.into(),
            regions,
            fail_at: None,
            wait_at: None,
        }
    }
}

#[async_trait]
impl SagaProcedure<Cluster> for CreateTable {
    type Output = Vec<String>;

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<Vec<String>, ProcError> {
        let env = ctx.env();
        // A step's work: it records itself, waits (until the engine drops it) if told
        // to, fails if told to (before changing anything).
        let gate = |step: &str| {
            env.call(format!("do {step}"));
            let wait = self.wait_at.as_deref() == Some(step) && env.hold.load(SeqCst);
            let fail = (self.fail_at.as_deref() == Some(step))
                .then(|| ProcError::failed(format!("{step} broke")));
            async move {
                if wait {
                    env.in_step.notify_one();
                    std::future::pending::<()>().await;
                }
                fail.map_or(Ok(()), Err)
            }
        };
        let undo_of = |step: &str| {
            let step = step.to_string();
            move |undoing: Undoing<String>| async move {
                let told = match &undoing {
                    Undoing::Completed(v) => format!("completed {v}"),
                    Undoing::Failed => "failed".to_string(),
                    Undoing::Interrupted => "interrupted".to_string(),
                };
                env.call(format!("undo {step} ({told})"));
                {
                    let mut flaky = env.flaky_undo.lock().unwrap();
                    if flaky.0 == step && flaky.1 > 0 {
                        flaky.1 -= 1;
                        return Err(ProcError::failed("undo broke"));
                    }
                }
                // A failed step made nothing (it fails before changing anything).
                if matches!(undoing, Undoing::Completed(_) | Undoing::Interrupted) {
                    env.tables.lock().unwrap().remove(&step);
                    env.regions.lock().unwrap().remove(&step);
                }
                Ok(())
            }
        };

        let made = ctx
            .step(
                "table",
                || async {
                    gate("table").await?;
                    env.tables.lock().unwrap().insert(self.name.clone());
                    Ok(self.name.clone())
                },
                undo_of(&self.name),
            )
            .await?;
        let mut regions = Vec::new();
        for r in 0..self.regions {
            let step = format!("region {r}");
            let region = format!("{made}-r{r}");
            let done = ctx
                .step(
                    &step,
                    || async {
                        gate(&step).await?;
                        env.regions.lock().unwrap().insert(region.clone());
                        Ok(region.clone())
                    },
                    undo_of(&region),
                )
                .await?;
            regions.push(done);
        }
        ctx.step(
            "enable",
            || gate("enable"),
            |_: Undoing<()>| async { Ok(()) },
        )
        .await?;
        Ok(regions)
    }
}

/// How a step returns the region server's error.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Mark {
    Plain,
    Retryable,
    Terminal,
}

/// Reserve, connect to the region server (refused while the cluster says so, its error
/// returned as `mark` says, under the retry policy `retry`), enable; under the failure
/// policy `policy`. Each step and undo is recorded.
#[derive(Clone, Serialize, Deserialize)]
struct Connect {
    mark: Mark,
    retry: Option<RetryPolicy>,
    policy: FailurePolicy,
}

impl Connect {
    fn new(mark: Mark) -> Self {
        Connect {
            mark,
            retry: None,
            policy: FailurePolicy::Rollback,
        }
    }
}

#[async_trait]
impl SagaProcedure<Cluster> for Connect {
    type Output = ();

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<(), ProcError> {
        let env = ctx.env();
        let undo = |step: &'static str| {
            move |undoing: Undoing<()>| async move {
                let told = match undoing {
                    Undoing::Completed(()) => "completed",
                    Undoing::Failed => "failed",
                    Undoing::Interrupted => "interrupted",
                };
                env.call(format!("undo {step} ({told})"));
                Ok(())
            }
        };
        let done = |step: &'static str| {
            move || async move {
                env.call(format!("do {step}"));
                Ok(())
            }
        };
        ctx.step("reserve", done("reserve"), undo("reserve"))
            .await?;
        if let Some(retry) = self.retry {
            ctx.set_retry_policy(retry);
        }
        ctx.step(
            "connect",
            || async {
                env.call("do connect".into());
                let refused = env
                    .refusals
                    .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if refused {
                    let e = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
                    return Err(match self.mark {
                        Mark::Plain => ProcError::from(e),
                        Mark::Retryable => ProcError::retryable(e),
                        Mark::Terminal => ProcError::terminal(e),
                    });
                }
                Ok(())
            },
            undo("connect"),
        )
        .await?;
        ctx.step("enable", done("enable"), undo("enable")).await
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        self.policy
    }
}

fn builder(cluster: &Arc<Cluster>) -> ExecutorBuilder<Cluster> {
    let mut registry = Registry::new();
    registry
        .register_saga::<CreateTable>("create_table")
        .register_saga::<Connect>("connect")
        .register_saga::<Slow>("slow");
    Executor::builder().registry(registry).env(cluster.clone())
}

async fn start(store: Box<dyn ProcedureStore>, cluster: &Arc<Cluster>) -> Executor<Cluster> {
    builder(cluster).store(store).start().await.expect("starts")
}

#[actix::test]
async fn a_saga_runs_each_step_once_and_answers_its_output() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = start(store, &cluster).await;
        let id = executor
            .submit(Saga::new(CreateTable::new("t1", 2)))
            .await
            .unwrap();
        let regions: Vec<String> = executor.wait_value(id).await.unwrap();
        assert_eq!(regions, ["t1-r0", "t1-r1"], "{name}");
        // Replayed at every step, but each step ran once.
        assert_eq!(
            cluster.calls(),
            ["do table", "do region 0", "do region 1", "do enable"],
            "{name}"
        );
        assert_eq!(
            cluster.state(),
            (vec!["t1".into()], vec!["t1-r0".into(), "t1-r1".into()])
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_failed_step_rolls_the_saga_back_newest_first() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = start(store, &cluster).await;
        let mut create = CreateTable::new("t1", 2);
        create.fail_at = Some("region 1".into());
        let id = executor.submit(Saga::new(create)).await.unwrap();
        match executor.wait_value::<Vec<String>>(id).await {
            Err(WaitError::Failed(f)) => assert_eq!(f.error, ProcError::failed("region 1 broke")),
            other => panic!("{name}: {other:?}"),
        }
        assert_eq!(
            cluster.calls(),
            [
                "do table",
                "do region 0",
                "do region 1",
                "undo t1-r1 (failed)",
                "undo t1-r0 (completed t1-r0)",
                "undo t1 (completed t1)",
            ],
            "{name}"
        );
        assert_eq!(cluster.state(), (vec![], vec![]), "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn an_abort_mid_saga_undoes_what_was_done_and_a_failing_undo_is_retried() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        cluster
            .hold
            .store(true, std::sync::atomic::Ordering::SeqCst);
        *cluster.flaky_undo.lock().unwrap() = ("t1".into(), 2);
        let executor = start(store, &cluster).await;
        let mut create = CreateTable::new("t1", 1);
        create.wait_at = Some("region 0".into());
        let id = executor.submit(Saga::new(create)).await.unwrap();
        cluster.in_step.notified().await;
        // The step runs: the abort cancels it, and it fails.
        assert!(executor.abort(id).await.unwrap(), "{name}");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::Aborted, "{name}");
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack
        );
        assert_eq!(
            cluster.calls(),
            [
                "do table",
                "do region 0",
                "undo t1-r0 (failed)",
                // Fails twice, then succeeds: retried with backoff.
                "undo t1 (completed t1)",
                "undo t1 (completed t1)",
                "undo t1 (completed t1)",
            ],
            "{name}"
        );
        assert_eq!(cluster.state(), (vec![], vec![]), "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// After a crash run of creating table `t1` with two regions: the world is the table
/// and its regions if the run succeeded, nothing otherwise, and the run succeeded
/// exactly when it `succeeds` (if its root was submitted at all). Then a new world for
/// the next run.
fn check_world(cluster: &Cluster, run: &CrashRun, succeeds: bool) {
    let state = cluster.state();
    match &run.result {
        Some(Ok(())) => assert_eq!(
            state,
            (vec!["t1".into()], vec!["t1-r0".into(), "t1-r1".into()]),
            "{run:?}"
        ),
        Some(Err(_)) | None => assert_eq!(state, (vec![], vec![]), "{run:?}"),
    }
    assert_eq!(
        run.result.as_ref().map(Result::is_ok),
        run.root.map(|_| succeeds)
    );
    *cluster.tables.lock().unwrap() = BTreeSet::new();
    *cluster.regions.lock().unwrap() = BTreeSet::new();
}

#[actix::test]
async fn after_a_crash_at_any_write_the_world_matches_the_result() {
    for fail_at in [None, Some("region 1")] {
        let cluster = Arc::new(Cluster::default());
        let runs = restart_at_every_write(
            // The world lives through each run's crash and restart.
            || builder(&cluster),
            || {
                let mut create = CreateTable::new("t1", 2);
                create.fail_at = fail_at.map(str::to_string);
                Saga::new(create)
            },
            |run| check_world(&cluster, run, fail_at.is_none()),
        )
        .await
        .expect("runs");
        assert!(runs.len() >= 10, "{fail_at:?}: {} runs", runs.len());
    }
}

#[actix::test]
async fn after_a_restart_journaled_steps_answer_from_the_journal_without_running() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let cluster = Arc::new(Cluster::default());
        cluster
            .hold
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let executor = start(store.open(), &cluster).await;
        let mut create = CreateTable::new("t1", 2);
        create.wait_at = Some("region 1".into());
        let id = executor.submit(Saga::new(create)).await.unwrap();
        cluster.in_step.notified().await;
        // Stopped in region 1's step: the step is cut off, not recorded.
        executor.shutdown_now().await.unwrap();
        cluster
            .hold
            .store(false, std::sync::atomic::Ordering::SeqCst);

        let executor = start(store.open(), &cluster).await;
        let regions: Vec<String> = executor.wait_value(id).await.unwrap();
        assert_eq!(regions, ["t1-r0", "t1-r1"], "{name}");
        // The table and region 0 came from the journal: they ran once.
        assert_eq!(
            cluster.calls(),
            [
                "do table",
                "do region 0",
                "do region 1",
                "do region 1",
                "do enable"
            ],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

/// Assigns one region (a child of a saga): it adds the region and answers its server.
#[derive(Serialize, Deserialize)]
struct Assign {
    region: String,
    fail: bool,
}

#[async_trait]
impl Procedure<Cluster> for Assign {
    async fn execute(&mut self, ctx: &mut Context<Cluster>) -> Result<Flow<Cluster>, ProcError> {
        ctx.env().call(format!("assign {}", self.region));
        if self.fail {
            return Err(ProcError::failed(format!("{} broke", self.region)));
        }
        ctx.env()
            .regions
            .lock()
            .unwrap()
            .insert(self.region.clone());
        ctx.set_result(&format!("server of {}", self.region))?;
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, ctx: &mut Context<Cluster>) -> Result<(), ProcError> {
        if ctx.undoing() != Undo::Failed {
            ctx.env().call(format!("unassign {}", self.region));
            ctx.env().regions.lock().unwrap().remove(&self.region);
        }
        Ok(())
    }
}

/// Create a table, assign its regions as children, then enable it with their servers.
#[derive(Serialize, Deserialize)]
struct CreateWithChildren {
    name: String,
    regions: u32,
    fail_region: Option<u32>,
}

impl CreateWithChildren {
    fn region_names(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.regions).map(|r| format!("{}-r{r}", self.name))
    }
}

#[async_trait]
impl SagaProcedure<Cluster> for CreateWithChildren {
    type Output = Vec<String>;

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<Vec<String>, ProcError> {
        let env = ctx.env();
        ctx.step(
            "table",
            || async {
                env.call("do table".into());
                env.tables.lock().unwrap().insert(self.name.clone());
                Ok(())
            },
            move |undoing: Undoing<()>| async move {
                env.call(format!("undo table ({undoing:?})"));
                if undoing != Undoing::Failed {
                    env.tables.lock().unwrap().remove(&self.name);
                }
                Ok(())
            },
        )
        .await?;
        let servers: Vec<String> = ctx
            .children(
                "assign",
                || {
                    self.region_names()
                        .enumerate()
                        .map(move |(r, region)| Assign {
                            region,
                            fail: self.fail_region == u32::try_from(r).ok(),
                        })
                },
                // The regions of the children that had succeeded (the engine rolls back
                // the others): all of them, or, not knowing which, whichever are there.
                move |undoing: Undoing<Vec<String>>| async move {
                    let how = match &undoing {
                        Undoing::Completed(_) => "completed",
                        Undoing::Failed => "failed",
                        Undoing::Interrupted => "interrupted",
                    };
                    env.call(format!("undo assign ({how})"));
                    let mut assigned = env.regions.lock().unwrap();
                    for region in self.region_names() {
                        assigned.remove(&region);
                    }
                    Ok(())
                },
            )
            .await?;
        ctx.step(
            "enable",
            || async {
                env.call(format!("enable with {}", servers.join(", ")));
                Ok(())
            },
            |_: Undoing<()>| async { Ok(()) },
        )
        .await?;
        Ok(servers)
    }

    fn child_types() -> Vec<ChildType> {
        vec![ChildType::of::<Assign>()]
    }
}

fn builder_with_children(cluster: &Arc<Cluster>) -> ExecutorBuilder<Cluster> {
    let mut registry = Registry::new();
    registry
        .register_saga::<CreateWithChildren>("create_with_children")
        .register::<Assign>("assign");
    Executor::builder().registry(registry).env(cluster.clone())
}

#[actix::test]
async fn a_saga_starts_children_and_gets_their_values_in_order() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = builder_with_children(&cluster)
            .store(store)
            .start()
            .await
            .unwrap();
        let create = CreateWithChildren {
            name: "t1".into(),
            regions: 3,
            fail_region: None,
        };
        let id = executor.submit(Saga::new(create)).await.unwrap();
        let servers: Vec<String> = executor.wait_value(id).await.unwrap();
        let expected = ["server of t1-r0", "server of t1-r1", "server of t1-r2"];
        assert_eq!(servers, expected, "{name}");
        let calls = cluster.calls();
        assert_eq!(
            calls.first().map(String::as_str),
            Some("do table"),
            "{name}"
        );
        assert_eq!(
            calls.last().map(String::as_str),
            Some("enable with server of t1-r0, server of t1-r1, server of t1-r2"),
            "{name}"
        );
        // Each child ran once (in any order), and once only.
        assert_eq!(calls.len(), 5, "{name}: {calls:?}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_failing_child_rolls_the_saga_back() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = builder_with_children(&cluster)
            .store(store)
            .start()
            .await
            .unwrap();
        let create = CreateWithChildren {
            name: "t1".into(),
            regions: 2,
            fail_region: Some(1),
        };
        let id = executor.submit(Saga::new(create)).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::failed("t1-r1 broke"), "{name}");
        assert_eq!(cluster.state(), (vec![], vec![]), "{name}");
        let calls = cluster.calls();
        // The children's step was undone not knowing which succeeded, then the
        // table's, told it completed; enable never ran.
        let undo_assign = calls.iter().position(|c| c == "undo assign (interrupted)");
        let undo_table = calls.iter().position(|c| c == "undo table (Completed(()))");
        assert!(
            undo_assign.is_some() && undo_assign < undo_table,
            "{name}: {calls:?}"
        );
        assert!(
            !calls.iter().any(|c| c.starts_with("enable")),
            "{name}: {calls:?}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_saga_with_children_survives_a_crash_at_any_write() {
    for fail_region in [None, Some(1)] {
        let cluster = Arc::new(Cluster::default());
        let runs = restart_at_every_write(
            || builder_with_children(&cluster),
            || {
                Saga::new(CreateWithChildren {
                    name: "t1".into(),
                    regions: 2,
                    fail_region,
                })
            },
            |run| check_world(&cluster, run, fail_region.is_none()),
        )
        .await
        .expect("runs");
        assert!(runs.len() >= 8, "{fail_region:?}: {} runs", runs.len());
    }
}

/// A cluster whose region server refuses `refusals` connections.
fn refusing(refusals: u32) -> Arc<Cluster> {
    let cluster = Cluster::default();
    cluster.refusals.store(refusals, SeqCst);
    Arc::new(cluster)
}

/// Fast retries, for the tests.
fn retries(n: u32) -> RetryPolicy {
    RetryPolicy::new(n).backoff_ms(1).max_delay_ms(5)
}

#[actix::test]
async fn a_retryable_saga_step_is_retried_and_the_saga_goes_on() {
    for name in common::STORES {
        // Refused twice, three retries set before the step: the journaled step does not
        // run again, the failed one does until it connects.
        let cluster = refusing(2);
        let executor = start(common::Reopen::new(name).open(), &cluster).await;
        let mut connect = Connect::new(Mark::Retryable);
        connect.retry = Some(retries(3));
        let id = executor.submit(Saga::new(connect)).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = [
            "do reserve",
            "do connect",
            "do connect",
            "do connect",
            "do enable",
        ];
        assert_eq!(cluster.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();

        // No retry policy set: the default one (from 200 ms).
        let cluster = refusing(1);
        let executor = start(common::Reopen::new(name).open(), &cluster).await;
        let id = executor
            .submit(Saga::new(Connect::new(Mark::Retryable)))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = ["do reserve", "do connect", "do connect", "do enable"];
        assert_eq!(cluster.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_retryable_saga_step_past_its_retries_is_undone_then_the_steps_before_it() {
    for name in common::STORES {
        let cluster = refusing(u32::MAX);
        let executor = start(common::Reopen::new(name).open(), &cluster).await;
        let mut connect = Connect::new(Mark::Retryable);
        connect.retry = Some(retries(2));
        let id = executor.submit(Saga::new(connect)).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error.kind(), Some(ErrorKind::Retryable), "{name}");
        let expected = [
            "do reserve",
            "do connect",
            "do connect",
            "do connect",
            "undo connect (failed)",
            "undo reserve (completed)",
        ];
        assert_eq!(cluster.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_saga_declares_its_failure_policy() {
    let retry = FailurePolicy::RetryThenRollback {
        times: 2,
        backoff_ms: 1,
    };
    for name in common::STORES {
        // Retry first, as the saga says: an error not marked is retried too.
        let cluster = refusing(1);
        let executor = start(common::Reopen::new(name).open(), &cluster).await;
        let mut connect = Connect::new(Mark::Plain);
        connect.policy = retry;
        let id = executor.submit(Saga::new(connect)).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = ["do reserve", "do connect", "do connect", "do enable"];
        assert_eq!(cluster.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();

        // ... but never a terminal one: undone at once.
        let cluster = refusing(1);
        let executor = start(common::Reopen::new(name).open(), &cluster).await;
        let mut connect = Connect::new(Mark::Terminal);
        connect.policy = retry;
        let id = executor.submit(Saga::new(connect)).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error.kind(), Some(ErrorKind::Terminal), "{name}");
        let expected = [
            "do reserve",
            "do connect",
            "undo connect (failed)",
            "undo reserve (completed)",
        ];
        assert_eq!(cluster.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();

        // Pause: an operator's continue runs the failed step again, and the saga goes
        // on; an operator's rollback undoes it, then the steps before it.
        for continued in [true, false] {
            let cluster = refusing(1);
            let executor = start(common::Reopen::new(name).open(), &cluster).await;
            let mut connect = Connect::new(Mark::Plain);
            connect.policy = FailurePolicy::Pause;
            let id = executor.submit(Saga::new(connect)).await.unwrap();
            common::wait_for_state(&executor, id, ProcState::Paused).await;
            assert_eq!(cluster.calls(), ["do reserve", "do connect"], "{name}");
            let (result, expected) = if continued {
                executor.resume(id).await.unwrap();
                let after = ["do reserve", "do connect", "do connect", "do enable"];
                (executor.wait(id).await.unwrap().is_ok(), after.to_vec())
            } else {
                executor.rollback(id).await.unwrap();
                let after = [
                    "do reserve",
                    "do connect",
                    "undo connect (failed)",
                    "undo reserve (completed)",
                ];
                (executor.wait(id).await.unwrap().is_ok(), after.to_vec())
            };
            assert_eq!(result, continued, "{name}");
            assert_eq!(cluster.calls(), expected, "{name} continued={continued}");
            executor.shutdown().await.unwrap();
        }
    }
}

/// A node's slot, reserved under the saga's mark (its procedure's id), the way a step's
/// undo is written: the saga's field and the environment used by both `run` and
/// `undo`.
#[derive(Serialize, Deserialize)]
struct ReserveCloning {
    node: String,
}

#[async_trait]
impl SagaProcedure<Cluster> for ReserveCloning {
    type Output = ();

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<(), ProcError> {
        // An undo that must be 'static: its own copies of everything it touches.
        let env = ctx.env_arc().clone();
        let (e, n, ue, un) = (
            env.clone(),
            self.node.clone(),
            env.clone(),
            self.node.clone(),
        );
        ctx.step(
            "reserve",
            move || async move {
                e.call(format!("do reserve {n}"));
                e.tables.lock().unwrap().insert(n);
                Ok(())
            },
            move |undoing: Undoing<()>| async move {
                ue.call(format!("undo reserve {un} ({undoing:?})"));
                ue.tables.lock().unwrap().remove(&un);
                Ok(())
            },
        )
        .await?;
        Err(ProcError::failed("no region server"))
    }
}

/// The same saga without a copy: `ctx.env()` does not borrow the saga's context, and
/// the undo runs while `run` does, so it borrows what `run` borrows.
#[derive(Serialize, Deserialize)]
struct ReserveBorrowing {
    node: String,
}

#[async_trait]
impl SagaProcedure<Cluster> for ReserveBorrowing {
    type Output = ();

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<(), ProcError> {
        let env = ctx.env();
        ctx.step(
            "reserve",
            || async {
                env.call(format!("do reserve {}", self.node));
                env.tables.lock().unwrap().insert(self.node.clone());
                Ok(())
            },
            |undoing| async move {
                env.call(format!("undo reserve {} ({undoing:?})", self.node));
                env.tables.lock().unwrap().remove(&self.node);
                Ok(())
            },
        )
        .await?;
        Err(ProcError::failed("no region server"))
    }
}

#[actix::test]
async fn an_undo_borrows_the_saga_and_the_environment_as_its_step_does() {
    let cluster = Arc::new(Cluster::default());
    let mut registry = Registry::<Cluster>::default();
    registry
        .register_saga::<ReserveCloning>("reserve_cloning")
        .register_saga::<ReserveBorrowing>("reserve_borrowing");
    let executor = Executor::builder()
        .registry(registry)
        .env(cluster.clone())
        .store(proctor::MemoryStore::new())
        .start()
        .await
        .unwrap();
    let cloning = executor
        .submit(Saga::new(ReserveCloning { node: "n1".into() }))
        .await
        .unwrap();
    let borrowing = executor
        .submit(Saga::new(ReserveBorrowing { node: "n2".into() }))
        .await
        .unwrap();
    for id in [cloning, borrowing] {
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::failed("no region server"));
    }
    // The same calls either way, and the slots are free again.
    let mut calls = cluster.calls();
    calls.sort();
    assert_eq!(
        calls,
        [
            "do reserve n1",
            "do reserve n2",
            "undo reserve n1 (Completed(()))",
            "undo reserve n2 (Completed(()))",
        ]
    );
    assert_eq!(cluster.state(), (vec![], vec![]));
    executor.shutdown().await.unwrap();
}

/// Reserves, then runs a step that sleeps `ms` without watching for cancellation
/// (`uncancellable` if told), then enables. Each step and undo is recorded.
#[derive(Serialize, Deserialize)]
struct Slow {
    ms: u64,
    uncancellable: bool,
}

#[async_trait]
impl SagaProcedure<Cluster> for Slow {
    type Output = ();

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<(), ProcError> {
        let env = ctx.env();
        let undo = |step: &'static str| {
            move |undoing: Undoing<()>| async move {
                env.call(format!("undo {step} ({undoing:?})"));
                Ok(())
            }
        };
        ctx.step(
            "reserve",
            || async {
                env.call("do reserve".into());
                Ok(())
            },
            undo("reserve"),
        )
        .await?;
        let slow = ctx.step(
            "slow",
            || async {
                env.call("do slow".into());
                env.in_step.notify_one();
                tokio::time::sleep(std::time::Duration::from_millis(self.ms)).await;
                env.call("done slow".into());
                Ok(())
            },
            undo("slow"),
        );
        if self.uncancellable {
            slow.uncancellable().await?;
        } else {
            slow.await?;
        }
        ctx.step(
            "enable",
            || async {
                env.call("do enable".into());
                Ok(())
            },
            undo("enable"),
        )
        .await
    }
}

#[actix::test]
async fn an_abort_drops_a_saga_step_that_does_not_watch_for_it_and_its_undo_is_told_failed() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = start(store, &cluster).await;
        let slow = Slow {
            ms: 5_000,
            uncancellable: false,
        };
        let id = executor.submit(Saga::new(slow)).await.unwrap();
        cluster.in_step.notified().await;
        let asked = std::time::Instant::now();
        assert!(executor.abort(id).await.unwrap(), "{name}");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        let took = asked.elapsed();
        assert_eq!(failure.error, ProcError::Aborted, "{name}");
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack,
            "{name}"
        );
        // Not the step's 5 s: it was dropped at the abort.
        assert!(took < std::time::Duration::from_secs(3), "{name}: {took:?}");
        assert_eq!(
            cluster.calls(),
            [
                "do reserve",
                "do slow",
                "undo slow (Failed)",
                "undo reserve (Completed(()))",
            ],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn an_uncancellable_saga_step_runs_to_its_end_before_the_rollback() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = start(store, &cluster).await;
        let slow = Slow {
            ms: 1_000,
            uncancellable: true,
        };
        let id = executor.submit(Saga::new(slow)).await.unwrap();
        cluster.in_step.notified().await;
        let asked = std::time::Instant::now();
        assert!(executor.abort(id).await.unwrap(), "{name}");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        let took = asked.elapsed();
        assert_eq!(failure.error, ProcError::Aborted, "{name}");
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack,
            "{name}"
        );
        // The step slept its whole second (less the moment before the abort).
        assert!(
            took >= std::time::Duration::from_millis(900),
            "{name}: {took:?}"
        );
        assert_eq!(
            cluster.calls(),
            [
                "do reserve",
                "do slow",
                "done slow",
                "undo slow (Completed(()))",
                "undo reserve (Completed(()))",
            ],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_shutdown_past_its_drain_deadline_drops_a_saga_step_and_it_runs_again_after_the_restart()
{
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let cluster = Arc::new(Cluster::default());
        let executor = builder(&cluster)
            .drain_timeout(std::time::Duration::from_millis(100))
            .store(store.open())
            .start()
            .await
            .unwrap();
        let slow = Slow {
            ms: 5_000,
            uncancellable: false,
        };
        let id = executor.submit(Saga::new(slow)).await.unwrap();
        cluster.in_step.notified().await;
        let asked = std::time::Instant::now();
        executor.shutdown().await.unwrap();
        let took = asked.elapsed();
        // The deadline's 100 ms, not the second more a step that runs on is given.
        assert!(took < std::time::Duration::from_secs(1), "{name}: {took:?}");

        // Nothing was recorded for the step, nor undone: it runs again, and its undo
        // is told it was interrupted (the attempt cut off may have done more than the
        // one aborted).
        let executor = start(store.open(), &cluster).await;
        cluster.in_step.notified().await;
        assert!(executor.abort(id).await.unwrap(), "{name}");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::Aborted, "{name}");
        assert_eq!(
            cluster.calls(),
            [
                "do reserve",
                "do slow",
                "do slow",
                "undo slow (Interrupted)",
                "undo reserve (Completed(()))",
            ],
            "{name} (shut down in {took:?})"
        );
        executor.shutdown().await.unwrap();
    }
}

/// Reserves a slot, then waits — `sleep_ms` durably, or for the event `event` — then
/// announces; the waits are steps of the engine's own, with nothing to undo.
#[derive(Serialize, Deserialize)]
struct Waits {
    sleep_ms: Option<u64>,
    event: Option<String>,
    timeout_ms: Option<u64>,
}

#[async_trait]
impl SagaProcedure<Cluster> for Waits {
    type Output = ();

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<(), ProcError> {
        let cluster = ctx.env();
        ctx.step(
            "reserve",
            || async move {
                cluster.call("do reserve".into());
                Ok(())
            },
            move |undoing: Undoing<()>| async move {
                cluster.call(format!("undo reserve ({undoing:?})"));
                Ok(())
            },
        )
        .await?;
        if let Some(ms) = self.sleep_ms {
            ctx.sleep("cool down", ms).await?;
        }
        if let Some(event) = &self.event {
            ctx.wait_for_event("approval", event).await?;
        }
        ctx.step(
            "announce",
            || async move {
                cluster.call("do announce".into());
                Ok(())
            },
            |_: Undoing<()>| async { Ok(()) },
        )
        .await
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.timeout_ms
    }
}

fn waits_builder(cluster: &Arc<Cluster>) -> ExecutorBuilder<Cluster> {
    let mut registry = Registry::new();
    registry.register_saga::<Waits>("waits");
    Executor::builder().registry(registry).env(cluster.clone())
}

/// A saga sleeps between two steps holding no worker (WAITING_TIMEOUT), durably: an
/// engine stopped during the sleep finishes it after a restart, each step run once.
#[actix::test]
async fn a_saga_sleeps_between_two_steps_and_after_a_restart_goes_on() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let cluster = Arc::new(Cluster::default());
        let executor = waits_builder(&cluster)
            .store(store.open())
            .start()
            .await
            .unwrap();
        let started = std::time::Instant::now();
        let waits = Waits {
            sleep_ms: Some(300),
            event: None,
            timeout_ms: None,
        };
        let id = executor.submit(Saga::new(waits)).await.unwrap();
        common::wait_for_state(&executor, id, ProcState::WaitingTimeout).await;
        assert_eq!(cluster.calls(), ["do reserve"], "{name}");
        executor.shutdown().await.unwrap();

        let executor = waits_builder(&cluster)
            .store(store.open())
            .start()
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert!(
            started.elapsed() >= std::time::Duration::from_millis(300),
            "{name}"
        );
        assert_eq!(cluster.calls(), ["do reserve", "do announce"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// A saga waits for an event (WAITING, no worker held) and goes on when it is woken;
/// stopped while waiting, it waits for the event again after a restart (whether it
/// was woken is not persisted), not running past it.
#[actix::test]
async fn a_saga_waits_for_an_event_and_again_after_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let cluster = Arc::new(Cluster::default());
        let executor = waits_builder(&cluster)
            .store(store.open())
            .start()
            .await
            .unwrap();
        let waits = Waits {
            sleep_ms: None,
            event: Some("approved/t1".into()),
            timeout_ms: None,
        };
        let id = executor.submit(Saga::new(waits)).await.unwrap();
        common::wait_for_state(&executor, id, ProcState::Waiting).await;
        executor.shutdown().await.unwrap();

        let executor = waits_builder(&cluster)
            .store(store.open())
            .start()
            .await
            .unwrap();
        // Another saga runs to its end meanwhile: a recovered saga that ran on past
        // its wait (queued at the start) would have announced by then.
        let other = Waits {
            sleep_ms: None,
            event: None,
            timeout_ms: None,
        };
        let other = executor.submit(Saga::new(other)).await.unwrap();
        assert_eq!(executor.wait(other).await.unwrap(), Ok(()), "{name}");
        let announced = || {
            cluster
                .calls()
                .iter()
                .filter(|c| *c == "do announce")
                .count()
        };
        assert_eq!(announced(), 1, "{name}: the first still waits");
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::Waiting,
            "{name}"
        );
        executor.wake_event("approved/t1").await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(announced(), 2, "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// A saga's time limit (`SagaProcedure::timeout_ms`) covers its waits: one waiting for
/// an event that never comes fails timed out and undoes what it did.
#[actix::test]
async fn a_saga_past_its_time_limit_fails_and_rolls_back() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let executor = waits_builder(&cluster).store(store).start().await.unwrap();
        let waits = Waits {
            sleep_ms: None,
            event: Some("never".into()),
            timeout_ms: Some(200),
        };
        let id = executor.submit(Saga::new(waits)).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert!(
            matches!(failure.error, ProcError::TimedOut { .. }),
            "{name}: {failure}"
        );
        assert_eq!(
            cluster.calls(),
            ["do reserve", "undo reserve (Completed(()))"],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

/// Region operations on the fake nodes below.
#[derive(Clone, Debug, Serialize, Deserialize)]
enum RegionOp {
    Open(u32),
    Close(u32),
}

/// Nodes that apply each operation once (by its id) and report it in their answer.
#[derive(Clone, Default)]
struct Nodes(Arc<Mutex<(BTreeSet<u64>, Vec<String>)>>);

impl Nodes {
    fn applied(&self) -> Vec<String> {
        self.0.lock().unwrap().1.clone()
    }
}

#[async_trait]
impl Transport for Nodes {
    type Op = RegionOp;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, RegionOp)>,
    ) -> Result<Vec<Report>, TransportError> {
        let mut nodes = self.0.lock().unwrap();
        let mut reports = Vec::new();
        for (id, op) in ops {
            if nodes.0.insert(id.0) {
                nodes.1.push(format!("{target} {op:?}"));
            }
            reports.push(Report::ok(id, &true).map_err(|e| TransportError(e.to_string()))?);
        }
        Ok(reports)
    }
}

/// Opens two regions on two nodes, each with its undo, then enables the table (which
/// fails when `fail` is set).
#[derive(Serialize, Deserialize)]
struct OpenRegions {
    fail: bool,
}

#[async_trait]
impl SagaProcedure<Cluster> for OpenRegions {
    type Output = Vec<bool>;

    async fn run(&self, ctx: &mut SagaContext<'_, Cluster>) -> Result<Vec<bool>, ProcError> {
        let mut opened = Vec::new();
        for (node, region) in [("rs-1", 1), ("rs-2", 2)] {
            let close = RegionOp::Close(region);
            let result = ctx
                .remote::<Nodes>(
                    &format!("open {region}"),
                    node,
                    &RegionOp::Open(region),
                    Some(&close),
                )
                .await?;
            opened.push(result.value::<bool>()?);
        }
        let fail = self.fail;
        ctx.step(
            "enable",
            || async move {
                if fail {
                    Err(ProcError::failed("enable refused"))
                } else {
                    Ok(())
                }
            },
            |_: Undoing<()>| async { Ok(()) },
        )
        .await?;
        Ok(opened)
    }
}

fn remote_builder(cluster: &Arc<Cluster>, nodes: &Nodes) -> ExecutorBuilder<Cluster> {
    let mut registry = Registry::new();
    registry.register_saga::<OpenRegions>("open_regions");
    Executor::builder()
        .registry(registry)
        .env(cluster.clone())
        .remote(nodes.clone(), proctor::RemoteOptions::default())
}

/// A saga's remote steps: each operation reaches its node once and the step returns
/// the node's report; when a later step fails, the rollback sends each returned
/// operation's undo, newest first.
#[actix::test]
async fn a_saga_sends_remote_operations_and_undoes_them_when_it_rolls_back() {
    for (name, store, _dir) in stores() {
        let cluster = Arc::new(Cluster::default());
        let nodes = Nodes::default();
        let executor = remote_builder(&cluster, &nodes)
            .store(store)
            .start()
            .await
            .unwrap();
        let id = executor
            .submit(Saga::new(OpenRegions { fail: false }))
            .await
            .unwrap();
        let opened: Vec<bool> = executor.wait_value(id).await.unwrap();
        assert_eq!(opened, [true, true], "{name}");
        assert_eq!(nodes.applied(), ["rs-1 Open(1)", "rs-2 Open(2)"], "{name}");

        let nodes_before = nodes.applied().len();
        let id = executor
            .submit(Saga::new(OpenRegions { fail: true }))
            .await
            .unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error.to_string(), "enable refused", "{name}");
        assert_eq!(
            nodes.applied()[nodes_before..],
            [
                "rs-1 Open(1)",
                "rs-2 Open(2)",
                "rs-2 Close(2)",
                "rs-1 Close(1)"
            ],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}
