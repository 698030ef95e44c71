//! Remote operations (HBase's `RemoteProcedureDispatcher`): work a step sends to other
//! nodes, batched per node, completed by the node's report.
//!
//! A step calls [`Context::dispatch`](crate::Context::dispatch) for each operation and
//! returns [`Context::await_remote`](crate::Context::await_remote). Each operation
//! becomes a child procedure of its own (a `RemoteCall`, as HBase's region procedures
//! are children of the procedure that moves a region), inserted durably with the step
//! — target, operation and id are on disk before anything is sent — and its id
//! ([`OpId`], the child's procedure id) is what the node deduplicates by and reports
//! with. The child hands its operation to the engine's dispatcher and suspends on an
//! event of its own; the dispatcher buffers operations per target and sends them as
//! one request when [`BatchRules::max_ops`] are queued or the oldest has waited
//! [`BatchRules::max_age_ms`], with at most [`BatchRules::max_in_flight`] requests per
//! target at once. A report (or a failure: the send failed until the operation's
//! deadline, the operation failed on the node, the node was removed, no report came
//! in time) wakes the child, which records the outcome as its value and finishes. The
//! parent's next step reads every outcome ([`Context::remote_results`]) and decides:
//! go on, dispatch again (a retry, or another node), or fail (its tree rolls back).
//!
//! After a restart a child that waited runs again: it has no outcome in memory, so it
//! dispatches its operation again, under the same id (the node answers a duplicate
//! with its first outcome), unless the transport's `rebuild` says it no longer needs
//! sending. An outcome is recorded once, so the parent sees each operation's outcome
//! exactly once.
//!
//! An operation can be given its undo at dispatch ([`Dispatched::undo`]), recorded
//! with it. Should the tree roll back while the child waits, the child's rollback
//! settles the operation with the dispatcher ([`Fate`]): one still queued and never
//! handed to the transport is dropped, and nothing is undone; otherwise the dispatcher
//! sends it no more and hands its outcome (a report, a failure, its deadline) to the
//! rollback rather than to the child's event, and if it succeeded or may have been
//! applied the rollback sends the undo under [`OpId::undo`] and waits for the undo's
//! report. A rollback after a restart finds the operation unknown to the dispatcher,
//! and undoes it if it may have been sent; the undo goes under the same id again, so
//! a node that has it answers with its first outcome. Without an undo the rollback
//! only forgets the operation, which stays applied where it reached its node.
//!
//! This module is the pure part: the batching rules ([`Batcher`], driven by a clock
//! the caller gives), the outcome types, and the child procedure. The dispatcher actor
//! and the transport are in the actix layer.
//!
//! [`Context::remote_results`]: crate::Context::remote_results

use crate::fast_map::NameHasher;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::procedure::{Context, Flow, ProcError, ProcId, Procedure};

/// The id of a remote operation: unique and stable across restarts (it is the id of
/// the child procedure that carries it), so a node deduplicates by it. The undo of an
/// operation ([`Dispatched::undo`]) goes under an id of its own, [`OpId::undo`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OpId(pub u64);

/// The bit an undo's id sets: procedure ids never have it (ids start at 1, and the
/// stores refuse one above `2^63 - 1` as damage), so no operation's id is an undo's.
const UNDO_BIT: u64 = 1 << 63;

impl OpId {
    /// The id the undo of this operation is sent under ([`Dispatched::undo`]): this
    /// id with its top bit set. Derived, not allocated, so it is the same in every
    /// engine that rolls the operation back (a node deduplicates the undo by it as
    /// it does the operation), and it is no operation's id: procedure ids stay below
    /// `2^63`.
    ///
    /// ```
    /// use proctor::OpId;
    /// let open = OpId(42);
    /// assert_ne!(open.undo(), open);
    /// assert_eq!(open.undo().undoes(), Some(open));
    /// assert_eq!(open.undoes(), None);
    /// assert_eq!(open.undo().to_string(), "op-42/undo");
    /// ```
    #[must_use]
    pub const fn undo(self) -> OpId {
        OpId(self.0 | UNDO_BIT)
    }

    /// The operation this id is the undo of, if it is an undo's id ([`OpId::undo`]).
    #[must_use]
    pub const fn undoes(self) -> Option<OpId> {
        if self.0 & UNDO_BIT == 0 {
            None
        } else {
            Some(OpId(self.0 & !UNDO_BIT))
        }
    }
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.undoes() {
            Some(op) => write!(f, "op-{}/undo", op.0),
            None => write!(f, "op-{}", self.0),
        }
    }
}

impl From<ProcId> for OpId {
    fn from(id: ProcId) -> Self {
        OpId(id.0)
    }
}

/// Why a remote operation did not succeed, with HBase's meanings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteError {
    /// Sending to the target failed, and kept failing until the operation's deadline
    /// (HBase's `remoteCallFailed`; the dispatcher retried with backoff until then).
    #[error("sending to {target} failed until the operation's deadline: {reason}")]
    CallFailed {
        /// The target.
        target: String,
        /// The transport's last error.
        reason: String,
    },
    /// The target ran the operation and reported a failure (`remoteOperationFailed`).
    #[error("the operation failed on {target}: {reason}")]
    Operation {
        /// The target.
        target: String,
        /// What the target reported.
        reason: String,
    },
    /// The target was declared gone ([`Executor::remove_target`]) while the operation
    /// was queued for it or awaited its report (HBase's `removeNode`).
    ///
    /// [`Executor::remove_target`]: crate::Executor::remove_target
    #[error("{target} was removed before it reported")]
    TargetGone {
        /// The target.
        target: String,
    },
    /// No report came within the operation's deadline.
    #[error("no report from {target} within {deadline_ms} ms")]
    Timeout {
        /// The target.
        target: String,
        /// The deadline it had.
        deadline_ms: u64,
    },
    /// The operation does not decode as the transport's operation type
    /// ([`Transport::Op`](crate::Transport::Op)): the step dispatched a value of another
    /// type. It was never sent.
    #[error("the operation for {target} was not sent: {reason}")]
    BadOp {
        /// The target.
        target: String,
        /// What the decoding said, with the type it expected.
        reason: String,
    },
    /// After a restart, the transport's `rebuild` said the operation no longer needs
    /// sending (HBase's `remoteCallBuild` returning nothing): it was not sent again.
    #[error("not sent again to {target} after the restart: the transport no longer needs it")]
    NotSent {
        /// The target.
        target: String,
    },
}

