//! Hash maps keyed by the engine's own identifiers (procedure ids, type ids): hashed with
//! foldhash rather than SipHash, which cost about 5 % of a step's instructions. The keys
//! are ids the engine assigns, not input an attacker picks; maps keyed by names users
//! give (events, lock resources) keep the standard hasher.

use std::collections::{HashMap, HashSet};

/// The hasher of [`IdMap`] and [`IdSet`]: foldhash, seeded per process (with a fixed
/// seed under the `simulation` feature, so that a seed's run iterates its maps in the
/// same order every time).
#[cfg(not(feature = "simulation"))]
pub(crate) type IdHasher = foldhash::fast::RandomState;
#[cfg(feature = "simulation")]
pub(crate) type IdHasher = foldhash::fast::FixedState;

/// The hasher of maps keyed by names users give (lock resources, events, remote
/// targets): the standard one, randomly keyed; a fixed one under the `simulation`
/// feature, as for [`IdHasher`].
#[cfg(not(feature = "simulation"))]
pub(crate) type NameHasher = std::hash::RandomState;
#[cfg(feature = "simulation")]
pub(crate) type NameHasher = foldhash::quality::FixedState;

/// A `HashMap` keyed by an engine identifier.
pub(crate) type IdMap<K, V> = HashMap<K, V, IdHasher>;

/// A `HashSet` of engine identifiers.
pub(crate) type IdSet<K> = HashSet<K, IdHasher>;

/// A map for the few entries of one procedure tree: a `Vec` sorted by key. Trees are
/// small, ids within a tree are handed out in increasing order (so inserts append), and
/// an idle one-procedure tree should cost one entry, not a hash table's four slots or a
/// `BTreeMap`'s 11-slot leaf (2 KiB for a tree's nodes). Lookups are binary searches.
#[derive(Debug)]
pub(crate) struct SortedMap<K, V>(Vec<(K, V)>);

impl<K, V> Default for SortedMap<K, V> {
    fn default() -> Self {
        SortedMap(Vec::new())
    }
}

impl<K: Ord + Copy, V> SortedMap<K, V> {
    /// An empty map with room for `n` entries.
    pub(crate) fn with_capacity(n: usize) -> Self {
        SortedMap(Vec::with_capacity(n))
    }

    fn position(&self, key: K) -> Result<usize, usize> {
        self.0.binary_search_by_key(&key, |(k, _)| *k)
    }

    pub(crate) fn insert(&mut self, key: K, value: V) -> Option<V> {
        match self.position(key) {
            Ok(i) => Some(std::mem::replace(&mut self.0[i].1, value)),
            Err(i) => {
                // Room for exactly one entry at first: most trees are one procedure, and
                // a `Vec`'s first growth makes room for four.
                if self.0.capacity() == 0 {
                    self.0.reserve_exact(1);
                }
                self.0.insert(i, (key, value));
                None
            }
        }
    }

    pub(crate) fn get(&self, key: &K) -> Option<&V> {
        self.position(*key).ok().map(|i| &self.0[i].1)
    }

    pub(crate) fn get_mut(&mut self, key: &K) -> Option<&mut V> {
        self.position(*key).ok().map(|i| &mut self.0[i].1)
    }

    pub(crate) fn contains_key(&self, key: &K) -> bool {
        self.position(*key).is_ok()
    }

    pub(crate) fn remove(&mut self, key: &K) -> Option<V> {
        let i = self.position(*key).ok()?;
        let (_, value) = self.0.remove(i);
        if self.0.is_empty() {
            // An emptied map keeps no buffer.
            self.0 = Vec::new();
        }
        Some(value)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub(crate) fn clear(&mut self) {
        self.0 = Vec::new();
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.0.iter().map(|(k, v)| (k, v))
    }

    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&K, &mut V)> {
        self.0.iter_mut().map(|(k, v)| (&*k, v))
    }

    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.0.iter_mut().map(|(_, v)| v)
    }
}

impl<K: Ord + Copy, V> Extend<(K, V)> for SortedMap<K, V> {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, entries: I) {
        for (k, v) in entries {
            self.insert(k, v);
        }
    }
}

impl<K: Ord + Copy, V> FromIterator<(K, V)> for SortedMap<K, V> {
    /// Sorts the entries once (a later entry for the same key wins), rather than
    /// inserting them one by one in whatever order they come.
    fn from_iter<I: IntoIterator<Item = (K, V)>>(entries: I) -> Self {
        let mut entries: Vec<(K, V)> = entries.into_iter().collect();
        // Stable: of equal keys, the later entry comes last.
        entries.sort_by_key(|(k, _)| *k);
        let mut out: Vec<(K, V)> = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            match out.last_mut() {
                Some(last) if last.0 == k => last.1 = v,
                _ => out.push((k, v)),
            }
        }
        SortedMap(out)
    }
}

#[cfg(test)]
mod tests {
    use super::SortedMap;

    #[test]
    fn a_sorted_map_keeps_its_keys_in_order_and_sized_for_one() {
        let mut m = SortedMap::default();
        assert_eq!(m.insert(5, "e"), None);
        assert_eq!(m.0.capacity(), 1, "one entry: room for exactly one");
        for (k, v) in [(9, "i"), (1, "a"), (7, "g")] {
            assert_eq!(m.insert(k, v), None);
        }
        assert_eq!(m.insert(7, "G"), Some("g"));
        assert_eq!(m.iter().map(|(k, _)| *k).collect::<Vec<_>>(), [1, 5, 7, 9]);
        assert_eq!((m.get(&7), m.get(&6)), (Some(&"G"), None));
        assert!(m.contains_key(&9) && !m.contains_key(&2));
        if let Some(v) = m.get_mut(&1) {
            *v = "A";
        }
        assert_eq!(m.remove(&1), Some("A"));
        assert_eq!(m.remove(&1), None);
        for k in [5, 7, 9] {
            m.remove(&k);
        }
        assert_eq!(m.0.capacity(), 0, "an emptied map keeps no buffer");
        let m: SortedMap<u32, &str> = [(3, "c"), (1, "a"), (3, "C"), (2, "b")]
            .into_iter()
            .collect();
        assert_eq!(m.0, [(1, "a"), (2, "b"), (3, "C")]);
        let mut m = m;
        m.extend([(0, "z"), (4, "d")]);
        assert_eq!(
            m.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
    }
}
