//! The simulated workload and what it records: a procedure type whose steps leave
//! effects in a ledger (the outside world a control plane changes), and the history
//! checker that judges every call into user code as it happens and every result as it
//! arrives.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Rng;
use crate::{
    async_trait, Context, FailurePolicy, Flow, Lock, OpId, ProcError, ProcId, Procedure, Registry,
    Report, Transport, TransportError,
};

/// The procedure type every simulated procedure is.
pub(super) const SIM_PROC: &str = "sim";

/// One simulated procedure, as submitted (its plan) and as it goes (`at`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct SimProc {
    /// Its index in the seed's plan: the ledger's name for it.
    pub(super) key: u32,
    steps: u8,
    /// Steps done (recorded or about to be).
    at: u8,
    /// The step that fails, and how many times (more than `retries`: the tree rolls
    /// back; at most `retries`: a retry gets past it).
    fail_at: Option<(u8, u32)>,
    retries: u32,
    /// The step that starts the children.
    children_at: Option<u8>,
    children: Vec<SimProc>,
    /// An exclusive engine lock (roots only).
    lock: Option<u8>,
    /// The step that sends a remote operation (with its undo) to a node; the next
    /// step reads its outcome and fails if it failed.
    #[serde(default)]
    remote: Option<u8>,
    /// How long each call works, in simulated µs.
    work_us: u32,
}

/// The registry of the simulation's one procedure type.
pub(super) fn registry() -> Registry<World> {
    let mut registry = Registry::new();
    registry.register::<SimProc>(SIM_PROC);
    registry
}

/// What the checker knows of one procedure of the plan.
struct Planned {
    root: u32,
    parent: Option<u32>,
    steps: u8,
    children_at: Option<u8>,
    remote: Option<u8>,
}

/// One root's plan, for the driver.
#[derive(Clone)]
pub(super) struct RootPlan {
    pub(super) proc: SimProc,
    /// When it is submitted, in simulated ms after the start.
    pub(super) at_ms: u64,
    /// Whether (and when, in ms after its submission) an operator aborts it.
    pub(super) abort_after_ms: Option<u64>,
    /// Whether it must succeed: no failure that rolls it back, no abort.
    pub(super) must_succeed: bool,
}

/// A seed's workload: `roots` trees of up to three levels.
pub(super) fn plan(rng: &mut Rng, roots: usize, faults: &super::Swarm) -> Vec<RootPlan> {
    let mut next = 0u32;
    (0..roots)
        .map(|_| {
            let mut fails = false;
            let proc = gen_proc(rng, &mut next, 0, faults, &mut fails);
            let abort_after_ms = (faults.aborts && rng.below(8) == 0).then(|| rng.below(40));
            RootPlan {
                // A cluster's roots come over a longer time, so that leases change
                // hands while they run.
                at_ms: rng.below(if faults.cluster { 1_500 } else { 50 }),
                must_succeed: !fails && abort_after_ms.is_none(),
                abort_after_ms,
                proc,
            }
        })
        .collect()
}

fn gen_proc(
    rng: &mut Rng,
    next: &mut u32,
    depth: u32,
    faults: &super::Swarm,
    fails: &mut bool,
) -> SimProc {
    let key = *next;
    *next += 1;
    let steps = 1 + rng.below(4) as u8;
    let retries = if rng.below(3) == 0 { 2 } else { 0 };
    let fail_at = (faults.step_failures && rng.below(6) == 0).then(|| {
        let times = 1 + rng.below(3) as u32;
        if times > retries {
            *fails = true;
        }
        (1 + rng.below(u64::from(steps)) as u8, times)
    });
    let children_at = (depth < 2 && steps >= 2 && rng.below(3) == 0)
        .then(|| 1 + rng.below(u64::from(steps) - 1) as u8);
    let remote = (faults.remote && steps >= 2 && rng.below(3) == 0)
        .then(|| 1 + rng.below(u64::from(steps) - 1) as u8)
        .filter(|&at| Some(at) != children_at);
    let children = match children_at {
        Some(_) => (0..1 + rng.below(3))
            .map(|_| gen_proc(rng, next, depth + 1, faults, fails))
            .collect(),
        None => Vec::new(),
    };
    SimProc {
        key,
        steps,
        at: 0,
        fail_at,
        retries,
        children_at,
        children,
        lock: (depth == 0 && rng.below(3) == 0).then(|| rng.below(3) as u8),
        remote,
        work_us: rng.below(if faults.cluster { 15_000 } else { 3_000 }) as u32,
    }
}

