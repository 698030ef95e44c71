//! The multilevel feedback queue behind fair scheduling (in the manner of Trino's
//! `MultilevelSplitQueue`): which queued step runs next, so that trees with little step
//! time behind them are not held up by trees that run long steps.
//!
//! - **Levels.** A tree (a root and all its descendants) is on the level of its
//!   accumulated step time: `[0, 1)` s is level 0, then from 1, 10, 60 and 300 s
//!   ([`LEVEL_THRESHOLD_SECS`]). A step is queued on its tree's level at the time it is
//!   queued.
//! - **Shares.** Each level has a scheduled-time counter (the step time charged to it).
//!   Level `l` is owed `2^-l` of the run time (level 0 weight 1, level 1 weight 1/2, ...:
//!   Trino's `levelTimeMultiplier` of 2), so [`Mlfq::pop`] takes from the non-empty
//!   level whose scheduled time divided by its share is lowest (the lower level on a
//!   tie).
//! - **Starting at the fair share.** When a level becomes non-empty, its counter is
//!   raised to what the others say it should have had (the largest of their counters,
//!   each scaled to level 0's share, scaled back to this level's): a level that was
//!   idle gets no credit to run a burst with, and it is not behind either.
//! - **Cap.** What one step adds to level counters is capped at
//!   [`LEVEL_CONTRIBUTION_CAP_NS`] (30 s, as Trino's per-quantum cap), so one step stuck
//!   for minutes does not shut its level out for minutes. The tree's own accumulated
//!   time counts the whole step. A step that takes its tree across level thresholds is
//!   charged to each level it crossed, up to that level's end, and the rest to the new
//!   one.
//! - **Within a level,** entries go by key, then sequence. A continuing procedure
//!   (`front`: its previous step just ended, or its children did) is keyed by its
//!   tree's accumulated time and goes first among equal keys (the newest such push
//!   first, as the FIFO queue's front). A new or yielding procedure (`back`) is keyed by
//!   the larger of its tree's accumulated time and the largest key a back push of the
//!   level got so far: new and yielding procedures keep FIFO order among themselves (a
//!   yield goes behind every new or yielding procedure already queued on its level),
//!   and are ordered against continuing ones by time.
//!
//! An entry's level and key are fixed when it is queued; a tree whose other procedures
//! run meanwhile is ranked anew at its next push. The accumulated time of a tree is
//! kept from its first push until [`Mlfq::forget`] (its tree ended); a charge for a
//! forgotten tree is dropped, so the map holds only live trees.
//!
//! Pure: the step times come in as parameters. The worker bound lives in
//! [`ReadyQueue`](crate::ready_queue::ReadyQueue), which holds one of these.

use crate::fast_map::IdMap;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::hash::Hash;

/// Where each level starts, in seconds of a tree's accumulated step time.
pub const LEVEL_THRESHOLD_SECS: [u64; 5] = [0, 1, 10, 60, 300];

/// How many levels there are.
pub const LEVELS: usize = LEVEL_THRESHOLD_SECS.len();

/// The most one step adds to the level counters, in nanoseconds (30 s).
pub const LEVEL_CONTRIBUTION_CAP_NS: u64 = 30 * NS_PER_SEC;

const NS_PER_SEC: u64 = 1_000_000_000;

/// Where level `l` starts, in nanoseconds (`u64::MAX` past the last level).
fn threshold_ns(level: usize) -> u64 {
    LEVEL_THRESHOLD_SECS
        .get(level)
        .map_or(u64::MAX, |s| s * NS_PER_SEC)
}

/// The level of a tree that has run `accumulated_ns` of steps.
pub fn level_of(accumulated_ns: u64) -> usize {
    (1..LEVELS)
        .take_while(|&l| accumulated_ns >= threshold_ns(l))
        .last()
        .unwrap_or(0)
}

/// A queued item's place in its level's heap: its rank and its slot in the
/// [`Slab`]. The item itself stays put while the heap reorders (24 bytes moved per
/// sift, not the item's size: a step's item is about 60).
struct Entry {
    key: u64,
    seq: i64,
    slot: u32,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.key, self.seq) == (other.key, other.seq)
    }
}

impl Eq for Entry {}

impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.key, self.seq).cmp(&(other.key, other.seq))
    }
}

/// The queued items, by slot; a freed slot is reused by the next push.
struct Slab<T> {
    slots: Vec<Option<T>>,
    free: Vec<u32>,
}

