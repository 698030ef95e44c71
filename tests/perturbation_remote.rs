//! Seeded randomized runs of remote operations under perturbation, against a history
//! checker: the remote dispatcher's races (a report against a removal, a late or
//! doubled report against a rollback, a crash between a dispatch and its report).
//!
//! Each seed submits a few roots; each dispatches one to four operations to random
//! nodes of four, waits for them, reads their outcomes, and — as the seed says — goes
//! on, dispatches once more, or fails when an operation failed (its tree rolls back).
//! Some roots give each operation its undo (`ctx.dispatch(..)?.undo(..)`), which a
//! rollback sends while the operation may be applied. The fake nodes answer some operations in the request's answer (a value, or a
//! failure on the node), hold the others for a reporter that reports them later in any
//! order, some twice, beside reports for operations nobody dispatched; some sends fail
//! and are retried; one node may die mid-run (its sends fail) and a watchdog removes
//! it (`remove_target`) until the end; an operator aborts a random root; and some seeds
//! crash the store at a random append and restart on it, whose dispatcher sends again
//! what was not reported. Perturbation points stall the actors' threads at random.
//!
//! The checks:
//!
//! - every tree ends (a lost wake-up hangs, and the run's timeout says so);
//! - a step that reads outcomes sees exactly the operations its previous step
//!   dispatched, each once, at the targets it chose; a re-run of that step after a
//!   restart sees the same operations with the same outcomes;
//! - a value the step sees is what the node reported for that operation, and the node
//!   applied it; `TargetGone` names only the dead node;
//! - a node receives an operation's id only with that operation's payload (ids are
//!   stable across re-sends), and applies it once;
//! - one engine takes at most one report per operation (`Executor::report` answers
//!   `true` once);
//! - an undo carries the undo its operation was dispatched with, and comes only for an
//!   operation of a root that did not succeed; in a run without a crash, none comes
//!   for an operation that failed on its node, each comes once, and none before a
//!   receipt of its operation (an operation is not sent again once its undo was).
//!
//! `PROCTOR_SEEDS` (default 16), `PROCTOR_SEED`, `PROCTOR_SEED_BASE` and
//! `PROCTOR_PERTURB_SECS` work as for `tests/perturbation.rs`.

mod common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proctor::testing::{CrashPoint, CrashingStore};
use proctor::{
    async_trait, perturb, Context, Error, Executor, Flow, MemoryStore, OpId, ProcError, ProcId,
    Procedure, ProcedureStore, Registry, RemoteOptions, Report, Transport, TransportError,
    WalStore,
};
use serde::{Deserialize, Serialize};

const NODES: [&str; 4] = ["dn-0", "dn-1", "dn-2", "dn-3"];
/// The node that may die.
const DEAD: &str = "dn-3";

/// An operation: which root's which dispatch it is.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct Op {
    tag: String,
}

/// What a step that read outcomes saw, one per operation: its id, target and outcome
/// (`Ok(tag)` from the value the node reported, or the error's text).
type Seen = Vec<(OpId, String, Result<String, String>)>;

/// What roots dispatched: (root, phase) -> [(target, tag)].
type Dispatched = BTreeMap<(ProcId, u8), Vec<(String, String)>>;

/// Everything the run observed, and the fake nodes' state.
#[derive(Default)]
struct World {
    rng: Mutex<Option<fastrand::Rng>>,
    /// The dead node's sends fail from now on.
    dead: AtomicBool,
    /// Every op id a node received, with its payload.
    received: Mutex<HashMap<OpId, Op>>,
    /// Receipts of ops, re-sends included.
    receipts: AtomicU32,
    /// Engines that crashed and were restarted on their store.
    restarts: AtomicU32,
    /// The ops a node applied (once each), with what it reported for each.
    applied: Mutex<HashMap<OpId, (String, Op)>>,
    /// Ops whose report the reporter sends later: (id, target, op, fails on the node).
    held: Mutex<Vec<(OpId, String, Op, bool)>>,
    /// What each root dispatched, per phase: (root, phase) -> [(target, tag)].
    dispatched: Mutex<Dispatched>,
    /// What each root saw, per phase, every time the step ran.
    seen: Mutex<Vec<(ProcId, u8, Seen)>>,
    /// Reports the engine took, per engine incarnation and op.
    taken: Mutex<HashMap<(u32, OpId), u32>>,
    /// Every receipt of an op id by a node, in order (re-sends included).
    order: Mutex<Vec<OpId>>,
    /// Ops that failed on their node (it reported a failure, at once or later).
    failed_on_node: Mutex<HashSet<OpId>>,
    /// How each root ended (`true`: SUCCESS), on the last engine that ran it.
    ended: Mutex<HashMap<ProcId, bool>>,
    incarnation: AtomicU32,
    violations: Mutex<Vec<String>>,
}