/// One remote operation's outcome, as the step after [`Context::await_remote`] sees
/// it ([`Context::remote_results`]).
///
/// [`Context::await_remote`]: crate::Context::await_remote
/// [`Context::remote_results`]: crate::Context::remote_results
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteResult {
    /// The operation.
    pub op: OpId,
    /// Where it was sent.
    pub target: String,
    /// The value the target reported (MessagePack), or why there is none.
    pub outcome: Result<Vec<u8>, RemoteError>,
}

impl RemoteResult {
    /// The reported value as `T`.
    ///
    /// # Errors
    /// The operation's [`RemoteError`] (as a step failure), or a value that is not a
    /// `T`.
    pub fn value<T: DeserializeOwned>(&self) -> Result<T, ProcError> {
        match &self.outcome {
            Ok(bytes) => rmp_serde::from_slice(bytes).map_err(|e| {
                ProcError::failed(format!(
                    "the value {} reported for {} is not a {}: {e}",
                    self.target,
                    self.op,
                    std::any::type_name::<T>()
                ))
            }),
            Err(e) => Err(ProcError::failed(format!("{}: {e}", self.op))),
        }
    }
}

/// A remote operation's outcome as its child records it (its value): marked so that
/// [`Context::remote_results`](crate::Context::remote_results) tells it from other
/// children's values.
#[derive(Serialize, Deserialize)]
pub(crate) struct Reported {
    proctor_remote: u8,
    target: String,
    outcome: Result<serde_bytes::ByteBuf, RemoteError>,
    /// The operation's id (its child's), for a saga's remote step, whose journal has
    /// no other record of it; 0 in values recorded before it was kept.
    #[serde(default)]
    op: u64,
}

impl Reported {
    /// The outcome it holds, of the operation it names.
    pub(crate) fn result(self) -> RemoteResult {
        RemoteResult {
            op: OpId(self.op),
            target: self.target,
            outcome: self.outcome.map(serde_bytes::ByteBuf::into_vec),
        }
    }

    /// The outcome of `op`, from a child's value; `None` if the value is not one.
    pub(crate) fn decode(op: OpId, bytes: &[u8]) -> Option<RemoteResult> {
        let reported: Reported = rmp_serde::from_slice(bytes).ok()?;
        (reported.proctor_remote == 1).then(|| RemoteResult {
            op,
            target: reported.target,
            outcome: reported.outcome.map(serde_bytes::ByteBuf::into_vec),
        })
    }
}

/// The event a remote operation's child suspends on; the `proctor.remote/` prefix is
/// the engine's.
pub(crate) fn event_of(op: OpId) -> String {
    format!("proctor.remote/{}", op.0)
}

/// How a `RemoteCall` hands its operation over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Handing {
    /// The op was sent before a restart (recorded as handed over): the transport may
    /// decide it no longer needs sending.
    pub resend: bool,
    /// A target may have it already (it was handed over before a restart, or this
    /// child's step may have run before one): should its rollback find it still
    /// queued, it is not taken as never sent.
    pub maybe_sent: bool,
}

/// What became of an operation whose child rolls back, as the dispatcher answers
/// [`RemoteSink::settle`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Dropped from its target's queue before it was ever handed to the transport:
    /// never applied.
    Unsent,
    /// Dropped while its sends were being retried (or while queued again after a
    /// restart): one of them may have reached the target.
    Stopped,
    /// The dispatcher does not know it: it was handed over before a restart, or not
    /// at all.
    Unknown,
    /// Its outcome: a report, a failure, or its deadline.
    Outcome(Result<Vec<u8>, RemoteError>),
}

impl Fate {
    /// Whether the operation must be undone: it succeeded, or may have been applied
    /// (`may_have_been_sent`, for an operation the dispatcher does not know).
    pub(crate) fn needs_undo(&self, may_have_been_sent: bool) -> bool {
        match self {
            Fate::Unsent => false,
            Fate::Stopped => true,
            Fate::Unknown => may_have_been_sent,
            Fate::Outcome(Ok(_)) => true,
            Fate::Outcome(Err(e)) => match e {
                // It failed on the target, its target is declared gone (what it
                // applied went with it), or it was never sent.
                RemoteError::Operation { .. }
                | RemoteError::TargetGone { .. }
                | RemoteError::BadOp { .. } => false,
                // No report in time, a call that failed after it may have reached
                // the target, a resend the transport declined: unknown.
                RemoteError::CallFailed { .. }
                | RemoteError::Timeout { .. }
                | RemoteError::NotSent { .. } => true,
            },
        }
    }
}

/// An answer of the dispatcher's, to await; `None` if it stopped before answering.
pub(crate) type Answer<T> = Pin<Box<dyn Future<Output = Option<T>> + Send>>;

