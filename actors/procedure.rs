//! The procedure actor: one per live procedure. It owns the user's object and is the
//! only place that calls into it: a step when the scheduler says [`RunStep`], a rollback
//! when its root stack says [`Rollback`], the abort and timeout hooks between steps.
//!
//! It never decides what happens next; it reports what the user's code returned to its
//! root stack ([`StepDone`], [`FailRequest`], [`RolledBack`]), which frees the step's
//! worker once the report is recorded. While a call is running the object is moved into
//! the call's future; an abort that arrives meanwhile waits for the step to end, so user
//! code never sees two calls at once. Once its tree is halted (the store failed) it calls
//! no user code at all, exactly as if the process had died.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;

use crate::cancel::{Cancel, CancelReason};
use crate::erased::{Call, DynProc, ErasedProc, Next, StepResult};
use crate::error::Error;
use crate::locks::LockClaim;
use crate::procedure::{FailurePolicy, LockState, OnTimeout, ProcError, ProcId, ProcState};
use crate::registry::RegistryError;
use crate::root_stack::{NewChild, OnError, RollbackFailure, StepOutcome, StepReport};

use super::guard::{guard, CatchUnwind};
use super::metrics;
use super::perturb;
use super::protocol::{
    AbortAck, AbortProc, Deadline, FailRequest, ForgetPause, LockFailed, LocksGranted, LocksHeld,
    PauseNow, PauseProc, ProcLost, ReleaseLocks, ResetProc, Rollback, RolledBack, RunStep,
    StepDone, StepFinished, StopProc,
};
use super::root_stack::RootStackActor;
use super::shared::{now_ms, Shared, TreeStatus};

/// The largest encoding buffer a thread keeps between steps.
const SCRATCH_KEEP: usize = 1 << 20;

/// Who a procedure actor is.
pub(crate) struct ProcSpec {
    pub(crate) id: ProcId,
    pub(crate) parent: Option<ProcId>,
    pub(crate) root: ProcId,
    /// Its registered type name.
    pub(crate) type_name: &'static str,
    /// When its timeout expires (persisted, so it holds across restarts).
    pub(crate) deadline_ms: Option<u64>,
    /// Rebuilt by recovery: call `after_recover` when the actor starts.
    pub(crate) recovered: bool,
    /// It declared locks (the engine's, in the scheduler's lock table).
    pub(crate) has_locks: bool,
}

/// Why a new procedure cannot start.
pub(crate) enum Undeclarable {
    /// Its type cannot be persisted.
    Registry(RegistryError),
    /// What it declares is not usable (a bad resource name, a panicking hook).
    Invalid(ProcError),
}

/// Names a new procedure: encodes it, and asks (through the panic guard) what it
/// declares once, at its start: its locks and its timeout.
pub(crate) fn declare(
    shared: &Shared,
    proc: &dyn ErasedProc,
    now_ms: u64,
) -> Result<NewChild, Undeclarable> {
    let (type_name, data) = shared
        .registry
        .encode(proc)
        .map_err(Undeclarable::Registry)?;
    let (locks, for_life, timeout_ms) = guard("locks", || {
        (proc.locks(), proc.holds_lock(), proc.timeout_ms())
    })
    .map_err(Undeclarable::Invalid)?;
    let locks = LockClaim::declare(locks, for_life)
        .map_err(|e| Undeclarable::Invalid(ProcError::failed(format_args!("{type_name}: {e}"))))?;
    Ok(NewChild {
        id: shared.next_id(),
        type_name,
        data,
        locks,
        deadline_ms: timeout_ms.map(|t| now_ms.saturating_add(t)),
        nonce: None,
    })
}

