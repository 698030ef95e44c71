//! Deterministic simulation of the whole engine (the `simulation` feature): one seed
//! replays one run, bit for bit.
//!
//! [`run`] starts the real engine — executor, shards, schedulers, root stacks,
//! procedure actors, persistence, locks — on one thread, an actix system on a
//! current-thread tokio runtime whose clock is paused: time moves only when every
//! actor and task waits, straight to the next timer. The engine reads that clock
//! (its `now_ms`, its monotonic windows, every timer), its shards share the one
//! arbiter, and its writer is a task of the same thread that waits a simulated disk
//! latency before each append. The store is the real WAL store on a simulated disk
//! ([`WalFs`](crate::ops::WalFs)) that fails writes and syncs with `EIO`/`ENOSPC`
//! and, at a power cut, keeps a random part of each file's unsynced tail, sector by
//! sector. The hashers' seeds are fixed under the feature, so maps iterate alike in
//! every run.
//!
//! The seed picks the faults (swarm testing, as FoundationDB does: each seed turns on
//! its own mix of crashes, disk errors, failing steps, operator aborts, a slow
//! disk, a lossy network, a cluster over a simulated PostgreSQL with partitions and
//! dropped connections), the engine's shape (workers, shards) and a workload of trees
//! with children, retried and failing steps, exclusive engine locks and remote
//! operations with undos, sent by the real dispatcher through a simulated network to
//! simulated nodes. The driver submits the roots
//! (each under a nonce, resubmitted after a crash until acknowledged), waits for their
//! results, aborts some, and at the seed's crash times drops the whole system at once
//! — every actor, task and call in flight — cuts the disk's power, and starts a new
//! engine on what survived. Everything observable goes into one history, hashed as it
//! grows (the run's `trace_hash`), and a checker judges it as it happens:
//!
//! - a step the engine moved past (a later step of the same procedure ran) never runs
//!   again: it was durable;
//! - a rollback undoes a procedure's newest step first, its children's effects before
//!   the step that started them, and the steps a parent took after its children ended
//!   before any of theirs;
//! - no two procedures are inside one exclusive lock at once;
//! - a root's result never changes, nothing of its tree runs after it, a tree that
//!   succeeded left every effect of its procedures, one that rolled back none of its
//!   root's and, of each child, all (it succeeded first) or none, and a root with no
//!   failure and no abort succeeds;
//! - every acknowledged root ends;
//! - no undo reaches a node while its operation is on its way there, and a tree that
//!   succeeded has every remote effect (one that rolled back may leave applied an
//!   operation whose child recorded its outcome first: counted, as documented);
//! - in a cluster, no call into user code under a fencing token whose lease term may
//!   have ended, none under an older token after a newer one's first, and no lease
//!   given up while the database was reachable.
//!
//! A [`Mutation`] turns on one deliberately reintroduced bug; the crate's tests show
//! the checker finds each within a fixed number of seeds.
//!
//! What it does not control: the real operating system (real `fsync`, real threads of
//! a multi-shard engine, signals) and a real PostgreSQL. The real-thread perturbation
//! tests, the kill loops of real processes and the PostgreSQL tests cover those
//! (`ARCHITECTURE.md`, "Deterministic simulation").

mod cluster;
mod db;
mod disk;
mod world;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

pub use crate::mutation::Mutation;

use crate::actors::wal_store::{WalOptions, WalStore};
use crate::procedure::ProcId;
use crate::record::Nonce;
use crate::Executor;

pub(crate) use db::SimDb;
use disk::SimDisk;
use world::{RootPlan, World};

/// The simulated wall clock at a seed's start (2026-01-01T00:00:00Z, in ms).
const EPOCH_MS: u64 = 1_767_225_600_000;

/// How long an incarnation may run in simulated time before the run counts as stalled.
const STALL_AFTER: Duration = Duration::from_secs(600);

/// A small seeded generator (xorshift64*, seeded through splitmix64).
#[derive(Clone, Debug)]
pub(crate) struct Rng(u64);

impl Default for Rng {
    fn default() -> Self {
        Rng::new(0)
    }
}

