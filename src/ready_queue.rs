//! The scheduler's ready queue: FIFO with a front for procedures that continue, and a
//! bound on how many steps run at once (the workers).
//!
//! Pure and generic so the rule is unit-tested; the scheduler actor owns one. A later
//! multilevel fair queue replaces the `VecDeque` behind the same three calls.

use std::collections::VecDeque;

/// Queued items and the count of items dispatched but not completed.
#[derive(Debug)]
pub struct ReadyQueue<T> {
    queue: VecDeque<T>,
    workers: usize,
    busy: usize,
}

impl<T> ReadyQueue<T> {
    /// A queue that lets at most `workers` items run at once.
    ///
    /// # Panics
    /// If `workers` is 0.
    pub fn new(workers: usize) -> Self {
        assert!(workers > 0, "a ready queue needs at least one worker");
        ReadyQueue {
            queue: VecDeque::new(),
            workers,
            busy: 0,
        }
    }

    /// Queues an item; `front` puts it before everything queued (a procedure continuing
    /// its steps), otherwise it goes to the back (a new or yielding procedure).
    pub fn push(&mut self, item: T, front: bool) {
        if front {
            self.queue.push_front(item);
        } else {
            self.queue.push_back(item);
        }
    }

    /// The next item to run, if a worker is free; it counts as busy until
    /// [`complete`](ReadyQueue::complete).
    pub fn pop(&mut self) -> Option<T> {
        if self.busy >= self.workers {
            return None;
        }
        let item = self.queue.pop_front()?;
        self.busy += 1;
        Some(item)
    }

    /// Changes how many items may run at once (at least 1); items already running
    /// beyond a lowered bound finish normally.
    pub fn set_workers(&mut self, workers: usize) {
        self.workers = workers.max(1);
    }

    /// How many items are queued.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// How many items run.
    pub fn busy(&self) -> usize {
        self.busy
    }

    /// A dispatched item finished; its worker is free.
    ///
    /// # Panics
    /// If nothing was dispatched: that is a bookkeeping bug.
    pub fn complete(&mut self) {
        assert!(self.busy > 0, "complete() without a dispatched item");
        self.busy -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ops: `+N` push back, `^N` push front, `p` pop (records what came out), `c` complete.
    fn check(workers: usize, script: &str, expected: &str) {
        let mut q = ReadyQueue::new(workers);
        let mut out = Vec::new();
        for op in script.split_whitespace() {
            match op.split_at(1) {
                ("+", n) => q.push(n.parse::<u32>().unwrap(), false),
                ("^", n) => q.push(n.parse::<u32>().unwrap(), true),
                ("p", _) => out.push(q.pop().map_or("-".to_string(), |n| n.to_string())),
                ("c", _) => q.complete(),
                _ => panic!("bad op {op}"),
            }
        }
        assert_eq!(out.join(" "), expected, "{script}");
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

    #[test]
    #[should_panic(expected = "without a dispatched item")]
    fn complete_needs_a_dispatch() {
        ReadyQueue::<u32>::new(1).complete();
    }
}
