//! The procedure cell: the state of one live procedure: the user's object, its last
//! good encoded state, and what it must settle between calls (aborts and a timeout that
//! arrived during a call, an operator's pause, a failed step's fate being decided). Its
//! procedure actor ([`ProcedureActor`](super::ProcedureActor)) holds it while the
//! procedure is active, and only that actor calls into it, each call one message; while
//! the procedure waits (for children, an event, a timer, an operator) its root stack
//! keeps it as a value.
//!
//! It never decides what happens next; it reports what the user's code returned
//! ([`StepDone`], [`FailRequest`], [`RolledBack`]) to its root stack, which works through
//! them in the order they were sent; the step's worker is freed once its report is
//! recorded. While a call is running the object is moved into the call's future; an
//! abort that arrives meanwhile waits for the step to end, so user code never sees two
//! calls at once. Once its tree is halted (the store failed) it calls no user code at
//! all, exactly as if the process had died.

use std::sync::Arc;
use std::time::Instant;

use crate::cancel::{Cancel, CancelReason};
use crate::erased::{Call, DynProc, ErasedProc, Next, StepResult};
use crate::locks::LockClaim;
use crate::procedure::{FailurePolicy, LockState, ProcError, ProcId, ProcState};
use crate::registry::RegistryError;
use crate::root_stack::{
    ChildrenSeen, NewChild, OnError, RollbackFailure, RollbackOf, StepOutcome, StepReport,
};

use crate::actors::guard::{decode_guarded, guard, CatchUnwind};
use crate::actors::perturb;
use crate::actors::protocol::{
    AbortAck, FailRequest, LockFailed, LocksHeld, Outbox, Release, ReleaseLocks, Report, Rollback,
    RolledBack, RunStep, StepDone, ToCell,
};
use crate::actors::shared::{now_ms, Shared, TreeStatus};

use super::ProcCtx;

mod between;

/// Who a procedure is.
pub(crate) struct ProcSpec {
    pub(crate) id: ProcId,
    pub(crate) parent: Option<ProcId>,
    pub(crate) root: ProcId,
    /// Its registered type name.
    pub(crate) type_name: &'static str,
    /// When its timeout expires (persisted, so it holds across restarts).
    pub(crate) deadline_ms: Option<u64>,
    /// Rebuilt by recovery: call `after_recover` when the cell starts.
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

pub(crate) struct ProcedureCell {
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
    status: Arc<TreeStatus>,
    /// This procedure failed (a step, or an accepted abort or timeout): run no more steps.
    failed: bool,
    /// Its failed step's fate is the root stack's to decide (its policy may retry or
    /// pause it; past a point of no return it pauses): an abort waits for that
    /// decision (`went_on`, or `tree_failed`) instead of being answered as if it
    /// were failing.
    deciding: bool,
    /// A step returned Done: nothing more to abort.
    done: bool,
    lock_held: bool,
    /// What arrived while a call ran, and an operator's pause: rare, so boxed (a cell
    /// is in every live procedure's tree, idle or not).
    pending: Option<Box<Pending>>,
    /// The running step's cancellation signal, raised by an abort that arrives meanwhile.
    step_cancel: Option<Cancel>,
    /// The signal steps get, reused from step to step until one is raised.
    cancel: Option<Cancel>,
    /// The procedure's span (id, root, parent, type): the parent of its step and
    /// rollback spans, so whatever user code logs carries them.
    span: tracing::Span,
    /// `proctor_step_duration_seconds` for its type, registered once.
    step_seconds: ::metrics::Histogram,
    /// The second (of the clock, modulo 2^16) in which it last asked its object for its
    /// state name: a procedure that runs on from step to step is asked at its first
    /// step in each second, not at every step. Two bytes, in the bools' padding.
    named_s: u16,
}

/// The second of `now_ms`, modulo 2^16 (a name is taken once more than needed if a
/// procedure runs on for exactly 2^16 s between two steps).
fn second_of(now_ms: u64) -> u16 {
    (now_ms / 1_000) as u16
}

/// What arrived for a cell while a call into user code ran, and an operator's pause.
#[derive(Default)]
struct Pending {
    /// Aborts, answered when the call ends.
    aborts: Vec<AbortAck>,
    /// The timeout expired.
    timeout: bool,
    /// An operator asked it to pause: report its next step as paused, not run.
    pause_next: bool,
}

/// A call into user code in progress, counted by the graceful shutdown's drain until
/// it is dropped: when the call's result has been handled, or with the call itself if
/// its root stack dies first.
pub(crate) struct InCall(Arc<Shared>);

impl InCall {
    fn begin(shared: &Arc<Shared>) -> Option<InCall> {
        shared.drain.begin_call().then(|| InCall(shared.clone()))
    }
}

impl Drop for InCall {
    fn drop(&mut self) {
        self.0.drain.end_call();
    }
}

/// A call into user code that ended.
pub(crate) enum CallEnd {
    Step(StepEnd),
    Rollback(RollbackEnd),
}

/// What a step's future hands back to the cell.
pub(crate) type StepEnd = (DynProc, Call, Result<StepResult, ProcError>, InCall);

/// What a rollback's future hands back to the cell.
pub(crate) type RollbackEnd = (
    DynProc,
    Call,
    Result<Result<(), ProcError>, ProcError>,
    InCall,
);

impl ProcedureCell {
    pub(crate) fn new(
        spec: ProcSpec,
        proc: DynProc,
        data: Vec<u8>,
        shared: Arc<Shared>,
        status: Arc<TreeStatus>,
    ) -> Self {
        let span = tracing::info_span!(target: crate::targets::PROCEDURE,
            "procedure",
            id = spec.id.0,
            root = spec.root.0,
            parent = spec.parent.map(|p| p.0),
            r#type = %spec.type_name,
        );
        ProcedureCell {
            span,
            step_seconds: shared.metrics.step_histogram(spec.type_name),
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
            status,
            failed: false,
            deciding: false,
            done: false,
            lock_held: false,
            pending: None,
            step_cancel: None,
            cancel: None,
            named_s: second_of(now_ms()),
        }
    }

