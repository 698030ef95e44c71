//! Operator tooling, what the `proctor` command is built on: reading a WAL directory
//! from outside an engine ([`scan_wal_dir`], [`view_wal_dir`] beside a running one,
//! [`Repair`]), the filesystem the WAL store goes through ([`WalFs`], [`StdFs`]), the
//! log's byte format ([`wal`]) and the recovery planner ([`recovery`]). Not a stable
//! API: it changes with the log format. A service needs none of it: a
//! [`WalStore`](crate::WalStore) and an [`Executor`](crate::Executor) are enough.

#[path = "recovery.rs"]
pub mod recovery;
#[path = "wal.rs"]
pub mod wal;

/// [`recovery::plan`] of a store's parts ([`ProcedureStore::load_parts`](crate::ProcedureStore::load_parts)) on every core, as the executor plans its recovery.
pub use crate::actors::recover::plan as plan_recovery;

pub use crate::actors::{
    scan_wal_dir, scan_wal_dir_on, scan_wal_dir_with, view_wal_dir, view_wal_dir_on, DirView,
    Entry, LockProbe, Repair, SegmentReport, StdFs, WalDirScan, WalFs, VIEW_ATTEMPTS,
};
