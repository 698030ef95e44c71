//! The procedure model: the [`Procedure`] trait users implement, the [`Flow`] a step
//! returns, the seven [`ProcState`]s, and the [`Context`] a step runs with.
//!
//! This module is pure: a procedure is a value with async methods; nothing here knows how
//! or where it runs. The engine (`actors/`) calls `execute` once per step, persists the
//! procedure's serialized state after every step, and calls `rollback` once per executed
//! step in reverse order when the procedure's tree fails.

use std::any::{Any, TypeId};
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::cancel::{Cancel, CancelReason, Cancelled};
use crate::locks::Lock;

/// The identifier the engine gives a procedure when it is submitted (or, for a child,
/// when its parent's step returns it). Ids are never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ProcId(pub u64);

impl fmt::Display for ProcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Where a procedure is in its life. The names and meanings follow HBase Procedure v2.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ProcState {
    /// Submitted, not yet persisted and queued.
    Initializing,
    /// Ready to run its next step (queued or executing).
    Runnable,
    /// Waiting for its children to finish, or suspended on an event.
    Waiting,
    /// Sleeping until a deadline.
    WaitingTimeout,
    /// Failed and fully rolled back. Terminal.
    RolledBack,
    /// Finished every step. Terminal.
    Success,
    /// Failed; its tree is rolling back (or about to).
    Failed,
    /// Stopped by its [`FailurePolicy`] after a failed step, or by an operator's pause:
    /// persisted, holding its locks, running nothing until an operator continues it
    /// (the step runs again) or rolls it back.
    Paused,
    /// Its rollback failed and its [`FailurePolicy`] gave up retrying: the tree's
    /// rollback waits for an operator to continue it.
    RollbackPaused,
}

impl ProcState {
    /// Every state, in the order of a procedure's life.
    pub const ALL: [ProcState; 9] = [
        ProcState::Initializing,
        ProcState::Runnable,
        ProcState::Waiting,
        ProcState::WaitingTimeout,
        ProcState::Paused,
        ProcState::RollbackPaused,
        ProcState::Failed,
        ProcState::Success,
        ProcState::RolledBack,
    ];

    /// `true` for the two terminal states, [`ProcState::Success`] and
    /// [`ProcState::RolledBack`].
    pub fn is_finished(self) -> bool {
        matches!(self, ProcState::Success | ProcState::RolledBack)
    }
}

impl fmt::Display for ProcState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProcState::Initializing => "INITIALIZING",
            ProcState::Runnable => "RUNNABLE",
            ProcState::Waiting => "WAITING",
            ProcState::WaitingTimeout => "WAITING_TIMEOUT",
            ProcState::RolledBack => "ROLLEDBACK",
            ProcState::Success => "SUCCESS",
            ProcState::Failed => "FAILED",
            ProcState::Paused => "PAUSED",
            ProcState::RollbackPaused => "ROLLBACK_PAUSED",
        })
    }
}

/// A state's name as [`ProcState`] displays it, in any case, `-` for `_`:
///
/// ```
/// use proctor::ProcState;
/// assert_eq!("rollback-paused".parse(), Ok(ProcState::RollbackPaused));
/// assert!("done".parse::<ProcState>().unwrap_err().to_string().contains("expected one of"));
/// ```
impl std::str::FromStr for ProcState {
    type Err = UnknownState;

    fn from_str(name: &str) -> Result<Self, UnknownState> {
        let wanted = name.trim().to_uppercase().replace('-', "_");
        ProcState::ALL
            .into_iter()
            .find(|s| s.to_string() == wanted)
            .ok_or_else(|| UnknownState(name.to_string()))
    }
}

/// A name that is no [`ProcState`]'s (from its `FromStr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownState(pub String);

impl fmt::Display for UnknownState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown state {:?}: expected one of ", self.0)?;
        for (n, state) in ProcState::ALL.iter().enumerate() {
            if n > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{state}")?;
        }
        Ok(())
    }
}

impl std::error::Error for UnknownState {}

/// Why a procedure failed. Persisted with the procedure, and kept as its root's result
/// through the whole rollback, so it must be plain data.
///
/// Any `std::error::Error` converts into it, so `?` works inside a step; the error's
/// message, its type and its chain of sources are kept ([`ProcError::Error`]). (For
/// that, `ProcError` itself does not implement `std::error::Error`; it is `Display`,
/// and [`Failure`](crate::Failure), which carries it to the caller, is an error.)
///
/// An error can say more than what went wrong ([`ProcError::Marked`]): whether trying
/// the step again may help ([`ProcError::retryable`], [`ProcError::terminal`]; a
/// retryable error is retried under the step's [`RetryPolicy`] before it fails the
/// procedure), and a code the service matches on ([`ProcError::with_code`],
/// [`ProcError::coded`]), kept in the recorded [`Failure`](crate::Failure). An error
/// that says neither (a plain `?`, [`ProcError::failed`]) is left to the procedure's
/// [`failure_policy`](Procedure::failure_policy), which by default rolls the tree back
/// at once.
///
/// ```
/// use proctor::ProcError;
/// fn read_config() -> Result<String, ProcError> {
///     Ok(std::fs::read_to_string("/nonexistent/proctor.toml")?)
/// }
/// match read_config() {
///     Err(ProcError::Error { type_name, .. }) => assert!(type_name.contains("io")),
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ProcError {
    /// The procedure's own code reported a failure.
    Failed(String),
    /// An operator aborted the procedure and the procedure accepted the abort.
    Aborted,
    /// The procedure's timeout expired and [`Procedure::on_timeout`] chose to fail.
    TimedOut {
        /// The timeout that expired.
        timeout_ms: u64,
    },
    /// User code panicked; the engine caught the panic and kept running.
    Panicked {
        /// The method that panicked (`execute`, `rollback`, `abort`, ...).
        hook: String,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// The procedure (or a child it returned) could not be encoded or has no registered
    /// type, so its state could not be made durable.
    Persist(String),
    /// Waiting for its locks closed a wait-for cycle between trees, and this procedure's
    /// tree was the youngest in it. The text names every wait of the cycle.
    Deadlock(String),
    /// A Rust error a step returned with `?` (or converted with `ProcError::from`).
    Error {
        /// The error's message (its `Display`).
        message: String,
        /// Its type, as `std::any::type_name` gives it (`std::io::error::Error`).
        type_name: String,
        /// The messages of its sources, nearest first (`Error::source`, repeatedly).
        sources: Vec<String>,
    },
    /// An error with marks: whether it is worth trying again, and its code. Made by
    /// [`ProcError::retryable`], [`ProcError::terminal`], [`ProcError::with_code`] and
    /// [`ProcError::coded`] (marks on a marked error replace its marks, never nest);
    /// read with [`ProcError::kind`], [`ProcError::code`] and [`ProcError::cause`],
    /// the error itself. It displays as the error itself.
    #[non_exhaustive]
    Marked {
        /// The error itself.
        error: Box<ProcError>,
        /// Whether trying again may help; `None` when it does not say.
        #[serde(default)]
        kind: Option<ErrorKind>,
        /// Its code, for a service to match on.
        #[serde(default)]
        code: Option<String>,
    },
}

/// Whether a step's error is worth trying again ([`ProcError::kind`]). An error that
/// says neither is left to the procedure's
/// [`failure_policy`](Procedure::failure_policy) (by default: roll back at once).
///
/// | the procedure's policy | error not marked | [`Retryable`](ErrorKind::Retryable) | [`Terminal`](ErrorKind::Terminal) |
/// | --- | --- | --- | --- |
/// | [`Rollback`](FailurePolicy::Rollback) (default) | roll back | retry, then roll back | roll back |
/// | [`Pause`](FailurePolicy::Pause) | pause | retry, then pause | pause |
/// | [`RetryThenRollback`](FailurePolicy::RetryThenRollback) | retry, then roll back | retry, then roll back | roll back |
/// | [`RetryThenPause`](FailurePolicy::RetryThenPause) | retry, then pause | retry, then pause | pause |
///
/// A retryable error is retried under the [`RetryPolicy`] its step set
/// ([`Context::set_retry_policy`]), else under the procedure's retrying policy, else
/// under [`RetryPolicy::default`]. Past a point of no return
/// ([`Context::set_irreversible`]) "roll back" is "pause", as for any failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Trying the step again may succeed: a timeout, a refused connection, a server
    /// that is busy or has no leader yet. The step is retried (from the state recorded
    /// before it) under its retry policy before its failure counts.
    Retryable,
    /// Trying again will not help: a request the service refuses, something that
    /// already exists. Never retried, not even under a failure policy that retries.
    Terminal,
}

impl fmt::Display for ProcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProcError::Failed(message) | ProcError::Deadlock(message) => f.write_str(message),
            ProcError::Aborted => f.write_str("aborted by operator"),
            ProcError::TimedOut { timeout_ms } => write!(f, "timed out after {timeout_ms} ms"),
            ProcError::Panicked { hook, message } => write!(f, "panicked in {hook}: {message}"),
            ProcError::Persist(reason) => write!(f, "cannot persist procedure state: {reason}"),
            ProcError::Error {
                message, sources, ..
            } => {
                f.write_str(message)?;
                for source in sources {
                    write!(f, ": {source}")?;
                }
                Ok(())
            }
            ProcError::Marked { error, .. } => error.fmt(f),
        }
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for ProcError {
    fn from(error: E) -> Self {
        let mut sources = Vec::new();
        let mut next = error.source();
        while let Some(source) = next {
            sources.push(source.to_string());
            next = source.source();
        }
        ProcError::Error {
            message: error.to_string(),
            type_name: std::any::type_name::<E>().to_string(),
            sources,
        }
    }
}

