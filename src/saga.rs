//! Straight-line procedures with automatic undo: a [`SagaProcedure`] is one async
//! function, [`SagaProcedure::run`], whose steps ([`SagaContext::step`]) are each given
//! with their undo. [`Saga`] turns it into a [`Procedure`]: every step is one step of the
//! engine, its value journaled in the procedure's state (so durable before the next
//! step begins), and a restart replays `run` from the top, handing each journaled step
//! its value without running it again. When the tree fails (or the saga is aborted),
//! the engine's rollbacks run the undos of the steps, newest first, each told what its
//! step did ([`Undoing`]).
//!
//! Child procedures: [`SagaContext::children`] starts children and, once all of them
//! have succeeded, returns their values. It takes two steps of the engine: one that
//! journals the step and returns [`Flow::Children`], and, once the children have
//! succeeded, one that copies their values into the journal entry and runs nothing of
//! the user's (so no step of the user's ever runs with a children entry still
//! unfilled, and a rollback's replay always finds the values it needs). The children
//! roll themselves back by the engine's rules; the step has no undo of its own.
//!
//! Invariant: the journal holds one entry per recorded step of the saga but its last
//! (the one that returned the output), in order; each rollback of a recorded step pops
//! one entry after its undo succeeds, and the rollback of the step that failed (or was
//! cut off) undoes the step after the journal's end. A children entry is unfilled only
//! while it is the journal's last.
//!
//! # The determinism rule
//!
//! `run` runs again from the top at every engine step and after every restart, with the
//! journaled steps answered from the journal. So outside [`SagaContext::step`], `run`
//! must do the same thing every time: no effects on the world (they would repeat), and
//! no decision on anything but its own fields and the values its steps returned (not on
//! the clock, randomness, or what a service answers now). Put anything like that inside
//! a step. A step whose name differs from the journal's at its position fails the saga
//! with an error naming both.
//!
//! # Borrowing, and undos
//!
//! A step's `run` and `undo` are closures that borrow what `run` has: the saga's fields
//! (`&self`), the environment ([`SagaContext::env`], taken once before the steps), the
//! values of the steps before. The rollback of a step replays `run` from the top as
//! every pass does and, at that step, calls its `undo` and awaits it there, so neither
//! closure outlives `run`'s pass.
//!
//! # Cancellation
//!
//! A step's `run` is cancellable by default: when the engine cancels the step (an
//! abort, the saga's tree failing elsewhere, a graceful shutdown's drain deadline;
//! [`Context::cancelled`]), the engine drops its future where it waits and the step
//! fails with [`ProcError::Aborted`], so an abort rolls the saga back at once without
//! waiting for the step's end; its undo is told [`Undoing::Failed`]. A step that must
//! not be cut between two writes opts out with [`SagaStep::uncancellable`].
//!
//! # Failures
//!
//! A step's error fails the saga as any procedure's step's error fails it: a
//! [retryable](ProcError::retryable) one is retried first (the engine step runs again:
//! `run` replays the journal and runs the failed step again), under the retry policy
//! set with [`SagaContext::set_retry_policy`] before the step; then the saga's
//! [`failure_policy`](SagaProcedure::failure_policy) decides (by default, roll back:
//! the undos run, the failed step's first).

use std::convert::Infallible;
use std::future::{Future, IntoFuture};
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use async_trait::async_trait;
use futures_util::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::cancel::Cancelled;
use crate::locks::Lock;
use crate::procedure::{
    ChildType, Context, FailurePolicy, Flow, ProcError, Procedure, RetryPolicy, Undo,
};
use crate::remote::{send_undo, Fate, RemoteCall, RemoteResult, Reported};

/// A procedure written as one async function of steps, each with its undo (see the
/// module docs, and the guide's "Straight-line procedures"). Wrap it in [`Saga`] to
/// submit it; register it with
/// [`Registry::register_saga`](crate::Registry::register_saga).
///
/// ```
/// use proctor::{async_trait, ProcError, SagaContext, SagaProcedure, Undoing};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct AddNode { node: String }
///
/// #[async_trait]
/// impl SagaProcedure for AddNode {
///     type Output = u32;
///     async fn run(&self, ctx: &mut SagaContext<'_>) -> Result<u32, ProcError> {
///         let slot: u32 = ctx
///             .step("reserve a slot", || async { Ok(7) }, |undoing: Undoing<u32>| async move {
///                 if let Undoing::Completed(slot) = undoing {
///                     let _ = slot; // free it
///                 }
///                 Ok(())
///             })
///             .await?;
///         Ok(slot)
///     }
/// }
/// ```
#[async_trait]
pub trait SagaProcedure<E = ()>: Serialize + DeserializeOwned + Send + Sync + 'static
where
    E: Send + Sync + 'static,
{
    /// What the saga ends with: the procedure's value
    /// ([`Executor::wait_value`](crate::Executor::wait_value), or its parent's
    /// [`Context::child_results`]).
    type Output: Serialize + Send;

    /// The saga, from the top. Runs again at every step and after a restart: follow
    /// the determinism rule (module docs).
    async fn run(&self, ctx: &mut SagaContext<'_, E>) -> Result<Self::Output, ProcError>;

    /// See [`Procedure::locks`].
    fn locks(&self) -> Vec<Lock> {
        Vec::new()
    }

    /// See [`Procedure::affinity`]: by default the resource of its first lock.
    fn affinity(&self) -> Option<String> {
        self.locks().into_iter().next().map(|lock| lock.resource)
    }

    /// See [`Procedure::holds_lock`].
    fn holds_lock(&self) -> bool {
        false
    }

    /// What a failed step (an `Err` from `run`: a step's own error, or one of `run`'s;
    /// or a panic) or a failed undo leads to: roll back (the default), pause for an
    /// operator, or retry first. See [`Procedure::failure_policy`]; a step's error
    /// marked [retryable](ProcError::retryable) is retried before the policy's end,
    /// and one marked [terminal](ProcError::terminal) is never retried
    /// ([`ErrorKind`](crate::ErrorKind)). Asked on the saga's fields; a step's error
    /// tells which step failed by its [code](ProcError::with_code), say.
    ///
    /// Paused ([`FailurePolicy::Pause`]), the saga waits for an operator: a continue
    /// runs the failed step again, a rollback undoes it and the steps before it.
    ///
    /// ```
    /// use proctor::{async_trait, FailurePolicy, ProcError, SagaContext, SagaProcedure, Undoing};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct MoveRegion { region: u32 }
    ///
    /// #[async_trait]
    /// impl SagaProcedure for MoveRegion {
    ///     type Output = ();
    ///     async fn run(&self, ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    ///         ctx.step("close", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    ///         ctx.step(
    ///             "open",
    ///             || async { Err(ProcError::with_code("no_server", "no server takes it")) },
    ///             |_: Undoing<()>| async { Ok(()) },
    ///         )
    ///         .await
    ///     }
    ///     fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
    ///         match error.code() {
    ///             // Closed, and nowhere to open it: an operator finds it a server.
    ///             Some("no_server") => FailurePolicy::Pause,
    ///             _ => FailurePolicy::Rollback,
    ///         }
    ///     }
    /// }
    /// ```
    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        FailurePolicy::Rollback
    }

    /// A time limit for the saga, in milliseconds from submission, whatever it is
    /// doing (a step, its children, a [`sleep`](SagaContext::sleep), a
    /// [`wait_for_event`](SagaContext::wait_for_event)): past it the saga fails with
    /// [`ProcError::TimedOut`] and rolls back (its step in progress is cancelled, so
    /// dropped unless [`uncancellable`](SagaStep::uncancellable)). As
    /// [`Procedure::timeout_ms`]: asked once, at submission; the deadline is persisted.
    fn timeout_ms(&self) -> Option<u64> {
        None
    }

    /// The procedure types [`SagaContext::children`] may start: see
    /// [`Procedure::child_types`].
    fn child_types() -> Vec<ChildType>
    where
        Self: Sized,
    {
        Vec::new()
    }
}

