//! The procedure actor: one per active procedure, started and supervised by its tree's
//! root-stack actor, on the same arbiter. It holds the procedure's cell
//! ([`ProcedureCell`]: the user's object and its bookkeeping) and is the only place
//! that calls into user code: a step when its root stack forwards the scheduler's
//! [`RunStep`](super::protocol::RunStep), a rollback, the abort and timeout hooks, each
//! as the handling of one message ([`ProcMsg`]). Steps and rollbacks run as futures of
//! this actor; an abort that arrives during one is kept by the cell until it ends.
//! What the cell reports goes to the root stack as [`FromProc`] messages, in the order
//! it made them.
//!
//! **Activation and passivation.** A procedure waiting for children, an event, a timer
//! or an operator keeps no actor: its root stack asks it to hand its cell back
//! ([`ProcMsg::Passivate`]) and keeps the cell as a value until a message comes for it,
//! which starts a new actor with the cell (the messages sent meanwhile wait in the root
//! stack and go to the new actor first). An actor with a call running refuses, and
//! stays.
//!
//! **Supervision.** An actor that stops without being told (a panic in engine code
//! around the user's, which catches its own, or a test that stops it) tells its root
//! stack as it is dropped ([`FromProc::Exited`]); the root stack starts the procedure
//! again from the state it last reported, as recovery would after a crash: a step it
//! was running runs again (its work may have been cut off, so it is marked for an
//! unrecorded rollback should its tree fail first), a rollback it was running is sent
//! again, and `after_recover` runs.

mod cell;

use std::cell::RefCell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{self, Poll};

use actix::fut::wrap_future;
use actix::prelude::*;

use crate::procedure::{ProcId, ProcState};
use crate::root_stack::{ChildrenSeen, RollbackOf};

use super::guard::panic_message;
use super::lent::Lent;
use super::protocol::{AbortAck, Outgoing, Report, ToProc, TreeAddr};
use super::root_stack::{FromProc, RootStackActor};
use super::shard::{Counted, ShardIo};
use super::shared::TreeStatus;

pub(crate) use cell::{declare, CallEnd, ProcSpec, ProcedureCell, Undeclarable};

/// What a procedure actor is sent, all by its root stack: what the scheduler and the
/// lock actor sent the procedure (forwarded through its tree), and the root stack's
/// own requests. One mailbox, so they are handled in the order the root stack sent
/// them.
pub(crate) enum ProcMsg {
    /// From the scheduler or the lock actor: run a step, roll one back, locks granted
    /// or failed.
    Cell(ToCell),
    /// From the scheduler, straight to this actor (its root stack named it when it
    /// queued the step): run a step.
    Direct(DirectStep),
    /// An operator's abort.
    Abort(AbortAck),
    /// Its deadline (as it was when the timer was armed) has passed.
    Timeout { deadline_ms: u64 },
    /// An operator's pause: at its next step, or `now` if it waits.
    Pause { now: bool },
    /// It paused: a pause asked meanwhile is answered.
    ForgetPause,
    /// Its failed attempt is discarded: reload its recorded state.
    Reset(Vec<u8>),
    /// Its tree failed.
    TreeFailed,
    /// It finished and its final record is durable: release its lock, run its cleanup,
    /// answer late aborts, report [`FromProc::Stopped`] and stop.
    Stop(ProcState),
    /// It waits: hand the cell back ([`FromProc::Passivated`]) and stop, unless a call
    /// runs.
    Passivate,
    /// Its tree halted or was cut off: stop, calling no more user code.
    Halt,
    /// Its actor stopped, unasked, more often than the restart limit allows while in
    /// the step it was sent again: report that step failed with this error, without
    /// running it.
    FailStep(Box<crate::procedure::ProcError>),
    /// Stop at once without reporting, as a crash of this actor would (for tests of
    /// its supervision): with `panic`, by a panic in the handler.
    #[cfg(feature = "perturb")]
    Kill { panic: bool },
}

impl Message for ProcMsg {
    type Result = ();
}