/// What a `RemoteCall` child asks of the engine's dispatcher (implemented in the actix
/// layer).
pub(crate) trait RemoteSink: Send + Sync {
    /// Hands `op` to the dispatcher, unless it already has it.
    fn dispatch(&self, op: OpId, target: &str, payload: &[u8], how: Handing);
    /// Takes `op`'s outcome, if it has come; the op is then forgotten.
    fn take(&self, op: OpId) -> Option<Result<Vec<u8>, RemoteError>>;
    /// The op's procedure is rolled back, and the op has no undo: forget the op and any
    /// outcome.
    fn cancel(&self, op: OpId);
    /// The op's procedure is rolled back to undo it: the dispatcher hands the op to the
    /// transport no more (a queued one is dropped, a failed send not retried) and
    /// answers with its fate, once it has one: its outcome goes to this answer, not to
    /// the op's procedure.
    fn settle(&self, op: OpId) -> Answer<Fate>;
    /// Sends `undo`, an op's undo under [`OpId::undo`], to `target`, and answers with
    /// its outcome (a second call for an undo in hand waits for the same outcome).
    fn undo(&self, undo: OpId, target: &str, payload: &[u8]) -> Answer<Fate>;
}

/// The dispatcher a call's context reaches.
pub(crate) type Sink = Arc<dyn RemoteSink>;

/// The child procedure that carries one remote operation (registered as
/// [`REMOTE_CALL`]): dispatches it, waits for its outcome, records it as its value.
/// Its rollback undoes the operation if it was given an undo (see
/// [`Dispatched::undo`]); without one it only forgets the operation.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct RemoteCall {
    pub(crate) target: String,
    #[serde(with = "serde_bytes")]
    pub(crate) op: Vec<u8>,
    /// It was handed to the dispatcher before (recorded with its suspension): a run
    /// without an outcome is then a run after a restart.
    #[serde(default)]
    pub(crate) sent: bool,
    /// The operation that undoes `op`, recorded with it (with the step that
    /// dispatched it), sent under [`OpId::undo`] by a rollback that finds `op`
    /// applied, or possibly applied.
    #[serde(default, with = "serde_bytes")]
    pub(crate) undo: Option<Vec<u8>>,
    /// A rollback call of it succeeded (it undid the operation, or found nothing to
    /// undo): a later one, of another of its steps, sends nothing.
    #[serde(default)]
    pub(crate) undone: bool,
    /// Decoded from its record (after a restart, or its actor's restart): its first
    /// send in this engine may not be its first.
    #[serde(skip)]
    pub(crate) recovered: bool,
}

impl RemoteCall {
    /// `op` for `target`, with no undo yet.
    pub(crate) fn new(target: String, op: Vec<u8>) -> Self {
        RemoteCall {
            target,
            op,
            sent: false,
            undo: None,
            undone: false,
            recovered: false,
        }
    }

    /// With `undo` as the operation that undoes it (see [`Dispatched::undo`]).
    pub(crate) fn with_undo(mut self, undo: Option<Vec<u8>>) -> Self {
        self.undo = undo;
        self
    }
}

/// A remote operation a step has just dispatched ([`Context::dispatch`]): give it the
/// operation that undoes it with [`Dispatched::undo`], or drop it (no undo).
///
/// [`Context::dispatch`]: crate::Context::dispatch
pub struct Dispatched<'a, T: Transport> {
    call: &'a mut RemoteCall,
    transport: std::marker::PhantomData<fn() -> T>,
}

impl<T: Transport> fmt::Debug for Dispatched<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatched")
            .field("call", &self.call)
            .finish()
    }
}

impl<'a, T: Transport> Dispatched<'a, T> {
    pub(crate) fn new(call: &'a mut RemoteCall) -> Self {
        Dispatched {
            call,
            transport: std::marker::PhantomData,
        }
    }

    /// Gives the operation its undo: the operation, of the transport's type, that a
    /// rollback sends to the same target to take it back. It is recorded with the
    /// operation (with the step that dispatched it).
    ///
    /// Should the tree roll back before the operation's child has recorded the
    /// outcome, the child's rollback settles the operation first: one still queued,
    /// never handed to the transport, is dropped and nothing is undone; otherwise the
    /// rollback waits for its outcome (a report, a failure, its deadline), and if it
    /// succeeded, or may have (no report within the deadline, the call failed after
    /// it may have reached the target, the engine restarted meanwhile), sends the
    /// undo under [`OpId::undo`] and waits for the undo's report. An operation that
    /// failed on its target ([`RemoteError::Operation`]), or whose target was removed
    /// ([`RemoteError::TargetGone`]), is not undone. A failed undo fails the rollback,
    /// which the engine retries with backoff (then ROLLBACK_PAUSED, under the default
    /// failure policy). A target deduplicates the undo by its id, as it does the
    /// operation, and must take an undo of an operation it never applied as done.
    ///
    /// An operation without an undo is left as it is: one that reached its target
    /// stays applied whatever its tree does. The same goes, with or without an undo,
    /// for an operation whose child recorded its outcome before the tree failed: the
    /// engine does not roll back children that succeeded, so the parent's rollback
    /// undoes what its steps read.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, Flow, OpId, ProcError, Report, Transport, TransportError};
    /// # #[derive(serde::Serialize, serde::Deserialize)] enum RegionOp { Open(u32), Close(u32) }
    /// # struct Rpc;
    /// # #[async_trait] impl Transport for Rpc { type Op = RegionOp;
    /// #     async fn send(&self, _: &str, _: Vec<(OpId, RegionOp)>) -> Result<Vec<Report>, TransportError> { Ok(vec![]) } }
    /// # fn step(ctx: &mut Context) -> Result<Flow, ProcError> {
    /// ctx.dispatch::<Rpc>("rs-1", &RegionOp::Open(7))?.undo(&RegionOp::Close(7))?;
    /// Ok(ctx.await_remote())
    /// # }
    /// ```
    ///
    /// # Errors
    /// [`ProcError::Persist`] if `undo` does not serialize.
    pub fn undo(self, undo: &T::Op) -> Result<(), ProcError> {
        let undo = rmp_serde::to_vec_named(undo)
            .map_err(|e| ProcError::Persist(format!("undo of a remote operation: {e}")))?;
        self.call.undo = Some(undo);
        Ok(())
    }
}

/// The registered name of the remote operations' child procedures.
pub const REMOTE_CALL: &str = "proctor.remote";

