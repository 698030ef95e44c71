//! The root-stack actor: one per live tree, on its shard's arbiter, while the tree has
//! work in flight. It holds the tree's runner ([`TreeRunner`]: the pure `RootStack`,
//! the addresses of its procedures' actors and the cells of those that wait) and gives
//! it an actor's context ([`TreeCtx`]): the procedure actors it starts and supervises
//! run on this arbiter and report to this actor ([`FromProc`]), its timers are this
//! actor's `run_later`, and what it sends the scheduler, the lock actor and the
//! persistence actor goes into its shard's outbox ([`ShardIo`]), sent as one message
//! per actor when the shard flushes it.
//!
//! Every message to the tree comes through its shard ([`Shard`], the host), which
//! forwards it ([`Deliver`]), so one sender's messages to a tree arrive in the order
//! they were sent and the shard knows everything the actor has been sent. A tree with
//! nothing in flight (no transition waiting for durability, no step out, no timer
//! armed, and no procedure actor: once the rest is quiet it passivates those first) is
//! passivated: the actor asks its shard ([`Quiet`]), the
//! shard holds the tree's later messages and sends [`Passivate`] behind everything it
//! forwarded; the actor, still quiet, hands its runner back ([`Passivated`]) and stops,
//! and the shard keeps the runner as a value until the next message activates it again
//! (the messages held meanwhile go to the new actor first). A tree waiting for an event
//! or paused for an operator costs its runner only.
//!
//! A panic in engine code around a tree's handling cuts that tree off (its runner's
//! `Drop` tells the executor, and halts its procedure actors); the shard and its other
//! trees go on. A tree that stopped gets nothing more: its shard drops messages for it,
//! and its calls in flight are not polled again (they watch its status).

#[cfg(test)]
mod actor_tests;
mod effects;
mod runner;

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::erased::DynProc;
use crate::error::Error;
use crate::procedure::{ProcError, ProcId};
use crate::root_stack::{RollbackFailure, RollbackOf, StepReport};

use super::guard::panic_message;
use super::lent::lendable;
use super::procedure::{ProcedureActor, ProcedureCell};
use super::protocol::{Outgoing, ToCell, TreeFinished};
use super::shard::{Gone, Passivated, Quiet, Shard, ShardIo};
use super::shared::Shared;

pub(crate) use effects::Leave;
use effects::{carry_out, Sink};

pub(crate) use runner::{publish_recovered, Objects, TreeRunner};

