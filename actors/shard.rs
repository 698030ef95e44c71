//! The shard: one actor per arbiter, the host of the trees placed on it. A tree with
//! work in flight runs as a root-stack actor on the shard's arbiter
//! ([`RootStackActor`]); a tree with nothing in flight is passivated, its runner kept
//! here as a value, so an idle tree costs its state only. Every message for a tree
//! comes through here (a [`ToTree`] naming the root, or a [`ToTrees`] batch from a
//! sender on another thread), and the shard forwards it to the tree's actor, activating
//! the tree first if it is passivated. So one sender's messages to a tree arrive in the
//! order they were sent, whether the tree was active, passivated, or between the two
//! (messages that arrive while a tree hands its runner back are held and go first to
//! its next actor), and a tree that ended gets nothing more: its messages are dropped.
//!
//! The shard also holds its trees' outbox ([`ShardIo`], shared with their actors on
//! this thread): what they send the scheduler, the lock actor and the persistence actor
//! is queued in the order made and sent as one message per actor when the shard
//! handles [`FlushOut`] (asked for by the first message queued), or at once when a tree
//! must send it before something else leaves it.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use actix::prelude::*;

use crate::fast_map::IdMap;
use crate::procedure::ProcId;

use super::perturb;
use super::protocol::{
    FromShard, LocksFromShard, Outgoing, Persist, ToLocks, ToPersistence, ToScheduler, TreeAddr,
    TreeEnded,
};
use super::root_stack::{
    start_without_actor, Deliver, Passivate, RootStackActor, TreeMsg, TreeRunner,
};
use super::scheduler::SchedulerActor;
use super::shared::ShardAddr;

/// Where a tree is reached: its shard and its root. Shared (`TreeAddr`), because every
/// queued step and table entry of the tree holds it.
pub(crate) struct TreeHandle {
    /// Its shard and the shard's scheduler (for the lock actor's grants), shared by the
    /// shard's trees: cloning an actix `Addr` allocates.
    at: Arc<ShardAddr>,
    /// The shard's place among the executor's shards, for [`Mail`].
    index: usize,
    root: ProcId,
    /// Set when the tree's root stack is dropped: nothing of the tree runs any more.
    ended: AtomicBool,
}

impl TreeHandle {
    /// The address of the tree of `root`, placed on the `index`th shard (`at`: its
    /// address and its scheduler's).
    pub(crate) fn new(at: Arc<ShardAddr>, index: usize, root: ProcId) -> TreeAddr {
        Arc::new(TreeHandle {
            at,
            index,
            root,
            ended: AtomicBool::new(false),
        })
    }

    /// The shard's place among the executor's shards.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    /// The shard's scheduler.
    pub(crate) fn scheduler(&self) -> &Addr<SchedulerActor> {
        &self.at.1
    }

    /// The shard.
    fn shard(&self) -> &Addr<Shard> {
        &self.at.0
    }

    /// Sends `msg` to the tree, through its shard's mailbox.
    pub(crate) fn do_send(&self, msg: impl Into<TreeMsg>) {
        self.shard().do_send(ToTree {
            root: self.root,
            msg: msg.into(),
        });
    }

    /// Starts `tree` on its shard; every later message of this sender comes after.
    pub(crate) fn start(&self, tree: TreeRunner) {
        self.do_send(TreeMsg::Start(Box::new(tree)));
    }

    /// Starts `tree` through `mail` (many trees at once, as at recovery).
    pub(crate) fn start_by(&self, mail: &mut Mail, tree: TreeRunner) {
        mail.push(self, TreeMsg::Start(Box::new(tree)));
    }

    /// Whether the tree's root stack still runs.
    pub(crate) fn connected(&self) -> bool {
        !self.ended.load(Ordering::Acquire) && self.shard().connected()
    }

    /// The tree's root stack is gone.
    pub(crate) fn set_ended(&self) {
        self.ended.store(true, Ordering::Release);
    }
}

/// A message to one tree of a shard.
pub(crate) struct ToTree {
    root: ProcId,
    msg: TreeMsg,
}

impl Message for ToTree {
    type Result = ();
}

/// Messages to trees of one shard, in the order they were made: one message for what
/// a sender has for many trees (the scheduler's acknowledgements of a durable batch,
/// its dispatched steps).
pub(crate) struct ToTrees(Letters);

impl Message for ToTrees {
    type Result = ();
}

