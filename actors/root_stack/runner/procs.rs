//! The tree's procedure actors, as their root stack starts, feeds, passivates, stops
//! and supervises them. Every message to a procedure goes through [`TreeRunner::send`]:
//! to its actor's mailbox, held while the actor hands its cell back, or, to a waiting
//! procedure, to a new actor started with its cell.

use actix::Addr;

use crate::actors::guard::decode_guarded;
use crate::actors::procedure::ProcedureActor;
use crate::actors::protocol::RunStep;
use crate::actors::root_stack::FromProc;

use super::*;

/// A live procedure: its actor while it is active, its cell while it waits (exactly
/// one of the two).
pub(in crate::actors::root_stack) struct Slot {
    cell: Option<Box<ProcedureCell>>,
    live: Option<Box<Live>>,
}

/// Finished procedures whose actors run their `Stop`, by id.
pub(in crate::actors::root_stack) type Leaving = Option<Box<SortedMap<ProcId, Box<Live>>>>;

/// A procedure's running actor, as its root stack knows it.
pub(in crate::actors::root_stack) struct Live {
    /// Shared with the steps queued for it ([`Live::queue_step`]): cloning an actix
    /// `Addr` allocates.
    addr: Arc<Addr<ProcedureActor>>,
    /// Which activation this is (an exit report names it).
    generation: u32,
    /// The state it last reported (or was reset to): where it starts again if its
    /// actor dies, and what an operator's bypass records.
    checkpoint: Vec<u8>,
    /// A step or rollback sent to it and not reported yet.
    busy: Busy,
    /// `Passivate` was sent: messages wait here for its answer.
    held: Option<Vec<ProcMsg>>,
    /// It refused to passivate: not asked again until it reports.
    refused: bool,
}

#[derive(Clone, Copy)]
enum Busy {
    No,
    /// A step queued with the scheduler, which sends it straight to this actor: it is
    /// the actor's once it takes it (its exit says so), and comes back through the
    /// tree if the actor stops first.
    Queued(usize),
    Step(usize),
    Rollback {
        of: RollbackOf,
    },
}

impl Slot {
    pub(super) fn active(live: Box<Live>) -> Slot {
        Slot {
            cell: None,
            live: Some(live),
        }
    }

    /// A procedure with no actor yet: its actor starts with its first message.
    pub(super) fn waiting(cell: Box<ProcedureCell>) -> Slot {
        Slot {
            cell: Some(cell),
            live: None,
        }
    }

    /// Its state as last recorded (or reported), for an operator's bypass.
    pub(super) fn recorded(&self) -> &[u8] {
        match (&self.cell, &self.live) {
            (Some(cell), _) => cell.data(),
            (None, Some(live)) => &live.checkpoint,
            (None, None) => &[],
        }
    }
}

impl Live {
    /// The actor a step of it just queued may be sent to straight (and it is then
    /// not passivated until it reports that step), if it runs and is not handing its
    /// cell back.
    fn queue_step(&mut self, step: usize) -> Option<Arc<Addr<ProcedureActor>>> {
        if self.held.is_some() || !matches!(self.busy, Busy::No) {
            return None;
        }
        self.busy = Busy::Queued(step);
        Some(self.addr.clone())
    }

    /// Sends `msg` (or holds it while a passivation is answered), noting what it asks.
    fn post(&mut self, msg: ProcMsg) {
        match &msg {
            ProcMsg::Cell(ToCell::RunStep(run)) => self.busy = Busy::Step(run.step),
            ProcMsg::Cell(ToCell::Rollback(Rollback { of })) => {
                self.busy = Busy::Rollback { of: *of }
            }
            ProcMsg::Reset(data) => self.checkpoint.clone_from(data),
            _ => {}
        }
        match &mut self.held {
            Some(held) => held.push(msg),
            None => self.addr.do_send(msg),
        }
    }

    /// Asks the actor to hand its cell back, unless it has a call out or refused.
    fn ask_passivate(&mut self) {
        if self.held.is_none() && matches!(self.busy, Busy::No) && !self.refused {
            self.addr.do_send(ProcMsg::Passivate);
            self.held = Some(Vec::new());
        }
    }

