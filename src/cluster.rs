//! The pure rules of a cluster of executors sharing one store: which partition a root
//! belongs to, how its id names that partition, and how the coordinator spreads the
//! partitions over the live executors.
//!
//! A cluster's store is cut into a fixed number of partitions, chosen when the store's
//! cluster is created. Each partition has one owner at a time (an executor, by name) and
//! an epoch that every change of owner bumps: the partition's fencing token. Ids are
//! striped over the partitions: partition `p` of `n` hands out `p`, `p + n`, `p + 2n`, …,
//! so an id names its partition (`id % n`) and no two owners ever hand out the same id.

// Without the PostgreSQL store there are no clusters: only the whole store's stripe.
#![cfg_attr(not(feature = "postgres"), allow(dead_code))]

use crate::procedure::ProcId;

/// Where a cluster's ids come from: the `offset`th of `count` partitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IdStripe {
    pub(crate) offset: u64,
    pub(crate) count: u64,
}

impl IdStripe {
    /// The ids of a store that is not partitioned: 1, 2, 3, …
    pub(crate) const WHOLE: IdStripe = IdStripe {
        offset: 0,
        count: 1,
    };

    /// The stripe of partition `partition` of `count`.
    pub(crate) fn of(partition: u32, count: u32) -> IdStripe {
        IdStripe {
            offset: u64::from(partition),
            count: u64::from(count.max(1)),
        }
    }

    /// The `n`th id of the stripe (`n` ≥ 1).
    pub(crate) fn id(self, n: u64) -> ProcId {
        ProcId(n * self.count + self.offset)
    }

    /// How many ids of the stripe lie at or below `max_id`: the next id is
    /// `id(ordinal(max_id) + 1)`.
    pub(crate) fn ordinal(self, max_id: u64) -> u64 {
        if max_id < self.offset {
            0
        } else {
            (max_id - self.offset) / self.count
        }
    }
}

/// The partition of a root: from its affinity key if it has one (every root with the
/// same key shares a partition, so their entity locks meet in one lock table), else
/// from its nonce (a retry lands where the first submit did), else the caller's choice.
/// The hash is FNV-1a over the key's UTF-8 bytes, mixed: fixed across versions and processes.
pub fn partition_of_key(key: &str, partitions: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // FNV's last bytes reach only its low bits: finish with MurmurHash3's mixer.
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xff51_afd7_ed55_8ccd);
    hash ^= hash >> 33;
    hash = hash.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    hash ^= hash >> 33;
    u32::try_from(hash % u64::from(partitions.max(1))).unwrap_or(0)
}

/// The partition an id of a cluster of `partitions` names.
pub fn partition_of_id(id: ProcId, partitions: u32) -> u32 {
    u32::try_from(id.0 % u64::from(partitions.max(1))).unwrap_or(0)
}

/// A change the coordinator makes to one partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Move {
    /// The partition has no live owner: give it to `to` now (bumping its epoch). Its
    /// last owner's term is over (its membership expired), so it calls no user code.
    Assign { partition: u32, to: String },
    /// Balance: ask the live owner to hand the partition to `to` once it has stopped
    /// its engine for it (the owner bumps the epoch).
    HandOff { partition: u32, to: String },
}

/// One partition as the coordinator reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owned {
    pub(crate) owner: Option<String>,
    /// A hand-off the coordinator asked for and the owner has not made yet.
    pub(crate) wanted: Option<String>,
}

