//! The executor's start: [`ExecutorBuilder`] with its options, and the start itself,
//! which loads the store, decodes what recovery carries on, starts the scheduler, the
//! arbiters and their shards, and creates the executor actor. Used by
//! [`Executor::builder`] and by `crash_test.rs`. The invariant it guards: every recovered
//! tree is on its shard, and every finished root's result in the table, before the
//! executor handles any request.

use std::collections::{HashSet, VecDeque};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::erased::AnyEnv;
use crate::error::Error;
use crate::fast_map::IdMap;
use crate::locks::Lock;
use crate::ready_queue::Scheduling;
use crate::registry::{Registry, Types};
use crate::store::ProcedureStore;

use crate::actors::locks::LockActor;
use crate::actors::persistence::PersistenceActor;
use crate::actors::scheduler::{share, Monitor, Queueing, SchedulerActor, SchedulerSetup};
use crate::actors::shard::{Shard, ShardPeers};
use crate::actors::shared::{Mandate, RestartLimit, SchedulerViews, ShardAddr, Shared};

use super::actor::ExecutorActor;
use super::api::Shutdown;
use super::front::Front;
use super::handle::{Executor, OwnedSystem};
use super::recovered::{keep_results, start_recovered, Recovered};
use crate::actors::remote::{AnyTransport, RemoteDispatcher, RemoteOptions, Transport, Typed};

/// Configuration of an executor, with defaults that suit a control plane.
///
/// ```
/// use proctor::{Executor, ExecutorBuilder, MemoryStore, Registry};
/// // Procedures without an environment (`Registry::new()` infers it from what it
/// // registers, and here nothing is).
/// let builder: ExecutorBuilder = Executor::builder()
///     .registry(Registry::new())
///     .store(MemoryStore::new())
///     .workers(32);
/// # let _ = builder;
/// ```
pub struct ExecutorBuilder<E = ()> {
    workers: usize,
    scheduling: Scheduling,
    reserved_workers: Option<usize>,
    system_workers: usize,
    arbiters: usize,
    store: Option<Box<dyn ProcedureStore>>,
    registry: Registry<E>,
    env: Option<Arc<E>>,
    permits: Vec<(String, u32)>,
    max_unfinished: usize,
    retention: Retention,
    monitor: Monitor,
    drain_timeout: Duration,
    restart_limit: RestartLimit,
    rollback_retries: u32,
    retry_policy: Option<crate::RetryPolicy>,
    /// The transport of remote operations, and how they are batched.
    remote: Option<(Arc<dyn AnyTransport>, RemoteOptions)>,
    /// The leader lease to hold, on the PostgreSQL store.
    #[cfg(feature = "postgres")]
    lease: Option<crate::actors::PgLease>,
    /// A standby's wait: told of the holders it sees, and ended by a stop.
    #[cfg(feature = "postgres")]
    standby: Option<Arc<dyn StandbyWait>>,
    /// The cluster partition this engine runs, and the ownership it runs it under.
    #[cfg(feature = "postgres")]
    pub(crate) grant: Option<crate::actors::cluster::Grant>,
}

impl<E> std::fmt::Debug for ExecutorBuilder<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorBuilder")
            .field("workers", &self.workers)
            .field("scheduling", &self.scheduling)
            .field("reserved_workers", &self.reserved_workers)
            .field("system_workers", &self.system_workers)
            .field("arbiters", &self.arbiters)
            .field("store", &self.store.as_ref().map(|_| "custom"))
            .field("registry", &self.registry)
            .field("env", &self.env.is_some())
            .field("permits", &self.permits)
            .field("max_unfinished", &self.max_unfinished)
            .field("retention", &self.retention)
            .field("monitor", &self.monitor)
            .field("drain_timeout", &self.drain_timeout)
            .field("restart_limit", &self.restart_limit)
            .field("rollback_retries", &self.rollback_retries)
            .field("retry_policy", &self.retry_policy)
            .field("remote", &self.remote.as_ref().map(|(_, options)| options))
            .finish_non_exhaustive()
    }
}

/// How long finished roots' results are kept, and how often the cleaner looks.
#[derive(Clone, Copy, Debug)]
pub(super) struct Retention {
    pub(super) kept: Duration,
    pub(super) after_ack: Duration,
    pub(super) every: Duration,
    /// How long a root's nonce is remembered after it finished (at least `kept`).
    pub(super) nonces: Duration,
}

