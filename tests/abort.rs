//! Operator aborts: of a running procedure, of an unknown id, of a finished one.

mod common;

use common::{run, start, stores, Scripted, Step};
use proctor::{Error, List, ProcError, ProcId, ProcState};

#[actix::test]
async fn abort_of_a_running_procedure_rolls_it_back() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let id = executor
            .submit(Scripted::new("long", vec![Step::Forever(2)]))
            .await
            .unwrap();
        // Wait until it has run a step: aborting a procedure that never ran is a
        // different (easier) case.
        rec.signal.notified().await;

        assert!(executor.abort(id).await.unwrap(), "abort accepted");
        let failure = executor.wait(id).await.unwrap().unwrap_err();

        assert_eq!(failure.proc, id, "{store_name}");
        assert_eq!(failure.error, ProcError::Aborted);
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack
        );
        let execs = rec.count("long-exec");
        assert!(execs >= 1);
        assert_eq!(
            rec.count("long-rollback"),
            execs,
            "one rollback per executed step"
        );
        assert_eq!(rec.calls().last().unwrap(), "long-rollback");
    }
}

/// A step that would never end on its own: the abort cancels it, so the abort's answer
/// comes (it would otherwise wait for the step for ever), and the tree rolls back.
#[actix::test]
async fn abort_cancels_a_running_step_and_is_answered_without_waiting_for_it_to_end() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let id = executor
            .submit(Scripted::new(
                "long",
                vec![Step::More, Step::UntilCancelled],
            ))
            .await
            .unwrap();
        rec.signal.notified().await;

        assert!(executor.abort(id).await.unwrap(), "{store_name}: accepted");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, ProcError::Aborted, "{store_name}");
        assert_eq!(
            rec.calls(),
            [
                "long-exec",
                "long-exec",
                "long-cancelled",
                "long-rollback",
                "long-rollback"
            ],
            "{store_name}: the cancelled step is rolled back too (it may have begun work)"
        );
    }
}

#[actix::test]
async fn abort_of_a_parent_waiting_for_children_rolls_back_the_tree() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let child = Scripted::new("child", vec![Step::Forever(2)]);
        let id = executor
            .submit(Scripted::new("root", vec![Step::Children(vec![child])]))
            .await
            .unwrap();
        rec.signal.notified().await;

        assert!(executor.abort(id).await.unwrap());
        let failure = executor.wait(id).await.unwrap().unwrap_err();

        assert_eq!(failure.error, ProcError::Aborted, "{store_name}");
        let calls = rec.calls();
        let tail: Vec<&str> = calls.iter().rev().take(2).map(String::as_str).collect();
        assert_eq!(tail, ["root-rollback", "child-rollback"], "{calls:?}");
    }
}

#[actix::test]
async fn abort_of_unknown_or_finished_procedures_is_a_clear_error() {
    for (store_name, store, _dir) in stores() {
        let (executor, _rec) = start(store, 4).await;

        let unknown = executor.abort(ProcId(424242)).await.unwrap_err();
        assert!(matches!(unknown, Error::UnknownProcedure(ProcId(424242))));
        assert_eq!(unknown.to_string(), "unknown procedure 424242");

        let (id, result) = run(&executor, Scripted::new("quick", vec![Step::More])).await;
        assert_eq!(result, Ok(()), "{store_name}");
        let finished = executor.abort(id).await.unwrap_err();
        assert!(
            matches!(finished, Error::Finished { id: i, state: ProcState::Success } if i == id),
            "{finished}"
        );
        assert!(finished.to_string().contains("already finished (SUCCESS)"));
    }
}

