//! The scheduler actor: its mailbox decides what runs next, and what is written.
//!
//! It owns the [`ReadyQueue`] (at most `workers` steps at once, in the order of the
//! executor's [`Scheduling`]: the multilevel fair queue by default, or FIFO with a
//! front for procedures that continue), the [`LockTable`] and the table of events
//! procedures are suspended on. It times every step it dispatches (from `RunStep` to
//! its `StepFinished`) and charges the time to the step's tree, whose accumulated time
//! puts it on a level of the fair queue; a tree's time is dropped at its `TreeEnded`. A
//! procedure waiting for children, an event, a deadline or its locks is not in the
//! ready queue and holds no worker. Every enqueue comes from a root stack, after the
//! step that caused it is durable; the scheduler itself never changes a procedure's
//! state. What it knows of locks it mirrors into the shared lock view that `GetState`
//! and `List` read.
//!
//! It also holds the group commit in front of the store ([`Persistence`]): a step's
//! records and the end of the step come in one message (`Persist` with `finished`), and
//! it answers each append once its batch is durable.

use std::collections::hash_map::Entry;
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::events::EventTable;
use crate::fast_map::{IdMap, IdSet};
use crate::locks::{Changes, Hold, LockTable, Request};
use crate::procedure::ProcId;
use crate::ready_queue::{Lane, ReadyQueue, Scheduling};
use crate::root_stack::Place;
use crate::workers::{Change, WorkerPolicy, Workers};

use super::metrics;
use super::persistence::{BatchResult, InFlight, Persistence};
use super::perturb;
use super::protocol::{
    DurableAck, Enqueue, FromShard, LockFailed, LockForRollback, LocksGranted, Persist, ProcAddr,
    Refuse, Regrant, ReleaseLocks, Rollback, RunStep, StepFinished, StopWriter, SuspendOn,
    TreeAddr, TreeEnded, TreeFailed, TreeIrreversible, Unsuspend, Wake, WithdrawStep,
};
use super::shard::Mail;
use super::shared::{now_ms, LockView, SchedulerViews};

/// Makes the named event ready and wakes the procedures suspended on it, oldest first;
/// until it is reset ([`ResetEvent`]), procedures that suspend on it go on at once.
/// Send it to the executor.
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// executor.wake_event("region-17-online").await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct WakeEvent(pub String);

impl Message for WakeEvent {
    type Result = ();
}

/// Makes the named event not ready again: procedures that suspend on it from now on
/// wait for the next [`WakeEvent`]. An event that is not ready and has no waiters takes
/// no memory. Send it to the executor.
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// executor.reset_event("region-17-online").await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct ResetEvent(pub String);

impl Message for ResetEvent {
    type Result = ();
}

/// A request that came while the same procedure still held the locks of its previous
/// step (its `StepFinished`, which releases them, is still on its way): asked again
/// right after the release.
enum Deferred {
    Step(Enqueue),
    Rollback(LockForRollback),
}

/// What to do for a procedure once its locks are granted.
enum Then {
    Step {
        addr: ProcAddr,
        place: Place,
        what: What,
    },
    Rollback {
        addr: ProcAddr,
        unrecorded: bool,
    },
}

struct Parked {
    root: ProcId,
    then: Then,
}

