//! The lock actor: one for the whole executor, owning the [`LockTable`] and the table of
//! events procedures are suspended on — what procedures wait for across trees, and so
//! across shards.
//!
//! A step that needs locks asks here (its `Enqueue` carries the request) instead of its
//! shard's scheduler; once the lock table grants it, the step goes to its tree's
//! scheduler to be queued ([`Granted`]), one message per shard and turn. So a waiting
//! procedure holds no worker, the lock order is FIFO per resource across every shard,
//! and the wait-for cycle detection sees every waiter. The per-step locks of a step are
//! released when its scheduler says it finished (`ReleaseLocks` with `Release::Step`);
//! a request that arrives while the same procedure still holds its previous step's
//! locks waits for that release. Procedures that declare no locks never message it,
//! and neither do their schedulers.
//!
//! What it knows of locks it mirrors into the shared lock view that `GetState` and
//! `List` read, and into the lock gauges.

use std::sync::Arc;

use actix::prelude::*;

use crate::events::EventTable;
use crate::fast_map::{IdMap, IdSet};
use crate::locks::{Changes, Hold, LockCycle, LockReport, LockTable, Request};
use crate::procedure::ProcId;
use crate::root_stack::RollbackOf;

use super::metrics;
use super::perturb;
use super::protocol::{
    Enqueue, LockFailed, LocksFromShard, LocksGranted, ProcAddr, Rollback, ToCell, TreeAddr,
    TreeEnded, Wake,
};
use super::scheduler::{Grant, Granted, SchedulerActor};
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

/// The lock actor's part of the scheduler statistics: procedures holding and waiting
/// for locks, and the events that take memory.
pub(crate) struct GetLockStats;

impl Message for GetLockStats {
    type Result = LockStats;
}

/// Procedures holding and waiting for locks, and events that take memory.
pub(crate) struct LockStats {
    pub(crate) holders: usize,
    pub(crate) waiters: usize,
    pub(crate) events: usize,
}

/// A request that came while the same procedure still held the locks of its previous
/// step (the release of them is still on its way): asked again right after the
/// release.
enum Deferred {
    Step(Enqueue),
    Rollback(LockForRollback),
}

/// What to do for a procedure once its locks are granted.
enum Then {
    Step(Enqueue),
    Rollback { addr: ProcAddr, of: RollbackOf },
}

struct Parked {
    root: ProcId,
    then: Then,
}

/// Grants gathered per shard, each shard's sent to its scheduler as one [`Granted`].
#[derive(Default)]
struct Grants {
    shards: Vec<Option<(Addr<SchedulerActor>, Vec<Grant>)>>,
}

impl Grants {
    fn push(&mut self, tree: &TreeAddr, grant: Grant) {
        let index = tree.index();
        if self.shards.len() <= index {
            self.shards.resize_with(index + 1, || None);
        }
        let (_, grants) =
            self.shards[index].get_or_insert_with(|| (tree.scheduler().clone(), Vec::new()));
        grants.push(grant);
    }

    fn send(&mut self) {
        for (scheduler, grants) in self.shards.iter_mut().flatten() {
            if !grants.is_empty() {
                perturb::point("locks::grants::send");
                scheduler.do_send(Granted(std::mem::take(grants)));
            }
        }
    }
}

pub(crate) struct LockActor {
    locks: LockTable,
    events: EventTable<(ProcId, TreeAddr)>,
    /// Procedures waiting in the lock table, and what to do once granted.
    parked: IdMap<ProcId, Parked>,
    /// The parked procedures of each tree, for `TreeFailed`.
    parked_by_root: IdMap<ProcId, IdSet<ProcId>>,
    /// Requests that arrived while the previous step still held its step locks.
    deferred: IdMap<ProcId, Deferred>,
    view: Arc<SchedulerViews>,
    gauges: metrics::Gauges,
    /// Steps to queue and messages for procedures, per shard (to its scheduler).
    grants: Grants,
    /// Wakes, per shard (to its trees).
    mail: Mail,
    /// Handling a shard's batch: what its messages gather is sent once, at its end.
    in_batch: bool,
    /// The latest wait-for cycles it broke or lent through, for operators.
    cycles: std::collections::VecDeque<LockCycle>,
}

/// How many handled cycles the lock actor keeps for operators.
const CYCLES_KEPT: usize = 32;

