//! The questions the executor answers and the results it hands out: a procedure's
//! state, a root's result (at once, or once it finishes, decoded to the caller's type),
//! its acknowledgement, lists and pages of the table, and the schedulers', lock
//! table's and store's figures. Each is answered from the executor's table or by
//! asking the actor that owns the figure; none orders anything.

use std::sync::Arc;

use actix::prelude::*;
use tokio::sync::oneshot;

use crate::actors::locks::{GetLockReport, GetLockStats, WakeEvent};
use crate::actors::persistence::GetStoreStatus;
use crate::actors::root_stack::Describe;
use crate::actors::scheduler::{GetSchedulerStats, GetShardStats, SchedulerStats};
use crate::actors::shard::GetTreeCounts;
use crate::actors::shared::now_ms;
use crate::error::{Error, WaitError};
use crate::procedure::ProcId;
use crate::record::Failure;

use super::actor::ExecutorActor;
use super::api::{
    AckResult, Answer, Answered, EngineStatus, GetEngineStatus, GetLocks, GetState, GetTree,
    GetValue, List, ProcInfo, TreeInfo, WaitFor, WaitValue,
};

impl<E: Send + Sync + 'static> Handler<GetState> for ExecutorActor<E> {
    type Result = Result<ProcInfo, Error>;

    fn handle(&mut self, msg: GetState, _ctx: &mut Context<Self>) -> Self::Result {
        self.info(msg.0).ok_or_else(|| self.missing(msg.0))
    }
}

impl<E: Send + Sync + 'static> Handler<WaitFor> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<Result<(), Failure>, Error>>;

    fn handle(&mut self, msg: WaitFor, _ctx: &mut Context<Self>) -> Self::Result {
        self.wait_for(msg.0).into_response()
    }
}

impl<E: Send + Sync + 'static> Handler<Answered<WaitFor>> for ExecutorActor<E> {
    type Result = MessageResult<Answered<WaitFor>>;

    fn handle(&mut self, msg: Answered<WaitFor>, _ctx: &mut Context<Self>) -> Self::Result {
        MessageResult(self.wait_for(msg.0 .0))
    }
}

impl<E: Send + Sync + 'static> ExecutorActor<E> {
    /// The result of root `id`: at once if it finished, else once it does.
    fn wait_for(&mut self, id: ProcId) -> Answer<Result<(), Failure>> {
        // The row's root and result only (the table's guard released before anything
        // else is looked up), not the whole `ProcInfo`.
        let row = self
            .shared
            .table
            .get(&id)
            .map(|e| (e.root, e.result().cloned()));
        let ready = match row {
            None => Some(Err(self.missing(id))),
            Some((root, _)) if root != id => Some(Err(Error::NotRoot { id, root })),
            Some((_, Some(result))) => Some(Ok(result.map_err(|f| *f))),
            Some((_, None)) => self.broken.as_ref().map(|e| Err(e.duplicate())),
        };
        if let Some(ready) = ready {
            return Answer::Now(ready);
        }
        let (tx, rx) = oneshot::channel();
        self.waiters.entry(id).or_default().push(tx);
        Answer::Later(rx)
    }
}

impl<E, T> Handler<GetValue<T>> for ExecutorActor<E>
where
    E: Send + Sync + 'static,
    T: serde::de::DeserializeOwned + 'static,
{
    type Result = Result<Option<T>, Error>;

    fn handle(&mut self, msg: GetValue<T>, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.id;
        let bytes = match self.shared.table.get(&id) {
            None => return Err(self.missing(id)),
            Some(e) if e.result().is_none() => return Err(Error::NotFinished(id)),
            Some(e) => e.caller_value().cloned(),
        };
        bytes.map(|b| decode_value(id, &b)).transpose()
    }
}

impl<E, T> Handler<WaitValue<T>> for ExecutorActor<E>
where
    E: Send + Sync + 'static,
    T: serde::de::DeserializeOwned + 'static,
{
    type Result = ResponseFuture<Result<T, WaitError>>;

    fn handle(&mut self, msg: WaitValue<T>, ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.id;
        let finished = self.handle(WaitFor(id), ctx);
        let shared = Arc::clone(&self.shared);
        Box::pin(async move {
            finished.await?.map_err(WaitError::Failed)?;
            // Read as the result was published: kept at least until its retention ends.
            let bytes = shared
                .table
                .get(&id)
                .ok_or(WaitError::Gone(id))?
                .caller_value()
                .cloned()
                .ok_or(WaitError::NoValue(id))?;
            Ok(decode_value(id, &bytes)?)
        })
    }
}

/// A root's value as the type its caller asked for.
fn decode_value<T: serde::de::DeserializeOwned>(id: ProcId, bytes: &[u8]) -> Result<T, Error> {
    rmp_serde::from_slice(bytes).map_err(|e| Error::ValueType {
        id,
        reason: e.to_string(),
    })
}

