//! Embedding the engine: started from a plain tokio runtime (multi-thread and
//! current-thread) it runs its own actix system and stops it at shutdown; inside an
//! actix system it joins it; an actor holding only the executor's address can list
//! with filters, subscribe to completions and shut it down.

mod common;

use std::sync::Arc;

use common::{registry, Recorder, Reopen, Scripted, Step};
use proctor::messages::{Shutdown, Subscribe};
use proctor::{Error, Executor, List, ProcEvent, ProcId, ProcState, StateMachine, WaitingOn};

async fn start_on(store: Box<dyn proctor::ProcedureStore>) -> (Executor<Recorder>, Arc<Recorder>) {
    let rec = Arc::new(Recorder::default());
    let executor = Executor::builder()
        .registry(registry())
        .store(store)
        .workers(4)
        .arbiters(2)
        .env(rec.clone())
        .start()
        .await
        .expect("executor starts");
    (executor, rec)
}

/// Runs one procedure to its end, shuts down, and starts again on the same store: the
/// second start finds the finished root (and, for the WAL, the directory lock free, so
/// the first engine's threads are gone).
async fn start_run_stop_restart(name: &'static str) {
    let store = Reopen::new(name);
    let (executor, rec) = start_on(store.open()).await;
    let id = executor
        .submit(Scripted::new("a", vec![Step::More, Step::More]))
        .await
        .expect("submit");
    assert_eq!(executor.wait(id).await.expect("wait"), Ok(()), "{name}");
    assert_eq!(rec.count("a-exec"), 2, "{name}: {:?}", rec.calls());
    executor.shutdown().await.expect("shutdown");

    restarts_to_find_one_success(store.open(), id, name).await;
}

