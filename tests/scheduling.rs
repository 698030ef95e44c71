//! The ready queue as seen from outside: yields, empty child lists, and many trees at
//! once with no lost wake-ups.

mod common;

use std::sync::Arc;

use common::{run, start, stores, wait_for_state, Recorder, Scripted, Step};
use proctor::{
    async_trait, Context, Executor, Flow, ProcError, ProcId, ProcState, Procedure, ProcedureStore,
    Scheduling,
};
use serde::{Deserialize, Serialize};

/// One worker, two procedures that yield: each yield puts the yielder behind the other,
/// so they alternate strictly. Nothing here depends on the disk: yields write nothing,
/// and a worker is handed on only once the yield's report is recorded and its requeue
/// sent. (Before, the other procedure stepped with `MoreToDo`, whose requeue waited for
/// an fsync, so under load the yielder could finish alone.)
#[actix::test]
async fn yielding_5_times_runs_6_times_and_lets_others_run_between() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 1).await;
        // A blocker holds the only worker while both yielders are queued behind it.
        let blocker = common::start_gated(&executor, &rec, "b").await;
        let yielder = Scripted::new("y", (0..5).map(|_| Step::Yield).collect());
        let yielder = executor.submit(yielder).await.unwrap();
        let other = Scripted::new("o", (0..3).map(|_| Step::Yield).collect());
        let other = executor.submit(other).await.unwrap();
        rec.gate.notify_one();

        assert_eq!(executor.wait(blocker).await.unwrap(), Ok(()));
        assert_eq!(executor.wait(yielder).await.unwrap(), Ok(()));
        assert_eq!(executor.wait(other).await.unwrap(), Ok(()));
        assert_eq!(rec.count("y-exec"), 6, "{store_name}: 5 yields + final");
        assert_eq!(rec.count("o-exec"), 4, "{store_name}: 3 yields + final");
        let calls: Vec<String> = rec.calls().into_iter().filter(|c| c != "b-exec").collect();
        let expected: Vec<String> = "yoyoyoyoyy".chars().map(|p| format!("{p}-exec")).collect();
        assert_eq!(calls, expected, "{store_name}: strict alternation");
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

/// A sleep as long as the clock allows is a timer like any other: the procedure waits
/// (its shard's timer queue holds the deadline, capped, rather than overflowing an
/// `Instant`), and an abort ends it.
#[actix::test]
async fn a_sleep_of_almost_forever_waits_and_an_abort_ends_it() {
    for (store_name, store, _dir) in stores() {
        let (executor, _rec) = start(store, 1).await;
        let sleeper = executor
            .submit(Scripted::new("forever", vec![Step::Sleep(u64::MAX / 2)]))
            .await
            .unwrap();
        wait_for_state(&executor, sleeper, ProcState::WaitingTimeout).await;
        assert!(executor.abort(sleeper).await.unwrap(), "{store_name}");
        let result = executor.wait(sleeper).await.unwrap();
        assert!(result.is_err(), "{store_name}: {result:?}");
        executor.shutdown_now().await.unwrap();
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
            .list(proctor::List::new().with_finished())
            .await
            .unwrap()
            .into_iter()
            .filter(|p| !p.state.is_finished())
            .count();
        assert_eq!(live, 0);
    }
}

