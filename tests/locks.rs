//! Engine locks, driven through the executor's messages on both stores: contention
//! checked by the procedures themselves, FIFO per resource, children under their
//! parent's locks, counted resources, a deadlock between two trees (and one that only a
//! loan breaks), locks held across a restart, an abort of a waiting procedure, bad names,
//! and admission control.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use proctor::{
    async_trait, Context, Error, Executor, FailurePolicy, Flow, List, Lock, LockMode, ProcError,
    ProcId, ProcState, Procedure, ProcedureStore, Registry,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, Semaphore};

/// What the lock tests observe: which steps hold which resources right now (as the
/// procedures themselves register them), conflicts seen, and the order of calls.
struct World {
    /// resource -> (procedure name, mode)
    holding: Mutex<HashMap<String, Vec<(String, LockMode)>>>,
    conflicts: Mutex<Vec<String>>,
    calls: Mutex<Vec<String>>,
    /// For counted resources: how many holders were inside one at once, at most.
    in_counted: AtomicUsize,
    max_counted: AtomicUsize,
    signal: Notify,
    /// One permit per `Step::Signal` run (for waiting on several at once).
    signals: Semaphore,
    permits: Semaphore,
    /// How many `Step::MarkThenFailOnce` ran.
    marked: AtomicUsize,
}

impl Default for World {
    fn default() -> Self {
        World {
            holding: Mutex::default(),
            conflicts: Mutex::default(),
            calls: Mutex::default(),
            in_counted: AtomicUsize::new(0),
            max_counted: AtomicUsize::new(0),
            signal: Notify::new(),
            signals: Semaphore::new(0),
            permits: Semaphore::new(0),
            marked: AtomicUsize::new(0),
        }
    }
}

impl World {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    fn first(&self, call: &str) -> Option<usize> {
        self.calls().iter().position(|c| c == call)
    }
}

