//! The WAL's byte format and the recovery planner, for the `proctor` command and the
//! project's own tests and benchmarks. Not a stable API: they change with the log
//! format; a service needs only [`WalStore`](crate::WalStore) and
//! [`Executor`](crate::Executor).

#[path = "recovery.rs"]
pub mod recovery;
#[path = "wal.rs"]
pub mod wal;

/// [`recovery::plan`] of a store's parts ([`ProcedureStore::load_parts`](crate::ProcedureStore::load_parts)) on every core, as the executor plans its recovery.
pub use crate::actors::recover::plan as plan_recovery;
