//! PostgreSQL restarted (`pg_ctl restart -m fast`) under a running engine: the store
//! reconnects and writes the batch again, the procedures go on, and nothing
//! acknowledged is lost (a restart of the engine on the same tables finds every
//! finished root). Its own test binary: it restarts the process's server.

mod common;

use common::{Scripted, Step};
use proctor::ProcState;

#[actix::test]
async fn the_engine_rides_out_a_database_restart() {
    let schema = common::pg::fresh_schema();
    let (executor, rec) = common::start(Box::new(common::pg::store_in(&schema)), 4).await;
    let mut ids = Vec::new();
    for _ in 0..20 {
        let steps = vec![Step::More, Step::More];
        ids.push(executor.submit(Scripted::new("p", steps)).await.unwrap());
    }
    // Some procedures wait for an event across the restart.
    let waiting = executor
        .submit(Scripted::new(
            "w",
            vec![Step::Suspend("after-restart".into()), Step::More],
        ))
        .await
        .unwrap();
    common::wait_for_state(&executor, waiting, ProcState::Waiting).await;

    let server = common::pg::server();
    tokio::task::spawn_blocking(move || server.restart())
        .await
        .unwrap()
        .expect("PostgreSQL restarts");

    // Written after the restart: the store reconnected.
    executor.wake_event("after-restart").await.unwrap();
    for _ in 0..20 {
        let steps = vec![Step::More, Step::More];
        ids.push(executor.submit(Scripted::new("q", steps)).await.unwrap());
    }
    ids.push(waiting);
    for &id in &ids {
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()), "{id}");
    }
    assert_eq!(rec.count("p-exec"), 40);
    assert_eq!(rec.count("q-exec"), 40);
    executor.shutdown().await.unwrap();

    // Every acknowledged result is in the tables.
    let (executor, _) = common::start(Box::new(common::pg::store_in(&schema)), 4).await;
    for &id in &ids {
        assert_eq!(
            executor.wait(id).await.unwrap(),
            Ok(()),
            "{id} after a restart"
        );
    }
    executor.shutdown().await.unwrap();
}
