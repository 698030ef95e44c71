//! [`ExecutorActor`], the executor's actor, with its state and a handler for every
//! message it takes: submits (with their nonces and the admission bound), operators'
//! commands passed to the trees, queries of the procedure table, result waiters, the
//! result cleaner, subscribers, and the shutdown. [`Executor`] and the public messages
//! reach it; the root stacks tell it of finished trees and news. The invariant it
//! guards: once the store has failed or a shutdown began, it accepts nothing more, and
//! every waiter is answered.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::{Error, WaitError};
use crate::fast_map::IdMap;
use crate::procedure::{ProcId, ProcState};
use crate::record::{Failure, Nonce, StoreOp};

use crate::actors::locks::{GetLockReport, GetLockStats, ResetEvent, StopLocks, WakeEvent};
use crate::actors::persistence::GetStoreStatus;
use crate::actors::procedure::{declare, Undeclarable};
use crate::actors::protocol::{
    AbortRequest, BypassRequest, Command, CommandRequest, DurableAck, Persist, Quiesce, Refuse,
    StopWriter, TreeAddr,
};
use crate::actors::root_stack::Describe;
use crate::actors::root_stack::TreeRunner;
use crate::actors::scheduler::{GetSchedulerStats, GetShardStats, SchedulerStats};
use crate::actors::shard::GetTreeCounts;
use crate::actors::shared::{now_ms, Shared, Waiting};

use super::api::{
    Abort, AckResult, Bypass, Continue, EngineStatus, GetEngineStatus, GetLocks, GetState, GetTree,
    GetValue, List, Pause, ProcEvent, ProcInfo, RecentFailure, Rollback, Shutdown, Submit,
    Subscribe, SubscribeChannel, TreeFinished, TreeInfo, TreeNews, WaitFor, WaitValue, WaitingOn,
};
use super::builder::Retention;

// For the docs' links only.
#[cfg(doc)]
use super::handle::Executor;

/// Where a subscriber's events go.
pub(super) enum Subscriber {
    Actor(Recipient<ProcEvent>),
    Channel(tokio::sync::mpsc::UnboundedSender<ProcEvent>),
}

impl Subscriber {
    /// Delivers `event`; `false` once the subscriber is gone.
    fn deliver(&self, event: ProcEvent) -> bool {
        match self {
            Subscriber::Actor(r) => {
                r.connected() && {
                    r.do_send(event);
                    true
                }
            }
            Subscriber::Channel(tx) => tx.send(event).is_ok(),
        }
    }
}

/// How long a graceful shutdown waits, past its drain deadline, for the calls it
/// cancelled to return.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

type Waiter = oneshot::Sender<Result<Result<(), Failure>, Error>>;

/// The executor's actor. Talk to it through [`Executor`] or with the messages.
pub struct ExecutorActor<E = ()> {
    pub(super) shared: Arc<Shared>,
    pub(super) waiters: IdMap<ProcId, Vec<Waiter>>,
    /// Set once the store has failed (or the engine broke): nothing more is accepted,
    /// and every waiter gets this error.
    pub(super) broken: Option<Error>,
    /// The arbiter threads, joined at shutdown.
    pub(super) arbiters: Vec<Arbiter>,
    /// Root procedures submitted or recovered and not finished.
    pub(super) unfinished: usize,
    pub(super) max_unfinished: usize,
    /// Roots by the nonce they were submitted with, as long as their records live.
    pub(super) nonces: HashMap<Nonce, NonceState>,
    pub(super) retention: Retention,
    /// Finished roots whose results are kept, oldest first: when they finished.
    pub(super) finished: VecDeque<(u64, ProcId)>,
    /// Roots whose results were evicted while their nonces are still remembered (their
    /// records kept in the store for them): until when, roughly oldest first.
    pub(super) nonce_only: VecDeque<(u64, ProcId, Nonce)>,
    /// Results the client acknowledged, and when.
    pub(super) acked: IdMap<ProcId, u64>,
    /// A batch of evictions is on its way to the store.
    pub(super) evicting: bool,
    /// The actix system is the executor's own: shutdown stops it.
    pub(super) owned_system: bool,
    /// The longest a graceful shutdown waits.
    pub(super) drain_timeout: Duration,
    /// A shutdown has begun: submits are refused.
    pub(super) stopping: bool,
    /// The procedures recovery left in the store, their trees corrupt: a drained stop
    /// names them as possibly cut off, since this engine never knew whether they were.
    pub(super) corrupt: Vec<ProcId>,
    /// Who receives procedure events.
    pub(super) subscribers: Vec<Subscriber>,
    /// The latest trees that rolled back, for operators.
    pub(super) recent_failures: VecDeque<RecentFailure>,
    /// The token of the latest nonce reservation.
    pub(super) next_token: u64,
    /// What this executor is: alone on its store, the lease's holder, or stepped down.
    pub(super) role: Role,
    /// The lease it holds (renewed from its own thread; dropped with the actor, which
    /// lets the lease go).
    #[cfg(feature = "postgres")]
    pub(super) leadership: Option<crate::actors::Leadership>,
    /// The environment type of the procedures it takes.
    pub(super) env: PhantomData<fn() -> E>,
}

impl<E> std::fmt::Debug for ExecutorActor<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorActor")
            .field("unfinished", &self.unfinished)
            .field("max_unfinished", &self.max_unfinished)
            .field("finished_kept", &self.finished.len())
            .field("broken", &self.broken)
            .field("stopping", &self.stopping)
            .field("subscribers", &self.subscribers.len())
            .finish_non_exhaustive()
    }
}

