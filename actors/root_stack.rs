//! The root-stack actor: one per procedure tree. It supervises the tree's procedure
//! actors and runs the pure [`RootStack`] bookkeeping: every event of the tree goes
//! through it, its records are persisted, and only then are its actions performed, in
//! the order the transitions were made.
//!
//! Honest limits: an actor's mailbox lives in memory. If the process dies, what was in
//! flight here is gone; durability comes only from the store, and recovery rebuilds this
//! actor from it.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::procedure::{ProcError, ProcId, Procedure};
use crate::record::{Failure, StoreOp};
use crate::root_stack::{Action, RootStack, StepReport, Transition};

use super::executor::TreeFinished;
use super::persistence::Persist;
use super::procedure::{ProcSpec, ProcedureActor, Rollback, StopProc};
use super::scheduler::{Enqueue, SuspendOn};
use super::shared::{now_ms, Entry, Shared};

/// Decoded procedures waiting for their actors, with their encoded state.
pub(crate) type Objects = HashMap<ProcId, (Box<dyn Procedure>, Vec<u8>)>;

/// A step ended (from the procedure actor), with the objects of any new children.
pub(crate) struct StepDone {
    pub(crate) report: StepReport,
    pub(crate) children: Vec<(ProcId, Box<dyn Procedure>)>,
}

impl Message for StepDone {
    type Result = ();
}

/// The procedure accepted an abort or timeout between steps.
pub(crate) struct FailRequest {
    pub(crate) id: ProcId,
    pub(crate) error: ProcError,
    pub(crate) data: Vec<u8>,
}

impl Message for FailRequest {
    type Result = ();
}

/// A rollback step ended: the state after it, or its error.
pub(crate) struct RolledBack {
    pub(crate) id: ProcId,
    pub(crate) result: Result<Vec<u8>, ProcError>,
}

impl Message for RolledBack {
    type Result = ();
}

/// A timer or event woke the procedure.
pub(crate) struct Wake(pub(crate) ProcId);

impl Message for Wake {
    type Result = ();
}

/// A transition's actions, waiting for its records to be durable.
struct Pending {
    actions: Vec<Action>,
    durable: bool,
}

pub(crate) struct RootStackActor {
    core: RootStack,
    shared: Arc<Shared>,
    /// Live procedure actors of this tree.
    procs: HashMap<ProcId, Addr<ProcedureActor>>,
    /// New procedures, started once their insert is durable.
    unspawned: Objects,
    tree_failed: Arc<AtomicBool>,
    /// Transitions in the order they were made; actions run strictly in that order.
    pending: VecDeque<Pending>,
    /// Answered once the root's insert is durable and it is queued.
    submit_ack: Option<oneshot::Sender<Result<ProcId, Error>>>,
    /// The submit's transition, applied when the actor starts.
    initial: Option<Transition>,
    /// How many transitions have had their actions performed.
    performed: usize,
    /// Rebuilt by recovery: the first actors it spawns are recovered procedures.
    recovered: bool,
    /// Set when the store failed: the tree is stuck and reports nothing more.
    broken: bool,
}

impl RootStackActor {
    /// A newly submitted root: `started` persists its insert and queues it.
    pub(crate) fn submit(
        shared: Arc<Shared>,
        id: ProcId,
        type_name: &'static str,
        proc: Box<dyn Procedure>,
        data: Vec<u8>,
        ack: oneshot::Sender<Result<ProcId, Error>>,
    ) -> Self {
        let (core, t) = RootStack::submit(id, type_name, data.clone(), now_ms());
        let mut unspawned = HashMap::new();
        unspawned.insert(id, (proc, data));
        RootStackActor {
            core,
            shared,
            procs: HashMap::new(),
            unspawned,
            tree_failed: Arc::new(AtomicBool::new(false)),
            pending: VecDeque::new(),
            submit_ack: Some(ack),
            initial: Some(t),
            performed: 0,
            recovered: false,
            broken: false,
        }
    }