impl World {
    fn roll(&self, percent: u32) -> bool {
        let mut rng = self.rng.lock().unwrap();
        rng.as_mut().is_some_and(|r| r.u32(0..100) < percent)
    }

    fn violation(&self, text: String) {
        self.violations.lock().unwrap().push(text);
    }
}

struct Nodes(Arc<World>);

#[async_trait]
impl Transport for Nodes {
    type Op = Op;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, Op)>,
    ) -> Result<Vec<Report>, TransportError> {
        let world = &self.0;
        let delay = world
            .rng
            .lock()
            .unwrap()
            .as_mut()
            .map_or(0, |r| r.u64(0..3));
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if target == DEAD && world.dead.load(Ordering::SeqCst) {
            return Err(TransportError(format!("{target} is down")));
        }
        if world.roll(10) {
            return Err(TransportError(format!("{target} refused the connection")));
        }
        let mut reports = Vec::new();
        for (id, op) in ops {
            world.receipts.fetch_add(1, Ordering::SeqCst);
            world.order.lock().unwrap().push(id);
            let known = world.received.lock().unwrap().insert(id, op.clone());
            if known.as_ref().is_some_and(|k| *k != op) {
                world.violation(format!("{id} received as {known:?}, then as {op:?}"));
            }
            if let Some(of) = id.undoes() {
                // An undo carries its operation's undo, whenever it comes.
                let of_op = world.received.lock().unwrap().get(&of).cloned();
                let fits = match &of_op {
                    Some(of_op) => op.tag == format!("undo/{}", of_op.tag),
                    None => op.tag.starts_with("undo/"),
                };
                if !fits {
                    world.violation(format!("{id} carries {op:?}, the undo of {of_op:?}"));
                }
            }
            // The node applies an op once, whatever it is sent again.
            world
                .applied
                .lock()
                .unwrap()
                .entry(id)
                .or_insert_with(|| (target.to_string(), op.clone()));
            // An undo does not fail on its node (one that did would fail its
            // rollback, retried until it is paused for an operator).
            let fails = world.roll(10) && id.undoes().is_none();
            if fails {
                world.failed_on_node.lock().unwrap().insert(id);
            }
            if world.roll(40) {
                world
                    .held
                    .lock()
                    .unwrap()
                    .push((id, target.to_string(), op, fails));
            } else if fails {
                reports.push(Report::failed(id, "the node's disk is full"));
            } else {
                reports.push(Report::ok(id, &op.tag).unwrap());
            }
        }
        Ok(reports)
    }
}

/// A root: dispatches `ops` (target, tag), reads the outcomes; then, as planned,
/// dispatches `again` once more, and fails if an outcome failed and `strict`. With
/// `undo`, each operation is dispatched with its undo (tag `undo/TAG`).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Fan {
    ops: Vec<(String, String)>,
    again: Option<(String, String)>,
    strict: bool,
    phase: u8,
    undo: bool,
}

#[async_trait]
impl Procedure<World> for Fan {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env_arc().clone();
        let root = ctx.id();
        let batch = match self.phase {
            0 => self.ops.clone(),
            1 | 2 => {
                let dispatched = if self.phase == 1 { self.ops.len() } else { 1 };
                let results = ctx.remote_results();
                // Each phase's outcomes follow the earlier phases'.
                let latest = &results[results.len().saturating_sub(dispatched)..];
                let seen: Seen = latest
                    .iter()
                    .map(|r| {
                        let outcome = match &r.outcome {
                            Ok(_) => r.value::<String>().map_err(|e| e.to_string()),
                            Err(e) => Err(e.to_string()),
                        };
                        (r.op, r.target.clone(), outcome)
                    })
                    .collect();
                let failed = seen.iter().any(|(_, _, o)| o.is_err());
                world
                    .seen
                    .lock()
                    .unwrap()
                    .push((root, self.phase - 1, seen));
                if failed && self.strict {
                    return Err(ProcError::failed("a remote operation failed"));
                }
                match (&self.again, self.phase) {
                    (Some(again), 1) => vec![again.clone()],
                    _ => return Ok(Flow::Done),
                }
            }
            _ => return Ok(Flow::Done),
        };
        for (target, tag) in &batch {
            let dispatched = ctx.dispatch::<Nodes>(target.clone(), &Op { tag: tag.clone() })?;
            if self.undo {
                let tag = format!("undo/{tag}");
                dispatched.undo(&Op { tag })?;
            }
        }
        world
            .dispatched
            .lock()
            .unwrap()
            .insert((root, self.phase), batch);
        self.phase += 1;
        Ok(ctx.await_remote())
    }

    async fn rollback(&mut self, _ctx: &mut Context<World>) -> Result<(), ProcError> {
        Ok(())
    }
}

