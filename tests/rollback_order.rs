//! Rollback order across a tree and inside a state machine, asserted on the recorded
//! sequence of execute and rollback calls.

mod common;

use common::{run, start, stores, AddState, Adder, Scripted, Step};
use proctor::{ProcError, ProcState, StateMachine};
use std::sync::atomic::Ordering;

#[actix::test]
async fn failure_deep_in_a_chain_rolls_back_newest_first() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let child2 = Scripted::new("child2", vec![Step::Fail("child2 broke".into())]);
        let child1 = Scripted::new("child1", vec![Step::Children(vec![child2])]);
        let root = Scripted::new("root", vec![Step::Children(vec![child1])]);

        let (id, result) = run(&executor, root).await;

        assert_eq!(
            rec.calls(),
            [
                "root-exec",
                "child1-exec",
                "child2-exec",
                "child2-rollback",
                "child1-rollback",
                "root-rollback"
            ],
            "{store_name}"
        );
        let failure = result.expect_err("the tree failed");
        assert_eq!(failure.error, ProcError::failed("child2 broke"));
        assert_eq!(failure.type_name, "scripted");
        assert_ne!(failure.proc, id, "the failure names child2, not the root");
        let info = executor.state(id).await.unwrap();
        assert_eq!(info.state, ProcState::RolledBack);
        assert_eq!(info.result, Some(Err(failure)));
    }
}

#[actix::test]
async fn a_child_that_succeeded_is_not_rolled_back() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let child = Scripted::new("child", vec![Step::More]);
        let root = Scripted::new(
            "root",
            vec![
                Step::Children(vec![child]),
                Step::Fail("parent broke".into()),
            ],
        );

        let (id, result) = run(&executor, root).await;

        assert_eq!(
            rec.calls(),
            [
                "root-exec",
                "child-exec",
                "root-exec",
                // One rollback per executed root step, the failed one first.
                "root-rollback",
                "root-rollback"
            ],
            "{store_name}"
        );
        let failure = result.unwrap_err();
        assert_eq!(failure.proc, id);
        assert_eq!(failure.error, ProcError::failed("parent broke"));
    }
}

#[actix::test]
async fn state_machine_adds_up_to_26() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let (_, result) = run(&executor, StateMachine::new(Adder { fail_in: None })).await;
        assert_eq!(result, Ok(()), "{store_name}");
        assert_eq!(rec.counter.load(Ordering::SeqCst), 26);
        assert_eq!(
            rec.calls(),
            ["exec One", "exec Two", "exec Three", "exec Four"]
        );
    }
}

#[actix::test]
async fn state_machine_failing_in_state_3_rolls_back_3_2_1() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let proc = StateMachine::new(Adder {
            fail_in: Some(AddState::Three),
        });
        let (id, result) = run(&executor, proc).await;
        let failure = result.unwrap_err();
        assert_eq!(failure.proc, id);
        assert_eq!(failure.error, ProcError::failed("Three failed"));
        assert_eq!(
            rec.calls(),
            [
                "exec One",
                "exec Two",
                "exec Three",
                "rollback Three",
                "rollback Two",
                "rollback One"
            ],
            "{store_name}"
        );
        assert_eq!(rec.counter.load(Ordering::SeqCst), 0);
    }
}
