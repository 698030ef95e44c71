//! Recovery planning: the latest records of a store in, a [`RecoveryPlan`] out. Pure,
//! so every rule is a table-driven unit test.
//!
//! The plan groups records by tree and rebuilds each unfinished tree with
//! the core's `RootStack::recover`. A tree whose history is incomplete (its root's record
//! missing, a parent missing, holes in the stack indexes, an unknown type) is reported
//! as corrupt, procedure by procedure, and left in the store untouched for an operator;
//! it never stops unrelated trees from recovering. Finished roots keep their results.

use std::collections::HashMap;
use std::ops::Range;

use crate::fast_map::IdMap;
use crate::procedure::{ProcError, ProcId, ProcState};
use crate::record::{Failure, ProcRecord, StoreOp};
use crate::root_stack::{RootStack, Transition};
use crate::store::LastStop;

/// A procedure that recovery could not rebuild, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorruptProc {
    /// The procedure.
    pub id: ProcId,
    /// The root its record names.
    pub root: ProcId,
    /// What is wrong with its tree.
    pub reason: String,
}

/// One unfinished tree, rebuilt. Its records stay in the plan
/// ([`RecoveryPlan::records_of`]).
#[derive(Debug)]
pub struct TreeRecovery {
    /// The part of [`RecoveryPlan::records`] that holds the tree's records.
    pub part: usize,
    /// Where in that part: the tree's records, children before parents.
    pub range: Range<usize>,
    /// The rebuilt bookkeeping.
    pub stack: RootStack,
    /// What to do to carry the tree on (no records; actions only).
    pub start: Transition,
}

/// What recovery does with a store's records.
#[derive(Debug, Default)]
pub struct RecoveryPlan {
    /// Unfinished trees, in the runs they were planned in (each run by root; every
    /// tree is [`each_tree`](RecoveryPlan::each_tree)). Kept as the planning threads
    /// made them rather than copied into one list: that would touch their memory twice.
    pub trees: Vec<Vec<TreeRecovery>>,
    /// The unfinished trees' records, in the parts they were planned in, each tree's
    /// together ([`TreeRecovery::range`]). Kept where they were decoded rather than
    /// moved into a list per tree: for a million records that is hundreds of megabytes
    /// less memory touched.
    pub records: Vec<Vec<ProcRecord>>,
    /// Finished roots (by root within each part): their results are kept.
    pub finished: Vec<ProcRecord>,
    /// Procedures that cannot be recovered.
    pub corrupt: Vec<CorruptProc>,
}

impl RecoveryPlan {
    /// Every unfinished tree, run after run.
    pub fn each_tree(&self) -> impl Iterator<Item = &TreeRecovery> {
        self.trees.iter().flatten()
    }

    /// How many unfinished trees the plan carries on.
    pub fn tree_count(&self) -> usize {
        self.trees.iter().map(Vec::len).sum()
    }

    /// The records of `tree`, one of this plan's trees: children before parents.
    pub fn records_of(&self, tree: &TreeRecovery) -> &[ProcRecord] {
        self.records
            .get(tree.part)
            .and_then(|part| part.get(tree.range.clone()))
            .unwrap_or_default()
    }

    /// Adds the plan of other parts after this plan's.
    pub fn append(&mut self, mut later: RecoveryPlan) {
        let parts = self.records.len();
        for tree in later.trees.iter_mut().flatten() {
            tree.part += parts;
        }
        self.trees.append(&mut later.trees);
        self.records.append(&mut later.records);
        self.finished.append(&mut later.finished);
        self.corrupt.append(&mut later.corrupt);
    }

    /// The plan of one part, `records`, planned in `runs` (in order, as
    /// [`plan_trees`] left them): the records of corrupt and finished trees leave the
    /// part (a finished root's for [`finished`](RecoveryPlan::finished)), and the
    /// others close up, in order, with each tree's range moved down to match.
    pub fn of_part(mut records: Vec<ProcRecord>, runs: Vec<PlannedRun>) -> RecoveryPlan {
        let mut plan = RecoveryPlan::default();
        let mut dropped = Vec::new();
        for mut run in runs {
            plan.trees.push(run.trees);
            plan.corrupt.append(&mut run.corrupt);
            dropped.append(&mut run.dropped);
        }
        if !dropped.is_empty() {
            // Both lists are in record order: each tree's range moves down by the
            // records dropped before it.
            let mut before = dropped.iter().peekable();
            let mut gone = 0;
            for tree in plan.trees.iter_mut().flatten() {
                while let Some((range, _)) = before.next_if(|(r, _)| r.end <= tree.range.start) {
                    gone += range.len();
                }
                tree.range = tree.range.start - gone..tree.range.end - gone;
            }
            let mut at = 0;
            let mut next = dropped.iter().peekable();
            let mut out = records.extract_if(.., |_| {
                let i = at;
                at += 1;
                while next.next_if(|(r, _)| r.end <= i).is_some() {}
                next.peek().is_some_and(|(r, _)| r.contains(&i))
            });
            // The records come out in order, range after range.
            for (range, finished_root) in &dropped {
                for i in range.clone() {
                    match out.next() {
                        Some(r) if Some(i) == *finished_root => plan.finished.push(r),
                        _ => {}
                    }
                }
            }
        }
        plan.records.push(records);
        plan
    }
}