/// A procedure's type and which of its steps is queued (from 1).
type What = (&'static str, usize);

/// A queued step: who, its tree (root), its actor, its type and step.
type Ready = (ProcId, ProcId, ProcAddr, What);

/// A dispatched step: when it started (monotonic: its run time, and how long it has
/// been running for the stuck-worker monitor; one clock read a dispatch), its type and
/// step, and its tree.
struct Running {
    started: Instant,
    what: What,
    root: ProcId,
    /// The workers it counts against.
    lane: Lane,
}

/// How the ready queue orders steps and which workers it keeps for whom.
pub(crate) struct Queueing {
    pub(crate) scheduling: Scheduling,
    /// Workers kept for level 0 of the fair order.
    pub(crate) reserved: usize,
    /// Workers beside the shared ones for system procedures' steps.
    pub(crate) system_workers: usize,
    /// Types registered as system procedures.
    pub(crate) system: HashSet<&'static str>,
}

/// What the scheduler is doing, for operators and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Workers now: the configured ones plus any extra the stuck-worker monitor added.
    pub workers: usize,
    /// Workers, beside `workers`, that only system procedures' steps take
    /// ([`ExecutorBuilder::system_workers`](crate::ExecutorBuilder::system_workers)).
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

pub(crate) struct Scheduler {
    /// Queued steps by their tree (root).
    ready: ReadyQueue<Ready, ProcId>,
    /// Types registered as system procedures: their steps go first.
    system: HashSet<&'static str>,
    /// Steps dispatched and not finished: each procedure's oldest.
    running: IdMap<ProcId, Running>,
    /// A procedure's later steps, dispatched before its earlier one's `StepFinished`
    /// arrived, oldest first. A step that queues its procedure again (a yield, a
    /// continue) sends that `Enqueue` before it frees its worker, so the next step may
    /// start first; each `StepFinished` ends the procedure's oldest step.
    overlapped: IdMap<ProcId, VecDeque<Running>>,
    workers: Workers,
    monitor_every: Duration,
    events: EventTable<(ProcId, TreeAddr)>,
    locks: LockTable,
    /// Procedures waiting in the lock table, and what to do once granted.
    parked: IdMap<ProcId, Parked>,
    /// The parked procedures of each tree, for `TreeFailed`.
    parked_by_root: IdMap<ProcId, IdSet<ProcId>>,
    /// Enqueues that arrived while the previous step still held its step locks.
    deferred: IdMap<ProcId, Deferred>,
    view: Arc<SchedulerViews>,
    gauges: metrics::SchedulerGauges,
    /// The group commit in front of the store: appends share this mailbox with the
    /// steps whose reports made them.
    persistence: Persistence,
    /// Everything for the trees (acknowledgements, dispatched steps, grants, wakes), one
    /// message per shard: sent once a durable batch is answered, after a monitor tick,
    /// before the scheduler stops, and whenever its mailbox is empty (`SendMail`).
    mail: Mail,
}

impl Scheduler {
    pub(crate) fn new(
        workers: usize,
        Queueing {
            scheduling,
            reserved,
            system_workers,
            system,
        }: Queueing,
        monitor: Monitor,
        permits: Vec<(String, u32)>,
        view: Arc<SchedulerViews>,
        persistence: Persistence,
    ) -> Self {
        let mut locks = LockTable::new();
        for (resource, n) in permits {
            locks.set_permits(resource, n);
        }
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let mut ready = ReadyQueue::new(workers, scheduling);
        ready.set_reserved(reserved);
        ready.set_system_workers(system_workers);
        Scheduler {
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
            events: EventTable::new(),
            locks,
            parked: IdMap::default(),
            parked_by_root: IdMap::default(),
            deferred: IdMap::default(),
            view,
            gauges: metrics::SchedulerGauges::new(),
            persistence,
            mail: Mail::default(),
        }
    }

    /// Queues a step of `root`'s tree at `place`. A system procedure's goes before all
    /// others, unless it gave its turn away (a yield): that one waits its turn like any
    /// other, or a system procedure that yields until another procedure lets go of
    /// something would keep every worker from that procedure.
    fn queue(&mut self, item: Ready, root: ProcId, place: Place) {
        if place != Place::Yielded && !self.system.is_empty() && self.system.contains(item.3 .0) {
            self.ready.push_urgent(item);
        } else {
            self.ready.push(item, root, place == Place::Front);
        }
    }

    /// Queues the step an `Enqueue` asks for, its locks (if any) already held.
    fn queue_step(&mut self, step: Enqueue) {
        let (place, root) = (step.place, step.root);
        self.queue((step.id, root, step.addr, step.what), root, place);
    }

    fn dispatch(&mut self) {
        while let Some(((id, root, addr, what), lane)) = self.ready.pop() {
            // A procedure's actor stops only after its tree has finished, and a finished
            // tree queues nothing; a stopped one here would leak the worker, so free it.
            if addr.connected() {
                tracing::trace!(proc = %id, "dispatch");
                perturb::point("scheduler::dispatch::run_step");
                let running = Running {
                    started: Instant::now(),
                    what,
                    root,
                    lane,
                };
                match self.running.entry(id) {
                    Entry::Vacant(slot) => {
                        slot.insert(running);
                    }
                    Entry::Occupied(_) => {
                        self.overlapped.entry(id).or_default().push_back(running);
                    }
                }
                addr.post(
                    &mut self.mail,
                    RunStep {
                        step: what.1,
                        children: None,
                    },
                );
            } else {
                tracing::warn!(proc = %id, "queued procedure has no actor");
                self.ready.complete(lane);
                self.release(id, Some(Hold::Step));
            }
        }
        let (holders, waiters) = self.locks.len();
        let counts = [self.ready.queued(), self.ready.busy(), holders, waiters];
        self.gauges.set(counts);
    }

    /// The stuck-worker check: warns about steps past the threshold, and adds or
    /// retires a worker as [`Workers::check`] says.
    fn monitor(&mut self) {
        let now = now_ms();
        let mono = Instant::now();
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
                tracing::warn!(
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
            Change::Added => tracing::warn!(
                workers = self.workers.current(),
                stuck,
                "stuck workers: allowing an extra worker"
            ),
            Change::Retired => {
                tracing::info!(workers = self.workers.current(), "an extra worker retired")
            }
        }
        self.ready.set_workers(self.workers.current());
        self.dispatch();
    }

    /// Asks again for what waited on `id`'s previous locks, now released.
    fn undefer(&mut self, id: ProcId, ctx: &mut Context<Self>) {
        if self.locks.held_for(id).is_some() {
            return;
        }
        match self.deferred.remove(&id) {
            Some(Deferred::Step(msg)) => <Self as Handler<Enqueue>>::handle(self, msg, ctx),
            Some(Deferred::Rollback(msg)) => {
                <Self as Handler<LockForRollback>>::handle(self, msg, ctx)
            }
            None => {}
        }
    }

    /// A dispatched step of `id` is over: its worker (in `lane`; `None` if none was
    /// counted for it) and its step's locks are free, and what waited on those locks is
    /// asked again.
    fn free_worker(&mut self, id: ProcId, lane: Option<Lane>, ctx: &mut Context<Self>) {
        if let Some(lane) = lane {
            self.ready.complete(lane);
        }
        self.release(id, Some(Hold::Step));
        self.undefer(id, ctx);
    }

    /// Asks the lock table for `req`, parked until granted.
    fn request(&mut self, req: Request, then: Then) {
        let id = req.owner;
        self.parked.insert(
            id,
            Parked {
                root: req.root,
                then,
            },
        );
        self.parked_by_root.entry(req.root).or_default().insert(id);
        let locks = req.locks.clone();
        let changes = self.locks.request(req);
        if self.parked.contains_key(&id) && self.locks.waited_by(id).is_some() {
            let (holders, waiters) = self.locks.len();
            tracing::debug!(proc = %id, holders, waiters, "waiting for locks");
            self.view.locks.insert(id, LockView { locks, held: false });
        }
        self.apply(changes);
    }

    /// Releases what `id` holds if it holds it for `what` (`None`: whatever it holds).
    /// A step's `StepFinished` must not release locks granted meanwhile to the same
    /// procedure's rollback (a skipped step's report can start the rollback before its
    /// `StepFinished` is sent), so each release names what it ends.
    fn release(&mut self, id: ProcId, what: Option<Hold>) {
        match self.locks.held_for(id) {
            Some(held) if what.is_none_or(|w| w == held) => {
                self.view.locks.remove(&id);
                let changes = self.locks.release(id);
                self.apply(changes);
            }
            _ => {}
        }
    }

    fn unpark(&mut self, id: ProcId) -> Option<Parked> {
        let parked = self.parked.remove(&id)?;
        if let Some(set) = self.parked_by_root.get_mut(&parked.root) {
            set.remove(&id);
            if set.is_empty() {
                self.parked_by_root.remove(&parked.root);
            }
        }
        Some(parked)
    }

    /// Acts on what the lock table granted and whom it failed.
    fn apply(&mut self, changes: Changes) {
        // Logged before the grants go out (the perturbation test orders a borrower's
        // calls after its loan by this event).
        for loan in &changes.loans {
            tracing::warn!(proc = %loan.borrower, lender = %loan.lender, %loan, "deadlock no failure can break: the waiter borrows the locks of a tree that rolls back");
        }
        for id in changes.granted {
            let Some(parked) = self.unpark(id) else {
                continue;
            };
            if let Some(locks) = self.locks.held_by(id) {
                self.view.locks.insert(
                    id,
                    LockView {
                        locks: locks.to_vec(),
                        held: true,
                    },
                );
            }
            match parked.then {
                Then::Step { addr, place, what } => {
                    if self.locks.holds(id) == Some(true) {
                        // Held for life: made durable before the step runs.
                        addr.post(&mut self.mail, LocksGranted);
                    } else {
                        self.queue((id, parked.root, addr, what), parked.root, place);
                    }
                }
                Then::Rollback { addr, unrecorded } => {
                    addr.post(&mut self.mail, Rollback { unrecorded })
                }
            }
        }
        for deadlock in changes.deadlocks {
            let id = deadlock.victim;
            tracing::warn!(proc = %id, %deadlock, "deadlock: failing a waiter");
            self.view.locks.remove(&id);
            match self.unpark(id).map(|p| (p.root, p.then)) {
                Some((root, Then::Step { addr, place, what })) => {
                    addr.post(&mut self.mail, LockFailed(deadlock.to_string()));
                    // Its step is still owed a report: queued, it reports itself skipped.
                    self.queue((id, root, addr, what), root, place);
                }
                Some((_, Then::Rollback { .. })) | None => {
                    tracing::error!(proc = %id, "deadlock victim is not a waiting step");
                }
            }
        }
        self.dispatch();
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.spawn(SendMail);
        ctx.run_interval(self.monitor_every, |act, _ctx| {
            act.monitor();
            act.mail.send();
        });
    }

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.persistence.close_writer();
    }
}

