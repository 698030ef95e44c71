//! The root-stack actor: one per live tree, on its shard's arbiter, while the tree has
//! work in flight. It holds the tree's runner ([`TreeRunner`]: the pure `RootStack`
//! and the cells of the tree's procedures) and gives it an actor's context
//! ([`TreeCtx`]): its calls into user code are futures of this actor, its timers this
//! actor's `run_later`, and what it sends the scheduler, the lock actor and the
//! persistence actor goes into its shard's outbox ([`ShardIo`]), sent as one message
//! per actor when the shard flushes it.
//!
//! Every message to the tree comes through its shard ([`Shard`], the host), which
//! forwards it ([`Deliver`]), so one sender's messages to a tree arrive in the order
//! they were sent and the shard knows everything the actor has been sent. A tree with
//! nothing in flight (no transition waiting for durability, no step out, no call
//! running, no timer armed) is passivated: the actor asks its shard ([`Quiet`]), the
//! shard holds the tree's later messages and sends [`Passivate`] behind everything it
//! forwarded; the actor, still quiet, hands its runner back ([`Passivated`]) and stops,
//! and the shard keeps the runner as a value until the next message activates it again
//! (the messages held meanwhile go to the new actor first). A tree waiting for an event
//! or paused for an operator costs its runner only.
//!
//! A panic in engine code around a tree's handling cuts that tree off (its runner's
//! `Drop` tells the executor); the shard and its other trees go on. A tree that stopped
//! gets nothing more: its shard drops messages for it, and its calls in flight are not
//! polled again (they watch its status) and go with the actor.

mod runner;

use std::cell::RefCell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{self, Poll};
use std::time::{Duration, Instant};

use actix::fut::wrap_future;
use actix::prelude::*;

use crate::procedure::ProcId;

use super::guard::panic_message;
use super::procedure::CallEnd;
use super::protocol::{
    AbortRequest, BypassRequest, CommandRequest, Durable, Outgoing, Quiesce, ToProc, TreeFinished,
    Wake,
};
use super::shard::{Gone, Passivated, Quiet, Shard, ShardIo};
use super::shared::TreeStatus;

pub(crate) use runner::{publish_recovered, Objects, TreeRunner};

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

/// A message for the tree, forwarded by its shard.
pub(crate) struct Deliver(pub(crate) TreeMsg);

impl Message for Deliver {
    type Result = ();
}

/// From the shard, behind everything it forwarded: hand the runner back and stop if
/// the tree is still quiet.
pub(crate) struct Passivate;

impl Message for Passivate {
    type Result = ();
}

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