fn clash(a: &Lock, mode_b: LockMode, b: &str) -> bool {
    let ra = a.resource.as_str();
    let below = |upper: &str, lower: &str| {
        lower.len() > upper.len()
            && lower.starts_with(upper)
            && lower[upper.len()..].starts_with('/')
    };
    if ra == b {
        a.mode == LockMode::Exclusive || mode_b == LockMode::Exclusive
    } else if below(ra, b) {
        a.mode == LockMode::Exclusive
    } else if below(b, ra) {
        mode_b == LockMode::Exclusive
    } else {
        false
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
enum Step {
    More,
    /// Tell the test, then go on.
    Signal,
    /// Wait for a permit from the test, then go on.
    Permit,
    Children(Vec<Locker>),
    Suspend(String),
    /// Mark the tree's point of no return, then go on.
    Irreversible,
    /// The first time (in the world), mark the point of no return and fail; then go on.
    MarkThenFailOnce,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Locker {
    name: String,
    locks: Vec<Lock>,
    life: bool,
    plan: Vec<Step>,
    at: usize,
    /// Names of its ancestors (their locks cover it).
    ancestors: Vec<String>,
    counted: bool,
    /// After a restart, wait for the event again instead of re-running.
    #[serde(default)]
    stay_suspended: bool,
    /// A failed step is retried once (`RetryThenRollback`).
    #[serde(default)]
    retry_once: bool,
}

impl Locker {
    fn new(name: &str, locks: Vec<Lock>, life: bool, plan: Vec<Step>) -> Self {
        Locker {
            name: name.into(),
            locks,
            life,
            plan,
            at: 0,
            ancestors: Vec::new(),
            counted: false,
            stay_suspended: false,
            retry_once: false,
        }
    }

    /// Registers this procedure's locks in the world, noting any conflict with what
    /// other procedures registered.
    fn enter(&self, world: &World) {
        let mut holding = world.holding.lock().unwrap();
        for lock in &self.locks {
            for (resource, holders) in holding.iter() {
                for (who, mode) in holders {
                    let related = self.ancestors.contains(who) || *who == self.name;
                    if !related && clash(lock, *mode, resource) {
                        world.conflicts.lock().unwrap().push(format!(
                            "{} took {lock} while {who} held {mode:?} {resource}",
                            self.name
                        ));
                    }
                }
            }
        }
        for lock in &self.locks {
            let entry = holding.entry(lock.resource.clone()).or_default();
            if !entry.iter().any(|(who, _)| *who == self.name) {
                entry.push((self.name.clone(), lock.mode));
            }
        }
    }

    fn leave(&self, world: &World) {
        let mut holding = world.holding.lock().unwrap();
        for lock in &self.locks {
            if let Some(v) = holding.get_mut(&lock.resource) {
                v.retain(|(who, _)| *who != self.name);
            }
        }
    }
}

#[async_trait]
impl Procedure<World> for Locker {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        world
            .calls
            .lock()
            .unwrap()
            .push(format!("{}-exec", self.name));
        self.enter(&world);
        if self.counted && self.at == 0 {
            // Inside the counted resource from the first step to the last.
            let now = world.in_counted.fetch_add(1, Ordering::SeqCst) + 1;
            world.max_counted.fetch_max(now, Ordering::SeqCst);
        }
        // Give any conflicting step the chance to run now, if the engine let it.
        for _ in 0..3 {
            tokio::task::yield_now().await;
        }
        let step = self.plan.get(self.at).cloned();
        self.at += 1;
        let last = self.at >= self.plan.len();
        let flow = match step {
            None | Some(Step::More) if last => Flow::Done,
            None | Some(Step::More) => Flow::MoreToDo,
            Some(Step::Signal) => {
                world.signal.notify_one();
                world.signals.add_permits(1);
                if last {
                    Flow::Done
                } else {
                    Flow::MoreToDo
                }
            }
            Some(Step::Permit) => {
                world.permits.acquire().await.expect("open").forget();
                if last {
                    Flow::Done
                } else {
                    Flow::MoreToDo
                }
            }
            Some(Step::Children(children)) => Flow::Children(
                children
                    .into_iter()
                    .map(|mut c| {
                        c.ancestors = self.ancestors.clone();
                        c.ancestors.push(self.name.clone());
                        Box::new(c) as Box<dyn Procedure<World>>
                    })
                    .collect(),
            ),
            Some(Step::Suspend(event)) => Flow::Suspend(event),
            Some(Step::Irreversible) => {
                ctx.set_irreversible();
                if last {
                    Flow::Done
                } else {
                    Flow::MoreToDo
                }
            }
            Some(Step::MarkThenFailOnce) => {
                if world.marked.fetch_add(1, Ordering::SeqCst) == 0 {
                    ctx.set_irreversible();
                    self.leave(&world);
                    return Err(ProcError::failed("marked, then failed"));
                }
                if last {
                    Flow::Done
                } else {
                    Flow::MoreToDo
                }
            }
        };
        if self.counted && matches!(flow, Flow::Done) {
            world.in_counted.fetch_sub(1, Ordering::SeqCst);
        }
        // A lock held for one step is left at its end; one held for life when the
        // procedure is done (the engine releases it after that).
        if !self.life || matches!(flow, Flow::Done) {
            self.leave(&world);
        }
        Ok(flow)
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        let world = ctx.env();
        world
            .calls
            .lock()
            .unwrap()
            .push(format!("{}-rollback", self.name));
        self.leave(world);
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        self.locks.clone()
    }

    fn holds_lock(&self) -> bool {
        self.life
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        if self.retry_once {
            FailurePolicy::RetryThenRollback {
                times: 1,
                backoff_ms: 0,
            }
        } else {
            FailurePolicy::Rollback
        }
    }

    fn rerun_after_recover(&self, _event: &str) -> bool {
        !self.stay_suspended
    }
}

fn registry() -> Registry<World> {
    let mut r = Registry::new();
    r.register::<Locker>("locker");
    r
}

async fn start(
    store: Box<dyn ProcedureStore>,
    workers: usize,
    configure: impl FnOnce(proctor::ExecutorBuilder<World>) -> proctor::ExecutorBuilder<World>,
) -> (Executor<World>, Arc<World>) {
    let world = Arc::new(World::default());
    let builder = Executor::builder()
        .registry(registry())
        .store(store)
        .workers(workers)
        .env(world.clone());
    let executor = configure(builder).start().await.expect("executor starts");
    (executor, world)
}

/// The first child `parent` has, once it has one.
async fn first_child(executor: &Executor<World>, parent: ProcId) -> ProcId {
    loop {
        let list = executor.list(List::new().root(parent)).await.unwrap();
        if let Some(child) = list.iter().find(|p| p.parent == Some(parent)) {
            return child.id;
        }
        tokio::task::yield_now().await;
    }
}

/// Waits until `id` is reported waiting for its locks (polling, as an operator would).
async fn wait_for_lock_wait(executor: &Executor<World>, id: ProcId) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while executor.state(id).await.unwrap().locks_waiting.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "{id} never waited for its locks"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// 1 000 procedures over 10 tables and their regions, each with random shared and
/// exclusive needs, some with children that take a region of their parent's table:
/// the procedures never see two conflicting holders, all of them finish, and between
/// any two that conflict, the one submitted first runs first.
#[actix::test]
async fn contention_never_lets_conflicting_holders_in_and_keeps_fifo() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 8, |b| b).await;
        let mut rng = fastrand::Rng::with_seed(7);
        let mut submitted: Vec<(ProcId, Locker)> = Vec::new();
        for i in 0..1000 {
            let table = rng.usize(0..10);
            let mut locks = vec![Lock::shared("ns")];
            match rng.u8(0..4) {
                0 => locks.push(Lock::exclusive(format!("ns/t{table}"))),
                1 => locks.push(Lock::shared(format!("ns/t{table}"))),
                2 => locks.push(Lock::exclusive(format!("ns/t{table}/r{}", rng.u8(0..4)))),
                _ => {
                    locks.push(Lock::shared(format!("ns/t{table}/r{}", rng.u8(0..4))));
                    locks.push(Lock::exclusive(format!("ns/t{}", (table + 1) % 10)));
                }
            }
            let mut plan = vec![Step::More, Step::More];
            if i % 10 == 0 {
                // A child under its parent's locks, with a region of its own.
                let child = Locker::new(
                    &format!("p{i}c"),
                    vec![Lock::exclusive(format!("ns/t{table}/r9"))],
                    false,
                    vec![Step::More],
                );
                plan.insert(1, Step::Children(vec![child]));
            }
            let proc = Locker::new(&format!("p{i}"), locks, true, plan);
            let id = executor.submit(proc.clone()).await.expect("submit");
            submitted.push((id, proc));
        }
        for (id, _) in &submitted {
            assert_eq!(executor.wait(*id).await.expect("wait"), Ok(()), "{name}");
        }
        let conflicts = world.conflicts.lock().unwrap().clone();
        assert!(conflicts.is_empty(), "{name}: {conflicts:?}");
        let calls = world.calls();
        let first: HashMap<&str, usize> = calls
            .iter()
            .enumerate()
            .rev()
            .map(|(i, c)| (c.trim_end_matches("-exec"), i))
            .collect();
        let mut checked = 0;
        for (i, (_, a)) in submitted.iter().enumerate() {
            for (_, b) in &submitted[i + 1..] {
                let conflict = a
                    .locks
                    .iter()
                    .any(|la| b.locks.iter().any(|lb| clash(la, lb.mode, &lb.resource)));
                if conflict {
                    checked += 1;
                    assert!(
                        first[a.name.as_str()] < first[b.name.as_str()],
                        "{name}: {} was submitted before {} and conflicts with it, but ran after",
                        a.name,
                        b.name
                    );
                }
            }
        }
        assert!(checked > 10_000, "{name}: only {checked} conflicting pairs");
        executor.shutdown_now().await.unwrap();
    }
}

