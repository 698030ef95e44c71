//! The scheduler actor: its mailbox decides what runs next.
//!
//! It owns the [`ReadyQueue`] (FIFO, a front for procedures that continue, at most
//! `workers` steps at once), the [`LockTable`] and the table of events procedures are
//! suspended on. A procedure waiting for children, an event, a deadline or its locks is
//! not in the ready queue and holds no worker. Every enqueue comes from a root stack,
//! after the step that caused it is durable; the scheduler itself never changes a
//! procedure's state. What it knows of locks it mirrors into the shared lock view that
//! `GetState` and `List` read.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use actix::prelude::*;

use crate::events::EventTable;
use crate::locks::{Changes, LockTable, Request};
use crate::procedure::ProcId;
use crate::ready_queue::ReadyQueue;

use super::perturb;
use super::procedure::ProcedureActor;
use super::protocol::{
    Enqueue, LockFailed, LockForRollback, LocksGranted, Regrant, ReleaseLocks, Rollback, RunStep,
    StepFinished, SuspendOn, TreeFailed, Wake,
};
use super::root_stack::RootStackActor;
use super::shared::{LockView, LockViews};

/// Makes the named event ready and wakes the procedures suspended on it, oldest first;
/// until it is reset ([`ResetEvent`]), procedures that suspend on it go on at once.
/// Send it to the executor.
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// executor.wake_event("region-17-online").await?;
/// # Ok(()) }
/// ```
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
pub struct ResetEvent(pub String);

impl Message for ResetEvent {
    type Result = ();
}

/// What to do for a procedure once its locks are granted.
enum Then {
    Step {
        addr: Addr<ProcedureActor>,
        front: bool,
    },
    Rollback {
        addr: Addr<ProcedureActor>,
        unrecorded: bool,
    },
}

struct Parked {
    root: ProcId,
    then: Then,
}

pub(crate) struct Scheduler {
    ready: ReadyQueue<(ProcId, Addr<ProcedureActor>)>,
    events: EventTable<(ProcId, Addr<RootStackActor>)>,
    locks: LockTable,
    /// Procedures waiting in the lock table, and what to do once granted.
    parked: HashMap<ProcId, Parked>,
    /// The parked procedures of each tree, for `TreeFailed`.
    parked_by_root: HashMap<ProcId, HashSet<ProcId>>,
    /// Enqueues that arrived while the previous step still held its step locks.
    deferred: HashMap<ProcId, Enqueue>,
    view: Arc<LockViews>,
}

impl Scheduler {
    pub(crate) fn new(workers: usize, permits: Vec<(String, u32)>, view: Arc<LockViews>) -> Self {
        let mut locks = LockTable::new();
        for (resource, n) in permits {
            locks.set_permits(resource, n);
        }
        Scheduler {
            ready: ReadyQueue::new(workers),
            events: EventTable::new(),
            locks,
            parked: HashMap::new(),
            parked_by_root: HashMap::new(),
            deferred: HashMap::new(),
            view,
        }
    }

    fn dispatch(&mut self) {
        while let Some((id, addr)) = self.ready.pop() {
            // A procedure's actor stops only after its tree has finished, and a finished
            // tree queues nothing; a stopped one here would leak the worker, so free it.
            if addr.connected() {
                tracing::trace!(proc = %id, "dispatch");
                perturb::point("scheduler::dispatch::run_step");
                addr.do_send(RunStep);
            } else {
                tracing::warn!(proc = %id, "queued procedure has no actor");
                self.ready.complete();
                self.release(id, true);
            }
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
            tracing::debug!(proc = %id, holders, waiters, "waiting for locks");
            self.view.insert(id, LockView { locks, held: false });
        }
        self.apply(changes);
    }