/// What [`plan_trees`] makes of a run of trees, before [`RecoveryPlan::of_part`]
/// closes up the part's records.
#[derive(Debug, Default)]
pub struct PlannedRun {
    /// The trees to carry on, their ranges where their records are now.
    trees: Vec<TreeRecovery>,
    corrupt: Vec<CorruptProc>,
    /// The ranges of the trees whose records leave the part, in order, each with the
    /// place of its root's record when that root has finished (a result to keep).
    dropped: Vec<(Range<usize>, Option<usize>)>,
}

/// An operator's bypass on a stopped engine's store (`proctor bypass`): from the latest
/// records, the ops that mark `id` (and, with `recursive`, its unfinished descendants)
/// SUCCESS without running further or rolling back, exactly as
/// [`Executor::bypass`](crate::Executor::bypass) would, except that a RUNNABLE
/// procedure may be bypassed too (nothing runs). Append them through the store.
///
/// # Errors
/// A refusal naming the reason: `id` is not in the store, its tree cannot be rebuilt,
/// it has finished, its tree is rolling back, it has unfinished children and
/// `recursive` is not set, or it (or a descendant) is neither waiting, PAUSED nor
/// RUNNABLE.
pub fn bypass(
    records: &[ProcRecord],
    id: ProcId,
    recursive: bool,
    now_ms: u64,
) -> Result<Vec<StoreOp>, String> {
    let (_, mut stack) = rebuild(records, id, now_ms)?;
    let data_of = |p: ProcId| {
        records
            .iter()
            .find(|r| r.id == p)
            .map(|r| r.data.clone())
            .unwrap_or_default()
    };
    let t = stack.on_bypass(
        id,
        recursive,
        crate::root_stack::BypassReach::Stopped,
        &data_of,
        now_ms,
    )?;
    Ok(t.persist)
}

/// `id`'s record and its tree, rebuilt from the latest records as recovery would.
fn rebuild(
    records: &[ProcRecord],
    id: ProcId,
    now_ms: u64,
) -> Result<(&ProcRecord, RootStack), String> {
    let target = records
        .iter()
        .find(|r| r.id == id)
        .ok_or_else(|| format!("procedure {id} is not in the store"))?;
    let (stack, _) = rebuild_tree(records, target.root, now_ms)?;
    Ok((target, stack))
}

/// Rebuilds the tree of `root` from the latest records, as the engine's recovery
/// would: a parent cycle is refused here too (recovery finds it while ordering the
/// tree, which an operator's command does not need), or a recursive bypass would walk
/// it for ever.
fn rebuild_tree(
    records: &[ProcRecord],
    root: ProcId,
    now_ms: u64,
) -> Result<(RootStack, Transition), String> {
    let mut tree: Vec<ProcRecord> = records.iter().filter(|r| r.root == root).cloned().collect();
    order_children_first(&mut tree)
        .and_then(|()| RootStack::recover(&tree, |name| Some(leak(name)), &|_| true, now_ms))
        .map_err(|reason| format!("tree {root} cannot be rebuilt: {reason}"))
}

