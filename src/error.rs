//! [`Error`]: what the executor's API answers when it cannot do what was asked.

use crate::procedure::{ProcId, ProcState};
use crate::record::Nonce;
use crate::registry::RegistryError;
use crate::store::StoreError;

/// An error from the executor's API (not a procedure's failure: that is a
/// [`Failure`](crate::Failure), the `Err` of a finished procedure's result).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// This store never handed out this id.
    #[error("unknown procedure {0}")]
    UnknownProcedure(ProcId),
    /// The id was handed out, but the procedure is no longer known: its tree finished
    /// and its result was evicted (see
    /// [`ExecutorBuilder::retention`](crate::ExecutorBuilder::retention)), or it was a
    /// child procedure and has finished (a child is forgotten as it finishes, whether
    /// its tree still runs or has finished too), or its submit never became durable.
    #[error("procedure {0} is gone: its result was evicted, it was a child procedure and has finished (its tree may still be running), or its submit never became durable")]
    Gone(ProcId),
    /// The procedure's value does not decode as the type asked for.
    #[error("the value of procedure {id} does not decode as the type asked for: {reason}")]
    ValueType {
        /// The procedure.
        id: ProcId,
        /// The decoder's complaint.
        reason: String,
    },
    /// A bypass was refused; `reason` says why (it has already finished, it is in a
    /// step, it has unfinished children and the bypass was not recursive, its tree is
    /// rolling back).
    #[error("bypass of procedure {id} refused: {reason}")]
    BypassRefused {
        /// The procedure.
        id: ProcId,
        /// Why.
        reason: String,
    },
    /// An operator's command (continue, rollback, abort) was refused in the
    /// procedure's state; the reason says why.
    #[error("{command} of procedure {id} refused: {reason}")]
    Refused {
        /// The command.
        command: &'static str,
        /// The procedure.
        id: ProcId,
        /// Why.
        reason: String,
    },
    /// The procedure has not finished yet: it has no result to read or acknowledge.
    #[error("procedure {0} has not finished yet")]
    NotFinished(ProcId),
    /// The procedure has finished; it can no longer be aborted.
    #[error("procedure {id} has already finished ({state})")]
    Finished {
        /// The procedure.
        id: ProcId,
        /// Its final state.
        state: ProcState,
    },
    /// Only root procedures have results to wait for.
    #[error("procedure {id} is not a root procedure; wait for its root {root}")]
    NotRoot {
        /// The procedure asked about.
        id: ProcId,
        /// The root of its tree.
        root: ProcId,
    },
    /// The procedure's type cannot be persisted.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The store failed; the engine acknowledges nothing more.
    #[error("store failed: {0}")]
    Store(String),
    /// The engine broke one of its own invariants (a bug, or a log it could not
    /// detect as damaged); it stopped accepting work rather than carry on wrong.
    #[error("engine invariant broken, the executor stopped: {0}")]
    Internal(String),
    /// The executor (or its actor system) has stopped.
    #[error("the executor has stopped")]
    Stopped,
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The submitted procedure cannot run as declared (e.g. a bad resource name in its
    /// locks, or a panic in a declaration hook).
    #[error("procedure refused: {0}")]
    Invalid(String),
    /// The executor already has as many unfinished root procedures as it was configured
    /// to accept ([`ExecutorBuilder::max_unfinished`](crate::ExecutorBuilder::max_unfinished));
    /// the submit was refused at once. Retry later.
    #[error("executor overloaded: {limit} root procedures are unfinished, the configured bound")]
    Overloaded {
        /// The configured bound.
        limit: usize,
    },
    /// This executor is not (or no longer) the leader: a standby waiting for the leader
    /// lease, or a leader that lost it (a renewal found a newer holder, or none
    /// succeeded in time) and stepped down, so it runs and acknowledges nothing more.
    /// Send the request to the leader, `leader` when the lease names one.
    #[error("not the leader: {reason}{}", leader_named(leader.as_deref()))]
    NotLeader {
        /// Why it is not.
        reason: String,
        /// The lease's holder as this executor last saw it, if any.
        leader: Option<String>,
    },
    /// A submit named a nonce already used for another submission: a procedure of
    /// another type, or with other arguments (another initial state), than `existing`
    /// was submitted with. Nothing was submitted. A retry of a request submits the same
    /// procedure with the same arguments (and gets `existing`'s id); a new request
    /// needs a new nonce.
    #[error("nonce {}:{} was used for procedure {existing}, submitted with another procedure type or other arguments than this submit's: a retry submits the same procedure with the same arguments, a new request needs a new nonce", .nonce.group, .nonce.nonce)]
    NonceConflict {
        /// The nonce.
        nonce: Nonce,
        /// The root the nonce was first used for.
        existing: ProcId,
    },
}

