//! The remote dispatcher: one actor per executor that sends remote operations to their
//! targets in batches through the user's [`Transport`], and turns reports and failures
//! into outcomes that wake the operations' procedures (see `src/remote.rs` for the
//! model).
//!
//! It receives `Dispatch` (from a remote operation's procedure, through its context),
//! [`Report`] and [`RemoveTarget`] (from the executor's handle), `CancelOp` (a rolled
//! back operation without an undo), `SettleOp` and `DispatchUndo` (the rollback of one
//! with an undo), the ends of its own send tasks, and ticks of its own. An outcome goes
//! into the map the procedures take from, then the operation's event is woken at the
//! lock actor: the procedure that takes the outcome finds it there. The rules it keeps:
//! an operation is known once (a second `Dispatch` of the same id is a no-op, so a
//! step re-run after a crash sends nothing twice within a run); it gets one outcome
//! (a report for an operation that has one, or that it does not know, is counted and
//! ignored); a failed send is retried with backoff until the operation's deadline,
//! with the failed operations first in the next request. Once a rollback settles an
//! operation (`SettleOp`), the operation is handed to the transport no more (dropped
//! if queued, its failed sends not retried) and its outcome goes to the rollback's
//! answer, not into the map: no event is woken for it. An undo (`DispatchUndo`) is an
//! operation of its own, under [`OpId::undo`], whose outcome goes to its rollback's
//! answer; its failed sends are retried until its deadline.

use crate::fast_map::NameHasher;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::actors::locks::{LockActor, ResetEvent, WakeEvent};
use crate::actors::perturb;
use crate::actors::shared::Mandate;
use crate::remote::{
    event_of, Answer, Batch, BatchRules, Batcher, Fate, Handing, OpId, RemoteError, RemoteSink,
};
pub use crate::remote::{Report, Transport, TransportError};

type SendFuture = Pin<Box<dyn Future<Output = Result<Vec<Report>, TransportError>> + Send>>;

/// A transport with its operations as bytes.
pub(crate) trait AnyTransport: Send + Sync {
    fn send(&self, target: String, ops: Vec<(OpId, Vec<u8>)>) -> SendFuture;
    fn rebuild(&self, target: &str, op: &[u8]) -> Option<Vec<u8>>;
    /// Whether `op` decodes as the transport's operation type; if not, why.
    fn check(&self, op: &[u8]) -> Result<(), String>;
}

/// A typed [`Transport`] behind [`AnyTransport`].
pub(crate) struct Typed<T>(pub(crate) Arc<T>);

impl<T: Transport> AnyTransport for Typed<T> {
    fn send(&self, target: String, ops: Vec<(OpId, Vec<u8>)>) -> SendFuture {
        let transport = self.0.clone();
        Box::pin(async move {
            let mut typed = Vec::with_capacity(ops.len());
            for (id, bytes) in ops {
                let op = rmp_serde::from_slice(&bytes).map_err(|e| {
                    TransportError(format!(
                        "{id} does not decode as a {}: {e}",
                        std::any::type_name::<T::Op>()
                    ))
                })?;
                typed.push((id, op));
            }
            transport.send(&target, typed).await
        })
    }

    fn check(&self, op: &[u8]) -> Result<(), String> {
        rmp_serde::from_slice::<T::Op>(op).map(drop).map_err(|e| {
            format!(
                "it does not decode as a {}: {e}",
                std::any::type_name::<T::Op>()
            )
        })
    }

    fn rebuild(&self, target: &str, op: &[u8]) -> Option<Vec<u8>> {
        let op: T::Op = rmp_serde::from_slice(op).ok()?;
        let op = self.0.rebuild(target, op)?;
        rmp_serde::to_vec_named(&op).ok()
    }
}

/// How the dispatcher batches, retries and gives up. Defaults: requests of at most 32
/// operations or 150 ms of waiting (HBase's), 4 requests in flight per target, a
/// deadline of 60 s per operation, retries after 100 ms doubling to 5 s.
///
/// ```
/// use std::time::Duration;
/// let options = proctor::RemoteOptions::default()
///     .max_ops(64)
///     .max_age(Duration::from_millis(50))
///     .deadline(Duration::from_secs(30));
/// # let _ = options;
/// ```
#[derive(Clone, Copy, Debug)]
pub struct RemoteOptions {
    rules: BatchRules,
    deadline: Duration,
    retry_min: Duration,
    retry_max: Duration,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            rules: BatchRules::default(),
            deadline: Duration::from_secs(60),
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
        }
    }
}