    /// What it reported: a step or rollback it was sent has ended, and its state.
    fn reported(&mut self, report: &Report) {
        self.refused = false;
        let data = match report {
            Report::StepDone(m) => {
                self.busy = Busy::No;
                &m.report.data
            }
            Report::RolledBack(m) => {
                self.busy = Busy::No;
                match &m.result {
                    Ok(data) => data,
                    Err(failure) => &failure.data,
                }
            }
            Report::Fail(m) => match &m.failure {
                Some((_, data)) => data,
                None => return,
            },
            Report::Deadline(m) => &m.data,
            Report::PauseNow(m) => &m.data,
            Report::LocksHeld(m) => &m.data,
        };
        // A yield reports no state.
        if !data.is_empty() {
            self.checkpoint.clone_from(data);
        }
    }
}

/// Starts an actor holding `cell` (fields of the runner, borrowed apart from its map).
fn start(
    generation: &mut u32,
    live: &mut u32,
    cell: Box<ProcedureCell>,
    ctx: &mut TreeCtx<'_>,
) -> Box<Live> {
    *generation = generation.wrapping_add(1);
    *live += 1;
    let checkpoint = cell.data().to_vec();
    let addr = Arc::new(ctx.start_procedure(cell, *generation));
    Box::new(Live {
        addr,
        generation: *generation,
        checkpoint,
        busy: Busy::No,
        held: None,
        refused: false,
    })
}

fn report_id(report: &Report) -> ProcId {
    match report {
        Report::StepDone(m) => m.report.id,
        Report::Fail(m) => m.id,
        Report::RolledBack(m) => m.id,
        Report::Deadline(m) => m.id,
        Report::PauseNow(m) => m.id,
        Report::LocksHeld(m) => m.id,
    }
}

impl TreeRunner {
    /// Starts the actor of a procedure of this tree with `cell`.
    pub(super) fn activate(
        &mut self,
        cell: Box<ProcedureCell>,
        ctx: &mut TreeCtx<'_>,
    ) -> Box<Live> {
        start(&mut self.generation, &mut self.live, cell, ctx)
    }

    /// The actor a step of `id` just queued may be sent straight to, if it has one
    /// that may take it (see [`Live::queue_step`]).
    pub(super) fn straight_to(
        &mut self,
        id: ProcId,
        step: usize,
    ) -> Option<Arc<Addr<ProcedureActor>>> {
        self.procs.get_mut(&id)?.live.as_mut()?.queue_step(step)
    }

    /// Sends `msg` to live procedure `id`, starting its actor if it waits; gives the
    /// message back if `id` is not live.
    pub(super) fn send(
        &mut self,
        id: ProcId,
        msg: ProcMsg,
        ctx: &mut TreeCtx<'_>,
    ) -> Result<(), ProcMsg> {
        let Some(slot) = self.procs.get_mut(&id) else {
            return Err(msg);
        };
        if let Some(cell) = slot.cell.take() {
            slot.live = Some(start(&mut self.generation, &mut self.live, cell, ctx));
        }
        match slot.live.as_mut() {
            Some(live) => {
                live.post(msg);
                Ok(())
            }
            None => Err(msg),
        }
    }

    /// A message from one of the tree's procedure actors.
    pub(crate) fn on_procedure(&mut self, msg: FromProc, ctx: &mut TreeCtx<'_>) {
        match msg {
            FromProc::Report(report) => {
                let id = report_id(&report);
                if self.core.state_of(id).is_none_or(|s| s.is_finished()) {
                    // A forced bypass finished it under a call that reported before
                    // it was stopped: nothing to record, but a step's worker to free.
                    if let Report::StepDone(_) = report {
                        self.step_dropped(id, ctx);
                    }
                    self.stop_when_quiet(ctx);
                    return;
                }
                if let Some(live) = self.procs.get_mut(&id).and_then(|s| s.live.as_mut()) {
                    live.reported(&report);
                }
                self.on_report(report, ctx);
                self.passivate_if_waiting(id);
            }
            FromProc::Passivated(id, cell) => self.on_passivated(id, cell, ctx),
            FromProc::Stopped { id, cut } => {
                if cut {
                    self.step_dropped(id, ctx);
                }
                if self.leave(id).is_some() {
                    self.publish_result(ctx);
                    self.answer_quiesce(ctx);
                }
            }
            FromProc::Exited {
                id,
                generation,
                reason,
                in_step,
            } => {
                self.on_exited(id, generation, &reason, in_step, ctx);
            }
        }
        self.stop_when_quiet(ctx);
    }

