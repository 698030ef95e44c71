//! Remote operations end to end, through a fake in-process transport: batching, reports
//! in any order and twice, reports for unknown operations, failed sends retried, a
//! target that keeps failing, a target removed mid-flight, an operation of the wrong
//! type, and a crash at every write.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proctor::{
    async_trait, Context, Executor, ExecutorBuilder, Flow, OpId, ProcError, Procedure, Registry,
    RemoteError, RemoteOptions, Report, Transport, TransportError,
};
use serde::{Deserialize, Serialize};

/// What a node is asked to do.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct OpenRegion {
    region: u32,
}

/// The fake nodes, shared by every engine of a test.
#[derive(Default)]
struct Nodes {
    /// Every request: its target and its ops.
    requests: Mutex<Vec<(String, Vec<OpId>)>>,
    /// How many times each op reached a node (a node applies it once: it deduplicates).
    received: Mutex<HashMap<OpId, u32>>,
    /// Targets whose next sends fail, how many more times.
    failing: Mutex<HashMap<String, u32>>,
    /// Targets that take requests and report nothing.
    silent: Mutex<HashSet<String>>,
    /// Report later (the test reports), not with the request's answer.
    later: bool,
    /// Ops received whose report the test sends.
    held: Mutex<Vec<(OpId, String, u32)>>,
    changed: tokio::sync::Notify,
}

impl Nodes {
    fn requests_to(&self, target: &str) -> Vec<Vec<OpId>> {
        let requests = self.requests.lock().unwrap();
        requests
            .iter()
            .filter(|(t, _)| t == target)
            .map(|(_, ops)| ops.clone())
            .collect()
    }

    /// Waits until `done` holds (checked whenever a request comes).
    async fn until(&self, done: impl Fn(&Nodes) -> bool) {
        loop {
            let changed = self.changed.notified();
            if done(self) {
                return;
            }
            changed.await;
        }
    }
}

struct Fake(Arc<Nodes>);

#[async_trait]
impl Transport for Fake {
    type Op = OpenRegion;

    /// A region whose number is 0 no longer needs opening after a restart.
    fn rebuild(&self, _target: &str, op: OpenRegion) -> Option<OpenRegion> {
        (op.region != 0).then_some(op)
    }

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, OpenRegion)>,
    ) -> Result<Vec<Report>, TransportError> {
        let nodes = &self.0;
        nodes
            .requests
            .lock()
            .unwrap()
            .push((target.to_string(), ops.iter().map(|(id, _)| *id).collect()));
        let failed = {
            let mut failing = nodes.failing.lock().unwrap();
            match failing.get_mut(target) {
                Some(left) if *left > 0 => {
                    *left = left.saturating_sub(1);
                    true
                }
                _ => false,
            }
        };
        nodes.changed.notify_waiters();
        if failed {
            return Err(TransportError(format!("{target} refused the connection")));
        }
        let mut reports = Vec::new();
        for (id, op) in ops {
            *nodes.received.lock().unwrap().entry(id).or_default() += 1;
            if nodes.silent.lock().unwrap().contains(target) {
                continue;
            }
            if nodes.later {
                nodes
                    .held
                    .lock()
                    .unwrap()
                    .push((id, target.to_string(), op.region));
            } else {
                reports.push(Report::ok(id, &(target.to_string(), op.region)).unwrap());
            }
        }
        nodes.changed.notify_waiters();
        Ok(reports)
    }
}

/// What the procedures did, in order.
#[derive(Default)]
struct Log(Mutex<Vec<String>>);

