//! proctor: a durable, actor-model procedure engine. The guide below is the crate's
//! front page; the repository's `ARCHITECTURE.md` describes the two layers (the pure
//! core in `src/`, the actix actors in `actors/`) and their invariants.
// The quickstart package compiles these sources without the tests' dependencies: as a
// test target there (`cargo test --lib` selects every library) it is empty.
#![cfg(not(all(test, proctor_quickstart)))]
#![warn(
    missing_debug_implementations,
    missing_docs,
    clippy::missing_errors_doc,
    clippy::missing_panics_doc
)]
#![doc = include_str!("guide.md")]

mod cancel;
mod cluster;
mod crash_store;
mod dag;
mod erased;
mod error;
mod events;
mod fast_map;
mod locks;
mod mlfq;
#[cfg(feature = "simulation")]
mod mutation;
mod output;
mod policy;
mod procedure;
mod ready_queue;
mod record;
mod registry;
mod remote;
mod root_stack;
mod saga;
mod state_machine;
pub mod store;
mod targets;
mod workers;

#[path = "../actors/mod.rs"]
mod actors;

/// The operator's web page: see its module docs.
#[cfg(feature = "admin")]
#[path = "../admin/mod.rs"]
pub mod admin;

/// Seeded perturbation of the actor protocol for randomized tests (the `perturb`
/// feature): [`perturb::set_seed`] makes rare interleavings common.
#[cfg(feature = "perturb")]
pub use crate::actors::perturb;
#[cfg(feature = "simulation")]
pub use crate::actors::simulation;

pub use async_trait::async_trait;

pub mod ops;
pub(crate) use ops::{recovery, wal};

/// Tools for testing your procedures against crashes, as HBase's
/// `ProcedureTestingUtility` does for its users: [`testing::CrashingStore`] wraps any
/// store and "crashes" at a chosen write, leaving exactly what a process killed just
/// before or just after that write would leave, and [`testing::restart_at_every_write`]
/// runs a procedure through a crash at each of its writes and a restart after it.
pub mod testing {
    pub use crate::actors::{restart_at_every_write, CrashRun};
    pub use crate::crash_store::{CrashPoint, CrashingStore};
}

/// The names of the engine's metrics (recorded through the `metrics` facade) and what
/// each one measures.
pub use crate::actors::metrics;

/// The messages the executor's actor ([`ExecutorActor`]) takes, for code that holds its
/// address (`Executor::addr`), as an actix service sends to its own actors: each is
/// what one of [`Executor`]'s methods sends, answered with what that method returns.
///
/// ```
/// use proctor::messages::{Pause, Resume};
/// # async fn steer(executor: proctor::Executor, id: proctor::ProcId) -> Result<(), proctor::Error> {
/// let addr = executor.addr()?;
/// addr.send(Pause(id)).await??; // `executor.pause(id)`
/// addr.send(Resume(id)).await??; // `executor.resume(id)`
/// # Ok(()) }
/// ```
pub mod messages {
    pub use crate::actors::{
        Abort, AckResult, Bypass, GetEngineStatus, GetLocks, GetSchedulerStats, GetState, GetTree,
        GetValue, Pause, RemoveTarget, ResetEvent, Resume, Rollback, Shutdown, Submit, Subscribe,
        WaitFor, WakeEvent,
    };
}

