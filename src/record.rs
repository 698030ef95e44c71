//! The persisted form of a procedure: [`ProcRecord`], and the operations a store applies,
//! [`StoreOp`].
//!
//! A record is a full snapshot: the latest record of a procedure is all recovery needs
//! to rebuild it (its tree position, root-stack indexes, waits and failure), with the
//! user's state as opaque MessagePack bytes decoded through the
//! [`Registry`](crate::Registry).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::num::NonZeroU32;

use serde::{Deserialize, Serialize};

use crate::locks::LockClaim;
use crate::procedure::{FailurePolicy, ProcError, ProcId, ProcState, Undo};

/// Which procedure failed, and why: the result of a failed tree, kept as the root's
/// result through the whole rollback.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("procedure {proc} ({type_name}) failed: {error}")]
pub struct Failure {
    /// The procedure whose step (or abort, or timeout) failed first.
    pub proc: ProcId,
    /// Its registered type name.
    pub type_name: String,
    /// The original error.
    pub error: ProcError,
}

impl Failure {
    /// The error's code, if the step gave it one
    /// ([`ProcError::with_code`](crate::ProcError::with_code)): what a service maps to
    /// its answer without reading the message. Recorded with the failure, so the same
    /// after a restart.
    ///
    /// ```
    /// use proctor::{Failure, ProcError, ProcId};
    /// let failure = Failure {
    ///     proc: ProcId(7),
    ///     type_name: "create_table".into(),
    ///     error: ProcError::with_code("already_exists", "table t1 exists"),
    /// };
    /// let status = match failure.code() {
    ///     Some("already_exists") => 409,
    ///     Some(_) => 400,
    ///     None => 500,
    /// };
    /// assert_eq!(status, 409);
    /// ```
    pub fn code(&self) -> Option<&str> {
        self.error.code()
    }
}

/// A client's key for one submission (HBase's `NonceKey`): a second submit with the
/// same nonce and the same procedure, at the same moment or after a restart, gets the
/// first one's id and runs nothing; one with another procedure or other arguments is
/// refused ([`Error::NonceConflict`](crate::Error::NonceConflict)). `group` separates
/// clients (say, one per client process), `nonce` their requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Nonce {
    /// The client's group.
    pub group: u64,
    /// The request within the group.
    pub nonce: u64,
}

impl Nonce {
    /// The nonce of a client's string key (a request id, an idempotency key): the
    /// 128-bit FNV-1a hash of the key's UTF-8 bytes, its high 64 bits as `group` and its
    /// low 64 bits as `nonce`. The function is fixed: the same key gives the same nonce
    /// in every version of proctor, on every platform, in every process (unlike
    /// `std`'s `DefaultHasher`, whose output may change between Rust releases), so a
    /// client that retries after a restart of either side, with the same key, is
    /// recognised. Two different keys collide with a probability of about 2^-128 each;
    /// FNV is not a cryptographic hash, so keys chosen by an adversary to collide
    /// should be hashed by the client first.
    ///
    /// ```
    /// use proctor::Nonce;
    /// let a = Nonce::from_key("create-table:users:req-7");
    /// assert_eq!(a, Nonce::from_key("create-table:users:req-7"));
    /// assert_ne!(a, Nonce::from_key("create-table:users:req-8"));
    /// ```
    #[must_use]
    pub fn from_key(key: &str) -> Nonce {
        // FNV-1a, 128 bits: the offset basis and prime of the FNV specification.
        const OFFSET: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
        const PRIME: u128 = 0x0000_0000_0100_0000_0000_0000_0000_013b;
        let hash = key
            .bytes()
            .fold(OFFSET, |h, b| (h ^ u128::from(b)).wrapping_mul(PRIME));
        Nonce {
            group: (hash >> 64) as u64,
            nonce: hash as u64,
        }
    }
}

