//! Seeded randomized runs of the whole engine against a history checker.
//!
//! Each seed builds a random workload — trees of procedures with children, failing
//! steps (some retried by a `RetryThenRollback` policy, some of those getting past the
//! failure on a retry), yields, roots holding a lock through the user hooks, procedures
//! (roots and children) declaring engine locks on a small resource hierarchy and a
//! counted resource (1 or 2 permits), per step or for life, some roots of a system type
//! (their steps first, on system workers when the seed gives the executor one), time
//! limits of a few ms on some procedures (a timeout fails the tree wherever the
//! procedure is: in a step, queued, waiting for locks or children, paused), operator
//! aborts at random moments, sometimes a crash through a failing store and a restart,
//! or (in a third of the seeds without one) a graceful shutdown mid-run and a restart
//! after the drained stop (checked as strictly as a run without a restart, but for the
//! user's lock hooks, whose holds end with the stopped process) —
//! and runs it with the actor layer's perturbation points on (`proctor::perturb`), so
//! rare interleavings happen often. Everything observable goes into one history: step
//! and rollback calls, hook lock grants and releases, which procedure is inside which
//! engine locks (entered at the start of a call, left before the call that ends the
//! hold returns), cleanups, records as they become durable, states the executor
//! reports, abort and pause answers, continues and results. [`check`] then asserts the
//! engine's promises on it:
//!
//! - a failed tree's result is the first failure its log made durable;
//! - without a crash, rollbacks are exactly the recorded steps of the procedures that
//!   must roll back, newest first;
//! - the effects ledger ends with every effect of a successful tree and none of a
//!   rolled-back one (even across a crash);
//! - a lock is held by one procedure at a time, around every call of its holder, and
//!   released exactly once per grant (without a crash);
//! - engine locks: two procedures that are not ancestor and descendant of each other are
//!   never inside conflicting locks at once, nor more lines of descent than its permits
//!   inside the counted resource, before or after a restart (a life-long
//!   holder stays inside across it: recovery grants its locks back before anything
//!   runs); every tree ends SUCCESS or ROLLEDBACK, with its own failure, an abort, a
//!   timeout or a deadlock (`deadlock: ...`) as the reason;
//! - completion cleanup runs at most once per procedure (exactly once without a crash)
//!   and before its tree's result is visible;
//! - the executor never reports a state before it is durable, and an abort answered
//!   `Ok(true)` ends in ROLLEDBACK;
//! - operators pause random live procedures and continue them a little later: a pause
//!   is answered only once PAUSED is durable, and a durably PAUSED procedure runs no
//!   step until an operator continues it (across a crash too);
//! - some trees mark a step their point of no return (one of them may hold engine locks
//!   for life): once that mark is durable before any failure, the tree never rolls
//!   back; an operator continues whatever a failure paused past it, and a deadlock
//!   there is broken by a loan from a tree that rolls back (see `gen_plan`).
//!
//! CI runs `PROCTOR_SEEDS` seeds (default 24). A failure prints its seed; replay it with
//! `PROCTOR_SEED=<seed> cargo test --test perturbation`. A longer search:
//! `PROCTOR_PERTURB_SECS=600 cargo test --release --test perturbation -- --nocapture`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
mod common;

use std::time::Duration;

use proctor::store::{StoreOp, StoreSnapshot};
use proctor::testing::{CrashPoint, CrashingStore};
use proctor::{
    async_trait, perturb, Context, Error, Executor, Failure, FailurePolicy, Flow, Lock, LockMode,
    LockState, MemoryStore, ProcError, ProcId, ProcState, Procedure, ProcedureStore, Registry,
    StoreError, WalStore,
};
use serde::{Deserialize, Serialize};

/// One observable event.
#[derive(Clone, Debug)]
enum Ev {
    Exec {
        id: ProcId,
        name: String,
        /// The step failed (its policy may retry it: then it is not recorded).
        failed: bool,
    },
    Rollback {
        id: ProcId,
        unrecorded: bool,
    },
    Lock {
        name: String,
        resource: u32,
    },
    Unlock {
        name: String,
        resource: u32,
    },
    Cleanup {
        name: String,
    },
    /// A call of `name` runs inside its engine locks (the engine granted them): at the
    /// start of every step and rollback. Again while already inside is harmless.
    Enter {
        id: ProcId,
        name: String,
        locks: Vec<Lock>,
        /// Held for the procedure's life.
        life: bool,
        /// `execute`, or `rollback`.
        call: &'static str,
    },
    /// `name` is no longer inside its engine locks: logged before the call returns that
    /// ends its hold (every call for a per-step holder; for a life-long one its last
    /// step, returning Done, or its last rollback), so before the engine can hand them on.
    Leave {
        id: ProcId,
        name: String,
    },
    /// A life-long holder's call ended; it stays inside its locks.
    Pause {
        id: ProcId,
        name: String,
    },
    /// A record that the store made durable: (procedure, root, state, stack indexes,
    /// failure), or a delete.
    Durable {
        id: ProcId,
        root: ProcId,
        state: ProcState,
        stack: Vec<u32>,
        failure: Option<Failure>,
        /// A recorded step of it marked the tree's point of no return.
        irreversible: bool,
    },
    Observed {
        id: ProcId,
        state: ProcState,
    },
    AbortAnswer {
        id: ProcId,
        answer: Result<bool, String>,
    },
    /// An operator's pause of `id` was answered `Ok`: it is durably PAUSED.
    Paused {
        id: ProcId,
    },
    /// An operator is about to continue `id` (logged before the call).
    Continued {
        id: ProcId,
    },
    Result {
        root: ProcId,
        result: Result<(), Failure>,
    },
    Violation(String),
    /// The lock table lent `lender`'s locks to `borrower` (its WARN event, logged before
    /// the grant goes out): a deadlock no failure breaks.
    Loan {
        borrower: ProcId,
        lender: ProcId,
        /// Some waiter of the cycle is a step past a point of no return (not only
        /// rollbacks).
        past_ponr: bool,
    },
    /// The engine is being stopped at once (`shutdown_now`): its arbiters stop one by
    /// one, dropping the calls in flight on each, so a call that entered may never
    /// leave; a dropped tree's scheduler has the lock actor free its step locks, and a call of a tree on
    /// an arbiter not yet stopped may start under them meanwhile (and be dropped in
    /// turn).
    Stopping,
    /// The engine was cut off (store crash) and a new one started.
    Restart,
}

#[derive(Default)]
struct World {
    history: Mutex<Vec<Ev>>,
    ledger: Mutex<BTreeSet<String>>,
    locks: Mutex<HashMap<u32, String>>,
    /// Failed attempts so far, by procedure name (for failures that pass).
    failures: Mutex<HashMap<String, u32>>,
}

impl World {
    fn log(&self, ev: Ev) {
        self.history.lock().unwrap().push(ev);
    }
}

/// Completion cleanup gets no context, so it finds the world here.
static WORLD: Mutex<Option<Arc<World>>> = Mutex::new(None);

/// Turns the lock actor's loan events into `Ev::Loan`s of the current seed's history.
struct LoanWitness;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for LoanWitness {
    fn on_event(
        &self,
        event: &tracing::Event<'_>,
        _ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        #[derive(Default)]
        struct Fields {
            message: String,
            borrower: Option<u64>,
            lender: Option<u64>,
            loan: String,
        }
        impl tracing::field::Visit for Fields {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                let text = format!("{value:?}");
                match field.name() {
                    "message" => self.message = text,
                    "proc" => self.borrower = text.parse().ok(),
                    "lender" => self.lender = text.parse().ok(),
                    "loan" => self.loan = text,
                    _ => {}
                }
            }
        }
        let mut fields = Fields::default();
        event.record(&mut fields);
        if !fields.message.starts_with("deadlock no failure can break") {
            return;
        }
        let (Some(borrower), Some(lender)) = (fields.borrower, fields.lender) else {
            panic!("a loan event without its procedures: {}", fields.message);
        };
        if let Some(world) = WORLD.lock().unwrap().as_ref() {
            world.log(Ev::Loan {
                borrower: ProcId(borrower),
                lender: ProcId(lender),
                past_ponr: fields
                    .loan
                    .starts_with("deadlock past a point of no return"),
            });
        }
    }
}

