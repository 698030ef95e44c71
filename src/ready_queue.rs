//! The scheduler's ready queue: the order in which queued steps run ([`Scheduling`]:
//! the multilevel fair queue of [`Mlfq`], or FIFO with a front for procedures that
//! continue), and a bound on how many steps run at once (the workers).
//!
//! Pure and generic so the rules are unit-tested; the scheduler actor owns one, and
//! tells it each finished step's run time ([`charge`](ReadyQueue::charge)) and when a
//! tree ended ([`forget`](ReadyQueue::forget)).

use std::collections::VecDeque;
use std::hash::Hash;

use crate::mlfq::Mlfq;

/// How the scheduler picks the next step among the queued ones
/// ([`ExecutorBuilder::scheduling`](crate::ExecutorBuilder::scheduling)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scheduling {
    /// A multilevel feedback queue, in the manner of Trino's: trees are put on levels by
    /// the step time they have run (from 0, 1, 10, 60 and 300 s), each level gets half
    /// the run time of the one below it, and within a level the tree with less time
    /// goes first. A tree of a few short steps is not held up behind trees that run
    /// hundreds of long steps. Steps are not preempted: a step waits for a free worker,
    /// and [`ExecutorBuilder::reserved_workers`](crate::ExecutorBuilder::reserved_workers)
    /// keeps workers free for trees on level 0.
    #[default]
    Fair,
    /// First in, first out, with a front: a procedure continuing its steps goes before
    /// everything queued, so long procedures keep their workers until they end.
    Fifo,
}

#[derive(Debug)]
enum Order<T, R> {
    Fair(Mlfq<T, R>),
    Fifo(VecDeque<T>),
}

/// Which workers a dispatched item counts against: what [`ReadyQueue::pop`] says and
/// [`ReadyQueue::complete`] is given back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lane {
    /// A step of any other type: one of the `workers`.
    Shared,
    /// A system procedure's step: one of the system workers while any is free, else one
    /// of the `workers`.
    System,
}

/// Queued items and the count of items dispatched but not completed; `R` names the
/// tree an item belongs to.
#[derive(Debug)]
pub struct ReadyQueue<T, R> {
    /// Steps of system procedures: before everything else, in arrival order.
    urgent: VecDeque<T>,
    order: Order<T, R>,
    workers: usize,
    /// Items running, system items included.
    busy: usize,
    /// Workers only level 0 of the fair order may take (fewer than `workers`).
    reserved: usize,
    /// Workers beside `workers` that only system items take.
    system_workers: usize,
    /// System items running (on their own workers first, then on shared ones).
    busy_system: usize,
}

impl<T, R: Hash + Eq> ReadyQueue<T, R> {
    /// A queue in the given order that lets at most `workers` items run at once.
    ///
    /// # Panics
    /// If `workers` is 0.
    pub fn new(workers: usize, scheduling: Scheduling) -> Self {
        assert!(workers > 0, "a ready queue needs at least one worker");
        let order = match scheduling {
            Scheduling::Fair => Order::Fair(Mlfq::new()),
            Scheduling::Fifo => Order::Fifo(VecDeque::new()),
        };
        ReadyQueue {
            urgent: VecDeque::new(),
            order,
            workers,
            busy: 0,
            reserved: 0,
            system_workers: 0,
            busy_system: 0,
        }
    }

    /// Gives system items `n` workers of their own beside the shared ones (as HBase's
    /// urgent workers): a system item starts while one of them is free even when every
    /// shared worker runs a long step, and takes a shared worker only when its own are
    /// all busy. Other items never take them.
    pub fn set_system_workers(&mut self, n: usize) {
        self.system_workers = n;
    }

    /// Keeps `n` workers for level 0 of the fair order (trees with under a second of
    /// step time): an item of a higher level is taken only while more than `n` workers
    /// are free. Steps are not preempted, so without a free worker a new tree's step
    /// waits for some running step to end, however long that is; a reserved worker is
    /// free for it unless young trees use it. Clamped below the workers; FIFO ignores
    /// it.
    pub fn set_reserved(&mut self, n: usize) {
        self.reserved = n;
    }

    /// Queues an item of `tree`; `front` for a procedure continuing its steps (FIFO: before
    /// everything queued), otherwise a new, woken or yielding one (FIFO: at the back).
    /// The fair order is in [`Mlfq`]'s docs.
    pub fn push(&mut self, item: T, tree: R, front: bool) {
        match &mut self.order {
            Order::Fair(q) => q.push(item, tree, front),
            Order::Fifo(q) if front => q.push_front(item),
            Order::Fifo(q) => q.push_back(item),
        }
    }