/// A counted resource with 2 permits lets 2 of its holders in together, and never 3.
#[actix::test]
async fn a_counted_resource_lets_n_holders_run() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 8, |b| b.permits("ddl/db1", 2)).await;
        let mut ids = Vec::new();
        for i in 0..12 {
            let mut p = Locker::new(
                &format!("d{i}"),
                vec![Lock::shared("ddl/db1")],
                true,
                vec![Step::Signal, Step::Permit, Step::More],
            );
            p.counted = true;
            ids.push(executor.submit(p).await.unwrap());
        }
        // Two holders are inside at once, each waiting for a permit in its second step.
        world.signals.acquire_many(2).await.unwrap().forget();
        assert_eq!(world.in_counted.load(Ordering::SeqCst), 2, "{name}");
        world.permits.add_permits(12);
        for id in ids {
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        }
        assert_eq!(world.max_counted.load(Ordering::SeqCst), 2, "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// A root holding `mine` for its life (after `first`, if any): it signals, waits for a
/// permit, then starts a child that asks for `theirs`.
fn crossing(n: &str, mine: &str, theirs: &str, first: Option<Step>) -> Locker {
    let child = Locker::new(
        &format!("{n}-child"),
        vec![Lock::exclusive(theirs)],
        false,
        vec![Step::More],
    );
    let plan = first.into_iter().chain([
        Step::Signal,
        Step::Permit,
        Step::Children(vec![child]),
        Step::More,
    ]);
    Locker::new(n, vec![Lock::exclusive(mine)], true, plan.collect())
}

/// Each tree holds one resource for its life, and its child asks for the other's: the
/// younger tree fails with a deadlock error naming both procedures and resources, and
/// rolls back; the older one finishes.
#[actix::test]
async fn a_deadlock_between_two_trees_fails_the_younger() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 4, |b| b).await;
        let tree = |n, mine, theirs| crossing(n, mine, theirs, None);
        let a = executor.submit(tree("a", "res/1", "res/2")).await.unwrap();
        world.signal.notified().await;
        let b = executor.submit(tree("b", "res/2", "res/1")).await.unwrap();
        world.signal.notified().await;
        // Both roots hold their resource; let them start their children.
        world.permits.add_permits(2);
        let failure = executor.wait(b).await.unwrap().expect_err("b deadlocks");
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()), "{name}");
        let ProcError::Deadlock(text) = &failure.error else {
            panic!("{name}: {failure}");
        };
        for needle in [
            format!("(tree {a}) waits for [X res/2] held by procedure {b} (tree {b})"),
            format!("waits for [X res/1] held by procedure {a} (tree {a})"),
            format!("of the younger tree {b}"),
        ] {
            assert!(text.contains(&needle), "{name}: {needle:?} not in {text}");
        }
        assert!(world.first("b-rollback").is_some(), "{name}: b rolled back");
        assert!(world.first("b-child-exec").is_none(), "{name}");
        assert!(world.conflicts.lock().unwrap().is_empty());
        // Operators see the cycle and what the engine did about it.
        let report = executor.locks().await.unwrap();
        assert_eq!(report.cycles.len(), 1, "{name}: {report:?}");
        let cycle = &report.cycles[0];
        assert_eq!(
            cycle.resolution,
            format!("failed procedure {} (tree {b})", cycle.edges[0].waiter),
            "{name}"
        );
        let mut blockers: Vec<ProcId> = cycle.edges.iter().map(|e| e.blocker).collect();
        blockers.sort();
        assert_eq!(blockers, [a, b], "{name}: {cycle:?}");
        assert!(cycle.edges.iter().all(|e| e.held), "{name}");
        assert!(report.resources.is_empty(), "{name}: all released");
        executor.shutdown_now().await.unwrap();
    }
}