/// What every procedure of one seed shares: the history and its checker.
pub(super) struct World {
    inner: Mutex<History>,
    /// In a cluster run, the database whose lease a call's fencing token must hold.
    lease: std::sync::OnceLock<super::SimDb>,
}

#[derive(Default)]
struct History {
    planned: BTreeMap<u32, Planned>,
    /// The effects in the outside world: (procedure, step).
    ledger: BTreeSet<(u32, u8)>,
    /// The highest step each procedure has run.
    highest: BTreeMap<u32, u8>,
    /// Failures injected so far, by procedure.
    failures: BTreeMap<u32, u32>,
    /// Who is inside each lock now.
    holders: BTreeMap<u8, BTreeSet<u32>>,
    /// The roots whose result was seen, and whether they succeeded.
    results: BTreeMap<u32, bool>,
    violations: Vec<String>,
    /// Calls into user code.
    calls: u64,
    /// The trace's hash so far (FNV-1a over each event's text).
    hash: u64,
    /// The trace itself, when asked for.
    trace: Option<Vec<String>>,
    /// The newest fencing token a call into user code was made under.
    newest_token: Option<i64>,
    /// The nodes' side of remote operations: each operation applied (once, whatever
    /// it is sent again), the operations undone (an operation that comes after its
    /// undo is refused), and the effects applied and not undone.
    applied: BTreeMap<OpId, (u32, u8)>,
    undone: BTreeSet<OpId>,
    remote_effects: BTreeSet<(u32, u8)>,
    /// Operations in requests on their way (sent, not yet at their node).
    in_flight: BTreeMap<OpId, u32>,
    /// Remote effects a rolled-back tree left applied.
    left_applied: u32,
    /// The network's own generator.
    net: Rng,
    /// Whether the network drops requests and answers.
    net_faults: bool,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

impl World {
    pub(super) fn new(plans: &[RootPlan], trace: bool, seed: u64, net_faults: bool) -> World {
        let mut history = History {
            hash: FNV_OFFSET,
            net: Rng::new(seed ^ 0x0e7),
            net_faults,
            trace: trace.then(Vec::new),
            ..History::default()
        };
        for plan in plans {
            history.add_planned(&plan.proc, plan.proc.key, None);
        }
        World {
            inner: Mutex::new(history),
            lease: std::sync::OnceLock::new(),
        }
    }

    /// Judges every call's fencing token against `db`'s lease.
    pub(super) fn lease_in(&self, db: super::SimDb) {
        let _ = self.lease.set(db);
    }

    /// A call under `token` runs user code now: the lease it was taken under must
    /// still hold (a leader that lost its lease calls no user code).
    fn leading(&self, key: u32, token: Option<i64>, what: &str) {
        let (Some(db), Some(token)) = (self.lease.get(), token) else {
            return;
        };
        if !db.lease_holds(token) {
            self.violation(format!(
                "{key} ran user code ({what}) under epoch {token}, whose lease no longer holds"
            ));
        }
    }

    fn history(&self) -> MutexGuard<'_, History> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records an event of the driver's (submissions, answers, crashes).
    pub(super) fn log(&self, event: std::fmt::Arguments<'_>) {
        self.history().log(event);
    }

    pub(super) fn violation(&self, what: String) {
        let mut h = self.history();
        h.log(format_args!("VIOLATION {what}"));
        h.violations.push(what);
    }

    /// A crash: every call in progress died with the process.
    pub(super) fn crashed(&self) {
        self.history().holders.clear();
    }

