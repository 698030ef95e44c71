//! The stuck-worker rule (IoTDB's and HBase's worker monitor): when at least half of
//! the configured workers have been inside one step for too long while runnable
//! procedures wait, one more worker is allowed, up to a cap; an extra worker retires
//! once the pool has had an idle worker for a while.
//!
//! Pure: the scheduler actor calls [`Workers::check`] on a timer with what it sees, and
//! applies the answer to its ready queue's worker bound.

/// The rule's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerPolicy {
    /// The configured workers.
    pub base: usize,
    /// The most workers there may be with the extra ones (10 × `base` by default).
    pub max: usize,
    /// How long a worker must have been in one step to count as stuck.
    pub stuck_after_ms: u64,
    /// How long the pool must have had an idle worker before an extra one retires.
    pub retire_after_ms: u64,
}

/// What a check changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    /// Nothing.
    None,
    /// One more worker.
    Added,
    /// One extra worker retired.
    Retired,
}

/// The current worker count and the rule's memory.
#[derive(Debug)]
pub struct Workers {
    policy: WorkerPolicy,
    current: usize,
    idle_since_ms: Option<u64>,
}

impl Workers {
    /// The configured pool, no extra workers.
    pub fn new(policy: WorkerPolicy) -> Self {
        Workers {
            policy,
            current: policy.base,
            idle_since_ms: None,
        }
    }

    /// How many workers there are now.
    pub fn current(&self) -> usize {
        self.current
    }

    /// `true` if a step that started at `started_ms` counts as stuck at `now_ms`.
    pub fn is_stuck(&self, started_ms: u64, now_ms: u64) -> bool {
        now_ms.saturating_sub(started_ms) >= self.policy.stuck_after_ms
    }

    /// One check: `stuck` steps are past the threshold, `busy` workers run steps,
    /// `queued` procedures wait for a worker.
    pub fn check(&mut self, now_ms: u64, stuck: usize, busy: usize, queued: usize) -> Change {
        if queued > 0 && stuck * 2 >= self.policy.base && self.current < self.policy.max {
            self.current += 1;
            self.idle_since_ms = None;
            return Change::Added;
        }
        if self.current <= self.policy.base || busy >= self.current || queued > 0 {
            self.idle_since_ms = None;
            return Change::None;
        }
        let since = *self.idle_since_ms.get_or_insert(now_ms);
        if now_ms.saturating_sub(since) >= self.policy.retire_after_ms {
            self.current -= 1;
            // The next extra worker needs an idle spell of its own.
            self.idle_since_ms = Some(now_ms);
            return Change::Retired;
        }
        Change::None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: WorkerPolicy = WorkerPolicy {
        base: 4,
        max: 6,
        stuck_after_ms: 10_000,
        retire_after_ms: 60_000,
    };

    #[test]
    fn stuck_workers_add_one_at_a_time_and_idle_ones_retire() {
        // (now, stuck, busy, queued) -> (change, workers after)
        type Row = ((u64, usize, usize, usize), (Change, usize));
        let script: &[Row] = &[
            // One stuck of four: not enough.
            ((0, 1, 4, 5), (Change::None, 4)),
            // Half stuck, but nobody waits: nothing to help.
            ((5_000, 2, 4, 0), (Change::None, 4)),
            // Half stuck and runnable procedures wait: one more, then another.
            ((10_000, 2, 4, 3), (Change::Added, 5)),
            ((15_000, 2, 5, 2), (Change::Added, 6)),
            // The cap.
            ((20_000, 4, 6, 2), (Change::None, 6)),
            // Idle capacity starts the clock; a minute later one retires.
            ((30_000, 0, 5, 0), (Change::None, 6)),
            ((89_999, 0, 5, 0), (Change::None, 6)),
            ((90_000, 0, 5, 0), (Change::Retired, 5)),
            // The next needs its own idle minute; busy again resets it.
            ((100_000, 0, 5, 0), (Change::None, 5)),
            ((120_000, 0, 3, 0), (Change::None, 5)),
            ((179_999, 0, 3, 0), (Change::None, 5)),
            ((180_000, 0, 3, 0), (Change::Retired, 4)),
            // Never below the configured count.
            ((500_000, 0, 0, 0), (Change::None, 4)),
        ];
        let mut w = Workers::new(POLICY);
        for (i, &((now, stuck, busy, queued), (change, after))) in script.iter().enumerate() {
            assert_eq!(w.check(now, stuck, busy, queued), change, "#{i}");
            assert_eq!(w.current(), after, "#{i}");
        }
        // Busy without pause keeps the extra worker.
        let mut w = Workers::new(POLICY);
        w.check(0, 2, 4, 1);
        for t in 1..100 {
            assert_eq!(w.check(t * 10_000, 0, 5, 0), Change::None);
        }
        assert_eq!(w.current(), 5);
    }

    #[test]
    fn stuck_means_past_the_threshold() {
        let w = Workers::new(POLICY);
        assert!(!w.is_stuck(1_000, 10_999));
        assert!(w.is_stuck(1_000, 11_000));
        assert!(!w.is_stuck(5_000, 1_000), "a clock step back is not stuck");
    }
}