/// A deadlock no failure can break for good: tree `t` is past its point of no return
/// and holds X t0 for its life; its child `c` waits for X t1, which tree `f` holds for
/// its life; `f`'s child `g` then needs S t0/r0. The victim is `g` (its tree can roll
/// back), and `f` fails; but `g`'s rollback needs S t0/r0 too, and closes the cycle
/// again with `c` as its only waiter that can be failed. Failing `c` would only pause
/// it (a continue would close the cycle once more), so `c` borrows `f`'s locks: `f`
/// runs nothing until `g`'s rollback is granted, which waits for `t` to finish. Before,
/// `c` paused and both trees hung.
#[actix::test]
async fn a_step_past_the_point_of_no_return_borrows_from_a_tree_rolling_back() {
    borrow_past_the_point_of_no_return(Lock::exclusive("t0"), Lock::shared("t0/r0"), None).await;
}

/// The same cycle through a counted resource: `t` fills `srv` (1 permit) for its life,
/// and `g` needs a share of it. `g`'s wait could end by any holder of `srv` leaving,
/// but its only holder is `t`, which cannot finish before its waiting child `c`: the
/// cycle holds, and `c` borrows. Before, a wait on a counted resource never carried a
/// loan: `c` paused and both trees hung.
#[actix::test]
async fn a_cycle_through_a_counted_resource_the_cycle_fills_also_borrows() {
    borrow_past_the_point_of_no_return(Lock::shared("srv"), Lock::shared("srv"), Some(("srv", 1)))
        .await;
}

/// Tree `t` (irreversible, `t_lock` for its life, child `c` wanting X t1) against tree
/// `f` (X t1 for its life, child `g` wanting `g_lock`): see the two tests above.
async fn borrow_past_the_point_of_no_return(
    t_lock: Lock,
    g_lock: Lock,
    permits: Option<(&str, u32)>,
) {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 4, |b| match permits {
            Some((resource, n)) => b.permits(resource, n),
            None => b,
        })
        .await;
        let g = Locker::new(
            "g",
            vec![g_lock.clone()],
            false,
            vec![Step::More, Step::Suspend("g".into()), Step::More],
        );
        let f = executor
            .submit(Locker::new(
                "f",
                vec![Lock::exclusive("t1")],
                true,
                vec![Step::Children(vec![g])],
            ))
            .await
            .unwrap();
        // g has run its first step and is suspended.
        let [g] = common::waiting_children(&executor, f, 1).await[..] else {
            panic!("{name}: f has one child");
        };
        let c = Locker::new("c", vec![Lock::exclusive("t1")], false, vec![Step::More]);
        let t = executor
            .submit(Locker::new(
                "t",
                vec![t_lock.clone()],
                true,
                vec![Step::Irreversible, Step::Children(vec![c])],
            ))
            .await
            .unwrap();
        let c = first_child(&executor, t).await;
        wait_for_lock_wait(&executor, c).await;
        executor.wake_event("g").await.unwrap();

        let both = async { (executor.wait(t).await, executor.wait(f).await) };
        let Ok((t_result, f_result)) =
            tokio::time::timeout(std::time::Duration::from_secs(30), both).await
        else {
            let c = executor.state(c).await.unwrap();
            panic!(
                "{name}: the trees hang; c is {:?} ({:?})",
                c.state, c.steering
            );
        };
        assert_eq!(t_result.unwrap(), Ok(()), "{name}");
        let failure = f_result.unwrap().expect_err("f deadlocks");
        assert_eq!(failure.proc, g, "{name}: {failure}");
        assert!(
            matches!(failure.error, ProcError::Deadlock(_)),
            "{name}: {failure}"
        );
        // c ran under f's lock (the loan), before g's rollback and f's.
        let (c_exec, g_back, f_back) = (
            world.first("c-exec").expect("c ran"),
            world.first("g-rollback").expect("g rolled back"),
            world.first("f-rollback").expect("f rolled back"),
        );
        assert!(
            c_exec < g_back && g_back < f_back,
            "{name}: {:?}",
            world.calls()
        );
        assert_eq!(
            *world.conflicts.lock().unwrap(),
            ["c took X t1 while f held Exclusive t1"],
            "{name}: the loan, and nothing else"
        );
        executor.shutdown_now().await.unwrap();
    }
}