    fn on_report(&mut self, report: Report, ctx: &mut TreeCtx<'_>) {
        match report {
            Report::StepDone(m) => self.on_step_done(m, ctx),
            Report::Fail(m) => self.on_fail_request(m, ctx),
            Report::RolledBack(m) => self.on_rolled_back(m, ctx),
            Report::Deadline(m) => self.on_deadline(m, ctx),
            Report::PauseNow(m) => self.on_pause_now(m, ctx),
            Report::LocksHeld(m) => self.on_locks_held(m, ctx),
        }
    }

    /// After `id` reported: if it now waits for children, an event, a timer or an
    /// operator, its actor hands its cell back.
    fn passivate_if_waiting(&mut self, id: ProcId) {
        let waits = matches!(
            self.core.state_of(id),
            Some(
                ProcState::Waiting
                    | ProcState::WaitingTimeout
                    | ProcState::Paused
                    | ProcState::RollbackPaused
            )
        );
        if waits {
            if let Some(live) = self.procs.get_mut(&id).and_then(|s| s.live.as_mut()) {
                live.ask_passivate();
            }
        }
    }

    /// The tree has nothing in flight but its procedures' actors: each that has no
    /// call out hands its cell back, so the tree can be passivated in turn.
    pub(crate) fn passivate_idle_procedures(&mut self) {
        if !self.quiet_but_for_procedures() {
            return;
        }
        for (_, slot) in self.procs.iter_mut() {
            if let Some(live) = slot.live.as_mut() {
                live.ask_passivate();
            }
        }
    }

    fn on_passivated(
        &mut self,
        id: ProcId,
        cell: Option<Box<ProcedureCell>>,
        ctx: &mut TreeCtx<'_>,
    ) {
        let in_procs = self.procs.contains_key(&id);
        let live = if in_procs {
            self.procs.get_mut(&id).and_then(|s| s.live.take())
        } else {
            // It finished meanwhile: its `Stop` waits in `held`.
            self.leaving.as_mut().and_then(|l| l.remove(&id))
        };
        let Some(mut live) = live else {
            return;
        };
        let mut held = live.held.take().unwrap_or_default();
        let live = match cell {
            // A call was running: it stays, and gets what waited.
            None => {
                live.refused = true;
                for msg in held {
                    live.addr.do_send(msg);
                }
                Some(live)
            }
            Some(cell) => {
                self.live -= 1;
                if held.is_empty() {
                    if let Some(slot) = self.procs.get_mut(&id) {
                        slot.cell = Some(cell);
                    }
                    None
                } else {
                    // Messages came meanwhile: a new actor takes the cell, and them.
                    let mut new = self.activate(cell, ctx);
                    for msg in held.drain(..) {
                        new.post(msg);
                    }
                    Some(new)
                }
            }
        };
        match (live, in_procs) {
            (Some(live), true) => {
                if let Some(slot) = self.procs.get_mut(&id) {
                    slot.live = Some(live);
                }
            }
            (Some(live), false) => {
                self.leaving.get_or_insert_default().insert(id, live);
            }
            (None, _) => {}
        }
    }

    /// `id` finished and its final record is durable: its actor (started again if it
    /// waited) releases its lock and runs its cleanup; the tree's result waits for it.
    pub(super) fn stop_procedure(&mut self, id: ProcId, state: ProcState, ctx: &mut TreeCtx<'_>) {
        let Some(slot) = self.procs.remove(&id) else {
            return;
        };
        if self.core.lock_request(id, false).is_some() && !self.status.halted() {
            // The engine's locks, before anything later (another procedure's request,
            // the tree's result).
            ctx.tell(ReleaseLocks {
                id,
                what: Release::All,
            });
        }
        let mut live = match (slot.cell, slot.live) {
            (Some(cell), _) => self.activate(cell, ctx),
            (None, Some(live)) => live,
            (None, None) => return,
        };
        live.post(ProcMsg::Stop(state));
        self.leaving.get_or_insert_default().insert(id, live);
    }

