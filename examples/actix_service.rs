//! An actix-actor service: a `ClusterManager` actor that holds only the engine's address
//! (`Addr<ExecutorActor<E>>`) and talks to it by messages. Run it with
//!
//! ```sh
//! cargo run --release --example actix_service              # WAL in a fresh temp dir
//! cargo run --release --example actix_service -- --dir D   # WAL in D (kept)
//! ```
//!
//! The manager subscribes its own `Recipient<ProcEvent>` when it starts, so the engine
//! pushes every root's completion to it: nobody polls. Its requests map onto engine
//! messages:
//!
//! | the manager's message | what it sends the engine |
//! | --- | --- |
//! | `CreateTableRequest` | `Submit`, then (on the `Finished` event) `GetValue::<TableInfo>`, typed |
//! | `StartCompaction` | `Submit` |
//! | `AbortJob` | `Abort`: the compaction's long step sees `ctx.cancelled()` and stops |
//! | `AwaitJob` | nothing: answered from the `Finished` event |
//! | `ListJobs` | `List` |
//! | `StopEngine` | `Shutdown::graceful()` |

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use proctor::messages::{Abort, GetValue, Shutdown, Submit, Subscribe};
use proctor::{
    async_trait, Context as StepContext, Executor, ExecutorActor, Failure, Flow, List, ProcError,
    ProcEvent, ProcId, ProcInfo, Procedure, Registry, WalStore,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{oneshot, Notify};

// ---------------------------------------------------------------------------------------
// The procedures.

/// The typed result of `CreateTable`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableInfo {
    pub name: String,
    pub regions: Vec<String>,
}

/// Creates a table: one step per region, then a last step that sets the result.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    table: String,
    regions: usize,
    assigned: Vec<String>,
}

#[async_trait]
impl Procedure<CompactionStarted> for CreateTable {
    async fn execute(
        &mut self,
        ctx: &mut StepContext<CompactionStarted>,
    ) -> Result<Flow<CompactionStarted>, ProcError> {
        if self.assigned.len() < self.regions {
            let region = format!("{}-r{}", self.table, self.assigned.len());
            println!("  [create_table {}] assign {region}", ctx.id());
            self.assigned.push(region); // persisted before the next step runs
            return Ok(Flow::MoreToDo);
        }
        ctx.set_result(&TableInfo {
            name: self.table.clone(),
            regions: self.assigned.clone(),
        })?;
        Ok(Flow::Done)
    }

    async fn rollback(
        &mut self,
        _ctx: &mut StepContext<CompactionStarted>,
    ) -> Result<(), ProcError> {
        self.assigned.pop();
        Ok(())
    }
}

/// Tells whoever waits that a compaction step has begun (the engine's `env`).
pub struct CompactionStarted(Notify);

/// Compacts a table: one long step that races its work against cancellation.
#[derive(Serialize, Deserialize)]
struct Compaction {
    table: String,
}

#[async_trait]
impl Procedure<CompactionStarted> for Compaction {
    async fn execute(
        &mut self,
        ctx: &mut StepContext<CompactionStarted>,
    ) -> Result<Flow<CompactionStarted>, ProcError> {
        println!("  [compaction {}] compacting {}", ctx.id(), self.table);
        ctx.env().0.notify_one();
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(3600)) => Ok(Flow::Done),
            () = ctx.cancelled() => {
                println!("  [compaction {}] cancelled mid-step, stopping", ctx.id());
                Err(ProcError::Aborted)
            }
        }
    }

    async fn rollback(
        &mut self,
        ctx: &mut StepContext<CompactionStarted>,
    ) -> Result<(), ProcError> {
        println!(
            "  [compaction {}] rollback: discard partial output of {}",
            ctx.id(),
            self.table
        );
        Ok(())
    }
}

/// Every type that can be persisted, under a name that never changes.
fn registry() -> Registry<CompactionStarted> {
    let mut registry = Registry::new();
    registry
        .register::<CreateTable>("create_table")
        .register::<Compaction>("compaction");
    registry
}

// ---------------------------------------------------------------------------------------
// The service actor.