    /// A tree rebuilt by recovery: `core` and `t` from [`RootStack::recover`], the
    /// decoded objects of its unfinished procedures, and their records for the table.
    pub(crate) fn recover(
        shared: Arc<Shared>,
        core: RootStack,
        t: Transition,
        objects: Objects,
    ) -> Self {
        let tree_failed = Arc::new(AtomicBool::new(core.is_failed()));
        RootStackActor {
            core,
            shared,
            procs: HashMap::new(),
            unspawned: objects,
            tree_failed,
            pending: VecDeque::new(),
            submit_ack: None,
            initial: Some(t),
            performed: 0,
            recovered: true,
            broken: false,
        }
    }

    /// Persists the transition's records, then (in order) performs its actions.
    fn apply(&mut self, t: Transition, ctx: &mut Context<Self>) {
        if self.broken {
            return;
        }
        if self.core.is_failed() {
            self.tree_failed.store(true, Ordering::Release);
        }
        self.publish(&t.persist);
        let durable = t.persist.is_empty();
        self.pending.push_back(Pending {
            actions: t.actions,
            durable,
        });
        if durable {
            self.run_ready(ctx);
            return;
        }
        let (ack, rx) = oneshot::channel();
        self.shared.persistence.do_send(Persist {
            ops: t.persist,
            ack,
        });
        let seq = self.performed + self.pending.len() - 1;
        ctx.spawn(rx.into_actor(self).map(move |result, act, ctx| {
            match result.unwrap_or(Err(Error::Stopped)) {
                Ok(()) => {
                    let index = seq - act.performed;
                    act.pending[index].durable = true;
                    act.run_ready(ctx);
                }
                Err(e) => act.break_tree(e, ctx),
            }
        }));
    }

    fn run_ready(&mut self, ctx: &mut Context<Self>) {
        while self.pending.front().is_some_and(|p| p.durable) {
            let Some(p) = self.pending.pop_front() else {
                break;
            };
            self.performed += 1;
            for action in p.actions {
                self.perform(action, ctx);
            }
            self.recovered = false;
        }
        if let Some(ack) = self.submit_ack.take() {
            if self.performed > 0 {
                let _ = ack.send(Ok(self.core.root()));
            } else {
                self.submit_ack = Some(ack);
            }
        }
    }

    fn perform(&mut self, action: Action, ctx: &mut Context<Self>) {
        match action {
            Action::Spawn(id) => self.spawn(id, ctx),
            Action::Enqueue { id, front } => match self.procs.get(&id) {
                Some(addr) => self.shared.scheduler.do_send(Enqueue {
                    id,
                    addr: addr.clone(),
                    front,
                }),
                None => unreachable!("enqueue of {id}, which has no actor"),
            },
            Action::Stop(id) => {
                if let Some(addr) = self.procs.remove(&id) {
                    addr.do_send(StopProc);
                }
                if id != self.core.root() {
                    self.shared.table.remove(&id);
                } else if let Some(mut e) = self.shared.table.get_mut(&id) {
                    e.addr = None;
                }
            }
            Action::Rollback { id, unrecorded } => self.send_rollback(id, unrecorded),
            Action::RetryRollback {
                id,
                unrecorded,
                delay_ms,
            } => {
                ctx.run_later(Duration::from_millis(delay_ms), move |act, _| {
                    act.send_rollback(id, unrecorded)
                });
            }
            Action::WakeAt { id, at_ms } => {
                let delay = Duration::from_millis(at_ms.saturating_sub(now_ms()));
                ctx.run_later(delay, move |act, ctx| {
                    let t = act.core.on_wake(id);
                    act.apply(t, ctx);
                });
            }
            Action::SuspendOn { id, event } => self.shared.scheduler.do_send(SuspendOn {
                id,
                event,
                root_stack: ctx.address(),
            }),
            Action::Finished(result) => self.finished(result, ctx),
        }
    }

    fn spawn(&mut self, id: ProcId, ctx: &mut Context<Self>) {
        let Some((proc, data)) = self.unspawned.remove(&id) else {
            unreachable!("spawn of {id}, which has no object");
        };
        let shared = self.shared.clone();
        let root_stack = ctx.address();
        let tree_failed = self.tree_failed.clone();
        let spec = match self.shared.table.get(&id) {
            Some(e) => ProcSpec {
                id,
                parent: e.parent,
                root: e.root,
                submitted_ms: e.submitted_ms,
                recovered: self.recovered,
            },
            None => unreachable!("spawn of {id}, which is not in the table"),
        };
        let arbiter = self.shared.next_arbiter().clone();
        let addr = ProcedureActor::start_in_arbiter(&arbiter, move |_| {
            ProcedureActor::new(spec, proc, data, shared, root_stack, tree_failed)
        });
        if let Some(mut e) = self.shared.table.get_mut(&id) {
            e.addr = Some(addr.clone());
        }
        self.procs.insert(id, addr);
    }

