//! The executor: the engine's public address. [`ExecutorBuilder`] configures and starts
//! it; [`Executor`] is a cheap, `Send` handle with async methods; [`ExecutorActor`] takes
//! the same requests as messages ([`Submit`], [`Abort`], [`GetState`], [`WaitFor`],
//! [`List`], [`WakeEvent`]) for code that talks to actors.
//!
//! The executor itself does little: it names and encodes a submitted procedure, starts
//! its tree on one of the arbiters' shards, and answers once the tree's root stack has
//! made the insert durable. It keeps the waiters for results.

use std::collections::{HashMap, VecDeque};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::erased::{erase, erase_boxed, AnyEnv, DynProc};
use crate::error::Error;
use crate::fast_map::IdMap;
use crate::locks::Lock;
use crate::procedure::{ProcId, ProcState, Procedure};
use crate::ready_queue::Scheduling;
use crate::record::{Failure, Nonce, Paused, ProcRecord, Steering, StoreOp};
use crate::recovery::{self, CorruptProc};
use crate::registry::{Registry, Types};
use crate::store::{LastStop, MemoryStore, ProcedureStore};

use super::guard::{decode_guarded, guard};
use super::persistence::Persistence;
use super::procedure::{declare, Undeclarable};
use super::protocol::{
    AbortRequest, BypassRequest, Command, CommandRequest, DurableAck, Persist, Quiesce, Refuse,
    Regrant, StopWriter, TreeAddr, TreeFinished, TreeNews,
};
use super::root_stack::{publish_recovered, Objects, TreeRunner};
use super::scheduler::{
    GetSchedulerStats, Monitor, Queueing, ResetEvent, Scheduler, SchedulerStats, WakeEvent,
};
use super::shard::{Mail, Shard};
use super::shared::{now_ms, Entry, EntryExtra, SchedulerViews, Shared, Waiting};

impl From<MailboxError> for Error {
    fn from(_: MailboxError) -> Self {
        Error::Stopped
    }
}

/// How many recovered trees are gathered before they go to their shards (one message
/// per shard).
const RECOVERED_STARTS_PER_MESSAGE: usize = 4096;

/// Below this many recovered trees, the executor builds them on its own thread.
const PARALLEL_START_MIN: usize = 4096;

/// `items` in up to `parts` runs of about equal length, in order; one run if there are
/// fewer than `min`.
fn split_evenly<T>(items: Vec<T>, parts: usize, min: usize) -> Vec<Vec<T>> {
    if items.len() < min || parts <= 1 {
        return vec![items];
    }
    let len = items.len().div_ceil(parts);
    let mut items = items.into_iter();
    std::iter::from_fn(|| {
        Some(items.by_ref().take(len).collect::<Vec<T>>()).filter(|run| !run.is_empty())
    })
    .collect()
}

/// Configuration of an executor, with defaults that suit a control plane.
///
/// ```
/// use proctor::{Executor, MemoryStore, Registry};
/// let builder = Executor::builder()
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
            .finish()
    }
}

/// How long finished roots' results are kept, and how often the cleaner looks.
#[derive(Clone, Copy, Debug)]
struct Retention {
    kept: Duration,
    after_ack: Duration,
    every: Duration,
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
            registry: Registry::default(),
            env: None,
            permits: Vec::new(),
            max_unfinished: 1_000_000,
            retention: Retention {
                kept: Duration::from_secs(15 * 60),
                after_ack: Duration::from_secs(5 * 60),
                every: Duration::from_secs(30),
            },
            monitor: Monitor {
                every: Duration::from_secs(5),
                stuck_after: Duration::from_secs(10),
                retire_after: Duration::from_secs(60),
            },
            drain_timeout: Duration::from_secs(30),
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

    /// How many steps may run at once (default 16). Waiting procedures hold none.
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
    /// let builder = Executor::builder().scheduling(Scheduling::Fifo);
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
    /// a second or more use at most `workers - n` workers. Default: 1 with 4 workers or
    /// more, else 0; always fewer than the workers. [`Scheduling::Fifo`] ignores it.
    ///
    /// ```
    /// let builder = proctor::Executor::builder().workers(8).reserved_workers(2);
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
    /// Default 1. An executor without system types never uses them.
    ///
    /// ```
    /// let builder = proctor::Executor::builder().workers(8).system_workers(2);
    /// # let _ = builder;
    /// ```
    #[must_use]
    pub fn system_workers(mut self, n: usize) -> Self {
        self.system_workers = n;
        self
    }

    /// How many arbiters (threads) the trees are spread over, round robin (default:
    /// one per core). The procedures of one tree run on their tree's arbiter.
    #[must_use]
    pub fn arbiters(mut self, arbiters: usize) -> Self {
        self.arbiters = arbiters;
        self
    }

    /// Where records go (default: a fresh [`MemoryStore`], which survives nothing).
    #[must_use]
    pub fn store(mut self, store: impl ProcedureStore) -> Self {
        self.store = Some(Box::new(store));
        self
    }

