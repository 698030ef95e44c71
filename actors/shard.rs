//! The shard: one actor per arbiter, owning the runners of the trees placed on it as
//! plain values. A tree has no task and no mailbox of its own: its messages come through
//! its shard's mailbox (a [`ToTree`] naming the root, or a [`ToTrees`] batch), the calls
//! into its procedures' user code are futures of the shard's (polled when they are
//! woken, not all at once), and its timers sit in the shard's timer queue. An idle tree
//! costs its runner only.
//!
//! What a runner knew of its actix context it now gets from a [`TreeCtx`]: spawn a
//! call, start a timer, tell the scheduler (queued in the shard's outbox, sent as one
//! message when the shard's handler or poll returns, or at once with `send_now`), stop.
//! The rules it obeys are those it obeyed as an actor: one sender's messages to a tree
//! arrive in the order they were sent (one mailbox per shard, batches kept in order, and
//! a tree never moves), a tree's calls and timers end on its shard's thread, and a tree
//! that stopped gets nothing more: its messages and timers that arrive later are
//! dropped, and its calls in flight are not polled again, as a stopped actor's would be;
//! those of a tree cut off by a panic in engine code are dropped with it.

use std::collections::BTreeMap;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{self, Poll};
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures_util::stream::{FuturesUnordered, StreamExt};

use crate::fast_map::IdMap;
use crate::procedure::ProcId;

use super::guard::panic_message;
use super::locks::LockActor;
use super::persistence::PersistenceActor;
use super::perturb;
use super::procedure::CallEnd;
use super::protocol::{
    AbortRequest, BypassRequest, CommandRequest, Durable, FromShard, LocksFromShard, Outgoing,
    Persist, Quiesce, ToLocks, ToPersistence, ToProc, ToScheduler, TreeAddr, Wake,
};
use super::root_stack::TreeRunner;
use super::scheduler::SchedulerActor;
use super::shared::TreeStatus;

/// Where a tree is reached: its shard and its root. Shared (`TreeAddr`), because every
/// queued step and table entry of the tree holds it.
pub(crate) struct TreeHandle {
    shard: Addr<Shard>,
    /// The shard's scheduler (for the lock actor's grants).
    scheduler: Addr<SchedulerActor>,
    /// The shard's place among the executor's shards, for [`Mail`].
    index: usize,
    root: ProcId,
    /// Set when the tree's root stack is dropped: nothing of the tree runs any more.
    ended: AtomicBool,
}

