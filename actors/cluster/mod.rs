//! A cluster: several executors, each a member, sharing one PostgreSQL store cut into
//! partitions (the `postgres` feature).
//!
//! Each member runs, for every partition it owns, an engine of its own: an executor
//! with its shards, schedulers, persistence and lock actors, whose store is the
//! partition's rows ([`PgStore`] scoped to it), fenced with the partition's epoch, and
//! whose calls into user code hold while the member's membership does. The pieces:
//!
//! - `mod.rs`: [`Cluster`] (the handle: submit anywhere, wait anywhere) and
//!   [`ClusterBuilder`];
//! - `node.rs`: the member's actor, [`NodeActor`], which joins, starts and stops the
//!   engines of the partitions it owns as ownership changes, hands partitions off when
//!   the coordinator asks, and submits what other members forwarded;
//! - `db.rs`: the member's thread on its own connection, which reads ownership every
//!   tick, moves partitions while the member coordinates, and carries forwarded
//!   submits.
//!
//! The rules: a partition has one owner at a time, and one engine of that owner runs
//! it, under an epoch that engine claimed (bumped) before loading the partition; every
//! write of the engine carries that epoch and fails once it changed. A partition leaves
//! a member only by the member's own hand-off (after its engine stopped) or when its
//! membership has expired by the database's clock — and a member calls no user code
//! past two thirds of its membership's period without a renewal, so the two never
//! overlap. The coordinator (the leader lease's holder) only decides; the database
//! checks every move against the memberships.

mod db;
mod node;

use std::sync::{Arc, RwLock};
use std::time::Duration;

use actix::prelude::*;

pub use crate::actors::pg_store::cluster::{ClusterState, MemberState, MoveRecord, PartitionState};
use crate::actors::pg_store::PgOptions;
use crate::actors::{Executor, ExecutorBuilder};
use crate::error::Error;
use crate::procedure::{ProcId, Procedure};
use crate::record::{Failure, Nonce};
use crate::registry::Registry;

pub use node::NodeActor;

/// The partition an engine of a cluster runs, and the ownership it runs it under
/// (given to its builder by the member).
pub(crate) struct Grant {
    pub(crate) partition: u32,
    pub(crate) partitions: u32,
    pub(crate) leadership: crate::actors::Leadership,
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("partition", &self.partition)
            .field("partitions", &self.partitions)
            .finish_non_exhaustive()
    }
}

/// What makes each partition's engine: the options every engine of the member gets
/// (registry, environment, workers); the member adds the store and the ownership.
pub type EngineFactory<E> = Arc<dyn Fn() -> ExecutorBuilder<E> + Send + Sync>;

/// Configures and starts a member of a cluster ([`Cluster::builder`]).
pub struct ClusterBuilder<E: Send + Sync + 'static = ()> {
    url: String,
    name: String,
    options: PgOptions,
    partitions: u32,
    period: Duration,
    engines: Option<EngineFactory<E>>,
}

