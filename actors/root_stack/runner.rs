//! The tree runner: one per procedure tree, held by its root-stack actor (and, while
//! the tree is passivated, by its shard as a value), which hands it the tree's
//! messages, its procedures' reports and its timers. It starts the tree (`start.rs`),
//! starts and supervises the actors of the tree's live procedures (`procs.rs`), keeps
//! the cells of those that wait, and runs the pure [`RootStack`] bookkeeping: every
//! event of the tree goes through it, its records are persisted, and only then are its
//! actions performed, in the order the transitions were made.
//!
//! The protocol rules it enforces (see `ARCHITECTURE.md`, "Protocol"):
//! - it frees a step's worker (`StepFinished` to the scheduler) only after it has fed
//!   the step's report to the core, so a step dispatched later is recorded later;
//! - it publishes a transition's records to the procedure table, and answers aborts,
//!   only once those records are durable;
//! - it handles its procedures' reports in the order each procedure made them (they
//!   are messages from its procedures' actors);
//! - it stops a finished procedure (lock released, cleanup run) once its final record
//!   is durable, before it publishes the tree's result;
//! - when nothing more can be made durable (the store failed) or the core broke an
//!   invariant, it halts the tree like a crash: no more user calls, no cleanup, every
//!   waiter answered, and it stays alive until each dispatched step has reported, so no
//!   worker of the scheduler leaks.
//!
//! Honest limits: a mailbox lives in memory. If the process dies, what was in flight
//! here is gone; durability comes only from the store, and recovery rebuilds the tree
//! from it.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::erased::DynProc;
use crate::error::Error;
use crate::fast_map::{IdMap, SortedMap};
use crate::procedure::{ProcError, ProcId, ProcState};
use crate::record::{Failure, Paused, ProcRecord, Steering, StoreOp};
use crate::root_stack::{Action, ChildrenSeen, NewChild, Place, RollbackOf, RootStack, Transition};

use super::{Leave, Timer, TreeCtx, TreeMsg};

mod operator;
mod procs;
mod reports;
mod start;
mod table;

use crate::actors::guard::{guard, panic_message};
use crate::actors::lent::{lendable, Lent};
use crate::actors::perturb;
use crate::actors::procedure::{ProcMsg, ProcSpec, ProcedureCell};
use crate::actors::protocol::{
    AbortAck, AbortRequest, AckWith, BypassRequest, Command, CommandRequest, Deadline, Durable,
    DurableAck, Enqueue, FailRequest, LockForRollback, LocksHeld, PauseNow, Persist, ProcAddr,
    Quiesce, Release, ReleaseLocks, Report, Rollback, RolledBack, StepDone, StepFinished,
    SuspendOn, ToCell, ToProc, TreeAck, TreeAddr, TreeEnded, TreeFailed, TreeFinished,
    TreeIrreversible, TreeNews, Unsuspend, Wake, WithdrawStep,
};
use crate::actors::shared::{now_ms, Entry, EntryExtra, Shared, TreeStatus, Waiting};
use operator::refusal;
use procs::{Leaving, Slot};
pub(crate) use table::publish_recovered;
use table::{apply_rows, rows, Row, Rows};

/// Decoded procedures waiting for their cells, with their encoded state.
pub(crate) type Objects = SortedMap<ProcId, (DynProc, Vec<u8>)>;

lendable!(Pending);

/// A transition waiting for its records to be durable: then its rows are published, its
/// actions performed and its acks answered, in that order.
struct Pending {
    rows: Rows,
    actions: Vec<Action>,
    acks: Vec<AckWith>,
    durable: bool,
}

/// The parts of a root stack that few trees ever use.
#[derive(Default)]
struct Rare {
    /// Operators' pauses not in effect yet, answered when they are (or when the
    /// procedure ends or its tree fails first).
    pause_waiters: IdMap<ProcId, Vec<AbortAck>>,
    /// Recovered procedures suspended on an event that run their next step at once.
    rerun: Vec<ProcId>,
    /// A graceful shutdown waits for the pending transitions to become durable.
    quiesce: Vec<oneshot::Sender<Option<Vec<ProcId>>>>,
    /// When each procedure's actor was last started again (supervision's restarts).
    restarts: Restarts,
    /// The tree's procedures below its root that have finished, successful and rolled
    /// back, for the root's `procedure finished` line.
    children_finished: [u32; 2],
}

/// The recent restarts of a tree's procedure actors, for the restart limit.
#[derive(Default)]
pub(super) struct Restarts(IdMap<ProcId, Vec<Instant>>);