    /// The procedure types this executor can persist and recover. Their environment
    /// type `F` becomes the executor's: give the registry first, then
    /// [`env`](Self::env). An environment given before, of another type, is dropped.
    #[must_use]
    pub fn registry<F: Send + Sync + 'static>(self, registry: Registry<F>) -> ExecutorBuilder<F> {
        let env = self
            .env
            .and_then(|env| (env as Arc<AnyEnv>).downcast::<F>().ok());
        ExecutorBuilder {
            workers: self.workers,
            scheduling: self.scheduling,
            reserved_workers: self.reserved_workers,
            system_workers: self.system_workers,
            arbiters: self.arbiters,
            store: self.store,
            registry,
            env,
            permits: self.permits,
            max_unfinished: self.max_unfinished,
            retention: self.retention,
            monitor: self.monitor,
            drain_timeout: self.drain_timeout,
        }
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
    ///     .registry(Registry::<Cluster>::default())
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
    /// let builder = proctor::Executor::builder().permits("ddl/db1", 4);
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
            return self.start_here(false).await;
        }
        let (started, answer) = oneshot::channel();
        let (gone, system_gone) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("proctor-system".into())
            .spawn(move || {
                let system = actix::System::new();
                let result = system.block_on(self.start_here(true));
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
        let addr = executor.addr.clone();
        executor.system = Some(Arc::new(OwnedSystem {
            gone: std::sync::Mutex::new(Some((system_gone, thread))),
            stop: Box::new(move || addr.do_send(Shutdown::graceful())),
        }));
        Ok(executor)
    }

    /// Starts the actors in the current actix system; `owned`: the system is the
    /// executor's own, stopped by its shutdown.
    async fn start_here(self, owned: bool) -> Result<Executor<E>, Error> {
        let env: Arc<AnyEnv> = match self.env {
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
        let mut store = self.store.unwrap_or_else(|| Box::new(MemoryStore::new()));
        let snapshot = store.load_parts()?;
        // A drained stop's mark holds for one start: this engine may run a step (a
        // recovered waiter's, say) before it first appends, so the mark goes first.
        if snapshot.last_stop != LastStop::Unknown {
            store.mark_running()?;
        }
        let registry = self.registry.into_types();
        let names = |name: &str| registry.static_name(name);
        let cut_off = recovery::may_be_cut_off(&snapshot.last_stop);
        let mut plan = super::recover::plan(snapshot.parts, &names, &cut_off, now_ms());
        // The procedures recovery takes as possibly cut off, for this engine's own
        // drained stop to pass on if they have not run a step by then.
        let cut_off: Vec<ProcId> = plan.each_tree().flat_map(|t| t.stack.cut_off()).collect();
        let mut corrupt = std::mem::take(&mut plan.corrupt);
        // Decode every unfinished procedure before anything starts, so that hooks run
        // in the plan's order (children before parents) and a tree that cannot be
        // decoded is reported whole.
        let mut trees = Vec::with_capacity(plan.tree_count());
        for tree in std::mem::take(&mut plan.trees).into_iter().flatten() {
            let records = plan.records_of(&tree);
            match decode_tree(&registry, records) {
                Ok(decoded) => trees.push((tree, decoded)),
                Err(reason) => corrupt.extend(records.iter().map(|r| CorruptProc {
                    id: r.id,
                    root: r.root,
                    reason: reason.clone(),
                })),
            }
        }
        for c in &corrupt {
            tracing::error!(proc = %c.id, root = %c.root, reason = %c.reason, "cannot recover procedure");
        }
        let mut recovered_roots: Vec<ProcId> = trees.iter().map(|(t, _)| t.stack.root()).collect();
        recovered_roots.sort_unstable();
        let report = Arc::new(Recovery {
            recovered_roots,
            finished_roots: plan.finished.len(),
            corrupt,
            repairs: snapshot.repairs,
        });
        super::metrics::describe();
        let persistence = Persistence::new(store)
            .map_err(|e| Error::Config(format!("cannot start the store writer thread: {e}")))?;
        let views = Arc::new(SchedulerViews {
            fair: self.scheduling == Scheduling::Fair,
            ..SchedulerViews::default()
        });
        let reserved = self
            .reserved_workers
            .unwrap_or(usize::from(self.workers >= 4));
        let scheduler = Scheduler::new(
            self.workers,
            Queueing {
                scheduling: self.scheduling,
                reserved,
                system_workers: self.system_workers,
                system: registry.system(),
            },
            self.monitor,
            self.permits,
            views.clone(),
            persistence,
        )
        .start();
        // Locks held for life when the engine stopped go back to their holders, roots
        // first, before any tree is started and can ask for anything.
        let mut held: Vec<_> = trees
            .iter()
            .flat_map(|(t, _)| t.stack.held_locks())
            .collect();
        held.sort_by_key(|r| (r.root, r.owner));
        if !held.is_empty() {
            scheduler.do_send(Regrant(held));
        }
        let max_unfinished = self.max_unfinished;
        let retention = self.retention;
        let drain_timeout = self.drain_timeout;
        let unfinished = trees.len();
        // Results to evict, oldest first (recovered ones by when they finished).
        let mut finished_at: Vec<(u64, ProcId)> =
            plan.finished.iter().map(|r| (r.updated_ms, r.id)).collect();
        finished_at.sort_unstable();
        // Every root record keeps its nonce, finished or not.
        let nonces: HashMap<Nonce, NonceState> = plan
            .finished
            .iter()
            .chain(trees.iter().flat_map(|(t, _)| plan.records_of(t)))
            .filter(|r| r.parent.is_none())
            .filter_map(|r| Some((r.nonce?, NonceState::Known(r.id))))
            .collect();
        let arbiters: Vec<Arbiter> = (0..self.arbiters).map(|_| Arbiter::new()).collect();
        let handles = arbiters.iter().map(Arbiter::handle).collect();
        let shards = arbiters
            .iter()
            .map(|arbiter| {
                let scheduler = scheduler.clone();
                Shard::start_in_arbiter(&arbiter.handle(), |_| Shard::new(scheduler))
            })
            .collect();
        let finished = std::mem::take(&mut plan.finished);
        let table_capacity = finished.len()
            + trees
                .iter()
                .map(|(t, _)| plan.records_of(t).len())
                .sum::<usize>();
        let addr = ExecutorActor::<E>::create(move |ctx| {
            let shared = Arc::new(Shared::new(
                registry,
                env,
                views,
                scheduler,
                ctx.address().recipient(),
                ctx.address().recipient(),
                handles,
                shards,
                snapshot.max_id,
                table_capacity,
            ));
            for record in finished {
                // Finished roots keep their results across restarts.
                shared.table.insert(
                    record.id,
                    Entry {
                        root: record.root,
                        parent: record.parent,
                        type_name: shared
                            .registry
                            .static_name(&record.type_name)
                            .unwrap_or("?"),
                        state: record.state,
                        submitted_ms: record.submitted_ms,
                        updated_ms: record.updated_ms,
                        tree: None,
                        extra: EntryExtra {
                            result: Some(record.failure.map_or(Ok(()), Err)),
                            value: record.result,
                            nonce: record.nonce,
                        }
                        .boxed(),
                        waiting: Waiting::Nothing,
                        state_name: None,
                        steering: None,
                    },
                );
            }
            // The trees go to their shards a few thousand to a message, all of them
            // before the executor handles any request. A large recovery builds them on
            // every core.
            let chunks = split_evenly(trees, super::recover::cores(), PARALLEL_START_MIN);
            super::recover::on_threads(chunks, |chunk| {
                let mut starts = Mail::default();
                for (n, (tree, (objects, rerun))) in chunk.into_iter().enumerate() {
                    if n % RECOVERED_STARTS_PER_MESSAGE == 0 {
                        starts.send();
                    }
                    // Finished children stay out: nothing stops (and unlists) them later.
                    let records = plan
                        .records_of(&tree)
                        .iter()
                        .filter(|r| r.parent.is_none() || !r.state.is_finished());
                    let addr = shared.new_tree(tree.stack.root());
                    // In the table before the executor handles any request (it is not
                    // running yet): recovered records are durable by definition.
                    publish_recovered(&shared, records, &addr);
                    let runner = TreeRunner::recover(
                        shared.clone(),
                        addr.clone(),
                        tree.stack,
                        tree.start,
                        objects,
                        rerun,
                    );
                    addr.start_by(&mut starts, runner);
                }
                starts.send();
            });
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
                acked: IdMap::default(),
                evicting: false,
                owned_system: owned,
                drain_timeout,
                stopping: false,
                cut_off,
                subscribers: Vec::new(),
                env: PhantomData,
            }
        });
        if !report.recovered_roots.is_empty() {
            tracing::info!(
                recovered = report.recovered_roots.len(),
                finished = report.finished_roots,
                corrupt = report.corrupt.len(),
                "recovered procedures"
            );
        }
        Ok(Executor {
            addr,
            report,
            system: None,
        })
    }
}

/// The actix system an executor started for itself, and how to see its thread end.
struct OwnedSystem {
    gone: std::sync::Mutex<Option<(oneshot::Receiver<()>, std::thread::JoinHandle<()>)>>,
    /// Asks the executor to shut down (gracefully), for when the last handle goes.
    stop: Box<dyn Fn() + Send + Sync>,
}

impl Drop for OwnedSystem {
    /// The last handle went without a shutdown: the engine shuts down on its own
    /// threads (as `shutdown` does, without anyone waiting), and its system thread then
    /// ends, releasing the store. Left running, nobody could reach it again, and it
    /// would hold the store (a WAL directory's lock) until the process ended.
    fn drop(&mut self) {
        let running = self.gone.get_mut().map_or(true, |g| g.is_some());
        if running {
            (self.stop)();
        }
    }
}

/// Decodes the unfinished procedures of a recovered tree and runs their
/// `before_recover` hooks, children first. Also returns the suspended procedures that
/// run their next step at once rather than wait for their event again.
fn decode_tree(registry: &Types, records: &[ProcRecord]) -> Result<(Objects, Vec<ProcId>), String> {
    let mut objects = Vec::new();
    let mut rerun = Vec::new();
    for r in records.iter().filter(|r| !r.state.is_finished()) {
        // The user's `Deserialize` runs here: a panic in it makes the tree corrupt,
        // named, rather than ending the engine's start.
        let mut proc = decode_guarded(registry, &r.type_name, &r.data)
            .map_err(|e| format!("procedure {}: {e}", r.id))?;
        if let Err(e) = guard("before_recover", || proc.before_recover()) {
            tracing::error!(proc = %r.id, %e, "before_recover panicked");
        }
        // Paused while it waited (an operator's pause), it asks the same question:
        // continued, does it run its next step or wait for the event again?
        if let (ProcState::Waiting | ProcState::Paused, Some(event)) = (r.state, &r.event) {
            match guard("rerun_after_recover", || proc.rerun_after_recover(event)) {
                Ok(true) => rerun.push(r.id),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(proc = %r.id, %e, "rerun_after_recover panicked; re-running");
                    rerun.push(r.id);
                }
            }
        }
        objects.push((r.id, (proc, r.data.clone())));
    }
    Ok((objects.into_iter().collect(), rerun))
}

/// What the executor found in its store when it started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Roots of the unfinished trees it carries on, by id.
    pub recovered_roots: Vec<ProcId>,
    /// Finished roots whose results it keeps.
    pub finished_roots: usize,
    /// Procedures it could not rebuild (left in the store for an operator).
    pub corrupt: Vec<CorruptProc>,
    /// What opening the store changed on disk (e.g. a torn WAL tail truncated), one line
    /// each naming the file, the byte offset and what was done.
    pub repairs: Vec<String>,
}