/// What a procedure actor may do beyond its cell: its actor's context (its calls are
/// its futures) and its shard's outbox (what it tells the lock actor).
pub(crate) struct ProcCtx<'a> {
    actor: &'a mut Context<ProcedureActor>,
    io: &'a RefCell<ShardIo>,
    calls: &'a mut u32,
}

impl ProcCtx<'_> {
    /// Runs `call` as one of the actor's futures; its end goes to the cell. If the tree
    /// (whose status is `tree`) is dropped first, or the engine loses its mandate, the
    /// call is not polled again.
    pub(crate) fn spawn(
        &mut self,
        tree: Arc<TreeStatus>,
        call: impl Future<Output = CallEnd> + 'static,
    ) {
        *self.calls += 1;
        let call = wrap_future::<_, ProcedureActor>(guarded_call(tree, call))
            .map(|end, actor, ctx| actor.call_done(end, ctx));
        self.actor.spawn(call);
    }

    /// Queues `msg` for its actor (the lock actor), in its shard's outbox.
    pub(crate) fn tell(&mut self, msg: impl Into<Outgoing>) {
        ShardIo::push(self.io, msg.into());
    }
}

/// The procedure actor (see the module docs).
pub(crate) struct ProcedureActor {
    id: ProcId,
    /// Which activation of the procedure this is, so its root stack can tell a report
    /// of this actor's exit from one of an earlier actor's.
    generation: u32,
    /// `None` once handed back or stopped.
    cell: Option<Box<ProcedureCell>>,
    root_stack: Addr<RootStackActor>,
    io: Rc<RefCell<ShardIo>>,
    /// What the cell reported during one handling, sent once it returns.
    out: Outbox,
    /// Calls into user code running.
    calls: u32,
    /// It stops as it was told (stopped, passivated, halted): its drop reports nothing.
    told: bool,
    /// Why it stops untold, if it knows (a panic out of engine code).
    exit_reason: Option<String>,
    /// The step it was sent and has not reported yet: its exit tells its root stack
    /// it took the step (one sent straight from the scheduler is otherwise unknown
    /// to the root stack until it reports).
    in_step: Option<usize>,
    /// Counted among its shard's procedure actors while it lives.
    _counted: Counted,
}

impl ProcedureActor {
    pub(crate) fn new(
        cell: Box<ProcedureCell>,
        generation: u32,
        root_stack: Addr<RootStackActor>,
        io: Rc<RefCell<ShardIo>>,
    ) -> Self {
        let counted = Counted::new(&io.borrow().procedure_actors);
        ProcedureActor {
            id: cell.id(),
            generation,
            cell: Some(cell),
            root_stack,
            io,
            out: Outbox::default(),
            calls: 0,
            told: false,
            exit_reason: None,
            in_step: None,
            _counted: counted,
        }
    }

    /// Sends what the cell reported, in order.
    fn send_reports(&mut self) {
        while let Some(report) = self.out.pop_front() {
            if let Report::StepDone(_) = report {
                self.in_step = None;
            }
            self.root_stack.do_send(FromProc::Report(report));
        }
        self.out.release();
    }

    fn call_done(&mut self, end: Ended, ctx: &mut Context<Self>) {
        self.calls -= 1;
        match end {
            Ended::Returned(end) => {
                let Some(cell) = self.cell.as_mut() else {
                    return;
                };
                match end {
                    CallEnd::Step(end) => cell.step_ended(end, &mut self.out),
                    CallEnd::Rollback(end) => {
                        let mut pctx = ProcCtx {
                            actor: ctx,
                            io: &self.io,
                            calls: &mut self.calls,
                        };
                        cell.rollback_ended(end, &mut self.out, &mut pctx);
                    }
                }
                self.send_reports();
            }
            // The engine stepped down: the call is dropped, nothing is reported (the
            // lease's new holder runs the procedure from its record), and the
            // procedure calls nothing more (its cell has no object left).
            Ended::Deposed => {
                tracing::warn!(target: crate::targets::PROCEDURE, proc = %self.id, "a call in progress was dropped: the engine lost its leader lease");
            }
            // Its tree is gone: so is this actor.
            Ended::Dropped => {
                self.told = true;
                ctx.stop();
            }
            // Engine code around the user's panicked, and the user's object went with
            // the call: the actor dies, and its root stack starts the procedure again.
            Ended::Panicked(message) => {
                tracing::error!(target: crate::targets::PROCEDURE, proc = %self.id, %message, "engine code panicked in a call: the procedure is restarted");
                self.exit_reason = Some(format!("engine code panicked in a call: {message}"));
                ctx.stop();
            }
        }
    }
}

