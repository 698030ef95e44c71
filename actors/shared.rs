//! What every actor of one executor shares: the registry, the user's environment, the
//! procedure table, the id counter, and the addresses of the singleton actors.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix::prelude::*;
use dashmap::DashMap;

use crate::cancel::Cancel;
use crate::erased::AnyEnv;
use crate::fast_map::IdHasher;
use crate::locks::Lock;
use crate::procedure::{ProcId, ProcState};
use crate::record::{Failure, Nonce, Steering};
use crate::registry::Types;

use super::locks::LockActor;
use super::persistence::PersistenceActor;
use super::protocol::{TreeAddr, TreeFinished, TreeNews};
use super::scheduler::SchedulerActor;
use super::shard::{Shard, TreeHandle};

/// The engine's clock, in ms since the Unix epoch. The one place the actors read time;
/// the core gets it as a parameter.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What the procedures of one tree read before each call into user code, written
/// only by the tree's root stack. Monotonic: healthy, then failed, then halted, then
/// dropped.
#[derive(Default)]
pub(crate) struct TreeStatus(AtomicU8);

const FAILED: u8 = 1;
const HALTED: u8 = 2;
const DROPPED: u8 = 3;

impl TreeStatus {
    /// The tree has failed: run no more steps (report them skipped).
    pub(crate) fn failed(&self) -> bool {
        self.0.load(Ordering::Acquire) >= FAILED
    }

    /// The tree can make nothing durable any more (the store failed, or the engine
    /// broke an invariant): call no user code at all, as after a crash.
    pub(crate) fn halted(&self) -> bool {
        self.0.load(Ordering::Acquire) >= HALTED
    }

    pub(crate) fn set_failed(&self) {
        self.0.fetch_max(FAILED, Ordering::AcqRel);
    }

    pub(crate) fn set_halted(&self) {
        self.0.fetch_max(HALTED, Ordering::AcqRel);
    }

    /// The tree's runner is gone: a call of it still in flight is not polled again.
    pub(crate) fn dropped(&self) -> bool {
        self.0.load(Ordering::Acquire) >= DROPPED
    }

    pub(crate) fn set_dropped(&self) {
        self.0.fetch_max(DROPPED, Ordering::AcqRel);
    }
}

/// What few rows of the procedure table carry.
#[derive(Default)]
pub(crate) struct EntryExtra {
    /// A finished root's result.
    pub(crate) result: Option<Result<(), Box<Failure>>>,
    /// A finished root's value for the caller (MessagePack), if its last step set one.
    pub(crate) value: Option<Vec<u8>>,
    /// The nonce a root was submitted with.
    pub(crate) nonce: Option<Nonce>,
    /// An operator bypassed it.
    pub(crate) bypassed: bool,
}

impl EntryExtra {
    /// `None` when there is nothing to keep.
    pub(crate) fn boxed(self) -> Option<Box<EntryExtra>> {
        let empty =
            self.result.is_none() && self.value.is_none() && self.nonce.is_none() && !self.bypassed;
        (!empty).then(|| Box::new(self))
    }
}

impl Entry {
    /// A finished root's result.
    pub(crate) fn result(&self) -> Option<&Result<(), Box<Failure>>> {
        self.extra.as_ref()?.result.as_ref()
    }

    /// A finished root's value for the caller.
    pub(crate) fn caller_value(&self) -> Option<&Vec<u8>> {
        self.extra.as_ref()?.value.as_ref()
    }

    /// The nonce a root was submitted with.
    pub(crate) fn nonce(&self) -> Option<Nonce> {
        self.extra.as_ref()?.nonce
    }

    pub(crate) fn extra_mut(&mut self) -> &mut EntryExtra {
        self.extra.get_or_insert_with(Box::default)
    }
}

