//! The scheduler actor: one per shard, on its shard's arbiter. Its mailbox decides
//! which of its shard's steps runs next.
//!
//! It owns its shard's [`ReadyQueue`] (at most its share of the executor's `workers`
//! steps at once, in the order of the executor's [`Scheduling`]: the multilevel fair
//! queue by default, or FIFO with a front for procedures that continue), the system
//! procedures' workers of its own, and the stuck-worker monitor of its workers. It times
//! every step it dispatches (from `RunStep` to its `StepFinished`) and charges the time
//! to the step's tree, whose accumulated time puts it on a level of the fair queue; a
//! tree's time is dropped at its `TreeEnded`. A procedure waiting for children, an
//! event, a deadline or its locks is not in the ready queue and holds no worker. Every
//! enqueue comes from a root stack of its shard, after the step that caused it is
//! durable, or from the lock actor once the step's locks are granted ([`Granted`]); the
//! scheduler itself never changes a procedure's state. Everything here stays on the
//! shard's thread: its `RunStep`s go to the shard's trees as one message per turn, and
//! what the trees send it comes as one message per turn of theirs.

use std::collections::hash_map::Entry;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::fast_map::IdMap;
use crate::locks::Request;
use crate::procedure::ProcId;
use crate::ready_queue::{Lane, ReadyQueue, Scheduling};
use crate::root_stack::Place;
use crate::workers::{Change, WorkerPolicy, Workers};

use super::locks::LockActor;
use super::metrics;
use super::perturb;
use super::protocol::{FromShard, ProcAddr, Release, ReleaseLocks, ToCell};
use super::shard::Mail;
use super::shared::{now_ms, SchedulerViews};

/// A procedure's type and which of its steps is queued (from 1).
type What = (&'static str, usize);

/// A queued step: who, its tree (root), its procedure, its type and step, and whether
/// it holds locks for this step (released when it finishes).
struct Ready {
    id: ProcId,
    root: ProcId,
    addr: ProcAddr,
    what: What,
    locked: bool,
}

/// What the lock actor hands a scheduler, in the order it was made.
pub(crate) enum Grant {
    /// Queue this step: its locks are granted (`locked`: for this step only, released
    /// when it finishes; life-long ones stay), or its request was withdrawn and it only
    /// reports itself skipped.
    Step { step: Enqueue, locked: bool },
    /// Hand the procedure this (a grant of its life-long locks, a rollback's grant, a
    /// deadlock's failure), in order with the steps: a deadlock victim's `LockFailed`
    /// comes before its step, which it then skips.
    Post(ProcAddr, ToCell),
}

/// Grants of the lock actor for procedures of this shard.
pub(crate) struct Granted(pub(crate) Vec<Grant>);

impl Message for Granted {
    type Result = ();
}

/// A dispatched step: when it started (monotonic: its run time, and how long it has
/// been running for the stuck-worker monitor; one clock read a dispatch), its type and
/// step, and its tree.
struct Running {
    started: Instant,
    what: What,
    root: ProcId,
    /// The workers it counts against.
    lane: Lane,
    /// It holds locks for this step: the lock actor is told when it finishes.
    locked: bool,
}

/// How the ready queue orders steps and which workers it keeps for whom.
#[derive(Clone)]
pub(crate) struct Queueing {
    pub(crate) scheduling: Scheduling,
    /// Workers kept for level 0 of the fair order.
    pub(crate) reserved: usize,
    /// Workers beside the shared ones for system procedures' steps.
    pub(crate) system_workers: usize,
    /// Types registered as system procedures.
    pub(crate) system: Arc<HashSet<&'static str>>,
}

/// What the scheduler is doing, for operators and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Shards the trees are spread over, each with its own scheduler and its share of
    /// the workers (the figures below are their sums).
    pub shards: usize,
    /// Workers now: the configured ones plus any extra the stuck-worker monitor added.
    pub workers: usize,
    /// Workers, beside `workers`, that only system procedures' steps take, every
    /// shard's ([`ExecutorBuilder::system_workers`](crate::ExecutorBuilder::system_workers)
    /// on each).
    pub system_workers: usize,
    /// Steps running, system procedures' included.
    pub running: usize,
    /// Of `running`, steps of system procedures (on their own workers first).
    pub running_system: usize,
    /// Steps queued for a worker.
    pub queued: usize,
    /// Steps queued for a worker on each level of the fair queue, level 0 first (five
    /// levels, for trees that have run from 0, 1, 10, 60 and 300 s of steps); one entry
    /// (all of `queued`) under [`Scheduling::Fifo`].
    pub queued_by_level: Vec<usize>,
    /// Steps of system procedures queued
    /// ([`Registry::register_system`](crate::Registry::register_system)): counted in
    /// `queued`, not in `queued_by_level`.
    pub queued_system: usize,
    /// Procedures holding engine locks.
    pub lock_holders: usize,
    /// Procedures waiting for engine locks.
    pub lock_waiters: usize,
    /// Events that take memory (ready ones, and ones with waiters).
    pub events: usize,
    /// Trees with a root-stack actor running: those with work in flight.
    pub trees_active: usize,
    /// Trees passivated: nothing in flight (waiting for an event, an operator or
    /// another tree), kept by their shard as values, with no actor, until a message
    /// comes.
    pub trees_passivated: usize,
    /// Procedure actors running: those of procedures with a step queued or running, a
    /// rollback, or a hook to call. A procedure that waits (for children, an event, a
    /// timer or an operator) has none: its root stack keeps its state.
    pub procedures_active: usize,
    /// Each shard's own workers, running and queued steps, shard 0 first.
    pub per_shard: Vec<ShardLoad>,
}