/// Messages to trees gathered per shard, each shard's sent as one [`ToTrees`]. Whoever
/// gathers sends before any other message to a tree, so nothing overtakes them.
#[derive(Default)]
pub(crate) struct Mail {
    /// By the shard's index: its address and what is gathered for it.
    shards: Vec<Option<(Addr<Shard>, Letters)>>,
}

/// Messages for trees of one shard, each with its tree's root.
type Letters = Vec<(ProcId, TreeMsg)>;

impl Mail {
    /// Adds `msg` for `tree`.
    pub(crate) fn push(&mut self, tree: &TreeHandle, msg: impl Into<TreeMsg>) {
        if self.shards.len() <= tree.index {
            self.shards.resize_with(tree.index + 1, || None);
        }
        let (_, msgs) =
            self.shards[tree.index].get_or_insert_with(|| (tree.shard().clone(), Vec::new()));
        msgs.push((tree.root, msg.into()));
    }

    /// Sends what was gathered, one message per shard.
    pub(crate) fn send(&mut self) {
        for (shard, msgs) in self.shards.iter_mut().flatten() {
            if !msgs.is_empty() {
                perturb::point("shard::mail::send");
            }
            match msgs.len() {
                0 => {}
                1 => {
                    if let Some((root, msg)) = msgs.pop() {
                        shard.do_send(ToTree { root, msg });
                    }
                }
                _ => shard.do_send(ToTrees(take_sized(msgs))),
            }
        }
    }
}

/// The next batch is about as long as this one: its buffer starts at this one's length
/// (up to `BATCH_CAPACITY_MAX`) rather than growing from empty again, copying as it
/// grows.
fn take_sized<T>(batch: &mut Vec<T>) -> Vec<T> {
    let next = Vec::with_capacity(batch.len().min(BATCH_CAPACITY_MAX));
    std::mem::replace(batch, next)
}

/// The most a batch's buffer starts with (a recovery's batches are thousands long).
const BATCH_CAPACITY_MAX: usize = 256;

/// What a shard's trees send out of the shard, queued per actor in the order made.
pub(crate) struct ShardIo {
    scheduler: Recipient<FromShard>,
    locks: Recipient<LocksFromShard>,
    persistence: Recipient<ToPersistence>,
    to_scheduler: Vec<ToScheduler>,
    to_locks: Vec<ToLocks>,
    to_persistence: Vec<Persist>,
    /// The shard, asked to flush when the first message is queued; its trees' actors
    /// share it (making an actix `Addr` allocates). Set when the shard starts.
    shard: Option<Rc<Addr<Shard>>>,
    /// A `FlushOut` is on its way to the shard.
    flush_asked: bool,
    /// Procedure actors running on this shard's arbiter.
    pub(crate) procedure_actors: Rc<Cell<usize>>,
}

/// One procedure actor of a shard, counted in its shard's `procedure_actors` while it
/// lives (however it ends).
pub(crate) struct Counted(Rc<Cell<usize>>);

impl Counted {
    pub(crate) fn new(count: &Rc<Cell<usize>>) -> Self {
        count.set(count.get() + 1);
        Counted(count.clone())
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.set(self.0.get().saturating_sub(1));
    }
}

/// Where a shard's trees send what leaves the shard: the shard's scheduler, the lock
/// actor and the persistence actor, or whatever stands in for them (a test's actors),
/// each as the recipient of a shard's batches.
#[derive(Clone)]
pub(crate) struct ShardPeers {
    pub(crate) scheduler: Recipient<FromShard>,
    pub(crate) locks: Recipient<LocksFromShard>,
    pub(crate) persistence: Recipient<ToPersistence>,
}

impl ShardIo {
    fn new(peers: ShardPeers) -> Self {
        ShardIo {
            scheduler: peers.scheduler,
            locks: peers.locks,
            persistence: peers.persistence,
            to_scheduler: Vec::new(),
            to_locks: Vec::new(),
            to_persistence: Vec::new(),
            shard: None,
            flush_asked: false,
            procedure_actors: Rc::default(),
        }
    }

    /// Queues `msg` for its actor, and asks the shard to send what is queued once the
    /// handlers that run before it are done (so that they send as one message).
    pub(crate) fn push(io: &RefCell<ShardIo>, msg: Outgoing) {
        let mut io = io.borrow_mut();
        match msg {
            Outgoing::Scheduler(m) => io.to_scheduler.push(m),
            Outgoing::Locks(m) => io.to_locks.push(m),
            Outgoing::Persist(m) => io.to_persistence.push(m),
        }
        io.ask_flush_now();
    }

