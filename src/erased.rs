//! The engine's view of a procedure: one object-safe type for procedures of every
//! environment type.
//!
//! Users write `Procedure<E>` for their executor's environment `E`, and the compiler
//! checks that an `Executor<E>` only ever holds `Procedure<E>`s. The engine's actors do
//! not carry `E` around: they hold a [`DynProc`] (a `Box<dyn ErasedProc>`) and call it
//! with a [`Call`], whose environment is the executor's `Arc<E>` seen as
//! `Arc<dyn Any>`. The typed wrapper ([`Typed`]) turns the call back into the
//! `Context<E>` the procedure expects, and the children it returns into `DynProc`s.
//!
//! Invariant: a `DynProc` made from a `Procedure<E>` is only ever called with a `Call`
//! whose environment is an `E` (see `Context::typed`).

use std::any::{Any, TypeId};
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use crate::locks::Lock;
use crate::procedure::{
    type_id_of, Context, FailurePolicy, Flow, LockState, OnTimeout, ProcError, Procedure,
    RetryPolicy,
};

/// The environment as the engine holds it.
pub(crate) type AnyEnv = dyn Any + Send + Sync;

/// One call into a procedure, as the engine makes it.
pub(crate) type Call = Context<AnyEnv>;

/// A procedure of any environment type.
pub(crate) type DynProc = Box<dyn ErasedProc>;

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// [`Flow`] with its children erased.
pub(crate) enum Next {
    Done,
    MoreToDo,
    Children(Vec<DynProc>),
    Spawn(Vec<DynProc>),
    Yield,
    Suspend(String),
    SleepUntil(u64),
}

impl<E: Send + Sync + 'static> From<Flow<E>> for Next {
    fn from(flow: Flow<E>) -> Self {
        match flow {
            Flow::Done => Next::Done,
            Flow::MoreToDo => Next::MoreToDo,
            Flow::Children(children) => {
                Next::Children(children.into_iter().map(erase_boxed).collect())
            }
            Flow::WaitAny(children) => Next::Spawn(children.into_iter().map(erase_boxed).collect()),
            Flow::Yield => Next::Yield,
            Flow::Suspend(event) => Next::Suspend(event),
            Flow::SleepUntil(at_ms) => Next::SleepUntil(at_ms),
        }
    }
}

/// What a step returned, with what it set through its context.
pub(crate) struct StepResult {
    pub(crate) next: Result<Next, ProcError>,
    /// The value for its root's result ([`Context::set_result`]).
    pub(crate) value: Option<Vec<u8>>,
    /// It marked itself the point of no return ([`Context::set_irreversible`]).
    pub(crate) irreversible: bool,
    /// How its retryable errors are retried ([`Context::set_retry_policy`]).
    pub(crate) retry: Option<RetryPolicy>,
}

/// [`Procedure`], object-safe over every environment type. Each method is the
/// procedure's own (see there); the contexts are [`Call`]s.
pub(crate) trait ErasedProc: Send + 'static {
    fn execute<'a>(&'a mut self, call: &Call) -> BoxFuture<'a, StepResult>;
    fn rollback<'a>(&'a mut self, call: &Call) -> BoxFuture<'a, Result<(), ProcError>>;
    fn abort(&mut self, call: &Call) -> bool;
    fn locks(&self) -> Vec<Lock>;
    fn acquire_lock(&mut self, call: &Call) -> LockState;
    fn release_lock(&mut self, call: &Call);
    fn holds_lock(&self) -> bool;
    fn before_recover(&mut self, call: &Call);
    fn after_recover(&mut self, call: &Call);
    fn rerun_after_recover(&self, event: &str) -> bool;
    fn completion_cleanup(&mut self, call: &Call);
    fn state_name(&self) -> Option<String>;
    fn step_name(&self) -> Option<String>;
    fn is_yield_after_execution(&self) -> bool;
    fn timeout_ms(&self) -> Option<u64>;
    fn on_timeout(&mut self, call: &Call) -> OnTimeout;
    fn failure_policy(&self, error: &ProcError) -> FailurePolicy;
    fn encode_state_into(&self, out: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error>;
    /// The user's type, for the registry.
    fn proc_type_id(&self) -> TypeId;
    /// The user's type's Rust name, for error messages.
    fn rust_type_name(&self) -> &'static str;
}

/// Where a [`Typed`] keeps its procedure: by value (submitted and recovered
/// procedures, one allocation) or boxed (the children a step returns, already boxed).
trait Holder<E: Send + Sync + 'static>: Send + 'static {
    fn get(&self) -> &dyn Procedure<E>;
    fn get_mut(&mut self) -> &mut dyn Procedure<E>;
}

/// A procedure held by value.
struct ByValue<P>(P);

impl<E: Send + Sync + 'static, P: Procedure<E>> Holder<E> for ByValue<P> {
    fn get(&self) -> &dyn Procedure<E> {
        &self.0
    }
    fn get_mut(&mut self) -> &mut dyn Procedure<E> {
        &mut self.0
    }
}

impl<E: Send + Sync + 'static> Holder<E> for Box<dyn Procedure<E>> {
    fn get(&self) -> &dyn Procedure<E> {
        &**self
    }
    fn get_mut(&mut self) -> &mut dyn Procedure<E> {
        &mut **self
    }
}

/// A `Procedure<E>` as an [`ErasedProc`].
struct Typed<E, H> {
    proc: H,
    env: PhantomData<fn() -> E>,
}