/// What a saga step's undo is told its step did: how far the engine saw it get (its
/// [`Undo`], with the step's value when it completed), not what in the world is the
/// saga's. Neither `Failed` nor `Interrupted` says the step changed nothing: mark what
/// a step creates with a token the saga has before the step runs (its procedure's id,
/// [`Context::id`]) and undo only what carries it (the guide's "Straight-line
/// procedures").
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Undoing<T> {
    /// The step's `run` returned this value (journaled with the step): it did all it
    /// does.
    Completed(T),
    /// The step's `run` returned an error or panicked, or was dropped when the engine
    /// cancelled it ([`Context::cancelled`]: an abort, or the saga's tree failing
    /// elsewhere): the engine saw it end. It did what it did before that: nothing if
    /// it failed on a check before its first change, part of its work if it failed or
    /// panicked between (or in the middle of) its writes, and all of it if its value
    /// does not encode ([`Undo::Failed`]).
    ///
    /// A cancelled step (one not [uncancellable](SagaStep::uncancellable)) was
    /// dropped where it waited, at one of its `.await`s: everything its code did up to
    /// that await is done, nothing after it ran; what it awaited there may or may not
    /// have taken effect (a request sent whose answer it was waiting for, a write
    /// flushed or not). So it may have done none of its writes, some of them (the ones
    /// before the await it was dropped at), or, as far as the world knows, that one
    /// too. A step the engine cancelled before it started did nothing.
    Failed,
    /// Nothing recorded how far the step got: the process died, a graceful shutdown
    /// cancelled the step, or its actor was stopped, while it may have been running,
    /// and the tree failed before the step ran again, or as a later attempt of it
    /// failed ([`Undo::Interrupted`]); or, for a
    /// [`children`](SagaContext::children) step, not all its children succeeded (those
    /// that did are the undo's to undo: the engine does not roll back a finished
    /// procedure). It may have done all its work, part, none, or failed on its check,
    /// finding what someone else made: undo only what is there and carries the saga's
    /// mark.
    Interrupted,
}

/// One journaled step: its name and its value (MessagePack).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Entry {
    name: String,
    #[serde(with = "serde_bytes")]
    value: Vec<u8>,
    /// For a [`SagaContext::children`] step: which of the procedure's children it
    /// started. Its `value` is the children's values (a MessagePack array, each the
    /// child's value or nil) once `filled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    children: Option<ChildrenStep>,
}

impl Entry {
    /// Whether its value is the step's whole value: not an unfilled children step.
    fn is_complete(&self) -> bool {
        self.children.is_none_or(|c| c.filled)
    }
}

/// The children a saga step started: `count` of them, after the `first` it had started
/// before (in the order [`Context::children`] lists them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct ChildrenStep {
    first: u32,
    count: u32,
    filled: bool,
}

/// What stops an execute pass: the step it journals, and the children it starts.
struct NewStep<E> {
    entry: Entry,
    /// `Some` for a children step that starts them now.
    children: Option<Vec<Box<dyn Procedure<E>>>>,
    /// `Some((at, values))`: the children entry at `at` is filled with `values`.
    filled: Option<(usize, Vec<u8>)>,
    /// What the procedure does once the entry is recorded, for a step of the engine's
    /// own (a sleep, a wait for an event); `None`: the next step runs at once.
    then: Option<Then>,
}

impl<E> NewStep<E> {
    /// A step that journals `name` with `value` and starts no children.
    fn plain(name: &str, value: Vec<u8>, then: Option<Then>) -> Self {
        NewStep {
            entry: Entry {
                name: name.to_string(),
                value,
                children: None,
            },
            children: None,
            filled: None,
            then,
        }
    }
}

