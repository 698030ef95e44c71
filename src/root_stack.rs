//! The bookkeeping of one procedure tree (HBase's `RootProcedureState`, IoTDB's
//! `RootProcedureStack`), as a pure state machine: events in, a [`Transition`] out.
//!
//! The actor layer's tree runner feeds this every event of its tree (a step finished,
//! an abort was accepted, a rollback finished, a timer or event fired), persists
//! [`Transition::persist`] and only once that is durable performs
//! [`Transition::actions`]. That ordering is the write-ahead rule: nothing a step
//! caused (the next step, a child's start, a parent's wake-up, the tree's result) is
//! visible before the step's record is on disk.
//!
//! Invariants guarded here:
//! - `stack` holds one entry per executed step of the tree, in execution order, and each
//!   node's `stack_indexes` are exactly its positions in `stack`.
//! - `running` counts procedures queued or executing; a failed tree starts rolling back
//!   only when it is 0, so no step runs concurrently with a rollback.
//! - The first failure of a tree is its result, whatever happens during rollback.
//! - Rollback walks the stack newest first, skipping procedures that finished
//!   successfully (their parent's rollback undoes what the parent caused).

use std::fmt;

use crate::fast_map::SortedMap;
use crate::locks::{LockClaim, Request};
use crate::policy::{decide, decide_within, for_step, Decision};
use crate::procedure::{FailurePolicy, RetryPolicy, Undo};
use crate::procedure::{ProcError, ProcId, ProcState};
use crate::record::{
    Failure, Paused, ProcRecord, RootNonce, Steering, StoreOp, MAX_RECORDED_STEPS,
};

mod operator;
pub use operator::BypassReach;
mod recover;
#[cfg(test)]
mod simulation;

/// What a step of one procedure came to, as the procedure's cell reports it.
#[derive(Debug)]
pub enum StepOutcome {
    /// The procedure finished.
    Done,
    /// Run another step; `yield_after` puts it behind the other queued procedures.
    MoreToDo {
        /// From [`Procedure::is_yield_after_execution`](crate::Procedure::is_yield_after_execution).
        yield_after: bool,
    },
    /// Start these children (ids already assigned) and wait for all of them (and any
    /// still running from earlier steps).
    Children(Vec<NewChild>),
    /// Start these children (possibly none) and wait until any child succeeds, or at
    /// once if none is running ([`Flow::WaitAny`](crate::Flow::WaitAny)).
    Spawn(Vec<NewChild>),
    /// Not a step: requeue behind the others; nothing is persisted.
    Yield,
    /// Wait for the named event.
    Suspend(String),
    /// Sleep until this time (ms since the Unix epoch).
    SleepUntil(u64),
    /// The step failed (error, panic, or state that cannot be persisted).
    Failed(ProcError),
    /// The step was not run because the tree had already failed.
    Skipped,
    /// The step was not run because an operator asked the procedure to pause; `data`
    /// is its state as last recorded.
    Paused,
}

impl StepOutcome {
    /// Whether the step is recorded as one of the procedure's steps (with its state,
    /// and a root's value for the caller): not a failed, yielded, skipped or paused one.
    pub fn is_recorded(&self) -> bool {
        !matches!(
            self,
            StepOutcome::Failed(_)
                | StepOutcome::Yield
                | StepOutcome::Skipped
                | StepOutcome::Paused
        )
    }
}

/// A child returned by a step, already named and encoded.
#[derive(Debug, Clone)]
pub struct NewChild {
    /// Its new id.
    pub id: ProcId,
    /// Its registered type name.
    pub type_name: &'static str,
    /// Its encoded initial state.
    pub data: Vec<u8>,
    /// The locks it declared, if any.
    pub locks: Option<LockClaim>,
    /// When its timeout expires (ms since the Unix epoch), if it has one.
    pub deadline_ms: Option<u64>,
    /// For a root: the nonce it was submitted with, and its submission's fingerprint.
    pub nonce: Option<RootNonce>,
}

/// A step's report: which procedure, what came of it, and its state after the step.
#[derive(Debug)]
pub struct StepReport {
    /// The procedure that ran.
    pub id: ProcId,
    /// What the step returned.
    pub outcome: StepOutcome,
    /// The procedure's encoded state after the step.
    pub data: Vec<u8>,
    /// For a step that finished a root: the value it set for the caller.
    pub result: Option<Vec<u8>>,
    /// The step marked itself as the procedure's point of no return.
    pub irreversible: bool,
    /// For a failed step: its policy and the state recorded before it.
    pub on_error: Option<OnError>,
}

/// What a failed step's report adds: the procedure's [`FailurePolicy`] for the error, the
/// retry policy the step set, and its state as recorded before the step (which a retry
/// or a pause records again, since the failed attempt is discarded).
#[derive(Debug)]
pub struct OnError {
    /// What the procedure's `failure_policy` answered.
    pub policy: FailurePolicy,
    /// The encoded state from before the step.
    pub before: Vec<u8>,
    /// How the step's retryable errors are retried, if it said
    /// ([`Context::set_retry_policy`](crate::Context::set_retry_policy)); boxed, as
    /// few steps say and every report carries the field.
    pub retry: Option<Box<RetryPolicy>>,
}

/// A failed rollback step: its error, the procedure's policy for it, and its state as
/// last recorded.
#[derive(Debug)]
pub struct RollbackFailure {
    /// The rollback's error.
    pub error: ProcError,
    /// What the procedure's `failure_policy` answered.
    pub policy: FailurePolicy,
    /// The encoded state as last recorded.
    pub data: Vec<u8>,
    /// Under the default policy, how many times the rollback is retried before its
    /// procedure is paused: the executor's limit for a failed call into the procedure;
    /// `None` (as many as it takes) when the engine did not get to call it (its lock
    /// was not available).
    pub limit: Option<u32>,
}

/// Where a queued step goes in the ready queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// Before the others: a procedure continuing its steps.
    Front,
    /// Behind the others: a new, woken or resumed procedure.
    Back,
    /// Behind the others, and never ahead of them by its type: a procedure that gave
    /// its turn away (a yield, or `is_yield_after_execution`).
    Yielded,
}

/// Something to do once the transition's records are durable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Start the actor of a new procedure.
    Spawn(ProcId),
    /// Queue a step, at `place`.
    Enqueue {
        /// The procedure.
        id: ProcId,
        /// Where in the ready queue.
        place: Place,
    },
    /// The locks granted to the queued step of `id` for its life are durably held: run
    /// the step. Not a new step: the one queued before is still counted as running.
    Resume(ProcId),
    /// The procedure is finished: stop its actor (releasing its lock and running its
    /// completion cleanup).
    Stop(ProcId),
    /// The procedure will run nothing more (a step skipped in a failed tree, with no
    /// step of its own to roll back): release the locks it holds for its life now, not
    /// when the tree ends, so its tree's rollbacks can take them.
    Release(ProcId),
    /// Its queued step is to come back skipped (it pauses then, past the point of no
    /// return): if it waits for its locks, stop waiting and queue it, so that the
    /// pause does not wait for a holder that may never let go.
    Withdraw(ProcId),
    /// Ask the procedure to roll back its newest step, telling it what that step did.
    Rollback {
        /// The procedure.
        id: ProcId,
        /// The step.
        of: RollbackOf,
    },
    /// Ask again after a failed rollback.
    RetryRollback {
        /// The procedure.
        id: ProcId,
        /// As in [`Action::Rollback`].
        of: RollbackOf,
        /// How long to wait first.
        delay_ms: u64,
    },
    /// Wake the procedure at this time (ms since the Unix epoch).
    WakeAt {
        /// The procedure.
        id: ProcId,
        /// When.
        at_ms: u64,
    },
    /// Its failed attempt is discarded: reload the procedure from `data`, its state as
    /// recorded now (before its next call, which a retry or an operator starts later).
    Reset {
        /// The procedure.
        id: ProcId,
        /// Its recorded state.
        data: Vec<u8>,
    },
    /// The procedure is paused (PAUSED or ROLLBACK_PAUSED, for an operator or by its
    /// failure policy), durably: answer the operators' pauses waiting on it and tell
    /// the subscribers.
    Paused {
        /// The procedure.
        id: ProcId,
        /// PAUSED or ROLLBACK_PAUSED.
        state: ProcState,
        /// Why. Boxed, like `Finished`'s failure: every transition carries a `Vec`
        /// of actions, and these two rare payloads would make each action 112 bytes.
        why: Box<Paused>,
    },
    /// Wake the procedure when the event is woken.
    SuspendOn {
        /// The procedure.
        id: ProcId,
        /// The event's name.
        event: String,
    },
    /// The tree is finished with this result.
    Finished(Result<(), Box<Failure>>),
    /// Something for the metrics, durable now.
    Count(Count),
}

/// What [`Action::Count`] counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// The procedure failed: its step's error (or a panic, or a timeout that failed it),
    /// or an abort (`aborted`), was recorded on it. Not the procedures its tree's
    /// rollback undoes because of it.
    Failed {
        /// The procedure.
        id: ProcId,
        /// An operator's abort (or rollback of a paused procedure) failed it.
        aborted: bool,
    },
    /// A failed step is retried by its failure policy.
    StepRetry(ProcId),
    /// A failed rollback is retried.
    RollbackRetry(ProcId),
}

impl Count {
    /// The procedure counted.
    pub fn id(self) -> ProcId {
        match self {
            Count::Failed { id, .. } | Count::StepRetry(id) | Count::RollbackRetry(id) => id,
        }
    }
}

/// What a parent's step sees of its children.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChildrenSeen {
    /// Each child, in the order it was started, with its state.
    pub states: Box<[(ProcId, ProcState)]>,
    /// The value each child that succeeded set, if it set one, in the same order.
    pub values: Box<[(ProcId, Vec<u8>)]>,
}

/// The step a rollback undoes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RollbackOf {
    /// What it did (see [`Context::undoing`](crate::Context::undoing)).
    pub undo: Undo,
    /// `false` for a step no record holds: one a crash may have cut off (recovery adds
    /// it, see [`RootStack::recover`]) or a failed attempt that was to be retried or was
    /// paused (see [`Context::is_unrecorded_step`](crate::Context::is_unrecorded_step)).
    pub recorded: bool,
}

/// Records to persist, then actions to perform.
#[derive(Debug, Default)]
pub struct Transition {
    /// Apply atomically before any action.
    pub persist: Vec<StoreOp>,
    /// Perform in order once `persist` is durable.
    pub actions: Vec<Action>,
}

impl Transition {
    /// Adds a record to persist. Most transitions persist one: the list starts with
    /// room for exactly one (a `Vec`'s first growth, to four records of some 300 bytes,
    /// is past the allocator's small sizes, on its slow path).
    fn push_op(&mut self, op: StoreOp) {
        if self.persist.capacity() == 0 {
            self.persist.reserve_exact(1);
        }
        self.persist.push(op);
    }
}

/// Where the tree is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Steps run.
    Executing,
    /// A procedure failed and every procedure has stopped; rollback steps run.
    RollingBack,
    /// The root is SUCCESS or ROLLEDBACK.
    Finished,
}

/// A step's failure, as [`RootStack::on_step`] hands it on.
struct Failed {
    error: ProcError,
    on_error: Option<OnError>,
    /// The step returned `Ok` and the engine refused its outcome: it did all it does.
    ran_to_end: bool,
}

/// One entry of the execution stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StackEntry {
    id: ProcId,
    /// `false` for the entries recovery adds for steps that may have started before a
    /// crash; they are not in any record's `stack_indexes`.
    recorded: bool,
}

#[derive(Debug)]
struct Node {
    parent: Option<ProcId>,
    type_name: &'static str,
    state: ProcState,
    stack_indexes: Vec<u32>,
    pending_children: u32,
    submitted_ms: u64,
    wake_at_ms: Option<u64>,
    event: Option<Box<str>>,
    /// Boxed: most procedures never fail, and a `Failure` is 100 bytes.
    failure: Option<Box<Failure>>,
    stopped: bool,
    /// Boxed, like the failure: every live procedure holds a node (and the idle ones
    /// nothing else of note), and most declare no locks.
    locks: Option<Box<LockClaim>>,
    deadline_ms: Option<u64>,
    bypassed: bool,
    steering: Steering,
    /// What few procedures have. Boxed: every idle procedure holds a node.
    extra: Option<Box<NodeExtra>>,
    /// Waking per child, a child of it succeeded while it was not waiting (queued,
    /// running a step, asleep for a retry, paused): its next wait for children ends at
    /// once, since the step may have looked before that child finished.
    unseen_child: bool,
    /// A step of it may have been cut off (by a crash, or its actor stopped) since its
    /// last recorded step: a rollback of its next failed or unrecorded step is told
    /// [`Undo::Interrupted`]. In memory only: recovery marks it again.
    cut_off: bool,
}

/// The parts of a node that few procedures use: a failure's order, retries of a
/// rollback, a nonce, a result, a pause.
#[derive(Debug, Default)]
struct NodeExtra {
    failure_seq: Option<u64>,
    rollback_attempts: u32,
    nonce: Option<RootNonce>,
    result: Option<Vec<u8>>,
    /// For a PAUSED or ROLLBACK_PAUSED procedure: its state as last recorded, written
    /// again when an operator continues or rolls it back.
    paused_data: Option<Vec<u8>>,
    /// A failure past the point of no return found it RUNNABLE: its queued step,
    /// skipped, pauses it for this reason.
    pause_at_step: Option<Box<Paused>>,
    /// Its children, in the order it started them (ascending ids).
    children: Vec<ProcId>,
}

impl NodeExtra {
    /// `None` when there is nothing to keep.
    fn boxed(self) -> Option<Box<NodeExtra>> {
        let empty = self.failure_seq.is_none()
            && self.rollback_attempts == 0
            && self.nonce.is_none()
            && self.result.is_none()
            && self.paused_data.is_none()
            && self.pause_at_step.is_none()
            && self.children.is_empty();
        (!empty).then(|| Box::new(self))
    }
}