impl ProcError {
    /// A failure reported by user code, from anything that displays.
    ///
    /// ```
    /// let e = proctor::ProcError::failed("region server unreachable");
    /// assert_eq!(e.to_string(), "region server unreachable");
    /// ```
    pub fn failed(message: impl fmt::Display) -> Self {
        ProcError::Failed(message.to_string())
    }

    /// `error` marked [retryable](ErrorKind::Retryable): trying the step again may
    /// succeed, so it is retried under the step's [`RetryPolicy`] before it fails the
    /// procedure. Takes any `std::error::Error` (or a `ProcError`), for `map_err`:
    ///
    /// ```
    /// use proctor::{ErrorKind, ProcError};
    /// fn connect() -> Result<(), std::io::Error> {
    ///     Err(std::io::ErrorKind::ConnectionRefused.into())
    /// }
    /// fn step() -> Result<(), ProcError> {
    ///     connect().map_err(ProcError::retryable)?;
    ///     Ok(())
    /// }
    /// let error = step().unwrap_err();
    /// assert_eq!(error.kind(), Some(ErrorKind::Retryable));
    /// assert!(matches!(error.cause(), ProcError::Error { type_name, .. } if type_name.contains("io")));
    /// ```
    pub fn retryable(error: impl Into<ProcError>) -> Self {
        error.into().marked(Some(ErrorKind::Retryable), None)
    }

    /// `error` marked [terminal](ErrorKind::Terminal): trying again will not help, so
    /// it is never retried, not even under a [`FailurePolicy`] that retries. Returned
    /// by a rollback, it calls the operator at once: the procedure is ROLLBACK_PAUSED
    /// without the rollback's retries (a rollback is never given up on its own).
    ///
    /// ```
    /// use proctor::{ErrorKind, ProcError};
    /// let error = ProcError::terminal(ProcError::failed("no such table"));
    /// assert_eq!(error.kind(), Some(ErrorKind::Terminal));
    /// assert_eq!(error.to_string(), "no such table");
    /// ```
    pub fn terminal(error: impl Into<ProcError>) -> Self {
        error.into().marked(Some(ErrorKind::Terminal), None)
    }

    /// A failure reported by user code, with a code a service matches on without
    /// reading the message: `"already_exists"` for an HTTP 409, say. The code is kept
    /// in the recorded [`Failure`](crate::Failure) ([`Failure::code`](crate::Failure::code)),
    /// through restarts. It says nothing of retrying: mark it
    /// [`terminal`](ProcError::terminal) under a policy that retries.
    ///
    /// ```
    /// use proctor::ProcError;
    /// let error = ProcError::with_code("already_exists", "table t1 exists");
    /// assert_eq!(error.code(), Some("already_exists"));
    /// assert_eq!(error.to_string(), "table t1 exists");
    /// ```
    pub fn with_code(code: impl Into<String>, message: impl fmt::Display) -> Self {
        ProcError::failed(message).coded(code)
    }

    /// This error with a code (see [`ProcError::with_code`]), replacing any it had.
    ///
    /// ```
    /// use proctor::{ErrorKind, ProcError};
    /// let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
    /// let error = ProcError::retryable(refused).coded("unavailable");
    /// assert_eq!((error.kind(), error.code()), (Some(ErrorKind::Retryable), Some("unavailable")));
    /// ```
    #[must_use]
    pub fn coded(self, code: impl Into<String>) -> Self {
        self.marked(None, Some(code.into()))
    }

    /// Whether trying again may help, if the error says ([`ProcError::retryable`],
    /// [`ProcError::terminal`]); `None` for an error that does not (a plain `?`,
    /// [`ProcError::failed`], the engine's own errors), which the procedure's
    /// [`failure_policy`](Procedure::failure_policy) decides alone.
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            ProcError::Marked { error, kind, .. } => kind.or_else(|| error.kind()),
            _ => None,
        }
    }

    /// `true` for an error marked [retryable](ErrorKind::Retryable).
    pub fn is_retryable(&self) -> bool {
        self.kind() == Some(ErrorKind::Retryable)
    }

    /// The error's code, if it has one ([`ProcError::with_code`], [`ProcError::coded`]).
    pub fn code(&self) -> Option<&str> {
        match self {
            ProcError::Marked { error, code, .. } => code.as_deref().or_else(|| error.code()),
            _ => None,
        }
    }

    /// The error itself, without its marks: what went wrong, to match on.
    pub fn cause(&self) -> &ProcError {
        match self {
            ProcError::Marked { error, .. } => error.cause(),
            other => other,
        }
    }

    /// This error with `kind` and `code` set where given, the others kept.
    fn marked(self, kind: Option<ErrorKind>, code: Option<String>) -> Self {
        match self {
            ProcError::Marked {
                error,
                kind: had_kind,
                code: had_code,
            } => ProcError::Marked {
                error,
                kind: kind.or(had_kind),
                code: code.or(had_code),
            },
            error => ProcError::Marked {
                error: Box::new(error),
                kind,
                code,
            },
        }
    }
}

/// How a step's [retryable](ErrorKind::Retryable) errors are retried: how many times,
/// and how long each retry waits. Set for a step with [`Context::set_retry_policy`];
/// without one, a retryable error is retried under the procedure's retrying
/// [`FailurePolicy`], or else under [`RetryPolicy::default`]: 5 retries, from 200 ms,
/// doubling up to 30 s.
///
/// The *n*-th retry (from 0) waits a time drawn evenly between zero and
/// `min(backoff_ms × 2ⁿ, max_delay_ms)` ("full jitter", so that procedures that failed
/// together do not retry together). Retries are counted in the procedure's record, so a
/// restart does not reset them; a retried step runs again from the state recorded
/// before it. Once the retries are spent, the error fails the procedure as the
/// procedure's policy says: its tree rolls back (or it pauses, under
/// [`FailurePolicy::Pause`], or past a point of no return).
///
/// ```
/// use proctor::RetryPolicy;
/// let policy = RetryPolicy::new(10).backoff_ms(50).max_delay_ms(2_000);
/// assert_eq!((policy.retries, policy.backoff_ms, policy.max_delay_ms), (10, 50, 2_000));
/// assert_eq!(RetryPolicy::default(), RetryPolicy::new(5).backoff_ms(200).max_delay_ms(30_000));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub struct RetryPolicy {
    /// How many times the step is retried (after its first attempt).
    pub retries: u32,
    /// The first retry's backoff, in milliseconds; it doubles with each retry.
    pub backoff_ms: u64,
    /// The longest backoff, in milliseconds.
    pub max_delay_ms: u64,
}

impl RetryPolicy {
    /// `retries` retries, with the default backoff (from 200 ms, doubling up to 30 s).
    pub const fn new(retries: u32) -> Self {
        RetryPolicy {
            retries,
            backoff_ms: 200,
            max_delay_ms: 30_000,
        }
    }

    /// The first retry's backoff, in milliseconds.
    #[must_use]
    pub const fn backoff_ms(mut self, backoff_ms: u64) -> Self {
        self.backoff_ms = backoff_ms;
        self
    }

    /// The longest backoff, in milliseconds.
    #[must_use]
    pub const fn max_delay_ms(mut self, max_delay_ms: u64) -> Self {
        self.max_delay_ms = max_delay_ms;
        self
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::new(5)
    }
}

/// What a failed step (or rollback) of a procedure leads to; see
/// [`Procedure::failure_policy`].
///
/// A retry waits a time drawn evenly between zero and its backoff ("full jitter", so
/// that procedures that failed together do not retry together); the backoff is
/// `backoff_ms`, doubling per retry (up to ten minutes). Retries are counted in the
/// procedure's record, so a restart does not reset them. A retried step runs again
/// from the state recorded before it, as after a crash: what the failed attempt changed
/// in the procedure's fields is discarded.
///
/// ```
/// use proctor::FailurePolicy;
/// let policy = FailurePolicy::RetryThenPause { times: 3, backoff_ms: 100 };
/// assert_ne!(policy, FailurePolicy::default());
/// assert_eq!(FailurePolicy::default(), FailurePolicy::Rollback);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FailurePolicy {
    /// Fail the procedure; its tree rolls back. For a failed rollback: retry it with
    /// backoff, up to [`ExecutorBuilder::rollback_retries`](crate::ExecutorBuilder::rollback_retries)
    /// times (20 by default), then stop in [`ProcState::RollbackPaused`] for an operator
    /// (rollback is never abandoned, nor taken as done).
    #[default]
    Rollback,
    /// Stop in [`ProcState::Paused`] (a failed rollback: [`ProcState::RollbackPaused`])
    /// and wait for an operator.
    Pause,
    /// Retry up to `times` times, then as [`FailurePolicy::Rollback`].
    RetryThenRollback {
        /// How many retries.
        times: u32,
        /// The first retry's delay, in milliseconds.
        backoff_ms: u64,
    },
    /// Retry up to `times` times, then as [`FailurePolicy::Pause`].
    RetryThenPause {
        /// How many retries.
        times: u32,
        /// The first retry's delay, in milliseconds.
        backoff_ms: u64,
    },
}

impl FailurePolicy {
    /// Whether it retries a failed step itself (`RetryThen…`).
    pub(crate) fn retries(self) -> bool {
        matches!(
            self,
            FailurePolicy::RetryThenRollback { .. } | FailurePolicy::RetryThenPause { .. }
        )
    }
}

/// What a procedure does when its deadline passes (see [`Procedure::on_timeout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnTimeout {
    /// Fail with [`ProcError::TimedOut`]; the tree rolls back.
    Fail,
    /// Keep going, with a new deadline this many milliseconds from now.
    Rearm(u64),
    /// Keep going, with no deadline any more.
    Continue,
}