pub(crate) struct ProcedureActor {
    id: ProcId,
    /// Its registered type name.
    type_name: &'static str,
    parent: Option<ProcId>,
    root: ProcId,
    deadline_ms: Option<u64>,
    recovered: bool,
    has_locks: bool,
    /// `None` while a call into user code runs.
    proc: Option<DynProc>,
    /// The latest state that encoded, sent again if a later encoding fails.
    data: Vec<u8>,
    shared: Arc<Shared>,
    root_stack: Addr<RootStackActor>,
    status: Arc<TreeStatus>,
    /// This procedure failed (a step, or an accepted abort or timeout): run no more steps.
    failed: bool,
    /// A step returned Done: nothing more to abort.
    done: bool,
    lock_held: bool,
    /// Aborts that arrived while a step ran, answered when it ends.
    pending_aborts: Vec<AbortAck>,
    /// The timeout expired while a step ran.
    pending_timeout: bool,
    /// The running step's cancellation signal, raised by an abort that arrives meanwhile.
    step_cancel: Option<Cancel>,
    /// The signal steps get, reused from step to step until one is raised.
    cancel: Option<Cancel>,
    /// The state name after the last step, for its report.
    state_name: Option<String>,
    /// `StopProc` was handled: the actor ends because the procedure finished.
    stopped: bool,
    /// An operator asked it to pause: report its next step as paused, not run.
    pause_next: bool,
    /// The procedure's span (id, root, parent, type): the parent of its step and
    /// rollback spans, so whatever user code logs carries them.
    span: tracing::Span,
    /// `proctor_step_duration_seconds` for its type, registered once.
    step_seconds: ::metrics::Histogram,
}

impl ProcedureActor {
    pub(crate) fn new(
        spec: ProcSpec,
        proc: DynProc,
        data: Vec<u8>,
        shared: Arc<Shared>,
        root_stack: Addr<RootStackActor>,
        status: Arc<TreeStatus>,
    ) -> Self {
        let span = tracing::info_span!(
            "procedure",
            id = spec.id.0,
            root = spec.root.0,
            parent = spec.parent.map(|p| p.0),
            r#type = %spec.type_name,
        );
        ProcedureActor {
            span,
            step_seconds: metrics::step_histogram(spec.type_name),
            id: spec.id,
            type_name: spec.type_name,
            parent: spec.parent,
            root: spec.root,
            deadline_ms: spec.deadline_ms,
            recovered: spec.recovered,
            has_locks: spec.has_locks,
            proc: Some(proc),
            data,
            shared,
            root_stack,
            status,
            failed: false,
            done: false,
            lock_held: false,
            pending_aborts: Vec::new(),
            pending_timeout: false,
            step_cancel: None,
            cancel: None,
            state_name: None,
            stopped: false,
            pause_next: false,
        }
    }

    fn context(&self) -> Call {
        Call::new(
            self.id,
            self.parent,
            self.root,
            now_ms(),
            self.shared.env.clone(),
        )
        .with_shutdown(self.shared.shutdown.clone())
    }

    /// Reports a step that did not run (skipped, yielded).
    fn report(&mut self, outcome: StepOutcome, data: Vec<u8>) {
        let report = StepReport {
            id: self.id,
            outcome,
            data,
            result: None,
            irreversible: false,
            on_error: None,
        };
        self.send_report(report, Vec::new());
    }

    fn send_report(&mut self, report: StepReport, children: Vec<(ProcId, DynProc)>) {
        // The root stack frees the worker once it has recorded this report; freeing it
        // here would let a later step's report overtake this one.
        perturb::point("procedure::report::step_done");
        if !self.root_stack.connected() {
            // The root stack died of a panic in engine code: no one else would free
            // this step's worker.
            self.shared.scheduler.do_send(StepFinished(self.id));
            return;
        }
        self.root_stack.do_send(StepDone {
            report,
            children,
            state_name: self.state_name.take(),
        });
    }