/// Where a nonce's submit is.
pub(super) enum NonceState {
    /// Its insert is on its way to the store: later submits (and registrations) wait
    /// for the answer.
    Submitting(Vec<NonceWaiter>),
    /// Reserved by the holder of the reservation `token`, who will submit, record a
    /// failure, or let go; later submits and registrations wait for which.
    Reserved {
        token: u64,
        waiting: Vec<NonceWaiter>,
    },
    /// The procedure exists (durably).
    Known(ProcId),
}

/// A submit or registration waiting on a nonce: told the answer, or `None` to try
/// again (the nonce's reservation was let go).
pub(super) type NonceWaiter = oneshot::Sender<Option<Result<ProcId, Error>>>;

/// Where a nonce stands for a request that names it.
pub(super) enum Turn {
    /// Its procedure exists.
    Known(ProcId),
    /// Another request holds it: wait for this answer.
    Wait(oneshot::Receiver<Option<Result<ProcId, Error>>>),
    /// This request may go on (the nonce is free, or it holds the reservation).
    Go,
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    fn info(&self, id: ProcId) -> Option<ProcInfo> {
        let (locks_held, locks_waiting) = match self.shared.views.locks.get(&id) {
            Some(v) if v.held => (v.locks.clone(), Vec::new()),
            Some(v) => (Vec::new(), v.locks.clone()),
            None => (Vec::new(), Vec::new()),
        };
        let views = &self.shared.views;
        self.shared.table.get(&id).map(|e| {
            let waiting_on = match (&e.waiting, e.state) {
                _ if !locks_waiting.is_empty() => Some(WaitingOn::Locks),
                (Waiting::Event(event), ProcState::Waiting) => {
                    Some(WaitingOn::Event(event.to_string()))
                }
                (Waiting::Timer(at_ms), ProcState::WaitingTimeout) => {
                    Some(WaitingOn::Timer { at_ms: *at_ms })
                }
                (_, ProcState::Waiting) => Some(WaitingOn::Children),
                _ => None,
            };
            ProcInfo {
                id,
                root: e.root,
                parent: e.parent,
                type_name: e.type_name,
                state: e.state,
                steps: (!e.state.is_finished()).then_some(e.steps),
                submitted_ms: e.submitted_ms,
                updated_ms: e.updated_ms,
                result: e.result().cloned().map(|r| r.map_err(|f| *f)),
                locks_held,
                locks_waiting,
                state_name: e.state_name.clone(),
                waiting_on,
                steering: e.steering.as_deref().cloned().unwrap_or_default(),
                queue_level: (views.fair && e.state == ProcState::Runnable)
                    .then(|| views.levels.get(&e.root).map_or(0, |l| *l)),
                bypassed: e.extra.as_ref().is_some_and(|x| x.bypassed),
            }
        })
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// The root stack of `id`'s tree while `id` is unfinished, or why there is none.
    fn live_tree(&self, id: ProcId) -> Result<TreeAddr, Error> {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        match self.shared.table.get(&id) {
            None => Err(self.missing(id)),
            Some(e) => match &e.tree {
                Some(tree) if !e.state.is_finished() && e.result().is_none() => Ok(tree.clone()),
                _ => Err(Error::Finished { id, state: e.state }),
            },
        }
    }

    /// The error for an id the table does not have.
    fn missing(&self, id: ProcId) -> Error {
        if self.shared.issued(id) {
            Error::Gone(id)
        } else {
            Error::UnknownProcedure(id)
        }
    }

    /// Evicts, in one append, up to a batch of results whose time is up; goes on at
    /// once if there were more.
    fn clean(&mut self, ctx: &mut Context<Self>) {
        if self.evicting || self.broken.is_some() {
            return;
        }
        let due = self.due_results();
        let mut more = due.len() == EVICT_BATCH;
        let batch = self.deletions(due);
        more |= batch.len() == EVICT_BATCH;
        if batch.is_empty() {
            return;
        }
        self.evicting = true;
        let (ack, durable) = oneshot::channel();
        self.shared.persistence.do_send(Persist {
            ops: batch.iter().map(|&(id, _)| StoreOp::Delete(id)).collect(),
            ack: DurableAck::Caller(ack),
        });
        let done = async move { durable.await.unwrap_or(Err(Error::Stopped)) };
        ctx.spawn(done.into_actor(self).map(move |result, act, ctx| {
            act.evicting = false;
            match result {
                Ok(()) => {
                    act.evicted(&batch);
                    if more {
                        act.clean(ctx);
                    }
                }
                Err(e) => act.broke(e),
            }
        }));
    }

    /// Of the roots whose results are due, those whose records go (with their nonce, if
    /// any), and then those whose nonce window has passed since: a root whose nonce is
    /// still remembered loses its result now, and keeps its records (and its nonce)
    /// until its window ends.
    fn deletions(&mut self, due: Vec<ProcId>) -> Vec<(ProcId, Option<Nonce>)> {
        let now = now_ms();
        let window = self.retention.nonces.max(self.retention.kept);
        let window = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
        let mut batch = Vec::with_capacity(due.len());
        for id in due {
            let nonce = self.shared.table.get(&id).and_then(|e| {
                let nonce = e.nonce()?;
                Some((nonce, e.updated_ms.saturating_add(window)))
            });
            match nonce {
                Some((nonce, until)) if until > now => {
                    self.shared.table.remove(&id);
                    self.acked.remove(&id);
                    self.nonce_only.push_back((until, id, nonce));
                }
                nonce => batch.push((id, nonce.map(|(nonce, _)| nonce))),
            }
        }
        while batch.len() < EVICT_BATCH {
            match self.nonce_only.front() {
                Some(&(until, id, nonce)) if until <= now => {
                    self.nonce_only.pop_front();
                    batch.push((id, Some(nonce)));
                }
                _ => break,
            }
        }
        batch
    }

    /// Up to a batch of results whose time is up, in id order, taken out of
    /// `finished` and `acked`: those kept past their retention first, then those
    /// acknowledged past the shorter one.
    fn due_results(&mut self) -> Vec<ProcId> {
        let now = now_ms();
        let kept = u64::try_from(self.retention.kept.as_millis()).unwrap_or(u64::MAX);
        let after_ack = u64::try_from(self.retention.after_ack.as_millis()).unwrap_or(u64::MAX);
        let mut batch: Vec<ProcId> = Vec::new();
        while batch.len() < EVICT_BATCH {
            match self.finished.front() {
                Some(&(at, id)) if at.saturating_add(kept) <= now => {
                    self.finished.pop_front();
                    batch.push(id);
                }
                _ => break,
            }
        }
        if batch.len() < EVICT_BATCH {
            let due: Vec<ProcId> = self
                .acked
                .iter()
                .filter(|(_, &at)| at.saturating_add(after_ack) <= now)
                .map(|(&id, _)| id)
                .take(EVICT_BATCH - batch.len())
                .collect();
            for id in due {
                self.acked.remove(&id);
                batch.push(id);
            }
        }
        // An acknowledged result may also have reached its time in `finished`.
        batch.sort_unstable();
        batch.dedup();
        batch.retain(|id| {
            self.shared
                .table
                .get(id)
                .is_some_and(|e| e.result().is_some())
        });
        batch
    }

    /// Forgets the roots of `batch`, whose deletes are durable: their rows, their
    /// nonces and their acknowledgements.
    fn evicted(&mut self, batch: &[(ProcId, Option<Nonce>)]) {
        for (id, nonce) in batch {
            self.shared.table.remove(id);
            if let Some(nonce) = nonce {
                self.nonces.remove(nonce);
            }
            self.acked.remove(id);
        }
        tracing::debug!(target: crate::targets::EXECUTOR, evicted = batch.len(), "evicted finished results");
    }

    /// The store failed (or the engine broke): accept nothing more and answer every
    /// waiter with the error.
    pub(super) fn broke(&mut self, e: Error) {
        if self.broken.is_none() {
            tracing::error!(target: crate::targets::EXECUTOR, error = %e, "executor stopped accepting work");
            if matches!(e, Error::Internal(_) | Error::NotLeader { .. }) {
                // Stop every other tree at its next write, as a store failure does.
                self.shared.persistence.do_send(Refuse(e.to_string()));
            }
            let _ = self.shared.broken_error.set(e.duplicate());
            if matches!(e, Error::NotLeader { .. }) {
                // Stepped down: no user code from here on, not a step, a rollback, a
                // retry or a hook; the lease's new holder carries every tree on.
                self.shared.mandate.end();
            } else {
                self.shared.mandate.broke();
            }
            self.shared.broken.cancel();
            self.broken = Some(e);
        }
        // Trees that are idle (sleeping, suspended) write nothing and would never
        // learn; their waiters get the error now, like everyone's.
        let broken = self
            .broken
            .as_ref()
            .map_or(Error::Stopped, Error::duplicate);
        for (_, waiters) in self.waiters.drain() {
            for waiter in waiters {
                let _ = waiter.send(Err(broken.duplicate()));
            }
        }
    }
}

/// Results evicted per append, at most.
const EVICT_BATCH: usize = 10_000;

impl<E: Send + Sync + 'static> Actor for ExecutorActor<E> {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(self.retention.every, |act, ctx| act.clean(ctx));
    }
}