/// What a saga waits for after a step of the engine's own.
enum Then {
    /// Until this time (ms since the Unix epoch).
    Sleep(u64),
    /// Until this event is woken.
    Event(String),
}

/// What one pass of `run` is for.
enum Pass<E> {
    /// A step of the engine: run the first step past the journal (or fill the
    /// children entry at its end), then stop.
    Execute {
        /// That step, once it has a value.
        new: Arc<Mutex<Option<NewStep<E>>>>,
    },
    /// A rollback: replay the journal up to the step at `target` (the newest journaled
    /// one, or the one after the journal), run its undo there, told `undoing`, then
    /// stop.
    Rollback {
        target: usize,
        /// Taken by the step at `target`.
        undoing: Option<Undoing<Vec<u8>>>,
        /// What the undo returned, once it has.
        done: Arc<Mutex<Option<Result<(), ProcError>>>>,
    },
}

/// What a saga's `run` gets: the procedure's [`Context`] (through `Deref`: its id, the
/// environment, the time) and its steps.
pub struct SagaContext<'c, E = ()> {
    ctx: &'c Context<E>,
    journal: &'c [Entry],
    at: usize,
    pass: Pass<E>,
    /// The retry policy set last ([`SagaContext::set_retry_policy`]).
    retry: Option<RetryPolicy>,
}

impl<E> std::fmt::Debug for SagaContext<'_, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaContext")
            .field("ctx", &self.ctx)
            .field("journaled", &self.journal.len())
            .field("at", &self.at)
            .finish_non_exhaustive()
    }
}

impl<E> std::ops::Deref for SagaContext<'_, E> {
    type Target = Context<E>;
    fn deref(&self) -> &Context<E> {
        self.ctx
    }
}