/// Installs the witness once, for the lock actor's WARN events only (no span of the
/// engine is enabled by it, so the runs pay nothing for it).
fn witness_loans() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::Layer;
    let only_loans = tracing_subscriber::filter::filter_fn(|m| {
        m.is_event()
            && *m.level() == tracing::Level::WARN
            && m.target().starts_with("proctor::locks")
    });
    let subscriber = tracing_subscriber::registry().with(LoanWitness.with_filter(only_loans));
    let _ = tracing::subscriber::set_global_default(subscriber);
}

/// The engine the current seed runs on, for the report of a hang.
static EXECUTOR: Mutex<Option<Executor<World>>> = Mutex::new(None);

/// What a hung run leaves: its unfinished procedures and every lock held or waited for
/// (a lost release or wake-up shows here), then the last events.
async fn hang_report() -> String {
    let mut out = String::new();
    let executor = EXECUTOR.lock().unwrap().clone();
    if let Some(executor) = executor {
        let list = tokio::time::timeout(
            Duration::from_secs(5),
            executor.list(proctor::List::new().with_finished()),
        )
        .await;
        if let Ok(Ok(stats)) =
            tokio::time::timeout(Duration::from_secs(5), executor.scheduler_stats()).await
        {
            out += &format!("the scheduler: {stats:?}\n");
        }
        if let Ok(Ok(list)) = list {
            for i in list {
                if !i.state.is_finished() || !i.locks_held.is_empty() {
                    out += &format!(
                        "  {} (parent {:?}, tree {}) {}: holds {:?}, waits for {:?}\n",
                        i.id, i.parent, i.root, i.state, i.locks_held, i.locks_waiting
                    );
                }
            }
        }
    }
    out += "the last events (without the observer's):\n";
    if let Some(world) = WORLD.lock().unwrap().as_ref() {
        out += &last_events(&world.history.lock().unwrap(), 60);
    }
    out
}

fn world_of(ctx: &Context<World>) -> Arc<World> {
    ctx.env_arc().clone()
}

/// A procedure generated from the seed. Its effects go into the ledger under
/// `name#step`; rolling back its children step removes its descendants' effects (the
/// parent's rollback undoes what it caused).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Traced {
    name: String,
    steps: u32,
    at: u32,
    fail_at: Option<u32>,
    children_at: Option<u32>,
    children: Vec<Traced>,
    /// A lock through the user hooks (`acquire_lock`/`release_lock`).
    lock: Option<u32>,
    /// The engine locks it declares (`locks()`).
    engine_locks: Vec<Lock>,
    /// `holds_lock()`: both kinds of lock are held for the procedure's life.
    hold: bool,
    yields: u32,
    /// Its time limit (`timeout_ms()`): past it, it fails with `TimedOut` wherever it
    /// is (queued, waiting for locks or children, paused, inside a step).
    #[serde(default)]
    timeout_ms: Option<u64>,
    /// Its failed step is retried this many times (`RetryThenRollback`) before the
    /// tree rolls back.
    #[serde(default)]
    retries: u32,
    /// Step `fail_at` fails this many times, then succeeds (a retry gets past it);
    /// `None`: every time.
    #[serde(default)]
    fail_times: Option<u32>,
    /// Starts its children with `Flow::WaitAny`: woken as each succeeds, it records a
    /// step that changes nothing (`waits` counts them) until all have.
    #[serde(default)]
    spawn: bool,
    #[serde(default)]
    waits: u32,
    /// This step marks the tree's point of no return (`Context::set_irreversible`):
    /// once it is recorded, a failure anywhere in the tree pauses the failing
    /// procedure (an operator continues it) and the tree never rolls back.
    #[serde(default)]
    irreversible_at: Option<u32>,
}

impl Traced {
    fn check_lock(&self, world: &World, what: &str) {
        if let Some(r) = self.lock {
            let holder = world.locks.lock().unwrap().get(&r).cloned();
            if holder.as_deref() != Some(&self.name) {
                world.log(Ev::Violation(format!(
                    "{} runs {what} without lock {r} (held by {holder:?})",
                    self.name
                )));
            }
        }
    }

    /// The start of a call: inside the engine locks from here.
    fn enter(&self, world: &World, ctx: &Context<World>, call: &'static str) {
        if !self.engine_locks.is_empty() {
            world.log(Ev::Enter {
                id: ctx.id(),
                name: self.name.clone(),
                locks: self.engine_locks.clone(),
                life: self.hold,
                call,
            });
        }
    }

    /// Before the call that ends the hold returns.
    fn leave(&self, world: &World, ctx: &Context<World>) {
        if !self.engine_locks.is_empty() {
            world.log(Ev::Leave {
                id: ctx.id(),
                name: self.name.clone(),
            });
        }
    }

    /// Before a call of a life-long holder that keeps its locks returns.
    fn pause(&self, world: &World, ctx: &Context<World>) {
        if !self.engine_locks.is_empty() {
            world.log(Ev::Pause {
                id: ctx.id(),
                name: self.name.clone(),
            });
        }
    }

    /// Inside its engine locks, gives any conflicting call the chance to run now, if the
    /// engine let it in.
    async fn linger(&self) {
        if !self.engine_locks.is_empty() {
            for _ in 0..2 {
                tokio::task::yield_now().await;
            }
        }
    }

    fn undo(&self, world: &World, step: u32) {
        let mut ledger = world.ledger.lock().unwrap();
        ledger.remove(&format!("{}#{step}", self.name));
        if self.children_at == Some(step) {
            let prefix = format!("{}.", self.name);
            ledger.retain(|k| !k.starts_with(&prefix));
        }
    }

    /// Every effect a successful run of this procedure leaves.
    fn all_effects(&self, out: &mut BTreeSet<String>) {
        for step in 1..=self.steps {
            out.insert(format!("{}#{step}", self.name));
        }
        for c in &self.children {
            c.all_effects(out);
        }
    }
}

