//! A cluster of three member processes on a private PostgreSQL, through faults: the
//! test binary runs itself again as each member (the workload's trees: a child, failures
//! injected, exclusive locks on a few resources, every effect in one ledger file that
//! refuses a token older than the newest it took in the same partition). Each round,
//! every member submits a batch through itself, and then one fault strikes:
//!
//! - **kill**: a member is SIGKILLed; its partitions must be owned by the others within
//!   two membership periods, and it is started again;
//! - **stop**: a member is SIGSTOPped past its membership and continued; meanwhile its
//!   partitions move, and once continued it must act on nothing (its late effects are
//!   refused by the ledger, its writes by the store) and join again;
//! - **restart**: the database restarts under every member.
//!
//! After each round, once every root of the store has finished, the ledger and the store
//! must agree across the processes: every root SUCCESS or ROLLEDBACK as planned, every
//! acknowledged root in the store, effects all or none per root, tokens in order per
//! partition, no two trees inside one resource at once. Ten rounds of each fault
//! (`PROCTOR_CLUSTER_ROUNDS` rounds in all, 30 by default).

mod common;

#[path = "../examples/workload/dag.rs"]
#[allow(dead_code)]
mod dag;
#[path = "../examples/workload/ledger.rs"]
#[allow(dead_code)]
mod ledger;
#[path = "../examples/workload/nodes.rs"]
#[allow(dead_code)]
mod nodes;
#[path = "../examples/workload/work.rs"]
#[allow(dead_code)]
mod work;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ledger::Ledger;
use proctor::{Cluster, Executor, PgOptions, PgStore, StateMachine};
use work::{Env, Work};

const URL_VAR: &str = "PROCTOR_CLUSTER_URL";
const SCHEMA_VAR: &str = "PROCTOR_CLUSTER_SCHEMA";
const LEDGER_VAR: &str = "PROCTOR_CLUSTER_LEDGER";
const NAME_VAR: &str = "PROCTOR_CLUSTER_NAME";
const PERIOD: Duration = Duration::from_millis(1000);
const PARTITIONS: u32 = 8;
const MEMBERS: usize = 3;
const BATCH: u64 = 30;
const LOCKS: u32 = 6;
/// How long each call awaits before it changes the ledger.
const THINK: Duration = Duration::from_millis(25);

/// The child: one member, driven through its stdin (`go SEED`: submit a batch through
/// itself and print `done SEED` once each root of it has finished; `leave`).
#[test]
fn cluster_member_child() {
    let (Ok(url), Ok(schema), Ok(ledger), Ok(name)) = (
        std::env::var(URL_VAR),
        std::env::var(SCHEMA_VAR),
        std::env::var(LEDGER_VAR),
        std::env::var(NAME_VAR),
    ) else {
        return;
    };
    actix::System::new().block_on(async move {
        // Calls await a moment before they change the ledger, as calls that wait on
        // the network do: a fault finds trees in flight, and calls parked there.
        let env = Arc::new(Env {
            think: Some(THINK),
            ..Env::new(Some(Ledger::open(Path::new(&ledger)).expect("ledger")))
        });
        let engine_env = env.clone();
        let cluster = Cluster::builder(url, name.clone())
            .options(PgOptions::default().schema(&schema))
            .partitions(PARTITIONS)
            .period(PERIOD)
            .engines(move || {
                Executor::builder()
                    .registry(work::registry())
                    .env(engine_env.clone())
                    .workers(16)
                    .arbiters(1)
            })
            .start()
            .await
            .expect("joins");
        println!("ready");
        let (lines_tx, mut lines) = tokio::sync::mpsc::unbounded_channel();
        std::thread::spawn(move || {
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        while let Some(line) = lines.recv().await {
            if line == "leave" {
                break;
            }
            let Some(seed) = line.strip_prefix("go ").and_then(|s| s.parse::<u64>().ok()) else {
                continue;
            };
            let cluster = cluster.clone();
            let env = env.clone();
            actix::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(seed);
                let mut waits = Vec::new();
                for _ in 0..BATCH {
                    let fail = (rng.f64() < 0.2).then(|| (rng.u16(0..=1), rng.u16(0..3)));
                    // Half lock a resource (and run in its partition, one tree at a
                    // time); half run free in this member's partitions.
                    let lock = rng.bool().then(|| rng.u32(0..LOCKS));
                    let root = StateMachine::new(Work::root(3, 1, fail, lock));
                    let cluster = cluster.clone();
                    let env = env.clone();
                    waits.push(actix::spawn(async move {
                        // A refusal (the member is between memberships) is no ack.
                        let Ok(id) = cluster.submit(root).await else {
                            return;
                        };
                        let _ = env.ledger.as_ref().unwrap().acknowledged(id.0);
                        let _ = cluster.wait(id).await;
                    }));
                }
                for wait in waits {
                    let _ = wait.await;
                }
                println!("done {seed}");
            });
        }
        let _ = cluster.leave().await;
    });
}

