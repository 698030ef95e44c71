//! The executor: the engine's public address. [`ExecutorBuilder`] configures and starts
//! it; [`Executor`] is a cheap, `Send` handle with async methods; [`ExecutorActor`] takes
//! the same requests as messages ([`Submit`], [`Abort`], [`GetState`], [`WaitFor`],
//! [`List`], [`WakeEvent`]) for code that talks to actors.
//!
//! The executor itself does little: it names and encodes a submitted procedure, starts
//! its tree on one of the arbiters' shards, and answers once the tree's root stack has
//! made the insert durable. It keeps the waiters for results.
//!
//! Users reach it through the crate's re-exports; `crash_test.rs` starts engines with
//! the builder. Its parts: `builder.rs` (the options and the start) with `recovered.rs`
//! (what the start makes of the store), `handle.rs` (the handle), `front.rs` (what the
//! handle sends to: the actor, or a standby's wait for the lease), `api.rs` (the
//! messages the actor takes), `actor.rs` (the actor, submits, commands, the cleaner)
//! with `queries.rs`, `shutdown.rs` and `leader.rs` (its other handlers), and
//! `nonces.rs` (nonce reservations: their messages and handlers). The invariants they guard together: a
//! submit is answered only once its insert is durable, the executor handles no request
//! before every recovered tree is on its shard, and once a shutdown has answered nothing
//! of the engine runs.
//!
//! [`WakeEvent`]: super::scheduler::WakeEvent

mod actor;
mod api;
mod builder;
mod front;
mod handle;
mod leader;
mod nonces;
mod queries;
mod recovered;
mod shutdown;

pub use actor::ExecutorActor;
pub use api::{
    Abort, AckResult, Bypass, EngineStatus, GetEngineStatus, GetLocks, GetState, GetTree, GetValue,
    List, ListPage, Pause, ProcEvent, ProcInfo, ProcPage, RecentFailure, Resume, Rollback,
    Shutdown, Submit, Subscribe, TreeInfo, WaitFor, WaitValue, WaitingOn,
};
pub(crate) use api::{TreeFinished, TreeNews};
pub use builder::ExecutorBuilder;
pub use handle::{Executor, Submission, Submitted, Subscription};
pub use leader::Role;
pub use nonces::{NonceRegistration, NonceReservation};
pub use recovered::Recovery;