impl Node {
    fn extra(&mut self) -> &mut NodeExtra {
        self.extra.get_or_insert_with(Box::default)
    }

    fn failure_seq(&self) -> Option<u64> {
        self.extra.as_ref().and_then(|e| e.failure_seq)
    }

    fn rollback_attempts(&self) -> u32 {
        self.extra.as_ref().map_or(0, |e| e.rollback_attempts)
    }

    fn reset_rollback_attempts(&mut self) {
        if let Some(e) = &mut self.extra {
            e.rollback_attempts = 0;
        }
    }
}

/// A tree's nodes by id.
type NodeMap = SortedMap<ProcId, Node>;

impl std::ops::Index<&ProcId> for NodeMap {
    type Output = Node;
    fn index(&self, id: &ProcId) -> &Node {
        self.get(id).expect("node of this tree")
    }
}

/// The state of one procedure tree. See the module docs.
#[derive(Debug)]
pub struct RootStack {
    root: ProcId,
    nodes: NodeMap,
    stack: Vec<StackEntry>,
    /// Procedures of the tree with a step or rollback in progress.
    running: u32,
    /// The first failure. Boxed: most trees never fail, and a `Failure` is 100 bytes.
    failure: Option<Box<Failure>>,
    /// How many procedures of the tree have failed: the next failure's `failure_seq`.
    failures: u64,
    phase: Phase,
    /// The steps rolled back so far, in the order they were (since this tree was
    /// loaded: a restart begins it again). `None` until a rollback step is done;
    /// boxed, as most trees never roll back (an idle tree's size is its memory: 8
    /// bytes here, where a `Vec` would take 24).
    #[allow(clippy::box_collection)]
    undone: Option<Box<Vec<ProcId>>>,
}

impl RootStack {
    /// A newly submitted root. The transition inserts it, then spawns and queues it.
    pub fn submit(root: NewChild, now_ms: u64) -> (Self, Transition) {
        let mut stack = RootStack {
            root: root.id,
            nodes: NodeMap::default(),
            stack: Vec::new(),
            running: 0,
            failure: None,
            failures: 0,
            phase: Phase::Executing,
            undone: None,
        };
        let mut t = Transition::default();
        stack.add_node(&mut t, None, root, now_ms);
        (stack, t)
    }