/// What a step asks the engine to do next. `E` is the executor's environment type (see
/// [`Procedure`]): children run in the same executor as their parent.
#[non_exhaustive]
pub enum Flow<E = ()> {
    /// The procedure is finished. It becomes SUCCESS once that is durable.
    Done,
    /// Persist the new state and run another step.
    MoreToDo,
    /// Persist, start these children, and WAIT until all of them finish; then run the
    /// next step. An empty list behaves like [`Flow::Done`].
    Children(Vec<Box<dyn Procedure<E>>>),
    /// Persist, start these children (none is fine), and WAIT until any child of the
    /// procedure — from this step or an earlier one — succeeds; then run the next step,
    /// which sees in [`Context::children`] which have finished. With no child running
    /// the next step runs at once. For work that starts more children as earlier ones
    /// finish, as a [`Dag`](crate::Dag) does its tasks.
    ///
    /// Until its children have all finished, the procedure's steps may return only
    /// `WaitAny` or [`Flow::Children`] (which waits for all of them); any other flow fails
    /// the step. A wake writes nothing, so a step may also run again after a restart
    /// without a new child having finished: look at [`Context::children`] rather
    /// than count wakes.
    ///
    /// A rolling restart, two nodes at a time, each next one as soon as a slot frees:
    ///
    /// ```
    /// use proctor::{async_trait, Context, Flow, ProcError, ProcId, ProcState, Procedure};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Restart { node: u32 }
    ///
    /// #[async_trait]
    /// impl Procedure for Restart {
    ///     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
    ///         Ok(Flow::Done) // restart self.node...
    ///     }
    ///     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
    ///         Ok(())
    ///     }
    /// }
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct RollingRestart { nodes: u32, started: u32 }
    ///
    /// #[async_trait]
    /// impl Procedure for RollingRestart {
    ///     async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
    ///         let children = ctx.children();
    ///         let running = children.iter().filter(|(_, s)| *s != ProcState::Success).count();
    ///         if self.started == self.nodes && running == 0 {
    ///             return Ok(Flow::Done);
    ///         }
    ///         let room = 2usize.saturating_sub(running).min((self.nodes - self.started) as usize);
    ///         let next = (self.started..).take(room).map(|node| Restart { node });
    ///         self.started += room as u32;
    ///         Ok(Flow::wait_any(next))
    ///     }
    ///     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
    ///         Ok(())
    ///     }
    /// }
    ///
    /// // Its steps, as the engine would run them: two start, then one per finished.
    /// let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    /// let mut roll = RollingRestart { nodes: 3, started: 0 };
    /// let ctx = |children| Context::new(ProcId(1), None, ProcId(1), 0, Default::default())
    ///     .with_children(children);
    /// let spawned = |flow: Flow| match flow {
    ///     Flow::WaitAny(next) => next.len(),
    ///     other => panic!("{other:?}"),
    /// };
    /// assert_eq!(spawned(rt.block_on(roll.execute(&mut ctx(vec![]))).unwrap()), 2);
    /// let one_done = vec![(ProcId(2), ProcState::Success), (ProcId(3), ProcState::Runnable)];
    /// assert_eq!(spawned(rt.block_on(roll.execute(&mut ctx(one_done))).unwrap()), 1);
    /// ```
    WaitAny(Vec<Box<dyn Procedure<E>>>),
    /// Run again later, behind everything already queued (under the default
    /// [`Scheduling::Fair`](crate::Scheduling::Fair): behind every new or yielding
    /// procedure queued on its tree's level). Nothing is persisted and the step is not
    /// recorded for rollback, so a yielding step must not change state.
    Yield,
    /// Persist, then WAIT until the named event is woken
    /// (see [`WakeEvent`](crate::messages::WakeEvent)); then run the next step. If the event is
    /// already woken the procedure continues at once.
    Suspend(String),
    /// Persist, then sleep (WAITING_TIMEOUT) until this absolute time in milliseconds
    /// since the Unix epoch (compare [`Context::now_ms`]); then run the next step.
    SleepUntil(u64),
}

impl<E: Send + Sync + 'static> Flow<E> {
    /// [`Flow::Children`] of procedures of one type, boxed here: no
    /// `as Box<dyn Procedure<E>>` at the call. Children of several types go in
    /// `Flow::Children` boxed, or as an enum of them that implements [`Procedure`].
    ///
    /// ```
    /// use proctor::{async_trait, Context, Flow, ProcError, Procedure};
    /// use serde::{Deserialize, Serialize};
    ///
    /// #[derive(Serialize, Deserialize)]
    /// struct Assign { region: u32 }
    ///
    /// #[async_trait]
    /// impl Procedure for Assign {
    ///     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    ///     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// }
    ///
    /// let flow: Flow = Flow::children((0..3).map(|region| Assign { region }));
    /// assert!(matches!(flow, Flow::Children(c) if c.len() == 3));
    /// ```
    pub fn children<P: Procedure<E>>(children: impl IntoIterator<Item = P>) -> Self {
        Flow::Children(boxed(children))
    }

    /// [`Flow::WaitAny`] of procedures of one type, boxed here (see [`Flow::children`]).
    pub fn wait_any<P: Procedure<E>>(children: impl IntoIterator<Item = P>) -> Self {
        Flow::WaitAny(boxed(children))
    }

    /// The former name of [`Flow::wait_any`].
    #[deprecated(
        since = "0.1.0",
        note = "renamed `Flow::wait_any` (the variant is `Flow::WaitAny`)"
    )]
    pub fn spawn<P: Procedure<E>>(children: impl IntoIterator<Item = P>) -> Self {
        Self::wait_any(children)
    }
}

fn boxed<E: Send + Sync + 'static, P: Procedure<E>>(
    children: impl IntoIterator<Item = P>,
) -> Vec<Box<dyn Procedure<E>>> {
    children
        .into_iter()
        .map(|c| Box::new(c) as Box<dyn Procedure<E>>)
        .collect()
}

impl<E> fmt::Debug for Flow<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Flow::Done => f.write_str("Done"),
            Flow::MoreToDo => f.write_str("MoreToDo"),
            Flow::Children(c) => write!(f, "Children({})", c.len()),
            Flow::WaitAny(c) => write!(f, "WaitAny({})", c.len()),
            Flow::Yield => f.write_str("Yield"),
            Flow::Suspend(e) => write!(f, "Suspend({e:?})"),
            Flow::SleepUntil(t) => write!(f, "SleepUntil({t})"),
        }
    }
}

/// The answer of [`Procedure::acquire_lock`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockState {
    /// The lock is held: run the step.
    Acquired,
    /// The lock is not available: requeue the procedure behind the others and ask again.
    Yield,
}

/// What the step a rollback undoes did, as far as the engine knows
/// ([`Context::undoing`]): how far it saw the step get, not what in the world is the
/// step's. (A saga step's undo is told the same, as an
/// [`Undoing`](crate::Undoing) that carries the step's value when it completed: one
/// answer, two shapes, as a procedure's step keeps its value in its state and a saga
/// step returns it.) A rollback undoes only what its step did: a step that failed because what
/// it was to create already existed created nothing, and its rollback must not delete
/// what someone else made. No value tells that apart by itself (a failed step may have
/// written half its work; an interrupted one may have created the object, or found
/// someone else's): mark what a step creates with a token recorded before it acts —
/// the procedure's id serves — and undo only what carries it (the guide's "Rollbacks
/// undo only what their step did").
///
/// ```
/// use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// use serde::{Deserialize, Serialize};
/// use std::{collections::BTreeMap, sync::Mutex};
///
/// /// Directory → the procedure that created it, written with the directory.
/// struct Dirs(Mutex<BTreeMap<String, u64>>);
///
/// #[derive(Serialize, Deserialize)]
/// struct CreateDir { path: String }
///
/// #[async_trait]
/// impl Procedure<Dirs> for CreateDir {
///     async fn execute(&mut self, ctx: &mut Context<Dirs>) -> Result<Flow<Dirs>, ProcError> {
///         let me = ctx.id().0;
///         let mut dirs = ctx.env().0.lock().unwrap();
///         match dirs.get(&self.path) {
///             Some(&by) if by == me => {} // ours: this step ran before a crash
///             Some(_) => return Err(ProcError::failed(format!("{} exists", self.path))),
///             None => {
///                 dirs.insert(self.path.clone(), me); // created with its owner, at once
///             }
///         }
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, ctx: &mut Context<Dirs>) -> Result<(), ProcError> {
///         // Whatever `ctx.undoing()` says: completed, the directory is ours; failed,
///         // the step found someone else's; interrupted, either, or none at all.
///         let mut dirs = ctx.env().0.lock().unwrap();
///         if dirs.get(&self.path) == Some(&ctx.id().0) {
///             dirs.remove(&self.path);
///         }
///         Ok(())
///     }
/// }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum Undo {
    /// The step returned `Ok` (it ran to its end, whether or not the engine then took
    /// what it returned) and was recorded: it did all it does.
    #[default]
    Completed = 0,
    /// The step returned an error or panicked, and the engine saw it end: its own
    /// failure, or it stopped early because it was cancelled ([`Context::cancelled`]:
    /// an abort, or its tree failing elsewhere, cancels the steps that run). It did
    /// what it did before that, no more: nothing if it failed on a check before its
    /// first change, part of its work if it failed, panicked or was cancelled between
    /// (or in the middle of) its writes — and all of it if it returned `Ok` with a state
    /// (or a child) that does not encode, which the engine fails. Skip its undo only if
    /// no way of failing can come after the step's first change. The step whose
    /// failure rolls the tree back, a step that failed as its tree was failing, or a
    /// failed attempt that was to be retried (or was paused) when its tree failed.
    Failed = 1,
    /// Nothing recorded how far the step got: the process died (a crash, or
    /// [`Executor::shutdown_now`](crate::Executor::shutdown_now)), a graceful shutdown
    /// cancelled the step, or its actor was stopped, while it may have been running;
    /// and its tree failed (after the restart, or at it: `proctor abort` on a stopped
    /// engine rolls the tree back when it starts) before the step ran again, or as a
    /// later attempt of it failed, which may have done less than the one cut off. The
    /// step may have done all its work, part of it, none, or failed on its check,
    /// finding what someone else made: undo only what is there and carries the step's
    /// mark, checking first.
    Interrupted = 2,
}