/// A cycle that a holder outside it ends: `srv` (2 permits) is filled for life by `t`
/// and by `x`, which is in a step (waiting for the test). `t`'s child `c` waits for
/// X p, which `a` holds for life; then `a`'s child `a2` needs S srv:
/// a2 -> t -> c -> a -> a2. Nothing holds `x` up, and its leaving ends `a2`'s wait,
/// so there is no deadlock: `a2` waits, and all three trees succeed. Before, the
/// younger tree `t` failed with a deadlock error and rolled back.
#[actix::test]
async fn a_cycle_a_holder_outside_it_ends_is_not_a_deadlock() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 4, |b| b.permits("srv", 2)).await;
        let in_srv = |n, life, plan| Locker {
            counted: true,
            ..Locker::new(n, vec![Lock::shared("srv")], life, plan)
        };
        let x = in_srv("x", true, vec![Step::Signal, Step::Permit]);
        let x = executor.submit(x).await.unwrap();
        world.signal.notified().await;
        let a2 = in_srv("a2", false, vec![Step::More]);
        let a = Locker::new(
            "a",
            vec![Lock::exclusive("p")],
            true,
            vec![Step::Suspend("a".into()), Step::Children(vec![a2])],
        );
        let a = executor.submit(a).await.unwrap();
        let c = Locker::new("c", vec![Lock::exclusive("p")], false, vec![Step::More]);
        let t = in_srv("t", true, vec![Step::Children(vec![c])]);
        let t = executor.submit(t).await.unwrap();
        let c = first_child(&executor, t).await;
        wait_for_lock_wait(&executor, c).await;
        // a holds p and is suspended (c waits for it); now it starts a2.
        executor.wake_event("a").await.unwrap();
        let a2 = first_child(&executor, a).await;
        // a2's request closes the cycle: it waits (before, c was failed at once).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let (a2_info, t_info) = (executor.state(a2).await, executor.state(t).await);
            if !a2_info.unwrap().locks_waiting.is_empty() || t_info.unwrap().result.is_some() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name}: a2 never asked"
            );
            tokio::task::yield_now().await;
        }
        world.permits.add_permits(1);
        for (tree, id) in [("x", x), ("a", a), ("t", t)] {
            let result = executor.wait(id).await.unwrap();
            assert_eq!(result, Ok(()), "{name}: tree {tree}");
        }
        // c ran once a (and so a2) was done; never more than two inside srv.
        let first = |call| {
            world
                .first(call)
                .unwrap_or_else(|| panic!("{name}: {call}"))
        };
        assert!(first("a2-exec") < first("c-exec"), "{name}");
        assert_eq!(world.max_counted.load(Ordering::SeqCst), 2, "{name}");
        assert!(world.conflicts.lock().unwrap().is_empty(), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// One wait closing two cycles. `srv` (3 permits) is filled for life by `c` (tree c,
/// suspended), `a` (tree a) and `e` (tree e). `c`'s child `c2` waits for X p, held by
/// `a` for life. Tree a is aborted: the rollback of its child `a2` waits for X q, held
/// by `b` for life. Tree b is aborted: the rollback of its child `b2` needs S srv. That
/// wait closes a cycle of rollbacks through `a` (nothing to fail, and no loan: `c` or
/// `e` leaving would end it) and one through `c` and `c2` (`c2` can be failed). Before,
/// the table stopped at the first cycle it met (through `a`) and all four trees hung;
/// now it fails `c2`, and everything finishes. `e` is held up by a wait (its child
/// `e2` waits for X z, which the suspended `z` holds): were it free to leave, `b2`
/// would just wait for it (`a_cycle_a_holder_outside_it_ends_is_not_a_deadlock`).
#[actix::test]
async fn a_wait_closing_two_cycles_breaks_the_one_that_can_be_broken() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 8, |b| b.permits("srv", 3)).await;
        let srv = || Lock::shared("srv");
        let suspended = |n: &str, locks: Vec<Lock>, mut plan: Vec<Step>| {
            plan.insert(0, Step::Suspend(n.to_string()));
            Locker::new(n, locks, true, plan)
        };
        let c2 = Locker::new("c2", vec![Lock::exclusive("p")], false, vec![Step::More]);
        let c = executor
            .submit(suspended("c", vec![srv()], vec![Step::Children(vec![c2])]))
            .await
            .unwrap();
        common::wait_for_state(&executor, c, ProcState::Waiting).await;
        // a2 takes X q for two steps, then waits for an event.
        let a2 = Locker::new(
            "a2",
            vec![Lock::exclusive("q")],
            false,
            vec![Step::More, Step::Suspend("a2".into()), Step::More],
        );
        let a = executor
            .submit(Locker::new(
                "a",
                vec![srv(), Lock::exclusive("p")],
                true,
                vec![Step::Children(vec![a2])],
            ))
            .await
            .unwrap();
        let [a2] = common::waiting_children(&executor, a, 1).await[..] else {
            panic!("{name}: a has one child");
        };
        // b2 takes S srv (the third permit) for two steps, then waits for an event.
        let b2 = Locker::new(
            "b2",
            vec![srv()],
            false,
            vec![Step::More, Step::Suspend("b2".into()), Step::More],
        );
        let b = executor
            .submit(Locker::new(
                "b",
                vec![Lock::exclusive("q")],
                true,
                vec![Step::Children(vec![b2])],
            ))
            .await
            .unwrap();
        common::waiting_children(&executor, b, 1).await;
        let z = executor
            .submit(suspended("z", vec![Lock::exclusive("z")], vec![Step::More]))
            .await
            .unwrap();
        common::wait_for_state(&executor, z, ProcState::Waiting).await;
        let e2 = Locker::new("e2", vec![Lock::exclusive("z")], false, vec![Step::More]);
        let e = executor
            .submit(Locker::new(
                "e",
                vec![srv()],
                true,
                vec![Step::Children(vec![e2])],
            ))
            .await
            .unwrap();
        wait_for_lock_wait(&executor, first_child(&executor, e).await).await;
        executor.wake_event("c").await.unwrap();
        let c2 = first_child(&executor, c).await;
        wait_for_lock_wait(&executor, c2).await;
        // a2's rollback waits for b's X q, then b2's closes the cycles.
        assert!(executor.abort(a).await.unwrap(), "{name}");
        wait_for_lock_wait(&executor, a2).await;
        assert!(executor.abort(b).await.unwrap(), "{name}");

        let trees = async {
            (
                executor.wait(a).await,
                executor.wait(b).await,
                executor.wait(c).await,
            )
        };
        let Ok((a_result, b_result, c_result)) =
            tokio::time::timeout(std::time::Duration::from_secs(30), trees).await
        else {
            panic!("{name}: the trees hang; calls {:?}", world.calls());
        };
        assert!(a_result.unwrap().is_err(), "{name}: a was aborted");
        assert!(b_result.unwrap().is_err(), "{name}: b was aborted");
        let failure = c_result.unwrap().expect_err("c deadlocks");
        assert_eq!(failure.proc, c2, "{name}: {failure}");
        assert!(
            matches!(failure.error, ProcError::Deadlock(_)),
            "{name}: {failure}"
        );
        executor.wake_event("z").await.unwrap();
        assert_eq!(executor.wait(z).await.unwrap(), Ok(()), "{name}");
        assert_eq!(executor.wait(e).await.unwrap(), Ok(()), "{name}");
        assert!(world.conflicts.lock().unwrap().is_empty(), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// The table hears that a tree passed its point of no return only once the step that
/// marks it is taken. Tree `a`'s first step marks it and fails; retried, it goes on
/// without the mark, so `a` can still roll back. When `a`'s and the younger `b`'s
/// children then deadlock, `b` being past its point of no return, the victim is `a`'s
/// child. (When the mark of the failed attempt reached the table, both trees looked
/// irreversible there and the younger `b`'s child was failed: it paused, and both
/// trees hung.)
#[actix::test]
async fn a_failed_step_that_marked_the_point_of_no_return_leaves_its_tree_the_victim() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 4, |b| b).await;
        let mut a = crossing("a", "res/1", "res/2", Some(Step::MarkThenFailOnce));
        a.retry_once = true;
        let a = executor.submit(a).await.unwrap();
        world.signal.notified().await;
        let b = executor
            .submit(crossing("b", "res/2", "res/1", Some(Step::Irreversible)))
            .await
            .unwrap();
        world.signal.notified().await;
        assert_eq!(world.marked.load(Ordering::SeqCst), 2, "{name}: a retried");
        world.permits.add_permits(2);
        let both = async { (executor.wait(a).await, executor.wait(b).await) };
        let Ok((a_result, b_result)) =
            tokio::time::timeout(std::time::Duration::from_secs(30), both).await
        else {
            panic!("{name}: the trees hang");
        };
        let failure = a_result.unwrap().expect_err("a is the deadlock's victim");
        assert!(
            matches!(failure.error, ProcError::Deadlock(_)),
            "{name}: {failure}"
        );
        assert_eq!(b_result.unwrap(), Ok(()), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// A procedure that holds its lock for life keeps it across a restart: after recovery
/// the lock is granted back before anything else runs, so a procedure submitted to the
/// new engine waits (and `List` says for what) until the holder finishes.
#[actix::test]
async fn life_long_locks_are_granted_back_after_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = start(store.open(), 4, |b| b).await;
        let mut holder = Locker::new(
            "holder",
            vec![Lock::exclusive("ns/t1")],
            true,
            vec![Step::Suspend("go".into()), Step::More],
        );
        holder.stay_suspended = true;
        let a = executor.submit(holder).await.unwrap();
        common::wait_for_state(&executor, a, ProcState::Waiting).await;
        let info = executor.state(a).await.unwrap();
        assert_eq!(info.locks_held, vec![Lock::exclusive("ns/t1")], "{name}");
        executor.shutdown_now().await.unwrap();

        let (executor, world) = start(store.open(), 4, |b| b).await;
        assert_eq!(executor.recovery().recovered_roots, vec![a]);
        let b = executor
            .submit(Locker::new(
                "later",
                vec![Lock::shared("ns/t1/r1")],
                false,
                vec![Step::More],
            ))
            .await
            .unwrap();
        // The newcomer waits for the recovered holder.
        wait_for_lock_wait(&executor, b).await;
        let list = executor
            .list(proctor::List::new().with_finished())
            .await
            .unwrap();
        let waiting = list
            .iter()
            .find(|p| p.id == b)
            .map(|p| p.locks_waiting.clone());
        assert_eq!(waiting, Some(vec![Lock::shared("ns/t1/r1")]), "{name}");
        let held = list
            .iter()
            .find(|p| p.id == a)
            .map(|p| p.locks_held.clone());
        assert_eq!(held, Some(vec![Lock::exclusive("ns/t1")]), "{name}");
        assert!(
            world.first("later-exec").is_none(),
            "{name}: ran under a held lock"
        );
        executor.wake_event("go").await.unwrap();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()));
        assert_eq!(executor.wait(b).await.unwrap(), Ok(()));
        let calls = world.calls();
        assert_eq!(calls, ["holder-exec", "later-exec"], "{name}");
        assert!(world.conflicts.lock().unwrap().is_empty());
        executor.shutdown_now().await.unwrap();
    }
}

