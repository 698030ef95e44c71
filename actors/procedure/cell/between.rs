//! What a cell settles between calls: an operator's abort and pause, a timeout, the
//! root stack's reset after a failed attempt (`reset`, `went_on`) and its tree's
//! failure. Each is asked of the user's code only when no call runs; one that arrives
//! during a call waits in [`Pending`] and is settled when the call ends
//! (`settle_pending`), so the user's object never sees two calls at once.

use crate::actors::guard::guard;
use crate::actors::perturb;
use crate::actors::protocol::{AbortAck, Deadline, FailRequest, Outbox, PauseNow, Report};
use crate::actors::shared::now_ms;
use crate::error::Error;
use crate::procedure::{OnTimeout, ProcError, ProcState};

use super::{Pending, ProcedureCell};

impl ProcedureCell {
    /// Asks the idle procedure to accept an abort; if it does, fails it with its root
    /// stack, which answers `ack` once that is durable. A refusal is answered at once.
    pub(super) fn request_failure(&mut self, ack: Option<AbortAck>, out: &mut Outbox) {
        if self.cut_off() {
            if let Some(ack) = ack {
                let _ = ack.send(Err(Error::Stopped));
            }
            return;
        }
        let ack = match ack {
            Some(ack) if self.deciding && !self.status.failed() => {
                // Its failed step's fate is not decided yet (a policy may retry or
                // pause it): whether it is failing is not known. The abort waits.
                self.pending().aborts.push(ack);
                return;
            }
            ack => ack,
        };
        if self.done || self.failed || self.status.failed() {
            // Finished, or already failing (itself or its tree): no hook to ask. The
            // answer waits until what it reports is durable.
            let answer = if self.done {
                Err(self.finished_error(ProcState::Success))
            } else {
                Ok(true)
            };
            out.push_back(Report::Fail(FailRequest {
                id: self.id,
                failure: None,
                ack: ack.map(|ack| (ack, answer)),
            }));
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("request_failure while a call runs");
        };
        let call = self.context();
        let (accepted, error) = match guard("abort", || proc.abort(&call)) {
            Ok(accepted) => (accepted, ProcError::Aborted),
            // A panicking hook fails the procedure like any other panic in user code.
            Err(panic) => (true, panic),
        };
        if accepted {
            if ack.is_some() {
                tracing::info!(target: crate::targets::PROCEDURE, parent: &self.span, %error, "abort accepted");
            }
            self.failed = true;
            let data = self.encode(&*proc).unwrap_or_else(|_| self.data.clone());
            perturb::point("procedure::request_failure::fail_request");
            out.push_back(Report::Fail(FailRequest {
                id: self.id,
                failure: Some((error, data)),
                ack: ack.map(|ack| (ack, Ok(true))),
            }));
        } else if let Some(ack) = ack {
            let _ = ack.send(Ok(false));
        }
        self.proc = Some(proc);
    }