/// Sends the scheduler's gathered messages to the trees once its mailbox is empty:
/// actix polls an actor's futures after handling every message waiting. (What a future
/// of the scheduler's own gathers, it sends before it returns.)
struct SendMail;

impl ActorFuture<Scheduler> for SendMail {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        scheduler: &mut Scheduler,
        _ctx: &mut Context<Scheduler>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        scheduler.mail.send();
        std::task::Poll::Pending
    }
}

impl Handler<FromShard> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: FromShard, ctx: &mut Context<Self>) {
        for msg in msg.0 {
            msg.handle_in(self, ctx);
        }
    }
}

impl Handler<GetSchedulerStats> for Scheduler {
    type Result = Result<SchedulerStats, crate::Error>;

    fn handle(&mut self, _msg: GetSchedulerStats, _ctx: &mut Context<Self>) -> Self::Result {
        let (lock_holders, lock_waiters) = self.locks.len();
        Ok(SchedulerStats {
            workers: self.workers.current(),
            system_workers: self.ready.system_workers(),
            running: self.ready.busy(),
            running_system: self.ready.busy_system(),
            queued: self.ready.queued(),
            queued_by_level: self.ready.queued_by_level(),
            queued_system: self.ready.queued_urgent(),
            lock_holders,
            lock_waiters,
            events: self.events.len(),
        })
    }
}