#[async_trait::async_trait]
impl<E: Send + Sync + 'static> Procedure<E> for RemoteCall {
    async fn execute(&mut self, ctx: &mut Context<E>) -> Result<Flow<E>, ProcError> {
        let op = OpId::from(ctx.id());
        let sink = ctx.remote_sink().ok_or_else(|| {
            ProcError::failed(
                "remote operations need a dispatcher: give the executor's builder \
                 .remote(transport)",
            )
        })?;
        if let Some(outcome) = sink.take(op) {
            ctx.set_result(&Reported {
                proctor_remote: 1,
                target: self.target.clone(),
                outcome: outcome.map(serde_bytes::ByteBuf::from),
                op: op.0,
            })?;
            return Ok(Flow::Done);
        }
        let how = Handing {
            resend: self.sent,
            maybe_sent: self.sent || self.recovered,
        };
        sink.dispatch(op, &self.target, &self.op, how);
        self.sent = true;
        Ok(Flow::Suspend(event_of(op)))
    }

    /// Without an undo, forgets the operation: one that reached its target stays
    /// applied. With one, settles the operation and undoes it if it was, or may have
    /// been, applied (see [`Dispatched::undo`]).
    async fn rollback(&mut self, ctx: &mut Context<E>) -> Result<(), ProcError> {
        let op = OpId::from(ctx.id());
        let Some(sink) = ctx.remote_sink() else {
            return Ok(());
        };
        let Some(undo) = self.undo.clone() else {
            sink.cancel(op);
            return Ok(());
        };
        if self.undone {
            return Ok(());
        }
        // A step cut off by a crash may have handed the op over unrecorded.
        let may_have_been_sent =
            self.sent || self.recovered || ctx.undoing() == crate::procedure::Undo::Interrupted;
        let fate = answered(ctx, sink.settle(op), &format!("the outcome of {op}")).await?;
        if fate.needs_undo(may_have_been_sent) {
            send_undo(ctx, &sink, op, &self.target, &undo).await?;
        }
        self.undone = true;
        Ok(())
    }

    fn before_recover(&mut self, _ctx: &Context<E>) {
        self.recovered = true;
    }

    fn after_recover(&mut self, _ctx: &Context<E>) {
        self.recovered = true;
    }

    fn state_name(&self) -> Option<String> {
        Some(format!("remote to {}", self.target))
    }
}

/// The dispatcher's answer, unless the engine's shutdown signal (a graceful stop's
/// drain deadline) comes first: the rollback then fails, to be tried again after the
/// restart.
/// Sends `undo`, the operation that takes `op` back, to `target` under
/// [`OpId::undo`], and waits for its outcome: done once the target reports it (or the
/// target is gone, and what it applied with it), a failure otherwise.
pub(crate) async fn send_undo<E: ?Sized>(
    ctx: &Context<E>,
    sink: &Sink,
    op: OpId,
    target: &str,
    undo: &[u8],
) -> Result<(), ProcError> {
    let undo_id = op.undo();
    let waiting = format!("the outcome of {undo_id}");
    match answered(ctx, sink.undo(undo_id, target, undo), &waiting).await? {
        Fate::Outcome(Ok(_) | Err(RemoteError::TargetGone { .. })) => Ok(()),
        Fate::Outcome(Err(e)) => Err(ProcError::failed(format!("{undo_id}: {e}"))),
        other => Err(ProcError::failed(format!(
            "{undo_id}: the dispatcher answered {other:?}"
        ))),
    }
}

async fn answered<E: ?Sized, T>(
    ctx: &Context<E>,
    answer: Answer<T>,
    waiting_for: &str,
) -> Result<T, ProcError> {
    let mut answer = answer;
    let mut cancelled = std::pin::pin!(ctx.cancelled());
    let answer = std::future::poll_fn(|cx| {
        if let Poll::Ready(answer) = answer.as_mut().poll(cx) {
            return Poll::Ready(Some(answer));
        }
        cancelled.as_mut().poll(cx).map(|()| None)
    })
    .await;
    match answer {
        Some(Some(answer)) => Ok(answer),
        Some(None) => Err(ProcError::failed(format!(
            "the remote dispatcher stopped before {waiting_for} came"
        ))),
        None => Err(ProcError::failed(format!(
            "stopped by the engine's shutdown while waiting for {waiting_for}"
        ))),
    }
}

/// How the dispatcher batches: a target's request goes out when `max_ops` operations
/// are queued for it or its oldest has waited `max_age_ms`, with at most
/// `max_in_flight` requests to one target at once (the rest wait their turn).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRules {
    /// Operations per request, at most (HBase: 32).
    pub max_ops: usize,
    /// How long an operation waits for others before its request goes (HBase: 150 ms).
    pub max_age_ms: u64,
    /// Requests to one target at once.
    pub max_in_flight: usize,
}

impl Default for BatchRules {
    fn default() -> Self {
        BatchRules {
            max_ops: 32,
            max_age_ms: 150,
            max_in_flight: 4,
        }
    }
}

/// One request: operations for one target.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Batch<T> {
    /// Where it goes.
    pub target: String,
    /// What it carries, oldest first.
    pub ops: Vec<(OpId, T)>,
}

#[derive(Debug)]
struct Queue<T> {
    /// Queued operations, oldest first, with when each was queued.
    ops: VecDeque<(OpId, T, u64)>,
    in_flight: usize,
}

/// The dispatcher's buffers: per target, the queued operations and the requests in
/// flight. Pure: the caller gives the time, sends the batches it is handed, and says
/// when each request has finished ([`Batcher::finished`]).
#[derive(Debug)]
pub(crate) struct Batcher<T> {
    rules: BatchRules,
    targets: HashMap<String, Queue<T>, NameHasher>,
}