    /// Encodes the object's state; on failure keeps the last good bytes and says why.
    /// The encoder writes into a buffer of the thread's, so a step's encoding costs one
    /// allocation of the exact size rather than a growing `Vec`'s several.
    fn encode(&mut self, proc: &dyn ErasedProc) -> Result<Vec<u8>, ProcError> {
        thread_local! {
            static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        SCRATCH.with_borrow_mut(|buf| {
            buf.clear();
            let encoded = self.shared.registry.encode_into(proc, buf);
            let result = match encoded {
                Ok(_) => {
                    self.data.clear();
                    self.data.extend_from_slice(buf);
                    Ok(buf.to_vec())
                }
                Err(e) => Err(ProcError::Persist(e.to_string())),
            };
            // One huge state must not pin its buffer for the thread's life.
            if buf.capacity() > SCRATCH_KEEP {
                *buf = Vec::new();
            }
            result
        })
    }

    /// Turns what `execute` returned into a report: names and encodes children and the
    /// procedure's own new state.
    fn finish_step(
        &mut self,
        mut proc: DynProc,
        ctx: &Call,
        result: Result<StepResult, ProcError>,
    ) {
        let mut children = Vec::new();
        let (mut next, value, irreversible) = match result {
            Ok(StepResult {
                next,
                value,
                irreversible,
            }) => (next, value, irreversible),
            Err(panic) => (Err(panic), None, false),
        };
        if next.is_err() && ctx.cancel_reason() == Some(CancelReason::Shutdown) {
            // Stopped by the shutdown, not failed: as a yield, nothing is recorded, and
            // like a step cut off by a crash it runs again after the restart.
            tracing::info!(parent: &self.span, "step stopped by the shutdown; it runs again after the restart");
            next = Ok(Next::Yield);
        }
        let mut outcome = match next {
            Ok(Next::Done) => StepOutcome::Done,
            Ok(Next::MoreToDo) => StepOutcome::MoreToDo {
                yield_after: proc.is_yield_after_execution(),
            },
            Ok(Next::Children(procs)) => self.name_children(procs, &mut children),
            Ok(Next::Yield) => StepOutcome::Yield,
            Ok(Next::Suspend(event)) => StepOutcome::Suspend(event),
            Ok(Next::SleepUntil(at_ms)) => StepOutcome::SleepUntil(at_ms),
            Err(e) => StepOutcome::Failed(e),
        };
        // A lock held for the procedure's life is released by `StopProc`, after the
        // final record (and any rollback) — never between a failed step and its rollback.
        // A halted tree is a crashed process: nothing is released.
        if self.lock_held && !proc.holds_lock() && !self.status.halted() {
            self.release_lock(&mut *proc, ctx);
        }
        let mut on_error = None;
        let data = match &outcome {
            StepOutcome::Yield => Vec::new(),
            // The failed attempt's state goes with the report (a rollback starts from
            // it), and so does the state recorded before the step, which a retry or a
            // pause records again (and then reloads: `ResetProc`).
            StepOutcome::Failed(error) => {
                let policy =
                    guard("failure_policy", || proc.failure_policy(error)).unwrap_or_default();
                let before = self.data.clone();
                let after = self.encode(&*proc).unwrap_or_else(|_| before.clone());
                on_error = Some(OnError { policy, before });
                after
            }
            _ => match self.encode(&*proc) {
                Ok(bytes) => bytes,
                Err(e) => {
                    children.clear();
                    outcome = StepOutcome::Failed(e);
                    on_error = Some(OnError {
                        policy: FailurePolicy::Rollback,
                        before: self.data.clone(),
                    });
                    self.data.clone()
                }
            },
        };
        match &outcome {
            StepOutcome::Done => self.done = true,
            StepOutcome::Failed(error) => {
                tracing::info!(parent: &self.span, %error, "step failed");
                self.failed = true;
            }
            _ => {}
        }
        // For operators: the state it is in now (published with the step's record).
        self.state_name = guard("state_name", || proc.state_name()).ok().flatten();
        self.proc = Some(proc);
        // The value for the caller counts only from the step that finishes.
        let result = value.filter(|_| matches!(outcome, StepOutcome::Done));
        self.send_report(
            StepReport {
                id: self.id,
                outcome,
                data,
                result,
                irreversible,
                on_error,
            },
            children,
        );
    }

    fn name_children(
        &self,
        procs: Vec<DynProc>,
        objects: &mut Vec<(ProcId, DynProc)>,
    ) -> StepOutcome {
        let mut named = Vec::with_capacity(procs.len());
        let now = now_ms();
        for child in procs {
            match declare(&self.shared, &*child, now) {
                Ok(new) => {
                    objects.push((new.id, child));
                    named.push(new);
                }
                Err(e) => {
                    objects.clear();
                    return StepOutcome::Failed(match e {
                        Undeclarable::Registry(e) => ProcError::Persist(format!("child: {e}")),
                        Undeclarable::Invalid(e) => ProcError::failed(format_args!("child: {e}")),
                    });
                }
            }
        }
        StepOutcome::Children(named)
    }

    fn release_lock(&mut self, proc: &mut dyn ErasedProc, ctx: &Call) {
        self.lock_held = false;
        if let Err(e) = guard("release_lock", || proc.release_lock(ctx)) {
            tracing::error!(proc = %self.id, %e, "release_lock panicked; the lock may leak");
        }
    }

    /// Asks the idle procedure to accept an abort; if it does, fails it with its root
    /// stack, which answers `ack` once that is durable. A refusal is answered at once.
    fn request_failure(&mut self, ack: Option<AbortAck>) {
        if self.status.halted() {
            if let Some(ack) = ack {
                let _ = ack.send(Err(Error::Stopped));
            }
            return;
        }
        if self.done || self.failed || self.status.failed() {
            // Finished, or already failing (itself or its tree): no hook to ask. The
            // answer waits until what it reports is durable.
            let answer = if self.done {
                Err(self.finished_error(ProcState::Success))
            } else {
                Ok(true)
            };
            self.root_stack.do_send(FailRequest {
                id: self.id,
                failure: None,
                ack: ack.map(|ack| (ack, answer)),
            });
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("request_failure while a call runs");
        };
        let (accepted, error) = match guard("abort", || proc.abort()) {
            Ok(accepted) => (accepted, ProcError::Aborted),
            // A panicking hook fails the procedure like any other panic in user code.
            Err(panic) => (true, panic),
        };
        if accepted {
            if ack.is_some() {
                tracing::info!(parent: &self.span, %error, "abort accepted");
            }
            self.failed = true;
            let data = self.encode(&*proc).unwrap_or_else(|_| self.data.clone());
            perturb::point("procedure::request_failure::fail_request");
            self.root_stack.do_send(FailRequest {
                id: self.id,
                failure: Some((error, data)),
                ack: ack.map(|ack| (ack, Ok(true))),
            });
        } else if let Some(ack) = ack {
            let _ = ack.send(Ok(false));
        }
        self.proc = Some(proc);
    }

    /// The deadline passed while the procedure was idle: asks its timeout hook, then
    /// fails it, or persists the new deadline (or none) and re-arms.
    fn expire(&mut self, ctx: &mut Context<Self>) {
        if self.status.halted() || self.done || self.failed || self.status.failed() {
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("a timeout handled while a call runs");
        };
        let timeout_ms = guard("timeout_ms", || proc.timeout_ms())
            .ok()
            .flatten()
            .unwrap_or(0);
        let choice = guard("on_timeout", || proc.on_timeout());
        let data = self.encode(&*proc).unwrap_or_else(|_| self.data.clone());
        self.proc = Some(proc);
        let deadline_ms = match choice {
            Ok(OnTimeout::Rearm(ms)) => Some(now_ms().saturating_add(ms)),
            Ok(OnTimeout::Continue) => None,
            // A panicking hook fails the procedure like any other panic in user code.
            Ok(OnTimeout::Fail) | Err(_) => {
                let error = match choice {
                    Err(panic) => panic,
                    _ => ProcError::TimedOut { timeout_ms },
                };
                tracing::info!(parent: &self.span, %error, "timed out");
                self.failed = true;
                self.root_stack.do_send(FailRequest {
                    id: self.id,
                    failure: Some((error, data)),
                    ack: None,
                });
                return;
            }
        };
        self.deadline_ms = deadline_ms;
        self.root_stack.do_send(Deadline {
            id: self.id,
            deadline_ms,
            data,
        });
        self.arm(ctx);
    }

    /// Starts the timer for the current deadline, if any (at once if it has passed).
    fn arm(&mut self, ctx: &mut Context<Self>) {
        let Some(deadline_ms) = self.deadline_ms else {
            return;
        };
        let delay = Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
        ctx.run_later(delay, move |act, ctx| {
            // A later re-arm replaced this deadline: its own timer is running.
            if act.deadline_ms != Some(deadline_ms) || act.status.halted() {
                return;
            }
            if act.proc.is_some() {
                act.expire(ctx);
            } else {
                act.pending_timeout = true;
            }
        });
    }

    fn finished_error(&self, state: ProcState) -> Error {
        Error::Finished { id: self.id, state }
    }

    /// Answers aborts and a timeout that arrived while a step or rollback ran.
    fn settle_pending(&mut self, ctx: &mut Context<Self>) {
        if self.status.halted() {
            self.pending_timeout = false;
            for ack in std::mem::take(&mut self.pending_aborts) {
                let _ = ack.send(Err(Error::Stopped));
            }
            return;
        }
        if std::mem::take(&mut self.pending_timeout) {
            self.expire(ctx);
        }
        for ack in std::mem::take(&mut self.pending_aborts) {
            self.request_failure(Some(ack));
        }
    }
}

impl Actor for ProcedureActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if self.recovered {
            if let Some(proc) = self.proc.as_mut() {
                if let Err(e) = guard("after_recover", || proc.after_recover()) {
                    tracing::error!(proc = %self.id, %e, "after_recover panicked");
                }
            }
        }
        self.arm(ctx);
    }
}