    /// Queues an item of a system procedure (a type registered with
    /// [`Registry::register_system`](crate::Registry::register_system)): it runs before
    /// every other queued item, system items in arrival order, on a system worker
    /// ([`set_system_workers`](ReadyQueue::set_system_workers)) or any shared one,
    /// reserved or not.
    pub fn push_urgent(&mut self, item: T) {
        self.urgent.push_back(item);
    }

    /// The next item to run, if a worker is free for it, and the lane it runs in; it
    /// counts as busy until [`complete`](ReadyQueue::complete) gets that lane back.
    pub fn pop(&mut self) -> Option<(T, Lane)> {
        // System items run on their own workers first: what they take beyond those is
        // taken from the shared ones.
        let shared_busy = self.busy_shared();
        let shared_free = self.workers.saturating_sub(shared_busy);
        if !self.urgent.is_empty() && (shared_free > 0 || self.busy_system < self.system_workers) {
            let item = self.urgent.pop_front()?;
            self.busy += 1;
            self.busy_system += 1;
            return Some((item, Lane::System));
        }
        if shared_free == 0 {
            return None;
        }
        let item = match &mut self.order {
            Order::Fair(q) if shared_free <= self.reserved.min(self.workers - 1) => q.pop_at(0),
            Order::Fair(q) => q.pop(),
            Order::Fifo(q) => q.pop_front(),
        }?;
        self.busy += 1;
        Some((item, Lane::Shared))
    }

    /// A step of `tree` ran for `elapsed_ns` (the fair order's feedback; FIFO ignores
    /// it). Call it before [`complete`](ReadyQueue::complete) frees the worker, so the
    /// next pick already counts the step.
    /// Returns the tree's new level when the step moved it to another one.
    pub fn charge(&mut self, tree: &R, elapsed_ns: u64) -> Option<usize> {
        match &mut self.order {
            Order::Fair(q) => q.charge(tree, elapsed_ns),
            Order::Fifo(_) => None,
        }
    }

    /// `tree` ended: its accumulated time is dropped.
    pub fn forget(&mut self, tree: &R) {
        if let Order::Fair(q) = &mut self.order {
            q.forget(tree);
        }
    }

    /// Changes how many items may run at once (at least 1); items already running
    /// beyond a lowered bound finish normally.
    pub fn set_workers(&mut self, workers: usize) {
        self.workers = workers.max(1);
    }

    /// How many items are queued, system items included.
    pub fn queued(&self) -> usize {
        self.urgent.len()
            + match &self.order {
                Order::Fair(q) => q.len(),
                Order::Fifo(q) => q.len(),
            }
    }

    /// How many items of system procedures are queued.
    pub fn queued_urgent(&self) -> usize {
        self.urgent.len()
    }

    /// How many items are queued on each level, level 0 first: [`LEVELS`](crate::mlfq::LEVELS) entries under
    /// the fair order, one under FIFO (system items not included).
    pub fn queued_by_level(&self) -> Vec<usize> {
        match &self.order {
            Order::Fair(q) => q.queued_by_level(),
            Order::Fifo(q) => vec![q.len()],
        }
    }

    /// How many items run.
    pub fn busy(&self) -> usize {
        self.busy
    }

    /// How many workers only system items take.
    pub fn system_workers(&self) -> usize {
        self.system_workers
    }

    /// How many system items run.
    pub fn busy_system(&self) -> usize {
        self.busy_system
    }

    /// How many of the shared workers are busy (system items count against their own
    /// workers first).
    pub fn busy_shared(&self) -> usize {
        self.busy
            .saturating_sub(self.busy_system.min(self.system_workers))
    }

    /// Of `stuck` running system items, how many count against the shared workers: those
    /// beyond the system workers (a system item counts against its own workers first).
    pub fn system_on_shared(&self, stuck: usize) -> usize {
        stuck.saturating_sub(self.system_workers)
    }