impl Restarts {
    /// Notes a restart of `id` at `now`, and says how many it had within `within`
    /// up to now, this one included.
    pub(super) fn note(&mut self, id: ProcId, now: Instant, within: Duration) -> u32 {
        let times = self.0.entry(id).or_default();
        times.retain(|t| now.saturating_duration_since(*t) < within);
        times.push(now);
        u32::try_from(times.len()).unwrap_or(u32::MAX)
    }
}

/// What a root stack starts with. Every tree holds a runner, so these few words live
/// in a box that goes once the tree has started.
struct Start {
    /// The submit's (or recovery's) transition, applied when the tree starts.
    initial: Option<Transition>,
    /// Answered once the root's insert is durable and it is queued.
    submit_ack: Option<oneshot::Sender<Result<ProcId, Error>>>,
}

pub(crate) struct TreeRunner {
    core: RootStack,
    shared: Arc<Shared>,
    /// The live procedures of this tree: each its actor, or its cell while it waits.
    procs: SortedMap<ProcId, Slot>,
    /// Finished procedures whose actors run their `Stop` (lock release, cleanup); the
    /// tree's result waits for them. `None` while there are none.
    leaving: Leaving,
    /// Procedure actors running (those of `procs` and of `leaving`).
    live: u32,
    /// Activations so far, numbering each procedure actor.
    generation: u32,
    /// The tree's address (its shard and root), shared by its procedures' addresses.
    me: TreeAddr,
    /// What few trees ever need: boxed, as every tree holds a runner.
    rare: Option<Box<Rare>>,
    /// New procedures, started once their insert is durable. Boxed, and `None` while
    /// there are none (nearly always).
    unspawned: Option<Box<Objects>>,
    status: Arc<TreeStatus>,
    /// Transitions in the order they were made; actions run strictly in that order.
    pending: Lent<Pending>,
    /// What the runner starts with, dropped once the root's insert is durable.
    start: Option<Box<Start>>,
    /// How many transitions have had their actions performed.
    performed: usize,
    /// Rebuilt by recovery: the first cells it makes are recovered procedures.
    recovered: bool,
    /// Steps handed to the scheduler whose `StepDone` has not come back. Each holds (or
    /// waits for) a worker that only this runner frees.
    dispatched: u32,
    /// The tree's result, published once every stop has been answered.
    result: Option<Box<Result<(), Failure>>>,
    /// Set when nothing more can be made durable: the tree is cut off like in a crash.
    halted: Option<Box<Error>>,
    /// The result went to the executor: the runner's work is done.
    published: bool,
    /// Its shard queued its `TreeEnded` ([`TreeRunner::ended`]): its drop sends none.
    ended_queued: bool,
}

impl TreeRunner {
    /// Feeds an event to the core. A panic there is a broken engine invariant: the tree
    /// halts and the executor stops, rather than an arbiter thread dying with the
    /// tree's waiters unanswered.
    fn core<R>(
        &mut self,
        event: &str,
        f: impl FnOnce(&mut RootStack) -> R,
        ctx: &mut TreeCtx<'_>,
    ) -> Option<R> {
        match catch_unwind(AssertUnwindSafe(|| f(&mut self.core))) {
            Ok(r) => Some(r),
            Err(payload) => {
                let message = panic_message(&*payload);
                let root = self.core.root();
                self.halt(
                    Error::Internal(format!("tree {root}, on {event}: {message}")),
                    ctx,
                );
                None
            }
        }
    }

    /// Feeds an event to the core and applies the transition it makes; nothing once
    /// the tree has halted (or the core broke on it). Whether a transition was applied.
    fn feed(
        &mut self,
        event: &str,
        f: impl FnOnce(&mut RootStack) -> Transition,
        ctx: &mut TreeCtx<'_>,
    ) -> bool {
        if self.halted.is_some() {
            return false;
        }
        match self.core(event, f, ctx) {
            Some(t) => {
                self.apply(t, None, ctx);
                true
            }
            None => false,
        }
    }

    /// Persists the transition's records, then (in order) publishes them, performs its
    /// actions and answers `ack`.
    fn apply(&mut self, t: Transition, ack: Option<AckWith>, ctx: &mut TreeCtx<'_>) {
        self.apply_named(t, ack, Vec::new(), ctx);
    }