impl Drop for ProcedureActor {
    /// An actor that ends before its procedure finished, in a tree that is not halted,
    /// died of a panic in engine code (user code is guarded): its root stack would wait
    /// for its reports for ever, so it is told.
    fn drop(&mut self) {
        if !self.stopped && !self.status.halted() {
            self.root_stack.do_send(ProcLost(self.id));
        }
    }
}

impl Handler<RunStep> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: RunStep, ctx: &mut Context<Self>) {
        let id = self.id;
        if self.shared.drain.is_draining() {
            // A graceful shutdown: the step runs after the restart.
            return;
        }
        if self.failed || self.done || self.status.failed() {
            // Its last good state: the report may be recorded (a procedure that never
            // ran gives up its locks in the record).
            self.report(StepOutcome::Skipped, self.data.clone());
            return;
        }
        if std::mem::take(&mut self.pause_next) {
            // A step boundary: the pause takes effect, and the step runs when an
            // operator continues it.
            self.report(StepOutcome::Paused, self.data.clone());
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("procedure {id} dispatched while a call runs");
        };
        let cancel = self.cancel.get_or_insert_with(Cancel::new).clone();
        let pctx = self.context().with_cancel(cancel.clone());
        if !self.lock_held {
            match guard("acquire_lock", || proc.acquire_lock(&pctx)) {
                Ok(LockState::Acquired) => self.lock_held = true,
                Ok(LockState::Yield) => {
                    self.proc = Some(proc);
                    self.report(StepOutcome::Yield, Vec::new());
                    return;
                }
                Err(panic) => {
                    self.finish_step(proc, &pctx, Err(panic));
                    self.settle_pending(ctx);
                    return;
                }
            }
        }
        if !self.shared.drain.begin_call() {
            self.proc = Some(proc);
            return;
        }
        self.step_cancel = Some(cancel);
        let span = tracing::info_span!(
            parent: &self.span,
            "step",
            step = msg.step,
            state = tracing::field::Empty
        );
        if !span.is_disabled() {
            if let Ok(Some(name)) = guard("state_name", || proc.state_name()) {
                span.record("state", name.as_str());
            }
        }
        let step_seconds = self.step_seconds.clone();
        let step = async move {
            let started = Instant::now();
            let result = CatchUnwind {
                hook: "execute",
                future: proc.execute(&pctx),
            }
            .await;
            step_seconds.record(started.elapsed());
            (proc, pctx, result)
        };
        ctx.spawn(
            tracing::Instrument::instrument(step, span)
                .into_actor(self)
                .map(|(proc, pctx, result), act, ctx| {
                    if act.step_cancel.take().is_some_and(|c| c.is_cancelled()) {
                        // Raised for this step: the next one gets a fresh signal.
                        act.cancel = None;
                    }
                    act.finish_step(proc, &pctx, result);
                    act.settle_pending(ctx);
                    act.shared.drain.end_call();
                }),
        );
    }
}

