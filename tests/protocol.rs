//! The actor protocol where it races: the order step reports reach a root stack, when a
//! finished procedure's lock and cleanup run, what the executor may show before it is
//! durable, when an abort is answered, and what a store failure leaves behind. Each test
//! pins one rule of `ARCHITECTURE.md`'s "Protocol" section and failed before that rule
//! was enforced.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{run, start, stores, wait_for_state, GatedStore, Reopen, Scripted, Step};
use proctor::store::{ProcRecord, StoreOp};
use proctor::testing::{CrashPoint, CrashingStore};
use proctor::{
    async_trait, Context, Error, Executor, Flow, LockState, MemoryStore, ProcError, ProcId,
    ProcState, Procedure, ProcedureStore, Registry,
};
use serde::{Deserialize, Serialize};

/// One worker, two children, the first fails before the second starts: the first
/// failure is the result, the second child never runs, and the rollback undoes the
/// first child and then the root. (Seen: 1 run in 3 reported the second child's error,
/// because a worker was freed before the step's report reached the root stack.)
#[actix::test]
async fn the_first_failure_is_the_result_and_the_sibling_never_runs() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 1).await;
        for round in 0..25 {
            let name = |n: &str| format!("{round}{n}");
            let root = Scripted::new(
                &name("r"),
                vec![Step::Children(vec![
                    Scripted::new(&name("a"), vec![Step::Fail("first".into())]),
                    Scripted::new(&name("b"), vec![Step::Fail("second".into())]),
                ])],
            );
            let (_, result) = run(&executor, root).await;
            let failure = result.unwrap_err();
            assert_eq!(
                failure.error,
                ProcError::failed("first"),
                "{store_name} round {round}"
            );
            let calls: Vec<String> = rec
                .calls()
                .into_iter()
                .filter(|c| c.starts_with(&format!("{round}")))
                .collect();
            assert_eq!(
                calls,
                [
                    name("r-exec"),
                    name("a-exec"),
                    name("a-rollback"),
                    name("r-rollback")
                ],
                "{store_name} round {round}"
            );
        }
    }
}

/// A procedure that takes an exclusive lock on a resource in a lock table shared through
/// the environment, and records every hook call.
#[derive(Serialize, Deserialize)]
struct Locker {
    name: String,
    resource: u32,
    steps: u32,
    done: u32,
    hold: bool,
    fail_at: Option<u32>,
}

#[derive(Default)]
struct Locks {
    holders: Mutex<BTreeMap<u32, String>>,
    events: Mutex<Vec<String>>,
}

impl Locks {
    fn log(&self, e: String) {
        self.events.lock().unwrap().push(e);
    }
    fn events_of(&self, name: &str) -> Vec<String> {
        let prefix = format!("{name} ");
        self.events
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| e.strip_prefix(&prefix).map(str::to_string))
            .collect()
    }
}

