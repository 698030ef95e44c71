//! The storage trait, [`ProcedureStore`], its in-memory implementation,
//! [`MemoryStore`], and what a store exchanges with the engine: the records it keeps
//! ([`ProcRecord`], with its [`Steering`]), the writes it applies ([`StoreOp`]) and what
//! it loads ([`StoreParts`], [`StoreSnapshot`], [`LastStop`]). For writing a store of
//! your own; [`WalStore`](crate::WalStore) is the one a service uses.
//!
//! The engine talks to storage only through this trait, from one place (the group
//! commit's writer thread), so implementations need no internal concurrency.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::procedure::ProcId;
pub use crate::record::{Paused, ProcRecord, Steering, StoreOp};

/// Why the store failed. Once an append has failed, a store accepts no more appends:
/// after a failed fsync the state of the file is unknown, so carrying on could lose
/// acknowledged steps.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// An IO call failed.
    #[error("{context}: {source}")]
    Io {
        /// What the store was doing, and on which file.
        context: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// Stored bytes are damaged.
    #[error("corrupt store: {file} at byte {offset}: {reason}")]
    Corrupt {
        /// The damaged file.
        file: String,
        /// The offset of the first bad byte or frame.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// Another engine holds the store.
    #[error("the store's lock file {file} is held by another engine")]
    Locked {
        /// The lock file (`DIR/LOCK` for the WAL store).
        file: String,
    },
    /// An earlier append failed; the store refuses further appends.
    #[error("store refuses appends after an earlier failure: {0}")]
    Failed(String),
    /// The database refused or failed a request (the PostgreSQL store): it cannot be
    /// reached, the credentials are wrong, a statement failed, a record does not decode.
    #[error("{context}: {reason}")]
    Database {
        /// What the store was doing.
        context: String,
        /// The database's (or the client's) message.
        reason: String,
    },
    /// A newer leader took the lease: this engine's writes are refused (the PostgreSQL
    /// store's fencing).
    #[error("fenced: the leader lease is at epoch {current}, this engine holds epoch {granted}")]
    Fenced {
        /// The epoch this engine was granted.
        granted: i64,
        /// The lease's epoch now.
        current: i64,
    },
    /// The store's tables were made by a newer version of proctor.
    #[error("the store's schema is version {found}; this proctor reads up to version {supported}")]
    Schema {
        /// The version found.
        found: i32,
        /// The newest version this build knows.
        supported: i32,
    },
}

/// What a store holds: the latest record of every procedure not deleted, and the
/// highest id it has ever seen (deleted ones included), so ids are never reused; plus
/// what the store repaired when it opened.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StoreSnapshot {
    /// Latest record per live procedure, by id.
    pub records: Vec<ProcRecord>,
    /// The highest procedure id ever written, 0 when none.
    pub max_id: u64,
    /// What opening the store changed on disk, one line each naming the file, the byte
    /// offset and what was done (a torn WAL tail truncated, the empty segment of an
    /// interrupted roll removed). Empty when nothing was repaired, and always empty for
    /// [`MemoryStore`]. Only the first `load` after opening reports them.
    pub repairs: Vec<String>,
    /// How the last engine on the store stopped, as far as the store knows.
    pub last_stop: LastStop,
}

/// How the last engine on a store stopped ([`StoreSnapshot::last_stop`]), which tells
/// recovery which procedures may have been in the middle of a step that was never
/// recorded (those get an extra, *unrecorded* rollback should their tree fail before
/// the step runs again).
///
/// ```
/// use proctor::store::{LastStop, MemoryStore, ProcedureStore};
/// let mut store = MemoryStore::new();
/// store.mark_drained(&[]).unwrap(); // a graceful shutdown's last write
/// assert_eq!(store.load().unwrap().last_stop, LastStop::Drained { cut_off: vec![] });
/// store.mark_running().unwrap(); // the next engine's first write
/// assert_eq!(store.load().unwrap().last_stop, LastStop::Unknown);
/// ```
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub enum LastStop {
    /// A crash, a shutdown that cut steps off, an engine still running, or a store
    /// that keeps no mark: any procedure recorded runnable, or waiting for a timer or
    /// an event, may have been in a step.
    #[default]
    Unknown,
    /// A graceful shutdown drained every call into user code and made every report
    /// durable: no step was cut off, but maybe those of `cut_off` — procedures that an
    /// earlier crash may have cut off and that had not run a step since.
    Drained {
        /// The procedures that may still have been cut off by an earlier crash.
        cut_off: Vec<ProcId>,
    },
}