/// A submit with a nonce was answered (from the submit's own future, before its caller
/// hears): the retries that came meanwhile get the same answer, and a successful one
/// makes the nonce known; a failed one frees it for the next retry.
struct NonceSettled {
    nonce: Nonce,
    result: Result<ProcId, Error>,
}

impl Message for NonceSettled {
    type Result = ();
}

impl<E: Send + Sync + 'static> Handler<NonceSettled> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: NonceSettled, _ctx: &mut Context<Self>) {
        self.settle_nonce(msg.nonce, msg.result);
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// The submit (or failure) of `nonce` is answered with `result`: the requests
    /// waiting on it hear the same, and a successful one makes the nonce known; a
    /// failed one frees it.
    pub(super) fn settle_nonce(&mut self, nonce: Nonce, result: Result<ProcId, Error>) {
        if let Some(NonceState::Submitting(waiting)) = self.nonces.remove(&nonce) {
            for tx in waiting {
                let answer = result.as_ref().map(|id| *id).map_err(Error::duplicate);
                let _ = tx.send(Some(answer));
            }
        }
        if let Ok(id) = result {
            self.nonces.insert(nonce, NonceState::Known(id));
        }
    }

    /// Where `nonce` stands for a request holding the reservation `token` (if any).
    pub(super) fn nonce_turn(&mut self, nonce: Nonce, token: Option<u64>) -> Turn {
        let waiting = match self.nonces.get_mut(&nonce) {
            None => return Turn::Go,
            Some(NonceState::Known(id)) => return Turn::Known(*id),
            Some(NonceState::Reserved { token: held, .. }) if Some(*held) == token => {
                return Turn::Go
            }
            Some(NonceState::Reserved { waiting, .. } | NonceState::Submitting(waiting)) => waiting,
        };
        let (tx, rx) = oneshot::channel();
        waiting.push(tx);
        Turn::Wait(rx)
    }

    /// Why no request is taken now: the engine broke, or a shutdown began.
    pub(super) fn refusal(&self) -> Option<Error> {
        if let Some(broken) = &self.broken {
            return Some(broken.duplicate());
        }
        self.stopping.then_some(Error::Stopped)
    }
}

