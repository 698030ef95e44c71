//! Quickstart: a create-table procedure written as a state machine, with one child
//! procedure per region. Run it with
//!
//! ```sh
//! cargo run --release --example quickstart
//! ```
//!
//! It prints each state the procedure passes through and ends with SUCCESS. The
//! "cluster" is a map in memory that stands in for the service that embeds proctor.
//! The steps do not write to stdout themselves: they hand their lines to a thread
//! that does, so a reader that goes away (`| head -3`) ends the output, not the
//! procedure (a `println!` in a step would panic on the closed pipe, and fail it).
//! With `RUST_LOG=info` the engine's log goes to stderr: a line per submitted root and
//! per finished procedure (id, type, outcome, duration), and the `[procedure N]` lines'
//! spans (`RUST_LOG=info,proctor=debug` shows more).

// This package compiles proctor's sources as a library of its own (its `Cargo.toml`
// says why); in a service that depends on `proctor-engine`, the library is `proctor`.
extern crate proctor_quickstart as proctor;

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::sync::{mpsc, Mutex};
use std::thread::JoinHandle;

use proctor::{
    async_trait, ChildType, Context, Executor, Flow, MemoryStore, ProcError, ProcId, Procedure,
    Registry, StateContext, StateMachine, StateMachineProcedure,
};
use serde::{Deserialize, Serialize};

/// What the procedures act on: table name → the table; and where they say what they
/// do.
struct Cluster {
    tables: Mutex<BTreeMap<String, Table>>,
    out: Output,
}

/// A table: the procedure that created it, written in the same change that creates
/// it (so that a rollback drops only a table its procedure created), and the regions
/// assigned so far.
struct Table {
    owner: ProcId,
    regions: Vec<String>,
}

/// The program's output: lines handed to the thread that writes them.
#[derive(Clone)]
struct Output(mpsc::Sender<Option<String>>);

impl Output {
    /// Writes `line` (on the output's thread). Never fails: once the reader has gone,
    /// lines are dropped.
    fn say(&self, line: String) {
        let _ = self.0.send(Some(line));
    }

    /// Ends the output: the thread writes what it was given, then returns.
    fn end(self, writer: JoinHandle<()>) {
        let _ = self.0.send(None);
        let _ = writer.join();
    }
}

/// Starts the thread that writes the lines to `out`, a line at a time; it stops
/// writing at the first error (the reader went away).
fn output(mut out: impl Write + Send + 'static) -> (Output, JoinHandle<()>) {
    let (lines, to_write) = mpsc::channel::<Option<String>>();
    let writer = std::thread::spawn(move || {
        while let Ok(Some(line)) = to_write.recv() {
            if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
                break;
            }
        }
    });
    (Output(lines), writer)
}

/// The states of creating a table, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum CreateTableState {
    Prepare,
    WriteMeta,
    AssignRegions,
    Enable,
}