    /// Asks the shard for a flush, if anything is queued and none was asked for.
    pub(crate) fn ask_flush(io: &RefCell<ShardIo>) {
        io.borrow_mut().ask_flush_now();
    }

    fn ask_flush_now(&mut self) {
        let queued = !(self.to_scheduler.is_empty()
            && self.to_locks.is_empty()
            && self.to_persistence.is_empty());
        if queued && !self.flush_asked {
            if let Some(shard) = &self.shard {
                self.flush_asked = true;
                shard.do_send(FlushOut);
            }
        }
    }

    /// A tree ended: its `TreeEnded`, behind everything it sent, to its scheduler, and
    /// to the lock actor if it told it the tree passed its point of no return.
    pub(crate) fn tree_ended(&mut self, ended: TreeEnded, irreversible: bool) {
        if irreversible {
            self.to_locks.push(ToLocks::TreeEnded(ended.clone()));
        }
        self.to_scheduler.push(ToScheduler::TreeEnded(ended));
    }

    /// Sends the scheduler, the lock actor and the persistence actor what the trees
    /// have for them: one batch each.
    pub(crate) fn flush(&mut self) {
        send_batch(
            &mut self.to_persistence,
            "shard::flush::to_persistence",
            |msgs| self.persistence.do_send(ToPersistence(msgs)),
        );
        send_batch(&mut self.to_locks, "shard::flush::to_locks", |msgs| {
            self.locks.do_send(LocksFromShard(msgs))
        });
        send_batch(
            &mut self.to_scheduler,
            "shard::flush::to_scheduler",
            |msgs| self.scheduler.do_send(FromShard(msgs)),
        );
    }
}

/// Sends what is queued in `queue` as one batch, if anything is.
fn send_batch<T>(queue: &mut Vec<T>, point: &'static str, send: impl FnOnce(Vec<T>)) {
    if queue.is_empty() {
        return;
    }
    perturb::point(point);
    send(take_sized(queue));
}

/// A tree on its shard.
enum Slot {
    /// Its root-stack actor runs.
    Active(Addr<RootStackActor>),
    /// Passivated: its runner, with nothing in flight.
    Idle(Box<TreeRunner>),
    /// Its actor was asked to hand its runner back: what arrives meanwhile waits here.
    Passivating(Addr<RootStackActor>, Vec<TreeMsg>),
}

/// One arbiter's trees.
pub(crate) struct Shard {
    trees: IdMap<ProcId, Slot>,
    io: Rc<RefCell<ShardIo>>,
}

impl Shard {
    pub(crate) fn new(peers: ShardPeers) -> Self {
        Shard {
            trees: IdMap::default(),
            io: Rc::new(RefCell::new(ShardIo::new(peers))),
        }
    }

    /// Starts a root-stack actor for `runner` (`starts`: a new or recovered tree, not a
    /// passivated one), handing it `msgs` first.
    fn activate(
        &mut self,
        root: ProcId,
        runner: Box<TreeRunner>,
        starts: bool,
        msgs: Vec<TreeMsg>,
        ctx: &mut Context<Self>,
    ) {
        let me = self.io.borrow().shard.clone();
        let me = me.unwrap_or_else(|| Rc::new(ctx.address()));
        let actor = RootStackActor::new(root, runner, self.io.clone(), me, starts);
        let addr = actor.start();
        for msg in msgs {
            addr.do_send(Deliver(msg));
        }
        self.trees.insert(root, Slot::Active(addr));
    }

    /// Hands `msg` to the tree of `root` (a `Start` places the tree first).
    fn deliver(&mut self, root: ProcId, msg: TreeMsg, ctx: &mut Context<Self>) {
        let msg = match msg {
            TreeMsg::Start(mut runner) => {
                if runner.starts_idle() {
                    if start_without_actor(&mut runner, &self.io) {
                        self.trees.insert(root, Slot::Idle(runner));
                    }
                    return;
                }
                self.activate(root, runner, true, Vec::new(), ctx);
                return;
            }
            msg => msg,
        };
        match self.trees.get_mut(&root) {
            Some(Slot::Active(addr)) => addr.do_send(Deliver(msg)),
            Some(Slot::Passivating(_, held)) => held.push(msg),
            Some(Slot::Idle(_)) => {
                if let Some(Slot::Idle(runner)) = self.trees.remove(&root) {
                    self.activate(root, runner, false, vec![msg], ctx);
                }
            }
            // It ended: dropped, as a stopped actor's mailbox would drop it.
            None => {}
        }
    }
}