impl<'c, E: Send + Sync + 'static> SagaContext<'c, E> {
    /// How the [retryable](ProcError::retryable) errors of the steps that follow are
    /// retried (until it is set again): see [`Context::set_retry_policy`]. Set it
    /// before the step, outside it; like everything outside the steps, the same way in
    /// every pass (the determinism rule).
    ///
    /// ```
    /// use proctor::{async_trait, ProcError, RetryPolicy, SagaContext, SagaProcedure, Undoing};
    /// # async fn open_region(_: u32) -> Result<(), std::io::Error> { Ok(()) }
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct OpenRegion { region: u32 }
    /// # #[async_trait]
    /// # impl SagaProcedure for OpenRegion {
    /// #     type Output = ();
    /// async fn run(&self, ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    ///     ctx.set_retry_policy(RetryPolicy::new(10).backoff_ms(50).max_delay_ms(2_000));
    ///     ctx.step(
    ///         "open",
    ///         || async { open_region(self.region).await.map_err(ProcError::retryable) },
    ///         |_: Undoing<()>| async { Ok(()) },
    ///     )
    ///     .await
    /// }
    /// # }
    /// ```
    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.retry = Some(policy);
    }

    /// The environment the service gave the executor, as [`Context::env`] gives it,
    /// but borrowed for as long as the saga's context lives rather than for this call:
    /// taken once before the steps, it does not hold the `SagaContext`, so every step's
    /// `run` and `undo` can use it (see [`step`](Self::step)).
    pub fn env(&self) -> &'c E {
        self.ctx.env()
    }

    /// The environment's `Arc`, as [`Context::env_arc`] gives it, borrowed as
    /// [`env`](Self::env) is: clone it for what must own the environment.
    pub fn env_arc(&self) -> &'c Arc<E> {
        self.ctx.env_arc()
    }

    /// One step of the saga: `run` does it and returns its value, which is journaled
    /// (durably, before the next step begins); `undo` undoes it when the saga rolls
    /// back, told what the step did ([`Undoing`]: its value if it completed). A step
    /// already journaled (before a restart, or in an earlier step of the engine)
    /// returns its journaled value without running again. An `Err` from `run` fails the
    /// saga (its tree rolls back, this step's undo first, told it failed); an `Err`
    /// from `undo` is retried with backoff, as any rollback. Await the answer
    /// ([`SagaStep`], through `IntoFuture`) for the step's value.
    ///
    /// `run` and `undo` borrow what they need: the saga's fields (`self`), the
    /// environment (taken first with [`SagaContext::env`]), the values of the steps
    /// before. The rollback replays `run` up to the step it undoes, as every pass
    /// does, and calls `undo` there, so `undo` lives no longer than `run`'s pass:
    ///
    /// ```
    /// use proctor::{async_trait, ProcError, SagaContext, SagaProcedure};
    /// use serde::{Deserialize, Serialize};
    /// use std::{collections::BTreeSet, sync::Mutex};
    ///
    /// struct Nodes { reserved: Mutex<BTreeSet<String>> }
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct AddNode { node: String }
    ///
    /// #[async_trait]
    /// impl SagaProcedure<Nodes> for AddNode {
    ///     type Output = ();
    ///     async fn run(&self, ctx: &mut SagaContext<'_, Nodes>) -> Result<(), ProcError> {
    ///         let nodes = ctx.env();
    ///         ctx.step(
    ///             "reserve",
    ///             || async {
    ///                 nodes.reserved.lock().unwrap().insert(self.node.clone());
    ///                 Ok(())
    ///             },
    ///             // `move`: the undo takes its `Undoing` into its future; what it
    ///             // captures (`nodes`, `self`) are references.
    ///             move |_undoing| async move {
    ///                 nodes.reserved.lock().unwrap().remove(&self.node);
    ///                 Ok(())
    ///             },
    ///         )
    ///         .await
    ///     }
    /// }
    /// ```
    ///
    /// # Cancellation
    ///
    /// `run` is cancellable: when the engine cancels the step ([`Context::cancelled`]:
    /// an abort, the saga's tree failing elsewhere, or a graceful shutdown's drain
    /// deadline), its future is dropped at the await point where it waits, and the step
    /// fails with [`ProcError::Aborted`] (a step the engine cancels before it starts
    /// does not start). Aborted, the saga rolls back at once, this step's undo first,
    /// told [`Undoing::Failed`]; at a shutdown, nothing is recorded and the step runs
    /// again after the restart. A step that must not be cut between two of its writes
    /// says so with [`SagaStep::uncancellable`]: it runs to its end, and may watch
    /// [`Context::cancelled`] itself to stop where it can.
    ///
    /// # Errors
    /// The step's own error; [`ProcError::Aborted`] if it was cancelled;
    /// [`ProcError::Failed`] if the journal's step at this position has another name
    /// (the saga is not deterministic), or its value does not decode as `T`;
    /// [`ProcError::Persist`] if the value does not encode.
    pub fn step<'s, T, R, RF, U, UF>(
        &'s mut self,
        name: &'s str,
        run: R,
        undo: U,
    ) -> SagaStep<'s, 'c, E, T, R, U>
    where
        T: Serialize + DeserializeOwned + Send,
        R: FnOnce() -> RF + Send,
        RF: Future<Output = Result<T, ProcError>> + Send,
        U: FnOnce(Undoing<T>) -> UF + Send,
        UF: Future<Output = Result<(), ProcError>> + Send,
    {
        SagaStep {
            ctx: self,
            name,
            run,
            undo,
            cancellable: true,
            value: PhantomData,
        }
    }

    /// The step [`step`](Self::step) answers, when awaited.
    async fn run_step<T, R, RF, U, UF>(
        &mut self,
        name: &str,
        run: R,
        undo: U,
        cancellable: bool,
    ) -> Result<T, ProcError>
    where
        T: Serialize + DeserializeOwned + Send,
        R: FnOnce() -> RF + Send,
        RF: Future<Output = Result<T, ProcError>> + Send,
        U: FnOnce(Undoing<T>) -> UF + Send,
        UF: Future<Output = Result<(), ProcError>> + Send,
    {
        let at = self.at;
        self.at += 1;
        if self.undoes(at) {
            match self.undo_here(decode::<T>, undo).await {}
        }
        if let Some(entry) = self.journaled(at, name, false)? {
            return decode(&entry.value);
        }
        match &self.pass {
            // Past the journal, and not the step this rollback undoes: no rollback
            // reaches here (its step is the newest journaled one, or this one).
            Pass::Rollback { .. } => std::future::pending().await,
            Pass::Execute { new } => {
                let value = if !cancellable {
                    run().await?
                } else if self.ctx.is_cancelled() {
                    return Err(ProcError::Aborted);
                } else {
                    match until_cancelled(run(), self.ctx.cancelled()).await {
                        Some(value) => value?,
                        // Dropped where it waited.
                        None => return Err(ProcError::Aborted),
                    }
                };
                let value = rmp_serde::to_vec_named(&value)
                    .map_err(|e| ProcError::Persist(format!("saga step {name:?}: {e}")))?;
                *lock(new) = Some(NewStep::plain(name, value, None));
                // The engine records it; the next step of the engine goes on from here.
                std::future::pending().await
            }
        }
    }

    /// Whether the step at `at` is the one this pass undoes.
    fn undoes(&self, at: usize) -> bool {
        matches!(self.pass, Pass::Rollback { target, .. } if target == at)
    }

    /// Runs the undo of the step this rollback undoes (the one at its target), told
    /// what the step did, its value (as journaled) decoded by `decode`; keeps what it
    /// returns for the rollback, and ends the pass.
    async fn undo_here<T, D, U, UF>(&mut self, decode: D, undo: U) -> Infallible
    where
        D: FnOnce(&[u8]) -> Result<T, ProcError>,
        U: FnOnce(Undoing<T>) -> UF,
        UF: Future<Output = Result<(), ProcError>>,
    {
        let Pass::Rollback { undoing, done, .. } = &mut self.pass else {
            unreachable!("only a rollback undoes");
        };
        let (undoing, done) = (undoing.take(), done.clone());
        let undoing = match undoing.unwrap_or(Undoing::Interrupted) {
            Undoing::Completed(bytes) => decode(&bytes).map(Undoing::Completed),
            Undoing::Failed => Ok(Undoing::Failed),
            Undoing::Interrupted => Ok(Undoing::Interrupted),
        };
        let undone = match undoing {
            Ok(undoing) => undo(undoing).await,
            Err(e) => Err(e),
        };
        *lock(&done) = Some(undone);
        std::future::pending().await
    }

    /// A version marker for a change of the saga's code while sagas are in flight (as
    /// Temporal's `GetVersion`): `old` for a saga that had already passed this point of
    /// its code when the change was deployed, `new` for every other, so the code can
    /// keep the old sequence of steps for the sagas that are in it:
    ///
    /// ```
    /// # use proctor::{ProcError, SagaContext, Undoing};
    /// # async fn run(ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    /// ctx.step("reserve", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// // Added later, between two steps that sagas in flight have journaled.
    /// if ctx.version("audit", 1, 2).await? >= 2 {
    ///     ctx.step("audit", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// }
    /// ctx.step("announce", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// A saga that reaches the marker for the first time journals `new` under the step
    /// name `version CHANGE` (one step of the engine, undone by nothing) and sees it
    /// ever after; one whose journal has another step at this position (it passed
    /// here under the old code) gets `old` and journals nothing. Remove a marker, and
    /// the old branch, only once no saga that passed it is in flight.
    ///
    /// # Errors
    /// As [`step`](Self::step) for the journaled marker.
    pub async fn version(&mut self, change: &str, old: u32, new: u32) -> Result<u32, ProcError> {
        let name = format!("version {change}");
        if let Some(entry) = self.journal.get(self.at) {
            if entry.name != name || entry.children.is_some() {
                return Ok(old);
            }
        }
        self.step(
            &name,
            move || async move { Ok(new) },
            |_: Undoing<u32>| async { Ok(()) },
        )
        .await
    }

    /// Waits `ms` milliseconds, durably: a step of the engine's own (journaled as
    /// `sleep NAME` with the time it ends), during which the saga holds no worker and
    /// its tree passivates; after a restart it waits only what is left. The saga goes
    /// on at the next `run` pass past it. It has nothing to undo. Like a step, it
    /// must come at the same point of `run` every time.
    ///
    /// ```
    /// # use proctor::{ProcError, SagaContext, Undoing};
    /// # async fn run(ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    /// ctx.step("drain", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// ctx.sleep("let clients reconnect", 30_000).await?;
    /// ctx.step("close", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ProcError::Failed`] if the journal has another step at this position.
    pub async fn sleep(&mut self, name: &str, ms: u64) -> Result<(), ProcError> {
        let until = self.ctx.now_ms().saturating_add(ms);
        self.wait(&format!("sleep {name}"), Then::Sleep(until))
            .await
    }

    /// Waits until `event` is woken ([`Executor::wake_event`](crate::Executor::wake_event), or the
    /// [`WakeEvent`](crate::messages::WakeEvent) message), durably: a step of the
    /// engine's own (journaled as `event NAME`), the saga suspended on the event as a
    /// procedure returning [`Flow::Suspend`] is. Whether an event was woken is not
    /// persisted (events live in the service's memory): after a restart the saga waits
    /// for it again, so the service wakes it again (a wake before the wait is kept, as
    /// for any procedure). It has nothing to undo.
    ///
    /// ```
    /// # use proctor::{ProcError, SagaContext, Undoing};
    /// # async fn run(ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    /// ctx.step("request approval", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// ctx.wait_for_event("approval", "approved/table-7").await?;
    /// ctx.step("apply", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ProcError::Failed`] if the journal has another step at this position.
    pub async fn wait_for_event(&mut self, name: &str, event: &str) -> Result<(), ProcError> {
        self.wait(&format!("event {name}"), Then::Event(event.to_string()))
            .await
    }

    /// A step of the engine's own, journaled as `name` (with nothing of the user's),
    /// after which the procedure waits as `then` says.
    async fn wait(&mut self, name: &str, then: Then) -> Result<(), ProcError> {
        let at = self.at;
        self.at += 1;
        if self.undoes(at) {
            // Nothing to undo.
            match self
                .undo_here(|_| Ok(()), |_: Undoing<()>| async { Ok(()) })
                .await {}
        }
        if self.journaled(at, name, false)?.is_some() {
            return Ok(());
        }
        let Pass::Execute { new } = &self.pass else {
            // Past the journal, and not the step this rollback undoes.
            return std::future::pending().await;
        };
        let value = match &then {
            Then::Sleep(until) => rmp_serde::to_vec_named(until),
            Then::Event(event) => rmp_serde::to_vec_named(event),
        }
        .map_err(|e| ProcError::Persist(format!("saga step {name:?}: {e}")))?;
        *lock(new) = Some(NewStep::plain(name, value, Some(then)));
        std::future::pending().await
    }

    /// A remote operation as a step: `op` goes to `target` through the executor's
    /// transport `T` (as [`Context::dispatch`] sends it, batched, deduplicated by its
    /// id, retried until its deadline), and the step returns its outcome once there is
    /// one — the target's report, or why there is none ([`RemoteResult`]: take the
    /// value with [`RemoteResult::value`], whose `?` fails the saga on a failed
    /// operation). Journaled as any step: after a restart the operation is not sent
    /// again once its outcome is recorded.
    ///
    /// `undo` is the operation that takes `op` back, sent to the same target under
    /// [`OpId::undo`](crate::OpId::undo) when the saga rolls back: if the operation
    /// was in flight when the saga failed, once its outcome is known (as
    /// [`Dispatched::undo`](crate::Dispatched::undo) does), and if the step had
    /// returned, when the rollback reaches it, unless the target reported a failure of
    /// the operation (or was removed). With `None` the operation stays applied. (One
    /// whose outcome was recorded in the moment between the operation's end and the
    /// step's return, as the saga failed elsewhere, is left as it is: the engine does
    /// not roll back a finished child.)
    ///
    /// ```
    /// # use proctor::{async_trait, OpId, ProcError, Report, SagaContext, Transport, TransportError, Undoing};
    /// # #[derive(serde::Serialize, serde::Deserialize)] enum RegionOp { Open(u32), Close(u32) }
    /// # struct Rpc;
    /// # #[async_trait] impl Transport for Rpc { type Op = RegionOp;
    /// #     async fn send(&self, _: &str, _: Vec<(OpId, RegionOp)>) -> Result<Vec<Report>, TransportError> { Ok(vec![]) } }
    /// # async fn run(ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    /// let opened = ctx
    ///     .remote::<Rpc>("open", "rs-1", &RegionOp::Open(7), Some(&RegionOp::Close(7)))
    ///     .await?;
    /// let _: bool = opened.value()?; // a failed open fails the saga (nothing to close)
    /// ctx.step("announce", || async { Ok(()) }, |_: Undoing<()>| async { Ok(()) }).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`children`](Self::children); [`ProcError::Persist`] if `op` or `undo` does
    /// not serialize.
    pub async fn remote<T: crate::remote::Transport>(
        &mut self,
        name: &str,
        target: &str,
        op: &T::Op,
        undo: Option<&T::Op>,
    ) -> Result<RemoteResult, ProcError> {
        let encode = |op: &T::Op| {
            rmp_serde::to_vec_named(op)
                .map_err(|e| ProcError::Persist(format!("saga step {name:?}: {e}")))
        };
        let payload = encode(op)?;
        let undo = undo.map(encode).transpose()?;
        let ctx: &'c Context<E> = self.ctx;
        let call = RemoteCall::new(target.to_string(), payload).with_undo(undo.clone());
        let mut reported = self
            .children(
                name,
                move || [call],
                move |undoing: Undoing<Vec<Reported>>| async move {
                    // In flight when the saga failed: the operation's own rollback
                    // settled and undid it. Returned: undone here, unless it failed on
                    // its target.
                    let (Some(undo), Undoing::Completed(mut reported)) = (undo, undoing) else {
                        return Ok(());
                    };
                    let Some(result) = reported.pop().map(Reported::result) else {
                        return Ok(());
                    };
                    if !Fate::Outcome(result.outcome).needs_undo(true) {
                        return Ok(());
                    }
                    let Some(sink) = ctx.remote_sink() else {
                        return Ok(());
                    };
                    send_undo(ctx, &sink, result.op, &result.target, &undo).await
                },
            )
            .await?;
        reported
            .pop()
            .map(Reported::result)
            .ok_or_else(|| ProcError::failed(format!("saga step {name:?}: no outcome")))
    }

    /// A step that starts the procedures `start` returns as children of this one and,
    /// once every one of them has succeeded, returns the value each set
    /// ([`Context::set_result`]), decoded as `T`, in the order they were started (a
    /// child that set none decodes from nil: fine for `()` and `Option`). Journaled as
    /// any step: after a restart it neither starts the children again nor waits for
    /// them again. A child that fails fails the saga, which rolls back.
    ///
    /// `undo` undoes what the children did. The engine rolls back a child that failed
    /// or was still running when its tree failed, but not one that had succeeded (as in
    /// HBase, a finished procedure is not rolled back): that is `undo`'s, told
    /// [`Undoing::Completed`] with every child's value when all of them had succeeded,
    /// or [`Undoing::Interrupted`] when some may have (check what is there; the ones
    /// the engine rolled back may be among them). Like a step's, `start` and `undo`
    /// borrow what `run` has. Declare the children's types in
    /// [`SagaProcedure::child_types`].
    ///
    /// ```
    /// use proctor::{async_trait, Context, Flow, ProcError, Procedure, SagaContext, SagaProcedure, Undoing};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct AssignRegion { region: u32 }
    ///
    /// #[async_trait]
    /// impl Procedure for AssignRegion {
    ///     async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
    ///         ctx.set_result(&format!("server-{}", self.region % 3))?;
    ///         Ok(Flow::Done)
    ///     }
    ///     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
    ///         Ok(()) // unassign self.region, if it was
    ///     }
    /// }
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct CreateTable { regions: u32 }
    ///
    /// #[async_trait]
    /// impl SagaProcedure for CreateTable {
    ///     type Output = Vec<String>;
    ///     async fn run(&self, ctx: &mut SagaContext<'_>) -> Result<Vec<String>, ProcError> {
    ///         let servers: Vec<String> = ctx
    ///             .children(
    ///                 "assign regions",
    ///                 || (0..self.regions).map(|region| AssignRegion { region }),
    ///                 move |undoing: Undoing<Vec<String>>| async move {
    ///                     // Unassign those of the regions that are assigned.
    ///                     let _ = (self.regions, undoing);
    ///                     Ok(())
    ///                 },
    ///             )
    ///             .await?;
    ///         Ok(servers)
    ///     }
    ///     fn child_types() -> Vec<proctor::ChildType> {
    ///         vec![proctor::ChildType::of::<AssignRegion>()]
    ///     }
    /// }
    /// ```
    ///
    /// # Errors
    /// As [`step`](Self::step); [`ProcError::Failed`] naming the child whose value does
    /// not decode as `T`.
    pub async fn children<T, S, I, P, U, UF>(
        &mut self,
        name: &str,
        start: S,
        undo: U,
    ) -> Result<Vec<T>, ProcError>
    where
        T: DeserializeOwned + Send,
        S: FnOnce() -> I + Send,
        I: IntoIterator<Item = P>,
        P: Procedure<E>,
        U: FnOnce(Undoing<Vec<T>>) -> UF + Send,
        UF: Future<Output = Result<(), ProcError>> + Send,
    {
        let at = self.at;
        self.at += 1;
        if self.undoes(at) {
            let values = |bytes: &[u8]| decode_children::<T>(name, bytes);
            match self.undo_here(values, undo).await {}
        }
        if let Some(entry) = self.journaled(at, name, true)? {
            let step = entry.children.unwrap_or(ChildrenStep {
                first: 0,
                count: 0,
                filled: true,
            });
            if step.filled {
                return decode_children(name, &entry.value);
            }
            return match &self.pass {
                // Unfilled, so the newest entry, and not the step this rollback
                // undoes: that is the step after it, the one that fills it, which did
                // nothing of the user's; its undo is none.
                Pass::Rollback { done, .. } => {
                    *lock(done) = Some(Ok(()));
                    std::future::pending().await
                }
                Pass::Execute { new } => {
                    // Woken: every child has succeeded. Their values go into the
                    // entry, recorded by this step of the engine alone.
                    let values = self.fill_values(name, step)?;
                    *lock(new) = Some(NewStep {
                        entry: entry.clone(),
                        children: None,
                        filled: Some((at, values)),
                        then: None,
                    });
                    std::future::pending().await
                }
            };
        }
        let Pass::Execute { new } = &self.pass else {
            // Past the journal, and not the step this rollback undoes: no rollback
            // reaches here.
            return std::future::pending().await;
        };
        let children: Vec<Box<dyn Procedure<E>>> = start()
            .into_iter()
            .map(|c| Box::new(c) as Box<dyn Procedure<E>>)
            .collect();
        let too_many = |_| ProcError::failed(format!("saga step {name:?}: too many children"));
        let first = u32::try_from(self.ctx.children().len()).map_err(too_many)?;
        let count = u32::try_from(children.len()).map_err(too_many)?;
        let empty = children.is_empty();
        let entry = Entry {
            name: name.to_string(),
            // No children: no values, and nothing to wait for.
            value: if empty {
                encode_values(&[])?
            } else {
                Vec::new()
            },
            children: Some(ChildrenStep {
                first,
                count,
                filled: empty,
            }),
        };
        *lock(new) = Some(NewStep {
            entry,
            children: (!empty).then_some(children),
            filled: None,
            then: None,
        });
        std::future::pending().await
    }

    /// The journal's entry at `at`, if the journal reaches it, checked to be the step
    /// `name` of the same kind.
    fn journaled(
        &self,
        at: usize,
        name: &str,
        children: bool,
    ) -> Result<Option<&Entry>, ProcError> {
        let Some(entry) = self.journal.get(at) else {
            return Ok(None);
        };
        if entry.name != name || entry.children.is_some() != children {
            return Err(ProcError::failed(format!(
                "saga step {at} is {name:?}, but the journal has {:?} there: the saga \
                 does not run its steps the same way every time",
                entry.name
            )));
        }
        Ok(Some(entry))
    }

    /// The values of the children `step` started, as a children entry keeps them.
    fn fill_values(&self, name: &str, step: ChildrenStep) -> Result<Vec<u8>, ProcError> {
        let children = self.ctx.children();
        let (first, count) = (step.first as usize, step.count as usize);
        let Some(started) = children.get(first..first + count) else {
            return Err(ProcError::failed(format!(
                "saga step {name:?} started {count} children, but the procedure has {}",
                children.len()
            )));
        };
        let mut values = Vec::with_capacity(count);
        for &(child, state) in started {
            if state != crate::procedure::ProcState::Success {
                return Err(ProcError::failed(format!(
                    "saga step {name:?}: child {child} is {state}, not SUCCESS"
                )));
            }
            let value = self
                .ctx
                .child_values()
                .find(|(id, _)| *id == child)
                .map(|(_, bytes)| bytes.to_vec());
            values.push(value);
        }
        encode_values(&values)
    }
}

