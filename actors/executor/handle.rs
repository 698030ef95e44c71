//! [`Executor`], the handle on a running executor that users hold: cheap to clone and
//! `Send`, with an async method per request, each a message to the executor actor, and
//! [`Subscription`], the stream [`Executor::subscribe`] gives. The invariant it guards:
//! an executor that started its own actix system stops that system's thread, on
//! shutdown or when its last handle goes.

use std::marker::PhantomData;
use std::sync::Arc;

use actix::prelude::*;
use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

use crate::error::{Error, WaitError};
use crate::output::ProducesOutput;
use crate::procedure::{ProcId, Procedure};
use crate::record::{Failure, Nonce};

use crate::actors::locks::{ResetEvent, WakeEvent};
use crate::actors::scheduler::{GetSchedulerStats, SchedulerStats};

use super::actor::ExecutorActor;
use super::api::{
    Abort, AckResult, Answer, Answered, Bypass, GetState, List, Pause, ProcEvent, ProcInfo, Resume,
    Rollback, Shutdown, Submit, SubscribeChannel, WaitFor, WaitValue,
};
use super::builder::ExecutorBuilder;
use super::front::Front;
use super::leader::{GetRole, Role};
use super::nonces::{NonceRegistration, NonceReservation, RegisterNonce, Registered};
use super::recovered::Recovery;

impl From<MailboxError> for Error {
    fn from(_: MailboxError) -> Self {
        Error::Stopped
    }
}

/// The actix system an executor started for itself, and how to see its thread end.
pub(super) struct OwnedSystem {
    pub(super) gone: std::sync::Mutex<Option<(oneshot::Receiver<()>, std::thread::JoinHandle<()>)>>,
    /// Asks the executor to shut down (gracefully), for when the last handle goes.
    pub(super) stop: Box<dyn Fn() + Send + Sync>,
}

impl Drop for OwnedSystem {
    /// The last handle went without a shutdown: the engine shuts down on its own
    /// threads (as `shutdown` does, without anyone waiting), and its system thread then
    /// ends, releasing the store. Left running, nobody could reach it again, and it
    /// would hold the store (a WAL directory's lock) until the process ended.
    fn drop(&mut self) {
        let running = self.gone.get_mut().map_or(true, |g| g.is_some());
        if running {
            (self.stop)();
        }
    }
}

/// A handle on a running executor. Cheap to clone and `Send`: use it from actors or
/// from plain tokio tasks.
///
/// ```no_run
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure, Registry, Executor, MemoryStore};
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)] struct Noop;
/// # #[async_trait] impl Procedure for Noop {
/// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
/// #[actix::main]
/// async fn main() -> Result<(), proctor::Error> {
///     let mut registry = Registry::new();
///     registry.register::<Noop>("noop");
///     let executor = Executor::builder()
///         .registry(registry)
///         .store(MemoryStore::new())
///         .start()
///         .await?;
///     let id = executor.submit(Noop).await?;
///     assert!(executor.wait(id).await?.is_ok());
///     Ok(())
/// }
/// ```
///
/// `E` is the environment its procedures get (see [`Procedure`](crate::Procedure)).
pub struct Executor<E = ()>
where
    E: Send + Sync + 'static,
{
    /// The running actor, or a standby's wait for the lease.
    pub(super) front: Arc<Front<E>>,
    /// Set when the executor runs its own actix system (started outside one).
    pub(super) system: Option<Arc<OwnedSystem>>,
}

impl<E: Send + Sync + 'static> Clone for Executor<E> {
    fn clone(&self) -> Self {
        Executor {
            front: self.front.clone(),
            system: self.system.clone(),
        }
    }
}

