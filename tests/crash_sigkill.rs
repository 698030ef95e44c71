//! A real crash test (in the manner of sled's): the test binary runs itself again as a
//! child process that recovers a WAL directory and keeps submitting workload trees
//! (children, injected failures, a ledger of side effects); the parent kills it with
//! SIGKILL at a random moment, several times over the same directory, then recovers it
//! one last time and checks the ledger: every root SUCCESS or ROLLEDBACK, all effects
//! of the successful ones, none of the rolled-back ones, none of unknown procedures.
//! The same with DAG roots (failures, points of no return, the child and the last
//! recovery continuing what pauses): rolled-back DAGs undid their tasks against the
//! edges and never past a point of no return. The trees' roots also send one remote
//! operation per step to in-process nodes, which apply each operation once (they
//! deduplicate by op id, remembering in the ledger): after the kills no operation was
//! applied twice, though operations a kill left unreported were sent again, and no
//! step's operation was applied under two op ids.

#[path = "../examples/workload/dag.rs"]
mod dag;
#[path = "../examples/workload/ledger.rs"]
#[allow(dead_code)]
mod ledger;
#[path = "../examples/workload/nodes.rs"]
mod nodes;
#[path = "../examples/workload/work.rs"]
#[allow(dead_code)]
mod work;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use proctor::{Executor, ProcState, ProcedureStore, StateMachine, WalStore};

use ledger::Ledger;
use work::{Env, Work};

const DIR_VAR: &str = "PROCTOR_CRASH_CHILD_DIR";
const SEED_VAR: &str = "PROCTOR_CRASH_CHILD_SEED";
/// Set: the child submits DAGs of this many tasks instead of trees.
const DAG_VAR: &str = "PROCTOR_CRASH_CHILD_DAG";
/// Set: the child's engine evicts results this many ms after their roots finish.
const RETENTION_VAR: &str = "PROCTOR_CRASH_CHILD_RETENTION_MS";
const STEPS: u16 = 3;
const CHILDREN: u16 = 2;
/// Each tree locks one of these resources for its life (`res/<k>`).
const LOCKS: u32 = 8;
/// Each step of a tree's root sends an operation to one of these remote nodes.
const REMOTE_TARGETS: u16 = 4;

/// The two tests here run side by side: one spawns children while the other opens a
/// WAL. A child holds a copy of this process's descriptors, a WAL's lock included, until
/// its exec closes them, and Linux lets the spawning thread go on a moment before that.
/// A log dropped and reopened in that moment would find its lock still held. So each
/// child lives, from spawn to exit, with this mutex held, and every open takes it.
static FORK: Mutex<()> = Mutex::new(());

fn open_wal(dir: &Path) -> WalStore {
    let _serial = FORK.lock().unwrap_or_else(PoisonError::into_inner);
    WalStore::open(dir).expect("open WAL")
}

async fn executor(dir: &Path, retention: Option<Duration>) -> (Executor<Env>, Arc<Env>) {
    let env = Arc::new(Env::new(Some(
        Ledger::open(&dir.join("ledger")).expect("ledger"),
    )));
    let mut builder = Executor::builder()
        .registry(work::registry())
        .store(open_wal(&dir.join("wal")))
        .env(env.clone())
        .workers(32);
    if let Some(kept) = retention {
        builder = builder
            .retention(kept)
            .cleaner_interval(Duration::from_millis(20));
    }
    let nodes = nodes::Nodes::new(env.clone(), 2, 0.05, 1).expect("nodes");
    let remote = proctor::RemoteOptions::default().max_age(Duration::from_millis(5));
    let builder = builder.remote(nodes::ToNodes(nodes.clone()), remote);
    let executor = builder.start().await.expect("recovery succeeds");
    let _ = nodes.executor.set(executor.clone());
    (executor, env)
}