impl Rng {
    pub(crate) fn new(seed: u64) -> Rng {
        let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng((z ^ (z >> 31)) | 1)
    }

    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 for `n == 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// What a seed turns on (swarm testing): each fault on in some seeds and off in
/// others, so that one fault does not hide the paths another reaches.
#[derive(Clone, Debug)]
pub(crate) struct Swarm {
    /// Two executors over a simulated PostgreSQL, taking the leader lease from each
    /// other, rather than one over the WAL.
    pub(crate) cluster: bool,
    /// (Cluster) processes cut off from the database for a while.
    partitions: bool,
    /// (Cluster) connections that drop, commits whose outcome is unknown.
    db_drops: bool,
    crashes: u32,
    disk_errors: bool,
    pub(crate) step_failures: bool,
    pub(crate) aborts: bool,
    /// Steps that send remote operations to simulated nodes.
    pub(crate) remote: bool,
    /// The network loses requests and answers.
    net_faults: bool,
    slow_disk: bool,
    workers: usize,
    arbiters: usize,
}

impl Swarm {
    fn pick(rng: &mut Rng) -> Swarm {
        Swarm {
            cluster: rng.below(3) == 0,
            partitions: rng.below(3) != 0,
            db_drops: rng.below(3) != 0,
            crashes: [0, 1, 2, 4][rng.below(4) as usize],
            disk_errors: rng.below(4) == 0,
            step_failures: rng.below(4) != 0,
            aborts: rng.below(3) != 0,
            remote: rng.below(2) == 0,
            net_faults: rng.below(2) == 0,
            slow_disk: rng.below(3) == 0,
            workers: 1 + rng.below(8) as usize,
            arbiters: 1 + rng.below(3) as usize,
        }
    }

    fn describe(&self) -> String {
        let mut on = Vec::new();
        if self.cluster {
            on.push("cluster".to_string());
            for (flag, name) in [(self.partitions, "partitions"), (self.db_drops, "db-drops")] {
                if flag {
                    on.push(name.to_string());
                }
            }
        }
        if self.crashes > 0 {
            on.push(format!("crashes={}", self.crashes));
        }
        for (flag, name) in [
            (self.disk_errors && !self.cluster, "disk-errors"),
            (self.step_failures, "step-failures"),
            (self.remote, "remote"),
            (self.remote && self.net_faults, "net-faults"),
            (self.aborts, "aborts"),
            (self.slow_disk, "slow-disk"),
        ] {
            if flag {
                on.push(name.to_string());
            }
        }
        on.push(format!("workers={}", self.workers));
        on.push(format!("shards={}", self.arbiters.min(self.workers)));
        on.join(",")
    }
}

/// The simulation running on this thread: its clock and the disk's latencies.
struct Running {
    /// Simulated µs since the seed's start, at `start`.
    base_us: u64,
    start: tokio::time::Instant,
    rng: Rng,
    slow_disk: bool,
}

thread_local! {
    static RUNNING: RefCell<Option<Running>> = const { RefCell::new(None) };
}

/// Whether a simulation runs on this thread (the engine starting now is simulated).
pub(crate) fn active() -> bool {
    RUNNING.with(|r| r.borrow().is_some())
}

/// Simulated µs since the seed's start (0 outside a simulation).
fn now_us() -> u64 {
    RUNNING.with(|r| {
        r.borrow().as_ref().map_or(0, |r| {
            let since = tokio::time::Instant::now().saturating_duration_since(r.start);
            r.base_us + u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
        })
    })
}

/// The engine's wall clock under a simulation.
pub(crate) fn now_ms() -> Option<u64> {
    active().then(|| EPOCH_MS + now_us() / 1_000)
}

/// How long the simulated disk takes for the next write.
pub(crate) fn disk_latency() -> Duration {
    RUNNING.with(|r| {
        r.borrow_mut().as_mut().map_or(Duration::ZERO, |r| {
            let most = if r.slow_disk { 5_000 } else { 300 };
            Duration::from_micros(10 + r.rng.below(most))
        })
    })
}

/// A network round trip to the simulated database.
pub(crate) fn net_latency() -> Duration {
    RUNNING.with(|r| {
        r.borrow_mut().as_mut().map_or(Duration::ZERO, |r| {
            Duration::from_micros(50 + r.rng.below(450))
        })
    })
}

/// A run's settings.
#[derive(Clone, Debug)]
pub struct Options {
    /// Roots in the workload (default 50).
    pub roots: usize,
    /// The deliberately reintroduced bug to run with, if any.
    pub mutation: Option<Mutation>,
    /// Keep the whole trace, not only its hash ([`Outcome::trace`]).
    pub trace: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            roots: 50,
            mutation: None,
            trace: false,
        }
    }
}

/// What one seed's run found.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// The hash of the run's whole history (FNV-1a, 64 bits): equal for two runs of a
    /// seed with the same options, on any machine.
    pub trace_hash: u64,
    /// What the checker found broken (empty for a good run).
    pub violations: Vec<String>,
    /// Crashes (whole-system drops with a power cut) the run went through.
    pub crashes: u32,
    /// Faults injected into the disk (failed writes and syncs).
    pub faults: u32,
    /// Roots submitted and acknowledged.
    pub roots: usize,
    /// Calls into user code (steps and rollbacks).
    pub calls: u64,
    /// Remote effects that trees which rolled back left applied: operations whose
    /// child recorded the outcome before the tree failed, which the engine does not
    /// undo (see [`Dispatched::undo`](crate::Dispatched::undo)).
    pub remote_left_applied: u32,
    /// Bytes in the WAL's files at the end.
    pub wal_bytes: u64,
    /// Simulated time the run took, in ms.
    pub simulated_ms: u64,
    /// The faults and shape the seed picked.
    pub swarm: String,
    /// The mutation it ran with.
    pub mutation: Option<Mutation>,
    /// The history, one event a line, when [`Options::trace`] asked for it.
    pub trace: Vec<String>,
}

impl Outcome {
    /// The outcome as one JSON line (the `simulate` example's output).
    #[must_use]
    pub fn json(&self) -> String {
        let mut out = String::new();
        let _ = write!(
            out,
            "{{\"seed\":{},\"trace_hash\":\"{:016x}\",\"violations\":{},\"crashes\":{},\"faults\":{},\"roots\":{},\"calls\":{},\"remote_left_applied\":{},\"wal_bytes\":{},\"simulated_ms\":{},\"swarm\":{},\"mutation\":{}",
            self.seed,
            self.trace_hash,
            self.violations.len(),
            self.crashes,
            self.faults,
            self.roots,
            self.calls,
            self.remote_left_applied,
            self.wal_bytes,
            self.simulated_ms,
            json_string(&self.swarm),
            self.mutation.map_or("null".to_string(), |m| json_string(m.name())),
        );
        out.push_str(",\"found\":[");
        for (i, v) in self.violations.iter().take(20).enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&json_string(v));
        }
        out.push_str("]}");
        out
    }
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// How an incarnation of the engine ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// Every acknowledged root has its result and nothing is left to submit.
    Finished,
    /// The seed's crash time came.
    Crashed,
    /// The engine broke (its store failed): the process restarts.
    Broken,
    /// Nothing more can be learnt (the engine would not start, or it stalled).
    Fatal,
}

/// Runs one seed (see the module docs) and returns what it found.
///
/// ```
/// use proctor::simulation::{run, Options};
/// let options = Options { roots: 5, ..Options::default() };
/// let once = run(7, &options);
/// assert!(once.violations.is_empty(), "{:?}", once.violations);
/// assert_eq!(run(7, &options).trace_hash, once.trace_hash);
/// ```
#[must_use]
pub fn run(seed: u64, options: &Options) -> Outcome {
    let mut rng = Rng::new(seed);
    let swarm = Swarm::pick(&mut rng);
    let plans = world::plan(&mut rng, options.roots, &swarm);
    let world = Arc::new(World::new(&plans, options.trace, seed, swarm.net_faults));
    let disk = SimDisk::new(seed, if swarm.disk_errors { 300 } else { 0 });
    let db = if swarm.db_drops {
        SimDb::new(seed, 2_000, 100_000)
    } else {
        SimDb::new(seed, 0, 0)
    };
    if swarm.cluster {
        world.lease_in(db.clone());
    }
    crate::mutation::set(options.mutation);
    world.log(format_args!(
        "seed {seed} swarm {} mutation {:?}",
        swarm.describe(),
        options.mutation.map(Mutation::name)
    ));
    let acked: Rc<RefCell<BTreeMap<u32, ProcId>>> = Rc::default();
    let (mut clock_us, mut crashes, mut restarts) = (0u64, 0u32, 0u32);
    loop {
        let crash_after =
            (crashes < swarm.crashes).then(|| Duration::from_micros(1 + rng.below(80_000)));
        let incarnation = Incarnation {
            plans: &plans,
            world: &world,
            disk: &disk,
            db: &db,
            acked: &acked,
            swarm: &swarm,
            first: restarts == 0,
            number: restarts,
            crash_after,
        };
        let (end, now) = incarnation.run(clock_us, seed ^ u64::from(restarts));
        clock_us = now + 1_000;
        match end {
            End::Finished | End::Fatal => break,
            End::Crashed | End::Broken => {
                if end == End::Crashed {
                    crashes += 1;
                }
                restarts += 1;
                world.crashed();
                if !swarm.cluster {
                    disk.power_cut(&mut rng);
                }
                world.log(format_args!("{end:?}; restart {restarts}"));
            }
        }
        if restarts > swarm.crashes + 12 {
            world.violation(format!(
                "the engine restarted {restarts} times without finishing"
            ));
            break;
        }
    }
    world::check_all_ended(&world, &acked.borrow());
    crate::mutation::set(None);
    let acked_roots = acked.borrow().len();
    Outcome {
        seed,
        trace_hash: world.hash(),
        violations: world.violations(),
        crashes,
        faults: disk.faults() + db.faults(),
        roots: acked_roots,
        calls: world.calls(),
        wal_bytes: disk.bytes(),
        remote_left_applied: world.left_applied(),
        simulated_ms: clock_us / 1_000,
        swarm: swarm.describe(),
        mutation: options.mutation,
        trace: world.trace(),
    }
}

/// One life of the engine, from its start on the disk as it is to a crash or the end.
struct Incarnation<'a> {
    plans: &'a [RootPlan],
    world: &'a Arc<World>,
    disk: &'a SimDisk,
    db: &'a SimDb,
    acked: &'a Rc<RefCell<BTreeMap<u32, ProcId>>>,
    swarm: &'a Swarm,
    first: bool,
    /// How many incarnations came before.
    number: u32,
    crash_after: Option<Duration>,
}