impl<E: Send + Sync + 'static> std::fmt::Debug for ClusterBuilder<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterBuilder")
            .field("name", &self.name)
            .field("options", &self.options)
            .field("partitions", &self.partitions)
            .field("period", &self.period)
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> ClusterBuilder<E> {
    /// The store's schema ([`PgOptions`]): a cluster needs a schema of its own.
    #[must_use]
    pub fn options(mut self, options: PgOptions) -> Self {
        self.options = options;
        self
    }

    /// How many partitions the cluster has (8 by default, at most 4096): read only by
    /// the member that creates the cluster's tables; later members take the store's.
    /// It bounds how many members share the work. Each partition a member owns is an
    /// engine of its own (its actors, its threads, its connection to the database and
    /// its group commit), so a member owns about `partitions / members` of them, and
    /// the fewer it owns the larger its batches: on two cores a member of 16
    /// partitions spends about 1.7 times the CPU per step of one of 8 (`BENCHMARKS.md`).
    #[must_use]
    pub fn partitions(mut self, partitions: u32) -> Self {
        self.partitions = partitions.clamp(1, 4096);
        self
    }

    /// The membership's period, and the leader lease's (30 s by default, at least
    /// 300 ms): a member that stops renewing loses its partitions within two periods.
    #[must_use]
    pub fn period(mut self, period: Duration) -> Self {
        self.period = period.max(Duration::from_millis(300));
        self
    }

    /// How to make each partition's engine: a builder with the registry, the
    /// environment and the engine's options (fewer arbiters than a lone executor's
    /// suit a member that runs many partitions). Required.
    #[must_use]
    pub fn engines(
        mut self,
        engines: impl Fn() -> ExecutorBuilder<E> + Send + Sync + 'static,
    ) -> Self {
        self.engines = Some(Arc::new(engines));
        self
    }

    /// Makes the cluster's tables if missing (with [`partitions`](Self::partitions)
    /// partitions), joins it and starts the member. The member takes partitions as the
    /// coordinator assigns them; [`Cluster::wait_owning`] waits for the first.
    ///
    /// Works from any async context, as [`ExecutorBuilder::start`] does: inside an
    /// actix system the member and its engines join it; anywhere else (a plain tokio
    /// runtime) they run in an actix system of their own on a thread the member owns,
    /// which [`Cluster::leave`] ends.
    ///
    /// # Errors
    /// [`Error::Config`] without [`engines`](Self::engines), or when its thread cannot
    /// start; [`Error::Store`] if the database cannot be reached or the schema holds a
    /// single engine's store.
    pub async fn start(self) -> Result<Cluster<E>, Error> {
        if actix::Arbiter::try_current().is_some() {
            return self.start_here(false).await;
        }
        let (started, answer) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("proctor-member".into())
            .spawn(move || {
                let system = actix::System::new();
                let result = system.block_on(self.start_here(true));
                let ok = result.is_ok();
                if started.send(result).is_ok() && ok {
                    let _ = system.run();
                }
            })
            .map_err(|e| Error::Config(format!("cannot start the member's system thread: {e}")))?;
        answer.await.map_err(|_| {
            Error::Internal("the member's system thread ended while starting".into())
        })?
    }

    /// Starts the member in the current actix system; `owned`: the system is the
    /// member's own, stopped when it leaves.
    async fn start_here(self, owned: bool) -> Result<Cluster<E>, Error> {
        let engines = self.engines.clone().ok_or_else(|| {
            Error::Config(
                "a cluster member needs its engines: give the builder .engines(|| \
                 Executor::builder().registry(..))"
                    .into(),
            )
        })?;
        let registry = Arc::new(engines().into_registry());
        let (url, options, wanted) = (self.url.clone(), self.options.clone(), self.partitions);
        let (db, partitions) = tokio::task::spawn_blocking(move || {
            let mut db = db::ClusterDb::new(&url, &options)?;
            let partitions = db.create(wanted)?;
            Ok::<_, crate::store::StoreError>((db, partitions))
        })
        .await
        .map_err(|e| Error::Internal(format!("creating the cluster: {e}")))??;
        let routes = Arc::new(Routes::new(partitions));
        let self_name = self.name.clone();
        let shared = Arc::new(db::Shared::default());
        let setup = node::Setup {
            url: self.url,
            name: self.name.clone(),
            options: self.options,
            partitions,
            period: self.period,
            engines,
            registry: registry.clone(),
            routes: routes.clone(),
        };
        let (addr, requests) = node::NodeActor::start_with(setup, db, shared.clone(), owned)?;
        Ok(Cluster {
            inner: Arc::new(Inner {
                name: self.name,
                partitions,
                period: self.period,
                addr,
                routes,
                registry,
                requests,
                shared,
                nonces: Nonces::new(&self_name),
            }),
        })
    }
}

/// Which partitions the member runs, and their engines: read by every submit.
pub(crate) struct Routes<E: Send + Sync + 'static> {
    partitions: u32,
    running: RwLock<Running<E>>,
}

struct Running<E: Send + Sync + 'static> {
    engines: Vec<Option<Executor<E>>>,
    /// The partitions with an engine, in order.
    local: Vec<u32>,
    /// Turns over the local partitions for roots without a key.
    next: usize,
}

