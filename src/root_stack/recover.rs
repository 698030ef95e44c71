//! Rebuilding a tree from its records after a restart: [`RootStack::recover`], with
//! the checks that refuse a log the engine never writes.

use super::{Node, NodeExtra, NodeMap, Phase, Place, RootStack, StackEntry, Transition};
use crate::procedure::{ProcId, ProcState};
use crate::record::{ProcRecord, RootNonce, MAX_RECORDED_STEPS};
use crate::root_stack::Action;

impl RootStack {
    /// Rebuilds a tree from its records after a restart (HBase's and IoTDB's load):
    /// the stack from the persisted stack indexes, pending children per parent, and the
    /// first failure. The transition persists nothing; its actions start the actors of
    /// every unfinished procedure and carry the tree on:
    ///
    /// - a healthy tree queues its RUNNABLE procedures and every WAITING parent whose
    ///   children have all finished, re-arms sleep deadlines and re-suspends on events;
    /// - a failed tree rolls back at once (nothing is running after a restart). Before
    ///   the recorded steps, every unfinished procedure that may have been in the middle
    ///   of a step gets one *unrecorded* rollback, so a step that started but was never
    ///   recorded is undone too.
    ///
    /// `records` are all records of one tree, root included; `names` maps stored type
    /// names to the registry's; `cut_off` says whether a procedure may have been in a
    /// step nobody recorded when the engine stopped (any, after a crash; after a
    /// drained shutdown, only those an earlier crash may have cut off: see
    /// [`LastStop`](crate::LastStop)). Fails, naming the reason, when the history is
    /// incomplete: a missing root or parent, holes in the stack indexes.
    pub fn recover(
        records: &[ProcRecord],
        names: impl Fn(&str) -> Option<&'static str>,
        cut_off: &dyn Fn(ProcId) -> bool,
        now_ms: u64,
    ) -> Result<(Self, Transition), String> {
        let root = match records.iter().find(|r| r.parent.is_none()) {
            Some(r) => r.id,
            None => return Err("the root's record is missing".into()),
        };
        let mut nodes = NodeMap::with_capacity(records.len());
        let mut indexed: Vec<(u32, ProcId)> = Vec::new();
        for r in records {
            if r.root != root {
                return Err(format!(
                    "procedure {} belongs to root {}, not {root}",
                    r.id, r.root
                ));
            }
            let type_name = names(&r.type_name)
                .ok_or_else(|| format!("procedure {} has unknown type {:?}", r.id, r.type_name))?;
            indexed.extend(r.stack_indexes.iter().map(|&i| (i, r.id)));
            nodes.insert(
                r.id,
                Node {
                    parent: r.parent,
                    type_name,
                    state: r.state,
                    stack_indexes: r.stack_indexes.clone(),
                    pending_children: 0,
                    submitted_ms: r.submitted_ms,
                    wake_at_ms: r.wake_at_ms,
                    event: r.event.as_deref().map(Box::from),
                    failure: r.failure.clone(),
                    stopped: r.state.is_finished(),
                    locks: r.locks.clone().map(Box::new),
                    deadline_ms: r.deadline_ms,
                    bypassed: r.bypassed,
                    steering: r.steering.clone(),
                    extra: NodeExtra {
                        failure_seq: r.failure_seq,
                        rollback_attempts: 0,
                        nonce: r.nonce.map(|nonce| RootNonce {
                            nonce,
                            fingerprint: r.nonce_fingerprint,
                        }),
                        result: r.result.clone(),
                        paused_data: matches!(
                            r.state,
                            ProcState::Paused | ProcState::RollbackPaused
                        )
                        .then(|| r.data.clone()),
                        pause_at_step: None,
                        children: Vec::new(),
                    }
                    .boxed(),
                    unseen_child: false,
                    cut_off: false,
                },
            );
        }
        let failed = records.iter().any(|r| r.failure.is_some());
        for r in records {
            if r.failure.is_some() != r.failure_seq.is_some() {
                return Err(format!(
                    "procedure {} has a failure without its sequence number (or the converse)",
                    r.id
                ));
            }
            if r.failure_seq == Some(u64::MAX) {
                return Err(format!("procedure {}'s failure sequence is u64::MAX", r.id));
            }
            // A procedure's steps are pushed on the stack in order and popped from the
            // top: its positions only grow. (The stores' decoders check this too; a
            // store of another kind may not.)
            if !r.stack_indexes.windows(2).all(|w| w[0] < w[1])
                || r.stack_indexes.len() > MAX_RECORDED_STEPS
            {
                return Err(format!(
                    "procedure {}'s stack indexes are out of order or too many",
                    r.id
                ));
            }
            // Rolled back means every recorded step was undone and popped; only a
            // success keeps its positions (rollback skips them).
            if r.state.is_finished() && r.state != ProcState::Success && !r.stack_indexes.is_empty()
            {
                return Err(format!(
                    "procedure {} is {} but still has recorded steps",
                    r.id, r.state
                ));
            }
            // A rollback pauses only in a tree that is rolling back, after a failure.
            if r.state == ProcState::RollbackPaused && !failed {
                return Err(format!(
                    "procedure {} is ROLLBACK_PAUSED in a tree without a failure",
                    r.id
                ));
            }
            if let Some(parent) = r.parent {
                let Some(p) = nodes.get_mut(&parent) else {
                    return Err(format!("procedure {}'s parent {parent} is missing", r.id));
                };
                p.extra().children.push(r.id);
                if r.state == ProcState::Success {
                    // Waking per child, the parent may have been woken for it.
                    p.unseen_child = true;
                }
                if !r.state.is_finished() {
                    p.pending_children += 1;
                    // A parent starts its children in the same record that makes it
                    // WAITING, and is woken only once all of them finished; in a healthy
                    // tree any other state beside an unfinished child is a log that was
                    // reordered or mixed from different times.
                    // (A PAUSED parent was paused at once while they ran: a failure
                    // past its tree's point of no return, its timeout.) One that wakes
                    // per child runs steps while they run, and may retry one, so it may
                    // be recorded in any unfinished state but waiting for an event.
                    let waits = matches!(p.state, ProcState::Waiting | ProcState::Paused)
                        || (p.steering.wakes_per_child && !p.state.is_finished());
                    if !failed && (!waits || p.event.is_some()) {
                        return Err(format!(
                            "procedure {parent} is {} but its child {} is unfinished ({})",
                            p.state, r.id, r.state
                        ));
                    }
                }
            }
        }
        for node in nodes.values_mut() {
            if let Some(extra) = node.extra.as_mut() {
                // Ids only grow: their order is the order the parent started them.
                extra.children.sort_unstable();
            }
        }
        indexed.sort_unstable();
        let mut stack = Vec::with_capacity(indexed.len());
        for (expected, &(index, id)) in indexed.iter().enumerate() {
            if index as usize == expected {
                stack.push(StackEntry { id, recorded: true });
                continue;
            }
            // Rollback pops from the top and does not write when it skips a successful
            // procedure's entries, so once an entry below them has been rolled back (and
            // written), those skipped entries are all that can remain above the gap.
            let skipped = &indexed[expected..];
            let only_skipped = failed
                && skipped
                    .iter()
                    .all(|(_, id)| nodes.get(id).is_some_and(|n| n.state == ProcState::Success));
            if !only_skipped {
                return Err(format!(
                    "holes in the stack indexes: expected index {expected}, found {index} (procedure {id})"
                ));
            }
            for node in nodes.values_mut() {
                node.stack_indexes.retain(|&i| (i as usize) < expected);
            }
            break;
        }
        // The first failure: the smallest failure sequence number the tree recorded.
        let first = records
            .iter()
            .filter_map(|r| Some((r.failure_seq?, r.failure.as_ref()?)))
            .min_by_key(|(seq, _)| *seq);
        let failures = records
            .iter()
            .filter_map(|r| r.failure_seq)
            .max()
            .map_or(0, |seq| seq + 1); // below u64::MAX, checked above
        let mut tree = RootStack {
            root,
            nodes,
            stack,
            running: 0,
            failure: first.map(|(_, f)| f.clone()),
            failures,
            phase: Phase::Executing,
            undone: None,
        };
        // Each unfinished procedure is spawned and, at most, queued, suspended or
        // put to sleep: sized for that, as every recovered tree's plan holds this
        // until its actor starts.
        let unfinished = tree.nodes.iter().filter(|(_, n)| !n.state.is_finished());
        let mut t = Transition {
            persist: Vec::new(),
            actions: Vec::with_capacity(2 * unfinished.count()),
        };
        for (&id, node) in tree.nodes.iter() {
            if !node.state.is_finished() {
                t.actions.push(Action::Spawn(id));
            }
        }
        if tree.is_failed() {
            // A parent is woken only once all its children succeeded; one with a child
            // that did not (failed, or rolled back for another's failure) never ran
            // again and has nothing unrecorded.
            let failed_child_of: std::collections::BTreeSet<ProcId> = records
                .iter()
                .filter(|r| r.state != ProcState::Success)
                .filter_map(|r| r.parent)
                .collect();
            // Those that may have been mid-step at the crash, and those whose failed
            // attempt, to be retried or paused, is unrecorded: each gets an unrecorded
            // rollback, the first kind told it was interrupted (`cut_off`).
            let mut cut = Vec::new();
            let maybe_mid_step: Vec<ProcId> = tree
                .nodes
                .iter()
                .filter(|(id, n)| {
                    // One that wakes per child may have been woken by a child that
                    // succeeded, whatever the others did.
                    let woken = (n.steering.wakes_per_child && n.unseen_child)
                        || (n.pending_children == 0 && !failed_child_of.contains(id));
                    let mid_step = !n.state.is_finished()
                        && n.state != ProcState::Failed
                        && n.state != ProcState::RollbackPaused
                        && woken
                        && cut_off(**id);
                    if mid_step {
                        cut.push(**id);
                    }
                    mid_step || (n.steering.dirty && !n.state.is_finished())
                })
                .map(|(&id, _)| id)
                .collect();
            for id in cut {
                tree.node_mut(id).cut_off = true;
            }
            tree.roll_back_from(maybe_mid_step, &mut t, now_ms);
            return Ok((tree, t));
        }
        let ids: Vec<ProcId> = tree.nodes.iter().map(|(&id, _)| id).collect();
        for id in ids {
            let node = &tree.nodes[&id];
            // A waiting one too: a wake (its timer, its event) queues the next step
            // without a record.
            // One waking per child was woken, unrecorded, by any child that succeeded.
            let woken =
                node.pending_children == 0 || (node.steering.wakes_per_child && node.unseen_child);
            // Its next step, if any, sees every child as it is now.
            tree.node_mut(id).unseen_child = false;
            let node = &tree.nodes[&id];
            let may_have_run = match node.state {
                ProcState::Runnable | ProcState::Initializing | ProcState::WaitingTimeout => true,
                ProcState::Waiting => woken,
                _ => false,
            };
            if may_have_run && cut_off(id) {
                // It may have been in the middle of a step the crash kept from being
                // recorded. If the tree fails before that step runs again, its rollback
                // undoes it first, as it would have had the tree failed before the crash
                // (the step, run again and recorded or failed, clears this).
                let node = tree.node_mut(id);
                node.steering.dirty = true;
                node.cut_off = true;
            }
            let node = &tree.nodes[&id];
            match node.state {
                ProcState::Runnable | ProcState::Initializing => {
                    tree.enqueue(&mut t, id, Place::Back)
                }
                ProcState::Waiting if node.event.is_some() => {
                    let event = node.event.as_deref().unwrap_or_default().to_string();
                    t.actions.push(Action::SuspendOn { id, event });
                }
                ProcState::Waiting if woken => tree.enqueue(&mut t, id, Place::Back),
                ProcState::WaitingTimeout => {
                    let at_ms = node.wake_at_ms.unwrap_or(now_ms);
                    t.actions.push(Action::WakeAt { id, at_ms });
                }
                _ => {}
            }
        }
        Ok((tree, t))
    }
}