#[async_trait]
impl Procedure<Locks> for Locker {
    async fn execute(&mut self, ctx: &mut Context<Locks>) -> Result<Flow<Locks>, ProcError> {
        let locks = ctx.env();
        assert_eq!(
            locks.holders.lock().unwrap().get(&self.resource),
            Some(&self.name),
            "{} runs without its lock",
            self.name
        );
        self.done += 1;
        locks.log(format!("{} exec {}", self.name, self.done));
        if self.fail_at == Some(self.done) {
            return Err(ProcError::failed("planned"));
        }
        Ok(if self.done < self.steps {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<Locks>) -> Result<(), ProcError> {
        let locks = ctx.env();
        assert_eq!(
            locks.holders.lock().unwrap().get(&self.resource),
            Some(&self.name),
            "{} rolls back without its lock",
            self.name
        );
        locks.log(format!("{} rollback {}", self.name, self.done));
        self.done -= 1;
        Ok(())
    }

    fn acquire_lock(&mut self, ctx: &Context<Locks>) -> LockState {
        let locks = ctx.env();
        let mut holders = locks.holders.lock().unwrap();
        match holders.get(&self.resource) {
            Some(holder) => {
                assert_ne!(holder, &self.name, "{} takes its lock twice", self.name);
                LockState::Yield
            }
            None => {
                holders.insert(self.resource, self.name.clone());
                locks.log(format!("{} lock", self.name));
                LockState::Acquired
            }
        }
    }

    fn release_lock(&mut self, ctx: &Context<Locks>) {
        let locks = ctx.env();
        let holder = locks.holders.lock().unwrap().remove(&self.resource);
        assert_eq!(
            holder.as_ref(),
            Some(&self.name),
            "{} releases a lock it does not hold",
            self.name
        );
        locks.log(format!("{} unlock", self.name));
    }

    fn holds_lock(&self) -> bool {
        self.hold
    }

    fn completion_cleanup(&mut self, _ctx: &Context<Locks>) {
        CLEANUPS.lock().unwrap().push(self.name.clone());
    }
}

/// Where completion cleanups report.
static CLEANUPS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn cleanups_of(name: &str) -> usize {
    CLEANUPS
        .lock()
        .unwrap()
        .iter()
        .filter(|n| *n == name)
        .count()
}

fn locker(name: &str, resource: u32, steps: u32, hold: bool) -> Locker {
    Locker {
        name: name.to_string(),
        resource,
        steps,
        done: 0,
        hold,
        fail_at: None,
    }
}

async fn start_locks(
    store: Box<dyn ProcedureStore>,
    workers: usize,
) -> (Executor<Locks>, Arc<Locks>) {
    let mut registry = Registry::new();
    registry.register::<Locker>("locker");
    let locks = Arc::new(Locks::default());
    let executor = Executor::builder()
        .registry(registry)
        .store(store)
        .workers(workers)
        .env(locks.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, locks)
}

/// Hundreds of lock-holding procedures on a few resources: when `wait` answers, each has
/// released its lock exactly once and run its cleanup exactly once. (Seen: up to 45 of
/// 1 000 leaked their lock for ever, because the message that stops a finished
/// procedure could be dropped with the actor's last address; and the cleanup ran after
/// the result was visible.)
#[actix::test]
async fn a_finished_procedure_releases_and_cleans_up_before_its_result() {
    for (store_name, store, _dir) in stores() {
        let (executor, locks) = start_locks(store, 4).await;
        let names: Vec<String> = (0..300).map(|i| format!("{store_name}-h{i}")).collect();
        let mut ids = Vec::new();
        for (i, name) in names.iter().enumerate() {
            let id = executor
                .submit(locker(name, i as u32 % 7, 2, true))
                .await
                .unwrap();
            ids.push((id, name));
        }
        for (id, name) in ids {
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
            assert_eq!(cleanups_of(name), 1, "{name}: cleanup before the result");
            assert_eq!(
                locks.events_of(name),
                ["lock", "exec 1", "exec 2", "unlock"],
                "{name}"
            );
        }
        assert!(locks.holders.lock().unwrap().is_empty());
        executor.shutdown_now().await.unwrap();
    }
}

/// A lock held for the procedure's life is held through its rollback and released once,
/// after the last rollback step. (Seen: released when the step failed, so a waiter ran
/// on the resource during the rollback, and the rollback took the lock again.)
#[actix::test]
async fn a_held_lock_covers_the_rollback() {
    for (store_name, store, _dir) in stores() {
        let (executor, locks) = start_locks(store, 2).await;
        let name = format!("{store_name}-fails");
        let mut failing = locker(&name, 1, 3, true);
        failing.fail_at = Some(2);
        let waiter_name = format!("{store_name}-waiter");
        let id = executor.submit(failing).await.unwrap();
        let waiter = executor
            .submit(locker(&waiter_name, 1, 1, true))
            .await
            .unwrap();
        assert!(executor.wait(id).await.unwrap().is_err());
        assert_eq!(executor.wait(waiter).await.unwrap(), Ok(()));
        assert_eq!(
            locks.events_of(&name),
            [
                "lock",
                "exec 1",
                "exec 2",
                "rollback 2",
                "rollback 1",
                "unlock"
            ],
            "{store_name}"
        );
        assert_eq!(cleanups_of(&name), 1);
    }
}

/// When the store fails, procedures that have not finished are cut off like in a crash:
/// no lock release, no completion cleanup (they run once, after recovery, when the
/// procedure really finishes). (Seen: both ran on unfinished procedures, then again
/// after the restart.)
#[actix::test]
async fn a_store_failure_runs_no_cleanup_on_unfinished_procedures() {
    for store_name in common::STORES {
        let stores = Reopen::new(store_name);
        let cut = format!("{store_name}-cut");
        // Append 1 is the submit's insert; the record of step 1 crashes.
        let store = CrashingStore::new(stores.open(), 1, CrashPoint::BeforeWrite);
        let (executor, locks) = start_locks(Box::new(store), 2).await;
        let id = executor.submit(locker(&cut, 1, 3, true)).await.unwrap();
        let err = executor.wait(id).await.unwrap_err();
        assert!(matches!(err, Error::Store(_)), "{err}");
        executor.shutdown_now().await.unwrap();
        assert_eq!(locks.events_of(&cut), ["lock", "exec 1"]);
        assert_eq!(cleanups_of(&cut), 0);

        // The restarted engine runs it again from its last durable state, and finishes
        // it once: one release, one cleanup.
        locks.holders.lock().unwrap().clear();
        let mut registry = Registry::new();
        registry.register::<Locker>("locker");
        let executor = Executor::builder()
            .registry(registry)
            .store(stores.open())
            .env(locks.clone())
            .start()
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        assert_eq!(
            locks.events_of(&cut),
            ["lock", "exec 1", "lock", "exec 1", "exec 2", "exec 3", "unlock"],
            "{store_name}"
        );
        assert_eq!(cleanups_of(&cut), 1);
        executor.shutdown_now().await.unwrap();
    }
}

/// What the executor reports is never ahead of the store: while the record of a
/// procedure's last step is on its way to disk, the procedure is still RUNNABLE.
/// (Seen: SUCCESS was reported for a record never written; after a crash the step ran
/// again.)
#[actix::test]
async fn state_is_reported_only_once_durable() {
    for store_name in common::STORES {
        let stores = Reopen::new(store_name);
        // Append 1 is the insert; append 2, the record of the one step, waits at the gate.
        let (store, mut gate) = GatedStore::new(stores.open(), 2);
        let (executor, _rec) = start(Box::new(store), 2).await;
        let id = executor.submit(Scripted::new("v", vec![])).await.unwrap();
        gate.reached().await;
        let seen = executor.state(id).await.unwrap();
        assert_eq!(
            seen.state,
            ProcState::Runnable,
            "{store_name}: reported before durable"
        );
        assert_eq!(seen.result, None);
        gate.release();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        assert_eq!(executor.state(id).await.unwrap().state, ProcState::Success);
        executor.shutdown_now().await.unwrap();
    }
}

/// `abort` answers `Ok(true)` only once the abort is durable: if the store fails on the
/// FAILED record, the caller hears about it, and a restarted engine (which never saw
/// the abort) finishes the procedure normally. (Seen: `Ok(true)`, then SUCCESS after the
/// restart.)
#[actix::test]
async fn an_accepted_abort_is_durable_before_it_is_answered() {
    for store_name in common::STORES {
        let stores = Reopen::new(store_name);
        // Appends: 1 the insert, 2 the sleep; the abort's FAILED record crashes.
        let store = CrashingStore::new(stores.open(), 2, CrashPoint::BeforeWrite);
        let (executor, _rec) = start(Box::new(store), 2).await;
        let id = executor
            .submit(Scripted::new("sleeper", vec![Step::Sleep(3_600_000)]))
            .await
            .unwrap();
        wait_for_state(&executor, id, ProcState::WaitingTimeout).await;
        let answer = executor.abort(id).await;
        assert!(
            matches!(answer, Err(Error::Store(_))),
            "{store_name}: {answer:?}"
        );
        executor.shutdown_now().await.unwrap();

        let (executor, _rec) = start(stores.open(), 2).await;
        assert_eq!(executor.recovery().recovered_roots, [id]);
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::WaitingTimeout,
            "{store_name}: the abort was never durable, so it never happened"
        );
        // Now accepted and durable: the answer means it.
        assert!(executor.abort(id).await.unwrap());
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::Aborted);
        executor.shutdown_now().await.unwrap();
    }
}