impl<E: Send + Sync + 'static> std::fmt::Debug for Executor<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field(
                "connected",
                &self.front.actor().is_ok_and(actix::Addr::connected),
            )
            .field("own_system", &self.system.is_some())
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> Executor<E> {
    /// A builder with the defaults, for an executor whose procedures take an
    /// environment of type `E` (see [`Procedure`]). `E` is fixed by the registry
    /// ([`ExecutorBuilder::registry`]) or the environment ([`ExecutorBuilder::env`]),
    /// whichever comes first, or named here: `Executor::<Cluster>::builder()`; an
    /// executor without an environment is an `Executor<()>`.
    ///
    /// ```
    /// use proctor::{Executor, MemoryStore, Registry};
    /// struct Cluster;
    /// // The environment first, then the registry: the registry's type fixes `E`.
    /// let builder = Executor::builder()
    ///     .env(Cluster)
    ///     .registry(Registry::new())
    ///     .store(MemoryStore::new());
    /// # let _ = builder;
    /// ```
    pub fn builder() -> ExecutorBuilder<E> {
        ExecutorBuilder::default()
    }
    /// What recovery found when the executor started (nothing, on a standby that
    /// does not lead yet).
    pub fn recovery(&self) -> &Recovery {
        self.front.report()
    }

    /// The executor actor, for sending the messages directly.
    ///
    /// # Errors
    /// [`Error::NotLeader`] on a standby that does not lead yet (see
    /// [`ExecutorBuilder::start_standby`]), or its start's error if it failed.
    pub fn addr(&self) -> Result<&Addr<ExecutorActor<E>>, Error> {
        self.front.actor()
    }

    /// Waits until this executor leads: at once for one that [`start`]ed; for a
    /// standby ([`ExecutorBuilder::start_standby`]), until it has taken the lease,
    /// loaded the store and recovered every tree.
    ///
    /// [`start`]: ExecutorBuilder::start
    ///
    /// # Errors
    /// The standby's start error (the database, the store), or [`Error::Stopped`] if it
    /// was shut down while it waited.
    pub async fn leading(&self) -> Result<(), Error> {
        self.front.leading().await
    }

    /// Submits a root procedure: `.await` it for the root's id, answered once its insert
    /// is durable; [`Submission::nonce`] first makes the submit idempotent, and
    /// [`Submission::typed`] answers a [`Submitted`] handle instead, which waits for
    /// the procedure's declared output ([`ProducesOutput`](crate::ProducesOutput)).
    ///
    /// ```no_run
    /// # use proctor::{Context, Flow, Nonce, ProcError, Procedure};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct Noop;
    /// # #[async_trait::async_trait] impl Procedure for Noop {
    /// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// let id = executor.submit(Noop).await?;
    /// let key = Nonce::from_key("create-table t1"); // an Idempotency-Key, say
    /// let again = executor.submit(Noop).nonce(key).await?;
    /// assert_eq!(again, executor.submit(Noop).nonce(key).await?); // ran once
    /// # let _ = id; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::NonceConflict`] for a nonce already used for another procedure or
    /// other arguments; [`Error::Stopped`] once a shutdown has begun; [`Error::Store`] or
    /// [`Error::Internal`] once the store has failed or the engine broke (this insert's
    /// failure included); [`Error::Overloaded`] at
    /// [`ExecutorBuilder::max_unfinished`] unfinished roots; [`Error::Registry`] if its
    /// type is not registered or its state does not serialize; [`Error::Invalid`] for a
    /// bad resource name in its locks or a panic in `locks`, `holds_lock` or
    /// `timeout_ms`.
    pub fn submit<P: Procedure<E>>(&self, proc: P) -> Submission<'_, E, P> {
        Submission {
            executor: self,
            submit: Submit::new(proc),
            proc: PhantomData,
        }
    }

    /// Submits a boxed root procedure, as [`submit`](Self::submit) does: for code that
    /// picks the procedure's type at run time.
    ///
    /// ```no_run
    /// # use proctor::{Context, Flow, ProcError, Procedure};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct Noop;
    /// # #[async_trait::async_trait] impl Procedure for Noop {
    /// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// let proc: Box<dyn Procedure> = Box::new(Noop);
    /// let id = executor.submit_boxed(proc).await?;
    /// # let _ = id; Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`submit`](Self::submit).
    pub fn submit_boxed(&self, proc: Box<dyn Procedure<E>>) -> Submission<'_, E> {
        Submission {
            executor: self,
            submit: Submit::boxed(proc),
            proc: PhantomData,
        }
    }

    /// Submits a root procedure at most once per `nonce`: a retry with the same nonce
    /// and the same procedure (concurrent, or after a restart) answers the first
    /// submit's id and runs nothing. The same as `submit(proc).nonce(nonce)`
    /// ([`Submission::nonce`]).
    ///
    /// # Errors
    ///
    /// As [`submit`](Self::submit): [`Error::NonceConflict`] if the nonce was used for
    /// another procedure or other arguments. A retry that comes while the first submit
    /// is on its way gets that submit's answer, error included; a failed submit frees
    /// the nonce.
    pub async fn submit_with_nonce(
        &self,
        proc: impl Procedure<E>,
        nonce: Nonce,
    ) -> Result<ProcId, Error> {
        self.submit(proc).nonce(nonce).await
    }

    /// What this executor is to its store: [`Role::Alone`] without a leader lease,
    /// [`Role::Standby`] while it waits for one, [`Role::Leader`] while it holds one,
    /// [`Role::SteppedDown`] once it lost it (see
    /// [`ExecutorBuilder::leadership`](crate::ExecutorBuilder)).
    ///
    /// # Errors
    /// [`Error::Stopped`] after shutdown.
    pub async fn role(&self) -> Result<Role, Error> {
        if let Some(standby) = self.front.standby_role() {
            return standby;
        }
        Ok(self.front.actor()?.send(GetRole).await?)
    }

    /// Reserves `nonce` before the procedure is built (HBase's `registerNonce`):
    /// [`NonceRegistration::Known`] with the procedure a request with this nonce
    /// created (submitted, or a failure recorded for it; a registration carries no
    /// procedure, so it is never a conflict), or
    /// [`NonceRegistration::Reserved`] — the caller holds the nonce, and every other
    /// request with it waits until the caller submits, records a failure or lets go
    /// (see [`NonceReservation`]). Waits itself while another request holds the nonce.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown; [`Error::Store`] or [`Error::Internal`] once
    /// the store has failed or the engine broke; the error of the submit it waited for.
    pub async fn register_nonce(&self, nonce: Nonce) -> Result<NonceRegistration<E>, Error> {
        Ok(
            match self.front.actor()?.send(RegisterNonce(nonce)).await?? {
                Registered::Known(id) => NonceRegistration::Known(id),
                Registered::Reserved(token) => {
                    NonceRegistration::Reserved(NonceReservation::new(nonce, token, self.clone()))
                }
            },
        )
    }

    /// Asks a procedure to abort. `Ok(true)` once it has accepted and its failure is
    /// durable (its tree then rolls back, even across a crash), `Ok(false)` if it
    /// refused. If the store fails first, the answer is that error and the abort did not
    /// happen.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::Finished`] if it has finished; [`Error::Refused`] past
    /// its tree's point of no return ([`Context::set_irreversible`](crate::Context::set_irreversible)),
    /// also when the tree passes it while the abort waits for a running step: the
    /// procedure is then paused instead, for an operator to continue; [`Error::Store`]
    /// or [`Error::Internal`] once the store has failed or the engine broke;
    /// [`Error::Stopped`] after shutdown.
    pub async fn abort(&self, id: ProcId) -> Result<bool, Error> {
        self.front.actor()?.send(Abort(id)).await?
    }

    /// Stops live procedure `id`'s actor as a crash of that one actor would (with
    /// `panic`, by a panic in its handler, else by stopping it), for tests of its
    /// supervision: its root stack starts it again from the state it last reported,
    /// and a step it was in runs again. Only with the `perturb` feature.
    #[cfg(feature = "perturb")]
    #[doc(hidden)]
    pub async fn kill_procedure_actor(&self, id: ProcId, panic: bool) -> Result<(), Error> {
        let kill = crate::actors::root_stack::KillProcedure { id, panic };
        self.front.actor()?.send(kill).await?
    }

    /// Bypasses a stuck procedure (HBCK2's `bypass`): it is marked SUCCESS without
    /// running further or rolling back, its locks are released, and its parent goes on
    /// as if it had succeeded (bypassing a root ends its tree). With `recursive`, its
    /// unfinished descendants are bypassed too; without, a procedure with unfinished
    /// children is refused. Only a procedure that waits (for children, an event, a
    /// deadline, or an operator: PAUSED) can be bypassed, not one queued or in a step
    /// ([`force_bypass`](Self::force_bypass) takes those), and not in a tree that is rolling back (ROLLBACK_PAUSED included): each refusal
    /// is [`Error::BypassRefused`] with the reason.
    /// Answers once the bypass is durable.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::Finished`] if it has finished; [`Error::BypassRefused`] as
    /// above; [`Error::Store`] or [`Error::Internal`] once the store has failed or the
    /// engine broke; [`Error::Stopped`] after shutdown.
    pub async fn bypass(&self, id: ProcId, recursive: bool) -> Result<(), Error> {
        let bypass = Bypass {
            id,
            recursive,
            force: false,
        };
        self.front.actor()?.send(bypass).await?
    }

    /// Bypasses a procedure stuck in a step (HBCK2's `bypass -o`): as
    /// [`bypass`](Self::bypass), and a procedure queued or in a step is taken too.
    /// Its step is dropped: a call in progress is dropped at its next `.await` (code
    /// between two awaits, or one blocking its thread, runs on until then), without a
    /// rollback, a report or its `completion_cleanup`; a queued one never runs; a wait
    /// for its locks is withdrawn, and the locks it holds are released. What the
    /// dropped step did stays done: bypass it only once its work has been finished, or
    /// made harmless, by hand.
    ///
    /// ```no_run
    /// # async fn stuck(executor: proctor::Executor, id: proctor::ProcId) -> Result<(), proctor::Error> {
    /// // A region assignment hangs on a node that will never answer; the operator
    /// // has opened the region by hand.
    /// executor.force_bypass(id, false).await?;
    /// assert_eq!(executor.wait(id).await?, Ok(()));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// As [`bypass`](Self::bypass), but for the refusal of a procedure queued or in a
    /// step.
    pub async fn force_bypass(&self, id: ProcId, recursive: bool) -> Result<(), Error> {
        let bypass = Bypass {
            id,
            recursive,
            force: true,
        };
        self.front.actor()?.send(bypass).await?
    }

    /// Pauses a procedure (PolarDB-X's `PAUSE DDL`) at its next step boundary: the
    /// step it is running (or is queued for) ends as usual, and the next one does not
    /// start; a waiting procedure pauses when it would run again. It is then PAUSED,
    /// persisted and holding its locks, until [`resume`](Self::resume) or
    /// [`rollback`](Self::rollback). Answers once PAUSED is durable.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] for a procedure that is not runnable or waiting (already
    /// paused, failed), in a tree rolling back, or that finished or whose tree failed
    /// before the pause took effect; as [`resume`](Self::resume) for a procedure not
    /// live, after shutdown or a store failure.
    pub async fn pause(&self, id: ProcId) -> Result<(), Error> {
        self.front.actor()?.send(Pause(id)).await?
    }

    /// Continues a paused procedure (PolarDB-X's `CONTINUE DDL`): a PAUSED one runs
    /// the step that failed again, from its recorded state, with its retries reset; a
    /// ROLLBACK_PAUSED one retries its rollback. Answers once that is durable.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] for a procedure in any other state, or PAUSED in a tree that
    /// has failed meanwhile (it is rolled back, not continued); [`Error::Finished`],
    /// [`Error::UnknownProcedure`] or [`Error::Gone`] for one not live; [`Error::Stopped`]
    /// after shutdown; the store's error once it has failed.
    #[doc(alias = "continue")]
    pub async fn resume(&self, id: ProcId) -> Result<(), Error> {
        self.front.actor()?.send(Resume(id)).await?
    }

    /// Rolls a procedure's tree back on an operator's word (`ROLLBACK DDL`). A PAUSED
    /// procedure fails ([`ProcError::Aborted`](crate::ProcError::Aborted)) and its tree
    /// rolls back, starting with the step that failed, which may have left effects.
    /// Any other live procedure is aborted as by [`abort`](Self::abort): a running
    /// step is cancelled, and the abort hook may refuse. Answers once the failure is
    /// durable.
    ///
    /// # Errors
    ///
    /// [`Error::Refused`] past the tree's point of no return
    /// ([`Context::set_irreversible`](crate::Context::set_irreversible): continue
    /// instead), for a procedure whose rollback is paused (continue it), in a tree
    /// already rolling back, or when the abort hook refuses; as [`resume`](Self::resume)
    /// for a procedure not live, after shutdown or a store failure.
    pub async fn rollback(&self, id: ProcId) -> Result<(), Error> {
        self.front.actor()?.send(Rollback(id)).await?
    }

    /// What the executor knows of a procedure now.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::Stopped`] after shutdown.
    pub async fn state(&self, id: ProcId) -> Result<ProcInfo, Error> {
        self.front.actor()?.send(GetState(id)).await?
    }

    /// Waits until the root procedure `id` has finished; its result is `Ok(())` for
    /// SUCCESS or the tree's original [`Failure`] for ROLLEDBACK.
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known; [`Error::NotRoot`] for a child; [`Error::Store`] or
    /// [`Error::Internal`] if the store fails or the engine breaks before the tree
    /// finishes; [`Error::Stopped`] if the executor stops first.
    pub async fn wait(&self, id: ProcId) -> Result<Result<(), Failure>, Error> {
        self.answered(WaitFor(id)).await
    }

    /// Sends `msg` to the actor and awaits its answer on this task ([`Answered`]).
    async fn answered<M, T>(&self, msg: M) -> Result<T, Error>
    where
        M: Send + 'static,
        T: Send + 'static,
        Answered<M>: Message<Result = Answer<T>>,
        ExecutorActor<E>: Handler<Answered<M>>,
        <ExecutorActor<E> as Actor>::Context: actix::dev::ToEnvelope<ExecutorActor<E>, Answered<M>>,
    {
        self.front.actor()?.send(Answered(msg)).await?.get().await
    }

    /// Waits like [`wait`](Self::wait) and returns the value a step of the root set
    /// with [`Context::set_result`](crate::Context::set_result) (the last one set),
    /// decoded as a `T`.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor, id: proctor::ProcId) -> Result<(), proctor::WaitError> {
    /// let region_count: u32 = executor.wait_value(id).await?;
    /// println!("created {region_count} regions");
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`WaitError::Failed`] with the tree's failure if it rolled back;
    /// [`WaitError::NoValue`] if it succeeded without setting one; [`WaitError::Gone`]
    /// for a procedure no longer known (also if its result is evicted before the value
    /// is read); [`WaitError::Engine`] with the error [`wait`](Self::wait) gives
    /// otherwise, or [`Error::ValueType`] if the value does not decode as `T`.
    pub async fn wait_value<T: serde::de::DeserializeOwned + Send + 'static>(
        &self,
        id: ProcId,
    ) -> Result<T, WaitError> {
        self.front
            .actor()?
            .send(WaitValue::new(id))
            .await
            .map_err(Error::from)?
    }

    /// Tells the executor the client has its result: it is evicted after the shorter
    /// retention ([`ExecutorBuilder::retention_after_ack`]).
    ///
    /// # Errors
    ///
    /// [`Error::UnknownProcedure`] for an id never issued, [`Error::Gone`] for one no
    /// longer known (evicted already); [`Error::NotRoot`] for a child;
    /// [`Error::NotFinished`] before the tree finishes; [`Error::Stopped`] after
    /// shutdown.
    pub async fn ack_result(&self, id: ProcId) -> Result<(), Error> {
        self.front.actor()?.send(AckResult(id)).await?
    }

    /// What the scheduler is doing: workers (with any extra), running and queued steps,
    /// lock holders and waiters.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn scheduler_stats(&self) -> Result<SchedulerStats, Error> {
        self.front.actor()?.send(GetSchedulerStats).await?
    }

    /// The execution stack of the live tree `id` is in (any of its procedures), and
    /// for a tree that rolls back, the steps undone so far, in order.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor, id: proctor::ProcId) -> Result<(), proctor::Error> {
    /// let tree = executor.tree(id).await?;
    /// if tree.rolling_back {
    ///     println!("{} undone so far: {:?}", tree.root, tree.rolled_back);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Finished`] once the tree has finished; [`Error::UnknownProcedure`],
    /// [`Error::Gone`] as [`state`](Self::state); [`Error::Stopped`] after shutdown.
    pub async fn tree(&self, id: ProcId) -> Result<crate::TreeInfo, Error> {
        self.front
            .actor()?
            .send(crate::messages::GetTree(id))
            .await?
    }

    /// The engine's locks: each resource held, waited for or counted, with its holders
    /// and its queue in the order it is served; the wait-for cycles left standing;
    /// and the latest cycles the engine broke (failing a waiter) or lent through.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// for r in executor.locks().await?.resources {
    ///     println!("{}: held by {:?}, queue {:?}", r.resource, r.holders, r.waiters);
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn locks(&self) -> Result<crate::LockReport, Error> {
        self.front.actor()?.send(crate::messages::GetLocks).await?
    }

    /// The engine for operators: what its store says of itself (for the WAL: its
    /// segments, their bytes, the live bytes and the size bound), the group commit's
    /// batches since the start, and the latest trees that rolled back.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// let status = executor.engine_status().await?;
    /// println!("{} records per batch", status.commits.mean_records());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown or once the store's writer has stopped.
    pub async fn engine_status(&self) -> Result<crate::EngineStatus, Error> {
        self.front
            .actor()?
            .send(crate::messages::GetEngineStatus)
            .await?
    }

    /// The procedures that pass `which` (see [`List`]), in id order: by default every
    /// unfinished one.
    ///
    /// # Errors
    ///
    /// [`Error::Store`] or [`Error::Internal`] once the store has failed or the engine
    /// broke; [`Error::Stopped`] after shutdown.
    pub async fn list(&self, which: List) -> Result<Vec<ProcInfo>, Error> {
        self.front.actor()?.send(which).await?
    }

    /// One page of the procedures `which` matches, newest first (see [`ListPage`](crate::ListPage)):
    /// only the page's procedures are described, however many match.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// let waiting = proctor::List::new().state(proctor::ProcState::Waiting);
    /// let page = executor.list_page(waiting, 0, 100).await?;
    /// println!("{} of {}", page.procedures.len(), page.total);
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`list`](Self::list).
    pub async fn list_page(
        &self,
        which: List,
        offset: usize,
        limit: usize,
    ) -> Result<crate::ProcPage, Error> {
        self.front
            .actor()?
            .send(crate::ListPage::new(which, offset, limit))
            .await?
    }

    /// Subscribes to [`ProcEvent`]s: every root submitted or finishing, and every
    /// procedure pausing, from now on.
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// let mut events = executor.subscribe().await?;
    /// while let Some(event) = events.next().await {
    ///     if let proctor::ProcEvent::Finished { id, result, .. } = event {
    ///         println!("{id}: {result:?}");
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::Store`] or [`Error::Internal`] once the store has failed or the engine
    /// broke; [`Error::Stopped`] after shutdown.
    pub async fn subscribe(&self) -> Result<Subscription, Error> {
        let (tx, events) = tokio::sync::mpsc::unbounded_channel();
        if let Some(tx) = self.front.hold_subscriber(tx) {
            self.front.actor()?.send(SubscribeChannel(tx)).await??;
        }
        Ok(Subscription { events })
    }

    /// Hands the dispatcher a target's report of a remote operation (see
    /// [`Context::dispatch`](crate::Context::dispatch)): [`Report::ok`](crate::Report::ok) with its value,
    /// or [`Report::failed`](crate::Report::failed) with why it failed on the target. `Ok(true)` if it was
    /// taken; `Ok(false)` if it was ignored — the operation is unknown, already has an
    /// outcome, or was rolled back (targets may report twice).
    ///
    /// ```no_run
    /// # async fn f(executor: proctor::Executor, op: proctor::OpId) -> Result<(), proctor::Error> {
    /// executor.report(proctor::Report::ok(op, &"opened")?).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Config`] if the executor has no remote dispatcher
    /// ([`ExecutorBuilder::remote`]); [`Error::Stopped`] after shutdown.
    pub async fn report(&self, report: crate::Report) -> Result<bool, Error> {
        self.front.actor()?.send(report).await?
    }

    /// Declares `target` gone (HBase's `removeNode`): every remote operation queued
    /// for it or awaiting its report fails with
    /// [`RemoteError::TargetGone`](crate::RemoteError::TargetGone), and its
    /// procedure's next step decides (another target, or fail). Answers how many.
    ///
    /// # Errors
    /// As [`report`](Self::report).
    pub async fn remove_target(&self, target: impl Into<String>) -> Result<usize, Error> {
        self.front
            .actor()?
            .send(crate::messages::RemoveTarget(target.into()))
            .await?
    }

    /// Makes `event` ready and wakes the procedures suspended on it (see
    /// [`Flow::Suspend`](crate::Flow)); it stays ready until [`reset_event`](Self::reset_event).
    ///
    /// The waiters are handed to their trees oldest first, and each tree queues its
    /// procedure's next step with its shard's scheduler. Trees on the same shard queue
    /// them in that order, so under [`Scheduling::Fifo`](crate::Scheduling::Fifo) the
    /// oldest waiter's step is queued first; trees on different shards (see
    /// [`ExecutorBuilder::arbiters`]) run on different workers, and which of those
    /// steps runs first is not promised. A service that needs its woken procedures to
    /// run in order runs one shard, or orders them itself (one waiter that starts the
    /// next).
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn wake_event(&self, event: impl Into<String>) -> Result<(), Error> {
        Ok(self.front.actor()?.send(WakeEvent(event.into())).await?)
    }

    /// Makes `event` not ready again: later suspensions on it wait for the next wake.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] after shutdown.
    pub async fn reset_event(&self, event: impl Into<String>) -> Result<(), Error> {
        Ok(self.front.actor()?.send(ResetEvent(event.into())).await?)
    }

    /// Stops the executor gracefully: new submits are refused, no new step or rollback
    /// starts, the running ones end and their records become durable (within
    /// [`ExecutorBuilder::drain_timeout`]); then the arbiters and the store writer stop
    /// and the store (and its directory lock) is released. Unfinished procedures go on
    /// from their last record when an executor starts on the store again.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] if the executor had already stopped.
    pub async fn shutdown(self) -> Result<(), Error> {
        self.stop(Shutdown::graceful()).await
    }

    /// Stops the executor at once: steps still running are cut off, exactly as by a
    /// crash; what is durable is what the next executor recovers. For tests.
    ///
    /// # Errors
    ///
    /// [`Error::Stopped`] if the executor had already stopped.
    pub async fn shutdown_now(self) -> Result<(), Error> {
        self.stop(Shutdown::now()).await
    }

    async fn stop(self, how: Shutdown) -> Result<(), Error> {
        let stopped = match self.front.stop() {
            Some(addr) => addr.send(how).await,
            // A standby stops waiting.
            None => Ok(()),
        };
        // An executor started outside actix also ends the system thread it started.
        let gone = self
            .system
            .as_ref()
            .and_then(|s| s.gone.lock().ok()?.take());
        if let Some((gone, thread)) = gone {
            let _ = gone.await;
            let _ = thread.join();
        }
        Ok(stopped?)
    }
}

