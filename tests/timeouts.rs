//! Timeouts through the executor, on both stores: in every waiting state, handled and
//! re-armed by the hook, and persisted as absolute deadlines across restarts.

mod common;

use std::sync::{Arc, Mutex};

use proctor::{
    async_trait, Context, Executor, Flow, MemoryStore, OnTimeout, ProcError, ProcId, ProcState,
    Procedure, ProcedureStore, Registry,
};

use proctor::store::{ProcRecord, StoreOp};
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

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Wait {
    /// Suspend on an event nobody wakes.
    Suspend,
    /// Sleep for an hour.
    Sleep,
    /// Start a child that suspends for ever, and wait for it.
    Child,
}

/// Waits in its first step as `wait` says; its timeout hook keeps it going `handle`
/// times (re-arming `timeout` each time), then fails it.
#[derive(Serialize, Deserialize)]
struct Timer {
    name: String,
    timeout: Option<u64>,
    wait: Wait,
    handle: u32,
    handled: u32,
    started: bool,
}

impl Timer {
    fn new(name: &str, timeout: Option<u64>, wait: Wait, handle: u32) -> Self {
        Timer {
            name: name.into(),
            timeout,
            wait,
            handle,
            handled: 0,
            started: false,
        }
    }
}

#[async_trait]
impl Procedure<Calls> for Timer {
    async fn execute(&mut self, ctx: &mut Context<Calls>) -> Result<Flow<Calls>, ProcError> {
        if self.started {
            return Ok(Flow::Done);
        }
        self.started = true;
        Ok(match self.wait {
            Wait::Suspend => Flow::Suspend("never".into()),
            Wait::Sleep => Flow::SleepUntil(ctx.now_ms() + 3_600_000),
            Wait::Child => Flow::Children(vec![Box::new(Timer::new(
                &format!("{}-child", self.name),
                None,
                Wait::Suspend,
                0,
            ))]),
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<Calls>) -> Result<(), ProcError> {
        // An unrecorded step: one its wake may have started before a restart.
        let unrecorded = if ctx.is_unrecorded_step() {
            "-unrecorded"
        } else {
            ""
        };
        ctx.env()
            .push(format!("{}-rollback{unrecorded}", self.name));
        Ok(())
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.timeout
    }

    fn on_timeout(&mut self, _ctx: &Context<Calls>) -> OnTimeout {
        if !self.started {
            // Not in its wait yet (a loaded machine): what the tests time out is the
            // wait, so the deadline is pushed back until the step has run.
            return OnTimeout::Rearm(self.timeout.unwrap_or(0));
        }
        self.handled += 1;
        if self.handled <= self.handle {
            OnTimeout::Rearm(self.timeout.unwrap_or(0))
        } else {
            OnTimeout::Fail
        }
    }

    fn rerun_after_recover(&self, _event: &str) -> bool {
        false
    }
}

fn registry() -> Registry<Calls> {
    let mut registry = Registry::new();
    registry.register::<Timer>("timer");
    registry
}

async fn start(store: Box<dyn ProcedureStore>) -> (Executor<Calls>, Arc<Calls>) {
    let calls = Arc::new(Calls::default());
    let executor = Executor::builder()
        .registry(registry())
        .store(store)
        .env(calls.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, calls)
}

/// The timeout applies whatever the procedure waits for: an event, a deadline of its
/// own, or its children (which are rolled back with it).
#[actix::test]
async fn a_timeout_fails_a_procedure_in_every_waiting_state() {
    for (name, store, _dir) in common::stores() {
        let (executor, calls) = start(store).await;
        for wait in [Wait::Suspend, Wait::Sleep, Wait::Child] {
            let id = executor
                .submit(Timer::new("t", Some(20), wait, 0))
                .await
                .unwrap();
            let failure = executor.wait(id).await.unwrap().expect_err("times out");
            assert_eq!(failure.proc, id, "{name} {wait:?}");
            assert_eq!(
                failure.error,
                ProcError::TimedOut { timeout_ms: 20 },
                "{name} {wait:?}"
            );
        }
        // The child of the third was rolled back with its parent, child first.
        assert_eq!(
            calls.all()[calls.all().len() - 2..],
            ["t-child-rollback", "t-rollback"],
            "{name}"
        );
        // The procedures that timed out while suspended no longer wait on the event:
        // it takes no memory.
        assert_eq!(
            executor.scheduler_stats().await.unwrap().events,
            0,
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

/// The hook's count of handled timeouts, from the procedure's final record.
fn handled_in_store(store: &common::Reopen, id: ProcId) -> u32 {
    let snapshot = store.open().load().unwrap();
    let record = snapshot.records.iter().find(|r| r.id == id).unwrap();
    assert_eq!(record.state, ProcState::RolledBack);
    let timer: Timer = rmp_serde::from_slice(&record.data).unwrap();
    timer.handled
}

/// A hook that handles its timeout 5 times and fails on the 6th ends the procedure
/// with the timeout error after exactly 6 calls.
#[actix::test]
async fn a_timeout_handled_five_times_fails_at_the_sixth() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = start(store.open()).await;
        let id = executor
            .submit(Timer::new("t", Some(5), Wait::Suspend, 5))
            .await
            .unwrap();
        let failure = executor.wait(id).await.unwrap().expect_err("times out");
        assert_eq!(
            failure.error,
            ProcError::TimedOut { timeout_ms: 5 },
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
        assert_eq!(handled_in_store(&store, id), 6, "{name}");
    }
}

/// A record a crashed engine left: a procedure suspended on an event whose (persisted,
/// absolute) deadline has long passed. The new engine fails it at once — it does not
/// restart the hour-long timeout from now.
#[actix::test]
async fn an_overdue_deadline_fires_at_once_after_a_restart() {
    let registry = registry();
    let mut proc = Timer::new("t", Some(3_600_000), Wait::Suspend, 0);
    proc.started = true;
    let (type_name, data) = registry.encode(&proc).unwrap();
    let record = ProcRecord {
        id: ProcId(1),
        parent: None,
        root: ProcId(1),
        type_name: type_name.to_string().into(),
        state: ProcState::Waiting,
        stack_indexes: vec![0],
        failure: None,
        failure_seq: None,
        submitted_ms: 1,
        updated_ms: 1,
        wake_at_ms: None,
        event: Some("never".into()),
        data,
        locks: None,
        // Long past: the procedure was submitted at 1 ms with a 1-hour timeout that
        // had already been re-armed to expire at 2 ms.
        deadline_ms: Some(2),
        nonce: None,
        result: None,
        bypassed: false,
        steering: Default::default(),
        nonce_fingerprint: None,
    };
    let mut store = MemoryStore::new();
    store.append(&[StoreOp::Insert(record)]).unwrap();
    let (executor, calls) = start(Box::new(store)).await;
    let failure = executor
        .wait(ProcId(1))
        .await
        .unwrap()
        .expect_err("overdue");
    assert_eq!(
        failure.error,
        ProcError::TimedOut {
            timeout_ms: 3_600_000
        }
    );
    // A procedure recovered waiting may have been woken, and have run its next step,
    // before the restart: that step is undone first, then the recorded one.
    assert_eq!(calls.all(), ["t-rollback-unrecorded", "t-rollback"]);
    executor.shutdown_now().await.unwrap();
}

/// Re-armed deadlines and the hook's state are persisted: after a restart the count
/// goes on where the log left it, and the procedure still fails at its 6th timeout.
#[actix::test]
async fn a_re_armed_deadline_survives_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = start(store.open()).await;
        let id = executor
            .submit(Timer::new("t", Some(40), Wait::Suspend, 5))
            .await
            .unwrap();
        // Stop once at least two re-armed deadlines are durable (each one's record
        // updates the procedure's row).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let info = executor.state(id).await.unwrap();
            if info.state == ProcState::Waiting && info.updated_ms >= info.submitted_ms + 80 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: never re-armed"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        executor.shutdown_now().await.unwrap();
        let (executor, _) = start(store.open()).await;
        let failure = executor.wait(id).await.unwrap().expect_err("times out");
        assert_eq!(
            failure.error,
            ProcError::TimedOut { timeout_ms: 40 },
            "{name}"
        );
        executor.shutdown_now().await.unwrap();
        assert_eq!(handled_in_store(&store, id), 6, "{name}");
    }
}