impl<E> Default for ExecutorBuilder<E> {
    fn default() -> Self {
        ExecutorBuilder {
            workers: 16,
            scheduling: Scheduling::Fair,
            reserved_workers: None,
            system_workers: 1,
            arbiters: std::thread::available_parallelism().map_or(2, |n| n.get()),
            store: None,
            remote: None,
            #[cfg(feature = "postgres")]
            lease: None,
            #[cfg(feature = "postgres")]
            standby: None,
            #[cfg(feature = "postgres")]
            grant: None,
            registry: Registry::default(),
            env: None,
            permits: Vec::new(),
            max_unfinished: 1_000_000,
            retention: Retention {
                kept: Duration::from_secs(15 * 60),
                after_ack: Duration::from_secs(5 * 60),
                every: Duration::from_secs(30),
                nonces: Duration::from_secs(60 * 60),
            },
            monitor: Monitor {
                every: Duration::from_secs(5),
                stuck_after: Duration::from_secs(10),
                retire_after: Duration::from_secs(60),
            },
            drain_timeout: Duration::from_secs(30),
            restart_limit: RestartLimit::default(),
            rollback_retries: crate::policy::DEFAULT_ROLLBACK_RETRIES,
            retry_policy: None,
        }
    }
}

impl<E: Send + Sync + 'static> ExecutorBuilder<E> {
    /// How long a graceful [`Executor::shutdown`] waits for running steps and
    /// rollbacks to end and their records to become durable (default 30 s). Past it,
    /// the calls still running are cancelled
    /// ([`CancelReason::Shutdown`](crate::CancelReason::Shutdown)) and get one more
    /// second to return; then the engine stops as by [`Executor::shutdown_now`].
    #[must_use]
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// The supervision's restart limit (default 3 restarts within 60 s), as Erlang/OTP
    /// supervisors have. A procedure's actor that stops unasked (a panic in engine
    /// code around a call: a bug, not the user's panic, which fails the step) is
    /// started again by its root stack from the state it last reported, and the step it
    /// was in runs again. Past `max_restarts` within `within`, the step is not run
    /// again but fails with [`ProcError::Panicked`](crate::ProcError::Panicked) (hook
    /// `the procedure's actor`, the message naming the count and the last reason),
    /// which its failure policy and the tree's rollback take as any failure; an actor
    /// that keeps stopping in a rollback, or between calls, halts its tree instead (a
    /// rollback is never abandoned): its waiters get
    /// [`Error::Internal`](crate::Error::Internal) naming the reason, and a restart of
    /// the engine carries the tree on. Each restart is logged under
    /// `proctor::supervision` with its reason and counted in
    /// `proctor_procedure_restarts_total`.
    ///
    /// ```
    /// use std::time::Duration;
    /// let builder: proctor::ExecutorBuilder =
    ///     proctor::Executor::builder().restart_limit(5, Duration::from_secs(10));
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn restart_limit(mut self, max_restarts: u32, within: Duration) -> Self {
        self.restart_limit = RestartLimit {
            max: max_restarts,
            within,
        };
        self
    }

    /// How many times a failed rollback step (its `rollback` returned an error or
    /// panicked) is retried before its procedure is
    /// [`ROLLBACK_PAUSED`](crate::ProcState::RollbackPaused) for an operator (default
    /// 20), under the default [`FailurePolicy::Rollback`](crate::FailurePolicy) (a
    /// procedure's own retry policy says its own count). Retries back off from 20 ms,
    /// doubling up to 10 s, with full jitter: the default spends about a minute (two at
    /// most). Each
    /// failure is logged at WARN under `proctor::tree` and counted in
    /// `proctor_rollback_retries_total`; the pause is logged at WARN naming the
    /// procedure, its type and the error, and counted in `proctor_procedures_paused`.
    /// The paused procedure's [`ProcInfo::steering`](crate::ProcInfo) says why
    /// (`paused`: the error, the policy, the retries spent), as do the admin page and
    /// `proctor procs`; [`Executor::resume`] (or `proctor continue`) tries its rollback
    /// again, with its retries anew. The retries are counted in memory: a restart
    /// gives a failing rollback its retries again. A rollback waiting for its lock
    /// ([`Procedure::acquire_lock`](crate::Procedure::acquire_lock) yielding) is not
    /// failing, and waits as long as it takes.
    ///
    /// ```
    /// let builder: proctor::ExecutorBuilder = proctor::Executor::builder().rollback_retries(5);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn rollback_retries(mut self, retries: u32) -> Self {
        self.rollback_retries = retries;
        self
    }

    /// How a step's [retryable](crate::ErrorKind::Retryable) error is retried when
    /// neither the step ([`Context::set_retry_policy`](crate::Context::set_retry_policy))
    /// nor its procedure's failure policy (a retrying
    /// [`FailurePolicy`](crate::FailurePolicy)) says: the service's default, instead of
    /// [`RetryPolicy::default`](crate::RetryPolicy) (5 retries, from 200 ms, doubling
    /// up to 30 s). Terminal errors and errors of no kind are not retried by it.
    ///
    /// ```
    /// use proctor::{Executor, ExecutorBuilder, RetryPolicy};
    /// // A flaky network: up to 20 retries, from 100 ms, none longer than 5 s apart.
    /// let builder: ExecutorBuilder =
    ///     Executor::builder().retry_policy(RetryPolicy::new(20).backoff_ms(100).max_delay_ms(5_000));
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn retry_policy(mut self, policy: crate::RetryPolicy) -> Self {
        self.retry_policy = Some(policy);
        self
    }

    /// How many steps may run at once (default 16), split as evenly as can be over the
    /// shards ([`ExecutorBuilder::arbiters`]). Waiting procedures hold none.
    #[must_use]
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// The order in which queued steps get a worker (default [`Scheduling::Fair`]: a
    /// multilevel feedback queue by each tree's accumulated step time, so trees of a
    /// few short steps are not held up behind trees that run many long ones;
    /// [`Scheduling::Fifo`] runs them in arrival order and lets a procedure that
    /// continues keep its worker).
    ///
    /// ```
    /// use proctor::{Executor, Scheduling};
    /// let builder: proctor::ExecutorBuilder = Executor::builder().scheduling(Scheduling::Fifo);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn scheduling(mut self, scheduling: Scheduling) -> Self {
        self.scheduling = scheduling;
        self
    }

    /// Workers kept for young trees (under a second of step time, level 0 of the
    /// [`Scheduling::Fair`] queue): a step of an older tree starts only while more than
    /// `n` workers are free. Steps are not preempted, so a new tree's first step would
    /// otherwise wait for some running step to end when long-running trees fill every
    /// worker; with a reserved worker it starts at once. The price: trees that have run
    /// a second or more use at most `workers - n` workers. Per shard: each shard's
    /// scheduler keeps `n` of its own share, always fewer than that share (with 4
    /// workers on 2 shards and the default, one of each shard's two). Default: 1 with 4
    /// workers or more, else 0. [`Scheduling::Fifo`] ignores it.
    ///
    /// ```
    /// let builder: proctor::ExecutorBuilder = proctor::Executor::builder().workers(8).reserved_workers(2);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn reserved_workers(mut self, n: usize) -> Self {
        self.reserved_workers = Some(n);
        self
    }

    /// Workers of their own for system procedures
    /// ([`Registry::register_system`](crate::Registry::register_system)), beside the
    /// [`workers`](Self::workers), as HBase keeps urgent workers for its meta table's
    /// procedures. A system procedure's step takes one of them while one is free, and a
    /// shared worker only when they are all busy; no other step takes them. Steps are
    /// not preempted, so without one a system step waits for some running step to end
    /// when long user steps fill every worker, even when it is first in the queue.
    /// Per shard: each shard's scheduler has `n` of them beside its share of the
    /// workers, so a system procedure on any shard has one. Default 1. An executor
    /// without system types never uses them.
    ///
    /// ```
    /// let builder: proctor::ExecutorBuilder = proctor::Executor::builder().workers(8).system_workers(2);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn system_workers(mut self, n: usize) -> Self {
        self.system_workers = n;
        self
    }

    /// How many shards the trees are spread over (default: one per core), each an
    /// arbiter (a thread) with its own scheduler, but never more than the workers. A new
    /// tree goes to the shard with the fewest live trees and never moves: its
    /// procedures run on their shard's thread, on its share of the workers. So the
    /// worker bound, the fair queue's levels and the stuck-worker rule are per shard
    /// (with 8 workers and 2 shards, one tree runs at most 4 steps at once), while lock
    /// order (FIFO per resource) and deadlock detection stay global.
    ///
    /// ```
    /// // Two shards of 4 workers each.
    /// let builder: proctor::ExecutorBuilder = proctor::Executor::builder().workers(8).arbiters(2);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn arbiters(mut self, arbiters: usize) -> Self {
        self.arbiters = arbiters;
        self
    }

    /// Where records go: required, so that no engine runs in memory by accident. A
    /// [`WalStore`](crate::WalStore) keeps procedures across a crash; a [`MemoryStore`](crate::MemoryStore)
    /// keeps nothing past the process (for tests and examples). Without one,
    /// [`start`](Self::start) fails with [`Error::Config`].
    #[must_use]
    pub fn store(mut self, store: impl ProcedureStore) -> Self {
        self.store = Some(Box::new(store));
        self
    }

    /// The registry, for a cluster member that encodes and decodes forwarded roots.
    #[cfg(feature = "postgres")]
    pub(crate) fn into_registry(self) -> Registry<E> {
        self.registry
    }

    /// Sends remote operations ([`Context::dispatch`](crate::Context::dispatch))
    /// through `transport`, batched per target as `options` say
    /// ([`RemoteOptions::default`]: 32 operations or 150 ms, HBase's). Their targets
    /// report through [`Executor::report`]. Without a transport, a step that dispatches
    /// fails its operations' procedures with an error that says so.
    ///
    /// ```
    /// # use proctor::{async_trait, OpId, Report, Transport, TransportError};
    /// # struct Rpc;
    /// # #[async_trait] impl Transport for Rpc { type Op = u32;
    /// #   async fn send(&self, _: &str, _: Vec<(OpId, u32)>) -> Result<Vec<Report>, TransportError> { Ok(vec![]) } }
    /// let builder = proctor::Executor::<()>::builder()
    ///     .store(proctor::MemoryStore::new())
    ///     .remote(Rpc, proctor::RemoteOptions::default());
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn remote<T: Transport>(mut self, transport: T, options: RemoteOptions) -> Self {
        self.remote = Some((Arc::new(Typed(Arc::new(transport))), options));
        self
    }

    /// Runs the executor only while it holds the leader lease `lease` (HBase's active
    /// master, PolarDB-X's DDL leader): [`start`](Self::start) waits as a standby
    /// until the lease is free or has expired, takes it, fences the store with its
    /// epoch, and only then loads the store and recovers every tree. The lease is
    /// renewed every third of its period; once it is lost (another engine took it, or
    /// no renewal succeeded for two thirds of the period), the executor steps down
    /// before the lease can expire: no step starts, nothing more is acknowledged, and
    /// every request is answered [`Error::NotLeader`]. A graceful shutdown lets the
    /// lease go at once for a standby. The store must be the lease's (the same
    /// database and schema): a [`PgStore`](crate::PgStore).
    ///
    /// ```no_run
    /// # async fn f(registry: proctor::Registry) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use proctor::{Executor, PgLease, PgStore};
    ///
    /// let url = "postgresql://proctor@db.internal/control";
    /// let executor = Executor::builder()
    ///     .registry(registry)
    ///     .store(PgStore::connect(url)?)
    ///     .leadership(PgLease::new(url, "master-a").period(Duration::from_secs(15)))
    ///     .start() // returns once this engine leads
    ///     .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    #[must_use]
    pub fn leadership(mut self, lease: crate::actors::PgLease) -> Self {
        self.lease = Some(lease);
        self
    }

    /// The procedure types this executor can persist and recover, all of the
    /// executor's environment type `E` (which the registry's type fixes, in whatever
    /// order the builder's calls come).
    #[must_use]
    pub fn registry(mut self, registry: Registry<E>) -> Self {
        self.registry = registry;
        self
    }

    /// The value every call borrows through [`Context::env`](crate::Context::env): the
    /// service's clients, say. Its type `E` is the registry's (see
    /// [`Procedure`](crate::Procedure)); give it by value or as an `Arc<E>` the
    /// service keeps a copy of. Needed unless `E` is `()`: [`start`](Self::start)
    /// refuses to start without it.
    ///
    /// ```
    /// use proctor::{Executor, Registry};
    /// use std::sync::Arc;
    /// struct Cluster { name: String }
    /// let cluster = Arc::new(Cluster { name: "c1".into() });
    /// let builder = Executor::builder()
    ///     .registry(Registry::<Cluster>::new())
    ///     .env(cluster.clone());
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn env(mut self, env: impl Into<Arc<E>>) -> Self {
        self.env = Some(env.into());
        self
    }

    /// Makes `resource` a counted resource: at most `permits` procedures hold a shared
    /// lock on it at once (say, DDL parallelism per schema). A procedure whose ancestor
    /// holds that shared lock for its life runs under the ancestor's permit and takes
    /// none of its own (an ancestor's share held for one step covers nothing). A tree's
    /// rollback step is not kept out by its own tree's holders, nor a deadlock's
    /// borrower by its lender (see the guide's **Locks**): those run nothing meanwhile,
    /// so at most `permits` lines of descent run inside at once. An exclusive lock on
    /// it still excludes everyone.
    ///
    /// ```
    /// let builder: proctor::ExecutorBuilder = proctor::Executor::builder().permits("ddl/db1", 4);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn permits(mut self, resource: impl Into<String>, permits: u32) -> Self {
        self.permits.push((resource.into(), permits));
        self
    }

    /// The most root procedures that may be unfinished at once (default 1 000 000,
    /// recovered ones included). A submit beyond it is refused at once with
    /// [`Error::Overloaded`] instead of queueing without bound.
    #[must_use]
    pub fn max_unfinished(mut self, max: usize) -> Self {
        self.max_unfinished = max;
        self
    }

    /// How long a finished root's result (its state, outcome, value and nonce) is kept
    /// after it finished (default 15 minutes, as HBase): then a periodic cleaner evicts
    /// it in batches, its records become garbage in the log, and asking for it answers
    /// [`Error::Gone`].
    #[must_use]
    pub fn retention(mut self, kept: Duration) -> Self {
        self.retention.kept = kept;
        self
    }

    /// How long a result is kept once the client acknowledged it with
    /// [`Executor::ack_result`] (default 5 minutes), if that is sooner.
    #[must_use]
    pub fn retention_after_ack(mut self, kept: Duration) -> Self {
        self.retention.after_ack = kept;
        self
    }

    /// How long a root's nonce is remembered after the root finished (default 1 hour;
    /// never less than [`retention`](Self::retention)): until then a submit with the
    /// same nonce and the same procedure, before or after a restart, answers the root's
    /// id and runs nothing (one with another procedure or other arguments is
    /// [`Error::NonceConflict`](crate::Error::NonceConflict)),
    /// even once the result itself was evicted (asking for it then answers
    /// [`Error::Gone`](crate::Error::Gone)). The root's records stay in the store as
    /// long, so a restart still knows the nonce; then they are deleted with it. This is
    /// the window HBase's nonces get from the result's time to live, made a setting of
    /// its own: a client that retries for longer than it needs a nonce remembered for
    /// longer.
    #[must_use]
    pub fn nonce_retention(mut self, kept: Duration) -> Self {
        self.retention.nonces = kept;
        self
    }

    /// How often the cleaner looks for results to evict (default 30 s).
    #[must_use]
    pub fn cleaner_interval(mut self, every: Duration) -> Self {
        self.retention.every = every;
        self
    }

    /// The stuck-worker monitor: every `every` (default 5 s) it counts the workers that
    /// have been in one step for `stuck_after` (default 10 s) or more, warns about each
    /// (procedure, type, how long), and when at least half of the configured workers
    /// are stuck while runnable procedures wait, allows one extra worker (up to 10×
    /// the configured count).
    #[must_use]
    pub fn stuck_worker_monitor(mut self, every: Duration, stuck_after: Duration) -> Self {
        self.monitor.every = every;
        self.monitor.stuck_after = stuck_after;
        self
    }

    /// How long the pool must have had an idle worker before an extra worker retires
    /// (default one minute).
    #[must_use]
    pub fn extra_worker_idle(mut self, retire_after: Duration) -> Self {
        self.monitor.retire_after = retire_after;
        self
    }

    /// Recovers the store and starts the executor. Every unfinished tree in the store is
    /// carried on to SUCCESS or ROLLEDBACK; see [`Executor::recovery`].
    ///
    /// Works from any async context. Inside an actix system (under `#[actix::main]`, in
    /// an actor, on an actix arbiter) the executor joins that system. Anywhere else (a
    /// plain tokio runtime, multi-thread or current-thread) it starts an actix system
    /// of its own on a thread it owns; [`Executor::shutdown`] stops that thread, and so
    /// does dropping the last handle without a shutdown (the engine then shuts down
    /// gracefully on its own threads, and nobody waits for it).
    ///
    /// # Errors
    ///
    /// [`Error::Config`] for a bad setting, a missing environment (one of type `E` is
    /// needed unless `E` is `()`), or when a thread cannot be started;
    /// [`Error::Store`] when the store cannot be loaded (a corrupt log, a directory
    /// locked by another engine).
    pub async fn start(self) -> Result<Executor<E>, Error> {
        if actix::Arbiter::try_current().is_some() {
            return Ok(self.start_here(false).await?.0);
        }
        let (started, answer) = oneshot::channel();
        let (gone, system_gone) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("proctor-system".into())
            .spawn(move || {
                let system = actix::System::new();
                let result = system.block_on(self.start_here(true)).map(|(e, _)| e);
                let ok = result.is_ok();
                // The starter may have given up waiting: then nothing should run.
                if started.send(result).is_ok() && ok {
                    let _ = system.run();
                }
                let _ = gone.send(());
            })
            .map_err(|e| Error::Config(format!("cannot start the engine's system thread: {e}")))?;
        let mut executor = answer.await.map_err(|_| {
            Error::Internal("the engine's system thread ended while starting".into())
        })??;
        executor.system = Some(owned_system(&executor.front, system_gone, thread));
        Ok(executor)
    }

    /// Starts a standby: an executor that answers every request at once with
    /// [`Error::NotLeader`] (naming the lease's holder as it last saw it) while it
    /// waits for the leader lease ([`leadership`](Self::leadership), which it needs),
    /// and then — in the background — takes it, loads the store, recovers every tree
    /// and takes requests as [`start`](Self::start)'s executor does. A service holds
    /// this one handle from its start and routes each request by its answer;
    /// [`Executor::leading`] waits for the lease, [`Executor::role`] tells
    /// [`Role::Standby`](crate::Role::Standby) from a leader, and a subscription made
    /// while it waits hears [`ProcEvent::Leading`](crate::ProcEvent::Leading) first. A
    /// shutdown while it waits ends the wait (a lease it had just taken is let go).
    ///
    /// ```no_run
    /// # use proctor::{async_trait, Context, Flow, ProcError, Procedure};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct CreateTable;
    /// # #[async_trait] impl Procedure for CreateTable {
    /// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
    /// # async fn f(registry: proctor::Registry) -> Result<(), proctor::Error> {
    /// use proctor::{Error, Executor, PgLease, PgStore};
    /// let url = "host=db.internal user=proctor dbname=control";
    /// let executor = Executor::builder()
    ///     .registry(registry)
    ///     .store(PgStore::connect(url)?)
    ///     .leadership(PgLease::new(url, "master-b"))
    ///     .start_standby()?;
    /// match executor.submit(CreateTable).await {
    ///     Ok(id) => println!("submitted {id}"),
    ///     Err(Error::NotLeader { leader, .. }) => println!("ask the leader: {leader:?}"),
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Config`] without a lease or a store, or when its thread cannot start.
    /// Errors of the start itself (the database, the store) come later, as the
    /// answers to requests and from [`Executor::leading`].
    #[cfg(feature = "postgres")]
    pub fn start_standby(mut self) -> Result<Executor<E>, Error> {
        if self.lease.is_none() || self.store.is_none() {
            return Err(Error::Config(
                "a standby needs a store and a leader lease: give the builder .store(..) \
                 and .leadership(PgLease::new(..))"
                    .into(),
            ));
        }
        let front = Arc::new(Front::standby());
        self.standby = Some(front.clone());
        let started = front.clone();
        let run = move |result: Result<Started<E>, Error>| match result {
            Ok((executor, leading)) => {
                if let Some((holder, epoch)) = leading {
                    started.started(&executor.front, &holder, epoch);
                }
                true
            }
            Err(e) => {
                started.failed(e);
                false
            }
        };
        if actix::Arbiter::try_current().is_some() {
            actix::spawn(async move {
                run(self.start_here(false).await);
            });
            return Ok(Executor {
                front,
                system: None,
            });
        }
        let (gone, system_gone) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("proctor-system".into())
            .spawn(move || {
                let system = actix::System::new();
                if run(system.block_on(self.start_here(true))) {
                    let _ = system.run();
                }
                let _ = gone.send(());
            })
            .map_err(|e| Error::Config(format!("cannot start the engine's system thread: {e}")))?;
        let system = Some(owned_system(&front, system_gone, thread));
        Ok(Executor { front, system })
    }

    /// Starts the actors in the current actix system; `owned`: the system is the
    /// executor's own, stopped by its shutdown.
    async fn start_here(mut self, owned: bool) -> Result<Started<E>, Error> {
        let env = self.check()?;
        let mut store = self.store.take().ok_or_else(|| {
            Error::Config(
                "no store: give the builder one with .store(..): a WalStore for procedures \
                 that survive a crash, or a MemoryStore (for tests), which keeps nothing"
                    .into(),
            )
        })?;
        // A standby waits here for the lease; the store is read only once it leads.
        #[cfg(feature = "postgres")]
        let grant = self.grant.take();
        #[cfg(feature = "postgres")]
        let (leadership, partition, stripe) = match (self.lease.take(), grant) {
            // A partition's owner: its writes are fenced with the partition's epoch.
            (_, Some(grant)) => {
                store.fence(Some(grant.leadership.epoch()))?;
                let stripe = crate::cluster::IdStripe::of(grant.partition, grant.partitions);
                (Some(grant.leadership), Some(grant.partition), stripe)
            }
            (Some(lease), None) => {
                let leadership = self.acquire(lease).await?;
                store.fence(Some(leadership.epoch()))?;
                ::metrics::gauge!(crate::actors::metrics::IS_LEADER).set(1.0);
                (Some(leadership), None, crate::cluster::IdStripe::WHOLE)
            }
            (None, None) => (None, None, crate::cluster::IdStripe::WHOLE),
        };
        #[cfg(not(feature = "postgres"))]
        let (partition, stripe) = (None, crate::cluster::IdStripe::WHOLE);
        // The registry's types go to the recovery, and on to the actors: the other
        // options are still read below.
        let mut registry = std::mem::take(&mut self.registry);
        // Remote operations' children are every registry's: they may be in the store.
        if registry.static_name(crate::remote::REMOTE_CALL).is_none() {
            registry.register::<crate::remote::RemoteCall>(crate::remote::REMOTE_CALL);
        }
        let recovered = Recovered::load(&mut *store, registry, &env)?;
        // Which store, for the start's log line: its kind and where it is (the WAL's
        // directory, the PostgreSQL store's schema).
        let store_status = store.status();
        let store_at = store_status
            .facts
            .iter()
            .find(|(name, _)| matches!(*name, "dir" | "schema"))
            .map(|(_, at)| at.clone());
        crate::actors::metrics::describe();
        let persistence = PersistenceActor::new(store)
            .map_err(|e| Error::Config(format!("cannot start the store writer thread: {e}")))?
            .start();
        let views = Arc::new(SchedulerViews {
            fair: self.scheduling == Scheduling::Fair,
            ..SchedulerViews::default()
        });
        let locks = LockActor::new(std::mem::take(&mut self.permits), views.clone()).start();
        // The lease's epoch (every call's fencing token) and its term (the mandate's).
        #[cfg(feature = "postgres")]
        let (fencing_token, lease_term) =
            leadership.as_ref().map(|l| (l.epoch(), l.term())).unzip();
        #[cfg(not(feature = "postgres"))]
        let (fencing_token, lease_term) = (None, None);
        let mandate = Mandate::new(lease_term);
        let remote = self.remote.take().map(|(transport, options)| {
            let dispatcher =
                RemoteDispatcher::new(transport, options, locks.clone(), mandate.clone());
            let outcomes = dispatcher.outcomes();
            let addr = dispatcher.start();
            (
                RemoteDispatcher::sink(addr.clone(), outcomes, locks.clone()),
                addr,
            )
        });
        recovered.regrant(&locks);
        let report = recovered.report.clone();
        let peers = Peers {
            locks,
            persistence,
            views,
            broken: crate::cancel::Cancel::new(),
            mandate,
            fencing_token,
            partition,
            remote,
        };
        let addr = self.create_actor(recovered, env, peers, owned, stripe);
        #[cfg_attr(not(feature = "postgres"), allow(unused_mut))]
        let mut leading = None;
        #[cfg(feature = "postgres")]
        if let Some(leadership) = leadership {
            leading = Some((leadership.holder().to_string(), leadership.epoch()));
            super::leader::lead(&addr, leadership, partition);
        }
        tracing::info!(target: crate::targets::EXECUTOR,
            version = env!("CARGO_PKG_VERSION"),
            store = store_status.kind,
            store_at = store_at.as_deref(),
            shards = self.shards(),
            workers = self.workers,
            recovered = report.recovered_roots.len(),
            finished = report.finished_roots,
            corrupt = report.corrupt.len(),
            "executor started"
        );
        Ok((
            Executor {
                front: Arc::new(Front::running(addr, report)),
                system: None,
            },
            leading,
        ))
    }

    /// Waits for `lease` and takes it; a standby's wait ends early when it is stopped,
    /// and tells its front who holds the lease meanwhile.
    #[cfg(feature = "postgres")]
    async fn acquire(
        &self,
        lease: crate::actors::PgLease,
    ) -> Result<crate::actors::Leadership, Error> {
        let Some(standby) = self.standby.clone() else {
            return Ok(lease.acquire().await?);
        };
        let stopped = standby.stopped();
        tokio::select! {
            taken = lease.acquire_watching(move |holder| standby.seen(holder)) => Ok(taken?),
            () = stopped.cancelled() => Err(Error::Stopped),
        }
    }

    /// The environment the procedures get, once the options are checked: nothing
    /// starts with a missing environment, without workers or arbiters, or with a bad
    /// counted resource.
    fn check(&mut self) -> Result<Arc<AnyEnv>, Error> {
        let env: Arc<AnyEnv> = match self.env.take() {
            Some(env) => env,
            // The one environment there is nothing to give of.
            None => (Arc::new(()) as Arc<AnyEnv>).downcast::<E>().map_err(|_| {
                Error::Config(format!(
                    "the registry's procedures need an environment of type {}: give it \
                         with ExecutorBuilder::env",
                    std::any::type_name::<E>()
                ))
            })?,
        };
        if self.workers == 0 || self.arbiters == 0 {
            return Err(Error::Config(
                "workers and arbiters must be at least 1".into(),
            ));
        }
        if let Some(missing) = self.registry.missing_child_type() {
            return Err(Error::Config(missing));
        }
        for (resource, permits) in &self.permits {
            Lock::shared(resource.as_str())
                .check()
                .map_err(Error::Config)?;
            if *permits == 0 {
                return Err(Error::Config(format!(
                    "counted resource {resource:?} needs at least 1 permit"
                )));
            }
        }
        Ok(env)
    }

    /// How many shards the trees are spread over: one per arbiter, but no more than
    /// the workers, each shard's scheduler taking its share of them.
    fn shards(&self) -> usize {
        self.arbiters.min(self.workers)
    }

    /// The `index`th shard's scheduler, with its share of the workers, and the system
    /// procedures' workers, the reserved workers and the queueing of the options.
    fn scheduler_setup(
        &self,
        system: &Arc<HashSet<&'static str>>,
        peers: &Peers,
        index: usize,
    ) -> SchedulerSetup {
        let shards = self.shards();
        let workers = share(self.workers, shards, index);
        // Of the shard's share: the ready queue keeps it below that share.
        let reserved = self
            .reserved_workers
            .unwrap_or(usize::from(self.workers >= 4));
        SchedulerSetup {
            workers,
            queueing: Queueing {
                scheduling: self.scheduling,
                reserved,
                system_workers: self.system_workers,
                system: system.clone(),
            },
            monitor: self.monitor,
            view: peers.views.clone(),
            locks: peers.locks.clone(),
            mandate: peers.mandate.clone(),
        }
    }

    /// Starts the arbiters, each with its shard and the shard's scheduler: the arbiters
    /// (joined at shutdown), their handles, and the shards with their schedulers.
    fn start_arbiters(
        &self,
        registry: &Types,
        peers: &Peers,
    ) -> (Vec<Arbiter>, Vec<ArbiterHandle>, Vec<ShardAddr>) {
        let system = Arc::new(registry.system());
        // A simulation runs every shard on its one thread, the current arbiter's.
        #[cfg(feature = "simulation")]
        let simulated = crate::actors::simulation::active();
        #[cfg(not(feature = "simulation"))]
        let simulated = false;
        let arbiters: Vec<Arbiter> = if simulated {
            Vec::new()
        } else {
            (0..self.shards()).map(|_| Arbiter::new()).collect()
        };
        let handles: Vec<ArbiterHandle> = if simulated {
            (0..self.shards()).map(|_| Arbiter::current()).collect()
        } else {
            arbiters.iter().map(Arbiter::handle).collect()
        };
        let shards = handles
            .iter()
            .enumerate()
            .map(|(index, arbiter)| {
                let setup = self.scheduler_setup(&system, peers, index);
                let scheduler =
                    SchedulerActor::start_in_arbiter(arbiter, move |_| SchedulerActor::new(setup));
                let shard_peers = ShardPeers {
                    scheduler: scheduler.clone().recipient(),
                    locks: peers.locks.clone().recipient(),
                    persistence: peers.persistence.clone().recipient(),
                };
                let shard = Shard::start_in_arbiter(arbiter, move |_| Shard::new(shard_peers));
                (shard, scheduler)
            })
            .collect();
        (arbiters, handles, shards)
    }

    /// Starts the arbiters, each with its shard, and then the executor actor, which
    /// keeps the recovered results and sends the recovered trees to their shards
    /// before it handles any request.
    fn create_actor(
        &self,
        recovered: Recovered,
        env: Arc<AnyEnv>,
        peers: Peers,
        owned: bool,
        stripe: crate::cluster::IdStripe,
    ) -> Addr<ExecutorActor<E>> {
        let max_unfinished = self.max_unfinished;
        let retention = self.retention;
        let drain_timeout = self.drain_timeout;
        let unfinished = recovered.trees.len();
        let finished_at = recovered.finished_at();
        let nonces = recovered.nonces();
        let (arbiters, handles, shards) = self.start_arbiters(&recovered.registry, &peers);
        let Recovered {
            registry,
            mut plan,
            trees,
            report,
            max_id,
            ..
        } = recovered;
        let finished = std::mem::take(&mut plan.finished);
        let table_capacity = finished.len()
            + trees
                .iter()
                .map(|(t, _)| plan.records_of(t).len())
                .sum::<usize>();
        ExecutorActor::<E>::create(move |ctx| {
            let shared = Arc::new(Shared::new(
                registry,
                env,
                peers.views,
                peers.locks,
                peers.persistence,
                ctx.address().recipient(),
                ctx.address().recipient(),
                handles,
                shards,
                (max_id, stripe),
                table_capacity,
                peers.broken,
                peers.mandate,
                self.restart_limit,
                self.rollback_retries,
                self.retry_policy,
                (peers.fencing_token, peers.partition),
                peers.remote,
            ));
            keep_results(&shared, finished);
            start_recovered(&shared, &plan, trees);
            ExecutorActor {
                shared,
                waiters: IdMap::default(),
                broken: None,
                arbiters,
                unfinished,
                max_unfinished,
                nonces,
                retention,
                finished: finished_at.into(),
                nonce_only: VecDeque::new(),
                acked: IdMap::default(),
                evicting: false,
                owned_system: owned,
                drain_timeout,
                stopping: false,
                corrupt: report.corrupt.iter().map(|c| c.id).collect(),
                subscribers: Vec::new(),
                recent_failures: VecDeque::new(),
                next_token: 0,
                role: super::leader::Role::Alone,
                #[cfg(feature = "postgres")]
                leadership: None,
                env: PhantomData,
            }
        })
    }
}

/// A started executor, and the lease's holder and epoch if it leads.
type Started<E> = (Executor<E>, Option<(String, i64)>);

/// A standby's wait for the lease, as the start sees it.
#[cfg(feature = "postgres")]
pub(super) trait StandbyWait: Send + Sync {
    /// The lease's holder it found, while it waits.
    fn seen(&self, holder: Option<String>);
    /// Raised when the standby is stopped while it waits.
    fn stopped(&self) -> crate::cancel::Cancel;
}

/// The system thread an executor started for itself, ended with it: `stop` asks the
/// executor behind `front` to shut down when the last handle goes.
fn owned_system<E: Send + Sync + 'static>(
    front: &Arc<Front<E>>,
    gone: oneshot::Receiver<()>,
    thread: std::thread::JoinHandle<()>,
) -> Arc<OwnedSystem> {
    let front = front.clone();
    Arc::new(OwnedSystem {
        gone: std::sync::Mutex::new(Some((gone, thread))),
        stop: Box::new(move || {
            if let Some(addr) = front.stop() {
                addr.do_send(Shutdown::graceful());
            }
        }),
    })
}

/// The actors every shard talks to, started before the shards.
struct Peers {
    locks: Addr<LockActor>,
    persistence: Addr<PersistenceActor>,
    views: Arc<SchedulerViews>,
    /// Raised when the executor breaks (or steps down): operator commands waiting on a
    /// tree that will never write again are answered (the schedulers read `mandate`).
    broken: crate::cancel::Cancel,
    /// Whether user code may be called: until the executor breaks or steps down, and
    /// while the leader lease holds.
    mandate: Arc<Mandate>,
    /// The leader lease's epoch, for every call's context.
    fencing_token: Option<i64>,
    /// The cluster partition, for every call's context.
    partition: Option<u32>,
    /// The remote dispatcher, and what procedures reach it through.
    remote: Option<(crate::remote::Sink, Addr<RemoteDispatcher>)>,
}