/// A children entry's value: each child's value, or nil.
fn encode_values(values: &[Option<Vec<u8>>]) -> Result<Vec<u8>, ProcError> {
    let values: Vec<Option<&serde_bytes::Bytes>> = values
        .iter()
        .map(|v| v.as_deref().map(serde_bytes::Bytes::new))
        .collect();
    rmp_serde::to_vec(&values).map_err(|e| ProcError::Persist(format!("saga children: {e}")))
}

/// A filled children entry's values, each decoded as `T` (a child that set none from
/// nil).
fn decode_children<T: DeserializeOwned>(name: &str, bytes: &[u8]) -> Result<Vec<T>, ProcError> {
    let values: Vec<Option<serde_bytes::ByteBuf>> = rmp_serde::from_slice(bytes).map_err(|e| {
        ProcError::failed(format!(
            "saga step {name:?}: journaled children's values: {e}"
        ))
    })?;
    const NIL: &[u8] = &[0xc0];
    values
        .iter()
        .map(|v| decode(v.as_deref().map_or(NIL, |b| &b[..])))
        .collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProcError> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        ProcError::failed(format!(
            "a saga step's journaled value does not decode as {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

/// Polls `fut` until it ends (`Some`) or, pending, `stop` says so (`None`).
async fn drive<F: Future>(fut: F, stop: impl Fn() -> bool) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
        Poll::Ready(output) => Poll::Ready(Some(output)),
        Poll::Pending if stop() => Poll::Ready(None),
        Poll::Pending => Poll::Pending,
    })
    .await
}

