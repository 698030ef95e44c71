//! Events through the executor's messages, on both stores: wake and reset, and what a
//! suspended procedure does after a restart (re-run by default, or wait again).

mod common;

use std::sync::{Arc, Mutex};

use proctor::{
    async_trait, Context, Executor, Flow, ProcError, ProcState, Procedure, ProcedureStore, Registry,
};
use serde::{Deserialize, Serialize};

#[derive(Default)]
struct Calls(Mutex<Vec<String>>);

impl Calls {
    fn push(&self, call: String) {
        self.0.lock().unwrap().push(call);
    }

    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Suspends on `event` in its first step and finishes in its second.
#[derive(Serialize, Deserialize)]
struct Waiter {
    name: String,
    event: String,
    /// After a restart, wait for the event again instead of re-running.
    stay: bool,
    suspended: bool,
}

impl Waiter {
    fn new(name: &str, event: &str, stay: bool) -> Self {
        Waiter {
            name: name.into(),
            event: event.into(),
            stay,
            suspended: false,
        }
    }
}

#[async_trait]
impl Procedure<Calls> for Waiter {
    async fn execute(&mut self, ctx: &mut Context<Calls>) -> Result<Flow<Calls>, ProcError> {
        let calls = ctx.env();
        if self.suspended {
            calls.push(format!("{}-run", self.name));
            return Ok(Flow::Done);
        }
        calls.push(format!("{}-suspend", self.name));
        self.suspended = true;
        Ok(Flow::Suspend(self.event.clone()))
    }

    async fn rollback(&mut self, _ctx: &mut Context<Calls>) -> Result<(), ProcError> {
        Ok(())
    }