/// A delay capped at about 30 years, as tokio caps its own timers, so that no delay
/// overflows an `Instant`.
fn capped(delay: Duration) -> Duration {
    const FAR: Duration = Duration::from_secs(86_400 * 365 * 30);
    let now = Instant::now();
    match now.checked_add(delay.min(FAR)) {
        Some(_) => delay.min(FAR),
        None => Duration::ZERO,
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

/// `call` as one of the actor's futures: not polled again once `tree` is dropped, a
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

/// What a root stack may do beyond its own state: its actor's context and its shard's
/// outbox.
pub(crate) struct TreeCtx<'a> {
    actor: &'a mut Context<RootStackActor>,
    io: &'a RefCell<ShardIo>,
    /// Calls and timers in flight: counted here, for passivation.
    in_flight: &'a mut u32,
    stop: bool,
    /// The tree's result, sent to the executor once the actor has left its shard.
    result: Option<TreeFinished>,
}

impl TreeCtx<'_> {
    /// Runs `call` as one of the actor's futures; its end goes to the tree's
    /// `call_ended`. If the tree (whose status is `tree`) is dropped first, the call is
    /// not polled again: it ends, and drops the user's future, the next time it wakes,
    /// or at once with the actor if a panic in engine code cut the tree off.
    pub(crate) fn spawn(
        &mut self,
        tree: Arc<TreeStatus>,
        call: impl Future<Output = CallEnd> + 'static,
    ) {
        *self.in_flight += 1;
        let call = wrap_future::<_, RootStackActor>(guarded_call(tree, call))
            .map(|end, actor, ctx| actor.call_done(end, ctx));
        self.actor.spawn(call);
    }

    /// Fires `timer` after `delay` (dropped if the tree stops first).
    pub(crate) fn run_later(&mut self, delay: Duration, timer: Timer) {
        *self.in_flight += 1;
        self.actor.run_later(capped(delay), move |actor, ctx| {
            actor.timer_fired(timer, ctx);
        });
    }

    /// The tree's work is done: its actor stops once this call returns.
    pub(crate) fn stop(&mut self) {
        self.stop = true;
    }

    /// The tree's result, for the executor: sent as the actor stops, after it told its
    /// shard it is gone, so that whoever hears the result finds the tree gone.
    pub(crate) fn publish(&mut self, result: TreeFinished) {
        self.result = Some(result);
    }

    /// Queues `msg` for its actor (the shard's scheduler, the lock actor or the
    /// persistence actor), after everything the shard's trees queued for it before.
    pub(crate) fn tell(&mut self, msg: impl Into<Outgoing>) {
        ShardIo::push(self.io, msg.into());
    }

    /// Sends what is queued for the scheduler, the lock actor and the persistence actor
    /// now: before anything that leaves the shard another way and must not overtake it
    /// (an answer to a caller, a tree's result, news for the executor).
    pub(crate) fn send_now(&mut self) {
        self.io.borrow_mut().flush();
    }
}

/// The root-stack actor (see the module docs).
pub(crate) struct RootStackActor {
    root: ProcId,
    /// `None` once handed back to the shard, or once the tree ended.
    runner: Option<Box<TreeRunner>>,
    io: Rc<RefCell<ShardIo>>,
    shard: Addr<Shard>,
    /// Calls into user code and timers in flight.
    in_flight: u32,
    /// The runner starts with this actor (a new or recovered tree), rather than being
    /// activated again.
    starts: bool,
    /// It told its shard it is quiet and has not heard back.
    quiet_told: bool,
}

impl RootStackActor {
    pub(crate) fn new(
        root: ProcId,
        runner: Box<TreeRunner>,
        io: Rc<RefCell<ShardIo>>,
        shard: Addr<Shard>,
        starts: bool,
    ) -> Self {
        RootStackActor {
            root,
            runner: Some(runner),
            io,
            shard,
            in_flight: 0,
            starts,
            quiet_told: false,
        }
    }