/// A stream of [`ProcEvent`]s from [`Executor::subscribe`]. Unbounded: read it, or
/// drop it.
#[derive(Debug)]
pub struct Subscription {
    events: tokio::sync::mpsc::UnboundedReceiver<ProcEvent>,
}

impl Subscription {
    /// The next event; `None` once the executor has stopped.
    pub async fn next(&mut self) -> Option<ProcEvent> {
        self.events.recv().await
    }
}

/// A [`Subscription`] is a `futures` stream too, for `StreamExt`'s combinators:
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// use futures_util::StreamExt;
/// let finished = executor
///     .subscribe()
///     .await?
///     .filter(|e| std::future::ready(matches!(e, proctor::ProcEvent::Finished { .. })))
///     .take(10);
/// # let _ = finished;
/// # Ok(())
/// # }
/// ```
impl futures_util::Stream for Subscription {
    type Item = ProcEvent;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<ProcEvent>> {
        self.events.poll_recv(cx)
    }
}

/// A submit on its way ([`Executor::submit`]): `.await` it for the root's id, or
/// [`typed`](Self::typed) for a [`Submitted`] handle. `P` is the procedure's type
/// (a boxed procedure's, for [`Executor::submit_boxed`]).
#[must_use = "a submission does nothing until it is awaited"]
pub struct Submission<'a, E: Send + Sync + 'static = (), P = Box<dyn Procedure<E>>> {
    executor: &'a Executor<E>,
    submit: Submit<E>,
    proc: PhantomData<fn() -> P>,
}

