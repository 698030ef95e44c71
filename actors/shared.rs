//! What every actor of one executor shares: the registry, the user's environment, the
//! procedure table, the id counter, and the addresses of the singleton actors.

use std::any::Any;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix::prelude::*;
use dashmap::DashMap;

use crate::procedure::{ProcId, ProcState};
use crate::record::Failure;
use crate::registry::Registry;

use super::executor::ExecutorActor;
use super::persistence::Persistence;
use super::procedure::ProcedureActor;
use super::scheduler::Scheduler;

/// The engine's clock, in ms since the Unix epoch. The one place the actors read time;
/// the core gets it as a parameter.
pub(crate) fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// One row of the procedure table.
pub(crate) struct Entry {
    pub(crate) root: ProcId,
    pub(crate) parent: Option<ProcId>,
    pub(crate) type_name: &'static str,
    pub(crate) state: ProcState,
    pub(crate) submitted_ms: u64,
    pub(crate) updated_ms: u64,
    /// The live actor; `None` once the procedure has finished.
    pub(crate) addr: Option<Addr<ProcedureActor>>,
    /// A finished root's result.
    pub(crate) result: Option<Result<(), Failure>>,
}

pub(crate) struct Shared {
    pub(crate) registry: Arc<Registry>,
    pub(crate) env: Option<Arc<dyn Any + Send + Sync>>,
    pub(crate) table: DashMap<ProcId, Entry>,
    pub(crate) scheduler: Addr<Scheduler>,
    pub(crate) persistence: Addr<Persistence>,
    pub(crate) executor: Addr<ExecutorActor>,
    pub(crate) arbiters: Vec<ArbiterHandle>,
    next_arbiter: AtomicUsize,
    next_id: AtomicU64,
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        registry: Arc<Registry>,
        env: Option<Arc<dyn Any + Send + Sync>>,
        scheduler: Addr<Scheduler>,
        persistence: Addr<Persistence>,
        executor: Addr<ExecutorActor>,
        arbiters: Vec<ArbiterHandle>,
        max_id: u64,
    ) -> Self {
        Shared {
            registry,
            env,
            table: DashMap::new(),
            scheduler,
            persistence,
            executor,
            arbiters,
            next_arbiter: AtomicUsize::new(0),
            next_id: AtomicU64::new(max_id + 1),
        }
    }

    /// A new procedure id, above every id the store has seen.
    pub(crate) fn next_id(&self) -> ProcId {
        ProcId(self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// The arbiter for the next new actor: round robin, so trees and children spread
    /// over all cores.
    pub(crate) fn next_arbiter(&self) -> &ArbiterHandle {
        let i = self.next_arbiter.fetch_add(1, Ordering::Relaxed);
        &self.arbiters[i % self.arbiters.len()]
    }
}
