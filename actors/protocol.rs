//! The messages that cross actors: the ordering rule of each group, and the messages
//! themselves, re-exported from beside the actor that receives each (each actor's
//! module ends with the messages it receives). A sender names a message from here.
//! actix delivers the messages of one mailbox in the order they were sent and promises
//! nothing across mailboxes; every rule here is one the senders keep (see also
//! `ARCHITECTURE.md`, "Protocol"). `tests/protocol.rs` pins each rule with the race that
//! broke it, and `tests/perturbation.rs` checks them all on random workloads.
//!
//! Every message to a tree goes through its shard (`shard.rs`), which forwards it to the
//! tree's root-stack actor (starting one for a passivated tree), and what a shard's trees
//! send the scheduler, the lock actor and the persistence actor is gathered and sent in
//! batches that keep the order it was made in (`Mail`, `FromShard`, `LocksFromShard`,
//! `ToPersistence`), so every rule below holds per tree, one sender at a time.
//!
//! The public messages a caller sends (`Submit`, `Abort`, `GetState`, `WaitFor`, `List`,
//! `WakeEvent`) live in `executor/api.rs` and `locks.rs` beside the API they mirror.
//!
//! ## Scheduler <-> root stack <-> procedure actor: one step
//!
//! Enqueue (root stack -> its shard's scheduler, or the lock actor when the step needs
//! locks) is sent only once the transition that caused it is durable and performed, so
//! the step's RunStep reaches the root stack after the transition's actions (the step's
//! actor started, for a new child). RunStep (scheduler -> the procedure) counts against
//! a worker. It goes straight to the procedure's actor (DirectStep) when the root stack
//! named the actor in the Enqueue (the actor runs, the procedure declares no locks, its
//! step sees no children); a straight step the actor does not take goes back through
//! the tree as it drops, and one it took is named in its Exited. Otherwise it goes
//! through the tree's shard as a ToProc and its root stack, which forwards it to the
//! procedure's actor, starting one if the procedure waited. Every RunStep
//! is answered by exactly one StepDone (the procedure actor's report), and the root
//! stack frees the worker (StepFinished -> scheduler) only after feeding that report to
//! the core and queueing its records (Persist) and any Enqueue it caused without a
//! write. A worker is handed on only once its step is recorded. The scheduler times
//! each step from its RunStep to its StepFinished and charges it to the step's tree
//! (the Enqueue names the root), and tells the lock actor when a step that held
//! per-step locks finished; when a tree ends its actor queues the tree's TreeEnded in
//! the shard's outbox, after every StepFinished the tree sent (a runner dropped another
//! way sends it from its Drop), and the scheduler then drops the tree's accumulated
//! time, and, when the root stack says steps may be out (it died of a panic in engine
//! code, and the steps' calls with it), frees the worker of any step of the tree still
//! running.
//!
//! Messages: `Enqueue`, `StepFinished`, `TreeEnded` (`scheduler.rs`); `RunStep`,
//! `DirectStep` (`procedure/`); `ToProc`, `StepDone` (`root_stack/`).
//!
//! ## Locks: the lock actor owns the lock table
//!
//! A step's lock request rides on its Enqueue, sent to the lock actor; the step goes to
//! its scheduler's ready queue (Granted) only once granted, so a waiting procedure
//! holds no worker. Locks for one step are released when that step's StepFinished
//! reaches its scheduler (ReleaseLocks with Release::Step, scheduler -> lock actor); an
//! Enqueue that arrives while the previous step still holds them (a yield's, the next
//! step's) waits for it. Locks for a procedure's life are first granted to a step as
//! LocksGranted (-> procedure), answered with LocksHeld (its report), which persists
//! the hold and only then sends Resume's Enqueue: no step runs under a life-long lock
//! before recovery would grant it back. A rollback step's locks are asked with
//! LockForRollback; the lock actor has the tree's scheduler post the Rollback once
//! granted, and the procedure releases them with ReleaseLocks after the call, or
//! instead of it when its acquire_lock hook yields (and everything when it stops,
//! before the tree's result). TreeFailed withdraws the tree's waiting step requests
//! (those steps are skipped anyway), WithdrawStep one procedure's (its cell failed past
//! the point of no return, so the step comes back skipped and it pauses); a deadlock
//! victim gets LockFailed and then its step, which it skips.
//!
//! Messages: `LockForRollback`, `ReleaseLocks`, `Release`, `TreeFailed`,
//! `TreeIrreversible`, `WithdrawStep`, `Regrant`, `SuspendOn`, `Unsuspend`
//! (`locks.rs`); `LocksGranted`, `LockFailed` (`procedure/`); `LocksHeld`
//! (`root_stack/`).
//!
//! ## Root stack -> procedure: rollback, stop
//!
//! A rollback is started only when nothing of the tree runs, newest stack entry first,
//! and is answered by RolledBack. A finished procedure is stopped (its engine locks
//! released by its root stack at once; its user lock and cleanup by its actor, which
//! answers Stopped) when its final record is durable, before the tree's result is
//! published.
//!
//! Messages: `Rollback` (`procedure/`); `RolledBack`, `PauseNow` (`root_stack/`); the
//! procedure actor's own `ProcMsg` (`procedure/`) and `FromProc` (`root_stack/`).
//!
//! ## Aborts: executor -> root stack -> procedure -> root stack
//!
//! AbortRequest goes to the tree's root stack, which sends it on to the live
//! procedure's actor. Its cell asks the abort hook between calls (settling aborts that
//! arrive during a call when the call ends) and reports FailRequest with the answer
//! channel; the root stack answers only once the failure, and everything it did before,
//! is durable. The answer never runs ahead of the log.
//!
//! Messages: `AbortRequest`, `AbortAck`, `AckWith`, `FailRequest`, `BypassRequest`,
//! `CommandRequest`, `Command` (`root_stack/`).
//!
//! ## Wake-ups and deadlines
//!
//! A procedure's deadline timer is its root stack's (one `run_later` per armed
//! deadline, so a waiting procedure needs no actor for it); when it fires the root
//! stack sends the procedure a Timeout, and its cell asks the timeout hook only between
//! calls. A kept-going procedure sends Deadline with its new deadline and state; the
//! root stack persists it and arms the new deadline's timer. A timer may fire before
//! that record is durable: a crash then brings back the old deadline and the old state,
//! which expire again at once, so the hook runs again from the state it last saw
//! durable.
//!
//! Messages: `Wake`, `Deadline` (`root_stack/`).
//!
//! ## Root stack -> persistence actor (the group commit), root stack -> executor
//!
//! Persist is answered after its batch is durable, in the order the appends arrived;
//! after a failed append every later one fails too (Refuse forces that state). A root
//! stack's Persist is answered with a Durable message naming its transition (so the
//! answers reach it in the order it sent the appends), the cleaner's on a channel; an
//! answer dropped unsent is an Error::Stopped. A root stack sends TreeFinished once:
//! its result (after its finished procedures were stopped, and after its actor told its
//! shard it is gone), or the error that halted it; on the first error the executor
//! answers every waiter.
//!
//! Messages: `Persist`, `DurableAck`, `TreeAck`, `Refuse`, `StopWriter`,
//! `ToPersistence` (`persistence.rs`); `Durable`, `Quiesce` (`root_stack/`);
//! `TreeFinished`, `TreeNews` (`executor/actor.rs`).
//!
//! ## A graceful shutdown
//!
//! Executor -> root stack (`Quiesce`), once no call into user code runs.
//!
//! ## Subscriptions
//!
//! Root stack -> executor (`TreeNews`), in order with the tree's `TreeFinished`.
//!
//! ## Operators' questions
//!
//! Read-only, answered at once from the receiver's own state, and never ordered with
//! anything else: executor -> root stack (`Describe`: the execution stack and the
//! rollback so far, as the core holds them when the message is handled); executor ->
//! lock actor (`GetLockReport`: resources, queues, cycles); executor -> persistence
//! actor (`GetStoreStatus`), which hands it to the writer thread behind the batches
//! already handed over, so the store is asked between appends and a slow append delays
//! the answer, never a batch. A tree that finishes before its `Describe` is handled
//! drops the answer (the caller hears `Finished`, as if it had asked later).
//!
//! Messages: `Describe` (`root_stack/`), `GetLockReport` (`locks.rs`),
//! `GetStoreStatus` (`persistence.rs`).
//!