    /// Its actor started: a recovered procedure's `after_recover` hook runs, once (at
    /// its first activation after recovery, or after its actor was restarted), unless
    /// its tree halted meanwhile.
    pub(crate) fn activated(&mut self) {
        if !std::mem::take(&mut self.recovered) || self.cut_off() {
            return;
        }
        let call = self.context();
        if let Some(proc) = self.proc.as_mut() {
            if let Err(e) = guard("after_recover", || proc.after_recover(&call)) {
                tracing::error!(target: crate::targets::PROCEDURE, proc = %self.id, %e, "after_recover panicked");
            }
        }
    }

    pub(crate) fn id(&self) -> ProcId {
        self.id
    }

    /// Whether the procedure may call no user code, as after a crash: its tree halted
    /// (nothing it does can be made durable), or the engine lost its mandate (it
    /// stepped down, or its leader lease ran out by its own clock). Read before every
    /// call into the user's object.
    fn cut_off(&self) -> bool {
        self.status.halted() || self.status.deposed()
    }

    /// Its failed step's fate is being decided (see `deciding`).
    pub(crate) fn deciding(&self) -> bool {
        self.deciding
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
        .with_fencing_token(self.shared.fencing_token)
        .with_partition(self.shared.partition)
        .with_remote(self.shared.remote.as_ref().map(|(sink, _)| sink.clone()))
    }

    /// Reports a step that did not run (skipped, yielded).
    fn report(&mut self, outcome: StepOutcome, data: Vec<u8>, out: &mut Outbox) {
        let report = StepReport {
            id: self.id,
            outcome,
            data,
            result: None,
            irreversible: false,
            on_error: None,
        };
        self.send_report(report, Vec::new(), None, out);
    }

    /// `state_name`: the procedure's state name after the step, for operators.
    fn send_report(
        &mut self,
        report: StepReport,
        children: Vec<(ProcId, DynProc)>,
        state_name: Option<String>,
        out: &mut Outbox,
    ) {
        // The root stack frees the worker once it has recorded this report; freeing it
        // here would let a later step's report overtake this one.
        perturb::point("procedure::report::step_done");
        out.push_back(Report::StepDone(StepDone {
            report,
            children,
            state_name,
        }));
    }

    /// Encodes the object's state; on failure keeps the last good bytes and says why.
    /// The encoder writes into the thread's buffer (`registry::with_scratch`), so a
    /// step's encoding costs one allocation of the exact size.
    fn encode(&mut self, proc: &dyn ErasedProc) -> Result<Vec<u8>, ProcError> {
        crate::registry::with_scratch(|buf| {
            // Its type is registered under `type_name` (it was encoded before, at its
            // insert): no lookup of the name again.
            match proc.encode_state_into(buf) {
                Ok(()) => {
                    self.data.clear();
                    self.data.extend_from_slice(buf);
                    Ok(buf.to_vec())
                }
                Err(source) => Err(ProcError::Persist(
                    RegistryError::Encode {
                        name: self.type_name,
                        source,
                    }
                    .to_string(),
                )),
            }
        })
    }

