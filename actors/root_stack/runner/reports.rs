//! What a tree's procedures report to their runner: a step's end, a pause asked for
//! between calls, a failure asked for (an abort, a timeout), a rollback's end, locks
//! held for life, a kept-going deadline.

use super::*;

impl TreeRunner {
    pub(super) fn on_step_done(&mut self, msg: StepDone, ctx: &mut TreeCtx<'_>) {
        self.dispatched -= 1;
        let id = msg.report.id;
        // Whether this step may make the tree irreversible (the core decides: not a
        // failed, yielded or skipped step, nor one in a tree that failed first).
        let marks = msg.report.irreversible && !self.core.is_irreversible();
        if self.halted.is_none() {
            if !msg.children.is_empty() {
                self.unspawned.get_or_insert_default().extend(
                    msg.children
                        .into_iter()
                        .map(|(id, proc)| (id, (proc, Vec::new()))),
                );
            }
            if let Some(t) = self.core(
                "step report",
                |core| core.on_step(msg.report, now_ms()),
                ctx,
            ) {
                if marks && self.core.is_irreversible() && !self.core.is_failed() {
                    // Before the transition's lock requests: the deadlock detector
                    // neither fails nor lends to this tree's waiters as if it could
                    // roll back. Told before the record is durable; a crash resets
                    // it, and recovery tells it again if the record made it.
                    self.tell_irreversible(ctx);
                }
                // Children keep their encoded state for their cell's "last good" copy,
                // and show their state name from the start (a DAG's task names its
                // task before it has run).
                let mut names: Vec<(ProcId, String)> =
                    msg.state_name.map(|name| (id, name)).into_iter().collect();
                for op in &t.persist {
                    if let StoreOp::Insert(r) = op {
                        let unspawned = self.unspawned.as_deref_mut();
                        if let Some(entry) = unspawned.and_then(|u| u.get_mut(&r.id)) {
                            entry.1.clone_from(&r.data);
                            let proc = &entry.0;
                            if let Ok(Some(name)) = guard("state_name", || proc.state_name()) {
                                names.push((r.id, name));
                            }
                        }
                    }
                }
                self.apply_named(t, None, names, ctx);
            }
        }
        // Only now, with the report recorded (its records on their way to the
        // persistence actor, and any enqueue it caused without a write sent first), may
        // the worker go to another step.
        perturb::point("root_stack::step_done::free_worker");
        ctx.tell(StepFinished(id));
        self.stop_when_quiet(ctx);
    }
}

impl TreeRunner {
    pub(super) fn on_pause_now(&mut self, msg: PauseNow, ctx: &mut TreeCtx<'_>) {
        if self.halted.is_some() {
            return;
        }
        let (id, data) = (msg.id, msg.data);
        let t = self.core(
            "pause",
            |core| core.on_pause_waiting(id, data, now_ms()),
            ctx,
        );
        match t {
            Some(Some(t)) => self.apply(t, None, ctx),
            // Woken meanwhile: it pauses at its next step (the waiting answers stay).
            Some(None) => {
                let _ = self.send(id, ProcMsg::Pause { now: false }, ctx);
            }
            None => {}
        }
    }
}

impl TreeRunner {
    pub(super) fn on_fail_request(&mut self, msg: FailRequest, ctx: &mut TreeCtx<'_>) {
        let mut ack = msg.ack;
        let id = msg.id;
        let t = match msg.failure {
            Some((error, data)) => {
                self.core("abort", |core| core.on_fail(id, error, data, now_ms()), ctx)
            }
            // Already failing (an earlier abort, a timeout, a failed step): that
            // failure's request came first and is applied.
            None => Some(Transition::default()),
        };
        let Some(t) = t else {
            if let (Some((ack, _)), Some(e)) = (ack, &self.halted) {
                ctx.answer(ack, Err(e.duplicate()));
            }
            return;
        };
        // An abort is answered accepted only if its tree now rolls back. It may not:
        // the tree passed its point of no return after the abort reached the
        // procedure (a sibling's step recorded it while the abort waited for a step,
        // or for a failed step's policy), so the failure pauses the procedure instead;
        // or the procedure finished meanwhile (an operator's bypass).
        if let Some((_, answer @ Ok(true))) = &mut ack {
            if !self.core.is_failed() {
                *answer = Err(match self.core.state_of(id) {
                    Some(state) if !state.is_finished() => Error::Refused {
                        command: "abort",
                        id,
                        reason: format!(
                            "tree {} passed its point of no return before the abort took \
                             effect: procedure {id} pauses instead (at once, or when its \
                             queued step comes back); continue it then",
                            self.core.root()
                        ),
                    },
                    state => Error::Finished {
                        id,
                        state: state.unwrap_or(ProcState::Success),
                    },
                });
            }
        }
        self.apply(t, ack, ctx);
    }
}

impl TreeRunner {
    pub(super) fn on_rolled_back(&mut self, msg: RolledBack, ctx: &mut TreeCtx<'_>) {
        let rolled_back = |core: &mut RootStack| core.on_rolled_back(msg.id, msg.result, now_ms());
        self.feed("rollback report", rolled_back, ctx);
    }
}

impl TreeRunner {
    pub(super) fn on_locks_held(&mut self, msg: LocksHeld, ctx: &mut TreeCtx<'_>) {
        if self.halted.is_some() {
            // Nothing is persisted any more; the step still owes its report (skipped),
            // and this runner waits for it before it stops.
            if self.procs.contains_key(&msg.id) {
                let addr = self.proc_addr(msg.id);
                ctx.tell(Enqueue {
                    id: msg.id,
                    root: self.core.root(),
                    addr,
                    place: Place::Front,
                    what: (self.core.type_name_of(msg.id).unwrap_or("?"), 0),
                    lock: None,
                });
            }
            return;
        }
        let held = |core: &mut RootStack| core.on_locks_held(msg.id, msg.data, now_ms());
        self.feed("locks granted", held, ctx);
    }
}

impl TreeRunner {
    pub(super) fn on_deadline(&mut self, msg: Deadline, ctx: &mut TreeCtx<'_>) {
        let id = msg.id;
        let kept = |core: &mut RootStack| core.on_deadline(id, msg.deadline_ms, msg.data, now_ms());
        if self.feed("deadline", kept, ctx) {
            // The timer of the new deadline, if the timeout hook set one.
            self.arm_deadline(id, ctx);
        }
    }
}