impl Actor for Shard {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        self.io.borrow_mut().shard = Some(Rc::new(ctx.address()));
    }
}

impl Handler<ToTree> for Shard {
    type Result = ();

    fn handle(&mut self, msg: ToTree, ctx: &mut Context<Self>) {
        self.deliver(msg.root, msg.msg, ctx);
    }
}

impl Handler<ToTrees> for Shard {
    type Result = ();

    fn handle(&mut self, msg: ToTrees, ctx: &mut Context<Self>) {
        for (root, msg) in msg.0 {
            self.deliver(root, msg, ctx);
        }
    }
}

/// From a tree's actor: it has nothing in flight.
pub(crate) struct Quiet(pub(crate) ProcId);

impl Message for Quiet {
    type Result = ();
}

impl Handler<Quiet> for Shard {
    type Result = ();

    fn handle(&mut self, msg: Quiet, _ctx: &mut Context<Self>) {
        if let Some(slot) = self.trees.get_mut(&msg.0) {
            if let Slot::Active(addr) = slot {
                // Behind everything forwarded to it; what comes now waits.
                let addr = addr.clone();
                addr.do_send(Passivate);
                *slot = Slot::Passivating(addr, Vec::new());
            }
        }
    }
}

/// From a tree's actor, answering [`Passivate`]: its runner (it stopped), or `None`
/// (it had work again, and runs on).
pub(crate) struct Passivated(pub(crate) ProcId, pub(crate) Option<Box<TreeRunner>>);

impl Message for Passivated {
    type Result = ();
}

impl Handler<Passivated> for Shard {
    type Result = ();

    fn handle(&mut self, msg: Passivated, ctx: &mut Context<Self>) {
        let Passivated(root, runner) = msg;
        let Some(Slot::Passivating(addr, held)) = self.trees.remove(&root) else {
            return;
        };
        match runner {
            Some(runner) if held.is_empty() => {
                self.trees.insert(root, Slot::Idle(runner));
            }
            Some(runner) => self.activate(root, runner, false, held, ctx),
            None => {
                for msg in held {
                    addr.do_send(Deliver(msg));
                }
                self.trees.insert(root, Slot::Active(addr));
            }
        }
    }
}

/// From a tree's actor: the tree ended and the actor stopped.
pub(crate) struct Gone(pub(crate) ProcId);

impl Message for Gone {
    type Result = ();
}

impl Handler<Gone> for Shard {
    type Result = ();

    fn handle(&mut self, msg: Gone, _ctx: &mut Context<Self>) {
        self.trees.remove(&msg.0);
    }
}

/// Asks a shard how many of its trees are active (a root-stack actor runs), how many
/// are passivated, and how many procedure actors run.
pub(crate) struct GetTreeCounts;

/// A shard's answer to [`GetTreeCounts`].
pub(crate) struct TreeCounts {
    pub(crate) active: usize,
    pub(crate) passivated: usize,
    pub(crate) procedures_active: usize,
}

impl Message for GetTreeCounts {
    type Result = TreeCounts;
}

impl Handler<GetTreeCounts> for Shard {
    type Result = MessageResult<GetTreeCounts>;

    fn handle(&mut self, _msg: GetTreeCounts, _ctx: &mut Context<Self>) -> Self::Result {
        let idle = self
            .trees
            .values()
            .filter(|slot| matches!(slot, Slot::Idle(_)))
            .count();
        MessageResult(TreeCounts {
            active: self.trees.len() - idle,
            passivated: idle,
            procedures_active: self.io.borrow().procedure_actors.get(),
        })
    }
}

/// Sends what the shard's trees queued (asked for by the first message queued).
pub(crate) struct FlushOut;

impl Message for FlushOut {
    type Result = ();
}

impl Handler<FlushOut> for Shard {
    type Result = ();

    fn handle(&mut self, _msg: FlushOut, _ctx: &mut Context<Self>) {
        let mut io = self.io.borrow_mut();
        io.flush_asked = false;
        io.flush();
    }
}
