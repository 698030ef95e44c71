//! A cluster run: executors over the simulated PostgreSQL, each a standby until it
//! takes the leader lease (the PostgreSQL store's own lease code, on the simulated
//! database), with the seed's partitions and dropped connections. A process that
//! stepped down or broke is replaced by a new one, as a service's supervisor would;
//! the old one stays in the system, deposed, and the checker sees whether it calls
//! user code after its successor's first call. The client submits anywhere (the
//! standbys answer `NotLeader`) and waits wherever the result is.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;
use std::rc::Rc;
use std::time::Duration;

use super::world::{RootPlan, World};
use super::{now_us, Drive, End, Incarnation, Rng};
use crate::actors::pg_store::PgLease;
use crate::procedure::ProcId;
use crate::{Error, Executor, Role};

/// The leader lease's period (the shortest the lease allows).
const PERIOD: Duration = Duration::from_millis(300);

/// How many processes one incarnation may replace before the run counts as stuck.
const MOST_REPLACED: u32 = 40;

struct Process {
    name: String,
    executor: Rc<Executor<World>>,
}

/// The live processes, and those the client found broken.
struct Cluster {
    live: RefCell<Vec<Process>>,
    broken: RefCell<BTreeSet<String>>,
    started: Cell<u32>,
}

impl Cluster {
    fn executors(&self) -> Vec<(String, Rc<Executor<World>>)> {
        (self.live.borrow().iter())
            .map(|p| (p.name.clone(), p.executor.clone()))
            .collect()
    }

    /// Starts a new process as a standby.
    fn start(&self, inc: &Incarnation<'_>) -> Result<(), Error> {
        let n = self.started.get() + 1;
        self.started.set(n);
        let name = format!("p{}.{n}", inc.number);
        let executor = inc
            .builder()
            .store(inc.db.store(&name))
            .leadership(PgLease::simulated(inc.db.clone(), &name, PERIOD))
            .start_standby()?;
        inc.world.log(format_args!("start {name}"));
        self.live.borrow_mut().push(Process {
            name,
            executor: Rc::new(executor),
        });
        Ok(())
    }

    /// Takes `name` out of the cluster (its executor stays in the system, deposed).
    fn remove(&self, name: &str) {
        self.live.borrow_mut().retain(|p| p.name != name);
    }
}

/// Whether an error says "ask another process" rather than "this one is broken".
fn elsewhere(e: &Error) -> bool {
    matches!(e, Error::NotLeader { .. } | Error::Stopped)
}

pub(super) async fn drive(inc: &Incarnation<'_>) -> End {
    let world = inc.world;
    let cluster = Rc::new(Cluster {
        live: RefCell::new(Vec::new()),
        broken: RefCell::new(BTreeSet::new()),
        started: Cell::new(0),
    });
    for _ in 0..2 {
        if let Err(e) = cluster.start(inc) {
            world.violation(format!("a standby does not start: {e}"));
            return End::Fatal;
        }
    }
    let state = Rc::new(Drive::default());
    for (key, id, must) in inc.unfinished() {
        watch(&state, &cluster, world, key, id, must);
    }
    let todo = inc.to_submit();
    let submitting = Rc::new(Cell::new(true));
    {
        let (state, cluster, submitting) = (state.clone(), cluster.clone(), submitting.clone());
        let (world, acked, first) = (world.clone(), inc.acked.clone(), inc.first);
        let start = tokio::time::Instant::now();
        tokio::task::spawn_local(async move {
            for plan in todo {
                if first {
                    tokio::time::sleep_until(start + Duration::from_millis(plan.at_ms)).await;
                }
                let key = plan.proc.key;
                let id = submit(&cluster, &world, &plan).await;
                world.log(format_args!("submitted {key} {id}"));
                acked.borrow_mut().insert(key, id);
                watch(&state, &cluster, &world, key, id, plan.must_succeed);
                if let Some(after) = plan.abort_after_ms {
                    let (cluster, world) = (cluster.clone(), world.clone());
                    tokio::task::spawn_local(async move {
                        tokio::time::sleep(Duration::from_millis(after)).await;
                        let answer = abort(&cluster, id).await;
                        world.log(format_args!("abort {key} {id} {answer:?}"));
                    });
                }
            }
            submitting.set(false);
            state.wake.notify_one();
        });
    }
    inc.until_end(&state, &submitting, supervise(inc, &cluster))
        .await
}

