//! The optional hooks as the engine calls them: lock acquire/release around steps, a
//! procedure timeout, completion cleanup, the recovery hooks, each with the
//! procedure's context, and the environment.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proctor::{
    async_trait, Context, Error, Executor, Flow, Lock, LockState, MemoryStore, OnTimeout,
    ProcError, ProcState, Procedure, Registry,
};
use serde::{Deserialize, Serialize};

/// The calls around steps, a count of busy locks to answer, the calls of the hooks
/// that get a context (each with the id it was given), and a signal of cleanups.
#[derive(Default)]
struct Log(
    Mutex<Vec<String>>,
    AtomicU32,
    Mutex<Vec<String>>,
    tokio::sync::Notify,
);

impl Log {
    fn hook(&self, ctx: &Context<Log>, hook: &str) {
        let entry = format!("{hook} {}", ctx.id());
        self.2.lock().unwrap().push(entry);
    }
    fn hooks(&self) -> Vec<String> {
        self.2.lock().unwrap().clone()
    }
    fn push(&self, s: impl Into<String>) {
        self.0.lock().unwrap().push(s.into());
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

#[derive(Serialize, Deserialize)]
struct Hooked {
    steps: u32,
    busy_locks: u32,
    hold: bool,
    timeout_ms: Option<u64>,
    sleep_forever: bool,
    /// Tell the test when completion cleanup runs.
    signal_cleanup: bool,
    /// The last step fails, and the next `n` `acquire_lock`s (its rollback's) yield.
    fail_then_busy: Option<u32>,
    /// An engine lock beside the hooks.
    resource: Option<String>,
}

fn log(ctx: &Context<Log>, entry: &str) {
    ctx.env().push(entry);
}

impl Hooked {
    fn new(steps: u32) -> Self {
        Hooked {
            steps,
            busy_locks: 0,
            hold: false,
            timeout_ms: None,
            sleep_forever: false,
            signal_cleanup: false,
            fail_then_busy: None,
            resource: None,
        }
    }
}

#[async_trait]
impl Procedure<Log> for Hooked {
    async fn execute(&mut self, ctx: &mut Context<Log>) -> Result<Flow<Log>, ProcError> {
        ctx.env().push("execute");
        if self.sleep_forever {
            return Ok(Flow::SleepUntil(ctx.now_ms() + 3_600_000));
        }
        self.steps -= 1;
        if let (0, Some(busy)) = (self.steps, self.fail_then_busy) {
            ctx.env().1.store(busy, Ordering::SeqCst);
            return Err(ProcError::failed("the last step fails"));
        }
        Ok(if self.steps > 0 {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<Log>) -> Result<(), ProcError> {
        log(ctx, "rollback");
        Ok(())
    }

    fn acquire_lock(&mut self, ctx: &Context<Log>) -> LockState {
        let env_busy = ctx
            .env()
            .1
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if self.busy_locks > 0 || env_busy.is_ok() {
            self.busy_locks = self.busy_locks.saturating_sub(1);
            log(ctx, "lock busy");
            return LockState::Yield;
        }
        log(ctx, "lock");
        LockState::Acquired
    }

    fn release_lock(&mut self, ctx: &Context<Log>) {
        log(ctx, "unlock");
    }

    fn holds_lock(&self) -> bool {
        self.hold
    }

    fn locks(&self) -> Vec<Lock> {
        self.resource.iter().map(Lock::exclusive).collect()
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.timeout_ms
    }

    fn completion_cleanup(&mut self, ctx: &Context<Log>) {
        ctx.env().hook(ctx, "cleanup");
        if self.signal_cleanup {
            ctx.env().3.notify_one();
        }
    }

    fn abort(&mut self, ctx: &Context<Log>) -> bool {
        ctx.env().hook(ctx, "abort");
        true
    }

    fn on_timeout(&mut self, ctx: &Context<Log>) -> OnTimeout {
        ctx.env().hook(ctx, "timeout");
        OnTimeout::Fail
    }

    fn before_recover(&mut self, ctx: &Context<Log>) {
        ctx.env().hook(ctx, "before_recover");
    }

    fn after_recover(&mut self, ctx: &Context<Log>) {
        ctx.env().hook(ctx, "after_recover");
    }
}

async fn start() -> (Executor<Log>, Arc<Log>) {
    let mut registry = Registry::new();
    registry.register::<Hooked>("hooked");
    let log = Arc::new(Log::default());
    let executor = Executor::builder()
        .registry(registry)
        .store(MemoryStore::new())
        .env(log.clone())
        .start()
        .await
        .unwrap();
    (executor, log)
}

#[actix::test]
async fn locks_are_taken_around_each_step_and_a_busy_lock_requeues() {
    let (executor, log) = start().await;
    let mut proc = Hooked::new(2);
    proc.busy_locks = 2;
    let id = executor.submit(proc).await.unwrap();
    assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    assert_eq!(
        log.take(),
        [
            "lock busy",
            "lock busy",
            "lock",
            "execute",
            "unlock",
            "lock",
            "execute",
            "unlock"
        ]
    );
}

/// A rollback whose hook lock is busy is retried (the engine's own trouble) under the
/// engine's locks as well: each try gives the engine's locks back, or the retry would
/// wait for them for ever.
#[actix::test]
async fn a_rollback_whose_lock_is_busy_is_retried_beside_engine_locks() {
    let (executor, log) = start().await;
    for resource in [None, Some("t1".to_string())] {
        let mut proc = Hooked::new(2);
        proc.fail_then_busy = Some(2);
        proc.resource = resource.clone();
        let id = executor.submit(proc).await.unwrap();
        let failure = tokio::time::timeout(Duration::from_secs(30), executor.wait(id))
            .await
            .unwrap_or_else(|_| panic!("{resource:?}: the rollback never ran"))
            .unwrap()
            .unwrap_err();
        assert_eq!(failure.error, ProcError::failed("the last step fails"));
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack
        );
        assert_eq!(
            log.take(),
            [
                "lock",
                "execute",
                "unlock",
                "lock",
                "execute",
                "unlock",
                "lock busy",
                "lock busy",
                "lock",
                "rollback",
                "unlock",
                "lock",
                "rollback",
                "unlock"
            ],
            "{resource:?}"
        );
    }
}

#[actix::test]
async fn a_held_lock_is_taken_once_and_released_at_the_end() {
    let (executor, log) = start().await;
    let mut proc = Hooked::new(3);
    proc.hold = true;
    let id = executor.submit(proc).await.unwrap();
    assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    assert_eq!(
        log.take(),
        ["lock", "execute", "execute", "execute", "unlock"]
    );
}

#[actix::test]
async fn an_expired_timeout_fails_and_rolls_back() {
    let (executor, log) = start().await;
    let mut proc = Hooked::new(1);
    proc.timeout_ms = Some(20);
    proc.sleep_forever = true;
    let id = executor.submit(proc).await.unwrap();
    let failure = executor.wait(id).await.unwrap().unwrap_err();
    assert_eq!(failure.error, ProcError::TimedOut { timeout_ms: 20 });
    assert_eq!(
        executor.state(id).await.unwrap().state,
        ProcState::RolledBack
    );
    assert_eq!(
        log.take(),
        ["lock", "execute", "unlock", "lock", "rollback", "unlock"]
    );
}

#[actix::test]
async fn a_missing_environment_is_refused_at_start() {
    let mut registry = Registry::new();
    registry.register::<Hooked>("hooked");
    let err = Executor::builder()
        .registry(registry)
        .start()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(
        err.to_string()
            .contains("need an environment of type hooks::Log"),
        "{err}"
    );
}

#[actix::test]
async fn an_environment_given_by_value_or_shared_is_the_same_type() {
    // `env` takes an `E` or an `Arc<E>`: the slip of giving one and asking for the
    // other cannot happen any more.
    for shared in [false, true] {
        let mut registry = Registry::new();
        registry.register::<Hooked>("hooked");
        let log = Arc::new(Log::default());
        let builder = Executor::builder()
            .registry(registry)
            .store(MemoryStore::new());
        let builder = if shared {
            builder.env(log.clone())
        } else {
            builder.env(Log::default())
        };
        let executor = builder.start().await.unwrap();
        let id = executor.submit(Hooked::new(1)).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        if shared {
            assert_eq!(log.take(), ["lock", "execute", "unlock"]);
        }
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn an_unregistered_type_is_refused_at_submit() {
    let (executor, _log) = start().await;
    let err = executor.submit(common::Noop).await.unwrap_err();
    assert!(matches!(err, Error::Registry(_)));
    assert!(
        err.to_string().contains("common::Noop is not registered"),
        "{err}"
    );
}

#[actix::test]
async fn completion_cleanup_runs_once_finished() {
    let (executor, log) = start().await;
    let mut proc = Hooked::new(1);
    proc.signal_cleanup = true;
    let id = executor.submit(proc).await.unwrap();
    assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    // The cleanup runs when the actor stops, which may be just after the result.
    tokio::time::timeout(Duration::from_secs(10), log.3.notified())
        .await
        .expect("completion_cleanup ran");
    assert_eq!(log.hooks(), [format!("cleanup {id}")]);
}

/// An executor of `Hooked` procedures on `store` (again, after a stop), with `log`.
async fn start_on(store: &common::Reopen, log: &Arc<Log>) -> Executor<Log> {
    let mut registry = Registry::new();
    registry.register::<Hooked>("hooked");
    Executor::builder()
        .registry(registry)
        .store(store.open())
        .env(log.clone())
        .start()
        .await
        .unwrap()
}

/// Submits a procedure that sleeps for an hour, once it sleeps.
async fn submit_sleeper(executor: &Executor<Log>) -> proctor::ProcId {
    let mut sleeper = Hooked::new(1);
    sleeper.sleep_forever = true;
    let id = executor.submit(sleeper).await.unwrap();
    common::wait_for_state(executor, id, ProcState::WaitingTimeout).await;
    id
}

#[actix::test]
async fn the_abort_timeout_and_recovery_hooks_get_their_procedures_context() {
    let store = common::Reopen::new("memory");
    let log = Arc::new(Log::default());
    let start = || start_on(&store, &log);
    let executor = start().await;
    let aborted = submit_sleeper(&executor).await;
    assert!(executor.abort(aborted).await.unwrap());
    assert!(executor.wait(aborted).await.unwrap().is_err());

    let mut timed = Hooked::new(1);
    timed.sleep_forever = true;
    timed.timeout_ms = Some(20);
    let timed = executor.submit(timed).await.unwrap();
    assert!(executor.wait(timed).await.unwrap().is_err());

    let kept = submit_sleeper(&executor).await;
    executor.shutdown_now().await.unwrap();
    let executor = start().await;
    // after_recover runs when the recovered procedure is next called: abort it.
    assert!(executor.abort(kept).await.unwrap());
    assert!(executor.wait(kept).await.unwrap().is_err());
    executor.shutdown_now().await.unwrap();

    let hooks = log.hooks();
    let expected = [
        format!("abort {aborted}"),
        format!("timeout {timed}"),
        format!("before_recover {kept}"),
        format!("after_recover {kept}"),
        format!("abort {kept}"),
    ];
    let seen: Vec<&String> = hooks.iter().filter(|h| !h.starts_with("cleanup")).collect();
    assert_eq!(seen, expected.iter().collect::<Vec<_>>());
    for id in [aborted, timed, kept] {
        assert!(hooks.contains(&format!("cleanup {id}")), "{hooks:?}");
    }
}

/// A recovered procedure that waits (a sleep of an hour) starts no actor at the restart,
/// and its `after_recover` runs only once the engine has work for it (here: an abort).
#[actix::test]
async fn a_recovered_procedure_that_waits_has_no_actor_until_it_has_work() {
    let store = common::Reopen::new("memory");
    let log = Arc::new(Log::default());
    let start = || start_on(&store, &log);
    let executor = start().await;
    let id = submit_sleeper(&executor).await;
    executor.shutdown_now().await.unwrap();

    let executor = start().await;
    // Answered by its root stack: the tree has started, and made its procedures.
    let tree = executor.tree(id).await.unwrap();
    assert_eq!(tree.root, id);
    let stats = executor.scheduler_stats().await.unwrap();
    assert_eq!(
        stats.procedures_active, 0,
        "no actor for a waiting procedure"
    );
    let after = format!("after_recover {id}");
    assert!(!log.hooks().contains(&after), "{:?}", log.hooks());
    assert!(executor.abort(id).await.unwrap());
    assert!(executor.wait(id).await.unwrap().is_err());
    executor.shutdown_now().await.unwrap();
    let hooks = log.hooks();
    let at = |h: &str| hooks.iter().position(|x| x == h);
    let (recovered, aborted) = (at(&after), at(&format!("abort {id}")));
    assert!(
        recovered.is_some() && recovered < aborted,
        "after_recover before the abort hook: {hooks:?}"
    );
}
