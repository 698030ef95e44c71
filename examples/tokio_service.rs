//! A tokio-first service: a tiny control plane that embeds proctor from a plain
//! `#[tokio::main]` program (no actix in sight). Run it with
//!
//! ```sh
//! cargo run --release --example tokio_service              # WAL in a fresh temp dir
//! cargo run --release --example tokio_service -- --dir D   # WAL in D (kept)
//! ```
//!
//! It shows, in order:
//!
//! 1. starting the engine on a WAL directory and subscribing to its events (every root
//!    submitted and finished is pushed to a task: no polling);
//! 2. `CreateTable`, a state machine with one child per region, whose last step sets a
//!    result of the type it declares (`ProducesOutput`), which its caller gets back
//!    typed: a `typed()` submit answers a `Submitted<TableInfo>`;
//! 3. a request whose step fails through `?` on a std error (a region count that does
//!    not parse): the tree rolls back and the caller gets the error's message and type;
//!    and a second create of an existing table, which fails and rolls back without
//!    touching the table that exists: a table carries the procedure that created it,
//!    and a rollback drops only its own (`ctx.undoing()` says how far its step got,
//!    not whose the table is);
//! 4. `Compaction`, whose one long step races its work against `ctx.cancelled()`: an
//!    abort sent while the step runs is answered at once, and the tree rolls back;
//! 5. a graceful `shutdown`: running steps end, records become durable, the WAL
//!    directory is released, and the event stream ends.

use std::collections::BTreeMap;
use std::error::Error;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proctor::{
    async_trait, ChildType, Failure, Lock, ProcError, ProcEvent, ProcId, ProcState, Procedure,
    ProducesOutput, StateMachine, StateMachineProcedure, WalStore,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

// `Context`, `Flow`, `StateContext<'_, S>`, `Registry` and `Executor` below are
// proctor's for the environment `Cluster`.
proctor::environment!(Cluster);

/// What the service manages: the executor's environment, which every step borrows
/// through `ctx.env()` (the procedures implement `Procedure<Cluster>`).
#[derive(Default)]
struct Cluster {
    /// Table name → the table.
    tables: Mutex<BTreeMap<String, Table>>,
    /// Told when a compaction has begun its long step (so `main` aborts it mid-step).
    compaction_running: Notify,
}

/// A table: the procedure that created it (written in the same change that creates
/// it, so its rollback can tell its own table from someone else's), and its regions.
#[derive(Clone, Debug)]
struct Table {
    owner: ProcId,
    regions: Vec<String>,
}

/// The typed result of `CreateTable`, handed to its caller by `Submitted::wait`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TableInfo {
    pub name: String,
    pub regions: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum CreateTableState {
    Prepare,
    CreateMeta,
    AssignRegions,
    Enable,
}

/// Creates a table with `regions` regions. The count comes in as text, as it would
/// from a request; the first step parses it.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    table: String,
    regions: String,
}

/// What its last step sets (`ctx.set_result`), and its caller gets.
impl ProducesOutput for CreateTable {
    type Output = TableInfo;
}

#[async_trait]
impl StateMachineProcedure<Cluster> for CreateTable {
    type State = CreateTableState;

    fn initial_state(&self) -> CreateTableState {
        CreateTableState::Prepare
    }

