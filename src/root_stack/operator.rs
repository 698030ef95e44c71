//! What operators do to a tree: continue, pause, roll back and bypass its procedures,
//! each refused with a reason when the state does not allow it.

use super::*;

impl RootStack {
    /// An operator continues `id`: a PAUSED procedure runs its step again (from its
    /// recorded state, its retries reset); a ROLLBACK_PAUSED one retries its rollback.
    /// Refusals say why.
    pub fn on_continue(&mut self, id: ProcId, now_ms: u64) -> Result<Transition, String> {
        let Some(node) = self.nodes.get(&id) else {
            return Err(format!("procedure {id} is not in tree {}", self.root));
        };
        let mut t = Transition::default();
        match node.state {
            ProcState::Paused if self.phase == Phase::Executing && !self.is_failed() => {
                let data = self.unpause(id);
                let node = self.node_mut(id);
                node.steering.retries = 0;
                // Paused while it waited (`on_pause_waiting`): it waits again.
                match (node.event.as_deref().map(str::to_string), node.wake_at_ms) {
                    (Some(event), _) => {
                        node.state = ProcState::Waiting;
                        t.actions.push(Action::SuspendOn { id, event });
                    }
                    (None, Some(at_ms)) => {
                        node.state = ProcState::WaitingTimeout;
                        t.actions.push(Action::WakeAt { id, at_ms });
                    }
                    // Paused (past its tree's point of no return, its timeout) while
                    // its children ran: it waits for those still running, and the last
                    // to finish wakes it; waking per child, it looks at them at once
                    // (some may have succeeded while it was paused).
                    (None, None)
                        if node.pending_children > 0 && !node.steering.wakes_per_child =>
                    {
                        node.state = ProcState::Waiting;
                    }
                    (None, None) => self.enqueue(&mut t, id, Place::Back),
                }
                self.persist_update(&mut t, id, data, now_ms);
            }
            ProcState::Paused => {
                return Err(format!(
                    "procedure {id}'s tree {} has failed: it is rolled back, not continued",
                    self.root
                ))
            }
            // Recovered, it may be below entries the rollback undoes first (the steps
            // of others that may have been cut off): it is continued when it is next.
            ProcState::RollbackPaused if self.stack.last().is_none_or(|e| e.id != id) => {
                return Err(format!(
                    "procedure {id}'s rollback is not next: the tree's rollback undoes \
                     other steps first, then waits for it; continue it then"
                ))
            }
            ProcState::RollbackPaused => {
                let of = self.rollback_of_top();
                let data = self.unpause(id);
                let node = self.node_mut(id);
                node.steering.retries = 0;
                node.reset_rollback_attempts();
                node.state = ProcState::Failed;
                self.persist_update(&mut t, id, data, now_ms);
                t.actions.push(Action::Rollback { id, of });
            }
            state => {
                return Err(format!(
                    "procedure {id} is {state}: only a PAUSED or ROLLBACK_PAUSED procedure can be continued"
                ))
            }
        }
        Ok(t)
    }

    /// Whether `id` waits for an event or a timer (not for children): it has no step to
    /// stop at soon, so an operator's pause takes effect at once (`on_pause_waiting`).
    pub fn waits_for_wake(&self, id: ProcId) -> bool {
        self.nodes.get(&id).is_some_and(|n| {
            n.state == ProcState::WaitingTimeout
                || (n.state == ProcState::Waiting && n.event.is_some())
        })
    }

    /// An operator pauses `id` while it waits for an event or a timer: it is PAUSED
    /// now, recorded with `data` (its state as recorded), and keeps what it waits for,
    /// so [`on_continue`](Self::on_continue) puts it back to waiting (an event that
    /// is still ready, or a time that has passed, wakes it at once). `None` if it no
    /// longer waits (woken meanwhile, or its tree failed): it pauses at its next step
    /// instead, if any.
    pub fn on_pause_waiting(
        &mut self,
        id: ProcId,
        data: Vec<u8>,
        now_ms: u64,
    ) -> Option<Transition> {
        if !self.waits_for_wake(id) || self.pause_refusal(id).is_some() {
            return None;
        }
        Some(self.operator_pause(id, data, now_ms))
    }