/// After a store failure every waiter is answered with the error, including waiters on
/// idle trees that have nothing to write, and the error reads once. (Seen: a `wait` on
/// another, sleeping tree was never answered; the error read "store failed: store
/// failed: ...".)
#[actix::test]
async fn a_store_failure_answers_every_waiter() {
    // Appends: sleeper insert, sleeper step, runner insert; the runner's step crashes.
    // (Store-agnostic: the wrapper fails, whatever is under it.)
    let store = CrashingStore::new(MemoryStore::new(), 3, CrashPoint::BeforeWrite);
    let (executor, _rec) = start(Box::new(store), 2).await;
    let sleeper = executor
        .submit(Scripted::new("idle", vec![Step::Sleep(3_600_000)]))
        .await
        .unwrap();
    wait_for_state(&executor, sleeper, ProcState::WaitingTimeout).await;
    let idle_wait = executor.wait(sleeper);
    let runner = executor
        .submit(Scripted::new("runner", vec![Step::More, Step::More]))
        .await
        .unwrap();
    let guard = Duration::from_secs(30);
    let runner_err = tokio::time::timeout(guard, executor.wait(runner))
        .await
        .expect("the failing tree's waiter is answered")
        .unwrap_err();
    let idle_err = tokio::time::timeout(guard, idle_wait)
        .await
        .expect("the idle tree's waiter is answered")
        .unwrap_err();
    for err in [runner_err, idle_err] {
        let text = err.to_string();
        assert!(matches!(err, Error::Store(_)), "{text}");
        assert_eq!(text.matches("store failed").count(), 1, "{text}");
        assert!(text.contains("simulated crash"), "{text}");
    }
    // Nothing more is accepted, and the process can stop.
    assert!(matches!(
        executor.submit(Scripted::new("late", vec![])).await,
        Err(Error::Store(_))
    ));
    executor.shutdown_now().await.unwrap();
}

