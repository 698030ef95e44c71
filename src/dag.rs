//! DAG procedures: a [`Dag`] is a procedure made of [`Task`]s with "before → after"
//! edges. Ready tasks (every predecessor done) run in parallel, up to a limit, each as
//! a child procedure ([`DagTask`]); the task statuses are the DAG's persisted state, so
//! a restart resumes the DAG where it was; a failure rolls back every task the DAG
//! started, in reverse topological order. [`DagBuilder::build`] refuses a cycle,
//! naming its tasks; a DAG's record that does not describe one it could build (a
//! cycle, a task out of range) fails to decode, saying what is wrong, so recovery
//! reports that procedure as corrupt.
//!
//! # How it runs
//!
//! Each step of the DAG marks done the started tasks whose child procedures have
//! succeeded ([`Context::children`]), picks the ready tasks — longest remaining chain
//! first, then in the order they were added — takes as many as
//! [`DagBuilder::parallelism`] leaves room for beside the tasks still running, marks
//! them started and returns them as [`Flow::WaitAny`]: a *wave*, possibly empty. The
//! engine makes that state durable before it starts the children, runs them on its
//! worker pool, and wakes the DAG each time one of its children succeeds, so a task
//! starts as soon as its predecessors are done, whatever else runs beside it. The
//! last step returns [`Flow::Done`].
//!
//! The DAG's children are its started tasks in the order it started them, so the
//! `n`-th child is the `n`-th task of its waves: a step whose children do not match its
//! started tasks fails, naming both counts. A DAG recorded by a version that started
//! its waves with `Flow::Children` resumes the same way (woken once all had finished,
//! its step finds them all succeeded).
//!
//! # Why the DAG rolls its tasks back itself
//!
//! The engine does not roll back a child that finished successfully: rollback walks
//! the tree's stack newest first and skips SUCCESS procedures, leaving the parent's
//! rollback to undo what the parent caused (see `a_child_that_succeeded_is_not_rolled_back`
//! in `tests/rollback_order.rs`). Tasks of earlier waves are exactly such children. So
//! the child procedure ([`DagTask`]) does nothing in its rollback, and the DAG rolls
//! its tasks back in its own rollback: one rollback call of the DAG per recorded DAG
//! step, newest first, each undoing the newest wave not yet undone, its tasks all at
//! once (a wave has no edge inside it and is never larger than the parallelism; the
//! calls run concurrently on the DAG's rollback call, each with a clone of its
//! context). A wave's tasks started only once all their predecessors were done, and a
//! step sees a task done only after the step that started it, so for every edge
//! `a → b` that ran, `b`'s wave is newer than `a`'s and `b` is rolled back before `a`.
//! The DAG has at least as many recorded steps as waves (a step that started nothing
//! is recorded too; the extra rollback calls find nothing left to undo). Every started task is rolled back exactly once (a crash during the DAG's rollback,
//! or a failed rollback of one task of a wave, may repeat that wave's calls —
//! rollbacks are idempotent), including a task of the failing wave that the engine had queued but
//! not yet run when the tree failed (it skips such a step). Hence [`Task`] rather than
//! [`Procedure`]: a task is one idempotent action with one idempotent undo, and its
//! value never changes, so the DAG's copy is what both its execution and its rollback
//! see.
//!
//! A finished task's rollback runs inside the DAG's rollback step: with the DAG's
//! context and under the DAG's locks ([`DagBuilder::lock`]), not the task's own
//! ([`Task::locks`], taken for its execution).
//!
//! # Failure policies and points of no return
//!
//! A task's [`Task::failure_policy`] decides what its failed `execute` leads to (its
//! child procedure asks it) and what a failed `rollback` of it leads to (the DAG asks
//! it for the task whose rollback failed): roll back, pause, or retry first.
//!
//! A task whose [`Task::irreversible`] is true is a point of no return: its child
//! procedure marks its step ([`Context::set_irreversible`]), so once that step is
//! recorded a failure anywhere in the tree pauses the failing procedure, and the DAG
//! is never rolled back past the task. Such a task runs alone: it starts only when no
//! other task is running or ready, and nothing starts beside it. A sibling failing
//! while it ran could otherwise fail the tree while the task's step is still
//! unrecorded, and the DAG would have to undo it. Alone, the task either fails itself
//! (its effect is then not done, and the DAG rolls back) or is recorded before any
//! other task starts.

use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::locks::Lock;
use crate::procedure::{
    ChildType, Context, FailurePolicy, Flow, ProcError, ProcState, Procedure, Undo,
};

/// A task of a [`Dag`]: one idempotent action and its idempotent undo. Usually an enum
/// of the kinds of work a DAG does. Its value is fixed when it is added to the
/// [`DagBuilder`]: both `execute` and `rollback` take `&self`.
///
/// `execute` may run more than once (after a crash), and `rollback` may run for a task
/// whose `execute` never ran or was cut off, so both must tolerate what is already
/// done or undone.
///
/// ```
/// use proctor::{async_trait, Context, ProcError, Task};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Clone, Debug, Serialize, Deserialize)]
/// enum Deploy { Image(String), Restart(String) }
///
/// #[async_trait]
/// impl Task for Deploy {
///     async fn execute(&self, _ctx: &mut Context) -> Result<(), ProcError> {
///         Ok(()) // pull the image, restart the service...
///     }
///     async fn rollback(&self, _ctx: &mut Context) -> Result<(), ProcError> {
///         Ok(()) // ...and undo it, if it was done
///     }
/// }
/// ```
#[async_trait]
pub trait Task<E = ()>:
    Clone + fmt::Debug + Serialize + DeserializeOwned + Send + Sync + 'static
where
    E: Send + Sync + 'static,
{
    /// Does the task. Runs as the one step of a child procedure of the DAG, with that
    /// child's context; an `Err` fails the DAG's tree (a
    /// [retryable](ProcError::retryable) one after its retries, under the retry policy
    /// the task set with [`Context::set_retry_policy`]).
    async fn execute(&self, ctx: &mut Context<E>) -> Result<(), ProcError>;

    /// Undoes the task. Runs in a rollback step of the DAG, with the DAG's context, whose
    /// [`Context::undoing`] says [`Undo::Completed`] for a task the DAG saw succeed and
    /// [`Undo::Interrupted`] for one that was still running when the tree failed (it
    /// may have failed — perhaps the failure that rolls the DAG back — been cut off,
    /// or finished): check what is there before undoing it. An `Err` is retried with
    /// backoff, as any rollback.
    async fn rollback(&self, ctx: &mut Context<E>) -> Result<(), ProcError>;

    /// The engine locks the task's execution needs (see [`Procedure::locks`]). Tasks
    /// run under the DAG's own locks ([`DagBuilder::lock`]) without waiting for them.
    fn locks(&self) -> Vec<Lock> {
        Vec::new()
    }

    /// What a failed `execute` (or a failed `rollback`) of this task leads to, as
    /// [`Procedure::failure_policy`]: roll the DAG back (the default), pause for an
    /// operator, or retry first.
    fn failure_policy(&self, _error: &ProcError) -> FailurePolicy {
        FailurePolicy::Rollback
    }

    /// Whether the task is a point of no return ([`Context::set_irreversible`]): once
    /// its `execute` is done and recorded, a failure anywhere in the DAG's tree pauses
    /// instead of rolling back, so the DAG never undoes it. Such a task runs alone,
    /// after the ready reversible tasks: with no sibling in flight, no failure can race
    /// it, and its own failure still rolls the DAG back.
    fn irreversible(&self) -> bool {
        false
    }
}

/// A task's place in its [`Dag`]: the order in which it was added, from 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct TaskId(u32);

impl TaskId {
    /// The position of the task in the order it was added.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Where a task of a [`Dag`] is, as [`Dag::statuses`] reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TaskStatus {
    /// Some predecessor is not done.
    Waiting,
    /// Every predecessor is done; the DAG starts it when there is room.
    Ready,
    /// Given to the engine as a child procedure (running, queued, or finished but not
    /// yet seen by a step of the DAG).
    Started,
    /// Done, as a step of the DAG has seen.
    Done,
    /// Started, then rolled back because the DAG's tree failed.
    RolledBack,
}