impl Incarnation<'_> {
    /// Runs it on a new system and runtime, dropped (as a crash drops a process) when
    /// it ends; returns how it ended and the simulated clock then.
    fn run(&self, base_us: u64, seed: u64) -> (End, u64) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                self.world
                    .violation(format!("cannot build the simulation's runtime: {e}"));
                return (End::Fatal, base_us);
            }
        };
        let system = actix::System::with_tokio_rt(move || runtime);
        let end = system.block_on(async {
            RUNNING.with(|r| {
                *r.borrow_mut() = Some(Running {
                    base_us,
                    start: tokio::time::Instant::now(),
                    rng: Rng::new(seed ^ 0x5157),
                    slow_disk: self.swarm.slow_disk,
                });
            });
            let end = self.drive().await;
            (end, now_us())
        });
        // The crash: every actor, task and call in flight goes with the system.
        drop(system);
        RUNNING.with(|r| *r.borrow_mut() = None);
        end
    }

    async fn drive(&self) -> End {
        if self.swarm.cluster {
            return cluster::drive(self).await;
        }
        let world = self.world;
        let options = WalOptions {
            segment_bytes: 16 << 10,
            max_segments: 3,
            sync: true,
        };
        let store = match WalStore::open_on(self.disk.clone(), "/sim/wal", options) {
            Ok(store) => store,
            // The disk failed a call (an injected fault): the start fails, with the
            // error, and the process is started again.
            Err(e @ crate::store::StoreError::Io { .. }) => {
                world.log(format_args!("the WAL does not open: {e}"));
                return End::Broken;
            }
            Err(e) => {
                world.violation(format!("the WAL does not open: {e}"));
                return End::Fatal;
            }
        };
        let executor = self.builder().store(store).start().await;
        let executor = match executor {
            Ok(executor) => Rc::new(executor),
            Err(e @ crate::Error::Store(_)) if self.disk.faults() > 0 => {
                world.log(format_args!("the engine does not start: {e}"));
                return End::Broken;
            }
            Err(e) => {
                world.violation(format!("the engine does not start: {e}"));
                return End::Fatal;
            }
        };
        let state = Rc::new(Drive::default());
        for (key, id, must) in self.unfinished() {
            state.watch(&executor, world, key, id, must);
        }
        let todo = self.to_submit();
        let submitting = Rc::new(Cell::new(true));
        {
            let (executor, state, submitting) =
                (executor.clone(), state.clone(), submitting.clone());
            let world = world.clone();
            let acked = self.acked.clone();
            let first = self.first;
            let start = tokio::time::Instant::now();
            tokio::task::spawn_local(async move {
                for plan in todo {
                    if first {
                        tokio::time::sleep_until(start + Duration::from_millis(plan.at_ms)).await;
                    }
                    let key = plan.proc.key;
                    match executor.submit(plan.proc.clone()).nonce(nonce(key)).await {
                        Ok(id) => {
                            world.log(format_args!("submitted {key} {id}"));
                            acked.borrow_mut().insert(key, id);
                            state.watch(&executor, &world, key, id, plan.must_succeed);
                            if let Some(after) = plan.abort_after_ms {
                                let (executor, world) = (executor.clone(), world.clone());
                                tokio::task::spawn_local(async move {
                                    tokio::time::sleep(Duration::from_millis(after)).await;
                                    let answer = executor.abort(id).await;
                                    world.log(format_args!("abort {key} {id} {answer:?}"));
                                });
                            }
                        }
                        Err(e) => {
                            world.log(format_args!("submit {key} refused: {e}"));
                            state.broken.set(true);
                            state.wake.notify_one();
                            return;
                        }
                    }
                }
                submitting.set(false);
                state.wake.notify_one();
            });
        }
        self.until_end(&state, &submitting, std::future::pending())
            .await
    }

    /// Waits for the incarnation's end: the seed's crash time, every root's result
    /// (or the engine breaking), `beside` (the cluster's supervisor giving up), or a
    /// stall.
    async fn until_end(
        &self,
        state: &Drive,
        submitting: &Cell<bool>,
        beside: impl std::future::Future<Output = End>,
    ) -> End {
        let crash = async {
            match self.crash_after {
                Some(after) => tokio::time::sleep(after).await,
                None => std::future::pending().await,
            }
        };
        let done = async {
            loop {
                if state.broken.get() {
                    return End::Broken;
                }
                if !submitting.get() && state.open.get() == 0 {
                    return End::Finished;
                }
                state.wake.notified().await;
            }
        };
        let end = tokio::select! {
            biased;
            () = crash => End::Crashed,
            end = done => end,
            end = beside => end,
            () = tokio::time::sleep(STALL_AFTER) => {
                self.world.violation(format!(
                    "stalled: {} roots without a result after {} s of simulated time",
                    state.open.get(),
                    STALL_AFTER.as_secs()
                ));
                End::Fatal
            }
        };
        self.world.log(format_args!("end {end:?}"));
        end
    }

    /// A builder with the seed's registry, environment, shape, retention and
    /// transport; the driver adds the store (and a cluster's process, its lease).
    fn builder(&self) -> crate::ExecutorBuilder<World> {
        Executor::builder()
            .registry(world::registry())
            .env(self.world.clone())
            .workers(self.swarm.workers)
            .arbiters(self.swarm.arbiters)
            .retention(Duration::from_secs(86_400))
            .remote(world::SimNet(self.world.clone()), remote_options())
    }

    /// The roots acknowledged before whose result was not seen: their keys, ids and
    /// whether they must succeed.
    fn unfinished(&self) -> Vec<(u32, ProcId, bool)> {
        (self.acked.borrow().iter())
            .filter(|(&key, _)| !self.world.finished(key))
            .map(|(&key, &id)| {
                let plan = self.plans.iter().find(|p| p.proc.key == key);
                (key, id, plan.is_some_and(|p| p.must_succeed))
            })
            .collect()
    }

    /// The roots not acknowledged yet, in the order of their submission times (at
    /// once after a restart).
    fn to_submit(&self) -> Vec<RootPlan> {
        let acked = self.acked.borrow();
        let mut todo: Vec<RootPlan> = (self.plans.iter())
            .filter(|p| !acked.contains_key(&p.proc.key))
            .cloned()
            .collect();
        todo.sort_by_key(|p| (p.at_ms, p.proc.key));
        todo
    }
}

