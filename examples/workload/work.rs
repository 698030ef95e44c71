//! The workload's procedure: a state machine of `steps` steps that records each step's
//! side effect in the ledger, starts `children` children from its first step, and fails
//! where its plan says. With a lock, the root holds `res/<k>` exclusively for its life
//! (its children run under it) and every step checks that no other tree is inside that
//! resource. Shared with the SIGKILL crash test.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use proctor::{
    async_trait, Context, Flow, Lock, ProcError, ProcId, ProcState, Registry, StateContext,
    StateMachine, StateMachineProcedure,
};
use serde::{Deserialize, Serialize};

use crate::ledger::{self, Ledger};

/// What the procedures share: the ledger, a step counter, and who is inside each
/// locked resource.
#[derive(Default)]
pub struct Env {
    pub ledger: Option<Ledger>,
    pub steps: AtomicU64,
    /// Resource `k` -> the root whose tree is inside it (from its first step to its
    /// last step or last rollback).
    pub inside: Mutex<HashMap<u32, u64>>,
    /// Steps that found another tree inside their resource.
    pub lock_conflicts: AtomicU64,
    /// DAG tasks (root, index) whose injected fault has fired in this process.
    pub fired: Mutex<HashSet<(u64, u16)>>,
    /// How long each step and rollback awaits before it changes the ledger (none by
    /// default): the failover test's calls are caught at an await when the process
    /// is stopped, as calls that wait on the network are.
    pub think: Option<std::time::Duration>,
}

impl Env {
    pub fn new(ledger: Option<Ledger>) -> Self {
        Env {
            ledger,
            ..Env::default()
        }
    }

    /// A step (or rollback) of `root`'s tree enters resource `k`.
    fn enter(&self, k: Option<u32>, root: u64) {
        let Some(k) = k else { return };
        let mut inside = self.inside.lock().unwrap_or_else(|e| e.into_inner());
        let owner = inside.entry(k).or_insert(root);
        if *owner != root {
            self.lock_conflicts.fetch_add(1, Ordering::Relaxed);
            eprintln!("lock conflict: tree {root} inside res/{k} while tree {owner} is");
        }
    }

    /// `root`'s tree is done with resource `k` (its last step or last rollback).
    fn leave(&self, k: Option<u32>, root: u64) {
        let Some(k) = k else { return };
        let mut inside = self.inside.lock().unwrap_or_else(|e| e.into_inner());
        if inside.get(&k) == Some(&root) {
            inside.remove(&k);
        }
    }

    /// Whether task `index` of DAG `root` fails now: the first time only.
    pub fn fire(&self, root: u64, index: u16) -> bool {
        let mut fired = self.fired.lock().unwrap_or_else(|e| e.into_inner());
        fired.insert((root, index))
    }

    /// Records `effect` in the ledger, of a tree that leaves `total` effects when it
    /// succeeds, made under the leader lease's fencing token `token` if any.
    pub fn add_effect(
        &self,
        effect: ledger::Effect,
        total: u32,
        token: ledger::Fence,
        lock: Option<u32>,
    ) -> Result<(), ProcError> {
        let Some(ledger) = &self.ledger else {
            return Ok(());
        };
        ledger
            .add(effect, total, token, lock)
            .map_err(|e| ProcError::failed(format!("ledger: {e}")))
    }

    /// Removes `effect` from the ledger, under fencing token `token` if any.
    pub fn remove_effect(
        &self,
        effect: ledger::Effect,
        token: ledger::Fence,
        lock: Option<u32>,
    ) -> Result<(), ProcError> {
        let Some(ledger) = &self.ledger else {
            return Ok(());
        };
        ledger
            .remove(effect, token, lock)
            .map_err(|e| ProcError::failed(format!("ledger: {e}")))
    }
}

/// One procedure of the workload: `path` 0 is the root, `i` its child `i`.
#[derive(Clone, Serialize, Deserialize)]
pub struct Work {
    pub path: u16,
    pub steps: u16,
    pub children: u16,
    /// `(path, step)` that fails in this tree, if any.
    pub fail: Option<(u16, u16)>,
    /// The resource `res/<k>` the tree locks exclusively, if any.
    #[serde(default)]
    pub lock: Option<u32>,
    /// The ledger effects the whole tree leaves when it succeeds, written with each
    /// effect (0 in states written before it was kept). Stored under a short name:
    /// the state is encoded at every step, field names included.
    #[serde(default, rename = "of")]
    pub tree_effects: u32,
    /// With remote targets (`--remote T`): each step of the root also sends one
    /// operation to one of `remote` targets and waits for it (sent again until it
    /// succeeds: a failed operation is retried by the step).
    #[serde(default, rename = "rt")]
    pub remote: u16,
    /// The root waits for the outcome of the operation its current step sent.
    #[serde(default, rename = "ra")]
    pub awaiting: bool,
}