/// One procedure as the store keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProcRecord {
    /// The procedure.
    pub id: ProcId,
    /// Its parent, `None` for a root.
    pub parent: Option<ProcId>,
    /// The root of its tree (itself for a root).
    pub root: ProcId,
    /// The registered type name of `data`: borrowed from the registry when the engine
    /// writes the record (no allocation per record), owned when it is decoded.
    pub type_name: Cow<'static, str>,
    /// Its state when the record was written.
    pub state: ProcState,
    /// Its positions on the root stack, one per executed step not yet rolled back.
    /// Stored as runs of consecutive positions, so the record of a procedure that runs
    /// many steps in a row stays small however long it runs.
    #[serde(with = "stack_runs")]
    pub stack_indexes: Vec<u32>,
    /// Why it failed; for a finished root, why its tree failed. Boxed: most records
    /// have none, and a `Failure` inline would be a quarter of every record.
    pub failure: Option<Box<Failure>>,
    /// For a procedure that failed: the order of its failure among the failures of its
    /// tree (0 for the first), as its root stack recorded them. Recovery takes the
    /// smallest as the tree's result: order comes from the log, never from a clock.
    pub failure_seq: Option<u64>,
    /// When it was submitted, in ms since the Unix epoch.
    pub submitted_ms: u64,
    /// When this record was made, in ms since the Unix epoch.
    pub updated_ms: u64,
    /// For WAITING_TIMEOUT: when to wake, in ms since the Unix epoch.
    pub wake_at_ms: Option<u64>,
    /// For a procedure suspended on an event: the event's name.
    pub event: Option<String>,
    /// The procedure's encoded state.
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// The resources it declared ([`Procedure::locks`](crate::Procedure::locks)) and, for
    /// locks held for its life, whether it holds them. `None` when it declared none.
    /// Last, and defaulted, so records written before it existed still decode.
    #[serde(default)]
    pub locks: Option<LockClaim>,
    /// When its timeout expires, in ms since the Unix epoch (from
    /// [`Procedure::timeout_ms`](crate::Procedure::timeout_ms), or re-armed by
    /// [`Procedure::on_timeout`](crate::Procedure::on_timeout)). Defaulted, last.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// For a root submitted with a nonce: the nonce, kept as long as its record (so a
    /// retried submit finds it after a restart, and not after its result is evicted).
    /// Defaulted, last.
    #[serde(default)]
    pub nonce: Option<Nonce>,
    /// For a root that succeeded: the value its last step set
    /// ([`Context::set_result`](crate::Context::set_result)), MessagePack. Defaulted, last.
    #[serde(default, with = "serde_bytes")]
    pub result: Option<Vec<u8>>,
    /// An operator bypassed it: marked finished without running further or rolling
    /// back. Defaulted, last.
    #[serde(default)]
    pub bypassed: bool,
    /// Failure policies and operators at work on it: retries spent, why it is paused,
    /// its point of no return. Defaulted, last.
    #[serde(default)]
    pub steering: Steering,
    /// For a root submitted with a nonce: the fingerprint of what was submitted (its
    /// registered type name and its initial state), so that a later submit with the
    /// same nonce but another procedure or other arguments is refused
    /// ([`Error::NonceConflict`](crate::Error::NonceConflict)). `None` for a record
    /// without a nonce, a failure recorded for a reserved nonce, and records written
    /// before it existed: a nonce without a fingerprint is never a conflict.
    /// Defaulted, last.
    #[serde(default)]
    pub nonce_fingerprint: Option<NonZeroU32>,
}

/// A root's nonce as the engine carries it from its submit to the root's records: with
/// the fingerprint of the submission ([`ProcRecord::nonce_fingerprint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RootNonce {
    /// The nonce.
    pub nonce: Nonce,
    /// What was submitted with it, if known (see [`fingerprint`]).
    pub fingerprint: Option<NonZeroU32>,
}

/// The fingerprint of a submission: the CRC-32C (Castagnoli) of the length of its
/// registered type name (8 bytes, little-endian), the name's UTF-8 bytes and its
/// encoded initial state, a zero CRC taken as `u32::MAX` (so that it is never zero
/// and an `Option` of it takes no more room than the `u32`). Persisted with the
/// root's nonce, so the function is fixed: the same procedure with the same arguments
/// gives the same fingerprint in every version, on every platform and in every
/// process. Arguments that differ in a run of up to 32 bits always give another
/// fingerprint (a property of the CRC); others share one with a probability of about
/// 2^-32, and are then taken for the same submission, as every submission with a
/// nonce was before fingerprints.
pub(crate) fn fingerprint(type_name: &str, state: &[u8]) -> NonZeroU32 {
    let len = (type_name.len() as u64).to_le_bytes();
    let crc = crc32c::crc32c_append(crc32c::crc32c(&len), type_name.as_bytes());
    let crc = crc32c::crc32c_append(crc, state);
    NonZeroU32::new(crc).unwrap_or(NonZeroU32::MAX)
}

