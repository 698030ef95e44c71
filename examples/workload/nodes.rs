//! The workload's remote targets (`--remote T`): in-process nodes behind the engine's
//! `Transport`. A request is taken at once; each operation is applied after a random
//! latency and reported through `Executor::report`. A share of requests fails (the
//! dispatcher retries them) and a share of operations fails on the node (the step
//! sends them again, under a new op id). A node applies an operation once: it
//! deduplicates by op id, with the ledger (`= OP ROOT STEP` lines) as its durable
//! memory, so a SIGKILLed run resumed later still never applies an op twice; a repeat
//! is reported ok again, neither applied nor failed.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use proctor::{async_trait, Executor, OpId, Report, Transport, TransportError};

use crate::work::{Env, RemoteOp};

/// What the nodes did in this run.
#[derive(Default)]
pub struct NodeStats {
    pub requests: AtomicU64,
    pub failed_requests: AtomicU64,
    pub applied: AtomicU64,
    pub repeats: AtomicU64,
    pub failed_ops: AtomicU64,
}

pub struct Nodes {
    env: Arc<Env>,
    /// Ops applied, as the ledger says (loaded at start) and this run added.
    applied: Mutex<HashSet<u64>>,
    latency_ms: u64,
    fail_rate: f64,
    rng: Mutex<fastrand::Rng>,
    /// Where reports go, once the executor has started.
    pub executor: OnceLock<Executor<Env>>,
    pub stats: NodeStats,
}

impl Nodes {
    pub fn new(
        env: Arc<Env>,
        latency_ms: u64,
        fail_rate: f64,
        seed: u64,
    ) -> std::io::Result<Arc<Nodes>> {
        let applied = match &env.ledger {
            Some(ledger) => ledger.applied_ops()?.into_keys().collect(),
            None => HashSet::new(),
        };
        Ok(Arc::new(Nodes {
            env,
            applied: Mutex::new(applied),
            latency_ms,
            fail_rate,
            rng: Mutex::new(fastrand::Rng::with_seed(seed)),
            executor: OnceLock::new(),
            stats: NodeStats::default(),
        }))
    }

    fn chance(&self, p: f64) -> bool {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).f64() < p
    }

    fn latency(&self) -> Duration {
        let ms = self
            .rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .u64(0..=self.latency_ms);
        Duration::from_millis(ms)
    }

    /// Applies `op` (once) and reports it, or reports that it failed. A repeat of an
    /// op already applied (in this run, or in an earlier one as the ledger says) is
    /// reported ok again, before any failure is drawn: a failure reported for an op
    /// that was applied would have its step send it again, under a new op id.
    async fn run(self: Arc<Self>, id: OpId, op: RemoteOp) {
        tokio::time::sleep(self.latency()).await;
        let fresh = {
            let mut applied = self.applied.lock().unwrap_or_else(|e| e.into_inner());
            if applied.contains(&id.0) {
                Some(false)
            } else if self.chance(self.fail_rate / 2.0) {
                None
            } else {
                Some(applied.insert(id.0))
            }
        };
        let report = match fresh {
            None => {
                self.stats.failed_ops.fetch_add(1, Ordering::Relaxed);
                Report::failed(id, "the node could not apply it")
            }
            Some(fresh) => {
                if fresh {
                    if let Some(ledger) = &self.env.ledger {
                        if let Err(e) = ledger.applied(id.0, op.root, op.step) {
                            eprintln!("node: ledger: {e}");
                            return;
                        }
                    }
                    self.stats.applied.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.stats.repeats.fetch_add(1, Ordering::Relaxed);
                }
                match Report::ok(id, &op.step) {
                    Ok(report) => report,
                    Err(_) => return,
                }
            }
        };
        if let Some(executor) = self.executor.get() {
            let _ = executor.report(report).await;
        }
    }
}

/// The engine's side: hands each request to the nodes.
pub struct ToNodes(pub Arc<Nodes>);

#[async_trait]
impl Transport for ToNodes {
    type Op = RemoteOp;

    async fn send(
        &self,
        target: &str,
        ops: Vec<(OpId, RemoteOp)>,
    ) -> Result<Vec<Report>, TransportError> {
        let nodes = &self.0;
        nodes.stats.requests.fetch_add(1, Ordering::Relaxed);
        if nodes.chance(nodes.fail_rate / 2.0) {
            nodes.stats.failed_requests.fetch_add(1, Ordering::Relaxed);
            return Err(TransportError(format!("{target}: connection reset")));
        }
        for (id, op) in ops {
            tokio::spawn(nodes.clone().run(id, op));
        }
        Ok(Vec::new())
    }
}