#[async_trait]
impl Procedure<World> for Traced {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        let world = world_of(ctx);
        self.enter(&world, ctx, "execute");
        self.linger().await;
        if self.yields > 0 {
            self.yields -= 1;
            // Yields come before any recorded step, so a life-long holder that is
            // aborted now gets no rollback to leave at: it is inside for this call only.
            self.leave(&world, ctx);
            return Ok(Flow::Yield);
        }
        self.check_lock(&world, "a step");
        let waiting = self.spawn
            && self.children_at == Some(self.at)
            && ctx
                .children()
                .iter()
                .any(|(_, state)| *state != ProcState::Success);
        if waiting {
            // Woken for a child while others run: a recorded step with no effect.
            self.waits += 1;
            world.log(Ev::Exec {
                id: ctx.id(),
                name: self.name.clone(),
                failed: false,
            });
            if self.hold {
                self.pause(&world, ctx);
            } else {
                self.leave(&world, ctx);
            }
            return Ok(Flow::WaitAny(Vec::new()));
        }
        self.at += 1;
        let fails = self.fail_at == Some(self.at) && {
            let mut failures = world.failures.lock().unwrap();
            let failed = failures.entry(self.name.clone()).or_default();
            *failed += 1;
            self.fail_times.is_none_or(|times| *failed <= times)
        };
        world.log(Ev::Exec {
            id: ctx.id(),
            name: self.name.clone(),
            failed: fails,
        });
        world
            .ledger
            .lock()
            .unwrap()
            .insert(format!("{}#{}", self.name, self.at));
        if self.irreversible_at == Some(self.at) && !fails {
            ctx.set_irreversible();
        }
        let flow = if fails {
            Err(ProcError::failed(format!("{} failed", self.name)))
        } else if self.children_at == Some(self.at) {
            let children = self
                .children
                .iter()
                .map(|c| Box::new(c.clone()) as Box<dyn Procedure<World>>)
                .collect();
            if self.spawn {
                Ok(Flow::WaitAny(children))
            } else {
                Ok(Flow::Children(children))
            }
        } else if self.at < self.steps {
            Ok(Flow::MoreToDo)
        } else {
            Ok(Flow::Done)
        };
        // A life-long holder keeps its locks through a failed step into its rollback.
        if !self.hold || matches!(flow, Ok(Flow::Done)) {
            self.leave(&world, ctx);
        } else {
            self.pause(&world, ctx);
        }
        flow
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        let world = world_of(ctx);
        self.enter(&world, ctx, "rollback");
        self.linger().await;
        self.check_lock(&world, "a rollback");
        let unrecorded = ctx.is_unrecorded_step();
        world.log(Ev::Rollback {
            id: ctx.id(),
            unrecorded,
        });
        if unrecorded {
            self.undo(&world, self.at + 1);
        } else if self.children_at == Some(self.at) && self.waits > 0 {
            // The steps it recorded while its children ran come after the one that
            // started them, and changed nothing.
            self.waits -= 1;
        } else {
            self.undo(&world, self.at);
            self.at -= 1;
        }
        // A life-long holder's last rollback undoes its first step.
        if !self.hold || self.at == 0 {
            self.leave(&world, ctx);
        } else {
            self.pause(&world, ctx);
        }
        Ok(())
    }

    fn acquire_lock(&mut self, ctx: &Context<World>) -> LockState {
        let Some(r) = self.lock else {
            return LockState::Acquired;
        };
        let world = world_of(ctx);
        let mut locks = world.locks.lock().unwrap();
        match locks.get(&r) {
            Some(holder) if holder == &self.name => {
                world.log(Ev::Violation(format!("{} takes lock {r} twice", self.name)));
                LockState::Acquired
            }
            Some(_) => LockState::Yield,
            None => {
                locks.insert(r, self.name.clone());
                world.log(Ev::Lock {
                    name: self.name.clone(),
                    resource: r,
                });
                LockState::Acquired
            }
        }
    }

    fn release_lock(&mut self, ctx: &Context<World>) {
        let Some(r) = self.lock else { return };
        let world = world_of(ctx);
        // The release and its event are one step for other threads, as a grant is.
        let mut locks = world.locks.lock().unwrap();
        let holder = locks.remove(&r);
        if holder.as_deref() != Some(&self.name) {
            world.log(Ev::Violation(format!(
                "{} releases lock {r} held by {holder:?}",
                self.name
            )));
        }
        world.log(Ev::Unlock {
            name: self.name.clone(),
            resource: r,
        });
    }

    fn locks(&self) -> Vec<Lock> {
        self.engine_locks.clone()
    }

    fn holds_lock(&self) -> bool {
        self.hold
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.timeout_ms
    }

    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        match self.retries {
            0 => FailurePolicy::Rollback,
            times => FailurePolicy::RetryThenRollback {
                times,
                backoff_ms: 1,
            },
        }
    }

    fn completion_cleanup(&mut self, ctx: &Context<World>) {
        ctx.env().log(Ev::Cleanup {
            name: self.name.clone(),
        });
    }
}

/// A root of a system type (`Registry::register_system`): the same procedure, whose
/// steps go first and may run on the system workers beside the shared ones.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct Urgent(Traced);

#[async_trait]
impl Procedure<World> for Urgent {
    async fn execute(&mut self, ctx: &mut Context<World>) -> Result<Flow<World>, ProcError> {
        self.0.execute(ctx).await
    }

    async fn rollback(&mut self, ctx: &mut Context<World>) -> Result<(), ProcError> {
        self.0.rollback(ctx).await
    }

    fn acquire_lock(&mut self, ctx: &Context<World>) -> LockState {
        self.0.acquire_lock(ctx)
    }

    fn release_lock(&mut self, ctx: &Context<World>) {
        self.0.release_lock(ctx);
    }

    fn locks(&self) -> Vec<Lock> {
        self.0.locks()
    }

    fn holds_lock(&self) -> bool {
        self.0.holds_lock()
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.0.timeout_ms()
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        self.0.failure_policy(error)
    }

    fn completion_cleanup(&mut self, ctx: &Context<World>) {
        self.0.completion_cleanup(ctx);
    }
}

/// Records every op the inner store made durable.
#[derive(Clone)]
struct Recording<S> {
    inner: S,
    world: Arc<World>,
}

impl<S: ProcedureStore> ProcedureStore for Recording<S> {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        self.inner.append(ops)?;
        for op in ops {
            if let StoreOp::Insert(r) | StoreOp::Update(r) = op {
                self.world.log(Ev::Durable {
                    id: r.id,
                    root: r.root,
                    state: r.state,
                    stack: r.stack_indexes.clone(),
                    failure: r.failure.as_deref().cloned(),
                    irreversible: r.steering.irreversible,
                });
            }
        }
        Ok(())
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        self.inner.load()
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        self.inner.mark_drained(cut_off)
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        self.inner.mark_running()
    }
}

/// The workload of one seed.
struct Plan {
    trees: Vec<Traced>,
    workers: usize,
    arbiters: usize,
    wal: bool,
    crash: Option<(usize, CrashPoint)>,
    /// In a seed without a crash, a graceful shutdown after this many yields of the
    /// test, and a restart: the drained stop, after which recovery takes no step as
    /// cut off but those an earlier crash left.
    drain: Option<u32>,
    aborts: usize,
    /// Operators' pauses of random live procedures, each continued a little later.
    pauses: usize,
    /// Which roots are of the system type (by index in `trees`).
    urgent: Vec<bool>,
    /// The executor's system workers.
    system_workers: usize,
    /// How many procedures outside one another's ancestry may hold [`COUNTED`] at once.
    counted_permits: u32,
}

impl Plan {
    /// Steps run one at a time: one shared worker, and no system step beside it.
    fn serial(&self) -> bool {
        self.workers == 1 && (self.system_workers == 0 || !self.urgent.contains(&true))
    }
}

/// The resources engine locks are drawn from: two tables and some of their regions.
const RESOURCES: [&str; 5] = ["t0", "t0/r0", "t0/r1", "t1", "t1/r0"];

/// A counted resource (at most [`Plan::counted_permits`] holders, 1 or 2, a holder under
/// an ancestor that holds it for life not counted), always taken shared, beside other
/// engine locks.
const COUNTED: &str = "srv";

/// One or two engine locks on distinct resources, each shared or exclusive.
fn gen_locks(rng: &mut fastrand::Rng) -> Vec<Lock> {
    let mut resources: Vec<&str> = RESOURCES.to_vec();
    rng.shuffle(&mut resources);
    resources[..rng.usize(1..=2)]
        .iter()
        .map(|r| {
            if rng.bool() {
                Lock::exclusive(*r)
            } else {
                Lock::shared(*r)
            }
        })
        .collect()
}

