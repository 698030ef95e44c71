//! The public messages the executor actor takes ([`Submit`], [`Abort`], [`Bypass`],
//! [`Pause`], [`Resume`], [`Rollback`], [`GetState`], [`WaitFor`], [`WaitValue`], [`GetValue`],
//! [`AckResult`], [`List`], [`Shutdown`], [`Subscribe`]) and what it answers or sends
//! with them ([`ProcInfo`], [`WaitingOn`], [`ProcEvent`]), for code that talks to
//! actors; [`Executor`]'s methods send the same messages. Each message's `Result` is
//! the answer its handler in `actor.rs` gives, and the one its method returns.

use std::marker::PhantomData;

use actix::prelude::*;

use crate::erased::{erase, erase_boxed, DynProc};
use crate::error::{Error, WaitError};
use crate::locks::Lock;
use crate::procedure::{ProcId, ProcState, Procedure};
use crate::record::{Failure, Nonce, Paused, Steering};

// For the docs' links only.
#[cfg(doc)]
use super::{Executor, ExecutorBuilder};
#[cfg(doc)]
use crate::ready_queue::Scheduling;

/// What a waiting procedure waits for (see [`ProcInfo::waiting_on`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaitingOn {
    /// Its children to finish.
    Children,
    /// The named event to be woken ([`Executor::wake_event`]).
    Event(String),
    /// Its timer: it runs again at this time (ms since the Unix epoch).
    Timer {
        /// When.
        at_ms: u64,
    },
    /// The engine locks in [`ProcInfo::locks_waiting`].
    Locks,
}

/// A snapshot of one procedure.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ProcInfo {
    /// The procedure.
    pub id: ProcId,
    /// The root of its tree.
    pub root: ProcId,
    /// Its parent, `None` for a root.
    pub parent: Option<ProcId>,
    /// Its registered type name.
    pub type_name: &'static str,
    /// Its state.
    pub state: ProcState,
    /// Its recorded steps not rolled back (as `proctor procs` shows them); `None` once
    /// it has finished (its final record keeps no steps).
    pub steps: Option<u32>,
    /// When it was submitted, ms since the Unix epoch.
    pub submitted_ms: u64,
    /// When its state last changed, ms since the Unix epoch.
    pub updated_ms: u64,
    /// For a finished root: its result.
    pub result: Option<Result<(), Failure>>,
    /// The engine locks it holds now (see [`Procedure::locks`](crate::Procedure::locks)).
    pub locks_held: Vec<Lock>,
    /// The engine locks it is waiting for (all granted together).
    pub locks_waiting: Vec<Lock>,
    /// The name of the state it is in ([`Procedure::state_name`]; for a
    /// [`StateMachine`](crate::StateMachine), its current state), as of its latest step
    /// that left it waiting, paused, failed or finished; while it runs on from step to
    /// step, at most a second old. `None` for a root before any of those.
    pub state_name: Option<String>,
    /// What it waits for, when it is not queued or running: children, an event, its
    /// timer, or engine locks.
    pub waiting_on: Option<WaitingOn>,
    /// What failure policies and operators did to it: retries spent on its current
    /// step, why it is PAUSED or ROLLBACK_PAUSED, whether it passed its point of no
    /// return.
    pub steering: Steering,
    /// For a RUNNABLE procedure under [`Scheduling::Fair`]: the level of the fair queue
    /// its steps are queued on (0 to 4, by its tree's accumulated step time: from 0, 1,
    /// 10, 60 and 300 s); `None` otherwise.
    pub queue_level: Option<u8>,
    /// An operator bypassed it ([`Executor::bypass`], or `proctor bypass` on a stopped
    /// engine): it was marked finished without running to its end.
    pub bypassed: bool,
}

/// Submit a root procedure; answers its id once the insert is durable.
///
/// ```
/// # use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// # #[derive(serde::Serialize)] struct Noop;
/// # #[async_trait] impl Procedure for Noop {
/// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
/// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
/// let submit = proctor::messages::Submit::new(Noop).with_nonce(proctor::Nonce { group: 7, nonce: 42 });
/// # let _ = submit;
/// ```
pub struct Submit<E = ()> {
    pub(super) proc: DynProc,
    pub(super) nonce: Option<Nonce>,
    /// The token of the nonce's reservation this submit holds, if it holds one.
    pub(super) reservation: Option<u64>,
    env: PhantomData<fn() -> E>,
}

impl<E> std::fmt::Debug for Submit<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submit")
            .field("nonce", &self.nonce)
            .finish_non_exhaustive()
    }
}

