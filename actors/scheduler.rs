//! The scheduler actor: its mailbox decides what runs next.
//!
//! It owns the [`ReadyQueue`] (FIFO, a front for procedures that continue, at most
//! `workers` steps at once) and the table of events procedures are suspended on. A
//! procedure waiting for children, an event or a deadline is not in the queue and holds
//! no worker. Every enqueue comes from a root stack, after the step that caused it is
//! durable; the scheduler itself never changes a procedure's state.

use std::collections::HashMap;

use actix::prelude::*;

use crate::procedure::ProcId;
use crate::ready_queue::ReadyQueue;

use super::perturb;
use super::procedure::ProcedureActor;
use super::protocol::{Enqueue, RunStep, StepFinished, SuspendOn, Wake};
use super::root_stack::RootStackActor;

/// Wakes every procedure suspended on the named event, and every procedure that
/// suspends on it later. Send it to the executor.
///
/// ```no_run
/// # async fn f(executor: proctor::Executor) -> Result<(), proctor::Error> {
/// executor.wake_event("region-17-online").await?;
/// # Ok(()) }
/// ```
pub struct WakeEvent(pub String);

impl Message for WakeEvent {
    type Result = ();
}

#[derive(Default)]
struct EventState {
    woken: bool,
    waiters: Vec<(ProcId, Addr<RootStackActor>)>,
}

pub(crate) struct Scheduler {
    ready: ReadyQueue<(ProcId, Addr<ProcedureActor>)>,
    events: HashMap<String, EventState>,
}

impl Scheduler {
    pub(crate) fn new(workers: usize) -> Self {
        Scheduler {
            ready: ReadyQueue::new(workers),
            events: HashMap::new(),
        }
    }

    fn dispatch(&mut self) {
        while let Some((id, addr)) = self.ready.pop() {
            // A procedure's actor stops only after its tree has finished, and a finished
            // tree queues nothing; a stopped one here would leak the worker, so free it.
            if addr.connected() {
                tracing::trace!(proc = %id, "dispatch");
                perturb::point("scheduler::dispatch::run_step");
                addr.do_send(RunStep);
            } else {
                tracing::warn!(proc = %id, "queued procedure has no actor");
                self.ready.complete();
            }
        }
    }
}

impl Actor for Scheduler {
    type Context = Context<Self>;
}

impl Handler<Enqueue> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: Enqueue, _ctx: &mut Context<Self>) {
        self.ready.push((msg.id, msg.addr), msg.front);
        self.dispatch();
    }
}

impl Handler<StepFinished> for Scheduler {
    type Result = ();

    fn handle(&mut self, _msg: StepFinished, _ctx: &mut Context<Self>) {
        self.ready.complete();
        self.dispatch();
    }
}

impl Handler<SuspendOn> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: SuspendOn, _ctx: &mut Context<Self>) {
        let event = self.events.entry(msg.event).or_default();
        if event.woken {
            msg.root_stack.do_send(Wake(msg.id));
        } else {
            event.waiters.push((msg.id, msg.root_stack));
        }
    }
}

impl Handler<WakeEvent> for Scheduler {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        let event = self.events.entry(msg.0).or_default();
        event.woken = true;
        for (id, root_stack) in event.waiters.drain(..) {
            root_stack.do_send(Wake(id));
        }
    }
}
