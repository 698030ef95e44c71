//! A synthetic workload: many root procedures, each a state machine of `--steps` steps
//! with `--children` child state machines, some failing at a random step and rolling
//! back. It is the project's throughput benchmark and, with `--ledger` and `--verify`,
//! its end-to-end correctness check. The flags and the last line (one JSON object) are a
//! contract that outside checks drive; `examples/README.md` writes it down.
//!
//! ```sh
//! cargo run --release --example workload -- --store memory --procs 20000 --steps 3 \
//!     --children 2 --fail-rate 0.1 --ledger /tmp/ledger --verify
//! ```
//!
//! With `--dag W` each root is instead a DAG of W tasks (`dag.rs`): seeded random
//! edges, failures at `--fail-rate`, points of no return at `--irreversible-rate`. The
//! workload then also acts as the operator: it continues every procedure that pauses.

mod dag;
mod file_store;
mod join;
mod ledger;
mod nodes;
mod rss;
mod work;

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use hdrhistogram::Histogram;
use proctor::store::{StoreOp, StoreParts, StoreSnapshot};
use proctor::{
    Executor, MemoryStore, ProcId, ProcState, ProcedureStore, StateMachine, StoreError, WalOptions,
    WalStats, WalStore,
};
use tokio::sync::Semaphore;

use file_store::FilePerProcStore;
use ledger::Ledger;
use nodes::{Nodes, ToNodes};
use work::{registry, Env, Work};

/// The WAL store, with its counters copied out after every append for the report.
struct ProbedWal {
    wal: WalStore,
    stats: Arc<Mutex<WalStats>>,
}

impl ProcedureStore for ProbedWal {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        let result = self.wal.append(ops);
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = self.wal.stats();
        result
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        self.wal.load()
    }

    fn load_parts(&mut self) -> Result<StoreParts, StoreError> {
        self.wal.load_parts()
    }

    fn mark_drained(&mut self, cut_off: &[proctor::ProcId]) -> Result<(), StoreError> {
        self.wal.mark_drained(cut_off)
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        self.wal.mark_running()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// The engine's write-ahead log.
    Wal,
    /// No persistence.
    Memory,
    /// One file per procedure, rewritten on every update (the baseline).
    FilePerProc,
    /// The PostgreSQL store (`--pg URL`).
    Postgres,
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
    /// The database of `--store postgres` (a `postgresql://` URL or libpq key-values).
    #[arg(long)]
    pg: Option<String>,
    /// The PostgreSQL schema of `--store postgres`'s tables.
    #[arg(long, default_value = "proctor")]
    pg_schema: String,
    /// With `--store postgres`: wait as a standby for the leader lease, take over, and
    /// run what the leader left to completion (as --resume does; submits nothing).
    #[arg(long)]
    standby: bool,
    /// With `--store postgres`: join the cluster of executors in the schema (made with
    /// `--partitions` partitions by its first member) as a member named `--holder`,
    /// submit `--procs` roots through it, wait for them and leave; with `--verify`,
    /// first wait until every root of the cluster has finished, then check them all
    /// and the shared `--ledger` (see `join.rs`).
    #[arg(long)]
    join: bool,
    /// With `--join`: the cluster's partitions, if this member creates it.
    #[arg(long, default_value_t = 8)]
    partitions: u32,
    /// With `--store postgres`: the leader lease's period, in ms (with `--join`: the
    /// membership's).
    #[arg(long, default_value_t = 3000)]
    lease_ms: u64,
    /// With `--store postgres`: this engine's name in the lease (default
    /// `workload-<pid>`).
    #[arg(long)]
    holder: Option<String>,
    /// Remote targets: each step of a root also sends one operation to one of T
    /// in-process nodes through the engine's dispatcher and waits for its report.
    #[arg(long, default_value_t = 0)]
    remote: u16,
    /// The nodes' latency: each operation is applied and reported after a random
    /// delay up to this many ms.
    #[arg(long, default_value_t = 5)]
    remote_latency_ms: u64,
    /// Share of requests that fail (retried by the dispatcher) plus share of operations
    /// that fail on a node (sent again by their step), half each.
    #[arg(long, default_value_t = 0.05)]
    remote_fail_rate: f64,
    /// The dispatcher's batching age, in ms (requests of 32 operations or this old).
    #[arg(long, default_value_t = 150)]
    remote_batch_ms: u64,
    /// Serve the admin page on this address during the run (read-only).
    #[arg(long)]
    admin: Option<std::net::SocketAddr>,
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
    /// Submit nothing: recover the store in --dir and run it to completion. With
    /// --verify it needs no other flag of the original run: each root's shape (steps,
    /// children, failure plan, lock) is read from its persisted state.
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
    /// Shards (arbiter threads, each with its scheduler and a share of the workers)
    /// the trees are spread over (default: the engine's, one per core).
    #[arg(long, alias = "arbiters")]
    shards: Option<usize>,
    /// Each root (and its children) holds an exclusive lock on one of N resources
    /// (`res/<k>`); every step checks that no other tree is inside it (JSON:
    /// `lock_conflicts`, which must be 0).
    #[arg(long)]
    locks: Option<u32>,
    /// How long finished roots' results are kept before the cleaner evicts them (and
    /// the log forgets them); default: the engine's (15 minutes). A short retention
    /// keeps the WAL and the memory small on long runs; `--verify` then sees only the
    /// roots still kept.
    #[arg(long)]
    retention_ms: Option<u64>,
    /// Each root is a DAG of this many tasks (seeded random edges, each task one step;
    /// `--steps` is then unused). A failing root has one failing task; the workload
    /// continues every procedure that pauses (a failure past a point of no return).
    #[arg(long)]
    dag: Option<u16>,
    /// With `--dag`: the share of tasks that are points of no return (0..1).
    #[arg(long, default_value_t = 0.0)]
    irreversible_rate: f64,
    /// WAL segment size in bytes (`--store wal`; default: `WalOptions`'s). A frame (one
    /// group commit) larger than this takes a segment of its own: the log's bytes stay
    /// within 2·L + M·(S + F), but its segment count is then bounded only by
    /// 1 + (2·L + M·S)/90 (see `actors/wal_store/mod.rs`), so keep it well above the
    /// largest group commit.
    #[arg(long)]
    segment_bytes: Option<u64>,
    /// WAL segments kept before compaction rewrites the oldest (`--store wal`; default:
    /// `WalOptions`'s).
    #[arg(long)]
    max_segments: Option<usize>,
    /// Record the engine's metrics in a Prometheus recorder (nothing is served), to
    /// measure what recording costs; without it no recorder is installed.
    #[arg(long)]
    metrics_recorder: bool,
}