impl<E: Send + Sync + 'static> Handler<Submit<E>> for ExecutorActor<E> {
    // A plain future, not one of the actor's: actix polls every future an actor holds
    // each time the actor wakes, so thousands of submits waiting for their inserts to
    // be durable made every message to the executor cost thousands of polls.
    type Result = ResponseFuture<Result<ProcId, Error>>;

    fn handle(&mut self, msg: Submit<E>, ctx: &mut Context<Self>) -> Self::Result {
        if let Some(refusal) = self.refusal() {
            return Box::pin(std::future::ready(Err(refusal)));
        }
        if let Some(nonce) = msg.nonce {
            match self.nonce_turn(nonce, msg.reservation) {
                Turn::Known(id) => {
                    tracing::debug!(target: crate::targets::EXECUTOR, proc = %id, group = nonce.group, nonce = nonce.nonce, "submit with a known nonce: answered with its procedure");
                    return Box::pin(std::future::ready(Ok(id)));
                }
                Turn::Wait(answer) => {
                    tracing::debug!(target: crate::targets::EXECUTOR, group = nonce.group, nonce = nonce.nonce, "submit with a nonce being submitted: answered with its procedure once durable");
                    let executor = ctx.address();
                    return Box::pin(async move {
                        match answer.await {
                            Ok(Some(answer)) => answer,
                            // Let go by its reservation: this submit tries again, as
                            // if it had come just now.
                            Ok(None) => executor.send(msg).await?,
                            Err(_) => Err(Error::Stopped),
                        }
                    });
                }
                Turn::Go => {}
            }
        }
        if self.unfinished >= self.max_unfinished {
            let limit = self.max_unfinished;
            return Box::pin(std::future::ready(Err(Error::Overloaded { limit })));
        }
        let nonce = msg.nonce;
        let answer = match self.start_root(msg) {
            Ok(answer) => answer,
            Err(e) => return Box::pin(std::future::ready(Err(e))),
        };
        let Some(nonce) = nonce else {
            return Box::pin(answer);
        };
        settle_nonce(ctx.address(), nonce, answer)
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Names and encodes the submitted root (its nonce, if any, now submitting) and
    /// starts its tree; the answer comes once its insert is durable.
    fn start_root(
        &mut self,
        msg: Submit<E>,
    ) -> Result<impl Future<Output = Result<ProcId, Error>> + 'static, Error> {
        let mut root = declare(&self.shared, &*msg.proc, now_ms()).map_err(|e| match e {
            Undeclarable::Registry(e) => Error::Registry(e),
            Undeclarable::Invalid(e) => Error::Invalid(e.to_string()),
        })?;
        root.nonce = msg.nonce;
        if let Some(nonce) = msg.nonce {
            // The requests waiting on its reservation, if it had one, now wait on it.
            let waiting = match self.nonces.remove(&nonce) {
                Some(NonceState::Reserved { waiting, .. }) => waiting,
                _ => Vec::new(),
            };
            self.nonces.insert(nonce, NonceState::Submitting(waiting));
        }
        let shared = self.shared.clone();
        let (ack, rx) = oneshot::channel();
        let proc = msg.proc;
        self.unfinished += 1;
        let tree = self.shared.new_tree(root.id);
        tree.start(TreeRunner::submit(shared, tree.clone(), root, proc, ack));
        Ok(async move { rx.await.unwrap_or(Err(Error::Stopped)) })
    }
}

/// The answer to a submit with a nonce: `answer`, once the executor has settled the
/// nonce with it ([`NonceSettled`]).
fn settle_nonce<E: Send + Sync + 'static>(
    executor: Addr<ExecutorActor<E>>,
    nonce: Nonce,
    answer: impl Future<Output = Result<ProcId, Error>> + 'static,
) -> ResponseFuture<Result<ProcId, Error>> {
    Box::pin(async move {
        let result = answer.await;
        let settled = result.as_ref().map(|id| *id).map_err(Error::duplicate);
        // Settled before the caller hears, so a retry after the answer finds the
        // nonce known. A stopped executor answers the waiting retries by dropping
        // them.
        let _ = executor
            .send(NonceSettled {
                nonce,
                result: settled,
            })
            .await;
        result
    })
}

#[cfg(feature = "perturb")]
impl<E: Send + Sync + 'static> Handler<crate::actors::root_stack::KillProcedure>
    for ExecutorActor<E>
{
    type Result = Result<(), Error>;

    fn handle(
        &mut self,
        msg: crate::actors::root_stack::KillProcedure,
        _ctx: &mut Context<Self>,
    ) -> Self::Result {
        self.live_tree(msg.id)?.do_send(msg);
        Ok(())
    }
}

impl<E: Send + Sync + 'static> Handler<Abort> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<bool, Error>>;

    fn handle(&mut self, msg: Abort, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        let tree = self.live_tree(id);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            tree?.do_send(AbortRequest { id, ack });
            // No answer: the tree finished (or halted) meanwhile, or the procedure's
            // actor died holding the abort (it is started again; the abort was not
            // taken).
            let answer = answer.await.ok();
            answer.unwrap_or_else(|| {
                Err(match shared.table.get(&id) {
                    Some(e) if e.state.is_finished() => Error::Finished { id, state: e.state },
                    _ => Error::Stopped,
                })
            })
        })
    }
}