impl Handler<Enqueue> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Enqueue, _ctx: &mut Context<Self>) {
        let Some(req) = msg.lock.clone() else {
            self.queue_step(msg);
            self.dispatch();
            return;
        };
        match self.locks.holds(msg.id) {
            Some(true) => {
                self.queue_step(msg);
                self.dispatch();
            }
            // The previous step's report was recorded but its StepFinished (which frees
            // its locks) is still on its way: ask again after it.
            Some(false) => {
                self.deferred.insert(msg.id, Deferred::Step(msg));
            }
            None => {
                let then = Then::Step {
                    addr: msg.addr,
                    place: msg.place,
                    what: msg.what,
                };
                self.request(req, then);
            }
        }
    }
}

impl Handler<StepFinished> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: StepFinished, ctx: &mut Context<Self>) {
        self.step_finished(msg.0, ctx);
    }
}

impl Scheduler {
    /// A dispatched step of `id` ended and its report is recorded: its time is charged
    /// to its tree, then its worker is handed on.
    fn step_finished(&mut self, id: ProcId, ctx: &mut Context<Self>) {
        let lane = match self.end_oldest(id) {
            Some(run) => {
                let elapsed = u64::try_from(run.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                if let Some(level) = self.ready.charge(&run.root, elapsed) {
                    let level = u8::try_from(level).unwrap_or(u8::MAX);
                    self.view.levels.insert(run.root, level);
                }
                Some(run.lane)
            }
            // A bookkeeping bug: no worker is counted for it, so none is freed (its
            // step's locks still are).
            None => {
                tracing::warn!(proc = %id, "a step finished that is not running");
                None
            }
        };
        self.free_worker(id, lane, ctx);
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

    /// Waits for a batch handed to the writer thread; when it is answered, answers its
    /// appends and hands the writer the next batch.
    fn wait_for(&mut self, batch: Option<InFlight>, ctx: &mut Context<Self>) {
        let Some(InFlight { answer, acks }) = batch else {
            return;
        };
        ctx.spawn(answer.into_actor(self).map(move |answer, act, ctx| {
            act.batch_done(answer, acks, ctx);
        }));
    }

    /// A batch is durable (or failed): queues the steps its transitions queue without
    /// locks, answers each append in order, hands the writer the next batch, and only
    /// then dispatches, so each root stack gets its `Durable` before any `RunStep` of
    /// those steps (both go into the mail, in that order, sent as one message per
    /// shard).
    fn batch_done(
        &mut self,
        answer: Result<BatchResult, oneshot::error::RecvError>,
        acks: Vec<DurableAck>,
        ctx: &mut Context<Self>,
    ) {
        if let Some(mut acks) = self.persistence.done(answer, acks, &mut self.mail) {
            for ack in acks.drain(..) {
                match ack {
                    DurableAck::Tree(mut ack) => {
                        let steps = ack.take_steps();
                        let enqueued = steps.len();
                        for step in steps {
                            self.queue_step(step);
                        }
                        ack.durable(enqueued, &mut self.mail);
                    }
                    caller @ DurableAck::Caller(_) => caller.send(Ok(()), &mut self.mail),
                }
            }
            self.persistence.recycle(acks);
        }
        let next = self.persistence.next_batch(&mut self.mail);
        self.wait_for(next, ctx);
        self.dispatch();
        // The batch's answers, then the steps dispatched after them (a future's mail is
        // sent by the future itself).
        self.mail.send();
    }
}

impl Handler<Persist> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        let batch = self.persistence.append(msg.ops, msg.ack, &mut self.mail);
        self.wait_for(batch, ctx);
        if let Some(id) = msg.finished {
            self.step_finished(id, ctx);
        }
    }
}

