//! The messages that cross actors, in one place, with the ordering rules each one
//! obeys. actix delivers the messages of one mailbox in the order they were sent and
//! promises nothing across mailboxes; every rule here is one the senders keep (see also
//! `ARCHITECTURE.md`, "Protocol"). `tests/protocol.rs` pins each rule with the race that
//! broke it, and `tests/perturbation.rs` checks them all on random workloads.
//!
//! Every message to a tree goes through its shard (`shard.rs`), which forwards it to the
//! tree's root-stack actor (starting one for a passivated tree), and what a shard's trees
//! send the scheduler, the lock actor and the persistence actor is gathered and sent in
//! batches that keep the order it was made in (`Mail`, `FromShard`, `LocksFromShard`,
//! `ToPersistence`), so every rule below holds per tree, one sender at a time.
//!
//! Handlers live with their actors; the public messages a caller sends (`Submit`,
//! `Abort`, `GetState`, `WaitFor`, `List`, `WakeEvent`) live in `executor/api.rs` and
//! `locks.rs` beside the API they mirror.

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::erased::DynProc;
use crate::error::Error;
use crate::locks::Request;
use crate::procedure::{ProcError, ProcId, ProcState};
use crate::record::{Failure, Paused, StoreOp};
use crate::root_stack::{Place, RollbackFailure, StepReport};

use super::lent::{lendable, Lent};
use super::locks::LockActor;
use super::scheduler::SchedulerActor;
use super::shard::{Mail, TreeHandle};

/// A root stack's address as the engine keeps it (in the procedure table, the event
/// table, every queued step): its shard and root, shared, because cloning an actix
/// `Addr` counts a new sender.
pub(crate) type TreeAddr = std::sync::Arc<TreeHandle>;

/// Where a procedure is reached: its tree's root stack, which holds the procedure's
/// cell and hands it what is addressed to it ([`ToProc`]). Every queued step carries
/// one.
#[derive(Clone)]
pub(crate) struct ProcAddr {
    tree: TreeAddr,
    id: ProcId,
}

impl ProcAddr {
    pub(crate) fn new(tree: TreeAddr, id: ProcId) -> Self {
        ProcAddr { tree, id }
    }

    /// Its tree's address.
    pub(crate) fn tree(&self) -> &TreeAddr {
        &self.tree
    }

    /// Whether its root stack still runs.
    pub(crate) fn connected(&self) -> bool {
        self.tree.connected()
    }

    /// Adds `msg` for the procedure to `mail`.
    pub(crate) fn post(&self, mail: &mut Mail, msg: impl Into<ToCell>) {
        mail.push(
            &self.tree,
            ToProc {
                id: self.id,
                msg: msg.into(),
            },
        );
    }
}

/// What the scheduler sends a procedure, through its root stack.
pub(crate) struct ToProc {
    pub(crate) id: ProcId,
    pub(crate) msg: ToCell,
}

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

/// A procedure actor's queue of its cell's reports: empty between messages, so it
/// lends its buffer to the thread while empty ([`Lent`]).
pub(crate) type Outbox = Lent<Report>;

lendable!(Report);

// ------------------------------------------------------------------------------------
// Scheduler <-> root stack <-> procedure actor: one step.
//
// Enqueue (root stack -> its shard's scheduler, or the lock actor when the step needs
// locks) is sent only once the transition that caused it is durable and performed, so
// the step's RunStep reaches the root stack after the transition's actions (the step's
// actor started, for a new child). RunStep (scheduler -> the procedure, through its
// tree's shard as a ToProc and its root stack, which forwards it to the procedure's
// actor, starting one if the procedure waited) counts against a worker. Every RunStep
// is answered by exactly one StepDone (the procedure actor's report), and the
// root stack frees the worker (StepFinished -> scheduler) only after feeding that report
// to the core and queueing its records (Persist) and any Enqueue it caused without a
// write. A worker is handed on only once its step is recorded. The scheduler times each
// step from its RunStep to its StepFinished and charges it to the step's tree (the
// Enqueue names the root), and tells the lock actor when a step that held per-step
// locks finished; when a tree ends its actor queues the tree's TreeEnded in the shard's
// outbox, after every StepFinished the tree sent (a runner dropped another way sends it
// from its Drop), and the scheduler then drops the tree's accumulated time, and, when
// the root stack says steps may be out (it died of a panic in engine code, and the
// steps' calls with it), frees the worker of any step of the tree still running.
// ------------------------------------------------------------------------------------