impl<E: Send + Sync + 'static> Handler<Bypass> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Bypass, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.id;
        let tree = self.live_tree(id);
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            let request = BypassRequest {
                id,
                recursive: msg.recursive,
                ack,
            };
            tree?.do_send(request);
            answer.await.unwrap_or(Err(Error::Stopped)).map(|_| ())
        })
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Sends an operator's command to the procedure's tree; the answer comes once its
    /// effect is durable.
    fn command(&self, id: ProcId, command: Command) -> ResponseFuture<Result<(), Error>> {
        let tree = self.live_tree(id);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            tree?.do_send(CommandRequest { id, command, ack });
            // A pause waits for a step boundary that a broken engine may never reach
            // (a tree that writes nothing is never told).
            let answer = tokio::select! {
                biased;
                answer = answer => answer.unwrap_or(Err(Error::Stopped)),
                () = shared.broken.cancelled() => Err(shared
                    .broken_error
                    .get()
                    .map_or(Error::Stopped, Error::duplicate)),
            };
            match answer? {
                true => Ok(()),
                // A rollback of a procedure that is not paused is an abort, which its
                // hook refused.
                false => Err(Error::Refused {
                    command: command.name(),
                    id,
                    reason: "the procedure's abort hook refused".into(),
                }),
            }
        })
    }
}

impl<E: Send + Sync + 'static> Handler<Pause> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Pause, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Pause)
    }
}

impl<E: Send + Sync + 'static> Handler<Continue> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Continue, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Continue)
    }
}

impl<E: Send + Sync + 'static> Handler<Rollback> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Rollback, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Rollback)
    }
}

impl<E: Send + Sync + 'static> Handler<GetState> for ExecutorActor<E> {
    type Result = Result<ProcInfo, Error>;

    fn handle(&mut self, msg: GetState, _ctx: &mut Context<Self>) -> Self::Result {
        self.info(msg.0).ok_or_else(|| self.missing(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<WaitFor> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<Result<(), Failure>, Error>>;

    fn handle(&mut self, msg: WaitFor, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        // The row's root and result only (the table's guard released before anything
        // else is looked up), not the whole `ProcInfo`.
        let row = self
            .shared
            .table
            .get(&id)
            .map(|e| (e.root, e.result().cloned()));
        let ready = match row {
            None => Some(Err(self.missing(id))),
            Some((root, _)) if root != id => Some(Err(Error::NotRoot { id, root })),
            Some((_, Some(result))) => Some(Ok(result.map_err(|f| *f))),
            Some((_, None)) => self.broken.as_ref().map(|e| Err(e.duplicate())),
        };
        if let Some(ready) = ready {
            return Box::pin(async move { ready });
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.entry(id).or_default().push(tx);
        Box::pin(async move { rx.await.unwrap_or(Err(Error::Stopped)) })
    }
}

impl<E, T> Handler<GetValue<T>> for ExecutorActor<E>
where
    E: Send + Sync + 'static,
    T: serde::de::DeserializeOwned + 'static,
{
    type Result = Result<Option<T>, Error>;

    fn handle(&mut self, msg: GetValue<T>, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.id;
        let bytes = match self.shared.table.get(&id) {
            None => return Err(self.missing(id)),
            Some(e) if e.result().is_none() => return Err(Error::NotFinished(id)),
            Some(e) => e.caller_value().cloned(),
        };
        bytes.map(|b| decode_value(id, &b)).transpose()
    }
}

impl<E, T> Handler<WaitValue<T>> for ExecutorActor<E>
where
    E: Send + Sync + 'static,
    T: serde::de::DeserializeOwned + 'static,
{
    type Result = ResponseFuture<Result<T, WaitError>>;

    fn handle(&mut self, msg: WaitValue<T>, ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.id;
        let finished = self.handle(WaitFor(id), ctx);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            finished.await?.map_err(WaitError::Failed)?;
            // Read as the result was published: kept at least until its retention ends.
            let bytes = shared
                .table
                .get(&id)
                .ok_or(WaitError::Gone(id))?
                .caller_value()
                .cloned()
                .ok_or(WaitError::NoValue(id))?;
            Ok(decode_value(id, &bytes)?)
        })
    }
}

/// A root's value as the type its caller asked for.
fn decode_value<T: serde::de::DeserializeOwned>(id: ProcId, bytes: &[u8]) -> Result<T, Error> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::ValueType {
        id,
        reason: e.to_string(),
    })
}

impl<E: Send + Sync + 'static> Handler<AckResult> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: AckResult, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        match self.shared.table.get(&id) {
            None => return Err(self.missing(id)),
            Some(e) if e.root != id => return Err(Error::NotRoot { id, root: e.root }),
            Some(e) if e.result().is_none() => return Err(Error::NotFinished(id)),
            Some(_) => {}
        }
        self.acked.entry(id).or_insert_with(now_ms);
        Ok(())
    }
}

impl<E: Send + Sync + 'static> Handler<List> for ExecutorActor<E> {
    type Result = Result<Vec<ProcInfo>, Error>;

    fn handle(&mut self, msg: List, _ctx: &mut Context<Self>) -> Self::Result {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        let mut ids: Vec<ProcId> = match msg.root {
            Some(root) => self
                .shared
                .table
                .iter()
                .filter(|e| e.root == root)
                .map(|e| *e.key())
                .collect(),
            None => self.shared.table.iter().map(|e| *e.key()).collect(),
        };
        ids.sort_unstable();
        Ok(ids
            .into_iter()
            .filter_map(|id| self.info(id))
            .filter(|info| msg.matches(info))
            .collect())
    }
}

impl<E: Send + Sync + 'static> Handler<super::api::ListPage> for ExecutorActor<E> {
    type Result = Result<super::api::ProcPage, Error>;

    fn handle(&mut self, msg: super::api::ListPage, _ctx: &mut Context<Self>) -> Self::Result {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        // Matched on the table's own fields: only the page is described.
        let mut ids: Vec<ProcId> = self
            .shared
            .table
            .iter()
            .filter(|e| msg.list.matches_fields(e.state, e.type_name, e.root))
            .map(|e| *e.key())
            .collect();
        let total = ids.len();
        ids.sort_unstable_by(|a, b| b.cmp(a));
        let procedures = ids
            .into_iter()
            .skip(msg.offset)
            .take(msg.limit)
            .filter_map(|id| self.info(id))
            .collect();
        Ok(super::api::ProcPage { procedures, total })
    }
}