impl LockActor {
    pub(crate) fn new(permits: Vec<(String, u32)>, view: Arc<SchedulerViews>) -> Self {
        let mut locks = LockTable::new();
        for (resource, n) in permits {
            locks.set_permits(resource, n);
        }
        LockActor {
            locks,
            events: EventTable::new(),
            parked: IdMap::default(),
            parked_by_root: IdMap::default(),
            deferred: IdMap::default(),
            view,
            gauges: metrics::Gauges::locks(),
            grants: Grants::default(),
            mail: Mail::default(),
            in_batch: false,
            cycles: std::collections::VecDeque::new(),
        }
    }

    /// Sends what the handler gathered: grants to the schedulers, wakes to the trees
    /// (in a shard's batch, once, at its end).
    fn send(&mut self) {
        if self.in_batch {
            return;
        }
        self.grants.send();
        self.mail.send();
        let (holders, waiters) = self.locks.len();
        self.gauges.set([holders, waiters]);
    }

    /// Hands `step` to its scheduler to be queued; `locked`: it holds locks for this
    /// step, released when it finishes.
    fn queue(&mut self, mut step: Enqueue, locked: bool) {
        step.lock = None;
        let tree = step.addr.tree().clone();
        self.grants.push(&tree, Grant::Step { step, locked });
    }

    /// Hands the procedure at `addr` a message, in order with its steps.
    fn post(&mut self, addr: ProcAddr, msg: impl Into<ToCell>) {
        let tree = addr.tree().clone();
        self.grants.push(&tree, Grant::Post(addr, msg.into()));
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
            tracing::debug!(target: crate::targets::LOCKS, proc = %id, holders, waiters, "waiting for locks");
            self.view.locks.insert(id, LockView { locks, held: false });
        }
        self.apply(changes);
    }

    /// Releases what `id` holds if it holds it for `what` (`None`: whatever it holds).
    /// A step's end must not release locks granted meanwhile to the same procedure's
    /// rollback (a skipped step's report can start the rollback before the step's
    /// scheduler hears it finished), so each release names what it ends.
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

    fn remember(&mut self, cycle: LockCycle) {
        if self.cycles.len() == CYCLES_KEPT {
            self.cycles.pop_front();
        }
        self.cycles.push_back(cycle);
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
            tracing::warn!(target: crate::targets::LOCKS, proc = %loan.borrower, lender = %loan.lender, %loan, "deadlock no failure can break: the waiter borrows the locks of a tree that rolls back");
            self.remember(LockCycle::lent(now_ms(), loan));
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
                Then::Step(step) => {
                    if self.locks.holds(id) == Some(true) {
                        // Held for life: made durable before the step runs.
                        self.post(step.addr, LocksGranted);
                    } else {
                        self.queue(step, true);
                    }
                }
                Then::Rollback { addr, of } => self.post(addr, Rollback { of }),
            }
        }
        for deadlock in changes.deadlocks {
            let id = deadlock.victim;
            tracing::warn!(target: crate::targets::LOCKS, proc = %id, %deadlock, "deadlock: failing a waiter");
            self.remember(LockCycle::broken(now_ms(), &deadlock));
            self.view.locks.remove(&id);
            match self.unpark(id).map(|p| p.then) {
                Some(Then::Step(step)) => {
                    self.post(step.addr.clone(), LockFailed(deadlock.to_string()));
                    // Its step is still owed a report: queued, it reports itself skipped.
                    self.queue(step, false);
                }
                Some(Then::Rollback { .. }) | None => {
                    tracing::error!(target: crate::targets::LOCKS, proc = %id, "deadlock victim is not a waiting step");
                }
            }
        }
    }

    /// If `id`'s step is parked waiting for its locks, withdraws the request and
    /// queues the step without them, to come back skipped (its tree failed, or it
    /// failed past its tree's point of no return). A rollback's wait stays.
    fn withdraw_step(&mut self, id: ProcId) {
        if !matches!(self.parked.get(&id).map(|p| &p.then), Some(Then::Step(_))) {
            return;
        }
        let Some(Parked {
            then: Then::Step(step),
            ..
        }) = self.unpark(id)
        else {
            return;
        };
        self.view.locks.remove(&id);
        let changes = self.locks.release(id);
        self.queue(step, false);
        self.apply(changes);
    }
}

