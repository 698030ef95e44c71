//! Random event sequences against the core (a model-based test): steps that end in
//! every outcome (`WaitAny`, `Children`, done, more, yield, failures under each policy),
//! timer wakes, operator pauses, continues and bypasses, timeouts past the point of no
//! return, and crashes recovered from the records so far. After every transition it
//! checks that nothing is queued twice or in a failed tree, that a per-child parent
//! waiting for its children has seen every child that succeeded, that a healthy tree
//! never stalls with nothing to run, that every set of records recovers, and that a
//! step a crash cut off is marked to be undone. `PROCTOR_CORE_SEEDS` sets how many
//! seeds run (5 000 by default).
use super::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

struct Sim {
    rs: RootStack,
    queue: VecDeque<u64>,
    running: Vec<(u64, BTreeSet<u64>)>,
    timers: BTreeSet<u64>,
    paused: BTreeSet<u64>,
    pause_req: BTreeSet<u64>,
    cell_failed: BTreeSet<u64>,
    seen: BTreeMap<u64, BTreeSet<u64>>,
    next_id: u64,
    records: BTreeMap<u64, ProcRecord>,
    log: Vec<String>,
    finished: bool,
    rolling_back: bool,
}

fn kid(id: u64) -> NewChild {
    NewChild {
        id: ProcId(id),
        type_name: "t",
        data: vec![],
        locks: None,
        deadline_ms: None,
        nonce: None,
    }
}

impl Sim {
    fn apply(&mut self, what: String, t: Transition) {
        self.log.push(format!("{what} => {t}"));
        for op in t.persist {
            match op {
                StoreOp::Insert(r) | StoreOp::Update(r) => {
                    self.records.insert(r.id.0, r);
                }
                StoreOp::Delete(id) => {
                    self.records.remove(&id.0);
                }
            }
        }
        for a in t.actions {
            match a {
                Action::Enqueue { id, .. } => {
                    let id = id.0;
                    assert!(
                        !self.queue.contains(&id) && !self.running.iter().any(|r| r.0 == id),
                        "{id} queued twice\n{}",
                        self.log.join("\n")
                    );
                    assert!(
                        !self.rs.is_failed(),
                        "{id} queued in a failed tree\n{}",
                        self.log.join("\n")
                    );
                    self.queue.push_back(id);
                }
                Action::WakeAt { id, .. } => {
                    self.timers.insert(id.0);
                }
                Action::Paused { id, .. } => {
                    self.paused.insert(id.0);
                    self.pause_req.remove(&id.0);
                }
                Action::Reset { id, .. } => {
                    self.cell_failed.remove(&id.0);
                }
                Action::Rollback { .. } | Action::RetryRollback { .. } => self.rolling_back = true,
                Action::Finished(_) => self.finished = true,
                _ => {}
            }
        }
        self.check_seen();
    }

    /// A per-child parent waiting for its children, not queued, has seen every child
    /// that succeeded.
    fn check_seen(&self) {
        if self.rs.is_failed() || self.finished {
            return;
        }
        for (&id, n) in self.rs.nodes.iter() {
            let id = id.0;
            if n.state != ProcState::Waiting || !n.steering.wakes_per_child || n.event.is_some() {
                continue;
            }
            let succeeded: BTreeSet<u64> = self
                .rs
                .nodes
                .iter()
                .filter(|(_, c)| c.parent == Some(ProcId(id)) && c.state == ProcState::Success)
                .map(|(c, _)| c.0)
                .collect();
            let seen = self.seen.get(&id).cloned().unwrap_or_default();
            assert!(
                succeeded.is_subset(&seen),
                "parent {id} waits, missing the success of {:?}\n{}",
                succeeded.difference(&seen).collect::<Vec<_>>(),
                self.log.join("\n")
            );
        }
    }

    fn recover_ok(&self) {
        let records: Vec<ProcRecord> = self.records.values().cloned().collect();
        if let Err(e) = RootStack::recover(&records, |_| Some("t"), &|_| true, 100) {
            panic!("recovery refuses: {e}\n{}", self.log.join("\n"));
        }
    }
}

