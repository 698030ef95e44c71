//! The executor's shutdown: a graceful one drains the calls in flight, then the
//! records, then stops; an immediate one (or a drain past its deadline) stops the
//! arbiters, joins their threads and closes the store writer, so nothing of the engine
//! runs once `Executor::shutdown` returns.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::actors::locks::StopLocks;
use crate::actors::protocol::{Quiesce, StopWriter};
use crate::actors::shared::Shared;
use crate::error::Error;
use crate::procedure::ProcId;

use super::actor::ExecutorActor;
use super::api::Shutdown;

/// How long a graceful shutdown waits, past its drain deadline, for the calls it
/// cancelled to return.
const CANCEL_GRACE: Duration = Duration::from_secs(1);

impl<E: Send + Sync + 'static> Handler<Shutdown> for ExecutorActor<E> {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, msg: Shutdown, _ctx: &mut Context<Self>) -> Self::Result {
        if !msg.graceful || self.stopping || self.broken.is_some() {
            self.stopping = true;
            return Box::pin(self.stop_now(None));
        }
        self.stopping = true;
        tracing::info!(target: crate::targets::EXECUTOR,
            timeout_ms = self.drain_timeout.as_millis() as u64,
            "draining"
        );
        let shared = self.shared.clone();
        let deadline = tokio::time::Instant::now() + self.drain_timeout;
        Box::pin(
            graceful_drain(shared, deadline)
                .into_actor(self)
                .then(|drained, act: &mut Self, _ctx| act.stop_now(drained)),
        )
    }
}

/// A graceful shutdown's drain: waits until `deadline` for the running calls to end
/// (past it, cancels them and waits [`CANCEL_GRACE`] more), then for every tree to make
/// its records durable. If all of it ended in time and no step was cut off, the
/// procedures the trees say an earlier crash may still have cut off (see [`Quiesce`]).
async fn graceful_drain(
    shared: Arc<Shared>,
    mut deadline: tokio::time::Instant,
) -> Option<Vec<ProcId>> {
    // Whether a step was cut off (cancelled, or not made durable in time).
    let mut cut = false;
    if tokio::time::timeout_at(deadline, shared.drain.drain())
        .await
        .is_err()
    {
        // Ask the running calls to stop (`CancelReason::Shutdown`), and give
        // those that watch the signal a moment to return.
        tracing::warn!(target: crate::targets::EXECUTOR, "drain deadline passed with steps still running: cancelling them");
        shared.shutdown.cancel();
        deadline = tokio::time::Instant::now() + CANCEL_GRACE;
        if tokio::time::timeout_at(deadline, shared.drain.drain())
            .await
            .is_err()
        {
            tracing::warn!(target: crate::targets::EXECUTOR, "steps still running after their cancellation: stopping now");
            return None;
        }
        // A cancelled step that returned reported a yield: it ran, unrecorded.
        cut = true;
    }
    // Every report is sent; wait until each tree has made its records durable.
    let Ok(cut_off) = tokio::time::timeout_at(deadline, quiesced(&shared)).await else {
        tracing::warn!(target: crate::targets::EXECUTOR, "drain deadline passed with records not yet durable: stopping now");
        return None;
    };
    cut_off.filter(|_| !cut)
}

/// Asks every tree to make its records durable (`Quiesce`, sent now); the future ends
/// once each has answered, with what they answered together (`None` if one halted).
fn quiesced(shared: &Shared) -> impl Future<Output = Option<Vec<ProcId>>> {
    let trees: Vec<_> = shared
        .table
        .iter()
        .filter(|e| e.parent.is_none())
        .filter_map(|e| e.tree.clone())
        .collect();
    let answers: Vec<_> = trees
        .into_iter()
        .map(|tree| {
            let (tx, rx) = oneshot::channel();
            tree.do_send(Quiesce(tx));
            rx
        })
        .collect();
    async move {
        let mut cut_off = Vec::new();
        for answer in answers {
            // A tree that ended meanwhile drops its sender: quiet too.
            if let Ok(answer) = answer.await {
                cut_off.extend(answer?);
            }
        }
        Some(cut_off)
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// Stops the arbiters (cutting off what runs) and the store writer. `drained`: a
    /// graceful shutdown ended every call and made every report durable, so the store
    /// is marked so ([`ProcedureStore::mark_drained`](crate::ProcedureStore::mark_drained))
    /// after its last append, naming these procedures (and the corrupt ones left in the
    /// store) as possibly cut off by an earlier crash.
    fn stop_now(&mut self, drained: Option<Vec<ProcId>>) -> impl ActorFuture<Self, Output = ()> {
        let drained = drained.map(|mut cut_off| {
            cut_off.extend_from_slice(&self.corrupt);
            cut_off
        });
        // Set first: the trees cut off below report nothing as an engine failure.
        self.broken = Some(Error::Stopped);
        // The arbiters stop one by one, and a tree cut off on one frees its locks:
        // a procedure on another must not start a call under them meanwhile.
        self.shared.drain.close();
        for arbiter in &self.shared.arbiters {
            arbiter.stop();
        }
        for (_, waiters) in self.waiters.drain() {
            for waiter in waiters {
                let _ = waiter.send(Err(Error::Stopped));
            }
        }
        // Their streams end.
        self.subscribers.clear();
        let persistence = self.shared.persistence.clone();
        let locks = self.shared.locks.clone();
        let owned_system = self.owned_system;
        let was_drained = drained.is_some();
        // Joined off the actor threads: a call into user code that is in the middle of a
        // poll finishes it, and then nothing of this executor runs any more when
        // `shutdown` returns (a new executor on the same store must never overlap it).
        let (joined, threads_gone) = oneshot::channel();
        let arbiters = std::mem::take(&mut self.arbiters);
        let joiner = std::thread::Builder::new()
            .name("proctor-shutdown".into())
            .spawn(move || {
                for arbiter in arbiters {
                    let _ = arbiter.join();
                }
                let _ = joined.send(());
            });
        async move {
            if joiner.is_ok() {
                let _ = threads_gone.await;
            }
            // Errors mean it has stopped already.
            let _ = persistence.send(StopWriter { drained }).await;
            // Nothing of this engine asks for locks or waits for events any more.
            locks.do_send(StopLocks);
            tracing::info!(target: crate::targets::EXECUTOR,
                drained = was_drained,
                "executor stopped: its threads are joined and its store is closed"
            );
            if owned_system {
                System::current().stop();
            }
        }
        .into_actor(self)
        // Stopped last: an actor's pending futures end with it. Meanwhile `broken`
        // answers every request.
        .map(|(), _act, ctx| ctx.stop())
    }
}