impl<T> Slab<T> {
    fn insert(&mut self, item: T) -> u32 {
        match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(item);
                slot
            }
            None => {
                let slot = u32::try_from(self.slots.len()).expect("more than 2^32 queued items");
                self.slots.push(Some(item));
                slot
            }
        }
    }

    fn take(&mut self, slot: u32) -> T {
        self.free.push(slot);
        self.slots[slot as usize]
            .take()
            .expect("a queued entry's slot holds its item")
    }
}

struct Level {
    /// Least (key, sequence) first.
    queue: BinaryHeap<Reverse<Entry>>,
    /// Step time charged to this level, in nanoseconds.
    scheduled_ns: u64,
    /// The largest key a back push got on this level.
    back_key: u64,
}

impl Level {
    fn new() -> Self {
        Level {
            queue: BinaryHeap::new(),
            scheduled_ns: 0,
            back_key: 0,
        }
    }

    /// Scheduled time over the level's share, scaled to level 0's share.
    fn normalized(&self, level: usize) -> u128 {
        u128::from(self.scheduled_ns) << level
    }
}

/// Items queued on levels by their tree's accumulated step time; `R` names a tree.
pub struct Mlfq<T, R> {
    levels: Vec<Level>,
    items: Slab<T>,
    /// Accumulated step time of each live tree, in nanoseconds.
    trees: IdMap<R, u64>,
    /// The next back push's sequence (counting up) and front push's (counting down).
    next_back: i64,
    next_front: i64,
    len: usize,
}

impl<T, R> std::fmt::Debug for Mlfq<T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let queued: Vec<usize> = self.levels.iter().map(|l| l.queue.len()).collect();
        let scheduled: Vec<u64> = self.levels.iter().map(|l| l.scheduled_ns).collect();
        f.debug_struct("Mlfq")
            .field("queued", &queued)
            .field("scheduled_ns", &scheduled)
            .field("trees", &self.trees.len())
            .finish()
    }
}

impl<T, R: Hash + Eq> Default for Mlfq<T, R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, R: Hash + Eq> Mlfq<T, R> {
    /// An empty queue.
    pub fn new() -> Self {
        Mlfq {
            levels: (0..LEVELS).map(|_| Level::new()).collect(),
            items: Slab {
                slots: Vec::new(),
                free: Vec::new(),
            },
            trees: IdMap::default(),
            next_back: 0,
            next_front: -1,
            len: 0,
        }
    }

    /// Queues `item`, a step of a procedure of `tree`; `front` for a procedure that
    /// continues its steps, otherwise (new, yielding or woken) behind the new and
    /// yielding ones of its level (see the module docs).
    pub fn push(&mut self, item: T, tree: R, front: bool) {
        let accumulated = *self.trees.entry(tree).or_insert(0);
        let l = level_of(accumulated);
        if self.levels[l].queue.is_empty() {
            self.start_at_fair_share(l);
        }
        let level = &mut self.levels[l];
        let (key, seq) = if front {
            self.next_front -= 1;
            (accumulated, self.next_front + 1)
        } else {
            self.next_back += 1;
            let key = accumulated.max(level.back_key);
            level.back_key = key;
            (key, self.next_back - 1)
        };
        let slot = self.items.insert(item);
        level.queue.push(Reverse(Entry { key, seq, slot }));
        self.len += 1;
    }

    /// The next item: the first of the non-empty level furthest below its share.
    pub fn pop(&mut self) -> Option<T> {
        let l = self.pick()?;
        self.pop_at(l)
    }

    /// The next item of level `l` only (see [`ReadyQueue`](crate::ready_queue::ReadyQueue)'s
    /// reserved workers).
    pub fn pop_at(&mut self, l: usize) -> Option<T> {
        let Reverse(entry) = self.levels.get_mut(l)?.queue.pop()?;
        self.len -= 1;
        Some(self.items.take(entry.slot))
    }

    /// The level [`pop`](Mlfq::pop) takes from: the non-empty one with the lowest
    /// scheduled time over share, the lower level on a tie.
    pub fn pick(&self) -> Option<usize> {
        (0..LEVELS)
            .filter(|&l| !self.levels[l].queue.is_empty())
            .min_by_key(|&l| self.levels[l].normalized(l))
    }