/// A RUNNABLE root record of tree 1 with nothing recorded: procedure `id` of
/// `type_name`, its state `data`.
fn runnable_record(id: u64, type_name: &str, data: Vec<u8>) -> ProcRecord {
    ProcRecord {
        id: ProcId(id),
        parent: None,
        root: ProcId(1),
        type_name: type_name.to_string().into(),
        state: ProcState::Runnable,
        stack_indexes: vec![],
        failure: None,
        failure_seq: None,
        submitted_ms: 1,
        updated_ms: 1,
        wake_at_ms: None,
        event: None,
        data,
        locks: None,
        deadline_ms: None,
        nonce: None,
        result: None,
        bypassed: false,
        steering: Default::default(),
        nonce_fingerprint: None,
    }
}

/// A log whose frames were swapped can hold a child's insert with its parent's older
/// record (RUNNABLE, not WAITING). Recovery reports that tree as corrupt instead of
/// running it into an internal assertion that killed an arbiter thread and hung the
/// engine.
#[actix::test]
async fn a_reordered_log_is_reported_not_run_into_a_panic() {
    let registry = common::registry();
    let (type_name, data) = registry.encode(&Scripted::new("orphan", vec![])).unwrap();
    let record = |id: u64, parent: Option<u64>, stack: Vec<u32>| ProcRecord {
        parent: parent.map(ProcId),
        stack_indexes: stack,
        ..runnable_record(id, type_name, data.clone())
    };
    let mut store = MemoryStore::new();
    store
        .append(&[
            StoreOp::Insert(record(1, None, vec![0])),
            StoreOp::Insert(record(2, Some(1), vec![])),
        ])
        .unwrap();
    let (executor, _rec) = start(Box::new(store), 2).await;
    let corrupt: Vec<ProcId> = executor.recovery().corrupt.iter().map(|c| c.id).collect();
    assert_eq!(corrupt, [ProcId(2), ProcId(1)]);
    assert!(executor.recovery().corrupt[0]
        .reason
        .contains("procedure 1 is RUNNABLE but its child 2 is unfinished"));
    // The engine serves other work.
    let (_, result) = run(&executor, Scripted::new("other", vec![Step::More])).await;
    assert_eq!(result, Ok(()));
}

/// A procedure type whose own `Deserialize` panics on its recorded state: recovery
/// reports that tree as corrupt, naming the panic, and the engine starts and serves
/// other work (the panic used to end the engine's start).
#[actix::test]
async fn a_panic_decoding_a_recovered_state_is_reported_not_fatal() {
    #[derive(Serialize)]
    struct Touchy {
        unreadable: bool,
    }
    impl<'de> Deserialize<'de> for Touchy {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            #[derive(Deserialize)]
            struct Raw {
                unreadable: bool,
            }
            let raw = Raw::deserialize(d)?;
            assert!(!raw.unreadable, "a state this build cannot read");
            Ok(Touchy { unreadable: false })
        }
    }
    #[async_trait]
    impl Procedure<common::Recorder> for Touchy {
        async fn execute(
            &mut self,
            _: &mut Context<common::Recorder>,
        ) -> Result<Flow<common::Recorder>, ProcError> {
            Ok(Flow::Done)
        }
        async fn rollback(&mut self, _: &mut Context<common::Recorder>) -> Result<(), ProcError> {
            Ok(())
        }
    }
    let mut registry = common::registry();
    registry.register::<Touchy>("touchy");
    let (type_name, data) = registry.encode(&Touchy { unreadable: true }).unwrap();
    let mut store = MemoryStore::new();
    store
        .append(&[StoreOp::Insert(runnable_record(1, type_name, data))])
        .unwrap();
    let executor = Executor::builder()
        .registry(registry)
        .store(store)
        .env(Arc::new(common::Recorder::default()))
        .start()
        .await
        .expect("the engine starts");
    let corrupt = &executor.recovery().corrupt;
    assert_eq!(corrupt.len(), 1, "{corrupt:?}");
    assert_eq!(corrupt[0].id, ProcId(1));
    assert!(
        corrupt[0].reason.contains("a state this build cannot read"),
        "{corrupt:?}"
    );
    let (_, result) = run(&executor, Scripted::new("other", vec![Step::More])).await;
    assert_eq!(result, Ok(()));
    executor.shutdown().await.unwrap();
}