    /// As `apply`, for the report of a step, with state names to publish on the rows
    /// the transition writes: its procedure's after the step, its new children's.
    fn apply_named(
        &mut self,
        t: Transition,
        ack: Option<AckWith>,
        names: Vec<(ProcId, String)>,
        ctx: &mut TreeCtx<'_>,
    ) {
        if let Some(e) = &self.halted {
            if let Some((ack, _)) = ack {
                ctx.answer(ack, Err(e.duplicate()));
            }
            return;
        }
        if self.core.is_failed() && !self.status.failed() {
            self.status.set_failed();
            // Pauses not in effect never will be: the tree rolls back.
            self.refuse_pauses("its tree failed before it paused", ctx);
            // Aborts that waited for a failed step's fate: it is failing.
            self.tell_tree_failed(ctx);
            // Its procedures waiting for locks would only be skipped once granted.
            ctx.tell(TreeFailed(self.core.root()));
        }
        let durable = t.persist.is_empty();
        // Only inserts need the tree's address.
        let inserts = t.persist.iter().any(|op| matches!(op, StoreOp::Insert(_)));
        let tree = inserts.then(|| self.me.clone());
        let mut rows = rows(&self.shared, &t.persist, tree.as_ref());
        for (named, name) in names {
            for row in rows.as_mut_slice() {
                let (id, state_name) = match row {
                    Row::Update { id, state_name, .. } => (*id, state_name),
                    Row::Insert(id, entry) => (*id, &mut entry.state_name),
                };
                if id == named {
                    *state_name = Some(name);
                    break;
                }
            }
        }
        self.pending.push_back(Pending {
            rows,
            actions: t.actions,
            acks: ack.into_iter().collect(),
            durable,
        });
        if durable {
            self.run_ready(ctx);
            return;
        }
        let seq = self.performed + self.pending.len() - 1;
        ctx.tell(Persist {
            ops: t.persist,
            ack: DurableAck::Tree(TreeAck::new(self.me.clone(), seq)),
        });
    }

    fn run_ready(&mut self, ctx: &mut TreeCtx<'_>) {
        while self.pending.front().is_some_and(|p| p.durable) {
            let Some(p) = self.pending.pop_front() else {
                break;
            };
            self.performed += 1;
            apply_rows(&self.shared, p.rows);
            for action in p.actions {
                self.perform(action, ctx);
            }
            for (ack, answer) in p.acks {
                ctx.answer(ack, answer);
            }
            self.recovered = false;
        }
        if self.pending.is_empty() {
            self.pending.release();
            self.answer_quiesce(ctx);
        }
        // The initial transition is durable and performed: the tree has started.
        if self.performed > 0 {
            if let Some(ack) = self.start.take().and_then(|s| s.submit_ack) {
                // Its first step's request reaches the scheduler before the submitter
                // hears (and submits the next, perhaps through another shard).
                ctx.leave(Leave::Submitted(ack, Ok(self.core.root())));
                if self.shared.has_subscribers() {
                    ctx.leave(Leave::News(TreeNews::Submitted(self.core.root())));
                }
            }
        }
    }

    /// Answers a graceful shutdown's `Quiesce`s once the tree is settled: every record
    /// durable, and every finished procedure's stop (its lock release and completion
    /// cleanup, user code) done, so that a drained stop cuts off no cleanup.
    fn answer_quiesce(&mut self, ctx: &mut TreeCtx<'_>) {
        if !self.pending.is_empty() || self.leaving.is_some() {
            return;
        }
        let Some(rare) = self.rare.as_mut().filter(|r| !r.quiesce.is_empty()) else {
            return;
        };
        let cut_off: Vec<ProcId> = self.core.cut_off().collect();
        for ack in rare.quiesce.drain(..) {
            ctx.leave(Leave::Quiesced(ack, Some(cut_off.clone())));
        }
    }

    /// Answers every pause not in effect with a refusal.
    fn refuse_pauses(&mut self, reason: &str, ctx: &mut TreeCtx<'_>) {
        let Some(rare) = &mut self.rare else {
            return;
        };
        for (id, acks) in rare.pause_waiters.drain() {
            for ack in acks {
                ctx.leave(refusal(ack, "pause", id, reason));
            }
        }
    }