/// Polls `fut` until it ends (`Some`) or, pending, `cancelled` completes (`None`: `fut`
/// is dropped where it waits).
async fn until_cancelled<F: Future>(fut: F, mut cancelled: Cancelled) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
        Poll::Ready(output) => Poll::Ready(Some(output)),
        Poll::Pending if Pin::new(&mut cancelled).poll(cx).is_ready() => Poll::Ready(None),
        Poll::Pending => Poll::Pending,
    })
    .await
}

/// A saga step, as [`SagaContext::step`] answers it: await it for the step's value
/// (through `IntoFuture`), after its options.
#[must_use = "a saga step does nothing unless awaited"]
pub struct SagaStep<'s, 'c, E, T, R, U> {
    ctx: &'s mut SagaContext<'c, E>,
    name: &'s str,
    run: R,
    undo: U,
    cancellable: bool,
    value: PhantomData<fn() -> T>,
}

impl<E, T, R, U> std::fmt::Debug for SagaStep<'_, '_, E, T, R, U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SagaStep")
            .field("name", &self.name)
            .field("cancellable", &self.cancellable)
            .finish_non_exhaustive()
    }
}

impl<E, T, R, U> SagaStep<'_, '_, E, T, R, U> {
    /// The step runs to its end whatever the engine cancels: for a step that must not
    /// be cut between two of its writes. An abort (or the saga's tree failing
    /// elsewhere) waits for it; it may still stop early by watching
    /// [`Context::cancelled`] itself, at the points where it can. Aborted meanwhile, a
    /// step that returns `Ok` is journaled, then undone as completed. A graceful
    /// shutdown waits for it one second past its drain deadline, as for any step, and
    /// then cuts it off (it runs again after the restart).
    ///
    /// ```
    /// # use proctor::{ProcError, SagaContext, Undoing};
    /// # async fn write_twice() -> Result<(), ProcError> { Ok(()) }
    /// # async fn run(ctx: &mut SagaContext<'_>) -> Result<(), ProcError> {
    /// ctx.step("move", write_twice, |_: Undoing<()>| async { Ok(()) })
    ///     .uncancellable()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn uncancellable(mut self) -> Self {
        self.cancellable = false;
        self
    }
}