/// Two workers, both stuck in a step: once the monitor sees them stuck while another
/// procedure waits, it allows an extra worker, which runs the waiting one; when the
/// pool has been idle for a while, the extra worker retires.
#[actix::test]
async fn a_stuck_pool_gets_an_extra_worker_that_later_retires() {
    use std::sync::Arc;
    use std::time::{Duration, Instant};
    for (store_name, store, _dir) in stores() {
        let rec = Arc::new(common::Recorder::default());
        let executor = proctor::Executor::builder()
            .registry(common::registry())
            .store(store)
            .workers(2)
            .env(rec.clone())
            .stuck_worker_monitor(Duration::from_millis(10), Duration::from_millis(30))
            .extra_worker_idle(Duration::from_millis(50))
            .start()
            .await
            .unwrap();
        let a = executor
            .submit(Scripted::new("a", vec![Step::Gate]))
            .await
            .unwrap();
        let b = executor
            .submit(Scripted::new("b", vec![Step::Gate]))
            .await
            .unwrap();
        while rec.count("a-exec") + rec.count("b-exec") < 2 {
            tokio::task::yield_now().await;
        }
        // Both workers are inside gated steps: this one runs only on an extra worker.
        let c = executor.submit(Scripted::new("c", vec![])).await.unwrap();
        assert_eq!(executor.wait(c).await.unwrap(), Ok(()), "{store_name}");
        let stats = executor.scheduler_stats().await.unwrap();
        assert!(stats.workers >= 3, "{store_name}: {stats:?}");
        assert_eq!(stats.running, 2, "{store_name}: {stats:?}");
        rec.gate.notify_waiters();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()));
        assert_eq!(executor.wait(b).await.unwrap(), Ok(()));
        let deadline = Instant::now() + Duration::from_secs(30);
        while executor.scheduler_stats().await.unwrap().workers > 2 {
            assert!(
                Instant::now() < deadline,
                "{store_name}: extra worker never retired"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        executor.shutdown_now().await.unwrap();
    }
}

/// The scheduler's stats show the queued steps per level of the fair queue: five
/// levels, all of them new trees on level 0 here.
#[actix::test]
async fn stats_show_queued_steps_per_level() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 1).await;
        let blocker = common::start_gated(&executor, &rec, "b").await;
        let mut queued = Vec::new();
        for name in ["q1", "q2"] {
            queued.push(executor.submit(Scripted::new(name, vec![])).await.unwrap());
        }
        let stats = loop {
            let stats = executor.scheduler_stats().await.unwrap();
            if stats.queued == 2 {
                break stats;
            }
            tokio::task::yield_now().await;
        };
        assert_eq!(stats.queued_by_level, [2, 0, 0, 0, 0], "{store_name}");
        let info = executor.state(queued[0]).await.unwrap();
        assert_eq!(
            info.queue_level,
            Some(0),
            "{store_name}: a new tree's level"
        );
        rec.gate.notify_one();
        assert_eq!(executor.wait(blocker).await.unwrap(), Ok(()));
        for id in queued {
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        }
    }
}

