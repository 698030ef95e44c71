//! `CrashingStore`: a store that "crashes" at a chosen append (see `proctor::testing`).
//!
//! Pure like the rest of `src/`: it counts appends and decides; the inner store does any
//! IO.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::procedure::ProcId;
use crate::record::StoreOp;
use crate::store::{ProcedureStore, StoreError, StoreSnapshot};

/// Where the crash happens relative to the append it hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CrashPoint {
    /// The append is not written: the process died before the write.
    BeforeWrite,
    /// The append is written and durable, but the engine is never told: the process
    /// died after the write and before the acknowledgement.
    AfterWrite,
}

/// A store that passes `appends` appends through to `inner`, then crashes at the next
/// one (see [`CrashPoint`]) and fails every append after it, like a dead process.
///
/// Clones share the count, so a test keeps one clone to ask [`CrashingStore::crashed`].
///
/// ```
/// use proctor::testing::{CrashPoint, CrashingStore};
/// use proctor::{MemoryStore, ProcedureStore};
///
/// let inner = MemoryStore::new();
/// let mut store = CrashingStore::new(inner.clone(), 0, CrashPoint::AfterWrite);
/// assert!(store.append(&[proctor::store::StoreOp::Delete(proctor::ProcId(1))]).is_err());
/// assert!(store.crashed());
/// // The write happened; a restarted engine would find it in `inner`.
/// assert_eq!(inner.clone().load().unwrap().max_id, 1);
/// ```
#[derive(Clone)]
pub struct CrashingStore<S> {
    inner: S,
    state: Arc<CrashState>,
}

impl<S> std::fmt::Debug for CrashingStore<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrashingStore")
            .field("point", &self.state.point)
            .field("appends_left", &self.state.budget.load(Ordering::Relaxed))
            .field("crashed", &self.state.crashed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

struct CrashState {
    budget: AtomicUsize,
    point: CrashPoint,
    crashed: AtomicBool,
}

impl<S: ProcedureStore> CrashingStore<S> {
    /// Wraps `inner`; the crash hits the append after the first `appends`.
    pub fn new(inner: S, appends: usize, point: CrashPoint) -> Self {
        CrashingStore {
            inner,
            state: Arc::new(CrashState {
                budget: AtomicUsize::new(appends),
                point,
                crashed: AtomicBool::new(false),
            }),
        }
    }

    /// `true` once the crash has happened.
    pub fn crashed(&self) -> bool {
        self.state.crashed.load(Ordering::SeqCst)
    }
}

impl<S: ProcedureStore> ProcedureStore for CrashingStore<S> {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        let dead = || {
            Err(StoreError::Io {
                context: "simulated crash".into(),
                source: std::io::Error::other("the process died at this append"),
            })
        };
        if self.crashed() {
            return dead();
        }
        let left = self.state.budget.load(Ordering::SeqCst);
        if left == 0 {
            self.state.crashed.store(true, Ordering::SeqCst);
            if self.state.point == CrashPoint::AfterWrite {
                self.inner.append(ops)?;
            }
            return dead();
        }
        self.state.budget.store(left - 1, Ordering::SeqCst);
        self.inner.append(ops)
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        self.inner.load()
    }

    /// A crashed process marks nothing.
    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        if self.crashed() {
            return Ok(());
        }
        self.inner.mark_drained(cut_off)
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        self.inner.mark_running()
    }

    fn status(&self) -> crate::store::StoreStatus {
        self.inner.status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::ProcId;
    use crate::store::MemoryStore;

    #[test]
    fn crashes_at_the_chosen_append() {
        let op = |id| [StoreOp::Delete(ProcId(id))];
        // (appends let through, point, max id the inner store saw)
        let cases = [
            (0, CrashPoint::BeforeWrite, 0),
            (0, CrashPoint::AfterWrite, 1),
            (2, CrashPoint::BeforeWrite, 2),
            (2, CrashPoint::AfterWrite, 3),
        ];
        for (appends, point, seen) in cases {
            let inner = MemoryStore::new();
            let mut store = CrashingStore::new(inner.clone(), appends, point);
            for id in 1..=appends as u64 {
                store.append(&op(id)).unwrap();
            }
            assert!(!store.crashed());
            assert!(store.append(&op(appends as u64 + 1)).is_err());
            assert!(store.crashed());
            assert!(store.append(&op(99)).is_err(), "dead after the crash");
            assert_eq!(
                inner.clone().load().unwrap().max_id,
                seen,
                "{appends} {point:?}"
            );
        }
    }
}