impl<E: Send + Sync + 'static> Handler<WakeEvent> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        self.shared.locks.do_send(msg);
    }
}

impl<E: Send + Sync + 'static> Handler<GetSchedulerStats> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<SchedulerStats, Error>>;

    fn handle(&mut self, _msg: GetSchedulerStats, _ctx: &mut Context<Self>) -> Self::Result {
        // Every shard and its scheduler, and the lock actor: asked at once, added up.
        let shards: Vec<_> = self
            .shared
            .shards
            .iter()
            .map(|at| (at.1.send(GetShardStats), at.0.send(GetTreeCounts)))
            .collect();
        let locks = self.shared.locks.send(GetLockStats);
        Box::pin(async move {
            let mut stats = SchedulerStats::default();
            for (scheduler, trees) in shards {
                stats.add(&scheduler.await?);
                let trees = trees.await?;
                stats.trees_active += trees.active;
                stats.trees_passivated += trees.passivated;
                stats.procedures_active += trees.procedures_active;
            }
            let locks = locks.await?;
            stats.lock_holders = locks.holders;
            stats.lock_waiters = locks.waiters;
            stats.events = locks.events;
            Ok(stats)
        })
    }
}

impl<E: Send + Sync + 'static> Handler<GetTree> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<TreeInfo, Error>>;

    fn handle(&mut self, msg: GetTree, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        let tree = self.live_tree(id);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            tree?.do_send(Describe(ack));
            // Unanswered: the tree finished before it was asked, or the engine stopped.
            answer
                .await
                .map_err(|_| match shared.table.get(&id).map(|e| e.state) {
                    Some(state) if state.is_finished() => Error::Finished { id, state },
                    _ => Error::Stopped,
                })
        })
    }
}

impl<E: Send + Sync + 'static> Handler<GetLocks> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<crate::LockReport, Error>>;

    fn handle(&mut self, _msg: GetLocks, _ctx: &mut Context<Self>) -> Self::Result {
        let report = self.shared.locks.send(GetLockReport);
        Box::pin(async move { Ok(report.await?) })
    }
}

impl<E: Send + Sync + 'static> Handler<GetEngineStatus> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<EngineStatus, Error>>;

    fn handle(&mut self, _msg: GetEngineStatus, _ctx: &mut Context<Self>) -> Self::Result {
        let store = self.shared.persistence.send(GetStoreStatus);
        let recent_failures = self.recent_failures.iter().cloned().collect();
        Box::pin(async move {
            let (store, commits) = store.await??;
            Ok(EngineStatus {
                store,
                commits,
                recent_failures,
            })
        })
    }
}

impl<E: Send + Sync + 'static> Handler<ResetEvent> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: ResetEvent, _ctx: &mut Context<Self>) {
        self.shared.locks.do_send(msg);
    }
}

impl<E: Send + Sync + 'static> Handler<TreeFinished> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: TreeFinished, _ctx: &mut Context<Self>) {
        match msg.result {
            Ok(result) => {
                self.unfinished = self.unfinished.saturating_sub(1);
                let now = now_ms();
                self.finished.push_back((now, msg.root));
                if let Err(failure) = &result {
                    if self.recent_failures.len() == RECENT_FAILURES {
                        self.recent_failures.pop_front();
                    }
                    self.recent_failures.push_back(RecentFailure {
                        at_ms: now,
                        root: msg.root,
                        type_name: self.type_name_of(msg.root),
                        failure: failure.clone(),
                    });
                }
                if !self.subscribers.is_empty() {
                    let event = ProcEvent::Finished {
                        id: msg.root,
                        type_name: self.type_name_of(msg.root),
                        result: result.clone(),
                    };
                    self.publish(event);
                }
                for waiter in self.waiters.remove(&msg.root).unwrap_or_default() {
                    let _ = waiter.send(Ok(result.clone()));
                }
            }
            Err(e) => self.broke(e),
        }
    }
}

