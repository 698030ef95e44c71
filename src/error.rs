//! [`Error`]: what the executor's API answers when it cannot do what was asked.

use crate::procedure::{ProcId, ProcState};
use crate::registry::RegistryError;
use crate::store::StoreError;

/// An error from the executor's API (not a procedure's failure: that is a
/// [`Failure`](crate::Failure), the `Err` of a finished procedure's result).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No procedure with this id exists (or it was a child of a tree that finished).
    #[error("unknown procedure {0}")]
    UnknownProcedure(ProcId),
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
    /// The executor (or its actor system) has stopped.
    #[error("the executor has stopped")]
    Stopped,
    /// Bad configuration.
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        Error::Store(e.to_string())
    }
}