/// A member process, with its stdin to drive it and its lines of stdout.
struct Member {
    name: String,
    child: Child,
    stdin: ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Member {
    fn spawn(url: &str, schema: &str, ledger: &Path, name: &str) -> Member {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "cluster_member_child",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(URL_VAR, url)
            .env(SCHEMA_VAR, schema)
            .env(LEDGER_VAR, ledger)
            .env(NAME_VAR, name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a member");
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let member = Member {
            name: name.to_string(),
            child,
            stdin,
            lines,
        };
        member.expect_line("ready", Duration::from_secs(30));
        member
    }

    fn send(&mut self, line: &str) {
        let _ = writeln!(self.stdin, "{line}");
        let _ = self.stdin.flush();
    }

    /// Waits for a line that ends with `what`.
    fn expect_line(&self, what: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.ends_with(what) => return,
                Ok(_) => {}
                Err(_) => panic!("member {}: no {what:?} within {within:?}", self.name),
            }
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {signal} {}", self.name);
    }
}

/// How long until no partition is owned by `name` and each is owned by a live member.
fn until_moved_off(url: &str, options: &PgOptions, name: &str, since: Instant) -> Duration {
    loop {
        let state = PgStore::inspect_cluster(url, options)
            .expect("inspect")
            .expect("a cluster");
        let live: Vec<&str> = state
            .members
            .iter()
            .filter(|m| m.remaining.is_some())
            .map(|m| m.name.as_str())
            .collect();
        let moved = state.partitions.iter().all(|p| {
            p.owner
                .as_deref()
                .is_some_and(|owner| owner != name && live.contains(&owner))
        });
        if moved {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "{name}'s partitions did not move: {:?}",
            state.partitions
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until every root in the store has finished and no forwarded submit waits.
fn until_quiet(url: &str, schema: &str) {
    let mut sql = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut quiet = 0;
    while quiet < 2 {
        let counts = sql.query_one(
            &format!(
                "SELECT (SELECT count(*) FROM {schema}.proctor_procs
                         WHERE parent IS NULL AND state NOT IN ('SUCCESS', 'ROLLEDBACK')),
                        (SELECT count(*) FROM {schema}.proctor_inbox
                         WHERE id IS NULL AND error IS NULL)"
            ),
            &[],
        );
        let (roots, inbox): (i64, i64) = match counts {
            Ok(row) => (row.get(0), row.get(1)),
            // The database restarting: ask again.
            Err(_) => {
                sql = postgres::Client::connect(url, postgres::NoTls).expect("connect");
                (1, 0)
            }
        };
        quiet = if roots == 0 && inbox == 0 {
            quiet + 1
        } else {
            0
        };
        assert!(
            Instant::now() < deadline,
            "{roots} roots unfinished and {inbox} forwarded submits waiting after 120 s"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn three_members_ride_out_kills_stops_and_database_restarts() {
    if std::env::var_os(URL_VAR).is_some() {
        return;
    }
    let rounds: usize = std::env::var("PROCTOR_CLUSTER_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(30);
    let server = common::pg::server();
    let url = server.url();
    let schema = common::pg::fresh_schema();
    let options = PgOptions::default().schema(&schema);
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("ledger");
    let mut members: Vec<Member> = (0..MEMBERS)
        .map(|i| Member::spawn(&url, &schema, &ledger, &format!("m{i}")))
        .collect();
    let mut rng = fastrand::Rng::with_seed(
        std::env::var("PROCTOR_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(7),
    );
    let mut moves = Vec::new();
    let mut late_changes = 0;
    for round in 0..rounds {
        let seed = round as u64 + 1;
        for member in &mut members {
            member.send(&format!("go {seed}"));
        }
        std::thread::sleep(Duration::from_millis(rng.u64(20..200)));
        let victim = rng.usize(0..MEMBERS);
        let fault = ["kill", "stop", "restart"][round % 3];
        let mut waiting: Vec<usize> = (0..MEMBERS).collect();
        match fault {
            "kill" => {
                let name = members[victim].name.clone();
                members[victim].signal("-KILL");
                let killed = Instant::now();
                let _ = members[victim].child.wait();
                let took = until_moved_off(&url, &options, &name, killed);
                moves.push(took);
                assert!(
                    took <= 2 * PERIOD,
                    "round {round}: {name}'s partitions moved after {took:?}"
                );
                members[victim] = Member::spawn(&url, &schema, &ledger, &name);
                waiting.retain(|&i| i != victim);
            }
            "stop" => {
                let name = members[victim].name.clone();
                let refused = Ledger::open(&ledger).unwrap().refusals().unwrap();
                let engines = PgStore::inspect_cluster(&url, &options)
                    .expect("inspect")
                    .expect("a cluster")
                    .partitions
                    .iter()
                    .filter(|p| p.owner.as_deref() == Some(name.as_str()))
                    .count();
                members[victim].signal("-STOP");
                let stopped = Instant::now();
                let took = until_moved_off(&url, &options, &name, stopped);
                moves.push(took);
                assert!(
                    took <= 2 * PERIOD,
                    "round {round}: {name}'s partitions moved after {took:?}"
                );
                std::thread::sleep(PERIOD / 2);
                members[victim].signal("-CONT");
                // Continued past its membership, the member starts no call: what it
                // may still change is what a call between two awaits at the stop
                // does, one per thread that runs procedures (an arbiter per engine;
                // the member may have claimed one more partition after the count).
                std::thread::sleep(PERIOD / 2);
                let late = Ledger::open(&ledger).unwrap().refusals().unwrap() - refused;
                late_changes = late_changes.max(late);
                assert!(
                    late <= engines + 1,
                    "round {round}: {name} ran {engines} engines and made {late} changes \
                     after it was continued"
                );
            }
            _ => server.restart().expect("the database restarts"),
        }
        for &i in &waiting {
            members[i].expect_line(&format!("done {seed}"), Duration::from_secs(120));
        }
        until_quiet(&url, &schema);
        let (snapshot, _) = PgStore::inspect(&url, &options).expect("inspect");
        let (violations, conflicts) =
            work::check_cluster(&snapshot.records, &Ledger::open(&ledger).unwrap())
                .expect("ledger");
        assert!(
            violations.is_empty(),
            "round {round} ({fault}): {} violations ({conflicts} lock conflicts), first: {:?}",
            violations.len(),
            &violations[..violations.len().min(10)]
        );
    }
    let (snapshot, _) = PgStore::inspect(&url, &options).expect("inspect");
    let roots = snapshot
        .records
        .iter()
        .filter(|r| r.parent.is_none())
        .count();
    eprintln!(
        "{rounds} rounds, {roots} roots; partitions moved off a dead or stopped member in \
         {moves:?}; at most {late_changes} late changes refused after a stop"
    );
    assert!(roots as u64 >= BATCH * (rounds as u64), "{roots} roots");
    for member in &mut members {
        member.send("leave");
    }
    for member in &mut members {
        let _ = member.child.wait();
    }
}

/// The checks the rounds rely on find what they look for, on hand-made ledgers: two
/// trees inside one resource at once, and a token older than one taken in the same
/// partition (tokens of two partitions are not ordered).
#[test]
fn the_ledger_finds_overlapping_trees_and_late_tokens_per_partition() {
    if std::env::var_os(URL_VAR).is_some() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ledger");
    let lines = [
        "+ 8 0 0 2 @5/0 ^1",
        "+ 16 0 0 2 @5/0 ^2",
        // Tree 9 enters res/1 while tree 8 is still inside.
        "+ 9 0 0 1 @4/1 ^1",
        "+ 8 0 1 2 @5/0 ^1",
        // Partition 1's token 2 after its 4: late.
        "+ 17 0 0 1 @2/1",
        // Partition 0's token 3 after its 5: late.
        "+ 16 0 1 2 @3/0 ^2",
    ];
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    let ledger = Ledger::open_unfenced(&path).unwrap();
    let conflicts = ledger.lock_conflicts().unwrap();
    assert_eq!(conflicts.len(), 1, "{conflicts:?}");
    assert!(conflicts[0].contains("trees 8 and 9") && conflicts[0].contains("res/1"));
    let late = ledger.fence_violations().unwrap();
    assert_eq!(late.len(), 2, "{late:?}");
    assert!(
        late[0].contains("token 2 in partition 1 after token 4"),
        "{late:?}"
    );
    assert!(
        late[1].contains("token 3 in partition 0 after token 5"),
        "{late:?}"
    );
    // A fenced ledger refuses them instead, per partition.
    let fenced = Ledger::open(&dir.path().join("fenced")).unwrap();
    fenced.add((1, 0, 0), 1, Some((7, Some(0))), None).unwrap();
    fenced.add((2, 0, 0), 1, Some((3, Some(1))), None).unwrap();
    assert!(fenced.add((1, 0, 1), 1, Some((6, Some(0))), None).is_err());
    fenced.add((2, 0, 1), 1, Some((3, Some(1))), None).unwrap();
}
