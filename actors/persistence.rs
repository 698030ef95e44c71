//! Group commit in front of the [`ProcedureStore`], owned by the scheduler actor.
//!
//! Appends that arrive while a batch is being written wait in `pending` and go out
//! together as the next batch: one `append` (one write and one sync, for the WAL) per
//! batch, however many procedures stepped meanwhile. The store itself lives on a
//! dedicated writer thread, so a slow disk never blocks an actor thread. Every waiter is
//! answered only after its batch is durable, in the order the appends arrived.
//!
//! It is not an actor of its own: the scheduler holds it, so a root stack's append and
//! the end of the step that caused it travel as one message (`Persist` with its
//! `finished` step), and the scheduler's mailbox orders appends and scheduling alike.
//! The scheduler polls each batch's completion as one of its futures and hands it back
//! ([`Persistence::done`]).
//!
//! After a failed append it fails every later append: the state of the storage is
//! unknown, and acknowledging anything more could lose an acknowledged step.

use std::sync::mpsc;
use std::thread;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::error::Error;
use crate::procedure::ProcId;
use crate::record::StoreOp;
use crate::store::{ProcedureStore, StoreError};

use super::metrics;
use super::perturb;
use super::protocol::DurableAck;
use super::shard::Mail;

struct Batch {
    ops: Vec<StoreOp>,
    /// The result, and the batch's `Vec` emptied, for the next batch to reuse.
    done: oneshot::Sender<BatchResult>,
}

/// What the writer thread is handed, in order.
enum Write {
    Batch(Batch),
    /// The last write of a drained shutdown (after every batch handed over before it):
    /// [`ProcedureStore::mark_drained`].
    Drained(Vec<ProcId>),
}

/// What the writer thread answers for a batch: the append's result and the batch's
/// emptied buffer.
pub(crate) type BatchResult = (Result<(), StoreError>, Vec<StoreOp>);

/// A batch handed to the writer thread: its answer, and whom to tell.
pub(crate) struct InFlight {
    pub(crate) answer: oneshot::Receiver<BatchResult>,
    pub(crate) acks: Vec<DurableAck>,
}

/// The largest batch buffers kept for reuse, in ops and acks.
const KEEP_CAPACITY: usize = 1 << 14;

