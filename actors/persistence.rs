//! The persistence actor: the one door to the [`ProcedureStore`], with group commit.
//!
//! Appends that arrive while a batch is being written wait in `pending` and go out
//! together as the next batch: one `append` (one write and one sync, for the WAL) per
//! batch, however many procedures stepped meanwhile. The store itself lives on a
//! dedicated writer thread, so a slow disk never blocks an actor thread. Every waiter is
//! answered only after its batch is durable, in the order the appends arrived.
//!
//! After a failed append the actor fails every later append: the state of the storage
//! is unknown, and acknowledging anything more could lose an acknowledged step.

use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::record::StoreOp;
use crate::store::{ProcedureStore, StoreError};

use super::metrics;
use super::perturb;
use super::protocol::{DurableAck, Persist, Refuse, StopWriter};

struct Batch {
    ops: Vec<StoreOp>,
    /// The result, and the batch's `Vec` emptied, for the next batch to reuse.
    done: oneshot::Sender<(Result<(), StoreError>, Vec<StoreOp>)>,
}

/// The largest batch buffers kept for reuse, in ops and acks.
const KEEP_CAPACITY: usize = 1 << 14;

pub(crate) struct Persistence {
    writer: Option<mpsc::Sender<Batch>>,
    thread: Option<thread::JoinHandle<()>>,
    pending_ops: Vec<StoreOp>,
    pending_acks: Vec<DurableAck>,
    /// Emptied buffers of the last batch written: a batch reuses them rather than
    /// growing new ones op by op (an op is a whole record, about 300 bytes).
    spare_ops: Vec<StoreOp>,
    spare_acks: Vec<DurableAck>,
    in_flight: bool,
    failed: Option<String>,
}

impl Persistence {
    /// Moves the store onto its writer thread.
    pub(crate) fn new(mut store: Box<dyn ProcedureStore>) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Batch>();
        let thread = thread::Builder::new()
            .name("proctor-store-writer".into())
            .spawn(move || {
                let metrics = metrics::WalMetrics::new();
                while let Ok(batch) = rx.recv() {
                    perturb::point("persistence::writer::append");
                    let started = Instant::now();
                    let mut ops = batch.ops;
                    let records = ops.len();
                    let result = store.append_owned(&mut ops);
                    metrics.append(started.elapsed(), records);
                    // The actor may be gone at shutdown; nothing is waiting then.
                    let _ = batch.done.send((result, ops));
                }
            })?;
        Ok(Persistence {
            writer: Some(tx),
            thread: Some(thread),
            pending_ops: Vec::new(),
            pending_acks: Vec::new(),
            spare_ops: Vec::new(),
            spare_acks: Vec::new(),
            in_flight: false,
            failed: None,
        })
    }

    fn enqueue(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        if let Some(reason) = &self.failed {
            msg.ack.send(Err(Error::Store(reason.clone())));
            return;
        }
        self.pending_ops.extend(msg.ops);
        self.pending_acks.push(msg.ack);
        if !self.in_flight {
            self.flush(ctx);
        }
    }

    fn flush(&mut self, ctx: &mut Context<Self>) {
        if self.pending_acks.is_empty() {
            return;
        }
        let ops = std::mem::replace(&mut self.pending_ops, std::mem::take(&mut self.spare_ops));
        let acks = std::mem::replace(&mut self.pending_acks, std::mem::take(&mut self.spare_acks));
        let (done, done_rx) = oneshot::channel();
        let sent = self
            .writer
            .as_ref()
            .is_some_and(|w| w.send(Batch { ops, done }).is_ok());
        if !sent {
            self.fail("the store writer thread has stopped".to_string(), acks);
            return;
        }
        self.in_flight = true;
        ctx.spawn(done_rx.into_actor(self).map(move |result, act, ctx| {
            act.in_flight = false;
            match result {
                Ok((Ok(()), ops)) => {
                    let mut acks = acks;
                    for ack in acks.drain(..) {
                        ack.send(Ok(()));
                    }
                    if ops.capacity() <= KEEP_CAPACITY && acks.capacity() <= KEEP_CAPACITY {
                        act.spare_ops = ops;
                        act.spare_acks = acks;
                    }
                    act.flush(ctx);
                }
                Ok((Err(e), _)) => act.fail(e.to_string(), acks),
                Err(_) => act.fail("the store writer thread panicked".to_string(), acks),
            }
        }));
    }

    /// Closes the channel, which ends the writer thread once it has written what it
    /// has, and waits for it (dropping the store and releasing its lock).
    fn close_writer(&mut self) {
        self.writer = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    fn fail(&mut self, reason: String, acks: Vec<DurableAck>) {
        tracing::error!(%reason, "store failed; refusing further appends");
        self.failed = Some(reason.clone());
        let later = std::mem::take(&mut self.pending_acks);
        self.pending_ops.clear();
        for ack in acks.into_iter().chain(later) {
            ack.send(Err(Error::Store(reason.clone())));
        }
    }
}

impl Actor for Persistence {
    type Context = Context<Self>;

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.close_writer();
    }
}

impl Handler<Persist> for Persistence {
    type Result = ();

    fn handle(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        self.enqueue(msg, ctx);
    }
}

impl Handler<Refuse> for Persistence {
    type Result = ();

    fn handle(&mut self, msg: Refuse, _ctx: &mut Context<Self>) {
        if self.failed.is_none() {
            self.fail(msg.0, Vec::new());
        }
    }
}

impl Handler<StopWriter> for Persistence {
    type Result = ();

    fn handle(&mut self, _msg: StopWriter, ctx: &mut Context<Self>) {
        self.close_writer();
        // A shutdown, not a store failure: refuse what is still queued, quietly.
        self.failed = Some("the executor has shut down".to_string());
        self.pending_ops.clear();
        for ack in std::mem::take(&mut self.pending_acks) {
            ack.send(Err(Error::Stopped));
        }
        ctx.stop();
    }
}