impl TreeHandle {
    /// The address of the tree of `root`, placed on `shard` (the `index`th shard, with
    /// its `scheduler`).
    pub(crate) fn new(
        shard: Addr<Shard>,
        scheduler: Addr<SchedulerActor>,
        index: usize,
        root: ProcId,
    ) -> TreeAddr {
        Arc::new(TreeHandle {
            shard,
            scheduler,
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
        &self.scheduler
    }

    /// Sends `msg` to the tree, through its shard's mailbox.
    pub(crate) fn do_send(&self, msg: impl Into<TreeMsg>) {
        self.shard.do_send(ToTree {
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
        !self.ended.load(Ordering::Acquire) && self.shard.connected()
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
            self.shards[tree.index].get_or_insert_with(|| (tree.shard.clone(), Vec::new()));
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

/// Declares [`TreeMsg`]: `Start`, then one variant per message a tree is sent, each
/// with its `From`.
macro_rules! tree_msg {
    ($($variant:ident($message:ty)),* $(,)?) => {
        /// What a tree is sent. Each variant's ordering rule is written beside its
        /// message in `protocol.rs`.
        pub(crate) enum TreeMsg {
            /// The tree joins the shard and starts (its first message).
            Start(Box<TreeRunner>),
            $($variant($message),)*
        }

        $(
            impl From<$message> for TreeMsg {
                fn from(m: $message) -> Self {
                    TreeMsg::$variant(m)
                }
            }
        )*
    };
}

tree_msg!(
    Durable(Durable),
    ToProc(ToProc),
    Bypass(BypassRequest),
    Wake(Wake),
    Quiesce(Quiesce),
    Command(CommandRequest),
    Abort(AbortRequest),
);

/// A timer of a tree: what to do when it fires.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Timer {
    /// Send a failed rollback of `id` again.
    RetryRollback { id: ProcId, unrecorded: bool },
    /// `id`'s sleep is over.
    WakeAt { id: ProcId },
    /// `id`'s deadline (as armed then) has passed.
    Deadline { id: ProcId, deadline_ms: u64 },
}

/// A call into user code of the tree rooted at `root`.
struct TreeCall<T = CallEnd> {
    root: ProcId,
    call: Pin<Box<dyn Future<Output = Ended<T>>>>,
}

impl<T> Future for TreeCall<T> {
    type Output = (ProcId, Ended<T>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut task::Context<'_>) -> Poll<Self::Output> {
        let root = self.root;
        self.call.as_mut().poll(cx).map(|end| (root, end))
    }
}

/// The shard's calls in flight, each polled when it is woken.
struct Calls<T = CallEnd>(FuturesUnordered<TreeCall<T>>);

impl<T> Default for Calls<T> {
    fn default() -> Self {
        Calls(FuturesUnordered::new())
    }
}

impl<T> Calls<T> {
    fn push(&mut self, root: ProcId, call: Pin<Box<dyn Future<Output = Ended<T>>>>) {
        self.0.push(TreeCall { root, call });
    }

    /// Drops the calls of `root`'s tree now, and the user's futures in them, rather
    /// than when each next wakes (which may be never): for a tree cut off while calls
    /// of it run. Takes every call out and puts the others back, so each of those is
    /// polled once more (a spurious wake, which a future allows). Returns how many
    /// went.
    fn drop_tree(&mut self, root: ProcId) -> usize {
        let before = self.0.len();
        for call in std::mem::take(&mut self.0) {
            if call.root != root {
                self.0.push(call);
            }
        }
        before - self.0.len()
    }

    /// The next call that ended, with its tree's root; `Ready(None)` when none is in
    /// flight.
    fn poll_next(&mut self, cx: &mut task::Context<'_>) -> Poll<Option<(ProcId, Ended<T>)>> {
        self.0.poll_next_unpin(cx)
    }

    /// How many calls are in flight.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.len()
    }
}

/// How a call of a tree ended.
#[derive(Debug, PartialEq)]
enum Ended<T = CallEnd> {
    /// It returned: its tree handles what it reports.
    Returned(T),
    /// Its tree was dropped first: it was not polled again.
    Dropped,
    /// Engine code around the user's (which catches its own panics) panicked: the
    /// tree is cut off, as for a panic in its handling.
    Panicked(String),
}

/// `call` as one of the shard's futures: not polled again once `tree` is dropped, a
/// panic out of it caught, the call (the user's future) dropped as soon as it ended
/// either way. Boxed as it is, not awaited inside another future: the call moves into
/// it once.
async fn guarded_call<T>(tree: Arc<TreeStatus>, call: impl Future<Output = T>) -> Ended<T> {
    let mut call = std::pin::pin!(call);
    std::future::poll_fn(|cx| poll_guarded(&tree, call.as_mut(), cx)).await
}

/// Polls `call` unless `tree` was dropped, catching a panic out of it.
fn poll_guarded<T>(
    tree: &TreeStatus,
    call: Pin<&mut impl Future<Output = T>>,
    cx: &mut task::Context<'_>,
) -> Poll<Ended<T>> {
    if tree.dropped() {
        return Poll::Ready(Ended::Dropped);
    }
    match catch_unwind(AssertUnwindSafe(|| call.poll(cx))) {
        Ok(Poll::Ready(end)) => Poll::Ready(Ended::Returned(end)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(payload) => Poll::Ready(Ended::Panicked(panic_message(&*payload))),
    }
}

/// A timer's place in the queue: when it fires, then the order it was started in.
type TimerKey = (Instant, u64);

/// The shard's calls, timers and messages out: what a tree's context reaches.
pub(crate) struct ShardIo {
    scheduler: Addr<SchedulerActor>,
    locks: Addr<LockActor>,
    persistence: Addr<PersistenceActor>,
    /// The trees' messages to each of the three, in the order they were made: sent as
    /// one message each when the shard's handler or its poll of calls and timers
    /// returns, before a tree is dropped (whose `TreeEnded` goes after them), and before
    /// anything leaves a tree another way (`TreeCtx::send_now`).
    to_scheduler: Vec<ToScheduler>,
    to_locks: Vec<ToLocks>,
    to_persistence: Vec<Persist>,
    calls: Calls,
    timers: Timers,
    /// Set to the first timer's instant while there is one.
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// Where a shard's trees send what leaves the shard.
#[derive(Clone)]
pub(crate) struct ShardPeers {
    pub(crate) scheduler: Addr<SchedulerActor>,
    pub(crate) locks: Addr<LockActor>,
    pub(crate) persistence: Addr<PersistenceActor>,
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
            calls: Calls::default(),
            timers: Timers::default(),
            sleep: None,
        }
    }

    fn push(&mut self, msg: Outgoing) {
        match msg {
            Outgoing::Scheduler(m) => self.to_scheduler.push(m),
            Outgoing::Locks(m) => self.to_locks.push(m),
            Outgoing::Persist(m) => self.to_persistence.push(m),
        }
    }

    /// Sends the scheduler, the lock actor and the persistence actor what the trees
    /// have for them: one message each.
    fn flush(&mut self) {
        if !self.to_persistence.is_empty() {
            perturb::point("shard::flush::to_persistence");
            if self.to_persistence.len() == 1 {
                if let Some(msg) = self.to_persistence.pop() {
                    self.persistence.do_send(msg);
                }
            } else {
                self.persistence
                    .do_send(ToPersistence(take_sized(&mut self.to_persistence)));
            }
        }
        if !self.to_locks.is_empty() {
            perturb::point("shard::flush::to_locks");
            if self.to_locks.len() == 1 {
                if let Some(msg) = self.to_locks.pop() {
                    msg.send_to(&self.locks);
                }
            } else {
                self.locks
                    .do_send(LocksFromShard(take_sized(&mut self.to_locks)));
            }
        }
        if !self.to_scheduler.is_empty() {
            perturb::point("shard::flush::to_scheduler");
            if self.to_scheduler.len() == 1 {
                if let Some(msg) = self.to_scheduler.pop() {
                    msg.send_to(&self.scheduler);
                }
            } else {
                self.scheduler
                    .do_send(FromShard(take_sized(&mut self.to_scheduler)));
            }
        }
    }
}

/// When a timer started at `now` with `delay` fires. A delay is capped at about 30
/// years, as tokio caps its own timers, so that no delay overflows an `Instant`.
fn fire_at(now: Instant, delay: Duration) -> Instant {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    now.checked_add(delay.min(FAR))
        .or_else(|| now.checked_add(FAR))
        .unwrap_or(now)
}

/// The timers of a shard's trees, by when they fire (then in the order they were
/// started), with each tree's own so that a tree's go when it stops.
#[derive(Default)]
struct Timers {
    queue: BTreeMap<TimerKey, (ProcId, Timer)>,
    /// The keys of each tree's timers that have not fired.
    by_tree: IdMap<ProcId, Vec<TimerKey>>,
    next: u64,
}

impl Timers {
    fn add(&mut self, root: ProcId, at: Instant, timer: Timer) {
        let key = (at, self.next);
        self.next += 1;
        self.queue.insert(key, (root, timer));
        self.by_tree.entry(root).or_default().push(key);
    }

    /// When the first timer fires.
    fn first(&self) -> Option<Instant> {
        self.queue.first_key_value().map(|(k, _)| k.0)
    }

    /// The first timer due at `now`, taken out of the queue.
    fn due(&mut self, now: Instant) -> Option<(ProcId, Timer)> {
        let entry = self.queue.first_entry()?;
        if entry.key().0 > now {
            return None;
        }
        let key = *entry.key();
        let (root, timer) = entry.remove();
        if let Some(keys) = self.by_tree.get_mut(&root) {
            keys.retain(|k| *k != key);
            if keys.is_empty() {
                self.by_tree.remove(&root);
            }
        }
        Some((root, timer))
    }

    /// Drops the timers of `root`'s tree.
    fn forget(&mut self, root: ProcId) {
        for key in self.by_tree.remove(&root).unwrap_or_default() {
            self.queue.remove(&key);
        }
    }
}

/// What a root stack may do beyond its own state: the part of its shard it reaches.
pub(crate) struct TreeCtx<'a> {
    root: ProcId,
    io: &'a mut ShardIo,
    stop: bool,
}

impl TreeCtx<'_> {
    /// Runs `call` as one of the shard's futures; its end goes to the tree's
    /// `call_ended`. If the tree (whose status is `tree`) is dropped first, the call is
    /// not polled again: it ends, and drops the user's future, the next time it wakes
    /// (as a stopped actor's futures were dropped with it), or at once if a panic in
    /// engine code cut the tree off.
    pub(crate) fn spawn(
        &mut self,
        tree: Arc<TreeStatus>,
        call: impl Future<Output = CallEnd> + 'static,
    ) {
        self.io
            .calls
            .push(self.root, Box::pin(guarded_call(tree, call)));
    }

    /// Fires `timer` after `delay` (dropped if the tree stops first).
    pub(crate) fn run_later(&mut self, delay: Duration, timer: Timer) {
        self.io
            .timers
            .add(self.root, fire_at(Instant::now(), delay), timer);
    }

    /// The tree's work is done: the shard drops its root stack once this call returns.
    pub(crate) fn stop(&mut self) {
        self.stop = true;
    }

    /// Queues `msg` for its actor (the shard's scheduler, the lock actor or the
    /// persistence actor), after everything the shard's trees queued for it before.
    pub(crate) fn tell(&mut self, msg: impl Into<Outgoing>) {
        self.io.push(msg.into());
    }

    /// Sends what is queued for the scheduler, the lock actor and the persistence actor
    /// now: before anything that leaves the shard another way and must not overtake it
    /// (an answer to a caller, a tree's result, news for the executor).
    pub(crate) fn send_now(&mut self) {
        self.io.flush();
    }
}

/// One arbiter's trees.
pub(crate) struct Shard {
    trees: IdMap<ProcId, Box<TreeRunner>>,
    io: ShardIo,
}

impl Shard {
    pub(crate) fn new(peers: ShardPeers) -> Self {
        Shard {
            trees: IdMap::default(),
            io: ShardIo::new(peers),
        }
    }

    /// Calls `f` with the root stack of `root`, if it is live, and drops it if it
    /// stopped. A panic in engine code drops that tree only (its runner's `Drop` tells
    /// the scheduler and the executor), as it killed only that tree's actor when each
    /// tree had one: the shard and its other trees go on.
    fn with_tree(&mut self, root: ProcId, f: impl FnOnce(&mut TreeRunner, &mut TreeCtx<'_>)) {
        let Some(tree) = self.trees.get_mut(&root) else {
            return;
        };
        let mut ctx = TreeCtx {
            root,
            io: &mut self.io,
            stop: false,
        };
        let ran = catch_unwind(AssertUnwindSafe(|| f(tree, &mut ctx)));
        let stop = ctx.stop;
        match ran {
            Err(payload) => self.cut_off(root, &panic_message(&*payload)),
            Ok(()) if stop => self.drop_tree(root),
            Ok(()) => {}
        }
    }

    /// Engine code panicked for the tree `root`: it is dropped, the others go on.
    fn cut_off(&mut self, root: ProcId, message: &str) {
        tracing::error!(%root, %message, "engine code panicked: the tree is cut off");
        self.drop_tree(root);
    }

    fn drop_tree(&mut self, root: ProcId) {
        self.io.timers.forget(root);
        let Some(mut tree) = self.trees.remove(&root) else {
            return;
        };
        // Its `TreeEnded` goes after everything it sent, with the shard's next batch:
        // to the scheduler, and to the lock actor if it told it the tree passed its
        // point of no return.
        let (ended, irreversible, cut_off) = tree.ended();
        if irreversible {
            self.io.to_locks.push(ToLocks::TreeEnded(ended.clone()));
        }
        self.io.to_scheduler.push(ToScheduler::TreeEnded(ended));
        if cut_off {
            // The drop tells the executor that the tree failed: the scheduler hears
            // first that it ended (and frees the workers of its steps).
            self.io.flush();
            drop(tree);
            // Its calls still running hold the user's futures (and what those hold):
            // they go now, not when each next wakes. (A tree that stops normally has
            // heard back from every call.)
            let dropped = self.io.calls.drop_tree(root);
            if dropped > 0 {
                tracing::warn!(%root, calls = dropped, "calls of a cut-off tree dropped");
            }
        }
    }

    /// Hands the trees their ended calls and fired timers until there are none, then
    /// waits for the next.
    fn drive(&mut self, cx: &mut task::Context<'_>) {
        loop {
            let mut progress = false;
            while let Poll::Ready(Some((root, end))) = self.io.calls.poll_next(cx) {
                progress = true;
                match end {
                    Ended::Returned(end) => {
                        self.with_tree(root, |tree, ctx| tree.call_ended(end, ctx));
                    }
                    Ended::Dropped => {}
                    Ended::Panicked(message) if self.trees.contains_key(&root) => {
                        self.cut_off(root, &message);
                    }
                    Ended::Panicked(_) => {}
                }
            }
            let now = Instant::now();
            while let Some((root, timer)) = self.io.timers.due(now) {
                progress = true;
                self.with_tree(root, |tree, ctx| tree.on_timer(timer, ctx));
            }
            match self.io.timers.first() {
                Some(at) => {
                    let at = tokio::time::Instant::from_std(at);
                    let sleep = self
                        .io
                        .sleep
                        .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(at)));
                    if sleep.deadline() != at {
                        sleep.as_mut().reset(at);
                    }
                    if sleep.as_mut().poll(cx).is_ready() {
                        progress = true;
                    }
                }
                None => self.io.sleep = None,
            }
            if !progress {
                self.io.flush();
                return;
            }
        }
    }
}

impl Actor for Shard {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.spawn(Driver);
    }
}

