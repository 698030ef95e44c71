//! The workload's DAG mode (`--dag W`): each root is a [`Dag`] of W tasks with seeded
//! random edges. Every task records its effect in the ledger and its rollback removes
//! it. At `--fail-rate` a root has one task that fails; at `--irreversible-rate` a task
//! is a point of no return. The failure is a transient fault: it fires once per task
//! per process, so a task paused by it (past a point of no return) succeeds when the
//! workload, acting as the operator, continues it. Shared with the SIGKILL crash test.
//!
//! What a root must come to, read from its persisted state ([`Plan::of`]) and checked
//! against the ledger's history ([`violations`]):
//! - no failing task: SUCCESS;
//! - a failing task that ran before any point of no return was recorded: ROLLEDBACK,
//!   its tasks undone in an order that respects the reversed edges (for every edge
//!   `a → b`, every undo of `b` before the first undo of `a`), and no irreversible
//!   task ever done;
//! - a failing task that ran after one: paused, continued, SUCCESS — the ledger shows
//!   an irreversible task done before the failing task first ran.

use std::cell::Cell;
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::Ordering;

use proctor::{
    async_trait, Context, Dag, DagBuilder, DagTask, Executor, List, ProcError, ProcEvent, ProcId,
    ProcState, Registry, Task,
};
use serde::{Deserialize, Serialize};

use crate::ledger::Effect;
use crate::work::Env;

/// The registered name of a DAG root.
pub const DAG_TYPE: &str = "workload_dag";

/// Tasks started at once by one DAG.
const PARALLELISM: usize = 4;

/// One task of a workload DAG: its effect is `(root, index, 0)` in the ledger.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Step {
    pub index: u16,
    /// Fails the first time it runs in this process (after recording its effect).
    pub fail: bool,
    pub irreversible: bool,
    /// The DAG's tasks: the effects it leaves when it succeeds (0 in states written
    /// before it was kept).
    #[serde(default)]
    pub of: u16,
}

#[async_trait]
impl Task<Env> for Step {
    async fn execute(&self, ctx: &mut Context<Env>) -> Result<(), ProcError> {
        let env = ctx.env();
        env.steps.fetch_add(1, Ordering::Relaxed);
        let root = ctx.root().0;
        env.add_effect(
            (root, self.index, 0),
            u32::from(self.of),
            crate::work::fence(ctx),
            None,
        )?;
        if self.fail && env.fire(root, self.index) {
            return Err(ProcError::failed(format!(
                "injected failure in task {}",
                self.index
            )));
        }
        Ok(())
    }

    async fn rollback(&self, ctx: &mut Context<Env>) -> Result<(), ProcError> {
        ctx.env()
            .remove_effect((ctx.root().0, self.index, 0), crate::work::fence(ctx), None)
    }

    fn irreversible(&self) -> bool {
        self.irreversible
    }
}

/// Registers the DAG root and its task type.
pub fn register(registry: &mut Registry<Env>) {
    registry
        .register::<Dag<Step>>(DAG_TYPE)
        .register::<DagTask<Step>>("workload_dag_task");
}

/// A DAG of `width` tasks: each task after the first depends on up to two random
/// earlier ones; each is irreversible at `irreversible_rate`; at `fail_rate` one
/// reversible task fails.
pub fn generate(
    rng: &mut fastrand::Rng,
    width: u16,
    fail_rate: f64,
    irreversible_rate: f64,
) -> Dag<Step> {
    let irreversible: Vec<bool> = (0..width).map(|_| rng.f64() < irreversible_rate).collect();
    let reversible: Vec<u16> = (0..width).filter(|&i| !irreversible[i as usize]).collect();
    let fail = (rng.f64() < fail_rate && !reversible.is_empty())
        .then(|| reversible[rng.usize(0..reversible.len())]);
    let mut b = DagBuilder::new();
    let ids: Vec<_> = (0..width)
        .map(|index| {
            b.add(Step {
                index,
                fail: fail == Some(index),
                irreversible: irreversible[index as usize],
                of: width,
            })
        })
        .collect();
    for after in 1..ids.len() {
        for _ in 0..rng.usize(0..=after.min(2)) {
            b.edge(ids[rng.usize(0..after)], ids[after]);
        }
    }
    b.parallelism(PARALLELISM);
    b.build()
        .expect("edges go from earlier to later tasks: no cycle")
}