struct Plan {
    roots: Vec<Fan>,
    wal: bool,
    crash: Option<(usize, CrashPoint)>,
    /// When the dead node dies (reporter turns), if it does.
    dies_at: Option<u32>,
    abort: bool,
}

fn gen_plan(seed: u64) -> Plan {
    let mut rng = fastrand::Rng::with_seed(seed);
    // Drawn apart, so that a seed plans the rest as it did before undos.
    let mut undos = fastrand::Rng::with_seed(seed.rotate_left(17));
    let roots = (0..rng.usize(2..7))
        .map(|r| {
            let ops = (0..rng.usize(1..5))
                .map(|k| {
                    (
                        NODES[rng.usize(..NODES.len())].to_string(),
                        format!("r{r}-{k}"),
                    )
                })
                .collect();
            Fan {
                ops,
                again: rng
                    .bool()
                    .then(|| (NODES[rng.usize(..3)].to_string(), format!("r{r}-again"))),
                strict: rng.u32(0..3) == 0,
                phase: 0,
                undo: undos.bool(),
            }
        })
        .collect();
    Plan {
        roots,
        wal: rng.bool(),
        crash: (rng.u32(0..3) == 0).then(|| {
            let point = if rng.bool() {
                CrashPoint::BeforeWrite
            } else {
                CrashPoint::AfterWrite
            };
            (rng.usize(1..16), point)
        }),
        dies_at: rng.bool().then(|| rng.u32(0..40)),
        abort: rng.u32(0..4) == 0 || undos.u32(0..3) == 0,
    }
}

fn options() -> RemoteOptions {
    RemoteOptions::default()
        .max_ops(3)
        .max_age(Duration::from_millis(2))
        .retry_backoff(Duration::from_millis(1), Duration::from_millis(8))
        // Longer than a run may take: an operation the engine loses track of hangs the
        // run rather than ending at its deadline.
        .deadline(Duration::from_secs(30))
}

async fn start(store: impl ProcedureStore, world: &Arc<World>) -> Executor<World> {
    let mut registry = Registry::new();
    registry.register::<Fan>("fan");
    world.incarnation.fetch_add(1, Ordering::SeqCst);
    Executor::builder()
        .registry(registry)
        .store(store)
        .workers(3)
        .env(world.clone())
        .remote(Nodes(world.clone()), options())
        .start()
        .await
        .unwrap()
}