impl RemoteOptions {
    /// Operations per request, at most (32).
    #[must_use]
    pub fn max_ops(mut self, n: usize) -> Self {
        self.rules.max_ops = n.max(1);
        self
    }

    /// How long an operation waits for others before its request goes (150 ms).
    #[must_use]
    pub fn max_age(mut self, age: Duration) -> Self {
        self.rules.max_age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// Requests to one target at once (4).
    #[must_use]
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.rules.max_in_flight = n.max(1);
        self
    }

    /// How long an operation may go unreported, failed sends retried meanwhile (60 s):
    /// then its procedure gets [`RemoteError::Timeout`] (or
    /// [`RemoteError::CallFailed`] if its sends kept failing).
    #[must_use]
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The first retry's wait after a failed send, doubling up to `max` (100 ms, 5 s).
    #[must_use]
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min;
        self.retry_max = max.max(min);
        self
    }

    fn tick(&self) -> Duration {
        Duration::from_millis((self.rules.max_age_ms / 4).clamp(1, 25))
    }
}

/// The outcomes that came, until their procedures take them.
type Outcomes = Mutex<HashMap<OpId, Result<Vec<u8>, RemoteError>, NameHasher>>;

fn lock(
    outcomes: &Outcomes,
) -> std::sync::MutexGuard<'_, HashMap<OpId, Result<Vec<u8>, RemoteError>, NameHasher>> {
    outcomes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Where an operation is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// In the batcher's queue for its target.
    Queued,
    /// In a request being sent.
    Sending,
    /// Its request was sent: it awaits the report.
    Sent,
    /// Its request failed: it waits to be queued again.
    Retrying,
}

struct Pending {
    target: String,
    payload: Vec<u8>,
    deadline_ms: u64,
    failed_sends: u32,
    last_error: Option<String>,
    stage: Stage,
    /// A target may have it from before a restart (see [`Handing::maybe_sent`]).
    maybe_sent: bool,
    /// Its rolling-back procedure waits for its outcome here (`SettleOp`), or it is an
    /// undo whose rollback waits (`DispatchUndo`): the outcome goes here, not into
    /// the map, and wakes no event; its sends are not retried.
    watcher: Option<tokio::sync::oneshot::Sender<Fate>>,
}

/// The dispatcher actor (see the module docs).
pub struct RemoteDispatcher {
    transport: Arc<dyn AnyTransport>,
    options: RemoteOptions,
    batcher: Batcher<Vec<u8>>,
    pending: HashMap<OpId, Pending, NameHasher>,
    /// Failed operations by when they go again.
    retries: BTreeMap<u64, Vec<OpId>>,
    outcomes: Arc<Outcomes>,
    locks: Addr<LockActor>,
    epoch: Instant,
    /// Whether the user's transport may be called: not once the engine stepped down.
    mandate: Arc<Mandate>,
}

impl RemoteDispatcher {
    pub(crate) fn new(
        transport: Arc<dyn AnyTransport>,
        options: RemoteOptions,
        locks: Addr<LockActor>,
        mandate: Arc<Mandate>,
    ) -> Self {
        RemoteDispatcher {
            mandate,
            transport,
            options,
            batcher: Batcher::new(options.rules),
            pending: HashMap::default(),
            retries: BTreeMap::new(),
            outcomes: Arc::default(),
            locks,
            epoch: super::shared::mono_now(),
        }
    }

    /// What a remote operation's procedure reaches it through.
    pub(crate) fn sink(
        addr: Addr<Self>,
        outcomes: Arc<Outcomes>,
        locks: Addr<LockActor>,
    ) -> crate::remote::Sink {
        Arc::new(DispatcherSink {
            addr,
            outcomes,
            locks,
        })
    }

    /// The outcomes map its procedures take from.
    pub(crate) fn outcomes(&self) -> Arc<Outcomes> {
        self.outcomes.clone()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(
            super::shared::mono_now()
                .saturating_duration_since(self.epoch)
                .as_millis(),
        )
        .unwrap_or(u64::MAX)
    }

