//! The workload's procedure: a state machine of `steps` steps that records each step's
//! side effect in the ledger, starts `children` children from its first step, and fails
//! where its plan says. Shared with the SIGKILL crash test.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use proctor::{
    async_trait, Context, Flow, ProcError, ProcId, ProcState, Registry, StateContext, StateMachine,
    StateMachineProcedure,
};
use serde::{Deserialize, Serialize};

use crate::ledger::{self, Ledger};

/// What the procedures share: the ledger and a step counter.
pub struct Env {
    pub ledger: Option<Ledger>,
    pub steps: AtomicU64,
}

impl Env {
    fn effect(&self, effect: ledger::Effect, add: bool) -> Result<(), ProcError> {
        let Some(ledger) = &self.ledger else {
            return Ok(());
        };
        let written = if add {
            ledger.add(effect)
        } else {
            ledger.remove(effect)
        };
        written.map_err(|e| ProcError::failed(format!("ledger: {e}")))
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
}

#[async_trait]
impl StateMachineProcedure for Work {
    type State = u16;

    fn initial_state(&self) -> u16 {
        0
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, u16>,
        step: u16,
    ) -> Result<Flow, ProcError> {
        let env = ctx.env::<Arc<Env>>()?;
        env.steps.fetch_add(1, Ordering::Relaxed);
        if step >= self.steps {
            // Only reached by a one-step root with children: the step after them.
            return Ok(Flow::Done);
        }
        env.effect((ctx.root().0, self.path, step), true)?;
        if self.fail == Some((self.path, step)) {
            return Err(ProcError::failed(format!(
                "injected failure at path {} step {step}",
                self.path
            )));
        }
        ctx.set_next_state(step + 1);
        if self.path == 0 && step == 0 && self.children > 0 {
            let children = (1..=self.children)
                .map(|path| {
                    Box::new(StateMachine::new(Work {
                        path,
                        children: 0,
                        ..self.clone()
                    })) as Box<dyn proctor::Procedure>
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

    async fn rollback_state(&mut self, ctx: &mut Context, step: u16) -> Result<(), ProcError> {
        let env = ctx.env::<Arc<Env>>()?;
        if step >= self.steps {
            return Ok(());
        }
        env.effect((ctx.root().0, self.path, step), false)?;
        if self.path == 0 && step == 0 {
            // The root's first step started the children: undo what they did. A child
            // that succeeded is not rolled back itself (see DESIGN.md).
            for path in 1..=self.children {
                for child_step in 0..self.steps {
                    env.effect((ctx.root().0, path, child_step), false)?;
                }
            }
        }
        Ok(())
    }
}

/// The registry the workload's executors use.
pub fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.register::<StateMachine<Work>>("workload");
    registry
}

/// Checks finished roots against the ledger: a successful root has all
/// `effects_per_root` effects, a rolled-back one none, and the ledger names no root the
/// store does not know. `roots` are the roots the executor knows, with their states.
pub fn ledger_violations(
    roots: &HashMap<ProcId, ProcState>,
    effects: &HashMap<u64, usize>,
    effects_per_root: usize,
) -> Vec<String> {
    let mut violations = Vec::new();
    for (id, state) in roots {
        let n = effects.get(&id.0).copied().unwrap_or(0);
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