impl Actor for LockActor {
    type Context = Context<Self>;
}

/// Stops the lock actor: the executor's last word to it, once every shard has stopped
/// and the store is closed.
pub(crate) struct StopLocks;

impl Message for StopLocks {
    type Result = ();
}

impl Handler<StopLocks> for LockActor {
    type Result = ();

    fn handle(&mut self, _msg: StopLocks, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

impl Handler<LocksFromShard> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: LocksFromShard, ctx: &mut Context<Self>) {
        self.in_batch = true;
        for msg in msg.0 {
            msg.handle_in(self, ctx);
        }
        self.in_batch = false;
        self.send();
    }
}

/// The locks as an operator sees them: resources with holders and queues, standing
/// cycles, the latest cycles handled (for `Executor::locks`).
pub(crate) struct GetLockReport;

impl Message for GetLockReport {
    type Result = LockReport;
}

impl Handler<GetLockReport> for LockActor {
    type Result = MessageResult<GetLockReport>;

    fn handle(&mut self, _msg: GetLockReport, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(LockReport {
            resources: self.locks.resources(),
            standing: self.locks.standing(),
            cycles: self.cycles.iter().cloned().collect(),
        })
    }
}

impl Handler<GetLockStats> for LockActor {
    type Result = MessageResult<GetLockStats>;

    fn handle(&mut self, _msg: GetLockStats, _ctx: &mut Context<Self>) -> Self::Result {
        let (holders, waiters) = self.locks.len();
        MessageResult(LockStats {
            holders,
            waiters,
            events: self.events.len(),
        })
    }
}

impl Handler<Enqueue> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: Enqueue, _ctx: &mut Context<Self>) {
        let Some(req) = msg.lock.clone() else {
            // Withdrawn while deferred: it only reports itself skipped.
            self.queue(msg, false);
            self.send();
            return;
        };
        match self.locks.holds(msg.id) {
            Some(true) => self.queue(msg, false),
            // The previous step's report was recorded but its end (which frees its
            // locks) has not reached here yet: ask again after it.
            Some(false) => {
                self.deferred.insert(msg.id, Deferred::Step(msg));
            }
            None => self.request(req, Then::Step(msg)),
        }
        self.send();
    }
}

impl Handler<LockForRollback> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: LockForRollback, _ctx: &mut Context<Self>) {
        match self.locks.held_for(msg.id) {
            // Held for its life: through its rollback.
            Some(Hold::Life) => self.post(msg.addr, Rollback { of: msg.of }),
            // A skipped step's report can start the rollback before the step's end
            // frees the step's locks: ask once they are freed, or the rollback would
            // run under locks about to go.
            Some(Hold::Step | Hold::RollbackStep) => {
                self.deferred.insert(msg.id, Deferred::Rollback(msg));
            }
            None => {
                let then = Then::Rollback {
                    addr: msg.addr,
                    of: msg.of,
                };
                self.request(msg.lock, then);
            }
        }
        self.send();
    }
}

impl Handler<ReleaseLocks> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: ReleaseLocks, ctx: &mut Context<Self>) {
        let what = match msg.what {
            Release::Step => Some(Hold::Step),
            Release::RollbackStep => Some(Hold::RollbackStep),
            Release::All => None,
        };
        self.release(msg.id, what);
        self.undefer(msg.id, ctx);
        self.send();
    }
}

impl Handler<TreeFailed> for LockActor {
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
        self.send();
    }
}

impl Handler<TreeIrreversible> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: TreeIrreversible, _ctx: &mut Context<Self>) {
        self.locks.set_irreversible(msg.0, true);
    }
}

impl Handler<TreeEnded> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: TreeEnded, _ctx: &mut Context<Self>) {
        self.locks.set_irreversible(msg.root, false);
    }
}

impl Handler<WithdrawStep> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: WithdrawStep, _ctx: &mut Context<Self>) {
        let id = msg.0;
        // Deferred behind its previous step's locks: it asks for none when it comes.
        if let Some(Deferred::Step(step)) = self.deferred.get_mut(&id) {
            step.lock = None;
        }
        // Granted already, or never waited: its step comes back as it is.
        self.withdraw_step(id);
        self.send();
    }
}