/// Stored as one byte (a record's steering keeps it for the step that failed).
impl Serialize for Undo {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u8(*self as u8)
    }
}

impl<'de> Deserialize<'de> for Undo {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match u8::deserialize(d)? {
            0 => Ok(Undo::Completed),
            1 => Ok(Undo::Failed),
            2 => Ok(Undo::Interrupted),
            n => Err(serde::de::Error::custom(format!(
                "{n} is not a step's undo (0 completed, 1 failed, 2 interrupted)"
            ))),
        }
    }
}

impl fmt::Display for Undo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Undo::Completed => "completed",
            Undo::Failed => "failed",
            Undo::Interrupted => "interrupted",
        })
    }
}

/// What a step or rollback runs with: who the procedure is, the time, and the
/// environment `E` the service gave the executor (see [`Context::env`]).
///
/// Time comes in as a value so that a procedure never reads a clock of its own; tests
/// and replays can set it.
pub struct Context<E: ?Sized = ()> {
    id: ProcId,
    parent: Option<ProcId>,
    root: ProcId,
    now_ms: u64,
    env: Arc<E>,
    undo: Undo,
    unrecorded: bool,
    result: Option<Vec<u8>>,
    cancel: Option<Cancel>,
    shutdown: Option<Cancel>,
    irreversible: bool,
    /// Boxed, and only for a parent's steps: every call carries a context.
    children: Option<Box<[(ProcId, ProcState)]>>,
    /// The values its children that succeeded set; only for a parent's steps.
    child_values: Option<ChildValues>,
    /// The leader lease's epoch, when the executor leads through one.
    fencing_token: Option<i64>,
    /// The cluster partition the executor runs, when it runs one.
    partition: Option<u32>,
    /// The engine's remote dispatcher, when it has one.
    remote: Option<crate::remote::Sink>,
    /// Operations this step dispatched, for [`Context::await_remote`].
    dispatched: Vec<crate::remote::RemoteCall>,
    /// How this step's retryable errors are retried ([`Context::set_retry_policy`]).
    retry: Option<RetryPolicy>,
}

impl<E: ?Sized> Clone for Context<E> {
    fn clone(&self) -> Self {
        Context {
            id: self.id,
            parent: self.parent,
            root: self.root,
            now_ms: self.now_ms,
            env: Arc::clone(&self.env),
            undo: self.undo,
            unrecorded: self.unrecorded,
            result: self.result.clone(),
            cancel: self.cancel.clone(),
            shutdown: self.shutdown.clone(),
            irreversible: self.irreversible,
            children: self.children.clone(),
            child_values: self.child_values.clone(),
            fencing_token: self.fencing_token,
            partition: self.partition,
            remote: self.remote.clone(),
            dispatched: self.dispatched.clone(),
            retry: self.retry,
        }
    }
}