/// Aborts that reached a procedure in a step, while its tree could still roll back, but
/// take effect (the abort hook accepts one) only after a sibling recorded the tree's
/// point of no return: the tree does not roll back, so each is answered refused, and
/// the procedure is paused for an operator, as any failure there. With two, the second
/// finds the cell already failing (it was answered accepted, before).
#[actix::test]
async fn aborts_overtaken_by_a_siblings_point_of_no_return_are_refused_and_pause() {
    for aborts in [1, 2] {
        for (store_name, store, _dir) in stores() {
            let at = format!("{store_name}, {aborts} aborts");
            let (executor, rec) = start(store, 4).await;
            let held = Scripted::new("held", vec![Step::Hold, Step::More]);
            let mark = Scripted::new("mark", vec![Step::Suspend("go".into()), Step::Irreversible]);
            let root = executor
                .submit(Scripted::new(
                    "root",
                    vec![Step::Children(vec![held, mark])],
                ))
                .await
                .unwrap();
            rec.signal.notified().await; // held is inside its first step
            let mut children: Vec<ProcId> = executor
                .list(List::new().root(root))
                .await
                .unwrap()
                .into_iter()
                .filter(|p| p.parent == Some(root))
                .map(|p| p.id)
                .collect();
            children.sort();
            let [held, mark] = children[..] else {
                panic!("{at}: children {children:?}");
            };
            let sent: Vec<_> = (0..aborts)
                .map(|_| {
                    let executor = executor.clone();
                    actix::spawn(async move { executor.abort(held).await })
                })
                .collect();
            // Answered in order after the aborts: they have reached the tree (which could
            // still roll back), and wait for the step.
            for _ in 0..2 {
                let refused = executor.resume(held).await.unwrap_err();
                assert!(matches!(refused, Error::Refused { .. }), "{refused}");
            }
            executor.wake_event("go").await.unwrap();
            // Its SUCCESS is durable once it is shown, or once it is gone (a finished
            // child).
            while executor
                .state(mark)
                .await
                .is_ok_and(|p| p.state != ProcState::Success)
            {
                tokio::task::yield_now().await;
            }
            rec.gate.notify_one(); // held's step ends; the abort hook accepts
            for abort in sent {
                match abort.await.unwrap() {
                    Err(Error::Refused { reason, .. }) => {
                        assert!(reason.contains("point of no return"), "{at}: {reason}")
                    }
                    other => {
                        panic!("{at}: nothing rolls back, yet an abort was answered {other:?}")
                    }
                }
            }
            while executor.state(held).await.unwrap().state != ProcState::Paused {
                tokio::task::yield_now().await;
            }
            executor.resume(held).await.unwrap();
            assert_eq!(executor.wait(root).await.unwrap(), Ok(()), "{at}");
            assert_eq!(rec.count("held-rollback"), 0, "{at}");
            executor.shutdown().await.unwrap();
        }
    }
}

/// An abort of a root whose children are in long steps cancels those steps: each sees
/// its cancellation signal, returns, and the tree rolls back at once rather than after
/// the steps' own end (here: never, as each step waits only for its signal).
#[actix::test]
async fn an_abort_cancels_the_running_steps_of_the_whole_tree() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 8).await;
        let children = (1..=3)
            .map(|i| Scripted::new(&format!("c{i}"), vec![Step::UntilCancelled]))
            .collect();
        let id = executor
            .submit(Scripted::new("root", vec![Step::Children(children)]))
            .await
            .unwrap();
        // Each child is in its step (a `Notify` keeps one signal, not three).
        while (1..=3).any(|i| rec.count(&format!("c{i}-exec")) == 0) {
            tokio::task::yield_now().await;
        }
        let asked = std::time::Instant::now();
        assert!(executor.abort(id).await.unwrap(), "{store_name}: accepted");
        // Without the cancellation the children would never return.
        let failure = tokio::time::timeout(std::time::Duration::from_secs(30), executor.wait(id))
            .await
            .expect("the tree rolled back")
            .unwrap()
            .unwrap_err();
        let took = asked.elapsed();
        assert_eq!(failure.error, ProcError::Aborted, "{store_name}");
        for i in 1..=3 {
            let child = format!("c{i}");
            assert_eq!(rec.count(&format!("{child}-cancelled")), 1, "{store_name}");
            assert_eq!(rec.count(&format!("{child}-rollback")), 1, "{store_name}");
        }
        assert_eq!(rec.count("root-rollback"), 1, "{store_name}");
        eprintln!("{store_name}: abort to rolled back in {took:?}");
    }
}

/// A step that fails cancels its siblings' running steps the same way: the tree rolls
/// back as soon as they return.
#[actix::test]
async fn a_failed_step_cancels_its_siblings_running_steps() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 8).await;
        let children = vec![
            Scripted::new("c1", vec![Step::UntilCancelled]),
            Scripted::new("c2", vec![Step::UntilCancelled]),
            Scripted::new("f", vec![Step::GateFail("boom".into())]),
        ];
        let id = executor
            .submit(Scripted::new("root", vec![Step::Children(children)]))
            .await
            .unwrap();
        while ["c1", "c2"]
            .iter()
            .any(|c| rec.count(&format!("{c}-exec")) == 0)
        {
            tokio::task::yield_now().await;
        }
        // Now `f` fails, while both siblings are in their steps.
        rec.permits.add_permits(1);
        let failure = tokio::time::timeout(std::time::Duration::from_secs(30), executor.wait(id))
            .await
            .expect("the tree rolled back")
            .unwrap()
            .unwrap_err();
        assert_eq!(failure.error, ProcError::failed("boom"), "{store_name}");
        for child in ["c1", "c2"] {
            assert_eq!(rec.count(&format!("{child}-cancelled")), 1, "{store_name}");
            assert_eq!(rec.count(&format!("{child}-rollback")), 1, "{store_name}");
        }
        assert_eq!(rec.count("f-rollback"), 1, "{store_name}");
    }
}