/// What the service's requests can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error("engine: {0}")]
    Engine(#[from] proctor::Error),
    #[error("store: {0}")]
    Store(#[from] proctor::StoreError),
    #[error("engine unreachable: {0}")]
    Mailbox(#[from] MailboxError),
    #[error("{0}")]
    Failed(#[from] Failure),
    #[error("procedure {0} set no result")]
    NoValue(ProcId),
}

/// The service. It holds the engine's address and what it heard from the engine.
pub struct ClusterManager {
    engine: Addr<ExecutorActor<CompactionStarted>>,
    /// Requests waiting for a root to finish.
    waiting: HashMap<ProcId, Vec<oneshot::Sender<Result<(), Failure>>>>,
    /// Results that came before anyone asked for them (a quick root can finish before
    /// its submit's answer is back).
    finished: HashMap<ProcId, Result<(), Failure>>,
    /// Every event, for the record.
    history: Vec<ProcEvent>,
}

impl ClusterManager {
    pub fn new(engine: Addr<ExecutorActor<CompactionStarted>>) -> Self {
        ClusterManager {
            engine,
            waiting: HashMap::new(),
            finished: HashMap::new(),
            history: Vec::new(),
        }
    }

    /// Answers once root `id` has finished, with its result.
    fn completion(&mut self, id: ProcId) -> oneshot::Receiver<Result<(), Failure>> {
        let (tx, rx) = oneshot::channel();
        match self.finished.remove(&id) {
            Some(result) => {
                let _ = tx.send(result);
            }
            None => self.waiting.entry(id).or_default().push(tx),
        }
        rx
    }
}

impl Actor for ClusterManager {
    type Context = actix::Context<Self>;

    fn started(&mut self, ctx: &mut Self::Context) {
        // Subscribe before handling any request (`wait` holds the mailbox meanwhile), so
        // no completion is missed.
        let me = ctx.address().recipient();
        self.engine
            .send(Subscribe(me))
            .into_actor(self)
            .map(|subscribed, _act, ctx| match subscribed {
                Ok(Ok(())) => println!("[manager] subscribed to the engine's events"),
                Ok(Err(e)) => {
                    eprintln!("[manager] cannot subscribe: {e}");
                    ctx.stop();
                }
                Err(e) => {
                    eprintln!("[manager] cannot subscribe: {e}");
                    ctx.stop();
                }
            })
            .wait(ctx);
    }
}

/// The engine pushes every root's events here.
impl Handler<ProcEvent> for ClusterManager {
    type Result = ();

    fn handle(&mut self, event: ProcEvent, _ctx: &mut Self::Context) {
        match &event {
            ProcEvent::Submitted { id, type_name } => {
                println!("[manager] event: {type_name} {id} submitted");
            }
            ProcEvent::Finished {
                id,
                type_name,
                result,
            } => {
                match result {
                    Ok(()) => println!("[manager] event: {type_name} {id} finished: SUCCESS"),
                    Err(failure) => {
                        println!(
                            "[manager] event: {type_name} {id} finished: ROLLEDBACK ({failure})"
                        );
                    }
                }
                match self.waiting.remove(id) {
                    Some(waiters) => {
                        for waiter in waiters {
                            let _ = waiter.send(result.clone());
                        }
                    }
                    None => {
                        self.finished.insert(*id, result.clone());
                    }
                }
            }
            _ => {}
        }
        self.history.push(event);
    }
}

/// Create a table and answer its `TableInfo` once it exists.
#[derive(Message)]
#[rtype(result = "Result<TableInfo, ServiceError>")]
pub struct CreateTableRequest {
    pub table: String,
    pub regions: usize,
}

impl Handler<CreateTableRequest> for ClusterManager {
    type Result = ResponseActFuture<Self, Result<TableInfo, ServiceError>>;

    fn handle(&mut self, msg: CreateTableRequest, _ctx: &mut Self::Context) -> Self::Result {
        let engine = self.engine.clone();
        let submit = self.engine.send(Submit::new(CreateTable {
            table: msg.table,
            regions: msg.regions,
            assigned: Vec::new(),
        }));
        Box::pin(
            async move { Ok::<_, ServiceError>(submit.await??) }
                .into_actor(self)
                // Back in the actor: register for the root's completion.
                .map(|submitted, act, _ctx| submitted.map(|id| (id, act.completion(id))))
                .then(|submitted, act, _ctx| {
                    async move {
                        let (id, done) = submitted?;
                        println!("[manager] create_table {id} submitted; waiting for its event");
                        done.await.map_err(|_| proctor::Error::Stopped)??;
                        // The value its last step set, decoded as the type asked for.
                        let value = engine.send(GetValue::<TableInfo>::new(id)).await??;
                        value.ok_or(ServiceError::NoValue(id))
                    }
                    .into_actor(act)
                }),
        )
    }
}

/// Start compacting a table; answers the job's id at once.
#[derive(Message)]
#[rtype(result = "Result<ProcId, ServiceError>")]
pub struct StartCompaction {
    pub table: String,
}

impl Handler<StartCompaction> for ClusterManager {
    type Result = ResponseFuture<Result<ProcId, ServiceError>>;

    fn handle(&mut self, msg: StartCompaction, _ctx: &mut Self::Context) -> Self::Result {
        let submit = self
            .engine
            .send(Submit::new(Compaction { table: msg.table }));
        Box::pin(async move { Ok(submit.await??) })
    }
}

/// Abort a job; answers whether it accepted.
#[derive(Message)]
#[rtype(result = "Result<bool, ServiceError>")]
pub struct AbortJob(pub ProcId);

impl Handler<AbortJob> for ClusterManager {
    type Result = ResponseFuture<Result<bool, ServiceError>>;

    fn handle(&mut self, msg: AbortJob, _ctx: &mut Self::Context) -> Self::Result {
        let abort = self.engine.send(Abort(msg.0));
        Box::pin(async move { Ok(abort.await??) })
    }
}

/// Wait for a job to finish; answers its result.
#[derive(Message)]
#[rtype(result = "Result<Result<(), Failure>, ServiceError>")]
pub struct AwaitJob(pub ProcId);

impl Handler<AwaitJob> for ClusterManager {
    type Result = ResponseFuture<Result<Result<(), Failure>, ServiceError>>;

    fn handle(&mut self, msg: AwaitJob, _ctx: &mut Self::Context) -> Self::Result {
        let done = self.completion(msg.0);
        Box::pin(async move { Ok(done.await.map_err(|_| proctor::Error::Stopped)?) })
    }
}

/// Every procedure the engine knows, finished roots included.
#[derive(Message)]
#[rtype(result = "Result<Vec<ProcInfo>, ServiceError>")]
pub struct ListJobs;

impl Handler<ListJobs> for ClusterManager {
    type Result = ResponseFuture<Result<Vec<ProcInfo>, ServiceError>>;

    fn handle(&mut self, _msg: ListJobs, _ctx: &mut Self::Context) -> Self::Result {
        let list = self.engine.send(List::new().with_finished());
        Box::pin(async move { Ok(list.await??) })
    }
}

/// Shut the engine down gracefully; answers the events the service heard.
#[derive(Message)]
#[rtype(result = "Result<Vec<ProcEvent>, ServiceError>")]
pub struct StopEngine;

impl Handler<StopEngine> for ClusterManager {
    type Result = ResponseActFuture<Self, Result<Vec<ProcEvent>, ServiceError>>;

    fn handle(&mut self, _msg: StopEngine, _ctx: &mut Self::Context) -> Self::Result {
        let shutdown = self.engine.send(Shutdown::graceful());
        Box::pin(shutdown.into_actor(self).map(|stopped, act, _ctx| {
            stopped?;
            println!("[manager] engine shut down");
            Ok(std::mem::take(&mut act.history))
        }))
    }
}

// ---------------------------------------------------------------------------------------
// The flow: a client of the service.

/// What a run saw, for the printout and the tests.
#[derive(Debug)]
pub struct Report {
    pub table: TableInfo,
    pub compaction: ProcId,
    pub jobs_before_abort: Vec<ProcInfo>,
    pub abort_accepted: bool,
    pub compaction_result: Result<(), Failure>,
    pub jobs_at_end: Vec<ProcInfo>,
    pub events: Vec<ProcEvent>,
}

fn print_jobs(jobs: &[ProcInfo]) {
    for job in jobs {
        println!("    {:>4}  {:<14} {}", job.id, job.type_name, job.state);
    }
}

/// The service's whole flow, on a WAL in `dir`. Call it inside an actix system.
pub async fn run(dir: &Path) -> Result<Report, ServiceError> {
    let compaction_started = Arc::new(CompactionStarted(Notify::new()));
    // Inside an actix system the engine joins it.
    let executor = Executor::builder()
        .registry(registry())
        .store(WalStore::open(dir)?)
        .env(compaction_started.clone())
        .start()
        .await?;
    println!("engine started on {}", dir.display());
    // From here on everything goes through the manager, which holds only the address.
    let manager = ClusterManager::new(executor.addr()?.clone()).start();

    let table = manager
        .send(CreateTableRequest {
            table: "users".into(),
            regions: 3,
        })
        .await??;
    println!("created {table:?}");

    let compaction = manager
        .send(StartCompaction {
            table: "users".into(),
        })
        .await??;
    println!("started compaction {compaction}");
    compaction_started.0.notified().await; // its long step is under way

    let jobs_before_abort = manager.send(ListJobs).await??;
    println!("jobs:");
    print_jobs(&jobs_before_abort);

    // The step would run for an hour; it races `ctx.cancelled()`, so the abort (answered
    // once the step has returned) comes back at once, and the tree rolls back.
    let abort_accepted = manager.send(AbortJob(compaction)).await??;
    println!("abort of compaction {compaction} accepted: {abort_accepted}");
    let compaction_result = manager.send(AwaitJob(compaction)).await??;
    if let Err(failure) = &compaction_result {
        println!("compaction {compaction} rolled back: {failure}");
    }
    let jobs_at_end = manager.send(ListJobs).await??;
    println!("jobs:");
    print_jobs(&jobs_at_end);

    let events = manager.send(StopEngine).await??;
    Ok(Report {
        table,
        compaction,
        jobs_before_abort,
        abort_accepted,
        compaction_result,
        jobs_at_end,
        events,
    })
}

#[actix::main]
async fn main() -> std::process::ExitCode {
    // An error is shown by what it says (its `Display`): `main` returning a `Result`
    // would print its `Debug` form (`Locked { file: .. }`).
    match serve().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("actix_service: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir: Option<PathBuf> = match (args.next().as_deref(), args.next()) {
        (None, _) => None,
        (Some("--dir"), Some(dir)) => Some(dir.into()),
        _ => return Err("usage: actix_service [--dir PATH]".into()),
    };
    // Without --dir, a temp dir removed at the end.
    let temp = tempfile::tempdir()?;
    run(dir.as_deref().unwrap_or(temp.path())).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proctor::ProcState;

    fn state_of(jobs: &[ProcInfo], id: ProcId) -> ProcState {
        jobs.iter().find(|j| j.id == id).map(|j| j.state).unwrap()
    }

    /// The example's whole flow on a temp dir, checked step by step.
    #[actix::test]
    async fn the_manager_drives_the_engine_by_messages() {
        let dir = tempfile::tempdir().unwrap();
        let report = run(dir.path()).await.unwrap();

        // The typed result, fetched with GetValue once the Finished event came.
        assert_eq!(
            report.table,
            TableInfo {
                name: "users".into(),
                regions: vec!["users-r0".into(), "users-r1".into(), "users-r2".into()],
            }
        );
        // The compaction was listed unfinished mid-step, then aborted and rolled back.
        assert!(!state_of(&report.jobs_before_abort, report.compaction).is_finished());
        assert!(report.abort_accepted);
        let failure = report.compaction_result.as_ref().unwrap_err();
        assert_eq!(failure.proc, report.compaction);
        assert_eq!(failure.error, ProcError::Aborted);
        assert_eq!(
            state_of(&report.jobs_at_end, report.compaction),
            ProcState::RolledBack
        );

        // Both roots were pushed as submitted, then finished.
        let kinds: Vec<(&str, &str)> = report
            .events
            .iter()
            .map(|event| match event {
                ProcEvent::Submitted { type_name, .. } => ("submitted", *type_name),
                ProcEvent::Finished { type_name, .. } => ("finished", *type_name),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            kinds,
            [
                ("submitted", "create_table"),
                ("finished", "create_table"),
                ("submitted", "compaction"),
                ("finished", "compaction"),
            ]
        );

        // The graceful shutdown released the directory with everything durable.
        let again = Executor::builder()
            .registry(registry())
            .env(CompactionStarted(Notify::new()))
            .store(WalStore::open(dir.path()).unwrap())
            .start()
            .await
            .unwrap();
        assert_eq!(again.recovery().finished_roots, 2);
        assert!(again.recovery().recovered_roots.is_empty());
        again.shutdown().await.unwrap();
    }
}