/// [`StoreSnapshot`]'s records split for a recovery on several threads
/// ([`ProcedureStore::load_parts`]): parts that no tree spans (the records that name the
/// same `root` are in one part). Within a part the order is the store's: by id (the
/// default), or by root and then id (the [`WalStore`](crate::WalStore)), which recovery
/// plans without moving a record.
///
/// ```
/// use proctor::{MemoryStore, ProcedureStore};
/// let mut store = MemoryStore::new();
/// let loaded = store.load_parts().unwrap();
/// assert_eq!(loaded.parts.len(), 1); // a store that does not split: one part
/// assert!(loaded.into_snapshot().records.is_empty());
/// ```
#[derive(Debug, Default, Clone, PartialEq)]
pub struct StoreParts {
    /// The latest record per live procedure, in parts.
    pub parts: Vec<Vec<ProcRecord>>,
    /// As [`StoreSnapshot::max_id`].
    pub max_id: u64,
    /// As [`StoreSnapshot::repairs`].
    pub repairs: Vec<String>,
    /// As [`StoreSnapshot::last_stop`].
    pub last_stop: LastStop,
}

impl StoreParts {
    /// The snapshot these parts make: every record, by id.
    pub fn into_snapshot(self) -> StoreSnapshot {
        let mut parts = self.parts;
        let mut records = if parts.len() <= 1 {
            parts.pop().unwrap_or_default()
        } else {
            parts.concat()
        };
        if !records.is_sorted_by_key(|r: &ProcRecord| r.id) {
            records.sort_by_cached_key(|r| r.id);
        }
        StoreSnapshot {
            records,
            max_id: self.max_id,
            repairs: self.repairs,
            last_stop: self.last_stop,
        }
    }
}

impl From<StoreSnapshot> for StoreParts {
    /// One part: the snapshot's records.
    fn from(snapshot: StoreSnapshot) -> StoreParts {
        StoreParts {
            parts: vec![snapshot.records],
            max_id: snapshot.max_id,
            repairs: snapshot.repairs,
            last_stop: snapshot.last_stop,
        }
    }
}

