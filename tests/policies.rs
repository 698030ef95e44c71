//! Failure policies and operator commands: retries (counted across a restart), pause
//! and continue, an operator's rollback of a paused and of a running procedure, a
//! rollback that pauses, a rollback that fails (a panic or an error) retried on the
//! same step and paused past the executor's limit, and the point of no return. Each scenario runs on both stores;
//! every command in every state, with its refusal, is a table in the core's tests
//! (`operator_commands_in_each_state_are_done_or_refused_saying_why`).

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use common::{wait_for_state, Reopen};
use proctor::{
    async_trait, Context, Error, Executor, ExecutorBuilder, FailurePolicy, Flow, OnTimeout,
    ProcError, ProcEvent, ProcId, ProcState, Procedure, ProcedureStore, Registry, StateContext,
    StateMachine, StateMachineProcedure,
};
use serde::{Deserialize, Serialize};

/// What the procedures do, as the test sees it.
#[derive(Default)]
struct World {
    calls: Mutex<Vec<String>>,
    /// How many more times the failing step fails.
    step_failures: AtomicU32,
    /// How many more times a rollback fails.
    rollback_failures: AtomicU32,
    /// A `Gated` step signals `entered`, then waits for `gate`.
    entered: tokio::sync::Notify,
    gate: tokio::sync::Notify,
}

