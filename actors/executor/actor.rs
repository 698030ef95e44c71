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
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::fast_map::IdMap;
use crate::procedure::{ProcId, ProcState};
use crate::record::{fingerprint, Failure, Nonce, RootNonce, StoreOp};

use crate::actors::locks::ResetEvent;
use crate::actors::procedure::{declare, Undeclarable};
use crate::actors::protocol::{
    AbortRequest, BypassRequest, Command, CommandRequest, DurableAck, Persist, Refuse, TreeAddr,
};
use crate::actors::root_stack::TreeRunner;
use crate::actors::shared::{now_ms, Shared, Waiting};

use super::api::{
    Abort, Answer, Answered, Bypass, Pause, ProcEvent, ProcInfo, RecentFailure, Resume, Rollback,
    Submit, Subscribe, SubscribeChannel, TreeFinished, TreeNews, WaitingOn,
};
use super::builder::Retention;
use super::leader::Role;

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

pub(super) type Waiter = oneshot::Sender<Result<Result<(), Failure>, Error>>;

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

/// Where a nonce's submit is. A `fingerprint` is that of the submission the nonce
/// was used for (`None` for a failure recorded for it, or a root recorded without one):
/// a submit with another fingerprint is a conflict.
pub(super) enum NonceState {
    /// Its insert is on its way to the store: later submits (and registrations) wait
    /// for the answer.
    Submitting {
        fingerprint: Option<NonZeroU32>,
        waiting: Vec<NonceWaiter>,
    },
    /// Reserved by the holder of the reservation `token`, who will submit, record a
    /// failure, or let go; later submits and registrations wait for which.
    Reserved {
        token: u64,
        waiting: Vec<NonceWaiter>,
    },
    /// The procedure exists (durably).
    Known {
        id: ProcId,
        fingerprint: Option<NonZeroU32>,
    },
}

/// A submit or registration waiting on a nonce.
pub(super) struct NonceWaiter {
    /// Told the answer, or `None` to try again (the nonce's reservation was let go).
    pub(super) answer: oneshot::Sender<Option<Result<ProcId, Error>>>,
    /// The fingerprint of the submission it carries; `None` for a registration.
    pub(super) fingerprint: Option<NonZeroU32>,
}

/// The answer to a request that names `nonce` with the fingerprint `asked` (`None`
/// for a registration, which carries no procedure), once the nonce is known to be
/// root `id`'s, submitted with the fingerprint `held`.
pub(super) fn nonce_answer(
    nonce: Nonce,
    id: ProcId,
    held: Option<NonZeroU32>,
    asked: Option<NonZeroU32>,
) -> Result<ProcId, Error> {
    match (held, asked) {
        (Some(held), Some(asked)) if held != asked => Err(Error::NonceConflict {
            nonce,
            existing: id,
        }),
        _ => Ok(id),
    }
}