    /// Releases what `id` holds for one step (`step_only`) or everything.
    fn release(&mut self, id: ProcId, step_only: bool) {
        match self.locks.holds(id) {
            Some(true) if step_only => {}
            Some(_) => {
                self.view.remove(&id);
                let changes = self.locks.release(id);
                self.apply(changes);
            }
            None => {}
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
        for id in changes.granted {
            let Some(parked) = self.unpark(id) else {
                continue;
            };
            if let Some(locks) = self.locks.held_by(id) {
                self.view.insert(
                    id,
                    LockView {
                        locks: locks.to_vec(),
                        held: true,
                    },
                );
            }
            match parked.then {
                Then::Step { addr, front } => {
                    if self.locks.holds(id) == Some(true) {
                        // Held for life: made durable before the step runs.
                        addr.do_send(LocksGranted);
                    } else {
                        self.ready.push((id, addr), front);
                    }
                }
                Then::Rollback { addr, unrecorded } => addr.do_send(Rollback { unrecorded }),
            }
        }
        for deadlock in changes.deadlocks {
            let id = deadlock.victim;
            tracing::warn!(proc = %id, %deadlock, "deadlock: failing the younger tree");
            self.view.remove(&id);
            match self.unpark(id).map(|p| p.then) {
                Some(Then::Step { addr, front }) => {
                    addr.do_send(LockFailed(deadlock.to_string()));
                    // Its step is still owed a report: queued, it reports itself skipped.
                    self.ready.push((id, addr), front);
                }
                Some(Then::Rollback { .. }) | None => {
                    tracing::error!(proc = %id, "deadlock victim is not a waiting step");
                }
            }
        }
        self.dispatch();
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;
}

impl Handler<Enqueue> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Enqueue, _ctx: &mut Context<Self>) {
        let Some(req) = msg.lock.clone() else {
            self.ready.push((msg.id, msg.addr), msg.front);
            self.dispatch();
            return;
        };
        match self.locks.holds(msg.id) {
            Some(true) => {
                self.ready.push((msg.id, msg.addr), msg.front);
                self.dispatch();
            }
            // The previous step's report was recorded but its StepFinished (which frees
            // its locks) is still on its way: ask again after it.
            Some(false) => {
                self.deferred.insert(msg.id, msg);
            }
            None => {
                let then = Then::Step {
                    addr: msg.addr,
                    front: msg.front,
                };
                self.request(req, then);
            }
        }
    }
}

impl Handler<StepFinished> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: StepFinished, _ctx: &mut Context<Self>) {
        self.ready.complete();
        self.release(msg.0, true);
        if let Some(next) = self.deferred.remove(&msg.0) {
            self.handle(next, _ctx);
        }
        self.dispatch();
    }
}

impl Handler<LockForRollback> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: LockForRollback, _ctx: &mut Context<Self>) {
        let then = Then::Rollback {
            addr: msg.addr,
            unrecorded: msg.unrecorded,
        };
        if self.locks.holds(msg.id).is_some() {
            if let Then::Rollback { addr, unrecorded } = then {
                addr.do_send(Rollback { unrecorded });
            }
            return;
        }
        self.request(msg.lock, then);
    }
}

impl Handler<ReleaseLocks> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: ReleaseLocks, _ctx: &mut Context<Self>) {
        self.release(msg.id, msg.step_only);
    }
}

impl Handler<TreeFailed> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: TreeFailed, _ctx: &mut Context<Self>) {
        let ids: Vec<ProcId> = self
            .parked_by_root
            .get(&msg.0)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default();
        for id in ids {
            if !matches!(
                self.parked.get(&id).map(|p| &p.then),
                Some(Then::Step { .. })
            ) {
                continue;
            }
            let Some(Parked {
                then: Then::Step { addr, front },
                ..
            }) = self.unpark(id)
            else {
                continue;
            };
            self.view.remove(&id);
            let changes = self.locks.release(id);
            // Queued without its locks: its tree has failed, so it only reports a skip.
            self.ready.push((id, addr), front);
            self.apply(changes);
        }
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
                self.view.insert(id, LockView { locks, held: true });
            }
        }
    }
}

impl Handler<SuspendOn> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: SuspendOn, _ctx: &mut Context<Self>) {
        if let Some((id, root_stack)) = self.events.suspend(&msg.event, (msg.id, msg.root_stack)) {
            root_stack.do_send(Wake(id));
        }
    }
}

impl Handler<WakeEvent> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        for (id, root_stack) in self.events.wake(&msg.0) {
            root_stack.do_send(Wake(id));
        }
    }
}

impl Handler<ResetEvent> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: ResetEvent, _ctx: &mut Context<Self>) {
        self.events.reset(&msg.0);
    }
}