    /// A root's result, as its waiter saw it.
    pub(super) fn result(&self, root: u32, id: ProcId, ok: bool, must_succeed: bool) {
        let mut h = self.history();
        h.log(format_args!("result {root} {id} {ok}"));
        if let Some(&before) = h.results.get(&root) {
            if before != ok {
                h.violate(format!(
                    "root {root} ({id}) ended {} after it had ended {}",
                    outcome(ok),
                    outcome(before)
                ));
            }
            return;
        }
        h.results.insert(root, ok);
        if must_succeed && !ok {
            h.violate(format!(
                "root {root} ({id}) rolled back with no failure and no abort"
            ));
        }
        // The ledger must hold every effect of a tree that succeeded. Of one that rolled
        // back it holds none of the root's and, of each other procedure, all (it
        // succeeded before the tree failed: a finished procedure is not rolled back) or
        // none.
        let tree: Vec<(u32, u8)> = (h.planned.iter())
            .filter(|(_, p)| p.root == root)
            .map(|(&k, p)| (k, p.steps))
            .collect();
        let remote: Vec<(u32, u8)> = (h.planned.iter())
            .filter(|(_, p)| p.root == root)
            .filter_map(|(&k, p)| Some((k, p.remote?)))
            .collect();
        for effect @ (key, step) in remote {
            let there = h.remote_effects.contains(&effect);
            if ok && !there {
                h.violate(format!(
                    "root {root} succeeded without the remote effect of {key}#{step}"
                ));
            } else if !ok && there {
                // As documented (`Dispatched::undo`): an operation whose child
                // recorded its outcome before the tree failed is not undone by the
                // engine. Counted, not judged: the workload's procedures cannot
                // undo it in their own rollback.
                h.left_applied += 1;
                h.log(format_args!("remote effect of {key}#{step} left applied"));
            }
        }
        for (key, steps) in tree {
            let there = (1..=steps)
                .filter(|&s| h.ledger.contains(&(key, s)))
                .count();
            if ok && there < usize::from(steps) {
                h.violate(format!(
                    "root {root} succeeded with {there} of the {steps} effects of {key}"
                ));
            } else if !ok && there > 0 && (key == root || there < usize::from(steps)) {
                h.violate(format!(
                    "root {root} rolled back, leaving {there} of the {steps} effects of {key}"
                ));
            }
        }
    }

    /// What the checker found.
    pub(super) fn violations(&self) -> Vec<String> {
        self.history().violations.clone()
    }

    /// Remote effects rolled-back trees left applied.
    pub(super) fn left_applied(&self) -> u32 {
        self.history().left_applied
    }

    pub(super) fn calls(&self) -> u64 {
        self.history().calls
    }

    pub(super) fn hash(&self) -> u64 {
        self.history().hash
    }

    pub(super) fn trace(&self) -> Vec<String> {
        self.history().trace.clone().unwrap_or_default()
    }

    pub(super) fn finished(&self, root: u32) -> bool {
        self.history().results.contains_key(&root)
    }
}

fn outcome(ok: bool) -> &'static str {
    if ok {
        "SUCCESS"
    } else {
        "ROLLEDBACK"
    }
}

impl History {
    fn add_planned(&mut self, proc: &SimProc, root: u32, parent: Option<u32>) {
        self.planned.insert(
            proc.key,
            Planned {
                root,
                parent,
                steps: proc.steps,
                children_at: proc.children_at,
                remote: proc.remote,
            },
        );
        for child in &proc.children {
            self.add_planned(child, root, Some(proc.key));
        }
    }

    fn log(&mut self, event: std::fmt::Arguments<'_>) {
        let mut line = String::new();
        let _ = write!(line, "{:>10} {event}", super::now_us());
        for b in line.bytes().chain([b'\n']) {
            self.hash = (self.hash ^ u64::from(b)).wrapping_mul(FNV_PRIME);
        }
        if let Some(trace) = &mut self.trace {
            trace.push(line);
        }
    }

    fn violate(&mut self, what: String) {
        self.log(format_args!("VIOLATION {what}"));
        self.violations.push(what);
    }

    fn root_of(&self, key: u32) -> u32 {
        self.planned.get(&key).map_or(key, |p| p.root)
    }

    /// `key`'s ancestors, nearest first.
    fn ancestors(&self, key: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = self.planned.get(&key).and_then(|p| p.parent);
        while let Some(a) = at {
            out.push(a);
            at = self.planned.get(&a).and_then(|p| p.parent);
        }
        out
    }

    fn is_below(&self, key: u32, ancestor: u32) -> bool {
        self.ancestors(key).contains(&ancestor)
    }

    /// Step `step` of `key` starts: a step before the highest one it ran (which the
    /// engine moved past, so it was durable) must not run again, nor anything in a
    /// tree whose result was seen.
    fn execute(&mut self, key: u32, id: ProcId, step: u8, token: Option<i64>) {
        self.calls += 1;
        self.log(format_args!("exec {key} {id} #{step} {token:?}"));
        self.fenced(key, token);
        let root = self.root_of(key);
        if self.results.contains_key(&root) {
            self.violate(format!(
                "{key}#{step} ran after root {root}'s result was seen"
            ));
        }
        let highest = self.highest.entry(key).or_default();
        if step < *highest {
            let was = *highest;
            self.violate(format!(
                "{key}#{step} ran again after #{was} had run: a step the engine moved past was lost"
            ));
        }
        let highest = self.highest.entry(key).or_default();
        *highest = (*highest).max(step);
        self.ledger.insert((key, step));
    }