impl<E: Send + Sync + 'static> Handler<AckResult> for ExecutorActor<E> {
    type Result = Result<(), Error>;

    fn handle(&mut self, msg: AckResult, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        match self.shared.table.get(&id) {
            None => return Err(self.missing(id)),
            Some(e) if e.root != id => return Err(Error::NotRoot { id, root: e.root }),
            Some(e) if e.result().is_none() => return Err(Error::NotFinished(id)),
            Some(_) => {}
        }
        self.acked.entry(id).or_insert_with(now_ms);
        Ok(())
    }
}

impl<E: Send + Sync + 'static> Handler<List> for ExecutorActor<E> {
    type Result = Result<Vec<ProcInfo>, Error>;

    fn handle(&mut self, msg: List, _ctx: &mut Context<Self>) -> Self::Result {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        let mut ids: Vec<ProcId> = match msg.root {
            Some(root) => self
                .shared
                .table
                .iter()
                .filter(|e| e.root == root)
                .map(|e| *e.key())
                .collect(),
            None => self.shared.table.iter().map(|e| *e.key()).collect(),
        };
        ids.sort_unstable();
        Ok(ids
            .into_iter()
            .filter_map(|id| self.info(id))
            .filter(|info| msg.matches(info))
            .collect())
    }
}

impl<E: Send + Sync + 'static> Handler<super::api::ListPage> for ExecutorActor<E> {
    type Result = Result<super::api::ProcPage, Error>;

    fn handle(&mut self, msg: super::api::ListPage, _ctx: &mut Context<Self>) -> Self::Result {
        if let Some(broken) = &self.broken {
            return Err(broken.duplicate());
        }
        // Matched on the table's own fields: only the page is described.
        let mut ids: Vec<ProcId> = self
            .shared
            .table
            .iter()
            .filter(|e| msg.list.matches_fields(e.state, e.type_name, e.root))
            .map(|e| *e.key())
            .collect();
        let total = ids.len();
        ids.sort_unstable_by(|a, b| b.cmp(a));
        let procedures = ids
            .into_iter()
            .skip(msg.offset)
            .take(msg.limit)
            .filter_map(|id| self.info(id))
            .collect();
        Ok(super::api::ProcPage { procedures, total })
    }
}

impl<E: Send + Sync + 'static> Handler<WakeEvent> for ExecutorActor<E> {
    type Result = ();

    fn handle(&mut self, msg: WakeEvent, _ctx: &mut Context<Self>) {
        self.shared.locks.do_send(msg);
    }
}

impl<E: Send + Sync + 'static> Handler<GetSchedulerStats> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<SchedulerStats, Error>>;

    fn handle(&mut self, _msg: GetSchedulerStats, _ctx: &mut Context<Self>) -> Self::Result {
        // Every shard and its scheduler, and the lock actor: asked at once, added up.
        let shards: Vec<_> = self
            .shared
            .shards
            .iter()
            .map(|at| (at.1.send(GetShardStats), at.0.send(GetTreeCounts)))
            .collect();
        let locks = self.shared.locks.send(GetLockStats);
        Box::pin(async move {
            let mut stats = SchedulerStats::default();
            for (scheduler, trees) in shards {
                stats.add(&scheduler.await?);
                let trees = trees.await?;
                stats.trees_active += trees.active;
                stats.trees_passivated += trees.passivated;
                stats.procedures_active += trees.procedures_active;
            }
            let locks = locks.await?;
            stats.lock_holders = locks.holders;
            stats.lock_waiters = locks.waiters;
            stats.events = locks.events;
            Ok(stats)
        })
    }
}

impl<E: Send + Sync + 'static> Handler<GetTree> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<TreeInfo, Error>>;

    fn handle(&mut self, msg: GetTree, _ctx: &mut Context<Self>) -> Self::Result {
        let id = msg.0;
        let tree = self.live_tree(id);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ack, answer) = oneshot::channel();
            tree?.do_send(Describe(ack));
            // Unanswered: the tree finished before it was asked, or the engine stopped.
            answer
                .await
                .map_err(|_| match shared.table.get(&id).map(|e| e.state) {
                    Some(state) if state.is_finished() => Error::Finished { id, state },
                    _ => Error::Stopped,
                })
        })
    }
}

impl<E: Send + Sync + 'static> Handler<GetLocks> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<crate::LockReport, Error>>;

    fn handle(&mut self, _msg: GetLocks, _ctx: &mut Context<Self>) -> Self::Result {
        let report = self.shared.locks.send(GetLockReport);
        Box::pin(async move { Ok(report.await?) })
    }
}

impl<E: Send + Sync + 'static> Handler<GetEngineStatus> for ExecutorActor<E> {
    type Result = ResponseFuture<Result<EngineStatus, Error>>;

    fn handle(&mut self, _msg: GetEngineStatus, _ctx: &mut Context<Self>) -> Self::Result {
        let store = self.shared.persistence.send(GetStoreStatus);
        let recent_failures = self.recent_failures.iter().cloned().collect();
        Box::pin(async move {
            let (store, commits) = store.await??;
            Ok(EngineStatus {
                store,
                commits,
                recent_failures,
            })
        })
    }
}