    /// Calls `f` with the runner and a context; then stops the actor if the tree ended
    /// (or a panic in engine code cut it off), or tells the shard if it went quiet.
    fn with_runner(
        &mut self,
        ctx: &mut Context<Self>,
        f: impl FnOnce(&mut TreeRunner, &mut TreeCtx<'_>),
    ) {
        let Some(runner) = self.runner.as_mut() else {
            return;
        };
        let mut tree_ctx = TreeCtx {
            actor: ctx,
            io: &self.io,
            in_flight: &mut self.in_flight,
            stop: false,
            result: None,
        };
        let ran = catch_unwind(AssertUnwindSafe(|| f(runner, &mut tree_ctx)));
        let (stop, result) = (tree_ctx.stop, tree_ctx.result);
        match ran {
            Err(payload) => self.cut_off(&panic_message(&*payload), result, ctx),
            Ok(()) if stop => self.end(result, ctx),
            Ok(()) => self.tell_if_quiet(),
        }
    }

    /// Whether the tree has nothing in flight, and may be passivated.
    fn quiet(&self) -> bool {
        self.in_flight == 0 && self.runner.as_ref().is_some_and(|r| r.quiet())
    }

    fn tell_if_quiet(&mut self) {
        if !self.quiet_told && self.quiet() {
            self.quiet_told = true;
            self.shard.do_send(Quiet(self.root));
        }
    }

    /// Engine code panicked for this tree: it is cut off, the others go on (a result
    /// it published before the panic still goes out).
    fn cut_off(&mut self, message: &str, result: Option<TreeFinished>, ctx: &mut Context<Self>) {
        tracing::error!(root = %self.root, %message, "engine code panicked: the tree is cut off");
        self.end(result, ctx);
    }

    /// The tree ended: its `TreeEnded` goes after everything it sent, the shard hears
    /// it is gone, then the executor gets its `result` (if it published one), and the
    /// actor stops (its calls in flight, if it was cut off, go with it).
    fn end(&mut self, result: Option<TreeFinished>, ctx: &mut Context<Self>) {
        let Some(mut runner) = self.runner.take() else {
            return;
        };
        let executor = result.is_some().then(|| runner.executor());
        let (ended, irreversible, cut_off) = runner.ended();
        {
            let mut io = self.io.borrow_mut();
            io.tree_ended(ended, irreversible);
            if cut_off {
                // The drop tells the executor that the tree failed: the scheduler
                // hears first that it ended (and frees the workers of its steps).
                io.flush();
            }
        }
        drop(runner);
        ShardIo::ask_flush(&self.io);
        self.shard.do_send(Gone(self.root));
        if let (Some(result), Some(executor)) = (result, executor) {
            executor.do_send(result);
        }
        ctx.stop();
    }

    fn call_done(&mut self, end: Ended, ctx: &mut Context<Self>) {
        self.in_flight -= 1;
        match end {
            Ended::Returned(end) => self.with_runner(ctx, |r, c| r.call_ended(end, c)),
            Ended::Dropped => {}
            Ended::Panicked(message) => {
                if self.runner.is_some() {
                    self.cut_off(&message, None, ctx);
                }
            }
        }
    }

    fn timer_fired(&mut self, timer: Timer, ctx: &mut Context<Self>) {
        self.in_flight -= 1;
        self.with_runner(ctx, |r, c| r.on_timer(timer, c));
    }
}

impl Actor for RootStackActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.starts {
            self.with_runner(ctx, TreeRunner::started);
        }
    }
}

impl Handler<Deliver> for RootStackActor {
    type Result = ();

    fn handle(&mut self, msg: Deliver, ctx: &mut Context<Self>) {
        self.with_runner(ctx, |r, c| r.receive(msg.0, c));
    }
}

impl Handler<Passivate> for RootStackActor {
    type Result = ();

    fn handle(&mut self, _msg: Passivate, ctx: &mut Context<Self>) {
        self.quiet_told = false;
        if self.quiet() {
            let runner = self.runner.take();
            self.shard.do_send(Passivated(self.root, runner));
            ctx.stop();
        } else {
            // Something it was sent before the shard held its messages gave it work.
            self.shard.do_send(Passivated(self.root, None));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// A call that returns `7` at its `ready_at`th poll, or panics there; counts its
    /// polls and says when it is dropped.
    struct Probe {
        polls: Arc<AtomicUsize>,
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
    /// ended, and how often the call was polled. The guard drops the call as soon as
    /// it ends, while the guard itself is still held.
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
                if let Poll::Ready(end) = call.as_mut().poll(&mut cx) {
                    break end;
                }
            };
            assert_eq!(ended, expected, "ready at {ready_at}, panics {panics}");
            assert_eq!(count.load(Ordering::SeqCst), polls);
            assert!(dropped.load(Ordering::SeqCst), "the call went as it ended");
        }
    }

    #[test]
    fn a_timer_delay_is_capped_far_away_rather_than_overflowing() {
        assert_eq!(capped(Duration::from_secs(5)), Duration::from_secs(5));
        let far = capped(Duration::MAX);
        assert!(far < Duration::MAX && far >= Duration::from_secs(86_400 * 365 * 29));
    }
}