    /// Sends each batch as a request of its own. A deposed engine sends nothing, and a
    /// request in progress is not polled again (its operations are the lease's new
    /// holder's to send).
    fn send_all(&mut self, batches: Vec<Batch<Vec<u8>>>, ctx: &mut Context<Self>) {
        if !self.mandate.holds() {
            return;
        }
        for batch in batches {
            let ids: Vec<OpId> = batch.ops.iter().map(|(id, _)| *id).collect();
            for id in &ids {
                if let Some(p) = self.pending.get_mut(id) {
                    p.stage = Stage::Sending;
                }
            }
            let target = batch.target;
            ::metrics::histogram!(super::metrics::REMOTE_BATCH_OPS, "target" => target.clone())
                .record(ids.len() as f64);
            self.gauges(&target);
            let started = Instant::now();
            perturb::point("remote::send_all::send");
            let send = self.transport.send(target.clone(), batch.ops);
            let mandate = self.mandate.clone();
            let send = async move {
                let mut send = std::pin::pin!(send);
                std::future::poll_fn(|cx| {
                    if mandate.holds() {
                        send.as_mut().poll(cx).map(Some)
                    } else {
                        std::task::Poll::Ready(None)
                    }
                })
                .await
            };
            ctx.spawn(
                actix::fut::wrap_future(send).map(move |result, act: &mut Self, ctx| {
                    if let Some(result) = result {
                        act.sent(&target, ids, result, started, ctx);
                    }
                }),
            );
        }
    }

    /// A request finished: its operations await their reports, or are retried.
    fn sent(
        &mut self,
        target: &str,
        ids: Vec<OpId>,
        result: Result<Vec<Report>, TransportError>,
        started: Instant,
        ctx: &mut Context<Self>,
    ) {
        ::metrics::histogram!(super::metrics::REMOTE_SEND, "target" => target.to_string())
            .record(started.elapsed());
        let now = self.now_ms();
        match result {
            Ok(reports) => {
                for id in &ids {
                    if let Some(p) = self
                        .pending
                        .get_mut(id)
                        .filter(|p| p.stage == Stage::Sending)
                    {
                        p.stage = Stage::Sent;
                    }
                }
                for report in reports {
                    self.take_report(report);
                }
            }
            Err(e) => {
                ::metrics::counter!(super::metrics::REMOTE_SEND_FAILURES, "target" => target.to_string())
                    .increment(1);
                tracing::debug!(target: crate::targets::REMOTE, target_node = target, error = %e, ops = ids.len(), "a remote request failed; retrying");
                for id in ids {
                    let Some(p) = self
                        .pending
                        .get_mut(&id)
                        .filter(|p| p.stage == Stage::Sending)
                    else {
                        continue;
                    };
                    p.failed_sends += 1;
                    p.last_error = Some(e.0.clone());
                    let backoff = self
                        .options
                        .retry_min
                        .saturating_mul(1 << p.failed_sends.min(16).saturating_sub(1))
                        .min(self.options.retry_max);
                    let at = now + u64::try_from(backoff.as_millis()).unwrap_or(u64::MAX);
                    // An op whose rollback waits is sent no more: the call failed after
                    // it may have reached the target. (An undo is retried.)
                    let watched = p.watcher.is_some() && id.undoes().is_none();
                    if at >= p.deadline_ms || watched {
                        let reason = e.0.clone();
                        let target = p.target.clone();
                        self.complete(id, Err(RemoteError::CallFailed { target, reason }));
                    } else {
                        p.stage = Stage::Retrying;
                        self.retries.entry(at).or_default().push(id);
                    }
                }
            }
        }
        let more = self.batcher.finished(target, now);
        self.send_all(more, ctx);
        self.gauges(target);
    }

    /// Gives `op` its outcome and wakes its procedure, or hands it to the rollback that
    /// waits for it; it is forgotten here.
    fn complete(&mut self, op: OpId, outcome: Result<Vec<u8>, RemoteError>) {
        let Some(p) = self.pending.remove(&op) else {
            return;
        };
        if p.stage == Stage::Queued {
            self.batcher.cancel(&p.target, op);
        }
        match p.watcher {
            Some(watcher) => {
                if let Err(e) = &outcome {
                    ::metrics::counter!(super::metrics::REMOTE_FAILURES, "target" => p.target.clone())
                        .increment(1);
                    tracing::debug!(target: crate::targets::REMOTE, %op, error = %e, "remote operation failed during its rollback");
                }
                if let Err(Fate::Outcome(outcome)) = watcher.send(Fate::Outcome(outcome)) {
                    // The rollback that waited is gone (its tree stopped, or the
                    // shutdown ended it): its next try takes the outcome from the map.
                    // No event: nothing suspends on it any more.
                    lock(&self.outcomes).insert(op, outcome);
                }
                self.gauges(&p.target);
            }
            None => self.settle(op, &p.target, outcome),
        }
    }