    /// Turns what `execute` returned into a report: names and encodes children and the
    /// procedure's own new state.
    fn finish_step(
        &mut self,
        mut proc: DynProc,
        ctx: &Call,
        result: Result<StepResult, ProcError>,
        out: &mut Outbox,
    ) {
        let mut children = Vec::new();
        let (mut next, value, irreversible, retry) = match result {
            Ok(StepResult {
                next,
                value,
                irreversible,
                retry,
            }) => (next, value, irreversible, retry),
            Err(panic) => (Err(panic), None, false, None),
        };
        if next.is_err() && ctx.cancel_reason() == Some(CancelReason::Shutdown) {
            // Stopped by the shutdown, not failed: as a yield, nothing is recorded, and
            // like a step cut off by a crash it runs again after the restart.
            tracing::info!(target: crate::targets::PROCEDURE, parent: &self.span, "step stopped by the shutdown; it runs again after the restart");
            next = Ok(Next::Yield);
        }
        let mut outcome = match next {
            Ok(Next::Done) => StepOutcome::Done,
            Ok(Next::MoreToDo) => StepOutcome::MoreToDo {
                yield_after: proc.is_yield_after_execution(),
            },
            Ok(Next::Children(procs)) => {
                let named = self.name_children(procs, &mut children);
                named.map_or_else(StepOutcome::Failed, StepOutcome::Children)
            }
            Ok(Next::Spawn(procs)) => {
                let named = self.name_children(procs, &mut children);
                named.map_or_else(StepOutcome::Failed, StepOutcome::Spawn)
            }
            Ok(Next::Yield) => StepOutcome::Yield,
            Ok(Next::Suspend(event)) => StepOutcome::Suspend(event),
            Ok(Next::SleepUntil(at_ms)) => StepOutcome::SleepUntil(at_ms),
            Err(e) => StepOutcome::Failed(e),
        };
        // A lock held for the procedure's life is released by `stop`, after the final
        // record (and any rollback) — never between a failed step and its rollback.
        // A halted tree is a crashed process: nothing is released.
        if self.lock_held && !proc.holds_lock() && !self.cut_off() {
            self.release_lock(&mut *proc, ctx);
        }
        let mut on_error = None;
        let data = match &outcome {
            StepOutcome::Yield => Vec::new(),
            // The failed attempt's state goes with the report (a rollback starts from
            // it), and so does the state recorded before the step, which a retry or a
            // pause records again (and then reloads: `reset`).
            StepOutcome::Failed(error) => {
                let policy =
                    guard("failure_policy", || proc.failure_policy(error)).unwrap_or_default();
                let before = self.data.clone();
                let after = self.encode(&*proc).unwrap_or_else(|_| before.clone());
                // Even under `Rollback`: past a point of no return a sibling may have
                // recorded meanwhile, a failure pauses instead.
                self.deciding = !self.status.failed();
                // The executor's default, for a step that set none under a policy that
                // does not retry (`policy::for_step` decides for retryable errors).
                let retry = retry
                    .or_else(|| self.shared.retry_policy.filter(|_| !policy.retries()))
                    .map(Box::new);
                on_error = Some(OnError {
                    policy,
                    before,
                    retry,
                });
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
                        retry: None,
                    });
                    self.data.clone()
                }
            },
        };
        let waits = matches!(
            outcome,
            StepOutcome::Suspend(_) | StepOutcome::SleepUntil(_)
        );
        match &outcome {
            StepOutcome::Done => self.done = true,
            StepOutcome::Failed(error) => {
                tracing::info!(target: crate::targets::PROCEDURE, parent: &self.span, %error, "step failed");
                self.failed = true;
            }
            // Idle for a while: the next step gets a new cancellation signal, and the
            // waiting procedure keeps none.
            StepOutcome::Suspend(_) | StepOutcome::SleepUntil(_) => self.cancel = None,
            _ => {}
        }
        // For operators: the state it is in now (published with the step's record),
        // when it stops running on, and once a second while it runs on (formatting a
        // name at every step cost a step about 3 % of its instructions).
        let runs_on = matches!(outcome, StepOutcome::MoreToDo { yield_after: false });
        let second = second_of(ctx.now_ms());
        let state_name = if !runs_on || second != self.named_s {
            self.named_s = second;
            guard("state_name", || proc.state_name()).ok().flatten()
        } else {
            None
        };
        self.proc = Some(proc);
        // A value for the caller counts from a step that is recorded (the last one set
        // wins); a failed or yielded step's is not taken.
        let result = value.filter(|_| outcome.is_recorded());
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
            state_name,
            out,
        );
        if waits && self.pending.as_ref().is_some_and(|p| p.pause_next) {
            // An operator's pause asked during the step, which now waits for an event
            // or a timer: no step comes soon to stop at, so it pauses now, as a pause
            // of a waiting procedure does (after the step's report, which makes it wait).
            self.forget_pause();
            self.pause(true, out);
        }
    }

    fn name_children(
        &self,
        procs: Vec<DynProc>,
        objects: &mut Vec<(ProcId, DynProc)>,
    ) -> Result<Vec<NewChild>, ProcError> {
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
                    return Err(match e {
                        Undeclarable::Registry(e) => ProcError::Persist(format!("child: {e}")),
                        Undeclarable::Invalid(e) => ProcError::failed(format_args!("child: {e}")),
                    });
                }
            }
        }
        Ok(named)
    }

    fn release_lock(&mut self, proc: &mut dyn ErasedProc, ctx: &Call) {
        self.lock_held = false;
        if let Err(e) = guard("release_lock", || proc.release_lock(ctx)) {
            tracing::error!(target: crate::targets::PROCEDURE, proc = %self.id, %e, "release_lock panicked; the lock may leak");
        }
    }

    /// Handles what the scheduler sent.
    pub(crate) fn deliver(&mut self, msg: ToCell, out: &mut Outbox, ctx: &mut ProcCtx<'_>) {
        match msg {
            ToCell::RunStep(RunStep { step, children }) => self.run_step(step, children, out, ctx),
            ToCell::Rollback(Rollback { of }) => self.rollback(of, out, ctx),
            ToCell::LocksGranted => {
                // Between steps: `data` is the state the last record holds.
                out.push_back(Report::LocksHeld(LocksHeld {
                    id: self.id,
                    data: self.data.clone(),
                }));
            }
            ToCell::LockFailed(LockFailed(reason)) => {
                if self.failed || self.done || self.status.failed() {
                    return;
                }
                self.failed = true;
                tracing::warn!(target: crate::targets::PROCEDURE, proc = %self.id, %reason, "procedure failed on a deadlock");
                out.push_back(Report::Fail(FailRequest {
                    id: self.id,
                    failure: Some((ProcError::Deadlock(reason), self.data.clone())),
                    ack: None,
                }));
            }
        }
    }

    /// Runs one step (the scheduler counts it against a worker): the user's `execute`
    /// runs as a future of the tree's shard; [`ProcedureCell::step_ended`] takes its end.
    fn run_step(
        &mut self,
        step: usize,
        children: Option<Box<ChildrenSeen>>,
        out: &mut Outbox,
        ctx: &mut ProcCtx<'_>,
    ) {
        if self.shared.drain.is_draining() || self.status.deposed() {
            // A graceful shutdown: the step runs after the restart. A deposed engine:
            // the lease's new holder runs it.
            return;
        }
        if self.failed || self.done || self.status.failed() {
            // Its last good state: the report may be recorded (a procedure that never
            // ran gives up its locks in the record).
            self.report(StepOutcome::Skipped, self.data.clone(), out);
            return;
        }
        let pause = self
            .pending
            .as_mut()
            .is_some_and(|p| std::mem::take(&mut p.pause_next));
        if pause {
            self.tidy_pending();
            // A step boundary: the pause takes effect, and the step runs when an
            // operator continues it.
            self.report(StepOutcome::Paused, self.data.clone(), out);
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("procedure {} dispatched while a call runs", self.id);
        };
        let cancel = self.cancel.get_or_insert_with(Cancel::new).clone();
        let mut pctx = self.context().with_cancel(cancel.clone());
        if let Some(children) = children {
            let ChildrenSeen { states, values } = *children;
            pctx = pctx
                .with_children(states.into_vec())
                .with_child_values(values.into_vec());
        }
        if !self.lock_held {
            match guard("acquire_lock", || proc.acquire_lock(&pctx)) {
                Ok(LockState::Acquired) => self.lock_held = true,
                Ok(LockState::Yield) => {
                    self.proc = Some(proc);
                    self.report(StepOutcome::Yield, Vec::new(), out);
                    return;
                }
                Err(panic) => {
                    self.finish_step(proc, &pctx, Err(panic), out);
                    self.settle_pending(out);
                    return;
                }
            }
        }
        let Some(in_call) = InCall::begin(&self.shared) else {
            self.proc = Some(proc);
            return;
        };
        self.step_cancel = Some(cancel);
        let span = tracing::info_span!(target: crate::targets::PROCEDURE,
            parent: &self.span,
            "step",
            step,
            state = tracing::field::Empty
        );
        if !span.is_disabled() {
            if let Ok(Some(name)) = guard("step_name", || proc.step_name()) {
                span.record("state", name.as_str());
            }
        }
        let step_seconds = self.step_seconds.clone();
        let call = async move {
            let started = Instant::now();
            let result = CatchUnwind {
                hook: "execute",
                future: proc.execute(&pctx),
            }
            .await;
            step_seconds.record(started.elapsed());
            (proc, pctx, result, in_call)
        };
        let call = tracing::Instrument::instrument(call, span);
        ctx.spawn(
            self.status.clone(),
            futures_util::FutureExt::map(call, CallEnd::Step),
        );
    }

    /// The step it was sent is not run: its actor kept stopping past the restart
    /// limit, so the step fails with `error` (its failure policy and the tree's
    /// rollback take it from there, as for a failure the step returned).
    pub(crate) fn fail_step(&mut self, error: ProcError, out: &mut Outbox) {
        if self.cut_off() {
            return;
        }
        let Some(proc) = self.proc.take() else {
            unreachable!("procedure {} failed while a call runs", self.id);
        };
        tracing::error!(target: crate::targets::PROCEDURE, parent: &self.span, %error, "step given up by supervision");
        let pctx = self.context();
        self.finish_step(proc, &pctx, Err(error), out);
        self.settle_pending(out);
    }

    /// A step's call ended: its report goes to the root stack.
    pub(crate) fn step_ended(&mut self, end: StepEnd, out: &mut Outbox) {
        let (proc, pctx, result, in_call) = end;
        if self.step_cancel.take().is_some_and(|c| c.is_cancelled()) {
            // Raised for this step: the next one gets a fresh signal.
            self.cancel = None;
        }
        self.finish_step(proc, &pctx, result, out);
        self.settle_pending(out);
        drop(in_call);
    }

    /// Rolls back the newest step (from the root stack, or from the scheduler once the
    /// rollback's locks are granted), telling it what the step did
    /// ([`Context::undoing`](crate::Context::undoing)).
    pub(crate) fn rollback(&mut self, of: RollbackOf, out: &mut Outbox, ctx: &mut ProcCtx<'_>) {
        let id = self.id;
        if self.cut_off() || self.shared.drain.is_draining() {
            // Cut off like in a crash (or not begun, in a graceful shutdown): recovery
            // rolls back from the durable state.
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("rollback of {id} while a call runs");
        };
        let mut pctx = self.context().undoing_step(of.undo);
        if !of.recorded {
            pctx = pctx.for_unrecorded_step();
        }
        // A rollback runs under the procedure's lock, like a step.
        if !self.lock_held {
            // Its lock not available yet: the rollback waits for it, retried with
            // backoff as long as it takes, whatever the policy. Its hook panicking is
            // a failure of the procedure's like any other.
            let limit = Some(self.shared.rollback_retries);
            let busy = match guard("acquire_lock", || proc.acquire_lock(&pctx)) {
                Ok(LockState::Acquired) => None,
                Ok(LockState::Yield) => {
                    Some((ProcError::failed("lock not available for rollback"), None))
                }
                Err(panic) => Some((panic, limit)),
            };
            if let Some((error, limit)) = busy {
                self.proc = Some(proc);
                if self.has_locks {
                    // The engine's locks were granted for this try: given back like
                    // after a rollback call, or the retry waits for them for ever.
                    ctx.tell(ReleaseLocks {
                        id,
                        what: Release::RollbackStep,
                    });
                }
                out.push_back(Report::RolledBack(RolledBack {
                    id,
                    result: Err(RollbackFailure {
                        error,
                        policy: FailurePolicy::Rollback,
                        data: self.data.clone(),
                        limit,
                    }),
                }));
                return;
            }
            self.lock_held = true;
        }
        let Some(in_call) = InCall::begin(&self.shared) else {
            self.proc = Some(proc);
            return;
        };
        let (undo, recorded) = (of.undo, of.recorded);
        let span = tracing::info_span!(target: crate::targets::PROCEDURE, parent: &self.span, "rollback", %undo, recorded);
        let call = async move {
            let result = CatchUnwind {
                hook: "rollback",
                future: proc.rollback(&pctx),
            }
            .await;
            (proc, pctx, result, in_call)
        };
        let call = tracing::Instrument::instrument(call, span);
        ctx.spawn(
            self.status.clone(),
            futures_util::FutureExt::map(call, CallEnd::Rollback),
        );
    }

    /// A rollback's call ended: its result goes to the root stack.
    pub(crate) fn rollback_ended(
        &mut self,
        end: RollbackEnd,
        out: &mut Outbox,
        ctx: &mut ProcCtx<'_>,
    ) {
        let (mut proc, pctx, result, in_call) = end;
        if !proc.holds_lock() && !self.cut_off() {
            self.release_lock(&mut *proc, &pctx);
        }
        // An `Err` the procedure returned leaves its object as the procedure chose (a
        // state machine keeps the state it could not undo, a DAG which of its tasks
        // it undid and which one failed). A panic leaves it anywhere (half a step
        // undone, or forgotten), and a state that does not encode after a rollback
        // that succeeded leaves it a step ahead of its record: either attempt is
        // discarded, as a failed step's is, so that the retry (or an operator's
        // continue) undoes the same step again from the state recorded before it,
        // which is what the failure records.
        let (result, discard) = match result {
            Err(panic) => (Err(panic), true),
            Ok(Err(error)) => (Err(error), false),
            Ok(Ok(())) => match self.encode(&*proc) {
                Ok(data) => (Ok(data), false),
                Err(error) => (Err(error), true),
            },
        };
        if discard && !self.cut_off() {
            proc = self.reloaded(proc);
        }
        let result = result.map_err(|error| RollbackFailure {
            policy: guard("failure_policy", || proc.failure_policy(&error)).unwrap_or_default(),
            error,
            data: self.data.clone(),
            limit: Some(self.shared.rollback_retries),
        });
        self.proc = Some(proc);
        if self.has_locks && !self.cut_off() {
            ctx.tell(ReleaseLocks {
                id: self.id,
                what: Release::RollbackStep,
            });
        }
        perturb::point("procedure::rollback::rolled_back");
        self.settle_pending(out);
        out.push_back(Report::RolledBack(RolledBack {
            id: self.id,
            result,
        }));
        drop(in_call);
    }

    /// The object decoded again from its recorded state (`data`); `proc` itself if that
    /// fails, which is not expected: the state decoded (or was encoded) before.
    fn reloaded(&self, proc: DynProc) -> DynProc {
        self.decode_recorded(&self.data).unwrap_or(proc)
    }

    /// The object decoded from `data`, a state it recorded; `None`, logged, if that
    /// fails, which is not expected: the state decoded at least once, or was just
    /// encoded.
    fn decode_recorded(&self, data: &[u8]) -> Option<DynProc> {
        // The user's `Deserialize` runs here: a panic in it is caught like any other.
        match decode_guarded(&self.shared.registry, self.type_name, data) {
            Ok(proc) => Some(proc),
            Err(e) => {
                tracing::error!(target: crate::targets::PROCEDURE, proc = %self.id, %e, "cannot reload the recorded state");
                None
            }
        }
    }

    /// The procedure is finished and its final record is durable: release its locks,
    /// run its completion cleanup, and answer late aborts with how it finished.
    pub(crate) fn stop(mut self, state: ProcState) {
        // (Its engine locks were released by its root stack as it was stopped.)
        if let Some(mut proc) = self.proc.take().filter(|_| !self.cut_off()) {
            let pctx = self.context();
            if self.lock_held {
                self.release_lock(&mut *proc, &pctx);
            }
            perturb::point("procedure::stop::cleanup");
            if let Err(e) = guard("completion_cleanup", || proc.completion_cleanup(&pctx)) {
                tracing::error!(target: crate::targets::PROCEDURE, proc = %self.id, %e, "completion_cleanup panicked");
            }
        }
        let aborts = self.pending.take().map(|p| p.aborts).unwrap_or_default();
        for ack in aborts {
            let _ = ack.send(Err(self.finished_error(state)));
        }
    }

    /// The procedure's latest state that encoded: its state as recorded, between calls.
    pub(crate) fn data(&self) -> &[u8] {
        &self.data
    }
}