pub(crate) struct Persistence {
    writer: Option<mpsc::Sender<Write>>,
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
        let (tx, rx) = mpsc::channel::<Write>();
        let thread = thread::Builder::new()
            .name("proctor-store-writer".into())
            .spawn(move || {
                let metrics = metrics::WalMetrics::new();
                // The store refuses every append after a failed one, and then a
                // drained mark would be a lie: it is written only after successes.
                let mut failed = false;
                while let Ok(write) = rx.recv() {
                    let batch = match write {
                        Write::Batch(batch) => batch,
                        Write::Drained(cut_off) => {
                            if !failed {
                                if let Err(e) = store.mark_drained(&cut_off) {
                                    tracing::warn!(%e, "cannot mark the store drained; the next start assumes steps were cut off");
                                }
                            }
                            continue;
                        }
                    };
                    perturb::point("persistence::writer::append");
                    let started = Instant::now();
                    let mut ops = batch.ops;
                    let records = ops.len();
                    let result = store.append_owned(&mut ops);
                    failed |= result.is_err();
                    metrics.append(started.elapsed(), records);
                    // The scheduler may be gone at shutdown; nothing is waiting then.
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

    /// Queues `ops` for the next batch, answered on `ack` once durable (at once, with
    /// the error, after a failure). Returns the batch to wait for if the writer was
    /// idle and took it.
    pub(crate) fn append(
        &mut self,
        ops: Vec<StoreOp>,
        ack: DurableAck,
        mail: &mut Mail,
    ) -> Option<InFlight> {
        if let Some(reason) = &self.failed {
            ack.send(Err(Error::Store(reason.clone())), mail);
            return None;
        }
        self.pending_ops.extend(ops);
        self.pending_acks.push(ack);
        if self.in_flight {
            return None;
        }
        self.flush(mail)
    }

    /// Hands what is pending to the writer thread as one batch.
    fn flush(&mut self, mail: &mut Mail) -> Option<InFlight> {
        if self.pending_acks.is_empty() {
            return None;
        }
        let ops = std::mem::replace(&mut self.pending_ops, std::mem::take(&mut self.spare_ops));
        let acks = std::mem::replace(&mut self.pending_acks, std::mem::take(&mut self.spare_acks));
        let (done, answer) = oneshot::channel();
        let sent = self
            .writer
            .as_ref()
            .is_some_and(|w| w.send(Write::Batch(Batch { ops, done })).is_ok());
        if !sent {
            self.fail(
                "the store writer thread has stopped".to_string(),
                acks,
                mail,
            );
            return None;
        }
        self.in_flight = true;
        Some(InFlight { answer, acks })
    }

    /// The writer thread answered the batch in flight (`Err`: it dropped the answer,
    /// having panicked). On success, returns the batch's acks for the caller to answer
    /// (then to hand back with [`Persistence::recycle`]); on a failure, answers them
    /// with the error and fails everything after.
    pub(crate) fn done(
        &mut self,
        answer: Result<BatchResult, oneshot::error::RecvError>,
        acks: Vec<DurableAck>,
        mail: &mut Mail,
    ) -> Option<Vec<DurableAck>> {
        self.in_flight = false;
        match answer {
            Ok((Ok(()), ops)) => {
                if ops.capacity() <= KEEP_CAPACITY {
                    self.spare_ops = ops;
                }
                Some(acks)
            }
            Ok((Err(e), _)) => {
                self.fail(e.to_string(), acks, mail);
                None
            }
            Err(_) => {
                self.fail("the store writer thread panicked".to_string(), acks, mail);
                None
            }
        }
    }

    /// Takes back an answered batch's emptied `Vec` of acks, for a later batch.
    pub(crate) fn recycle(&mut self, acks: Vec<DurableAck>) {
        debug_assert!(acks.is_empty());
        if acks.capacity() <= KEEP_CAPACITY {
            self.spare_acks = acks;
        }
    }

    /// Hands the writer what waited while a batch was in flight, if anything did.
    pub(crate) fn next_batch(&mut self, mail: &mut Mail) -> Option<InFlight> {
        if self.in_flight {
            return None;
        }
        self.flush(mail)
    }

    /// Refuses every append from now on (the engine broke an invariant).
    pub(crate) fn refuse(&mut self, reason: String, mail: &mut Mail) {
        if self.failed.is_none() {
            self.fail(reason, Vec::new(), mail);
        }
    }

    /// Closes the channel, which ends the writer thread once it has written what it
    /// has, and waits for it (dropping the store and releasing its lock).
    pub(crate) fn close_writer(&mut self) {
        self.writer = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// A shutdown, not a store failure: closes the writer and refuses what is still
    /// queued, quietly. `drained` (a drained shutdown's procedures possibly cut off by
    /// an earlier crash): the store is marked drained after the batches already handed
    /// over, unless an append failed.
    pub(crate) fn stop(&mut self, drained: Option<Vec<ProcId>>, mail: &mut Mail) {
        if let (Some(cut_off), None, Some(writer)) = (drained, &self.failed, &self.writer) {
            let _ = writer.send(Write::Drained(cut_off));
        }
        self.close_writer();
        self.failed = Some("the executor has shut down".to_string());
        self.pending_ops.clear();
        for ack in std::mem::take(&mut self.pending_acks) {
            ack.send(Err(Error::Stopped), mail);
        }
    }

    fn fail(&mut self, reason: String, acks: Vec<DurableAck>, mail: &mut Mail) {
        tracing::error!(%reason, "store failed; refusing further appends");
        self.failed = Some(reason.clone());
        let later = std::mem::take(&mut self.pending_acks);
        self.pending_ops.clear();
        for ack in acks.into_iter().chain(later) {
            ack.send(Err(Error::Store(reason.clone())), mail);
        }
    }
}