/// The most edges [`Dag::summary`] lists.
const SUMMARY_EDGES: usize = 256;

/// A DAG's progress read back from its [`Dag::summary`] (a procedure's state name),
/// for pages that know only that: each task's status, and its edges when listed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) struct SummaryView {
    pub(crate) statuses: Vec<TaskStatus>,
    /// `None` when there were too many to list.
    pub(crate) edges: Option<Vec<(u32, u32)>>,
}

#[cfg_attr(not(feature = "admin"), allow(dead_code))]
impl SummaryView {
    /// `None` unless `text` is a summary.
    pub(crate) fn parse(text: &str) -> Option<SummaryView> {
        let mut parts = text.split("; ");
        let counts = parts.next()?;
        if !counts.contains(" done, ") || !counts.contains(" running") {
            return None;
        }
        let statuses = parts
            .next()?
            .strip_prefix("tasks ")?
            .chars()
            .map(|c| match c {
                'w' => Some(TaskStatus::Waiting),
                'r' => Some(TaskStatus::Ready),
                's' => Some(TaskStatus::Started),
                'd' => Some(TaskStatus::Done),
                'u' => Some(TaskStatus::RolledBack),
                _ => None,
            })
            .collect::<Option<Vec<_>>>()?;
        let edges = match parts.next() {
            None => Some(Vec::new()),
            Some(list) => {
                let list = list.strip_prefix("edges ")?;
                if list.ends_with(" not listed") {
                    None
                } else {
                    let n = statuses.len() as u32;
                    let edges = list
                        .split(' ')
                        .map(|e| {
                            let (a, b) = e.split_once('>')?;
                            let (a, b) = (a.parse().ok()?, b.parse().ok()?);
                            (a < n && b < n).then_some((a, b))
                        })
                        .collect::<Option<Vec<_>>>()?;
                    Some(edges)
                }
            }
        };
        if parts.next().is_some() {
            return None;
        }
        Some(SummaryView { statuses, edges })
    }
}

/// What a [`Dag`] persists per task: one byte each (see [`stored_marks`], which also
/// reads the names earlier records held; `Serialize` writes those names, for its test).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
enum Mark {
    Pending = 0,
    Started = 1,
    Done = 2,
    RolledBack = 3,
}

impl Mark {
    fn from_byte(b: u8) -> Option<Mark> {
        [Mark::Pending, Mark::Started, Mark::Done, Mark::RolledBack]
            .get(usize::from(b))
            .copied()
    }
}

/// A DAG's task statuses as its record holds them: a byte string, a byte a task (its
/// `Mark` as a number). A DAG records its whole state at every step, now one per
/// finished task, and a status by name took eight bytes. Records written before hold a
/// list of names, which still read. The bytes are asked for as such
/// (`deserialize_byte_buf`), so formats that are not self-describing (postcard,
/// bincode) read them too; only the old list needs a self-describing one.
mod stored_marks {
    use std::fmt;

    use serde::de::{self, SeqAccess, Visitor};
    use serde::{Deserialize, Deserializer, Serializer};

    use super::Mark;

    pub(super) fn serialize<S: Serializer>(marks: &[Mark], s: S) -> Result<S::Ok, S::Error> {
        let bytes: Vec<u8> = marks.iter().map(|&m| m as u8).collect();
        s.serialize_bytes(&bytes)
    }

    /// The statuses as read, each a byte, not yet checked.
    pub(super) struct Stored(Vec<u8>);

    impl Stored {
        pub(super) fn into_marks(self) -> Result<Vec<Mark>, String> {
            self.0
                .iter()
                .map(|&b| Mark::from_byte(b).ok_or_else(|| format!("a task status of {b}")))
                .collect()
        }
    }

    impl<'de> Deserialize<'de> for Stored {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_byte_buf(StoredVisitor)
        }
    }

    struct StoredVisitor;

    impl<'de> Visitor<'de> for StoredVisitor {
        type Value = Stored;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("task statuses")
        }

        fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Stored, E> {
            Ok(Stored(v.to_vec()))
        }

        fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Stored, E> {
            Ok(Stored(v))
        }

        /// A list: of names (as written before), or of numbers (a format that writes
        /// bytes as a list, JSON).
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stored, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
            while let Some(OneMark(b)) = seq.next_element()? {
                out.push(b);
            }
            Ok(Stored(out))
        }
    }

    /// One status in a list: its number, or its name.
    struct OneMark(u8);

    impl<'de> Deserialize<'de> for OneMark {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            d.deserialize_any(OneMarkVisitor)
        }
    }

    struct OneMarkVisitor;

    impl Visitor<'_> for OneMarkVisitor {
        type Value = OneMark;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a task status")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<OneMark, E> {
            u8::try_from(v)
                .map(OneMark)
                .map_err(|_| E::custom(format!("a task status of {v}")))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<OneMark, E> {
            let mark = match v {
                "Pending" => Mark::Pending,
                "Started" => Mark::Started,
                "Done" => Mark::Done,
                "RolledBack" => Mark::RolledBack,
                _ => return Err(E::custom(format!("a task status of {v:?}"))),
            };
            Ok(OneMark(mark as u8))
        }
    }
}

/// Why [`DagBuilder::build`] refused a DAG.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DagError {
    /// The edges form a cycle (a task that must run after itself).
    #[error("the tasks form a cycle: {}", cycle_text(.tasks, .names))]
    Cycle {
        /// The tasks of one cycle, each before the next and the last before the first,
        /// starting with the lowest id.
        tasks: Vec<TaskId>,
        /// Their `Debug` text, in the same order.
        names: Vec<String>,
    },
    /// An edge names a task this builder did not add.
    #[error("edge names task {task}, but the builder has only {tasks} tasks")]
    UnknownTask {
        /// The unknown id.
        task: TaskId,
        /// How many tasks the builder has.
        tasks: usize,
    },
    /// A parallelism of 0 would run nothing.
    #[error("parallelism must be at least 1")]
    ZeroParallelism,
}

fn cycle_text(tasks: &[TaskId], names: &[String]) -> String {
    let mut text: Vec<String> = tasks
        .iter()
        .zip(names)
        .map(|(id, name)| format!("{id} {name}"))
        .collect();
    if let Some(first) = text.first().cloned() {
        text.push(first);
    }
    text.join(" → ")
}

/// Builds a [`Dag`]: add tasks, then edges between them.
///
/// ```
/// use proctor::{DagBuilder, DagError};
/// # use proctor::{async_trait, Context, ProcError, Task};
/// # #[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
/// # struct Step(String);
/// # #[async_trait]
/// # impl Task for Step {
/// #     async fn execute(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
/// #     async fn rollback(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
/// # }
/// let mut dag = DagBuilder::new();
/// let fetch = dag.add(Step("fetch".into()));
/// let build = dag.add(Step("build".into()));
/// dag.edge(fetch, build).edge(build, fetch);
/// match dag.build() {
///     Err(DagError::Cycle { tasks, .. }) => assert_eq!(tasks, [fetch, build]),
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Clone, Debug)]
pub struct DagBuilder<T> {
    tasks: Vec<T>,
    edges: Vec<(TaskId, TaskId)>,
    parallelism: usize,
    locks: Vec<Lock>,
}

impl<T> Default for DagBuilder<T> {
    fn default() -> Self {
        DagBuilder {
            tasks: Vec::new(),
            edges: Vec::new(),
            parallelism: usize::MAX,
            locks: Vec::new(),
        }
    }
}

impl<T: fmt::Debug> DagBuilder<T> {
    /// An empty DAG with no parallelism limit (the engine's workers still bound it).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a task; its id is its position in the order of adding.
    ///
    /// # Panics
    /// Past `u32::MAX` tasks.
    pub fn add(&mut self, task: T) -> TaskId {
        let id = TaskId(u32::try_from(self.tasks.len()).expect("at most u32::MAX tasks"));
        self.tasks.push(task);
        id
    }