impl<E: Send + Sync + 'static, P> std::fmt::Debug for Submission<'_, E, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submission")
            .field("submit", &self.submit)
            .finish_non_exhaustive()
    }
}

impl<'a, E: Send + Sync + 'static, P: ProducesOutput> Submission<'a, E, P> {
    /// Submits as `.await` does, and answers a [`Submitted`] handle on the root: its
    /// id, and [`Submitted::wait`] for the procedure's output, of the type it declares
    /// ([`ProducesOutput`]). With a nonce, call [`nonce`](Self::nonce) first.
    ///
    /// ```
    /// use proctor::{async_trait, Executor, MemoryStore, Nonce, ProcError, Registry, Saga,
    ///               SagaContext, SagaProcedure, Undoing};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct CreateTable { name: String }
    ///
    /// #[async_trait]
    /// impl SagaProcedure for CreateTable {
    ///     type Output = u32; // the regions it created
    ///     async fn run(&self, ctx: &mut SagaContext<'_>) -> Result<u32, ProcError> {
    ///         ctx.step("regions", || async { Ok(3) }, |_: Undoing<u32>| async { Ok(()) })
    ///             .await
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let mut registry = Registry::new();
    /// registry.register_saga::<CreateTable>("create_table");
    /// let executor = Executor::builder()
    ///     .registry(registry)
    ///     .store(MemoryStore::new())
    ///     .start()
    ///     .await?;
    /// let created = executor
    ///     .submit(Saga::new(CreateTable { name: "users".into() }))
    ///     .nonce(Nonce::from_key("create users"))
    ///     .typed()
    ///     .await?;
    /// println!("creating users as procedure {}", created.id());
    /// let regions = created.wait().await??; // a u32: the saga's output
    /// assert_eq!(regions, 3);
    /// executor.shutdown().await?;
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    /// As [`Executor::submit`].
    pub fn typed(self) -> BoxFuture<'a, Result<Submitted<P::Output, E>, Error>> {
        let Submission {
            executor, submit, ..
        } = self;
        Box::pin(async move {
            let id = executor.answered(submit).await?;
            Ok(Submitted {
                id,
                executor: executor.clone(),
                output: PhantomData,
            })
        })
    }
}