impl<E: Send + Sync + 'static> Submit<E> {
    /// Boxes the procedure.
    pub fn new(proc: impl Procedure<E>) -> Self {
        Submit {
            proc: erase(proc),
            nonce: None,
            reservation: None,
            env: PhantomData,
        }
    }

    /// An already boxed procedure.
    pub fn boxed(proc: Box<dyn Procedure<E>>) -> Self {
        Submit {
            proc: erase_boxed(proc),
            nonce: None,
            reservation: None,
            env: PhantomData,
        }
    }

    /// Makes the submit idempotent: another submit with the same nonce and the same
    /// procedure (type and initial state) — concurrent, or after a restart — answers
    /// this one's id and runs nothing, for as long as the nonce is remembered; one with
    /// another procedure or other arguments is refused with
    /// [`Error::NonceConflict`] (see [`Submission::nonce`](crate::Submission::nonce)).
    #[must_use]
    pub fn with_nonce(mut self, nonce: Nonce) -> Self {
        self.nonce = Some(nonce);
        self
    }
}

impl<E> Message for Submit<E> {
    type Result = Result<ProcId, Error>;
}

/// Abort a procedure; answers whether it accepted.
#[derive(Clone, Copy, Debug)]
pub struct Abort(pub ProcId);

impl Message for Abort {
    type Result = Result<bool, Error>;
}

/// Bypass a stuck procedure (HBCK2's `bypass`); see [`Executor::bypass`].
#[derive(Clone, Copy, Debug)]
pub struct Bypass {
    /// The procedure.
    pub id: ProcId,
    /// Also bypass its unfinished descendants (required if it has any).
    pub recursive: bool,
    /// Take a procedure queued or in a step too, dropping its step (HBCK2's
    /// `bypass -o`); see [`Executor::force_bypass`].
    pub force: bool,
}

impl Message for Bypass {
    type Result = Result<(), Error>;
}

/// Pause a procedure at its next step; see [`Executor::pause`].
#[derive(Clone, Copy, Debug)]
pub struct Pause(pub ProcId);

impl Message for Pause {
    type Result = Result<(), Error>;
}

/// Resume a PAUSED or ROLLBACK_PAUSED procedure; see [`Executor::resume`].
#[derive(Clone, Copy, Debug)]
pub struct Resume(pub ProcId);

impl Message for Resume {
    type Result = Result<(), Error>;
}

/// Roll a procedure's tree back on an operator's word; see [`Executor::rollback`].
#[derive(Clone, Copy, Debug)]
pub struct Rollback(pub ProcId);

impl Message for Rollback {
    type Result = Result<(), Error>;
}

/// What the executor knows of a procedure.
#[derive(Clone, Copy, Debug)]
pub struct GetState(pub ProcId);

impl Message for GetState {
    type Result = Result<ProcInfo, Error>;
}

/// A live tree's execution as an operator sees it ([`Executor::tree`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeInfo {
    /// The tree's root.
    pub root: ProcId,
    /// The execution stack, oldest step first: the procedure of each step the tree
    /// ran (a procedure once per step), which a rollback undoes newest first.
    pub stack: Vec<ProcId>,
    /// Whether the tree is rolling back.
    pub rolling_back: bool,
    /// The steps rolled back so far, in the order they were, since this engine loaded
    /// the tree.
    pub rolled_back: Vec<ProcId>,
}

/// The execution stack of the live tree a procedure is in.
#[derive(Clone, Copy, Debug)]
pub struct GetTree(pub ProcId);

impl Message for GetTree {
    type Result = Result<TreeInfo, Error>;
}

/// The engine's locks: each resource's holders and queue, and the cycles it handled.
#[derive(Clone, Copy, Debug)]
pub struct GetLocks;

impl Message for GetLocks {
    type Result = Result<crate::LockReport, Error>;
}

/// The engine's state for operators ([`Executor::engine_status`]): its store, its
/// group commit and its latest failures.
#[derive(Clone, Debug)]
pub struct EngineStatus {
    /// What the store says of itself (for the WAL: segments, bytes, live bytes and the
    /// size bound).
    pub store: crate::StoreStatus,
    /// The group commit since the engine started.
    pub commits: crate::CommitStats,
    /// The latest trees that rolled back, oldest first (at most 32).
    pub recent_failures: Vec<RecentFailure>,
}

