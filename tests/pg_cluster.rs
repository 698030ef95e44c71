//! A cluster of executors on the PostgreSQL store, in one process: members share the
//! partitions (each partition one owner, each owner's calls under the partition's epoch
//! and in the partition its root's id names), any member takes any submit and any
//! result request, roots with one key meet in one partition, and a member that leaves
//! gives its partitions to the others, which carry its roots on.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use proctor::{
    Cluster, Context, Executor, Flow, PgOptions, ProcError, ProcId, Procedure, Registry,
};

const PERIOD: Duration = Duration::from_millis(900);

/// One call: its root, its partition, its fencing token.
type Call = (ProcId, Option<u32>, Option<i64>);

/// What every call saw.
#[derive(Default)]
struct Calls {
    seen: Mutex<Vec<Call>>,
}

/// A root of `steps` steps, placed by `key` if it has one.
#[derive(serde::Serialize, serde::Deserialize)]
struct Steps {
    steps: u32,
    at: u32,
    key: Option<String>,
    /// How long each step awaits (a member's engines are stopped mid-root).
    think_ms: u64,
}

#[proctor::async_trait]
impl Procedure<Calls> for Steps {
    async fn execute(&mut self, ctx: &mut Context<Calls>) -> Result<Flow<Calls>, ProcError> {
        tokio::time::sleep(Duration::from_millis(self.think_ms)).await;
        ctx.env()
            .seen
            .lock()
            .unwrap()
            .push((ctx.root(), ctx.partition(), ctx.fencing_token()));
        self.at += 1;
        Ok(if self.at < self.steps {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, _: &mut Context<Calls>) -> Result<(), ProcError> {
        Ok(())
    }

    fn affinity(&self) -> Option<String> {
        self.key.clone()
    }
}

async fn member(schema: &str, name: &str, calls: &Arc<Calls>) -> Cluster<Calls> {
    let calls = calls.clone();
    Cluster::builder(common::pg::server().url(), name)
        .options(PgOptions::default().schema(schema))
        .partitions(8)
        .period(PERIOD)
        .engines(move || {
            let mut registry = Registry::new();
            registry.register::<Steps>("steps");
            Executor::builder()
                .registry(registry)
                .env(calls.clone())
                .arbiters(1)
                .workers(4)
        })
        .start()
        .await
        .expect("joins")
}

async fn until(what: &str, within: Duration, mut done: impl FnMut() -> bool) {
    let started = Instant::now();
    while !done() {
        assert!(started.elapsed() < within, "not within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn root(key: Option<String>, think_ms: u64) -> Steps {
    Steps {
        steps: 3,
        at: 0,
        key,
        think_ms,
    }
}

#[actix::test]
async fn members_share_the_partitions_and_take_any_request() {
    let schema = common::pg::fresh_schema();
    let calls = Arc::new(Calls::default());
    let a = member(&schema, "a", &calls).await;
    let b = member(&schema, "b", &calls).await;
    until(
        "both own half the partitions",
        Duration::from_secs(10),
        || a.owned().len() == 4 && b.owned().len() == 4,
    )
    .await;
    let mut ids = Vec::new();
    for i in 0..40 {
        let (via, key) = match i % 4 {
            0 => (&a, None),
            1 => (&b, None),
            2 => (&a, Some(format!("table/{}", i % 3))),
            _ => (&b, Some(format!("table/{}", i % 3))),
        };
        let id = via.submit(root(key.clone(), 0)).await.expect("submitted");
        ids.push((id, key));
    }
    for (i, (id, _)) in ids.iter().enumerate() {
        // Wait through the other member than the one submitted to.
        let via = if i % 2 == 0 { &b } else { &a };
        via.wait(*id).await.expect("waited").expect("succeeded");
    }
    let seen = calls.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 120, "three steps per root");
    let mut by_key: HashMap<String, HashSet<u32>> = HashMap::new();
    for (id, key) in &ids {
        let partition = a.partition_of(*id);
        for (root, p, token) in seen.iter().filter(|(r, _, _)| r == id) {
            assert_eq!(
                *p,
                Some(partition),
                "root {root} ran in the partition its id names"
            );
            assert!(
                token.is_some_and(|t| t > 0),
                "every call has its partition's epoch"
            );
        }
        if let Some(key) = key {
            by_key.entry(key.clone()).or_default().insert(partition);
            assert_eq!(
                partition,
                proctor::partitions::partition_of_key(key, 8),
                "a keyed root runs in its key's partition"
            );
        }
    }
    assert!(
        by_key.values().all(|p| p.len() == 1),
        "one key, one partition"
    );
    let state = a.state().await.expect("state");
    assert_eq!(state.partitions.len(), 8);
    assert!(state.coordinator.is_some());
    a.leave().await.expect("left");
    b.leave().await.expect("left");
}

#[actix::test]
async fn a_member_that_leaves_gives_its_roots_to_the_others() {
    let schema = common::pg::fresh_schema();
    let calls = Arc::new(Calls::default());
    let a = member(&schema, "a", &calls).await;
    let b = member(&schema, "b", &calls).await;
    until("both own partitions", Duration::from_secs(10), || {
        a.owned().len() == 4 && b.owned().len() == 4
    })
    .await;
    // Roots that think: some are mid-way when a leaves.
    let mut ids = Vec::new();
    for _ in 0..16 {
        ids.push(a.submit(root(None, 100)).await.expect("submitted"));
    }
    let left = Instant::now();
    a.leave().await.expect("left");
    until("b owns every partition", 2 * PERIOD, || {
        b.owned().len() == 8
    })
    .await;
    eprintln!("partitions moved in {:?}", left.elapsed());
    for id in &ids {
        b.wait(*id).await.expect("waited").expect("succeeded");
    }
    let state = b.state().await.expect("state");
    assert!(
        state.moves >= 4,
        "a's partitions moved: {:?}",
        state.recent_moves
    );
    let seen = calls.seen.lock().unwrap().clone();
    // Each root's steps ran in order under non-decreasing epochs.
    for id in &ids {
        let tokens: Vec<i64> = seen
            .iter()
            .filter(|(r, _, _)| r == id)
            .filter_map(|(_, _, t)| *t)
            .collect();
        assert!(tokens.len() >= 3, "root {id}: {tokens:?}");
        assert!(
            tokens.windows(2).all(|w| w[0] <= w[1]),
            "root {id}: {tokens:?}"
        );
    }
    b.leave().await.expect("left");
}

/// A member started from a plain tokio runtime runs in an actix system of its own,
/// which leaving ends.
#[tokio::test]
async fn a_member_starts_outside_actix_and_leaving_ends_its_system() {
    let schema = common::pg::fresh_schema();
    let calls = Arc::new(Calls::default());
    let a = member(&schema, "a", &calls).await;
    tokio::time::timeout(Duration::from_secs(10), a.wait_owning())
        .await
        .expect("owns within 10 s")
        .expect("owns");
    let id = a.submit(root(None, 0)).await.expect("submitted");
    a.wait(id).await.expect("waited").expect("succeeded");
    a.leave().await.expect("left");
    assert!(matches!(
        a.submit(root(None, 0)).await,
        Err(proctor::Error::Stopped)
    ));
}