/// The operator: continues every procedure paused now and every one that pauses from
/// now on, on a task of the current actix system; counts the continues.
///
/// # Errors
/// Those of [`Executor::subscribe`] and [`Executor::list`].
pub async fn continue_every_pause(
    executor: &Executor<Env>,
) -> Result<Rc<Cell<u64>>, proctor::Error> {
    let mut events = executor.subscribe().await?;
    let paused = executor.list(List::new().state(ProcState::Paused)).await?;
    let continued = Rc::new(Cell::new(0u64));
    let (executor, count) = (executor.clone(), continued.clone());
    actix::spawn(async move {
        let continue_one = |id: ProcId| {
            let (executor, count) = (executor.clone(), count.clone());
            async move {
                match executor.resume(id).await {
                    Ok(()) => count.set(count.get() + 1),
                    // Paused between the subscription and the listing, it came twice;
                    // the second continue finds it running again.
                    Err(proctor::Error::Refused { .. }) => {}
                    Err(e) => eprintln!("continue {id}: {e}"),
                }
            }
        };
        for info in paused {
            continue_one(info.id).await;
        }
        while let Some(event) = events.next().await {
            if let ProcEvent::Paused { id, .. } = event {
                continue_one(id).await;
            }
        }
    });
    Ok(continued)
}

/// What a DAG root must come to, from its (persisted) state.
#[derive(Clone, Debug)]
pub struct Plan {
    pub width: usize,
    pub fail: Option<u16>,
    pub irreversible: Vec<u16>,
    pub edges: Vec<(u16, u16)>,
}

impl Plan {
    pub fn of(dag: &Dag<Step>) -> Plan {
        let tasks: Vec<&Step> = dag
            .statuses()
            .into_iter()
            .filter_map(|(id, _)| dag.task(id))
            .collect();
        let index = |id: proctor::TaskId| tasks[id.index()].index;
        Plan {
            width: tasks.len(),
            fail: tasks.iter().find(|t| t.fail).map(|t| t.index),
            irreversible: tasks
                .iter()
                .filter(|t| t.irreversible)
                .map(|t| t.index)
                .collect(),
            edges: dag
                .edges()
                .into_iter()
                .map(|(a, b)| (index(a), index(b)))
                .collect(),
        }
    }
}

/// Where a root's effects were added and removed in the ledger: positions in its
/// history, per task.
#[derive(Default)]
pub struct Trace {
    added: HashMap<u16, Vec<usize>>,
    removed: HashMap<u16, Vec<usize>>,
}

/// The ledger's history, one [`Trace`] per root.
pub fn traces(history: &[(bool, Effect)]) -> HashMap<u64, Trace> {
    let mut traces: HashMap<u64, Trace> = HashMap::new();
    for (at, &(add, (root, task, _))) in history.iter().enumerate() {
        let trace = traces.entry(root).or_default();
        let positions = if add {
            &mut trace.added
        } else {
            &mut trace.removed
        };
        positions.entry(task).or_default().push(at);
    }
    traces
}

/// What is wrong with DAG root `id`, finished in `state`, given its plan and its
/// trace. The count of its effects in force is checked with the other roots'
/// ([`crate::work::ledger_violations`]).
pub fn violations(id: ProcId, state: ProcState, plan: &Plan, trace: &Trace) -> Vec<String> {
    let mut found = Vec::new();
    let first_added = |t: u16| trace.added.get(&t).and_then(|p| p.first().copied());
    match (state, plan.fail) {
        (ProcState::Success, None) => {}
        (ProcState::Success, Some(f)) => {
            // It failed, so it must have paused: past a recorded point of no return.
            let failed_at = first_added(f);
            let before = plan
                .irreversible
                .iter()
                .any(|&i| first_added(i).zip(failed_at).is_some_and(|(i, f)| i < f));
            if !before {
                found.push(format!(
                    "DAG {id} succeeded though task {f} failed before any point of no return"
                ));
            }
        }
        (ProcState::RolledBack, None) => {
            found.push(format!("DAG {id} rolled back though no task fails"));
        }
        (ProcState::RolledBack, Some(_)) => {
            for &i in &plan.irreversible {
                if trace.added.contains_key(&i) {
                    found.push(format!(
                        "DAG {id} rolled back past task {i}, a point of no return"
                    ));
                }
            }
            for &(a, b) in &plan.edges {
                let (Some(undo_a), Some(undo_b)) = (trace.removed.get(&a), trace.removed.get(&b))
                else {
                    continue;
                };
                if undo_b.last() > undo_a.first() {
                    found.push(format!(
                        "DAG {id} undid task {a} before task {b}, against the edge {a} → {b}"
                    ));
                }
            }
        }
        _ => {} // not finished: reported with the other roots
    }
    found
}
