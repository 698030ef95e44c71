//! The persisted form of a procedure: [`ProcRecord`], and the operations a store applies,
//! [`StoreOp`].
//!
//! A record is a full snapshot: the latest record of a procedure is all recovery needs
//! to rebuild it (its tree position, root-stack indexes, waits and failure), with the
//! user's state as opaque MessagePack bytes decoded through the
//! [`Registry`](crate::Registry).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::procedure::{ProcError, ProcId, ProcState};

/// Which procedure failed, and why: the result of a failed tree, kept as the root's
/// result through the whole rollback.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("procedure {proc} ({type_name}) failed: {error}")]
pub struct Failure {
    /// The procedure whose step (or abort, or timeout) failed first.
    pub proc: ProcId,
    /// Its registered type name.
    pub type_name: String,
    /// The original error.
    pub error: ProcError,
}

/// One procedure as the store keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcRecord {
    /// The procedure.
    pub id: ProcId,
    /// Its parent, `None` for a root.
    pub parent: Option<ProcId>,
    /// The root of its tree (itself for a root).
    pub root: ProcId,
    /// The registered type name of `data`.
    pub type_name: String,
    /// Its state when the record was written.
    pub state: ProcState,
    /// Its positions on the root stack, one per executed step not yet rolled back.
    pub stack_indexes: Vec<u32>,
    /// Why it failed; for a finished root, why its tree failed.
    pub failure: Option<Failure>,
    /// For a procedure that failed: the order of its failure among the failures of its
    /// tree (0 for the first), as its root stack recorded them. Recovery takes the
    /// smallest as the tree's result: order comes from the log, never from a clock.
    pub failure_seq: Option<u64>,
    /// When it was submitted, in ms since the Unix epoch.
    pub submitted_ms: u64,
    /// When this record was made, in ms since the Unix epoch.
    pub updated_ms: u64,
    /// For WAITING_TIMEOUT: when to wake, in ms since the Unix epoch.
    pub wake_at_ms: Option<u64>,
    /// For a procedure suspended on an event: the event's name.
    pub event: Option<String>,
    /// The procedure's encoded state.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// A change to the store. Ops are applied in order; see
/// [`ProcedureStore::append`](crate::ProcedureStore::append) for atomicity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StoreOp {
    /// A new procedure (a submitted root or a child).
    Insert(ProcRecord),
    /// A newer snapshot of a known procedure.
    Update(ProcRecord),
    /// The procedure is gone (a finished tree's children, or an evicted root).
    Delete(ProcId),
}

impl StoreOp {
    /// Replays the op onto the latest record per procedure: inserts and updates replace,
    /// a delete removes.
    pub fn apply_to(self, latest: &mut BTreeMap<ProcId, ProcRecord>) {
        match self {
            StoreOp::Insert(r) | StoreOp::Update(r) => {
                latest.insert(r.id, r);
            }
            StoreOp::Delete(id) => {
                latest.remove(&id);
            }
        }
    }

    /// The procedure the op is about.
    pub fn proc_id(&self) -> ProcId {
        match self {
            StoreOp::Insert(r) | StoreOp::Update(r) => r.id,
            StoreOp::Delete(id) => *id,
        }
    }
}