impl<E: ?Sized> fmt::Debug for Context<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("id", &self.id)
            .field("parent", &self.parent)
            .field("root", &self.root)
            .field("now_ms", &self.now_ms)
            .field("undo", &self.undo)
            .field("unrecorded", &self.unrecorded)
            .field("cancelled", &self.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl<E: ?Sized> Context<E> {
    /// The epoch of the leader lease this executor runs under
    /// ([`ExecutorBuilder::leadership`](crate::ExecutorBuilder)), `None` without one:
    /// a fencing token for the resources a step changes. The engine's own writes are
    /// fenced by the store; a step's effects on the world are not, and a leader that
    /// was stopped (a pause, a long GC, a SIGSTOP) inside a step may finish that step
    /// after a standby took over. Pass the token along with the change, and have the
    /// resource refuse a token lower than the highest it has seen: then a deposed
    /// leader's late effect is refused there too.
    ///
    /// ```
    /// use proctor::{Context, ProcId};
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()))
    ///     .with_fencing_token(Some(7));
    /// assert_eq!(ctx.fencing_token(), Some(7));
    /// ```
    pub fn fencing_token(&self) -> Option<i64> {
        self.fencing_token
    }

    /// The partition of a [cluster](crate::Cluster) this procedure's tree belongs to,
    /// `None` outside a cluster. There the [fencing token](Self::fencing_token) is the
    /// partition's epoch, which grows with each change of the partition's owner: tokens
    /// of one partition are ordered, tokens of two partitions are not, so a resource
    /// that checks tokens keeps the highest it has seen per partition.
    ///
    /// ```
    /// use proctor::{Context, ProcId};
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()))
    ///     .with_partition(Some(3))
    ///     .with_fencing_token(Some(12));
    /// assert_eq!((ctx.partition(), ctx.fencing_token()), (Some(3), Some(12)));
    /// ```
    pub fn partition(&self) -> Option<u32> {
        self.partition
    }

    /// The procedure's children, in the order it started them, each with its state
    /// when this call was dispatched: [`ProcState::Success`] for one whose success is
    /// durable, an unfinished state for one still running (or whose success is not
    /// recorded yet). Empty for a procedure that started
    /// none, and in a rollback. A step that follows a [`Flow::WaitAny`] looks here for
    /// which children it was woken for.
    ///
    /// ```
    /// use proctor::{Context, ProcId, ProcState};
    /// use std::sync::Arc;
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, Arc::new(()))
    ///     .with_children(vec![(ProcId(2), ProcState::Success), (ProcId(3), ProcState::Runnable)]);
    /// let done = ctx.children().iter().filter(|(_, s)| *s == ProcState::Success).count();
    /// assert_eq!(done, 1);
    /// ```
    pub fn children(&self) -> &[(ProcId, ProcState)] {
        self.children.as_deref().unwrap_or(&[])
    }

    /// The values this procedure's children set with [`Context::set_result`], decoded
    /// as `T`: one for each child whose success was durable when this step was
    /// dispatched and that set one, in the order the children were started. A
    /// parent's step after [`Flow::Children`] sees every child's; after
    /// [`Flow::WaitAny`], those that have succeeded so far. Empty in a rollback.
    ///
    /// ```
    /// use proctor::{Context, ProcId};
    /// # fn main() -> Result<(), proctor::ProcError> {
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()))
    ///     .with_child_value(ProcId(2), &"r-0")?
    ///     .with_child_value(ProcId(3), &"r-1")?;
    /// let regions: Vec<(ProcId, String)> = ctx.child_results()?;
    /// assert_eq!(regions[1], (ProcId(3), "r-1".to_string()));
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ProcError::Failed`] naming the child whose value does not decode as `T` (`?`
    /// in a step fails the step with it).
    pub fn child_results<T: DeserializeOwned>(&self) -> Result<Vec<(ProcId, T)>, ProcError> {
        self.child_values
            .iter()
            .flat_map(|values| values.iter())
            .map(|(id, bytes)| Ok((*id, decode_child_value(*id, bytes)?)))
            .collect()
    }

    /// The children's values as they were set (MessagePack), for the saga's journal.
    pub(crate) fn child_values(&self) -> impl Iterator<Item = (ProcId, &[u8])> {
        self.child_values
            .iter()
            .flat_map(|values| values.iter())
            .map(|(id, bytes)| (*id, &bytes[..]))
    }

    /// Queues a remote operation `op` for `target` through the transport `T` (the one
    /// given to [`ExecutorBuilder::remote`](crate::ExecutorBuilder::remote): `op` is of
    /// its [`Transport::Op`](crate::Transport::Op) type, checked by the compiler), for
    /// this step to wait on: return
    /// [`Context::await_remote`] at the end of the step. The operation is recorded with
    /// the step (a child procedure of its own, whose id is the operation's [`OpId`])
    /// before it is handed to the engine's dispatcher, which batches it with others for
    /// the same target and sends it through the executor's transport
    /// ([`ExecutorBuilder::remote`](crate::ExecutorBuilder::remote)). Operations
    /// dispatched in a step that does not return `await_remote` are dropped.
    ///
    /// The answer can give the operation its undo, sent should the tree roll back
    /// while the operation may have been applied ([`Dispatched::undo`]):
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, OpId, ProcError, Report, Transport, TransportError};
    /// # #[derive(serde::Serialize, serde::Deserialize)] enum RegionOp { Open(u32), Close(u32) }
    /// # struct Rpc;
    /// # #[async_trait] impl Transport for Rpc { type Op = RegionOp;
    /// #     async fn send(&self, _: &str, _: Vec<(OpId, RegionOp)>) -> Result<Vec<Report>, TransportError> { Ok(vec![]) } }
    /// # fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    /// // `Rpc` is the executor's transport (`Transport::Op = RegionOp`): naming it ties
    /// // the operation's type to it at compile time.
    /// ctx.dispatch::<Rpc>("rs-1", &RegionOp::Open(7))?.undo(&RegionOp::Close(7))?;
    /// ctx.dispatch::<Rpc>("rs-2", &RegionOp::Open(8))?; // left applied on a rollback
    /// Ok(ctx.await_remote())
    /// # }
    /// ```
    ///
    /// A value of another type than the transport's operations does not compile (it
    /// used to be sent, fail to decode at the transport, and fail the operation):
    ///
    /// ```compile_fail
    /// # use proctor::{async_trait, Context, Flow, OpId, ProcError, Report, Transport, TransportError};
    /// # #[derive(serde::Serialize, serde::Deserialize)] enum RegionOp { Open(u32), Close(u32) }
    /// # struct Rpc;
    /// # #[async_trait] impl Transport for Rpc { type Op = RegionOp;
    /// #     async fn send(&self, _: &str, _: Vec<(OpId, RegionOp)>) -> Result<Vec<Report>, TransportError> { Ok(vec![]) } }
    /// # fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    /// ctx.dispatch::<Rpc>("rs-1", &"open region 7")?; // expected `RegionOp`
    /// # Ok(ctx.await_remote()) }
    /// ```
    ///
    /// [`OpId`]: crate::OpId
    /// [`Dispatched::undo`]: crate::Dispatched::undo
    ///
    /// # Errors
    /// [`ProcError::Persist`] if `op` does not serialize.
    pub fn dispatch<T: crate::remote::Transport>(
        &mut self,
        target: impl Into<String>,
        op: &T::Op,
    ) -> Result<crate::remote::Dispatched<'_, T>, ProcError> {
        let op = rmp_serde::to_vec_named(op)
            .map_err(|e| ProcError::Persist(format!("remote operation: {e}")))?;
        let at = self.dispatched.len();
        self.dispatched
            .push(crate::remote::RemoteCall::new(target.into(), op));
        Ok(crate::remote::Dispatched::new(&mut self.dispatched[at]))
    }

    /// The outcomes of the remote operations this procedure waited for (see
    /// [`Context::dispatch`]), in the order its steps dispatched them: each reported
    /// value, or why there is none ([`RemoteError`](crate::RemoteError): the send kept
    /// failing until the deadline, the operation failed on its target, the target was
    /// removed, no report came in time). The step decides what a failure means: go
    /// on, dispatch again, or return an error (its tree rolls back).
    ///
    /// ```
    /// # use proctor::{Context, Flow, ProcError};
    /// # fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    /// for result in ctx.remote_results() {
    ///     let opened: bool = result.value()?; // a failed operation fails the step
    ///     assert!(opened, "{} on {}", result.op, result.target);
    /// }
    /// # Ok(Flow::Done) }
    /// ```
    pub fn remote_results(&self) -> Vec<crate::remote::RemoteResult> {
        self.child_values
            .iter()
            .flat_map(|values| values.iter())
            .filter_map(|(id, bytes)| crate::remote::Reported::decode((*id).into(), bytes))
            .collect()
    }

    /// The engine's remote dispatcher, for the remote operations' children.
    pub(crate) fn remote_sink(&self) -> Option<crate::remote::Sink> {
        self.remote.clone()
    }

    /// Gives the call the engine's remote dispatcher.
    #[must_use]
    pub(crate) fn with_remote(mut self, remote: Option<crate::remote::Sink>) -> Self {
        self.remote = remote;
        self
    }

    /// The value child `child` set with [`Context::set_result`], decoded as `T`;
    /// `None` if it has not succeeded (durably) by this step's dispatch, set none, or
    /// is not a child of this procedure.
    ///
    /// # Errors
    /// As [`Context::child_results`].
    pub fn child_result<T: DeserializeOwned>(&self, child: ProcId) -> Result<Option<T>, ProcError> {
        self.child_values
            .iter()
            .flat_map(|values| values.iter())
            .find(|(id, _)| *id == child)
            .map(|(id, bytes)| decode_child_value(*id, bytes))
            .transpose()
    }

    /// `true` once the engine asks the call to stop early;
    /// [`cancel_reason`](Self::cancel_reason) says why. Stopping is up to the step: return an error
    /// (typically [`ProcError::Aborted`]) or `Ok` as usual. (A saga step's `run` is
    /// dropped at the cancellation instead, unless it is
    /// [uncancellable](crate::SagaStep::uncancellable): see
    /// [`SagaContext::step`](crate::SagaContext::step).)
    ///
    /// - [`CancelReason::Abort`]: the procedure was aborted while the step ran. An
    ///   error fails the procedure and its tree rolls back, this step included; `Ok`
    ///   leaves the decision to the abort hook, as between steps. The abort is answered
    ///   once the step has returned. Also raised when the step's tree fails while it
    ///   runs (another procedure of the tree failed or was aborted): the tree rolls
    ///   back, this step included whatever it returns, once every running step of the
    ///   tree has returned, so a step that watches the signal lets the rollback begin
    ///   at once.
    /// - [`CancelReason::Shutdown`]: a graceful shutdown's drain deadline
    ///   ([`ExecutorBuilder::drain_timeout`](crate::ExecutorBuilder::drain_timeout))
    ///   passed with the step still running. An error is *not* recorded: the step runs
    ///   again after the restart, as after a crash (HBase treats an interrupted step
    ///   the same way); `Ok` is recorded as usual, if the engine is still there to
    ///   record it (it waits one more second).
    pub fn is_cancelled(&self) -> bool {
        self.cancel_reason().is_some()
    }

    /// Why the engine asks the call to stop early, if it does (see
    /// [`is_cancelled`](Self::is_cancelled)). An abort comes first when both apply.
    ///
    /// ```
    /// use proctor::{Cancel, CancelReason, Context, ProcId};
    /// let shutdown = Cancel::new();
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()))
    ///     .with_cancel(Cancel::new())
    ///     .with_shutdown(shutdown.clone());
    /// assert_eq!(ctx.cancel_reason(), None);
    /// shutdown.cancel();
    /// assert_eq!(ctx.cancel_reason(), Some(CancelReason::Shutdown));
    /// ```
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        if self.cancel.as_ref().is_some_and(Cancel::is_cancelled) {
            Some(CancelReason::Abort)
        } else if self.shutdown.as_ref().is_some_and(Cancel::is_cancelled) {
            Some(CancelReason::Shutdown)
        } else {
            None
        }
    }

    /// Completes when [`is_cancelled`](Self::is_cancelled) becomes `true`: race a long
    /// step's work against it.
    ///
    /// ```no_run
    /// # use proctor::{Context, Flow, ProcError};
    /// # async fn copy_region(_: &str) -> Result<(), ProcError> { Ok(()) }
    /// async fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    ///     tokio::select! {
    ///         copied = copy_region("r-17") => copied.map(|()| Flow::MoreToDo),
    ///         () = ctx.cancelled() => Err(ProcError::Aborted),
    ///     }
    /// }
    /// ```
    pub fn cancelled(&self) -> Cancelled {
        Cancelled::either(
            self.cancel.clone().unwrap_or_default(),
            self.shutdown.clone(),
        )
    }

    /// In [`Procedure::rollback`]: how far the engine saw the step this call undoes get
    /// — it completed, it failed (returned an error, panicked, or stopped early when
    /// cancelled), or it was interrupted with nothing recorded (see [`Undo`]). Undo
    /// only what it did: what carries the step's mark (the procedure's id), not
    /// whatever has the name it was to create — a step that failed on its check found
    /// someone else's, and an interrupted one may have. [`Undo::Completed`] outside a
    /// rollback.
    pub fn undoing(&self) -> Undo {
        self.undo
    }

    /// In [`Procedure::rollback`]: `true` when this call undoes a step that was never
    /// recorded: one that may have started before a crash (one such call for each
    /// procedure that may have been mid-step at the crash, when its tree fails before
    /// that step runs again; [`Undo::Interrupted`]), or one that failed and was to be
    /// retried, or paused ([`Undo::Failed`], or interrupted if a crash came first).
    /// The procedure's state is the one from before that step: a state machine rolls
    /// back the state it was about to run, not the one before.
    pub fn is_unrecorded_step(&self) -> bool {
        self.unrecorded
    }

    /// Sets the procedure's value, from any of its steps: the last value set wins. A
    /// root's goes to the caller with the result
    /// ([`Executor::wait_value`](crate::Executor::wait_value)) and is kept with the
    /// finished root as long as its result; a child's goes to its parent's next steps
    /// ([`Context::child_results`]) once the child has succeeded. It is recorded with
    /// the step (so it survives a restart). A step that fails or yields records
    /// nothing, its value included.
    ///
    /// ```
    /// use proctor::{Context, ProcId};
    /// let mut ctx = Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()));
    /// ctx.set_result(&("table-7", 12u32)).unwrap();
    /// ```
    ///
    /// # Errors
    /// [`ProcError::Persist`] if `value` does not serialize (its `Serialize` fails); the
    /// value set before, if any, is kept.
    pub fn set_result<T: Serialize>(&mut self, value: &T) -> Result<(), ProcError> {
        let bytes = rmp_serde::to_vec_named(value)
            .map_err(|e| ProcError::Persist(format!("result: {e}")))?;
        self.result = Some(bytes);
        Ok(())
    }

    /// In [`Procedure::execute`]: marks this step as the procedure's point of no return
    /// (PolarDB-X's CDC mark), recorded with the step. From then on a failure anywhere
    /// in its tree pauses the failing procedure ([`ProcState::Paused`]) instead of
    /// rolling the tree back, an abort is refused, and an operator's rollback is
    /// refused ("continue instead"): what is done can only be finished.
    pub fn set_irreversible(&mut self) {
        self.irreversible = true;
    }

    /// In [`Procedure::execute`]: how this step's [retryable](ProcError::retryable)
    /// errors are retried, in place of the procedure's retrying [`FailurePolicy`] or
    /// [`RetryPolicy::default`]. For this step only (a retry of it sets it again, as
    /// it runs the same code). Errors not marked retryable are not retried by it.
    ///
    /// ```
    /// # use proctor::{Context, Flow, ProcError, RetryPolicy};
    /// # async fn open_region(_: &str) -> Result<(), std::io::Error> { Ok(()) }
    /// async fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    ///     // Up to 10 retries, from 50 ms, backing off to at most 2 s.
    ///     ctx.set_retry_policy(RetryPolicy::new(10).backoff_ms(50).max_delay_ms(2_000));
    ///     open_region("r-17").await.map_err(ProcError::retryable)?;
    ///     Ok(Flow::Done)
    /// }
    /// ```
    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.retry = Some(policy);
    }

    /// The retry policy this step set ([`Context::set_retry_policy`]), if it did.
    pub fn retry_policy(&self) -> Option<RetryPolicy> {
        self.retry
    }

    /// The retry policy the step set, taken out.
    pub(crate) fn take_retry_policy(&mut self) -> Option<RetryPolicy> {
        self.retry.take()
    }

    /// Whether the step marked itself irreversible, taken out.
    pub(crate) fn take_irreversible(&mut self) -> bool {
        std::mem::take(&mut self.irreversible)
    }

    /// The value set by [`Context::set_result`], taken out.
    pub(crate) fn take_result(&mut self) -> Option<Vec<u8>> {
        self.result.take()
    }

    /// This procedure's id.
    pub fn id(&self) -> ProcId {
        self.id
    }

    /// The parent's id, `None` for a root procedure.
    pub fn parent(&self) -> Option<ProcId> {
        self.parent
    }

    /// The id of the root of this procedure's tree (its own id for a root).
    pub fn root(&self) -> ProcId {
        self.root
    }

    /// The engine's clock when the call started, in milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// The environment given to the executor's builder
    /// ([`ExecutorBuilder::env`](crate::ExecutorBuilder::env)): the service's clients,
    /// say. Its type is the executor's, checked by the compiler: a procedure that
    /// implements `Procedure<Cluster>` runs only in an `Executor<Cluster>`.
    ///
    /// ```
    /// use proctor::{Context, ProcId};
    /// use std::sync::Arc;
    /// struct Cluster { name: &'static str }
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, Arc::new(Cluster { name: "c1" }));
    /// assert_eq!(ctx.env().name, "c1");
    /// ```
    pub fn env(&self) -> &E {
        &self.env
    }

    /// The environment as the shared pointer the executor holds, for a step that hands
    /// it to a task of its own.
    pub fn env_arc(&self) -> &Arc<E> {
        &self.env
    }
}