/// What failure policies and operators did to a procedure (see
/// [`FailurePolicy`](crate::FailurePolicy)); all empty for one that never failed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Steering {
    /// Retries of the current step (or rollback step) so far; back to 0 when it
    /// succeeds.
    #[serde(default)]
    pub retries: u32,
    /// Why it is PAUSED or ROLLBACK_PAUSED (boxed: most procedures never pause, and
    /// every record and tree node carries a `Steering`).
    #[serde(default)]
    pub paused: Option<Box<Paused>>,
    /// A recorded step marked itself as the point of no return
    /// ([`Context::set_irreversible`](crate::Context::set_irreversible)).
    #[serde(default)]
    pub irreversible: bool,
    /// Its last step failed and was not recorded, but may have left effects: a rollback
    /// of the procedure undoes it first (as an unrecorded step).
    #[serde(default)]
    pub dirty: bool,
    /// Its last step that started or awaited children was a
    /// [`Flow::WaitAny`](crate::Flow::WaitAny): each child that succeeds wakes it, not only
    /// the last. (Absent from records written before format 3.)
    #[serde(default)]
    pub wakes_per_child: bool,
    /// When its newest recorded step is the one that failed and failed its tree, what
    /// the rollback of that step is told ([`Undo::Failed`](crate::Undo::Failed), or
    /// [`Undo::Interrupted`](crate::Undo::Interrupted) when a crash may have cut off an
    /// earlier attempt); [`Undo::Completed`](crate::Undo::Completed) otherwise, and again
    /// once that rollback succeeds. (Absent from records written before format 5.)
    #[serde(default)]
    pub failed_step: Undo,
}

/// Why a procedure is paused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Paused {
    /// The error of the step (or rollback) that failed; `None` for an operator's pause.
    pub error: Option<ProcError>,
    /// The policy that paused it (`None` for an operator's pause).
    pub policy: Option<FailurePolicy>,
    /// The retries it had spent.
    pub retries: u32,
}

/// The stored form of [`ProcRecord::stack_indexes`]: `(first, count)` runs of
/// consecutive positions. A procedure alone in its tree has one run however many steps
/// it has taken; children interleave their runs with their parent's.
mod stack_runs {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(indexes: &[u32], s: S) -> Result<S::Ok, S::Error> {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &i in indexes {
            match runs.last_mut() {
                Some((first, count)) if first.checked_add(*count) == Some(i) => *count += 1,
                _ => runs.push((i, 1)),
            }
        }
        runs.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        let runs: Vec<(u32, u32)> = Vec::deserialize(d)?;
        super::expand_stack_runs(runs).map_err(serde::de::Error::custom)
    }
}

/// The most steps one procedure records ([`ProcRecord::stack_indexes`]): its next
/// step past them fails the procedure (see `RootStack::on_step`), and a record that
/// claims more is damage, refused before anything is allocated for it. A step recorded
/// costs its tree's stack 8 bytes and the procedure's record 4 bytes until the
/// procedure ends, so this is far past any procedure that finishes, and small enough
/// that a damaged record cannot ask for more memory than a machine has.
#[cfg(not(test))]
pub(crate) const MAX_RECORDED_STEPS: usize = 1 << 24;
/// Small in the crate's unit tests, so that a test reaches it.
#[cfg(test)]
pub(crate) const MAX_RECORDED_STEPS: usize = 1 << 12;

/// The stack positions of `(first, count)` runs, checked as the engine writes them: in
/// increasing order without overlap, at most [`MAX_RECORDED_STEPS`] in all. The error
/// says what is wrong.
pub(crate) fn expand_stack_runs(
    runs: impl IntoIterator<Item = (u32, u32)>,
) -> Result<Vec<u32>, String> {
    let mut indexes: Vec<u32> = Vec::new();
    // The first position the next run may start at.
    let mut next = 0u64;
    for (first, count) in runs {
        let end = u64::from(first) + u64::from(count);
        if u64::from(first) < next || count == 0 {
            return Err(format!(
                "stack run ({first}, {count}) is empty, or not after the run before it"
            ));
        }
        if end > u64::from(u32::MAX) + 1 {
            return Err(format!("stack run ({first}, {count}) goes past u32::MAX"));
        }
        if indexes.len() + count as usize > MAX_RECORDED_STEPS {
            return Err(format!(
                "stack runs of more than {MAX_RECORDED_STEPS} steps"
            ));
        }
        indexes.extend((u64::from(first)..end).map(|i| i as u32));
        next = end;
    }
    Ok(indexes)
}

/// A change to the store. Ops are applied in order; see
/// [`ProcedureStore::append`](crate::ProcedureStore::append) for atomicity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StoreOp {
    /// A new procedure (a submitted root or a child).
    Insert(ProcRecord),
    /// A newer snapshot of a known procedure.
    Update(ProcRecord),
    /// The procedure is gone (a finished tree's children, or an evicted root).
    Delete(ProcId),
}