impl Actor for ProcedureActor {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Context<Self>) {
        if let Some(cell) = self.cell.as_mut() {
            cell.activated();
        }
    }
}

impl Handler<ProcMsg> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: ProcMsg, ctx: &mut Context<Self>) {
        match msg {
            ProcMsg::Stop(state) => self.stop(state, ctx),
            ProcMsg::Passivate => self.passivate(ctx),
            ProcMsg::Halt => {
                self.told = true;
                self.cell = None;
                ctx.stop();
            }
            #[cfg(feature = "perturb")]
            ProcMsg::Kill { panic } => {
                if panic {
                    let message = format!("procedure {}'s actor killed by a test", self.id);
                    self.exit_reason = Some(format!("its handler panicked: {message}"));
                    panic!("{message}");
                }
                self.exit_reason = Some("stopped by a test".to_string());
                ctx.stop();
            }
            msg => self.deliver(msg, ctx),
        }
    }
}

impl ProcedureActor {
    /// Hands a message to the cell and sends what it reported.
    fn deliver(&mut self, msg: ProcMsg, ctx: &mut Context<Self>) {
        let Some(cell) = self.cell.as_mut() else {
            // A step sent straight here goes back through the tree as it drops.
            return;
        };
        let msg = match msg {
            ProcMsg::Direct(run) => ProcMsg::Cell(ToCell::RunStep(run.take())),
            msg => msg,
        };
        if let ProcMsg::Cell(ToCell::RunStep(run)) = &msg {
            self.in_step = Some(run.step);
        }
        let out = &mut self.out;
        match msg {
            ProcMsg::Cell(msg) => {
                let mut pctx = ProcCtx {
                    actor: ctx,
                    io: &self.io,
                    calls: &mut self.calls,
                };
                cell.deliver(msg, out, &mut pctx);
            }
            ProcMsg::Abort(ack) => cell.abort(ack, out),
            ProcMsg::Timeout { deadline_ms } => cell.deadline_passed(deadline_ms, out),
            ProcMsg::Pause { now } => cell.pause(now, out),
            ProcMsg::ForgetPause => cell.forget_pause(),
            ProcMsg::Reset(data) => cell.reset(data, out),
            ProcMsg::TreeFailed => cell.tree_failed(out),
            ProcMsg::FailStep(error) => cell.fail_step(*error, out),
            _ => unreachable!("handled by the actor"),
        }
        self.send_reports();
    }

    fn stop(&mut self, state: ProcState, ctx: &mut Context<Self>) {
        let Some(cell) = self.cell.take() else {
            return;
        };
        (*cell).stop(state);
        self.told = true;
        self.send_reports();
        // A step still in progress (a forced bypass finished the procedure under it)
        // goes with this actor: its futures are dropped as it stops.
        let cut = self.in_step.take().is_some();
        self.root_stack
            .do_send(FromProc::Stopped { id: self.id, cut });
        ctx.stop();
    }

    fn passivate(&mut self, ctx: &mut Context<Self>) {
        if self.calls > 0 {
            self.root_stack.do_send(FromProc::Passivated(self.id, None));
            return;
        }
        self.told = true;
        self.send_reports();
        let cell = self.cell.take();
        self.root_stack.do_send(FromProc::Passivated(self.id, cell));
        ctx.stop();
    }
}

impl Drop for ProcedureActor {
    /// Stopped without being told (a panic, or stopped from outside): what it reported
    /// goes out, then its root stack hears that it exited and starts it again.
    fn drop(&mut self) {
        if !self.told {
            self.send_reports();
            let reason = self
                .exit_reason
                .take()
                .unwrap_or_else(|| "stopped without being told".to_string());
            self.root_stack.do_send(FromProc::Exited {
                id: self.id,
                generation: self.generation,
                reason: reason.into_boxed_str(),
                in_step: self.in_step,
            });
        }
    }
}