/// Declares [`TreeMsg`]: `Start`, then one variant per message a tree is sent, each
/// with its `From`.
macro_rules! tree_msg {
    ($($(#[$cfg:meta])* $variant:ident($message:ty)),* $(,)?) => {
        /// What a tree is sent (the ordering rules: `ARCHITECTURE.md`, "Protocol").
        pub(crate) enum TreeMsg {
            /// The tree joins the shard and starts (its first message).
            Start(Box<TreeRunner>),
            $($(#[$cfg])* $variant($message),)*
        }

        $(
            $(#[$cfg])*
            impl From<$message> for TreeMsg {
                fn from(m: $message) -> Self {
                    TreeMsg::$variant(m)
                }
            }
        )*
    };
}

tree_msg!(
    Durable(Durable),
    ToProc(ToProc),
    Bypass(BypassRequest),
    Wake(Wake),
    Quiesce(Quiesce),
    Describe(Describe),
    Command(CommandRequest),
    Abort(AbortRequest),
    #[cfg(feature = "perturb")]
    Kill(KillProcedure),
);

/// Stop procedure `id`'s actor as a crash of that actor would (with `panic`, by a panic
/// in its handler), for tests of its supervision.
#[cfg(feature = "perturb")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct KillProcedure {
    pub(crate) id: ProcId,
    pub(crate) panic: bool,
}

#[cfg(feature = "perturb")]
impl Message for KillProcedure {
    type Result = Result<(), crate::Error>;
}

/// A message for the tree, forwarded by its shard.
pub(crate) struct Deliver(pub(crate) TreeMsg);

impl Message for Deliver {
    type Result = ();
}

/// What a procedure actor tells its root stack, in the order it happened. (Its size is
/// a report's: each message is moved once, into actix's boxed envelope.)
#[allow(clippy::large_enum_variant)]
pub(crate) enum FromProc {
    /// What its cell reported: a step's end, a failure asked for, a rollback's end, ...
    Report(Report),
    /// Its answer to `Passivate`: the cell, or `None` if a call runs (it stays active).
    Passivated(ProcId, Option<Box<ProcedureCell>>),
    /// It ran its `Stop` (lock released, cleanup run) and stopped; `cut` if a step it
    /// had taken was still running (an operator's forced bypass): the call was dropped
    /// with the actor, and the step's worker is the root stack's to free.
    Stopped { id: ProcId, cut: bool },
    /// The actor of this activation (its generation) stopped without being told, for
    /// the reason given, in the step it names if it had taken one and not reported
    /// it: it is started again, within the restart limit.
    Exited {
        id: ProcId,
        generation: u32,
        reason: Box<str>,
        in_step: Option<usize>,
    },
}

impl Message for FromProc {
    type Result = ();
}

/// From the shard, behind everything it forwarded: hand the runner back and stop if
/// the tree is still quiet.
pub(crate) struct Passivate;

impl Message for Passivate {
    type Result = ();
}

/// A timer of a tree: what to do when it fires.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Timer {
    /// Send a failed rollback of `id` again.
    RetryRollback { id: ProcId, of: RollbackOf },
    /// `id`'s sleep is over.
    WakeAt { id: ProcId },
    /// `id`'s deadline (as armed then) has passed.
    Deadline { id: ProcId, deadline_ms: u64 },
}

/// A delay capped at about 30 years, as tokio caps its own timers, so that no delay
/// overflows an `Instant`.
fn capped(delay: Duration) -> Duration {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    let now = Instant::now();
    match now.checked_add(delay.min(FAR)) {
        Some(_) => delay.min(FAR),
        None => Duration::ZERO,
    }
}

/// What a root stack may do beyond its own state: start its procedures' actors and
/// its timers with its actor's context, tell the shard's peers through its outbox, and
/// record what leaves the shard otherwise ([`Leave`]), carried out in order, behind the
/// outbox, when the handling returns (see `effects.rs`).
pub(crate) struct TreeCtx<'a> {
    /// `None` for a recovered tree started by its shard without an actor
    /// ([`TreeRunner::starts_idle`]), which starts no procedure actor and no timer.
    actor: Option<&'a mut Context<RootStackActor>>,
    io: &'a Rc<RefCell<ShardIo>>,
    /// Timers in flight: counted here, for passivation.
    in_flight: &'a mut u32,
    leaves: &'a mut Vec<Leave>,
    stop: bool,
    /// The tree's result, sent to the executor once the actor has left its shard.
    result: Option<TreeFinished>,
}

impl TreeCtx<'_> {
    /// Starts an actor for a procedure of the tree, holding `cell`, on this arbiter.
    pub(crate) fn start_procedure(
        &mut self,
        cell: Box<ProcedureCell>,
        generation: u32,
    ) -> Addr<ProcedureActor> {
        let root_stack = self.actor().address();
        ProcedureActor::new(cell, generation, root_stack, self.io.clone()).start()
    }

    /// Fires `timer` after `delay` (dropped if the tree stops first).
    pub(crate) fn run_later(&mut self, delay: Duration, timer: Timer) {
        *self.in_flight += 1;
        self.actor().run_later(capped(delay), move |actor, ctx| {
            actor.timer_fired(timer, ctx);
        });
    }

    fn actor(&mut self) -> &mut Context<RootStackActor> {
        match self.actor.as_deref_mut() {
            Some(actor) => actor,
            None => {
                unreachable!("a tree started without an actor needs one (TreeRunner::starts_idle)")
            }
        }
    }

    /// The tree's work is done: its actor stops once this call returns.
    pub(crate) fn stop(&mut self) {
        self.stop = true;
    }

    /// The tree's result, for the executor: sent as the actor stops, after it told its
    /// shard it is gone and after everything the tree told, so that whoever hears the
    /// result finds the tree gone and the locks it released free.
    pub(crate) fn publish(&mut self, result: TreeFinished) {
        self.result = Some(result);
    }

    /// Tells `msg` to its actor (the shard's scheduler, the lock actor or the
    /// persistence actor), behind everything the shard's trees told it before.
    pub(crate) fn tell(&mut self, msg: impl Into<Outgoing>) {
        ShardIo::push(self.io, msg.into());
    }

    /// Sends `leave` out of the shard when the handling returns, behind everything
    /// told by then.
    pub(crate) fn leave(&mut self, leave: Leave) {
        self.leaves.push(leave);
    }

    /// Answers `ack` with `answer`, behind everything told before.
    pub(crate) fn answer(&mut self, ack: AbortAck, answer: Result<bool, Error>) {
        self.leave(Leave::Answered(ack, answer));
    }
}

/// The actor's side of [`carry_out`]: the shard's outbox and the executor.
struct ShardSink<'a> {
    io: &'a RefCell<ShardIo>,
    shared: &'a Shared,
}