/// A procedure and its subtree. A tree either takes the hook lock (its root, sometimes)
/// or engine locks (most of its procedures, a half of them for life); an engine tree's
/// root that holds its engine locks one step at a time sometimes takes a hook lock too.
/// Never a hook lock held for life beside engine locks: the engine cannot see a wait
/// for a hook lock, so a cycle through both kinds would hang.
/// Trees with engine locks have children more often, and their roots often take a
/// whole table exclusively: with children locking in the other table, two such trees
/// deadlock (a wait-for cycle always goes through a parent holding for life).
fn gen_proc(rng: &mut fastrand::Rng, name: String, depth: u32, root: bool, engine: bool) -> Traced {
    let mut steps = rng.u32(1..=4);
    let parent = if root && engine {
        rng.bool()
    } else {
        rng.u8(0..3) == 0
    };
    let children_at = (depth < 2 && parent).then(|| rng.u32(1..=steps));
    if let Some(at) = children_at {
        // A parent runs another step once its children are done.
        steps = steps.max(at + 1);
    }
    let children = match children_at {
        Some(_) => (0..rng.usize(1..=3))
            .map(|i| gen_proc(rng, format!("{name}.{i}"), depth + 1, false, engine))
            .collect(),
        None => Vec::new(),
    };
    let fail_at = (rng.u8(0..6) == 0).then(|| rng.u32(1..=steps));
    let lock = (!engine && root && rng.bool()).then(|| rng.u32(0..3));
    let mut engine_locks = if !engine || rng.u8(0..3) == 0 {
        Vec::new()
    } else if root && rng.bool() {
        vec![Lock::exclusive(format!("t{}", rng.u8(0..2)))]
    } else {
        gen_locks(rng)
    };
    let hold = (lock.is_some() || !engine_locks.is_empty()) && rng.bool();
    let yields = if rng.u8(0..4) == 0 { rng.u32(1..3) } else { 0 };
    // Sometimes both kinds, one step at a time: the hook lock is taken only once the
    // engine's are granted, and a busy one yields (a rollback's is retried) giving
    // them back, so no wait is ever held across the two.
    let lock = match lock {
        None if root && !hold && !engine_locks.is_empty() && rng.u8(0..3) == 0 => {
            Some(rng.u32(0..3))
        }
        lock => lock,
    };
    // Drawn last, so the rest of a seed's plan is what it was before timeouts.
    let timeout_ms = (rng.u8(0..8) == 0).then(|| rng.u64(1..60));
    let retries = if fail_at.is_some() && rng.bool() {
        rng.u32(1..4)
    } else {
        0
    };
    let fail_times = (retries > 0 && rng.bool()).then(|| rng.u32(1..=retries));
    let spawn = children_at.is_some() && rng.bool();
    if !engine_locks.is_empty() && rng.u8(0..4) == 0 {
        engine_locks.push(Lock::shared(COUNTED));
    }
    Traced {
        name,
        steps,
        at: 0,
        fail_at,
        children_at,
        children,
        lock,
        engine_locks,
        hold,
        yields,
        timeout_ms,
        retries,
        fail_times,
        spawn,
        waits: 0,
        irreversible_at: None,
    }
}

/// Makes a step of one procedure of `tree` its point of no return. Past it a failure
/// pauses instead of rolling back, and the run's operator continues it: so every
/// failure of the tree passes after some attempts, and no procedure has a time limit
/// (past its deadline a continue would only time out again).
fn mark_irreversible(tree: &mut Traced, rng: &mut fastrand::Rng) {
    fn count(p: &Traced) -> usize {
        1 + p.children.iter().map(count).sum::<usize>()
    }
    fn walk(p: &mut Traced, pick: usize, at: &mut usize, rng: &mut fastrand::Rng) {
        if *at == pick {
            p.irreversible_at = Some(rng.u32(1..=p.steps));
        }
        *at += 1;
        p.timeout_ms = None;
        if p.fail_at.is_some() {
            p.fail_times = Some(p.fail_times.unwrap_or(1).max(1));
        }
        for c in &mut p.children {
            walk(c, pick, at, rng);
        }
    }
    let pick = rng.usize(0..count(tree));
    walk(tree, pick, &mut 0, rng);
}

/// The names of the procedures of `p`'s tree that hold engine locks for their life.
fn life_long_holders<'a>(p: &'a Traced, out: &mut Vec<&'a str>) {
    if p.hold && !p.engine_locks.is_empty() {
        out.push(&p.name);
    }
    for c in &p.children {
        life_long_holders(c, out);
    }
}

/// Whether every two of `names` are ancestor and descendant.
fn on_one_line(names: &[&str]) -> bool {
    names
        .iter()
        .enumerate()
        .all(|(i, a)| names[i + 1..].iter().all(|b| related(a, b)))
}