impl<E: Send + Sync + 'static> Routes<E> {
    fn new(partitions: u32) -> Self {
        Routes {
            partitions,
            running: RwLock::new(Running {
                engines: (0..partitions).map(|_| None).collect(),
                local: Vec::new(),
                next: 0,
            }),
        }
    }

    /// The engine of `partition`, if this member runs it.
    fn engine(&self, partition: u32) -> Option<Executor<E>> {
        let running = self
            .running
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        running.engines.get(partition as usize)?.clone()
    }

    /// A partition this member runs, in turn, with its engine.
    fn any_local(&self) -> Option<(u32, Executor<E>)> {
        let mut running = self
            .running
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if running.local.is_empty() {
            return None;
        }
        running.next = running.next.wrapping_add(1);
        let partition = running.local[running.next % running.local.len()];
        let engine = running.engines[partition as usize].clone()?;
        Some((partition, engine))
    }

    pub(crate) fn set(&self, partition: u32, engine: Option<Executor<E>>) {
        let mut running = self
            .running
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(slot) = running.engines.get_mut(partition as usize) {
            *slot = engine;
        }
        let local: Vec<u32> = (0..self.partitions)
            .filter(|p| running.engines[*p as usize].is_some())
            .collect();
        running.local = local;
    }

    pub(crate) fn local(&self) -> Vec<u32> {
        let running = self
            .running
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        running.local.clone()
    }
}

struct Inner<E: Send + Sync + 'static> {
    name: String,
    partitions: u32,
    period: Duration,
    addr: Addr<NodeActor<E>>,
    routes: Arc<Routes<E>>,
    registry: Arc<Registry<E>>,
    requests: std::sync::mpsc::Sender<db::Request>,
    shared: Arc<db::Shared>,
    nonces: Nonces,
}

/// The nonces of forwarded submits that came without one: unique to this member's
/// incarnation (its name and start time as the group, a counter as the nonce).
struct Nonces {
    group: u64,
    next: std::sync::atomic::AtomicU64,
}

impl Nonces {
    fn new(name: &str) -> Nonces {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let key = format!("proctor member {name} {started}");
        Nonces {
            group: Nonce::from_key(&key).group,
            next: std::sync::atomic::AtomicU64::new(1),
        }
    }

    fn next(&self) -> Nonce {
        Nonce {
            group: self.group,
            nonce: self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }
}

/// A member of a cluster of executors sharing one PostgreSQL store (see
/// `ARCHITECTURE.md`, "A cluster of executors"): a cheap, cloneable handle. Any member
/// takes any request: a root whose partition another member owns is forwarded to it
/// through the store, and a result is read wherever its root runs.
///
/// ```no_run
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct CreateTable;
/// # #[async_trait] impl Procedure for CreateTable {
/// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
/// # async fn f() -> Result<(), proctor::Error> {
/// use proctor::{Cluster, Executor, PgOptions, Registry};
/// let cluster = Cluster::builder("host=db.internal user=proctor dbname=control", "master-a")
///     .options(PgOptions::default().schema("control_cluster"))
///     .engines(|| {
///         let mut registry = Registry::new();
///         registry.register::<CreateTable>("create_table");
///         Executor::builder().registry(registry).arbiters(1)
///     })
///     .start()
///     .await?;
/// let id = cluster.submit(CreateTable).await?;
/// cluster.wait(id).await?.expect("created");
/// cluster.leave().await?;
/// # Ok(()) }
/// ```
pub struct Cluster<E: Send + Sync + 'static = ()> {
    inner: Arc<Inner<E>>,
}

impl<E: Send + Sync + 'static> Clone for Cluster<E> {
    fn clone(&self) -> Self {
        Cluster {
            inner: self.inner.clone(),
        }
    }
}

impl<E: Send + Sync + 'static> std::fmt::Debug for Cluster<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("name", &self.inner.name)
            .field("partitions", &self.inner.partitions)
            .finish_non_exhaustive()
    }
}

/// How often a member looks for answers to its forwarded submits and for submits
/// forwarded to it.
pub(crate) const POLL: Duration = Duration::from_millis(20);

impl Cluster<()> {
    /// A builder for the member named `name` (unique in the cluster: a member whose
    /// name is still live elsewhere waits until that membership expires) of the
    /// cluster whose store is at `url`.
    pub fn builder<E: Send + Sync + 'static>(
        url: impl Into<String>,
        name: impl Into<String>,
    ) -> ClusterBuilder<E> {
        ClusterBuilder {
            url: url.into(),
            name: name.into(),
            options: PgOptions::default(),
            partitions: 8,
            period: Duration::from_secs(30),
            engines: None,
        }
    }
}

