//! A real crash test (in the manner of sled's): the test binary runs itself again as a
//! child process that recovers a WAL directory and keeps submitting workload trees
//! (children, injected failures, a ledger of side effects); the parent kills it with
//! SIGKILL at a random moment, several times over the same directory, then recovers it
//! one last time and checks the ledger: every root SUCCESS or ROLLEDBACK, all effects
//! of the successful ones, none of the rolled-back ones, none of unknown procedures.

#[path = "../examples/workload/ledger.rs"]
mod ledger;
#[path = "../examples/workload/work.rs"]
#[allow(dead_code)]
mod work;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use proctor::{Executor, ProcState, StateMachine, WalStore};

use ledger::Ledger;
use work::{Env, Work};

const DIR_VAR: &str = "PROCTOR_CRASH_CHILD_DIR";
const SEED_VAR: &str = "PROCTOR_CRASH_CHILD_SEED";
const STEPS: u16 = 3;
const CHILDREN: u16 = 2;
/// Each tree locks one of these resources for its life (`res/<k>`).
const LOCKS: u32 = 8;

async fn executor(dir: &Path) -> (Executor<Env>, Arc<Env>) {
    let env = Arc::new(Env::new(Some(
        Ledger::open(&dir.join("ledger")).expect("ledger"),
    )));
    let executor = Executor::builder()
        .registry(work::registry())
        .store(WalStore::open(dir.join("wal")).expect("open WAL"))
        .env(env.clone())
        .workers(32)
        .start()
        .await
        .expect("recovery succeeds");
    (executor, env)
}

/// The child: does nothing unless the parent set the variables.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(DIR_VAR) else {
        return;
    };
    let seed: u64 = std::env::var(SEED_VAR).unwrap().parse().unwrap();
    actix::System::new().block_on(async move {
        let (executor, _env) = executor(Path::new(&dir)).await;
        println!("ready");
        let mut rng = fastrand::Rng::with_seed(seed);
        let window = Arc::new(tokio::sync::Semaphore::new(200));
        loop {
            let fail = (rng.f64() < 0.2).then(|| (rng.u16(0..=CHILDREN), rng.u16(0..STEPS)));
            let work = Work {
                path: 0,
                steps: STEPS,
                children: CHILDREN,
                fail,
                lock: Some(rng.u32(0..LOCKS)),
            };
            let permit = window.clone().acquire_owned().await.unwrap();
            let executor = executor.clone();
            actix::spawn(async move {
                if let Ok(id) = executor.submit(StateMachine::new(work)).await {
                    let _ = executor.wait(id).await;
                }
                drop(permit);
            });
        }
    });
}

#[test]
fn sigkill_at_random_moments_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    for round in 0..10 {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["crash_child", "--exact", "--nocapture", "--test-threads=1"])
            .env(DIR_VAR, dir.path())
            .env(SEED_VAR, round.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the child");
        // Wait for the child to have recovered and started submitting.
        let stdout = child.stdout.take().unwrap();
        let ready = BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .any(|line| line.ends_with("ready"));
        assert!(ready, "round {round}: the child failed before it was ready");
        // The random moment is the point of the test.
        std::thread::sleep(Duration::from_millis(rng.u64(20..400)));
        child.kill().expect("SIGKILL");
        child.wait().unwrap();
    }

    actix::System::new().block_on(async {
        let (executor, env) = executor(dir.path()).await;
        let recovery = executor.recovery().clone();
        assert!(recovery.corrupt.is_empty(), "{:?}", recovery.corrupt);
        assert!(
            !recovery.recovered_roots.is_empty(),
            "a kill mid-run leaves work to recover"
        );
        for id in &recovery.recovered_roots {
            let _ = executor.wait(*id).await.expect("recovered root finishes");
        }
        let roots: HashMap<_, ProcState> = executor
            .list(proctor::List::new().with_finished())
            .await
            .unwrap()
            .into_iter()
            .filter(|p| p.parent.is_none())
            .map(|p| (p.id, p.state))
            .collect();
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
        executor.shutdown_now().await.unwrap();
    });
}
