//! Graceful shutdown: submits are refused at once, no new step starts, the running step
//! ends and its record is durable before the engine stops, so the next engine goes on
//! from it; at the drain deadline running steps are cancelled, and what has not ended
//! then is cut off like in a crash.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{registry, Recorder, Reopen, Scripted, Step};
use proctor::messages::Shutdown;
use proctor::{Error, Executor};

async fn start_on(
    store: Box<dyn proctor::ProcedureStore>,
    drain: Duration,
) -> (Executor<Recorder>, Arc<Recorder>) {
    let rec = Arc::new(Recorder::default());
    let executor = Executor::builder()
        .registry(registry())
        .store(store)
        .workers(4)
        .drain_timeout(drain)
        .env(rec.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, rec)
}

#[actix::test]
async fn a_graceful_shutdown_lets_the_running_step_finish_and_persist() {
    for name in common::STORES {
        let store = Reopen::new(name);
        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        let id = executor
            .submit(Scripted::new("a", vec![Step::Hold, Step::More]))
            .await
            .unwrap();
        rec.signal.notified().await; // step 1 is running
                                     // Queued now, before the submit below: the drain has begun when that is handled.
        let stop = executor.addr().unwrap().send(Shutdown::graceful());
        assert!(
            matches!(
                executor.submit(Scripted::new("late", vec![])).await,
                Err(Error::Stopped)
            ),
            "{name}: a submit during the drain is refused"
        );
        rec.gate.notify_one(); // step 1 ends
        stop.await.expect("shutdown answers");
        assert_eq!(
            rec.calls(),
            ["a-exec"],
            "{name}: step 2 did not start during the drain"
        );

        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(
            rec.calls(),
            ["a-exec"],
            "{name}: step 1's record was durable, so only step 2 ran after the restart"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn past_the_drain_timeout_the_engine_stops_like_a_crash() {
    for name in common::STORES {
        let store = Reopen::new(name);
        let (executor, rec) = start_on(store.open(), Duration::from_millis(20)).await;
        let id = executor
            .submit(Scripted::new("a", vec![Step::Hold]))
            .await
            .unwrap();
        rec.signal.notified().await;
        // The step never ends by itself: the drain gives up and the engine stops.
        executor.shutdown().await.expect("shutdown answers");

        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        rec.signal.notified().await; // the cut-off step runs again
        rec.gate.notify_one();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.calls(), ["a-exec"], "{name}");
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn at_the_drain_deadline_a_running_step_is_cancelled_and_runs_again_after_the_restart() {
    for name in common::STORES {
        let store = Reopen::new(name);
        let (executor, rec) = start_on(store.open(), Duration::from_millis(50)).await;
        let id = executor
            .submit(Scripted::new("a", vec![Step::UntilCancelled, Step::More]))
            .await
            .unwrap();
        rec.signal.notified().await;
        // The step waits for its cancellation: the drain deadline raises it, the step
        // sees why and fails, and that failure is not recorded.
        executor.shutdown().await.expect("shutdown answers");
        assert_eq!(rec.calls(), ["a-exec", "a-shutdown"], "{name}");

        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        assert_eq!(executor.recovery().recovered_roots, [id], "{name}");
        // The same step runs again: it was not failed (a recorded failure would roll
        // back without running it).
        tokio::time::timeout(Duration::from_secs(30), rec.signal.notified())
            .await
            .unwrap_or_else(|_| panic!("{name}: the step did not run again: {:?}", rec.calls()));
        assert!(executor.abort(id).await.unwrap(), "{name}");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.error, proctor::ProcError::Aborted, "{name}");
        assert_eq!(
            rec.calls(),
            ["a-exec", "a-cancelled", "a-rollback"],
            "{name}: an abort, unlike the shutdown, fails the step"
        );
        executor.shutdown().await.unwrap();
    }
}

/// After a graceful shutdown nothing was in the middle of a step: a procedure that
/// waited for its timer (its deadline far off) is rolled back for its recorded steps
/// only. The extra rollback of a step that may have started unrecorded is for a crash
/// (and for a shutdown whose drain cut steps off), not for a drained engine. (A
/// procedure waiting for an event re-runs its step after a restart by default; the
/// core's tests cover one that waits again.)
#[actix::test]
async fn after_a_graceful_shutdown_no_step_is_rolled_back_as_cut_off() {
    use proctor::ProcState;
    let sleeper = || {
        Scripted::new(
            "sleeper",
            vec![Step::More, Step::Sleep(600_000), Step::More],
        )
    };
    for name in common::STORES {
        let store = Reopen::new(name);
        let (executor, _) = start_on(store.open(), Duration::from_secs(60)).await;
        let id = executor.submit(sleeper()).await.unwrap();
        common::wait_for_state(&executor, id, ProcState::WaitingTimeout).await;
        executor.shutdown().await.unwrap();

        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        assert!(executor.abort(id).await.unwrap(), "{name}");
        assert!(executor.wait(id).await.unwrap().is_err(), "{name}");
        assert_eq!(
            rec.count("sleeper-rollback"),
            2,
            "{name}: {:?}",
            rec.calls()
        );
        // A second sleeper, left waiting by a drained stop, and the engine after it
        // cut off (no drain): the mark held for one start only, and the next start
        // assumes its step may have been cut off.
        let id = executor.submit(sleeper()).await.unwrap();
        common::wait_for_state(&executor, id, ProcState::WaitingTimeout).await;
        executor.shutdown_now().await.unwrap();
        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        assert!(executor.abort(id).await.unwrap(), "{name}");
        assert!(executor.wait(id).await.unwrap().is_err(), "{name}");
        assert_eq!(
            rec.count("sleeper-rollback"),
            3,
            "{name}: {:?}",
            rec.calls()
        );
        executor.shutdown().await.unwrap();
    }
}

/// A procedure an earlier crash may have cut off stays so through a drained stop that
/// came before it ran again: the drained mark names it, and its rollback still undoes
/// the step it may have been in.
#[actix::test]
async fn a_drained_stop_keeps_what_an_earlier_crash_may_have_cut_off() {
    use proctor::ProcState;
    for name in common::STORES {
        let store = Reopen::new(name);
        let (executor, _) = start_on(store.open(), Duration::from_secs(60)).await;
        let id = executor
            .submit(Scripted::new(
                "sleeper",
                vec![Step::More, Step::Sleep(600_000), Step::More],
            ))
            .await
            .unwrap();
        common::wait_for_state(&executor, id, ProcState::WaitingTimeout).await;
        executor.shutdown_now().await.unwrap(); // cut off: no mark
        let (executor, _) = start_on(store.open(), Duration::from_secs(60)).await;
        executor.shutdown().await.unwrap(); // drained, the sleeper not run since
        let (executor, rec) = start_on(store.open(), Duration::from_secs(60)).await;
        assert!(executor.abort(id).await.unwrap(), "{name}");
        assert!(executor.wait(id).await.unwrap().is_err(), "{name}");
        assert_eq!(
            rec.count("sleeper-rollback"),
            3,
            "{name}: {:?}",
            rec.calls()
        );
        executor.shutdown().await.unwrap();
    }
}