/// A holder of `X t` for its life suspended on `go`, and a procedure waiting for `X t`.
async fn holder_and_waiter(executor: &Executor<World>) -> (ProcId, ProcId) {
    let holder = Locker::new(
        "holder",
        vec![Lock::exclusive("t")],
        true,
        vec![Step::Suspend("go".into()), Step::More],
    );
    let a = executor.submit(holder).await.unwrap();
    common::wait_for_state(executor, a, ProcState::Waiting).await;
    let waiter = Locker::new("waiter", vec![Lock::exclusive("t")], true, vec![Step::More]);
    let b = executor.submit(waiter).await.unwrap();
    wait_for_lock_wait(executor, b).await;
    (a, b)
}

/// A PAUSED procedure keeps the locks it holds for life, across a restart too: those
/// waiting for them wait until it is continued and finishes.
#[actix::test]
async fn a_paused_holder_keeps_its_locks_until_continued_and_done() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, world) = start(store.open(), 4, |b| b).await;
        let holder = Locker::new(
            "holder",
            vec![Lock::exclusive("t")],
            true,
            vec![Step::Suspend("go".into()), Step::More],
        );
        let a = executor
            .submit(Locker {
                stay_suspended: true,
                ..holder
            })
            .await
            .unwrap();
        common::wait_for_state(&executor, a, ProcState::Waiting).await;
        executor
            .pause(a)
            .await
            .expect("paused at once: it waits for an event");
        let waiter = Locker::new("waiter", vec![Lock::exclusive("t")], true, vec![Step::More]);
        let b = executor.submit(waiter).await.unwrap();
        wait_for_lock_wait(&executor, b).await;
        let info = executor.state(a).await.unwrap();
        assert_eq!(info.state, ProcState::Paused, "{name}");
        assert_eq!(info.locks_held, [Lock::exclusive("t")], "{name}");
        executor.shutdown_now().await.unwrap();

        let (executor, world2) = start(store.open(), 4, |b| b).await;
        let info = executor.state(a).await.unwrap();
        assert_eq!(
            (info.state, info.locks_held),
            (ProcState::Paused, vec![Lock::exclusive("t")]),
            "{name}: paused and holding, after the restart"
        );
        wait_for_lock_wait(&executor, b).await;
        executor.resume(a).await.unwrap();
        common::wait_for_state(&executor, a, ProcState::Waiting).await;
        executor.wake_event("go").await.unwrap();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()), "{name}");
        assert_eq!(executor.wait(b).await.unwrap(), Ok(()), "{name}");
        let calls = [world.calls(), world2.calls()].concat();
        assert_eq!(
            calls,
            ["holder-exec", "holder-exec", "waiter-exec"],
            "{name}"
        );
        assert!(world.conflicts.lock().unwrap().is_empty(), "{name}");
        assert!(world2.conflicts.lock().unwrap().is_empty(), "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// Aborting a procedure that waits for its lock fails it at once: it never runs, and
/// the holder is not disturbed.
#[actix::test]
async fn an_abort_of_a_waiting_procedure_does_not_wait_for_the_lock() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 4, |b| b).await;
        let (a, b) = holder_and_waiter(&executor).await;
        assert!(executor.abort(b).await.unwrap(), "{name}");
        let failure = executor.wait(b).await.unwrap().expect_err("aborted");
        assert_eq!(failure.error, ProcError::Aborted);
        assert!(world.first("waiter-exec").is_none(), "{name}");
        assert_eq!(executor.state(a).await.unwrap().state, ProcState::Waiting);
        executor.wake_event("go").await.unwrap();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()));
        executor.shutdown_now().await.unwrap();
    }
}