/// A tree that rolled back, as [`EngineStatus::recent_failures`] keeps it.
#[derive(Clone, Debug)]
pub struct RecentFailure {
    /// When it finished, in ms since the Unix epoch.
    pub at_ms: u64,
    /// Its root.
    pub root: ProcId,
    /// The root's registered type name.
    pub type_name: &'static str,
    /// The failure it rolled back for.
    pub failure: Failure,
}

/// The engine's store, group commit and latest failures.
#[derive(Clone, Copy, Debug)]
pub struct GetEngineStatus;

impl Message for GetEngineStatus {
    type Result = Result<EngineStatus, Error>;
}

/// A request the executor's handle sends, answered with an [`Answer`] that the
/// handle's own task awaits. The public messages are answered with a
/// `ResponseFuture`, which actix runs as a task of its own on the executor's arbiter
/// only to pass the answer on: two more tasks for every root submitted and waited for.
pub(crate) struct Answered<M>(pub(crate) M);

impl<E: Send + Sync + 'static> Message for Answered<Submit<E>> {
    type Result = Answer<ProcId>;
}

impl Message for Answered<WaitFor> {
    type Result = Answer<Result<(), Failure>>;
}

/// The executor's answer: given at once, or to come on a channel (a dropped channel is
/// [`Error::Stopped`]).
pub(crate) enum Answer<T> {
    Now(Result<T, Error>),
    Later(tokio::sync::oneshot::Receiver<Result<T, Error>>),
}

impl<T: Send + 'static> Answer<T> {
    /// The answer `future` gives, from a task of its own on the current arbiter: for
    /// an answer that must be worked out even if its caller stops waiting.
    pub(crate) fn spawned(
        future: impl std::future::Future<Output = Result<T, Error>> + 'static,
    ) -> Self {
        let (tx, rx) = tokio::sync::oneshot::channel();
        actix::spawn(async move {
            let _ = tx.send(future.await);
        });
        Answer::Later(rx)
    }

    /// Waits for it.
    pub(crate) async fn get(self) -> Result<T, Error> {
        match self {
            Answer::Now(answer) => answer,
            Answer::Later(rx) => rx.await.unwrap_or(Err(Error::Stopped)),
        }
    }

    /// As a public message's answer.
    pub(crate) fn into_response(self) -> ResponseFuture<Result<T, Error>> {
        Box::pin(self.get())
    }
}

/// Wait for a root procedure to finish.
#[derive(Clone, Copy, Debug)]
pub struct WaitFor(pub ProcId);

impl Message for WaitFor {
    type Result = Result<Result<(), Failure>, Error>;
}

/// A finished root's value, decoded as a `T`, if a step of it set one
/// ([`Context::set_result`](crate::Context::set_result)); answered at once
/// ([`Error::NotFinished`] before the tree finishes). [`WaitValue`] waits for it.
///
/// ```no_run
/// # async fn f(addr: actix::Addr<proctor::ExecutorActor>, id: proctor::ProcId)
/// #     -> Result<(), Box<dyn std::error::Error>> {
/// use proctor::messages::GetValue;
/// let regions: Option<u32> = addr.send(GetValue::new(id)).await??;
/// # Ok(()) }
/// ```
pub struct GetValue<T> {
    /// The root.
    pub id: ProcId,
    value: PhantomData<fn() -> T>,
}

impl<T> Clone for GetValue<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for GetValue<T> {}

impl<T> std::fmt::Debug for GetValue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("GetValue").field(&self.id).finish()
    }
}

impl<T> GetValue<T> {
    /// The value of root `id`.
    pub fn new(id: ProcId) -> Self {
        GetValue {
            id,
            value: PhantomData,
        }
    }
}

impl<T: serde::de::DeserializeOwned + 'static> Message for GetValue<T> {
    type Result = Result<Option<T>, Error>;
}

/// Wait for a root procedure to finish, and answer with the value a step of it set
/// ([`Context::set_result`](crate::Context::set_result)), decoded as a `T`, or why
/// there is none ([`WaitError`]). [`Executor::wait_value`] sends it.
pub struct WaitValue<T> {
    /// The root.
    pub id: ProcId,
    value: PhantomData<fn() -> T>,
}

impl<T> Clone for WaitValue<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for WaitValue<T> {}

impl<T> std::fmt::Debug for WaitValue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("WaitValue").field(&self.id).finish()
    }
}

impl<T> WaitValue<T> {
    /// Waits for root `id`.
    pub fn new(id: ProcId) -> Self {
        WaitValue {
            id,
            value: PhantomData,
        }
    }
}

