//! Nonces through the executor, on every store: two submits with the same nonce at the
//! same moment get one id and run once; after a restart a retry finds the procedure,
//! finished or not; another group's nonce is another submission; a nonce reused with
//! another procedure or other arguments is a conflict, before and after a restart, and
//! runs nothing; a nonce reserved before its procedure is built makes retries wait for
//! its submit, its recorded failure, or its release.

mod common;

use common::{Adder, Recorder, Scripted, Step};
use proctor::store::StoreOp;
use proctor::{Error, Nonce, NonceRegistration, ProcError, ProcId, ProcState, StateMachine};

/// The id a conflict names, or a panic saying what came instead.
fn conflict(answer: Result<ProcId, Error>, nonce: Nonce, what: &str) -> ProcId {
    match answer {
        Err(Error::NonceConflict {
            nonce: named,
            existing,
        }) => {
            assert_eq!(named, nonce, "{what}");
            existing
        }
        other => panic!("{what}: a conflict, not {other:?}"),
    }
}

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
async fn a_submission_with_a_nonce_is_the_same_submit() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let nonce = Nonce::from_key("create-table t1");
        // The builder and the method take the same nonce; `join!` takes the builders.
        let (a, b) = tokio::join!(
            executor
                .submit(Scripted::new("p", vec![Step::More]))
                .nonce(nonce),
            executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce),
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a, b, "{name}");
        assert_eq!(executor.wait(a).await.unwrap(), Ok(()));
        let c = executor
            .submit(Scripted::new("p", vec![Step::More]))
            .nonce(nonce)
            .await
            .unwrap();
        assert_eq!(c, a, "{name}");
        assert_eq!(rec.count("p-exec"), 1, "{name}: {:?}", rec.calls());
        // Without a nonce: another submission.
        let other = executor.submit(Scripted::new("p", vec![])).await.unwrap();
        assert_ne!(other, a, "{name}");
        executor.shutdown_now().await.unwrap();
    }
}

#[actix::test]
async fn a_retry_after_a_restart_finds_the_procedure() {
    for name in common::STORES {
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
            .submit_with_nonce(
                Scripted::new("waits", vec![Step::Suspend("never".into()), Step::More]),
                waiting,
            )
            .await
            .unwrap();
        assert_eq!(again, suspended, "{name}");
        assert_eq!(executor.wait(again).await.unwrap(), Ok(()));
        // Nothing ran twice: only the recovered procedure's remaining steps.
        assert_eq!(rec.count("done-exec"), 0, "{name}: {:?}", rec.calls());
        executor.shutdown_now().await.unwrap();
    }
}

/// A nonce names one submission: reused with other arguments or another procedure
/// type it is refused with a conflict naming the procedure it was first used for, and
/// nothing runs; the same procedure with the same arguments still gets the first id.
/// Two different submits at the same moment: one runs, the other is the conflict.
#[actix::test]
async fn a_nonce_reused_with_other_arguments_is_a_conflict() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let nonce = Nonce::from_key("create-table t1");
        let first = executor
            .submit(Scripted::new("p", vec![Step::More]))
            .nonce(nonce)
            .await
            .unwrap();
        let other_arguments = executor
            .submit(Scripted::new("p", vec![Step::More, Step::More]))
            .nonce(nonce)
            .await;
        assert_eq!(conflict(other_arguments, nonce, name), first, "{name}");
        let other_type = executor
            .submit(StateMachine::<Adder, Recorder>::new(Adder {
                fail_in: None,
            }))
            .nonce(nonce)
            .await;
        assert_eq!(conflict(other_type, nonce, name), first, "{name}");
        // The message says what happened and what to do.
        let message = executor
            .submit(Scripted::new("q", vec![]))
            .nonce(nonce)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            message.contains(&format!("procedure {first}"))
                && message.contains("other arguments")
                && message.contains("new nonce"),
            "{name}: {message}"
        );
        // The retry of the first submission is still answered with its id, before
        // and after it finished.
        let retry = executor
            .submit(Scripted::new("p", vec![Step::More]))
            .nonce(nonce)
            .await
            .unwrap();
        assert_eq!(retry, first, "{name}");
        assert_eq!(executor.wait(first).await.unwrap(), Ok(()), "{name}");
        let retry = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(retry, first, "{name}");
        assert_eq!(rec.count("p-exec"), 1, "{name}: {:?}", rec.calls());
        assert_eq!(rec.count("q-exec"), 0, "{name}: {:?}", rec.calls());

        // At the same moment: whichever comes first runs; the other is its conflict.
        let nonce = Nonce::from_key("create-table t2");
        let (a, b) = tokio::join!(
            executor.submit(Scripted::new("a", vec![])).nonce(nonce),
            executor.submit(Scripted::new("b", vec![])).nonce(nonce),
        );
        let (ran, refused) = match (a, b) {
            (Ok(id), b) => (id, b),
            (a, Ok(id)) => (id, a),
            (a, b) => panic!("{name}: neither ran: {a:?}, {b:?}"),
        };
        assert_eq!(conflict(refused, nonce, name), ran, "{name}");
        assert_eq!(executor.wait(ran).await.unwrap(), Ok(()), "{name}");
        assert_eq!(
            rec.count("a-exec") + rec.count("b-exec"),
            1,
            "{name}: {:?}",
            rec.calls()
        );
        executor.shutdown_now().await.unwrap();
    }
}

