//! The state-machine helper: users write [`StateMachineProcedure::execute_from_state`]
//! and [`StateMachineProcedure::rollback_state`] over their own state enum, and
//! [`StateMachine`] turns that into a [`Procedure`].
//!
//! Invariant: `history` holds exactly one entry per executed (persisted) step of this
//! procedure, in order, which is also the number of entries this procedure has on its
//! root stack. Each rollback pops one entry and rolls back that state, so states roll back
//! in reverse, the failed state first.

use std::fmt::Debug;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use async_trait::async_trait;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::locks::Lock;
use crate::procedure::{
    ChildType, Context, FailurePolicy, Flow, LockState, OnTimeout, ProcError, Procedure,
};

/// A procedure written as a state machine over `Self::State` (HBase's
/// `StateMachineProcedure`). Wrap it in [`StateMachine`] to submit it.
///
/// ```
/// use proctor::{async_trait, Context, Flow, ProcError, StateContext, StateMachine,
///               StateMachineProcedure};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
/// enum Step { Prepare, Write }
///
/// #[derive(Serialize, Deserialize)]
/// struct CreateTable { name: String }
///
/// #[async_trait]
/// impl StateMachineProcedure for CreateTable {
///     type State = Step;
///     fn initial_state(&self) -> Step { Step::Prepare }
///     async fn execute_from_state(&mut self, ctx: &mut StateContext<'_, Step>, state: Step)
///         -> Result<Flow, ProcError> {
///         match state {
///             Step::Prepare => { ctx.set_next_state(Step::Write); Ok(Flow::MoreToDo) }
///             Step::Write => Ok(Flow::Done),
///         }
///     }
///     async fn rollback_state(&mut self, _ctx: &mut Context, _state: Step)
///         -> Result<(), ProcError> { Ok(()) }
/// }
///
/// let proc = StateMachine::new(CreateTable { name: "t1".into() });
/// assert_eq!(proc.cycles(), 0);
/// ```
///
/// `E` is the executor's environment, as for [`Procedure`]; the wrapper is then
/// `StateMachine<T, E>`.
#[async_trait]
pub trait StateMachineProcedure<E = ()>: Serialize + DeserializeOwned + Send + 'static
where
    E: Send + Sync + 'static,
{
    /// The user's state enum.
    type State: Copy + Eq + Debug + Serialize + DeserializeOwned + Send + Sync + 'static;

    /// The state the first step runs in.
    fn initial_state(&self) -> Self::State;

    /// Runs `state`. Move on with [`StateContext::set_next_state`]; without it the next
    /// step runs the same state again (a cycle, counted by [`StateMachine::cycles`]).
    async fn execute_from_state(
        &mut self,
        ctx: &mut StateContext<'_, Self::State, E>,
        state: Self::State,
    ) -> Result<Flow<E>, ProcError>;

    /// Undoes what running `state` did, newest state first. It is also called for the
    /// state that failed: [`Context::undoing`] then says [`Undo::Failed`](crate::Undo),
    /// and only what that run did before failing may be undone — nothing, when it
    /// failed on a check ("the table exists"), or it would undo someone else's work.
    /// [`Undo::Interrupted`](crate::Undo) marks a run a crash may have cut off. Must be
    /// idempotent: after a crash it may run again.
    async fn rollback_state(
        &mut self,
        ctx: &mut Context<E>,
        state: Self::State,
    ) -> Result<(), ProcError>;

    /// Whether an abort may be accepted while the machine is about to run `state`.
    fn is_rollback_supported(&self, _state: Self::State) -> bool {
        true
    }

    /// See [`Procedure::locks`].
    fn locks(&self) -> Vec<Lock> {
        Vec::new()
    }

    /// See [`Procedure::affinity`]: by default the resource of its first lock.
    fn affinity(&self) -> Option<String> {
        self.locks().into_iter().next().map(|lock| lock.resource)
    }

    /// See [`Procedure::acquire_lock`].
    fn acquire_lock(&mut self, _ctx: &Context<E>) -> LockState {
        LockState::Acquired
    }

    /// See [`Procedure::release_lock`].
    fn release_lock(&mut self, _ctx: &Context<E>) {}

    /// See [`Procedure::holds_lock`].
    fn holds_lock(&self) -> bool {
        false
    }

    /// See [`Procedure::before_recover`].
    fn before_recover(&mut self, _ctx: &Context<E>) {}

    /// See [`Procedure::rerun_after_recover`].
    fn rerun_after_recover(&self, _event: &str) -> bool {
        true
    }

    /// See [`Procedure::after_recover`].
    fn after_recover(&mut self, _ctx: &Context<E>) {}

    /// See [`Procedure::completion_cleanup`].
    fn completion_cleanup(&mut self, _ctx: &Context<E>) {}

    /// See [`Procedure::is_yield_after_execution`].
    fn is_yield_after_execution(&self) -> bool {
        false
    }

    /// See [`Procedure::timeout_ms`].
    fn timeout_ms(&self) -> Option<u64> {
        None
    }

    /// See [`Procedure::failure_policy`]: what a failure in `state` (its step or its
    /// rollback) leads to.
    fn failure_policy(&self, _state: Self::State, _error: &ProcError) -> FailurePolicy {
        FailurePolicy::Rollback
    }

    /// See [`Procedure::on_timeout`].
    fn on_timeout(&mut self, _ctx: &Context<E>) -> OnTimeout {
        OnTimeout::Fail
    }

    /// See [`Procedure::child_types`].
    fn child_types() -> Vec<ChildType>
    where
        Self: Sized,
    {
        Vec::new()
    }
}