/// `NotLeader`'s pointer to the leader.
fn leader_named(leader: Option<&str>) -> String {
    leader.map_or_else(String::new, |l| format!(" (the leader is {l})"))
}

impl Error {
    /// The same error for another waiter. The variants an executor hands to many
    /// waiters copy exactly; the others (never shared) keep their text.
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::UnknownProcedure(id) => Error::UnknownProcedure(*id),
            Error::Gone(id) => Error::Gone(*id),
            Error::NotFinished(id) => Error::NotFinished(*id),
            Error::BypassRefused { id, reason } => Error::BypassRefused {
                id: *id,
                reason: reason.clone(),
            },
            Error::Refused {
                command,
                id,
                reason,
            } => Error::Refused {
                command,
                id: *id,
                reason: reason.clone(),
            },
            Error::ValueType { id, reason } => Error::ValueType {
                id: *id,
                reason: reason.clone(),
            },
            Error::Finished { id, state } => Error::Finished {
                id: *id,
                state: *state,
            },
            Error::NotRoot { id, root } => Error::NotRoot {
                id: *id,
                root: *root,
            },
            Error::Store(s) => Error::Store(s.clone()),
            Error::Internal(s) => Error::Internal(s.clone()),
            Error::Stopped => Error::Stopped,
            Error::Config(s) => Error::Config(s.clone()),
            Error::Invalid(s) => Error::Invalid(s.clone()),
            Error::Overloaded { limit } => Error::Overloaded { limit: *limit },
            Error::NotLeader { reason, leader } => Error::NotLeader {
                reason: reason.clone(),
                leader: leader.clone(),
            },
            Error::Registry(e) => Error::Config(e.to_string()),
            Error::NonceConflict { nonce, existing } => Error::NonceConflict {
                nonce: *nonce,
                existing: *existing,
            },
        }
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Store(e.to_string())
    }
}

/// Why [`Executor::wait_value`](crate::Executor::wait_value) (or the
/// [`WaitValue`](crate::WaitValue) message) gives no value: the tree failed, the root
/// set none, the procedure is gone, or the engine could not answer.
///
/// ```no_run
/// # async fn f(executor: proctor::Executor, id: proctor::ProcId) {
/// use proctor::WaitError;
/// match executor.wait_value::<u32>(id).await {
///     Ok(regions) => println!("created with {regions} regions"),
///     Err(WaitError::Failed(failure)) => println!("rolled back: {failure}"),
///     Err(WaitError::Gone(id)) => println!("{id} is no longer known"),
///     Err(e) => println!("could not wait: {e}"),
/// }
/// # }
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// The tree rolled back: its original failure.
    #[error(transparent)]
    Failed(crate::record::Failure),
    /// The root succeeded without setting a value
    /// ([`Context::set_result`](crate::Context::set_result)).
    #[error("procedure {0} succeeded and set no value")]
    NoValue(ProcId),
    /// The procedure is not known any more: its result was evicted (see
    /// [`ExecutorBuilder::retention`](crate::ExecutorBuilder::retention)), it was a
    /// child procedure and has finished (its tree still running or finished too), or
    /// its submit never became durable.
    #[error("procedure {0} is gone: its result was evicted, it was a child procedure and has finished (its tree may still be running), or its submit never became durable")]
    Gone(ProcId),
    /// The engine could not answer (an id never issued, a child's id, a value that
    /// does not decode as the type asked for, a store failure, a stopped executor).
    #[error(transparent)]
    Engine(Error),
}

impl From<Error> for WaitError {
    fn from(e: Error) -> Self {
        match e {
            Error::Gone(id) => WaitError::Gone(id),
            e => WaitError::Engine(e),
        }
    }
}
