//! A synthetic workload: many root procedures, each a state machine of `--steps` steps
//! with `--children` child state machines, some failing at a random step and rolling
//! back. It is the project's throughput benchmark and, with `--ledger` and `--verify`,
//! its end-to-end correctness check. The flags and the last line (one JSON object) are a
//! contract that outside checks drive; see `DESIGN.md`.
//!
//! ```sh
//! cargo run --release --example workload -- --store memory --procs 20000 --steps 3 \
//!     --children 2 --fail-rate 0.1 --ledger /tmp/ledger --verify
//! ```

mod ledger;

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use proctor::{
    async_trait, Context, Executor, Flow, MemoryStore, ProcError, ProcId, ProcState, Registry,
    StateContext, StateMachine, StateMachineProcedure,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use ledger::Ledger;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// The engine's write-ahead log.
    Wal,
    /// No persistence.
    Memory,
    /// One file per procedure, rewritten on every update (the baseline).
    FilePerProc,
}

#[derive(Parser, Debug)]
#[command(about = "Run a synthetic procedure workload and report throughput as JSON")]
struct Args {
    /// Which store to run on.
    #[arg(long, value_enum, default_value = "wal")]
    store: StoreKind,
    /// Store directory (default: a fresh temp dir).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Root procedures to submit.
    #[arg(long, default_value_t = 10_000)]
    procs: u64,
    /// State-machine steps per procedure.
    #[arg(long, default_value_t = 3)]
    steps: u16,
    /// Child procedures per root, each with `--steps` steps.
    #[arg(long, default_value_t = 0)]
    children: u16,
    /// Share of roots that fail at a random step and must roll back (0..1).
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    /// Random seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Ledger file: every step records its effect, every rollback removes it.
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// Submit nothing: recover the store in --dir and run it to completion.
    #[arg(long)]
    resume: bool,
    /// Check at the end that every procedure is SUCCESS or ROLLEDBACK and the ledger
    /// agrees.
    #[arg(long)]
    verify: bool,
    /// Roots in flight at once (submitted and not finished).
    #[arg(long, default_value_t = 1000)]
    concurrency: usize,
    /// Concurrent steps (the executor's workers).
    #[arg(long, default_value_t = 64)]
    workers: usize,
}

/// What the procedures share: the ledger and a step counter.
struct Env {
    ledger: Option<Ledger>,
    steps: AtomicU64,
}

impl Env {
    fn effect(&self, effect: ledger::Effect, add: bool) -> Result<(), ProcError> {
        let Some(ledger) = &self.ledger else {
            return Ok(());
        };
        let written = if add {
            ledger.add(effect)
        } else {
            ledger.remove(effect)
        };
        written.map_err(|e| ProcError::failed(format!("ledger: {e}")))
    }
}

/// One procedure of the workload: `path` 0 is the root, `i` its child `i`.
#[derive(Clone, Serialize, Deserialize)]
struct Work {
    path: u16,
    steps: u16,
    children: u16,
    /// `(path, step)` that fails in this tree, if any.
    fail: Option<(u16, u16)>,
}

#[async_trait]
impl StateMachineProcedure for Work {
    type State = u16;

    fn initial_state(&self) -> u16 {
        0
    }

    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, u16>,
        step: u16,
    ) -> Result<Flow, ProcError> {
        let env = ctx.env::<Arc<Env>>()?;
        env.steps.fetch_add(1, Ordering::Relaxed);
        if step >= self.steps {
            // Only reached by a one-step root with children: the step after them.
            return Ok(Flow::Done);
        }
        env.effect((ctx.root().0, self.path, step), true)?;
        if self.fail == Some((self.path, step)) {
            return Err(ProcError::failed(format!(
                "injected failure at path {} step {step}",
                self.path
            )));
        }
        ctx.set_next_state(step + 1);
        if self.path == 0 && step == 0 && self.children > 0 {
            let children = (1..=self.children)
                .map(|path| {
                    Box::new(StateMachine::new(Work {
                        path,
                        children: 0,
                        ..self.clone()
                    })) as Box<dyn proctor::Procedure>
                })
                .collect();
            return Ok(Flow::Children(children));
        }
        if step + 1 < self.steps {
            Ok(Flow::MoreToDo)
        } else {
            Ok(Flow::Done)
        }
    }

    async fn rollback_state(&mut self, ctx: &mut Context, step: u16) -> Result<(), ProcError> {
        let env = ctx.env::<Arc<Env>>()?;
        if step >= self.steps {
            return Ok(());
        }
        env.effect((ctx.root().0, self.path, step), false)?;
        if self.path == 0 && step == 0 {
            // The root's first step started the children: undo what they did. A child
            // that succeeded is not rolled back itself (see DESIGN.md).
            for path in 1..=self.children {
                for child_step in 0..self.steps {
                    env.effect((ctx.root().0, path, child_step), false)?;
                }
            }
        }
        Ok(())
    }
}

/// What each root came to.
#[derive(Default)]
struct Tally {
    success: u64,
    rolled_back: u64,
    failed: u64,
    violations: Vec<String>,
    latency_us: Option<Histogram<u64>>,
}

fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.register::<StateMachine<Work>>("workload");
    registry
}

