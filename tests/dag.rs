//! DAG procedures end to end, on both stores: a failure in the middle of a 20-task DAG
//! rolls back exactly the started tasks against the edges, a DAG cut off by a crash-like
//! stop resumes on the same store, a cycle is refused, and a wave never runs more tasks
//! than the DAG's parallelism; a task's failure, and its failed rollback, follow its
//! policy; a task runs under its own locks; and past an irreversible task a failure
//! pauses the task until an operator continues it.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::{stores, Reopen};
use proctor::{
    async_trait, Context, Dag, DagBuilder, DagError, DagTask, Error, Executor, FailurePolicy, Lock,
    ProcError, ProcState, ProcedureStore, Registry, Task, TaskId,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Semaphore};

/// What the tests observe of the tasks.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// `exec x` and `rollback x`, in call order.
    calls: Vec<String>,
    /// Tasks inside `execute` now, and the most there ever were.
    running: usize,
    max_running: usize,
    /// Tasks that entered `execute`, in order.
    entered: Vec<String>,
}

struct Env {
    seen: watch::Sender<Seen>,
    /// `Kind::Permit` tasks take one each.
    permits: Semaphore,
    /// `Kind::Hold` tasks never end while this is set (the engine is stopped under them).
    hold: bool,
}

impl Env {
    fn new(hold: bool) -> Arc<Env> {
        Arc::new(Env {
            seen: watch::Sender::new(Seen::default()),
            permits: Semaphore::new(0),
            hold,
        })
    }

    fn calls(&self) -> Vec<String> {
        self.seen.borrow().calls.clone()
    }