    fn send_rollback(&self, id: ProcId, unrecorded: bool) {
        match self.procs.get(&id) {
            Some(addr) => addr.do_send(Rollback { unrecorded }),
            None => unreachable!("rollback of {id}, which has no actor"),
        }
    }

    fn publish(&self, ops: &[StoreOp]) {
        publish(&self.shared, ops);
    }

    fn finished(&mut self, result: Result<(), Failure>, ctx: &mut Context<Self>) {
        let root = self.core.root();
        match &result {
            Ok(()) => tracing::debug!(root = %root, "tree succeeded"),
            Err(failure) => tracing::debug!(root = %root, %failure, "tree rolled back"),
        }
        if let Some(mut e) = self.shared.table.get_mut(&root) {
            e.result = Some(result.clone());
        }
        self.shared.executor.do_send(TreeFinished {
            root,
            result: Ok(result),
        });
        ctx.stop();
    }

    /// The store failed: nothing this tree does can be made durable any more.
    fn break_tree(&mut self, e: Error, ctx: &mut Context<Self>) {
        if self.broken {
            return;
        }
        self.broken = true;
        let root = self.core.root();
        tracing::error!(root = %root, error = %e, "tree stopped: its records cannot be persisted");
        if let Some(ack) = self.submit_ack.take() {
            let _ = ack.send(Err(Error::Store(e.to_string())));
        }
        self.shared.executor.do_send(TreeFinished {
            root,
            result: Err(e.to_string()),
        });
        for addr in self.procs.values() {
            addr.do_send(StopProc);
        }
        ctx.stop();
    }
}

impl Actor for RootStackActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(t) = self.initial.take() {
            self.apply(t, ctx);
        }
    }
}

impl Handler<StepDone> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: StepDone, ctx: &mut Context<Self>) {
        self.unspawned.extend(
            msg.children
                .into_iter()
                .map(|(id, proc)| (id, (proc, Vec::new()))),
        );
        let t = self.core.on_step(msg.report, now_ms());
        // Children keep their encoded state for their actor's "last good" copy.
        for op in &t.persist {
            if let StoreOp::Insert(r) = op {
                if let Some(entry) = self.unspawned.get_mut(&r.id) {
                    entry.1.clone_from(&r.data);
                }
            }
        }
        self.apply(t, ctx);
    }
}

impl Handler<FailRequest> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: FailRequest, ctx: &mut Context<Self>) {
        let t = self.core.on_fail(msg.id, msg.error, msg.data, now_ms());
        self.apply(t, ctx);
    }
}

impl Handler<RolledBack> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: RolledBack, ctx: &mut Context<Self>) {
        let t = self.core.on_rolled_back(msg.id, msg.result, now_ms());
        self.apply(t, ctx);
    }
}

impl Handler<Wake> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: Wake, ctx: &mut Context<Self>) {
        let t = self.core.on_wake(msg.0);
        self.apply(t, ctx);
    }
}

/// Mirrors records into the procedure table, for `GetState` and `List`.
pub(crate) fn publish(shared: &Shared, ops: &[StoreOp]) {
    for op in ops {
        match op {
            StoreOp::Insert(r) => {
                shared.table.insert(
                    r.id,
                    Entry {
                        root: r.root,
                        parent: r.parent,
                        type_name: shared.registry.static_name(&r.type_name).unwrap_or("?"),
                        state: r.state,
                        submitted_ms: r.submitted_ms,
                        updated_ms: r.updated_ms,
                        addr: None,
                        result: None,
                    },
                );
            }
            StoreOp::Update(r) => {
                if let Some(mut e) = shared.table.get_mut(&r.id) {
                    e.state = r.state;
                    e.updated_ms = r.updated_ms;
                }
            }
            StoreOp::Delete(_) => {}
        }
    }
}