impl<'s, 'c, E, T, R, RF, U, UF> IntoFuture for SagaStep<'s, 'c, E, T, R, U>
where
    E: Send + Sync + 'static,
    T: Serialize + DeserializeOwned + Send + 's,
    R: FnOnce() -> RF + Send + 's,
    RF: Future<Output = Result<T, ProcError>> + Send + 's,
    U: FnOnce(Undoing<T>) -> UF + Send + 's,
    UF: Future<Output = Result<(), ProcError>> + Send + 's,
{
    type Output = Result<T, ProcError>;
    type IntoFuture = BoxFuture<'s, Result<T, ProcError>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(
            self.ctx
                .run_step(self.name, self.run, self.undo, self.cancellable),
        )
    }
}

/// A [`SagaProcedure`] as a [`Procedure`]: the saga and its journal. Register it with
/// [`Registry::register_saga`](crate::Registry::register_saga).
#[derive(Serialize, Deserialize)]
#[serde(bound = "S: Serialize + DeserializeOwned")]
pub struct Saga<S, E = ()> {
    saga: S,
    journal: Vec<Entry>,
    #[serde(skip)]
    env: std::marker::PhantomData<fn() -> E>,
}

impl<S: std::fmt::Debug, E> std::fmt::Debug for Saga<S, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Saga")
            .field("saga", &self.saga)
            .field("journaled", &self.journaled().collect::<Vec<_>>())
            .finish()
    }
}

