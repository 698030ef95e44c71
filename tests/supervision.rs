//! Procedure actors under their root stack: one runs while its procedure has work
//! (a step queued or running, a rollback, a hook to call), none while it waits, and
//! one that stops without being told is started again by its root stack, from the
//! state it last reported, as recovery would start it after a crash.

mod common;

use std::time::Duration;

use common::{start, stores, Recorder, Scripted, Step};
use proctor::{Executor, SchedulerStats};

/// Waits (on the engine's own account, not on time) until `check` holds for its stats.
async fn until_stats(
    executor: &Executor<Recorder>,
    what: &str,
    check: impl Fn(&SchedulerStats) -> bool,
) -> SchedulerStats {
    let wait = async {
        loop {
            let stats = executor.scheduler_stats().await.unwrap();
            if check(&stats) {
                return stats;
            }
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), wait)
        .await
        .unwrap_or_else(|_| panic!("never saw: {what}"))
}

/// Stopped in the middle of a step, by a panic in its handler or by being stopped,
/// the actor is started again: the step it was in runs again from the state recorded
/// before it (the cut-off attempt's work is not taken), and the procedure goes on to
/// its end with nothing rolled back.
#[actix::test]
async fn a_procedure_actor_stopped_in_a_step_is_started_again_and_the_step_runs_again() {
    for panic in [false, true] {
        for (store_name, store, _dir) in stores() {
            let (executor, rec) = start(store, 2).await;
            let plan = vec![Step::More, Step::Hold, Step::More];
            let id = executor.submit(Scripted::new("s", plan)).await.unwrap();
            // Its second step is running (and holds there).
            rec.signal.notified().await;
            assert_eq!(rec.count("s-exec"), 2, "{store_name}");
            executor.kill_procedure_actor(id, panic).await.unwrap();
            // The new actor runs the second step again: it signals again.
            rec.signal.notified().await;
            assert_eq!(rec.count("s-exec"), 3, "{store_name}, panic {panic}");
            rec.gate.notify_one();
            assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
            assert_eq!(rec.count("s-exec"), 4, "{store_name}: the third step once");
            assert_eq!(rec.count("s-rollback"), 0, "{store_name}");
            let stats = until_stats(&executor, "no procedure actor left", |s| {
                s.procedures_active == 0
            })
            .await;
            assert_eq!(stats.running, 0, "{store_name}: the worker was freed");
            executor.shutdown_now().await.unwrap();
        }
    }
}

/// A procedure waiting for its children keeps no actor; its children, in their steps,
/// each have one. Once they finish, the parent is activated again and ends the tree.
#[actix::test]
async fn a_parent_waiting_for_its_children_keeps_no_actor() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 4).await;
        let children = vec![
            Scripted::new("c1", vec![Step::Gate]),
            Scripted::new("c2", vec![Step::Gate]),
        ];
        let plan = vec![Step::Children(children), Step::More];
        let id = executor.submit(Scripted::new("p", plan)).await.unwrap();
        let stats = until_stats(&executor, "both children in their steps", |s| {
            s.running == 2
        })
        .await;
        let stats = if stats.procedures_active == 2 {
            stats
        } else {
            // The parent's actor hands its cell back once its step's report is in.
            until_stats(&executor, "the parent passivated", |s| {
                s.procedures_active == 2
            })
            .await
        };
        assert_eq!(stats.trees_active, 1, "{store_name}");
        // Opens the gate until both children have passed it (a permit is kept for one
        // that has not started waiting yet, but only one).
        let opener = async {
            loop {
                rec.gate.notify_one();
                tokio::task::yield_now().await;
            }
        };
        let result = tokio::select! {
            result = executor.wait(id) => result,
            () = opener => unreachable!(),
        };
        assert_eq!(result.unwrap(), Ok(()), "{store_name}");
        assert_eq!(rec.count("p-exec"), 2, "{store_name}");
        until_stats(&executor, "no procedure actor left", |s| {
            s.procedures_active == 0 && s.trees_active == 0
        })
        .await;
        executor.shutdown_now().await.unwrap();
    }
}

/// A procedure stopped between steps, while it waits for an event, is started from
/// its recorded state when the event comes, and ends as if nothing happened.
#[actix::test]
async fn a_procedure_actor_stopped_while_it_waits_goes_on_when_woken() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start(store, 2).await;
        let plan = vec![Step::More, Step::Suspend("go".into()), Step::More];
        let id = executor.submit(Scripted::new("w", plan)).await.unwrap();
        until_stats(&executor, "the tree passivated", |s| {
            s.trees_passivated == 1 && s.procedures_active == 0
        })
        .await;
        // The kill activates it (a new actor with its cell), then stops that actor.
        executor.kill_procedure_actor(id, true).await.unwrap();
        executor.wake_event("go").await.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{store_name}");
        assert_eq!(rec.count("w-exec"), 3, "{store_name}");
        assert_eq!(rec.count("w-rollback"), 0, "{store_name}");
        executor.shutdown_now().await.unwrap();
    }
}