    /// Puts `op`'s outcome where its procedure takes it, then wakes the procedure.
    fn settle(&mut self, op: OpId, target: &str, outcome: Result<Vec<u8>, RemoteError>) {
        if let Err(e) = &outcome {
            ::metrics::counter!(super::metrics::REMOTE_FAILURES, "target" => target.to_string())
                .increment(1);
            tracing::debug!(target: crate::targets::REMOTE, %op, error = %e, "remote operation failed");
        }
        lock(&self.outcomes).insert(op, outcome);
        perturb::point("remote::settle::wake");
        self.locks.do_send(WakeEvent(event_of(op)));
        self.gauges(target);
    }

    /// A target's report: the operation's outcome, unless it is unknown or has one
    /// (then counted and ignored: `false`).
    fn take_report(&mut self, report: Report) -> bool {
        let Some(target) = self.pending.get(&report.op).map(|p| p.target.clone()) else {
            ::metrics::counter!(super::metrics::REMOTE_REPORTS_IGNORED).increment(1);
            tracing::debug!(target: crate::targets::REMOTE, op = %report.op, "report for an unknown or finished operation; ignored");
            return false;
        };
        let outcome = report
            .outcome
            .map_err(|reason| RemoteError::Operation { target, reason });
        self.complete(report.op, outcome);
        true
    }

    /// Retries that are due, requests due by age, and operations past their deadline.
    fn tick(&mut self, ctx: &mut Context<Self>) {
        let now = self.now_ms();
        let later = self.retries.split_off(&(now + 1));
        let due = std::mem::replace(&mut self.retries, later);
        let mut again: HashMap<String, Vec<(OpId, Vec<u8>)>, NameHasher> = HashMap::default();
        for id in due.into_values().flatten() {
            if let Some(p) = self
                .pending
                .get_mut(&id)
                .filter(|p| p.stage == Stage::Retrying)
            {
                p.stage = Stage::Queued;
                again
                    .entry(p.target.clone())
                    .or_default()
                    .push((id, p.payload.clone()));
            }
        }
        let mut batches = Vec::new();
        for (target, ops) in again {
            batches.extend(self.batcher.push_front(&target, ops, now));
        }
        batches.extend(self.batcher.due(now));
        self.send_all(batches, ctx);
        // Past their deadline: not reported in time (a request still being sent
        // decides for its own operations when it ends).
        let expired: Vec<OpId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.deadline_ms <= now && p.stage != Stage::Sending)
            .map(|(id, _)| *id)
            .collect();
        for id in expired {
            let Some(p) = self.pending.get(&id) else {
                continue;
            };
            let target = p.target.clone();
            let error = match (&p.last_error, p.stage) {
                (Some(reason), Stage::Retrying | Stage::Queued) => RemoteError::CallFailed {
                    target,
                    reason: reason.clone(),
                },
                _ => RemoteError::Timeout {
                    target,
                    deadline_ms: u64::try_from(self.options.deadline.as_millis())
                        .unwrap_or(u64::MAX),
                },
            };
            self.complete(id, Err(error));
        }
    }

    fn gauges(&self, target: &str) {
        let (queued, in_flight) = self.batcher.load(target);
        ::metrics::gauge!(super::metrics::REMOTE_QUEUED, "target" => target.to_string())
            .set(queued as f64);
        ::metrics::gauge!(super::metrics::REMOTE_IN_FLIGHT, "target" => target.to_string())
            .set(in_flight as f64);
    }
}

impl Actor for RemoteDispatcher {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        super::metrics::describe_remote();
        ctx.run_interval(self.options.tick(), |act, ctx| act.tick(ctx));
    }
}

/// A remote operation's procedure hands it over (see [`RemoteSink::dispatch`]).
pub(crate) struct Dispatch {
    op: OpId,
    target: String,
    payload: Vec<u8>,
    how: Handing,
}

impl Message for Dispatch {
    type Result = ();
}

impl Handler<Dispatch> for RemoteDispatcher {
    type Result = ();

