//! The persistence actor: group commit in front of the [`ProcedureStore`], one for the
//! whole executor.
//!
//! Appends (`Persist`, from every shard's root stacks, one batch per shard and turn)
//! that arrive while a batch is being written wait in `pending` and go out together as
//! the next batch: one `append` (one write and one sync, for the WAL) per batch, however
//! many procedures of however many shards stepped meanwhile. The store itself lives on
//! a dedicated writer thread, so a slow disk never blocks an actor thread; the actor
//! polls each batch's answer as one of its futures. Every waiter is answered only after
//! its batch is durable, in the order the appends arrived: a root stack with a
//! `Durable` message naming its transition, gathered per shard ([`Mail`]) and sent as
//! one message per shard when the batch is answered.
//!
//! After a failed append it fails every later append: the state of the storage is
//! unknown, and acknowledging anything more could lose an acknowledged step.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::error::Error;
use crate::procedure::ProcId;
use crate::record::StoreOp;
use crate::store::{ProcedureStore, StoreError, StoreStatus};

use super::metrics;
use super::perturb;

use super::protocol::{Durable, TreeAddr};
use super::shard::Mail;

/// The group commit as the store's writer saw it since the engine started
/// ([`EngineStatus::commits`](crate::EngineStatus)): how many batches, how large.
///
/// ```
/// let stats = proctor::CommitStats::default();
/// assert_eq!(stats.mean_records(), 0.0);
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommitStats {
    /// Appends to the store: one per batch.
    pub batches: u64,
    /// Records (procedure writes) in them.
    pub records: u64,
    /// The most records one batch held.
    pub largest: usize,
    /// Batches by their records, in powers of two: index `i` counts the batches of
    /// `2^i` to `2^(i+1) − 1` records (`[1]`, `[2, 3]`, `[4, 7]`, …).
    pub by_size: Vec<u64>,
    /// Time spent in appends (for the WAL: its writes and syncs).
    pub append_time: Duration,
}

impl CommitStats {
    /// Records per batch, on average.
    pub fn mean_records(&self) -> f64 {
        if self.batches == 0 {
            0.0
        } else {
            self.records as f64 / self.batches as f64
        }
    }

    fn add(&mut self, records: usize, took: Duration) {
        self.batches += 1;
        self.records += records as u64;
        self.largest = self.largest.max(records);
        let bucket = records.max(1).ilog2() as usize;
        if self.by_size.len() <= bucket {
            self.by_size.resize(bucket + 1, 0);
        }
        self.by_size[bucket] += 1;
        self.append_time += took;
    }
}

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
    /// An operator's question, answered between batches: the store's status and the
    /// group commit's figures.
    Status(oneshot::Sender<(StoreStatus, CommitStats)>),
}

/// What the writer thread answers for a batch: the append's result and the batch's
/// emptied buffer.
type BatchResult = (Result<(), StoreError>, Vec<StoreOp>);

/// A batch handed to the writer thread: its answer, and whom to tell.
struct InFlight {
    answer: oneshot::Receiver<BatchResult>,
    acks: Vec<DurableAck>,
}

/// The largest batch buffers kept for reuse, in ops and acks.
const KEEP_CAPACITY: usize = 1 << 14;

/// The store's side of the group commit: what the writer thread runs, a batch at a
/// time, in the order the actor handed them over.
struct Writer {
    store: Box<dyn ProcedureStore>,
    metrics: metrics::WalMetrics,
    commits: CommitStats,
    /// The store refuses every append after a failed one, and then a drained mark
    /// would be a lie: it is written only after successes.
    failed: bool,
}

impl Writer {
    fn new(store: Box<dyn ProcedureStore>) -> Writer {
        Writer {
            store,
            metrics: metrics::WalMetrics::new(),
            commits: CommitStats::default(),
            failed: false,
        }
    }

    fn write(&mut self, write: Write) {
        let batch = match write {
            Write::Batch(batch) => batch,
            Write::Drained(cut_off) => {
                if !self.failed {
                    if let Err(e) = self.store.mark_drained(&cut_off) {
                        tracing::warn!(target: crate::targets::STORE, %e, "cannot mark the store drained; the next start assumes steps were cut off");
                    }
                }
                return;
            }
            Write::Status(answer) => {
                let _ = answer.send((self.store.status(), self.commits.clone()));
                return;
            }
        };
        perturb::point("persistence::writer::append");
        let started = Instant::now();
        let mut ops = batch.ops;
        let records = ops.len();
        let result = self.store.append_owned(&mut ops);
        self.failed |= result.is_err();
        let took = started.elapsed();
        self.metrics.append(took, records);
        self.commits.add(records, took);
        // The scheduler may be gone at shutdown; nothing is waiting then.
        let _ = batch.done.send((result, ops));
    }
}