    fn perform(&mut self, action: Action, ctx: &mut TreeCtx<'_>) {
        match action {
            Action::Spawn(id) => self.spawn(id, ctx),
            Action::Enqueue { id, place } => {
                self.dispatched += 1;
                self.enqueue(id, place, ctx);
            }
            // The same queued step, now that its life-long locks are durably held.
            Action::Resume(id) => self.enqueue(id, Place::Front, ctx),
            Action::Withdraw(id) => {
                if self.core.lock_request(id, false).is_some() {
                    ctx.tell(WithdrawStep(id));
                }
            }
            Action::Release(id) => {
                if self.core.lock_request(id, false).is_some() {
                    ctx.tell(ReleaseLocks {
                        id,
                        what: Release::All,
                    });
                }
            }
            Action::Stop(id) => self.on_stopped(id, ctx),
            Action::Paused { id, state, why } => self.on_paused(id, state, *why, ctx),
            Action::Reset { id, data } => {
                // Before any later call of `id`: that call comes from a step queued (or
                // a rollback sent) after this, through this runner, to the same mailbox.
                let _ = self.send(id, ProcMsg::Reset(data), ctx);
            }
            Action::Rollback { id, of } => self.send_rollback(id, of, ctx),
            Action::RetryRollback { id, of, delay_ms } => {
                let timer = Timer::RetryRollback { id, of };
                ctx.run_later(Duration::from_millis(delay_ms), timer);
            }
            Action::WakeAt { id, at_ms } => {
                let delay = Duration::from_millis(at_ms.saturating_sub(now_ms()));
                ctx.run_later(delay, Timer::WakeAt { id });
            }
            Action::SuspendOn { id, event } => {
                let root_stack = self.me.clone();
                ctx.tell(SuspendOn {
                    id,
                    event,
                    root_stack,
                });
            }
            Action::Finished(result) => {
                match &result {
                    Ok(()) => {
                        tracing::debug!(target: crate::targets::TREE, root = self.core.root().0, "tree succeeded")
                    }
                    Err(failure) => {
                        tracing::warn!(target: crate::targets::TREE, root = self.core.root().0, %failure, "tree rolled back")
                    }
                }
                self.result = Some(Box::new(result.map_err(|f| *f)));
                self.publish_result(ctx);
            }
            Action::Count(count) => {
                if let Some(type_name) = self.core.type_name_of(count.id()) {
                    self.shared.metrics.count(type_name, count);
                }
            }
        }
    }

    /// `id` finished and its final record is durable.
    fn on_stopped(&mut self, id: ProcId, ctx: &mut TreeCtx<'_>) {
        if let Some(acks) = self.pause_waiters(id) {
            for ack in acks {
                ctx.leave(refusal(ack, "pause", id, "it finished before it paused"));
            }
        }
        // Stopped while suspended (its tree failed, or timed out): it no longer
        // waits, so the event must not keep it.
        self.unsuspend(id, ctx);
        // Its actor releases its lock and runs its cleanup before the tree's result
        // is published.
        perturb::point("root_stack::perform::stop");
        let state = self.core.state_of(id).unwrap_or(ProcState::Success);
        self.stop_procedure(id, state, ctx);
        self.log_finished(id);
        if id != self.core.root() {
            self.shared.table.remove(&id);
        } else if let Some(mut e) = self.shared.table.get_mut(&id) {
            e.tree = None;
        }
    }

    /// `id` paused (its pause is durable): the operators who asked hear, and so do
    /// subscribers.
    fn on_paused(&mut self, id: ProcId, state: ProcState, why: Paused, ctx: &mut TreeCtx<'_>) {
        for ack in self.pause_waiters(id).unwrap_or_default() {
            ctx.answer(ack, Ok(true));
        }
        self.forget_pause(id, ctx);
        // Paused while it waited for an event: the event must not wake it (a continue
        // suspends it again).
        self.unsuspend(id, ctx);
        if self.shared.has_subscribers() {
            let root = self.core.root();
            let news = TreeNews::Paused {
                id,
                root,
                state,
                why,
            };
            ctx.leave(Leave::News(news));
        }
    }

    /// The event `id` waits for, if any, must no longer wake it.
    fn unsuspend(&self, id: ProcId, ctx: &mut TreeCtx<'_>) {
        if let Some(event) = self.core.event_of(id) {
            ctx.tell(Unsuspend {
                id,
                event: event.to_string(),
            });
        }
    }

