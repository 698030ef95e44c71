//! Remote operations over real sockets: a coordinator and five "data nodes" on
//! loopback TCP, and a create-table procedure that opens its regions on the nodes
//! through the engine's remote dispatcher, each open dispatched with its undo (closing
//! the region). Run it with
//!
//! ```sh
//! cargo run --release --example remote_nodes
//! ```
//!
//! Each node listens on a port of its own and takes one request per connection: a JSON
//! line of `[op id, {"Open": region} | {"Close": region}]` pairs, answered at once with
//! `ok`. It does the work in the background and reports each op to the coordinator's
//! report port (a JSON line `{"op", "node"}`), which hands it to `Executor::report`. A
//! node deduplicates by op id, as a real one must: an op it already did is reported
//! again, not done twice.
//!
//! Table `users`: node `dn-3` is slow and is killed while it still holds regions; the
//! coordinator's failure detector (here: `main`, once it sees the node's port closed)
//! calls `Executor::remove_target`, and the procedure's next step moves those regions
//! to the nodes still alive.
//!
//! Table `orders`: its regions go to `dn-4` and `dn-5`, which take a while to open
//! them, and the table is aborted while the opens are in flight. The tree rolls back
//! as far as the opens and waits: the nodes finish them late, their reports reach the
//! rollback, and each region opened is closed on its node (the open's undo, sent under
//! an op id of its own, `OpId::undo`). An open still queued in the coordinator would be
//! dropped unsent; one that failed on its node would not be closed.
//!
//! The last line is the outcome: `{"table": "users", "state": "SUCCESS", "regions":
//! {region: node, ...}, "failed_over": N, "aborted": {"table": "orders", "state":
//! "ROLLEDBACK", "opened": N, "closed": N, "open_now": [...]}}`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proctor::{
    async_trait, Context, Executor, Flow, MemoryStore, OpId, ProcError, ProcId, Procedure,
    Registry, RemoteError, RemoteOptions, Report, Transport, TransportError,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What a node is asked to do with a region.
#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum RegionOp {
    Open(u32),
    /// An open's undo.
    Close(u32),
}

/// What the coordinator knows of its nodes: where each listens.
struct Nodes {
    addrs: HashMap<String, SocketAddr>,
}

/// The coordinator's side of the wire: one TCP request per batch.
struct Tcp(Arc<Nodes>);

#[async_trait]
impl Transport for Tcp {
    type Op = RegionOp;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, RegionOp)>,
    ) -> Result<Vec<Report>, TransportError> {
        let addr = self
            .0
            .addrs
            .get(target)
            .ok_or_else(|| TransportError(format!("no node {target}")))?;
        let fail = |e: std::io::Error| TransportError(format!("{target} ({addr}): {e}"));
        let mut stream = TcpStream::connect(addr).await.map_err(fail)?;
        let request: Vec<(u64, RegionOp)> = ops.iter().map(|(id, op)| (id.0, *op)).collect();
        let mut line = serde_json::to_string(&request).expect("json");
        line.push('\n');
        stream.write_all(line.as_bytes()).await.map_err(fail)?;
        let mut answer = String::new();
        BufReader::new(stream)
            .read_line(&mut answer)
            .await
            .map_err(fail)?;
        if answer.trim() != "ok" {
            return Err(TransportError(format!("{target} answered {answer:?}")));
        }
        // The node reports each region later, on the report port.
        Ok(Vec::new())
    }
}

/// What a node did: the regions open on it, and how many it opened and closed.
#[derive(Default)]
struct NodeState {
    /// The op ids it took (it does each once).
    ops: HashSet<u64>,
    open: BTreeSet<u32>,
    opened: usize,
    closed: usize,
}

/// One data node: listens on `listener`, does each op after `delay`, reports to
/// `coordinator`; counts the operations it was sent in `received`.
async fn data_node(
    name: String,
    listener: TcpListener,
    delay: Duration,
    coordinator: SocketAddr,
    received: Arc<watch::Sender<usize>>,
    state: Arc<Mutex<NodeState>>,
) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let (name, state, received) = (name.clone(), state.clone(), received.clone());
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            if BufReader::new(read).read_line(&mut line).await.is_err() {
                return;
            }
            let Ok(ops) = serde_json::from_str::<Vec<(u64, RegionOp)>>(&line) else {
                return;
            };
            let _ = write.write_all(b"ok\n").await;
            received.send_modify(|n| *n += ops.len());
            for (op, what) in ops {
                let (name, state) = (name.clone(), state.clone());
                tokio::spawn(async move {
                    // A repeat of an op it has is reported again, not done twice.
                    if state.lock().unwrap().ops.insert(op) {
                        tokio::time::sleep(delay).await;
                        let mut state = state.lock().unwrap();
                        match what {
                            RegionOp::Open(region) => {
                                state.open.insert(region);
                                state.opened += 1;
                            }
                            RegionOp::Close(region) => {
                                state.open.remove(&region);
                                state.closed += 1;
                            }
                        }
                        println!("{name}: {what:?} done ({})", OpId(op));
                    }
                    let report = serde_json::json!({"op": op, "node": name});
                    if let Ok(mut stream) = TcpStream::connect(coordinator).await {
                        let _ = stream.write_all(format!("{report}\n").as_bytes()).await;
                    }
                });
            }
        });
    }
}