/// Building a context by hand, for tests of a procedure's steps (the engine makes
/// one per call): the procedure's place, and what the engine gives a call.
impl<E: ?Sized> Context<E> {
    /// A context for a procedure; the engine makes one per call. Tests of a procedure's
    /// steps make their own:
    ///
    /// ```
    /// use proctor::{Context, ProcId};
    /// use std::sync::Arc;
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, Arc::new(()));
    /// assert_eq!(ctx.root(), ProcId(1));
    /// ```
    pub fn new(id: ProcId, parent: Option<ProcId>, root: ProcId, now_ms: u64, env: Arc<E>) -> Self {
        Context {
            id,
            parent,
            root,
            now_ms,
            env,
            undo: Undo::Completed,
            unrecorded: false,
            result: None,
            cancel: None,
            shutdown: None,
            irreversible: false,
            children: None,
            child_values: None,
            fencing_token: None,
            partition: None,
            remote: None,
            dispatched: Vec::new(),
            retry: None,
        }
    }

    /// Gives the call the cluster partition it runs in (see [`Context::partition`]).
    /// For tests of a step's own handling.
    #[must_use]
    pub fn with_partition(mut self, partition: Option<u32>) -> Self {
        self.partition = partition;
        self
    }

    /// Gives the call the executor's fencing token (see [`Context::fencing_token`]).
    /// For tests of a step's own handling.
    #[must_use]
    pub fn with_fencing_token(mut self, token: Option<i64>) -> Self {
        self.fencing_token = token;
        self
    }

    /// Gives the call the procedure's children as they were when it was dispatched
    /// (see [`Context::children`]). For tests of a parent's steps.
    #[must_use]
    pub fn with_children(mut self, children: Vec<(ProcId, ProcState)>) -> Self {
        self.children = Some(children.into_boxed_slice());
        self
    }

    /// Gives the call the values its children that succeeded set (see
    /// [`Context::child_results`]), each as MessagePack (as
    /// `rmp_serde::to_vec_named` writes it). For tests of a parent's steps.
    #[must_use]
    pub fn with_child_values(mut self, values: Vec<(ProcId, Vec<u8>)>) -> Self {
        self.child_values = (!values.is_empty()).then(|| values.into_boxed_slice());
        self
    }

    /// Adds the value one child set, as its [`Context::set_result`] would have stored
    /// it, after those given so far (see [`Context::child_results`]). For tests of a
    /// parent's steps.
    ///
    /// # Errors
    /// [`ProcError::Persist`] if `value` does not serialize, as `set_result` would say.
    pub fn with_child_value<T: Serialize>(
        mut self,
        child: ProcId,
        value: &T,
    ) -> Result<Self, ProcError> {
        let bytes = rmp_serde::to_vec_named(value)
            .map_err(|e| ProcError::Persist(format!("child {child}'s value: {e}")))?;
        let mut values = self.child_values.take().map(Vec::from).unwrap_or_default();
        values.push((child, bytes));
        self.child_values = Some(values.into_boxed_slice());
        Ok(self)
    }

    /// Gives the call a cancellation signal (the engine gives each step one; see
    /// [`Context::cancelled`]).
    #[must_use]
    pub fn with_cancel(mut self, cancel: Cancel) -> Self {
        self.cancel = Some(cancel);
        self
    }

    /// Gives the call the engine's shutdown signal (the engine gives every call one;
    /// see [`Context::cancel_reason`]). For tests of a step's own handling.
    #[must_use]
    pub fn with_shutdown(mut self, shutdown: Cancel) -> Self {
        self.shutdown = Some(shutdown);
        self
    }

    /// Tells a rollback call what the step it undoes did (see [`Context::undoing`]).
    /// The engine sets it; tests of a procedure's rollback set it themselves.
    ///
    /// ```
    /// use proctor::{Context, ProcId, Undo};
    /// let ctx = Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()))
    ///     .undoing_step(Undo::Failed);
    /// assert_eq!(ctx.undoing(), Undo::Failed);
    /// ```
    #[must_use]
    pub fn undoing_step(mut self, undo: Undo) -> Self {
        self.undo = undo;
        self
    }

    /// Marks a rollback call as undoing the unrecorded step (see
    /// [`Context::is_unrecorded_step`]).
    #[must_use]
    pub fn for_unrecorded_step(mut self) -> Self {
        self.unrecorded = true;
        self
    }
}

impl<E: Send + Sync + 'static> Context<E> {
    /// Ends a step that dispatched remote operations ([`Context::dispatch`]): the
    /// procedure waits until every one has an outcome, and its next step reads them
    /// ([`Context::remote_results`]). With none dispatched the procedure is done (as
    /// an empty [`Flow::Children`]).
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, OpId, ProcError, Report, Transport, TransportError};
    /// # #[derive(serde::Serialize, serde::Deserialize)] enum RegionOp { Open(u32), Close(u32) }
    /// # struct Rpc;
    /// # #[async_trait] impl Transport for Rpc { type Op = RegionOp;
    /// #     async fn send(&self, _: &str, _: Vec<(OpId, RegionOp)>) -> Result<Vec<Report>, TransportError> { Ok(vec![]) } }
    /// # fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    /// ctx.dispatch::<Rpc>("rs-1", &RegionOp::Open(1))?;
    /// ctx.dispatch::<Rpc>("rs-2", &RegionOp::Open(2))?;
    /// Ok(ctx.await_remote())
    /// # }
    /// ```
    pub fn await_remote(&mut self) -> Flow<E> {
        Flow::Children(
            std::mem::take(&mut self.dispatched)
                .into_iter()
                .map(|call| Box::new(call) as Box<dyn Procedure<E>>)
                .collect(),
        )
    }
}

impl Context<dyn Any + Send + Sync> {
    /// The engine's type-erased context as the typed one a procedure of environment `E`
    /// receives.
    ///
    /// # Panics
    /// If the environment is not an `E`. The engine cannot get there: an
    /// `Executor<E>` holds an `E` and accepts only `Procedure<E>`s (its builder, its
    /// registry, its `Submit` messages and a procedure's children are all typed by
    /// `E`), so a mismatch is a bug in the engine, not in its user.
    pub(crate) fn typed<E: Any + Send + Sync>(&self) -> Context<E> {
        let env = Arc::clone(&self.env).downcast::<E>().unwrap_or_else(|_| {
            panic!(
                "proctor bug: a procedure for environment {} got another one",
                std::any::type_name::<E>()
            )
        });
        Context {
            id: self.id,
            parent: self.parent,
            root: self.root,
            now_ms: self.now_ms,
            env,
            undo: self.undo,
            unrecorded: self.unrecorded,
            result: None,
            cancel: self.cancel.clone(),
            shutdown: self.shutdown.clone(),
            irreversible: false,
            children: self.children.clone(),
            child_values: self.child_values.clone(),
            fencing_token: self.fencing_token,
            partition: self.partition,
            remote: self.remote.clone(),
            dispatched: Vec::new(),
            retry: None,
        }
    }
}

/// Each child that set a value, with the value (MessagePack).
type ChildValues = Box<[(ProcId, Vec<u8>)]>;

/// A child's value as the type its parent asked for.
fn decode_child_value<T: DeserializeOwned>(child: ProcId, bytes: &[u8]) -> Result<T, ProcError> {
    rmp_serde::from_slice(bytes).map_err(|e| {
        ProcError::failed(format!(
            "the value of child {child} does not decode as {}: {e}",
            std::any::type_name::<T>()
        ))
    })
}

/// A procedure type another one may start as a child (see [`Procedure::child_types`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChildType {
    pub(crate) type_id: TypeId,
    pub(crate) rust_type: &'static str,
}

impl ChildType {
    /// The procedure type `P`.
    pub fn of<P: Any>() -> Self {
        ChildType {
            type_id: TypeId::of::<P>(),
            rust_type: std::any::type_name::<P>(),
        }
    }

    /// Its Rust type name.
    pub fn rust_type(&self) -> &'static str {
        self.rust_type
    }
}

