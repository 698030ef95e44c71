//! `--join`: the workload as one member of a cluster of executors over PostgreSQL.
//!
//! The process joins the cluster in `--pg`/`--pg-schema` (creating it with
//! `--partitions` partitions if it is the first), submits its `--procs` roots through
//! itself (a root that locks `res/K` goes to that resource's partition, wherever its
//! owner is; one without a lock to a partition this member runs), waits for each, and
//! leaves, handing its partitions to the others. With `--verify` it then waits until
//! every root in the store has finished (so the last member to verify, with
//! `--procs 0`, runs what the others left) and checks, across every process: each root
//! SUCCESS or ROLLEDBACK as its plan says, each acknowledged root in the store, the
//! ledger's effects all or none per root, its tokens in order per partition, and no
//! two trees inside one resource at once. Its JSON line adds `member`, `partitions`,
//! `partitions_moved` (changes of owner between members in the cluster's history),
//! `ledger_refusals` (late changes the ledger refused), `lock_conflicts` and
//! `violations`.

use std::cell::RefCell;
use std::process::ExitCode;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use proctor::{Cluster, Executor, PgOptions, StateMachine};
use tokio::sync::Semaphore;

use crate::work::{registry, Env, Work};
use crate::{round3, rss, Args, Running, Tally};

pub async fn run(args: &Args, env: Arc<Env>) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let url = args.pg.clone().unwrap_or_default();
    let name = args
        .holder
        .clone()
        .unwrap_or_else(|| format!("workload-{}", std::process::id()));
    let options = PgOptions::default().schema(&args.pg_schema);
    let period = Duration::from_millis(args.lease_ms);
    let (workers, shards, retention) = (args.workers, args.shards, args.retention_ms);
    let engine_env = env.clone();
    let cluster = Cluster::builder(url.clone(), name.clone())
        .options(options.clone())
        .partitions(args.partitions)
        .period(period)
        .engines(move || {
            let mut builder = Executor::builder()
                .registry(registry())
                .workers(workers)
                .arbiters(shards.unwrap_or(1))
                .env(engine_env.clone());
            if let Some(ms) = retention {
                builder = builder
                    .retention(Duration::from_millis(ms))
                    .cleaner_interval(Duration::from_millis((ms / 2).clamp(10, 1000)));
            }
            builder
        })
        .start()
        .await?;
    // Roots without a lock run where they are submitted: own a partition first.
    let _ = tokio::time::timeout(2 * period, cluster.wait_owning()).await;
    eprintln!(
        "workload: {name} joined the cluster ({} partitions), owning {:?}",
        cluster.partitions(),
        cluster.owned()
    );
    let started = Instant::now();
    let cpu_started = rss::cpu_s();
    let tally = Rc::new(RefCell::new(Tally {
        latency_us: Some(Histogram::new_with_bounds(1, 3_600_000_000, 3)?),
        ..Tally::default()
    }));
    let mut rng = fastrand::Rng::with_seed(args.seed);
    let window = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let running = Rc::new(Running::default());
    for _ in 0..args.procs {
        let fail = (rng.f64() < args.fail_rate)
            .then(|| (rng.u16(0..=args.children), rng.u16(0..args.steps)));
        let lock = args.locks.map(|n| rng.u32(0..n));
        let work = Work::root(args.steps, args.children, fail, lock);
        let permit = window.clone().acquire_owned().await?;
        let cluster = cluster.clone();
        let tally = tally.clone();
        let env = env.clone();
        let done = running.start();
        actix::spawn(async move {
            let t0 = Instant::now();
            let outcome = match cluster.submit(StateMachine::new(work)).await {
                Ok(id) => {
                    if let Some(ledger) = &env.ledger {
                        if let Err(e) = ledger.acknowledged(id.0) {
                            tally.borrow_mut().violations.push(format!("ledger: {e}"));
                        }
                    }
                    cluster.wait(id).await
                }
                Err(e) => Err(e),
            };
            tally.borrow_mut().count(t0, outcome);
            drop(permit);
            done.finish();
        });
    }
    running.all_done().await;
    let wall_s = started.elapsed().as_secs_f64();
    let cpu_s = rss::cpu_s() - cpu_started;
    let mut tally = tally.take();
    if args.verify {
        // Every root of every member finished, and nothing forwarded waits.
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut quiet = 0;
        while quiet < 2 {
            let (unfinished, waiting) = cluster.unfinished().await?;
            quiet = if unfinished == 0 && waiting == 0 {
                quiet + 1
            } else {
                0
            };
            if Instant::now() > deadline {
                tally.violations.push(format!(
                    "{unfinished} roots unfinished and {waiting} forwarded submits waiting after 600 s"
                ));
                break;
            }
            tokio::time::sleep(period / 3).await;
        }
    }
    let state = cluster.state().await?;
    cluster.leave().await?;
    // In-process detection counts a tree that moved to another member as still
    // inside its resource here: the ledger's spans, across processes, replace it.
    let mut lock_conflicts = if env.ledger.is_some() {
        0
    } else {
        env.lock_conflicts.load(Ordering::Relaxed)
    };
    if args.verify {
        let (violations, conflicts) = verify(&url, &options, &env).await?;
        tally.violations.extend(violations);
        lock_conflicts += conflicts;
    }
    for v in tally.violations.iter().take(20) {
        eprintln!("violation: {v}");
    }
    let steps = env.steps.load(Ordering::Relaxed);
    let latency = tally.latency_us.as_ref().expect("histogram");
    let ms = |q: f64| latency.value_at_quantile(q) as f64 / 1000.0;
    let finished = tally.success + tally.rolled_back;
    let report = serde_json::json!({
        "store": "postgres",
        "member": name,
        "partitions": cluster.partitions(),
        "submitted": args.procs,
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
        "peak_rss_mb": round3(rss::peak_rss_mb()),
        "partitions_moved": state.moves,
        // Changes the ledger refused as late (a member's after its partition moved).
        "ledger_refusals": match &env.ledger {
            Some(ledger) => ledger.refusals()?,
            None => 0,
        },
        "lock_conflicts": lock_conflicts,
        "violations": tally.violations.len(),
    });
    println!("{report}");
    Ok(if tally.violations.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The checks across every process (see `work::check_cluster`): the violations, and
/// how many of them are lock conflicts.
async fn verify(
    url: &str,
    options: &PgOptions,
    env: &Env,
) -> Result<(Vec<String>, u64), Box<dyn std::error::Error>> {
    let (url, options) = (url.to_string(), options.clone());
    let (snapshot, _) =
        tokio::task::spawn_blocking(move || proctor::PgStore::inspect(&url, &options)).await??;
    match &env.ledger {
        Some(ledger) => Ok(crate::work::check_cluster(&snapshot.records, ledger)?),
        None => Ok(crate::work::check_cluster_states(&snapshot.records)),
    }
}