/// Erases a procedure of environment `E`.
pub(crate) fn erase<E: Send + Sync + 'static, P: Procedure<E>>(proc: P) -> DynProc {
    Box::new(Typed {
        proc: ByValue(proc),
        env: PhantomData::<fn() -> E>,
    })
}

/// Erases a boxed procedure of environment `E`.
pub(crate) fn erase_boxed<E: Send + Sync + 'static>(proc: Box<dyn Procedure<E>>) -> DynProc {
    Box::new(Typed {
        proc,
        env: PhantomData::<fn() -> E>,
    })
}

impl<E: Send + Sync + 'static, H: Holder<E>> ErasedProc for Typed<E, H> {
    fn execute<'a>(&'a mut self, call: &Call) -> BoxFuture<'a, StepResult> {
        let mut ctx = call.typed::<E>();
        let proc = self.proc.get_mut();
        Box::pin(async move {
            let flow = proc.execute(&mut ctx).await;
            StepResult {
                next: flow.map(Next::from),
                value: ctx.take_result(),
                irreversible: ctx.take_irreversible(),
                retry: ctx.take_retry_policy(),
            }
        })
    }

    fn rollback<'a>(&'a mut self, call: &Call) -> BoxFuture<'a, Result<(), ProcError>> {
        let mut ctx = call.typed::<E>();
        let proc = self.proc.get_mut();
        Box::pin(async move { proc.rollback(&mut ctx).await })
    }

    fn abort(&mut self, call: &Call) -> bool {
        self.proc.get_mut().abort(&call.typed())
    }

    fn locks(&self) -> Vec<Lock> {
        self.proc.get().locks()
    }

    fn acquire_lock(&mut self, call: &Call) -> LockState {
        self.proc.get_mut().acquire_lock(&call.typed())
    }

    fn release_lock(&mut self, call: &Call) {
        self.proc.get_mut().release_lock(&call.typed())
    }

    fn holds_lock(&self) -> bool {
        self.proc.get().holds_lock()
    }

    fn before_recover(&mut self, call: &Call) {
        self.proc.get_mut().before_recover(&call.typed())
    }

    fn after_recover(&mut self, call: &Call) {
        self.proc.get_mut().after_recover(&call.typed())
    }

    fn rerun_after_recover(&self, event: &str) -> bool {
        self.proc.get().rerun_after_recover(event)
    }

    fn completion_cleanup(&mut self, call: &Call) {
        self.proc.get_mut().completion_cleanup(&call.typed())
    }

    fn state_name(&self) -> Option<String> {
        self.proc.get().state_name()
    }

    fn step_name(&self) -> Option<String> {
        self.proc.get().step_name()
    }

    fn is_yield_after_execution(&self) -> bool {
        self.proc.get().is_yield_after_execution()
    }

    fn timeout_ms(&self) -> Option<u64> {
        self.proc.get().timeout_ms()
    }

    fn on_timeout(&mut self, call: &Call) -> OnTimeout {
        self.proc.get_mut().on_timeout(&call.typed())
    }

    fn failure_policy(&self, error: &ProcError) -> FailurePolicy {
        self.proc.get().failure_policy(error)
    }

    fn encode_state_into(&self, out: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error> {
        self.proc.get().encode_state_into(out)
    }

    fn proc_type_id(&self) -> TypeId {
        type_id_of(self.proc.get())
    }

    fn rust_type_name(&self) -> &'static str {
        self.proc.get().rust_type_name()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use async_trait::async_trait;
    use serde::Serialize;

    use super::*;
    use crate::procedure::ProcId;

    struct Cluster {
        servers: u32,
    }

    #[derive(Serialize)]
    struct Count {
        seen: u32,
    }

    #[async_trait]
    impl Procedure<Cluster> for Count {
        async fn execute(
            &mut self,
            ctx: &mut Context<Cluster>,
        ) -> Result<Flow<Cluster>, ProcError> {
            self.seen = ctx.env().servers;
            ctx.set_result(&self.seen)?;
            Ok(Flow::Children(vec![Box::new(Count { seen: 0 })]))
        }
        async fn rollback(&mut self, _: &mut Context<Cluster>) -> Result<(), ProcError> {
            Ok(())
        }
    }

    fn run<F: Future>(f: F) -> F::Output {
        let mut f = std::pin::pin!(f);
        match f
            .as_mut()
            .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        {
            std::task::Poll::Ready(out) => out,
            std::task::Poll::Pending => panic!("the step did not finish"),
        }
    }

    #[test]
    fn a_typed_procedure_sees_its_environment_through_the_erased_call() {
        let env: Arc<AnyEnv> = Arc::new(Cluster { servers: 3 });
        let call = Call::new(ProcId(1), None, ProcId(1), 0, env);
        let mut proc = erase(Count { seen: 0 });
        let StepResult {
            next,
            value: result,
            ..
        } = run(proc.execute(&call));
        let Ok(Next::Children(children)) = next else {
            panic!("expected children");
        };
        assert_eq!(result, Some(rmp_serde::to_vec_named(&3u32).unwrap()));
        let mut state = Vec::new();
        proc.encode_state_into(&mut state).unwrap();
        assert_eq!(state, rmp_serde::to_vec_named(&Count { seen: 3 }).unwrap());
        // Boxed children keep their own type for the registry.
        assert_eq!(children[0].proc_type_id(), TypeId::of::<Count>());
        assert_eq!(proc.proc_type_id(), TypeId::of::<Count>());
        assert!(proc.rust_type_name().ends_with("Count"));
    }
}