impl Handler<Rollback> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: Rollback, ctx: &mut Context<Self>) {
        let id = self.id;
        if self.status.halted() || self.shared.drain.is_draining() {
            // Cut off like in a crash (or not begun, in a graceful shutdown): recovery
            // rolls back from the durable state.
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("rollback of {id} while a call runs");
        };
        let mut pctx = self.context();
        if msg.unrecorded {
            pctx = pctx.for_unrecorded_step();
        }
        // A rollback runs under the procedure's lock, like a step.
        if !self.lock_held {
            let busy = match guard("acquire_lock", || proc.acquire_lock(&pctx)) {
                Ok(LockState::Acquired) => None,
                Ok(LockState::Yield) => Some(ProcError::failed("lock not available for rollback")),
                Err(panic) => Some(panic),
            };
            if let Some(error) = busy {
                self.proc = Some(proc);
                // The engine's own trouble: retried for ever, whatever the policy.
                self.root_stack.do_send(RolledBack {
                    id,
                    result: Err(RollbackFailure {
                        error,
                        policy: FailurePolicy::Rollback,
                        data: self.data.clone(),
                    }),
                });
                return;
            }
            self.lock_held = true;
        }
        if !self.shared.drain.begin_call() {
            self.proc = Some(proc);
            return;
        }
        let span = tracing::info_span!(parent: &self.span, "rollback", unrecorded = msg.unrecorded);
        let call = async move {
            let result = CatchUnwind {
                hook: "rollback",
                future: proc.rollback(&pctx),
            }
            .await;
            (proc, pctx, result)
        };
        ctx.spawn(
            tracing::Instrument::instrument(call, span)
                .into_actor(self)
                .map(|(mut proc, pctx, result), act, ctx| {
                    if !proc.holds_lock() && !act.status.halted() {
                        act.release_lock(&mut *proc, &pctx);
                    }
                    let result = result
                        .and_then(|r| r)
                        .and_then(|()| act.encode(&*proc))
                        .map_err(|error| RollbackFailure {
                            policy: guard("failure_policy", || proc.failure_policy(&error))
                                .unwrap_or_default(),
                            error,
                            data: act.data.clone(),
                        });
                    act.proc = Some(proc);
                    if act.has_locks && !act.status.halted() {
                        act.shared.scheduler.do_send(ReleaseLocks {
                            id: act.id,
                            step_only: true,
                        });
                    }
                    perturb::point("procedure::rollback::rolled_back");
                    act.settle_pending(ctx);
                    act.root_stack.do_send(RolledBack { id: act.id, result });
                    act.shared.drain.end_call();
                }),
        );
    }
}