    /// `before` must be done before `after` starts. Adding an edge twice is harmless.
    pub fn edge(&mut self, before: TaskId, after: TaskId) -> &mut Self {
        self.edges.push((before, after));
        self
    }

    /// At most `n` tasks running at once. Unlimited by default.
    pub fn parallelism(&mut self, n: usize) -> &mut Self {
        self.parallelism = n;
        self
    }

    /// An engine lock the DAG holds from its first step until it finishes (see
    /// [`Procedure::holds_lock`]), through its rollback: its tasks run under it, and
    /// the rollbacks of its tasks, which run in the DAG's rollback steps, hold it.
    pub fn lock(&mut self, lock: Lock) -> &mut Self {
        self.locks.push(lock);
        self
    }

    /// The DAG, ready to submit.
    ///
    /// # Errors
    ///
    /// [`DagError::UnknownTask`] for an edge to a task that was not added,
    /// [`DagError::ZeroParallelism`], or [`DagError::Cycle`] naming one cycle.
    pub fn build(self) -> Result<Dag<T>, DagError> {
        if self.parallelism == 0 {
            return Err(DagError::ZeroParallelism);
        }
        let n = self.tasks.len();
        let mut preds: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); n];
        for &(before, after) in &self.edges {
            for task in [before, after] {
                if task.index() >= n {
                    return Err(DagError::UnknownTask { task, tasks: n });
                }
            }
            preds[after.index()].insert(before.0);
        }
        let preds: Vec<Vec<u32>> = preds.into_iter().map(|p| p.into_iter().collect()).collect();
        if let Some(cycle) = find_cycle(&preds) {
            let names = cycle
                .iter()
                .map(|&t| format!("{:?}", self.tasks[t as usize]))
                .collect();
            return Err(DagError::Cycle {
                tasks: cycle.into_iter().map(TaskId).collect(),
                names,
            });
        }
        Ok(Dag {
            marks: vec![Mark::Pending; n],
            tasks: self.tasks,
            preds,
            waves: Vec::new(),
            parallelism: u32::try_from(self.parallelism).unwrap_or(u32::MAX),
            locks: self.locks,
            failed_rollback: None,
        })
    }
}

/// A procedure made of [`Task`]s and edges between them, built with [`DagBuilder`].
/// Submit it like any procedure; register both it and its child type:
///
/// ```
/// # use proctor::{async_trait, Context, ProcError, Task};
/// # #[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
/// # struct Deploy;
/// # #[async_trait]
/// # impl Task for Deploy {
/// #     async fn execute(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
/// #     async fn rollback(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
/// # }
/// use proctor::{Dag, DagTask, Registry};
/// let mut registry = Registry::new();
/// registry.register::<Dag<Deploy>>("deploy").register::<DagTask<Deploy>>("deploy_task");
/// ```
///
/// Each step starts a wave: the ready tasks (every predecessor done), longest
/// remaining chain first, up to [`DagBuilder::parallelism`] tasks running at once, each
/// as a child procedure ([`DagTask`]). The engine wakes the DAG as each task succeeds
/// ([`Flow::WaitAny`]), and its next step marks the finished tasks done and starts those
/// they made ready, while the others run on.
///
/// When the DAG's tree fails, running tasks end their step, then the DAG rolls back
/// every task it started — done, failed, cut off, or queued but never run — exactly
/// once, in reverse topological order: for every edge `a → b`, `b` before `a`. It does
/// so itself, one wave per recorded DAG step, newest wave first, because the engine does
/// not roll back children that finished successfully. A finished task's rollback runs
/// in the DAG's rollback step, with the DAG's context and locks.
///
/// Its persisted state is the tasks, the edges, each task's status and the waves
/// started so far, so a restart resumes it where it was. [`Dag::statuses`] reads the
/// statuses; the engine shows [`Dag::summary`] as the DAG's state name
/// ([`ProcInfo::state_name`](crate::ProcInfo::state_name)), and each started task as a
/// child of the DAG (`List::new().root(id)`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(try_from = "DagRecord<T>")]
#[serde(bound(deserialize = "T: Deserialize<'de>"))]
pub struct Dag<T> {
    tasks: Vec<T>,
    /// Each task's predecessors, ascending.
    preds: Vec<Vec<u32>>,
    #[serde(serialize_with = "stored_marks::serialize")]
    marks: Vec<Mark>,
    /// The tasks each DAG step started, in order.
    waves: Vec<Vec<u32>>,
    parallelism: u32,
    locks: Vec<Lock>,
    /// The task whose rollback failed last, for [`Procedure::failure_policy`].
    #[serde(skip)]
    failed_rollback: Option<u32>,
}

/// A [`Dag`] as its record holds it, checked before it becomes one: a record that
/// does not describe a DAG [`DagBuilder::build`] could make (a cycle, a task index out
/// of range, lists of different lengths) fails to decode with what is wrong, so
/// recovery reports the procedure as corrupt rather than the engine panicking on it.
#[derive(Deserialize)]
struct DagRecord<T> {
    tasks: Vec<T>,
    preds: Vec<Vec<u32>>,
    marks: stored_marks::Stored,
    waves: Vec<Vec<u32>>,
    parallelism: u32,
    locks: Vec<Lock>,
}

impl<T> TryFrom<DagRecord<T>> for Dag<T> {
    type Error = String;

    fn try_from(r: DagRecord<T>) -> Result<Self, String> {
        let n = r.tasks.len();
        let marks = r.marks.into_marks()?;
        if r.preds.len() != n || marks.len() != n {
            return Err(format!(
                "a DAG of {n} tasks with {} predecessor lists and {} statuses",
                r.preds.len(),
                marks.len()
            ));
        }
        if r.parallelism == 0 {
            return Err("a DAG with a parallelism of 0".into());
        }
        let in_range = |t: u32| (t as usize) < n;
        for (task, preds) in r.preds.iter().enumerate() {
            if let Some(p) = preds.iter().find(|&&p| !in_range(p)) {
                return Err(format!(
                    "task {task} of {n} follows task {p}, which does not exist"
                ));
            }
        }
        for wave in &r.waves {
            if let Some(t) = wave.iter().find(|&&t| !in_range(t)) {
                return Err(format!("a wave of a DAG of {n} tasks names task {t}"));
            }
        }
        if let Some(cycle) = find_cycle(&r.preds) {
            return Err(format!(
                "the DAG's edges form a cycle through tasks {cycle:?}"
            ));
        }
        Ok(Dag {
            tasks: r.tasks,
            preds: r.preds,
            marks,
            waves: r.waves,
            parallelism: r.parallelism,
            locks: r.locks,
            failed_rollback: None,
        })
    }
}

impl<T> Dag<T> {
    /// Each task's id and status, in id order.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, ProcError, Task};
    /// # #[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
    /// # struct Step;
    /// # #[async_trait]
    /// # impl Task for Step {
    /// #     async fn execute(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// #     async fn rollback(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// # }
    /// use proctor::{DagBuilder, TaskStatus};
    /// let mut dag = DagBuilder::new();
    /// let (a, b) = (dag.add(Step), dag.add(Step));
    /// dag.edge(a, b);
    /// let dag = dag.build().unwrap();
    /// assert_eq!(dag.statuses(), [(a, TaskStatus::Ready), (b, TaskStatus::Waiting)]);
    /// assert_eq!(dag.summary(), "0/2 done, 0 running; tasks rw; edges 0>1");
    /// ```
    pub fn statuses(&self) -> Vec<(TaskId, TaskStatus)> {
        (0..self.tasks.len())
            .map(|t| {
                let status = match self.marks[t] {
                    Mark::Pending if self.is_ready(t) => TaskStatus::Ready,
                    Mark::Pending => TaskStatus::Waiting,
                    Mark::Started => TaskStatus::Started,
                    Mark::Done => TaskStatus::Done,
                    Mark::RolledBack => TaskStatus::RolledBack,
                };
                (TaskId(t as u32), status)
            })
            .collect()
    }