/// The moves that bring `partitions` to the `live` executors (names, any order):
/// every partition whose owner is not live goes to the live executor with the fewest
/// (ties to the smaller name); then, while an executor owns at least two more than the
/// emptiest, one of its partitions is handed to the emptiest — one hand-off per owner at a time, so a rebalance
/// stops one engine of an owner at a time. Pending hand-offs to executors that are no
/// longer live are asked again.
pub(crate) fn plan(partitions: &[Owned], live: &[String]) -> Vec<Move> {
    let mut live: Vec<&str> = live.iter().map(String::as_str).collect();
    live.sort_unstable();
    live.dedup();
    if live.is_empty() {
        return Vec::new();
    }
    let mut load: Vec<(usize, &str)> = live.iter().map(|name| (0, *name)).collect();
    let index = |name: &str| live.binary_search(&name).ok();
    let mut orphans = Vec::new();
    let mut pending_from = vec![false; live.len()];
    for (p, owned) in partitions.iter().enumerate() {
        match owned.owner.as_deref().and_then(index) {
            Some(i) => {
                // A hand-off on its way counts at its destination.
                match owned.wanted.as_deref().and_then(index) {
                    Some(to) => {
                        load[to].0 += 1;
                        pending_from[i] = true;
                    }
                    None => load[i].0 += 1,
                }
            }
            None => orphans.push(p),
        }
    }
    let mut moves = Vec::new();
    let fewest = |load: &[(usize, &str)]| {
        (0..load.len())
            .min_by_key(|&i| (load[i].0, load[i].1))
            .unwrap_or(0)
    };
    for p in orphans {
        let i = fewest(&load);
        load[i].0 += 1;
        moves.push(Move::Assign {
            partition: u32::try_from(p).unwrap_or(u32::MAX),
            to: load[i].1.to_string(),
        });
    }
    // Hand-offs that point at an executor that is not live: point them anew.
    for (p, owned) in partitions.iter().enumerate() {
        let (Some(owner), Some(wanted)) = (owned.owner.as_deref(), owned.wanted.as_deref()) else {
            continue;
        };
        if index(owner).is_some() && index(wanted).is_none() {
            let i = fewest(&load);
            load[i].0 += 1;
            moves.push(Move::HandOff {
                partition: u32::try_from(p).unwrap_or(u32::MAX),
                to: load[i].1.to_string(),
            });
        }
    }
    for (p, owned) in partitions.iter().enumerate() {
        if owned.wanted.is_some() {
            continue;
        }
        let Some(from) = owned.owner.as_deref().and_then(index) else {
            continue;
        };
        let to = fewest(&load);
        if pending_from[from] || load[from].0 < load[to].0 + 2 {
            continue;
        }
        load[from].0 -= 1;
        load[to].0 += 1;
        pending_from[from] = true;
        moves.push(Move::HandOff {
            partition: u32::try_from(p).unwrap_or(u32::MAX),
            to: load[to].1.to_string(),
        });
    }
    moves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn owned(owners: &[Option<&str>]) -> Vec<Owned> {
        owners
            .iter()
            .map(|o| Owned {
                owner: o.map(str::to_string),
                wanted: None,
            })
            .collect()
    }

    fn names(live: &[&str]) -> Vec<String> {
        live.iter().map(|s| (*s).to_string()).collect()
    }

    fn assign(partition: u32, to: &str) -> Move {
        Move::Assign {
            partition,
            to: to.to_string(),
        }
    }

    fn hand_off(partition: u32, to: &str) -> Move {
        Move::HandOff {
            partition,
            to: to.to_string(),
        }
    }

    #[test]
    fn plans() {
        // Name, owners by partition, live members, the moves planned.
        type Case<'a> = (&'a str, Vec<Option<&'a str>>, Vec<&'a str>, Vec<Move>);
        let cases: Vec<Case> = vec![
            ("nobody alive: nothing", vec![None, None], vec![], vec![]),
            (
                "a fresh cluster spreads over the live",
                vec![None, None, None, None],
                vec!["b", "a"],
                vec![
                    assign(0, "a"),
                    assign(1, "b"),
                    assign(2, "a"),
                    assign(3, "b"),
                ],
            ),
            (
                "a dead owner's partitions go to the emptiest",
                vec![Some("a"), Some("b"), Some("c"), Some("c")],
                vec!["a", "b"],
                vec![assign(2, "a"), assign(3, "b")],
            ),
            (
                "balanced: nothing",
                vec![Some("a"), Some("b"), Some("a"), Some("b"), Some("a")],
                vec!["a", "b"],
                vec![],
            ),
            (
                "a newcomer gets one hand-off per owner",
                vec![
                    Some("a"),
                    Some("a"),
                    Some("a"),
                    Some("a"),
                    Some("b"),
                    Some("b"),
                ],
                vec!["a", "b", "c"],
                vec![hand_off(0, "c")],
            ),
            (
                "two full owners each hand one off",
                vec![Some("a"), Some("a"), Some("b"), Some("b")],
                vec!["a", "b", "c", "d"],
                vec![hand_off(0, "c"), hand_off(2, "d")],
            ),
        ];
        for (name, owners, live, expected) in cases {
            assert_eq!(plan(&owned(&owners), &names(&live)), expected, "{name}");
        }
    }

    #[test]
    fn a_pending_hand_off_counts_and_one_to_the_dead_is_pointed_anew() {
        let mut partitions = owned(&[Some("a"), Some("a"), Some("a"), Some("b")]);
        partitions[0].wanted = Some("c".to_string());
        // c is alive: the hand-off is under way, a gives nothing more.
        assert_eq!(plan(&partitions, &names(&["a", "b", "c"])), vec![]);
        // c died: the hand-off goes to the emptiest live executor.
        assert_eq!(
            plan(&partitions, &names(&["a", "b"])),
            vec![hand_off(0, "b")]
        );
    }

    #[test]
    fn every_partition_ends_owned_and_balanced() {
        for n in 1..40usize {
            for members in 1..6usize {
                let live: Vec<String> = (0..members).map(|i| format!("m{i}")).collect();
                let mut partitions = owned(&vec![None; n]);
                // Apply plans until none is left, as the coordinator does.
                for _ in 0..(n * 2 + 2) {
                    let moves = plan(&partitions, &live);
                    if moves.is_empty() {
                        break;
                    }
                    for m in moves {
                        match m {
                            Move::Assign { partition, to } | Move::HandOff { partition, to } => {
                                partitions[partition as usize].owner = Some(to);
                            }
                        }
                    }
                }
                assert!(plan(&partitions, &live).is_empty(), "{n} over {members}");
                let mut counts = vec![0; members];
                for p in &partitions {
                    let owner = p.owner.as_deref().expect("owned");
                    counts[live.iter().position(|l| l == owner).expect("live")] += 1;
                }
                let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
                assert!(hi - lo <= 1, "{n} over {members}: {counts:?}");
            }
        }
    }

    #[test]
    fn ids_name_their_partition() {
        let stripe = IdStripe::of(5, 16);
        assert_eq!(stripe.id(1), ProcId(21));
        assert_eq!(partition_of_id(stripe.id(7), 16), 5);
        assert_eq!(stripe.ordinal(0), 0);
        assert_eq!(stripe.ordinal(21), 1);
        assert_eq!(stripe.ordinal(36), 1);
        assert_eq!(stripe.ordinal(37), 2);
        assert_eq!(
            IdStripe::WHOLE.id(IdStripe::WHOLE.ordinal(41) + 1),
            ProcId(42)
        );
        // Fixed: the same key, the same partition, in every version.
        assert_eq!(
            partition_of_key("table/t1", 64),
            partition_of_key("table/t1", 64)
        );
        let spread: std::collections::HashSet<u32> = (0..200)
            .map(|k| partition_of_key(&format!("res/{k}"), 16))
            .collect();
        assert_eq!(spread.len(), 16);
    }
}
