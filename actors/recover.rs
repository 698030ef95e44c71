//! Recovery's plan on every core: [`recovery::plan`] with the trees split over scoped
//! threads. The core plans a run of trees exactly as it plans them all, so the parts,
//! appended in order, are the plan one thread would have made. Also the scoped-thread
//! helpers the WAL store's open shares ([`cores`], [`on_threads`], [`joined`]).

use crate::procedure::ProcId;
use crate::record::ProcRecord;
use crate::recovery::{self, RecoveryPlan};

/// Below this many records, planning stays on the calling thread.
const PARALLEL_PLAN_MIN: usize = 4096;

/// How many threads recovery works on: one per core, 8 at most.
pub(crate) fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(8))
}

/// `work` on each of `items`: the first on this thread, each other on a scoped thread
/// of its own; the results in the order of the items.
pub(crate) fn on_threads<T: Send, R: Send>(items: Vec<T>, work: impl Fn(T) -> R + Sync) -> Vec<R> {
    let mut items = items.into_iter();
    let Some(first) = items.next() else {
        return Vec::new();
    };
    let work = &work;
    std::thread::scope(|scope| {
        let others: Vec<_> = items.map(|item| scope.spawn(move || work(item))).collect();
        let mut results = Vec::with_capacity(others.len() + 1);
        results.push(work(first));
        results.extend(others.into_iter().map(joined));
        results
    })
}

