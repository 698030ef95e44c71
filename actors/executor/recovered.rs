//! What the start makes of the store: [`Recovered`] loads it, plans the recovery of
//! what it holds and decodes every tree that carries on (running `before_recover`
//! hooks, children first), puts the finished roots' results in the table, and starts
//! each recovered tree on its shard, many at a time ([`RECOVERED_STARTS_PER_MESSAGE`]
//! a message; large recoveries built on every arbiter at once). [`Recovery`] is what
//! the executor tells its user it found.

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;

use crate::actors::guard::{decode_guarded, guard};
use crate::actors::locks::LockActor;
use crate::actors::protocol::Regrant;
use crate::actors::root_stack::{publish_recovered, Objects, TreeRunner};
use crate::actors::shard::Mail;
use crate::actors::shared::{now_ms, Entry, EntryExtra, Shared, Waiting};
use crate::erased::{AnyEnv, Call};
use crate::error::Error;
use crate::procedure::{ProcId, ProcState};
use crate::record::{Nonce, ProcRecord};
use crate::recovery::{self, CorruptProc, RecoveryPlan, TreeRecovery};
use crate::registry::{Registry, Types};
use crate::store::{LastStop, ProcedureStore};

use super::actor::NonceState;

/// How many recovered trees are gathered before they go to their shards (one message
/// per shard).
pub(super) const RECOVERED_STARTS_PER_MESSAGE: usize = 4096;

/// Below this many recovered trees, the executor builds them on its own thread.
pub(super) const PARALLEL_START_MIN: usize = 4096;

/// `items` in up to `parts` runs of about equal length, in order; one run if there are
/// fewer than `min`.
pub(super) fn split_evenly<T>(items: Vec<T>, parts: usize, min: usize) -> Vec<Vec<T>> {
    if items.len() < min || parts <= 1 {
        return vec![items];
    }
    let len = items.len().div_ceil(parts);
    let mut items = items.into_iter();
    std::iter::from_fn(|| {
        Some(items.by_ref().take(len).collect::<Vec<T>>()).filter(|run| !run.is_empty())
    })
    .collect()
}

/// A recovered tree, decoded: its plan, its procedures, and the suspended ones that
/// run their next step at once.
pub(super) type DecodedTree = (TreeRecovery, (Objects, Vec<ProcId>));

/// What the start made of the store before any actor starts.
pub(super) struct Recovered {
    pub(super) registry: Types,
    /// The plan, its trees and corrupt procedures taken out (into `trees` and
    /// `report`).
    pub(super) plan: RecoveryPlan,
    /// The unfinished trees that decoded, in the plan's order.
    pub(super) trees: Vec<DecodedTree>,
    pub(super) report: Arc<Recovery>,
    /// The highest procedure id the store has seen.
    pub(super) max_id: u64,
}