/// A remote operation of the workload: which root's step sent it.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct RemoteOp {
    pub root: u64,
    pub step: u16,
}

impl Work {
    /// A root of `steps` steps with `children` children, failing where `fail` says.
    pub fn root(steps: u16, children: u16, fail: Option<(u16, u16)>, lock: Option<u32>) -> Self {
        let mut work = Work {
            path: 0,
            steps,
            children,
            fail,
            lock,
            tree_effects: 0,
            remote: 0,
            awaiting: false,
        };
        work.tree_effects = work.effects() as u32;
        work
    }

    /// The same root, each of its steps also sending an operation to one of `targets`.
    pub fn with_remote(mut self, targets: u16) -> Self {
        self.remote = targets;
        self
    }

    /// A root's step with remote targets: sends its operation and waits (`Some`), or —
    /// its operation's outcome in — goes on (`None`), or sends it again if it failed.
    fn remote_step(
        &mut self,
        ctx: &mut StateContext<'_, u16, Env>,
        step: u16,
    ) -> Result<Option<Flow<Env>>, ProcError> {
        if self.remote == 0 || self.path != 0 {
            return Ok(None);
        }
        if self.awaiting {
            let results = ctx.remote_results();
            if results.last().is_some_and(|r| r.outcome.is_ok()) {
                self.awaiting = false;
                return Ok(None);
            }
        }
        let root = ctx.root().0;
        let target = format!("node-{}", (root + u64::from(step)) % u64::from(self.remote));
        ctx.dispatch::<crate::nodes::ToNodes>(target, &RemoteOp { root, step })?;
        self.awaiting = true;
        Ok(Some(ctx.await_remote()))
    }

    /// The ledger effects a successful tree of this root leaves.
    pub fn effects(&self) -> usize {
        usize::from(self.steps) * (1 + usize::from(self.children))
    }
}

#[async_trait]
impl StateMachineProcedure<Env> for Work {
    type State = u16;

    fn initial_state(&self) -> u16 {
        0
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, u16, Env>,
        step: u16,
    ) -> Result<Flow<Env>, ProcError> {
        let env = ctx.env_arc().clone();
        if let Some(think) = env.think {
            tokio::time::sleep(think).await;
        }
        env.steps.fetch_add(1, Ordering::Relaxed);
        let root = ctx.root().0;
        env.enter(self.lock, root);
        let flow = self.step(ctx, &env, step)?;
        if self.path == 0 && matches!(flow, Flow::Done) {
            env.leave(self.lock, root);
        }
        Ok(flow)
    }

    async fn rollback_state(&mut self, ctx: &mut Context<Env>, step: u16) -> Result<(), ProcError> {
        if let Some(think) = ctx.env().think {
            tokio::time::sleep(think).await;
        }
        let env = ctx.env();
        let root = ctx.root().0;
        let token = fence(ctx);
        env.enter(self.lock, root);
        if step >= self.steps {
            return Ok(());
        }
        env.remove_effect((root, self.path, step), token, self.lock)?;
        if self.path == 0 && step == 0 {
            // The root's first step started the children: undo what they did. A child
            // that succeeded is not rolled back itself (its parent's rollback undoes
            // what the parent caused).
            for path in 1..=self.children {
                for child_step in 0..self.steps {
                    env.remove_effect((root, path, child_step), token, self.lock)?;
                }
            }
            // The root's last rollback: the tree leaves its resource.
            env.leave(self.lock, root);
        }
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        self.lock
            .map(|k| vec![Lock::exclusive(format!("res/{k}"))])
            .unwrap_or_default()
    }

    fn holds_lock(&self) -> bool {
        self.path == 0
    }
}

impl Work {
    fn step(
        &mut self,
        ctx: &mut StateContext<'_, u16, Env>,
        env: &Env,
        step: u16,
    ) -> Result<Flow<Env>, ProcError> {
        if step >= self.steps {
            // Only reached by a one-step root with children: the step after them.
            return Ok(Flow::Done);
        }
        let token = fence(ctx);
        env.add_effect(
            (ctx.root().0, self.path, step),
            self.tree_effects,
            token,
            self.lock,
        )?;
        if self.fail == Some((self.path, step)) {
            return Err(ProcError::failed(format!(
                "injected failure at path {} step {step}",
                self.path
            )));
        }
        if let Some(flow) = self.remote_step(ctx, step)? {
            return Ok(flow);
        }
        ctx.set_next_state(step + 1);
        if self.path == 0 && step == 0 && self.children > 0 {
            let children = (1..=self.children)
                .map(|path| {
                    Box::new(StateMachine::new(Work {
                        path,
                        children: 0,
                        ..self.clone()
                    })) as Box<dyn proctor::Procedure<Env>>
                })
                .collect();
            return Ok(Flow::Children(children));
        }
        if step + 1 < self.steps {
            Ok(Flow::MoreToDo)
        } else {
            Ok(Flow::Done)
        }
    }
}