/// An executor on `store` whose supervision gives up past `max` restarts in a minute.
async fn start_limited(
    store: Box<dyn proctor::ProcedureStore>,
    max: u32,
) -> (Executor<Recorder>, std::sync::Arc<Recorder>) {
    let rec = std::sync::Arc::new(Recorder::default());
    let mut registry = common::registry();
    registry.register::<HeldRollback>("held_rollback");
    let executor = Executor::builder()
        .registry(registry)
        .store(store)
        .workers(2)
        .arbiters(2)
        .restart_limit(max, Duration::from_secs(60))
        .env(rec.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, rec)
}

/// A procedure whose actor keeps stopping in the same step is started again up to the
/// restart limit, the step running again each time; past it, the step is not run
/// again but fails with an error that names the count and the last reason, and the
/// tree rolls back as after any failed step.
#[actix::test]
async fn an_actor_that_keeps_stopping_in_a_step_fails_it_past_the_restart_limit() {
    for (store_name, store, _dir) in stores() {
        let (executor, rec) = start_limited(store, 3).await;
        let plan = vec![Step::More, Step::Hold, Step::More];
        let id = executor.submit(Scripted::new("s", plan)).await.unwrap();
        rec.signal.notified().await;
        for restart in 1..=3 {
            executor.kill_procedure_actor(id, true).await.unwrap();
            // Within the limit: started again, and the step runs again.
            rec.signal.notified().await;
            assert_eq!(rec.count("s-exec"), 2 + restart, "{store_name}");
        }
        // The fourth stop within the minute is past the limit.
        executor.kill_procedure_actor(id, true).await.unwrap();
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        match &failure.error {
            proctor::ProcError::Panicked { hook, message } => {
                assert_eq!(hook, "the procedure's actor", "{store_name}");
                assert!(
                    message.contains("stopped 4 times within 60000 ms")
                        && message.contains("restart limit of 3")
                        && message.contains("killed by a test"),
                    "{store_name}: {message}"
                );
            }
            other => panic!("{store_name}: {other:?}"),
        }
        assert_eq!(rec.count("s-exec"), 5, "{store_name}: not run a sixth time");
        // Both steps are undone, newest first: the one given up (it may have done part
        // of its work), then the first, completed.
        let undos = rec.undos();
        assert_eq!(undos.len(), 2, "{store_name}: {undos:?}");
        assert_eq!(
            undos[0].1,
            proctor::Undo::Interrupted,
            "{store_name}: {undos:?}"
        );
        assert_eq!(
            undos[1].1,
            proctor::Undo::Completed,
            "{store_name}: {undos:?}"
        );
        executor.shutdown_now().await.unwrap();
    }
}

/// A rollback is never abandoned: an actor that keeps stopping in one halts its tree,
/// whose waiters hear why; a restart of the engine carries the rollback on.
#[actix::test]
async fn an_actor_that_keeps_stopping_in_a_rollback_halts_its_tree() {
    let dir = tempfile::tempdir().unwrap();
    let store = proctor::WalStore::open(dir.path()).unwrap();
    let (executor, rec) = start_limited(Box::new(store), 2).await;
    let id = executor.submit(HeldRollback::default()).await.unwrap();
    rec.signal.notified().await;
    for _ in 0..2 {
        executor.kill_procedure_actor(id, false).await.unwrap();
        rec.signal.notified().await;
    }
    executor.kill_procedure_actor(id, false).await.unwrap();
    let error = executor.wait(id).await.unwrap_err();
    assert!(
        matches!(&error, proctor::Error::Internal(m) if m.contains("stopped 3 times") && m.contains("restart limit of 2") && m.contains("stopped by a test")),
        "{error}"
    );
    assert_eq!(rec.count("held-rollback"), 3);
    executor.shutdown_now().await.unwrap();

    // The next engine on the directory rolls it back to its end.
    let store = proctor::WalStore::open(dir.path()).unwrap();
    let (executor, rec) = start_limited(Box::new(store), 2).await;
    rec.gate.notify_one();
    let failure = executor.wait(id).await.unwrap().unwrap_err();
    assert_eq!(
        failure.error,
        proctor::ProcError::failed("the second step fails")
    );
    // The failed step's rollback, done this time, then the first step's.
    assert_eq!(rec.count("held-rollback"), 2);
    executor.shutdown_now().await.unwrap();
}

/// Fails its second step; the rollback of that step signals and waits at the gate
/// each time it is called.
#[derive(Default, serde::Serialize, serde::Deserialize)]
struct HeldRollback {
    step: u32,
}

#[proctor::async_trait]
impl proctor::Procedure<Recorder> for HeldRollback {
    async fn execute(
        &mut self,
        _ctx: &mut proctor::Context<Recorder>,
    ) -> Result<proctor::Flow<Recorder>, proctor::ProcError> {
        self.step += 1;
        if self.step == 1 {
            return Ok(proctor::Flow::MoreToDo);
        }
        Err(proctor::ProcError::failed("the second step fails"))
    }

    async fn rollback(
        &mut self,
        ctx: &mut proctor::Context<Recorder>,
    ) -> Result<(), proctor::ProcError> {
        let rec = ctx.env_arc().clone();
        rec.record("held-rollback".to_string());
        if self.step == 2 {
            rec.signal.notify_one();
            rec.gate.notified().await;
        }
        self.step -= 1;
        Ok(())
    }
}