    /// A dispatched item finished; its worker is free. `lane` is what
    /// [`pop`](ReadyQueue::pop) said.
    ///
    /// # Panics
    /// If nothing was dispatched in that lane: that is a bookkeeping bug.
    pub fn complete(&mut self, lane: Lane) {
        assert!(self.busy > 0, "complete() without a dispatched item");
        if lane == Lane::System {
            assert!(
                self.busy_system > 0,
                "complete(System) without a system item"
            );
            self.busy_system -= 1;
        }
        self.busy -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlfq::LEVELS;

    /// Ops: `+N` push back, `^N` push front (item N of tree N), `p` pop (records what
    /// came out), `c` complete. No step time is charged, so both orders agree.
    fn check(workers: usize, script: &str, expected: &str) {
        for scheduling in [Scheduling::Fair, Scheduling::Fifo] {
            let mut q = ReadyQueue::new(workers, scheduling);
            let mut out = Vec::new();
            for op in script.split_whitespace() {
                match op.split_at(1) {
                    ("+", n) => q.push(n.parse::<u32>().unwrap(), 0, false),
                    ("^", n) => q.push(n.parse::<u32>().unwrap(), 0, true),
                    ("p", _) => out.push(q.pop().map_or("-".to_string(), |(n, _)| n.to_string())),
                    ("c", _) => q.complete(Lane::Shared),
                    _ => panic!("bad op {op}"),
                }
            }
            assert_eq!(out.join(" "), expected, "{scheduling:?}: {script}");
        }
    }

    #[test]
    fn fifo_front_and_worker_bound() {
        let cases = [
            (2, "+1 +2 +3 p p p", "1 2 -"),
            (2, "+1 +2 +3 p p c p", "1 2 3"),
            (1, "+1 +2 ^3 p c p c p", "3 1 2"),
            (3, "p +1 p p", "- 1 -"),
            (1, "+1 p c +2 ^1 p c p", "1 1 2"),
        ];
        for (workers, script, expected) in cases {
            check(workers, script, expected);
        }
    }

    /// The same pushes and charges, in both orders: FIFO runs the long tree's
    /// continuing step first; the fair order runs the new tree's step before it.
    #[test]
    fn fair_runs_a_new_tree_before_a_long_one_fifo_does_not() {
        let cases = [
            (Scheduling::Fifo, "long short", 1),
            (Scheduling::Fair, "short long", LEVELS),
        ];
        for (scheduling, expected, levels) in cases {
            let mut q = ReadyQueue::new(1, scheduling);
            q.push("long", 1, false);
            assert_eq!(q.pop(), Some(("long", Lane::Shared)));
            q.charge(&1, 2_000_000_000);
            q.push("short", 2, false);
            q.push("long", 1, true);
            assert_eq!(q.queued_by_level().len(), levels, "{scheduling:?}");
            q.complete(Lane::Shared);
            let mut out = Vec::new();
            while let Some((item, lane)) = q.pop() {
                out.push(item);
                q.complete(lane);
            }
            assert_eq!(out.join(" "), expected, "{scheduling:?}");
        }
    }

    /// Tree 1 has run 2 s (level 1); tree 2 is new. Ops: `oN` push item N of tree 1,
    /// `y` push an item of tree 2, `p` pop, `c` complete.
    #[test]
    fn reserved_workers_go_only_to_young_trees() {
        // (scheduling, workers, reserved, script, popped)
        let cases = [
            // Two of three workers for the old tree; the third waits for a young one.
            (Scheduling::Fair, 3, 1, "o1 o2 o3 p p p y p p", "1 2 - y -"),
            // With two free, the old tree takes one; then the last is kept again.
            (
                Scheduling::Fair,
                3,
                1,
                "o1 o2 o3 o4 p p p c p p",
                "1 2 - 3 -",
            ),
            // Young trees may take every worker.
            (Scheduling::Fair, 2, 1, "y y p p", "y y"),
            // Reserving every worker would starve old trees: one is always left.
            (Scheduling::Fair, 1, 1, "o1 p", "1"),
            (Scheduling::Fair, 2, 5, "o1 o2 p p", "1 -"),
            (Scheduling::Fifo, 3, 1, "o1 o2 o3 p p p", "1 2 3"),
        ];
        for (scheduling, workers, reserved, script, expected) in cases {
            let mut q = ReadyQueue::new(workers, scheduling);
            q.set_reserved(reserved);
            q.push("o0".to_string(), 1, false);
            assert_eq!(q.pop().map(|(s, _)| s).as_deref(), Some("o0"));
            q.charge(&1, 2_000_000_000);
            q.complete(Lane::Shared);
            let mut out = Vec::new();
            for op in script.split_whitespace() {
                match op {
                    "y" => q.push("y".to_string(), 2, false),
                    "p" => out.push(q.pop().map_or("-".to_string(), |(s, _)| s.replace('o', ""))),
                    "c" => q.complete(Lane::Shared),
                    _ => q.push(op.to_string(), 1, false),
                }
            }
            let at = format!("{scheduling:?} workers={workers} reserved={reserved}: {script}");
            assert_eq!(out.join(" "), expected, "{at}");
        }
    }

    /// System items go before everything, in arrival order, under both orders, and
    /// take a reserved worker.
    #[test]
    fn system_items_go_first_and_may_take_a_reserved_worker() {
        for scheduling in [Scheduling::Fair, Scheduling::Fifo] {
            let mut q = ReadyQueue::new(2, scheduling);
            q.set_reserved(1);
            q.push("o0", 1, false);
            assert_eq!(q.pop(), Some(("o0", Lane::Shared)));
            q.charge(&1, 2_000_000_000); // tree 1 is old now
            q.push("old", 1, true);
            q.push("young", 2, false);
            q.push_urgent("s1");
            q.push_urgent("s2");
            assert_eq!((q.queued(), q.queued_urgent()), (4, 2));
            // o0 runs: the one free worker is the reserved one, and s1 takes it.
            let mut out = vec![q.pop()];
            q.complete(Lane::System);
            q.complete(Lane::Shared);
            out.extend([q.pop(), q.pop()]);
            for (_, lane) in out[1..].iter().flatten() {
                q.complete(*lane);
            }
            out.extend([q.pop(), q.pop()]);
            let out: Vec<_> = out.into_iter().map(|p| p.map(|(s, _)| s)).collect();
            let expected = match scheduling {
                Scheduling::Fair => [Some("s1"), Some("s2"), Some("young"), Some("old"), None],
                Scheduling::Fifo => [Some("s1"), Some("s2"), Some("old"), Some("young"), None],
            };
            assert_eq!(out, expected, "{scheduling:?}");
        }
    }

    /// System workers: `s` pushes a system item, `u` a user item (tree 1), `p` pops
    /// (what came out and its lane: `S`ystem or `U`ser), `cs`/`cu` complete one of
    /// that lane.
    #[test]
    fn system_workers_run_system_items_only_and_first() {
        // (workers, system workers, script, popped)
        let cases = [
            // Every shared worker busy: a system item still starts, on its own worker.
            (2, 1, "u u p p s p", "uU uU sS"),
            // Its own worker busy too: the next one waits for a shared worker.
            (2, 1, "u u p p s s p p cu p", "uU uU sS - sS"),
            // A user item never takes a system worker.
            (2, 1, "u u u p p p", "uU uU -"),
            // System items take their own worker first: the shared ones stay for users.
            (2, 1, "s u u p p p", "sS uU uU"),
            // With their own busy, system items take shared workers, and users wait
            // until a shared one is free again; a system item ending on a shared worker
            // frees it for them.
            (2, 1, "s s s u p p p p cs p", "sS sS sS - uU"),
            // Without system workers, system items share the workers.
            (2, 0, "u u p p s p cu p", "uU uU - sS"),
        ];
        for (scheduling, (workers, system, script, expected)) in
            [Scheduling::Fair, Scheduling::Fifo]
                .into_iter()
                .flat_map(|s| cases.iter().map(move |c| (s, *c)))
        {
            let mut q = ReadyQueue::new(workers, scheduling);
            q.set_system_workers(system);
            let mut out = Vec::new();
            for op in script.split_whitespace() {
                match op {
                    "s" => q.push_urgent("s"),
                    "u" => q.push("u", 1, false),
                    "p" => out.push(q.pop().map_or("-".to_string(), |(s, lane)| {
                        let lane = if lane == Lane::System { "S" } else { "U" };
                        format!("{s}{lane}")
                    })),
                    "cs" => q.complete(Lane::System),
                    "cu" => q.complete(Lane::Shared),
                    _ => panic!("bad op {op}"),
                }
            }
            let at = format!("{scheduling:?} workers={workers} system={system}: {script}");
            assert_eq!(out.join(" "), expected, "{at}");
            let running = out.iter().filter(|s| *s != "-").count();
            let completed = script
                .split_whitespace()
                .filter(|o| o.starts_with('c'))
                .count();
            assert_eq!(q.busy(), running - completed, "{at}");
        }
    }

    /// Two system workers: (system items running, stuck ones) → shared workers they
    /// take, stuck ones counted against the shared workers.
    #[test]
    fn system_items_count_against_their_own_workers_first() {
        for (running, stuck, shared, stuck_shared) in
            [(0, 0, 0, 0), (2, 2, 0, 0), (3, 1, 1, 0), (4, 3, 2, 1)]
        {
            let mut q = ReadyQueue::<u32, u32>::new(4, Scheduling::Fair);
            q.set_system_workers(2);
            for i in 0..running {
                q.push_urgent(i);
                assert_eq!(q.pop(), Some((i, Lane::System)));
            }
            assert_eq!(q.busy_shared(), shared, "{running} running");
            assert_eq!((q.busy_system(), q.system_workers()), (running as usize, 2));
            assert_eq!(q.system_on_shared(stuck), stuck_shared, "{stuck} stuck");
        }
    }

    #[test]
    #[should_panic(expected = "without a dispatched item")]
    fn complete_needs_a_dispatch() {
        ReadyQueue::<u32, u32>::new(1, Scheduling::Fair).complete(Lane::Shared);
    }
}