/// The fingerprint of a nonce's submission is kept with the root's records: after a
/// restart a retry with the same procedure and arguments gets the first id, and one
/// with other arguments the conflict, for a finished root and an unfinished one.
#[actix::test]
async fn a_nonce_conflict_is_found_after_a_restart() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = common::start(store.open(), 4).await;
        let done = Nonce::from_key("done");
        let waiting = Nonce::from_key("waiting");
        let waits = || Scripted::new("waits", vec![Step::Suspend("never".into()), Step::More]);
        let finished = executor
            .submit_with_nonce(Scripted::new("done", vec![Step::More]), done)
            .await
            .unwrap();
        assert_eq!(executor.wait(finished).await.unwrap(), Ok(()));
        let suspended = executor.submit_with_nonce(waits(), waiting).await.unwrap();
        common::wait_for_state(&executor, suspended, ProcState::Waiting).await;
        executor.shutdown_now().await.unwrap();

        let (executor, rec) = common::start(store.open(), 4).await;
        let other = executor
            .submit_with_nonce(Scripted::new("done", vec![]), done)
            .await;
        assert_eq!(conflict(other, done, name), finished, "{name}");
        let other = executor
            .submit_with_nonce(Scripted::new("waits", vec![Step::More]), waiting)
            .await;
        assert_eq!(conflict(other, waiting, name), suspended, "{name}");
        let again = executor
            .submit_with_nonce(Scripted::new("done", vec![Step::More]), done)
            .await
            .unwrap();
        assert_eq!(again, finished, "{name}");
        let again = executor.submit_with_nonce(waits(), waiting).await.unwrap();
        assert_eq!(again, suspended, "{name}");
        assert_eq!(rec.count("done-exec"), 0, "{name}: {:?}", rec.calls());
        executor.shutdown_now().await.unwrap();
    }
}

/// A root recorded before nonces kept a fingerprint (its record has none) is never a
/// conflict: any submit with its nonce gets its id, as before.
#[actix::test]
async fn a_nonce_recorded_without_a_fingerprint_is_never_a_conflict() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, _) = common::start(store.open(), 4).await;
        let nonce = Nonce::from_key("from an older version");
        let first = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(executor.wait(first).await.unwrap(), Ok(()));
        executor.shutdown().await.unwrap();

        // Its record as an older version wrote it: the nonce, no fingerprint.
        {
            let mut opened = store.open();
            let snapshot = opened.load().unwrap();
            let mut record = snapshot
                .records
                .into_iter()
                .find(|r| r.id == first)
                .expect("the root's record");
            assert!(record.nonce_fingerprint.is_some(), "{name}");
            record.nonce_fingerprint = None;
            opened.append(&[StoreOp::Update(record)]).unwrap();
        }

        let (executor, rec) = common::start(store.open(), 4).await;
        let again = executor
            .submit_with_nonce(Scripted::new("other", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(again, first, "{name}");
        assert_eq!(rec.count("other-exec"), 0, "{name}: {:?}", rec.calls());
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
    for name in common::STORES {
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

/// A reservation held while a retry comes: the retry waits, then gets the reserved
/// submit's id; a registration after that finds the procedure.
#[actix::test]
async fn a_reserved_nonce_makes_retries_wait_for_its_submit() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let nonce = Nonce::from_key("create users");
        let NonceRegistration::Reserved(reservation) =
            executor.register_nonce(nonce).await.unwrap()
        else {
            panic!("{name}: a fresh nonce is reserved");
        };
        // A retry while it is held: waits (it has not answered once the reservation
        // submits), then answers the same id.
        let retry = executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce);
        let registration = executor.register_nonce(nonce);
        let submit = reservation.submit(Scripted::new("p", vec![Step::More]));
        let (retry, registration, submit) = tokio::join!(retry, registration, submit);
        let id = submit.unwrap();
        assert_eq!(retry.unwrap(), id, "{name}");
        match registration.unwrap() {
            NonceRegistration::Known(known) => assert_eq!(known, id, "{name}"),
            NonceRegistration::Reserved(_) => panic!("{name}: reserved twice"),
        }
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        assert_eq!(rec.count("p-exec"), 1, "{name}: {:?}", rec.calls());
        executor.shutdown_now().await.unwrap();
    }
}