/// The dispatcher's settings: small batches, quick retries, a deadline far beyond a
/// run (an operation the engine loses track of stalls the run rather than failing).
fn remote_options() -> crate::RemoteOptions {
    crate::RemoteOptions::default()
        .max_ops(3)
        .max_age(Duration::from_millis(2))
        .retry_backoff(Duration::from_millis(1), Duration::from_millis(20))
        .deadline(Duration::from_secs(300))
}

/// The nonce a root is submitted (and resubmitted) under.
fn nonce(key: u32) -> Nonce {
    Nonce {
        group: 0x5157,
        nonce: u64::from(key),
    }
}

/// The driver's state within one incarnation.
#[derive(Default)]
struct Drive {
    /// Roots watched without a result yet.
    open: Cell<usize>,
    /// The engine broke (a request failed).
    broken: Cell<bool>,
    wake: tokio::sync::Notify,
}

impl Drive {
    /// Waits for `id`'s result on a task of its own and gives it to the checker.
    fn watch(
        self: &Rc<Self>,
        executor: &Rc<Executor<World>>,
        world: &Arc<World>,
        key: u32,
        id: ProcId,
        must_succeed: bool,
    ) {
        self.open.set(self.open.get() + 1);
        let (state, executor, world) = (self.clone(), executor.clone(), world.clone());
        tokio::task::spawn_local(async move {
            match executor.wait(id).await {
                Ok(result) => world.result(key, id, result.is_ok(), must_succeed),
                Err(e) => {
                    world.log(format_args!("wait {key} {id}: {e}"));
                    state.broken.set(true);
                }
            }
            state.open.set(state.open.get() - 1);
            state.wake.notify_one();
        });
    }
}