    /// The execution stack, oldest step first: the procedure of each step the tree
    /// ran (a procedure once per step), which its rollback undoes newest first.
    pub fn stack(&self) -> impl Iterator<Item = ProcId> + '_ {
        self.stack.iter().map(|e| e.id)
    }

    /// Whether the tree is rolling back.
    pub fn is_rolling_back(&self) -> bool {
        self.phase == Phase::RollingBack
    }

    /// The steps rolled back so far, in the order they were, since this tree was
    /// loaded.
    pub fn undone(&self) -> &[ProcId] {
        self.undone.as_deref().map_or(&[], Vec::as_slice)
    }

    /// The root's id.
    pub fn root(&self) -> ProcId {
        self.root
    }

    /// The event `id` is suspended on, if it is.
    pub fn event_of(&self, id: ProcId) -> Option<&str> {
        self.nodes.get(&id).and_then(|n| n.event.as_deref())
    }

    /// The state of a procedure of the tree, as the tree's bookkeeping has it.
    pub fn state_of(&self, id: ProcId) -> Option<ProcState> {
        self.nodes.get(&id).map(|n| n.state)
    }

    /// Whether an operator bypassed `id`.
    pub fn is_bypassed(&self, id: ProcId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.bypassed)
    }

    /// A procedure of the tree: its parent and when it was submitted (ms since the Unix
    /// epoch), or `None` if it is not in the tree.
    pub fn procedure(&self, id: ProcId) -> Option<(Option<ProcId>, u64)> {
        self.nodes.get(&id).map(|n| (n.parent, n.submitted_ms))
    }

    /// How many of `id`'s steps are recorded (its next step is the one after).
    pub fn steps_of(&self, id: ProcId) -> usize {
        self.nodes.get(&id).map_or(0, |n| n.stack_indexes.len())
    }

    /// Whether `id` has children its steps see ([`RootStack::children_of`] is then
    /// `Some`), without building their view.
    pub fn has_children(&self, id: ProcId) -> bool {
        self.nodes
            .get(&id)
            .and_then(|n| n.extra.as_ref())
            .is_some_and(|extra| !extra.children.is_empty())
    }

    /// `id`'s children, in the order they were started, each with its state, and the
    /// values those that succeeded set; `None` for a procedure that never started one.
    /// What a parent's step sees of them
    /// ([`Context::children`](crate::Context::children),
    /// [`Context::child_results`](crate::Context::child_results)).
    pub fn children_of(&self, id: ProcId) -> Option<Box<ChildrenSeen>> {
        let children = &self.nodes.get(&id)?.extra.as_ref()?.children;
        if children.is_empty() {
            return None;
        }
        let mut states = Vec::with_capacity(children.len());
        let mut values = Vec::new();
        for &child in children {
            let node = self.nodes.get(&child);
            let state = node.map_or(ProcState::Success, |n| n.state);
            states.push((child, state));
            let value = node.and_then(|n| n.extra.as_ref()?.result.as_ref());
            if let (ProcState::Success, Some(value)) = (state, value) {
                values.push((child, value.clone()));
            }
        }
        Some(Box::new(ChildrenSeen {
            states: states.into_boxed_slice(),
            values: values.into_boxed_slice(),
        }))
    }

    /// The registered type name of `id`.
    pub fn type_name_of(&self, id: ProcId) -> Option<&'static str> {
        self.nodes.get(&id).map(|n| n.type_name)
    }

    /// When `id`'s timeout expires (ms since the Unix epoch), if it has one.
    pub fn deadline_of(&self, id: ProcId) -> Option<u64> {
        self.nodes.get(&id).and_then(|n| n.deadline_ms)
    }

    /// `id`'s timeout hook kept it going with a new deadline (or none): persist that,
    /// with its state after the hook. Ignored once it has finished or failed.
    pub fn on_deadline(
        &mut self,
        id: ProcId,
        deadline_ms: Option<u64>,
        data: Vec<u8>,
        now_ms: u64,
    ) -> Transition {
        let mut t = Transition::default();
        let live = self
            .nodes
            .get(&id)
            .is_some_and(|n| !n.state.is_finished() && n.state != ProcState::Failed);
        if self.phase == Phase::Executing && live {
            let node = self.node_mut(id);
            node.deadline_ms = deadline_ms;
            if let Some(paused) = node.extra.as_mut().and_then(|e| e.paused_data.as_mut()) {
                // Paused: the state its continue or rollback records is this one now
                // (the timeout hook may have changed it).
                paused.clone_from(&data);
            }
            self.persist_update(&mut t, id, data, now_ms);
        }
        t
    }

    /// The tree's result if it fails: its first failure, once there is one.
    pub fn first_failure(&self) -> Option<&Failure> {
        self.failure.as_deref()
    }

    /// `true` once any procedure of the tree has failed.
    pub fn is_failed(&self) -> bool {
        self.failure.is_some()
    }

    /// A step of `report.id` finished.
    pub fn on_step(&mut self, mut report: StepReport, now_ms: u64) -> Transition {
        let id = report.id;
        assert!(
            self.running > 0,
            "step report for {id} with nothing running"
        );
        assert_eq!(self.phase, Phase::Executing, "step report for {id}");
        self.running -= 1;
        let mut t = Transition::default();
        let refused = self.check_outcome(&mut report);
        // A root's value for the caller, a child's for its parent, from any recorded
        // step (the last one set wins): kept with its records, so it survives a restart.
        if report.outcome.is_recorded() {
            if let Some(value) = report.result.take() {
                self.node_mut(id).extra().result = Some(value);
            }
        }
        let pause_at_step = match report.outcome {
            StepOutcome::Skipped if !self.is_failed() => self
                .node_mut(id)
                .extra
                .as_mut()
                .and_then(|e| e.pause_at_step.take()),
            _ => None,
        };
        match report.outcome {
            StepOutcome::Skipped => self.on_skipped(&mut t, id, pause_at_step, report.data, now_ms),
            StepOutcome::Paused if !self.is_failed() => {
                let why = Paused {
                    error: None,
                    policy: None,
                    retries: 0,
                };
                self.pause(&mut t, id, ProcState::Paused, why, report.data, now_ms);
            }
            // Its tree failed meanwhile: it is rolled back with the others.
            StepOutcome::Paused => {}
            StepOutcome::Yield => {
                if !self.is_failed() {
                    self.enqueue(&mut t, id, Place::Yielded);
                }
            }
            StepOutcome::Failed(error) => {
                // A step the engine refused ran to its end: rolled back as completed.
                let failed = Failed {
                    error,
                    on_error: report.on_error,
                    ran_to_end: refused,
                };
                self.on_step_failed(&mut t, id, failed, report.data, now_ms)
            }
            StepOutcome::Children(children) if children.is_empty() => {
                self.step_done(&mut t, id, report.data, now_ms);
            }
            StepOutcome::Done => self.step_done(&mut t, id, report.data, now_ms),
            StepOutcome::MoreToDo { yield_after } => {
                self.push_step(id);
                self.node_mut(id).state = ProcState::Runnable;
                self.persist_update(&mut t, id, report.data, now_ms);
                if !self.is_failed() {
                    let place = if yield_after {
                        Place::Yielded
                    } else {
                        Place::Front
                    };
                    self.enqueue(&mut t, id, place);
                }
            }
            StepOutcome::Children(children) => {
                self.push_step(id);
                let node = self.node_mut(id);
                node.state = ProcState::Waiting;
                node.steering.wakes_per_child = false;
                node.unseen_child = false;
                self.persist_update(&mut t, id, report.data, now_ms);
                self.start_children(&mut t, id, children, now_ms);
            }
            StepOutcome::Spawn(children) => {
                self.push_step(id);
                let node = self.node_mut(id);
                node.state = ProcState::Waiting;
                node.steering.wakes_per_child = true;
                self.persist_update(&mut t, id, report.data, now_ms);
                self.start_children(&mut t, id, children, now_ms);
                // Recorded WAITING: the wake, like any, writes nothing.
                let node = self.node_mut(id);
                let wake = node.pending_children == 0 || std::mem::take(&mut node.unseen_child);
                if wake && !self.is_failed() {
                    self.enqueue(&mut t, id, Place::Front);
                }
            }
            StepOutcome::Suspend(event) => {
                self.push_step(id);
                let node = self.node_mut(id);
                node.state = ProcState::Waiting;
                node.event = Some(Box::from(event.as_str()));
                self.persist_update(&mut t, id, report.data, now_ms);
                t.actions.push(Action::SuspendOn { id, event });
            }
            StepOutcome::SleepUntil(at_ms) => {
                self.push_step(id);
                let node = self.node_mut(id);
                node.state = ProcState::WaitingTimeout;
                node.wake_at_ms = Some(at_ms);
                self.persist_update(&mut t, id, report.data, now_ms);
                t.actions.push(Action::WakeAt { id, at_ms });
            }
        }
        self.maybe_start_rollback(&mut t, now_ms);
        t
    }

    /// A step that succeeded may still fail: past the most steps a procedure may record,
    /// or ending (or waiting for something else) while children it started still run.
    /// `true` if it was refused so (its outcome is now a failure).
    fn check_outcome(&mut self, report: &mut StepReport) -> bool {
        let id = report.id;
        let mut refused = false;
        if report.outcome.is_recorded() {
            let node = self.node_mut(id);
            let recorded = node.stack_indexes.len();
            if recorded + 1 >= MAX_RECORDED_STEPS {
                // Past its last recordable step: the step fails instead (its failure
                // is recorded as that last step, and rolled back), rather than write a
                // record no engine could read back. A point of no return it declared
                // still counts: then the failure pauses it.
                node.steering.irreversible |= report.irreversible;
                let error = ProcError::failed(format!(
                    "procedure {id} has recorded {recorded} steps, the most a procedure may"
                ));
                report.outcome = StepOutcome::Failed(error);
                report.on_error = None;
                refused = true;
            } else {
                // A step that succeeded: its retries are over, it left nothing
                // unrecorded, and a point of no return is recorded with it.
                node.steering.retries = 0;
                node.steering.dirty = false;
                node.cut_off = false;
                node.steering.irreversible |= report.irreversible;
            }
            let pending = node.pending_children;
            let waits_for_children = || match &report.outcome {
                StepOutcome::Spawn(_) | StepOutcome::Failed(_) => true,
                StepOutcome::Children(children) => !children.is_empty(),
                _ => false,
            };
            if pending > 0 && !waits_for_children() {
                // Woken per child while others run: it may not finish, nor wait for
                // anything but them, before they do.
                let error = ProcError::failed(format!(
                    "procedure {id} returned {} with {pending} children unfinished: until \
                     they finish, a step may only return Flow::WaitAny or Flow::Children",
                    outcome_name(&report.outcome)
                ));
                report.outcome = StepOutcome::Failed(error);
                report.on_error = None;
                refused = true;
            }
        }
        refused
    }

    /// `id`'s step was not run (its tree failed): a pause asked for it takes effect
    /// instead, or a procedure that never ran a step gives up its life-long locks.
    fn on_skipped(
        &mut self,
        t: &mut Transition,
        id: ProcId,
        pause_at_step: Option<Box<Paused>>,
        data: Vec<u8>,
        now_ms: u64,
    ) {
        if let Some(why) = pause_at_step {
            self.pause(t, id, ProcState::Paused, *why, data.clone(), now_ms);
            // Its failure was not taken: it goes on from `data` when continued.
            t.actions.push(Action::Reset { id, data });
            return;
        }
        // Never ran a step, in a failed tree: nothing of it to roll back, so locks it
        // holds for its life go now — recorded first, so that recovery does not grant
        // them back beside whoever takes them next.
        let node = self.node_mut(id);
        // Unless a step of it may have run unrecorded (a retry, or a crash): then it
        // is rolled back, holding them.
        let undone = node.stack_indexes.is_empty() && !node.steering.dirty;
        let held = node.locks.as_mut().filter(|c| c.for_life && c.held);
        if let (true, Some(claim)) = (undone, held) {
            claim.held = false;
            self.persist_update(t, id, data, now_ms);
            t.actions.push(Action::Release(id));
        }
    }

    /// `id`'s step failed: its policy (or its tree's failure) decides whether the
    /// attempt is recorded and rolled back, retried after a delay, or paused.
    fn on_step_failed(
        &mut self,
        t: &mut Transition,
        id: ProcId,
        failed: Failed,
        data: Vec<u8>,
        now_ms: u64,
    ) {
        let Failed {
            error,
            on_error,
            ran_to_end,
        } = failed;
        let (policy, retry, before) = match on_error {
            Some(OnError {
                policy,
                before,
                retry,
            }) => (policy, retry.map(|r| *r), Some(before)),
            None => (FailurePolicy::Rollback, None, None),
        };
        // The error's kind and the step's retry policy make the procedure's policy the
        // one the failure is decided by.
        let (policy, max_delay_ms) = for_step(policy, error.kind(), retry);
        let decision = if self.is_failed() {
            Decision::Rollback
        } else {
            let retries = self.nodes[&id].steering.retries;
            let irreversible = self.is_irreversible();
            decide_within(
                policy,
                max_delay_ms,
                retries,
                irreversible,
                false,
                None,
                id.0,
            )
        };
        match decision {
            Decision::Rollback => {
                // This attempt is recorded and rolled back, told that it failed; the
                // attempts retried before it were the same step.
                let node = self.node_mut(id);
                node.steering.dirty = false;
                node.steering.failed_step = if std::mem::take(&mut node.cut_off) {
                    // An attempt before it may have done more than it did.
                    Undo::Interrupted
                } else if ran_to_end {
                    Undo::Completed
                } else {
                    Undo::Failed
                };
                self.push_step(id);
                self.fail(t, id, error);
                self.persist_update(t, id, data, now_ms);
            }
            Decision::Retry { delay_ms } => {
                let at_ms = now_ms.saturating_add(delay_ms);
                tracing::info!(target: crate::targets::TREE, proc = %id, %error, delay_ms, "step failed; retrying");
                let node = self.node_mut(id);
                node.steering.retries += 1;
                node.steering.dirty = true;
                node.state = ProcState::WaitingTimeout;
                t.actions.push(Action::Count(Count::StepRetry(id)));
                node.wake_at_ms = Some(at_ms);
                let data = before.unwrap_or(data);
                self.persist_update(t, id, data.clone(), now_ms);
                t.actions.push(Action::Reset { id, data });
                t.actions.push(Action::WakeAt { id, at_ms });
            }
            Decision::Pause => {
                tracing::warn!(target: crate::targets::TREE, proc = %id, %error, "step failed; procedure paused");
                let data = before.unwrap_or(data);
                let node = self.node_mut(id);
                let retries = std::mem::take(&mut node.steering.retries);
                node.steering.dirty = true;
                let why = Paused {
                    error: Some(error),
                    policy: Some(policy),
                    retries,
                };
                self.pause(t, id, ProcState::Paused, why, data.clone(), now_ms);
                t.actions.push(Action::Reset { id, data });
            }
        }
    }

    /// An abort (or timeout) was accepted by `id` between its steps: it fails with
    /// `error`. Ignored if the procedure has finished or the tree is already rolling back.
    pub fn on_fail(
        &mut self,
        id: ProcId,
        error: ProcError,
        data: Vec<u8>,
        now_ms: u64,
    ) -> Transition {
        let mut t = Transition::default();
        let live = self.nodes.get(&id).is_some_and(|n| !n.state.is_finished());
        if self.phase == Phase::Executing && live && self.is_irreversible() {
            // Past the point of no return a timeout cannot roll the tree back either.
            tracing::warn!(target: crate::targets::TREE, proc = %id, %error, "failure past the point of no return; procedure paused");
            let why = Paused {
                error: Some(error),
                policy: None,
                retries: 0,
            };
            let node = self.node_mut(id);
            if node.state == ProcState::Runnable {
                // Its step is queued (or waits for its locks), and comes back skipped
                // (the procedure asked to fail): it pauses then, not with a step out.
                node.extra().pause_at_step = Some(Box::new(why));
                t.actions.push(Action::Withdraw(id));
            } else {
                // It keeps what it waits for, as under an operator's pause: the root
                // stack unsuspends it from its event when the pause is performed (after
                // the record that suspended it, whose `SuspendOn` comes first), and a
                // continue puts it back to waiting.
                self.pause(&mut t, id, ProcState::Paused, why, data.clone(), now_ms);
                // Its failure was not taken: it goes on from `data` when continued.
                t.actions.push(Action::Reset { id, data });
            }
        } else if self.phase == Phase::Executing && live {
            self.fail(&mut t, id, error);
            self.persist_update(&mut t, id, data, now_ms);
            self.maybe_start_rollback(&mut t, now_ms);
        }
        t
    }

    /// `true` once a recorded step of the tree marked itself as the point of no return.
    pub fn is_irreversible(&self) -> bool {
        self.nodes.iter().any(|(_, n)| n.steering.irreversible)
    }

    /// A timer or event woke `id`. Ignored unless it is still waiting for one and the
    /// tree is healthy.
    pub fn on_wake(&mut self, id: ProcId) -> Transition {
        let mut t = Transition::default();
        if self.phase == Phase::Executing && !self.is_failed() && self.waits_for_wake(id) {
            let node = self.node_mut(id);
            node.wake_at_ms = None;
            node.event = None;
            self.enqueue(&mut t, id, Place::Back);
        }
        t
    }

    /// `id`'s step was cut off in this process (the actor running it stopped): like a
    /// step a crash cut off, it may have done part of its work, so should the tree fail
    /// before it runs again, it gets an unrecorded rollback first. In memory only: were
    /// the process to crash too, recovery marks it again.
    pub fn mark_cut_off(&mut self, id: ProcId) {
        if let Some(node) = self.nodes.get_mut(&id) {
            if !node.state.is_finished() {
                node.steering.dirty = true;
                node.cut_off = true;
            }
        }
    }

    /// The unfinished procedures that may have been in a step nobody recorded (marked
    /// `Steering::dirty`, by recovery or by a failed step): should the tree fail before
    /// they run again, each gets an unrecorded rollback first.
    pub fn cut_off(&self) -> impl Iterator<Item = ProcId> + '_ {
        self.nodes
            .iter()
            .filter(|(_, n)| n.steering.dirty && !n.state.is_finished())
            .map(|(&id, _)| id)
    }

    /// After a restart, `id`, recorded waiting for an event, runs its next step rather
    /// than wait again (its `rerun_after_recover` said so: whether the event was woken
    /// before the restart is not in the log). A waiting one is woken now; one an
    /// operator paused while it waited forgets its event, so that when it is continued
    /// it runs its next step. (Kept, the event would put it back to waiting for a wake
    /// that may have come and gone while it was paused.)
    pub fn on_recovered_rerun(&mut self, id: ProcId) -> Transition {
        let paused_waiting = self
            .nodes
            .get(&id)
            .is_some_and(|n| n.state == ProcState::Paused && n.event.is_some());
        if paused_waiting {
            self.node_mut(id).event = None;
            return Transition::default();
        }
        self.on_wake(id)
    }

    /// The locks `id` holds for its life were granted to its queued step: record that
    /// (so recovery grants them back before anything else runs), then run the step.
    /// `data` is the procedure's current state.
    pub fn on_locks_held(&mut self, id: ProcId, data: Vec<u8>, now_ms: u64) -> Transition {
        let mut t = Transition::default();
        let Some(node) = self.nodes.get_mut(&id) else {
            return t;
        };
        if let Some(claim) = node.locks.as_mut() {
            claim.held = true;
        }
        self.persist_update(&mut t, id, data, now_ms);
        t.actions.push(Action::Resume(id));
        t
    }

    /// The lock request of `id`'s next step (or, with `rollback`, rollback step), if it
    /// declared locks: its ancestors (whose locks do not block it) come from the tree.
    /// Whether `id` declared engine locks (what [`lock_request`](Self::lock_request)
    /// would build a request for), without building one.
    pub fn claims_locks(&self, id: ProcId) -> bool {
        self.nodes.get(&id).is_some_and(|n| n.locks.is_some())
    }

    pub fn lock_request(&self, id: ProcId, rollback: bool) -> Option<Request> {
        let node = self.nodes.get(&id)?;
        let claim = node.locks.as_ref()?;
        let mut ancestors = Vec::new();
        let mut up = node.parent;
        while let Some(p) = up {
            ancestors.push(p);
            up = self.nodes.get(&p).and_then(|n| n.parent);
        }
        Some(Request {
            owner: id,
            root: self.root,
            ancestors,
            locks: claim.locks.clone(),
            for_life: claim.for_life,
            rollback,
        })
    }

    /// The requests of the tree's unfinished procedures whose records say they hold
    /// their locks for life, ancestors first: recovery grants them back before anything
    /// else is scheduled.
    pub fn held_locks(&self) -> Vec<Request> {
        self.nodes
            .iter()
            .filter(|(_, n)| {
                !n.state.is_finished() && n.locks.as_ref().is_some_and(|c| c.for_life && c.held)
            })
            .filter_map(|(&id, _)| self.lock_request(id, false))
            .collect()
    }

    /// The procedure on top of the stack finished a rollback step: `Ok` with its state
    /// after the rollback, or the rollback's error (retried with backoff).
    pub fn on_rolled_back(
        &mut self,
        id: ProcId,
        result: Result<Vec<u8>, RollbackFailure>,
        now_ms: u64,
    ) -> Transition {
        assert_eq!(self.phase, Phase::RollingBack, "rollback report for {id}");
        assert_eq!(
            self.stack.last().map(|e| e.id),
            Some(id),
            "rollback report out of order"
        );
        let mut t = Transition::default();
        match result {
            Ok(data) => {
                let of = self.rollback_of_top();
                self.pop_step(id);
                self.undone.get_or_insert_with(Box::default).push(id);
                let node = self.node_mut(id);
                node.reset_rollback_attempts();
                node.steering.retries = 0;
                if of.recorded {
                    // The step that failed the tree is undone: the next completed.
                    node.steering.failed_step = Undo::Completed;
                } else {
                    // The step that failed (or may have run) before is undone.
                    node.steering.dirty = false;
                }
                node.cut_off = false;
                // The record says how far the rollback got, so a restart neither repeats
                // an unrecorded step's rollback nor adds one to a procedure whose
                // rollback has begun: FAILED while recorded steps remain, ROLLEDBACK
                // after the last.
                node.state = if node.stack_indexes.is_empty() {
                    ProcState::RolledBack
                } else {
                    ProcState::Failed
                };
                self.persist_update(&mut t, id, data, now_ms);
                // Fully rolled back: it is finished, and its locks (held for its life,
                // through its rollback) must not outlast it — other procedures of the
                // tree may need them for their own rollbacks. The root is stopped with
                // the tree.
                if id != self.root && self.node_mut(id).state == ProcState::RolledBack {
                    self.node_mut(id).stopped = true;
                    t.actions.push(Action::Stop(id));
                }
                self.next_rollback(&mut t, now_ms);
            }
            Err(RollbackFailure {
                error,
                policy,
                data,
                limit,
            }) => {
                let of = self.rollback_of_top();
                let node = self.node_mut(id);
                // The default policy counts its retries in memory (a restart gives the
                // rollback its retries again); a declared policy's retries are recorded,
                // so a restart does not reset them.
                let counted = policy != FailurePolicy::Rollback;
                let retries = if counted {
                    node.steering.retries
                } else {
                    node.rollback_attempts()
                };
                // A rollback error marked terminal will not go away by retrying: the
                // operator is called at once.
                let decision = if error.kind() == Some(crate::procedure::ErrorKind::Terminal) {
                    Decision::Pause
                } else {
                    decide(policy, retries, false, true, limit, id.0)
                };
                match decision {
                    Decision::Retry { delay_ms } => {
                        tracing::warn!(target: crate::targets::TREE, proc = %id, r#type = node.type_name, %error, retry = retries + 1, delay_ms, "rollback failed; retrying");
                        t.actions.push(Action::Count(Count::RollbackRetry(id)));
                        if counted {
                            node.steering.retries += 1;
                            self.persist_update(&mut t, id, data, now_ms);
                        } else {
                            let attempts = node.rollback_attempts().saturating_add(1);
                            node.extra().rollback_attempts = attempts;
                        }
                        t.actions.push(Action::RetryRollback { id, of, delay_ms });
                    }
                    Decision::Pause | Decision::Rollback => {
                        tracing::warn!(target: crate::targets::TREE, proc = %id, r#type = node.type_name, %error, retries, "rollback failed; procedure ROLLBACK_PAUSED until an operator continues it");
                        node.steering.retries = 0;
                        node.reset_rollback_attempts();
                        let why = Paused {
                            error: Some(error),
                            policy: Some(policy),
                            retries,
                        };
                        self.pause(&mut t, id, ProcState::RollbackPaused, why, data, now_ms);
                    }
                }
            }
        }
        t
    }

    /// Stops `id` in `state` (PAUSED or ROLLBACK_PAUSED) for `why`: records it with
    /// `data`, and keeps `data` for the record the operator's command writes.
    fn pause(
        &mut self,
        t: &mut Transition,
        id: ProcId,
        state: ProcState,
        why: Paused,
        data: Vec<u8>,
        now_ms: u64,
    ) {
        let node = self.node_mut(id);
        node.state = state;
        let why = Box::new(why);
        node.steering.paused = Some(why.clone());
        node.extra().paused_data = Some(data.clone());
        self.persist_update(t, id, data, now_ms);
        t.actions.push(Action::Paused { id, state, why });
    }

    /// Ends `id`'s pause: its recorded state, for the record the operator's command
    /// writes.
    fn unpause(&mut self, id: ProcId) -> Vec<u8> {
        let node = self.node_mut(id);
        node.steering.paused = None;
        let data = node.extra.as_mut().and_then(|e| e.paused_data.take());
        data.unwrap_or_default()
    }

    fn node_mut(&mut self, id: ProcId) -> &mut Node {
        self.nodes
            .get_mut(&id)
            .unwrap_or_else(|| panic!("procedure {id} is not in tree {}", self.root))
    }

    fn add_node(&mut self, t: &mut Transition, parent: Option<ProcId>, new: NewChild, now_ms: u64) {
        let NewChild {
            id,
            type_name,
            data,
            locks,
            deadline_ms,
            nonce,
        } = new;
        let node = Node {
            parent,
            type_name,
            state: ProcState::Runnable,
            stack_indexes: Vec::new(),
            pending_children: 0,
            submitted_ms: now_ms,
            wake_at_ms: None,
            event: None,
            failure: None,
            stopped: false,
            locks: locks.map(Box::new),
            deadline_ms,
            bypassed: false,
            steering: Steering::default(),
            extra: NodeExtra {
                nonce,
                ..NodeExtra::default()
            }
            .boxed(),
            unseen_child: false,
            cut_off: false,
        };
        let old = self.nodes.insert(id, node);
        assert!(old.is_none(), "procedure {id} added twice");
        t.push_op(StoreOp::Insert(self.record(id, data, now_ms)));
        t.actions.push(Action::Spawn(id));
        self.enqueue(t, id, Place::Back);
    }

    fn enqueue(&mut self, t: &mut Transition, id: ProcId, place: Place) {
        let node = self.node_mut(id);
        node.state = ProcState::Runnable;
        // Its step, dispatched after this, sees every child that has finished.
        node.unseen_child = false;
        self.running += 1;
        t.actions.push(Action::Enqueue { id, place });
    }

    fn push_step(&mut self, id: ProcId) {
        let index = u32::try_from(self.stack.len()).expect("root stack deeper than u32::MAX");
        if self.stack.capacity() == 0 {
            // Most trees are one procedure of a few steps: not four entries at first.
            self.stack.reserve_exact(2);
        }
        self.stack.push(StackEntry { id, recorded: true });
        self.node_mut(id).stack_indexes.push(index);
    }

    /// The step on top of the stack, for its rollback. An unrecorded one (a failed
    /// attempt to be retried or paused, or a step a crash may have cut off) failed,
    /// unless it may have been cut off; a procedure's newest recorded step is the one
    /// that failed its tree if its record says so; any other completed.
    fn rollback_of_top(&self) -> RollbackOf {
        let Some(top) = self.stack.last() else {
            return RollbackOf {
                undo: Undo::Completed,
                recorded: true,
            };
        };
        let node = &self.nodes[&top.id];
        let undo = match (top.recorded, node.cut_off) {
            (false, true) => Undo::Interrupted,
            (false, false) => Undo::Failed,
            (true, _) => node.steering.failed_step,
        };
        RollbackOf {
            undo,
            recorded: top.recorded,
        }
    }

    /// Pops the top entry, which must be `id`'s.
    fn pop_step(&mut self, id: ProcId) {
        let popped = self.stack.pop().expect("pop of an empty stack");
        assert_eq!(popped.id, id);
        if popped.recorded {
            let index = self.node_mut(id).stack_indexes.pop();
            assert_eq!(index.map(|i| i as usize), Some(self.stack.len()));
        }
    }

    fn fail(&mut self, t: &mut Transition, id: ProcId, error: ProcError) {
        let aborted = matches!(error.cause(), ProcError::Aborted);
        t.actions.push(Action::Count(Count::Failed { id, aborted }));
        let failure = Failure {
            proc: id,
            type_name: self.node_mut(id).type_name.to_string(),
            error,
        };
        let seq = self.failures;
        self.failures += 1;
        let node = self.node_mut(id);
        node.state = ProcState::Failed;
        node.failure = Some(Box::new(failure.clone()));
        node.extra().failure_seq = Some(seq);
        if self.failure.is_none() {
            tracing::debug!(target: crate::targets::TREE, root = %self.root, %failure, "tree failed");
            self.failure = Some(Box::new(failure));
        }
    }

    fn step_done(&mut self, t: &mut Transition, id: ProcId, data: Vec<u8>, now_ms: u64) {
        self.push_step(id);
        if self.is_failed() {
            // Too late to succeed: the step ran, so its rollback will undo it; a root in
            // a failed tree never becomes SUCCESS.
            if id == self.root {
                self.persist_update(t, id, data, now_ms);
                return;
            }
        }
        self.node_mut(id).state = ProcState::Success;
        self.persist_update(t, id, data, now_ms);
        if id == self.root {
            self.finish(t, now_ms);
            return;
        }
        self.node_mut(id).stopped = true;
        t.actions.push(Action::Stop(id));
        let parent = self.nodes[&id].parent.expect("a child has a parent");
        assert!(self.nodes[&parent].pending_children > 0 || self.is_failed());
        self.child_succeeded(t, parent);
    }

    /// A child of `parent` succeeded (or was bypassed): the parent is woken when it was
    /// the last one it waited for, or, waking per child, for any.
    fn child_succeeded(&mut self, t: &mut Transition, parent: ProcId) {
        let failed = self.is_failed();
        let node = self.node_mut(parent);
        node.pending_children = node.pending_children.saturating_sub(1);
        let waiting = node.state == ProcState::Waiting && node.event.is_none();
        let per_child = node.steering.wakes_per_child;
        if per_child && !waiting && !node.state.is_finished() {
            node.unseen_child = true;
        }
        if waiting && (node.pending_children == 0 || per_child) && !failed {
            // The child's SUCCESS is in this transition, so it is durable before the
            // parent's next step can run.
            self.enqueue(t, parent, Place::Front);
        }
    }

    /// Starts `children` of `id` (none in a failed tree: the parent is rolled back
    /// anyway); the parent waits for them besides any still running.
    fn start_children(
        &mut self,
        t: &mut Transition,
        id: ProcId,
        children: Vec<NewChild>,
        now_ms: u64,
    ) {
        if self.is_failed() || children.is_empty() {
            return;
        }
        let node = self.node_mut(id);
        // More children than a u32 counts cannot be started anyway.
        let added = u32::try_from(children.len()).unwrap_or(u32::MAX);
        node.pending_children = node.pending_children.saturating_add(added);
        node.extra().children.extend(children.iter().map(|c| c.id));
        for child in children {
            self.add_node(t, Some(id), child, now_ms);
        }
    }

    fn maybe_start_rollback(&mut self, t: &mut Transition, now_ms: u64) {
        if self.is_failed() && self.phase == Phase::Executing && self.running == 0 {
            tracing::debug!(target: crate::targets::TREE, root = %self.root, steps = self.stack.len(), "rolling back tree");
            // A step that failed and was not recorded (retried or paused) may have left
            // effects: undo it first, as recovery does for a step cut off by a crash.
            let dirty: Vec<ProcId> = self
                .nodes
                .iter()
                .filter(|(_, n)| n.steering.dirty && !n.state.is_finished())
                .map(|(&id, _)| id)
                .collect();
            self.roll_back_from(dirty, t, now_ms);
        }
    }

    /// Starts the failed tree's rollback: first the steps `unrecorded` procedures may
    /// have run without a record (each gets an unrecorded rollback), then the recorded
    /// ones, newest first.
    fn roll_back_from(&mut self, unrecorded: Vec<ProcId>, t: &mut Transition, now_ms: u64) {
        for id in unrecorded {
            self.stack.push(StackEntry {
                id,
                recorded: false,
            });
        }
        self.phase = Phase::RollingBack;
        #[cfg(feature = "simulation")]
        if crate::mutation::on(crate::mutation::Mutation::RollbackOutOfOrder) {
            self.reverse_stack();
        }
        self.next_rollback(t, now_ms);
    }

    /// The `RollbackOutOfOrder` mutation: the stack turned over, oldest step on top,
    /// with every node's `stack_indexes` following its entries.
    #[cfg(feature = "simulation")]
    fn reverse_stack(&mut self) {
        self.stack.reverse();
        let entries: Vec<(usize, ProcId)> = (self.stack.iter().enumerate())
            .filter(|(_, e)| e.recorded)
            .map(|(at, e)| (at, e.id))
            .collect();
        for &(_, id) in &entries {
            self.node_mut(id).stack_indexes.clear();
        }
        for (at, id) in entries {
            let at = u32::try_from(at).unwrap_or(u32::MAX);
            self.node_mut(id).stack_indexes.push(at);
        }
    }

    fn next_rollback(&mut self, t: &mut Transition, now_ms: u64) {
        while let Some(&top) = self.stack.last() {
            if self.nodes[&top.id].state == ProcState::Success {
                self.pop_step(top.id);
                continue;
            }
            if self.nodes[&top.id].state == ProcState::RollbackPaused {
                // Recovered so: the rollback waits for an operator's continue.
                return;
            }
            let of = self.rollback_of_top();
            t.actions.push(Action::Rollback { id: top.id, of });
            return;
        }
        self.finish(t, now_ms);
    }

    /// The root is SUCCESS, or the stack is empty after a rollback: write the root's
    /// final record, delete the rest of the tree, stop every actor, report the result.
    fn finish(&mut self, t: &mut Transition, now_ms: u64) {
        let root = self.root;
        let result = match self.failure.as_deref().cloned() {
            None => Ok(()),
            Some(failure) => {
                let node = self.node_mut(root);
                node.state = ProcState::RolledBack;
                node.failure = Some(Box::new(failure.clone()));
                Err(failure)
            }
        };
        self.phase = Phase::Finished;
        // The final record supersedes the one this transition holds for the root (its last
        // step, or its last rollback) and keeps that state with the result: an operator
        // (or a verifier) can read what the procedure was, until its result is evicted.
        let mut data = Vec::new();
        t.persist.retain_mut(|op| match op {
            StoreOp::Update(r) if r.id == root => {
                data = std::mem::take(&mut r.data);
                false
            }
            _ => true,
        });
        self.node_mut(root).stack_indexes.clear();
        t.push_op(StoreOp::Update(self.record(root, data, now_ms)));
        for (&id, node) in self.nodes.iter_mut() {
            if id != root {
                t.push_op(StoreOp::Delete(id));
            }
            if !node.stopped {
                node.stopped = true;
                if node.state != ProcState::Success {
                    node.state = ProcState::RolledBack;
                }
                t.actions.push(Action::Stop(id));
            }
        }
        t.actions.push(Action::Finished(result.map_err(Box::new)));
    }

    fn persist_update(&self, t: &mut Transition, id: ProcId, data: Vec<u8>, now_ms: u64) {
        t.push_op(StoreOp::Update(self.record(id, data, now_ms)));
    }

    fn record(&self, id: ProcId, data: Vec<u8>, now_ms: u64) -> ProcRecord {
        let node = &self.nodes[&id];
        ProcRecord {
            id,
            parent: node.parent,
            root: self.root,
            type_name: std::borrow::Cow::Borrowed(node.type_name),
            state: node.state,
            stack_indexes: node.stack_indexes.clone(),
            failure: node.failure.clone(),
            failure_seq: node.failure_seq(),
            submitted_ms: node.submitted_ms,
            updated_ms: now_ms,
            wake_at_ms: node.wake_at_ms,
            event: node.event.as_deref().map(str::to_string),
            data,
            locks: node.locks.as_deref().cloned(),
            deadline_ms: node.deadline_ms,
            nonce: node.extra.as_ref().and_then(|e| e.nonce).map(|n| n.nonce),
            result: node.extra.as_ref().and_then(|e| e.result.clone()),
            bypassed: node.bypassed,
            steering: node.steering.clone(),
            nonce_fingerprint: node.extra.as_ref().and_then(|e| e.nonce?.fingerprint),
        }
    }
}

impl fmt::Display for Transition {
    /// A compact trace for tests: `persist U2:WAITING[1] I3 | spawn 3, run 3`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut ops = Vec::new();
        for op in &self.persist {
            ops.push(match op {
                StoreOp::Insert(r) => format!("I{}", r.id),
                StoreOp::Update(r) => format!("U{}:{}{:?}", r.id, r.state, r.stack_indexes),
                StoreOp::Delete(id) => format!("D{id}"),
            });
        }
        let mut acts = Vec::new();
        for a in &self.actions {
            acts.push(match a {
                Action::Spawn(id) => format!("spawn {id}"),
                Action::Enqueue {
                    id,
                    place: Place::Front,
                } => format!("run {id} now"),
                Action::Enqueue {
                    id,
                    place: Place::Back,
                } => format!("run {id}"),
                Action::Enqueue {
                    id,
                    place: Place::Yielded,
                } => format!("run {id} after others"),
                Action::Resume(id) => format!("resume {id}"),
                Action::Release(id) => format!("release {id}"),
                Action::Withdraw(id) => format!("withdraw {id}"),
                Action::Reset { id, .. } => format!("reset {id}"),
                Action::Paused { id, .. } => format!("paused {id}"),
                Action::Stop(id) => format!("stop {id}"),
                Action::Rollback { id, of } => {
                    let mut s = format!("rollback {id}");
                    if of.undo != Undo::Completed {
                        s = format!("{s} {}", of.undo);
                    }
                    if !of.recorded {
                        s.push_str(" unrecorded");
                    }
                    s
                }
                Action::RetryRollback { id, delay_ms, .. } => format!("retry {id} in {delay_ms}"),
                Action::WakeAt { id, at_ms } => format!("wake {id} at {at_ms}"),
                Action::SuspendOn { id, event } => format!("suspend {id} on {event}"),
                Action::Finished(Ok(())) => "finished ok".to_string(),
                Action::Finished(Err(e)) => format!("finished err {}:{}", e.proc, e.error),
                Action::Count(Count::Failed { id, aborted: false }) => format!("failed {id}"),
                Action::Count(Count::Failed { id, aborted: true }) => format!("aborted {id}"),
                Action::Count(Count::StepRetry(id)) => format!("retried {id}"),
                Action::Count(Count::RollbackRetry(id)) => format!("rollback retried {id}"),
            });
        }
        write!(f, "{} | {}", ops.join(" "), acts.join(", "))
    }
}