/// One shard's share of [`SchedulerStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardLoad {
    /// Its workers.
    pub workers: usize,
    /// Its steps running.
    pub running: usize,
    /// Its steps queued for a worker.
    pub queued: usize,
}

/// Asks the scheduler for its [`SchedulerStats`]. Send it to the executor.
#[derive(Clone, Copy, Debug)]
pub struct GetSchedulerStats;

impl Message for GetSchedulerStats {
    type Result = Result<SchedulerStats, crate::Error>;
}

/// The stuck-worker monitor's settings.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Monitor {
    pub(crate) every: Duration,
    pub(crate) stuck_after: Duration,
    pub(crate) retire_after: Duration,
}

impl SchedulerStats {
    /// Adds another shard's figures to these.
    pub(crate) fn add(&mut self, other: &SchedulerStats) {
        self.per_shard.push(ShardLoad {
            workers: other.workers + other.system_workers,
            running: other.running,
            queued: other.queued,
        });
        self.shards += other.shards;
        self.workers += other.workers;
        self.system_workers += other.system_workers;
        self.running += other.running;
        self.running_system += other.running_system;
        self.queued += other.queued;
        self.queued_system += other.queued_system;
        if self.queued_by_level.len() < other.queued_by_level.len() {
            self.queued_by_level.resize(other.queued_by_level.len(), 0);
        }
        for (sum, n) in self.queued_by_level.iter_mut().zip(&other.queued_by_level) {
            *sum += n;
        }
    }
}

/// A shard's share of `total` workers among `shards`: as even as
/// can be, the first ones taking what does not divide.
pub(crate) fn share(total: usize, shards: usize, index: usize) -> usize {
    total / shards + usize::from(index < total % shards)
}

pub(crate) struct SchedulerActor {
    /// Queued steps by their tree (root).
    ready: ReadyQueue<Ready, ProcId>,
    /// Types registered as system procedures: their steps go first.
    system: Arc<HashSet<&'static str>>,
    /// Steps dispatched and not finished: each procedure's oldest.
    running: IdMap<ProcId, Running>,
    /// A procedure's later steps, dispatched before its earlier one's `StepFinished`
    /// arrived, oldest first. A step that queues its procedure again (a yield, a
    /// continue) may send that `Enqueue` before it frees its worker, so the next step
    /// may start first; each `StepFinished` ends the procedure's oldest step.
    overlapped: IdMap<ProcId, VecDeque<Running>>,
    workers: Workers,
    monitor_every: Duration,
    view: Arc<SchedulerViews>,
    gauges: metrics::Gauges,
    /// The lock actor, told when a step that held locks for itself finishes.
    locks: Addr<LockActor>,
    /// Ended when the executor broke or stepped down, or its lease ran out: no step
    /// is dispatched then (it would run user code whose record could never be
    /// durable, or act after a successor did).
    mandate: Arc<crate::actors::shared::Mandate>,
    /// Everything for the shard's trees (dispatched steps, what the lock actor
    /// granted), one message: sent after a monitor tick and whenever the mailbox is
    /// empty (`SendMail`).
    mail: Mail,
}