impl<S, E> Saga<S, E> {
    /// Wraps a saga that has not run yet.
    pub fn new(saga: S) -> Self {
        Saga {
            saga,
            journal: Vec::new(),
            env: std::marker::PhantomData,
        }
    }

    /// The user's saga.
    pub fn saga(&self) -> &S {
        &self.saga
    }

    /// The names of the steps journaled so far, oldest first.
    pub fn journaled(&self) -> impl Iterator<Item = &str> {
        self.journal.iter().map(|e| e.name.as_str())
    }
}

#[async_trait]
impl<S, E> Procedure<E> for Saga<S, E>
where
    S: SagaProcedure<E>,
    E: Send + Sync + 'static,
{
    async fn execute(&mut self, ctx: &mut Context<E>) -> Result<Flow<E>, ProcError> {
        let new = Arc::new(Mutex::new(None));
        let (ended, retry) = {
            let mut sctx = SagaContext {
                ctx: &*ctx,
                journal: &self.journal,
                at: 0,
                pass: Pass::Execute { new: new.clone() },
                retry: None,
            };
            let ended = drive(self.saga.run(&mut sctx), || lock(&new).is_some()).await;
            (ended, sctx.retry)
        };
        // For the step that ended the pass, should it fail.
        if let Some(retry) = retry {
            ctx.set_retry_policy(retry);
        }
        match ended {
            Some(Ok(output)) => {
                ctx.set_result(&output)?;
                Ok(Flow::Done)
            }
            Some(Err(e)) => Err(e),
            None => {
                let Some(step) = lock(&new).take() else {
                    unreachable!("only a new step stops the pass");
                };
                if let Some((at, values)) = step.filled {
                    let entry = &mut self.journal[at];
                    entry.value = values;
                    if let Some(children) = &mut entry.children {
                        children.filled = true;
                    }
                    return Ok(Flow::MoreToDo);
                }
                self.journal.push(step.entry);
                Ok(match (step.children, step.then) {
                    (Some(children), _) => Flow::Children(children),
                    (None, Some(Then::Sleep(at_ms))) => Flow::SleepUntil(at_ms),
                    (None, Some(Then::Event(event))) => Flow::Suspend(event),
                    (None, None) => Flow::MoreToDo,
                })
            }
        }
    }

    async fn rollback(&mut self, ctx: &mut Context<E>) -> Result<(), ProcError> {
        // A completed step is the newest journaled one; the step that failed (or may
        // have run unrecorded) is the one after the journal.
        let undo = ctx.undoing();
        let target = match undo {
            Undo::Completed => match self.journal.len().checked_sub(1) {
                Some(newest) => newest,
                None => return Ok(()),
            },
            _ => self.journal.len(),
        };
        let undoing = match undo {
            // A children step whose children did not all succeed (or whose values were
            // not copied yet): some of them may have.
            Undo::Completed if !self.journal[target].is_complete() => Undoing::Interrupted,
            Undo::Completed => Undoing::Completed(self.journal[target].value.clone()),
            Undo::Failed => Undoing::Failed,
            _ => Undoing::Interrupted,
        };
        let done = Arc::new(Mutex::new(None));
        {
            let mut sctx = SagaContext {
                ctx: &*ctx,
                journal: &self.journal,
                at: 0,
                pass: Pass::Rollback {
                    target,
                    undoing: Some(undoing),
                    done: done.clone(),
                },
                retry: None,
            };
            // Ends once the target's undo has returned (its step stops the pass there),
            // or earlier if `run` ends before another step.
            drive(self.saga.run(&mut sctx), || lock(&done).is_some()).await;
        }
        let Some(undone) = lock(&done).take() else {
            // `run` failed (or ended) before another step: nothing of it to undo.
            return Ok(());
        };
        undone?;
        if undo == Undo::Completed {
            self.journal.pop();
        }
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        self.saga.locks()
    }

    fn affinity(&self) -> Option<String> {
        self.saga.affinity()
    }

    fn holds_lock(&self) -> bool {
        self.saga.holds_lock()
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        self.saga.failure_policy(error)
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.saga.timeout_ms()
    }

    /// A saga waiting in [`SagaContext::wait_for_event`] when the engine stopped waits
    /// for the event again: its `run` cannot re-check what it waited for.
    fn rerun_after_recover(&self, _event: &str) -> bool {
        false
    }

    fn child_types() -> Vec<ChildType> {
        S::child_types()
    }

    fn state_name(&self) -> Option<String> {
        Some(match self.journal.last() {
            Some(last) => format!("after {:?} ({} steps)", last.name, self.journal.len()),
            None => "start".to_string(),
        })
    }

    fn rust_type_name(&self) -> &'static str {
        std::any::type_name::<S>()
    }
}