impl Handler<Regrant> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: Regrant, _ctx: &mut Context<Self>) {
        for req in msg.0 {
            let (id, locks) = (req.owner, req.locks.clone());
            if self.locks.force_grant(req) {
                tracing::debug!(target: crate::targets::LOCKS, proc = %id, "locks granted back after recovery");
                self.view.locks.insert(id, LockView { locks, held: true });
            }
        }
        self.send();
    }
}

impl Handler<SuspendOn> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: SuspendOn, _ctx: &mut Context<Self>) {
        if let Some((id, root_stack)) = self.events.suspend(&msg.event, (msg.id, msg.root_stack)) {
            self.mail.push(&root_stack, Wake(id));
        }
        self.send();
    }
}

impl Handler<WakeEvent> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        for (id, root_stack) in self.events.wake(&msg.0) {
            self.mail.push(&root_stack, Wake(id));
        }
        self.send();
    }
}

impl Handler<Unsuspend> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: Unsuspend, _ctx: &mut Context<Self>) {
        self.events.cancel(&msg.event, |(id, _)| *id == msg.id);
    }
}

impl Handler<ResetEvent> for LockActor {
    type Result = ();

    fn handle(&mut self, msg: ResetEvent, _ctx: &mut Context<Self>) {
        self.events.reset(&msg.0);
    }
}

// ------------------------------------------------------------------------------------
// The messages this actor receives (ordering rules: `ARCHITECTURE.md`, "Protocol").
// ------------------------------------------------------------------------------------

/// Wake `id` through its root stack once `event` is woken (at once if it already is).
pub(crate) struct SuspendOn {
    pub(crate) id: ProcId,
    pub(crate) event: String,
    pub(crate) root_stack: TreeAddr,
}

impl Message for SuspendOn {
    type Result = ();
}

/// `id` stopped while suspended on `event`: drop it from the event's waiters (from its
/// root stack, after the `SuspendOn` it sent before).
pub(crate) struct Unsuspend {
    pub(crate) id: ProcId,
    pub(crate) event: String,
}

impl Message for Unsuspend {
    type Result = ();
}

/// Roll back a step of `id` once its locks are granted (from the root stack).
pub(crate) struct LockForRollback {
    pub(crate) id: ProcId,
    pub(crate) addr: ProcAddr,
    pub(crate) lock: Request,
    pub(crate) of: RollbackOf,
}

impl Message for LockForRollback {
    type Result = ();
}

/// Release the locks of `id`: those of one step (from its scheduler, when the step
/// finished), of one rollback step (from its procedure cell), or everything it holds
/// (from its root stack: it finished, or will never run again).
pub(crate) struct ReleaseLocks {
    pub(crate) id: ProcId,
    pub(crate) what: Release,
}

/// Which of a procedure's locks a [`ReleaseLocks`] ends: each release names what it
/// ends, so that a step's end does not release locks granted meanwhile to the same
/// procedure's rollback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Those held for one step.
    Step,
    /// Those held for one rollback step.
    RollbackStep,
    /// Whatever it holds.
    All,
}

impl Message for ReleaseLocks {
    type Result = ();
}

/// The tree rooted at `.0` failed: its waiting step requests are withdrawn and the
/// steps queued, to be skipped (from the root stack).
pub(crate) struct TreeFailed(pub(crate) ProcId);

impl Message for TreeFailed {
    type Result = ();
}

/// The tree rooted at `.0` has passed its point of no return (from its root stack, once
/// a step marking it is reported, or at start for a recovered one): a deadlock's victim
/// is taken from other trees while one can be (until its `TreeEnded`).
pub(crate) struct TreeIrreversible(pub(crate) ProcId);

impl Message for TreeIrreversible {
    type Result = ();
}

/// The queued step of `.0` is to be skipped (its procedure failed past the point of no
/// return, and pauses when the step comes back): if it waits for its locks, the request
/// is withdrawn and the step queued (from the root stack).
pub(crate) struct WithdrawStep(pub(crate) ProcId);

impl Message for WithdrawStep {
    type Result = ();
}

/// Grant these recovered life-long holds before anything else is scheduled (from the
/// executor, before any root stack starts).
pub(crate) struct Regrant(pub(crate) Vec<Request>);

impl Message for Regrant {
    type Result = ();
}