impl Handler<Refuse> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Refuse, _ctx: &mut Context<Self>) {
        self.persistence.refuse(msg.0, &mut self.mail);
    }
}

impl Handler<StopWriter> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: StopWriter, ctx: &mut Context<Self>) {
        self.persistence.stop(msg.drained, &mut self.mail);
        // A stopping actor polls no future: its mail goes now.
        self.mail.send();
        ctx.stop();
    }
}

impl Handler<LockForRollback> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: LockForRollback, _ctx: &mut Context<Self>) {
        match self.locks.held_for(msg.id) {
            // Held for its life: through its rollback.
            Some(Hold::Life) => msg.addr.post(
                &mut self.mail,
                Rollback {
                    unrecorded: msg.unrecorded,
                },
            ),
            // A skipped step's report can start the rollback before the step's
            // StepFinished frees the step's locks: ask once they are freed, or the
            // rollback would run under locks about to go.
            Some(Hold::Step | Hold::RollbackStep) => {
                self.deferred.insert(msg.id, Deferred::Rollback(msg));
            }
            None => {
                let then = Then::Rollback {
                    addr: msg.addr,
                    unrecorded: msg.unrecorded,
                };
                self.request(msg.lock, then);
            }
        }
    }
}

impl Handler<ReleaseLocks> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: ReleaseLocks, _ctx: &mut Context<Self>) {
        let what = if msg.step_only {
            Some(Hold::RollbackStep)
        } else {
            None
        };
        self.release(msg.id, what);
        self.undefer(msg.id, _ctx);
    }
}