/// Queue a step of `id`; with `lock`, once its locks are granted.
pub(crate) struct Enqueue {
    pub(crate) id: ProcId,
    /// The root of its tree: the fair queue ranks the step by the tree's step time.
    pub(crate) root: ProcId,
    pub(crate) addr: ProcAddr,
    pub(crate) place: Place,
    /// Its registered type name and which of its steps this is, counting from 1 (for
    /// the stuck-worker monitor's warnings).
    pub(crate) what: (&'static str, usize),
    /// The locks the step needs (`None`: none, or its tree has failed and the step will
    /// only be skipped).
    pub(crate) lock: Option<Request>,
}

impl Message for Enqueue {
    type Result = ();
}

/// A dispatched step of `.0` finished (or was skipped); its worker, and the locks it
/// held for this step, are free.
pub(crate) struct StepFinished(pub(crate) ProcId);

impl Message for StepFinished {
    type Result = ();
}

#[derive(Clone)]
/// The tree rooted at `root` ended (its root stack stopped): the scheduler forgets its
/// accumulated step time. A late `StepFinished` of the tree (from a procedure whose
/// root stack died) charges nothing.
pub(crate) struct TreeEnded {
    pub(crate) root: ProcId,
    /// Steps of the tree may still hold workers: its root stack was cut off (a panic
    /// in engine code) or stopped with steps it had not heard back from. Otherwise
    /// every step of it has finished, and the scheduler need not look for them.
    pub(crate) steps_out: bool,
}

impl Message for TreeEnded {
    type Result = ();
}

/// Wake `id` through its root stack once `event` is woken (at once if it already is).
pub(crate) struct SuspendOn {
    pub(crate) id: ProcId,
    pub(crate) event: String,
    pub(crate) root_stack: TreeAddr,
}

impl Message for SuspendOn {
    type Result = ();
}

/// `id` stopped while suspended on `event`: drop it from the event's waiters (from its
/// root stack, after the `SuspendOn` it sent before).
pub(crate) struct Unsuspend {
    pub(crate) id: ProcId,
    pub(crate) event: String,
}

impl Message for Unsuspend {
    type Result = ();
}

/// Run one step (from the scheduler, which counts it against a worker).
pub(crate) struct RunStep {
    /// Which of the procedure's steps this is, counting from 1 (for its span).
    pub(crate) step: usize,
    /// For a parent: its children as they are now (filled in by its root stack, whose
    /// bookkeeping has them; see `Context::children`).
    pub(crate) children: Option<Box<[(ProcId, ProcState)]>>,
}

/// A step ended (the procedure's report), with the objects of any new children. Every
/// `RunStep` the scheduler dispatched is answered by exactly one `StepDone`.
pub(crate) struct StepDone {
    pub(crate) report: StepReport,
    pub(crate) children: Vec<(ProcId, DynProc)>,
    /// The procedure's state name after the step (`Procedure::state_name`), published
    /// with the step's record.
    pub(crate) state_name: Option<String>,
}

// ------------------------------------------------------------------------------------
// Locks: the lock actor owns the lock table.
//
// A step's lock request rides on its Enqueue, sent to the lock actor; the step goes to
// its scheduler's ready queue (Granted) only once granted, so a waiting procedure holds
// no worker. Locks for one step are released when that step's StepFinished reaches its
// scheduler (ReleaseLocks with Release::Step, scheduler -> lock actor); an Enqueue that
// arrives while the previous step still holds them (a yield's, the next step's) waits
// for it. Locks
// for a procedure's life are first granted to a step as LocksGranted (-> procedure),
// answered with LocksHeld (its report), which persists the hold and only then
// sends Resume's Enqueue: no step runs under a life-long lock before recovery would
// grant it back. A rollback step's locks are asked with LockForRollback; the lock actor
// has the tree's scheduler post the Rollback once granted, and the procedure releases them with
// ReleaseLocks after the call, or instead of it when its acquire_lock hook yields (and
// everything when it stops, before the tree's result).
// TreeFailed withdraws the tree's waiting step requests (those steps are skipped
// anyway), WithdrawStep one procedure's (its cell failed past the point of no return,
// so the step comes back skipped and it pauses); a deadlock victim gets LockFailed and
// then its step, which it skips.
// ------------------------------------------------------------------------------------

/// Roll back a step of `id` once its locks are granted (from the root stack).
pub(crate) struct LockForRollback {
    pub(crate) id: ProcId,
    pub(crate) addr: ProcAddr,
    pub(crate) lock: Request,
    pub(crate) unrecorded: bool,
}

impl Message for LockForRollback {
    type Result = ();
}

/// Release the locks of `id`: those of one step (from its scheduler, when the step
/// finished), of one rollback step (from its procedure cell), or everything it holds
/// (from its cell or root stack: it finished, or will never run again).
pub(crate) struct ReleaseLocks {
    pub(crate) id: ProcId,
    pub(crate) what: Release,
}

/// Which of a procedure's locks a [`ReleaseLocks`] ends: each release names what it
/// ends, so that a step's end does not release locks granted meanwhile to the same
/// procedure's rollback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Those held for one step.
    Step,
    /// Those held for one rollback step.
    RollbackStep,
    /// Whatever it holds.
    All,
}