    fn spawn(&mut self, id: ProcId, ctx: &mut TreeCtx<'_>) {
        let object = self.unspawned.as_mut().and_then(|u| u.remove(&id));
        if self.unspawned.as_ref().is_some_and(|u| u.is_empty()) {
            self.unspawned = None;
        }
        let Some((proc, data)) = object else {
            unreachable!("spawn of {id}, which has no object");
        };
        let spec = self.spec(id, self.recovered);
        let (parent, type_name) = (spec.parent, spec.type_name);
        if !self.recovered {
            // Its insert is durable: accepted (a recovered one was counted before).
            self.shared.metrics.submitted(type_name);
            if id == self.core.root() {
                tracing::info!(target: crate::targets::TREE, id = id.0, r#type = %type_name, "procedure submitted");
            } else {
                tracing::debug!(target: crate::targets::TREE,
                    id = id.0,
                    parent = parent.map(|p| p.0),
                    root = self.core.root().0,
                    r#type = type_name,
                    "child procedure submitted"
                );
            }
        }
        let (shared, status) = (self.shared.clone(), self.status.clone());
        let cell = Box::new(ProcedureCell::new(spec, proc, data, shared, status));
        let slot = if self.recovered {
            // A recovered procedure starts no actor until it first has work (its
            // step is dispatched, an operator asks, a timer fires): a restart with
            // many waiting procedures starts only those that run. Its
            // `after_recover` runs when its actor starts.
            Slot::waiting(cell)
        } else {
            // Its first step is queued at once: the scheduler sends it straight to
            // the actor.
            Slot::active(self.activate(cell, ctx))
        };
        self.procs.insert(id, slot);
        self.arm_deadline(id, ctx);
    }

    /// A procedure's final record is durable: its metrics and one line, at INFO for a
    /// root (with how many procedures below it finished, which a tree of a thousand
    /// children would otherwise log a line each for), at DEBUG for the others. The
    /// duration runs from its persisted submit time (so it spans restarts).
    fn log_finished(&mut self, id: ProcId) {
        let Some(e) = self.shared.table.get(&id) else {
            return;
        };
        let (type_name, state, parent, root) = (e.type_name, e.state, e.parent, e.root);
        let duration_ms = now_ms().saturating_sub(e.submitted_ms);
        drop(e);
        self.shared.metrics.finished(type_name, state, duration_ms);
        if id != self.core.root() {
            let rolled_back = usize::from(state != ProcState::Success);
            self.rare().children_finished[rolled_back] += 1;
            tracing::debug!(target: crate::targets::TREE,
                id = id.0,
                parent = parent.map(|p| p.0),
                root = root.0,
                r#type = %type_name,
                outcome = %state,
                duration_ms,
                "procedure finished"
            );
            return;
        }
        let [children, children_rolled_back] =
            self.rare.as_ref().map_or([0, 0], |r| r.children_finished);
        tracing::info!(target: crate::targets::TREE,
            id = id.0,
            r#type = %type_name,
            outcome = %state,
            duration_ms,
            children = children + children_rolled_back,
            children_rolled_back,
            "procedure finished"
        );
    }

    fn rare(&mut self) -> &mut Rare {
        self.rare.get_or_insert_with(Box::default)
    }

    /// Takes the operators' pauses of `id` not in effect yet.
    fn pause_waiters(&mut self, id: ProcId) -> Option<Vec<AbortAck>> {
        self.rare.as_mut()?.pause_waiters.remove(&id)
    }

    /// Where the scheduler reaches procedure `id`: through this runner.
    fn proc_addr(&self, id: ProcId) -> ProcAddr {
        ProcAddr::new(self.me.clone(), id)
    }

    fn enqueue(&mut self, id: ProcId, place: Place, ctx: &mut TreeCtx<'_>) {
        if !self.procs.contains_key(&id) {
            unreachable!("enqueue of {id}, which is not live");
        }
        if let Some(mut step) = self.enqueue_msg(id, place) {
            // The scheduler sends the step straight to the procedure's actor when it
            // runs, declares no locks (their grants and failures come through the
            // tree, in order with its steps) and its step sees no children (their
            // states are the root stack's, as they are at dispatch); otherwise through
            // the tree.
            // (Without a lock request the step's `lock` is `None` too.)
            let straight =
                self.core.lock_request(id, false).is_none() && !self.core.has_children(id);
            if let Some(actor) = straight
                .then(|| self.straight_to(id, step.what.1))
                .flatten()
            {
                step.addr = step.addr.with_actor(actor);
            }
            ctx.tell(step);
        }
    }

    /// What queues a step of `id` (`None` if it is not in the tree).
    fn enqueue_msg(&self, id: ProcId, place: Place) -> Option<Enqueue> {
        let type_name = self.core.type_name_of(id)?;
        let addr = self.proc_addr(id);
        // A failed tree's steps are only skipped: they need no locks.
        let lock = if self.core.is_failed() {
            None
        } else {
            self.core.lock_request(id, false)
        };
        Some(Enqueue {
            id,
            root: self.core.root(),
            addr,
            place,
            what: (type_name, self.core.steps_of(id) + 1),
            lock,
        })
    }

    fn send_rollback(&mut self, id: ProcId, of: RollbackOf, ctx: &mut TreeCtx<'_>) {
        match self.core.lock_request(id, true) {
            // A rollback step runs under the procedure's locks, like a step.
            Some(lock) => {
                let addr = self.proc_addr(id);
                ctx.tell(LockForRollback { id, addr, lock, of });
            }
            None => {
                let rollback = ProcMsg::Cell(ToCell::Rollback(Rollback { of }));
                if self.send(id, rollback, ctx).is_err() {
                    unreachable!("rollback of {id}, which is not live");
                }
            }
        }
    }

    /// Publishes the tree's result once it is known and every finished procedure has
    /// released its lock and run its cleanup; then the runner's work is done.
    fn publish_result(&mut self, ctx: &mut TreeCtx<'_>) {
        // A step a forced bypass dropped may still come back through the tree.
        if self.halted.is_some() || self.leaving.is_some() || self.dispatched > 0 {
            return;
        }
        let Some(result) = self.result.take().map(|r| *r) else {
            return;
        };
        let root = self.core.root();
        if let Some(mut e) = self.shared.table.get_mut(&root) {
            e.extra_mut().result = Some(result.clone().map_err(Box::new));
        }
        // The actor sends it as it stops, once the tree has left its shard and after
        // everything the tree told (the locks its procedures released are free).
        ctx.publish(TreeFinished {
            root,
            result: Ok(result),
        });
        self.published = true;
        ctx.stop();
    }

    /// Nothing this tree does can be made durable any more (or the core broke): stop
    /// calling user code, answer everyone, and tell the executor.
    fn halt(&mut self, e: Error, ctx: &mut TreeCtx<'_>) {
        if self.halted.is_some() {
            return;
        }
        let root = self.core.root();
        tracing::error!(target: crate::targets::TREE, root = %root, error = %e, "tree halted: its records cannot be made durable");
        self.status.set_halted();
        // Steps waiting for locks are queued to report themselves skipped.
        ctx.tell(TreeFailed(root));
        if let Some(ack) = self.start.take().and_then(|s| s.submit_ack) {
            ctx.leave(Leave::Submitted(ack, Err(e.duplicate())));
        }
        for p in self.pending.take_all() {
            for (ack, _) in p.acks {
                ctx.answer(ack, Err(e.duplicate()));
            }
        }
        let waiters = self.rare.iter_mut().flat_map(|r| r.pause_waiters.drain());
        for ack in waiters.flat_map(|(_, acks)| acks) {
            ctx.answer(ack, Err(e.duplicate()));
        }
        // Nothing more becomes durable: a graceful shutdown waiting for that goes on
        // now, not when the tree has stopped.
        for ack in self.rare.iter_mut().flat_map(|r| r.quiesce.drain(..)) {
            ctx.leave(Leave::Quiesced(ack, None));
        }
        self.unspawned = None;
        self.result = None;
        ctx.leave(Leave::Halted(TreeFinished {
            root,
            result: Err(e.duplicate()),
        }));
        self.halted = Some(Box::new(e));
        self.stop_when_quiet(ctx);
    }

    /// A halted tree stops once every dispatched step has reported (and freed its
    /// worker). Its procedures' actors stop, and their cells go with them.
    /// A step of `id` ended without a report to record (a forced bypass took it from
    /// the tree: it came back queued, its call was dropped, or it reported after the
    /// procedure finished; or its actor died in a halted or deposed tree): its worker
    /// is freed, and a finished tree that waited only for it publishes its result.
    pub(super) fn step_dropped(&mut self, id: ProcId, ctx: &mut TreeCtx<'_>) {
        self.dispatched = self.dispatched.saturating_sub(1);
        ctx.tell(StepFinished(id));
        if self.dispatched == 0 {
            self.publish_result(ctx);
        }
    }

    fn stop_when_quiet(&mut self, ctx: &mut TreeCtx<'_>) {
        if self.halted.is_some() && self.dispatched == 0 {
            self.halt_procedures();
            ctx.stop();
        }
    }
}

impl TreeRunner {
    /// A message to the tree, from its shard's mailbox.
    pub(crate) fn receive(&mut self, msg: TreeMsg, ctx: &mut TreeCtx<'_>) {
        match msg {
            // The shard starts a tree itself.
            TreeMsg::Start(_) => {}
            TreeMsg::Durable(m) => self.on_durable(m, ctx),
            TreeMsg::ToProc(m) => self.on_to_proc(m, ctx),
            TreeMsg::Bypass(m) => self.on_bypass(m, ctx),
            TreeMsg::Wake(m) => self.on_wake(m, ctx),
            TreeMsg::Quiesce(m) => self.on_quiesce(m, ctx),
            TreeMsg::Describe(m) => {
                let _ = m.0.send(crate::TreeInfo {
                    root: self.core.root(),
                    stack: self.core.stack().collect(),
                    rolling_back: self.core.is_rolling_back(),
                    rolled_back: self.core.undone().to_vec(),
                });
            }
            TreeMsg::Command(m) => self.on_command(m, ctx),
            TreeMsg::Abort(m) => self.on_abort(m, ctx),
            #[cfg(feature = "perturb")]
            TreeMsg::Kill(m) => {
                let _ = self.send(m.id, ProcMsg::Kill { panic: m.panic }, ctx);
            }
        }
    }

