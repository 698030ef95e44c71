//! A procedure's declared output: [`ProducesOutput`] names the type of the value a
//! root's steps set ([`Context::set_result`](crate::Context::set_result)), so that
//! [`Submission::typed`](crate::Submission::typed) hands its caller a
//! [`Submitted<T>`](crate::Submitted) whose `wait` gives a `T` the compiler checked. The
//! value is stored as it always is (MessagePack, with the root's records); the type
//! only connects the procedure to its caller.
//!
//! A [`Saga`] declares its output already ([`SagaProcedure::Output`]); a
//! [`StateMachine`] has its machine's, and a [`Dag`] has none (`()`).

use serde::de::DeserializeOwned;

use crate::dag::Dag;
use crate::saga::{Saga, SagaProcedure};
use crate::state_machine::{StateMachine, StateMachineProcedure};

/// The type of the value a procedure sets for its caller
/// ([`Context::set_result`](crate::Context::set_result): the last one set), which
/// [`Submitted::wait`](crate::Submitted::wait) decodes. Implement it for a procedure
/// (or a [`StateMachineProcedure`]'s machine: its [`StateMachine`] then has it too) to
/// submit it with [`Submission::typed`](crate::Submission::typed); a [`Saga`] has its
/// saga's [`Output`](SagaProcedure::Output).
///
/// An output of `()` or `Option<_>` may be left unset: a procedure that sets no value
/// gives `()` or `None`. Any other output the procedure must set, in a step of the
/// root, as this type (or one that encodes the same way).
///
/// ```
/// use proctor::{async_trait, Context, Executor, Flow, MemoryStore, ProcError, Procedure,
///               ProducesOutput, Registry};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct AddNode { node: String }
///
/// #[async_trait]
/// impl Procedure for AddNode {
///     async fn execute(&mut self, ctx: &mut Context) -> Result<Flow, ProcError> {
///         ctx.set_result(&format!("{} joined", self.node))?;
///         Ok(Flow::Done)
///     }
///     async fn rollback(&mut self, _ctx: &mut Context) -> Result<(), ProcError> {
///         Ok(())
///     }
/// }
///
/// impl ProducesOutput for AddNode {
///     type Output = String; // what `execute` sets
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let mut registry = Registry::new();
/// registry.register::<AddNode>("add_node");
/// let executor = Executor::builder()
///     .registry(registry)
///     .store(MemoryStore::new())
///     .start()
///     .await?;
/// let added = executor.submit(AddNode { node: "dn-4".into() }).typed().await?;
/// let joined: String = added.wait().await??; // a String, checked by the compiler
/// assert_eq!(joined, "dn-4 joined");
/// executor.shutdown().await?;
/// # Ok(())
/// # }
/// ```
pub trait ProducesOutput {
    /// The value's type.
    type Output: DeserializeOwned + Send + 'static;
}

/// A saga's output is its `run`'s.
impl<S, E> ProducesOutput for Saga<S, E>
where
    S: SagaProcedure<E>,
    S::Output: DeserializeOwned + 'static,
    E: Send + Sync + 'static,
{
    type Output = S::Output;
}

/// A state machine's output is the one its machine declares.
impl<T, E> ProducesOutput for StateMachine<T, E>
where
    T: StateMachineProcedure<E> + ProducesOutput,
    E: Send + Sync + 'static,
{
    type Output = T::Output;
}

/// A DAG sets no value.
impl<T> ProducesOutput for Dag<T> {
    type Output = ();
}