impl Sink for ShardSink<'_> {
    fn send_outbox(&mut self) {
        self.io.borrow_mut().flush();
    }

    fn leave(&mut self, leave: Leave) {
        leave.send(&self.shared.news, &self.shared.finished);
    }
}

thread_local! {
    /// What leaves the shard in the handling under way on this thread (root stacks
    /// handle one message at a time per arbiter), kept between handlings so that
    /// recording it allocates nothing.
    static LEAVES: RefCell<Vec<Leave>> = const { RefCell::new(Vec::new()) };
}

/// Starts a recovered tree whose start needs no actor ([`TreeRunner::starts_idle`]) on
/// its shard's thread, as its actor would; the shard then keeps it passivated. `false`
/// if engine code panicked: the runner is cut off, and its drop tells the executor.
pub(crate) fn start_without_actor(runner: &mut TreeRunner, io: &Rc<RefCell<ShardIo>>) -> bool {
    let mut in_flight = 0;
    match handle(runner, None, io, &mut in_flight, TreeRunner::started).ran {
        Ok(()) => true,
        Err(payload) => {
            let message = panic_message(&*payload);
            tracing::error!(target: crate::targets::TREE, root = %runner.root(), %message, "engine code panicked: the tree is cut off");
            false
        }
    }
}

/// What one handling of a runner decided beyond its effects.
struct Handled {
    /// `Err`: engine code panicked, with this payload.
    ran: std::thread::Result<()>,
    stop: bool,
    result: Option<TreeFinished>,
}

/// Calls `f` with `runner` and a context — its actor's, or none for a tree its shard
/// starts ([`start_without_actor`]) — catching a panic in engine code, then carries out
/// what leaves the shard, behind the outbox (whether or not the handling finished:
/// what it decided before a panic happens, as it did when each effect was immediate).
/// A result it published is for the actor to send as it stops; the outbox goes first.
fn handle(
    runner: &mut TreeRunner,
    actor: Option<&mut Context<RootStackActor>>,
    io: &Rc<RefCell<ShardIo>>,
    in_flight: &mut u32,
    f: impl FnOnce(&mut TreeRunner, &mut TreeCtx<'_>),
) -> Handled {
    let mut leaves = LEAVES.with_borrow_mut(std::mem::take);
    let mut ctx = TreeCtx {
        actor,
        io,
        in_flight,
        leaves: &mut leaves,
        stop: false,
        result: None,
    };
    let ran = catch_unwind(AssertUnwindSafe(|| f(runner, &mut ctx)));
    let (stop, result) = (ctx.stop, ctx.result);
    let mut sink = ShardSink {
        io,
        shared: runner.shared_ref(),
    };
    carry_out(leaves.drain(..), &mut sink);
    if result.is_some() {
        // The result goes after everything the tree told (the locks its procedures
        // released are free before anyone hears of it).
        sink.send_outbox();
    }
    LEAVES.with_borrow_mut(|spare| {
        if spare.capacity() < leaves.capacity() {
            *spare = leaves;
        }
    });
    Handled { ran, stop, result }
}

/// The root-stack actor (see the module docs).
pub(crate) struct RootStackActor {
    root: ProcId,
    /// `None` once handed back to the shard, or once the tree ended.
    runner: Option<Box<TreeRunner>>,
    io: Rc<RefCell<ShardIo>>,
    shard: Rc<Addr<Shard>>,
    /// Timers in flight.
    in_flight: u32,
    /// The runner starts with this actor (a new or recovered tree), rather than being
    /// activated again.
    starts: bool,
    /// It told its shard it is quiet and has not heard back.
    quiet_told: bool,
}

impl RootStackActor {
    pub(crate) fn new(
        root: ProcId,
        runner: Box<TreeRunner>,
        io: Rc<RefCell<ShardIo>>,
        shard: Rc<Addr<Shard>>,
        starts: bool,
    ) -> Self {
        RootStackActor {
            root,
            runner: Some(runner),
            io,
            shard,
            in_flight: 0,
            starts,
            quiet_told: false,
        }
    }

    /// Calls `f` with the runner and a context; then stops the actor if the tree ended
    /// (or a panic in engine code cut it off), or tells the shard if it went quiet.
    fn with_runner(
        &mut self,
        ctx: &mut Context<Self>,
        f: impl FnOnce(&mut TreeRunner, &mut TreeCtx<'_>),
    ) {
        let Some(runner) = self.runner.as_mut() else {
            return;
        };
        let Handled { ran, stop, result } =
            handle(runner, Some(&mut *ctx), &self.io, &mut self.in_flight, f);
        match ran {
            Err(payload) => self.cut_off(&panic_message(&*payload), result, ctx),
            Ok(()) if stop => self.end(result, ctx),
            Ok(()) => self.tell_if_quiet(),
        }
    }

    /// Whether the tree has nothing in flight, and may be passivated.
    fn quiet(&self) -> bool {
        self.in_flight == 0 && self.runner.as_ref().is_some_and(|r| r.quiet())
    }

    /// Tells the shard once the tree is quiet; once nothing but its procedures' actors
    /// is in flight, asks those to hand their cells back first.
    fn tell_if_quiet(&mut self) {
        if self.quiet_told || self.in_flight > 0 {
            return;
        }
        let Some(runner) = self.runner.as_mut() else {
            return;
        };
        if runner.quiet() {
            self.quiet_told = true;
            self.shard.do_send(Quiet(self.root));
        } else {
            runner.passivate_idle_procedures();
        }
    }

    /// Engine code panicked for this tree: it is cut off, the others go on (a result
    /// it published before the panic still goes out).
    fn cut_off(&mut self, message: &str, result: Option<TreeFinished>, ctx: &mut Context<Self>) {
        tracing::error!(target: crate::targets::TREE, root = %self.root, %message, "engine code panicked: the tree is cut off");
        self.end(result, ctx);
    }

    /// The tree ended: its `TreeEnded` goes after everything it sent, the shard hears
    /// it is gone, then the executor gets its `result` (if it published one), and the
    /// actor stops (its calls in flight, if it was cut off, go with it).
    fn end(&mut self, result: Option<TreeFinished>, ctx: &mut Context<Self>) {
        let Some(mut runner) = self.runner.take() else {
            return;
        };
        let shared = result.is_some().then(|| runner.shared());
        let (ended, irreversible, cut_off) = runner.ended();
        {
            let mut io = self.io.borrow_mut();
            io.tree_ended(ended, irreversible);
            if cut_off {
                // The drop tells the executor that the tree failed: the scheduler
                // hears first that it ended (and frees the workers of its steps).
                io.flush();
            }
        }
        drop(runner);
        ShardIo::ask_flush(&self.io);
        self.shard.do_send(Gone(self.root));
        if let (Some(result), Some(shared)) = (result, shared) {
            shared.finished.do_send(result);
        }
        ctx.stop();
    }

    fn timer_fired(&mut self, timer: Timer, ctx: &mut Context<Self>) {
        self.in_flight -= 1;
        self.with_runner(ctx, |r, c| r.on_timer(timer, c));
    }
}

impl Actor for RootStackActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.starts {
            self.with_runner(ctx, TreeRunner::started);
        }
    }
}