    /// One of the tree's timers fired.
    pub(crate) fn on_timer(&mut self, timer: Timer, ctx: &mut TreeCtx<'_>) {
        match timer {
            Timer::RetryRollback { id, of } => {
                if self.halted.is_none() {
                    self.send_rollback(id, of, ctx);
                }
            }
            Timer::WakeAt { id } => {
                self.feed("wake", |core| core.on_wake(id), ctx);
            }
            Timer::Deadline { id, deadline_ms } => {
                // A later deadline replaced this one (its own timer runs), or it
                // finished: its procedure need not wake for it.
                if self.halted.is_none() && self.core.deadline_of(id) == Some(deadline_ms) {
                    let _ = self.send(id, ProcMsg::Timeout { deadline_ms }, ctx);
                }
            }
        }
    }
}

impl TreeRunner {
    fn on_durable(&mut self, msg: Durable, ctx: &mut TreeCtx<'_>) {
        if self.halted.is_some() {
            return;
        }
        perturb::point("root_stack::apply::durable");
        match msg.result {
            Ok(()) => {
                // One message per transition, in the order they were made.
                let Some(index) = msg.seq.checked_sub(self.performed) else {
                    return;
                };
                if let Some(p) = self.pending.get_mut(index) {
                    p.durable = true;
                }
                self.run_ready(ctx);
            }
            Err(e) => self.halt(e, ctx),
        }
    }
}

impl TreeRunner {
    fn on_to_proc(&mut self, msg: ToProc, ctx: &mut TreeCtx<'_>) {
        let ToProc { id, mut msg } = msg;
        if let ToCell::RunStep(step) = &mut msg {
            step.children = self.children_for(id);
        }
        match self.send(id, ProcMsg::Cell(msg), ctx) {
            Ok(()) => {}
            Err(msg) => {
                if let ProcMsg::Cell(ToCell::RunStep(_)) = msg {
                    // Only a forced bypass finishes a procedure with a step queued:
                    // the step is dropped, and its worker freed.
                    if !self.core.is_bypassed(id) {
                        tracing::warn!(target: crate::targets::TREE, proc = %id, "a step dispatched to a stopped procedure");
                    }
                    self.step_dropped(id, ctx);
                }
            }
        }
        self.stop_when_quiet(ctx);
    }
}

impl TreeRunner {
    /// `id`'s children as its next step sees them.
    fn children_for(&self, id: ProcId) -> Option<Box<ChildrenSeen>> {
        self.core.children_of(id).map(|mut children| {
            let mut unseen = false;
            for (child, state) in children.states.iter_mut() {
                if *state == ProcState::Success && self.procs.contains_key(child) {
                    // Its SUCCESS is not durable yet (its `Stop`, performed after the
                    // record, ends it): the step sees it running, and not its value.
                    // Its parent, not waiting now, is woken again for it
                    // (`unseen_child`).
                    *state = ProcState::Runnable;
                    unseen = true;
                }
            }
            if unseen {
                let values = std::mem::take(&mut children.values).into_vec();
                children.values = values
                    .into_iter()
                    .filter(|(child, _)| !self.procs.contains_key(child))
                    .collect();
            }
            children
        })
    }