/// How a shard's scheduler is set up.
pub(crate) struct SchedulerSetup {
    /// Its share of the executor's workers (at least 1).
    pub(crate) workers: usize,
    pub(crate) queueing: Queueing,
    pub(crate) monitor: Monitor,
    pub(crate) view: Arc<SchedulerViews>,
    pub(crate) locks: Addr<LockActor>,
    pub(crate) mandate: Arc<crate::actors::shared::Mandate>,
}

impl SchedulerActor {
    pub(crate) fn new(
        SchedulerSetup {
            workers,
            queueing:
                Queueing {
                    scheduling,
                    reserved,
                    system_workers,
                    system,
                },
            monitor,
            view,
            locks,
            mandate,
        }: SchedulerSetup,
    ) -> Self {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let mut ready = ReadyQueue::new(workers, scheduling);
        ready.set_reserved(reserved);
        ready.set_system_workers(system_workers);
        SchedulerActor {
            ready,
            system,
            running: IdMap::default(),
            overlapped: IdMap::default(),
            workers: Workers::new(WorkerPolicy {
                base: workers,
                max: workers.saturating_mul(10),
                stuck_after_ms: ms(monitor.stuck_after),
                retire_after_ms: ms(monitor.retire_after),
            }),
            monitor_every: monitor.every,
            view,
            gauges: metrics::Gauges::scheduler(),
            locks,
            mandate,
            mail: Mail::default(),
        }
    }

    /// Queues a step of `root`'s tree at `place`. A system procedure's goes before all
    /// others, unless it gave its turn away (a yield): that one waits its turn like any
    /// other, or a system procedure that yields until another procedure lets go of
    /// something would keep every worker from that procedure.
    fn queue(&mut self, step: Enqueue, locked: bool) {
        let Enqueue {
            id,
            root,
            addr,
            place,
            what,
            ..
        } = step;
        let item = Ready {
            id,
            root,
            addr,
            what,
            locked,
        };
        if place != Place::Yielded && !self.system.is_empty() && self.system.contains(what.0) {
            self.ready.push_urgent(item);
        } else {
            self.ready.push(item, root, place == Place::Front);
        }
    }

    fn dispatch(&mut self) {
        if !self.mandate.dispatches() {
            // Queued steps stay queued: a restart (or a standby) runs them.
            return;
        }
        while let Some((step, lane)) = self.ready.pop() {
            let Ready {
                id,
                root,
                addr,
                what,
                locked,
            } = step;
            // A finished tree queues nothing; a step of one whose root stack is gone
            // would leak its worker, so free it.
            if addr.connected() {
                tracing::trace!(target: crate::targets::SCHEDULER, proc = %id, "dispatch");
                perturb::point("scheduler::dispatch::run_step");
                let running = Running {
                    started: super::shared::mono_now(),
                    what,
                    root,
                    lane,
                    locked,
                };
                match self.running.entry(id) {
                    Entry::Vacant(slot) => {
                        slot.insert(running);
                    }
                    Entry::Occupied(_) => {
                        self.overlapped.entry(id).or_default().push_back(running);
                    }
                }
                addr.run(&mut self.mail, what.1);
            } else {
                tracing::warn!(target: crate::targets::SCHEDULER, proc = %id, "queued procedure has no root stack");
                self.free_worker(id, lane, locked);
            }
        }
        self.gauges.set([self.ready.queued(), self.ready.busy()]);
    }