fn gen_plan(seed: u64) -> Plan {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut trees: Vec<Traced> = (0..rng.usize(3..=9))
        .map(|i| {
            let engine = rng.u8(0..3) != 0;
            gen_proc(&mut rng, format!("t{i}"), 0, true, engine)
        })
        .collect();
    let crash = (rng.u8(0..3) == 0).then(|| {
        let point = if rng.bool() {
            CrashPoint::BeforeWrite
        } else {
            CrashPoint::AfterWrite
        };
        (rng.usize(1..40), point)
    });
    let (workers, arbiters, wal) = (rng.usize(1..=4), rng.usize(1..=3), rng.bool());
    let (aborts, pauses) = (rng.usize(0..3), rng.usize(0..3));
    // Drawn last, so the rest of a seed's plan is what it was before system roots.
    let urgent = (0..trees.len()).map(|_| rng.u8(0..4) == 0).collect();
    // Points of no return, from a generator of their own (the plan above unchanged).
    // A wait-for cycle with no tree that can roll back in it has no way out but an
    // operator's bypass: its victim pauses, and continued closes the cycle again. Such
    // a cycle needs two trees past their point of no return holding engine locks for
    // life, or one whose life-long holders are not all on one line of descent (two
    // branches, each waiting for what the other holds). So at most one tree with
    // life-long engine locks gets a point of no return, and only if its holders are on
    // one line. (Any other cycle has a tree that can roll back: one is failed, or lends
    // its locks while it rolls back.)
    let mut ponr = fastrand::Rng::with_seed(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut life_long_marked = false;
    for tree in &mut trees {
        if ponr.u8(0..4) == 0 {
            let mut holders = Vec::new();
            life_long_holders(tree, &mut holders);
            if holders.is_empty() {
                mark_irreversible(tree, &mut ponr);
            } else if !life_long_marked && on_one_line(&holders) {
                life_long_marked = true;
                mark_irreversible(tree, &mut ponr);
            }
        }
    }
    // From a generator of its own too, so that every other part of a seed's plan is
    // what it was before drained restarts.
    let mut stops = fastrand::Rng::with_seed(seed ^ 0x5851_f42d_4c95_7f2d);
    let drain = (crash.is_none() && stops.u8(0..3) == 0).then(|| stops.u32(0..400));
    Plan {
        trees,
        workers,
        arbiters,
        wal,
        crash,
        drain,
        aborts,
        pauses,
        urgent,
        system_workers: rng.usize(0..=1),
        counted_permits: rng.u32(1..=2),
    }
}

fn registry() -> Registry<World> {
    let mut r = Registry::new();
    r.register::<Traced>("traced");
    r.register_system::<Urgent>("urgent");
    r
}

async fn start(
    store: impl ProcedureStore,
    plan: &Plan,
    world: &Arc<World>,
) -> Result<Executor<World>, Error> {
    Executor::builder()
        .registry(registry())
        .store(store)
        .workers(plan.workers)
        .system_workers(plan.system_workers)
        .arbiters(plan.arbiters)
        .permits(COUNTED, plan.counted_permits)
        .env(world.clone())
        .start()
        .await
}

/// The operator who continues what a failure paused (past a tree's point of no return,
/// a failure pauses the failing procedure), until told to stop. Operators' own pauses
/// (no error) are continued by whoever paused them.
fn spawn_continuer(
    executor: Executor<World>,
    world: Arc<World>,
    going: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<()> {
    actix::spawn(async move {
        let paused = proctor::List::new().state(ProcState::Paused);
        while going.load(Ordering::SeqCst) {
            let Ok(list) = executor.list(paused.clone()).await else {
                return;
            };
            for info in list {
                let failed = info
                    .steering
                    .paused
                    .as_ref()
                    .is_some_and(|p| p.error.is_some());
                if failed {
                    world.log(Ev::Continued { id: info.id });
                    let _ = executor.resume(info.id).await;
                }
            }
            tokio::task::yield_now().await;
        }
    })
}

/// Runs one seed to the end (checking its effects ledger) and returns its history and
/// whether the engine crashed on the way.
async fn run_seed(seed: u64) -> (Vec<Ev>, bool) {
    let plan = gen_plan(seed);
    let (mut locking, mut for_life, mut counted, mut marks) = (0, 0, 0, 0);
    let mut todo: Vec<&Traced> = plan.trees.iter().collect();
    while let Some(p) = todo.pop() {
        if !p.engine_locks.is_empty() {
            locking += 1;
            for_life += usize::from(p.hold);
            counted += usize::from(p.engine_locks.iter().any(|l| l.resource == COUNTED));
        }
        marks += usize::from(p.irreversible_at.is_some());
        todo.extend(&p.children);
    }
    eprintln!(
        "seed {seed}: {} trees ({} of a system type), {} workers (+{} for system steps), \
         {} arbiters, {}, crash {:?}, drain {:?}, {} aborts, {} pauses, {locking} \
         procedures with engine locks ({for_life} for life, {counted} on {COUNTED} of {} \
         permits), {marks} points of no return",
        plan.trees.len(),
        plan.urgent.iter().filter(|&&u| u).count(),
        plan.workers,
        plan.system_workers,
        plan.arbiters,
        if plan.wal { "wal" } else { "memory" },
        plan.crash,
        plan.drain,
        plan.aborts,
        plan.pauses,
        plan.counted_permits
    );
    let world = Arc::new(World::default());
    *WORLD.lock().unwrap() = Some(world.clone());
    let dir = tempfile::tempdir().unwrap();
    let memory = MemoryStore::new();
    let open = || -> Box<dyn ProcedureStore> {
        let inner: Box<dyn ProcedureStore> = if plan.wal {
            Box::new(WalStore::open(dir.path()).unwrap())
        } else {
            Box::new(memory.clone())
        };
        Box::new(Recording {
            inner,
            world: world.clone(),
        })
    };
    perturb::set_seed(seed);
    let executor = match plan.crash {
        Some((n, point)) => start(CrashingStore::new(open(), n, point), &plan, &world).await,
        None => start(open(), &plan, &world).await,
    }
    .unwrap();
    *EXECUTOR.lock().unwrap() = Some(executor.clone());

    // An observer that records what the executor reports, as a user polling it would.
    let stop = Arc::new(AtomicBool::new(false));
    let observer = {
        let (executor, world, stop) = (executor.clone(), world.clone(), stop.clone());
        actix::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                match executor.list(proctor::List::new().with_finished()).await {
                    Ok(list) => {
                        for info in list {
                            world.log(Ev::Observed {
                                id: info.id,
                                state: info.state,
                            });
                        }
                    }
                    Err(_) => break,
                }
                tokio::task::yield_now().await;
            }
        })
    };

    let mut trees = BTreeMap::new();
    for (tree, &urgent) in plan.trees.iter().zip(&plan.urgent) {
        let submitted = if urgent {
            executor.submit(Urgent(tree.clone())).await
        } else {
            executor.submit(tree.clone()).await
        };
        if let Ok(id) = submitted {
            trees.insert(id, tree.clone());
        }
    }
    // Aborts of random live procedures at random moments.
    let mut aborters = Vec::new();
    let mut rng = fastrand::Rng::with_seed(seed ^ 0xab);
    for _ in 0..plan.aborts {
        let (executor, world) = (executor.clone(), world.clone());
        let delay = rng.u32(0..50);
        let pick = rng.usize(..);
        aborters.push(actix::spawn(async move {
            for _ in 0..delay {
                tokio::task::yield_now().await;
            }
            let Ok(list) = executor.list(proctor::List::new().with_finished()).await else {
                return;
            };
            let live: Vec<ProcId> = list
                .iter()
                .filter(|i| !i.state.is_finished())
                .map(|i| i.id)
                .collect();
            if live.is_empty() {
                return;
            }
            let id = live[pick % live.len()];
            let answer = executor.abort(id).await.map_err(|e| e.to_string());
            world.log(Ev::AbortAnswer { id, answer });
        }));
    }
    // Operators' pauses of random live procedures, each continued after a while.
    for _ in 0..plan.pauses {
        let (executor, world) = (executor.clone(), world.clone());
        let (delay, hold) = (rng.u32(0..50), rng.u32(0..50));
        let pick = rng.usize(..);
        aborters.push(actix::spawn(async move {
            for _ in 0..delay {
                tokio::task::yield_now().await;
            }
            let Ok(list) = executor.list(proctor::List::new()).await else {
                return;
            };
            if list.is_empty() {
                return;
            }
            let id = list[pick % list.len()].id;
            if executor.pause(id).await.is_err() {
                return; // refused (finished, failing), or the engine is gone
            }
            world.log(Ev::Paused { id });
            for _ in 0..hold {
                tokio::task::yield_now().await;
            }
            world.log(Ev::Continued { id });
            let _ = executor.resume(id).await;
        }));
    }
    let going = Arc::new(AtomicBool::new(true));
    let continuer = spawn_continuer(executor.clone(), world.clone(), going.clone());
    // A graceful shutdown in the middle of the run, then a restart below.
    let drainer = plan.drain.map(|yields| {
        let executor = executor.clone();
        actix::spawn(async move {
            for _ in 0..yields {
                tokio::task::yield_now().await;
            }
            if let Ok(addr) = executor.addr() {
                let _ = addr.send(proctor::messages::Shutdown::graceful()).await;
            }
        })
    });
    let mut crashed = false;
    let mut drained = false;
    for &root in trees.keys() {
        match executor.wait(root).await {
            Ok(result) => world.log(Ev::Result { root, result }),
            Err(Error::Store(_)) => crashed = true,
            Err(Error::Stopped) if drainer.is_some() => drained = true,
            Err(e) => panic!("seed {seed}: wait for {root}: {e}"),
        }
    }
    if let Some(drainer) = drainer {
        let _ = drainer.await;
    }
    for a in aborters {
        let _ = a.await;
    }
    going.store(false, Ordering::SeqCst);
    let _ = continuer.await;
    stop.store(true, Ordering::SeqCst);
    let _ = observer.await;
    world.log(Ev::Stopping);
    // Stopped already after a drain.
    let stopped = executor.shutdown_now().await;
    assert!(
        stopped.is_ok() || plan.drain.is_some(),
        "seed {seed}: {stopped:?}"
    );

    if crashed || drained || plan.crash.is_some_and(|_| trees.len() < plan.trees.len()) {
        // The process stopped: its in-memory locks end with it (the user's lock hooks
        // are not asked to release what a tree cut off by the stop held).
        world.log(Ev::Restart);
        // What the store says of the stop (a drain that cut a step off marks nothing).
        let marked = open().load().map(|s| s.last_stop);
        eprintln!(
            "seed {seed}: restart after a {} stop, the store says {marked:?}",
            if drained { "drained" } else { "crashed" }
        );
        crashed |= !drained;
        world.locks.lock().unwrap().clear();
        let executor = start(open(), &plan, &world).await.unwrap();
        *EXECUTOR.lock().unwrap() = Some(executor.clone());
        // Paused before the crash, paused after it: the operator continues them.
        let paused = proctor::List::new().state(ProcState::Paused);
        for info in executor.list(paused).await.unwrap() {
            world.log(Ev::Continued { id: info.id });
            let _ = executor.resume(info.id).await;
        }
        let going = Arc::new(AtomicBool::new(true));
        let continuer = spawn_continuer(executor.clone(), world.clone(), going.clone());
        // A submit that failed at the crash may still have been written: its root is
        // among the recovered ones.
        let recovered: Vec<ProcId> = executor.recovery().recovered_roots.clone();
        let mut all: BTreeSet<ProcId> = trees.keys().copied().collect();
        all.extend(recovered);
        for root in all {
            match executor.wait(root).await {
                Ok(result) => world.log(Ev::Result { root, result }),
                Err(Error::UnknownProcedure(_) | Error::Gone(_)) => {}
                Err(e) => panic!("seed {seed}: wait for {root} after the restart: {e}"),
            }
        }
        going.store(false, Ordering::SeqCst);
        let _ = continuer.await;
        executor.shutdown_now().await.unwrap();
    }
    perturb::set_seed(0);
    *WORLD.lock().unwrap() = None;
    *EXECUTOR.lock().unwrap() = None;
    let history = world.history.lock().unwrap().clone();
    // Trees whose submit failed but were written are identified by their root name.
    let by_name: HashMap<String, Traced> = plan
        .trees
        .iter()
        .map(|t| (t.name.clone(), t.clone()))
        .collect();
    for ev in &history {
        if let Ev::Exec { id, name, .. } = ev {
            if let Some(t) = by_name.get(name) {
                trees.entry(*id).or_insert_with(|| t.clone());
            }
        }
    }
    let ledger = world.ledger.lock().unwrap().clone();
    check_ledger(&trees, &history, &ledger);
    (history, crashed)
}