    /// A step of `tree` ran for `elapsed_ns`: adds it to the tree's accumulated time
    /// and (capped) to the level counters. Nothing for a tree not queued since its last
    /// [`forget`](Mlfq::forget). Returns the tree's new level if the step moved it.
    pub fn charge(&mut self, tree: &R, elapsed_ns: u64) -> Option<usize> {
        let accumulated = self.trees.get_mut(tree)?;
        let old = *accumulated;
        let new = old.saturating_add(elapsed_ns);
        *accumulated = new;
        let (from, to) = (level_of(old), level_of(new));
        let mut left = elapsed_ns.min(LEVEL_CONTRIBUTION_CAP_NS);
        for l in from..to {
            let room = threshold_ns(l + 1) - old.max(threshold_ns(l));
            let part = room.min(left);
            self.add_scheduled(l, part);
            left -= part;
        }
        self.add_scheduled(to, left);
        (to != from).then_some(to)
    }

    /// `tree` ended: drops its accumulated time.
    pub fn forget(&mut self, tree: &R) {
        self.trees.remove(tree);
    }

    /// The accumulated step time of `tree`, in nanoseconds (0 for one not known).
    #[cfg(test)]
    fn accumulated_ns(&self, tree: &R) -> u64 {
        self.trees.get(tree).copied().unwrap_or(0)
    }

    /// How many items are queued.
    pub fn len(&self) -> usize {
        self.len
    }

    /// How many items are queued on each level, level 0 first.
    pub fn queued_by_level(&self) -> Vec<usize> {
        self.levels.iter().map(|l| l.queue.len()).collect()
    }

    /// The scheduled-time counter of each level, in nanoseconds.
    #[cfg(test)]
    fn scheduled_ns(&self) -> Vec<u64> {
        self.levels.iter().map(|l| l.scheduled_ns).collect()
    }

    fn add_scheduled(&mut self, level: usize, ns: u64) {
        let s = &mut self.levels[level].scheduled_ns;
        *s = s.saturating_add(ns);
    }

    /// Raises level `l`'s counter to what the busiest level (by its share) implies.
    fn start_at_fair_share(&mut self, l: usize) {
        let level0 = (0..LEVELS)
            .map(|k| self.levels[k].normalized(k))
            .max()
            .unwrap_or(0);
        let expected = u64::try_from(level0 >> l).unwrap_or(u64::MAX);
        let s = &mut self.levels[l].scheduled_ns;
        *s = (*s).max(expected);
    }