/// One row of the procedure table.
pub(crate) struct Entry {
    pub(crate) root: ProcId,
    pub(crate) parent: Option<ProcId>,
    pub(crate) type_name: &'static str,
    pub(crate) state: ProcState,
    /// Its recorded steps not rolled back (its record's stack indexes).
    pub(crate) steps: u32,
    pub(crate) submitted_ms: u64,
    pub(crate) updated_ms: u64,
    /// The root stack of its tree, which answers aborts; `None` once it has finished.
    pub(crate) tree: Option<TreeAddr>,
    /// A finished root's result and value, a root's nonce. Boxed: every live procedure
    /// has a row, and most have none of these.
    pub(crate) extra: Option<Box<EntryExtra>>,
    /// What a WAITING or WAITING_TIMEOUT procedure waits for, as its record says.
    pub(crate) waiting: Waiting,
    /// Its [`Procedure::state_name`](crate::Procedure::state_name) before its latest
    /// step.
    pub(crate) state_name: Option<String>,
    /// Its record's steering, when there is any.
    pub(crate) steering: Option<Box<Steering>>,
}

/// What a procedure's record says it waits for (children, when it says neither).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) enum Waiting {
    #[default]
    Nothing,
    Event(Box<str>),
    Timer(u64),
}

impl Waiting {
    pub(crate) fn of(record: &crate::record::ProcRecord) -> Self {
        match (&record.event, record.wake_at_ms) {
            (Some(event), _) => Waiting::Event(event.as_str().into()),
            (None, Some(at)) => Waiting::Timer(at),
            (None, None) => Waiting::Nothing,
        }
    }
}

/// The locks a procedure holds, or waits for, as the scheduler last saw them.
pub(crate) struct LockView {
    pub(crate) locks: Vec<Lock>,
    pub(crate) held: bool,
}

/// What the scheduler knows that `GetState` and `List` show: written by the
/// scheduler, read by the executor.
#[derive(Default)]
pub(crate) struct SchedulerViews {
    /// The locks each procedure holds or waits for.
    pub(crate) locks: DashMap<ProcId, LockView, IdHasher>,
    /// The fair queue's level of each tree (by root) past level 0.
    pub(crate) levels: DashMap<ProcId, u8, IdHasher>,
    /// Whether the fair queue orders steps (levels mean nothing under FIFO).
    pub(crate) fair: bool,
}

/// A shard and its scheduler, on one arbiter.
pub(crate) type ShardAddr = (Addr<Shard>, Addr<SchedulerActor>);

pub(crate) struct Shared {
    pub(crate) registry: Types,
    /// The executor's environment (an `E` for an `Executor<E>`).
    pub(crate) env: Arc<AnyEnv>,
    pub(crate) table: DashMap<ProcId, Entry, IdHasher>,
    pub(crate) views: Arc<SchedulerViews>,
    /// The lock actor (locks and events).
    pub(crate) locks: Addr<LockActor>,
    /// The persistence actor (the group commit in front of the store).
    pub(crate) persistence: Addr<PersistenceActor>,
    /// The executor, for finished trees.
    pub(crate) finished: Recipient<TreeFinished>,
    /// The executor, for submits and pauses to publish.
    pub(crate) news: Recipient<TreeNews>,
    /// The arbiters' threads, stopped at shutdown.
    pub(crate) arbiters: Vec<ArbiterHandle>,
    /// One shard on each arbiter, holding the trees placed on it, with its scheduler.
    pub(crate) shards: Vec<ShardAddr>,
    /// Live trees per shard (by the shard's index): a new tree goes to the shard with
    /// the fewest.
    live_trees: Box<[AtomicUsize]>,
    next_id: AtomicU64,
    /// A graceful shutdown in progress, and the calls into user code it waits for.
    pub(crate) drain: Drain,
    /// Raised when a graceful shutdown's drain deadline passes: every call's context
    /// watches it (`CancelReason::Shutdown`).
    pub(crate) shutdown: Cancel,
    /// Raised when the executor broke (its store failed, or engine code panicked), with
    /// the error: operator commands waiting on a tree that will never write again
    /// are answered with it.
    pub(crate) broken: Cancel,
    pub(crate) broken_error: std::sync::OnceLock<crate::Error>,
    /// Someone subscribed to procedure events (root stacks then report submits).
    pub(crate) subscribed: AtomicBool,
    /// Each procedure type's metric handles.
    pub(crate) metrics: super::metrics::TypeMetrics,
    /// The gauges of unfinished, paused and waiting procedures, moved with `table`.
    pub(crate) proc_gauges: super::metrics::ProcGauges,
    /// The leader lease's epoch the executor runs under, given to every call
    /// (`Context::fencing_token`).
    pub(crate) fencing_token: Option<i64>,
    /// The remote dispatcher, and what a call's context reaches it through.
    pub(crate) remote: Option<(crate::remote::Sink, Addr<super::remote::RemoteDispatcher>)>,
}