impl<T: serde::de::DeserializeOwned + 'static> Message for WaitValue<T> {
    type Result = Result<T, WaitError>;
}

/// The client has a finished root's result: keep it only for the shorter retention.
#[derive(Clone, Copy, Debug)]
pub struct AckResult(pub ProcId);

impl Message for AckResult {
    type Result = Result<(), Error>;
}

/// Which procedures to list: by default every unfinished one. Filters combine (a
/// procedure must pass all of them); finished roots, whose results the executor keeps
/// for a while, only with [`with_finished`](Self::with_finished).
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// use proctor::{List, ProcState};
/// let waiting = executor
///     .list(List::new().state(ProcState::Waiting).type_name("create-table"))
///     .await?;
/// # let _ = waiting; Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct List {
    states: Vec<ProcState>,
    type_name: Option<String>,
    pub(super) root: Option<ProcId>,
    finished: bool,
}

impl List {
    /// Every unfinished procedure.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only procedures in `state` (call again to allow more states). Asking for a
    /// finished state lists finished roots too.
    #[must_use]
    pub fn state(mut self, state: ProcState) -> Self {
        self.finished |= state.is_finished();
        self.states.push(state);
        self
    }

    /// Only procedures of the registered type `name`.
    #[must_use]
    pub fn type_name(mut self, name: impl Into<String>) -> Self {
        self.type_name = Some(name.into());
        self
    }

    /// Only the tree of root `root`.
    #[must_use]
    pub fn root(mut self, root: ProcId) -> Self {
        self.root = Some(root);
        self
    }

    /// Finished roots too (SUCCESS or ROLLEDBACK, kept for their results).
    #[must_use]
    pub fn with_finished(mut self) -> Self {
        self.finished = true;
        self
    }

    pub(super) fn matches(&self, info: &ProcInfo) -> bool {
        self.matches_fields(info.state, info.type_name, info.root)
    }

    /// [`matches`](Self::matches) on the fields it looks at.
    pub(super) fn matches_fields(&self, state: ProcState, type_name: &str, root: ProcId) -> bool {
        (self.finished || !state.is_finished())
            && (self.states.is_empty() || self.states.contains(&state))
            && self.type_name.as_deref().is_none_or(|t| t == type_name)
            && self.root.is_none_or(|r| r == root)
    }
}

impl Message for List {
    type Result = Result<Vec<ProcInfo>, Error>;
}

/// One page of what a [`List`] matches, newest first (highest id first): `limit`
/// procedures after skipping `offset`, with how many match in all. Only the page's
/// procedures are described, so a page of a hundred thousand costs a page.
#[derive(Clone, Debug)]
pub struct ListPage {
    pub(super) list: List,
    pub(super) offset: usize,
    pub(super) limit: usize,
}

impl ListPage {
    /// The page of `list` that starts after `offset` matches and holds `limit`.
    pub fn new(list: List, offset: usize, limit: usize) -> Self {
        ListPage {
            list,
            offset,
            limit,
        }
    }
}

/// A page of procedures ([`ListPage`]).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct ProcPage {
    /// The page, newest first.
    pub procedures: Vec<ProcInfo>,
    /// How many procedures match in all.
    pub total: usize,
}

impl Message for ListPage {
    type Result = Result<ProcPage, Error>;
}

/// Stops the executor, as [`Executor::shutdown`] (graceful, the default) or
/// [`Executor::shutdown_now`] do: for code that holds only the executor's address.
/// Answers once the engine's threads and its store writer have stopped; an executor
/// that started its own actix system stops that system too.
///
/// ```no_run
/// # async fn f(addr: actix::Addr<proctor::ExecutorActor>) -> Result<(), actix::MailboxError> {
/// addr.send(proctor::messages::Shutdown::graceful()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct Shutdown {
    pub(super) graceful: bool,
}

impl Shutdown {
    /// Drains first: no new step or rollback starts, running ones end and their records
    /// become durable, within the executor's
    /// [`drain_timeout`](ExecutorBuilder::drain_timeout).
    pub fn graceful() -> Self {
        Shutdown { graceful: true }
    }

    /// Stops at once, cutting off running steps as a crash would (for tests of
    /// recovery).
    pub fn now() -> Self {
        Shutdown { graceful: false }
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown::graceful()
    }
}

