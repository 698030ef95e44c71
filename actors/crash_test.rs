//! `restart_at_every_write`: runs a procedure through a crash at every store write, for
//! users testing their own procedures (HBase's `ProcedureTestingUtility`). Re-exported
//! as `proctor::testing::restart_at_every_write`.

use crate::crash_store::{CrashPoint, CrashingStore};
use crate::error::Error;
use crate::procedure::{ProcId, Procedure};
use crate::record::Failure;
use crate::store::MemoryStore;

use super::executor::ExecutorBuilder;

/// One run of [`restart_at_every_write`]: where the engine crashed and how the
/// procedure ended on the engine started after it.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct CrashRun {
    /// The crash hit the store write after this many writes went through.
    pub writes_before: usize,
    /// Whether the write it hit was lost or made durable.
    pub point: CrashPoint,
    /// The root, once its insert was durable (`None`: the crash hit the submit's own
    /// write before it was durable, so the procedure never existed).
    pub root: Option<ProcId>,
    /// How the restarted engine finished it (`None` when it never existed).
    pub result: Option<Result<(), Failure>>,
}

/// Runs a procedure once per store write it causes, crashing the engine at that write —
/// once losing the write, once after it is durable — then starting a new engine on what
/// the crash left and waiting for the procedure to finish there. After each run,
/// `check` sees how it ended: assert your invariants there (the procedure's effects on
/// your environment match its result) and reset what the next run needs.
///
/// `builder` gives a fresh executor configuration for each engine (registry,
/// environment, workers; the store is set here, a [`MemoryStore`] per run shared by the
/// crashed engine and the one after it), and `make` the procedure to submit. It stops
/// at the first write count the procedure no longer reaches, and returns every run.
///
/// ```no_run
/// # use proctor::{async_trait, Context, Executor, Flow, ProcError, Procedure, Registry};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct AddNode { step: u8 }
/// # #[async_trait] impl Procedure for AddNode {
/// #   async fn execute(&mut self, _: &mut Context) -> Result<Flow, ProcError> {
/// #     self.step += 1; Ok(if self.step < 3 { Flow::MoreToDo } else { Flow::Done }) }
/// #   async fn rollback(&mut self, _: &mut Context) -> Result<(), ProcError> { Ok(()) } }
/// # async fn f() -> Result<(), proctor::Error> {
/// let builder = || {
///     let mut registry = Registry::new();
///     registry.register::<AddNode>("add_node");
///     Executor::builder().registry(registry)
/// };
/// let runs = proctor::testing::restart_at_every_write(
///     builder,
///     || AddNode { step: 0 },
///     |run| assert!(run.result.as_ref().is_none_or(|r| r.is_ok()), "{run:?}"),
/// )
/// .await?;
/// assert!(runs.len() >= 8, "two runs per write of a 3-step procedure");
/// # Ok(()) }
/// ```
///
/// # Errors
///
/// An executor's start fails, or an engine after a crash fails (a store error there is
/// a bug the run found).
pub async fn restart_at_every_write<E: Send + Sync + 'static, P: Procedure<E>>(
    mut builder: impl FnMut() -> ExecutorBuilder<E>,
    mut make: impl FnMut() -> P,
    mut check: impl FnMut(&CrashRun),
) -> Result<Vec<CrashRun>, Error> {
    let mut runs = Vec::new();
    for writes_before in 0.. {
        for point in [CrashPoint::BeforeWrite, CrashPoint::AfterWrite] {
            let inner = MemoryStore::new();
            let crashing = CrashingStore::new(inner.clone(), writes_before, point);
            let executor = builder().store(crashing.clone()).start().await?;
            let submitted = executor.submit(make()).await;
            if let Ok(id) = submitted {
                // Ends at the crash (the engine halts and answers) or at the end.
                let _ = executor.wait(id).await;
            }
            // A crashed engine may already have stopped answering.
            let _ = executor.shutdown_now().await;
            if !crashing.crashed() {
                // The procedure finished within `writes_before` writes: every write
                // has had its crash.
                return Ok(runs);
            }
            let executor = builder().store(inner).start().await?;
            let root = executor.recovery().recovered_roots.first().copied().or(
                // Finished before the crash (the crash hit a cleanup write).
                submitted.ok(),
            );
            let result = match root {
                Some(id) => Some(executor.wait(id).await?),
                None => None,
            };
            executor.shutdown_now().await?;
            let run = CrashRun {
                writes_before,
                point,
                root,
                result,
            };
            check(&run);
            runs.push(run);
        }
    }
    Ok(runs)
}