    /// An operator pauses `id` on a stopped engine (`proctor pause`), `data` being its
    /// recorded state. Nothing runs there, so a RUNNABLE procedure pauses at once, as
    /// one waiting for an event or a timer does (`on_pause_waiting`); a parent waiting
    /// for its children is refused, since its pause takes effect at its next step,
    /// which only a running engine sees. Other refusals as [`pause_refusal`]
    /// (Self::pause_refusal).
    pub fn on_offline_pause(
        &mut self,
        id: ProcId,
        data: Vec<u8>,
        now_ms: u64,
    ) -> Result<Transition, String> {
        if let Some(reason) = self.pause_refusal(id) {
            return Err(reason);
        }
        let node = &self.nodes[&id];
        if node.state == ProcState::Waiting && node.pending_children > 0 {
            return Err(format!(
                "procedure {id} waits for its children: pause them, or pause it on a \
                 running engine (it stops at its next step)"
            ));
        }
        Ok(self.operator_pause(id, data, now_ms))
    }

    /// Pauses `id` for an operator: no error, no policy, no retries spent.
    fn operator_pause(&mut self, id: ProcId, data: Vec<u8>, now_ms: u64) -> Transition {
        let mut t = Transition::default();
        let why = Paused {
            error: None,
            policy: None,
            retries: 0,
        };
        self.pause(&mut t, id, ProcState::Paused, why, data, now_ms);
        t
    }

    /// `id`'s node, if it is in the tree and unfinished; otherwise why an operator may
    /// not act on it.
    fn unfinished(&self, id: ProcId) -> Result<&Node, String> {
        let Some(node) = self.nodes.get(&id) else {
            return Err(format!("procedure {id} is not in tree {}", self.root));
        };
        if node.state.is_finished() {
            return Err(format!(
                "procedure {id} has already finished ({})",
                node.state
            ));
        }
        Ok(node)
    }

    /// Why an operator may not pause `id`, if not: only a procedure queued, running or
    /// waiting in a healthy tree can be (it pauses at its next step, which it does not
    /// run).
    pub fn pause_refusal(&self, id: ProcId) -> Option<String> {
        let node = match self.unfinished(id) {
            Ok(node) => node,
            Err(refusal) => return Some(refusal),
        };
        if self.is_failed() || self.phase != Phase::Executing {
            return Some(format!("tree {} is rolling back", self.root));
        }
        match node.state {
            ProcState::Runnable | ProcState::Waiting | ProcState::WaitingTimeout => None,
            state => Some(format!(
                "procedure {id} is {state}: only a runnable or waiting procedure can be paused"
            )),
        }
    }

    /// Why an operator may not roll `id` back, if not: a tree past its point of no
    /// return, a procedure finished, rolling back or with its rollback paused.
    pub fn rollback_refusal(&self, id: ProcId) -> Option<String> {
        let node = match self.unfinished(id) {
            Ok(node) => node,
            Err(refusal) => return Some(refusal),
        };
        if node.state == ProcState::RollbackPaused {
            return Some(format!(
                "procedure {id}'s rollback is paused: continue it instead"
            ));
        }
        if self.is_failed() || self.phase != Phase::Executing {
            return Some(format!("tree {} is already rolling back", self.root));
        }
        if self.is_irreversible() {
            return Some(format!(
                "tree {} has passed its point of no return: continue instead",
                self.root
            ));
        }
        None
    }

    /// An operator rolls back the PAUSED procedure `id`: it fails
    /// ([`ProcError::Aborted`]) and its tree rolls back, the step that failed first when
    /// it may have left effects. Refusals say why (see [`rollback_refusal`]
    /// (Self::rollback_refusal)); a procedure that is not paused is rolled back by an
    /// abort instead.
    pub fn on_operator_rollback(&mut self, id: ProcId, now_ms: u64) -> Result<Transition, String> {
        if let Some(reason) = self.rollback_refusal(id) {
            return Err(reason);
        }
        if self.nodes[&id].state != ProcState::Paused {
            return Err(format!("procedure {id} is not paused"));
        }
        let mut t = Transition::default();
        let data = self.unpause(id);
        self.fail(&mut t, id, ProcError::Aborted);
        self.persist_update(&mut t, id, data, now_ms);
        self.maybe_start_rollback(&mut t, now_ms);
        Ok(t)
    }