/// An operator's abort on a stopped engine's store (`proctor abort`, HBase's
/// `abort_procedure`): from the latest records, the op that fails `id` with
/// [`ProcError::Aborted`], so that the engine that starts next rolls its tree back and
/// the tree's result is this abort. Append it through the store.
///
/// The procedure is not asked (offline there is no registry, so no
/// [`Procedure::abort`](crate::Procedure::abort)): the operator overrides it, and its
/// tree's rollback runs as after any failure. Its record keeps the state it was
/// written with and gains the failure (sequence 0, the tree's first), so recovery
/// treats it as it treats any procedure of a failed tree that may have been in the
/// middle of a step when the engine stopped: it gets one unrecorded rollback first,
/// then its recorded steps are rolled back.
///
/// # Errors
/// A refusal naming the reason: `id` is not in the store, has finished, its root has no
/// record, its tree has finished, its tree cannot be rebuilt, or its tree has already
/// failed (it is rolling back, or will at next start).
pub fn abort(records: &[ProcRecord], id: ProcId, now_ms: u64) -> Result<Vec<StoreOp>, String> {
    let target = records
        .iter()
        .find(|r| r.id == id)
        .ok_or_else(|| format!("procedure {id} is not in the store"))?;
    if target.state.is_finished() {
        return Err(format!(
            "procedure {id} has already finished ({})",
            target.state
        ));
    }
    let root = target.root;
    match records.iter().find(|r| r.id == root) {
        Some(r) if r.state.is_finished() => {
            return Err(format!("its tree {root} has finished ({})", r.state));
        }
        Some(_) => {}
        None => return Err(format!("its root {root} has no record")),
    }
    let (stack, _) = rebuild_tree(records, root, now_ms)?;
    if let Some(first) = stack.first_failure() {
        return Err(format!("tree {root} is already rolling back: {first}"));
    }
    let record = ProcRecord {
        failure: Some(Box::new(Failure {
            proc: id,
            type_name: target.type_name.to_string(),
            error: ProcError::Aborted,
        })),
        failure_seq: Some(0),
        updated_ms: now_ms,
        ..target.clone()
    };
    Ok(vec![StoreOp::Update(record)])
}

/// An operator's command on a paused procedure of a stopped engine's store
/// (`proctor continue` / `proctor rollback`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Steer {
    /// A RUNNABLE procedure, or one waiting for an event or a timer, is PAUSED (by an
    /// operator) and stays so at next start until continued; a parent waiting for its
    /// children is refused (pause them).
    Pause,
    /// A PAUSED procedure runs its step again at next start (retries reset); a
    /// ROLLBACK_PAUSED one retries its rollback.
    Continue,
    /// A PAUSED procedure fails ([`ProcError::Aborted`]) and its tree rolls back at
    /// next start, the failed step first. (For one not paused, see [`abort`].)
    Rollback,
}

/// The ops that carry out `command` on `id`, from the latest records, exactly as the
/// running engine's [`Executor::pause`](crate::Executor::pause),
/// [`Executor::resume`](crate::Executor::resume) and
/// [`Executor::rollback`](crate::Executor::rollback) would write them (a pause takes
/// effect at once: nothing runs). Append them through the store.
///
/// # Errors
/// A refusal naming the reason: `id` is not in the store, its tree cannot be rebuilt,
/// or the command does not apply in its state (as the engine refuses it; a rollback of
/// a procedure that is not paused: use [`abort`]).
pub fn steer(
    records: &[ProcRecord],
    id: ProcId,
    command: Steer,
    now_ms: u64,
) -> Result<Vec<StoreOp>, String> {
    let (target, mut stack) = rebuild(records, id, now_ms)?;
    let t = match command {
        Steer::Pause => stack.on_offline_pause(id, target.data.clone(), now_ms)?,
        Steer::Continue => stack.on_continue(id, now_ms)?,
        Steer::Rollback => stack.on_operator_rollback(id, now_ms).map_err(|reason| {
            if target.state == ProcState::Paused {
                reason
            } else {
                format!("{reason} (`proctor abort` rolls back a procedure that is not paused)")
            }
        })?,
    };
    Ok(t.persist)
}

/// Which procedures may have been in the middle of a step nobody recorded when the
/// engine stopped, as recovery needs to know ([`plan`]'s `cut_off`): after a crash
/// (or a stop the store cannot tell), any; after a drained shutdown, only those an
/// earlier crash may have cut off that had not run a step since.
pub fn may_be_cut_off(last_stop: &LastStop) -> impl Fn(ProcId) -> bool + Sync + '_ {
    let only: Option<std::collections::HashSet<ProcId>> = match last_stop {
        LastStop::Unknown => None,
        LastStop::Drained { cut_off } => Some(cut_off.iter().copied().collect()),
    };
    move |id| only.as_ref().is_none_or(|ids| ids.contains(&id))
}

/// Type names are only compared here; the few an offline bypass needs may live for the
/// rest of the command.
fn leak(name: &str) -> &'static str {
    Box::leak(name.to_string().into_boxed_str())
}