#[cfg(feature = "simulation")]
impl Writer {
    /// The writer as a task of the simulation's one thread: each write waits for the
    /// simulated disk's latency first. Under the `DurableBeforeWrite` mutation a batch
    /// is answered as durable before that wait, and a crash during it loses the batch.
    fn simulate(mut self, mut rx: tokio::sync::mpsc::UnboundedReceiver<Write>) {
        use crate::mutation::{on, Mutation};
        tokio::task::spawn_local(async move {
            while let Some(mut write) = rx.recv().await {
                if let (Write::Batch(batch), true) = (&mut write, on(Mutation::DurableBeforeWrite))
                {
                    let (early, _) = oneshot::channel();
                    let done = std::mem::replace(&mut batch.done, early);
                    let _ = done.send((Ok(()), Vec::new()));
                }
                tokio::time::sleep(super::simulation::disk_latency()).await;
                self.write(write);
            }
        });
    }
}

/// Where the actor hands its writes: the writer thread, or under a simulation the
/// simulated disk's task on the actors' own thread.
enum WriterTx {
    Thread(mpsc::Sender<Write>),
    #[cfg(feature = "simulation")]
    Simulated(tokio::sync::mpsc::UnboundedSender<Write>),
}

impl WriterTx {
    /// Hands `write` over; `false` if the writer has stopped.
    fn send(&self, write: Write) -> bool {
        match self {
            WriterTx::Thread(tx) => tx.send(write).is_ok(),
            #[cfg(feature = "simulation")]
            WriterTx::Simulated(tx) => tx.send(write).is_ok(),
        }
    }
}

/// The group commit: what is pending, the batch in flight, and the writer thread.
struct Persistence {
    writer: Option<WriterTx>,
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
    /// Moves the store onto its writer thread (under a simulation, onto a task of the
    /// current thread that writes each batch after the simulated disk's latency).
    fn new(store: Box<dyn ProcedureStore>) -> std::io::Result<Self> {
        #[cfg(feature = "simulation")]
        if super::simulation::active() {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            Writer::new(store).simulate(rx);
            return Ok(Persistence::with_writer(WriterTx::Simulated(tx), None));
        }
        let (tx, rx) = mpsc::channel::<Write>();
        let thread = thread::Builder::new()
            .name("proctor-store-writer".into())
            .spawn(move || {
                let mut writer = Writer::new(store);
                while let Ok(write) = rx.recv() {
                    writer.write(write);
                }
            })?;
        Ok(Persistence::with_writer(WriterTx::Thread(tx), Some(thread)))
    }

    fn with_writer(writer: WriterTx, thread: Option<thread::JoinHandle<()>>) -> Persistence {
        Persistence {
            writer: Some(writer),
            thread,
            pending_ops: Vec::new(),
            pending_acks: Vec::new(),
            spare_ops: Vec::new(),
            spare_acks: Vec::new(),
            in_flight: false,
            failed: None,
        }
    }