impl Message for ReleaseLocks {
    type Result = ();
}

/// The tree rooted at `.0` failed: its waiting step requests are withdrawn and the
/// steps queued, to be skipped (from the root stack).
pub(crate) struct TreeFailed(pub(crate) ProcId);

impl Message for TreeFailed {
    type Result = ();
}

/// The tree rooted at `.0` has passed its point of no return (from its root stack, once
/// a step marking it is reported, or at start for a recovered one): a deadlock's victim
/// is taken from other trees while one can be (until its `TreeEnded`).
pub(crate) struct TreeIrreversible(pub(crate) ProcId);

impl Message for TreeIrreversible {
    type Result = ();
}

/// The queued step of `.0` is to be skipped (its procedure failed past the point of no
/// return, and pauses when the step comes back): if it waits for its locks, the request
/// is withdrawn and the step queued (from the root stack).
pub(crate) struct WithdrawStep(pub(crate) ProcId);

impl Message for WithdrawStep {
    type Result = ();
}

/// The locks the procedure holds for its life were granted (from the lock actor, through
/// the tree's scheduler):
/// answer with `LocksHeld` and its current state.
pub(crate) struct LocksGranted;

/// Persist that `id` holds its life-long locks, then run its queued step.
pub(crate) struct LocksHeld {
    pub(crate) id: ProcId,
    pub(crate) data: Vec<u8>,
}

/// The procedure's lock request was removed to break a wait-for cycle (from the
/// lock actor, through the tree's scheduler): fail with this text. Its step follows, to
/// be skipped.
pub(crate) struct LockFailed(pub(crate) String);

/// Grant these recovered life-long holds before anything else is scheduled (from the
/// executor, before any root stack starts).
pub(crate) struct Regrant(pub(crate) Vec<Request>);

impl Message for Regrant {
    type Result = ();
}

// ------------------------------------------------------------------------------------
// Root stack -> procedure: rollback, stop.
//
// A rollback is started only when nothing of the tree runs, newest stack entry first,
// and is answered by RolledBack. A finished procedure is stopped (its lock released, its
// cleanup run) by a call, when its final record is durable: before anything the root
// stack does later, the tree's result included.
// ------------------------------------------------------------------------------------

/// Roll back the newest step (from the lock actor through the tree's scheduler, once
/// the rollback's locks are granted, or at once when it holds them for life);
/// `unrecorded` as in
/// [`Context::is_unrecorded_step`](crate::Context::is_unrecorded_step).
pub(crate) struct Rollback {
    pub(crate) unrecorded: bool,
}

/// A rollback step ended: the state after it, or its error.
/// A procedure between calls asks to be paused now, with its recorded state.
pub(crate) struct PauseNow {
    pub(crate) id: ProcId,
    pub(crate) data: Vec<u8>,
}

pub(crate) struct RolledBack {
    pub(crate) id: ProcId,
    pub(crate) result: Result<Vec<u8>, RollbackFailure>,
}

// ------------------------------------------------------------------------------------
// Aborts: executor -> root stack -> procedure -> root stack.
//
// AbortRequest goes to the tree's root stack, which sends it on to the live
// procedure's actor. Its cell asks the abort hook between calls (settling aborts that
// arrive during a call when the call ends) and reports FailRequest with the answer
// channel; the root stack answers only once the failure, and everything it did before,
// is durable. The answer never runs ahead of the log.
// ------------------------------------------------------------------------------------

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

// ------------------------------------------------------------------------------------
// Wake-ups and deadlines.
//
// A procedure's deadline timer is its root stack's (one `run_later` per armed
// deadline, so a waiting procedure needs no actor for it); when it fires the root stack
// sends the procedure a Timeout, and its cell asks the timeout hook only between calls.
// A kept-going procedure sends Deadline with its new deadline and state; the root stack
// persists it and arms the new deadline's timer. A timer may fire before that record
// is durable: a crash then brings back the old deadline and the old state, which
// expire again at once, so the hook runs again from the state it last saw durable.
// ------------------------------------------------------------------------------------

