//! The actix layer: the only part of proctor that knows actix (and tokio, and threads).
//!
//! Each handler decodes a message, asks the pure core in `src/` what to do, and performs
//! the effects. See `ARCHITECTURE.md` for who sends what to whom.

#[cfg(feature = "postgres")]
pub(crate) mod cluster;
mod crash_test;
mod executor;
mod guard;
mod lent;
mod locks;
pub mod metrics;
mod persistence;
pub use persistence::CommitStats;
pub mod perturb;
#[cfg(feature = "postgres")]
pub(crate) mod pg_store;
mod procedure;
mod protocol;
pub(crate) mod recover;
pub(crate) mod remote;
mod root_stack;
mod scheduler;
mod shard;
mod shared;
#[cfg(feature = "simulation")]
pub mod simulation;
mod wal_store;

#[cfg(feature = "postgres")]
pub use cluster::{Cluster, ClusterBuilder, ClusterState, MemberState, MoveRecord, PartitionState};
pub use crash_test::{restart_at_every_write, CrashRun};
pub use executor::{
    Abort, AckResult, Bypass, EngineStatus, Executor, ExecutorActor, ExecutorBuilder,
    GetEngineStatus, GetLocks, GetState, GetTree, GetValue, List, ListPage, NonceRegistration,
    NonceReservation, Pause, ProcEvent, ProcInfo, ProcPage, RecentFailure, Recovery, Resume, Role,
    Rollback, Shutdown, Submission, Submit, Submitted, Subscribe, Subscription, TreeInfo, WaitFor,
    WaitValue, WaitingOn,
};
pub use locks::{ResetEvent, WakeEvent};
#[cfg(feature = "postgres")]
pub use pg_store::{Leadership, LeaseState, PgLease, PgOptions, PgStore};
pub use remote::{RemoteOptions, RemoveTarget, Report, Transport, TransportError};
pub use scheduler::{GetSchedulerStats, SchedulerStats, ShardLoad};
pub use wal_store::{
    scan_wal_dir, scan_wal_dir_on, scan_wal_dir_with, view_wal_dir, view_wal_dir_on, DirView,
    Entry, LockProbe, Repair, SegmentReport, StdFs, WalDirScan, WalFs, WalOptions, WalStats,
    WalStore, VIEW_ATTEMPTS,
};