impl Recovered {
    /// Loads `store`, plans the recovery of what it holds and decodes every tree the
    /// plan carries on; reports what cannot be recovered.
    pub(super) fn load<E: Send + Sync + 'static>(
        store: &mut dyn ProcedureStore,
        registry: Registry<E>,
        env: &Arc<AnyEnv>,
    ) -> Result<Self, Error> {
        let snapshot = store.load_parts()?;
        // A drained stop's mark holds for one start: this engine may run a step (a
        // recovered waiter's, say) before it first appends, so the mark goes first.
        if snapshot.last_stop != LastStop::Unknown {
            store.mark_running()?;
        }
        let registry = registry.into_types();
        let names = |name: &str| registry.static_name(name);
        let cut_off = recovery::may_be_cut_off(&snapshot.last_stop);
        let mut plan = crate::actors::recover::plan(snapshot.parts, &names, &cut_off, now_ms());
        let (trees, corrupt) = decode_trees(&registry, &mut plan, env);
        for c in &corrupt {
            tracing::error!(target: crate::targets::EXECUTOR, proc = %c.id, root = %c.root, reason = %c.reason, "cannot recover procedure");
        }
        let mut recovered_roots: Vec<ProcId> = trees.iter().map(|(t, _)| t.stack.root()).collect();
        recovered_roots.sort_unstable();
        let report = Arc::new(Recovery {
            recovered_roots,
            finished_roots: plan.finished.len(),
            corrupt,
            repairs: snapshot.repairs,
        });
        Ok(Recovered {
            registry,
            plan,
            trees,
            report,
            max_id: snapshot.max_id,
        })
    }

    /// Locks held for life when the engine stopped go back to their holders, roots
    /// first, before any tree is started and can ask for anything.
    pub(super) fn regrant(&self, locks: &Addr<LockActor>) {
        let mut held: Vec<_> = self
            .trees
            .iter()
            .flat_map(|(t, _)| t.stack.held_locks())
            .collect();
        held.sort_by_key(|r| (r.root, r.owner));
        if !held.is_empty() {
            locks.do_send(Regrant(held));
        }
    }

    /// Results to evict, oldest first (recovered ones by when they finished).
    pub(super) fn finished_at(&self) -> Vec<(u64, ProcId)> {
        let mut finished_at: Vec<(u64, ProcId)> = self
            .plan
            .finished
            .iter()
            .map(|r| (r.updated_ms, r.id))
            .collect();
        finished_at.sort_unstable();
        finished_at
    }

    /// Every root record keeps its nonce, finished or not, with its submission's
    /// fingerprint.
    pub(super) fn nonces(&self) -> HashMap<Nonce, NonceState> {
        let plan = &self.plan;
        plan.finished
            .iter()
            .chain(self.trees.iter().flat_map(|(t, _)| plan.records_of(t)))
            .filter(|r| r.parent.is_none())
            .filter_map(|r| {
                let known = NonceState::Known {
                    id: r.id,
                    fingerprint: r.nonce_fingerprint,
                };
                Some((r.nonce?, known))
            })
            .collect()
    }
}

/// Decodes the trees `plan` carries on, taking them and its corrupt procedures out of
/// it: the trees that decoded, and every procedure that cannot be recovered (those of
/// a tree that does not decode included).
pub(super) fn decode_trees(
    registry: &Types,
    plan: &mut RecoveryPlan,
    env: &Arc<AnyEnv>,
) -> (Vec<DecodedTree>, Vec<CorruptProc>) {
    let mut corrupt = std::mem::take(&mut plan.corrupt);
    // Decode every unfinished procedure before anything starts, so that hooks run
    // in the plan's order (children before parents) and a tree that cannot be
    // decoded is reported whole.
    let mut trees = Vec::with_capacity(plan.tree_count());
    for tree in std::mem::take(&mut plan.trees).into_iter().flatten() {
        let records = plan.records_of(&tree);
        match decode_tree(registry, records, env) {
            Ok(decoded) => trees.push((tree, decoded)),
            Err(reason) => corrupt.extend(records.iter().map(|r| CorruptProc {
                id: r.id,
                root: r.root,
                reason: reason.clone(),
            })),
        }
    }
    (trees, corrupt)
}

/// Puts the recovered finished roots in the table, with their results.
pub(super) fn keep_results(shared: &Shared, finished: Vec<ProcRecord>) {
    for record in finished {
        // Finished roots keep their results across restarts.
        shared
            .table
            .insert(record.id, finished_entry(shared, record));
    }
}

/// The table's entry of a finished root, from its record: with its result.
pub(super) fn finished_entry(shared: &Shared, record: ProcRecord) -> Entry {
    Entry {
        root: record.root,
        parent: record.parent,
        type_name: shared
            .registry
            .static_name(&record.type_name)
            .unwrap_or("?"),
        state: record.state,
        steps: 0,
        submitted_ms: record.submitted_ms,
        updated_ms: record.updated_ms,
        tree: None,
        extra: EntryExtra {
            result: Some(record.failure.map_or(Ok(()), Err)),
            value: record.result,
            nonce: record.nonce,
            bypassed: record.bypassed,
        }
        .boxed(),
        waiting: Waiting::Nothing,
        state_name: None,
        steering: None,
    }
}