    /// The rollback of `key`'s step `step`: its own later steps, the later steps of
    /// its ancestors (taken after their children ended), and, for the step that
    /// started children, every effect of its descendants, must all be undone already.
    fn undo(&mut self, key: u32, id: ProcId, step: u8, token: Option<i64>) {
        self.calls += 1;
        self.log(format_args!("undo {key} {id} #{step} {token:?}"));
        self.fenced(key, token);
        if step == 0 {
            self.violate(format!("{key} was rolled back past its first step"));
            return;
        }
        let root = self.root_of(key);
        if self.results.contains_key(&root) {
            self.violate(format!(
                "{key}#{step} was rolled back after root {root}'s result was seen"
            ));
        }
        let mut early = Vec::new();
        for &(k, s) in &self.ledger {
            let out_of_order = (k == key && s > step)
                || self
                    .ancestors(key)
                    .iter()
                    .any(|&a| a == k && self.planned[&a].children_at.is_some_and(|at| s > at))
                || (self.planned[&key].children_at == Some(step)
                    && self.is_below(k, key)
                    && !self.complete(k));
            if out_of_order {
                early.push((k, s));
            }
        }
        if let Some((k, s)) = early.first() {
            self.violate(format!(
                "{key}#{step} was rolled back before {k}#{s}, which came after it"
            ));
        }
        self.ledger.remove(&(key, step));
    }

    /// A call under the fencing token `token`: none may begin under an older token
    /// once one has begun under a newer (a deposed leader calls no user code after
    /// its successor's first call).
    fn fenced(&mut self, key: u32, token: Option<i64>) {
        let Some(token) = token else { return };
        match self.newest_token {
            Some(newest) if token < newest => self.violate(format!(
                "{key} was called under epoch {token} after a call under epoch {newest}"
            )),
            _ => self.newest_token = Some(token),
        }
    }

    /// Whether every step of `key` has its effect: it succeeded, and is not rolled
    /// back with its tree.
    fn complete(&self, key: u32) -> bool {
        let steps = self.planned.get(&key).map_or(0, |p| p.steps);
        (1..=steps).all(|s| self.ledger.contains(&(key, s)))
    }

    fn enter(&mut self, lock: u8, key: u32) {
        let holders = self.holders.entry(lock).or_default();
        if let Some(&other) = holders.iter().find(|&&h| h != key) {
            self.violate(format!(
                "{key} entered lock {lock} while {other} was inside it"
            ));
        }
        self.holders.entry(lock).or_default().insert(key);
    }

    fn leave(&mut self, lock: u8, key: u32) {
        if let Some(holders) = self.holders.get_mut(&lock) {
            holders.remove(&key);
        }
    }

    /// Whether `key`'s step `step` fails now (counting the injected failure).
    fn fails(&mut self, key: u32, step: u8, plan: Option<(u8, u32)>) -> bool {
        match plan {
            Some((at, times)) if at == step => {
                let failed = self.failures.entry(key).or_default();
                *failed += 1;
                *failed <= times
            }
            _ => false,
        }
    }
}

/// Inside a lock for one call: left when the call ends or its future is dropped.
struct Inside<'a> {
    world: &'a World,
    lock: Option<u8>,
    key: u32,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        if let Some(lock) = self.lock {
            self.world.history().leave(lock, self.key);
        }
    }
}

impl SimProc {
    async fn work(&self, world: &World, token: Option<i64>) {
        world.leading(self.key, token, "a call begins");
        if let Some(lock) = self.lock {
            world.history().enter(lock, self.key);
        }
        let _inside = Inside {
            world,
            lock: self.lock,
            key: self.key,
        };
        tokio::time::sleep(Duration::from_micros(u64::from(self.work_us))).await;
        world.leading(self.key, token, "a call goes on after an await");
    }
}