/// What happened to a root procedure, or to any procedure that paused, for subscribers
/// ([`Executor::subscribe`], [`Subscribe`]). Each root gives `Submitted` (once its
/// insert is durable) before `Finished`, and any `Paused` of its tree between them;
/// roots recovered at start give no `Submitted`, and procedures recovered paused give
/// no `Paused` (list them: `List::new().state(ProcState::Paused)`).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum ProcEvent {
    /// A root was submitted: it is durable and will run to SUCCESS or ROLLEDBACK.
    Submitted {
        /// The root.
        id: ProcId,
        /// Its registered type name.
        type_name: &'static str,
    },
    /// A procedure (a root or a child) is durably paused and waits for an operator's
    /// [`Executor::resume`] or [`Executor::rollback`]: stopped by [`Executor::pause`],
    /// or by its [`FailurePolicy`](crate::FailurePolicy), or by a failure past the
    /// point of no return.
    Paused {
        /// The paused procedure.
        id: ProcId,
        /// Its root.
        root: ProcId,
        /// [`ProcState::Paused`] or [`ProcState::RollbackPaused`].
        state: ProcState,
        /// Why: the error and policy, or neither for an operator's pause.
        why: Paused,
    },
    /// A root's tree finished: `Ok` for SUCCESS, the original failure for ROLLEDBACK.
    Finished {
        /// The root.
        id: ProcId,
        /// Its registered type name.
        type_name: &'static str,
        /// Its result, as [`Executor::wait`] gives it.
        result: Result<(), Failure>,
    },
    /// A standby took the leader lease, loaded the store and recovered its trees: it
    /// leads from now on (see
    /// [`ExecutorBuilder::start_standby`](crate::ExecutorBuilder::start_standby)). The
    /// first event of a subscription made while it waited.
    Leading {
        /// Its name in the lease.
        holder: String,
        /// The lease's epoch.
        epoch: i64,
    },
    /// This executor lost the leader lease and stepped down (see
    /// [`ExecutorBuilder::leadership`](crate::ExecutorBuilder)): it runs and
    /// acknowledges nothing more, and every request is answered
    /// [`Error::NotLeader`](crate::Error::NotLeader). The last event of a subscription.
    SteppedDown {
        /// Why: who took the lease, or how long no renewal succeeded.
        reason: String,
    },
}

impl Message for ProcEvent {
    type Result = ();
}

/// Subscribes an actor to [`ProcEvent`]s: it receives every root's events from now on,
/// until it stops. For code that holds only the executor's address.
///
/// ```no_run
/// # use actix::prelude::*;
/// # struct Manager;
/// # impl Actor for Manager { type Context = Context<Self>; }
/// # impl Handler<proctor::ProcEvent> for Manager {
/// #     type Result = ();
/// #     fn handle(&mut self, _: proctor::ProcEvent, _: &mut Context<Self>) {}
/// # }
/// # async fn f(executor: Addr<proctor::ExecutorActor>, me: Addr<Manager>) -> Result<(), proctor::Error> {
/// executor.send(proctor::messages::Subscribe(me.recipient())).await??;
/// # Ok(()) }
/// ```
pub struct Subscribe(pub Recipient<ProcEvent>);

impl std::fmt::Debug for Subscribe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Subscribe")
            .field(&"Recipient<ProcEvent>")
            .finish()
    }
}

impl Message for Subscribe {
    type Result = Result<(), Error>;
}

/// Subscribes a channel (what [`Executor::subscribe`] sends).
pub(super) struct SubscribeChannel(pub(super) tokio::sync::mpsc::UnboundedSender<ProcEvent>);

impl Message for SubscribeChannel {
    type Result = Result<(), Error>;
}

impl Message for Shutdown {
    type Result = ();
}

// ------------------------------------------------------------------------------------
// The messages this actor receives from the engine's own actors (ordering rules:
// `ARCHITECTURE.md`, "Protocol").
// ------------------------------------------------------------------------------------

/// A tree finished (from its root stack), or halted because nothing more can be made
/// durable (the store failed) or the engine broke an invariant.
pub(crate) struct TreeFinished {
    pub(crate) root: ProcId,
    pub(crate) result: Result<Result<(), Failure>, Error>,
}

impl Message for TreeFinished {
    type Result = ();
}

/// News of a tree for the subscribers (sent only while there are any). From the root
/// stack, so it reaches the executor before the same tree's `TreeFinished`.
pub(crate) enum TreeNews {
    /// The root's insert is durable and its submitter answered.
    Submitted(ProcId),
    /// A procedure of the tree is durably paused.
    Paused {
        id: ProcId,
        root: ProcId,
        state: ProcState,
        why: Paused,
    },
}

impl Message for TreeNews {
    type Result = ();
}