    fn handle(&mut self, msg: Dispatch, ctx: &mut Context<Self>) {
        if self.pending.contains_key(&msg.op)
            || lock(&self.outcomes).contains_key(&msg.op)
            || !self.mandate.holds()
        {
            return;
        }
        let payload = if msg.how.resend {
            match self.transport.rebuild(&msg.target, &msg.payload) {
                Some(payload) => payload,
                None => {
                    let not_sent = RemoteError::NotSent {
                        target: msg.target.clone(),
                    };
                    self.settle(msg.op, &msg.target, Err(not_sent));
                    return;
                }
            }
        } else {
            // A value of another type than the transport's would fail every send
            // until its deadline: it fails at once.
            if let Err(reason) = self.transport.check(&msg.payload) {
                let target = msg.target.clone();
                self.settle(
                    msg.op,
                    &msg.target,
                    Err(RemoteError::BadOp { target, reason }),
                );
                return;
            }
            msg.payload
        };
        self.enqueue(msg.op, msg.target, payload, msg.how.maybe_sent, None, ctx);
    }
}

impl RemoteDispatcher {
    /// Queues `op` for `target`, to be sent within its deadline.
    fn enqueue(
        &mut self,
        op: OpId,
        target: String,
        payload: Vec<u8>,
        maybe_sent: bool,
        watcher: Option<tokio::sync::oneshot::Sender<Fate>>,
        ctx: &mut Context<Self>,
    ) {
        let now = self.now_ms();
        let deadline = u64::try_from(self.options.deadline.as_millis()).unwrap_or(u64::MAX);
        let batches = self.batcher.push(&target, op, payload.clone(), now);
        self.pending.insert(
            op,
            Pending {
                target: target.clone(),
                payload,
                deadline_ms: now.saturating_add(deadline),
                failed_sends: 0,
                last_error: None,
                stage: Stage::Queued,
                maybe_sent,
                watcher,
            },
        );
        self.gauges(&target);
        self.send_all(batches, ctx);
    }
}

impl Message for Report {
    /// Whether the report was taken (`false`: ignored); an error from an executor
    /// without a dispatcher.
    type Result = Result<bool, crate::Error>;
}

impl Handler<Report> for RemoteDispatcher {
    type Result = Result<bool, crate::Error>;

    fn handle(&mut self, msg: Report, _ctx: &mut Context<Self>) -> Self::Result {
        Ok(self.take_report(msg))
    }
}

/// A target is gone (HBase's `removeNode`): every operation queued for it or awaiting
/// its report fails with [`RemoteError::TargetGone`]. Answers how many.
#[derive(Debug)]
pub struct RemoveTarget(pub String);

impl Message for RemoveTarget {
    type Result = Result<usize, crate::Error>;
}

impl Handler<RemoveTarget> for RemoteDispatcher {
    type Result = Result<usize, crate::Error>;

    fn handle(&mut self, msg: RemoveTarget, _ctx: &mut Context<Self>) -> Self::Result {
        self.batcher.remove(&msg.0);
        let gone: Vec<OpId> = self
            .pending
            .iter()
            .filter(|(_, p)| p.target == msg.0)
            .map(|(id, _)| *id)
            .collect();
        tracing::info!(target: crate::targets::REMOTE, target_node = %msg.0, ops = gone.len(), "remote target removed");
        for id in &gone {
            self.complete(
                *id,
                Err(RemoteError::TargetGone {
                    target: msg.0.clone(),
                }),
            );
        }
        Ok(gone.len())
    }
}

/// A remote operation's procedure was rolled back: forget the operation.
struct CancelOp(OpId);

impl Message for CancelOp {
    type Result = ();
}

impl Handler<CancelOp> for RemoteDispatcher {
    type Result = ();

    fn handle(&mut self, msg: CancelOp, _ctx: &mut Context<Self>) {
        if let Some(p) = self.pending.remove(&msg.0) {
            if p.stage == Stage::Queued {
                self.batcher.cancel(&p.target, msg.0);
            }
            self.gauges(&p.target);
        }
        lock(&self.outcomes).remove(&msg.0);
    }
}

/// A remote operation's procedure rolls back to undo it (see [`RemoteSink::settle`]):
/// the dispatcher hands it to the transport no more, and answers with its fate once it
/// has one.
struct SettleOp {
    op: OpId,
    answer: tokio::sync::oneshot::Sender<Fate>,
}