impl Handler<Deliver> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: Deliver, ctx: &mut Context<Self>) {
        self.with_runner(ctx, |r, c| r.receive(msg.0, c));
    }
}

impl Handler<FromProc> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: FromProc, ctx: &mut Context<Self>) {
        self.with_runner(ctx, |r, c| r.on_procedure(msg, c));
    }
}

impl Handler<Passivate> for RootStackActor {
    type Result = ();

    fn handle(&mut self, _msg: Passivate, ctx: &mut Context<Self>) {
        self.quiet_told = false;
        if self.quiet() {
            let runner = self.runner.take();
            self.shard.do_send(Passivated(self.root, runner));
            ctx.stop();
        } else {
            // Something it was sent before the shard held its messages gave it work.
            self.shard.do_send(Passivated(self.root, None));
        }
    }
}

// ------------------------------------------------------------------------------------
// The messages this actor receives (ordering rules: `ARCHITECTURE.md`, "Protocol").
// ------------------------------------------------------------------------------------

/// What the scheduler sends a procedure, through its root stack.
pub(crate) struct ToProc {
    pub(crate) id: ProcId,
    pub(crate) msg: ToCell,
}

/// What a procedure reports to its root stack: its actor queues what its cell reported
/// while handling one message and sends each, in order, once the handling has returned
/// (`FromProc::Report`), so the root stack handles a procedure's reports in the order
/// it made them, never from inside one of its own actions.
pub(crate) enum Report {
    StepDone(StepDone),
    Fail(FailRequest),
    RolledBack(RolledBack),
    Deadline(Deadline),
    PauseNow(PauseNow),
    LocksHeld(LocksHeld),
}

lendable!(Report);

/// A step ended (the procedure's report), with the objects of any new children. Every
/// `RunStep` the scheduler dispatched is answered by exactly one `StepDone`.
pub(crate) struct StepDone {
    pub(crate) report: StepReport,
    pub(crate) children: Vec<(ProcId, DynProc)>,
    /// The procedure's state name after the step (`Procedure::state_name`), published
    /// with the step's record.
    pub(crate) state_name: Option<String>,
}

