//! Test procedures and helpers shared by the integration tests.
//!
//! [`Scripted`] is a procedure whose steps follow a plan, and which records every
//! `execute` and `rollback` into the [`Recorder`] given to the executor as its
//! environment, so a test can assert the exact order of calls.
#![allow(dead_code)]

pub mod pg;
pub mod seeds;
pub mod wal;

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};

use proctor::{
    async_trait, CancelReason, Context, Executor, Flow, MemoryStore, ProcError, ProcId, Procedure,
    ProcedureStore, Registry, StateContext, StateMachine, StateMachineProcedure, Undo, WalStore,
};
use serde::{Deserialize, Serialize};
use tempfile::TempDir;
use tokio::sync::Notify;

/// What the tests observe: the calls in order, a counter, and gates.
pub struct Recorder {
    calls: Mutex<Vec<String>>,
    /// What each rollback of a `Scripted` was told its step did, in order.
    undos: Mutex<Vec<(String, Undo)>>,
    pub counter: AtomicI64,
    /// Opened by the test; a `Step::Gate` waits for it.
    pub gate: Notify,
    /// Signalled by a `Step::Signal`; the test waits for it.
    pub signal: Notify,
    /// Permits for `Step::GateFail`: each step that passes takes one (they are kept
    /// for a step that has not started waiting yet).
    pub permits: tokio::sync::Semaphore,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            calls: Mutex::default(),
            undos: Mutex::default(),
            counter: AtomicI64::default(),
            gate: Notify::new(),
            signal: Notify::new(),
            permits: tokio::sync::Semaphore::new(0),
        }
    }
}

impl Recorder {
    pub fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }

    pub fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }

    pub fn undos(&self) -> Vec<(String, Undo)> {
        self.undos.lock().unwrap().clone()
    }

    pub fn count(&self, call: &str) -> usize {
        self.calls().iter().filter(|c| *c == call).count()
    }
}

/// One planned step of a [`Scripted`] procedure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Step {
    /// Run another step.
    More,
    /// Start these children and wait for them.
    Children(Vec<Scripted>),
    /// Fail with this message.
    Fail(String),
    /// Panic with this message.
    Panic(String),
    /// Yield.
    Yield,
    /// Wait (inside the step, holding a worker) until the test opens the gate.
    Gate,
    /// Wait for a permit (`Recorder::permits`), then fail with this message.
    GateFail(String),
    /// Tell the test this step ran, then run another step.
    Signal,
    /// Sleep this many ms, then run another step.
    Sleep(u64),
    /// Suspend on the event.
    Suspend(String),
    /// Sleep this many ms for ever (a long-running procedure), signalling once.
    Forever(u64),
    /// Signal, then stay in the step until the engine cancels it; then record why
    /// (`-cancelled` for an abort, `-shutdown`) and fail aborted.
    UntilCancelled,
    /// Signal, then wait (inside the step) until the test opens the gate; then run
    /// another step.
    Hold,
    /// Mark the step as the point of no return, then run another step.
    Irreversible,
}

/// A procedure that follows its plan; when the plan runs out it is done.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Scripted {
    pub name: String,
    pub plan: Vec<Step>,
    pub at: usize,
    /// Go behind the queue after each step.
    pub yield_after: bool,
}

impl Scripted {
    pub fn new(name: &str, plan: Vec<Step>) -> Self {
        Scripted {
            name: name.to_string(),
            plan,
            at: 0,
            yield_after: false,
        }
    }
}