/// The procedure's own state: everything it needs to resume after a crash.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    table: String,
    regions: u32,
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
        ctx: &mut StateContext<'_, CreateTableState, Cluster>,
        state: CreateTableState,
    ) -> Result<Flow<Cluster>, ProcError> {
        let cluster = ctx.env();
        cluster
            .out
            .say(format!("[procedure {}] {state:?}", ctx.id()));
        match state {
            CreateTableState::Prepare => {
                if cluster.tables.lock().unwrap().contains_key(&self.table) {
                    return Err(ProcError::failed(format!("table {} exists", self.table)));
                }
                ctx.set_next_state(CreateTableState::WriteMeta);
                Ok(Flow::MoreToDo)
            }
            CreateTableState::WriteMeta => {
                let me = ctx.id();
                {
                    let mut tables = cluster.tables.lock().unwrap();
                    match tables.get(&self.table) {
                        // Idempotent: re-running after a crash finds its own table.
                        Some(table) if table.owner == me => {}
                        // Created by someone else since `Prepare` looked.
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
                let children = (0..self.regions).map(|r| AssignRegion {
                    table: self.table.clone(),
                    region: format!("{}-r{r}", self.table),
                });
                // The parent now WAITs, holding no worker, until every child finishes.
                Ok(Flow::children(children))
            }
            CreateTableState::Enable => Ok(Flow::Done),
        }
    }

    async fn rollback_state(
        &mut self,
        ctx: &mut Context<Cluster>,
        state: CreateTableState,
    ) -> Result<(), ProcError> {
        ctx.env()
            .out
            .say(format!("[procedure {}] rollback {state:?}", ctx.id()));
        if state == CreateTableState::WriteMeta {
            // Only a table this procedure created: the step may have found someone
            // else's (`ctx.undoing()` says how far the step got, not whose it is).
            let mut tables = ctx.env().tables.lock().unwrap();
            if tables.get(&self.table).is_some_and(|t| t.owner == ctx.id()) {
                tables.remove(&self.table);
            }
        }
        Ok(())
    }
}

/// A child: assign one region of the table (a single step).
#[derive(Serialize, Deserialize)]
struct AssignRegion {
    table: String,
    region: String,
}

#[async_trait]
impl Procedure<Cluster> for AssignRegion {
    async fn execute(&mut self, ctx: &mut Context<Cluster>) -> Result<Flow<Cluster>, ProcError> {
        let cluster = ctx.env();
        cluster.out.say(format!(
            "[procedure {} child of {}] assign region {}",
            ctx.id(),
            ctx.parent().map_or("-".to_string(), |p| p.to_string()),
            self.region
        ));
        let mut tables = cluster.tables.lock().unwrap();
        let Some(table) = tables.get_mut(&self.table) else {
            return Err(ProcError::failed(format!("table {} is gone", self.table)));
        };
        if !table.regions.contains(&self.region) {
            table.regions.push(self.region.clone());
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, ctx: &mut Context<Cluster>) -> Result<(), ProcError> {
        let cluster = ctx.env();
        if let Some(table) = cluster.tables.lock().unwrap().get_mut(&self.table) {
            table.regions.retain(|r| r != &self.region);
        }
        Ok(())
    }
}

#[actix::main]
async fn main() -> std::process::ExitCode {
    // The engine logs through `tracing`; this shows it on stderr as `RUST_LOG` says
    // (nothing but errors when it is unset), leaving stdout to the program.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    // An error is shown by what it says (its `Display`), as `main`'s `Result` would
    // show its `Debug` form: `Locked { file: .. }` rather than what to do about it.
    match run(std::io::stdout()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("quickstart: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Creates the table, writing what happens to `out` (the package's test gives it an
/// output that closes early).
pub(crate) async fn run(
    out: impl Write + Send + 'static,
) -> Result<(), Box<dyn std::error::Error>> {
    let (out, writer) = output(out);
    // Every type that can be persisted is registered under a name that never changes.
    let mut registry = Registry::new();
    registry
        .register_state_machine::<CreateTable>("create_table")
        .register::<AssignRegion>("assign_region");

    let executor = Executor::builder()
        .registry(registry)
        .store(MemoryStore::new())
        .env(Cluster {
            tables: Mutex::default(),
            out: out.clone(),
        })
        .start()
        .await?;

    let id = executor
        .submit(StateMachine::new(CreateTable {
            table: "users".into(),
            regions: 2,
        }))
        .await?;
    out.say(format!("submitted create_table as procedure {id}"));

    let result = executor.wait(id).await?;
    let info = executor.state(id).await?;
    executor.shutdown().await?;
    let ended = match result {
        Ok(()) => {
            out.say(format!("procedure {id} finished: {}", info.state));
            Ok(())
        }
        Err(failure) => Err(format!("procedure {id} ended {}: {failure}", info.state).into()),
    };
    out.end(writer);
    ended
}
