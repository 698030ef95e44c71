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
    let mut registry = Registry::<Calls>::default();
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
    for name in ["memory", "wal"] {
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