#[async_trait]
impl Procedure<Recorder> for Scripted {
    async fn execute(&mut self, ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        let rec = ctx.env_arc().clone();
        rec.record(format!("{}-exec", self.name));
        let Some(step) = self.plan.get(self.at).cloned() else {
            return Ok(Flow::Done);
        };
        if !matches!(step, Step::Yield | Step::Forever(_)) {
            self.at += 1;
        }
        let more = |at: usize, plan: &[Step]| {
            if at < plan.len() {
                Flow::MoreToDo
            } else {
                Flow::Done
            }
        };
        Ok(match step {
            Step::More => more(self.at, &self.plan),
            Step::Children(children) => {
                Flow::Children(children.into_iter().map(|c| Box::new(c) as _).collect())
            }
            Step::Fail(msg) => return Err(ProcError::failed(msg)),
            Step::Panic(msg) => panic!("{msg}"),
            Step::Yield => {
                // Yield `n` times: the plan holds one Yield entry per yield.
                self.plan.remove(self.at);
                Flow::Yield
            }
            Step::Gate => {
                rec.gate.notified().await;
                more(self.at, &self.plan)
            }
            Step::GateFail(msg) => {
                rec.permits.acquire().await.expect("open").forget();
                return Err(ProcError::failed(msg));
            }
            Step::Signal => {
                rec.signal.notify_one();
                more(self.at, &self.plan)
            }
            Step::Sleep(ms) => Flow::SleepUntil(ctx.now_ms() + ms),
            Step::Suspend(event) => Flow::Suspend(event),
            Step::Forever(ms) => {
                if rec.count(&format!("{}-exec", self.name)) == 1 {
                    rec.signal.notify_one();
                }
                Flow::SleepUntil(ctx.now_ms() + ms)
            }
            Step::Irreversible => {
                ctx.set_irreversible();
                more(self.at, &self.plan)
            }
            Step::Hold => {
                rec.signal.notify_one();
                rec.gate.notified().await;
                more(self.at, &self.plan)
            }
            Step::UntilCancelled => {
                rec.signal.notify_one();
                ctx.cancelled().await;
                let how = match ctx.cancel_reason() {
                    Some(CancelReason::Shutdown) => "shutdown",
                    _ => "cancelled",
                };
                rec.record(format!("{}-{how}", self.name));
                return Err(ProcError::Aborted);
            }
        })
    }

    async fn rollback(&mut self, ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        ctx.env().record(format!("{}-rollback", self.name));
        let undo = (self.name.clone(), ctx.undoing());
        ctx.env().undos.lock().unwrap().push(undo);
        Ok(())
    }

    fn is_yield_after_execution(&self) -> bool {
        self.yield_after
    }
}

/// A one-step procedure that needs no environment, so it runs in an executor of any
/// environment type.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Noop;

#[async_trait]
impl<E: Send + Sync + 'static> Procedure<E> for Noop {
    async fn execute(&mut self, _: &mut Context<E>) -> Result<Flow<E>, ProcError> {
        Ok(Flow::Done)
    }
    async fn rollback(&mut self, _: &mut Context<E>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// The state machine of the issue: four states adding 3, 5, 7 and 11 to a counter,
/// optionally failing in one state after adding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AddState {
    One,
    Two,
    Three,
    Four,
}

impl AddState {
    pub fn amount(self) -> i64 {
        match self {
            AddState::One => 3,
            AddState::Two => 5,
            AddState::Three => 7,
            AddState::Four => 11,
        }
    }
}

#[derive(Serialize, Deserialize)]
pub struct Adder {
    pub fail_in: Option<AddState>,
}

#[async_trait]
impl StateMachineProcedure<Recorder> for Adder {
    type State = AddState;

    fn initial_state(&self) -> AddState {
        AddState::One
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, AddState, Recorder>,
        state: AddState,
    ) -> Result<Flow<Recorder>, ProcError> {
        let rec = ctx.env();
        rec.counter.fetch_add(state.amount(), Ordering::SeqCst);
        rec.record(format!("exec {state:?}"));
        if self.fail_in == Some(state) {
            return Err(ProcError::failed(format!("{state:?} failed")));
        }
        let next = match state {
            AddState::One => AddState::Two,
            AddState::Two => AddState::Three,
            AddState::Three => AddState::Four,
            AddState::Four => return Ok(Flow::Done),
        };
        ctx.set_next_state(next);
        Ok(Flow::MoreToDo)
    }

    async fn rollback_state(
        &mut self,
        ctx: &mut Context<Recorder>,
        state: AddState,
    ) -> Result<(), ProcError> {
        let rec = ctx.env();
        rec.counter.fetch_sub(state.amount(), Ordering::SeqCst);
        rec.record(format!("rollback {state:?}"));
        Ok(())
    }
}