    /// Queues `ops` for the next batch, answered on `ack` once durable (at once, with
    /// the error, after a failure). Returns the batch to wait for if the writer was
    /// idle and took it.
    fn append(&mut self, ops: Vec<StoreOp>, ack: DurableAck, mail: &mut Mail) -> Option<InFlight> {
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
            .is_some_and(|w| w.send(Write::Batch(Batch { ops, done })));
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
    fn done(
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
    fn recycle(&mut self, acks: Vec<DurableAck>) {
        debug_assert!(acks.is_empty());
        if acks.capacity() <= KEEP_CAPACITY {
            self.spare_acks = acks;
        }
    }

    /// Hands the writer what waited while a batch was in flight, if anything did.
    fn next_batch(&mut self, mail: &mut Mail) -> Option<InFlight> {
        if self.in_flight {
            return None;
        }
        self.flush(mail)
    }

    /// Refuses every append from now on (the engine broke an invariant).
    fn refuse(&mut self, reason: String, mail: &mut Mail) {
        if self.failed.is_none() {
            self.fail(reason, Vec::new(), mail);
        }
    }

    /// Closes the channel, which ends the writer thread once it has written what it
    /// has, and waits for it (dropping the store and releasing its lock).
    fn close_writer(&mut self) {
        self.writer = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }

    /// A shutdown, not a store failure: closes the writer and refuses what is still
    /// queued, quietly. `drained` (a drained shutdown's procedures possibly cut off by
    /// an earlier crash): the store is marked drained after the batches already handed
    /// over, unless an append failed.
    fn stop(&mut self, drained: Option<Vec<ProcId>>, mail: &mut Mail) {
        if let (Some(cut_off), None, Some(writer)) = (drained, &self.failed, &self.writer) {
            writer.send(Write::Drained(cut_off));
        }
        self.close_writer();
        self.failed = Some("the executor has shut down".to_string());
        self.pending_ops.clear();
        for ack in std::mem::take(&mut self.pending_acks) {
            ack.send(Err(Error::Stopped), mail);
        }
    }

    fn fail(&mut self, reason: String, acks: Vec<DurableAck>, mail: &mut Mail) {
        tracing::error!(target: crate::targets::STORE, %reason, "store failed; refusing further appends");
        self.failed = Some(reason.clone());
        let later = std::mem::take(&mut self.pending_acks);
        self.pending_ops.clear();
        for ack in acks.into_iter().chain(later) {
            ack.send(Err(Error::Store(reason.clone())), mail);
        }
    }
}

/// The persistence actor (see the module docs).
pub(crate) struct PersistenceActor {
    persistence: Persistence,
    /// Answers for the root stacks, one message per shard: sent when a batch is
    /// answered, and at the end of any handler that answered something.
    mail: Mail,
}

impl PersistenceActor {
    /// Moves the store onto its writer thread.
    pub(crate) fn new(store: Box<dyn ProcedureStore>) -> std::io::Result<Self> {
        Ok(PersistenceActor {
            persistence: Persistence::new(store)?,
            mail: Mail::default(),
        })
    }

    fn persist(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        let batch = self.persistence.append(msg.ops, msg.ack, &mut self.mail);
        self.wait_for(batch, ctx);
    }

    /// Waits for a batch handed to the writer thread; when it is answered, answers its
    /// appends and hands the writer the next batch.
    fn wait_for(&mut self, batch: Option<InFlight>, ctx: &mut Context<Self>) {
        let Some(InFlight { answer, acks }) = batch else {
            return;
        };
        ctx.spawn(answer.into_actor(self).map(move |answer, act, ctx| {
            act.batch_done(answer, acks, ctx);
        }));
    }

    /// A batch is durable (or failed): answers each append in order, hands the writer
    /// the next batch, and sends the answers, one message per shard.
    fn batch_done(
        &mut self,
        answer: Result<BatchResult, oneshot::error::RecvError>,
        acks: Vec<DurableAck>,
        ctx: &mut Context<Self>,
    ) {
        if let Some(mut acks) = self.persistence.done(answer, acks, &mut self.mail) {
            for ack in acks.drain(..) {
                ack.send(Ok(()), &mut self.mail);
            }
            self.persistence.recycle(acks);
        }
        let next = self.persistence.next_batch(&mut self.mail);
        self.wait_for(next, ctx);
        self.mail.send();
    }
}

impl Actor for PersistenceActor {
    type Context = Context<Self>;

    fn stopped(&mut self, _ctx: &mut Context<Self>) {
        self.persistence.close_writer();
    }
}

impl Handler<Persist> for PersistenceActor {
    type Result = ();

    fn handle(&mut self, msg: Persist, ctx: &mut Context<Self>) {
        self.persist(msg, ctx);
        self.mail.send();
    }
}

impl Handler<ToPersistence> for PersistenceActor {
    type Result = ();

    fn handle(&mut self, msg: ToPersistence, ctx: &mut Context<Self>) {
        for msg in msg.0 {
            self.persist(msg, ctx);
        }
        self.mail.send();
    }
}

impl Handler<Refuse> for PersistenceActor {
    type Result = ();

    fn handle(&mut self, msg: Refuse, _ctx: &mut Context<Self>) {
        self.persistence.refuse(msg.0, &mut self.mail);
        self.mail.send();
    }
}

impl Handler<GetStoreStatus> for PersistenceActor {
    type Result = ResponseFuture<Result<(StoreStatus, CommitStats), Error>>;

    fn handle(&mut self, _msg: GetStoreStatus, _ctx: &mut Context<Self>) -> Self::Result {
        let (tx, answer) = oneshot::channel();
        let sent = self
            .persistence
            .writer
            .as_ref()
            .is_some_and(|w| w.send(Write::Status(tx)));
        Box::pin(async move {
            if !sent {
                return Err(Error::Stopped);
            }
            answer.await.map_err(|_| Error::Stopped)
        })
    }
}

impl Handler<StopWriter> for PersistenceActor {
    type Result = ();

    fn handle(&mut self, msg: StopWriter, ctx: &mut Context<Self>) {
        self.persistence.stop(msg.drained, &mut self.mail);
        self.mail.send();
        ctx.stop();
    }
}

// ------------------------------------------------------------------------------------
// The messages this actor receives (ordering rules: `ARCHITECTURE.md`, "Protocol").
// ------------------------------------------------------------------------------------

/// The store's status and the group commit's figures, for operators (asked by the
/// executor; answered by the writer thread between batches).
pub(crate) struct GetStoreStatus;

impl Message for GetStoreStatus {
    type Result = Result<(StoreStatus, CommitStats), Error>;
}

/// Makes `ops` durable, then answers on `ack`. If the persistence actor is gone, `ack`
/// is dropped and that is an answer too (`Error::Stopped`), so nothing waits for ever.
pub(crate) struct Persist {
    pub(crate) ops: Vec<StoreOp>,
    pub(crate) ack: DurableAck,
}

/// Who is told that a `Persist` is durable (or failed).
pub(crate) enum DurableAck {
    /// A caller waiting on a channel (the executor's result cleaner).
    Caller(oneshot::Sender<Result<(), Error>>),
    /// A root stack, told with a `Durable` message naming its transition: no channel
    /// and no future per transition.
    Tree(TreeAck),
}

impl DurableAck {
    /// Answers: a caller at once, a root stack through `mail` (the persistence actor's,
    /// one message per shard).
    pub(crate) fn send(self, result: Result<(), Error>, mail: &mut Mail) {
        match self {
            DurableAck::Caller(tx) => {
                let _ = tx.send(result);
            }
            DurableAck::Tree(ack) => ack.answer(result, mail),
        }
    }
}

/// A root stack's transition number `seq`, to acknowledge once. Dropped unanswered (the
/// persistence actor gone), it answers `Error::Stopped`, as a dropped channel did.
pub(crate) struct TreeAck {
    tree: TreeAddr,
    seq: usize,
    answered: bool,
}

impl TreeAck {
    pub(crate) fn new(tree: TreeAddr, seq: usize) -> Self {
        TreeAck {
            tree,
            seq,
            answered: false,
        }
    }

    /// Answers through `mail`.
    fn answer(mut self, result: Result<(), Error>, mail: &mut Mail) {
        self.answered = true;
        mail.push(&self.tree, self.message(result));
    }

    fn message(&self, result: Result<(), Error>) -> Durable {
        Durable {
            seq: self.seq,
            result,
        }
    }
}

impl Drop for TreeAck {
    /// Unanswered, the persistence actor is gone (and its mail with it): told directly.
    fn drop(&mut self) {
        if !self.answered {
            self.tree.do_send(self.message(Err(Error::Stopped)));
        }
    }
}

impl Message for Persist {
    type Result = ();
}

/// Refuse every append from now on (the engine broke an invariant and is stopping).
pub(crate) struct Refuse(pub(crate) String);

impl Message for Refuse {
    type Result = ();
}

/// Stops the persistence actor once everything handed to the writer thread is written
/// (the last message it gets, after every root stack's thread has ended); answers after the
/// thread (and with it the store, and its lock) is gone. `drained`: the shutdown
/// drained (no step was cut off), and the store is marked so after its last append,
/// naming the procedures an earlier crash may still have cut off.
pub(crate) struct StopWriter {
    pub(crate) drained: Option<Vec<ProcId>>,
}

impl Message for StopWriter {
    type Result = ();
}

/// A shard's appends, for the persistence actor, in the order its trees made them.
pub(crate) struct ToPersistence(pub(crate) Vec<Persist>);

impl Message for ToPersistence {
    type Result = ();
}