    fn on_wake(&mut self, msg: Wake, ctx: &mut TreeCtx<'_>) {
        self.feed("wake", |core| core.on_wake(msg.0), ctx);
    }
}

impl TreeRunner {
    /// Its shard is about to drop it: its `TreeEnded`, for the shard's outbox (behind
    /// everything the tree queued there), and whether the tree was cut off before it
    /// finished (a panic in engine code: then the shard sends the outbox at once, as the
    /// drop reports the tree's failure to the executor).
    pub(crate) fn ended(&mut self) -> (TreeEnded, bool, bool) {
        self.ended_queued = true;
        (
            self.ended_message(),
            self.told_irreversible(),
            self.cut_off(),
        )
    }

    /// What the tree's executor shares (where its result goes: cloning the recipient
    /// itself would allocate).
    pub(crate) fn shared(&self) -> Arc<Shared> {
        self.shared.clone()
    }

    /// The engine's shared state, borrowed.
    pub(crate) fn shared_ref(&self) -> &Shared {
        &self.shared
    }

    /// The tree's root.
    pub(crate) fn root(&self) -> ProcId {
        self.core.root()
    }

    /// Whether the tree has nothing in flight (nothing waiting to be durable, no step out,
    /// no report to handle, started, not halted): its actor may hand it back to its
    /// shard, which keeps it as a value until a message comes. Calls and timers are
    /// counted by the actor.
    pub(crate) fn quiet(&self) -> bool {
        self.quiet_but_for_procedures() && self.live == 0
    }