#[cfg(feature = "postgres")]
pub use crate::actors::{
    Cluster, ClusterBuilder, ClusterState, Leadership, LeaseState, MemberState, MoveRecord,
    PartitionState, PgLease, PgOptions, PgStore,
};
pub use crate::actors::{
    CommitStats, EngineStatus, Executor, ExecutorActor, ExecutorBuilder, List, ListPage,
    NonceRegistration, NonceReservation, ProcEvent, ProcInfo, ProcPage, RecentFailure, Recovery,
    Role, SchedulerStats, ShardLoad, Submission, Submitted, Subscription, TreeInfo, WaitValue,
    WaitingOn, WalOptions, WalStats, WalStore,
};
/// The pure rules of a cluster: a key's partition, an id's partition.
pub mod partitions {
    pub use crate::cluster::{partition_of_id, partition_of_key};
}
pub use crate::actors::{RemoteOptions, Report, Transport, TransportError};
pub use crate::cancel::{Cancel, CancelReason, Cancelled};
pub use crate::dag::{Dag, DagBuilder, DagError, DagTask, Task, TaskId, TaskStatus};
pub use crate::error::{Error, WaitError};
pub use crate::locks::{Lock, LockClaim, LockCycle, LockMode, LockReport, ResourceLocks, WaitEdge};
#[doc(inline)]
pub use crate::ops::recovery::CorruptProc;
pub use crate::output::ProducesOutput;
pub use crate::procedure::{
    ChildType, Context, EncodeState, ErrorKind, FailurePolicy, Flow, LockState, OnTimeout,
    ProcError, ProcId, ProcState, Procedure, RetryPolicy, Undo, UnknownState,
};
pub use crate::ready_queue::Scheduling;
pub use crate::record::{Failure, Nonce, Paused};
pub use crate::registry::{Registry, RegistryError};
pub use crate::remote::{BatchRules, Dispatched, OpId, RemoteError, RemoteResult, REMOTE_CALL};
pub use crate::saga::{Saga, SagaContext, SagaProcedure, SagaStep, Undoing};
pub use crate::state_machine::{StateContext, StateMachine, StateMachineProcedure};
pub use crate::store::{MemoryStore, ProcedureStore, StoreError, StoreStatus};

/// Names the environment once: `proctor::environment!(Cluster);` in a module declares
/// `Context`, `Flow`, `StateContext<'_, S>`, `SagaContext<'_>`, `Registry` and
/// `Executor` there as proctor's types for the environment `Cluster`, so the module's
/// signatures read `ctx: &mut Context` and `Result<Flow, ProcError>` instead of
/// `Context<Cluster>` and `Flow<Cluster>` (the `impl Procedure<Cluster>` line still
/// names it). `environment!(pub Cluster)` makes the aliases public.
///
/// ```
/// use proctor::{async_trait, ProcError, Procedure};
/// use std::sync::Arc;
///
/// pub struct Cluster { pub name: String }
/// proctor::environment!(Cluster);
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct CreateTable { table: String }
///
/// #[async_trait]
/// impl Procedure<Cluster> for CreateTable {
///     async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
///         assert_eq!(ctx.env().name, "c1");
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
///         Ok(())
///     }
/// }
///
/// # #[actix::main] async fn main() -> Result<(), proctor::Error> {
/// let mut registry = Registry::new();
/// registry.register::<CreateTable>("create_table");
/// let executor: Executor = Executor::builder()
///     .registry(registry)
///     .env(Arc::new(Cluster { name: "c1".into() }))
///     .store(proctor::MemoryStore::new())
///     .start()
///     .await?;
/// let id = executor.submit(CreateTable { table: "users".into() }).await?;
/// assert_eq!(executor.wait(id).await?, Ok(()));
/// # executor.shutdown().await }
/// ```
#[macro_export]
macro_rules! environment {
    ($vis:vis $env:ty) => {
        /// A step's context in this environment ([`proctor::Context`]).
        #[allow(dead_code)]
        $vis type Context = $crate::Context<$env>;
        /// What a step returns in this environment ([`proctor::Flow`]).
        #[allow(dead_code)]
        $vis type Flow = $crate::Flow<$env>;
        /// A state machine's step context in this environment.
        #[allow(dead_code)]
        $vis type StateContext<'c, S> = $crate::StateContext<'c, S, $env>;
        /// A saga's context in this environment.
        #[allow(dead_code)]
        $vis type SagaContext<'c> = $crate::SagaContext<'c, $env>;
        /// The registry of this environment's procedures.
        #[allow(dead_code)]
        $vis type Registry = $crate::Registry<$env>;
        /// An executor of this environment's procedures.
        #[allow(dead_code)]
        $vis type Executor = $crate::Executor<$env>;
    };
}

/// The README's examples compile and run as doc tests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