/// A handle on a running executor. Cheap to clone and `Send`: use it from actors or
/// from plain tokio tasks.
///
/// ```no_run
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure, Registry, Executor};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct Noop;
/// # #[async_trait] impl Procedure for Noop {
/// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
/// #[actix::main]
/// async fn main() -> Result<(), proctor::Error> {
///     let mut registry = Registry::new();
///     registry.register::<Noop>("noop");
///     let executor = Executor::builder().registry(registry).start().await?;
///     let id = executor.submit(Noop).await?;
///     assert!(executor.wait(id).await?.is_ok());
///     Ok(())
/// }
/// ```
///
/// `E` is the environment its procedures get (see [`Procedure`](crate::Procedure)).
pub struct Executor<E = ()>
where
    E: Send + Sync + 'static,
{
    addr: Addr<ExecutorActor<E>>,
    report: Arc<Recovery>,
    /// Set when the executor runs its own actix system (started outside one).
    system: Option<Arc<OwnedSystem>>,
}

impl<E: Send + Sync + 'static> Clone for Executor<E> {
    fn clone(&self) -> Self {
        Executor {
            addr: self.addr.clone(),
            report: self.report.clone(),
            system: self.system.clone(),
        }
    }
}

impl<E: Send + Sync + 'static> std::fmt::Debug for Executor<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("connected", &self.addr.connected())
            .field("own_system", &self.system.is_some())
            .finish_non_exhaustive()
    }
}

impl Executor {
    /// A builder with the defaults.
    pub fn builder() -> ExecutorBuilder {
        ExecutorBuilder::default()
    }
}