impl Message for SettleOp {
    type Result = ();
}

impl Handler<SettleOp> for RemoteDispatcher {
    type Result = ();

    fn handle(&mut self, msg: SettleOp, _ctx: &mut Context<Self>) {
        let SettleOp { op, answer } = msg;
        // Its event is woken no more (its outcome goes to the answer); an earlier wake
        // of this dispatcher's is ahead of this reset at the lock actor.
        self.locks.do_send(ResetEvent(event_of(op)));
        if let Some(outcome) = lock(&self.outcomes).remove(&op) {
            let _ = answer.send(Fate::Outcome(outcome));
            return;
        }
        let Some(p) = self.pending.get_mut(&op) else {
            let _ = answer.send(Fate::Unknown);
            return;
        };
        match p.stage {
            // In a request, or awaiting its report: its outcome is the answer.
            Stage::Sending | Stage::Sent => p.watcher = Some(answer),
            Stage::Queued | Stage::Retrying => {
                let fate = if p.maybe_sent || p.failed_sends > 0 {
                    Fate::Stopped
                } else {
                    Fate::Unsent
                };
                let target = p.target.clone();
                if p.stage == Stage::Queued {
                    self.batcher.cancel(&target, op);
                }
                self.pending.remove(&op);
                self.gauges(&target);
                let _ = answer.send(fate);
            }
        }
    }
}

/// A rollback sends an operation's undo (see [`RemoteSink::undo`]), and waits for its
/// outcome.
struct DispatchUndo {
    undo: OpId,
    target: String,
    payload: Vec<u8>,
    answer: tokio::sync::oneshot::Sender<Fate>,
}

impl Message for DispatchUndo {
    type Result = ();
}

impl Handler<DispatchUndo> for RemoteDispatcher {
    type Result = ();

    fn handle(&mut self, msg: DispatchUndo, ctx: &mut Context<Self>) {
        let DispatchUndo {
            undo,
            target,
            payload,
            answer,
        } = msg;
        if !self.mandate.holds() {
            return;
        }
        if let Some(p) = self.pending.get_mut(&undo) {
            // In hand already, for a rollback that is gone: this one waits instead.
            p.watcher = Some(answer);
            return;
        }
        if let Some(outcome) = lock(&self.outcomes).remove(&undo) {
            // Came after the rollback that waited for it was gone.
            let _ = answer.send(Fate::Outcome(outcome));
            return;
        }
        if let Err(reason) = self.transport.check(&payload) {
            let _ = answer.send(Fate::Outcome(Err(RemoteError::BadOp { target, reason })));
            return;
        }
        self.enqueue(undo, target, payload, true, Some(answer), ctx);
    }
}

/// What a remote operation's procedure reaches the dispatcher through.
struct DispatcherSink {
    addr: Addr<RemoteDispatcher>,
    outcomes: Arc<Outcomes>,
    locks: Addr<LockActor>,
}

impl RemoteSink for DispatcherSink {
    fn dispatch(&self, op: OpId, target: &str, payload: &[u8], how: Handing) {
        perturb::point("remote::sink::dispatch");
        self.addr.do_send(Dispatch {
            op,
            target: target.to_string(),
            payload: payload.to_vec(),
            how,
        });
    }

    fn take(&self, op: OpId) -> Option<Result<Vec<u8>, RemoteError>> {
        let outcome = lock(&self.outcomes).remove(&op)?;
        perturb::point("remote::sink::take");
        // Its event was woken once and is used no more: its entry goes.
        self.locks.do_send(ResetEvent(event_of(op)));
        Some(outcome)
    }

    fn cancel(&self, op: OpId) {
        self.addr.do_send(CancelOp(op));
        self.locks.do_send(ResetEvent(event_of(op)));
    }

    fn settle(&self, op: OpId) -> Answer<Fate> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        perturb::point("remote::sink::settle");
        self.addr.do_send(SettleOp { op, answer });
        Box::pin(async move { answered.await.ok() })
    }

    fn undo(&self, undo: OpId, target: &str, payload: &[u8]) -> Answer<Fate> {
        let (answer, answered) = tokio::sync::oneshot::channel();
        perturb::point("remote::sink::undo");
        self.addr.do_send(DispatchUndo {
            undo,
            target: target.to_string(),
            payload: payload.to_vec(),
            answer,
        });
        Box::pin(async move { answered.await.ok() })
    }
}