/// How a step's outcome is named in errors: as the [`Flow`](crate::Flow) it came from.
fn outcome_name(outcome: &StepOutcome) -> &'static str {
    match outcome {
        StepOutcome::Done | StepOutcome::Children(_) => "Flow::Done",
        StepOutcome::MoreToDo { .. } => "Flow::MoreToDo",
        StepOutcome::Spawn(_) => "Flow::WaitAny",
        StepOutcome::Suspend(_) => "Flow::Suspend",
        StepOutcome::SleepUntil(_) => "Flow::SleepUntil",
        StepOutcome::Yield => "Flow::Yield",
        StepOutcome::Failed(_) => "an error",
        StepOutcome::Skipped | StepOutcome::Paused => "no step",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn actions_and_nodes_stay_small() {
        // Every transition carries a `Vec` of actions, and a recovered tree keeps its
        // start-up transition until its actor starts (500 000 trees: 175 MB more at
        // 112 bytes an action, before the rare payloads were boxed).
        assert!(std::mem::size_of::<Action>() <= 40);
        // Every live procedure, idle or not, holds a node (208 bytes before its locks
        // were boxed).
        let node = std::mem::size_of::<Node>();
        assert!(node <= 168, "a node is {node} bytes");
    }

    /// One event fed to the root stack in a test script.
    enum Ev {
        Step(u64, StepOutcome),
        Fail(u64, ProcError),
        Wake(u64),
        RolledBack(u64, Result<(), &'static str>),
    }
    use Ev::*;

    fn new(id: u64, data: Vec<u8>, locks: Option<LockClaim>) -> NewChild {
        NewChild {
            id: ProcId(id),
            type_name: "t",
            data,
            locks,
            deadline_ms: None,
            nonce: None,
        }
    }

    fn kids(ids: &[u64]) -> StepOutcome {
        StepOutcome::Children(
            ids.iter()
                .map(|&id| NewChild {
                    locks: None,
                    deadline_ms: None,
                    nonce: None,
                    id: ProcId(id),
                    type_name: "t",
                    data: vec![],
                })
                .collect(),
        )
    }
    fn more() -> StepOutcome {
        StepOutcome::MoreToDo { yield_after: false }
    }
    fn err(msg: &str) -> StepOutcome {
        StepOutcome::Failed(ProcError::failed(msg))
    }

    /// Submits root 1, feeds the events, and compares each transition's trace.
    fn check(events: Vec<Ev>, expected: &[&str]) {
        let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
        let mut traces = vec![t.to_string()];
        for ev in events {
            let t = match ev {
                Step(id, outcome) => rs.on_step(
                    StepReport {
                        id: ProcId(id),
                        outcome,
                        data: vec![1],
                        result: None,
                        irreversible: false,
                        on_error: None,
                    },
                    0,
                ),
                Fail(id, e) => rs.on_fail(ProcId(id), e, vec![1], 0),
                Wake(id) => rs.on_wake(ProcId(id)),
                RolledBack(id, r) => rs.on_rolled_back(
                    ProcId(id),
                    r.map(|()| vec![1]).map_err(|e| RollbackFailure {
                        error: ProcError::failed(e),
                        policy: FailurePolicy::Rollback,
                        data: vec![1],
                        limit: Some(2),
                    }),
                    0,
                ),
            };
            traces.push(t.to_string());
        }
        assert_eq!(traces, expected);
    }

    #[test]
    fn single_procedure_runs_to_success() {
        check(
            vec![Step(1, more()), Step(1, StepOutcome::Done)],
            &[
                "I1 | spawn 1, run 1",
                "U1:RUNNABLE[0] | run 1 now",
                "U1:SUCCESS[] | stop 1, finished ok",
            ],
        );
    }

    #[test]
    fn chain_failure_rolls_back_newest_first() {
        check(
            vec![
                Step(1, kids(&[2])),
                Step(2, kids(&[3])),
                Step(3, err("boom")),
                RolledBack(3, Ok(())),
                RolledBack(2, Ok(())),
                RolledBack(1, Ok(())),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 | spawn 2, run 2",
                "U2:WAITING[1] I3 | spawn 3, run 3",
                "U3:FAILED[2] | failed 3, rollback 3 failed",
                "U3:ROLLEDBACK[] | stop 3, rollback 2",
                "U2:ROLLEDBACK[] | stop 2, rollback 1",
                "U1:ROLLEDBACK[] D2 D3 | stop 1, finished err 3:boom",
            ],
        );
    }

    #[test]
    fn successful_child_is_not_rolled_back() {
        check(
            vec![
                Step(1, kids(&[2])),
                Step(2, StepOutcome::Done),
                Step(1, err("parent failed")),
                RolledBack(1, Ok(())),
                RolledBack(1, Ok(())),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 | spawn 2, run 2",
                "U2:SUCCESS[1] | stop 2, run 1 now",
                "U1:FAILED[0, 2] | failed 1, rollback 1 failed",
                // Entry 1 (the child's) is skipped.
                "U1:FAILED[0] | rollback 1",
                "U1:ROLLEDBACK[] D2 | stop 1, finished err 1:parent failed",
            ],
        );
    }

    #[test]
    fn rollback_waits_until_nothing_runs() {
        // Child 3 fails while its sibling 2 is still running a step; rollback starts only
        // after 2 reports, and 2's further steps are not queued.
        check(
            vec![
                Step(1, kids(&[2, 3])),
                Step(3, err("x")),
                Step(2, more()),
                RolledBack(2, Ok(())),
                RolledBack(3, Ok(())),
                RolledBack(1, Ok(())),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 I3 | spawn 2, run 2, spawn 3, run 3",
                "U3:FAILED[1] | failed 3",
                "U2:RUNNABLE[2] | rollback 2",
                "U2:ROLLEDBACK[] | stop 2, rollback 3 failed",
                "U3:ROLLEDBACK[] | stop 3, rollback 1",
                "U1:ROLLEDBACK[] D2 D3 | stop 1, finished err 3:x",
            ],
        );
    }

    #[test]
    fn abort_of_waiting_parent_and_skipped_steps() {
        check(
            vec![
                Step(1, kids(&[2])),
                Fail(1, ProcError::Aborted),
                Step(2, StepOutcome::Skipped),
                RolledBack(1, Ok(())),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 | spawn 2, run 2",
                "U1:FAILED[0] | aborted 1",
                " | rollback 1",
                "U1:ROLLEDBACK[] D2 | stop 1, stop 2, finished err 1:aborted by operator",
            ],
        );
    }

    #[test]
    fn yield_is_not_persisted_nor_a_step() {
        check(
            vec![Step(1, StepOutcome::Yield), Step(1, StepOutcome::Done)],
            &[
                "I1 | spawn 1, run 1",
                " | run 1 after others",
                "U1:SUCCESS[] | stop 1, finished ok",
            ],
        );
    }

    #[test]
    fn empty_children_is_done() {
        check(
            vec![Step(1, kids(&[]))],
            &["I1 | spawn 1, run 1", "U1:SUCCESS[] | stop 1, finished ok"],
        );
    }

    #[test]
    fn sleep_and_suspend_wait_for_wake() {
        check(
            vec![
                Step(1, StepOutcome::SleepUntil(500)),
                Wake(1),
                Wake(1),
                Step(1, StepOutcome::Suspend("ev".into())),
                Wake(1),
                Step(1, StepOutcome::Done),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING_TIMEOUT[0] | wake 1 at 500",
                " | run 1",
                // A second wake of a runnable procedure is ignored.
                " | ",
                "U1:WAITING[0, 1] | suspend 1 on ev",
                " | run 1",
                "U1:SUCCESS[] | stop 1, finished ok",
            ],
        );
    }

    /// A step report of `id` that failed with `policy`, its state before being `[9]`.
    fn failed_with(id: u64, policy: FailurePolicy) -> StepReport {
        StepReport {
            id: ProcId(id),
            outcome: err("boom"),
            data: vec![1],
            result: None,
            irreversible: false,
            on_error: Some(OnError {
                policy,
                before: vec![9],
                retry: None,
            }),
        }
    }

    fn done(id: u64, outcome: StepOutcome, irreversible: bool) -> StepReport {
        StepReport {
            id: ProcId(id),
            outcome,
            data: vec![1],
            result: None,
            irreversible,
            on_error: None,
        }
    }

    fn rollback_failed(policy: FailurePolicy) -> Result<Vec<u8>, RollbackFailure> {
        Err(RollbackFailure {
            error: ProcError::failed("stuck"),
            policy,
            data: vec![7],
            limit: Some(2),
        })
    }

    /// A failed rollback step is retried under its policy (the default's limit here is
    /// 2), unless its error is marked terminal: then its procedure is ROLLBACK_PAUSED
    /// at once, whatever the policy.
    #[test]
    fn a_rollback_error_marked_terminal_pauses_at_once() {
        let cases = [
            ("unmarked", ProcError::failed("stuck"), "retry 1"),
            (
                "retryable",
                ProcError::retryable(ProcError::failed("stuck")),
                "retry 1",
            ),
            (
                "terminal",
                ProcError::terminal(ProcError::failed("gone")),
                "paused 1",
            ),
        ];
        for policy in [
            FailurePolicy::Rollback,
            FailurePolicy::RetryThenRollback {
                times: 3,
                backoff_ms: 1,
            },
        ] {
            for (case, error, want) in cases.clone() {
                let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
                rs.on_step(failed_with(1, FailurePolicy::Rollback), 1);
                let failed = Err(RollbackFailure {
                    error,
                    policy,
                    data: vec![7],
                    limit: Some(2),
                });
                let t = rs.on_rolled_back(ProcId(1), failed, 2).to_string();
                assert!(t.contains(want), "{policy:?}, {case}: {t}");
            }
        }
    }

    #[test]
    fn a_retried_step_runs_again_from_its_recorded_state_then_rolls_back() {
        let policy = FailurePolicy::RetryThenRollback {
            times: 1,
            backoff_ms: 100,
        };
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        let t = rs.on_step(failed_with(1, policy), 1000);
        assert_eq!(
            t.to_string(),
            "U1:WAITING_TIMEOUT[] | retried 1, reset 1, wake 1 at 1033"
        );
        let StoreOp::Update(r) = &t.persist[0] else {
            panic!("{t}")
        };
        assert_eq!(
            (r.steering.retries, r.steering.dirty, &r.data[..]),
            (1, true, &[9][..])
        );
        assert_eq!(rs.on_wake(ProcId(1)).to_string(), " | run 1");
        // Retries spent: this failure is recorded and rolled back, once.
        let t = rs.on_step(failed_with(1, policy), 2000);
        assert_eq!(t.to_string(), "U1:FAILED[0] | failed 1, rollback 1 failed");
        let t = rs.on_rolled_back(ProcId(1), Ok(vec![1]), 2001);
        assert_eq!(
            t.to_string(),
            "U1:ROLLEDBACK[] | stop 1, finished err 1:boom"
        );
    }

    #[test]
    fn a_failed_steps_error_kind_says_whether_it_is_retried_first() {
        use crate::procedure::ErrorKind;
        let failed = |error: ProcError, policy, retry: Option<RetryPolicy>| {
            let mut report = failed_with(1, policy);
            report.outcome = StepOutcome::Failed(error);
            if let Some(on_error) = report.on_error.as_mut() {
                on_error.retry = retry.map(Box::new);
            }
            report
        };
        let mark = |kind| {
            let boom = ProcError::failed("boom");
            match kind {
                Some(ErrorKind::Retryable) => ProcError::retryable(boom),
                Some(ErrorKind::Terminal) => ProcError::terminal(boom),
                _ => boom,
            }
        };
        let step = RetryPolicy::new(2).backoff_ms(1_000).max_delay_ms(10);
        let retry_rb = FailurePolicy::RetryThenRollback {
            times: 1,
            backoff_ms: 1,
        };
        // (policy, kind, the step's retry policy, irreversible: state after each failure
        // until it stops retrying)
        let cases = [
            (
                FailurePolicy::Rollback,
                None,
                Some(step),
                false,
                vec![ProcState::Failed],
            ),
            (
                FailurePolicy::Rollback,
                Some(ErrorKind::Retryable),
                Some(step),
                false,
                vec![
                    ProcState::WaitingTimeout,
                    ProcState::WaitingTimeout,
                    ProcState::Failed,
                ],
            ),
            (
                FailurePolicy::Rollback,
                Some(ErrorKind::Retryable),
                Some(step),
                true,
                vec![
                    ProcState::WaitingTimeout,
                    ProcState::WaitingTimeout,
                    ProcState::Paused,
                ],
            ),
            (
                FailurePolicy::Pause,
                Some(ErrorKind::Retryable),
                None,
                false,
                [vec![ProcState::WaitingTimeout; 5], vec![ProcState::Paused]].concat(),
            ),
            (
                retry_rb,
                None,
                None,
                false,
                vec![ProcState::WaitingTimeout, ProcState::Failed],
            ),
            (
                retry_rb,
                Some(ErrorKind::Terminal),
                None,
                false,
                vec![ProcState::Failed],
            ),
        ];
        for (policy, kind, retry, irreversible, states) in cases {
            let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
            if irreversible {
                let more = StepOutcome::MoreToDo { yield_after: false };
                rs.on_step(done(1, more, true), 1);
            }
            let now = 100;
            for (attempt, expected) in states.iter().enumerate() {
                let case = format!("{policy:?} {kind:?} {retry:?} attempt {attempt}");
                let t = rs.on_step(failed(mark(kind), policy, retry), now);
                assert_eq!(rs.state_of(ProcId(1)), Some(*expected), "{case}: {t}");
                if *expected == ProcState::WaitingTimeout {
                    // Within the step's longest backoff when it set one.
                    let at = t.actions.iter().find_map(|a| match a {
                        Action::WakeAt { at_ms, .. } => Some(*at_ms),
                        _ => None,
                    });
                    let most = now + retry.map_or(30_000, |r| r.max_delay_ms);
                    assert!(at.is_some_and(|at| at <= most), "{case}: {t}");
                    rs.on_wake(ProcId(1));
                }
                if *expected == ProcState::Paused {
                    // What paused it: the retrying policy it was decided by (past
                    // the point of no return, one that would have rolled back).
                    let StoreOp::Update(r) = &t.persist[0] else {
                        panic!("{case}: {t}")
                    };
                    let paused = r.steering.paused.as_deref().expect("paused");
                    assert_eq!(paused.retries, states.len() as u32 - 1, "{case}");
                    let retried = |times| match paused.policy {
                        Some(FailurePolicy::RetryThenPause { times: t, .. }) => t == times,
                        Some(FailurePolicy::RetryThenRollback { times: t, .. }) => {
                            irreversible && t == times
                        }
                        _ => false,
                    };
                    assert!(retried(paused.retries), "{case}: {paused:?}");
                }
            }
        }
    }

    #[test]
    fn a_paused_procedure_is_continued_or_rolled_back_by_an_operator() {
        // Continued: the step runs again and the procedure goes on.
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        let t = rs.on_step(failed_with(1, FailurePolicy::Pause), 10);
        assert_eq!(t.to_string(), "U1:PAUSED[] | paused 1, reset 1");
        assert_eq!(rs.state_of(ProcId(1)), Some(ProcState::Paused));
        assert!(rs.on_wake(ProcId(1)).actions.is_empty(), "nothing wakes it");
        let t = rs.on_continue(ProcId(1), 20).unwrap();
        assert_eq!(t.to_string(), "U1:RUNNABLE[] | run 1");
        let StoreOp::Update(r) = &t.persist[0] else {
            panic!("{t}")
        };
        assert_eq!((&r.data[..], r.steering.paused.is_none()), (&[9][..], true));
        let t = rs.on_step(done(1, StepOutcome::Done, false), 30);
        assert_eq!(t.to_string(), "U1:SUCCESS[] | stop 1, finished ok");

        // Rolled back: the failed step, which may have left effects, is undone first
        // (unrecorded), then the recorded ones.
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(
            done(1, StepOutcome::MoreToDo { yield_after: false }, false),
            1,
        );
        rs.on_step(failed_with(1, FailurePolicy::Pause), 2);
        assert!(rs.on_continue(ProcId(2), 3).is_err());
        let t = rs.on_operator_rollback(ProcId(1), 3).unwrap();
        assert_eq!(
            t.to_string(),
            "U1:FAILED[0] | aborted 1, rollback 1 failed unrecorded"
        );
        let t = rs.on_rolled_back(ProcId(1), Ok(vec![1]), 4);
        assert_eq!(t.to_string(), "U1:FAILED[0] | rollback 1");
        let t = rs.on_rolled_back(ProcId(1), Ok(vec![1]), 5);
        assert_eq!(
            t.to_string(),
            "U1:ROLLEDBACK[] | stop 1, finished err 1:aborted by operator"
        );
    }

    #[test]
    fn a_rollback_that_gives_up_pauses_until_continued() {
        let policy = FailurePolicy::RetryThenPause {
            times: 1,
            backoff_ms: 50,
        };
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(failed_with(1, FailurePolicy::Rollback), 1);
        let t = rs.on_rolled_back(ProcId(1), rollback_failed(policy), 2);
        assert_eq!(
            t.to_string(),
            "U1:FAILED[0] | rollback retried 1, retry 1 in 34"
        );
        let t = rs.on_rolled_back(ProcId(1), rollback_failed(policy), 3);
        assert_eq!(t.to_string(), "U1:ROLLBACK_PAUSED[0] | paused 1");
        let refusal = rs.rollback_refusal(ProcId(1)).unwrap();
        assert!(refusal.contains("continue it instead"), "{refusal}");
        let t = rs.on_continue(ProcId(1), 4).unwrap();
        assert_eq!(t.to_string(), "U1:FAILED[0] | rollback 1 failed");
        let t = rs.on_rolled_back(ProcId(1), Ok(vec![1]), 5);
        assert_eq!(
            t.to_string(),
            "U1:ROLLEDBACK[] | stop 1, finished err 1:boom"
        );
    }

    #[test]
    fn a_parent_paused_while_its_children_run_recovers_and_waits_for_them() {
        let mut latest = std::collections::BTreeMap::<ProcId, ProcRecord>::new();
        let mut keep = |t: &Transition| {
            for op in &t.persist {
                if let StoreOp::Insert(r) | StoreOp::Update(r) = op {
                    latest.insert(r.id, r.clone());
                }
            }
        };
        let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
        keep(&t);
        keep(&rs.on_step(done(1, kids(&[2]), true), 1));
        // Past the point of no return its timeout pauses it at once, child running.
        let t = rs.on_fail(ProcId(1), ProcError::TimedOut { timeout_ms: 5 }, vec![1], 2);
        assert_eq!(t.to_string(), "U1:PAUSED[0] | paused 1, reset 1");
        keep(&t);
        // What the log holds then recovers: the parent stays paused, the child runs.
        let records: Vec<ProcRecord> = latest.values().cloned().collect();
        let (_, start) =
            RootStack::recover(&records, |_| Some("t"), &|_| true, 3).expect("recovers");
        assert_eq!(start.to_string(), " | spawn 1, spawn 2, run 2");
        // Continued while the child runs, it waits for it; the child's end wakes it.
        let t = rs.on_continue(ProcId(1), 4).unwrap();
        assert_eq!(t.to_string(), "U1:WAITING[0] | ");
        let t = rs.on_step(done(2, StepOutcome::Done, false), 5);
        assert!(t.to_string().ends_with("stop 2, run 1 now"), "{t}");
    }

    #[test]
    fn a_procedure_at_the_most_recorded_steps_fails_its_next_step() {
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        for step in 0..MAX_RECORDED_STEPS - 1 {
            let t = rs.on_step(done(1, more(), false), 1);
            assert_eq!(t.actions.len(), 1, "step {step}: {t}");
        }
        assert_eq!(rs.steps_of(ProcId(1)), MAX_RECORDED_STEPS - 1);
        // The step past the last recordable one fails instead, whatever it returned,
        // and its failure is recorded as that last step.
        let t = rs.on_step(done(1, StepOutcome::Done, false), 2);
        assert!(t.to_string().starts_with("U1:FAILED"), "{t}");
        assert_eq!(rs.steps_of(ProcId(1)), MAX_RECORDED_STEPS);
        let StoreOp::Update(r) = &t.persist[0] else {
            panic!("{t}")
        };
        let failure = r.failure.as_ref().expect("failed");
        assert!(
            failure
                .error
                .to_string()
                .contains("the most a procedure may"),
            "{failure:?}"
        );
        // Its record still reads back.
        let bytes = rmp_serde::to_vec_named(r).unwrap();
        let back: ProcRecord = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back.stack_indexes.len(), MAX_RECORDED_STEPS);

        // Past a point of no return (its first step), that failure pauses it instead.
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(done(1, more(), true), 1);
        for _ in 1..MAX_RECORDED_STEPS - 1 {
            rs.on_step(done(1, more(), false), 1);
        }
        let t = rs.on_step(done(1, StepOutcome::Done, false), 2);
        assert!(t.to_string().starts_with("U1:PAUSED"), "{t}");
        assert_eq!(rs.steps_of(ProcId(1)), MAX_RECORDED_STEPS - 1);
    }

    #[test]
    fn past_the_point_of_no_return_a_failure_pauses_waiting_now_and_runnable_at_its_step() {
        // Waiting for an event: paused now.
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(done(1, StepOutcome::Suspend("e".into()), true), 1);
        let t = rs.on_fail(ProcId(1), ProcError::TimedOut { timeout_ms: 5 }, vec![7], 2);
        assert!(t.to_string().starts_with("U1:PAUSED"), "{t}");
        // It keeps its event (the root stack unsuspends it when the pause is performed),
        // and a continue puts it back to waiting.
        assert_eq!(rs.event_of(ProcId(1)), Some("e"));
        let t = rs.on_continue(ProcId(1), 3).unwrap();
        assert_eq!(t.to_string(), "U1:WAITING[0] | suspend 1 on e");

        // RUNNABLE: its step is queued (perhaps behind a lock, which it stops waiting
        // for: a holder may never let go), so nothing changes until that step comes
        // back skipped; then it pauses, for the failure's reason.
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(done(1, more(), true), 1);
        let t = rs.on_fail(ProcId(1), ProcError::TimedOut { timeout_ms: 5 }, vec![7], 2);
        assert_eq!(t.to_string(), " | withdraw 1");
        assert_eq!(rs.state_of(ProcId(1)), Some(ProcState::Runnable));
        let t = rs.on_step(done(1, StepOutcome::Skipped, false), 3);
        assert!(t.to_string().starts_with("U1:PAUSED"), "{t}");
        let why = t.actions.iter().find_map(|a| match a {
            Action::Paused { why, .. } => why.error.clone(),
            _ => None,
        });
        assert_eq!(why, Some(ProcError::TimedOut { timeout_ms: 5 }));
        // Continued, it runs that step.
        let t = rs.on_continue(ProcId(1), 4).unwrap();
        assert!(t.to_string().contains("run 1"), "{t}");
    }

    #[test]
    fn a_parent_whose_children_all_finished_can_be_paused_offline() {
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(done(1, kids(&[2]), false), 1);
        rs.on_step(done(2, StepOutcome::Done, false), 2);
        let t = rs.on_offline_pause(ProcId(1), vec![5], 3).unwrap();
        assert!(t.to_string().starts_with("U1:PAUSED"), "{t}");
    }

    #[test]
    fn operator_commands_in_each_state_are_done_or_refused_saying_why() {
        // Pause, continue, rollback, (online) bypass, and pause on a stopped engine.
        type Setup = fn() -> (RootStack, u64);
        fn submit() -> RootStack {
            RootStack::submit(new(1, vec![], None), 0).0
        }
        /// Root 1's first step failed under `policy`.
        fn failed(policy: FailurePolicy) -> RootStack {
            let mut rs = submit();
            rs.on_step(failed_with(1, policy), 1);
            rs
        }
        /// Root 1 started children 2 and 3.
        fn parent() -> RootStack {
            let mut rs = submit();
            rs.on_step(done(1, kids(&[2, 3]), false), 1);
            rs
        }
        const RETRY: FailurePolicy = FailurePolicy::RetryThenRollback {
            times: 1,
            backoff_ms: 100,
        };
        // Each command's expected outcome (pause, continue, rollback, bypass, offline
        // pause): `""`
        // done, else a part of the refusal. An operator's rollback of a procedure that
        // is not paused is an abort (the actor layer's): here it is only not refused.
        const IDLE_ONLY: &str = "only a waiting or paused procedure can be bypassed";
        const CHILDREN: &str = "waits for its children";
        let cases: [(&str, Setup, [&str; 5]); 11] = [
            (
                "runnable",
                || (submit(), 1),
                ["", "is RUNNABLE: only a PAUSED", "", IDLE_ONLY, ""],
            ),
            (
                "waiting for children",
                || (parent(), 1),
                [
                    "",
                    "is WAITING",
                    "",
                    "has unfinished children 2, 3: bypass it recursively",
                    CHILDREN,
                ],
            ),
            (
                "waiting for a retry",
                || (failed(RETRY), 1),
                ["", "is WAITING_TIMEOUT", "", "", ""],
            ),
            (
                "paused",
                || (failed(FailurePolicy::Pause), 1),
                [
                    "is PAUSED: only a runnable or waiting",
                    "",
                    "",
                    "",
                    "is PAUSED: only a runnable or waiting",
                ],
            ),
            (
                "rollback paused",
                || {
                    let mut rs = failed(FailurePolicy::Rollback);
                    rs.on_rolled_back(ProcId(1), rollback_failed(FailurePolicy::Pause), 2);
                    (rs, 1)
                },
                [
                    "is rolling back",
                    "",
                    "rollback is paused: continue it instead",
                    "is rolling back",
                    "is rolling back",
                ],
            ),
            (
                "rolling back",
                || (failed(FailurePolicy::Rollback), 1),
                [
                    "is rolling back",
                    "is FAILED",
                    "is already rolling back",
                    "is rolling back",
                    "is rolling back",
                ],
            ),
            (
                "paused in a tree that failed",
                || {
                    let mut rs = parent();
                    rs.on_step(failed_with(2, FailurePolicy::Pause), 2);
                    rs.on_step(failed_with(3, FailurePolicy::Rollback), 3);
                    (rs, 2)
                },
                [
                    "is rolling back",
                    "has failed: it is rolled back, not continued",
                    "is already rolling back",
                    "is rolling back",
                    "is rolling back",
                ],
            ),
            (
                "paused, its tree failed while a step still runs",
                || {
                    let mut rs = submit();
                    rs.on_step(done(1, kids(&[2, 3, 4]), false), 1);
                    rs.on_step(failed_with(2, FailurePolicy::Pause), 2);
                    rs.on_step(failed_with(3, FailurePolicy::Rollback), 3);
                    (rs, 2)
                },
                [
                    "is rolling back",
                    "has failed: it is rolled back, not continued",
                    "is already rolling back",
                    "is rolling back",
                    "is rolling back",
                ],
            ),
            (
                "finished, its tree running",
                || {
                    let mut rs = parent();
                    rs.on_step(done(2, StepOutcome::Done, false), 2);
                    (rs, 2)
                },
                [
                    "has already finished (SUCCESS)",
                    "is SUCCESS",
                    "has already finished (SUCCESS)",
                    "has already finished (SUCCESS)",
                    "has already finished (SUCCESS)",
                ],
            ),
            (
                "past its tree's point of no return",
                || {
                    let mut rs = submit();
                    rs.on_step(done(1, kids(&[2]), true), 1);
                    (rs, 2)
                },
                [
                    "",
                    "is RUNNABLE",
                    "passed its point of no return: continue instead",
                    IDLE_ONLY,
                    "",
                ],
            ),
            ("not in the tree", || (submit(), 9), ["not in tree 1"; 5]),
        ];
        let outcome = |r: Option<String>| r.unwrap_or_default();
        for (case, setup, [pause, cont, rollback, bypass, offline]) in cases {
            let (mut rs, id) = setup();
            let got = outcome(rs.on_offline_pause(ProcId(id), vec![5], 10).err());
            assert!(
                got.contains(offline) && got.is_empty() == offline.is_empty(),
                "{case}: offline pause: {got:?}"
            );
            let (mut rs, id) = setup();
            let got = outcome(
                rs.on_bypass(ProcId(id), false, BypassReach::Waiting, &|_| vec![7], 10)
                    .err(),
            );
            assert!(
                got.contains(bypass) && got.is_empty() == bypass.is_empty(),
                "{case}: bypass: {got:?}"
            );
            let (rs, id) = setup();
            let got = outcome(rs.pause_refusal(ProcId(id)));
            assert!(
                got.contains(pause) && got.is_empty() == pause.is_empty(),
                "{case}: pause: {got:?}"
            );
            let (mut rs, _) = setup();
            let got = outcome(rs.on_continue(ProcId(id), 10).err());
            assert!(
                got.contains(cont) && got.is_empty() == cont.is_empty(),
                "{case}: continue: {got:?}"
            );
            let (mut rs, _) = setup();
            let got = outcome(rs.rollback_refusal(ProcId(id)));
            assert!(
                got.contains(rollback) && got.is_empty() == rollback.is_empty(),
                "{case}: rollback: {got:?}"
            );
            // The core's own rollback does only a PAUSED procedure, and refuses what
            // the refusal above refuses, saying the same.
            let done = rs.on_operator_rollback(ProcId(id), 10);
            match (rs.state_of(ProcId(id)), &done) {
                (_, Err(why)) if !rollback.is_empty() => assert_eq!(why, &got, "{case}"),
                (Some(ProcState::Failed), Ok(_)) => assert_eq!(case, "paused"),
                (_, Err(why)) => assert!(why.contains("is not paused"), "{case}: {why}"),
                (state, Ok(t)) => panic!("{case}: rolled back from {state:?}: {t}"),
            }
        }
    }

    /// A forced bypass (HBCK2's `bypass -o`) takes a procedure queued or in a step:
    /// its step stops counting as the tree's, a lock request it may wait on is
    /// withdrawn, and it ends as any bypassed procedure does. A tree rolling back is
    /// still refused, and so is an unforced bypass of the same procedure.
    #[test]
    fn a_forced_bypass_takes_a_procedure_in_a_step() {
        fn children() -> RootStack {
            let mut rs = RootStack::submit(new(1, vec![], None), 0).0;
            rs.on_step(done(1, kids(&[2, 3]), false), 1);
            rs
        }
        let locked = || {
            let claim =
                LockClaim::declare(vec![crate::locks::Lock::exclusive("t1")], false).unwrap();
            RootStack::submit(new(1, vec![], claim), 0).0
        };
        let failed = || {
            let mut rs = children();
            rs.on_step(failed_with(2, FailurePolicy::Rollback), 2);
            rs
        };
        type Setup = fn() -> RootStack;
        // (case, setup, target, running after, the transition or the refusal)
        let cases: [(&str, Setup, u64, u32, &str); 5] = [
            (
                "a root in its first step",
                || RootStack::submit(new(1, vec![], None), 0).0,
                1,
                0,
                "U1:SUCCESS[] | stop 1, finished ok",
            ),
            (
                "a root queued behind its locks",
                locked,
                1,
                0,
                "U1:SUCCESS[] | withdraw 1, stop 1, finished ok",
            ),
            (
                "a child in a step, its sibling too",
                children,
                2,
                1,
                "U2:SUCCESS[] | stop 2",
            ),
            (
                "a tree rolling back",
                failed,
                3,
                1,
                "tree 1 is rolling back",
            ),
            (
                "the parent of children in steps, not recursive",
                children,
                1,
                2,
                "has unfinished children 2, 3",
            ),
        ];
        for (case, setup, target, running, want) in cases {
            let refused =
                setup().on_bypass(ProcId(target), false, BypassReach::Waiting, &|_| vec![], 5);
            assert!(refused.is_err(), "{case}: an unforced bypass is refused");
            let mut rs = setup();
            let got = match rs.on_bypass(ProcId(target), false, BypassReach::Forced, &|_| vec![], 5)
            {
                Ok(t) => t.to_string(),
                Err(why) => why,
            };
            assert!(got.contains(want), "{case}: {got}");
            assert_eq!(rs.running, running, "{case}: steps counted as running");
        }
    }

    #[test]
    fn past_the_point_of_no_return_failures_pause_and_rollback_is_refused() {
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(done(1, kids(&[2]), true), 1);
        assert!(rs.is_irreversible());
        // The child fails under the default policy: it pauses instead.
        let t = rs.on_step(failed_with(2, FailurePolicy::Rollback), 2);
        assert_eq!(t.to_string(), "U2:PAUSED[] | paused 2, reset 2");
        let refusal = rs.rollback_refusal(ProcId(2)).unwrap();
        assert!(refusal.contains("continue instead"), "{refusal}");
        assert!(rs.on_operator_rollback(ProcId(2), 3).is_err());
        // A timeout, too.
        let t = rs.on_fail(ProcId(1), ProcError::TimedOut { timeout_ms: 5 }, vec![1], 3);
        assert_eq!(t.to_string(), "U1:PAUSED[0] | paused 1, reset 1");
        assert!(!rs.is_failed());
        let t = rs.on_continue(ProcId(2), 4).unwrap();
        assert_eq!(t.to_string(), "U2:RUNNABLE[] | run 2");
    }

    #[test]
    fn failed_rollback_is_retried_with_backoff() {
        check(
            vec![
                Step(1, err("x")),
                RolledBack(1, Err("busy")),
                RolledBack(1, Err("busy")),
                RolledBack(1, Ok(())),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:FAILED[0] | failed 1, rollback 1 failed",
                // Full jitter under backoffs of 20 and 40 ms (see `policy::decide`).
                " | rollback retried 1, retry 1 in 13",
                " | rollback retried 1, retry 1 in 31",
                "U1:ROLLEDBACK[] | stop 1, finished err 1:x",
            ],
        );
        // Past its limit (2 retries here) it is paused for an operator, never taken as
        // done.
        check(
            vec![
                Step(1, err("x")),
                RolledBack(1, Err("busy")),
                RolledBack(1, Err("busy")),
                RolledBack(1, Err("busy")),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:FAILED[0] | failed 1, rollback 1 failed",
                " | rollback retried 1, retry 1 in 13",
                " | rollback retried 1, retry 1 in 31",
                "U1:ROLLBACK_PAUSED[0] | paused 1",
            ],
        );
    }

    #[test]
    fn first_failure_is_the_result() {
        check(
            vec![
                Step(1, kids(&[2, 3])),
                Step(2, err("first")),
                Step(3, err("second")),
                RolledBack(3, Ok(())),
                RolledBack(2, Ok(())),
                RolledBack(1, Ok(())),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 I3 | spawn 2, run 2, spawn 3, run 3",
                "U2:FAILED[1] | failed 2",
                "U3:FAILED[2] | failed 3, rollback 3 failed",
                "U3:ROLLEDBACK[] | stop 3, rollback 2 failed",
                "U2:ROLLEDBACK[] | stop 2, rollback 1",
                "U1:ROLLEDBACK[] D2 D3 | stop 1, finished err 2:first",
            ],
        );
    }

    #[test]
    fn locks_held_for_life_are_recorded_and_recovered_root_first() {
        use crate::locks::Lock;
        let claim = |lock: Lock| {
            Some(LockClaim {
                locks: vec![lock],
                for_life: true,
                held: false,
            })
        };
        let (mut rs, _) = RootStack::submit(new(1, vec![], claim(Lock::exclusive("ns/t1"))), 0);
        let t = rs.on_locks_held(ProcId(1), vec![7], 5);
        assert_eq!(t.to_string(), "U1:RUNNABLE[] | resume 1");
        let StoreOp::Update(root) = &t.persist[0] else {
            panic!("{t}")
        };
        assert_eq!(root.locks.as_ref().map(|c| c.held), Some(true));
        let child = new(2, vec![], claim(Lock::exclusive("ns/t1/r1")));
        let t = rs.on_step(
            StepReport {
                id: ProcId(1),
                outcome: StepOutcome::Children(vec![child]),
                data: vec![],
                result: None,
                irreversible: false,
                on_error: None,
            },
            6,
        );
        rs.on_locks_held(ProcId(2), vec![], 7);
        let req = rs.lock_request(ProcId(2), false).expect("a request");
        assert_eq!(req.ancestors, vec![ProcId(1)]);
        assert_eq!(req.root, ProcId(1));
        assert!(rs.lock_request(ProcId(2), true).is_some_and(|r| r.rollback));
        // Rebuilt from its records, the tree hands back both holds, root first.
        let mut records = latest_records(t.persist);
        for r in &mut records {
            if let Some(c) = r.locks.as_mut() {
                c.held = true;
            }
        }
        let (back, _) =
            RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
        let held: Vec<ProcId> = back.held_locks().iter().map(|r| r.owner).collect();
        assert_eq!(held, vec![ProcId(1), ProcId(2)]);
    }

    #[test]
    fn a_finished_root_keeps_its_last_state_with_its_result() {
        let last = |t: &Transition| match t.persist.last() {
            Some(StoreOp::Update(r)) => (r.state, r.data.clone()),
            other => panic!("{other:?}"),
        };
        let (mut rs, _) = RootStack::submit(new(1, vec![1], None), 0);
        let t = rs.on_step(
            StepReport {
                id: ProcId(1),
                outcome: StepOutcome::Done,
                data: vec![9],
                result: None,
                irreversible: false,
                on_error: None,
            },
            1,
        );
        assert_eq!(t.persist.len(), 1, "{t}");
        assert_eq!(last(&t), (ProcState::Success, vec![9]));

        let (mut rs, _) = RootStack::submit(new(1, vec![1], None), 0);
        let t = rs.on_step(
            StepReport {
                id: ProcId(1),
                outcome: StepOutcome::Failed(ProcError::failed("x")),
                data: vec![2],
                result: None,
                irreversible: false,
                on_error: None,
            },
            1,
        );
        assert_eq!(t.to_string(), "U1:FAILED[0] | failed 1, rollback 1 failed");
        let t = rs.on_rolled_back(ProcId(1), Ok(vec![8]), 2);
        assert_eq!(t.persist.len(), 1, "{t}");
        assert_eq!(last(&t), (ProcState::RolledBack, vec![8]));
    }

    /// A claim on `lock` held for the procedure's life, not yet granted.
    fn for_life(lock: crate::locks::Lock) -> LockClaim {
        LockClaim {
            locks: vec![lock],
            for_life: true,
            held: false,
        }
    }

    /// A step report of `id` whose state is then `[id]`.
    fn report(id: u64, outcome: StepOutcome) -> StepReport {
        StepReport {
            id: ProcId(id),
            outcome,
            data: vec![id as u8],
            result: None,
            irreversible: false,
            on_error: None,
        }
    }

    #[test]
    fn a_skipped_holder_that_never_ran_gives_up_its_locks_in_the_record_first() {
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        let life = for_life(crate::locks::Lock::exclusive("t/r"));
        let children =
            StepOutcome::Children(vec![new(2, vec![], Some(life)), new(3, vec![], None)]);
        rs.on_step(report(1, children), 1);
        rs.on_locks_held(ProcId(2), vec![2], 2);
        rs.on_step(report(3, StepOutcome::Failed(ProcError::failed("x"))), 3);
        let t = rs.on_step(report(2, StepOutcome::Skipped), 4);
        assert!(t.to_string().starts_with("U2:RUNNABLE[]"), "{t}");
        assert!(t.to_string().contains("release 2"), "{t}");
        let StoreOp::Update(r) = &t.persist[0] else {
            panic!("{t}")
        };
        assert_eq!(r.locks.as_ref().map(|c| c.held), Some(false));
        assert_eq!(r.data, vec![2]);
    }

    #[test]
    fn a_step_a_crash_may_have_cut_off_is_undone_if_the_tree_fails_before_it_runs_again() {
        let life = for_life(crate::locks::Lock::shared("t/r"));
        // Before the crash: 1 starts 2 (which holds a lock for its life, and then runs
        // a step the crash keeps from being recorded) and 3.
        let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
        let mut persisted = t.persist;
        let children =
            StepOutcome::Children(vec![new(2, vec![], Some(life)), new(3, vec![], None)]);
        persisted.extend(rs.on_step(report(1, children), 1).persist);
        persisted.extend(rs.on_locks_held(ProcId(2), vec![2], 2).persist);
        let records = latest_records(persisted);
        // After it: both run again, and 3 fails before 2's step has run.
        let (mut rs, start) =
            RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
        let mut seen = vec![start.to_string()];
        seen.push(
            rs.on_step(report(3, StepOutcome::Failed(ProcError::failed("x"))), 11)
                .to_string(),
        );
        seen.push(rs.on_step(report(2, StepOutcome::Skipped), 12).to_string());
        seen.push(rs.on_rolled_back(ProcId(2), Ok(vec![2]), 13).to_string());
        seen.push(rs.on_rolled_back(ProcId(3), Ok(vec![3]), 14).to_string());
        seen.push(rs.on_rolled_back(ProcId(1), Ok(vec![1]), 15).to_string());
        assert_eq!(
            seen,
            [
                " | spawn 1, spawn 2, spawn 3, run 2, run 3",
                "U3:FAILED[1] | failed 3",
                // 2 keeps the lock it holds for its life: its rollback runs inside it.
                " | rollback 2 interrupted unrecorded",
                "U2:ROLLEDBACK[] | stop 2, rollback 3 interrupted",
                "U3:ROLLEDBACK[] | stop 3, rollback 1",
                "U1:ROLLEDBACK[] D2 D3 | stop 1, finished err 3:x",
            ]
        );
    }

    #[test]
    fn a_deadline_kept_going_while_paused_is_what_the_continue_records() {
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        rs.on_step(done(1, StepOutcome::Suspend("e".into()), false), 1);
        rs.on_pause_waiting(ProcId(1), vec![1], 2).expect("paused");
        // The timeout hook re-armed the deadline, changing the state.
        rs.on_deadline(ProcId(1), Some(100), vec![2], 3);
        let t = rs.on_continue(ProcId(1), 4).unwrap();
        let StoreOp::Update(r) = &t.persist[0] else {
            panic!("{t}")
        };
        assert_eq!((r.state, &r.data[..]), (ProcState::Waiting, &[2][..]));
    }

    #[test]
    fn a_procedure_recovered_waiting_may_have_run_its_next_step_unrecorded() {
        // A wake (of the timer or the event) queues the next step without a record:
        // the crash may have come in that step. If the tree fails before the step
        // runs again, its rollback undoes it first, as for a RUNNABLE one.
        for outcome in [
            StepOutcome::SleepUntil(50),
            StepOutcome::Suspend("e".into()),
        ] {
            let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
            let records = latest_records(
                t.persist
                    .into_iter()
                    .chain(rs.on_step(report(1, outcome), 1).persist),
            );
            let (mut rs, _) =
                RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
            let t = rs.on_fail(ProcId(1), ProcError::Aborted, vec![], 11);
            assert_eq!(
                t.to_string(),
                "U1:FAILED[0] | aborted 1, rollback 1 interrupted unrecorded"
            );
        }
    }

    #[test]
    fn a_recovered_rerun_wakes_a_waiter_and_makes_a_paused_one_run_when_continued() {
        // Recorded suspended on "e": woken now, it runs its next step.
        // Recorded paused while suspended: it stays paused, and continued it runs its
        // next step instead of waiting for a wake it may have missed while paused.
        for pause in [false, true] {
            let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
            let mut ops = t.persist;
            ops.extend(
                rs.on_step(report(1, StepOutcome::Suspend("e".into())), 1)
                    .persist,
            );
            if pause {
                let t = rs.on_pause_waiting(ProcId(1), vec![1], 2).expect("pauses");
                ops.extend(t.persist);
            }
            let records = latest_records(ops);
            let (mut rs, _) =
                RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
            let t = rs.on_recovered_rerun(ProcId(1));
            if !pause {
                assert_eq!(t.to_string(), " | run 1");
                continue;
            }
            assert_eq!(t.to_string(), " | ");
            assert_eq!(rs.state_of(ProcId(1)), Some(ProcState::Paused));
            let t = rs.on_continue(ProcId(1), 11).unwrap();
            assert_eq!(t.to_string(), "U1:RUNNABLE[0] | run 1");
        }
    }

    #[test]
    fn a_retried_holder_whose_retry_is_skipped_is_rolled_back_inside_its_locks() {
        let policy = FailurePolicy::RetryThenRollback {
            times: 3,
            backoff_ms: 100,
        };
        let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
        let life = for_life(crate::locks::Lock::exclusive("t/r"));
        let children =
            StepOutcome::Children(vec![new(2, vec![], Some(life)), new(3, vec![], None)]);
        rs.on_step(report(1, children), 1);
        rs.on_locks_held(ProcId(2), vec![2], 2);
        // 2's step fails and is retried; before the retry starts, 3 fails the tree.
        let retry = rs.on_step(failed_with(2, policy), 3).to_string();
        assert!(retry.starts_with("U2:WAITING_TIMEOUT[]"), "{retry}");
        assert_eq!(rs.on_wake(ProcId(2)).to_string(), " | run 2");
        rs.on_step(report(3, StepOutcome::Failed(ProcError::failed("x"))), 4);
        // The retry is skipped, but the failed attempt may have left effects: 2 keeps
        // its lock and its rollback undoes that attempt first.
        let t = rs.on_step(report(2, StepOutcome::Skipped), 5);
        assert_eq!(t.to_string(), " | rollback 2 failed unrecorded");
    }

    fn spawn(ids: &[u64]) -> StepOutcome {
        match kids(ids) {
            StepOutcome::Children(children) => StepOutcome::Spawn(children),
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_parent_that_spawns_is_woken_as_each_child_succeeds() {
        check(
            vec![
                Step(1, spawn(&[2, 3])),
                Step(2, StepOutcome::Done),
                Step(1, spawn(&[4])),
                Step(3, StepOutcome::Done),
                // Nothing new, 4 still runs: it waits.
                Step(1, spawn(&[])),
                Step(4, StepOutcome::Done),
                Step(1, StepOutcome::Done),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 I3 | spawn 2, run 2, spawn 3, run 3",
                "U2:SUCCESS[1] | stop 2, run 1 now",
                "U1:WAITING[0, 2] I4 | spawn 4, run 4",
                "U3:SUCCESS[3] | stop 3, run 1 now",
                "U1:WAITING[0, 2, 4] | ",
                "U4:SUCCESS[5] | stop 4, run 1 now",
                "U1:SUCCESS[] D2 D3 D4 | stop 1, finished ok",
            ],
        );
    }

    #[test]
    fn a_child_that_succeeds_while_its_spawning_parent_runs_wakes_it_after() {
        check(
            vec![
                Step(1, spawn(&[2, 3, 4])),
                Step(2, StepOutcome::Done),
                // 1 runs, having looked before 3 finished.
                Step(3, StepOutcome::Done),
                Step(1, spawn(&[])),
                Step(1, spawn(&[])),
                Step(4, StepOutcome::Done),
                Step(1, StepOutcome::Done),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 I3 I4 | spawn 2, run 2, spawn 3, run 3, spawn 4, run 4",
                "U2:SUCCESS[1] | stop 2, run 1 now",
                "U3:SUCCESS[2] | stop 3",
                "U1:WAITING[0, 3] | run 1 now",
                "U1:WAITING[0, 3, 4] | ",
                "U4:SUCCESS[5] | stop 4, run 1 now",
                "U1:SUCCESS[] D2 D3 D4 | stop 1, finished ok",
            ],
        );
    }

    #[test]
    fn children_after_spawn_wait_for_every_child() {
        check(
            vec![
                Step(1, spawn(&[2, 3])),
                Step(2, StepOutcome::Done),
                Step(1, kids(&[4])),
                Step(3, StepOutcome::Done),
                Step(4, StepOutcome::Done),
                Step(1, StepOutcome::Done),
            ],
            &[
                "I1 | spawn 1, run 1",
                "U1:WAITING[0] I2 I3 | spawn 2, run 2, spawn 3, run 3",
                "U2:SUCCESS[1] | stop 2, run 1 now",
                "U1:WAITING[0, 2] I4 | spawn 4, run 4",
                "U3:SUCCESS[3] | stop 3",
                "U4:SUCCESS[4] | stop 4, run 1 now",
                "U1:SUCCESS[] D2 D3 D4 | stop 1, finished ok",
            ],
        );
    }

    #[test]
    fn a_rollback_is_told_whether_its_step_completed_or_failed_and_a_restart_keeps_it() {
        // Root 1 starts 2 and 3 and is woken by 2; its second step fails (the user's
        // error) or returns Done while 3 runs (the engine refuses it: it ran to its
        // end). The rollback begins when 3 has finished.
        for (failing, undo) in [
            (err("table exists"), "rollback 1 failed"),
            (StepOutcome::Done, "rollback 1"),
        ] {
            let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
            let mut persisted = t.persist;
            persisted.extend(rs.on_step(report(1, spawn(&[2, 3])), 1).persist);
            persisted.extend(rs.on_step(report(2, StepOutcome::Done), 2).persist);
            let refused = matches!(failing, StepOutcome::Done);
            persisted.extend(rs.on_step(report(1, failing), 2).persist);
            let t = rs.on_step(report(3, StepOutcome::Done), 3);
            assert!(t.to_string().ends_with(undo), "{t}");
            persisted.extend(t.persist);
            // A restart before that rollback finishes asks for it the same way.
            let records = latest_records(persisted.clone());
            let root = records.iter().find(|r| r.id == ProcId(1)).unwrap();
            let told = if refused {
                Undo::Completed
            } else {
                Undo::Failed
            };
            assert_eq!(root.steering.failed_step, told);
            let (_, start) =
                RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
            assert!(start.to_string().ends_with(undo), "{start}");
            // Once it is undone, the step below it completed: so says its record.
            let t = rs.on_rolled_back(ProcId(1), Ok(vec![1]), 4);
            assert_eq!(t.to_string(), "U1:FAILED[0] | rollback 1");
            persisted.extend(t.persist);
            let records = latest_records(persisted);
            let (_, start) =
                RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
            assert!(start.to_string().ends_with("rollback 1"), "{start}");
        }
    }

    #[test]
    fn a_parent_woken_per_child_may_not_finish_before_its_children() {
        for (outcome, name) in [
            (StepOutcome::Done, "Flow::Done"),
            (more(), "Flow::MoreToDo"),
            (StepOutcome::Suspend("e".into()), "Flow::Suspend"),
            (StepOutcome::Children(Vec::new()), "Flow::Done"),
        ] {
            let (mut rs, _) = RootStack::submit(new(1, vec![], None), 0);
            rs.on_step(report(1, spawn(&[2, 3])), 1);
            rs.on_step(report(2, StepOutcome::Done), 2);
            let t = rs.on_step(report(1, outcome), 3);
            // Failed and recorded; the rollback waits for 3, still running.
            assert_eq!(t.to_string(), "U1:FAILED[0, 2] | failed 1", "{name}");
            let failure = rs.first_failure().expect("failed").to_string();
            assert!(
                failure.contains(&format!(
                    "procedure 1 returned {name} with 1 children unfinished"
                )),
                "{failure}"
            );
        }
    }

    /// The latest record of each procedure the ops write, as a store keeps them (the
    /// tests here delete nothing).
    fn latest_records(ops: impl IntoIterator<Item = StoreOp>) -> Vec<ProcRecord> {
        let mut records: Vec<ProcRecord> = Vec::new();
        for op in ops {
            if let StoreOp::Insert(r) | StoreOp::Update(r) = op {
                records.retain(|x| x.id != r.id);
                records.push(r);
            }
        }
        records
    }

    /// Records of a tree after `steps` (each a report), as the store would keep them.
    fn recorded(steps: Vec<(u64, StepOutcome)>) -> Vec<ProcRecord> {
        let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
        let mut ops = t.persist;
        for (id, outcome) in steps {
            ops.extend(rs.on_step(report(id, outcome), 1).persist);
        }
        latest_records(ops)
    }

    #[test]
    fn recovery_wakes_a_parent_that_spawns_for_a_child_that_succeeded() {
        // (the parent's step, whether 2 succeeded, the recovered plan)
        let cases = [
            (spawn(&[2, 3]), true, "spawn 1, spawn 3, run 1, run 3"),
            (
                spawn(&[2, 3]),
                false,
                "spawn 1, spawn 2, spawn 3, run 2, run 3",
            ),
            // Waiting for all, it is not woken before the last.
            (kids(&[2, 3]), true, "spawn 1, spawn 3, run 3"),
        ];
        for (i, (outcome, succeeded, plan)) in cases.into_iter().enumerate() {
            let mut steps = vec![(1, outcome)];
            if succeeded {
                steps.push((2, StepOutcome::Done));
            }
            let records = recorded(steps);
            let (mut rs, t) =
                RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
            assert_eq!(t.to_string(), format!(" | {plan}"), "case {i}");
            // Woken, it may have been in a step the crash cut off: a failure undoes it.
            let queued: Vec<u64> = (1..=3)
                .filter(|&id| rs.state_of(ProcId(id)) == Some(ProcState::Runnable))
                .collect();
            let mut t = rs
                .on_fail(ProcId(3), ProcError::Aborted, vec![], 11)
                .to_string();
            // Their queued steps come back skipped; then the rollback starts.
            for id in queued {
                t += &rs.on_step(report(id, StepOutcome::Skipped), 12).to_string();
            }
            // Roll back to the end, each rollback call succeeding.
            let mut last = t.clone();
            while let Some(at) = last.rfind("rollback ") {
                let id: u64 = last[at + 9..]
                    .split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("an id");
                last = rs.on_rolled_back(ProcId(id), Ok(vec![]), 13).to_string();
                t += &last;
            }
            let woken = i == 0;
            assert_eq!(t.contains("rollback 1 interrupted"), woken, "case {i}: {t}");
        }
    }

    #[test]
    fn a_failed_tree_recovered_undoes_a_spawning_parents_unrecorded_step() {
        // 1 spawned 2 and 3; 2 succeeded and woke 1; then 3 failed, and the crash
        // came before anything was rolled back.
        let records = recorded(vec![
            (1, spawn(&[2, 3])),
            (2, StepOutcome::Done),
            (3, err("x")),
        ]);
        let (_, t) = RootStack::recover(&records, |_| Some("t"), &|_| true, 10).expect("recovers");
        let plan = t.to_string();
        assert!(plan.contains("rollback 1 interrupted"), "{plan}");
    }

    #[test]
    fn a_parent_whose_only_child_failed_never_ran_again_and_gets_no_unrecorded_rollback() {
        // Its child failed and was rolled back, then the crash: woken by no child, the
        // parent (waiting for all, or per child) has no step to undo but its recorded one.
        for per_child in [false, true] {
            let (mut rs, t) = RootStack::submit(new(1, vec![], None), 0);
            let mut ops = t.persist;
            let outcome = if per_child { spawn(&[2]) } else { kids(&[2]) };
            ops.extend(rs.on_step(report(1, outcome), 1).persist);
            ops.extend(rs.on_step(report(2, err("x")), 2).persist);
            ops.extend(rs.on_rolled_back(ProcId(2), Ok(vec![]), 3).persist);
            let records = latest_records(ops);
            let (_, t) = RootStack::recover(&records, |_| Some("t"), &|_| true, 10).unwrap();
            assert_eq!(
                t.to_string(),
                " | spawn 1, rollback 1",
                "per child: {per_child}"
            );
        }
    }
}