impl<E: Send + Sync + 'static> Executor<E> {
    /// What recovery found when the executor started.
    pub fn recovery(&self) -> &Recovery {
        &self.report
    }

    /// The executor actor, for sending the messages directly.
    pub fn addr(&self) -> &Addr<ExecutorActor<E>> {
        &self.addr
    }

    /// Submits a root procedure; answers with its id once its insert is durable.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] once a shutdown has begun; [`Error::Store`] or
    /// [`Error::Internal`] once the store has failed or the engine broke (this insert's
    /// failure included); [`Error::Overloaded`] at
    /// [`ExecutorBuilder::max_unfinished`] unfinished roots; [`Error::Registry`] if its
    /// type is not registered or its state does not serialize; [`Error::Invalid`] for a
    /// bad resource name in its locks or a panic in `locks`, `holds_lock` or
    /// `timeout_ms`.
    pub async fn submit(&self, proc: impl Procedure<E>) -> Result<ProcId, Error> {
        self.addr.send(Submit::new(proc)).await?
    }

    /// Submits a root procedure at most once per `nonce`: a retry with the same nonce
    /// (concurrent, or after a restart) answers the first submit's id and runs nothing.
    ///
    /// # Errors
    ///
    /// As [`submit`](Self::submit). A retry that comes while the first submit is on its
    /// way gets that submit's answer, error included; a failed submit frees the nonce.
    pub async fn submit_with_nonce(
        &self,
        proc: impl Procedure<E>,
        nonce: Nonce,
    ) -> Result<ProcId, Error> {
        self.addr.send(Submit::new(proc).with_nonce(nonce)).await?
    }

    /// Asks a procedure to abort. `Ok(true)` once it has accepted and its failure is
    /// durable (its tree then rolls back, even across a crash), `Ok(false)` if it
    /// refused. If the store fails first, the answer is that error and the abort did not
    /// happen.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::Finished`] if it has finished; [`Error::Refused`] past
    /// its tree's point of no return ([`Context::set_irreversible`](crate::Context::set_irreversible)),
    /// also when the tree passes it while the abort waits for a running step: the
    /// procedure is then paused instead, for an operator to continue; [`Error::Store`]
    /// or [`Error::Internal`] once the store has failed or the engine broke;
    /// [`Error::Stopped`] after shutdown.
    pub async fn abort(&self, id: ProcId) -> Result<bool, Error> {
        self.addr.send(Abort(id)).await?
    }

    /// Bypasses a stuck procedure (HBCK2's `bypass`): it is marked SUCCESS without
    /// running further or rolling back, its locks are released, and its parent goes on
    /// as if it had succeeded (bypassing a root ends its tree). With `recursive`, its
    /// unfinished descendants are bypassed too; without, a procedure with unfinished
    /// children is refused. Only a procedure that waits (for children, an event, a
    /// deadline, or an operator: PAUSED) can be bypassed, not one queued or in a step,
    /// and not in a tree that is rolling back (ROLLBACK_PAUSED included): each refusal
    /// is [`Error::BypassRefused`] with the reason.
    /// Answers once the bypass is durable.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::Finished`] if it has finished; [`Error::BypassRefused`] as
    /// above; [`Error::Store`] or [`Error::Internal`] once the store has failed or the
    /// engine broke; [`Error::Stopped`] after shutdown.
    pub async fn bypass(&self, id: ProcId, recursive: bool) -> Result<(), Error> {
        self.addr.send(Bypass { id, recursive }).await?
    }

    /// Pauses a procedure (PolarDB-X's `PAUSE DDL`) at its next step boundary: the
    /// step it is running (or is queued for) ends as usual, and the next one does not
    /// start; a waiting procedure pauses when it would run again. It is then PAUSED,
    /// persisted and holding its locks, until [`resume`](Self::resume) or
    /// [`rollback`](Self::rollback). Answers once PAUSED is durable.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] for a procedure that is not runnable or waiting (already
    /// paused, failed), in a tree rolling back, or that finished or whose tree failed
    /// before the pause took effect; as [`resume`](Self::resume) for a procedure not
    /// live, after shutdown or a store failure.
    pub async fn pause(&self, id: ProcId) -> Result<(), Error> {
        self.addr.send(Pause(id)).await?
    }

    /// Continues a paused procedure (PolarDB-X's `CONTINUE DDL`): a PAUSED one runs
    /// the step that failed again, from its recorded state, with its retries reset; a
    /// ROLLBACK_PAUSED one retries its rollback. Answers once that is durable.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] for a procedure in any other state, or PAUSED in a tree that
    /// has failed meanwhile (it is rolled back, not continued); [`Error::Finished`],
    /// [`Error::UnknownProcedure`] or [`Error::Gone`] for one not live; [`Error::Stopped`]
    /// after shutdown; the store's error once it has failed.
    #[doc(alias = "continue")]
    pub async fn resume(&self, id: ProcId) -> Result<(), Error> {
        self.addr.send(Continue(id)).await?
    }

    /// Rolls a procedure's tree back on an operator's word (`ROLLBACK DDL`). A PAUSED
    /// procedure fails ([`ProcError::Aborted`](crate::ProcError::Aborted)) and its tree
    /// rolls back, starting with the step that failed, which may have left effects.
    /// Any other live procedure is aborted as by [`abort`](Self::abort): a running
    /// step is cancelled, and the abort hook may refuse. Answers once the failure is
    /// durable.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] past the tree's point of no return
    /// ([`Context::set_irreversible`](crate::Context::set_irreversible): continue
    /// instead), for a procedure whose rollback is paused (continue it), in a tree
    /// already rolling back, or when the abort hook refuses; as [`resume`](Self::resume)
    /// for a procedure not live, after shutdown or a store failure.
    pub async fn rollback(&self, id: ProcId) -> Result<(), Error> {
        self.addr.send(Rollback(id)).await?
    }

    /// What the executor knows of a procedure now.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::Stopped`] after shutdown.
    pub async fn state(&self, id: ProcId) -> Result<ProcInfo, Error> {
        self.addr.send(GetState(id)).await?
    }

    /// Waits until the root procedure `id` has finished; its result is `Ok(())` for
    /// SUCCESS or the tree's original [`Failure`] for ROLLEDBACK.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::NotRoot`] for a child; [`Error::Store`] or
    /// [`Error::Internal`] if the store fails or the engine breaks before the tree
    /// finishes; [`Error::Stopped`] if the executor stops first.
    pub async fn wait(&self, id: ProcId) -> Result<Result<(), Failure>, Error> {
        self.addr.send(WaitFor(id)).await?
    }

    /// Waits like [`wait`](Self::wait), and for a root that succeeded also returns the
    /// value its last step set with [`Context::set_result`](crate::Context::set_result)
    /// (`None` if it set none).
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor, id: proctor::ProcId) -> Result<(), proctor::Error> {
    /// if let Ok(Some(region_count)) = executor.wait_value::<u32>(id).await? {
    ///     println!("created {region_count} regions");
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`wait`](Self::wait); [`Error::Gone`] also if the result is evicted before its
    /// value is read; [`Error::ValueType`] if the value does not decode as `T`.
    pub async fn wait_value<T: serde::de::DeserializeOwned>(
        &self,
        id: ProcId,
    ) -> Result<Result<Option<T>, Failure>, Error> {
        if let Err(failure) = self.wait(id).await? {
            return Ok(Err(failure));
        }
        let Some(bytes) = self.addr.send(GetValue(id)).await?? else {
            return Ok(Ok(None));
        };
        rmp_serde::from_slice(&bytes)
            .map(|v| Ok(Some(v)))
            .map_err(|e| Error::ValueType {
                id,
                reason: e.to_string(),
            })
    }

    /// Tells the executor the client has its result: it is evicted after the shorter
    /// retention ([`ExecutorBuilder::retention_after_ack`]).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known (evicted already); [`Error::NotRoot`] for a child;
    /// [`Error::NotFinished`] before the tree finishes; [`Error::Stopped`] after
    /// shutdown.
    pub async fn ack_result(&self, id: ProcId) -> Result<(), Error> {
        self.addr.send(AckResult(id)).await?
    }

    /// What the scheduler is doing: workers (with any extra), running and queued steps,
    /// lock holders and waiters.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn scheduler_stats(&self) -> Result<SchedulerStats, Error> {
        self.addr.send(GetSchedulerStats).await?
    }

    /// The procedures that pass `which` (see [`List`]), in id order: by default every
    /// unfinished one.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] or [`Error::Internal`] once the store has failed or the engine
    /// broke; [`Error::Stopped`] after shutdown.
    pub async fn list(&self, which: List) -> Result<Vec<ProcInfo>, Error> {
        self.addr.send(which).await?
    }

    /// Subscribes to [`ProcEvent`]s: every root submitted or finishing, and every
    /// procedure pausing, from now on.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// let mut events = executor.subscribe().await?;
    /// while let Some(event) = events.next().await {
    ///     if let proctor::ProcEvent::Finished { id, result, .. } = event {
    ///         println!("{id}: {result:?}");
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Store`] or [`Error::Internal`] once the store has failed or the engine
    /// broke; [`Error::Stopped`] after shutdown.
    pub async fn subscribe(&self) -> Result<Subscription, Error> {
        let (tx, events) = tokio::sync::mpsc::unbounded_channel();
        self.addr.send(SubscribeChannel(tx)).await??;
        Ok(Subscription { events })
    }

    /// Makes `event` ready and wakes the procedures suspended on it (see
    /// [`Flow::Suspend`](crate::Flow)); it stays ready until [`reset_event`](Self::reset_event).
    ///
    /// The waiters are handed to their trees oldest first, and each tree queues its
    /// procedure's next step. Trees on the same arbiter queue them in that order, so
    /// under [`Scheduling::Fifo`](crate::Scheduling::Fifo) the oldest waiter's step is
    /// queued first; trees on different arbiters (placed round robin, see
    /// [`ExecutorBuilder::arbiters`]) queue theirs concurrently, and which of those
    /// steps runs first is not promised. A service that needs its woken procedures to
    /// run in order runs one arbiter, or orders them itself (one waiter that starts the
    /// next).
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn wake_event(&self, event: impl Into<String>) -> Result<(), Error> {
        Ok(self.addr.send(WakeEvent(event.into())).await?)
    }

    /// Makes `event` not ready again: later suspensions on it wait for the next wake.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn reset_event(&self, event: impl Into<String>) -> Result<(), Error> {
        Ok(self.addr.send(ResetEvent(event.into())).await?)
    }

    /// Stops the executor gracefully: new submits are refused, no new step or rollback
    /// starts, the running ones end and their records become durable (within
    /// [`ExecutorBuilder::drain_timeout`]); then the arbiters and the store writer stop
    /// and the store (and its directory lock) is released. Unfinished procedures go on
    /// from their last record when an executor starts on the store again.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] if the executor had already stopped.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.stop(Shutdown::graceful()).await
    }

    /// Stops the executor at once: steps still running are cut off, exactly as by a
    /// crash; what is durable is what the next executor recovers. For tests.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] if the executor had already stopped.
    pub async fn shutdown_now(self) -> Result<(), Error> {
        self.stop(Shutdown::now()).await
    }

    async fn stop(self, how: Shutdown) -> Result<(), Error> {
        let stopped = self.addr.send(how).await;
        // An executor started outside actix also ends the system thread it started.
        let gone = self
            .system
            .as_ref()
            .and_then(|s| s.gone.lock().ok()?.take());
        if let Some((gone, thread)) = gone {
            let _ = gone.await;
            let _ = thread.join();
        }
        Ok(stopped?)
    }
}

/// What a waiting procedure waits for (see [`ProcInfo::waiting_on`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitingOn {
    /// Its children to finish.
    Children,
    /// The named event to be woken ([`Executor::wake_event`]).
    Event(String),
    /// Its timer: it runs again at this time (ms since the Unix epoch).
    Timer {
        /// When.
        at_ms: u64,
    },
    /// The engine locks in [`ProcInfo::locks_waiting`].
    Locks,
}

/// A snapshot of one procedure.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ProcInfo {
    /// The procedure.
    pub id: ProcId,
    /// The root of its tree.
    pub root: ProcId,
    /// Its parent, `None` for a root.
    pub parent: Option<ProcId>,
    /// Its registered type name.
    pub type_name: &'static str,
    /// Its state.
    pub state: ProcState,
    /// When it was submitted, ms since the Unix epoch.
    pub submitted_ms: u64,
    /// When its state last changed, ms since the Unix epoch.
    pub updated_ms: u64,
    /// For a finished root: its result.
    pub result: Option<Result<(), Failure>>,
    /// The engine locks it holds now (see [`Procedure::locks`](crate::Procedure::locks)).
    pub locks_held: Vec<Lock>,
    /// The engine locks it is waiting for (all granted together).
    pub locks_waiting: Vec<Lock>,
    /// The name of the state it is in ([`Procedure::state_name`]; for a
    /// [`StateMachine`](crate::StateMachine), its current state), as of its latest step.
    pub state_name: Option<String>,
    /// What it waits for, when it is not queued or running: children, an event, its
    /// timer, or engine locks.
    pub waiting_on: Option<WaitingOn>,
    /// What failure policies and operators did to it: retries spent on its current
    /// step, why it is PAUSED or ROLLBACK_PAUSED, whether it passed its point of no
    /// return.
    pub steering: Steering,
    /// For a RUNNABLE procedure under [`Scheduling::Fair`]: the level of the fair queue
    /// its steps are queued on (0 to 4, by its tree's accumulated step time: from 0, 1,
    /// 10, 60 and 300 s); `None` otherwise.
    pub queue_level: Option<u8>,
}

/// Submit a root procedure; answers its id once the insert is durable.
///
/// ```
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// # #[derive(serde::Serialize)] struct Noop;
/// # #[async_trait] impl Procedure for Noop {
/// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
/// let submit = proctor::Submit::new(Noop).with_nonce(proctor::Nonce { group: 7, nonce: 42 });
/// # let _ = submit;
/// ```
pub struct Submit<E = ()> {
    proc: DynProc,
    nonce: Option<Nonce>,
    env: PhantomData<fn() -> E>,
}

impl<E> std::fmt::Debug for Submit<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submit")
            .field("nonce", &self.nonce)
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> Submit<E> {
    /// Boxes the procedure.
    pub fn new(proc: impl Procedure<E>) -> Self {
        Submit {
            proc: erase(proc),
            nonce: None,
            env: PhantomData,
        }
    }

    /// An already boxed procedure.
    pub fn boxed(proc: Box<dyn Procedure<E>>) -> Self {
        Submit {
            proc: erase_boxed(proc),
            nonce: None,
            env: PhantomData,
        }
    }

    /// Makes the submit idempotent: another submit with the same nonce — concurrent, or
    /// after a restart — answers this one's id and runs nothing, for as long as the
    /// procedure's result is kept.
    #[must_use]
    pub fn with_nonce(mut self, nonce: Nonce) -> Self {
        self.nonce = Some(nonce);
        self
    }
}

impl<E> Message for Submit<E> {
    type Result = Result<ProcId, Error>;
}

/// Abort a procedure; answers whether it accepted.
#[derive(Clone, Copy, Debug)]
pub struct Abort(pub ProcId);

impl Message for Abort {
    type Result = Result<bool, Error>;
}