    /// The task with this id.
    pub fn task(&self, id: TaskId) -> Option<&T> {
        self.tasks.get(id.index())
    }

    /// The edges, `(before, after)`, by `after` then `before`.
    ///
    /// ```
    /// # use proctor::{async_trait, Context, ProcError, Task};
    /// # #[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
    /// # struct Step;
    /// # #[async_trait]
    /// # impl Task for Step {
    /// #     async fn execute(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// #     async fn rollback(&self, _: &mut Context) -> Result<(), ProcError> { Ok(()) }
    /// # }
    /// let mut dag = proctor::DagBuilder::new();
    /// let (a, b, c) = (dag.add(Step), dag.add(Step), dag.add(Step));
    /// dag.edge(b, c).edge(a, c).edge(a, b);
    /// assert_eq!(dag.build().unwrap().edges(), [(a, b), (a, c), (b, c)]);
    /// ```
    pub fn edges(&self) -> Vec<(TaskId, TaskId)> {
        self.preds
            .iter()
            .enumerate()
            .flat_map(|(after, preds)| {
                preds
                    .iter()
                    .map(move |&before| (TaskId(before), TaskId(after as u32)))
            })
            .collect()
    }

    /// How far the DAG is, as its state name (and `proctor procs`, and the admin
    /// page) shows it: `3/6 done, 2 running; tasks dddssw; edges 0>1 1>2` — the tasks
    /// done, started and, once there are some, rolled back, then each task's status
    /// in id order: `w` waiting, `r` ready, `s` started, `d` done, `u` rolled back
    /// (undone); then, if there are any, the edges `before>after` (up to
    /// 256; beyond, only their number: `edges 300 not listed`).
    ///
    /// ```
    /// use proctor::DagBuilder;
    ///
    /// let mut dag = DagBuilder::new();
    /// let (a, b) = (dag.add("create"), dag.add("fill"));
    /// dag.add("index");
    /// dag.edge(a, b);
    /// assert_eq!(dag.build().unwrap().summary(), "0/3 done, 0 running; tasks rwr; edges 0>1");
    /// ```
    pub fn summary(&self) -> String {
        let count = |mark| self.marks.iter().filter(|&&m| m == mark).count();
        let mut text = format!(
            "{}/{} done, {} running",
            count(Mark::Done),
            self.tasks.len(),
            count(Mark::Started)
        );
        let rolled_back = count(Mark::RolledBack);
        if rolled_back > 0 {
            text.push_str(&format!(", {rolled_back} rolled back"));
        }
        text.reserve(8 + self.tasks.len());
        text.push_str("; tasks ");
        text.extend(self.statuses().into_iter().map(|(_, status)| match status {
            TaskStatus::Waiting => 'w',
            TaskStatus::Ready => 'r',
            TaskStatus::Started => 's',
            TaskStatus::Done => 'd',
            TaskStatus::RolledBack => 'u',
        }));
        let edges: usize = self.preds.iter().map(Vec::len).sum();
        if edges > SUMMARY_EDGES {
            text.push_str(&format!("; edges {edges} not listed"));
        } else if edges > 0 {
            text.push_str("; edges");
            for (before, after) in self.edges() {
                text.push_str(&format!(" {}>{}", before.0, after.0));
            }
        }
        text
    }

    fn is_ready(&self, t: usize) -> bool {
        self.preds[t]
            .iter()
            .all(|&p| self.marks[p as usize] == Mark::Done)
    }

    /// Marks the `done` tasks done and starts the next wave: the ready tasks, by
    /// priority, as many as the parallelism leaves room for beside the tasks still
    /// running; one for which `alone` is true (an irreversible one) only when no other
    /// task is running or ready, and nothing beside it. Empty when nothing can start.
    fn next_wave(&mut self, done: &[u32], alone: impl Fn(u32) -> bool) -> Vec<u32> {
        for &t in done {
            if self.marks[t as usize] == Mark::Started {
                self.marks[t as usize] = Mark::Done;
            }
        }
        let running: Vec<u32> = (0..self.marks.len() as u32)
            .filter(|&t| self.marks[t as usize] == Mark::Started)
            .collect();
        if running.iter().any(|&t| alone(t)) {
            return Vec::new();
        }
        let room = (self.parallelism as usize).saturating_sub(running.len());
        let ready = ready(&self.preds, &self.marks);
        let mut wave: Vec<u32> = ready.iter().copied().filter(|&t| !alone(t)).collect();
        if wave.is_empty() && running.is_empty() {
            wave.extend(ready.first());
        }
        wave.truncate(room);
        for &t in &wave {
            self.marks[t as usize] = Mark::Started;
        }
        if !wave.is_empty() {
            self.waves.push(wave.clone());
        }
        wave
    }

    /// The tasks the next rollback call undoes, in order: those not yet rolled back of
    /// the newest wave that has some, newest started first (the order their
    /// concurrent calls are first polled in).
    fn to_roll_back(&self) -> Vec<u32> {
        self.waves
            .iter()
            .rev()
            .map(|wave| {
                wave.iter()
                    .rev()
                    .copied()
                    .filter(|&t| self.marks[t as usize] != Mark::RolledBack)
                    .collect::<Vec<_>>()
            })
            .find(|tasks| !tasks.is_empty())
            .unwrap_or_default()
    }
}

/// The tasks not started whose predecessors are all done, longest remaining chain
/// first, then by id.
fn ready(preds: &[Vec<u32>], marks: &[Mark]) -> Vec<u32> {
    let height = heights(preds);
    let mut ready: Vec<u32> = (0..preds.len())
        .filter(|&t| {
            marks[t] == Mark::Pending && preds[t].iter().all(|&p| marks[p as usize] == Mark::Done)
        })
        .map(|t| t as u32)
        .collect();
    ready.sort_by_key(|&t| (std::cmp::Reverse(height[t as usize]), t));
    ready
}

/// A topological order (Kahn's, lowest id first among the ready), or the tasks left
/// over when there is a cycle.
fn topological(preds: &[Vec<u32>]) -> Result<Vec<u32>, Vec<bool>> {
    let n = preds.len();
    let mut succs: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut indegree: Vec<usize> = vec![0; n];
    for (t, ps) in preds.iter().enumerate() {
        indegree[t] = ps.len();
        for &p in ps {
            succs[p as usize].push(t as u32);
        }
    }
    let mut ready: BTreeSet<u32> = (0..n as u32)
        .filter(|&t| indegree[t as usize] == 0)
        .collect();
    let mut order = Vec::with_capacity(n);
    while let Some(t) = ready.pop_first() {
        order.push(t);
        for &s in &succs[t as usize] {
            indegree[s as usize] -= 1;
            if indegree[s as usize] == 0 {
                ready.insert(s);
            }
        }
    }
    if order.len() == n {
        Ok(order)
    } else {
        Err(indegree.iter().map(|&d| d > 0).collect())
    }
}

/// For each task, the number of tasks on the longest chain it heads (itself included).
/// The graph must be acyclic.
fn heights(preds: &[Vec<u32>]) -> Vec<u32> {
    let order = topological(preds).expect("acyclic");
    let mut height = vec![1u32; preds.len()];
    for &t in order.iter().rev() {
        for &p in &preds[t as usize] {
            let h = height[t as usize] + 1;
            let hp = &mut height[p as usize];
            *hp = (*hp).max(h);
        }
    }
    height
}

/// One cycle, each task before the next, starting with its lowest id; `None` if the
/// graph is acyclic.
fn find_cycle(preds: &[Vec<u32>]) -> Option<Vec<u32>> {
    let left = topological(preds).err()?;
    // Every task left over has a predecessor left over: walk back until one repeats.
    let start = left.iter().position(|&l| l)?;
    let mut path: Vec<u32> = vec![start as u32];
    loop {
        let last = *path.last().expect("non-empty");
        let prev = *preds[last as usize]
            .iter()
            .find(|&&p| left[p as usize])
            .expect("a task left over has a predecessor left over");
        if let Some(at) = path.iter().position(|&t| t == prev) {
            let mut cycle: Vec<u32> = path.split_off(at);
            cycle.reverse(); // walked backwards
            let lowest = cycle.iter().enumerate().min_by_key(|&(_, t)| t)?.0;
            cycle.rotate_left(lowest);
            return Some(cycle);
        }
        path.push(prev);
    }
}