/// The child: does nothing unless the parent set the variables.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(DIR_VAR) else {
        return;
    };
    let seed: u64 = std::env::var(SEED_VAR).unwrap().parse().unwrap();
    let dag_width: Option<u16> = std::env::var(DAG_VAR).ok().map(|w| w.parse().unwrap());
    let retention = std::env::var(RETENTION_VAR)
        .ok()
        .map(|ms| Duration::from_millis(ms.parse().unwrap()));
    actix::System::new().block_on(async move {
        let (executor, _env) = executor(Path::new(&dir), retention).await;
        if dag_width.is_some() {
            dag::continue_every_pause(&executor).await.unwrap();
        }
        println!("ready");
        // With a retention: the first root seen to succeed, and whether its eviction
        // was told (once, on stdout, when `state` answers `Gone`: its delete is durable).
        let evicted = Arc::new(Mutex::new((None, retention.is_none())));
        let mut rng = fastrand::Rng::with_seed(seed);
        let window = Arc::new(tokio::sync::Semaphore::new(200));
        loop {
            let proc: Box<dyn proctor::Procedure<Env>> = match dag_width {
                Some(width) => Box::new(dag::generate(&mut rng, width, 0.3, 0.15)),
                None => {
                    let fail =
                        (rng.f64() < 0.2).then(|| (rng.u16(0..=CHILDREN), rng.u16(0..STEPS)));
                    let lock = Some(rng.u32(0..LOCKS));
                    let work = Work::root(STEPS, CHILDREN, fail, lock).with_remote(REMOTE_TARGETS);
                    Box::new(StateMachine::new(work))
                }
            };
            let permit = window.clone().acquire_owned().await.unwrap();
            let executor = executor.clone();
            let evicted = evicted.clone();
            actix::spawn(async move {
                let submit = proctor::messages::Submit::boxed(proc);
                if let Ok(Ok(id)) = executor.addr().unwrap().send(submit).await {
                    let succeeded = matches!(executor.wait(id).await, Ok(Ok(())));
                    tell_eviction(&executor, &evicted, succeeded.then_some(id)).await;
                }
                drop(permit);
            });
        }
    });
}

/// The child's evidence of an eviction, looked for each time one of its roots finishes
/// (`succeeded`: that root, if it succeeded): prints `evicted ID` once the first root
/// seen to succeed is gone, so its effects are in the ledger and its records out of the
/// store. `evicted` holds that root and whether it was told (or need not be).
async fn tell_eviction(
    executor: &Executor<Env>,
    evicted: &Mutex<(Option<proctor::ProcId>, bool)>,
    succeeded: Option<proctor::ProcId>,
) {
    let first = {
        let mut evicted = evicted.lock().unwrap_or_else(PoisonError::into_inner);
        let (first, told) = &mut *evicted;
        if *told {
            return;
        }
        match first.or(succeeded) {
            Some(id) => *first.insert(id),
            None => return,
        }
    };
    if matches!(executor.state(first).await, Err(proctor::Error::Gone(_))) {
        let mut evicted = evicted.lock().unwrap_or_else(PoisonError::into_inner);
        if !evicted.1 {
            evicted.1 = true;
            println!("evicted {first}");
        }
    }
}

/// Runs the child over `dir` `rounds` times, each killed with SIGKILL at a random
/// moment once it is ready (and, with a retention, once it has evicted a result).
fn kill_repeatedly(dir: &Path, rounds: u32, dag_width: Option<u16>) {
    kill_repeatedly_with(dir, rounds, dag_width, None);
}

/// As [`kill_repeatedly`], the child's engine evicting results `retention_ms` after
/// their roots finish, if given.
fn kill_repeatedly_with(
    dir: &Path,
    rounds: u32,
    dag_width: Option<u16>,
    retention_ms: Option<u64>,
) {
    let mut rng = fastrand::Rng::with_seed(7);
    for round in 0..rounds {
        let mut command = Command::new(std::env::current_exe().unwrap());
        command
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(DIR_VAR, dir)
            .env(SEED_VAR, round.to_string())
            .stdout(Stdio::piped());
        if let Some(width) = dag_width {
            command.env(DAG_VAR, width.to_string());
        }
        if let Some(ms) = retention_ms {
            command.env(RETENTION_VAR, ms.to_string());
        }
        let _serial = FORK.lock().unwrap_or_else(PoisonError::into_inner);
        let mut child = command.spawn().expect("spawn the child");
        // Wait for the child to have recovered and started submitting.
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines().map_while(Result::ok);
        let ready = lines.any(|line| line.ends_with("ready"));
        assert!(ready, "round {round}: the child failed before it was ready");
        if retention_ms.is_some() {
            // The evidence the test needs of the child, however slow the machine.
            let evicted = lines.any(|line| line.starts_with("evicted "));
            assert!(evicted, "round {round}: the child ended before it evicted");
        }
        // The random moment is the point of the test.
        std::thread::sleep(Duration::from_millis(rng.u64(20..400)));
        child.kill().expect("SIGKILL");
        child.wait().unwrap();
    }
}