impl Log {
    fn push(&self, line: String) {
        self.0.lock().unwrap().push(line);
    }
    fn lines(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// Opens regions on their nodes; regions whose node was removed go to `spare`.
#[derive(Serialize, Deserialize)]
struct Open {
    regions: Vec<(String, u32)>,
    spare: Option<String>,
    phase: u8,
}

impl Open {
    fn new(regions: &[(&str, u32)]) -> Self {
        Open {
            regions: regions
                .iter()
                .map(|(t, r)| ((*t).to_string(), *r))
                .collect(),
            spare: None,
            phase: 0,
        }
    }
}

#[async_trait]
impl Procedure<Log> for Open {
    async fn execute(&mut self, ctx: &mut Context<Log>) -> Result<Flow<Log>, ProcError> {
        if self.phase == 0 {
            for (target, region) in &self.regions {
                ctx.dispatch(target.clone(), &OpenRegion { region: *region })?;
            }
            self.phase = 1;
            return Ok(ctx.await_remote());
        }
        // Each phase's outcomes come after the earlier phases'.
        let results = ctx.remote_results();
        let latest = &results[results.len() - self.regions.len()..];
        let mut moved = Vec::new();
        for (result, (_, region)) in latest.iter().zip(&self.regions) {
            match &result.outcome {
                Ok(_) => {
                    let (node, opened): (String, u32) = result.value()?;
                    assert_eq!(opened, *region);
                    ctx.env().push(format!("opened {region} on {node}"));
                }
                Err(e @ (RemoteError::NotSent { .. } | RemoteError::Timeout { .. }))
                    if *region == 0 =>
                {
                    ctx.env().push(format!("region 0: {e}"));
                }
                Err(RemoteError::TargetGone { target }) if self.spare.is_some() => {
                    ctx.env().push(format!("{target} gone, moving {region}"));
                    moved.push((self.spare.clone().unwrap_or_default(), *region));
                }
                Err(e) => return Err(ProcError::failed(format!("region {region}: {e}"))),
            }
        }
        if moved.is_empty() {
            return Ok(Flow::Done);
        }
        for (target, region) in &moved {
            ctx.dispatch(target.clone(), &OpenRegion { region: *region })?;
        }
        self.regions = moved;
        self.phase += 1;
        Ok(ctx.await_remote())
    }

    async fn rollback(&mut self, ctx: &mut Context<Log>) -> Result<(), ProcError> {
        ctx.env().push(format!("rollback {:?}", ctx.undoing()));
        Ok(())
    }
}

fn builder(nodes: &Arc<Nodes>, log: &Arc<Log>, options: RemoteOptions) -> ExecutorBuilder<Log> {
    let mut registry = Registry::<Log>::default();
    registry.register::<Open>("open");
    Executor::builder()
        .registry(registry)
        .env(log.clone())
        .remote(Fake(nodes.clone()), options)
}

async fn start(nodes: &Arc<Nodes>, log: &Arc<Log>, options: RemoteOptions) -> Executor<Log> {
    builder(nodes, log, options)
        .store(proctor::MemoryStore::new())
        .start()
        .await
        .unwrap()
}

#[actix::test]
async fn a_hundred_procedures_to_three_targets_go_in_requests_of_at_most_32() {
    let nodes = Arc::new(Nodes::default());
    let log = Arc::new(Log::default());
    let executor = start(&nodes, &log, RemoteOptions::default()).await;
    let mut ids = Vec::new();
    for region in 0..100u32 {
        let target = ["a", "b", "c"][region as usize % 3];
        ids.push(
            executor
                .submit(Open::new(&[(target, region)]))
                .await
                .unwrap(),
        );
    }
    for id in ids {
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    }
    let requests = nodes.requests.lock().unwrap().clone();
    assert!(
        requests.iter().all(|(_, ops)| ops.len() <= 32),
        "{requests:?}"
    );
    assert!(requests.len() < 100, "batched: {} requests", requests.len());
    let received = nodes.received.lock().unwrap().clone();
    assert_eq!(received.len(), 100);
    assert!(received.values().all(|&n| n == 1), "each op sent once");
    let opened: HashSet<String> = log.lines().into_iter().collect();
    assert_eq!(opened.len(), 100, "each region opened once");
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn reports_in_any_order_and_twice_are_each_taken_once_and_unknown_ones_ignored() {
    let nodes = Arc::new(Nodes {
        later: true,
        ..Nodes::default()
    });
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default().max_age(Duration::from_millis(5));
    let executor = start(&nodes, &log, options).await;
    let mut ids = Vec::new();
    for n in 0..5u32 {
        let open = Open::new(&[("a", 2 * n), ("b", 2 * n + 1)]);
        ids.push(executor.submit(open).await.unwrap());
    }
    nodes.until(|n| n.held.lock().unwrap().len() == 10).await;
    let mut held = nodes.held.lock().unwrap().clone();
    held.reverse();
    for (op, target, region) in held {
        let report = || Report::ok(op, &(target.clone(), region)).unwrap();
        assert!(executor.report(report()).await.unwrap(), "{op} taken");
        assert!(
            !executor.report(report()).await.unwrap(),
            "{op} again: ignored"
        );
    }
    let unknown = Report::failed(OpId(1 << 40), "no such op");
    assert!(!executor.report(unknown).await.unwrap());
    for id in ids {
        assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    }
    assert_eq!(log.lines().len(), 10);
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn failed_sends_are_retried_and_a_target_that_keeps_failing_rolls_the_tree_back() {
    let nodes = Arc::new(Nodes::default());
    nodes.failing.lock().unwrap().insert("a".into(), 2);
    nodes.failing.lock().unwrap().insert("b".into(), u32::MAX);
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default()
        .max_age(Duration::from_millis(5))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(40))
        .deadline(Duration::from_millis(400));
    let executor = start(&nodes, &log, options).await;

    let retried = executor.submit(Open::new(&[("a", 1)])).await.unwrap();
    assert_eq!(executor.wait(retried).await.unwrap(), Ok(()));
    assert_eq!(
        nodes.requests_to("a").len(),
        3,
        "two failed sends, then one"
    );
    assert_eq!(nodes.received.lock().unwrap().len(), 1);

    let failing = executor.submit(Open::new(&[("b", 2)])).await.unwrap();
    let failure = executor
        .wait(failing)
        .await
        .unwrap()
        .unwrap_err()
        .to_string();
    assert!(
        failure.contains("sending to b failed until the operation's deadline")
            && failure.contains("b refused the connection"),
        "{failure}"
    );
    assert!(
        nodes.requests_to("b").len() >= 2,
        "retried until the deadline"
    );
    // The step that failed, then the one that dispatched.
    assert_eq!(
        log.lines(),
        ["opened 1 on a", "rollback Failed", "rollback Completed"]
    );
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn a_removed_target_fails_its_operations_and_the_step_moves_them() {
    let nodes = Arc::new(Nodes::default());
    nodes.silent.lock().unwrap().insert("c".into());
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default().max_age(Duration::from_millis(5));
    let executor = start(&nodes, &log, options).await;
    let mut open = Open::new(&[("a", 1), ("c", 2), ("c", 3)]);
    open.spare = Some("d".into());
    let id = executor.submit(open).await.unwrap();
    nodes.until(|n| n.received.lock().unwrap().len() == 3).await;
    assert_eq!(executor.remove_target("c").await.unwrap(), 2);
    assert_eq!(executor.wait(id).await.unwrap(), Ok(()));
    let lines = log.lines();
    assert_eq!(lines[0], "opened 1 on a", "{lines:?}");
    assert_eq!(
        lines[1..3],
        ["c gone, moving 2", "c gone, moving 3"],
        "{lines:?}"
    );
    assert_eq!(lines[3..], ["opened 2 on d", "opened 3 on d"], "{lines:?}");
    // Nothing is left for the removed target; a report from it now is ignored.
    let late = nodes.requests_to("c")[0][0];
    assert!(!executor.report(Report::failed(late, "late")).await.unwrap());
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn a_crash_at_every_write_reports_each_operation_once_to_its_procedure() {
    let nodes = Arc::new(Nodes::default());
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default().max_age(Duration::from_millis(1));
    let mut resent = 0;
    let runs = proctor::testing::restart_at_every_write(
        || builder(&nodes, &log, options),
        || Open::new(&[("a", 1), ("b", 2), ("a", 3)]),
        |run| {
            let lines = log.lines();
            let received = std::mem::take(&mut *nodes.received.lock().unwrap());
            nodes.requests.lock().unwrap().clear();
            log.0.lock().unwrap().clear();
            let Some(result) = &run.result else { return };
            assert_eq!(*result, Ok(()), "{run:?}");
            // The last step ran once to its end on the engine after the crash (or
            // before it): each region once in its last run.
            let tail: Vec<&String> = lines.iter().rev().take(3).collect();
            for region in [1, 3] {
                assert_eq!(
                    tail.iter()
                        .filter(|l| **l == &format!("opened {region} on a"))
                        .count(),
                    1,
                    "{run:?}: {lines:?}"
                );
            }
            // An op goes again only to a node after a restart: at most twice.
            assert!(received.values().all(|&n| n <= 2), "{run:?}: {received:?}");
            resent += received.values().filter(|&&n| n == 2).count();
        },
    )
    .await
    .unwrap();
    assert!(runs.len() >= 10, "{}", runs.len());
    assert!(
        resent > 0,
        "some crash fell between a send and its recorded outcome"
    );
}

#[actix::test]
async fn an_operation_not_reported_in_time_fails_its_step() {
    let nodes = Arc::new(Nodes::default());
    nodes.silent.lock().unwrap().insert("a".into());
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default()
        .max_age(Duration::from_millis(5))
        .deadline(Duration::from_millis(200));
    let executor = start(&nodes, &log, options).await;
    let id = executor.submit(Open::new(&[("a", 1)])).await.unwrap();
    let failure = executor.wait(id).await.unwrap().unwrap_err().to_string();
    assert!(
        failure.contains("no report from a within 200 ms"),
        "{failure}"
    );
    assert_eq!(nodes.requests_to("a").len(), 1, "sent once, never reported");
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn after_a_restart_an_operation_the_transport_no_longer_needs_is_not_sent_again() {
    // Region 0 is silent, and no longer needed once the engine restarts: a crash
    // after it was sent ends it `NotSent` (without one, its deadline passes).
    let nodes = Arc::new(Nodes::default());
    nodes.silent.lock().unwrap().insert("a".into());
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default()
        .max_age(Duration::from_millis(1))
        .deadline(Duration::from_millis(300));
    let mut not_sent = 0;
    proctor::testing::restart_at_every_write(
        || builder(&nodes, &log, options),
        || Open::new(&[("a", 0)]),
        |run| {
            let lines = std::mem::take(&mut *log.0.lock().unwrap());
            let received = std::mem::take(&mut *nodes.received.lock().unwrap());
            let Some(result) = &run.result else { return };
            assert_eq!(*result, Ok(()), "{run:?}");
            if lines.iter().any(|l| l.contains("not sent again to a")) {
                not_sent += 1;
                assert!(received.values().all(|&n| n == 1), "{run:?}: {received:?}");
            } else {
                assert!(
                    lines.iter().any(|l| l.contains("no report from a")),
                    "{run:?}: {lines:?}"
                );
            }
        },
    )
    .await
    .unwrap();
    assert!(not_sent > 0, "a crash fell after the send");
}

/// Dispatches a value that is not the transport's operation type, then fails with
/// what came back.
#[derive(Serialize, Deserialize)]
struct Misdispatch {
    dispatched: bool,
}

#[async_trait]
impl Procedure<Log> for Misdispatch {
    async fn execute(&mut self, ctx: &mut Context<Log>) -> Result<Flow<Log>, ProcError> {
        if !self.dispatched {
            self.dispatched = true;
            ctx.dispatch("a", &"open region 7")?;
            return Ok(ctx.await_remote());
        }
        match &ctx.remote_results()[0].outcome {
            Err(e) => Err(ProcError::failed(e.to_string())),
            Ok(_) => Ok(Flow::Done),
        }
    }

    async fn rollback(&mut self, _: &mut Context<Log>) -> Result<(), ProcError> {
        Ok(())
    }
}

#[actix::test]
async fn an_operation_of_another_type_than_the_transports_fails_at_once_unsent() {
    let nodes = Arc::new(Nodes::default());
    let log = Arc::new(Log::default());
    let mut registry = Registry::<Log>::default();
    registry.register::<Misdispatch>("misdispatch");
    // The default deadline (60 s): an operation that cannot be sent must not wait
    // for it.
    let executor = Executor::builder()
        .registry(registry)
        .env(log.clone())
        .remote(Fake(nodes.clone()), RemoteOptions::default())
        .store(proctor::MemoryStore::new())
        .start()
        .await
        .unwrap();
    let id = executor
        .submit(Misdispatch { dispatched: false })
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(10), executor.wait(id))
        .await
        .expect("failed well before the operation's deadline");
    let failure = ended.unwrap().unwrap_err().to_string();
    assert!(
        failure.contains("the operation for a was not sent")
            && failure.contains("does not decode as a")
            && failure.contains("OpenRegion"),
        "{failure}"
    );
    assert!(nodes.requests_to("a").is_empty(), "nothing was sent");
    executor.shutdown().await.unwrap();
}