/// Plans the recovery of `records` (the latest record of every live procedure, in any
/// order; grouped by tree, by root then id, they are not moved).
/// `names` maps a stored type name to the registry's, `None` when unknown; `cut_off`
/// says which procedures may have been in a step nobody recorded ([`may_be_cut_off`]).
///
/// The same as [`group_trees`], [`plan_trees`] of the groups, then
/// [`RecoveryPlan::of_part`]; a caller with cores to spare may split the groups (and
/// the records at the same places) and plan the runs on several threads: the result is
/// the same.
pub fn plan(
    mut records: Vec<ProcRecord>,
    names: impl Fn(&str) -> Option<&'static str>,
    cut_off: &dyn Fn(ProcId) -> bool,
    now_ms: u64,
) -> RecoveryPlan {
    let groups = group_trees(&mut records);
    let run = plan_trees(&mut records, &groups, 0, names, cut_off, now_ms);
    RecoveryPlan::of_part(records, vec![run])
}

/// A tree's root and how many records it has, as [`group_trees`] found them.
pub type TreeGroup = (ProcId, usize);

/// The first step of [`plan`]: puts `records` in tree order (by root, then by id) and
/// returns the trees in that order. Records already in that order (the
/// [`WalStore`](crate::WalStore) hands its parts over so) are not moved; others are
/// moved once each (their keys are sorted, not the records: a record is a few hundred
/// bytes).
pub fn group_trees(records: &mut [ProcRecord]) -> Vec<TreeGroup> {
    let grouped = records
        .windows(2)
        .all(|w| (w[0].root, w[0].id) < (w[1].root, w[1].id));
    if !grouped {
        records.sort_by_cached_key(|r| (r.root, r.id));
    }
    let mut groups: Vec<TreeGroup> = Vec::new();
    for r in records.iter() {
        match groups.last_mut() {
            Some((root, n)) if *root == r.root => *n += 1,
            _ => groups.push((r.root, 1)),
        }
    }
    groups
}

/// The second step of [`plan`]: rebuilds each tree of `groups` (a run of
/// [`group_trees`]' groups, in order) from `records`, the run's records, which start at
/// `offset` in their part. Puts each tree's records children first, in place.
pub fn plan_trees(
    records: &mut [ProcRecord],
    groups: &[TreeGroup],
    offset: usize,
    names: impl Fn(&str) -> Option<&'static str>,
    cut_off: &dyn Fn(ProcId) -> bool,
    now_ms: u64,
) -> PlannedRun {
    let mut run = PlannedRun::default();
    // Nearly every group is a tree to carry on: one allocation, no regrowth.
    run.trees.reserve_exact(groups.len());
    let mut end = 0;
    for &(root, len) in groups {
        let (start, group) = match records.get_mut(end..end + len) {
            Some(group) => (end, group),
            None => break, // more groups than records: not from group_trees
        };
        end += len;
        let range = offset + start..offset + end;
        let corrupt = |group: &[ProcRecord], reason: String| -> Vec<CorruptProc> {
            group
                .iter()
                .map(|r| CorruptProc {
                    id: r.id,
                    root,
                    reason: reason.clone(),
                })
                .collect()
        };
        let Some(root_at) = group.iter().position(|r| r.id == root) else {
            run.corrupt
                .extend(corrupt(group, format!("its root {root} has no record")));
            run.dropped.push((range, None));
            continue;
        };
        let root_state = group[root_at].state;
        if root_state.is_finished() {
            // A finished tree's children are deleted with the root's final record, in
            // one atomic append; any left over mean the log was tampered with.
            let reason = format!("its root {root} has finished ({root_state})");
            run.corrupt
                .extend(group.iter().filter(|r| r.id != root).map(|r| CorruptProc {
                    id: r.id,
                    root,
                    reason: reason.clone(),
                }));
            run.dropped
                .push((range.clone(), Some(range.start + root_at)));
            continue;
        }
        if let Err(reason) = order_children_first(group) {
            run.corrupt.extend(corrupt(group, reason));
            run.dropped.push((range, None));
            continue;
        }
        match RootStack::recover(group, &names, cut_off, now_ms) {
            Ok((stack, start)) => run.trees.push(TreeRecovery {
                part: 0,
                range,
                stack,
                start,
            }),
            Err(reason) => {
                run.corrupt.extend(corrupt(group, reason));
                run.dropped.push((range, None));
            }
        }
    }
    run
}