    /// Waits until `until` holds for what has been seen.
    async fn wait(&self, until: impl FnMut(&Seen) -> bool) {
        let mut rx = self.seen.subscribe();
        rx.wait_for(until).await.expect("env alive");
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum Kind {
    Plain,
    /// Fail once every task named here has entered `execute`.
    FailAfter(Vec<String>),
    /// Never end while the environment holds.
    Hold,
    /// Wait for a permit.
    Permit,
    /// Fail the first N times.
    FailTimes(u32),
    /// Execute at once; roll back only once the named task's rollback has begun.
    UndoWith(String),
    /// Execute at once; the first N rollbacks fail.
    UndoFailsTimes(u32),
    /// End only once the named task has entered `execute`.
    Until(String),
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Job {
    name: String,
    kind: Kind,
    policy: FailurePolicy,
    irreversible: bool,
    locks: Vec<Lock>,
}

fn job(name: impl Into<String>, kind: Kind) -> Job {
    Job {
        name: name.into(),
        kind,
        policy: FailurePolicy::Rollback,
        irreversible: false,
        locks: Vec::new(),
    }
}

#[async_trait]
impl Task<Env> for Job {
    async fn execute(&self, ctx: &mut Context<Env>) -> Result<(), ProcError> {
        let env = ctx.env();
        env.seen.send_modify(|s| {
            s.calls.push(format!("exec {}", self.name));
            s.entered.push(self.name.clone());
            s.running += 1;
            s.max_running = s.max_running.max(s.running);
        });
        let result = match &self.kind {
            Kind::Plain | Kind::UndoWith(_) | Kind::UndoFailsTimes(_) => Ok(()),
            Kind::FailAfter(others) => {
                env.wait(|s| others.iter().all(|o| s.entered.contains(o)))
                    .await;
                Err(ProcError::failed(format!("{} broke", self.name)))
            }
            Kind::Until(other) => {
                env.wait(|s| s.entered.contains(other)).await;
                Ok(())
            }
            Kind::Hold if env.hold => std::future::pending().await,
            Kind::Hold => Ok(()),
            Kind::Permit => {
                env.permits.acquire().await.expect("open").forget();
                Ok(())
            }
            Kind::FailTimes(n) => {
                let failed = env
                    .seen
                    .borrow()
                    .calls
                    .iter()
                    .filter(|c| **c == format!("exec {}", self.name))
                    .count();
                if failed <= *n as usize {
                    Err(ProcError::failed(format!("{} broke", self.name)))
                } else {
                    Ok(())
                }
            }
        };
        env.seen.send_modify(|s| s.running -= 1);
        result
    }

    async fn rollback(&self, ctx: &mut Context<Env>) -> Result<(), ProcError> {
        let env = ctx.env();
        env.seen
            .send_modify(|s| s.calls.push(format!("rollback {}", self.name)));
        match &self.kind {
            Kind::UndoWith(other) => {
                let begun = format!("rollback {other}");
                env.wait(|s| s.calls.contains(&begun)).await;
            }
            Kind::UndoFailsTimes(n) => {
                let mine = format!("rollback {}", self.name);
                let tries = env.calls().iter().filter(|c| **c == mine).count();
                if tries <= *n as usize {
                    return Err(ProcError::failed(format!("{} is stuck", self.name)));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        self.policy
    }

    fn irreversible(&self) -> bool {
        self.irreversible
    }

    fn locks(&self) -> Vec<Lock> {
        self.locks.clone()
    }
}

async fn start(store: Box<dyn ProcedureStore>, env: Arc<Env>, workers: usize) -> Executor<Env> {
    let mut registry = Registry::new();
    registry
        .register::<Dag<Job>>("dag")
        .register::<DagTask<Job>>("dag_task");
    Executor::builder()
        .registry(registry)
        .store(store)
        .workers(workers)
        .env(env)
        .start()
        .await
        .expect("executor starts")
}

/// Position of the first (or, with `last`, the last) occurrence of `call`.
fn position(calls: &[String], call: &str, last: bool) -> Option<usize> {
    if last {
        calls.iter().rposition(|c| c == call)
    } else {
        calls.iter().position(|c| c == call)
    }
}

/// Five layers of four tasks; each task of a layer depends on one or two tasks of the
/// layer before (seeded), sometimes also on one two layers up. So a task's layer is
/// its depth.
fn layered(seed: u64) -> (Vec<String>, Vec<(usize, usize)>) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let names: Vec<String> = (0..20).map(|t| format!("t{t}")).collect();
    let mut edges = Vec::new();
    for t in 4..20 {
        let layer = t / 4;
        let before = |l: usize, rng: &mut fastrand::Rng| (l * 4) + rng.usize(0..4);
        let first = before(layer - 1, &mut rng);
        edges.push((first, t));
        if rng.bool() {
            let second = before(layer - 1, &mut rng);
            if second != first {
                edges.push((second, t));
            }
        }
        if layer >= 2 && rng.u8(0..3) == 0 {
            edges.push((before(layer - 2, &mut rng), t));
        }
    }
    (names, edges)
}

#[actix::test]
async fn a_failure_mid_dag_rolls_back_exactly_the_started_tasks_against_the_edges() {
    for seed in [7, 42] {
        for (store_name, store, _dir) in stores() {
            let env = Env::new(false);
            let executor = start(store, env.clone(), 8).await;
            let (names, edges) = layered(seed);
            // t9 (layer 2) fails once the rest of its layer has started.
            let failing = 9;
            let layer_mates: Vec<String> = (8..12)
                .filter(|&t| t != failing)
                .map(|t| names[t].clone())
                .collect();
            let mut b = DagBuilder::new();
            let ids: Vec<TaskId> = names
                .iter()
                .enumerate()
                .map(|(t, name)| {
                    let kind = if t == failing {
                        Kind::FailAfter(layer_mates.clone())
                    } else {
                        Kind::Plain
                    };
                    b.add(job(name, kind))
                })
                .collect();
            for &(x, y) in &edges {
                b.edge(ids[x], ids[y]);
            }
            b.parallelism(4);
            let id = executor.submit(b.build().unwrap()).await.unwrap();
            let failure = executor.wait(id).await.unwrap().unwrap_err();
            let at = format!("{store_name}, seed {seed}");
            assert_eq!(failure.error, ProcError::failed("t9 broke"), "{at}");
            assert_eq!(failure.type_name, "dag_task", "{at}");

            let calls = env.calls();
            let count = |call: String| calls.iter().filter(|c| **c == call).count();
            let undone: Vec<bool> = names
                .iter()
                .map(|name| count(format!("rollback {name}")) == 1)
                .collect();
            for (t, name) in names.iter().enumerate() {
                let (execs, rollbacks) = (
                    count(format!("exec {name}")),
                    count(format!("rollback {name}")),
                );
                if t < 12 {
                    // Layers 0 to 2: all ran before t9 failed (it waits for its mates),
                    // and each is undone once.
                    assert_eq!((execs, rollbacks), (1, 1), "{at}: {name}: {calls:?}");
                    continue;
                }
                // Later layers: a task starts as soon as its predecessors are done, so
                // one may have started (and even run) before t9 failed; whatever
                // started is undone once, run or not, and nothing else.
                assert!(
                    execs <= rollbacks && rollbacks <= 1,
                    "{at}: {name} ran {execs}, undone {rollbacks}: {calls:?}"
                );
                if rollbacks == 1 {
                    for &(x, _) in edges.iter().filter(|&&(_, y)| y == t) {
                        assert_eq!(
                            count(format!("exec {}", names[x])),
                            1,
                            "{at}: {name} started before its predecessor {} ran: {calls:?}",
                            names[x]
                        );
                    }
                }
            }
            let execs = calls.iter().filter(|c| c.starts_with("exec")).count();
            let first_rollback = calls.iter().position(|c| c.starts_with("rollback"));
            assert_eq!(
                first_rollback,
                Some(execs),
                "{at}: every rollback after every execute: {calls:?}"
            );
            for &(x, y) in &edges {
                if undone[x] && undone[y] {
                    let undo =
                        |t: usize| position(&calls, &format!("rollback {}", names[t]), false);
                    assert!(
                        undo(y) < undo(x),
                        "{at}: {} → {}: the later task is undone first: {calls:?}",
                        names[x],
                        names[y]
                    );
                }
            }
            assert_eq!(
                executor.state(id).await.unwrap().state,
                ProcState::RolledBack,
                "{at}"
            );
            executor.shutdown().await.unwrap();
        }
    }
}

#[actix::test]
async fn a_dag_stopped_mid_wave_resumes_after_a_restart() {
    for store_name in common::STORES {
        let store = Reopen::new(store_name);
        // a → {b, c, d} → e → f, two at a time: b and c are cut off by the stop.
        let names = ["a", "b", "c", "d", "e", "f"];
        let mut b = DagBuilder::new();
        let ids: HashMap<&str, TaskId> = names
            .iter()
            .map(|&n| {
                let kind = if n == "b" || n == "c" {
                    Kind::Hold
                } else {
                    Kind::Plain
                };
                (n, b.add(job(n, kind)))
            })
            .collect();
        let edges = [
            ("a", "b"),
            ("a", "c"),
            ("a", "d"),
            ("b", "e"),
            ("c", "e"),
            ("d", "e"),
            ("e", "f"),
        ];
        for (x, y) in edges {
            b.edge(ids[x], ids[y]);
        }
        b.parallelism(2).lock(Lock::exclusive("dags/d1"));

        let first_env = Env::new(true);
        let first = start(store.open(), first_env.clone(), 4).await;
        let id = first.submit(b.build().unwrap()).await.unwrap();
        first_env
            .wait(|s| ["b", "c"].iter().all(|n| s.entered.iter().any(|e| e == n)))
            .await;
        let info = first.state(id).await.unwrap();
        assert_eq!(
            info.state_name.as_deref(),
            Some("1/6 done, 2 running; tasks dssrww; edges 0>1 0>2 0>3 1>4 2>4 3>4 4>5"),
            "{store_name}: the DAG's progress is its state name"
        );
        assert_eq!(
            info.locks_held,
            [Lock::exclusive("dags/d1")],
            "{store_name}: the DAG holds its lock for life, its tasks run under it"
        );
        let tasks = first.list(proctor::List::new().root(id)).await.unwrap();
        let running = tasks
            .iter()
            .filter(|p| p.type_name == "dag_task" && p.state == ProcState::Runnable)
            .count();
        assert_eq!(
            running, 2,
            "{store_name}: each started task is a child: {tasks:?}"
        );
        first.shutdown_now().await.unwrap();
        let before = first_env.calls();
        assert_eq!(before[0], "exec a", "{store_name}");
        assert_eq!(before.len(), 3, "{store_name}: {before:?}");

        let second_env = Env::new(false);
        let second = start(store.open(), second_env.clone(), 4).await;
        assert_eq!(second.wait(id).await.unwrap(), Ok(()), "{store_name}");
        let after = second_env.calls();
        let mut rerun: Vec<&str> = after[..2].iter().map(String::as_str).collect();
        rerun.sort();
        assert_eq!(
            rerun,
            ["exec b", "exec c"],
            "{store_name}: the cut-off tasks run again first: {after:?}"
        );
        assert_eq!(after[2..], ["exec d", "exec e", "exec f"], "{store_name}");

        let all: Vec<String> = before.into_iter().chain(after).collect();
        for (x, y) in edges {
            let done = position(&all, &format!("exec {x}"), true);
            let next = position(&all, &format!("exec {y}"), false);
            assert!(done < next, "{store_name}: {x} → {y}: {all:?}");
        }
        second.shutdown().await.unwrap();
    }
}

#[test]
fn a_cycle_is_refused_with_its_tasks() {
    let mut b = DagBuilder::new();
    let names = ["create", "assign", "open", "report"];
    let ids: Vec<TaskId> = names.iter().map(|n| b.add(job(*n, Kind::Plain))).collect();
    b.edge(ids[0], ids[1])
        .edge(ids[1], ids[2])
        .edge(ids[2], ids[1])
        .edge(ids[2], ids[3]);
    let err = b.build().unwrap_err();
    let text = err.to_string();
    match err {
        DagError::Cycle { tasks, names } => {
            assert_eq!(tasks, [ids[1], ids[2]]);
            assert!(names[0].contains("assign") && names[1].contains("open"));
        }
        other => panic!("{other:?}"),
    }
    assert!(
        text.contains("#1") && text.contains("assign") && text.contains("#2"),
        "{text}"
    );
}

#[actix::test]
async fn never_more_tasks_run_at_once_than_the_parallelism() {
    const TASKS: usize = 20;
    const LIMIT: usize = 3;
    for (store_name, store, _dir) in stores() {
        let env = Env::new(false);
        let executor = start(store, env.clone(), 8).await;
        let mut b = DagBuilder::new();
        for t in 0..TASKS {
            b.add(job(format!("p{t}"), Kind::Permit));
        }
        b.parallelism(LIMIT);
        let id = executor.submit(b.build().unwrap()).await.unwrap();
        let mut entered = 0;
        while entered < TASKS {
            // A whole wave is inside `execute`, waiting for permits: let it go.
            let wave = LIMIT.min(TASKS - entered);
            env.wait(|s| s.entered.len() == entered + wave && s.running == wave)
                .await;
            entered += wave;
            env.permits.add_permits(wave);
        }
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        let seen = env.seen.borrow().clone();
        assert_eq!(seen.max_running, LIMIT, "{store_name}");
        assert_eq!(seen.entered.len(), TASKS, "{store_name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_task_failure_follows_the_tasks_policy() {
    for (store_name, store, _dir) in stores() {
        let env = Env::new(false);
        let executor = start(store, env.clone(), 4).await;
        let mut b = DagBuilder::new();
        let a = b.add(job("a", Kind::Plain));
        let mut flaky = job("b", Kind::FailTimes(2));
        flaky.policy = FailurePolicy::RetryThenRollback {
            times: 3,
            backoff_ms: 1,
        };
        let flaky = b.add(flaky);
        b.edge(a, flaky);
        let id = executor.submit(b.build().unwrap()).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        assert_eq!(
            env.calls(),
            ["exec a", "exec b", "exec b", "exec b"],
            "{store_name}: b was retried, nothing rolled back"
        );
        executor.shutdown().await.unwrap();
    }
}

/// A task whose rollback fails follows its own policy too: under `Pause` the DAG's
/// rollback pauses (ROLLBACK_PAUSED) until an operator continues it, and the task's
/// rollback then runs again and the DAG ends rolled back.
#[actix::test]
async fn a_tasks_failed_rollback_follows_the_tasks_policy() {
    for (store_name, store, _dir) in stores() {
        let env = Env::new(false);
        let executor = start(store, env.clone(), 4).await;
        let mut b = DagBuilder::new();
        let mut stuck = job("a", Kind::UndoFailsTimes(1));
        stuck.policy = FailurePolicy::Pause;
        let a = b.add(stuck);
        let fails = b.add(job("b", Kind::FailTimes(u32::MAX)));
        b.edge(a, fails);
        let id = executor.submit(b.build().unwrap()).await.unwrap();
        common::wait_for_state(&executor, id, ProcState::RollbackPaused).await;
        let info = executor.state(id).await.unwrap();
        let paused = info.steering.paused.expect("why it paused");
        assert_eq!(paused.policy, Some(FailurePolicy::Pause), "{store_name}");
        assert!(
            paused
                .error
                .is_some_and(|e| e.to_string().contains("a is stuck")),
            "{store_name}"
        );
        executor.resume(id).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert!(
            failure.error.to_string().contains("b broke"),
            "{store_name}"
        );
        assert_eq!(
            env.calls(),
            ["exec a", "exec b", "rollback b", "rollback a", "rollback a"],
            "{store_name}: b (started, failed) undone first; a's rollback ran again after the continue"
        );
        executor.shutdown().await.unwrap();
    }
}

/// A task's own locks (`Task::locks`) are held while it runs: its child procedure
/// shows them, and they are free once the DAG is done.
#[actix::test]
async fn a_task_runs_under_its_own_locks() {
    for (store_name, store, _dir) in stores() {
        let env = Env::new(false);
        let executor = start(store, env.clone(), 4).await;
        let mut b = DagBuilder::new();
        let mut locked = job("a", Kind::Permit);
        locked.locks = vec![Lock::exclusive("tables/t1")];
        b.add(locked);
        let id = executor.submit(b.build().unwrap()).await.unwrap();
        env.wait(|s| s.running == 1).await;
        let tree = executor.list(proctor::List::new().root(id)).await.unwrap();
        let task = tree
            .iter()
            .find(|p| p.parent == Some(id))
            .expect("a's child");
        assert_eq!(
            task.locks_held,
            [Lock::exclusive("tables/t1")],
            "{store_name}"
        );
        env.permits.add_permits(1);
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        // Free again: another DAG whose task takes the same lock runs.
        let mut again = DagBuilder::new();
        let mut locked = job("b", Kind::Plain);
        locked.locks = vec![Lock::exclusive("tables/t1")];
        again.add(locked);
        let id = executor.submit(again.build().unwrap()).await.unwrap();
        let waited = tokio::time::timeout(std::time::Duration::from_secs(60), executor.wait(id))
            .await
            .expect("the lock is free again");
        assert_eq!(waited.unwrap(), Ok(()), "{store_name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn past_an_irreversible_task_a_failure_pauses_until_continued() {
    for store_name in common::STORES {
        let store = Reopen::new(store_name);
        let env = Env::new(false);
        let executor = start(store.open(), env.clone(), 4).await;
        let mut events = executor.subscribe().await.unwrap();
        // a → !x → c, and d beside them: c fails once, after the point of no return.
        let mut b = DagBuilder::new();
        let a = b.add(job("a", Kind::Plain));
        let mut x = job("x", Kind::Plain);
        x.irreversible = true;
        let x = b.add(x);
        let c = b.add(job("c", Kind::FailTimes(1)));
        b.add(job("d", Kind::Plain));
        b.edge(a, x).edge(x, c);
        let id = executor.submit(b.build().unwrap()).await.unwrap();
        let paused = loop {
            if let proctor::ProcEvent::Paused { id: p, root, .. } = events.next().await.unwrap() {
                assert_eq!(root, id, "{store_name}");
                break p;
            }
        };
        assert_eq!(
            executor.state(paused).await.unwrap().type_name,
            "dag_task",
            "{store_name}: the failing task is paused, not the DAG"
        );
        let refused = executor.abort(id).await.unwrap_err();
        assert!(
            matches!(&refused, Error::Refused { reason, .. } if reason.contains("continue instead")),
            "{store_name}: {refused}"
        );
        // Paused across a restart, then continued.
        executor.shutdown().await.unwrap();
        let executor = start(store.open(), env.clone(), 4).await;
        assert_eq!(
            executor.state(paused).await.unwrap().state,
            ProcState::Paused,
            "{store_name}"
        );
        executor.resume(paused).await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        let calls = env.calls();
        assert!(
            !calls.iter().any(|c| c.starts_with("rollback")),
            "{store_name}: {calls:?}"
        );
        // x ran alone: d (ready beside it) ran before it, c after it.
        let at = |call: &str| position(&calls, call, false).unwrap();
        assert!(
            at("exec d") < at("exec x") && at("exec x") < at("exec c"),
            "{calls:?}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn the_tasks_of_a_wave_roll_back_at_once() {
    for (store_name, store, _dir) in stores() {
        let env = Env::new(false);
        let executor = start(store, env.clone(), 4).await;
        // One wave of three: c fails once a and b ran; a's undo waits for b's to begin
        // and b's for a's, so only concurrent undos end.
        let mut b = DagBuilder::new();
        b.add(job("a", Kind::UndoWith("b".into())));
        b.add(job("b", Kind::UndoWith("a".into())));
        b.add(job("c", Kind::FailAfter(vec!["a".into(), "b".into()])));
        let id = executor.submit(b.build().unwrap()).await.unwrap();
        let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), executor.wait(id))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{store_name}: the undos waited for each other: {:?}",
                    env.calls()
                )
            });
        assert!(outcome.unwrap().is_err(), "{store_name}");
        let mut undone: Vec<String> = env
            .calls()
            .into_iter()
            .filter(|c| c.starts_with("rollback"))
            .collect();
        undone.sort();
        assert_eq!(
            undone,
            ["rollback a", "rollback b", "rollback c"],
            "{store_name}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn a_task_starts_once_its_predecessors_are_done_while_a_slower_one_runs() {
    for (store_name, store, _dir) in stores() {
        let env = Env::new(false);
        let executor = start(store, env.clone(), 4).await;
        // a → b, and slow beside them, which ends only once b has begun: b must start
        // while slow still runs (a DAG that waited for all it started would hang here).
        let mut dag = DagBuilder::new();
        let a = dag.add(job("a", Kind::Plain));
        let b = dag.add(job("b", Kind::Plain));
        dag.add(job("slow", Kind::Until("b".into())));
        dag.edge(a, b);
        let id = executor.submit(dag.build().unwrap()).await.unwrap();
        let outcome = tokio::time::timeout(std::time::Duration::from_secs(60), executor.wait(id))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{store_name}: b waited for slow, which waited for b: {:?}",
                    env.calls()
                )
            });
        assert_eq!(outcome.unwrap(), Ok(()), "{store_name}");
        let calls = env.calls();
        assert_eq!(calls.len(), 3, "{store_name}: {calls:?}");
        assert!(
            position(&calls, "exec a", false) < position(&calls, "exec b", false),
            "{store_name}: {calls:?}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn an_executor_whose_registry_lacks_a_dags_task_type_refuses_to_start() {
    let mut registry = Registry::new();
    registry.register::<Dag<Job>>("dag");
    let refused = Executor::builder()
        .registry(registry)
        .store(proctor::MemoryStore::new())
        .env(Env::new(false))
        .start()
        .await
        .expect_err("refused");
    let text = refused.to_string();
    assert!(matches!(refused, proctor::Error::Config(_)), "{text}");
    assert!(
        text.contains("\"dag\" starts children of type proctor::dag::DagTask<dag::Job>")
            && text.contains("Registry::register::<proctor::dag::DagTask<dag::Job>>"),
        "{text}"
    );
}
