//! Nonces through the executor, on both stores: two submits with the same nonce at the
//! same moment get one id and run once; after a restart a retry finds the procedure,
//! finished or not; another group's nonce is another submission.

mod common;

use common::{Scripted, Step};
use proctor::{Nonce, ProcState};

#[actix::test]
async fn the_same_nonce_at_the_same_moment_runs_once() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let nonce = Nonce { group: 1, nonce: 7 };
        let (a, b) = tokio::join!(
            executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce),
            executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b, "{name}");
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()));
        // Once more after it finished: still the same procedure.
        let c = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(c, a, "{name}");
        assert_eq!(rec.count("p-exec"), 1, "{name}: {:?}", rec.calls());
        // Another group, same number: another submission.
        let other = executor
            .submit_with_nonce(Scripted::new("q", vec![]), Nonce { group: 2, nonce: 7 })
            .await
            .unwrap();
        assert_ne!(other, a, "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn a_retry_after_a_restart_finds_the_procedure() {
    for name in ["memory", "wal"] {
        let store = common::Reopen::new(name);
        let (executor, _) = common::start(store.open(), 4).await;
        let done = Nonce { group: 1, nonce: 1 };
        let waiting = Nonce { group: 1, nonce: 2 };
        let finished = executor
            .submit_with_nonce(Scripted::new("done", vec![Step::More]), done)
            .await
            .unwrap();
        assert_eq!(executor.wait(finished).await.unwrap(), Ok(()));
        let suspended = executor
            .submit_with_nonce(
                Scripted::new("waits", vec![Step::Suspend("never".into()), Step::More]),
                waiting,
            )
            .await
            .unwrap();
        common::wait_for_state(&executor, suspended, ProcState::Waiting).await;
        executor.shutdown_now().await.unwrap();

        let (executor, rec) = common::start(store.open(), 4).await;
        let again = executor
            .submit_with_nonce(Scripted::new("done", vec![Step::More]), done)
            .await
            .unwrap();
        assert_eq!(again, finished, "{name}");
        assert_eq!(executor.wait(again).await.unwrap(), Ok(()));
        let again = executor
            .submit_with_nonce(Scripted::new("waits", vec![]), waiting)
            .await
            .unwrap();
        assert_eq!(again, suspended, "{name}");
        assert_eq!(executor.wait(again).await.unwrap(), Ok(()));
        // Nothing ran twice: only the recovered procedure's remaining steps.
        assert_eq!(rec.count("done-exec"), 0, "{name}: {:?}", rec.calls());
        executor.shutdown_now().await.unwrap();
    }
}

/// An executor whose results are evicted 30 ms after they finish, with nonces
/// remembered for `nonces`.
async fn start_evicting(
    store: Box<dyn proctor::ProcedureStore>,
    nonces: std::time::Duration,
) -> (
    proctor::Executor<common::Recorder>,
    std::sync::Arc<common::Recorder>,
) {
    use std::time::Duration;
    let rec = std::sync::Arc::new(common::Recorder::default());
    let executor = proctor::Executor::builder()
        .registry(common::registry())
        .store(store)
        .env(rec.clone())
        .retention(Duration::from_millis(30))
        .cleaner_interval(Duration::from_millis(5))
        .nonce_retention(nonces)
        .start()
        .await
        .expect("executor starts");
    (executor, rec)
}

/// Polls (as a client would) until `id`'s result is evicted.
async fn until_gone(executor: &proctor::Executor<common::Recorder>, id: proctor::ProcId) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !matches!(executor.state(id).await, Err(proctor::Error::Gone(_))) {
        assert!(std::time::Instant::now() < deadline, "{id} never evicted");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// A nonce outlives its root's result: within its window a retry answers the first
/// id and runs nothing, before and after a restart, although the result is gone; once
/// the window has passed too, the root's records are deleted and the nonce is free.
#[actix::test]
async fn a_nonce_is_remembered_for_its_own_window_after_the_result_is_evicted() {
    use std::time::Duration;
    for name in ["memory", "wal"] {
        let store = common::Reopen::new(name);
        let nonce = Nonce { group: 3, nonce: 9 };
        let (executor, rec) = start_evicting(store.open(), Duration::from_secs(3600)).await;
        let first = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(executor.wait(first).await.unwrap(), Ok(()), "{name}");
        until_gone(&executor, first).await;
        let retry = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(retry, first, "{name}: the nonce outlived the result");
        assert_eq!(rec.count("p-exec"), 1, "{name}: nothing ran again");
        executor.shutdown_now().await.unwrap();

        let (executor, rec) = start_evicting(store.open(), Duration::from_secs(3600)).await;
        let retry = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(retry, first, "{name}: the nonce outlived a restart");
        until_gone(&executor, first).await;
        assert_eq!(rec.count("p-exec"), 0, "{name}");
        executor.shutdown_now().await.unwrap();

        // Its window is now shorter than the time since it finished: it goes.
        let (executor, rec) = start_evicting(store.open(), Duration::from_millis(30)).await;
        until_gone(&executor, first).await;
        let fresh = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_ne!(fresh, first, "{name}: the nonce's window had passed");
        assert_eq!(executor.wait(fresh).await.unwrap(), Ok(()), "{name}");
        assert_eq!(rec.count("p-exec"), 1, "{name}: a new submission ran");
        executor.shutdown_now().await.unwrap();
        let snapshot = store.open().load().unwrap();
        assert!(
            snapshot.records.iter().all(|r| r.id != first),
            "{name}: the first root's records were deleted with its nonce"
        );
    }
}