/// A scoped worker's result; its panic goes on in this thread.
pub(crate) fn joined<R>(worker: std::thread::ScopedJoinHandle<'_, R>) -> R {
    worker
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// [`recovery::plan`] of the records of `parts` (parts that no tree spans, as
/// [`ProcedureStore::load_parts`](crate::ProcedureStore::load_parts) gives them), on as
/// many threads as there are cores (8 at most) when there are many: the same plan,
/// sooner. Several parts are planned each on a thread of its own and merged by root;
/// one part is grouped into trees on this thread and runs of its trees are planned on
/// several.
pub fn plan(
    mut parts: Vec<Vec<ProcRecord>>,
    names: &(dyn Fn(&str) -> Option<&'static str> + Sync),
    cut_off: &(dyn Fn(ProcId) -> bool + Sync),
    now_ms: u64,
) -> RecoveryPlan {
    if parts.len() > 1 {
        return plan_parts(parts, names, cut_off, now_ms);
    }
    let records = parts.pop().unwrap_or_default();
    let threads = if records.len() < PARALLEL_PLAN_MIN {
        1
    } else {
        cores()
    };
    plan_on(records, names, cut_off, now_ms, threads)
}

/// Each of `parts` planned on a thread of its own, the plans appended in order.
fn plan_parts(
    parts: Vec<Vec<ProcRecord>>,
    names: &(dyn Fn(&str) -> Option<&'static str> + Sync),
    cut_off: &(dyn Fn(ProcId) -> bool + Sync),
    now_ms: u64,
) -> RecoveryPlan {
    let plan_one = |part| recovery::plan(part, names, cut_off, now_ms);
    let mut plans = on_threads(parts, plan_one).into_iter();
    let mut plan = plans.next().unwrap_or_default();
    for later in plans {
        plan.append(later);
    }
    plan
}

/// [`plan`] of one part on `threads` threads: the trees grouped on this thread, then
/// runs of them planned on several, their records in place.
fn plan_on(
    mut records: Vec<ProcRecord>,
    names: &(dyn Fn(&str) -> Option<&'static str> + Sync),
    cut_off: &(dyn Fn(ProcId) -> bool + Sync),
    now_ms: u64,
    threads: usize,
) -> RecoveryPlan {
    let groups = recovery::group_trees(&mut records);
    let per_thread = groups.len().div_ceil(threads.max(1)).max(1);
    let mut runs = Vec::with_capacity(threads);
    let mut rest: &mut [ProcRecord] = &mut records;
    let mut offset = 0;
    for run in groups.chunks(per_thread) {
        let len: usize = run.iter().map(|&(_, n)| n).sum();
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(len);
        runs.push((head, run, offset));
        offset += len;
        rest = tail;
    }
    let planned = on_threads(runs, |(records, groups, offset)| {
        recovery::plan_trees(records, groups, offset, names, cut_off, now_ms)
    });
    RecoveryPlan::of_part(records, planned)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::{ProcId, ProcState};
    use crate::record::Failure;
    use crate::ProcError;

    fn rec(id: u64, root: u64, parent: Option<u64>, state: ProcState, stack: &[u32]) -> ProcRecord {
        let failed = state == ProcState::Failed;
        ProcRecord {
            id: ProcId(id),
            parent: parent.map(ProcId),
            root: ProcId(root),
            type_name: if id.is_multiple_of(97) {
                "unknown"
            } else {
                "t"
            }
            .into(),
            state,
            stack_indexes: stack.to_vec(),
            failure: failed.then(|| {
                Box::new(Failure {
                    proc: ProcId(id),
                    type_name: "t".into(),
                    error: ProcError::failed("x"),
                })
            }),
            failure_seq: failed.then_some(0),
            submitted_ms: 0,
            updated_ms: 0,
            wake_at_ms: None,
            event: None,
            data: vec![],
            locks: None,
            deadline_ms: None,
            nonce: None,
            result: None,
            bypassed: false,
            steering: Default::default(),
            nonce_fingerprint: None,
        }
    }

    /// Trees of every kind the plan sorts: running alone, waiting on a child, failed
    /// (rolling back), finished, without a root, of an unknown type.
    fn records() -> Vec<ProcRecord> {
        let mut records = Vec::new();
        for root in (1..600).step_by(3) {
            let child = root + 1;
            match root % 5 {
                0 => records.push(rec(root, root, None, ProcState::Runnable, &[0])),
                1 => {
                    records.push(rec(root, root, None, ProcState::Waiting, &[0]));
                    records.push(rec(child, root, Some(root), ProcState::Runnable, &[1]));
                }
                2 => {
                    records.push(rec(root, root, None, ProcState::Failed, &[0, 1]));
                }
                3 => records.push(rec(root, root, None, ProcState::Success, &[0])),
                _ => records.push(rec(child, root, Some(root), ProcState::Runnable, &[])),
            }
        }
        records.sort_by_key(|r| r.id);
        records
    }

    fn names(name: &str) -> Option<&'static str> {
        (name == "t").then_some("t")
    }

    /// What a plan does, whatever parts and runs it was made in: each tree (by root)
    /// with its records and start, then the finished roots and the corrupt procedures.
    fn described(plan: &RecoveryPlan) -> String {
        let mut trees: Vec<String> = plan
            .each_tree()
            .map(|t| format!("{:?} {:?} {:?}", plan.records_of(t), t.stack, t.start))
            .collect();
        trees.sort();
        let mut finished: Vec<String> = plan.finished.iter().map(|r| format!("{r:?}")).collect();
        finished.sort();
        let mut corrupt: Vec<String> = plan.corrupt.iter().map(|c| format!("{c:?}")).collect();
        corrupt.sort();
        format!("{trees:#?}\n{finished:#?}\n{corrupt:#?}")
    }

    #[test]
    fn a_plan_of_parts_is_the_plan_of_their_records() {
        let alone = described(&recovery::plan(records(), names, &|_| true, 5));
        for parts in [2, 3, 8] {
            // Split as a store splits them: by root, each part sorted by id.
            let mut split = vec![Vec::new(); parts];
            for r in records() {
                split[(r.root.0 as usize * 7) % parts].push(r);
            }
            let planned = plan(split, &names, &|_| true, 5);
            assert_eq!(planned.records.len(), parts);
            assert_eq!(described(&planned), alone, "{parts} parts");
        }
    }

    #[test]
    fn a_plan_on_many_threads_is_the_plan_on_one() {
        let alone = recovery::plan(records(), names, &|_| true, 5);
        for threads in [1, 2, 3, 8] {
            let split = plan_on(records(), &names, &|_| true, 5, threads);
            assert!(split.tree_count() > 50 && !split.corrupt.is_empty());
            assert!(!split.finished.is_empty());
            assert_eq!(described(&split), described(&alone), "{threads} threads");
            // The same part, in the same order, and the same trees in it.
            assert_eq!(split.records, alone.records, "{threads} threads");
            let ranges = |plan: &RecoveryPlan| -> Vec<_> {
                plan.each_tree()
                    .map(|t| (t.part, t.range.clone()))
                    .collect()
            };
            assert_eq!(ranges(&split), ranges(&alone), "{threads} threads");
            assert_eq!(split.trees.len(), threads.min(split.tree_count()));
        }
    }
}
