//! Two members of a cluster of executors in one process, from a plain `#[tokio::main]`
//! (each member runs its own actix system on a thread of its own). In a service each
//! member is a process of its own, on its own machine; the code is the same.
//!
//! ```sh
//! cargo run --release --example cluster -- "host=127.0.0.1 user=postgres dbname=postgres"
//! ```
//!
//! It shows, in order:
//!
//! 1. two members joining a cluster of 8 partitions (the first creates it, in the
//!    schema `proctor_cluster_example`, emptied first); the coordinator hands partitions
//!    to the second until each owns four;
//! 2. `CreateTable` roots submitted to member `a`: one that names a table goes to that
//!    table's partition (its `affinity`, by default the resource it locks), wherever
//!    it is owned, so procedures on one table exclude each other under one lock table;
//! 3. their results waited for through member `b`, whichever member ran them;
//! 4. `a` leaving: its partitions move to `b`, which runs what was left.

use std::time::{Duration, Instant};

use proctor::{
    async_trait, Cluster, Context, Executor, Flow, Lock, PgOptions, ProcError, Procedure, Registry,
};
use serde::{Deserialize, Serialize};

/// Creates a table in two steps, holding the table's lock.
#[derive(Serialize, Deserialize)]
struct CreateTable {
    table: String,
    step: u32,
}

#[async_trait]
impl Procedure for CreateTable {
    async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
        // Partition and fencing token: what a resource this step changes would check.
        let (partition, token) = (ctx.partition(), ctx.fencing_token());
        tracing::debug!(table = %self.table, step = self.step, ?partition, ?token, "step");
        tokio::time::sleep(Duration::from_millis(20)).await;
        self.step += 1;
        Ok(if self.step < 2 {
            Flow::MoreToDo
        } else {
            Flow::Done
        })
    }

    async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
        Ok(())
    }

    fn locks(&self) -> Vec<Lock> {
        vec![Lock::exclusive(format!("table/{}", self.table))]
    }
}

fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.register::<CreateTable>("create_table");
    registry
}

async fn member(url: &str, name: &str) -> Result<Cluster, proctor::Error> {
    Cluster::builder(url, name)
        .options(PgOptions::default().schema(SCHEMA))
        .partitions(8)
        .period(Duration::from_secs(2))
        // Each partition a member owns runs in an engine made here.
        .engines(|| {
            Executor::builder()
                .registry(registry())
                .arbiters(1)
                .workers(8)
        })
        .start()
        .await
}

const SCHEMA: &str = "proctor_cluster_example";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: cluster POSTGRES_URL (a database this example may make a schema in)");
        return Ok(());
    };
    // A fresh cluster each run (the synchronous client, off the runtime's threads).
    let reset = url.clone();
    tokio::task::spawn_blocking(move || drop_schema(&reset)).await??;

    let a = member(&url, "a").await?;
    let b = member(&url, "b").await?;
    let started = Instant::now();
    while a.owned().len() != 4 || b.owned().len() != 4 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "a owns {:?} and b owns {:?} after {:?}",
        a.owned(),
        b.owned(),
        started.elapsed()
    );

    let mut ids = Vec::new();
    for i in 0..16 {
        let table = format!("t{}", i % 8);
        let id = a
            .submit(CreateTable {
                table: table.clone(),
                step: 0,
            })
            .await?;
        ids.push((id, table));
    }
    for (id, table) in &ids {
        let partition = b.partition_of(*id);
        let ran_in = if a.owned().contains(&partition) {
            "a"
        } else {
            "b"
        };
        b.wait(*id).await?.map_err(|f| f.to_string())?;
        println!("{id} (table {table}, partition {partition}, run by {ran_in}): SUCCESS");
    }

    // Leaving hands a's partitions to b; a root submitted to b now runs there.
    a.leave().await?;
    let id = b
        .submit(CreateTable {
            table: "t9".into(),
            step: 0,
        })
        .await?;
    b.wait(id).await?.map_err(|f| f.to_string())?;
    let state = b.state().await?;
    println!(
        "after a left: b owns {} partitions; {} moves between members; {id}: SUCCESS",
        b.owned().len(),
        state.moves
    );
    b.leave().await?;
    Ok(())
}

/// Drops the example's schema, left by an earlier run.
fn drop_schema(url: &str) -> Result<(), postgres::Error> {
    let mut sql = postgres::Client::connect(url, postgres::NoTls)?;
    sql.batch_execute(&format!("DROP SCHEMA IF EXISTS {SCHEMA} CASCADE"))
}