impl StoreOp {
    /// Replays the op onto the latest record per procedure: inserts and updates replace,
    /// a delete removes.
    pub fn apply_to(self, latest: &mut BTreeMap<ProcId, ProcRecord>) {
        match self {
            StoreOp::Insert(r) | StoreOp::Update(r) => {
                latest.insert(r.id, r);
            }
            StoreOp::Delete(id) => {
                latest.remove(&id);
            }
        }
    }

    /// The procedure the op is about.
    pub fn proc_id(&self) -> ProcId {
        match self {
            StoreOp::Insert(r) | StoreOp::Update(r) => r.id,
            StoreOp::Delete(id) => *id,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Nonce::from_key` is FNV-1a 128 and must never change: these are the FNV
    /// specification's test vectors ("", "a", "foobar") and one key of our own.
    #[test]
    fn a_keys_nonce_is_the_same_in_every_version() {
        let cases = [
            ("", 0x6c62_272e_07bb_0142, 0x62b8_2175_6295_c58d),
            ("a", 0xd228_cb69_6f1a_8caf, 0x7891_2b70_4e4a_8964),
            ("foobar", 0x343e_1662_793c_64bf, 0x6f0d_3597_ba44_6f18),
            (
                "create-table:users:req-7",
                0xb114_42e6_8257_a2af,
                0xee8d_8141_613c_e550,
            ),
        ];
        for (key, group, nonce) in cases {
            assert_eq!(Nonce::from_key(key), Nonce { group, nonce }, "{key:?}");
        }
    }

    /// `fingerprint` is persisted and must never change: it is CRC-32C (its check
    /// value) of the name's length, the name and the state, never zero, and one
    /// fingerprint of our own stays what it was.
    #[test]
    fn a_submissions_fingerprint_is_the_same_in_every_version() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        let crc = |bytes: &[u8]| NonZeroU32::new(crc32c::crc32c(bytes)).unwrap();
        assert_eq!(
            fingerprint("", b"123456789"),
            crc(&[&[0; 8][..], b"123456789"].concat())
        );
        assert_eq!(
            fingerprint("create_table", &[0x81, 0xa1, 0x74, 0x01]).get(),
            FIXED
        );
        // The name and the state are told apart: moving a byte from one to the other
        // is another fingerprint.
        assert_ne!(fingerprint("ab", b"c"), fingerprint("a", b"bc"));
    }

    /// `fingerprint("create_table", {t: 1})`, as the first version computed it.
    const FIXED: u32 = 0x5fcc_7a27;

    fn record(stack: Vec<u32>) -> ProcRecord {
        ProcRecord {
            id: ProcId(2),
            parent: Some(ProcId(1)),
            root: ProcId(1),
            type_name: "t".into(),
            state: ProcState::Runnable,
            stack_indexes: stack,
            failure: None,
            failure_seq: None,
            submitted_ms: 0,
            updated_ms: 0,
            wake_at_ms: None,
            event: None,
            data: vec![],
            locks: None,
            deadline_ms: None,
            nonce: None,
            result: None,
            bypassed: false,
            steering: Default::default(),
            nonce_fingerprint: None,
        }
    }

    #[test]
    fn stack_indexes_round_trip_as_runs() {
        let cases: [Vec<u32>; 4] = [
            vec![],
            vec![0],
            vec![0, 1, 2, 5, 6, 9],
            vec![u32::MAX - 1, u32::MAX],
        ];
        for stack in cases {
            let r = record(stack.clone());
            let bytes = rmp_serde::to_vec_named(&r).unwrap();
            let back: ProcRecord = rmp_serde::from_slice(&bytes).unwrap();
            assert_eq!(back.stack_indexes, stack);
        }
        // Positions only grow: a stack out of order is damage, refused on reading.
        let bytes = rmp_serde::to_vec_named(&record(vec![3, 1, 2])).unwrap();
        let refused = rmp_serde::from_slice::<ProcRecord>(&bytes).unwrap_err();
        assert!(
            refused.to_string().contains("not after the run before it"),
            "{refused}"
        );
    }

    #[test]
    fn a_long_run_of_steps_keeps_the_record_small() {
        let short = rmp_serde::to_vec_named(&record((0..1).collect())).unwrap();
        let long = rmp_serde::to_vec_named(&record((0..10_000).collect())).unwrap();
        // 10 000 steps in a row cost a few bytes more than one, not 40 KB.
        assert!(
            long.len() <= short.len() + 4,
            "{} vs {}",
            long.len(),
            short.len()
        );
    }

    #[test]
    fn absurd_runs_are_refused_not_allocated() {
        #[derive(Serialize)]
        struct Raw {
            stack_indexes: Vec<(u32, u32)>,
        }
        #[derive(Debug, Deserialize)]
        struct Decoded {
            #[serde(with = "stack_runs")]
            #[allow(dead_code)]
            stack_indexes: Vec<u32>,
        }
        // More than a procedure records (one run: a few bytes asking for 16 GiB),
        // overlapping, past u32::MAX, empty.
        let too_long = (0, super::MAX_RECORDED_STEPS as u32 + 1);
        for runs in [
            vec![too_long],
            vec![(0, u32::MAX)],
            vec![(0, 2), (1, 2)],
            vec![(u32::MAX, 2)],
            vec![(5, 0)],
        ] {
            let bytes = rmp_serde::to_vec_named(&Raw {
                stack_indexes: runs,
            })
            .unwrap();
            assert!(rmp_serde::from_slice::<Decoded>(&bytes).is_err());
        }
    }

    #[test]
    #[cfg(target_pointer_width = "64")]
    fn a_record_stays_small() {
        // Recovery moves every record several times, and the memory store keeps one per
        // procedure: the rare fields (a failure) are boxed. 400 bytes before.
        assert!(
            std::mem::size_of::<ProcRecord>() <= 304,
            "{}",
            std::mem::size_of::<ProcRecord>()
        );
        assert!(std::mem::size_of::<StoreOp>() <= 312);
    }

    #[test]
    fn a_failures_marks_round_trip_and_unmarked_failures_keep_their_bytes() {
        // A failure as every version has written it: [7, "t", {"Failed": "x"}].
        let old = [
            0x93, 0x07, 0xa1, b't', 0x81, 0xa6, b'F', b'a', b'i', b'l', b'e', b'd', 0xa1, b'x',
        ];
        let plain = Failure {
            proc: ProcId(7),
            type_name: "t".into(),
            error: ProcError::failed("x"),
        };
        assert_eq!(rmp_serde::from_slice::<Failure>(&old).unwrap(), plain);
        // Unmarked, it is written as before, so an older build reads it.
        assert_eq!(rmp_serde::to_vec(&plain).unwrap(), old);
        for error in [
            ProcError::with_code("already_exists", "table t1 exists"),
            ProcError::retryable(ProcError::Aborted),
            ProcError::terminal(ProcError::failed("no")).coded("bad_request"),
        ] {
            let failure = Failure {
                error: error.clone(),
                ..plain.clone()
            };
            for bytes in [
                rmp_serde::to_vec(&failure).unwrap(),
                rmp_serde::to_vec_named(&failure).unwrap(),
            ] {
                let back: Failure = rmp_serde::from_slice(&bytes).unwrap();
                assert_eq!(back, failure);
                assert_eq!(
                    (back.code(), back.error.kind()),
                    (error.code(), error.kind())
                );
            }
        }
    }

    #[test]
    fn records_written_before_the_locks_field_still_decode() {
        // The record as it was encoded before `locks` existed: the same fields, in order,
        // without the last one.
        #[derive(Serialize)]
        struct Old {
            id: ProcId,
            parent: Option<ProcId>,
            root: ProcId,
            type_name: String,
            state: ProcState,
            stack_indexes: Vec<(u32, u32)>,
            failure: Option<Failure>,
            failure_seq: Option<u64>,
            submitted_ms: u64,
            updated_ms: u64,
            wake_at_ms: Option<u64>,
            event: Option<String>,
            #[serde(with = "serde_bytes")]
            data: Vec<u8>,
        }
        let old = Old {
            id: ProcId(2),
            parent: Some(ProcId(1)),
            root: ProcId(1),
            type_name: "t".into(),
            state: ProcState::Runnable,
            stack_indexes: vec![(0, 2)],
            failure: None,
            failure_seq: None,
            submitted_ms: 0,
            updated_ms: 0,
            wake_at_ms: None,
            event: None,
            data: vec![],
        };
        let expected = record(vec![0, 1]);
        for bytes in [
            rmp_serde::to_vec(&old).unwrap(),
            rmp_serde::to_vec_named(&old).unwrap(),
        ] {
            let back: ProcRecord = rmp_serde::from_slice(&bytes).unwrap();
            assert_eq!(back, expected);
        }
    }
}