fn run(seed: u64) {
    let (rs, t) = RootStack::submit(kid(1), 0);
    let mut sim = Sim {
        rs,
        queue: VecDeque::new(),
        running: Vec::new(),
        timers: BTreeSet::new(),
        paused: BTreeSet::new(),
        pause_req: BTreeSet::new(),
        cell_failed: BTreeSet::new(),
        seen: BTreeMap::new(),
        next_id: 2,
        records: BTreeMap::new(),
        log: Vec::new(),
        finished: false,
        rolling_back: false,
    };
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let ponr = rng.below(2) == 0;
    let allow_fail = rng.below(4) == 0;
    sim.apply("submit".into(), t);
    let mut first_root_step = true;
    for _ in 0..400 {
        if sim.finished || sim.rolling_back {
            break;
        }
        sim.recover_ok();
        let ev = rng.below(9);
        match ev {
            // Dispatch the next queued step.
            0 | 1 if !sim.queue.is_empty() => {
                let id = sim.queue.pop_front().unwrap();
                if sim.rs.is_failed() || sim.cell_failed.contains(&id) {
                    let t = sim.rs.on_step(
                        StepReport {
                            id: ProcId(id),
                            outcome: StepOutcome::Skipped,
                            data: vec![],
                            result: None,
                            irreversible: false,
                            on_error: None,
                        },
                        1,
                    );
                    sim.apply(format!("{id} skipped"), t);
                } else if sim.pause_req.remove(&id) {
                    let t = sim.rs.on_step(
                        StepReport {
                            id: ProcId(id),
                            outcome: StepOutcome::Paused,
                            data: vec![],
                            result: None,
                            irreversible: false,
                            on_error: None,
                        },
                        1,
                    );
                    sim.apply(format!("{id} paused at step"), t);
                } else {
                    assert_eq!(
                        sim.rs.has_children(ProcId(id)),
                        sim.rs.children_of(ProcId(id)).is_some(),
                        "has_children of {id} agrees with children_of"
                    );
                    let snap: BTreeSet<u64> = sim
                        .rs
                        .children_of(ProcId(id))
                        .unwrap_or_default()
                        .states
                        .iter()
                        .filter(|(_, s)| *s == ProcState::Success)
                        .map(|(c, _)| c.0)
                        .collect();
                    sim.log.push(format!("dispatch {id} sees {snap:?}"));
                    sim.running.push((id, snap));
                }
            }
            // A running step ends.
            2 | 3 if !sim.running.is_empty() => {
                let i = rng.below(sim.running.len() as u64) as usize;
                let (id, snap) = sim.running.remove(i);
                sim.seen.insert(id, snap);
                let pending = sim.rs.nodes[&ProcId(id)].pending_children;
                let room = sim.next_id < 12;
                let kids = |rng: &mut Rng, max: u64, sim: &mut Sim| -> Vec<NewChild> {
                    if !room {
                        return Vec::new();
                    }
                    (0..rng.below(max + 1))
                        .map(|_| {
                            let k = kid(sim.next_id);
                            sim.next_id += 1;
                            k
                        })
                        .collect()
                };
                let policy_fail = |rng: &mut Rng| {
                    let policy = match rng.below(3) {
                        0 => FailurePolicy::RetryThenPause {
                            times: 1,
                            backoff_ms: 1,
                        },
                        1 => FailurePolicy::Pause,
                        _ => FailurePolicy::RetryThenRollback {
                            times: 1,
                            backoff_ms: 1,
                        },
                    };
                    // Not marked, retryable (under the step's retry policy or
                    // the procedure's), or terminal.
                    let (error, retry) = match rng.below(4) {
                        0 => (ProcError::retryable(ProcError::failed("x")), None),
                        1 => (
                            ProcError::retryable(ProcError::failed("x")),
                            Some(Box::new(RetryPolicy::new(1).backoff_ms(1))),
                        ),
                        2 => (ProcError::terminal(ProcError::failed("x")), None),
                        _ => (ProcError::failed("x"), None),
                    };
                    (
                        StepOutcome::Failed(error),
                        Some(OnError {
                            policy,
                            before: vec![],
                            retry,
                        }),
                    )
                };
                let (outcome, on_error) = match (pending > 0, rng.below(10)) {
                    (true, 0..=5) => (StepOutcome::Spawn(kids(&mut rng, 1, &mut sim)), None),
                    (true, 6) => {
                        let k = kids(&mut rng, 1, &mut sim);
                        if k.is_empty() {
                            (StepOutcome::Spawn(k), None)
                        } else {
                            (StepOutcome::Children(k), None)
                        }
                    }
                    (true, 7) => (StepOutcome::Yield, None),
                    (true, _) => policy_fail(&mut rng),
                    (false, 0..=2) => (StepOutcome::Done, None),
                    (false, 3) => (StepOutcome::MoreToDo { yield_after: false }, None),
                    (false, 4..=5) => (StepOutcome::Spawn(kids(&mut rng, 2, &mut sim)), None),
                    (false, 6) => (StepOutcome::Children(kids(&mut rng, 2, &mut sim)), None),
                    (false, 7) => (StepOutcome::Yield, None),
                    (false, 8) if allow_fail => {
                        (StepOutcome::Failed(ProcError::failed("boom")), None)
                    }
                    (false, _) => policy_fail(&mut rng),
                };
                let irreversible = ponr && id == 1 && first_root_step;
                if id == 1 {
                    first_root_step = false;
                }
                let name = format!("{id} ends {outcome:?}");
                let t = sim.rs.on_step(
                    StepReport {
                        id: ProcId(id),
                        outcome,
                        data: vec![],
                        result: None,
                        irreversible,
                        on_error,
                    },
                    1,
                );
                sim.apply(name, t);
            }
            4 if !sim.timers.is_empty() => {
                let id = *sim.timers.iter().next().unwrap();
                sim.timers.remove(&id);
                let t = sim.rs.on_wake(ProcId(id));
                sim.apply(format!("wake {id}"), t);
            }
            5 if !sim.paused.is_empty() => {
                let id = *sim.paused.iter().next().unwrap();
                sim.paused.remove(&id);
                if let Ok(t) = sim.rs.on_continue(ProcId(id), 1) {
                    sim.apply(format!("continue {id}"), t);
                }
            }
            6 => {
                // An operator's pause, or a bypass, of a random procedure.
                let id = 1 + rng.below(sim.next_id - 1);
                let running = sim.running.iter().any(|r| r.0 == id);
                if rng.below(2) == 0 {
                    if sim.rs.pause_refusal(ProcId(id)).is_none() {
                        if sim.rs.waits_for_wake(ProcId(id)) && !sim.cell_failed.contains(&id) {
                            if let Some(t) = sim.rs.on_pause_waiting(ProcId(id), vec![], 1) {
                                sim.timers.remove(&id);
                                sim.apply(format!("pause now {id}"), t);
                            }
                        } else {
                            sim.log.push(format!("pause asked {id}"));
                            sim.pause_req.insert(id);
                        }
                    }
                } else if id != 1 {
                    // Forced (HBCK2's `bypass -o`), a procedure queued or in a step may
                    // go too: the runner drops its step.
                    let reach = if rng.below(3) == 0 {
                        BypassReach::Forced
                    } else {
                        BypassReach::Waiting
                    };
                    let refused = running && reach == BypassReach::Waiting;
                    if let Some(t) = (!refused)
                        .then(|| {
                            sim.rs
                                .on_bypass(ProcId(id), false, reach, &|_| Vec::new(), 1)
                        })
                        .and_then(Result::ok)
                    {
                        sim.timers.remove(&id);
                        sim.paused.remove(&id);
                        sim.pause_req.remove(&id);
                        sim.queue.retain(|&q| q != id);
                        sim.running.retain(|r| r.0 != id);
                        sim.apply(format!("bypass {id} {reach:?}"), t);
                    }
                }
            }
            7 => {
                // A timeout past the point of no return, between calls.
                let id = 1 + rng.below(sim.next_id - 1);
                let running = sim.running.iter().any(|r| r.0 == id);
                let live = sim
                    .rs
                    .nodes
                    .get(&ProcId(id))
                    .is_some_and(|n| !n.state.is_finished() && n.state != ProcState::Paused);
                if sim.rs.is_irreversible() && !running && live && !sim.cell_failed.contains(&id) {
                    sim.cell_failed.insert(id);
                    let t = sim.rs.on_fail(ProcId(id), ProcError::Aborted, vec![], 1);
                    sim.timers.remove(&id);
                    sim.apply(format!("timeout {id}"), t);
                }
            }
            8 if rng.below(4) == 0 => {
                // A crash and a restart from the records.
                let records: Vec<ProcRecord> = sim.records.values().cloned().collect();
                let (rs, t) = RootStack::recover(&records, |_| Some("t"), &|_| true, 100).unwrap();
                let cut_off: Vec<u64> = sim.running.iter().map(|r| r.0).collect();
                for &id in &cut_off {
                    let n = &rs.nodes[&ProcId(id)];
                    if n.state.is_finished() {
                        continue;
                    }
                    let undone = if rs.is_failed() {
                        rs.stack.iter().any(|e| e.id == ProcId(id) && !e.recorded)
                    } else {
                        n.steering.dirty
                    };
                    assert!(
                        undone,
                        "seed {seed}: {id}'s step cut off by the crash is not marked to undo ({})\n{}",
                        n.state,
                        sim.log.join("\n")
                    );
                }
                sim.rs = rs;
                sim.queue.clear();
                sim.running.clear();
                sim.timers.clear();
                sim.pause_req.clear();
                sim.cell_failed.clear();
                sim.seen.clear();
                sim.paused = sim
                    .rs
                    .nodes
                    .iter()
                    .filter(|(_, n)| n.state == ProcState::Paused)
                    .map(|(id, _)| id.0)
                    .collect();
                sim.apply("crash, recover".into(), t);
            }
            _ => {}
        }
        // The core counts as running exactly the steps queued or in progress.
        assert_eq!(
            sim.rs.running as usize,
            sim.queue.len() + sim.running.len(),
            "seed {seed}: steps counted as running\n{}",
            sim.log.join("\n")
        );
        let idle = sim.queue.is_empty()
            && sim.running.is_empty()
            && sim.timers.is_empty()
            && sim.paused.is_empty();
        if idle && !sim.finished && !sim.rolling_back && !sim.rs.is_failed() {
            panic!("seed {seed}: hang, nothing runs\n{}", sim.log.join("\n"));
        }
    }
}

#[test]
fn random_event_sequences_keep_the_tree_consistent() {
    let seeds: u64 = std::env::var("PROCTOR_CORE_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5_000);
    for seed in 1..=seeds {
        run(seed);
    }
}