/// The timeout hook of `id` kept it going with this deadline (or none): persist it
/// with its state.
pub(crate) struct Deadline {
    pub(crate) id: ProcId,
    pub(crate) deadline_ms: Option<u64>,
    pub(crate) data: Vec<u8>,
}

/// A timer or event woke the procedure.
pub(crate) struct Wake(pub(crate) ProcId);

// ------------------------------------------------------------------------------------
// Root stack -> persistence actor (the group commit), root stack -> executor.
//
// Persist is answered after its batch is durable, in the order the appends arrived;
// after a failed append every later one fails too (Refuse forces that state). A root
// stack's Persist is answered with a Durable message naming its transition (so the
// answers reach it in the order it sent the appends), the cleaner's on a channel; an
// answer dropped unsent is an Error::Stopped. A root stack sends TreeFinished once: its
// result (after its finished procedures were stopped, and after its actor told its
// shard it is gone), or the error that halted it; on the first error the executor
// answers every waiter.
// ------------------------------------------------------------------------------------

/// Makes `ops` durable, then answers on `ack`. If the persistence actor is gone, `ack`
/// is dropped and that is an answer too (`Error::Stopped`), so nothing waits for ever.
pub(crate) struct Persist {
    pub(crate) ops: Vec<StoreOp>,
    pub(crate) ack: DurableAck,
}

/// Who is told that a `Persist` is durable (or failed).
pub(crate) enum DurableAck {
    /// A caller waiting on a channel (the executor's result cleaner).
    Caller(oneshot::Sender<Result<(), Error>>),
    /// A root stack, told with a `Durable` message naming its transition: no channel
    /// and no future per transition.
    Tree(TreeAck),
}

impl DurableAck {
    /// Answers: a caller at once, a root stack through `mail` (the persistence actor's,
    /// one message per shard).
    pub(crate) fn send(self, result: Result<(), Error>, mail: &mut Mail) {
        match self {
            DurableAck::Caller(tx) => {
                let _ = tx.send(result);
            }
            DurableAck::Tree(ack) => ack.answer(result, mail),
        }
    }
}

/// A root stack's transition number `seq`, to acknowledge once. Dropped unanswered (the
/// persistence actor gone), it answers `Error::Stopped`, as a dropped channel did.
pub(crate) struct TreeAck {
    tree: TreeAddr,
    seq: usize,
    answered: bool,
}

impl TreeAck {
    pub(crate) fn new(tree: TreeAddr, seq: usize) -> Self {
        TreeAck {
            tree,
            seq,
            answered: false,
        }
    }

    /// Answers through `mail`.
    fn answer(mut self, result: Result<(), Error>, mail: &mut Mail) {
        self.answered = true;
        mail.push(&self.tree, self.message(result));
    }

    fn message(&self, result: Result<(), Error>) -> Durable {
        Durable {
            seq: self.seq,
            result,
        }
    }
}

impl Drop for TreeAck {
    /// Unanswered, the persistence actor is gone (and its mail with it): told directly.
    fn drop(&mut self) {
        if !self.answered {
            self.tree.do_send(self.message(Err(Error::Stopped)));
        }
    }
}

/// The root stack's transition `seq` (and every earlier one) is durable, or the store
/// failed. From the persistence actor, in the order the appends arrived.
pub(crate) struct Durable {
    pub(crate) seq: usize,
    pub(crate) result: Result<(), Error>,
}

impl Message for Persist {
    type Result = ();
}

/// Refuse every append from now on (the engine broke an invariant and is stopping).
pub(crate) struct Refuse(pub(crate) String);

impl Message for Refuse {
    type Result = ();
}

/// Stops the persistence actor once everything handed to the writer thread is written
/// (the last message it gets, after every root stack's thread has ended); answers after the
/// thread (and with it the store, and its lock) is gone. `drained`: the shutdown
/// drained (no step was cut off), and the store is marked so after its last append,
/// naming the procedures an earlier crash may still have cut off.
pub(crate) struct StopWriter {
    pub(crate) drained: Option<Vec<ProcId>>,
}

impl Message for StopWriter {
    type Result = ();
}

/// A tree finished (from its root stack), or halted because nothing more can be made
/// durable (the store failed) or the engine broke an invariant.
pub(crate) struct TreeFinished {
    pub(crate) root: ProcId,
    pub(crate) result: Result<Result<(), Failure>, Error>,
}

impl Message for TreeFinished {
    type Result = ();
}