/// The effects ledger at the end: all effects of a successful tree, none of a rolled-back
/// one.
fn check_ledger(trees: &BTreeMap<ProcId, Traced>, history: &[Ev], ledger: &BTreeSet<String>) {
    for (root, tree) in trees {
        let Some(result) = history.iter().rev().find_map(|e| match e {
            Ev::Result { root: r, result } if r == root => Some(result.clone()),
            _ => None,
        }) else {
            panic!("tree {root} ({}) has no result", tree.name);
        };
        // The tree's procedures, for the messages.
        let ids: Vec<ProcId> = history
            .iter()
            .filter_map(|e| match e {
                Ev::Durable { id, root: r, .. } if r == root => Some(*id),
                _ => None,
            })
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let mine: BTreeSet<String> = ledger
            .iter()
            .filter(|k| {
                k.starts_with(&format!("{}#", tree.name))
                    || k.starts_with(&format!("{}.", tree.name))
            })
            .cloned()
            .collect();
        // Once a step marking the point of no return is recorded before any failure,
        // the tree does not roll back (a failure recorded first may still: the mark
        // then came from a step that ran beside the failing one).
        let first = |hit: &dyn Fn(&Ev) -> bool| history.iter().position(hit);
        let marked =
            first(&|e| matches!(e, Ev::Durable { root: r, irreversible: true, .. } if r == root));
        let failed =
            first(&|e| matches!(e, Ev::Durable { root: r, failure: Some(_), .. } if r == root));
        if let (Err(f), Some(marked)) = (&result, marked) {
            assert!(
                failed.is_some_and(|failed| failed < marked),
                "tree {root} ({}) rolled back ({f}) past its point of no return:\n{}",
                tree.name,
                excerpt(history, &ids, 120)
            );
        }
        match result {
            Ok(()) => {
                let mut expected = BTreeSet::new();
                tree.all_effects(&mut expected);
                assert_eq!(
                    mine,
                    expected,
                    "tree {root} ({}) succeeded:\n{}",
                    tree.name,
                    excerpt(history, &ids, 120)
                );
            }
            Err(f) => assert!(
                mine.is_empty(),
                "tree {root} ({}) rolled back ({f}) but left {mine:?}:\n{}",
                tree.name,
                excerpt(history, &ids, 120)
            ),
        }
    }
}

/// What the durable records of tree `root` say: which procedure recorded each stack
/// index (the first record to carry it: indexes are never reused in a tree), and each
/// procedure's last durable state.
fn recorded_steps(
    history: &[Ev],
    root: ProcId,
) -> (BTreeMap<u32, ProcId>, HashMap<ProcId, ProcState>) {
    let mut index_owner = BTreeMap::new();
    let mut last_state = HashMap::new();
    for ev in history {
        if let Ev::Durable {
            id,
            root: r,
            state,
            stack,
            ..
        } = ev
        {
            if *r == root {
                for &i in stack {
                    index_owner.entry(i).or_insert(*id);
                }
                last_state.insert(*id, *state);
            }
        }
    }
    (index_owner, last_state)
}

/// Whether engine lock `a` conflicts with `b` (held by someone outside its ancestry).
fn clash(a: &Lock, b: &Lock) -> bool {
    let below = |upper: &str, lower: &str| {
        lower.len() > upper.len()
            && lower.starts_with(upper)
            && lower[upper.len()..].starts_with('/')
    };
    let (ra, rb) = (a.resource.as_str(), b.resource.as_str());
    if ra == rb {
        a.mode == LockMode::Exclusive || b.mode == LockMode::Exclusive
    } else if below(ra, rb) {
        a.mode == LockMode::Exclusive
    } else if below(rb, ra) {
        b.mode == LockMode::Exclusive
    } else {
        false
    }
}

/// Whether two procedure names belong to the same tree (`t3`, `t3.0`, `t3.0.1`).
fn same_tree(a: &str, b: &str) -> bool {
    a.split('.').next() == b.split('.').next()
}

/// Procedure names are paths (`t3.0.1` is a child of `t3.0`): whether one is the
/// other's ancestor, so runs under its locks.
fn related(a: &str, b: &str) -> bool {
    under(a, b) || under(b, a)
}

/// Whether `lower` is a descendant of `upper`.
fn under(lower: &str, upper: &str) -> bool {
    lower.len() > upper.len() && lower.starts_with(upper) && lower[upper.len()..].starts_with('.')
}

/// A hold of engine locks as the check replays it: the procedure's id, its locks,
/// whether for life, the index of the enter that began it, whether in a call, and
/// which call.
type Hold<'a> = (ProcId, &'a [Lock], bool, usize, bool, &'a str);

