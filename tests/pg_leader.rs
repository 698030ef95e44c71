//! Leadership on the PostgreSQL store: a standby waits for the lease and, once the
//! leader lets it go, takes it and carries on what the leader left; a leader whose
//! lease was taken steps down (no step starts, nothing more is acknowledged, requests
//! are answered `NotLeader`); a standby started at once answers `NotLeader` naming the
//! leader until it leads; an engine without the lease does not start beside a leader.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Recorder, Scripted, Step};
use proctor::store::ProcedureStore;
use proctor::{Error, Executor, PgLease, PgOptions, ProcEvent, ProcState, Role};

const PERIOD: Duration = Duration::from_millis(900);

fn lease(schema: &str, holder: &str) -> PgLease {
    PgLease::new(common::pg::server().url(), holder)
        .options(PgOptions::default().schema(schema))
        .period(PERIOD)
}

/// Records the fencing token its step runs under.
#[derive(serde::Serialize, serde::Deserialize)]
struct Token;

#[proctor::async_trait]
impl proctor::Procedure<Recorder> for Token {
    async fn execute(
        &mut self,
        ctx: &mut proctor::Context<Recorder>,
    ) -> Result<proctor::Flow<Recorder>, proctor::ProcError> {
        ctx.env().record(format!("token {:?}", ctx.fencing_token()));
        Ok(proctor::Flow::Done)
    }
    async fn rollback(
        &mut self,
        _: &mut proctor::Context<Recorder>,
    ) -> Result<(), proctor::ProcError> {
        Ok(())
    }
}

async fn start_leading(schema: &str, holder: &str) -> (Executor<Recorder>, Arc<Recorder>) {
    let rec = Arc::new(Recorder::default());
    let mut registry = common::registry();
    registry.register::<Token>("token");
    let executor = Executor::builder()
        .registry(registry)
        .store(common::pg::store_in(schema))
        .leadership(lease(schema, holder))
        .workers(4)
        .env(rec.clone())
        .start()
        .await
        .expect("leads");
    (executor, rec)
}

/// Runs `f` on a thread of its own: the synchronous PostgreSQL client runs a tokio
/// runtime, which may not start on a runtime's thread.
fn off_runtime<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| s.spawn(f).join().unwrap())
}

/// Submits "left", which waits for the event `go` after its first step, and returns
/// once it waits.
async fn submit_waiting(executor: &Executor<Recorder>) -> proctor::ProcId {
    let steps = vec![Step::Suspend("go".into()), Step::More];
    let left = executor.submit(Scripted::new("left", steps)).await.unwrap();
    common::wait_for_state(executor, left, ProcState::Waiting).await;
    left
}

/// Polls `executor`'s role until `done` says so (the lease's renewals run on a thread
/// of their own, at a third of the period), for at most 10 periods.
async fn until_role(executor: &Executor<Recorder>, done: impl Fn(&Role) -> bool) -> Role {
    let deadline = Instant::now() + PERIOD * 10;
    loop {
        let role = executor.role().await.unwrap();
        if done(&role) {
            return role;
        }
        assert!(Instant::now() < deadline, "still {role:?}");
        actix::clock::sleep(Duration::from_millis(20)).await;
    }
}

#[actix::test]
async fn a_standby_takes_over_what_the_leader_left() {
    let schema = common::pg::fresh_schema();
    let (a, a_rec) = start_leading(&schema, "a").await;
    assert_eq!(
        a.role().await.unwrap(),
        Role::Leader {
            holder: "a".into(),
            epoch: 1
        }
    );
    // Steps carry the lease's epoch, for the resources they change.
    let token = a.submit(Token).await.unwrap();
    assert_eq!(a.wait(token).await.unwrap(), Ok(()));
    assert_eq!(a_rec.count("token Some(1)"), 1, "{:?}", a_rec.calls());
    let done = a
        .submit(Scripted::new("done", vec![Step::More]))
        .await
        .unwrap();
    assert_eq!(a.wait(done).await.unwrap(), Ok(()));
    let left = submit_waiting(&a).await;

    // The standby waits while "a" leads.
    let standby = actix::spawn({
        let schema = schema.clone();
        async move { start_leading(&schema, "b").await }
    });
    let state = off_runtime(|| lease(&schema, "observer").state().unwrap());
    assert_eq!(state.holder.as_deref(), Some("a"));
    assert!(!standby.is_finished());

    // "a" stops and lets the lease go: "b" takes it and recovers the tree.
    a.shutdown().await.unwrap();
    let (b, rec) = standby.await.unwrap();
    assert_eq!(
        b.role().await.unwrap(),
        Role::Leader {
            holder: "b".into(),
            epoch: 2
        }
    );
    assert_eq!(b.wait(done).await.unwrap(), Ok(()), "a's result is b's");
    b.wake_event("go").await.unwrap();
    assert_eq!(b.wait(left).await.unwrap(), Ok(()));
    assert_eq!(rec.count("left-exec"), 1, "only the step a had not run");
    let token = b.submit(Token).await.unwrap();
    assert_eq!(b.wait(token).await.unwrap(), Ok(()));
    assert_eq!(rec.count("token Some(2)"), 1, "{:?}", rec.calls());
    b.shutdown().await.unwrap();
}

