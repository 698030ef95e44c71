//! Events procedures suspend on (HBase's `ProcedureEvent`): named, with a lifecycle.
//!
//! An event is *ready* or not. A procedure that suspends on a ready event goes on at
//! once; on one that is not ready it waits. [`EventTable::wake`] makes the event ready
//! and hands back its waiters, oldest first; [`EventTable::reset`] makes it not ready
//! again (the next suspension waits). An event that is not ready and has no waiters is
//! not stored at all, so names used once and reset cost nothing; a ready event costs one
//! entry until it is reset.
//!
//! Pure and generic over what a waiter is; the scheduler actor owns one table.

use crate::fast_map::NameHasher;
use std::collections::{HashMap, VecDeque};

#[derive(Debug)]
struct Event<W> {
    ready: bool,
    waiters: VecDeque<W>,
}

/// The table of events. See the module docs.
#[derive(Debug)]
pub struct EventTable<W> {
    events: HashMap<String, Event<W>, NameHasher>,
}

impl<W> Default for EventTable<W> {
    fn default() -> Self {
        EventTable {
            events: HashMap::default(),
        }
    }
}

impl<W> EventTable<W> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Suspends `waiter` on `name`. Returns it back if the event is ready (it goes on at
    /// once); otherwise it waits behind the earlier waiters.
    pub fn suspend(&mut self, name: &str, waiter: W) -> Option<W> {
        match self.events.get_mut(name) {
            Some(e) if e.ready => Some(waiter),
            Some(e) => {
                e.waiters.push_back(waiter);
                None
            }
            None => {
                self.events.insert(
                    name.to_string(),
                    Event {
                        ready: false,
                        waiters: VecDeque::from([waiter]),
                    },
                );
                None
            }
        }
    }

    /// Makes `name` ready and returns its waiters, oldest first.
    pub fn wake(&mut self, name: &str) -> Vec<W> {
        let e = self.events.entry(name.to_string()).or_insert(Event {
            ready: true,
            waiters: VecDeque::new(),
        });
        e.ready = true;
        e.waiters.drain(..).collect()
    }

    /// Makes `name` not ready: later suspensions wait. Its waiters (there are none if
    /// it was ready) keep waiting.
    pub fn reset(&mut self, name: &str) {
        if let Some(e) = self.events.get_mut(name) {
            e.ready = false;
            if e.waiters.is_empty() {
                self.events.remove(name);
            }
        }
    }

    /// Removes `waiter`s matching `f` from `name` (a waiter that stopped waiting for
    /// another reason); frees the event if nothing is left of it.
    pub fn cancel(&mut self, name: &str, f: impl Fn(&W) -> bool) {
        if let Some(e) = self.events.get_mut(name) {
            e.waiters.retain(|w| !f(w));
            if !e.ready && e.waiters.is_empty() {
                self.events.remove(name);
            }
        }
    }

    /// Whether `name` is ready.
    #[cfg(test)]
    pub fn is_ready(&self, name: &str) -> bool {
        self.events.get(name).is_some_and(|e| e.ready)
    }

    /// How many events take memory (ready ones, and ones with waiters).
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// `true` when no event takes memory.
    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A script of calls and what each returns.
    enum Op {
        Suspend(&'static str, u32, Option<u32>),
        Wake(&'static str, &'static [u32]),
        Reset(&'static str),
        Cancel(&'static str, u32),
        Len(usize),
        Ready(&'static str, bool),
    }
    use Op::*;

    #[test]
    fn events_follow_their_lifecycle() {
        let cases: &[(&str, &[Op])] = &[
            (
                "waiters are woken oldest first",
                &[
                    Suspend("e", 1, None),
                    Suspend("e", 2, None),
                    Suspend("e", 3, None),
                    Wake("e", &[1, 2, 3]),
                ],
            ),
            (
                "a ready event lets a suspension through",
                &[
                    Wake("e", &[]),
                    Ready("e", true),
                    Suspend("e", 1, Some(1)),
                    Len(1),
                ],
            ),
            (
                "reset makes it wait again and frees it",
                &[
                    Wake("e", &[]),
                    Reset("e"),
                    Len(0),
                    Ready("e", false),
                    Suspend("e", 1, None),
                    Wake("e", &[1]),
                ],
            ),
            (
                "an event with no waiters that is not ready takes no memory",
                &[Suspend("e", 1, None), Len(1), Cancel("e", 1), Len(0)],
            ),
            (
                "reset keeps waiters waiting",
                &[
                    Suspend("e", 1, None),
                    Reset("e"),
                    Len(1),
                    Wake("e", &[1]),
                    Len(1),
                ],
            ),
            (
                "names are independent",
                &[
                    Suspend("a", 1, None),
                    Suspend("b", 2, None),
                    Wake("b", &[2]),
                    Ready("a", false),
                    Wake("a", &[1]),
                    Reset("a"),
                    Reset("b"),
                    Len(0),
                ],
            ),
        ];
        for (name, ops) in cases {
            let mut t = EventTable::new();
            for (i, op) in ops.iter().enumerate() {
                match *op {
                    Suspend(e, w, expect) => assert_eq!(t.suspend(e, w), expect, "{name} #{i}"),
                    Wake(e, expect) => assert_eq!(t.wake(e), expect, "{name} #{i}"),
                    Reset(e) => t.reset(e),
                    Cancel(e, w) => t.cancel(e, |x| *x == w),
                    Len(n) => assert_eq!(t.len(), n, "{name} #{i}"),
                    Ready(e, r) => assert_eq!(t.is_ready(e), r, "{name} #{i}"),
                }
            }
        }
    }

    #[test]
    fn names_used_and_reset_leave_nothing() {
        let mut t = EventTable::new();
        for i in 0..100_000u32 {
            let name = format!("region-{i}");
            assert_eq!(t.suspend(&name, i), None);
            assert_eq!(t.wake(&name), vec![i]);
            t.reset(&name);
        }
        assert!(t.is_empty());
    }
}
