//! Hash maps keyed by the engine's own identifiers (procedure ids, type ids): hashed with
//! foldhash rather than SipHash, which cost about 5 % of a step's instructions. The keys
//! are ids the engine assigns, not input an attacker picks; maps keyed by names users
//! give (events, lock resources) keep the standard hasher.

use std::collections::{HashMap, HashSet};

/// The hasher of [`IdMap`] and [`IdSet`]: foldhash, seeded per process.
pub(crate) type IdHasher = foldhash::fast::RandomState;

/// A `HashMap` keyed by an engine identifier.
pub(crate) type IdMap<K, V> = HashMap<K, V, IdHasher>;

/// A `HashSet` of engine identifiers.
pub(crate) type IdSet<K> = HashSet<K, IdHasher>;