impl<E: Send + Sync + 'static> Cluster<E> {
    /// The member's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The cluster's number of partitions.
    pub fn partitions(&self) -> u32 {
        self.inner.partitions
    }

    /// The membership's period.
    pub fn period(&self) -> Duration {
        self.inner.period
    }

    /// The partitions this member runs now.
    pub fn owned(&self) -> Vec<u32> {
        self.inner.routes.local()
    }

    /// The engine of `partition`, if this member runs it: for the requests a cluster
    /// does not forward (abort, pause, queries), sent to the partition's owner.
    pub fn engine(&self, partition: u32) -> Option<Executor<E>> {
        self.inner.routes.engine(partition)
    }

    /// The partition root `id` belongs to.
    pub fn partition_of(&self, id: ProcId) -> u32 {
        crate::cluster::partition_of_id(id, self.inner.partitions)
    }

    /// Waits until this member runs at least one partition.
    ///
    /// # Errors
    /// [`Error::Stopped`] once the member has left.
    pub async fn wait_owning(&self) -> Result<(), Error> {
        loop {
            if !self.owned().is_empty() {
                return Ok(());
            }
            if !self.inner.addr.connected() {
                return Err(Error::Stopped);
            }
            actix::clock::sleep(POLL).await;
        }
    }

    /// Submits a root to the cluster and answers its id once its insert is durable in
    /// its partition. The partition is its key's ([`Procedure::affinity`]), else its
    /// nonce's, else one this member runs (the next in turn). If another member owns
    /// it, the root is written for that member to submit, and the answer waits for
    /// that submit (until an owner takes the partition, if it has none now).
    ///
    /// # Errors
    /// As [`Executor::submit`]; [`Error::Registry`] if a root to forward does not
    /// encode; [`Error::Store`] if the store cannot be reached. Never
    /// [`Error::NotLeader`]: a submit that meets its partition leaving this member is
    /// forwarded to the partition's next owner, under a nonce that makes it run once.
    pub async fn submit<P: Procedure<E>>(&self, proc: P) -> Result<ProcId, Error> {
        self.submit_routed(Box::new(proc), None).await
    }

    /// [`submit`](Self::submit), boxed.
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    pub async fn submit_boxed(&self, proc: Box<dyn Procedure<E>>) -> Result<ProcId, Error> {
        self.submit_routed(proc, None).await
    }

    /// [`submit`](Self::submit) at most once per `nonce`, on whichever member: a
    /// root without a key goes to its nonce's partition, so a retry meets the first
    /// submit there.
    ///
    /// # Errors
    /// As [`Executor::submit_with_nonce`].
    pub async fn submit_with_nonce(
        &self,
        proc: Box<dyn Procedure<E>>,
        nonce: Nonce,
    ) -> Result<ProcId, Error> {
        self.submit_routed(proc, Some(nonce)).await
    }

    async fn submit_routed(
        &self,
        proc: Box<dyn Procedure<E>>,
        nonce: Option<Nonce>,
    ) -> Result<ProcId, Error> {
        let partitions = self.inner.partitions;
        let key = proc.affinity();
        let partition = match (&key, nonce) {
            (Some(key), _) => Some(crate::cluster::partition_of_key(key, partitions)),
            (None, Some(nonce)) => Some(crate::cluster::partition_of_key(
                &format!("{}:{}", nonce.group, nonce.nonce),
                partitions,
            )),
            (None, None) => None,
        };
        let local = match partition {
            Some(p) => self.inner.routes.engine(p).map(|e| (p, e)),
            None => self.inner.routes.any_local(),
        };
        if let Some((p, engine)) = local {
            // Every root goes in under a nonce (the caller's, or one of the member's
            // own), so a submit that meets its partition leaving is forwarded to the
            // partition's next owner, where the nonce finds it if it went in.
            let nonce = nonce.unwrap_or_else(|| self.inner.nonces.next());
            let (name, bytes) = self.inner.registry.encode(&*proc)?;
            return match engine.submit_boxed(proc).nonce(nonce).await {
                Err(Error::NotLeader { .. } | Error::Stopped) => {
                    self.forward(name, bytes, p, Some(nonce)).await
                }
                other => other,
            };
        }
        let (name, bytes) = self.inner.registry.encode(&*proc)?;
        let p = match partition {
            Some(p) => p,
            None => {
                u32::try_from(self.inner.nonces.next().nonce % u64::from(partitions)).unwrap_or(0)
            }
        };
        self.forward(name, bytes, p, nonce).await
    }

    /// Writes a root for its partition's owner and waits for the owner's answer.
    async fn forward(
        &self,
        type_name: &str,
        state: Vec<u8>,
        partition: u32,
        nonce: Option<Nonce>,
    ) -> Result<ProcId, Error> {
        let nonce = nonce.unwrap_or_else(|| self.inner.nonces.next());
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.inner
            .requests
            .send(db::Request::Forward(
                crate::actors::pg_store::cluster::Forwarded {
                    nonce,
                    partition,
                    type_name: type_name.to_string(),
                    state,
                },
                tx,
            ))
            .map_err(|_| Error::Stopped)?;
        match rx.await.map_err(|_| Error::Stopped)? {
            Ok(id) => Ok(id),
            Err(e) => Err(e),
        }
    }

    /// Waits until root `id` is finished, wherever it runs, and answers as
    /// [`Executor::wait`] does: on the engine of its partition if this member runs it,
    /// else by reading its record in the store until it is final.
    ///
    /// # Errors
    /// As [`Executor::wait`]; [`Error::Gone`] for a root the store no longer has
    /// (evicted after its retention, or never written).
    pub async fn wait(&self, id: ProcId) -> Result<Result<(), Failure>, Error> {
        let partition = self.partition_of(id);
        let mut delay = POLL;
        loop {
            if let Some(engine) = self.inner.routes.engine(partition) {
                match engine.wait(id).await {
                    // The partition went meanwhile: read the store.
                    Err(Error::NotLeader { .. } | Error::Stopped) => {}
                    other => return other,
                }
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            self.inner
                .requests
                .send(db::Request::Root(id, tx))
                .map_err(|_| Error::Stopped)?;
            match rx.await.map_err(|_| Error::Stopped)?? {
                crate::actors::pg_store::cluster::RootRow::Missing => {
                    return Err(Error::Gone(id));
                }
                crate::actors::pg_store::cluster::RootRow::Found(record) => match record.state {
                    crate::procedure::ProcState::Success => return Ok(Ok(())),
                    crate::procedure::ProcState::RolledBack => {
                        return Ok(Err(record.failure.map(|f| *f).unwrap_or_else(|| Failure {
                            proc: id,
                            type_name: record.type_name.to_string(),
                            error: crate::procedure::ProcError::failed("rolled back"),
                        })));
                    }
                    _ => {}
                },
            }
            actix::clock::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }

    /// The cluster as its tables have it: partitions, owners, epochs, members, moves.
    ///
    /// # Errors
    /// [`Error::Store`] if the store cannot be read.
    pub async fn state(&self) -> Result<ClusterState, Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.inner
            .requests
            .send(db::Request::State(tx))
            .map_err(|_| Error::Stopped)?;
        Ok(rx.await.map_err(|_| Error::Stopped)??)
    }

    /// How many roots of the whole cluster are unfinished, and how many forwarded
    /// submits wait for an owner.
    ///
    /// # Errors
    /// [`Error::Store`] if the store cannot be read.
    pub async fn unfinished(&self) -> Result<(u64, u64), Error> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.inner
            .requests
            .send(db::Request::Unfinished(tx))
            .map_err(|_| Error::Stopped)?;
        let (roots, waiting) = rx.await.map_err(|_| Error::Stopped)??;
        Ok((
            u64::try_from(roots).unwrap_or(0),
            u64::try_from(waiting).unwrap_or(0),
        ))
    }

    /// Leaves the cluster: stops the engine of each partition it runs (a graceful
    /// shutdown), gives the partitions back for the coordinator to assign at once,
    /// and ends the membership and the coordination (and the member's own actix
    /// system, if it started one). Dropping the last handle does not leave: the member
    /// runs on until its process ends, and its partitions move only once its
    /// membership expires.
    ///
    /// # Errors
    /// [`Error::Stopped`] if it had already left.
    pub async fn leave(&self) -> Result<(), Error> {
        self.inner.addr.send(node::Leave).await?;
        Ok(())
    }

    /// Whether this member coordinates the cluster now.
    pub fn coordinates(&self) -> bool {
        self.inner.shared.coordinating().is_some()
    }
}