/// Bypass a stuck procedure (HBCK2's `bypass`); see [`Executor::bypass`].
#[derive(Clone, Copy, Debug)]
pub struct Bypass {
    /// The procedure.
    pub id: ProcId,
    /// Also bypass its unfinished descendants (required if it has any).
    pub recursive: bool,
}

impl Message for Bypass {
    type Result = Result<(), Error>;
}

/// Pause a procedure at its next step; see [`Executor::pause`].
#[derive(Clone, Copy, Debug)]
pub struct Pause(pub ProcId);

impl Message for Pause {
    type Result = Result<(), Error>;
}

/// Continue a PAUSED or ROLLBACK_PAUSED procedure; see [`Executor::resume`].
#[derive(Clone, Copy, Debug)]
pub struct Continue(pub ProcId);

impl Message for Continue {
    type Result = Result<(), Error>;
}

/// Roll a procedure's tree back on an operator's word; see [`Executor::rollback`].
#[derive(Clone, Copy, Debug)]
pub struct Rollback(pub ProcId);

impl Message for Rollback {
    type Result = Result<(), Error>;
}

/// What the executor knows of a procedure.
#[derive(Clone, Copy, Debug)]
pub struct GetState(pub ProcId);

impl Message for GetState {
    type Result = Result<ProcInfo, Error>;
}

/// Wait for a root procedure to finish.
#[derive(Clone, Copy, Debug)]
pub struct WaitFor(pub ProcId);

impl Message for WaitFor {
    type Result = Result<Result<(), Failure>, Error>;
}

/// A finished root's value (MessagePack), if its last step set one.
#[derive(Clone, Copy, Debug)]
pub struct GetValue(pub ProcId);

impl Message for GetValue {
    type Result = Result<Option<Vec<u8>>, Error>;
}

/// The client has a finished root's result: keep it only for the shorter retention.
#[derive(Clone, Copy, Debug)]
pub struct AckResult(pub ProcId);

impl Message for AckResult {
    type Result = Result<(), Error>;
}

/// Which procedures to list: by default every unfinished one. Filters combine (a
/// procedure must pass all of them); finished roots, whose results the executor keeps
/// for a while, only with [`with_finished`](Self::with_finished).
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// use proctor::{List, ProcState};
/// let waiting = executor
///     .list(List::new().state(ProcState::Waiting).type_name("create-table"))
///     .await?;
/// # let _ = waiting; Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct List {
    states: Vec<ProcState>,
    type_name: Option<String>,
    root: Option<ProcId>,
    finished: bool,
}

impl List {
    /// Every unfinished procedure.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only procedures in `state` (call again to allow more states). Asking for a
    /// finished state lists finished roots too.
    #[must_use]
    pub fn state(mut self, state: ProcState) -> Self {
        self.finished |= state.is_finished();
        self.states.push(state);
        self
    }

    /// Only procedures of the registered type `name`.
    #[must_use]
    pub fn type_name(mut self, name: impl Into<String>) -> Self {
        self.type_name = Some(name.into());
        self
    }

    /// Only the tree of root `root`.
    #[must_use]
    pub fn root(mut self, root: ProcId) -> Self {
        self.root = Some(root);
        self
    }

    /// Finished roots too (SUCCESS or ROLLEDBACK, kept for their results).
    #[must_use]
    pub fn with_finished(mut self) -> Self {
        self.finished = true;
        self
    }

    fn matches(&self, info: &ProcInfo) -> bool {
        (self.finished || !info.state.is_finished())
            && (self.states.is_empty() || self.states.contains(&info.state))
            && self
                .type_name
                .as_deref()
                .is_none_or(|t| t == info.type_name)
            && self.root.is_none_or(|r| r == info.root)
    }
}

impl Message for List {
    type Result = Result<Vec<ProcInfo>, Error>;
}

/// Stops the executor, as [`Executor::shutdown`] (graceful, the default) or
/// [`Executor::shutdown_now`] do: for code that holds only the executor's address.
/// Answers once the engine's threads and its store writer have stopped; an executor
/// that started its own actix system stops that system too.
///
/// ```no_run
/// # async fn f(addr: actix::Addr<proctor::ExecutorActor>) -> Result<(), actix::MailboxError> {
/// addr.send(proctor::Shutdown::graceful()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Shutdown {
    graceful: bool,
}

impl Shutdown {
    /// Drains first: no new step or rollback starts, running ones end and their records
    /// become durable, within the executor's
    /// [`drain_timeout`](ExecutorBuilder::drain_timeout).
    pub fn graceful() -> Self {
        Shutdown { graceful: true }
    }

    /// Stops at once, cutting off running steps as a crash would (for tests of
    /// recovery).
    pub fn now() -> Self {
        Shutdown { graceful: false }
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown::graceful()
    }
}

/// What happened to a root procedure, or to any procedure that paused, for subscribers
/// ([`Executor::subscribe`], [`Subscribe`]). Each root gives `Submitted` (once its
/// insert is durable) before `Finished`, and any `Paused` of its tree between them;
/// roots recovered at start give no `Submitted`, and procedures recovered paused give
/// no `Paused` (list them: `List::new().state(ProcState::Paused)`).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ProcEvent {
    /// A root was submitted: it is durable and will run to SUCCESS or ROLLEDBACK.
    Submitted {
        /// The root.
        id: ProcId,
        /// Its registered type name.
        type_name: &'static str,
    },
    /// A procedure (a root or a child) is durably paused and waits for an operator's
    /// [`Executor::resume`] or [`Executor::rollback`]: stopped by [`Executor::pause`],
    /// or by its [`FailurePolicy`](crate::FailurePolicy), or by a failure past the
    /// point of no return.
    Paused {
        /// The paused procedure.
        id: ProcId,
        /// Its root.
        root: ProcId,
        /// [`ProcState::Paused`] or [`ProcState::RollbackPaused`].
        state: ProcState,
        /// Why: the error and policy, or neither for an operator's pause.
        why: Paused,
    },
    /// A root's tree finished: `Ok` for SUCCESS, the original failure for ROLLEDBACK.
    Finished {
        /// The root.
        id: ProcId,
        /// Its registered type name.
        type_name: &'static str,
        /// Its result, as [`Executor::wait`] gives it.
        result: Result<(), Failure>,
    },
}

impl Message for ProcEvent {
    type Result = ();
}

/// Subscribes an actor to [`ProcEvent`]s: it receives every root's events from now on,
/// until it stops. For code that holds only the executor's address.
///
/// ```no_run
/// # use actix::prelude::*;
/// # struct Manager;
/// # impl Actor for Manager { type Context = Context<Self>; }
/// # impl Handler<proctor::ProcEvent> for Manager {
/// #     type Result = ();
/// #     fn handle(&mut self, _: proctor::ProcEvent, _: &mut Context<Self>) {}
/// # }
/// # async fn f(executor: Addr<proctor::ExecutorActor>, me: Addr<Manager>) -> Result<(), proctor::Error> {
/// executor.send(proctor::Subscribe(me.recipient())).await??;
/// # Ok(()) }
/// ```
pub struct Subscribe(pub Recipient<ProcEvent>);

impl std::fmt::Debug for Subscribe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Subscribe")
            .field(&"Recipient<ProcEvent>")
            .finish()
    }
}

impl Message for Subscribe {
    type Result = Result<(), Error>;
}

/// A stream of [`ProcEvent`]s from [`Executor::subscribe`]. Unbounded: read it, or
/// drop it.
#[derive(Debug)]
pub struct Subscription {
    events: tokio::sync::mpsc::UnboundedReceiver<ProcEvent>,
}

impl Subscription {
    /// The next event; `None` once the executor has stopped.
    pub async fn next(&mut self) -> Option<ProcEvent> {
        self.events.recv().await
    }
}

/// Where a subscriber's events go.
enum Subscriber {
    Actor(Recipient<ProcEvent>),
    Channel(tokio::sync::mpsc::UnboundedSender<ProcEvent>),
}

impl Subscriber {
    /// Delivers `event`; `false` once the subscriber is gone.
    fn deliver(&self, event: ProcEvent) -> bool {
        match self {
            Subscriber::Actor(r) => {
                r.connected() && {
                    r.do_send(event);
                    true
                }
            }
            Subscriber::Channel(tx) => tx.send(event).is_ok(),
        }
    }
}

/// Subscribes a channel (what [`Executor::subscribe`] sends).
struct SubscribeChannel(tokio::sync::mpsc::UnboundedSender<ProcEvent>);