    #[cfg(test)]
    fn set_scheduled(&mut self, scheduled: [u64; LEVELS]) {
        for (level, ns) in self.levels.iter_mut().zip(scheduled) {
            level.scheduled_ns = ns;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = NS_PER_SEC;
    const MS: u64 = 1_000_000;

    /// Items stay in their slots while the heap orders the entries; a popped item's
    /// slot is reused, so the slab holds at most as many slots as were ever queued at
    /// once, and every item comes out once, intact, in order.
    #[test]
    fn slots_are_reused_and_items_come_out_whole() {
        let mut q: Mlfq<String, u64> = Mlfq::new();
        let mut out = Vec::new();
        for round in 0..50 {
            for i in 0..3 {
                q.push(format!("{round}-{i}"), 7, false);
            }
            out.extend(q.pop());
            out.extend(q.pop());
        }
        while let Some(item) = q.pop() {
            out.push(item);
        }
        let expected: Vec<String> = (0..50)
            .flat_map(|round| (0..3).map(move |i| format!("{round}-{i}")))
            .collect();
        assert_eq!(out, expected);
        assert_eq!(q.len(), 0);
        // Round r holds r + 3 after its pushes: 52 at most, in the last.
        assert_eq!(q.items.slots.len(), 52);
        assert!(q.items.slots.iter().all(Option::is_none));
    }

    #[test]
    fn levels_by_accumulated_time() {
        let cases = [
            (0, 0),
            (S - 1, 0),
            (S, 1),
            (10 * S - 1, 1),
            (10 * S, 2),
            (59 * S, 2),
            (60 * S, 3),
            (299 * S, 3),
            (300 * S, 4),
            (u64::MAX, 4),
        ];
        for (ns, level) in cases {
            assert_eq!(level_of(ns), level, "{ns} ns");
        }
    }

    /// Which level is picked, given the level counters and which levels hold items.
    #[test]
    fn level_selection() {
        // (scheduled ns per level, occupied levels, picked)
        let cases: [([u64; LEVELS], &[usize], Option<usize>); 10] = [
            ([0; LEVELS], &[], None),
            ([0; LEVELS], &[0, 1, 2], Some(0)),
            ([0; LEVELS], &[3], Some(3)),
            // Level 1 is owed half of level 0: 10 vs 2·6 = 12, level 0 is behind.
            ([10, 6, 0, 0, 0], &[0, 1], Some(0)),
            // 10 vs 2·4 = 8: level 1 is behind.
            ([10, 4, 0, 0, 0], &[0, 1], Some(1)),
            // Exactly at its share: the lower level wins the tie.
            ([10, 5, 0, 0, 0], &[0, 1], Some(0)),
            // Level 4 is owed 1/16: 16·1 = 16 > 15.
            ([15, 0, 0, 0, 1], &[0, 4], Some(0)),
            ([17, 0, 0, 0, 1], &[0, 4], Some(4)),
            // Empty levels do not count, however far behind.
            ([100, 0, 0, 0, 0], &[0, 2], Some(2)),
            ([100, 0, 60, 30, 0], &[0, 2, 3], Some(0)),
        ];
        for (scheduled, occupied, picked) in cases {
            let mut q: Mlfq<usize, u64> = Mlfq::new();
            for &l in occupied {
                // Tree `l` with the accumulated time of level l.
                q.trees.insert(l as u64, threshold_ns(l));
                q.push(l, l as u64, false);
            }
            q.set_scheduled(scheduled);
            assert_eq!(q.pick(), picked, "{scheduled:?} {occupied:?}");
            if let Some(l) = picked {
                assert_eq!(q.pop(), Some(l));
            }
        }
    }

    /// A level that becomes non-empty starts at its fair share, given the others.
    #[test]
    fn a_level_becoming_non_empty_starts_at_its_fair_share() {
        // (counters before, level pushed to, its counter after)
        let cases: [([u64; LEVELS], usize, u64); 6] = [
            // Level 0 ran 8 s: level 1 is owed 4 s, level 2 2 s, level 4 0.5 s.
            ([8 * S, 0, 0, 0, 0], 1, 4 * S),
            ([8 * S, 0, 0, 0, 0], 2, 2 * S),
            ([8 * S, 0, 0, 0, 0], 4, S / 2),
            // The busiest level by share sets the bar: level 2's 4 s is worth 16 s at
            // level 0, so level 0 starts at 16 s.
            ([S, 0, 4 * S, 0, 0], 0, 16 * S),
            // A level already at or above its share keeps its counter.
            ([8 * S, 5 * S, 0, 0, 0], 1, 5 * S),
            ([0; LEVELS], 3, 0),
        ];
        for (before, level, after) in cases {
            let mut q: Mlfq<(), u64> = Mlfq::new();
            q.set_scheduled(before);
            q.trees.insert(1, threshold_ns(level));
            q.push((), 1, false);
            assert_eq!(q.scheduled_ns()[level], after, "{before:?} -> {level}");
            // Once the level holds an item, a second push changes nothing.
            q.set_scheduled(before);
            q.push((), 1, true);
            assert_eq!(q.scheduled_ns(), before.to_vec(), "{before:?}: second push");
        }
    }

    /// What one step adds to the counters: capped, and spread over the levels crossed.
    #[test]
    fn charges_are_capped_and_spread_over_levels() {
        // (tree's time before, step, counters after, tree's time after)
        let cases: [(u64, u64, [u64; LEVELS], u64); 6] = [
            (0, 30 * MS, [30 * MS, 0, 0, 0, 0], 30 * MS),
            (2 * S, 3 * S, [0, 3 * S, 0, 0, 0], 5 * S),
            // Crossing from level 0 to 1: the part below 1 s goes to level 0.
            (900 * MS, 300 * MS, [100 * MS, 200 * MS, 0, 0, 0], 1200 * MS),
            // A 40 s step counts 30 s: 1 s at level 0, 9 s at level 1, 20 s at level 2.
            (0, 40 * S, [S, 9 * S, 20 * S, 0, 0], 40 * S),
            // A 10 minute step from level 2 to 4: 30 s, all within level 2's room of 50 s.
            (5 * S + 5 * S, 600 * S, [0, 0, 30 * S, 0, 0], 610 * S),
            (400 * S, 600 * S, [0, 0, 0, 0, 30 * S], 1000 * S),
        ];
        for (before, step, after, tree_after) in cases {
            let mut q: Mlfq<(), u64> = Mlfq::new();
            q.trees.insert(7, before);
            q.charge(&7, step);
            assert_eq!(q.scheduled_ns(), after.to_vec(), "{before} + {step}");
            assert_eq!(q.accumulated_ns(&7), tree_after);
        }
    }

    #[test]
    fn a_forgotten_tree_is_not_charged_and_not_kept() {
        let mut q: Mlfq<u32, u64> = Mlfq::new();
        q.charge(&1, S);
        assert_eq!((q.trees.len(), q.scheduled_ns()[0]), (0, 0));
        q.push(1, 1, false);
        assert_eq!(q.pop(), Some(1));
        q.charge(&1, S);
        assert_eq!(q.accumulated_ns(&1), S);
        q.forget(&1);
        q.charge(&1, S);
        assert_eq!((q.trees.len(), q.accumulated_ns(&1)), (0, 0));
    }

    /// Ops: `+T` / `^T` push back / front an item of tree T (items are numbered from 1
    /// in push order), `p` pop (records the item), `cT:MS` charge tree T with MS ms.
    fn order(script: &str) -> String {
        let mut q: Mlfq<usize, u32> = Mlfq::new();
        let mut out = Vec::new();
        let mut n = 0;
        for op in script.split_whitespace() {
            match op.split_at(1) {
                ("+", t) | ("^", t) => {
                    n += 1;
                    q.push(n, t.parse().unwrap(), op.starts_with('^'));
                }
                ("p", _) => out.push(q.pop().map_or("-".to_string(), |i| i.to_string())),
                ("c", rest) => {
                    let (t, ms) = rest.split_once(':').unwrap();
                    q.charge(&t.parse().unwrap(), ms.parse::<u64>().unwrap() * MS);
                }
                _ => panic!("bad op {op}"),
            }
        }
        out.join(" ")
    }

    #[test]
    fn order_within_and_across_levels() {
        let cases = [
            // No time charged: FIFO with a front, as the FIFO queue.
            ("+1 +2 ^3 p p p", "3 1 2"),
            ("^1 ^2 p p", "2 1"),
            // A continuing tree with less time goes first.
            ("+1 +2 p p c1:30 c2:10 ^1 ^2 p p", "1 2 4 3"),
            // A new tree (no time) goes before continuing ones with time.
            ("+1 p c1:30 ^1 +2 p p", "1 3 2"),
            // Yields keep FIFO among themselves: two yielders alternate whatever their
            // times (tree 2 has less but yielded later).
            ("+1 +2 p c1:20 +1 p c2:5 +2 p p", "1 2 3 4"),
            // Tree 1's 1.5 s step took it to level 1 (1 s charged to level 0, 0.5 s to
            // level 1: both at their share). Tree 2's new item wins the tie on level 0;
            // after its 10 ms step, level 1 is behind and goes first.
            ("+1 p c1:1500 ^1 +2 p c2:10 ^2 p p", "1 3 2 4"),
            // Level 0 gets twice level 1's time: once tree 1 (on level 1) has run a
            // 400 ms step, tree 2 (on level 0) runs two before tree 1 runs again.
            (
                "+1 p c1:1500 ^1 +2 p c2:400 ^2 p c1:400 ^1 p c2:400 ^2 p p",
                "1 3 2 4 6 5",
            ),
        ];
        for (script, expected) in cases {
            assert_eq!(order(script), expected, "{script}");
        }
    }

    /// Over many steps, the levels get run time in the ratio of their shares.
    #[test]
    fn levels_share_time_by_weight() {
        let mut q: Mlfq<u32, u32> = Mlfq::new();
        // Tree 0 on level 0 and tree 1 on level 1 (both stay: 10 ms steps, and tree 0
        // is forgotten and starts over before it reaches 1 s).
        q.trees.insert(1, 2 * S);
        q.push(0, 0, false);
        q.push(1, 1, false);
        let mut ran = [0u64; 2];
        for _ in 0..3000 {
            let tree = q.pop().unwrap();
            ran[tree as usize] += 1;
            q.charge(&tree, 10 * MS);
            if q.accumulated_ns(&0) > 900 * MS {
                q.forget(&0);
            }
            q.push(tree, tree, true);
        }
        // Level 0 weight 1, level 1 weight 1/2: 2000 and 1000 steps.
        assert!(
            ran[0].abs_diff(2000) <= 5 && ran[1].abs_diff(1000) <= 5,
            "{ran:?}"
        );
    }

    /// `charge` says when a tree changes level, for the listing's `queue_level`.
    #[test]
    fn charge_reports_a_change_of_level() {
        let mut q: Mlfq<u32, u32> = Mlfq::new();
        q.push(1, 7, false);
        let ms = 1_000_000;
        // (charge in ms, the new level it reports)
        let cases = [
            (600, None),
            (600, Some(1)),
            (8_000, None),
            (2_000, Some(2)),
            (0, None),
        ];
        for (charge, expected) in cases {
            assert_eq!(q.charge(&7, charge * ms), expected, "charge {charge} ms");
        }
        assert_eq!(q.charge(&8, ms), None, "a tree never queued");
    }
}