    /// Its children: an executor whose registry lacks their type refuses to start.
    fn child_types() -> Vec<ChildType> {
        vec![ChildType::of::<AssignRegion>()]
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, CreateTableState>,
        state: CreateTableState,
    ) -> Result<Flow, ProcError> {
        println!("  [create_table {}] {state:?}", ctx.id());
        let cluster = ctx.env();
        match state {
            CreateTableState::Prepare => {
                // `?` on a std error (here `ParseIntError`): the step fails with
                // `ProcError::Error`, which keeps the message and the error's type.
                let count: u32 = self.regions.parse()?;
                if count == 0 {
                    return Err(ProcError::failed("a table needs at least one region"));
                }
                // Only checks, and changes nothing: its rollback has nothing to undo,
                // whether it passed, failed ("exists") or was cut off by a crash.
                if cluster.tables.lock().unwrap().contains_key(&self.table) {
                    return Err(ProcError::failed(format!("table {} exists", self.table)));
                }
                ctx.set_next_state(CreateTableState::CreateMeta);
                Ok(Flow::MoreToDo)
            }
            CreateTableState::CreateMeta => {
                // The table's lock, held since Prepare, keeps other creates of it out;
                // should one get in anyway (one not through the engine), the step fails.
                // The table is created with its owner, this procedure, in one change.
                {
                    let me = ctx.id();
                    let mut tables = cluster.tables.lock().unwrap();
                    match tables.get(&self.table) {
                        // Ours: this step ran before a crash.
                        Some(table) if table.owner == me => {}
                        Some(_) => {
                            return Err(ProcError::failed(format!("table {} exists", self.table)))
                        }
                        None => {
                            let table = Table {
                                owner: me,
                                regions: Vec::new(),
                            };
                            tables.insert(self.table.clone(), table);
                        }
                    }
                }
                ctx.set_next_state(CreateTableState::AssignRegions);
                Ok(Flow::MoreToDo)
            }
            CreateTableState::AssignRegions => {
                ctx.set_next_state(CreateTableState::Enable);
                let count: u32 = self.regions.parse()?;
                let children = (0..count).map(|r| AssignRegion {
                    table: self.table.clone(),
                    region: format!("{}-r{r}", self.table),
                });
                Ok(Flow::children(children))
            }
            CreateTableState::Enable => {
                let mut regions = cluster.tables.lock().unwrap()[&self.table].regions.clone();
                regions.sort(); // the children ran concurrently
                                // The last step's value is persisted with the finished root.
                ctx.set_result(&TableInfo {
                    name: self.table.clone(),
                    regions,
                })?;
                Ok(Flow::Done)
            }
        }
    }

    /// The table, exclusively, from the first step to the last (or the last rollback).
    fn locks(&self) -> Vec<Lock> {
        vec![Lock::exclusive(format!("table/{}", self.table))]
    }

    fn holds_lock(&self) -> bool {
        true
    }

    async fn rollback_state(
        &mut self,
        ctx: &mut Context,
        state: CreateTableState,
    ) -> Result<(), ProcError> {
        // The state that failed is rolled back too: undo only what its run did.
        let undo = ctx.undoing();
        println!("  [create_table {}] rollback {state:?} ({undo})", ctx.id());
        if state == CreateTableState::CreateMeta {
            // Completed, failed or interrupted: drop the table if this procedure
            // created it, and only then: failed, the step found someone else's;
            // interrupted by a crash, it may have created it, found someone else's, or
            // not got so far.
            let mut tables = ctx.env().tables.lock().unwrap();
            if tables.get(&self.table).is_some_and(|t| t.owner == ctx.id()) {
                tables.remove(&self.table);
            }
        }
        // Prepare only checked; the regions are undone by their own procedures.
        Ok(())
    }
}

/// A child of `CreateTable`: assigns one region (one step, idempotent).
#[derive(Serialize, Deserialize)]
struct AssignRegion {
    table: String,
    region: String,
}

#[async_trait]
impl Procedure<Cluster> for AssignRegion {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        println!("  [assign_region {}] {}", ctx.id(), self.region);
        let cluster = ctx.env();
        let mut tables = cluster.tables.lock().unwrap();
        let Some(table) = tables.get_mut(&self.table) else {
            return Err(ProcError::failed(format!("table {} is gone", self.table)));
        };
        if !table.regions.contains(&self.region) {
            table.regions.push(self.region.clone());
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, ctx: &mut Context) -> Result<(), ProcError> {
        let cluster = ctx.env();
        if let Some(table) = cluster.tables.lock().unwrap().get_mut(&self.table) {
            table.regions.retain(|r| r != &self.region);
        }
        Ok(())
    }
}

/// Compacts a table: one long step that honours cancellation.
#[derive(Serialize, Deserialize)]
struct Compaction {
    table: String,
}

#[async_trait]
impl Procedure<Cluster> for Compaction {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        println!("  [compaction {}] compacting {}", ctx.id(), self.table);
        ctx.env().compaction_running.notify_one();
        // The work (an hour of it) races the cancellation signal an abort raises.
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(3600)) => Ok(Flow::Done),
            () = ctx.cancelled() => {
                println!("  [compaction {}] cancelled mid-step, stopping", ctx.id());
                Err(ProcError::Aborted)
            }
        }
    }

    async fn rollback(&mut self, ctx: &mut Context) -> Result<(), ProcError> {
        // The cancelled step is rolled back too: it may have written partial output.
        println!(
            "  [compaction {}] rollback: discard partial output of {}",
            ctx.id(),
            self.table
        );
        Ok(())
    }
}