    /// An operator bypasses `id` (HBCK2's `bypass`): it is marked SUCCESS without
    /// running further or rolling back, and so, with `recursive`, is every unfinished
    /// procedure below it. Which procedures it may take is `reach`'s ([`BypassReach`]):
    /// by default only procedures that wait (for children, an event, a deadline, or an
    /// operator: PAUSED). A tree that is rolling back (a ROLLBACK_PAUSED procedure's
    /// too) is refused. The parent of a bypassed procedure goes on as if it had
    /// succeeded; bypassing the root ends the tree. Refusals say why.
    ///
    /// `data_of` gives a procedure's state as recorded (the core keeps only a paused
    /// one's): each bypassed procedure's final record keeps it, so what it was can be
    /// read (and decoded) until its result is evicted.
    pub fn on_bypass(
        &mut self,
        id: ProcId,
        recursive: bool,
        reach: BypassReach,
        data_of: &dyn Fn(ProcId) -> Vec<u8>,
        now_ms: u64,
    ) -> Result<Transition, String> {
        self.unfinished(id)?;
        // A failed tree rolls back once its running steps end: a procedure bypassed
        // now would have its steps skipped by that rollback.
        if self.phase != Phase::Executing || self.is_failed() {
            return Err(format!("tree {} is rolling back", self.root));
        }
        // The target and, with `recursive`, its unfinished descendants, deepest first.
        let mut targets = vec![id];
        let mut i = 0;
        while i < targets.len() {
            let parent = targets[i];
            let children: Vec<ProcId> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.parent == Some(parent) && !n.state.is_finished())
                .map(|(&c, _)| c)
                .collect();
            if !children.is_empty() && !recursive {
                let children: Vec<String> = children.iter().map(ToString::to_string).collect();
                return Err(format!(
                    "procedure {parent} has unfinished children {}: bypass it recursively",
                    children.join(", ")
                ));
            }
            targets.extend(children);
            i += 1;
        }
        for &target in &targets {
            let state = self.nodes[&target].state;
            let idle = matches!(
                state,
                ProcState::Waiting | ProcState::WaitingTimeout | ProcState::Paused
            ) || (reach != BypassReach::Waiting && state == ProcState::Runnable);
            if !idle {
                let hint = if state == ProcState::Runnable {
                    " (force the bypass to drop its step)"
                } else {
                    ""
                };
                return Err(format!(
                    "procedure {target} is {state}: only a waiting or paused procedure can be bypassed{hint}"
                ));
            }
        }
        let mut t = Transition::default();
        let root = self.root;
        let mut root_data = Vec::new();
        for &target in targets.iter().rev() {
            let data = if self.nodes[&target].state == ProcState::Paused {
                self.unpause(target)
            } else {
                data_of(target)
            };
            if reach == BypassReach::Forced && self.nodes[&target].state == ProcState::Runnable {
                // Its step, queued or in progress, is no longer the tree's: the runner
                // frees its worker when it comes back or its call is dropped. One
                // waiting for its locks stops waiting.
                self.running -= 1;
                if self.lock_request(target, false).is_some() {
                    t.actions.push(Action::Withdraw(target));
                }
            }
            let node = self.node_mut(target);
            node.state = ProcState::Success;
            node.bypassed = true;
            node.pending_children = 0;
            node.wake_at_ms = None;
            if target != root {
                node.stopped = true;
                self.persist_update(&mut t, target, data, now_ms);
                t.actions.push(Action::Stop(target));
            } else {
                root_data = data;
            }
        }
        tracing::warn!(target: crate::targets::TREE, root = %self.root, proc = %id, recursive, ?reach, "procedure bypassed");
        if id == self.root {
            self.persist_update(&mut t, id, root_data, now_ms);
            self.finish(&mut t, now_ms);
        } else if let Some(parent) = self.nodes[&id].parent {
            self.child_succeeded(&mut t, parent);
        }
        Ok(t)
    }
}

/// Which procedures an operator's bypass ([`RootStack::on_bypass`]) may take, besides
/// those that wait (for children, an event, a deadline) or are PAUSED.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BypassReach {
    /// A running engine's bypass: no other. A procedure queued or in a step is
    /// refused: it cannot be stopped under it.
    Waiting,
    /// A stopped engine's (an operator's offline bypass, from the records): RUNNABLE
    /// ones too, as nothing is queued or in a step then.
    Stopped,
    /// A running engine's forced bypass (HBCK2's `bypass -o`), for a procedure stuck
    /// in a step: RUNNABLE ones too. A queued step is dropped when the scheduler gets
    /// to it, a lock request withdrawn, and a call in progress dropped at its next
    /// `.await` (code between two awaits, or blocking its thread, runs on until then).
    Forced,
}