/// Engine locks: replays who is inside which locks and asserts that no two procedures
/// outside each other's ancestry are ever inside conflicting ones. A restart ends every
/// call of the old engine; only life-long holders stay inside (their locks are durably
/// held and granted back first). At the end, every hold has been left.
///
/// One exception, the engine's loan: a rollback, or a step of a tree past its point of
/// no return, may enter the locks of a life-long holder of another failed tree between
/// that holder's calls (when the waits of the two trees close a cycle that no failure
/// can break, the waiter borrows the failed tree's locks while that tree runs nothing).
/// The lender's own next call is then checked as usual.
///
/// The counted resource bounds the lines of descent *running* inside it: a holder
/// between its calls, in a tree whose rollback step is inside the resource (that
/// rollback went in ignoring its own tree's holders), runs nothing meanwhile and is not
/// counted against a procedure that enters then. (Counted, a later grant to another
/// tree, made while only that holder was inside, read as a third line in two permits
/// once the rollback had entered in between: seed 107612, about one run in six.)
fn check_engine_locks(history: &[Ev], permits: u32) {
    // name -> its hold
    let mut inside: BTreeMap<&str, Hold<'_>> = BTreeMap::new();
    let mut root_of: HashMap<ProcId, ProcId> = HashMap::new();
    let mut failed_trees: BTreeSet<ProcId> = BTreeSet::new();
    let mut irreversible_trees: BTreeSet<ProcId> = BTreeSet::new();
    let mut loans: BTreeSet<(ProcId, ProcId)> = BTreeSet::new();
    for (at, ev) in history.iter().enumerate() {
        match ev {
            Ev::Loan {
                borrower, lender, ..
            } => {
                loans.insert((*borrower, *lender));
            }
            Ev::Durable {
                id,
                root,
                state,
                failure,
                irreversible,
                ..
            } => {
                root_of.insert(*id, *root);
                if failure.is_some() || *state == ProcState::Failed {
                    failed_trees.insert(*root);
                }
                if *irreversible {
                    irreversible_trees.insert(*root);
                }
            }
            Ev::Enter {
                id,
                name,
                locks,
                life,
                call,
            } => {
                let counted = locks.iter().any(|l| l.resource == COUNTED);
                let mut sharing = Vec::new();
                for (&other, &(other_id, other_locks, life, since, in_call, _)) in &inside {
                    if other == name || related(name, other) {
                        continue;
                    }
                    // A tree rolls back one step at a time with nothing of it running:
                    // a rollback does not wait for locks its own tree holds.
                    if *call == "rollback" && same_tree(name, other) {
                        continue;
                    }
                    let lender = life
                        && !in_call
                        && root_of
                            .get(&other_id)
                            .is_some_and(|r| failed_trees.contains(r));
                    let borrower = *call == "rollback"
                        || root_of
                            .get(id)
                            .is_some_and(|r| irreversible_trees.contains(r));
                    if borrower && lender && loans.contains(&(*id, other_id)) {
                        continue;
                    }
                    // A holder between its calls in a tree whose rollback step is inside
                    // the counted resource runs nothing meanwhile (that rollback went in
                    // ignoring its own tree's holders): it is no line running inside.
                    let idle_beside_its_rollback = !in_call
                        && inside.iter().any(|(&o, hold)| {
                            hold.4
                                && hold.5 == "rollback"
                                && same_tree(o, other)
                                && hold.1.iter().any(|l| l.resource == COUNTED)
                        });
                    if counted
                        && !idle_beside_its_rollback
                        && other_locks.iter().any(|l| l.resource == COUNTED)
                    {
                        sharing.push((other, other_id, since));
                    }
                    let pair = locks
                        .iter()
                        .find_map(|a| other_locks.iter().find(|b| clash(a, b)).map(|b| (a, b)));
                    if let Some((a, b)) = pair {
                        let excerpt = excerpt(&history[..=at], &[*id, other_id], 50);
                        panic!(
                            "event {at}: {name} ({id}) entered [{a}] for its {call} while {other} \
                             ({other_id}) was inside [{b}] since event {since}; its last \
                             events and {other}'s:\n{excerpt}"
                        );
                    }
                }
                // The counted resource takes a permit per line of descent: a holder
                // under a life-long holder of it (its ancestor) takes none. At most its
                // permits (a second call inside the same hold is no new holder).
                let covered = |x: &str| {
                    inside.iter().any(|(&a, hold)| {
                        hold.2 && hold.1.iter().any(|l| l.resource == COUNTED) && under(x, a)
                    })
                };
                sharing.retain(|s| !covered(s.0));
                if counted
                    && !inside.contains_key(name.as_str())
                    && !covered(name)
                    && sharing.len() >= permits as usize
                {
                    let ids: Vec<ProcId> = sharing.iter().map(|s| s.1).chain([*id]).collect();
                    panic!(
                        "event {at}: {name} ({id}) entered S {COUNTED} for its {call} while \
                         {sharing:?} (name, id, since event) were inside it; their last \
                         events:\n{}",
                        excerpt(&history[..=at], &ids, 50)
                    );
                }
                let hold = inside.entry(name.as_str()).or_insert((
                    *id,
                    &locks[..],
                    *life,
                    at,
                    true,
                    *call,
                ));
                hold.4 = true;
                hold.5 = *call;
            }
            Ev::Leave { name, .. } => {
                inside.remove(name.as_str());
            }
            Ev::Pause { name, .. } => {
                if let Some(hold) = inside.get_mut(name.as_str()) {
                    hold.4 = false;
                }
            }
            // A call in flight at a stop may be dropped without leaving: from then on
            // only what is held for life is held.
            Ev::Stopping | Ev::Restart => {
                inside.retain(|_, hold| hold.2);
                for hold in inside.values_mut() {
                    hold.4 = false;
                }
            }
            _ => {}
        }
    }
    if let Some((name, (id, _, _, since, _, _))) = inside.iter().next() {
        let ids: Vec<ProcId> = inside
            .values()
            .flat_map(|hold| [hold.0, root_of.get(&hold.0).copied().unwrap_or(hold.0)])
            .collect();
        panic!(
            "inside engine locks at the end: {:?} ({name} ({id}) since event {since}); their \
             last events:\n{}",
            inside.keys().collect::<Vec<_>>(),
            excerpt(history, &ids, 60)
        );
    }
}

/// The last `n` events about the procedures `ids` (or trees they are the root of), and
/// restarts, one a line, for a failure message.
fn excerpt(history: &[Ev], ids: &[ProcId], n: usize) -> String {
    let mut lines: Vec<String> = history
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, ev)| match ev {
            Ev::Exec { id, .. }
            | Ev::Rollback { id, .. }
            | Ev::Enter { id, .. }
            | Ev::Leave { id, .. }
            | Ev::Pause { id, .. }
            | Ev::Durable { id, .. }
            | Ev::Paused { id }
            | Ev::Continued { id }
            | Ev::AbortAnswer { id, .. } => ids.contains(id),
            Ev::Result { root, .. } => ids.contains(root),
            Ev::Loan {
                borrower, lender, ..
            } => ids.contains(borrower) || ids.contains(lender),
            Ev::Stopping | Ev::Restart | Ev::Violation(_) => true,
            _ => false,
        })
        .take(n)
        .map(|(at, ev)| format!("  {at}: {ev:?}"))
        .collect();
    lines.reverse();
    lines.join("\n")
}

/// The last `n` events but the observer's, one a line, for a failure message.
fn last_events(history: &[Ev], n: usize) -> String {
    let mut lines: Vec<String> = history
        .iter()
        .enumerate()
        .rev()
        .filter(|(_, e)| !matches!(e, Ev::Observed { .. }))
        .take(n)
        .map(|(at, e)| format!("  {at}: {e:?}"))
        .collect();
    lines.reverse();
    lines.join("\n")
}

/// Calls inside engine locks (all, and those inside the counted resource), trees failed
/// on a deadlock, trees failed on a timeout, and loans the lock table made (all, and
/// those past a point of no return).
fn lock_stats(history: &[Ev]) -> ([usize; 2], usize, usize, [usize; 2]) {
    let count = |what: fn(&Ev) -> bool| history.iter().filter(|e| what(e)).count();
    let enters = [
        count(|e| matches!(e, Ev::Enter { .. })),
        count(
            |e| matches!(e, Ev::Enter { locks, .. } if locks.iter().any(|l| l.resource == COUNTED)),
        ),
    ];
    let loans = [
        count(|e| matches!(e, Ev::Loan { .. })),
        count(|e| {
            matches!(
                e,
                Ev::Loan {
                    past_ponr: true,
                    ..
                }
            )
        }),
    ];
    let failed_for = |what: fn(&ProcError) -> bool| {
        history
            .iter()
            .filter(|e| matches!(e, Ev::Result { result: Err(f), .. } if what(&f.error)))
            .count()
    };
    let deadlocks = failed_for(|e| matches!(e, ProcError::Deadlock(_)));
    let timeouts = failed_for(|e| matches!(e, ProcError::TimedOut { .. }));
    (enters, deadlocks, timeouts, loans)
}