impl<E: Send + Sync + 'static, P> Submission<'_, E, P> {
    /// Makes the submit idempotent: another submit with the same nonce and the same
    /// procedure — its registered type and its initial state, as encoded — concurrent
    /// or after a restart, answers this one's id and runs nothing, for as long as the
    /// nonce is remembered ([`ExecutorBuilder::nonce_retention`]). A submit with the
    /// same nonce and another procedure or other arguments is refused with
    /// [`Error::NonceConflict`]: a nonce names one submission, and a new request needs
    /// a new one. A retry that comes while the first submit is on its way gets that
    /// submit's answer (or the conflict with it), error included; a failed submit frees
    /// the nonce.
    ///
    /// The state is compared as it encodes: a field whose encoding depends on more
    /// than its value (a `HashMap`, whose order changes from process to process) can
    /// make a retry look like other arguments; use a `BTreeMap`.
    ///
    /// ```no_run
    /// # use proctor::{Context, Flow, ProcError, Procedure};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct CreateTable { name: String }
    /// # #[async_trait::async_trait] impl Procedure for CreateTable {
    /// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
    /// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
    /// use proctor::{Error, Nonce};
    /// let key = Nonce::from_key("req-7");
    /// let users = || CreateTable { name: "users".into() };
    /// let id = executor.submit(users()).nonce(key).await?;
    /// assert_eq!(executor.submit(users()).nonce(key).await?, id); // a retry
    /// let other = executor.submit(CreateTable { name: "orders".into() }).nonce(key).await;
    /// assert!(matches!(other, Err(Error::NonceConflict { existing, .. }) if existing == id));
    /// # Ok(()) }
    /// ```
    pub fn nonce(mut self, nonce: Nonce) -> Self {
        self.submit = self.submit.with_nonce(nonce);
        self
    }
}