impl<T> Batcher<T> {
    /// Empty buffers batching by `rules` (a zero is taken as 1).
    pub fn new(rules: BatchRules) -> Self {
        Batcher {
            rules: BatchRules {
                max_ops: rules.max_ops.max(1),
                max_in_flight: rules.max_in_flight.max(1),
                ..rules
            },
            targets: HashMap::default(),
        }
    }

    /// Queues `op` for `target` at `now_ms`: the requests that may go now (a full one,
    /// if a slot is free).
    pub fn push(&mut self, target: &str, op: OpId, item: T, now_ms: u64) -> Vec<Batch<T>> {
        self.queue(target).ops.push_back((op, item, now_ms));
        self.ready(target, now_ms, false)
    }

    /// Queues again, at the front, operations whose request failed (to be retried
    /// first): the requests that may go now.
    pub fn push_front(&mut self, target: &str, ops: Vec<(OpId, T)>, now_ms: u64) -> Vec<Batch<T>> {
        let aged = now_ms.saturating_sub(self.rules.max_age_ms);
        let queue = self.queue(target);
        for (op, item) in ops.into_iter().rev() {
            // Already old: they go with the next request.
            queue.ops.push_front((op, item, aged));
        }
        self.ready(target, now_ms, false)
    }

    /// A request to `target` finished (sent, or failed): its slot is free. The requests
    /// that may go now.
    pub fn finished(&mut self, target: &str, now_ms: u64) -> Vec<Batch<T>> {
        if let Some(queue) = self.targets.get_mut(target) {
            queue.in_flight = queue.in_flight.saturating_sub(1);
        }
        let batches = self.ready(target, now_ms, false);
        self.drop_if_idle(target);
        batches
    }

    /// The requests whose oldest operation has waited long enough, at `now_ms`.
    pub fn due(&mut self, now_ms: u64) -> Vec<Batch<T>> {
        let aged: Vec<String> = self
            .targets
            .iter()
            .filter(|(_, q)| q.ops.front().is_some_and(|o| self.aged(o.2, now_ms)))
            .map(|(t, _)| t.clone())
            .collect();
        aged.iter()
            .flat_map(|target| self.ready(target, now_ms, true))
            .collect()
    }

    /// Drops what is queued for `target` (it is gone): the dropped operations.
    pub fn remove(&mut self, target: &str) -> Vec<(OpId, T)> {
        let Some(queue) = self.targets.get_mut(target) else {
            return Vec::new();
        };
        let dropped = queue
            .ops
            .drain(..)
            .map(|(op, item, _)| (op, item))
            .collect();
        self.drop_if_idle(target);
        dropped
    }

    /// Drops `op` if it is queued for `target`.
    pub fn cancel(&mut self, target: &str, op: OpId) -> Option<T> {
        let queue = self.targets.get_mut(target)?;
        let at = queue.ops.iter().position(|o| o.0 == op)?;
        let item = queue.ops.remove(at).map(|(_, item, _)| item);
        self.drop_if_idle(target);
        item
    }

    /// Operations queued for `target`, and its requests in flight.
    pub fn load(&self, target: &str) -> (usize, usize) {
        self.targets
            .get(target)
            .map_or((0, 0), |q| (q.ops.len(), q.in_flight))
    }

    fn queue(&mut self, target: &str) -> &mut Queue<T> {
        self.targets
            .entry(target.to_string())
            .or_insert_with(|| Queue {
                ops: VecDeque::new(),
                in_flight: 0,
            })
    }

    fn aged(&self, queued_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(queued_ms) >= self.rules.max_age_ms
    }

    /// The requests `target` may send now: full ones, and (`flush`, or its oldest has
    /// aged) the rest, while it has free slots.
    fn ready(&mut self, target: &str, now_ms: u64, flush: bool) -> Vec<Batch<T>> {
        let (max_ops, max_in_flight, max_age) = (
            self.rules.max_ops,
            self.rules.max_in_flight,
            self.rules.max_age_ms,
        );
        let Some(queue) = self.targets.get_mut(target) else {
            return Vec::new();
        };
        let mut batches = Vec::new();
        while queue.in_flight < max_in_flight {
            let aged = queue
                .ops
                .front()
                .is_some_and(|o| now_ms.saturating_sub(o.2) >= max_age);
            let goes = queue.ops.len() >= max_ops || (!queue.ops.is_empty() && (flush || aged));
            if !goes {
                break;
            }
            let n = queue.ops.len().min(max_ops);
            let ops = queue
                .ops
                .drain(..n)
                .map(|(op, item, _)| (op, item))
                .collect();
            queue.in_flight += 1;
            batches.push(Batch {
                target: target.to_string(),
                ops,
            });
        }
        batches
    }