/// Sorts a tree's records deepest first (so hooks run on children before parents).
fn order_children_first(group: &mut [ProcRecord]) -> Result<(), String> {
    if group.len() == 1 {
        return Ok(());
    }
    let parents: IdMap<ProcId, Option<ProcId>> = group.iter().map(|r| (r.id, r.parent)).collect();
    let mut depth = HashMap::with_capacity(group.len());
    for r in group.iter() {
        let mut d = 0usize;
        let mut at = r.parent;
        while let Some(p) = at {
            d += 1;
            if d > group.len() {
                return Err(format!("procedure {} is in a parent cycle", r.id));
            }
            at = match parents.get(&p) {
                Some(&next) => next,
                // Reported with its reason by RootStack::recover.
                None => None,
            };
        }
        depth.insert(r.id, d);
    }
    group.sort_by_key(|r| (std::cmp::Reverse(depth[&r.id]), r.id));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record: id, parent, state, stack indexes.
    fn rec(id: u64, parent: Option<u64>, state: ProcState, stack: &[u32]) -> ProcRecord {
        ProcRecord {
            id: ProcId(id),
            parent: parent.map(ProcId),
            root: ProcId(if parent.is_some() { 1 } else { id }),
            type_name: "t".into(),
            state,
            stack_indexes: stack.to_vec(),
            failure: (state == ProcState::Failed).then(|| {
                Box::new(Failure {
                    proc: ProcId(id),
                    type_name: "t".into(),
                    error: ProcError::failed("x"),
                })
            }),
            failure_seq: (state == ProcState::Failed).then_some(id),
            submitted_ms: 0,
            updated_ms: 0,
            wake_at_ms: (state == ProcState::WaitingTimeout).then_some(500),
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

    fn names(name: &str) -> Option<&'static str> {
        (name == "t").then_some("t")
    }

    /// Plans and describes the result: one line per tree (its start actions), then
    /// finished roots and corrupt procedures.
    fn check(records: Vec<ProcRecord>, expected: &[&str]) {
        let plan = plan(records, names, &|_| true, 100);
        let mut lines = Vec::new();
        for tree in plan.each_tree() {
            let order: Vec<String> = plan
                .records_of(tree)
                .iter()
                .map(|r| r.id.to_string())
                .collect();
            lines.push(format!("tree [{}]: {}", order.join(" "), tree.start));
        }
        for r in &plan.finished {
            lines.push(format!("finished {} {}", r.id, r.state));
        }
        for c in &plan.corrupt {
            lines.push(format!("corrupt {}: {}", c.id, c.reason));
        }
        assert_eq!(lines, expected);
    }

    use ProcState::*;

    #[test]
    fn healthy_trees_carry_on() {
        check(
            vec![
                // A root mid-way through its steps.
                rec(1, None, Runnable, &[0, 1]),
                // A parent whose children have all finished: it runs next.
                rec(10, None, Waiting, &[0]),
                ProcRecord {
                    root: ProcId(10),
                    ..rec(11, Some(10), Success, &[1])
                },
                // A parent with one child still running.
                rec(20, None, Waiting, &[0]),
                ProcRecord {
                    root: ProcId(20),
                    ..rec(21, Some(20), Success, &[1])
                },
                ProcRecord {
                    root: ProcId(20),
                    ..rec(22, Some(20), Runnable, &[])
                },
                // A sleeper gets its timer back.
                rec(30, None, WaitingTimeout, &[0]),
            ],
            &[
                "tree [1]:  | spawn 1, run 1",
                "tree [11 10]:  | spawn 10, run 10",
                "tree [21 22 20]:  | spawn 20, spawn 22, run 22",
                "tree [30]:  | spawn 30, wake 30 at 500",
            ],
        );
    }

    #[test]
    fn failed_trees_roll_back_covering_unrecorded_steps() {
        check(
            vec![
                // Child 3 failed; sibling 2 may have been mid-step: it gets an
                // unrecorded rollback before the recorded ones.
                rec(1, None, Waiting, &[0]),
                rec(2, Some(1), Runnable, &[1]),
                rec(3, Some(1), Failed, &[2]),
            ],
            &["tree [2 3 1]:  | spawn 1, spawn 2, spawn 3, rollback 2 interrupted unrecorded"],
        );
        check(
            vec![
                // Part-way through the rollback: 3 is rolled back, 2 and 1 remain.
                rec(1, None, Waiting, &[0]),
                rec(2, Some(1), Runnable, &[1]),
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(3),
                    ..rec(3, Some(1), RolledBack, &[])
                },
            ],
            &["tree [2 3 1]:  | spawn 1, spawn 2, rollback 2 interrupted unrecorded"],
        );
        check(
            vec![
                // 2's unrecorded step was rolled back and written (FAILED): a restart
                // goes on with its recorded steps instead of repeating that rollback.
                rec(1, None, Waiting, &[0]),
                ProcRecord {
                    failure: None,
                    failure_seq: None,
                    ..rec(2, Some(1), Failed, &[1])
                },
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(3),
                    ..rec(3, Some(1), RolledBack, &[])
                },
            ],
            &["tree [2 3 1]:  | spawn 1, spawn 2, rollback 2"],
        );
    }

    #[test]
    fn a_parent_whose_children_were_rolled_back_has_no_unrecorded_step() {
        // Child 3 failed; the rollback undid it and then 2's child 4 (no failure of
        // its own). 2 never ran after starting 4, so only its recorded step is undone.
        check(
            vec![
                rec(1, None, Waiting, &[0]),
                rec(2, Some(1), Waiting, &[1]),
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(0),
                    ..rec(3, Some(1), RolledBack, &[])
                },
                rec(4, Some(2), RolledBack, &[]),
            ],
            &["tree [4 2 3 1]:  | spawn 1, spawn 2, rollback 2"],
        );
    }

    #[test]
    fn the_first_failure_comes_from_its_sequence_number_not_the_clock() {
        // 3 failed first (sequence 0) but its record is the newer one by the clock, as
        // when both fail in one millisecond and 3's rollback rewrote it.
        let failed = |id: u64, seq: u64, updated_ms: u64| ProcRecord {
            failure_seq: Some(seq),
            updated_ms,
            ..rec(id, Some(1), Failed, &[id as u32 - 1])
        };
        let records = vec![
            rec(1, None, Waiting, &[0]),
            failed(2, 1, 5),
            failed(3, 0, 9),
        ];
        let plan = plan(records, names, &|_| true, 100);
        let result = plan.trees[0][0].stack.first_failure().cloned();
        assert_eq!(result.map(|f| f.proc), Some(ProcId(3)));
    }

    #[test]
    fn a_parent_not_waiting_for_its_unfinished_child_is_corrupt() {
        // What two swapped frames leave: the child's insert is there, the parent's
        // update that started it is older.
        check(
            vec![rec(1, None, Runnable, &[0]), rec(2, Some(1), Runnable, &[])],
            &[
                "corrupt 2: procedure 1 is RUNNABLE but its child 2 is unfinished (RUNNABLE)",
                "corrupt 1: procedure 1 is RUNNABLE but its child 2 is unfinished (RUNNABLE)",
            ],
        );
    }

    #[test]
    fn skipped_successful_entries_above_a_rolled_back_one_are_dropped() {
        // Rollback popped 5 (written), skipped the successful child's 4 and 3 (not
        // written), rolled back 2 (written); then the process died.
        check(
            vec![
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(3),
                    ..rec(1, None, Waiting, &[0])
                },
                rec(2, Some(1), Success, &[1, 3, 4]),
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(3),
                    ..rec(3, Some(1), RolledBack, &[])
                },
            ],
            &["tree [2 3 1]:  | spawn 1, rollback 1"],
        );
        // The same gap under a procedure that did not succeed is corruption.
        check(
            vec![
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(3),
                    ..rec(1, None, Waiting, &[0])
                },
                rec(2, Some(1), Runnable, &[1, 3, 4]),
                ProcRecord {
                    failure: rec(3, Some(1), Failed, &[]).failure,
                    failure_seq: Some(3),
                    ..rec(3, Some(1), RolledBack, &[])
                },
            ],
            &[
                "corrupt 2: holes in the stack indexes: expected index 2, found 3 (procedure 2)",
                "corrupt 3: holes in the stack indexes: expected index 2, found 3 (procedure 2)",
                "corrupt 1: holes in the stack indexes: expected index 2, found 3 (procedure 2)",
            ],
        );
    }

    #[test]
    fn finished_roots_keep_their_results() {
        check(
            vec![rec(1, None, Success, &[0]), rec(5, None, RolledBack, &[])],
            &["finished 1 SUCCESS", "finished 5 ROLLEDBACK"],
        );
    }

    #[test]
    fn incomplete_histories_are_corrupt_and_others_recover() {
        check(
            vec![
                // Root 1's record is missing.
                rec(2, Some(1), Runnable, &[0]),
                // Holes in root 10's stack: index 1 is nowhere.
                rec(10, None, Waiting, &[0]),
                ProcRecord {
                    root: ProcId(10),
                    ..rec(11, Some(10), Runnable, &[2])
                },
                // An unknown type.
                ProcRecord {
                    type_name: "gone".into(),
                    ..rec(20, None, Runnable, &[])
                },
                // A healthy tree beside them.
                rec(30, None, Runnable, &[]),
            ],
            &[
                "tree [30]:  | spawn 30, run 30",
                "corrupt 2: its root 1 has no record",
                "corrupt 11: holes in the stack indexes: expected index 1, found 2 (procedure 11)",
                "corrupt 10: holes in the stack indexes: expected index 1, found 2 (procedure 11)",
                "corrupt 20: procedure 20 has unknown type \"gone\"",
            ],
        );
    }

    #[test]
    fn an_operators_command_refuses_a_tree_with_a_parent_cycle() {
        // Root 1; 2 and 3 name each other as parents (and 1 as their root).
        let records = [
            rec(1, None, Waiting, &[0]),
            rec(2, Some(3), Waiting, &[]),
            rec(3, Some(2), Waiting, &[]),
        ];
        let refused = bypass(&records, ProcId(2), true, 0).unwrap_err();
        assert!(refused.contains("parent cycle"), "{refused}");
        let refused = abort(&records, ProcId(2), 0).unwrap_err();
        assert!(refused.contains("parent cycle"), "{refused}");
    }

    #[test]
    fn a_rollback_paused_below_others_is_continued_when_it_is_next() {
        // 2's rollback paused; 3 may have been in a step when the engine stopped, so
        // its unrecorded rollback goes first.
        let failure = rec(2, Some(1), Failed, &[]).failure;
        let records = [
            rec(1, None, Waiting, &[0]),
            ProcRecord {
                failure,
                failure_seq: Some(0),
                ..rec(2, Some(1), RollbackPaused, &[1])
            },
            rec(3, Some(1), Runnable, &[]),
        ];
        let (mut stack, start) = RootStack::recover(&records, names, &|_| true, 0).unwrap();
        assert!(
            start
                .to_string()
                .ends_with("rollback 3 interrupted unrecorded"),
            "{start}"
        );
        let refused = stack.on_continue(ProcId(2), 1).unwrap_err();
        assert!(refused.contains("rollback is not next"), "{refused}");
        // 3 is undone; the rollback then waits for 2's continue.
        let t = stack.on_rolled_back(ProcId(3), Ok(vec![]), 2);
        assert_eq!(t.to_string(), "U3:ROLLEDBACK[] | stop 3");
        let t = stack.on_continue(ProcId(2), 3).unwrap();
        assert!(t.to_string().ends_with("rollback 2"), "{t}");
    }

    #[test]
    fn records_the_engine_never_writes_are_corrupt_not_a_panic() {
        let child = |id, root, state, stack: &[u32]| ProcRecord {
            root: ProcId(root),
            ..rec(id, Some(root), state, stack)
        };
        check(
            vec![
                // A child's positions out of order: its rollback would pop the wrong
                // entry.
                rec(40, None, Waiting, &[0]),
                child(41, 40, Runnable, &[2, 1]),
                // Rolled back, yet with a recorded step left.
                rec(50, None, Failed, &[0]),
                child(51, 50, RolledBack, &[1]),
                // A rollback paused in a tree that never failed.
                rec(60, None, RollbackPaused, &[0]),
                // A failure sequence with no successor.
                ProcRecord {
                    failure_seq: Some(u64::MAX),
                    ..rec(70, None, Failed, &[0])
                },
            ],
            &[
                "corrupt 41: procedure 41's stack indexes are out of order or too many",
                "corrupt 40: procedure 41's stack indexes are out of order or too many",
                "corrupt 51: procedure 51 is ROLLEDBACK but still has recorded steps",
                "corrupt 50: procedure 51 is ROLLEDBACK but still has recorded steps",
                "corrupt 60: procedure 60 is ROLLBACK_PAUSED in a tree without a failure",
                "corrupt 70: procedure 70's failure sequence is u64::MAX",
            ],
        );
    }

    #[test]
    fn records_in_any_order_make_one_plan_and_records_in_tree_order_stay_put() {
        let child = |id, root, state| ProcRecord {
            root: ProcId(root),
            ..rec(id, Some(root), state, &[1])
        };
        let tree_order = vec![
            rec(1, None, Runnable, &[0]),
            // No root: dropped, between trees that stay.
            child(3, 2, Runnable),
            rec(10, None, Waiting, &[0]),
            child(11, 10, Runnable),
            // A finished root with a child left over: its result kept, the child corrupt.
            rec(20, None, Success, &[0]),
            child(21, 20, Success),
            rec(30, None, Waiting, &[0]),
            child(31, 30, Success),
            ProcRecord {
                stack_indexes: vec![2],
                ..child(32, 30, Runnable)
            },
        ];
        let described = |plan: &RecoveryPlan| -> Vec<String> {
            let mut lines: Vec<String> = plan
                .each_tree()
                .map(|t| format!("tree {:?}: {}", ids(plan.records_of(t)), t.start))
                .collect();
            lines.push(format!("finished {:?}", ids(&plan.finished)));
            lines.push(format!("corrupt {:?}", plan.corrupt));
            lines
        };
        let expected = [
            "tree [1]:  | spawn 1, run 1",
            "tree [11, 10]:  | spawn 10, spawn 11, run 11",
            "tree [31, 32, 30]:  | spawn 30, spawn 32, run 32",
            "finished [20]",
        ];
        let mut by_id = tree_order.clone();
        by_id.sort_by_key(|r| std::cmp::Reverse(r.id));
        by_id.sort_by_key(|r| r.id);
        let mut reversed = tree_order.clone();
        reversed.reverse();
        for records in [tree_order.clone(), by_id, reversed] {
            let lines = described(&plan(records, names, &|_| true, 100));
            assert_eq!(lines[..4], expected);
            assert!(lines[4].contains("id: ProcId(3)") && lines[4].contains("id: ProcId(21)"));
        }
        // In tree order nothing moves but the dropped records and the children put
        // before their parents: the part is the buffer that came in.
        let buffer = tree_order.as_ptr();
        let planned = plan(tree_order, names, &|_| true, 100);
        assert_eq!(planned.records.len(), 1);
        assert_eq!(planned.records[0].as_ptr(), buffer);
        assert_eq!(ids(&planned.records[0]), [1, 11, 10, 31, 32, 30]);
    }

    fn ids(records: &[ProcRecord]) -> Vec<u64> {
        records.iter().map(|r| r.id.0).collect()
    }

    #[test]
    fn an_offline_abort_fails_the_procedure_and_its_tree_rolls_back() {
        // Root 1 waits for 2 (suspended on an event) and 3 (runnable).
        let suspended = ProcRecord {
            event: Some("e".into()),
            ..rec(2, Some(1), Waiting, &[1])
        };
        let records = vec![
            rec(1, None, Waiting, &[0]),
            suspended,
            rec(3, Some(1), Runnable, &[]),
        ];
        let ops = abort(&records, ProcId(2), 77).unwrap();
        let [StoreOp::Update(aborted)] = &ops[..] else {
            panic!("{ops:?}");
        };
        assert_eq!(aborted.state, Waiting, "the state it was written with");
        assert_eq!(aborted.failure_seq, Some(0));
        assert_eq!(aborted.updated_ms, 77);
        let failure = aborted.failure.clone().unwrap();
        assert_eq!(
            (failure.proc, failure.error),
            (ProcId(2), ProcError::Aborted)
        );
        // Recovery rolls the tree back with the abort as its result; 2 and 3 may have
        // been mid-step, so each gets an unrecorded rollback first.
        let mut latest: std::collections::BTreeMap<ProcId, ProcRecord> =
            records.into_iter().map(|r| (r.id, r)).collect();
        for op in ops {
            op.apply_to(&mut latest);
        }
        let records: Vec<ProcRecord> = latest.into_values().collect();
        check(
            records.clone(),
            &["tree [2 3 1]:  | spawn 1, spawn 2, spawn 3, rollback 3 interrupted unrecorded"],
        );
        let plan = plan(records.clone(), names, &|_| true, 100);
        let first = plan.trees[0][0].stack.first_failure().cloned().unwrap();
        assert_eq!((first.proc, first.error), (ProcId(2), ProcError::Aborted));
        // Once aborted, the tree is rolling back: a second abort is refused.
        let again = abort(&records, ProcId(3), 100).unwrap_err();
        assert!(again.contains("tree 1 is already rolling back"), "{again}");
    }

    #[test]
    fn offline_abort_refusals_say_why() {
        let records = vec![
            rec(1, None, Waiting, &[0]),
            ProcRecord {
                root: ProcId(1),
                ..rec(2, Some(1), Success, &[1])
            },
            rec(5, None, Success, &[0]),
            rec(7, None, Waiting, &[0]),
            ProcRecord {
                root: ProcId(7),
                ..rec(8, Some(7), Failed, &[1])
            },
        ];
        let cases = [
            (9, "procedure 9 is not in the store"),
            (2, "procedure 2 has already finished (SUCCESS)"),
            (5, "procedure 5 has already finished (SUCCESS)"),
            (7, "tree 7 is already rolling back"),
        ];
        for (id, expected) in cases {
            let got = abort(&records, ProcId(id), 0).unwrap_err();
            assert!(got.contains(expected), "{id}: {got}");
        }
        // The parent is not finished: the abort is accepted.
        assert!(abort(&records, ProcId(1), 0).is_ok());
    }
}