    /// `id`'s actor stopped after its `Stop` (or died in it): it has left.
    fn leave(&mut self, id: ProcId) -> Option<Box<Live>> {
        let leaving = self.leaving.as_mut()?;
        let live = leaving.remove(&id)?;
        if leaving.is_empty() {
            self.leaving = None;
        }
        self.live -= 1;
        Some(live)
    }

    /// Its procedures' actors stop without calling user code (the tree halted, or was
    /// cut off); their cells go with them.
    pub(super) fn halt_procedures(&mut self) {
        for (_, slot) in self.procs.iter() {
            if let Some(live) = &slot.live {
                live.addr.do_send(ProcMsg::Halt);
            }
        }
        for (_, live) in self.leaving.iter().flat_map(|l| l.iter()) {
            live.addr.do_send(ProcMsg::Halt);
        }
        self.procs.clear();
        self.leaving = None;
        self.live = 0;
    }

    /// The tree failed: procedures whose failed step's fate was being decided answer
    /// the aborts that waited for it.
    pub(super) fn tell_tree_failed(&mut self, ctx: &mut TreeCtx<'_>) {
        for (_, slot) in self.procs.iter_mut() {
            if let Some(cell) = slot.cell.take_if(|cell| cell.deciding()) {
                slot.live = Some(start(&mut self.generation, &mut self.live, cell, ctx));
            }
            if let Some(live) = slot.live.as_mut() {
                live.post(ProcMsg::TreeFailed);
            }
        }
    }

    /// `id` paused: a pause asked meanwhile is answered (bookkeeping only: a waiting
    /// procedure's cell is told without an actor).
    pub(super) fn forget_pause(&mut self, id: ProcId, ctx: &mut TreeCtx<'_>) {
        match self.procs.get_mut(&id) {
            Some(Slot {
                cell: Some(cell), ..
            }) => cell.forget_pause(),
            Some(_) => {
                let _ = self.send(id, ProcMsg::ForgetPause, ctx);
            }
            None => {}
        }
    }

    /// Arms the timer of `id`'s deadline, if it has one.
    pub(super) fn arm_deadline(&self, id: ProcId, ctx: &mut TreeCtx<'_>) {
        if let Some(deadline_ms) = self.core.deadline_of(id) {
            let delay = Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
            ctx.run_later(delay, Timer::Deadline { id, deadline_ms });
        }
    }

    /// What a procedure's cell is made with: who it is, from the tree's bookkeeping.
    pub(super) fn spec(&self, id: ProcId, recovered: bool) -> ProcSpec {
        let parent = self.core.procedure(id).and_then(|(parent, _)| parent);
        ProcSpec {
            id,
            parent,
            root: self.core.root(),
            type_name: self.core.type_name_of(id).unwrap_or("?"),
            deadline_ms: self.core.deadline_of(id),
            recovered,
            has_locks: self.core.lock_request(id, false).is_some(),
        }
    }

    /// An actor stopped without being told. If it is the current actor of a live
    /// procedure, the procedure starts again from the state it last reported, as
    /// recovery would start it after a crash.
    fn on_exited(
        &mut self,
        id: ProcId,
        generation: u32,
        reason: &str,
        in_step: Option<usize>,
        ctx: &mut TreeCtx<'_>,
    ) {
        if let Some(slot) = self.procs.get_mut(&id) {
            if let Some(mut old) = slot.live.take_if(|live| live.generation == generation) {
                self.live -= 1;
                // A step sent straight from the scheduler was the actor's if it took
                // it; if not, it comes back through the tree, to the new actor.
                if let (Busy::Queued(queued), Some(taken)) = (old.busy, in_step) {
                    debug_assert_eq!(queued, taken, "procedure {id} took another step");
                    old.busy = Busy::Step(taken);
                }
                self.restart(id, *old, reason, ctx);
            }
            return;
        }
        let leaving = self.leaving.as_ref().and_then(|l| l.get(&id));
        if leaving.is_some_and(|live| live.generation == generation) {
            tracing::error!(target: crate::targets::TREE, proc = %id, "a finished procedure's actor stopped before its cleanup ran");
            self.leave(id);
            self.publish_result(ctx);
            self.answer_quiesce(ctx);
        }
    }