pub fn registry() -> Registry<Recorder> {
    let mut registry = Registry::default();
    registry
        .register::<Scripted>("scripted")
        .register::<StateMachine<Adder, Recorder>>("adder")
        .register::<Unwind>("unwind");
    registry
}

/// A tree that rolls back and holds in the middle of it: the root runs two steps, the
/// second starting a child that runs two steps and fails; each call is recorded as
/// `exec ID` or `rollback ID`, and the root's second rollback call signals
/// `rec.signal` and waits at `rec.gate`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Unwind {
    pub child: bool,
    pub step: u32,
}

impl Unwind {
    pub fn root() -> Self {
        Unwind {
            child: false,
            step: 0,
        }
    }
}

#[async_trait]
impl Procedure<Recorder> for Unwind {
    async fn execute(&mut self, ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        self.step += 1;
        ctx.env().record(format!("exec {}", ctx.id()));
        match (self.child, self.step) {
            (_, 1) => Ok(Flow::MoreToDo),
            (false, _) => Ok(Flow::Children(vec![Box::new(Unwind {
                child: true,
                step: 0,
            })])),
            (true, _) => Err(ProcError::failed("the child fails")),
        }
    }

    async fn rollback(&mut self, ctx: &mut Context<Recorder>) -> Result<(), ProcError> {
        let call = format!("rollback {}", ctx.id());
        let rec = ctx.env_arc().clone();
        rec.record(call.clone());
        if !self.child && rec.count(&call) == 2 {
            rec.signal.notify_one();
            rec.gate.notified().await;
        }
        Ok(())
    }
}

/// The ids named in the recorder's calls that start with `prefix`, in order.
pub fn recorded(rec: &Recorder, prefix: &str) -> Vec<u64> {
    rec.calls()
        .iter()
        .filter_map(|c| c.strip_prefix(prefix)?.parse().ok())
        .collect()
}

/// The stores every scenario runs on: (name, store, the directory to keep alive).
pub fn stores() -> Vec<(&'static str, Box<dyn ProcedureStore>, Option<TempDir>)> {
    let dir = tempfile::tempdir().expect("temp dir");
    let wal = WalStore::open(dir.path()).expect("open WAL");
    vec![
        ("memory", Box::new(MemoryStore::new()), None),
        ("wal", Box::new(wal), Some(dir)),
        ("pg", Box::new(pg::store()), None),
    ]
}

/// The stores every scenario runs on, by name (see [`Reopen`]).
pub const STORES: [&str; 3] = ["memory", "wal", "pg"];

/// An executor on `store` with a fresh recorder.
pub async fn start(
    store: Box<dyn ProcedureStore>,
    workers: usize,
) -> (Executor<Recorder>, Arc<Recorder>) {
    let rec = Arc::new(Recorder::default());
    // Two shards whatever the machine (as many as the workers allow): each takes half
    // of the workers, and a tree's steps run on its shard's half.
    let executor = Executor::builder()
        .registry(registry())
        .store(store)
        .workers(workers)
        .arbiters(2)
        .env(rec.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, rec)
}

/// Submits a procedure `name` whose one step waits at `rec.gate`, and returns once that
/// step runs (holding a worker until `rec.gate` is notified).
pub async fn start_gated(executor: &Executor<Recorder>, rec: &Recorder, name: &str) -> ProcId {
    let id = executor
        .submit(Scripted::new(name, vec![Step::Gate]))
        .await
        .expect("submit");
    while rec.count(&format!("{name}-exec")) == 0 {
        tokio::task::yield_now().await;
    }
    id
}

/// Submits and waits for the result.
pub async fn run(
    executor: &Executor<Recorder>,
    proc: impl Procedure<Recorder>,
) -> (ProcId, Result<(), proctor::Failure>) {
    let id = executor.submit(proc).await.expect("submit");
    let result = executor.wait(id).await.expect("wait");
    (id, result)
}