/// Durable storage for procedure records.
///
/// Contract for implementations:
/// - [`append`](ProcedureStore::append) returns only when every op in the call is
///   durable, and it is atomic: after a crash either all of its ops are visible or none.
///   The engine relies on that to insert a parent's update with its new children.
/// - A failed append leaves the store refusing appends ([`StoreError::Failed`]); the
///   engine stops and reports the error rather than acknowledge anything more.
/// - [`load`](ProcedureStore::load) returns the state as of the last successful append.
/// - [`mark_drained`](ProcedureStore::mark_drained) and
///   [`mark_running`](ProcedureStore::mark_running) keep (or knowingly do not keep) the
///   mark of a graceful stop; they have no defaults, so a wrapper cannot drop them.
///
/// A store that wraps another forwards every required method, and the optional ones
/// whose inner behaviour it wants (`load_parts`, `append_owned`, `fence`, `status`):
///
/// ```
/// use proctor::store::{ProcedureStore, StoreError, StoreOp, StoreParts, StoreSnapshot};
/// use proctor::ProcId;
///
/// /// Counts appends, otherwise the inner store's.
/// struct Counting<S> { inner: S, appends: u64 }
///
/// impl<S: ProcedureStore> ProcedureStore for Counting<S> {
///     fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
///         self.appends += 1;
///         self.inner.append(ops)
///     }
///     fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
///         self.inner.load()
///     }
///     fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
///         self.inner.mark_drained(cut_off)
///     }
///     fn mark_running(&mut self) -> Result<(), StoreError> {
///         self.inner.mark_running()
///     }
///     fn load_parts(&mut self) -> Result<StoreParts, StoreError> {
///         self.inner.load_parts()
///     }
///     fn fence(&mut self, epoch: Option<i64>) -> Result<(), StoreError> {
///         self.inner.fence(epoch)
///     }
/// }
/// # let mut store = Counting { inner: proctor::MemoryStore::new(), appends: 0 };
/// # store.mark_drained(&[]).unwrap();
/// # assert!(matches!(store.load().unwrap().last_stop, proctor::store::LastStop::Drained { .. }));
/// ```
///
/// A wrapper that forwards only `append` and `load` does not compile:
///
/// ```compile_fail,E0046
/// use proctor::store::{ProcedureStore, StoreError, StoreOp, StoreSnapshot};
///
/// struct Forgetful(proctor::MemoryStore);
///
/// impl ProcedureStore for Forgetful {
///     fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
///         self.0.append(ops)
///     }
///     fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
///         self.0.load()
///     }
/// }
/// ```
pub trait ProcedureStore: Send + 'static {
    /// Applies `ops` in order, durably and atomically.
    ///
    /// # Errors
    /// [`StoreError::Io`] (or the variant that names the cause) when the ops may not be
    /// durable: after a restart either all of them are visible or none. From then on,
    /// [`StoreError::Failed`] for every append.
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError>;

    /// [`append`](ProcedureStore::append) of a batch the caller gives up: a store may
    /// take the records out of `ops` rather than copy them (the engine's writer calls
    /// this). `ops` is left empty either way, its capacity kept for the caller's next
    /// batch. The default appends and clears.
    ///
    /// # Errors
    /// As [`append`](ProcedureStore::append).
    fn append_owned(&mut self, ops: &mut Vec<StoreOp>) -> Result<(), StoreError> {
        let result = self.append(ops);
        ops.clear();
        result
    }

    /// Reads everything back, for recovery and inspection.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the storage cannot be read, [`StoreError::Corrupt`] (file
    /// and offset) for damage the store cannot repair. An executor does not start on
    /// either ([`Error::Store`](crate::Error::Store)).
    fn load(&mut self) -> Result<StoreSnapshot, StoreError>;

    /// [`load`](ProcedureStore::load) in parts that no tree spans, for a recovery that
    /// plans the parts on several threads (the executor's start). A store that finds
    /// its records on several threads (the [`WalStore`](crate::WalStore)) can hand them
    /// over so, without merging them first. The default is one part, `load`'s records.
    ///
    /// # Errors
    /// As [`load`](ProcedureStore::load).
    fn load_parts(&mut self) -> Result<StoreParts, StoreError> {
        self.load().map(StoreParts::from)
    }

    /// Marks a graceful stop, after the engine's last append: its drain ended every call
    /// into user code and made every report durable, so no step was cut off but maybe
    /// those of `cut_off` (left by an earlier crash). Until the next append or
    /// [`mark_running`](ProcedureStore::mark_running), [`load`](ProcedureStore::load)
    /// reports [`LastStop::Drained`]. Durable when it returns.
    ///
    /// Required, with [`mark_running`](ProcedureStore::mark_running), so that a store
    /// wrapping another (to inject faults, count, trace) cannot forget them: a wrapper
    /// forwards both to its inner store, as the example on the trait shows. A store
    /// that keeps no mark returns `Ok(())` from both and has its `load` report
    /// [`LastStop::Unknown`]: recovery then assumes any waiting or runnable procedure
    /// may have been in a step, which is always safe, and rolls back as after a crash.
    ///
    /// # Errors
    /// As [`append`](ProcedureStore::append); the engine is stopping anyway, and the
    /// next start assumes the worst.
    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError>;

    /// Ends a [`LastStop::Drained`] mark: an engine starts on the store and may run
    /// steps before its first append. The engine calls it, durably, before anything
    /// runs, when its `load` reported a drained stop. (A store whose mark outlived
    /// this call would tell the start after a crash that nothing was cut off.)
    ///
    /// # Errors
    /// As [`append`](ProcedureStore::append); the engine does not start then.
    fn mark_running(&mut self) -> Result<(), StoreError>;

    /// Fences the store's writes with the leader lease's epoch `epoch`: from now on a
    /// write is applied only while the lease still carries it, and is refused
    /// ([`StoreError::Fenced`]) once a newer leader took the lease. `None` writes
    /// unfenced. The executor calls it when it starts as the lease's holder
    /// (`ExecutorBuilder::leadership`). The default refuses: only a store shared by
    /// several engines (the PostgreSQL store) can be fenced.
    ///
    /// # Errors
    /// [`StoreError::Failed`] for a store that cannot be fenced.
    fn fence(&mut self, epoch: Option<i64>) -> Result<(), StoreError> {
        let _ = epoch;
        Err(StoreError::Failed(
            "this store cannot be fenced: leadership needs a store shared by the engines \
             (the PostgreSQL store)"
                .to_string(),
        ))
    }

    /// What the store tells operators about itself now (the admin page's engine view):
    /// its kind and named figures. Asked between appends; must not block on IO. The
    /// default names no figures.
    fn status(&self) -> StoreStatus {
        StoreStatus {
            kind: "custom",
            facts: Vec::new(),
        }
    }
}