use actix::prelude::*;

use crate::procedure::ProcId;

use super::locks::LockActor;
use super::perturb;
use super::procedure::{DirectStep, ProcMsg, ProcedureActor};
use super::scheduler::SchedulerActor;
use super::shard::{Mail, TreeHandle};

pub(crate) use super::executor::{TreeFinished, TreeNews};
pub(crate) use super::locks::{
    LockForRollback, Regrant, Release, ReleaseLocks, SuspendOn, TreeFailed, TreeIrreversible,
    Unsuspend, WithdrawStep,
};
pub(crate) use super::persistence::{
    DurableAck, Persist, Refuse, StopWriter, ToPersistence, TreeAck,
};
pub(crate) use super::procedure::{LockFailed, LocksGranted, Outbox, Rollback, RunStep, ToCell};
pub(crate) use super::root_stack::{
    AbortAck, AbortRequest, AckWith, BypassRequest, Command, CommandRequest, Deadline, Durable,
    FailRequest, LocksHeld, PauseNow, Quiesce, Report, RolledBack, StepDone, ToProc, Wake,
};
pub(crate) use super::scheduler::{Enqueue, StepFinished, TreeEnded};

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
    /// The procedure's actor, when its root stack queued a step it may be sent
    /// straight ([`ProcAddr::run`]).
    actor: Option<std::sync::Arc<Addr<ProcedureActor>>>,
}

impl ProcAddr {
    pub(crate) fn new(tree: TreeAddr, id: ProcId) -> Self {
        ProcAddr {
            tree,
            id,
            actor: None,
        }
    }

    /// The same, with the actor its queued step goes straight to.
    pub(crate) fn with_actor(mut self, actor: std::sync::Arc<Addr<ProcedureActor>>) -> Self {
        self.actor = Some(actor);
        self
    }

    /// Whether its step goes straight to the procedure's actor.
    #[cfg(test)]
    pub(crate) fn straight(&self) -> bool {
        self.actor.is_some()
    }

    /// Sends the procedure its `step`: straight to its actor if its root stack named
    /// one, else through its tree, in `mail`.
    pub(crate) fn run(self, mail: &mut Mail, step: usize) {
        match self.actor {
            Some(actor) => {
                perturb::point("protocol::run::direct");
                actor.do_send(ProcMsg::Direct(DirectStep::new(self.tree, self.id, step)));
            }
            None => self.post(
                mail,
                RunStep {
                    step,
                    children: None,
                },
            ),
        }
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
