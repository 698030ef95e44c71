//! The procedure table's rows a transition publishes once durable, and what recovery
//! publishes.

use super::*;

/// What one persisted op changes in the procedure table; applied once the op is durable.
pub(super) enum Row {
    /// Boxed: an entry is much larger than an update.
    Insert(ProcId, Box<Entry>),
    Update {
        id: ProcId,
        state: ProcState,
        steps: u32,
        updated_ms: u64,
        value: Option<Vec<u8>>,
        bypassed: bool,
        waiting: Waiting,
        state_name: Option<String>,
        steering: Option<Box<Steering>>,
    },
}

/// The rows one transition changes: most transitions write one record, whose row is
/// kept inline (no allocation per step).
#[derive(Default)]
pub(super) enum Rows {
    #[default]
    None,
    One(Row),
    Many(Vec<Row>),
}

impl Rows {
    fn push(&mut self, row: Row) {
        *self = match std::mem::take(self) {
            Rows::None => Rows::One(row),
            Rows::One(first) => Rows::Many(vec![first, row]),
            Rows::Many(mut rows) => {
                rows.push(row);
                Rows::Many(rows)
            }
        };
    }

    pub(super) fn as_mut_slice(&mut self) -> &mut [Row] {
        match self {
            Rows::None => &mut [],
            Rows::One(row) => std::slice::from_mut(row),
            Rows::Many(rows) => rows,
        }
    }
}

/// What `ops` will change in the procedure table once they are durable.
pub(super) fn rows(shared: &Shared, ops: &[StoreOp], tree: Option<&TreeAddr>) -> Rows {
    let mut rows = Rows::None;
    for op in ops {
        rows.push(match op {
            StoreOp::Insert(r) => Row::Insert(r.id, Box::new(entry(shared, r, tree))),
            StoreOp::Update(r) => Row::Update {
                id: r.id,
                state: r.state,
                steps: steps_of(r),
                updated_ms: r.updated_ms,
                value: r.result.clone(),
                bypassed: r.bypassed,
                waiting: Waiting::of(r),
                state_name: None,
                steering: steering_of(r),
            },
            StoreOp::Delete(_) => continue,
        });
    }
    rows
}

/// The table's entry for a new procedure, from its record.
pub(super) fn entry(shared: &Shared, r: &ProcRecord, tree: Option<&TreeAddr>) -> Entry {
    Entry {
        root: r.root,
        parent: r.parent,
        type_name: shared.registry.static_name(&r.type_name).unwrap_or("?"),
        state: r.state,
        steps: steps_of(r),
        submitted_ms: r.submitted_ms,
        updated_ms: r.updated_ms,
        tree: tree.cloned(),
        extra: EntryExtra {
            nonce: r.nonce,
            bypassed: r.bypassed,
            ..EntryExtra::default()
        }
        .boxed(),
        waiting: Waiting::of(r),
        state_name: None,
        steering: steering_of(r),
    }
}

/// A record's steps not rolled back.
fn steps_of(r: &ProcRecord) -> u32 {
    u32::try_from(r.stack_indexes.len()).unwrap_or(u32::MAX)
}

/// A record's steering, boxed and only when there is any (most procedures never fail).
pub(super) fn steering_of(r: &ProcRecord) -> Option<Box<Steering>> {
    (r.steering != Steering::default()).then(|| Box::new(r.steering.clone()))
}

pub(super) fn apply_rows(shared: &Shared, rows: Rows) {
    match rows {
        Rows::None => {}
        Rows::One(row) => apply_row(shared, row),
        Rows::Many(rows) => rows.into_iter().for_each(|row| apply_row(shared, row)),
    }
}

fn apply_row(shared: &Shared, row: Row) {
    match row {
        Row::Insert(id, entry) => {
            let state = entry.state;
            let old = shared.table.insert(id, *entry).map(|e| e.state);
            shared.proc_gauges.moved(old, Some(state));
        }
        Row::Update {
            id,
            state,
            steps,
            updated_ms,
            value,
            bypassed,
            waiting,
            state_name,
            steering,
        } => {
            if let Some(mut e) = shared.table.get_mut(&id) {
                shared.proc_gauges.moved(Some(e.state), Some(state));
                e.steering = steering;
                e.state = state;
                e.steps = steps;
                e.updated_ms = updated_ms;
                e.waiting = waiting;
                if state_name.is_some() {
                    e.state_name = state_name;
                }
                if value.is_some() {
                    e.extra_mut().value = value;
                }
                if bypassed {
                    e.extra_mut().bypassed = true;
                }
            }
        }
    }
}

/// Mirrors the recovered records of the tree `tree` into the procedure table (they are
/// durable by definition), for `GetState`, `List` and `Abort`.
pub(crate) fn publish_recovered<'a>(
    shared: &Shared,
    records: impl Iterator<Item = &'a ProcRecord>,
    tree: &TreeAddr,
) {
    for r in records {
        let old = shared.table.insert(r.id, entry(shared, r, Some(tree)));
        shared
            .proc_gauges
            .moved(old.map(|e| e.state), Some(r.state));
    }
}