/// What a store tells operators about itself ([`ProcedureStore::status`]).
///
/// ```
/// use proctor::ProcedureStore;
/// let status = proctor::MemoryStore::new().status();
/// assert_eq!(status.kind, "memory");
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StoreStatus {
    /// `wal`, `memory`, `postgres`, or a custom store's word for itself.
    pub kind: &'static str,
    /// Named figures, in the order to show them (the WAL's: its segments, their
    /// bytes, the live bytes and the bound on the segments' bytes).
    pub facts: Vec<(&'static str, String)>,
}

impl ProcedureStore for Box<dyn ProcedureStore> {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        (**self).append(ops)
    }

    fn append_owned(&mut self, ops: &mut Vec<StoreOp>) -> Result<(), StoreError> {
        (**self).append_owned(ops)
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        (**self).load()
    }

    fn load_parts(&mut self) -> Result<StoreParts, StoreError> {
        (**self).load_parts()
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        (**self).mark_drained(cut_off)
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        (**self).mark_running()
    }

    fn fence(&mut self, epoch: Option<i64>) -> Result<(), StoreError> {
        (**self).fence(epoch)
    }

    fn status(&self) -> StoreStatus {
        (**self).status()
    }
}

/// A store in memory: nothing survives the process, but clones share one map, so a test
/// can stop an executor and start another on the same store to exercise recovery.
///
/// It keeps each procedure's latest record encoded as the WAL store writes it, so a
/// record costs its encoding (about a hundred bytes for a small state) and what `load`
/// gives back has been through the same codec as a record read from disk.
///
/// ```
/// use proctor::{MemoryStore, ProcedureStore};
/// let mut store = MemoryStore::new();
/// assert!(store.load().unwrap().records.is_empty());
/// ```
#[derive(Clone, Default)]
pub struct MemoryStore {
    inner: Arc<Mutex<MemoryInner>>,
}

impl std::fmt::Debug for MemoryStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f.debug_struct("MemoryStore")
            .field("records", &inner.records.len())
            .field("max_id", &inner.max_id)
            .finish()
    }
}

#[derive(Default)]
struct MemoryInner {
    /// Each live procedure's latest op, encoded as the WAL encodes it (MessagePack,
    /// positional). A record kept so costs its encoding, about a hundred bytes, where a
    /// decoded one costs 300 and its strings; and what `load` returns has been through
    /// the codec a record read back from disk has been through.
    records: BTreeMap<ProcId, Box<[u8]>>,
    max_id: u64,
    last_stop: LastStop,
    /// Where a record is encoded before it is stored.
    scratch: Vec<u8>,
}