    /// The stuck-worker check: warns about steps past the threshold, and adds or
    /// retires a worker as [`Workers::check`] says.
    fn monitor(&mut self) {
        let now = now_ms();
        let mono = super::shared::mono_now();
        // Stuck steps on shared workers: the extra workers are shared ones.
        let (mut stuck, mut stuck_system) = (0, 0);
        for (id, run) in &self.running {
            let ran = u64::try_from(mono.saturating_duration_since(run.started).as_millis());
            let started = now.saturating_sub(ran.unwrap_or(u64::MAX));
            let (type_name, step) = run.what;
            if self.workers.is_stuck(started, now) {
                match run.lane {
                    Lane::Shared => stuck += 1,
                    Lane::System => stuck_system += 1,
                }
                tracing::warn!(target: crate::targets::SCHEDULER,
                    proc = %id,
                    r#type = type_name,
                    step,
                    secs = now.saturating_sub(started) / 1000,
                    "procedure stuck in one step"
                );
            }
        }
        let stuck = stuck + self.ready.system_on_shared(stuck_system);
        let change = self
            .workers
            .check(now, stuck, self.ready.busy_shared(), self.ready.queued());
        match change {
            Change::None => return,
            Change::Added => tracing::warn!(target: crate::targets::SCHEDULER,
                workers = self.workers.current(),
                stuck,
                "stuck workers: allowing an extra worker"
            ),
            Change::Retired => {
                tracing::info!(target: crate::targets::SCHEDULER, workers = self.workers.current(), "an extra worker retired")
            }
        }
        self.ready.set_workers(self.workers.current());
        self.dispatch();
    }

    /// A dispatched step of `id` is over: its worker (in `lane`) is free, and the
    /// locks it held for this step (`locked`) are released by the lock actor.
    fn free_worker(&mut self, id: ProcId, lane: Lane, locked: bool) {
        self.ready.complete(lane);
        if locked {
            self.release_step_locks(id);
        }
    }

    /// Has the lock actor release the locks `id` holds for one step (and nothing else).
    fn release_step_locks(&self, id: ProcId) {
        perturb::point("scheduler::free_worker::release_locks");
        self.locks.do_send(ReleaseLocks {
            id,
            what: Release::Step,
        });
    }

    /// A dispatched step of `id` ended and its report is recorded: its time is charged
    /// to its tree, then its worker is handed on.
    fn step_finished(&mut self, id: ProcId) {
        match self.end_oldest(id) {
            Some(run) => {
                let elapsed = u64::try_from(
                    super::shared::mono_now()
                        .saturating_duration_since(run.started)
                        .as_nanos(),
                )
                .unwrap_or(u64::MAX);
                if let Some(level) = self.ready.charge(&run.root, elapsed) {
                    let level = u8::try_from(level).unwrap_or(u8::MAX);
                    self.view.levels.insert(run.root, level);
                }
                self.free_worker(id, run.lane, run.locked);
            }
            // A bookkeeping bug: no worker is counted for it, so none is freed (its
            // step's locks still are, if it held any: releasing none is harmless).
            None => {
                tracing::warn!(target: crate::targets::SCHEDULER, proc = %id, "a step finished that is not running");
                self.release_step_locks(id);
            }
        }
        self.dispatch();
    }

    /// Takes `id`'s oldest running step out; its next one, if any, becomes the oldest.
    fn end_oldest(&mut self, id: ProcId) -> Option<Running> {
        let run = self.running.remove(&id)?;
        if let Some(later) = self.overlapped.get_mut(&id) {
            if let Some(next) = later.pop_front() {
                self.running.insert(id, next);
            }
            if later.is_empty() {
                self.overlapped.remove(&id);
            }
        }
        Some(run)
    }

    fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            shards: 1,
            workers: self.workers.current(),
            system_workers: self.ready.system_workers(),
            running: self.ready.busy(),
            running_system: self.ready.busy_system(),
            queued: self.ready.queued(),
            queued_by_level: self.ready.queued_by_level(),
            queued_system: self.ready.queued_urgent(),
            ..SchedulerStats::default()
        }
    }
}

impl Actor for SchedulerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.spawn(SendMail);
        ctx.run_interval(self.monitor_every, |act, _ctx| {
            act.monitor();
            act.mail.send();
        });
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        // What is queued and running goes with the shard; the gauges count live
        // shards only.
        self.gauges.set([0, 0]);
    }
}

/// Sends the scheduler's gathered messages to the trees once its mailbox is empty:
/// actix polls an actor's futures after handling every message waiting.
struct SendMail;

impl ActorFuture<SchedulerActor> for SendMail {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        scheduler: &mut SchedulerActor,
        _ctx: &mut Context<SchedulerActor>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        scheduler.mail.send();
        std::task::Poll::Pending
    }
}

impl Handler<FromShard> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: FromShard, ctx: &mut Context<Self>) {
        for msg in msg.0 {
            msg.handle_in(self, ctx);
        }
    }
}