impl Message for SubscribeChannel {
    type Result = Result<(), Error>;
}

impl Message for Shutdown {
    type Result = ();
}

/// How long a graceful shutdown waits, past its drain deadline, for the calls it
/// cancelled to return.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

type Waiter = oneshot::Sender<Result<Result<(), Failure>, Error>>;

/// The executor's actor. Talk to it through [`Executor`] or with the messages.
pub struct ExecutorActor<E = ()> {
    shared: Arc<Shared>,
    waiters: IdMap<ProcId, Vec<Waiter>>,
    /// Set once the store has failed (or the engine broke): nothing more is accepted,
    /// and every waiter gets this error.
    broken: Option<Error>,
    /// The arbiter threads, joined at shutdown.
    arbiters: Vec<Arbiter>,
    /// Root procedures submitted or recovered and not finished.
    unfinished: usize,
    max_unfinished: usize,
    /// Roots by the nonce they were submitted with, as long as their records live.
    nonces: HashMap<Nonce, NonceState>,
    retention: Retention,
    /// Finished roots whose results are kept, oldest first: when they finished.
    finished: VecDeque<(u64, ProcId)>,
    /// Results the client acknowledged, and when.
    acked: IdMap<ProcId, u64>,
    /// A batch of evictions is on its way to the store.
    evicting: bool,
    /// The actix system is the executor's own: shutdown stops it.
    owned_system: bool,
    /// The longest a graceful shutdown waits.
    drain_timeout: Duration,
    /// A shutdown has begun: submits are refused.
    stopping: bool,
    /// The procedures recovery took as possibly cut off by the last engine's stop.
    /// A drained stop marks those still unfinished as possibly cut off, since a
    /// procedure that has not been recorded since keeps that in memory only.
    cut_off: Vec<ProcId>,
    /// Who receives procedure events.
    subscribers: Vec<Subscriber>,
    /// The environment type of the procedures it takes.
    env: PhantomData<fn() -> E>,
}

impl<E> std::fmt::Debug for ExecutorActor<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorActor")
            .field("unfinished", &self.unfinished)
            .field("max_unfinished", &self.max_unfinished)
            .field("finished_kept", &self.finished.len())
            .field("broken", &self.broken)
            .field("stopping", &self.stopping)
            .field("subscribers", &self.subscribers.len())
            .finish_non_exhaustive()
    }
}

/// Where a nonce's submit is.
enum NonceState {
    /// Its insert is on its way to the store: later submits wait for the answer.
    Submitting(Vec<oneshot::Sender<Result<ProcId, Error>>>),
    /// The procedure exists (durably).
    Known(ProcId),
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    fn info(&self, id: ProcId) -> Option<ProcInfo> {
        let (locks_held, locks_waiting) = match self.shared.views.locks.get(&id) {
            Some(v) if v.held => (v.locks.clone(), Vec::new()),
            Some(v) => (Vec::new(), v.locks.clone()),
            None => (Vec::new(), Vec::new()),
        };
        let views = &self.shared.views;
        self.shared.table.get(&id).map(|e| {
            let waiting_on = match (&e.waiting, e.state) {
                _ if !locks_waiting.is_empty() => Some(WaitingOn::Locks),
                (Waiting::Event(event), ProcState::Waiting) => {
                    Some(WaitingOn::Event(event.to_string()))
                }
                (Waiting::Timer(at_ms), ProcState::WaitingTimeout) => {
                    Some(WaitingOn::Timer { at_ms: *at_ms })
                }
                (_, ProcState::Waiting) => Some(WaitingOn::Children),
                _ => None,
            };
            ProcInfo {
                id,
                root: e.root,
                parent: e.parent,
                type_name: e.type_name,
                state: e.state,
                submitted_ms: e.submitted_ms,
                updated_ms: e.updated_ms,
                result: e.result().cloned().map(|r| r.map_err(|f| *f)),
                locks_held,
                locks_waiting,
                state_name: e.state_name.clone(),
                waiting_on,
                steering: e.steering.as_deref().cloned().unwrap_or_default(),
                queue_level: (views.fair && e.state == ProcState::Runnable)
                    .then(|| views.levels.get(&e.root).map_or(0, |l| *l)),
            }
        })
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// The root stack of `id`'s tree while `id` is unfinished, or why there is none.
    fn live_tree(&self, id: ProcId) -> Result<TreeAddr, Error> {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        match self.shared.table.get(&id) {
            None => Err(self.missing(id)),
            Some(e) => match &e.tree {
                Some(tree) if !e.state.is_finished() && e.result().is_none() => Ok(tree.clone()),
                _ => Err(Error::Finished { id, state: e.state }),
            },
        }
    }

    /// The error for an id the table does not have.
    fn missing(&self, id: ProcId) -> Error {
        if self.shared.issued(id) {
            Error::Gone(id)
        } else {
            Error::UnknownProcedure(id)
        }
    }

    /// Evicts, in one append, up to a batch of results whose time is up; goes on at
    /// once if there were more.
    fn clean(&mut self, ctx: &mut Context<Self>) {
        if self.evicting || self.broken.is_some() {
            return;
        }
        let now = now_ms();
        let kept = u64::try_from(self.retention.kept.as_millis()).unwrap_or(u64::MAX);
        let after_ack = u64::try_from(self.retention.after_ack.as_millis()).unwrap_or(u64::MAX);
        let mut batch: Vec<ProcId> = Vec::new();
        while batch.len() < EVICT_BATCH {
            match self.finished.front() {
                Some(&(at, id)) if at.saturating_add(kept) <= now => {
                    self.finished.pop_front();
                    batch.push(id);
                }
                _ => break,
            }
        }
        if batch.len() < EVICT_BATCH {
            let due: Vec<ProcId> = self
                .acked
                .iter()
                .filter(|(_, &at)| at.saturating_add(after_ack) <= now)
                .map(|(&id, _)| id)
                .take(EVICT_BATCH - batch.len())
                .collect();
            for id in due {
                self.acked.remove(&id);
                batch.push(id);
            }
        }
        // An acknowledged result may also have reached its time in `finished`.
        batch.sort_unstable();
        batch.dedup();
        batch.retain(|id| {
            self.shared
                .table
                .get(id)
                .is_some_and(|e| e.result().is_some())
        });
        if batch.is_empty() {
            return;
        }
        let more = batch.len() == EVICT_BATCH;
        self.evicting = true;
        let (ack, durable) = oneshot::channel();
        self.shared.scheduler.do_send(Persist {
            ops: batch.iter().map(|&id| StoreOp::Delete(id)).collect(),
            ack: DurableAck::Caller(ack),
            finished: None,
        });
        let done = async move { durable.await.unwrap_or(Err(Error::Stopped)) };
        ctx.spawn(done.into_actor(self).map(move |result, act, ctx| {
            act.evicting = false;
            match result {
                Ok(()) => {
                    for id in &batch {
                        if let Some((_, e)) = act.shared.table.remove(id) {
                            if let Some(nonce) = e.nonce() {
                                act.nonces.remove(&nonce);
                            }
                        }
                        act.acked.remove(id);
                    }
                    tracing::debug!(evicted = batch.len(), "evicted finished results");
                    if more {
                        act.clean(ctx);
                    }
                }
                Err(e) => act.broke(e),
            }
        }));
    }

    /// The store failed (or the engine broke): accept nothing more and answer every
    /// waiter with the error.
    fn broke(&mut self, e: Error) {
        if self.broken.is_none() {
            tracing::error!(error = %e, "executor stopped accepting work");
            if matches!(e, Error::Internal(_)) {
                // Stop every other tree at its next write, as a store failure does.
                self.shared.scheduler.do_send(Refuse(e.to_string()));
            }
            let _ = self.shared.broken_error.set(e.duplicate());
            self.shared.broken.cancel();
            self.broken = Some(e);
        }
        // Trees that are idle (sleeping, suspended) write nothing and would never
        // learn; their waiters get the error now, like everyone's.
        let broken = self
            .broken
            .as_ref()
            .map_or(Error::Stopped, Error::duplicate);
        for (_, waiters) in self.waiters.drain() {
            for waiter in waiters {
                let _ = waiter.send(Err(broken.duplicate()));
            }
        }
    }
}

/// Results evicted per append, at most.
const EVICT_BATCH: usize = 10_000;

impl<E: Send + Sync + 'static> Actor for ExecutorActor<E> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.retention.every, |act, ctx| act.clean(ctx));
    }
}