/// The roots the executor knows (all finished), with their states.
async fn finished_roots(executor: &Executor<Env>) -> HashMap<proctor::ProcId, ProcState> {
    executor
        .list(proctor::List::new().with_finished())
        .await
        .unwrap()
        .into_iter()
        .filter(|p| p.parent.is_none())
        .map(|p| (p.id, p.state))
        .collect()
}

#[test]
fn sigkill_at_random_moments_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    kill_repeatedly(dir.path(), 10, None);

    actix::System::new().block_on(async {
        let (executor, env) = executor(dir.path(), None).await;
        let recovery = executor.recovery().clone();
        assert!(recovery.corrupt.is_empty(), "{:?}", recovery.corrupt);
        assert!(
            !recovery.recovered_roots.is_empty(),
            "a kill mid-run leaves work to recover"
        );
        for id in &recovery.recovered_roots {
            let _ = executor.wait(*id).await.expect("recovered root finishes");
        }
        let roots = finished_roots(&executor).await;
        let rolled_back = roots
            .values()
            .filter(|s| **s == ProcState::RolledBack)
            .count();
        assert!(rolled_back > 0, "failures were injected");
        assert!(roots.len() > rolled_back, "and most roots succeeded");
        let effects = env.ledger.as_ref().unwrap().effects_per_root().unwrap();
        let per_root = usize::from(STEPS) * (1 + usize::from(CHILDREN));
        let violations = work::ledger_violations(&roots, &effects, |_| per_root);
        assert_eq!(
            env.lock_conflicts.load(Ordering::Relaxed),
            0,
            "lock conflicts"
        );
        assert!(
            violations.is_empty(),
            "{} violations over {} roots, first: {:?}",
            violations.len(),
            roots.len(),
            &violations[..violations.len().min(5)]
        );
        let applied = env.ledger.as_ref().unwrap().applications().unwrap();
        assert!(
            applied.len() > roots.len(),
            "the roots' steps sent operations"
        );
        let twice = work::remote_violations(&applied);
        assert!(twice.is_empty(), "applied more than once: {twice:?}");
        executor.shutdown_now().await.unwrap();
    });
}

#[test]
fn sigkill_during_dags_loses_nothing_and_never_rolls_back_past_a_point_of_no_return() {
    const WIDTH: u16 = 10;
    let dir = tempfile::tempdir().unwrap();
    kill_repeatedly(dir.path(), 6, Some(WIDTH));

    // What each root must come to, from its persisted state, as `workload --resume
    // --verify` reads it.
    let snapshot = open_wal(&dir.path().join("wal")).load().unwrap();
    let plans: HashMap<proctor::ProcId, dag::Plan> = snapshot
        .records
        .iter()
        .filter(|r| r.parent.is_none())
        .map(|r| {
            assert_eq!(r.type_name, dag::DAG_TYPE);
            let d: proctor::Dag<dag::Step> = rmp_serde::from_slice(&r.data).unwrap();
            (r.id, dag::Plan::of(&d))
        })
        .collect();
    actix::System::new().block_on(async {
        let (executor, env) = executor(dir.path(), None).await;
        let recovery = executor.recovery().clone();
        assert!(recovery.corrupt.is_empty(), "{:?}", recovery.corrupt);
        dag::continue_every_pause(&executor).await.unwrap();
        let all_finish = async {
            for id in &recovery.recovered_roots {
                let _ = executor.wait(*id).await.expect("recovered root finishes");
            }
        };
        if tokio::time::timeout(Duration::from_secs(120), all_finish)
            .await
            .is_err()
        {
            let stuck = executor.list(proctor::List::new()).await.unwrap();
            panic!("recovered DAGs did not finish in 120 s; unfinished: {stuck:#?}");
        }
        let roots = finished_roots(&executor).await;
        assert_eq!(roots.len(), plans.len(), "every root in the log is known");
        let ledger = env.ledger.as_ref().unwrap();
        let effects = ledger.effects_per_root().unwrap();
        let mut violations = work::ledger_violations(&roots, &effects, |id| plans[&id].width);
        let traces = dag::traces(&ledger.history().unwrap());
        let none = dag::Trace::default();
        let mut outcomes: HashMap<(bool, ProcState), usize> = HashMap::new();
        for (id, state) in &roots {
            let plan = &plans[id];
            *outcomes.entry((plan.fail.is_some(), *state)).or_default() += 1;
            let trace = traces.get(&id.0).unwrap_or(&none);
            violations.extend(dag::violations(*id, *state, plan, trace));
        }
        assert!(
            violations.is_empty(),
            "{} violations over {} DAGs, first: {:?}",
            violations.len(),
            roots.len(),
            &violations[..violations.len().min(5)]
        );
        // All three ends were reached: no failure, a failure rolled back, and a failure
        // past a point of no return paused, continued and finished.
        for end in [
            (false, ProcState::Success),
            (true, ProcState::RolledBack),
            (true, ProcState::Success),
        ] {
            assert!(
                outcomes.contains_key(&end),
                "no DAG ended {end:?}: {outcomes:?}"
            );
        }
        executor.shutdown_now().await.unwrap();
    });
}