/// Publishes the recovered trees' records and starts each tree on its shard.
pub(super) fn start_recovered(shared: &Arc<Shared>, plan: &RecoveryPlan, trees: Vec<DecodedTree>) {
    // The trees go to their shards a few thousand to a message, all of them
    // before the executor handles any request. A large recovery builds them on
    // every core.
    let chunks = split_evenly(trees, crate::actors::recover::cores(), PARALLEL_START_MIN);
    crate::actors::recover::on_threads(chunks, |chunk| {
        let mut starts = Mail::default();
        for (n, (tree, (objects, rerun))) in chunk.into_iter().enumerate() {
            if n % RECOVERED_STARTS_PER_MESSAGE == 0 {
                starts.send();
            }
            // Finished children stay out: nothing stops (and unlists) them later.
            let records = plan
                .records_of(&tree)
                .iter()
                .filter(|r| r.parent.is_none() || !r.state.is_finished());
            let addr = shared.new_tree(tree.stack.root());
            // In the table before the executor handles any request (it is not
            // running yet): recovered records are durable by definition.
            publish_recovered(shared, records, &addr);
            let runner = TreeRunner::recover(
                shared.clone(),
                addr.clone(),
                tree.stack,
                tree.start,
                objects,
                rerun,
            );
            addr.start_by(&mut starts, runner);
        }
        starts.send();
    });
}

/// Decodes the unfinished procedures of a recovered tree and runs their
/// `before_recover` hooks, children first. Also returns the suspended procedures that
/// run their next step at once rather than wait for their event again.
pub(super) fn decode_tree(
    registry: &Types,
    records: &[ProcRecord],
    env: &Arc<AnyEnv>,
) -> Result<(Objects, Vec<ProcId>), String> {
    let mut objects = Vec::new();
    let mut rerun = Vec::new();
    for r in records.iter().filter(|r| !r.state.is_finished()) {
        // The user's `Deserialize` runs here: a panic in it makes the tree corrupt,
        // named, rather than ending the engine's start.
        let mut proc = decode_guarded(registry, &r.type_name, &r.data)
            .map_err(|e| format!("procedure {}: {e}", r.id))?;
        let call = Call::new(r.id, r.parent, r.root, now_ms(), Arc::clone(env));
        if let Err(e) = guard("before_recover", || proc.before_recover(&call)) {
            tracing::error!(target: crate::targets::EXECUTOR, proc = %r.id, %e, "before_recover panicked");
        }
        // Paused while it waited (an operator's pause), it asks the same question:
        // continued, does it run its next step or wait for the event again?
        if let (ProcState::Waiting | ProcState::Paused, Some(event)) = (r.state, &r.event) {
            match guard("rerun_after_recover", || proc.rerun_after_recover(event)) {
                Ok(true) => rerun.push(r.id),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(target: crate::targets::EXECUTOR, proc = %r.id, %e, "rerun_after_recover panicked; re-running");
                    rerun.push(r.id);
                }
            }
        }
        objects.push((r.id, (proc, r.data.clone())));
    }
    Ok((objects.into_iter().collect(), rerun))
}

/// What the executor found in its store when it started.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recovery {
    /// Roots of the unfinished trees it carries on, by id.
    pub recovered_roots: Vec<ProcId>,
    /// Finished roots whose results it keeps.
    pub finished_roots: usize,
    /// Procedures it could not rebuild (left in the store for an operator).
    pub corrupt: Vec<CorruptProc>,
    /// What opening the store changed on disk (e.g. a torn WAL tail truncated), one line
    /// each naming the file, the byte offset and what was done.
    pub repairs: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::split_evenly;

    /// (items, parts, min) → the runs' lengths.
    #[test]
    fn split_evenly_keeps_order_and_stays_whole_when_small() {
        let cases: [(usize, usize, usize, &[usize]); 7] = [
            (0, 2, 0, &[]),
            (10, 2, 20, &[10]),
            (10, 1, 0, &[10]),
            (10, 2, 0, &[5, 5]),
            (11, 2, 0, &[6, 5]),
            (10, 3, 0, &[4, 4, 2]),
            (2, 4, 0, &[1, 1]),
        ];
        for (n, parts, min, lengths) in cases {
            let runs = split_evenly((0..n).collect(), parts, min);
            let got: Vec<usize> = runs.iter().map(Vec::len).collect();
            assert_eq!(got, lengths, "{n} items, {parts} parts, min {min}");
            let flat: Vec<usize> = runs.into_iter().flatten().collect();
            assert_eq!(flat, (0..n).collect::<Vec<_>>(), "order");
        }
    }
}