/// Asks one shard's scheduler for its part of the [`SchedulerStats`] (the executor
/// adds the shards' and the lock actor's).
pub(crate) struct GetShardStats;

impl Message for GetShardStats {
    type Result = SchedulerStats;
}

impl Handler<GetShardStats> for SchedulerActor {
    type Result = MessageResult<GetShardStats>;

    fn handle(&mut self, _msg: GetShardStats, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.stats())
    }
}

impl Handler<Enqueue> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: Enqueue, _ctx: &mut Context<Self>) {
        // A step that needs locks goes to the lock actor instead (`Outgoing`).
        debug_assert!(
            msg.lock.is_none(),
            "a step that needs locks asks the lock actor"
        );
        self.queue(msg, false);
        self.dispatch();
    }
}

impl Handler<Granted> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: Granted, _ctx: &mut Context<Self>) {
        for grant in msg.0 {
            match grant {
                Grant::Step { step, locked } => self.queue(step, locked),
                Grant::Post(addr, msg) => addr.post(&mut self.mail, msg),
            }
        }
        self.dispatch();
    }
}

impl Handler<StepFinished> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: StepFinished, _ctx: &mut Context<Self>) {
        self.step_finished(msg.0);
    }
}

impl Handler<TreeEnded> for SchedulerActor {
    type Result = ();

    fn handle(&mut self, msg: TreeEnded, _ctx: &mut Context<Self>) {
        let TreeEnded { root, steps_out } = msg;
        // Every `StepFinished` the tree's root stack sent came before this: a step of
        // the tree still running died with it (a panic in engine code), and its worker
        // is freed here, or it would leak. A tree that heard back from every step it
        // was given has none running: no need to look through every running step.
        if steps_out {
            let lost: Vec<ProcId> = self
                .running
                .iter()
                .filter(|(_, run)| run.root == root)
                .map(|(id, _)| *id)
                .collect();
            for id in lost {
                while let Some(run) = self.end_oldest(id) {
                    tracing::warn!(target: crate::targets::SCHEDULER, proc = %id, "a step's tree ended before the step reported");
                    self.free_worker(id, run.lane, run.locked);
                }
            }
        } else if perturb::checking() {
            // The tests (and the perturbation test, built for release) check the
            // root stack's count against the running steps on every tree's end.
            assert!(
                !self.running.values().any(|run| run.root == root),
                "tree {root} ended saying no step of it was out, but one is running"
            );
        }
        self.ready.forget(&root);
        self.view.levels.remove(&root);
        self.dispatch();
    }
}

// ------------------------------------------------------------------------------------
// The messages this actor receives (ordering rules: `ARCHITECTURE.md`, "Protocol").
// ------------------------------------------------------------------------------------

/// Queue a step of `id`; with `lock`, once its locks are granted.
pub(crate) struct Enqueue {
    pub(crate) id: ProcId,
    /// The root of its tree: the fair queue ranks the step by the tree's step time.
    pub(crate) root: ProcId,
    pub(crate) addr: ProcAddr,
    pub(crate) place: Place,
    /// Its registered type name and which of its steps this is, counting from 1 (for
    /// the stuck-worker monitor's warnings).
    pub(crate) what: (&'static str, usize),
    /// The locks the step needs (`None`: none, or its tree has failed and the step will
    /// only be skipped).
    pub(crate) lock: Option<Request>,
}

impl Message for Enqueue {
    type Result = ();
}

/// A dispatched step of `.0` finished (or was skipped); its worker, and the locks it
/// held for this step, are free.
pub(crate) struct StepFinished(pub(crate) ProcId);

impl Message for StepFinished {
    type Result = ();
}

#[derive(Clone)]
/// The tree rooted at `root` ended (its root stack stopped): the scheduler forgets its
/// accumulated step time. A late `StepFinished` of the tree (from a procedure whose
/// root stack died) charges nothing.
pub(crate) struct TreeEnded {
    pub(crate) root: ProcId,
    /// Steps of the tree may still hold workers: its root stack was cut off (a panic
    /// in engine code) or stopped with steps it had not heard back from. Otherwise
    /// every step of it has finished, and the scheduler need not look for them.
    pub(crate) steps_out: bool,
}

impl Message for TreeEnded {
    type Result = ();
}