/// The context of one state-machine step: a [`Context`] plus the next-state slot.
pub struct StateContext<'c, S, E = ()> {
    ctx: &'c mut Context<E>,
    next: Option<S>,
}

impl<S: Debug, E> Debug for StateContext<'_, S, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateContext")
            .field("ctx", &self.ctx)
            .field("next", &self.next)
            .finish()
    }
}

impl<S, E> StateContext<'_, S, E> {
    /// The state the next step runs in.
    pub fn set_next_state(&mut self, state: S) {
        self.next = Some(state);
    }
}

impl<S, E> Deref for StateContext<'_, S, E> {
    type Target = Context<E>;
    fn deref(&self) -> &Context<E> {
        self.ctx
    }
}

impl<S, E> DerefMut for StateContext<'_, S, E> {
    fn deref_mut(&mut self) -> &mut Context<E> {
        self.ctx
    }
}

/// A [`StateMachineProcedure`] as a [`Procedure`]: keeps the state to run next, the
/// states visited (for rollback in reverse), and the cycle count. Register it as
/// `registry.register_state_machine::<MyProc>("my_proc")`.
///
/// Stored as a MessagePack array of its own four fields (the machine, the next state,
/// the history, the cycle count), the machine inside with its field names as any
/// procedure's state. The wrapper is encoded at every step and its field names would
/// be a quarter of a small record; the named form that earlier versions wrote still
/// decodes (serde reads a struct from either form), and a field added later goes last,
/// with `#[serde(default)]`.
#[derive(Deserialize)]
#[serde(bound = "")]
pub struct StateMachine<T, E = ()>
where
    T: StateMachineProcedure<E>,
    E: Send + Sync + 'static,
{
    machine: T,
    next: Option<T::State>,
    /// Stored as `(state, times)` runs, so a machine that cycles in one state for
    /// thousands of steps keeps a small record.
    #[serde(deserialize_with = "state_runs::deserialize")]
    history: Vec<T::State>,
    cycles: u32,
    #[serde(skip)]
    env: PhantomData<fn() -> E>,
}

impl<T, E> Serialize for StateMachine<T, E>
where
    T: StateMachineProcedure<E>,
    E: Send + Sync + 'static,
{
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeTuple;
        /// The history as its runs.
        struct Runs<'a, X>(&'a [X]);
        impl<X: Copy + Eq + Serialize> Serialize for Runs<'_, X> {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                state_runs::serialize(self.0, s)
            }
        }
        let mut fields = s.serialize_tuple(4)?;
        fields.serialize_element(&self.machine)?;
        fields.serialize_element(&self.next)?;
        fields.serialize_element(&Runs(&self.history))?;
        fields.serialize_element(&self.cycles)?;
        fields.end()
    }
}

impl<T, E> Debug for StateMachine<T, E>
where
    T: StateMachineProcedure<E> + Debug,
    E: Send + Sync + 'static,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMachine")
            .field("machine", &self.machine)
            .field("next", &self.next)
            .field("history", &self.history)
            .field("cycles", &self.cycles)
            .finish()
    }
}