    /// The deadline passed while the procedure was idle: asks its timeout hook, then
    /// fails it, or persists the new deadline (or none) and re-arms.
    pub(super) fn expire(&mut self, out: &mut Outbox) {
        if self.cut_off() || self.status.failed() {
            return;
        }
        if self.failed || self.done {
            // Its failure is being decided: a failed step's policy may retry or pause
            // it, and past the point of no return a failure pauses it. The deadline
            // counts again once it goes on (`went_on`); if its tree fails, never. Done,
            // its `Done` may yet be refused (children still running): the deadline
            // waits with it, and goes with the cell when the success is recorded.
            self.pending().timeout = true;
            return;
        }
        let Some(mut proc) = self.proc.take() else {
            unreachable!("a timeout handled while a call runs");
        };
        let timeout_ms = guard("timeout_ms", || proc.timeout_ms())
            .ok()
            .flatten()
            .unwrap_or(0);
        let call = self.context();
        let choice = guard("on_timeout", || proc.on_timeout(&call));
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
                tracing::info!(target: crate::targets::PROCEDURE, parent: &self.span, %error, "timed out");
                self.failed = true;
                out.push_back(Report::Fail(FailRequest {
                    id: self.id,
                    failure: Some((error, data)),
                    ack: None,
                }));
                return;
            }
        };
        self.deadline_ms = deadline_ms;
        // Its root stack arms the timer of the new deadline as it records it.
        out.push_back(Report::Deadline(Deadline {
            id: self.id,
            deadline_ms,
            data,
        }));
    }

    /// The timer of `deadline_ms` fired (its root stack keeps the timers).
    pub(crate) fn deadline_passed(&mut self, deadline_ms: u64, out: &mut Outbox) {
        // A later re-arm replaced this deadline: its own timer is running.
        if self.deadline_ms != Some(deadline_ms) || self.cut_off() {
            return;
        }
        if self.proc.is_some() {
            self.expire(out);
        } else {
            self.pending().timeout = true;
        }
    }

    pub(super) fn pending(&mut self) -> &mut Pending {
        self.pending.get_or_insert_with(Box::default)
    }

    /// Frees the box once nothing is pending.
    pub(super) fn tidy_pending(&mut self) {
        if self
            .pending
            .as_ref()
            .is_some_and(|p| p.aborts.is_empty() && !p.timeout && !p.pause_next)
        {
            self.pending = None;
        }
    }

    pub(super) fn finished_error(&self, state: ProcState) -> Error {
        Error::Finished { id: self.id, state }
    }

    /// Answers aborts and a timeout that arrived while a step or rollback ran.
    pub(super) fn settle_pending(&mut self, out: &mut Outbox) {
        let (timeout, aborts) = match self.pending.as_deref_mut() {
            Some(p) => (
                std::mem::take(&mut p.timeout),
                std::mem::take(&mut p.aborts),
            ),
            None => return,
        };
        self.tidy_pending();
        if self.cut_off() {
            for ack in aborts {
                let _ = ack.send(Err(Error::Stopped));
            }
            return;
        }
        if timeout {
            self.expire(out);
        }
        for ack in aborts {
            self.request_failure(Some(ack), out);
        }
    }

    /// An operator's abort: answers on `ack` whether the procedure accepted it, once
    /// the acceptance is durable.
    pub(crate) fn abort(&mut self, ack: AbortAck, out: &mut Outbox) {
        if self.cut_off() {
            let _ = ack.send(Err(Error::Stopped));
        } else if self.proc.is_none() {
            // In a call: answered when it ends; a step is asked to end early.
            if let Some(cancel) = &self.step_cancel {
                cancel.cancel();
            }
            self.pending().aborts.push(ack);
        } else {
            self.request_failure(Some(ack), out);
        }
    }

    /// The procedure is paused (whichever way: its next step, now while it waited, or
    /// its failure policy): a pause asked again meanwhile is answered, so it must not
    /// pause the step after a continue.
    pub(crate) fn forget_pause(&mut self) {
        if let Some(p) = &mut self.pending {
            p.pause_next = false;
        }
        self.tidy_pending();
    }

    /// An operator asked the procedure to pause: its next step is not run but reported
    /// as paused. With `now` (it waits for an event or a timer), a procedure between
    /// calls asks to be paused at once instead.
    pub(crate) fn pause(&mut self, now: bool, out: &mut Outbox) {
        // Not while its failure is being decided: until a retry's `Reset`, the
        // object (and `data`) is the failed attempt's, not the recorded state, and
        // the pause would record it. `went_on` asks again.
        if now && self.proc.is_some() && !self.cut_off() && !self.failed {
            let data = self.data.clone();
            out.push_back(Report::PauseNow(PauseNow { id: self.id, data }));
            return;
        }
        self.pending().pause_next = true;
    }

    /// The procedure's failed attempt is discarded (a failure policy retries or pauses
    /// it): reload its object from `data`, the state now recorded. Before anything can
    /// call it again.
    pub(crate) fn reset(&mut self, data: Vec<u8>, out: &mut Outbox) {
        // What its step returned was not taken: a `Done` the root stack refused (a
        // parent with children still running, a procedure at its most steps) failed
        // the step instead, so it is not done and its next step runs; what waited
        // meanwhile (a deadline) is settled as after any failure not taken.
        if std::mem::take(&mut self.done) {
            self.failed = true;
        }
        if self.cut_off() {
            return;
        }
        // If it does not decode, the object stays as the failed attempt left it.
        if let Some(proc) = self.decode_recorded(&data) {
            self.proc = Some(proc);
            self.data = data;
        }
        self.went_on(out);
    }

    /// Its tree failed. A step it is running is asked to end early (its cancellation
    /// signal is raised): whatever the step does will be rolled back, and the tree's
    /// rollback starts once every running step has returned. Aborts that waited for
    /// its failed step's fate are answered now (accepted: it is failing), not when its
    /// own rollback starts, which other rollbacks (paused, retried, waiting for locks)
    /// may hold back.
    pub(crate) fn tree_failed(&mut self, out: &mut Outbox) {
        if let Some(cancel) = &self.step_cancel {
            cancel.cancel();
        }
        if !std::mem::take(&mut self.deciding) {
            return;
        }
        let aborts = self
            .pending
            .as_mut()
            .map(|p| std::mem::take(&mut p.aborts))
            .unwrap_or_default();
        self.tidy_pending();
        for ack in aborts {
            self.request_failure(Some(ack), out);
        }
    }

    /// The failure the procedure asked for (a failed step, a timeout, an abort, a
    /// deadlock) was not taken: a policy retries or pauses it, or past the point of no
    /// return it is paused (each comes with a `Reset` to the recorded state, which
    /// calls this). It is not failed, so its next step runs; a deadline that passed,
    /// aborts and an operator's pause that came meanwhile are handled now.
    pub(super) fn went_on(&mut self, out: &mut Outbox) {
        self.deciding = false;
        if !std::mem::take(&mut self.failed) || self.proc.is_none() {
            return;
        }
        // A deadline that passed and aborts that came meanwhile.
        self.settle_pending(out);
        if self.pending.as_ref().is_some_and(|p| p.pause_next) {
            // An operator's pause that came meanwhile: now that it holds its recorded
            // state, at once if it waits (for its retry), else at its next step.
            self.pause(true, out);
        }
    }
}