/// The coordinator's report port: each line a node's report, handed to the executor.
async fn report_port(listener: TcpListener, executor: Executor) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        let executor = executor.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stream).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(report) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                let op = OpId(report["op"].as_u64().unwrap_or_default());
                let node = report["node"].as_str().unwrap_or_default().to_string();
                if let Ok(report) = Report::ok(op, &node) {
                    let _ = executor.report(report).await;
                }
            }
        });
    }
}

/// Creates a table: opens each region on its node (undone by closing it, should the
/// table be rolled back while the open may be applied), and moves the regions of a node
/// that is declared gone to the nodes still alive.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    table: String,
    /// Region -> the node it is being opened on.
    assignment: BTreeMap<u32, String>,
    nodes: Vec<String>,
    /// Regions waiting for their outcome, in the order they were dispatched.
    waiting: Vec<u32>,
}

#[async_trait]
impl Procedure for CreateTable {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        if self.waiting.is_empty() {
            // The first step: every region to its node.
            for (region, node) in &self.assignment {
                ctx.dispatch::<Tcp>(node.clone(), &RegionOp::Open(*region))?
                    .undo(&RegionOp::Close(*region))?;
                self.waiting.push(*region);
            }
            println!("{}: opening {} regions", self.table, self.waiting.len());
            return Ok(ctx.await_remote());
        }
        // The outcomes of the last dispatch: the last `waiting.len()` of them.
        let results = ctx.remote_results();
        let latest = &results[results.len() - self.waiting.len()..];
        let mut moved = Vec::new();
        for (result, region) in latest.iter().zip(std::mem::take(&mut self.waiting)) {
            match &result.outcome {
                Ok(_) => {
                    let node: String = result.value()?;
                    println!(
                        "{}: region {region} open on {node} ({})",
                        self.table, result.op
                    );
                }
                // The node was declared dead: the region goes to a live one.
                Err(RemoteError::TargetGone { target }) => {
                    self.nodes.retain(|n| n != target);
                    let Some(node) = self.nodes.get(region as usize % self.nodes.len().max(1))
                    else {
                        return Err(ProcError::failed("no node left"));
                    };
                    println!(
                        "{}: {target} is gone; region {region} moves to {node}",
                        self.table
                    );
                    self.assignment.insert(region, node.clone());
                    moved.push(region);
                }
                Err(e) => return Err(ProcError::failed(format!("region {region}: {e}"))),
            }
        }
        if moved.is_empty() {
            ctx.set_result(&self.assignment)?;
            return Ok(Flow::Done);
        }
        for region in &moved {
            ctx.dispatch::<Tcp>(self.assignment[region].clone(), &RegionOp::Open(*region))?
                .undo(&RegionOp::Close(*region))?;
        }
        self.waiting = moved;
        Ok(ctx.await_remote())
    }

    /// The regions whose opens were in flight are closed by the opens' own rollbacks,
    /// which run first (they are this step's children); the table has nothing else.
    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        println!("{}: rolled back", self.table);
        Ok(())
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let outcome = run().await?;
    println!("{outcome}");
    Ok(())
}

