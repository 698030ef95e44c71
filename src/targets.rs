//! The log targets the engine's lines and spans go to, named for what logs rather than
//! for the module that logs it (`RUST_LOG=proctor::tree=debug`, say).

/// The executor: start, drain and stop, leading and stepping down, nonces, evictions.
pub(crate) const EXECUTOR: &str = "proctor::executor";
/// A procedure: its spans and the calls into user code (failed steps, accepted aborts,
/// timeouts, panics).
pub(crate) const PROCEDURE: &str = "proctor::procedure";
/// A tree: submits, its steps, rollbacks, retries, operator commands and result.
pub(crate) const TREE: &str = "proctor::tree";
/// Supervision: procedure actors started again after they stopped unasked, and those
/// given up past the restart limit.
pub(crate) const SUPERVISION: &str = "proctor::supervision";
/// The schedulers: workers, stuck steps.
pub(crate) const SCHEDULER: &str = "proctor::scheduler";
/// The lock actor: grants, deadlocks, loans.
pub(crate) const LOCKS: &str = "proctor::locks";
/// The persistence actor's group commit, the PostgreSQL connection and the leader lease.
pub(crate) const STORE: &str = "proctor::store";
/// The write-ahead log.
pub(crate) const WAL: &str = "proctor::wal";
/// The remote dispatcher: requests, failures, reports.
pub(crate) const REMOTE: &str = "proctor::remote";
/// The admin page: operators' actions.
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) const ADMIN: &str = "proctor::admin";