/// With results evicted soon after their roots finish (as `workload --retention-ms`
/// runs), the roots that earlier processes evicted are in the store no more: the final
/// check tells them (ids the engine issued, their effects all or none in the ledger)
/// from roots it never knew, which it used to report by the thousand.
#[test]
fn sigkill_with_results_evicted_loses_nothing_and_tells_evicted_from_unknown() {
    let dir = tempfile::tempdir().unwrap();
    kill_repeatedly_with(dir.path(), 6, None, Some(100));

    actix::System::new().block_on(async {
        let (executor, env) = executor(dir.path(), None).await;
        let recovery = executor.recovery().clone();
        assert!(recovery.corrupt.is_empty(), "{:?}", recovery.corrupt);
        for id in &recovery.recovered_roots {
            let _ = executor.wait(*id).await.expect("recovered root finishes");
        }
        let roots = finished_roots(&executor).await;
        let mut effects = env.ledger.as_ref().unwrap().effects_per_root().unwrap();
        let evicted = work::check_evicted(&executor, &env, &HashMap::new(), &roots, &mut effects)
            .await
            .unwrap();
        assert!(evicted.count > 0, "earlier processes evicted results");
        let per_root = usize::from(STEPS) * (1 + usize::from(CHILDREN));
        let mut violations = evicted.violations;
        violations.extend(work::ledger_violations(&roots, &effects, |_| per_root));
        assert_eq!(
            env.lock_conflicts.load(Ordering::Relaxed),
            0,
            "lock conflicts"
        );
        assert!(
            violations.is_empty(),
            "{} violations over {} roots known and {} evicted, first: {:?}",
            violations.len(),
            roots.len(),
            evicted.count,
            &violations[..violations.len().min(5)]
        );
        executor.shutdown_now().await.unwrap();
    });
}

/// The check of what the remote nodes applied, over a hand-made ledger: an op applied
/// twice, and a root step applied under two op ids (a node that reported "could not
/// apply" for an op it had applied, and the step sent it again), are both violations;
/// lines of the older form, `= OP ROOT`, are read and checked by op id alone.
#[test]
fn remote_check_flags_an_op_applied_twice_and_a_step_applied_under_two_ops() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    std::fs::write(&path, "= 5 1\n= 6 1\n+ 1 0 0 3\n").unwrap();
    let ledger = Ledger::open(&path).unwrap();
    // Root 1: step 0 sent op 10, step 1 op 11, step 2 op 12 — each applied once.
    for (op, step) in [(10, 0), (11, 1), (12, 2)] {
        ledger.applied(op, 1, step).unwrap();
    }
    // Root 2: step 0 applied as op 20 and again as op 21.
    ledger.applied(20, 2, 0).unwrap();
    ledger.applied(21, 2, 0).unwrap();
    // Root 3: op 30 applied twice, for its step 1.
    ledger.applied(30, 3, 1).unwrap();
    ledger.applied(30, 3, 1).unwrap();
    let applied = ledger.applications().unwrap();
    assert_eq!(applied.len(), 9);
    assert_eq!(
        applied[0],
        ledger::Applied {
            op: 5,
            root: 1,
            step: None
        }
    );
    assert_eq!(ledger.applied_ops().unwrap()[&30], 2);
    assert_eq!(
        work::remote_violations(&applied),
        vec![
            "remote op 30 applied 2 times by the nodes".to_string(),
            "root 2 step 0: its operation applied under op ids [20, 21]".to_string(),
        ]
    );
    // The same ledger without them: nothing to report.
    let clean: Vec<_> = applied.into_iter().filter(|a| a.root == 1).collect();
    assert!(work::remote_violations(&clean).is_empty());
}