/// The protocol's promises on one history; `serial`: the executor ran one step at a
/// time; `permits`: the counted resource's.
fn check(history: &[Ev], crashed: bool, serial: bool, permits: u32) {
    let violations: Vec<&String> = history
        .iter()
        .filter_map(|e| match e {
            Ev::Violation(v) => Some(v),
            _ => None,
        })
        .collect();
    assert!(violations.is_empty(), "violations: {violations:?}");
    check_engine_locks(history, permits);

    // Which tree each procedure belongs to, and its durable states so far.
    let mut root_of: HashMap<ProcId, ProcId> = HashMap::new();
    let mut durable_states: HashMap<ProcId, BTreeSet<String>> = HashMap::new();
    let mut first_failure: HashMap<ProcId, Failure> = HashMap::new();
    let mut results: HashMap<ProcId, Result<(), Failure>> = HashMap::new();
    for (at, ev) in history.iter().enumerate() {
        match ev {
            Ev::Durable {
                id,
                root,
                state,
                failure,
                ..
            } => {
                root_of.insert(*id, *root);
                durable_states
                    .entry(*id)
                    .or_default()
                    .insert(state.to_string());
                if let Some(f) = failure {
                    first_failure.entry(*root).or_insert_with(|| f.clone());
                }
            }
            Ev::Observed { id, state } => {
                let seen = durable_states
                    .get(id)
                    .is_some_and(|s| s.contains(&state.to_string()));
                assert!(
                    seen,
                    "event {at}: the executor reported {id} as {state} before that was durable"
                );
            }
            Ev::Result { root, result } => {
                results.insert(*root, result.clone());
                // Every tree ends SUCCESS or ROLLEDBACK, for a reason the workload gives.
                if let Err(f) = result {
                    match &f.error {
                        ProcError::Failed(text) if text.ends_with(" failed") => {}
                        ProcError::Aborted | ProcError::TimedOut { .. } => {}
                        ProcError::Deadlock(text) => assert!(
                            text.starts_with("deadlock: "),
                            "tree {root}: deadlock failure {text:?}"
                        ),
                        other => panic!("tree {root} rolled back for {other:?}"),
                    }
                }
                // A failed tree's result is the first failure its log made durable.
                match result {
                    Ok(()) => assert!(
                        !first_failure.contains_key(root),
                        "tree {root} succeeded after a durable failure"
                    ),
                    Err(f) => assert_eq!(
                        first_failure.get(root),
                        Some(f),
                        "tree {root}: the result is not the first durable failure"
                    ),
                }
            }
            _ => {}
        }
    }
    for ev in history {
        if let Ev::AbortAnswer {
            id,
            answer: Ok(true),
        } = ev
        {
            let root = root_of.get(id).copied().unwrap_or(*id);
            if let Some(r) = results.get(&root) {
                assert!(
                    r.is_err(),
                    "abort of {id} accepted, but tree {root} succeeded"
                );
            }
        }
    }

    // A procedure durably PAUSED runs no step until an operator continues it, and a
    // pause is answered only once it is durable. (The answer's own log line may come
    // late, after another operator's continue, so the record is the reference.)
    let mut paused: BTreeSet<ProcId> = BTreeSet::new();
    let mut durably_paused: BTreeSet<ProcId> = BTreeSet::new();
    for ev in history {
        match ev {
            Ev::Durable {
                id,
                state: ProcState::Paused,
                ..
            } => {
                paused.insert(*id);
                durably_paused.insert(*id);
            }
            Ev::Paused { id } => assert!(
                durably_paused.contains(id),
                "the pause of {id} was answered before it was durable:\n{}",
                excerpt(history, &[*id], 30)
            ),
            Ev::Continued { id } => {
                paused.remove(id);
            }
            Ev::Exec { id, name, .. } if paused.contains(id) => panic!(
                "{name} ({id}) ran a step while paused:\n{}",
                excerpt(history, &[*id], 30)
            ),
            _ => {}
        }
    }

    // Cleanup: at most once per procedure, and before its tree's result.
    let mut cleanups: HashMap<&str, usize> = HashMap::new();
    for ev in history {
        if let Ev::Cleanup { name } = ev {
            *cleanups.entry(name.as_str()).or_default() += 1;
        }
    }
    for (name, n) in &cleanups {
        assert_eq!(*n, 1, "{name} cleaned up {n} times");
    }

    if crashed {
        return;
    }
    // Without a crash: every procedure that ran cleaned up before its tree's result...
    let mut name_of: HashMap<ProcId, String> = HashMap::new();
    for ev in history {
        if let Ev::Exec { id, name, .. } = ev {
            name_of.insert(*id, name.clone());
        }
    }
    for (at, ev) in history.iter().enumerate() {
        if let Ev::Result { root, .. } = ev {
            for (id, name) in &name_of {
                if root_of.get(id) == Some(root) {
                    let cleaned = history[..at]
                        .iter()
                        .any(|e| matches!(e, Ev::Cleanup { name: n } if n == name));
                    assert!(
                        cleaned,
                        "{name} ({id}) had no cleanup before tree {root}'s result"
                    );
                }
            }
        }
    }
    // ...every grant was released once, and the locks end free...
    let mut held: HashMap<u32, String> = HashMap::new();
    for ev in history {
        match ev {
            Ev::Lock { name, resource } => {
                let old = held.insert(*resource, name.clone());
                assert!(
                    old.is_none(),
                    "lock {resource} granted to {name} while {old:?} holds it"
                );
            }
            Ev::Unlock { name, resource } => {
                assert_eq!(
                    held.remove(resource).as_ref(),
                    Some(name),
                    "unlock of {resource}"
                );
            }
            // A drained stop: what the stopped process held ended with it.
            Ev::Restart => held.clear(),
            _ => {}
        }
    }
    assert!(held.is_empty(), "locks never released: {held:?}");
    // ...and each failed tree rolled back exactly its recorded steps, newest first,
    // skipping procedures that succeeded.
    for (root, result) in &results {
        if result.is_ok() {
            continue;
        }
        let (index_owner, last_state) = recorded_steps(history, *root);
        let expected: Vec<ProcId> = index_owner
            .iter()
            .rev()
            .map(|(_, id)| *id)
            .filter(|id| last_state.get(id) != Some(&ProcState::Success))
            .collect();
        let actual: Vec<ProcId> = history
            .iter()
            .filter_map(|e| match e {
                Ev::Rollback {
                    id,
                    unrecorded: false,
                } if root_of.get(id) == Some(root) => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(actual, expected, "tree {root}: rollback order");
    }
    // With one worker (and no system step beside it) steps happen one after another,
    // and the order the root stack records (the stack indexes) must be the order they
    // happened.
    if serial {
        let roots: BTreeSet<ProcId> = root_of.values().copied().collect();
        for root in roots {
            let (index_owner, _) = recorded_steps(history, root);
            let recorded: Vec<ProcId> = index_owner.values().copied().collect();
            // A failed attempt its policy retried (or one whose retry its tree's
            // failure cut short) is not recorded: the recorded steps are the calls in
            // the order they happened, some failed ones left out.
            let execs: Vec<(ProcId, bool)> = history
                .iter()
                .filter_map(|e| match e {
                    Ev::Exec { id, failed, .. } if root_of.get(id) == Some(&root) => {
                        Some((*id, *failed))
                    }
                    _ => None,
                })
                .collect();
            let mut matched = 0;
            let mut unrecorded = Vec::new();
            for (at, &(id, failed)) in execs.iter().enumerate() {
                if failed && execs[at + 1..].iter().any(|&(later, _)| later == id) {
                    // Retried: the same step again.
                    continue;
                }
                if recorded.get(matched) == Some(&id) {
                    matched += 1;
                } else if !failed {
                    unrecorded.push(at);
                }
            }
            // A successful root's last step is never recorded with its index (the final
            // record keeps only the result).
            let last_ok = execs.iter().rposition(|&(_, failed)| !failed);
            assert!(
                matched == recorded.len()
                    && (unrecorded.is_empty() || unrecorded == [last_ok.unwrap_or(usize::MAX)]),
                "tree {root}: steps happened in the order {execs:?} (id, failed), recorded as \
                 {recorded:?}"
            );
        }
    }
}

#[actix::test]
async fn random_workloads_keep_every_promise_under_perturbation() {
    witness_loans();
    let mut seeds = common::seeds::Seeds::from_env(24);
    let mut runs = 0;
    let (mut enters, mut deadlocks, mut timeouts, mut loans) = ([0, 0], 0, 0, [0, 0]);
    for seed in seeds.by_ref() {
        let run = async {
            let (history, crashed) = run_seed(seed).await;
            let plan = gen_plan(seed);
            check(&history, crashed, plan.serial(), plan.counted_permits);
            lock_stats(&history)
        };
        // A guard against a hang (which is itself the failure), not a sequencer.
        match tokio::time::timeout(Duration::from_secs(60), run).await {
            Ok((e, d, t, l)) => {
                enters[0] += e[0];
                enters[1] += e[1];
                deadlocks += d;
                timeouts += t;
                loans[0] += l[0];
                loans[1] += l[1];
            }
            Err(_) => panic!(
                "seed {seed}: the run hung; replay with PROCTOR_SEED={seed} cargo test --test \
                 perturbation\nthe live procedures and their locks:\n{}",
                hang_report().await
            ),
        }
        runs += 1;
    }
    eprintln!(
        "{runs} seeds checked in {:?}: {} calls inside engine locks ({} inside {COUNTED}), \
         {deadlocks} trees failed on a deadlock, {} loans ({} past a point of no return), \
         {timeouts} trees failed on a timeout",
        seeds.elapsed(),
        enters[0],
        enters[1],
        loans[0],
        loans[1]
    );
}