impl World {
    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

/// Three steps; step `fail_at` fails while the world says so.
#[derive(Clone, Serialize, Deserialize)]
struct Flaky {
    at: u32,
    fail_at: u32,
    policy: FailurePolicy,
    rollback_policy: FailurePolicy,
    /// Step 1 is the point of no return.
    irreversible: bool,
}

impl Flaky {
    fn new(policy: FailurePolicy) -> Self {
        Flaky {
            at: 0,
            fail_at: 2,
            policy,
            rollback_policy: FailurePolicy::Rollback,
            irreversible: false,
        }
    }
}

#[async_trait]
impl Procedure<World> for Flaky {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        self.at += 1;
        world.record(format!("exec {}", self.at));
        if self.at == 1 && self.irreversible {
            ctx.set_irreversible();
        }
        if self.at == self.fail_at {
            let left = world.step_failures.load(Ordering::SeqCst);
            if left > 0 {
                world.step_failures.store(left - 1, Ordering::SeqCst);
                return Err(ProcError::failed(format!("step {} failed", self.at)));
            }
        }
        Ok(if self.at < 3 {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        let world = ctx.env();
        let left = world.rollback_failures.load(Ordering::SeqCst);
        if left > 0 {
            world.rollback_failures.store(left - 1, Ordering::SeqCst);
            world.record(format!("rollback {} failed", self.at));
            return Err(ProcError::failed("rollback failed"));
        }
        if ctx.is_unrecorded_step() {
            // The step that failed, from the state before it.
            world.record(format!("undo {}", self.at + 1));
        } else {
            world.record(format!("rollback {}", self.at));
            self.at -= 1;
        }
        Ok(())
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        if error.to_string().starts_with("rollback") {
            self.rollback_policy
        } else {
            self.policy
        }
    }
}

/// Step 1 waits (for event `e`, or until `sleep_until_ms`); step 2 ends.
#[derive(Clone, Serialize, Deserialize)]
struct Waiter {
    at: u32,
    sleep_until_ms: Option<u64>,
}

#[async_trait]
impl Procedure<World> for Waiter {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        self.at += 1;
        ctx.env().record(format!("exec {}", self.at));
        Ok(match (self.at, self.sleep_until_ms) {
            (1, Some(at_ms)) => Flow::SleepUntil(at_ms),
            (1, None) => Flow::Suspend("e".into()),
            _ => Flow::Done,
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// Three steps; step 1 waits for the world's gate, then fails while the world says so,
/// under the `Pause` policy.
#[derive(Clone, Serialize, Deserialize)]
struct Gated {
    at: u32,
}

#[async_trait]
impl Procedure<World> for Gated {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        self.at += 1;
        world.record(format!("exec {}", self.at));
        if self.at == 1 && world.step_failures.load(Ordering::SeqCst) > 0 {
            world.entered.notify_one();
            world.gate.notified().await;
            world.step_failures.fetch_sub(1, Ordering::SeqCst);
            self.at -= 1;
            return Err(ProcError::failed("step 1 failed"));
        }
        Ok(if self.at < 3 {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        FailurePolicy::Pause
    }
}

/// Two steps; step 1 does what `first` says, step 2 ends. `timeout_ms` is its time
/// limit; with `wait_for_step_1` a deadline that passes before step 1 has run is
/// re-armed (so the timeout is sure to find step 1 done).
#[derive(Clone, Serialize, Deserialize)]
struct Timed {
    at: u32,
    first: First,
    timeout_ms: Option<u64>,
    wait_for_step_1: bool,
    /// Its deadline is re-armed until `TIME_OUT` is set; then it times out, and
    /// signals `TIMED_OUT`.
    time_out_when_told: bool,
    policy: FailurePolicy,
    /// An engine lock, exclusive.
    resource: Option<String>,
}

static TIME_OUT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static TIMED_OUT: tokio::sync::Notify = tokio::sync::Notify::const_new();

#[derive(Clone, Copy, Serialize, Deserialize)]
enum First {
    /// While the world has step failures: takes this many ms, then fails. After: waits
    /// for an event nobody wakes.
    SlowFailThenSuspend(u64),
    /// Signals `entered`, waits for the world's gate, then waits for an event nobody
    /// wakes.
    GatedSuspend,
    /// Marks the point of no return and waits for event `go`.
    IrreversibleSuspend,
    /// While the world has step failures: signals `entered`, waits for the world's
    /// gate, then fails. After: goes on.
    GatedFail,
}

impl Timed {
    fn new(first: First) -> Self {
        Timed {
            at: 0,
            first,
            timeout_ms: None,
            wait_for_step_1: false,
            time_out_when_told: false,
            policy: FailurePolicy::Rollback,
            resource: None,
        }
    }
}

#[async_trait]
impl Procedure<World> for Timed {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        self.at += 1;
        world.record(format!("exec {}", self.at));
        if self.at > 1 {
            return Ok(Flow::Done);
        }
        let never = Flow::Suspend("never".into());
        Ok(match self.first {
            First::SlowFailThenSuspend(ms) => {
                if world.step_failures.load(Ordering::SeqCst) > 0 {
                    world.step_failures.fetch_sub(1, Ordering::SeqCst);
                    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
                    return Err(ProcError::failed("slow step failed"));
                }
                never
            }
            First::GatedSuspend => {
                world.entered.notify_one();
                world.gate.notified().await;
                never
            }
            First::IrreversibleSuspend => {
                ctx.set_irreversible();
                Flow::Suspend("go".into())
            }
            First::GatedFail => {
                if world.step_failures.load(Ordering::SeqCst) > 0 {
                    world.entered.notify_one();
                    world.gate.notified().await;
                    world.step_failures.fetch_sub(1, Ordering::SeqCst);
                    return Err(ProcError::failed("step 1 failed"));
                }
                Flow::MoreToDo
            }
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        ctx.env().record(format!("rollback {}", self.at));
        Ok(())
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.timeout_ms
    }

    fn on_timeout(&mut self, _ctx: &Context<World>) -> OnTimeout {
        if self.wait_for_step_1 && self.at == 0 {
            OnTimeout::Rearm(20)
        } else if self.time_out_when_told {
            if TIME_OUT.load(Ordering::SeqCst) {
                TIMED_OUT.notify_one();
                OnTimeout::Fail
            } else {
                OnTimeout::Rearm(10)
            }
        } else {
            OnTimeout::Fail
        }
    }

    fn locks(&self) -> Vec<proctor::Lock> {
        self.resource.iter().map(proctor::Lock::exclusive).collect()
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        self.policy
    }
}

/// A state machine of three phases whose last fails its step; its rollback of a phase
/// fails while the world has rollback failures, by a panic or an error as `panics`
/// says. Each call is recorded.
#[derive(Clone, Serialize, Deserialize)]
struct Machine {
    panics: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Phase {
    Prepare,
    Write,
    Assign,
}

#[async_trait]
impl StateMachineProcedure<World> for Machine {
    type State = Phase;

    fn initial_state(&self) -> Phase {
        Phase::Prepare
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, Phase, World>,
        state: Phase,
    ) -> Result<Flow<World>, ProcError> {
        ctx.env().record(format!("exec {state:?}"));
        match state {
            Phase::Prepare => ctx.set_next_state(Phase::Write),
            Phase::Write => ctx.set_next_state(Phase::Assign),
            Phase::Assign => return Err(ProcError::failed("assign failed")),
        }
        Ok(Flow::MoreToDo)
    }

    async fn rollback_state(
        &mut self,
        ctx: &mut Context<World>,
        state: Phase,
    ) -> Result<(), ProcError> {
        let world = ctx.env();
        let fails = world
            .rollback_failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        match (fails, self.panics) {
            (false, _) => {
                world.record(format!("rollback {state:?}"));
                Ok(())
            }
            (true, true) => {
                world.record(format!("rollback {state:?} panicked"));
                panic!("cannot undo {state:?}");
            }
            (true, false) => {
                world.record(format!("rollback {state:?} failed"));
                Err(ProcError::failed(format!("cannot undo {state:?}")))
            }
        }
    }
}

async fn start(store: Box<dyn ProcedureStore>, world: Arc<World>) -> Executor<World> {
    start_with(store, world, |builder| builder).await
}

/// As [`start`], with the builder's options `options` sets.
async fn start_with(
    store: Box<dyn ProcedureStore>,
    world: Arc<World>,
    options: impl FnOnce(ExecutorBuilder<World>) -> ExecutorBuilder<World>,
) -> Executor<World> {
    let mut registry = Registry::new();
    registry
        .register::<Flaky>("flaky")
        .register::<Waiter>("waiter")
        .register::<Gated>("gated")
        .register::<Timed>("timed")
        .register::<Parent>("parent")
        .register_state_machine::<Machine>("machine");
    let builder = Executor::builder()
        .registry(registry)
        .store(store)
        .env(world);
    options(builder).start().await.expect("executor starts")
}

fn world(step_failures: u32, rollback_failures: u32) -> Arc<World> {
    let world = World::default();
    world.step_failures.store(step_failures, Ordering::SeqCst);
    world
        .rollback_failures
        .store(rollback_failures, Ordering::SeqCst);
    Arc::new(world)
}

fn retry_then_rollback(times: u32) -> FailurePolicy {
    FailurePolicy::RetryThenRollback {
        times,
        backoff_ms: 1,
    }
}

#[actix::test]
async fn a_retried_step_runs_again_until_it_succeeds_or_its_retries_run_out() {
    for name in common::STORES {
        // Two failures, three retries: it succeeds, and its retries are spent.
        let w = world(2, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let id = executor
            .submit(Flaky::new(retry_then_rollback(3)))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        let expected = ["exec 1", "exec 2", "exec 2", "exec 2", "exec 3"];
        assert_eq!(w.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();

        // Failing for ever: three attempts, then the last one is rolled back with the
        // steps before it, once each.
        let w = world(100, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let id = executor
            .submit(Flaky::new(retry_then_rollback(2)))
            .await
            .unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::failed("step 2 failed"), "{name}");
        let expected = [
            "exec 1",
            "exec 2",
            "exec 2",
            "exec 2",
            "rollback 2",
            "rollback 1",
        ];
        assert_eq!(w.calls(), expected, "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn retries_are_counted_across_a_restart() {
    for name in common::STORES {
        let store = Reopen::new(name);
        let policy = FailurePolicy::RetryThenPause {
            times: 3,
            backoff_ms: 300,
        };
        let w = world(100, 0);
        let executor = start(store.open(), w.clone()).await;
        let id = executor.submit(Flaky::new(policy)).await.unwrap();
        // The first failure is recorded with its retry; the engine stops meanwhile.
        wait_for_state(&executor, id, ProcState::WaitingTimeout).await;
        executor.shutdown_now().await.unwrap();

        let executor = start(store.open(), w.clone()).await;
        wait_for_state(&executor, id, ProcState::Paused).await;
        let info = executor.state(id).await.unwrap();
        let paused = info.steering.paused.expect("paused with a reason");
        assert_eq!(paused.retries, 3, "{name}");
        assert_eq!(paused.error, Some(ProcError::failed("step 2 failed")));
        assert_eq!(paused.policy, Some(policy));
        // One attempt and three retries in all, however they fell around the restart.
        let attempts = w.calls().iter().filter(|c| *c == "exec 2").count();
        assert_eq!(attempts, 4, "{name}: {:?}", w.calls());
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_paused_procedure_stays_paused_across_a_restart_and_continues() {
    for name in common::STORES {
        let store = Reopen::new(name);
        let w = world(1, 0);
        let executor = start(store.open(), w.clone()).await;
        let id = executor
            .submit(Flaky::new(FailurePolicy::Pause))
            .await
            .unwrap();
        wait_for_state(&executor, id, ProcState::Paused).await;
        let refused = executor.rollback(ProcId(id.0 + 100)).await;
        assert!(
            matches!(refused, Err(Error::UnknownProcedure(_))),
            "{refused:?}"
        );
        executor.shutdown().await.unwrap();

        let executor = start(store.open(), w.clone()).await;
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, ProcState::Paused, "{name}");
        assert!(
            info.steering.dirty,
            "{name}: the failed step may have left effects"
        );
        executor.resume(id).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        // The failed step ran again after the continue, from its recorded state.
        assert_eq!(
            w.calls(),
            ["exec 1", "exec 2", "exec 2", "exec 3"],
            "{name}"
        );
        let refused = executor.resume(id).await;
        assert!(
            matches!(refused, Err(Error::Finished { .. })),
            "{refused:?}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn an_operators_rollback_of_a_paused_procedure_undoes_the_failed_step_first() {
    for name in common::STORES {
        let w = world(100, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let id = executor
            .submit(Flaky::new(FailurePolicy::Pause))
            .await
            .unwrap();
        wait_for_state(&executor, id, ProcState::Paused).await;
        executor.rollback(id).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::Aborted, "{name}");
        assert_eq!(
            w.calls(),
            ["exec 1", "exec 2", "undo 2", "rollback 1"],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

/// `Rollback` of a RUNNING procedure: its step is cancelled, the answer comes once the
/// failure is durable, and its steps are rolled back; a second one is refused
/// (the tree is already rolling back), and so is one of the finished procedure.
#[actix::test]
async fn an_operators_rollback_of_a_running_procedure_cancels_its_step() {
    use common::{Scripted, Step};
    for name in common::STORES {
        let (executor, rec) = common::start(Reopen::new(name).open(), 2).await;
        let plan = vec![Step::More, Step::UntilCancelled, Step::More];
        let id = executor.submit(Scripted::new("p", plan)).await.unwrap();
        rec.signal.notified().await; // step 2 runs, until cancelled
        assert_eq!(executor.state(id).await.unwrap().state, ProcState::Runnable);
        executor.rollback(id).await.expect("rolled back");
        let refused = executor.rollback(id).await;
        assert!(
            matches!(
                &refused,
                Err(Error::Refused { .. } | Error::Finished { .. })
            ),
            "{name}: {refused:?}"
        );
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::Aborted, "{name}");
        // The cancelled step may have left effects: it is undone (unrecorded) before
        // the recorded step 1.
        assert_eq!(
            rec.calls(),
            [
                "p-exec",
                "p-exec",
                "p-cancelled",
                "p-rollback",
                "p-rollback"
            ],
            "{name}"
        );
        let refused = executor.rollback(id).await.unwrap_err();
        assert!(
            matches!(refused, Error::Finished { .. }),
            "{name}: {refused}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_rollback_that_gives_up_is_rollback_paused_until_continued() {
    for name in common::STORES {
        let store = Reopen::new(name);
        let w = world(100, 100);
        let executor = start(store.open(), w.clone()).await;
        let mut proc = Flaky::new(FailurePolicy::Rollback);
        proc.rollback_policy = FailurePolicy::RetryThenPause {
            times: 1,
            backoff_ms: 1,
        };
        let id = executor.submit(proc).await.unwrap();
        wait_for_state(&executor, id, ProcState::RollbackPaused).await;
        // Still waiting for an operator after a restart: recovery does not retry it.
        executor.shutdown().await.unwrap();
        let executor = start(store.open(), w.clone()).await;
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, ProcState::RollbackPaused, "{name}");
        let why = info.steering.paused.expect("a reason");
        assert_eq!(
            why.error,
            Some(ProcError::failed("rollback failed")),
            "{name}"
        );
        assert_eq!(why.retries, 1, "{name}");
        let refused = executor.rollback(id).await.unwrap_err();
        assert!(
            refused.to_string().contains("continue it instead"),
            "{refused}"
        );
        w.rollback_failures.store(0, Ordering::SeqCst);
        executor.resume(id).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::failed("step 2 failed"), "{name}");
        assert_eq!(
            w.calls(),
            [
                "exec 1",
                "exec 2",
                "rollback 2 failed",
                "rollback 2 failed",
                "rollback 2",
                "rollback 1"
            ],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

/// A rollback that fails (a panic, or an error) and is retried undoes the same step
/// again, from the state recorded before it: each phase is undone once it succeeds,
/// in reverse, and none is passed over.
#[actix::test]
async fn a_rollback_that_fails_twice_then_succeeds_undoes_each_step_once() {
    for name in common::STORES {
        for panics in [true, false] {
            let w = world(0, 2);
            let executor = start(Reopen::new(name).open(), w.clone()).await;
            let id = executor
                .submit(StateMachine::new(Machine { panics }))
                .await
                .unwrap();
            let failure = executor.wait(id).await.unwrap().unwrap_err();
            assert_eq!(failure.error, ProcError::failed("assign failed"), "{name}");
            let state = executor.state(id).await.unwrap().state;
            assert_eq!(state, ProcState::RolledBack, "{name}");
            let failed = if panics { "panicked" } else { "failed" };
            assert_eq!(
                w.calls(),
                [
                    "exec Prepare",
                    "exec Write",
                    "exec Assign",
                    &format!("rollback Assign {failed}"),
                    &format!("rollback Assign {failed}"),
                    "rollback Assign",
                    "rollback Write",
                    "rollback Prepare",
                ],
                "{name}, panics: {panics}"
            );
            executor.shutdown().await.unwrap();
        }
    }
}

/// A rollback that fails on every call (a panic, or an error) under the default policy
/// is retried up to the executor's limit, then paused for an operator with its error
/// in the procedure's info: never taken as done. Continued once it can succeed, it
/// undoes every step.
#[actix::test]
async fn a_rollback_that_fails_every_time_is_rollback_paused_past_the_limit() {
    for name in common::STORES {
        for panics in [true, false] {
            let w = world(0, u32::MAX);
            let store = Reopen::new(name).open();
            let executor = start_with(store, w.clone(), |b| b.rollback_retries(3)).await;
            let mut events = executor.subscribe().await.unwrap();
            let id = executor
                .submit(StateMachine::new(Machine { panics }))
                .await
                .unwrap();
            let (state, why) = loop {
                match events.next().await.expect("an event") {
                    ProcEvent::Paused {
                        id: p, state, why, ..
                    } if p == id => break (state, why),
                    ProcEvent::Finished { result, .. } => {
                        panic!("{name}: finished {result:?}, never paused")
                    }
                    _ => {}
                }
            };
            assert_eq!(state, ProcState::RollbackPaused, "{name}");
            let error = if panics {
                ProcError::Panicked {
                    hook: "rollback".into(),
                    message: "cannot undo Assign".into(),
                }
            } else {
                ProcError::failed("cannot undo Assign")
            };
            // What an operator reads: its state, and why it paused.
            let info = executor.state(id).await.unwrap();
            assert_eq!(info.state, ProcState::RollbackPaused, "{name}");
            assert_eq!(info.steering.paused.as_deref(), Some(&why), "{name}");
            assert_eq!(why.error, Some(error), "{name}");
            assert_eq!(why.policy, Some(FailurePolicy::Rollback), "{name}");
            assert_eq!(why.retries, 3, "{name}");
            // The first call and three retries, all of the step that failed.
            let failed = if panics { "panicked" } else { "failed" };
            let undo = format!("rollback Assign {failed}");
            let mut expected = vec!["exec Prepare", "exec Write", "exec Assign"];
            expected.extend([undo.as_str(); 4]);
            assert_eq!(w.calls(), expected, "{name}, panics: {panics}");

            w.rollback_failures.store(0, Ordering::SeqCst);
            executor.resume(id).await.unwrap();
            let failure = executor.wait(id).await.unwrap().unwrap_err();
            assert_eq!(failure.error, ProcError::failed("assign failed"), "{name}");
            let state = executor.state(id).await.unwrap().state;
            assert_eq!(state, ProcState::RolledBack, "{name}");
            expected.extend(["rollback Assign", "rollback Write", "rollback Prepare"]);
            assert_eq!(w.calls(), expected, "{name}, panics: {panics}");
            executor.shutdown().await.unwrap();
        }
    }
}

#[actix::test]
async fn past_the_point_of_no_return_a_failure_pauses_and_only_continue_is_allowed() {
    for name in common::STORES {
        let w = world(1, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let mut events = executor.subscribe().await.unwrap();
        let mut proc = Flaky::new(FailurePolicy::Rollback);
        proc.irreversible = true;
        let id = executor.submit(proc).await.unwrap();
        // Subscribers hear of the pause, with its reason, once it is durable.
        let paused = loop {
            match events.next().await.expect("an event") {
                ProcEvent::Paused {
                    id: p,
                    root,
                    state,
                    why,
                } => break (p, root, state, why),
                ProcEvent::Finished { .. } => panic!("{name}: finished, never paused"),
                _ => {}
            }
        };
        assert_eq!((paused.0, paused.1, paused.2), (id, id, ProcState::Paused));
        let error = paused.3.error.expect("the failure that paused it");
        assert!(
            error.to_string().contains("step 2 failed"),
            "{name}: {error}"
        );
        assert_eq!(executor.state(id).await.unwrap().state, ProcState::Paused);
        assert!(executor.state(id).await.unwrap().steering.irreversible);
        for refused in [
            executor.rollback(id).await.unwrap_err(),
            executor.abort(id).await.unwrap_err(),
        ] {
            assert!(
                matches!(&refused, Error::Refused { reason, .. } if reason.contains("continue instead")),
                "{name}: {refused}"
            );
        }
        executor.resume(id).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(
            w.calls(),
            ["exec 1", "exec 2", "exec 2", "exec 3"],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn an_operator_pauses_a_running_procedure_at_its_next_step_and_continues_it() {
    use common::{Scripted, Step};
    for name in common::STORES {
        let store = Reopen::new(name);
        let (executor, rec) = common::start(store.open(), 2).await;
        let plan = vec![Step::Hold, Step::More, Step::More];
        let id = executor.submit(Scripted::new("p", plan)).await.unwrap();
        rec.signal.notified().await; // step 1 runs
        let pausing = {
            let executor = executor.clone();
            actix::spawn(async move { executor.pause(id).await })
        };
        // Answered only once in effect: let the running step end.
        rec.gate.notify_one();
        pausing.await.unwrap().expect("paused");
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, ProcState::Paused, "{name}");
        let why = info.steering.paused.expect("a reason");
        assert_eq!(
            (why.error, why.policy),
            (None, None),
            "{name}: an operator's"
        );
        let again = executor.pause(id).await.unwrap_err();
        assert!(matches!(again, Error::Refused { .. }), "{name}: {again}");
        let ran = rec.count("p-exec");
        assert!(
            (1..3).contains(&ran),
            "{name}: it stopped at a step boundary"
        );
        executor.shutdown().await.unwrap();

        // Paused across a restart, then continued: every step runs exactly once.
        let (executor, rec2) = common::start(store.open(), 2).await;
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::Paused,
            "{name}"
        );
        executor.resume(id).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(ran + rec2.count("p-exec"), 3, "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// A procedure waiting for an event or a timer has no step to stop at soon: a pause
/// takes effect at once, and the event no longer wakes it. A continue puts the sleeper
/// back to waiting for its time; after a restart, the one that waited for the event
/// runs its next step (which re-checks), as every recovered suspended procedure does by
/// default: the wake it missed while paused is in no log.
#[actix::test]
async fn a_waiting_procedure_pauses_at_once_and_waits_again_when_continued() {
    let in_an_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
        + 3_600_000;
    for name in common::STORES {
        let store = Reopen::new(name);
        let w = world(0, 0);
        let executor = start(store.open(), w.clone()).await;
        let on_event = executor
            .submit(Waiter {
                at: 0,
                sleep_until_ms: None,
            })
            .await
            .unwrap();
        let sleeping = executor
            .submit(Waiter {
                at: 0,
                sleep_until_ms: Some(in_an_hour),
            })
            .await
            .unwrap();
        wait_for_state(&executor, on_event, ProcState::Waiting).await;
        wait_for_state(&executor, sleeping, ProcState::WaitingTimeout).await;
        for id in [on_event, sleeping] {
            // Answered without waiting for the event or the hour.
            let paused =
                tokio::time::timeout(std::time::Duration::from_secs(30), executor.pause(id)).await;
            assert!(matches!(paused, Ok(Ok(()))), "{name}: {paused:?}");
            assert_eq!(
                executor.state(id).await.unwrap().state,
                ProcState::Paused,
                "{name}"
            );
        }
        // The event comes while it is paused: nothing runs.
        executor.wake_event("e").await.unwrap();
        assert_eq!(
            executor.state(on_event).await.unwrap().state,
            ProcState::Paused,
            "{name}"
        );
        assert_eq!(w.calls(), ["exec 1", "exec 1"], "{name}");
        executor.shutdown().await.unwrap();

        let executor = start(store.open(), w.clone()).await;
        for id in [on_event, sleeping] {
            assert_eq!(
                executor.state(id).await.unwrap().state,
                ProcState::Paused,
                "{name}"
            );
            executor.resume(id).await.unwrap();
        }
        // The sleeper waits for its hour again; the other runs its next step.
        assert_eq!(
            executor.state(sleeping).await.unwrap().state,
            ProcState::WaitingTimeout,
            "{name}"
        );
        assert_eq!(executor.wait(on_event).await.unwrap(), Ok(()), "{name}");
        assert_eq!(w.calls(), ["exec 1", "exec 1", "exec 2"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// An operator's pause asked while a step runs is answered when the step's failure
/// pauses the procedure instead; it must not pause the procedure again after the
/// continue (the pause asked for is spent).
#[actix::test]
async fn a_pause_answered_by_a_failure_policy_is_spent() {
    for name in common::STORES {
        let w = world(1, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let id = executor.submit(Gated { at: 0 }).await.unwrap();
        w.entered.notified().await;
        let pausing = {
            let executor = executor.clone();
            actix::spawn(async move { executor.pause(id).await })
        };
        // The pause reaches the root stack before the step ends: a command sent after
        // it (a continue, refused while the procedure runs) is answered after it. The
        // first continue is sent before the spawned pause runs, the second after.
        for _ in 0..2 {
            let refused = executor.resume(id).await.unwrap_err();
            assert!(
                matches!(refused, Error::Refused { .. }),
                "{name}: {refused}"
            );
        }
        w.gate.notify_one();
        pausing.await.unwrap().expect("paused by the failure");
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, ProcState::Paused, "{name}");
        executor.resume(id).await.unwrap();
        let done = result_of(&executor, id, name).await;
        assert_eq!(
            done,
            Ok(()),
            "{name}: paused again after the continue: {:?}",
            executor.state(id).await.map(|i| i.state)
        );
        assert_eq!(
            w.calls(),
            ["exec 1", "exec 1", "exec 2", "exec 3"],
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

/// Past the point of no return a timeout pauses the procedure instead of failing it.
/// Paused, its event does not wake it; continued, it waits for the event again (as
/// after an operator's pause), and the event, still ready, lets it run its next step
/// and end: the failure the timeout asked for must not stay with it.
#[actix::test]
async fn a_procedure_a_timeout_paused_past_the_point_of_no_return_runs_when_continued() {
    for name in common::STORES {
        let w = world(0, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let mut proc = Timed::new(First::IrreversibleSuspend);
        proc.timeout_ms = Some(30);
        proc.wait_for_step_1 = true;
        let id = executor.submit(proc).await.unwrap();
        wait_for_state(&executor, id, ProcState::Paused).await;
        let why = executor.state(id).await.unwrap().steering.paused.unwrap();
        assert!(
            matches!(why.error, Some(ProcError::TimedOut { .. })),
            "{name}: {why:?}"
        );
        executor.wake_event("go").await.unwrap();
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::Paused,
            "{name}"
        );
        assert_eq!(w.calls(), ["exec 1"], "{name}: ran while paused");
        executor.resume(id).await.unwrap();
        let done = result_of(&executor, id, name).await;
        assert_eq!(
            done,
            Ok(()),
            "{name}: {:?}",
            executor.state(id).await.map(|i| i.state)
        );
        assert_eq!(w.calls(), ["exec 1", "exec 2"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// A deadline that passes while a step runs is handled when the step ends; when that
/// step fails and its policy retries it, the timeout still comes, after the retry is
/// set up (here it ends the retries, which wait for an event nobody wakes).
#[actix::test]
async fn a_deadline_passed_during_a_failing_step_still_times_out_its_retries() {
    for name in common::STORES {
        let w = world(1, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let mut proc = Timed::new(First::SlowFailThenSuspend(300));
        proc.timeout_ms = Some(100);
        proc.policy = FailurePolicy::RetryThenPause {
            times: 3,
            backoff_ms: 1,
        };
        let id = executor.submit(proc).await.unwrap();
        let done = result_of(&executor, id, name).await;
        let failure = done.unwrap_err();
        assert!(
            matches!(failure.error, ProcError::TimedOut { timeout_ms: 100 }),
            "{name}: {failure:?}"
        );
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack,
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

/// An operator's pause that arrives while a step runs takes effect at the step's end;
/// when the step then waits for an event (or a timer), there is no next step to stop
/// at soon, so it pauses at once, as a pause of a waiting procedure does.
#[actix::test]
async fn a_pause_asked_during_a_step_that_then_waits_takes_effect_at_once() {
    for name in common::STORES {
        let w = world(0, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let id = executor
            .submit(Timed::new(First::GatedSuspend))
            .await
            .unwrap();
        let pause = {
            let executor = executor.clone();
            async move { executor.pause(id).await }
        };
        let paused = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            during_gated_step(&executor, &w, id, pause),
        )
        .await
        .unwrap_or_else(|_| panic!("{name}: the pause was never answered"));
        assert!(matches!(paused, Ok(())), "{name}: {paused:?}");
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::Paused,
            "{name}"
        );
        // Continued, it waits for its event again.
        executor.resume(id).await.unwrap();
        wait_for_state(&executor, id, ProcState::Waiting).await;
        executor.wake_event("never").await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(w.calls(), ["exec 1", "exec 2"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// Past the point of no return, a timeout that finds the procedure with its step
/// queued behind another tree's lock pauses it when that step comes (skipped): it
/// does not run the step, and it is not paused with a step still out. Continued, it
/// runs the step and ends.
#[actix::test]
async fn a_timeout_past_the_point_of_no_return_pauses_a_procedure_waiting_for_its_locks() {
    for name in common::STORES {
        TIME_OUT.store(false, Ordering::SeqCst);
        let w = world(0, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let mut waiter = Timed::new(First::IrreversibleSuspend);
        waiter.timeout_ms = Some(10);
        waiter.time_out_when_told = true;
        waiter.resource = Some("r".into());
        let id = executor.submit(waiter).await.unwrap();
        wait_for_state(&executor, id, ProcState::Waiting).await;
        let mut holder = Timed::new(First::GatedSuspend);
        holder.resource = Some("r".into());
        let holder = executor.submit(holder).await.unwrap();
        w.entered.notified().await;
        // Woken, its step 2 waits for `r`, which the holder's step holds.
        executor.wake_event("go").await.unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while executor.state(id).await.unwrap().locks_waiting.is_empty() {
            assert!(std::time::Instant::now() < deadline, "never waited for r");
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        TIME_OUT.store(true, Ordering::SeqCst);
        // The root stack handles the timeout's failure in the same turn as the hook.
        TIMED_OUT.notified().await;
        // Its step stops waiting for `r` and comes back skipped: it pauses while the
        // holder still holds `r` (one that never let go kept it RUNNABLE before).
        wait_for_state(&executor, id, ProcState::Paused).await;
        assert!(
            executor.state(id).await.unwrap().locks_waiting.is_empty(),
            "{name}"
        );
        assert_eq!(
            executor.state(holder).await.unwrap().state,
            ProcState::Runnable,
            "{name}: the holder is still in its step"
        );
        w.gate.notify_one();
        // Once the holder has left its step: nothing queued, running or waiting for a
        // lock.
        loop {
            let stats = executor.scheduler_stats().await.unwrap();
            let quiet = stats.running == 0 && stats.queued == 0 && stats.lock_waiters == 0;
            let holder_done = executor.state(holder).await.unwrap().state == ProcState::Waiting;
            if quiet
                && holder_done
                && executor.state(id).await.unwrap().state != ProcState::Runnable
            {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "never quiet: {stats:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        assert_eq!(executor.state(id).await.unwrap().state, ProcState::Paused);
        let why = executor.state(id).await.unwrap().steering.paused.unwrap();
        assert!(
            matches!(why.error, Some(ProcError::TimedOut { .. })),
            "{why:?}"
        );
        assert_eq!(w.calls(), ["exec 1", "exec 1"], "step 2 did not run");
        executor.resume(id).await.unwrap();
        assert_eq!(result_of(&executor, id, name).await, Ok(()), "{name}");
        assert_eq!(w.calls(), ["exec 1", "exec 1", "exec 2"]);
        assert_eq!(
            executor.state(holder).await.unwrap().state,
            ProcState::Waiting
        );
        executor.shutdown().await.unwrap();
    }
}

/// An abort that reaches a procedure while its step runs is settled when the step
/// ends. When that step fails and its policy retries it (or pauses it), the procedure
/// is not failing yet: the abort must not be answered as accepted and then lost to a
/// retry that succeeds (seen: "the abort was accepted, but: Ok(())"). It waits for the
/// decision, and then aborts the procedure (a paused one too), whose rollback undoes
/// the failed step from the state recorded before it.
#[actix::test]
async fn an_abort_during_a_step_that_fails_waits_for_its_policy_then_aborts() {
    for policy in [retry_then_rollback(3), FailurePolicy::Pause] {
        for name in common::STORES {
            let w = world(1, 0);
            let executor = start(Reopen::new(name).open(), w.clone()).await;
            let mut proc = Timed::new(First::GatedFail);
            proc.policy = policy;
            let id = executor.submit(proc).await.unwrap();
            let abort = {
                let executor = executor.clone();
                async move { executor.abort(id).await }
            };
            let answer = during_gated_step(&executor, &w, id, abort).await;
            assert!(matches!(answer, Ok(true)), "{name} {policy:?}: {answer:?}");
            let done = result_of(&executor, id, &format!("{name} {policy:?}")).await;
            assert!(
                matches!(&done, Err(f) if f.error == ProcError::Aborted),
                "{name} {policy:?}: the abort was accepted, but: {done:?}"
            );
            assert_eq!(
                executor.state(id).await.unwrap().state,
                ProcState::RolledBack,
                "{name} {policy:?}"
            );
            assert_eq!(w.calls(), ["exec 1", "rollback 0"], "{name} {policy:?}");
            executor.shutdown().await.unwrap();
        }
    }
}

/// `id`'s result, waited for at most 30 s: a hang is the failure, reported with
/// `what` and the state `id` was stuck in.
async fn result_of(
    executor: &Executor<World>,
    id: ProcId,
    what: &str,
) -> Result<(), proctor::Failure> {
    match tokio::time::timeout(std::time::Duration::from_secs(30), executor.wait(id)).await {
        Ok(result) => result.unwrap(),
        Err(_) => panic!(
            "{what}: {id} never ended ({:?})",
            executor.state(id).await.map(|i| i.state)
        ),
    }
}

/// Sends `command` to the tree of `id` while its gated step runs (once the step has
/// signalled `entered`), makes sure the tree has it before the step ends, then opens
/// the gate; gives the command's answer.
async fn during_gated_step<T: 'static>(
    executor: &Executor<World>,
    w: &World,
    id: ProcId,
    command: impl std::future::Future<Output = T> + 'static,
) -> T {
    w.entered.notified().await;
    let sent = actix::spawn(command);
    // A command sent after it is answered after it (a continue, refused while the step
    // runs). The first continue is sent before the spawned command runs, the second
    // after.
    for _ in 0..2 {
        let refused = executor.resume(id).await.unwrap_err();
        assert!(matches!(refused, Error::Refused { .. }), "{refused}");
    }
    w.gate.notify_one();
    sent.await.unwrap()
}

/// Step 1 starts its child; step 2 ends.
#[derive(Clone, Serialize, Deserialize)]
struct Parent {
    child: Option<Flaky>,
}

#[async_trait]
impl Procedure<World> for Parent {
    async fn execute(&mut self, _ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        Ok(match self.child.take() {
            Some(child) => Flow::Children(vec![Box::new(child)]),
            None => Flow::Done,
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// A step that fails under a retrying policy leaves its failed attempt's state in the
/// procedure until the retry's record is durable and it is reset to the recorded
/// state. An operator's pause in that window (the procedure already waits for its
/// retry) must record the recorded state, not the failed attempt's: continued after
/// a restart, the retry runs the failed step again, not the step after it. (Seen in
/// the perturbation test: a tree SUCCESS without the children of its failed step.)
#[actix::test]
async fn a_pause_while_a_retry_is_being_recorded_keeps_the_recorded_state() {
    for name in common::STORES {
        let w = world(1, 0);
        // Appends: 1 the parent's insert, 2 its step and the child's insert, 3 the
        // child's step 1, 4 the retry of its step 2.
        let reopen = Reopen::new(name);
        let (store, mut gate) = common::GatedStore::new(reopen.open(), 4);
        let executor = start(Box::new(store), w.clone()).await;
        let parent = Parent {
            child: Some(Flaky::new(retry_then_rollback(3))),
        };
        let root = executor.submit(parent).await.unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(30), gate.reached())
            .await
            .expect("append 4");
        let child = executor
            .list(proctor::List::new())
            .await
            .unwrap()
            .into_iter()
            .find(|p| p.parent == Some(root))
            .expect("the child")
            .id;
        let pausing = {
            let executor = executor.clone();
            actix::spawn(async move { executor.pause(child).await })
        };
        // The pause has reached the tree once a command sent after it is answered (a
        // continue of the parent, refused: it waits for its child). The first is sent
        // before the spawned pause runs, the second after.
        for _ in 0..2 {
            let refused = executor.resume(root).await.unwrap_err();
            assert!(
                matches!(refused, Error::Refused { .. }),
                "{name}: {refused}"
            );
        }
        gate.release();
        pausing.await.unwrap().expect("paused");
        // The record is what counts: continued after a restart, it goes on from it.
        executor.shutdown().await.unwrap();
        let executor = start(reopen.open(), w.clone()).await;
        assert_eq!(
            executor.state(child).await.unwrap().state,
            ProcState::Paused
        );
        executor.resume(child).await.unwrap();
        assert_eq!(result_of(&executor, root, name).await, Ok(()), "{name}");
        assert_eq!(
            w.calls(),
            ["exec 1", "exec 2", "exec 2", "exec 3"],
            "{name}: the failed step ran again"
        );
        executor.shutdown().await.unwrap();
    }
}

/// The abort of a procedure whose failing step is running waits for the step's fate;
/// once that fails the tree, it is answered then, not when the procedure's own rollback
/// starts, which may wait (here for its lock, which another tree took in between).
#[actix::test]
async fn an_abort_that_waited_for_a_failing_step_is_answered_when_the_tree_fails() {
    for name in common::STORES {
        let w = world(1, 0);
        let executor = start(Reopen::new(name).open(), w.clone()).await;
        let mut failing = Timed::new(First::GatedFail);
        failing.resource = Some("x".into());
        let id = executor.submit(failing).await.unwrap();
        // Waits for `x` while the failing step holds it; takes it once that step is
        // over, and holds it at the gate.
        let mut holder = Timed::new(First::GatedSuspend);
        holder.resource = Some("x".into());
        let holder = executor.submit(holder).await.unwrap();
        let abort = {
            let executor = executor.clone();
            async move { executor.abort(id).await }
        };
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            during_gated_step(&executor, &w, id, abort),
        )
        .await
        .unwrap_or_else(|_| panic!("{name}: the abort waited for the rollback"));
        assert!(matches!(answer, Ok(true)), "{name}: {answer:?}");
        // The holder's step runs at the gate; let it go, and the rollback follows.
        w.entered.notified().await;
        w.gate.notify_one();
        let done = executor.wait(id).await.unwrap();
        assert!(
            matches!(&done, Err(f) if f.error == ProcError::Failed("step 1 failed".into())),
            "{name}: {done:?}"
        );
        wait_for_state(&executor, holder, ProcState::Waiting).await;
        executor.shutdown().await.unwrap();
    }
}
