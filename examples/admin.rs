//! The operator's web page on a running engine. Run it with
//!
//! ```sh
//! cargo run --release --example admin -- --token s3cret
//! ```
//!
//! and open <http://127.0.0.1:9092/procedures>. The engine keeps a small workload going:
//! deployments of a few steps with a child each, some failing and rolling back, and
//! some waiting for an operator's approval (the event `approve`, never woken here) —
//! abort one of those from the page with the token, and watch its tree roll back.
//! `--addr` moves the page, `--secs N` stops after N seconds (default: run until
//! killed). Without `--token` the page is read-only.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use clap::Parser;
use proctor::admin::AdminConfig;
use proctor::{async_trait, Context, Executor, Flow, MemoryStore, ProcError, Procedure, Registry};
use serde::{Deserialize, Serialize};

#[derive(Parser, Debug)]
struct Args {
    /// Where the page listens.
    #[arg(long, default_value = "127.0.0.1:9092")]
    addr: SocketAddr,
    /// The bearer token actions need (none: read-only).
    #[arg(long)]
    token: Option<String>,
    /// Stop after this many seconds.
    #[arg(long)]
    secs: Option<u64>,
}

/// A deployment: `steps` steps of `step_ms` each, a child that verifies it, and — for
/// some — a wait for an operator's approval, or a failure at the end.
#[derive(Serialize, Deserialize)]
pub struct Deploy {
    pub step: u32,
    pub steps: u32,
    pub step_ms: u64,
    pub needs_approval: bool,
    pub fails: bool,
}

#[derive(Serialize, Deserialize)]
pub struct Verify;

#[async_trait]
impl Procedure for Deploy {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        tokio::time::sleep(Duration::from_millis(self.step_ms)).await;
        self.step += 1;
        if self.step == 1 {
            return Ok(Flow::Children(vec![Box::new(Verify)]));
        }
        if self.step == 2 && self.needs_approval {
            return Ok(Flow::Suspend("approve".into()));
        }
        if self.step >= self.steps {
            if self.fails {
                return Err(ProcError::failed("the canary's error rate is too high"));
            }
            return Ok(Flow::Done);
        }
        Ok(Flow::MoreToDo)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }

    fn state_name(&self) -> Option<String> {
        Some(format!("step {} of {}", self.step, self.steps))
    }
}

#[async_trait]
impl Procedure for Verify {
    async fn execute(&mut self, _ctx: &mut Context) -> Result<Flow, ProcError> {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }
}

/// The engine with its registry.
pub async fn engine() -> Result<Executor, proctor::Error> {
    let mut registry = Registry::new();
    registry
        .register::<Deploy>("deploy")
        .register::<Verify>("verify");
    Executor::builder()
        .registry(registry)
        .store(MemoryStore::new())
        .start()
        .await
}

/// Submits deployments for ever, one every `every`: every fifth waits for approval,
/// every seventh fails.
pub async fn keep_deploying(executor: Executor, every: Duration) {
    let n = AtomicU64::new(0);
    loop {
        let i = n.fetch_add(1, Ordering::Relaxed);
        let deploy = Deploy {
            step: 0,
            steps: 4,
            step_ms: 50,
            needs_approval: i.is_multiple_of(5),
            fails: i % 7 == 3,
        };
        if executor.submit(deploy).await.is_err() {
            return;
        }
        tokio::time::sleep(every).await;
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let executor = engine().await?;
    let mut config = AdminConfig::default();
    if let Some(token) = &args.token {
        config = config.token(token.clone());
    }
    let listener = tokio::net::TcpListener::bind(args.addr).await?;
    println!(
        "the admin page: http://{}/procedures ({})",
        listener.local_addr()?,
        if args.token.is_some() {
            "actions with the token"
        } else {
            "read-only"
        }
    );
    tokio::spawn(config.serve_on(listener, executor.clone()));
    let load = tokio::spawn(keep_deploying(executor.clone(), Duration::from_millis(200)));
    match args.secs {
        Some(secs) => tokio::time::sleep(Duration::from_secs(secs)).await,
        None => std::future::pending().await,
    }
    load.abort();
    let procedures = executor
        .list(proctor::List::new().with_finished())
        .await?
        .len();
    executor.shutdown().await?;
    println!("{}", serde_json::json!({ "procedures": procedures }));
    Ok(())
}