    fn rerun_after_recover(&self, _event: &str) -> bool {
        !self.stay
    }
}

async fn start(store: Box<dyn ProcedureStore>) -> (Executor<Calls>, Arc<Calls>) {
    let mut registry = Registry::new();
    registry.register::<Waiter>("waiter");
    let calls = Arc::new(Calls::default());
    let executor = Executor::builder()
        .registry(registry)
        .store(store)
        .env(calls.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, calls)
}

/// A wake runs every waiter; the event stays ready (a later suspension goes on at once)
/// until it is reset (then the next one waits for the next wake).
#[actix::test]
async fn a_woken_event_stays_ready_until_it_is_reset() {
    for (name, store, _dir) in common::stores() {
        let (executor, calls) = start(store).await;
        let w1 = executor
            .submit(Waiter::new("w1", "e", false))
            .await
            .unwrap();
        let w2 = executor
            .submit(Waiter::new("w2", "e", false))
            .await
            .unwrap();
        common::wait_for_state(&executor, w1, ProcState::Waiting).await;
        common::wait_for_state(&executor, w2, ProcState::Waiting).await;
        executor.wake_event("e").await.unwrap();
        assert_eq!(executor.wait(w1).await.unwrap(), Ok(()), "{name}");
        assert_eq!(executor.wait(w2).await.unwrap(), Ok(()), "{name}");
        // Ready: goes through without another wake.
        let w3 = executor
            .submit(Waiter::new("w3", "e", false))
            .await
            .unwrap();
        assert_eq!(executor.wait(w3).await.unwrap(), Ok(()), "{name}");
        executor.reset_event("e").await.unwrap();
        let w4 = executor
            .submit(Waiter::new("w4", "e", false))
            .await
            .unwrap();
        common::wait_for_state(&executor, w4, ProcState::Waiting).await;
        assert!(!calls.all().contains(&"w4-run".to_string()), "{name}");
        executor.wake_event("e").await.unwrap();
        assert_eq!(executor.wait(w4).await.unwrap(), Ok(()), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// After a restart a procedure that was suspended runs its next step at once by
/// default (whether the event was woken is not persisted: the step re-checks), or,
/// when its hook says so, waits for the event again.
#[actix::test]
async fn a_suspended_procedure_reruns_or_waits_after_a_restart_as_its_hook_says() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = start(store.open()).await;
        let rerun = executor
            .submit(Waiter::new("rerun", "e", false))
            .await
            .unwrap();
        let stay = executor
            .submit(Waiter::new("stay", "e", true))
            .await
            .unwrap();
        common::wait_for_state(&executor, rerun, ProcState::Waiting).await;
        common::wait_for_state(&executor, stay, ProcState::Waiting).await;
        executor.shutdown_now().await.unwrap();

        let (executor, calls) = start(store.open()).await;
        assert_eq!(executor.wait(rerun).await.unwrap(), Ok(()), "{name}");
        assert_eq!(calls.all(), ["rerun-run"], "{name}");
        assert_eq!(
            executor.state(stay).await.unwrap().state,
            ProcState::Waiting,
            "{name}"
        );
        executor.wake_event("e").await.unwrap();
        assert_eq!(executor.wait(stay).await.unwrap(), Ok(()), "{name}");
        assert_eq!(calls.all(), ["rerun-run", "stay-run"], "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// Waits for `id`'s result, failing the test (rather than hanging it) if none comes.
async fn result_of(
    executor: &Executor<Calls>,
    id: proctor::ProcId,
) -> Result<(), proctor::Failure> {
    tokio::time::timeout(std::time::Duration::from_secs(30), executor.wait(id))
        .await
        .unwrap_or_else(|_| panic!("procedure {id} never finished"))
        .unwrap()
}

/// Appends what an operator's offline command plans, as `proctor` does on a stopped
/// engine's store.
fn offline(
    store: &common::Reopen,
    plan: impl FnOnce(&[proctor::store::ProcRecord]) -> Vec<proctor::store::StoreOp>,
) {
    let mut s = store.open();
    let records = s.load().unwrap().records;
    let ops = plan(&records);
    s.append(&ops).unwrap();
}

/// A procedure paused while it was suspended is off its event's waiters; a wake of the
/// event then finds nobody. After a restart, continued, it runs its next step (which
/// re-checks) as every recovered suspended procedure does by default — or, when its
/// hook says so, waits for the event again. It used to wait for the event in both
/// cases, and the wake it had missed never came again.
#[actix::test]
async fn a_paused_suspended_procedure_reruns_when_continued_after_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = start(store.open()).await;
        let rerun = executor
            .submit(Waiter::new("rerun", "e", false))
            .await
            .unwrap();
        let stay = executor
            .submit(Waiter::new("stay", "e", true))
            .await
            .unwrap();
        for id in [rerun, stay] {
            common::wait_for_state(&executor, id, ProcState::Waiting).await;
            executor.pause(id).await.unwrap();
            common::wait_for_state(&executor, id, ProcState::Paused).await;
        }
        executor.wake_event("e").await.unwrap();
        executor.shutdown().await.unwrap();

        let (executor, calls) = start(store.open()).await;
        for id in [rerun, stay] {
            let state = executor.state(id).await.unwrap().state;
            assert_eq!(state, ProcState::Paused, "{name}: {id}");
            executor.resume(id).await.unwrap();
        }
        assert_eq!(result_of(&executor, rerun).await, Ok(()), "{name}");
        assert_eq!(calls.all(), ["rerun-run"], "{name}");
        common::wait_for_state(&executor, stay, ProcState::Waiting).await;
        executor.wake_event("e").await.unwrap();
        assert_eq!(result_of(&executor, stay).await, Ok(()), "{name}");
        assert_eq!(calls.all(), ["rerun-run", "stay-run"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// The same with a pause written on the stopped engine's store (`proctor pause`): at
/// the next start it is PAUSED, and once continued it runs its next step.
#[actix::test]
async fn an_offline_pause_of_a_suspended_procedure_reruns_when_continued() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = start(store.open()).await;
        let w = executor.submit(Waiter::new("w", "e", false)).await.unwrap();
        common::wait_for_state(&executor, w, ProcState::Waiting).await;
        executor.shutdown().await.unwrap();

        offline(&store, |records| {
            proctor::ops::recovery::steer(records, w, proctor::ops::recovery::Steer::Pause, 0)
                .unwrap()
        });
        let (executor, calls) = start(store.open()).await;
        assert_eq!(
            executor.state(w).await.unwrap().state,
            ProcState::Paused,
            "{name}"
        );
        executor.resume(w).await.unwrap();
        assert_eq!(result_of(&executor, w).await, Ok(()), "{name}");
        assert_eq!(calls.all(), ["w-run"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// An abort written on the stopped engine's store (`proctor abort`) of a suspended
/// procedure, or of one an operator paused while it was suspended, rolls its tree back
/// at the next start: its result comes, no step runs.
#[actix::test]
async fn an_offline_abort_of_a_suspended_procedure_rolls_it_back_at_the_next_start() {
    for name in common::STORES {
        for paused in [false, true] {
            let store = common::Reopen::new(name);
            let (executor, _) = start(store.open()).await;
            let w = executor.submit(Waiter::new("w", "e", false)).await.unwrap();
            common::wait_for_state(&executor, w, ProcState::Waiting).await;
            if paused {
                executor.pause(w).await.unwrap();
                common::wait_for_state(&executor, w, ProcState::Paused).await;
                executor.wake_event("e").await.unwrap();
            }
            executor.shutdown().await.unwrap();

            offline(&store, |records| {
                proctor::ops::recovery::abort(records, w, 0).unwrap()
            });
            let (executor, calls) = start(store.open()).await;
            let failure = result_of(&executor, w).await.expect_err("rolled back");
            assert!(
                failure.to_string().contains("abort"),
                "{name}, paused {paused}: {failure}"
            );
            assert_eq!(calls.all(), Vec::<String>::new(), "{name}, paused {paused}");
            executor.shutdown().await.unwrap();
        }
    }
}

/// `wake_event` hands its waiters to their trees oldest first, and each tree queues
/// its procedure's next step. Trees on one arbiter are queued in that order, so with
/// one worker and FIFO scheduling the oldest waiter's step runs first; trees on
/// different arbiters are queued by each arbiter in turn, in an order not promised
/// (the executor's docs of `wake_event` say so).
#[actix::test]
async fn woken_waiters_of_one_arbiter_run_oldest_first() {
    for (name, store, _dir) in common::stores() {
        let mut registry = Registry::new();
        registry.register::<Waiter>("waiter");
        let calls = Arc::new(Calls::default());
        let executor = Executor::builder()
            .registry(registry)
            .store(store)
            .env(calls.clone())
            .workers(1)
            .arbiters(1)
            .scheduling(proctor::Scheduling::Fifo)
            .start()
            .await
            .expect("executor starts");
        for round in 0..12 {
            let event = format!("e{round}");
            let (a, b) = (format!("a{round}"), format!("b{round}"));
            let first = executor
                .submit(Waiter::new(&a, &event, false))
                .await
                .unwrap();
            common::wait_for_state(&executor, first, ProcState::Waiting).await;
            let second = executor
                .submit(Waiter::new(&b, &event, false))
                .await
                .unwrap();
            common::wait_for_state(&executor, second, ProcState::Waiting).await;
            executor.wake_event(event).await.unwrap();
            assert_eq!(executor.wait(first).await.unwrap(), Ok(()), "{name}");
            assert_eq!(executor.wait(second).await.unwrap(), Ok(()), "{name}");
            let runs: Vec<String> = calls
                .all()
                .into_iter()
                .filter(|c| c.ends_with("-run") && c.contains(&format!("{round}-")))
                .collect();
            assert_eq!(
                runs,
                [format!("{a}-run"), format!("{b}-run")],
                "{name}: round {round}"
            );
        }
        executor.shutdown().await.unwrap();
    }
}
