//! `testing::restart_at_every_write`, the helper users test their procedures with: a
//! run per write and crash point, each finished by the engine started after the crash.

mod common;

use std::sync::Arc;

use common::{registry, Recorder, Scripted, Step};
use proctor::testing::{restart_at_every_write, CrashPoint};
use proctor::{Executor, ProcError};

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