/// The stored form of a state machine's history: runs of one state repeated.
mod state_runs {
    use serde::de::DeserializeOwned;
    use serde::ser::SerializeSeq;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<T, S>(history: &[T], s: S) -> Result<S::Ok, S::Error>
    where
        T: Copy + Eq + Serialize,
        S: Serializer,
    {
        // Encoded at every step: the runs are counted, then written as they are found,
        // with no `Vec` built in between.
        let mut seq = s.serialize_seq(Some(runs(history).count()))?;
        for run in runs(history) {
            seq.serialize_element(&run)?;
        }
        seq.end()
    }

    /// `(state, times)` for each run of equal states (a run longer than `u32::MAX`
    /// splits).
    fn runs<T: Copy + Eq>(history: &[T]) -> impl Iterator<Item = (T, u32)> + '_ {
        let mut rest = history;
        std::iter::from_fn(move || {
            let (&state, _) = rest.split_first()?;
            let len = rest
                .iter()
                .take(u32::MAX as usize)
                .take_while(|&&s| s == state)
                .count();
            rest = &rest[len..];
            Some((state, len as u32))
        })
    }

    pub(super) fn deserialize<'de, T, D>(d: D) -> Result<Vec<T>, D::Error>
    where
        T: Copy + DeserializeOwned,
        D: Deserializer<'de>,
    {
        let runs: Vec<(T, u32)> = Vec::deserialize(d)?;
        let total: u64 = runs.iter().map(|&(_, n)| u64::from(n)).sum();
        // One entry per step run: a history far longer than a procedure may record
        // is damage, not a reason to allocate. (Twice the bound: past its point of no
        // return, a procedure at the bound pauses after each step an operator
        // continues, its state moving on without a recorded step.)
        let most = 2 * crate::record::MAX_RECORDED_STEPS as u64;
        if total > most {
            return Err(serde::de::Error::custom(format!(
                "a state history of {total} steps, more than a procedure runs ({most})"
            )));
        }
        let mut history = Vec::with_capacity(total as usize);
        for (state, times) in runs {
            history.extend(std::iter::repeat_n(state, times as usize));
        }
        Ok(history)
    }
}

impl<T, E> StateMachine<T, E>
where
    T: StateMachineProcedure<E>,
    E: Send + Sync + 'static,
{
    /// Wraps a machine that has not run yet.
    pub fn new(machine: T) -> Self {
        StateMachine {
            machine,
            next: None,
            history: Vec::new(),
            cycles: 0,
            env: PhantomData,
        }
    }

    /// The user's machine.
    pub fn machine(&self) -> &T {
        &self.machine
    }

    /// The state the next step runs in.
    pub fn current_state(&self) -> T::State {
        self.next.unwrap_or_else(|| self.machine.initial_state())
    }

    /// How many steps in a row ran the same state: a number that keeps growing is a
    /// stuck loop.
    pub fn cycles(&self) -> u32 {
        self.cycles
    }

    /// States executed and not yet rolled back, oldest first.
    pub fn history(&self) -> &[T::State] {
        &self.history
    }
}