/// Where a nonce stands for a request that names it.
pub(super) enum Turn {
    /// Its procedure exists: its id, or the conflict with it.
    Known(Result<ProcId, Error>),
    /// Another request holds it: wait for this answer.
    Wait(oneshot::Receiver<Option<Result<ProcId, Error>>>),
    /// This request may go on (the nonce is free, or it holds the reservation).
    Go,
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    pub(super) fn info(&self, id: ProcId) -> Option<ProcInfo> {
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
    pub(super) fn live_tree(&self, id: ProcId) -> Result<TreeAddr, Error> {
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
    pub(super) fn missing(&self, id: ProcId) -> Error {
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
        let mut held = None;
        if let Some(NonceState::Submitting {
            fingerprint,
            waiting,
        }) = self.nonces.remove(&nonce)
        {
            held = fingerprint;
            for waiter in waiting {
                let answer = match &result {
                    Ok(id) => nonce_answer(nonce, *id, held, waiter.fingerprint),
                    Err(e) => Err(e.duplicate()),
                };
                let _ = waiter.answer.send(Some(answer));
            }
        }
        if let Ok(id) = result {
            let known = NonceState::Known {
                id,
                fingerprint: held,
            };
            self.nonces.insert(nonce, known);
        }
    }

    /// Whether a request holding the reservation `token` (if any) goes on with `nonce`
    /// (it is free, or this request holds it), rather than being answered from the
    /// procedure the nonce names or waiting for it.
    pub(super) fn nonce_free(&self, nonce: Nonce, token: Option<u64>) -> bool {
        match self.nonces.get(&nonce) {
            None => true,
            Some(NonceState::Reserved { token: held, .. }) => Some(*held) == token,
            Some(_) => false,
        }
    }

    /// Where `nonce` stands for a request holding the reservation `token` (if any) and
    /// carrying a submission of the fingerprint `asked` (`None` for a registration).
    pub(super) fn nonce_turn(
        &mut self,
        nonce: Nonce,
        token: Option<u64>,
        asked: Option<NonZeroU32>,
    ) -> Turn {
        let waiting = match self.nonces.get_mut(&nonce) {
            None => return Turn::Go,
            Some(NonceState::Known { id, fingerprint }) => {
                return Turn::Known(nonce_answer(nonce, *id, *fingerprint, asked))
            }
            Some(NonceState::Reserved { token: held, .. }) if Some(*held) == token => {
                return Turn::Go
            }
            Some(NonceState::Reserved { waiting, .. } | NonceState::Submitting { waiting, .. }) => {
                waiting
            }
        };
        let (answer, rx) = oneshot::channel();
        waiting.push(NonceWaiter {
            answer,
            fingerprint: asked,
        });
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
        self.submit(msg, ctx).into_response()
    }
}

impl<E: Send + Sync + 'static> Handler<Answered<Submit<E>>> for ExecutorActor<E> {
    type Result = MessageResult<Answered<Submit<E>>>;

    fn handle(&mut self, msg: Answered<Submit<E>>, ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.submit(msg.0, ctx))
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Takes a submit: answered once the root's insert is durable, or at once when it
    /// is refused or its nonce is known.
    fn submit(&mut self, msg: Submit<E>, ctx: &mut Context<Self>) -> Answer<ProcId> {
        if let Some(refusal) = self.refusal() {
            return Answer::Now(Err(refusal));
        }
        if let Some(nonce) = msg.nonce {
            // What this submit carries, to compare with what the nonce was used for:
            // encoded here only when the nonce is not free (a free one's is taken
            // from the root's encoding as it starts).
            let asked = if self.nonce_free(nonce, msg.reservation) {
                None
            } else {
                match self.shared.registry.encode(&*msg.proc) {
                    Ok((type_name, state)) => Some(fingerprint(type_name, &state)),
                    Err(e) => return Answer::Now(Err(Error::Registry(e))),
                }
            };
            match self.nonce_turn(nonce, msg.reservation, asked) {
                Turn::Known(Ok(id)) => {
                    tracing::debug!(target: crate::targets::EXECUTOR, proc = %id, group = nonce.group, nonce = nonce.nonce, "submit with a known nonce: answered with its procedure");
                    return Answer::Now(Ok(id));
                }
                Turn::Known(Err(conflict)) => {
                    tracing::info!(target: crate::targets::EXECUTOR, group = nonce.group, nonce = nonce.nonce, error = %conflict, "submit refused: its nonce names another submission");
                    return Answer::Now(Err(conflict));
                }
                Turn::Wait(answer) => {
                    tracing::debug!(target: crate::targets::EXECUTOR, group = nonce.group, nonce = nonce.nonce, "submit with a nonce being submitted: answered with its procedure once durable");
                    let executor = ctx.address();
                    return Answer::spawned(async move {
                        match answer.await {
                            Ok(Some(answer)) => answer,
                            // Let go by its reservation: this submit tries again, as
                            // if it had come just now.
                            Ok(None) => executor.send(Answered(msg)).await?.get().await,
                            Err(_) => Err(Error::Stopped),
                        }
                    });
                }
                Turn::Go => {}
            }
        }
        if self.unfinished >= self.max_unfinished {
            let limit = self.max_unfinished;
            return Answer::Now(Err(Error::Overloaded { limit }));
        }
        let nonce = msg.nonce;
        let answer = match self.start_root(msg) {
            Ok(answer) => answer,
            Err(e) => return Answer::Now(Err(e)),
        };
        let Some(nonce) = nonce else {
            return Answer::Later(answer);
        };
        // Settled before the caller hears, even if the caller stops waiting.
        Answer::spawned(settle_nonce(
            ctx.address(),
            nonce,
            Answer::Later(answer).get(),
        ))
    }

    /// Names and encodes the submitted root (its nonce, if any, now submitting) and
    /// starts its tree; the answer comes once its insert is durable.
    fn start_root(
        &mut self,
        msg: Submit<E>,
    ) -> Result<oneshot::Receiver<Result<ProcId, Error>>, Error> {
        let mut root = declare(&self.shared, &*msg.proc, now_ms()).map_err(|e| match e {
            Undeclarable::Registry(e) => Error::Registry(e),
            Undeclarable::Invalid(e) => Error::Invalid(e.to_string()),
        })?;
        if let Some(nonce) = msg.nonce {
            let fingerprint = Some(fingerprint(root.type_name, &root.data));
            root.nonce = Some(RootNonce { nonce, fingerprint });
            // The requests waiting on its reservation, if it had one, now wait on it.
            let waiting = match self.nonces.remove(&nonce) {
                Some(NonceState::Reserved { waiting, .. }) => waiting,
                _ => Vec::new(),
            };
            let submitting = NonceState::Submitting {
                fingerprint,
                waiting,
            };
            self.nonces.insert(nonce, submitting);
        }
        let shared = self.shared.clone();
        let (ack, rx) = oneshot::channel();
        let proc = msg.proc;
        self.unfinished += 1;
        let tree = self.shared.new_tree(root.id);
        tree.start(TreeRunner::submit(shared, tree.clone(), root, proc, ack));
        Ok(rx)
    }
}

/// The answer to a submit with a nonce: `answer`, once the executor has settled the
/// nonce with it ([`NonceSettled`]).
async fn settle_nonce<E: Send + Sync + 'static>(
    executor: Addr<ExecutorActor<E>>,
    nonce: Nonce,
    answer: impl Future<Output = Result<ProcId, Error>> + 'static,
) -> Result<ProcId, Error> {
    let result = answer.await;
    let settled = result.as_ref().map(|id| *id).map_err(Error::duplicate);
    // Settled before the caller hears, so a retry after the answer finds the nonce
    // known. A stopped executor answers the waiting retries by dropping them.
    let _ = executor
        .send(NonceSettled {
            nonce,
            result: settled,
        })
        .await;
    result
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
                force: msg.force,
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
    pub(super) fn command(
        &self,
        id: ProcId,
        command: Command,
    ) -> ResponseFuture<Result<(), Error>> {
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

impl<E: Send + Sync + 'static> Handler<Resume> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Resume, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Continue)
    }
}

impl<E: Send + Sync + 'static> Handler<Rollback> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<(), Error>>;

    fn handle(&mut self, msg: Rollback, _ctx: &mut Context<Self>) -> Self::Result {
        self.command(msg.0, Command::Rollback)
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
    pub(super) fn dispatcher(
        &self,
    ) -> Result<Addr<crate::actors::remote::RemoteDispatcher>, Error> {
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