/// Encodes a procedure's state for the store. Implemented for every `Serialize` type, so
/// a procedure only derives `Serialize`; it exists so that `dyn Procedure` can encode.
pub trait EncodeState {
    /// The state as MessagePack with field names (so that fields can be added later
    /// with `#[serde(default)]` and old logs still decode).
    ///
    /// # Errors
    /// The encoder's error if the state does not serialize (its `Serialize` fails).
    fn encode_state(&self) -> Result<Vec<u8>, rmp_serde::encode::Error>;

    /// [`encode_state`](EncodeState::encode_state), appended to `out`: what the engine
    /// calls at every step, with a buffer it reuses.
    ///
    /// # Errors
    /// As [`encode_state`](EncodeState::encode_state); `out` may then hold part of the
    /// encoding.
    fn encode_state_into(&self, out: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error> {
        out.extend(self.encode_state()?);
        Ok(())
    }
}

impl<T: Serialize> EncodeState for T {
    fn encode_state(&self) -> Result<Vec<u8>, rmp_serde::encode::Error> {
        rmp_serde::to_vec_named(self)
    }

    fn encode_state_into(&self, out: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error> {
        rmp_serde::encode::write_named(out, self)
    }
}

/// A multi-step operation that must end fully done or fully undone.
///
/// The engine calls [`execute`](Procedure::execute) once per step and makes the
/// procedure's new state durable before it runs the next step, starts children, or wakes
/// a parent. After a crash the step that was running is executed again, so **steps must
/// be idempotent**. When the procedure's tree fails, the engine calls
/// [`rollback`](Procedure::rollback) once for every step this procedure executed
/// (including the one that failed), newest first; rollbacks must be idempotent too.
///
/// Register every procedure type with a [`Registry`](crate::Registry) under a stable name,
/// so that persisted state decodes back into the right type.
///
/// `E` is the environment the executor gives every call ([`Context::env`]): the
/// service's clients, say. It defaults to `()`, for procedures that need none; a
/// procedure that needs one implements `Procedure<Cluster>` and then runs only in an
/// `Executor<Cluster>` (HBase's `Procedure<TEnvironment>`), which the compiler checks.
///
/// ```
/// use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct Greet { done: bool }
///
/// #[async_trait]
/// impl Procedure for Greet {
///     async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
///         println!("hello from procedure {}", ctx.id());
///         self.done = true;
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
///         self.done = false;
///         Ok(())
///     }
/// }
/// ```
///
/// With an environment:
///
/// ```
/// use proctor::{async_trait, Context, Flow, ProcError, Procedure};
/// use serde::{Deserialize, Serialize};
///
/// struct Cluster { region_servers: Vec<String> }
///
/// #[derive(Serialize, Deserialize)]
/// struct CountServers { seen: usize }
///
/// #[async_trait]
/// impl Procedure<Cluster> for CountServers {
///     async fn execute(&mut self, ctx: &mut Context<Cluster>) -> Result<Flow<Cluster>, ProcError> {
///         self.seen = ctx.env().region_servers.len();
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, _ctx: &mut Context<Cluster>) -> Result<(), ProcError> {
///         Ok(())
///     }
/// }
/// ```
///
/// ([`environment!`](crate::environment) names `Cluster` once for a module, so its
/// signatures read `Context` and `Flow`.)
///
/// The `impl` needs `#[async_trait]` (re-exported as `proctor::async_trait`), as the
/// trait has it: without it the compiler says that the "lifetime parameters or bounds
/// on method `execute` do not match the trait declaration" (E0195), which means this.
///
/// ```compile_fail,E0195
/// # use proctor::{Context, Flow, ProcError, Procedure};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct Forgot;
/// impl Procedure for Forgot { // no #[async_trait]
///     async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> {
///         Ok(())
///     }
/// }
/// ```
///
/// A procedure for one environment does not go into an executor of another: this does
/// not compile.
///
/// ```compile_fail,E0277
/// # use proctor::{async_trait, Context, Executor, Flow, ProcError, Procedure};
/// # #[derive(serde::Serialize)] struct Cluster;
/// #[derive(serde::Serialize)]
/// struct NeedsCluster;
/// #[async_trait]
/// impl Procedure<Cluster> for NeedsCluster {
///     async fn execute(&mut self, _: &mut Context<Cluster>) -> Result<Flow<Cluster>, ProcError> {
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, _: &mut Context<Cluster>) -> Result<(), ProcError> {
///         Ok(())
///     }
/// }
/// async fn submit(executor: Executor) {
///     let _ = executor.submit(NeedsCluster).await; // an Executor<()>
/// }
/// ```
#[async_trait]
pub trait Procedure<E = ()>: EncodeState + Any + Send + 'static
where
    E: Send + Sync + 'static,
{
    /// Runs one step. An `Err` fails the procedure and rolls back its tree; a panic is
    /// caught and treated the same way. Unless the error is
    /// [retryable](ProcError::retryable) (the step runs again first) or the
    /// [`failure_policy`](Procedure::failure_policy) says otherwise.
    async fn execute(&mut self, ctx: &mut Context<E>) -> Result<Flow<E>, ProcError>;

    /// Undoes one executed step. Called once per executed step, newest first — the step
    /// that failed included — and after a crash possibly once more first, for a step
    /// that may have started but was never recorded. [`Context::undoing`] says which:
    /// a step that [completed](Undo::Completed), the one that [failed](Undo::Failed)
    /// (undo only what it did before failing), or one
    /// [interrupted](Undo::Interrupted). An `Err` (or a panic) is retried with backoff,
    /// and past the limit ([`FailurePolicy::Rollback`]) the procedure waits in
    /// [`ProcState::RollbackPaused`] for an operator: rollback is never abandoned, and a
    /// step counts as undone only once a call returns `Ok`. After an `Err` the retry is
    /// called on the procedure as the failed call left it (keep in its fields what the
    /// retry must know); after a panic, on the procedure as recorded before that call
    /// (whatever the call changed is discarded).
    async fn rollback(&mut self, ctx: &mut Context<E>) -> Result<(), ProcError>;

    /// An operator asks to abort. Return `true` to accept: the procedure then fails with
    /// [`ProcError::Aborted`] before its next step and its tree rolls back. Called only
    /// between steps, with the procedure's context (its id, its tree, the time, the
    /// environment). The default accepts.
    fn abort(&mut self, _ctx: &Context<E>) -> bool {
        true
    }

    /// The key that places this root in a partition of a [cluster](crate::Cluster):
    /// every root with the same key runs in the same partition, so on the same executor
    /// and under one lock table. The default is the resource of its first
    /// [lock](Procedure::locks), so roots that lock the same resource meet; one
    /// without locks has none, and runs where it is submitted (or where its nonce
    /// places it). Locks are honoured only within a partition: roots that lock
    /// resources of one hierarchy (`ns` and `ns/t1`), or several resources that other
    /// roots lock apart, need a key that puts them together (the table's name for every
    /// procedure on that table). Asked once, when the root is submitted to a cluster;
    /// an executor outside a cluster never asks.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, Lock, ProcError, Procedure};
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct SplitRegion { table: String, region: u32 }
    /// #[async_trait]
    /// impl Procedure for SplitRegion {
    ///     # async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    ///     # async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    ///     fn locks(&self) -> Vec<Lock> {
    ///         vec![Lock::exclusive(format!("table/{}/region/{}", self.table, self.region))]
    ///     }
    ///     // With every procedure on the table, whichever region it locks.
    ///     fn affinity(&self) -> Option<String> {
    ///         Some(format!("table/{}", self.table))
    ///     }
    /// }
    /// ```
    fn affinity(&self) -> Option<String> {
        self.locks().into_iter().next().map(|lock| lock.resource)
    }

    /// The resources this procedure needs, and how (see [`Lock`]). Asked once, when the
    /// procedure is submitted (or returned by its parent's step), and persisted with it.
    /// The engine grants them all together, never some, before each step (and each
    /// rollback step); with [`holds_lock`](Procedure::holds_lock) from the first step
    /// until the procedure finishes, through its rollback. A procedure waiting for
    /// locks holds no worker. Locks its ancestors hold do not block it, so a child
    /// needs to declare only what its parent does not cover. The default is none.
    ///
    /// ```
    /// use proctor::{async_trait, Context, Flow, Lock, ProcError, Procedure};
    /// # use serde::{Deserialize, Serialize};
    /// #[derive(Serialize, Deserialize)]
    /// struct SplitRegion { table: String, region: String }
    ///
    /// #[async_trait]
    /// impl Procedure for SplitRegion {
    ///     fn locks(&self) -> Vec<Lock> {
    ///         vec![
    ///             Lock::shared(format!("ns/{}", self.table)),
    ///             Lock::exclusive(format!("ns/{}/{}", self.table, self.region)),
    ///         ]
    ///     }
    ///     fn holds_lock(&self) -> bool {
    ///         true
    ///     }
    ///     async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
    ///         Ok(Flow::Done)
    ///     }
    ///     async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
    ///         Ok(())
    ///     }
    /// }
    /// ```
    fn locks(&self) -> Vec<Lock> {
        Vec::new()
    }

    /// Called before each step (or once, if [`holds_lock`](Procedure::holds_lock)).
    /// Returning [`LockState::Yield`] requeues the procedure without running the step.
    fn acquire_lock(&mut self, _ctx: &Context<E>) -> LockState {
        LockState::Acquired
    }

    /// Releases what [`acquire_lock`](Procedure::acquire_lock) took. Called after each
    /// step, or only when the procedure finishes if it holds its lock.
    fn release_lock(&mut self, _ctx: &Context<E>) {}

    /// `true` to keep the lock (the engine's [`locks`](Procedure::locks) and the
    /// [`acquire_lock`](Procedure::acquire_lock) hook's) from the first step until the
    /// procedure finishes.
    fn holds_lock(&self) -> bool {
        false
    }

    /// Called on a recovered procedure before the engine resumes it after a restart
    /// (children before parents, while the store is being loaded), with its context.
    fn before_recover(&mut self, _ctx: &Context<E>) {}

    /// Called on a recovered procedure once the whole store is loaded, with its
    /// context, before its first call after the restart: when the engine first has
    /// work for it (its step is dispatched, a rollback, an abort, a timeout, an
    /// operator's command), not for every recovered procedure at the start, so a
    /// procedure that waits on after a restart (for an event, its children, a timer)
    /// is not called until it is woken.
    fn after_recover(&mut self, _ctx: &Context<E>) {}

    /// For a procedure that was suspended on `event` when the engine stopped. Whether
    /// an event was woken is not persisted (events live in the service's memory), so by
    /// default (`true`) the procedure runs its next step at once after a restart: that
    /// step re-checks what it waited for and suspends again if it must. `false` suspends
    /// it on the event again, until the service wakes it.
    fn rerun_after_recover(&self, _event: &str) -> bool {
        true
    }

    /// What a failed step (an `Err` or a panic from [`execute`](Procedure::execute)) or
    /// a failed [`rollback`](Procedure::rollback) leads to: roll back (the default),
    /// pause for an operator, or retry first (see [`FailurePolicy`]). Asked on the
    /// procedure as the failed call left it. A step's error marked
    /// [retryable](ProcError::retryable) is retried before the policy's end, and one
    /// marked [terminal](ProcError::terminal) is not retried (see [`ErrorKind`]).
    ///
    /// ```
    /// # use proctor::{FailurePolicy, ProcError};
    /// # struct MoveRegion;
    /// # impl MoveRegion {
    /// fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
    ///     match error.cause() {
    ///         // A region server that does not answer may come back: try again, and
    ///         // let an operator look if it does not.
    ///         ProcError::Error { type_name, .. } if type_name.contains("io") => {
    ///             FailurePolicy::RetryThenPause { times: 5, backoff_ms: 200 }
    ///         }
    ///         _ => FailurePolicy::Rollback,
    ///     }
    /// }
    /// # }
    /// ```
    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        FailurePolicy::Rollback
    }

    /// Called once when the procedure has finished (SUCCESS or ROLLEDBACK) and its final
    /// state is durable, with its context.
    fn completion_cleanup(&mut self, _ctx: &Context<E>) {}

    /// The name of the state the procedure is in, for operators (HBase's
    /// `toStringState`): shown by [`Executor::state`](crate::Executor::state) and
    /// `list` as [`ProcInfo::state_name`](crate::ProcInfo::state_name). Asked when a
    /// child is inserted, after a step that leaves the procedure waiting (for children,
    /// an event or a timer), yielding, failed or done, and once a second while it runs
    /// on from step to step (at its first step in each second), so what operators see
    /// of a running procedure is at most a second old; keep it cheap.
    /// [`StateMachine`](crate::StateMachine) gives the current state's `Debug` name.
    fn state_name(&self) -> Option<String> {
        None
    }

    /// The name of what the next step runs, for its `step` span's `state` field (asked
    /// before each step, only when that span is enabled). By default
    /// [`state_name`](Self::state_name); [`StateMachine`](crate::StateMachine) gives the
    /// state the step runs, where its `state_name` between steps also names the one
    /// that ran last.
    fn step_name(&self) -> Option<String> {
        self.state_name()
    }

    /// `true` to go behind the other queued procedures after each step instead of
    /// running the next step at once.
    fn is_yield_after_execution(&self) -> bool {
        false
    }

    /// A time limit for the procedure, in milliseconds from submission, whatever it is
    /// doing: running steps, waiting for its children, suspended on an event, or
    /// sleeping. Asked once, when the procedure is submitted (or returned by its
    /// parent's step); the deadline is absolute and persisted, so a restart does not
    /// reset it, and one that passed while the engine was down expires at once.
    fn timeout_ms(&self) -> Option<u64> {
        None
    }

    /// Called (never during a step or a rollback: then when it ends) when the deadline
    /// from [`timeout_ms`](Procedure::timeout_ms), or the last re-armed one, has passed.
    /// [`OnTimeout::Fail`] (the default) fails the procedure with
    /// [`ProcError::TimedOut`], and its tree rolls back; [`OnTimeout::Rearm`] keeps it
    /// going (sleeping, suspended or waiting as it was) with a new deadline — the
    /// retry-with-backoff pattern; [`OnTimeout::Continue`] keeps it going with none. The
    /// procedure's state after the call is persisted with the new deadline.
    ///
    /// ```
    /// use proctor::{Context, OnTimeout};
    /// # struct Probe { attempts: u32 }
    /// # impl Probe {
    /// fn on_timeout(&mut self, ctx: &Context) -> OnTimeout {
    ///     tracing::info!(proc = %ctx.id(), attempts = self.attempts, "probe timed out");
    ///     self.attempts += 1;
    ///     if self.attempts <= 5 {
    ///         OnTimeout::Rearm(100 << self.attempts) // back off, then look again
    ///     } else {
    ///         OnTimeout::Fail
    ///     }
    /// }
    /// # }
    /// ```
    fn on_timeout(&mut self, _ctx: &Context<E>) -> OnTimeout {
        OnTimeout::Fail
    }

    /// The types of the children this procedure may start ([`ChildType::of`]). An
    /// executor whose registry lacks one of them refuses to start, naming it, rather
    /// than fail a tree the first time a step returns such a child. Optional: a child
    /// of an unregistered type fails its tree either way. [`Dag`](crate::Dag) declares
    /// its tasks' type.
    ///
    /// ```
    /// # use proctor::{async_trait, ChildType, Context, Flow, ProcError, Procedure};
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct AssignRegion;
    /// # #[async_trait] impl Procedure for AssignRegion {
    /// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> { Ok(Flow::Done) }
    /// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct CreateTable;
    /// # #[async_trait] impl Procedure for CreateTable {
    /// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
    /// #       Ok(Flow::children([AssignRegion])) }
    /// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// fn child_types() -> Vec<ChildType> {
    ///     vec![ChildType::of::<AssignRegion>()]
    /// }
    /// # }
    /// ```
    fn child_types() -> Vec<ChildType>
    where
        Self: Sized,
    {
        Vec::new()
    }

    /// The Rust type name, for error messages. Do not override.
    #[doc(hidden)]
    fn rust_type_name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
}

/// The `TypeId` of the concrete type behind a `dyn Procedure`.
pub(crate) fn type_id_of<E: Send + Sync + 'static>(proc: &dyn Procedure<E>) -> TypeId {
    let any: &dyn Any = proc;
    any.type_id()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_print_like_hbase() {
        let cases = [
            (ProcState::Initializing, "INITIALIZING", false),
            (ProcState::Runnable, "RUNNABLE", false),
            (ProcState::Waiting, "WAITING", false),
            (ProcState::WaitingTimeout, "WAITING_TIMEOUT", false),
            (ProcState::RolledBack, "ROLLEDBACK", true),
            (ProcState::Success, "SUCCESS", true),
            (ProcState::Failed, "FAILED", false),
            (ProcState::Paused, "PAUSED", false),
            (ProcState::RollbackPaused, "ROLLBACK_PAUSED", false),
        ];
        for (state, name, finished) in cases {
            assert_eq!(state.to_string(), name);
            assert_eq!(state.is_finished(), finished, "{name}");
        }
    }

