//! Remote operations end to end, through a fake in-process transport: batching, reports
//! in any order and twice, reports for unknown operations, failed sends retried, a
//! target that keeps failing, a target removed mid-flight, an operation of the wrong
//! type, and a crash at every write.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering::SeqCst;
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
                ctx.dispatch::<Fake>(target.clone(), &OpenRegion { region: *region })?;
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
            ctx.dispatch::<Fake>(target.clone(), &OpenRegion { region: *region })?;
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
    let mut registry = Registry::new();
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

/// Dispatches through a transport other than the executor's (`Elsewhere`, whose
/// operations are strings, not the executor's transport's type), then fails with what
/// came back.
/// A transport no executor of these tests is given.
struct Elsewhere;

#[async_trait]
impl Transport for Elsewhere {
    type Op = String;

    async fn send(&self, _: &str, _: Vec<(OpId, String)>) -> Result<Vec<Report>, TransportError> {
        Ok(Vec::new())
    }
}

#[derive(Serialize, Deserialize)]
struct Misdispatch {
    dispatched: bool,
}

#[async_trait]
impl Procedure<Log> for Misdispatch {
    async fn execute(&mut self, ctx: &mut Context<Log>) -> Result<Flow<Log>, ProcError> {
        if !self.dispatched {
            self.dispatched = true;
            ctx.dispatch::<Elsewhere>("a", &"open region 7".to_string())?;
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
    let mut registry = Registry::new();
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

// Undoing operations on a rollback: region nodes that open and close regions.

/// What a region node is asked to do: open a region, or close it (an open's undo).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum RegionOp {
    Open(u32),
    Close(u32),
}

/// Region nodes that finish each operation once (deduplicating by op id, and answering
/// a repeat with the first outcome), at once in the request's answer or, while held,
/// when the test says (`finish_held`).
#[derive(Default)]
struct Cluster {
    /// Every op a node received, repeats included: (target, id, op).
    received: Mutex<Vec<(String, OpId, RegionOp)>>,
    /// Ops received and not finished yet.
    working: Mutex<Vec<(String, OpId, RegionOp)>>,
    /// The first outcome of each finished op.
    finished: Mutex<HashMap<OpId, Result<(), String>>>,
    /// What the nodes did, in order: `open 1 on a (op-7)`, `close 1 on a (op-7/undo)`,
    /// `failed open 4 on c (op-9)`.
    done: Mutex<Vec<String>>,
    /// Regions whose opening fails on the node.
    failing: Mutex<HashSet<u32>>,
    /// Finish opens only when the test says.
    hold_opens: AtomicBool,
    /// Finish closes only when the test says.
    hold_closes: AtomicBool,
    /// Finish opens at once and never report them, repeats included.
    silent_opens: bool,
    changed: tokio::sync::Notify,
}

impl Cluster {
    fn holding(opens: bool, closes: bool) -> Arc<Cluster> {
        let cluster = Cluster::default();
        cluster.hold_opens.store(opens, SeqCst);
        cluster.hold_closes.store(closes, SeqCst);
        Arc::new(cluster)
    }

    fn holds(&self, op: &RegionOp) -> bool {
        match op {
            RegionOp::Open(_) => self.hold_opens.load(SeqCst),
            RegionOp::Close(_) => self.hold_closes.load(SeqCst),
        }
    }

    fn finish(&self, target: &str, id: OpId, op: &RegionOp) -> Report {
        let outcome = match op {
            RegionOp::Open(r) if self.failing.lock().unwrap().contains(r) => {
                Err(format!("region {r} is damaged"))
            }
            _ => Ok(()),
        };
        let line = match (op, &outcome) {
            (RegionOp::Open(r), Ok(())) => format!("open {r} on {target} ({id})"),
            (RegionOp::Close(r), _) => format!("close {r} on {target} ({id})"),
            (RegionOp::Open(r), Err(_)) => format!("failed open {r} on {target} ({id})"),
        };
        self.done.lock().unwrap().push(line);
        self.finished.lock().unwrap().insert(id, outcome.clone());
        Self::report(id, &outcome)
    }

    fn report(id: OpId, outcome: &Result<(), String>) -> Report {
        match outcome {
            Ok(()) => Report::ok(id, &()).unwrap(),
            Err(e) => Report::failed(id, e.clone()),
        }
    }

    /// Finishes every op held, oldest first: their reports.
    fn finish_held(&self) -> Vec<Report> {
        let working = std::mem::take(&mut *self.working.lock().unwrap());
        working
            .iter()
            .map(|(target, id, op)| self.finish(target, *id, op))
            .collect()
    }

    fn received(&self) -> Vec<(String, OpId, RegionOp)> {
        self.received.lock().unwrap().clone()
    }

    fn done(&self) -> Vec<String> {
        self.done.lock().unwrap().clone()
    }

    /// How many times the nodes did `line`'s work.
    fn times(&self, line: &str) -> usize {
        self.done().iter().filter(|l| *l == line).count()
    }

    /// The id each region's open was sent under.
    fn open_ids(&self) -> HashMap<u32, OpId> {
        self.received()
            .into_iter()
            .filter_map(|(_, id, op)| match op {
                RegionOp::Open(r) => Some((r, id)),
                RegionOp::Close(_) => None,
            })
            .collect()
    }

    /// Waits until `done` holds (checked whenever a node is sent something), at most
    /// 10 s.
    async fn until(&self, done: impl Fn(&Cluster) -> bool) {
        let wait = async {
            loop {
                let changed = self.changed.notified();
                if done(self) {
                    return;
                }
                changed.await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .is_err()
        {
            panic!("the nodes never got there: {:?}", self.received());
        }
    }
}

struct RegionNodes(Arc<Cluster>);

#[async_trait]
impl Transport for RegionNodes {
    type Op = RegionOp;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, RegionOp)>,
    ) -> Result<Vec<Report>, TransportError> {
        let cluster = &self.0;
        let mut reports = Vec::new();
        for (id, op) in ops {
            cluster
                .received
                .lock()
                .unwrap()
                .push((target.to_string(), id, op.clone()));
            let first = cluster.finished.lock().unwrap().get(&id).cloned();
            let working = cluster.working.lock().unwrap().iter().any(|w| w.1 == id);
            let silent = cluster.silent_opens && matches!(op, RegionOp::Open(_));
            if silent {
                if first.is_none() {
                    cluster.finish(target, id, &op);
                }
            } else if let Some(first) = first {
                // A repeat of a finished op: its first outcome again.
                reports.push(Cluster::report(id, &first));
            } else if working {
                // A repeat of an op at work: reported once finished.
            } else if cluster.holds(&op) {
                cluster
                    .working
                    .lock()
                    .unwrap()
                    .push((target.to_string(), id, op));
            } else {
                reports.push(cluster.finish(target, id, &op));
            }
        }
        cluster.changed.notify_waiters();
        Ok(reports)
    }
}

/// Opens each region on its node, each open undone by closing the region.
#[derive(Serialize, Deserialize)]
struct Assign {
    regions: Vec<(String, u32)>,
    dispatched: bool,
    timeout_ms: Option<u64>,
}

impl Assign {
    fn new(regions: &[(&str, u32)]) -> Self {
        Assign {
            regions: regions
                .iter()
                .map(|(t, r)| ((*t).to_string(), *r))
                .collect(),
            dispatched: false,
            timeout_ms: None,
        }
    }
}

#[async_trait]
impl Procedure<Log> for Assign {
    fn timeout_ms(&self) -> Option<u64> {
        self.timeout_ms
    }

    async fn execute(&mut self, ctx: &mut Context<Log>) -> Result<Flow<Log>, ProcError> {
        if self.dispatched {
            return Ok(Flow::Done);
        }
        for (target, region) in &self.regions {
            ctx.dispatch::<RegionNodes>(target.clone(), &RegionOp::Open(*region))?
                .undo(&RegionOp::Close(*region))?;
        }
        self.dispatched = true;
        Ok(ctx.await_remote())
    }

    async fn rollback(&mut self, ctx: &mut Context<Log>) -> Result<(), ProcError> {
        ctx.env()
            .push(format!("assign rollback {:?}", ctx.undoing()));
        Ok(())
    }
}

fn region_builder(
    cluster: &Arc<Cluster>,
    log: &Arc<Log>,
    options: RemoteOptions,
) -> ExecutorBuilder<Log> {
    let mut registry = Registry::new();
    registry.register::<Assign>("assign");
    Executor::builder()
        .registry(registry)
        .env(log.clone())
        .remote(RegionNodes(cluster.clone()), options)
}

/// Waits until every remote operation of `root`'s tree has been handed to the
/// dispatcher (their procedures wait for their outcomes).
async fn until_dispatched(executor: &Executor<Log>, root: proctor::ProcId, n: usize) {
    loop {
        let waiting = executor
            .list(
                proctor::List::new()
                    .root(root)
                    .type_name(proctor::REMOTE_CALL)
                    .state(proctor::ProcState::Waiting),
            )
            .await
            .unwrap();
        if waiting.len() == n {
            return;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[actix::test]
async fn an_abort_while_operations_are_in_flight_undoes_each_applied_one_once() {
    // Regions 1 and 2 on a, 3 on b, and 4 on c, where opening it fails. The nodes
    // take the opens and finish them only after the abort has rolled the tree back
    // as far as the operations.
    let cluster = Cluster::holding(true, false);
    cluster.failing.lock().unwrap().insert(4);
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default().max_age(Duration::from_millis(5));
    let executor = region_builder(&cluster, &log, options)
        .store(proctor::MemoryStore::new())
        .start()
        .await
        .unwrap();
    let root = executor
        .submit(Assign::new(&[("a", 1), ("a", 2), ("b", 3), ("c", 4)]))
        .await
        .unwrap();
    cluster.until(|c| c.received().len() == 4).await;
    assert!(executor.abort(root).await.unwrap(), "the abort is accepted");
    // The nodes finish their opens late: each report reaches the engine, whose
    // rollback waits for it.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(cluster.done().is_empty(), "{:?}", cluster.done());
    for report in cluster.finish_held() {
        assert!(
            executor.report(report).await.unwrap(),
            "a late report is taken"
        );
    }
    let failure = executor.wait(root).await.unwrap().unwrap_err();
    assert_eq!(failure.error, ProcError::Aborted, "{failure}");
    let ids = cluster.open_ids();
    let closes: Vec<String> = [("a", 1), ("a", 2), ("b", 3)]
        .iter()
        .map(|(t, r)| format!("close {r} on {t} ({})", ids[r].undo()))
        .collect();
    for close in &closes {
        assert_eq!(cluster.times(close), 1, "{close}: {:?}", cluster.done());
    }
    // Region 4 failed on c: nothing to undo there.
    assert_eq!(
        cluster.times(&format!("failed open 4 on c ({})", ids[&4])),
        1,
        "{:?}",
        cluster.done()
    );
    assert_eq!(cluster.done().len(), 7, "{:?}", cluster.done());
    assert!(
        !cluster
            .received()
            .iter()
            .any(|(_, _, op)| *op == RegionOp::Close(4)),
        "{:?}",
        cluster.received()
    );
    // Each undo went once, after its open's outcome, and no open went again.
    assert_eq!(cluster.received().len(), 7, "{:?}", cluster.received());
    assert_eq!(log.lines(), ["assign rollback Completed"]);
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn an_operation_still_queued_at_the_abort_is_dropped_unsent_and_not_undone() {
    // Its request would go only once it has waited 10 s for others.
    let cluster = Arc::new(Cluster::default());
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default().max_age(Duration::from_secs(10));
    let executor = region_builder(&cluster, &log, options)
        .store(proctor::MemoryStore::new())
        .start()
        .await
        .unwrap();
    let root = executor.submit(Assign::new(&[("a", 1)])).await.unwrap();
    until_dispatched(&executor, root, 1).await;
    assert!(executor.abort(root).await.unwrap());
    let ended = tokio::time::timeout(Duration::from_secs(5), executor.wait(root))
        .await
        .expect("rolled back without waiting for the request");
    assert_eq!(ended.unwrap().unwrap_err().error, ProcError::Aborted);
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(cluster.received().is_empty(), "{:?}", cluster.received());
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn a_restart_during_the_rollback_sends_the_undo_again_under_its_id_and_it_is_applied_once() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::holding(true, true);
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default().max_age(Duration::from_millis(5));
    let start = || async {
        region_builder(&cluster, &log, options)
            .store(proctor::WalStore::open(dir.path()).unwrap())
            .start()
            .await
            .unwrap()
    };
    let executor = start().await;
    let root = executor
        .submit(Assign::new(&[("a", 1), ("b", 2)]))
        .await
        .unwrap();
    cluster.until(|c| c.received().len() == 2).await;
    assert!(executor.abort(root).await.unwrap());
    for report in cluster.finish_held() {
        assert!(executor.report(report).await.unwrap());
    }
    // The rollback sends the first undo; the node takes it and the engine stops
    // before it hears back.
    cluster.until(|c| c.received().len() == 3).await;
    executor.shutdown_now().await.unwrap();
    let (_, first_undo, _) = cluster.received()[2].clone();
    assert!(first_undo.undoes().is_some(), "{:?}", cluster.received());
    // The node finishes it meanwhile; its report finds no engine.
    let _ = cluster.finish_held();
    cluster.hold_closes.store(false, SeqCst);

    let executor = start().await;
    let failure = executor.wait(root).await.unwrap().unwrap_err();
    assert_eq!(failure.error, ProcError::Aborted, "{failure}");
    let ids = cluster.open_ids();
    for (target, region) in [("a", 1), ("b", 2)] {
        let open = ids[&region];
        assert_eq!(
            cluster.times(&format!("open {region} on {target} ({open})")),
            1
        );
        assert_eq!(
            cluster.times(&format!("close {region} on {target} ({})", open.undo())),
            1,
            "{:?}",
            cluster.done()
        );
    }
    let received = cluster.received();
    let sends = |id: OpId| received.iter().filter(|(_, i, _)| *i == id).count();
    assert_eq!(sends(first_undo), 2, "sent again, same id: {received:?}");
    assert!(
        ids.values().all(|open| sends(*open) == 1),
        "no open sent again: {received:?}"
    );
    executor.shutdown().await.unwrap();
}

#[actix::test]
async fn a_crash_at_every_write_of_a_tree_that_times_out_undoes_each_applied_operation_once() {
    // The nodes open the regions and never report: the tree times out while they are
    // in flight, and its rollback waits for each operation's deadline, then closes
    // the region (the outcome is unknown). Whatever write the crash hits, each region
    // a node opened is closed once.
    let cluster = Arc::new(Cluster {
        silent_opens: true,
        ..Cluster::default()
    });
    let log = Arc::new(Log::default());
    let options = RemoteOptions::default()
        .max_age(Duration::from_millis(1))
        .deadline(Duration::from_millis(150));
    let mut undone = 0;
    let runs = proctor::testing::restart_at_every_write(
        || region_builder(&cluster, &log, options),
        || Assign {
            timeout_ms: Some(40),
            ..Assign::new(&[("a", 1), ("b", 2)])
        },
        |run| {
            let done = std::mem::take(&mut *cluster.done.lock().unwrap());
            cluster.received.lock().unwrap().clear();
            cluster.finished.lock().unwrap().clear();
            log.0.lock().unwrap().clear();
            let Some(result) = &run.result else { return };
            let failure = result.as_ref().unwrap_err();
            assert!(
                failure.to_string().contains("timed out"),
                "{run:?}: {failure}"
            );
            for (target, region) in [("a", 1), ("b", 2)] {
                let opened = format!("open {region} on {target}");
                let closed = format!("close {region} on {target}");
                let opens = done.iter().filter(|l| l.starts_with(&opened)).count();
                let closes = done.iter().filter(|l| l.starts_with(&closed)).count();
                assert!(opens <= 1 && closes <= 1, "{run:?}: {done:?}");
                if opens == 1 {
                    assert_eq!(closes, 1, "{run:?}: opened, never closed: {done:?}");
                    undone += 1;
                }
            }
        },
    )
    .await
    .unwrap();
    assert!(runs.len() >= 10, "{}", runs.len());
    assert!(undone > 0, "some run opened regions and closed them");
}