/// The whole flow; its outcome as the last line says.
async fn run() -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let reports = TcpListener::bind("127.0.0.1:0").await?;
    let coordinator = reports.local_addr()?;
    let mut addrs = HashMap::new();
    let mut nodes = HashMap::new();
    let mut received = HashMap::new();
    let mut states: HashMap<&str, Arc<Mutex<NodeState>>> = HashMap::new();
    let slow = [("dn-4", 300), ("dn-5", 300)];
    for (name, delay_ms) in [("dn-1", 20), ("dn-2", 20), ("dn-3", 60_000)]
        .into_iter()
        .chain(slow)
    {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        addrs.insert(name.to_string(), listener.local_addr()?);
        let (count, seen) = watch::channel(0);
        received.insert(name, seen);
        let state = Arc::new(Mutex::new(NodeState::default()));
        states.insert(name, state.clone());
        let node = data_node(
            name.to_string(),
            listener,
            Duration::from_millis(delay_ms),
            coordinator,
            Arc::new(count),
            state,
        );
        nodes.insert(name, tokio::spawn(node));
    }
    let known = Arc::new(Nodes { addrs });

    let mut registry = Registry::new();
    registry.register::<CreateTable>("create_table");
    let executor = Executor::builder()
        .registry(registry)
        .store(MemoryStore::new())
        .remote(
            Tcp(known.clone()),
            RemoteOptions::default().max_age(Duration::from_millis(20)),
        )
        .start()
        .await?;
    tokio::spawn(report_port(reports, executor.clone()));

    let names: Vec<String> = ["dn-1", "dn-2", "dn-3"].map(String::from).to_vec();
    let assignment = (0..6u32)
        .map(|r| (r, names[r as usize % 3].clone()))
        .collect();
    let id = executor
        .submit(CreateTable {
            table: "users".into(),
            assignment,
            nodes: names,
            waiting: Vec::new(),
        })
        .await?;

    // dn-3 dies while it holds regions (once it was sent its two, regions 2 and 5):
    // once its port is closed, the failure detector declares it gone.
    let dn3 = known.addrs["dn-3"];
    let mut dn3_received = received["dn-3"].clone();
    dn3_received.wait_for(|n| *n >= 2).await?;
    nodes["dn-3"].abort();
    while TcpStream::connect(dn3).await.is_ok() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let failed = executor.remove_target("dn-3").await?;
    println!("dn-3 declared dead: {failed} operations failed over");

    let regions: BTreeMap<u32, String> = executor.wait_value(id).await?;
    let state = executor.state(id).await?.state;

    // The orders table is aborted while its nodes are still opening its regions.
    let slow: Vec<String> = ["dn-4", "dn-5"].map(String::from).to_vec();
    let assignment = (10..14u32)
        .map(|r| (r, slow[r as usize % 2].clone()))
        .collect();
    let orders = executor
        .submit(CreateTable {
            table: "orders".into(),
            assignment,
            nodes: slow,
            waiting: Vec::new(),
        })
        .await?;
    for node in ["dn-4", "dn-5"] {
        received[node].clone().wait_for(|n| *n >= 2).await?;
    }
    executor.abort(orders).await?;
    println!("orders: aborted while dn-4 and dn-5 open its regions");
    let aborted = aborted_outcome(&executor, orders, &states).await?;

    let outcome = serde_json::json!({
        "table": "users",
        "state": state.to_string(),
        "regions": regions,
        "failed_over": failed,
        "aborted": aborted,
    });
    executor.shutdown().await?;
    Ok(outcome)
}

/// How the aborted table ended, and what its nodes did: regions opened, closed, and
/// open now.
async fn aborted_outcome(
    executor: &Executor,
    orders: ProcId,
    states: &HashMap<&str, Arc<Mutex<NodeState>>>,
) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let ended = executor.wait(orders).await?;
    let state = executor.state(orders).await?.state;
    let (mut opened, mut closed, mut open_now) = (0, 0, Vec::new());
    for node in ["dn-4", "dn-5"] {
        let node = states[node].lock().unwrap();
        opened += node.opened;
        closed += node.closed;
        open_now.extend(node.open.iter().copied());
    }
    println!(
        "orders: {state} ({}): {opened} regions opened, {closed} closed",
        ended
            .err()
            .map_or("no error".to_string(), |f| f.error.to_string())
    );
    Ok(serde_json::json!({
        "table": "orders",
        "state": state.to_string(),
        "opened": opened,
        "closed": closed,
        "open_now": open_now,
    }))
}

#[cfg(test)]
mod tests {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_table_is_created_the_dead_nodes_regions_move_and_the_aborted_tables_opens_are_undone(
    ) {
        let outcome = super::run().await.expect("runs");
        assert_eq!(outcome["state"], "SUCCESS", "{outcome}");
        let regions = outcome["regions"].as_object().expect("regions");
        assert_eq!(regions.len(), 6, "{outcome}");
        assert!(regions.values().all(|n| n != "dn-3"), "{outcome}");
        assert_eq!(
            outcome["failed_over"], 2,
            "dn-3 held two regions: {outcome}"
        );
        // The aborted table's four regions were opened late, and each was closed.
        let aborted = &outcome["aborted"];
        assert_eq!(aborted["state"], "ROLLEDBACK", "{outcome}");
        assert_eq!(aborted["opened"], 4, "{outcome}");
        assert_eq!(aborted["closed"], 4, "{outcome}");
        assert_eq!(aborted["open_now"], serde_json::json!([]), "{outcome}");
    }
}