/// How a call of a procedure ended.
#[derive(Debug, PartialEq)]
enum Ended<T = CallEnd> {
    /// It returned: its cell handles what it reports.
    Returned(T),
    /// Its tree was dropped first: it was not polled again.
    Dropped,
    /// The engine lost its mandate (stepped down, or its lease ran out) first: it was
    /// not polled again, and the user's object went with it.
    Deposed,
    /// Engine code around the user's (which catches its own panics) panicked.
    Panicked(String),
}

/// `call` as one of the actor's futures: not polled again once `tree` is dropped, a
/// panic out of it caught, the call (the user's future) dropped as soon as it ended
/// either way.
fn guarded_call<F: Future>(tree: Arc<TreeStatus>, call: F) -> Guarded<F> {
    Guarded {
        tree,
        call: Some(call),
    }
}

pin_project_lite::pin_project! {
    /// The future of [`guarded_call`]: the call is held in place, not moved into a
    /// future of its own (an `async fn` would hold its argument and the pinned local
    /// both, twice the call's size in every step's allocation).
    struct Guarded<F> {
        tree: Arc<TreeStatus>,
        #[pin]
        call: Option<F>,
    }
}

impl<F: Future> Future for Guarded<F> {
    type Output = Ended<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let Some(call) = this.call.as_mut().as_pin_mut() else {
            unreachable!("a guarded call polled after it ended");
        };
        let polled = poll_guarded(this.tree, call, cx);
        if polled.is_ready() {
            this.call.set(None);
        }
        polled
    }
}