#[actix::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    match run(args).await {
        Ok(ok) => ok,
        Err(e) => {
            eprintln!("workload: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, Box<dyn std::error::Error>> {
    if !(0.0..=1.0).contains(&args.fail_rate) {
        return Err(format!("--fail-rate must be within 0..1, not {}", args.fail_rate).into());
    }
    if args.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    if args.resume && args.store == StoreKind::Memory {
        return Err("--resume needs a persistent store; the memory store keeps nothing".into());
    }
    let ledger = args.ledger.as_deref().map(Ledger::open).transpose()?;
    let env = Arc::new(Env {
        ledger,
        steps: AtomicU64::new(0),
    });
    let builder = Executor::builder()
        .registry(registry())
        .workers(args.workers)
        .env(env.clone());
    let executor = match args.store {
        StoreKind::Memory => builder.store(MemoryStore::new()).start().await?,
        StoreKind::Wal | StoreKind::FilePerProc => {
            return Err(format!(
                "--store {:?} is not available yet; use --store memory",
                args.store
            )
            .into())
        }
    };

    let started = Instant::now();
    let tally = Rc::new(RefCell::new(Tally {
        latency_us: Some(Histogram::new_with_bounds(1, 3_600_000_000, 3)?),
        ..Tally::default()
    }));
    let expected: Rc<RefCell<HashMap<ProcId, bool>>> = Rc::default();
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let window = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let mut tasks = Vec::new();
    for _ in 0..args.procs {
        let fail = (rng.f64() < args.fail_rate)
            .then(|| (rng.u16(0..=args.children), rng.u16(0..args.steps)));
        let work = Work {
            path: 0,
            steps: args.steps,
            children: args.children,
            fail,
        };
        let permit = window.clone().acquire_owned().await?;
        let executor = executor.clone();
        let tally = tally.clone();
        let expected = expected.clone();
        tasks.push(actix::spawn(async move {
            let t0 = Instant::now();
            let outcome = match executor.submit(StateMachine::new(work)).await {
                Ok(id) => {
                    expected.borrow_mut().insert(id, fail.is_none());
                    executor.wait(id).await.map(|r| (id, r))
                }
                Err(e) => Err(e),
            };
            let mut tally = tally.borrow_mut();
            let micros = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
            if let Some(h) = tally.latency_us.as_mut() {
                h.saturating_record(micros);
            }
            match outcome {
                Ok((_, Ok(()))) => tally.success += 1,
                Ok((_, Err(_))) => tally.rolled_back += 1,
                Err(e) => {
                    tally.failed += 1;
                    tally
                        .violations
                        .push(format!("a root ended with an engine error: {e}"));
                }
            }
            drop(permit);
        }));
    }
    for task in tasks {
        task.await?;
    }
    let wall_s = started.elapsed().as_secs_f64();
    // Every task has finished: the shared cells are ours alone now.
    let expected = expected.take();
    let mut tally = tally.take();

    if args.verify {
        verify(&executor, &env, &expected, &args, &mut tally).await?;
    }
    for v in tally.violations.iter().take(20) {
        eprintln!("violation: {v}");
    }
    let steps = env.steps.load(Ordering::Relaxed);
    let finished = tally.success + tally.rolled_back;
    let latency = tally.latency_us.as_ref().expect("histogram");
    let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    let report = serde_json::json!({
        "store": format!("{:?}", args.store).to_lowercase(),
        "submitted": args.procs,
        "recovered": 0,
        "success": tally.success,
        "rolled_back": tally.rolled_back,
        "failed": tally.failed,
        "steps": steps,
        "wall_s": round3(wall_s),
        "procs_per_s": round3(finished as f64 / wall_s),
        "steps_per_s": round3(steps as f64 / wall_s),
        "p50_ms": round3(ms(0.50)),
        "p99_ms": round3(ms(0.99)),
        "violations": tally.violations.len(),
    });
    println!("{report}");
    Ok(if tally.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Every root is finished, in the state its plan says, and the ledger holds exactly the
/// effects of the successful roots.
async fn verify(
    executor: &Executor,
    env: &Env,
    expected: &HashMap<ProcId, bool>,
    args: &Args,
    tally: &mut Tally,
) -> Result<(), Box<dyn std::error::Error>> {
    let per_root = (u64::from(args.children) + 1) * u64::from(args.steps);
    let effects = match &env.ledger {
        Some(ledger) => Some(ledger.effects_per_root()?),
        None => None,
    };
    let mut known = HashMap::new();
    for info in executor.list().await? {
        if info.parent.is_some() || info.root != info.id {
            tally.violations.push(format!(
                "procedure {} ({}) is still known after every root finished",
                info.id, info.state
            ));
            continue;
        }
        known.insert(info.id, info.state);
    }
    for (id, state) in &known {
        let should_succeed = expected.get(id).copied();
        let effects_here = effects.as_ref().map(|e| e.get(&id.0).copied().unwrap_or(0));
        let problem = match (state, should_succeed) {
            (ProcState::Success, Some(false)) => Some("succeeded though it was planned to fail"),
            (ProcState::RolledBack, Some(true)) => Some("rolled back though nothing failed"),
            (ProcState::Success | ProcState::RolledBack, _) => None,
            _ => Some("is not finished"),
        };
        if let Some(problem) = problem {
            tally
                .violations
                .push(format!("root {id} ({state}) {problem}"));
        }
        match (state, effects_here) {
            (ProcState::Success, Some(n)) if n as u64 != per_root => tally.violations.push(
                format!("root {id} succeeded with {n} effects in the ledger, not {per_root}"),
            ),
            (ProcState::RolledBack, Some(n)) if n != 0 => tally.violations.push(format!(
                "root {id} rolled back but left {n} effects in the ledger"
            )),
            _ => {}
        }
    }
    for id in expected.keys() {
        if !known.contains_key(id) {
            tally
                .violations
                .push(format!("root {id} was submitted but is unknown"));
        }
    }
    if let Some(effects) = effects {
        for root in effects.keys() {
            if !known.contains_key(&ProcId(*root)) {
                tally.violations.push(format!(
                    "the ledger holds effects of procedure {root}, unknown to the store"
                ));
            }
        }
    }
    Ok(())
}