#[actix::test]
async fn a_leader_whose_lease_was_taken_steps_down() {
    let schema = common::pg::fresh_schema();
    let (a, rec) = start_leading(&schema, "a").await;
    let left = submit_waiting(&a).await;
    let mut events = a.subscribe().await.unwrap();

    // Another engine takes the lease (as a standby would after "a" went silent).
    off_runtime(|| {
        let mut sql =
            postgres::Client::connect(&common::pg::server().url(), postgres::NoTls).unwrap();
        sql.execute(
            &format!(
                "UPDATE {schema}.proctor_lease
                 SET holder = 'b', epoch = epoch + 1, expires_at = now() + interval '1 hour'"
            ),
            &[],
        )
        .unwrap();
    });

    // Subscribers hear it.
    loop {
        match events.next().await {
            Some(ProcEvent::SteppedDown { reason }) => {
                assert!(reason.contains("b took it"), "{reason}");
                break;
            }
            Some(_) => {}
            None => panic!("the subscription ended without a step-down"),
        }
    }
    let role = until_role(&a, |r| matches!(r, Role::SteppedDown { .. })).await;
    let Role::SteppedDown { reason } = role else {
        unreachable!()
    };
    assert!(reason.contains("b took it (epoch 2)"), "{reason}");
    // It acts on nothing more: submits are refused, the woken procedure does not run.
    let refused = a
        .submit(Scripted::new("late", vec![Step::More]))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::NotLeader { leader: Some(b), .. } if b == "b"),
        "{refused}"
    );
    let _ = a.wake_event("go").await;
    let waited = a.wait(left).await.unwrap_err();
    assert!(matches!(waited, Error::NotLeader { .. }), "{waited}");
    assert_eq!(rec.count("left-exec"), 1, "{:?}", rec.calls());
    assert_eq!(rec.count("late-exec"), 0);
    let _ = a.shutdown_now().await;
}

#[actix::test]
async fn a_standby_answers_with_the_leaders_name_until_it_leads() {
    let schema = common::pg::fresh_schema();
    let (a, _) = start_leading(&schema, "a").await;
    let left = submit_waiting(&a).await;
    let rec = Arc::new(Recorder::default());
    let b = Executor::builder()
        .registry(common::registry())
        .store(common::pg::store_in(&schema))
        .leadership(lease(&schema, "b"))
        .env(rec.clone())
        .start_standby()
        .expect("a standby starts at once");
    let mut events = b.subscribe().await.expect("a standby takes subscribers");

    // While "a" leads, "b" runs nothing and points at "a".
    let role = until_role(&b, |r| matches!(r, Role::Standby { leader: Some(_) })).await;
    assert_eq!(
        role,
        Role::Standby {
            leader: Some("a".into())
        }
    );
    let refused = b
        .submit(Scripted::new("early", vec![Step::More]))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, Error::NotLeader { leader: Some(l), .. } if l == "a"),
        "{refused}"
    );
    assert!(
        refused.to_string().contains("(the leader is a)"),
        "{refused}"
    );
    assert!(matches!(b.state(left).await, Err(Error::NotLeader { .. })));
    assert!(b.recovery().recovered_roots.is_empty());

    // "a" goes: "b" leads, its subscribers hear it first, and it carries "left" on.
    a.shutdown().await.unwrap();
    b.leading().await.expect("b leads");
    assert_eq!(
        events.next().await,
        Some(ProcEvent::Leading {
            holder: "b".into(),
            epoch: 2
        })
    );
    assert_eq!(
        b.role().await.unwrap(),
        Role::Leader {
            holder: "b".into(),
            epoch: 2
        }
    );
    assert_eq!(b.recovery().recovered_roots, vec![left]);
    b.wake_event("go").await.unwrap();
    assert_eq!(b.wait(left).await.unwrap(), Ok(()));
    // Its subscription goes on as any other.
    let id = b
        .submit(Scripted::new("late", vec![Step::More]))
        .await
        .unwrap();
    loop {
        match events.next().await {
            Some(ProcEvent::Finished { id: done, .. }) if done == id => break,
            Some(_) => {}
            None => panic!("the subscription ended"),
        }
    }
    b.shutdown().await.unwrap();
}