    #[test]
    fn errors_name_what_happened() {
        let cases = [
            (ProcError::failed("disk full"), "disk full"),
            (ProcError::Aborted, "aborted by operator"),
            (
                ProcError::TimedOut { timeout_ms: 50 },
                "timed out after 50 ms",
            ),
            (
                ProcError::Panicked {
                    hook: "execute".into(),
                    message: "boom".into(),
                },
                "panicked in execute: boom",
            ),
        ];
        for (err, text) in cases {
            assert_eq!(err.to_string(), text);
        }
    }

    #[test]
    fn marks_on_an_error_replace_its_marks_and_never_hide_it() {
        use ErrorKind::{Retryable, Terminal};
        let io = || ProcError::from(std::io::Error::other("refused"));
        // (error, its kind, its code, its cause, its text)
        let cases = [
            (io(), None, None, io(), "refused"),
            (
                ProcError::retryable(io()),
                Some(Retryable),
                None,
                io(),
                "refused",
            ),
            (
                ProcError::terminal(io()),
                Some(Terminal),
                None,
                io(),
                "refused",
            ),
            (
                ProcError::with_code("exists", "t1 exists"),
                None,
                Some("exists"),
                ProcError::failed("t1 exists"),
                "t1 exists",
            ),
            // A later mark replaces one of the same sort and keeps the others.
            (
                ProcError::terminal(ProcError::retryable(io()).coded("a")),
                Some(Terminal),
                Some("a"),
                io(),
                "refused",
            ),
            (
                ProcError::retryable(io()).coded("a").coded("b"),
                Some(Retryable),
                Some("b"),
                io(),
                "refused",
            ),
            (
                ProcError::Aborted.coded("stop"),
                None,
                Some("stop"),
                ProcError::Aborted,
                "aborted by operator",
            ),
        ];
        for (error, kind, code, cause, text) in cases {
            assert_eq!(error.kind(), kind, "{error:?}");
            assert_eq!(error.is_retryable(), kind == Some(Retryable), "{error:?}");
            assert_eq!(error.code(), code, "{error:?}");
            assert_eq!(error.cause(), &cause, "{error:?}");
            assert_eq!(error.to_string(), text, "{error:?}");
            // One layer of marks at most.
            if let ProcError::Marked { error: inner, .. } = &error {
                assert!(!matches!(**inner, ProcError::Marked { .. }), "{error:?}");
            }
        }
    }
}