/// Reports the held ops in random order, some twice, beside unknown ones; kills the
/// dead node when planned and from then on removes it, until stopped.
fn spawn_reporter(
    executor: Executor<World>,
    world: Arc<World>,
    dies_at: Option<u32>,
    going: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    actix::spawn(async move {
        let mut turn = 0u32;
        while going.load(Ordering::SeqCst) {
            turn += 1;
            if dies_at.is_some_and(|at| turn >= at) {
                world.dead.store(true, Ordering::SeqCst);
                if executor.remove_target(DEAD).await.is_err() {
                    return;
                }
            }
            let mut held = std::mem::take(&mut *world.held.lock().unwrap());
            if let Some(rng) = world.rng.lock().unwrap().as_mut() {
                rng.shuffle(&mut held);
            }
            for (id, _target, op, fails) in held {
                let times = if world.roll(20) { 2 } else { 1 };
                for _ in 0..times {
                    let report = if fails {
                        Report::failed(id, "the node's disk is full")
                    } else {
                        Report::ok(id, &op.tag).unwrap()
                    };
                    match executor.report(report).await {
                        Ok(true) => {
                            let incarnation = world.incarnation.load(Ordering::SeqCst);
                            *world
                                .taken
                                .lock()
                                .unwrap()
                                .entry((incarnation, id))
                                .or_default() += 1;
                        }
                        Ok(false) => {}
                        // The engine crashed: the node reports again to the next one.
                        Err(_) => {
                            world
                                .held
                                .lock()
                                .unwrap()
                                .push((id, String::new(), op.clone(), fails))
                        }
                    }
                }
            }
            if world.roll(10) {
                let _ = executor
                    .report(Report::failed(OpId(1 << 50), "never sent"))
                    .await;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
}

async fn run_seed(seed: u64) -> Arc<World> {
    let plan = gen_plan(seed);
    eprintln!(
        "seed {seed}: {} roots, {} ops, {}, crash {:?}, {} dies at {:?}, abort {}",
        plan.roots.len(),
        plan.roots.iter().map(|r| r.ops.len()).sum::<usize>(),
        if plan.wal { "wal" } else { "memory" },
        plan.crash,
        DEAD,
        plan.dies_at,
        plan.abort
    );
    let world = Arc::new(World::default());
    *world.rng.lock().unwrap() = Some(fastrand::Rng::with_seed(seed ^ 0x5eed));
    let dir = tempfile::tempdir().unwrap();
    let memory = MemoryStore::new();
    let open = || -> Box<dyn ProcedureStore> {
        if plan.wal {
            Box::new(WalStore::open(dir.path()).unwrap())
        } else {
            Box::new(memory.clone())
        }
    };
    perturb::set_seed(seed);
    let executor = match plan.crash {
        Some((n, point)) => start(CrashingStore::new(open(), n, point), &world).await,
        None => start(open(), &world).await,
    };
    let going = Arc::new(AtomicBool::new(true));
    let reporter = spawn_reporter(executor.clone(), world.clone(), plan.dies_at, going.clone());
    let mut roots = Vec::new();
    for root in &plan.roots {
        if let Ok(id) = executor.submit(root.clone()).await {
            roots.push(id);
        }
    }
    if plan.abort {
        if let Some(&id) = roots.get(seed as usize % roots.len().max(1)) {
            let _ = executor.abort(id).await;
        }
    }
    let mut crashed = roots.len() < plan.roots.len();
    for &root in &roots {
        match executor.wait(root).await {
            Ok(result) => {
                world.ended.lock().unwrap().insert(root, result.is_ok());
            }
            Err(Error::Store(_)) => crashed = true,
            Err(e) => panic!("seed {seed}: wait for {root}: {e}"),
        }
    }
    going.store(false, Ordering::SeqCst);
    let _ = reporter.await;
    executor.shutdown_now().await.unwrap();
    if crashed {
        world.restarts.fetch_add(1, Ordering::SeqCst);
        let executor = start(open(), &world).await;
        let going = Arc::new(AtomicBool::new(true));
        let reporter = spawn_reporter(executor.clone(), world.clone(), plan.dies_at, going.clone());
        let mut all: HashSet<ProcId> = roots.iter().copied().collect();
        all.extend(executor.recovery().recovered_roots.iter().copied());
        for root in all {
            match executor.wait(root).await {
                Ok(result) => {
                    world.ended.lock().unwrap().insert(root, result.is_ok());
                }
                Err(Error::UnknownProcedure(_) | Error::Gone(_)) => {}
                Err(e) => panic!("seed {seed}: wait for {root} after the restart: {e}"),
            }
        }
        going.store(false, Ordering::SeqCst);
        let _ = reporter.await;
        executor.shutdown_now().await.unwrap();
    }
    perturb::set_seed(0);
    world
}

fn check(seed: u64, world: &World) {
    let fail = |what: String| -> ! { panic!("seed {seed}: {what}") };
    if let Some(v) = world.violations.lock().unwrap().first() {
        fail(v.clone());
    }
    let dispatched = world.dispatched.lock().unwrap().clone();
    let applied = world.applied.lock().unwrap().clone();
    let mut first_seen: HashMap<(ProcId, u8), Seen> = HashMap::new();
    for (root, phase, seen) in world.seen.lock().unwrap().iter() {
        let Some(batch) = dispatched.get(&(*root, *phase)) else {
            fail(format!(
                "{root} read outcomes of phase {phase}, which it never dispatched"
            ));
        };
        // Exactly the ops dispatched, each once, at the targets chosen.
        let ids: HashSet<OpId> = seen.iter().map(|(id, _, _)| *id).collect();
        if ids.len() != seen.len() || seen.len() != batch.len() {
            fail(format!(
                "{root} phase {phase} dispatched {batch:?}, saw {seen:?}"
            ));
        }
        let mut targets: Vec<&String> = seen.iter().map(|(_, t, _)| t).collect();
        let mut chosen: Vec<&String> = batch.iter().map(|(t, _)| t).collect();
        targets.sort();
        chosen.sort();
        if targets != chosen {
            fail(format!(
                "{root} phase {phase}: targets {chosen:?}, outcomes from {targets:?}"
            ));
        }
        let mut tags = HashSet::new();
        for (id, target, outcome) in seen {
            match outcome {
                Ok(tag) => {
                    if !batch.iter().any(|(t, g)| t == target && g == tag) || !tags.insert(tag) {
                        fail(format!(
                            "{root}: {id} at {target} gave {tag}, dispatched {batch:?}"
                        ));
                    }
                    match applied.get(id) {
                        Some((t, op)) if t == target && op.tag == *tag => {}
                        other => fail(format!(
                            "{root}: {id} gave {tag}, the node applied {other:?}"
                        )),
                    }
                }
                Err(e) if e.contains("is gone") || e.contains("removed") => {
                    if target != DEAD {
                        fail(format!("{root}: {id} at {target}: {e}"));
                    }
                }
                Err(_) => {}
            }
        }
        // A re-run of the step (after a restart) sees the same.
        match first_seen.get(&(*root, *phase)) {
            Some(before) if before != seen => {
                fail(format!(
                    "{root} phase {phase} saw {before:?}, then {seen:?}"
                ));
            }
            Some(_) => {}
            None => {
                first_seen.insert((*root, *phase), seen.clone());
            }
        }
    }
    for ((incarnation, id), n) in world.taken.lock().unwrap().iter() {
        if *n > 1 {
            fail(format!("engine {incarnation} took {n} reports of {id}"));
        }
    }
    check_undos(seed, world, &dispatched);
}

/// The undos the nodes received: each for an operation of a root that did not succeed;
/// and, in a run without a crash, none for an operation that failed on its node, each
/// received once, and none before a receipt of its operation.
fn check_undos(seed: u64, world: &World, dispatched: &Dispatched) {
    let fail = |what: String| -> ! { panic!("seed {seed}: {what}") };
    let root_of: HashMap<&str, ProcId> = dispatched
        .iter()
        .flat_map(|((root, _), batch)| batch.iter().map(move |(_, tag)| (tag.as_str(), *root)))
        .collect();
    let received = world.received.lock().unwrap().clone();
    let ended = world.ended.lock().unwrap().clone();
    let failed_on_node = world.failed_on_node.lock().unwrap().clone();
    let order = world.order.lock().unwrap().clone();
    let crashed = world.restarts.load(Ordering::SeqCst) > 0;
    let mut undone = HashSet::new();
    for (at, id) in order.iter().enumerate() {
        let Some(op) = id.undoes() else { continue };
        let tag = received[id].tag.trim_start_matches("undo/");
        let Some(root) = root_of.get(tag) else {
            fail(format!("{id} undoes {tag}, which no root dispatched"));
        };
        if ended.get(root) == Some(&true) {
            fail(format!("{id} undid {tag} of {root}, which succeeded"));
        }
        if crashed {
            continue;
        }
        if failed_on_node.contains(&op) {
            fail(format!("{id} undid {op}, which failed on its node"));
        }
        if !undone.insert(*id) {
            fail(format!("{id} reached its node twice without a crash"));
        }
        if order[at..].contains(&op) {
            fail(format!("{op} reached its node after its undo {id}"));
        }
    }
}

#[actix::test]
async fn remote_operations_keep_every_promise_under_perturbation() {
    let mut seeds = common::seeds::Seeds::from_env(16);
    let (mut runs, mut outcomes, mut failed, mut gone) = (0, 0, 0, 0);
    let (mut restarts, mut resent, mut taken, mut undos) = (0, 0, 0, 0);
    for seed in seeds.by_ref() {
        // A guard against a hang (which is itself the failure), not a sequencer: shorter
        // than the operations' deadline.
        let world = match tokio::time::timeout(Duration::from_secs(20), run_seed(seed)).await {
            Ok(world) => world,
            Err(_) => panic!(
                "seed {seed}: the run hung; replay with PROCTOR_SEED={seed} cargo test --test \
                 perturbation_remote"
            ),
        };
        check(seed, &world);
        for (_, _, seen) in world.seen.lock().unwrap().iter() {
            outcomes += seen.len();
            failed += seen.iter().filter(|(_, _, o)| o.is_err()).count();
            gone += seen
                .iter()
                .filter(|(_, _, o)| o.as_ref().is_err_and(|e| e.contains("removed")))
                .count();
        }
        restarts += world.restarts.load(Ordering::SeqCst);
        resent +=
            world.receipts.load(Ordering::SeqCst) as usize - world.received.lock().unwrap().len();
        taken += world.taken.lock().unwrap().len();
        undos += world
            .received
            .lock()
            .unwrap()
            .keys()
            .filter(|id| id.undoes().is_some())
            .count();
        runs += 1;
    }
    eprintln!(
        "{runs} seeds checked in {:?}: {outcomes} outcomes read ({failed} failed, {gone} \
         of a removed node), {taken} reports taken from the reporter, {resent} ops sent \
         again, {undos} ops undone on their nodes, {restarts} restarts after a crash",
        seeds.elapsed()
    );
}