#[async_trait]
impl Procedure<World> for SimProc {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = ctx.env();
        self.at += 1;
        let step = self.at;
        world
            .history()
            .execute(self.key, ctx.id(), step, ctx.fencing_token());
        self.work(world, ctx.fencing_token()).await;
        if world.history().fails(self.key, step, self.fail_at) {
            return Err(ProcError::failed(format!("{}#{step} failed", self.key)));
        }
        if self.remote == Some(step) {
            let op = NetOp {
                key: self.key,
                step,
            };
            ctx.dispatch::<SimNet>(format!("n{}", self.key % 3), &op)?
                .undo(&op)?;
            return Ok(ctx.await_remote());
        }
        if self.remote.is_some_and(|at| at + 1 == step) {
            if let Some(failed) = ctx.remote_results().iter().find(|r| r.outcome.is_err()) {
                return Err(ProcError::failed(format!(
                    "{}#{step}: remote operation {} failed",
                    self.key, failed.op
                )));
            }
        }
        Ok(if self.children_at == Some(step) {
            Flow::Children(
                self.children
                    .iter()
                    .map(|c| Box::new(c.clone()) as Box<dyn Procedure<World>>)
                    .collect(),
            )
        } else if step < self.steps {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        let world = ctx.env();
        if ctx.is_unrecorded_step() {
            (world.history()).undo(self.key, ctx.id(), self.at + 1, ctx.fencing_token());
        } else {
            (world.history()).undo(self.key, ctx.id(), self.at, ctx.fencing_token());
            self.at = self.at.saturating_sub(1);
        }
        self.work(world, ctx.fencing_token()).await;
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        self.lock
            .map(|l| vec![Lock::exclusive(format!("sim/{l}"))])
            .unwrap_or_default()
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        match self.retries {
            0 => FailurePolicy::Rollback,
            times => FailurePolicy::RetryThenRollback {
                times,
                backoff_ms: 1,
            },
        }
    }
}

/// The checker's verdict on a whole run, once the last incarnation ended: every root
/// acknowledged ended, once.
pub(super) fn check_all_ended(world: &World, acked: &BTreeMap<u32, ProcId>) {
    for (&root, &id) in acked {
        if !world.finished(root) {
            world.violation(format!(
                "root {root} ({id}) was acknowledged and never ended"
            ));
        }
    }
}

/// A remote operation of the simulated workload: the effect of `key`'s step `step` on
/// a node (its undo carries the same).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(super) struct NetOp {
    key: u32,
    step: u8,
}

/// The simulated network and nodes: each request takes a random latency (so
/// requests overtake each other), and in seeds with network faults a request is lost
/// on its way (10 %) or its answer is (10 %, after the node applied it). A node
/// applies an operation once, however often it comes, refuses one that comes after
/// its undo, and answers every operation in the response.
pub(super) struct SimNet(pub(super) std::sync::Arc<World>);

#[async_trait]
impl Transport for SimNet {
    type Op = NetOp;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, NetOp)>,
    ) -> Result<Vec<Report>, TransportError> {
        let latency = {
            let mut h = self.0.history();
            for (id, _) in &ops {
                *h.in_flight.entry(*id).or_default() += 1;
            }
            h.net.below(3_000)
        };
        // Dropped with the request (a crash, a deposed engine): no longer on its way.
        let _on_its_way = OnItsWay(&self.0, ops.iter().map(|(id, _)| *id).collect());
        tokio::time::sleep(Duration::from_micros(100 + latency)).await;
        let mut h = self.0.history();
        if h.net_faults && h.net.below(10) == 0 {
            h.log(format_args!("net: request to {target} lost"));
            return Err(TransportError(format!("{target}: request lost")));
        }
        let mut reports = Vec::with_capacity(ops.len());
        for (id, op) in ops {
            h.log(format_args!("net: {target} gets {id} {op:?}"));
            let ok = |id| Report::ok(id, &()).map_err(|e| TransportError(e.to_string()));
            if let Some(of) = id.undoes() {
                // An undo goes out only once its operation's course has ended.
                if h.in_flight.get(&of).is_some_and(|&n| n > 0) {
                    h.violate(format!(
                        "the undo of {of} reached {target} while {of} was on its way there"
                    ));
                }
                if let Some(effect) = h.applied.get(&of).copied() {
                    if !h.undone.contains(&of) {
                        h.remote_effects.remove(&effect);
                    }
                }
                h.undone.insert(of);
                reports.push(ok(id)?);
            } else if h.undone.contains(&id) {
                reports.push(Report::failed(id, "undone before it arrived"));
            } else {
                if let std::collections::btree_map::Entry::Vacant(first) = h.applied.entry(id) {
                    first.insert((op.key, op.step));
                    h.remote_effects.insert((op.key, op.step));
                }
                reports.push(ok(id)?);
            }
        }
        if h.net_faults && h.net.below(10) == 0 {
            h.log(format_args!("net: answer from {target} lost"));
            return Err(TransportError(format!("{target}: answer lost")));
        }
        Ok(reports)
    }
}

/// Operations of one request, counted on their way until it ends.
struct OnItsWay<'a>(&'a World, Vec<OpId>);

impl Drop for OnItsWay<'_> {
    fn drop(&mut self) {
        let mut h = self.0.history();
        for id in &self.1 {
            if let Some(n) = h.in_flight.get_mut(id) {
                *n = n.saturating_sub(1);
            }
        }
    }
}