/// Starts an engine on `store`, checks that it finds only `id`, finished SUCCESS, and
/// shuts it down.
async fn restarts_to_find_one_success(
    store: Box<dyn proctor::ProcedureStore>,
    id: ProcId,
    name: &str,
) {
    let (executor, _) = start_on(store).await;
    let listed = executor
        .list(List::new().with_finished())
        .await
        .expect("list");
    assert_eq!(
        listed.iter().map(|i| (i.id, i.state)).collect::<Vec<_>>(),
        vec![(id, ProcState::Success)],
        "{name}"
    );
    executor.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_from_a_multi_thread_tokio_runtime() {
    for name in ["memory", "wal"] {
        start_run_stop_restart(name).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn starts_from_a_current_thread_tokio_runtime() {
    for name in ["memory", "wal"] {
        start_run_stop_restart(name).await;
    }
}

#[test]
fn starts_from_a_plain_thread_with_its_own_runtime() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(start_run_stop_restart("wal"));
}

/// Dropping the last handle of an executor that runs its own actix system (started
/// outside actix) shuts it down as `shutdown` does: its threads end and the store's lock
/// is released, so a new executor can open the same directory; what was durable is
/// there. While any handle is left it runs on. (Seen: the system thread ran on, holding
/// the WAL directory's lock, until the process ended.)
#[tokio::test(flavor = "current_thread")]
async fn dropping_the_last_handle_stops_an_executor_that_owns_its_system() {
    let dir = tempfile::tempdir().expect("temp dir");
    let wal = proctor::WalStore::open(dir.path()).expect("open");
    let (executor, _rec) = start_on(Box::new(wal)).await;
    let id = executor
        .submit(Scripted::new("a", vec![Step::More]))
        .await
        .expect("submit");
    assert_eq!(executor.wait(id).await.expect("wait"), Ok(()));
    let other = executor.clone();
    drop(executor);
    assert_eq!(
        other.state(id).await.expect("still running").state,
        ProcState::Success
    );
    drop(other);
    // The engine stops on its own threads; wait for its lock to go (no fixed sleep).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let reopened = loop {
        match proctor::WalStore::open(dir.path()) {
            Ok(wal) => break wal,
            Err(proctor::StoreError::Locked { .. }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            Err(e) => panic!("the dropped executor still holds its store: {e}"),
        }
    };
    restarts_to_find_one_success(Box::new(reopened), id, "wal").await;
}

#[actix::test]
async fn inside_actix_it_joins_the_system_and_stops_by_message() {
    for (name, store, _dir) in common::stores() {
        let (executor, _) = start_on(store).await;
        let id = executor
            .submit(Scripted::new("a", vec![]))
            .await
            .expect("submit");
        executor.wait(id).await.expect("wait").expect("succeeds");
        // Only the address: the shutdown message.
        executor
            .addr()
            .unwrap()
            .send(Shutdown::now())
            .await
            .expect("shutdown");
        assert!(
            matches!(executor.state(id).await, Err(Error::Stopped)),
            "{name}"
        );
    }
}

#[actix::test]
async fn list_filters_by_state_type_and_tree() {
    for (name, store, _dir) in common::stores() {
        let (executor, _) = start_on(store).await;
        let done = executor
            .submit(Scripted::new("done", vec![]))
            .await
            .unwrap();
        executor.wait(done).await.unwrap().unwrap();
        let parked = executor
            .submit(Scripted::new(
                "parent",
                vec![Step::Children(vec![Scripted::new(
                    "child",
                    vec![Step::Suspend("never".into())],
                )])],
            ))
            .await
            .unwrap();
        common::wait_for_state(&executor, parked, ProcState::Waiting).await;
        let ids = |list: Vec<proctor::ProcInfo>| list.iter().map(|i| i.id).collect::<Vec<_>>();
        // Wait until the child is suspended too.
        loop {
            let waiting = executor
                .list(List::new().state(ProcState::Waiting))
                .await
                .unwrap();
            if waiting.len() == 2 {
                break;
            }
            tokio::task::yield_now().await;
        }
        let live = executor.list(List::new()).await.unwrap();
        let waits: Vec<_> = live.iter().map(|i| i.waiting_on.clone()).collect();
        assert_eq!(
            waits,
            [
                Some(WaitingOn::Children),
                Some(WaitingOn::Event("never".into()))
            ],
            "{name}: what each waits for"
        );
        assert!(
            live.iter().all(|i| !i.state.is_finished()),
            "{name}: finished roots are left out by default: {live:?}"
        );
        assert_eq!(live.len(), 2, "{name}: {live:?}");
        let child = live.iter().find(|i| i.parent == Some(parked)).unwrap().id;
        assert_eq!(
            ids(executor.list(List::new().with_finished()).await.unwrap()),
            vec![done, parked, child],
            "{name}"
        );
        assert_eq!(
            ids(executor
                .list(List::new().state(ProcState::Success))
                .await
                .unwrap()),
            vec![done],
            "{name}: asking for a finished state lists finished roots"
        );
        assert_eq!(
            ids(executor.list(List::new().root(parked)).await.unwrap()),
            vec![parked, child],
            "{name}"
        );
        assert_eq!(
            ids(executor
                .list(List::new().with_finished().type_name("adder"))
                .await
                .unwrap()),
            Vec::<proctor::ProcId>::new(),
            "{name}"
        );
        executor.shutdown().await.unwrap();
    }
}

#[actix::test]
async fn subscribers_hear_each_root_submitted_then_finished() {
    for (name, store, _dir) in common::stores() {
        let (executor, _) = start_on(store).await;
        let mut events = executor.subscribe().await.expect("subscribe");
        let ok = executor
            .submit(Scripted::new("ok", vec![Step::More]))
            .await
            .unwrap();
        let bad = executor
            .submit(Scripted::new("bad", vec![Step::Fail("no".into())]))
            .await
            .unwrap();
        let mut seen = Vec::new();
        while seen.len() < 4 {
            seen.push(events.next().await.expect("an event"));
        }
        for id in [ok, bad] {
            let of_id: Vec<&ProcEvent> = seen
                .iter()
                .filter(|e| match e {
                    ProcEvent::Submitted { id: i, .. } | ProcEvent::Finished { id: i, .. } => {
                        *i == id
                    }
                    _ => false,
                })
                .collect();
            assert!(
                matches!(
                    of_id[..],
                    [
                        ProcEvent::Submitted {
                            type_name: "scripted",
                            ..
                        },
                        ProcEvent::Finished {
                            type_name: "scripted",
                            ..
                        }
                    ]
                ),
                "{name}: {seen:?}"
            );
        }
        let bad_result = seen.iter().find_map(|e| match e {
            ProcEvent::Finished { id, result, .. } if *id == bad => Some(result.clone()),
            _ => None,
        });
        assert!(
            matches!(bad_result, Some(Err(ref f)) if f.error == proctor::ProcError::failed("no")),
            "{name}: {bad_result:?}"
        );
        executor.shutdown().await.unwrap();
        assert_eq!(
            events.next().await,
            None,
            "{name}: the stream ends at shutdown"
        );
    }
}

/// An actor that holds only the executor's address hears completions by message.
struct Listener {
    finished: tokio::sync::mpsc::UnboundedSender<ProcId>,
}

impl actix::Actor for Listener {
    type Context = actix::Context<Self>;
}

impl actix::Handler<ProcEvent> for Listener {
    type Result = ();

    fn handle(&mut self, event: ProcEvent, _ctx: &mut actix::Context<Self>) {
        if let ProcEvent::Finished { id, .. } = event {
            let _ = self.finished.send(id);
        }
    }
}

#[actix::test]
async fn an_actor_subscribes_with_its_recipient() {
    use actix::Actor;
    let (executor, _) = start_on(Box::new(proctor::MemoryStore::new())).await;
    let (tx, mut finished) = tokio::sync::mpsc::unbounded_channel();
    let listener = Listener { finished: tx }.start();
    executor
        .addr()
        .unwrap()
        .send(Subscribe(listener.recipient()))
        .await
        .unwrap()
        .unwrap();
    let id = executor
        .addr()
        .unwrap()
        .send(proctor::messages::Submit::new(Scripted::new("a", vec![])))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(finished.recv().await, Some(id));
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn a_state_machine_shows_the_name_of_its_state() {
    for (name, store, _dir) in common::stores() {
        let (executor, _) = start_on(store).await;
        let id = executor
            .submit(StateMachine::new(common::Adder { fail_in: None }))
            .await
            .unwrap();
        executor.wait(id).await.unwrap().unwrap();
        let info = executor.state(id).await.unwrap();
        assert_eq!(
            info.state_name.as_deref(),
            Some("Four"),
            "{name}: its last state"
        );
        assert_eq!(info.waiting_on, None, "{name}");
        executor.shutdown().await.unwrap();
    }
}

/// A subscription is a `futures` stream: `StreamExt`'s combinators work on it.
#[actix::test]
async fn a_subscription_is_a_stream() {
    use futures_util::StreamExt;
    for (name, store, _dir) in common::stores() {
        let (executor, _) = start_on(store).await;
        let events = executor.subscribe().await.expect("subscribe");
        let id = executor.submit(Scripted::new("ok", vec![])).await.unwrap();
        let finished: Vec<ProcEvent> = events
            .filter(|e| std::future::ready(matches!(e, ProcEvent::Finished { .. })))
            .take(1)
            .collect()
            .await;
        assert!(
            matches!(finished[..], [ProcEvent::Finished { id: i, .. }] if i == id),
            "{name}: {finished:?}"
        );
        executor.shutdown().await.unwrap();
    }
}