    fn restart(&mut self, id: ProcId, old: Live, reason: &str, ctx: &mut TreeCtx<'_>) {
        let Live {
            checkpoint,
            busy,
            held,
            ..
        } = old;
        if self.halted.is_some() || self.status.deposed() {
            // It calls no user code any more; a step it owed still reports, so the
            // scheduler's worker is freed and the tree can stop.
            self.procs.remove(&id);
            if let Busy::Step(_) = busy {
                self.step_dropped(id, ctx);
            }
            return;
        }
        let limit = self.shared.restart_limit;
        let restarts =
            self.rare()
                .restarts
                .note(id, crate::actors::shared::mono_now(), limit.within);
        crate::actors::metrics::procedure_restarted(self.core.type_name_of(id).unwrap_or("?"));
        let over = restarts > limit.max;
        if over {
            tracing::error!(target: crate::targets::SUPERVISION, proc = %id, %reason, ?busy, restarts, within_ms = limit.within.as_millis() as u64, max = limit.max, "procedure actor stopped past the restart limit");
        } else {
            tracing::warn!(target: crate::targets::SUPERVISION, proc = %id, %reason, ?busy, restarts, "procedure restarted: its actor stopped unexpectedly, started again from its last reported state");
        }
        let given_up = || {
            format!(
                "its actor stopped {restarts} times within {} ms, past the restart limit \
                 of {} (last: {reason})",
                limit.within.as_millis(),
                limit.max
            )
        };
        if over && !matches!(busy, Busy::Step(_)) {
            // A rollback is never abandoned, and an idle procedure has no step to
            // fail: the tree halts, as when its records cannot be made durable, and a
            // restart of the engine carries it on.
            return self.halt(
                Error::Internal(format!("procedure {id}: {}", given_up())),
                ctx,
            );
        }
        let spec = self.spec(id, true);
        let proc = match decode_guarded(&self.shared.registry, spec.type_name, &checkpoint) {
            Ok(proc) => proc,
            Err(e) => {
                let error = Error::Internal(format!(
                    "procedure {id}'s actor stopped and its last state does not decode: {e}"
                ));
                return self.halt(error, ctx);
            }
        };
        let cell = ProcedureCell::new(
            spec,
            proc,
            checkpoint,
            self.shared.clone(),
            self.status.clone(),
        );
        let mut live = self.activate(Box::new(cell), ctx);
        match busy {
            Busy::No => {}
            // Its step comes back through the tree (the scheduler's message to the
            // old actor goes back as it drops); until then it is not passivated.
            Busy::Queued(step) => live.busy = Busy::Queued(step),
            // Its step may have done part of its work: as after a crash, it runs
            // again, and should its tree fail first, it is rolled back as interrupted.
            Busy::Step(step) => {
                self.core.mark_cut_off(id);
                if over {
                    // The step fails without running again; its worker is freed by
                    // its report, as for any step's end.
                    let error = ProcError::Panicked {
                        hook: "the procedure's actor".to_string(),
                        message: given_up(),
                    };
                    live.busy = Busy::Step(step);
                    live.post(ProcMsg::FailStep(Box::new(error)));
                } else {
                    let children = self.children_for(id);
                    live.post(ProcMsg::Cell(ToCell::RunStep(RunStep { step, children })));
                }
            }
            Busy::Rollback { of } => {
                live.post(ProcMsg::Cell(ToCell::Rollback(Rollback { of })));
            }
        }
        // What waited for a passivation it never answered.
        for msg in held.into_iter().flatten() {
            live.post(msg);
        }
        // An operator's pause not in effect yet, and a deadline whose timeout may
        // have been lost with the mailbox.
        if self
            .rare
            .as_ref()
            .is_some_and(|r| r.pause_waiters.contains_key(&id))
        {
            let now = self.core.waits_for_wake(id);
            live.post(ProcMsg::Pause { now });
        }
        if let Some(deadline_ms) = self.core.deadline_of(id) {
            if deadline_ms <= now_ms() {
                live.post(ProcMsg::Timeout { deadline_ms });
            }
        }
        if let Some(slot) = self.procs.get_mut(&id) {
            slot.live = Some(live);
        }
    }
}

impl std::fmt::Debug for Busy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Busy::No => f.write_str("idle"),
            Busy::Queued(step) => write!(f, "with step {step} queued"),
            Busy::Step(step) => write!(f, "in step {step}"),
            Busy::Rollback { .. } => f.write_str("in a rollback"),
        }
    }
}