/// Persist that `id` holds its life-long locks, then run its queued step.
pub(crate) struct LocksHeld {
    pub(crate) id: ProcId,
    pub(crate) data: Vec<u8>,
}

/// A procedure between calls asks to be paused now, with its recorded state.
pub(crate) struct PauseNow {
    pub(crate) id: ProcId,
    pub(crate) data: Vec<u8>,
}

/// A rollback step ended: the state after it, or its error.
pub(crate) struct RolledBack {
    pub(crate) id: ProcId,
    pub(crate) result: Result<Vec<u8>, RollbackFailure>,
}

/// Answers an operator's abort: `Ok(true)` once the abort is durable.
pub(crate) type AbortAck = oneshot::Sender<Result<bool, Error>>;

/// An abort's answer channel with the answer to give once what it reports is durable.
pub(crate) type AckWith = (AbortAck, Result<bool, Error>);

/// An operator's abort of a procedure of this tree, from the executor.
pub(crate) struct AbortRequest {
    pub(crate) id: ProcId,
    pub(crate) ack: AbortAck,
}

/// An operator's bypass of a procedure of this tree, from the executor: answered
/// `Ok(true)` once the bypass is durable, or with why it was refused.
pub(crate) struct BypassRequest {
    pub(crate) id: ProcId,
    pub(crate) recursive: bool,
    /// Forced: a procedure queued or in a step is taken too.
    pub(crate) force: bool,
    pub(crate) ack: AbortAck,
}

/// An operator's command on a procedure of this tree, from the executor: answered
/// `Ok(true)` once its effect is durable, or with why it was refused.
pub(crate) struct CommandRequest {
    pub(crate) id: ProcId,
    pub(crate) command: Command,
    pub(crate) ack: AbortAck,
}

/// What an operator asks of a procedure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Command {
    /// PAUSED: run the step again; ROLLBACK_PAUSED: retry the rollback.
    Continue,
    /// PAUSED: fail and roll back the tree; otherwise as an abort.
    Rollback,
    /// Pause at the next step (answered once PAUSED is durable).
    Pause,
}

impl Command {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Command::Continue => "continue",
            Command::Rollback => "rollback",
            Command::Pause => "pause",
        }
    }
}

/// The procedure accepted an abort or timeout between steps (`failure`), or was asked
/// to abort when there was nothing to accept (`None`: it had finished or was already
/// failing). `ack`, if any, gets its answer once everything the root stack did before,
/// and this failure, is durable.
pub(crate) struct FailRequest {
    pub(crate) id: ProcId,
    pub(crate) failure: Option<(ProcError, Vec<u8>)>,
    pub(crate) ack: Option<AckWith>,
}

/// The timeout hook of `id` kept it going with this deadline (or none): persist it
/// with its state.
pub(crate) struct Deadline {
    pub(crate) id: ProcId,
    pub(crate) deadline_ms: Option<u64>,
    pub(crate) data: Vec<u8>,
}

/// A timer or event woke the procedure.
pub(crate) struct Wake(pub(crate) ProcId);

/// The root stack's transition `seq` (and every earlier one) is durable, or the store
/// failed. From the persistence actor, in the order the appends arrived.
pub(crate) struct Durable {
    pub(crate) seq: usize,
    pub(crate) result: Result<(), Error>,
}

/// Answer once every transition the tree has made is durable and its actions are
/// performed. Sent after the last call into user code ended (its report was sent
/// before), so the answer covers every report of the tree. The answer names the tree's
/// procedures that may still have been cut off by an earlier crash (marked in memory
/// by recovery, not run since: [`RootStack::cut_off`](crate::root_stack::RootStack::cut_off)),
/// for the drained stop's mark; `None` from a halted tree, whose last transitions may
/// never become durable (so the stop is not drained).
pub(crate) struct Quiesce(pub(crate) oneshot::Sender<Option<Vec<ProcId>>>);

/// An operator's look at the tree ([`Executor::tree`](crate::Executor::tree)): its
/// execution stack and its rollback so far, answered at once.
pub(crate) struct Describe(pub(crate) oneshot::Sender<crate::TreeInfo>);

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_timer_delay_is_capped_far_away_rather_than_overflowing() {
        assert_eq!(capped(Duration::from_secs(5)), Duration::from_secs(5));
        let far = capped(Duration::MAX);
        assert!(far < Duration::MAX && far >= Duration::from_secs(86_400 * 365 * 29));
    }
}