/// A submit with a nonce was answered (from the submit's own future, before its caller
/// hears): the retries that came meanwhile get the same answer, and a successful one
/// makes the nonce known; a failed one frees it for the next retry.
struct NonceSettled {
    nonce: Nonce,
    result: Result<ProcId, Error>,
}

impl Message for NonceSettled {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<NonceSettled> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: NonceSettled, _ctx: &mut Context<Self>) {
        let NonceSettled { nonce, result } = msg;
        if let Some(NonceState::Submitting(waiting)) = self.nonces.remove(&nonce) {
            for tx in waiting {
                let _ = tx.send(result.as_ref().map(|id| *id).map_err(Error::duplicate));
            }
        }
        if let Ok(id) = result {
            self.nonces.insert(nonce, NonceState::Known(id));
        }
    }
}

impl<E: Send + Sync + 'static> Handler<Submit<E>> for ExecutorActor<E> {
    // A plain future, not one of the actor's: actix polls every future an actor holds
    // each time the actor wakes, so thousands of submits waiting for their inserts to
    // be durable made every message to the executor cost thousands of polls.
    type Result = ResponseFuture<Result<ProcId, Error>>;

    fn handle(&mut self, msg: Submit<E>, ctx: &mut Context<Self>) -> Self::Result {
        if let Some(broken) = &self.broken {
            let e = broken.duplicate();
            return Box::pin(std::future::ready(Err(e)));
        }
        if self.stopping {
            return Box::pin(std::future::ready(Err(Error::Stopped)));
        }
        if let Some(nonce) = msg.nonce {
            match self.nonces.get_mut(&nonce) {
                Some(NonceState::Known(id)) => {
                    let id = *id;
                    return Box::pin(std::future::ready(Ok(id)));
                }
                Some(NonceState::Submitting(waiting)) => {
                    let (tx, rx) = oneshot::channel();
                    waiting.push(tx);
                    return Box::pin(async move { rx.await.unwrap_or(Err(Error::Stopped)) });
                }
                None => {}
            }
        }
        if self.unfinished >= self.max_unfinished {
            let limit = self.max_unfinished;
            return Box::pin(std::future::ready(Err(Error::Overloaded { limit })));
        }
        let mut root = match declare(&self.shared, &*msg.proc, now_ms()) {
            Ok(root) => root,
            Err(e) => {
                let e = match e {
                    Undeclarable::Registry(e) => Error::Registry(e),
                    Undeclarable::Invalid(e) => Error::Invalid(e.to_string()),
                };
                return Box::pin(std::future::ready(Err(e)));
            }
        };
        root.nonce = msg.nonce;
        if let Some(nonce) = msg.nonce {
            self.nonces
                .insert(nonce, NonceState::Submitting(Vec::new()));
        }
        let shared = self.shared.clone();
        let (ack, rx) = oneshot::channel();
        let proc = msg.proc;
        self.unfinished += 1;
        let tree = self.shared.new_tree(root.id);
        tree.start(TreeRunner::submit(shared, tree.clone(), root, proc, ack));
        let answer = async move { rx.await.unwrap_or(Err(Error::Stopped)) };
        let Some(nonce) = msg.nonce else {
            return Box::pin(answer);
        };
        let executor = ctx.address();
        Box::pin(async move {
            let result = answer.await;
            let settled = result.as_ref().map(|id| *id).map_err(Error::duplicate);
            // Settled before the caller hears, so a retry after the answer finds the
            // nonce known. A stopped executor answers the waiting retries by dropping
            // them.
            let _ = executor
                .send(NonceSettled {
                    nonce,
                    result: settled,
                })
                .await;
            result
        })
    }
}

impl<E: Send + Sync + 'static> Handler<Abort> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<bool, Error>>;

    fn handle(&mut self, msg: Abort, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        let tree = self.live_tree(id);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            tree?.do_send(AbortRequest { id, ack });
            // No answer: the tree finished (or halted) meanwhile.
            let answer = answer.await.ok();
            answer.unwrap_or_else(|| {
                Err(match shared.table.get(&id) {
                    Some(e) => Error::Finished { id, state: e.state },
                    None => Error::Stopped,
                })
            })
        })
    }
}

impl<E: Send + Sync + 'static> Handler<Bypass> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Bypass, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.id;
        let tree = self.live_tree(id);
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            let request = BypassRequest {
                id,
                recursive: msg.recursive,
                ack,
            };
            tree?.do_send(request);
            answer.await.unwrap_or(Err(Error::Stopped)).map(|_| ())
        })
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Sends an operator's command to the procedure's tree; the answer comes once its
    /// effect is durable.
    fn command(&self, id: ProcId, command: Command) -> ResponseFuture<Result<(), Error>> {
        let tree = self.live_tree(id);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            tree?.do_send(CommandRequest { id, command, ack });
            // A pause waits for a step boundary that a broken engine may never reach
            // (a tree that writes nothing is never told).
            let answer = tokio::select! {
                biased;
                answer = answer => answer.unwrap_or(Err(Error::Stopped)),
                () = shared.broken.cancelled() => Err(shared
                    .broken_error
                    .get()
                    .map_or(Error::Stopped, Error::duplicate)),
            };
            match answer? {
                true => Ok(()),
                // A rollback of a procedure that is not paused is an abort, which its
                // hook refused.
                false => Err(Error::Refused {
                    command: command.name(),
                    id,
                    reason: "the procedure's abort hook refused".into(),
                }),
            }
        })
    }
}

impl<E: Send + Sync + 'static> Handler<Pause> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Pause, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Pause)
    }
}

impl<E: Send + Sync + 'static> Handler<Continue> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Continue, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Continue)
    }
}

impl<E: Send + Sync + 'static> Handler<Rollback> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Rollback, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Rollback)
    }
}

impl<E: Send + Sync + 'static> Handler<GetState> for ExecutorActor<E> {
    type Result = Result<ProcInfo, Error>;

    fn handle(&mut self, msg: GetState, _ctx: &mut Context<Self>) -> Self::Result {
        self.info(msg.0).ok_or_else(|| self.missing(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<WaitFor> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<Result<(), Failure>, Error>>;

    fn handle(&mut self, msg: WaitFor, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        // The row's root and result only (the table's guard released before anything
        // else is looked up), not the whole `ProcInfo`.
        let row = self
            .shared
            .table
            .get(&id)
            .map(|e| (e.root, e.result().cloned()));
        let ready = match row {
            None => Some(Err(self.missing(id))),
            Some((root, _)) if root != id => Some(Err(Error::NotRoot { id, root })),
            Some((_, Some(result))) => Some(Ok(result.map_err(|f| *f))),
            Some((_, None)) => self.broken.as_ref().map(|e| Err(e.duplicate())),
        };
        if let Some(ready) = ready {
            return Box::pin(async move { ready });
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.entry(id).or_default().push(tx);
        Box::pin(async move { rx.await.unwrap_or(Err(Error::Stopped)) })
    }
}

impl<E: Send + Sync + 'static> Handler<GetValue> for ExecutorActor<E> {
    type Result = Result<Option<Vec<u8>>, Error>;

    fn handle(&mut self, msg: GetValue, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        match self.shared.table.get(&id) {
            None => Err(self.missing(id)),
            Some(e) if e.result().is_none() => Err(Error::NotFinished(id)),
            Some(e) => Ok(e.caller_value().cloned()),
        }
    }
}

impl<E: Send + Sync + 'static> Handler<AckResult> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: AckResult, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        match self.shared.table.get(&id) {
            None => return Err(self.missing(id)),
            Some(e) if e.root != id => return Err(Error::NotRoot { id, root: e.root }),
            Some(e) if e.result().is_none() => return Err(Error::NotFinished(id)),
            Some(_) => {}
        }
        self.acked.entry(id).or_insert_with(now_ms);
        Ok(())
    }
}

impl<E: Send + Sync + 'static> Handler<List> for ExecutorActor<E> {
    type Result = Result<Vec<ProcInfo>, Error>;

    fn handle(&mut self, msg: List, _ctx: &mut Context<Self>) -> Self::Result {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        let mut ids: Vec<ProcId> = match msg.root {
            Some(root) => self
                .shared
                .table
                .iter()
                .filter(|e| e.root == root)
                .map(|e| *e.key())
                .collect(),
            None => self.shared.table.iter().map(|e| *e.key()).collect(),
        };
        ids.sort_unstable();
        Ok(ids
            .into_iter()
            .filter_map(|id| self.info(id))
            .filter(|info| msg.matches(info))
            .collect())
    }
}