/// The token a call runs under, with its partition in a cluster (the ledger orders
/// tokens per partition).
pub fn fence<E: ?Sized>(ctx: &Context<E>) -> ledger::Fence {
    ctx.fencing_token().map(|t| (t, ctx.partition()))
}

/// Each root in `records` (a cluster's store, read after every root finished):
/// finished as its plan says (a planned failure rolls it back, no failure succeeds),
/// and its state decodes.
pub fn check_cluster_states(records: &[proctor::store::ProcRecord]) -> (Vec<String>, u64) {
    let mut violations = Vec::new();
    for record in records.iter().filter(|r| r.parent.is_none()) {
        let id = record.id;
        let planned = match rmp_serde::from_slice::<StateMachine<Work, Env>>(&record.data) {
            Ok(machine) => machine.machine().fail.is_none(),
            Err(e) => {
                violations.push(format!("root {id}: its state does not decode: {e}"));
                continue;
            }
        };
        match (record.state, planned) {
            (ProcState::Success, false) => {
                violations.push(format!("root {id} succeeded though it was planned to fail"));
            }
            (ProcState::RolledBack, true) => {
                violations.push(format!("root {id} rolled back though nothing failed"));
            }
            (ProcState::Success | ProcState::RolledBack, _) => {}
            (other, _) => violations.push(format!("root {id} is not finished ({other})")),
        }
    }
    (violations, 0)
}

/// The checks of a cluster's run across every process, on its store's `records` and
/// the shared `ledger`: [`check_cluster_states`]; every root acknowledged to a
/// submitter is in the store; the ledger's tokens in order per partition; no two trees
/// inside one resource at once; each root's effects all (SUCCESS) or none
/// (ROLLEDBACK). Returns the violations and how many are lock conflicts.
pub fn check_cluster(
    records: &[proctor::store::ProcRecord],
    ledger: &Ledger,
) -> std::io::Result<(Vec<String>, u64)> {
    let (mut violations, _) = check_cluster_states(records);
    let mut known: HashMap<ProcId, ProcState> = HashMap::new();
    let mut effects_of: HashMap<ProcId, usize> = HashMap::new();
    for record in records.iter().filter(|r| r.parent.is_none()) {
        known.insert(record.id, record.state);
        if let Ok(machine) = rmp_serde::from_slice::<StateMachine<Work, Env>>(&record.data) {
            effects_of.insert(record.id, machine.machine().effects());
        }
    }
    for acked in ledger.acknowledgements()? {
        if !known.contains_key(&ProcId(acked)) {
            violations.push(format!(
                "root {acked} was acknowledged but is not in the store"
            ));
        }
    }
    violations.extend(ledger.fence_violations()?);
    let conflicts = ledger.lock_conflicts()?;
    let lock_conflicts = conflicts.len() as u64;
    violations.extend(conflicts);
    let effects = ledger.effects_per_root()?;
    violations.extend(ledger_violations(&known, &effects, |id| {
        effects_of.get(&id).copied().unwrap_or(0)
    }));
    Ok((violations, lock_conflicts))
}

/// The registry the workload's executors use.
pub fn registry() -> Registry<Env> {
    let mut registry = Registry::new();
    registry.register::<StateMachine<Work, Env>>("workload");
    crate::dag::register(&mut registry);
    registry
}

/// Checks finished roots against the ledger: a successful root has all the effects its
/// tree makes (`effects_of`), a rolled-back one none, and the ledger names no root the
/// store does not know. `roots` are the roots the executor knows, with their states.
pub fn ledger_violations(
    roots: &HashMap<ProcId, ProcState>,
    effects: &HashMap<u64, usize>,
    effects_of: impl Fn(ProcId) -> usize,
) -> Vec<String> {
    let mut violations = Vec::new();
    for (id, state) in roots {
        let n = effects.get(&id.0).copied().unwrap_or(0);
        let effects_per_root = effects_of(*id);
        match state {
            ProcState::Success if n != effects_per_root => violations.push(format!(
                "root {id} succeeded with {n} effects in the ledger, not {effects_per_root}"
            )),
            ProcState::RolledBack if n != 0 => violations.push(format!(
                "root {id} rolled back but left {n} effects in the ledger"
            )),
            ProcState::Success | ProcState::RolledBack => {}
            other => violations.push(format!("root {id} is not finished ({other})")),
        }
    }
    for root in effects.keys() {
        if !roots.contains_key(&ProcId(*root)) {
            violations.push(format!(
                "the ledger holds effects of procedure {root}, unknown to the store"
            ));
        }
    }
    violations
}

