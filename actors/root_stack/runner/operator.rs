//! A tree's operator requests (abort, bypass, pause, continue, rollback) and a graceful
//! shutdown's `Quiesce`, as the runner handles them.

use super::*;

use crate::root_stack::BypassReach;

impl TreeRunner {
    pub(super) fn on_bypass(&mut self, msg: BypassRequest, ctx: &mut TreeCtx<'_>) {
        if let Some(e) = &self.halted {
            ctx.answer(msg.ack, Err(e.duplicate()));
            return;
        }
        let (id, recursive) = (msg.id, msg.recursive);
        let reach = if msg.force {
            BypassReach::Forced
        } else {
            BypassReach::Waiting
        };
        // Each bypassed procedure's final record keeps its state as recorded (a copy
        // of the tree's: an operator's command is rare).
        let recorded: Vec<(ProcId, Vec<u8>)> = self
            .procs
            .iter()
            .map(|(&p, slot)| (p, slot.recorded().to_vec()))
            .collect();
        let data_of = |p: ProcId| {
            recorded
                .iter()
                .find(|(q, _)| *q == p)
                .map(|(_, data)| data.clone())
                .unwrap_or_default()
        };
        match self.core(
            "bypass",
            |core| core.on_bypass(id, recursive, reach, &data_of, now_ms()),
            ctx,
        ) {
            Some(Ok(t)) => self.apply(t, Some((msg.ack, Ok(true))), ctx),
            Some(Err(reason)) => {
                ctx.answer(msg.ack, Err(Error::BypassRefused { id, reason }));
            }
            None => {
                ctx.answer(msg.ack, Err(self.halted_error()));
            }
        }
    }
}

impl TreeRunner {
    pub(super) fn on_quiesce(&mut self, msg: Quiesce, ctx: &mut TreeCtx<'_>) {
        if self.halted.is_some() {
            ctx.leave(Leave::Quiesced(msg.0, None));
        } else {
            self.rare().quiesce.push(msg.0);
            self.answer_quiesce(ctx);
        }
    }
}

impl TreeRunner {
    pub(super) fn on_command(&mut self, msg: CommandRequest, ctx: &mut TreeCtx<'_>) {
        if let Some(e) = &self.halted {
            ctx.answer(msg.ack, Err(e.duplicate()));
            return;
        }
        let (id, command) = (msg.id, msg.command);
        if command == Command::Pause {
            let refused = self.core.pause_refusal(id);
            match (refused, self.procs.contains_key(&id)) {
                (None, true) => {
                    let now = self.core.waits_for_wake(id);
                    let _ = self.send(id, ProcMsg::Pause { now }, ctx);
                    self.rare()
                        .pause_waiters
                        .entry(id)
                        .or_default()
                        .push(msg.ack);
                }
                (refused, _) => {
                    let reason = refused.unwrap_or_else(|| format!("procedure {id} has finished"));
                    ctx.leave(refusal(msg.ack, command.name(), id, reason));
                }
            }
            return;
        }
        let paused = self.core.state_of(id) == Some(ProcState::Paused);
        if command == Command::Rollback && !paused {
            // Not paused: a rollback is an abort (its hook decides, a running step is
            // cancelled), refused where an operator's rollback is.
            if let Some(reason) = self.core.rollback_refusal(id) {
                ctx.leave(refusal(msg.ack, command.name(), id, reason));
                return;
            }
            self.on_abort(AbortRequest { id, ack: msg.ack }, ctx);
            return;
        }
        let now = now_ms();
        let changed = self.core(
            command.name(),
            |core| match command {
                Command::Continue => core.on_continue(id, now),
                Command::Rollback | Command::Pause => core.on_operator_rollback(id, now),
            },
            ctx,
        );
        match changed {
            Some(Ok(t)) => {
                tracing::info!(target: crate::targets::TREE, proc = %id, command = command.name(), "operator command");
                self.apply(t, Some((msg.ack, Ok(true))), ctx);
            }
            Some(Err(reason)) => {
                ctx.leave(refusal(msg.ack, command.name(), id, reason));
            }
            None => {
                ctx.answer(msg.ack, Err(self.halted_error()));
            }
        }
    }
}

impl TreeRunner {
    pub(super) fn on_abort(&mut self, msg: AbortRequest, ctx: &mut TreeCtx<'_>) {
        if let Some(e) = &self.halted {
            ctx.answer(msg.ack, Err(e.duplicate()));
            return;
        }
        if self.core.is_irreversible() && !self.core.is_failed() {
            let reason = format!(
                "tree {} has passed its point of no return: continue instead",
                self.core.root()
            );
            ctx.leave(refusal(msg.ack, "abort", msg.id, reason));
            return;
        }
        let id = msg.id;
        // Finished (its stop is on its way): nothing left to abort.
        if let Err(ProcMsg::Abort(ack)) = self.send(id, ProcMsg::Abort(msg.ack), ctx) {
            let state = self.core.state_of(id).unwrap_or(ProcState::Success);
            ctx.answer(ack, Err(Error::Finished { id, state }));
        }
    }
}

impl TreeRunner {
    /// What an operator request that the core could not take is answered with: the
    /// error that halted the tree, or `Stopped`.
    fn halted_error(&self) -> Error {
        self.halted
            .as_ref()
            .map_or(Error::Stopped, |e| e.duplicate())
    }
}

/// The answer to an operator's command that is refused.
pub(super) fn refusal(
    ack: AbortAck,
    command: &'static str,
    id: ProcId,
    reason: impl Into<String>,
) -> Leave {
    Leave::Answered(
        ack,
        Err(Error::Refused {
            command,
            id,
            reason: reason.into(),
        }),
    )
}