impl<E: Send + Sync + 'static> Handler<WakeEvent> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        self.shared.scheduler.do_send(msg);
    }
}

impl<E: Send + Sync + 'static> Handler<GetSchedulerStats> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<SchedulerStats, Error>>;

    fn handle(&mut self, msg: GetSchedulerStats, _ctx: &mut Context<Self>) -> Self::Result {
        let scheduler = self.shared.scheduler.clone();
        Box::pin(async move { scheduler.send(msg).await? })
    }
}

impl<E: Send + Sync + 'static> Handler<ResetEvent> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: ResetEvent, _ctx: &mut Context<Self>) {
        self.shared.scheduler.do_send(msg);
    }
}

impl<E: Send + Sync + 'static> Handler<TreeFinished> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: TreeFinished, _ctx: &mut Context<Self>) {
        match msg.result {
            Ok(result) => {
                self.unfinished = self.unfinished.saturating_sub(1);
                self.finished.push_back((now_ms(), msg.root));
                if !self.subscribers.is_empty() {
                    let event = ProcEvent::Finished {
                        id: msg.root,
                        type_name: self.type_name_of(msg.root),
                        result: result.clone(),
                    };
                    self.publish(event);
                }
                for waiter in self.waiters.remove(&msg.root).unwrap_or_default() {
                    let _ = waiter.send(Ok(result.clone()));
                }
            }
            Err(e) => self.broke(e),
        }
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    fn type_name_of(&self, id: ProcId) -> &'static str {
        self.shared.table.get(&id).map_or("?", |e| e.type_name)
    }

    /// Sends `event` to every subscriber, forgetting those that are gone.
    fn publish(&mut self, event: ProcEvent) {
        self.subscribers.retain(|s| s.deliver(event.clone()));
        if self.subscribers.is_empty() {
            self.shared
                .subscribed
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn subscribe(&mut self, subscriber: Subscriber) -> Result<(), Error> {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        self.subscribers.push(subscriber);
        self.shared
            .subscribed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl<E: Send + Sync + 'static> Handler<Subscribe> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: Subscribe, _ctx: &mut Context<Self>) -> Self::Result {
        self.subscribe(Subscriber::Actor(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<SubscribeChannel> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: SubscribeChannel, _ctx: &mut Context<Self>) -> Self::Result {
        self.subscribe(Subscriber::Channel(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<TreeNews> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: TreeNews, _ctx: &mut Context<Self>) {
        if self.subscribers.is_empty() {
            return;
        }
        let event = match msg {
            TreeNews::Submitted(id) => ProcEvent::Submitted {
                id,
                type_name: self.type_name_of(id),
            },
            TreeNews::Paused {
                id,
                root,
                state,
                why,
            } => ProcEvent::Paused {
                id,
                root,
                state,
                why,
            },
        };
        self.publish(event);
    }
}

impl<E: Send + Sync + 'static> Handler<Shutdown> for ExecutorActor<E> {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, msg: Shutdown, _ctx: &mut Context<Self>) -> Self::Result {
        if !msg.graceful || self.stopping || self.broken.is_some() {
            self.stopping = true;
            return Box::pin(self.stop_now(false));
        }
        self.stopping = true;
        tracing::info!(
            timeout_ms = self.drain_timeout.as_millis() as u64,
            "draining"
        );
        let shared = self.shared.clone();
        let mut deadline = tokio::time::Instant::now() + self.drain_timeout;
        // Whether a step was cut off (cancelled, or not made durable in time).
        let mut cut = false;
        let drain = async move {
            if tokio::time::timeout_at(deadline, shared.drain.drain())
                .await
                .is_err()
            {
                // Ask the running calls to stop (`CancelReason::Shutdown`), and give
                // those that watch the signal a moment to return.
                tracing::warn!("drain deadline passed with steps still running: cancelling them");
                shared.shutdown.cancel();
                deadline = tokio::time::Instant::now() + CANCEL_GRACE;
                if tokio::time::timeout_at(deadline, shared.drain.drain())
                    .await
                    .is_err()
                {
                    tracing::warn!("steps still running after their cancellation: stopping now");
                    return false;
                }
                // A cancelled step that returned reported a yield: it ran, unrecorded.
                cut = true;
            }
            // Every report is sent; wait until each tree has made its records durable.
            let trees: Vec<_> = shared
                .table
                .iter()
                .filter(|e| e.parent.is_none())
                .filter_map(|e| e.tree.clone())
                .collect();
            let answers: Vec<_> = trees
                .into_iter()
                .map(|tree| {
                    let (tx, rx) = oneshot::channel();
                    tree.do_send(Quiesce(tx));
                    rx
                })
                .collect();
            let all_quiet = async {
                for answer in answers {
                    // A tree that ended meanwhile drops its sender: quiet too.
                    let _ = answer.await;
                }
            };
            if tokio::time::timeout_at(deadline, all_quiet).await.is_err() {
                tracing::warn!("drain deadline passed with records not yet durable: stopping now");
                return false;
            }
            !cut
        };
        Box::pin(
            drain
                .into_actor(self)
                .then(|drained, act: &mut Self, _ctx| act.stop_now(drained)),
        )
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Stops the arbiters (cutting off what runs) and the store writer. `drained`: a
    /// graceful shutdown ended every call and made every report durable, so the store
    /// is marked so ([`ProcedureStore::mark_drained`](crate::ProcedureStore::mark_drained))
    /// after its last append.
    fn stop_now(&mut self, drained: bool) -> impl ActorFuture<Self, Output = ()> {
        let drained = drained.then(|| {
            let table = &self.shared.table;
            let mut cut_off = std::mem::take(&mut self.cut_off);
            cut_off.retain(|id| table.get(id).is_some_and(|e| !e.state.is_finished()));
            cut_off
        });
        // Set first: the trees cut off below report nothing as an engine failure.
        self.broken = Some(Error::Stopped);
        // The arbiters stop one by one, and a tree cut off on one frees its locks:
        // a procedure on another must not start a call under them meanwhile.
        self.shared.drain.close();
        for arbiter in &self.shared.arbiters {
            arbiter.stop();
        }
        for (_, waiters) in self.waiters.drain() {
            for waiter in waiters {
                let _ = waiter.send(Err(Error::Stopped));
            }
        }
        // Their streams end.
        self.subscribers.clear();
        let scheduler = self.shared.scheduler.clone();
        let owned_system = self.owned_system;
        // Joined off the actor threads: a call into user code that is in the middle of a
        // poll finishes it, and then nothing of this executor runs any more when
        // `shutdown` returns (a new executor on the same store must never overlap it).
        let (joined, threads_gone) = oneshot::channel();
        let arbiters = std::mem::take(&mut self.arbiters);
        let joiner = std::thread::Builder::new()
            .name("proctor-shutdown".into())
            .spawn(move || {
                for arbiter in arbiters {
                    let _ = arbiter.join();
                }
                let _ = joined.send(());
            });
        async move {
            if joiner.is_ok() {
                let _ = threads_gone.await;
            }
            // Errors mean it has stopped already.
            let _ = scheduler.send(StopWriter { drained }).await;
            if owned_system {
                System::current().stop();
            }
        }
        .into_actor(self)
        // Stopped last: an actor's pending futures end with it. Meanwhile `broken`
        // answers every request.
        .map(|(), _act, ctx| ctx.stop())
    }
}

#[cfg(test)]
mod tests {
    use super::split_evenly;

    /// (items, parts, min) → the runs' lengths.
    #[test]
    fn split_evenly_keeps_order_and_stays_whole_when_small() {
        let cases: [(usize, usize, usize, &[usize]); 7] = [
            (0, 2, 0, &[]),
            (10, 2, 20, &[10]),
            (10, 1, 0, &[10]),
            (10, 2, 0, &[5, 5]),
            (11, 2, 0, &[6, 5]),
            (10, 3, 0, &[4, 4, 2]),
            (2, 4, 0, &[1, 1]),
        ];
        for (n, parts, min, lengths) in cases {
            let runs = split_evenly((0..n).collect(), parts, min);
            let got: Vec<usize> = runs.iter().map(Vec::len).collect();
            assert_eq!(got, lengths, "{n} items, {parts} parts, min {min}");
            let flat: Vec<usize> = runs.into_iter().flatten().collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "order");
        }
    }
}