/// How many rolled-back trees the executor keeps for operators.
const RECENT_FAILURES: usize = 32;

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    fn type_name_of(&self, id: ProcId) -> &'static str {
        self.shared.table.get(&id).map_or("?", |e| e.type_name)
    }

    /// Sends `event` to every subscriber, forgetting those that are gone.
    pub(super) fn publish(&mut self, event: ProcEvent) {
        self.subscribers.retain(|s| s.deliver(event.clone()));
        if self.subscribers.is_empty() {
            self.shared
                .subscribed
                .store(false, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn subscribe(&mut self, subscriber: Subscriber) -> Result<(), Error> {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        self.subscribers.push(subscriber);
        self.shared
            .subscribed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl<E: Send + Sync + 'static> Handler<Subscribe> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: Subscribe, _ctx: &mut Context<Self>) -> Self::Result {
        self.subscribe(Subscriber::Actor(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<SubscribeChannel> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: SubscribeChannel, _ctx: &mut Context<Self>) -> Self::Result {
        self.subscribe(Subscriber::Channel(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<TreeNews> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: TreeNews, _ctx: &mut Context<Self>) {
        if self.subscribers.is_empty() {
            return;
        }
        let event = match msg {
            TreeNews::Submitted(id) => ProcEvent::Submitted {
                id,
                type_name: self.type_name_of(id),
            },
            TreeNews::Paused {
                id,
                root,
                state,
                why,
            } => ProcEvent::Paused {
                id,
                root,
                state,
                why,
            },
        };
        self.publish(event);
    }
}

impl<E: Send + Sync + 'static> Handler<Shutdown> for ExecutorActor<E> {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, msg: Shutdown, _ctx: &mut Context<Self>) -> Self::Result {
        if !msg.graceful || self.stopping || self.broken.is_some() {
            self.stopping = true;
            return Box::pin(self.stop_now(None));
        }
        self.stopping = true;
        tracing::info!(target: crate::targets::EXECUTOR,
            timeout_ms = self.drain_timeout.as_millis() as u64,
            "draining"
        );
        let shared = self.shared.clone();
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        Box::pin(
            graceful_drain(shared, deadline)
                .into_actor(self)
                .then(|drained, act: &mut Self, _ctx| act.stop_now(drained)),
        )
    }
}

/// A graceful shutdown's drain: waits until `deadline` for the running calls to end
/// (past it, cancels them and waits [`CANCEL_GRACE`] more), then for every tree to make
/// its records durable. If all of it ended in time and no step was cut off, the
/// procedures the trees say an earlier crash may still have cut off (see [`Quiesce`]).
async fn graceful_drain(
    shared: Arc<Shared>,
    mut deadline: tokio::time::Instant,
) -> Option<Vec<ProcId>> {
    // Whether a step was cut off (cancelled, or not made durable in time).
    let mut cut = false;
    if tokio::time::timeout_at(deadline, shared.drain.drain())
        .await
        .is_err()
    {
        // Ask the running calls to stop (`CancelReason::Shutdown`), and give
        // those that watch the signal a moment to return.
        tracing::warn!(target: crate::targets::EXECUTOR, "drain deadline passed with steps still running: cancelling them");
        shared.shutdown.cancel();
        deadline = tokio::time::Instant::now() + CANCEL_GRACE;
        if tokio::time::timeout_at(deadline, shared.drain.drain())
            .await
            .is_err()
        {
            tracing::warn!(target: crate::targets::EXECUTOR, "steps still running after their cancellation: stopping now");
            return None;
        }
        // A cancelled step that returned reported a yield: it ran, unrecorded.
        cut = true;
    }
    // Every report is sent; wait until each tree has made its records durable.
    let Ok(cut_off) = tokio::time::timeout_at(deadline, quiesced(&shared)).await else {
        tracing::warn!(target: crate::targets::EXECUTOR, "drain deadline passed with records not yet durable: stopping now");
        return None;
    };
    cut_off.filter(|_| !cut)
}

/// Asks every tree to make its records durable (`Quiesce`, sent now); the future ends
/// once each has answered, with what they answered together (`None` if one halted).
fn quiesced(shared: &Shared) -> impl Future<Output = Option<Vec<ProcId>>> {
    let trees: Vec<_> = shared
        .table
        .iter()
        .filter(|e| e.parent.is_none())
        .filter_map(|e| e.tree.clone())
        .collect();
    let answers: Vec<_> = trees
        .into_iter()
        .map(|tree| {
            let (tx, rx) = oneshot::channel();
            tree.do_send(Quiesce(tx));
            rx
        })
        .collect();
    async move {
        let mut cut_off = Vec::new();
        for answer in answers {
            // A tree that ended meanwhile drops its sender: quiet too.
            if let Ok(answer) = answer.await {
                cut_off.extend(answer?);
            }
        }
        Some(cut_off)
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Stops the arbiters (cutting off what runs) and the store writer. `drained`: a
    /// graceful shutdown ended every call and made every report durable, so the store
    /// is marked so ([`ProcedureStore::mark_drained`](crate::ProcedureStore::mark_drained))
    /// after its last append, naming these procedures (and the corrupt ones left in the
    /// store) as possibly cut off by an earlier crash.
    fn stop_now(&mut self, drained: Option<Vec<ProcId>>) -> impl ActorFuture<Self, Output = ()> {
        let drained = drained.map(|mut cut_off| {
            cut_off.extend_from_slice(&self.corrupt);
            cut_off
        });
        // Set first: the trees cut off below report nothing as an engine failure.
        self.broken = Some(Error::Stopped);
        // The arbiters stop one by one, and a tree cut off on one frees its locks:
        // a procedure on another must not start a call under them meanwhile.
        self.shared.drain.close();
        for arbiter in &self.shared.arbiters {
            arbiter.stop();
        }
        for (_, waiters) in self.waiters.drain() {
            for waiter in waiters {
                let _ = waiter.send(Err(Error::Stopped));
            }
        }
        // Their streams end.
        self.subscribers.clear();
        let persistence = self.shared.persistence.clone();
        let locks = self.shared.locks.clone();
        let owned_system = self.owned_system;
        let was_drained = drained.is_some();
        // Joined off the actor threads: a call into user code that is in the middle of a
        // poll finishes it, and then nothing of this executor runs any more when
        // `shutdown` returns (a new executor on the same store must never overlap it).
        let (joined, threads_gone) = oneshot::channel();
        let arbiters = std::mem::take(&mut self.arbiters);
        let joiner = std::thread::Builder::new()
            .name("proctor-shutdown".into())
            .spawn(move || {
                for arbiter in arbiters {
                    let _ = arbiter.join();
                }
                let _ = joined.send(());
            });
        async move {
            if joiner.is_ok() {
                let _ = threads_gone.await;
            }
            // Errors mean it has stopped already.
            let _ = persistence.send(StopWriter { drained }).await;
            // Nothing of this engine asks for locks or waits for events any more.
            locks.do_send(StopLocks);
            tracing::info!(target: crate::targets::EXECUTOR,
                drained = was_drained,
                "executor stopped: its threads are joined and its store is closed"
            );
            if owned_system {
                System::current().stop();
            }
        }
        .into_actor(self)
        // Stopped last: an actor's pending futures end with it. Meanwhile `broken`
        // answers every request.
        .map(|(), _act, ctx| ctx.stop())
    }
}

impl<E: Send + Sync + 'static> Handler<crate::actors::remote::Report> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<bool, Error>>;

    fn handle(
        &mut self,
        msg: crate::actors::remote::Report,
        _ctx: &mut Context<Self>,
    ) -> Self::Result {
        let dispatcher = self.dispatcher();
        Box::pin(async move { dispatcher?.send(msg).await? })
    }
}

impl<E: Send + Sync + 'static> Handler<crate::actors::remote::RemoveTarget> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<usize, Error>>;

    fn handle(
        &mut self,
        msg: crate::actors::remote::RemoveTarget,
        _ctx: &mut Context<Self>,
    ) -> Self::Result {
        let dispatcher = self.dispatcher();
        Box::pin(async move { dispatcher?.send(msg).await? })
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// The remote dispatcher, or why there is none.
    fn dispatcher(&self) -> Result<Addr<crate::actors::remote::RemoteDispatcher>, Error> {
        self.shared
            .remote
            .as_ref()
            .map(|(_, addr)| addr.clone())
            .ok_or_else(|| {
                Error::Config(
                    "this executor has no remote dispatcher: give its builder .remote(transport)"
                        .into(),
                )
            })
    }
}

/// What an executor is to its store ([`Executor::role`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Role {
    /// It runs without a leader lease (one engine on its store).
    Alone,
    /// It holds the leader lease ([`ExecutorBuilder::leadership`](super::ExecutorBuilder)).
    Leader {
        /// Its name in the lease.
        holder: String,
        /// The lease's epoch, which its writes are fenced with.
        epoch: i64,
    },
    /// It waits for the lease as a standby
    /// ([`ExecutorBuilder::start_standby`](super::ExecutorBuilder)): it runs nothing,
    /// and answers every request [`Error::NotLeader`] naming `leader`.
    Standby {
        /// The lease's holder as it last saw it, if any.
        leader: Option<String>,
    },
    /// It lost the lease and stepped down: it runs and acknowledges nothing more.
    SteppedDown {
        /// Why.
        reason: String,
    },
}

/// Ask the executor what it is.
pub(super) struct GetRole;

impl Message for GetRole {
    type Result = Role;
}

impl<E: Send + Sync + 'static> Handler<GetRole> for ExecutorActor<E> {
    type Result = MessageResult<GetRole>;

    fn handle(&mut self, _: GetRole, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.role.clone())
    }
}

/// The lease is lost: step down.
#[cfg(feature = "postgres")]
struct LeaseLost(crate::actors::pg_store::Loss);

#[cfg(feature = "postgres")]
impl Message for LeaseLost {
    type Result = ();
}

#[cfg(feature = "postgres")]
impl<E: Send + Sync + 'static> Handler<LeaseLost> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: LeaseLost, _ctx: &mut Context<Self>) {
        if !matches!(self.role, Role::Leader { .. }) {
            return;
        }
        let crate::actors::pg_store::Loss { reason, taker } = msg.0;
        tracing::error!(target: crate::targets::EXECUTOR, reason = %reason, "lost the leader lease: stepping down");
        ::metrics::gauge!(crate::actors::metrics::IS_LEADER).set(0.0);
        self.role = Role::SteppedDown {
            reason: reason.clone(),
        };
        if !self.subscribers.is_empty() {
            self.publish(ProcEvent::SteppedDown {
                reason: reason.clone(),
            });
        }
        self.broke(Error::NotLeader {
            reason,
            leader: taker,
        });
    }
}