#[actix::test]
async fn a_standby_stopped_while_it_waits_never_leads() {
    let schema = common::pg::fresh_schema();
    let (a, _) = start_leading(&schema, "a").await;
    let b = Executor::builder()
        .registry(common::registry())
        .store(common::pg::store_in(&schema))
        .leadership(lease(&schema, "b"))
        .env(Arc::new(Recorder::default()))
        .start_standby()
        .unwrap();
    until_role(&b, |r| matches!(r, Role::Standby { leader: Some(_) })).await;
    b.clone().shutdown().await.unwrap();
    assert!(matches!(b.leading().await, Err(Error::Stopped)));
    assert!(matches!(b.role().await, Err(Error::Stopped)));
    // The lease stays with "a", whose epoch is still the first.
    a.shutdown().await.unwrap();
    let state = off_runtime(|| lease(&schema, "observer").state().unwrap());
    assert_eq!((state.holder.as_deref(), state.epoch), (Some("a"), 1));
}

#[test]
fn an_engine_without_the_lease_does_not_start_beside_a_leader() {
    let schema = common::pg::fresh_schema();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let leadership = runtime.block_on(lease(&schema, "a").acquire()).unwrap();
    let mut store = common::pg::store_in(&schema);
    let error = store.load().unwrap_err().to_string();
    assert!(
        error.contains("a holds the store's leader lease"),
        "{error}"
    );
    // Nor does it write.
    let error = store.append(&[proctor::store::StoreOp::Delete(proctor::ProcId(1))]);
    assert!(error.is_err());
    drop(leadership);
    // Once the leader let it go, it may: at once when the release reached the
    // database, else once the lease expires (a holder whose connection was down as it
    // stopped cannot release it; under load that happens).
    let deadline = Instant::now() + PERIOD * 3;
    loop {
        match store.load() {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                assert!(
                    e.to_string().contains("a holds the store's leader lease"),
                    "{e}"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("the lease was neither released nor expired: {e}"),
        }
    }
}

/// The backend pid of the lease's connection, once there is one other than `not`.
async fn lease_backend(not: Option<i32>) -> i32 {
    let deadline = Instant::now() + PERIOD * 10;
    loop {
        let pid: Option<i32> = off_runtime(|| {
            let mut sql =
                postgres::Client::connect(&common::pg::server().url(), postgres::NoTls).unwrap();
            sql.query_opt(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'proctor lease'
                 AND pid <> $1 LIMIT 1",
                &[&not.unwrap_or(0)],
            )
            .unwrap()
            .map(|row| row.get(0))
        });
        if let Some(pid) = pid {
            return pid;
        }
        assert!(Instant::now() < deadline, "no lease connection");
        actix::clock::sleep(Duration::from_millis(10)).await;
    }
}

/// One dropped connection costs the leader a round trip, not its lease: the renewal
/// that finds it gone is tried again at once on a new connection, and the leader goes
/// on renewing (the lease's expiry moves on) and leading.
#[actix::test]
async fn a_dropped_lease_connection_does_not_depose_the_leader() {
    let schema = common::pg::fresh_schema();
    let (a, rec) = start_leading(&schema, "a").await;
    let lease = lease(&schema, "observer");
    let expiry = |lease: &PgLease| {
        let state = off_runtime(|| lease.state().unwrap());
        assert_eq!(state.epoch, 1, "{state:?}");
        Instant::now() + state.remaining.unwrap_or_default()
    };
    for round in 0..3 {
        let pid = lease_backend(None).await;
        off_runtime(|| {
            let mut sql =
                postgres::Client::connect(&common::pg::server().url(), postgres::NoTls).unwrap();
            sql.execute("SELECT pg_terminate_backend($1)", &[&pid])
                .unwrap();
        });
        // Renewed twice since: the expiry moved on past where it stood, twice.
        let mut seen = expiry(&lease);
        for _ in 0..2 {
            let deadline = Instant::now() + PERIOD * 2;
            loop {
                let now = expiry(&lease);
                if now > seen + PERIOD / 10 {
                    seen = now;
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "round {round}: the lease was not renewed after its connection dropped"
                );
                actix::clock::sleep(Duration::from_millis(10)).await;
            }
        }
        assert_ne!(
            lease_backend(None).await,
            pid,
            "round {round}: a new connection"
        );
        assert_eq!(
            a.role().await.unwrap(),
            Role::Leader {
                holder: "a".into(),
                epoch: 1
            },
            "round {round}"
        );
    }
    let id = a.submit(Token).await.unwrap();
    assert_eq!(a.wait(id).await.unwrap(), Ok(()));
    assert_eq!(rec.calls(), vec!["token Some(1)".to_string()]);
    let _ = a.shutdown_now().await;
}
