//! `testing::restart_at_every_write`, the helper users test their procedures with: a
//! run per write and crash point, each finished by the engine started after the crash.

mod common;

use std::sync::Arc;

use common::{registry, Recorder, Scripted, Step};
use proctor::testing::{restart_at_every_write, CrashPoint};
use proctor::{Executor, ProcError, Undo};

fn builder() -> proctor::ExecutorBuilder<Recorder> {
    Executor::builder()
        .registry(registry())
        .env(Arc::new(Recorder::default()))
}

#[actix::test]
async fn every_write_of_a_tree_gets_a_crash_and_the_tree_still_succeeds() {
    let plan = || {
        Scripted::new(
            "root",
            vec![
                Step::More,
                Step::Children(vec![Scripted::new("child", vec![Step::More])]),
            ],
        )
    };
    let mut checked = 0;
    let runs = restart_at_every_write(builder, plan, |run| {
        checked += 1;
        match run.result {
            Some(ref result) => assert_eq!(*result, Ok(()), "{run:?}"),
            None => assert_eq!(
                (run.writes_before, run.point),
                (0, CrashPoint::BeforeWrite),
                "only a lost submit leaves nothing"
            ),
        }
    })
    .await
    .expect("runs");
    assert_eq!(checked, runs.len());
    // Two runs per write: the submit, the root's first step, its second with the
    // child's insert, the child's end, the root's end (appends carry several records).
    assert!(runs.len() >= 8 && runs.len() % 2 == 0, "{}", runs.len());
    let last = runs.last().unwrap();
    assert_eq!(last.point, CrashPoint::AfterWrite);
    assert_eq!(runs[0].result, None);
    assert_eq!(
        runs[1].result,
        Some(Ok(())),
        "the submit survived: {:?}",
        runs[1]
    );
}

#[actix::test]
async fn a_failing_procedure_rolls_back_whichever_write_the_crash_hits() {
    let plan = || Scripted::new("root", vec![Step::More, Step::Fail("boom".into())]);
    let runs = restart_at_every_write(builder, plan, |_| {})
        .await
        .expect("runs");
    assert!(runs.len() >= 6, "{}", runs.len());
    for run in &runs[1..] {
        let failure = run.result.clone().expect("submitted").unwrap_err();
        assert_eq!(failure.error, ProcError::failed("boom"), "{run:?}");
    }
}

#[actix::test]
async fn after_a_crash_the_failed_step_is_still_rolled_back_as_failed() {
    // The engine of each run's second half, whose rollbacks the check reads.
    let rec = Arc::new(std::sync::Mutex::new(Arc::new(Recorder::default())));
    let builder = || {
        let fresh = Arc::new(Recorder::default());
        *rec.lock().unwrap() = fresh.clone();
        Executor::builder().registry(registry()).env(fresh)
    };
    let plan = || Scripted::new("root", vec![Step::More, Step::Fail("boom".into())]);
    let mut told = Vec::new();
    restart_at_every_write(builder, plan, |run| {
        let undos: Vec<Undo> = rec.lock().unwrap().undos().iter().map(|u| u.1).collect();
        // What is left to undo after the crash: the failed step, if its rollback was
        // not recorded, then the one that completed. The failed step is told it
        // failed once its failure is recorded; a crash before that leaves it to run
        // again after the restart (it fails again), and then the first attempt may
        // have done anything: interrupted.
        let whole = |first| [first, Undo::Completed];
        assert!(
            whole(Undo::Failed).ends_with(&undos) || whole(Undo::Interrupted).ends_with(&undos),
            "{run:?}: {undos:?}"
        );
        told.push(undos);
    })
    .await
    .expect("runs");
    assert!(
        told.contains(&vec![Undo::Failed, Undo::Completed]),
        "{told:?}"
    );
    assert!(
        told.contains(&vec![Undo::Interrupted, Undo::Completed]),
        "{told:?}"
    );
    assert!(told.contains(&vec![Undo::Completed]), "{told:?}");
}