/// A resource name with an empty segment is refused at submit, naming it.
#[actix::test]
async fn a_bad_resource_name_is_refused_at_submit() {
    let (executor, _) = start(Box::new(proctor::MemoryStore::new()), 2, |b| b).await;
    let bad = Locker::new("bad", vec![Lock::exclusive("ns//t1")], false, vec![]);
    match executor.submit(bad).await {
        Err(Error::Invalid(text)) => assert!(text.contains("\"ns//t1\""), "{text}"),
        other => panic!("{other:?}"),
    }
    executor.shutdown_now().await.unwrap();
}

/// With a bound of 2 unfinished roots, a third submit is refused at once with a typed
/// error; once one finishes, submits are accepted again.
#[actix::test]
async fn submits_beyond_the_bound_are_refused_at_once() {
    for (name, store, _dir) in common::stores() {
        let (executor, _) = start(store, 4, |b| b.max_unfinished(2)).await;
        let idle =
            |n: &str| Locker::new(n, vec![], false, vec![Step::Suspend(n.into()), Step::More]);
        let a = executor.submit(idle("a")).await.unwrap();
        let _b = executor.submit(idle("b")).await.unwrap();
        match executor.submit(idle("c")).await {
            Err(Error::Overloaded { limit: 2 }) => {}
            other => panic!("{name}: {other:?}"),
        }
        executor.wake_event("a").await.unwrap();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()));
        executor.submit(idle("d")).await.expect("room again");
        executor.shutdown_now().await.unwrap();
    }
}