impl MemoryInner {
    /// Applies `ops` in order, all or none (an op that does not encode stops the batch
    /// before anything is applied).
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        let scratch = &mut self.scratch;
        let encoded = ops
            .iter()
            .map(|op| match op {
                StoreOp::Insert(r) | StoreOp::Update(r) => {
                    // Encoded into a buffer kept between records, then copied out at
                    // its size: one allocation a record, no growth.
                    scratch.clear();
                    crate::wal::encode_op(op, scratch)
                        .map(|()| Some(Box::<[u8]>::from(scratch.as_slice())))
                        .map_err(|e| StoreError::Io {
                            context: format!("encoding the record of procedure {}", r.id),
                            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
                        })
                }
                StoreOp::Delete(_) => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.last_stop = LastStop::Unknown;
        for (op, bytes) in ops.iter().zip(encoded) {
            let id = op.proc_id();
            self.max_id = self.max_id.max(id.0);
            match bytes {
                Some(bytes) => {
                    self.records.insert(id, bytes);
                }
                None => {
                    self.records.remove(&id);
                }
            }
        }
        Ok(())
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, MemoryInner> {
        // A panic while holding this lock cannot leave the map half-updated in a way
        // that matters more than losing the process would, so poisoning is ignored.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ProcedureStore for MemoryStore {
    fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
        self.lock().append(ops)
    }

    fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
        self.lock().last_stop = LastStop::Drained {
            cut_off: cut_off.to_vec(),
        };
        Ok(())
    }

    fn mark_running(&mut self) -> Result<(), StoreError> {
        self.lock().last_stop = LastStop::Unknown;
        Ok(())
    }

    fn status(&self) -> StoreStatus {
        let inner = self.lock();
        let bytes: usize = inner.records.values().map(|r| r.len()).sum();
        StoreStatus {
            kind: "memory",
            facts: vec![
                ("records", inner.records.len().to_string()),
                ("live_bytes", bytes.to_string()),
            ],
        }
    }

    fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
        let inner = self.lock();
        let records = inner
            .records
            .iter()
            .map(|(id, bytes)| match crate::wal::decode_op(bytes) {
                Ok(StoreOp::Insert(r) | StoreOp::Update(r)) => Ok(r),
                Ok(StoreOp::Delete(_)) | Err(_) => Err(StoreError::Corrupt {
                    file: "memory".into(),
                    offset: 0,
                    reason: format!("the record of procedure {id} does not decode"),
                }),
            })
            .collect::<Result<_, _>>()?;
        Ok(StoreSnapshot {
            records,
            max_id: inner.max_id,
            repairs: Vec::new(),
            last_stop: inner.last_stop.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procedure::ProcState;

    fn record(id: u64, state: ProcState) -> ProcRecord {
        ProcRecord {
            id: ProcId(id),
            parent: None,
            root: ProcId(id),
            type_name: "t".into(),
            state,
            stack_indexes: vec![],
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
    fn latest_record_wins_and_deletes_keep_max_id() {
        let mut store = MemoryStore::new();
        let shared = store.clone();
        store
            .append(&[
                StoreOp::Insert(record(1, ProcState::Runnable)),
                StoreOp::Insert(record(2, ProcState::Runnable)),
                StoreOp::Update(record(1, ProcState::Success)),
                StoreOp::Delete(ProcId(2)),
            ])
            .unwrap();
        let snap = shared.clone().load().unwrap();
        assert_eq!(snap.records, vec![record(1, ProcState::Success)]);
        assert_eq!(snap.max_id, 2);
    }

    /// An owned append applies the same ops as a borrowed one and leaves the batch
    /// empty, its buffer kept.
    #[test]
    fn an_owned_append_takes_the_records() {
        let ops = vec![
            StoreOp::Insert(record(1, ProcState::Runnable)),
            StoreOp::Insert(record(3, ProcState::Runnable)),
            StoreOp::Update(record(1, ProcState::Failed)),
            StoreOp::Delete(ProcId(3)),
        ];
        let mut borrowed = MemoryStore::new();
        borrowed.append(&ops).unwrap();
        let mut owned = MemoryStore::new();
        let mut batch = ops.clone();
        owned.append_owned(&mut batch).unwrap();
        assert!(batch.is_empty() && batch.capacity() >= ops.len());
        let (a, b) = (borrowed.load().unwrap(), owned.load().unwrap());
        assert_eq!((a.records, a.max_id), (b.records, b.max_id));
        // The default, for a store without its own, appends and clears.
        struct Plain(MemoryStore);
        impl ProcedureStore for Plain {
            fn append(&mut self, ops: &[StoreOp]) -> Result<(), StoreError> {
                self.0.append(ops)
            }
            fn load(&mut self) -> Result<StoreSnapshot, StoreError> {
                self.0.load()
            }
            fn mark_drained(&mut self, cut_off: &[ProcId]) -> Result<(), StoreError> {
                self.0.mark_drained(cut_off)
            }
            fn mark_running(&mut self) -> Result<(), StoreError> {
                self.0.mark_running()
            }
        }
        let mut boxed: Box<dyn ProcedureStore> = Box::new(Plain(MemoryStore::new()));
        let mut batch = ops.clone();
        boxed.append_owned(&mut batch).unwrap();
        assert!(batch.is_empty());
        assert_eq!(
            boxed.load().unwrap().records,
            vec![record(1, ProcState::Failed)]
        );
    }
}
