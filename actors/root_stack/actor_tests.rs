//! The root-stack actor and its procedure actors driven by messages alone, with test
//! actors standing in for the shard's scheduler (it runs every queued step at once)
//! and for the persistence actor (it holds each `Persist` until the test releases it,
//! so a test decides when each transition becomes durable). The tree is started on a
//! real shard, as the executor starts one; nothing else of an executor runs.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use actix::prelude::*;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::actors::locks::LockActor;
use crate::actors::persistence::PersistenceActor;
use crate::actors::procedure::declare;
use crate::actors::protocol::{
    AbortRequest, Enqueue, FromShard, LocksFromShard, Persist, ToPersistence, ToScheduler,
    TreeAddr, TreeFinished, TreeNews,
};
use crate::actors::scheduler::{Monitor, Queueing, SchedulerActor, SchedulerSetup};
use crate::actors::shard::{Mail, Shard, ShardPeers};
use crate::actors::shared::{now_ms, SchedulerViews, Shared};
use crate::erased::{erase, AnyEnv};
use crate::error::Error;
use crate::procedure::{Context, Flow, ProcError, ProcId, Procedure};
use crate::registry::Registry;
use crate::store::MemoryStore;
use crate::Scheduling;

use super::TreeRunner;

/// The calls the procedures made, in order, and a gate a step may wait at.
#[derive(Default)]
struct Log {
    calls: Mutex<Vec<String>>,
    gate: tokio::sync::Notify,
}