/// Hands the executor at `addr` the lease it holds: it keeps it, and steps down when
/// the lease is lost.
#[cfg(feature = "postgres")]
pub(super) fn lead<E: Send + Sync + 'static>(
    addr: &Addr<ExecutorActor<E>>,
    leadership: crate::actors::Leadership,
) {
    let lost = leadership.signal();
    let term = leadership.term();
    addr.do_send(Lead(Some(leadership)));
    let addr = addr.clone();
    actix::spawn(async move {
        // The lease's thread tells of a loss; a term that ran out by this process's
        // clock is one too, should that thread be held up (a connection that hangs).
        let loss = tokio::select! {
            loss = crate::actors::pg_store::lost_reason(lost) => loss,
            () = async {
                loop {
                    let left = term.left();
                    if left.is_zero() {
                        break;
                    }
                    actix::clock::sleep(left).await;
                }
            } => crate::actors::pg_store::Loss {
                reason: "the leader lease's term ran out: no renewal succeeded within two \
                         thirds of its period"
                    .to_string(),
                taker: None,
            },
        };
        addr.do_send(LeaseLost(loss));
    });
}

/// The lease this executor holds.
#[cfg(feature = "postgres")]
struct Lead(Option<crate::actors::Leadership>);

#[cfg(feature = "postgres")]
impl Message for Lead {
    type Result = ();
}

#[cfg(feature = "postgres")]
impl<E: Send + Sync + 'static> Handler<Lead> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, mut msg: Lead, _ctx: &mut Context<Self>) {
        if let Some(leadership) = msg.0.take() {
            self.role = Role::Leader {
                holder: leadership.holder().to_string(),
                epoch: leadership.epoch(),
            };
            tracing::info!(target: crate::targets::EXECUTOR, holder = leadership.holder(), epoch = leadership.epoch(), "leading");
            self.leadership = Some(leadership);
        }
    }
}