impl<'a, E: Send + Sync + 'static, P> std::future::IntoFuture for Submission<'a, E, P> {
    type Output = Result<ProcId, Error>;
    type IntoFuture = BoxFuture<'a, Result<ProcId, Error>>;

    fn into_future(self) -> Self::IntoFuture {
        let Submission {
            executor, submit, ..
        } = self;
        Box::pin(executor.answered(submit))
    }
}

/// A submitted root whose output type is known ([`Submission::typed`]): its id, and
/// [`wait`](Self::wait) for its output as a `T`, the type its procedure declares
/// ([`ProducesOutput`]). Cheap to clone; it holds a handle on the executor.
pub struct Submitted<T, E: Send + Sync + 'static = ()> {
    id: ProcId,
    executor: Executor<E>,
    output: PhantomData<fn() -> T>,
}

impl<T, E: Send + Sync + 'static> Clone for Submitted<T, E> {
    fn clone(&self) -> Self {
        Submitted {
            id: self.id,
            executor: self.executor.clone(),
            output: PhantomData,
        }
    }
}

impl<T, E: Send + Sync + 'static> std::fmt::Debug for Submitted<T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submitted")
            .field("id", &self.id)
            .field("output", &std::any::type_name::<T>())
            .finish_non_exhaustive()
    }
}

