//! The ready queue as seen from outside: yields, empty child lists, and many trees at
//! once with no lost wake-ups.

mod common;

use common::{run, start, stores, Scripted, Step};
use proctor::ProcState;

#[actix::test]
async fn yielding_5_times_runs_6_times_and_lets_others_run_between() {
    for (store_name, store, _dir) in stores() {
        // One worker: whatever runs between the yielder's steps ran because it yielded.
        let (executor, rec) = start(store, 1).await;
        let mut plan = vec![Step::Gate];
        plan.extend((0..5).map(|_| Step::Yield));
        let yielder = executor.submit(Scripted::new("y", plan)).await.unwrap();
        let mut other = Scripted::new("o", vec![Step::More, Step::More, Step::More]);
        other.yield_after = true;
        let other = executor.submit(other).await.unwrap();
        // The other procedure is queued now; let the yielder (holding the worker) go on.
        rec.gate.notify_one();

        assert_eq!(executor.wait(yielder).await.unwrap(), Ok(()));
        assert_eq!(executor.wait(other).await.unwrap(), Ok(()));
        assert_eq!(
            rec.count("y-exec"),
            7,
            "{store_name}: gate step + 5 yields + final"
        );
        let calls = rec.calls();
        let first_y = calls.iter().position(|c| c == "y-exec").unwrap();
        let last_y = calls.iter().rposition(|c| c == "y-exec").unwrap();
        let between = calls[first_y..last_y]
            .iter()
            .filter(|c| *c == "o-exec")
            .count();
        assert!(between >= 2, "others ran between the yields: {calls:?}");
    }
}

#[actix::test]
async fn yielding_procedure_without_gate_runs_once_per_yield_plus_one() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let plan = (0..5).map(|_| Step::Yield).collect();
        let (_, result) = run(&executor, Scripted::new("y", plan)).await;
        assert_eq!(result, Ok(()), "{store_name}");
        assert_eq!(rec.count("y-exec"), 6);
        assert_eq!(rec.count("y-rollback"), 0);
    }
}

#[actix::test]
async fn an_empty_child_list_behaves_like_done() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let (id, result) = run(
            &executor,
            Scripted::new(
                "p",
                vec![Step::Children(vec![]), Step::Fail("unreached".into())],
            ),
        )
        .await;
        assert_eq!(result, Ok(()), "{store_name}");
        assert_eq!(rec.calls(), ["p-exec"]);
        assert_eq!(executor.state(id).await.unwrap().state, ProcState::Success);
    }
}

#[actix::test]
async fn sleeping_and_suspended_procedures_wake_up() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 1).await;
        let sleeper = executor
            .submit(Scripted::new("s", vec![Step::Sleep(5), Step::More]))
            .await
            .unwrap();
        let waiter = executor
            .submit(Scripted::new(
                "w",
                vec![Step::Suspend("go".into()), Step::Signal, Step::More],
            ))
            .await
            .unwrap();
        assert_eq!(
            executor.wait(sleeper).await.unwrap(),
            Ok(()),
            "{store_name}"
        );
        executor.wake_event("go").await.unwrap();
        rec.signal.notified().await;
        assert_eq!(executor.wait(waiter).await.unwrap(), Ok(()));
        // Woken events stay woken: a later suspend continues at once.
        let late = executor
            .submit(Scripted::new("late", vec![Step::Suspend("go".into())]))
            .await
            .unwrap();
        assert_eq!(executor.wait(late).await.unwrap(), Ok(()));
    }
}

#[actix::test]
async fn ten_thousand_roots_with_two_children_each_all_complete() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 16).await;
        let mut ids = Vec::with_capacity(10_000);
        let submits: Vec<_> = (0..10_000)
            .map(|_| {
                let kids = vec![
                    Scripted::new("c", vec![Step::More]),
                    Scripted::new("c", vec![Step::More]),
                ];
                executor.submit(Scripted::new("r", vec![Step::Children(kids), Step::More]))
            })
            .collect();
        for submit in submits {
            ids.push(submit.await.unwrap());
        }
        for id in ids {
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        }
        assert_eq!(rec.count("r-exec"), 20_000);
        assert_eq!(rec.count("c-exec"), 20_000, "one step per child");
        let live = executor
            .list()
            .await
            .unwrap()
            .into_iter()
            .filter(|p| !p.state.is_finished())
            .count();
        assert_eq!(live, 0);
    }
}