/// Polls `call` unless `tree` was dropped or the engine lost its mandate, catching a
/// panic out of it.
fn poll_guarded<T>(
    tree: &TreeStatus,
    call: Pin<&mut impl Future<Output = T>>,
    cx: &mut task::Context<'_>,
) -> Poll<Ended<T>> {
    if tree.dropped() {
        return Poll::Ready(Ended::Dropped);
    }
    if tree.deposed() {
        return Poll::Ready(Ended::Deposed);
    }
    match catch_unwind(AssertUnwindSafe(|| call.poll(cx))) {
        Ok(Poll::Ready(end)) => Poll::Ready(Ended::Returned(end)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(payload) => Poll::Ready(Ended::Panicked(panic_message(&*payload))),
    }
}

// ------------------------------------------------------------------------------------
// The messages this actor receives (ordering rules: `ARCHITECTURE.md`, "Protocol").
// ------------------------------------------------------------------------------------

/// The scheduler's messages to a procedure.
pub(crate) enum ToCell {
    RunStep(RunStep),
    Rollback(Rollback),
    LocksGranted,
    LockFailed(LockFailed),
}

impl From<RunStep> for ToCell {
    fn from(m: RunStep) -> Self {
        ToCell::RunStep(m)
    }
}

impl From<Rollback> for ToCell {
    fn from(m: Rollback) -> Self {
        ToCell::Rollback(m)
    }
}

impl From<LocksGranted> for ToCell {
    fn from(_: LocksGranted) -> Self {
        ToCell::LocksGranted
    }
}

impl From<LockFailed> for ToCell {
    fn from(m: LockFailed) -> Self {
        ToCell::LockFailed(m)
    }
}

/// A procedure actor's queue of its cell's reports: empty between messages, so it
/// lends its buffer to the thread while empty ([`Lent`]).
pub(crate) type Outbox = Lent<Report>;

/// Run one step (from the scheduler, which counts it against a worker).
pub(crate) struct RunStep {
    /// Which of the procedure's steps this is, counting from 1 (for its span).
    pub(crate) step: usize,
    /// For a parent: its children as they are now (filled in by its root stack, whose
    /// bookkeeping has them; see `Context::children`).
    pub(crate) children: Option<Box<ChildrenSeen>>,
}

/// A step the scheduler sends straight to the procedure's actor, which its root stack
/// named when it queued the step. If the actor does not take it (it stopped before
/// handling it, or has no cell any more), dropping it sends it through the tree as a
/// [`RunStep`], which the root stack forwards to the procedure's current actor: a
/// dispatched step is never lost, and it goes back once only.
pub(crate) struct DirectStep {
    id: ProcId,
    step: usize,
    /// The tree it goes back through; `None` once taken.
    back: Option<TreeAddr>,
}

impl DirectStep {
    pub(crate) fn new(tree: TreeAddr, id: ProcId, step: usize) -> Self {
        DirectStep {
            id,
            step,
            back: Some(tree),
        }
    }

    /// The actor takes it: it goes back no more.
    fn take(mut self) -> RunStep {
        self.back = None;
        RunStep {
            step: self.step,
            children: None,
        }
    }
}

impl Drop for DirectStep {
    fn drop(&mut self) {
        if let Some(tree) = self.back.take() {
            tree.do_send(ToProc {
                id: self.id,
                msg: ToCell::RunStep(RunStep {
                    step: self.step,
                    children: None,
                }),
            });
        }
    }
}

/// The locks the procedure holds for its life were granted (from the lock actor, through
/// the tree's scheduler):
/// answer with `LocksHeld` and its current state.
pub(crate) struct LocksGranted;

/// The procedure's lock request was removed to break a wait-for cycle (from the
/// lock actor, through the tree's scheduler): fail with this text. Its step follows, to
/// be skipped.
pub(crate) struct LockFailed(pub(crate) String);

/// Roll back the newest step (from the lock actor through the tree's scheduler, once
/// the rollback's locks are granted, or at once when it holds them for life), told
/// what the step did ([`Context::undoing`](crate::Context::undoing)).
pub(crate) struct Rollback {
    pub(crate) of: RollbackOf,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A call that returns `7` at its `ready_at`th poll, or panics there; counts its
    /// polls and says when it is dropped.
    struct Probe {
        polls: Arc<AtomicUsize>,
        dropped: Arc<AtomicBool>,
        ready_at: usize,
        panics: bool,
    }

    impl Future for Probe {
        type Output = u32;
        fn poll(self: Pin<&mut Self>, _: &mut task::Context<'_>) -> Poll<u32> {
            let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
            if n < self.ready_at {
                Poll::Pending
            } else if self.panics {
                panic!("engine bug at poll {n}");
            } else {
                Poll::Ready(7)
            }
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    /// (ready at poll, panics, the tree is dropped after this many polls) → how it
    /// ended, and how often the call was polled. The guard drops the call as soon as
    /// it ends, while the guard itself is still held.
    #[test]
    fn a_call_is_guarded_against_engine_panics_and_its_dropped_tree() {
        let panicked = |n: usize| Ended::Panicked(format!("engine bug at poll {n}"));
        let cases = [
            (1, false, None, Ended::Returned(7), 1),
            (3, false, None, Ended::Returned(7), 3),
            (2, true, None, panicked(2), 2),
            (3, false, Some(1), Ended::Dropped, 1),
            (1, false, Some(0), Ended::Dropped, 0),
        ];
        for (ready_at, panics, drop_after, expected, polls) in cases {
            let probe = Probe {
                polls: Arc::default(),
                dropped: Arc::default(),
                ready_at,
                panics,
            };
            let (count, dropped) = (probe.polls.clone(), probe.dropped.clone());
            let tree = Arc::new(TreeStatus::new(crate::actors::shared::Mandate::new(None)));
            let mut call = Box::pin(guarded_call(tree.clone(), probe));
            let mut cx = task::Context::from_waker(task::Waker::noop());
            let mut pass = 0;
            let ended = loop {
                if drop_after == Some(pass) {
                    tree.set_dropped();
                }
                pass += 1;
                if let Poll::Ready(end) = call.as_mut().poll(&mut cx) {
                    break end;
                }
            };
            assert_eq!(ended, expected, "ready at {ready_at}, panics {panics}");
            assert_eq!(count.load(Ordering::SeqCst), polls);
            assert!(dropped.load(Ordering::SeqCst), "the call went as it ended");
        }
    }
}