/// What a run of the service saw, for the printout and the tests.
#[derive(Debug)]
pub struct Report {
    pub table: TableInfo,
    pub bad_request: Failure,
    pub duplicate: Failure,
    pub compaction: ProcId,
    pub abort_accepted: bool,
    pub abort_took: Duration,
    pub compaction_failure: Failure,
    pub compaction_state: ProcState,
    pub events: Vec<ProcEvent>,
    /// The tables that exist at the end, with their regions: the failed requests left
    /// nothing behind and took nothing away.
    pub tables: BTreeMap<String, Vec<String>>,
}

/// Every type that can be persisted, under a name that never changes (the WAL keeps it).
fn registry() -> Registry {
    let mut registry = Registry::new();
    registry
        .register_state_machine::<CreateTable>("create_table")
        .register::<AssignRegion>("assign_region")
        .register::<Compaction>("compaction");
    registry
}

/// The service's whole flow, on a WAL in `dir`.
pub async fn run(dir: &Path) -> Result<Report, Box<dyn Error>> {
    // 1. Start on the WAL. The cluster is shared with the steps.
    let cluster = Arc::new(Cluster::default());
    let executor = Executor::builder()
        .registry(registry())
        .store(WalStore::open(dir)?) // recovers whatever an earlier run left there
        .env(cluster.clone())
        .start()
        .await?;
    println!("engine started on {}", dir.display());

    // Events are pushed: a task prints each one as it comes. The stream ends when the
    // engine shuts down, and the task hands back everything it saw.
    let mut subscription = executor.subscribe().await?;
    let event_log = tokio::spawn(async move {
        let mut seen = Vec::new();
        while let Some(event) = subscription.next().await {
            match &event {
                ProcEvent::Submitted { id, type_name } => {
                    println!("  (event) {type_name} {id} submitted");
                }
                ProcEvent::Finished {
                    id,
                    type_name,
                    result,
                } => match result {
                    Ok(()) => println!("  (event) {type_name} {id} finished: SUCCESS"),
                    Err(failure) => {
                        println!("  (event) {type_name} {id} finished: ROLLEDBACK ({failure})");
                    }
                },
                _ => {}
            }
            seen.push(event);
        }
        seen
    });

    // 2. A procedure with a typed result.
    let created = executor
        .submit(StateMachine::new(CreateTable {
            table: "users".into(),
            regions: "3".into(),
        }))
        .typed()
        .await?;
    let id = created.id();
    println!("submitted create_table {id}");
    // Its declared output, a `TableInfo`, or the tree's `Failure` if it rolled back.
    let table = created.wait().await??;
    println!("create_table {id} returned {table:?}");

    // 3. A step that fails through `?`: the caller sees the std error's message.
    let id = executor
        .submit(StateMachine::new(CreateTable {
            table: "orders".into(),
            regions: "three".into(),
        }))
        .await?;
    println!("submitted create_table {id} with regions \"three\"");
    let bad_request = match executor.wait(id).await? {
        Ok(()) => return Err(format!("create_table {id} should have failed").into()),
        Err(failure) => failure,
    };
    println!("create_table {id} rolled back: {bad_request}");
    if let ProcError::Error { type_name, .. } = &bad_request.error {
        println!("  (the step's error was a {type_name})");
    }

    //    The same table again: the create fails, and its rollback leaves the table.
    let id = executor
        .submit(StateMachine::new(CreateTable {
            table: "users".into(),
            regions: "1".into(),
        }))
        .await?;
    println!("submitted create_table {id} of users again");
    let duplicate = match executor.wait(id).await? {
        Ok(()) => return Err(format!("create_table {id} should have failed").into()),
        Err(failure) => failure,
    };
    println!("create_table {id} rolled back: {duplicate}");

    // 4. Abort a long step that cooperates: its work would take an hour, but it races
    //    `ctx.cancelled()`, so the abort is answered as soon as the step sees the signal.
    let compaction = executor
        .submit(Compaction {
            table: "users".into(),
        })
        .await?;
    println!("submitted compaction {compaction}");
    // Wait until the step is under way (a real service aborts whenever an operator asks).
    cluster.compaction_running.notified().await;
    let asked = Instant::now();
    let abort_accepted = executor.abort(compaction).await?;
    let abort_took = asked.elapsed();
    println!(
        "abort of compaction {compaction} accepted: {abort_accepted} (answered in {abort_took:?})"
    );
    let compaction_failure = match executor.wait(compaction).await? {
        Ok(()) => return Err(format!("compaction {compaction} should have rolled back").into()),
        Err(failure) => failure,
    };
    let compaction_state = executor.state(compaction).await?.state;
    println!("compaction {compaction} ended {compaction_state}: {compaction_failure}");

    // 5. Graceful shutdown: drains, makes everything durable, releases the directory.
    executor.shutdown().await?;
    println!("engine shut down");
    let events = event_log.await?;
    let tables = cluster
        .tables
        .lock()
        .unwrap()
        .iter()
        .map(|(name, table)| (name.clone(), table.regions.clone()))
        .collect();

    Ok(Report {
        table,
        bad_request,
        duplicate,
        compaction,
        abort_accepted,
        abort_took,
        compaction_failure,
        compaction_state,
        events,
        tables,
    })
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // An error is shown by what it says (its `Display`): `main` returning a `Result`
    // would print its `Debug` form (`Locked { file: .. }`).
    match serve().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokio_service: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let dir: Option<PathBuf> = match (args.next().as_deref(), args.next()) {
        (None, _) => None,
        (Some("--dir"), Some(dir)) => Some(dir.into()),
        _ => return Err("usage: tokio_service [--dir PATH]".into()),
    };
    // Without --dir, a temp dir removed at the end.
    let temp = tempfile::tempdir()?;
    run(dir.as_deref().unwrap_or(temp.path())).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example's whole flow on a temp dir, checked step by step.
    #[tokio::test(flavor = "multi_thread")]
    async fn the_service_runs_its_flow_and_shuts_down_gracefully() {
        let dir = tempfile::tempdir().unwrap();
        let report = run(dir.path()).await.unwrap();

        // The typed result.
        assert_eq!(
            report.table,
            TableInfo {
                name: "users".into(),
                regions: vec!["users-r0".into(), "users-r1".into(), "users-r2".into()],
            }
        );
        // `?` on a std error: its type and message reach the caller; nothing is left.
        match &report.bad_request.error {
            ProcError::Error {
                type_name, message, ..
            } => {
                assert!(type_name.contains("ParseIntError"), "{type_name}");
                assert_eq!(message, "invalid digit found in string");
            }
            other => panic!("{other:?}"),
        }
        // The second create of users failed and left the first one's table whole.
        assert_eq!(
            report.duplicate.error,
            ProcError::failed("table users exists")
        );
        let mut regions = report.tables["users"].clone();
        regions.sort();
        assert_eq!(report.tables.len(), 1, "{:?}", report.tables);
        assert_eq!(regions, report.table.regions);
        // The abort: accepted while the hour-long step ran, answered promptly, rolled back.
        assert!(report.abort_accepted);
        assert!(
            report.abort_took < Duration::from_secs(30),
            "{:?}",
            report.abort_took
        );
        assert_eq!(report.compaction_failure.proc, report.compaction);
        assert_eq!(report.compaction_failure.error, ProcError::Aborted);
        assert_eq!(report.compaction_state, ProcState::RolledBack);

        // Every root was pushed as submitted, then finished with its result.
        let seen: Vec<(&str, &str, String)> = report
            .events
            .iter()
            .map(|event| match event {
                ProcEvent::Submitted { type_name, .. } => ("submitted", *type_name, String::new()),
                ProcEvent::Finished {
                    type_name, result, ..
                } => (
                    "finished",
                    *type_name,
                    result
                        .as_ref()
                        .map_or_else(|f| f.error.to_string(), |()| "ok".into()),
                ),
                other => panic!("{other:?}"),
            })
            .collect();
        let expected = [
            ("submitted", "create_table", ""),
            ("finished", "create_table", "ok"),
            ("submitted", "create_table", ""),
            ("finished", "create_table", "invalid digit found in string"),
            ("submitted", "create_table", ""),
            ("finished", "create_table", "table users exists"),
            ("submitted", "compaction", ""),
            ("finished", "compaction", "aborted by operator"),
        ];
        let expected: Vec<(&str, &str, String)> = expected
            .iter()
            .map(|(k, t, r)| (*k, *t, r.to_string()))
            .collect();
        assert_eq!(seen, expected);

        // The graceful shutdown released the directory and left every result durable:
        // a new engine opens it and finds the four roots finished, nothing to carry on.
        let again = Executor::builder()
            .registry(registry())
            .env(Cluster::default())
            .store(WalStore::open(dir.path()).unwrap())
            .start()
            .await
            .unwrap();
        assert_eq!(again.recovery().finished_roots, 4);
        assert!(again.recovery().recovered_roots.is_empty());
        assert_eq!(
            again.state(report.compaction).await.unwrap().state,
            ProcState::RolledBack
        );
        again.shutdown().await.unwrap();
    }
}