impl Handler<AbortProc> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: AbortProc, _ctx: &mut Context<Self>) {
        if self.status.halted() {
            let _ = msg.0.send(Err(Error::Stopped));
        } else if self.proc.is_none() {
            // In a call: answered when it ends; a step is asked to end early.
            if let Some(cancel) = &self.step_cancel {
                cancel.cancel();
            }
            self.pending_aborts.push(msg.0);
        } else {
            self.request_failure(Some(msg.0));
        }
    }
}

impl Handler<StopProc> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: StopProc, ctx: &mut Context<Self>) {
        if self.has_locks && !self.status.halted() {
            // Before the answer: the tree's result is published only after it.
            self.shared.scheduler.do_send(ReleaseLocks {
                id: self.id,
                step_only: false,
            });
        }
        if let Some(mut proc) = self.proc.take() {
            let pctx = self.context();
            if self.lock_held {
                self.release_lock(&mut *proc, &pctx);
            }
            perturb::point("procedure::stop::cleanup");
            if let Err(e) = guard("completion_cleanup", || proc.completion_cleanup()) {
                tracing::error!(proc = %self.id, %e, "completion_cleanup panicked");
            }
        }
        for ack in std::mem::take(&mut self.pending_aborts) {
            let _ = ack.send(Err(self.finished_error(msg.state)));
        }
        self.stopped = true;
        ctx.stop();
    }
}

impl Handler<ForgetPause> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, _msg: ForgetPause, _ctx: &mut Context<Self>) {
        self.pause_next = false;
    }
}

impl Handler<PauseProc> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: PauseProc, _ctx: &mut Context<Self>) {
        if msg.now && self.proc.is_some() && !self.status.halted() {
            let data = self.data.clone();
            self.root_stack.do_send(PauseNow { id: self.id, data });
            return;
        }
        self.pause_next = true;
    }
}

impl Handler<ResetProc> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: ResetProc, _ctx: &mut Context<Self>) {
        match self.shared.registry.decode(self.type_name, &msg.0) {
            Ok(proc) => {
                self.proc = Some(proc);
                self.data = msg.0;
                // It goes on (later), so it is not failed.
                self.failed = false;
            }
            // Its recorded state decoded at least once (or it was just encoded), so
            // this is not expected; keep the object as the failed attempt left it.
            Err(e) => tracing::error!(proc = %self.id, %e, "cannot reload the recorded state"),
        }
    }
}

impl Handler<LocksGranted> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, _msg: LocksGranted, _ctx: &mut Context<Self>) {
        // Between steps: `data` is the state the last record holds.
        self.root_stack.do_send(LocksHeld {
            id: self.id,
            data: self.data.clone(),
        });
    }
}

impl Handler<LockFailed> for ProcedureActor {
    type Result = ();

    fn handle(&mut self, msg: LockFailed, _ctx: &mut Context<Self>) {
        if self.failed || self.done || self.status.failed() {
            return;
        }
        self.failed = true;
        tracing::warn!(proc = %self.id, reason = %msg.0, "procedure failed on a deadlock");
        self.root_stack.do_send(FailRequest {
            id: self.id,
            failure: Some((ProcError::Deadlock(msg.0), self.data.clone())),
            ack: None,
        });
    }
}