// A graceful shutdown: executor -> root stack, once no call into user code runs.

/// Answer once every transition the tree has made is durable and its actions are
/// performed. Sent after the last call into user code ended (its report was sent
/// before), so the answer covers every report of the tree. The answer names the tree's
/// procedures that may still have been cut off by an earlier crash (marked in memory
/// by recovery, not run since: [`RootStack::cut_off`](crate::root_stack::RootStack::cut_off)),
/// for the drained stop's mark; `None` from a halted tree, whose last transitions may
/// never become durable (so the stop is not drained).
pub(crate) struct Quiesce(pub(crate) oneshot::Sender<Option<Vec<ProcId>>>);

// Subscriptions: root stack -> executor, in order with the tree's `TreeFinished`.

/// News of a tree for the subscribers (sent only while there are any). From the root
/// stack, so it reaches the executor before the same tree's `TreeFinished`.
pub(crate) enum TreeNews {
    /// The root's insert is durable and its submitter answered.
    Submitted(ProcId),
    /// A procedure of the tree is durably paused.
    Paused {
        id: ProcId,
        root: ProcId,
        state: ProcState,
        why: Paused,
    },
}

impl Message for TreeNews {
    type Result = ();
}

// Batches: a shard -> its scheduler, the lock actor and the persistence actor, each in
// the order its trees made them.

macro_rules! batch_of {
    ($(#[$doc:meta])* $name:ident, $batch:ident, $actor:ty; $($variant:ident),* $(,)?) => {
        $(#[$doc])*
        pub(crate) enum $name {
            $($variant($variant),)*
        }

        impl $name {
            /// Handles it as the message itself would be.
            pub(crate) fn handle_in(self, actor: &mut $actor, ctx: &mut Context<$actor>) {
                match self {
                    $($name::$variant(m) => Handler::handle(actor, m, ctx),)*
                }
            }
        }

        /// Messages of one shard's trees, handled in the order they were made, as if
        /// each had been sent on its own.
        pub(crate) struct $batch(pub(crate) Vec<$name>);

        impl Message for $batch {
            type Result = ();
        }
    };
}

batch_of!(
    /// What a tree sends its shard's scheduler.
    ToScheduler, FromShard, SchedulerActor;
    Enqueue,
    StepFinished,
    TreeEnded,
);

batch_of!(
    /// What a tree sends the lock actor: only trees whose procedures declare locks, or
    /// suspend on events, or pass a point of no return.
    ToLocks, LocksFromShard, LockActor;
    Enqueue,
    ReleaseLocks,
    Unsuspend,
    SuspendOn,
    LockForRollback,
    TreeFailed,
    WithdrawStep,
    TreeIrreversible,
    TreeEnded,
);

/// A shard's appends, for the persistence actor, in the order its trees made them.
pub(crate) struct ToPersistence(pub(crate) Vec<Persist>);

impl Message for ToPersistence {
    type Result = ();
}

/// Something a tree sends out of its shard: to whom it goes follows from what it is.
pub(crate) enum Outgoing {
    Scheduler(ToScheduler),
    Locks(ToLocks),
    Persist(Persist),
}

macro_rules! outgoing {
    ($to:ident($batch:ident): $($variant:ident),*) => {
        $(
            impl From<$variant> for Outgoing {
                fn from(m: $variant) -> Self {
                    Outgoing::$to($batch::$variant(m))
                }
            }
        )*
    };
}

outgoing!(Scheduler(ToScheduler): StepFinished);
outgoing!(
    Locks(ToLocks): ReleaseLocks,
    Unsuspend,
    SuspendOn,
    LockForRollback,
    TreeFailed,
    WithdrawStep,
    TreeIrreversible
);

impl From<Persist> for Outgoing {
    fn from(m: Persist) -> Self {
        Outgoing::Persist(m)
    }
}

impl From<Enqueue> for Outgoing {
    /// A step that needs locks asks the lock actor, which queues it once granted; any
    /// other goes to the scheduler at once.
    fn from(m: Enqueue) -> Self {
        if m.lock.is_some() {
            Outgoing::Locks(ToLocks::Enqueue(m))
        } else {
            Outgoing::Scheduler(ToScheduler::Enqueue(m))
        }
    }
}

impl From<ToScheduler> for Outgoing {
    fn from(m: ToScheduler) -> Self {
        Outgoing::Scheduler(m)
    }
}

impl From<ToLocks> for Outgoing {
    fn from(m: ToLocks) -> Self {
        Outgoing::Locks(m)
    }
}