/// A procedure with locks that may fail at a step and may start children (the engine
/// hang the perturbation checker found: a rolled-back procedure kept its life-long
/// locks until its whole tree ended, so a sibling's or parent's rollback that needed
/// them waited for ever).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Failing {
    locks: Vec<Lock>,
    life: bool,
    steps: u32,
    fail_at: Option<u32>,
    children: Vec<Failing>,
    at: u32,
}

#[async_trait]
impl Procedure for Failing {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        self.at += 1;
        if self.fail_at == Some(self.at) {
            return Err(ProcError::failed("planned"));
        }
        if self.at == 1 && !self.children.is_empty() {
            let children = self.children.iter().cloned();
            return Ok(Flow::Children(
                children
                    .map(|c| Box::new(c) as Box<dyn Procedure>)
                    .collect(),
            ));
        }
        Ok(if self.at < self.steps {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        self.at -= 1;
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        self.locks.clone()
    }

    fn holds_lock(&self) -> bool {
        self.life
    }
}

fn failing(locks: Vec<Lock>, life: bool, steps: u32, fail_at: Option<u32>) -> Failing {
    Failing {
        locks,
        life,
        steps,
        fail_at,
        children: Vec::new(),
        at: 0,
    }
}

#[actix::test]
async fn a_rolled_back_procedure_frees_its_life_long_locks_for_the_rest_of_the_rollback() {
    let with = |mut p: Failing, children: Vec<Failing>| {
        p.children = children;
        p
    };
    let cases: Vec<(&str, Failing)> = vec![
        (
            // The root's own rollback (X t per step) needs what its failed child held
            // for life (S t/r).
            "parent after child",
            with(
                failing(vec![Lock::exclusive("t")], false, 2, None),
                vec![failing(vec![Lock::shared("t/r")], true, 1, Some(1))],
            ),
        ),
        (
            // A sibling's rollback (X t per step) needs what the failed sibling held.
            "sibling after sibling",
            with(
                failing(vec![], false, 2, None),
                vec![
                    failing(vec![Lock::exclusive("t")], false, 2, None),
                    failing(vec![Lock::exclusive("t/r")], true, 1, Some(1)),
                ],
            ),
        ),
        (
            // A sibling that never ran a step (skipped: another failed first) held its
            // life-long lock from the grant.
            "a skipped sibling",
            with(
                failing(vec![], false, 2, None),
                vec![
                    failing(vec![Lock::exclusive("t")], false, 2, None),
                    failing(vec![], false, 1, Some(1)),
                    failing(vec![Lock::exclusive("t/r")], true, 1, None),
                ],
            ),
        ),
    ];
    for (store_name, store, _dir) in common::stores() {
        let mut registry = Registry::new();
        registry.register::<Failing>("failing");
        let executor = Executor::builder()
            .registry(registry)
            .store(store)
            .workers(1)
            .start()
            .await
            .unwrap();
        for (case, root) in &cases {
            let id = executor.submit(root.clone()).await.unwrap();
            let result =
                tokio::time::timeout(std::time::Duration::from_secs(30), executor.wait(id))
                    .await
                    .unwrap_or_else(|_| panic!("{store_name} {case}: the rollback hangs"));
            assert!(result.unwrap().is_err(), "{store_name} {case}");
        }
        executor.shutdown_now().await.unwrap();
    }
}

/// A bypassed holder's locks are released: the procedure waiting for them runs. The
/// waiter itself cannot be bypassed (it is queued: no wait of the lock table, which a
/// loan could rest on, ends by a bypass of its waiter).
#[actix::test]
async fn a_bypassed_holder_releases_its_locks() {
    for (name, store, _dir) in common::stores() {
        let (executor, world) = start(store, 4, |b| b).await;
        let (a, b) = holder_and_waiter(&executor).await;
        let refused = executor.bypass(b, false).await;
        assert!(
            matches!(&refused, Err(Error::BypassRefused { id, .. }) if *id == b),
            "{name}: {refused:?}"
        );
        executor.bypass(a, false).await.unwrap();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()), "{name}");
        assert_eq!(executor.wait(b).await.unwrap(), Ok(()), "{name}");
        assert_eq!(world.calls(), ["holder-exec", "waiter-exec"], "{name}");
        executor.shutdown_now().await.unwrap();
    }
}
