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
    #[cfg(feature = "simulation")]
    if let Some(ms) = super::simulation::now_ms() {
        return ms;
    }
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The monotonic clock the actors time their own waits and windows by (restart
/// limits, stuck workers, remote deadlines): tokio's, which is the simulated one under
/// a simulation and `std`'s anywhere else.
#[inline]
pub(crate) fn mono_now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

/// Whether this engine may call user code: from its start until it breaks or steps
/// down, and, under a leader lease, only while the lease surely holds by this
/// process's own clock ([`Term`]). Read before every call into user code (steps,
/// rollbacks, hooks, lock hooks, cleanups, a transport's sends) and at every poll of a
/// running call, so a call in progress is not polled again once it ends: after the
/// lease is lost (or the process was stopped past it) no user code starts, and a
/// running step or rollback is dropped at its next await. What a call does between two
/// awaits cannot be stopped: the resources a step changes check its fencing token.
pub(crate) struct Mandate {
    ended: AtomicBool,
    /// The executor broke (its store failed, engine code panicked) or stepped down:
    /// no step is dispatched. User code may still run where a halted tree allows.
    broken: AtomicBool,
    term: Option<Arc<Term>>,
}

impl Mandate {
    /// A mandate that holds until [`end`](Self::end), and while `term` does.
    pub(crate) fn new(term: Option<Arc<Term>>) -> Arc<Mandate> {
        Arc::new(Mandate {
            ended: AtomicBool::new(false),
            broken: AtomicBool::new(false),
            term,
        })
    }

    /// Whether user code may be called now.
    #[inline]
    pub(crate) fn holds(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && self.term.as_ref().is_none_or(|t| t.holds())
    }

    /// Whether steps may be dispatched: the mandate holds and the executor did not
    /// break.
    #[inline]
    pub(crate) fn dispatches(&self) -> bool {
        !self.broken.load(Ordering::Acquire) && self.holds()
    }

    /// The executor broke: dispatch no step from now on.
    pub(crate) fn broke(&self) {
        self.broken.store(true, Ordering::Release);
    }

    /// The engine stepped down: no user code from now on.
    pub(crate) fn end(&self) {
        self.broke();
        self.ended.store(true, Ordering::Release);
    }
}

/// How long a leader lease surely holds, by this process's monotonic clock: the lease
/// thread extends it after each renewal to the renewal's start plus the part of the
/// period the holder may act in, and ends it when the lease is lost. A process stopped
/// (SIGSTOP, a long pause) past that instant finds the term over at its first look,
/// before the lease thread has even woken: the monotonic clock ran meanwhile.
///
/// Once anyone has seen the term over, it stays over: the reader that sees it lapse
/// ends it (a compare-and-swap against the renewal's), so a renewal that lands just
/// after cannot revive a term someone already acted on as over; the lease thread then
/// gives the lease up.
#[derive(Debug)]
pub(crate) struct Term {
    base: std::time::Instant,
    /// Microseconds after `base` until which the lease holds; 0 once it ended.
    until_us: AtomicU64,
}

// Only `holds` is called without the PostgreSQL store (the lease makes the terms).
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
impl Term {
    /// A term that holds until `until`.
    pub(crate) fn until(until: std::time::Instant) -> Term {
        let base = mono_now().min(until);
        let us = Self::micros(base, until);
        Term {
            base,
            until_us: AtomicU64::new(us),
        }
    }

    fn micros(base: std::time::Instant, until: std::time::Instant) -> u64 {
        let us = until.saturating_duration_since(base).as_micros();
        u64::try_from(us).unwrap_or(u64::MAX).max(1)
    }

    /// The lease was renewed: it holds until `until`. `false` (and nothing changed)
    /// if the term is over: someone saw it lapse, or it was ended.
    pub(crate) fn extend(&self, until: std::time::Instant) -> bool {
        let us = Self::micros(self.base, until);
        self.until_us
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |now| {
                (now != 0).then_some(us)
            })
            .is_ok()
    }

    /// The lease is lost.
    pub(crate) fn end(&self) {
        self.until_us.store(0, Ordering::Release);
    }

    /// Whether the lease holds now.
    pub(crate) fn holds(&self) -> bool {
        loop {
            let until = self.until_us.load(Ordering::Acquire);
            if until == 0 {
                return false;
            }
            let now = u64::try_from(mono_now().saturating_duration_since(self.base).as_micros())
                .unwrap_or(u64::MAX);
            if now < until {
                return true;
            }
            // Lapsed: over for good, unless a renewal extended it meanwhile.
            if self
                .until_us
                .compare_exchange(until, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return false;
            }
        }
    }

    /// How long it holds from now (zero once over).
    pub(crate) fn left(&self) -> std::time::Duration {
        let until = self.until_us.load(Ordering::Acquire);
        std::time::Duration::from_micros(until)
            .saturating_sub(mono_now().saturating_duration_since(self.base))
    }
}