/// Many trees in flight on many workers when the store fails (the issue's "resume on a
/// still-full disk" hung in 6 of 8 tries with 64 workers): every wait is answered, with
/// a result or the store error, and the executor shuts down.
#[actix::test]
async fn a_store_failure_under_load_leaves_nothing_hanging() {
    for store_name in common::STORES {
        for crash_at in [40, 150] {
            let stores = Reopen::new(store_name);
            let store = CrashingStore::new(stores.open(), crash_at, CrashPoint::AfterWrite);
            let (executor, _rec) = start(Box::new(store), 64).await;
            let mut roots = Vec::new();
            for i in 0..200 {
                let child = Scripted::new(&format!("c{i}"), vec![Step::More, Step::Yield]);
                let plan = vec![Step::More, Step::Children(vec![child]), Step::More];
                match executor.submit(Scripted::new(&format!("r{i}"), plan)).await {
                    Ok(id) => roots.push(id),
                    Err(Error::Store(_)) => break,
                    Err(e) => panic!("{store_name}: {e}"),
                }
            }
            let guard = Duration::from_secs(60);
            for id in roots {
                let answer = tokio::time::timeout(guard, executor.wait(id))
                    .await
                    .unwrap_or_else(|_| panic!("{store_name} crash at {crash_at}: {id} hangs"));
                assert!(
                    matches!(answer, Ok(_) | Err(Error::Store(_))),
                    "{store_name}: {answer:?}"
                );
            }
            tokio::time::timeout(guard, executor.shutdown_now())
                .await
                .expect("shutdown returns")
                .unwrap();
        }
    }
}

/// A step is queued only once the transition that queued it is durable and performed,
/// so its `RunStep` reaches the root stack after the transition's actions: while the
/// record of the root's first step (which starts a child) is on its way to disk,
/// neither the child nor the root's next step runs and the child is not listed; once it
/// is durable, the child's cell exists before its first step arrives, and everything
/// runs in order. (Seen when such steps rode on their record's append, queued by the
/// scheduler: a step dispatched before its root stack had performed the transition
/// found no cell and was dropped as a stopped procedure's.)
#[actix::test]
async fn a_step_queued_with_its_record_runs_only_once_the_record_is_durable() {
    for store_name in common::STORES {
        let stores = Reopen::new(store_name);
        // Append 1 is the root's insert; append 2, the record of its first step (the
        // child's insert with it), waits at the gate.
        let (store, mut gate) = GatedStore::new(stores.open(), 2);
        let (executor, rec) = start(Box::new(store), 4).await;
        let child = Scripted::new("c", vec![Step::More, Step::More]);
        let root = Scripted::new("r", vec![Step::Children(vec![child]), Step::More]);
        let id = executor.submit(root).await.unwrap();
        gate.reached().await;
        assert_eq!(rec.calls(), ["r-exec"], "{store_name}: ran before durable");
        let listed = executor.list(proctor::List::new()).await.unwrap();
        assert_eq!(
            listed.iter().map(|p| p.id).collect::<Vec<_>>(),
            [id],
            "{store_name}: the child is listed before its insert is durable"
        );
        gate.release();
        let result = tokio::time::timeout(Duration::from_secs(30), executor.wait(id))
            .await
            .unwrap_or_else(|_| panic!("{store_name}: the tree never finished"));
        assert_eq!(result.unwrap(), Ok(()));
        assert_eq!(
            rec.calls(),
            ["r-exec", "c-exec", "c-exec", "r-exec"],
            "{store_name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}