impl Log {
    fn push(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
}

/// `steps` steps (the first starts `children`, if any), failing at step `fail_at`,
/// waiting at the log's gate in step `hold_at`.
#[derive(Clone, Serialize, Deserialize)]
struct P {
    name: String,
    steps: u32,
    fail_at: Option<u32>,
    hold_at: Option<u32>,
    children: Vec<P>,
    at: u32,
}

fn p(name: &str, steps: u32) -> P {
    P {
        name: name.into(),
        steps,
        fail_at: None,
        hold_at: None,
        children: Vec::new(),
        at: 0,
    }
}

#[async_trait::async_trait]
impl Procedure<Log> for P {
    async fn execute(&mut self, ctx: &mut Context<Log>) -> Result<Flow<Log>, ProcError> {
        self.at += 1;
        ctx.env().push(format!("{} exec {}", self.name, self.at));
        if self.fail_at == Some(self.at) {
            return Err(ProcError::failed("planned"));
        }
        if self.hold_at == Some(self.at) {
            ctx.env().gate.notified().await;
        }
        if self.at == 1 && !self.children.is_empty() {
            let children = std::mem::take(&mut self.children);
            return Ok(Flow::Children(
                children.into_iter().map(|c| Box::new(c) as _).collect(),
            ));
        }
        Ok(if self.at >= self.steps {
            Flow::Done
        } else {
            Flow::MoreToDo
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<Log>) -> Result<(), ProcError> {
        ctx.env()
            .push(format!("{} rollback {}", self.name, self.at));
        self.at -= 1;
        Ok(())
    }
}

/// Stands in for the persistence actor: holds each `Persist` (or, `auto`, answers it
/// at once).
struct TestPersistence {
    held: Arc<Mutex<Vec<Persist>>>,
    auto: Arc<std::sync::atomic::AtomicBool>,
}

impl Actor for TestPersistence {
    type Context = Context_<Self>;
}

type Context_<A> = actix::Context<A>;

impl Handler<ToPersistence> for TestPersistence {
    type Result = ();

    fn handle(&mut self, msg: ToPersistence, _ctx: &mut Context_<Self>) {
        let mut held = self.held.lock().unwrap();
        held.extend(msg.0);
        if self.auto.load(std::sync::atomic::Ordering::SeqCst) {
            answer(held.drain(..).collect());
        }
    }
}

/// Answers `persists` as durable, in their order.
fn answer(persists: Vec<Persist>) {
    let mut mail = Mail::default();
    for persist in persists {
        persist.ack.send(Ok(()), &mut mail);
    }
    mail.send();
}

/// Stands in for the shard's scheduler: runs every queued step at once (or, while
/// `hold` is set, keeps it in `queued` for the test to run), and counts the steps that
/// finished.
struct TestScheduler {
    finished: Arc<Mutex<Vec<ProcId>>>,
    hold: Arc<std::sync::atomic::AtomicBool>,
    queued: Arc<Mutex<Vec<Enqueue>>>,
}

impl Actor for TestScheduler {
    type Context = Context_<Self>;
}

impl Handler<FromShard> for TestScheduler {
    type Result = ();

    fn handle(&mut self, msg: FromShard, _ctx: &mut Context_<Self>) {
        let mut mail = Mail::default();
        for m in msg.0 {
            match m {
                ToScheduler::Enqueue(e) => {
                    if self.hold.load(std::sync::atomic::Ordering::SeqCst) {
                        self.queued.lock().unwrap().push(e);
                    } else {
                        e.addr.run(&mut mail, e.what.1);
                    }
                }
                ToScheduler::StepFinished(f) => self.finished.lock().unwrap().push(f.0),
                ToScheduler::TreeEnded(_) => {}
            }
        }
        mail.send();
    }
}

/// Nothing of these tests asks for locks: whatever comes is dropped.
struct NoLocks;

impl Actor for NoLocks {
    type Context = Context_<Self>;
}

impl Handler<LocksFromShard> for NoLocks {
    type Result = ();

    fn handle(&mut self, _msg: LocksFromShard, _ctx: &mut Context_<Self>) {}
}

/// Stands in for the executor: keeps the tree's result.
struct TestExecutor {
    results: Arc<Mutex<Vec<TreeFinished>>>,
}

impl Actor for TestExecutor {
    type Context = Context_<Self>;
}

impl Handler<TreeFinished> for TestExecutor {
    type Result = ();

    fn handle(&mut self, msg: TreeFinished, _ctx: &mut Context_<Self>) {
        self.results.lock().unwrap().push(msg);
    }
}

impl Handler<TreeNews> for TestExecutor {
    type Result = ();

    fn handle(&mut self, _msg: TreeNews, _ctx: &mut Context_<Self>) {}
}

/// One tree on a shard of its own, its peers the test's actors.
struct Harness {
    log: Arc<Log>,
    tree: TreeAddr,
    root: ProcId,
    held: Arc<Mutex<Vec<Persist>>>,
    auto: Arc<std::sync::atomic::AtomicBool>,
    results: Arc<Mutex<Vec<TreeFinished>>>,
    steps_finished: Arc<Mutex<Vec<ProcId>>>,
    hold_steps: Arc<std::sync::atomic::AtomicBool>,
    queued_steps: Arc<Mutex<Vec<Enqueue>>>,
    submitted: oneshot::Receiver<Result<ProcId, Error>>,
}

impl Harness {
    /// Starts `root`'s tree; `auto`: every `Persist` is answered as it comes.
    fn start(root: P, auto: bool) -> Harness {
        let log = Arc::new(Log::default());
        let mut registry = Registry::new();
        registry.register::<P>("p");
        let views = Arc::new(SchedulerViews::default());
        let locks = LockActor::new(Vec::new(), views.clone()).start();
        let persistence = PersistenceActor::new(Box::new(MemoryStore::new()))
            .expect("a writer thread")
            .start();
        // The tree's address names a scheduler (the lock actor's grants would go
        // there): a real one, which nothing here uses.
        let scheduler = SchedulerActor::new(SchedulerSetup {
            workers: 1,
            queueing: Queueing {
                scheduling: Scheduling::Fifo,
                reserved: 0,
                system_workers: 0,
                system: Arc::new(HashSet::new()),
            },
            monitor: Monitor {
                every: Duration::from_secs(3600),
                stuck_after: Duration::from_secs(3600),
                retire_after: Duration::from_secs(3600),
            },
            view: views.clone(),
            locks: locks.clone(),
            mandate: crate::actors::shared::Mandate::new(None),
        })
        .start();
        let held = Arc::new(Mutex::new(Vec::new()));
        let auto = Arc::new(std::sync::atomic::AtomicBool::new(auto));
        let test_persistence = TestPersistence {
            held: held.clone(),
            auto: auto.clone(),
        }
        .start();
        let steps_finished = Arc::new(Mutex::new(Vec::new()));
        let hold_steps = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let queued_steps = Arc::new(Mutex::new(Vec::new()));
        let test_scheduler = TestScheduler {
            finished: steps_finished.clone(),
            hold: hold_steps.clone(),
            queued: queued_steps.clone(),
        }
        .start();
        let results = Arc::new(Mutex::new(Vec::new()));
        let executor = TestExecutor {
            results: results.clone(),
        }
        .start();
        let shard = Shard::new(ShardPeers {
            scheduler: test_scheduler.recipient(),
            locks: NoLocks.start().recipient(),
            persistence: test_persistence.recipient(),
        })
        .start();
        let env: Arc<AnyEnv> = log.clone();
        let shared = Arc::new(Shared::new(
            registry.into_types(),
            env,
            views,
            locks,
            persistence,
            executor.clone().recipient(),
            executor.recipient(),
            Vec::new(),
            vec![(shard, scheduler)],
            (0, crate::cluster::IdStripe::WHOLE),
            16,
            crate::cancel::Cancel::new(),
            crate::actors::shared::Mandate::new(None),
            crate::actors::shared::RestartLimit::default(),
            crate::policy::DEFAULT_ROLLBACK_RETRIES,
            None,
            (None, None),
            None,
        ));
        let proc = erase::<Log, P>(root);
        let root = declare(&shared, &*proc, now_ms()).unwrap_or_else(|_| panic!("declared"));
        let id = root.id;
        let tree = shared.new_tree(id);
        let (ack, submitted) = oneshot::channel();
        tree.start(TreeRunner::submit(shared, tree.clone(), root, proc, ack));
        Harness {
            log,
            tree,
            root: id,
            held,
            auto,
            results,
            steps_finished,
            hold_steps,
            queued_steps,
            submitted,
        }
    }

    /// Waits until a step is queued (while steps are held) and takes it.
    async fn queued_step(&self) -> Enqueue {
        loop {
            if let Some(step) = self.queued_steps.lock().unwrap().pop() {
                return step;
            }
            tokio::task::yield_now().await;
        }
    }

    /// Waits until `n` appends are held, then answers them in their order.
    async fn release(&self, n: usize) {
        let persists = loop {
            {
                let mut held = self.held.lock().unwrap();
                if held.len() >= n {
                    break held.drain(..n).collect::<Vec<_>>();
                }
            }
            tokio::task::yield_now().await;
        };
        answer(persists);
    }

    /// Waits until `n` appends are held.
    async fn until_held(&self, n: usize) {
        while self.held.lock().unwrap().len() < n {
            tokio::task::yield_now().await;
        }
    }

    /// Lets the messages in flight be handled.
    async fn settle(&self) {
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
    }

    /// Answers every append from now on, and waits for the tree's result.
    async fn finish(&self) -> TreeFinished {
        self.auto.store(true, std::sync::atomic::Ordering::SeqCst);
        let held: Vec<Persist> = self.held.lock().unwrap().drain(..).collect();
        answer(held);
        loop {
            if let Some(result) = self.results.lock().unwrap().pop() {
                return result;
            }
            tokio::task::yield_now().await;
        }
    }
}

/// Each step runs only once the transition before it is durable: with the appends
/// held, the tree does nothing; each answer lets exactly one more step run.
#[actix::test]
async fn a_step_runs_only_after_the_record_before_it_is_durable() {
    let mut h = Harness::start(p("a", 3), false);
    h.settle().await;
    assert!(
        h.log.calls().is_empty(),
        "nothing runs before the insert is durable"
    );
    h.release(1).await; // the insert
    assert_eq!((&mut h.submitted).await.unwrap().unwrap(), h.root);
    for step in 1..=3 {
        // Step `step` ran and its record is held: nothing more runs until it is
        // durable.
        h.until_held(1).await;
        h.settle().await;
        let expected: Vec<String> = (1..=step).map(|s| format!("a exec {s}")).collect();
        assert_eq!(h.log.calls(), expected, "step {step}");
        h.release(1).await;
    }
    let result = h.finish().await;
    assert!(matches!(result.result, Ok(Ok(()))));
    assert_eq!(
        h.steps_finished.lock().unwrap().len(),
        3,
        "each step's worker freed"
    );
}

/// A child fails: its tree rolls back by messages — the failed step and every
/// recorded step undone once, each procedure newest first, a parent only after its
/// children; a child that had already succeeded is not rolled back.
#[actix::test]
async fn a_failed_child_rolls_the_tree_back_newest_first() {
    let mut child_a = p("c1", 2);
    child_a.steps = 2;
    let mut child_b = p("c2", 3);
    child_b.fail_at = Some(2);
    let mut root = p("root", 2);
    root.children = vec![child_a, child_b];
    let h = Harness::start(root, true);
    let result = h.finish().await;
    let failure = result.result.unwrap().unwrap_err();
    assert_eq!(failure.error, ProcError::failed("planned"));
    let calls = h.log.calls();
    let rollbacks: Vec<&String> = calls.iter().filter(|c| c.contains("rollback")).collect();
    // c2's failed second step and its first; c1's recorded steps; the root's one.
    for (name, steps) in [("c2", 2), ("root", 1)] {
        let mine: Vec<&&String> = rollbacks
            .iter()
            .filter(|c| c.starts_with(&format!("{name} ")))
            .collect();
        let expected: Vec<String> = (1..=steps)
            .rev()
            .map(|s| format!("{name} rollback {s}"))
            .collect();
        assert_eq!(
            mine.iter().map(|c| c.as_str()).collect::<Vec<_>>(),
            expected,
            "{calls:?}"
        );
    }
    // c1 either succeeded before c2 failed (then it stays done) or was cut short (then
    // each step it ran is undone).
    let c1_executed = calls.iter().filter(|c| c.starts_with("c1 exec")).count();
    let c1_undone = rollbacks.iter().filter(|c| c.starts_with("c1 ")).count();
    let c1_succeeded = c1_executed == 2 && c1_undone == 0;
    assert!(c1_succeeded || c1_undone == c1_executed, "{calls:?}");
    assert_eq!(
        rollbacks.last().map(|c| c.as_str()),
        Some("root rollback 1"),
        "the parent last: {calls:?}"
    );
}

/// An abort sent to a running tree as a message: answered once the failure is
/// durable (not before), and the tree rolls back.
#[actix::test]
async fn an_abort_message_is_answered_once_durable_and_rolls_the_tree_back() {
    let mut h = Harness::start(p("a", 5), false);
    h.release(1).await; // the insert
    assert_eq!((&mut h.submitted).await.unwrap().unwrap(), h.root);
    h.release(1).await; // step 1's record
    h.settle().await;
    let (ack, mut answer) = oneshot::channel();
    h.tree.do_send(AbortRequest { id: h.root, ack });
    h.settle().await;
    assert!(
        matches!(answer.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        "not answered before the failure is durable"
    );
    let result = h.finish().await;
    assert!(answer.await.unwrap().unwrap(), "accepted");
    let failure = result.result.unwrap().unwrap_err();
    assert_eq!(failure.error, ProcError::Aborted);
    let calls = h.log.calls();
    let executed = calls.iter().filter(|c| c.contains("exec")).count();
    let undone = calls.iter().filter(|c| c.contains("rollback")).count();
    assert_eq!(undone, executed, "every executed step undone: {calls:?}");
}

/// The procedure's actor dies in the middle of a step (stopped from outside): its root
/// stack starts it again from the state it last reported, the cut-off step runs again
/// on the new actor, and the tree ends as if nothing had happened, its worker freed.
#[cfg(feature = "perturb")]
#[actix::test]
async fn a_procedure_actor_that_dies_in_a_step_is_started_again_by_its_root_stack() {
    use super::KillProcedure;
    let mut a = p("a", 3);
    a.hold_at = Some(2);
    let mut h = Harness::start(a, false);
    h.release(1).await; // the insert
    assert_eq!((&mut h.submitted).await.unwrap().unwrap(), h.root);
    h.release(1).await; // step 1's record: step 2 starts and waits at the gate
    while h.log.calls().len() < 2 {
        tokio::task::yield_now().await;
    }
    h.tree.do_send(KillProcedure {
        id: h.root,
        panic: false,
    });
    // The new actor runs step 2 again (from step 1's state), and waits again.
    while h.log.calls().len() < 3 {
        tokio::task::yield_now().await;
    }
    h.log.gate.notify_one();
    let result = h.finish().await;
    assert!(matches!(result.result, Ok(Ok(()))));
    assert_eq!(
        h.log.calls(),
        ["a exec 1", "a exec 2", "a exec 2", "a exec 3"],
        "the cut-off step ran again from the state before it"
    );
    assert_eq!(
        h.steps_finished.lock().unwrap().len(),
        3,
        "one worker a step"
    );
}

/// A step the scheduler sends straight to the procedure's actor, whose actor stopped
/// after the step was queued: the message goes back through the tree as it drops, and
/// the root stack hands it to the procedure's new actor, where it runs once.
#[cfg(feature = "perturb")]
#[actix::test]
async fn a_step_sent_straight_to_an_actor_that_stopped_comes_back_through_its_tree() {
    use super::KillProcedure;
    let mut h = Harness::start(p("a", 3), true);
    h.hold_steps
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!((&mut h.submitted).await.unwrap().unwrap(), h.root);
    // The first step, straight to the actor its submit started.
    let first = h.queued_step().await;
    assert!(first.addr.straight(), "queued with its actor");
    let mut mail = Mail::default();
    first.addr.run(&mut mail, first.what.1);
    mail.send();
    // The second, queued straight to the actor that ran the first; which then stops.
    let second = h.queued_step().await;
    assert!(second.addr.straight(), "queued with its actor");
    h.tree.do_send(KillProcedure {
        id: h.root,
        panic: false,
    });
    h.settle().await;
    h.hold_steps
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let mut mail = Mail::default();
    second.addr.run(&mut mail, second.what.1);
    mail.send();
    let result = tokio::time::timeout(Duration::from_secs(60), h.finish())
        .await
        .expect("the step sent to the stopped actor came back and ran");
    assert!(matches!(result.result, Ok(Ok(()))));
    assert_eq!(
        h.log.calls(),
        ["a exec 1", "a exec 2", "a exec 3"],
        "each step ran once"
    );
    assert_eq!(
        h.steps_finished.lock().unwrap().len(),
        3,
        "one worker a step"
    );
}