/// Supervision's restart limit: more than `max` restarts of one procedure's actor
/// within `within` and its root stack gives up on it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RestartLimit {
    pub(crate) max: u32,
    pub(crate) within: std::time::Duration,
}

impl Default for RestartLimit {
    fn default() -> Self {
        RestartLimit {
            max: 3,
            within: std::time::Duration::from_secs(60),
        }
    }
}

/// What the procedures of one tree read before each call into user code, written
/// only by the tree's root stack. Monotonic: healthy, then failed, then halted, then
/// dropped. Beside it, the engine's [`Mandate`], which every tree reads.
pub(crate) struct TreeStatus(AtomicU8, Arc<Mandate>);

const FAILED: u8 = 1;
const HALTED: u8 = 2;
const DROPPED: u8 = 3;

impl TreeStatus {
    /// A healthy tree's status, under the engine's `mandate`.
    pub(crate) fn new(mandate: Arc<Mandate>) -> Self {
        TreeStatus(AtomicU8::new(0), mandate)
    }

    /// The engine lost its mandate: call no user code at all, as after a crash (and
    /// unlike `halted`, report nothing: the lease's new holder runs the tree).
    pub(crate) fn deposed(&self) -> bool {
        #[cfg(feature = "simulation")]
        if crate::mutation::on(crate::mutation::Mutation::CallsAfterLeaseLoss) {
            return false;
        }
        !self.1.holds()
    }

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
    /// One shard on each arbiter, holding the trees placed on it, with its scheduler
    /// (shared with the addresses of its trees).
    pub(crate) shards: Vec<Arc<ShardAddr>>,
    /// Live trees per shard (by the shard's index): a new tree goes to the shard with
    /// the fewest.
    live_trees: Box<[AtomicUsize]>,
    /// How many ids of the engine's stripe were handed out (the next is this plus one).
    next_id: AtomicU64,
    /// The ids this engine hands out: every id, or, for a partition of a cluster, the
    /// partition's stripe.
    stripe: crate::cluster::IdStripe,
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
    /// Whether user code may be called (see [`Mandate`]).
    pub(crate) mandate: Arc<Mandate>,
    /// How often a procedure's actor may be started again by supervision.
    pub(crate) restart_limit: RestartLimit,
    /// How many times a failed rollback step is retried under the default failure
    /// policy before its procedure is ROLLBACK_PAUSED.
    pub(crate) rollback_retries: u32,
    /// How a retryable step error is retried when neither its step nor its
    /// procedure's failure policy says (`ExecutorBuilder::retry_policy`).
    pub(crate) retry_policy: Option<crate::procedure::RetryPolicy>,
    /// Someone subscribed to procedure events (root stacks then report submits).
    pub(crate) subscribed: AtomicBool,
    /// Each procedure type's metric handles.
    pub(crate) metrics: super::metrics::TypeMetrics,
    /// The gauges of unfinished, paused and waiting procedures, moved with `table`.
    pub(crate) proc_gauges: super::metrics::ProcGauges,
    /// The leader lease's epoch the executor runs under, given to every call
    /// (`Context::fencing_token`).
    pub(crate) fencing_token: Option<i64>,
    /// The cluster partition the executor runs (`Context::partition`).
    pub(crate) partition: Option<u32>,
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
        (max_id, stripe): (u64, crate::cluster::IdStripe),
        table_capacity: usize,
        broken: Cancel,
        mandate: Arc<Mandate>,
        restart_limit: RestartLimit,
        rollback_retries: u32,
        retry_policy: Option<crate::procedure::RetryPolicy>,
        (fencing_token, partition): (Option<i64>, Option<u32>),
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
            shards: shards.into_iter().map(Arc::new).collect(),
            next_id: AtomicU64::new(stripe.ordinal(max_id) + 1),
            stripe,
            drain: Drain::default(),
            shutdown: Cancel::new(),
            broken,
            broken_error: std::sync::OnceLock::new(),
            mandate,
            restart_limit,
            rollback_retries,
            retry_policy,
            subscribed: AtomicBool::new(false),
            metrics: super::metrics::TypeMetrics::default(),
            proc_gauges: super::metrics::ProcGauges::new(),
            fencing_token,
            partition,
            remote,
        }
    }

    /// Whether anyone subscribed to procedure events.
    pub(crate) fn has_subscribers(&self) -> bool {
        self.subscribed.load(Ordering::Relaxed)
    }

    /// A new procedure id, above every id the store has seen.
    pub(crate) fn next_id(&self) -> ProcId {
        self.stripe.id(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether `id` was ever handed out by this store (by this engine or before a
    /// restart): an id that was, but is in no table, is gone, not unknown.
    pub(crate) fn issued(&self, id: ProcId) -> bool {
        id.0 % self.stripe.count == self.stripe.offset
            && self.stripe.ordinal(id.0) < self.next_id.load(Ordering::Relaxed)
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
        TreeHandle::new(self.shards[i].clone(), i, root)
    }

    /// A tree of the `index`th shard has ended.
    pub(crate) fn tree_ended(&self, index: usize) {
        if let Some(n) = self.live_trees.get(index) {
            n.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    #[test]
    fn a_term_holds_until_its_instant_and_a_renewal_moves_it() {
        let now = Instant::now();
        let term = Term::until(now + Duration::from_secs(60));
        assert!(term.holds());
        assert!(term.left() > Duration::from_secs(59));
        assert!(term.extend(now + Duration::from_secs(120)));
        assert!(term.left() > Duration::from_secs(119));
        term.end();
        assert!(!term.holds());
        assert_eq!(term.left(), Duration::ZERO);
        assert!(
            !term.extend(now + Duration::from_secs(180)),
            "an ended term stays over"
        );
        assert!(!term.holds());
    }

    #[test]
    fn a_term_seen_over_cannot_be_revived_by_a_late_renewal() {
        // Over already (its instant is the past): a reader sees it lapse first.
        let past = Instant::now() - Duration::from_millis(5);
        let term = Term::until(past);
        assert!(!term.holds());
        assert!(!term.extend(Instant::now() + Duration::from_secs(60)));
        assert!(!term.holds());
        // A renewal that lands before anyone looked revives nothing anyone acted on.
        let term = Term::until(past);
        assert!(term.extend(Instant::now() + Duration::from_secs(60)));
        assert!(term.holds());
    }

    #[test]
    fn a_mandate_holds_until_it_ends_or_its_term_does() {
        // (term, broke, ended) -> (holds, dispatches)
        let cases = [
            (None, false, false, true, true),
            (None, true, false, true, false),
            (None, false, true, false, false),
            (Some(60), false, false, true, true),
            (Some(0), false, false, false, false),
            (Some(60), true, false, true, false),
            (Some(60), false, true, false, false),
        ];
        for (term_s, broke, ended, holds, dispatches) in cases {
            let until = |s| match s {
                0 => Instant::now() - Duration::from_millis(5),
                s => Instant::now() + Duration::from_secs(s),
            };
            let term = term_s.map(|s| Arc::new(Term::until(until(s))));
            let mandate = Mandate::new(term);
            if broke {
                mandate.broke();
            }
            if ended {
                mandate.end();
            }
            let case = (term_s, broke, ended);
            assert_eq!(mandate.holds(), holds, "{case:?}");
            assert_eq!(mandate.dispatches(), dispatches, "{case:?}");
        }
    }
}