impl Handler<ToTree> for Shard {
    type Result = ();

    fn handle(&mut self, msg: ToTree, _ctx: &mut Context<Self>) {
        self.deliver(msg.root, msg.msg);
        self.io.flush();
    }
}

impl Handler<ToTrees> for Shard {
    type Result = ();

    fn handle(&mut self, msg: ToTrees, _ctx: &mut Context<Self>) {
        for (root, msg) in msg.0 {
            self.deliver(root, msg);
        }
        self.io.flush();
    }
}

impl Shard {
    /// Hands `msg` to the tree of `root` (a `Start` places the tree first).
    fn deliver(&mut self, root: ProcId, msg: TreeMsg) {
        match msg {
            TreeMsg::Start(tree) => {
                self.trees.insert(root, tree);
                self.with_tree(root, TreeRunner::started);
            }
            msg => self.with_tree(root, |tree, ctx| tree.receive(msg, ctx)),
        }
    }
}

/// The shard's one lasting future: polls its calls and timers. actix polls it after
/// every batch of messages (so calls spawned by a handler start at once) and whenever
/// a call or the timer wakes the shard.
struct Driver;

impl ActorFuture<Shard> for Driver {
    type Output = ();

    fn poll(
        self: Pin<&mut Self>,
        shard: &mut Shard,
        _ctx: &mut Context<Shard>,
        cx: &mut task::Context<'_>,
    ) -> Poll<()> {
        shard.drive(cx);
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call that returns `7` at its `ready_at`th poll, or panics there; counts its
    /// polls and says when it is dropped.
    struct Probe {
        polls: Arc<std::sync::atomic::AtomicUsize>,
        dropped: Arc<AtomicBool>,
        ready_at: usize,
        panics: bool,
    }

    impl Future for Probe {
        type Output = u32;
        fn poll(self: Pin<&mut Self>, _: &mut task::Context<'_>) -> Poll<u32> {
            let n = self.polls.fetch_add(1, Ordering::SeqCst) + 1;
            if n < self.ready_at {
                Poll::Pending
            } else if self.panics {
                panic!("engine bug at poll {n}");
            } else {
                Poll::Ready(7)
            }
        }
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    /// (ready at poll, panics, the tree is dropped after this many polls) → how it
    /// ended, and how often the call was polled. The shard's future drops the call as
    /// soon as it ends, while the future itself is still held.
    #[test]
    fn a_call_is_guarded_against_engine_panics_and_its_dropped_tree() {
        let panicked = |n: usize| Ended::Panicked(format!("engine bug at poll {n}"));
        let cases = [
            (1, false, None, Ended::Returned(7), 1),
            (3, false, None, Ended::Returned(7), 3),
            (2, true, None, panicked(2), 2),
            (3, false, Some(1), Ended::Dropped, 1),
            (1, false, Some(0), Ended::Dropped, 0),
        ];
        for (ready_at, panics, drop_after, expected, polls) in cases {
            let probe = Probe {
                polls: Arc::default(),
                dropped: Arc::default(),
                ready_at,
                panics,
            };
            let (count, dropped) = (probe.polls.clone(), probe.dropped.clone());
            let tree = Arc::new(TreeStatus::default());
            let mut call = Box::pin(guarded_call(tree.clone(), probe));
            let mut cx = task::Context::from_waker(task::Waker::noop());
            let mut pass = 0;
            let ended = loop {
                if drop_after == Some(pass) {
                    tree.set_dropped();
                }
                pass += 1;
                if let Poll::Ready(ended) = call.as_mut().poll(&mut cx) {
                    break ended;
                }
                assert!(pass < 10, "never ended");
            };
            let at = format!("ready at {ready_at}, panics {panics}, dropped {drop_after:?}");
            assert_eq!(ended, expected, "{at}");
            assert_eq!(count.load(Ordering::SeqCst), polls, "{at}");
            assert!(dropped.load(Ordering::SeqCst), "{at}: the call was dropped");
        }
    }

    /// A call of a tree cut off goes at once, with the user's future in it, however
    /// long that future would have waited; the other trees' calls go on.
    #[test]
    fn a_cut_off_trees_calls_are_dropped_at_once_and_the_others_run_on() {
        let probe = |ready_at: usize| Probe {
            polls: Arc::default(),
            dropped: Arc::default(),
            ready_at,
            panics: false,
        };
        // Two calls of tree 1 that never end, one of tree 2 that ends at its 2nd poll.
        let (a, b, c) = (probe(usize::MAX), probe(usize::MAX), probe(2));
        let flags = [&a, &b, &c].map(|p| (p.dropped.clone(), p.polls.clone()));
        let mut calls = Calls::<u32>::default();
        for (root, p) in [(1, a), (1, b), (2, c)] {
            let status = Arc::new(TreeStatus::default());
            calls.push(ProcId(root), Box::pin(guarded_call(status, p)));
        }
        let mut cx = task::Context::from_waker(task::Waker::noop());
        assert!(calls.poll_next(&mut cx).is_pending());
        assert_eq!(calls.drop_tree(ProcId(3)), 0);
        assert_eq!(calls.drop_tree(ProcId(1)), 2);
        let dropped = flags.each_ref().map(|(d, _)| d.load(Ordering::SeqCst));
        assert_eq!(dropped, [true, true, false]);
        // Tree 2's call is polled again (put back, as if woken) and ends.
        match calls.poll_next(&mut cx) {
            Poll::Ready(Some((root, ended))) => {
                assert_eq!((root, ended), (ProcId(2), Ended::Returned(7)));
            }
            other => panic!("tree 2's call did not end: {other:?}"),
        }
        assert_eq!(flags[2].1.load(Ordering::SeqCst), 2);
        assert_eq!(calls.len(), 0);
    }

    fn wake(id: u64) -> Timer {
        Timer::WakeAt { id: ProcId(id) }
    }

    fn fired(timers: &mut Timers, now: Instant) -> Vec<(u64, u64)> {
        std::iter::from_fn(|| timers.due(now))
            .map(|(root, timer)| match timer {
                Timer::WakeAt { id } => (root.0, id.0),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_timer_delay_is_capped_far_away_rather_than_overflowing() {
        let now = Instant::now();
        let far = Duration::from_secs(86_400 * 365 * 30);
        for (delay, expect) in [
            (Duration::ZERO, now),
            (Duration::from_millis(5), now + Duration::from_millis(5)),
            (Duration::from_millis(u64::MAX), now + far),
            (Duration::MAX, now + far),
        ] {
            assert_eq!(fire_at(now, delay), expect, "{delay:?}");
        }
    }

    /// Timers started as (tree, timer id, fires at ms), the trees stopped, the time
    /// looked at (ms), what fired as (tree, timer id), and how many are left.
    struct Case {
        added: &'static [(u64, u64, u64)],
        stopped: &'static [u64],
        now: u64,
        fired: &'static [(u64, u64)],
        left: usize,
    }

    #[test]
    fn timers_fire_by_instant_then_start_order_and_go_with_their_tree() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let cases = [
            Case {
                added: &[(1, 10, 5), (2, 20, 1), (1, 11, 5)],
                stopped: &[],
                now: 5,
                fired: &[(2, 20), (1, 10), (1, 11)],
                left: 0,
            },
            Case {
                added: &[(1, 10, 5), (2, 20, 1)],
                stopped: &[],
                now: 3,
                fired: &[(2, 20)],
                left: 1,
            },
            Case {
                added: &[(1, 10, 5), (2, 20, 1), (1, 11, 2)],
                stopped: &[1],
                now: 9,
                fired: &[(2, 20)],
                left: 0,
            },
            Case {
                added: &[(1, 10, 5)],
                stopped: &[2],
                now: 4,
                fired: &[],
                left: 1,
            },
            Case {
                added: &[],
                stopped: &[1],
                now: 4,
                fired: &[],
                left: 0,
            },
        ];
        for (i, c) in cases.iter().enumerate() {
            let mut timers = Timers::default();
            for &(root, id, at) in c.added {
                timers.add(ProcId(root), ms(at), wake(id));
            }
            for &root in c.stopped {
                timers.forget(ProcId(root));
            }
            assert_eq!(fired(&mut timers, ms(c.now)), c.fired, "case {i}");
            assert_eq!(timers.queue.len(), c.left, "case {i}");
            // A fired timer is no longer its tree's to forget.
            for &(root, _, _) in c.added {
                timers.forget(ProcId(root));
            }
            assert_eq!(timers.queue.len(), 0, "case {i}");
            assert!(timers.by_tree.is_empty(), "case {i}");
        }
    }
}
