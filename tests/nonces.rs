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