/// A store that, at one chosen append (1-based), tells the test it has been reached and
/// holds the append until the test releases it: the window in which a record is on its
/// way to disk but not durable yet.
pub struct GatedStore<S> {
    pub inner: S,
    appends: usize,
    gate_at: usize,
    reached: tokio::sync::mpsc::UnboundedSender<()>,
    release: std::sync::mpsc::Receiver<()>,
}

/// The test's side of a [`GatedStore`].
pub struct Gate {
    reached: tokio::sync::mpsc::UnboundedReceiver<()>,
    release: std::sync::mpsc::Sender<()>,
}

impl<S: ProcedureStore> GatedStore<S> {
    pub fn new(inner: S, gate_at: usize) -> (Self, Gate) {
        let (reached_tx, reached_rx) = tokio::sync::mpsc::unbounded_channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel();
        let store = GatedStore {
            inner,
            appends: 0,
            gate_at,
            reached: reached_tx,
            release: release_rx,
        };
        let gate = Gate {
            reached: reached_rx,
            release: release_tx,
        };
        (store, gate)
    }
}

impl Gate {
    /// Waits until the gated append has started.
    pub async fn reached(&mut self) {
        self.reached.recv().await.expect("store alive");
    }

    /// Lets the gated append go on.
    pub fn release(&self) {
        let _ = self.release.send(());
    }
}

impl<S: ProcedureStore> ProcedureStore for GatedStore<S> {
    fn append(&mut self, ops: &[proctor::store::StoreOp]) -> Result<(), proctor::StoreError> {
        self.appends += 1;
        if self.appends == self.gate_at {
            let _ = self.reached.send(());
            let _ = self.release.recv();
        }
        self.inner.append(ops)
    }

    fn load(&mut self) -> Result<proctor::store::StoreSnapshot, proctor::StoreError> {
        self.inner.load()
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), proctor::StoreError> {
        self.inner.mark_drained(cut_off)
    }

    fn mark_running(&mut self) -> Result<(), proctor::StoreError> {
        self.inner.mark_running()
    }
}

/// Waits until the executor reports `state` for `id` (it polls: the state is what the
/// test observes from outside, as a user would).
pub async fn wait_for_state<E: Send + Sync + 'static>(
    executor: &Executor<E>,
    id: ProcId,
    state: proctor::ProcState,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        if executor.state(id).await.map(|i| i.state).ok() == Some(state) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "procedure {id} never reached {state}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// Waits until `n` children of `root` are WAITING (suspended, sleeping, or waiting for
/// their own children) and returns their ids (it polls, as `wait_for_state` does).
pub async fn waiting_children<E: Send + Sync + 'static>(
    executor: &Executor<E>,
    root: ProcId,
    n: usize,
) -> Vec<ProcId> {
    let which = proctor::List::new()
        .root(root)
        .state(proctor::ProcState::Waiting);
    loop {
        let list = executor.list(which.clone()).await.expect("list");
        let children: Vec<ProcId> = list
            .iter()
            .filter(|p| p.parent == Some(root))
            .map(|p| p.id)
            .collect();
        if children.len() == n {
            return children;
        }
        tokio::task::yield_now().await;
    }
}

/// One store, opened again for each engine of a test: the same `MemoryStore`, or a new
/// `WalStore` on the same directory.
pub struct Reopen {
    name: &'static str,
    dir: tempfile::TempDir,
    memory: MemoryStore,
    /// The PostgreSQL store's schema.
    schema: String,
}

impl Reopen {
    /// The WAL's directory (unused by the memory store).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    pub fn new(name: &'static str) -> Self {
        Reopen {
            name,
            dir: tempfile::tempdir().unwrap(),
            memory: MemoryStore::new(),
            schema: pg::fresh_schema(),
        }
    }

    pub fn open(&self) -> Box<dyn ProcedureStore> {
        match self.name {
            "memory" => Box::new(self.memory.clone()),
            "pg" => Box::new(pg::store_in(&self.schema)),
            _ => Box::new(WalStore::open(self.dir.path()).unwrap()),
        }
    }
}