/// A retry that waits on a reservation is compared with what the holder submits: the
/// same procedure gets its id, another a conflict; a registration (no procedure) gets
/// the id.
#[actix::test]
async fn a_retry_waiting_on_a_reservation_with_other_arguments_is_a_conflict() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let nonce = Nonce::from_key("create users");
        let NonceRegistration::Reserved(reservation) =
            executor.register_nonce(nonce).await.unwrap()
        else {
            panic!("{name}: a fresh nonce is reserved");
        };
        let same = executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce);
        let other = executor.submit_with_nonce(Scripted::new("p", vec![]), nonce);
        let registration = executor.register_nonce(nonce);
        let submit = reservation.submit(Scripted::new("p", vec![Step::More]));
        let (same, other, registration, submit) = tokio::join!(same, other, registration, submit);
        let id = submit.unwrap();
        assert_eq!(same.unwrap(), id, "{name}");
        assert_eq!(conflict(other, nonce, name), id, "{name}");
        match registration.unwrap() {
            NonceRegistration::Known(known) => assert_eq!(known, id, "{name}"),
            NonceRegistration::Reserved(_) => panic!("{name}: reserved twice"),
        }
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        assert_eq!(rec.count("p-exec"), 1, "{name}: {:?}", rec.calls());
        executor.shutdown_now().await.unwrap();
    }
}

/// A failure recorded for a reserved nonce is its result, durably: retries before and
/// after a restart get its id, and waiting on it gives the failure; nothing ran.
#[actix::test]
async fn a_failure_recorded_for_a_reserved_nonce_answers_every_retry() {
    for name in common::STORES {
        let store = common::Reopen::new(name);
        let (executor, rec) = common::start(store.open(), 4).await;
        let nonce = Nonce::from_key("create ''");
        let NonceRegistration::Reserved(reservation) =
            executor.register_nonce(nonce).await.unwrap()
        else {
            panic!("{name}: a fresh nonce is reserved");
        };
        let retry = executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce);
        let failed = reservation.fail("scripted", ProcError::failed("a table needs a name"));
        let (retry, failed) = tokio::join!(retry, failed);
        let id = failed.unwrap();
        assert_eq!(retry.unwrap(), id, "{name}");
        let failure = executor.wait(id).await.unwrap().unwrap_err();
        assert_eq!(failure.proc, id);
        assert_eq!(failure.type_name, "scripted");
        assert_eq!(failure.error, ProcError::failed("a table needs a name"));
        assert_eq!(
            executor.state(id).await.unwrap().state,
            ProcState::RolledBack
        );
        executor.shutdown_now().await.unwrap();

        let (executor, _) = common::start(store.open(), 4).await;
        match executor.register_nonce(nonce).await.unwrap() {
            NonceRegistration::Known(known) => assert_eq!(known, id, "{name}"),
            NonceRegistration::Reserved(_) => panic!("{name}: the failure was forgotten"),
        }
        let again = executor
            .submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce)
            .await
            .unwrap();
        assert_eq!(again, id, "{name}");
        assert!(executor.wait(id).await.unwrap().is_err(), "{name}");
        assert_eq!(rec.count("p-exec"), 0, "{name}: {:?}", rec.calls());
        executor.shutdown_now().await.unwrap();
    }
}

/// A reservation let go (dropped, or released) frees the nonce: a retry waiting on it
/// submits itself, and runs once; a failure for an unregistered type lets it go too.
#[actix::test]
async fn a_reservation_let_go_hands_the_nonce_to_the_next_request() {
    for (name, store, _dir) in common::stores() {
        let (executor, rec) = common::start(store, 4).await;
        let nonce = Nonce { group: 3, nonce: 1 };
        let NonceRegistration::Reserved(reservation) =
            executor.register_nonce(nonce).await.unwrap()
        else {
            panic!("{name}: a fresh nonce is reserved");
        };
        let retry = executor.submit_with_nonce(Scripted::new("p", vec![Step::More]), nonce);
        let let_go = async move {
            let error = reservation
                .fail("no such type", ProcError::failed("x"))
                .await
                .unwrap_err();
            assert!(matches!(error, Error::Registry(_)), "{error}");
        };
        let (retry, ()) = tokio::join!(retry, let_go);
        let id = retry.unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        assert_eq!(rec.count("p-exec"), 1, "{name}: {:?}", rec.calls());

        // Released by hand, then reserved again by the next registration.
        let other = Nonce { group: 3, nonce: 2 };
        let NonceRegistration::Reserved(first) = executor.register_nonce(other).await.unwrap()
        else {
            panic!("{name}: a fresh nonce is reserved");
        };
        first.release();
        let NonceRegistration::Reserved(second) = executor.register_nonce(other).await.unwrap()
        else {
            panic!("{name}: a released nonce is free");
        };
        let id = second
            .submit(Scripted::new("q", vec![Step::More]))
            .await
            .unwrap();
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
        executor.shutdown_now().await.unwrap();
    }
}