impl Handler<TreeFailed> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: TreeFailed, _ctx: &mut Context<Self>) {
        // A step deferred behind its previous step's locks asked for its own before
        // the tree failed: it only needs to report itself skipped now.
        for deferred in self.deferred.values_mut() {
            if let Deferred::Step(step) = deferred {
                if step.lock.as_ref().is_some_and(|l| l.root == msg.0) {
                    step.lock = None;
                }
            }
        }
        let ids: Vec<ProcId> = self
            .parked_by_root
            .get(&msg.0)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        for id in ids {
            // Its tree has failed, so it only reports a skip.
            self.withdraw_step(id);
        }
        self.dispatch();
    }
}

impl Scheduler {
    /// If `id`'s step is parked waiting for its locks, withdraws the request and
    /// queues the step without them, to come back skipped (its tree failed, or it
    /// failed past its tree's point of no return). A rollback's wait stays.
    fn withdraw_step(&mut self, id: ProcId) {
        if !matches!(
            self.parked.get(&id).map(|p| &p.then),
            Some(Then::Step { .. })
        ) {
            return;
        }
        let Some(Parked {
            then: Then::Step { addr, place, what },
            root,
        }) = self.unpark(id)
        else {
            return;
        };
        self.view.locks.remove(&id);
        let changes = self.locks.release(id);
        self.queue((id, root, addr, what), root, place);
        self.apply(changes);
    }
}

impl Handler<TreeIrreversible> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: TreeIrreversible, _ctx: &mut Context<Self>) {
        self.locks.set_irreversible(msg.0, true);
    }
}

impl Handler<WithdrawStep> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: WithdrawStep, _ctx: &mut Context<Self>) {
        let id = msg.0;
        // Deferred behind its previous step's locks: it asks for none when it comes.
        if let Some(Deferred::Step(step)) = self.deferred.get_mut(&id) {
            step.lock = None;
        }
        // Granted already, or never waited: its step comes back as it is.
        self.withdraw_step(id);
        self.dispatch();
    }
}

impl Handler<Regrant> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Regrant, _ctx: &mut Context<Self>) {
        for req in msg.0 {
            let (id, locks) = (req.owner, req.locks.clone());
            if self.locks.force_grant(req) {
                tracing::debug!(proc = %id, "locks granted back after recovery");
                self.view.locks.insert(id, LockView { locks, held: true });
            }
        }
        let (holders, waiters) = self.locks.len();
        let counts = [self.ready.queued(), self.ready.busy(), holders, waiters];
        self.gauges.set(counts);
    }
}

impl Handler<SuspendOn> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: SuspendOn, _ctx: &mut Context<Self>) {
        if let Some((id, root_stack)) = self.events.suspend(&msg.event, (msg.id, msg.root_stack)) {
            self.mail.push(&root_stack, Wake(id));
        }
    }
}

impl Handler<WakeEvent> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        for (id, root_stack) in self.events.wake(&msg.0) {
            self.mail.push(&root_stack, Wake(id));
        }
    }
}

impl Handler<Unsuspend> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Unsuspend, _ctx: &mut Context<Self>) {
        self.events.cancel(&msg.event, |(id, _)| *id == msg.id);
    }
}

impl Handler<ResetEvent> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: ResetEvent, _ctx: &mut Context<Self>) {
        self.events.reset(&msg.0);
    }
}

impl Handler<TreeEnded> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: TreeEnded, ctx: &mut Context<Self>) {
        let TreeEnded { root, steps_out } = msg;
        self.locks.set_irreversible(root, false);
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
                    tracing::warn!(proc = %id, "a step's tree ended before the step reported");
                    self.free_worker(id, Some(run.lane), ctx);
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