#[async_trait]
impl<T, E> Procedure<E> for Dag<T>
where
    T: Task<E>,
    E: Send + Sync + 'static,
{
    async fn execute(&mut self, ctx: &mut Context<E>) -> Result<Flow<E>, ProcError> {
        // The DAG's children are its started tasks, in the order it started them.
        let started = self.waves.iter().flatten();
        let children = ctx.children();
        if started.clone().count() != children.len() {
            return Err(ProcError::failed(format!(
                "DAG has started {} tasks but has {} children ({})",
                started.count(),
                children.len(),
                self.summary()
            )));
        }
        let done: Vec<u32> = started
            .zip(children)
            .filter(|(_, (_, state))| *state == ProcState::Success)
            .map(|(&t, _)| t)
            .collect();
        let tasks = &self.tasks;
        let alone: Vec<bool> = tasks.iter().map(Task::irreversible).collect();
        let wave = self.next_wave(&done, |t| alone[t as usize]);
        if self.marks.iter().all(|&m| m == Mark::Done) {
            return Ok(Flow::Done);
        }
        if wave.is_empty() && !self.marks.contains(&Mark::Started) {
            // build() refuses cycles, so only a corrupt state gets here.
            return Err(ProcError::failed(format!(
                "DAG cannot go on: nothing is ready ({})",
                self.summary()
            )));
        }
        // Woken as each task finishes, to start what it made ready.
        Ok(Flow::WaitAny(
            wave.into_iter()
                .map(|t| {
                    Box::new(DagTask {
                        id: TaskId(t),
                        task: self.tasks[t as usize].clone(),
                    }) as Box<dyn Procedure<E>>
                })
                .collect(),
        ))
    }

    async fn rollback(&mut self, ctx: &mut Context<E>) -> Result<(), ProcError> {
        if ctx.is_unrecorded_step() {
            // A DAG step acts only through its recorded result (the children start
            // after it is durable): an unrecorded one did nothing.
            return Ok(());
        }
        // One wave: no edge between its tasks, so they roll back at once (a wave is
        // never larger than the parallelism).
        let wave = self.to_roll_back();
        let (tasks, marks) = (&self.tasks, &self.marks);
        let undos = wave.iter().map(|&t| {
            // A task the DAG saw succeed completed; one still started when the tree
            // failed may have failed, been cut off, or finished unseen.
            let undo = match marks[t as usize] {
                Mark::Done => Undo::Completed,
                _ => Undo::Interrupted,
            };
            let mut ctx = ctx.clone().undoing_step(undo);
            async move { tasks[t as usize].rollback(&mut ctx).await }
        });
        let results = join_all(undos.collect()).await;
        let mut first_error = None;
        for (&t, result) in wave.iter().zip(results) {
            match result {
                Ok(()) => self.marks[t as usize] = Mark::RolledBack,
                Err(e) if first_error.is_none() => {
                    self.failed_rollback = Some(t);
                    first_error = Some(e);
                }
                Err(_) => {}
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn child_types() -> Vec<ChildType> {
        vec![ChildType::of::<DagTask<T>>()]
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        // A DAG step only starts tasks; what fails in it is a task's rollback.
        self.failed_rollback
            .and_then(|t| self.tasks.get(t as usize))
            .map_or(FailurePolicy::Rollback, |task| task.failure_policy(error))
    }

    fn locks(&self) -> Vec<Lock> {
        self.locks.clone()
    }

    fn holds_lock(&self) -> bool {
        !self.locks.is_empty()
    }

    fn state_name(&self) -> Option<String> {
        Some(self.summary())
    }
}

/// Runs the futures concurrently on the calling task; their outputs in order.
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// The child procedure that runs one task of a [`Dag`]: its one step is the task's
/// `execute`; its rollback does nothing, because the DAG rolls its tasks back itself
/// (see the crate's "DAG procedures"). Register it beside the DAG:
/// `registry.register::<DagTask<MyTask>>("my_task")`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DagTask<T> {
    id: TaskId,
    task: T,
}

impl<T> DagTask<T> {
    /// The task's id in its DAG.
    pub fn id(&self) -> TaskId {
        self.id
    }

    /// The task.
    pub fn task(&self) -> &T {
        &self.task
    }
}

#[async_trait]
impl<T, E> Procedure<E> for DagTask<T>
where
    T: Task<E>,
    E: Send + Sync + 'static,
{
    async fn execute(&mut self, ctx: &mut Context<E>) -> Result<Flow<E>, ProcError> {
        self.task.execute(ctx).await?;
        if self.task.irreversible() {
            ctx.set_irreversible();
        }
        Ok(Flow::Done)
    }

    async fn rollback(&mut self, _ctx: &mut Context<E>) -> Result<(), ProcError> {
        Ok(()) // the DAG's rollback undoes the task, in reverse topological order
    }

    fn locks(&self) -> Vec<Lock> {
        self.task.locks()
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        self.task.failure_policy(error)
    }

    fn state_name(&self) -> Option<String> {
        Some(format!("task {} {:?}", self.id, self.task))
    }
}

/// The task index a [`DagTask`]'s state name (`task #N …`) names, for pages that know
/// only the name.
#[cfg_attr(not(feature = "admin"), allow(dead_code))]
pub(crate) fn task_named(state_name: &str) -> Option<usize> {
    state_name
        .strip_prefix("task #")?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::ProcId;
    use std::future::Future;
    use std::pin::pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context as TaskContext, Poll, Waker};

    /// Runs a future that never waits (the tasks below do no IO).
    fn now<F: Future>(fut: F) -> F::Output {
        match pin!(fut)
            .as_mut()
            .poll(&mut TaskContext::from_waker(Waker::noop()))
        {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("test future must not wait"),
        }
    }

    type Log = Mutex<Vec<String>>;
    type Edges = &'static [(u32, u32)];
    /// `Ok` for a DAG, or the cycle `build` names.
    type Verdict = Result<(), &'static [u32]>;

    #[derive(Clone, Debug, Serialize, Deserialize)]
    struct Job(String);

    fn job(name: &str) -> Job {
        Job(name.to_string())
    }

    #[async_trait]
    impl Task<Log> for Job {
        async fn execute(&self, ctx: &mut Context<Log>) -> Result<(), ProcError> {
            ctx.env().lock().unwrap().push(format!("exec {}", self.0));
            Ok(())
        }
        async fn rollback(&self, ctx: &mut Context<Log>) -> Result<(), ProcError> {
            ctx.env()
                .lock()
                .unwrap()
                .push(format!("rollback {}", self.0));
            Ok(())
        }
        /// A job named `!…` is a point of no return.
        fn irreversible(&self) -> bool {
            self.0.starts_with('!')
        }
    }

    fn ctx(log: &Arc<Log>) -> Context<Log> {
        Context::new(ProcId(1), None, ProcId(1), 0, log.clone())
    }

    fn preds(n: usize, edges: &[(u32, u32)]) -> Vec<Vec<u32>> {
        let mut preds = vec![Vec::new(); n];
        for &(a, b) in edges {
            preds[b as usize].push(a);
        }
        preds
    }

    /// `P`ending, `S`tarted, `D`one, `R`olled back, one letter per task.
    fn marks(text: &str) -> Vec<Mark> {
        text.chars()
            .map(|c| match c {
                'P' => Mark::Pending,
                'S' => Mark::Started,
                'D' => Mark::Done,
                'R' => Mark::RolledBack,
                _ => panic!("mark {c}"),
            })
            .collect()
    }

    #[test]
    fn ready_tasks_have_every_predecessor_done_and_the_longest_chain_goes_first() {
        let diamond: &[(u32, u32)] = &[(0, 1), (0, 2), (1, 3), (2, 3)];
        let cases: &[(&str, Edges, &str, &[u32])] = &[
            ("empty", &[], "", &[]),
            ("no edges: all, by id", &[], "PPP", &[0, 1, 2]),
            ("chain: the head", &[(0, 1), (1, 2)], "PPP", &[0]),
            ("chain: after the head", &[(0, 1), (1, 2)], "DPP", &[1]),
            ("started is not done", &[(0, 1), (1, 2)], "SPP", &[]),
            ("rolled back is not done", &[(0, 1)], "RP", &[]),
            ("diamond: both branches", diamond, "DPPP", &[1, 2]),
            ("diamond: join waits for both", diamond, "DDSP", &[]),
            ("diamond: join", diamond, "DDDP", &[3]),
            ("all done", diamond, "DDDD", &[]),
            (
                "longest chain first: 1→2→3, 4→5, 0 alone",
                &[(1, 2), (2, 3), (4, 5)],
                "PPPPPP",
                &[1, 4, 0],
            ),
            (
                "ties by id",
                &[(0, 3), (1, 4), (2, 5)],
                "PPPPPP",
                &[0, 1, 2],
            ),
        ];
        for &(name, edges, state, want) in cases {
            let m = marks(state);
            assert_eq!(ready(&preds(m.len(), edges), &m), want, "{name}");
        }
    }

    #[test]
    fn build_refuses_cycles_naming_them_and_bad_edges() {
        let cases: &[(&str, usize, Edges, Verdict)] = &[
            ("no tasks", 0, &[], Ok(())),
            ("diamond", 4, &[(0, 1), (0, 2), (1, 3), (2, 3)], Ok(())),
            ("duplicate edge", 2, &[(0, 1), (0, 1)], Ok(())),
            ("self edge", 3, &[(0, 1), (2, 2)], Err(&[2])),
            ("two", 2, &[(0, 1), (1, 0)], Err(&[0, 1])),
            (
                "three, from the lowest",
                4,
                &[(3, 1), (1, 2), (2, 3)],
                Err(&[1, 2, 3]),
            ),
            (
                "cycle behind a task",
                5,
                &[(0, 2), (2, 4), (4, 3), (3, 2)],
                Err(&[2, 4, 3]),
            ),
            (
                "backward edge",
                3,
                &[(0, 1), (1, 2), (2, 0)],
                Err(&[0, 1, 2]),
            ),
        ];
        for &(name, n, edges, want) in cases {
            let mut b = DagBuilder::new();
            let ids: Vec<TaskId> = (0..n).map(|_| b.add(job("t"))).collect();
            for &(x, y) in edges {
                b.edge(ids[x as usize], ids[y as usize]);
            }
            match (b.build(), want) {
                (Ok(_), Ok(())) => {}
                (Err(DagError::Cycle { tasks, names }), Err(cycle)) => {
                    let got: Vec<u32> = tasks.iter().map(|t| t.0).collect();
                    assert_eq!(got, cycle, "{name}");
                    assert_eq!(names.len(), cycle.len(), "{name}");
                }
                (got, _) => panic!("{name}: {got:?}"),
            }
        }
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let mut b = DagBuilder::new();
        let a = b.add(job("fetch"));
        let c = b.add(job("build"));
        b.edge(a, c).edge(c, a);
        assert_eq!(
            b.build().unwrap_err().to_string(),
            r#"the tasks form a cycle: #0 Job("fetch") → #1 Job("build") → #0 Job("fetch")"#
        );

        let mut other = DagBuilder::new();
        let far = (0..3).map(|_| other.add(job("x"))).last().unwrap();
        let mut b = DagBuilder::new();
        let a = b.add(job("a"));
        b.edge(a, far);
        assert_eq!(
            b.build().unwrap_err(),
            DagError::UnknownTask {
                task: far,
                tasks: 1
            }
        );

        let mut b = DagBuilder::<Job>::new();
        b.parallelism(0);
        assert_eq!(b.build().unwrap_err(), DagError::ZeroParallelism);
    }

    /// The task ids a step started, or `None` for `Done`, once every task it started
    /// before has finished.
    fn step(dag: &mut Dag<Job>, log: &Arc<Log>) -> Option<Vec<usize>> {
        let all: Vec<usize> = dag.waves.iter().flatten().map(|&t| t as usize).collect();
        step_after(dag, log, &all)
    }

    /// The same, once the `done` tasks it started have finished (the others run on).
    fn step_after(dag: &mut Dag<Job>, log: &Arc<Log>, done: &[usize]) -> Option<Vec<usize>> {
        // Its children, as the engine shows them: the started tasks in order.
        let children = dag
            .waves
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, &t)| {
                let state = if done.contains(&(t as usize)) {
                    ProcState::Success
                } else {
                    ProcState::Runnable
                };
                (ProcId(i as u64 + 2), state)
            })
            .collect();
        let mut ctx = ctx(log).with_children(children);
        match now(Procedure::<Log>::execute(dag, &mut ctx)).unwrap() {
            Flow::Done => None,
            Flow::WaitAny(children) => Some(
                children
                    .iter()
                    .map(|c| {
                        let any: &dyn std::any::Any = c.as_ref();
                        any.downcast_ref::<DagTask<Job>>().unwrap().id().index()
                    })
                    .collect(),
            ),
            other => panic!("a DAG step spawns children or is done: {other:?}"),
        }
    }

    /// 0 → {1, 2, 3} → 4, parallelism 2.
    fn fan() -> Dag<Job> {
        let mut b = DagBuilder::new();
        let ids: Vec<TaskId> = ["a", "b", "c", "d", "e"]
            .into_iter()
            .map(|n| b.add(job(n)))
            .collect();
        for mid in 1..=3 {
            b.edge(ids[0], ids[mid]).edge(ids[mid], ids[4]);
        }
        b.parallelism(2);
        b.build().unwrap()
    }

    #[test]
    fn a_task_child_names_its_task() {
        let child = DagTask {
            id: TaskId(3),
            task: job("c"),
        };
        assert_eq!(task_named(&child.state_name().unwrap()), Some(3));
        for other in ["step 3 of 4", "task #x y", "task 3"] {
            assert_eq!(task_named(other), None, "{other}");
        }
    }

    #[test]
    fn a_summary_reads_back_as_statuses_and_edges() {
        let dag = fan();
        let view = SummaryView::parse(&dag.summary()).unwrap();
        let statuses: Vec<TaskStatus> = dag.statuses().into_iter().map(|(_, s)| s).collect();
        assert_eq!(view.statuses, statuses);
        let edges: Vec<(u32, u32)> = dag.edges().into_iter().map(|(a, b)| (a.0, b.0)).collect();
        assert_eq!(view.edges, Some(edges));
        // (summary, Some((tasks, edges listed))) or None where it is not a summary.
        type Want = Option<(usize, Option<usize>)>;
        let cases: &[(&str, Want)] = &[
            ("0/2 done, 0 running; tasks rr", Some((2, Some(0)))),
            (
                "0/2 done, 1 running, 1 rolled back; tasks us; edges 0>1",
                Some((2, Some(1))),
            ),
            (
                "0/2 done, 0 running; tasks rw; edges 300 not listed",
                Some((2, None)),
            ),
            ("step 3 of 4", None),
            ("0/2 done, 0 running; tasks rx", None),
            ("0/2 done, 0 running; tasks rw; edges 0>2", None),
            ("0/2 done, 0 running; tasks rw; edges 0-1", None),
            ("0/2 done, 0 running; tasks rw; edges 0>1; more", None),
        ];
        for (text, want) in cases {
            let got =
                SummaryView::parse(text).map(|v| (v.statuses.len(), v.edges.map(|e| e.len())));
            assert_eq!(got, *want, "{text}");
        }
    }

    #[test]
    fn steps_start_waves_of_at_most_parallelism_ready_tasks() {
        let log = Arc::new(Log::default());
        let mut dag = fan();
        let mut waves = Vec::new();
        let mut names = vec![dag.summary()];
        while let Some(wave) = step(&mut dag, &log) {
            waves.push(wave);
            names.push(dag.summary());
        }
        names.push(dag.summary());
        assert_eq!(waves, [vec![0], vec![1, 2], vec![3], vec![4]]);
        assert_eq!(
            names,
            [
                "0/5 done, 0 running; tasks rwwww; edges 0>1 0>2 0>3 1>4 2>4 3>4",
                "0/5 done, 1 running; tasks swwww; edges 0>1 0>2 0>3 1>4 2>4 3>4",
                "1/5 done, 2 running; tasks dssrw; edges 0>1 0>2 0>3 1>4 2>4 3>4",
                "3/5 done, 1 running; tasks dddsw; edges 0>1 0>2 0>3 1>4 2>4 3>4",
                "4/5 done, 1 running; tasks dddds; edges 0>1 0>2 0>3 1>4 2>4 3>4",
                "5/5 done, 0 running; tasks ddddd; edges 0>1 0>2 0>3 1>4 2>4 3>4",
            ]
        );
        assert!(
            log.lock().unwrap().is_empty(),
            "the DAG runs no task itself"
        );
    }

    #[test]
    fn an_irreversible_task_runs_alone_after_the_ready_reversible_ones() {
        // (tasks, edges, parallelism, waves)
        type Case = (
            &'static [&'static str],
            Edges,
            usize,
            &'static [&'static [usize]],
        );
        let cases: &[Case] = &[
            // a → c; !x and b free: the reversible first, !x once none is ready.
            (&["a", "!x", "b", "c"], &[(0, 3)], 3, &[&[0, 2], &[3], &[1]]),
            // Only irreversible tasks ready: one per wave.
            (
                &["!x", "!y", "z"],
                &[(0, 2), (1, 2)],
                4,
                &[&[0], &[1], &[2]],
            ),
            // !x heads the longest chain, yet waits for the reversible b.
            (&["!x", "a", "b"], &[(0, 1)], 2, &[&[2], &[0], &[1]]),
        ];
        for &(names, edges, parallelism, expected) in cases {
            let mut dag = dag_of(names, edges, parallelism);
            let log = Arc::new(Log::default());
            let mut waves = Vec::new();
            while let Some(wave) = step(&mut dag, &log) {
                waves.push(wave);
            }
            assert_eq!(waves, expected, "{names:?} {edges:?}");
        }
    }

    /// A DAG of jobs with these names and edges (by index).
    fn dag_of(names: &[&str], edges: &[(u32, u32)], parallelism: usize) -> Dag<Job> {
        let mut b = DagBuilder::new();
        let ids: Vec<TaskId> = names.iter().map(|n| b.add(job(n))).collect();
        for &(x, y) in edges {
            b.edge(ids[x as usize], ids[y as usize]);
        }
        b.parallelism(parallelism);
        b.build().unwrap()
    }

    #[test]
    fn a_task_starts_once_its_predecessors_are_done_beside_slower_ones() {
        // (tasks, edges, parallelism, steps: the tasks done when the step runs and what
        // it starts, `None` for done)
        type Case = (
            &'static str,
            &'static [&'static str],
            Edges,
            usize,
            &'static [(&'static [usize], Option<&'static [usize]>)],
        );
        let cases: &[Case] = &[
            (
                "b follows a while c runs on; d waits for c",
                &["a", "b", "c", "d"],
                &[(0, 1), (2, 3)],
                4,
                &[
                    (&[], Some(&[0, 2])),
                    (&[0], Some(&[1])),
                    (&[0, 1], Some(&[])),
                    (&[0, 1, 2], Some(&[3])),
                    (&[0, 1, 2, 3], None),
                ],
            ),
            (
                "a finished task's place goes to the next ready one",
                &["a", "b", "c", "d"],
                &[],
                2,
                &[
                    (&[], Some(&[0, 1])),
                    (&[1], Some(&[2])),
                    (&[1], Some(&[])),
                    (&[0, 1, 2], Some(&[3])),
                    (&[0, 1, 2, 3], None),
                ],
            ),
            (
                "an irreversible task waits until nothing else runs or is ready",
                &["a", "!x", "b", "c"],
                &[(0, 2)],
                4,
                &[
                    (&[], Some(&[0, 3])),
                    (&[0], Some(&[2])),
                    (&[0, 2], Some(&[])),
                    (&[0, 2, 3], Some(&[1])),
                    (&[0, 1, 2, 3], None),
                ],
            ),
        ];
        for &(name, names, edges, parallelism, steps) in cases {
            let mut dag = dag_of(names, edges, parallelism);
            let log = Arc::new(Log::default());
            for (i, &(done, want)) in steps.iter().enumerate() {
                let got = step_after(&mut dag, &log, done);
                assert_eq!(got.as_deref(), want, "{name}: step {i}");
            }
        }
    }

    #[test]
    fn a_step_whose_children_do_not_match_its_started_tasks_fails() {
        let log = Arc::new(Log::default());
        let mut dag = fan();
        step(&mut dag, &log); // starts a
        let mut ctx = ctx(&log); // but shows no child
        let e = now(Procedure::<Log>::execute(&mut dag, &mut ctx)).unwrap_err();
        assert!(
            e.to_string()
                .contains("DAG has started 1 tasks but has 0 children"),
            "{e}"
        );
    }

    #[test]
    fn an_irreversible_task_marks_its_step() {
        let log = Arc::new(Log::default());
        for (name, marked) in [("!x", true), ("a", false)] {
            let mut task = DagTask {
                id: TaskId(0),
                task: job(name),
            };
            let mut ctx = ctx(&log);
            now(Procedure::<Log>::execute(&mut task, &mut ctx)).unwrap();
            assert_eq!(ctx.take_irreversible(), marked, "{name}");
        }
    }

    #[test]
    fn rollback_undoes_one_wave_per_call_newest_first() {
        let log = Arc::new(Log::default());
        let mut dag = fan();
        step(&mut dag, &log); // wave [a]
        step(&mut dag, &log); // wave [b, c], then the tree fails
        let statuses: Vec<TaskStatus> = dag.statuses().into_iter().map(|(_, s)| s).collect();
        use TaskStatus::*;
        assert_eq!(statuses, [Done, Started, Started, Ready, Waiting]);

        // Recovery's extra call for a step that may have been cut off does nothing.
        let unrecorded = ctx(&log).for_unrecorded_step();
        now(Procedure::<Log>::rollback(&mut dag, &mut { unrecorded })).unwrap();
        assert!(log.lock().unwrap().is_empty());

        for _ in 0..3 {
            // Two recorded DAG steps, and one more call does no harm.
            now(Procedure::<Log>::rollback(&mut dag, &mut ctx(&log))).unwrap();
        }
        assert_eq!(
            *log.lock().unwrap(),
            ["rollback c", "rollback b", "rollback a"]
        );
        let statuses: Vec<TaskStatus> = dag.statuses().into_iter().map(|(_, s)| s).collect();
        assert_eq!(
            statuses,
            [RolledBack, RolledBack, RolledBack, Waiting, Waiting]
        );
        assert_eq!(
            dag.summary(),
            "0/5 done, 0 running, 3 rolled back; tasks uuuww; edges 0>1 0>2 0>3 1>4 2>4 3>4"
        );
    }

    #[test]
    fn the_state_survives_encoding() {
        let log = Arc::new(Log::default());
        let mut dag = fan();
        step(&mut dag, &log);
        step(&mut dag, &log);
        let bytes = rmp_serde::to_vec_named(&dag).unwrap();
        let mut back: Dag<Job> = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back.statuses(), dag.statuses());
        assert_eq!(step(&mut back, &log), Some(vec![3]));
    }

    #[test]
    fn statuses_are_a_byte_each_and_records_with_their_names_still_read() {
        let log = Arc::new(Log::default());
        let mut dag = fan();
        step(&mut dag, &log);
        step(&mut dag, &log); // a done, b and c started
        let bytes = rmp_serde::to_vec_named(&dag).unwrap();
        // "marks" then a bin of five bytes: 0xc4 5, done, started, started, pending, pending.
        let at = bytes.windows(5).position(|w| w == b"marks").unwrap() + 5;
        assert_eq!(bytes[at..at + 7], [0xc4, 5, 2, 1, 1, 0, 0]);
        // As an earlier version wrote it: each status by its name.
        #[derive(Serialize)]
        struct Named<'a> {
            tasks: &'a [Job],
            preds: &'a [Vec<u32>],
            marks: &'a [Mark],
            waves: &'a [Vec<u32>],
            parallelism: u32,
            locks: &'a [Lock],
        }
        let named = rmp_serde::to_vec_named(&Named {
            tasks: &dag.tasks,
            preds: &dag.preds,
            marks: &dag.marks,
            waves: &dag.waves,
            parallelism: dag.parallelism,
            locks: &dag.locks,
        })
        .unwrap();
        assert!(
            named.len() > bytes.len() + 20,
            "{} vs {}",
            named.len(),
            bytes.len()
        );
        let back: Dag<Job> = rmp_serde::from_slice(&named).unwrap();
        assert_eq!(back.statuses(), dag.statuses());
        let back: Dag<Job> = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back.statuses(), dag.statuses());
    }

    /// Statuses read where the format says nothing of its values' kinds (postcard,
    /// bincode): only bytes asked for as bytes, no `deserialize_any`.
    #[test]
    fn statuses_read_from_a_format_that_is_not_self_describing() {
        struct OnlyBytes(Vec<u8>);
        impl<'de> serde::Deserializer<'de> for OnlyBytes {
            type Error = serde::de::value::Error;
            fn deserialize_any<V: serde::de::Visitor<'de>>(
                self,
                _: V,
            ) -> Result<V::Value, Self::Error> {
                Err(serde::de::Error::custom("not self-describing"))
            }
            fn deserialize_byte_buf<V: serde::de::Visitor<'de>>(
                self,
                visitor: V,
            ) -> Result<V::Value, Self::Error> {
                visitor.visit_byte_buf(self.0)
            }
            serde::forward_to_deserialize_any! {
                bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
                option unit unit_struct newtype_struct seq tuple tuple_struct map struct
                enum identifier ignored_any
            }
        }
        let stored = stored_marks::Stored::deserialize(OnlyBytes(vec![2, 1, 0, 3])).unwrap();
        assert_eq!(
            stored.into_marks().unwrap(),
            [Mark::Done, Mark::Started, Mark::Pending, Mark::RolledBack]
        );
        let bad = stored_marks::Stored::deserialize(OnlyBytes(vec![4])).unwrap();
        assert_eq!(bad.into_marks().unwrap_err(), "a task status of 4");
    }

    #[test]
    fn a_record_that_is_no_dag_fails_to_decode_saying_why() {
        let dag = fan();
        let good = serde_json::to_value(&dag).unwrap();
        let n = dag.statuses().len();
        type Edit = fn(&mut serde_json::Value);
        let cases: [(&str, Edit, &str); 7] = [
            ("as written", |_| {}, ""),
            (
                "a cycle",
                |v| v["preds"][0] = serde_json::json!([1]),
                "cycle through tasks [0, 1]",
            ),
            (
                "a self edge",
                |v| v["preds"][2] = serde_json::json!([2]),
                "cycle through tasks [2]",
            ),
            (
                "a missing task",
                |v| v["preds"][1] = serde_json::json!([99]),
                "follows task 99",
            ),
            (
                "a short list",
                |v| v["marks"].as_array_mut().unwrap().truncate(1),
                "1 statuses",
            ),
            (
                "a bad status",
                |v| v["marks"][0] = serde_json::json!(7),
                "a task status of 7",
            ),
            (
                "a bad wave",
                |v| v["waves"] = serde_json::json!([[0], [7, 1]]),
                "names task 7",
            ),
        ];
        for (case, edit, why) in cases {
            let mut v = good.clone();
            edit(&mut v);
            match serde_json::from_value::<Dag<Job>>(v) {
                Ok(back) if why.is_empty() => assert_eq!(back.statuses().len(), n),
                Ok(_) => panic!("{case}: decoded"),
                Err(e) if !why.is_empty() => assert!(e.to_string().contains(why), "{case}: {e}"),
                Err(e) => panic!("{case}: {e}"),
            }
        }
        let mut v = good;
        v["parallelism"] = serde_json::json!(0);
        let e = serde_json::from_value::<Dag<Job>>(v).unwrap_err();
        assert!(e.to_string().contains("parallelism of 0"), "{e}");
    }

    /// Random DAGs (1 to 7 tasks, some irreversible, random edges and parallelism),
    /// their tasks finishing in random order and numbers between steps, and a failure
    /// at a random step: no task starts before its predecessors are done or twice,
    /// the parallelism is never exceeded, an irreversible task runs alone, and the
    /// rollback (one call per recorded step) undoes every started task once, each
    /// edge's later task first.
    #[test]
    fn random_dags_start_tasks_in_order_and_roll_back_against_the_edges() {
        let mut rng = fastrand::Rng::with_seed(88_172_645_463_325_252);
        for case in 0..3_000 {
            let n = rng.usize(1..=7);
            let names: Vec<String> = (0..n)
                .map(|i| {
                    if rng.u8(0..5) == 0 {
                        format!("!t{i}")
                    } else {
                        format!("t{i}")
                    }
                })
                .collect();
            let mut edges: Vec<(u32, u32)> = Vec::new();
            for a in 0..n as u32 {
                for b in a + 1..n as u32 {
                    if rng.u8(0..3) == 0 {
                        edges.push((a, b));
                    }
                }
            }
            let parallelism = rng.usize(1..=3);
            let names_ref: Vec<&str> = names.iter().map(String::as_str).collect();
            let mut dag = dag_of(&names_ref, &edges, parallelism);
            let log = Arc::new(Log::default());
            let (mut done, mut started): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
            let fail_at = rng.usize(0..12);
            let mut steps = 0;
            let mut failed = false;
            for round in 0..100 {
                steps += 1;
                let Some(wave) = step_after(&mut dag, &log, &done) else {
                    assert_eq!(done.len(), n, "case {case}: done early");
                    break;
                };
                for &t in &wave {
                    for &(a, _) in edges.iter().filter(|&&(_, b)| b as usize == t) {
                        assert!(done.contains(&(a as usize)), "case {case}: {t} before {a}");
                    }
                    assert!(!started.contains(&t), "case {case}: {t} started twice");
                    started.push(t);
                }
                let mut running: Vec<usize> = started
                    .iter()
                    .copied()
                    .filter(|t| !done.contains(t))
                    .collect();
                assert!(running.len() <= parallelism, "case {case}: {running:?}");
                if running.iter().any(|&t| names[t].starts_with('!')) {
                    assert_eq!(running.len(), 1, "case {case}: not alone: {running:?}");
                }
                if round == fail_at {
                    failed = true;
                    break;
                }
                // Some of the running tasks finish before the next step, in any order.
                for _ in 0..rng.usize(0..=running.len()) {
                    done.push(running.swap_remove(rng.usize(0..running.len())));
                }
            }
            if !failed {
                continue;
            }
            for _ in 0..steps {
                now(Procedure::<Log>::rollback(&mut dag, &mut ctx(&log))).unwrap();
            }
            let undone: Vec<usize> = log
                .lock()
                .unwrap()
                .iter()
                .map(|l| {
                    let name = l.strip_prefix("rollback ").expect("only rollbacks logged");
                    names.iter().position(|n| n == name).expect("a task")
                })
                .collect();
            let mut got = undone.clone();
            got.sort_unstable();
            started.sort_unstable();
            assert_eq!(got, started, "case {case}: each started task undone once");
            for &(a, b) in &edges {
                let at = |t: u32| undone.iter().position(|&u| u == t as usize);
                if let (Some(pa), Some(pb)) = (at(a), at(b)) {
                    assert!(pb < pa, "case {case}: {b} undone after {a}");
                }
            }
        }
    }
}