#[async_trait]
impl<T, E> Procedure<E> for StateMachine<T, E>
where
    T: StateMachineProcedure<E>,
    E: Send + Sync + 'static,
{
    async fn execute(&mut self, ctx: &mut Context<E>) -> Result<Flow<E>, ProcError> {
        let state = self.current_state();
        self.cycles = match self.history.last() {
            Some(last) if *last == state => self.cycles.saturating_add(1),
            _ => 0,
        };
        if self.cycles > 0 && self.cycles.is_power_of_two() && self.cycles >= 64 {
            tracing::warn!(target: crate::targets::PROCEDURE, proc = %ctx.id(), ?state, cycles = self.cycles, "state machine loops in one state");
        }
        // Recorded before running so that a state that fails half-way is rolled back too.
        self.history.push(state);
        let mut sctx = StateContext { ctx, next: None };
        let result = self.machine.execute_from_state(&mut sctx, state).await;
        let next = sctx.next;
        if matches!(result, Ok(Flow::Yield)) {
            // A yield is not a recorded step: it has no root-stack entry to roll back.
            self.history.pop();
        }
        if let Some(next) = next {
            self.next = Some(next);
        } else if self.next.is_none() {
            self.next = Some(state);
        }
        result
    }

    async fn rollback(&mut self, ctx: &mut Context<E>) -> Result<(), ProcError> {
        if ctx.is_unrecorded_step() {
            // The state that was about to run when the process died: it may have
            // started, so undo it; the history is untouched (it was never recorded).
            let state = self.current_state();
            return self.machine.rollback_state(ctx, state).await;
        }
        let Some(&state) = self.history.last() else {
            return Ok(());
        };
        // Popped only once undone: a rollback that fails (or panics) keeps it, so that
        // the retry rolls back the same state.
        self.machine.rollback_state(ctx, state).await?;
        self.history.pop();
        self.next = Some(state);
        Ok(())
    }

    fn abort(&mut self, _ctx: &Context<E>) -> bool {
        self.machine.is_rollback_supported(self.current_state())
    }

    fn locks(&self) -> Vec<Lock> {
        self.machine.locks()
    }

    fn affinity(&self) -> Option<String> {
        self.machine.affinity()
    }

    fn acquire_lock(&mut self, ctx: &Context<E>) -> LockState {
        self.machine.acquire_lock(ctx)
    }

    fn release_lock(&mut self, ctx: &Context<E>) {
        self.machine.release_lock(ctx)
    }

    fn holds_lock(&self) -> bool {
        self.machine.holds_lock()
    }

    fn rerun_after_recover(&self, event: &str) -> bool {
        self.machine.rerun_after_recover(event)
    }

    fn before_recover(&mut self, ctx: &Context<E>) {
        self.machine.before_recover(ctx)
    }

    fn after_recover(&mut self, ctx: &Context<E>) {
        self.machine.after_recover(ctx)
    }

    fn completion_cleanup(&mut self, ctx: &Context<E>) {
        self.machine.completion_cleanup(ctx)
    }

    fn is_yield_after_execution(&self) -> bool {
        self.machine.is_yield_after_execution()
    }

    fn state_name(&self) -> Option<String> {
        // Between steps, the state that ran last is the one it is in (waiting for the
        // children it started, say), and the next one is where it goes.
        Some(match (self.history.last(), self.next) {
            (Some(last), Some(next)) if *last != next => format!("{last:?} (next {next:?})"),
            _ => format!("{:?}", self.current_state()),
        })
    }

    fn step_name(&self) -> Option<String> {
        Some(format!("{:?}", self.current_state()))
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.machine.timeout_ms()
    }

    fn on_timeout(&mut self, ctx: &Context<E>) -> OnTimeout {
        self.machine.on_timeout(ctx)
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        // The state that failed is the newest in the history (a step records it before
        // running; a rollback that fails keeps it).
        let state = self
            .history
            .last()
            .copied()
            .unwrap_or_else(|| self.current_state());
        self.machine.failure_policy(state, error)
    }

    fn child_types() -> Vec<ChildType> {
        T::child_types()
    }

    fn rust_type_name(&self) -> &'static str {
        std::any::type_name::<T>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::ProcId;
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context as TaskContext, Poll, Waker};

    /// Runs a future that never waits (the machines below do no IO).
    fn now<F: Future>(fut: F) -> F::Output {
        let mut fut = pin!(fut);
        match fut
            .as_mut()
            .poll(&mut TaskContext::from_waker(Waker::noop()))
        {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("test future must not wait"),
        }
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    enum S {
        A,
        B,
        C,
    }

    /// Plan: (state, next state, what the step returns); `fail` fails that state.
    #[derive(Serialize, Deserialize, Default)]
    struct Machine {
        fail: Option<S>,
        loops_in_b: u32,
        executed: Vec<S>,
        rolled_back: Vec<S>,
    }

    #[async_trait]
    impl StateMachineProcedure for Machine {
        type State = S;
        fn initial_state(&self) -> S {
            S::A
        }
        async fn execute_from_state(
            &mut self,
            ctx: &mut StateContext<'_, S>,
            state: S,
        ) -> Result<Flow, ProcError> {
            self.executed.push(state);
            if self.fail == Some(state) {
                return Err(ProcError::failed(format!("{state:?} failed")));
            }
            match state {
                S::A => ctx.set_next_state(S::B),
                S::B if self.loops_in_b > 0 => self.loops_in_b -= 1,
                S::B => ctx.set_next_state(S::C),
                S::C => return Ok(Flow::Done),
            }
            Ok(Flow::MoreToDo)
        }
        async fn rollback_state(&mut self, _ctx: &mut Context, state: S) -> Result<(), ProcError> {
            self.rolled_back.push(state);
            Ok(())
        }
        fn is_rollback_supported(&self, state: S) -> bool {
            state != S::C
        }
    }

    fn ctx() -> Context {
        Context::new(ProcId(1), None, ProcId(1), 0, std::sync::Arc::new(()))
    }

    /// Runs the machine until it finishes or fails; returns the flows' names.
    fn run(sm: &mut StateMachine<Machine>) -> Vec<String> {
        let mut out = Vec::new();
        loop {
            match now(sm.execute(&mut ctx())) {
                Ok(Flow::Done) => {
                    out.push("done".to_string());
                    return out;
                }
                Ok(flow) => out.push(format!("{flow:?}")),
                Err(e) => {
                    out.push(format!("err: {e}"));
                    return out;
                }
            }
        }
    }

    #[test]
    fn transitions_history_and_rollback_order() {
        struct Case {
            fail: Option<S>,
            loops_in_b: u32,
            flows: &'static [&'static str],
            history: &'static [S],
            cycles: u32,
        }
        let cases = [
            Case {
                fail: None,
                loops_in_b: 0,
                flows: &["MoreToDo", "MoreToDo", "done"],
                history: &[S::A, S::B, S::C],
                cycles: 0,
            },
            Case {
                fail: Some(S::B),
                loops_in_b: 0,
                flows: &["MoreToDo", "err: B failed"],
                history: &[S::A, S::B],
                cycles: 0,
            },
            Case {
                fail: None,
                loops_in_b: 2,
                flows: &["MoreToDo", "MoreToDo", "MoreToDo", "MoreToDo", "done"],
                history: &[S::A, S::B, S::B, S::B, S::C],
                cycles: 0,
            },
        ];
        for case in cases {
            let mut sm = StateMachine::new(Machine {
                fail: case.fail,
                loops_in_b: case.loops_in_b,
                ..Machine::default()
            });
            assert_eq!(run(&mut sm), case.flows, "fail={:?}", case.fail);
            assert_eq!(sm.history(), case.history);
            assert_eq!(sm.cycles(), case.cycles);
            // Roll back every recorded step: states come back newest first.
            for _ in 0..case.history.len() {
                now(sm.rollback(&mut ctx())).unwrap();
            }
            let mut expect = case.history.to_vec();
            expect.reverse();
            assert_eq!(sm.machine().rolled_back, expect);
            assert!(sm.history().is_empty());
            // A further rollback (a retry after a crash) is a no-op.
            now(sm.rollback(&mut ctx())).unwrap();
            assert_eq!(sm.machine().rolled_back.len(), case.history.len());
        }
    }

    #[test]
    fn cycles_count_steps_in_the_same_state() {
        let mut sm = StateMachine::new(Machine {
            loops_in_b: 3,
            ..Machine::default()
        });
        let mut seen = Vec::new();
        for _ in 0..4 {
            now(sm.execute(&mut ctx())).unwrap();
            seen.push(sm.cycles());
        }
        assert_eq!(seen, [0, 0, 1, 2]);
    }

    #[test]
    fn the_state_name_is_where_it_is_and_goes_and_a_step_is_named_for_what_it_runs() {
        let mut sm = StateMachine::new(Machine::default());
        assert_eq!(
            sm.state_name().as_deref(),
            Some("A"),
            "before its first step"
        );
        now(sm.execute(&mut ctx())).unwrap();
        // Between steps (waiting for children, say): in A, going to B.
        assert_eq!(sm.state_name().as_deref(), Some("A (next B)"));
        // The next step runs B, and its span says so.
        assert_eq!(sm.step_name().as_deref(), Some("B"));
    }

    #[test]
    fn abort_follows_is_rollback_supported() {
        let mut sm = StateMachine::new(Machine::default());
        assert!(sm.abort(&ctx()), "A supports rollback");
        now(sm.execute(&mut ctx())).unwrap();
        now(sm.execute(&mut ctx())).unwrap();
        assert_eq!(sm.current_state(), S::C);
        assert!(!sm.abort(&ctx()), "C does not");
    }

    #[test]
    fn state_round_trips_through_messagepack() {
        let mut sm = StateMachine::new(Machine::default());
        now(sm.execute(&mut ctx())).unwrap();
        let bytes = crate::procedure::EncodeState::encode_state(&sm).unwrap();
        let back: StateMachine<Machine> = rmp_serde::from_slice(&bytes).unwrap();
        assert_eq!(back.history(), &[S::A]);
        assert_eq!(back.current_state(), S::B);
    }

    /// The wrapper's fields by position, the machine's by name; and the named form
    /// earlier versions wrote still decodes.
    #[test]
    fn the_wrappers_fields_are_positional_and_the_named_form_still_decodes() {
        let mut sm = StateMachine::new(Machine {
            loops_in_b: 2,
            ..Machine::default()
        });
        now(sm.execute(&mut ctx())).unwrap();
        let bytes = crate::procedure::EncodeState::encode_state(&sm).unwrap();
        // A fixarray of 4, then the machine as a fixmap of its 4 named fields.
        assert_eq!(bytes[..2], [0x94, 0x84]);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("loops_in_b") && !text.contains("history"));

        #[derive(Serialize)]
        struct Named<'a> {
            machine: &'a Machine,
            next: Option<S>,
            history: Vec<(S, u32)>,
            cycles: u32,
        }
        let old = rmp_serde::to_vec_named(&Named {
            machine: &sm.machine,
            next: sm.next,
            history: vec![(S::A, 1)],
            cycles: sm.cycles,
        })
        .unwrap();
        for bytes in [bytes, old] {
            let back: StateMachine<Machine> = rmp_serde::from_slice(&bytes).unwrap();
            assert_eq!(back.history(), &[S::A]);
            assert_eq!(back.current_state(), S::B);
            assert_eq!(back.machine.loops_in_b, 2);
        }
    }

    #[test]
    fn a_long_cycle_keeps_the_state_small() {
        let encoded = |history: Vec<S>| {
            let mut sm = StateMachine::new(Machine::default());
            sm.history = history;
            let bytes = crate::procedure::EncodeState::encode_state(&sm).unwrap();
            let back: StateMachine<Machine> = rmp_serde::from_slice(&bytes).unwrap();
            assert_eq!(back.history(), sm.history());
            bytes.len()
        };
        let one = encoded(vec![S::A, S::B]);
        let many = encoded([S::A].into_iter().chain([S::B; 8_000]).collect());
        assert!(many <= one + 4, "8 000 cycles: {many} bytes, 1: {one}");
        encoded(vec![S::A, S::B, S::A, S::C, S::C]);
        encoded(Vec::new());
    }

    /// The runs are written as the list of `(state, times)` pairs that logs already
    /// hold.
    #[test]
    fn state_runs_are_a_list_of_pairs() {
        #[derive(Serialize)]
        struct Runs(#[serde(with = "state_runs")] Vec<S>);
        type Case = (Vec<S>, Vec<(S, u32)>);
        let cases: [Case; 3] = [
            (vec![], vec![]),
            (vec![S::A], vec![(S::A, 1)]),
            (
                vec![S::A, S::A, S::B, S::A, S::C, S::C, S::C],
                vec![(S::A, 2), (S::B, 1), (S::A, 1), (S::C, 3)],
            ),
        ];
        for (history, pairs) in cases {
            assert_eq!(
                rmp_serde::to_vec(&Runs(history)).unwrap(),
                rmp_serde::to_vec(&pairs).unwrap()
            );
        }
    }

    /// A machine's key reaches its wrapper: declared, or its first lock's resource.
    #[test]
    fn the_wrapper_gives_the_machines_affinity() {
        #[derive(Serialize, Deserialize)]
        struct Keyed(Option<String>);
        #[async_trait]
        impl StateMachineProcedure for Keyed {
            type State = S;
            fn initial_state(&self) -> S {
                S::A
            }
            async fn execute_from_state(
                &mut self,
                _ctx: &mut StateContext<'_, S>,
                _state: S,
            ) -> Result<Flow, ProcError> {
                Ok(Flow::Done)
            }
            async fn rollback_state(
                &mut self,
                _ctx: &mut Context,
                _state: S,
            ) -> Result<(), ProcError> {
                Ok(())
            }
            fn locks(&self) -> Vec<Lock> {
                vec![Lock::exclusive("table/t1/region/3")]
            }
            fn affinity(&self) -> Option<String> {
                self.0
                    .clone()
                    .or_else(|| self.locks().into_iter().next().map(|lock| lock.resource))
            }
        }
        let cases = [
            (Some("table/t1"), Some("table/t1")),
            (None, Some("table/t1/region/3")),
        ];
        for (key, expected) in cases {
            let proc: &dyn Procedure = &StateMachine::new(Keyed(key.map(str::to_string)));
            assert_eq!(proc.affinity().as_deref(), expected, "{key:?}");
        }
    }
}