/// Calls into user code (steps and rollbacks) in progress, for a graceful shutdown:
/// once it begins, no new call starts, and the executor waits for these to end.
#[derive(Default)]
pub(crate) struct Drain {
    draining: AtomicBool,
    calls: AtomicUsize,
    idle: tokio::sync::Notify,
}

impl Drain {
    /// A graceful shutdown has begun: start no call.
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Counts a call about to start; `false` (counting nothing) once draining. The
    /// count comes first, so either the drain sees this call or the call sees the drain.
    pub(crate) fn begin_call(&self) -> bool {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.is_draining() {
            self.end_call();
            return false;
        }
        true
    }

    /// A counted call ended (and sent its report).
    pub(crate) fn end_call(&self) {
        if self.calls.fetch_sub(1, Ordering::SeqCst) == 1 && self.is_draining() {
            self.idle.notify_waiters();
        }
    }

    /// Starts no call from now on, without waiting for those in progress (a stop
    /// at once: they are cut off with their arbiters).
    pub(crate) fn close(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Begins draining, and completes when no call is in progress.
    pub(crate) async fn drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        loop {
            let idle = self.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.calls.load(Ordering::SeqCst) == 0 {
                return;
            }
            idle.await;
        }
    }
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        registry: Types,
        env: Arc<AnyEnv>,
        views: Arc<SchedulerViews>,
        locks: Addr<LockActor>,
        persistence: Addr<PersistenceActor>,
        finished: Recipient<TreeFinished>,
        news: Recipient<TreeNews>,
        arbiters: Vec<ArbiterHandle>,
        shards: Vec<ShardAddr>,
        max_id: u64,
        table_capacity: usize,
        broken: Cancel,
        fencing_token: Option<i64>,
        remote: Option<(crate::remote::Sink, Addr<super::remote::RemoteDispatcher>)>,
    ) -> Self {
        Shared {
            registry,
            env,
            // Sized for what recovery publishes: growing it row by row would move every
            // row once or twice more.
            table: DashMap::with_capacity_and_hasher(table_capacity, IdHasher::default()),
            views,
            locks,
            persistence,
            finished,
            news,
            arbiters,
            live_trees: shards.iter().map(|_| AtomicUsize::new(0)).collect(),
            shards,
            next_id: AtomicU64::new(max_id + 1),
            drain: Drain::default(),
            shutdown: Cancel::new(),
            broken,
            broken_error: std::sync::OnceLock::new(),
            subscribed: AtomicBool::new(false),
            metrics: super::metrics::TypeMetrics::default(),
            proc_gauges: super::metrics::ProcGauges::new(),
            fencing_token,
            remote,
        }
    }

    /// Whether anyone subscribed to procedure events.
    pub(crate) fn has_subscribers(&self) -> bool {
        self.subscribed.load(Ordering::Relaxed)
    }

    /// A new procedure id, above every id the store has seen.
    pub(crate) fn next_id(&self) -> ProcId {
        ProcId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether `id` was ever handed out by this store (by this engine or before a
    /// restart): an id that was, but is in no table, is gone, not unknown.
    pub(crate) fn issued(&self, id: ProcId) -> bool {
        id.0 < self.next_id.load(Ordering::Relaxed)
    }

    /// The address of a new tree of `root`, on the shard with the fewest live trees
    /// (the first of them on a tie); a tree never moves. Its runner's drop hands the
    /// place back ([`Shared::tree_ended`]).
    pub(crate) fn new_tree(&self, root: ProcId) -> TreeAddr {
        let i = self
            .live_trees
            .iter()
            .enumerate()
            .min_by_key(|(_, n)| n.load(Ordering::Relaxed))
            .map_or(0, |(i, _)| i);
        self.live_trees[i].fetch_add(1, Ordering::Relaxed);
        let (shard, scheduler) = &self.shards[i];
        TreeHandle::new(shard.clone(), scheduler.clone(), i, root)
    }

    /// A tree of the `index`th shard has ended.
    pub(crate) fn tree_ended(&self, index: usize) {
        if let Some(n) = self.live_trees.get(index) {
            n.fetch_sub(1, Ordering::Relaxed);
        }
    }
}