    fn drop_if_idle(&mut self, target: &str) {
        if self
            .targets
            .get(target)
            .is_some_and(|q| q.ops.is_empty() && q.in_flight == 0)
        {
            self.targets.remove(target);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(max_ops: usize, max_age_ms: u64, max_in_flight: usize) -> BatchRules {
        BatchRules {
            max_ops,
            max_age_ms,
            max_in_flight,
        }
    }

    /// What a batch carries, by op number.
    fn ids(batches: &[Batch<()>]) -> Vec<(String, Vec<u64>)> {
        batches
            .iter()
            .map(|b| {
                (
                    b.target.clone(),
                    b.ops.iter().map(|(op, ())| op.0).collect(),
                )
            })
            .collect()
    }

    /// One event against the batcher, and the requests it must hand out.
    enum Ev {
        Push(&'static str, u64, u64),
        Due(u64),
        Finished(&'static str, u64),
        Remove(&'static str),
    }

    /// The requests an event must hand out: target and op numbers.
    type Want<'a> = &'a [(&'a str, &'a [u64])];

    fn run(rules: BatchRules, events: &[(Ev, Want<'_>)]) {
        let mut b = Batcher::new(rules);
        for (n, (ev, want)) in events.iter().enumerate() {
            let got = match ev {
                Ev::Push(t, op, now) => ids(&b.push(t, OpId(*op), (), *now)),
                Ev::Due(now) => {
                    let mut got = ids(&b.due(*now));
                    got.sort();
                    got
                }
                Ev::Finished(t, now) => ids(&b.finished(t, *now)),
                Ev::Remove(t) => vec![(
                    (*t).to_string(),
                    b.remove(t)
                        .into_iter()
                        .map(|(op, ())| op.0)
                        .collect::<Vec<u64>>(),
                )]
                .into_iter()
                .filter(|(_, ops)| !ops.is_empty())
                .collect(),
            };
            let want: Vec<(String, Vec<u64>)> = want
                .iter()
                .map(|(t, ops)| ((*t).to_string(), ops.to_vec()))
                .collect();
            assert_eq!(got, want, "event {n}");
        }
    }

    #[test]
    fn a_full_buffer_goes_at_once_and_a_partial_one_when_its_oldest_has_aged() {
        run(
            rules(3, 100, 4),
            &[
                (Ev::Push("a", 1, 0), &[]),
                (Ev::Push("a", 2, 10), &[]),
                (Ev::Push("b", 3, 20), &[]),
                (Ev::Push("a", 4, 30), &[("a", &[1, 2, 4])]),
                (Ev::Due(99), &[]),
                (Ev::Due(120), &[("b", &[3])]),
                (Ev::Push("a", 5, 130), &[]),
                (Ev::Due(229), &[]),
                (Ev::Due(230), &[("a", &[5])]),
            ],
        );
    }

    #[test]
    fn requests_in_flight_are_bounded_per_target_and_a_finish_lets_the_next_go() {
        run(
            rules(2, 100, 1),
            &[
                (Ev::Push("a", 1, 0), &[]),
                (Ev::Push("a", 2, 0), &[("a", &[1, 2])]),
                (Ev::Push("a", 3, 1), &[]),
                (Ev::Push("a", 4, 2), &[]),
                // Full, but the one slot is taken; another target is not held back.
                (Ev::Push("b", 5, 3), &[]),
                (Ev::Push("b", 6, 3), &[("b", &[5, 6])]),
                (Ev::Due(500), &[]),
                (Ev::Finished("a", 501), &[("a", &[3, 4])]),
                (Ev::Finished("a", 502), &[]),
            ],
        );
    }

    #[test]
    fn a_removed_target_drops_what_is_queued_for_it() {
        run(
            rules(10, 100, 1),
            &[
                (Ev::Push("a", 1, 0), &[]),
                (Ev::Push("b", 2, 0), &[]),
                (Ev::Remove("a"), &[("a", &[1])]),
                (Ev::Remove("a"), &[]),
                (Ev::Due(100), &[("b", &[2])]),
            ],
        );
    }

    #[test]
    fn failed_ops_go_first_in_the_next_request_and_a_cancelled_one_not_at_all() {
        let mut b = Batcher::new(rules(3, 100, 1));
        assert!(b.push("a", OpId(3), (), 0).is_empty());
        let sent = b.push_front("a", vec![(OpId(1), ()), (OpId(2), ())], 10);
        assert_eq!(ids(&sent), vec![("a".to_string(), vec![1, 2, 3])]);
        assert!(b.push("a", OpId(4), (), 20).is_empty());
        assert!(b.push("a", OpId(5), (), 20).is_empty());
        assert_eq!(b.cancel("a", OpId(4)), Some(()));
        assert_eq!(b.cancel("a", OpId(4)), None);
        assert_eq!(b.load("a"), (1, 1));
        assert!(b.due(500).is_empty(), "its slot is taken");
        assert_eq!(ids(&b.finished("a", 50)), Vec::<(String, Vec<u64>)>::new());
        assert!(b.due(119).is_empty());
        assert_eq!(ids(&b.due(120)), vec![("a".to_string(), vec![5])]);
        assert_eq!(ids(&b.finished("a", 130)), Vec::<(String, Vec<u64>)>::new());
        assert_eq!(b.load("a"), (0, 0));
        assert!(b.targets.is_empty(), "idle targets are not kept");
    }

    #[test]
    fn a_hundred_ops_to_three_targets_go_in_requests_of_at_most_32() {
        let mut b = Batcher::new(BatchRules::default());
        let mut sent = Vec::new();
        for op in 0..100u64 {
            let target = ["a", "b", "c"][(op % 3) as usize];
            sent.extend(b.push(target, OpId(op), (), op));
        }
        sent.extend(b.due(1000));
        assert!(sent.iter().all(|batch| batch.ops.len() <= 32));
        assert_eq!(sent.iter().map(|b| b.ops.len()).sum::<usize>(), 100);
        assert_eq!(sent.len(), 6, "two requests per target: 32 and the rest");
    }

    #[test]
    fn an_undos_id_is_no_operations_and_leads_back_to_its_operation() {
        for id in [1u64, 42, crate::wal::MAX_ID] {
            let op = OpId(id);
            assert_eq!(op.undoes(), None);
            assert_ne!(op.undo(), op);
            assert_eq!(op.undo().undoes(), Some(op));
            assert_eq!(op.undo().undo(), op.undo());
        }
        assert_eq!(OpId(7).undo().to_string(), "op-7/undo");
    }

    #[test]
    fn an_operation_is_undone_when_it_succeeded_or_may_have_been_applied() {
        let target = || "rs-1".to_string();
        let reason = || "no".to_string();
        // (what became of it, whether it may have been sent, whether it is undone)
        let cases = [
            (Fate::Unsent, true, false),
            (Fate::Stopped, false, true),
            (Fate::Unknown, true, true),
            (Fate::Unknown, false, false),
            (Fate::Outcome(Ok(vec![0xc0])), false, true),
            (
                Fate::Outcome(Err(RemoteError::Operation {
                    target: target(),
                    reason: reason(),
                })),
                true,
                false,
            ),
            (
                Fate::Outcome(Err(RemoteError::TargetGone { target: target() })),
                true,
                false,
            ),
            (
                Fate::Outcome(Err(RemoteError::BadOp {
                    target: target(),
                    reason: reason(),
                })),
                true,
                false,
            ),
            (
                Fate::Outcome(Err(RemoteError::CallFailed {
                    target: target(),
                    reason: reason(),
                })),
                false,
                true,
            ),
            (
                Fate::Outcome(Err(RemoteError::Timeout {
                    target: target(),
                    deadline_ms: 5,
                })),
                false,
                true,
            ),
            (
                Fate::Outcome(Err(RemoteError::NotSent { target: target() })),
                false,
                true,
            ),
        ];
        for (fate, may_have_been_sent, undone) in cases {
            assert_eq!(
                fate.needs_undo(may_have_been_sent),
                undone,
                "{fate:?}, may have been sent: {may_have_been_sent}"
            );
        }
    }

    /// A dispatcher that answers at once: what the op came to, and what its undo does.
    struct Answering {
        fate: Fate,
        undo: Fate,
        calls: std::sync::Mutex<Vec<String>>,
    }

    impl RemoteSink for Answering {
        fn dispatch(&self, op: OpId, _: &str, _: &[u8], _: Handing) {
            self.calls.lock().unwrap().push(format!("dispatch {op}"));
        }
        fn take(&self, _: OpId) -> Option<Result<Vec<u8>, RemoteError>> {
            None
        }
        fn cancel(&self, op: OpId) {
            self.calls.lock().unwrap().push(format!("cancel {op}"));
        }
        fn settle(&self, op: OpId) -> Answer<Fate> {
            self.calls.lock().unwrap().push(format!("settle {op}"));
            let fate = self.fate.clone();
            Box::pin(async move { Some(fate) })
        }
        fn undo(&self, undo: OpId, target: &str, _: &[u8]) -> Answer<Fate> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("undo {undo} on {target}"));
            let fate = self.undo.clone();
            Box::pin(async move { Some(fate) })
        }
    }

    /// Rolls `call` back (child 9) as `undo` says, against a dispatcher answering
    /// `fate` for the op and `undone` for its undo: what it asked, and how it ended.
    fn roll_back(
        call: &mut RemoteCall,
        undo: crate::procedure::Undo,
        fate: Fate,
        undone: Fate,
    ) -> (Vec<String>, Result<(), ProcError>) {
        let sink = Arc::new(Answering {
            fate,
            undo: undone,
            calls: std::sync::Mutex::default(),
        });
        let mut ctx = Context::new(ProcId(9), Some(ProcId(1)), ProcId(1), 0, Arc::new(()))
            .with_remote(Some(sink.clone()))
            .undoing_step(undo);
        let result = std::pin::pin!(Procedure::<()>::rollback(call, &mut ctx))
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        let Poll::Ready(result) = result else {
            panic!("the answers were ready")
        };
        let calls = sink.calls.lock().unwrap().clone();
        (calls, result)
    }

    #[test]
    fn a_rollback_undoes_its_operation_once_when_it_was_or_may_have_been_applied() {
        use crate::procedure::Undo;
        let sent = || RemoteCall {
            sent: true,
            undo: Some(vec![0xc0]),
            ..RemoteCall::new("rs-1".into(), vec![0xc0])
        };
        let ok = || Fate::Outcome(Ok(vec![0xc0]));
        let settle = "settle op-9";
        let undo = "undo op-9/undo on rs-1";

        // Without an undo: forgotten, as before.
        let mut call = RemoteCall::new("rs-1".into(), vec![0xc0]);
        let (calls, result) = roll_back(&mut call, Undo::Completed, ok(), ok());
        assert_eq!((calls, result), (vec!["cancel op-9".to_string()], Ok(())));

        // Applied: undone, once; a second rollback call sends nothing.
        let mut call = sent();
        let (calls, result) = roll_back(&mut call, Undo::Completed, ok(), ok());
        assert_eq!(calls, [settle, undo]);
        assert_eq!(result, Ok(()));
        assert!(call.undone);
        let (calls, result) = roll_back(&mut call, Undo::Completed, ok(), ok());
        assert!(calls.is_empty(), "{calls:?}");
        assert_eq!(result, Ok(()));

        // Never sent, or failed on its target: nothing to undo.
        let mut call = sent();
        let (calls, _) = roll_back(&mut call, Undo::Completed, Fate::Unsent, ok());
        assert_eq!(calls, [settle]);
        let failed = Fate::Outcome(Err(RemoteError::Operation {
            target: "rs-1".into(),
            reason: "full".into(),
        }));
        let (calls, _) = roll_back(&mut sent(), Undo::Completed, failed, ok());
        assert_eq!(calls, [settle]);

        // Unknown to the dispatcher (a restart): undone if it may have been sent —
        // recorded as sent, decoded from its record, or its step was cut off.
        let (calls, _) = roll_back(&mut sent(), Undo::Completed, Fate::Unknown, ok());
        assert_eq!(calls, [settle, undo]);
        let unsent = || RemoteCall {
            sent: false,
            ..sent()
        };
        let (calls, _) = roll_back(&mut unsent(), Undo::Failed, Fate::Unknown, ok());
        assert_eq!(calls, [settle]);
        let (calls, _) = roll_back(&mut unsent(), Undo::Interrupted, Fate::Unknown, ok());
        assert_eq!(calls, [settle, undo]);
        let mut recovered = unsent();
        Procedure::<()>::after_recover(
            &mut recovered,
            &Context::new(ProcId(9), None, ProcId(9), 0, Arc::new(())),
        );
        let (calls, _) = roll_back(&mut recovered, Undo::Failed, Fate::Unknown, ok());
        assert_eq!(calls, [settle, undo]);

        // A failed undo fails the rollback, to be tried again; a removed target's is
        // done.
        let mut call = sent();
        let no = Fate::Outcome(Err(RemoteError::Timeout {
            target: "rs-1".into(),
            deadline_ms: 5,
        }));
        let (_, result) = roll_back(&mut call, Undo::Completed, ok(), no);
        let error = result.unwrap_err().to_string();
        assert!(error.contains("op-9/undo: no report from rs-1"), "{error}");
        assert!(!call.undone);
        let gone = Fate::Outcome(Err(RemoteError::TargetGone {
            target: "rs-1".into(),
        }));
        let (_, result) = roll_back(&mut call, Undo::Completed, Fate::Unknown, gone);
        assert_eq!(result, Ok(()));
        assert!(call.undone);
    }

    #[test]
    fn a_remote_call_recorded_before_undos_decodes_without_one() {
        #[derive(Serialize)]
        struct Before {
            target: String,
            #[serde(with = "serde_bytes")]
            op: Vec<u8>,
            sent: bool,
        }
        let before = Before {
            target: "rs-1".into(),
            op: vec![1, 2],
            sent: true,
        };
        let bytes = rmp_serde::to_vec_named(&before).unwrap();
        let call: RemoteCall = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!((call.sent, call.undo, call.undone), (true, None, false));
        let with_undo = RemoteCall {
            undo: Some(vec![3]),
            ..RemoteCall::new("rs-1".into(), vec![1, 2])
        };
        let bytes = rmp_serde::to_vec_named(&with_undo).unwrap();
        let call: RemoteCall = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(call.undo, Some(vec![3]));
        assert!(!call.recovered, "in memory only");
    }

    #[test]
    fn reported_values_are_told_from_other_childrens_values() {
        let reported = Reported {
            proctor_remote: 1,
            target: "rs-1".into(),
            outcome: Ok(serde_bytes::ByteBuf::from(
                rmp_serde::to_vec(&7u32).unwrap(),
            )),
            op: 9,
        };
        let bytes = rmp_serde::to_vec_named(&reported).unwrap();
        let result = Reported::decode(OpId(9), &bytes).unwrap();
        assert_eq!(result.value::<u32>().unwrap(), 7);
        assert_eq!(result.target, "rs-1");
        let other = rmp_serde::to_vec_named(&("a table", 3)).unwrap();
        assert!(Reported::decode(OpId(9), &other).is_none());
        let failed = RemoteResult {
            op: OpId(9),
            target: "rs-1".into(),
            outcome: Err(RemoteError::TargetGone {
                target: "rs-1".into(),
            }),
        };
        let error = failed.value::<u32>().unwrap_err().to_string();
        assert!(error.contains("op-9: rs-1 was removed"), "{error}");
    }
}

/// A send that failed: the transport's words.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

/// How remote operations reach their targets: a request of one or more operations to
/// one target. Implement it over the service's RPC (HTTP, gRPC, a socket).
///
/// `send` answers once the target has the request (HBase's dispatch RPC), with the
/// reports of the operations the target finished within it (a request-response RPC
/// answers them all); the target reports the others later, through
/// [`Executor::report`](crate::Executor::report). An `Err` is a failed call: the
/// dispatcher retries the operations (first in the next request) with backoff until
/// their deadline. Targets must deduplicate by [`OpId`]: after a restart, and after a
/// failed call that the target did receive, an operation comes again with the same id,
/// and its report should repeat the first.
///
/// ```
/// use proctor::{async_trait, OpId, Report, Transport, TransportError};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// enum RegionOp { Open(u32), Close(u32) }
///
/// struct Rpc;
///
/// #[async_trait]
/// impl Transport for Rpc {
///     type Op = RegionOp;
///     async fn send(&self, target: &str, ops: Vec<(OpId, RegionOp)>) -> Result<Vec<Report>, TransportError> {
///         // One request to `target` carrying every op, each with its id; this target
///         // reports later, through `Executor::report`.
///         let _ = (target, ops);
///         Ok(Vec::new())
///     }
/// }
/// ```
#[async_trait::async_trait]
pub trait Transport: Send + Sync + 'static {
    /// What one operation carries (as the step dispatched it).
    type Op: Serialize + DeserializeOwned + Send + 'static;

    /// Sends `ops` to `target` in one request; answers the reports it came back with
    /// (none if the target reports later).
    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, Self::Op)>,
    ) -> Result<Vec<Report>, TransportError>;

    /// After a restart, an operation sent before it is about to be sent again: the op
    /// to send (by default the same), or `None` if it no longer needs sending (HBase's
    /// `remoteCallBuild` returning nothing); its procedure then gets
    /// [`RemoteError::NotSent`].
    fn rebuild(&self, _target: &str, op: Self::Op) -> Option<Self::Op> {
        Some(op)
    }
}

/// A target's report of one operation: its value, or why it failed on the target
/// (HBase's `remoteOperationCompleted` / `remoteOperationFailed`). A report for an
/// operation the dispatcher does not know (never dispatched, already reported, rolled
/// back) is counted and ignored: targets may report twice.
#[derive(Debug)]
pub struct Report {
    pub(crate) op: OpId,
    pub(crate) outcome: Result<Vec<u8>, String>,
}

impl Report {
    /// `op` succeeded with `value`.
    ///
    /// # Errors
    /// A value that does not serialize.
    pub fn ok<T: Serialize>(op: OpId, value: &T) -> Result<Report, crate::Error> {
        let bytes = rmp_serde::to_vec_named(value)
            .map_err(|e| crate::Error::Invalid(format!("the value reported for {op}: {e}")))?;
        Ok(Report {
            op,
            outcome: Ok(bytes),
        })
    }

    /// `op` failed on its target.
    pub fn failed(op: OpId, reason: impl Into<String>) -> Report {
        Report {
            op,
            outcome: Err(reason.into()),
        }
    }
}