impl<T, E> Submitted<T, E>
where
    T: DeserializeOwned + Send + 'static,
    E: Send + Sync + 'static,
{
    /// The root's id (for [`Executor::state`], [`Executor::abort`], ...).
    pub fn id(&self) -> ProcId {
        self.id
    }

    /// Waits until the root has finished, as [`Executor::wait`] does: `Ok(value)`, its
    /// output, for SUCCESS; the tree's original [`Failure`] for ROLLEDBACK. An output
    /// of `()` or `Option<_>` the procedure did not set is `()` or `None`.
    ///
    /// ```no_run
    /// # async fn f(created: proctor::Submitted<u32>) -> Result<(), Box<dyn std::error::Error>> {
    /// match created.wait().await? {
    ///     Ok(regions) => println!("created with {regions} regions"),
    ///     Err(failure) => println!("rolled back: {failure}"),
    /// }
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    ///
    /// [`Error::ValueType`] if the value does not decode as `T` (its reason names `T`,
    /// the declared output), or the procedure set none and `T` is not `()` or an
    /// `Option`; [`Error::Gone`] if the result was evicted first (see
    /// [`ExecutorBuilder::retention`]); otherwise as [`Executor::wait`].
    pub async fn wait(&self) -> Result<Result<T, Failure>, Error> {
        let declared = || std::any::type_name::<T>();
        match self.executor.wait_value::<T>(self.id).await {
            Ok(value) => Ok(Ok(value)),
            Err(WaitError::Failed(failure)) => Ok(Err(failure)),
            // Unset: what MessagePack's nil decodes as (`()`, `None`), if anything.
            Err(WaitError::NoValue(id)) => match rmp_serde::from_slice::<T>(&[0xc0]) {
                Ok(value) => Ok(Ok(value)),
                Err(_) => Err(Error::ValueType {
                    id,
                    reason: format!(
                        "it set none (Context::set_result), and its declared output `{}` \
                         is not `()` or an `Option`",
                        declared()
                    ),
                }),
            },
            Err(WaitError::Gone(id)) => Err(Error::Gone(id)),
            Err(WaitError::Engine(Error::ValueType { id, reason })) => Err(Error::ValueType {
                id,
                reason: format!("its declared output is `{}`: {reason}", declared()),
            }),
            Err(WaitError::Engine(e)) => Err(e),
        }
    }
}