/// A tree whose steps have run for over a second is on level 1 of the fair queue, and
/// the listing says so. (Step time is measured, so the first step is held open for
/// 1.1 s: the duration is what is tested, not a way to order events.)
#[actix::test]
async fn the_listing_shows_a_tree_moved_down_a_level() {
    use std::time::{Duration, Instant};
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 1).await;
        let a = executor
            .submit(Scripted::new("a", vec![Step::Hold, Step::Hold]))
            .await
            .unwrap();
        rec.signal.notified().await; // step 1 runs
        assert_eq!(executor.state(a).await.unwrap().queue_level, Some(0));
        tokio::time::sleep(Duration::from_millis(1100)).await;
        rec.gate.notify_one();
        rec.signal.notified().await; // step 2 runs
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let level = executor.state(a).await.unwrap().queue_level;
            if level == Some(1) {
                break;
            }
            assert!(Instant::now() < deadline, "{store_name}: level {level:?}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        rec.gate.notify_one();
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()), "{store_name}");
        assert_eq!(
            executor.state(a).await.unwrap().queue_level,
            None,
            "{store_name}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

/// A one-step procedure registered as a system procedure.
#[derive(Serialize, Deserialize)]
struct Meta(String);

#[async_trait]
impl Procedure<Recorder> for Meta {
    async fn execute(&mut self, ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        ctx.env().record(format!("{}-exec", self.0));
        Ok(Flow::Done)
    }
    async fn rollback(&mut self, _: &mut Context<Recorder>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// A system procedure that yields until a procedure named `waits_for` has run a step.
#[derive(Serialize, Deserialize)]
struct Spinner {
    waits_for: String,
}

#[async_trait]
impl Procedure<Recorder> for Spinner {
    async fn execute(&mut self, ctx: &mut Context<Recorder>) -> Result<Flow<Recorder>, ProcError> {
        if ctx.env().count(&format!("{}-exec", self.waits_for)) == 0 {
            return Ok(Flow::Yield);
        }
        ctx.env().record("spinner-exec".to_string());
        Ok(Flow::Done)
    }
    async fn rollback(&mut self, _: &mut Context<Recorder>) -> Result<(), ProcError> {
        Ok(())
    }
}

/// One worker and no system worker: a system procedure that yields until a user
/// procedure has run does not keep the worker from it (a yield gives up the system
/// type's place before everything), under both orders.
#[actix::test]
async fn a_yielding_system_procedure_lets_queued_user_procedures_run() {
    for scheduling in [Scheduling::Fair, Scheduling::Fifo] {
        for (store_name, store, _dir) in stores() {
            let rec = Arc::new(Recorder::default());
            let executor = one_worker::<Spinner>(store, &rec, "spinner", 0, scheduling).await;
            let spinner = executor
                .submit(Spinner {
                    waits_for: "u".into(),
                })
                .await
                .unwrap();
            let user = executor.submit(Scripted::new("u", vec![])).await.unwrap();
            for id in [spinner, user] {
                // A guard against the livelock (which is the failure), not a sequencer.
                let result =
                    tokio::time::timeout(std::time::Duration::from_secs(60), executor.wait(id))
                        .await
                        .expect("the system procedure kept the only worker")
                        .unwrap();
                assert_eq!(result, Ok(()), "{scheduling:?}, {store_name}");
            }
            assert_eq!(rec.calls(), ["u-exec", "spinner-exec"], "{scheduling:?}");
            executor.shutdown().await.unwrap();
        }
    }
}

/// An executor on `store` with one shared worker, `system_workers` system workers, and
/// `P` registered as the system procedure `name`.
async fn one_worker<P: Procedure<Recorder> + serde::de::DeserializeOwned>(
    store: Box<dyn ProcedureStore>,
    rec: &Arc<Recorder>,
    name: &'static str,
    system_workers: usize,
    scheduling: Scheduling,
) -> Executor<Recorder> {
    let mut registry = common::registry();
    registry.register_system::<P>(name);
    Executor::builder()
        .registry(registry)
        .store(store)
        .workers(1)
        .system_workers(system_workers)
        .scheduling(scheduling)
        .env(rec.clone())
        .start()
        .await
        .unwrap()
}

/// One shared worker, `system_workers` system workers, and `store`: a blocker holds the
/// shared worker (released by `rec.gate`), a user procedure queues behind it, then a
/// system procedure is submitted. Returns the executor and the three ids.
async fn blocked_then_user_then_system(
    store: Box<dyn ProcedureStore>,
    rec: &Arc<Recorder>,
    system_workers: usize,
) -> (Executor<Recorder>, [ProcId; 3]) {
    let executor = one_worker::<Meta>(store, rec, "meta", system_workers, Scheduling::Fair).await;
    let blocker = common::start_gated(&executor, rec, "b").await;
    let user = executor.submit(Scripted::new("u", vec![])).await.unwrap();
    let system = executor.submit(Meta("s".into())).await.unwrap();
    (executor, [blocker, user, system])
}

/// Without a system worker, the system procedure queues too, and runs first.
#[actix::test]
async fn a_system_procedure_runs_before_queued_user_procedures() {
    for (store_name, store, _dir) in stores() {
        let rec = Arc::new(Recorder::default());
        let (executor, ids) = blocked_then_user_then_system(store, &rec, 0).await;
        let stats = loop {
            let stats = executor.scheduler_stats().await.unwrap();
            if stats.queued == 2 {
                break stats;
            }
            tokio::task::yield_now().await;
        };
        assert_eq!(stats.queued_system, 1, "{store_name}");
        assert_eq!(stats.queued_by_level, [1, 0, 0, 0, 0], "{store_name}");
        rec.gate.notify_one();
        for id in ids {
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        }
        assert_eq!(rec.calls(), ["b-exec", "s-exec", "u-exec"], "{store_name}");
        executor.shutdown().await.unwrap();
    }
}

/// With a system worker, the system procedure runs to its end meanwhile, and the user
/// procedure does not take that worker when it is free again.
#[actix::test]
async fn a_system_procedure_runs_on_its_own_worker_while_user_steps_fill_the_others() {
    for (store_name, store, _dir) in stores() {
        let rec = Arc::new(Recorder::default());
        let (executor, [blocker, user, system]) =
            blocked_then_user_then_system(store, &rec, 1).await;
        assert_eq!(executor.wait(system).await.unwrap(), Ok(()), "{store_name}");
        let stats = executor.scheduler_stats().await.unwrap();
        let (running, queued) = (stats.running, stats.queued);
        assert_eq!((running, queued), (1, 1), "{store_name}: {stats:?}");
        let system = (stats.system_workers, stats.running_system);
        assert_eq!(system, (1, 0), "{store_name}: {stats:?}");
        assert_eq!(rec.calls(), ["b-exec", "s-exec"], "{store_name}");
        rec.gate.notify_one();
        for id in [blocker, user] {
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        }
        assert_eq!(rec.calls(), ["b-exec", "s-exec", "u-exec"], "{store_name}");
        executor.shutdown().await.unwrap();
    }
}

/// The workers are split over the shards, and a tree's steps run on its own shard's
/// share: with 4 workers on 2 shards, a root's 4 gated children run 2 at a time, and a
/// second root, placed on the other shard (the one with fewer live trees), runs at once
/// beside them.
#[actix::test]
async fn a_tree_runs_on_its_shards_share_of_the_workers() {
    use std::time::Duration;
    for (store_name, store, _dir) in stores() {
        // Two shards (`common::start`), two workers each.
        let (executor, rec) = start(store, 4).await;
        let stats = executor.scheduler_stats().await.unwrap();
        assert_eq!((stats.shards, stats.workers), (2, 4), "{store_name}");
        let children: Vec<_> = (0..4)
            .map(|i| Scripted::new(&format!("c{i}"), vec![Step::Gate]))
            .collect();
        let a = executor
            .submit(Scripted::new("a", vec![Step::Children(children)]))
            .await
            .unwrap();
        let inside =
            |rec: &Recorder| -> usize { (0..4).map(|i| rec.count(&format!("c{i}-exec"))).sum() };
        while inside(&rec) < 2 {
            tokio::task::yield_now().await;
        }
        let b = common::start_gated(&executor, &rec, "b").await;
        // The root's shard is full: its other two children wait, and `b` ran beside them.
        let stats = executor.scheduler_stats().await.unwrap();
        assert_eq!(inside(&rec), 2, "{store_name}: {stats:?}");
        assert_eq!(
            (stats.running, stats.queued),
            (3, 2),
            "{store_name}: {stats:?}"
        );
        for id in [a, b] {
            loop {
                rec.gate.notify_waiters();
                let waited = tokio::time::timeout(Duration::from_millis(5), executor.wait(id));
                if let Ok(result) = waited.await {
                    assert_eq!(result.unwrap(), Ok(()), "{store_name}");
                    break;
                }
            }
        }
        assert_eq!(inside(&rec), 4, "{store_name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// A tree with nothing in flight is passivated: suspended on an event, it keeps no
/// root-stack actor (its shard holds it as a value); the wake activates it again, and
/// it runs on from where it was. Twice, so that a tree passivated, woken and
/// passivated again is seen too.
#[actix::test]
async fn a_tree_waiting_for_an_event_is_passivated_and_woken_again() {
    use std::time::Duration;
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 2).await;
        let plan = vec![
            Step::Suspend("first".into()),
            Step::Suspend("second".into()),
            Step::More,
        ];
        let id = executor.submit(Scripted::new("w", plan)).await.unwrap();
        for (event, ran) in [("first", 1), ("second", 2)] {
            // Waits on the engine's own account of its trees, not on time.
            let passivated = async {
                loop {
                    let stats = executor.scheduler_stats().await.unwrap();
                    if (stats.trees_active, stats.trees_passivated) == (0, 1) {
                        break;
                    }
                    tokio::task::yield_now().await;
                }
            };
            tokio::time::timeout(Duration::from_secs(30), passivated)
                .await
                .unwrap_or_else(|_| panic!("{store_name}: never passivated before {event}"));
            assert_eq!(rec.count("w-exec"), ran, "{store_name}");
            executor.wake_event(event).await.unwrap();
        }
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        assert_eq!(rec.count("w-exec"), 3, "{store_name}");
        let stats = executor.scheduler_stats().await.unwrap();
        assert_eq!((stats.trees_active, stats.trees_passivated), (0, 0));
        executor.shutdown_now().await.unwrap();
    }
}