    /// As `quiet`, but for the actors of its procedures, which it may passivate.
    fn quiet_but_for_procedures(&self) -> bool {
        self.start.is_none()
            && self.pending.is_empty()
            && self.dispatched == 0
            && self.halted.is_none()
    }

    /// Tells the lock actor that the tree has passed its point of no return.
    fn tell_irreversible(&self, ctx: &mut TreeCtx<'_>) {
        ctx.tell(TreeIrreversible(self.core.root()));
    }

    /// Whether the lock actor may have been told the tree passed its point of no
    /// return (then its `TreeEnded` goes there too, so the mark is dropped).
    fn told_irreversible(&self) -> bool {
        self.core.is_irreversible()
    }

    fn ended_message(&self) -> TreeEnded {
        TreeEnded {
            root: self.core.root(),
            steps_out: self.cut_off() || self.dispatched > 0,
        }
    }

    /// It stops without having published its result or halted: a panic in engine
    /// code cut it off.
    fn cut_off(&self) -> bool {
        self.halted.is_none() && !self.published
    }
}

impl Drop for TreeRunner {
    /// A root stack that ends without publishing its result or halting died of a panic
    /// in engine code; the executor must not leave the tree's waiters hanging.
    fn drop(&mut self) {
        self.me.set_ended();
        self.shared.tree_ended(self.me.index());
        // Its calls still in flight run no more user code, and its procedures' actors
        // stop.
        self.status.set_dropped();
        self.halt_procedures();
        if !self.ended_queued {
            // Every StepFinished this runner sent is ahead of this in the scheduler's
            // mailbox (its shard sends what it queued before it drops a tree).
            self.me.scheduler().do_send(self.ended_message());
            if self.told_irreversible() {
                self.shared.locks.do_send(self.ended_message());
            }
        }
        if self.cut_off() {
            // Cut the tree off like a crash. Its running calls died with it; the
            // scheduler frees their workers on `TreeEnded`, and those of its queued
            // steps when it finds the tree ended (`TreeHandle::connected`).
            self.status.set_halted();
            self.shared.finished.do_send(TreeFinished {
                root: self.core.root(),
                result: Err(Error::Internal(format!(
                    "the root stack of tree {} stopped before the tree finished",
                    self.core.root()
                ))),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn an_idle_tree_is_its_root_stack_only() {
        // A passivated tree is a boxed root stack in its shard's map (no actor): up to
        // 224 bytes the box is in mimalloc's 224-byte class, where an active tree costs
        // a 640-byte task and a mailbox of its own besides (BENCHMARKS.md, "bytes per
        // idle procedure").
        let tree = std::mem::size_of::<TreeRunner>();
        assert!(tree <= 224, "a root stack is {tree} bytes");
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_procedure_cell_stays_small() {
        // A waiting procedure's cell is boxed in its tree's map: at 208 bytes the box
        // is in mimalloc's 208-byte class (232 bytes before a cell's pending aborts,
        // timeout and pause were boxed: the 256-byte class).
        let cell = std::mem::size_of::<ProcedureCell>();
        assert!(cell <= 208, "a cell is {cell} bytes");
    }
}
