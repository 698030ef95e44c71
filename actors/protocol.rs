//! The messages that cross actors, re-exported from beside the actor that receives each
//! (each actor's module ends with the messages it receives), so a sender names a
//! message from here; with them `TreeAddr` and `ProcAddr`, which every queued step
//! carries, and the batches a shard's trees send their scheduler and the lock actor
//! (`FromShard` of `ToScheduler`, `LocksFromShard` of `ToLocks`, routed by `Outgoing`).
//!
//! Who may send what, before what, is written once, in `ARCHITECTURE.md`, "Protocol":
//! each ordering rule there, with the tests that pin it.
//!
//! The messages by group, and where each is defined:
//!
//! - Shards: `ToTree`, `ToTrees`, `Quiet`, `Passivated`, `Gone`, `FlushOut`
//!   (`shard.rs`); `Deliver`, `Passivate` (`root_stack/`); the batches `FromShard`,
//!   `LocksFromShard` (here) and `ToPersistence` (`persistence.rs`).
//! - Scheduler <-> root stack <-> procedure actor, one step: `Enqueue`, `StepFinished`,
//!   `TreeEnded` (`scheduler.rs`); `RunStep`, `DirectStep` (`procedure/`); `ToProc`,
//!   `StepDone` (`root_stack/`).
//! - Locks: `LockForRollback`, `ReleaseLocks`, `Release`, `TreeFailed`,
//!   `TreeIrreversible`, `WithdrawStep`, `Regrant`, `SuspendOn`, `Unsuspend`
//!   (`locks.rs`); `Granted` (`scheduler.rs`); `LocksGranted`, `LockFailed`
//!   (`procedure/`); `LocksHeld` (`root_stack/`).
//! - Root stack -> procedure, rollback and stop: `Rollback`, and the procedure actor's
//!   own `ProcMsg` (`procedure/`); `RolledBack`, `PauseNow`, and its `FromProc`
//!   (`root_stack/`).
//! - Aborts and operator commands: `AbortRequest`, `AbortAck`, `AckWith`, `FailRequest`,
//!   `BypassRequest`, `CommandRequest`, `Command` (`root_stack/`).
//! - Wake-ups and deadlines: `Wake`, `Deadline` (`root_stack/`).
//! - Root stack -> persistence actor, root stack -> executor: `Persist`, `DurableAck`,
//!   `TreeAck`, `Refuse` (`persistence.rs`); `Durable` (`root_stack/`); `TreeFinished`
//!   (`executor/api.rs`).
//! - A graceful shutdown, and the stop: `Quiesce` (`root_stack/`), `StopWriter`
//!   (`persistence.rs`), `StopLocks` (`locks.rs`).
//! - Subscriptions: `TreeNews` (`executor/api.rs`).
//! - Operators' questions: `Describe` (`root_stack/`), `GetLockReport` (`locks.rs`),
//!   `GetStoreStatus` (`persistence.rs`).
//! - Remote operations: `Dispatch`, `CancelOp`, `SettleOp`, `DispatchUndo`, `Report`,
//!   `RemoveTarget` (`remote.rs`; the dispatcher answers `SettleOp` and
//!   `DispatchUndo` on a oneshot channel), `WakeEvent` and `ResetEvent` (`locks.rs`).
//! - The public messages a caller sends: `Submit`, `Abort`, `GetState`, `WaitFor`,
//!   `List` (`executor/api.rs`), `WakeEvent` (`locks.rs`), beside the API they mirror.

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

/// Where a procedure is reached: through its tree's root stack ([`ToProc`]), or, for a
/// step its root stack let go straight, at its actor. Every queued step carries one.
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