/// Counts the detached tasks still running; `all_done` waits for the last.
#[derive(Default)]
struct Running {
    count: std::cell::Cell<usize>,
    zero: tokio::sync::Notify,
}

/// One running task's share of [`Running`].
struct Done(Rc<Running>);

impl Running {
    fn start(self: &Rc<Self>) -> Done {
        self.count.set(self.count.get() + 1);
        Done(self.clone())
    }

    async fn all_done(&self) {
        while self.count.get() > 0 {
            self.zero.notified().await;
        }
    }
}

impl Done {
    fn finish(self) {
        let running = &self.0;
        running.count.set(running.count.get() - 1);
        if running.count.get() == 0 {
            running.zero.notify_one();
        }
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

impl Tally {
    fn count(
        &mut self,
        t0: Instant,
        outcome: Result<Result<(), proctor::Failure>, proctor::Error>,
    ) {
        let micros = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
        if let Some(h) = self.latency_us.as_mut() {
            h.saturating_record(micros);
        }
        match outcome {
            Ok(Ok(())) => self.success += 1,
            Ok(Err(_)) => self.rolled_back += 1,
            Err(e) => {
                self.failed += 1;
                self.violations
                    .push(format!("a root ended with an engine error: {e}"));
            }
        }
    }
}

/// The engine allocates a few small objects per step; mimalloc makes that cheaper than
/// the system allocator, kept from giving freed memory back to the system. The library
/// leaves this choice to the program that uses it.
#[path = "../../benches/common/allocator.rs"]
mod allocator;

#[actix::main]
async fn main() -> ExitCode {
    allocator::keep_freed_memory();
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
    if (args.store == StoreKind::Postgres) != args.pg.is_some() {
        return Err("--pg URL goes with --store postgres, and only with it".into());
    }
    if args.standby && args.store != StoreKind::Postgres {
        return Err("--standby needs --store postgres (the leader lease lives there)".into());
    }
    if args.join
        && (args.store != StoreKind::Postgres
            || args.standby
            || args.resume
            || args.dag.is_some()
            || args.remote > 0)
    {
        return Err(
            "--join needs --store postgres, and takes neither --standby, --resume, --dag nor \
             --remote"
                .into(),
        );
    }
    // A standby submits nothing: it runs what the leader left.
    let resume = args.resume || args.standby;
    if args.resume && args.store == StoreKind::Memory {
        return Err("--resume needs a persistent store; the memory store keeps nothing".into());
    }
    if args.locks == Some(0) {
        return Err("--locks must be at least 1".into());
    }
    if !(0.0..=1.0).contains(&args.irreversible_rate) {
        return Err(format!(
            "--irreversible-rate must be within 0..1, not {}",
            args.irreversible_rate
        )
        .into());
    }
    if args.dag == Some(0) {
        return Err("--dag must be at least 1".into());
    }
    if args.dag.is_some() && (args.children > 0 || args.locks.is_some()) {
        return Err("--dag does not combine with --children or --locks".into());
    }
    if args.metrics_recorder {
        metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    }
    let ledger = match args.ledger.as_deref() {
        Some(path) => {
            Some(Ledger::open(path).map_err(|e| format!("ledger {}: {e}", path.display()))?)
        }
        None => None,
    };
    let env = Arc::new(Env::new(ledger));
    if args.join {
        return join::run(&args, env).await;
    }
    // The remote nodes serve any run: a resumed one carries on the operations its
    // recovered procedures sent.
    let nodes = Nodes::new(
        env.clone(),
        args.remote_latency_ms,
        args.remote_fail_rate,
        args.seed,
    )?;
    let mut builder = Executor::builder()
        .registry(registry())
        .workers(args.workers)
        .env(env.clone())
        .remote(
            ToNodes(nodes.clone()),
            proctor::RemoteOptions::default().max_age(Duration::from_millis(args.remote_batch_ms)),
        );
    if let Some(n) = args.shards {
        builder = builder.arbiters(n);
    }
    if let Some(ms) = args.retention_ms {
        builder = builder
            .retention(Duration::from_millis(ms))
            .cleaner_interval(Duration::from_millis((ms / 2).clamp(10, 1000)));
    }
    // A temp dir lives until the end of the run when no --dir is given.
    let temp = match &args.dir {
        Some(_) => None,
        None => Some(tempfile::tempdir()?),
    };
    let dir = args.dir.clone().unwrap_or_else(|| {
        temp.as_ref()
            .map(|t| t.path().to_path_buf())
            .unwrap_or_default()
    });
    let wal_stats = Arc::new(Mutex::new(WalStats::default()));
    // What to expect of the roots already in the store comes from their own records.
    let shapes: Rc<RefCell<HashMap<ProcId, Shape>>> = Rc::default();
    // (The PostgreSQL store is read once this engine leads, below.)
    if args.verify && !matches!(args.store, StoreKind::Memory | StoreKind::Postgres) {
        *shapes.borrow_mut() = stored_shapes(&args, &dir, None)?;
    }
    let executor = match args.store {
        StoreKind::Memory => builder.store(MemoryStore::new()).start().await?,
        StoreKind::Wal => {
            let defaults = WalOptions::default();
            let options = WalOptions {
                segment_bytes: args.segment_bytes.unwrap_or(defaults.segment_bytes),
                max_segments: args.max_segments.unwrap_or(defaults.max_segments),
                ..defaults
            };
            if options.max_segments < 2 || options.segment_bytes < 4096 {
                return Err(
                    "--max-segments must be at least 2 and --segment-bytes at least 4096".into(),
                );
            }
            let wal = WalStore::open_with(&dir, options)?;
            let stats = wal_stats.clone();
            builder.store(ProbedWal { wal, stats }).start().await?
        }
        StoreKind::FilePerProc => {
            builder
                .store(FilePerProcStore::open(dir.clone())?)
                .start()
                .await?
        }
        StoreKind::Postgres => {
            let url = args.pg.clone().unwrap_or_default();
            let holder = args
                .holder
                .clone()
                .unwrap_or_else(|| format!("workload-{}", std::process::id()));
            let options = proctor::PgOptions::default().schema(&args.pg_schema);
            let lease = proctor::PgLease::new(url, holder)
                .options(options)
                .period(Duration::from_millis(args.lease_ms));
            let executor = builder
                .store(pg_store(&args)?)
                .leadership(lease)
                .start()
                .await?;
            let epoch = match executor.role().await? {
                proctor::Role::Leader { epoch, holder } => {
                    eprintln!("workload: {holder} leads (lease epoch {epoch})");
                    Some(epoch)
                }
                _ => None,
            };
            if args.verify {
                *shapes.borrow_mut() = stored_shapes(&args, &dir, epoch)?;
            }
            executor
        }
    };
    let _ = nodes.executor.set(executor.clone());
    if let Some(addr) = args.admin {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        eprintln!(
            "workload: the admin page on http://{}/procedures",
            listener.local_addr()?
        );
        actix::spawn(proctor::admin::AdminConfig::default().serve_on(listener, executor.clone()));
    }
    let recovery = executor.recovery().clone();
    let shards = executor.scheduler_stats().await?.shards;
    // The operator: continues every procedure that pauses (DAG tasks that failed past
    // a point of no return; their fault fires once per process).
    let continued = if args.dag.is_some() || resume {
        dag::continue_every_pause(&executor).await?
    } else {
        Rc::default()
    };
    for corrupt in &recovery.corrupt {
        eprintln!(
            "corrupt: procedure {} (root {}): {}",
            corrupt.id, corrupt.root, corrupt.reason
        );
    }
    let started = Instant::now();
    let cpu_started = rss::cpu_s();
    let tally = Rc::new(RefCell::new(Tally {
        latency_us: Some(Histogram::new_with_bounds(1, 3_600_000_000, 3)?),
        ..Tally::default()
    }));
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let window = Arc::new(Semaphore::new(args.concurrency.max(1)));
    // Tasks are detached and counted (a million join handles would keep a million
    // finished tasks in memory).
    let running = Rc::new(Running::default());
    // Recovered roots are waited for like submitted ones (their latency counts from now).
    for &id in &recovery.recovered_roots {
        let executor = executor.clone();
        let tally = tally.clone();
        let done = running.start();
        actix::spawn(async move {
            let t0 = Instant::now();
            let outcome = executor.wait(id).await;
            tally.borrow_mut().count(t0, outcome);
            done.finish();
        });
    }
    let to_submit = if resume { 0 } else { args.procs };
    for _ in 0..to_submit {
        let (proc, shape): (Box<dyn proctor::Procedure<Env>>, Shape) = match args.dag {
            Some(width) => {
                let dag = dag::generate(&mut rng, width, args.fail_rate, args.irreversible_rate);
                let shape = Shape::of_dag(&dag);
                (Box::new(dag), shape)
            }
            None => {
                let fail = (rng.f64() < args.fail_rate)
                    .then(|| (rng.u16(0..=args.children), rng.u16(0..args.steps)));
                let lock = args.locks.map(|n| rng.u32(0..n));
                let work =
                    Work::root(args.steps, args.children, fail, lock).with_remote(args.remote);
                let shape = Shape::of(&work);
                (Box::new(StateMachine::new(work)), shape)
            }
        };
        let permit = window.clone().acquire_owned().await?;
        let executor = executor.clone();
        let tally = tally.clone();
        let shapes = shapes.clone();
        let verify = args.verify;
        let done = running.start();
        actix::spawn(async move {
            let t0 = Instant::now();
            let submitted = executor.submit_boxed(proc).await;
            let outcome = match submitted {
                Ok(id) => {
                    if verify {
                        shapes.borrow_mut().insert(id, shape);
                    }
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
            done.finish();
        });
    }
    running.all_done().await;
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_s = rss::cpu_s() - cpu_started;
    // Every task has finished: the shared cells are ours alone now.
    let shapes = shapes.take();
    let mut tally = tally.take();
    let lock_conflicts = env.lock_conflicts.load(Ordering::Relaxed);
    if lock_conflicts > 0 {
        tally.violations.push(format!(
            "{lock_conflicts} steps ran inside a resource another tree held"
        ));
    }

    let mut evicted = 0;
    if args.verify {
        evicted = verify(&executor, &env, &shapes, &mut tally).await?;
        for corrupt in &recovery.corrupt {
            tally.violations.push(format!(
                "procedure {} could not be recovered: {}",
                corrupt.id, corrupt.reason
            ));
        }
    }
    for v in tally.violations.iter().take(20) {
        eprintln!("violation: {v}");
    }
    let steps = env.steps.load(Ordering::Relaxed);
    let finished = tally.success + tally.rolled_back;
    let latency = tally.latency_us.as_ref().expect("histogram");
    let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    let wal = *wal_stats.lock().unwrap_or_else(|e| e.into_inner());
    let (wal_dir_bytes, wal_segments) = if args.store == StoreKind::Wal {
        wal_dir_size(&dir)?
    } else {
        (0, 0)
    };
    let report = serde_json::json!({
        "store": match args.store {
            StoreKind::Wal => "wal",
            StoreKind::Memory => "memory",
            StoreKind::FilePerProc => "file-per-proc",
            StoreKind::Postgres => "postgres",
        },
        "shards": shards,
        "submitted": to_submit,
        "recovered": recovery.recovered_roots.len(),
        "corrupt": recovery.corrupt.len(),
        "success": tally.success,
        "rolled_back": tally.rolled_back,
        "failed": tally.failed,
        "steps": steps,
        "wall_s": round3(wall_s),
        "procs_per_s": round3(finished as f64 / wall_s),
        "steps_per_s": round3(steps as f64 / wall_s),
        "cpu_s": round3(cpu_s),
        "cpu_us_per_step": if steps > 0 { round3(cpu_s * 1e6 / steps as f64) } else { 0.0 },
        "p50_ms": round3(ms(0.50)),
        "p99_ms": round3(ms(0.99)),
        "wal_bytes": wal.bytes_appended,
        "wal_bytes_per_step": if steps > 0 { round3(wal.bytes_appended as f64 / steps as f64) } else { 0.0 },
        "wal_syncs": wal.appends,
        "wal_dir_bytes": wal_dir_bytes,
        "wal_segments": wal_segments,
        "wal_live_bytes": wal.live_bytes,
        "wal_largest_frame": wal.largest_frame,
        "peak_rss_mb": round3(rss::peak_rss_mb()),
        "lock_conflicts": lock_conflicts,
        "evicted": evicted,
        "continued": continued.get(),
        "remote_requests": nodes.stats.requests.load(Ordering::Relaxed),
        "remote_failed_requests": nodes.stats.failed_requests.load(Ordering::Relaxed),
        "remote_applied": nodes.stats.applied.load(Ordering::Relaxed),
        "remote_repeats": nodes.stats.repeats.load(Ordering::Relaxed),
        "remote_failed_ops": nodes.stats.failed_ops.load(Ordering::Relaxed),
        "violations": tally.violations.len(),
    });
    println!("{report}");
    Ok(if tally.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The WAL directory at the end of the run: bytes of all its files, and how many are
/// segments.
fn wal_dir_size(dir: &std::path::Path) -> std::io::Result<(u64, u64)> {
    let (mut bytes, mut segments) = (0, 0);
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        bytes += entry.metadata()?.len();
        if entry.path().extension().is_some_and(|e| e == "wal") {
            segments += 1;
        }
    }
    Ok((bytes, segments))
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// What verification expects of one root: the ledger effects of its tree if it
/// succeeds, whether its plan makes it succeed (`None`: a DAG whose failure may come
/// before or after a point of no return), and a DAG's plan.
#[derive(Clone, Debug)]
struct Shape {
    effects: usize,
    succeeds: Option<bool>,
    dag: Option<dag::Plan>,
}

impl Shape {
    fn of(work: &Work) -> Self {
        Shape {
            effects: work.effects(),
            succeeds: Some(work.fail.is_none()),
            dag: None,
        }
    }

    fn of_dag(d: &proctor::Dag<dag::Step>) -> Self {
        let plan = dag::Plan::of(d);
        Shape {
            effects: plan.width,
            succeeds: plan.fail.is_none().then_some(true),
            dag: Some(plan),
        }
    }
}

/// The PostgreSQL store of `--pg` and `--pg-schema`.
fn pg_store(args: &Args) -> Result<proctor::PgStore, proctor::store::StoreError> {
    let url = args.pg.as_deref().unwrap_or_default();
    let options = proctor::PgOptions::default().schema(&args.pg_schema);
    proctor::PgStore::connect_with(url, options)
}

/// The shapes of the roots already in the store, from their persisted state, read
/// before the engine opens the store (the PostgreSQL store: once it leads, under the
/// lease's `epoch`).
fn stored_shapes(
    args: &Args,
    dir: &std::path::Path,
    epoch: Option<i64>,
) -> Result<HashMap<ProcId, Shape>, Box<dyn std::error::Error>> {
    let snapshot = match args.store {
        StoreKind::Memory => return Ok(HashMap::new()),
        StoreKind::Wal => WalStore::open(dir)?.load()?,
        StoreKind::FilePerProc => FilePerProcStore::open(dir.to_path_buf())?.load()?,
        StoreKind::Postgres => {
            // Read as the lease's holder: the engine's own store is fenced the same.
            let mut store = pg_store(args)?;
            store.fence(epoch)?;
            store.load()?
        }
    };
    let mut shapes = HashMap::new();
    for record in snapshot.records.into_iter().filter(|r| r.parent.is_none()) {
        let undecodable = |e| format!("root {}: cannot decode its state: {e}", record.id);
        let shape = if record.type_name == dag::DAG_TYPE {
            let d: proctor::Dag<dag::Step> =
                rmp_serde::from_slice(&record.data).map_err(undecodable)?;
            Shape::of_dag(&d)
        } else {
            let machine: StateMachine<Work, Env> =
                rmp_serde::from_slice(&record.data).map_err(undecodable)?;
            Shape::of(machine.machine())
        };
        shapes.insert(record.id, shape);
    }
    Ok(shapes)
}

/// Every root is finished, in the state its plan says, and the ledger holds exactly the
/// effects of the successful roots. Returns how many roots the engine had evicted
/// (`--retention-ms`): those are checked against the ledger alone.
async fn verify(
    executor: &Executor<Env>,
    env: &Env,
    shapes: &HashMap<ProcId, Shape>,
    tally: &mut Tally,
) -> Result<u64, Box<dyn std::error::Error>> {
    let mut known = HashMap::new();
    for info in executor.list(proctor::List::new().with_finished()).await? {
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
        let problem = match (state, shapes.get(id).map(|s| s.succeeds)) {
            (ProcState::Success, Some(Some(false))) => {
                Some("succeeded though it was planned to fail")
            }
            (ProcState::RolledBack, Some(Some(true))) => Some("rolled back though nothing failed"),
            (_, None) => Some("has no known shape"),
            _ => None,
        };
        if let Some(problem) = problem {
            tally
                .violations
                .push(format!("root {id} ({state}) {problem}"));
        }
    }
    if let Some(ledger) = &env.ledger {
        tally.violations.extend(ledger.fence_violations()?);
        tally
            .violations
            .extend(work::remote_violations(&ledger.applications()?));
    }
    let mut effects = match &env.ledger {
        Some(ledger) => ledger.effects_per_root()?,
        None => known.keys().map(|id| (id.0, 0)).collect(),
    };
    // DAG roots: the order of undos and the points of no return, from the history.
    if let Some(ledger) = &env.ledger {
        if shapes.values().any(|s| s.dag.is_some()) {
            let traces = dag::traces(&ledger.history()?);
            let none = dag::Trace::default();
            for (id, state) in &known {
                if let Some(plan) = shapes.get(id).and_then(|s| s.dag.as_ref()) {
                    let trace = traces.get(&id.0).unwrap_or(&none);
                    tally
                        .violations
                        .extend(dag::violations(*id, *state, plan, trace));
                }
            }
        }
    }
    let planned = shapes
        .iter()
        .map(|(&id, s)| (id, (s.succeeds, s.effects)))
        .collect();
    let evicted = work::check_evicted(executor, env, &planned, &known, &mut effects).await?;
    tally.violations.extend(evicted.violations);
    let ledger = env.ledger.is_some();
    let expect = |id: ProcId| match shapes.get(&id) {
        Some(shape) if ledger => shape.effects,
        _ => 0,
    };
    tally
        .violations
        .extend(work::ledger_violations(&known, &effects, expect));
    Ok(evicted.count)
}