/// The supervisor: cuts processes off the database when the seed says so, replaces a
/// process that stepped down or broke, and checks that a process steps down only when
/// it could not reach the database.
async fn supervise(inc: &Incarnation<'_>, cluster: &Rc<Cluster>) -> End {
    let world = inc.world;
    let mut rng = Rng::new(u64::from(cluster.started.get()) ^ inc.world.hash());
    // When each process was last cut off, until when (µs).
    let mut cut_until: std::collections::BTreeMap<String, u64> = Default::default();
    loop {
        tokio::time::sleep(Duration::from_millis(5 + rng.below(30))).await;
        let now = now_us();
        if inc.swarm.partitions && rng.below(8) == 0 {
            // The leader, mostly its lease's connection alone (its store's still
            // works: nothing but its own clock stops it).
            let mut target = None;
            for (name, executor) in cluster.executors() {
                let role = tokio::time::timeout(Duration::from_millis(50), executor.role());
                if let Ok(Ok(Role::Leader { .. })) = role.await {
                    target = Some(name);
                }
            }
            if let Some(name) = target {
                let until = now + 50_000 + rng.below(1_200_000);
                let lease = rng.below(3) != 0;
                inc.db.cut(&name, until, lease);
                cut_until.insert(name.clone(), until);
                let what = if lease { "lease of " } else { "" };
                world.log(format_args!(
                    "cut {what}{name} for {} ms",
                    (until - now) / 1_000
                ));
            }
        }
        let broken: BTreeSet<String> = std::mem::take(&mut *cluster.broken.borrow_mut());
        for (name, executor) in cluster.executors() {
            // A process that does not answer does not hold the supervisor up.
            let role = tokio::time::timeout(Duration::from_millis(50), executor.role()).await;
            let stepped_down = match role {
                Ok(Ok(Role::SteppedDown { reason })) => Some(reason),
                Ok(_) => None,
                Err(_) => {
                    world.log(format_args!("{name} did not answer in 50 ms"));
                    None
                }
            };
            if let Some(reason) = stepped_down {
                world.log(format_args!("{name} stepped down: {reason}"));
                let reachable = cut_until
                    .get(&name)
                    .is_none_or(|&until| until.saturating_add(period_us()) < now);
                if reachable {
                    world.violation(format!(
                        "{name} gave up the leader lease with the database reachable: {reason}"
                    ));
                }
            } else if broken.contains(&name) {
                // A broken process is killed: cut off for good, its lease runs out.
                inc.db.cut(&name, u64::MAX, false);
                cut_until.insert(name.clone(), u64::MAX);
                world.log(format_args!("kill {name}"));
            } else {
                continue;
            }
            cluster.remove(&name);
            if let Err(e) = cluster.start(inc) {
                world.violation(format!("a standby does not start: {e}"));
                return End::Fatal;
            }
        }
        if cluster.started.get() > MOST_REPLACED {
            world.violation(format!(
                "{} processes started without finishing",
                cluster.started.get()
            ));
            return End::Fatal;
        }
    }
}

fn period_us() -> u64 {
    u64::try_from(PERIOD.as_micros()).unwrap_or(u64::MAX)
}

/// Submits `plan`'s root to whichever process takes it, under its nonce.
async fn submit(cluster: &Cluster, world: &World, plan: &RootPlan) -> ProcId {
    loop {
        for (name, executor) in cluster.executors() {
            match executor
                .submit(plan.proc.clone())
                .nonce(super::nonce(plan.proc.key))
                .await
            {
                Ok(id) => return id,
                Err(e) if elsewhere(&e) => {}
                Err(e) => {
                    world.log(format_args!("{name} refused a submit: {e}"));
                    cluster.broken.borrow_mut().insert(name);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Aborts `id` at whichever process leads.
async fn abort(cluster: &Cluster, id: ProcId) -> Result<bool, String> {
    for _ in 0..100 {
        for (_, executor) in cluster.executors() {
            match executor.abort(id).await {
                Err(e) if elsewhere(&e) => {}
                answer => return answer.map_err(|e| e.to_string()),
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err("no process led".to_string())
}

/// Waits for `id`'s result wherever it is, on a task of its own.
fn watch(
    state: &Rc<Drive>,
    cluster: &Rc<Cluster>,
    world: &std::sync::Arc<World>,
    key: u32,
    id: ProcId,
    must_succeed: bool,
) {
    state.open.set(state.open.get() + 1);
    let (state, cluster, world) = (state.clone(), cluster.clone(), world.clone());
    tokio::task::spawn_local(async move {
        'found: loop {
            for (name, executor) in cluster.executors() {
                match executor.wait(id).await {
                    Ok(result) => {
                        world.result(key, id, result.is_ok(), must_succeed);
                        break 'found;
                    }
                    Err(e) if elsewhere(&e) => {}
                    Err(e) => {
                        world.log(format_args!("{name} failed a wait: {e}"));
                        cluster.broken.borrow_mut().insert(name);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        state.open.set(state.open.get() - 1);
        state.wake.notify_one();
    });
}