/// Checks what the remote targets applied (`--remote T`, the ledger's `=` lines): each
/// operation once, and each root step's operation under one op id. A step sends its
/// operation again under a new id only after the node reported that it could not apply
/// it, so two ids applied for one step is a step's effect made twice. (Lines that name
/// no step are checked by op id alone.)
pub fn remote_violations(applied: &[ledger::Applied]) -> Vec<String> {
    let mut times: HashMap<u64, usize> = HashMap::new();
    let mut ops_of_step: HashMap<(u64, u16), Vec<u64>> = HashMap::new();
    for a in applied {
        *times.entry(a.op).or_default() += 1;
        if let Some(step) = a.step {
            let ops = ops_of_step.entry((a.root, step)).or_default();
            if !ops.contains(&a.op) {
                ops.push(a.op);
            }
        }
    }
    let mut violations: Vec<String> = times
        .into_iter()
        .filter(|&(_, n)| n > 1)
        .map(|(op, n)| format!("remote op {op} applied {n} times by the nodes"))
        .collect();
    violations.extend(
        ops_of_step
            .into_iter()
            .filter(|(_, ops)| ops.len() > 1)
            .map(|((root, step), ops)| {
                format!("root {root} step {step}: its operation applied under op ids {ops:?}")
            }),
    );
    violations.sort();
    violations
}

/// What [`check_evicted`] found.
pub struct Evicted {
    /// Roots the engine had evicted.
    pub count: u64,
    pub violations: Vec<String>,
}

/// Roots the engine no longer knows — planned (`planned`: whether a root's plan makes
/// it succeed, and its tree's effects then), or named by the ledger — that it
/// evicted (with a retention, in this process or an earlier one: ids it issued and
/// holds no record of). How they ended is gone with their results, so each must have
/// none or all of its tree's effects in force (all if its plan says it succeeds, none
/// if it fails; the total from its plan or from its ledger lines). Each is taken out
/// of `effects`, so that what remains there unknown to the engine is a violation of
/// [`ledger_violations`]. `known` are the roots the engine knows.
///
/// # Errors
/// Reading the ledger.
pub async fn check_evicted(
    executor: &proctor::Executor<Env>,
    env: &Env,
    planned: &HashMap<ProcId, (Option<bool>, usize)>,
    known: &HashMap<ProcId, ProcState>,
    effects: &mut HashMap<u64, usize>,
) -> std::io::Result<Evicted> {
    let totals = match &env.ledger {
        Some(ledger) => ledger.totals()?,
        None => HashMap::new(),
    };
    let mut found = Evicted {
        count: 0,
        violations: Vec::new(),
    };
    let unknown: std::collections::BTreeSet<ProcId> = effects
        .keys()
        .map(|&root| ProcId(root))
        .chain(planned.keys().copied())
        .filter(|id| !known.contains_key(id))
        .collect();
    for id in unknown {
        if !matches!(executor.state(id).await, Err(proctor::Error::Gone(_))) {
            // One the ledger names is reported by `ledger_violations`, as unknown to
            // the store.
            if planned.contains_key(&id) {
                found
                    .violations
                    .push(format!("root {id} was submitted but is unknown"));
            }
            continue;
        }
        found.count += 1;
        let n = effects.remove(&id.0).unwrap_or(0);
        let plan = planned.get(&id).copied();
        let total = plan.map(|(_, t)| t).or_else(|| totals.get(&id.0).copied());
        let whole = Some(n) == total;
        let ok = match plan.and_then(|(succeeds, _)| succeeds) {
            Some(true) => whole,
            Some(false) => n == 0,
            // A DAG that may pause past a point of no return and be continued, or a
            // root known only from the ledger; with no total (a ledger written before
            // totals were), nothing to check.
            None => n == 0 || whole || total.is_none(),
        };
        if !ok {
            let total = total.map_or("?".to_string(), |t| t.to_string());
            found.violations.push(format!(
                "root {id} was evicted with {n} of its tree's {total} effects in the ledger"
            ));
        }
    }
    Ok(found)
}
